"""Random-weight checkpoints of the shapes people serve, for ``trioserve
bench real-size``: the shapes, their tensors, the seeded weights, and the
cache that keeps each checkpoint and its GGUF files between runs.

A checkpoint is a Hugging Face folder (config.json, safetensors shards in
the Hub's layout, the default model's tokenizer) written tensor by tensor,
so a 4B shape never sits in memory as a model. Every tensor is drawn from
its own generator, seeded by the run's seed and the tensor's name, so a
tensor's values do not depend on which others exist or on their order.
Projections are drawn with a standard deviation of 1/sqrt(fan in) (each
sublayer's output at its input's scale), the embeddings and the LM head
with 1/sqrt(hidden) (logits of about unit spread after the final norm);
norms are ones. The logits are then spread but not flat: greedy decoding
picks different tokens at different positions.
"""

from __future__ import annotations

import hashlib
import json
import math
import shutil
from collections.abc import Iterator
from pathlib import Path

import attrs
import torch

VOCAB_SIZE = 49152  # the default model's tokenizer (SmolLM2)
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}
FAMILIES = tuple(ARCHITECTURES)
QUANT_TYPES = ("Q4_K_M", "Q4_0", "Q8_0")
FLOAT_TYPE = "BF16"  # what the converter writes, and llama-quantize reads
# Bumped when the weights drawn for a (shape, seed) change: part of the cache key.
WEIGHTS_VERSION = 1
SHARD_BYTES = 2 * 2**30


@attrs.frozen
class Shape:
    """A decoder's shape. ``experts`` > 0 makes it a mixture of experts:
    every layer routes each token to ``experts_per_token`` of ``experts``
    MLPs of ``expert_intermediate``."""

    name: str
    family: str = attrs.field(validator=attrs.validators.in_(FAMILIES))
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    tied: bool
    experts: int = 0
    experts_per_token: int = 0
    expert_intermediate: int = 0
    vocab: int = VOCAB_SIZE
    rope_theta: float = 500000.0

    @property
    def is_moe(self) -> bool:
        return self.experts > 0

    def key(self, seed: int) -> str:
        """The cache folder's name: the shape's name, the seed, and a digest
        of every field and the weights' version."""
        fields = json.dumps({**attrs.asdict(self), "weights_version": WEIGHTS_VERSION}, sort_keys=True)
        return f"{self.name}-s{seed}-{hashlib.sha256(fields.encode()).hexdigest()[:10]}"


# Real models' shapes with the default model's 49k vocabulary.
SHAPES = {
    shape.name: shape
    for shape in (
        Shape("llama-3.2-1b", "llama", layers=16, hidden=2048, heads=32, kv_heads=8, head_dim=64,
              intermediate=8192, tied=True),
        Shape("llama-3.2-3b", "llama", layers=28, hidden=3072, heads=24, kv_heads=8, head_dim=128,
              intermediate=8192, tied=True),
        Shape("qwen3-1.7b", "qwen3", layers=28, hidden=2048, heads=16, kv_heads=8, head_dim=128,
              intermediate=6144, tied=True, rope_theta=1000000.0),
        Shape("qwen3-4b", "qwen3", layers=36, hidden=2560, heads=32, kv_heads=8, head_dim=128,
              intermediate=9728, tied=True, rope_theta=1000000.0),
        # OLMoE-1B-7B's layout (16 layers, 64 experts of 1024, 8 a token) in
        # Qwen3-MoE's (Qwen3-30B-A3B's attention: 32 heads over 4, of 128).
        Shape("qwen3-moe-7b-a1b", "qwen3_moe", layers=16, hidden=2048, heads=32, kv_heads=4, head_dim=128,
              intermediate=6144, tied=False, experts=64, experts_per_token=8, expert_intermediate=1024,
              rope_theta=1000000.0),
    )
}  # fmt: skip


def hf_config(shape: Shape):
    """The transformers config of ``shape`` (token ids of the default tokenizer)."""
    import transformers  # seconds to import: only where a checkpoint is made

    common = dict(
        vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers, num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
        head_dim=shape.head_dim, max_position_embeddings=4096, rms_norm_eps=1e-6, tie_word_embeddings=shape.tied,
        bos_token_id=1, eos_token_id=2, pad_token_id=2, rope_theta=shape.rope_theta, torch_dtype="bfloat16",
        architectures=[ARCHITECTURES[shape.family]],  # what the converter dispatches on
    )  # fmt: skip
    if shape.family == "llama":
        return transformers.LlamaConfig(**common)
    if shape.family == "qwen3":
        return transformers.Qwen3Config(**common)
    return transformers.Qwen3MoeConfig(
        **common, num_experts=shape.experts, num_experts_per_tok=shape.experts_per_token,
        moe_intermediate_size=shape.expert_intermediate, norm_topk_prob=True, decoder_sparse_step=1,
    )  # fmt: skip


@attrs.frozen
class TensorSpec:
    """One checkpoint tensor: its name in the Hub's layout, its shape, and
    the standard deviation it is drawn with (None: ones, a norm's weight)."""

    name: str
    shape: tuple[int, ...]
    std: float | None

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def tensor_specs(shape: Shape) -> list[TensorSpec]:
    """Every tensor of ``shape``'s checkpoint, in the Hub's names (experts one
    by one, as published Qwen3-MoE checkpoints hold them)."""

    def linear(name: str, out: int, fan_in: int) -> TensorSpec:
        return TensorSpec(name, (out, fan_in), 1 / math.sqrt(fan_in))

    h, q, kv = shape.hidden, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    specs = [TensorSpec("model.embed_tokens.weight", (shape.vocab, h), 1 / math.sqrt(h))]
    for i in range(shape.layers):
        p = f"model.layers.{i}."
        specs += [
            TensorSpec(p + "input_layernorm.weight", (h,), None),
            linear(p + "self_attn.q_proj.weight", q, h),
            linear(p + "self_attn.k_proj.weight", kv, h),
            linear(p + "self_attn.v_proj.weight", kv, h),
            linear(p + "self_attn.o_proj.weight", h, q),
            TensorSpec(p + "post_attention_layernorm.weight", (h,), None),
        ]
        if shape.family != "llama":
            specs += [TensorSpec(p + "self_attn.q_norm.weight", (shape.head_dim,), None),
                      TensorSpec(p + "self_attn.k_norm.weight", (shape.head_dim,), None)]  # fmt: skip
        if shape.is_moe:
            specs.append(linear(p + "mlp.gate.weight", shape.experts, h))
            for e in range(shape.experts):
                x, m = f"{p}mlp.experts.{e}.", shape.expert_intermediate
                specs += [linear(x + "gate_proj.weight", m, h), linear(x + "up_proj.weight", m, h),
                          linear(x + "down_proj.weight", h, m)]  # fmt: skip
        else:
            m = shape.intermediate
            specs += [linear(p + "mlp.gate_proj.weight", m, h), linear(p + "mlp.up_proj.weight", m, h),
                      linear(p + "mlp.down_proj.weight", h, m)]  # fmt: skip
    specs.append(TensorSpec("model.norm.weight", (h,), None))
    if not shape.tied:
        specs.append(TensorSpec("lm_head.weight", (shape.vocab, h), 1 / math.sqrt(h)))
    return specs


def parameter_count(shape: Shape) -> int:
    """Parameters of ``shape``, tied embeddings counted once."""
    return sum(spec.numel for spec in tensor_specs(shape))


def active_parameter_count(shape: Shape) -> int:
    """Parameters a token goes through: only ``experts_per_token`` experts of
    a mixture, the embedding table whole (it is read whole as the LM head
    when tied, and counted whole here in either case as published counts do)."""
    if not shape.is_moe:
        return parameter_count(shape)
    per_expert = 3 * shape.hidden * shape.expert_intermediate
    return parameter_count(shape) - shape.layers * (shape.experts - shape.experts_per_token) * per_expert


def tensor_seed(seed: int, name: str) -> int:
    """The generator seed of tensor ``name`` in the checkpoint of ``seed``."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little") >> 1


def make_tensor(spec: TensorSpec, seed: int) -> torch.Tensor:
    """The bfloat16 values of one tensor, the same for the same seed."""
    if spec.std is None:
        return torch.ones(spec.shape, dtype=torch.bfloat16)
    generator = torch.Generator().manual_seed(tensor_seed(seed, spec.name))
    return (torch.randn(spec.shape, generator=generator) * spec.std).to(torch.bfloat16)


def _shards(specs: list[TensorSpec]) -> list[list[TensorSpec]]:
    shards: list[list[TensorSpec]] = [[]]
    size = 0
    for spec in specs:
        if shards[-1] and size + 2 * spec.numel > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += 2 * spec.numel
    return shards


def write_checkpoint(shape: Shape, seed: int, folder: Path, tokenizer_folder: Path) -> Path:
    """Write ``shape``'s checkpoint of ``seed`` into ``folder`` (replaced):
    config, safetensors shards with their index, and the tokenizer files
    copied from ``tokenizer_folder``."""
    from safetensors.torch import save_file

    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    hf_config(shape).save_pretrained(folder)
    shards = _shards(tensor_specs(shape))
    weight_map, total = {}, 0
    for index, shard in enumerate(shards, 1):
        file = f"model-{index:05d}-of-{len(shards):05d}.safetensors"
        tensors = {spec.name: make_tensor(spec, seed) for spec in shard}
        save_file(tensors, str(folder / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, file))
        total += sum(2 * spec.numel for spec in shard)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    for file in tokenizer_folder.iterdir():
        if file.is_file():
            shutil.copy(file, folder / file.name)
    return folder


@attrs.frozen
class CacheEntry:
    """Where one (shape, seed)'s files live under the cache root: the
    checkpoint folder, the converter's BF16 GGUF, and one GGUF per
    quantization type. A file is only ever renamed into place complete, so
    what exists is reused as it is."""

    root: Path
    shape: Shape
    seed: int

    @property
    def folder(self) -> Path:
        return self.root / self.shape.key(self.seed)

    @property
    def checkpoint(self) -> Path:
        return self.folder / "checkpoint"

    def gguf(self, quant: str) -> Path:
        return self.folder / f"{self.shape.name}.{quant}.gguf"

    def missing(self, quants: tuple[str, ...]) -> Iterator[str]:
        """The steps still to do for ``quants``, in order: ``checkpoint``,
        ``convert``, then each quantization type not yet cached."""
        todo = [q for q in quants if not self.gguf(q).is_file()]
        if todo and not self.gguf(FLOAT_TYPE).is_file():
            if not (self.checkpoint / "model.safetensors.index.json").is_file():
                yield "checkpoint"
            yield "convert"
        yield from todo


def default_cache_root() -> Path:
    return Path.home() / ".cache" / "trioserve" / "real-size"


def extract_converter(sdist: Path, dest: Path) -> Path:
    """Extract llama.cpp's ``convert_hf_to_gguf.py`` with what it imports
    (``conversion/``, ``gguf-py/``) from llama-cpp-python's source
    distribution ``sdist`` into ``dest``, once; the script's path."""
    import tarfile

    script = dest / "convert_hf_to_gguf.py"
    if script.is_file():
        return script
    top = sdist.name.removesuffix(".tar.gz") + "/vendor/llama.cpp/"
    wanted = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/")
    partial = dest.with_name(dest.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    with tarfile.open(sdist) as tar:
        members = []
        for member in tar.getmembers():
            if member.name.startswith(top) and member.name[len(top):].startswith(wanted):
                member.name = member.name[len(top):]
                members.append(member)
        if not any(m.name == "convert_hf_to_gguf.py" for m in members):
            raise FileNotFoundError(f"{sdist}: no {top}convert_hf_to_gguf.py")
        tar.extractall(partial, members=members, filter="data")
    partial.rename(dest)
    return script


def download_sdist(dest: Path, version: str) -> Path:
    """llama-cpp-python's source distribution of ``version`` in ``dest``,
    downloaded with pip as scripts/build_llama_server.sh does unless there."""
    import subprocess
    import sys

    sdist = dest / f"llama_cpp_python-{version}.tar.gz"
    if not sdist.is_file():
        dest.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "--dest",
                        str(dest), f"llama-cpp-python=={version}"], check=True, capture_output=True)  # fmt: skip
    return sdist
