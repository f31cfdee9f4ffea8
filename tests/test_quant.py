"""Compressed weights (engine/kernels): formats, GGUF decoding, kernels, the
chooser, and loading a float checkpoint quantized (cached) or refused."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from trioserve.engine.kernels import capability
from trioserve.engine.kernels.capability import CpuPaths, PathStatus
from trioserve.engine.errors import CpuCapabilityError
from trioserve.engine.loading.loader import load_model
from trioserve.engine.kernels import choose
from trioserve.engine.loading import gguf_weights
from trioserve.engine.kernels import int4_native
from trioserve.engine.kernels import native
from trioserve.engine.kernels import rtn
from trioserve.engine.loading import rtn_cache
from trioserve.engine.loading.compressed import wanted
from trioserve.engine.kernels.q8_lanes import Q8Lanes
from trioserve.testing.quality import prompt_logits

from test_loader import make_checkpoint, write_tokenizer

QUANT_PATHS = [k.name for k in choose.KERNELS]


def test_rtn_int8_round_trip_is_within_half_a_step():
    w = torch.randn(40, 64)
    q = rtn.quantize_int8(w)
    assert q.q.dtype == torch.int8
    assert ((q.dequantize() - w).abs() <= q.scale[:, None] / 2 + 1e-6).all()


def test_rtn_int4_round_trip_is_within_half_a_step_and_checks_group_size():
    w = torch.randn(8, 96)
    q = rtn.quantize_int4(w, 32)
    assert int(q.q.max()) <= 15 and q.scale.shape == (8, 3)
    step = q.scale.repeat_interleave(32, dim=1)
    assert ((q.dequantize() - w).abs() <= step / 2 + 1e-5).all()
    with pytest.raises(ValueError, match=r"group size 64 does not divide blk\.w's input dimension 96"):
        rtn.quantize_int4(w, 64, "blk.w")


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0"])
def test_gguf_blocks_decode_exactly_like_the_reference(kind):
    import gguf

    qtype = gguf.GGMLQuantizationType[kind]
    data = np.random.default_rng(0).standard_normal((6, 64)).astype(np.float32)
    blocks = gguf.quants.quantize(data, qtype)
    reference = torch.from_numpy(gguf.quants.dequantize(blocks, qtype))
    if kind == "Q8_0":
        got = gguf_weights.decode_q8_0(blocks)
    else:
        got = gguf_weights.decode_q4(kind, blocks).dequantize()
    assert torch.equal(got, reference)


def _write_gguf(path: Path, tensors: dict[str, tuple[np.ndarray, object]]) -> None:
    """A GGUF of ``{name: (array, qtype)}``: a float array quantized to
    ``qtype`` (None: as it is), a uint8 array taken as ``qtype``'s blocks."""
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    for name, (array, qtype) in tensors.items():
        if qtype is None:
            writer.add_tensor(name, array)
        elif array.dtype == np.uint8:
            writer.add_tensor(name, array, raw_dtype=qtype)
        else:
            writer.add_tensor(name, gguf.quants.quantize(array, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_gguf_reader_maps_names_and_unpermutes_q(tmp_path):
    import gguf

    rng = np.random.default_rng(1)
    q = rng.standard_normal((12, 32)).astype(np.float32)
    norm = rng.standard_normal(32).astype(np.float32)
    path = tmp_path / "m.gguf"
    _write_gguf(path, {"blk.0.attn_q.weight": (q, gguf.GGMLQuantizationType.Q4_1), "blk.0.attn_norm.weight": (norm, None)})
    got = dict(gguf_weights.read_tensors(path, num_heads=2, num_kv_heads=1))  # heads of 6 rows
    assert set(got) == {"model.layers.0.self_attn.q_proj.weight", "model.layers.0.input_layernorm.weight"}
    # llama.cpp stores a head's rows (0 1 2 | 3 4 5) as (0 3 1 4 2 5); Hugging Face's order is back.
    stored = gguf.quants.dequantize(gguf.quants.quantize(q, gguf.GGMLQuantizationType.Q4_1), gguf.GGMLQuantizationType.Q4_1)
    order = [0, 2, 4, 1, 3, 5, 6, 8, 10, 7, 9, 11]
    assert torch.equal(got["model.layers.0.self_attn.q_proj.weight"].dequantize(), torch.from_numpy(stored[order]))
    assert torch.equal(got["model.layers.0.input_layernorm.weight"], torch.from_numpy(norm))



@pytest.mark.cpu_paths
def test_every_kernel_that_runs_here_matches_the_dequantized_weights(cpu_paths):
    """Each kernel whose trial passed (under the forced-AVX2 pass, what is
    left) against F.linear over the weights it holds; the chooser picks one
    of them, and a kernel that is off is never chosen."""
    usable = [k for k in choose.KERNELS if cpu_paths.available(k.name)]
    assert usable, cpu_paths.describe()
    gen = torch.Generator().manual_seed(0)
    # 12 rows: from 10 the AVX-512 variants run their panels (csrc/panel.h).
    w, bias, x = torch.randn(48, 64, generator=gen), torch.randn(48, generator=gen), torch.randn(12, 64, generator=gen)
    for kernel in usable:
        held = rtn.quantize_int4(w, 32) if kernel.bits == 4 else rtn.quantize_int8(w)
        want = F.linear(x, held.dequantize(), bias)
        got = kernel.make(held, bias, 32)(x)
        # fbgemm rounds activations to 7 bits, the bfloat16 kernels and panels to 8.
        assert (got - want).abs().max() <= 0.02 * want.abs().max(), kernel.name
    picked = choose.choose_kernel(cpu_paths, "auto", [(48, 64), (64, 32)])
    assert picked.kernel in usable


def test_a_quantization_no_kernel_runs_is_refused_with_what_the_machine_runs():
    four_bit = {k.name for k in choose.KERNELS if k.bits == 4}
    probes = [p for p in capability.PROBES if p.name not in four_bit]
    paths = CpuPaths.detect(probes=probes)
    with pytest.raises(CpuCapabilityError, match=r"quantization int4 cannot run on this CPU.*runs int8, none"):
        choose.candidates(paths, "int4")
    none = CpuPaths.detect(probes=[p for p in capability.PROBES if p.name not in QUANT_PATHS])
    with pytest.raises(CpuCapabilityError, match="this machine runs only none"):
        choose.candidates(none, "auto")


def test_auto_compresses_a_gguf_on_cpu_float32_only():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert wanted("auto", is_gguf=True, device=cpu, dtype=torch.float32)
    assert not wanted("auto", is_gguf=False, device=cpu, dtype=torch.float32)
    assert not wanted("auto", is_gguf=True, device=cuda, dtype=torch.bfloat16)
    assert not wanted("none", is_gguf=True, device=cpu, dtype=torch.float32)
    assert wanted("int4", is_gguf=False, device=cpu, dtype=torch.float32)


def _checkpoint(folder: Path) -> None:
    """A tiny random Llama whose projections all take multiples of 32 inputs, untied."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, eos_token_id=2, bos_token_id=1,
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(str(folder))
    write_tokenizer(folder)


@pytest.mark.parametrize(("scheme", "group"), [("int8", 32), ("int4", 32)])
def test_a_float_checkpoint_quantizes_once_into_the_cache(tmp_path, scheme, group):
    folder = tmp_path / "ckpt"
    _checkpoint(folder)
    cache = tmp_path / "cache"
    ids = [1, 5, 9, 3, 7, 11, 4, 8]
    # One kernel a width (the first this machine runs; a 4-bit model's head
    # is int8), so that both loads below run the same ones whatever the
    # mode picks (the logits are compared exactly). The chooser is tested on its own.
    here = CpuPaths.from_environment()
    kept = {choose.candidates(here, width)[0].name for width in {scheme, "int8"}}
    pinned = CpuPaths.from_environment(probes=[p for p in capability.PROBES if p.name not in QUANT_PATHS or p.name in kept])
    float_model = load_model(str(folder), quantization="none")
    load = {"quantization": scheme, "quantization_group_size": group, "cache_dir": cache, "cpu_paths": pinned}
    quant = load_model(str(folder), **load)
    assert quant.projection_choice.quantization == scheme
    assert not any(p.numel() > 64 * 64 and "embed" not in n for n, p in quant.model.named_parameters())
    entries = list(cache.iterdir())
    assert len(entries) == 1 and (entries[0] / rtn_cache.FILE).is_file()
    stamp = os.stat(entries[0] / rtn_cache.FILE).st_mtime_ns
    again = load_model(str(folder), **load)
    assert list(cache.iterdir()) == entries and os.stat(entries[0] / rtn_cache.FILE).st_mtime_ns == stamp
    ref, got, got_again = (prompt_logits(m.model, ids) for m in (float_model, quant, again))
    assert torch.equal(got, got_again)
    assert (got - ref).abs().max() <= (0.05 if scheme == "int8" else 0.25) * ref.abs().max()
    # The untied LM head is kept in int8 groups of 32 (a step a group), each
    # value within half its group's step; where the native int8 kernels run,
    # the model runs those groups as they are.
    head = dict(rtn_cache.read(entries[0]))["lm_head.weight"]
    assert isinstance(head, rtn.Int8GroupWeight) and head.group_size == rtn_cache.HEAD_GROUP == 32
    float_head = float_model.model.lm_head.detach().view(64, 2, 32)
    error = (head.dequantize().view(64, 2, 32) - float_head).abs().amax(-1)
    assert (error <= head.scale / 2 * (1 + 1e-5)).all()
    made = quant.model._projections()
    if any(pinned.works(f"quant_int8_native_{isa}") for isa in native.LINEAR_ISA_ORDER):
        held = made.head.weight
        held = held.groups() if isinstance(held, Q8Lanes) else held  # avx2int8's layout of the same values
        assert torch.equal(held.q, head.q) and torch.equal(held.scale, head.scale)


def test_a_group_size_that_does_not_divide_a_dimension_is_refused_at_load(tmp_path):
    folder = tmp_path / "ckpt"
    make_checkpoint(folder)  # hidden 32, intermediate 48
    with pytest.raises(ValueError, match=r"group size 32 does not divide down projection's input dimension 48"):
        load_model(str(folder), quantization="int4", quantization_group_size=32, cache_dir=tmp_path / "c")
    with pytest.raises(ValueError, match=r"group size 16: the 4-bit kernel runs groups of 32, 64, 128, 256 only"):
        load_model(str(folder), quantization="int4", quantization_group_size=16, cache_dir=tmp_path / "c")


@pytest.mark.cpu_paths
@pytest.mark.parametrize("scheme", ["auto", "int4", "int8"])
def test_the_kernel_choice_is_a_rule_over_what_the_cpu_runs_never_a_timing(cpu_paths, scheme):
    """Two starts on one machine run the same kernel (issue 39): the choice
    is the first candidate in KERNELS' order, nothing timed."""
    assert not hasattr(choose, "measure")  # nothing left to time the kernels with
    for invariant in (True, False):
        picked = choose.choose_kernel(cpu_paths, scheme, [(64, 64)], batch_invariant=invariant)
        assert picked == choose.choose_kernel(cpu_paths, scheme, [(64, 64)], batch_invariant=invariant)
        assert picked.kernel is choose.candidates(cpu_paths, scheme, batch_invariant=invariant)[0]
        assert picked.label == f"int{picked.kernel.bits}" and "chosen by rule" in picked.reason
        if scheme != "int8" and any(k.family == "native4" for k in choose.candidates(cpu_paths, scheme)):
            assert picked.kernel.family == "native4"  # native first: the fused step runs every layer


@pytest.mark.parametrize("level", ["avx512", "avx512bf16", "avx512vnni"])
def test_batch_invariant_takes_only_4_bit_variants_whose_rows_keep_their_bits(level):
    """avx512 and avx512bf16 switch to panels of another arithmetic from 10
    rows, so a batch-invariant model passes over them (an AVX-512 CPU
    without VNNI runs avx2int8); the fast mode takes the best variant."""
    paths = CpuPaths.from_environment({"TRIOSERVE_CPU_ASSUME": level})
    native4 = [k for k in choose.candidates(paths, "int4", batch_invariant=True) if k.family == "native4"]
    if not any(paths.works(f"quant_int4_native_{isa}") for isa in native.LINEAR_ISA_ORDER):
        pytest.skip("no native 4-bit kernel runs here")
    assert [k.isa for k in native4] and native4[0].isa in choose.ROW_INVARIANT_ISAS
    fast = next(k for k in choose.candidates(paths, "int4") if k.family == "native4")
    best = next(isa for isa in native.LINEAR_ISA_ORDER if paths.works(f"quant_int4_native_{isa}"))
    assert fast.isa == best


def test_the_bfloat16_gemm_runs_prompts_only_outside_batch_invariant_mode():
    """On AMX, outside batch-invariant mode, a prompt's 4-bit calls from
    BF16_GEMM_FROM_ROWS rows run torch's bfloat16 GEMM; batch-invariant,
    never (the fused step runs every token), nor where the path is off."""
    try:
        native.ops()
    except native.NativeUnavailable as exc:
        pytest.skip(str(exc))
    vnni = CpuPaths.from_environment({})
    if not vnni.works("quant_int4_native_avx512vnni"):
        pytest.skip("this CPU runs no avx512vnni kernel")
    # This CPU's own status of the GEMM path (on where it has AMX) replaced by each case's.
    others = tuple(p for p in vnni.paths if p.name != int4_native.BF16_GEMM_PATH)
    on = CpuPaths("AVX512", None, (*others, PathStatus(int4_native.BF16_GEMM_PATH, "the GEMM", None)))
    fast = choose.choose_kernel(on, "auto", [(64, 64)], batch_invariant=False)
    assert fast.gemm_from_rows == choose.BF16_GEMM_FROM_ROWS
    assert fast.make(torch.randn(64, 64), None).gemm_from_rows == choose.BF16_GEMM_FROM_ROWS
    assert f"bfloat16 GEMM from {choose.BF16_GEMM_FROM_ROWS} rows" in fast.reason
    invariant = choose.choose_kernel(on, "auto", [(64, 64)])
    assert invariant.gemm_from_rows is None and invariant.make(torch.randn(64, 64), None).gemm_from_rows is None
    off = CpuPaths("AVX512", None, (*others, PathStatus(int4_native.BF16_GEMM_PATH, "the GEMM", None, "TRIOSERVE_CPU_ASSUME=avx512vnni")))
    assert choose.choose_kernel(off, "auto", [(64, 64)], batch_invariant=False).gemm_from_rows is None


