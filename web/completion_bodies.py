"""The response bodies of ``/v1/completions`` and ``/v1/chat/completions``,
whole and streamed, in OpenAI's exact shapes.

The engine streams ``RequestOutput`` deltas, the ``n`` completions of a
request interleaved by ``index``. ``CompletionStream`` and
``ChatCompletionStream`` turn each delta into ``text_completion`` or
``chat.completion.chunk`` chunks (web/sse.py frames them as events);
``OutputAccumulator`` gathers the deltas into the non-streaming
``text_completion`` or ``chat.completion`` body.

Finish reasons are the engine's, except that a request ended by its
deadline reports ``"timeout"`` (see ``FINISH_REASONS``).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import attrs

from trioserve.engine.core.sequence import FinishReason

from .logprobs import TokenTexts, chat_logprobs, completion_logprobs, concat_logprobs, echo_logprobs, vllm_prompt_logprobs
from .output_reader import ChatReading, StreamedChoice

if TYPE_CHECKING:
    from trioserve.engine.core.outputs import RequestOutput, RequestTimes
    from trioserve.engine.sampling.prompt_logprobs import PromptLogprob

    from .slo import SloReport

# OpenAI's finish reasons are stop/length; the others are ours, named so a
# client can tell them apart: "timeout" is a deadline that expired (the
# request's ``timeout`` or X-Request-Timeout, or --max-request-time),
# "abort" a request cancelled on the server, "error" a failed model step;
# "queue_timeout" and "shed" end a stream already started whose request
# overload control dropped before any compute (docs/reliability.md).
FINISH_REASONS = {
    FinishReason.STOP: "stop",
    FinishReason.LENGTH: "length",
    FinishReason.ABORT: "abort",
    FinishReason.DEADLINE: "timeout",
    FinishReason.ERROR: "error",
    FinishReason.QUEUE_TIMEOUT: "queue_timeout",
    FinishReason.SHED: "shed",
}


def finish_reason(reason: FinishReason | None) -> str | None:
    return None if reason is None else FINISH_REASONS[reason]


def completion_id() -> str:
    return f"cmpl-{uuid.uuid4().hex}"


def chat_completion_id() -> str:
    return f"chatcmpl-{uuid.uuid4().hex}"


def _now() -> int:
    return int(time.time())


# -- per-choice state ------------------------------------------------------


@attrs.define
class _Choice:
    text: list[str] = attrs.field(factory=list)
    logprobs: list[Any] = attrs.field(factory=list)
    text_offset: int = 0
    started: bool = False
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    prompt_logprobs: tuple[PromptLogprob, ...] | None = None
    prompt_token_ids: tuple[int, ...] | None = None


@attrs.define
class _Choices:
    """What a request's completions have produced so far, by index."""

    by_index: dict[int, _Choice] = attrs.field(factory=dict)
    num_prompt_tokens: int = 0
    # Latency objectives (web/slo.py): the report ``usage.slo`` gives, and
    # the first completion's latest times it measures from.
    slo: SloReport | None = None
    times: RequestTimes | None = None

    def update(self, output: RequestOutput) -> _Choice:
        choice = self.by_index.setdefault(output.index, _Choice())
        self.num_prompt_tokens = output.num_prompt_tokens
        if output.index == 0:
            self.times = output.times
        choice.num_output_tokens = output.num_output_tokens
        choice.num_cached_tokens = output.num_cached_tokens
        if output.finish_reason is not None:
            choice.finish_reason = output.finish_reason
            choice.stop_reason = output.stop_reason
        if output.prompt_logprobs is not None:
            choice.prompt_logprobs = output.prompt_logprobs
            choice.prompt_token_ids = output.prompt_token_ids
        return choice

    def usage(self) -> dict[str, Any]:
        """Usage: the shared prompt counts once; each completion's tokens count."""
        completion = sum(c.num_output_tokens for c in self.by_index.values())
        first = self.by_index[min(self.by_index)] if self.by_index else None
        cached = first.num_cached_tokens if first is not None else 0
        usage = {
            "prompt_tokens": self.num_prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": self.num_prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
        }
        if self.slo is not None:
            usage["slo"] = self.slo.usage(self.times, first.num_output_tokens if first is not None else 0)
        return usage


class _ReportsSlo:
    """The builders' common setter of ``usage.slo``."""

    _choices: _Choices

    def report_slo(self, report: SloReport | None) -> None:
        """Put ``report`` (web/slo.py) in the usage: the request's targets,
        whether they are enforced, predicted and measured."""
        self._choices.slo = report


# -- streams -------------------------------------------------------------


@attrs.define
class CompletionStream(_ReportsSlo):
    """Chunks of a streamed ``POST /v1/completions`` response.

    Pass ``texts`` when the request asked for logprobs. Call ``chunks`` per
    engine delta and ``final_chunks`` once all completions finished, then
    send ``SSE_DONE`` (web/sse.py).
    """

    model: str
    texts: TokenTexts | None = None
    include_usage: bool = False
    id: str = attrs.field(factory=completion_id)
    created: int = attrs.field(factory=_now)
    # vLLM's ``prompt_logprobs`` asked for: a completion's first chunk with
    # text carries them (pass ``texts`` too).
    prompt_logprobs: bool = False
    _choices: _Choices = attrs.field(factory=_Choices, init=False)

    def _chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        chunk = {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model, "choices": choices}
        if self.include_usage:
            chunk["usage"] = None
        return chunk

    def chunks(self, output: RequestOutput) -> list[dict[str, Any]]:
        choice = self._choices.update(output)
        logprobs = None
        if self.texts is not None:
            logprobs, choice.text_offset = completion_logprobs(output.logprobs, self.texts, choice.text_offset)
        if not output.text_delta and not output.logprobs and output.finish_reason is None:
            # The detokenizer is holding text back; nothing to say yet (the
            # prompt's logprobs wait in the choice for the next chunk).
            return []
        body = {
            "index": output.index,
            "text": output.text_delta,
            "logprobs": logprobs,
            "finish_reason": finish_reason(output.finish_reason),
            "stop_reason": output.stop_reason,
        }
        if self.prompt_logprobs and self.texts is not None and not choice.started:
            choice.started = True
            ids, scored = choice.prompt_token_ids, choice.prompt_logprobs
            body["prompt_logprobs"] = None if ids is None or scored is None else vllm_prompt_logprobs(ids, scored, self.texts)
        return [self._chunk([body])]

    def final_chunks(self) -> list[dict[str, Any]]:
        """The usage chunk (empty ``choices``) when ``stream_options.include_usage`` asked for it."""
        if not self.include_usage:
            return []
        return [{**self._chunk([]), "usage": self._choices.usage()}]


@attrs.define
class ChatCompletionStream(_ReportsSlo):
    """Chunks of a streamed ``POST /v1/chat/completions`` response.

    Each completion's first chunk carries ``delta.role``; later ones carry
    ``delta.content`` and, with logprobs, ``logprobs.content``.
    """

    model: str
    texts: TokenTexts | None = None
    include_usage: bool = False
    id: str = attrs.field(factory=chat_completion_id)
    created: int = attrs.field(factory=_now)
    # Reasoning and tool calls read out of the text (web/output_reader.py).
    reading: ChatReading = attrs.field(factory=ChatReading)
    _choices: _Choices = attrs.field(factory=_Choices, init=False)
    _readers: dict[int, StreamedChoice] = attrs.field(factory=dict, init=False)

    def _chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        chunk = {"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model}
        chunk["choices"] = choices
        if self.include_usage:
            chunk["usage"] = None
        return chunk

    @staticmethod
    def _choice(index: int, delta: dict[str, Any], logprobs: Any = None, output: RequestOutput | None = None) -> dict[str, Any]:
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": None}
        if output is not None and output.finish_reason is not None:
            choice["finish_reason"] = finish_reason(output.finish_reason)
            choice["stop_reason"] = output.stop_reason
        return choice

    def chunks(self, output: RequestOutput) -> list[dict[str, Any]]:
        choice = self._choices.update(output)
        chunks = []
        if not choice.started:
            choice.started = True
            chunks.append(self._chunk([self._choice(output.index, {"role": "assistant", "content": ""})]))
        logprobs = None
        if self.texts is not None and output.logprobs:
            logprobs = {"content": chat_logprobs(output.logprobs, self.texts), "refusal": None}
        if self.reading.active:
            return chunks + self._read_chunks(output, logprobs)
        if output.text_delta or logprobs is not None or output.finish_reason is not None:
            delta = {"content": output.text_delta} if output.text_delta or logprobs is not None else {}
            chunks.append(self._chunk([self._choice(output.index, delta, logprobs, output)]))
        return chunks

    def _read_chunks(self, output: RequestOutput, logprobs: Any) -> list[dict[str, Any]]:
        # Reasoning goes as delta.reasoning_content; a call's first delta
        # (index, id, type, name) goes once its name is known, then its
        # arguments as they come (web/tool_stream.py).
        reader = self._readers.setdefault(output.index, StreamedChoice(self.reading))
        read = reader.feed(output.text_delta, final=output.finish_reason is not None)
        piece = read.piece
        chunks = []
        if read.reasoning:
            chunks.append(self._chunk([self._choice(output.index, {"reasoning_content": read.reasoning})]))
        if piece.content or logprobs is not None:
            chunks.append(self._chunk([self._choice(output.index, {"content": piece.content}, logprobs)]))
        if piece.tool_calls:
            chunks.append(self._chunk([self._choice(output.index, {"tool_calls": list(piece.tool_calls)})]))
        if output.finish_reason is not None:
            final = self._choice(output.index, {}, None, output)
            if reader.num_calls and output.finish_reason is FinishReason.STOP:
                final["finish_reason"] = "tool_calls"
            chunks.append(self._chunk([final]))
        return chunks

    def final_chunks(self) -> list[dict[str, Any]]:
        """The usage chunk (empty ``choices``) when ``stream_options.include_usage`` asked for it."""
        if not self.include_usage:
            return []
        return [{**self._chunk([]), "usage": self._choices.usage()}]


# -- whole bodies ----------------------------------------------------------


@attrs.define
class OutputAccumulator(_ReportsSlo):
    """Gathers a request's deltas into one non-streaming body.

    ``n`` is the number of completions to wait for; pass ``texts`` when the
    request asked for logprobs.
    """

    n: int = 1
    texts: TokenTexts | None = None
    # ``echo``: the prompt's text, which each completion's text starts with
    # (and its logprobs with the prompt's, when the engine scored it).
    echo: str | None = None
    # ``max_tokens`` 0 with ``echo``: the sampled token is left out.
    drop_output: bool = False
    # vLLM's ``prompt_logprobs`` asked for: each choice carries them.
    prompt_logprobs: bool = False
    _choices: _Choices = attrs.field(factory=_Choices, init=False)

    def add(self, output: RequestOutput) -> None:
        choice = self._choices.update(output)
        choice.text.append(output.text_delta)
        choice.logprobs.extend(output.logprobs)

    @property
    def finished(self) -> bool:
        done = [c for c in self._choices.by_index.values() if c.finish_reason is not None]
        return len(done) >= self.n

    @property
    def timed_out(self) -> bool:
        """Whether any completion ended by its deadline (the app answers 504)."""
        return any(c.finish_reason is FinishReason.DEADLINE for c in self._choices.by_index.values())

    @property
    def num_output_tokens(self) -> int:
        return sum(c.num_output_tokens for c in self._choices.by_index.values())

    def usage(self) -> dict[str, Any]:
        usage = self._choices.usage()
        if self.drop_output:
            usage["total_tokens"] -= usage["completion_tokens"]
            usage["completion_tokens"] = 0
        return usage

    def _sorted(self) -> list[tuple[int, _Choice]]:
        return sorted(self._choices.by_index.items())

    def completion_body(self, model: str, *, id: str | None = None, created: int | None = None) -> dict[str, Any]:
        """A ``text_completion`` body."""

        def content(choice: _Choice) -> dict[str, Any]:
            text = "" if self.drop_output else "".join(choice.text)
            logprobs = None
            scored = choice.prompt_token_ids is not None and choice.prompt_logprobs is not None
            if self.texts is not None:
                logprobs, offset = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}, 0
                if self.echo is not None and scored:
                    logprobs, offset = echo_logprobs(choice.prompt_token_ids, choice.prompt_logprobs, self.texts)
                if not self.drop_output:
                    logprobs = concat_logprobs(logprobs, completion_logprobs(choice.logprobs, self.texts, offset)[0])
            body: dict[str, Any] = {"text": text if self.echo is None else self.echo + text, "logprobs": logprobs}
            if self.prompt_logprobs:
                body["prompt_logprobs"] = (
                    vllm_prompt_logprobs(choice.prompt_token_ids, choice.prompt_logprobs, self.texts) if scored else None
                )
            return body

        return self._body(model, "text_completion", id or completion_id(), created, content)

    def chat_completion_body(
        self, model: str, *, id: str | None = None, created: int | None = None, reading: ChatReading | None = None
    ) -> dict[str, Any]:
        """A ``chat.completion`` body; ``reading`` says how a choice's text
        is read (web/output_reader.py): its reasoning becomes
        ``message.reasoning_content``, its calls ``message.tool_calls`` and
        its finish reason ``tool_calls``."""

        def content(choice: _Choice) -> dict[str, Any]:
            logprobs = None
            if self.texts is not None:
                logprobs = {"content": chat_logprobs(choice.logprobs, self.texts), "refusal": None}
            text = "".join(choice.text)
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if reading is not None and reading.active:
                message = reading.message(text)
            return {"message": message, "logprobs": logprobs}

        body = self._body(model, "chat.completion", id or chat_completion_id(), created, content)
        for choice in body["choices"]:
            if choice["message"].get("tool_calls") and choice["finish_reason"] == "stop":
                choice["finish_reason"] = "tool_calls"
        return body

    def _body(
        self, model: str, kind: str, id: str, created: int | None, content: Callable[[_Choice], dict[str, Any]]
    ) -> dict[str, Any]:
        """The body shared by both endpoints; ``content`` gives a choice's
        text (or message) and logprobs."""
        choices = [
            {
                "index": index,
                **content(choice),
                "finish_reason": finish_reason(choice.finish_reason),
                "stop_reason": choice.stop_reason,
            }
            for index, choice in self._sorted()
        ]
        return {
            "id": id,
            "object": kind,
            "created": created if created is not None else _now(),
            "model": model,
            "choices": choices,
            "usage": self.usage(),
        }


def batch_completion_body(bodies: list[dict[str, Any]], n: int) -> dict[str, Any]:
    """One ``text_completion`` body of a batch of prompts from each
    prompt's own body (in order): prompt ``i``'s completions are choices
    ``i * n .. i * n + n - 1``; usage is the sum of theirs."""
    first = bodies[0]
    choices = [
        {**choice, "index": i * n + choice["index"]} for i, body in enumerate(bodies) for choice in body["choices"]
    ]
    usage = {key: sum(b["usage"][key] for b in bodies) for key in ("prompt_tokens", "completion_tokens", "total_tokens")}
    cached = sum(b["usage"]["prompt_tokens_details"]["cached_tokens"] for b in bodies)
    return {**first, "choices": choices, "usage": {**usage, "prompt_tokens_details": {"cached_tokens": cached}}}
