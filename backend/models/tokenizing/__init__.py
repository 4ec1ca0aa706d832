"""Tokenizers and chat formats: the light tokenizer (``light_tokenizer.py``), where replies stop and whether a model
chats (``chat_format.py``), and the draft/target tokenizer check (``tokenizer_check.py``)."""
