"""Sampled: DSpine's law == plain vLLM's on the hybrid pair's target.

vLLM runs this target in bf16 only, so the law to match is plain vLLM's own (bf16),
not a float64 enumeration as in tests/test_exact_distribution.py: a two-sample
chi-square test per case and position on tokens 2 and 3 (the ones speculation emits:
accepted drafts, corrections, bonus tokens), DSpine verifying exactly 2 drafts a step.

The trained pair is conftest.py's `hybrid_trained_pair` (distilled once per session).
Slow on an AVX2 CPU: the fixture took 2,171.8 s in a fresh-clone CI run (docs/hybrid.md).
"""

from __future__ import annotations

import pytest
import torch

from hybrid_fixtures import close_engine, hybrid_engine
from hybrid_fixtures import offline  # noqa: F401 - autouse: no model hub
from vllm_dspine.pairs.hybrid import TARGET_SIZES
from vllm_dspine.serving.metrics import ACCEPTED_PER_POS, NUM_DRAFTS, spec_decode_counters


@pytest.fixture(scope="module")
def trained_pair(hybrid_trained_pair):
    return hybrid_trained_pair  # conftest.py: distilled once per session


SAMPLED_N = 6000  # requests per case and engine
SAMPLED_CASES = {"t1": dict(temperature=1.0), "t0.7_top_k8": dict(temperature=0.7, top_k=8),
                 "t0.8_top_p0.9": dict(temperature=0.8, top_p=0.9)}
SAMPLED_PROMPT = list(b"the quick brown fox jumps over")


def _sample_tokens(llm) -> dict[str, torch.Tensor]:
    from vllm import SamplingParams, TokensPrompt

    names = list(SAMPLED_CASES)
    params = [SamplingParams(max_tokens=3, ignore_eos=True, detokenize=False, **SAMPLED_CASES[c])
              for c in names]
    k = len(names)
    outs = llm.generate([TokensPrompt(prompt_token_ids=SAMPLED_PROMPT)] * (SAMPLED_N * k),
                        [params[i % k] for i in range(SAMPLED_N * k)], use_tqdm=False)
    tokens = torch.tensor([list(o.outputs[0].token_ids) for o in outs])  # [N k, 3]
    return {c: tokens[i::k] for i, c in enumerate(names)}


def _two_sample(x: torch.Tensor, y: torch.Tensor, V: int) -> tuple[float, int]:
    """Chi-square homogeneity of two token samples over bins (tokens >= 2 % of the pooled
    sample alone, the rest together). Returns (p-value, degrees of freedom)."""
    from scipy.stats import chi2_contingency

    cx, cy = torch.bincount(x, minlength=V).double(), torch.bincount(y, minlength=V).double()
    pooled = (cx + cy) / (cx.sum() + cy.sum())
    big = pooled >= 0.02
    rows = [torch.cat([c[big], c[~big].sum().view(1)]) for c in (cx, cy)]
    table = torch.stack(rows)
    table = table[:, table.sum(0) > 0]
    return float(chi2_contingency(table.numpy())[1]), table.shape[1] - 1


@pytest.fixture(scope="module")
def sampled(trained_pair):
    from engine_utils import dspine_spec

    # Both engines run up to 128 requests at once: a plain engine of 16 at once (the
    # `plain_llm` of tests/test_hybrid_engine.py) took 15-25 minutes for these 18,000
    # requests in a fresh-clone CI run (2026-12-02).
    batch = dict(max_num_seqs=128, max_num_batched_tokens=128 * 16, max_model_len=64)
    plain = hybrid_engine(trained_pair.target_dir, **batch)
    try:
        want = _sample_tokens(plain)
    finally:
        plain.llm_engine.engine_core.shutdown()
        del plain
    llm = hybrid_engine(trained_pair.target_dir,
                        dspine_spec(trained_pair.draft_dir, dspine_verify="fixed",
                                    dspine_verify_max=2), **batch)
    try:
        got = _sample_tokens(llm)
        counters = spec_decode_counters(llm)
        per_pos, drafts = counters[ACCEPTED_PER_POS], counters[NUM_DRAFTS]
    finally:
        close_engine(llm)
    return want, got, per_pos, drafts


@pytest.mark.engine
@pytest.mark.parametrize("case", list(SAMPLED_CASES))
def test_dspine_samples_follow_plain_vllm(sampled, case):
    """Sampled requests: DSpine's tokens 2 and 3 follow plain vLLM's law (p > 1e-3 per
    case and position); drafts 1 and 2 are accepted on some steps, so the commit
    replays 1, 2 and 3 positions."""
    want, got, per_pos, drafts = sampled
    assert per_pos[0] > 0 and per_pos[1] > 0, (per_pos, drafts)
    V = TARGET_SIZES["vocab_size"]
    for pos in (0, 1, 2):
        p, df = _two_sample(got[case][:, pos], want[case][:, pos], V)
        print(f"{case} token {pos + 1}: two-sample chi-square p = {p:.3g}, df {df}, "
              f"N {SAMPLED_N} + {SAMPLED_N}; accepted per position {per_pos[:3]} of {drafts}")
        assert p > 1e-3, f"{case}: token {pos + 1} does not follow plain vLLM's law (p {p:.2e})"


def test_two_sample_check_detects_a_shifted_law():
    """The check can fail (its sensitivity at these sample sizes): samples of SAMPLED_N
    from two laws at total variation 0.05 are rejected; two samples of one law are not."""
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(512, generator=g) * 2.5, 0)
    q = p.clone()
    order = p.argsort(descending=True)
    q[order[:4]] *= 1 + 0.05 / float(p[order[:4]].sum())
    q[order[4:]] *= 1 - 0.05 / float(p[order[4:]].sum())
    q /= q.sum()
    assert abs(0.5 * float((q - p).abs().sum()) - 0.05) < 1e-3
    a = torch.multinomial(p, SAMPLED_N, True, generator=g)
    b = torch.multinomial(q, SAMPLED_N, True, generator=g)
    c = torch.multinomial(p, SAMPLED_N, True, generator=g)
    assert _two_sample(a, b, 512)[0] < 1e-3
    assert _two_sample(a, c, 512)[0] > 1e-3
