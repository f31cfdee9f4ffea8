"""A request pre-processor: refuse, rewrite, or (on request) fail."""

from __future__ import annotations

from typing import Any

from trioserve.engine.plugins import PluginRejection, RequestContext


def preprocess(body: dict[str, Any], context: RequestContext) -> dict[str, Any]:
    """Refuse requests of the user ``blocked`` (403, ``param`` ``user``);
    cap ``max_tokens`` at ``example_max_tokens`` when the body gives one;
    raise when ``example`` is ``crash-preprocessor`` (to show isolation)."""
    if body.get("user") == "blocked":
        raise PluginRejection("user 'blocked' may not use this server", status=403, param="user", code="user_blocked")
    if body.get("example") == "crash-preprocessor":
        raise RuntimeError("the example pre-processor crashed, as asked")
    cap = body.get("example_max_tokens")
    if isinstance(cap, int) and cap >= 1:
        body = {**body, "max_tokens": min(body.get("max_tokens") or cap, cap)}
    return body
