"""Plain PyTorch reference of exact speculative sampling with a sparse draft q.

This is the CPU path and the oracle of the Triton kernels in `sparse_rejection.py`
(docs/design.md section 1.6). It works in vLLM 0.32.0's flattened layout: the draft tokens of
all requests are concatenated into `num_tokens` rows, request `r` owning rows
`cu_num_draft_tokens[r-1] .. cu_num_draft_tokens[r]-1` (inclusive cumsum, as vLLM's
`SpecDecodeMetadata`). The result is vLLM's `[num_reqs, max_spec_len + 1]` int32 layout:
accepted drafts, then the correction (or bonus) token, then -1.

The draft distribution of a row is sparse: `draft_cand_ids[i]` holds `topk` (16)
distinct token ids (-1 = padding, probability 0) and `draft_cand_probs[i]` their
probabilities; q(v) is the probability of v when v is among the ids, else 0.

Randomness is consumed exactly as vLLM 0.32.0's `rejection_sample` consumes it:
`generate_uniform_probs` (one float64 uniform per draft token, requests with no draft
skipped) and then `generate_inv_exp` (one Exponential(1) sample per request and vocab
entry, reciprocal taken; requests with no draft skip their own generator). The
recovered token of a rejected row is `argmax_v max(p(v) - q(v), 0) * inv_exp[r, v]`,
the Gumbel-max draw from the normalised residual `[p - q]_+` that vLLM's
`sample_recovered_tokens_kernel` makes, so that given the same generators this
reference and vLLM's dense sampler (q scattered dense) emit identical tokens.

Where vLLM's dense kernel is silent or unsafe we decide (docs/verify.md):
  * a draft with q(v) == 0, outside [0, V), or not among its candidates is rejected;
  * NaN target probabilities (a row whose logits are all -inf) count as 0;
  * a residual that is 0 everywhere (p <= q up to rounding) falls back to sampling from
    p with the same exponentials; a p that is 0 everywhere gives token 0, as vLLM's
    own sampler does for such a row.
Only the rejected row of a request is scored over the vocabulary (vLLM scores every
row); the exponentials are shared by all rows of a request, so the tokens are the same.
"""

from __future__ import annotations

import torch

from vllm.v1.sample.rejection_sampler import PLACEHOLDER_TOKEN_ID
from vllm.v1.sample.rejection_sampler import (
    generate_uniform_probs as _vllm_generate_uniform_probs,
)

# Bytes of one [rows, V] score chunk in the recovered-token pass.
_CHUNK_BYTES = 1 << 26


def generate_uniform_probs(
    num_tokens: int,
    num_draft_tokens: list[int],
    generators: dict[int, torch.Generator],
    device: torch.device,
) -> torch.Tensor:
    """vLLM's own `generate_uniform_probs` (plain torch, correct on CPU).

    Returns [num_tokens] float64 in [0, 1): the global RNG for all rows, then the
    request's generator for the rows of a seeded request with at least one draft.
    """
    return _vllm_generate_uniform_probs(
        num_tokens, num_draft_tokens, generators, device
    )


def generate_inv_exp(
    num_draft_tokens: list[int],
    vocab_size: int,
    generators: dict[int, torch.Generator],
    device: torch.device,
    dtype: torch.dtype = torch.float32,
    drafted_only: bool = False,
) -> torch.Tensor:
    """1 / Exponential(1) samples, [num_reqs, vocab_size], drawn as vLLM 0.32.0's
    `sample_recovered_tokens` draws its `inv_q`: one batch draw from the global RNG,
    then each seeded request with at least one draft redraws its own row.

    dtype: float32, or float64 where vLLM's sampler uses fp64 Gumbel noise.

    drafted_only (what serving runs): rows only where they can be read. A request with
    no draft never has a recovered token, so its row holds 1.0 and costs no draws; vLLM
    draws every row (~0.93 ms a row at 49,152 ids on this project's CPU,
    bench_cpu_ops), which at temperature 0.7 and concurrency 8 made any step with one
    draft pay 7.4 ms. Seeded requests with drafts draw their row from their own
    generator as above (the same stream, so the same text for a seed); the unseeded
    ones take one global draw of just their rows. Every row has the same law
    (independent Exponential(1) draws); what changes is how much of the global RNG a
    step consumes, so unseeded tokens are not bitwise vLLM's for the same global seed
    (the default keeps vLLM's order for the tests that compare token for token).
    """
    num_reqs = len(num_draft_tokens)
    if drafted_only:
        exp = torch.ones((num_reqs, vocab_size), dtype=dtype, device=device)
        unseeded = [i for i, n in enumerate(num_draft_tokens)
                    if n > 0 and i not in generators]
        if unseeded:
            # E.g. num_draft_tokens [2, 0, 3], no seeds -> rows 0 and 2 drawn, row 1 = 1.
            exp[torch.tensor(unseeded, dtype=torch.long, device=device)] = torch.empty(
                (len(unseeded), vocab_size), dtype=dtype, device=device).exponential_()
    else:
        exp = torch.empty((num_reqs, vocab_size), dtype=dtype, device=device)
        exp.exponential_()
    for req_idx, generator in generators.items():
        if num_draft_tokens[req_idx] > 0:
            exp[req_idx].exponential_(generator=generator)
    return exp.reciprocal_()


def generate_recovered_uniforms(
    num_draft_tokens: list[int],
    generators: dict[int, torch.Generator],
    device: torch.device,
) -> torch.Tensor:
    """One float64 uniform in [0, 1) per request with drafts, for the recovered token
    drawn by inverse CDF (`sparse_recovered_tokens_inverse_cdf`): [num_reqs].

    Drawn where `generate_inv_exp` draws its rows (after `generate_uniform_probs`): the
    unseeded requests with drafts take one global draw of their count, each seeded one a
    single value from its own generator (so a seed gives the same text run after run).
    Requests without drafts cannot reject; their entry is 0 and never read.
    """
    num_reqs = len(num_draft_tokens)
    out = torch.zeros(num_reqs, dtype=torch.float64, device=device)
    unseeded = [i for i, n in enumerate(num_draft_tokens) if n > 0 and i not in generators]
    if unseeded:
        out[torch.tensor(unseeded, dtype=torch.long, device=device)] = torch.rand(
            len(unseeded), dtype=torch.float64, device=device)
    for req_idx, generator in generators.items():
        if num_draft_tokens[req_idx] > 0:
            out[req_idx] = torch.rand(1, dtype=torch.float64, device=device,
                                      generator=generator)[0]
    return out


def sparse_draft_probs_at(
    token_ids: torch.Tensor,  # [N] int64
    draft_cand_ids: torch.Tensor,  # [N, topk] int64
    draft_cand_probs: torch.Tensor,  # [N, topk] float32
) -> torch.Tensor:
    """q(token) per row from the sparse candidates: [N] float32 (0 when absent).

    The ids of a row are distinct, so at most one term of the sum is non-zero and the
    sum is exact (the same value a dense scatter of q would hold).
    """
    hit = draft_cand_ids == token_ids.unsqueeze(1)  # [N, topk]
    return torch.where(hit, draft_cand_probs, 0.0).sum(dim=1)


def sampled_drafts_accepted(
    drafts: torch.Tensor,  # [N] int64
    draft_cand_ids: torch.Tensor,  # [N, topk] int64
    draft_cand_probs: torch.Tensor,  # [N, topk] float32
    target_probs: torch.Tensor,  # [N, V] float32
    uniform_probs: torch.Tensor,  # [N] float64
) -> torch.Tensor:
    """vLLM's test `p(v) / q(v) >= u` for each row's draft v: [N] bool. A draft outside
    [0, V) or with q(v) == 0 is never accepted."""
    vocab_size = target_probs.shape[1]
    in_vocab = (drafts >= 0) & (drafts < vocab_size)
    q_draft = sparse_draft_probs_at(drafts, draft_cand_ids, draft_cand_probs)
    p_draft = target_probs.gather(1, drafts.clamp(0, vocab_size - 1)[:, None]).squeeze(1)
    # float32 ratio compared with the float64 uniform, as vLLM's kernel does;
    # q == 0 is guarded (never accepted) rather than divided by.
    ratio = p_draft / torch.where(q_draft > 0, q_draft, 1.0)
    return in_vocab & (q_draft > 0) & (ratio >= uniform_probs)


def _residual_rows(
    probs: torch.Tensor,  # [c, V] the rows' p
    ids: torch.Tensor,  # [c, topk] int64, -1 = padding
    q_probs: torch.Tensor,  # [c, topk] float32
) -> torch.Tensor:
    """The dense residual `[p - q]_+` of each row without making q dense: p, with the
    (at most topk) candidate columns replaced by `max(p - q, 0)`: [c, V] float32.
    Padding slots write column 0 with the value it must keep (its own residual where 0
    is a candidate, else p[0]). E.g. ids [5, -1] -> col 5 <- max(p - q, 0), col 0 <- p[0]."""
    vocab_size = probs.shape[1]
    real = (ids >= 0) & (ids < vocab_size)  # [c, topk]
    safe_ids = torch.where(real, ids, 0)  # [c, topk]
    cand = (probs.gather(1, safe_ids) - q_probs).clamp_min(0.0)  # [c, topk]
    zero_cand = real & (ids == 0)
    col0 = torch.where(zero_cand.any(dim=1),
                       torch.where(zero_cand, cand, 0.0).sum(dim=1), probs[:, 0])  # [c]
    return probs.clone().scatter_(1, safe_ids, torch.where(real, cand, col0[:, None]))


def sparse_recovered_tokens_ref(
    token_idx: torch.Tensor,  # [R] int64, rows of the flattened batch to recover
    req_idx: torch.Tensor,  # [R] int64, their requests
    draft_cand_ids: torch.Tensor,  # [num_tokens, topk] int64
    draft_cand_probs: torch.Tensor,  # [num_tokens, topk] float32
    target_probs: torch.Tensor,  # [num_tokens, V] float32
    inv_exp: torch.Tensor,  # [num_reqs, V] float32 or float64
) -> torch.Tensor:
    """argmax_v max(p - q, 0)(v) * inv_exp[req, v] for each given row: [R] int64.

    q is never made dense: every id is scored `p * inv_exp` (the dense residual is p
    where q is 0), then the (at most topk) candidate columns of each row are
    overwritten with `max(p - q, 0) * inv_exp`, bitwise the values vLLM's dense
    kernel forms. Ties go to the lowest id, as in vLLM. Rows whose best score is
    NaN or not positive take `_recovered_tokens_careful`.
    """
    vocab_size = target_probs.shape[1]
    score_dtype = torch.promote_types(target_probs.dtype, inv_exp.dtype)
    out = torch.zeros(token_idx.shape[0], dtype=torch.int64, device=token_idx.device)
    chunk = max(1, _CHUNK_BYTES // (8 * vocab_size))
    for lo in range(0, token_idx.shape[0], chunk):
        rows = token_idx[lo : lo + chunk]  # [c]
        reqs = req_idx[lo : lo + chunk]  # [c]
        # The float32 residual times the exponentials: vLLM's values bit for bit (its
        # kernel forms p - q in float32, then multiplies).
        score = _residual_rows(target_probs[rows], draft_cand_ids[rows],
                               draft_cand_probs[rows]).to(score_dtype)  # [c, V]
        score.mul_(inv_exp[reqs])
        best, token = score.max(dim=1)  # NaN anywhere in a row -> best is NaN
        careful = ~(best > 0)
        if bool(careful.any()):
            token[careful] = _recovered_tokens_careful(
                rows[careful], reqs[careful], draft_cand_ids, draft_cand_probs,
                target_probs, inv_exp,
            )
        out[lo : lo + chunk] = token
    return out


def sparse_recovered_tokens_inverse_cdf(
    token_idx: torch.Tensor,  # [R] int64, rows of the flattened batch to recover
    req_idx: torch.Tensor,  # [R] int64, their requests
    draft_cand_ids: torch.Tensor,  # [num_tokens, topk] int64
    draft_cand_probs: torch.Tensor,  # [num_tokens, topk] float32
    target_probs: torch.Tensor,  # [num_tokens, V] float32
    recovered_uniforms: torch.Tensor,  # [num_reqs] float64 in [0, 1)
) -> torch.Tensor:
    """A draw from the normalised residual `[p - q]_+` of each given row by inverse
    CDF, one uniform per row: [R] int64.

    The same law as the exponential race of `sparse_recovered_tokens_ref` (each id v
    with probability r(v) / sum(r)), for one uniform instead of V exponentials: on a
    2-core CPU torch's `exponential_` costs ~1 ms a row at 49,152 ids, the largest part
    of what a rejected draft added to the sampler (docs/verify.md). The residual is
    formed as the race forms it (p, with the candidate columns replaced by
    `max(p - q, 0)`), NaN counted as 0; its float64 running sum is searched for u times
    its total. Every id where the running sum steps up has r(v) > 0, so an id outside
    the residual's support is never drawn. A residual that is 0 everywhere draws from p
    the same way; a p that is 0 everywhere gives token 0 (the race's fallbacks).
    """
    vocab_size = target_probs.shape[1]
    out = torch.zeros(token_idx.shape[0], dtype=torch.int64, device=token_idx.device)
    chunk = max(1, _CHUNK_BYTES // (8 * vocab_size))
    for lo in range(0, token_idx.shape[0], chunk):
        rows = token_idx[lo : lo + chunk]  # [c]
        probs = torch.nan_to_num(target_probs[rows], nan=0.0)  # [c, V]  a copy
        residual = _residual_rows(probs, draft_cand_ids[rows], draft_cand_probs[rows])
        u = recovered_uniforms[req_idx[lo : lo + chunk]]  # [c] float64
        token = _inverse_cdf(residual, u)  # [c], -1 where the residual is 0
        empty = token < 0
        if bool(empty.any()):
            token[empty] = _inverse_cdf(probs[empty], u[empty]).clamp_min_(0)
        out[lo : lo + chunk] = token
    return out


def _inverse_cdf(
    weights: torch.Tensor,  # [c, V] float32, finite and >= 0
    u: torch.Tensor,  # [c] float64 in [0, 1)
) -> torch.Tensor:
    """The id j of each row with cumsum[j - 1] <= u * total < cumsum[j]: [c] int64,
    -1 for a row whose total is 0."""
    cumulative = weights.cumsum(dim=1, dtype=torch.float64)  # [c, V]
    total = cumulative[:, -1:].contiguous()  # [c, 1]
    token = torch.searchsorted(cumulative, u[:, None] * total, right=True)  # [c, 1]
    # u * total rounds up to total only for u within 2^-53 of 1: take the last id with
    # weight (the first where the running sum reaches the total).
    last = torch.searchsorted(cumulative, total, right=False)  # [c, 1]
    token = torch.minimum(token, last).squeeze(1)
    return torch.where(total.squeeze(1) > 0, token, -1)


def _recovered_tokens_careful(
    rows: torch.Tensor,  # [c] int64
    reqs: torch.Tensor,  # [c] int64
    draft_cand_ids: torch.Tensor,  # [num_tokens, topk]
    draft_cand_probs: torch.Tensor,  # [num_tokens, topk]
    target_probs: torch.Tensor,  # [num_tokens, V]
    inv_exp: torch.Tensor,  # [num_reqs, V]
) -> torch.Tensor:
    """The recovered token where NaN or a vanished residual need care: NaN scores
    count as 0; a residual that is 0 everywhere falls back to sampling from p with
    the same exponentials; p that is 0 (or NaN) everywhere gives token 0."""
    vocab_size = target_probs.shape[1]
    probs = target_probs[rows]  # [c, V]
    exps = inv_exp[reqs]  # [c, V]
    ids = draft_cand_ids[rows]  # [c, topk]
    real = (ids >= 0) & (ids < vocab_size)
    residual = probs.clone()
    # Padding ids point at column 0 and add -0.0, which leaves p[0] unchanged.
    neg_q = torch.where(real, -draft_cand_probs[rows], -0.0)
    residual.scatter_add_(1, torch.where(real, ids, 0), neg_q)
    score = torch.nan_to_num_(
        residual.clamp_min_(0.0) * exps, nan=0.0, posinf=float("inf")
    )  # [c, V]
    best, token = score.max(dim=1)
    empty = ~(best > 0)
    if bool(empty.any()):
        p_score = torch.nan_to_num_(
            probs[empty] * exps[empty], nan=0.0, posinf=float("inf")
        )
        token[empty] = p_score.argmax(dim=1)
    return token


def sparse_rejection_sample_ref(
    draft_token_ids: torch.Tensor,  # [num_tokens] int
    num_draft_tokens: list[int],  # [num_reqs]
    max_spec_len: int,
    cu_num_draft_tokens: torch.Tensor,  # [num_reqs] int32, inclusive cumsum
    draft_cand_ids: torch.Tensor | None,  # [num_tokens, topk] int64
    draft_cand_probs: torch.Tensor | None,  # [num_tokens, topk] float32
    target_probs: torch.Tensor | None,  # [num_tokens, V] float32, processed + softmaxed
    bonus_token_ids: torch.Tensor,  # [num_reqs, 1] int
    is_greedy: torch.Tensor | None,  # [num_reqs] bool; None: every request random
    target_argmax: torch.Tensor | None,  # [num_tokens] int; None: from target_probs
    uniform_probs: torch.Tensor | None,  # [num_tokens] float64
    inv_exp: torch.Tensor | None,  # [num_reqs, V] float32/float64
    recovered_uniforms: torch.Tensor | None = None,  # [num_reqs] float64
) -> torch.Tensor:
    """Exact speculative sampling with a sparse q; returns [num_reqs, max_spec_len + 1]
    int32 tokens, -1 after the correction/bonus token.

    The recovered tokens come from the exponential race with `inv_exp`, or, where
    `recovered_uniforms` is given instead (what serving runs on CPU), by inverse CDF
    with one uniform per request (`sparse_recovered_tokens_inverse_cdf`).

    Greedy requests: accept while draft == target argmax, then emit the argmax; bonus
    when all match. Random requests: accept v with probability min(1, p(v) / q(v))
    (`p / q >= u`, vLLM's test); on the first rejection emit the recovered token
    (see `sparse_recovered_tokens_ref`); bonus when all are accepted.

    target_probs None means an all-greedy batch (then target_argmax is required and
    the draft candidates, uniforms and exponentials are not read).
    """
    num_reqs = len(num_draft_tokens)
    num_tokens = draft_token_ids.shape[0]
    device = draft_token_ids.device
    assert draft_token_ids.ndim == 1
    assert cu_num_draft_tokens.shape == (num_reqs,)
    assert bonus_token_ids.shape[0] == num_reqs
    assert sum(num_draft_tokens) == num_tokens
    assert max(num_draft_tokens, default=0) <= max_spec_len

    output = torch.full(
        (num_reqs, max_spec_len + 1), PLACEHOLDER_TOKEN_ID, dtype=torch.int32,
        device=device,
    )
    if num_reqs == 0:
        return output
    all_greedy = target_probs is None
    if all_greedy:
        assert target_argmax is not None, "an all-greedy batch needs target_argmax"
        is_greedy = torch.ones(num_reqs, dtype=torch.bool, device=device)

    num_drafts = torch.tensor(num_draft_tokens, dtype=torch.int64, device=device)
    # E.g. num_draft_tokens [2, 0, 3] -> token_req [0, 0, 2, 2, 2],
    # token_pos [0, 1, 0, 1, 2].
    token_req = torch.repeat_interleave(
        torch.arange(num_reqs, device=device), num_drafts
    )  # [num_tokens]
    req_start = cu_num_draft_tokens.long() - num_drafts  # [num_reqs]
    token_pos = torch.arange(num_tokens, device=device) - req_start[token_req]
    drafts = draft_token_ids.long()  # [num_tokens]

    token_greedy = (
        torch.zeros(num_tokens, dtype=torch.bool, device=device)
        if is_greedy is None
        else is_greedy.to(device)[token_req]
    )  # [num_tokens]
    any_greedy = is_greedy is not None and bool(is_greedy.any())
    any_random = not all_greedy and (is_greedy is None or not bool(is_greedy.all()))
    if any_greedy and target_argmax is None:
        target_argmax = target_probs.argmax(dim=-1)

    accepted = torch.zeros(num_tokens, dtype=torch.bool, device=device)
    if any_greedy:
        accepted = torch.where(token_greedy, drafts == target_argmax.long(), accepted)
    if any_random:
        assert draft_cand_ids is not None and draft_cand_probs is not None
        assert uniform_probs is not None
        assert (inv_exp is None) != (recovered_uniforms is None)
        random_ok = sampled_drafts_accepted(drafts, draft_cand_ids, draft_cand_probs,
                                            target_probs, uniform_probs)
        accepted = torch.where(token_greedy, accepted, random_ok)

    # Accepted prefix length per request: padded positions count as accepted so the
    # cumulative product runs to max_spec_len, then it is capped at the draft count.
    accept_grid = torch.ones(
        (num_reqs, max(max_spec_len, 1)), dtype=torch.int64, device=device
    )  # [num_reqs, max_spec_len]
    accept_grid[token_req, token_pos] = accepted.long()
    num_accepted = torch.minimum(accept_grid.cumprod(dim=1).sum(dim=1), num_drafts)

    keep = token_pos < num_accepted[token_req]  # [num_tokens]
    output[token_req[keep], token_pos[keep]] = drafts[keep].to(torch.int32)

    all_accepted = num_accepted == num_drafts  # [num_reqs]
    reqs_bonus = all_accepted.nonzero().squeeze(1)
    output[reqs_bonus, num_drafts[reqs_bonus]] = (
        bonus_token_ids.reshape(num_reqs)[reqs_bonus].to(torch.int32)
    )

    rejected = ~all_accepted
    if any_greedy:
        req_g = (rejected & is_greedy.to(device)).nonzero().squeeze(1)
        tok_g = req_start[req_g] + num_accepted[req_g]
        output[req_g, num_accepted[req_g]] = target_argmax.long()[tok_g].to(torch.int32)
    if any_random:
        random_req = (
            rejected if is_greedy is None else rejected & ~is_greedy.to(device)
        )
        req_r = random_req.nonzero().squeeze(1)
        if req_r.numel() > 0:
            tok_r = req_start[req_r] + num_accepted[req_r]
            if recovered_uniforms is not None:
                recovered = sparse_recovered_tokens_inverse_cdf(
                    tok_r, req_r, draft_cand_ids, draft_cand_probs, target_probs,
                    recovered_uniforms,
                )
            else:
                recovered = sparse_recovered_tokens_ref(
                    tok_r, req_r, draft_cand_ids, draft_cand_probs, target_probs,
                    inv_exp,
                )
            output[req_r, num_accepted[req_r]] = recovered.to(torch.int32)
    return output


def sparse_to_dense_probs(
    draft_cand_ids: torch.Tensor,  # [N, topk] int64, -1 = padding
    draft_cand_probs: torch.Tensor,  # [N, topk] float32
    vocab_size: int,
) -> torch.Tensor:
    """q scattered dense: [N, vocab_size] float32 (for vLLM's dense sampler, tests)."""
    real = (draft_cand_ids >= 0) & (draft_cand_ids < vocab_size)
    dense = torch.zeros(
        (draft_cand_ids.shape[0], vocab_size), dtype=torch.float32,
        device=draft_cand_ids.device,
    )
    dense.scatter_add_(
        1, torch.where(real, draft_cand_ids, 0),
        torch.where(real, draft_cand_probs.float(), 0.0),
    )
    return dense
