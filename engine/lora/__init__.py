"""LoRA adapters loaded at run time (docs/api.md, "LoRA adapters"): read
from PEFT folders (``adapter``), held by name (``registry``), and added to
the base model's projections per group of token rows (``projections``)."""

from trioserve.engine.lora.adapter import LoraAdapter, LoraDelta, LoraError, load_adapter
from trioserve.engine.lora.config import LoraConfig, LoraModule
from trioserve.engine.lora.registry import LoraInUse, LoraNotFound, LoraRef, LoraRegistry

__all__ = [
    "LoraAdapter", "LoraConfig", "LoraDelta", "LoraError", "LoraInUse", "LoraModule", "LoraNotFound",
    "LoraRef", "LoraRegistry", "load_adapter",
]  # fmt: skip
