"""An output post-processor: redact, stop, or (on request) fail."""

from __future__ import annotations

from collections.abc import Callable

import attrs

from trioserve.engine.core.outputs import RequestOutput
from trioserve.engine.plugins import RequestContext
from trioserve.engine.core.sequence import FinishReason


def postprocessor(context: RequestContext) -> Callable[[RequestOutput], RequestOutput]:
    """Per request: replace each ``example_redact`` string in a delta's text
    with ``***``; end a completion with finish reason ``stop`` after
    ``example_stop_after`` deltas; raise on the second delta when
    ``example`` is ``crash-postprocessor``."""
    options = context.body or {}
    redact = options.get("example_redact")
    stop_after = options.get("example_stop_after")
    crash = options.get("example") == "crash-postprocessor"
    seen: dict[int, int] = {}

    def process(output: RequestOutput) -> RequestOutput:
        seen[output.index] = count = seen.get(output.index, 0) + 1
        if crash and count == 2:
            raise RuntimeError("the example post-processor crashed, as asked")
        text = output.text_delta.replace(redact, "***") if isinstance(redact, str) and redact else output.text_delta
        if isinstance(stop_after, int) and count >= stop_after and output.finish_reason is None:
            return attrs.evolve(output, text_delta=text, finish_reason=FinishReason.STOP, stop_reason="example_stop_after")
        return attrs.evolve(output, text_delta=text)

    return process
