"""The serial tail's walk as one Triton kernel, beside its PyTorch reference
(`serial_walk_ref` in `tail.py`, the CPU path).

    R requests, K proposal rows, k candidates per row (16).

`serial_tail_kernel` walks one request per program: K steps, each reading one row
S[r, t, j_{t-1}, :] of the score tables, so the 15 dependent steps cost one launch and
no host round trip (the PyTorch loop launches ~20 small ops per step). Per step, as the
reference does (`serial_tail` in tail.py states the rules):
  greedy (temperature < 1e-5):  j_t = argmax_j S[t, j_{t-1}, j] (first index on ties);
  sampled:  q = vLLM's filters (min-p, top-k, top-p) then softmax of S / T, in float64;
            j_t = #{j : cdf_j <= u_t * cdf_{k-1}} (inverse CDF of the row's uniform).
The uniforms come in as a tensor: the caller draws them (`draw_tail_uniforms` in
tail.py) exactly as the reference draws them, so for the same uniforms the two paths
draw the same candidates. The filters are written without a sort: over k = 16 lanes the
stable ascending rank of a lane is the number of lanes below it (ties: lower index
first), so "the k-th largest" and "the ascending cumulative mass" are [k, k] comparisons.
Cumulative sums run lane by lane in ascending order, as torch's CPU cumsum does; the
softmax sums are reductions whose order differs from torch's, so q agrees with the
reference to float64 rounding (~1e-16) and a draw differs only where u * total falls
within that of a CDF step.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# vLLM's `_SAMPLING_EPS`: a temperature below it is greedy (tail.py re-exports it).
SAMPLING_EPS = 1e-5


@triton.jit
def _softmax64(x, lane_ok):
    """softmax over the real lanes of x [BLOCK_K] float64; -inf and padding lanes -> 0."""
    x = tl.where(lane_ok, x, float("-inf"))
    e = tl.exp(x - tl.max(x, axis=0))
    e = tl.where(lane_ok, e, 0.0)
    return e / tl.sum(e, axis=0)


@triton.jit
def serial_tail_kernel(
    scores_ptr,  # [R, K, k, k]  S, float32 or float64, contiguous
    cand_ids_ptr,  # [R, K, k]  int32 or int64, contiguous
    temperature_ptr,  # [R]
    top_k_ptr,  # [R] int, or None
    top_p_ptr,  # [R], or None
    min_p_ptr,  # [R], or None
    uniforms_ptr,  # [R, >= K] float64 (row stride stride_u)
    draft_ptr,  # [R, K] int64 out: the drafted token ids
    probs_ptr,  # [R, K, k] float32 out: q each draft was drawn from (one-hot if greedy)
    K,
    k,
    stride_u,
    BLOCK_K: tl.constexpr,  # next power of 2 >= k
    HAS_TOP_K: tl.constexpr,
    HAS_TOP_P: tl.constexpr,
    HAS_MIN_P: tl.constexpr,
    SAMPLING_EPS: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64)
    lane = tl.arange(0, BLOCK_K)  # [BLOCK_K] candidate index j
    lane_ok = lane < k
    # [BLOCK_K, BLOCK_K] pair masks: row i (a lane), column j (another lane).
    pair_ok = lane_ok[None, :] & lane_ok[:, None]
    earlier = lane[None, :] < lane[:, None]  # j < i

    temperature = tl.load(temperature_ptr + r).to(tl.float64)
    greedy = temperature < SAMPLING_EPS
    temp = tl.where(greedy, 1.0, temperature)  # greedy rows never divide by it
    if HAS_TOP_K:
        top_k = tl.load(top_k_ptr + r).to(tl.int32)
        top_k = tl.where((top_k <= 0) | (top_k >= k), k, top_k)  # <= 0 or >= k: off
    if HAS_TOP_P:
        top_p = tl.load(top_p_ptr + r).to(tl.float64)
    if HAS_MIN_P:
        min_p = tl.load(min_p_ptr + r).to(tl.float64)

    prev = tl.zeros((), dtype=tl.int32)  # j_{t-1}; 0 stands for the anchor at t = 0
    for t in range(K):
        row_ptr = scores_ptr + ((r * K + t) * k + prev) * k
        row = tl.load(row_ptr + lane, mask=lane_ok, other=float("-inf"))  # [BLOCK_K]
        j_greedy = tl.argmax(row, axis=0, tie_break_left=True).to(tl.int32)

        logits = row.to(tl.float64) / temp  # [BLOCK_K]
        if HAS_MIN_P:
            p = _softmax64(logits, lane_ok)
            logits = tl.where(p < tl.max(p, axis=0) * min_p, float("-inf"), logits)
        if HAS_TOP_K:
            # Keep lane i iff fewer than top_k lanes score above it: the same set as
            # "score >= the top_k-th largest" (ties at the boundary stay).
            above = tl.sum((pair_ok & (logits[None, :] > logits[:, None])).to(tl.int32),
                           axis=1)  # [BLOCK_K]
            logits = tl.where(above < top_k, logits, float("-inf"))
        if HAS_TOP_P:
            # Stable ascending rank; the ascending cumulative mass summed lane by lane.
            below = (logits[None, :] < logits[:, None]) \
                | ((logits[None, :] == logits[:, None]) & earlier)
            rank = tl.sum((pair_ok & below).to(tl.int32), axis=1)  # [BLOCK_K]
            p = _softmax64(logits, lane_ok)
            cum = tl.zeros([BLOCK_K], dtype=tl.float64)
            acc = tl.zeros((), dtype=tl.float64)
            for pos in tl.static_range(BLOCK_K):
                at = lane_ok & (rank == pos)
                acc += tl.sum(tl.where(at, p, 0.0), axis=0)
                cum = tl.where(at, acc, cum)
            drop = (cum <= 1.0 - top_p) & (rank != k - 1)  # the largest always stays
            logits = tl.where(drop, float("-inf"), logits)
        q = _softmax64(logits, lane_ok)  # [BLOCK_K]

        # Inverse CDF; the CDF summed lane by lane in index order (torch's cumsum order).
        cdf = tl.zeros([BLOCK_K], dtype=tl.float64)
        acc = tl.zeros((), dtype=tl.float64)
        for i in tl.static_range(BLOCK_K):
            acc += tl.sum(tl.where(lane == i, q, 0.0), axis=0)
            cdf = tl.where(lane == i, acc, cdf)
        total = tl.sum(tl.where(lane == k - 1, cdf, 0.0), axis=0)
        u = tl.load(uniforms_ptr + r * stride_u + t)
        # An entry of probability 0 has an empty interval; u < 1 keeps j <= k - 1.
        j_sampled = tl.minimum(tl.sum((lane_ok & (cdf <= u * total)).to(tl.int32), axis=0),
                               k - 1)

        j = tl.where(greedy, j_greedy, j_sampled)
        probs = tl.where(greedy, (lane == j).to(tl.float32), q.to(tl.float32))
        tl.store(probs_ptr + (r * K + t) * k + lane, probs, mask=lane_ok)
        draft = tl.load(cand_ids_ptr + (r * K + t) * k + j).to(tl.int64)
        tl.store(draft_ptr + r * K + t, draft)
        prev = j


def serial_tail_fwd(
    scores: torch.Tensor,  # [R, K, k, k] float32 or float64
    cand_ids: torch.Tensor,  # [R, K, k] int
    temperature: torch.Tensor,  # [R]
    top_k: torch.Tensor | None,  # [R] int
    top_p: torch.Tensor | None,  # [R]
    min_p: torch.Tensor | None,  # [R]
    uniforms: torch.Tensor,  # [R, >= K] float64, last dim contiguous
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch `serial_tail_kernel` (grid R, one warp: a program holds [16, 16] lanes).
    Arguments already validated by `serial_tail`.  -> (draft ids [R, K] int64,
    probs [R, K, k] float32)"""
    R, K, k, _ = scores.shape
    assert scores.is_contiguous() and cand_ids.is_contiguous(), "serial_tail_fwd"
    assert uniforms.dtype == torch.float64 and uniforms.stride(-1) == 1
    draft = torch.empty(R, K, dtype=torch.int64, device=scores.device)
    probs = torch.empty(R, K, k, dtype=torch.float32, device=scores.device)
    if R == 0 or K == 0:
        return draft, probs
    serial_tail_kernel[(R,)](
        scores, cand_ids, temperature, top_k, top_p, min_p, uniforms, draft, probs,
        K, k, uniforms.stride(0),
        BLOCK_K=triton.next_power_of_2(k), HAS_TOP_K=top_k is not None,
        HAS_TOP_P=top_p is not None, HAS_MIN_P=min_p is not None,
        SAMPLING_EPS=SAMPLING_EPS, num_warps=1,
    )
    return draft, probs
