"""Request bodies of the OpenAI-compatible API, parsed and validated.

``CompletionRequest.from_json`` and ``ChatCompletionRequest.from_json`` take
the decoded JSON body of ``POST /v1/completions`` and
``POST /v1/chat/completions`` (OpenAI's fields plus vLLM's extras) and return
frozen values holding a ready ``SamplingParams`` (the sampling fields the
body leaves out unset, for the model's defaults). Every wrong type or value
raises ``InvalidRequest`` (400) whose ``param`` names the field. Unknown
fields are ignored, as OpenAI does; the few known fields we cannot honour
(``echo``, ``best_of``, ``suffix``) are refused rather than silently
dropped. ``response_format`` and ``structured_outputs`` are read by
``structured.py``, ``tools`` and ``tool_choice`` by ``tools.py``.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

import attrs

from trioserve.engine.errors import InvalidRequestError
from trioserve.engine.sampling.sampling_params import SamplingParams

from .errors import InvalidRequest
from .structured import structured_output
from .tools import ToolChoice, tool_choice

MAX_LOGPROBS = 20
# OpenAI's request bodies nest a few levels (a chat message's content parts
# are four deep); a deeper body is refused before anything walks it.
MAX_JSON_DEPTH = 32
MAX_N = 128
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")

_MISSING = object()
# A JSON escape of a UTF-16 surrogate (a pair is fine; a lone one is not).
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


# -- field readers ---------------------------------------------------------
# Each reads one field of ``body``: a missing field or JSON null gives
# ``default``; anything else must have the right type and range.


def _get(body: dict[str, Any], name: str) -> Any:
    value = body.get(name, _MISSING)
    return _MISSING if value is None else value


def _int(body: dict[str, Any], name: str, default: Any, *, low: int | None = None, high: int | None = None) -> Any:
    value = _get(body, name)
    if value is _MISSING:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequest(f"{name} must be an integer, got {value!r}", param=name)
    if (low is not None and value < low) or (high is not None and value > high):
        raise InvalidRequest(f"{name} must be {_range(low, high)}, got {value}", param=name)
    return value


def _float(
    body: dict[str, Any], name: str, default: Any, *, low: float | None = None, high: float | None = None, low_open: bool = False
) -> Any:
    value = _get(body, name)
    if value is _MISSING:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise InvalidRequest(f"{name} must be a number, got {value!r}", param=name)
    too_low = low is not None and (value <= low if low_open else value < low)
    if too_low or (high is not None and value > high):
        bound = _range(low, high)
        if low_open:
            bound = f"> {low}" + (f" and <= {high}" if high is not None else "")
        raise InvalidRequest(f"{name} must be {bound}, got {value}", param=name)
    return float(value)


def _bool(body: dict[str, Any], name: str, default: Any) -> Any:
    value = _get(body, name)
    if value is _MISSING:
        return default
    if not isinstance(value, bool):
        raise InvalidRequest(f"{name} must be true or false, got {value!r}", param=name)
    return value


def _str(body: dict[str, Any], name: str, default: Any) -> Any:
    value = _get(body, name)
    if value is _MISSING:
        return default
    if not isinstance(value, str):
        raise InvalidRequest(f"{name} must be a string, got {value!r}", param=name)
    return value


def _range(low: float | None, high: float | None) -> str:
    if low is not None and high is not None:
        return f"between {low} and {high}"
    return f">= {low}" if low is not None else f"<= {high}"


def _is_token_ids(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


def _token_ids(value: Any, name: str) -> tuple[int, ...]:
    if not _is_token_ids(value) or any(t < 0 for t in value):
        raise InvalidRequest(f"{name} must be a list of non-negative integer token ids", param=name)
    return tuple(value)


def _optional_token_ids(body: dict[str, Any], name: str) -> tuple[int, ...]:
    value = _get(body, name)
    return () if value is _MISSING else _token_ids(value, name)


def _stop(body: dict[str, Any]) -> tuple[str, ...]:
    value = _get(body, "stop")
    if value is _MISSING:
        return ()
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise InvalidRequest("stop must be a string or a list of strings", param="stop")
    if not all(value):
        raise InvalidRequest("stop must not contain an empty string", param="stop")
    return tuple(value)


def _logit_bias(body: dict[str, Any]) -> dict[int, float]:
    value = _get(body, "logit_bias")
    if value is _MISSING:
        return {}
    if not isinstance(value, dict):
        raise InvalidRequest("logit_bias must be an object mapping token ids to numbers", param="logit_bias")
    bias = {}
    for key, item in value.items():
        try:
            token_id = int(key)
        except ValueError:
            raise InvalidRequest(f"logit_bias keys must be token ids, got {key!r}", param="logit_bias") from None
        if token_id < 0:
            raise InvalidRequest(f"logit_bias keys must be token ids, got {key!r}", param="logit_bias")
        if isinstance(item, bool) or not isinstance(item, int | float) or not -100 <= item <= 100:
            raise InvalidRequest(f"logit_bias values must be numbers in [-100, 100], got {item!r}", param="logit_bias")
        bias[token_id] = float(item)
    return bias


def _refuse_unsupported(body: dict[str, Any], name: str, allowed: tuple[Any, ...], why: str) -> None:
    value = body.get(name)
    # By type too: 0 == False, but echo=0 is not the boolean this allows.
    if value is not None and not any(type(value) is type(ok) and value == ok for ok in allowed):
        raise InvalidRequest(f"{name} is not supported: {why}", param=name)


def _stream_options(body: dict[str, Any], stream: bool) -> bool:
    options = _get(body, "stream_options")
    if options is _MISSING:
        return False
    if not isinstance(options, dict):
        raise InvalidRequest("stream_options must be an object", param="stream_options")
    if not stream:
        raise InvalidRequest("stream_options is only allowed when stream is true", param="stream_options")
    include_usage = options.get("include_usage", False)
    if not isinstance(include_usage, bool | None):
        raise InvalidRequest(
            f"stream_options.include_usage must be true or false, got {include_usage!r}", param="stream_options.include_usage"
        )
    return bool(include_usage)


def _sampling_params(body: dict[str, Any], *, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
    """Sampling fields shared by both endpoints; SamplingParams rechecks ranges.

    ``temperature``, ``top_p``, ``top_k``, ``min_p`` and
    ``repetition_penalty`` left out (or null) stay unset: the served
    model's sampling defaults fill them (engine/loading/generation_config.py)."""
    n = _int(body, "n", 1, low=1, high=MAX_N)
    fields = dict(
        n=n,
        temperature=_float(body, "temperature", None, low=0.0),
        top_p=_float(body, "top_p", None, low=0.0, high=1.0, low_open=True),
        top_k=_int(body, "top_k", None, low=-1),
        min_p=_float(body, "min_p", None, low=0.0, high=1.0),
        presence_penalty=_float(body, "presence_penalty", 0.0, low=-2.0, high=2.0),
        frequency_penalty=_float(body, "frequency_penalty", 0.0, low=-2.0, high=2.0),
        repetition_penalty=_float(body, "repetition_penalty", None, low=0.0, low_open=True),
        seed=_int(body, "seed", None),
        max_tokens=max_tokens,
        min_tokens=_int(body, "min_tokens", 0, low=0),
        stop=_stop(body),
        stop_token_ids=_optional_token_ids(body, "stop_token_ids"),
        include_stop_str_in_output=_bool(body, "include_stop_str_in_output", False),
        ignore_eos=_bool(body, "ignore_eos", False),
        logit_bias=_logit_bias(body),
        logprobs=logprobs,
        skip_special_tokens=_bool(body, "skip_special_tokens", True),
        structured_output=structured_output(body),
        # Plugins' logits processors by name (engine/plugins.py); SamplingParams checks the shape.
        logits_processors=body.get("logits_processors"),
    )
    best_of = body.get("best_of")
    if best_of is not None and (type(best_of) is not int or best_of != n):
        raise InvalidRequest("best_of is not supported: omit it or set it equal to n", param="best_of")
    try:
        return SamplingParams(**fields)
    except InvalidRequestError as exc:
        raise InvalidRequest(str(exc), param=exc.field) from None


def _model(body: dict[str, Any]) -> str | None:
    return _str(body, "model", None)


def _priority(body: dict[str, Any]) -> int:
    return _int(body, "priority", 0)


def _timeout(body: dict[str, Any]) -> float | None:
    return _float(body, "timeout", None, low=0.0, low_open=True)


def _require_object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    return body


def parse_json_body(raw: bytes) -> dict[str, Any]:
    """Decode a request body that must be a JSON object in UTF-8, nested at
    most ``MAX_JSON_DEPTH`` levels, whose strings are all Unicode text."""
    try:
        # Strictly: json.loads(bytes) would let UTF-8-encoded surrogates
        # (b"\xed\xa0\x80") through, and accept UTF-16 and UTF-32 too.
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidRequest(f"the request body is not valid UTF-8: {exc.reason} at byte {exc.start}") from None
    try:
        body = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InvalidRequest(f"the request body is not valid JSON: {exc}") from None
    except RecursionError:
        # json's parser guards its own recursion; past the interpreter's
        # limit it gives up cleanly, long before the stack is at risk.
        raise _too_deep(None) from None
    except ValueError:  # an integer of more digits than int() converts
        raise InvalidRequest("the request body holds a number too long to read") from None
    body = _require_object(body)
    # Most bodies cannot break either rule; only the others are walked.
    if text.count("[") + text.count("{") > MAX_JSON_DEPTH or _SURROGATE_ESCAPE.search(text):
        _check_nesting_and_text(body)
    return body


def _too_deep(param: str | None) -> InvalidRequest:
    return InvalidRequest(f"the request body nests arrays and objects more than {MAX_JSON_DEPTH} levels deep", param=param)


def _check_nesting_and_text(body: dict[str, Any]) -> None:
    """Refuse nesting past ``MAX_JSON_DEPTH`` and strings holding a lone
    UTF-16 surrogate (JSON's ``\\ud800`` escape): they are not text, and no
    tokenizer takes them. Iterative, so no depth can exhaust the stack."""
    pending: list[tuple[Any, str, int]] = [(body, "", 1)]
    while pending:
        value, path, depth = pending.pop()
        if depth > MAX_JSON_DEPTH:
            raise _too_deep(path or None)
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for key, item in items:
            if isinstance(key, str):
                if not _is_text(key):
                    where = _printable(f"{path}.{key}" if path else key)
                    raise InvalidRequest(
                        f"the field name {where} is not valid Unicode text: it holds a lone UTF-16 surrogate", param=where
                    )
                where = f"{path}.{key}" if path else key
            else:
                where = f"{path}[{key}]"
            if isinstance(item, dict | list):
                pending.append((item, where, depth + 1))
            elif isinstance(item, str) and not _is_text(item):
                where = _printable(where)
                raise InvalidRequest(f"{where} is not valid Unicode text: it holds a lone UTF-16 surrogate", param=where)


def _is_text(value: str) -> bool:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _printable(text: str) -> str:
    """``text`` with any lone surrogate written as its escape."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def parse_timeout_header(value: str | None) -> float | None:
    """The ``X-Request-Timeout`` header: seconds, a number > 0."""
    if value is None:
        return None
    try:
        seconds = float(value)
    except ValueError:
        seconds = math.nan
    if not math.isfinite(seconds) or seconds <= 0:
        raise InvalidRequest(f"X-Request-Timeout must be a number of seconds > 0, got {value!r}", param="timeout")
    return seconds


def effective_timeout(*timeouts: float | None) -> float | None:
    """The tightest of the given timeouts (body, header, ``--max-request-time``); None if none is set."""
    given = [t for t in timeouts if t is not None]
    return min(given) if given else None


# -- prompts and messages --------------------------------------------------


def _prompt(body: dict[str, Any]) -> str | tuple[int, ...]:
    value = _get(body, "prompt")
    if value is _MISSING:
        raise InvalidRequest("prompt is required", param="prompt")
    # A batch of one is accepted in each of OpenAI's list shapes.
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str | list):
        value = value[0]
    elif isinstance(value, list) and value and not _is_token_ids(value):
        raise InvalidRequest(
            "prompt must be a string, a list of token ids, or a list of one of those; "
            "batched prompts are not supported, send one request per prompt",
            param="prompt",
        )
    if isinstance(value, str):
        if not value:
            raise InvalidRequest("prompt must not be empty", param="prompt")
        return value
    if not _is_token_ids(value) or not value:
        raise InvalidRequest("prompt must be a non-empty string or a non-empty list of token ids", param="prompt")
    return _token_ids(value, "prompt")


@attrs.frozen
class ChatMessage:
    """One chat message with its content flattened to text; an assistant's
    ``tool_calls`` (arguments decoded to objects, as chat templates take
    them) and a tool result's ``tool_call_id``."""

    role: str
    content: str
    tool_calls: tuple[dict[str, Any], ...] = ()
    tool_call_id: str | None = None

    def as_dict(self) -> dict[str, Any]:
        message: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.tool_calls:
            message["tool_calls"] = [dict(call) for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


def _tool_calls(value: Any, where: str) -> tuple[dict[str, Any], ...]:
    if value is None:
        return ()
    if not isinstance(value, list):
        raise InvalidRequest(f"{where} must be a list", param=where)
    calls = []
    for i, call in enumerate(value):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise InvalidRequest(f"{where}[{i}] must be {{'type': 'function', 'function': {{name, arguments}}}}", param=f"{where}[{i}]")
        arguments = function.get("arguments", "{}")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                raise InvalidRequest(f"{where}[{i}].function.arguments must be JSON", param=f"{where}[{i}].function.arguments") from None
        calls.append({"id": call.get("id"), "type": "function", "function": {"name": function["name"], "arguments": arguments}})
    return tuple(calls)


def _content(value: Any, param: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        texts = []
        for part in value:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise InvalidRequest(f"{param} parts must be {{'type': 'text', 'text': str}}; got a {kind!r} part", param=param)
            texts.append(part["text"])
        # vLLM joins text parts with newlines too, so templates see the same text.
        return "\n".join(texts)
    raise InvalidRequest(f"{param} must be a string or a list of text parts", param=param)


def _messages(body: dict[str, Any], name: str = "messages") -> tuple[ChatMessage, ...]:
    value = _get(body, name)
    if value is _MISSING:
        raise InvalidRequest(f"{name} is required", param=name)
    if not isinstance(value, list) or not value:
        raise InvalidRequest(f"{name} must be a non-empty list of messages", param=name)
    messages = []
    for i, item in enumerate(value):
        where = f"{name}[{i}]"
        if not isinstance(item, dict):
            raise InvalidRequest(f"{where} must be an object with role and content", param=where)
        role = item.get("role")
        if role not in CHAT_ROLES:
            raise InvalidRequest(f"{where}.role must be one of {', '.join(CHAT_ROLES)}; got {role!r}", param=f"{where}.role")
        content = item.get("content")
        if content is None and role == "assistant":
            content = ""
        tool_calls = _tool_calls(item.get("tool_calls"), f"{where}.tool_calls") if role == "assistant" else ()
        tool_call_id = item.get("tool_call_id")
        if role == "tool" and not isinstance(tool_call_id, str):
            raise InvalidRequest(f"{where}.tool_call_id is required for a tool message", param=f"{where}.tool_call_id")
        # Chat templates know "system"; "developer" is OpenAI's newer name for it.
        role = "system" if role == "developer" else role
        messages.append(ChatMessage(role, _content(content, f"{where}.content"), tool_calls, tool_call_id if role == "tool" else None))
    return tuple(messages)


# -- requests ------------------------------------------------------------


@attrs.frozen(kw_only=True)
class CompletionRequest:
    """A parsed ``POST /v1/completions`` body.

    ``model`` is None when the client left it out (the app then uses the
    served model). ``timeout`` is the body's ``timeout`` field in seconds;
    the app combines it with the header and ``--max-request-time`` through
    ``effective_timeout``.
    """

    model: str | None
    prompt: str | tuple[int, ...]
    params: SamplingParams
    stream: bool = False
    include_usage: bool = False
    priority: int = 0
    timeout: float | None = None

    @property
    def engine_prompt(self) -> str | list[int]:
        """The prompt in the form ``engine.generate`` takes."""
        return self.prompt if isinstance(self.prompt, str) else list(self.prompt)

    @classmethod
    def from_json(cls, body: Any) -> CompletionRequest:
        body = _require_object(body)
        _refuse_unsupported(body, "echo", (False,), "the prompt is not echoed back")
        _refuse_unsupported(body, "suffix", ("",), "insertion (suffix) needs a fill-in-the-middle model")
        stream = _bool(body, "stream", False)
        logprobs = _int(body, "logprobs", None, low=0, high=MAX_LOGPROBS)
        max_tokens = _int(body, "max_tokens", 16, low=1)
        return cls(
            model=_model(body),
            prompt=_prompt(body),
            params=_sampling_params(body, max_tokens=max_tokens, logprobs=logprobs),
            stream=stream,
            include_usage=_stream_options(body, stream),
            priority=_priority(body),
            timeout=_timeout(body),
        )


@attrs.frozen(kw_only=True)
class ChatCompletionRequest:
    """A parsed ``POST /v1/chat/completions`` body.

    ``params.logprobs`` is None unless ``logprobs`` was true; then it is
    ``top_logprobs`` (default 0).
    """

    model: str | None
    messages: tuple[ChatMessage, ...]
    params: SamplingParams
    stream: bool = False
    include_usage: bool = False
    priority: int = 0
    timeout: float | None = None
    tools: ToolChoice | None = None

    @property
    def engine_prompt(self) -> list[dict[str, Any]]:
        """The messages in the form ``engine.generate`` takes (templated there)."""
        return [m.as_dict() for m in self.messages]

    @property
    def renders_tools(self) -> bool:
        """Whether the prompt needs a template that knows tools (web/tools.py):
        the request offers tools, or its history holds calls or results."""
        return self.tools is not None or any(m.tool_calls or m.role == "tool" for m in self.messages)

    @classmethod
    def from_json(cls, body: Any) -> ChatCompletionRequest:
        body = _require_object(body)
        if body.get("functions"):
            raise InvalidRequest("functions is not supported: use tools", param="functions")
        stream = _bool(body, "stream", False)
        want_logprobs = _bool(body, "logprobs", False)
        top = _int(body, "top_logprobs", None, low=0, high=MAX_LOGPROBS)
        if top is not None and not want_logprobs:
            raise InvalidRequest("top_logprobs needs logprobs set to true", param="top_logprobs")
        # max_completion_tokens replaced max_tokens in OpenAI's chat API; the
        # newer name wins when both are given (both are checked).
        max_tokens = _int(body, "max_tokens", None, low=1)
        max_completion_tokens = _int(body, "max_completion_tokens", None, low=1)
        if max_completion_tokens is not None:
            max_tokens = max_completion_tokens
        tools = tool_choice(body)
        params = _sampling_params(body, max_tokens=max_tokens, logprobs=(top or 0) if want_logprobs else None)
        if tools is not None and (constraint := tools.constraint()) is not None:
            params = attrs.evolve(params, structured_output=constraint)
        return cls(
            model=_model(body),
            messages=_messages(body),
            params=params,
            tools=tools,
            stream=stream,
            include_usage=_stream_options(body, stream),
            priority=_priority(body),
            timeout=_timeout(body),
        )


@attrs.frozen(kw_only=True)
class TokenizeRequest:
    """A parsed ``POST /tokenize`` body: exactly one of ``prompt`` or ``messages``.

    ``add_special_tokens`` defaults to true for a prompt and false for
    messages (the chat template adds its own), as in vLLM.
    """

    model: str | None
    prompt: str | None
    messages: tuple[ChatMessage, ...] | None
    add_special_tokens: bool
    add_generation_prompt: bool = True

    @classmethod
    def from_json(cls, body: Any) -> TokenizeRequest:
        body = _require_object(body)
        has_prompt, has_messages = _get(body, "prompt") is not _MISSING, _get(body, "messages") is not _MISSING
        if has_prompt == has_messages:
            raise InvalidRequest("give exactly one of prompt or messages", param="prompt")
        if has_prompt:
            return cls(
                model=_model(body),
                prompt=_str(body, "prompt", ""),
                messages=None,
                add_special_tokens=_bool(body, "add_special_tokens", True),
            )
        return cls(
            model=_model(body),
            prompt=None,
            messages=_messages(body),
            add_special_tokens=_bool(body, "add_special_tokens", False),
            add_generation_prompt=_bool(body, "add_generation_prompt", True),
        )


@attrs.frozen(kw_only=True)
class DetokenizeRequest:
    """A parsed ``POST /detokenize`` body."""

    model: str | None
    tokens: tuple[int, ...]

    @classmethod
    def from_json(cls, body: Any) -> DetokenizeRequest:
        body = _require_object(body)
        if _get(body, "tokens") is _MISSING:
            raise InvalidRequest("tokens is required", param="tokens")
        return cls(model=_model(body), tokens=_token_ids(body["tokens"], "tokens"))
