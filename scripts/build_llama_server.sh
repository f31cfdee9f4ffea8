#!/usr/bin/env bash
# Build llama.cpp's llama-server and llama-quantize (CPU only: this machine's CPU
# features, or AVX2 only) for trioserve bench vs-llama and bench real-size,
# from the llama.cpp tree vendored in
# llama-cpp-python's source distribution, outside this repository.
#
#   scripts/build_llama_server.sh --build DIR [--src DIR] [--sdist FILE] [--isa avx2]
#
#   --build DIR   the cmake build folder; the binaries are DIR/bin/llama-server
#                 and DIR/bin/llama-quantize
#   --src DIR     where the llama.cpp sources are extracted (default: the
#                 build folder's sibling llama.cpp-src); its
#                 convert_hf_to_gguf.py is the converter bench real-size runs
#   --sdist FILE  llama_cpp_python-VERSION.tar.gz (default: downloaded with
#                 pip download --no-deps --no-binary :all:)
#   --isa avx2    build for AVX2 + FMA + F16C only (no AVX-512, no VNNI), to
#                 compare on the AVX2 class from a newer CPU, beside trioserve
#                 run with TRIOSERVE_CPU_ASSUME=avx2 and the library caps
#                 (engine/kernels/capability.py); default: this machine's features
#
# Environment: JOBS (parallel compile jobs, default 2), NICE (niceness,
# default 19), LLAMA_CPP_PYTHON_VERSION (default 0.3.36).
#
# Running it again reuses what is there: the sources are extracted again
# only from a different sdist, and ninja rebuilds only what changed. Not part
# of setup.sh or the tests: nothing in the test suite needs llama.cpp.
set -euo pipefail

version="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
jobs="${JOBS:-2}"
niceness="${NICE:-19}"
build="" src="" sdist="" isa="native"
while [ $# -gt 0 ]; do
    case "$1" in
        --build) build="$2"; shift 2 ;;
        --src) src="$2"; shift 2 ;;
        --sdist) sdist="$2"; shift 2 ;;
        --isa) isa="$2"; shift 2 ;;
        -h|--help) sed -n '2,26p' "$0"; exit 0 ;;
        *) echo "build_llama_server.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
done
[ -n "$build" ] || { echo "build_llama_server.sh: --build DIR is required (see --help)" >&2; exit 2; }
case "$isa" in
    native) isa_flags=(-DGGML_NATIVE=ON) ;;
    avx2) isa_flags=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON
                     -DGGML_AVX_VNNI=OFF -DGGML_AVX512=OFF -DGGML_AVX512_VBMI=OFF -DGGML_AVX512_VNNI=OFF
                     -DGGML_AVX512_BF16=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF) ;;
    *) echo "build_llama_server.sh: --isa $isa: expected native or avx2" >&2; exit 2 ;;
esac
for tool in cmake ninja tar; do
    command -v "$tool" >/dev/null || { echo "build_llama_server.sh: $tool is not installed" >&2; exit 2; }
done

mkdir -p "$build"
build="$(cd "$build" && pwd)"
src="${src:-$(dirname "$build")/llama.cpp-src}"
mkdir -p "$src"
src="$(cd "$src" && pwd)"
repo="$(cd "$(dirname "$0")/.." && pwd)"
for dir in "$build" "$src"; do
    case "$dir/" in
        "$repo"/*) echo "build_llama_server.sh: $dir is inside the repository; build outside it" >&2; exit 2 ;;
    esac
done

if [ -z "$sdist" ]; then
    download="$build/../llama-cpp-python-sdist"
    mkdir -p "$download"
    sdist="$download/llama_cpp_python-$version.tar.gz"
    if [ ! -f "$sdist" ]; then
        python3 -m pip download --no-deps --no-binary :all: --dest "$download" "llama-cpp-python==$version"
    fi
fi
[ -f "$sdist" ] || { echo "build_llama_server.sh: no sdist at $sdist" >&2; exit 2; }

top="$(basename "$sdist" .tar.gz)"   # llama_cpp_python-VERSION, the sdist's top folder
sum="$(sha256sum "$sdist" | cut -d' ' -f1)"
if [ "$(cat "$src/.extracted-from" 2>/dev/null)" != "$sum" ]; then
    if [ -n "$(ls -A "$src")" ] && [ ! -f "$src/.extracted-from" ]; then
        echo "build_llama_server.sh: $src is not empty and was not made by this script" >&2; exit 2
    fi
    echo "extracting $top/vendor/llama.cpp into $src"
    find "$src" -mindepth 1 -delete
    nice -n "$niceness" tar xzf "$sdist" -C "$src" --strip-components=3 "$top/vendor/llama.cpp"
    # A submodule's .git file pointing into llama-cpp-python's missing .git: git would only complain.
    [ -f "$src/.git" ] && rm "$src/.git"
    # The sdist has no .git: the llama.cpp commit is in llama-cpp-python's changelog.
    tar xzOf "$sdist" "$top/CHANGELOG.md" \
        | awk -v v="${top#llama_cpp_python-}" '$0 == "## [" v "]" {on=1; next} /^## \[/ {on=0}
              on && !found && match($0, /llama\.cpp@[0-9a-f]+/) {print substr($0, RSTART + 10, RLENGTH - 10); found=1}' \
        > "$src/.llama-cpp-commit"
    echo "$sum" > "$src/.extracted-from"
fi
commit="$(cat "$src/.llama-cpp-commit")"
echo "llama.cpp from ${top}: commit ${commit:-unknown}"

# No network at build time: no curl/OpenSSL, no web UI download (the server
# then runs without its browser UI), only the llama-server target and what
# it links, and llama-quantize (the K-quant and legacy types from a GGUF).
nice -n "$niceness" cmake -S "$src" -B "$build" -G Ninja \
    -DCMAKE_BUILD_TYPE=Release \
    "${isa_flags[@]}" \
    -DGGML_CUDA=OFF -DGGML_VULKAN=OFF -DGGML_METAL=OFF \
    -DBUILD_SHARED_LIBS=OFF \
    -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON \
    -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_APP=OFF \
    -DLLAMA_BUILD_COMMIT="${commit:-unknown}"
start=$(date +%s)
nice -n "$niceness" ninja -C "$build" -j "$jobs" llama-server llama-quantize
echo "built in $(( $(date +%s) - start )) s: $build/bin/llama-server, $build/bin/llama-quantize"
"$build/bin/llama-server" --version
