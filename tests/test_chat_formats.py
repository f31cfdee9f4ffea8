"""Reasoning parsers and each family's tool-call format (web/reasoning.py,
web/harmony.py, web/tool_format_*.py, web/parsers.py), on real chat
templates and tokenizers (tests/data/README.md): the template is chosen
from, renders tools, calls, results and ``enable_thinking``; text the
model writes parses into the right reasoning and calls, whole and however
it is cut into deltas (token by token with the real tokenizer where we
have it, so special tokens split as they do in serving)."""

from __future__ import annotations

import json
import lzma
import shutil
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trioserve.engine.text.chat_template import ChatTemplates
from trioserve.engine.text.fast_tokenizer import FastTokenizer
from trioserve.web.output_reader import ChatReading, StreamedChoice
from trioserve.web.parsers import OutputParsers, reasoning_parser_name, tool_call_parser_name
from trioserve.web.reasoning import prompt_opens_thinking
from trioserve.web.tools import tool_choice

DATA = Path(__file__).parent / "data"
TEMPLATES = DATA / "chat_templates"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"}},
            "required": ["city"],
        },
    },
}
HISTORY = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "abc123def", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}}
    ]},
    {"role": "tool", "tool_call_id": "abc123def", "content": "12C and rain"},
]  # fmt: skip


def template(name: str) -> str:
    return (TEMPLATES / f"{name}.jinja").read_text()


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    """The real Qwen3 and gpt-oss tokenizers, unpacked into folders."""
    out = {}
    for name, chat in (("qwen3", "qwen3"), ("gpt-oss", "gpt-oss")):
        folder = tmp_path_factory.mktemp(name)
        (folder / "tokenizer.json").write_bytes(lzma.decompress((DATA / "tokenizers" / f"{name}.tokenizer.json.xz").read_bytes()))
        shutil.copy(DATA / "tokenizers" / f"{name}.tokenizer_config.json", folder / "tokenizer_config.json")
        (folder / "chat_template.jinja").write_text(template(chat))
        out[name] = FastTokenizer.from_folder(folder)
    return out


# Each family: its template, the parsers its template picks, what its model
# writes (reasoning and a call), and what that reads as.
FAMILIES = {
    "qwen3": ("qwen3", "hermes",
              '<think>\nThe user wants Paris.\n</think>\n\nLet me check.\n<tool_call>\n'
              '{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>',
              "\nThe user wants Paris.\n", "Let me check."),
    "qwen3-coder": (None, "qwen3_coder",
                    "I will look it up.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
                    "<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>",
                    None, "I will look it up."),
    "gpt-oss": ("gpt_oss", "openai",
                "<|channel|>analysis<|message|>Need the weather tool.<|end|><|start|>assistant<|channel|>commentary "
                'to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris", "days": 2}<|call|>',
                "Need the weather tool.", None),
    "llama-3.1": (None, "llama3_json",
                  '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}<|eom_id|>',
                  None, None),
    "mistral-nemo": (None, "mistral",
                     'Checking.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}]</s>',
                     None, "Checking."),
    "deepseek-r1-distill-qwen": ("qwen3", "hermes", "The user wants Paris.\n</think>\n\nIt is 12C.", "The user wants Paris.\n", "It is 12C."),
}  # fmt: skip


def _reading(family: str, prompt: str = "") -> ChatReading:
    parsers = OutputParsers.for_template(template(family))
    tools = tool_choice({"tools": [WEATHER]})
    return ChatReading(parsers.reasoning, prompt_opens_thinking(prompt), tools, parsers.tools)


def _streamed(reading: ChatReading, pieces: list[str]) -> dict:
    """The message the openai client assembles from the stream's deltas."""
    choice = StreamedChoice(reading)
    reasoning, content, calls = "", "", {}
    for i, piece in enumerate([*pieces, ""]):
        read = choice.feed(piece, final=i == len(pieces))
        reasoning += read.reasoning
        content += read.piece.content
        for delta in read.piece.tool_calls:
            call = calls.setdefault(delta["index"], {"arguments": ""})
            if "id" in delta:
                call["name"] = delta["function"]["name"]
            call["arguments"] += delta["function"]["arguments"]
    return {"reasoning": reasoning or None, "content": content.strip() or None,
            "calls": [(c["name"], json.loads(c["arguments"])) for c in calls.values()]}  # fmt: skip


def _whole(reading: ChatReading, text: str) -> dict:
    message = reading.message(text)
    calls = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message.get("tool_calls", [])]
    return {"reasoning": message.get("reasoning_content"), "content": (message["content"] or "").strip() or None, "calls": calls}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_each_familys_template_picks_its_parsers(family):
    reasoning, tools, *_ = FAMILIES[family]
    assert reasoning_parser_name(template(family)) == reasoning
    assert tool_call_parser_name(template(family)) == tools
    assert reasoning_parser_name(template(family), "none") is None
    assert tool_call_parser_name(template(family), "mistral") == "mistral"


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_each_familys_template_renders_tools_calls_and_results(family):
    text = ChatTemplates().render(
        template(family), HISTORY, tools=[WEATHER], add_generation_prompt=True,
        variables={"bos_token": "<s>", "eos_token": "</s>"},
    )  # fmt: skip
    assert "get_weather" in text and "12C and rain" in text
    assert "Paris" in text.split("12C and rain")[0].split("Weather in Paris?")[1]  # the call, before its result


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_each_familys_output_reads_into_reasoning_and_calls(family):
    _, _, text, reasoning, content = FAMILIES[family]
    prompt = "<｜Assistant｜><think>\n" if family.startswith("deepseek") else ""
    reading = _reading(family, prompt)
    expected_calls = [] if family.startswith("deepseek") else [("get_weather", {"city": "Paris", "days": 2})]
    whole = _whole(reading, text)
    assert whole == {"reasoning": reasoning, "content": content, "calls": expected_calls}
    assert _streamed(reading, list(text)) == whole  # a character at a time


@settings(max_examples=40, deadline=None)
@given(family=st.sampled_from(sorted(FAMILIES)), cuts=st.lists(st.integers(1, 400), max_size=15))
def test_any_cut_of_the_text_streams_to_the_whole_bodys_reading(family, cuts):
    text = FAMILIES[family][2]
    reading = _reading(family, "<think>\n" if family.startswith("deepseek") else "")
    bounds = [0, *sorted({c for c in cuts if c < len(text)}), len(text)]
    assert _streamed(reading, [text[a:b] for a, b in zip(bounds, bounds[1:])]) == _whole(reading, text)


@pytest.mark.parametrize(("family", "tokenizer"), [("qwen3", "qwen3"), ("qwen3-coder", "qwen3"), ("gpt-oss", "gpt-oss")])
def test_token_by_token_with_the_real_tokenizer(tokenizers, family, tokenizer):
    tok = tokenizers[tokenizer]
    text = FAMILIES[family][2]
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text
    if family == "gpt-oss":  # the harmony markers are single special tokens, gone unless kept
        assert tok.encode("<|channel|>", add_special_tokens=False) == [tok.convert_tokens_to_ids("<|channel|>")]
        assert "<|channel|>" not in tok.decode(ids, skip_special_tokens=True)
    pieces, done = [], ""
    for i in range(1, len(ids) + 1):  # as the detokenizer sends them
        now = tok.decode(ids[:i])
        pieces.append(now[len(done) :])
        done = now
    reading = _reading(family)
    assert _streamed(reading, pieces) == _whole(reading, text)


def test_qwen3_enable_thinking_reaches_the_template_and_the_parser(tokenizers):
    tok = tokenizers["qwen3"]
    messages = [{"role": "user", "content": "Hi"}]
    thinking = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    off = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, enable_thinking=False)
    assert off.endswith("<think>\n\n</think>\n\n") and not thinking.endswith("</think>\n\n")
    assert not prompt_opens_thinking(off) and not prompt_opens_thinking(thinking)
    # With thinking off, the model writes no block: all is content.
    reading = _reading("qwen3", off)
    assert _whole(reading, "Hello!") == {"reasoning": None, "content": "Hello!", "calls": []}


def test_a_generation_that_starts_inside_the_think_block():
    def render(**variables):
        return ChatTemplates().render(template("deepseek-r1-distill-qwen"), [{"role": "user", "content": "Hi"}],
                                      add_generation_prompt=True, variables={"bos_token": "<s>", **variables})  # fmt: skip

    # llama.cpp's copy opens the block only with enable_thinking.
    assert not prompt_opens_thinking(render())
    prompt = render(enable_thinking=True)
    assert prompt_opens_thinking(prompt)
    reading = _reading("deepseek-r1-distill-qwen", prompt)
    assert _whole(reading, "Let me think") == {"reasoning": "Let me think", "content": None, "calls": []}
    assert _streamed(reading, ["Let me", " think"]) == _whole(reading, "Let me think")


def test_qwen3_coder_values_follow_the_schemas_types():
    reading = _reading("qwen3-coder")
    text = ("<tool_call>\n<function=get_weather>\n<parameter=city>\n42\n</parameter>\n<parameter=days>\n3\n</parameter>\n"
            "<parameter=metric>\nfalse\n</parameter>\n</function>\n</tool_call>")  # fmt: skip
    assert _whole(reading, text)["calls"] == [("get_weather", {"city": "42", "days": 3, "metric": False})]


def test_mistral_v11_calls_and_llama_plain_answers():
    reading = _reading("mistral-nemo")
    text = '[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}[TOOL_CALLS]get_weather[ARGS]{"city": "Rome"}'
    assert _whole(reading, text)["calls"] == [("get_weather", {"city": "Oslo"}), ("get_weather", {"city": "Rome"})]
    llama = _reading("llama-3.1")
    assert _whole(llama, "It is sunny.") == {"reasoning": None, "content": "It is sunny.", "calls": []}
    assert _streamed(llama, list("It is sunny.")) == _whole(llama, "It is sunny.")


def test_harmony_final_channel_is_content_and_analysis_reasoning():
    reading = _reading("gpt-oss")
    text = "<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final<|message|>Paris is sunny.<|return|>"
    assert _whole(reading, text) == {"reasoning": "Easy.", "content": "Paris is sunny.", "calls": []}
