"""Conversation history: ``store.py`` (chats and messages in one SQLite file, migrations, recovery from damage,
the streaming saver and Markdown export).
"""
