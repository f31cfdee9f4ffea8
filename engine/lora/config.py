"""What an engine serves of LoRA: the adapters to load at start and the bounds."""

from __future__ import annotations

import attrs

from trioserve.engine.validators import positive


@attrs.frozen
class LoraModule:
    """An adapter to load at start: served as ``name`` from the PEFT folder
    ``path``; ``base_model_name`` is what ``/v1/models`` shows as its parent
    (None: the served model's name)."""

    name: str
    path: str
    base_model_name: str | None = None


@attrs.frozen
class LoraConfig:
    """LoRA on an engine (``--enable-lora``, ``--lora-modules``): at most
    ``max_loras`` adapters loaded at once (loading one more is refused, never
    an eviction), none of a rank over ``max_lora_rank``; ``modules`` loaded
    at start."""

    modules: tuple[LoraModule, ...] = attrs.field(default=(), converter=tuple)
    max_loras: int = attrs.field(default=4, validator=positive)
    max_lora_rank: int = attrs.field(default=16, validator=positive)

    def __attrs_post_init__(self) -> None:
        names = [m.name for m in self.modules]
        if len(set(names)) != len(names):
            raise ValueError(f"--lora-modules names a module twice: {names}")
        if len(names) > self.max_loras:
            raise ValueError(f"--lora-modules lists {len(names)} adapters, over --max-loras ({self.max_loras})")
