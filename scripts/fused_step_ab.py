"""A model's decode steps in the fused native step against its layers in
torch, in one process, alternating (docs/performance.md, "The mixture of
experts"): the engine is loaded once, and each round runs ROWS greedy
requests of a 32-token prompt to the end through ``EngineCore.step`` with
the fused step, then with it switched off; the median and best step after
the prompts' steps are printed per round.

    python scripts/fused_step_ab.py MODEL.gguf [ROWS ...]
    python scripts/fused_step_ab.py ~/.cache/trioserve/real-size/qwen3-moe-7b-a1b-s0-4752900c2d/qwen3-moe-7b-a1b.Q4_K_M.gguf 1 32

Speeds depend on what else runs on the machine: compare the two in one run.
"""

import statistics
import sys
import time

import attrs

from trioserve.engine.config import EngineConfig
from trioserve.engine.core.engine_core import EngineCore
from trioserve.engine.sampling.sampling_params import SamplingParams

path = sys.argv[1]
rows_list = [int(a) for a in sys.argv[2:]] or [1, 32]
core = EngineCore.from_config(EngineConfig(model=path, max_num_seqs=max(rows_list), max_model_len=512))
model = core.runner.model
made = model._quantized
if made is None or made.decode is None:
    sys.exit(f"{path}: no fused step was built ({model.invariance()})")
torch_layers = attrs.evolve(made, decode=None)


def run(rows: int, steps: int, tag: str) -> list[float]:
    for i in range(rows):
        params = SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True)
        core.add_request(f"{tag}{i}", list(range(100 + i, 132 + i)), params)
    times = []
    while core.has_unfinished():
        start = time.perf_counter()
        core.step()
        times.append(time.perf_counter() - start)
    return sorted(times[4:])  # the prompts' steps left out


for rows in rows_list:
    steps = 28 if rows == 1 else 16
    for round_ in range(2):
        for name, layers in (("fused", made), ("torch", torch_layers)):
            model._quantized = layers
            t = run(rows, steps, f"{name}{rows}-{round_}-")
            median = statistics.median(t)
            print(f"rows={rows} {name}: median {1000 * median:.1f} ms, best {1000 * t[0]:.1f} ms, "
                  f"{rows / median:.1f} tok/s", flush=True)  # fmt: skip
model._quantized = made
