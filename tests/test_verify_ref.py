"""Exactness of the sparse rejection sampler reference (vllm_dspine/verify).

Statistical checks draw many independent requests in one vectorised batch, every
request verifying K drafts against the same per-position target p_j, with drafts drawn
from the same per-position sparse q_j. The token at position j of a request is then
distributed as p_j whenever it is emitted (emission of j depends only on positions
< j, which are independent of position j here).
"""

from __future__ import annotations

import math

import pytest
import torch
from scipy import stats

from vllm_dspine.verify import (
    generate_inv_exp,
    generate_uniform_probs,
    sparse_rejection_sample,
    sparse_rejection_sample_ref,
)
from vllm_dspine.verify.synthetic import sample_from_sparse, sparse_q_near

CPU = torch.device("cpu")


def _run_stationary(p, cand_ids, cand_probs, num_reqs, seed, uniform_override=None,
                    recovered="race"):
    """num_reqs requests, each with K = len(p) - 1 drafts; position j uses p[j] and
    the sparse q (cand_ids[j], cand_probs[j]); the bonus is drawn from p[K]. The
    recovered tokens by the exponential race ("race") or by inverse CDF with one uniform
    a request ("inverse_cdf", what the sampler runs on CPU).
    Returns (output [num_reqs, K+1], drafts [num_reqs, K])."""
    g = torch.Generator().manual_seed(seed)
    num_pos, vocab_size = p.shape
    k = num_pos - 1
    ids = cand_ids[:k].repeat(num_reqs, 1)  # [num_reqs*K, topk]
    probs = cand_probs[:k].repeat(num_reqs, 1)
    drafts = sample_from_sparse(ids, probs, g)  # [num_reqs*K]
    target_probs = p[:k].repeat(num_reqs, 1)  # [num_reqs*K, V]
    num_draft_tokens = [k] * num_reqs
    uniform = torch.rand(num_reqs * k, dtype=torch.float64, generator=g)
    if uniform_override is not None:
        uniform = uniform_override(uniform)
    inv_exp, recovered_uniforms = None, None
    if recovered == "race":
        inv_exp = torch.empty(num_reqs, vocab_size).exponential_(generator=g).reciprocal()
    else:
        recovered_uniforms = torch.rand(num_reqs, dtype=torch.float64, generator=g)
    bonus = torch.multinomial(p[k], num_reqs, replacement=True, generator=g)
    out = sparse_rejection_sample_ref(
        drafts, num_draft_tokens, k,
        torch.tensor(num_draft_tokens).cumsum(0).to(torch.int32),
        ids, probs, target_probs, bonus[:, None], None, None, uniform, inv_exp,
        recovered_uniforms=recovered_uniforms,
    )
    return out, drafts.view(num_reqs, k)


def _assert_every_position_follows_p(out, p):
    """At least 1e5 emitted tokens, and each position's tokens distributed as its p
    (chi-square p-value > 1e-3, more than 1,000 tokens a position)."""
    assert int((out >= 0).sum()) >= 100_000
    for j in range(p.shape[0]):
        col = out[:, j]
        tokens = col[col >= 0]
        assert tokens.numel() > 1000, f"position {j} reached too rarely"
        pvalue = _chi2_pvalue(tokens, p[j])
        assert pvalue > 1e-3, f"position {j}: chi-square p-value {pvalue:.2e}"


def _chi2_pvalue(tokens: torch.Tensor, p: torch.Tensor) -> float:
    """Pearson chi-square of the token counts against p; bins expecting < 5 are
    pooled into one. A token outside p's support gives p-value 0."""
    n = tokens.numel()
    counts = torch.bincount(tokens.long(), minlength=p.numel()).double()
    if bool((counts[p == 0] > 0).any()):
        return 0.0
    expected = p.double() * n
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum().view(1)])
    exp = torch.cat([expected[big], expected[~big].sum().view(1)])
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    if obs.numel() < 2:  # one bin holds all of p's mass (and all tokens)
        return 1.0
    exp = exp * obs.sum() / exp.sum()
    return float(stats.chisquare(obs.numpy(), exp.numpy()).pvalue)


def _stationary_inputs(k, vocab_size, seed, top_k_mask=None, top_p_mask=None):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(k + 1, vocab_size, generator=g) * 2.5
    p = logits.softmax(dim=-1)
    if top_k_mask is not None:
        kth = p.topk(top_k_mask, dim=1).values[:, -1:]
        p = torch.where(p >= kth, p, 0.0)
    if top_p_mask is not None:
        sorted_p, order = p.sort(dim=1, descending=True)
        # Keep the smallest prefix whose mass reaches top_p (at least one token).
        drop = sorted_p.cumsum(dim=1) - sorted_p >= top_p_mask
        p = p.scatter(1, order, torch.where(drop, 0.0, sorted_p))
    p = p / p.sum(dim=1, keepdim=True)
    # q near the *unmasked* distribution: it puts mass where the masked p is 0.
    # Small noise keeps acceptance near 0.9 so that late positions are reached.
    ids, probs = sparse_q_near(
        logits.softmax(dim=-1), 16, g, num_top=12, noise=0.25, num_pad=1
    )
    return p, ids, probs


@pytest.mark.parametrize(
    "k, num_reqs, mask",
    [
        pytest.param(3, 40_000, {}, id="K3"),
        pytest.param(15, 14_000, {}, id="K15"),
        pytest.param(7, 20_000, {"top_k_mask": 8}, id="K7-topk8"),
        pytest.param(7, 25_000, {"top_p_mask": 0.9}, id="K7-topp0.9"),
    ],
)
def test_lossless_every_position(k, num_reqs, mask):
    """Every emitted position is distributed as its p (vocab 50, sparse q of 16 with
    one padding slot; >= 1e5 emitted tokens per case). Threshold: a correct sampler
    fails a position with probability 1e-3, the K+1 positions together < 2 %; the
    seeds are fixed, so the outcome is deterministic. A sampler that emitted the
    drafts' q instead (see the next test) gives p-values < 1e-12 here."""
    p, ids, probs = _stationary_inputs(k, 50, seed=1000 + k, **mask)
    out, _ = _run_stationary(p, ids, probs, num_reqs, seed=k)
    _assert_every_position_follows_p(out, p)


def test_chi_square_detects_a_wrong_sampler():
    """The check above can fail: accepting every draft (u = 0) emits q, not p."""
    p, ids, probs = _stationary_inputs(3, 50, seed=1003)
    out, _ = _run_stationary(
        p, ids, probs, 40_000, seed=3, uniform_override=torch.zeros_like
    )
    assert _chi2_pvalue(out[:, 0], p[0]) < 1e-12


def test_acceptance_rate_matches_overlap():
    """P(accept at position j | position j reached) = sum_v min(p_j(v), q_j(v)).
    Binomial; bound 4.5 standard errors per position (false alarm ~1e-5 each)."""
    k = 6
    p, ids, probs = _stationary_inputs(k, 50, seed=77)
    num_reqs = 30_000
    out, drafts = _run_stationary(p, ids, probs, num_reqs, seed=78)
    for j in range(k):
        q_dense = torch.zeros(50).scatter_add_(
            0, ids[j].clamp(min=0), torch.where(ids[j] >= 0, probs[j], 0.0)
        )
        alpha = float(torch.minimum(p[j], q_dense).sum())
        reached = out[:, j] >= 0
        accepted = reached & (out[:, j] == drafts[:, j]) & (out[:, j + 1] >= 0)
        n = int(reached.sum())
        rate = float(accepted.sum()) / n
        se = math.sqrt(alpha * (1 - alpha) / n)
        assert abs(rate - alpha) < 4.5 * se, (j, rate, alpha, se)


def _seeded_run(num_draft_tokens, problem_seed, seeds, global_seed, vocab_size=64):
    from vllm_dspine.verify.synthetic import random_problem

    prob = random_problem(
        num_draft_tokens, vocab_size, torch.Generator().manual_seed(problem_seed)
    )
    gens = {i: torch.Generator().manual_seed(s) for i, s in seeds.items()}
    torch.manual_seed(global_seed)
    uniform = generate_uniform_probs(
        sum(num_draft_tokens), num_draft_tokens, gens, CPU
    )
    inv_exp = generate_inv_exp(num_draft_tokens, vocab_size, gens, CPU)
    return sparse_rejection_sample(
        prob.draft_token_ids, num_draft_tokens, max(num_draft_tokens),
        prob.cu_num_draft_tokens, prob.draft_cand_ids, prob.draft_cand_probs,
        prob.target_probs, prob.bonus_token_ids, None, None, uniform, inv_exp,
    )


def test_seeded_requests_reproduce():
    """Same per-request seeds -> same tokens, whatever the global RNG; the seeded
    requests' rows do not depend on the unseeded ones."""
    nd = [5] * 64
    seeds = {i: 10_000 + i for i in range(64)}
    a = _seeded_run(nd, 5, seeds, global_seed=1)
    b = _seeded_run(nd, 5, seeds, global_seed=2)
    assert torch.equal(a, b)
    other = _seeded_run(nd, 5, {i: 20_000 + i for i in range(64)}, global_seed=1)
    assert not torch.equal(a, other)
    # Unseeded requests follow the global RNG; seeded ones do not.
    half = {i: s for i, s in seeds.items() if i % 2 == 0}
    c = _seeded_run(nd, 5, half, global_seed=1)
    d = _seeded_run(nd, 5, half, global_seed=2)
    assert torch.equal(c[0::2], d[0::2]) and torch.equal(c[0::2], a[0::2])
    assert not torch.equal(c[1::2], d[1::2])


def test_zero_draft_requests_do_not_consume_their_generator():
    """As in vLLM: a request with 0 drafts skips its generator (uniforms and
    exponentials), so it keeps its stream for the next step."""
    g1 = torch.Generator().manual_seed(3)
    g2 = torch.Generator().manual_seed(3)
    generate_uniform_probs(4, [4, 0], {1: g1}, CPU)
    generate_inv_exp([4, 0], 10, {1: g1}, CPU)
    assert torch.equal(g1.get_state(), g2.get_state())


def _greedy(drafts_per_req, argmax_per_req, bonus, vocab_size=10):
    nd = [len(d) for d in drafts_per_req]
    drafts = torch.tensor(sum(drafts_per_req, []), dtype=torch.int64)
    argmax = torch.tensor(sum(argmax_per_req, []), dtype=torch.int64)
    return sparse_rejection_sample(
        drafts, nd, max(nd), torch.tensor(nd).cumsum(0).to(torch.int32),
        None, None, None, torch.tensor(bonus)[:, None], None, argmax, None, None,
    )


def test_greedy_exact():
    out = _greedy(
        [[1, 2, 3], [4, 5], [], [7, 8, 9]],
        [[1, 2, 3], [4, 6], [], [0, 8, 9]],
        [11, 12, 13, 14],
    )
    expected = torch.tensor(
        [[1, 2, 3, 11], [4, 6, -1, -1], [13, -1, -1, -1], [0, -1, -1, -1]],
        dtype=torch.int32,
    )
    assert torch.equal(out, expected)


def test_greedy_and_random_rows_mixed():
    """Greedy rows follow the argmax; random rows with one-hot p accept exactly the
    drafts equal to p's token and emit it on rejection."""
    vocab_size = 8
    nd = [3, 3, 0, 2]
    drafts = torch.tensor([1, 2, 3, 1, 2, 3, 5, 6])
    target_token = torch.tensor([1, 2, 4, 1, 0, 3, 5, 6])
    target_probs = torch.nn.functional.one_hot(target_token, vocab_size).float()
    ids = torch.stack([torch.arange(16) % vocab_size] * 8)
    ids[:, vocab_size:] = -1
    probs = torch.where(ids >= 0, 1.0 / vocab_size, 0.0)
    is_greedy = torch.tensor([True, False, False, True])
    g = torch.Generator().manual_seed(0)
    out = sparse_rejection_sample(
        drafts, nd, 3, torch.tensor(nd).cumsum(0).to(torch.int32), ids, probs,
        target_probs, torch.tensor([[11], [12], [13], [14]]), is_greedy,
        target_token, torch.rand(8, dtype=torch.float64, generator=g),
        generate_inv_exp(nd, vocab_size, {}, CPU),
    )
    expected = torch.tensor(
        [[1, 2, 4, -1], [1, 0, -1, -1], [13, -1, -1, -1], [5, 6, 14, -1]],
        dtype=torch.int32,
    )
    assert torch.equal(out, expected)


def _single(draft, target_probs, ids, probs, uniform=0.5, seed=0):
    """One random request; target_probs [K, V], ids/probs [K, topk]."""
    k = target_probs.shape[0]
    drafts = torch.as_tensor(draft, dtype=torch.int64).reshape(k)
    g = torch.Generator().manual_seed(seed)
    inv_exp = torch.empty(1, target_probs.shape[1]).exponential_(generator=g)
    return sparse_rejection_sample(
        drafts, [k], k, torch.tensor([k], dtype=torch.int32), ids, probs,
        target_probs, torch.tensor([[99]]), None, None,
        torch.full((k,), uniform, dtype=torch.float64), inv_exp.reciprocal(),
    )


@pytest.mark.parametrize(
    "draft, why",
    [
        pytest.param([3, 3], "q(draft) == 0 among the candidates", id="q-zero"),
        pytest.param([5, 3], "draft not among the candidates", id="not-candidate"),
        pytest.param([-1, 3], "padding draft id", id="draft-minus-one"),
        pytest.param([40, 3], "draft id outside the vocabulary", id="draft-oov"),
    ],
)
def test_draft_without_q_is_never_accepted(draft, why):
    """p is one-hot at the draft (ratio would be infinite), u tiny: still rejected,
    so the output stops after the first (correction) token."""
    vocab_size = 32
    target = 3 if draft[0] in (3, -1, 40) else 5
    target_probs = torch.zeros(2, vocab_size)
    target_probs[:, target] = 1.0
    ids = torch.tensor([[3, 7, 9, -1]] * 2)
    probs = torch.tensor([[0.0, 0.5, 0.5, 0.0]] * 2)
    out = _single(draft, target_probs, ids, probs, uniform=1e-12)
    assert out[0, 1] == -1 and out[0, 2] == -1, why
    assert out[0, 0] == target  # the correction comes from [p - q]_+


def test_correction_stays_in_p_support():
    """p is 0 outside {20, 21} (top-k/top-p mask); q has no mass there. Every
    rejection emits 20 or 21; 200 seeds."""
    vocab_size = 64
    target_probs = torch.zeros(1, vocab_size)
    target_probs[0, 20], target_probs[0, 21] = 0.25, 0.75
    ids = torch.tensor([[1, 2, 3, 4]])
    probs = torch.tensor([[0.4, 0.3, 0.2, 0.1]])
    seen = set()
    for seed in range(200):
        out = _single([2], target_probs, ids, probs, uniform=0.3, seed=seed)
        assert out[0, 1] == -1
        seen.add(int(out[0, 0]))
    assert seen == {20, 21}


def test_all_minus_inf_row_and_tiny_probs_give_valid_tokens():
    """A row whose logits are all -inf (softmax NaN) and rows of denormal p and q:
    no crash, every token in [0, V) or -1, the NaN row rejects its draft."""
    vocab_size = 40
    logits = torch.full((3, vocab_size), float("-inf"))
    logits[1, :] = torch.linspace(-200.0, 0.0, vocab_size)  # p down to ~1e-87 -> 0
    logits[2, :] = torch.linspace(-100.0, 0.0, vocab_size)
    target_probs = logits.softmax(dim=-1)
    assert bool(target_probs[0].isnan().all())
    ids = torch.tensor([[0, 1, 2, 39]] * 3)
    probs = torch.tensor([[1e-45, 1e-40, 1.0 - 2e-40, 1e-38]] * 3)
    for seed in range(20):
        out = _single([1, 0, 39], target_probs, ids, probs, uniform=0.5, seed=seed)
        assert bool((((out >= -1) & (out < vocab_size)) | (out == 99)).all())
        assert out[0, 1] == -1  # the NaN row never accepts


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -0.5], ids=["nan", "inf", "neg"])
def test_invalid_q_row_is_verified_as_q_zero(bad):
    """A q row with a NaN/inf/negative entry (a drafter whose weights overflow) must
    not bias the output: its draft is never accepted and the token follows p over the
    whole vocabulary, its 16 candidates included. (Treating the NaN residual of the
    candidates as 0 would never emit them: here they hold ~80 % of p.) 20,000
    one-draft requests, chi-square p-value > 1e-3; the valid rows of the same batch
    still accept their drafts."""
    vocab_size, n = 40, 20_000
    g = torch.Generator().manual_seed(5)
    p = (torch.randn(vocab_size, generator=g) * 1.5).softmax(-1)
    ids = p.topk(16).indices[None].repeat(2 * n, 1)  # [2n, 16] the likeliest 16
    probs = p[ids[0]] / p[ids[0]].sum()
    probs = probs[None].repeat(2 * n, 1)
    probs[:n, 3] = bad  # first half: invalid q rows
    drafts = ids[:, 0].clone()
    nd = [1] * (2 * n)
    out = sparse_rejection_sample(
        drafts, nd, 1, torch.tensor(nd).cumsum(0).to(torch.int32), ids, probs,
        p[None].repeat(2 * n, 1), torch.zeros(2 * n, 1, dtype=torch.long), None, None,
        torch.rand(2 * n, dtype=torch.float64, generator=g),
        torch.empty(2 * n, vocab_size).exponential_(generator=g).reciprocal())
    assert bool((out[:n, 1] == -1).all())  # never accepted: no bonus after it
    assert _chi2_pvalue(out[:n, 0], p) > 1e-3
    assert int((out[n:, 1] >= 0).sum()) > n // 2  # valid rows accept (q ~ p)


def test_vanished_residual_falls_back_to_p():
    """A p that occurs: p = q up to float32 rounding (one ulp lower at the draft, so
    p sums to 1 within 1e-7, as a float32 softmax does) and a uniform above the ratio
    p/q = 1 - 6e-8: the draft is rejected and [p - q]_+ is 0 everywhere, so the token
    is drawn from p (vLLM would emit id 0, which p excludes here). Over 3,000 seeds the
    draws follow p (chi-square, p-value > 1e-3)."""
    vocab_size = 30
    ids = torch.tensor([[4, 9, 17, -1]])
    probs = torch.tensor([[0.5, 0.3, 0.2, 0.0]])
    target_probs = torch.zeros(1, vocab_size)
    target_probs[0, 4] = torch.nextafter(torch.tensor(0.5), torch.tensor(0.0))
    target_probs[0, 9], target_probs[0, 17] = 0.3, 0.2
    assert abs(float(target_probs.double().sum()) - 1.0) < 1e-7
    q_dense = torch.zeros(1, vocab_size).index_put_((torch.zeros(3, dtype=torch.long),
                                                     ids[0, :3]), probs[0, :3])
    assert bool((target_probs - q_dense <= 0).all())  # the residual vanishes
    ratio = float(target_probs[0, 4] / probs[0, 0])
    uniform = (ratio + 1.0) / 2  # above the ratio, below 1
    assert ratio < uniform < 1.0
    tokens = []
    for seed in range(3000):
        out = _single([4], target_probs, ids, probs, uniform=uniform, seed=seed)
        assert out[0, 1] == -1  # rejected: no bonus after the one draft
        tokens.append(int(out[0, 0]))
    assert set(tokens) == {4, 9, 17}
    assert _chi2_pvalue(torch.tensor(tokens), target_probs[0]) > 1e-3


def test_bad_input_raises_value_error():
    drafts = torch.tensor([1, 2, 3])
    with pytest.raises(ValueError, match="sum\\(num_draft_tokens\\)"):
        sparse_rejection_sample(
            drafts, [2], 2, torch.tensor([2], dtype=torch.int32), None, None, None,
            torch.tensor([[0]]), None, torch.tensor([1, 2]), None, None,
        )
    with pytest.raises(ValueError, match="draft_cand_ids"):
        sparse_rejection_sample(
            drafts, [3], 3, torch.tensor([3], dtype=torch.int32), None, None,
            torch.full((3, 10), 0.1), torch.tensor([[0]]), None, None,
            torch.rand(3, dtype=torch.float64), torch.ones(1, 10),
        )


@pytest.mark.parametrize(
    "k, num_reqs, mask",
    [
        pytest.param(3, 40_000, {}, id="K3"),
        pytest.param(7, 25_000, {"top_p_mask": 0.9}, id="K7-topp0.9"),
    ],
)
def test_inverse_cdf_lossless_every_position(k, num_reqs, mask):
    """The sampler's CPU draw of recovered tokens (inverse CDF of [p - q]_+, one uniform
    a request) keeps every emitted position distributed as its p; the cases, sizes and
    threshold of test_lossless_every_position (>= 1e5 emitted tokens a case; a correct
    sampler fails a position with probability 1e-3)."""
    p, ids, probs = _stationary_inputs(k, 50, seed=1000 + k, **mask)
    out, _ = _run_stationary(p, ids, probs, num_reqs, seed=k, recovered="inverse_cdf")
    _assert_every_position_follows_p(out, p)


def test_inverse_cdf_recovered_token_law_and_edges():
    """`sparse_recovered_tokens_inverse_cdf` directly. Law: 200,000 draws of one row's
    recovered token follow the normalised residual [p - q]_+ (chi-square p-value >
    1e-3; at 200,000 draws a 1 % shift of a bin holding 10 % of the mass is 4.5
    standard errors, and an id of zero residual drawn once fails outright). Edges: u = 0
    gives the first id with residual, u just below 1 the last; a vanished residual draws
    from p; a NaN row gives token 0."""
    from vllm_dspine.verify.sparse_rejection_ref import sparse_recovered_tokens_inverse_cdf

    g = torch.Generator().manual_seed(11)
    vocab_size, n = 50, 200_000
    p = (torch.randn(vocab_size, generator=g) * 1.5).softmax(-1)
    p[[3, 30]] = 0.0  # a masked p (top-k/top-p): never drawn
    p = p / p.sum()
    ids = torch.tensor([[5, 7, 3, 11, -1]])
    probs = torch.tensor([[0.3, p[7].item(), 0.1, 0.05, 0.0]])  # q(7) = p(7): r(7) = 0
    residual = p.clone()
    residual[[5, 7, 3, 11]] = (p[[5, 7, 3, 11]] - probs[0, :4]).clamp_min(0)
    residual = residual / residual.sum()
    assert residual[7] == 0 and residual[3] == 0
    u = torch.rand(n, dtype=torch.float64, generator=g)
    tokens = sparse_recovered_tokens_inverse_cdf(
        torch.zeros(n, dtype=torch.long), torch.arange(n), ids, probs, p[None], u)
    assert _chi2_pvalue(tokens, residual) > 1e-3

    positive = (residual > 0).nonzero().squeeze(1)
    edge_u = torch.tensor([0.0, 1.0 - 2.0 ** -53], dtype=torch.float64)
    edge = sparse_recovered_tokens_inverse_cdf(
        torch.zeros(2, dtype=torch.long), torch.arange(2), ids, probs, p[None], edge_u)
    assert edge.tolist() == [int(positive[0]), int(positive[-1])]

    # Vanished residual (q = p on p's whole support): the draw follows p.
    small = torch.tensor([0.0, 0.5, 0.0, 0.3, 0.2])
    q_ids = torch.tensor([[1, 3, 4, -1]])
    q_probs = torch.tensor([[0.5, 0.3, 0.2, 0.0]])
    m = 30_000
    drawn = sparse_recovered_tokens_inverse_cdf(
        torch.zeros(m, dtype=torch.long), torch.arange(m), q_ids, q_probs, small[None],
        torch.rand(m, dtype=torch.float64, generator=g))
    assert _chi2_pvalue(drawn, small) > 1e-3

    nan_row = torch.full((1, vocab_size), float("nan"))
    assert sparse_recovered_tokens_inverse_cdf(
        torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long), ids, probs,
        nan_row, torch.tensor([0.7], dtype=torch.float64)).tolist() == [0]
