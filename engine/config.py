"""Model and engine configuration.

``ModelConfig`` is what the model code needs from a Hugging Face
``config.json``; ``EngineConfig`` is what a user sets when starting an engine.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import attrs

from trioserve.engine.latency_objectives import ObjectiveDefaults
from trioserve.engine.errors import GenerationConfigError
from trioserve.engine.lora.config import LoraConfig
from trioserve.engine.model_config import (  # noqa: F401  # re-exported: where callers import them from
    ARCHITECTURE_BY_MODEL_TYPE,
    FULL_ATTENTION,
    SLIDING_ATTENTION,
    SUPPORTED_ACTIVATIONS,
    SUPPORTED_ARCHITECTURES,
    SUPPORTED_ROPE_TYPES,
    ModelConfig,
    Rope,
    RopeScaling,
)
from trioserve.engine.validators import integer_at_least, optional_fraction, optional_positive, optional_positive_finite, positive

DEFAULT_WATCHDOG_TIMEOUT = 300.0
DEFAULT_MAX_BUFFERED_OUTPUTS = 64
DEFAULT_SHUTDOWN_TIMEOUT = 30.0
# Compiled grammars kept for structured output: a mid-size JSON schema's
# takes a few hundred KB (docs/api.md), so the cache stays in tens of MB.
DEFAULT_GRAMMAR_CACHE_SIZE = 128


def _kv_cache_memory(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value is None:
        return
    if isinstance(value, float) and not (0.0 < value <= 1.0):
        raise ValueError(f"kv_cache_memory as a fraction must be in (0, 1], got {value!r}")
    if isinstance(value, int) and value <= 0:
        raise ValueError(f"kv_cache_memory in bytes must be > 0, got {value!r}")


WORKER_MODES = ("thread", "process")
# The built-in scheduling policies (--scheduling-policy): "priority" runs
# lower priority values first, first come first served within a class;
# "slo" orders a class by deadline slack and admission refuses at the
# door what cannot meet its latency objectives (issue #44).
SCHEDULING_POLICIES = ("priority", "slo")
# What the KV cache may store (engine/kernels/kv_dtype_choice.py); "fp8" is e4m3, on CUDA only.
KV_CACHE_DTYPES = ("auto", "float32", "float16", "bfloat16", "fp8")
GENERATION_CONFIG_FILE = "generation_config.json"


def _worker_mode(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value not in WORKER_MODES:
        raise ValueError(f"worker_mode must be one of {', '.join(map(repr, WORKER_MODES))}, got {value!r}")


def _kv_cache_dtype(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(map(repr, KV_CACHE_DTYPES))}, got {value!r}")


def _generation_config(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    # The form and the path only: the file's fields are checked where it is
    # read (loading/generation_config.py), when an engine opens.
    if not isinstance(value, str) or not value:
        raise GenerationConfigError(f"generation_config must be 'auto', 'none' or a path, got {value!r}")
    if value not in ("auto", "none"):
        generation_config_path(value)

def generation_config_path(value: str) -> Path:
    """The file a ``generation_config`` path names: the file itself, or a
    folder's ``generation_config.json``."""
    path = Path(value).expanduser()
    if path.is_dir():
        path = path / GENERATION_CONFIG_FILE
        if not path.is_file():
            raise GenerationConfigError(f"generation_config: {path.parent} holds no {GENERATION_CONFIG_FILE}")
    elif not path.exists():
        raise GenerationConfigError(f"generation_config: {path}: no such file or folder")
    return path


def _speculative(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value not in (None, "ngram"):
        raise ValueError(f"speculative must be None or 'ngram', got {value!r}")


def _seconds(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value is None:
        raise ValueError(f"{attribute.name} must be a finite number > 0, got None")
    optional_positive_finite(instance, attribute, value)


@attrs.frozen(kw_only=True)
class DegradationPolicy:
    """What the engine gives up, step by step, as its admission queue fills.

    *Pressure* is the admission queue's fill: the larger of queued requests
    over ``max_queued_requests`` and queued prompt tokens over
    ``max_queued_tokens`` (when set), in [0, 1]; 1 while callers wait for
    room. It is 0 until the engine's own working set (``max_num_seqs``
    running and as many waiting) is full, so it measures backlog only.

    - pressure >= ``cap_at``: a new request of low priority (``priority >=
      low_priority``; lower values run first, the default is 0) gets
      ``max_tokens`` capped at ``low_priority_max_tokens``;
    - pressure >= ``refuse_expensive_at``: ``generate_nowait`` refuses
      requests with ``n > 1`` or more than ``expensive_logprobs`` top
      logprobs (``ExpensiveRequestRefused``, HTTP 429) while plain ones are
      still let in;
    - queue full: with ``shed_lower_priority`` a new request displaces the
      queued request of the lowest priority (the latest among equals) if that
      is strictly lower than its own (``RequestShed``, HTTP 429); otherwise
      it is refused (``EngineOverloaded``, HTTP 429).

    None turns a threshold off. With every request at one priority and
    ``n == 1`` only the last step ever applies.
    """

    low_priority: int = 1
    cap_at: float | None = attrs.field(default=0.5, validator=optional_fraction)
    low_priority_max_tokens: int = attrs.field(default=256, validator=integer_at_least(1))
    refuse_expensive_at: float | None = attrs.field(default=0.75, validator=optional_fraction)
    expensive_logprobs: int = attrs.field(default=5, validator=integer_at_least(0))
    shed_lower_priority: bool = True


@attrs.frozen(kw_only=True)
class EngineConfig:
    """Everything a user sets when starting an engine.

    ``kv_cache_memory`` is the KV pool's budget: an ``int`` is bytes, a
    ``float`` in (0, 1] a fraction of the device's free memory at start.
    ``None`` picks a default (engine/core/kv_budget.py): on CPU what is asked,
    ``max_num_seqs`` full contexts at ``kv_cache_dtype``'s bytes per token,
    capped at 4 GiB and a quarter of the host's available memory (shared with
    everything else) and never below one full context; 0.8 of free memory
    on CUDA, as vLLM does. The pool never needs to be larger than
    ``max_num_seqs`` full contexts, so it is capped at that.
    """

    model: str | None = None  # a name, a checkpoint folder or a .gguf file; None is the default model
    dtype: str | None = None  # "float32", "bfloat16" or "float16"; None: float32 on CPU, bfloat16 on CUDA
    device: str | None = None  # "cpu", "cuda", "cuda:1"; None: CUDA when present
    block_size: int = attrs.field(default=16, validator=positive)
    kv_cache_memory: int | float | None = attrs.field(default=None, validator=_kv_cache_memory)
    max_model_len: int | None = attrs.field(default=None, validator=optional_positive)
    max_num_seqs: int = attrs.field(default=64, validator=positive)
    max_num_batched_tokens: int = attrs.field(default=2048, validator=positive)
    enable_prefix_caching: bool = True
    # Admission bounds (the actors' backpressure): requests waiting to be scheduled.
    max_queued_requests: int = attrs.field(default=256, validator=positive)
    max_queued_tokens: int | None = attrs.field(default=None, validator=optional_positive)
    # A waiting request gains one priority level per this many steps, so low
    # priority is delayed, never starved (None: strict priorities).
    priority_aging_steps: int | None = attrs.field(default=256, validator=optional_positive)
    # Torch threads for the model step; None leaves torch's default.
    num_threads: int | None = attrs.field(default=None, validator=optional_positive)
    # Build the CPU kernels for every batch size at start (a few seconds), so
    # memory is flat while serving and no request waits for a kernel; False
    # starts faster and builds each as it is first met (engine/kernels/onednn.py).
    warm_up: bool = True
    # Run CUDA decode steps op by op, as vLLM's --enforce-eager; by default
    # a decode-only step replays a CUDA graph recorded for its shape
    # (engine/runtime/cuda_graphs.py). No effect on CPU.
    enforce_eager: bool = attrs.field(default=False, validator=attrs.validators.instance_of(bool))
    # Overload control (docs/reliability.md, "Overload control").
    # Seconds a request may wait from its arrival before anything is computed
    # for it; past that it is dropped (QueueTimeout; HTTP 503). None: no bound.
    max_queue_time: float | None = attrs.field(default=None, validator=optional_positive_finite)
    # Lower the running-sequence limit while the p90 time per output token is
    # above target_tpot_ms, raise it while below (AIMD, within [1, max_num_seqs]).
    adaptive_concurrency: bool = False
    target_tpot_ms: float = attrs.field(default=100.0, validator=optional_positive_finite)
    degradation: DegradationPolicy = attrs.field(factory=DegradationPolicy)
    # Latency objectives (docs/reliability.md, "Latency objectives"): the
    # scheduling policy (SCHEDULING_POLICIES), and the targets a request that
    # gives none gets. Only "slo" enforces targets; under "priority" they are
    # carried and reported as not enforced.
    scheduling_policy: str = attrs.field(default="priority", validator=attrs.validators.in_(SCHEDULING_POLICIES))
    slo_defaults: ObjectiveDefaults = attrs.field(
        factory=ObjectiveDefaults, validator=attrs.validators.instance_of(ObjectiveDefaults)
    )
    # Seconds a model step may run before the executor declares it hung:
    # its requests fail, their KV blocks are quarantined until it returns,
    # and the next steps run on a fresh thread (docs/reliability.md). As
    # SGLang's --watchdog-timeout (default 300 s there too); None: no watchdog.
    watchdog_timeout: float | None = attrs.field(default=DEFAULT_WATCHDOG_TIMEOUT, validator=optional_positive_finite)
    # Outputs a request's reader may fall behind before its sequence is
    # paused (preempted by recompute, its output kept) until the reader
    # catches up; each request's output channel holds this many plus a fixed
    # reserve (docs/architecture.md, "The output channel's reserve").
    max_buffered_outputs: int = attrs.field(default=DEFAULT_MAX_BUFFERED_OUTPUTS, validator=integer_at_least(1))
    # Seconds that leaving ``async with open_engine(...)`` waits for what is
    # left to be aborted and the step in flight to finish before it cancels
    # the actors. Call ``Engine.drain`` first to let requests finish.
    shutdown_timeout: float = attrs.field(default=DEFAULT_SHUTDOWN_TIMEOUT, validator=positive)
    # Engine replicas (data parallelism), each with its own KV pool,
    # allocator, executor and scheduler; requests are routed by prefix
    # affinity and load (actors/replicas.py). On CUDA replica i runs on
    # cuda:i; on CPU each gets a share of the cores and ``num_threads`` is
    # per replica (engine/parallel/placement.py).
    data_parallel_size: int = attrs.field(default=1, validator=integer_at_least(1))
    # Where the model step runs (docs/reliability.md, "Worker processes"):
    # "thread", the engine's step thread in this process; or "process", a
    # worker process that loads the weights itself. A worker that dies is
    # restarted, and its requests recompute what they had; more than
    # ``max_worker_restarts`` restarts within ``worker_restart_window``
    # seconds and the worker is given up (its requests then fail).
    worker_mode: str = attrs.field(default="thread", validator=_worker_mode)
    max_worker_restarts: int = attrs.field(default=5, validator=integer_at_least(0))
    worker_restart_window: float = attrs.field(default=60.0, validator=_seconds)
    # Tensor parallelism (docs/deployment.md): ranks in one torch.distributed
    # group, ``nnodes`` machines with as many ranks each; this engine is
    # node 0 and hosts the rendezvous at master_addr:master_port (None: a
    # free port, on one machine only). ``distributed_timeout`` bounds the
    # wait for the master's port, for every rank to join, and any collective.
    tensor_parallel_size: int = attrs.field(default=1, validator=integer_at_least(1))
    nnodes: int = attrs.field(default=1, validator=integer_at_least(1))
    master_addr: str = "127.0.0.1"
    master_port: int | None = attrs.field(default=None, validator=optional_positive)
    distributed_timeout: float = attrs.field(default=120.0, validator=optional_positive_finite)
    # Speculative decoding without a draft model (engine/sampling/speculative.py):
    # "ngram" proposes up to ``num_speculative_tokens`` tokens per decoding
    # sequence and step by matching its latest ``speculative_max_ngram`` ..
    # ``speculative_min_ngram`` tokens against its prompt and output; None: off.
    speculative: str | None = attrs.field(default=None, validator=_speculative)
    num_speculative_tokens: int = attrs.field(default=4, validator=integer_at_least(1))
    speculative_max_ngram: int = attrs.field(default=4, validator=integer_at_least(1))
    # 2 by default (1-gram proposals verified more rows than they saved:
    # docs/benchmarks.md), or the longest when that is 1.
    speculative_min_ngram: int = attrs.field(
        default=attrs.Factory(lambda self: min(2, self.speculative_max_ngram), takes_self=True),
        validator=integer_at_least(1),
    )
    # Plugins to load by entry-point name (engine/plugins.py; --plugins).
    plugins: tuple[str, ...] = attrs.field(default=(), converter=tuple)
    # LoRA adapters (engine/lora; --enable-lora, --lora-modules): None serves none.
    lora: LoraConfig | None = None
    # Compressed weights (engine/kernels, docs/api.md): "auto" keeps a GGUF's
    # quantized matrices compressed on CPU (float32 activations) and loads
    # float checkpoints as they are; "int8" / "int4" quantize any checkpoint
    # round-to-nearest (per channel; in groups of quantization_group_size
    # inputs), once, cached; "none" is the dequantized float path. "auto"
    # is the default: on the default model compressed is 2.4x faster for one
    # stream in half the memory, and 0.76x float32's throughput at 32
    # streams, where "none" is the choice (docs/benchmarks.md in git history, "trioserve
    # against llama-server").
    quantization: str = attrs.field(default="auto", validator=attrs.validators.in_(("auto", "none", "int8", "int4")))
    quantization_group_size: int = attrs.field(default=32, validator=positive)
    # Structured output (engine/sampling/grammar.py): compiled grammars kept, least
    # recently used evicted first; one compile per distinct schema, regex or
    # grammar while it stays in (--grammar-cache-size).
    grammar_cache_size: int = attrs.field(default=DEFAULT_GRAMMAR_CACHE_SIZE, validator=integer_at_least(1))

    # What the KV cache stores (engine/kernels/kv_dtype_choice.py): "auto" is a 16-bit
    # dtype on CPU where its conversions work here, by a fixed rule (else
    # float32), and the model's dtype on CUDA; "fp8" (e4m3, saturating) runs
    # on CUDA only. Keys and values are computed in the model's dtype and
    # rounded into the cache's; a 16-bit cache holds twice the tokens of a
    # float32 one in the same bytes.
    kv_cache_dtype: str = attrs.field(default="auto", validator=_kv_cache_dtype)

    # Batch invariance (docs/architecture.md, "Same request, same answer"):
    # a request's tokens and logprobs do not depend on its batch mates, the
    # prefix cache, chunking, preemption or speculation. False keeps the
    # faster arithmetic for prompts that a decode step does not share
    # (--no-batch-invariant), at the cost of that guarantee.
    batch_invariant: bool = attrs.field(default=True, validator=attrs.validators.instance_of(bool))
    # The model's sampling defaults (generation_config.json, a GGUF's
    # sampling keys) fill the fields a request leaves out: "auto" reads the
    # model's, "none" ignores them, else the path of a generation_config.json.
    # A path is read and checked here (GenerationConfigError names the path
    # and the field), so a bad one stops startup before the model loads.
    generation_config: str = attrs.field(default="auto", validator=_generation_config)
    # What the model serves (engine/sampling/pooling.py): "generate" text,
    # "embed" pooled hidden states (/v1/embeddings), or "auto": embed for a
    # sentence-transformers folder (its modules.json has a Pooling module).
    task: str = attrs.field(default="auto", validator=attrs.validators.in_(("auto", "generate", "embed")))

    def __attrs_post_init__(self) -> None:
        if self.kv_cache_dtype == "fp8" and self.device is not None and str(self.device).startswith("cpu"):
            raise ValueError(
                "kv_cache_dtype 'fp8' runs on CUDA only, not on device 'cpu'; on CPU use auto, float32, float16 or bfloat16"
            )
        if self.speculative_min_ngram > self.speculative_max_ngram:
            raise ValueError(
                f"speculative_min_ngram ({self.speculative_min_ngram}) must be <= "
                f"speculative_max_ngram ({self.speculative_max_ngram})"
            )
        if self.tensor_parallel_size % self.nnodes:
            raise ValueError(
                f"tensor_parallel_size ({self.tensor_parallel_size}) must be a multiple of nnodes ({self.nnodes})"
            )
        if self.nnodes > 1 and self.master_port is None:
            raise ValueError("master_port is required when nnodes > 1 (the other machines must know where to meet)")
        if self.tensor_parallel_size > 1 and (self.data_parallel_size > 1 or self.worker_mode != "thread"):
            # Each would need a rank group per replica / inside the worker; refused rather than half-working.
            raise ValueError(
                "tensor_parallel_size > 1 runs with data_parallel_size 1 and worker_mode 'thread' only, "
                f"got data_parallel_size={self.data_parallel_size}, worker_mode={self.worker_mode!r}"
            )

    def resolved_max_model_len(self, model_config: ModelConfig) -> int:
        """The context limit in force: the user's, capped by the model's."""
        limit = model_config.max_context_len
        return limit if self.max_model_len is None else min(self.max_model_len, limit)

    def blocks_per_sequence(self, model_config: ModelConfig) -> int:
        return math.ceil(self.resolved_max_model_len(model_config) / self.block_size)
