"""What a chat is, independent of how it is drawn: ``conversation.py`` (turns and the requests built from them),
``settings.py`` (validated, persisted user settings), ``editing.py`` (/edit and /file) and ``history/`` (the
SQLite store, the streaming saver, Markdown export). Never imports Textual or torch.
"""
