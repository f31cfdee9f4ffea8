"""The ranks of a tensor-parallel engine: starting them, the driver's runner,
and the loop every other rank runs.

Rank 0 lives in the engine's process, on its step thread, as nano-vllm's
does: the scheduler's plan reaches it without another hop, its sampled
tokens go straight back, and one process fewer holds a copy of the Python
runtime. Its runner (``TPRunner``) is an ordinary ``Runner``
(``execute(plan) -> RunnerOutput``), so the thread executor drives it
today and a worker process could drive it the same way. The other ranks
(``rank_main``) loop on messages that rank 0 broadcasts with
``broadcast_object_list``; every message is a frozen, picklable value:

- ``LoadShard``: where the checkpoint is and how to load it; each rank reads
  only its slices, all ranks at once;
- ``AllocateKV``: the pool's size and dtype, which rank 0 decides from its
  budget and ``kv_cache_dtype``;
- a ``StepPlan``: run the forward (rank 0 alone samples);
- ``Stop``: leave the group and exit.

Local ranks are started with ``torch.multiprocessing`` (spawn) and hold the
read end of a pipe whose write end only the parent holds: when the parent
dies, even by SIGKILL, the kernel closes it, and a watcher thread in the
rank sees EOF and exits the process. (``PR_SET_PDEATHSIG`` would fire when
the *thread* that started the rank ends, and the step thread may be
replaced; the pipe follows the process.) Ranks on other machines are
started by ``trioserve worker`` (``run_worker``), which starts its local
ranks the same way.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Sequence
from typing import Any

import attrs
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from trioserve.engine.config import EngineConfig
from trioserve.engine.parallel.distributed import DistributedError, Rendezvous, backend_for, close_group, free_port, init_group, wait_reachable
from trioserve.engine.layers.kv_cache import KVCache, kv_bytes_per_block
from trioserve.engine.kernels.kv_dtype import DTYPES as KV_DTYPES
from trioserve.engine.kernels.kv_dtype import kv_dtype_name
from trioserve.engine.loading.loader import LoadedModel, resolve_device, resolve_dtype
from trioserve.engine.loading.sources import read_model_config, resolve_checkpoint
from trioserve.engine.models.hf_fallback import require_native
from trioserve.engine.runtime.model_runner import ModelRunner, RunnerOutput, StepLogits
from trioserve.engine.sampling.sampler import Sampler
from trioserve.engine.runtime.step_plan import StepPlan
from trioserve.engine.sampling.rows import TokenMask
from trioserve.engine.parallel.tensor_parallel import TPLlamaForCausalLM, TPShard, check_tensor_parallel, load_shard
from trioserve.engine.text.tokenizer import eos_token_ids, load_tokenizer

log = logging.getLogger(__name__)

# Seconds ``close`` waits for a rank to exit after Stop before killing it.
_JOIN_TIMEOUT = 10.0


@attrs.frozen
class LoadShard:
    """Load your part of the checkpoint ``model`` (as the user named it:
    each machine resolves it on its own disk)."""

    model: str | None
    dtype: str
    device_type: str


@attrs.frozen
class AllocateKV:
    num_blocks: int
    block_size: int
    dtype: str  # as kv_dtype.DTYPES names it: every rank stores what rank 0 chose


@attrs.frozen
class Stop:
    pass


def _broadcast(message: object = None) -> Any:
    """Rank 0 sends ``message``; every other rank gets it."""
    box = [message]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _device_for(device_type: str, local_rank: int) -> torch.device:
    return torch.device("cuda", local_rank) if device_type == "cuda" else torch.device("cpu")


def _load(message: LoadShard, rank: int, world_size: int, local_rank: int) -> TPLlamaForCausalLM:
    device = _device_for(message.device_type, local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    folder, _ = resolve_checkpoint(message.model)
    model_config = read_model_config(folder)
    shard = TPShard(model_config, rank, world_size)
    return load_shard(folder, model_config, shard, dtype=resolve_dtype(message.dtype, device), device=device)


# -- the other ranks -------------------------------------------------------------


@attrs.frozen
class RankSpec:
    """What a spawned rank needs to join its group."""

    rendezvous: Rendezvous
    rank: int
    local_rank: int
    num_threads: int


def _watch_parent(parent: Any) -> None:
    """Exit this process when the parent's end of ``parent`` closes."""

    def watch() -> None:
        try:
            parent.recv()
        except (EOFError, OSError):
            pass
        os._exit(0)

    threading.Thread(target=watch, name="tp-parent-watch", daemon=True).start()


def rank_main(spec: RankSpec, parent: Any) -> None:
    """A rank other than 0: join the group, then follow rank 0's messages
    until ``Stop``. Runs in a spawned process."""
    _watch_parent(parent)
    logging.basicConfig(level=logging.WARNING, format=f"%(asctime)s rank {spec.rank} %(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(spec.num_threads)
    init_group(spec.rendezvous, spec.rank)
    world = spec.rendezvous.world_size
    runner: ModelRunner | None = None
    model: TPLlamaForCausalLM | None = None
    try:
        while True:
            message = _broadcast()
            if isinstance(message, Stop):
                break
            if isinstance(message, LoadShard):
                model = _load(message, spec.rank, world, spec.local_rank)
            elif isinstance(message, AllocateKV):
                assert model is not None
                device = model.embed_tokens.device
                kv = KVCache.allocate(
                    model.config, num_blocks=message.num_blocks, block_size=message.block_size,
                    dtype=KV_DTYPES[message.dtype], device=device,
                )  # fmt: skip
                runner = ModelRunner(model, kv, Sampler(model.config.vocab_size, device), device)
            else:
                assert isinstance(message, StepPlan) and runner is not None
                if message.chunks:
                    with torch.inference_mode(), runner._attention_backends():
                        runner.forward(message)
    finally:
        close_group()


def start_local_ranks(spec: Rendezvous, ranks: Sequence[int], num_threads: int) -> list[tuple[Any, Any]]:
    """Spawn ``ranks`` of ``spec`` as processes of this one; return
    ``(process, pipe end)`` pairs (closing the pipe end ends the rank)."""
    context = mp.get_context("spawn")
    started = []
    first = ranks[0] - ranks[0] % spec.ranks_per_node
    for rank in ranks:
        mine, theirs = context.Pipe()
        process = context.Process(
            target=rank_main,
            args=(RankSpec(spec, rank, rank - first, num_threads), theirs),
            name=f"trioserve-tp-rank-{rank}",
            daemon=True,
        )
        process.start()
        theirs.close()
        started.append((process, mine))
    return started


def stop_processes(started: Sequence[tuple[Any, Any]], timeout: float = _JOIN_TIMEOUT) -> None:
    """Join ranks told to stop; kill what has not exited after ``timeout``."""
    for process, _ in started:
        process.join(timeout)
        if process.is_alive():
            log.warning("tensor-parallel rank %s did not exit; killing it", process.name)
            process.kill()
            process.join()
    for _, pipe in started:
        pipe.close()


# -- rank 0 ----------------------------------------------------------------------


@attrs.define
class TPRunner:
    """Rank 0's runner: sends each plan to the other ranks, runs its own
    part, and samples from the gathered logits. ``close`` stops the ranks
    (the local ones are the model's ``local_ranks``). Several runners may
    follow one another on one model (each sizes the ranks' KV pools anew);
    closing any ends the group."""

    inner: ModelRunner

    @property
    def block_size(self) -> int:
        return self.inner.block_size

    @property
    def model(self) -> TPLlamaForCausalLM:
        return self.inner.model  # type: ignore[return-value]

    def execute(self, plan: StepPlan) -> RunnerOutput:
        assert not plan.awaits_mask, "a plan awaiting its mask runs as forward_step, then sample_step"
        return self.sample_step(self.forward_step(plan), plan.token_mask)

    def forward_step(self, plan: StepPlan) -> StepLogits:
        """Every rank's forward of ``plan``; the logits gather on rank 0."""
        if not dist.is_initialized():
            raise DistributedError("the tensor-parallel group is closed")
        _broadcast(plan)
        return self.inner.forward_step(plan)

    def sample_step(self, step: StepLogits, token_mask: TokenMask | None) -> RunnerOutput:
        """Rank 0 alone samples (a structured output's mask reaches only it)."""
        return self.inner.sample_step(step, token_mask)

    def logits(self, plan: StepPlan) -> torch.Tensor:
        """The gathered logits of ``plan``'s sampling chunks, without
        sampling (for checks against one rank; ``plan`` is run as a step)."""
        _broadcast(plan)
        with torch.inference_mode(), self.inner._attention_backends():
            return self.inner.forward(plan)

    def collective_seconds(self) -> tuple[float, int]:
        """Seconds rank 0 spent in collectives, and how many, since the last call."""
        return self.model.timer.reset()

    def close(self) -> None:
        """Stop the group (``stop_tensor_parallel``). Idempotent."""
        stop_tensor_parallel(self.model)


def stop_tensor_parallel(model: TPLlamaForCausalLM) -> None:
    """Tell every rank of rank 0's ``model`` to stop, join the local ones
    (killing any that hang) and leave the group. Idempotent."""
    if dist.is_initialized():
        try:
            _broadcast(Stop())
        except RuntimeError as exc:  # a rank is gone already
            log.warning("stopping the tensor-parallel ranks: %s", exc)
    processes, model.local_ranks = model.local_ranks, []
    stop_processes(processes)
    close_group()


def threads_per_rank(config: EngineConfig, local_ranks: int) -> int:
    """Torch threads for each rank on a machine: ``num_threads``, else the
    cores shared out between the machine's ranks."""
    if config.num_threads is not None:
        return config.num_threads
    return max(1, (os.cpu_count() or 1) // local_ranks)


def rendezvous_for(config: EngineConfig, device: torch.device) -> Rendezvous:
    """The group an engine of ``config`` forms (node 0 is the engine's)."""
    port = config.master_port
    if port is None:
        if config.nnodes > 1:
            raise ValueError("master_port is required when the group spans several machines (nnodes > 1)")
        port = free_port()
    return Rendezvous(
        world_size=config.tensor_parallel_size,
        master_addr=config.master_addr,
        master_port=port,
        nnodes=config.nnodes,
        backend=backend_for(device),
        timeout=config.distributed_timeout,
    )


def start_tensor_parallel(config: EngineConfig) -> LoadedModel:
    """Check the model can be split, start the local ranks, form the group
    and load rank 0's part (every rank loads its own at the same time).
    Returns rank 0's ``LoadedModel``: its model is a ``TPLlamaForCausalLM``;
    ``tensor_parallel_runner`` then makes the engine's runner.

    Raises ``ValueError`` for sizes the model cannot split (naming its head
    count) and ``DistributedError`` when the group cannot form, before any
    rank loads anything."""
    if dist.is_initialized():
        raise DistributedError("this process already leads a tensor-parallel group: one such engine per process")
    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, device)
    folder, name = resolve_checkpoint(config.model)
    model_config = read_model_config(folder)
    require_native(model_config, f"tensor parallelism (tensor_parallel_size={config.tensor_parallel_size}; use 1)")
    check_tensor_parallel(model_config, config.tensor_parallel_size)
    rendezvous = rendezvous_for(config, device)
    local = rendezvous.node_ranks(0)
    threads = threads_per_rank(config, len(local))
    torch.set_num_threads(threads)
    processes = start_local_ranks(rendezvous, local[1:], threads) if len(local) > 1 else []
    try:
        init_group(rendezvous, 0)
        _broadcast(LoadShard(config.model, str(dtype).removeprefix("torch."), device.type))
        model = load_shard(folder, model_config, TPShard(model_config, 0, rendezvous.world_size), dtype=dtype, device=device)
        tokenizer = load_tokenizer(folder)
    except BaseException:
        for _, pipe in processes:
            pipe.close()  # the ranks exit on EOF
        stop_processes(processes, timeout=5.0)
        close_group()
        raise
    eos = eos_token_ids(tokenizer, model_config.eos_token_ids, folder)
    model.projection_choice = attrs.evolve(model.projection_choice, invariance=model.invariance())
    log.info("%s: tensor-parallel over %d ranks (%s), %s", name, rendezvous.world_size, rendezvous.backend, model.projection_choice)
    log.warning("%s: %s", name, model.projection_choice.invariance)
    loaded = LoadedModel(
        model=model,
        model_config=attrs.evolve(model_config, eos_token_ids=eos),
        tokenizer=tokenizer,
        name=name,
        path=folder,
        dtype=dtype,
        device=device,
    )
    model.local_ranks = processes
    return loaded


def tensor_parallel_runner(runner: ModelRunner) -> TPRunner:
    """Wrap rank 0's ``runner`` (over a ``TPLlamaForCausalLM`` from
    ``start_tensor_parallel``): the other ranks allocate KV pools of the
    same number of blocks, and from now on follow its plans."""
    model = runner.model
    assert isinstance(model, TPLlamaForCausalLM)
    kv = runner.kv_cache
    _broadcast(AllocateKV(kv.num_blocks, kv.block_size, kv_dtype_name(kv.dtype)))
    return TPRunner(runner)


def kv_bytes_per_rank_block(loaded: LoadedModel, block_size: int, kv_dtype: torch.dtype | None = None) -> int:
    """Bytes one block takes on a rank: its KV heads only, in ``kv_dtype`` (default: the model's dtype)."""
    return kv_bytes_per_block(loaded.model.config, block_size, loaded.dtype if kv_dtype is None else kv_dtype)


# -- other machines ----------------------------------------------------------------


def run_worker(
    *,
    tensor_parallel_size: int,
    nnodes: int,
    node_rank: int,
    master_addr: str,
    master_port: int | None,
    timeout: float,
    num_threads: int | None = None,
    device: str | None = None,
) -> int:
    """``trioserve worker``: run machine ``node_rank``'s ranks of the group
    whose node 0 is a server at ``master_addr:master_port``; return when
    they have all exited (0 when each stopped cleanly). Raises
    ``DistributedError`` naming the address if it does not answer within
    ``timeout`` seconds, before any rank starts. ``device``: "cpu" or
    "cuda" as on node 0 (None: CUDA when present, as there)."""
    if master_port is None:
        raise ValueError("a worker needs --master-port (or MASTER_PORT): where node 0 waits")
    if node_rank == 0:
        raise ValueError("node 0 is the server's (trioserve serve --nnodes ...); a worker's --node-rank is 1 or more")
    rendezvous = Rendezvous(
        world_size=tensor_parallel_size,
        master_addr=master_addr,
        master_port=master_port,
        nnodes=nnodes,
        backend=backend_for(resolve_device(device)),
        timeout=timeout,
    )
    ranks = rendezvous.node_ranks(node_rank)
    wait_reachable(master_addr, master_port, timeout)
    threads = num_threads or max(1, (os.cpu_count() or 1) // len(ranks))
    started = start_local_ranks(rendezvous, ranks, threads)
    log.info("ranks %d..%d of %d started, meeting at %s", ranks[0], ranks[-1], rendezvous.world_size, rendezvous.address)
    try:
        for process, _ in started:
            process.join()
    finally:
        stop_processes(started, timeout=0.0)
    return max((abs(process.exitcode or 0) for process, _ in started), default=0)
