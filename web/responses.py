"""JSON responses with OpenAI's field order (quart's ``jsonify`` sorts keys)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from quart import Response

from .errors import ApiError


def json_response(body: Any, status: int = 200, headers: Mapping[str, str] | None = None) -> Response:
    # A lone surrogate (only ever from a client's own text, echoed in an
    # error) cannot be UTF-8; it leaves as its JSON escape, still valid JSON.
    data = json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode("utf-8", "backslashreplace")
    return Response(data, status=status, headers=dict(headers or {}), content_type="application/json")


def error_response(error: ApiError) -> Response:
    return json_response(error.to_json(), error.status, error.headers)
