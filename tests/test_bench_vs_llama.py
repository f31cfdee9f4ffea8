"""The parts of ``trioserve bench vs-llama`` that need no server: the two
command lines, the token-count check, and the tables and plot drawn from its
JSON. Nothing here needs llama.cpp."""

from __future__ import annotations

import copy
import json
import os
import statistics
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from trioserve.bench.vs_llama import (
    Contender,
    Layout,
    check_tokens,
    format_tables,
    gguf_weight_type,
    llama_server_command,
    logprob_token_count,
    parse_quantizations,
    plot_comparison,
    ratio_rows,
    trioserve_command,
)
from trioserve.bench.vs_llama import (
    check_llama_isa,
    check_trioserve_isa,
    isa_environment,
    parse_isas,
    server_label,
)
from trioserve.bench.figures import vs_llama as vs_llama_command
from trioserve.bench.figures.vs_llama import paired_class, paired_groups, prompts_at, unbuilt_native_kernels
from trioserve.bench.paired import abba_order, ratio_summary, round_ratios, summarize
from trioserve.web.cli import build_parser
from trioserve.web.engine_options import engine_config_from_args

LAYOUT = Layout(slots=32, ctx_per_slot=512, threads=2)


def vs_llama(*argv: str):
    """``trioserve bench vs-llama ARGV``, parsed."""
    return build_parser().parse_args(["bench", "vs-llama", *argv])


def test_weight_type_from_the_file_name():
    assert gguf_weight_type("/x/SmolLM2-135M-Instruct.Q4_1.gguf") == "Q4_1"
    assert gguf_weight_type("qwen2.5-1.5b-instruct-q4_k_m.gguf") == "Q4_K_M"
    assert gguf_weight_type("model-f16.gguf") == "F16"
    assert gguf_weight_type("SmolLM2-135M-Instruct.gguf") is None


def test_quantization_lists():
    assert parse_quantizations("none, int8,int4") == ("none", "int8", "int4")
    assert parse_quantizations("") == ()
    with pytest.raises(ValueError, match="unknown fp8"):
        parse_quantizations("none,fp8")
    with pytest.raises(ValueError, match="twice"):
        parse_quantizations("int8,int8")


def test_trioserve_command_is_one_trioserve_accepts():
    contender = Contender.trioserve("int4", ["--dtype", "bfloat16"])
    command = trioserve_command("/venv/bin/trioserve", contender, LAYOUT, 4321)
    binary = command.index("/venv/bin/trioserve")
    assert command[:binary] == ["env", *isa_environment("native")]
    args = build_parser().parse_args(command[binary + 1:])
    config = engine_config_from_args(args)
    assert (args.host, args.port, args.quantization, args.dtype) == ("127.0.0.1", 4321, "int4", "bfloat16")
    assert (config.max_num_seqs, config.max_model_len, config.num_threads) == (32, 512, 2)
    assert contender.label == "trioserve int4" and contender.slug == "trioserve-int4"
    assert Contender.trioserve("none").label == "trioserve float32"


def test_llama_server_gets_the_same_slots_context_and_threads():
    contender = Contender.llama_server("/m/SmolLM2-135M-Instruct.Q4_1.gguf", ["--cache-ram", "0"])
    command = llama_server_command("/b/llama-server", "/m/SmolLM2-135M-Instruct.Q4_1.gguf", contender, LAYOUT, 9)
    flags = dict(zip(command[1::2], command[2::2]))
    # -c is the whole context, split evenly over the -np slots: 512 each.
    assert flags["-c"] == "16384" and flags["-np"] == "32"
    assert flags["-t"] == flags["-tb"] == "2"
    assert (flags["-m"], flags["--host"], flags["--port"]) == ("/m/SmolLM2-135M-Instruct.Q4_1.gguf", "127.0.0.1", "9")
    assert command[-2:] == ["--cache-ram", "0"]
    assert contender.label == "llama-server Q4_1"


def test_layout_and_contender_refuse_bad_values():
    with pytest.raises(ValueError):
        Layout(slots=0, ctx_per_slot=512, threads=2)
    with pytest.raises(ValueError, match="quantization must be one of"):
        Contender.trioserve("fp8")


def _bench_result(output_lens, errors=None, itl_counts=None) -> dict:
    errors = errors or [""] * len(output_lens)
    itl_counts = itl_counts or [n - 1 for n in output_lens]
    return {"output_lens": output_lens, "request_errors": errors, "itls": [[0.01] * n for n in itl_counts]}


def test_token_counts_of_a_run():
    check = check_tokens(_bench_result([128, 128, 0], errors=["", "", "HTTP 500"]), 128)
    assert check.exact and check.completed == 2 and (check.chunks_min, check.chunks_max) == (128, 128)
    short = check_tokens(_bench_result([128, 97]), 128)
    assert not short.exact and (short.usage_min, short.usage_max) == (97, 128)
    # Text chunks can be fewer than tokens (a detokenizer holding back half a character).
    assert check_tokens(_bench_result([128], itl_counts=[120]), 128).chunks_min == 121
    assert not check_tokens(_bench_result([0], errors=["timed out"]), 128).exact
    with pytest.raises(ValueError, match="--save-detailed"):
        check_tokens({"completed": 3}, 128)


def test_logprob_token_count_in_both_shapes():
    assert logprob_token_count({"choices": [{"logprobs": {"tokens": ["a", "b"], "token_logprobs": [0, 0]}}]}) == 2
    assert logprob_token_count({"choices": [{"logprobs": {"content": [{}, {}, {}]}}]}) == 3
    assert logprob_token_count({"choices": [{"logprobs": None}]}) is None
    assert logprob_token_count({"choices": []}) is None


def _run(tpot, tput, ttft_p99) -> dict:
    return {"median_tpot_ms": tpot, "p99_tpot_ms": tpot * 1.5, "median_ttft_ms": 100.0, "p99_ttft_ms": ttft_p99,
            "output_throughput": tput, "completed": 16, "failed": 0, "duration": 10.0,
            "tokens": {"expected": 128, "completed": 16, "usage_min": 128, "usage_max": 128,
                       "chunks_min": 128, "chunks_max": 128, "exact": True}}  # fmt: skip


def _server(label, kind, c1, c32, rss_mib) -> dict:
    rss = int(rss_mib * 2**20)
    after = {"rss": rss, "hwm": rss + 2**20, "rss_anon": rss - 2**20, "rss_file": 2**20, "processes": 1}
    return {"label": label, "kind": kind, "runs": {"1": c1, "32": c32}, "memory": {"ready": after, "after": after}}


DOCUMENT = {
    "info": {"concurrency": [1, 32], "input_len": 128, "output_len": 128, "memory_after_requests": 500,
             "threads": 2, "model_name": "SmolLM2-135M-Instruct"},
    "servers": [
        _server("trioserve float32", "trioserve", _run(30.0, 20.0, 900.0), _run(120.0, 200.0, 6000.0), 2500),
        _server("trioserve int4", "trioserve", _run(8.0, 60.0, 500.0), _run(60.0, 300.0, 4000.0), 900),
        {"label": "trioserve int8", "kind": "trioserve", "error": "trioserve exited with 2; see x.log"},
        _server("llama-server Q4_1", "llama-server", _run(10.0, 90.0, 100.0), _run(400.0, 75.0, 20000.0), 600),
    ],
}  # fmt: skip


def test_ratios_to_llama_server():
    ratios = dict(ratio_rows(DOCUMENT))
    assert set(ratios) == {"trioserve float32", "trioserve int4"}  # the failed row has none
    assert ratios["trioserve int4"] == pytest.approx([0.8, 4.0, 0.2, 1.5])
    assert ratios["trioserve float32"] == pytest.approx([3.0, 200 / 75, 0.3, 2500 / 600])
    without = copy.deepcopy(DOCUMENT)
    without["servers"] = without["servers"][:2]
    assert ratio_rows(without) == []


def test_tables():
    text = format_tables(DOCUMENT)
    assert "| trioserve int4 | 1 | 8.0 | 12.0 | 100.0 | 500.0 | 60.0 | 128 | 16 / 0 |" in text
    assert "| trioserve int8 | | failed: trioserve exited with 2; see x.log |" in text
    assert "| llama-server Q4_1 | 600 | 600 | 601 | 599 / 1 |" in text
    assert "| trioserve int4 | 0.80x | 4.00x | 0.20x | 1.50x |" in text
    short = copy.deepcopy(DOCUMENT)
    short["servers"][0]["runs"]["1"]["tokens"].update(usage_min=97, exact=False)
    assert "| **97-128** (asked 128) |" in format_tables(short)


def test_the_command_redraws_tables_and_plot_from_its_json(tmp_path, capsys):
    results = tmp_path / "results.json"
    results.write_text(json.dumps(DOCUMENT))
    out, png = tmp_path / "out", tmp_path / "images" / "vs_llama.png"
    args = vs_llama("--from-json", str(results), "--out", str(out), "--plot", str(png))
    assert args.func(args) == 0
    assert (out / "results.md").read_text() == format_tables(DOCUMENT)
    assert png.read_bytes().startswith(b"\x89PNG")
    assert "| against llama-server |" in capsys.readouterr().out


def test_the_command_refuses_unknown_configurations(capsys):
    with pytest.raises(SystemExit):
        vs_llama("--trioserve-quantization", "none,fp8")
    assert "unknown fp8" in capsys.readouterr().err
    assert vs_llama("--trioserve-quantization", "").quantizations == ()


def test_num_prompts_is_one_value_or_one_per_concurrency(capsys):
    args = vs_llama("--concurrency", "1,32", "--num-prompts", "4,32")
    assert [prompts_at(args.num_prompts, i, c) for i, c in enumerate(args.concurrency)] == [4, 32]
    args = vs_llama("--concurrency", "1,32", "--num-prompts", "8")
    assert [prompts_at(args.num_prompts, i, c) for i, c in enumerate(args.concurrency)] == [8, 8]
    args = vs_llama("--concurrency", "32,1")
    assert args.concurrency == [1, 32]
    assert [prompts_at(args.num_prompts, i, c) for i, c in enumerate(args.concurrency)] == [16, 64]
    args = vs_llama("--concurrency", "1,32", "--num-prompts", "4,8,16")
    assert args.func(args) == 2
    assert "one per --concurrency value (2)" in capsys.readouterr().err


def test_no_llama_server_binary_is_a_usage_error(tmp_path, capsys):
    args = vs_llama("--llama-server", str(tmp_path / "missing"), "--trioserve-quantization", "", "--out", str(tmp_path))
    assert args.func(args) == 2
    assert "no llama-server binary" in capsys.readouterr().err


def test_trioserve_without_its_native_build_is_a_usage_error(tmp_path, capsys, monkeypatch):
    # After an edit of the kernels' sources and before a build, a server
    # falls back to ATen's kernels: the comparison refuses to time those.
    monkeypatch.setenv("TRIOSERVE_NATIVE_CACHE", str(tmp_path / "no-builds"))
    args = vs_llama("--no-llama-server", "--trioserve-quantization", "auto", "--out", str(tmp_path / "out"))
    assert args.func(args) == 2
    err = capsys.readouterr().err
    assert "native kernels are not built for this source" in err and "trioserve.engine.kernels.native" in err
    assert not (tmp_path / "out").exists()  # refused before any server started
    monkeypatch.setenv("TRIOSERVE_NATIVE_KERNELS", "0")  # the fallback timed on purpose
    assert unbuilt_native_kernels() is None
    monkeypatch.delenv("TRIOSERVE_NATIVE_KERNELS")
    (tmp_path / "no-builds").mkdir()
    from trioserve.engine.kernels import native

    native.library_path().parent.mkdir(parents=True)
    native.library_path().write_bytes(b"")
    assert unbuilt_native_kernels() is None


def test_plot_needs_a_finished_server(tmp_path):
    failed = {"info": DOCUMENT["info"], "servers": [DOCUMENT["servers"][2]]}
    with pytest.raises(ValueError, match="nothing to plot"):
        plot_comparison(failed, tmp_path / "x.png")


# -- instruction set classes (--isa) ------------------------------------------


def test_isa_lists_and_the_avx2_binary(capsys):
    assert parse_isas("native, AVX2") == ("native", "avx2")
    for bad, message in (("native,avx512", "unknown avx512"), ("avx2,avx2", "twice"), (",", "empty list")):
        with pytest.raises(ValueError, match=message):
            parse_isas(bad)
    args = vs_llama("--isa", "native,avx2", "--llama-server-avx2", "/b2/llama-server")
    assert args.isas == ("native", "avx2") and args.llama_server_avx2 == "/b2/llama-server"
    assert vs_llama().isas == ("native",)
    with pytest.raises(SystemExit):
        vs_llama("--isa", "sse2")
    assert "--isa: unknown sse2; choose from native, avx2" in capsys.readouterr().err


def test_each_configuration_runs_at_each_class_side_by_side():
    from trioserve.bench.figures.vs_llama import at_classes

    contenders = at_classes([Contender.trioserve("auto"), Contender.llama_server("/m/x.Q4_K_M.gguf")],
                            ("native", "avx2"))  # fmt: skip
    assert [(c.label, c.isa) for c in contenders] == [("trioserve auto", "native"), ("trioserve auto", "avx2"),
                                                      ("llama-server Q4_K_M", "native"),
                                                      ("llama-server Q4_K_M", "avx2")]  # fmt: skip
    assert [c.slug for c in contenders] == ["trioserve-auto", "trioserve-auto-avx2", "llama-server-q4-k-m",
                                            "llama-server-q4-k-m-avx2"]  # fmt: skip


def _child_environment(command: list[str], binary: str) -> dict:
    """The environment ``command``'s server would get: its ``env`` prefix
    run here on an interpreter that prints its own."""
    import subprocess
    import sys

    prefix = command[: command.index(binary)]
    shown = [*prefix, sys.executable, "-c", "import json, os; print(json.dumps(dict(os.environ)))"]
    return json.loads(subprocess.run(shown, capture_output=True, text=True, check=True).stdout)


def test_the_trioserve_child_is_held_to_avx2_and_native_is_not(monkeypatch):
    held = {"TRIOSERVE_CPU_ASSUME": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2",
            "MKL_ENABLE_INSTRUCTIONS": "AVX2"}  # fmt: skip
    from trioserve.engine.kernels.capability import held_environment

    assert held_environment("avx2") == held
    auto = Contender.trioserve("auto")
    # A bench started held to AVX2 (as CI runs), DNNL's older name too: the
    # AVX2 row gets the held values alone, the native row none.
    for name, value in {**held, "DNNL_MAX_CPU_ISA": "AVX2"}.items():
        monkeypatch.setenv(name, value)
    avx2 = _child_environment(trioserve_command("/v/trioserve", auto.at("avx2"), LAYOUT, 1), "/v/trioserve")
    assert {name: avx2.get(name) for name in held} == held and "DNNL_MAX_CPU_ISA" not in avx2
    native = _child_environment(trioserve_command("/v/trioserve", auto, LAYOUT, 1), "/v/trioserve")
    assert not set(native) & {*held, "DNNL_MAX_CPU_ISA"}
    assert native["PATH"] == os.environ["PATH"]


def _cpu(assume=None, capability="AVX2", caps=None, available=("quant_int4_native_avx2int8", "matmul_float32")):
    names = ("quant_int4_native_avx512vnni", "quant_int4_native_avx2int8", "native_attention_avx512",
             "matmul_float32", "kv_cache_bfloat16")  # fmt: skip
    return {"capability": capability, "assume": assume, "library_caps": caps or {},
            "paths": {n: {"available": n in available} for n in names}}  # fmt: skip


CAPS = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"}


def test_trioserve_is_labelled_avx2_only_where_its_version_shows_nothing_above():
    held = check_trioserve_isa("avx2", _cpu("avx2", caps=CAPS))
    assert held.proven and held.found == "torch AVX2, paths up to avx2 (quant_int4_native_avx2int8)"
    vnni = check_trioserve_isa("avx2", _cpu("avx2", caps=CAPS, available=("quant_int4_native_avx512vnni",)))
    assert not vnni.proven and "above avx2: quant_int4_native_avx512vnni" in vnni.reason
    unheld = check_trioserve_isa("avx2", _cpu("avx2", capability="AVX512", caps={}))
    assert not unheld.proven
    assert "not held: ONEDNN_MAX_CPU_ISA=None" in unheld.reason and "above avx2: torch" in unheld.reason
    assert not check_trioserve_isa("avx2", _cpu(None, caps=CAPS)).proven  # the switch unset
    assert not check_trioserve_isa("avx2", None).proven
    unknown = {**_cpu("avx2", caps=CAPS), "paths": {"new_path": {"available": True}}}
    assert not check_trioserve_isa("avx2", unknown).proven
    native = check_trioserve_isa("native", _cpu(capability="AVX512", available=("quant_int4_native_avx512vnni",)))
    assert native.proven and native.found == "torch AVX512, paths up to avx512vnni (quant_int4_native_avx512vnni)"


# system_info lines of scripts/build_llama_server.sh's builds (native and --isa avx2) on an AVX-512 Xeon.
NATIVE_INFO = ("n_threads = 2 (n_threads_batch = 2) / 2 | CPU : SSE3 = 1 | SSSE3 = 1 | AVX = 1 | AVX2 = 1 | F16C = 1 "
               "| FMA = 1 | BMI2 = 1 | AVX512 = 1 | AVX512_VBMI = 1 | AVX512_VNNI = 1 | AVX512_BF16 = 1 "
               "| LLAMAFILE = 1 | OPENMP = 1 | REPACK = 1 | ")  # fmt: skip
AVX2_INFO = ("n_threads = 2 (n_threads_batch = 2) / 2 | CPU : SSE3 = 1 | SSSE3 = 1 | AVX = 1 | AVX2 = 1 | F16C = 1 "
             "| FMA = 1 | BMI2 = 1 | LLAMAFILE = 1 | OPENMP = 1 | REPACK = 1 | ")  # fmt: skip


def test_llama_server_is_labelled_avx2_only_where_its_system_info_shows_nothing_above():
    held = check_llama_isa("avx2", AVX2_INFO)
    assert held.proven and held.found == "AVX, AVX2, F16C, FMA"
    native_binary = check_llama_isa("avx2", NATIVE_INFO)
    assert not native_binary.proven
    assert native_binary.reason == "above avx2: AVX512, AVX512_VBMI, AVX512_VNNI, AVX512_BF16"
    assert not check_llama_isa("avx2", None).proven
    assert not check_llama_isa("avx2", "CPU : SSE3 = 1 | AVX = 1 | AVX2 = 0 |").proven
    assert check_llama_isa("native", NATIVE_INFO).proven


def _at(server: dict, isa: str, proven: bool) -> dict:
    return {**server, "isa": isa, "isa_check": {"asked": isa, "proven": proven, "found": "", "reason": ""}}


def test_avx2_rows_sit_beside_native_ones_and_take_their_own_reference():
    trio, llama = DOCUMENT["servers"][1], DOCUMENT["servers"][3]
    document = copy.deepcopy(DOCUMENT)
    document["servers"] = [
        trio, _at(_server("trioserve int4", "trioserve", _run(16.0, 30.0, 1000.0), _run(120.0, 150.0, 8000.0), 900),
                  "avx2", True),
        llama, _at(_server("llama-server Q4_1", "llama-server", _run(20.0, 45.0, 200.0), _run(800.0, 50.0, 40000.0),
                           600), "avx2", True),
        _at(trio, "avx2", False),
    ]  # fmt: skip
    assert [server_label(s) for s in document["servers"]] == [
        "trioserve int4", "trioserve int4, AVX2", "llama-server Q4_1", "llama-server Q4_1, AVX2",
        "trioserve int4, AVX2 asked, not proven"]  # fmt: skip
    ratios = dict(ratio_rows(document))
    assert set(ratios) == {"trioserve int4", "trioserve int4, AVX2"}  # the unproven row has none
    assert ratios["trioserve int4"] == pytest.approx([0.8, 4.0, 0.2, 1.5])
    assert ratios["trioserve int4, AVX2"] == pytest.approx([0.8, 3.0, 0.2, 1.5])  # over llama-server's AVX2 row
    text = format_tables(document)
    assert "| trioserve int4, AVX2 | 1 | 16.0 |" in text and "| llama-server Q4_1, AVX2 | 32 | 800.0 |" in text
    assert "| trioserve int4, AVX2 | 0.80x | 3.00x | 0.20x | 1.50x |" in text


# -- paired one-stream rounds (--paired-rounds) --------------------------------


@given(st.integers(1, 5), st.integers(1, 8))
def test_each_round_runs_every_server_once_and_reverses_the_order(servers, rounds):
    orders = [abba_order(range(servers), r) for r in range(rounds)]
    assert all(sorted(order) == list(range(servers)) for order in orders)
    for before, after in zip(orders, orders[1:]):
        assert after == before[::-1]  # A B, B A, A B, ...
    if rounds % 2 == 0:  # over whole pairs of rounds, every server sits at every place equally often
        places = {s: sum(order.index(s) for order in orders) for s in range(servers)}
        assert len(set(places.values())) == 1


def test_abba_order_of_two_servers():
    assert [abba_order("AB", r) for r in range(4)] == [["A", "B"], ["B", "A"], ["A", "B"], ["B", "A"]]


_tpots = st.lists(st.one_of(st.none(), st.floats(0.5, 500.0)), min_size=1, max_size=9)


@given(_tpots, _tpots)
def test_the_ratio_summary_spans_its_rounds(ours, theirs):
    ratios = round_ratios(ours, theirs)
    summary = ratio_summary(ours, theirs)
    both = [(a, b) for a, b in zip(ours, theirs) if a is not None and b is not None]
    assert ratios == [a / b for a, b in both]  # round by round, rounds missing a figure left out
    if not both:
        assert summary is None
        return
    assert summary.rounds == len(both)
    assert summary.low == min(ratios) and summary.high == max(ratios)
    assert summary.low <= summary.median <= summary.high
    assert summary.to_json() == {"median": summary.median, "min": summary.low, "max": summary.high,
                                 "rounds": len(both)}  # fmt: skip


def _paired_server(label, kind, tpot, ttft, bandwidth, isa="native") -> dict:
    return {"label": label, "kind": kind, "isa": isa, "isa_check": None, "tpot_ms": tpot, "ttft_ms": ttft,
            "bandwidth_gbs": bandwidth, "tokens_exact": [True] * len(tpot)}  # fmt: skip


def test_the_summary_of_given_rounds():
    servers = [
        _paired_server("trioserve auto", "trioserve", [18.0, 25.0, 20.0, 30.0], [90.0] * 4, [55.0, 33.0, 50, 33]),
        _paired_server("llama-server Q4_1", "llama-server", [20.0, 20.0, 20.0, 20.0], [80.0] * 4, [55.0] * 4),
    ]
    trio, llama = summarize(servers, "llama-server Q4_1")
    assert trio["median_tpot_ms"] == 22.5 and trio["median_ttft_ms"] == 90.0
    # The median of the per-round ratios (0.9, 1.25, 1.0, 1.5), not the ratio of the medians.
    assert trio["ratio"] == {"median": pytest.approx(1.125), "min": 0.9, "max": 1.5, "rounds": 4}
    assert llama == {"label": "llama-server Q4_1", "median_tpot_ms": 20.0, "median_ttft_ms": 80.0, "ratio": None}
    assert summarize(servers[:1], None)[0]["ratio"] is None  # no llama-server: medians only


def _paired_entry(isa="native") -> dict:
    servers = [
        _paired_server("trioserve int4", "trioserve", [9.0, 8.0, 7.0], [100.0] * 3, [33.0, 51.0, 56.5], isa),
        _paired_server("llama-server Q4_1", "llama-server", [10.0, 10.0, 10.0], [90.0] * 3, [34.0, 50.0, 57.0], isa),
    ]
    return {"isa": isa, "rounds": 3, "num_prompts": 2, "num_warmups": 1, "servers": servers,
            "order": [["trioserve int4", "llama-server Q4_1"], ["llama-server Q4_1", "trioserve int4"],
                      ["trioserve int4", "llama-server Q4_1"]],
            "summary": summarize(servers, "llama-server Q4_1")}  # fmt: skip


def test_tables_with_paired_rounds_and_without():
    assert "paired rounds" not in format_tables(DOCUMENT)  # results.json files from before render as ever
    document = {**DOCUMENT, "paired": [_paired_entry()]}
    text = format_tables(document)
    assert text.startswith(format_tables(DOCUMENT).rstrip("\n"))
    assert "one stream, paired rounds" in text
    assert "| trioserve int4 | 3 | 8.0 | 100 | 0.80x | 0.70x | 0.90x | 33.0-56.5 |" in text
    assert "| llama-server Q4_1 | 3 | 10.0 | 90 | n/a | n/a | n/a | 34.0-57.0 |" in text
    failed = {**DOCUMENT, "paired": [{"isa": "native", "error": "llama-server exited with 1; see x.log",
                                      "servers": [], "summary": []}]}  # fmt: skip
    assert "| native | | failed: llama-server exited with 1; see x.log |" in format_tables(failed)


def test_the_command_redraws_paired_rounds_from_its_json(tmp_path, capsys):
    document = {**DOCUMENT, "paired": [_paired_entry()]}
    (tmp_path / "results.json").write_text(json.dumps(document))
    args = vs_llama("--from-json", str(tmp_path / "results.json"), "--out", str(tmp_path / "out"))
    assert args.func(args) == 0
    assert (tmp_path / "out" / "results.md").read_text() == format_tables(document)
    assert "| trioserve int4 | 3 | 8.0 | 100 | 0.80x |" in capsys.readouterr().out


def test_paired_rounds_is_a_non_negative_count(capsys):
    assert vs_llama().paired_rounds == 0  # off: the comparison as before
    assert vs_llama("--paired-rounds", "4").paired_rounds == 4
    with pytest.raises(SystemExit):
        vs_llama("--paired-rounds", "-1")
    assert "argument --paired-rounds: must be >= 0, got -1" in capsys.readouterr().err


def test_the_rounds_pair_the_finished_servers_of_each_class():
    trio, llama = Contender.trioserve("int4"), Contender.llama_server("/m/x.Q4_1.gguf")
    int8 = Contender.trioserve("int8")
    contenders = [trio, trio.at("avx2"), int8, llama, llama.at("avx2")]
    results = [{}, {"isa": "avx2", "isa_check": {"proven": True}}, {"error": "exited"}, {},
               {"isa": "avx2", "isa_check": {"proven": False}}]  # fmt: skip
    # int8 failed its runs; avx2's llama-server did not prove its class: nothing to pair at avx2.
    assert paired_groups(contenders, results) == [("native", [(trio, {}), (llama, {})])]


# A stand-in for a server's process: it answers /health (all the rounds ask
# of a server besides bench serve's requests) and writes its pid down.
_HEALTH_SERVER = """
import http.server, os, pathlib, sys
pathlib.Path(sys.argv[2]).write_text(str(os.getpid()))
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()
    def log_message(self, *args):
        pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Health).serve_forever()
"""


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def _stand_ins(monkeypatch, tmp_path, failing: set[str]):
    """Each contender's command a health-only server (its pid in tmp_path/
    SLUG.pid), or one that exits at once for those in ``failing``; each
    bench run a result whose TPOT is the server's from ``TPOT`` (the
    requests bench serve sends are not what this checks)."""
    def command(contender, args, layout, model, port):
        if contender.kind in failing:
            return [sys.executable, "-c", "raise SystemExit(3)"]
        return [sys.executable, "-c", _HEALTH_SERVER, str(port), str(tmp_path / f"{contender.slug}.pid")]

    calls = []

    def bench(url, model, out, **kwargs):
        calls.append((url, kwargs))
        tpot = 10.0 + len(calls)  # every run slower than the one before: the host moving
        return {"median_tpot_ms": tpot, "median_ttft_ms": 5.0, "output_lens": [kwargs["output_len"]] * 2,
                "request_errors": ["", ""], "itls": [[0.01] * (kwargs["output_len"] - 1)] * 2}  # fmt: skip

    monkeypatch.setattr(vs_llama_command, "server_command", command)
    monkeypatch.setattr(vs_llama_command, "bench", bench)
    monkeypatch.setattr("trioserve.bench.roofline.measure_bandwidth", lambda threads, **kw: 40e9)
    return calls


def test_the_rounds_alternate_the_servers_and_stop_them(monkeypatch, tmp_path):
    calls = _stand_ins(monkeypatch, tmp_path, failing=set())
    trio, llama = Contender.trioserve("auto"), Contender.llama_server("/m/x.Q4_1.gguf")
    args = vs_llama("--paired-rounds", "4", "--output-len", "8", "--out", str(tmp_path), "--ready-timeout", "60")
    entry = paired_class(args, LAYOUT, tmp_path / "m.gguf", [(trio, {}), (llama, {})], "native")
    assert "error" not in entry
    assert entry["order"] == [[trio.label, llama.label], [llama.label, trio.label]] * 2
    assert [kwargs["concurrency"] for _, kwargs in calls] == [1] * 8
    # The same prompts for both servers in a round, other prompts each round.
    assert [kwargs["seed"] for _, kwargs in calls] == [3000, 3000, 3001, 3001, 3002, 3002, 3003, 3003]
    ours, theirs = entry["servers"]
    assert ours["tpot_ms"] == [11.0, 14.0, 15.0, 18.0] and theirs["tpot_ms"] == [12.0, 13.0, 16.0, 17.0]
    assert ours["bandwidth_gbs"] == [40.0] * 4 and ours["tokens_exact"] == [True] * 4
    ratio = entry["summary"][0]["ratio"]
    assert ratio["min"] == 11 / 12 and ratio["max"] == 14 / 13
    assert ratio["median"] == statistics.median([11 / 12, 14 / 13, 15 / 16, 18 / 17])
    for slug in (trio.slug, llama.slug):
        assert _gone(int((tmp_path / f"{slug}.pid").read_text()))


def test_a_server_that_fails_to_start_ends_its_class_and_stops_the_others(monkeypatch, tmp_path):
    calls = _stand_ins(monkeypatch, tmp_path, failing={"llama-server"})
    trio, llama = Contender.trioserve("auto"), Contender.llama_server("/m/x.Q4_1.gguf")
    args = vs_llama("--paired-rounds", "2", "--out", str(tmp_path), "--ready-timeout", "60")
    entry = paired_class(args, LAYOUT, tmp_path / "m.gguf", [(trio, {}), (llama, {})], "native")
    assert "exited with 3" in entry["error"] and calls == []
    assert _gone(int((tmp_path / f"{trio.slug}.pid").read_text()))  # started, then stopped
    assert "| native | | failed: " in format_tables({**DOCUMENT, "paired": [entry]})


# -- end to end, on the default model -------------------------------------------


def _llama_server_avx2() -> str:
    """scripts/build_llama_server.sh --isa avx2's llama-server: $LLAMA_SERVER_AVX2, else where the docs build it."""
    binary = os.environ.get("LLAMA_SERVER_AVX2") or "/tmp/llama-build-avx2/bin/llama-server"
    if not os.access(binary, os.X_OK):
        pytest.skip(f"no llama-server built with --isa avx2 ({binary}): set LLAMA_SERVER_AVX2")
    return binary


@pytest.mark.slow
def test_a_server_held_to_avx2_proves_it_in_its_own_report(tmp_path):
    """The part of a comparison's run that starts trioserve at a class and
    reads its /version (bench serve's runs are vs-llama's as ever)."""
    from trioserve.bench.figures.vs_llama import trioserve_cpu
    from trioserve.bench.process import TRIOSERVE, free_port, running

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    layout = Layout(slots=2, ctx_per_slot=64, threads=1)
    command = trioserve_command(TRIOSERVE, Contender.trioserve("auto").at("avx2"), layout, port)
    with running(command, url, tmp_path / "avx2.log", 300):
        cpu = trioserve_cpu(url)
    check = check_trioserve_isa("avx2", cpu)
    assert check.proven, check
    assert cpu["assume"] == "avx2" and cpu["capability"] in ("AVX2", "DEFAULT")
    (model,) = cpu["models"].values()
    assert "avx512" not in model["reason"]  # the kernel the load chose says its variant


def test_the_avx2_llama_server_says_it_runs_avx2_and_nothing_above(tmp_path):
    from trioserve.bench.figures.vs_llama import llama_system_info

    info = llama_system_info(_llama_server_avx2(), 1, tmp_path)
    check = check_llama_isa("avx2", info)
    assert check.proven, (info, check)
