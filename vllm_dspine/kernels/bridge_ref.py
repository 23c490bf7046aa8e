"""Plain PyTorch reference of the code bridge (docs/design.md section 1.3).

This is the one source of truth for the bridge formulas: the CPU path, the oracle the
Triton kernels in `bridge.py` are tested against, and what the serial tail reuses.

Layout: the rows of many blocks of many requests are flattened into `N` rows. A row's
predecessor is the row before it, except at an anchor row (`is_anchor[i]`), which starts
a block: it reads the anchor token's codebook row instead of a predicted code and is
never written. So no predecessor is ever read across a block boundary.

    H hidden size, C code width, M message width, V vocabulary size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass
class BridgeWeights:
    """The bridge tensors of one drafter (docs/design.md section 2, `bridge.*`)."""

    codebook: torch.Tensor  # [V, C]  E
    read: list[torch.Tensor]  # L x [C, H]  R_l
    gate_recv: torch.Tensor  # [M, C]  G
    gate_pred: torch.Tensor  # [M, C]  Gp
    value: torch.Tensor  # [M, C]  A
    gate_bias: torch.Tensor  # [M]     b
    write: list[torch.Tensor]  # L x [H, M]  W_l
    eps: float

    @property
    def code_dim(self) -> int:
        return self.codebook.shape[1]

    @property
    def message_dim(self) -> int:
        return self.gate_recv.shape[0]


def row_rms(x: torch.Tensor) -> torch.Tensor:
    """r_t = sqrt(mean_i x_t,i^2), in fp32.  x: [N, H] -> [N]"""
    xf = x.float()
    return xf.pow(2).mean(dim=-1).sqrt()


def bridge_read_ref(
    x: torch.Tensor,  # [N, H]  post-MLP residual of one layer
    read_weight: torch.Tensor,  # [C, H]  R_l
    codebook: torch.Tensor,  # [V, C]  E
    token_ids: torch.Tensor,  # [N]     anchor token at anchor rows (others ignored)
    is_anchor: torch.Tensor,  # [N]     bool
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns codes [N, C] and rms [N], both fp32.

    Non-anchor rows: c = sqrt(C) * z / (||z|| + eps), z = R (x / (r + eps)).
    Anchor rows:     c = sqrt(C) * E[token].
    """
    C = read_weight.shape[0]
    scale = math.sqrt(C)
    rms = row_rms(x)  # [N]
    z = (x.float() / (rms[:, None] + eps)) @ read_weight.float().t()  # [N, C]
    codes = scale * z / (z.norm(dim=-1, keepdim=True) + eps)
    anchor_codes = scale * codebook[token_ids.long()].float()  # [N, C] (gather, then widen)
    codes = torch.where(is_anchor[:, None], anchor_codes, codes)
    return codes, rms


def predecessor_codes(codes: torch.Tensor, is_anchor: torch.Tensor) -> torch.Tensor:
    """c_{t-1} for every row; zeros at anchor rows (their write is disabled anyway).

    E.g. rows [a0 x1 x2 | b0 y1] -> [0 a0 x1 | 0 b0].  codes: [N, C] -> [N, C]
    """
    prev = torch.zeros_like(codes)
    prev[1:] = codes[:-1]
    return torch.where(is_anchor[:, None], torch.zeros_like(prev), prev)


def bridge_message_ref(
    recv_codes: torch.Tensor,  # [N, C]  c_t
    pred_codes: torch.Tensor,  # [N, C]  c_{t-1} (or a discrete candidate's sqrt(C) E[u])
    gate_recv: torch.Tensor,  # [M, C]
    gate_pred: torch.Tensor,  # [M, C]
    value: torch.Tensor,  # [M, C]
    gate_bias: torch.Tensor,  # [M]
) -> torch.Tensor:
    """m = sigmoid(G c_t + Gp c_{t-1} + b) * (A c_{t-1}).  -> [N, M] fp32"""
    rc, pc = recv_codes.float(), pred_codes.float()
    gate = torch.sigmoid(rc @ gate_recv.float().t() + pc @ gate_pred.float().t()
                         + gate_bias.float())
    return gate * (pc @ value.float().t())


def bridge_write_ref(
    x: torch.Tensor,  # [N, H]
    rms: torch.Tensor,  # [N]
    codes: torch.Tensor,  # [N, C]
    is_anchor: torch.Tensor,  # [N] bool
    gate_recv: torch.Tensor,  # [M, C]
    gate_pred: torch.Tensor,  # [M, C]
    value: torch.Tensor,  # [M, C]
    gate_bias: torch.Tensor,  # [M]
    write_weight: torch.Tensor,  # [H, M]  W_l
) -> torch.Tensor:
    """x' = x + r * (W m), m = 0 at anchor rows.  Returns [N, H] in x's dtype."""
    prev = predecessor_codes(codes, is_anchor)
    m = bridge_message_ref(codes, prev, gate_recv, gate_pred, value, gate_bias)  # [N, M]
    m = torch.where(is_anchor[:, None], torch.zeros_like(m), m)
    update = rms[:, None].float() * (m @ write_weight.float().t())  # [N, H]
    return (x.float() + update).to(x.dtype)


def code_bridge_ref(
    x: torch.Tensor,  # [N, H]
    layer: int,
    weights: BridgeWeights,
    token_ids: torch.Tensor,  # [N]
    is_anchor: torch.Tensor,  # [N] bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One bridge after draft layer `layer`: returns (x' [N, H], codes [N, C], rms [N])."""
    codes, rms = bridge_read_ref(x, weights.read[layer], weights.codebook, token_ids,
                                 is_anchor, weights.eps)
    x_new = bridge_write_ref(x, rms, codes, is_anchor, weights.gate_recv, weights.gate_pred,
                             weights.value, weights.gate_bias, weights.write[layer])
    return x_new, codes, rms
