"""GGUF files: reading their metadata and tensors (``gguf_file.py``), the architecture and tensor-name tables
(``gguf_arch.py``, ``gguf_tensors.py``), and conversion to transformers files, cached (``gguf_to_hf.py``,
``convert.py``, ``cache_keys.py``)."""
