"""What a GGUF file says of its model that transformers' GGUF reader drops.

transformers 5 rebuilds a Llama, Qwen2/3, Gemma 2/3 or Phi-3 config from a
GGUF's metadata with a fixed table of keys per architecture, and leaves the
rest at the config class's defaults, which are one checkpoint's values: a
Qwen3's head width (the default 128, where the file states its own in
``attention.key_length``: the model then fails to load), a Llama's
biases (present in the file, dropped from the model), Gemma 2's
soft-caps, Gemma's attention scale, rotary scaling (linear, yarn; Phi-3's
longrope tables and partial rotary). ``complete`` puts back what the file
states, or what llama.cpp derives where the file states nothing (Gemma's
attention scale), so the converted checkpoint computes what llama.cpp
computes from the same file. Used by ``gguf_cache`` in its converting child.

Not recovered: a llama3 rotary (llama.cpp keeps only its table of
per-frequency divisors, ``rope_freqs``, from which the config's four
parameters do not follow in general): such a file converts with plain
rotary, as transformers reads it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from trioserve.engine.errors import ModelLoadError

# llama.cpp architectures of the dense families the decoder runs natively
# that transformers 5.25's GGUF reader converts (Mistral is written as llama).
READABLE = ("gemma2", "gemma3", "llama", "phi3", "qwen2", "qwen3")
# Architectures llama.cpp writes that transformers cannot read back: refused
# by name rather than with transformers' own message.
UNREADABLE = ("smollm3",)
# llama.cpp's LLM_TYPE_27B, by layer count: the one Gemma whose attention
# scale is 1/sqrt(hidden / heads) rather than 1/sqrt(head_dim).
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}


def read_metadata(path: Path) -> tuple[dict[str, Any], dict[str, list[float]]]:
    """The GGUF's metadata (scalars and arrays, by key; its tensors' names
    under ``"tensors"``), and its rotary factor tables
    (``rope_factors_long``/``_short``, ``rope_freqs``) as lists."""
    import gguf

    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as exc:  # gguf raises ValueError, struct.error, OSError...
        raise ModelLoadError(f"{path}: not a readable GGUF model: {type(exc).__name__}: {exc}") from None
    metadata = {}
    for key, field in reader.fields.items():
        if key.startswith("tokenizer.") or key.startswith("GGUF."):
            continue
        try:
            metadata[key] = field.contents()
        except Exception:  # noqa: BLE001 - a key we cannot parse is one we do not use
            continue
    metadata["tensors"] = [t.name for t in reader.tensors]
    tables = {
        t.name.removesuffix(".weight"): [float(x) for x in gguf.quants.dequantize(t.data, t.tensor_type).reshape(-1)]
        for t in reader.tensors
        if t.name.startswith("rope_")
    }
    return metadata, tables


def check_readable(path: Path, metadata: dict[str, Any]) -> str:
    """The file's architecture; ``ModelLoadError`` naming it where the
    conversion cannot read it."""
    arch = str(metadata.get("general.architecture", ""))
    if arch in UNREADABLE:
        raise ModelLoadError(
            f"{path}: GGUF architecture {arch!r} cannot be loaded: transformers' GGUF reader, which the "
            f"conversion uses, does not read it (it reads {', '.join(READABLE)} among the families "
            f"trioserve runs); load the model's Hugging Face checkpoint folder instead"
        )
    return arch


def complete(hf: dict[str, Any], metadata: dict[str, Any], tables: dict[str, list[float]]) -> dict[str, Any]:
    """``hf`` (a config dict transformers read from the file) with what the
    file states and transformers dropped put back."""
    arch = str(metadata.get("general.architecture", ""))
    hf = dict(hf)

    def key(name: str, default: Any = None) -> Any:
        return metadata.get(f"{arch}.{name}", default)

    heads = int(hf["num_attention_heads"])
    head_dim = int(key("attention.key_length") or hf.get("head_dim") or hf["hidden_size"] // heads)
    hf["head_dim"] = head_dim
    rope = _rope(hf, arch, key, tables, head_dim)
    if arch == "gemma3":
        params = dict(hf.get("rope_parameters") or {})
        params["full_attention"] = {**dict(params.get("full_attention") or {}), **rope}
        hf["rope_parameters"] = params
    else:
        hf["rope_parameters"] = {**dict(hf.get("rope_parameters") or {}), **rope}
        hf.pop("rope_scaling", None)
    if "partial_rotary_factor" in rope:
        hf["partial_rotary_factor"] = rope["partial_rotary_factor"]
    if arch == "llama":
        # Llama's attention_bias (q/k/v and o): the file holds the biases or not.
        hf["attention_bias"] = any(name.endswith("attn_q.bias") for name in metadata.get("tensors", ()))
    pad = hf.get("pad_token_id")
    if isinstance(pad, int) and not 0 <= pad < int(hf["vocab_size"]):
        # A class default (Phi-3's 32000) for a file that states no padding token.
        hf["pad_token_id"] = None
    if arch in ("gemma2", "gemma3"):
        big = int(hf["num_hidden_layers"]) == _GEMMA_27B_LAYERS[arch]
        hf["query_pre_attn_scalar"] = int(hf["hidden_size"]) // heads if big else head_dim
    if arch == "gemma2":
        for name in ("attn_logit_softcapping", "final_logit_softcapping"):
            hf[name] = key(name)
    return hf


def _rope(hf: dict[str, Any], arch: str, key: Any, tables: dict[str, list[float]], head_dim: int) -> dict[str, Any]:
    """The rotary parameters the file states, in transformers 5's form."""
    theta = key("rope.freq_base", hf.get("rope_theta"))
    rope: dict[str, Any] = {"rope_type": "default"} if theta is None else {"rope_type": "default", "rope_theta": float(theta)}
    dims = key("rope.dimension_count")
    if dims is not None and int(dims) != head_dim:
        rope["partial_rotary_factor"] = int(dims) / head_dim
    kind = key("rope.scaling.type")
    original = key("rope.scaling.original_context_length")
    if kind in ("linear", "yarn"):
        rope.update(rope_type=kind, factor=float(key("rope.scaling.factor", 1.0)))
        if kind == "yarn" and original:
            rope["original_max_position_embeddings"] = int(original)
    elif "rope_factors_short" in tables:  # Phi-3's longrope
        rope.update(
            rope_type="longrope",
            short_factor=tables["rope_factors_short"],
            long_factor=tables.get("rope_factors_long", tables["rope_factors_short"]),
            original_max_position_embeddings=int(original or hf["max_position_embeddings"]),
        )
        hf["original_max_position_embeddings"] = rope["original_max_position_embeddings"]
    return rope
