"""`apply_top_k_top_p_values_sorted` (vllm_dspine/verify/top_k_top_p.py) against vLLM
0.32.0's own `apply_top_k_top_p_pytorch`, the function vLLM's CPU sampler runs: the
results must be `torch.equal` (the same -inf positions, every kept value's bits), on
rows built to be awkward: ties at the cut, -inf, NaN, top-p 1.0, top-k 1 and vocab,
vocabularies of 1 to 49,152 ids; on rows shaped like a language model's, which the fast
path (the 256 largest values, no sort) decides; and with 1 - p placed on vLLM's own last
bit, which it must leave to the sort."""

from __future__ import annotations

import zlib

import pytest
import torch

from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch

from vllm_dspine.verify.synthetic import language_model_logits
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


def test_top_values_decide_language_model_rows():
    """The fast path (the largest 256 values, no sort) decides nearly every row shaped
    like the target's, and what it decides is vLLM's result. On SmolLM2's own chat
    logits it decided 99.9 % of 7,990 rows at top-p 0.95 (docs/verify.md); a regression
    that sends every row to the sort would still be exact, so the share is asserted."""
    import vllm_dspine.verify.top_k_top_p as mod

    g = torch.Generator().manual_seed(7)
    decided = total = 0
    for p_value in (0.95, 0.9, 0.8):
        x = language_model_logits(48, 49152, g)
        p = torch.full((48,), p_value)
        found = mod._top_p_from_top_values(x, p)
        decided += int((found.decided | found.keep_all).sum())
        total += 48
        assert torch.equal(apply_top_k_top_p_values_sorted(x.clone(), None, p), _vllm(x, None, p))
    assert decided >= 0.9 * total


def test_a_cut_at_vllms_own_cumulative_probability_is_never_guessed():
    """1 - p placed exactly on vLLM's float32 cumulative probability at a position (p <=
    0.5, where 1 - (1 - c) is exact in float32): the kept set then hangs on vLLM's last
    bit, so the fast path must hand the row to the sort; one float32 step of 1 - p to
    either side must still give vLLM's result, whichever path takes it."""
    import numpy as np

    import vllm_dspine.verify.top_k_top_p as mod

    g = torch.Generator().manual_seed(11)
    # Flatter rows: vLLM's cumulative probability with m = 3 / 20 / 90 kept is ~0.998 /
    # 0.990 / 0.968 (medians), in [0.5, 1) where the round trip is exact.
    x = language_model_logits(64, 8192, g) * 0.15
    cum = torch.cumsum(torch.from_numpy(np.sort(x.numpy(), axis=-1)).softmax(dim=-1), dim=-1)
    on_cut = 0
    for row in range(64):
        for m in (3, 20, 90):
            c = cum[row, -1 - m]  # vLLM's value with m ids kept
            if not 0.5 <= float(c) < 1.0:
                continue
            for cut in (c, torch.nextafter(c, torch.tensor(0.0)),
                        torch.nextafter(c, torch.tensor(1.0))):
                p = (1 - cut).reshape(1)
                assert float(1 - p) == float(cut)
                got = apply_top_k_top_p_values_sorted(x[row:row + 1].clone(), None, p)
                assert torch.equal(got, _vllm(x[row:row + 1], None, p))
            found = mod._top_p_from_top_values(x[row:row + 1], (1 - c).reshape(1))
            assert not bool(found.decided | found.keep_all)
            on_cut += 1
    assert on_cut >= 50  # enough rows reached the exact case


def test_the_bound_holds_vllms_cumulative_probabilities_with_room():
    """vLLM's own float32 cumulative probability at every cut among the 256 largest
    (sorted softmax, cumsum) lies within the fast path's error bound of its float64
    value, by a factor of 10 at least (on SmolLM2's logits the largest deviation was
    under 1 % of the bound, bench/bench_cpu_ops.py): a bound too tight for vLLM's
    arithmetic would fail here before it decided a row wrongly."""
    import numpy as np

    import vllm_dspine.verify.top_k_top_p as mod

    g = torch.Generator().manual_seed(5)
    for x in (language_model_logits(32, 49152, g), torch.randn(8, 4096, generator=g) * 2):
        vllm_cum = torch.cumsum(
            torch.from_numpy(np.sort(x.numpy(), axis=-1)).softmax(dim=-1), dim=-1)
        found = mod._top_p_from_top_values(x, torch.full((len(x),), 0.95))
        width = found.cumulative.shape[1]
        at_cut = vllm_cum[:, -1 - torch.arange(width)].double()  # vLLM's c_m, m = 0 .. K
        assert bool(((at_cut - found.cumulative).abs() <= found.error / 10).all())


def test_top_p_one_beside_a_few_finite_logits_keeps_them_all():
    """Top-p 1.0 keeps every id of nonzero probability. Rows with only 100 finite logits
    (the rest -inf from earlier masks), spread over 10 or 90 units: the mass past the
    100 largest is exactly 0, where the fast path's cumulative probability cancels to
    ~1e-16 of either sign; it must not read that as a cut."""
    x = torch.full((2, 4096), float("-inf"))
    x[0, :100] = torch.linspace(0, -10, 100)
    x[1, :100] = torch.linspace(0, -90, 100)
    p = torch.ones(2)
    got = apply_top_k_top_p_values_sorted(x.clone(), None, p)
    assert torch.equal(got, _vllm(x, None, p))
    assert int(torch.isfinite(got[0]).sum()) == 100  # row 1: vLLM's underflow decides
