"""Where a serving process's resident memory goes, stage by stage.

    .venv/bin/python scripts/rss_breakdown.py [--quantization auto] [--requests 500]
        [--max-num-seqs 32] [--max-model-len 512] [--num-threads 2] [--trim]

Goes through what ``trioserve serve`` does at start, in this one process,
and prints VmRSS (and its anonymous and file-backed parts, from
/proc/self/status) after each stage, with the heavy top-level packages
each stage imported:

1. the interpreter, then ``import torch``;
2. the server's modules (``trioserve.web.app``, ``trioserve.web.serve``,
   ``trioserve.actors``), imported as ``trioserve serve`` imports them;
3. the model and tokenizer (``load_model_for``), then the engine core
   (KV pool, warm-up), with the KV pool's mapped and resident bytes (a
   CPU pool commits its pages as blocks are written: engine/layers/kv_cache.py);
4. ``--requests`` plain completions (128 random words in, 16 tokens out,
   greedy), 32 in flight, through ``EngineCore`` (no HTTP; the core trims
   the heap when it goes idle at the end, unless ``--no-heap-trim``);
5. with ``--trim``, after each stage, glibc's ``malloc_trim(0)`` and
   the RSS again: what glibc held freed but had not returned.

Each stage's delta is what it added; the stages' packages say what a plain
completion imported that it may not need. Engine options mirror
``trioserve serve``'s (``--quantization``, ``--kv-cache-dtype``, ...).
"""

from __future__ import annotations

import argparse
import ctypes
import random
import sys
import time
import traceback

# Top-level packages worth naming when a stage imports them (the rest are small).
HEAVY = (
    "torch",
    "numpy",
    "transformers",
    "tokenizers",
    "xgrammar",
    "triton",
    "opentelemetry",
    "grpc",
    "playwright",
    "matplotlib",
    "gguf",
    "safetensors",
    "jinja2",
    "quart",
    "quart_trio",
    "hypercorn",
    "httpx",
    "sympy",
    "scipy",
    "pandas",
    "PIL",
    "huggingface_hub",
    "sentencepiece",
)


def memory() -> dict[str, int]:
    """VmRSS, RssAnon, RssFile and VmHWM of this process, in MiB."""
    values = {}
    with open("/proc/self/status") as status:
        for line in status:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "RssAnon", "RssFile", "VmHWM"):
                values[key] = int(rest.split()[0]) >> 10
    return values


class Stages:
    """Prints one line per stage: RSS, its delta, and newly imported heavy packages."""

    def __init__(self, trim: bool = False) -> None:
        self.trim = trim
        self.last = memory()["VmRSS"]
        self.modules = set(sys.modules)
        print(f"{'stage':<34} {'RSS':>6} {'delta':>6} {'anon':>6} {'file':>6} {'peak':>6}  new heavy packages")

    def mark(self, name: str) -> None:
        now = memory()
        new = set(sys.modules) - self.modules
        heavy = sorted({m.split(".")[0] for m in new} & set(HEAVY))
        submodules = sorted(m for m in new if m.startswith("torch.") and m.count(".") == 1)
        print(
            f"{name:<34} {now['VmRSS']:>6} {now['VmRSS'] - self.last:>+6} {now['RssAnon']:>6} "
            f"{now['RssFile']:>6} {now['VmHWM']:>6}  {' '.join(heavy)} ({len(new)} modules"
            + (f"; torch: {' '.join(s[6:] for s in submodules[:12])}" if submodules else "")
            + ")",
            flush=True,
        )
        self.last = now["VmRSS"]
        self.modules = set(sys.modules)
        if self.trim:
            # What glibc holds freed but not returned (fragmentation, arena tops).
            start = time.perf_counter()
            ctypes.CDLL(None).malloc_trim(0)
            took = (time.perf_counter() - start) * 1e3
            trimmed = memory()["VmRSS"]
            print(f"{'  after malloc_trim(0)':<34} {trimmed:>6} {trimmed - self.last:>+6}  ({took:.1f} ms)", flush=True)
            self.last = trimmed


def trace_imports(names: set[str]) -> None:
    """Print where each of ``names`` is first imported (an audit hook: it
    sees imports from every thread and every importer)."""
    seen: set[str] = set()

    def hook(event: str, args: tuple) -> None:
        if event == "import" and args[0] in names and args[0] not in seen:
            seen.add(args[0])
            frames = [f for f in traceback.extract_stack()[:-1] if not f.filename.startswith("<frozen")]
            where = " <- ".join(f"{f.filename.rsplit('site-packages/', 1)[-1]}:{f.lineno}" for f in reversed(frames[-8:]))
            print(f"  import {args[0]}: {where}", flush=True)

    sys.addaudithook(hook)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 2)[2])
    parser.add_argument("--model", default=None, help="model (default: the default model's GGUF)")
    parser.add_argument("--quantization", default="auto", help="auto, none, int8 or int4 (default auto)")
    parser.add_argument("--kv-cache-dtype", default="auto")
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--num-threads", type=int, default=2)
    parser.add_argument("--requests", type=int, default=500, help="plain completions to run (0: none)")
    parser.add_argument("--in-flight", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--trim", action="store_true", help="after each stage, call malloc_trim(0) and report RSS again")
    parser.add_argument(
        "--no-heap-trim",
        action="store_true",
        help="the engine's own heap trims (at start, when idle) off: what RSS was without them",
    )
    parser.add_argument("--trace-imports", default="", help="comma-separated modules: print where each is first imported")
    args = parser.parse_args()
    if args.trace_imports:
        trace_imports(set(args.trace_imports.split(",")))

    stages = Stages(trim=args.trim)
    stages.mark("python")
    import torch  # noqa: F401

    stages.mark("import torch")
    import trioserve.web.app  # noqa: F401
    import trioserve.web.serve  # noqa: F401

    stages.mark("import web.app, web.serve")
    import trioserve.actors  # noqa: F401

    stages.mark("import actors")
    from trioserve.bench.datasets import random_words
    from trioserve.engine.config import EngineConfig
    from trioserve.engine.core.engine_core import EngineCore
    from trioserve.engine.loading.loader import load_model_for
    from trioserve.engine.sampling.sampling_params import SamplingParams

    stages.mark("import engine_core, loader")
    if args.no_heap_trim:
        import trioserve.engine.core.engine_core as engine_core

        engine_core.trim_heap = lambda: False
    config = EngineConfig(
        model=args.model,
        quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
        num_threads=args.num_threads,
    )
    loaded = load_model_for(config)
    stages.mark("load model + tokenizer")
    weights = sum(p.numel() * p.element_size() for p in loaded.model.parameters())
    embedding = getattr(loaded.model, "_embedding", None)
    compressed = f", compressed embeddings {embedding.nbytes >> 20} MiB" if embedding is not None else ""
    print(f"  float parameters: {weights >> 20} MiB{compressed} ({loaded.model.projection_choice.summary})")
    core = EngineCore(loaded, config)
    stages.mark("engine core (KV pool, warm-up)")
    print(f"  KV pool: {core.num_blocks} blocks of {config.block_size} tokens, {core.kv_cache.nbytes >> 20} MiB mapped, "
          f"{(core.kv_cache.resident_bytes() or 0) >> 20} MiB resident")  # fmt: skip
    if args.requests:
        rng = random.Random(1)
        params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
        started = done = 0
        start = time.monotonic()
        while done < args.requests:
            while started < args.requests and core.num_requests < args.in_flight:
                core.add_request(f"r{started}", random_words(rng, 128), params)
                started += 1
            done += sum(1 for out in core.step() if out.finished)
        stages.mark(f"{args.requests} requests ({time.monotonic() - start:.0f} s)")
        written = core.block_manager.num_written_blocks
        print(f"  KV pool: {(core.kv_cache.resident_bytes() or 0) >> 20} MiB resident, {written} blocks ever written")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
