"""Token embeddings kept in a checkpoint's compressed format.

A step looks up one row per token it runs, a few hundred of the
vocabulary's tens of thousands, so the table stays as the file stores it
(int8 or 4-bit values with their group scales: a quarter of float32's
bytes or less) and only the rows looked up are dequantized. Each row comes
out bit for bit as the whole table's ``dequantize()`` has it: the same
float operations on the same values, row by row.
"""

from __future__ import annotations

import attrs
import torch

from trioserve.engine.kernels.q6k_lanes import Q6KLanes
from trioserve.engine.kernels.q8_lanes import Q8Lanes
from trioserve.engine.kernels.rtn import Int4Weight, Int8GroupWeight


@attrs.frozen
class CompressedEmbedding:
    """``weight``'s rows, dequantized on lookup (a ``Q8Lanes`` or
    ``Q6KLanes`` table: the LM head's, which a tied model's embeddings
    share)."""

    weight: Int4Weight | Int8GroupWeight | Q8Lanes | Q6KLanes

    @property
    def num_embeddings(self) -> int:
        return self._shape[0]

    @property
    def embedding_dim(self) -> int:
        return self._shape[1]

    @property
    def _shape(self) -> tuple[int, int]:
        w = self.weight
        return w.shape if isinstance(w, Q8Lanes | Q6KLanes) else (w.q.shape[0], w.q.shape[1])

    @property
    def nbytes(self) -> int:
        w = self.weight
        if isinstance(w, Q8Lanes | Q6KLanes):
            return w.nbytes
        zero = w.zero.nbytes if isinstance(w, Int4Weight) else 0
        return w.q.nbytes + w.scale.nbytes + zero

    def __call__(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Float32 ``[*input_ids.shape, embedding_dim]``, the rows of ``input_ids``."""
        w = self.weight
        flat = input_ids.reshape(-1)
        if isinstance(w, Q8Lanes | Q6KLanes):
            return w.lookup(flat).view(*input_ids.shape, self.embedding_dim)
        q = w.q.index_select(0, flat)
        scale = w.scale.index_select(0, flat)
        if isinstance(w, Int4Weight):
            rows = Int4Weight(q, scale, w.zero.index_select(0, flat), w.group_size)
        else:
            rows = Int8GroupWeight(q, scale, w.group_size)
        return rows.dequantize().view(*input_ids.shape, self.embedding_dim)
