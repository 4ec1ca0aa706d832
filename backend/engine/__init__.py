"""The engine: owns the models, their paged caches and the conversations, and runs one request at a time.

``engine.py`` (Engine: the lock, conversations and prefix reuse, loading a pair), ``request.py`` (one reply:
prefill, propose, verify, commit), ``runner.py``-level forwards over the paged cache, ``prompting.py`` (chat
templates, fitting the context) and ``detokenize.py`` (incremental text with stop strings).
"""
