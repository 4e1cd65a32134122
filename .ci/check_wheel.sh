#!/usr/bin/env bash
# A non-editable install (pip install .) must carry the C++/CUDA sources and build
# the native ops from them: install the project into a scratch venv that sees the
# system's torch, then build every op from outside the repository, strictly.
set -euo pipefail
cd "$(dirname "$0")/.."
scratch="$(mktemp -d)"
trap 'rm -rf "$scratch"' EXIT
python -m venv --system-site-packages "$scratch/venv"
"$scratch/venv/bin/pip" install -q --no-deps .
cd "$scratch"
export TORCH_EXTENSIONS_DIR="$scratch/ext"
"$scratch/venv/bin/python" - <<'PY'
import zfunc, zfunc.ops.builder as b
assert "/venv/" in zfunc.__file__, f"imported {zfunc.__file__}, not the installed wheel"
assert b.CSRC.parent.name == "zfunc" and (b.CSRC / "adam" / "cpu_adam.cpp").is_file(), b.CSRC
print(f"wheel install: sources at {b.CSRC}")
PY
"$scratch/venv/bin/python" -m zfunc.ops --strict
