"""`serial_tail_kernel` (kernels/tail_walk.py) against the PyTorch walk `serial_walk_ref`
under TRITON_INTERPRET=1 (conftest): for the same uniforms the two draw the same
candidates and retain the same q (to fp32 rounding), greedy and sampled, every filter.

The reference's draws are tested for their distribution in tests/test_tail_sampling.py
(chain frequencies, retained q); the kernel makes the same draws from the same uniforms,
so it inherits that. Shapes are awkward on purpose: 1 and 3 requests, K 15 and 3, k 16,
12 (padding lanes) and 5, ties in the scores.
"""

from __future__ import annotations

import pytest
import torch

from vllm_dspine.kernels.tail import draw_tail_uniforms, serial_tail

pytestmark = pytest.mark.triton


def _tables(R, K, k, seed, dtype=torch.float64, scale=2.0, ties=False):
    gen = torch.Generator().manual_seed(seed)
    S = torch.randn(R, K, k, k, generator=gen, dtype=torch.float64) * scale
    if ties:  # scores on a coarse grid: ties in argmax, at the top-k boundary, in top-p
        S = (S * 2).round() / 2
    S[:, 0] = S[:, 0, :1]  # row 1: every predecessor index is the anchor
    cand = torch.stack([torch.randperm(50000, generator=gen)[:k] for _ in range(R * K)])
    return S.to(dtype), cand.view(R, K, k)


def _settings(R, seed, temperature, top_k=None, top_p=None, min_p=None):
    """Per-request settings: a scalar for every request, or a list of R values."""
    def per_req(v, dtype):
        if v is None:
            return None
        return torch.tensor(v if isinstance(v, list) else [v] * R, dtype=dtype)
    return dict(temperature=per_req(temperature, torch.float32),
                top_k=per_req(top_k, torch.int32), top_p=per_req(top_p, torch.float32),
                min_p=per_req(min_p, torch.float32))


def _assert_same(ref, kern):
    assert torch.equal(kern.draft_token_ids, ref.draft_token_ids)
    assert torch.equal(kern.cand_ids, ref.cand_ids)
    assert kern.cand_probs.dtype == torch.float32
    torch.testing.assert_close(kern.cand_probs, ref.cand_probs, rtol=1e-6, atol=1e-7)
    assert torch.equal(kern.cand_probs > 0, ref.cand_probs > 0)  # filtered entries stay 0


CASES = [
    pytest.param(1, 15, 16, dict(temperature=0.0), torch.float32, False, id="R1-K15-greedy-fp32"),
    pytest.param(3, 15, 16, dict(temperature=0.0), torch.float32, True, id="R3-greedy-ties"),
    pytest.param(1, 15, 16, dict(temperature=1.0), torch.float64, False, id="R1-K15-T1"),
    pytest.param(3, 3, 16, dict(temperature=[0.0, 0.7, 1.3]), torch.float64, False,
                 id="R3-K3-mixed"),
    pytest.param(3, 15, 16, dict(temperature=[0.8, 0.0, 2.0], top_k=[5, 3, 0]),
                 torch.float64, True, id="R3-topk-ties"),
    pytest.param(3, 15, 16, dict(temperature=1.3, top_p=[0.7, 0.95, 1.0]), torch.float64,
                 True, id="R3-topp"),
    pytest.param(3, 15, 16, dict(temperature=0.8, min_p=[0.1, 0.0, 0.3]), torch.float64,
                 False, id="R3-minp"),
    pytest.param(3, 15, 16, dict(temperature=[2.0, 0.5, 5e-6], top_k=[12, 16, 4],
                                 top_p=[0.95, 0.6, 0.9], min_p=[0.02, 0.05, 0.0]),
                 torch.float64, True, id="R3-all-filters-one-greedy"),
    pytest.param(3, 15, 16, dict(temperature=1.0, top_k=3), torch.float32, False,
                 id="R3-sampled-fp32-tables"),
    pytest.param(3, 3, 12, dict(temperature=[0.9, 1.1, 0.0], top_k=[4, 20, 0], top_p=0.8),
                 torch.float64, False, id="R3-K3-k12-padding-lanes"),
    pytest.param(1, 15, 5, dict(temperature=0.7, top_p=0.5, min_p=0.05), torch.float64,
                 True, id="R1-k5"),
]


@pytest.mark.parametrize("R, K, k, setting, dtype, ties", CASES)
def test_kernel_draws_what_the_reference_draws(R, K, k, setting, dtype, ties):
    S, cand = _tables(R, K, k, seed=R * 100 + K * 10 + k, dtype=dtype, ties=ties)
    kw = _settings(R, 0, **setting)
    u = torch.rand(R, 15, dtype=torch.float64, generator=torch.Generator().manual_seed(7))
    ref = serial_tail(S, cand, uniforms=u, use_triton=False, **kw)
    kern = serial_tail(S, cand, uniforms=u, use_triton=True, **kw)
    _assert_same(ref, kern)
    greedy = kw["temperature"] < 1e-5
    assert torch.all(kern.cand_probs[greedy].max(-1).values == 1)


# Seeds 0 and 1 (tables without and with ties) in the default tier, 2 and 3 in `full`
# (~10 s each under TRITON_INTERPRET on a slow core).
@pytest.mark.parametrize("seed", [0, 1, *(pytest.param(s, marks=pytest.mark.full)
                                         for s in (2, 3))])
def test_kernel_matches_reference_on_many_uniforms(seed):
    # Many rows and uniforms: every draw index and filter boundary gets exercised.
    R, K, k = 3, 15, 16
    S, cand = _tables(R, K, k, seed=1000 + seed, ties=seed % 2 == 1)
    kw = _settings(R, seed, temperature=[0.6, 1.0, 1.7], top_k=[0, 8, 14],
                   top_p=[0.9, 1.0, 0.75], min_p=[0.0, 0.03, 0.01])
    gen = torch.Generator().manual_seed(seed)
    for _ in range(3):
        u = torch.rand(R, K, dtype=torch.float64, generator=gen)
        _assert_same(serial_tail(S, cand, uniforms=u, use_triton=False, **kw),
                     serial_tail(S, cand, uniforms=u, use_triton=True, **kw))


def test_uniforms_at_the_ends_of_the_unit_interval():
    # u = 0 draws the first candidate of nonzero probability; u just below 1 the last.
    R, K, k = 2, 3, 16
    S, cand = _tables(R, K, k, seed=5)
    kw = _settings(R, 0, temperature=1.0, top_k=[4, 0])
    for value in (0.0, 1.0 - 2 ** -53):
        u = torch.full((R, K), value, dtype=torch.float64)
        ref = serial_tail(S, cand, uniforms=u, use_triton=False, **kw)
        _assert_same(ref, serial_tail(S, cand, uniforms=u, use_triton=True, **kw))
        chosen = (ref.cand_ids == ref.draft_token_ids[..., None]).float().argmax(-1)
        nonzero = (ref.cand_probs > 0).nonzero()
        for r in range(R):
            for t in range(K):
                js = nonzero[(nonzero[:, 0] == r) & (nonzero[:, 1] == t), 2]
                assert chosen[r, t] == (js.min() if value == 0.0 else js.max())


def test_default_draws_are_the_same_on_both_paths():
    # Without `uniforms`, both paths draw them from the same generators and global RNG.
    R, K, k = 3, 15, 16
    S, cand = _tables(R, K, k, seed=9)
    kw = _settings(R, 0, temperature=[1.0, 0.0, 0.5], top_p=0.9)

    def run(use_triton):
        torch.manual_seed(3)
        gens = [torch.Generator().manual_seed(11), None, None]
        return serial_tail(S, cand, generators=gens, draws_per_request=15,
                           use_triton=use_triton, **kw)

    _assert_same(run(False), run(True))


def test_draw_tail_uniforms_on_cpu_reads_which_requests_sample():
    gens = [torch.Generator().manual_seed(1), None, torch.Generator().manual_seed(2), None]
    temperature = torch.tensor([1.0, 0.5, 0.0, 0.0])
    torch.manual_seed(0)
    u = draw_tail_uniforms(temperature, 15, gens, torch.device("cpu"))
    assert u.shape == (4, 15) and u.dtype == torch.float64
    assert torch.equal(u[0], torch.rand(15, dtype=torch.float64,
                                        generator=torch.Generator().manual_seed(1)))
    assert torch.all(u[2:] == 0)  # greedy requests draw nothing: their generator is unused
    assert torch.equal(torch.rand(1, generator=gens[2]),
                       torch.rand(1, generator=torch.Generator().manual_seed(2)))
    torch.manual_seed(0)
    assert torch.equal(u[1], torch.rand(1, 15, dtype=torch.float64)[0])  # shared draw
    assert draw_tail_uniforms(torch.zeros(2), 15, [None, None], torch.device("cpu")) is None


def test_empty_batch_and_bad_uniforms():
    S, cand = _tables(1, 3, 16, seed=1)
    empty = serial_tail(S[:0], cand[:0], torch.zeros(0), use_triton=True)
    assert empty.draft_token_ids.shape == (0, 3) and empty.cand_probs.shape == (0, 3, 16)
    with pytest.raises(ValueError, match="uniforms must be float64"):
        serial_tail(S, cand, torch.ones(1), uniforms=torch.rand(1, 2, dtype=torch.float64))
    with pytest.raises(ValueError, match="uniforms must be float64"):
        serial_tail(S, cand, torch.ones(1), uniforms=torch.rand(1, 3))
