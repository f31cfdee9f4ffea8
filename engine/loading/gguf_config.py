"""What a GGUF file says of its model that transformers' GGUF reader drops.

transformers 5 rebuilds a Llama, Qwen2/3, Gemma 2/3 or Phi-3 config from a
GGUF's metadata with a fixed table of keys per architecture, and leaves the
rest at the config class's defaults, which are one checkpoint's values: a
Qwen3's head width (the default 128, where the file states its own in
``attention.key_length``: the model then fails to load), a Llama's
biases (present in the file, dropped from the model), Gemma 2's
soft-caps, Gemma's attention scale, rotary scaling (linear, yarn; Phi-3's
longrope tables and partial rotary; llama3's, which the file keeps only
as ``rope_freqs``, a divisor per frequency). ``complete`` puts back what
the file states, or what llama.cpp derives where the file states nothing
(Gemma's attention scale), so the converted checkpoint computes what
llama.cpp computes from the same file. Used by ``gguf_cache`` in its
converting child.

Files transformers' reader cannot make a model of (SmolLM3; a Llama with
experts, which is how llama.cpp writes Mixtral; Qwen3-MoE, whose expert
width it drops; gpt-oss, whose metadata it fails on) are converted by
trioserve's own reader instead, and ``native_config`` builds their config
from the metadata alone. It builds the dense Llama's, Qwen2's and Qwen3's
too, for a cache entry without weights (``describable``): the config and
tokenizer written without importing transformers (gguf_cache.py), the
same ``ModelConfig`` as transformers' reading gives
(tests/test_gguf_tokenizer.py).

A llama3 rotary's four parameters are recovered from its table
(``llama3_parameters``): the table fixes ``factor`` and the two wavelength
bounds ``original / low_freq_factor`` and ``original / high_freq_factor``
(scaling all three by one number changes no divisor), and the context is
taken from the file where it states one, else ``low_freq_factor`` is 1
(every Llama 3's); the parameters are checked to give the table back.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from trioserve.engine.errors import ModelLoadError

# config.json's model_type and architecture of what native_config builds, by
# llama.cpp's architecture ("llama" with experts is Mixtral).
_NATIVE = {
    "smollm3": ("smollm3", "SmolLM3ForCausalLM"),
    "qwen3moe": ("qwen3_moe", "Qwen3MoeForCausalLM"),
    "mixtral": ("mixtral", "MixtralForCausalLM"),
    "gpt-oss": ("gpt_oss", "GptOssForCausalLM"),
}
# The dense families native_config also builds (transformers reads them too).
_DENSE = {
    "llama": ("llama", "LlamaForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
}
# llama.cpp's SmolLM3 without a no_rope_layers array: every 4th layer has no rotary.
_SMOLLM3_NO_ROPE_STEP = 4
# llama.cpp's LLM_TYPE_27B, by layer count: the one Gemma whose attention
# scale is 1/sqrt(hidden / heads) rather than 1/sqrt(head_dim).
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}


def read_metadata(path: Path, file: Any = None) -> tuple[dict[str, Any], dict[str, list[float]]]:
    """The GGUF's metadata (scalars and arrays, by key; its tensors' names
    under ``"tensors"``), and its rotary factor tables
    (``rope_factors_long``/``_short``, ``rope_freqs``) as lists. Read from
    the header alone (``gguf_file``; ``file``, a ``GGUFFile`` of ``path``
    that reads ``metadata_strings``, where one is at hand): of the
    tokenizer's keys only its special ids (native_config's) are kept."""
    import gguf

    from trioserve.engine.loading.gguf_file import GGUFFile

    if file is None:
        file = GGUFFile(path, want_strings=metadata_strings)
    metadata = {
        key: value
        for key, value in file.fields.items()
        if not (key.startswith("tokenizer.") and not key.endswith("_token_id")) and value is not None
    }
    metadata["tensors"] = [t.name for t in file.tensors]
    tables = {
        t.name.removesuffix(".weight"): [
            float(x) for x in gguf.quants.dequantize(file.data(t), gguf.GGMLQuantizationType[t.type_name]).reshape(-1)
        ]
        for t in file.tensors
        if t.name.startswith("rope_")
    }
    return metadata, tables


def metadata_strings(key: str) -> bool:
    """The string arrays ``read_metadata`` keeps: all but the tokenizer's."""
    return not key.startswith("tokenizer.")


def native_kind(metadata: dict[str, Any]) -> str | None:
    """Which ``_NATIVE`` family the file is, for a file trioserve converts
    itself (see the module's docstring); None for one transformers reads."""
    arch = str(metadata.get("general.architecture", ""))
    if arch == "llama" and int(metadata.get("llama.expert_count") or 0) > 0:
        return "mixtral"
    return arch if arch in _NATIVE else None


def describable(metadata: dict[str, Any]) -> bool:
    """Whether ``native_config`` builds this file's config as transformers
    reads it: a ``native_kind`` or a dense family of ``_DENSE``, but for a
    Llama named exactly "mistral", which transformers reads as a Mistral
    (its name test compares the whole name), with its class's default
    sliding window; a weights conversion of the file, which transformers
    makes, must find the same model."""
    arch = str(metadata.get("general.architecture", ""))
    if arch == "llama" and metadata.get("general.name") == "mistral":
        return False
    return native_kind(metadata) is not None or arch in _DENSE


def native_config(metadata: dict[str, Any], tables: dict[str, list[float]], vocab_size: int) -> dict[str, Any]:
    """The config.json of a ``describable`` file, from its metadata (and its
    embedding table's rows, ``vocab_size``, where it states no vocabulary
    size): the fields transformers' config class of the family reads."""
    arch = str(metadata.get("general.architecture", ""))
    kind = native_kind(metadata)
    dense = kind is None
    model_type, architecture = _DENSE[arch] if dense else _NATIVE[kind]

    def key(name: str, default: Any = None) -> Any:
        value = metadata.get(f"{arch}.{name}", default)
        if value is None:
            raise ModelLoadError(f"GGUF metadata has no {arch}.{name}")
        return value

    heads = int(key("attention.head_count"))
    layers = int(key("block_count"))
    hf: dict[str, Any] = {
        "model_type": model_type,
        "architectures": [architecture],
        "hidden_size": int(key("embedding_length")),
        "intermediate_size": int(key("feed_forward_length")),
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": int(key("attention.head_count_kv", heads)),
        "max_position_embeddings": int(key("context_length")),
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon")),
        "vocab_size": int(metadata.get(f"{arch}.vocab_size") or vocab_size),
        "tie_word_embeddings": "output.weight" not in metadata.get("tensors", ()),
        "attention_bias": dense and any(name.endswith("attn_q.bias") for name in metadata.get("tensors", ())),
        "rope_theta": float(key("rope.freq_base", 10000.0)),
    }
    for name, gguf_name in (("bos", "bos"), ("eos", "eos"), ("pad", "padding")):
        token = metadata.get(f"tokenizer.ggml.{gguf_name}_token_id")
        if token is not None:
            hf[f"{name}_token_id"] = int(token)
    if kind == "smollm3":
        flags = metadata.get(f"{arch}.no_rope_layers")
        if flags is None:
            flags = [int((i + 1) % _SMOLLM3_NO_ROPE_STEP != 0) for i in range(layers)]
        hf["no_rope_layers"] = [int(f) for f in flags]
        hf["mlp_bias"] = False
    elif kind is not None:  # the mixtures
        hf["num_experts_per_tok"] = int(key("expert_used_count"))
        if kind == "qwen3moe":
            hf["num_experts"] = int(key("expert_count"))
            hf["moe_intermediate_size"] = int(key("expert_feed_forward_length"))
            # llama.cpp's qwen3moe always renormalises the top k weights, and
            # has no dense layers among the sparse ones.
            hf["norm_topk_prob"] = True
            hf["mlp_only_layers"] = []
            hf["decoder_sparse_step"] = 1
        elif kind == "gpt-oss":
            # llama.cpp's gpt-oss: q/k/v/o biases, sliding layers first and
            # alternating, SwiGLU clamped at transformers' defaults (it
            # stores neither), yarn without a truncated ramp.
            hf["num_local_experts"] = int(key("expert_count"))
            hf["intermediate_size"] = int(key("expert_feed_forward_length", hf["intermediate_size"]))
            hf["attention_bias"] = True
            hf["sliding_window"] = int(key("attention.sliding_window"))
            hf["layer_types"] = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
        else:
            hf["num_local_experts"] = int(key("expert_count"))
            hf["sliding_window"] = None
    hf = complete(hf, metadata, tables)
    if kind == "gpt-oss" and hf["rope_parameters"].get("rope_type") == "yarn":
        hf["rope_parameters"].update(beta_fast=32.0, beta_slow=1.0, truncate=False)
    hf.pop("rope_theta")  # in rope_parameters now
    return hf


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
    elif "rope_freqs" in tables:  # llama3's divisors
        rope.update(
            llama3_parameters(tables["rope_freqs"], rope.get("rope_theta", 10000.0), int(dims or head_dim), original)
        )
    elif "rope_factors_short" in tables:  # Phi-3's longrope
        rope.update(
            rope_type="longrope",
            short_factor=tables["rope_factors_short"],
            long_factor=tables.get("rope_factors_long", tables["rope_factors_short"]),
            original_max_position_embeddings=int(original or hf["max_position_embeddings"]),
        )
        hf["original_max_position_embeddings"] = rope["original_max_position_embeddings"]
    return rope


def llama3_table(parameters: dict[str, Any], theta: float, dims: int) -> list[float]:
    """The divisor llama3 rotary with ``parameters`` applies to each of the
    ``dims // 2`` frequencies (llama.cpp's ``rope_freqs``)."""
    factor, low, high = (float(parameters[k]) for k in ("factor", "low_freq_factor", "high_freq_factor"))
    old = float(parameters["original_max_position_embeddings"])
    out = []
    for i in range(dims // 2):
        wavelen = 2 * math.pi * theta ** (2 * i / dims)
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return out


def llama3_parameters(table: list[float], theta: float, dims: int, original: Any = None) -> dict[str, Any]:
    """transformers' llama3 rotary parameters that give ``table`` (see the
    module's docstring); ``ModelLoadError`` where none do: at least two
    frequencies must lie between the bounds, or none (then any bounds in
    the gap between the unscaled and the scaled frequencies do)."""
    if len(table) != dims // 2:
        raise ModelLoadError(f"GGUF rope_freqs has {len(table)} values for {dims // 2} rotary frequencies")
    factor = max(table)
    if factor <= 1.0:
        return {"rope_type": "default"}
    wavelens = [2 * math.pi * theta ** (2 * i / dims) for i in range(dims // 2)]
    tol = 1e-6 * factor
    middle = [(w, v) for w, v in zip(wavelens, table) if 1.0 + tol < v < factor - tol]
    if len(middle) >= 2:
        # smooth = (old / w - low) / (high - low) = a / w + b, and
        # 1 / v = (1 - smooth) / factor + smooth: a line in 1 / w.
        xs = [1 / w for w, _ in middle]
        ys = [(1 / v - 1 / factor) / (1 - 1 / factor) for _, v in middle]
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        a = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
        b = my - a * mx
        to_low, to_high = -a / b, a / (1 - b)  # old / low, old / high
    elif not middle:
        unscaled = [w for w, v in zip(wavelens, table) if v <= 1.0 + tol]
        scaled = [w for w, v in zip(wavelens, table) if v >= factor - tol]
        below = max(unscaled, default=min(scaled) / 2)
        above = min(scaled)
        to_high, to_low = below ** (2 / 3) * above ** (1 / 3), below ** (1 / 3) * above ** (2 / 3)
    else:
        raise ModelLoadError("GGUF rope_freqs has one frequency between its bounds: its llama3 parameters are not determined")
    old = int(original) if original else round(to_low)
    parameters = {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": old / to_low,
        "high_freq_factor": old / to_high,
        "original_max_position_embeddings": old,
    }
    again = llama3_table(parameters, theta, dims)
    if max(abs(x - y) / y for x, y in zip(again, table)) > 1e-4:
        raise ModelLoadError("GGUF rope_freqs is not a llama3 rotary's table: no llama3 parameters give it back")
    return parameters
