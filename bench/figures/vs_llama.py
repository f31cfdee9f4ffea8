"""``trioserve bench vs-llama``: trioserve against llama.cpp's llama-server,
side by side in one run.

    trioserve bench vs-llama --llama-server /path/to/llama-server \\
        --out bench-vs-llama --plot docs/images/vs_llama.png

For each configuration in turn (trioserve with each ``--trioserve-quantization``,
then llama-server), it starts the server on a free 127.0.0.1 port, on the
same GGUF file (the default model unless ``--model``), with as many slots as
the highest concurrency, the same context per slot and the same threads;
sends one non-streamed request to count the tokens it really produces with
``ignore_eos``; runs ``trioserve bench serve`` at each ``--concurrency``
(random prompts of ``--input-len`` tokens, ``--output-len`` out, greedy,
``ignore_eos``; the same prompts for every server); sends more requests
until the server has served ``--memory-after`` and reads the resident
memory of its process tree from /proc; and stops it, also when something
fails. Only one server runs at a time. It writes ``results.json`` and
``results.md`` (the tables) into ``--out``, and the plot with ``--plot``.
``--from-json`` redraws the tables and the plot from an earlier run.

Build llama-server with scripts/build_llama_server.sh. Flags after
``--trioserve-args=`` / ``--llama-args=`` (one quoted string each) go to
every trioserve / the llama-server command line unchanged. The parts that
need no server (command lines, token checks, tables, plot) are
``trioserve.bench.vs_llama``.

``--isa native,avx2`` runs each configuration at each class in turn:
trioserve held to AVX2 by the variables engine/kernels/capability.py names
(``env`` sets them for the child alone) and the llama-server of
``--llama-server-avx2``; a row is labelled AVX2 only where the server's own
report (trioserve's ``/version``, llama-server's system_info line) shows
nothing above it, and its ratios are to llama-server's row of its class.

``--paired-rounds N`` adds a phase after those runs, because on a shared VM
the host moves between runs: its read bandwidth changes over minutes (the
vCPUs landing on shared or separate physical cores) and one stream's time
per token follows it, so servers timed minutes apart measure the host as
much as the engines. For each class it starts every server that finished
its runs at once (the same command lines, each on its own free port), then
for N rounds times one stream on each in turn (``bench serve`` at
concurrency 1, 2 requests after 1 warmup, the same prompts for all in a
round), the order reversed every other round (ABBA), with a read-bandwidth
probe before each run. results.json's ``paired`` keeps each round's TPOT
p50, TTFT p50 and bandwidth per server, and the median over rounds of the
per-round ratios to llama-server with their min and max (``trioserve.bench
.paired``); the tables show them. It needs the memory of all the servers of
a class at once.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from trioserve.engine.loading.sources import DEFAULT_MODEL_NAME, default_model_path

from ..arguments import int_list, non_negative_int, positive_int, usage_error
from ..datasets import load_tokenizer, random_dataset
from ..memory import tree_memory
from ..paired import abba_order, summarize
from ..plot import require_matplotlib
from ..process import TRIOSERVE, ServerStartError, free_port, running
from ..vs_llama import (
    LLAMA_SERVER,
    NATIVE,
    TRIOSERVE as TRIOSERVE_KIND,
    Contender,
    Layout,
    check_llama_isa,
    check_trioserve_isa,
    check_tokens,
    format_tables,
    llama_server_command,
    logprob_token_count,
    parse_isas,
    parse_quantizations,
    plot_comparison,
    proven,
    run_summary,
    trioserve_command,
)

ROOT = Path(__file__).resolve().parents[2]
# A paired round's run on each server: few requests, so that a round is
# short next to the minutes over which the host moves.
PAIRED_PROMPTS = 2
PAIRED_WARMUPS = 1
# Round r's prompts are seeded seed + PAIRED_SEED + r: the same for every
# server in a round, apart from the sequential runs' and the token count's.
PAIRED_SEED = 3000


class ServerFailed(RuntimeError):
    """A server exited, or did not become ready, or a run against it failed."""


class IsaNotProven(ServerFailed):
    """A server's own report shows it did not run at the class it was asked
    for; ``result`` holds what it showed."""

    def __init__(self, message: str, result: dict) -> None:
        super().__init__(message)
        self.result = result


def _quantizations(text: str) -> tuple[str, ...]:
    try:
        return parse_quantizations(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("--trioserve-quantization: ")) from None


def _isas(text: str) -> tuple[str, ...]:
    try:
        return parse_isas(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("--isa: ")) from None


def add_parser(commands) -> argparse.ArgumentParser:
    p = commands.add_parser(
        "vs-llama",
        help="trioserve against llama-server on the same GGUF, side by side",
        description=__doc__.split("\n\n")[0].removeprefix("``trioserve bench vs-llama``: "),
        epilog=__doc__.split("\n\n", 2)[2],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_comparison_arguments(p, quantizations=("none", "int8", "int4"), memory_after=500)
    p.add_argument_group("model").add_argument(
        "--model", default=None, help="GGUF file both serve (default: the default model's)")
    out = p.add_argument_group("output")
    out.add_argument("--out", type=Path, default=Path("bench-vs-llama"), help="folder for JSON, tables and logs")
    out.add_argument("--plot", type=Path, default=None, help="write the plot here (PNG; needs the plot extra)")
    out.add_argument("--from-json", type=Path, default=None, help="only redraw tables and plot from this results.json")
    p.set_defaults(func=run)
    return p


def add_comparison_arguments(p: argparse.ArgumentParser, *, quantizations: tuple[str, ...], memory_after: int) -> None:
    """The servers' and the workload's options of a comparison against
    llama-server (``compare`` reads them), with these defaults."""
    who = p.add_argument_group("servers")
    who.add_argument("--trioserve-quantization", dest="quantizations", type=_quantizations,
                     default=quantizations, metavar=",".join(quantizations),
                     help="trioserve configurations to run, by --quantization (auto, none, int8, int4); "
                          f"'' runs none (default: {','.join(quantizations)})")  # fmt: skip
    who.add_argument("--llama-server", default=os.environ.get("LLAMA_SERVER") or shutil.which("llama-server"),
                     help="the llama-server binary (default: $LLAMA_SERVER, else llama-server on PATH)")
    who.add_argument("--llama-server-avx2", default=os.environ.get("LLAMA_SERVER_AVX2"),
                     help="the llama-server binary of --isa avx2, built by scripts/build_llama_server.sh --isa avx2 "
                          "(default: $LLAMA_SERVER_AVX2)")  # fmt: skip
    who.add_argument("--no-llama-server", action="store_true", help="run the trioserve configurations only")
    who.add_argument("--isa", dest="isas", type=_isas, default=(NATIVE,), metavar="native[,avx2]",
                     help="instruction set classes to run every server at, each beside the other: avx2 holds "
                          "trioserve to AVX2 (TRIOSERVE_CPU_ASSUME and the library caps, engine/kernels/"
                          "capability.py) and runs --llama-server-avx2; a row is labelled AVX2 only where the "
                          "server's own report shows nothing above it (default: native)")  # fmt: skip
    who.add_argument("--trioserve-args", default="", metavar="'FLAGS'",
                     help="more flags for every trioserve serve, one string: --trioserve-args='--dtype bfloat16'")
    who.add_argument("--llama-args", default="", metavar="'FLAGS'",
                     help="more flags for llama-server, one string: --llama-args='--cache-ram 0'")
    who.add_argument("--ctx-per-slot", type=positive_int, default=512,
                     help="context per sequence: trioserve --max-model-len; llama-server -c is this times the "
                          "slots (default: 512)")  # fmt: skip
    who.add_argument("--threads", type=positive_int, default=2, help="trioserve --num-threads, llama-server -t/-tb")
    who.add_argument("--ready-timeout", type=float, default=600.0, help="seconds a server may take to start")

    load = p.add_argument_group("workload")
    load.add_argument("--concurrency", type=lambda text: sorted(set(int_list(text))), default=[1, 32], metavar="1,32",
                      help="bench serve --max-concurrency values; the highest is both servers' slot count")
    load.add_argument("--input-len", type=positive_int, default=128, help="prompt tokens (default: 128)")
    load.add_argument("--output-len", type=positive_int, default=128, help="tokens out, ignore_eos (default: 128)")
    load.add_argument("--num-prompts", type=int_list, default=None, metavar="N[,N...]",
                      help="timed requests per concurrency: one value for all, or one per --concurrency value "
                           "(default: max(16, 2 x concurrency))")
    load.add_argument("--num-warmups", type=non_negative_int, default=2, help="untimed requests before each timed run")
    load.add_argument("--memory-after", type=non_negative_int, default=memory_after,
                      help="requests a server has served (all runs included) when its memory is read "
                           f"(default: {memory_after})")  # fmt: skip
    load.add_argument("--memory-input-len", type=positive_int, default=128,
                      help="prompt tokens of the requests sent to reach --memory-after")
    load.add_argument("--memory-output-len", type=positive_int, default=16,
                      help="output tokens of the requests sent to reach --memory-after")
    load.add_argument("--seed", type=int, default=0, help="prompts (the same for every server)")
    load.add_argument("--paired-rounds", type=non_negative_int, default=0, metavar="N",
                      help="after the runs, start every server of a class at once and time one stream on each, "
                           f"N rounds, order ABBA, {PAIRED_PROMPTS} requests each after {PAIRED_WARMUPS} warmup, a "
                           "bandwidth probe before each run: the host moves between runs, a round does not; needs "
                           "the memory of all the servers at once (default: 0, off)")  # fmt: skip


def prompts_at(num_prompts: list[int] | None, index: int, concurrency: int) -> int:
    """The timed requests of the ``index``-th concurrency: ``--num-prompts``'
    value for it (or its only value), else max(16, 2 x concurrency)."""
    if not num_prompts:
        return max(16, 2 * concurrency)
    return num_prompts[index] if len(num_prompts) > 1 else num_prompts[0]


def bench(url: str, model: Path, out: Path, *, concurrency: int, num_prompts: int, warmups: int, input_len: int,
          output_len: int, seed: int) -> dict:  # fmt: skip
    """One ``trioserve bench serve`` run; its JSON result (per-request lists included)."""
    command = [
        str(TRIOSERVE), "bench", "serve", "--base-url", url, "--tokenizer", str(model), "--dataset", "random",
        "--input-len", str(input_len), "--output-len", str(output_len), "--ignore-eos", "--seed", str(seed),
        "--max-concurrency", str(concurrency), "--num-prompts", str(num_prompts), "--num-warmups", str(warmups),
        "--result-json", str(out), "--save-detailed", "--no-progress",
    ]  # fmt: skip
    print("$", shlex.join(command[1:]), flush=True)
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise ServerFailed(f"bench serve exited with {done.returncode}: {done.stderr.strip()[-500:]}")
    return json.loads(out.read_text())


def count_tokens(url: str, prompt: str, output_len: int) -> dict:
    """Send one non-streamed greedy request with ``ignore_eos`` and
    ``logprobs``: how many tokens the server says it produced, and how many
    it gave logprobs for."""
    served = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
    body = {"model": served, "prompt": prompt, "max_tokens": output_len, "temperature": 0.0,
            "ignore_eos": True, "logprobs": 1}  # fmt: skip
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=600)
    if response.status_code != 200:
        raise ServerFailed(f"the token-count request got HTTP {response.status_code}: {response.text[:300]}")
    data = response.json()
    choice = data["choices"][0]
    return {
        "asked": output_len,
        "usage_completion_tokens": (data.get("usage") or {}).get("completion_tokens"),
        "usage_prompt_tokens": (data.get("usage") or {}).get("prompt_tokens"),
        "logprob_tokens": logprob_token_count(data),
        "finish_reason": choice.get("finish_reason"),
        "text": choice.get("text"),
    }


def llama_binary(args: argparse.Namespace, isa: str) -> str | None:
    """The llama-server binary of class ``isa``."""
    return args.llama_server if isa == NATIVE else getattr(args, f"llama_server_{isa}")


def missing_llama_binaries(args: argparse.Namespace) -> list[str]:
    """What is wrong with the llama-server binaries of ``args.isas``, one
    phrase each (empty: each is there and executable)."""
    missing = []
    for isa in args.isas:
        binary = llama_binary(args, isa)
        if not binary or not os.access(binary, os.X_OK):
            flag = "--llama-server" if isa == NATIVE else f"--llama-server-{isa}"
            build = "" if isa == NATIVE else f" --isa {isa}"
            missing.append(f"no llama-server binary for {isa} ({flag} {binary!r}): build it with "
                           f"scripts/build_llama_server.sh{build} and pass {flag} PATH")  # fmt: skip
    return missing


def unbuilt_native_kernels() -> str | None:
    """Why trioserve's servers here would run without their native kernels
    (none built for this source: after an edit of engine/kernels/csrc, until
    a build), or None. They would still serve, on ATen's fallback kernels
    at about half the speed, and a comparison would time those under
    trioserve's name. None too where the kernels are switched off on
    purpose (``TRIOSERVE_NATIVE_KERNELS=0``)."""
    from trioserve.engine.kernels import native

    if os.environ.get(native.SWITCH_ENV, "1").strip() == "0":
        return None
    path = native.library_path()
    if path.is_file():
        return None
    return (f"trioserve's native kernels are not built for this source (no {path}), so its servers would run "
            f"ATen's fallback kernels: build them with python -m trioserve.engine.kernels.native (or "
            f"scripts/setup.sh), or set {native.SWITCH_ENV}=0 to time the fallback")  # fmt: skip


def llama_system_info(binary: str | Path, threads: int, folder: Path) -> str | None:
    """The system_info line llama-server ``binary`` prints on this machine
    (the CPU features its backend runs); None if it printed none. It prints
    it only at verbosity 4, so it is read from a start of its own on a
    model that does not exist, which stops right after it: the timed
    server keeps its usual logging."""
    command = [str(binary), "-lv", "4", "-t", str(threads), "--port", "0", "-m", str(folder / "no-such-model.gguf")]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired):
        return None
    for line in (done.stdout + done.stderr).splitlines():
        if "system_info:" in line:
            return line.partition("system_info:")[2].strip()
    return None


def trioserve_cpu(url: str) -> dict | None:
    """The ``cpu`` block of a trioserve server's ``/version``: the paths its
    CPU and class let it choose and what each model chose."""
    return httpx.get(f"{url}/version", timeout=30).json().get("cpu")


def server_command(contender: Contender, args: argparse.Namespace, layout: Layout, model: Path,
                   port: int) -> list[str]:  # fmt: skip
    """The command line that serves ``contender`` on ``port``."""
    if contender.kind == LLAMA_SERVER:
        return llama_server_command(llama_binary(args, contender.isa), model, contender, layout, port)
    command = trioserve_command(TRIOSERVE, contender, layout, port)
    return command + (["--model", str(model)] if args.model is not None else [])


def measure(contender: Contender, args: argparse.Namespace, layout: Layout, model: Path, prompt: str) -> dict:
    """Start one server, check that it runs at its class, run every part
    against it, stop it."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    result: dict = {"label": contender.label, "kind": contender.kind, "quantization": contender.quantization,
                    "isa": contender.isa}  # fmt: skip
    command = server_command(contender, args, layout, model, port)
    if contender.kind == LLAMA_SERVER:
        result["system_info"] = system_info = llama_system_info(llama_binary(args, contender.isa), layout.threads,
                                                                args.out)  # fmt: skip
        check = check_llama_isa(contender.isa, system_info)
    result.update(command=command, loadavg_before=os.getloadavg(), runs={})
    started = time.monotonic()
    with running(command, url, args.out / f"{contender.slug}.log", args.ready_timeout) as proc:
        result["ready_s"] = time.monotonic() - started
        if contender.kind != LLAMA_SERVER:
            result["cpu"] = cpu = trioserve_cpu(url)
            check = check_trioserve_isa(contender.isa, cpu)
        result["isa_check"] = check.to_json()
        if not check.proven:  # before the runs: minutes spent on a row the report will not label
            raise IsaNotProven(f"{contender.label} asked to run at {contender.isa}: {check.reason} "
                               f"(found {check.found})", result)  # fmt: skip
        memory = {"ready": tree_memory(proc.pid).to_json()}
        result["token_count"] = counted = count_tokens(url, prompt, args.output_len)
        if not counted["usage_completion_tokens"] == counted["logprob_tokens"] == args.output_len:
            print(f"warning: {contender.label} answered a request for {args.output_len} tokens with ignore_eos "
                  f"with {counted['usage_completion_tokens']} (usage) / {counted['logprob_tokens']} (logprobs)",
                  file=sys.stderr, flush=True)  # fmt: skip
        served = 1
        for index, concurrency in enumerate(args.concurrency):
            prompts = prompts_at(args.num_prompts, index, concurrency)
            run = bench(url, model, args.out / f"{contender.slug}-c{concurrency}.json", concurrency=concurrency,
                        num_prompts=prompts, warmups=args.num_warmups, input_len=args.input_len,
                        output_len=args.output_len, seed=args.seed + concurrency)  # fmt: skip
            result["runs"][str(concurrency)] = summary = run_summary(run, args.output_len)
            if not summary["tokens"]["exact"]:
                print(f"warning: {contender.label} at concurrency {concurrency} produced {summary['tokens']} "
                      f"tokens per request, not {args.output_len}", file=sys.stderr, flush=True)  # fmt: skip
            served += prompts + args.num_warmups
            memory[f"after_c{concurrency}"] = tree_memory(proc.pid).to_json()
        if args.memory_after > served:
            bench(url, model, args.out / f"{contender.slug}-memory.json", concurrency=layout.slots,
                  num_prompts=args.memory_after - served, warmups=0, input_len=args.memory_input_len,
                  output_len=args.memory_output_len, seed=args.seed + 2000)  # fmt: skip
            served = args.memory_after
        memory["after"] = tree_memory(proc.pid).to_json()
        memory["requests"] = served
        result["memory"] = memory
    result["loadavg_after"] = os.getloadavg()
    return result


def _version(command: list[str]) -> str:
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"unknown ({exc})"
    return (done.stdout + done.stderr).strip()


def _cpu() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    return platform.processor()


def write_outputs(document: dict, out: Path, plot: Path | None) -> None:
    (out / "results.json").write_text(json.dumps(document, indent=2) + "\n")
    (out / "results.md").write_text(format_tables(document))
    if plot is not None:
        print(f"plot written to {plot_comparison(document, plot)}", file=sys.stderr)


def run(args: argparse.Namespace) -> int:
    """The comparison the parsed ``args`` describe; 1 if a server failed."""
    if args.num_prompts and len(args.num_prompts) not in (1, len(args.concurrency)):
        count = len(args.concurrency)
        return usage_error("vs-llama", f"--num-prompts takes one value or one per --concurrency value ({count})")
    if args.from_json is not None:
        document = json.loads(args.from_json.read_text())
        args.out.mkdir(parents=True, exist_ok=True)
        write_outputs(document, args.out, args.plot)
        print(format_tables(document))
        return 0
    if args.plot is not None:
        require_matplotlib()  # fail before the runs, not after them
    unbuilt = unbuilt_native_kernels() if args.quantizations else None
    if unbuilt:
        return usage_error("vs-llama", unbuilt)
    model = Path(args.model) if args.model else default_model_path()
    contenders = [Contender.trioserve(q, shlex.split(args.trioserve_args)) for q in args.quantizations]
    llama_version = None
    if not args.no_llama_server:
        missing = missing_llama_binaries(args)
        if missing:
            return usage_error("vs-llama", "; ".join(missing) + ", or give --no-llama-server")
        contenders.append(Contender.llama_server(model, shlex.split(args.llama_args)))
        llama_version = llama_server_version(args.llama_server or llama_binary(args, args.isas[0]))
    contenders = at_classes(contenders, args.isas)
    if not contenders:
        return usage_error("vs-llama", "nothing to run")
    # SIGTERM/SIGHUP unwind like Ctrl-C, so the running server is stopped.
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda signum, frame: sys.exit(128 + signum))
    document = compare(args, model, contenders, llama_version)
    write_outputs(document, args.out, args.plot)
    print(format_tables(document))
    return 1 if any(s.get("error") for s in [*document["servers"], *document.get("paired", [])]) else 0


def at_classes(contenders: list[Contender], isas: tuple[str, ...]) -> list[Contender]:
    """Each of ``contenders`` at each class of ``isas``, a configuration's
    classes one after the other (its rows side by side)."""
    return [contender.at(isa) for contender in contenders for isa in isas]


def llama_server_version(binary: str) -> str:
    """What ``binary --version`` prints."""
    return _version([binary, "--version"])


def compare(args: argparse.Namespace, model: Path, contenders: list[Contender], llama_version: str | None,
            on_server=None) -> dict:  # fmt: skip
    """Run each of ``contenders`` in turn on ``model`` as ``args`` (this
    command's parsed options) say, writing results.json and results.md into
    ``args.out`` after each; the document. ``on_server(contender)`` is
    called before each server starts (a progress line)."""
    # The prompt of the token-count request (the runs' own come from bench serve).
    prompt = random_dataset(load_tokenizer(model), num_prompts=1, input_len=args.input_len,
                            output_len=args.output_len, seed=args.seed + 1000)[0].prompt  # fmt: skip
    layout = Layout(slots=max(args.concurrency), ctx_per_slot=args.ctx_per_slot, threads=args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    document = {
        "info": {
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "model": str(model),
            "model_name": model.stem if args.model else DEFAULT_MODEL_NAME,
            "input_len": args.input_len,
            "output_len": args.output_len,
            "concurrency": args.concurrency,
            "num_prompts": args.num_prompts,
            "num_warmups": args.num_warmups,
            "slots": layout.slots,
            "ctx_per_slot": layout.ctx_per_slot,
            "threads": layout.threads,
            "memory_after_requests": args.memory_after,
            "memory_request": [args.memory_input_len, args.memory_output_len],
            "seed": args.seed,
            "paired_rounds": getattr(args, "paired_rounds", 0),
            "trioserve_commit": _version(["git", "-C", str(ROOT), "describe", "--always", "--dirty"]),
            "llama_server_version": llama_version,
            "isas": list(getattr(args, "isas", (NATIVE,))),
            "cpu": _cpu(),
            "cpus": os.cpu_count(),
            "argv": sys.argv,
        },
        "servers": [],
    }
    for contender in contenders:
        print(f"== {contender.label} ({contender.isa})", flush=True)
        if on_server is not None:
            on_server(contender)
        try:
            document["servers"].append(measure(contender, args, layout, model, prompt))
        except (ServerFailed, ServerStartError, OSError, httpx.HTTPError, ValueError, KeyError) as exc:
            print(f"{contender.label}: {exc}", file=sys.stderr, flush=True)
            shown = exc.result if isinstance(exc, IsaNotProven) else {}
            document["servers"].append({**shown, "label": contender.label, "kind": contender.kind,
                                        "quantization": contender.quantization, "isa": contender.isa,
                                        "error": str(exc)})  # fmt: skip
        write_outputs(document, args.out, None)  # what is done survives a later failure
    if getattr(args, "paired_rounds", 0):
        document["paired"] = [paired_class(args, layout, model, group, isa)
                              for isa, group in paired_groups(contenders, document["servers"])]  # fmt: skip
        write_outputs(document, args.out, None)
    return document


def paired_groups(contenders: list[Contender], results: list[dict]) -> list[tuple[str, list[tuple[Contender, dict]]]]:
    """The servers of each class that the paired rounds run, with their
    results: those that finished their runs at the class they asked for,
    where a class has a llama-server and a trioserve among them (else there
    is nothing to pair)."""
    groups: dict[str, list[tuple[Contender, dict]]] = {}
    for contender, result in zip(contenders, results):
        if not result.get("error") and proven(result):
            groups.setdefault(contender.isa, []).append((contender, result))
    paired = []
    for isa, group in groups.items():
        if {c.kind for c, _ in group} == {TRIOSERVE_KIND, LLAMA_SERVER}:
            paired.append((isa, group))
        else:
            print(f"paired rounds at {isa}: skipped, no llama-server and trioserve both finished", flush=True)
    return paired


def paired_class(args: argparse.Namespace, layout: Layout, model: Path, members: list[tuple[Contender, dict]],
                 isa: str) -> dict:  # fmt: skip
    """``args.paired_rounds`` rounds of one-stream runs on every server of
    ``members`` (one class, each with its result of the runs) up at once, order ABBA, a bandwidth probe before
    each run; the class's entry of results.json's ``paired``. A server that
    fails to start or a run that fails ends the rounds with ``error`` set
    (what was measured kept); every server is stopped, also then."""
    from ..roofline import measure_bandwidth  # torch: only where the rounds run

    group = [contender for contender, _ in members]
    print(f"== paired rounds at {isa}: {', '.join(c.label for c in group)}", flush=True)
    # The label's class is the one the runs proved (vs_llama.server_label).
    servers = [{"label": c.label, "kind": c.kind, "isa": c.isa, "isa_check": result.get("isa_check"),
                "tpot_ms": [], "ttft_ms": [], "bandwidth_gbs": [], "tokens_exact": []}
               for c, result in members]  # fmt: skip
    entry: dict = {"isa": isa, "rounds": args.paired_rounds, "num_prompts": PAIRED_PROMPTS,
                   "num_warmups": PAIRED_WARMUPS, "order": [], "servers": servers}  # fmt: skip
    try:
        with contextlib.ExitStack() as stack:
            urls = []
            for contender in group:  # each started once the one before listens: free_port gives a new port
                port = free_port()
                urls.append(url := f"http://127.0.0.1:{port}")
                stack.enter_context(running(server_command(contender, args, layout, model, port), url,
                                            args.out / f"paired-{contender.slug}.log", args.ready_timeout))  # fmt: skip
            for index in range(args.paired_rounds):
                order = abba_order(range(len(group)), index)
                entry["order"].append([group[k].label for k in order])
                for k in order:
                    bandwidth = measure_bandwidth(layout.threads, nbytes=2**29, repeats=3)
                    result = bench(urls[k], model, args.out / f"paired-{group[k].slug}-r{index}.json",
                                   concurrency=1, num_prompts=PAIRED_PROMPTS, warmups=PAIRED_WARMUPS,
                                   input_len=args.input_len, output_len=args.output_len,
                                   seed=args.seed + PAIRED_SEED + index)  # fmt: skip
                    server = servers[k]
                    server["tpot_ms"].append(result.get("median_tpot_ms"))
                    server["ttft_ms"].append(result.get("median_ttft_ms"))
                    server["bandwidth_gbs"].append(bandwidth / 1e9)
                    server["tokens_exact"].append(check_tokens(result, args.output_len).exact)
                    tpot = server["tpot_ms"][-1]
                    print(f"round {index} {group[k].label}: TPOT p50 "
                          f"{'n/a' if tpot is None else f'{tpot:.1f}'} ms, bandwidth {bandwidth / 1e9:.1f} GB/s",
                          flush=True)  # fmt: skip
    except (ServerFailed, ServerStartError, OSError, httpx.HTTPError, ValueError, KeyError) as exc:
        print(f"paired rounds at {isa}: {exc}", file=sys.stderr, flush=True)
        entry["error"] = str(exc)
    entry["summary"] = summarize(servers, next(c.label for c in group if c.kind == LLAMA_SERVER))
    return entry
