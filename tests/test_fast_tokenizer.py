"""``FastTokenizer`` (engine/text/fast_tokenizer.py) against transformers'
``PreTrainedTokenizerFast``, which served before it: for the default
model's tokenizer and small ones built here (word-level, byte-level BPE with
special tokens the vocabulary lacks, a legacy ``special_tokens_map.json``,
several chat templates), the same backend, special tokens, ids, text, chat
renderings, xgrammar vocabulary and streamed text. And a serving engine on a
checkpoint with a ``tokenizer.json`` never imports transformers.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import jinja2
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_loader import make_checkpoint, write_tokenizer

from trioserve.engine.text.detokenizer import IncrementalDetokenizer
from trioserve.engine.text.fast_tokenizer import FastTokenizer
from trioserve.engine.sampling.grammar import _tokenizer_info
from trioserve.engine.text.tokenizer import load_tokenizer
from trioserve.testing.tiny_model import hf_tokenizer_folder
from trioserve.web.tools import CHATML_TOOLS_TEMPLATE

TEXTS = (
    "",
    "Hello, world!",
    "  leading and trailing spaces  ",
    "tabs\tand\nnew\r\nlines\n\n\n",
    "Ünïcödé: 世界, Привет, مرحبا, 😀👍🏽, e\u0301",
    "<|im_start|>user\nspecial tokens in text<|im_end|>",
    "<|endoftext|><|im_end|>x<|im_start|>",
    "don't stop , it 's fine . really ?",
    "code: def f(x):\n    return x ** 2  # ok",
    "\x00\x01 control \x7f chars",
)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather <now> & 'here'",
            "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "Zürich"}}},
        },
    }
]
CONVERSATIONS = (
    [{"role": "user", "content": "Hi there"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}],
    [
        {"role": "user", "content": "Tell me a joke"},
        {"role": "assistant", "content": "Why did the chicken... 🐔", "tool_calls": None},
        {"role": "user", "content": "Another, in 日本語"},
    ],
    [{"role": "user", "content": "weather?"}, {"role": "assistant", "content": None, "reasoning_content": "think"}],
)


# -- tokenizer folders ---------------------------------------------------------------


def _byte_level_backend():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator([" ".join(TEXTS) * 3, "hello world, the quick brown fox"], trainer)
    return tok


def _special_folder(folder: Path) -> None:
    """Byte-level BPE whose config names special tokens the vocabulary lacks,
    an added token with other flags than tokenizer.json's, a model-specific
    token, no post-processor, and several chat templates."""
    folder.mkdir()
    tok = _byte_level_backend()
    tok.add_tokens(["<tool>"])
    tok.post_processor = None
    tok.save(str(folder / "tokenizer.json"))
    tool_id = tok.token_to_id("<tool>")
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": {
            "0": {"content": "<|endoftext|>", "lstrip": False, "normalized": False, "rstrip": False, "single_word": False, "special": True},
            str(tool_id): {"content": "<tool>", "lstrip": True, "normalized": False, "rstrip": False, "single_word": False, "special": True},
        },
        "eos_token": "<|endoftext|>",
        "pad_token": "<pad>",
        "bos_token": "<s>",
        "image_token": "<image>",
        "extra_special_tokens": ["<extra_0>", "<extra_1>"],
        "clean_up_tokenization_spaces": True,  # BPE: transformers skips it
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "chat_template.jinja").write_text(
        "{% for m in messages %}{{ bos_token }}{{ m.role }}: {{ m.content }}{{ eos_token }}{% endfor %}"
        "{% if add_generation_prompt %}{{ bos_token }}assistant:{% endif %}"
    )
    (folder / "additional_chat_templates").mkdir()
    (folder / "additional_chat_templates" / "tool_use.jinja").write_text(
        "{{ image_token }}{% for t in tools %}{{ t | tojson(indent=2, sort_keys=True) }}{% endfor %}"
        "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    )


def _legacy_folder(folder: Path) -> None:
    """Word-level, clean-up on (not BPE: it applies), and special tokens in
    a legacy special_tokens_map.json (a config without added_tokens_decoder)."""
    folder.mkdir()
    write_tokenizer(folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    for key in ("added_tokens_decoder", "bos_token", "eos_token", "unk_token"):
        config.pop(key, None)
    config["clean_up_tokenization_spaces"] = True
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    special = {
        "bos_token": {"content": "<s>", "lstrip": False, "normalized": False, "rstrip": False, "single_word": False},
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "additional_special_tokens": ["<sep>"],
    }
    (folder / "special_tokens_map.json").write_text(json.dumps(special))


def _config_template_folder(folder: Path) -> None:
    """The default model's tokenizer as the GGUF cache writes it: the chat
    template inside tokenizer_config.json, no chat_template.jinja."""
    shutil.copytree(hf_tokenizer_folder(), folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = (folder / "chat_template.jinja").read_text()
    (folder / "chat_template.jinja").unlink()
    (folder / "tokenizer_config.json").write_text(json.dumps(config))


FOLDERS = {
    "default": lambda folder: shutil.copytree(hf_tokenizer_folder(), folder),
    "default-config-template": _config_template_folder,
    "word": lambda folder: (folder.mkdir(), write_tokenizer(folder)),
    "special": _special_folder,
    "legacy": _legacy_folder,
}


@pytest.fixture(scope="module", params=sorted(FOLDERS))
def pair(request, tmp_path_factory):
    """(ours, transformers') tokenizers of one folder."""
    from transformers import PreTrainedTokenizerFast

    folder = tmp_path_factory.mktemp("tok") / request.param
    FOLDERS[request.param](folder)
    theirs = PreTrainedTokenizerFast.from_pretrained(str(folder), local_files_only=True)
    theirs.encode("reset", add_special_tokens=False)  # its first call turns truncation and padding off
    return FastTokenizer.from_folder(folder), theirs


@pytest.fixture(scope="module")
def default_pair():
    from transformers import PreTrainedTokenizerFast

    return FastTokenizer.from_folder(hf_tokenizer_folder()), PreTrainedTokenizerFast.from_pretrained(
        str(hf_tokenizer_folder()), local_files_only=True
    )


# -- the same tokenizer --------------------------------------------------------------


def test_backend_and_special_tokens_are_transformers(pair):
    ours, theirs = pair
    assert json.loads(ours.backend_tokenizer.to_str()) == json.loads(theirs.backend_tokenizer.to_str())
    assert ours.special_tokens_map == theirs.special_tokens_map
    assert ours.all_special_tokens == theirs.all_special_tokens
    assert ours.all_special_ids == theirs.all_special_ids
    for name in ("bos_token", "eos_token", "unk_token", "pad_token"):
        assert (getattr(ours, name), getattr(ours, name + "_id")) == (getattr(theirs, name), getattr(theirs, name + "_id"))
    assert (ours.vocab_size, len(ours), ours.get_vocab()) == (theirs.vocab_size, len(theirs), theirs.get_vocab())
    assert ours.chat_template == theirs.chat_template
    ids = list(range(len(theirs)))
    assert ours.convert_ids_to_tokens(ids) == theirs.convert_ids_to_tokens(ids)
    assert ours.convert_ids_to_tokens(3) == theirs.convert_ids_to_tokens(3)
    tokens = [*theirs.convert_ids_to_tokens(ids[:50]), "surely-not-a-token"]
    assert ours.convert_tokens_to_ids(tokens) == theirs.convert_tokens_to_ids(tokens)


def test_encode_and_decode_are_transformers(pair):
    ours, theirs = pair
    for text in TEXTS:
        for special in (True, False):
            ids = theirs.encode(text, add_special_tokens=special)
            assert ours.encode(text, add_special_tokens=special) == ids, text
            assert ours(text, add_special_tokens=special) == {"input_ids": ids}
            for skip in (True, False):
                assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip)


def test_decoding_cleans_up_spaces_only_where_transformers_does(pair):
    ours, theirs = pair
    ids = ours.encode("hello , world .", add_special_tokens=False)
    assert ours.decode(ids) == theirs.decode(ids)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(st.characters(blacklist_categories=("Cs",)), max_size=60), data=st.data())
def test_unicode_encode_and_any_ids_decode_as_transformers(default_pair, text, data):
    ours, theirs = default_pair
    ids = theirs.encode(text, add_special_tokens=False)
    assert ours.encode(text, add_special_tokens=False) == ids
    assert ours.decode(ids) == theirs.decode(ids)
    noise = data.draw(st.lists(st.integers(0, len(theirs) - 1), max_size=12))
    for skip in (True, False):
        assert ours.decode(noise, skip_special_tokens=skip) == theirs.decode(noise, skip_special_tokens=skip)


# -- chat templates --------------------------------------------------------------------


def _both(ours, theirs, messages, **kwargs):
    """Rendered text and ids from both, or the exception type both raised."""
    results = []
    for tok in (ours, theirs):
        try:
            text = tok.apply_chat_template(messages, tokenize=False, **kwargs)
            ids = tok.apply_chat_template(messages, tokenize=True, return_dict=False, **kwargs)
            results.append((text, [int(i) for i in ids]))
        except (jinja2.TemplateError, ValueError) as exc:
            results.append(type(exc).__name__)
    return results


@pytest.mark.parametrize("generation_prompt", [True, False])
def test_chat_template_renders_as_transformers(pair, generation_prompt):
    ours, theirs = pair
    rendered = 0
    for messages in CONVERSATIONS:
        for tools in (None, TOOLS):
            mine, reference = _both(ours, theirs, messages, tools=tools, add_generation_prompt=generation_prompt)
            assert mine == reference, (messages, tools)
            rendered += not isinstance(mine, str)  # else both raised the same error
    assert rendered >= (6 if theirs.chat_template is not None else 0)


def test_tools_template_and_documents_render_as_transformers(default_pair):
    ours, theirs = default_pair
    messages = [{"role": "system", "content": "sys"}, *CONVERSATIONS[2]]
    calls = [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Zürich"}}}]
    messages.append({"role": "assistant", "content": "", "tool_calls": calls})
    messages.append({"role": "tool", "content": '{"t": 21}'})
    mine, reference = _both(ours, theirs, messages, tools=TOOLS, chat_template=CHATML_TOOLS_TEMPLATE, add_generation_prompt=True)
    assert mine == reference and "Zürich" in mine[0]
    documents = [{"title": "a <b>", "text": "ü"}]
    template = "{% for d in documents %}{{ d | tojson }}{% endfor %}{{ messages[0].content }}"
    mine, reference = _both(ours, theirs, messages, documents=documents, chat_template=template)
    assert mine == reference and '"a <b>"' in mine[0]


TEMPLATE_FEATURES = (
    # trim_blocks and lstrip_blocks
    "{% for m in messages %}\n    {% if m.role == 'user' %}\nU:{{ m.content }}\n    {% endif %}\n{% endfor %}",
    # loop controls, namespace, dict
    "{% set ns = namespace(n=0) %}{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}"
    "{% set ns.n = ns.n + 1 %}{% continue %}{% endfor %}{{ ns.n }}{{ dict(a=1, b=[2]) | tojson }}{{ dict.fromkeys(['x']) }}",
    # tojson's options, HTML characters and non-ASCII kept
    "{{ messages | tojson(indent=2, sort_keys=True) }}{{ {'k': '<&>'} | tojson(separators=(',', ':')) }}{{ 'é' | tojson(ensure_ascii=True) }}",
    # a generation block renders its body
    "{% for m in messages %}{% generation %}[{{ m.content }}]{% endgeneration %}{% endfor %}",
    # the date, in a format that does not change within a test
    "{{ strftime_now('%Y') }}|{{ bos_token }}|{{ eos_token }}",
    # raise_exception, and a namespace that refuses underscore names
    "{% if messages[0].role != 'system' %}{{ raise_exception('a system message must come first') }}{% endif %}",
    "{% set ns = namespace(_x=1) %}",
    "{{ unclosed",
)


@pytest.mark.parametrize("template", TEMPLATE_FEATURES)
def test_template_environment_is_transformers(default_pair, template):
    ours, theirs = default_pair
    messages = CONVERSATIONS[2]
    results = []
    for tok in (ours, theirs):
        try:
            results.append(tok.apply_chat_template(messages, chat_template=template, tokenize=False))
        except jinja2.TemplateError as exc:
            results.append((type(exc).__name__, str(exc) if "raise_exception" in template else ""))
    assert results[0] == results[1]


def test_template_choice_among_several(pair):
    ours, theirs = pair
    for tools in (None, TOOLS):
        assert ours.get_chat_template(None, tools) == theirs.get_chat_template(None, tools)
    if isinstance(theirs.chat_template, dict):
        assert ours.get_chat_template("tool_use") == theirs.get_chat_template("tool_use")


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    system=st.none() | st.text(max_size=30),
    turns=st.lists(st.text(st.characters(blacklist_categories=("Cs",)), max_size=40), min_size=1, max_size=4),
    generation_prompt=st.booleans(),
)
def test_unicode_conversations_render_as_transformers(default_pair, system, turns, generation_prompt):
    ours, theirs = default_pair
    messages = [{"role": "system", "content": system}] if system is not None else []
    messages += [{"role": ("user", "assistant")[i % 2], "content": text} for i, text in enumerate(turns)]
    mine, reference = _both(ours, theirs, messages, add_generation_prompt=generation_prompt)
    assert mine == reference


# -- what the engine builds on it -------------------------------------------------------


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=50), data=st.data())
def test_incremental_detokenization_is_unchanged(default_pair, text, data):
    ours, theirs = default_pair
    ids = theirs.encode(text, add_special_tokens=False) + [theirs.eos_token_id] + theirs.encode("ok", add_special_tokens=False)
    stop = data.draw(st.sampled_from(["", text[-2:], "ok"]))
    skip = data.draw(st.booleans())
    prompt = theirs.encode("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
    streams = []
    for tok in (ours, theirs):
        detok = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip, stop=[stop] if stop else [])
        deltas = []
        for token in ids:
            if detok.finished:
                break
            deltas.append(detok.add_tokens([token]))
        streams.append((deltas, detok.finish(), detok.stop_str))
    assert streams[0] == streams[1]


@pytest.mark.parametrize("folder", ["default", "word"])
def test_xgrammar_sees_the_vocabulary_transformers_gives_it(folder, tmp_path):
    import xgrammar
    from transformers import PreTrainedTokenizerFast

    FOLDERS[folder](tmp_path / folder)
    ours = FastTokenizer.from_folder(tmp_path / folder)
    theirs = PreTrainedTokenizerFast.from_pretrained(str(tmp_path / folder), local_files_only=True)
    vocab_size = len(theirs) + 7  # a model's logits are often wider than its vocabulary
    mine = _tokenizer_info(xgrammar, ours, vocab_size, (theirs.eos_token_id,))
    reference = xgrammar.TokenizerInfo.from_huggingface(theirs, vocab_size=vocab_size, stop_token_ids=[theirs.eos_token_id])
    for field in ("vocab_type", "vocab_size", "add_prefix_space", "stop_token_ids", "special_token_ids", "decoded_vocab"):
        assert getattr(mine, field) == getattr(reference, field), field
    with pytest.raises(ValueError, match="stop_token_ids"):
        _tokenizer_info(xgrammar, ours, vocab_size, ())


def test_saved_tokenizer_loads_back_the_same_in_both(pair, tmp_path):
    from transformers import PreTrainedTokenizerFast

    ours, _ = pair
    ours.save_pretrained(tmp_path / "saved")
    again = FastTokenizer.from_folder(tmp_path / "saved")
    theirs = PreTrainedTokenizerFast.from_pretrained(str(tmp_path / "saved"), local_files_only=True)
    for tok in (again, theirs):
        assert (tok.special_tokens_map, tok.chat_template) == (ours.special_tokens_map, ours.chat_template)
        assert [tok.encode(t) for t in TEXTS] == [ours.encode(t) for t in TEXTS]


def test_load_tokenizer_picks_the_fast_class_and_falls_back_to_transformers(tmp_path):
    from transformers import PreTrainedTokenizerBase

    write_tokenizer(tmp_path / "fast")
    assert isinstance(load_tokenizer(tmp_path / "fast"), FastTokenizer)
    # Without tokenizer.json (the slow GPT-2 files only), transformers loads it.
    slow = tmp_path / "slow"
    slow.mkdir()
    backend = _byte_level_backend()
    model = json.loads(backend.to_str())["model"]
    (slow / "vocab.json").write_text(json.dumps(model["vocab"]))
    (slow / "merges.txt").write_text("#version: 0.2\n" + "\n".join(" ".join(m) for m in model["merges"]) + "\n")
    (slow / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "GPT2Tokenizer", "eos_token": "<|endoftext|>"}))
    fallback = load_tokenizer(slow)
    assert isinstance(fallback, PreTrainedTokenizerBase)
    assert fallback.decode(fallback.encode("hello world")) == "hello world"


SERVE_WITHOUT_TRANSFORMERS = textwrap.dedent(
    """
    import json, sys
    from trioserve.engine.config import EngineConfig
    from trioserve.engine.core.engine_core import EngineCore
    from trioserve.engine.loading.loader import load_model
    from trioserve.engine.sampling.sampling_params import SamplingParams
    from trioserve.engine.text.tokenizer import apply_chat_template

    loaded = load_model(sys.argv[1])
    core = EngineCore(loaded, EngineConfig(max_model_len=64, max_num_seqs=2, warm_up=False, kv_cache_memory=8 << 20))
    chat = apply_chat_template(loaded.tokenizer, [{"role": "user", "content": "hello world"}])
    core.add_request("r", chat, SamplingParams(temperature=0.0, max_tokens=4))
    text = ""
    while core.has_unfinished():
        text += "".join(out.text_delta for out in core.step())
    print(json.dumps({"tokenizer": type(loaded.tokenizer).__name__, "chat": chat,
                      "transformers": sorted(m for m in sys.modules if m.split(".")[0] == "transformers")}))
    """
)


def test_serving_a_checkpoint_with_tokenizer_json_never_imports_transformers(tmp_path):
    folder = tmp_path / "tiny-llama"
    make_checkpoint(folder)
    out = subprocess.run(
        [sys.executable, "-c", SERVE_WITHOUT_TRANSFORMERS, str(folder)], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.splitlines()[-1])
    assert result == {"tokenizer": "FastTokenizer", "chat": [4, 8, 6, 7, 5, 8], "transformers": []}
