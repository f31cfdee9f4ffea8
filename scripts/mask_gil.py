"""Does filling a structured-output mask release the GIL, so it can run
beside the model's forward? Measured with the default model's tokenizer:

1. one fill of ``--rows`` rows (each at a different point of a JSON
   document of a mid-size schema), alone, median of ``--repeat``;
2. a pure-Python loop's rate while another thread fills masks back to back,
   against its rate alone, beside the same for two controls in that other
   thread: a pure-Python loop (holds the GIL: the rate about halves) and
   torch matmuls (release it: the rate stays, cores allowing). The GIL's
   switch interval is set to 0.1 ms so a waiting thread gets it quickly;
3. the same loop's progress during one long call into xgrammar (compiling
   the schema, uncached: tens of milliseconds in one call through the same
   tvm_ffi binding as a fill): near none if the call held the GIL (C code
   cannot be preempted), about its rate alone if it releases it;
4. fills in a thread while torch runs matmuls in this one (a stand-in for
   the forward), both timed against each alone.

    python scripts/mask_gil.py [--rows 32] [--repeat 50] [--seconds 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time

import torch

from trioserve.engine.sampling.grammar import GrammarCompiler, GrammarMatchers, MaskRequest
from trioserve.engine.sampling.structured_output import StructuredOutput
from trioserve.testing.tiny_model import VOCAB_SIZE, tokenizer

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 1, "maxItems": 4},
        "role": {"enum": ["admin", "user", "guest"]},
        "score": {"type": "number", "minimum": 0, "maximum": 1},
    },
    "required": ["name", "age", "tags", "role", "score"],
}


def _matchers(rows: int) -> tuple[GrammarMatchers, list[MaskRequest]]:
    """``rows`` matchers, row i advanced by i random allowed tokens."""
    tok = tokenizer()
    matchers = GrammarMatchers(GrammarCompiler(tok, VOCAB_SIZE, (tok.eos_token_id,)))
    generator = torch.Generator().manual_seed(0)
    requests = []
    for i in range(rows):
        request_id = f"r{i}"
        matchers.add(request_id, StructuredOutput.json_schema(json.dumps(SCHEMA)))
        for _ in range(i):
            mask = matchers.fill([MaskRequest(request_id)]).mask
            allowed = torch.nonzero(
                ((mask.bitmask[0].unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1).flatten()[:VOCAB_SIZE]
            ).flatten()
            choice = allowed[torch.randint(len(allowed), (1,), generator=generator)].item()
            if choice == tok.eos_token_id or not matchers.accept(request_id, choice):
                break
        requests.append(MaskRequest(request_id))
    return matchers, requests


def _loop_rate(seconds: float) -> float:
    count, end = 0, time.perf_counter() + seconds
    while time.perf_counter() < end:
        count += 1
    return count / seconds


def _in_thread(work, stop: threading.Event) -> tuple[threading.Thread, list[float]]:
    times: list[float] = []

    def run() -> None:
        while not stop.is_set():
            start = time.perf_counter()
            work()
            times.append(time.perf_counter() - start)

    thread = threading.Thread(target=run)
    thread.start()
    return thread, times


def main(args: argparse.Namespace) -> None:
    matchers, rows = _matchers(args.rows)
    fill = matchers.prepare(rows)
    alone = []
    for _ in range(args.repeat):
        start = time.perf_counter()
        fill.run()
        alone.append(time.perf_counter() - start)
    print(f"fill of {args.rows} rows alone: median {statistics.median(alone) * 1e3:.3f} ms")

    sys.setswitchinterval(1e-4)
    a, b = torch.randn(256, 2048), torch.randn(2048, 2048)
    spin = lambda: _loop_rate(0.001)  # noqa: E731
    base = _loop_rate(args.seconds)
    for name, work in (("fills", fill.run), ("a Python loop (control)", spin), ("torch matmuls (control)", lambda: a @ b)):
        stop = threading.Event()
        thread, times = _in_thread(work, stop)
        busy = _loop_rate(args.seconds)
        stop.set()
        thread.join()
        print(
            f"python loop beside {name}: {busy / base:.2f} of its rate alone ({base:,.0f}/s); "
            f"the other thread did {len(times)} calls, median {statistics.median(times) * 1e3:.3f} ms"
        )
    sys.setswitchinterval(0.005)

    compiler = GrammarCompiler(tokenizer(), VOCAB_SIZE, (0,))
    compiler.compile(StructuredOutput.regex("warm"))  # the tokenizer table, once
    counts: list[int] = []
    stop = threading.Event()

    def count() -> None:
        n = 0
        while not stop.is_set():
            n += 1
        counts.append(n)

    probe = threading.Thread(target=count)
    start = time.perf_counter()
    probe.start()
    compiler._backend().compile_json_schema(json.dumps(SCHEMA), any_whitespace=False)
    stop.set()
    seconds = time.perf_counter() - start
    probe.join()
    print(
        f"python loop during one {seconds * 1e3:.1f} ms compile call: {counts[0] / seconds:,.0f}/s, "
        f"{counts[0] / seconds / base:.2f} of its rate alone"
    )

    def matmuls() -> float:
        start = time.perf_counter()
        for _ in range(20):
            a @ b
        return time.perf_counter() - start

    matmuls()
    torch_alone = statistics.median(matmuls() for _ in range(5))
    stop = threading.Event()
    thread, times = _in_thread(fill.run, stop)
    torch_busy = statistics.median(matmuls() for _ in range(5))
    stop.set()
    thread.join()
    print(
        f"torch {torch.get_num_threads()} threads, 20 matmuls: {torch_alone * 1e3:.1f} ms alone, {torch_busy * 1e3:.1f} ms "
        f"beside fills; fills beside torch: median {statistics.median(times) * 1e3:.3f} ms ({len(times)} fills)"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=32, help="constrained rows per fill (default: 32)")
    parser.add_argument("--repeat", type=int, default=50, help="fills timed alone (default: 50)")
    parser.add_argument("--seconds", type=float, default=2.0, help="length of each loop-rate window (default: 2)")
    main(parser.parse_args())
