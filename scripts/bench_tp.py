"""Tensor parallelism on this machine: TP=1 against TP=N, in one run.

Builds a random-weight Llama of about the default model's size whose heads
split evenly over N ranks (SmolLM2-135M's 9 heads do not split over 2),
saves it with the default model's tokenizer, and runs the same greedy
workload through ``EngineCore`` at each TP size: ``--concurrency`` requests
at once (each a list: 1 and 32 by default) of ``--input-len`` prompt
tokens and ``--output-len`` generated tokens, EOS ignored. Rank 0's time
inside its collectives (the all-reduces after o_proj and down_proj, the
embedding's all-reduce, the logits' gather) is read from its timers
around them; it includes any wait for a slower rank. With
``--profile-steps K`` the same is read a second way, from torch's profiler:
K decode steps at each concurrency run under ``torch.profiler`` on rank 0,
and the time of its collective events (``gloo:all_reduce`` and the like,
which torch records itself) is summed per step.

    .venv/bin/python scripts/bench_tp.py --tp 2 --threads 2 --profile-steps 16
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch


def save_model(path: Path, *, layers: int, hidden: int, heads: int, kv_heads: int, intermediate: int) -> Path:
    import transformers

    from trioserve.testing.tiny_model import tokenizer

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


def run(core, prompts: list[list[int]], output_len: int, tp_runner) -> dict:
    from trioserve.engine.sampling.sampling_params import SamplingParams

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
        "decode_step_ms": statistics.median(decode_ms),
        "collective_ms": statistics.median(collective_ms) if collective_ms else 0.0,
        "collective_calls": statistics.median(calls) if calls else 0,
    }


def profile_collectives(core, prompts: list[list[int]], steps: int) -> dict:
    """Median per decode step of rank 0's collective time as torch's profiler
    records it, over ``steps`` decode steps after the prompts' prefill."""
    from torch.profiler import ProfilerActivity, profile, record_function

    from trioserve.engine.sampling.sampling_params import SamplingParams

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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2, help="cores in all: TP=1 gets them all, TP=N a share each")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--intermediate", type=int, default=1536)
    parser.add_argument("--profile-steps", type=int, default=0, help="also profile this many decode steps (TP > 1)")
    args = parser.parse_args()

    from trioserve.engine.config import EngineConfig
    from trioserve.engine.core.engine_core import EngineCore
    from trioserve.engine.runtime.step_thread import StepThread

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
                thread.call(run, core, prompts[:2], 4, tp_runner)  # warm-up
                for c in args.concurrency:
                    r = thread.call(run, core, prompts[:c], args.output_len, tp_runner)
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


if __name__ == "__main__":
    sys.exit(main())
