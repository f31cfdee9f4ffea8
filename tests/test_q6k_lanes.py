"""GGUF's Q6_K held at the file's width on avx512vnni and avx2int8
(engine/kernels/q6k_lanes.py, csrc/q6k_lanes_vnni.h, csrc/q6k_lanes_avx2.h):
the lanes hold the file's values; a row's result has the same bits at every
row count and batch composition, the bits of a numpy emulation of the
kernel's operations (the AVX2 kernel's the vnni kernel's), and is close to
float64 W x over the file's values; a Q4_K_M-style file's Q6_K projections,
head and experts load so, and an engine over it answers a request alike
alone and in a batch."""

from __future__ import annotations

import attrs
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trioserve.engine.config import EngineConfig
from trioserve.engine.core.engine_core import EngineCore
from trioserve.engine.kernels import native, q6k_lanes
from trioserve.engine.kernels.choose import KERNELS, KernelChoice
from trioserve.engine.kernels.int4_native import bf16_gemm
from trioserve.engine.kernels.int8_native import Int8GroupNativeLinear
from trioserve.engine.kernels.q6k_lanes import Q6KGroups, Q6KLanes
from trioserve.engine.kernels.q8_lanes import Q8Lanes
from trioserve.engine.kernels.rtn import Int8GroupWeight
from trioserve.engine.loading import gguf_weights
from trioserve.engine.loading.compressed import load_gguf_quantized, quantization_choice
from trioserve.engine.loading.loader import LoadedModel
from trioserve.engine.models.moe_weights import expert_linear
from trioserve.engine.sampling.sampling_params import SamplingParams
from trioserve.engine.text.fast_tokenizer import FastTokenizer
from trioserve.testing.tiny_model import write_word_tokenizer

from test_gguf_kquants import _CONFIG, _random_blocks, _random_tensors, _reference, _write

VNNI, BF16, AVX512 = native.ISAS["avx512vnni"], native.ISAS["avx512bf16"], native.ISAS["avx512"]
AVX2_INT8, AVX2 = native.ISAS["avx2int8"], native.ISAS["avx2"]
ROWS = (1, 2, 5, 17, 40)
SHAPES = ((16, 256), (48, 768), (96, 2048))


@pytest.fixture(scope="module")
def ops(isas) -> object:
    if "avx512vnni" not in isas:
        pytest.skip(f"this CPU cannot run avx512vnni ({native.ISA_REQUIREMENTS['avx512vnni']})")
    return native.ops()


@pytest.fixture(scope="module")
def avx2_ops(isas) -> object:
    if "avx2int8" not in isas:
        pytest.skip(f"this CPU cannot run avx2int8 ({native.ISA_REQUIREMENTS['avx2int8']})")
    return native.ops()


def _matrix(out: int, k: int, seed: int) -> np.ndarray:
    return _random_blocks("Q6_K", out, k, np.random.default_rng(seed))


def _emulate(x: torch.Tensor, data: np.ndarray) -> torch.Tensor:
    """csrc/q6k_lanes_vnni.h's operations (and q6k_lanes_avx2.h's) in numpy: the rows rounded to int8
    in groups of 32 (quantize_rows_q8), each group's exact int32 sum of its
    two sub-blocks' scaled dots, then in float32 ``acc = fma(t * dx, d,
    acc)`` group after group (the fma exact in float64, then rounded)."""
    out = data.shape[0]
    blocks = data.reshape(out, -1, 210)
    n = blocks.shape[1]
    u = (gguf_weights.decode_q6_k(data).q.numpy().astype(np.int64)).reshape(out, n * 16, 16)  # u - 32
    sc = blocks[..., 192:208].view(np.int8).astype(np.int64).reshape(out, n * 16)
    d = np.ascontiguousarray(blocks[..., 208:210]).view(np.float16).astype(np.float32)[..., 0]  # [out, n]
    g = x.numpy().reshape(x.shape[0], -1, 32)
    amax = np.abs(g).max(-1)
    inv = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    q = np.rint(g * inv[..., None]).astype(np.int64).reshape(x.shape[0], n * 16, 16)
    step = (amax / np.float32(127)).astype(np.float32)  # [rows, groups]
    t = (np.einsum("rsi,osi->ros", q, u) * sc).reshape(x.shape[0], out, n * 8, 2).sum(-1)  # exact
    acc = np.zeros((x.shape[0], out), np.float32)
    for b in range(n * 8):
        a = t[:, :, b].astype(np.float32) * step[:, b : b + 1]
        acc = (a.astype(np.float64) * d[:, b // 8].astype(np.float64) + acc).astype(np.float32)
    return torch.from_numpy(acc)


def test_the_lanes_hold_the_files_values(ops):
    """Each channel decoded back from the lanes (float32 panels against the
    identity: exact) is the file's Q6_K values, as gguf's reference reads
    them; the bfloat16 matrix is each of them rounded."""
    for out, k in SHAPES:
        data = _matrix(out, k, out + k)
        lanes = Q6KLanes.of(data, ops)
        assert lanes.shape == (out, k) and lanes.nbytes == data.nbytes  # the file's bytes, rearranged
        assert lanes.lanes.shape == (out // 16, k // 256, q6k_lanes.LANES_BYTES)
        want = _reference("Q6_K", data)
        assert torch.equal(lanes.linear(torch.eye(k), AVX512).T, want)
        assert torch.equal(lanes.dequantize_bf16(), want.to(torch.bfloat16))


@settings(max_examples=25, deadline=None)
@given(panels=st.integers(1, 4), supers=st.integers(1, 3), seed=st.integers(0, 2**16),
       picks=st.lists(st.integers(0, 10**6), min_size=0, max_size=40), many=st.booleans())  # fmt: skip
def test_rows_looked_up_in_the_lanes_are_the_files_values(panels, supers, seed, picks, many):
    """A tied model's embeddings read their rows out of the head's lanes
    (``lookup``, torch on any CPU): each row is the file's groups'
    dequantized values bit for bit, in any order, repeated, and past a
    lookup's chunk of rows."""
    out, k = panels * q6k_lanes.CHANNELS, supers * q6k_lanes.SUPER
    data = _matrix(out, k, seed)
    lanes = Q6KLanes(*q6k_lanes.to_lanes(data), None)
    index = torch.tensor([p % out for p in picks], dtype=torch.int64)
    if many:  # more rows than one chunk
        index = torch.cat([index, torch.randint(0, out, (q6k_lanes._LOOKUP_ROWS + 7,), generator=torch.Generator().manual_seed(seed))])
    want = gguf_weights.decode_q6_k(data).dequantize()
    assert torch.equal(lanes.lookup(index), want[index])


def test_a_rows_bits_are_the_same_at_every_row_count_and_in_any_batch(ops):
    for out, k in SHAPES:
        lanes = Q6KLanes.of(_matrix(out, k, out), ops)
        x = torch.randn(max(ROWS), k, generator=torch.Generator().manual_seed(k))
        x[3, :32] = 0.0  # a group of zeros: a zero step
        whole = lanes.linear(x, VNNI)
        for rows in ROWS:
            assert torch.equal(lanes.linear(x[:rows], VNNI), whole[:rows]), (out, k, rows)
        # Row 7 alone, and among other rows at another place in the batch.
        others = torch.randn(20, k, generator=torch.Generator().manual_seed(1))
        mixed = torch.cat([others[:11], x[7:8], others[11:]])
        assert torch.equal(lanes.linear(x[7:8], VNNI)[0], whole[7])
        assert torch.equal(lanes.linear(mixed, VNNI)[11], whole[7])
        # The panels a prompt's rows take outside batch-invariant mode too.
        for isa in (BF16, AVX512):
            panels = lanes.linear(x, isa)
            assert torch.equal(lanes.linear(x[:5], isa), panels[:5]) and torch.equal(lanes.linear(mixed, isa)[11], panels[7])


def _assert_documented_operations(ops, isa: int, float_isa: int | None = None) -> None:
    """The int8 kernel of ``isa`` computes ``_emulate``'s operations and is
    close to W x; with ``float_isa``, that variant's float panels closer."""
    for out, k in SHAPES:
        data = _matrix(out, k, 2 * out)
        x = torch.randn(max(ROWS), k, generator=torch.Generator().manual_seed(out))
        lanes = Q6KLanes.of(data, ops)
        got = lanes.linear(x, isa)
        assert torch.equal(got, _emulate(x, data))
        exact = x.double() @ _reference("Q6_K", data).double().T
        # The int8 activations' rounding alone (at most amax / 254 a value).
        assert (got.double() - exact).abs().max() <= 1e-2 * exact.abs().max()
        if float_isa is not None:
            # A prompt's float panels: the file's values, float sums.
            floats = lanes.linear(x, float_isa)
            assert (floats.double() - exact).abs().max() <= 1e-5 * exact.abs().max()


def test_the_kernel_computes_its_documented_operations_and_is_close_to_w_x(ops):
    _assert_documented_operations(ops, VNNI)


def test_the_linear_takes_int8_activations_only_where_asked(ops):
    """Decode steps (``int8_panels``, as native_decode.decode_head asks; the
    fused step calls the kernel itself) run the int8 kernel; a prompt's rows
    float activations in bfloat16 panels, or from ``gemm_from_rows`` torch's
    bfloat16 GEMM over the matrix dequantized; the bias added after."""
    out, k = 48, 768
    lanes = Q6KLanes.of(_matrix(out, k, 9), ops)
    bias = torch.randn(out, generator=torch.Generator().manual_seed(2))
    x = torch.randn(20, k, generator=torch.Generator().manual_seed(3))
    linear = Int8GroupNativeLinear.q6k(lanes, "avx512vnni", bias, gemm_from_rows=16)
    assert torch.equal(attrs.evolve(linear, int8_panels=True)(x), lanes.linear(x, VNNI) + bias)
    assert torch.equal(linear(x[:9]), lanes.linear(x[:9], BF16) + bias)
    assert torch.equal(linear(x), bf16_gemm(x, lanes.dequantize_bf16()) + bias)


@pytest.mark.cpu_paths
def test_the_avx2_kernel_has_the_vnni_kernels_bits(avx2_ops, isas):
    """avx2int8's kernel (csrc/q6k_lanes_avx2.h) gives avx512vnni's bits for
    the same inputs, where this CPU runs both (a zero group among them)."""
    if "avx512vnni" not in isas:
        pytest.skip(f"this CPU cannot run avx512vnni ({native.ISA_REQUIREMENTS['avx512vnni']}) to compare with")
    for out, k in SHAPES:
        lanes = Q6KLanes.of(_matrix(out, k, 3 * out), avx2_ops)
        x = torch.randn(max(ROWS), k, generator=torch.Generator().manual_seed(k + 1))
        x[5, 32:64] = 0.0
        for rows in ROWS:
            assert torch.equal(lanes.linear(x[:rows], AVX2_INT8), lanes.linear(x[:rows], VNNI)), (out, k, rows)


@pytest.mark.cpu_paths
def test_the_avx2_kernel_computes_the_documented_operations_and_is_close_to_w_x(avx2_ops):
    _assert_documented_operations(avx2_ops, AVX2_INT8, float_isa=AVX2)


@pytest.mark.cpu_paths
@settings(max_examples=20, deadline=None)
@given(panels=st.integers(1, 3), supers=st.integers(1, 3), rows=st.integers(1, 23), row=st.integers(0, 22),
       seed=st.integers(0, 2**16))  # fmt: skip
def test_an_avx2_rows_bits_are_the_same_at_every_row_count(avx2_ops, panels, supers, rows, row, seed):
    """A row's result on avx2int8 alone equals it among ``rows`` rows at any
    place (tiles of 4 rows and their remainders), and so do avx2's panels."""
    out, k = panels * q6k_lanes.CHANNELS, supers * q6k_lanes.SUPER
    lanes = Q6KLanes.of(_matrix(out, k, seed), avx2_ops)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(seed))
    row %= rows
    for isa in (AVX2_INT8, AVX2):
        assert torch.equal(lanes.linear(x, isa)[row], lanes.linear(x[row : row + 1], isa)[0]), isa


@pytest.mark.cpu_paths
def test_the_avx2int8_linear_takes_int8_activations_only_where_asked(avx2_ops):
    """As on avx512vnni: decode steps (``int8_panels``) run the int8 kernel,
    a prompt's rows avx2's float32 panels at any row count, as avx2int8's
    Q8_0 groups take float32 activations there; the bias added after."""
    out, k = 48, 768
    lanes = Q6KLanes.of(_matrix(out, k, 9), avx2_ops)
    bias = torch.randn(out, generator=torch.Generator().manual_seed(2))
    x = torch.randn(20, k, generator=torch.Generator().manual_seed(3))
    linear = Int8GroupNativeLinear.q6k(lanes, "avx2int8", bias)
    assert torch.equal(attrs.evolve(linear, int8_panels=True)(x), lanes.linear(x, AVX2_INT8) + bias)
    for rows in (3, 20):
        assert torch.equal(linear(x[:rows]), lanes.linear(x[:rows], AVX2) + bias)


@pytest.mark.cpu_paths
@pytest.mark.parametrize("isa", sorted(q6k_lanes.ISAS))
def test_a_files_q6_k_expert_is_held_as_q6_k_lanes(isas, isa):
    """A mixture's Q6_K expert matrix on avx512vnni or avx2int8 keeps the
    file's values in Q6_K lanes, on the int8 kernel when batch-invariant."""
    if isa not in isas:
        pytest.skip(f"this CPU cannot run {isa}")
    data = _matrix(96, 512, 4)
    weight = Q6KGroups(data, gguf_weights.decode_q6_k_rows)
    choice = KernelChoice(next(k for k in KERNELS if k.name == f"quant_int4_native_{isa}"), "auto", 32)
    linear = expert_linear(choice, weight, None, batch_invariant=True)
    assert isinstance(linear, Int8GroupNativeLinear) and isinstance(linear.weight, Q6KLanes)
    assert linear.isa == native.ISAS[isa] and linear.int8_panels and not weight.decoded
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(0))
    assert torch.equal(linear(x), _emulate(x, data))


def test_shapes_without_whole_panels_do_not_fit():
    assert q6k_lanes.fits(16, 256) and q6k_lanes.fits(512, 8192)
    assert not q6k_lanes.fits(24, 256) and not q6k_lanes.fits(16, 288)


# Layer 0 as llama.cpp's Q4_K_M stores it (a Q6_K v fused with Q4_K q and
# k, a Q6_K down); layer 1 with q, k and v all Q6_K.
_LAYERS = (
    {"attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q6_K", "attn_output": "Q4_K", "ffn_gate": "Q4_K", "ffn_up": "Q4_K", "ffn_down": "Q6_K"},
    {"attn_q": "Q6_K", "attn_k": "Q6_K", "attn_v": "Q6_K", "attn_output": "Q4_K", "ffn_gate": "Q4_K", "ffn_up": "Q4_K", "ffn_down": "Q4_K"},
)


@pytest.fixture(scope="module")
def q6k_file(tmp_path_factory):
    tensors = _random_tensors(_LAYERS, np.random.default_rng(5))
    folder = tmp_path_factory.mktemp("q6k")
    _write(folder / "q6k.gguf", tensors)
    write_word_tokenizer(folder, _CONFIG.vocab_size)
    return folder, tensors


@pytest.mark.cpu_paths
def test_a_files_q6_k_projections_load_as_q6_k_lanes_on_avx512vnni_and_avx2int8(cpu_paths, q6k_file):
    """Every Q6_K projection of whole panels (layer 0's down, layer 1's
    fused q, k and v, its q and k rows put back in Hugging Face's order) is
    held as Q6_K lanes of the file's values, and so is the tied Q6_K table
    as the head; a qkv fusing Q4_K with Q6_K keeps Q8_0 groups (in lanes on
    avx512vnni); the fused decode step takes every layer. Under
    TRIOSERVE_CPU_ASSUME=avx2 the kernel is avx2int8's."""
    folder, tensors = q6k_file
    choice = quantization_choice(cpu_paths, torch.device("cpu"), torch.float32, "auto", _CONFIG, 32)
    if choice.kernel.isa not in q6k_lanes.ISAS:
        pytest.skip(f"the 4-bit kernel here is {choice.kernel.name}, not avx512vnni's or avx2int8's")
    isa = native.ISAS[choice.kernel.isa]
    model = load_gguf_quantized(folder / "q6k.gguf", _CONFIG, choice, cpu_paths)
    assert "Q6_K lanes blocks" in model.projection_choice.reason
    made = model._projections()
    layer0, layer1 = made.layers
    assert isinstance(layer0.qkv_linear.weight, Q8Lanes if isa == VNNI else Int8GroupWeight)
    for linear in (layer0.down_linear, layer1.qkv_linear, made.head):
        assert isinstance(linear, Int8GroupNativeLinear) and isinstance(linear.weight, Q6KLanes)
        assert linear.isa == isa
    assert made.decode is not None and made.decode.isa == isa
    # Float32 panels on the widest variant this CPU runs (an AVX2-only CPU has no avx512).
    panels = AVX512 if "avx512" in native.cpu_isas() else AVX2
    down = layer0.down_linear.weight.linear(torch.eye(_CONFIG.intermediate_size), panels).T
    assert torch.equal(down, _reference("Q6_K", tensors["blk.0.ffn_down.weight"][1]))
    qkv = layer1.qkv_linear.weight.linear(torch.eye(_CONFIG.hidden_size), panels).T
    heads = {"attn_q": _CONFIG.num_attention_heads, "attn_k": _CONFIG.num_key_value_heads, "attn_v": None}
    parts = [_reference("Q6_K", tensors[f"blk.1.{p}.weight"][1]) for p in heads]
    parts = [w if h is None else gguf_weights._unpermute(w, h) for w, h in zip(parts, heads.values())]
    assert torch.equal(qkv, torch.cat(parts))


def test_q6_k_tensors_keep_the_files_rows(q6k_file):
    folder, tensors = q6k_file
    got = dict(gguf_weights.read_tensors(folder / "q6k.gguf", num_heads=4, num_kv_heads=2))
    down = got["model.layers.0.mlp.down_proj.weight"]
    assert isinstance(down, Q6KGroups) and np.array_equal(down.blocks, tensors["blk.0.ffn_down.weight"][1])
    assert isinstance(got["model.layers.1.self_attn.k_proj.weight"], Q6KGroups)


def _generate(core: EngineCore, prompts: dict[str, list[int]]) -> dict[str, tuple[list[int], list[object]]]:
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2)
    for rid, prompt in prompts.items():
        core.add_request(rid, prompt, params)
    results: dict[str, tuple[list[int], list[object]]] = {rid: ([], []) for rid in prompts}
    while core.has_unfinished():
        for out in core.step():
            results[out.request_id][0].extend(out.new_token_ids)
            results[out.request_id][1].extend(out.logprobs or [])
    return results


@pytest.mark.cpu_paths
def test_an_engine_over_q6_k_lanes_answers_alike_alone_and_in_a_batch(cpu_paths, q6k_file):
    """Batch invariance with the Q6_K projections in lanes: greedy tokens and
    their logprobs of each request alone equal those in a batch of three."""
    folder, _ = q6k_file
    choice = quantization_choice(cpu_paths, torch.device("cpu"), torch.float32, "auto", _CONFIG, 32)
    model = load_gguf_quantized(folder / "q6k.gguf", _CONFIG, choice, cpu_paths)
    loaded = LoadedModel(model=model, model_config=_CONFIG, tokenizer=FastTokenizer.from_folder(folder), name="q6k",
                         path=folder, dtype=torch.float32, device=torch.device("cpu"))  # fmt: skip
    config = dict(block_size=16, max_model_len=128, max_num_seqs=4, kv_cache_memory=4 << 20, kv_cache_dtype="float32",
                  warm_up=False)  # fmt: skip
    rng = np.random.default_rng(6)
    prompts = {f"r{i}": [int(t) for t in rng.integers(3, _CONFIG.vocab_size, n)] for i, n in enumerate((5, 19, 33))}
    together = _generate(EngineCore(loaded, EngineConfig(**config)), prompts)
    for rid, prompt in prompts.items():
        alone = _generate(EngineCore(loaded, EngineConfig(**config)), {rid: prompt})
        assert alone[rid] == together[rid], rid
