"""Start-up's GGUF reading gives the same bits as the reading it replaced.

The header is read without gguf-py's parse of every token
(engine/loading/gguf_file.py), each tensor is decoded from the mapped file
a chunk of rows at a time (engine/loading/gguf_weights.py), and a
projection stored wider than 4 bits is rounded into int8 groups of 32 a
chunk at a time (engine/loading/compressed.py). The reference is the slow
path they replaced, kept here (``_ref_*``: gguf-py's ``GGUFReader`` and the
decoders as they were), compared bit for bit; and a GGUF whose weights load
compressed leaves only its config and tokenizer in the cache
(engine/loading/gguf_cache.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trioserve.engine.kernels.rtn import Int4Weight, Int8GroupWeight, quantize_int8_groups, regroup_int8
from trioserve.engine.loading import compressed, gguf_cache, gguf_weights
from trioserve.engine.loading.gguf_file import GGUFFile
from trioserve.testing import gguf_writer

# -- the reference: the decoders as they were, over gguf-py's reader ---------


def _ref_fp16(blocks: np.ndarray, at: int) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(blocks[..., at : at + 2]).view(np.float16)[..., 0].astype(np.float32))


def _ref_nibbles(qs: np.ndarray) -> torch.Tensor:
    q = torch.from_numpy(np.ascontiguousarray(qs))
    return torch.cat([q & 0x0F, q >> 4], dim=-1)


def _ref_q4(kind: str, data: np.ndarray) -> Int4Weight:
    size = 18 if kind == "Q4_0" else 20
    out = data.shape[0]
    blocks = data.reshape(out, -1, size)
    d = _ref_fp16(blocks, 0)
    zero = _ref_fp16(blocks, 2) + 8 * d if kind == "Q4_1" else torch.zeros_like(d)
    return Int4Weight(_ref_nibbles(blocks[..., size - 16 :]).reshape(out, -1), d, zero, 32)


def _ref_q4_k(data: np.ndarray) -> Int4Weight:
    import gguf

    out = data.shape[0]
    blocks = data.reshape(out, -1, 144)
    d, dmin = _ref_fp16(blocks, 0), _ref_fp16(blocks, 2)
    sc, mins = gguf.quants.Q4_K.get_scale_min(np.ascontiguousarray(blocks[..., 4:16]).reshape(-1, 12))
    scale = d[..., None] * torch.from_numpy(sc.astype(np.float32)).view(*d.shape, 8)
    offset = dmin[..., None] * torch.from_numpy(mins.astype(np.float32)).view(*d.shape, 8)
    qs = torch.from_numpy(np.ascontiguousarray(blocks[..., 16:])).view(out, -1, 4, 32)
    q = torch.stack([qs & 0x0F, qs >> 4], dim=3)
    scale, offset = scale.reshape(out, -1), offset.reshape(out, -1)
    return Int4Weight(q.reshape(out, -1), scale, 8 * scale - offset, 32)


def _ref_q5_0(data: np.ndarray) -> Int8GroupWeight:
    out = data.shape[0]
    blocks = data.reshape(out, -1, 22)
    d = _ref_fp16(blocks, 0)
    high = np.ascontiguousarray(blocks[..., 2:6]).view(np.uint32)
    high = ((high >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)
    q = _ref_nibbles(blocks[..., 6:]) | torch.from_numpy(high << 4)
    return Int8GroupWeight((q.to(torch.int8) - 16).reshape(out, -1), d, 32)


def _ref_q6_k(data: np.ndarray) -> Int8GroupWeight:
    out = data.shape[0]
    blocks = data.reshape(out, -1, 210)
    n = blocks.shape[1]
    low = np.ascontiguousarray(blocks[..., :128]).reshape(out, n, 2, 1, 64)
    low = (low >> np.array([0, 4], dtype=np.uint8).reshape(2, 1)) & 0x0F
    high = np.ascontiguousarray(blocks[..., 128:192]).reshape(out, n, 2, 1, 32)
    high = (high >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(4, 1)) & 0x03
    q = (low.reshape(out, n, 256) | (high.reshape(out, n, 256) << 4)).astype(np.int8) - np.int8(32)
    sc = torch.from_numpy(np.ascontiguousarray(blocks[..., 192:208]).view(np.int8).astype(np.float32))
    scale = _ref_fp16(blocks, 208)[..., None] * sc
    return Int8GroupWeight(torch.from_numpy(q.reshape(out, -1)), scale.reshape(out, -1), 16)


def _ref_q8_0(data: np.ndarray) -> Int8GroupWeight:
    out = data.shape[0]
    blocks = data.reshape(out, -1, 34)
    q = torch.from_numpy(np.ascontiguousarray(blocks[..., 2:]).view(np.int8))
    return Int8GroupWeight(q.reshape(out, -1), _ref_fp16(blocks, 0), 32)


_REF = {
    "Q4_0": lambda d: _ref_q4("Q4_0", d), "Q4_1": lambda d: _ref_q4("Q4_1", d), "Q4_K": _ref_q4_k,
    "Q5_0": _ref_q5_0, "Q6_K": _ref_q6_k, "Q8_0": _ref_q8_0,
}  # fmt: skip
_NEW = {
    "Q4_0": lambda d: gguf_weights.decode_q4("Q4_0", d), "Q4_1": lambda d: gguf_weights.decode_q4("Q4_1", d),
    "Q4_K": gguf_weights.decode_q4_k, "Q5_0": gguf_weights.decode_q5_0, "Q6_K": gguf_weights.decode_q6_k,
    "Q8_0": gguf_weights.decode_q8_0_blocks,
}  # fmt: skip
# Where each type keeps its float16 scales.
_HALVES = {"Q4_0": (0,), "Q4_1": (0, 2), "Q4_K": (0, 2), "Q5_0": (0,), "Q5_K": (0, 2), "Q6_K": (208,), "Q8_0": (0,)}


def _ref_read(path: Path) -> dict[str, object]:
    """Every tensor of ``path`` as the reading it replaced gave it (before
    the rotary unpermutation and the names, which did not change)."""
    import gguf

    from trioserve.engine.kernels import mxfp4

    out: dict[str, object] = {}
    for t in gguf.GGUFReader(str(path)).tensors:
        kind, data = t.tensor_type.name, np.asarray(t.data)
        rows = [(t.name, data)] if data.ndim <= 2 else [(f"{t.name}[{e}]", data[e]) for e in range(data.shape[0])]
        for name, part in rows:
            if kind in _REF:
                out[name] = _REF[kind](part)
            elif kind in ("Q5_1", "Q5_K"):
                out[name] = gguf_weights.requantize_int8(kind, part)
            elif kind == "MXFP4":
                out[name] = mxfp4.decode_gguf(part, t.name)
            else:
                out[name] = torch.from_numpy(np.array(part, dtype=np.float32))
    return out


def _bits(value: object) -> list[torch.Tensor]:
    """The tensors of a weight in any format, each as raw bytes."""
    if isinstance(value, torch.Tensor):
        parts = [value]
    else:
        parts = [getattr(value, n) for n in ("q", "scale", "zero") if hasattr(value, n)]
    return [p.contiguous().view(torch.uint8) if p.dtype != torch.uint8 else p for p in parts]


def _same(got: object, want: object) -> bool:
    # A Q6_K tensor comes as Q6KGroups: the same int8 groups, with the file's
    # rows kept beside them for the Q6_K lanes (engine/kernels/q6k_lanes.py).
    if not isinstance(got, type(want)) or getattr(got, "group_size", None) != getattr(want, "group_size", None):
        return False
    return all(a.shape == b.shape and torch.equal(a, b) for a, b in zip(_bits(got), _bits(want), strict=True))


def _blocks(kind: str, out: int, blocks: int, rng: np.random.Generator) -> np.ndarray:
    """Random bytes of ``kind``, their float16 scales finite (either sign,
    from subnormal to large): a file's every nibble and bit pattern."""
    import gguf

    _, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind]]
    data = rng.integers(0, 256, size=(out, blocks, size), dtype=np.uint8)
    for at in _HALVES[kind]:
        halves = (rng.choice([-1, 1], (out, blocks)) * 10.0 ** rng.uniform(-7, 4, (out, blocks))).astype(np.float16)
        data[..., at : at + 2] = halves.view(np.uint8).reshape(out, blocks, 2)
    return data.reshape(out, -1)


# -- the decoders --------------------------------------------------------------


@settings(max_examples=40, deadline=None)
@given(
    kind=st.sampled_from(sorted(_REF)),
    out=st.integers(1, 9),
    blocks=st.integers(1, 3),
    seed=st.integers(0, 2**32 - 1),
    chunk=st.sampled_from([1, 300, 1 << 20]),
)
def test_each_decoder_gives_the_replaced_ones_bits(kind, out, blocks, seed, chunk):
    data = _blocks(kind, out, blocks * (8 if kind.endswith("_K") else 1), np.random.default_rng(seed))
    want = _REF[kind](data)
    assert _same(_NEW[kind](data), want)
    # A chunk of one row, of a few, of all: the rows come out as decoded whole.
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf_weights, "_CHUNK_BYTES", chunk)
        assert _same(gguf_weights.by_rows(_NEW[kind], data), want)


# -- a file ----------------------------------------------------------------------

_HIDDEN, _KV, _FFN, _EXPERTS = 256, 128, 512, 2
# A layer of each type, as llama.cpp's mixes keep them (Q4_K_M's Q6_K
# attn_v and ffn_down, Q8_0's everything, the 5-bit types, MXFP4 experts).
_LAYERS = (
    {"attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q6_K", "attn_output": "Q4_K", "ffn_gate": "Q4_K", "ffn_up": "Q4_K", "ffn_down": "Q6_K"},
    {"attn_q": "Q4_0", "attn_k": "Q4_1", "attn_v": "Q8_0", "attn_output": "Q5_0", "ffn_gate": "Q5_1", "ffn_up": "Q5_K", "ffn_down": "Q8_0"},
)  # fmt: skip


def _shape(part: str) -> tuple[int, int]:
    return {
        "attn_q": (_HIDDEN, _HIDDEN), "attn_k": (_KV, _HIDDEN), "attn_v": (_KV, _HIDDEN), "attn_output": (_HIDDEN, _HIDDEN),
        "ffn_gate": (_FFN, _HIDDEN), "ffn_up": (_FFN, _HIDDEN), "ffn_down": (_HIDDEN, _FFN),
    }[part]  # fmt: skip


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> Path:
    """A small GGUF of every type the loader decodes, quantized by
    ``gguf_writer`` (gguf-py's quantizers and its K-quants; Q5_K, which
    neither writes, as random blocks), with keys of every value type."""
    import gguf

    rng = np.random.default_rng(7)
    path = tmp_path_factory.mktemp("speed-bits") / "mixed.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_head_count(2)
    writer.add_head_count_kv(1)
    writer.add_float32("llama.rope.freq_base", 10000.5)
    writer.add_bool("general.flag", True)
    writer.add_array("general.tags", ["a", "bé", ""])
    writer.add_array("general.numbers", [1, 2, 3])
    writer.add_token_list([f"t{i}" for i in range(50)])
    writer.add_token_scores([float(i) for i in range(50)])

    def add(name: str, kind: str, shape: tuple[int, ...]) -> None:
        values = (0.1 * rng.standard_normal(shape)).astype(np.float32)
        if kind == "F32":
            writer.add_tensor(name, values)
        elif kind == "Q5_K":
            writer.add_tensor(name, _blocks("Q5_K", shape[0], shape[1] // 256, rng), raw_dtype=gguf.GGMLQuantizationType.Q5_K)
        else:
            writer.add_tensor(name, gguf_writer.quantize(values, kind), raw_dtype=gguf.GGMLQuantizationType[kind])

    add("token_embd.weight", "Q6_K", (300, _HIDDEN))
    add("output_norm.weight", "F32", (_HIDDEN,))
    for i, kinds in enumerate(_LAYERS):
        add(f"blk.{i}.attn_norm.weight", "F32", (_HIDDEN,))
        for part, kind in kinds.items():
            add(f"blk.{i}.{part}.weight", kind, _shape(part))
    add("blk.1.ffn_gate_exps.weight", "MXFP4", (_EXPERTS, _FFN, _HIDDEN))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_the_header_reads_as_gguf_py_reads_it(written):
    import gguf

    reader = gguf.GGUFReader(str(written))
    every = GGUFFile(written, want_strings=lambda key: True)
    fields = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    assert every.fields == fields
    # Without asking, a string array is stepped over; the rest is read.
    light = GGUFFile(written)
    assert light.fields["tokenizer.ggml.tokens"] is None and light.fields["general.tags"] is None
    assert light.fields["tokenizer.ggml.scores"] == fields["tokenizer.ggml.scores"]
    assert [t.name for t in light.tensors] == [t.name for t in reader.tensors]
    for t in reader.tensors:
        info = next(i for i in light.tensors if i.name == t.name)
        data = light.data(info)
        assert info.type_name == t.tensor_type.name and data.dtype == t.data.dtype and data.shape == t.data.shape
        assert np.array_equal(data.view(np.uint8), np.asarray(t.data).view(np.uint8))


def test_every_tensor_decodes_to_the_replaced_readings_bits(written):
    want = _ref_read(written)
    got = {}
    file = GGUFFile(written)
    for info in file.tensors:
        data = file.data(info)
        parts = [(info.name, data)] if data.ndim <= 2 else [(f"{info.name}[{e}]", data[e]) for e in range(data.shape[0])]
        for name, part in parts:
            got[name] = gguf_weights._decoded(written, info.name, info.type_name, part)
    assert got.keys() == want.keys()
    assert [n for n in got if not _same(got[n], want[n])] == []
    # read_tensors yields them under the Hub's names, q and k put back in order.
    named = dict(gguf_weights.read_tensors(written, num_heads=2, num_kv_heads=1))
    q = gguf_weights._unpermute(want["blk.0.attn_q.weight"], 2)
    assert _same(named["model.layers.0.self_attn.q_proj.weight"], q)
    assert _same(named["model.layers.1.block_sparse_moe.experts.1.w1.weight"], want["blk.1.ffn_gate_exps.weight[1]"])


def test_wide_projections_round_into_groups_of_32_as_before(written):
    named = dict(gguf_weights.read_tensors(written, num_heads=2, num_kv_heads=1))
    for i in range(len(_LAYERS)):
        parts = [named[f"model.layers.{i}.self_attn.{p}_proj.weight"] for p in "qkv"]
        dense = [p if isinstance(p, torch.Tensor) else p.dequantize() for p in parts]
        parts.append(dense[0])  # a float matrix too
        want = [
            p if isinstance(p, Int8GroupWeight) and p.group_size == 32 else quantize_int8_groups(d, 32)
            for p, d in zip(parts, [*dense, dense[0]])
        ]
        old = Int8GroupWeight(torch.cat([w.q for w in want]), torch.cat([w.scale for w in want]), 32)
        assert _same(compressed._int8_groups(parts), old)
    table = named["model.embed_tokens.weight"]
    assert _same(compressed._in_native_groups(table), quantize_int8_groups(table.dequantize(), 32))
    assert _same(regroup_int8(table, 32, rows_at_once=7), quantize_int8_groups(table.dequantize(), 32))


# -- the cache -------------------------------------------------------------------


def _fake_child(flags: list[str]):
    def write(gguf_path: Path, out_dir: Path) -> None:
        flags.append("describe" if write.light else "convert")
        (out_dir / "config.json").write_text(json.dumps({"from": "describe" if write.light else "convert"}))
        (out_dir / "tokenizer.json").write_text("{}")
        if not write.light:
            (out_dir / gguf_cache.WEIGHTS_FILE).write_bytes(b"weights")

    return write


def test_a_compressed_load_caches_no_weights_and_a_float_one_adds_them(tmp_path, monkeypatch):
    source = tmp_path / "m.gguf"
    source.write_bytes(b"GGUF")
    calls: list[str] = []
    describe, convert = _fake_child(calls), _fake_child(calls)
    describe.light, convert.light = True, False
    monkeypatch.setattr(gguf_cache, "describe_gguf", describe)
    monkeypatch.setattr(gguf_cache, "convert_gguf", convert)
    cache = tmp_path / "cache"
    entry = gguf_cache.ensure_converted(source, cache, weights=False)
    assert calls == ["describe"] and not (entry / gguf_cache.WEIGHTS_FILE).exists()
    assert gguf_cache.ensure_converted(source, cache, weights=False) == entry and calls == ["describe"]
    # A float load adds the weights, with the config that comes with them.
    assert gguf_cache.ensure_converted(source, cache) == entry and calls == ["describe", "convert"]
    assert (entry / gguf_cache.WEIGHTS_FILE).read_bytes() == b"weights"
    assert json.loads((entry / "config.json").read_text()) == {"from": "convert"}
    assert gguf_cache.ensure_converted(source, cache) == entry and len(calls) == 2
    assert gguf_cache.ensure_converted(source, cache, weights=False) == entry and len(calls) == 2
    assert [p.name for p in cache.iterdir()] == [entry.name]  # no temporary folder left


class _Stop(Exception):
    pass


@pytest.mark.parametrize(("quantization", "weights"), [("auto", False), ("int8", False), ("none", True)])
def test_the_loader_asks_the_cache_for_weights_only_for_a_float_model(quantization, weights, monkeypatch):
    from trioserve.engine.loading import loader

    asked = []

    def ensure_converted(source, cache_dir=None, *, weights=True):
        asked.append(weights)
        raise _Stop

    monkeypatch.setattr(gguf_cache, "ensure_converted", ensure_converted)
    with pytest.raises(_Stop):
        loader.load_model(quantization=quantization, device="cpu", dtype="float32")
    assert asked == [weights]
