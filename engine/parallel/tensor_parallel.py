"""Tensor parallelism: which part of the model a rank holds, its collectives,
and loading only that part.

Megatron's split, over ``torch.distributed``'s default group:

- q/k/v (one fused projection here) and gate/up are column-parallel: rank
  ``r`` holds the rows of its query heads, of the KV heads they read, and
  of its slice of the MLP's intermediate features. Attention then runs on
  local heads only, against a KV cache of local KV heads;
- o_proj and down_proj are row-parallel: each rank multiplies its slice of
  the features and one all-reduce sums the partial results. The residual
  (and o_proj's bias) is added on rank 0 only, so the sum counts it once;
- the embedding and the LM head are vocabulary-parallel: rank ``r`` holds
  rows ``r * V/N ..`` (``V`` padded up to a multiple of ``N`` with zero
  rows). An embedding lookup is one all-reduce; the logits are gathered on
  rank 0, which samples: the other ranks never see logits.

Where ``N`` exceeds the KV heads (GQA), ``N`` must be a multiple of them and
each KV head is replicated on the ``N / kv_heads`` ranks whose query heads
read it. The query heads must divide evenly (``N`` divides
``num_attention_heads``); an uneven split would make ranks wait for the
slowest at every all-reduce, and is refused with the head count named.

Each rank reads only its slices from the safetensors files (``get_slice``),
so no rank ever holds a full matrix. This needs float weights: a model whose
projections are stored in another layout cannot be sharded here and says so.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import attrs
import torch
import torch.distributed as dist
import torch.nn.functional as F

from trioserve.engine.kernels.capability import CpuPaths
from trioserve.engine.config import ModelConfig
from trioserve.engine.errors import ModelLoadError, TrioserveError
from trioserve.engine.loading.sources import find_shards
from trioserve.engine.models.llama import LlamaForCausalLM, _Made
from trioserve.engine.models.invariance import Invariance
from trioserve.engine.models.weights import fused_names

_MAX_LOAD_THREADS = 4


class TensorParallelSizeError(TrioserveError, ValueError):
    """The model cannot be split over that many ranks; the message names its sizes."""


def check_tensor_parallel(config: ModelConfig, size: int) -> None:
    """Raise ``TensorParallelSizeError`` naming the model's sizes when ``size`` ranks
    cannot split it: the attention heads, the KV heads (``size`` must
    divide them or be a multiple of them) and the MLP's intermediate size
    must split evenly."""
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise TensorParallelSizeError(f"tensor_parallel_size must be an integer >= 1, got {size!r}")
    unsplit = [
        name
        for name, default in (
            ("sandwich_norms", False), ("hidden_act", "silu"), ("embedding_multiplier", 1.0),
            ("final_logit_softcapping", None), ("moe_routing", None),
        )
        if getattr(config, name) != default
    ]  # fmt: skip
    if size > 1 and unsplit:
        # The shards' projections, embedding and LM head compute Llama's
        # layer; Gemma's norms, GeGLU and scalings, and the experts of a
        # mixture (each rank would hold and add every expert), are not split yet.
        raise TensorParallelSizeError(
            f"tensor_parallel_size {size}: {config.architecture} is not split across ranks "
            f"({', '.join(f'{n}={getattr(config, n)!r}' for n in unsplit)}); serve it with tensor_parallel_size 1"
        )
    heads, kv = config.num_attention_heads, config.num_key_value_heads
    if heads % size:
        divisors = [d for d in range(1, heads + 1) if heads % d == 0]
        raise TensorParallelSizeError(
            f"tensor_parallel_size {size} does not divide the model's {heads} attention heads "
            f"(num_attention_heads); use one of {', '.join(map(str, divisors))}"
        )
    if kv % size and size % kv:
        raise TensorParallelSizeError(
            f"tensor_parallel_size {size} neither divides the model's {kv} KV heads (num_key_value_heads) "
            f"nor is a multiple of them"
        )
    if config.intermediate_size % size:
        raise TensorParallelSizeError(
            f"tensor_parallel_size {size} does not divide the model's intermediate_size ({config.intermediate_size})"
        )


@attrs.frozen
class TPShard:
    """What rank ``rank`` of ``size`` holds of a model of ``config``."""

    config: ModelConfig
    rank: int
    size: int

    def __attrs_post_init__(self) -> None:
        check_tensor_parallel(self.config, self.size)
        if not 0 <= self.rank < self.size:
            raise ValueError(f"rank must be in [0, {self.size}), got {self.rank!r}")

    @property
    def num_heads(self) -> int:
        return self.config.num_attention_heads // self.size

    @property
    def num_kv_heads(self) -> int:
        return max(1, self.config.num_key_value_heads // self.size)

    @property
    def first_head(self) -> int:
        return self.rank * self.num_heads

    @property
    def first_kv_head(self) -> int:
        kv = self.config.num_key_value_heads
        if kv >= self.size:
            return self.rank * self.num_kv_heads
        return self.rank // (self.size // kv)  # replicated: the KV head its query heads read

    @property
    def intermediate(self) -> tuple[int, int]:
        per = self.config.intermediate_size // self.size
        return self.rank * per, (self.rank + 1) * per

    @property
    def vocab_per_rank(self) -> int:
        return -(-self.config.vocab_size // self.size)

    @property
    def vocab(self) -> tuple[int, int]:
        """This rank's vocabulary rows [start, end), end past the real
        vocabulary on the last rank when it is padded."""
        return self.rank * self.vocab_per_rank, (self.rank + 1) * self.vocab_per_rank

    def shard_config(self) -> ModelConfig:
        """The config of this rank's part: its heads, features and vocabulary rows."""
        return attrs.evolve(
            self.config,
            num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads,
            intermediate_size=self.config.intermediate_size // self.size,
            vocab_size=self.vocab_per_rank,
        )

    def slice_of(self, name: str) -> tuple[int, int, int] | None:
        """``(dim, start, stop)`` of the checkpoint tensor ``name`` this rank
        keeps, or None for a tensor it keeps whole (the norms)."""
        hd = self.config.head_dim
        if name.endswith(("embed_tokens.weight", "lm_head.weight")):
            return (0, *self.vocab)
        if name.endswith(("q_proj.weight", "q_proj.bias")):
            return 0, self.first_head * hd, (self.first_head + self.num_heads) * hd
        if name.endswith(("k_proj.weight", "k_proj.bias", "v_proj.weight", "v_proj.bias")):
            return 0, self.first_kv_head * hd, (self.first_kv_head + self.num_kv_heads) * hd
        if name.endswith("o_proj.weight"):
            return 1, self.first_head * hd, (self.first_head + self.num_heads) * hd
        if name.endswith(("gate_proj.weight", "up_proj.weight")):
            return (0, *self.intermediate)
        if name.endswith("down_proj.weight"):
            return (1, *self.intermediate)
        return None

    def read(self, name: str, tensor_slice: object, shape: tuple[int, ...]) -> torch.Tensor:
        """This rank's part of ``name``, read from a safetensors slice of
        full ``shape``: only those rows or columns are read. Vocabulary rows
        past the real vocabulary are zeros; o_proj's bias is zeros except on
        rank 0 (the all-reduce would add it ``size`` times)."""
        if name.endswith("o_proj.bias") and self.rank != 0:
            return torch.zeros(shape, dtype=_dtype_of(tensor_slice))
        spec = self.slice_of(name)
        if spec is None:
            return tensor_slice[:]
        dim, start, stop = spec
        real = min(stop, shape[dim])
        index = (slice(start, real),) if dim == 0 else (slice(None), slice(start, real))
        part = tensor_slice[index]
        if real < stop:  # the padded end of the vocabulary
            pad = list(part.shape)
            pad[dim] = stop - real
            part = torch.cat([part, part.new_zeros(pad)], dim=dim)
        return part


def _dtype_of(tensor_slice: object) -> torch.dtype:
    names = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
    kind = tensor_slice.get_dtype()  # type: ignore[attr-defined]
    if kind not in names:
        raise ModelLoadError(f"tensor parallelism needs float weights, found {kind}")
    return names[kind]


@attrs.define
class CollectiveTimer:
    """Seconds spent in this rank's collectives, for profiles: counted
    across steps until ``reset``."""

    seconds: float = 0.0
    calls: int = 0

    def reset(self) -> tuple[float, int]:
        taken = (self.seconds, self.calls)
        self.seconds, self.calls = 0.0, 0
        return taken


@attrs.frozen
class TPProjections:
    """One layer's projections on a rank: the local matmuls of ``inner``
    (plain or packed, model.py), each row-parallel one followed by its
    all-reduce. Rank 0 adds the residual; the others add zeros."""

    inner: object
    first: bool
    timer: CollectiveTimer

    def qkv(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner.qkv(x)  # type: ignore[attr-defined]

    def o_add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        out = self.inner.o_add(x, residual if self.first else torch.zeros_like(residual))  # type: ignore[attr-defined]
        return all_reduce(out, self.timer)

    def mlp_add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        out = self.inner.mlp_add(x, residual if self.first else torch.zeros_like(residual))  # type: ignore[attr-defined]
        return all_reduce(out, self.timer)


def all_reduce(tensor: torch.Tensor, timer: CollectiveTimer) -> torch.Tensor:
    """Sum ``tensor`` over the ranks, in place; return it."""
    start = time.perf_counter()
    dist.all_reduce(tensor)
    timer.seconds += time.perf_counter() - start
    timer.calls += 1
    return tensor


class TPLlamaForCausalLM(LlamaForCausalLM):
    """One rank's part of a ``LlamaForCausalLM`` (see the module docstring).

    Its ``forward`` takes the same batch and a KV cache of this rank's KV
    heads; on rank 0 it returns the full float32 logits, on the others an
    empty tensor (only rank 0 samples). Every rank must run the same
    batches in the same order: the collectives pair up by order.
    """

    def __init__(self, shard: TPShard, **kwargs: object) -> None:
        super().__init__(shard.shard_config(), **kwargs)  # type: ignore[arg-type]
        self.shard = shard
        self.timer = CollectiveTimer()
        # Rank 0's spawned ranks, until its runner takes them (tp_runner.py).
        self.local_ranks: list[object] = []
        self._tp_made: tuple[_Made, _Made] | None = None

    def invariance(self) -> Invariance:
        """Not claimed: each layer's partial sums meet in an all-reduce,
        whose summing order over more than two ranks follows how the
        backend chunks the tensor, that is the batch's rows; not checked."""
        return Invariance(
            False,
            f"tensor parallelism over {self.shard.size} ranks: not checked for invariance (the all-reduce's "
            "summing order over more than two ranks follows how the backend chunks the batch)",
        )

    def _projections(self) -> _Made:
        made = super()._projections()
        if self._tp_made is None or self._tp_made[0] is not made:
            first = self.shard.rank == 0
            layers = [TPProjections(p, first, self.timer) for p in made.layers]
            self._tp_made = (made, attrs.evolve(made, layers=layers))
        return self._tp_made[1]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        start, stop = self.shard.vocab
        local = input_ids - start
        outside = (local < 0) | (local >= stop - start)
        hidden = F.embedding(local.clamp(0, stop - start - 1), self.embed_tokens)
        hidden.masked_fill_(outside.unsqueeze(-1), 0.0)
        return all_reduce(hidden, self.timer)

    def lm_logits(self, hidden: torch.Tensor, made: _Made) -> torch.Tensor:
        local = super().lm_logits(hidden, made).contiguous()
        start = time.perf_counter()
        if self.shard.rank == 0:
            parts = [torch.empty_like(local) for _ in range(self.shard.size)]
            dist.gather(local, parts, dst=0)
        else:
            dist.gather(local, None, dst=0)
        self.timer.seconds += time.perf_counter() - start
        self.timer.calls += 1
        if self.shard.rank != 0:
            return local[:, :0]
        return torch.cat(parts, dim=-1)[:, : self.shard.config.vocab_size]

    def warm_up(self, max_logit_rows: int) -> int:
        # The packed kernels are built on first use instead: a warm-up of
        # the row-parallel projections would run all-reduces, which every
        # rank must then run in the same order.
        return 0


def load_shard(
    folder: Path,
    model_config: ModelConfig,
    shard: TPShard,
    *,
    dtype: torch.dtype,
    device: torch.device,
    cpu_paths: CpuPaths | None = None,
) -> TPLlamaForCausalLM:
    """Build rank ``shard.rank``'s part of the model in ``folder`` and fill
    it with only its slices of the checkpoint, one thread per safetensors
    file. Raises ``ModelLoadError`` naming the file."""
    from safetensors import SafetensorError, safe_open

    shards = find_shards(Path(folder))
    model = TPLlamaForCausalLM(shard, dtype=dtype, device=device, cpu_paths=cpu_paths)
    stop = threading.Event()

    def read(path: Path) -> set[str]:
        loaded: set[str] = set()
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for name in f.keys():
                    if stop.is_set():
                        break
                    part = f.get_slice(name)
                    shape = tuple(part.get_shape())
                    fused = fused_names(name, model_config)
                    if fused:
                        # Phi-3's qkv_proj and gate_up_proj: each rank's heads and
                        # features lie in every part, so read the tensor whole and
                        # shard each part under its own name.
                        whole = part[:]
                        parts = [(n, shard.read(n, whole[rows], tuple(whole[rows].shape))) for n, rows in fused]
                        loaded |= model.load_weights(parts) | {name}
                        continue
                    loaded |= model.load_weights([(name, shard.read(name, part, shape))])
        except (SafetensorError, OSError) as exc:
            stop.set()
            raise ModelLoadError(f"{path}: cannot read: {exc}") from None
        except ModelLoadError as exc:
            stop.set()
            raise ModelLoadError(f"{path}: {exc} (tensor-parallel rank {shard.rank} of {shard.size})") from None
        return loaded

    with ThreadPoolExecutor(min(len(shards), _MAX_LOAD_THREADS), thread_name_prefix="tp-shard") as pool:
        loaded: set[str] = set()
        for names in pool.map(read, shards):
            loaded |= names
    missing = model.required_weight_names() - loaded
    if missing:
        shown = ", ".join(sorted(missing)[:8])
        raise ModelLoadError(f"{folder}: {len(missing)} weight(s) missing from the checkpoint: {shown}")
    model.eval()
    return model
