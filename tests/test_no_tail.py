"""The no-tail ablation (`dspine_tail: false`): rows scored by their continuous logits
over their own candidates, drafted and sampled by the same serial walk as the tail."""

import torch

from vllm_dspine.kernels.tail import continuous_score_tables, serial_tail


def _problem(seed=0, R=3, K=5, k=4, H=8, V=40):
    g = torch.Generator().manual_seed(seed)
    head = torch.randn(V, H, generator=g)
    hidden = torch.randn(R, K, H, generator=g)
    cand = torch.stack([torch.randperm(V, generator=g)[:k] for _ in range(R * K)]).view(R, K, k)
    return head, hidden, cand


def test_tables_are_the_rows_logits_whatever_the_predecessor():
    head, hidden, cand = _problem()
    S = continuous_score_tables(hidden, cand, head)
    R, K, k = cand.shape
    assert S.shape == (R, K, k, k)
    logits = hidden @ head.t()  # [R, K, V]
    want = logits.gather(2, cand)  # [R, K, k]
    for u in range(k):
        torch.testing.assert_close(S[:, :, u], want)


def test_greedy_is_the_per_row_argmax_over_candidates():
    head, hidden, cand = _problem(1)
    S = continuous_score_tables(hidden, cand, head)
    prop = serial_tail(S, cand, torch.zeros(cand.shape[0]))
    want = cand.gather(2, (hidden @ head.t()).gather(2, cand).argmax(-1, keepdim=True))[..., 0]
    assert torch.equal(prop.draft_token_ids, want)


def test_sampled_rows_are_independent_softmaxes():
    # With predecessor-independent tables, the retained q of every row is the softmax of
    # its own candidate logits / T, whatever was drawn before it.
    head, hidden, cand = _problem(2)
    T = 0.7
    S = continuous_score_tables(hidden, cand, head, torch.float64)
    gens = [torch.Generator().manual_seed(i) for i in range(cand.shape[0])]
    prop = serial_tail(S, cand, torch.full((cand.shape[0],), T), generators=gens)
    want = ((hidden.double() @ head.double().t()).gather(2, cand) / T).softmax(-1)
    torch.testing.assert_close(prop.cand_probs.double(), want, atol=1e-6, rtol=1e-6)
    drafted = (prop.cand_ids == prop.draft_token_ids[..., None])
    assert bool((prop.cand_probs[drafted] > 0).all())
