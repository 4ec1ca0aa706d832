"""Models, by concern: ``catalog/`` (models.yaml: the pairs, strictly validated), ``gguf/`` (GGUF files and their
conversion), ``hub/`` (Hugging Face downloads), ``loading/`` (target, draft and head with their weights as the
forward path reads them), ``tokenizing/`` (tokenizers and chat formats) and ``facts/`` (what the files say, memory
estimates). ``models.yaml`` here is the packaged catalogue.
"""
