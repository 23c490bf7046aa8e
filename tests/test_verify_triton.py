"""The Triton kernels (under TRITON_INTERPRET=1, set by tests/conftest.py) emit the
same tokens as the PyTorch reference, on small and awkward shapes."""

from __future__ import annotations

import os

import pytest
import torch

from vllm_dspine.verify import generate_inv_exp, sparse_rejection_sample
from vllm_dspine.verify.synthetic import random_problem

pytestmark = pytest.mark.triton

CPU = torch.device("cpu")


def _both(*args):
    ref = sparse_rejection_sample(*args, use_triton=False)
    tri = sparse_rejection_sample(*args, use_triton=True)
    return ref, tri


def _random_args(num_draft_tokens, vocab_size, seed, topk=16, greedy_every=0,
                 num_pad=2, exp_dtype=torch.float32, top_k_mask=None):
    g = torch.Generator().manual_seed(seed)
    prob = random_problem(
        num_draft_tokens, vocab_size, g, topk=topk, num_pad=num_pad,
        top_k_mask=top_k_mask,
    )
    num_reqs = len(num_draft_tokens)
    is_greedy = None
    if greedy_every:
        is_greedy = torch.tensor([i % greedy_every == 0 for i in range(num_reqs)])
    num_tokens = prob.draft_token_ids.shape[0]
    # Uniforms spread over [0, 1) so that both acceptances and rejections occur.
    uniform = torch.rand(num_tokens, dtype=torch.float64, generator=g)
    inv_exp = torch.empty(num_reqs, vocab_size, dtype=exp_dtype).exponential_(
        generator=g
    ).reciprocal()
    return [
        prob.draft_token_ids, num_draft_tokens, max(num_draft_tokens),
        prob.cu_num_draft_tokens, prob.draft_cand_ids, prob.draft_cand_probs,
        prob.target_probs, prob.bonus_token_ids, is_greedy, None, uniform, inv_exp,
    ]


def test_interpreter_is_on():
    assert os.environ.get("TRITON_INTERPRET") == "1"


@pytest.mark.parametrize(
    "num_draft_tokens, vocab_size, kwargs",
    [
        pytest.param([5, 0, 3, 5, 1, 4], 100, {"greedy_every": 3}, id="mixed-V100"),
        pytest.param([15, 15], 50, {}, id="K15-V50-random"),
        pytest.param([4, 2, 0], 8193, {"topk": 10, "num_pad": 1}, id="V8193-topk10"),
        pytest.param([3, 3, 3], 61, {"exp_dtype": torch.float64}, id="fp64-exp"),
        pytest.param([6, 1, 6], 300, {"top_k_mask": 5}, id="topk5-masked-p"),
        pytest.param([0, 0], 40, {}, id="no-drafts"),
    ],
)
def test_triton_equals_reference(num_draft_tokens, vocab_size, kwargs):
    for seed in range(3):
        args = _random_args(num_draft_tokens, vocab_size, seed, **kwargs)
        ref, tri = _both(*args)
        assert torch.equal(ref, tri), (seed, ref, tri)


def test_triton_all_greedy():
    nd = [3, 0, 2]
    drafts = torch.tensor([1, 2, 3, 4, 5])
    argmax = torch.tensor([1, 2, 0, 4, 5])
    ref, tri = _both(
        drafts, nd, 3, torch.tensor(nd).cumsum(0).to(torch.int32), None, None, None,
        torch.tensor([[7], [8], [9]]), None, argmax, None, None,
    )
    assert torch.equal(ref, tri)
    assert tri.tolist() == [[1, 2, 0, -1], [8, -1, -1, -1], [4, 5, 9, -1]]


def test_triton_edge_cases():
    """NaN row (all -inf logits), denormal p and q, drafts with q == 0, outside
    the candidates, -1 and out of vocabulary, and a vanished residual."""
    vocab_size = 40
    logits = torch.randn(7, vocab_size, generator=torch.Generator().manual_seed(0))
    logits[0] = float("-inf")
    logits[1] = torch.linspace(-200.0, 0.0, vocab_size)
    target_probs = logits.softmax(dim=-1)
    ids = torch.tensor([[0, 1, 2, 39, -1]] * 7)
    probs = torch.tensor([[1e-45, 1e-40, 0.5, 0.5 - 2e-40, 0.0]] * 7)
    probs[4] = torch.tensor([0.0, 0.5, 0.5, 0.0, 0.0])  # q(0) == 0
    # Row 6: p == q on the candidates except a smaller p at the draft (id 2).
    target_probs[6] = 0.0
    target_probs[6, 1], target_probs[6, 2] = 0.5, 0.25
    ids[6] = torch.tensor([1, 2, -1, -1, -1])
    probs[6] = torch.tensor([0.5, 0.5, 0.0, 0.0, 0.0])
    drafts = torch.tensor([2, 0, 39, -1, 0, 41, 2])
    nd = [1] * 7
    for seed in range(5):
        g = torch.Generator().manual_seed(seed)
        inv_exp = generate_inv_exp(nd, vocab_size, {}, CPU)
        uniform = torch.rand(7, dtype=torch.float64, generator=g)
        uniform[6] = 0.9
        ref, tri = _both(
            drafts, nd, 1, torch.tensor(nd).cumsum(0).to(torch.int32), ids, probs,
            target_probs, torch.full((7, 1), 5), None, None, uniform, inv_exp,
        )
        assert torch.equal(ref, tri), (seed, ref, tri)
        assert bool(((tri >= -1) & (tri < vocab_size)).all())
        assert tri[3, 1] == -1 and tri[4, 1] == -1 and tri[5, 1] == -1
        assert int(tri[6, 0]) in (1, 2) and tri[6, 1] == -1
