"""`apply_top_k_top_p_values_sorted` (vllm_dspine/verify/top_k_top_p.py) against vLLM
0.32.0's own `apply_top_k_top_p_pytorch`, the function vLLM's CPU sampler runs: the
results must be `torch.equal` (the same -inf positions, every kept value's bits), on
rows built to be awkward: ties at the cut, -inf, NaN, top-p 1.0, top-k 1 and vocab,
vocabularies of 1 to 49,152 ids."""

from __future__ import annotations

import zlib

import pytest
import torch

from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch

from vllm_dspine.verify.top_k_top_p import apply_top_k_top_p_values_sorted


def _vllm(x, k, p):
    return apply_top_k_top_p_pytorch(x.clone(), k, p, allow_cpu_sync=True)


def _rows(kind: str, rows: int, vocab: int, g: torch.Generator) -> torch.Tensor:
    x = torch.randn(rows, vocab, generator=g) * (1 + 4 * torch.rand(rows, 1, generator=g))
    if kind == "ties":  # quarter steps: many equal logits, at the cut too
        x = (x * 4).round() / 4
    elif kind == "flat":  # every logit equal: the whole row ties
        x = torch.zeros(rows, vocab)
    elif kind == "neg_inf":  # masked earlier (logit bias, min-p)
        x[:, : vocab // 3] = float("-inf")
    elif kind == "peaked":  # one token holds almost all mass (top-p keeps one)
        x[:, 0] += 40.0
    return x


CASES = [
    pytest.param(kind, rows, vocab, id=f"{kind}-r{rows}-v{vocab}")
    for kind, rows, vocab in [
        ("random", 1, 1), ("random", 3, 7), ("ties", 5, 100), ("flat", 2, 33),
        ("neg_inf", 4, 8193), ("peaked", 3, 8193), ("random", 8, 49152),
        ("ties", 8, 49152),
    ]
]


@pytest.mark.parametrize("kind,rows,vocab", CASES)
@pytest.mark.parametrize("with_k", [False, True], ids=["top_p", "top_k_top_p"])
def test_equals_vllms_function(kind, rows, vocab, with_k):
    g = torch.Generator().manual_seed(zlib.crc32(f"{kind}{rows}{vocab}{with_k}".encode()))
    for _ in range(6):
        x = _rows(kind, rows, vocab, g)
        p = torch.rand(rows, generator=g) * 0.98 + 0.01
        p[0] = 1.0  # a request without top-p beside ones with it
        k = None
        if with_k:
            k = torch.randint(1, vocab + 1, (rows,), generator=g)
            k[-1] = vocab  # a request without top-k
            if rows > 2:
                k[1] = 1
        want = _vllm(x, k, p)
        got = apply_top_k_top_p_values_sorted(x.clone(), k, p)
        assert torch.equal(torch.isinf(got), torch.isinf(want))
        assert torch.equal(got, want)


def test_nan_rows_are_vllms():
    x = torch.randn(3, 500)
    x[1, 17] = float("nan")
    p = torch.full((3,), 0.9)
    want, got = _vllm(x, None, p), apply_top_k_top_p_values_sorted(x.clone(), None, p)
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got.nan_to_num(), want.nan_to_num())


def test_without_top_p_it_is_vllms_call():
    """Top-k alone (vLLM's path without a sort) and no filter at all pass through."""
    x = torch.randn(4, 300)
    k = torch.tensor([1, 5, 300, 17])
    assert torch.equal(apply_top_k_top_p_values_sorted(x.clone(), k, None), _vllm(x, k, None))
    assert torch.equal(apply_top_k_top_p_values_sorted(x.clone(), None, None), x)


def test_ties_at_the_cut_take_vllms_path(monkeypatch):
    """A row whose equal logits straddle the top-p cut is decided by vLLM's function
    (which of the tied ids survive depends on its sort); other rows are not."""
    import vllm_dspine.verify.top_k_top_p as mod

    calls = []
    real = mod.apply_top_k_top_p
    monkeypatch.setattr(mod, "apply_top_k_top_p",
                        lambda x, k, p: calls.append(x.shape[0]) or real(x, k, p))
    # Row 0: four ids at 0.25 each; top-p 0.6 keeps 3 of them (cumulative 0.25, 0.5,
    # 0.75, 1.0 from the bottom: <= 0.4 masks one). Row 1: distinct values.
    x = torch.tensor([[0.0, 0.0, 0.0, 0.0], [0.0, 1.0, 2.0, 3.0]])
    p = torch.tensor([0.6, 0.6])
    got = mod.apply_top_k_top_p_values_sorted(x.clone(), None, p)
    assert calls == [1]
    assert torch.equal(got, _vllm(x, None, p))
    assert int(torch.isinf(got[0]).sum()) == 1
