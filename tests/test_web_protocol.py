"""Request parsing, error JSON and response shapes of the OpenAI-compatible API.

Response shapes are checked the way the openai client reads them: bodies
through the pydantic models, and streams through a real ``openai.OpenAI``
client whose HTTP transport answers with our SSE bytes.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from trioserve.actors.errors import (
    DuplicateRequestError,
    EngineClosed,
    EngineOverloaded,
    ExpensiveRequestRefused,
    QueueTimeout,
    RequestShed,
)
from trioserve.engine.errors import InvalidRequestError, RequestTooLongError
from trioserve.engine.core.outputs import RequestOutput, RequestTimes
from trioserve.engine.sampling.sampler import TokenLogprobs
from trioserve.engine.core.sequence import FinishReason
from trioserve.web import errors
from trioserve.web.errors import ApiError
from trioserve.web.chat_messages import ChatMessage
from trioserve.web.json_body import parse_json_body
from trioserve.web.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from trioserve.web.timeouts import effective_timeout, parse_timeout_header
from trioserve.web.completion_bodies import ChatCompletionStream, CompletionStream, OutputAccumulator
from trioserve.web.logprobs import TokenTexts
from trioserve.web.sse import SSE_DONE, sse_error, sse_event, sse_events

# -- requests: bad values ----------------------------------------------------

BAD_SAMPLING = [
    ("n", 0),
    ("n", -1),
    ("n", "2"),
    ("n", 1.5),
    ("n", True),
    ("n", 129),
    ("temperature", -0.1),
    ("temperature", "hot"),
    ("temperature", True),
    ("temperature", float("inf")),
    ("top_p", 0),
    ("top_p", 1.5),
    ("top_p", [1]),
    ("top_k", -2),
    ("top_k", 2.5),
    ("min_p", -0.1),
    ("min_p", 1.1),
    ("presence_penalty", 2.5),
    ("presence_penalty", -3),
    ("frequency_penalty", 3),
    ("frequency_penalty", "0"),
    ("repetition_penalty", 0),
    ("repetition_penalty", -1),
    ("seed", "x"),
    ("seed", 1.5),
    ("min_tokens", -1),
    ("min_tokens", "1"),
    ("stop", ""),
    ("stop", [""]),
    ("stop", 3),
    ("stop", ["a", 1]),
    ("stop_token_ids", [-1]),
    ("stop_token_ids", "x"),
    ("stop_token_ids", [1.5]),
    ("include_stop_str_in_output", "yes"),
    ("ignore_eos", 1),
    ("skip_special_tokens", "no"),
    ("logit_bias", {"x": 1}),
    ("logit_bias", {"-1": 1}),
    ("logit_bias", {"5": 200}),
    ("logit_bias", {"5": True}),
    ("logit_bias", [1, 2]),
    ("priority", "high"),
    ("priority", 1.5),
    ("timeout", 0),
    ("timeout", -1),
    ("timeout", "5"),
    ("stream", "true"),
    ("model", 5),
]


def completion_body(**fields):
    return {"model": "m", "prompt": "hello", **fields}


def chat_body(**fields):
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}


def assert_bad(parse, body, param):
    with pytest.raises(ApiError) as info:
        parse(body)
    error = info.value
    assert error.status == 400
    assert error.type == "invalid_request_error"
    assert error.param == param
    assert param.split("[")[0].split(".")[0] in error.message
    assert error.to_json() == {"error": {"message": error.message, "type": "invalid_request_error", "param": param, "code": None}}


@pytest.mark.parametrize(("field", "value"), BAD_SAMPLING)
def test_completion_rejects_bad_sampling_field(field, value):
    assert_bad(CompletionRequest.from_json, completion_body(**{field: value}), field)


@pytest.mark.parametrize(("field", "value"), BAD_SAMPLING)
def test_chat_rejects_bad_sampling_field(field, value):
    assert_bad(ChatCompletionRequest.from_json, chat_body(**{field: value}), field)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_tokens", 0),
        ("max_tokens", "10"),
        ("max_tokens", 1.5),
        ("logprobs", -1),
        ("logprobs", 21),
        ("logprobs", True),
        ("logprobs", "1"),
        ("best_of", 2),
        ("suffix", "tail"),
    ],
)
def test_completion_rejects_bad_field(field, value):
    assert_bad(CompletionRequest.from_json, completion_body(**{field: value}), field)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_tokens", 0),
        ("max_completion_tokens", 0),
        ("max_completion_tokens", "8"),
        ("logprobs", 1),
        ("logprobs", "true"),
        ("tools", {"type": "function", "function": {"name": "f"}}),
        ("tool_choice", "required"),
        ("response_format", "text"),
    ],
)
def test_chat_rejects_bad_field(field, value):
    assert_bad(ChatCompletionRequest.from_json, chat_body(**{field: value}), field)


def test_chat_top_logprobs_range_and_dependency():
    assert_bad(ChatCompletionRequest.from_json, chat_body(logprobs=True, top_logprobs=21), "top_logprobs")
    assert_bad(ChatCompletionRequest.from_json, chat_body(logprobs=True, top_logprobs=-1), "top_logprobs")
    assert_bad(ChatCompletionRequest.from_json, chat_body(top_logprobs=2), "top_logprobs")


def test_sampling_params_errors_become_api_errors():
    # min_tokens > max_tokens is only checked by SamplingParams itself.
    assert_bad(CompletionRequest.from_json, completion_body(max_tokens=4, min_tokens=5), "min_tokens")


@pytest.mark.parametrize(
    "prompt", [None, "", [], ["a", ""], [1, "a"], 5, [[1, 2], []], [True], [-1], [[]], {"text": "a"}]
)
def test_completion_rejects_bad_prompt(prompt):
    body = completion_body(prompt=prompt)
    assert_bad(CompletionRequest.from_json, body, "prompt")


def test_stream_options():
    assert_bad(CompletionRequest.from_json, completion_body(stream_options={"include_usage": True}), "stream_options")
    assert_bad(CompletionRequest.from_json, completion_body(stream=True, stream_options=[1]), "stream_options")
    assert_bad(
        CompletionRequest.from_json,
        completion_body(stream=True, stream_options={"include_usage": "y"}),
        "stream_options.include_usage",
    )
    request = ChatCompletionRequest.from_json(chat_body(stream=True, stream_options={"include_usage": True}))
    assert request.stream and request.include_usage
    assert not ChatCompletionRequest.from_json(chat_body(stream=True, stream_options={})).include_usage


@pytest.mark.parametrize(
    ("messages", "param"),
    [
        (None, "messages"),
        ([], "messages"),
        ("hi", "messages"),
        (["hi"], "messages[0]"),
        ([{"role": "bot", "content": "x"}], "messages[0].role"),
        ([{"role": "tool", "content": "x"}], "messages[0].tool_call_id"),
        ([{"content": "x"}], "messages[0].role"),
        ([{"role": "user", "content": 5}], "messages[0].content"),
        ([{"role": "user", "content": None}], "messages[0].content"),
        ([{"role": "user", "content": "a"}, {"role": "user", "content": [{"type": "image_url"}]}], "messages[1].content"),
        ([{"role": "user", "content": [{"type": "text", "text": 3}]}], "messages[0].content"),
    ],
)
def test_chat_rejects_bad_messages(messages, param):
    assert_bad(ChatCompletionRequest.from_json, chat_body(messages=messages), param)


@pytest.mark.parametrize("body", [[], "x", 3, None])
def test_body_must_be_an_object(body):
    for parse in (CompletionRequest.from_json, ChatCompletionRequest.from_json, TokenizeRequest.from_json):
        with pytest.raises(ApiError) as info:
            parse(body)
        assert info.value.status == 400 and "JSON object" in info.value.message


# -- requests: good values ---------------------------------------------------

GOOD_SAMPLING = [
    ({"n": 3}, "n", 3),
    ({"temperature": 0}, "temperature", 0.0),
    ({"temperature": 1.7}, "temperature", 1.7),
    ({"top_p": 0.5}, "top_p", 0.5),
    ({"top_k": -1}, "top_k", -1),
    ({"top_k": 40}, "top_k", 40),
    ({"min_p": 0.05}, "min_p", 0.05),
    ({"presence_penalty": -2}, "presence_penalty", -2.0),
    ({"frequency_penalty": 1.5}, "frequency_penalty", 1.5),
    ({"repetition_penalty": 1.1}, "repetition_penalty", 1.1),
    ({"seed": 42}, "seed", 42),
    ({"seed": None}, "seed", None),
    ({"min_tokens": 3}, "min_tokens", 3),
    ({"stop": "END"}, "stop", ("END",)),
    ({"stop": ["a", "b"]}, "stop", ("a", "b")),
    ({"stop": None}, "stop", ()),
    ({"stop_token_ids": [2, 7]}, "stop_token_ids", (2, 7)),
    ({"include_stop_str_in_output": True}, "include_stop_str_in_output", True),
    ({"ignore_eos": True}, "ignore_eos", True),
    ({"skip_special_tokens": False}, "skip_special_tokens", False),
    ({"logit_bias": {"50256": -100, "7": 2.5}}, "logit_bias", ((7, 2.5), (50256, -100.0))),
    ({"temperature": None, "user": "someone", "unknown_field": [1]}, "temperature", 1.0),
]


@pytest.mark.parametrize(("fields", "attr", "expected"), GOOD_SAMPLING)
def test_good_sampling_fields(fields, attr, expected):
    for request in (
        CompletionRequest.from_json(completion_body(**fields)),
        ChatCompletionRequest.from_json(chat_body(**fields)),
    ):
        assert getattr(request.params, attr) == expected


def test_completion_defaults_and_extras():
    request = CompletionRequest.from_json({"prompt": "hi"})
    assert request.model is None
    assert request.params.max_tokens == 16  # OpenAI's default for completions
    assert request.params.logprobs is None
    assert (request.stream, request.include_usage, request.priority, request.timeout) == (False, False, 0, None)
    request = CompletionRequest.from_json(
        completion_body(max_tokens=5, logprobs=3, priority=-2, timeout=2.5, stream=True, echo=False, best_of=1, suffix=None)
    )
    assert (request.params.max_tokens, request.params.logprobs) == (5, 3)
    assert (request.priority, request.timeout, request.stream) == (-2, 2.5, True)


@pytest.mark.parametrize(
    ("prompt", "expected", "engine_prompt"),
    [
        ("hello", "hello", "hello"),
        (["hello"], "hello", "hello"),
        ([1, 2, 3], (1, 2, 3), [1, 2, 3]),
        ([[4, 5]], (4, 5), [4, 5]),
    ],
)
def test_completion_prompt_shapes(prompt, expected, engine_prompt):
    request = CompletionRequest.from_json(completion_body(prompt=prompt))
    assert request.prompt == expected
    assert request.engine_prompt == engine_prompt


def test_chat_messages_and_limits():
    request = ChatCompletionRequest.from_json(
        chat_body(
            messages=[
                {"role": "developer", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}], "name": "u"},
                {"role": "assistant", "content": None},
            ],
            max_tokens=50,
            max_completion_tokens=20,
        )
    )
    assert request.messages == (ChatMessage("system", "be brief"), ChatMessage("user", "a\nb"), ChatMessage("assistant", ""))
    assert request.engine_prompt[1] == {"role": "user", "content": "a\nb"}
    assert request.params.max_tokens == 20  # max_completion_tokens wins
    # ... but max_tokens is still checked (found by tests/reliability/test_fuzz.py).
    assert_bad(ChatCompletionRequest.from_json, chat_body(max_tokens=float("nan"), max_completion_tokens=1), "max_tokens")
    assert ChatCompletionRequest.from_json(chat_body(max_tokens=50)).params.max_tokens == 50
    assert ChatCompletionRequest.from_json(chat_body()).params.max_tokens is None  # up to the context limit
    assert ChatCompletionRequest.from_json(chat_body(response_format={"type": "text"}, tools=[])).params.n == 1


@pytest.mark.parametrize(
    ("fields", "expected"),
    [({}, None), ({"logprobs": False}, None), ({"logprobs": True}, 0), ({"logprobs": True, "top_logprobs": 5}, 5)],
)
def test_chat_logprobs(fields, expected):
    assert ChatCompletionRequest.from_json(chat_body(**fields)).params.logprobs == expected


def test_tokenize_and_detokenize_bodies():
    request = TokenizeRequest.from_json({"model": "m", "prompt": "hi"})
    assert (request.prompt, request.messages, request.add_special_tokens) == ("hi", None, True)
    request = TokenizeRequest.from_json({"messages": [{"role": "user", "content": "hi"}], "add_generation_prompt": False})
    assert request.messages == (ChatMessage("user", "hi"),)
    assert (request.add_special_tokens, request.add_generation_prompt) == (False, False)
    assert_bad(TokenizeRequest.from_json, {}, "prompt")
    assert_bad(TokenizeRequest.from_json, {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, "prompt")
    assert_bad(TokenizeRequest.from_json, {"prompt": 5}, "prompt")
    assert_bad(TokenizeRequest.from_json, {"prompt": "a", "add_special_tokens": "no"}, "add_special_tokens")
    assert DetokenizeRequest.from_json({"tokens": [1, 2]}).tokens == (1, 2)
    assert_bad(DetokenizeRequest.from_json, {}, "tokens")
    assert_bad(DetokenizeRequest.from_json, {"tokens": [1, "a"]}, "tokens")
    assert_bad(DetokenizeRequest.from_json, {"tokens": "12"}, "tokens")


def test_json_body_and_timeouts():
    assert parse_json_body(b'{"a": 1}') == {"a": 1}
    for raw in (b"{", b"\xff", b"[1]"):
        with pytest.raises(ApiError) as info:
            parse_json_body(raw)
        assert info.value.status == 400
    assert parse_timeout_header(None) is None
    assert parse_timeout_header("2.5") == 2.5
    for value in ("0", "-1", "soon", "nan", "inf"):
        with pytest.raises(ApiError) as info:
            parse_timeout_header(value)
        assert info.value.param == "timeout" and "X-Request-Timeout" in info.value.message
    assert effective_timeout(None, None) is None
    assert effective_timeout(10.0, None, 3.0) == 3.0


def _parse_error(raw: bytes) -> ApiError:
    with pytest.raises(ApiError) as info:
        parse_json_body(raw)
    assert info.value.status == 400
    return info.value


@pytest.mark.parametrize(
    "body, param",
    [
        ({"prompt": "\ud800"}, "prompt"),
        ({"prompt": "ok \udfff ok"}, "prompt"),
        ({"messages": [{"role": "user", "content": "Hi \ud83d"}]}, "messages[0].content"),
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": "\udc00"}]}]}, "messages[0].content[0].text"),
        ({"prompt": "Hi", "stop": ["a", "\ud800"]}, "stop[1]"),
        ({"prompt": "Hi", "logit_bias": {"\ud800": 1}}, "logit_bias.\\ud800"),
        ({"prompt": "Hi", "whatever": {"deep": ["\ud800"]}}, "whatever.deep[0]"),
    ],
)
def test_lone_surrogates_are_refused_naming_the_field(body, param):
    error = _parse_error(json.dumps(body).encode())  # ensure_ascii: "\\ud800" escapes
    assert error.param == param
    assert "lone UTF-16 surrogate" in error.message
    json.dumps(error.to_json()).encode("utf-8")  # the error itself is valid text


def test_surrogate_pairs_and_other_text_are_fine():
    text = "emoji \U0001f600, accents é, CJK 漢字, NUL \x00"
    assert parse_json_body(json.dumps({"prompt": text}).encode()) == {"prompt": text}
    assert parse_json_body(json.dumps({"prompt": text}, ensure_ascii=False).encode()) == {"prompt": text}


@pytest.mark.parametrize(
    "raw",
    [
        b'{"prompt": "\xed\xa0\x80"}',
        b'{"prompt": "\xff"}',
        b'{"prompt": "\xc0\x80"}',
        b'{"prompt": "\xe2\x82"}',
        b"\xef\xbb\xbf{}",
    ],
    ids=["utf8-surrogate", "ff", "overlong", "truncated", "bom"],
)
def test_bodies_that_are_not_utf8_json_are_refused(raw):
    error = _parse_error(raw)
    assert "UTF-8" in error.message or "not valid JSON" in error.message


def test_nesting_is_bounded():
    nested = lambda depth: b"[" * depth + b"]" * depth  # noqa: E731
    # The body: a thousand levels (past the parser's own recursion limit too).
    assert "32 levels" in _parse_error(nested(1000)).message
    assert "32 levels" in _parse_error(nested(100_000)).message
    # Thirty-two levels is fine (the object is the first); thirty-three is not.
    assert parse_json_body(b'{"a": ' + nested(31) + b"}") == {"a": json.loads(nested(31))}
    error = _parse_error(b'{"a": ' + nested(32) + b"}")
    assert error.param == "a" + "[0]" * 31  # the 33rd level
    error = _parse_error(b'{"a": {"b": ' + b'{"c": ' * 40 + b"1" + b"}" * 42)
    assert error.param.startswith("a.b.c.c")


def test_numbers_too_long_to_read_are_refused():
    error = _parse_error(b'{"max_tokens": ' + b"9" * 5000 + b"}")
    assert "too long" in error.message and "sys." not in error.message


@pytest.mark.parametrize("field, value", [("echo", 0), ("echo", 0.0), ("suffix", 0), ("best_of", True), ("best_of", 1.0)])
def test_unsupported_fields_are_compared_by_type(field, value):
    assert_bad(CompletionRequest.from_json, {"prompt": "Hi", field: value}, field)


# -- errors ------------------------------------------------------------------


def test_error_statuses_and_json():
    cases = [
        (errors.InvalidRequest("bad", param="n"), 400, "invalid_request_error", "n", None),
        (errors.AuthenticationError(), 401, "authentication_error", None, "invalid_api_key"),
        (errors.NotFoundError.model("gpt-4", ["smol"]), 404, "invalid_request_error", "model", "model_not_found"),
        (errors.RequestTooLarge(2_000_000, 1_000_000), 413, "invalid_request_error", None, "request_too_large"),
        (errors.Overloaded(0.2), 429, "rate_limit_error", None, "engine_overloaded"),
        (errors.ServiceUnavailable.draining(), 503, "service_unavailable_error", None, "draining"),
        (errors.ServiceUnavailable.loading(3), 503, "service_unavailable_error", None, "loading"),
        (errors.RequestTimeout(5.0, 12), 504, "timeout_error", "timeout", "request_timeout"),
        (errors.InternalError(), 500, "server_error", None, "internal_error"),
    ]
    for error, status, kind, param, code in cases:
        assert error.status == status
        assert error.to_json() == {"error": {"message": error.message, "type": kind, "param": param, "code": code}}
        json.dumps(error.to_json())
    assert "'gpt-4'" in cases[2][0].message and "'smol'" in cases[2][0].message
    assert cases[4][0].headers == {"Retry-After": "1"}  # whole seconds, never 0
    assert errors.Overloaded(2.1).headers == {"Retry-After": "3"}
    assert cases[6][0].headers == {"Retry-After": "3"}
    assert "5 s" in cases[7][0].message and "12 tokens" in cases[7][0].message
    assert cases[1][0].headers["WWW-Authenticate"] == "Bearer"


def test_from_exception():
    error = errors.from_exception(InvalidRequestError("temperature must be >= 0", field="temperature"))
    assert (error.status, error.param) == (400, "temperature")
    error = errors.from_exception(RequestTooLongError("prompt has 5000 tokens; max_model_len is 2048", field="prompt"))
    assert (error.status, error.param, error.code) == (400, "prompt", "context_length_exceeded")
    assert "2048" in error.message
    error = errors.from_exception(EngineOverloaded("full", retry_after=2.2))
    assert (error.status, error.headers["Retry-After"]) == (429, "3")
    assert errors.from_exception(EngineClosed("the engine is not taking requests")).status == 503
    error = errors.from_exception(DuplicateRequestError("r1"))  # a subclass maps like its base
    assert (error.status, error.param, error.code) == (400, "request_id", None)
    error = errors.from_exception(QueueTimeout("waited too long", request_id="r1", retry_after=0.0))
    assert (error.status, error.code, error.headers["Retry-After"]) == (503, "queue_timeout", "1")
    error = errors.from_exception(RequestShed("shed", request_id="r1", retry_after=4.5))
    assert (error.status, error.code, error.headers["Retry-After"]) == (429, "request_shed", "5")
    error = errors.from_exception(ExpensiveRequestRefused("too big", field="max_tokens", retry_after=1.0))
    assert (error.status, error.code, error.param) == (429, "expensive_request_refused", "max_tokens")
    error = errors.from_exception(RuntimeError("secret internals"))
    assert error.status == 500 and "secret" not in error.message and "RuntimeError" in error.message
    same = errors.InvalidRequest("x")
    assert errors.from_exception(same) is same


# -- SSE framing ---------------------------------------------------------------


def test_sse_framing():
    event = sse_event({"text": "héllo\nworld", "n": 1})
    assert event.startswith(b"data: ") and event.endswith(b"\n\n")
    assert event.count(b"\n") == 2  # the JSON itself is one line
    assert json.loads(event[len(b"data: ") : -2]) == {"text": "héllo\nworld", "n": 1}
    assert "héllo".encode() in event
    assert SSE_DONE == b"data: [DONE]\n\n"
    assert sse_events([{"a": 1}, {"b": 2}]) == b'data: {"a":1}\n\ndata: {"b":2}\n\n'
    assert json.loads(sse_error(errors.Overloaded(1))[6:])["error"]["code"] == "engine_overloaded"


# -- token texts ---------------------------------------------------------------


def byte_level_tokenizer() -> tuple[Tokenizer, dict[str, int]]:
    """A GPT-2 style byte-level BPE with one token per byte plus 'Ġhi'."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    vocab["hi"] = len(vocab)
    vocab["Ġhi"] = len(vocab)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[("h", "i"), ("Ġ", "hi")]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer, vocab


def test_token_texts_byte_level():
    tokenizer, vocab = byte_level_tokenizer()
    texts = TokenTexts(tokenizer)
    assert texts.text(vocab["Ġhi"]) == " hi"
    assert texts.bytes(vocab["Ġhi"]) == [32, 104, 105]
    euro = "€".encode()  # three tokens, none a whole character
    first = tokenizer.encode("€").ids[0]
    assert texts.text(first) == "bytes:\\xe2"
    assert texts.bytes(first) == [euro[0]]


class SentencePieceLike:
    """Decodes a lone token without its leading space, as Llama's decoder does."""

    pieces = {1: "\u2581Paris", 2: "<0xE2>", 3: "\ufffd"}

    def decode(self, ids, skip_special_tokens=True):
        piece = self.pieces[ids[0]]
        return "\ufffd" if piece.startswith("<0x") else piece.lstrip("\u2581")

    def convert_ids_to_tokens(self, token_id):
        return self.pieces[token_id]


def test_token_texts_sentencepiece():
    texts = TokenTexts(SentencePieceLike())
    assert texts.text(1) == " Paris"
    assert texts.bytes(1) == list(b" Paris")
    assert (texts.text(2), texts.bytes(2)) == ("bytes:\\xe2", [0xE2])
    # A token that really is U+FFFD keeps its text.
    assert (texts.text(3), texts.bytes(3)) == ("\ufffd", list("\ufffd".encode()))


# -- response shapes -------------------------------------------------------------


class Vocab:
    """Token i is the word 'w{i}' with a leading space."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(f" w{i}" for i in ids)


def output(index, tokens, text, *, finish=None, stop_reason=None, logprobs=False, num_output=1):
    entries = tuple(TokenLogprobs(t, -0.5, ((t, -0.5), (t + 1, -1.5))) for t in tokens) if logprobs else ()
    return RequestOutput(
        request_id="req",
        index=index,
        new_token_ids=tuple(tokens),
        text_delta=text,
        logprobs=entries,
        finish_reason=finish,
        stop_reason=stop_reason,
        num_prompt_tokens=7,
        num_output_tokens=num_output,
        num_cached_tokens=4,
        times=RequestTimes(arrival=0.0, first_scheduled=0.1, first_token=0.2, now=0.3),
    )


def interleaved(logprobs=False, last=FinishReason.STOP):
    """Two completions, interleaved; completion 1 has held-back text once."""
    return [
        output(0, [1], " w1", logprobs=logprobs, num_output=1),
        output(1, [5], "", logprobs=logprobs, num_output=1),
        output(1, [6], " w5 w6", logprobs=logprobs, num_output=2),
        output(0, [2], " w2", logprobs=logprobs, num_output=2, finish=FinishReason.LENGTH),
        output(1, [], "", num_output=2, finish=last, stop_reason="END"),
    ]


def test_completion_body_validates():
    acc = OutputAccumulator(n=2, texts=TokenTexts(Vocab()))
    deltas = interleaved(logprobs=True)
    for delta in deltas[:-1]:
        acc.add(delta)
        assert not acc.finished
    acc.add(deltas[-1])
    assert acc.finished and not acc.timed_out
    body = acc.completion_body("smol", created=123)
    completion = Completion.model_validate(body)
    assert completion.id.startswith("cmpl-") and completion.object == "text_completion" and completion.created == 123
    assert [c.text for c in completion.choices] == [" w1 w2", " w5 w6"]
    assert [c.finish_reason for c in completion.choices] == ["length", "stop"]
    assert body["choices"][1]["stop_reason"] == "END"
    logprobs = completion.choices[0].logprobs
    assert logprobs.tokens == [" w1", " w2"]
    assert logprobs.token_logprobs == [-0.5, -0.5]
    assert logprobs.top_logprobs == [{" w1": -0.5, " w2": -1.5}, {" w2": -0.5, " w3": -1.5}]
    assert logprobs.text_offset == [0, 3]
    assert completion.usage.prompt_tokens == 7
    assert completion.usage.completion_tokens == 4
    assert completion.usage.total_tokens == 11
    assert completion.usage.prompt_tokens_details.cached_tokens == 4


def test_chat_completion_body_validates():
    acc = OutputAccumulator(n=2, texts=TokenTexts(Vocab()))
    for delta in interleaved(logprobs=True):
        acc.add(delta)
    chat = ChatCompletion.model_validate(acc.chat_completion_body("smol"))
    assert chat.id.startswith("chatcmpl-") and chat.object == "chat.completion" and chat.model == "smol"
    assert [c.message.content for c in chat.choices] == [" w1 w2", " w5 w6"]
    assert chat.choices[0].message.role == "assistant"
    content = chat.choices[0].logprobs.content
    assert [(e.token, e.logprob, e.bytes) for e in content] == [(" w1", -0.5, list(b" w1")), (" w2", -0.5, list(b" w2"))]
    assert [t.token for t in content[0].top_logprobs] == [" w1", " w2"]
    assert chat.usage.total_tokens == 11
    plain = OutputAccumulator(n=1)
    plain.add(output(0, [1], "x", finish=FinishReason.STOP))
    assert plain.chat_completion_body("smol")["choices"][0]["logprobs"] is None


def test_deadline_reports_timeout():
    acc = OutputAccumulator(n=2)
    for delta in interleaved(last=FinishReason.DEADLINE):
        acc.add(delta)
    assert acc.timed_out and acc.num_output_tokens == 4
    body = acc.completion_body("smol")
    assert body["choices"][1]["finish_reason"] == "timeout"


def mock_client(body: bytes, content_type: str) -> openai.OpenAI:
    def answer(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=body, headers={"content-type": content_type})

    return openai.OpenAI(
        api_key="k", base_url="http://test/v1", max_retries=0, http_client=httpx.Client(transport=httpx.MockTransport(answer))
    )


def stream_bytes(stream, deltas) -> bytes:
    chunks = [chunk for delta in deltas for chunk in stream.chunks(delta)]
    return sse_events([*chunks, *stream.final_chunks()]) + SSE_DONE


def test_completion_stream_through_the_openai_client():
    stream = CompletionStream("smol", texts=TokenTexts(Vocab()), include_usage=True)
    raw = stream_bytes(stream, interleaved(logprobs=True))
    chunks = list(mock_client(raw, "text/event-stream").completions.create(model="smol", prompt="p", stream=True))
    # One chunk per delta (the held-back one still carries its token's
    # logprobs), then the usage chunk.
    assert len(chunks) == 6
    for chunk in chunks:
        # openai types a completion's finish_reason as never null, though its
        # own streams send null until the last chunk; validate the rest.
        dumped = chunk.model_dump()
        for choice in dumped["choices"]:
            choice["finish_reason"] = choice["finish_reason"] or "stop"
        Completion.model_validate(dumped)
        assert chunk.id == stream.id and chunk.object == "text_completion"
    text = {0: "", 1: ""}
    for chunk in chunks[:-1]:
        (choice,) = chunk.choices
        text[choice.index] += choice.text
    assert text == {0: " w1 w2", 1: " w5 w6"}
    assert chunks[1].choices[0].logprobs.tokens == [" w5"] and chunks[1].choices[0].text == ""
    assert chunks[3].choices[0].logprobs.text_offset == [3]  # continues after " w1"
    assert [c.choices[0].finish_reason for c in chunks[:-1]] == [None, None, None, "length", "stop"]
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == 11


def test_chat_stream_through_the_openai_client():
    stream = ChatCompletionStream("smol", texts=TokenTexts(Vocab()), include_usage=True)
    raw = stream_bytes(stream, interleaved(logprobs=True))
    client = mock_client(raw, "text/event-stream")
    chunks = list(client.chat.completions.create(model="smol", messages=[{"role": "user", "content": "p"}], stream=True))
    for chunk in chunks:
        ChatCompletionChunk.model_validate(chunk.model_dump())
        assert chunk.id == stream.id and chunk.object == "chat.completion.chunk"
    first = {}
    content = {0: "", 1: ""}
    finish = {}
    for chunk in chunks[:-1]:
        (choice,) = chunk.choices
        first.setdefault(choice.index, choice.delta.role)
        content[choice.index] += choice.delta.content or ""
        if choice.finish_reason:
            finish[choice.index] = choice.finish_reason
    assert first == {0: "assistant", 1: "assistant"}
    assert content == {0: " w1 w2", 1: " w5 w6"}
    assert finish == {0: "length", 1: "stop"}
    with_logprobs = [c for c in chunks[:-1] if c.choices[0].logprobs is not None]
    assert [e.token for c in with_logprobs for e in c.choices[0].logprobs.content] == [" w1", " w5", " w6", " w2"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 4


def test_stream_without_usage_or_logprobs():
    stream = ChatCompletionStream("smol")
    chunks = [c for d in interleaved() for c in stream.chunks(d)]
    assert stream.final_chunks() == []
    assert all("usage" not in c and c["choices"][0]["logprobs"] is None for c in chunks)
    # The final delta of completion 1 has no text: its chunk has an empty delta.
    assert chunks[-1]["choices"][0] == {
        "index": 1,
        "delta": {},
        "logprobs": None,
        "finish_reason": "stop",
        "stop_reason": "END",
    }


def test_timeout_finish_survives_the_openai_client():
    stream = CompletionStream("smol")
    raw = stream_bytes(stream, [output(0, [1], " w1", finish=FinishReason.DEADLINE)])
    (chunk,) = mock_client(raw, "text/event-stream").completions.create(model="smol", prompt="p", stream=True)
    assert chunk.choices[0].finish_reason == "timeout"
    acc = OutputAccumulator()
    acc.add(output(0, [1], " w1", finish=FinishReason.DEADLINE))
    body = json.dumps(acc.chat_completion_body("smol")).encode()
    chat = mock_client(body, "application/json").chat.completions.create(
        model="smol", messages=[{"role": "user", "content": "p"}]
    )
    assert chat.choices[0].finish_reason == "timeout" and chat.choices[0].message.content == " w1"
