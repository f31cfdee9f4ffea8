"""A mixture-of-experts block's config fields and checkpoint names.

``moe_fields`` reads what each family's config.json says about its experts.
``weight_targets`` maps a layer's checkpoint names onto a ``SparseMoeBlock``'s
float parameters, as ``models.weights.weight_targets`` does for the dense
layers (``copy_weights`` copies them): the Hub's names, which transformers
5.25's ``save_pretrained`` writes back for these classes (per expert for
Qwen3-MoE and Mixtral, ``block_sparse_moe.`` for Mixtral; fused
``[experts, in, out]`` tensors for gpt-oss). ``ExpertCollector`` takes a
layer's expert tensors as they stream in, float or compressed (GGUF's
formats, gpt-oss's MXFP4 ``_blocks``/``_scales``), and builds each expert's
compressed linears from that expert's tensors alone. A gpt-oss GGUF holds
its experts one matrix and bias each, as the other families' (``gguf_weights``
names them ``experts.E.gate_proj.weight`` ... ``down_proj.bias``); the
collector takes those too and interleaves gate's and up's rows itself.
"""

from __future__ import annotations

import re
from typing import Any

import attrs
import numpy as np
import torch

from trioserve.engine.errors import ModelLoadError
from trioserve.engine.model_config import MOE_MODEL_TYPES, moe_fields  # noqa: F401  # moe_fields: where the config reads them
from trioserve.engine.kernels import int8_native, mxfp4, native, q6k_lanes
from trioserve.engine.kernels.choose import ROW_INVARIANT_ISAS, KernelChoice, Linear
from trioserve.engine.kernels.int4_native import Int4NativeLinear
from trioserve.engine.kernels.rtn import Int4Weight, Int8GroupWeight, Int8Weight, regroup_int8
from trioserve.engine.models.moe import ExpertLinears, SparseMoeBlock
from trioserve.engine.models.weights import Target

Weight = torch.Tensor | Int4Weight | Int8Weight | Int8GroupWeight

# config.json's model_type -> the routing (moe.ROUTINGS) of that family.


def block_prefix(block: SparseMoeBlock, layer_prefix: str) -> str:
    """Where a layer's block lives in the checkpoint: ``{layer_prefix}mlp.``,
    Mixtral's ``{layer_prefix}block_sparse_moe.``."""
    return f"{layer_prefix}{'block_sparse_moe' if block.routing == 'mixtral' else 'mlp'}."


def _router_name(block: SparseMoeBlock) -> str:
    return "router" if block.routing == "gpt_oss" else "gate"


# Per expert, Hub names: (gate, up, down).
_PER_EXPERT = {"qwen3_moe": ("gate_proj", "up_proj", "down_proj"), "mixtral": ("w1", "w3", "w2")}


def weight_targets(block: SparseMoeBlock, layer_prefix: str) -> dict[str, Target]:
    """Each checkpoint name of ``block`` under ``layer_prefix`` (e.g.
    ``model.layers.3.``) -> the parameter view and rows it fills, for
    ``models.weights.copy_weights``; the experts' names only where the
    experts are float. The targets are views of the parameters as they are
    now: build them again after moving the block to another device or dtype."""
    p = block_prefix(block, layer_prefix)
    r = _router_name(block)
    targets: dict[str, Target] = {f"{p}{r}.weight": (block.router, None, None, 0.0)}
    if block.router_bias is not None:
        targets[f"{p}{r}.bias"] = (block.router_bias, None, None, 0.0)
    if not block.float_experts:
        return targets
    assert block.gate_up is not None and block.down is not None
    inter = block.intermediate_size
    if block.routing == "gpt_oss":
        # [experts, in, out] in the checkpoint: the transposed views of ours.
        targets[f"{p}experts.gate_up_proj"] = (block.gate_up.transpose(1, 2), None, None, 0.0)
        targets[f"{p}experts.down_proj"] = (block.down.transpose(1, 2), None, None, 0.0)
        assert block.gate_up_bias is not None and block.down_bias is not None
        targets[f"{p}experts.gate_up_proj_bias"] = (block.gate_up_bias, None, None, 0.0)
        targets[f"{p}experts.down_proj_bias"] = (block.down_bias, None, None, 0.0)
        return targets
    gate, up, down = _PER_EXPERT[block.routing]
    for e in range(block.num_experts):
        targets[f"{p}experts.{e}.{gate}.weight"] = (block.gate_up[e], 0, inter, 0.0)
        targets[f"{p}experts.{e}.{up}.weight"] = (block.gate_up[e], inter, 2 * inter, 0.0)
        targets[f"{p}experts.{e}.{down}.weight"] = (block.down[e], None, None, 0.0)
    return targets


def required_weight_names(block: SparseMoeBlock, layer_prefix: str) -> set[str]:
    """The names a complete float block needs (``weight_targets``' keys);
    for compressed experts add ``ExpertCollector.missing``."""
    return set(weight_targets(block, layer_prefix))


def _shape(w: Weight) -> tuple[int, ...]:
    return tuple(w.shape) if isinstance(w, torch.Tensor) else tuple(w.q.shape)


def stack_rows(parts: list[Weight]) -> Weight:
    """Matrices stacked by rows: exact when all share one compressed format,
    else float32 (one expert's gate and up: never more than an expert)."""
    first = parts[0]
    if all(isinstance(w, q6k_lanes.Q6KGroups) for w in parts):  # still the file's rows: kept so, undecoded
        return first.rows_of(np.concatenate([w.blocks for w in parts]))  # type: ignore[union-attr]
    if all(isinstance(w, Int4Weight) and w.group_size == first.group_size for w in parts):
        return Int4Weight(
            torch.cat([w.q for w in parts]), torch.cat([w.scale for w in parts]),  # type: ignore[union-attr]
            torch.cat([w.zero for w in parts]), first.group_size,  # type: ignore[union-attr]
        )
    if all(isinstance(w, Int8GroupWeight) and w.group_size == first.group_size for w in parts):
        return Int8GroupWeight(
            torch.cat([w.q for w in parts]), torch.cat([w.scale for w in parts]), first.group_size  # type: ignore[union-attr]
        )
    if all(isinstance(w, Int8Weight) for w in parts):
        return Int8Weight(torch.cat([w.q for w in parts]), torch.cat([w.scale for w in parts]))  # type: ignore[union-attr]
    return torch.cat([w.float() if isinstance(w, torch.Tensor) else w.dequantize() for w in parts])


def expert_linear(choice: KernelChoice, weight: Weight, bias: torch.Tensor | None, *, batch_invariant: bool) -> Linear:
    """One expert matrix on ``choice``'s kernel. Int8 groups (GGUF's Q8_0,
    Q6_K, Q5_0; MXFP4) run as they are on the native group kernel of the
    choice's variant (Q6_K's groups of 16 rounded into groups of 32), held
    as Q8_0 lanes blocks where ``in_lanes`` says (avx512vnni: the layout its
    kernels stream fastest, as the dense layers' wider projections); on
    avx512vnni and avx2int8 (``q6k_lanes.ISAS``) a file's Q6_K matrix is
    held at its width instead, as Q6_K lanes blocks (a Q4_K_M mixture's
    wider expert downs: 6.5625 bits a weight, not 9, of the bytes a routed
    token reads), as the dense layers' Q6_K projections are; any other
    weight as ``choice.make`` holds it. With ``batch_invariant``, a
    native linear of ``choose.ROW_INVARIANT_ISAS`` runs its int8 kernels at
    every row count, so an expert's row gets the same bits however many
    tokens the step routes to that expert."""
    isa = choice.kernel.isa
    if isa in q6k_lanes.ISAS and isinstance(weight, q6k_lanes.Q6KGroups) and q6k_lanes.fits(*weight.shape):
        held = q6k_lanes.Q6KLanes.of(weight.blocks, native.ops())
        linear: Linear = int8_native.Int8GroupNativeLinear.q6k(held, isa, bias, choice.gemm_from_rows)
    elif isinstance(weight, Int8GroupWeight) and isa:
        if weight.group_size != int8_native.GROUP:
            weight = regroup_int8(weight, int8_native.GROUP)
        linear = int8_native.Int8GroupNativeLinear.over(weight, isa, bias, choice.gemm_from_rows)
        linear = linear.in_lanes(head=False)
    else:
        linear = choice.make(weight, bias)
    if batch_invariant and isa in ROW_INVARIANT_ISAS and isinstance(linear, Int4NativeLinear | int8_native.Int8GroupNativeLinear):
        linear = attrs.evolve(linear, int8_panels=True, gemm_from_rows=None)
    return linear


_PER_EXPERT_NAME = re.compile(r"experts\.(\d+)\.(\w+)\.weight")
# gpt-oss one expert at a time (from a GGUF): each matrix and its bias.
_GPT_OSS_EXPERT = re.compile(r"experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.(weight|bias)")
_GPT_OSS_PARTS = tuple(f"{m}.{k}" for m in ("gate_proj", "up_proj", "down_proj") for k in ("weight", "bias"))


def interleave_rows(gate: Weight, up: Weight) -> Weight:
    """gate's and up's rows alternating, gate first (gpt-oss's fused layout),
    in any format: a permutation of rows, each row's values and scales its own."""
    n = _shape(gate)[0]
    order = torch.stack([torch.arange(n), torch.arange(n) + n], dim=1).reshape(-1)
    both = stack_rows([gate, up])
    if isinstance(both, torch.Tensor):
        return both[order]
    if isinstance(both, Int4Weight):
        return Int4Weight(both.q[order], both.scale[order], both.zero[order], both.group_size)
    if isinstance(both, Int8GroupWeight):
        return Int8GroupWeight(both.q[order], both.scale[order], both.group_size)
    return Int8Weight(both.q[order], both.scale[order])  # type: ignore[union-attr]


_FUSED = ("gate_up_proj", "down_proj")


@attrs.define
class ExpertCollector:
    """A compressed block's expert tensors of one layer, as they arrive;
    each expert's linears are built as soon as its tensors are all there
    and the tensors dropped, so at most one expert is held raw (gpt-oss's
    fused tensors hold every expert of the layer: they are sliced one
    expert at a time, never decoded whole)."""

    block: SparseMoeBlock
    layer_prefix: str
    choice: KernelChoice
    batch_invariant: bool = True
    _pending: dict[str, Any] = attrs.field(factory=dict)
    _built: dict[int, ExpertLinears] = attrs.field(factory=dict)
    # Whether gpt-oss's experts come one at a time (a GGUF's), not fused.
    _one_by_one: bool = False

    def accepts(self, name: str) -> bool:
        """Whether ``name`` is one of this block's expert tensors."""
        p = block_prefix(self.block, self.layer_prefix)
        return name.startswith(f"{p}experts.")

    def add(self, name: str, tensor: Weight) -> None:
        """Take expert tensor ``name``; ``ModelLoadError`` naming it where it
        is not one of the block's or has the wrong shape."""
        p = block_prefix(self.block, self.layer_prefix)
        if not self.accepts(name):
            raise ModelLoadError(f"weight {name!r} is not an expert of {p}")
        key = name.removeprefix(p)
        b = self.block
        h, i = b.hidden_size, b.intermediate_size
        per_expert = _GPT_OSS_EXPERT.fullmatch(key) if b.routing == "gpt_oss" else None
        if per_expert is not None:
            self._add_gpt_oss_expert(name, int(per_expert.group(1)), f"{per_expert.group(2)}.{per_expert.group(3)}", tensor)
            return
        if b.routing == "gpt_oss":
            want = self._fused_shapes().get(key)
            if want is None:
                raise ModelLoadError(f"unknown weight {name!r} for gpt-oss experts")
            if _shape(tensor) != want:
                raise ModelLoadError(f"weight {name!r}: expected shape {want}, got {_shape(tensor)}")
            self._pending[key] = tensor
            if not self.missing():
                self._build_fused()
            return
        match = _PER_EXPERT_NAME.fullmatch(key)
        gate, up, down = _PER_EXPERT[b.routing]
        if match is None or int(match.group(1)) >= b.num_experts or match.group(2) not in (gate, up, down):
            raise ModelLoadError(f"unknown weight {name!r} for {b.routing} experts ({b.num_experts} of them)")
        e, part = int(match.group(1)), match.group(2)
        want = (h, i) if part == down else (i, h)
        if _shape(tensor) != want:
            raise ModelLoadError(f"weight {name!r}: expected shape {want}, got {_shape(tensor)}")
        parts = self._pending.setdefault(str(e), {})
        parts[part] = tensor
        if len(parts) == 3:
            del self._pending[str(e)]
            self._built[e] = ExpertLinears(
                self._make(stack_rows([parts[gate], parts[up]]), None), self._make(parts[down], None)
            )

    def _add_gpt_oss_expert(self, name: str, e: int, part: str, tensor: Weight) -> None:
        b = self.block
        h, i = b.hidden_size, b.intermediate_size
        if e >= b.num_experts:
            raise ModelLoadError(f"unknown weight {name!r} for gpt_oss experts ({b.num_experts} of them)")
        down = part.startswith("down")
        want = ((h,) if down else (i,)) if part.endswith("bias") else ((h, i) if down else (i, h))
        if _shape(tensor) != want:
            raise ModelLoadError(f"weight {name!r}: expected shape {want}, got {_shape(tensor)}")
        self._one_by_one = True
        parts = self._pending.setdefault(f"expert {e}", {})
        parts[part] = tensor
        if len(parts) == len(_GPT_OSS_PARTS):
            del self._pending[f"expert {e}"]
            gate_up_bias = torch.stack([parts["gate_proj.bias"], parts["up_proj.bias"]], dim=1).reshape(-1).float()
            self._built[e] = ExpertLinears(
                self._make(interleave_rows(parts["gate_proj.weight"], parts["up_proj.weight"]), gate_up_bias),
                self._make(parts["down_proj.weight"], parts["down_proj.bias"].float()),
            )

    def _fused_shapes(self) -> dict[str, tuple[int, ...]]:
        e, h, i = self.block.num_experts, self.block.hidden_size, self.block.intermediate_size
        g = mxfp4.GROUP
        shapes = {"experts.gate_up_proj_bias": (e, 2 * i), "experts.down_proj_bias": (e, h)}
        # Float ([experts, in, out]) or MXFP4 ([experts, out, in / 32, 16] and scales).
        blocks = {"gate_up_proj": (e, 2 * i, h // g), "down_proj": (e, h, i // g)}
        for part in _FUSED:
            shapes[f"experts.{part}"] = (e, h, 2 * i) if part == "gate_up_proj" else (e, i, h)
            shapes[f"experts.{part}_blocks"] = (*blocks[part], g // 2)
            shapes[f"experts.{part}_scales"] = blocks[part]
        return shapes

    def missing(self) -> list[str]:
        """The expert tensors not yet given, by checkpoint name (for a
        gpt-oss MXFP4 checkpoint, a float ``gate_up_proj`` may stand for its
        ``_blocks`` and ``_scales``)."""
        p = block_prefix(self.block, self.layer_prefix)
        b = self.block
        if self._one_by_one:
            # gpt-oss one expert at a time (a GGUF's): what each expert still lacks.
            names = []
            for e in range(b.num_experts):
                if e not in self._built:
                    have = self._pending.get(f"expert {e}", {})
                    names += [f"{p}experts.{e}.{n}" for n in _GPT_OSS_PARTS if n not in have]
            return names
        if b.routing == "gpt_oss":
            if self._built:
                return []
            names = ["experts.gate_up_proj_bias", "experts.down_proj_bias"]
            for part in _FUSED:
                if f"experts.{part}" not in self._pending:
                    names += [f"experts.{part}_blocks", f"experts.{part}_scales"]
            return [f"{p}{n}" for n in names if n not in self._pending]
        gate, up, down = _PER_EXPERT[b.routing]
        names = []
        for e in range(b.num_experts):
            if e not in self._built:
                have = self._pending.get(str(e), {})
                names += [f"{p}experts.{e}.{n}.weight" for n in (gate, up, down) if n not in have]
        return names

    def _make(self, weight: Weight, bias: torch.Tensor | None) -> Linear:
        return expert_linear(self.choice, weight, bias, batch_invariant=self.batch_invariant)

    def _build_fused(self) -> None:
        p = block_prefix(self.block, self.layer_prefix)
        pending = self._pending
        for e in range(self.block.num_experts):
            made = []
            for part in _FUSED:
                if f"experts.{part}" in pending:
                    # [in, out] in the checkpoint: one expert transposed at a time.
                    weight: Weight = pending[f"experts.{part}"][e].transpose(0, 1).float().contiguous()
                else:
                    name = f"{p}experts.{part}_blocks"
                    weight = mxfp4.decode_hf(pending[f"experts.{part}_blocks"][e], pending[f"experts.{part}_scales"][e], name)
                bias = pending[f"experts.{part}_bias"][e].float()
                made.append(self._make(weight, bias))
            self._built[e] = ExpertLinears(*made)
        pending.clear()

    def build(self) -> list[ExpertLinears]:
        """Every expert's linears, for ``SparseMoeBlock.set_compressed``;
        ``ModelLoadError`` naming the tensors still missing."""
        missing = self.missing()
        if missing:
            raise ModelLoadError(f"missing expert weights {missing[:8]}{' ...' if len(missing) > 8 else ''}")
        return [self._built[e] for e in range(self.block.num_experts)]


def fuse_gpt_oss_experts(tensors: dict[str, torch.Tensor], layer_prefix: str, num_experts: int) -> None:
    """Replace one gpt-oss layer's float per-expert tensors in ``tensors``
    (``{layer_prefix}mlp.experts.E.gate_proj.weight`` ... ``down_proj.bias``,
    as ``gguf_weights`` names a GGUF's) by the checkpoint's fused ones
    (``experts.gate_up_proj`` ``[experts, in, out]``, gate and up interleaved,
    and their biases), which the float block loads."""
    p = f"{layer_prefix}mlp.experts."
    gate_up, gate_up_bias, down, down_bias = [], [], [], []
    for e in range(num_experts):
        part = {n: tensors.pop(f"{p}{e}.{n}") for n in _GPT_OSS_PARTS}
        gate_up.append(interleave_rows(part["gate_proj.weight"], part["up_proj.weight"]).transpose(0, 1))
        gate_up_bias.append(torch.stack([part["gate_proj.bias"], part["up_proj.bias"]], dim=1).reshape(-1))
        down.append(part["down_proj.weight"].transpose(0, 1))
        down_bias.append(part["down_proj.bias"])
    tensors[f"{p}gate_up_proj"] = torch.stack(gate_up).contiguous()
    tensors[f"{p}gate_up_proj_bias"] = torch.stack(gate_up_bias)
    tensors[f"{p}down_proj"] = torch.stack(down).contiguous()
    tensors[f"{p}down_proj_bias"] = torch.stack(down_bias)
