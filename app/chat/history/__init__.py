"""The chat history, kept in one SQLite file: ``store.py`` (:class:`ChatStore`: the file, its schema and
migrations, recovery from a damaged file, chats and messages), ``records.py`` (the rows it returns, ``StoreError``
and how a reply's statistics are stored), ``saver.py`` (``StreamingSaver``: a reply saved while it streams) and
``export.py`` (a chat rendered and written as Markdown). Imports neither Textual nor torch.
"""
