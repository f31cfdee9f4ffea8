"""The LoRA flags every engine command takes (``--enable-lora``,
``--lora-modules``, ``--max-loras``, ``--max-lora-rank``), in vLLM's
spellings, and the ``LoraConfig`` they describe (engine/lora)."""

from __future__ import annotations

import argparse
import json

from trioserve.engine.lora.config import LoraConfig, LoraModule

from .option_types import recording


def lora_module(value: str) -> LoraModule:
    """One ``--lora-modules`` item: ``name=path``, or vLLM's JSON form
    ``{"name": ..., "path": ..., "base_model_name": ...}``."""
    if value.lstrip().startswith("{"):
        try:
            item = json.loads(value)
        except json.JSONDecodeError as exc:
            raise argparse.ArgumentTypeError(f"--lora-modules item is not valid JSON: {exc}") from None
        if not isinstance(item, dict) or not isinstance(item.get("name"), str) or not isinstance(item.get("path"), str):
            raise argparse.ArgumentTypeError(f'--lora-modules JSON needs "name" and "path" strings, got {value!r}')
        base = item.get("base_model_name")
        if base is not None and not isinstance(base, str):
            raise argparse.ArgumentTypeError(f"--lora-modules base_model_name must be a string, got {base!r}")
        return LoraModule(item["name"], item["path"], base)
    name, sep, path = value.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"--lora-modules takes name=path (or JSON), got {value!r}")
    return LoraModule(name, path)


def add_lora_options(parser: argparse.ArgumentParser, group: argparse._ArgumentGroup) -> list[argparse.Action]:
    """Add the LoRA flags to ``group`` of ``parser``; returns them."""
    actions: list[argparse.Action] = []
    add = recording(group, actions)
    add(
        "--enable-lora",
        action="store_true",
        help="serve LoRA adapters: loaded at start (--lora-modules) or at run time (POST /v1/load_lora_adapter); "
        "a request picks one by its model field. Every batch then runs the layers in torch, so compressed "
        "weights are not batch-invariant (docs/api.md, \"LoRA adapters\") (default: off; on with --lora-modules)",
    )
    add(
        "--lora-modules",
        nargs="+",
        action="extend",
        type=lora_module,
        default=None,
        metavar="NAME=PATH",
        help='PEFT adapter folders (adapter_config.json, adapter_model.safetensors) to serve as NAME, or JSON '
        '{"name": ..., "path": ..., "base_model_name": ...}; implies --enable-lora',
    )
    add(
        "--max-loras",
        type=int,
        default=4,
        help="adapters loaded at once at most; loading one more is refused until one is unloaded (default: 4)",
    )
    add("--max-lora-rank", type=int, default=16, help="the highest adapter rank loaded (default: 16)")
    return actions


def lora_config_from_args(args: argparse.Namespace) -> LoraConfig | None:
    """The ``LoraConfig`` of ``add_lora_options``'s values; None when LoRA is off."""
    modules = tuple(getattr(args, "lora_modules", None) or ())
    if not getattr(args, "enable_lora", False) and not modules:
        return None
    return LoraConfig(modules, max_loras=args.max_loras, max_lora_rank=args.max_lora_rank)
