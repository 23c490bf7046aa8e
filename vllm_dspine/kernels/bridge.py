"""Triton kernels of the code bridge (docs/design.md section 1.3), beside `bridge_ref.py`.

    H hidden size, C code width, M message width, V vocabulary size,
    N rows: the blocks of all requests of a step, flattened (see `bridge_ref.py`).

One bridge is four launches; the matrix products are tiled over (row tile, output
tile) so a weight tile is loaded once for a whole tile of rows (`tl.dot` when the row
tile is >= 16 rows):

    bridge_read_kernel         partial R x and sum x^2 over one split of H
                               grid (row tiles, C tiles, H splits)
    bridge_read_finish_kernel  r = RMS(x), z = R x / (r + eps), c = sqrt(C) z / (||z|| + eps);
                               anchor rows: c = sqrt(C) E[a]          grid (row groups)
    bridge_message_kernel      m = sigmoid(G c_t + Gp c_{t-1} + b) * (A c_{t-1}), 0 at anchors
                               grid (row tiles, M tiles)
    bridge_write_kernel        x' = x + r (W m), x unchanged at anchor rows
                               grid (row tiles, H tiles)

The read is split because r and ||z|| need a whole row of x and of z, while the
product is spread over programs; splitting H too keeps many programs streaming R_l at
real size (N = 128 rows: only 2 x 16 (row tile, C tile) programs). The write is split
because W m needs the whole row of m. Partials are summed in a fixed order (no
atomics), so results do not depend on scheduling or on other rows.

The predecessor of row i is row i - 1 unless `is_anchor[i]` (or i == 0): then it is
zero, exactly as in `predecessor_codes`. So no code is read across a block boundary.

Weights may be fp32 or bf16 (or fp16); sums are accumulated in fp32. With 16-bit
weights the activation operand of each matrix product is rounded to the weight dtype
(a tensor-core input); with fp32 weights the product is full fp32 (`ieee`, no TF32).
"""

from __future__ import annotations

import functools
import math
import os

import torch
import triton
import triton.language as tl

from vllm_dspine.kernels.bridge_ref import (
    BridgeWeights,
    bridge_read_ref,
    bridge_write_ref,
)


@triton.jit
def _matmul_acc(acc, a, b, USE_DOT: tl.constexpr, W_FP32: tl.constexpr,
                INTERPRET: tl.constexpr):
    """acc [BN, BO] += a [BN, BK] @ b [BK, BO]; b is a weight tile in its own dtype."""
    if USE_DOT:
        if W_FP32:
            acc += tl.dot(a.to(tl.float32), b, input_precision="ieee")
        elif INTERPRET:
            # The interpreter multiplies the raw bits of 16-bit float dot operands
            # (triton-lang/triton#11584, "not supported yet"); the same products in fp32:
            # a 16-bit x 16-bit product is exact in fp32, so only the summation order differs.
            acc += tl.dot(a.to(b.dtype).to(tl.float32), b.to(tl.float32),
                          input_precision="ieee")
        else:
            acc += tl.dot(a.to(b.dtype), b)
    else:
        acc += tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], axis=1)
    return acc


@triton.jit
def bridge_read_kernel(
    x_ptr,  # [N, H]
    read_weight_ptr,  # [C, H]  R_l
    zpart_ptr,  # [S, N, C] fp32 out: R_l x over split s's H range
    sqpart_ptr,  # [S, N] fp32 out: sum of x^2 over split s's H range
    N,
    H,
    C,
    stride_x,
    stride_w,
    H_PER_SPLIT: tl.constexpr,  # a multiple of BLOCK_H
    BLOCK_N: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_C: tl.constexpr,
    USE_DOT: tl.constexpr,
    W_FP32: tl.constexpr,
    INTERPRET: tl.constexpr,  # running under TRITON_INTERPRET=1
):
    pid_n = tl.program_id(0)
    pid_c = tl.program_id(1)
    pid_s = tl.program_id(2)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    row_mask = rows < N
    cols = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)  # [BLOCK_C]
    col_mask = cols < C

    sumsq = tl.zeros([BLOCK_N], dtype=tl.float32)
    acc = tl.zeros([BLOCK_N, BLOCK_C], dtype=tl.float32)
    h_start = pid_s * H_PER_SPLIT
    for h0 in range(h_start, h_start + H_PER_SPLIT, BLOCK_H):
        hs = h0 + tl.arange(0, BLOCK_H)  # [BLOCK_H]
        h_mask = hs < H
        x = tl.load(x_ptr + rows[:, None] * stride_x + hs[None, :],
                    mask=row_mask[:, None] & h_mask[None, :], other=0.0)  # [BLOCK_N, BLOCK_H]
        xf = x.to(tl.float32)
        sumsq += tl.sum(xf * xf, axis=1)
        w = tl.load(read_weight_ptr + cols[None, :] * stride_w + hs[:, None],
                    mask=h_mask[:, None] & col_mask[None, :], other=0.0)  # [BLOCK_H, BLOCK_C]
        acc = _matmul_acc(acc, x, w, USE_DOT, W_FP32, INTERPRET)

    tl.store(zpart_ptr + (pid_s * N + rows)[:, None] * C + cols[None, :], acc,
             mask=row_mask[:, None] & col_mask[None, :])
    if pid_c == 0:
        tl.store(sqpart_ptr + pid_s * N + rows, sumsq, mask=row_mask)


@triton.jit
def bridge_read_finish_kernel(
    zpart_ptr,  # [S, N, C] fp32
    sqpart_ptr,  # [S, N] fp32
    codebook_ptr,  # [V, C]  E
    token_ids_ptr,  # [N]
    is_anchor_ptr,  # [N] bool (as uint8)
    codes_ptr,  # [N, C] fp32 out
    rms_ptr,  # [N] fp32 out
    N,
    H,
    C,
    stride_e,
    stride_c,
    eps,
    scale,  # sqrt(C)
    NUM_SPLITS: tl.constexpr,
    BLOCK_R: tl.constexpr,  # rows per program
    BLOCK_C: tl.constexpr,  # >= C: a whole code row per program
):
    pid = tl.program_id(0)
    rows = pid * BLOCK_R + tl.arange(0, BLOCK_R)  # [BLOCK_R]
    row_mask = rows < N
    cols = tl.arange(0, BLOCK_C)  # [BLOCK_C]
    col_mask = cols < C
    mask = row_mask[:, None] & col_mask[None, :]
    anchor = tl.load(is_anchor_ptr + rows, mask=row_mask, other=0) != 0  # [BLOCK_R]

    # The H splits are summed in a fixed order: no atomics, the same bits every run.
    sumsq = tl.zeros([BLOCK_R], dtype=tl.float32)
    rx = tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.float32)  # R_l x
    for s in range(NUM_SPLITS):
        sumsq += tl.load(sqpart_ptr + s * N + rows, mask=row_mask, other=0.0)
        rx += tl.load(zpart_ptr + (s * N + rows)[:, None] * C + cols[None, :], mask=mask,
                      other=0.0)
    rms = tl.sqrt(sumsq / H)  # [BLOCK_R]
    z = rx / (rms + eps)[:, None]  # R_l (x / (r + eps)): the scale is per row
    norm = tl.sqrt(tl.sum(z * z, axis=1))  # [BLOCK_R]; masked columns are 0
    code = scale * z / (norm + eps)[:, None]

    # Anchor rows: sqrt(C) * E[token]; token ids of other rows are never read.
    is_a = row_mask & anchor
    tok = tl.load(token_ids_ptr + rows, mask=is_a, other=0).to(tl.int64)  # [BLOCK_R]
    e = tl.load(codebook_ptr + tok[:, None] * stride_e + cols[None, :],
                mask=is_a[:, None] & col_mask[None, :], other=0.0)  # [BLOCK_R, BLOCK_C]
    code = tl.where(anchor[:, None], scale * e.to(tl.float32), code)
    tl.store(codes_ptr + rows[:, None] * stride_c + cols[None, :], code, mask=mask)
    tl.store(rms_ptr + rows, rms, mask=row_mask)


@triton.jit
def bridge_message_kernel(
    codes_ptr,  # [N, C] fp32
    is_anchor_ptr,  # [N]
    gate_recv_ptr,  # [M, C]  G
    gate_pred_ptr,  # [M, C]  Gp
    value_ptr,  # [M, C]  A
    gate_bias_ptr,  # [M]     b
    msg_ptr,  # [N, M] fp32 out
    N,
    C,
    M,
    stride_c,
    stride_g,
    stride_gp,
    stride_a,
    stride_m,
    BLOCK_N: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_C: tl.constexpr,
    USE_DOT: tl.constexpr,
    W_FP32: tl.constexpr,
    INTERPRET: tl.constexpr,  # running under TRITON_INTERPRET=1
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < N
    ms = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = ms < M
    anchor = tl.load(is_anchor_ptr + rows, mask=row_mask, other=0) != 0
    # Row i reads row i - 1 unless it starts a block: never across a block boundary.
    has_pred = row_mask & (rows > 0) & ~anchor  # [BLOCK_N]

    acc_gate = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    acc_value = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for c0 in range(0, C, BLOCK_C):
        cs = c0 + tl.arange(0, BLOCK_C)
        c_mask = cs < C
        recv = tl.load(codes_ptr + rows[:, None] * stride_c + cs[None, :],
                       mask=row_mask[:, None] & c_mask[None, :], other=0.0)  # [BLOCK_N, BLOCK_C]
        pred = tl.load(codes_ptr + (rows - 1)[:, None] * stride_c + cs[None, :],
                       mask=has_pred[:, None] & c_mask[None, :], other=0.0)  # [BLOCK_N, BLOCK_C]
        w_mask = c_mask[:, None] & m_mask[None, :]
        g = tl.load(gate_recv_ptr + ms[None, :] * stride_g + cs[:, None],
                    mask=w_mask, other=0.0)  # [BLOCK_C, BLOCK_M]
        gp = tl.load(gate_pred_ptr + ms[None, :] * stride_gp + cs[:, None],
                     mask=w_mask, other=0.0)
        a = tl.load(value_ptr + ms[None, :] * stride_a + cs[:, None], mask=w_mask, other=0.0)
        acc_gate = _matmul_acc(acc_gate, recv, g, USE_DOT, W_FP32, INTERPRET)
        acc_gate = _matmul_acc(acc_gate, pred, gp, USE_DOT, W_FP32, INTERPRET)
        acc_value = _matmul_acc(acc_value, pred, a, USE_DOT, W_FP32, INTERPRET)

    bias = tl.load(gate_bias_ptr + ms, mask=m_mask, other=0.0).to(tl.float32)  # [BLOCK_M]
    gate = tl.sigmoid(acc_gate + bias[None, :])
    msg = tl.where(anchor[:, None], 0.0, gate * acc_value)  # m_0 = 0
    tl.store(msg_ptr + rows[:, None] * stride_m + ms[None, :], msg,
             mask=row_mask[:, None] & m_mask[None, :])


@triton.jit
def bridge_write_kernel(
    x_ptr,  # [N, H]
    rms_ptr,  # [N] fp32
    msg_ptr,  # [N, M] fp32
    is_anchor_ptr,  # [N]
    write_weight_ptr,  # [H, M]  W_l
    out_ptr,  # [N, H] in x's dtype
    N,
    H,
    M,
    stride_x,
    stride_m,
    stride_w,
    stride_o,
    BLOCK_N: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_M: tl.constexpr,
    USE_DOT: tl.constexpr,
    W_FP32: tl.constexpr,
    INTERPRET: tl.constexpr,  # running under TRITON_INTERPRET=1
):
    pid_n = tl.program_id(0)
    pid_h = tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < N
    hs = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = hs < H
    anchor = tl.load(is_anchor_ptr + rows, mask=row_mask, other=0) != 0

    acc = tl.zeros([BLOCK_N, BLOCK_H], dtype=tl.float32)
    for m0 in range(0, M, BLOCK_M):
        ms = m0 + tl.arange(0, BLOCK_M)
        m_mask = ms < M
        msg = tl.load(msg_ptr + rows[:, None] * stride_m + ms[None, :],
                      mask=row_mask[:, None] & m_mask[None, :], other=0.0)  # [BLOCK_N, BLOCK_M]
        w = tl.load(write_weight_ptr + hs[None, :] * stride_w + ms[:, None],
                    mask=m_mask[:, None] & h_mask[None, :], other=0.0)  # [BLOCK_M, BLOCK_H]
        acc = _matmul_acc(acc, msg, w, USE_DOT, W_FP32, INTERPRET)

    rms = tl.load(rms_ptr + rows, mask=row_mask, other=0.0)  # [BLOCK_N]
    mask = row_mask[:, None] & h_mask[None, :]
    x = tl.load(x_ptr + rows[:, None] * stride_x + hs[None, :], mask=mask, other=0.0)
    new = (x.to(tl.float32) + rms[:, None] * acc).to(x.dtype)
    out = tl.where(anchor[:, None], x, new)  # anchor rows: a bit-exact copy
    tl.store(out_ptr + rows[:, None] * stride_o + hs[None, :], out, mask=mask)


# ----------------------------------------------------------------------------- launchers


def _block_n(N: int, block_n: int | None) -> int:
    """Row tile: 16..64 rows (tl.dot needs >= 16) unless the caller fixes it."""
    if block_n is not None:
        assert block_n >= 1 and block_n & (block_n - 1) == 0, block_n
        return block_n
    return min(64, max(16, triton.next_power_of_2(N)))


def _pow2(n: int, cap: int) -> int:
    return min(cap, max(16, triton.next_power_of_2(n)))


def _is_fp32(w: torch.Tensor) -> bool:
    return w.dtype == torch.float32


def _interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 1  # the interpreter: nothing to fill; tests pass num_splits themselves
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _cuda_sms(index)


@functools.lru_cache(maxsize=None)
def _cuda_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def bridge_read_fwd(
    x: torch.Tensor,  # [N, H]
    read_weight: torch.Tensor,  # [C, H]
    codebook: torch.Tensor,  # [V, C]
    token_ids: torch.Tensor,  # [N]
    is_anchor: torch.Tensor,  # [N] bool
    eps: float,
    block_n: int | None = None,
    block_h: int | None = None,
    block_c: int | None = None,
    num_splits: int | None = None,
    num_sms: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launches the read; returns codes [N, C] fp32 and rms [N] fp32.

    `num_splits` splits H across programs (split-K): with few rows (8 requests x 16)
    there are few (row tile, C tile) programs, and each would stream a long stretch of
    R_l alone. Default: enough splits to give every SM about one program (`num_sms`:
    x's GPU's by default; kernels/aot.py passes a target's when compiling ahead of time).
    """
    assert x.ndim == 2 and x.stride(-1) == 1
    assert read_weight.stride(-1) == 1 and codebook.stride(-1) == 1
    N, H = x.shape
    C = read_weight.shape[0]
    codes = torch.empty(N, C, device=x.device, dtype=torch.float32)  # [N, C]
    rms = torch.empty(N, device=x.device, dtype=torch.float32)  # [N]
    if N == 0:
        return codes, rms
    BLOCK_N = _block_n(N, block_n)
    BLOCK_H = block_h or _pow2(H, 64)
    BLOCK_C = block_c or _pow2(C, 64)
    tiles = triton.cdiv(N, BLOCK_N) * triton.cdiv(C, BLOCK_C)
    h_tiles = triton.cdiv(H, BLOCK_H)
    sms = num_sms or _num_sms(x.device)
    splits = num_splits or max(1, min(h_tiles // 4, sms // tiles))
    splits = max(1, min(splits, h_tiles))
    h_per_split = triton.cdiv(h_tiles, splits) * BLOCK_H
    splits = triton.cdiv(H, h_per_split)  # no empty split
    zpart = torch.empty(splits, N, C, device=x.device, dtype=torch.float32)  # [S, N, C]
    sqpart = torch.empty(splits, N, device=x.device, dtype=torch.float32)  # [S, N]
    bridge_read_kernel[(triton.cdiv(N, BLOCK_N), triton.cdiv(C, BLOCK_C), splits)](
        x, read_weight, zpart, sqpart, N, H, C, x.stride(0), read_weight.stride(0),
        H_PER_SPLIT=h_per_split, BLOCK_N=BLOCK_N, BLOCK_H=BLOCK_H, BLOCK_C=BLOCK_C,
        USE_DOT=BLOCK_N >= 16, W_FP32=_is_fp32(read_weight), INTERPRET=_interpret(),
    )
    BLOCK_CF = triton.next_power_of_2(C)
    BLOCK_R = max(1, min(16, 4096 // BLOCK_CF))
    bridge_read_finish_kernel[(triton.cdiv(N, BLOCK_R),)](
        zpart, sqpart, codebook, token_ids, is_anchor.view(torch.uint8), codes, rms,
        N, H, C, codebook.stride(0), codes.stride(0), eps, math.sqrt(C),
        NUM_SPLITS=splits, BLOCK_R=BLOCK_R, BLOCK_C=BLOCK_CF,
    )
    return codes, rms


def bridge_write_fwd(
    x: torch.Tensor,  # [N, H]
    rms: torch.Tensor,  # [N] fp32
    codes: torch.Tensor,  # [N, C] fp32
    is_anchor: torch.Tensor,  # [N] bool
    gate_recv: torch.Tensor,  # [M, C]
    gate_pred: torch.Tensor,  # [M, C]
    value: torch.Tensor,  # [M, C]
    gate_bias: torch.Tensor,  # [M]
    write_weight: torch.Tensor,  # [H, M]
    block_n: int | None = None,
    block_h: int | None = None,
    block_c: int | None = None,
    block_m: int | None = None,
) -> torch.Tensor:
    """Launches message + write; returns x' [N, H] in x's dtype."""
    assert x.ndim == 2 and x.stride(-1) == 1 and codes.stride(-1) == 1
    for w in (gate_recv, gate_pred, value, write_weight):
        assert w.stride(-1) == 1
    assert rms.dtype == torch.float32 and codes.dtype == torch.float32
    N, H = x.shape
    C = codes.shape[1]
    M = gate_recv.shape[0]
    out = torch.empty_like(x)  # [N, H]
    if N == 0:
        return out
    BLOCK_N = _block_n(N, block_n)
    # The message kernel holds five [BLOCK_N x BLOCK_C] / [BLOCK_C x BLOCK_M] tiles per
    # step and three pipeline stages of them: a C step of 64 needed 112 KiB of shared
    # memory (over sm_89's 99 KiB) and spilled registers there (bench/kernel_compile.py).
    BLOCK_C = block_c or _pow2(C, 32)
    BLOCK_M = block_m or _pow2(M, 64)
    BLOCK_H = block_h or _pow2(H, 64)
    use_dot = BLOCK_N >= 16
    anchor_u8 = is_anchor.view(torch.uint8)  # [N]
    msg = torch.empty(N, M, device=x.device, dtype=torch.float32)  # [N, M]
    bridge_message_kernel[(triton.cdiv(N, BLOCK_N), triton.cdiv(M, BLOCK_M))](
        codes, anchor_u8, gate_recv, gate_pred, value, gate_bias, msg,
        N, C, M, codes.stride(0), gate_recv.stride(0), gate_pred.stride(0), value.stride(0),
        msg.stride(0),
        BLOCK_N=BLOCK_N, BLOCK_M=BLOCK_M, BLOCK_C=BLOCK_C, USE_DOT=use_dot,
        W_FP32=_is_fp32(gate_recv), INTERPRET=_interpret(),
    )
    bridge_write_kernel[(triton.cdiv(N, BLOCK_N), triton.cdiv(H, BLOCK_H))](
        x, rms, msg, anchor_u8, write_weight, out,
        N, H, M, x.stride(0), msg.stride(0), write_weight.stride(0), out.stride(0),
        BLOCK_N=BLOCK_N, BLOCK_H=BLOCK_H, BLOCK_M=BLOCK_M, USE_DOT=use_dot,
        W_FP32=_is_fp32(write_weight), INTERPRET=_interpret(),
    )
    return out


# ----------------------------------------------------------------------------- public


def _use_triton(x: torch.Tensor, use_triton: bool | None) -> bool:
    """CUDA -> Triton, CPU -> reference; `use_triton=True` forces Triton (tests run it
    on CPU tensors under TRITON_INTERPRET=1)."""
    if use_triton is None:
        return x.is_cuda
    if use_triton and not x.is_cuda and not _interpret():
        raise ValueError(
            "bridge: use_triton=True on CPU tensors needs TRITON_INTERPRET=1 set before "
            "triton is imported; move the tensors to CUDA or pass use_triton=None")
    return use_triton


_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _check_2d(name: str, t: torch.Tensor, shape: tuple, float_: bool = True) -> None:
    if t.ndim != 2 or any(want is not None and got != want
                          for got, want in zip(t.shape, shape)):
        dims = ", ".join("?" if s is None else str(s) for s in shape)
        raise ValueError(f"bridge: {name} must have shape [{dims}], got {list(t.shape)}")
    if float_ and t.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"bridge: {name} must be float32, bfloat16 or float16, got {t.dtype}")
    if t.stride(-1) != 1:
        raise ValueError(f"bridge: {name} must have a contiguous last dimension; "
                         f"pass {name}.contiguous()")


def _check_rows(x: torch.Tensor, is_anchor: torch.Tensor, **others: torch.Tensor) -> None:
    N = x.shape[0]
    if is_anchor.dtype != torch.bool or is_anchor.shape != (N,):
        raise ValueError(f"bridge: is_anchor must be a bool tensor of shape [{N}], got "
                         f"{is_anchor.dtype} {list(is_anchor.shape)}")
    for name, t in others.items():
        if t.shape[0] != N:
            raise ValueError(f"bridge: {name} must have {N} rows (one per row of x), got "
                             f"{list(t.shape)}")
    for name, t in dict(is_anchor=is_anchor, **others).items():
        if t.device != x.device:
            raise ValueError(f"bridge: {name} is on {t.device} but x is on {x.device}; "
                             "put every bridge tensor on the same device")


def bridge_read(
    x: torch.Tensor,  # [N, H]
    read_weight: torch.Tensor,  # [C, H]  R_l
    codebook: torch.Tensor,  # [V, C]  E
    token_ids: torch.Tensor,  # [N]     anchor token at anchor rows (others ignored)
    is_anchor: torch.Tensor,  # [N]     bool
    eps: float,
    use_triton: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Bridge read: returns codes [N, C] fp32 and rms [N] fp32 (see `bridge_read_ref`)."""
    _check_2d("x", x, (None, None))
    H = x.shape[1]
    _check_2d("read_weight", read_weight, (None, H))
    C = read_weight.shape[0]
    _check_2d("codebook", codebook, (None, C))
    if token_ids.ndim != 1 or token_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"bridge: token_ids must be a 1-D int32/int64 tensor, got "
                         f"{token_ids.dtype} {list(token_ids.shape)}")
    _check_rows(x, is_anchor, token_ids=token_ids)
    for name, t in (("read_weight", read_weight), ("codebook", codebook)):
        if t.device != x.device:
            raise ValueError(f"bridge: {name} is on {t.device} but x is on {x.device}")
    if not _use_triton(x, use_triton):
        return bridge_read_ref(x, read_weight, codebook, token_ids, is_anchor, eps)
    return bridge_read_fwd(x, read_weight, codebook, token_ids.contiguous(),
                           is_anchor.contiguous(), eps)


def bridge_write(
    x: torch.Tensor,  # [N, H]
    rms: torch.Tensor,  # [N] fp32
    codes: torch.Tensor,  # [N, C] fp32
    is_anchor: torch.Tensor,  # [N] bool
    gate_recv: torch.Tensor,  # [M, C]  G
    gate_pred: torch.Tensor,  # [M, C]  Gp
    value: torch.Tensor,  # [M, C]  A
    gate_bias: torch.Tensor,  # [M]     b
    write_weight: torch.Tensor,  # [H, M]  W_l
    use_triton: bool | None = None,
) -> torch.Tensor:
    """Bridge write: returns x' [N, H] in x's dtype (see `bridge_write_ref`)."""
    _check_2d("x", x, (None, None))
    N, H = x.shape
    _check_2d("codes", codes, (N, None))
    C = codes.shape[1]
    _check_2d("gate_recv", gate_recv, (None, C))
    M = gate_recv.shape[0]
    _check_2d("gate_pred", gate_pred, (M, C))
    _check_2d("value", value, (M, C))
    _check_2d("write_weight", write_weight, (H, M))
    if not gate_recv.dtype == gate_pred.dtype == value.dtype:
        raise ValueError(f"bridge: gate_recv, gate_pred and value must share one dtype, got "
                         f"{gate_recv.dtype}, {gate_pred.dtype}, {value.dtype}; cast them "
                         "together when loading")
    if gate_bias.shape != (M,):
        raise ValueError(f"bridge: gate_bias must have shape [{M}], got {list(gate_bias.shape)}")
    if rms.shape != (N,):
        raise ValueError(f"bridge: rms must have shape [{N}], got {list(rms.shape)}")
    _check_rows(x, is_anchor, rms=rms, codes=codes)
    for name, t in (("gate_recv", gate_recv), ("gate_pred", gate_pred), ("value", value),
                    ("gate_bias", gate_bias), ("write_weight", write_weight)):
        if t.device != x.device:
            raise ValueError(f"bridge: {name} is on {t.device} but x is on {x.device}")
    if not _use_triton(x, use_triton):
        return bridge_write_ref(x, rms, codes, is_anchor, gate_recv, gate_pred, value,
                                gate_bias, write_weight)
    return bridge_write_fwd(x, rms.float().contiguous(), codes.float().contiguous(),
                            is_anchor.contiguous(), gate_recv, gate_pred, value,
                            gate_bias.contiguous(), write_weight)


def code_bridge(
    x: torch.Tensor,  # [N, H]
    layer: int,
    weights: BridgeWeights,
    token_ids: torch.Tensor,  # [N]
    is_anchor: torch.Tensor,  # [N] bool
    use_triton: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One bridge after draft layer `layer`: returns (x' [N, H], codes [N, C], rms [N])."""
    if not 0 <= layer < len(weights.read) or len(weights.write) != len(weights.read):
        raise ValueError(f"bridge: layer {layer} out of range for {len(weights.read)} read "
                         f"and {len(weights.write)} write weights")
    codes, rms = bridge_read(x, weights.read[layer], weights.codebook, token_ids, is_anchor,
                             weights.eps, use_triton)
    x_new = bridge_write(x, rms, codes, is_anchor, weights.gate_recv, weights.gate_pred,
                         weights.value, weights.gate_bias, weights.write[layer], use_triton)
    return x_new, codes, rms
