"""A GGUF's blocks put into the kernels' forms natively at load
(csrc/gguf_repack.cpp): each op gives the bits of the numpy it replaces on
random blocks (any float16 scale, NaN and infinity included where the op
takes them); a Q6_K tensor is decoded only when a consumer asks for its
int8 groups, and then into the same groups; a model loaded with the native
ops and one loaded with numpy's hold the same bytes and answer alike."""

from __future__ import annotations

import gc
import weakref
from unittest import mock

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from trioserve.engine.config import EngineConfig
from trioserve.engine.core.engine_core import EngineCore
from trioserve.engine.kernels import int4_native, native, q6k_lanes, q8_lanes
from trioserve.engine.kernels.q4k_blocks import Q4KBlocks
from trioserve.engine.kernels.q6k_lanes import Q6KGroups, Q6KLanes
from trioserve.engine.kernels.rtn import Int4Weight, Int8GroupWeight
from trioserve.engine.loading import compressed, gguf_weights
from trioserve.engine.loading.loader import LoadedModel
from trioserve.engine.sampling.sampling_params import SamplingParams
from trioserve.engine.text.fast_tokenizer import FastTokenizer
from trioserve.testing.tiny_model import write_word_tokenizer

from test_gguf_kquants import _CONFIG, _random_blocks, _random_tensors, _write
from test_q6k_lanes import _LAYERS


@pytest.fixture(scope="module")
def ops() -> object:
    try:
        return native.ops()
    except native.NativeUnavailable as exc:
        pytest.skip(str(exc))


def _blocks(size: int, halves: tuple[int, ...], out: int, n: int, seed: int, *, finite: bool) -> np.ndarray:
    """Random blocks ``[out, n * size]``: every byte random, the float16s at
    ``halves`` drawn from subnormal to float16's top, either sign (any bits
    at all, NaN and infinity too, unless ``finite``)."""
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, size=(out, n, size), dtype=np.uint8)
    for at in halves:
        if finite:
            values = rng.choice([-1, 1], (out, n)) * 10.0 ** rng.uniform(-8, 4.8, (out, n))
            data[..., at : at + 2] = values.astype(np.float16).view(np.uint8).reshape(out, n, 2)
    return data.reshape(out, -1)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bytes (a NaN equals itself, -0.0 is not 0.0)."""
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@settings(max_examples=30, deadline=None)
@given(out=st.integers(1, 20), n=st.integers(1, 3), seed=st.integers(0, 2**32 - 1), finite=st.booleans())
def test_q4_k_decodes_natively_to_numpys_bits(ops, out, n, seed, finite):
    data = _blocks(144, (0, 2), out, n, seed, finite=finite)
    with np.errstate(invalid="ignore", over="ignore"):  # NaN and infinity: numpy's arithmetic, as it was
        want = gguf_weights.decode_q4_k(data)
    scale, zero = ops.q4k_steps(torch.from_numpy(data))
    assert _same(ops.q4k_values(torch.from_numpy(data)), want.q)
    assert _same(scale, want.scale) and _same(zero, want.zero)


@settings(max_examples=30, deadline=None)
@given(panels=st.integers(1, 3), n=st.integers(1, 2), seed=st.integers(0, 2**32 - 1))
def test_q4_k_lanes_from_the_files_nibbles_are_those_of_its_values(ops, panels, n, seed):
    """Laid out from the blocks, never decoded, rows put back in another
    order or not: the bytes numpy packs from the decoded values."""
    data = _blocks(144, (0, 2), 16 * panels, n, seed, finite=True)
    blocks = Q4KBlocks(data, *ops.q4k_steps(torch.from_numpy(data)), gguf_weights._q4_k_values)
    for weight in (blocks, gguf_weights._unpermute(blocks, 2 * panels)):
        want = np.empty((panels, n * 8, 80), dtype=np.uint32)
        int4_native._pack_lanes_numpy(Int4Weight(weight.q, weight.scale, weight.zero, 32), want)
        fresh = Q4KBlocks(weight.blocks, weight.scale, weight.zero, gguf_weights._q4_k_values)
        assert np.array_equal(int4_native.pack_lanes(fresh).numpy(), want.view(np.uint8))
        assert not fresh.decoded
    assert _same(blocks.q, gguf_weights.decode_q4_k(data).q)


@settings(max_examples=30, deadline=None)
@given(panels=st.integers(1, 3), groups=st.integers(1, 3), group_size=st.sampled_from([32, 64]), data=st.data())
def test_4_bit_lanes_pack_natively_to_numpys_bytes(ops, panels, groups, group_size, data):
    """Any finite float32 steps (float16's overflow and subnormals
    included) and any byte as a value, as numpy packs them."""
    out, k = 16 * panels, group_size * groups
    q = data.draw(hnp.arrays(np.uint8, (out, k)))
    step = st.floats(width=32, allow_nan=False, allow_infinity=False)
    scale, zero = (data.draw(hnp.arrays(np.float32, (out, groups), elements=step)) for _ in range(2))
    weight = Int4Weight(torch.from_numpy(q), torch.from_numpy(scale), torch.from_numpy(zero), group_size)
    want = np.empty((panels, k // 32, 80), dtype=np.uint32)
    int4_native._pack_lanes_numpy(weight, want)
    assert np.array_equal(int4_native.pack_lanes(weight).numpy(), want.view(np.uint8))


@settings(max_examples=30, deadline=None)
@given(out=st.integers(1, 20), n=st.integers(1, 3), seed=st.integers(0, 2**32 - 1))
def test_a_q6_k_table_rounds_natively_into_q8_0_groups_with_numpys_bits(ops, out, n, seed):
    data = _blocks(210, (208,), out, n, seed, finite=True)
    with mock.patch.object(gguf_weights, "repack_ops", lambda: None):
        want = compressed._int8_groups([gguf_weights.decode_q6_k(data)])
    table = Q6KGroups(data, gguf_weights.decode_q6_k_rows)
    got = compressed._int8_groups([table])
    assert not table.decoded  # straight from the blocks
    assert _same(got.q, want.q) and _same(got.scale, want.scale)


@settings(max_examples=30, deadline=None)
@given(rows=st.integers(1, 6), groups=st.integers(1, 3), data=st.data())
def test_rows_round_into_q8_0_groups_with_numpys_bits_infinities_and_nan_too(ops, rows, groups, data):
    dense = data.draw(hnp.arrays(np.float32, (rows, 32 * groups), elements=st.floats(width=32)))
    want = (np.empty(dense.shape, dtype=np.int8), np.empty((rows, groups), dtype=np.float32))
    compressed._round_numpy(dense, *want)
    got = (np.empty(dense.shape, dtype=np.int8), np.empty((rows, groups), dtype=np.float32))
    compressed._round_into(dense, *got)
    assert np.array_equal(got[0], want[0]) and np.array_equal(got[1].view(np.uint32), want[1].view(np.uint32))


@settings(max_examples=30, deadline=None)
@given(panels=st.integers(1, 3), groups=st.integers(1, 3), data=st.data())
def test_q8_0_lanes_lay_out_natively_to_numpys_bytes(ops, panels, groups, data):
    q = data.draw(hnp.arrays(np.int8, (16 * panels, 32 * groups)))
    steps = data.draw(hnp.arrays(np.float32, (16 * panels, groups), elements=st.floats(width=32)))
    weight = Int8GroupWeight(torch.from_numpy(q), torch.from_numpy(steps), 32)
    assert _same(q8_lanes.Q8Lanes.of(weight, ops).blocks, q8_lanes.Q8Lanes.of(weight, None).blocks)


@settings(max_examples=30, deadline=None)
@given(panels=st.integers(1, 3), n=st.integers(1, 3), seed=st.integers(0, 2**32 - 1))
def test_q6_k_lanes_lay_out_natively_to_numpys_bytes(ops, panels, n, seed):
    data = np.random.default_rng(seed).integers(0, 256, (16 * panels, n * 210), dtype=np.uint8)  # d's bits any
    got = Q6KLanes.of(data, ops)
    lanes, d = q6k_lanes.to_lanes(data)
    assert _same(got.lanes, lanes) and _same(got.d, d)


@pytest.fixture(scope="module")
def q4_k_m_file(tmp_path_factory):
    """A Q4_K_M-style file: a Q6_K token table, Q4_K projections, Q6_K v and down."""
    tensors = _random_tensors(_LAYERS, np.random.default_rng(11))
    folder = tmp_path_factory.mktemp("repack")
    _write(folder / "m.gguf", tensors)
    write_word_tokenizer(folder, _CONFIG.vocab_size)
    return folder


def test_q4_k_and_q6_k_tensors_are_read_undecoded_and_decode_to_the_same_values(ops, q4_k_m_file):
    got = dict(gguf_weights.read_tensors(q4_k_m_file / "m.gguf", num_heads=4, num_kv_heads=2))
    with mock.patch.object(gguf_weights, "repack_ops", lambda: None):
        want = dict(gguf_weights.read_tensors(q4_k_m_file / "m.gguf", num_heads=4, num_kv_heads=2))
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.up_proj.weight"):
        assert isinstance(got[name], Q4KBlocks) and not got[name].decoded
        assert got[name].shape == tuple(want[name].q.shape)
        assert all(_same(getattr(got[name], p), getattr(want[name], p)) for p in ("q", "scale", "zero"))
    table = got["model.embed_tokens.weight"]
    assert isinstance(table, Q6KGroups) and not table.decoded
    assert table.shape == (_CONFIG.vocab_size, _CONFIG.hidden_size)
    want = gguf_weights.decode_q6_k(np.asarray(table.blocks))
    assert _same(table.q, want.q) and _same(table.scale, want.scale) and table.group_size == 16
    k = got["model.layers.1.self_attn.k_proj.weight"]  # its rows put back in Hugging Face's order, still undecoded
    assert isinstance(k, Q6KGroups) and not k.decoded
    file = gguf_weights.GGUFFile(q4_k_m_file / "m.gguf")
    raw = file.data(next(t for t in file.tensors if t.name == "blk.1.attn_k.weight"))
    want = gguf_weights._unpermute(gguf_weights.decode_q6_k(np.asarray(raw)), _CONFIG.num_key_value_heads)
    assert _same(k.q, want.q) and _same(k.scale, want.scale)


def test_a_damaged_q6_k_scale_is_refused_without_decoding(tmp_path):
    tensors = _random_tensors(_LAYERS[:1], np.random.default_rng(12))
    kind, down = tensors["blk.0.ffn_down.weight"]
    down = down.copy().reshape(down.shape[0], -1, 210)
    down[3, 0, 208:210] = np.array([np.inf], dtype=np.float16).view(np.uint8)  # an infinite d
    tensors["blk.0.ffn_down.weight"] = (kind, down.reshape(down.shape[0], -1))
    _write(tmp_path / "bad.gguf", tensors)
    damaged = r"'blk.0.ffn_down.weight' \(Q6_K\) has scales that are not finite"
    with pytest.raises(gguf_weights.ModelLoadError, match=damaged):
        dict(gguf_weights.read_tensors(tmp_path / "bad.gguf", num_heads=4, num_kv_heads=2))


class _WithoutNativeLanes:
    """``torch.ops.trioserve`` without the lanes layouts' ops: Q8_0 and Q6_K lanes laid out by numpy."""

    def __init__(self, ops: object) -> None:
        self._ops = ops

    def __getattr__(self, name: str) -> object:
        if name in ("q8_lanes_into", "q6k_lanes_into"):
            raise AttributeError(name)
        return getattr(self._ops, name)


def _greedy(loaded: LoadedModel, prompt: list[int]) -> tuple[list[int], list[object]]:
    config = EngineConfig(block_size=16, max_model_len=64, max_num_seqs=2, kv_cache_memory=2 << 20,
                          kv_cache_dtype="float32", warm_up=False)  # fmt: skip
    core = EngineCore(loaded, config)
    core.add_request("r", prompt, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2))
    tokens: list[int] = []
    logprobs: list[object] = []
    while core.has_unfinished():
        for out in core.step():
            tokens.extend(out.new_token_ids)
            logprobs.extend(out.logprobs or [])
    return tokens, logprobs


@pytest.mark.cpu_paths
def test_a_model_loaded_with_the_native_ops_answers_as_one_loaded_with_numpy(ops, cpu_paths, q4_k_m_file, monkeypatch):
    """The same file loaded twice, the second time with every repacking in
    numpy: the same greedy tokens and logprobs, bit for bit."""
    choice = compressed.quantization_choice(cpu_paths, torch.device("cpu"), torch.float32, "auto", _CONFIG, 32)

    def loaded() -> LoadedModel:
        model = compressed.load_gguf_quantized(q4_k_m_file / "m.gguf", _CONFIG, choice, cpu_paths)
        return LoadedModel(model=model, model_config=_CONFIG, tokenizer=FastTokenizer.from_folder(q4_k_m_file),
                           name="m", path=q4_k_m_file, dtype=torch.float32, device=torch.device("cpu"))  # fmt: skip

    prompt = [int(t) for t in np.random.default_rng(13).integers(3, _CONFIG.vocab_size, 9)]
    native_answer = _greedy(loaded(), prompt)
    monkeypatch.setattr(gguf_weights, "repack_ops", lambda: None)
    monkeypatch.setattr(int4_native, "_pack_lanes_into", int4_native._pack_lanes_numpy)
    monkeypatch.setattr(native, "ops", lambda environ=None: _WithoutNativeLanes(ops))
    assert _greedy(loaded(), prompt) == native_answer


@pytest.mark.cpu_paths
def test_no_view_of_the_mapped_file_outlives_the_load(cpu_paths, tmp_path, monkeypatch):
    """A Q4_K token table, kept as the embeddings, owns its values: while a
    view of the mapped file lives the map does, and every page the load
    read stays in the server's RSS (a 4.2 GB MoE file's 4.3 GB)."""
    rng = np.random.default_rng(14)
    tensors = _random_tensors(_LAYERS, rng)
    tensors["token_embd.weight"] = ("Q4_K", _random_blocks("Q4_K", _CONFIG.vocab_size, _CONFIG.hidden_size, rng))
    _write(tmp_path / "m.gguf", tensors)
    maps = []
    opened = gguf_weights.GGUFFile.__init__

    def recording(self, *args, **kwargs):
        opened(self, *args, **kwargs)
        maps.append(weakref.ref(self._map))

    monkeypatch.setattr(gguf_weights.GGUFFile, "__init__", recording)
    choice = compressed.quantization_choice(cpu_paths, torch.device("cpu"), torch.float32, "auto", _CONFIG, 32)
    model = compressed.load_gguf_quantized(tmp_path / "m.gguf", _CONFIG, choice, cpu_paths)
    gc.collect()
    assert maps and all(m() is None for m in maps), "a view of the mapped file outlived the load"
    assert model is not None
