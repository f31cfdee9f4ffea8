"""Build a model whose projections (and LM head) run on compressed weights.

Tensors come one at a time, from a GGUF file (``gguf_weights``, its own
quantized values) or from float safetensors shards (quantized here, round to
nearest). A fused checkpoint tensor (Phi-3's ``qkv_proj``, ``gate_up_proj``)
is split by rows into its parts, exactly in any format. A layer's projections
are built as soon as its seven matrices have arrived and the raw tensors are
dropped, so no float32 copy of the matrices is ever held beyond one layer's.
A mixture-of-experts layer's experts go to its ``moe_weights.ExpertCollector``,
which builds each expert's compressed linears from that expert's tensors
alone (never the layer's experts decoded whole); its router stays float32.
Norms stay float32; the token embeddings stay in the file's compressed
format where they come compressed (rows dequantized on lookup,
``embedding``), else float32.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterable
from pathlib import Path

import attrs
import numpy as np
import torch

from trioserve.engine.kernels.capability import CpuPaths
from trioserve.engine.config import ModelConfig
from trioserve.engine.errors import CpuCapabilityError, ModelLoadError
from trioserve.engine.models.llama import ExpertProjections, LlamaForCausalLM
from trioserve.engine.models.moe_weights import ExpertCollector
from trioserve.engine.models.projections import ProjectionChoice
from trioserve.engine.models.weights import fused_names
from trioserve.engine.loading import gguf_weights
from trioserve.engine.kernels import int4_native
from trioserve.engine.kernels import int4_pack
from trioserve.engine.kernels import int8_native
from trioserve.engine.kernels import native
from trioserve.engine.kernels import q6k_lanes
from trioserve.engine.kernels.q4k_blocks import Q4KBlocks, read_only
from trioserve.engine.loading import rtn_cache
from trioserve.engine.loading.sources import find_shards
from trioserve.engine.kernels.choose import KERNELS, Kernel, KernelChoice, Linear, candidates, choose_kernel
from trioserve.engine.kernels.embedding import CompressedEmbedding
from trioserve.engine.kernels.projections import QuantizedProjections
from trioserve.engine.kernels.rtn import Int4Weight, Int8GroupWeight, Int8Weight, check_group_size, quantize_int8_groups

logger = logging.getLogger(__name__)

Tensor = torch.Tensor | Int4Weight | Int8Weight | Int8GroupWeight
_PROJ = re.compile(r"model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)_proj\.(weight|bias)")
_PARTS = ("q", "k", "v", "o", "gate", "up", "down")
_LAYER = re.compile(r"model\.layers\.(\d+)\.")


def layer_shapes(config: ModelConfig) -> list[tuple[int, int]]:
    """The fused projections of a layer, ``(out, in)``: qkv and o, then a
    dense MLP's gate_up and down where a layer has one, an expert's where
    a layer has experts."""
    return [shape for _, shape in _named_shapes(config)]


def _named_shapes(config: ModelConfig) -> list[tuple[str, tuple[int, int]]]:
    hd, hidden, inter = config.head_dim, config.hidden_size, config.intermediate_size
    qkv = (config.num_attention_heads + 2 * config.num_key_value_heads) * hd
    shapes = [("qkv", (qkv, hidden)), ("o", (hidden, config.num_attention_heads * hd))]
    if len(config.moe_layers) < config.num_hidden_layers:
        shapes += [("gate_up", (2 * inter, hidden)), ("down", (hidden, inter))]
    if config.moe_layers:
        expert = config.moe_intermediate_size
        shapes += [("expert gate_up", (2 * expert, hidden)), ("expert down", (hidden, expert))]
    return shapes


def _shape(tensor: Tensor) -> tuple[int, ...]:
    """A weight's ``(out, in)`` in any format, without decoding a
    ``Q6KGroups`` or a ``Q4KBlocks`` (whose values a lanes projection never needs)."""
    if isinstance(tensor, torch.Tensor | q6k_lanes.Q6KGroups | Q4KBlocks):
        return tuple(tensor.shape)
    return tuple(tensor.q.shape)


def _rows(tensor: Tensor, rows: slice) -> Tensor:
    """Rows ``rows`` of a weight in any format: exact, each row's values and
    scales its own."""
    if isinstance(tensor, torch.Tensor):
        return tensor[rows]
    if isinstance(tensor, Int4Weight):
        return Int4Weight(tensor.q[rows], tensor.scale[rows], tensor.zero[rows], tensor.group_size)
    if isinstance(tensor, Int8Weight):
        return Int8Weight(tensor.q[rows], tensor.scale[rows])
    return Int8GroupWeight(tensor.q[rows], tensor.scale[rows], tensor.group_size)


def _unfused(name: str, tensor: Tensor, config: ModelConfig, source: Path) -> list[tuple[str, Tensor]]:
    """A fused checkpoint tensor (Phi-3's ``qkv_proj``, ``gate_up_proj``) as
    its parts by row, under the separate names; any other as it is."""
    parts = fused_names(name, config)
    if not parts:
        return [(name, tensor)]
    shape = _shape(tensor)
    rows = sum(s.stop - s.start for _, s in parts)
    if len(shape) != 2 or shape[0] != rows:
        raise ModelLoadError(f"{source}: weight {name!r}: expected {rows} rows, got shape {shape}")
    return [(n, _rows(tensor, s)) for n, s in parts]


def _expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Each projection's ``(out, in)`` and bias ``(out,)``, by part."""
    hd, hidden, inter = config.head_dim, config.hidden_size, config.intermediate_size
    q, kv = config.num_attention_heads * hd, config.num_key_value_heads * hd
    outs = {"q": (q, hidden), "k": (kv, hidden), "v": (kv, hidden), "o": (hidden, q),
            "gate": (inter, hidden), "up": (inter, hidden), "down": (hidden, inter)}  # fmt: skip
    return {**{f"{p}.weight": shape for p, shape in outs.items()}, **{f"{p}.bias": shape[:1] for p, shape in outs.items()}}


def _cat(parts: list[Tensor]) -> Tensor:
    """Stack weights by rows: exact when all share one format (the kernels
    convert it if it is not theirs), else float32."""
    if all(isinstance(p, Int4Weight) and p.group_size == parts[0].group_size for p in parts):
        if len(parts) == 1:
            return parts[0]

        def stacked(name: str) -> torch.Tensor:  # numpy's copy, on this thread (_dense_rows says why)
            return torch.from_numpy(np.concatenate([getattr(p, name).numpy() for p in parts]))

        return Int4Weight(stacked("q"), stacked("scale"), stacked("zero"), parts[0].group_size)
    if all(isinstance(p, Int8Weight) for p in parts):
        return Int8Weight(torch.cat([p.q for p in parts]), torch.cat([p.scale for p in parts]))
    return torch.cat([p if isinstance(p, torch.Tensor) else p.dequantize() for p in parts]).float()


def _stacked(choice: KernelChoice, parts: list[Tensor], bias: torch.Tensor | None) -> Linear:
    """``choice.make(_cat(parts), bias)``; on the native 4-bit kernel each
    part packed into its own rows of the kernel's blocks instead, the same
    bytes without the stacked copy (a fused qkv's or gate_up's values)."""
    kernel = choice.kernel
    same = all(isinstance(p, Int4Weight) and p.group_size == getattr(parts[0], "group_size", 0) for p in parts)
    if len(parts) == 1 or kernel.family != "native4" or not same:
        return choice.make(_cat(parts), bias)
    linear = int4_native.Int4NativeLinear.from_parts(parts, bias, kernel.isa)  # type: ignore[arg-type]
    return linear if choice.gemm_from_rows is None else attrs.evolve(linear, gemm_from_rows=choice.gemm_from_rows)


def _bias(parts: dict[str, Tensor], names: tuple[str, ...], rows: list[int]) -> torch.Tensor | None:
    if not any(f"{n}.bias" in parts for n in names):
        return None
    return torch.cat(
        [parts.get(f"{n}.bias", torch.zeros(r)).float() for n, r in zip(names, rows)]  # type: ignore[union-attr]
    )


@attrs.frozen
class _Wide:
    """How a projection any of whose matrices a file stores at more than 4
    bits is built (a GGUF's Q8_0, Q6_K or Q5 tensors, as K-quant mixes such
    as Q4_K_M keep their most sensitive matrices) when the model's kernel is
    4-bit: int8 rather than rounded to 4 bits."""

    build: Callable[[list[Tensor], torch.Tensor | None], Linear]
    what: str

    @classmethod
    def beside(cls, cpu_paths: CpuPaths, choice: KernelChoice) -> _Wide | None:
        """For "auto" on a 4-bit kernel (``int4`` asks for 4 bits throughout):
        int8 in groups of 32 on the native kernel of the same variant (a
        Q8_0 or Q5_0 matrix exactly; the fused decode step takes the layer;
        a prompt's rows on the bfloat16 GEMM from where the 4-bit kernel's
        do; held as Q8_0 lanes blocks where ``in_lanes`` says: on
        avx512vnni; there and on avx2int8, ``q6k_lanes.ISAS``, a projection
        whose every matrix the file stores as Q6_K is held as Q6_K lanes
        blocks instead, at the file's width: ``_q6k_lanes``), else int8 per
        channel on the int8 kernel here."""
        if choice.scheme != "auto" or choice.kernel.bits != 4:
            return None
        kernel = _eight_bit_kernel(cpu_paths, choice.kernel)
        isa = choice.kernel.isa
        if isa and kernel.isa == isa:
            rows = choice.gemm_from_rows

            def native_groups(parts: list[Tensor], bias: torch.Tensor | None) -> Linear:
                held = _q6k_lanes(parts) if isa in q6k_lanes.ISAS else None
                if held is not None:
                    return int8_native.Int8GroupNativeLinear.q6k(held, isa, bias, rows)
                return int8_native.Int8GroupNativeLinear.over(_int8_groups(parts), isa, bias, rows).in_lanes(head=False)

            q6k = "; those all Q6_K as Q6_K lanes blocks, the file's values" if isa in q6k_lanes.ISAS else ""
            return cls(native_groups, f"int8 in groups of 32, native kernel ({isa}){q6k}")
        return cls(lambda parts, bias: kernel.make(_cat(parts), bias, choice.group_size), kernel.what)


def _q6k_lanes(parts: list[Tensor]) -> q6k_lanes.Q6KLanes | None:
    """Matrices stacked by rows as Q6_K lanes blocks where every one is the
    file's Q6_K (a fused qkv mixing Q4_K q and k with a Q6_K v is not) and
    they make whole panels; else None. Their values as the file has them,
    not rounded once more into Q8_0 groups."""
    if not all(isinstance(p, q6k_lanes.Q6KGroups) for p in parts):
        return None
    out, k = sum(_shape(p)[0] for p in parts), _shape(parts[0])[1]
    if not q6k_lanes.fits(out, k):
        return None
    blocks = parts[0].blocks if len(parts) == 1 else np.concatenate([p.blocks for p in parts])  # type: ignore[union-attr]
    return q6k_lanes.Q6KLanes.of(blocks, native.ops())


# Values requantized at once by _int8_groups and _in_native_groups: a
# chunk's float32 temporaries (a few times 4 bytes a value) stay in a
# core's cache.
_REGROUP_VALUES = 1 << 16


def _dense_rows(weight: Tensor, rows: slice) -> np.ndarray:
    """Rows ``rows`` of ``weight`` as float32, by the arithmetic of its
    ``dequantize`` (``kernels/rtn.py``), in numpy on the calling thread:
    torch's parallel regions, one a chunk, wait on each other's threads,
    and on a busy machine every wait is a scheduler's time slice."""
    if isinstance(weight, torch.Tensor):
        return weight[rows].float().numpy()
    q = weight.q[rows].numpy().astype(np.float32)
    out, k = q.shape
    scale = weight.scale[rows].numpy()[..., None]
    if isinstance(weight, Int4Weight):
        groups = (q - 8).reshape(out, -1, weight.group_size) * scale + weight.zero[rows].numpy()[..., None]
    else:
        with np.errstate(over="ignore"):  # float16 steps near their top overflow as torch's dequantize does
            groups = q.reshape(out, -1, weight.group_size) * scale
    return groups.reshape(out, k)


def _round_into(dense: np.ndarray, q: np.ndarray, scale: np.ndarray) -> None:
    """``rtn.quantize_int8_groups`` of ``dense`` in groups of 32, by its
    float32 arithmetic, into ``q`` and ``scale``: csrc/gguf_repack.cpp's
    ``q8g_round_into`` where the library is built and every value is
    finite, else ``_round_numpy``; the same bits."""
    ops = gguf_weights.repack_ops() if q.flags.c_contiguous and scale.flags.c_contiguous else None
    done = ops is not None and ops.q8g_round_into(  # type: ignore[attr-defined]
        torch.from_numpy(np.ascontiguousarray(dense)), torch.from_numpy(q), torch.from_numpy(scale)
    )
    if not done:
        _round_numpy(dense, q, scale)


def _round_numpy(dense: np.ndarray, q: np.ndarray, scale: np.ndarray) -> None:
    """``_round_into`` in numpy (as ``_dense_rows``), infinite values and NaN too."""
    groups = dense.reshape(dense.shape[0], -1, int8_native.GROUP)
    # Each group's largest magnitude, over a transposed copy: numpy's
    # reduction along a short last axis took twice as long as this, copy
    # included. The same maximum (magnitudes compare in any order alike).
    magnitudes = np.ascontiguousarray(np.abs(groups).reshape(-1, int8_native.GROUP).T)
    scale[...] = magnitudes.max(axis=0).reshape(scale.shape) / np.float32(127)
    divisor = np.where(scale > 0, scale, np.float32(1))
    # An infinite group (overflowed above) rounds to NaN and casts as torch's
    # quantize_int8_groups casts it: the same bits, without numpy's warnings.
    with np.errstate(invalid="ignore"):
        rounded = np.rint(groups / divisor[..., None])
        np.clip(rounded, -127, 127, out=rounded)
        q[...] = rounded.reshape(q.shape)


def _int8_groups(parts: list[Tensor]) -> Int8GroupWeight:
    """Matrices stacked by rows as int8 in groups of 32: one stored in such
    groups taken as it is, any other rounded into them from its values (a
    group's largest magnitude to 127: ``rtn.quantize_int8_groups``). Each
    row is rounded on its own, so the rows go a chunk at a time, written
    into the result as they come."""
    rows = [_shape(p)[0] for p in parts]
    k = _shape(parts[0])[1]
    check_group_size((sum(rows), k), int8_native.GROUP)
    q = np.empty((sum(rows), k), dtype=np.int8)
    scale = np.empty((sum(rows), k // int8_native.GROUP), dtype=np.float32)
    at, step = 0, max(1, _REGROUP_VALUES // k)
    ops = gguf_weights.repack_ops()
    for part, n in zip(parts, rows):
        if isinstance(part, Int8GroupWeight) and part.group_size == int8_native.GROUP:
            q[at : at + n], scale[at : at + n] = part.q.numpy(), part.scale.numpy()
        elif isinstance(part, q6k_lanes.Q6KGroups) and ops is not None and not part.decoded:
            # Straight from the file's blocks, never decoded into groups of 16
            # first (a Q4_K_M file's tied token table: 1.5 CPU seconds of a
            # 1B model's start in numpy); the bits of the rounding below.
            into = (torch.from_numpy(q[at : at + n]), torch.from_numpy(scale[at : at + n]))
            ops.q6k_to_q8g_into(read_only(part.blocks), *into)  # type: ignore[attr-defined]
        else:
            for start in range(0, n, step):
                end = min(n, start + step)
                _round_into(_dense_rows(part, slice(start, end)), q[at + start : at + end], scale[at + start : at + end])
        at += n
    return Int8GroupWeight(torch.from_numpy(q), torch.from_numpy(scale), int8_native.GROUP)


def _build_layer(
    parts: dict[str, Tensor], choice: KernelChoice, index: int, wide: _Wide | None, *, mlp: bool = True
) -> tuple[QuantizedProjections, int]:
    """One layer's projections, and how many of them were built ``wide``;
    without ``mlp`` (a mixture-of-experts layer) attention's only."""
    widened = 0

    def make(names: tuple[str, ...]) -> object:
        nonlocal widened
        weights = [parts[f"{n}.weight"] for n in names]
        rows = [_shape(w)[0] for w in weights]
        if wide is not None and any(isinstance(w, Int8GroupWeight | Int8Weight) for w in weights):
            widened += 1
            return wide.build(weights, _bias(parts, names, rows))
        for n, w in zip(names, weights):
            shape = _shape(w)
            if choice.kernel.bits == 4:
                check_group_size(shape, choice.group_size, f"model.layers.{index}.{n}_proj.weight")
        return _stacked(choice, weights, _bias(parts, names, rows))

    gate_up, down = (make(("gate", "up")), make(("down",))) if mlp else (None, None)
    made = QuantizedProjections(make(("q", "k", "v")), make(("o",)), gate_up, down)  # type: ignore[arg-type]
    return made, widened


def quantization_choice(
    cpu_paths: CpuPaths | None,
    device: torch.device,
    dtype: torch.dtype,
    scheme: str,
    config: ModelConfig,
    group_size: int,
    *,
    batch_invariant: bool = True,
) -> KernelChoice:
    """The kernel for ``scheme`` on this machine (``choose.choose_kernel``);
    ``CpuCapabilityError`` where none runs."""
    if device.type != "cpu" or cpu_paths is None:
        raise CpuCapabilityError(f"quantization {scheme} runs on CPU only, not on {device}; use --quantization none")
    if dtype != torch.float32:
        raise CpuCapabilityError(
            f"quantization {scheme} runs with float32 activations, not {dtype}; use --dtype float32 or --quantization none"
        )
    if scheme == "int4":
        int4_pack.Int4PackLinear.check_group_size(group_size)
        for what, shape in _named_shapes(config):
            check_group_size(shape, group_size, f"{what} projection")
    return choose_kernel(cpu_paths, scheme, layer_shapes(config), group_size, batch_invariant=batch_invariant)


def build_quantized(
    tensors: Iterable[tuple[str, Tensor]],
    config: ModelConfig,
    choice: KernelChoice,
    *,
    source: Path,
    cpu_paths: CpuPaths,
) -> LlamaForCausalLM:
    """The model over ``tensors`` (Hugging Face names) with projections on ``choice``'s kernel."""
    projection = ProjectionChoice(
        device="cpu", dtype="float32", packed=False, reason=choice.reason, quantization=choice.label
    )
    model = LlamaForCausalLM(config, dtype=torch.float32, device="cpu", cpu_paths=cpu_paths, quantization=projection)
    pending: dict[int, dict[str, Tensor]] = {}
    layers: dict[int, QuantizedProjections] = {}
    wide = _Wide.beside(cpu_paths, choice)
    widened = 0
    moe = set(config.moe_layers)
    # gemm_from_rows is set only outside batch-invariant mode (choose_kernel).
    collectors = {
        i: ExpertCollector(
            model.layers[i].mlp, f"model.layers.{i}.", choice, batch_invariant=choice.gemm_from_rows is None
        )
        for i in sorted(moe)
    }
    head: Tensor | None = None
    embedding: CompressedEmbedding | None = None
    loaded: set[str] = set()
    shapes = _expected_shapes(config)
    for name, tensor in ((n, t) for fused, whole in tensors for n, t in _unfused(fused, whole, config, source)):
        expert_layer = _expert_layer(name, collectors)
        if expert_layer is not None:
            try:
                collectors[expert_layer].add(name, tensor)
            except ModelLoadError as exc:
                raise ModelLoadError(f"{source}: {exc}") from None
            continue
        match = _PROJ.fullmatch(name)
        if match is not None:
            index = int(match.group(1))
            if index >= config.num_hidden_layers:
                raise ModelLoadError(f"{source}: weight {name!r}: the config has {config.num_hidden_layers} layers")
            part = f"{match.group(3)}.{match.group(4)}"
            shape = _shape(tensor)
            if part not in shapes or (index in moe and match.group(2) == "mlp"):
                raise ModelLoadError(f"{source}: unknown weight {name!r} for {config.architecture}")
            if shape != shapes[part]:
                raise ModelLoadError(f"{source}: weight {name!r}: expected shape {shapes[part]}, got {shape}")
            parts = pending.setdefault(index, {})
            parts[part] = tensor
            needed = _PARTS[:4] if index in moe else _PARTS
            if all(f"{p}.weight" in parts for p in needed):
                layers[index], n = _build_layer(pending.pop(index), choice, index, wide, mlp=index not in moe)
                widened += n
            continue
        if name == "lm_head.weight" and not config.tie_word_embeddings:
            head = tensor  # kept compressed (below): the model has no float parameter for it
            continue
        if name == "model.embed_tokens.weight" and isinstance(tensor, (Int4Weight, Int8GroupWeight)):
            # Kept compressed (as the file has it, or Q6_K's groups of 16 in
            # groups of 32): a float32 copy would be the largest tensor of a
            # small model (113 MB for SmolLM2's 49,152 x 576). A tied Q6_K
            # table waits for the head (below), which may hold it at its width.
            tensor = _owned(tensor)
            if not (config.tie_word_embeddings and isinstance(tensor, q6k_lanes.Q6KGroups)):
                tensor = _in_native_groups(tensor)
            embedding = CompressedEmbedding(tensor)
            if config.tie_word_embeddings:
                head = tensor
            loaded.add(name)
            continue
        if not isinstance(tensor, torch.Tensor):
            tensor = tensor.dequantize()  # embeddings and norms are used as float32
        if name == "model.embed_tokens.weight" and config.tie_word_embeddings:
            head = tensor  # the LM head is compressed too (below); the embeddings stay float32
        loaded |= model.load_weights([(name, tensor)])
    missing = sorted(set(range(config.num_hidden_layers)) - set(layers))
    lacking = [
        f"model.layers.{i}.{'self_attn' if p in ('q', 'k', 'v', 'o') else 'mlp'}.{p}_proj.weight"
        for i in missing for p in (_PARTS[:4] if i in moe else _PARTS) if f"{p}.weight" not in pending.get(i, {})
    ]  # fmt: skip
    lacking += [n for i in sorted(moe) for n in collectors[i].missing()]
    if lacking or head is None:
        what = f"missing weights {lacking[:8]}" if lacking else "no lm_head.weight"
        raise ModelLoadError(f"{source}: incomplete checkpoint: {what}")
    for i in sorted(moe):
        block = model.layers[i].mlp
        assert block is not None
        block.set_compressed(collectors[i].build())
        layers[i] = ExpertProjections(layers[i], block.experts(pack=False))  # type: ignore[assignment]
    got = None if embedding is None else (embedding.num_embeddings, embedding.embedding_dim)
    if got is not None and got != (config.vocab_size, config.hidden_size):
        raise ModelLoadError(
            f"{source}: weight 'model.embed_tokens.weight': expected shape "
            f"{(config.vocab_size, config.hidden_size)}, got {got}"
        )
    if model.required_weight_names() - loaded:
        raise ModelLoadError(f"{source}: missing weights {sorted(model.required_weight_names() - loaded)[:8]}")
    assert head is not None
    shared = embedding is not None and embedding.weight is head
    head_linear = _q6k_head(cpu_paths, head, choice.kernel)
    if head_linear is None:
        head = _in_native_groups(head)
        head_linear = _shared_head(cpu_paths, head, choice.kernel) or _eight_bit_kernel(cpu_paths, choice.kernel).make(
            head, None, choice.group_size
        )
        if isinstance(head_linear, int8_native.Int8GroupNativeLinear):
            head_linear = head_linear.in_lanes()
    if shared:
        # One table: the embeddings look their rows up in the head's lanes
        # blocks, and the groups they replace are freed.
        weight = head_linear.weight if isinstance(head_linear, int8_native.Int8GroupNativeLinear) else head
        embedding = CompressedEmbedding(weight)
    model.set_quantized([layers[i] for i in range(config.num_hidden_layers)], head_linear, embedding)
    if widened:
        # What the model holds, for the load log and /version: "int8" where
        # every projection was stored wider (a Q6_K or Q8_0 file).
        assert wide is not None
        every = 4 * config.num_hidden_layers - 2 * len(moe)  # the experts are not counted
        model.projection_choice = attrs.evolve(
            projection,
            quantization="int8" if widened == every else f"{choice.label}+int8",
            reason=f"{projection.reason}; {widened} of {every} projections stored wider than 4 bits: {wide.what}",
        )
    return model


def _expert_layer(name: str, collectors: dict[int, ExpertCollector]) -> int | None:
    """The mixture-of-experts layer whose expert ``name`` is, if any."""
    match = _LAYER.match(name)
    if match is None:
        return None
    index = int(match.group(1))
    collector = collectors.get(index)
    return index if collector is not None and collector.accepts(name) else None


def _owned(tensor: Tensor) -> Tensor:
    """A table kept past the load as values of its own: a ``Q4KBlocks``
    decoded (its ``blocks`` view the mapped file, and while any view lives
    the map does, each page the load read counted in the server's RSS: 4.3
    GB of a 4.2 GB MoE file); anything else as it is."""
    if isinstance(tensor, Q4KBlocks):
        return Int4Weight(tensor.q, tensor.scale, tensor.zero, tensor.group_size)
    return tensor


def _in_native_groups(tensor: Tensor) -> Tensor:
    """An int8 table in groups of other than 32 (Q6_K's 16) rounded into
    groups of 32, which the native Q8_0 kernel runs (one more rounding: a
    group's largest value to 127); anything else as it is."""
    if isinstance(tensor, Int8GroupWeight) and tensor.group_size != int8_native.GROUP:
        return _int8_groups([tensor])  # as regroup_int8 rounds them, a chunk of rows at a time
    return tensor


def _native_isa(cpu_paths: CpuPaths, kernel: Kernel) -> str | None:
    """The native int8 kernel's variant an LM head runs on: ``kernel``'s
    where it is native, else the best here; None without the native kernels."""
    order = ((kernel.isa,) if kernel.isa else ()) + native.LINEAR_ISA_ORDER
    return next((i for i in order if cpu_paths.works(f"quant_int8_native_{i}")), None)


def _q6k_head(cpu_paths: CpuPaths, head: Tensor, kernel: Kernel) -> Linear | None:
    """A head the file stores as Q6_K (a K-quant mix's LM head, or its tied
    token table) held at the file's width as Q6_K lanes blocks, where it
    runs on avx512vnni or avx2int8 (``q6k_lanes.ISAS``: csrc/q6k_lanes_vnni.h,
    csrc/q6k_lanes_avx2.h; int8 activations at any row count, a row's bits
    the same at every count and on both variants): 6.5625 bits a weight,
    not Q8_0 lanes' 9 after one more rounding (a 1B-shaped model's decode
    step reads 31 of its 697 MB less). None elsewhere: the head goes into
    Q8_0 groups (``_shared_head``)."""
    if not isinstance(head, q6k_lanes.Q6KGroups) or not q6k_lanes.fits(*head.shape):
        return None
    isa = _native_isa(cpu_paths, kernel)
    if isa not in q6k_lanes.ISAS:
        return None
    return int8_native.Int8GroupNativeLinear.q6k(q6k_lanes.Q6KLanes.of(head.blocks, native.ops()), isa)


def _shared_head(cpu_paths: CpuPaths, head: Tensor, kernel: Kernel) -> Linear | None:
    """The LM head in int8 groups of 32 (GGUF's Q8_0) on the native kernel
    (``kernel``'s variant where it is native, else the best here). A head
    stored so runs over the stored values themselves: nothing requantized,
    and a tied head shares the embeddings' table. A float head (tied to
    float embeddings) is rounded into such groups here, as rtn_cache keeps
    an untied one: a step a group is finer than one a channel, and on
    avx512vnni and avx2int8 a decode step's logits then have the same bits
    at any batch size (an int8-per-channel head runs float32 activations,
    in bfloat16 or float32 panels from 10 rows). None where that does not
    run here, or for a head in another format (a 4-bit one)."""
    isa = _native_isa(cpu_paths, kernel)
    if isa is None:
        return None
    if isinstance(head, torch.Tensor) and head.shape[-1] % int8_native.GROUP == 0:
        head = quantize_int8_groups(head, int8_native.GROUP, "lm_head.weight")
    if not isinstance(head, Int8GroupWeight) or head.group_size != int8_native.GROUP:
        return None
    return int8_native.Int8GroupNativeLinear.over(head, isa)


def _eight_bit_kernel(cpu_paths: CpuPaths, kernel: Kernel) -> Kernel:
    """The int8-per-channel kernel beside ``kernel``, for an LM head that
    _shared_head does not run (a fifth of the weights a decode step streams;
    a 4-bit head moves logits more; without the native kernels a head in
    groups is rounded per channel once more) and, without the native
    kernels, the projections a file stores wider than 4 bits: ``kernel``
    itself when it is 8-bit, else the native int8 kernel of its variant,
    else the best int8 kernel here."""
    if kernel.bits == 8:
        return kernel
    sibling = f"quant_int8_native_{kernel.isa}"
    if kernel.isa and cpu_paths.works(sibling):
        return next(k for k in KERNELS if k.name == sibling)
    return candidates(cpu_paths, "int8")[0]


def load_gguf_quantized(
    gguf_path: Path, config: ModelConfig, choice: KernelChoice, cpu_paths: CpuPaths
) -> LlamaForCausalLM:
    """The model of ``gguf_path`` with its weights kept compressed."""
    tensors = gguf_weights.read_tensors(
        gguf_path, num_heads=config.num_attention_heads, num_kv_heads=config.num_key_value_heads
    )
    model = build_quantized(tensors, config, choice, source=gguf_path, cpu_paths=cpu_paths)
    logger.debug("%s: compressed projections, %s", gguf_path.name, choice.reason)
    return model


QUANTIZATIONS = ("auto", "none", "int8", "int4")


def wanted(quantization: str, *, is_gguf: bool, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether to load compressed: ``"auto"`` does for a GGUF on a CPU in
    float32 (elsewhere it falls back to float), ``"int8"``/``"int4"`` always
    (``quantization_choice`` then refuses what this machine cannot run)."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization {quantization!r} is not one of {', '.join(QUANTIZATIONS)}")
    if quantization == "auto":
        return is_gguf and device.type == "cpu" and dtype == torch.float32
    return quantization != "none"


def load_safetensors_quantized(
    folder: Path, config: ModelConfig, choice: KernelChoice, cpu_paths: CpuPaths, cache_dir: Path | None
) -> LlamaForCausalLM:
    """The float checkpoint in ``folder``, quantized round-to-nearest in
    ``choice.scheme`` (once: the result is cached, ``rtn_cache``)."""
    scheme = f"int{choice.kernel.bits}"
    shards = find_shards(folder)
    cached = rtn_cache.cache_dir_for(folder, shards, scheme, choice.group_size, cache_dir)
    if not cached.is_dir():
        logger.info("%s: quantizing to %s once into %s", folder.name, scheme, cached)
        rtn_cache.write(cached, _safetensors_tensors(shards), scheme, choice.group_size)
    return build_quantized(rtn_cache.read(cached), config, choice, source=folder, cpu_paths=cpu_paths)


def _safetensors_tensors(shards: list[Path]) -> Iterable[tuple[str, torch.Tensor]]:
    from safetensors import SafetensorError, safe_open

    for shard in shards:
        try:
            with safe_open(str(shard), framework="pt", device="cpu") as f:
                for name in f.keys():
                    tensor = f.get_tensor(name)
                    # gpt-oss's MXFP4 experts (uint8 _blocks and _scales) pass as they are.
                    yield name, tensor.float() if tensor.is_floating_point() else tensor
        except (SafetensorError, OSError) as exc:
            raise ModelLoadError(f"{shard}: cannot read: {exc}") from None
