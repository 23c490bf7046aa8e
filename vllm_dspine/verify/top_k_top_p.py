"""Top-k / top-p on the verified draft rows: vLLM 0.32.0's CPU result, bit for bit,
without its sort with indices, and for most top-p rows without any sort.

vLLM's CPU sampler (`apply_top_k_top_p_pytorch`, the path taken without Triton) sorts
every row of `[rows, vocab]` logits with their indices, masks the sorted rows (top-k by
value, top-p by the cumulative softmax of the sorted values), and scatters them back.
On this project's CPU the whole call costs ~4 ms a row at SmolLM2's 49,152 ids (one
thread; bench/bench_cpu_ops.py), and every verified draft of a sampled request is a
row (docs/verify.md, "Top-p on draft rows").

What the mask depends on is only the sorted *values* of a row: the top-k threshold is
the k-th largest value, and top-p masks the sorted positions j whose cumulative
probability (float32 softmax of the sorted values, then cumsum) is <= 1 - p, a prefix of
the sorted row. Two paths give vLLM's tensor:

  * top-p alone (`_top_p_from_top_values`): the cut almost always falls among a row's
    256 largest values, and the cumulative probability there is 1 minus their share of
    the row's exponentials. Computed in float64 from one `topk` and one sum, it decides
    the cut where both of its neighbours are farther from 1 - p than vLLM's float32
    arithmetic can be from it (a bound; on SmolLM2's own logits the largest deviation
    measured is under 1 % of it, bench/bench_cpu_ops.py); the row then keeps exactly
    its m largest ids.
  * every other row (`_apply_sorted`): sort the values alone (numpy's sort), apply
    vLLM's top-k and top-p formulas to them with the same torch kernels, which gives the
    first kept sorted position j and its value b, then mask every logit < b in the
    row's own order.

Tokens whose logit equals the cut's value on both sides of it: which of them vLLM keeps
depends on the order its unstable sort gave equal values, so such rows (and rows with
NaN) are handed to vLLM's own function; so are GPU tensors and calls without top-p
(vLLM's top-k-only path does not sort). The result is always `torch.equal` to vLLM's
(tests/test_top_k_top_p.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p


# The fast path reads each row's TOP_VALUES largest logits (one `topk`, no sort of the
# row): at temperature 0.7 / top-p 0.95 the cut falls among them for ~99.9 % of the
# target's rows (docs/verify.md, "Top-p on draft rows").
TOP_VALUES = 256
# The error bound's terms (docstring of `_top_p_from_top_values`): float32's and
# float64's unit roundoff; how far a float32 exponential may be from the exact one, in
# units of it (torch's vectorised softmax takes `exp_u20`, 20 units by its name); the
# arguments' magnitude up to which that is counted (smaller exponentials add _TINY_EXP
# each at most); the additions a reduction may make after adding the row in memory order.
_U32 = 2.0 ** -24
_U64 = 2.0 ** -53
_EXP_UNITS = 32.0
_ARG_LIMIT = 64.0
_TINY_EXP = math.exp(-_ARG_LIMIT)
_FINAL_ADDS = 64.0


@dataclass
class TopValuesCut:
    """What `_top_p_from_top_values` found for each row (K = TOP_VALUES)."""

    kept: torch.Tensor  # [rows] int64  ids the cut keeps, the m largest
    decided: torch.Tensor  # [rows] bool  the cut is certain: the row keeps its m largest
    keep_all: torch.Tensor  # [rows] bool  top-p 1.0 and nothing to mask
    top: torch.Tensor  # [rows, K + 1] float32  the largest values, descending
    top_ids: torch.Tensor  # [rows, K + 1] int64  their ids
    cumulative: torch.Tensor  # [rows, K + 1] float64  c_m for m = 0 .. K
    error: torch.Tensor  # [rows, K + 1] float64  how far vLLM's c_m may be from it


def _top_p_from_top_values(
    logits: torch.Tensor,  # [rows, vocab] float32
    p: torch.Tensor,  # [rows] float32
) -> TopValuesCut:
    """vLLM's top-p cut of each row from its largest values alone, where it is certain.

    With m ids kept, vLLM's cumulative probability at the cut is the mass of all but the
    m largest: c_m = 1 - (e_1 + ... + e_m) / S, e_i = exp(x_i - max) in float32 (the
    arguments are the ones vLLM's softmax takes) and S their sum. Here the e_i of the
    TOP_VALUES largest are summed in float64 and S too, and the first m with c_m <= 1 - p
    is taken only where both neighbours of the cut are farther from 1 - p than vLLM's
    float32 value can be from this one. The bound, relative to c_m: each exponential on
    either side within _EXP_UNITS units of roundoff of the exact one (arguments below
    -_ARG_LIMIT add at most _TINY_EXP each), vLLM's division and the cast of its cumsum
    a unit each (its CPU cumsum accumulates float32 in float64), and its float32 sum of
    the sorted row within u (sum over the ascending positions j of the prefix sums C_j +
    _FINAL_ADDS S): the error of any summation that adds the row in memory order into
    one or more partial sums and combines them in at most _FINAL_ADDS further additions,
    as torch's vectorised reduction does. The sum of C_j is the sum of e_i times i's
    rank from the top: exact for the largest, the vocabulary size for the rest. All
    doubled for second-order terms; plus, absolute, the float64 rounding of S and of the
    kept mass, whose difference c_m is (it cancels where little mass is left).
    tests/test_top_k_top_p.py compares the result with vLLM's on rows built to sit at
    the cut.

    Rows not decided: those whose cut is beyond TOP_VALUES, too near 1 - p, between
    equal values, or whose logits hold NaN or +inf.
    """
    rows, vocab = logits.shape
    num_top = min(TOP_VALUES, vocab - 1)
    top, top_ids = logits.topk(num_top + 1, dim=1)  # [rows, num_top + 1] descending
    row_max = top[:, :1]  # [rows, 1]  NaN sorts first in topk, then +inf
    e = (logits - row_max).exp_()  # [rows, vocab]  float32, as vLLM's softmax
    total = e.sum(dim=1, dtype=torch.float64)  # [rows]  S
    e_top = (top[:, :num_top] - row_max).exp_().double()  # [rows, num_top]
    kept_mass = torch.cat([torch.zeros(rows, 1, dtype=torch.float64),
                           e_top.cumsum(dim=1)], dim=1)  # [rows, num_top + 1]
    bottom = (total - kept_mass[:, -1]).clamp_(min=0)  # [rows]  mass past the top ones
    ranks = torch.arange(1, num_top + 1, dtype=torch.float64)
    rank_mass = (e_top * ranks).sum(dim=1) + vocab * bottom  # [rows]  >= sum_j C_j
    rel = 2 * _U32 * (4 * (_EXP_UNITS + _ARG_LIMIT) + 4
                      + (rank_mass + _FINAL_ADDS * total) / total)  # [rows]
    c = (total.unsqueeze(1) - kept_mass) / total.unsqueeze(1)  # [rows, num_top + 1]  c_m
    # + the float64 rounding of S and of the kept mass, absolute in c: c is their
    # difference, which cancels where little mass is left (c ~ 1e-15 on real rows)
    error = (c * rel.unsqueeze(1) + 4 * vocab * _TINY_EXP
             + 2 * (vocab + num_top + 4) * _U64)  # [rows, num_top + 1]
    cut = (1 - p).double().unsqueeze(1)  # [rows, 1]  1 - p as vLLM computes it (float32)
    # m: ids kept, the first m with c_m <= 1 - p (at least one: vLLM keeps the top id).
    m = (c > cut).sum(dim=1).clamp_(min=1)  # [rows]
    m_at = m.clamp(max=num_top).unsqueeze(1)  # [rows, 1]
    below = (c.gather(1, m_at) <= cut - error.gather(1, m_at)).squeeze(1)
    above = ((c.gather(1, m_at - 1) > cut + error.gather(1, m_at - 1)).squeeze(1)
             | (m == 1))
    untied = (top.gather(1, m_at) < top.gather(1, m_at - 1)).squeeze(1)
    decided = (m <= num_top) & below & above & untied & torch.isfinite(row_max.squeeze(1))
    # Top-p 1.0 (a request without it beside ones with it): 1 - p = 0 masks only ids of
    # probability 0, the -inf ones where every finite x - max >= -60 (exp(-60) / vocab
    # is a normal float32): such a row is kept as it is.
    keep_all = torch.zeros(rows, dtype=torch.bool)
    no_cut = ((cut.squeeze(1) == 0) & torch.isfinite(row_max.squeeze(1))).nonzero().squeeze(1)
    if no_cut.numel():
        x = logits[no_cut]  # [n, vocab]
        finite_min = x.masked_fill(~torch.isfinite(x), float("inf")).amin(dim=1)
        keep_all[no_cut] = finite_min >= row_max[no_cut, 0] - 60
    return TopValuesCut(m, decided, keep_all, top, top_ids, c, error)


def apply_top_k_top_p_values_sorted(
    logits: torch.Tensor,  # [rows, vocab] float32, updated in place
    k: torch.Tensor | None,  # [rows] int, or None
    p: torch.Tensor | None,  # [rows] float32, or None
) -> torch.Tensor:
    """vLLM's `apply_top_k_top_p(logits, k, p)`: the same tensor, the same values."""
    if p is None or logits.device.type != "cpu" or logits.dtype != torch.float32 \
            or logits.ndim != 2 or logits.shape[0] == 0:
        return apply_top_k_top_p(logits, k, p)
    if k is not None or logits.shape[1] < 2:
        return _apply_sorted(logits, k, p)
    found = _top_p_from_top_values(logits, p)
    cut_rows = (found.decided & ~found.keep_all).nonzero().squeeze(1)  # [n_cut]
    rest = (~found.decided & ~found.keep_all).nonzero().squeeze(1)  # [n_rest]
    if cut_rows.numel():
        # A decided row keeps exactly its m largest ids (no tie at the cut): -inf, then
        # those m values written back ([n_cut, width], -inf past each row's m).
        m = found.kept[cut_rows]  # [n_cut]
        width = int(m.max())
        ids = found.top_ids[cut_rows, :width]
        kept = found.top[cut_rows, :width].masked_fill(
            torch.arange(width) >= m.unsqueeze(1), float("-inf"))
        if cut_rows.numel() == logits.shape[0]:  # every row: in place
            logits.fill_(float("-inf")).scatter_(1, ids, kept)
        else:
            logits[cut_rows] = logits[cut_rows].fill_(float("-inf")).scatter_(1, ids, kept)
    if rest.numel():  # disjoint from the rows written above; logits[rest] is a copy
        logits[rest] = _apply_sorted(logits[rest], None, p[rest])
    return logits


def _apply_sorted(
    logits: torch.Tensor,  # [rows, vocab] float32, updated in place
    k: torch.Tensor | None,  # [rows] int, or None
    p: torch.Tensor,  # [rows] float32
) -> torch.Tensor:
    """The second path of the module docstring: the values of every row sorted."""
    vocab = logits.shape[1]
    values = torch.from_numpy(np.sort(logits.numpy(), axis=-1))  # [rows, vocab] ascending
    if k is not None:
        # vLLM: the value at sorted position vocab - k; smaller values -> -inf.
        kth = values.gather(1, (vocab - k.to(torch.long)).unsqueeze(1))  # [rows, 1]
        values.masked_fill_(values < kth, float("-inf"))
    probs_sum = values.softmax(dim=-1)
    torch.cumsum(probs_sum, dim=-1, out=probs_sum)  # [rows, vocab], as vLLM computes it
    masked = probs_sum <= 1 - p.unsqueeze(dim=1)  # a prefix of each sorted row
    masked[:, -1] = False
    first_kept = masked.sum(dim=1, keepdim=True)  # [rows, 1]  sorted position j
    # b: every kept value is >= b, every masked one <= b; b >= the top-k threshold
    # (the -inf it left are masked: their cumulative probability is 0 <= 1 - p).
    bound = values.gather(1, first_kept)  # [rows, 1]
    # Rows vLLM's own function must decide: values equal to b on both sides of the cut
    # (its unstable sort's order among them picks which are kept), NaN (sorted last).
    before = values.gather(1, (first_kept - 1).clamp(min=0))  # [rows, 1]
    redo = (((first_kept > 0) & (before == bound)).squeeze(1)
            | torch.isnan(values[:, -1])).nonzero().squeeze(1)  # [n_redo]
    saved = logits[redo] if redo.numel() else None  # a copy (advanced indexing)
    logits.masked_fill_(logits < bound, float("-inf"))
    if saved is not None:
        logits[redo] = apply_top_k_top_p(saved, None if k is None else k[redo], p[redo])
    return logits
