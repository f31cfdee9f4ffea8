"""``/v1/files``: the Batch API's files, as OpenAI's files API has them.

``POST /v1/files`` takes a multipart form with ``file`` and ``purpose``
(``batch``); its size is bounded by ``--max-upload-size`` (413 beyond, read
by web/body.py before the handler runs). ``GET /v1/files`` lists them
(``purpose``, ``after``, ``limit``, ``order``), ``GET /v1/files/ID`` gives
one, ``GET /v1/files/ID/content`` its bytes, ``DELETE /v1/files/ID``
deletes it. A batch's output and error files are listed here with purpose
``batch_output`` once the batch ends.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from typing import Any

import trio
from quart import Blueprint, Response, g, request
from werkzeug.exceptions import HTTPException
from werkzeug.formparser import MultiPartParser
from werkzeug.http import parse_options_header

from .batch_service import current_batches
from .errors import ApiError, InvalidRequest, NotFoundError
from .responses import json_response

PATH = "/v1/files"
# The purposes an upload may have: this server keeps files for batches only.
UPLOAD_PURPOSES = ("batch",)
# Parts a multipart upload may have (file, purpose and a few the client adds).
MAX_FORM_PARTS = 16
# OpenAI's bounds on a files list.
DEFAULT_FILES_LIMIT = 10000


def register(blueprint: Blueprint) -> None:
    blueprint.add_url_rule(PATH, view_func=upload_file, methods=["POST"])
    blueprint.add_url_rule(PATH, view_func=list_files, methods=["GET"])
    blueprint.add_url_rule(f"{PATH}/<file_id>", view_func=retrieve_file, methods=["GET"])
    blueprint.add_url_rule(f"{PATH}/<file_id>", view_func=delete_file, methods=["DELETE"])
    blueprint.add_url_rule(f"{PATH}/<file_id>/content", view_func=file_content, methods=["GET"])


async def upload_file() -> Response:
    mimetype, options = parse_options_header(request.headers.get("Content-Type", ""))
    if mimetype != "multipart/form-data" or not options.get("boundary"):
        raise InvalidRequest("POST /v1/files takes a multipart/form-data body with the fields file and purpose", param="file")
    parser = MultiPartParser(max_form_parts=MAX_FORM_PARTS)
    try:
        form, files = parser.parse(io.BytesIO(g.body), options["boundary"].encode("latin-1"), len(g.body))
    except (HTTPException, ValueError) as exc:
        raise InvalidRequest(f"the multipart body cannot be read: {exc}", param="file") from None
    purpose = form.get("purpose")
    if purpose is None:
        raise InvalidRequest("purpose is required", param="purpose")
    if purpose not in UPLOAD_PURPOSES:
        raise InvalidRequest(f"purpose must be one of {', '.join(UPLOAD_PURPOSES)}; got {purpose!r}", param="purpose")
    upload = files.get("file")
    if upload is None:
        raise InvalidRequest("file is required: a form field holding the file", param="file")
    data = upload.read()
    store = current_batches().store
    meta = await trio.to_thread.run_sync(lambda: store.add_file(data, filename=upload.filename or "upload.jsonl", purpose=purpose))
    return json_response(meta)


async def list_files() -> Response:
    purpose = request.args.get("purpose")
    files = [f for f in current_batches().store.files() if purpose is None or f["purpose"] == purpose]
    return json_response(page(files, DEFAULT_FILES_LIMIT, maximum=DEFAULT_FILES_LIMIT))


async def retrieve_file(file_id: str) -> Response:
    return json_response(_file(file_id))


async def file_content(file_id: str) -> Response:
    _file(file_id)
    data = await trio.to_thread.run_sync(current_batches().store.data_path(file_id).read_bytes)
    return Response(data, content_type="application/octet-stream")


async def delete_file(file_id: str) -> Response:
    _file(file_id)
    service = current_batches()
    if service.in_use(file_id):
        raise ApiError(
            409, f"file {file_id} is the input of a batch still running", type="invalid_request_error", param="file_id", code="file_in_use"
        )
    service.store.delete_file(file_id)
    return json_response({"id": file_id, "object": "file", "deleted": True})


def _file(file_id: str) -> dict[str, Any]:
    meta = current_batches().store.file(file_id)
    if meta is None:
        raise NotFoundError(f"no file with id {file_id!r}", param="file_id", code="file_not_found")
    return meta


def page(items: Sequence[dict[str, Any]], default_limit: int, *, maximum: int) -> dict[str, Any]:
    """A list response of ``items`` (newest first) as the query's ``after``,
    ``limit`` and ``order`` (``asc`` or ``desc``) ask."""
    order = request.args.get("order", "desc")
    if order not in ("asc", "desc"):
        raise InvalidRequest(f"order must be 'asc' or 'desc'; got {order!r}", param="order")
    items = list(items) if order == "desc" else list(reversed(items))
    text = request.args.get("limit")
    try:
        limit = default_limit if text is None else int(text)
    except ValueError:
        limit = 0
    if not 1 <= limit <= maximum:
        raise InvalidRequest(f"limit must be a whole number in [1, {maximum}]; got {text!r}", param="limit")
    after = request.args.get("after")
    if after is not None:
        ids = [item["id"] for item in items]
        if after not in ids:
            raise InvalidRequest(f"after names no listed object: {after!r}", param="after")
        items = items[ids.index(after) + 1 :]
    data = items[:limit]
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": len(items) > limit,
    }
