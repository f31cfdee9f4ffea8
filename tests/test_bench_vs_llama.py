"""The parts of ``trioserve bench vs-llama`` that need no server: the two
command lines, the token-count check, and the tables and plot drawn from its
JSON. Nothing here needs llama.cpp."""

from __future__ import annotations

import copy
import json

import pytest

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
from trioserve.bench.figures.vs_llama import prompts_at
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
    args = build_parser().parse_args(command[1:])
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


def test_plot_needs_a_finished_server(tmp_path):
    failed = {"info": DOCUMENT["info"], "servers": [DOCUMENT["servers"][2]]}
    with pytest.raises(ValueError, match="nothing to plot"):
        plot_comparison(failed, tmp_path / "x.png")
