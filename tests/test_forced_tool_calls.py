"""``tool_choice`` ``required`` and a named function, forced in each
family's own syntax (web/tools.py's ``ToolChoice.forced``), and structured
output held back until the reasoning ends (web/structured.py's
``chat_constraint``).

On the real Qwen3, gpt-oss and Llama 3.1 vocabularies (tests/data), what those
models write is a path through the forced grammar, token by token, and
reads back as the call; a wrong function is refused. On a real server
with the tiny model, told each family's parser, every forced output is a
valid call in that syntax that comes back as ``tool_calls``, whole and
streamed.
"""

from __future__ import annotations

import json
import lzma
import shutil
from pathlib import Path

import openai
import pytest
import xgrammar
from jsonschema import validate

from server_fixtures import MODEL, serving
from trioserve import testing
from trioserve.engine.sampling.grammar import GrammarCompiler
from trioserve.engine.text.fast_tokenizer import FastTokenizer
from trioserve.web.output_reader import ChatReading
from trioserve.web.parsers import REASONING_PARSERS, TOOL_CALL_PARSERS
from trioserve.web.app import create_app
from trioserve.web.settings import ServerConfig
from trioserve.web.structured import ModelTokens, chat_constraint
from trioserve.web.tools import tool_choice

DATA = Path(__file__).parent / "data"
PARAMETERS = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Oslo"]}, "metric": {"type": "boolean"}},
    "required": ["city", "metric"],
    "additionalProperties": False,
}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": PARAMETERS}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"]}}}  # fmt: skip
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    out = {}
    for name in ("qwen3", "gpt-oss", "llama-3.1"):
        folder = tmp_path_factory.mktemp(name)
        (folder / "tokenizer.json").write_bytes(lzma.decompress((DATA / "tokenizers" / f"{name}.tokenizer.json.xz").read_bytes()))
        shutil.copy(DATA / "tokenizers" / f"{name}.tokenizer_config.json", folder / "tokenizer_config.json")
        shutil.copy(DATA / "chat_templates" / f"{name}.jinja", folder / "chat_template.jinja")
        out[name] = FastTokenizer.from_folder(folder)
    out["smollm2"] = testing.tiny_loaded().tokenizer
    return out


def _tools(choice, **body):
    return tool_choice({"tools": [WEATHER, TIME], "tool_choice": choice, **body})


# What each family's model writes for get_weather(city="Paris", metric=true),
# on a vocabulary that has its markers (Mistral's is not in tests/data:
# its markers are written as text on the default model's).
WRITTEN = {
    "hermes": ("qwen3", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "metric": true}}\n</tool_call>'),
    "qwen3_coder": ("qwen3", "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
                             "<parameter=metric>\ntrue\n</parameter>\n</function>\n</tool_call>"),
    "openai": ("gpt-oss", '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>'
                          '{"city": "Paris", "metric": true}'),
    "llama3_json": ("llama-3.1", '{"name": "get_weather", "parameters": {"city": "Paris", "metric": true}}'),
    "mistral": ("smollm2", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "metric": true}}]'),
}  # fmt: skip


def _matcher(tok, constraint):
    vocab = max(tok.get_vocab().values()) + 1
    stop = tok.encode("<|call|>" if "<|call|>" in tok.get_vocab() else tok.eos_token, add_special_tokens=False)
    return xgrammar.GrammarMatcher(GrammarCompiler(tok, vocab, tuple(stop)).compile(constraint)), stop[0]


@pytest.mark.parametrize("family", sorted(WRITTEN))
@pytest.mark.parametrize("choice", ["required", NAMED])
def test_what_each_family_writes_is_a_path_through_its_forced_grammar(tokenizers, family, choice):
    vocabulary, text = WRITTEN[family]
    tok, tools = tokenizers[vocabulary], _tools(choice)
    model_format = TOOL_CALL_PARSERS[family]
    constraint = chat_constraint(None, tools=tools, tool_format=model_format, reasoning=None, prompt="", tokens=ModelTokens(tok))
    assert constraint.kind == "structural_tag" and constraint.starts_after == ()
    matcher, stop = _matcher(tok, constraint)
    ids = tok.encode(text, add_special_tokens=False)
    assert all(matcher.accept_token(i) for i in ids), family
    assert matcher.accept_token(stop) and matcher.is_terminated()
    message = ChatReading(None, False, tools, model_format).message(tok.decode(ids))
    (call,) = message["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris", "metric": True}
    # Another function, or arguments off the schema, are not a path.
    matcher.reset()
    wrong = text.replace("get_weather", "get_time") if isinstance(choice, dict) else text.replace("Paris", "Rome")
    assert not all(matcher.accept_token(i) for i in tok.encode(wrong, add_special_tokens=False))


def test_markers_are_the_vocabularys_own_tokens(tokenizers):
    qwen = tokenizers["qwen3"]
    spec = _tools("required").forced(TOOL_CALL_PARSERS["hermes"], ModelTokens(qwen).mark).spec
    for marker in ("<tool_call>", "</tool_call>"):
        assert json.dumps({"type": "token", "token": qwen.convert_tokens_to_ids(marker)}) in spec
    assert "<tool_call>" not in spec
    assert ModelTokens(tokenizers["smollm2"]).mark("<tool_call>") == {"type": "const_string", "value": "<tool_call>"}


def test_the_constraint_starts_after_the_reasoning_unless_the_prompt_closed_it(tokenizers):
    qwen, oss = ModelTokens(tokenizers["qwen3"]), ModelTokens(tokenizers["gpt-oss"])
    answer = _tools("auto").constraint()  # None: auto constrains nothing
    assert answer is None
    schema = tool_choice({"tools": [WEATHER], "tool_choice": NAMED}).constraint()
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    thinking = qwen.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    off = qwen.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, enable_thinking=False)
    qwen3 = REASONING_PARSERS["qwen3"]
    gated = chat_constraint(schema, tools=None, tool_format=None, reasoning=qwen3, prompt=thinking, tokens=qwen)
    assert gated.starts_after == (qwen.tokenizer.convert_tokens_to_ids("</think>"),) and gated.key == schema.key
    assert chat_constraint(schema, tools=None, tool_format=None, reasoning=qwen3, prompt=off, tokens=qwen) == schema
    assert chat_constraint(schema, tools=None, tool_format=None, reasoning=None, prompt=thinking, tokens=qwen) == schema
    # gpt-oss: an answer after the final channel opens; a forced call after the analysis ends.
    harmony, oss_format = REASONING_PARSERS["gpt_oss"], TOOL_CALL_PARSERS["openai"]
    prompt = oss.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert prompt.endswith("<|start|>assistant")
    answer = chat_constraint(schema, tools=None, tool_format=None, reasoning=harmony, prompt=prompt, tokens=oss)
    assert answer.starts_after == tuple(oss.ids("<|channel|>final<|message|>"))
    call = chat_constraint(None, tools=_tools("required"), tool_format=oss_format, reasoning=harmony,
                           prompt=prompt, tokens=oss)  # fmt: skip
    assert call.starts_after == tuple(oss.ids("<|end|>"))
    matcher, stop = _matcher(oss.tokenizer, call)
    after = "<|start|>assistant" + WRITTEN["openai"][1]
    assert all(matcher.accept_token(i) for i in oss.ids(after)) and matcher.accept_token(stop)


def _app(family):
    engine = testing.engine_config(max_model_len=512, max_num_batched_tokens=512)
    config = ServerConfig(engine=engine, shutdown_timeout=5.0, tool_call_parser=family, reasoning_parser="none")
    return create_app(config, loaded=testing.tiny_loaded())


@pytest.mark.parametrize("family", sorted(TOOL_CALL_PARSERS))
async def test_forced_calls_in_each_familys_syntax_come_back_as_tool_calls(family):
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    async with serving(_app(family)) as server:
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0) as client:
            for choice in ("required", NAMED):
                request = dict(model=MODEL, messages=messages, tools=[WEATHER, TIME], tool_choice=choice,
                               max_tokens=120, temperature=0, parallel_tool_calls=False)  # fmt: skip
                completion = await client.chat.completions.create(**request)
                (result,) = completion.choices
                assert result.finish_reason == "tool_calls", (family, result.message.content)
                (call,) = result.message.tool_calls
                assert call.function.name in ({"get_weather", "get_time"} if choice == "required" else {"get_weather"})
                schema = (WEATHER if call.function.name == "get_weather" else TIME)["function"]["parameters"]
                validate(json.loads(call.function.arguments), schema)

                stream = await client.chat.completions.create(**request, stream=True)
                deltas, finish = [], None
                async for chunk in stream:
                    for c in chunk.choices:
                        deltas += c.delta.tool_calls or []
                        finish = c.finish_reason or finish
                assert finish == "tool_calls" and deltas[0].function.name == call.function.name
                arguments = "".join(d.function.arguments or "" for d in deltas)
                assert json.loads(arguments) == json.loads(call.function.arguments)
