"""The store behind OpenAI's Responses API (web/responses_store.py): a
bounded, least-recently-used map of the responses kept, and its flag."""

from __future__ import annotations

import pytest

from trioserve.web.responses_store import ResponsesStore, StoredResponse
from trioserve.web.serve_options import build_serve_parser, server_config_from_args


def test_store_drops_the_least_recently_used_beyond_its_capacity():
    store = ResponsesStore(2)
    for name in ("a", "b"):
        store.put(StoredResponse({"id": name}, ()))
    assert store.get("a") is not None  # a use: b is now the oldest
    store.put(StoredResponse({"id": "c"}, ()))
    assert [store.get(name) is not None for name in ("a", "b", "c")] == [True, False, True]
    assert store.delete("a") and not store.delete("a")
    assert store.statistics().size == 1


def test_the_store_size_flag():
    args = build_serve_parser().parse_args(["--responses-store-size", "3"])
    assert server_config_from_args(args).responses_store_size == 3
    with pytest.raises(SystemExit):
        build_serve_parser().parse_args(["--responses-store-size", "0"])
