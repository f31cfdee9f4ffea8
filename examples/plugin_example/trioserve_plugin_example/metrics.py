"""Metrics plugins: collectors registered on the server's Prometheus registry."""

from __future__ import annotations

import time
from typing import Any

from prometheus_client import Gauge


def register(registry: Any) -> None:
    """``example_plugin_loaded_timestamp_seconds``: when the server loaded this plugin."""
    gauge = Gauge(
        "example_plugin_loaded_timestamp_seconds", "When the example plugin was loaded (Unix time).", registry=registry
    )
    gauge.set(time.time())


class _Broken:
    def describe(self) -> list[Any]:
        return []

    def collect(self) -> list[Any]:
        raise RuntimeError("this collector always fails, to show that /metrics survives it")


def register_faulty(registry: Any) -> None:
    """A collector whose ``collect`` raises: its scrape is left out, nothing else."""
    registry.register(_Broken())
