"""What a request that failed by a fault is told: a ``RequestFailed``
whose ``code`` names the fault and whose public message holds no inner
error text (it may quote paths or the prompt); the whole text, with the
cause chained, is for the log (docs/reliability.md)."""

from __future__ import annotations

from trioserve.engine.plugins import PluginError
from trioserve.engine.runtime.step_thread import StepThreadClosed, StepThreadDied
from trioserve.engine.sampling.grammar import GrammarError

from .errors import RequestFailed, StepHung, WorkerUnavailable


def step_failure(request_id: str, error: Exception) -> RequestFailed:
    """The error of a request whose model step failed with ``error``: its
    class is named, never its text, in what the client is told."""
    if isinstance(error, StepHung):
        code, public = "step_hung", str(error)
    elif isinstance(error, (StepThreadDied, StepThreadClosed)):
        code, public = "step_thread_died", "the model step's thread died during the step"
    elif isinstance(error, WorkerUnavailable):
        code, public = "worker_unavailable", "the model worker process is down and is not restarted"
    else:
        code, public = "step_failed", f"the model step failed ({type(error).__name__})"
    message = public if code == "step_hung" else f"{public}: {error}"
    failure = RequestFailed(message, request_id=request_id, code=code, public_message=public)
    failure.__cause__ = error
    return failure


def output_failure(request_id: str, error: Exception) -> RequestFailed:
    """The error of a request whose output could not be made: its
    detokenizer, its grammar or a logits processor (a plugin) failed."""
    if isinstance(error, PluginError):
        public, code, detail = str(error), "plugin_error", error.detail
    elif isinstance(error, GrammarError):
        public, code, detail = str(error), "structured_output_failed", str(error)
    else:
        public = f"the detokenizer failed on this request's output ({type(error).__name__})"
        code = "detokenizer_failed"
        detail = str(error)
    failure = RequestFailed(f"{public}: {detail}", request_id=request_id, code=code, public_message=public)
    failure.__cause__ = error
    return failure
