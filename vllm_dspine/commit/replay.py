"""The GDN replay commit as Triton kernels, beside its reference `gdn_ref.py`.

Letters as in `gdn_ref.py` (R requests, H / HV key / value heads, K / V head dims,
W conv width, D conv channels). After verification each request's state slot still
holds its checkpoint (the state before the verified block); `gdn_replay` rebuilds it, in
place, through the first `num_accepted_tokens[r]` positions of the block:

    gdn_replay_kernel       recurrent state: per (request, value head, V tile) program,
                            load the checkpoint tile S [BV, K], then for each accepted
                            position recompute the conv of its k (whole key head) and v
                            (the tile's channels) from the window and the pre-conv inputs,
                            the gates, and the delta-rule update; store S once.
                            grid (V tiles, R * HV)
    gdn_conv_window_kernel  conv window: the last W - 1 of (checkpoint window, accepted
                            inputs), per (request, channel tile).   grid (R, D tiles)

The state kernel reads the checkpoint window, so the window kernel is launched after it
(same stream). Each program owns its tile and reads all of it before writing, so both
are safe in place. The k conv of a key head is recomputed by each of the HV / H value
heads and V tiles that read it: W multiply-adds per channel per position, small next to
the V x K state update.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from vllm_dspine.commit.gdn_ref import (
    ACTIVATIONS,
    L2NORM_EPS,
    SOFTPLUS_THRESHOLD,
    GDNWeights,
    VerifiedBlockInputs,
    replay_commit_ref,
)


@triton.jit
def _bf16_rtne(x):
    """fp32 -> the nearest bf16 value (ties to even), kept in fp32: how torch and compiled
    Triton round. Triton 3.9's interpreter truncates in `.to(tl.bfloat16)` (its
    `cast_impl` converts fp32 -> bf16 without a rounding mode), so kernels that cast with
    `.to` would differ from the reference by an ulp under TRITON_INTERPRET=1; with this
    they agree bit for bit, and storing the result with `.to(tl.bfloat16)` is exact.
    Finite inputs."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _conv_channels(
    window_ptr, mixed_qkv_ptr, w_tile, bias, bos, t, ch, mask,
    stride_cs_dim, stride_cs_tok, stride_x_tok,
    W: tl.constexpr, BW: tl.constexpr, SILU: tl.constexpr,
):
    """Conv output of block position t on channels `ch` [B], in fp32 after rounding to the
    inputs' dtype. w_tile [BW, B]: the taps' weights (fp32); bias [B] fp32. Taps before
    the block come from the request's checkpoint window."""
    tap = tl.arange(0, BW)
    j = t - (W - 1) + tap  # [BW] block position of each tap; < 0: window column W - 1 + j
    valid = (tap < W)[:, None] & mask[None, :]
    x_win = tl.load(window_ptr + (W - 1 + j)[:, None] * stride_cs_tok
                    + ch[None, :] * stride_cs_dim, mask=valid & (j < 0)[:, None], other=0)
    x_blk = tl.load(mixed_qkv_ptr + (bos + j)[:, None] * stride_x_tok + ch[None, :],
                    mask=valid & (j >= 0)[:, None], other=0)
    prod = w_tile * (x_win.to(tl.float32) + x_blk.to(tl.float32))  # [BW, B]
    # Bias, then the taps oldest to newest, one add each: vLLM's conv kernels' order (a
    # tree sum over the taps could round y to a different bf16 neighbour).
    acc = bias
    for w in tl.static_range(W):
        acc += tl.sum(tl.where(tap[:, None] == w, prod, 0.0), axis=0)
    if SILU:
        acc = acc * tl.sigmoid(acc)
    # vLLM's conv kernels write their output in the inputs' dtype
    if mixed_qkv_ptr.dtype.element_ty == tl.bfloat16:
        return _bf16_rtne(acc)
    return acc.to(mixed_qkv_ptr.dtype.element_ty).to(tl.float32)


@triton.heuristics({"HAS_BIAS": lambda args: args["conv_bias_ptr"] is not None})
@triton.jit
def gdn_replay_kernel(
    ssm_state_ptr,  # [num_slots, HV, V, K] in: checkpoint, out: committed state
    conv_state_ptr,  # [num_slots, D, W-1] (any strides) read: checkpoint window
    mixed_qkv_ptr,  # [num_tokens, D] pre-conv inputs of the verified blocks
    a_ptr,  # [num_tokens, HV]
    b_ptr,  # [num_tokens, HV]
    conv_weight_ptr,  # [D, W]
    conv_bias_ptr,  # [D] or None
    A_log_ptr,  # [HV]
    dt_bias_ptr,  # [HV]
    query_start_loc_ptr,  # [R + 1]
    num_accepted_ptr,  # [R]
    state_indices_ptr,  # [R] slot of each request
    stride_ss_slot, stride_ss_head, stride_ss_v,
    stride_cs_slot, stride_cs_dim, stride_cs_tok,
    stride_x_tok, stride_ab_tok, stride_w_dim,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    W: tl.constexpr, BW: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    SILU: tl.constexpr, L2_EPS: tl.constexpr, SP_THRESHOLD: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
    i_v = tl.program_id(0)
    i_rh = tl.program_id(1)
    i_r = i_rh // HV
    i_hv = i_rh % HV
    i_h = i_hv // (HV // H)  # key head read by this value head

    bos = tl.load(query_start_loc_ptr + i_r).to(tl.int64)
    eos = tl.load(query_start_loc_ptr + i_r + 1).to(tl.int64)
    n = tl.minimum(tl.load(num_accepted_ptr + i_r).to(tl.int64), eos - bos)
    if n <= 0:
        return
    slot = tl.load(state_indices_ptr + i_r).to(tl.int64)

    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    mask_k = o_k < K
    mask_v = o_v < V
    mask_s = mask_v[:, None] & mask_k[None, :]
    ch_k = H * K + i_h * K + o_k  # conv channels of this key head's k
    ch_v = 2 * H * K + i_hv * V + o_v  # conv channels of this tile of v

    p_s = (ssm_state_ptr + slot * stride_ss_slot + i_hv * stride_ss_head
           + o_v[:, None] * stride_ss_v + o_k[None, :])
    s = tl.load(p_s, mask=mask_s, other=0).to(tl.float32)  # [BV, BK]
    neg_a = -tl.exp(tl.load(A_log_ptr + i_hv).to(tl.float32))
    dt_bias = tl.load(dt_bias_ptr + i_hv).to(tl.float32)
    window_ptr = conv_state_ptr + slot * stride_cs_slot
    tap = tl.arange(0, BW)
    w_k = tl.load(conv_weight_ptr + ch_k[None, :] * stride_w_dim + tap[:, None],
                  mask=(tap < W)[:, None] & mask_k[None, :], other=0).to(tl.float32)
    w_v = tl.load(conv_weight_ptr + ch_v[None, :] * stride_w_dim + tap[:, None],
                  mask=(tap < W)[:, None] & mask_v[None, :], other=0).to(tl.float32)
    bias_k = tl.zeros([BK], dtype=tl.float32)
    bias_v = tl.zeros([BV], dtype=tl.float32)
    if HAS_BIAS:
        bias_k += tl.load(conv_bias_ptr + ch_k, mask=mask_k, other=0).to(tl.float32)
        bias_v += tl.load(conv_bias_ptr + ch_v, mask=mask_v, other=0).to(tl.float32)

    for t in range(0, n):
        k = _conv_channels(window_ptr, mixed_qkv_ptr, w_k, bias_k, bos, t, ch_k, mask_k,
                           stride_cs_dim, stride_cs_tok, stride_x_tok, W, BW, SILU)
        v = _conv_channels(window_ptr, mixed_qkv_ptr, w_v, bias_v, bos, t, ch_v, mask_v,
                           stride_cs_dim, stride_cs_tok, stride_x_tok, W, BW, SILU)
        k = k * tl.rsqrt(tl.sum(k * k) + L2_EPS)
        x = tl.load(a_ptr + (bos + t) * stride_ab_tok + i_hv).to(tl.float32) + dt_bias
        softplus = tl.where(x <= SP_THRESHOLD, tl.log(1 + tl.exp(x)), x)
        beta = tl.sigmoid(tl.load(b_ptr + (bos + t) * stride_ab_tok + i_hv).to(tl.float32))
        s *= tl.exp(neg_a * softplus)
        u = (v - tl.sum(s * k[None, :], 1)) * beta  # [BV]
        s += u[:, None] * k[None, :]

    if ssm_state_ptr.dtype.element_ty == tl.bfloat16:
        s = _bf16_rtne(s)
    tl.store(p_s, s.to(ssm_state_ptr.dtype.element_ty), mask=mask_s)


@triton.jit
def gdn_conv_window_kernel(
    conv_state_ptr,  # [num_slots, D, W-1] (any strides) in: checkpoint, out: committed
    mixed_qkv_ptr,  # [num_tokens, D]
    query_start_loc_ptr,  # [R + 1]
    num_accepted_ptr,  # [R]
    state_indices_ptr,  # [R]
    D,
    stride_cs_slot, stride_cs_dim, stride_cs_tok, stride_x_tok,
    W: tl.constexpr, BW: tl.constexpr, BD: tl.constexpr,
):
    i_r = tl.program_id(0)
    i_d = tl.program_id(1)
    bos = tl.load(query_start_loc_ptr + i_r).to(tl.int64)
    eos = tl.load(query_start_loc_ptr + i_r + 1).to(tl.int64)
    n = tl.minimum(tl.load(num_accepted_ptr + i_r).to(tl.int64), eos - bos)
    if n <= 0:
        return
    slot = tl.load(state_indices_ptr + i_r).to(tl.int64)

    o_d = i_d * BD + tl.arange(0, BD)
    col = tl.arange(0, BW)  # new window column c, 0 .. W-2
    mask = (col[:, None] < W - 1) & (o_d[None, :] < D)
    # New column c holds old column c + n while that is inside the old window, else
    # block input n - (W - 1) + c. E.g. W 4, n 2: [w0 w1 w2] -> [w2 x0 x1].
    old_col = col + n
    blk_row = n - (W - 1) + col
    from_old = old_col < W - 1
    base = conv_state_ptr + slot * stride_cs_slot + o_d[None, :] * stride_cs_dim
    x_old = tl.load(base + old_col[:, None] * stride_cs_tok, mask=mask & from_old[:, None],
                    other=0)
    x_blk = tl.load(mixed_qkv_ptr + (bos + blk_row[:, None]) * stride_x_tok + o_d[None, :],
                    mask=mask & ~from_old[:, None], other=0)
    new = tl.where(from_old[:, None], x_old.to(tl.float32), x_blk.to(tl.float32))
    tl.store(base + col[:, None] * stride_cs_tok, new.to(conv_state_ptr.dtype.element_ty),
             mask=mask)


def gdn_replay_fwd(
    ssm_state: torch.Tensor,  # [num_slots, HV, V, K]
    conv_state: torch.Tensor,  # [num_slots, D, W-1]
    inputs: VerifiedBlockInputs,
    num_accepted_tokens: torch.Tensor,  # [R]
    state_indices: torch.Tensor,  # [R]
    weights: GDNWeights,
    block_v: int | None = None,
    block_d: int = 256,
) -> None:
    """Launch both kernels (in place). Arguments already validated by `gdn_replay`."""
    H, HV = weights.num_k_heads, weights.num_v_heads
    K, V, W, D = weights.head_k_dim, weights.head_v_dim, weights.conv_width, weights.conv_dim
    R = num_accepted_tokens.shape[0]
    assert ssm_state.ndim == 4 and ssm_state.stride(-1) == 1
    assert conv_state.ndim == 3
    assert inputs.mixed_qkv.stride(-1) == 1 and inputs.a.stride(-1) == 1
    assert inputs.a.stride(0) == inputs.b.stride(0) and inputs.b.stride(-1) == 1
    conv_weight = weights.conv_weight
    assert conv_weight.stride(-1) == 1
    if R == 0:
        return
    BK = triton.next_power_of_2(K)
    BV = block_v or min(triton.next_power_of_2(V), 32)
    gdn_replay_kernel[(triton.cdiv(V, BV), R * HV)](
        ssm_state, conv_state, inputs.mixed_qkv, inputs.a, inputs.b, conv_weight,
        weights.conv_bias, weights.A_log, weights.dt_bias,
        inputs.query_start_loc, num_accepted_tokens, state_indices,
        ssm_state.stride(0), ssm_state.stride(1), ssm_state.stride(2),
        conv_state.stride(0), conv_state.stride(1), conv_state.stride(2),
        inputs.mixed_qkv.stride(0), inputs.a.stride(0), conv_weight.stride(0),
        H=H, HV=HV, K=K, V=V, W=W, BW=triton.next_power_of_2(W), BK=BK, BV=BV,
        SILU=weights.activation in ("silu", "swish"),
        L2_EPS=L2NORM_EPS, SP_THRESHOLD=SOFTPLUS_THRESHOLD,
    )
    BD = min(triton.next_power_of_2(D), block_d)
    gdn_conv_window_kernel[(R, triton.cdiv(D, BD))](
        conv_state, inputs.mixed_qkv, inputs.query_start_loc, num_accepted_tokens,
        state_indices, D,
        conv_state.stride(0), conv_state.stride(1), conv_state.stride(2),
        inputs.mixed_qkv.stride(0),
        W=W, BW=triton.next_power_of_2(max(W - 1, 1)), BD=BD,
    )


def _interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _use_triton(x: torch.Tensor, use_triton: bool | None) -> bool:
    """CUDA -> Triton, CPU -> reference; `use_triton=True` forces Triton (tests run it on
    CPU tensors under TRITON_INTERPRET=1)."""
    if use_triton is None:
        return x.is_cuda
    if use_triton and not x.is_cuda and not _interpret():
        raise ValueError(
            "gdn_replay: use_triton=True on CPU tensors needs TRITON_INTERPRET=1 set before "
            "triton is imported; move the tensors to CUDA or pass use_triton=None")
    return use_triton


_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_INT_DTYPES = (torch.int32, torch.int64)


def _check(cond: bool, what: str) -> None:
    if not cond:
        raise ValueError(f"gdn_replay: {what}")


def _validate(ssm_state, conv_state, inputs, num_accepted_tokens, state_indices, w) -> None:
    H, HV, K, V, D, W = (w.num_k_heads, w.num_v_heads, w.head_k_dim, w.head_v_dim,
                         w.conv_dim, w.conv_width)
    _check(H > 0 and HV % H == 0,
           f"num_v_heads ({HV}) must be a multiple of num_k_heads ({H})")
    _check(w.activation in ACTIVATIONS,
           f"activation must be one of {ACTIVATIONS}, got {w.activation!r}")
    _check(w.conv_weight.ndim == 2 and w.conv_weight.shape[0] == D and W >= 2,
           f"conv_weight must be [D={D}, W>=2] (view vLLM's [D, 1, W] as [D, W]), got "
           f"{list(w.conv_weight.shape)}")
    if w.conv_bias is not None:
        _check(tuple(w.conv_bias.shape) == (D,),
               f"conv_bias must be None or [{D}], got {list(w.conv_bias.shape)}")
    _check(tuple(w.dt_bias.shape) == (HV,), f"dt_bias must be [{HV}], got "
           f"{list(w.dt_bias.shape)}")
    _check(ssm_state.ndim == 4 and tuple(ssm_state.shape[1:]) == (HV, V, K),
           f"ssm_state must be [num_slots, HV={HV}, V={V}, K={K}] (vLLM's layout), got "
           f"{list(ssm_state.shape)}")
    _check(conv_state.ndim == 3 and tuple(conv_state.shape[1:]) == (D, W - 1),
           f"conv_state must be [num_slots, D={D}, W-1={W - 1}] (transpose vLLM's SD "
           f"layout [num_slots, W-1, D]; a speculative-width window [.., D, W-1+num_spec] "
           f"is not a replay window), got {list(conv_state.shape)}")
    _check(conv_state.shape[0] == ssm_state.shape[0],
           f"conv_state has {conv_state.shape[0]} slots, ssm_state {ssm_state.shape[0]}")
    for name, t in (("ssm_state", ssm_state), ("conv_state", conv_state),
                    ("mixed_qkv", inputs.mixed_qkv), ("a", inputs.a), ("b", inputs.b)):
        _check(t.dtype in _FLOAT_DTYPES + (torch.float64,),
               f"{name} must be a float tensor, got {t.dtype}")
    num_tokens = inputs.mixed_qkv.shape[0]
    _check(inputs.mixed_qkv.ndim == 2 and inputs.mixed_qkv.shape[1] == D,
           f"mixed_qkv must be [num_tokens, D={D}], got {list(inputs.mixed_qkv.shape)}")
    for name, t in (("a", inputs.a), ("b", inputs.b)):
        _check(tuple(t.shape) == (num_tokens, HV),
               f"{name} must be [num_tokens={num_tokens}, HV={HV}], got {list(t.shape)}")
    R = num_accepted_tokens.shape[0] if num_accepted_tokens.ndim == 1 else -1
    _check(R >= 0 and num_accepted_tokens.dtype in _INT_DTYPES,
           f"num_accepted_tokens must be a 1-D int32/int64 tensor, got "
           f"{num_accepted_tokens.dtype} {list(num_accepted_tokens.shape)}")
    qsl = inputs.query_start_loc
    _check(qsl.dtype in _INT_DTYPES and tuple(qsl.shape) == (R + 1,),
           f"query_start_loc must be an int32/int64 tensor [R + 1 = {R + 1}], got "
           f"{qsl.dtype} {list(qsl.shape)}")
    _check(state_indices.dtype in _INT_DTYPES and tuple(state_indices.shape) == (R,),
           f"state_indices must be an int32/int64 tensor [R = {R}], got "
           f"{state_indices.dtype} {list(state_indices.shape)}")
    devices = {t.device for t in (ssm_state, conv_state, inputs.mixed_qkv, inputs.a,
                                  inputs.b, qsl, num_accepted_tokens, state_indices,
                                  w.conv_weight, w.A_log, w.dt_bias)}
    _check(len(devices) == 1, f"all tensors must be on one device, got {sorted(map(str, devices))}")
    if not ssm_state.is_cuda:  # value checks need the values on the host: CPU only
        lens = qsl[1:] - qsl[:-1]
        _check(bool((lens >= 0).all()) and int(qsl[-1]) <= num_tokens,
               f"query_start_loc must be non-decreasing and end at <= {num_tokens}, got "
               f"{qsl.tolist()}")
        bad = (num_accepted_tokens < 0) | (num_accepted_tokens > lens)
        _check(not bool(bad.any()),
               f"num_accepted_tokens must lie in 0 .. query length per request, got "
               f"{num_accepted_tokens.tolist()} for query lengths {lens.tolist()}")
        slots = state_indices.tolist()
        _check(all(0 <= s < ssm_state.shape[0] for s in slots) and len(set(slots)) == R,
               f"state_indices must be distinct slots in 0 .. {ssm_state.shape[0] - 1}, "
               f"got {slots}")


def gdn_replay(
    ssm_state: torch.Tensor,  # [num_slots, HV, V, K]  vLLM's recurrent-state pool
    conv_state: torch.Tensor,  # [num_slots, D, W-1]  vLLM's conv-state pool, DS view
    inputs: VerifiedBlockInputs,
    num_accepted_tokens: torch.Tensor,  # [R] accepted drafts + 1 (0: leave unchanged)
    weights: GDNWeights,
    state_indices: torch.Tensor | None = None,  # [R] slot per request (default 0..R-1)
    use_triton: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Replay commit of one GDN layer, in place on the state pools.

    For each request r, slot `state_indices[r]` of `ssm_state` / `conv_state` holds the
    checkpoint taken before its verified block; afterwards it holds the state and window
    reached by running the layer over exactly positions 0 .. num_accepted_tokens[r] - 1
    of the block (`replay_commit_ref` defines the count). Other slots are untouched.
    CUDA tensors run the Triton kernels, CPU tensors the reference. On CUDA the
    per-request counts are not checked against the query lengths (that would need a
    device sync); the kernels clamp them to 0 .. query length. Returns the two pools.
    """
    R = num_accepted_tokens.shape[0] if num_accepted_tokens.ndim == 1 else 0
    if state_indices is None:
        state_indices = torch.arange(R, device=num_accepted_tokens.device)
    _validate(ssm_state, conv_state, inputs, num_accepted_tokens, state_indices, weights)
    if _use_triton(ssm_state, use_triton):
        gdn_replay_fwd(ssm_state, conv_state, inputs, num_accepted_tokens, state_indices,
                       weights)
        return ssm_state, conv_state
    slots = state_indices.long()
    state, window = replay_commit_ref(ssm_state[slots], conv_state[slots], inputs,
                                      num_accepted_tokens, weights)
    ssm_state[slots] = state
    conv_state[slots] = window
    return ssm_state, conv_state
