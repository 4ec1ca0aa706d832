"""Device-specific fast paths the model runner may choose: the CPU native model (``native_model.py`` over the
library ``csrc/`` builds: ``native_build.py`` builds, caches and checks it, ``native.py`` holds it for the
process, ``rope.py`` makes its rotary tables), ``cuda_graphs.py`` (static-shape forwards replayed as
CUDA graphs), ``cpu_linear.py`` (linear layers through oneDNN with pre-packed weights), ``quant_linear.py`` and
``int4_layout.py`` (int4/int8 layers through PyTorch's kernels) and ``compact.py`` (a forward for models with
those layers).
"""

from __future__ import annotations

import os


def switched_off(variable: str) -> bool:
    """Whether the environment turns a fast path off: ``variable`` set to 0, false, no or off."""
    return os.environ.get(variable, "1").strip().lower() in ("0", "false", "no", "off")
