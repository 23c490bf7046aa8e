"""Candidate retrieval: FP8 coarse scoring of the whole vocabulary, exact rescoring
(docs/design.md section 1.4).

    N rows to score (num_tokens: proposal rows of all requests), H hidden size,
    V vocabulary size, k = head_topk (16), n = coarse_topk (128).

`retrieve_candidates` is the public entry, and this module is what callers import
(`FP8Head` included); it reads the reference module, never the other way round. The FP8
coarse scores come from `fp8_head_scores_kernel` on CUDA and from `fp8_head_scores_ref`
(retrieval_ref.py) on CPU; `use_triton=True` runs the kernel on CPU tensors under
TRITON_INTERPRET=1 (`use_triton=None`: CUDA -> kernel, CPU -> reference, as in
bridge.py and verify/sparse_rejection.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from vllm_dspine.kernels.retrieval_ref import (
    FP8Head,
    exact_scores_ref,
    fp8_head_scores_ref,
)

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - triton ships with vLLM
    HAS_TRITON = False

__all__ = ["FP8Head", "RETRIEVAL_MODES", "CertifiedCandidates", "bf16_score_error_bound",
           "fp8_matmul_available", "fp8_head_scores", "retrieve_candidates",
           "retrieve_candidates_certified"]

RETRIEVAL_MODES = ("auto", "fp8", "bf16")

# The first compute capability with float8_e4m3fn conversion in Triton (sm_89).
FP8_MIN_CAPABILITY = (8, 9)


if HAS_TRITON:

    @triton.jit
    def fp8_head_scores_kernel(
        x_ptr,  # [N, H]  hidden, bf16 or fp32
        w_ptr,  # [V, H]  float8_e4m3fn head
        scale_ptr,  # [V]  fp32 row scales
        out_ptr,  # [N, V]  fp32 scores
        N, V, H,
        stride_xn, stride_wv, stride_on,
        BLOCK_N: tl.constexpr,
        BLOCK_V: tl.constexpr,
        BLOCK_H: tl.constexpr,
    ):
        """One [BLOCK_N, BLOCK_V] tile of out = x @ (w * scale[:, None]).T, fp32 accumulate.

        The FP8 tile is converted to x's dtype (weight-only FP8: the head is read at half
        the bytes of BF16; the products run in bf16 on tensor cores; under the interpreter
        the launcher passes fp32 x, see `fp8_head_scores`). The row scale is applied once
        per output column after the H loop.
        """
        pid_v = tl.program_id(0)
        pid_n = tl.program_id(1)
        offs_v = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)  # [BLOCK_V]
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
        mask_v = offs_v < V
        mask_n = offs_n < N
        acc = tl.zeros((BLOCK_N, BLOCK_V), dtype=tl.float32)
        for h0 in range(0, H, BLOCK_H):
            offs_h = h0 + tl.arange(0, BLOCK_H)  # [BLOCK_H]
            mask_h = offs_h < H
            x = tl.load(x_ptr + offs_n[:, None] * stride_xn + offs_h[None, :],
                        mask=mask_n[:, None] & mask_h[None, :], other=0.0)  # [BLOCK_N, BLOCK_H]
            w = tl.load(w_ptr + offs_v[:, None] * stride_wv + offs_h[None, :],
                        mask=mask_v[:, None] & mask_h[None, :], other=0.0)  # [BLOCK_V, BLOCK_H]
            acc += tl.dot(x, tl.trans(w.to(x.dtype)))
        scale = tl.load(scale_ptr + offs_v, mask=mask_v, other=0.0)  # [BLOCK_V]
        acc = acc * scale[None, :]
        tl.store(out_ptr + offs_n[:, None] * stride_on + offs_v[None, :], acc,
                 mask=mask_n[:, None] & mask_v[None, :])


def fp8_head_scores_fwd(
    hidden: torch.Tensor,  # [N, H] bf16 or fp32, contiguous
    fp8_head: FP8Head,
    block_n: int | None = None,
    block_v: int | None = None,
    block_h: int | None = None,
    capability: tuple[int, int] | None = None,
) -> torch.Tensor:
    """Launch `fp8_head_scores_kernel`.  -> [N, V] fp32

    capability: the compute capability of the GPU it runs on (default: hidden's CUDA
    device's; kernels/aot.py passes a target's). Below 8.9 it is refused: Triton converts
    float8_e4m3fn only on sm_89 and newer.
    """
    assert HAS_TRITON
    assert hidden.ndim == 2 and hidden.is_contiguous()
    assert fp8_head.weight.is_contiguous() and fp8_head.scale.is_contiguous()
    if capability is None and hidden.is_cuda:
        capability = torch.cuda.get_device_capability(hidden.device)
    if capability is not None and tuple(capability) < FP8_MIN_CAPABILITY:
        major, minor = capability
        raise ValueError(
            f"the FP8 head kernel needs compute capability >= 8.9 (sm_89: L40S, H100 and "
            f"newer); this GPU has {major}.{minor} (sm_{major}{minor}). Use retrieval "
            f"mode 'bf16', or 'auto', which picks it there")
    N, H = hidden.shape
    V = fp8_head.vocab_size
    interpret = hidden.device.type == "cpu"  # CPU tensors run under TRITON_INTERPRET=1
    # tl.dot needs every block dim >= 16. Under the interpreter each program costs a
    # numpy call per op, so few, large tiles are fastest there.
    if block_n is None:
        block_n = 16 if N <= 16 else (64 if N <= 64 else 128)
    if block_v is None:
        block_v = 256 if interpret else 128
    if block_h is None:
        block_h = 128 if interpret else 64
    # The fp32 accumulator tile is spread over the program's threads: 128 x 128 on 4 warps
    # is 128 values a thread, which spilled on sm_89 (bench/kernel_compile.py); 8 warps
    # halve it.
    num_warps = 8 if block_n * block_v >= 128 * 128 else 4
    out = torch.empty(N, V, dtype=torch.float32, device=hidden.device)
    grid = (triton.cdiv(V, block_v), triton.cdiv(N, block_n))
    fp8_head_scores_kernel[grid](
        hidden, fp8_head.weight, fp8_head.scale, out,
        N, V, H,
        hidden.stride(0), fp8_head.weight.stride(0), out.stride(0),
        BLOCK_N=block_n, BLOCK_V=block_v, BLOCK_H=block_h, num_warps=num_warps,
    )
    return out


def fp8_head_scores(
    hidden: torch.Tensor,  # [N, H]
    fp8_head: FP8Head,
    use_triton: bool | None = None,
) -> torch.Tensor:
    """Approximate logits over the whole vocabulary with the FP8 head.  -> [N, V] fp32

    use_triton None: CUDA tensors run the Triton kernel, CPU tensors the dequantizing
    reference; True: the kernel (on CPU tensors under TRITON_INTERPRET=1); False: the
    reference.
    """
    if hidden.ndim != 2 or hidden.shape[1] != fp8_head.hidden_size:
        raise ValueError(f"hidden must be [num_tokens, {fp8_head.hidden_size}], got shape "
                         f"{tuple(hidden.shape)}")
    if hidden.device != fp8_head.weight.device:
        raise ValueError(f"hidden is on {hidden.device} but the FP8 head is on "
                         f"{fp8_head.weight.device}; build FP8Head on the model's device")
    if use_triton is None:
        use_triton = hidden.is_cuda
    if use_triton:
        if not HAS_TRITON:
            raise ValueError("the FP8 head kernel needs triton; install it or use mode='bf16'")
        # Triton 3.9's interpreter computes bf16 tl.dot wrongly (results ~1e10 off, seen
        # here), so off-GPU the kernel runs in fp32; on CUDA bf16 hidden feeds tensor cores.
        keep = hidden.is_cuda and hidden.dtype == torch.bfloat16
        x = hidden if keep else hidden.float()
        return fp8_head_scores_fwd(x.contiguous(), fp8_head)
    return fp8_head_scores_ref(hidden, fp8_head)


def fp8_matmul_available(device: torch.device | str) -> bool:
    """FP8 coarse scoring pays off only where the GPU has FP8 support (sm >= 8.9)."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability(device) >= FP8_MIN_CAPABILITY


def _resolve_mode(mode: str, fp8_head: FP8Head | None, device: torch.device) -> str:
    if mode not in RETRIEVAL_MODES:
        raise ValueError(f"retrieval mode must be one of {RETRIEVAL_MODES}, got {mode!r}")
    if mode == "auto":
        return "fp8" if fp8_head is not None and fp8_matmul_available(device) else "bf16"
    if mode == "fp8" and fp8_head is None:
        raise ValueError("retrieval mode 'fp8' needs an FP8Head; build one at load with "
                         "FP8Head.from_head(head_weight) or use mode='bf16'")
    if mode == "fp8" and device.type == "cuda" and not fp8_matmul_available(device):
        raise ValueError(f"retrieval mode 'fp8' needs a GPU with compute capability >= 8.9 "
                         f"(FP8 conversion in the kernel); {device} has "
                         f"{torch.cuda.get_device_capability(device)}; use 'auto' or 'bf16'")
    return mode


def _sort_by_exact_score(
    hidden: torch.Tensor,  # [N, H]
    head_weight: torch.Tensor,  # [V, H]
    ids: torch.Tensor,  # [N, n]
    keep: int,
) -> torch.Tensor:
    """Rescore `ids` exactly and keep the best `keep`, descending.  -> [N, keep] int64"""
    exact = exact_scores_ref(hidden, head_weight, ids)  # [N, n]
    order = exact.topk(keep, dim=1, sorted=True).indices  # [N, keep]
    return ids.gather(1, order)


def retrieve_candidates(
    final_hidden: torch.Tensor,  # [N, H]  after the final norm
    head_weight: torch.Tensor,  # [V, H]  bf16 or fp32 output head
    head_topk: int,
    coarse_topk: int,
    fp8_head: FP8Head | None = None,
    mode: str = "auto",
    use_triton: bool | None = None,
    coarse_head: torch.Tensor | None = None,  # [V, H] bf16 copy of an fp32 head
    head_matmul: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """The `head_topk` best vocabulary ids per row, sorted by exact score, descending.

    mode "fp8": FP8 scores over the whole vocabulary, keep `coarse_topk`, rescore those
    exactly (the head's values in fp32), keep `head_topk`.  mode "bf16": the same with
    BF16 full-vocabulary scores: the head itself when it is bf16; for an fp32 head its
    bf16 copy `coarse_head` when given (the CPU fast path: an fp32 model on CPU reads
    half the bytes and runs the bf16 GEMM, ~4x faster than fp32 here), else the fp32
    product itself, which is exact and needs no rescoring. The result is the exact top
    `head_topk` unless bf16 rounding pushes one of them below the `coarse_topk`-th.
    `head_matmul`, when given, computes that full-vocabulary product `x @ head_weight.T`
    (`cpu_gemm.FixedWeightMatmul`: vLLM's oneDNN path on CPU, 2.0-2.4x faster than
    torch's at 2-15 rows, bench/bench_cpu_ops.py). `use_triton`: see `fp8_head_scores`.
    mode "auto": "fp8" where an FP8Head is given and the device has FP8 support (CUDA,
    sm >= 8.9), else "bf16".  Returns cand_ids [N, head_topk] int64.
    """
    if final_hidden.ndim != 2 or head_weight.ndim != 2 \
            or final_hidden.shape[1] != head_weight.shape[1]:
        raise ValueError(f"final_hidden [N, H] and head_weight [V, H] must share H; got "
                         f"{tuple(final_hidden.shape)} and {tuple(head_weight.shape)}")
    V = head_weight.shape[0]
    if not 0 < head_topk <= coarse_topk <= V:
        raise ValueError(f"need 0 < head_topk <= coarse_topk <= vocab_size, got head_topk="
                         f"{head_topk}, coarse_topk={coarse_topk}, vocab_size={V}")
    resolved = _resolve_mode(mode, fp8_head, final_hidden.device)
    if resolved == "fp8":
        assert fp8_head is not None
        if fp8_head.weight.shape != head_weight.shape:
            raise ValueError(f"FP8Head is {tuple(fp8_head.weight.shape)} but the head is "
                             f"{tuple(head_weight.shape)}; rebuild it from this head")
        coarse = fp8_head_scores(final_hidden, fp8_head, use_triton)  # [N, V]
        coarse_ids = coarse.topk(coarse_topk, dim=1, sorted=False).indices  # [N, n]
        return _sort_by_exact_score(final_hidden, head_weight, coarse_ids, head_topk)
    # BF16 path: the full-vocabulary product in the head's dtype (what the target's own
    # logits use). Its bf16-rounded scores tie often near the 16th place, so the best
    # `coarse_topk` of them are rescored exactly, as on the FP8 path, and 16 kept.
    if coarse_head is not None and head_weight.dtype == torch.float32:
        if coarse_head.shape != head_weight.shape or coarse_head.dtype != torch.bfloat16:
            raise ValueError(f"coarse_head must be the head's bf16 copy {tuple(head_weight.shape)}"
                             f", got {coarse_head.dtype} {tuple(coarse_head.shape)}")
        coarse = final_hidden.to(torch.bfloat16) @ coarse_head.t()  # [N, V] bf16
        top_ids = coarse.topk(coarse_topk, dim=1, sorted=False).indices  # [N, n]
        return _sort_by_exact_score(final_hidden, head_weight, top_ids, head_topk)
    x = final_hidden.to(head_weight.dtype)
    scores = head_matmul(x) if head_matmul is not None else x @ head_weight.t()  # [N, V]
    if head_weight.dtype == torch.float32 and final_hidden.dtype == torch.float32:
        # An fp32 head's product already is the exact score: no rescoring needed.
        return scores.topk(head_topk, dim=1, sorted=True).indices
    top_ids = scores.topk(coarse_topk, dim=1, sorted=False).indices  # [N, n]
    return _sort_by_exact_score(final_hidden, head_weight, top_ids, head_topk)


# bfloat16 keeps 8 significant bits: rounding to nearest moves a value by at most 2^-8 of it.
BF16_UNIT_ROUNDOFF = 2.0 ** -8
# Slack for the bound's own fp32 arithmetic (a handful of roundings of 2^-24 each).
_BOUND_SLACK = 2.0 ** -20


def _fp32_sum_gamma(terms: int) -> float:
    """gamma_n = n 2^-24 / (1 - n 2^-24): an fp32 sum of n terms, in any order, is within
    gamma_n of the sum of their magnitudes."""
    return terms * 2.0 ** -24 / (1 - terms * 2.0 ** -24)


def bf16_score_error_bound(
    hidden_norm: torch.Tensor,  # [N]  ||x|| (fp32 hidden rows)
    row_norms: torch.Tensor,  # [V]  ||w_v|| of the fp32 head's rows (upper bounds)
    coarse: torch.Tensor,  # [N, V]  the bf16 product's scores, as fp32
    hidden_size: int,
) -> torch.Tensor:
    """An upper bound on |coarse - <x, w_v>| (the exact, real-number score).  -> [N, V]

    The coarse score rounds x and w_v to bf16 (2^-8 each: (2u + u^2) sum|x_i w_i|),
    multiplies exactly in fp32 (8 x 8 significant bits), accumulates H terms in fp32 in
    any order (gamma_H = H 2^-24 / (1 - H 2^-24) of the same sum, whatever the blocking
    of the GEMM), and rounds the result to bf16 (u |coarse| / (1 - u)); sum|x_i w_i| <=
    ||x|| ||w_v|| (Cauchy-Schwarz). Flushing denormal products to zero (AVX512-BF16's
    dot product does) adds at most H 2^-126. `_BOUND_SLACK` covers the rounding of this
    function's own fp32 arithmetic.
    """
    u = BF16_UNIT_ROUNDOFF
    per_norm = (2 * u + u * u) + _fp32_sum_gamma(hidden_size) * (1 + u) ** 2 + _BOUND_SLACK
    per_score = u / (1 - u) + _BOUND_SLACK
    # One [N, V] buffer, updated in place: fresh [N, V] temporaries are fresh pages on
    # every call on CPU (see exact_scores_ref).
    bound = coarse.abs().mul_(per_score).add_(hidden_size * 2.0 ** -126)
    return bound.addr_(hidden_norm * per_norm, row_norms)


@dataclass
class CertifiedCandidates:
    ids: torch.Tensor  # [N, k] int64  the k best ids by exact score, descending
    decided: torch.Tensor  # [N] bool  the first window held them
    scored_whole: int  # rows neither window proved, scored in fp32 whole


def _best_in_window(
    x: torch.Tensor,  # [n, H]
    head_weight: torch.Tensor,  # [V, H]
    coarse: torch.Tensor,  # [n, V]
    head_topk: int,
    window: int,
    row_norms: torch.Tensor,  # [V]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The best `head_topk` of the coarse top `window` by exact score, and whether the
    bound proves them the best of the whole head.  -> ids [n, k], proved [n] bool"""
    H = x.shape[1]
    win_ids = coarse.topk(window, dim=1, sorted=False).indices  # [n, window]
    exact = exact_scores_ref(x, head_weight, win_ids)  # [n, window]
    best = exact.topk(head_topk, dim=1, sorted=True)  # [n, k]
    hidden_norm = x.norm(dim=1)  # [n]
    # Every id outside the window: an upper bound on its exact score.
    upper = bf16_score_error_bound(hidden_norm, row_norms, coarse, H).add_(coarse)  # [n, V]
    upper.scatter_(1, win_ids, float("-inf"))
    # The kept k-th: a lower bound on its exact score (the rescoring's fp32 products and
    # sums, gamma_{H+1} of sum|x_i w_i|).
    gamma = _fp32_sum_gamma(H + 1) + _BOUND_SLACK
    lower = best.values[:, -1] - gamma * hidden_norm * row_norms.max()  # [n]
    return win_ids.gather(1, best.indices), upper.amax(dim=1) < lower


def retrieve_candidates_certified(
    final_hidden: torch.Tensor,  # [N, H]  fp32, after the final norm
    head_weight: torch.Tensor,  # [V, H]  fp32 head
    head_topk: int,
    window: int,
    coarse_matmul: Callable[[torch.Tensor], torch.Tensor],  # bf16 [N, H] -> [N, V]
    row_norms: torch.Tensor,  # [V] fp32  upper bounds on ||head_weight[v]||
    exact_matmul: Callable[[torch.Tensor], torch.Tensor] | None = None,  # fp32 [n, H] -> [n, V]
    wide_window: int = 256,
) -> CertifiedCandidates:
    """The exact top `head_topk` of an fp32 head, from a bf16 product where it proves so.

    The bf16 copy of the head scores the whole vocabulary (`coarse_matmul`: vLLM's oneDNN
    bf16 GEMM on a CPU with native bf16, 2x the fp32 GEMM's speed); the best `window` of
    those scores are rescored exactly and the best `head_topk` of them kept. A row is
    proved when every id outside the window, at its coarse score plus its error bound
    (`bf16_score_error_bound`), stays below the kept `head_topk`-th exact score less the
    rescoring's own fp32 error: then no id outside the window can be among the best, and
    the result is the fp32 product's top `head_topk` (up to fp32 near-ties, as between any
    two fp32 summation orders). Rows the window does not prove try `wide_window`, and
    rows that does not prove either are scored in fp32 over the whole head
    (`exact_matmul`, default `x @ head_weight.T`).
    """
    N, H = final_hidden.shape
    V = head_weight.shape[0]
    if not 0 < head_topk <= window <= V:
        raise ValueError(f"need 0 < head_topk <= window <= vocab_size, got head_topk="
                         f"{head_topk}, window={window}, vocab_size={V}")
    if final_hidden.dtype != torch.float32 or head_weight.dtype != torch.float32:
        raise ValueError(f"the certified path scores an fp32 head with fp32 hidden rows, got "
                         f"{final_hidden.dtype} rows and a {head_weight.dtype} head")
    x = final_hidden
    coarse = coarse_matmul(x.to(torch.bfloat16)).float()  # [N, V]
    ids, decided = _best_in_window(x, head_weight, coarse, head_topk, window, row_norms)
    scored_whole = 0
    if not bool(decided.all()):
        rows = (~decided).nonzero().squeeze(1)  # [n]
        wide = min(max(wide_window, window), V)
        if wide > window:
            wide_ids, proved = _best_in_window(x[rows], head_weight, coarse[rows], head_topk,
                                               wide, row_norms)
            ids[rows] = wide_ids
            rows = rows[~proved]
        if rows.numel():
            xs = x[rows]
            full = exact_matmul(xs) if exact_matmul is not None else xs @ head_weight.t()
            ids[rows] = full.topk(head_topk, dim=1, sorted=True).indices  # [n, k]
            scored_whole = int(rows.numel())
    return CertifiedCandidates(ids=ids, decided=decided, scored_whole=scored_whole)
