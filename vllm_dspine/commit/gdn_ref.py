"""Gated DeltaNet (GDN) as vLLM 0.32.0's Qwen3.5 / Qwen3-Next layers run it, in plain
PyTorch, per token; and the replay commit built on it. The CPU path of `replay.py`.

Shapes (one GDN layer; the same letters in `replay.py`):

    R  requests (vLLM's num_reqs)          T  positions of one request's verified block
    H  key heads (linear_num_key_heads)    HV value heads (linear_num_value_heads)
    K  key head dim                        V  value head dim
    W  conv width (linear_conv_kernel_dim) D  conv channels = 2 H K + HV V (q | k | v)

What one layer does with one token, read from vLLM 0.32.0
(`QwenGatedDeltaNetAttention._forward_core`, `causal_conv1d_update`,
`fused_sigmoid_gating_delta_rule_update_kernel` with `use_qk_l2norm_in_kernel=True`,
the CPU ops in `ops/cpu/gdn_attention.py`):

    x_t                = in_proj_qkv(h_t)                       [D]  pre-conv ("mixed_qkv")
    a_t, b_t           = in_proj_a(h_t), in_proj_b(h_t)         [HV] each
    y_t                = act(sum_w conv_weight[:, w] * x_{t-W+1+w} + conv_bias)
                         rounded to x's dtype (vLLM's conv kernels write their output in it)
    q_t | k_t | v_t    = y_t split [H K | H K | HV V] -> [H, K], [H, K], [HV, V]
    k^_t               = k_t / sqrt(||k_t||^2 + 1e-6)             (per key head)
    q^_t               = q_t / sqrt(||q_t||^2 + 1e-6) * K^-1/2
    g_t                = -exp(A_log) * softplus(a_t + dt_bias)    [HV] (softplus linear past 20)
    beta_t             = sigmoid(b_t)                             [HV]
    for value head j, key head i = j // (HV / H), state S_j [V, K] (vLLM's layout):
        S_j <- exp(g_t,j) S_j
        u    = beta_t,j (v_t,j - S_j k^_t,i)                      [V]
        S_j <- S_j + u k^_t,i^T
        o_t,j = S_j q^_t,i                                        [V]

`x_{t-W+1+w}` before the block comes from the conv window: the last W - 1 pre-conv inputs,
stored per request as [D, W - 1] (column W - 2 is the newest). After a token the window
drops its oldest column and appends x_t. A fresh sequence starts from zeros (vLLM zeroes
the state of a request without prior state).

Arithmetic is fp32 for fp32 / bf16 / fp16 inputs, as in vLLM's kernels, and float64 when
the state or the inputs are float64 (the oracle in the tests).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

L2NORM_EPS = 1e-6  # vLLM: rsqrt(sum(x * x) + 1e-6) in the recurrent kernels
SOFTPLUS_THRESHOLD = 20.0  # vLLM: softplus(x) = x for x > 20
ACTIVATIONS = (None, "silu", "swish")  # what vLLM's causal conv kernels accept


@dataclass(frozen=True)
class GDNWeights:
    """The parameters of one GDN layer that the recurrence and the conv window need
    (the projections that make x, a, b and the output norm/projection are not)."""

    conv_weight: torch.Tensor  # [D, W]  (vLLM's conv1d.weight [D, 1, W], viewed)
    conv_bias: torch.Tensor | None  # [D] or None (Qwen3.5 / Qwen3-Next: None)
    A_log: torch.Tensor  # [HV]
    dt_bias: torch.Tensor  # [HV]
    num_k_heads: int  # H
    head_k_dim: int  # K
    head_v_dim: int  # V
    activation: str | None = "silu"  # config.hidden_act; silu and swish are the same

    @property
    def num_v_heads(self) -> int:
        return self.A_log.shape[0]

    @property
    def conv_dim(self) -> int:
        return 2 * self.num_k_heads * self.head_k_dim + self.num_v_heads * self.head_v_dim

    @property
    def conv_width(self) -> int:
        return self.conv_weight.shape[1]


@dataclass(frozen=True)
class VerifiedBlockInputs:
    """What a verify forward keeps per position for the replay: the pre-conv inputs and
    the raw gate inputs, flattened over requests as vLLM lays out a step's tokens.
    Request r owns rows query_start_loc[r] .. query_start_loc[r + 1] - 1; row 0 of its
    block is the token sampled last step, rows 1.. its drafts.

    Why pre-conv x and raw a, b: the committed conv window *is* the last W - 1 pre-conv
    inputs, so x is needed whatever else is kept, and k, v, g, beta follow from x, a, b
    by per-position arithmetic; keeping post-conv k, v as well would add H K + HV V
    values per position. Recomputing them in vLLM's order and dtypes keeps the replay
    exact (docs/hybrid.md)."""

    mixed_qkv: torch.Tensor  # [num_tokens, D]  in_proj_qkv output, before the conv
    a: torch.Tensor  # [num_tokens, HV]  in_proj_a output (decay input)
    b: torch.Tensor  # [num_tokens, HV]  in_proj_b output (beta input)
    query_start_loc: torch.Tensor  # [R + 1] int, vLLM's cumulative query lengths


def compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """float64 if any tensor is float64, else float32 (vLLM's kernels accumulate in fp32)."""
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def l2norm(x: torch.Tensor) -> torch.Tensor:
    """x / sqrt(||x||^2 + 1e-6) over the last dim."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2NORM_EPS)


def gdn_gates_ref(a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor,
                  dt_bias: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(g, beta) in `dtype`: g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b).
    a, b: [..., HV]; A_log, dt_bias: [HV]."""
    x = a.to(dtype) + dt_bias.to(dtype)
    g = -torch.exp(A_log.to(dtype)) * F.softplus(x, beta=1.0, threshold=SOFTPLUS_THRESHOLD)
    return g, torch.sigmoid(b.to(dtype))


def causal_conv_ref(conv_state: torch.Tensor, x: torch.Tensor, w: GDNWeights,
                    dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The causal depthwise conv over a block, from the window before it.

    conv_state [D, W-1] (the W - 1 inputs before x[0]), x [T, D].
    Returns (y [T, D] rounded to x's dtype, the window after the block [D, W-1] in
    conv_state's dtype: the last W - 1 of (window, x)).
    """
    W = w.conv_width
    assert conv_state.shape == (w.conv_dim, W - 1), conv_state.shape
    T = x.shape[0]
    seq = torch.cat([conv_state.to(dtype).T, x.to(dtype)], dim=0)  # [W-1+T, D]
    weight = w.conv_weight.to(dtype)  # [D, W]
    # Bias first, then the taps oldest to newest: vLLM's kernels' order (so bf16 rounding
    # of y lands where theirs does).
    y = torch.zeros(T, w.conv_dim, dtype=dtype)
    if w.conv_bias is not None:
        y += w.conv_bias.to(dtype)
    for tap in range(W):
        # y[t] gets weight[:, tap] * seq[t + tap]  (seq[t + W - 1] is x[t])
        y += weight[:, tap] * seq[tap:tap + T]
    if w.activation in ("silu", "swish"):
        y = F.silu(y)
    new_window = torch.cat([conv_state.T, x.to(conv_state.dtype)], dim=0)[T:].T
    return y.to(x.dtype), new_window.contiguous()


def gdn_forward_ref(state: torch.Tensor, conv_state: torch.Tensor, mixed_qkv: torch.Tensor,
                    a: torch.Tensor, b: torch.Tensor, w: GDNWeights
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One request through T tokens, from its state and conv window.

    state [HV, V, K], conv_state [D, W-1], mixed_qkv [T, D], a, b [T, HV].
    Returns (o [T, HV, V] in the compute dtype, state [HV, V, K] in state's dtype,
    conv window [D, W-1] in conv_state's dtype). Nothing is modified in place.
    """
    H, HV, K, V = w.num_k_heads, w.num_v_heads, w.head_k_dim, w.head_v_dim
    assert state.shape == (HV, V, K), (state.shape, (HV, V, K))
    assert HV % H == 0, (HV, H)
    dtype = compute_dtype(state, mixed_qkv)
    T = mixed_qkv.shape[0]
    y, new_window = causal_conv_ref(conv_state, mixed_qkv, w, dtype)
    y = y.to(dtype)
    q = y[:, :H * K].reshape(T, H, K)
    k = y[:, H * K:2 * H * K].reshape(T, H, K)
    v = y[:, 2 * H * K:].reshape(T, HV, V)
    q = l2norm(q) * K ** -0.5
    k = l2norm(k)
    # Value head j reads key head j // (HV / H): [T, H, K] -> [T, HV, K]
    # (E.g. H 2, HV 4: value heads 0, 1, 2, 3 read key heads 0, 0, 1, 1.)
    q = q.repeat_interleave(HV // H, dim=1)
    k = k.repeat_interleave(HV // H, dim=1)
    g, beta = gdn_gates_ref(a, b, w.A_log, w.dt_bias, dtype)  # [T, HV] each
    S = state.to(dtype).clone()  # [HV, V, K]
    o = torch.empty(T, HV, V, dtype=dtype)
    for t in range(T):
        S = S * torch.exp(g[t])[:, None, None]
        u = beta[t][:, None] * (v[t] - torch.einsum("hvk,hk->hv", S, k[t]))  # [HV, V]
        S = S + u[:, :, None] * k[t][:, None, :]
        o[t] = torch.einsum("hvk,hk->hv", S, q[t])
    return o, S.to(state.dtype), new_window


def replay_commit_ref(checkpoint_state: torch.Tensor, conv_state: torch.Tensor,
                      per_position_inputs: VerifiedBlockInputs,
                      num_accepted: torch.Tensor, weights: GDNWeights
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """The replay commit: rebuild each request's state through exactly its accepted prefix.

    checkpoint_state [R, HV, V, K]: the recurrent state before position 0 of the verified
    block (the one slot the request keeps); conv_state [R, D, W-1]: its conv window then.
    per_position_inputs: the block's pre-conv inputs and gate inputs (`VerifiedBlockInputs`).
    num_accepted [R]: how many positions of the block become history, counted as vLLM
    counts `num_accepted_tokens` (`GPUModelRunner._update_states_after_model_execute`: the
    valid sampled tokens of the step) = accepted drafts + 1, so 1..T_r after a verify;
    0 leaves the request unchanged (padding rows, or nothing scheduled).

    Why "+ 1" counts position 0: the verified block is [the token sampled last step,
    drafts 1 .. T_r - 1]. Position 0 is always history (it was emitted last step but never
    ran through the target), so with `a` drafts accepted positions 0..a are run: `a + 1`
    positions. The correction/bonus token sampled in this step is emitted now and runs
    as position 0 of the next block, so it is not part of this commit. In vLLM's terms the
    committed state is the one its speculative layout keeps in slot `num_accepted - 1`.

    Returns (state [R, HV, V, K] in checkpoint_state's dtype, conv window [R, D, W-1] in
    conv_state's dtype): what running the layer over exactly the committed tokens gives.
    Inputs are not modified.
    """
    qsl = per_position_inputs.query_start_loc.tolist()
    counts = num_accepted.tolist()
    new_states, new_windows = [], []
    for r, n in enumerate(counts):
        start, end = qsl[r], qsl[r + 1]
        assert 0 <= n <= end - start, f"request {r}: {n} accepted of {end - start} positions"
        if n == 0:
            new_states.append(checkpoint_state[r].clone())
            new_windows.append(conv_state[r].clone())
            continue
        rows = slice(start, start + n)
        _, s, cw = gdn_forward_ref(checkpoint_state[r], conv_state[r],
                                   per_position_inputs.mixed_qkv[rows],
                                   per_position_inputs.a[rows], per_position_inputs.b[rows],
                                   weights)
        new_states.append(s)
        new_windows.append(cw)
    return torch.stack(new_states), torch.stack(new_windows)
