#!/usr/bin/env bash
# A non-editable install (pip install .) must carry the C++/CUDA sources and build the native ops
# from them: install the project into a scratch venv that sees the calling environment's torch (a
# .pth naming its site-packages), then build every op from outside the repository, strictly.
set -euo pipefail
cd "$(dirname "$0")/.."
scratch="$(mktemp -d)"
trap 'rm -rf "$scratch"' EXIT
outer="$(python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
python -m venv "$scratch/venv"
inner="$("$scratch/venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
echo "$outer" > "$inner/outer.pth"
"$scratch/venv/bin/pip" install -q .
cd "$scratch"
export TORCH_EXTENSIONS_DIR="$scratch/ext"
"$scratch/venv/bin/python" - <<'PY'
import zfunc, zfunc.ops.builder as b
assert "/venv/" in zfunc.__file__, f"imported {zfunc.__file__}, not the installed wheel"
assert b.CSRC.parent.name == "zfunc" and (b.CSRC / "adam" / "cpu_adam.cpp").is_file(), b.CSRC
print(f"wheel install: sources at {b.CSRC}")
PY
"$scratch/venv/bin/python" -m zfunc.ops --strict
