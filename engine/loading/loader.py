"""Load a model and its tokenizer: the default model, a Hugging Face
checkpoint folder or a ``.gguf`` file.

Safetensors shards are read tensor by tensor, one thread per shard, each
tensor copied into the model's own parameters and dropped: peak memory is the
model plus a few tensors, never a second full copy. Every failure is a
``ModelLoadError`` naming the file or field, and leaves no model behind.
"""

from __future__ import annotations

import logging
import re
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import attrs
import torch

from trioserve.engine.loading import gguf_cache
from trioserve.engine.loading import compressed as quant_load
from trioserve.engine.loading import model_snapshot
from trioserve.engine.kernels import native
from trioserve.engine.kernels.capability import CpuPaths
from trioserve.engine.kernels.choose import KernelChoice
from trioserve.engine.config import EngineConfig, ModelConfig
from trioserve.engine.errors import CpuCapabilityError, ModelLoadError
from trioserve.engine.loading.gguf_cache import Progress
from trioserve.engine.loading.hf_fallback_weights import load_fallback
from trioserve.engine.loading.sources import find_shards, read_model_config, resolve_source
from trioserve.engine.heap_trim import fix_heap_thresholds
from trioserve.engine.models.hf_fallback import is_fallback, require_native
from trioserve.engine.models.llama import LlamaForCausalLM
from trioserve.engine.models.projections import ProjectionChoice, choose_projections
from trioserve.engine.text.tokenizer import eos_token_ids, load_tokenizer

logger = logging.getLogger(__name__)

# Shard reads are memory copies that release the GIL; more threads than this
# only contend for memory bandwidth.
_MAX_LOAD_THREADS = 4
# Which config fields decide a weight's shape: named in the error when a
# checkpoint and its config.json disagree.
_SHAPE_FIELDS = (
    ("embed_tokens", ("vocab_size", "hidden_size")),
    ("lm_head", ("vocab_size", "hidden_size")),
    ("q_proj", ("num_attention_heads", "head_dim", "hidden_size")),
    ("k_proj", ("num_key_value_heads", "head_dim", "hidden_size")),
    ("v_proj", ("num_key_value_heads", "head_dim", "hidden_size")),
    ("o_proj", ("num_attention_heads", "head_dim", "hidden_size")),
    ("mlp.", ("intermediate_size", "hidden_size")),
    ("norm", ("hidden_size",)),
)
_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


@attrs.frozen
class LoadedModel:
    """A model ready to run, with what the engine needs to know about it.

    ``path`` is the checkpoint folder the weights were read from (for a GGUF
    file, its cache folder). ``model_config.eos_token_ids`` holds every EOS id:
    the config's, ``generation_config.json``'s and the tokenizer's.
    """

    model: LlamaForCausalLM
    model_config: ModelConfig
    tokenizer: Any
    name: str
    path: Path
    dtype: torch.dtype
    device: torch.device
    # A GGUF model built this start: its snapshot being written for the next
    # (model_snapshot); None where it was mapped from one, or none is kept.
    snapshot_writer: model_snapshot.SnapshotWriter | None = None

    @property
    def cpu_paths(self) -> CpuPaths | None:
        """What the CPU can run, as found when the model was built (None off CPU)."""
        return self.model.cpu_paths

    @property
    def projection_choice(self) -> ProjectionChoice:
        """Which projection path the model runs, and why."""
        return self.model.projection_choice



def resolve_device(device: str | torch.device | None) -> torch.device:
    """``None`` is CUDA when present, else CPU; a CUDA device must exist."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError):
        raise ModelLoadError(f"device {device!r} is not a torch device (try 'cpu', 'cuda' or 'cuda:1')") from None
    if resolved.type == "cuda":
        if not torch.cuda.is_available():
            raise ModelLoadError(f"device {device!r}: CUDA is not available on this machine")
        if resolved.index is not None and resolved.index >= torch.cuda.device_count():
            raise ModelLoadError(f"device {device!r}: only {torch.cuda.device_count()} CUDA device(s) present")
    elif resolved.type != "cpu":
        raise ModelLoadError(f"device {device!r}: only 'cpu' and 'cuda' devices are supported")
    return resolved


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """``None`` (or ``"auto"``) is float32 on CPU and bfloat16 on CUDA."""
    if dtype is None or dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, torch.dtype):
        if dtype in _DTYPES.values():
            return dtype
    elif isinstance(dtype, str) and dtype.lower().removeprefix("torch.") in _DTYPES:
        return _DTYPES[dtype.lower().removeprefix("torch.")]
    raise ModelLoadError(f"dtype {dtype!r} is not supported; use float32, bfloat16 or float16")


def load_model_for(config: EngineConfig) -> LoadedModel:
    """``load_model`` with the model, dtype, device and quantization an
    engine's configuration names."""
    return load_model(
        config.model,
        dtype=config.dtype,
        device=config.device,
        quantization=config.quantization,
        quantization_group_size=config.quantization_group_size,
        batch_invariant=config.batch_invariant,
    )


def load_model(
    model: str | None = None,
    *,
    dtype: str | torch.dtype | None = None,
    device: str | None = None,
    cache_dir: Path | None = None,
    cpu_paths: CpuPaths | None = None,
    quantization: str = "none",
    quantization_group_size: int = 32,
    batch_invariant: bool = True,
) -> LoadedModel:
    """Load ``model``: ``None`` or ``"SmolLM2-135M-Instruct"`` for the default,
    a checkpoint folder, or a ``.gguf`` file (its config and tokenizer kept
    once in ``cache_dir``, default ``$TRIOSERVE_CACHE`` or
    ``~/.cache/trioserve``; its weights read from the mapped file where they
    load compressed, else dequantized once into the cache too: ``gguf_cache``).

    On CPU, ``cpu_paths`` (default: ``CpuPaths.from_environment()``) says
    what this machine runs; the model picks its path from it, and the
    choice is logged once.

    ``quantization`` (``engine/kernels``): ``"auto"`` keeps a GGUF's
    quantized matrices compressed where this machine runs a compressed
    kernel (CPU, float32) and loads float checkpoints as they are;
    ``"int8"`` / ``"int4"`` compress any checkpoint (round to nearest, per
    channel or in groups of ``quantization_group_size``); ``"none"``
    dequantizes a GGUF to float as before.

    ``batch_invariant`` (``LlamaForCausalLM.invariance``): every token on
    one arithmetic, whatever shares its step; False lets prompts take
    faster arithmetic that decode steps do not share.

    Where this start builds a compressed GGUF model, what it built is kept
    in its cache entry (``model_snapshot``, written by
    ``LoadedModel.snapshot_writer``; ``$TRIOSERVE_MODEL_SNAPSHOT=0`` turns it
    off), and a later start with the same file, code, kernel and CPU maps
    it instead of building again.

    Raises ``ModelLoadError`` naming the file or field at fault, and its
    ``CpuCapabilityError`` for a dtype or quantization this CPU cannot run,
    before anything is read.
    """
    torch_device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, torch_device)
    cpu_paths = _check_cpu(torch_device, torch_dtype, cpu_paths)
    source, name = resolve_source(model)
    # Before the weights' blocks come and go, so that loading leaves no
    # arena a large free top (heap_trim.py).
    fix_heap_thresholds()
    # A GGUF whose weights load compressed is read from the file itself
    # (mapped, each tensor decoded as the model is built): its cache entry
    # needs the config and tokenizer only, not the weights dequantized.
    is_gguf = source.is_file()
    from_file = is_gguf and quant_load.wanted(quantization, is_gguf=True, device=torch_device, dtype=torch_dtype)
    folder = gguf_cache.ensure_converted(source, cache_dir, weights=not from_file) if is_gguf else source
    model_config = read_model_config(folder)
    fallback = is_fallback(model_config)
    if fallback and quantization in ("int8", "int4"):
        require_native(model_config, f"compressed weights (quantization={quantization!r}; use 'auto' or 'none')")
    # "auto" on the fallback loads float weights: it has no compressed path.
    compressed = not fallback and quant_load.wanted(
        quantization, is_gguf=source.is_file(), device=torch_device, dtype=torch_dtype
    )
    choice = None
    writer = None
    if compressed:
        try:
            choice = quant_load.quantization_choice(
                cpu_paths, torch_device, torch_dtype, quantization, model_config, quantization_group_size,
                batch_invariant=batch_invariant,
            )
        except CpuCapabilityError as exc:
            if quantization != "auto":
                raise
            logger.warning("%s: compressed weights unavailable, dequantizing to float: %s", name, exc)
    if from_file and (fallback or choice is None):
        # A float model after all: add the weights (and the config that comes with them).
        folder = gguf_cache.ensure_converted(source, cache_dir)
        model_config = read_model_config(folder)
    # The tokenizer (mostly Python, and transformers' import) loads while the
    # weight copies, which release the GIL, run.
    with ThreadPoolExecutor(1, thread_name_prefix="tokenizer") as pool:
        tokenizer_future = pool.submit(load_tokenizer, folder)
        if fallback:
            loaded = load_fallback(folder, model_config, dtype=torch_dtype, device=torch_device, cpu_paths=cpu_paths)
        elif choice is None:
            loaded = load_checkpoint(
                folder, model_config, dtype=torch_dtype, device=torch_device, cpu_paths=cpu_paths
            )
        elif source.is_file():
            assert cpu_paths is not None  # compressed weights run on CPU
            loaded, writer = _gguf_model(source, folder, model_config, choice, cpu_paths, name)
        else:
            loaded = quant_load.load_safetensors_quantized(folder, model_config, choice, cpu_paths, cache_dir)
        tokenizer_error = tokenizer_future.exception()
    if tokenizer_error is not None:
        # Drop the model before raising: the traceback keeps this frame alive.
        del loaded
        raise tokenizer_error
    tokenizer = tokenizer_future.result()
    eos = eos_token_ids(tokenizer, model_config.eos_token_ids, folder)
    loaded.batch_invariant = batch_invariant
    loaded.projection_choice = attrs.evolve(loaded.projection_choice, invariance=loaded.invariance())
    choice = loaded.projection_choice
    # A fallback is a warning: the user asked for a dtype this CPU runs slowly.
    logger.log(logging.WARNING if choice.fallback else logging.INFO, "%s: %s", name, choice)
    # Where a request's tokens may depend on what shares its steps, say so.
    logger.log(logging.INFO if choice.invariance.invariant else logging.WARNING, "%s: %s", name, choice.invariance)
    return LoadedModel(
        model=loaded,
        model_config=attrs.evolve(model_config, eos_token_ids=eos),
        tokenizer=tokenizer,
        name=name,
        path=folder,
        dtype=torch_dtype,
        device=torch_device,
        snapshot_writer=writer,
    )


def _gguf_model(
    source: Path, folder: Path, config: ModelConfig, choice: KernelChoice, cpu_paths: CpuPaths, name: str
) -> tuple[LlamaForCausalLM, model_snapshot.SnapshotWriter | None]:
    """``source``'s compressed model: mapped from the build an earlier start
    kept in its cache entry ``folder``, else built (and kept)."""

    def build() -> LlamaForCausalLM:
        return quant_load.load_gguf_quantized(source, config, choice, cpu_paths)

    key = None
    if model_snapshot.enabled():
        try:
            library = native.build_tag()
        except OSError:
            library = "absent"
        kernel = choice.kernel
        key = model_snapshot.snapshot_key(
            source,
            {
                "choice": f"{kernel.name} {kernel.isa} {choice.scheme} {choice.group_size} {choice.gemm_from_rows}",
                "cpu_paths": repr(cpu_paths),
                "native": library,
            },
        )
    return model_snapshot.load_or_build(folder, key, build, name)


@attrs.frozen
class RemoteModel:
    """What the server process knows of a model whose weights another
    process holds (``worker_mode="process"``): the CPU paths found here and
    the float projection choice made from them. A compressed model's
    kernel is chosen where it loads (by rule, ``kernels/choose.py``, from
    what that process finds), so the worker reports its own choice once
    ready (``Engine.projection_choice``). It has no weights and cannot
    run."""

    cpu_paths: CpuPaths | None
    projection_choice: ProjectionChoice
    config: ModelConfig  # as a loaded model's ``config``: what the KV cache is sized from


def describe_model(
    model: str | None = None,
    *,
    dtype: str | torch.dtype | None = None,
    device: str | None = None,
    cache_dir: Path | None = None,
) -> LoadedModel:
    """``load_model`` without the weights: the config, tokenizer, dtype and
    device of ``model``, with a ``RemoteModel`` in place of the model. For a
    server whose model step runs in a worker process that loads the
    weights itself. Raises what ``load_model`` raises, before any weight is
    read."""
    torch_device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, torch_device)
    cpu_paths = _check_cpu(torch_device, torch_dtype, None)
    source, name = resolve_source(model)
    # A GGUF's weights are the worker's to read (or convert): the config and
    # tokenizer are all this process needs of its cache entry.
    folder = gguf_cache.ensure_converted(source, cache_dir, weights=False) if source.is_file() else source
    model_config = read_model_config(folder)
    if not source.is_file():
        find_shards(folder)  # a folder without weights fails here, not in the worker
    tokenizer = load_tokenizer(folder)
    model_config = attrs.evolve(model_config, eos_token_ids=eos_token_ids(tokenizer, model_config.eos_token_ids, folder))
    remote = RemoteModel(cpu_paths, choose_projections(torch_device, torch_dtype, cpu_paths, None), model_config)
    return LoadedModel(
        model=remote,  # type: ignore[arg-type]  # no weights here: the worker has them
        model_config=model_config,
        tokenizer=tokenizer,
        name=name,
        path=folder,
        dtype=torch_dtype,
        device=torch_device,
    )


def _check_cpu(device: torch.device, dtype: torch.dtype, cpu_paths: CpuPaths | None) -> CpuPaths | None:
    """On CPU: what this CPU runs (found now unless given); raises
    ``CpuCapabilityError`` for a dtype it cannot."""
    if device.type != "cpu":
        return cpu_paths
    if cpu_paths is None:
        cpu_paths = CpuPaths.from_environment()
    for line in cpu_paths.describe():
        logger.debug("%s", line)
    cpu_paths.require_dtype(dtype)
    return cpu_paths






def load_checkpoint(
    folder: Path,
    model_config: ModelConfig,
    *,
    dtype: torch.dtype,
    device: torch.device,
    cpu_paths: CpuPaths | None = None,
) -> LlamaForCausalLM:
    """Build the model (on ``cpu_paths``, see ``LlamaForCausalLM``) and fill
    it from ``folder``'s safetensors shards.

    On failure nothing is kept: the model is dropped before ``ModelLoadError``
    is raised.
    """
    folder = Path(folder)
    shards = find_shards(folder)
    try:
        model = LlamaForCausalLM(model_config, dtype=dtype, device=device, cpu_paths=cpu_paths)
    except (RuntimeError, MemoryError) as exc:  # torch.OutOfMemoryError is a RuntimeError
        raise ModelLoadError(f"{folder}: cannot allocate the model in {dtype} on {device}: {exc}") from None
    failure = _fill(model, shards, folder / "config.json")
    if failure is None:
        return model
    # Raised here, outside any except block, so no exception context or
    # traceback still references the half-loaded model.
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    raise ModelLoadError(failure)


def _fill(model: LlamaForCausalLM, shards: list[Path], config_path: Path) -> str | None:
    """Load every shard into ``model``; return an error message or None."""
    progress = Progress(f"loading {config_path.parent.name}", sum(s.stat().st_size for s in shards), unit="B", log=logger)
    stop = threading.Event()
    try:
        with ThreadPoolExecutor(min(len(shards), _MAX_LOAD_THREADS), thread_name_prefix="shard") as pool:
            futures = [pool.submit(_load_shard, model, shard, config_path, progress, stop) for shard in shards]
            loaded: set[str] = set()
            for future in futures:
                # exception(), not result(): re-raising here would add this
                # frame (and through it the futures) to the traceback, a cycle
                # that keeps the model alive until the garbage collector runs.
                error = future.exception()
                if isinstance(error, ModelLoadError):
                    stop.set()
                    return str(error)
                loaded |= future.result()
    finally:
        progress.close()
    missing = model.required_weight_names() - loaded
    if missing:
        shown = ", ".join(sorted(missing)[:8]) + (", ..." if len(missing) > 8 else "")
        where = ", ".join(s.name for s in shards)
        return (
            f"{config_path.parent}: {len(missing)} weight(s) that {config_path.name} calls for are missing "
            f"from {where}: {shown}"
        )
    return None


def _mismatch_hint(name: str, config: ModelConfig) -> str:
    """The config.json fields that decide whether weight ``name`` fits."""
    layer = re.match(r"model\.layers\.(\d+)\.", name)
    if layer and int(layer.group(1)) >= config.num_hidden_layers:
        return f"num_hidden_layers (is {config.num_hidden_layers})"
    if name.endswith(".bias"):
        return f"attention_bias (is {config.attention_bias})"
    for part, fields in _SHAPE_FIELDS:
        if part in name:
            return ", ".join(f"{f} (is {getattr(config, f)})" for f in fields)
    return "the architecture"


def _load_shard(
    model: LlamaForCausalLM, shard: Path, config_path: Path, progress: Progress, stop: threading.Event
) -> set[str]:
    from safetensors import SafetensorError, safe_open

    loaded: set[str] = set()
    # Errors become a message raised after the except blocks: an exception
    # raised inside one would chain the library's, whose traceback holds
    # this frame and with it the model.
    error = None
    try:
        with safe_open(str(shard), framework="pt", device="cpu") as f:
            for name in f.keys():
                if stop.is_set():
                    break
                tensor = f.get_tensor(name)
                try:
                    loaded |= model.load_weights([(name, tensor)])
                except ModelLoadError as exc:
                    error = f"{exc}; {config_path} does not match: check {_mismatch_hint(name, model.config)}"
                    break
                progress.advance(tensor.nbytes)
                del tensor
    except SafetensorError as exc:
        error = f"not a valid safetensors file (truncated or corrupt?): {exc}"
    except OSError as exc:
        error = f"cannot read: {exc.strerror or exc}"
    except (RuntimeError, ValueError, TypeError) as exc:  # torch copy errors, odd dtypes
        error = f"cannot load: {type(exc).__name__}: {exc}"
    if error is not None:
        raise ModelLoadError(f"{shard}: {error}")
    progress.advance(0, note=f"{shard.name} loaded")
    return loaded
