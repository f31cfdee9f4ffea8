"""``trioserve bench real-size``: trioserve against llama-server on
random-weight checkpoints of the shapes people serve, with the machine's
roofline.

    trioserve bench real-size --llama-server /tmp/llama-build/bin/llama-server \\
        --shapes llama-3.2-1b --quants Q4_K_M --out bench-real-size --plot real_size.png

For each ``--shapes`` (Llama-3.2-1B and -3B, Qwen3-1.7B and -4B, and a
Qwen3-MoE of OLMoE-1B-7B's size, all with the default model's 49k
vocabulary) it writes a Hugging Face checkpoint of seeded random weights
with the default model's tokenizer, converts it to a BF16 GGUF with
llama.cpp's own convert_hf_to_gguf.py and quantizes that to each
``--quants`` with llama-quantize. The files are cached under
``--cache-dir``, one folder per shape and seed, one file per quantization,
and reused by the next run. It then runs ``trioserve bench vs-llama``'s
comparison on every file in turn (the same options), and measures this
machine's read bandwidth and GEMM peaks (bf16 and int8 at 32 and 512
rows) before and after the runs, keeping each figure's best; writing each one's results under ``--out`` and, for all,
``results.json`` and ``results.md``: the floors per shape and each
server's fraction of them. ``--prepare-only`` stops after the files;
``--from-json`` redraws the tables and the plot.

Build llama-server and llama-quantize with scripts/build_llama_server.sh;
the converter is taken from the llama.cpp sources it extracted (the build
folder's sibling llama.cpp-src), else from ``--llama-cpp-src``, else
extracted from llama-cpp-python's source distribution (downloaded with pip)
into the cache. The converter needs ``sentencepiece``.

``--isa native,avx2`` runs every server at each class, its AVX2 row beside
its native one: trioserve held to AVX2 (``TRIOSERVE_CPU_ASSUME`` and the
library caps of engine/kernels/capability.py, in the child's environment)
and the llama-server of ``--llama-server-avx2`` (scripts/build_llama_server.sh
--isa avx2). A row is labelled AVX2 only where the server's own report shows
nothing above it (trioserve's ``/version`` paths and torch capability,
llama-server's system_info line, both kept in results.json); else the run
stops before its benchmarks and its row says why. The roofline is measured
at each class too, AVX2's in a child held to it (the same bandwidth; torch's
GEMMs as the caps leave them, and trioserve's int8 kernel at the variant a
load held to AVX2 chooses); each row's fractions are of its class's floors.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import importlib.util
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import attrs

from ..arguments import name_list, usage_error
from ..real_size import (
    FLOAT_TYPE,
    QUANT_TYPES,
    SHAPES,
    CacheEntry,
    active_parameter_count,
    default_cache_root,
    download_sdist,
    extract_converter,
    parameter_count,
    write_checkpoint,
)
from ..real_size_report import format_report, plot_report
from ..roofline import Machine, expert_bytes, floors, measure_machine, read_gguf_tensors, weight_bytes_per_token
from ..vs_llama import NATIVE, Contender, isa_environment
from . import vs_llama

LLAMA_CPP_PYTHON_VERSION = "0.3.36"  # scripts/build_llama_server.sh's


def _choices(allowed) -> Callable[[str], list[str]]:
    def parse(text: str) -> list[str]:
        names = name_list(text)
        unknown = [n for n in names if n not in allowed]
        if unknown:
            raise argparse.ArgumentTypeError(f"unknown {', '.join(unknown)}; choose from {', '.join(allowed)}")
        return names

    return parse


def add_parser(commands) -> argparse.ArgumentParser:
    p = commands.add_parser(
        "real-size",
        help="trioserve against llama-server on random checkpoints of real shapes, with the roofline",
        description=__doc__.split("\n\n")[0].removeprefix("``trioserve bench real-size``: "),
        epilog=__doc__.split("\n\n", 2)[2],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    models = p.add_argument_group("checkpoints")
    models.add_argument("--shapes", type=_choices(SHAPES), default=list(SHAPES), metavar="NAME[,NAME...]",
                        help=f"shapes to run (default: all: {', '.join(SHAPES)})")
    models.add_argument("--quants", type=_choices(QUANT_TYPES), default=list(QUANT_TYPES), metavar="TYPE[,TYPE...]",
                        help=f"llama-quantize types (default: {','.join(QUANT_TYPES)})")
    models.add_argument("--weights-seed", type=int, default=0, help="the random weights' seed (default: 0)")
    models.add_argument("--cache-dir", type=Path, default=default_cache_root(),
                        help="where checkpoints and GGUF files are kept (default: %(default)s)")
    models.add_argument("--keep-checkpoint", action="store_true",
                        help="keep the Hugging Face checkpoint once converted (default: remove it)")
    models.add_argument("--llama-quantize", default=os.environ.get("LLAMA_QUANTIZE"),
                        help="the llama-quantize binary (default: $LLAMA_QUANTIZE, else beside --llama-server)")
    models.add_argument("--llama-cpp-src", type=Path, default=os.environ.get("LLAMA_CPP_SRC"),
                        help="llama.cpp sources holding convert_hf_to_gguf.py (default: $LLAMA_CPP_SRC, else "
                             "the build's sibling llama.cpp-src, else extracted from the sdist)")  # fmt: skip
    models.add_argument("--prepare-only", action="store_true", help="make the files, run no server")
    vs_llama.add_comparison_arguments(p, quantizations=("auto",), memory_after=0)
    out = p.add_argument_group("output")
    out.add_argument("--out", type=Path, default=Path("bench-real-size"), help="folder for JSON, tables and logs")
    out.add_argument("--plot", type=Path, default=None, help="write the plot here (PNG; needs the plot extra)")
    out.add_argument("--from-json", type=Path, default=None, help="only redraw tables and plot from this results.json")
    p.set_defaults(func=run)
    return p


def find_quantize(args: argparse.Namespace) -> Path | None:
    """``--llama-quantize``, else llama-quantize beside ``--llama-server``."""
    if args.llama_quantize:
        return Path(args.llama_quantize)
    if args.llama_server:
        return Path(args.llama_server).resolve().parent / "llama-quantize"
    found = shutil.which("llama-quantize")
    return Path(found) if found else None


def find_converter(args: argparse.Namespace, quantize: Path | None) -> Path:
    """convert_hf_to_gguf.py: ``--llama-cpp-src``'s, else the one the build
    script extracted beside its build folder, else one extracted from the
    sdist into the cache."""
    if args.llama_cpp_src is not None:
        return args.llama_cpp_src / "convert_hf_to_gguf.py"
    if quantize is not None:
        beside = quantize.resolve().parents[1].parent / "llama.cpp-src" / "convert_hf_to_gguf.py"
        if beside.is_file():
            return beside
    sdist = download_sdist(args.cache_dir / "sdist", LLAMA_CPP_PYTHON_VERSION)
    return extract_converter(sdist, args.cache_dir / f"llama.cpp-{LLAMA_CPP_PYTHON_VERSION}")


def convert(converter: Path, checkpoint: Path, out: Path, log: Path) -> None:
    """llama.cpp's converter: ``checkpoint`` to a BF16 GGUF at ``out``."""
    partial = out.with_name(out.name + ".partial")
    command = [sys.executable, str(converter), str(checkpoint), "--outfile", str(partial), "--outtype", "bf16"]
    _logged(command, log)
    partial.rename(out)


def quantize(binary: Path, source: Path, out: Path, quant: str, threads: int, log: Path) -> None:
    """``llama-quantize source out quant threads``."""
    partial = out.with_name(out.name + ".partial")
    _logged([str(binary), str(source), str(partial), quant, str(threads)], log)
    partial.rename(out)


def _logged(command: list[str], log: Path) -> None:
    with log.open("a") as file:
        file.write(f"$ {shlex.join(command)}\n")
        file.flush()
        done = subprocess.run(command, stdout=file, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        raise RuntimeError(f"{Path(command[1]).name if command[0] == sys.executable else Path(command[0]).name} "
                           f"exited with {done.returncode}: see {log}")  # fmt: skip


class Progress:
    """One line per step on stderr: a bar of steps done, then the step."""

    def __init__(self, total: int, width: int = 24) -> None:
        self.total, self.done, self.width = total, 0, width
        self.started = time.monotonic()

    def step(self, text: str) -> None:
        filled = self.width * self.done // max(self.total, 1)
        elapsed = time.monotonic() - self.started
        print(f"[{'#' * filled}{'.' * (self.width - filled)}] {self.done}/{self.total} {elapsed:6.0f}s  {text}",
              file=sys.stderr, flush=True)  # fmt: skip
        self.done += 1


def prepare(entry: CacheEntry, quants: list[str], *, converter, quantize_binary, threads: int, keep: bool,
            progress: Progress) -> None:  # fmt: skip
    """Make what ``entry`` lacks for ``quants``: the checkpoint, its BF16 GGUF, each quantized file."""
    from trioserve.testing.tiny_model import hf_tokenizer_folder

    entry.folder.mkdir(parents=True, exist_ok=True)
    log = entry.folder / "make.log"
    for step in entry.missing(tuple(quants)):
        progress.step(f"{entry.shape.name}: {step}")
        if step == "checkpoint":
            write_checkpoint(entry.shape, entry.seed, entry.checkpoint, hf_tokenizer_folder())
        elif step == "convert":
            if importlib.util.find_spec("sentencepiece") is None:
                raise RuntimeError("llama.cpp's convert_hf_to_gguf.py imports sentencepiece: pip install sentencepiece")
            convert(converter(), entry.checkpoint, entry.gguf(FLOAT_TYPE), log)
            if not keep:
                shutil.rmtree(entry.checkpoint)
        else:
            if quantize_binary is None or not os.access(quantize_binary, os.X_OK):
                raise RuntimeError(f"no llama-quantize binary ({quantize_binary}): build it with "
                                   "scripts/build_llama_server.sh, or give --llama-quantize")  # fmt: skip
            quantize(quantize_binary, entry.gguf(FLOAT_TYPE), entry.gguf(step), step, threads, log)


def steps_of(args: argparse.Namespace) -> int:
    """How many steps the progress bar counts: the files still to make, then one per comparison server."""
    servers = (len(args.quantizations) + (not args.no_llama_server)) * len(args.isas)
    made = sum(len(list(CacheEntry(args.cache_dir, SHAPES[name], args.weights_seed).missing(tuple(args.quants))))
               for name in args.shapes)  # fmt: skip
    return made + (0 if args.prepare_only else 2 + servers * len(args.shapes) * len(args.quants))


def write_outputs(document: dict, out: Path, plot: Path | None) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(document, indent=2) + "\n")
    (out / "results.md").write_text(format_report(document))
    if plot is not None:
        print(f"plot written to {plot_report(document, plot)}", file=sys.stderr)


def run(args: argparse.Namespace) -> int:
    """The comparison the parsed ``args`` describe; 1 if something failed."""
    if args.from_json is not None:
        document = json.loads(args.from_json.read_text())
        write_outputs(document, args.out, args.plot)
        print(format_report(document))
        return 0
    if args.num_prompts and len(args.num_prompts) not in (1, len(args.concurrency)):
        return usage_error("real-size", "--num-prompts takes one value or one per --concurrency value")
    missing = [] if args.prepare_only or args.no_llama_server else vs_llama.missing_llama_binaries(args)
    if missing:
        return usage_error("real-size", "; ".join(missing) + ", or give --no-llama-server")
    unbuilt = None if args.prepare_only or not args.quantizations else vs_llama.unbuilt_native_kernels()
    if unbuilt:
        return usage_error("real-size", unbuilt)
    if args.plot is not None:
        from ..plot import require_matplotlib

        require_matplotlib()  # fail before the runs, not after them
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda signum, frame: sys.exit(128 + signum))
    quantize_binary = find_quantize(args)
    converter_path: list[Path] = []

    def converter() -> Path:  # found (maybe downloaded) only when a conversion is due
        if not converter_path:
            converter_path.append(find_converter(args, quantize_binary))
        return converter_path[0]

    progress = Progress(steps_of(args))
    entries = [CacheEntry(args.cache_dir, SHAPES[name], args.weights_seed) for name in args.shapes]
    try:
        for entry in entries:
            prepare(entry, args.quants, converter=converter, quantize_binary=quantize_binary, threads=args.threads,
                    keep=args.keep_checkpoint, progress=progress)  # fmt: skip
    except (RuntimeError, OSError, subprocess.CalledProcessError) as exc:
        print(f"real-size: {exc}", file=sys.stderr)
        return 1
    if args.prepare_only:
        for entry in entries:
            for quant in args.quants:
                print(entry.gguf(quant))
        return 0

    progress.step("measuring the machine's read bandwidth and GEMM peaks")
    machines = measure_machines(args.isas, args.threads)
    binary = args.llama_server or vs_llama.llama_binary(args, args.isas[0])
    llama_version = None if args.no_llama_server else vs_llama.llama_server_version(binary)
    document = {"info": _info(args, llama_version), **machines_json(machines), "runs": []}
    for entry in entries:
        for quant in args.quants:
            document["runs"].append(compare_one(args, entry, quant, machines, llama_version, progress))
            write_outputs(document, args.out, None)
    progress.step("measuring the machine again: the floors take each figure's best")
    again = measure_machines(args.isas, args.threads)
    machines = {isa: machine.best(again[isa]) for isa, machine in machines.items()}
    document.update(machines_json(machines))
    for run in document["runs"]:
        run.update(floors_by_class(args, machines, SHAPES[run["shape"]], run["floors"]["weight_bytes"],
                                   run["floors"].get("expert_bytes", 0.0)))  # fmt: skip
    write_outputs(document, args.out, args.plot)
    print(format_report(document))
    failed = any(r.get("error") or any(s.get("error") for s in r["comparison"]["servers"]) for r in document["runs"])
    return 1 if failed else 0


def run_floors(args: argparse.Namespace, machine: Machine, shape, weight_bytes: float, all_expert_bytes: float) -> dict:
    return attrs.asdict(floors(machine, shape, weight_bytes, input_len=args.input_len, output_len=args.output_len,
                               streams=max(args.concurrency), all_expert_bytes=all_expert_bytes))  # fmt: skip


def floors_by_class(args: argparse.Namespace, machines: dict[str, Machine], shape, weight_bytes: float,
                    all_expert_bytes: float) -> dict:  # fmt: skip
    """A run's ``floors`` (native's, or its only class's) and, for each other
    class measured, ``floors_by_isa``: the same bytes, that class's peaks."""
    by_isa = {isa: run_floors(args, m, shape, weight_bytes, all_expert_bytes) for isa, m in machines.items()}
    first = NATIVE if NATIVE in by_isa else next(iter(by_isa))
    others = {isa: f for isa, f in by_isa.items() if isa != first}
    return {"floors": by_isa[first], **({"floors_by_isa": others} if others else {})}


def measure_machines(isas, threads: int) -> dict[str, Machine]:
    """The roofline's figures at each class: native's in this process,
    another's in a child held to it (``isa_environment``), since the
    libraries' caps take effect only before torch loads
    (``print_held_machine``)."""
    machines = {}
    for isa in isas:
        if isa == NATIVE:
            machines[isa] = measure_machine(threads)
            continue
        code = f"from trioserve.bench.figures.real_size import print_held_machine; print_held_machine({threads})"
        done = subprocess.run(["env", *isa_environment(isa), sys.executable, "-c", code], capture_output=True,
                              text=True, check=True)  # fmt: skip
        machines[isa] = Machine.from_json(json.loads(done.stdout.strip().splitlines()[-1]))
    return machines


def print_held_machine(threads: int) -> None:
    """Print the JSON of this process's roofline figures (``measure_machines``'
    child, started held to a class): the bandwidth, torch's GEMMs as its
    libraries' caps leave them, and trioserve's int8 kernel at the variant
    a model load here would choose (roofline.measure_gemm's default is the
    CPU's best, whatever ``TRIOSERVE_CPU_ASSUME`` says)."""
    from trioserve.engine.kernels import native
    from trioserve.engine.kernels.capability import CpuPaths

    from ..roofline import PEAK_ROWS, measure_bandwidth, measure_gemm

    peaks = {dtype: {rows: measure_gemm(dtype, rows, threads) for rows in PEAK_ROWS} for dtype in ("bf16", "int8")}
    paths = CpuPaths.from_environment()
    isa = next((isa for isa in native.LINEAR_ISA_ORDER if paths.works(f"quant_int8_native_{isa}")), None)
    if isa is not None:
        peaks["int8-trioserve"] = {rows: measure_gemm("int8-trioserve", rows, threads, isa=isa) for rows in PEAK_ROWS}
    print(json.dumps(Machine(measure_bandwidth(threads), peaks).to_json()))


def machines_json(machines: dict[str, Machine]) -> dict:
    """results.json's ``machine`` (native's, or the only class's) and
    ``machines``, every class's by name."""
    first = NATIVE if NATIVE in machines else next(iter(machines))
    return {"machine": machines[first].to_json(), "machines": {isa: m.to_json() for isa, m in machines.items()}}


def compare_one(args, entry: CacheEntry, quant: str, machines: dict[str, Machine], llama_version,
                progress: Progress) -> dict:  # fmt: skip
    """vs-llama's comparison on one cached file at each class, with its floors."""
    gguf, shape = entry.gguf(quant), entry.shape
    run = {"shape": shape.name, "quant": quant, "gguf": str(gguf), "gguf_bytes": gguf.stat().st_size,
           "parameters": parameter_count(shape), "active_parameters": active_parameter_count(shape)}  # fmt: skip
    tensors = read_gguf_tensors(gguf)
    run.update(floors_by_class(args, machines, shape, weight_bytes_per_token(tensors, shape), expert_bytes(tensors)))
    sub = copy.copy(args)
    sub.out, sub.model, sub.plot = args.out / f"{shape.name}-{quant}", str(gguf), None
    sub.out.mkdir(parents=True, exist_ok=True)
    contenders = [Contender.trioserve(q, shlex.split(args.trioserve_args)) for q in args.quantizations]
    if not args.no_llama_server:
        contenders.append(Contender.llama_server(gguf, shlex.split(args.llama_args)))
    contenders = vs_llama.at_classes(contenders, args.isas)
    run["comparison"] = vs_llama.compare(sub, gguf, contenders, llama_version, on_server=lambda c: progress.step(
        f"{shape.name} {quant}: {c.label}" + ("" if c.isa == NATIVE else f" at {c.isa}")))  # fmt: skip
    return run


def _info(args: argparse.Namespace, llama_version: str | None) -> dict:
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "shapes": args.shapes,
        "quants": args.quants,
        "weights_seed": args.weights_seed,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "concurrency": args.concurrency,
        "num_prompts": args.num_prompts,
        "threads": args.threads,
        "ctx_per_slot": args.ctx_per_slot,
        "isas": list(args.isas),
        "trioserve_commit": vs_llama._version(["git", "-C", str(vs_llama.ROOT), "describe", "--always", "--dirty"]),
        "llama_server_version": llama_version,
        "cpu": vs_llama._cpu(),
        "cpus": os.cpu_count(),
        "argv": sys.argv,
    }
