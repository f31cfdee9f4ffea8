"""A GGUF's config and byte-level tokenizer read without transformers
(engine/loading/gguf_tokenizer.py, ``gguf_config.native_config``,
``gguf_cache.describe_here``) equal transformers' reading of the same file.

The tokenizers are real vocabularies (tests/data/tokenizers: Qwen3's,
Llama 3.1's, gpt-oss's o200k) written as llama.cpp writes a GGUF's
tokenizer keys, and the default model's own file; the configs are every
family trioserve describes, from the files ``testing/gguf_writer.py`` writes.
"""

from __future__ import annotations

import json
import lzma
from pathlib import Path

import attrs
import pytest
from test_gguf_families import _build
from test_moe_loading import _FOR_GGUF as _MOE_FOR_GGUF
from test_moe_loading import _build as _build_moe
from transformers import CONFIG_MAPPING

from trioserve.engine.errors import ModelLoadError
from trioserve.engine.loading import gguf_cache, gguf_config, gguf_tokenizer
from trioserve.engine.loading.gguf_file import GGUFFile
from trioserve.engine.loading.sources import default_model_path
from trioserve.engine.models.hf_fallback import resolve_model_config
from trioserve.engine.text.fast_tokenizer import FastTokenizer
from trioserve.testing.gguf_writer import write_gguf, write_tokenizer_gguf

DATA = Path(__file__).parent / "data"
# name -> (tokenizer.ggml.pre as llama.cpp names the vocabulary's split, the add_*_token flags written)
VOCABULARIES = {
    "qwen3": ("qwen2", {}),
    "llama-3.1": ("llama-bpe", {"add_bos_token": True, "add_eos_token": True}),
    "gpt-oss": ("gpt-4o", {"add_bos_token": False}),
}
# What transformers' saved tokenizer_config.json holds of its own loading.
_LOADING_KEYS = ("is_local", "local_files_only")


def _real_gguf(name: str, path: Path) -> Path:
    pre, flags = VOCABULARIES[name]
    tokenizer = json.loads(lzma.decompress((DATA / "tokenizers" / f"{name}.tokenizer.json.xz").read_bytes()))
    config = json.loads((DATA / "tokenizers" / f"{name}.tokenizer_config.json").read_text())
    template = config.get("chat_template") or (DATA / "chat_templates" / f"{name}.jinja").read_text()
    return write_tokenizer_gguf(tokenizer, config, path, pre=pre, chat_template=template, flags=flags)


@pytest.fixture(scope="module", params=[*VOCABULARIES, "default"])
def vocabulary(request, tmp_path_factory) -> tuple[Path, Path]:
    """A GGUF with a real byte-level vocabulary, and transformers' files of it."""
    root = tmp_path_factory.mktemp(request.param)
    path = default_model_path() if request.param == "default" else _real_gguf(request.param, root / "file.gguf")
    theirs = root / "transformers"
    theirs.mkdir()
    gguf_cache._write_tokenizer(path, theirs)
    return path, theirs


def test_the_tokenizer_is_transformers_but_for_its_gpt2_default(vocabulary):
    """tokenizer.json equal to transformers' but for one token: the GPT-2
    class's ``<|endoftext|>``, which transformers adds past a vocabulary
    that lacks it (Llama 3.1's) and gguf_tokenizer does not; the config
    equal but for transformers' record of its own loading."""
    path, theirs = vocabulary
    fields = GGUFFile(path, want_strings=gguf_tokenizer.wants_strings).fields
    assert gguf_tokenizer.reads(fields)
    text, config = gguf_tokenizer.tokenizer_files(fields)
    mine, reference = json.loads(text), json.loads((theirs / "tokenizer.json").read_text())
    vocab_size = len(fields["tokenizer.ggml.tokens"])
    extra = [t for t in reference["added_tokens"] if t["id"] >= vocab_size]
    assert all(t["content"] == "<|endoftext|>" for t in extra)
    reference["added_tokens"] = [t for t in reference["added_tokens"] if t["id"] < vocab_size]
    assert mine == reference
    reference_config = json.loads((theirs / "tokenizer_config.json").read_text())
    assert config == {k: v for k, v in reference_config.items() if k not in _LOADING_KEYS}


def test_a_described_entry_serves_the_same_tokens(vocabulary, tmp_path):
    """The cache entry describe_here writes, loaded as a server loads it,
    encodes, decodes and renders the chat template as transformers' files
    do (the extra token aside: never in this text)."""
    path, theirs = vocabulary
    assert gguf_cache.describe_here(path, tmp_path)
    ours, reference = FastTokenizer.from_folder(tmp_path), FastTokenizer.from_folder(theirs)
    text = "Hello wörld!  123 4567 <think>x</think>\n\n\tdon't 你好 🙂 <|im_end|><|eot_id|>"
    for special in (True, False):
        assert ours.encode(text, add_special_tokens=special) == reference.encode(text, add_special_tokens=special)
    ids = reference.encode(text)
    assert ours.decode(ids) == reference.decode(ids)
    assert ours.decode(ids, skip_special_tokens=True) == reference.decode(ids, skip_special_tokens=True)
    messages = [{"role": "user", "content": "Hi"}]
    assert ours.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == (
        reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    )
    for name in ("bos_token", "eos_token", "pad_token"):
        assert getattr(ours, name) == getattr(reference, name)


def test_the_split_patterns_and_byte_alphabet_are_transformers():
    """The tables gguf_tokenizer keeps are transformers' own: a split added
    or changed there shows here."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode
    from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_PRE_TOKENIZER_SPLITS

    assert gguf_tokenizer.PRE_TOKENIZER_SPLITS == GGUF_PRE_TOKENIZER_SPLITS
    assert gguf_tokenizer.byte_alphabet() == bytes_to_unicode()


def test_a_byte_level_file_is_described_without_the_converting_child(tmp_path, monkeypatch):
    """The default model's first start writes its cache entry in process:
    no child importing torch and transformers (5-8 CPU seconds)."""

    def no_child(*args: object) -> None:
        raise AssertionError("the converting child ran")

    monkeypatch.setattr(gguf_cache, "_run_child", no_child)
    folder = gguf_cache.ensure_converted(default_model_path(), tmp_path, weights=False)
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "tokenizer.json", "tokenizer_config.json"]


def _transformers_config(path: Path, tmp_path: Path) -> dict:
    out = tmp_path / "transformers"
    out.mkdir()
    gguf_cache.convert_here(path, out, weights=False)
    return json.loads((out / "config.json").read_text())


def _native_config(path: Path) -> dict:
    metadata, tables = gguf_config.read_metadata(path)
    assert gguf_config.describable(metadata)
    embedding = next(t for t in GGUFFile(path).tensors if t.name == "token_embd.weight")
    return gguf_config.native_config(metadata, tables, vocab_size=int(embedding.dims[-1]))


_LLAMA3 = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
           "high_freq_factor": 4.0, "original_max_position_embeddings": 32}  # fmt: skip


@pytest.mark.parametrize(("kind", "changes"), [("llama", {}), ("llama", {"rope_parameters": _LLAMA3}),
                                               ("qwen2", {}), ("qwen3", {})])  # fmt: skip
def test_a_dense_config_is_the_model_transformers_reads(tmp_path, kind, changes):
    """The dense families' config from the metadata gives the ModelConfig
    transformers' reading of the same file gives (which a weights
    conversion of the file writes later into the same entry)."""
    _build(kind, tmp_path / kind, **changes)
    path = write_gguf(tmp_path / kind, tmp_path / f"{kind}.gguf", "Q8_0")
    assert resolve_model_config(_native_config(path)) == resolve_model_config(_transformers_config(path, tmp_path))


@pytest.mark.parametrize("kind", ["qwen3-moe", "mixtral", "gpt-oss"])
def test_a_mixture_config_needs_no_round_trip_through_transformers(tmp_path, kind):
    """The mixtures' config as written (no transformers config class filling
    in its defaults) gives the ModelConfig the round trip gave."""
    extra = {"swiglu_limit": 7.0} if kind == "gpt-oss" else {}
    _build_moe(kind, tmp_path / kind, **_MOE_FOR_GGUF.get(kind, {}), **extra)
    path = write_gguf(tmp_path / kind, tmp_path / f"{kind}.gguf", "Q8_0", name=f"tiny-{kind}",
                      expert_qtype="MXFP4" if kind == "gpt-oss" else None)  # fmt: skip
    config = _native_config(path)
    round_trip = json.loads(CONFIG_MAPPING[config["model_type"]].from_dict(config).to_json_string(use_diff=False))
    mine, theirs = resolve_model_config(config), resolve_model_config(round_trip)
    assert mine == theirs, {k: v for k, v in attrs.asdict(mine).items() if v != attrs.asdict(theirs)[k]}


def test_what_transformers_reads_otherwise_is_left_to_it(tmp_path):
    """A Llama named exactly "mistral" (transformers reads it as a Mistral,
    with that class's sliding window) and the sentencepiece families are
    not described here."""
    _build("mistral", tmp_path / "mistral")
    path = write_gguf(tmp_path / "mistral", tmp_path / "mistral.gguf", "Q8_0", name="mistral")
    metadata, _ = gguf_config.read_metadata(path)
    assert not gguf_config.describable(metadata)
    assert not gguf_cache.describe_here(path, tmp_path)
    assert not any(tmp_path.glob("*.json"))
    for family in ("gemma3", "phi3"):
        assert not gguf_config.describable({"general.architecture": family})


def _rewritten(source: Path, path: Path, key: str, value: object) -> Path:
    """``source`` with one tokenizer key's value replaced."""
    import gguf

    reader = gguf.GGUFReader(str(source))
    writer = gguf.GGUFWriter(str(path), str(reader.fields["general.architecture"].contents()))
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        kind = field.types[0]
        sub_type = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, value if name == key else field.contents(), kind, sub_type=sub_type)
    for tensor in reader.tensors:
        writer.add_tensor(tensor.name, tensor.data, raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize(
    ("key", "value", "named"),
    [("tokenizer.ggml.merges", ["a b c"], "tokenizer.ggml.merges"),
     ("tokenizer.ggml.bos_token_id", 10**6, "tokenizer.ggml.bos_token_id")],
)  # fmt: skip
def test_a_broken_tokenizer_key_is_refused_naming_it(tmp_path, key, value, named):
    path = _rewritten(default_model_path(), tmp_path / "broken.gguf", key, value)
    with pytest.raises(ModelLoadError, match=named) as caught:
        gguf_cache.ensure_converted(path, tmp_path / "cache", weights=False)
    assert str(path) in str(caught.value)
    assert not any((tmp_path / "cache").glob("*/config.json"))
