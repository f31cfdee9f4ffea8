"""LoRA in the forward: a layer's projections with the adapters' deltas
added (``LoraProjections``) for the step's groups of rows (``batch.LoraBatch``).

The base projections run over the whole batch as they would without LoRA
(float or compressed weights alike); each adapter's group of rows then
gets ``scaling * (x @ A.T) @ B.T`` added into its slice of the output rows.
Rows without an adapter are not touched. The deltas are computed in a fixed
order per row (``lora_delta``), so a request's delta does not depend on its
batch mates.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import torch

from trioserve.engine.kernels.projections import gate_activation
from trioserve.engine.lora.adapter import LoraDelta
from trioserve.engine.lora.batch import LoraBatch, LoraGroup

# Elements of the [rows, r, in] product ``lora_delta`` holds at once.
_CHUNK_ELEMENTS = 1 << 21


def lora_delta(x: torch.Tensor, delta: LoraDelta) -> torch.Tensor:
    """``delta.scaling * (x @ a.T) @ b.T`` in float32, each row on its own
    in a fixed order: the ``r`` sums over inputs are elementwise products
    reduced along one contiguous row (no GEMM, whose blocking follows the
    row count), and the output is ``r`` multiply-adds in order of ``k``.
    So a row's result has the same bits whatever rows come with it."""
    x = x.float()
    a, b = delta.a, delta.b
    rank = a.shape[0]
    rows = max(1, _CHUNK_ELEMENTS // max(1, rank * a.shape[1]))
    t = torch.cat([(part.unsqueeze(1) * a).sum(-1) for part in x.split(rows)]) if x.shape[0] else x.new_zeros(0, rank)
    t.mul_(delta.scaling)
    out = x.new_zeros(x.shape[0], b.shape[0])
    b_t = b.T  # [r, out]: row k is column k of B
    for k in range(rank):
        out.addcmul_(t[:, k : k + 1], b_t[k])
    return out


def _add(out: torch.Tensor, x: torch.Tensor, groups: tuple, projection: str) -> None:
    """Add each group's deltas for ``projection`` into its rows of ``out``,
    a slice add per segment of consecutive rows (the other rows untouched)."""
    for group, deltas in groups:
        chosen = [d for d in deltas if d.projection == projection]
        if not chosen:
            continue
        spans = group.segments
        x_rows = x[spans[0][0] : spans[0][1]] if len(spans) == 1 else x.index_select(0, group.rows)
        for delta in chosen:
            values = lora_delta(x_rows, delta).to(out.dtype)
            offset = 0
            for start, end in spans:
                out[start:end, delta.start : delta.start + values.shape[1]].add_(values[offset : offset + end - start])
                offset += end - start


@attrs.frozen(eq=False)
class LoraProjections:
    """A layer's projections (``base``: any of ``models/projections.py``'s,
    ``kernels.projections.QuantizedProjections``) with adapter deltas:
    ``groups`` pairs each adapter's token rows with its deltas of this layer."""

    base: object
    groups: tuple[tuple[LoraGroup, tuple[LoraDelta, ...]], ...]

    def _has(self, *projections: str) -> bool:
        return any(d.projection in projections for _, deltas in self.groups for d in deltas)

    def qkv(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base.qkv(x)
        _add(out, x, self.groups, "qkv")
        return out

    def o(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base.o(x)
        _add(out, x, self.groups, "o")
        return out

    def o_add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        out = self.base.o_add(x, residual)
        _add(out, x, self.groups, "o")
        return out

    def mlp(self, x: torch.Tensor, activation: str) -> torch.Tensor:
        if not self._has("gate_up", "down"):
            return self.base.mlp(x, activation)
        gate_up = self.base.gate_up(x)
        _add(gate_up, x, self.groups, "gate_up")
        gate, up = gate_up.chunk(2, dim=-1)
        hidden = gate_activation(gate, activation) * up
        out = self.base.down(hidden)
        _add(out, hidden, self.groups, "down")
        return out

    def mlp_add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        if not self._has("gate_up", "down"):
            return self.base.mlp_add(x, residual)
        return self.mlp(x, "silu").add_(residual)


def wrap_layers(lora: LoraBatch, layers: Sequence[object]) -> list[object]:
    """Each layer's projections, wrapped where an adapter of ``lora``'s
    step changes that layer (the others as they are)."""
    wrapped: list[object] = []
    for index, base in enumerate(layers):
        groups = tuple((g, g.adapter.layers[index]) for g in lora.groups if g.adapter.layers[index])
        wrapped.append(LoraProjections(base, groups) if groups else base)
    return wrapped
