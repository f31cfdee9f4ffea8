"""``Fault``: a record of something that went wrong while serving, for
``/health`` and the statistics (what happened, and when)."""

from __future__ import annotations

import time

import attrs


@attrs.frozen
class Fault:
    """One fault. ``kind`` is a short name (``step_failed``, ``step_hung``,
    ``step_thread_died``, ``tokenizer_failed``, ``detokenizer_failed``);
    ``message`` says what happened without quoting a prompt; ``time`` is
    ``time.time()``."""

    kind: str
    message: str
    time: float = attrs.field(factory=time.time)

    @staticmethod
    def latest(*faults: Fault | None) -> Fault | None:
        """The most recent of ``faults`` (None if all are None)."""
        known = [f for f in faults if f is not None]
        return max(known, key=lambda f: f.time, default=None)
