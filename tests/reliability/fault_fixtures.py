"""Test doubles that inject faults into the model step, the step thread,
the tokenizer and the detokenizer, and an engine on the fake executor.

Each double wraps the real object and misbehaves only when told to, so the
rest of a test runs on the real thing.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from contextlib import asynccontextmanager
from typing import Any

import trio

from actor_fixtures import assert_clean, tiny_loaded
from trioserve.testing import engine_config
from trioserve.actors import FakeExecutor, open_engine
from trioserve.engine.core.outputs import RequestOutput
from trioserve.engine.sampling.sampling_params import SamplingParams

STEP = 0.01  # virtual seconds per fake step


def greedy(max_tokens: int = 8, **kw: Any) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def tokens(outputs: list[RequestOutput], index: int = 0) -> list[int]:
    return [t for out in outputs if out.index == index for t in out.new_token_ids]


@asynccontextmanager
async def fake_engine(*, engine_kw: dict[str, Any] | None = None, clean: bool = True, **executor_kw: Any):
    """An engine on the tiny model's tokenizer and a ``FakeExecutor``
    (``executor_kw`` goes to it); checks the engine ended clean."""
    executors: list[FakeExecutor] = []

    def make(core):
        executor_kw.setdefault("step_time", STEP)
        executors.append(FakeExecutor.for_core(core, **executor_kw))
        return executors[0]

    async with open_engine(engine_config(), loaded=tiny_loaded(), executor=make, **(engine_kw or {})) as engine:
        engine.fake = executors[0]
        yield engine
    if clean:
        assert_clean(engine)


class FaultyRunner:
    """Wraps a ``ModelRunner``. ``fault(plan)`` (called on the step thread)
    picks what a step does: None runs it; ``"raise"`` raises
    ``RuntimeError``; ``"exit"`` raises ``SystemExit``, which ends the step
    thread as an exception raised into it would; ``"hang"`` blocks the step
    (before it computes) until ``release`` is set, then runs it.

    Records the thread of every step, and sets ``hung`` once a step hangs.
    """

    def __init__(self, runner: Any, fault: Callable[[Any], str | None]) -> None:
        self.runner = runner
        self.fault = fault
        self.release = threading.Event()
        self.hung = threading.Event()
        self.threads: list[threading.Thread] = []
        self.hung_thread: threading.Thread | None = None

    def execute(self, plan: Any) -> Any:
        self.threads.append(threading.current_thread())
        action = self.fault(plan)
        if action == "raise":
            raise RuntimeError("injected fault in the model step")
        if action == "exit":
            raise SystemExit("injected: the step thread is torn down")
        if action == "hang":
            self.hung_thread = threading.current_thread()
            self.hung.set()
            if not self.release.wait(timeout=120):
                raise TimeoutError("the test never released the hung step")
        return self.runner.execute(plan)


def prompt_has(plan: Any, marker: list[int]) -> bool:
    """Whether a chunk of ``plan`` computes the token sequence ``marker``
    (a prompt holding it, in the step that prefills it)."""
    n = len(marker)
    for chunk in plan.chunks:
        tokens = list(chunk.token_ids)
        if any(tokens[i : i + n] == marker for i in range(len(tokens) - n + 1)):
            return True
    return False


class FaultyTokenizer:
    """Wraps a tokenizer; ``encode`` raises for a text containing
    ``encode_marker``, ``decode`` raises for ids containing ``poison``, and
    once ``arm_decode()`` was called the next ``decode`` raises (once).
    Everything else is the real tokenizer's."""

    def __init__(self, tokenizer: Any, *, encode_marker: str | None = None, poison: int | None = None) -> None:
        self._tokenizer = tokenizer
        # The real methods, taken now: a test may patch them on the
        # tokenizer itself with this object's.
        self._encode = tokenizer.encode
        self._decode = tokenizer.decode
        self.encode_marker = encode_marker
        self.poison = poison
        self._armed = threading.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tokenizer, name)

    def arm_decode(self) -> None:
        self._armed.set()

    def encode(self, text: str, *args: Any, **kwargs: Any) -> Any:
        if self.encode_marker is not None and self.encode_marker in text:
            raise RuntimeError("injected fault in the tokenizer")
        return self._encode(text, *args, **kwargs)

    def decode(self, ids: Any, *args: Any, **kwargs: Any) -> str:
        if self.poison is not None and self.poison in list(ids):
            raise ValueError("injected fault in the detokenizer")
        if self._armed.is_set():
            self._armed.clear()
            raise ValueError("injected one-shot fault in the detokenizer")
        return self._decode(ids, *args, **kwargs)


class HangOnce:
    """A ``FakeExecutor`` ``delay`` hook: the first step that computes
    ``request_id``'s third token takes ``seconds`` more; ``plan`` is that step."""

    def __init__(self, request_id: str, seconds: float) -> None:
        self.request_id = request_id
        self.seconds = seconds
        self.plan: Any = None

    def __call__(self, index: int, plan: Any) -> float:
        if self.plan is not None:
            return 0.0  # once
        for chunk in plan.chunks:
            if chunk.request_id == self.request_id and chunk.sampling and chunk.sampling.num_output_tokens == 2:
                self.plan = plan
                return self.seconds
        return 0.0


async def wait_until(predicate: Callable[[], bool], *, poll: float = 0.01) -> None:
    """Poll ``predicate`` (engine statistics) until true; bound it with
    ``trio.fail_after`` around the call."""
    while not predicate():
        await trio.sleep(poll)
