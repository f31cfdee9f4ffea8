"""What ``torch.compile`` would save in a one-stream decode step, measured
on the part of a decoder layer between attention and the next layer's
attention: o projection plus residual, RMSNorm, gate/up projection, SiLU
times up, down projection plus residual, the next RMSNorm. Shapes of the
default model (SmolLM2-135M), random 4-bit weights on ATen's kernel in
bfloat16, one row; eager against inductor's compiled function. Prints the
compile time and the p50 microseconds of a call of each, taking turns.

    .venv/bin/python scripts/compile_trial.py --calls 300
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

HIDDEN, INTER, GROUP, EPS = 576, 1536, 32, 1e-5


def _int4(out: int, k: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    q = torch.randint(0, 16, (out, k), generator=gen, dtype=torch.int32)
    packed = torch._convert_weight_to_int4pack_for_cpu(q, 1)
    sz = torch.rand(k // GROUP, out, 2, generator=gen).to(torch.bfloat16) * 0.01
    return packed, sz.contiguous()


def block(attn, residual, w_post, w_next, o, o_sz, gu, gu_sz, d, d_sz):
    bf16 = torch.bfloat16
    residual = torch.add(residual, torch._weight_int4pack_mm_for_cpu(attn.to(bf16), o, GROUP, o_sz))
    x = F.rms_norm(residual, (HIDDEN,), w_post, EPS)
    gate, up = torch._weight_int4pack_mm_for_cpu(x.to(bf16), gu, GROUP, gu_sz).float().chunk(2, dim=-1)
    h = F.silu(gate).mul(up)
    residual = torch.add(residual, torch._weight_int4pack_mm_for_cpu(h.to(bf16), d, GROUP, d_sz))
    return residual, F.rms_norm(residual, (HIDDEN,), w_next, EPS).to(bf16)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--mode", default="default", help="torch.compile mode")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    o, o_sz = _int4(HIDDEN, HIDDEN, gen)
    gu, gu_sz = _int4(2 * INTER, HIDDEN, gen)
    d, d_sz = _int4(HIDDEN, INTER, gen)
    w_post, w_next = torch.rand(HIDDEN, generator=gen), torch.rand(HIDDEN, generator=gen)
    attn, residual = torch.randn(1, HIDDEN, generator=gen), torch.randn(1, HIDDEN, generator=gen)
    inputs = (attn, residual, w_post, w_next, o, o_sz, gu, gu_sz, d, d_sz)
    with torch.inference_mode():
        start = time.perf_counter()
        compiled = torch.compile(block, mode=args.mode, dynamic=False)
        want = block(*inputs)
        got = compiled(*inputs)
        compile_s = time.perf_counter() - start
        same = all(torch.equal(a, b) for a, b in zip(want, got))
        diff = max((a.float() - b.float()).abs().max().item() for a, b in zip(want, got))
        times: dict[str, list[float]] = {"eager": [], "compiled": []}
        for _ in range(args.calls):
            for name, fn in (("eager", block), ("compiled", compiled)):
                t0 = time.perf_counter()
                fn(*inputs)
                times[name].append(time.perf_counter() - t0)
    eager, comp = (1e6 * statistics.median(times[n]) for n in ("eager", "compiled"))
    print(f"compile {compile_s:.1f} s; outputs bit-equal: {same} (max difference {diff:.3g})")
    print(f"eager {eager:.0f} us, compiled {comp:.0f} us per call ({comp / eager:.2f}x); x30 layers: "
          f"{30 * (eager - comp) / 1e3:.2f} ms a step saved")


if __name__ == "__main__":
    main()
