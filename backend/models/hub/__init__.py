"""Hugging Face hub sources: download sizes and fetching repositories (``repos.py``), single GGUF files
(``hub_gguf.py``), and bringing a pair's files here before it loads (``fetch.py``)."""
