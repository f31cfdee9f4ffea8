"""``trioserve bench tp``: tensor parallelism on this machine, TP=1 against
TP=N in one run.

Builds a random-weight Llama of about the default model's size whose heads
split evenly over N ranks (SmolLM2-135M's 9 heads do not split over 2),
saves it with the default model's tokenizer, and runs the same greedy
workload through ``EngineCore`` at each TP size: ``--concurrency`` requests
at once of ``--input-len`` prompt tokens and ``--output-len`` generated
tokens, EOS ignored. Rank 0's time inside its collectives (the all-reduces
after o_proj and down_proj, the embedding's all-reduce, the logits' gather)
is read from its timers around them; it includes any wait for a slower
rank. With ``--profile-steps K`` the same is read a second way, from
torch's profiler: K decode steps at each concurrency run under
``torch.profiler`` on rank 0, and the time of its collective events
(``gloo:all_reduce`` and the like, which torch records itself) is summed
per step.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from trioserve.engine.config import EngineConfig
from trioserve.engine.core.engine_core import EngineCore
from trioserve.engine.runtime.step_thread import StepThread
from trioserve.engine.sampling.sampling_params import SamplingParams
from trioserve.testing.tiny_model import tokenizer

from ..arguments import int_list, non_negative_int, positive_int


def add_parser(commands) -> argparse.ArgumentParser:
    p = commands.add_parser(
        "tp",
        help="tensor parallelism against one rank, on a random Llama whose heads split",
        description=__doc__.split("\n\n")[0].removeprefix("``trioserve bench tp``: "),
    )
    layout = p.add_argument_group("layout")
    layout.add_argument("--tp", type=positive_int, default=2, help="the tensor-parallel size against 1 (default: 2)")
    layout.add_argument("--threads", type=positive_int, default=2,
                        help="cores in all: TP=1 gets them all, TP=N a share each (default: 2)")  # fmt: skip
    work = p.add_argument_group("workload")
    work.add_argument("--concurrency", type=int_list, default=[1, 32], help="comma-separated (default: 1,32)")
    work.add_argument("--input-len", type=positive_int, default=128, help="prompt tokens (default: 128)")
    work.add_argument("--output-len", type=positive_int, default=128, help="tokens out (default: 128)")
    work.add_argument("--profile-steps", type=non_negative_int, default=0,
                      help="also profile this many decode steps (TP > 1; default: 0)")  # fmt: skip
    model = p.add_argument_group("model")
    model.add_argument("--layers", type=positive_int, default=24, help="decoder layers (default: 24)")
    model.add_argument("--hidden", type=positive_int, default=512, help="hidden size (default: 512)")
    model.add_argument("--heads", type=positive_int, default=8, help="attention heads (default: 8)")
    model.add_argument("--kv-heads", type=positive_int, default=4, help="KV heads (default: 4)")
    model.add_argument("--intermediate", type=positive_int, default=1536, help="MLP size (default: 1536)")
    p.set_defaults(func=run)
    return p


def save_model(path: Path, *, layers: int, hidden: int, heads: int, kv_heads: int, intermediate: int) -> Path:
    import transformers  # seconds to import, for this command only

    config = transformers.LlamaConfig(
        vocab_size=49152, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=2048,
        tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    model.save_pretrained(path)
    tokenizer().save_pretrained(path)
    return path


def measure(core, prompts: list[list[int]], output_len: int, tp_runner) -> dict:
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    for i, ids in enumerate(prompts):
        core.add_request(f"r{i}", ids, params)
    decode_ms, collective_ms, calls = [], [], []
    tokens = 0
    start = time.perf_counter()
    while core.has_unfinished():
        if tp_runner is not None:
            tp_runner.collective_seconds()
        t = time.perf_counter()
        plan = core.schedule()
        outputs = core.process_output(plan, core.execute(plan))
        elapsed = time.perf_counter() - t
        tokens += sum(len(o.new_token_ids) for o in outputs)
        if plan.chunks and all(c.num_tokens == 1 for c in plan.chunks):
            decode_ms.append(elapsed * 1000)
            if tp_runner is not None:
                seconds, n = tp_runner.collective_seconds()
                collective_ms.append(seconds * 1000)
                calls.append(n)
    seconds = time.perf_counter() - start
    return {
        "tokens_per_s": tokens / seconds,
        "decode_step_ms": statistics.median(decode_ms) if decode_ms else float("nan"),
        "collective_ms": statistics.median(collective_ms) if collective_ms else 0.0,
        "collective_calls": statistics.median(calls) if calls else 0,
    }


def profile_collectives(core, prompts: list[list[int]], steps: int) -> dict:
    """Median per decode step of rank 0's collective time as torch's profiler
    records it, over ``steps`` decode steps after the prompts' prefill."""
    params = SamplingParams(temperature=0.0, max_tokens=steps + 1, ignore_eos=True)
    for i, ids in enumerate(prompts):
        core.add_request(f"p{i}", ids, params)
    # Prefill first, outside the profile.
    plan = core.schedule()
    while plan.chunks and not all(c.num_tokens == 1 for c in plan.chunks):
        core.process_output(plan, core.execute(plan))
        plan = core.schedule()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for step in range(steps):
            if not plan.chunks:
                break
            with record_function(f"decode_step_{step}"):
                core.process_output(plan, core.execute(plan))
            plan = core.schedule()
    while core.has_unfinished():
        core.process_output(plan, core.execute(plan))
        plan = core.schedule()
    steps_ms: list[float] = []
    collective_us: dict[str, float] = {}
    for event in prof.events():
        if event.name.startswith("decode_step_"):
            steps_ms.append(event.cpu_time_total / 1000)
        elif any(word in event.name for word in ("all_reduce", "allreduce", "all_gather", "allgather", "gather")):
            collective_us[event.name] = collective_us.get(event.name, 0.0) + event.cpu_time_total
    n = max(1, len(steps_ms))
    return {
        "profiled_steps": len(steps_ms),
        "step_ms": statistics.median(steps_ms) if steps_ms else 0.0,
        "collectives_ms_per_step": {name: us / 1000 / n for name, us in sorted(collective_us.items())},
    }


def run(args: argparse.Namespace) -> int:
    folder = Path(tempfile.mkdtemp(prefix="bench-tp-"))
    save_model(folder, layers=args.layers, hidden=args.hidden, heads=args.heads, kv_heads=args.kv_heads,
               intermediate=args.intermediate)  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    most = max(args.concurrency)
    prompts = [torch.randint(100, 49000, (args.input_len,), generator=gen).tolist() for _ in range(most)]
    results = []
    profiles = []
    for tp in (1, args.tp):
        threads = args.threads if tp == 1 else max(1, args.threads // tp)
        config = EngineConfig(
            model=str(folder), max_model_len=args.input_len + args.output_len + 16, max_num_seqs=most,
            max_num_batched_tokens=2048, num_threads=threads, tensor_parallel_size=tp, warm_up=tp == 1,
        )  # fmt: skip
        with StepThread(threads) as thread:
            core = thread.call(EngineCore.from_config, config)
            tp_runner = core.runner if tp > 1 else None
            try:
                thread.call(measure, core, prompts[:2], 4, tp_runner)  # warm-up
                for c in args.concurrency:
                    r = thread.call(measure, core, prompts[:c], args.output_len, tp_runner)
                    results.append((tp, threads, c, r))
                    print(f"TP={tp} ({threads} thread(s) per rank) concurrency {c}: {r}", file=sys.stderr)
                if tp_runner is not None and args.profile_steps:
                    for c in args.concurrency:
                        p = thread.call(profile_collectives, core, prompts[:c], args.profile_steps)
                        profiles.append((tp, c, p))
            finally:
                thread.call(core.close)
    print(f"\nmodel: Llama {args.layers} layers, hidden {args.hidden}, {args.heads} heads / {args.kv_heads} KV heads, "
          f"intermediate {args.intermediate}, vocab 49152, float32; {args.input_len} in, {args.output_len} out")  # fmt: skip
    print(f"{'TP':>3} {'thr/rank':>8} {'conc':>5} {'out tok/s':>10} {'decode step ms':>15} {'collectives ms/step':>20} {'calls/step':>10}")
    for tp, threads, c, r in results:
        print(f"{tp:>3} {threads:>8} {c:>5} {r['tokens_per_s']:>10.1f} {r['decode_step_ms']:>15.1f} "
              f"{r['collective_ms']:>20.1f} {r['collective_calls']:>10}")  # fmt: skip
    for tp, c, p in profiles:
        # c10d::* is the op's dispatch, gloo:*/nccl:* the collective's work
        # (with any wait for the other rank): count the work, once.
        work = {k: v for k, v in p["collectives_ms_per_step"].items() if k.startswith(("gloo:", "nccl:"))}
        total = sum((work or p["collectives_ms_per_step"]).values())
        print(f"\nprofile, TP={tp}, concurrency {c}: {p['profiled_steps']} decode steps, step {p['step_ms']:.1f} ms "
              f"(median), collectives' work {total:.1f} ms per step (mean):")  # fmt: skip
        for name, ms in p["collectives_ms_per_step"].items():
            print(f"  {name:<40} {ms:8.2f} ms/step")
    return 0
