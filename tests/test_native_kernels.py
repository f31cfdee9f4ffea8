"""The native kernels (engine/kernels/csrc, built by scripts/setup.sh): each
ISA variant this CPU runs against the dequantized weights, the chooser's
pick among them, and the fused decode step against the model's own layers.

Where the library is not built, these tests skip with how to build it,
except under CI=true, where setup.sh must have built it."""

from __future__ import annotations

import json
import random

import attrs
import pytest
import torch
import torch.nn.functional as F
from hypothesis import example, given, settings
from hypothesis import strategies as st

from trioserve.engine.kernels.capability import CpuPaths
from trioserve.engine.config import ModelConfig
from trioserve.engine.layers.forward_batch import ForwardBatch, SeqChunk
from trioserve.engine.layers.kv_cache import KVCache
from trioserve.engine.kernels import choose
from trioserve.engine.kernels import int4_native
from trioserve.engine.kernels import int8_native
from trioserve.engine.kernels import native
from trioserve.engine.loading.compressed import load_safetensors_quantized
from trioserve.engine.kernels.rtn import quantize_int4, quantize_int8, quantize_int8_groups

from test_quant import _checkpoint


def test_the_library_is_built_for_this_source_and_runs_scalar_everywhere(isas):
    assert native.library_path().is_file()
    assert "scalar" in isas
    assert native.build_tag() in str(native.library_path())


# csrc/panel.h's kPanelFromRows: from this many rows the AVX-512 variants run
# panels, avx512bf16 and, called from the model's layers, avx512vnni with
# bfloat16 products (int4_native.call_isa); below it the 4-bit kernels of
# avx512vnni and avx2int8 round the activations to int8 in groups of 32
# (avx2int8 takes avx2's kernels from 10 rows in the layers), and from 10
# rows avx2's 4-bit panels round them to int16 in groups of 32. The op
# itself, called with avx512vnni from 10 rows (as the fused decode step does),
# runs the VNNI panels on int8 activations (csrc/panel_vnni.h), and with
# avx2int8 its int8 rows at any count.
PANEL_FROM_ROWS = int4_native.PANEL_FROM_ROWS
BF16_PANELS = ("avx512bf16", "avx512vnni")
# The variants whose 4-bit row kernels take int8 activations.
INT8_ROWS = ("avx512vnni", "avx2int8")


def int8_activations(isa: str, rows: int, bits: int) -> bool:
    """Whether a linear's call of ``rows`` rows on ``isa`` rounds its activations to int8."""
    return isa in INT8_ROWS and bits == 4 and rows < PANEL_FROM_ROWS


def int16_activations(isa: str, rows: int, bits: int) -> bool:
    """Whether a linear's call of ``rows`` rows on ``isa`` runs avx2's int16
    panels (csrc/panel_avx2_int16.h; avx2int8 from the layers takes them too)."""
    return isa in ("avx2", "avx2int8") and bits == 4 and rows >= PANEL_FROM_ROWS


def assert_matches(
    got: torch.Tensor,
    x: torch.Tensor,
    w: torch.Tensor,
    b: torch.Tensor | None,
    isa: str,
    *,
    bits: int = 8,
) -> None:
    """``got`` is ``x @ w.T + b`` up to the order of the sums; for bfloat16
    panels, up to rounding each input and weight to bfloat16 (at most 2**-8
    of each product, well under 2**-7 with the float32 sums); for int8 or
    int16 activations, up to rounding each input by at most half its group's
    step (amax / 127 or amax / 32767)."""
    want = F.linear(x, w, b)
    int8, int16 = int8_activations(isa, x.shape[0], bits), int16_activations(isa, x.shape[0], bits)
    if int8 or int16:
        groups = x.view(x.shape[0], -1, 32)
        levels = 127 if int8 else 32767
        half_step = (groups.abs().amax(-1, keepdim=True) / (2 * levels)).expand_as(groups).reshape(x.shape)
        bound = (half_step @ w.abs().T) * 1.01 + 1e-5
    elif isa in BF16_PANELS and x.shape[0] >= PANEL_FROM_ROWS:
        bound = (x.abs() @ w.abs().T) * 2**-7 + 1e-5
    else:
        assert torch.allclose(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item()), (isa, x.shape)
        return
    assert ((got - want).abs() <= bound).all(), (isa, ((got - want).abs() / bound).max().item())
    # ... and not float32's result either: the narrower products did run.
    assert not torch.allclose(got, want, rtol=1e-6, atol=0), isa


@settings(max_examples=40, deadline=None)
@given(
    rows=st.integers(1, 20),
    out=st.integers(1, 40),
    groups=st.integers(1, 4),
    group_size=st.sampled_from([32, 64]),
    bias=st.booleans(),
    seed=st.integers(0, 2**16),
)
# From 10 rows AVX-512 runs the panels of csrc/panel.h: a short last panel and tile.
@example(rows=13, out=37, groups=3, group_size=32, bias=True, seed=1)
def test_each_variant_matches_the_dequantized_weights(isas, rows, out, groups, group_size, bias, seed):
    """Any row count (passes of up to 8 rows and a remainder; from 10 rows on
    AVX-512, tiles over decoded panels of channels, in bfloat16 products on
    avx512bf16), any output count (split
    over threads), 4-bit groups of 32 or 64 and int8 rows with a tail past
    the vector width: the float32 matmul of the dequantized weight."""
    gen = torch.Generator().manual_seed(seed)
    k = groups * 64
    x = torch.randn(rows, k, generator=gen)
    w = torch.randn(out, k, generator=gen)
    b = torch.randn(out, generator=gen) if bias else None
    q4, q8 = quantize_int4(w, group_size), quantize_int8(w[:, : k - 8])
    for isa in isas:
        got4 = int4_native.Int4NativeLinear.from_rtn(q4, b, isa)(x)
        got8 = int8_native.Int8NativeLinear.from_rtn(q8, b, isa)(x[:, : k - 8])
        assert_matches(got4, x, q4.dequantize(), b, isa, bits=4)
        assert_matches(got8, x[:, : k - 8], q8.dequantize(), b, isa)


def rounded_rows(x: torch.Tensor, levels: int = 127) -> torch.Tensor:
    """``x`` rounded as the VNNI kernels round it: to int8 in groups of 32,
    step amax / 127 (``levels`` 32767: as avx2's int16 panels do)."""
    groups = x.view(x.shape[0], -1, 32)
    amax = groups.abs().amax(-1, keepdim=True)
    scale = torch.where(amax > 0, levels / amax, torch.zeros_like(amax))
    return (torch.round(groups * scale).clamp(-levels, levels) * (amax / levels)).reshape(x.shape)


@pytest.mark.parametrize("variant", INT8_ROWS)
def test_the_int8_4bit_rows_round_only_the_activations_and_each_row_alone(isas, variant):
    """avx512vnni's (its panels) and avx2int8's (its row kernel) 4-bit calls
    of 1 to 9 rows: an odd number of blocks (a lone last block), passes of 8
    and a remainder, a group of zeros (no step to divide by): within half an
    int8 step of each activation, and every row exactly what it gives alone,
    so a batch or a speculative step's verified rows never change a
    sequence's result. From the model's layers avx2int8's calls of 10 rows
    or more take avx2's int16 panels."""
    if variant not in isas:
        pytest.skip(f"this CPU cannot run {variant} ({native.ISA_REQUIREMENTS[variant]})")
    gen = torch.Generator().manual_seed(3)
    for k in (32, 96, 160, 576):
        q4 = quantize_int4(torch.randn(37, k, generator=gen), 32)
        linear = int4_native.Int4NativeLinear.from_rtn(q4, None, variant)
        for rows in range(1, PANEL_FROM_ROWS):
            x = torch.randn(rows, k, generator=gen)
            if k > 32:
                x[0, :32] = 0.0
            got = linear(x)
            assert_matches(got, x, q4.dequantize(), None, variant, bits=4)
            # The rounded rows' matmul, m against the rounded sums too.
            want = F.linear(rounded_rows(x), q4.dequantize())
            assert (got - want).abs().max() <= 1e-5 * want.abs().max(), (k, rows)
            alone = torch.cat([linear(x[r : r + 1]) for r in range(rows)])
            assert torch.equal(got, alone), (k, rows)
        assert torch.equal(linear(torch.zeros(2, k)), torch.zeros(2, 37))
        if variant == "avx2int8":  # from the layers, 10 rows or more take avx2's int16 panels
            x = torch.randn(13, k, generator=gen)
            assert_matches(linear(x), x, q4.dequantize(), None, "avx2", bits=4)
            assert torch.equal(linear(x), int4_native.Int4NativeLinear.from_rtn(q4, None, "avx2")(x)), k


@pytest.mark.parametrize("variant", INT8_ROWS)
def test_the_int8_panels_compute_exactly_the_rounded_rows_and_each_row_alone(isas, variant):
    """avx512vnni's panels (csrc/panel_vnni.h: 4-bit blocks and int8 in
    groups of 32, GGUF's Q8_0) and avx2int8's (csrc/panel_avx2.h: 4-bit
    blocks), from 10 rows, as the fused decode step calls them, with short
    last panels and tiles, a group of zeros, and at 1,536 inputs more rows
    than a row block holds (336 and 340 rows). Each result is the rounded rows'
    matmul up to float32 rounding, far inside the int8 bound; and a row's
    result does not depend on how many rows it runs with, from 1 row on:
    below the panels the row kernels (csrc/rows_vnni.h, csrc/rows_avx2.h)
    give the panels' bits. The model's layers call the bfloat16 or int16
    panels from 10 rows instead."""
    if variant not in isas:
        pytest.skip(f"this CPU cannot run {variant} ({native.ISA_REQUIREMENTS[variant]})")
    from trioserve.engine.kernels.rtn import Int8GroupWeight

    gen = torch.Generator().manual_seed(5)
    for k in (32, 96, 576, 1536):
        w = torch.randn(37, k, generator=gen)
        q4 = quantize_int4(w, 32)
        q8g = Int8GroupWeight(torch.randint(-127, 128, (37, k), generator=gen, dtype=torch.int8),
                              torch.rand(37, k // 32, generator=gen) * 0.01, 32)
        index, ops = native.ISAS[variant], native.ops()
        blocks = int4_native.Int4NativeLinear.from_rtn(q4, None, variant).blocks
        linears = [("4-bit", lambda x: ops.q4_linear(x, blocks, index), q4)]
        if variant == "avx512vnni":
            linears.append(("Q8_0", lambda x: ops.q8g_linear(x, q8g.q, q8g.scale, index), q8g))
        x = torch.randn(400 if k == 1536 else 40, k, generator=gen)
        x[3, :32] = 0.0
        for name, linear, weight in linears:
            full = linear(x)
            for rows in (PANEL_FROM_ROWS, 13, x.shape[0]):
                got = full if rows == x.shape[0] else linear(x[:rows])
                want = F.linear(rounded_rows(x[:rows]), weight.dequantize())
                assert (got - want).abs().max() <= 1e-5 * want.abs().max(), (k, rows, name)
                assert torch.equal(got, full[:rows]), (k, rows, name)
        # A decode step of any size, and its LM head: one sequence's bits
        # whatever the batch (the row kernels of csrc/rows_vnni.h up to 8
        # rows and the panels from 9; on avx2int8 those of csrc/rows_avx2.h
        # below 10 rows).
        for name, linear, _ in linears:
            full = linear(x)
            for rows in (1, 2, 3, 4, 5, 7, 8, 9):
                assert torch.equal(linear(x[:rows]), full[:rows]), (k, rows, name)
            assert linear(x[:0]).shape == (0, 37), name  # no rows: nothing to run
        # From the layers, the same call runs the bfloat16 or int16 panels.
        layered = int4_native.Int4NativeLinear.from_rtn(q4, None, variant)(x)
        assert_matches(layered, x, q4.dequantize(), None, variant, bits=4)
        assert not torch.equal(layered, linears[0][1](x))


def test_the_avx2_panels_match_the_dequantized_weights_and_keep_each_row_alone(isas):
    """avx2's panels, from 10 rows: float32 ones (csrc/panel_avx2.h) for int8
    per channel with inputs past a multiple of 8 (the transpose's tail) and
    for Q8_0, int16 ones (csrc/panel_avx2_int16.h) for 4-bit blocks; a short
    last panel (37 channels: 16 + 16 + 5) and tile, a group of zeros, and at
    1,536 inputs more rows than one row block holds (84 float32 rows, 168
    int16 ones). The float32 panels give the float32 matmul of the
    dequantized weight; the int16 ones the matmul of the rows rounded to
    int16 in groups of 32, up to float32 rounding, and not float32's result;
    either way a row's result does not depend on how many rows it runs
    with."""
    if "avx2" not in isas:
        pytest.skip(f"this CPU cannot run avx2 ({native.ISA_REQUIREMENTS['avx2']})")
    from trioserve.engine.kernels.rtn import Int8GroupWeight

    gen = torch.Generator().manual_seed(7)
    avx2, ops = native.ISAS["avx2"], native.ops()
    for k, rows in ((96, 40), (100, 40), (1536, 180)):
        w = torch.randn(37, k, generator=gen)
        q8 = quantize_int8(w)
        linears = [("int8", lambda x, q8=q8: ops.q8_linear(x, q8.q, q8.scale, avx2), q8)]
        if k % 32 == 0:
            q4 = quantize_int4(w, 32)
            blocks = int4_native.Int4NativeLinear.from_rtn(q4, None, "avx2").blocks
            q8g = Int8GroupWeight(torch.randint(-127, 128, (37, k), generator=gen, dtype=torch.int8),
                                  torch.rand(37, k // 32, generator=gen) * 0.01, 32)
            linears += [("4-bit", lambda x, blocks=blocks: ops.q4_linear(x, blocks, avx2), q4),
                        ("Q8_0", lambda x, q8g=q8g: ops.q8g_linear(x, q8g.q, q8g.scale, avx2), q8g)]
        x = torch.randn(rows, k, generator=gen)
        x[3, :32] = 0.0
        for name, linear, weight in linears:
            full = linear(x)
            want = F.linear(x, weight.dequantize())
            if name == "4-bit":
                assert_matches(full, x, weight.dequantize(), None, "avx2", bits=4)
                rounded = F.linear(rounded_rows(x, 32767), weight.dequantize())
                assert (full - rounded).abs().max() <= 1e-5 * rounded.abs().max(), k
            else:
                assert torch.allclose(full, want, rtol=1e-4, atol=1e-4 * want.abs().max().item()), (k, name)
            for part in (PANEL_FROM_ROWS, 13):
                assert torch.equal(linear(x[:part]), full[:part]), (k, part, name)


def test_from_many_rows_a_call_without_panels_runs_the_gemm_over_the_dequantized_matrix(isas):
    gen = torch.Generator().manual_seed(1)
    rows = int4_native.DEQUANTIZE_FROM_ROWS
    w, b = torch.randn(24, 96, generator=gen), torch.randn(24, generator=gen)
    q4, q8 = quantize_int4(w, 32), quantize_int8(w)
    blocks = int4_native.Int4NativeLinear.from_rtn(q4, b, isas[-1]).blocks
    # q * d + m against (q - 8) * scale + zero: the same values, rounded apart.
    assert torch.allclose(native.ops().q4_dequantize(blocks), q4.dequantize(), rtol=1e-6, atol=1e-6)
    for isa in isas:
        # The AVX2 and AVX-512 variants run their panels at any row count, a prefill chunk's too.
        panels = isa != "scalar"
        assert int4_native.dequantizes(native.ISAS[isa], rows) is not panels
        assert not int4_native.dequantizes(native.ISAS[isa], rows - 1)
        for x in (torch.randn(rows - 1, 96, generator=gen), torch.randn(rows + 3, 96, generator=gen)):
            for linear, held in ((int4_native.Int4NativeLinear, q4), (int8_native.Int8NativeLinear, q8)):
                bits = 4 if linear is int4_native.Int4NativeLinear else 8
                assert_matches(linear.from_rtn(held, b, isa)(x), x, held.dequantize(), b, isa, bits=bits)


@given(st.integers(1, 4), st.integers(1, 3), st.integers(0, 2**31 - 1))
@settings(max_examples=20, deadline=None)
def test_lanes_blocks_are_a_permutation_of_the_blocks(panels, groups, seed):
    blocks = torch.randint(0, 256, (16 * panels, groups, 20), dtype=torch.uint8,
                           generator=torch.Generator().manual_seed(seed))
    lanes = int4_native.to_lanes(blocks)
    assert lanes.shape == (panels, groups, int4_native.LANES_BLOCK_BYTES)
    assert torch.equal(int4_native.from_lanes(lanes), blocks)
    assert torch.equal(lanes.flatten().sort().values, blocks.flatten().sort().values)


def test_avx2int8_holds_4_bit_weights_as_lanes_blocks_with_the_blocks_bits(isas):
    """avx2int8 keeps a 4-bit matrix of whole panels of 16 channels as lanes
    blocks (csrc/lanes_avx2.h: the same bytes, channels in the vector lanes),
    and every call gives the bits the kernels over GGUF's blocks give: its
    int8 kernels at every row count (rows_avx2.h's below 10 rows, the
    panels' from 10), and the int16 panels a prompt's rows take from the
    layers (isa avx2 from 10 rows). Where the channels are no whole panels
    the blocks stay as they are. The layout is in the shape, and a kernel
    that cannot read lanes blocks refuses them."""
    if "avx2int8" not in isas:
        pytest.skip(f"this CPU cannot run avx2int8 ({native.ISA_REQUIREMENTS['avx2int8']})")
    gen = torch.Generator().manual_seed(11)
    ops, int8, avx2 = native.ops(), native.ISAS["avx2int8"], native.ISAS["avx2"]
    for out, k in ((16, 32), (48, 96), (64, 1536)):
        q4 = quantize_int4(torch.randn(out, k, generator=gen), 32)
        linear = int4_native.Int4NativeLinear.from_rtn(q4, None, "avx2int8")
        blocks = int4_native.pack_blocks(q4)
        assert linear.blocks.shape == (out // 16, k // 32, 320) and linear.nbytes == blocks.numel()
        assert torch.equal(linear.row_blocks(), blocks)
        x = torch.randn(40, k, generator=gen)
        x[3, :32] = 0.0
        for rows in (1, 2, 3, 4, 5, 6, 7, 8, 9, PANEL_FROM_ROWS, 13, 40):
            got = ops.q4_linear(x[:rows], linear.blocks, int8)
            assert torch.equal(got, ops.q4_linear(x[:rows], blocks, int8)), (out, k, rows)
            # The model's layers: int8 below 10 rows, the int16 panels from there.
            assert torch.equal(linear(x[:rows]), attrs.evolve(linear, blocks=blocks)(x[:rows])), (out, k, rows)
        for rows in (PANEL_FROM_ROWS, 40):
            assert torch.equal(ops.q4_linear(x[:rows], linear.blocks, avx2), ops.q4_linear(x[:rows], blocks, avx2))
        assert ops.q4_linear(x[:0], linear.blocks, int8).shape == (0, out)
    kept = int4_native.Int4NativeLinear.from_rtn(quantize_int4(torch.randn(40, 64, generator=gen), 32), None, "avx2int8")
    assert kept.blocks.shape == (40, 2, 20)  # 16 + 16 + 8 channels: no whole panels
    lanes = int4_native.Int4NativeLinear.from_rtn(quantize_int4(torch.randn(32, 64, generator=gen), 32), None, "avx2int8")
    with pytest.raises(RuntimeError, match="lanes blocks run on isa 2 .avx2int8., or 1 .avx2. from 10 rows; not isa 1 at 3 rows"):
        ops.q4_linear(torch.randn(3, 64), lanes.blocks, avx2)
    with pytest.raises(RuntimeError, match=r"blocks must be uint8 \[out, in / 32, 20\], or lanes blocks"):
        ops.q4_linear(torch.randn(3, 64), lanes.blocks[..., :300], int8)


def test_a_variant_the_cpu_lacks_or_a_bad_shape_is_refused(isas):
    q = quantize_int4(torch.randn(8, 64), 32)
    linear = int4_native.Int4NativeLinear.from_rtn(q, None, "scalar")
    with pytest.raises(RuntimeError, match="unknown isa 7"):
        native.ops().q4_linear(torch.randn(1, 64), linear.blocks, 7)
    with pytest.raises(RuntimeError, match="x has 32 inputs, the weight 64"):
        linear(torch.randn(1, 32))
    with pytest.raises(ValueError, match="multiple of 32"):
        int4_native.pack_blocks(quantize_int4(torch.randn(8, 64), 16))


def test_only_the_best_variant_of_a_family_is_a_candidate():
    full = CpuPaths.from_environment({})
    avx2 = CpuPaths.from_environment({"TRIOSERVE_CPU_ASSUME": "avx2"})
    for paths in (full, avx2):
        names = [k.name for k in choose.candidates(paths, "auto")]
        for family in ("native4", "native8"):
            members = [k.name for k in choose.KERNELS if k.family == family]
            usable = [m for m in members if paths.available(m)]
            assert [n for n in names if n in members] == usable[:1]
    assert not any(n.endswith("_avx512") for n in (k.name for k in choose.candidates(avx2, "auto")))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("native") / "ckpt"
    _checkpoint(folder)  # hidden 64, 4 heads of 16, 2 KV heads, 2 layers
    return folder


def _native_model(checkpoint, cache_dir, isa: str):
    config = ModelConfig.from_hf_config(json.loads((checkpoint / "config.json").read_text()))
    kernel = next(k for k in choose.KERNELS if k.name == f"quant_int4_native_{isa}")
    choice = choose.KernelChoice(kernel, "int4", 32)
    return load_safetensors_quantized(checkpoint, config, choice, CpuPaths.from_environment({}), cache_dir)


def _step(model, cache, chunks):
    with torch.inference_mode():
        batch = ForwardBatch.build(chunks, block_size=cache.block_size, device="cpu")
        return model(batch, cache)


def _fused_and_layered(model, layered, caches, chunks):
    """The step's logits through the fused call on ``caches[0]``, and through
    the model's layers (its projections set to ``layered``) on ``caches[1]``."""
    made = model._quantized
    fused = _step(model, caches[0], chunks)
    model._quantized = layered
    try:
        return fused, _step(model, caches[1], chunks)
    finally:
        model._quantized = made


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_the_fused_decode_step_computes_what_the_layers_do(isas, checkpoint, tmp_path, cache_dtype):
    """Three sequences of different lengths over scattered blocks, prefilled
    alike, then three decode steps: once all layers in one native call,
    once through the model's layers. Logits and the cache agree; greedy
    picks are the same."""
    for isa in isas:
        model = _native_model(checkpoint, tmp_path, isa)
        made = model._projections()
        assert made.decode is not None and made.decode.isa == native.ISAS[isa]
        # The layers' path with the head the fused step runs (on rounded
        # activations where the variant has one, native_decode.decode_head).
        layered = attrs.evolve(made, decode=None, head=made.decode_head or made.head)
        rng = random.Random(0)
        blocks = list(range(1, 40))
        rng.shuffle(blocks)
        lengths = (5, 17, 9)
        tables = [blocks[i * 8 : i * 8 + 8] for i in range(3)]
        prompts = [[rng.randrange(3, 64) for _ in range(n)] for n in lengths]
        caches = [KVCache.allocate(model.config, num_blocks=40, block_size=4, dtype=cache_dtype, device="cpu") for _ in range(2)]
        for cache in caches:
            _step(model, cache, [SeqChunk(p, 0, t) for p, t in zip(prompts, tables)])
        tokens = [p[-1] for p in prompts]
        for step in range(3):
            chunks = [SeqChunk([tok], n + step, t) for tok, n, t in zip(tokens, lengths, tables)]
            assert made.decode.runs([1, 1, 1], caches[0].key.dtype)
            fused, ref = _fused_and_layered(model, layered, caches, chunks)
            # int8 activations (avx512vnni, avx2int8) round what the two paths'
            # last-bit differences feed them to different steps now and then.
            tol = 1e-4 if cache_dtype == torch.float32 and isa not in INT8_ROWS else 2e-2
            assert (fused - ref).abs().max() <= tol * ref.abs().max(), (isa, step)
            assert torch.equal(fused.argmax(-1), ref.argmax(-1)), (isa, step)
            for a, b in ((caches[0].key, caches[1].key), (caches[0].value, caches[1].value)):
                assert (a.float() - b.float()).abs().max() <= tol * b.float().abs().max(), (isa, step)
            tokens = ref.argmax(-1).tolist()
        # A speculative step's shape: runs of 3, 1 and 2 tokens, every one with logits.
        runs = [[5, 6, 7], [8], [9, 10]]
        chunks = [SeqChunk(run, n + 3, t, num_logits=len(run)) for run, n, t in zip(runs, lengths, tables)]
        assert made.decode.runs([3, 1, 2], caches[0].key.dtype)
        fused, ref = _fused_and_layered(model, layered, caches, chunks)
        assert fused.shape == ref.shape == (6, model.config.vocab_size)
        assert (fused - ref).abs().max() <= tol * ref.abs().max(), isa
        assert torch.equal(fused.argmax(-1), ref.argmax(-1)), isa


def test_a_verified_run_computes_bit_for_bit_what_one_token_steps_do(isas, checkpoint, tmp_path):
    """Speculative decoding's greedy output equals plain decoding's only if a
    token's logits do not depend on how many rows the step computes: a run of
    six tokens in one fused call and six one-token calls give identical
    logits and cache contents."""
    for isa in isas:
        model = _native_model(checkpoint, tmp_path, isa)
        assert model._projections().decode is not None
        table = [7, 3, 11, 5, 9]
        prompt = [11, 12, 13, 14, 15, 16]
        run = [21, 22, 23, 24, 25, 26]  # 6 rows: one pass of the 8-row kernels
        caches = [KVCache.allocate(model.config, num_blocks=12, block_size=4, dtype=torch.float16, device="cpu") for _ in range(2)]
        for cache in caches:
            _step(model, cache, [SeqChunk(prompt, 0, table)])
        together = _step(model, caches[0], [SeqChunk(run, len(prompt), table, num_logits=len(run))])
        one_by_one = torch.cat([_step(model, caches[1], [SeqChunk([t], len(prompt) + i, table)]) for i, t in enumerate(run)])
        assert torch.equal(together, one_by_one), isa
        assert torch.equal(caches[0].key, caches[1].key) and torch.equal(caches[0].value, caches[1].value), isa


def test_a_decode_steps_logits_do_not_depend_on_the_sequences_beside_them(isas, checkpoint, tmp_path):
    """On the int8 kernels (avx512vnni, avx2int8) a sequence's logits and
    cache in a decode step are the same bits alone, in a batch of 5 (the
    row kernels) and in one of 12 (the panels), LM head included (in int8
    groups of 32, as a GGUF file's and, since rtn_cache's format 3, a float
    checkpoint's): how busy the server is never changes a greedy token."""
    variants = [isa for isa in INT8_ROWS if isa in isas]
    if not variants:
        pytest.skip("this CPU runs neither avx512vnni nor avx2int8")
    for isa in variants:
        model = _native_model(checkpoint, tmp_path, isa)
        made = model._projections()
        assert isinstance(made.head, int8_native.Int8GroupNativeLinear) and made.decode_head is not None
        rng = random.Random(1)
        lengths = [rng.randrange(3, 12) for _ in range(12)]
        prompts = [[rng.randrange(3, 64) for _ in range(n)] for n in lengths]
        tables = [list(range(1 + 4 * i, 5 + 4 * i)) for i in range(12)]
        caches = [KVCache.allocate(model.config, num_blocks=49, block_size=4, dtype=torch.float16, device="cpu") for _ in range(3)]
        for cache in caches:
            _step(model, cache, [SeqChunk(p, 0, t) for p, t in zip(prompts, tables)])
        tokens = [p[-1] for p in prompts]
        for step in range(2):
            chunks = [SeqChunk([tok], n + step, t) for tok, n, t in zip(tokens, lengths, tables)]
            assert model._projections().decode.runs([1] * 12, torch.float16)
            together = _step(model, caches[0], chunks)
            alone = torch.cat([_step(model, caches[1], [chunk]) for chunk in chunks])
            in_fives = torch.cat([_step(model, caches[2], chunks[i : i + 5]) for i in range(0, 12, 5)])
            for other in caches[1:]:
                assert torch.equal(caches[0].key, other.key) and torch.equal(caches[0].value, other.value), (isa, step)
            assert torch.equal(together, alone), (isa, step)
            assert torch.equal(together, in_fives), (isa, step)
            tokens = together.argmax(-1).tolist()


def test_batches_the_fused_step_does_not_take_go_through_the_layers(isas, checkpoint, tmp_path):
    model = _native_model(checkpoint, tmp_path, isas[-1])
    decode = model._projections().decode
    assert decode is not None
    assert decode.runs([1, 2], torch.float32)  # a speculative step's verification
    assert not decode.runs([1, 17], torch.float32)  # a prefill chunk, outside batch-invariant mode
    assert decode.runs([1, 17, 300], torch.float32, prompts=True)  # batch-invariant: every token
    assert decode.runs([1, 1, 1], torch.float16)
    assert not decode.runs([1], torch.uint8)  # an fp8 pool
    assert not decode.runs([5], torch.uint8, prompts=True)


def test_without_the_library_the_chooser_takes_atens_kernels_and_says_why(isas, checkpoint, monkeypatch, tmp_path):
    """What a machine where the build failed gets (simulated by the switch,
    which the probes see the same way): the native paths off with the
    reason, ATen's 4-bit kernel chosen, and the layers run in torch."""
    monkeypatch.setenv(native.SWITCH_ENV, "0")
    paths = CpuPaths.from_environment()
    for kernel in choose.KERNELS:
        if kernel.family:
            assert not paths.available(kernel.name)
            assert "turned off by TRIOSERVE_NATIVE_KERNELS=0" in paths.status(kernel.name).reason
    picked = choose.choose_kernel(paths, "int4", [(48, 64), (64, 32)])
    assert picked.kernel.name == "quant_int4_pack_bfloat16"
    config = ModelConfig.from_hf_config(json.loads((checkpoint / "config.json").read_text()))
    model = load_safetensors_quantized(checkpoint, config, picked, paths, tmp_path / "cache")
    assert model._projections().decode is None


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_native_decode_attention_computes_what_the_torch_attention_does(isas, checkpoint, cache_dtype):
    """The float model's prompts (chunks of 6 and 13 tokens, one of 1),
    decode steps and a mixed batch with each native attention variant
    against the same steps attended in torch: logits and cache agree."""
    from trioserve.engine.loading.loader import load_model
    from trioserve.engine.kernels.native_attention import NativeAttention

    model = load_model(str(checkpoint), quantization="none").model
    assert model.native_attention is not None
    rng = random.Random(1)
    blocks = list(range(1, 40))
    rng.shuffle(blocks)
    lengths = (6, 13, 1)
    tables = [blocks[i * 8 : i * 8 + 8] for i in range(3)]
    prompts = [[rng.randrange(3, 64) for _ in range(n)] for n in lengths]
    for isa in isas:
        attention = NativeAttention(native.ISAS[isa], native.ops().decode_attention)
        caches = [KVCache.allocate(model.config, num_blocks=40, block_size=4, dtype=cache_dtype, device="cpu") for _ in range(2)]
        tol = 1e-5 if cache_dtype == torch.float32 else 1e-2
        prefill = [SeqChunk(p, 0, t, num_logits=len(p)) for p, t in zip(prompts, tables)]
        model.native_attention = attention
        got = _step(model, caches[0], prefill)
        model.native_attention = None
        want = _step(model, caches[1], prefill)
        assert (got - want).abs().max() <= tol * want.abs().max(), (isa, "prefill")
        tokens = [p[-1] for p in prompts]
        for step in range(2):
            chunks = [SeqChunk([tok], n + step, t) for tok, n, t in zip(tokens, lengths, tables)]
            model.native_attention = attention
            got = _step(model, caches[0], chunks)
            model.native_attention = None
            want = _step(model, caches[1], chunks)
            assert (got - want).abs().max() <= tol * want.abs().max(), (isa, step)
            for a, b in ((caches[0].key, caches[1].key), (caches[0].value, caches[1].value)):
                assert (a.float() - b.float()).abs().max() <= tol * b.float().abs().max(), (isa, step)
            tokens = want.argmax(-1).tolist()
        # A mixed batch: runs of 3 and 2 tokens over their cached context, and a decode row.
        runs = [[5, 6, 7], [8], [9, 10]]
        chunks = [SeqChunk(run, n + 2, t, num_logits=len(run)) for run, n, t in zip(runs, lengths, tables)]
        model.native_attention = attention
        got = _step(model, caches[0], chunks)
        model.native_attention = None
        want = _step(model, caches[1], chunks)
        assert (got - want).abs().max() <= tol * want.abs().max(), isa
    model.native_attention = NativeAttention(native.ISAS[isas[-1]], native.ops().decode_attention)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_native_decode_attention_of_64_wide_heads_matches_paged_attention(isas, cache_dtype):
    """64-wide heads take their own paths on AVX-512 (up to four query heads
    of a KV head at a time, 16 tokens' dot products summed together) and on
    AVX2 (up to three, the values' products in registers half a head a
    pass): groups of 1, 3, 5 (passes of four and one, or three and two) and
    8 heads, contexts on both sides of 16 tokens and of a block, against
    torch's paged attention."""
    from trioserve.engine.layers.attention import AttentionMetadata, paged_attention, write_kv
    from trioserve.engine.kernels.native_attention import NativeAttention
    from trioserve.engine.layers.rotary import apply_rotary

    gen = torch.Generator().manual_seed(7)
    head_dim, block_size, num_blocks = 64, 4, 24
    contexts = (1, 15, 16, 17, 33, 47)
    blocks = torch.randperm(num_blocks, generator=gen).tolist()
    chunks, used = [], 0
    for n in contexts:
        need = (n + block_size - 1) // block_size
        chunks.append(SeqChunk([5], n - 1, tuple(blocks[used : used + need])))
        used = (used + need) % (num_blocks - 12)
    batch = ForwardBatch.build(chunks, block_size=block_size, device="cpu")
    rows = len(contexts)
    angles = torch.randn(rows, 1, head_dim // 2, generator=gen)
    cos, sin = torch.cat([angles.cos(), angles.cos()], -1), torch.cat([-angles.sin(), angles.sin()], -1)
    for kv_heads, group in ((2, 1), (1, 3), (2, 5), (1, 8)):
        heads = kv_heads * group
        pools = KVCache(
            *(torch.randn(1, num_blocks, block_size, kv_heads, head_dim, generator=gen).to(cache_dtype) for _ in range(2))
        )
        keys, values = pools.key[0], pools.value[0]
        qkv = torch.randn(rows, (heads + 2 * kv_heads) * head_dim, generator=gen)
        qk = apply_rotary(qkv[:, : (heads + kv_heads) * head_dim].view(rows, heads + kv_heads, head_dim), cos, sin)
        v = qkv[:, (heads + kv_heads) * head_dim :].view(rows, kv_heads, head_dim)
        want_keys, want_values = keys.clone(), values.clone()
        write_kv(qk[:, heads:], v, want_keys, want_values, batch.slot_mapping)
        meta = AttentionMetadata.build(batch, KVCache(want_keys[None], want_values[None]))
        want = paged_attention(qk[:, :heads], qk[:, heads:], v, want_keys, want_values, meta, scale=head_dim**-0.5)
        want = want.reshape(rows, -1).float()
        for isa in isas:
            got_keys, got_values = keys.clone(), values.clone()
            bound = NativeAttention(native.ISAS[isa], native.ops().decode_attention).bind(batch, cos, sin)
            assert bound is not None
            got = bound(qkv, got_keys, got_values, heads, head_dim**-0.5).reshape(rows, -1)
            tol = 1e-5 if cache_dtype == torch.float32 else 1e-2
            assert (got - want).abs().max() <= tol * want.abs().max(), (isa, group, cache_dtype)
            for a, b in ((got_keys, want_keys), (got_values, want_values)):
                assert (a.float() - b.float()).abs().max() <= tol * b.float().abs().max(), (isa, group)


@pytest.mark.parametrize("head_dim", [64, 24])
def test_native_decode_attention_stores_float16_as_torch_does_and_saturates(isas, head_dim):
    """The new key and value go into a float16 pool as engine/layers/kv_cache.py's
    to_cache puts them (rounded to nearest even, saturating at +-65504), on
    the vector paths and, for 24-wide heads, AVX-512's scalar tail (one KV
    head: 24 = 16 + 8 values); a row alone in its context reads back its
    own value."""
    from trioserve.engine.layers.kv_cache import to_cache
    from trioserve.engine.kernels.native_attention import BoundAttention, NativeAttention

    gen = torch.Generator().manual_seed(3)
    heads, kv_heads, rows = 2, 1, 3
    kv_width = kv_heads * head_dim
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * head_dim, generator=gen)
    qkv[0, heads * head_dim :] *= 1e6  # row 0's key and value far past float16's range
    cos, sin = torch.ones(rows, head_dim), torch.zeros(rows, head_dim)  # rotation by 0: keys as given
    slots = torch.tensor([5, 9, 2])
    tables = torch.tensor([[1], [2], [0]])
    lens = torch.tensor([2, 2, 3])
    for isa in isas:
        attention = NativeAttention(native.ISAS[isa], native.ops().decode_attention)
        bound = BoundAttention(attention, cos, sin, slots, tables, lens)
        keys, values = (torch.zeros(3, 4, kv_heads, head_dim, dtype=torch.float16) for _ in range(2))
        bound(qkv, keys, values, heads, head_dim**-0.5)
        flat_k, flat_v = keys.view(-1, kv_width), values.view(-1, kv_width)
        for r, slot in enumerate(slots.tolist()):
            new_k = qkv[r, heads * head_dim : heads * head_dim + kv_width]
            new_v = qkv[r, heads * head_dim + kv_width :]
            assert torch.equal(flat_k[slot], to_cache(new_k, torch.float16)), (isa, r)
            assert torch.equal(flat_v[slot], to_cache(new_v, torch.float16)), (isa, r)
        assert flat_k[5].abs().max() == 65504 and flat_v[5].isfinite().all(), isa
    # One token of context: attention returns the row's own stored value.
    one = BoundAttention(
        NativeAttention(native.ISAS[isas[-1]], native.ops().decode_attention),
        cos[:1], sin[:1], torch.tensor([0]), torch.tensor([[0]]), torch.tensor([1]),
    )
    keys, values = (torch.zeros(1, 4, kv_heads, head_dim, dtype=torch.float16) for _ in range(2))
    out = one(qkv[:1], keys, values, heads, head_dim**-0.5).view(heads, head_dim)
    stored = values[0, 0].float()
    assert torch.equal(out, stored.repeat_interleave(heads // kv_heads, 0))


def test_native_decode_attention_refuses_a_block_outside_the_pool(isas):
    from trioserve.engine.kernels.native_attention import BoundAttention, NativeAttention

    attention = NativeAttention(native.ISAS["scalar"], native.ops().decode_attention)
    pool = torch.zeros(4, 4, 2, 16)
    bound = BoundAttention(
        attention, torch.ones(1, 16), torch.zeros(1, 16), torch.tensor([1]), torch.tensor([[9]]), torch.tensor([2])
    )
    with pytest.raises(RuntimeError, match="row 0 block 9 out of the cache"):
        bound(torch.randn(1, 8 * 16), pool, pool.clone(), 4, 0.25)


def test_a_q8_0_head_runs_on_the_stored_values_without_a_copy(isas):
    """int8 in groups of 32 (GGUF's Q8_0): the tensors are the table's own,
    and the result is the dequantized table's matmul, at few rows and many."""
    from trioserve.engine.kernels.rtn import Int8GroupWeight

    gen = torch.Generator().manual_seed(2)
    q = torch.randint(-127, 128, (40, 96), generator=gen, dtype=torch.int8)
    table = Int8GroupWeight(q, torch.rand(40, 3, generator=gen) * 0.01, 32)
    for isa in isas:
        head = int8_native.Int8GroupNativeLinear.over(table, isa)
        assert head.weight.q.data_ptr() == q.data_ptr()
        for rows in (1, 7, 12, int4_native.DEQUANTIZE_FROM_ROWS + 1):
            x = torch.randn(rows, 96, generator=gen)
            assert_matches(head(x), x, table.dequantize(), None, isa)
    with pytest.raises(ValueError, match="groups of 32"):
        int8_native.Int8GroupNativeLinear.over(Int8GroupWeight(q, torch.rand(40, 6), 16), isas[0])


@pytest.mark.parametrize("variant", INT8_ROWS)
def test_the_q8_0_rows_below_the_panels_round_as_documented_and_each_row_alone(isas, variant):
    """The Q8_0 kernels at one to nine rows (a decode step's LM head below
    10 rows), over 37 channels (a remainder in each thread's share), values
    in GGUF's -127..127, a group of zeros. Each rounds the activations as
    its panels do: avx512vnni to int8 (csrc/rows_vnni.h, 16 channels a pass
    up to 8 rows, its panels from 9), avx2int8 to int16 (csrc/rows_avx2.h,
    four channels a pass at one and two rows, two at three and four, one
    from five, 8 rows a pass). The rounded rows' matmul, and every row
    exactly what it gives alone."""
    from trioserve.engine.kernels.rtn import Int8GroupWeight

    if variant not in isas:
        pytest.skip(f"this CPU cannot run {variant} ({native.ISA_REQUIREMENTS[variant]})")
    gen = torch.Generator().manual_seed(5)
    isa = native.ISAS[variant]
    for k in (32, 96, 576):
        q = torch.randint(-127, 128, (37, k), generator=gen, dtype=torch.int8)
        scale = torch.rand(37, k // 32, generator=gen) * 0.01
        table = Int8GroupWeight(q, scale, 32)
        for rows in range(1, PANEL_FROM_ROWS):
            x = torch.randn(rows, k, generator=gen)
            if k > 32:
                x[0, :32] = 0.0
            got = native.ops().q8g_linear(x, q, scale, isa)
            want = F.linear(rounded_rows(x, 32767 if variant == "avx2int8" else 127), table.dequantize())
            assert (got - want).abs().max() <= 1e-5 * want.abs().max(), (k, rows)
            alone = torch.cat([native.ops().q8g_linear(x[r : r + 1], q, scale, isa) for r in range(rows)])
            assert torch.equal(got, alone), (k, rows)


def test_a_decode_steps_lm_head_runs_rounded_activations_and_a_prompts_the_wider_ones(isas):
    """On avx512vnni the fused decode step's LM head (native_decode.decode_head)
    runs int8 activations at any batch size (its row kernels up to 8 rows,
    its panels from 9), on avx2int8 int16 ones (its row kernels below 10
    rows, its panels from 10); the head a prompt's logits use keeps float32
    activations below 10 rows and runs the bfloat16 panels from 10 (on
    avx2int8 float32 activations at any count). Elsewhere there is no
    second head."""
    from trioserve.engine.kernels.native_decode import decode_head
    from trioserve.engine.kernels.rtn import Int8GroupWeight

    gen = torch.Generator().manual_seed(4)
    table = Int8GroupWeight(torch.randint(-127, 128, (40, 96), generator=gen, dtype=torch.int8),
                            torch.rand(40, 3, generator=gen) * 0.01, 32)
    x = torch.randn(12, 96, generator=gen)
    for isa in isas:
        head = int8_native.Int8GroupNativeLinear.over(table, isa)
        decoding = decode_head(head)
        if isa not in INT8_ROWS:
            assert decoding is None
            continue
        assert decoding.weight is head.weight
        assert torch.equal(decoding(x), native.ops().q8g_linear(x, table.q, table.scale, native.ISAS[isa]))
        wider = "avx512bf16" if isa == "avx512vnni" else "avx2"
        assert torch.equal(head(x), native.ops().q8g_linear(x, table.q, table.scale, native.ISAS[wider]))
        assert not torch.equal(decoding(x), head(x))
        # Below 10 rows too, a prompt's head keeps float32 activations (the
        # float matmul) and a decode step's rounds them (the rounded rows').
        few = x[:3]
        levels = 32767 if isa == "avx2int8" else 127
        floats, rounded = F.linear(few, table.dequantize()), F.linear(rounded_rows(few, levels), table.dequantize())
        assert torch.equal(head(few), native.ops().q8g_linear(few, table.q, table.scale, native.ISAS[wider]))
        assert (head(few) - floats).abs().max() <= 1e-5 * floats.abs().max()
        assert (decoding(few) - rounded).abs().max() <= 1e-5 * rounded.abs().max()
        assert not torch.equal(decoding(few), head(few))
        assert torch.equal(decoding(few), torch.cat([decoding(x[r : r + 1]) for r in range(3)]))
        # A row's logits are the same bits in a step of any size.
        assert torch.equal(decoding(few), decoding(x)[:3])
        if isa == "avx2int8":
            # From 10 rows the int16 panels (the test below).
            want = F.linear(rounded_rows(x, 32767), table.dequantize())
            assert (decoding(x) - want).abs().max() <= 1e-5 * want.abs().max()


def test_a_decode_steps_q8_0_head_runs_int16_panels_from_10_rows(isas):
    """avx2int8's Q8_0 kernel from 10 rows (csrc/panel_avx2_int16.h, as a
    decode step's LM head calls it): weights from -128 to 127, a short last
    panel (37 channels: 16 + 16 + 5) and tile, a group of zeros, and at 1,536
    inputs more rows than one row block holds (168). The matmul of the rows
    rounded to int16 in groups of 32, up to float32 rounding, and not
    float32's result; a row's result does not depend on how many rows it
    runs with, below 10 rows either (csrc/rows_avx2.h: the panels' bits)."""
    if "avx2int8" not in isas:
        pytest.skip(f"this CPU cannot run avx2int8 ({native.ISA_REQUIREMENTS['avx2int8']})")
    from trioserve.engine.kernels.rtn import Int8GroupWeight

    gen = torch.Generator().manual_seed(8)
    index, ops = native.ISAS["avx2int8"], native.ops()
    for k, rows in ((32, 20), (96, 40), (1536, 180)):
        table = Int8GroupWeight(torch.randint(-128, 128, (37, k), generator=gen, dtype=torch.int8),
                                torch.rand(37, k // 32, generator=gen) * 0.01, 32)
        table.q[0, :32] = -128
        x = torch.randn(rows, k, generator=gen)
        x[3, :32] = 0.0
        full = ops.q8g_linear(x, table.q, table.scale, index)
        want = F.linear(rounded_rows(x, 32767), table.dequantize())
        assert (full - want).abs().max() <= 1e-5 * want.abs().max(), k
        assert not torch.equal(full, F.linear(x, table.dequantize())), k
        for part in (1, 2, 3, 4, 5, 7, 8, 9, PANEL_FROM_ROWS, 13):
            assert torch.equal(ops.q8g_linear(x[:part], table.q, table.scale, index), full[:part]), (k, part)



def test_4_bit_blocks_dequantize_to_bfloat16_as_the_float32_matrix_rounds(isas):
    """q4_dequantize_bf16 (a prompt's matrix for the bfloat16 GEMM) is the
    float32 matrix rounded to nearest even, bit for bit; it needs
    AVX512_BF16 and says so elsewhere."""
    blocks = int4_native.pack_blocks(quantize_int4(torch.randn(37, 96, generator=torch.Generator().manual_seed(6)), 32))
    if "avx512bf16" not in isas:
        with pytest.raises(RuntimeError):
            native.ops().q4_dequantize_bf16(blocks)
        return
    got = native.ops().q4_dequantize_bf16(blocks)
    assert got.dtype == torch.bfloat16 and torch.equal(got, native.ops().q4_dequantize(blocks).bfloat16())


def test_int8_groups_dequantize_to_bfloat16_and_run_the_gemm_from_the_rows_asked(isas):
    """q8g_dequantize_bf16 is the int8 groups' float32 matrix rounded to
    nearest even, bit for bit (it needs AVX512_BF16); a wider projection's
    linear (``Int8GroupNativeLinear`` with a bias) runs ``gemm_from_rows``
    rows and more as torch's bfloat16 GEMM over it, fewer on its kernel."""
    gen = torch.Generator().manual_seed(8)
    weight = quantize_int8_groups(torch.randn(40, 96, generator=gen), 32)
    if "avx512bf16" not in isas:
        with pytest.raises(RuntimeError):
            native.ops().q8g_dequantize_bf16(weight.q, weight.scale)
        return
    got = native.ops().q8g_dequantize_bf16(weight.q, weight.scale)
    assert got.dtype == torch.bfloat16 and torch.equal(got, weight.dequantize().bfloat16())
    bias = torch.randn(40, generator=gen)
    isa = next(i for i in ("avx512vnni", "avx512bf16") if i in isas)
    plain = int8_native.Int8GroupNativeLinear.over(weight, isa, bias)
    linear = attrs.evolve(plain, gemm_from_rows=16)
    for rows in (3, 15, 16, 40):
        x = torch.randn(rows, 96, generator=gen)
        if rows < 16:
            assert torch.equal(linear(x), plain(x)), rows
            # From the layers, float32 activations below 10 rows (avx512bf16's rows, on either variant).
            kernel = native.ops().q8g_linear(x, weight.q, weight.scale, native.ISAS["avx512bf16"])
            assert torch.equal(plain(x), kernel + bias), rows
        else:
            padded = F.pad(x, (0, 0, 0, int4_native.gemm_rows(rows) - rows))
            want = F.linear(padded.bfloat16(), weight.dequantize().bfloat16()).float()[:rows] + bias
            assert torch.equal(linear(x), want), rows


@pytest.mark.cpu_paths
def test_a_prompts_4_bit_rows_run_the_bfloat16_gemm_from_the_set_rows(cpu_paths, isas):
    """Where the bfloat16 GEMM path works (AMX tiles; off below the amx
    level of TRIOSERVE_CPU_ASSUME), a linear with ``gemm_from_rows`` runs
    that many rows and more as torch's bfloat16 GEMM over the matrix
    dequantized for the call, and fewer on its own kernel; where it does
    not, the reason says why and the chooser never turns it on."""
    status = cpu_paths.status(int4_native.BF16_GEMM_PATH)
    if not status.available:
        assert "AMX" in status.reason or "TRIOSERVE_CPU_ASSUME" in status.reason, status.reason
        choice = choose.choose_kernel(cpu_paths, "int4", [(48, 64), (64, 32)], batch_invariant=False)
        assert choice.gemm_from_rows is None and getattr(choice.make(torch.randn(48, 64), None), "gemm_from_rows", None) is None
        return
    gen = torch.Generator().manual_seed(7)
    weight, bias = quantize_int4(torch.randn(40, 96, generator=gen), 32), torch.randn(40, generator=gen)
    isa = next(i for i in ("avx512vnni", "avx512bf16") if i in isas)
    plain = int4_native.Int4NativeLinear.from_rtn(weight, bias, isa)
    linear = attrs.evolve(plain, gemm_from_rows=16)
    dense = weight.dequantize()
    for rows in (1, 12, 15, 16, 40):
        x = torch.randn(rows, 96, generator=gen)
        if rows < 16:
            assert torch.equal(linear(x), plain(x)), rows
        else:
            # Padded with zero rows to a power of two (int4_native.gemm_rows).
            padded = F.pad(x, (0, 0, 0, int4_native.gemm_rows(rows) - rows))
            want = F.linear(padded.bfloat16(), dense.bfloat16()).float()[:rows] + bias
            assert torch.equal(linear(x), want), rows
            assert_matches(linear(x), x, dense, bias, "avx512bf16", bits=4)
    # The fused decode step's head, on int8 panels at any row count, never takes it.
    head = attrs.evolve(linear, int8_panels=True)
    x = torch.randn(20, 96, generator=gen)
    assert torch.equal(head(x), attrs.evolve(plain, int8_panels=True)(x))


@pytest.mark.cpu_paths
def test_the_bfloat16_gemm_meets_onednn_at_few_row_counts(cpu_paths, isas, monkeypatch):
    """oneDNN keeps a kernel for every row count it multiplies (MiBs each),
    so however many rows a prompt has, the GEMM runs at a power of two of
    them, past 4,096 in slices: a server's memory stays bounded."""
    if not cpu_paths.available(int4_native.BF16_GEMM_PATH):
        pytest.skip(cpu_paths.status(int4_native.BF16_GEMM_PATH).reason)
    gen = torch.Generator().manual_seed(8)
    weight = quantize_int4(torch.randn(24, 64, generator=gen), 32)
    linear = attrs.evolve(int4_native.Int4NativeLinear.from_rtn(weight, None, "avx512bf16"), gemm_from_rows=16)
    seen, linear_op = [], F.linear

    def recording(x, w, *args):
        seen.append(x.shape[0])
        return linear_op(x, w, *args)

    monkeypatch.setattr(int4_native.F, "linear", recording)
    counts = (16, 17, 40, 100, 513, 1000, 1500, 2048, 2100, 4097)
    calls = [(x, linear(x)) for x in (torch.randn(rows, 64, generator=gen) for rows in counts)]
    monkeypatch.undo()
    assert seen == [16, 32, 64, 128, 1024, 1024, 2048, 2048, 4096, 4096, 1], seen
    for x, got in calls:
        assert got.shape == (x.shape[0], 24)
        assert_matches(got, x, weight.dequantize(), None, "avx512bf16", bits=4)
