"""Resident memory of a server at ready and after requests: trioserve, and
llama-server beside it on the same GGUF.

    .venv/bin/python scripts/rss_ready.py [--requests 500] [--in-flight 32]
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
import contextlib
import os
import random
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

from trioserve.bench.datasets import random_words
from trioserve.bench.process import free_port, wait_healthy
from trioserve.bench.memory import tree_memory

BIN = Path(sys.executable).parent / "trioserve"


@contextlib.contextmanager
def running(command: list[str], log: Path, url: str) -> Iterator[subprocess.Popen]:
    """``command`` in a session of its own; yielded once ``url``/health
    answers; the session stopped (SIGTERM, then SIGKILL) when the block ends."""
    print("$", shlex.join(command), flush=True)
    with open(log, "w") as output:
        proc = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            wait_healthy(proc, url, 600, name=Path(command[0]).name, see=f"; see {log}")
            yield proc
        finally:
            for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, sig)
                try:
                    proc.wait(timeout=wait)
                    break
                except subprocess.TimeoutExpired:
                    continue


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
    log = Path(args.log_dir) / f"rss_ready-{name}.log"
    start = time.monotonic()
    with running(command, log, url) as proc:
        ready = tree_memory(proc.pid)
        print(f"{name}: ready in {time.monotonic() - start:.0f} s, RSS {ready.rss >> 20} MiB "
              f"(anon {ready.rss_anon >> 20}, file {ready.rss_file >> 20}, peak {ready.hwm >> 20})", flush=True)  # fmt: skip
        if args.requests:
            start = time.monotonic()
            send(url, args)
            after = tree_memory(proc.pid)
            print(f"{name}: after {args.requests} requests ({time.monotonic() - start:.0f} s), RSS {after.rss >> 20} MiB "
                  f"(anon {after.rss_anon >> 20}, file {after.rss_file >> 20}, peak {after.hwm >> 20})", flush=True)  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=500)
    parser.add_argument("--in-flight", type=int, default=32)
    parser.add_argument("--input-words", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--trioserve-args", default="", help="more flags for trioserve serve, one string")
    parser.add_argument("--no-trioserve", action="store_true")
    parser.add_argument("--llama-server", default=None, help="the llama-server binary (none: trioserve only)")
    parser.add_argument("--llama-args", default="", help="flags for llama-server, one string: '-np 64 -c 524288'")
    parser.add_argument("--model", default=None, help="GGUF for llama-server (default: the default model's)")
    parser.add_argument("--skip-above-available", type=float, default=None, metavar="GIB")
    parser.add_argument("--log-dir", default="/tmp")
    args = parser.parse_args()

    if not args.no_trioserve:
        port = free_port()
        command = [str(BIN), "serve", "--host", "127.0.0.1", "--port", str(port), "--shutdown-timeout", "5"]
        measure("trioserve", command + shlex.split(args.trioserve_args), f"http://127.0.0.1:{port}", args)
    if args.llama_server:
        from trioserve.engine.loading.sources import default_model_path

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
    import gguf

    from trioserve.engine.core.kv_budget import available_memory

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


if __name__ == "__main__":
    raise SystemExit(main())
