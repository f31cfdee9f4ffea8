"""GGUF's K-quants and 5-bit types (engine/loading/gguf_weights.py): each decodes
like gguf's own reference, and a file that mixes them, as llama.cpp's
Q4_K_M does, loads compressed with its wider matrices kept wide."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch

from trioserve.engine.config import ModelConfig, RopeScaling
from trioserve.engine.errors import ModelLoadError
from trioserve.engine.layers.forward_batch import ForwardBatch, SeqChunk
from trioserve.engine.layers.kv_cache import KVCache
from trioserve.engine.models.llama import LlamaForCausalLM
from trioserve.engine.loading import gguf_weights
from trioserve.engine.kernels import native, q6k_lanes
from trioserve.engine.kernels.choose import KERNELS, KernelChoice, candidates
from trioserve.engine.kernels.int4_native import Int4NativeLinear
from trioserve.engine.kernels.int8_native import Int8GroupNativeLinear
from trioserve.engine.loading.compressed import load_gguf_quantized, quantization_choice
from trioserve.engine.kernels.q6k_lanes import Q6KLanes
from trioserve.engine.kernels.q8_lanes import Q8Lanes
from trioserve.engine.kernels.rtn import Int4Weight, Int8GroupWeight, quantize_int8_groups, regroup_int8
from trioserve.testing.quality import prompt_logits

from test_quant import _write_gguf

# Where each type keeps its float16 scales, and values that keep a tiny
# model's weights near 0.1 at most (the other bytes are random).
_SCALES = {"Q4_K": ((0, 2), 1e-4), "Q5_K": ((0, 2), 5e-5), "Q6_K": ((208,), 2e-5), "Q5_0": ((0,), 5e-3)}


def _random_blocks(kind: str, out: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """``[out, k]`` weights of ``kind`` as raw blocks: random bytes, with
    float16 scales drawn small and positive."""
    import gguf

    values, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind]]
    data = rng.integers(0, 256, size=(out, k // values, size), dtype=np.uint8)
    at, high = _SCALES[kind]
    for offset in at:
        scales = rng.uniform(high / 4, high, size=(out, k // values)).astype(np.float16)
        data[..., offset : offset + 2] = scales.view(np.uint8).reshape(out, k // values, 2)
    return data.reshape(out, -1)


def _reference(kind: str, data: np.ndarray) -> torch.Tensor:
    import gguf

    return torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(data, gguf.GGMLQuantizationType[kind])))


@pytest.mark.parametrize("kind", ["Q5_0", "Q6_K"])
def test_q5_0_and_q6_k_decode_to_int8_groups_exactly(kind):
    data = _random_blocks(kind, 6, 512, np.random.default_rng(0))
    got = gguf_weights.decode_q5_0(data) if kind == "Q5_0" else gguf_weights.decode_q6_k(data)
    assert isinstance(got, Int8GroupWeight) and got.q.dtype == torch.int8
    assert got.group_size == (32 if kind == "Q5_0" else 16)
    assert torch.equal(got.dequantize(), _reference(kind, data))


def test_q4_k_decodes_to_4_bit_groups_of_32_as_the_reference_computes():
    data = _random_blocks("Q4_K", 6, 512, np.random.default_rng(1))
    got = gguf_weights.decode_q4_k(data)
    assert isinstance(got, Int4Weight) and got.group_size == 32 and int(got.q.max()) <= 15
    reference = _reference("Q4_K", data)
    # (q - 8) d + (8 d - min) against q d - min: float32's last bit apart.
    assert (got.dequantize() - reference).abs().max() <= 1e-6 * reference.abs().max()


@pytest.mark.parametrize("kind", ["Q4_K", "Q5_K", "Q6_K"])
def test_a_table_decodes_a_slice_of_rows_at_a_time_as_whole(kind):
    decode = {"Q4_K": gguf_weights.decode_q4_k, "Q6_K": gguf_weights.decode_q6_k}.get(
        kind, lambda rows: gguf_weights.requantize_int8(kind, rows)
    )
    data = _random_blocks(kind, 10, 512, np.random.default_rng(6))
    whole, sliced = decode(data), gguf_weights.by_rows(decode, data, rows_at_once=3)  # a remainder of one row
    assert type(sliced) is type(whole) and sliced.group_size == whole.group_size
    for name in ("q", "scale", "zero"):
        if hasattr(whole, name):
            assert torch.equal(getattr(sliced, name), getattr(whole, name)), name


def test_q6_k_groups_of_16_regroup_into_32_a_slice_of_rows_at_a_time_as_whole():
    table = gguf_weights.decode_q6_k(_random_blocks("Q6_K", 10, 512, np.random.default_rng(5)))
    whole = quantize_int8_groups(table.dequantize(), 32)
    sliced = regroup_int8(table, 32, rows_at_once=3)  # a remainder of one row
    assert torch.equal(sliced.q, whole.q) and torch.equal(sliced.scale, whole.scale) and sliced.group_size == 32


@pytest.mark.parametrize("kind", ["Q5_1", "Q5_K"])
def test_q5_1_and_q5_k_are_rounded_to_int8_groups_within_half_a_step(kind):
    import gguf

    rng = np.random.default_rng(2)
    if kind == "Q5_1":
        data = gguf.quants.quantize(rng.standard_normal((6, 512)).astype(np.float32), gguf.GGMLQuantizationType.Q5_1)
    else:
        data = _random_blocks(kind, 6, 512, rng)
    got = gguf_weights.requantize_int8(kind, data)
    reference = _reference(kind, data)
    assert got.group_size == 32
    step = got.scale.repeat_interleave(32, dim=1)
    # A value half way between two steps may round either way in float32.
    assert ((got.dequantize() - reference).abs() <= step / 2 + 1e-6 * reference.abs().max()).all()
    # Each group's largest magnitude is kept to float32's rounding.
    largest = reference.abs().view(6, -1, 32).amax(-1)
    assert torch.allclose(got.scale * 127, largest, rtol=1e-6)


def _write(path: Path, tensors: dict[str, tuple[str, np.ndarray]]) -> None:
    """A GGUF of ``{name: (kind, data)}``: float32 arrays as they are, else raw blocks of ``kind``."""
    import gguf

    _write_gguf(path, {n: (d, None if k == "F32" else gguf.GGMLQuantizationType[k]) for n, (k, d) in tensors.items()})


def test_a_type_with_no_mapping_is_refused_naming_the_tensor(tmp_path):
    path = tmp_path / "q3.gguf"
    import gguf

    values, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.Q3_K]
    _write(path, {"blk.0.ffn_down.weight": ("Q3_K", np.zeros((4, 256 // values * size), np.uint8))})
    with pytest.raises(
        ModelLoadError, match=r"tensor 'blk\.0\.ffn_down\.weight' has GGUF type Q3_K.*Q4_K.*Q6_K.*--quantization none"
    ):
        list(gguf_weights.read_tensors(path, num_heads=4, num_kv_heads=2))


def test_scales_that_the_kernels_cannot_hold_are_refused_naming_the_tensor(tmp_path):
    import gguf

    rng = np.random.default_rng(3)
    # Q4_K: a float16 d of 2,000 times a 6-bit scale of 63 is a step of
    # 126,000, past float16's largest (the native blocks' scales).
    wide = _random_blocks("Q4_K", 4, 256, rng).reshape(4, 1, 144)
    wide[..., 0:2] = np.full((4, 1), 2000.0, np.float16).view(np.uint8).reshape(4, 1, 2)
    wide[..., 4:16] = 0xFF  # every 6-bit scale and min 63
    path = tmp_path / "wide.gguf"
    _write(path, {"blk.0.ffn_up.weight": ("Q4_K", wide.reshape(4, -1))})
    refused = r"tensor 'blk\.0\.ffn_up\.weight' \(Q4_K\) has a group scale of 1\.26e\+05.*float16.*--quantization none"
    with pytest.raises(ModelLoadError, match=refused):
        list(gguf_weights.read_tensors(path, num_heads=4, num_kv_heads=2))
    # Q8_0 with a NaN scale in one block: a damaged file.
    values, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.Q8_0]
    damaged = rng.integers(-20, 20, size=(4, 64 // values, size)).astype(np.int8).view(np.uint8)
    damaged[..., 0:2] = np.full((4, 64 // values), 0.01, np.float16).view(np.uint8).reshape(4, -1, 2)
    damaged[2, 1, 0:2] = np.array([np.nan], np.float16).view(np.uint8)
    path = tmp_path / "nan.gguf"
    _write(path, {"token_embd.weight": ("Q8_0", damaged.reshape(4, -1))})
    with pytest.raises(ModelLoadError, match=r"tensor 'token_embd\.weight' \(Q8_0\) has scales that are not finite"):
        list(gguf_weights.read_tensors(path, num_heads=4, num_kv_heads=2))
    # A Q4_K tensor with ordinary scales loads.
    ordinary = _random_blocks("Q4_K", 4, 256, rng)
    _write(tmp_path / "ok.gguf", {"blk.0.ffn_up.weight": ("Q4_K", ordinary)})
    [(name, weight)] = gguf_weights.read_tensors(tmp_path / "ok.gguf", num_heads=4, num_kv_heads=2)
    assert name == "model.layers.0.mlp.up_proj.weight" and torch.isfinite(weight.scale).all()


# A model whose input dimensions are multiples of 256, as K-quants need.
_CONFIG = ModelConfig(
    architecture="LlamaForCausalLM",
    vocab_size=384,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    rope_scaling=RopeScaling(),
    tie_word_embeddings=True,
    attention_bias=False,
    bos_token_id=1,
    eos_token_ids=(2,),
)
# Layer 0 as llama.cpp's Q4_K_M stores a layer whose V and down matrices it
# keeps wider; layer 1 4-bit but for a Q5_0 output projection (Q4_K's
# fallback where a row is not a multiple of 256) and a Q5_K up projection.
_LAYERS = (
    {"attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q6_K", "attn_output": "Q4_K", "ffn_gate": "Q4_K", "ffn_up": "Q4_K", "ffn_down": "Q6_K"},
    {"attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q4_K", "attn_output": "Q5_0", "ffn_gate": "Q4_K", "ffn_up": "Q5_K", "ffn_down": "Q4_K"},
)


def _shape(name: str) -> tuple[int, int]:
    c = _CONFIG
    kv = c.num_key_value_heads * c.head_dim
    return {
        "attn_q": (c.hidden_size, c.hidden_size), "attn_k": (kv, c.hidden_size), "attn_v": (kv, c.hidden_size),
        "attn_output": (c.hidden_size, c.hidden_size), "ffn_gate": (c.intermediate_size, c.hidden_size),
        "ffn_up": (c.intermediate_size, c.hidden_size), "ffn_down": (c.hidden_size, c.intermediate_size),
    }[name]



def _random_tensors(layers, rng: np.random.Generator) -> dict[str, tuple[str, np.ndarray]]:
    """A file's tensors for ``_CONFIG``: a Q6_K embedding table, random norms,
    and each layer's projections in the kinds ``layers`` names, random bytes."""
    c = _CONFIG
    tensors = {
        "token_embd.weight": ("Q6_K", _random_blocks("Q6_K", c.vocab_size, c.hidden_size, rng)),
        "output_norm.weight": ("F32", (1 + 0.1 * rng.standard_normal(c.hidden_size)).astype(np.float32)),
    }
    for i, kinds in enumerate(layers):
        for part in ("attn_norm", "ffn_norm"):
            tensors[f"blk.{i}.{part}.weight"] = ("F32", (1 + 0.1 * rng.standard_normal(c.hidden_size)).astype(np.float32))
        for part, kind in kinds.items():
            tensors[f"blk.{i}.{part}.weight"] = (kind, _random_blocks(kind, *_shape(part), rng))
    return tensors

@pytest.fixture(scope="module")
def mixed_gguf(tmp_path_factory) -> tuple[Path, dict[str, torch.Tensor]]:
    """The mixed file, and its tensors dequantized by gguf's reference under
    Hugging Face names (q and k rows put back in their order)."""
    tensors = _random_tensors(_LAYERS, np.random.default_rng(3))
    path = tmp_path_factory.mktemp("kquants") / "mixed.gguf"
    _write(path, tensors)
    dense = {}
    for name, (kind, data) in tensors.items():
        value = torch.from_numpy(data) if kind == "F32" else _reference(kind, data)
        hf = gguf_weights.hf_name(name)
        if hf.endswith(("q_proj.weight", "k_proj.weight")):
            heads = _CONFIG.num_attention_heads if "q_proj" in hf else _CONFIG.num_key_value_heads
            value = gguf_weights._unpermute(value, heads)
        dense[hf] = value
    return path, dense


def _decode_step(model: LlamaForCausalLM, prompt: list[int], token: int) -> torch.Tensor:
    """The logits of one decode step after ``prompt``, over a fresh cache."""
    cache = KVCache.allocate(model.config, num_blocks=8, block_size=16, dtype=torch.float32, device="cpu")
    table = [1, 2, 3]
    with torch.inference_mode():
        for chunk in (SeqChunk(prompt, 0, table), SeqChunk([token], len(prompt), table)):
            logits = model(ForwardBatch.build([chunk], block_size=16, device="cpu"), cache)
    return logits


# The projections of _LAYERS with a matrix wider than 4 bits.
_WIDE = (
    "model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj", "model.layers.0.self_attn.v_proj",
    "model.layers.0.mlp.down_proj", "model.layers.1.self_attn.o_proj", "model.layers.1.mlp.gate_proj",
    "model.layers.1.mlp.up_proj",
)


@pytest.mark.cpu_paths
def test_a_q4_k_m_style_file_loads_compressed_with_its_wider_matrices_in_int8(cpu_paths, mixed_gguf):
    """With "auto" on the best 4-bit kernel here (the one it takes wherever a
    4-bit kernel is within reach of the fastest), the projections stored in
    4 bits run on it; one with a Q6_K, Q5_0 or Q5_K matrix runs int8 (in
    groups of 32 on the native kernels; on avx512vnni and avx2int8 one all
    Q6_K at the file's width, as the test after the next says) rather than being
    rounded to 4 bits; the Q6_K embeddings become one int8 table in groups of 32 shared
    with the LM head; and where the native kernels run, a decode step still
    runs all layers in one call."""
    path, dense = mixed_gguf
    choice = KernelChoice(candidates(cpu_paths, "int4")[0], "auto", 32)
    model = load_gguf_quantized(path, _CONFIG, choice, cpu_paths)
    made = model._projections()
    layer0, layer1 = made.layers
    # The wider kernel: int8 groups on the native kernels, int8 per channel on ATen's.
    four_bit, eight_bit = type(layer1.qkv_linear), type(layer0.qkv_linear)
    assert eight_bit is not four_bit
    assert type(layer0.o_linear) is type(layer0.gate_up_linear) is four_bit  # all Q4_K
    assert type(layer0.down_linear) is type(layer1.o_linear) is type(layer1.gate_up_linear) is eight_bit
    assert type(layer1.down_linear) is four_bit
    assert model.projection_choice.quantization == "int4+int8"
    assert "4 of 8 projections stored wider than 4 bits" in model.projection_choice.reason
    table = model._embedding.weight
    dense_table = dense["model.embed_tokens.weight"]
    if isinstance(table, Q6KLanes):
        # On avx512vnni and avx2int8 the one table is held as the LM head's
        # Q6_K lanes blocks: every row looked up is the file's values exactly.
        rows = torch.randperm(_CONFIG.vocab_size, generator=torch.Generator().manual_seed(0))
        assert torch.equal(model._embedding(rows), dense_table[rows])
    else:
        # Elsewhere one table in int8 groups of 32.
        embedding = table.groups() if isinstance(table, Q8Lanes) else table
        assert isinstance(embedding, Int8GroupWeight) and embedding.group_size == 32
        # Rounded once from Q6_K's groups of 16: within half a step of the file's values.
        step = embedding.scale.repeat_interleave(32, dim=1)
        assert ((embedding.dequantize() - dense_table).abs() <= step / 2 + 1e-6 * dense_table.abs().max()).all()
    if four_bit is Int4NativeLinear:
        assert eight_bit is Int8GroupNativeLinear and layer0.qkv_linear.isa == layer1.qkv_linear.isa
        held = layer1.o_linear.weight  # avx512vnni's in Q8_0 lanes blocks, the same values
        assert (held.groups() if isinstance(held, Q8Lanes) else held).q.shape == (256, 256)  # Q5_0's values as the file has them
        assert isinstance(made.head, Int8GroupNativeLinear) and made.head.weight is table
        assert isinstance(table, Q6KLanes) == (made.head.isa in {native.ISAS[i] for i in q6k_lanes.ISAS})
        assert made.decode is not None and made.decode.isa == layer1.qkv_linear.isa  # the fused step takes them


def _float_kernel_choice(cpu_paths) -> KernelChoice:
    """"auto" on the native 4-bit variant that multiplies a decode step's
    rows in float32 (AVX-512's, else AVX2's, else scalar), so that the
    logits follow the weights' rounding alone."""
    for isa in ("avx512", "avx2", "scalar"):
        name = f"quant_int4_native_{isa}"
        if cpu_paths.available(name):
            return KernelChoice(next(k for k in KERNELS if k.name == name), "auto", 32)
    if os.environ.get("CI") == "true":
        pytest.fail("scripts/setup.sh must build the native kernels under CI")
    pytest.skip("the native kernels are not built here")


@pytest.mark.cpu_paths
def test_a_mixed_files_logits_are_its_weights_rounded_as_documented(cpu_paths, mixed_gguf):
    """Against a float model over the file's values (gguf's own
    dequantization) with the documented roundings applied (in a projection
    with a wider matrix, each matrix not in Q5_0 or Q8_0 to int8 groups of
    32; the Q6_K table likewise), a prompt's logits and a fused decode
    step's agree to the kernels' float rounding: every other value, Q4_K's
    included, reached the kernels as the file has it."""
    path, dense = mixed_gguf
    model = load_gguf_quantized(path, _CONFIG, _float_kernel_choice(cpu_paths), cpu_paths)
    assert model._projections().decode is not None
    # A prompt's 24 rows run int16 activations on AVX2 (steps of 1/32767 of a group's largest).
    _assert_logits_follow_the_roundings(model, dense, cpu_paths, exact=(), prompt_tol=2e-3, decode_tol=2e-3)


def _assert_logits_follow_the_roundings(model, dense, cpu_paths, *, exact, prompt_tol: float, decode_tol: float):
    """``model``'s prompt logits and fused decode step against a float model
    over the file's values ``dense``, with the documented roundings applied:
    the embeddings, and each matrix of a projection with a wider one
    (``_WIDE``) that is not Q5_0 or Q8_0 and not in ``exact`` (held as the
    file has it), rounded to int8 groups of 32."""
    kinds = {gguf_weights.hf_name(f"blk.{i}.{part}.weight"): kind for i, layer in enumerate(_LAYERS) for part, kind in layer.items()}

    def rounded(name: str, value: torch.Tensor) -> torch.Tensor:
        projection = name.removesuffix(".weight")
        kept = projection in exact or kinds.get(name) in ("Q5_0", "Q8_0")
        if (name == "model.embed_tokens.weight" and not kept) or (projection in _WIDE and not kept):
            return quantize_int8_groups(value, 32).dequantize()
        return value

    reference = LlamaForCausalLM(_CONFIG, dtype=torch.float32, device="cpu", cpu_paths=cpu_paths)
    reference.load_weights([(name, rounded(name, value)) for name, value in dense.items()])
    prompt = [int(t) for t in np.random.default_rng(4).integers(3, _CONFIG.vocab_size, 24)]
    got, want = prompt_logits(model, prompt), prompt_logits(reference, prompt)
    assert (got - want).abs().max() <= prompt_tol * want.abs().max()
    got, want = _decode_step(model, prompt, 7), _decode_step(reference, prompt, 7)
    assert (got - want).abs().max() <= decode_tol * want.abs().max()


@pytest.mark.cpu_paths
def test_int4_asked_for_rounds_every_projection_to_4_bits(cpu_paths, mixed_gguf):
    path, _ = mixed_gguf
    choice = quantization_choice(cpu_paths, torch.device("cpu"), torch.float32, "int4", _CONFIG, 32)
    model = load_gguf_quantized(path, _CONFIG, choice, cpu_paths)
    kinds = {type(getattr(layer, f"{p}_linear")) for layer in model._projections().layers for p in ("qkv", "o", "gate_up", "down")}
    assert len(kinds) == 1 and "Int8" not in kinds.pop().__name__


@pytest.mark.parametrize(("kind", "group"), [("Q4_K", 32), ("Q6_K", 16)])
def test_the_writers_k_quants_are_the_format_gguf_reads(kind, group):
    """testing/gguf_writer's Q4_K and Q6_K, dequantized by gguf's reference:
    every value within one step of its sub-block (Q4_K: its range over 15
    steps; Q6_K: its largest magnitude over 31) of what was written, an
    all-positive and an all-zero super-block included, and the blocks our
    reader decodes into the same values."""
    import gguf

    from trioserve.testing.gguf_writer import quantize

    x = np.random.default_rng(7).standard_normal((3, 5, 512)).astype(np.float32)
    x[0, 0, :256] += 3
    x[1, 1, :256] = 0
    blocks = quantize(x, kind)
    values, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind]]
    assert blocks.dtype == np.uint8 and blocks.shape == (3, 5, 512 // values * size)
    y = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType[kind])
    sub, back = x.reshape(-1, group), y.reshape(-1, group)
    span = sub.max(-1) - np.minimum(sub.min(-1), 0) if kind == "Q4_K" else np.abs(sub).max(-1)
    step = span / (15 if kind == "Q4_K" else 31)
    assert (np.abs(back - sub).max(-1) <= step + 1e-6).all()
    assert (y[1, 1, :256] == 0).all()
    decode = gguf_weights.decode_q4_k if kind == "Q4_K" else gguf_weights.decode_q6_k
    ours = decode(blocks.reshape(15, -1)).dequantize().numpy()
    assert np.abs(ours - y.reshape(15, -1)).max() <= 1e-6 * np.abs(y).max()



@pytest.mark.cpu_paths
def test_on_avx512vnni_and_avx2int8_a_mixed_files_q6_k_projection_runs_the_files_values(cpu_paths, mixed_gguf):
    """The rule above on avx512vnni and avx2int8 (under
    TRIOSERVE_CPU_ASSUME=avx2), where a projection whose every matrix is
    Q6_K is held at the file's width (q6k_lanes): what the file holds is
    what runs. Layer 0's Q6_K down projection holds the file's values
    exactly (decoded back through float32 panels against the identity);
    its qkv, fusing Q4_K q and k with a Q6_K v, holds them rounded to int8
    groups of 32 as before. Against a float model over the file's values
    with only those other roundings, a prompt's logits and a fused decode
    step's agree to the int8 activations' rounding (a few percent of the
    largest logit on this random model; the Q6_K rounding the down
    projection no longer takes moves them under 1%)."""
    path, dense = mixed_gguf
    kernel = candidates(cpu_paths, "int4")[0]
    if kernel.isa not in q6k_lanes.ISAS:
        pytest.skip(f"the 4-bit kernel here is {kernel.name}, not avx512vnni's or avx2int8's")
    model = load_gguf_quantized(path, _CONFIG, KernelChoice(kernel, "auto", 32), cpu_paths)
    made = model._projections()
    assert made.decode is not None
    layer0, layer1 = made.layers
    down = layer0.down_linear.weight
    assert isinstance(down, Q6KLanes)
    # Float32 panels, on the widest variant this CPU runs (an AVX2-only CPU has no avx512).
    panels = native.ISAS["avx512" if "avx512" in native.cpu_isas() else "avx2"]
    assert torch.equal(down.linear(torch.eye(_CONFIG.intermediate_size), panels).T,
                       dense["model.layers.0.mlp.down_proj.weight"])  # fmt: skip
    qkv = torch.cat([dense[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv"])
    assert isinstance(layer0.qkv_linear.weight, Q8Lanes if kernel.isa == "avx512vnni" else Int8GroupWeight)
    assert torch.equal(layer0.qkv_linear.weight.dequantize(), quantize_int8_groups(qkv, 32).dequantize())
    _assert_logits_follow_the_roundings(
        model, dense, cpu_paths, exact=("model.layers.0.mlp.down_proj", "model.embed_tokens"), prompt_tol=5e-2,
        decode_tol=2e-2,
    )
