"""What the CPU native model covers, as plain constants (no torch): the estimates of `specchat models` read them
without importing torch, and the native model and its loader import them from here.

- :data:`GGML_TYPES`: the GGUF weight types its kernels run as stored (name -> ggml type id).
- :data:`FAMILIES`: the architectures (``model_type``) it runs.
"""

from __future__ import annotations

GGML_TYPES = {"F32": 0, "F16": 1, "Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q5_1": 7, "Q8_0": 8, "Q4_K": 12, "Q5_K": 13,
              "Q6_K": 14, "BF16": 30}  # fmt: skip
FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "phi3")
