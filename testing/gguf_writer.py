"""A Hugging Face checkpoint folder written as a GGUF file the way llama.cpp's
``convert_hf_to_gguf.py`` writes each architecture: its metadata keys, its
tensor names (gguf-py's table), and its conventions: a Llama-arch model's q
and k rows permuted for llama.cpp's rotary layout, Gemma's norms stored as
``1 + w``, Phi-3's fused ``attn_qkv`` and ``ffn_up`` kept fused, llama3 rotary
as a ``rope_freqs`` table and longrope as ``rope_factors_long``/``_short``,
a mixture's experts stacked into one ``[experts, out, in]`` tensor a matrix
and layer (``ffn_gate_exps``, ``ffn_up_exps``, ``ffn_down_exps``; Mixtral as
a Llama with ``expert_count``) with the router (``ffn_gate_inp``) in F32.
Matrices are quantized with gguf-py (``gguf.quants.quantize``: Q8_0, Q4_0,
Q4_1, Q5_0, Q5_1, F16, BF16) or, for the K-quants gguf-py does not write,
here (``quantize_q4_k``, ``quantize_q6_k``: the format exactly, a simpler
choice of scales than llama.cpp's search), norms and vectors stay
F32, and a matrix whose rows do not divide into the type's blocks stays F32
(llama.cpp falls back so too). A tiny word tokenizer (``tokenizer.ggml.model``
"llama") fills the tokenizer keys.

For tests and benchmarks only (``testing/``).
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np
import torch

# config.json's model_type -> llama.cpp's architecture (Mistral is written as Llama).
ARCHES = {
    "llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma2": "gemma2",
    "gemma3_text": "gemma3", "gemma3": "gemma3", "phi3": "phi3", "smollm3": "smollm3",
    "qwen3_moe": "qwen3moe", "mixtral": "llama", "gpt_oss": "gpt-oss",
}  # fmt: skip
# A mixture's per-expert matrices: Hub name -> the stacked name gguf-py's table maps.
_EXPERT = re.compile(r"(model\.layers\.\d+\.(?:mlp|block_sparse_moe)\.experts)\.(\d+)\.(\w+)\.weight")
# Architectures whose q/k rows llama.cpp permutes (its LlamaModel and subclasses).
PERMUTED = ("llama", "smollm3")


def write_gguf(
    folder: Path, path: Path, qtype: str = "F32", *, name: str | None = None, expert_qtype: str | None = None
) -> Path:
    """Write the checkpoint in ``folder`` (``config.json``, ``model.safetensors``)
    to ``path`` with its matrices in ``qtype`` (a ``GGMLQuantizationType``
    name), a mixture's experts in ``expert_qtype`` where given (llama.cpp's
    gpt-oss files hold them in MXFP4, the rest wider); return ``path``."""
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
        kind = expert_qtype if expert_qtype and ".experts." in hf_name else qtype
        _add_tensor(writer, hf_name, tensor, arch, kind, int(hf["num_hidden_layers"]))
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
    if hf.get("sliding_window") and arch in ("gemma2", "gemma3", "phi3", "gpt-oss"):
        writer.add_sliding_window(int(hf["sliding_window"]))
    if arch == "gemma2":
        writer.add_attn_logit_softcapping(float(hf["attn_logit_softcapping"]))
        writer.add_final_logit_softcapping(float(hf["final_logit_softcapping"]))
    experts = hf.get("num_experts") or hf.get("num_local_experts")
    if experts:
        writer.add_expert_count(int(experts))
        writer.add_expert_used_count(int(hf["num_experts_per_tok"]))
        width = hf.get("moe_intermediate_size") or (hf["intermediate_size"] if arch == "gpt-oss" else None)
        if width:
            writer.add_expert_feed_forward_length(int(width))
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


def write_tokenizer_gguf(
    tokenizer: dict, config: dict, path: Path, *, pre: str, chat_template: str | None = None, flags: dict | None = None
) -> Path:
    """A GGUF holding a byte-level BPE tokenizer (``tokenizer``, a
    ``tokenizer.json``'s content; ``config``, its ``tokenizer_config.json``'s)
    under llama.cpp's keys, as its converter writes one: every id's token
    (added tokens by their content), added special tokens as CONTROL and the
    other added tokens as USER_DEFINED, the merges, ``pre`` as
    ``tokenizer.ggml.pre``, the special ids the config names, and the
    ``add_*_token`` ``flags``; a tiny Llama's keys and a 4-wide embedding
    table (llama.cpp's files always have both); return ``path``."""
    import gguf

    vocab = dict(tokenizer["model"]["vocab"])
    added = {t["id"]: t for t in tokenizer["added_tokens"]}
    size = max([*vocab.values(), *added]) + 1
    tokens = [f"[PAD{i}]" for i in range(size)]
    types = [gguf.TokenType.UNUSED] * size
    for token, index in vocab.items():
        tokens[index], types[index] = token, gguf.TokenType.NORMAL
    for index, token in added.items():
        tokens[index] = token["content"]
        types[index] = gguf.TokenType.CONTROL if token["special"] else gguf.TokenType.USER_DEFINED
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tokenizer")
    _metadata(writer, {"max_position_embeddings": 4096, "hidden_size": 4, "num_hidden_layers": 1,
                       "intermediate_size": 8, "num_attention_heads": 1, "rms_norm_eps": 1e-5,
                       "vocab_size": size}, "llama")  # fmt: skip
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types([int(t) for t in types])
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tokenizer["model"]["merges"]])
    ids = {token: index for index, token in enumerate(tokens)}
    for name, add in (("bos_token", writer.add_bos_token_id), ("eos_token", writer.add_eos_token_id),
                      ("unk_token", writer.add_unk_token_id), ("pad_token", writer.add_pad_token_id)):  # fmt: skip
        value = config.get(name)
        value = value["content"] if isinstance(value, dict) else value
        if value is not None:
            add(ids[value])
    for flag, value in (flags or {}).items():
        writer.add_bool(f"tokenizer.ggml.{flag}", bool(value))
    if chat_template:
        writer.add_chat_template(chat_template)
    writer.add_tensor("token_embd.weight", np.zeros((size, 4), dtype=np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(path)


def _arch_tensors(tensors: dict[str, torch.Tensor], hf: dict, arch: str):
    """The checkpoint's tensors as llama.cpp stores them, plus the rotary
    tables it derives, under Hugging Face names (``rope_*`` as GGUF names)."""
    heads = int(hf["num_attention_heads"])
    kv_heads = int(hf.get("num_key_value_heads") or heads)
    experts: dict[str, dict[int, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        tensor = tensor.float()
        if name == "lm_head.weight" and hf.get("tie_word_embeddings"):
            continue
        if arch == "gpt-oss" and ".mlp.experts." in name:
            yield from _gpt_oss_experts(name, tensor)
            continue
        if name.endswith(".self_attn.sinks"):
            name += ".weight"  # llama.cpp's convert names them so
        match = _EXPERT.fullmatch(name)
        if match is not None:
            experts.setdefault(f"{match.group(1)}.{match.group(3)}.weight", {})[int(match.group(2))] = tensor
            continue
        if arch in PERMUTED and ".self_attn.q_proj." in name:
            tensor = _permute(tensor, heads)
        elif arch in PERMUTED and ".self_attn.k_proj." in name:
            tensor = _permute(tensor, kv_heads)
        if arch in ("gemma2", "gemma3") and name.endswith("norm.weight"):
            tensor = tensor + 1  # llama.cpp's Gemma norms multiply by the stored weight
        yield name, tensor
    for name, by_expert in experts.items():
        yield name, torch.stack([by_expert[e] for e in range(len(by_expert))])
    rope = dict(hf.get("rope_parameters") or {})
    if rope.get("rope_type") == "llama3":
        yield "rope_freqs.weight", _llama3_factors(hf, rope)
    if rope.get("rope_type") == "longrope":
        yield "rope_factors_long.weight", torch.tensor(rope["long_factor"], dtype=torch.float32)
        yield "rope_factors_short.weight", torch.tensor(rope["short_factor"], dtype=torch.float32)


def _gpt_oss_experts(name: str, tensor: torch.Tensor):
    """gpt-oss's fused expert tensor ``name`` as llama.cpp's convert splits
    it: ``gate_up_proj`` (``[experts, in, out]``, gate and up interleaved by
    column) into gate's and up's ``[experts, out, in]``, ``down_proj``
    transposed so, their biases split alike."""
    base = name.rsplit(".", 1)[0]
    if name.endswith("gate_up_proj"):
        yield f"{base}.gate_proj.weight", tensor[..., 0::2].transpose(1, 2).contiguous()
        yield f"{base}.up_proj.weight", tensor[..., 1::2].transpose(1, 2).contiguous()
    elif name.endswith("gate_up_proj_bias"):
        yield f"{base}.gate_proj.bias", tensor[..., 0::2].contiguous()
        yield f"{base}.up_proj.bias", tensor[..., 1::2].contiguous()
    elif name.endswith("down_proj"):
        yield f"{base}.down_proj.weight", tensor.transpose(1, 2).contiguous()
    elif name.endswith("down_proj_bias"):
        yield f"{base}.down_proj.bias", tensor
    else:
        raise ValueError(f"{name}: not a gpt-oss expert tensor this writer knows")


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
    gguf_name = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper().replace("-", "_")], layers).get_name(base)
    if gguf_name is None:
        raise ValueError(f"{hf_name}: no {arch} GGUF name")
    data = tensor.numpy()
    kind = gguf.GGMLQuantizationType[qtype]
    block = gguf.GGML_QUANT_SIZES[kind][0]
    router = gguf_name.endswith("ffn_gate_inp")  # llama.cpp keeps a router in F32
    if data.ndim < 2 or kind == gguf.GGMLQuantizationType.F32 or data.shape[-1] % block or router or suffix != "weight":
        writer.add_tensor(f"{gguf_name}.{suffix}", data)
    elif kind == gguf.GGMLQuantizationType.F16:
        writer.add_tensor(f"{gguf_name}.{suffix}", data.astype(np.float16))
    elif qtype in _K_QUANTS:
        writer.add_tensor(f"{gguf_name}.{suffix}", _K_QUANTS[qtype](data), raw_dtype=kind)
    else:
        writer.add_tensor(f"{gguf_name}.{suffix}", gguf.quants.quantize(data, kind), raw_dtype=kind)


def dequantized(path: Path) -> dict[str, np.ndarray]:
    """Every tensor of the GGUF at ``path`` by its GGUF name, dequantized to
    float32 as gguf-py reads it (rows as stored: permuted, Gemma's ``1 + w``)."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    return {t.name: gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32) for t in reader.tensors}


def _fp16_at_least(x: np.ndarray) -> np.ndarray:
    """``x`` in float16, rounded up where rounding to nearest went down: a
    super-block's scale that covers its largest sub-block scale."""
    h = x.astype(np.float16)
    return np.where(h.astype(np.float32) < x, np.nextafter(h, np.float16(np.inf)), h)


def quantize(data: np.ndarray, qtype: str) -> np.ndarray:
    """``data``'s rows in ``qtype`` as the writer stores them: the K-quants
    here, any other type by gguf-py."""
    import gguf

    if qtype in _K_QUANTS:
        return _K_QUANTS[qtype](data)
    return gguf.quants.quantize(data, gguf.GGMLQuantizationType[qtype])


def quantize_q4_k(data: np.ndarray) -> np.ndarray:
    """Rows of ``data`` (the last axis a multiple of 256) as Q4_K blocks of
    144 bytes: float16 ``d`` and ``dmin``, 8 sub-blocks of 32 with 6-bit
    ``(sc, m)`` packed in 12 bytes, and the nibbles (a 64-value chunk's low
    nibbles its first sub-block, the high ones its second); a value is
    ``q d sc - dmin m``. Each sub-block's step spans its range in 15 steps
    (from its minimum, or from 0 where all are positive), its 6-bit scales
    rounded up from the block's largest, so no value is clipped by more
    than the offset's rounding."""
    shape = data.shape
    x = data.astype(np.float32).reshape(-1, 8, 32)
    low = np.minimum(x.min(-1), 0.0)
    scale = (x.max(-1) - low) / 15
    d = _fp16_at_least(scale.max(-1) / 63)
    dmin = _fp16_at_least(-low.min(-1) / 63)
    d32, dmin32 = d.astype(np.float32)[:, None], dmin.astype(np.float32)[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(d32 > 0, np.ceil(scale / d32), 0).clip(0, 63).astype(np.uint8)
        m = np.where(dmin32 > 0, np.rint(-low / dmin32), 0).clip(0, 63).astype(np.uint8)
    step = d32 * sc.astype(np.float32)
    offset = dmin32 * m.astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(step[..., None] > 0, np.rint((x + offset[..., None]) / step[..., None]), 0)
    q = q.clip(0, 15).astype(np.uint8).reshape(-1, 4, 2, 32)
    packed = np.empty((x.shape[0], 12), np.uint8)
    packed[:, 0:4] = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    packed[:, 4:8] = m[:, :4] | ((m[:, 4:] >> 4) << 6)
    packed[:, 8:12] = (sc[:, 4:] & 0x0F) | ((m[:, 4:] & 0x0F) << 4)
    qs = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(-1, 128)
    blocks = np.concatenate([d.view(np.uint8).reshape(-1, 2), dmin.view(np.uint8).reshape(-1, 2), packed, qs], axis=1)
    return blocks.reshape(*shape[:-1], shape[-1] // 256 * 144)


def quantize_q6_k(data: np.ndarray) -> np.ndarray:
    """Rows of ``data`` (the last axis a multiple of 256) as Q6_K blocks of
    210 bytes: the values' low 4 bits (128 bytes: each half of 128 values
    in 64 bytes, low nibbles first), their high 2 bits (64 bytes: each half
    in 32, two bits a value, lowest first), 16 int8 scales and a float16
    ``d``; a value is ``(q - 32) d sc``, each sub-block of 16 spanning its
    largest magnitude in 31 steps."""
    shape = data.shape
    x = data.astype(np.float32).reshape(-1, 16, 16)
    scale = np.abs(x).max(-1) / 31
    d = _fp16_at_least(scale.max(-1) / 127)
    d32 = d.astype(np.float32)[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(d32 > 0, np.ceil(scale / d32), 0).clip(0, 127).astype(np.int8)
        step = d32 * sc.astype(np.float32)
        q = np.where(step[..., None] > 0, np.rint(x / step[..., None]), 0)
    q = (q.clip(-32, 31) + 32).astype(np.uint8).reshape(-1, 2, 128)  # [block, half, value]
    ql = (q[:, :, :64] & 0x0F) | ((q[:, :, 64:] & 0x0F) << 4)  # [block, half, 64]
    top = (q >> 4).reshape(-1, 2, 4, 32)
    qh = top[:, :, 0] | (top[:, :, 1] << 2) | (top[:, :, 2] << 4) | (top[:, :, 3] << 6)  # [block, half, 32]
    blocks = np.concatenate(
        [ql.reshape(-1, 128), qh.reshape(-1, 64), sc.view(np.uint8), d.view(np.uint8).reshape(-1, 2)], axis=1
    )
    return blocks.reshape(*shape[:-1], shape[-1] // 256 * 210)


# The K-quants this writer makes itself (gguf-py quantizes none).
_K_QUANTS = {"Q4_K": quantize_q4_k, "Q6_K": quantize_q6_k}
