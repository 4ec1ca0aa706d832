#!/usr/bin/env bash
# The one prepared check for the GPU device machine (issue 8): CUDA-graph tests, then the synthetic benchmark.
#
# The machine (kind nvidia-h200): Python 3.12, torch 2.11 (cu130), transformers 5.17, no bitsandbytes, no
# platformdirs, no network; at most 64 MiB of working tree plus carried paths travel. The checkout is not
# pip-installed there, and pyproject's package-dir mapping (app/ -> specchat.app, backend/ ->
# specchat.backend) means a plain PYTHONPATH=checkout cannot import `specchat.backend`: this script builds a
# temporary `specchat` package whose files are symlinks to the checkout's specchat/*, app/ and backend/, and
# puts it first on PYTHONPATH.
#
# Preparing the carried wheels (once, on a machine with pip, at the repository root; /.whl/ is git-ignored):
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
#     --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
#     -d .whl bitsandbytes==0.50.2 platformdirs
# bitsandbytes 0.50.2's wheel (41 MiB; carries libbitsandbytes_cuda130.so for torch's cu130) needs torch,
# numpy and packaging, which the machine has; platformdirs is pure Python (config paths). With the tree
# (~2 MiB) that is well under 64 MiB. Without .whl/ the script still runs: the draft is then bf16, not nf4,
# and the JSON's "notes" say so.
#
# Run (device tool): command `bash packaging/device_check.sh`, carry [".whl"], timeout_s 540.
# Environment: OUT (results folder; the device tool sets it), PYTHON (default python3), CHECK_BUDGET_S (whole
# script, default 450 s), SYNTHETIC (default llama3-8b), SYNTHETIC_DEVICE (default cuda), SYNTHETIC_TOKENS
# (new tokens, default the pair's 256).
# Results in $OUT: device_check.log (everything), pytest_cuda.log, synthetic.log, synthetic_<name>.json.
# Exit status: 0 when the tests passed and the benchmark wrote its JSON, else the first failure's status.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${OUT:-$ROOT/device_out}"
PYTHON="${PYTHON:-python3}"
BUDGET="${CHECK_BUDGET_S:-450}"
SYNTHETIC="${SYNTHETIC:-llama3-8b}"
SYNTHETIC_DEVICE="${SYNTHETIC_DEVICE:-cuda}"
mkdir -p "$OUT"
exec > >(tee "$OUT/device_check.log") 2>&1
export PYTHONUNBUFFERED=1
T0=$SECONDS
left() { echo $(( BUDGET - (SECONDS - T0) )); }
step() { printf '\n== [%ss] %s\n' "$((SECONDS - T0))" "$*"; }
status=0

step "carried wheels"
SITE="$(mktemp -d)/site"
if compgen -G "$ROOT/.whl/*.whl" >/dev/null; then
    ls -la "$ROOT"/.whl/
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
        "$ROOT"/.whl/*.whl || { echo "wheel install failed"; status=1; }
else
    echo "no .whl/ folder: running without bitsandbytes (draft in bf16)"
fi

step "importable specchat from the checkout"
PKG="$(mktemp -d)/pkg"
mkdir -p "$PKG/specchat"
for f in "$ROOT"/specchat/*; do ln -s "$f" "$PKG/specchat/"; done
ln -s "$ROOT/app" "$PKG/specchat/app"
ln -s "$ROOT/backend" "$PKG/specchat/backend"
export PYTHONPATH="$PKG:$SITE${PYTHONPATH:+:$PYTHONPATH}"
"$PYTHON" - <<'EOF' || status=1
import importlib, torch, transformers
import specchat.backend.kernels.cuda_graphs as cg
print("specchat.backend from", cg.__file__)
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available(),
      torch.cuda.get_device_name() if torch.cuda.is_available() else "")
print("transformers", transformers.__version__)
for name in ("bitsandbytes", "platformdirs"):
    try:
        m = importlib.import_module(name)
        print(name, getattr(m, "__version__", "?"))
    except Exception as error:
        print(name, "NOT importable:", type(error).__name__, error)
EOF
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv

step "pytest -m cuda (the files that hold cuda tests: CUDA graphs, the int4/int8 tinygemm layers)"
CUDA_TESTS=$(cd "$ROOT" && grep -rl --include='test_*.py' "pytest.mark.cuda" tests)
(cd "$ROOT" && timeout "$(( $(left) < 180 ? $(left) : 180 ))" "$PYTHON" -m pytest -m cuda -q -rs -x \
    -p no:cacheprovider $CUDA_TESTS 2>&1 | tee "$OUT/pytest_cuda.log")
rc=$?; [ $rc -ne 0 ] && { echo "cuda tests: exit $rc"; [ $status -eq 0 ] && status=$rc; }

step "synthetic benchmark $SYNTHETIC on $SYNTHETIC_DEVICE ($(left) s left)"
extra=()
[ -n "${SYNTHETIC_TOKENS:-}" ] && extra=(--max-new-tokens "$SYNTHETIC_TOKENS")
(cd "$ROOT" && timeout "$(( $(left) > 30 ? $(left) : 30 ))" "$PYTHON" -m specchat.app.cli.main bench \
    --synthetic "$SYNTHETIC" --device "$SYNTHETIC_DEVICE" --out "$OUT" "${extra[@]}" 2>&1 | tee "$OUT/synthetic.log")
rc=$?; [ $rc -ne 0 ] && { echo "synthetic bench: exit $rc"; [ $status -eq 0 ] && status=$rc; }
[ -f "$OUT/synthetic_$SYNTHETIC.json" ] || { echo "no synthetic_$SYNTHETIC.json written"; [ $status -eq 0 ] && status=1; }

step "done: exit $status"
exit $status
