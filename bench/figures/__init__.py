"""The measurements behind docs/benchmarks.md and docs/reliability.md, one
``trioserve bench`` command each, one module each: ``add_parser(commands)``
adds the command and sets ``run(args) -> exit status`` as its function.

Against other servers: ``vs-llama`` (throughput, latency and memory against
llama-server), ``real-size`` (the same on random checkpoints of real shapes,
with the roofline), ``rss-ready`` (memory at ready). The engine's choices:
``invariance``, ``quality``, ``speculative``, ``structured``, ``kv-dtype``,
``kernels``, ``cpu-paths``. Scaling out: ``dp``, ``worker-mode``, ``tp``.
Serving overhead and reliability: ``actors``, ``tracing``, ``overload``,
``slo`` (goodput under latency objectives), ``slow-reader``. The float
path against transformers: ``suite``.

They may import every package of trioserve; nothing imports them but
``trioserve.bench.cli``.
"""

from . import (
    actors,
    cpu_paths,
    dp,
    invariance,
    kernels,
    kv_dtype,
    overload,
    quality,
    real_size,
    rss_ready,
    slo,
    slow_reader,
    speculative,
    structured,
    suite,
    tp,
    tracing,
    vs_llama,
    worker_mode,
)

# In the order `trioserve bench --help` lists them.
COMMANDS = (
    vs_llama,
    real_size,
    rss_ready,
    invariance,
    quality,
    speculative,
    structured,
    kv_dtype,
    kernels,
    cpu_paths,
    dp,
    worker_mode,
    tp,
    actors,
    tracing,
    overload,
    slo,
    slow_reader,
    suite,
)
