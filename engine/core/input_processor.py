"""The core's side of a request's edge: a prompt into token ids, a request
into the ``NewRequest`` the core trusts.

Where the model is known, ``validate`` checks what no caller can check
alone: the prompt tokenized (every id in the vocabulary, short enough to
fit with one generated token), the sampling parameters against the
vocabulary, a grammar that compiles, logits processors that exist. A fault
inside the tokenizer refuses only that request (``TokenizerError``); it is
counted, and the latest kept, for ``/health``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import attrs

from trioserve.engine.core.new_request import NewRequest
from trioserve.engine.errors import InvalidRequestError, TokenizerError
from trioserve.engine.faults import Fault
from trioserve.engine.plugins import Plugins
from trioserve.engine.sampling.grammar import GrammarMatchers
from trioserve.engine.sampling.sampling_params import SamplingParams
from trioserve.engine.text.tokenizer import apply_chat_template, check_text

log = logging.getLogger(__name__)

# A prompt: text, token ids, or chat messages (templated).
Prompt = str | Sequence[int] | Sequence[dict[str, Any]]


@attrs.define(eq=False)
class InputProcessor:
    """Tokenizes and validates requests for one core: its ``tokenizer`` and
    ``vocab_size``, its ``grammars`` (whose compiler replicas share), its
    ``plugins``, and ``check_fits`` (the scheduler's: a prompt this long
    fits ``max_model_len`` and the pool)."""

    tokenizer: Any
    vocab_size: int
    grammars: GrammarMatchers
    plugins: Plugins
    check_fits: Callable[[int], None]
    num_tokenizer_errors: int = attrs.field(init=False, default=0)
    last_fault: Fault | None = attrs.field(init=False, default=None)

    def tokenize(self, prompt: Prompt) -> list[int]:
        """Token ids of a prompt: text, token ids, or chat messages (templated).

        Raises ``InvalidRequestError`` naming the field; an exception from
        inside the tokenizer becomes ``TokenizerError`` (the request is
        refused, nothing else is affected).
        """
        try:
            return self._tokenize(prompt)
        except InvalidRequestError:
            raise
        except Exception as exc:
            field = "prompt" if isinstance(prompt, str) or not prompt or not isinstance(prompt[0], dict) else "messages"
            raise self.tokenizer_error(f"the tokenizer failed on this request's {field}", field, exc) from exc

    def tokenizer_error(self, message: str, field: str, exc: Exception) -> TokenizerError:
        """Count a fault of the tokenizer on a request's ``field`` and
        return the error that refuses the request."""
        # The class name only: the exception's text may quote the prompt,
        # which is never logged or echoed.
        message = f"{message} ({type(exc).__name__})"
        self.num_tokenizer_errors += 1
        self.last_fault = Fault("tokenizer_failed", message)
        log.warning("%s", message)
        return TokenizerError(message, field=field)

    def _tokenize(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt must not be empty", field="prompt")
            check_text(prompt, "prompt")
            return list(self.tokenizer.encode(prompt, add_special_tokens=True))
        items = list(prompt)
        if not items:
            raise InvalidRequestError("prompt must not be empty", field="prompt")
        if all(isinstance(item, dict) for item in items):
            return apply_chat_template(self.tokenizer, items, add_generation_prompt=True)
        if all(isinstance(item, int) and not isinstance(item, bool) for item in items):
            bad = next((t for t in items if not 0 <= t < self.vocab_size), None)
            if bad is not None:
                raise InvalidRequestError(
                    f"prompt has token id {bad} outside the vocabulary [0, {self.vocab_size})", field="prompt"
                )
            return items
        raise InvalidRequestError("prompt must be a string, a list of token ids or a list of messages", field="prompt")

    def validate(self, request_id: str, prompt: Prompt, params: SamplingParams | None, priority: int) -> NewRequest:
        """The request as a ``NewRequest`` (whose validators check its id
        and priority), or ``InvalidRequestError`` (``RequestTooLongError``,
        ``TokenizerError``) naming the field at fault."""
        params = params or SamplingParams()
        params.validate_for_vocab(self.vocab_size)
        if params.structured_output is not None:
            # A dict hit when Engine.prepare compiled it in a worker thread.
            self.grammars.compiler.compile(params.structured_output)
        if params.logits_processors:
            self.plugins.check_logits_processors(params.logits_processors)
        prompt_ids = self.tokenize(prompt)
        self.check_fits(len(prompt_ids))
        return NewRequest(request_id, tuple(prompt_ids), params, priority)
