"""``trioserve bench offline``: the engine against transformers ``generate``, in one process.

Every contender runs the same prompts (random token ids of exact length,
seeded) to the same number of output tokens with EOS ignored, greedy. The
run also measures fp32 matmul throughput, so the engine's decode step can be
put against the machine's roofline.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import torch
import trio

from trioserve.engine.config import EngineConfig
from trioserve.engine.core.engine_core import EngineCore
from trioserve.engine.loading.loader import load_model_for
from trioserve.engine.parallel.placement import plan_replicas
from trioserve.engine.parallel.tp_runner import start_tensor_parallel, stop_tensor_parallel
from trioserve.engine.runtime.step_thread import StepThread
from trioserve.engine.sampling.sampling_params import SamplingParams
from trioserve.web.engine_options import add_option_groups, add_speculative_options, option_group, speculative_fields

from .replicated import run_actor_engine


@attrs.frozen
class ContenderResult:
    name: str
    num_requests: int
    output_tokens: int
    seconds: float
    per_token_latency_ms: float | None = None  # single-stream runs only

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds


def measure_matmul_gflops(dtype: Any, device: Any, size: int = 2048, repeats: int = 10) -> float:
    """GEMM throughput of this machine in ``dtype`` with torch's current threads."""
    a = torch.randn(size, size, dtype=dtype, device=device)
    b = torch.randn(size, size, dtype=dtype, device=device)
    torch.mm(a, b)  # warm-up: thread pool and allocator
    synchronize(device)
    start = time.perf_counter()
    for _ in range(repeats):
        torch.mm(a, b)
    synchronize(device)
    return 2 * size**3 * repeats / (time.perf_counter() - start) / 1e9


def synchronize(device: Any) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def decode_flops_per_token(model_config: Any, context_len: int) -> float:
    """Multiply-adds of one decode token, x2: every projection, the LM head,
    and attention over ``context_len`` cached tokens."""
    c = model_config
    q_dim, kv_dim = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    per_layer = c.hidden_size * (q_dim + 2 * kv_dim) + q_dim * c.hidden_size + 3 * c.hidden_size * c.intermediate_size
    attention = 2 * context_len * q_dim  # scores and weighted sum
    return 2.0 * (c.num_hidden_layers * (per_layer + attention) + c.hidden_size * c.vocab_size)


def make_prompts(num: int, length: int, vocab_size: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    # Skip the low ids, where special tokens live.
    return torch.randint(100, vocab_size, (num, length), generator=generator).tolist()


def run_engine(core_factory: Callable[[], Any], prompts: list[list[int]], output_len: int) -> tuple[ContenderResult, list[float]]:
    """All prompts through EngineCore at once; also return the times of the
    steps in which every running request decoded (no prefill)."""
    core = core_factory()
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    for i, ids in enumerate(prompts):
        core.add_request(f"r{i}", ids, params)
    decode_steps: list[float] = []
    tokens = 0
    start = time.perf_counter()
    while core.has_unfinished():
        step_start = time.perf_counter()
        plan = core.schedule()
        outputs = core.process_output(plan, core.execute(plan))
        elapsed = time.perf_counter() - step_start
        if plan.chunks and all(c.num_tokens == 1 for c in plan.chunks):
            decode_steps.append((len(plan.chunks), elapsed))
        tokens += sum(len(o.new_token_ids) for o in outputs)
    seconds = time.perf_counter() - start
    name = "trioserve EngineCore" if len(prompts) > 1 else "trioserve EngineCore, one stream"
    latency = seconds / tokens * 1000 if len(prompts) == 1 else None
    return ContenderResult(name, len(prompts), tokens, seconds, latency), decode_steps


def measure_batch_prefill(loaded: Any, prompts: list[list[int]], config_fields: dict) -> float:
    """Seconds the engine takes to prefill every prompt in one batch (one
    step, the token budget raised to hold them all): the floor for the
    slowest time to first token when they all arrive at once."""
    total = sum(len(p) for p in prompts)
    fields = config_fields | {"max_num_batched_tokens": total, "max_num_seqs": max(len(prompts), 1)}
    core = EngineCore(loaded, EngineConfig(**fields))
    for i, ids in enumerate(prompts):
        core.add_request(f"p{i}", ids, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    start = time.perf_counter()
    while core.has_unfinished():
        core.step()
    return time.perf_counter() - start


def run_transformers(
    model: Any, prompts: list[list[int]], output_len: int, batch_size: int, pad_id: int
) -> ContenderResult:
    """transformers ``generate`` over static batches of ``batch_size`` prompts
    (equal lengths, so no padding is involved)."""
    tokens = 0
    start = time.perf_counter()
    with torch.inference_mode():
        for first in range(0, len(prompts), batch_size):
            batch = torch.tensor(prompts[first : first + batch_size], device=model.device)
            out = model.generate(
                batch,
                attention_mask=torch.ones_like(batch),
                max_new_tokens=output_len,
                min_new_tokens=output_len,
                do_sample=False,
                pad_token_id=pad_id,
            )
            tokens += (out.shape[1] - batch.shape[1]) * out.shape[0]
    synchronize(model.device)
    seconds = time.perf_counter() - start
    name = "transformers generate, sequential" if batch_size == 1 else f"transformers generate, static batch {batch_size}"
    latency = seconds / tokens * 1000 if batch_size == 1 else None
    return ContenderResult(name, len(prompts), tokens, seconds, latency)


def run_replicated(args: argparse.Namespace, config: Any, loaded: Any, prompts: list[list[int]]) -> ContenderResult:
    """The actor engine with ``--data-parallel-size`` replicas, every prompt
    at once (on CPU the replicas share ``loaded``'s weights)."""
    replicated = attrs.evolve(config, data_parallel_size=args.data_parallel_size, num_threads=args.num_threads)
    shared = loaded if loaded.device.type == "cpu" else None  # on CUDA each replica loads onto its device
    run = trio.run(functools.partial(run_actor_engine, loaded=shared), replicated, prompts, args.output_len, len(prompts))
    return ContenderResult(f"trioserve actors, {run.layout}", run.requests, run.output_tokens, run.seconds)


def add_bench_offline_parser(bench_commands) -> None:
    p = bench_commands.add_parser(
        "offline",
        help="compare the engine with transformers generate in one process",
        description="Run the same prompts through EngineCore and through transformers generate "
        "(sequential and static batches) and print throughput, ratios and the matmul roofline.",
    )
    add_option_groups(p, "workload", "model", "engine", "scale-out", "output")
    work = option_group(p, "workload")
    work.add_argument("--num-prompts", type=int, default=64, help="prompts of the batch runs (default: 64)")
    work.add_argument("--input-len", type=int, default=128, help="tokens of each random prompt (default: 128)")
    work.add_argument("--output-len", type=int, default=128, help="tokens each prompt generates (default: 128)")
    work.add_argument(
        "--sequential-prompts", type=int, default=4, help="prompts run one at a time (a rate, so a few suffice; default: 4)"
    )
    work.add_argument(
        "--prefill-batch", type=int, default=32, help="prompts prefilled together for the TTFT floor (default: 32)"
    )
    work.add_argument("--batch-size", type=int, default=32, help="transformers static batch size (default: 32)")
    work.add_argument("--seed", type=int, default=0, help="seeds the random prompts (default: 0)")
    work.add_argument("--skip-transformers", action="store_true", help="run trioserve only, not transformers generate")

    model = option_group(p, "model")
    model.add_argument("--model", default=None, help="checkpoint folder or .gguf (default: SmolLM2-135M-Instruct)")
    model.add_argument(
        "--dtype", default="float32", choices=["float32", "bfloat16", "float16"], help="every contender's (default: float32)"
    )
    model.add_argument(
        "--quantization",
        default="auto",
        choices=["auto", "none", "int8", "int4"],
        help="trioserve's weights (docs/api.md; default: auto)",
    )
    model.add_argument(
        "--quantization-group-size", type=int, default=32, help="inputs per int4 scale (default: 32)"
    )

    engine = option_group(p, "engine")
    engine.add_argument("--device", default="cpu", help="every contender's: cpu, cuda, cuda:1 (default: cpu)")
    engine.add_argument("--num-threads", type=int, default=None, help="torch threads (default: torch's)")
    engine.add_argument("--max-num-seqs", type=int, default=64, help="trioserve's running sequences at most (default: 64)")
    engine.add_argument(
        "--max-num-batched-tokens", type=int, default=2048, help="trioserve's tokens per step at most (default: 2048)"
    )
    engine.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=["auto", "float32", "float16", "bfloat16", "fp8"],
        help="trioserve's KV cache (docs/api.md; default: auto)",
    )
    engine.add_argument(
        "--enforce-eager",
        action="store_true",
        help="on CUDA, trioserve's decode steps op by op, without CUDA graphs (docs/api.md)",
    )
    add_speculative_options(p)

    scale_out = option_group(p, "scale-out")
    scale_out.add_argument(
        "--data-parallel-size",
        type=int,
        default=1,
        help="also run the actor engine with this many replicas (--num-threads each), all prompts at once",
    )
    scale_out.add_argument(
        "--tensor-parallel-size", type=int, default=1, help="the engine's ranks (docs/deployment.md; default: 1)"
    )

    option_group(p, "output").add_argument(
        "--result-json", type=Path, default=None, help="write the results to this JSON file (default: print only)"
    )
    p.set_defaults(func=run_bench_offline)


def run_bench_offline(args: argparse.Namespace) -> int:
    """Every contender, and the load, runs on one long-lived thread: one
    OpenMP pool for all of them (see ``trioserve.engine.runtime.step_thread``)."""
    # More replicas than devices: refused before anything loads.
    plan_replicas(EngineConfig(device=args.device, data_parallel_size=args.data_parallel_size))
    with StepThread(args.num_threads) as step_thread:
        return step_thread.call(_run_bench_offline, args)


def _run_bench_offline(args: argparse.Namespace) -> int:
    config_fields = dict(
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.input_len + args.output_len + 16,
        dtype=args.dtype,
        device=args.device,
        tensor_parallel_size=args.tensor_parallel_size,
        model=args.model,
        quantization=args.quantization,
        quantization_group_size=args.quantization_group_size,
        kv_cache_dtype=args.kv_cache_dtype,
        enforce_eager=args.enforce_eager,
    )
    config_fields.update(speculative_fields(args))
    config = EngineConfig(**config_fields)
    if config.tensor_parallel_size > 1:
        # One group for every engine of the run (each sizes the ranks' KV pools anew).
        loaded = start_tensor_parallel(config)
    else:
        loaded = load_model_for(config)
    prompts = make_prompts(args.num_prompts, args.input_len, loaded.model_config.vocab_size, args.seed)
    gflops = measure_matmul_gflops(loaded.dtype, loaded.device)
    print(f"{args.dtype} matmul: {gflops:.1f} GFLOP/s ({torch.get_num_threads()} threads)", file=sys.stderr)

    results: list[ContenderResult] = []

    def core_factory() -> EngineCore:
        return EngineCore(loaded, config)

    # One short warm-up run so one-time costs (allocator, thread pools) do not count.
    run_engine(core_factory, prompts[:2], 4)
    engine, decode_steps = run_engine(core_factory, prompts, args.output_len)
    results.append(engine)
    single, _ = run_engine(core_factory, prompts[:1], args.output_len)
    results.append(single)
    prefill_seconds = measure_batch_prefill(loaded, prompts[: args.prefill_batch], config_fields)
    if args.data_parallel_size > 1:
        results.append(run_replicated(args, config, loaded, prompts))

    if not args.skip_transformers:
        from transformers import AutoModelForCausalLM

        reference = AutoModelForCausalLM.from_pretrained(str(loaded.path), dtype=loaded.dtype).to(loaded.device)
        reference.eval()
        pad = loaded.model_config.eos_token_ids[0] if loaded.model_config.eos_token_ids else 0
        sequential = prompts[: args.sequential_prompts]
        results.append(run_transformers(reference, sequential, args.output_len, 1, pad))
        results.append(run_transformers(reference, prompts, args.output_len, args.batch_size, pad))

    full_batch = [t for n, t in decode_steps if n == min(args.num_prompts, args.max_num_seqs)]
    step_ms = statistics.median(full_batch) * 1000 if full_batch else float("nan")
    batch = min(args.num_prompts, args.max_num_seqs)
    avg_context = args.input_len + args.output_len // 2
    step_gflop = decode_flops_per_token(loaded.model_config, avg_context) * batch / 1e9
    efficiency = step_gflop / (step_ms / 1000) / gflops if full_batch else float("nan")

    print(f"\nworkload: {args.num_prompts} prompts x {args.input_len} tokens -> {args.output_len} tokens, greedy, EOS ignored")
    print(f"{'contender':44} {'requests':>8} {'tokens':>7} {'seconds':>8} {'out tok/s':>10} {'ms/token':>9}")
    for r in results:
        latency = f"{r.per_token_latency_ms:9.1f}" if r.per_token_latency_ms is not None else f"{'':>9}"
        print(f"{r.name:44} {r.num_requests:8d} {r.output_tokens:7d} {r.seconds:8.1f} {r.output_tokens_per_s:10.1f} {latency}")
    ratios = {}
    by_name = {r.name: r for r in results}
    seq = by_name.get("transformers generate, sequential")
    static = by_name.get(f"transformers generate, static batch {args.batch_size}")
    if seq:
        ratios["vs_sequential"] = engine.output_tokens_per_s / seq.output_tokens_per_s
        ratios["single_stream_latency_ratio"] = single.per_token_latency_ms / seq.per_token_latency_ms
    if static:
        ratios["vs_static_batch"] = engine.output_tokens_per_s / static.output_tokens_per_s
    for key, value in ratios.items():
        print(f"{key}: {value:.2f}x")
    print(
        f"roofline: batch-{batch} decode step {step_ms:.1f} ms median over {len(full_batch)} steps, "
        f"{step_gflop:.1f} GFLOP -> {efficiency:.0%} of {gflops:.1f} GFLOP/s"
    )
    print(f"prefill of {min(args.prefill_batch, len(prompts))} prompts as one batch: {prefill_seconds:.2f} s")
    if args.result_json:
        payload = {
            "batch_prefill_seconds": prefill_seconds,
            "batch_prefill_prompts": min(args.prefill_batch, len(prompts)),
            "matmul_gflops": gflops,
            "decode_step_ms": step_ms,
            "decode_step_efficiency": efficiency,
            "results": [attrs.asdict(r) | {"output_tokens_per_s": r.output_tokens_per_s} for r in results],
            "ratios": ratios,
        }
        args.result_json.write_text(json.dumps(payload, indent=2))
    if config.tensor_parallel_size > 1:
        stop_tensor_parallel(loaded.model)
    return 0
