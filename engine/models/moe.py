"""The mixture-of-experts MLP block of Qwen3-MoE, Mixtral and gpt-oss.

A router scores each token against every expert and keeps the top k; each
kept expert runs its gated MLP on the token and the outputs are summed with
the routing weights. Each family normalises the weights its own way
(``ROUTINGS``): Qwen3-MoE takes the softmax over all experts, keeps the top
k and renormalises them when ``norm_topk_prob``; Mixtral does the same and
always renormalises; gpt-oss's router has a bias, keeps the top k logits and
takes the softmax over those k. gpt-oss's experts also carry biases, hold
gate and up interleaved by rows, and run a clamped SwiGLU
(``gpt_oss_activation``).

The experts run grouped (``GroupedExperts``): the (token, expert) pairs are
sorted by expert once, each expert with tokens runs one matmul over its
gathered tokens, and each token's k outputs are summed in its routing order,
so the work follows the routed tokens, not experts x tokens. A token's
result depends only on its own row wherever the matmuls give a row the same
bits at every row count (oneDNN's packed float32 GEMM; the native kernels of
``choose.ROW_INVARIANT_ISAS`` with ``int8_panels``): the routing, the gather
and the sum are all per row.

The experts' weights are float parameters (``SparseMoeBlock.experts``), or
compressed linears built expert by expert (``moe_weights``) and given by
``set_compressed``, so a compressed expert is never dequantized as a whole.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import attrs
import torch
import torch.nn.functional as F
from torch import nn

from trioserve.engine.kernels import onednn

Linear = Callable[[torch.Tensor], torch.Tensor]
# What a family's router does with its logits (see the module's docstring).
ROUTINGS = ("qwen3_moe", "mixtral", "gpt_oss")
# gpt-oss's clamped SwiGLU (transformers' GptOssExperts): its defaults.
SWIGLU_ALPHA = 1.702
SWIGLU_LIMIT = 7.0


def gpt_oss_activation(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's gated activation of a ``[rows, 2 * inter]`` gate/up product
    whose columns alternate gate and up: ``(up + 1) * gate * sigmoid(alpha *
    gate)``, with gate clamped to at most ``limit`` and up to ``[-limit, limit]``."""
    gate = gate_up[:, 0::2].clamp(max=limit)
    up = gate_up[:, 1::2].clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def silu_activation(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU of a ``[rows, 2 * inter]`` product whose first half is the gate, the second up."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate).mul_(up)


@attrs.frozen
class FloatLinear:
    """``F.linear`` over a float weight and bias, kept where a fused step can
    read them (engine/kernels/native_decode.py takes a router so)."""

    weight: torch.Tensor
    bias: torch.Tensor | None = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


@attrs.frozen
class ExpertLinears:
    """One expert's two linears: ``gate_up`` (``[rows, hidden] -> [rows, 2 *
    inter]``, its bias inside) and ``down`` (``[rows, inter] -> [rows, hidden]``)."""

    gate_up: Linear
    down: Linear


@attrs.frozen
class GroupedExperts:
    """A block's router and experts as made to run (float, packed or
    compressed); calling it is the block's forward."""

    router: Linear  # [tokens, hidden] -> logits [tokens, experts]
    experts: tuple[ExpertLinears, ...]
    routing: str
    top_k: int
    norm_topk_prob: bool = False
    swiglu_alpha: float = SWIGLU_ALPHA
    swiglu_limit: float = SWIGLU_LIMIT

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's routing weights (float32 ``[tokens, k]``) and experts
        (int64 ``[tokens, k]``), best first."""
        logits = self.router(x).float()
        if self.routing == "gpt_oss":
            top, index = torch.topk(logits, self.top_k, dim=-1)
            return torch.softmax(top, dim=-1), index
        top, index = torch.topk(torch.softmax(logits, dim=-1), self.top_k, dim=-1)
        if self.routing == "mixtral" or self.norm_topk_prob:
            top = top / top.sum(dim=-1, keepdim=True)
        return top, index

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """The block's output for the normed hidden rows ``x`` ``[tokens, hidden]``."""
        weights, index = self.route(x)
        return self.combine(x, weights, index)

    def combine(self, x: torch.Tensor, weights: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """``sum_j weights[t, j] * expert_{index[t, j]}(x[t])`` for every
        token t, each expert run once over the tokens routed to it."""
        tokens, k = index.shape
        if tokens == 0:
            return torch.zeros_like(x)
        if tokens == 1:
            return self._one_token(x, weights, index)
        pairs = index.reshape(-1)
        # Sorted by expert, and within an expert by token (stable): each
        # expert's rows are one slice of the gathered tokens.
        order = torch.argsort(pairs, stable=True)
        counts = torch.bincount(pairs, minlength=len(self.experts)).tolist()
        gathered = x.index_select(0, order // k)
        outputs = torch.empty_like(gathered)
        start = 0
        for expert, count in enumerate(counts):
            if count:
                rows = slice(start, start + count)
                outputs[rows] = self._expert(self.experts[expert], gathered[rows])
                start += count
        # Back to (token, rank) order, then each token's k outputs summed
        # rank by rank: an order that no other token can change.
        by_token = torch.empty_like(outputs).index_copy_(0, order, outputs).view(tokens, k, -1)
        w = weights.to(x.dtype)
        out = by_token[:, 0] * w[:, 0:1]
        for j in range(1, k):
            out.add_(by_token[:, j] * w[:, j : j + 1])
        return out

    def _one_token(self, x: torch.Tensor, weights: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """``combine`` of one token (a one-stream decode step): its k experts
        straight on its row, without the sort, gather and scatter, summed in
        the same rank order with the same products, so the bits are
        ``combine``'s."""
        w = weights.to(x.dtype)
        out = None
        for j, expert in enumerate(index[0].tolist()):
            y = self._expert(self.experts[expert], x).mul_(w[:, j : j + 1])
            out = y if out is None else out.add_(y)
        assert out is not None
        return out

    def _expert(self, expert: ExpertLinears, rows: torch.Tensor) -> torch.Tensor:
        gate_up = expert.gate_up(rows)
        if self.routing == "gpt_oss":
            hidden = gpt_oss_activation(gate_up, self.swiglu_alpha, self.swiglu_limit)
        else:
            hidden = silu_activation(gate_up)
        return expert.down(hidden)


def _param(*shape: int, dtype: torch.dtype, device: torch.device | str) -> nn.Parameter:
    # Uninitialised, as llama.py's: every value is overwritten by loading.
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


class SparseMoeBlock(nn.Module):
    """One decoder layer's mixture-of-experts MLP: ``forward(x)`` for the
    post-attention-normed hidden rows ``x`` ``[tokens, hidden]`` (the
    decoder adds the residual).

    Parameters, uninitialised until loaded (``moe_weights.weight_targets``):
    ``router`` ``[experts, hidden]`` (and ``router_bias`` for gpt-oss);
    ``gate_up`` ``[experts, 2 * inter, hidden]``, the gate's rows then up's
    (gpt-oss: interleaved, gate first, as its checkpoint's columns are);
    ``down`` ``[experts, hidden, inter]``; gpt-oss's ``gate_up_bias`` and
    ``down_bias``. With ``float_experts=False`` the experts have no float
    parameters: they come compressed through ``set_compressed``.
    """

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        num_experts: int,
        top_k: int,
        routing: str,
        *,
        norm_topk_prob: bool = False,
        swiglu_alpha: float = SWIGLU_ALPHA,
        swiglu_limit: float = SWIGLU_LIMIT,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        float_experts: bool = True,
    ):
        super().__init__()
        if routing not in ROUTINGS:
            raise ValueError(f"MoE routing {routing!r} is not one of {', '.join(ROUTINGS)}")
        if not 0 < top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok {top_k} must be in 1..num_experts ({num_experts})")
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_experts = num_experts
        self.top_k = top_k
        self.routing = routing
        self.norm_topk_prob = norm_topk_prob
        self.swiglu_alpha = swiglu_alpha
        self.swiglu_limit = swiglu_limit
        biased = routing == "gpt_oss"
        e, h, i = num_experts, hidden_size, intermediate_size
        where = {"dtype": dtype, "device": device}
        self.router = _param(e, h, **where)
        self.router_bias = _param(e, **where) if biased else None
        self.gate_up = _param(e, 2 * i, h, **where) if float_experts else None
        self.down = _param(e, h, i, **where) if float_experts else None
        # Compressed experts take their biases into their kernels.
        self.gate_up_bias = _param(e, 2 * i, **where) if biased and float_experts else None
        self.down_bias = _param(e, h, **where) if biased and float_experts else None
        self._compressed: tuple[ExpertLinears, ...] | None = None

    @property
    def float_experts(self) -> bool:
        """Whether the experts are float parameters (else compressed: ``set_compressed``)."""
        return self.gate_up is not None

    def _grouped(self, router: Linear, experts: Sequence[ExpertLinears]) -> GroupedExperts:
        return GroupedExperts(
            router,
            tuple(experts),
            self.routing,
            self.top_k,
            self.norm_topk_prob,
            self.swiglu_alpha,
            self.swiglu_limit,
        )

    def experts(self, pack: bool) -> GroupedExperts:
        """The block made to run: on oneDNN over packed copies of the router
        and float experts when ``pack`` (a row's bits then do not depend on
        the row count; the copies cost as much memory again), else
        ``F.linear`` over the parameters. Compressed experts (``set_compressed``)
        are taken as they are; their router runs as ``pack`` says."""
        router: Linear = FloatLinear(self.router, self.router_bias)  # a fused decode step reads its weight
        if pack:
            router_weight = onednn.pack(self.router)
            router_bias = self.router_bias

            def packed(x: torch.Tensor) -> torch.Tensor:
                return onednn.linear(x, router_weight, router_bias, "none")

            router = packed

        if self._compressed is not None:
            return self._grouped(router, self._compressed)
        assert self.gate_up is not None and self.down is not None
        made = []
        for e in range(self.num_experts):
            gate_up_bias = None if self.gate_up_bias is None else self.gate_up_bias[e]
            down_bias = None if self.down_bias is None else self.down_bias[e]
            if pack:
                made.append(ExpertLinears(_packed(self.gate_up[e], gate_up_bias), _packed(self.down[e], down_bias)))
            else:
                made.append(ExpertLinears(_plain(self.gate_up[e], gate_up_bias), _plain(self.down[e], down_bias)))
        return self._grouped(router, made)

    def set_compressed(self, experts: Sequence[ExpertLinears]) -> None:
        """Run the experts on compressed linears, one ``ExpertLinears`` an
        expert (``moe_weights.ExpertCollector.build``); the block must have
        been made with ``float_experts=False``."""
        if self.float_experts:
            raise ValueError("set_compressed needs a block made with float_experts=False")
        if len(experts) != self.num_experts:
            raise ValueError(f"{len(experts)} compressed experts for a block of {self.num_experts}")
        self._compressed = tuple(experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The block's output for ``x`` ``[tokens, hidden]``, on ``F.linear``
        over the parameters or the compressed experts; a model makes
        ``experts(pack)`` once and calls that instead."""
        return self.experts(pack=False)(x)


def _plain(weight: torch.Tensor, bias: torch.Tensor | None) -> Linear:
    return lambda x: F.linear(x, weight, bias)


def _packed(weight: torch.Tensor, bias: torch.Tensor | None) -> Linear:
    packed = onednn.pack(weight)
    return lambda x: onednn.linear(x, packed, bias, "none")
