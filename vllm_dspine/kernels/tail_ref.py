"""Plain PyTorch reference of the serial tail's score tables (docs/design.md section 1.5).

The direct formula, H-wide per (predecessor, candidate) pair: the oracle that the
accelerated tables in `tail.py` are tested against, and their fallback.

    R requests, B block rows (row 0 = anchor), K = B - 1 proposal rows,
    k = head_topk candidates per row, H hidden, C code width, M message width, V vocab.

For proposal row t (1..K), predecessor candidate u and receiver candidate v:

    m_t(u)    = sigmoid(G c_t + Gp sqrt(C) E[u] + b) * (A sqrt(C) E[u])
    x'_t(u)   = x_t + r_t * (W_L m_t(u))
    S_t(u, v) = < head[v], norm(x'_t(u)) >,   norm(y) = y / sqrt(mean(y^2) + eps) * g

with u ranging over C_{t-1} (C_0 = {anchor}) and v over C_t.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from vllm_dspine.kernels.bridge_ref import BridgeWeights, bridge_message_ref


@dataclass
class LastWriteInputs:
    """What the drafter's last layer hands the tail, per request's block: the state the
    tail re-writes once per discrete predecessor. The drafter's forward produces it
    (`model/vllm_model.py`, `model/drafter.py`'s `pre_write_state` / `last_codes` /
    `last_rms`); only the tail reads it."""

    pre_write_state: torch.Tensor  # [R, B, H]  last layer's post-MLP residual, unwritten
    codes: torch.Tensor  # [R, B, C]  that layer's read codes (row 0: sqrt(C) E[anchor])
    rms: torch.Tensor  # [R, B]  r_t of pre_write_state
    anchor_ids: torch.Tensor  # [R]  the token of each block's row 0

    @property
    def num_reqs(self) -> int:
        return self.pre_write_state.shape[0]

    def first_requests(self, n: int) -> "LastWriteInputs":
        """The first `n` requests' blocks (a padded batch holds more)."""
        return LastWriteInputs(self.pre_write_state[:n], self.codes[:n], self.rms[:n],
                               self.anchor_ids[:n])


@dataclass(frozen=True)
class TailWeights:
    """The weights the tail reads, loaded once for the engine's life: the bridge's, the
    final norm's and the target's output head."""

    bridge: BridgeWeights  # uses gate_recv, gate_pred, value, gate_bias, codebook, write[-1]
    norm_weight: torch.Tensor  # [H]  final-norm weight g
    norm_eps: float
    head_weight: torch.Tensor  # [V, H]


def rms_norm_ref(
    x: torch.Tensor,  # [..., H]
    weight: torch.Tensor,  # [H]  g
    eps: float,
) -> torch.Tensor:
    """Qwen3's RMSNorm, x / sqrt(mean(x^2) + eps) * g, in x's dtype (fp32 or float64).

    Qwen3 rounds the normalised state to the activation dtype before multiplying by g;
    this reference keeps full precision (no bf16 rounding anywhere in the tail).
    """
    var = x.pow(2).mean(dim=-1, keepdim=True)
    return x * torch.rsqrt(var + eps) * weight.to(x.dtype)


def predecessor_candidates(
    cand_ids: torch.Tensor,  # [R, K, k]  C_t for rows t = 1..K
    anchor_ids: torch.Tensor,  # [R]
) -> torch.Tensor:
    """u_i for every row: the anchor (C_0 = {a}, repeated k times) at t = 1, C_{t-1} after.

    E.g. K = 3: rows [C_1, C_2, C_3] -> predecessors [(a, a, ..), C_1, C_2].
    -> [R, K, k] int64
    """
    R, K, k = cand_ids.shape
    first = anchor_ids.long()[:, None, None].expand(R, 1, k)  # [R, 1, k]
    return torch.cat([first, cand_ids[:, :-1].long()], dim=1)


def check_tail_inputs(
    inputs: LastWriteInputs,
    cand_ids: torch.Tensor,  # [R, K, k]
    weights: TailWeights,
) -> None:
    """Internal invariants shared by both table paths (asserts: callers build these)."""
    x_last, codes, rms = inputs.pre_write_state, inputs.codes, inputs.rms
    bridge = weights.bridge
    assert x_last.ndim == 3, x_last.shape
    R, B, H = x_last.shape
    assert B >= 2, B
    assert codes.shape == (R, B, bridge.code_dim), (codes.shape, (R, B, bridge.code_dim))
    assert rms.shape == (R, B), (rms.shape, (R, B))
    assert cand_ids.ndim == 3 and cand_ids.shape[:2] == (R, B - 1), (cand_ids.shape, R, B)
    assert inputs.anchor_ids.shape == (R,), inputs.anchor_ids.shape
    assert weights.norm_weight.shape == (H,), weights.norm_weight.shape
    assert weights.head_weight.ndim == 2 and weights.head_weight.shape[1] == H, \
        weights.head_weight.shape
    assert bridge.write[-1].shape == (H, bridge.message_dim), bridge.write[-1].shape


def tail_score_tables_ref(
    inputs: LastWriteInputs,  # the last layer's state [R, B, ...] and anchors [R]
    cand_ids: torch.Tensor,  # [R, K, k]  candidates of rows 1..K
    weights: TailWeights,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """S[r, t-1, i, j] = < head[v_j], norm(x'_t(u_i)) > by the direct formula.

    The message comes from `bridge_message_ref` (the one source of truth; it computes in
    fp32); the write, the norm and the head products run in `dtype` (float64 for sampled
    rows).  -> S [R, K, k, k] in `dtype`
    """
    check_tail_inputs(inputs, cand_ids, weights)
    bridge = weights.bridge
    R, B, H = inputs.pre_write_state.shape
    K, k = B - 1, cand_ids.shape[2]
    C = bridge.code_dim
    pred_ids = predecessor_candidates(cand_ids, inputs.anchor_ids)  # [R, K, k]
    pred_codes = math.sqrt(C) * bridge.codebook[pred_ids].float()  # [R, K, k, C]
    recv_codes = inputs.codes[:, 1:, None, :].float().expand(R, K, k, C)  # [R, K, k, C]
    m = bridge_message_ref(recv_codes.reshape(-1, C), pred_codes.reshape(-1, C),
                           bridge.gate_recv, bridge.gate_pred, bridge.value,
                           bridge.gate_bias)  # [R*K*k, M]
    m = m.to(dtype).view(R, K, k, -1)  # [R, K, k, M]
    write = bridge.write[-1].to(dtype)  # [H, M]
    x = inputs.pre_write_state[:, 1:].to(dtype)  # [R, K, H]
    r = inputs.rms[:, 1:].to(dtype)  # [R, K]
    x_new = x[:, :, None, :] + r[:, :, None, None] * (m @ write.t())  # [R, K, k(u), H]
    y = rms_norm_ref(x_new, weights.norm_weight, weights.norm_eps)  # [R, K, k(u), H]
    heads = weights.head_weight[cand_ids.long()].to(dtype)  # [R, K, k(v), H]
    return torch.einsum("rtih,rtjh->rtij", y, heads)
