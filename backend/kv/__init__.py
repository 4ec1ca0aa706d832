"""The paged KV cache: ``block_pool.py`` (pure-Python block bookkeeping), ``kv_cache.py`` (K/V storage, sequences,
slot plans) and ``attention.py`` (the attention function transformers calls: writes new K/V, attends).
A leaf: imports nothing from the engine or speculation.
"""
