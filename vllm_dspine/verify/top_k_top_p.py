"""Top-k / top-p on the verified draft rows: vLLM 0.32.0's CPU result, bit for bit,
without its sort with indices.

vLLM's CPU sampler (`apply_top_k_top_p_pytorch`, the path taken without Triton) sorts
every row of `[rows, vocab]` logits with their indices, masks the sorted rows (top-k by
value, top-p by the cumulative softmax of the sorted values), and scatters them back.
On this project's CPU the whole call costs ~4.6-5.3 ms a row at SmolLM2's 49,152 ids
(one thread; bench/bench_cpu_ops.py), and every verified draft of a sampled request is
a row: at temperature 0.7 / top-p 0.95 verification of 4 drafts cost 26 ms of sampler
beside a ~70 ms target step (docs/verify.md, "Top-p on draft rows").

What the mask depends on is only the sorted *values* of a row: the top-k threshold is
the k-th largest value, and top-p masks the sorted positions j whose cumulative
probability (float32 softmax of the sorted values, then float32 cumsum: the same
kernels on the same numbers as vLLM's) is <= 1 - p, a prefix of the sorted row. So:

  1. sort the values alone (numpy's sort);
  2. apply vLLM's top-k and top-p formulas to them, which gives the first kept sorted
     position j and its value b;
  3. in the row's own order, mask every logit < b (and the top-k ones).

Tokens whose logit equals b straddle the cut when some of them sit before position j:
which of them vLLM keeps then depends on the order its unstable sort gave equal values.
Such rows (and rows with NaN) are handed to vLLM's own function; so are GPU tensors and
calls without top-p (vLLM's top-k-only path does not sort). The result is always
`torch.equal` to vLLM's (tests/test_top_k_top_p.py).
"""

from __future__ import annotations

import numpy as np
import torch

from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p


def apply_top_k_top_p_values_sorted(
    logits: torch.Tensor,  # [rows, vocab] float32, updated in place
    k: torch.Tensor | None,  # [rows] int, or None
    p: torch.Tensor | None,  # [rows] float32, or None
) -> torch.Tensor:
    """vLLM's `apply_top_k_top_p(logits, k, p)`: the same tensor, the same values."""
    if p is None or logits.device.type != "cpu" or logits.dtype != torch.float32 \
            or logits.ndim != 2 or logits.shape[0] == 0:
        return apply_top_k_top_p(logits, k, p)
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
