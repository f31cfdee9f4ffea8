"""Where the milliseconds of a one-stream decode step go.

Runs one greedy stream of the default model through ``EngineCore`` (128
prompt tokens, then ``--tokens`` decode steps), once per ``--quantization``
and per code tree (``--code``), each in a fresh process, taking turns
``--rounds`` times so that load from other work falls on all alike. For
each it reports the p50 of:

- the whole ``EngineCore.step`` and its parts: scheduling, the forward
  (batch tensors, attention plan, embeddings and rotary tables, the 30
  layers, final norm and LM head), the sampler, and ``process_output``
  (detokenizing, stops);
- the projections and LM head alone at one row (the same callables the
  forward runs, on a random row): the weight-streaming floor of the step;
- with ``--profile``, the aten ops ``torch.profiler`` sees per step (calls
  and self time; the profiler's own overhead inflates the times).

``--code before=/tmp/old`` runs the engine from another source tree (a
folder holding ``trioserve/engine``, e.g. ``git archive HEAD~3 engine |
tar -x -C /tmp/old/trioserve``), for before/after ratios in one run. The
machine may be shared: compare ratios within one run, not across runs.

    .venv/bin/python scripts/decode_profile.py --quantization none auto --rounds 2 --profile
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time


def _child(quantization: str, tokens: int, profile: bool) -> dict:
    import torch

    torch.set_num_threads(int(os.environ.get("TRIOSERVE_BENCH_THREADS", "2")))
    from trioserve.engine.layers.attention import AttentionMetadata
    from trioserve.engine.config import EngineConfig
    from trioserve.engine.core.engine_core import EngineCore
    from trioserve.engine.layers.forward_batch import ForwardBatch
    from trioserve.engine.loading.loader import load_model
    from trioserve.engine.sampling.sampling_params import SamplingParams

    loaded = load_model(None, quantization=quantization)
    core = EngineCore(
        loaded, EngineConfig(max_model_len=512, kv_cache_memory=64 << 20, quantization=quantization, max_num_seqs=4)
    )
    model = loaded.model
    parts: dict[str, float] = {}
    recording = [False]

    def timed(name, fn):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                if recording[0]:
                    parts[name] = parts.get(name, 0.0) + time.perf_counter() - start

        return wrapper

    core.schedule = timed("schedule", core.schedule)
    core.process_output = timed("process_output", core.process_output)
    runner = core.runner
    # Slotted attrs classes: wrapped on the class (this process only).
    type(runner).forward = timed("forward", type(runner).forward)
    type(runner.sampler).sample = timed("sample", type(runner.sampler).sample)
    model.lm_logits = timed("lm_head", model.lm_logits)
    model.embed = timed("embed", model.embed)
    model.rotary.cos_sin = timed("rotary_table", model.rotary.cos_sin)
    ForwardBatch.build = classmethod(timed("batch_tensors", ForwardBatch.build.__func__))
    AttentionMetadata.build = classmethod(timed("attention_plan", AttentionMetadata.build.__func__))

    prompt = list(range(1000, 1128))
    counter = [0]

    def run(n: int) -> list[tuple[float, dict[str, float]]]:
        counter[0] += 1
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        core.add_request(f"r{counter[0]}", prompt, params)
        core.step()  # the prefill
        steps = []
        while core.has_unfinished():
            parts.clear()
            recording[0] = True
            start = time.perf_counter()
            core.step()
            steps.append((time.perf_counter() - start, dict(parts)))
            recording[0] = False
        return steps

    run(8)  # warm
    steps = run(tokens)
    total = [s for s, _ in steps]
    names = ["schedule", "forward", "batch_tensors", "attention_plan", "embed", "rotary_table", "lm_head", "sample",
             "process_output"]
    med = {n: 1e3 * statistics.median(p.get(n, 0.0) for _, p in steps) for n in names}
    med["step"] = 1e3 * statistics.median(total)
    med["layers"] = med["forward"] - sum(med[n] for n in ("batch_tensors", "attention_plan", "embed", "rotary_table",
                                                          "lm_head"))
    med["rest"] = med["step"] - med["schedule"] - med["forward"] - med["sample"] - med["process_output"]
    result = {"parts_ms": med, "matmuls_ms": _matmuls_alone(model), "choice": loaded.projection_choice.summary}
    rss = int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    result["rss_mib"] = rss / 2**20
    if profile:
        result["ops"] = _profile_ops(core, prompt, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    return result


def _matmuls_alone(model) -> float:
    """p50 ms of every projection (with what is fused into it) and the LM head at one row."""
    import torch

    made = model._projections()
    c = model.config
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, c.hidden_size, generator=gen)
    attn = torch.randn(1, c.num_attention_heads * c.head_dim, generator=gen)
    times = []
    with torch.inference_mode():
        for _ in range(30):
            start = time.perf_counter()
            for p in made.layers:
                p.qkv(x)
                p.o_add(attn, x)
                p.mlp_add(x, x)
            model.lm_logits(x, made)
            times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times[5:])


def _profile_ops(core, prompt, params) -> list[dict]:
    from torch.profiler import ProfilerActivity, profile

    core.add_request("profiled", prompt, params)
    core.step()  # the prefill, not profiled
    for _ in range(3):
        core.step()
    steps = 0
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        while core.has_unfinished():
            core.step()
            steps += 1
    rows = []
    for e in prof.key_averages():
        if not e.key.startswith("aten::") and not e.key.startswith("mkldnn::"):
            continue
        rows.append({"op": e.key, "calls": e.count / steps, "self_ms": e.self_cpu_time_total / 1e3 / steps})
    rows.sort(key=lambda r: -r["self_ms"])
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quantization", nargs="+", default=["none", "auto"])
    parser.add_argument("--code", nargs="*", default=[], help="LABEL=FOLDER: run the engine from FOLDER/trioserve")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=64, help="decode steps measured per run")
    parser.add_argument("--profile", action="store_true", help="add torch.profiler's op table (one round)")
    parser.add_argument("--top", type=int, default=14, help="ops shown per profile")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        q, tokens, profile = args.child
        print(json.dumps(_child(q, int(tokens), profile == "1")))
        return
    # The children read it (a loaded machine stalls 2-thread OpenMP regions: 1 avoids that).
    os.environ["TRIOSERVE_BENCH_THREADS"] = str(args.threads)
    trees = [("current", None)] + [tuple(c.split("=", 1)) for c in args.code]
    results: dict[tuple[str, str], list[dict]] = {}
    for round_ in range(args.rounds):
        for label, folder in trees:
            for q in args.quantization:
                env = dict(os.environ)
                if folder:
                    env["PYTHONPATH"] = os.pathsep.join(filter(None, [folder, env.get("PYTHONPATH")]))
                profile = "1" if args.profile and round_ == 0 else "0"
                cmd = [sys.executable, __file__, "--child", q, str(args.tokens), profile]
                out = subprocess.run(cmd, capture_output=True, text=True, env=env)
                if out.returncode:
                    sys.exit(f"{label} {q} failed:\n{out.stderr[-3000:]}")
                results.setdefault((label, q), []).append(json.loads(out.stdout.strip().splitlines()[-1]))
                print(label, q, out.stdout.strip().splitlines()[-1], file=sys.stderr, flush=True)
    keys = list(results)
    names = ["step", "schedule", "forward", "batch_tensors", "attention_plan", "embed", "rotary_table", "layers",
             "lm_head", "sample", "process_output", "rest"]
    print("| part (p50 ms per decode step) | " + " | ".join(f"{lab} {q}" for lab, q in keys) + " |")
    print("|---" * (len(keys) + 1) + "|")
    for n in names:
        cells = [" / ".join(f"{r['parts_ms'][n]:.2f}" for r in results[k]) for k in keys]
        print(f"| {n} | " + " | ".join(cells) + " |")
    cells = [" / ".join(f"{r['matmuls_ms']:.2f}" for r in results[k]) for k in keys]
    print("| projections + LM head alone, 1 row | " + " | ".join(cells) + " |")
    cells = [f"{statistics.median(r['rss_mib'] for r in results[k]):,.0f}" for k in keys]
    print("| RSS MiB | " + " | ".join(cells) + " |")
    print()
    for k in keys:
        print(f"{k[0]} {k[1]}: {results[k][0]['choice']}")
    if args.profile:
        for k in keys:
            ops = results[k][0]["ops"]
            calls = sum(r["calls"] for r in ops)
            self_ms = sum(r["self_ms"] for r in ops)
            print(f"\n{k[0]} {k[1]}: {calls:.0f} aten calls per step, {self_ms:.2f} ms self time under the profiler")
            print("| op | calls/step | self ms/step |\n|---|---:|---:|")
            for r in ops[: args.top]:
                print(f"| `{r['op']}` | {r['calls']:.0f} | {r['self_ms']:.3f} |")


if __name__ == "__main__":
    main()
