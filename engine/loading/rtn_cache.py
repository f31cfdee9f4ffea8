"""A float checkpoint quantized once (round to nearest) and kept in the cache.

Quantizing every projection of a large model takes a while; reading the
result back is a plain safetensors load. So the first ``--quantization
int8|int4`` start writes ``<cache>/<folder>-<scheme>-<key>/quantized.safetensors``
(the key hashes the shards' identities, the scheme and the group size) and
later starts read it. As for a GGUF conversion (``gguf_cache``), a temporary
folder is renamed into place at the end, so an interrupted run leaves none.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch

from trioserve.engine.errors import ModelLoadError
from trioserve.engine.loading.gguf_cache import cache_root
from trioserve.engine.kernels.rtn import Int4Weight, Int8GroupWeight, Int8Weight, quantize_int4, quantize_int8, quantize_int8_groups

FILE = "quantized.safetensors"
FORMAT = 5
# An untied LM head is kept in int8 groups of this many inputs (GGUF's Q8_0
# form, which the native int8 kernels run: int8_native.GROUP) where its
# input width divides by it, else in int8 per channel.
HEAD_GROUP = 32
# The matrices that are quantized; everything else stays as it is.
# Phi-3's fused qkv_proj and gate_up_proj too: every format here quantizes
# each row on its own, so the parts split from them are as if quantized apart.
# Each expert's matrices (Qwen3-MoE's, Mixtral's w1/w2/w3), never a router:
# rounding its logits would change which experts a token goes to.
_QUANTIZED = re.compile(
    r"model\.layers\.\d+\.(self_attn\.(q|k|v|o|qkv)_proj|mlp\.(gate|up|down|gate_up)_proj"
    r"|(mlp|block_sparse_moe)\.experts\.\d+\.(gate_proj|up_proj|down_proj|w1|w2|w3))\.weight|lm_head\.weight"
)

Tensor = torch.Tensor | Int4Weight | Int8Weight | Int8GroupWeight


def cache_dir_for(folder: Path, shards: list[Path], scheme: str, group_size: int, cache_dir: Path | None) -> Path:
    """Where ``folder``'s ``scheme`` quantization lives (it may not exist yet)."""
    ident = "\0".join(f"{s.resolve()}\0{s.stat().st_size}\0{s.stat().st_mtime_ns}" for s in shards)
    # FORMAT: what quantize_int4 produces changed (float16 scales since 2);
    # the LM head in int8 groups since 3; Phi-3's fused matrices quantized since 4;
    # the experts of a mixture since 5.
    ident += f"\0{scheme}\0{group_size}\0{FORMAT}"
    key = hashlib.sha256(ident.encode()).hexdigest()[:16]
    tag = f"{scheme}-g{group_size}" if scheme == "int4" else scheme
    return cache_root(cache_dir) / f"{Path(folder).resolve().name}-{tag}-{key}"


def quantize_tensor(name: str, tensor: torch.Tensor, scheme: str, group_size: int) -> Tensor:
    """``tensor`` as it is kept: projections in ``scheme``, an untied LM head
    in int8 groups of HEAD_GROUP (a step a group: finer than one a channel,
    and on the native kernels a decode step's logits then have the same bits
    at any batch size), the rest unchanged."""
    if not _QUANTIZED.fullmatch(name):
        return tensor
    if name == "lm_head.weight":
        if tensor.shape[1] % HEAD_GROUP == 0:
            return quantize_int8_groups(tensor, HEAD_GROUP, name)
        return quantize_int8(tensor)
    if scheme == "int4":
        return quantize_int4(tensor, group_size, name)
    return quantize_int8(tensor)


def write(path: Path, tensors: Iterator[tuple[str, Tensor]], scheme: str, group_size: int) -> None:
    """Write ``tensors`` (quantized by ``quantize_tensor``) to ``path`` through a temporary folder."""
    from safetensors.torch import save_file

    flat: dict[str, torch.Tensor] = {}
    for name, tensor in tensors:
        value = quantize_tensor(name, tensor, scheme, group_size)
        if isinstance(value, Int4Weight):
            flat.update({f"{name}.q4": value.q, f"{name}.scale": value.scale, f"{name}.zero": value.zero})
        elif isinstance(value, Int8Weight):
            flat.update({f"{name}.q8": value.q, f"{name}.scale": value.scale})
        elif isinstance(value, Int8GroupWeight):
            flat.update({f"{name}.q8g": value.q, f"{name}.scale": value.scale})
        else:
            flat[name] = value.contiguous()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{os.getpid()}-", dir=path.parent))
    try:
        (tmp / FILE).parent.mkdir(exist_ok=True)
        save_file(flat, str(tmp / FILE), metadata={"scheme": scheme, "group_size": str(group_size)})
        tmp.chmod(0o755)
        try:
            os.rename(tmp, path)
        except OSError:
            if not path.is_dir():  # another process finished first otherwise
                raise
    except OSError as exc:
        raise ModelLoadError(f"{path}: cannot write the quantized checkpoint: {exc.strerror or exc}") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def read(path: Path) -> Iterator[tuple[str, Tensor]]:
    """The tensors of a cached quantization, one name at a time."""
    from safetensors import safe_open

    with safe_open(str(path / FILE), framework="pt", device="cpu") as f:
        group_size = int(f.metadata()["group_size"])
        names = set(f.keys())
        for key in sorted(names):
            if key.endswith(".q4"):
                name = key[: -len(".q4")]
                yield name, Int4Weight(f.get_tensor(key), f.get_tensor(f"{name}.scale"), f.get_tensor(f"{name}.zero"), group_size)
            elif key.endswith(".q8"):
                name = key[: -len(".q8")]
                yield name, Int8Weight(f.get_tensor(key), f.get_tensor(f"{name}.scale"))
            elif key.endswith(".q8g"):
                name = key[: -len(".q8g")]
                q, scale = f.get_tensor(key), f.get_tensor(f"{name}.scale")
                yield name, Int8GroupWeight(q, scale, q.shape[1] // scale.shape[1])
            elif not (key.endswith((".scale", ".zero")) and any(key.rsplit(".", 1)[0] + s in names for s in (".q4", ".q8", ".q8g"))):
                yield key, f.get_tensor(key)
