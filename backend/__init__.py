"""The in-process inference backend: loading, paged KV cache, speculative decoding engine. Never imports Textual."""
