#!/usr/bin/env bash
# GPU check: does the same code run on CUDA? Meant for a lent GPU machine
# (python3 with torch+CUDA, transformers, tokenizers, pytest, ... but no trio,
# quart-trio, hypercorn, pytest-trio, openai or gguf, and no network).
#
#   bash scripts/gpu_check.sh        # from the repo root; writes into $OUT
#
# Needs .whl/ (the wheels the machine lacks; see the list in the steps below)
# beside it. Steps, each under `timeout` and all under one overall deadline
# (GPU_CHECK_BUDGET seconds, default 330):
#   1. install the wheels into /tmp/site; make trioserve importable through a
#      shim (/tmp/tsroot/trioserve/{engine,actors,web} -> this checkout);
#   2. GPU, driver, torch and import report;
#   3. the device-sensitive tests with TRIOSERVE_TEST_DEVICE=cuda
#      (tests/test_cuda_paths.py, tests/test_attention.py,
#      tests/test_model_equivalence.py): junit XML and log in $OUT;
#   4. throughput probe: a random-weight model with SmolLM2-135M's exact
#      shape through EngineCore on CUDA (bf16 and fp32) and transformers
#      generate on CUDA for reference: $OUT/gpu_probe.json;
#   5. `trioserve bench offline` on that model, only if it has a --device option;
#   6. CUDA graphs: decode steps at batch 1 and 64 with and without them
#      (scripts/cuda_graphs_bench.py): $OUT/cuda_graphs.json.
# GPU_CHECK_STEPS="pytest-cuda graphs" runs only the steps named (the
# setup and the machine report always run).
# Exit status: 0 when every step passed, else the number of failed steps.
#
# Dry run on a machine without CUDA (checks the script, not the GPU):
#   GPU_CHECK_DEVICE=cpu GPU_PROBE_SMALL=1 bash scripts/gpu_check.sh
set -o pipefail
START=$SECONDS
BUDGET=${GPU_CHECK_BUDGET:-330}
OUT=${OUT:-/tmp/gpu_check_out}
mkdir -p "$OUT" || exit 1
REPO=$PWD
PY=${PYTHON:-python3}
export GPU_CHECK_DEVICE=${GPU_CHECK_DEVICE:-cuda}
FAILED=()

step() {  # step NAME SECONDS CMD...: run CMD under a timeout capped by the overall deadline
    local name=$1 limit=$2
    shift 2
    if [ -n "${GPU_CHECK_STEPS:-}" ] && ! [[ " nvidia-smi info $GPU_CHECK_STEPS " == *" $name "* ]]; then
        echo "=== [$name] not asked for (GPU_CHECK_STEPS=$GPU_CHECK_STEPS)"
        return 0
    fi
    local left=$((BUDGET - (SECONDS - START)))
    if ((left < 15)); then
        echo "=== [$name] SKIPPED: only ${left}s left of the ${BUDGET}s budget"
        FAILED+=("$name(skipped)")
        return 1
    fi
    ((limit > left)) && limit=$left
    echo "=== [$name] start at +$((SECONDS - START))s, timeout ${limit}s"
    local t0=$SECONDS rc
    timeout -k 10 "$limit" "$@"
    rc=$?
    echo "=== [$name] rc=$rc after $((SECONDS - t0))s$( ((rc == 124 || rc == 137)) && echo ' (TIMED OUT)')"
    ((rc == 0)) || FAILED+=("$name(rc=$rc)")
    return $rc
}

main() {
# --- 1. wheels and the trioserve shim ------------------------------------
echo "=== [setup] $(date -u +%FT%TZ) in $REPO"
rm -rf /tmp/site
if ! timeout 120 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --disable-pip-version-check --target /tmp/site .whl/*.whl; then
    # No pip (or it failed): a wheel is a zip laid out for site-packages.
    echo "pip install failed; unpacking the wheels instead"
    rm -rf /tmp/site
    "$PY" -c 'import glob, zipfile
for w in sorted(glob.glob(".whl/*.whl")):
    zipfile.ZipFile(w).extractall("/tmp/site")' || return 99
fi
# pyproject maps engine/ -> trioserve.engine etc. (no trioserve/__init__.py:
# a namespace package), so symlinks rebuild the installed layout.
rm -rf /tmp/tsroot && mkdir -p /tmp/tsroot/trioserve /tmp/tsroot/trioserve-0.1.0.dist-info || return 99
for pkg in engine actors web bench testing rpc; do ln -s "$REPO/$pkg" "/tmp/tsroot/trioserve/$pkg" || return 99; done
printf 'Metadata-Version: 2.1\nName: trioserve\nVersion: 0.1.0\n' > /tmp/tsroot/trioserve-0.1.0.dist-info/METADATA
export PYTHONPATH=/tmp/site:/tmp/tsroot${PYTHONPATH:+:$PYTHONPATH}
export PYTHONDONTWRITEBYTECODE=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
ls .whl | tr '\n' ' '; echo

# --- 2. machine report and imports ---------------------------------------
cat > /tmp/gpu_info.py <<'EOF'
import importlib, platform, sys
import torch
print("python", sys.version.split()[0], platform.machine())
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
if torch.cuda.is_available():
    print("device", torch.cuda.get_device_name(0), "capability", torch.cuda.get_device_capability(0))
    print("tf32 matmul", torch.backends.cuda.matmul.allow_tf32, "flash", torch.backends.cuda.flash_sdp_enabled(),
          "mem_efficient", torch.backends.cuda.mem_efficient_sdp_enabled())
bad = []
for name in ["transformers", "tokenizers", "safetensors", "attrs", "numpy", "pytest", "hypothesis", "httpx",
             "prometheus_client", "trio", "outcome", "pytest_trio", "quart", "quart_trio", "hypercorn",
             "openai", "pydantic", "gguf", "trioserve.engine.core.engine_core", "trioserve.actors",
             "trioserve.web.cli", "trioserve.web.app"]:
    try:
        mod = importlib.import_module(name)
        print("  ok  ", name, getattr(mod, "__version__", ""), getattr(mod, "__file__", ""))
    except Exception as exc:
        bad.append(name)
        print(f"  FAIL {name}: {type(exc).__name__}: {exc}")
sys.exit(1 if bad else 0)
EOF
step nvidia-smi 30 bash -c 'nvidia-smi -L && nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv'
step info 60 "$PY" /tmp/gpu_info.py

# --- 3. device-sensitive tests on CUDA -----------------------------------
# No -x: one run on the device should report every failure, not the first.
# -v and faulthandler_timeout: a hung test is named, with its stack, in the log.
step pytest-cuda 200 env TRIOSERVE_TEST_DEVICE="$GPU_CHECK_DEVICE" "$PY" -m pytest -p no:cacheprovider -v -rfEs \
    --maxfail=25 --durations=10 -o faulthandler_timeout=120 --junitxml="$OUT/pytest_cuda.xml" \
    -k "not flag" tests/test_cuda_paths.py tests/test_cuda_graphs.py tests/test_attention.py tests/test_model_equivalence.py

# --- 4. throughput probe ---------------------------------------------------
cat > /tmp/gpu_probe.py <<'EOF'
"""EngineCore on CUDA with SmolLM2-135M's exact shape and random weights."""
import json, math, os, statistics, sys, time, traceback
from pathlib import Path

import torch

OUT = Path(os.environ.get("OUT", "/tmp/gpu_check_out"))
DEVICE = os.environ.get("GPU_CHECK_DEVICE", "cuda")
SMALL = bool(os.environ.get("GPU_PROBE_SMALL"))  # a dry run of this script's logic on CPU
FOLDER = Path("/tmp/smollm2-135m-random")
CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
    "vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
    "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64, "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5, "rope_theta": 100000.0, "tie_word_embeddings": True,
    "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16",
}
if SMALL:
    CONFIG["num_hidden_layers"] = 2
report = {"device": DEVICE, "config": CONFIG, "runs": {}, "errors": {}}


def sync():
    if DEVICE.startswith("cuda"):
        torch.cuda.synchronize()


def free():
    if DEVICE.startswith("cuda"):
        torch.cuda.empty_cache()


def save():
    (OUT / "gpu_probe.json").write_text(json.dumps(report, indent=2))


def build_checkpoint():
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    FOLDER.mkdir(parents=True, exist_ok=True)
    c = CONFIG
    g = torch.Generator(device=DEVICE).manual_seed(0)
    hd, h, inter = c["head_dim"], c["hidden_size"], c["intermediate_size"]
    shapes = {"model.embed_tokens.weight": (c["vocab_size"], h), "model.norm.weight": (h,)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes |= {
            p + "self_attn.q_proj.weight": (c["num_attention_heads"] * hd, h),
            p + "self_attn.k_proj.weight": (c["num_key_value_heads"] * hd, h),
            p + "self_attn.v_proj.weight": (c["num_key_value_heads"] * hd, h),
            p + "self_attn.o_proj.weight": (h, c["num_attention_heads"] * hd),
            p + "mlp.gate_proj.weight": (inter, h),
            p + "mlp.up_proj.weight": (inter, h),
            p + "mlp.down_proj.weight": (h, inter),
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
        }
    tensors = {}
    for name, shape in shapes.items():
        if len(shape) == 1:
            t = torch.ones(shape, device=DEVICE)
        else:
            scale = 1.0 if "embed" in name else 1 / math.sqrt(shape[1])
            t = torch.randn(shape, generator=g, device=DEVICE) * scale
        tensors[name] = t.to(torch.bfloat16).cpu()
    save_file(tensors, str(FOLDER / "model.safetensors"), metadata={"format": "pt"})
    (FOLDER / "config.json").write_text(json.dumps(CONFIG))
    words = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, c["vocab_size"])}}
    tok = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>").save_pretrained(str(FOLDER))


def prompts(num, length, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, CONFIG["vocab_size"], (num, length), generator=g).tolist()


def run_engine(loaded, ps, out_len, **fields):
    from trioserve.engine.config import EngineConfig
    from trioserve.engine.core.engine_core import EngineCore
    from trioserve.bench.offline import run_engine as bench_engine

    fields.setdefault("max_model_len", max(len(p) for p in ps) + out_len + 16)
    cores = []

    def make_core():
        cores.append(EngineCore(loaded, EngineConfig(**fields)))
        return cores[-1]

    sync()
    run, decode = bench_engine(make_core, ps, out_len)  # reads sampled tokens each step: synchronised
    full = [dt for n, dt in decode if n == min(len(ps), fields.get("max_num_seqs", 64))]
    result = {
        "requests": len(ps), "input_len": len(ps[0]), "output_len": out_len, "output_tokens": run.output_tokens,
        "expected_tokens": len(ps) * out_len, "seconds": round(run.seconds, 3),
        "output_tok_per_s": round(run.output_tokens_per_s, 1),
        "ms_per_token_single_stream": round(run.per_token_latency_ms, 2) if run.per_token_latency_ms else None,
        "decode_step_ms_median": round(statistics.median(full) * 1000, 2) if full else None,
        "kv_blocks": cores[0].kv_cache.num_blocks, "kv_device": str(cores[0].kv_cache.key.device),
    }
    del cores
    free()
    return result


def timed(name, fn, *args, **kw):
    print(f"--- {name}", flush=True)
    try:
        t = time.perf_counter()
        report["runs"][name] = fn(*args, **kw)
        print(f"    {report['runs'][name]}  ({time.perf_counter() - t:.1f}s)", flush=True)
    except Exception:
        report["errors"][name] = traceback.format_exc()
        print(report["errors"][name], flush=True)
    save()


def hf_generate(ps, out_len, batch):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(FOLDER), dtype=torch.bfloat16).to(DEVICE).eval()
    with torch.inference_mode():
        x = torch.tensor(ps[:1], device=DEVICE)
        model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=4, do_sample=False, pad_token_id=2)
        sync()
        tokens, start = 0, time.perf_counter()
        for i in range(0, len(ps), batch):
            x = torch.tensor(ps[i : i + batch], device=DEVICE)
            y = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=out_len,
                               min_new_tokens=out_len, do_sample=False, pad_token_id=2)
            tokens += (y.shape[1] - x.shape[1]) * y.shape[0]
        sync()
    seconds = time.perf_counter() - start
    del model
    free()
    return {"requests": len(ps), "batch": batch, "output_tokens": tokens, "seconds": round(seconds, 3),
            "output_tok_per_s": round(tokens / seconds, 1)}


def main():
    from trioserve.engine.loading.loader import load_model

    t = time.perf_counter()
    build_checkpoint()
    report["build_seconds"] = round(time.perf_counter() - t, 1)
    t = time.perf_counter()
    bf16 = load_model(str(FOLDER), dtype="bfloat16", device=DEVICE)
    report["load_seconds_bf16"] = round(time.perf_counter() - t, 1)
    k = 16 if SMALL else 1  # fewer and shorter requests in a dry run
    p128 = prompts(256 // k, 128 // k)
    timed("warmup", run_engine, bf16, p128[:2], 8)
    timed("bf16_batch64_128x128", run_engine, bf16, p128[: 64 // k], 128 // k, max_num_seqs=64 // k, max_num_batched_tokens=2048)
    timed("bf16_single_128x128", run_engine, bf16, p128[:1], 128 // k, max_num_seqs=1)
    timed("bf16_batch256_128x128", run_engine, bf16, p128, 128 // k, max_num_seqs=256 // k, max_num_batched_tokens=8192)
    timed("bf16_prefill32x512_one_step", run_engine, bf16, prompts(32 // k, 512 // k, seed=1), 1,
          max_num_seqs=32 // k, max_num_batched_tokens=32 * 512)
    del bf16
    free()
    try:
        fp32 = load_model(str(FOLDER), dtype="float32", device=DEVICE)
        timed("fp32_batch64_128x64", run_engine, fp32, p128[: 64 // k], 64 // k, max_num_seqs=64 // k, max_num_batched_tokens=2048)
        del fp32
        free()
    except Exception:
        report["errors"]["fp32_load"] = traceback.format_exc()
    timed("hf_generate_bf16_static64_128x128", hf_generate, p128[: 64 // k], 128 // k, 64 // k)
    timed("hf_generate_bf16_single_128x64", hf_generate, p128[:1], 64 // k, 1)
    if DEVICE.startswith("cuda"):
        report["max_memory_allocated_GiB"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    save()
    bad = [n for n, r in report["runs"].items() if r.get("output_tokens") != r.get("expected_tokens", r.get("output_tokens"))]
    if bad:
        print("wrong token counts:", bad)
    return 1 if report["errors"] or bad else 0


if __name__ == "__main__":
    sys.exit(main())
EOF
step probe 150 env OUT="$OUT" "$PY" /tmp/gpu_probe.py

# --- 5. bench offline, when it can run on CUDA -----------------------------
BENCH_HELP=$("$PY" -m trioserve.web.cli bench offline --help 2>&1)
if grep -q -- '--device' <<<"$BENCH_HELP"; then
    BENCH_ARGS=(--model /tmp/smollm2-135m-random --device "$GPU_CHECK_DEVICE" --result-json "$OUT/bench_offline.json")
    grep -q -- '--dtype' <<<"$BENCH_HELP" && BENCH_ARGS+=(--dtype bfloat16)
    if [ -n "$GPU_PROBE_SMALL" ]; then
        BENCH_ARGS+=(--num-prompts 4 --input-len 8 --output-len 8 --sequential-prompts 1 --batch-size 4 --prefill-batch 2)
    else
        BENCH_ARGS+=(--num-prompts 64 --input-len 128 --output-len 64 --sequential-prompts 1 --batch-size 64 --prefill-batch 32)
    fi
    step bench-offline 90 "$PY" -m trioserve.web.cli bench offline "${BENCH_ARGS[@]}"
else
    echo "=== [bench-offline] not run: 'trioserve bench offline' has no --device option here (it would load on CPU)"
fi

# --- 6. CUDA graphs against eager decode steps ------------------------------
GRAPH_ARGS=(--device "$GPU_CHECK_DEVICE" --batch-sizes 1,64,256 --out "$OUT/cuda_graphs.json")
[ -n "${GPU_PROBE_SMALL:-}" ] && GRAPH_ARGS+=(--small --rounds 1)
step graphs 150 "$PY" scripts/cuda_graphs_bench.py "${GRAPH_ARGS[@]}"

echo "=== done in $((SECONDS - START))s; failed steps: ${FAILED[*]:-none}"
ls -la "$OUT"
return ${#FAILED[@]}
}

main 2>&1 | tee "$OUT/gpu_check.log"
exit "${PIPESTATUS[0]}"
