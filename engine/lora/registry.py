"""The adapters an engine has loaded, by name, bounded by ``max_loras``.

The core owns one (``EngineCore.lora``) and its runner reads the same
object during a step; it changes only between steps (the actors apply a
load or unload at a step boundary, actors/boundary.py), so a step never
sees it change.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import TYPE_CHECKING

import attrs

from trioserve.engine.lora.adapter import LoraAdapter, LoraError, load_adapter

if TYPE_CHECKING:
    from trioserve.engine.config import EngineConfig
    from trioserve.engine.loading.loader import LoadedModel


class LoraNotFound(LoraError):
    """No adapter of that name is loaded (HTTP 404)."""


class LoraInUse(LoraError):
    """The adapter serves requests still running (HTTP 409)."""


@attrs.frozen
class LoraRef:
    """Which adapter a request runs with: its name and the digest of its
    weights, so a different adapter loaded later under the same name is a
    different adapter (its requests never share the old one's cached blocks)."""

    name: str
    digest: str

    @property
    def root_hash(self) -> int:
        """The parent hash of the request's first KV block (``block_manager.hash_block``):
        64 bits of the name and digest, the same in every process (no ``hash(str)``)."""
        raw = hashlib.sha256(f"lora\0{self.name}\0{self.digest}".encode()).digest()
        return int.from_bytes(raw[:8], "little", signed=True)


@attrs.define
class LoraRegistry:
    """The loaded adapters; ``max_rank`` is the rank bound loading checks."""

    max_loras: int
    max_rank: int
    _adapters: dict[str, LoraAdapter] = attrs.field(factory=dict, init=False)
    # Admitted requests by id -> the adapter name they run with (``use``);
    # the ended ones are dropped once it doubles (``_prune_at``) and at unloads.
    _users: dict[str, str] = attrs.field(factory=dict, init=False)
    _prune_at: int = attrs.field(default=64, init=False)

    def use(self, request_id: str, ref: LoraRef, alive: Callable[[str], bool]) -> None:
        """Record that request ``request_id`` runs ``ref``'s adapter, so it
        is not unloaded under it (``check_unused``); ``alive`` says which
        recorded requests have not ended."""
        if len(self._users) >= self._prune_at:
            self._prune(alive)
            self._prune_at = max(64, 2 * len(self._users))
        self._users[request_id] = ref.name

    def _prune(self, alive: Callable[[str], bool]) -> None:
        self._users = {rid: n for rid, n in self._users.items() if alive(rid)}

    def check_unused(self, name: str, alive: Callable[[str], bool]) -> None:
        """``LoraInUse`` naming ``lora_name`` if a request still ``alive``
        runs adapter ``name``; forgets the requests that are not."""
        self._prune(alive)
        users = sorted(rid for rid, n in self._users.items() if n == name)
        if users:
            raise LoraInUse(
                f"adapter {name!r} serves {len(users)} running request(s) ({', '.join(users[:3])}); "
                "unload it once they finish",
                field="lora_name",
            )

    def add(self, adapter: LoraAdapter) -> None:
        """Serve ``adapter`` from now on; ``LoraError`` naming ``lora_name``
        if its name is taken or ``max_loras`` are loaded (nothing is evicted)."""
        if adapter.name in self._adapters:
            raise LoraError(f"adapter {adapter.name!r} is already loaded; unload it first", field="lora_name")
        if len(self._adapters) >= self.max_loras:
            raise LoraError(
                f"cannot load adapter {adapter.name!r}: max_loras reached ({self.max_loras} loaded: "
                f"{', '.join(sorted(self._adapters))}); unload one",
                field="lora_name",
            )
        self._adapters[adapter.name] = adapter

    def remove(self, name: str) -> LoraAdapter:
        """Stop serving ``name``; ``LoraNotFound`` if it is not loaded."""
        adapter = self._adapters.pop(name, None)
        if adapter is None:
            raise LoraNotFound(f"no adapter {name!r} is loaded", field="lora_name")
        return adapter

    def get(self, name: str) -> LoraAdapter | None:
        return self._adapters.get(name)

    def ref(self, name: str) -> LoraRef:
        """The reference a request to ``name`` carries; ``LoraNotFound`` (naming ``model``) if not loaded."""
        adapter = self._adapters.get(name)
        if adapter is None:
            raise LoraNotFound(f"no adapter {name!r} is loaded", field="model")
        return LoraRef(adapter.name, adapter.digest)

    def resolve(self, ref: LoraRef) -> LoraAdapter | None:
        """The adapter ``ref`` was made for, if it is still loaded."""
        adapter = self._adapters.get(ref.name)
        return adapter if adapter is not None and adapter.digest == ref.digest else None

    def adapters(self) -> tuple[LoraAdapter, ...]:
        """The loaded adapters, in loading order."""
        return tuple(self._adapters.values())

    def __len__(self) -> int:
        return len(self._adapters)


def serving_registry(config: EngineConfig, loaded: LoadedModel, *, has_runner: bool) -> LoraRegistry | None:
    """The registry of an engine of ``config`` on ``loaded`` (None without
    ``config.lora``), its ``--lora-modules`` loaded. ``ValueError`` where
    LoRA cannot run: the adapters' deltas are added by our own model's
    layers in this process's step."""
    lora = config.lora
    if lora is None:
        return None
    if config.tensor_parallel_size > 1 or config.data_parallel_size > 1 or not has_runner:
        raise ValueError(
            "LoRA adapters run with tensor_parallel_size 1, data_parallel_size 1 and worker_mode 'thread' only"
        )
    from trioserve.engine.models.llama import LlamaForCausalLM  # the model, only once LoRA is asked for

    if not isinstance(loaded.model, LlamaForCausalLM):
        raise ValueError(f"LoRA adapters need a natively run model; {loaded.name} runs on the transformers fallback")
    registry = LoraRegistry(lora.max_loras, lora.max_lora_rank)
    for module in lora.modules:
        registry.add(
            load_adapter(
                module.name, module.path, loaded.model_config, max_rank=lora.max_lora_rank,
                base_model_name=module.base_model_name, device=loaded.device,
            )
        )  # fmt: skip
    return registry
