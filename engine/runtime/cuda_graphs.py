"""CUDA graphs for decode batches: one launch for a whole decode step.

On CUDA a small model's decode step is bound by the host, not the GPU: about
30 layers of a dozen kernels each, every one launched from Python
(docs/benchmarks.md, "On a GPU"). A CUDA graph records a step's kernels
once and replays them with a single launch, as vLLM does unless told
``--enforce-eager`` (our ``EngineConfig.enforce_eager``).

A graph is recorded for a shape, not for a batch:

- ``rows``: the batch's sequences, padded up to the next of
  ``graph_batch_sizes`` (1, 2, 4, then multiples of 8);
- ``width``: the blocks of the longest context, padded up to a power of two
  (at most a whole ``max_model_len``). Attention gathers ``width`` blocks
  for every row and masks what lies past each row's context
  (``AttentionMetadata.for_decode_tables``).

Only decode-only steps run as graphs: every sequence one token and its
logits. Prefill chunks, speculative verification, and shapes whose gathered
keys and values would exceed ``MAX_GATHER_BYTES`` run eagerly as before.

The graph reads its inputs from one static buffer (token ids, positions,
KV slots, context lengths, block tables); each step copies its values there
and replays. Padding rows repeat row 0 whole: the same token at the same
position writes the same key and value into row 0's slot, so no spare slot
is needed and no other sequence's cache is touched; their logits are
dropped.

A shape is recorded when a step first needs it, from that step's own inputs:
the warm-up run before the recording writes exactly the keys and values the
step writes anyway, so recording never disturbs a cached sequence. All
graphs share one memory pool.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

import attrs
import torch

from trioserve.engine.layers.attention import AttentionMetadata
from trioserve.engine.layers.forward_batch import SeqChunk
from trioserve.engine.layers.kv_cache import KVCache

log = logging.getLogger(__name__)

# vLLM's default capture sizes go to 512 sequences; past that a step is
# large enough for its launches not to matter.
MAX_GRAPH_ROWS = 512
# The keys and values one layer's decode attention gathers (rows x width
# blocks): the largest recorded graph holds this much of the pool for good,
# so longer contexts in large batches run eagerly instead.
MAX_GATHER_BYTES = 256 << 20


def graph_batch_sizes(max_num_seqs: int) -> tuple[int, ...]:
    """The row counts graphs are recorded at: 1, 2, 4, then multiples of 8,
    up to the first that holds ``max_num_seqs`` (at most ``MAX_GRAPH_ROWS``)."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    sizes = []
    for size in (1, 2, 4, *range(8, MAX_GRAPH_ROWS + 1, 8)):
        sizes.append(size)
        if size >= max_num_seqs:
            break
    return tuple(sizes)


@attrs.frozen
class GraphShape:
    """What a recorded graph is for: ``rows`` sequences, ``width`` blocks each."""

    rows: int
    width: int


@attrs.frozen(eq=False)
class Recording:
    """A recorded step: ``replay()`` runs it again and leaves its result in ``output``."""

    replay: Callable[[], None]
    output: torch.Tensor


class CudaGraphRecorder:
    """Records steps as ``torch.cuda.CUDAGraph``s, all in one memory pool
    (graphs never run at once, so their scratch memory is shared)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pool = torch.cuda.graph_pool_handle()

    def __call__(self, step: Callable[[], torch.Tensor]) -> Recording:
        # Warm up outside the recording, as torch's docs ask: lazy
        # initialisation (cuBLAS handles and workspaces, autotuning) must not
        # land in the graph.
        current = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(current)
        with torch.cuda.stream(side):
            step()
        current.wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: the step thread records; nothing else may be
        # disturbed by (or disturb) the capture.
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            output = step()
        return Recording(graph.replay, output)


@attrs.frozen
class DecodeGraphStatistics:
    """How a runner's decode steps went: ``graphs`` shapes recorded (in
    ``record_seconds`` all told), ``replays`` steps run by replaying one,
    ``eager_steps`` decode-only steps that did not fit a graph; ``disabled``
    says why graphs stopped, if they did."""

    graphs: int
    replays: int
    eager_steps: int
    record_seconds: float
    disabled: str | None


@attrs.define(eq=False)
class _Graph:
    inputs: torch.Tensor  # the static buffer the graph reads: [rows * (4 + width)] int64
    replay: Callable[[], None]
    logits: torch.Tensor  # where the replay leaves [rows, vocab] float32 logits


@attrs.define(eq=False)
class DecodeGraphs:
    """Decode-only steps of ``model`` over ``kv_cache``, replayed from graphs.

    ``record`` turns a step function into a ``Recording``
    (``CudaGraphRecorder`` on CUDA). ``batch_sizes`` are the padded row
    counts (``graph_batch_sizes``); ``max_width`` is the most blocks a
    sequence has (a whole ``max_model_len``).
    """

    model: torch.nn.Module
    kv_cache: KVCache
    record: Callable[[Callable[[], torch.Tensor]], Recording]
    batch_sizes: tuple[int, ...]
    max_width: int
    max_gather_bytes: int = MAX_GATHER_BYTES
    _graphs: dict[GraphShape, _Graph] = attrs.field(factory=dict, init=False)
    _replays: int = attrs.field(default=0, init=False)
    _eager_steps: int = attrs.field(default=0, init=False)
    _record_seconds: float = attrs.field(default=0.0, init=False)
    _disabled: str | None = attrs.field(default=None, init=False)

    @classmethod
    def choose(
        cls, model: torch.nn.Module, kv_cache: KVCache, *, enforce_eager: bool, max_num_seqs: int, max_model_len: int
    ) -> DecodeGraphs | None:
        """Graphs for a model on CUDA, unless ``enforce_eager``; None on
        CPU (nothing to record), for compressed projections (their
        kernels are the CPU's) and for a model without ``forward_decode``."""
        device = kv_cache.key.device
        if enforce_eager or device.type != "cuda":
            return None
        choice = getattr(model, "projection_choice", None)
        if choice is not None and choice.quantization is not None:
            return None
        if not hasattr(model, "forward_decode"):
            return None  # the transformers fallback (hf_fallback.py) has no fixed-shape decode step to record
        return cls(
            model,
            kv_cache,
            CudaGraphRecorder(device),
            graph_batch_sizes(max_num_seqs),
            max_width=-(-max_model_len // kv_cache.block_size),
        )

    def statistics(self) -> DecodeGraphStatistics:
        return DecodeGraphStatistics(
            graphs=len(self._graphs),
            replays=self._replays,
            eager_steps=self._eager_steps,
            record_seconds=self._record_seconds,
            disabled=self._disabled,
        )

    def shape_of(self, chunks: Sequence[SeqChunk]) -> GraphShape | None:
        """The graph ``chunks`` would run as, or None when they do not all
        decode one token with its logits, or need a shape not recorded
        (too many rows, too long a context, too much to gather)."""
        if self._disabled is not None or not chunks:
            return None
        longest = 0
        for chunk in chunks:
            if len(chunk.token_ids) != 1 or chunk.num_logits != 1:
                return None
            longest = max(longest, chunk.start_position + 1)
        block_size = self.kv_cache.block_size
        needed = -(-longest // block_size)
        width = min(1 << (needed - 1).bit_length(), self.max_width)
        rows = next((size for size in self.batch_sizes if size >= len(chunks)), None)
        if rows is None or needed > width or rows * width * block_size * self.kv_cache.token_bytes > self.max_gather_bytes:
            self._eager_steps += 1
            return None
        return GraphShape(rows, width)

    def run(self, chunks: Sequence[SeqChunk]) -> torch.Tensor | None:
        """The float32 logits of ``chunks`` (one row each, in order) from
        a graph, recording it first if its shape is new; None when they
        run eagerly instead (``shape_of``), their keys and values unwritten."""
        shape = self.shape_of(chunks)
        if shape is None:
            return None
        host = _graph_inputs(chunks, shape, self.kv_cache.block_size)
        graph = self._graphs.get(shape)
        if graph is None:
            graph = self._record_shape(shape, host)
            if graph is None:
                return None
        else:
            graph.inputs.copy_(host)
        graph.replay()
        self._replays += 1
        # A copy: the next replay of any graph may reuse this memory.
        return graph.logits[: len(chunks)].clone()

    def _record_shape(self, shape: GraphShape, host: torch.Tensor) -> _Graph | None:
        rows, width = shape.rows, shape.width
        inputs = host.to(self.kv_cache.key.device)
        token_ids, positions, slots, context_lens = inputs[: 4 * rows].view(4, rows)
        tables = inputs[4 * rows :].view(rows, width)

        def step() -> torch.Tensor:
            meta = AttentionMetadata.for_decode_tables(tables, context_lens, self.kv_cache)
            return self.model.forward_decode(token_ids, positions, slots, meta, self.kv_cache)

        start = time.perf_counter()
        try:
            recording = self.record(step)
        except RuntimeError as exc:
            # Whatever this model runs that a graph cannot hold, it runs
            # eagerly from now on rather than failing requests.
            self._disabled = f"recording a decode graph of {rows} rows x {width} blocks failed: {exc}"
            log.warning("CUDA graphs off: %s", self._disabled)
            return None
        seconds = time.perf_counter() - start
        self._record_seconds += seconds
        graph = _Graph(inputs, recording.replay, recording.output)
        self._graphs[shape] = graph
        log.info("recorded a decode graph of %d rows x %d blocks in %.0f ms", rows, width, seconds * 1000)
        return graph


def _graph_inputs(chunks: Sequence[SeqChunk], shape: GraphShape, block_size: int) -> torch.Tensor:
    """The static buffer's values for ``chunks`` (on the host): token ids,
    positions, KV slots and context lengths of ``shape.rows`` rows, then
    their ``[rows, width]`` block tables. Rows past the chunks repeat the
    first; a table is padded with its own first block."""
    rows, width = shape.rows, shape.width
    token_ids, positions, slots, context_lens = [], [], [], []
    tables: list[int] = []
    for i, chunk in enumerate(chunks):
        position = chunk.start_position
        needed = position // block_size + 1
        if position < 0 or len(chunk.block_table) < needed:
            raise ValueError(
                f"chunk {i}: block_table has {len(chunk.block_table)} blocks, "
                f"position {position} needs {needed}"
            )
        table = list(chunk.block_table[:needed])
        token_ids.append(chunk.token_ids[0])
        positions.append(position)
        slots.append(table[-1] * block_size + position % block_size)
        context_lens.append(position + 1)
        tables.extend(table + table[:1] * (width - needed))
    pad = rows - len(chunks)
    columns = [values + values[:1] * pad for values in (token_ids, positions, slots, context_lens)]
    tables.extend(tables[:width] * pad)
    return torch.tensor([v for column in columns for v in column] + tables, dtype=torch.int64)
