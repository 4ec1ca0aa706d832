"""Loading a pair's models: the entry point (``pair.py``), what loading produces (``loaded.py``), the native path's
weights (``native_loading.py``, ``native_arch.py``), the int4/int8 torch fallback (``quantized.py``, ``skeleton.py``),
draft heads (``head_loading.py``) and keeping library chatter off the terminal (``capture.py``)."""
