"""Each family's real chat template and tokenizer (tests/data/README.md)
through trioserve's own text path, against transformers.

``FastTokenizer`` (engine/text/fast_tokenizer.py) renders chat templates in
its own sandbox and encodes without transformers' Python tokenizer classes.
A family whose prompt trioserve builds differently from transformers would
answer differently from the model's own reference, so for every family we
carry a template of (Qwen3, Gemma 2 and 3, Llama 3.1, SmolLM3, Phi-3.5,
Mistral Nemo, gpt-oss, DeepSeek-R1), the rendered text of plain, multi-turn,
tool-calling and thinking conversations equals transformers'
``apply_chat_template``, and, with the family's own tokenizer, so do the
token ids, and any text encodes and decodes as transformers' tokenizer does.
"""

from __future__ import annotations

import copy
import json
import lzma
import shutil
from pathlib import Path

import jinja2
import pytest
import transformers
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trioserve.engine.text.fast_tokenizer import FastTokenizer

DATA = Path(__file__).parent / "data"
TOKENIZERS = ("qwen3", "gemma3", "llama-3.1", "gpt-oss")

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}
PLAIN = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi there, who are you?"}]
TURNS = [
    {"role": "user", "content": "Name a prime."},
    {"role": "assistant", "content": "Seven."},
    {"role": "user", "content": "  Another one, with ünïcödé and 日本語?  "},
]
CALLS = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "abc123def", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}}
    ]},
    {"role": "tool", "tool_call_id": "abc123def", "name": "get_weather", "content": "12C and rain"},
]  # fmt: skip

# family: (template file, tokenizer it is paired with, its own tokenizer?,
# the conversations its template accepts, extra template variables to try).
# A template-only family borrows a tokenizer with the same special tokens
# where one exists; then only the text is compared, not the ids.
FAMILIES = {
    "qwen3": ("qwen3", "qwen3", True, ("plain", "turns", "calls"), ({}, {"enable_thinking": False})),
    "deepseek-r1": ("deepseek-r1-distill-qwen", "qwen3", False, ("plain", "turns"), ({},)),
    "gemma3": ("gemma3", "gemma3", True, ("plain", "turns"), ({},)),
    "gemma2": ("gemma2", "gemma3", False, ("turns",), ({},)),
    "llama-3.1": ("llama-3.1", "llama-3.1", True, ("plain", "turns", "calls"), ({},)),
    "smollm3": ("smollm3", "llama-3.1", False, ("plain", "turns", "calls"), ({}, {"enable_thinking": False})),
    "phi-3.5": ("phi-3.5", "llama-3.1", False, ("plain", "turns"), ({},)),
    "mistral-nemo": ("mistral-nemo", "llama-3.1", False, ("turns",), ({},)),
    "gpt-oss": ("gpt-oss", "gpt-oss", True, ("plain", "turns", "calls"), ({}, {"reasoning_effort": "high"})),
}
CONVERSATIONS = {"plain": (PLAIN, None), "turns": (TURNS, None), "calls": (CALLS, [WEATHER])}


def _unpack(folder: Path, tokenizer: str, template: str) -> Path:
    (folder / "tokenizer.json").write_bytes(lzma.decompress((DATA / "tokenizers" / f"{tokenizer}.tokenizer.json.xz").read_bytes()))
    shutil.copy(DATA / "tokenizers" / f"{tokenizer}.tokenizer_config.json", folder / "tokenizer_config.json")
    (folder / "chat_template.jinja").write_text((DATA / "chat_templates" / f"{template}.jinja").read_text())
    return folder


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    """family -> (trioserve's tokenizer, transformers' tokenizer), built
    once per template and tokenizer from the same folder."""
    out = {}
    for family, (template, tokenizer, *_rest) in FAMILIES.items():
        folder = _unpack(tmp_path_factory.mktemp(family), tokenizer, template)
        out[family] = (FastTokenizer.from_folder(folder), transformers.AutoTokenizer.from_pretrained(folder))
    return out


def _render(tokenizer, messages, tools, variables, tokenize):
    # Each side gets its own copy: a template may not mutate the caller's
    # messages, and neither renderer should see the other's changes.
    try:
        return tokenizer.apply_chat_template(
            copy.deepcopy(messages), tools=copy.deepcopy(tools), add_generation_prompt=True, tokenize=tokenize,
            return_dict=False, **variables,
        )
    except jinja2.TemplateError as exc:
        return ("raised", type(exc).__name__, str(exc))


CASES = [
    (family, conversation, json.dumps(variables))
    for family, (_t, _k, _own, conversations, variants) in FAMILIES.items()
    for conversation in conversations
    for variables in variants
]


@pytest.mark.parametrize(("family", "conversation", "variables"), CASES)
def test_rendered_prompt_equals_transformers(pairs, family, conversation, variables):
    ours, theirs = pairs[family]
    messages, tools = CONVERSATIONS[conversation]
    variables = json.loads(variables)
    text = _render(ours, messages, tools, variables, tokenize=False)
    assert isinstance(text, str), f"{family} {conversation}: trioserve's template raised {text}"
    assert text == _render(theirs, messages, tools, variables, tokenize=False)
    assert messages[-1]["content"].strip() in text
    if tools and "tools" in (DATA / "chat_templates" / f"{FAMILIES[family][0]}.jinja").read_text():
        assert "get_weather" in text  # SmolLM3's template takes its tools as xml_tools instead
    if FAMILIES[family][2]:
        ids = _render(ours, messages, tools, variables, tokenize=True)
        reference = _render(theirs, messages, tools, variables, tokenize=True)
        assert ids == list(reference)


def test_template_errors_stay_template_errors(pairs):
    # Gemma 2's template refuses a system turn; the refusal must reach the
    # caller as the template's own error (a 400 naming messages over HTTP).
    ours, theirs = pairs["gemma2"]
    ours_result = _render(ours, PLAIN, None, {}, tokenize=False)
    theirs_result = _render(theirs, PLAIN, None, {}, tokenize=False)
    assert ours_result[0] == theirs_result[0] == "raised"
    assert "System role not supported" in ours_result[2]


def test_thinking_switch_changes_the_prompt(pairs):
    # enable_thinking reaches the template (chat_template_kwargs over HTTP).
    for family in ("qwen3", "smollm3"):
        ours, _ = pairs[family]
        on = _render(ours, TURNS, None, {}, tokenize=False)
        off = _render(ours, TURNS, None, {"enable_thinking": False}, tokenize=False)
        assert on != off, family


TEXT = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=80) | st.sampled_from(
    ["  leading and trailing  ", "tabs\tand\nnewlines\r\n", "emoji 🦀🧪 and CJK 漢字", "<think>not special</think>", "x" * 300]
)


@pytest.mark.parametrize("name", TOKENIZERS)
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=TEXT)
def test_text_encodes_and_decodes_as_transformers(pairs, name, text):
    family = {"llama-3.1": "llama-3.1"}.get(name, name)
    ours, theirs = pairs[family]
    for special in (True, False):
        ids = ours.encode(text, add_special_tokens=special)
        assert ids == theirs.encode(text, add_special_tokens=special), (name, special)
    assert ours.decode(ids) == theirs.decode(ids)
    assert ours.decode(ids, skip_special_tokens=True) == theirs.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("name", TOKENIZERS)
def test_special_tokens_and_vocabulary_agree(pairs, name):
    ours, theirs = pairs[name]
    assert ours.vocab_size == len(theirs) or ours.get_vocab() == theirs.get_vocab()
    assert ours.convert_tokens_to_ids(theirs.eos_token) == theirs.eos_token_id
    assert set(ours.all_special_ids) == set(theirs.all_special_ids)
