"""``trioserve bench real-size`` without a server: the shapes and their
seeded checkpoints, the cache, the roofline's arithmetic, the command line
and the report; and llama.cpp's converter on a tiny shape (it needs no
llama.cpp build, only its sources from llama-cpp-python's sdist)."""

from __future__ import annotations

import copy
import json
import math
import os
import subprocess
from pathlib import Path

import pytest
import torch

from trioserve.bench.figures.real_size import Progress, prepare, steps_of
from trioserve.bench.real_size import (
    FLOAT_TYPE,
    SHAPES,
    CacheEntry,
    Shape,
    active_parameter_count,
    download_sdist,
    extract_converter,
    hf_config,
    make_tensor,
    parameter_count,
    tensor_specs,
    write_checkpoint,
)
from trioserve.bench.real_size_report import format_report, fractions, plot_report
from trioserve.bench.roofline import (
    Machine,
    TensorBytes,
    expert_bytes,
    experts_read,
    floors,
    flops_per_token,
    kv_bytes_per_token,
    measure_gemm,
    read_gguf_tensors,
    weight_bytes_per_token,
)
from trioserve.web.cli import build_parser

LLAMA_1B = SHAPES["llama-3.2-1b"]
TINY = Shape("tiny-llama", "llama", layers=2, hidden=64, heads=4, kv_heads=2, head_dim=16, intermediate=128, tied=True)
TINY_MOE = Shape("tiny-moe", "qwen3_moe", layers=2, hidden=64, heads=4, kv_heads=2, head_dim=16, intermediate=128,
                 tied=False, experts=4, experts_per_token=2, expert_intermediate=32)  # fmt: skip


def real_size(*argv: str):
    return build_parser().parse_args(["bench", "real-size", *argv])


# -- the shapes ---------------------------------------------------------------


def test_the_1b_shape_is_llama_3_2_1b_with_the_default_vocabulary():
    config = hf_config(LLAMA_1B)
    assert (config.num_hidden_layers, config.hidden_size, config.num_attention_heads, config.num_key_value_heads,
            config.intermediate_size, config.head_dim, config.vocab_size, config.tie_word_embeddings) == (
        16, 2048, 32, 8, 8192, 64, 49152, True)  # fmt: skip
    per_layer = 2048 * 2048 * 2 + 2 * 2048 * 512 + 3 * 2048 * 8192 + 2 * 2048
    assert parameter_count(LLAMA_1B) == 49152 * 2048 + 16 * per_layer + 2048 == 1_073_809_408


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_parameter_counts_match_transformers_model(name):
    import transformers

    shape = SHAPES[name]
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf_config(shape))
    assert [type(model).__name__] == hf_config(shape).architectures
    assert parameter_count(shape) == sum(p.numel() for p in model.parameters())


def test_the_moe_shape_counts_routed_experts_as_active():
    moe = SHAPES["qwen3-moe-7b-a1b"]
    assert 6.5e9 < parameter_count(moe) < 7.5e9  # a 7B-class mixture
    inactive = 16 * (64 - 8) * 3 * 2048 * 1024
    assert active_parameter_count(moe) == parameter_count(moe) - inactive
    assert active_parameter_count(LLAMA_1B) == parameter_count(LLAMA_1B)


# -- seeded weights -----------------------------------------------------------


def test_a_tensor_depends_on_its_seed_and_name_only():
    spec = next(s for s in tensor_specs(TINY) if s.name.endswith("layers.1.mlp.down_proj.weight"))
    assert torch.equal(make_tensor(spec, 3), make_tensor(spec, 3))
    assert not torch.equal(make_tensor(spec, 3), make_tensor(spec, 4))
    other = next(s for s in tensor_specs(TINY) if s.name.endswith("layers.0.mlp.down_proj.weight"))
    assert not torch.equal(make_tensor(spec, 3), make_tensor(other, 3))
    values = make_tensor(spec, 3).float()
    assert values.dtype == torch.float32 and abs(values.std().item() - 1 / math.sqrt(128)) < 0.01
    norm = next(s for s in tensor_specs(TINY) if s.name.endswith("input_layernorm.weight"))
    assert torch.equal(make_tensor(norm, 3), torch.ones(64, dtype=torch.bfloat16))


@pytest.fixture(scope="module")
def tokenizer_folder():
    from trioserve.testing.tiny_model import hf_tokenizer_folder

    return hf_tokenizer_folder()


@pytest.mark.parametrize("shape", [TINY, TINY_MOE], ids=lambda s: s.name)
def test_a_checkpoint_is_the_same_for_a_seed_and_its_logits_are_not_flat(tmp_path, tokenizer_folder, shape):
    import transformers

    first = write_checkpoint(shape, 7, tmp_path / "a", tokenizer_folder)
    second = write_checkpoint(shape, 7, tmp_path / "b", tokenizer_folder)
    shards = sorted(p.name for p in first.glob("*.safetensors"))
    assert shards and all((first / n).read_bytes() == (second / n).read_bytes() for n in shards)
    assert (first / "tokenizer.json").is_file()
    model = transformers.AutoModelForCausalLM.from_pretrained(first, dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.arange(100, 132)[None]).logits[0]
    spread = logits.std(dim=-1)
    assert bool(((spread > 0.3) & (spread < 10)).all())  # neither flat nor saturated
    assert len(set(logits.argmax(-1).tolist())) > 8  # greedy picks differ by position


# -- the cache ----------------------------------------------------------------


def test_cache_keys_follow_shape_and_seed(tmp_path):
    assert LLAMA_1B.key(0) == LLAMA_1B.key(0)
    assert LLAMA_1B.key(0) != LLAMA_1B.key(1)
    assert LLAMA_1B.key(0).startswith("llama-3.2-1b-s0-")
    import attrs

    assert LLAMA_1B.key(0) != attrs.evolve(LLAMA_1B, layers=15).key(0)
    entry = CacheEntry(tmp_path, LLAMA_1B, 0)
    assert entry.gguf("Q4_K_M") == tmp_path / LLAMA_1B.key(0) / "llama-3.2-1b.Q4_K_M.gguf"


def test_what_is_cached_is_not_made_again(tmp_path):
    entry = CacheEntry(tmp_path, TINY, 0)
    assert list(entry.missing(("Q4_K_M", "Q8_0"))) == ["checkpoint", "convert", "Q4_K_M", "Q8_0"]
    entry.checkpoint.mkdir(parents=True)
    (entry.checkpoint / "model.safetensors.index.json").write_text("{}")
    assert list(entry.missing(("Q4_K_M",))) == ["convert", "Q4_K_M"]
    entry.gguf(FLOAT_TYPE).write_bytes(b"gguf")
    assert list(entry.missing(("Q4_K_M", "Q8_0"))) == ["Q4_K_M", "Q8_0"]
    entry.gguf("Q8_0").write_bytes(b"gguf")
    assert list(entry.missing(("Q4_K_M", "Q8_0"))) == ["Q4_K_M"]
    entry.gguf("Q4_K_M").write_bytes(b"gguf")
    assert list(entry.missing(("Q4_K_M", "Q8_0"))) == []
    # A partial file (the converter or llama-quantize stopped) is not taken.
    other = CacheEntry(tmp_path, TINY, 1)
    other.folder.mkdir()
    other.gguf("Q8_0").with_name(other.gguf("Q8_0").name + ".partial").write_bytes(b"gg")
    assert "Q8_0" in list(other.missing(("Q8_0",)))


# -- the roofline -------------------------------------------------------------

# Q4_K: 144 bytes per 256 weights; Q6_K: 210 per 256.
TENSORS_TIED = [TensorBytes("token_embd.weight", 1000 * 64, 1000 * 64 * 210 // 256),
                TensorBytes("blk.0.attn_q.weight", 64 * 64, 64 * 64 * 144 // 256),
                TensorBytes("blk.0.attn_norm.weight", 64, 256)]  # fmt: skip


def test_bytes_per_token_count_stored_widths_and_the_tied_head():
    shape = Shape("t", "llama", layers=1, hidden=64, heads=4, kv_heads=2, head_dim=16, intermediate=128, tied=True,
                  vocab=1000)  # fmt: skip
    assert weight_bytes_per_token(TENSORS_TIED, shape) == 52500 + 2304 + 256
    # Untied: the embedding is one row a token, the LM head whole.
    untied = [*TENSORS_TIED, TensorBytes("output.weight", 64000, 68000)]
    assert weight_bytes_per_token(untied, shape) == 52500 / 1000 + 2304 + 256 + 68000


def test_bytes_per_token_count_routed_experts_only():
    moe = SHAPES["qwen3-moe-7b-a1b"]
    experts = TensorBytes("blk.0.ffn_up_exps.weight", 64 * 1024 * 2048, 64 * 1024 * 2048 * 34 // 32)
    head = TensorBytes("output.weight", 49152 * 2048, 49152 * 2048 * 34 // 32)
    assert weight_bytes_per_token([experts, head], moe) == experts.nbytes * 8 / 64 + head.nbytes


def test_a_step_of_many_streams_reads_every_expert_routed_to_once():
    moe = SHAPES["qwen3-moe-7b-a1b"]
    assert experts_read(moe, 1) == 8 / 64 and experts_read(LLAMA_1B, 32) == 1.0
    # 32 tokens of 8 in 64 miss an expert with probability (56/64)^32: 1.4%.
    assert experts_read(moe, 32) == pytest.approx(1 - (56 / 64) ** 32) and experts_read(moe, 32) > 0.98
    exps = [TensorBytes(f"blk.{i}.ffn_{p}_exps.weight", 64 * 1024 * 2048, 64 * 1024 * 2048 * 144 // 256)
            for i in range(16) for p in ("gate", "up", "down")]  # fmt: skip
    head = TensorBytes("output.weight", 49152 * 2048, 49152 * 2048 * 210 // 256)
    routed, every = weight_bytes_per_token([*exps, head], moe), expert_bytes([*exps, head])
    assert every == sum(t.nbytes for t in exps)
    machine = Machine(bandwidth=40e9, peaks={"bf16": {32: 200e9, 512: 400e9}, "int8": {32: 300e9, 512: 800e9}})
    f = floors(machine, moe, routed, input_len=128, output_len=128, streams=32, all_expert_bytes=every)
    assert f.step_weight_bytes == pytest.approx(head.nbytes + every * experts_read(moe, 32))
    assert f.tpot_s == pytest.approx((routed + kv_bytes_per_token(moe, 192)) / 40e9)  # one stream: routed only
    # The step of 32 reads nearly every expert: 3.6 GB, nearly 64 / 8 times one token's share.
    assert f.step_weight_bytes - head.nbytes > 7.8 * (routed - head.nbytes)
    step = max((f.step_weight_bytes + 32 * kv_bytes_per_token(moe, 192)) / 40e9,
               32 * flops_per_token(moe, 192) / 300e9)  # fmt: skip
    prefill = 32 * 128 * flops_per_token(moe, 64) / 800e9
    assert f.throughput == pytest.approx(32 * 128 / (prefill + 128 * step))


def test_flops_and_kv_bytes_of_the_1b_shape():
    matmuls = 16 * (2 * 2048 * 2048 + 2 * 2048 * 512 + 3 * 2048 * 8192) + 49152 * 2048
    assert flops_per_token(LLAMA_1B, 0) == 2 * matmuls
    assert flops_per_token(LLAMA_1B, 100) == 2 * matmuls + 4 * 16 * 2048 * 100
    assert kv_bytes_per_token(LLAMA_1B, 100) == 16 * 2 * 512 * 2 * 100


def test_floors_of_a_known_machine():
    machine = Machine(bandwidth=40e9, peaks={"bf16": {32: 200e9, 512: 400e9}, "int8": {32: 300e9, 512: 800e9}})
    weight_bytes = 669e6
    f = floors(machine, LLAMA_1B, weight_bytes, input_len=128, output_len=128, streams=32)
    context = 128 + 64
    one = (weight_bytes + kv_bytes_per_token(LLAMA_1B, context)) / 40e9
    assert f.tpot_s == pytest.approx(one)
    step = max((weight_bytes + 32 * kv_bytes_per_token(LLAMA_1B, context)) / 40e9,
               32 * flops_per_token(LLAMA_1B, context) / 300e9)  # fmt: skip
    prefill = 32 * 128 * flops_per_token(LLAMA_1B, 64) / 800e9
    assert f.throughput == pytest.approx(32 * 128 / (prefill + 128 * step))
    assert f.bound == "compute"  # 32 x 2.1 GFLOP at 300 GFLOP/s outlasts reading 0.7 GB at 40 GB/s
    assert machine.peak(1) == machine.peak(32) == 300e9 and machine.peak(4096) == 800e9


def test_the_best_of_two_measurements_is_kept():
    busy = Machine(10e9, {"bf16": {32: 60e9, 512: 100e9}, "int8": {32: 70e9, 512: 170e9}})
    quiet = Machine(30e9, {"bf16": {32: 200e9, 512: 90e9}, "int8-trioserve": {32: 400e9, 512: 700e9}})
    best = busy.best(quiet)
    assert best.bandwidth == 30e9
    assert best.peaks == {"bf16": {32: 200e9, 512: 100e9}, "int8": {32: 70e9, 512: 170e9},
                          "int8-trioserve": {32: 400e9, 512: 700e9}}  # fmt: skip
    assert Machine.from_json(best.to_json()) == best


@pytest.mark.parametrize("dtype", ["bf16", "int8", "int8-trioserve"])
def test_a_gemm_peak_is_a_positive_rate(dtype):
    from trioserve.engine.kernels.native import NativeUnavailable

    try:
        assert measure_gemm(dtype, 32, 1, repeats=1) > 1e8
    except NativeUnavailable as exc:
        pytest.skip(str(exc))
    with pytest.raises(ValueError, match="bf16, int8 or int8-trioserve"):
        measure_gemm("fp8", 32, 1)


# -- the command line ---------------------------------------------------------


def test_command_line_defaults_and_choices():
    args = real_size()
    assert args.shapes == list(SHAPES) and args.quants == ["Q4_K_M", "Q4_0", "Q8_0"]
    assert args.quantizations == ("auto",) and args.memory_after == 0 and args.concurrency == [1, 32]
    assert args.isas == ("native",)
    args = real_size("--shapes", "llama-3.2-1b,qwen3-4b", "--quants", "Q8_0", "--num-prompts", "4,32",
                     "--llama-args=--cache-ram 0", "--prepare-only")  # fmt: skip
    assert args.shapes == ["llama-3.2-1b", "qwen3-4b"] and args.quants == ["Q8_0"] and args.prepare_only
    assert args.num_prompts == [4, 32] and args.llama_args == "--cache-ram 0"
    assert args.func.__module__ == "trioserve.bench.figures.real_size"
    for bad in (["--shapes", "llama-70b"], ["--quants", "Q2_K"]):
        with pytest.raises(SystemExit):
            real_size(*bad)


def test_steps_count_what_is_cached(tmp_path):
    args = real_size("--shapes", "llama-3.2-1b", "--quants", "Q4_K_M,Q8_0", "--cache-dir", str(tmp_path))
    # checkpoint, convert, 2 quantizations; the machine twice; 2 servers on each of 2 files.
    assert steps_of(args) == 4 + 2 + 4
    args.prepare_only = True
    assert steps_of(args) == 4
    # Every server at each class: 2 servers x 2 classes on each of 2 files.
    args = real_size("--shapes", "llama-3.2-1b", "--quants", "Q4_K_M,Q8_0", "--cache-dir", str(tmp_path),
                     "--isa", "native,avx2", "--llama-server-avx2", "/b2/llama-server")  # fmt: skip
    assert args.isas == ("native", "avx2") and args.llama_server_avx2 == "/b2/llama-server"
    assert steps_of(args) == 4 + 2 + 8


def test_without_llama_server_the_command_says_how_to_build_it(tmp_path, capsys):
    args = real_size("--shapes", "llama-3.2-1b", "--llama-server", str(tmp_path / "none"), "--cache-dir", str(tmp_path))
    assert args.func(args) == 2
    assert "build_llama_server.sh" in capsys.readouterr().err


def test_without_trioserve_s_native_build_the_command_says_how_to_build_it(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("TRIOSERVE_NATIVE_CACHE", str(tmp_path / "no-builds"))
    args = real_size("--shapes", "llama-3.2-1b", "--no-llama-server", "--cache-dir", str(tmp_path))
    assert args.func(args) == 2
    assert "python -m trioserve.engine.kernels.native" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []  # refused before any file was made


def test_without_the_avx2_llama_server_the_command_says_how_to_build_it(tmp_path, capsys):
    native = tmp_path / "llama-server"
    native.write_text("#!/bin/sh\n")
    native.chmod(0o755)
    args = real_size("--shapes", "llama-3.2-1b", "--llama-server", str(native), "--isa", "native,avx2",
                     "--llama-server-avx2", str(tmp_path / "none"), "--cache-dir", str(tmp_path))  # fmt: skip
    assert args.func(args) == 2
    err = capsys.readouterr().err
    assert "no llama-server binary for avx2 (--llama-server-avx2" in err
    assert "scripts/build_llama_server.sh --isa avx2 and pass --llama-server-avx2 PATH" in err
    assert "for native" not in err


# -- the report ---------------------------------------------------------------

RECORDED = {
    "info": {"date": "2026-12-06T21:00:00+00:00", "cpu": "AMD EPYC", "threads": 2, "input_len": 128,
             "output_len": 128, "concurrency": [1, 32]},
    "machine": {"bandwidth": 34e9, "peaks": {"bf16": {"32": 206e9, "512": 384e9}, "int8": {"32": 400e9, "512": 760e9},
                                             "int8-trioserve": {"32": 350e9, "512": 500e9}}},
    "runs": [{
        "shape": "llama-3.2-1b", "quant": "Q4_K_M", "gguf": "/c/llama-3.2-1b.Q4_K_M.gguf", "gguf_bytes": 669_000_000,
        "parameters": 1_073_809_408, "active_parameters": 1_073_809_408,
        "floors": {"weight_bytes": 668e6, "tpot_s": 0.0200, "streams": 32, "throughput": 120.0, "bound": "compute"},
        "comparison": {"servers": [
            {"label": "trioserve auto", "kind": "trioserve", "runs": {
                "1": {"median_tpot_ms": 43.8, "median_ttft_ms": 986.0},
                "32": {"output_throughput": 73.4, "p99_ttft_ms": 29800.0}},
             "memory": {"after": {"rss": 1618 * 2**20}}},
            {"label": "llama-server Q4_K_M", "kind": "llama-server", "runs": {
                "1": {"median_tpot_ms": 26.4, "median_ttft_ms": 1027.0},
                "32": {"output_throughput": 59.2, "p99_ttft_ms": 28600.0}},
             "memory": {"after": {"rss": 1739 * 2**20}}},
        ]},
    }, {"shape": "llama-3.2-3b", "quant": "Q8_0", "gguf": "/c/x.gguf", "gguf_bytes": 3_300_000_000,
        "parameters": 2_969_742_336, "active_parameters": 2_969_742_336,
        "floors": {"weight_bytes": 3.2e9, "tpot_s": 0.094, "streams": 32, "throughput": 40.0, "bound": "bandwidth"},
        "comparison": {"servers": [{"label": "trioserve auto", "kind": "trioserve", "error": "did not start\nlog"}]}}],
}  # fmt: skip


def test_fractions_of_the_floors():
    run = RECORDED["runs"][0]
    ours, theirs = run["comparison"]["servers"]
    assert fractions(run, ours, 1, 32) == pytest.approx((20.0 / 43.8, 73.4 / 120.0))
    assert fractions(run, theirs, 1, 32) == pytest.approx((20.0 / 26.4, 59.2 / 120.0))


def test_the_report_from_a_recorded_run():
    text = format_report(RECORDED)
    assert ("| read bandwidth | bf16 GEMM, 32 rows | bf16 GEMM, 512 rows | int8 GEMM, 32 rows | int8 GEMM, 512 rows "
            "| int8-trioserve GEMM, 32 rows | int8-trioserve GEMM, 512 rows |") in text
    assert "| 34.0 GB/s | 206 GFLOP/s | 384 GFLOP/s | 400 GOP/s | 760 GOP/s | 350 GOP/s | 500 GOP/s |" in text
    assert "| llama-3.2-1b | Q4_K_M | 1.07B | 669 | 668 | 668 | 20.0 | 120.0 | compute |" in text
    assert ("| llama-3.2-1b | Q4_K_M | trioserve auto | 43.8 | 0.46 | 986 | 73.4 | 0.61 | 29,800 | 1,618 |"
            in text)  # fmt: skip
    assert "| llama-3.2-1b | Q4_K_M | llama-server Q4_K_M | 26.4 | 0.76 | 1,027 | 59.2 | 0.49 | 28,600 | 1,739 |" in text
    assert "| llama-3.2-1b Q4_K_M, trioserve auto | 1.66x | 1.24x | 1.04x | 0.93x |" in text
    assert "trioserve auto: failed did not start |" in text


def test_the_report_shows_the_paired_ratio_beside_the_one_stream_one():
    document = copy.deepcopy(RECORDED)
    document["runs"][0]["comparison"]["paired"] = [{"isa": "native", "summary": [
        {"label": "trioserve auto", "median_tpot_ms": 21.0, "median_ttft_ms": 900.0,
         "ratio": {"median": 0.95, "min": 0.92, "max": 1.4, "rounds": 6}},
        {"label": "llama-server Q4_K_M", "median_tpot_ms": 22.0, "median_ttft_ms": 950.0, "ratio": None}]}]  # fmt: skip
    text = format_report(document)
    assert ("| trioserve over llama-server | TPOT p50, 1 stream | paired rounds: median (min-max) "
            "| output tok/s, 32 streams |") in text  # fmt: skip
    assert "| llama-3.2-1b Q4_K_M, trioserve auto | 1.66x | 0.95x (0.92-1.40) | 1.24x | 1.04x | 0.93x |" in text
    assert "paired rounds" not in format_report(RECORDED)  # without them the table is as before
    args = real_size("--paired-rounds", "3")
    assert args.paired_rounds == 3 and real_size().paired_rounds == 0


def test_paired_rounds_is_a_non_negative_count(capsys):
    with pytest.raises(SystemExit):
        real_size("--paired-rounds", "-1")
    assert "argument --paired-rounds: must be >= 0, got -1" in capsys.readouterr().err


def test_the_report_redrawn_from_json(tmp_path):
    pytest.importorskip("matplotlib")
    source = tmp_path / "in.json"
    source.write_text(json.dumps(RECORDED))
    args = real_size("--from-json", str(source), "--out", str(tmp_path / "out"), "--plot", str(tmp_path / "p.png"))
    assert args.func(args) == 0
    assert (tmp_path / "out" / "results.md").read_text() == format_report(RECORDED)
    assert (tmp_path / "p.png").stat().st_size > 10_000
    empty = copy.deepcopy(RECORDED)
    for run in empty["runs"]:
        run["comparison"]["servers"] = []
    with pytest.raises(ValueError, match="nothing to plot"):
        plot_report(empty, tmp_path / "q.png")


# -- llama.cpp's converter on a tiny shape ------------------------------------


def _sdist() -> Path:
    """llama-cpp-python's sdist as scripts/build_llama_server.sh finds it:
    $LLAMA_CPP_SDIST, the build script's download folder, else pip download
    into trioserve's cache."""
    if os.environ.get("LLAMA_CPP_SDIST"):
        return Path(os.environ["LLAMA_CPP_SDIST"])
    for folder in (Path("/tmp/llama-cpp-python-sdist"), Path.home() / ".cache/trioserve/real-size/sdist"):
        found = sorted(folder.glob("llama_cpp_python-*.tar.gz"))
        if found:
            return found[-1]
    try:
        return download_sdist(Path.home() / ".cache/trioserve/real-size/sdist", "0.3.36")
    except (subprocess.CalledProcessError, OSError) as exc:
        pytest.skip(f"no llama-cpp-python sdist here and pip download failed (no network?): {exc}")


@pytest.fixture(scope="module")
def converter(tmp_path_factory):
    sdist = _sdist()
    pytest.importorskip("sentencepiece", reason="llama.cpp's convert_hf_to_gguf.py imports sentencepiece")
    return extract_converter(sdist, tmp_path_factory.mktemp("llama.cpp") / "src")


@pytest.mark.parametrize("shape", [TINY, TINY_MOE], ids=lambda s: s.name)
def test_the_converter_makes_a_gguf_of_a_tiny_shape_and_it_is_reused(tmp_path, converter, shape):
    from gguf import GGUFReader

    entry = CacheEntry(tmp_path, shape, 5)
    progress = Progress(3)
    with pytest.raises(RuntimeError, match="no llama-quantize binary"):  # none here: the float file only
        prepare(entry, ["Q8_0"], converter=lambda: converter, quantize_binary=None, threads=1, keep=False,
                progress=progress)  # fmt: skip
    assert progress.done == 3 and not entry.checkpoint.exists()  # checkpoint, convert, Q8_0; then removed
    assert list(entry.missing(("Q8_0",))) == ["Q8_0"]
    again = Progress(1)
    with pytest.raises(RuntimeError, match="no llama-quantize binary"):
        prepare(entry, ["Q8_0"], converter=lambda: pytest.fail("converted again"), quantize_binary=None, threads=1,
                keep=False, progress=again)  # fmt: skip
    assert again.done == 1  # the float file was reused

    tensors = {t.name: t for t in read_gguf_tensors(entry.gguf(FLOAT_TYPE))}
    assert ("output.weight" in tensors) == (not shape.tied)
    assert sum(t.elements for t in tensors.values()) == parameter_count(shape)
    expected = sum(t.nbytes for t in tensors.values())
    if shape.is_moe:
        exps = sum(t.nbytes for n, t in tensors.items() if "_exps." in n)
        assert exps > 0
        expected -= exps * (1 - shape.experts_per_token / shape.experts) + tensors["token_embd.weight"].nbytes * (
            1 - 1 / shape.vocab)  # fmt: skip
    assert weight_bytes_per_token(tensors.values(), shape) == pytest.approx(expected)
    # The converter kept the seeded values (a tensor it does not permute).
    reader = {t.name: t for t in GGUFReader(str(entry.gguf(FLOAT_TYPE))).tensors}
    down = reader["blk.1.ffn_down.weight" if not shape.is_moe else "blk.1.ffn_down_exps.weight"]
    spec_name = "model.layers.1.mlp.down_proj.weight" if not shape.is_moe else "model.layers.1.mlp.experts.0.down_proj.weight"
    spec = next(s for s in tensor_specs(shape) if s.name == spec_name)
    stored = torch.from_numpy(down.data.copy()).view(torch.bfloat16).reshape(-1)[: spec.numel]
    assert torch.equal(stored, make_tensor(spec, 5).reshape(-1))


def test_memory_read_right_after_the_runs_is_labelled_so():
    from trioserve.bench.vs_llama import format_tables

    document = {"info": {"memory_after_requests": 0, "concurrency": [1, 32]}, "servers": []}
    assert "| RSS after the runs (MiB) |" in format_tables(document)
    document["info"]["memory_after_requests"] = 500
    assert "| RSS after 500 requests (MiB) |" in format_tables(document)


# -- AVX2 beside native (--isa native,avx2) -----------------------------------


def _held(server: dict, proven: bool, reason: str = "") -> dict:
    found = "torch AVX2, paths up to avx2 (quant_int4_native_avx2int8)"
    return {**server, "isa": "avx2", "isa_check": {"asked": "avx2", "proven": proven, "found": found, "reason": reason}}


def _recorded_at_avx2() -> dict:
    """RECORDED's 1B run at native and AVX2: AVX2's own peaks (bf16 and
    int8 lower, no int8-trioserve figure), floors and rows, one not proven."""
    document = copy.deepcopy(RECORDED)
    document["runs"] = document["runs"][:1]
    document["machines"] = {"native": document["machine"],
                            "avx2": {"bandwidth": 33e9, "peaks": {"bf16": {"32": 20e9, "512": 25e9},
                                                                  "int8": {"32": 100e9, "512": 300e9}}}}  # fmt: skip
    run = document["runs"][0]
    run["floors_by_isa"] = {"avx2": {"weight_bytes": 668e6, "tpot_s": 0.0205, "streams": 32, "throughput": 80.0,
                                     "bound": "compute"}}  # fmt: skip
    ours, theirs = run["comparison"]["servers"]
    run["comparison"]["servers"] = [
        ours, _held({**ours, "runs": {"1": {"median_tpot_ms": 41.0, "median_ttft_ms": 1500.0},
                                      "32": {"output_throughput": 40.0, "p99_ttft_ms": 50000.0}}}, True),
        theirs, _held({**theirs, "runs": {"1": {"median_tpot_ms": 32.8, "median_ttft_ms": 2000.0},
                                          "32": {"output_throughput": 32.0, "p99_ttft_ms": 60000.0}}}, True),
        _held({"label": "trioserve int8", "kind": "trioserve", "runs": ours["runs"]}, False,
              "above avx2: quant_int8_native_avx512vnni"),
    ]  # fmt: skip
    return document


def test_the_report_shows_avx2_rows_beside_native_ones():
    text = format_report(_recorded_at_avx2())
    assert "| CPU class | read bandwidth | bf16 GEMM, 32 rows |" in text
    assert "| native | 34.0 GB/s | 206 GFLOP/s | 384 GFLOP/s | 400 GOP/s | 760 GOP/s | 350 GOP/s | 500 GOP/s |" in text
    assert "| avx2 | 33.0 GB/s | 20 GFLOP/s | 25 GFLOP/s | 100 GOP/s | 300 GOP/s | n/a | n/a |" in text
    assert "| llama-3.2-1b | Q4_K_M | native | 1.07B | 669 | 668 | 668 | 20.0 | 120.0 | compute |" in text
    assert "| llama-3.2-1b | Q4_K_M | avx2 | 1.07B | 669 | 668 | 668 | 20.5 | 80.0 | compute |" in text
    rows = [line for line in text.splitlines() if line.startswith("| llama-3.2-1b | Q4_K_M | trioserve")
            or line.startswith("| llama-3.2-1b | Q4_K_M | llama-server")]  # fmt: skip
    # Each server's AVX2 row right below its native one, its fraction of AVX2's floors.
    assert [row.split(" | ")[2] for row in rows] == [
        "trioserve auto", "trioserve auto, AVX2", "llama-server Q4_K_M", "llama-server Q4_K_M, AVX2",
        "trioserve int8, AVX2 asked, not proven: above avx2: quant_int8_native_avx512vnni"]  # fmt: skip
    assert "| trioserve auto, AVX2 | 41.0 | 0.50 | 1,500 | 40.0 | 0.50 | 50,000 | 1,618 |" in text
    # trioserve at AVX2 over llama-server at AVX2; the unproven row gets no ratio.
    assert "| llama-3.2-1b Q4_K_M, trioserve auto, AVX2 | 1.25x | 1.25x | 0.83x | 0.93x |" in text
    assert "| llama-3.2-1b Q4_K_M, trioserve auto | 1.66x |" in text
    assert "trioserve int8, AVX2" not in text.split("| trioserve over llama-server |")[1]


def test_a_run_at_avx2_alone_shows_no_native_row():
    document = _recorded_at_avx2()
    avx2 = document["machines"]["avx2"]
    document["machine"], document["machines"] = avx2, {"avx2": avx2}
    run = document["runs"][0]
    run["comparison"]["servers"] = [s for s in run["comparison"]["servers"] if s.get("isa") == "avx2"]
    text = format_report(document)
    # Its figures named by their class, never as native's.
    assert "| avx2 | 33.0 GB/s | 20 GFLOP/s |" in text and "| native |" not in text
    assert "| llama-3.2-1b | Q4_K_M | avx2 | 1.07B |" in text
    assert "| llama-3.2-1b Q4_K_M, trioserve auto, AVX2 | 1.25x |" in text


def test_an_unproven_avx2_row_is_left_out_of_the_plot(tmp_path):
    pytest.importorskip("matplotlib")
    document = _recorded_at_avx2()
    assert plot_report(document, tmp_path / "p.png").stat().st_size > 10_000
    for server in document["runs"][0]["comparison"]["servers"]:
        if server.get("isa") == "avx2":
            server["isa_check"]["proven"] = False
    del document["runs"][0]["comparison"]["servers"][::2]  # the native rows
    with pytest.raises(ValueError, match="nothing to plot"):
        plot_report(document, tmp_path / "q.png")


def test_the_int8_kernels_peak_is_measured_at_the_variant_asked():
    from trioserve.engine.kernels import native

    try:
        isas = native.cpu_isas()
    except native.NativeUnavailable as exc:
        pytest.skip(str(exc))
    if "avx2int8" not in isas:
        pytest.skip("no AVX2 int8 kernel on this CPU")
    # The AVX2 class's figure is taken on its own variant, not the CPU's best.
    assert measure_gemm("int8-trioserve", 32, 1, repeats=1, isa="avx2int8") > 1e8
    with pytest.raises(KeyError):
        measure_gemm("int8-trioserve", 32, 1, repeats=1, isa="avx9")
