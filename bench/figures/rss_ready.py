"""``trioserve bench rss-ready``: resident memory of a server at ready and
after requests: trioserve, and llama-server beside it on the same GGUF.

    trioserve bench rss-ready [--requests 500] [--in-flight 32]
        [--trioserve-args='...'] [--llama-server PATH --llama-args='-np 64 -c 524288']

Starts ``trioserve serve`` (its defaults plus ``--trioserve-args``) on a
free 127.0.0.1 port, reads the resident memory of its process tree once
``/health`` answers (``bench.memory.tree_memory``: VmRSS summed over the
tree, and the sum of each process's peak), sends ``--requests`` plain
completions, ``--in-flight`` at a time (distinct prompts of
``--input-words`` random words, ``--output-len`` tokens out, greedy,
``ignore_eos``), reads it again, and stops the server, also on an error.
Then the same for ``--llama-server`` when given, on the default model's
GGUF (or ``--model``) with ``--llama-args``. One server runs at a time.

With ``--skip-above-available`` a llama-server whose KV cache (it zeroes
the whole cache at start) would not leave that many GiB of the host's
available memory is not started: say ``-np 64 -c 524288`` is 11.3 GiB on
the default model.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import random
import shlex
import time
from pathlib import Path

import gguf
import httpx

from trioserve.engine.core.kv_budget import available_memory
from trioserve.engine.loading.sources import default_model_path

from ..arguments import non_negative_int, positive_int
from ..datasets import random_words
from ..memory import tree_memory
from ..process import TRIOSERVE, free_port, running


def add_parser(commands) -> argparse.ArgumentParser:
    p = commands.add_parser(
        "rss-ready",
        help="resident memory of trioserve (and llama-server) at ready and after requests",
        description=__doc__.split("\n\n")[0].removeprefix("``trioserve bench rss-ready``: "),
        epilog=__doc__.split("\n\n", 2)[2],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    work = p.add_argument_group("workload")
    work.add_argument("--requests", type=non_negative_int, default=500, help="completions after ready (default: 500)")
    work.add_argument("--in-flight", type=positive_int, default=32, help="completions at once (default: 32)")
    work.add_argument("--input-words", type=positive_int, default=128, help="random words a prompt (default: 128)")
    work.add_argument("--output-len", type=positive_int, default=16, help="tokens out, ignore_eos (default: 16)")
    work.add_argument("--seed", type=int, default=1, help="seeds the prompts (default: 1)")
    servers = p.add_argument_group("servers")
    servers.add_argument("--trioserve-args", default="", help="more flags for trioserve serve, one string")
    servers.add_argument("--no-trioserve", action="store_true", help="measure llama-server only")
    servers.add_argument("--llama-server", default=None, help="the llama-server binary (none: trioserve only)")
    servers.add_argument("--llama-args", default="", help="flags for llama-server, one string: '-np 64 -c 524288'")
    servers.add_argument("--model", default=None, help="GGUF for llama-server (default: the default model's)")
    servers.add_argument("--skip-above-available", type=float, default=None, metavar="GIB",
                         help="start no llama-server whose KV cache leaves less than GIB available")  # fmt: skip
    out = p.add_argument_group("output")
    out.add_argument("--log-dir", type=Path, default=Path("/tmp"), help="servers' logs (default: /tmp)")
    p.set_defaults(func=run)
    return p


def send(url: str, args: argparse.Namespace) -> None:
    """``args.requests`` completions, ``args.in_flight`` at a time."""
    rng = random.Random(args.seed)
    prompts = [random_words(rng, args.input_words) for _ in range(args.requests)]
    with httpx.Client(base_url=url, timeout=600) as http:
        model = http.get("/v1/models").json()["data"][0]["id"]

        def one(prompt: str) -> None:
            body = {"model": model, "prompt": prompt, "max_tokens": args.output_len, "temperature": 0.0, "ignore_eos": True}
            http.post("/v1/completions", json=body).raise_for_status()

        with concurrent.futures.ThreadPoolExecutor(args.in_flight) as pool:
            list(pool.map(one, prompts))


def measure(name: str, command: list[str], url: str, args: argparse.Namespace) -> None:
    log = args.log_dir / f"rss_ready-{name}.log"
    start = time.monotonic()
    with running(command, url, log, 600) as proc:
        ready = tree_memory(proc.pid)
        print(f"{name}: ready in {time.monotonic() - start:.0f} s, RSS {ready.rss >> 20} MiB "
              f"(anon {ready.rss_anon >> 20}, file {ready.rss_file >> 20}, peak {ready.hwm >> 20})", flush=True)  # fmt: skip
        if args.requests:
            start = time.monotonic()
            send(url, args)
            after = tree_memory(proc.pid)
            print(f"{name}: after {args.requests} requests ({time.monotonic() - start:.0f} s), RSS {after.rss >> 20} MiB "
                  f"(anon {after.rss_anon >> 20}, file {after.rss_file >> 20}, peak {after.hwm >> 20})", flush=True)  # fmt: skip


def run(args: argparse.Namespace) -> int:
    if not args.no_trioserve:
        port = free_port()
        command = [str(TRIOSERVE), "serve", "--host", "127.0.0.1", "--port", str(port), "--shutdown-timeout", "5"]
        measure("trioserve", command + shlex.split(args.trioserve_args), f"http://127.0.0.1:{port}", args)
    if args.llama_server:
        model = args.model or str(default_model_path())
        port = free_port()
        command = [args.llama_server, "-m", model, "--host", "127.0.0.1", "--port", str(port)]
        command += shlex.split(args.llama_args)
        if args.skip_above_available is not None and not _fits(command, args.skip_above_available):
            return 0
        measure("llama-server", command, f"http://127.0.0.1:{port}", args)
    return 0


def _fits(command: list[str], keep_gib: float) -> bool:
    """Whether llama-server's KV cache (f16, from ``-c``) leaves ``keep_gib``
    GiB of the host's available memory; prints why not."""
    fields = gguf.GGUFReader(command[command.index("-m") + 1]).fields

    def value(key: str) -> int:
        field = next(f for name, f in fields.items() if name.endswith(key))
        return int(field.parts[field.data[0]][0])

    context = int(command[command.index("-c") + 1]) if "-c" in command else value(".context_length")
    head_dim = value(".embedding_length") // value(".attention.head_count")
    kv = 2 * 2 * value(".block_count") * value(".attention.head_count_kv") * head_dim * context
    left = (available_memory() - kv) / (1 << 30)
    if left < keep_gib:
        print(f"llama-server not started: its {kv / (1 << 30):.1f} GiB KV cache would leave {left:.1f} GiB available")
        return False
    return True
