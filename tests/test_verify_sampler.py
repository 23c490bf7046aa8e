"""SparseRejectionSampler against vLLM 0.32.0's RejectionSampler (dense q).

vLLM's CPU `expand_batch_to_tokens` returns garbage for float inputs (docs/measured.md),
so the vLLM side runs with that one function replaced by a correct expansion; all
else (bonus sampling, logits processors, penalties, top-k/top-p, the C++ rejection
kernels, logprobs) is vLLM's own. Min-p and logit bias, which vLLM's rejection
sampler does not apply to draft rows, are checked against vLLM's per-row formulas.
"""

from __future__ import annotations

import pytest
import torch

import vllm.v1.sample.rejection_sampler as vllm_rs
from vllm.platforms.cpu import CpuPlatform
from vllm.v1.sample.logits_processor import LogitsProcessors
from vllm.v1.sample.logits_processor.builtin import (
    LogitBiasLogitsProcessor,
    MinPLogitsProcessor,
)
from vllm.v1.sample.metadata import SamplingMetadata
from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p
from vllm.v1.sample.sampler import Sampler
from vllm.v1.spec_decode.metadata import SpecDecodeMetadata

from vllm_dspine.verify import SparseDraftProbs, SparseRejectionSampler
from vllm_dspine.verify.sampler import (
    apply_draft_sampling_constraints,
    apply_logit_bias_to_drafts,
)
from vllm_dspine.verify.sparse_rejection_ref import generate_inv_exp
from vllm_dspine.verify.synthetic import sample_from_sparse, sparse_q_near


CPU = torch.device("cpu")


@pytest.fixture(scope="module", autouse=True)
def _vllm_cpu_kernels():
    CpuPlatform.import_kernels()
    CpuPlatform.register_triton_kernel_overrides()


def _expand_fixed(x, cu_num_tokens, num_tokens, replace_from=0, replace_to=0):
    counts = torch.diff(cu_num_tokens.long(), prepend=cu_num_tokens.new_zeros(1).long())
    x = torch.where(x == replace_from, torch.as_tensor(replace_to, dtype=x.dtype), x)
    out = torch.repeat_interleave(x, counts)
    assert out.shape[0] == num_tokens
    return out


def _spec_metadata(drafts: list[list[int]]) -> SpecDecodeMetadata:
    """Logits rows: each request's draft rows, then its bonus row.
    E.g. drafts [[a, b], [], [c]] -> rows [a, b, bonus0, bonus1, c, bonus2]."""
    num_draft_tokens = [len(d) for d in drafts]
    target, bonus, row = [], [], 0
    for n in num_draft_tokens:
        target.extend(range(row, row + n))
        bonus.append(row + n)
        row += n + 1
    return SpecDecodeMetadata(
        draft_token_ids=torch.tensor(sum(drafts, []), dtype=torch.int32),
        num_draft_tokens=num_draft_tokens,
        cu_num_draft_tokens=torch.tensor(num_draft_tokens).cumsum(0).to(torch.int32),
        cu_num_sampled_tokens=torch.tensor([n + 1 for n in num_draft_tokens])
        .cumsum(0)
        .to(torch.int32),
        target_logits_indices=torch.tensor(target, dtype=torch.int32),
        bonus_logits_indices=torch.tensor(bonus, dtype=torch.int32),
        logits_indices=torch.arange(row, dtype=torch.int32),
    )


def _sampling_metadata(temperatures, vocab_size, generators, top_k=None, top_p=None,
                       penalties=False, drafts=None, max_num_logprobs=None,
                       logitsprocs=None):
    num_reqs = len(temperatures)
    temperature = torch.tensor(temperatures, dtype=torch.float32)
    prompt = torch.randint(0, vocab_size, (num_reqs, 6), generator=torch.Generator())
    return SamplingMetadata(
        temperature=temperature,
        all_greedy=bool((temperature == 0).all()),
        all_random=bool((temperature != 0).all()),
        top_p=top_p,
        top_k=top_k,
        generators=generators,
        max_num_logprobs=max_num_logprobs,
        no_penalties=not penalties,
        prompt_token_ids=prompt if penalties else None,
        frequency_penalties=torch.full((num_reqs,), 0.3 if penalties else 0.0),
        presence_penalties=torch.full((num_reqs,), 0.2 if penalties else 0.0),
        repetition_penalties=torch.full((num_reqs,), 1.3 if penalties else 1.0),
        output_token_ids=[[1, 2, 3] for _ in range(num_reqs)],
        allowed_token_ids_mask=None,
        bad_words_token_ids={},
        logitsprocs=logitsprocs or LogitsProcessors(),
        spec_token_ids=drafts,
    )


def _batch(num_draft_tokens, vocab_size, seed):
    """Logits for draft + bonus rows, a sparse q near softmax(logits), drafts ~ q."""
    g = torch.Generator().manual_seed(seed)
    num_rows = sum(num_draft_tokens) + len(num_draft_tokens)
    logits = torch.randn(num_rows, vocab_size, generator=g) * 2.0
    meta0 = _spec_metadata([[0] * n for n in num_draft_tokens])
    target_rows = meta0.target_logits_indices.long()
    ids, probs = sparse_q_near(logits[target_rows].softmax(-1), 16, g, num_pad=1)
    flat = sample_from_sparse(ids, probs, g).tolist()
    drafts, start = [], 0
    for n in num_draft_tokens:
        drafts.append(flat[start : start + n])
        start += n
    return logits, _spec_metadata(drafts), drafts, SparseDraftProbs(ids, probs)


CASES = [
    pytest.param({}, id="plain"),
    pytest.param({"top_k": True}, id="top-k"),
    pytest.param({"top_p": True}, id="top-p"),
    pytest.param({"top_k": True, "top_p": True, "penalties": True}, id="all"),
    pytest.param({"max_num_logprobs": 3}, id="logprobs"),
]


@pytest.mark.parametrize("opts", CASES)
def test_matches_vllm_rejection_sampler(opts, monkeypatch):
    monkeypatch.setattr(vllm_rs, "expand_batch_to_tokens", _expand_fixed)
    # Token for token needs vLLM's draws of the global RNG: serving draws one uniform
    # per drafted request instead (test_recovered_by_inverse_cdf_in_the_sampler).
    monkeypatch.setattr(SparseRejectionSampler, "recovered_draw", "vllm")
    # vLLM's logprob ranks go through torch.compile (~50 s to compile here); eager
    # gives the same numbers.
    with torch._dynamo.config.patch(disable=True):
        _compare_with_vllm(opts)


def _compare_with_vllm(opts):
    num_draft_tokens = [15, 4, 0, 15, 7, 1, 15, 3]
    vocab_size = 300
    temperatures = [0.7, 1.0, 1.3, 0.0, 0.5, 1.0, 0.0, 2.0]
    num_reqs = len(num_draft_tokens)
    logits, meta, drafts, q = _batch(num_draft_tokens, vocab_size, seed=11)
    top_k = torch.tensor([5, 20, 300, 8, 50, 2, 300, 30]) if opts.get("top_k") else None
    top_p = (
        torch.tensor([0.9, 0.5, 1.0, 0.8, 0.95, 0.7, 1.0, 0.99])
        if opts.get("top_p") else None
    )
    vllm_sampler = vllm_rs.RejectionSampler(Sampler())
    ours = SparseRejectionSampler(Sampler())
    dense_q = q.to_dense(vocab_size)
    num_rejections = 0
    for trial in range(3):
        seeds = {i: 77 * trial + i for i in range(num_reqs) if i % 2 == 0}
        outs = []
        for sampler, draft_args in ((vllm_sampler, (dense_q,)),
                                    (ours, (q.cand_ids, q.cand_probs))):
            torch.manual_seed(trial)
            gens = {i: torch.Generator().manual_seed(s) for i, s in seeds.items()}
            sm = _sampling_metadata(
                temperatures, vocab_size, gens, top_k=top_k, top_p=top_p,
                penalties=opts.get("penalties", False), drafts=drafts,
                max_num_logprobs=opts.get("max_num_logprobs"),
            )
            outs.append(sampler(meta, *draft_args, logits.clone(), sm))
        want, got = outs
        assert torch.equal(got.sampled_token_ids, want.sampled_token_ids), trial
        emitted = (got.sampled_token_ids >= 0).sum(dim=1)
        num_rejections += int((emitted <= torch.tensor(num_draft_tokens)).sum())
        if opts.get("max_num_logprobs"):
            for a, b in zip(got.logprobs_tensors, want.logprobs_tensors):
                assert (a is None and b is None) or torch.equal(a, b)
    assert num_rejections >= 3  # the correction draws were compared too


def test_all_greedy_needs_no_q():
    num_draft_tokens = [3, 0, 5]
    logits, meta, drafts, _ = _batch(num_draft_tokens, 64, seed=3)
    sm = _sampling_metadata([0.0, 0.0, 0.0], 64, {})
    out = SparseRejectionSampler(Sampler())(meta, None, None, logits.clone(), sm)
    want = vllm_rs.RejectionSampler(Sampler())(meta, None, logits.clone(), sm)
    assert torch.equal(out.sampled_token_ids, want.sampled_token_ids)


def test_random_batch_without_q_raises():
    logits, meta, drafts, _ = _batch([2, 2], 64, seed=4)
    sm = _sampling_metadata([1.0, 0.0], 64, {})
    with pytest.raises(ValueError, match="draft_cand_ids"):
        SparseRejectionSampler(Sampler())(meta, None, None, logits, sm)


def _min_p_processor(min_p: list[float]) -> MinPLogitsProcessor:
    proc = MinPLogitsProcessor.__new__(MinPLogitsProcessor)
    proc.min_p_count = sum(1 for m in min_p if m)
    proc.min_p = torch.tensor(min_p).unsqueeze(1)  # [num_reqs, 1], as update_state
    return proc


def test_draft_constraints_match_vllm_sampler_per_row():
    """Temperature -> min-p -> top-k/top-p on each draft row equals what vLLM's
    Sampler.sample does to a normal row with the request's parameters."""
    vocab_size = 200
    num_draft_tokens = [3, 0, 4, 2]
    temperatures = [0.5, 1.0, 0.0, 1.7]
    min_p = [0.05, 0.0, 0.2, 0.0]
    top_k = torch.tensor([10, 200, 200, 40])
    top_p = torch.tensor([0.9, 1.0, 0.8, 0.5])
    proc = _min_p_processor(min_p)
    sm = _sampling_metadata(
        temperatures, vocab_size, {}, top_k=top_k, top_p=top_p,
        logitsprocs=LogitsProcessors([proc]),
    )
    logits = torch.randn(9, vocab_size, generator=torch.Generator().manual_seed(0)) * 3
    got = apply_draft_sampling_constraints(logits.clone(), num_draft_tokens, sm)
    row = 0
    for r, n in enumerate(num_draft_tokens):
        temp = temperatures[r] if temperatures[r] != 0 else 1.0
        for _ in range(n):
            x = logits[row : row + 1] / temp
            x = _min_p_processor([min_p[r]]).apply(x)
            x = apply_top_k_top_p(x, top_k[r : r + 1], top_p[r : r + 1])
            assert torch.equal(got[row], x[0]), (r, row)
            row += 1
    assert bool(torch.isinf(got).any())  # min-p / top-k / top-p did mask something


def test_logit_bias_reaches_every_draft_row():
    proc = LogitBiasLogitsProcessor.__new__(LogitBiasLogitsProcessor)
    proc.biases = {0: {3: 5.0, 7: -2.0}, 2: {1: 1.5}}
    sm = _sampling_metadata(
        [1.0, 1.0, 1.0], 10, {}, logitsprocs=LogitsProcessors([proc])
    )
    logits = torch.zeros(6, 10)
    out = apply_logit_bias_to_drafts(logits, sm, [2, 1, 3])
    want = torch.zeros(6, 10)
    want[0:2, 3], want[0:2, 7] = 5.0, -2.0
    want[3:6, 1] = 1.5
    assert torch.equal(out, want)


def test_sparse_draft_probs_validates():
    with pytest.raises(ValueError, match="int64"):
        SparseDraftProbs(torch.zeros(2, 16, dtype=torch.int32), torch.zeros(2, 16))
    with pytest.raises(ValueError, match="num_tokens, topk"):
        SparseDraftProbs(torch.zeros(2, 16, dtype=torch.int64), torch.zeros(2, 8))


def test_sparse_draft_probs_from_padded():
    ids = torch.arange(2 * 3 * 4).view(2, 3, 4)
    probs = torch.rand(2, 3, 4)
    q = SparseDraftProbs.from_padded(ids, probs, [2, 3])
    assert q.num_tokens == 5 and q.topk == 4
    assert torch.equal(q.cand_ids, torch.cat([ids[0, :2], ids[1]]))
    assert torch.equal(q.cand_probs, torch.cat([probs[0, :2], probs[1]]))


# ------------------------------------------------- a request without cached sparse q
def _fake_runner(cached: dict[str, tuple[torch.Tensor, torch.Tensor]], order, batch):
    """What DSpineRejectionSampler reads of vLLM's GPUModelRunner: the q cache of the
    drafting step (`_draft_probs` [num_cached, K, 2k] in `order`) and this step's
    batch order."""
    from types import SimpleNamespace

    from vllm_dspine.proposer.sparse_q import pack_sparse_q

    packed = torch.stack([pack_sparse_q(*cached[r]) for r in order])  # [n, K, 2k]
    return SimpleNamespace(_draft_probs=packed, _draft_prob_req_ids=list(order),
                           input_batch=SimpleNamespace(req_ids=list(batch)))


def test_missing_q_drops_only_that_requests_drafts():
    """vLLM hands the verifier no q at all when one request of the step has none
    cached. Only that request ("b") may lose its drafts: "a" and "c" must be verified
    with their own q (same tokens as SparseRejectionSampler given the q directly, with
    b's rows at q = 0), and b never accepts. Under the old behaviour (all q = 0) a and
    c would accept nothing; here they accept 18 and 10 of 36 drafts (seed 21)."""
    from vllm_dspine.proposer.sparse_q import (DSpineRejectionSampler,
                                               gather_sparse_q_per_request)

    num_draft_tokens = [6, 6, 6]
    vocab_size, K = 64, 8
    logits, meta, drafts, q = _batch(num_draft_tokens, vocab_size, seed=21)
    rows = {"a": slice(0, 6), "b": slice(6, 12), "c": slice(12, 18)}

    def padded(r):  # [K, 16]: the drafting step kept K rows per request
        ids = torch.full((K, 16), -1, dtype=torch.long)
        probs = torch.zeros(K, 16)
        ids[:6], probs[:6] = q.cand_ids[rows[r]], q.cand_probs[rows[r]]
        return ids, probs

    # Cached in another order than this step's batch, and without "b".
    runner = _fake_runner({"a": padded("a"), "c": padded("c")}, ["c", "a"], ["a", "b", "c"])
    ids_b0, probs_b0 = q.cand_ids.clone(), q.cand_probs.clone()
    ids_b0[rows["b"]], probs_b0[rows["b"]] = -1, 0.0

    got_ids, got_probs, missing = gather_sparse_q_per_request(
        runner._draft_probs, runner._draft_prob_req_ids, runner.input_batch.req_ids,
        num_draft_tokens, torch.device("cpu"))
    assert missing == ["b"]
    assert torch.equal(got_ids, ids_b0) and torch.equal(got_probs, probs_b0)

    ours = DSpineRejectionSampler(Sampler(), runner=runner)
    accepted = {"a": 0, "b": 0, "c": 0}
    for trial in range(6):
        outs = []
        for call in (lambda sm: ours(meta, None, logits.clone(), sm),
                     lambda sm: SparseRejectionSampler(Sampler())(
                         meta, ids_b0, probs_b0, logits.clone(), sm)):
            torch.manual_seed(trial)
            gens = {i: torch.Generator().manual_seed(100 * trial + i) for i in range(3)}
            outs.append(call(_sampling_metadata([1.0, 1.0, 1.0], vocab_size, gens,
                                                drafts=drafts)).sampled_token_ids)
        assert torch.equal(outs[0], outs[1]), trial
        for i, r in enumerate("abc"):
            accepted[r] += int((outs[0][i] >= 0).sum()) - 1
    assert accepted["b"] == 0
    assert accepted["a"] >= 6 and accepted["c"] >= 6, accepted


def test_missing_q_without_runner_or_cache_gives_q_zero():
    """No runner (or nothing cached): every draft is verified with q = 0, so nothing
    is accepted and each request emits one token; given q of the right length, the
    runner is not consulted."""
    from types import SimpleNamespace

    from vllm_dspine.proposer.sparse_q import DSpineRejectionSampler, pack_sparse_q

    num_draft_tokens = [4, 5]
    logits, meta, drafts, q = _batch(num_draft_tokens, 64, seed=22)
    empty = SimpleNamespace(_draft_probs=None, _draft_prob_req_ids=None,
                            input_batch=SimpleNamespace(req_ids=["a", "b"]))
    for sampler in (DSpineRejectionSampler(Sampler()),
                    DSpineRejectionSampler(Sampler(), runner=empty)):
        out = sampler(meta, None, logits.clone(),
                      _sampling_metadata([1.0, 0.7], 64, {}, drafts=drafts))
        assert torch.equal((out.sampled_token_ids >= 0).sum(dim=1), torch.tensor([1, 1]))
    packed = pack_sparse_q(q.cand_ids, q.cand_probs)  # [9, 32]: the runner's gather
    torch.manual_seed(5)
    a = DSpineRejectionSampler(Sampler(), runner=empty)(
        meta, packed, logits.clone(), _sampling_metadata([1.0, 0.7], 64, {}, drafts=drafts))
    torch.manual_seed(5)
    b = SparseRejectionSampler(Sampler())(
        meta, q.cand_ids, q.cand_probs, logits.clone(),
        _sampling_metadata([1.0, 0.7], 64, {}, drafts=drafts))
    assert torch.equal(a.sampled_token_ids, b.sampled_token_ids)


@pytest.mark.parametrize("top_p", [False, True], ids=["top-k-only", "top-k-top-p"])
def test_step_without_any_draft(top_p):
    """vLLM calls the rejection sampler on every step once speculation is configured,
    also when no request of the step has a draft (prefills, or a policy that verifies
    nothing). Random requests with top-k only used to crash there (vLLM's
    `apply_top_k_only` takes the max of an empty k); the output is the bonus tokens,
    as vLLM's sampler draws them."""
    num_draft_tokens = [0, 0, 0]
    logits, meta, drafts, q = _batch(num_draft_tokens, 64, seed=23)
    sm = _sampling_metadata([1.0, 0.7, 0.0], 64, {}, top_k=torch.tensor([3, 5, 64]),
                            top_p=torch.tensor([0.9, 1.0, 1.0]) if top_p else None,
                            drafts=drafts)
    torch.manual_seed(0)
    out = SparseRejectionSampler(Sampler())(meta, q.cand_ids, q.cand_probs,
                                            logits.clone(), sm)
    assert out.sampled_token_ids.shape == (3, 1)
    torch.manual_seed(0)
    want = Sampler()(logits.clone(), sm, predict_bonus_token=True).sampled_token_ids
    assert torch.equal(out.sampled_token_ids, want.to(out.sampled_token_ids.dtype))


def test_exponentials_only_for_drafted_rows(monkeypatch):
    """Serving draws a request's exponentials (its recovered token's noise) only when it
    has drafts: rows of requests without drafts hold 1.0 and cost no draws; seeded rows
    are the ones vLLM's order gives (the same stream, so the same text for a seed);
    unseeded rows are Exponential(1) reciprocals. Then through the sampler: with every
    drafted random request seeded the tokens are vLLM's, token for token."""
    num_draft_tokens = [3, 0, 2, 0, 1]
    gens = {0: torch.Generator().manual_seed(5), 1: torch.Generator().manual_seed(6)}
    want = generate_inv_exp(num_draft_tokens, 50, {
        i: torch.Generator().manual_seed(s) for i, s in ((0, 5), (1, 6))}, CPU)
    got = generate_inv_exp(num_draft_tokens, 50, gens, CPU, drafted_only=True)
    assert torch.equal(got[0], want[0])  # seeded, drafted: vLLM's row
    assert torch.equal(got[[1, 3]], torch.ones(2, 50))  # no drafts: not drawn
    assert gens[1].initial_seed() == 6 and torch.equal(  # seeded without drafts:
        gens[1].get_state(), torch.Generator().manual_seed(6).get_state())  # untouched
    # Unseeded drafted rows: 1 / Exponential(1), so u = exp(-1 / x) is uniform on
    # (0, 1). Over 2,000,000 draws its mean has standard error 0.29 / sqrt(2e6) =
    # 0.0002 and the share below 0.1 0.3 / sqrt(2e6) = 0.0002: 0.001 is 5 of them,
    # while a rate-1.01 exponential (a 1 % error) moves them by 0.0025 and 0.0023.
    torch.manual_seed(0)
    many = generate_inv_exp([1, 0], 2_000_000, {}, CPU, drafted_only=True)
    u = torch.exp(-1.0 / many[0].double())
    assert abs(u.mean().item() - 0.5) < 0.001
    assert abs((u < 0.1).double().mean().item() - 0.1) < 0.001  # the lower tail too

    monkeypatch.setattr(vllm_rs, "expand_batch_to_tokens", _expand_fixed)
    monkeypatch.setattr(SparseRejectionSampler, "recovered_draw", "drafted")
    num_draft_tokens = [15, 0, 4, 0, 7]
    vocab_size = 300
    logits, meta, drafts, q = _batch(num_draft_tokens, vocab_size, seed=3)
    num_rejections = 0
    for trial in range(6):
        outs = []
        for sampler, draft_args in ((vllm_rs.RejectionSampler(Sampler()),
                                     (q.to_dense(vocab_size),)),
                                    (SparseRejectionSampler(Sampler()),
                                     (q.cand_ids, q.cand_probs))):
            torch.manual_seed(trial)
            gens = {i: torch.Generator().manual_seed(31 * trial + i)
                    for i in (0, 2, 4)}  # every drafted request seeded
            sm = _sampling_metadata([0.7, 1.0, 1.3, 0.5, 1.0], vocab_size, gens,
                                    drafts=drafts)
            outs.append(sampler(meta, *draft_args, logits.clone(), sm))
        want_out, got_out = outs
        assert torch.equal(got_out.sampled_token_ids, want_out.sampled_token_ids), trial
        emitted = (got_out.sampled_token_ids >= 0).sum(dim=1)
        num_rejections += int((emitted <= torch.tensor(num_draft_tokens))[[0, 2, 4]].sum())
    assert num_rejections >= 3  # recovered tokens (the exponentials) were compared


def test_recovered_by_inverse_cdf_in_the_sampler(monkeypatch):
    """Serving's draw (`recovered_draw = "inverse_cdf"`, one uniform per drafted request;
    its law is tests/test_verify_ref.py::test_inverse_cdf_*): the acceptance is the
    "drafted" draw's, decision for decision (the per-draft uniforms come first from the
    same streams); a seeded request gives the same tokens whatever the global RNG did;
    a seeded request without drafts leaves its generator untouched; every token is in
    the support of its processed row (top-p 0.5 here masks most of the vocabulary)."""
    monkeypatch.setattr(vllm_rs, "expand_batch_to_tokens", _expand_fixed)
    num_draft_tokens = [15, 0, 4, 0, 7]
    vocab_size = 300
    logits, meta, drafts, q = _batch(num_draft_tokens, vocab_size, seed=4)
    num_rejections = 0
    for trial in range(8):
        outs = {}
        for draw, global_seed in (("drafted", trial), ("inverse_cdf", trial),
                                  ("inverse_cdf", 1000 + trial)):
            monkeypatch.setattr(SparseRejectionSampler, "recovered_draw", draw)
            torch.manual_seed(global_seed)
            gens = {i: torch.Generator().manual_seed(31 * trial + i) for i in (0, 1, 4)}
            sm = _sampling_metadata([0.7, 1.0, 1.3, 0.5, 1.0], vocab_size, gens,
                                    top_p=torch.full((5,), 0.5), drafts=drafts)
            out = SparseRejectionSampler(Sampler())(
                meta, q.cand_ids, q.cand_probs, logits.clone(), sm).sampled_token_ids
            outs[draw, global_seed] = out
            # Request 1 is seeded and has no draft: only its bonus draw touched it,
            # the same one plain decoding makes.
            assert gens[1].initial_seed() == 31 * trial + 1
        drafted, inv, inv_other = (outs["drafted", trial], outs["inverse_cdf", trial],
                                   outs["inverse_cdf", 1000 + trial])
        for r, n in enumerate(num_draft_tokens):
            accepted = int((drafted[r, :n] == torch.tensor(drafts[r], dtype=torch.int32))
                           .cumprod(0).sum()) if n else 0
            got = int((inv[r, :n] == torch.tensor(drafts[r], dtype=torch.int32))
                      .cumprod(0).sum()) if n else 0
            assert got == accepted, (trial, r)  # the same acceptance decisions
            num_rejections += int(n > 0 and accepted < n)
        for r in (0, 4):  # seeded, drafted: the global RNG does not reach them
            assert torch.equal(inv[r], inv_other[r]), (trial, r)
        # Every emitted token has probability > 0 under its processed row.
        target = logits[meta.target_logits_indices.long()] / torch.tensor(
            [t for t, n in zip([0.7, 1.0, 1.3, 0.5, 1.0], num_draft_tokens)
             for _ in range(n)])[:, None]
        kept = apply_top_k_top_p(target.clone(), None, torch.full((target.shape[0],), 0.5))
        row = 0
        for r, n in enumerate(num_draft_tokens):
            for j in range(n):
                tok = int(inv[r, j])
                if tok >= 0:
                    assert torch.isfinite(kept[row + j, tok]), (trial, r, j, tok)
            row += n
    assert num_rejections >= 10  # recovered tokens were drawn


@pytest.mark.parametrize("case", ["top-p", "top-k-top-p", "temperature-only", "flat-top-p",
                                  "invalid-q"])
def test_row_by_row_gives_the_whole_batch_tokens(case, monkeypatch):
    """Verifying position by position (rows after a request's first rejection never
    processed) gives the tokens of processing every draft row, bit for bit: 10 batches
    a case of 8 requests (0-15 drafts, some seeded) under the same RNG state; with top-p
    (the fast path of top_k_top_p.py), top-k and top-p (the sorted path), temperature
    alone, flat rows (the cut beyond the 256 largest values), and q rows holding NaN.
    The step is one `verifies_row_by_row` accepts, and later positions are reached."""
    monkeypatch.setattr(vllm_rs, "expand_batch_to_tokens", _expand_fixed)
    num_draft_tokens = [15, 0, 4, 1, 7, 0, 15, 2]
    vocab_size = 2000 if case == "flat-top-p" else 600
    reached = 0
    for trial in range(10):
        logits, meta, drafts, q = _batch(num_draft_tokens, vocab_size, seed=50 + trial)
        if case == "flat-top-p":
            logits = logits * 0.05
        ids, probs = q.cand_ids.clone(), q.cand_probs.clone()
        if case == "invalid-q":
            probs[::5, 2] = float("nan")
        temps = [0.7, 1.0, 1.3, 0.5, 1.0, 0.9, 0.8, 2.0]
        outs = []
        for row_by_row in (False, True):
            monkeypatch.setattr(SparseRejectionSampler, "row_by_row", row_by_row)
            torch.manual_seed(trial)
            gens = {i: torch.Generator().manual_seed(7 * trial + i) for i in (2, 5, 6)}
            sm = _sampling_metadata(
                temps, vocab_size, gens, drafts=drafts,
                top_k=torch.tensor([5, 600, 50, 3, 300, 10, 20, 40])
                if case == "top-k-top-p" else None,
                top_p=None if case == "temperature-only"
                else torch.tensor([0.95, 0.9, 0.5, 1.0, 0.8, 0.95, 0.99, 0.7]))
            sampler = SparseRejectionSampler(Sampler())
            assert sampler.verifies_row_by_row(sm, logits) == row_by_row
            outs.append(sampler(meta, ids, probs, logits.clone(), sm).sampled_token_ids)
        assert torch.equal(outs[0], outs[1]), (case, trial)
        reached += int((outs[1][:, 2:] >= 0).sum())
    # Positions past the second were verified (not on flat rows, which accept almost
    # nothing: q is drawn near the unscaled logits; they check the sorted top-p path).
    assert case == "flat-top-p" or reached > 4


def test_row_by_row_only_where_it_applies():
    """Logprobs, penalties, a greedy request or min-p keep the whole-batch path."""
    vocab_size = 50
    logits = torch.randn(4, vocab_size)
    plain = _sampling_metadata([0.7, 1.0], vocab_size, {})
    sampler = SparseRejectionSampler(Sampler())
    assert sampler.verifies_row_by_row(plain, logits)
    assert not sampler.verifies_row_by_row(
        _sampling_metadata([0.7, 1.0], vocab_size, {}, max_num_logprobs=2), logits)
    assert not sampler.verifies_row_by_row(
        _sampling_metadata([0.7, 1.0], vocab_size, {}, penalties=True), logits)
    assert not sampler.verifies_row_by_row(
        _sampling_metadata([0.7, 0.0], vocab_size, {}), logits)
    sampler.recovered_draw = "drafted"
    assert not sampler.verifies_row_by_row(plain, logits)
