"""Capability detection: each CPU path is tried, not assumed, the switch
forces the fallbacks, and what was chosen shows in the log, the CLI and
``/version``.

The fallback of the model itself (packed bfloat16 off) is checked in
test_model_equivalence.py; this file checks the detection, its messages,
and that a missing feature is found for real: with oneDNN capped at AVX2
before torch loads, the bfloat16 packing trial fails as it does on an AMD
Zen 3.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import httpx
import pytest
import torch
from server_fixtures import MODEL, server_config, serving

from trioserve.engine.kernels.capability import ASSUME_ENV, ISA_LEVELS, LIBRARY_CAPS, PROBES, CpuPaths, Probe, parse_assume, run_trial
from trioserve.engine.errors import CpuCapabilityError
from trioserve.engine.loading.loader import load_model
from trioserve.engine.models.projections import choose_projections
from trioserve.web.app import create_app

pytestmark = pytest.mark.cpu_paths

# Environment variables that change what the trials find.
_CAPS = (ASSUME_ENV, *LIBRARY_CAPS)


def _without_caps(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _CAPS}
    return {**env, **extra}


def _no_half_matmul() -> dict:
    # What torch builds before 2.1 answer for a float16 matmul on CPU.
    raise RuntimeError('"addmm_impl_cpu_" not implemented for \'Half\'')


def _paths_without_float16() -> CpuPaths:
    """The real probes, but float16's matmul as on a torch build without one."""
    probes = [p if p.name != "matmul_float16" else Probe(p.name, p.what, _no_half_matmul) for p in PROBES]
    return CpuPaths.detect(probes=probes)


def test_every_path_is_tried_and_the_switch_only_turns_paths_off():
    found = CpuPaths.detect()
    assert [p.name for p in found.paths] == [p.name for p in PROBES]
    assert found.capability == torch.backends.cpu.get_cpu_capability()
    assert found.assume is None and found.forced == ()
    for level in ("default", "avx2"):
        assumed = CpuPaths.detect(assume=level)
        assert assumed.assume == level
        above = [p.name for p in PROBES if ISA_LEVELS.index(level) < ISA_LEVELS.index(p.needs)]
        assert "onednn_packed_bfloat16" in above
        assert [p.name for p in assumed.forced] == above
        packed = assumed.status("onednn_packed_bfloat16")
        assert not packed.available
        assert f"off by {ASSUME_ENV}={level}" in packed.reason
        assert "AVX-512 BW/VL/DQ or AVX-NE-CONVERT" in packed.reason or packed.trial_error is not None
        # Every other path is what the trial found, forced or not.
        for mine, plain in zip(assumed.paths, found.paths):
            if mine.name not in above:
                assert mine == plain
    # AVX-512 without its BF16 extension: only the native linears' bfloat16 panels go.
    no_bf16 = CpuPaths.detect(assume="avx512")
    assert [p.name for p in no_bf16.forced] == [
        "quant_int4_native_avx512vnni", "quant_int4_native_avx512bf16",
        "quant_int8_native_avx512vnni", "quant_int8_native_avx512bf16", "quant_int4_bf16_gemm",
    ]  # fmt: skip
    # ... without VNNI, the variant whose 4-bit rows run on int8 activations
    # and the GEMM that needs AMX.
    no_vnni = CpuPaths.detect(assume="avx512bf16")
    assert [p.name for p in no_vnni.forced] == [
        "quant_int4_native_avx512vnni", "quant_int8_native_avx512vnni", "quant_int4_bf16_gemm"
    ]
    # ... and without AMX, only the bfloat16 GEMM of a prompt's 4-bit linears.
    assert [p.name for p in CpuPaths.detect(assume="avx512vnni").forced] == ["quant_int4_bf16_gemm"]
    top = CpuPaths.detect(assume=ISA_LEVELS[-1])
    assert top.forced == () and [p.available for p in top.paths] == [p.available for p in found.paths]


def test_a_trial_that_raises_or_computes_wrong_marks_its_path_missing():
    def raises() -> dict:
        raise RuntimeError("no such kernel\nsecond line")

    def wrong() -> dict:
        return {"op": (torch.ones(2, 3), torch.zeros(2, 3) + 2)}

    def nan() -> dict:
        return {"op": (torch.full((2,), float("nan")), torch.ones(2))}

    def misshapen() -> dict:
        return {"op": (torch.ones(3), torch.ones(2))}

    def right() -> dict:
        return {"op": (torch.tensor([1.0, 2.01]), torch.tensor([1.0, 2.0]))}

    assert run_trial(Probe("x", "x", raises)) == "RuntimeError: no such kernel"
    assert run_trial(Probe("x", "x", wrong)) == "op: off by 1 from float32 (tolerance 0.06)"
    assert run_trial(Probe("x", "x", nan)).startswith("op: off by nan")
    assert run_trial(Probe("x", "x", misshapen)) == "op: shape (3,), expected (2,)"
    assert run_trial(Probe("x", "x", right)) is None


def test_the_switch_is_read_from_the_environment_and_checked():
    paths = CpuPaths.from_environment({ASSUME_ENV: "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2", "PATH": "/bin"})
    assert paths.assume == "avx2"
    assert paths.library_caps == (("ONEDNN_MAX_CPU_ISA", "AVX2"),)
    assert CpuPaths.from_environment({ASSUME_ENV: ""}).assume is None
    assert parse_assume(None) is None
    bad = r"TRIOSERVE_CPU_ASSUME='avx3' is not a CPU level; use one of default, avx2, avx512"
    with pytest.raises(CpuCapabilityError, match=bad):
        CpuPaths.from_environment({ASSUME_ENV: "avx3"})
    shown = paths.as_json()
    assert shown["assume"] == "avx2" and shown["library_caps"] == {"ONEDNN_MAX_CPU_ISA": "AVX2"}
    assert shown["paths"]["onednn_packed_bfloat16"]["forced"] is True
    assert shown["paths"]["onednn_packed_bfloat16"]["available"] is False
    lines = paths.describe()
    assert lines[0].startswith(f"CPU paths: torch capability {paths.capability}, {ASSUME_ENV}=avx2")
    assert "  onednn_packed_bfloat16: NO (oneDNN packed bfloat16 weights: " in lines[2]


def test_oneDNN_capped_at_AVX2_fails_the_bfloat16_packing_trial_for_real():
    # As on an AVX2-only CPU: the trial itself fails, no switch involved.
    # (The cap must be set before torch loads, hence a fresh interpreter.)
    code = "import json; from trioserve.engine.kernels.capability import CpuPaths; print(json.dumps(CpuPaths.detect().as_json()))"
    env = _without_caps(ONEDNN_MAX_CPU_ISA="AVX2", ATEN_CPU_CAPABILITY="avx2")
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    found = json.loads(result.stdout)
    assert found["capability"] == "AVX2" and found["assume"] is None
    packed = found["paths"]["onednn_packed_bfloat16"]
    assert packed["available"] is False and packed["forced"] is False
    assert packed["reason"].startswith("oneDNN packed bfloat16 weights: trial failed: RuntimeError: ")
    assert "avx512bw" in packed["reason"]  # oneDNN's own words
    assert found["paths"]["onednn_packed_float32"]["available"] is True
    assert found["dtypes"] == ["float32", "bfloat16", "float16"]


def test_projections_are_chosen_by_capability():
    avx2 = CpuPaths.detect(assume="avx2")
    fp32 = choose_projections("cpu", torch.float32, avx2, None)
    assert fp32.packed is avx2.available("onednn_packed_float32")
    bf16 = choose_projections("cpu", torch.bfloat16, avx2, None)
    assert not bf16.packed and bf16.fallback
    assert bf16.reason.startswith(avx2.status("onednn_packed_bfloat16").reason + "; F.linear on the plain weights instead")
    assert bf16.as_json() == {
        "device": "cpu", "dtype": "bfloat16", "projections": "plain", "fallback": True, "reason": bf16.reason,
        "quantization": None, "invariance": None,  # set once a model is built (LlamaForCausalLM.invariance)
    }  # fmt: skip
    assert str(bf16) == f"bfloat16 on cpu, plain projections ({bf16.reason})"
    with pytest.raises(CpuCapabilityError, match="pack_weights=True, but oneDNN packed bfloat16 weights"):
        choose_projections("cpu", torch.bfloat16, avx2, True)
    half = choose_projections("cpu", torch.float16, avx2, None)
    assert not half.packed and not half.fallback and half.reason == "no packed path for float16: F.linear"
    off = choose_projections("cpu", torch.float32, avx2, False)
    assert not off.packed and not off.fallback and off.reason == "pack_weights=False: F.linear"
    # Off CPU nothing is packed, and nothing about the CPU is needed.
    gpu = choose_projections("cuda", torch.bfloat16, None, None)
    assert not gpu.packed and gpu.reason == "F.linear on cuda"
    with pytest.raises(ValueError, match="pack_weights needs a CPU float32 or bfloat16 model"):
        choose_projections("cuda", torch.float32, None, True)


def test_a_dtype_the_cpu_cannot_run_is_one_error_naming_it_and_what_runs():
    paths = _paths_without_float16()
    assert paths.dtypes() == (torch.float32, torch.bfloat16)
    paths.require_dtype(torch.bfloat16)
    message = (
        r"dtype float16 cannot run on this CPU \(float16 matmul: trial failed: RuntimeError: "
        r"\"addmm_impl_cpu_\" not implemented for 'Half'\); this machine runs float32, bfloat16 "
        r"\(torch CPU capability \w+\)"
    )
    with pytest.raises(CpuCapabilityError, match=message):
        paths.require_dtype(torch.float16)
    # The loader says so before it reads or converts anything.
    with pytest.raises(CpuCapabilityError, match=message):
        load_model("/no/such/model", dtype="float16", device="cpu", cpu_paths=paths)


def test_the_cli_reports_a_bad_switch_in_one_line():
    env = _without_caps(**{ASSUME_ENV: "avx3"})
    result = subprocess.run(
        [sys.executable, "-m", "trioserve.web.cli", "generate", "--max-tokens", "2", "Hi"],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 2
    assert result.stderr == (
        "trioserve: error: TRIOSERVE_CPU_ASSUME='avx3' is not a CPU level; use one of default, avx2, avx512, avx512bf16, avx512vnni, amx\n"
    )


@pytest.mark.slow
def test_generate_in_bfloat16_runs_on_the_path_this_cpu_has(cpu_paths):
    # Under .ci/run's forced pass this is the AVX2 fallback, for real.
    result = subprocess.run(
        [sys.executable, "-m", "trioserve.web.cli", "generate", "--dtype", "bfloat16", "--device", "cpu",
         "--max-tokens", "4", "--chat", "What is the capital of France?"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip()
    choice = choose_projections("cpu", torch.bfloat16, cpu_paths, None)
    assert choice.packed is cpu_paths.available("onednn_packed_bfloat16")
    # Logged once; a warning where the CPU made the model fall back.
    level = "WARNING" if choice.fallback else "INFO"
    assert result.stderr.count(f"{level} [-] trioserve.engine.loading.loader: {MODEL}: {choice}\n") == 1  # no request: id "-"


@pytest.mark.slow
async def test_version_and_the_startup_log_show_the_paths(cpu_paths, caplog):
    caplog.set_level(logging.INFO, logger="trioserve")
    loaded = load_model(None, dtype="bfloat16", device="cpu")
    app = create_app(server_config(), loaded=loaded)
    async with serving(app) as server, httpx.AsyncClient(base_url=server.url) as http:
        version = (await http.get("/version")).json()
        done = await http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "ignore_eos": True})
        assert done.status_code == 200
    cpu = version["cpu"]
    assert version["version"] == "0.1.0"
    assert cpu["capability"] == cpu_paths.capability and cpu["assume"] == cpu_paths.assume
    assert cpu["paths"] == {p.name: p.as_json() for p in cpu_paths.paths}
    packs = cpu_paths.available("onednn_packed_bfloat16")
    model = cpu["models"][MODEL]
    assert model["dtype"] == "bfloat16" and model["device"] == "cpu"
    assert model["projections"] == ("packed" if packs else "plain") and model["fallback"] is not packs
    assert model["reason"].startswith(cpu_paths.status("onednn_packed_bfloat16").reason)
    summary = f"bfloat16 on cpu, {model['projections']} projections"
    assert f"serving {MODEL} (max_model_len 512; {summary})" in caplog.text
    # The KV cache: a bfloat16 model's own dtype, in the budget the server was given (128 MiB).
    kv = version["kv_cache"][MODEL]
    assert kv["dtype"] == "bfloat16" and kv["dtype_reason"] == "the model's dtype (16 bits already)"
    assert kv["tokens"] == kv["blocks"] * kv["block_size"] and 0 < kv["bytes"] <= 128 << 20
    assert kv["reason"] == "kv_cache_memory 128.0 MiB"
    assert f"KV cache in bfloat16 (the model's dtype (16 bits already)); pool of {kv['tokens']} tokens" in caplog.text
