"""Request bodies of the OpenAI-compatible API, parsed into the engine's values.

``CompletionRequest.from_json`` and ``ChatCompletionRequest.from_json`` take
the decoded JSON body of ``POST /v1/completions`` and
``POST /v1/chat/completions`` (OpenAI's fields plus vLLM's extras) and return
frozen values holding the engine's ``RequestInput``: its prompt,
``SamplingParams`` (the sampling fields the body leaves out unset, for the
model's defaults) and priority. Those values' validators are the one
statement of each field's rule: this module reads the API's shapes (a
prompt given as a batch of one, ``stop`` as a string, chat's
``top_logprobs``), hands the values over as JSON has them, and turns their
``InvalidRequestError`` into a 400 whose ``param`` names the body's field
(fields.py). The fields that are the API's own (``stream``, ``timeout``,
...) are checked here. Unknown fields are ignored, as OpenAI does; the few
known fields we cannot honour (``best_of``, ``suffix``, ``echo`` with
``stream``) are refused rather than silently dropped. ``response_format`` and
``structured_outputs`` are read by ``structured.py``, ``tools`` and
``tool_choice`` by ``tools.py``, ``messages`` by ``chat_messages.py``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from trioserve.engine.core.new_request import RequestInput, as_prompt
from trioserve.engine.errors import InvalidRequestError
from trioserve.engine.sampling.sampling_params import SamplingParams
from trioserve.engine.sampling.structured_output import StructuredOutput

from .chat_messages import ChatMessage, chat_messages
from .errors import InvalidRequest
from .fields import boolean, invalid, is_token_ids, refuse_unsupported, string, token_ids
from .json_body import require_object
from .slo import body_objectives
from .structured import structured_output
from .timeouts import timeout_field
from .tools import ToolChoice, tool_choice

# The body's fields that are SamplingParams' own, by the same names: handed
# over as JSON has them (null: left out, for the default).
SAMPLING_FIELDS = (
    "n",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "seed",
    "min_tokens",
    "stop",
    "stop_token_ids",
    "include_stop_str_in_output",
    "ignore_eos",
    "logit_bias",
    "skip_special_tokens",
    # Plugins' logits processors by name (engine/plugins.py).
    "logits_processors",
)

# The chat API's names for the engine's fields: its prompt is the messages,
# its logprobs count is top_logprobs (``logprobs`` there is a flag).
CHAT_NAMES = {"prompt": "messages", "logprobs": "top_logprobs"}


def request_input(
    body: dict[str, Any],
    prompt: Any,
    *,
    max_tokens: Any,
    logprobs: Any,
    structured: StructuredOutput | None,
    names: Mapping[str, str] | None = None,
    prompt_logprobs: Any = None,
) -> RequestInput:
    """The engine's ``RequestInput`` of a body: ``prompt``, the sampling
    fields (with the endpoint's reading of ``max_tokens`` and ``logprobs``,
    and its constraint), and ``priority``; their validators judge every value.

    ``temperature``, ``top_p``, ``top_k``, ``min_p`` and
    ``repetition_penalty`` left out (or null) stay unset: the served model's
    sampling defaults fill them (engine/loading/generation_config.py)."""
    given = {name: body[name] for name in SAMPLING_FIELDS if body.get(name) is not None}
    # JSON's logit_bias is an object; the engine also takes a list of
    # (id, bias) pairs from Python, under which an empty list would pass.
    if "logit_bias" in given and not isinstance(given["logit_bias"], dict):
        found = type(given["logit_bias"]).__name__
        raise InvalidRequest(f"logit_bias must be an object mapping token ids to numbers, got {found}", param="logit_bias")
    priority = body.get("priority")
    try:
        params = SamplingParams(
            **given, max_tokens=max_tokens, logprobs=logprobs, structured_output=structured, prompt_logprobs=prompt_logprobs
        )
        request = RequestInput(prompt, params, 0 if priority is None else priority, objectives=body_objectives(body))
    except InvalidRequestError as exc:
        raise invalid(exc, names) from None
    best_of = body.get("best_of")
    if best_of is not None and (type(best_of) is not int or best_of != params.n):
        raise InvalidRequest("best_of is not supported: omit it or set it equal to n", param="best_of")
    return request


def _stream_options(body: dict[str, Any], stream: bool) -> bool:
    options = body.get("stream_options")
    if options is None:
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


# The most prompts one completions request may batch.
MAX_PROMPTS = 256


def _prompts(body: dict[str, Any]) -> list[Any]:
    """The completions API's prompts in the engine's shape: each text or
    token ids (the engine's ``as_prompt`` then judges it). A list of strings
    or of token-id lists is OpenAI's batch form: one prompt each."""
    value = body.get("prompt")
    if value is None:
        raise InvalidRequest("prompt is required", param="prompt")
    if not isinstance(value, str | list):
        raise InvalidRequest(f"prompt must be a string or a list of token ids, got {type(value).__name__}", param="prompt")
    if isinstance(value, list) and value and not is_token_ids(value):
        if not all(isinstance(item, str | list) for item in value):
            raise InvalidRequest(
                "prompt must be a string, a list of token ids, or a list of those", param="prompt"
            )
        if len(value) > MAX_PROMPTS:
            raise InvalidRequest(f"prompt may batch at most {MAX_PROMPTS} prompts, got {len(value)}", param="prompt")
        return list(value)
    return [value]


def _echo(body: dict[str, Any], stream: bool) -> bool:
    echo = boolean(body, "echo", False)
    if echo and stream:
        raise InvalidRequest("echo is not supported with stream: send stream false", param="echo")
    return echo


# -- requests ------------------------------------------------------------


@attrs.frozen(kw_only=True)
class CompletionRequest:
    """A parsed ``POST /v1/completions`` body.

    ``model`` is None when the client left it out (the app then uses the
    served model). ``timeout`` is the body's ``timeout`` field in seconds;
    the app combines it with the header and ``--max-request-time``
    through ``effective_timeout``.
    """

    model: str | None
    # One per prompt of the body, in order (OpenAI's batch form has several).
    requests: tuple[RequestInput, ...]
    stream: bool = False
    include_usage: bool = False
    timeout: float | None = None
    # ``echo``: each choice's text (and logprobs) starts with its prompt's.
    echo: bool = False
    # ``max_tokens`` 0 with ``echo``: the engine samples one token (it
    # always does after a prompt) that the response leaves out.
    drop_output: bool = False
    # vLLM's ``prompt_logprobs``: each choice carries them in vLLM's shape.
    prompt_logprobs: int | None = None

    @property
    def request(self) -> RequestInput:
        """The first prompt's request (the only one unless the body batched prompts)."""
        return self.requests[0]

    @property
    def prompt(self) -> str | tuple[int, ...]:
        return self.request.prompt  # type: ignore[return-value]

    @property
    def params(self) -> SamplingParams:
        return self.request.params

    @property
    def priority(self) -> int:
        return self.request.priority

    @property
    def engine_prompt(self) -> str | list[int]:
        """The prompt in the form ``engine.generate`` takes."""
        return self.prompt if isinstance(self.prompt, str) else list(self.prompt)

    @classmethod
    def from_json(cls, body: Any) -> CompletionRequest:
        body = require_object(body)
        refuse_unsupported(body, "suffix", ("",), "insertion (suffix) needs a fill-in-the-middle model")
        stream = boolean(body, "stream", False)
        echo = _echo(body, stream)
        max_tokens = body.get("max_tokens")
        if max_tokens is None:
            max_tokens = 16  # OpenAI's default for completions
        drop_output = echo and type(max_tokens) is int and max_tokens == 0
        prompts = _prompts(body)
        if stream and len(prompts) > 1:
            raise InvalidRequest("a batch of prompts is not supported with stream: send stream false", param="prompt")
        structured = structured_output(body)
        requests = []
        for prompt in prompts:
            request = request_input(
                body,
                prompt,
                max_tokens=1 if drop_output else max_tokens,
                logprobs=body.get("logprobs"),
                structured=structured,
                prompt_logprobs=body.get("prompt_logprobs"),
            )
            params = request.params
            if echo and params.logprobs is not None:
                # Echoed logprobs are the prompt's: the engine scores it.
                wanted = max(params.logprobs, params.prompt_logprobs or 0)
                request = attrs.evolve(request, params=attrs.evolve(params, prompt_logprobs=wanted))
            requests.append(request)
        return cls(
            model=string(body, "model", None),
            requests=tuple(requests),
            stream=stream,
            include_usage=_stream_options(body, stream),
            timeout=timeout_field(body),
            echo=echo,
            drop_output=drop_output,
            prompt_logprobs=body.get("prompt_logprobs"),  # judged by SamplingParams above
        )


@attrs.frozen(kw_only=True)
class ChatCompletionRequest:
    """A parsed ``POST /v1/chat/completions`` body.

    ``params.logprobs`` is None unless ``logprobs`` was true; then it is
    ``top_logprobs`` (default 0). The request's prompt is ``messages`` as
    the engine takes them (templated there).
    """

    model: str | None
    messages: tuple[ChatMessage, ...]
    request: RequestInput
    stream: bool = False
    include_usage: bool = False
    timeout: float | None = None
    tools: ToolChoice | None = None
    # Extra variables for the chat template (``enable_thinking``, ...).
    chat_template_kwargs: Mapping[str, Any] | None = None
    # Whether the body set skip_special_tokens (else a parser may need them kept).
    sets_special_tokens: bool = False

    @property
    def params(self) -> SamplingParams:
        return self.request.params

    @property
    def priority(self) -> int:
        return self.request.priority

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
        body = require_object(body)
        if body.get("functions"):
            raise InvalidRequest("functions is not supported: use tools", param="functions")
        if body.get("prompt_logprobs") is not None:
            # Refused, not ignored: the chat answer has no place for them yet.
            raise InvalidRequest("prompt_logprobs is supported on /v1/completions only", param="prompt_logprobs")
        stream = boolean(body, "stream", False)
        want_logprobs = boolean(body, "logprobs", False)
        top = body.get("top_logprobs")
        if top is not None and not want_logprobs:
            raise InvalidRequest("top_logprobs needs logprobs set to true", param="top_logprobs")
        # max_completion_tokens replaced max_tokens in OpenAI's chat API; the
        # newer name wins when both are given (both are checked).
        names = dict(CHAT_NAMES)
        max_tokens = body.get("max_tokens")
        if body.get("max_completion_tokens") is not None:
            if max_tokens is not None:
                _check_field("max_tokens", max_tokens)
            max_tokens = body["max_completion_tokens"]
            names["max_tokens"] = "max_completion_tokens"
        tools = tool_choice(body)
        structured = structured_output(body)
        if tools is not None and (constraint := tools.constraint()) is not None:
            structured = constraint
        messages = chat_messages(body)
        request = request_input(
            body,
            [m.as_dict() for m in messages],
            max_tokens=max_tokens,
            logprobs=(0 if top is None else top) if want_logprobs else None,
            structured=structured,
            names=names,
        )
        return cls(
            model=string(body, "model", None),
            messages=messages,
            request=request,
            tools=tools,
            stream=stream,
            include_usage=_stream_options(body, stream),
            timeout=timeout_field(body),
            chat_template_kwargs=chat_template_kwargs(body),
            sets_special_tokens=body.get("skip_special_tokens") is not None,
        )


# The names the chat template is rendered with: a request may not set them.
RESERVED_TEMPLATE_NAMES = frozenset(
    {"messages", "conversation", "tools", "documents", "add_generation_prompt", "chat_template", "tokenize", "return_dict"}
)


def chat_template_kwargs(body: dict[str, Any]) -> dict[str, Any] | None:
    """The body's ``chat_template_kwargs`` (vLLM's): an object of extra
    template variables, such as Qwen3's ``enable_thinking``."""
    value = body.get("chat_template_kwargs")
    if value is None:
        return None
    if not isinstance(value, dict):
        raise InvalidRequest("chat_template_kwargs must be an object", param="chat_template_kwargs")
    for name in value:
        if name in RESERVED_TEMPLATE_NAMES or name.startswith("_"):
            raise InvalidRequest(
                f"chat_template_kwargs may not set {name!r}: the server renders the template with it",
                param=f"chat_template_kwargs.{name}",
            )
    return value or None


def _check_field(name: str, value: Any) -> None:
    """``value`` judged by ``SamplingParams``' rule for ``name``, though the
    request does not use it."""
    try:
        SamplingParams(**{name: value})
    except InvalidRequestError as exc:
        raise invalid(exc) from None


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
        body = require_object(body)
        has_prompt, has_messages = body.get("prompt") is not None, body.get("messages") is not None
        if has_prompt == has_messages:
            raise InvalidRequest("give exactly one of prompt or messages", param="prompt")
        if has_prompt:
            return cls(
                model=string(body, "model", None),
                prompt=string(body, "prompt", ""),
                messages=None,
                add_special_tokens=boolean(body, "add_special_tokens", True),
            )
        messages = chat_messages(body)
        try:
            as_prompt([m.as_dict() for m in messages])  # the engine's rule for a prompt of messages
        except InvalidRequestError as exc:
            raise invalid(exc, CHAT_NAMES) from None
        return cls(
            model=string(body, "model", None),
            prompt=None,
            messages=messages,
            add_special_tokens=boolean(body, "add_special_tokens", False),
            add_generation_prompt=boolean(body, "add_generation_prompt", True),
        )


@attrs.frozen(kw_only=True)
class DetokenizeRequest:
    """A parsed ``POST /detokenize`` body."""

    model: str | None
    tokens: tuple[int, ...]

    @classmethod
    def from_json(cls, body: Any) -> DetokenizeRequest:
        body = require_object(body)
        if body.get("tokens") is None:
            raise InvalidRequest("tokens is required", param="tokens")
        return cls(model=string(body, "model", None), tokens=token_ids(body["tokens"], "tokens"))
