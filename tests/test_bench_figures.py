"""The ``trioserve bench`` commands behind docs/benchmarks.md and
docs/reliability.md: each takes the command lines the docs give, and the
quick ones run. They were scripts until issue 40:

| script | command |
| --- | --- |
| scripts/bench_vs_llama.py | trioserve bench vs-llama |
| scripts/rss_ready.py | trioserve bench rss-ready |
| scripts/bench_invariance.py | trioserve bench invariance |
| scripts/quant_quality.py | trioserve bench quality |
| scripts/bench_speculative.py | trioserve bench speculative |
| scripts/bench_structured.py | trioserve bench structured |
| scripts/bench_kv_dtype.py | trioserve bench kv-dtype |
| scripts/bench_qlinear.py | trioserve bench kernels |
| scripts/bench_cpu_paths.py | trioserve bench cpu-paths |
| scripts/bench_dp.py | trioserve bench dp |
| scripts/bench_worker_mode.py | trioserve bench worker-mode |
| scripts/bench_tp.py | trioserve bench tp |
| scripts/bench_actors.py | trioserve bench actors |
| scripts/bench_tracing.py | trioserve bench tracing |
| scripts/overload.py | trioserve bench overload |
| (new with issue 44) | trioserve bench slo |
| scripts/slow_reader.py | trioserve bench slow-reader |
| scripts/bench_suite.py | trioserve bench suite |
"""

from __future__ import annotations

import shlex

import pytest

from trioserve.bench.figures import COMMANDS
from trioserve.web.cli import build_parser

# The documented command lines, after `trioserve bench`.
DOCUMENTED = [
    "vs-llama --llama-server /b/llama-server --trioserve-quantization auto --concurrency 1,32 --num-prompts 4,32 "
    "--num-warmups 1 --llama-args='--cache-ram 0 --no-repack' --memory-after 500",
    "real-size --llama-server /b/llama-server --shapes llama-3.2-1b --quants Q4_K_M --num-prompts 4,32 "
    "--num-warmups 1 --llama-args='--cache-ram 0' --out bench-real-size --plot docs/images/real_size.png",
    "rss-ready --requests 200",
    "rss-ready --requests 64 --in-flight 64 --input-words 1000 --output-len 32",
    "rss-ready --no-trioserve --llama-server /b/llama-server --llama-args '-np 64 -c 524288 -t 2 -tb 2' --requests 200",
    "invariance --rounds 3",
    "quality --model smollm2-q4_k_m.gguf --quantization auto",
    "quality --quantization auto int8",
    "speculative --rounds 5",
    "structured --requests 32 --max-tokens 64 --c1-requests 3 --masks both --rounds 2",
    "kv-dtype --rounds 3 --dtypes float32,bfloat16,float16",
    "kernels --threads 2 --rows 1,32,64",
    "cpu-paths --rows 64 --threads 1",
    "dp --sequential-requests 2 --rounds 2",
    "worker-mode --repeats 2",
    "tp --tp 2 --threads 2 --layers 6 --profile-steps 16",
    "actors --requests 64 --max-tokens 64 --repeats 1",
    "tracing --outputs 64 --requests 2000",
    "overload --num-threads 1 --max-num-seqs 16 --input-len 32 --output-len 32 --duration 60 "
    "--calibration-requests 32 --out overload-results",
    "slo --rates 0.5,1,1.5 --burstiness 1,0.25 --requests 60 --num-threads 2 --out slo-results --plots docs/images",
    "slow-reader -- --num-threads 1",
    "suite --out bench-results --plots docs/images",
    "suite --dtype bfloat16 --out bench-bf16 --plots /tmp/bf16-img --skip start,prefix,memory,burst,sweep",
]


def parse(line: str):
    return build_parser().parse_args(["bench", *shlex.split(line)])


@pytest.mark.parametrize("line", DOCUMENTED, ids=[line.split()[0] for line in DOCUMENTED])
def test_the_documented_command_lines_parse(line):
    args = parse(line)
    assert callable(args.func)


def test_every_command_is_documented_here():
    names = {line.split()[0] for line in DOCUMENTED}
    parser = build_parser()
    bench = parser._subparsers._group_actions[0].choices["bench"]
    commands = set(bench._subparsers._group_actions[0].choices)
    assert commands == names | {"serve", "offline"}
    assert len(COMMANDS) == len(names)


def test_values_the_commands_share():
    assert parse("slow-reader --seconds 2 -- --num-threads 1 --max-num-seqs 4").server_args == [
        "--num-threads", "1", "--max-num-seqs", "4"
    ]  # fmt: skip
    assert parse("dp --layouts 1x2,2x1").layouts == [(1, 2), (2, 1)]
    assert parse("suite --skip start,memory").skip == {"start", "memory"}
    assert parse("kv-dtype --concurrency 1,32").concurrency == [1, 32]


@pytest.mark.parametrize(
    "line",
    ["dp --layouts 2", "suite --skip start,lunch", "kv-dtype --concurrency 0", "tp --tp 0", "invariance --rounds x"],
)
def test_bad_values_stop_at_parsing(line, capsys):
    with pytest.raises(SystemExit):
        parse(line)
    assert "error: argument" in capsys.readouterr().err


def test_tracing_runs(capsys):
    args = parse("tracing --outputs 4 --requests 10")
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert "tracing off:" in out and "tracing on:" in out


def test_cpu_paths_runs(capsys):
    args = parse("cpu-paths --rows 2 --seconds 0.01 --threads 1")
    assert args.func(args) == 0
    assert "float32 plain" in capsys.readouterr().out
