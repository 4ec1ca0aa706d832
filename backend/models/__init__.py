"""Models: ``config.py`` / ``config_yaml.py`` (models.yaml, strictly validated), ``loading.py`` (target and draft
with their tokenizers), ``hub.py`` (Hugging Face downloads), ``convert.py`` (GGUF), ``memory.py`` (estimates
and free memory) and ``capture.py`` (library output and progress while loading).
"""
