"""How requests and ``/v1/models`` see LoRA adapters: a request whose
``model`` names a loaded adapter runs it on its base model
(``served_adapter``, used by ``ModelHost.get``), and ``/v1/models`` lists
each adapter with ``parent`` its base model and ``root`` its folder
(``adapter_cards``, vLLM's shape). Loading them: lora_api.py."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import attrs

from trioserve.engine.core.new_request import RequestInput
from trioserve.engine.lora import LoraAdapter

from .served import ServedModel


class AdapterEngine:
    """A base model's engine as requests naming adapter ``name`` see it:
    each request it takes runs that adapter (``RequestInput.lora``); all
    else is the base engine's."""

    def __init__(self, engine: Any, name: str) -> None:
        self.base = engine
        self.name = name

    def submit_nowait(self, request: RequestInput, **options: Any) -> Any:
        return self.base.submit_nowait(attrs.evolve(request, lora=self.name), **options)

    async def submit(self, request: RequestInput, **options: Any) -> Any:
        return await self.base.submit(attrs.evolve(request, lora=self.name), **options)

    def __getattr__(self, attribute: str) -> Any:
        return getattr(self.base, attribute)


def adapters_of(served: ServedModel) -> tuple[LoraAdapter, ...]:
    """The adapters ``served`` has loaded (a replicated engine, which
    serves none, has no ``lora_adapters``)."""
    loaded = getattr(served.engine, "lora_adapters", None)
    return () if loaded is None else loaded()


def serves_lora(served: ServedModel) -> bool:
    """Whether ``served``'s engine was started with LoRA (--enable-lora)."""
    core = getattr(served.engine, "core", None)
    return core is not None and core.lora is not None


def served_adapter(models: Iterable[ServedModel], name: str) -> ServedModel | None:
    """The model a request naming adapter ``name`` runs on, seen as that
    adapter (responses name it; its metrics are its own), or None."""
    for served in models:
        if any(adapter.name == name for adapter in adapters_of(served)):
            engine = AdapterEngine(served.engine, name)
            return ServedModel(name, engine, served.metrics, created=served.created)  # type: ignore[arg-type]
    return None


def adapter_cards(models: Iterable[ServedModel]) -> list[dict[str, Any]]:
    """``/v1/models`` entries of the loaded adapters, in vLLM's shape."""
    cards = []
    for served in models:
        for adapter in adapters_of(served):
            cards.append(
                {
                    "id": adapter.name,
                    "object": "model",
                    "created": served.created,
                    "owned_by": "trioserve",
                    "root": adapter.path,
                    "parent": adapter.base_model_name or served.name,
                    "max_model_len": served.max_model_len,
                }
            )
    return cards
