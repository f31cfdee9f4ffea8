"""``gguf_header_reader``: the fields gguf-py's ``GGUFReader`` gives, part
for part, outside the vocabulary, and the config transformers'
``load_gguf_checkpoint`` makes of them, equal to the one it makes through
``GGUFReader``, for files of any keys and value types."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

from trioserve.engine.loading import gguf_header_reader
from trioserve.engine.loading.gguf_header_reader import HeaderReader, config_from_header

T = gguf.GGUFValueType
_INTS = {T.UINT8: (0, 255), T.INT8: (-128, 127), T.UINT16: (0, 65535), T.INT16: (-32768, 32767),
         T.UINT32: (0, 2**32 - 1), T.INT32: (-(2**31), 2**31 - 1), T.UINT64: (0, 2**64 - 1), T.INT64: (-(2**63), 2**63 - 1)}  # fmt: skip
_TEXT = st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=12)


@st.composite
def values(draw: st.DrawFn, *, arrays: bool = True) -> tuple[object, T, T | None]:
    """A value, its GGUF type and an array's item type."""
    kind = draw(st.sampled_from([*_INTS, T.FLOAT32, T.FLOAT64, T.BOOL, T.STRING] + ([T.ARRAY] if arrays else [])))
    if kind in _INTS:
        return draw(st.integers(*_INTS[kind])), kind, None
    if kind in (T.FLOAT32, T.FLOAT64):
        value = draw(st.floats(width=32 if kind == T.FLOAT32 else 64, allow_nan=False))
        return value, kind, None
    if kind == T.BOOL:
        return draw(st.booleans()), kind, None
    if kind == T.STRING:
        return draw(_TEXT), kind, None
    _, item, _ = draw(values(arrays=False))
    items = draw(st.lists(values(arrays=False).filter(lambda v: v[1] == item), min_size=1, max_size=4))
    return [v for v, _, _ in items], kind, item


def _write(path: Path, keys: dict[str, tuple[object, T, T | None]], vocabulary: int, vocab_size: bool) -> Path:
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(2)
    writer.add_embedding_length(64)
    writer.add_head_count(4)
    if vocab_size:
        writer.add_vocab_size(vocabulary)
    for key, (value, kind, item) in keys.items():
        writer.add_key_value(key, value, kind, sub_type=item)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([f"t{i}" for i in range(vocabulary)])
    writer.add_token_types([1] * vocabulary)
    writer.add_token_merges(["t 1", "t 2"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_tensor("token_embd.weight", np.zeros((vocabulary, 64), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _plain(part: object) -> list:
    return np.asarray(list(part) if isinstance(part, bytes) else part).tolist()


_KEYS = st.dictionaries(st.from_regex(r"llama\.x_[a-z]{1,8}", fullmatch=True), values(), max_size=6)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(keys=_KEYS, vocabulary=st.integers(3, 40), vocab_size=st.booleans())
def test_the_fields_and_config_are_gguf_readers(tmp_path: Path, keys: dict, vocabulary: int, vocab_size: bool) -> None:
    path = _write(tmp_path / "model.gguf", keys, vocabulary, vocab_size)
    reader, header = gguf.GGUFReader(str(path)), HeaderReader(path)
    assert list(header.fields) == list(reader.fields)
    for name, field in reader.fields.items():
        mine = header.fields[name]
        if name.startswith("tokenizer.") and field.types[0] == T.ARRAY:
            continue  # emptied (the tokens' count below)
        assert [int(t) for t in mine.types] == [int(t) for t in field.types], name
        assert mine.data == list(field.data), name
        assert [_plain(p) for p in mine.parts] == [_plain(p) for p in field.parts], name
    assert [t.name for t in header.tensors] == [t.name for t in reader.tensors]
    expected, original = load_gguf_checkpoint(str(path), return_tensors=False)["config"], gguf.GGUFReader
    with config_from_header(path):
        assert load_gguf_checkpoint(str(path), return_tensors=False)["config"] == expected
    assert gguf.GGUFReader is original


def test_an_array_of_arrays_is_left_to_gguf_reader(tmp_path: Path) -> None:
    path = tmp_path / "nested.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_key_value("llama.x_nested", [[1, 2], [3]], T.ARRAY, sub_type=T.ARRAY)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    with pytest.raises(gguf_header_reader.Unsupported, match="llama.x_nested"):
        HeaderReader(path)
    original = gguf.GGUFReader
    with config_from_header(path):
        assert gguf.GGUFReader is original
