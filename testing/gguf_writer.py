"""A Hugging Face checkpoint folder written as a GGUF file the way llama.cpp's
``convert_hf_to_gguf.py`` writes each architecture: its metadata keys, its
tensor names (gguf-py's table), and its conventions: a Llama-arch model's q
and k rows permuted for llama.cpp's rotary layout, Gemma's norms stored as
``1 + w``, Phi-3's fused ``attn_qkv`` and ``ffn_up`` kept fused, llama3 rotary
as a ``rope_freqs`` table and longrope as ``rope_factors_long``/``_short``.
Matrices are quantized with gguf-py (``gguf.quants.quantize``: Q8_0, Q4_0,
Q4_1, Q5_0, Q5_1, F16, BF16; it writes no K-quant), norms and vectors stay
F32, and a matrix whose rows do not divide into the type's blocks stays F32
(llama.cpp falls back so too). A tiny word tokenizer (``tokenizer.ggml.model``
"llama") fills the tokenizer keys.

For tests and benchmarks only (``testing/``).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import torch

# config.json's model_type -> llama.cpp's architecture (Mistral is written as Llama).
ARCHES = {
    "llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma2": "gemma2",
    "gemma3_text": "gemma3", "gemma3": "gemma3", "phi3": "phi3", "smollm3": "smollm3",
}  # fmt: skip
# Architectures whose q/k rows llama.cpp permutes (its LlamaModel and subclasses).
PERMUTED = ("llama", "smollm3")


def write_gguf(folder: Path, path: Path, qtype: str = "F32", *, name: str | None = None) -> Path:
    """Write the checkpoint in ``folder`` (``config.json``, ``model.safetensors``)
    to ``path`` with its matrices in ``qtype`` (a ``GGMLQuantizationType`` name);
    return ``path``."""
    import gguf
    from safetensors.torch import load_file

    hf = json.loads((Path(folder) / "config.json").read_text())
    arch = ARCHES[hf["model_type"]]
    tensors = load_file(str(Path(folder) / "model.safetensors"))
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(name or Path(folder).name)
    _metadata(writer, hf, arch)
    _tokenizer(writer, hf)
    for hf_name, tensor in _arch_tensors(tensors, hf, arch):
        _add_tensor(writer, hf_name, tensor, arch, qtype, int(hf["num_hidden_layers"]))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(path)


def _metadata(writer, hf: dict, arch: str) -> None:
    import gguf

    heads = int(hf["num_attention_heads"])
    head_dim = int(hf.get("head_dim") or hf["hidden_size"] // heads)
    rope = dict(hf.get("rope_parameters") or {})
    full = dict(rope.get("full_attention", rope))  # Gemma 3 keeps one per layer type
    writer.add_context_length(int(hf["max_position_embeddings"]))
    writer.add_embedding_length(int(hf["hidden_size"]))
    writer.add_block_count(int(hf["num_hidden_layers"]))
    writer.add_feed_forward_length(int(hf["intermediate_size"]))
    writer.add_head_count(heads)
    writer.add_head_count_kv(int(hf.get("num_key_value_heads") or heads))
    writer.add_layer_norm_rms_eps(float(hf["rms_norm_eps"]))
    writer.add_rope_freq_base(float(full.get("rope_theta", hf.get("rope_theta", 10000.0))))
    writer.add_vocab_size(int(hf["vocab_size"]))
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    partial = float(hf.get("partial_rotary_factor") or full.get("partial_rotary_factor") or 1.0)
    writer.add_rope_dimension_count(int(head_dim * partial))
    kind = full.get("rope_type", "default")
    if kind == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(full["factor"]))
    elif kind == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(float(full["factor"]))
        writer.add_rope_scaling_orig_ctx_len(int(full["original_max_position_embeddings"]))
    elif kind == "longrope":
        original = int(full.get("original_max_position_embeddings") or hf["original_max_position_embeddings"])
        scale = int(hf["max_position_embeddings"]) / original
        writer.add_rope_scaling_orig_ctx_len(original)
        writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0)
    if hf.get("sliding_window") and arch in ("gemma2", "gemma3", "phi3"):
        writer.add_sliding_window(int(hf["sliding_window"]))
    if arch == "gemma2":
        writer.add_attn_logit_softcapping(float(hf["attn_logit_softcapping"]))
        writer.add_final_logit_softcapping(float(hf["final_logit_softcapping"]))
    if arch == "smollm3":
        interval = int(hf.get("no_rope_layer_interval", 4))
        flags = hf.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(hf["num_hidden_layers"])]
        writer.add_array(f"{arch}.no_rope_layers", [int(f) for f in flags])


def _tokenizer(writer, hf: dict) -> None:
    """A word per id: ``<unk>``, ``<s>``, ``</s>``, then ``▁w3``, ``▁w4``, ..."""
    vocab = int(hf["vocab_size"])
    tokens = ["<unk>", "<s>", "</s>", *(f"\u2581w{i}" for i in range(3, vocab))]
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores([-float(i) for i in range(vocab)])
    writer.add_token_types([2, 3, 3, *([1] * (vocab - 3))])
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    if hf.get("pad_token_id") is not None:
        writer.add_pad_token_id(int(hf["pad_token_id"]))


def _arch_tensors(tensors: dict[str, torch.Tensor], hf: dict, arch: str):
    """The checkpoint's tensors as llama.cpp stores them, plus the rotary
    tables it derives, under Hugging Face names (``rope_*`` as GGUF names)."""
    heads = int(hf["num_attention_heads"])
    kv_heads = int(hf.get("num_key_value_heads") or heads)
    for name, tensor in tensors.items():
        tensor = tensor.float()
        if name == "lm_head.weight" and hf.get("tie_word_embeddings"):
            continue
        if arch in PERMUTED and ".self_attn.q_proj." in name:
            tensor = _permute(tensor, heads)
        elif arch in PERMUTED and ".self_attn.k_proj." in name:
            tensor = _permute(tensor, kv_heads)
        if arch in ("gemma2", "gemma3") and name.endswith("norm.weight"):
            tensor = tensor + 1  # llama.cpp's Gemma norms multiply by the stored weight
        yield name, tensor
    rope = dict(hf.get("rope_parameters") or {})
    if rope.get("rope_type") == "llama3":
        yield "rope_freqs.weight", _llama3_factors(hf, rope)
    if rope.get("rope_type") == "longrope":
        yield "rope_factors_long.weight", torch.tensor(rope["long_factor"], dtype=torch.float32)
        yield "rope_factors_short.weight", torch.tensor(rope["short_factor"], dtype=torch.float32)


def _permute(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """convert_hf_to_gguf.py's LlamaModel.permute: each head's rows (2, half) as (half, 2)."""
    return weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _llama3_factors(hf: dict, rope: dict) -> torch.Tensor:
    """convert_hf_to_gguf.py's llama3 ``rope_freqs``: a divisor per frequency."""
    head_dim = int(hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"])
    base, factor = float(rope["rope_theta"]), float(rope["factor"])
    low, high = float(rope.get("low_freq_factor", 1.0)), float(rope.get("high_freq_factor", 4.0))
    old = int(rope["original_max_position_embeddings"])
    freqs = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    out = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(out, dtype=torch.float32)


def _add_tensor(writer, hf_name: str, tensor: torch.Tensor, arch: str, qtype: str, layers: int) -> None:
    import gguf

    if hf_name.startswith("rope_"):
        writer.add_tensor(hf_name, tensor.numpy())
        return
    base, suffix = hf_name.rsplit(".", 1)
    gguf_name = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], layers).get_name(base)
    if gguf_name is None:
        raise ValueError(f"{hf_name}: no {arch} GGUF name")
    data = tensor.numpy()
    kind = gguf.GGMLQuantizationType[qtype]
    block = gguf.GGML_QUANT_SIZES[kind][0]
    if data.ndim < 2 or kind == gguf.GGMLQuantizationType.F32 or data.shape[-1] % block:
        writer.add_tensor(f"{gguf_name}.{suffix}", data)
    elif kind == gguf.GGMLQuantizationType.F16:
        writer.add_tensor(f"{gguf_name}.{suffix}", data.astype(np.float16))
    else:
        writer.add_tensor(f"{gguf_name}.{suffix}", gguf.quants.quantize(data, kind), raw_dtype=kind)


def dequantized(path: Path) -> dict[str, np.ndarray]:
    """Every tensor of the GGUF at ``path`` by its GGUF name, dequantized to
    float32 as gguf-py reads it (rows as stored: permuted, Gemma's ``1 + w``)."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    return {t.name: gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32) for t in reader.tensors}
