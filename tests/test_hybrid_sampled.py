"""Sampled: DSpine's law == plain vLLM's on the hybrid pair's target (`full` tier,
docs/testing.md; the check's own power is tested in the default tier).

vLLM runs this target in bf16 only, so the law to match is plain vLLM's own (bf16),
not a float64 enumeration as in tests/test_exact_distribution.py: a two-sample
chi-square test per case and position on tokens 1-3 (2 and 3 are the ones speculation
emits: accepted drafts, corrections, bonus tokens), DSpine verifying exactly 2 drafts a
step.

Power. Two samples of n each from laws at total variation TV (on the test's bins): the
homogeneity statistic is noncentral with lambda = (n / 2) sum (q - p)^2 / m, m = (p + q)
/ 2, and lambda >= 2 n TV^2 (Cauchy-Schwarz, as in tests/exact_law.py: half the one-sample
noncentrality of n samples, so twice the samples for the same power). SAMPLED_N =
200,000 per case and engine detects TV 0.0094 (df 10) to 0.0099 (df 15) at power 0.9 with
threshold p < 1e-3 (`two_sample_detectable_tv`, asserted <= 0.01 per test; measured
df 4-7 at 6,000 samples; the check and its bound are tests/hybrid_fixtures.py's). 6,000, the earlier size, saw only TV 0.048-0.057. Cost: 1.2 million
3-token requests (measured 2026-12-03 on one core of the AVX-512 machine: 60,000 with the
two engine starts in 274 s, so about 77 minutes; the 36,000 of 6,000 per case took
2,171.8 s in a fresh-clone CI run on an AVX2 CPU, docs/hybrid.md).

The trained pair is conftest.py's `hybrid_trained_pair` (the committed distilled drafter).
"""

from __future__ import annotations

import os

import pytest
import torch

from hybrid_fixtures import ALPHA, POWER, engine_kw, two_sample, two_sample_detectable_tv
from hybrid_fixtures import offline  # noqa: F401 - autouse: no model hub
from vllm_dspine.pairs.hybrid import TARGET_SIZES
from vllm_dspine.serving.metrics import ACCEPTED_PER_POS, NUM_DRAFTS, spec_decode_counters


@pytest.fixture(scope="module")
def trained_pair(hybrid_trained_pair):
    return hybrid_trained_pair  # conftest.py: the committed distilled drafter


SAMPLED_N = int(os.environ.get("DSPINE_HYBRID_SAMPLES", "200000"))  # per case and engine
TV = 0.01
SAMPLED_CASES = {"t1": dict(temperature=1.0), "t0.7_top_k8": dict(temperature=0.7, top_k=8),
                 "t0.8_top_p0.9": dict(temperature=0.8, top_p=0.9)}
SAMPLED_PROMPT = list(b"the quick brown fox jumps over")


def _sample_tokens(llm) -> dict[str, torch.Tensor]:
    from vllm import SamplingParams, TokensPrompt

    names = list(SAMPLED_CASES)
    params = [SamplingParams(max_tokens=3, ignore_eos=True, detokenize=False, **SAMPLED_CASES[c])
              for c in names]
    k = len(names)
    chunks = []
    # 20,000 requests per case at a time: 600,000 request outputs at once would hold
    # gigabytes of Python objects.
    for lo in range(0, SAMPLED_N, 20_000):
        n = min(20_000, SAMPLED_N - lo)
        outs = llm.generate([TokensPrompt(prompt_token_ids=SAMPLED_PROMPT)] * (n * k),
                            [params[i % k] for i in range(n * k)], use_tqdm=False)
        chunks.append(torch.tensor([list(o.outputs[0].token_ids) for o in outs]))  # [n k, 3]
    tokens = torch.cat(chunks).view(-1, k, 3)  # [N, k, 3]
    return {c: tokens[:, i] for i, c in enumerate(names)}


@pytest.fixture(scope="module")
def sampled(engines, trained_pair):
    from engine_utils import dspine_spec

    # Both engines run up to 128 requests at once: a plain engine of 16 at once (the
    # `plain_llm` of tests/test_hybrid_engine.py) took 15-25 minutes for 18,000
    # requests in a fresh-clone CI run (2026-12-02).
    batch = engine_kw(max_num_seqs=128, max_num_batched_tokens=128 * 16, max_model_len=64)
    with engines.private(trained_pair.target_dir, **batch) as plain:
        want = _sample_tokens(plain)
    with engines.private(trained_pair.target_dir,
                         dspine_spec(trained_pair.draft_dir, dspine_verify="fixed",
                                     dspine_verify_max=2), **batch) as llm:
        got = _sample_tokens(llm)
        counters = spec_decode_counters(llm)
        per_pos, drafts = counters[ACCEPTED_PER_POS], counters[NUM_DRAFTS]
    return want, got, per_pos, drafts


@pytest.mark.engine
@pytest.mark.full
@pytest.mark.parametrize("case", list(SAMPLED_CASES))
def test_dspine_samples_follow_plain_vllm(sampled, case):
    """Sampled requests: DSpine's tokens 1-3 follow plain vLLM's law (p > 1e-3 per case
    and position, the test detecting TV 0.01 at power 0.9); drafts 1 and 2 are accepted
    on some steps, so the commit replays 1, 2 and 3 positions."""
    want, got, per_pos, drafts = sampled
    assert per_pos[0] > 0 and per_pos[1] > 0, (per_pos, drafts)
    V = TARGET_SIZES["vocab_size"]
    for pos in (0, 1, 2):
        p, df = two_sample(got[case][:, pos], want[case][:, pos], V)
        tv90 = two_sample_detectable_tv(df, SAMPLED_N)
        print(f"{case} token {pos + 1}: two-sample chi-square p = {p:.3g}, df {df}, "
              f"N {SAMPLED_N} + {SAMPLED_N}, TV {tv90:.4f} at power {POWER}; accepted per "
              f"position {per_pos[:3]} of {drafts}")
        assert p > ALPHA, f"{case}: token {pos + 1} does not follow plain vLLM's law (p {p:.2e})"
        assert tv90 <= TV, f"{case}: token {pos + 1}: detects only TV {tv90:.4f} (df {df})"


def test_two_sample_check_detects_a_shifted_law():
    """The check can fail (its sensitivity at the full tier's sample size): samples of
    SAMPLED_N from two laws at total variation 0.01 are rejected; two samples of one law
    are not; and the worst-case bound gives TV <= 0.01 at power 0.9 up to df 15."""
    assert two_sample_detectable_tv(15, SAMPLED_N) <= TV
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(512, generator=g) * 2.5, 0)
    q = p.clone()
    order = p.argsort(descending=True)
    q[order[:4]] *= 1 + TV / float(p[order[:4]].sum())
    q[order[4:]] *= 1 - TV / float(p[order[4:]].sum())
    q /= q.sum()
    assert abs(0.5 * float((q - p).abs().sum()) - TV) < 1e-4
    a = torch.multinomial(p, SAMPLED_N, True, generator=g)
    b = torch.multinomial(q, SAMPLED_N, True, generator=g)
    c = torch.multinomial(p, SAMPLED_N, True, generator=g)
    assert two_sample(a, b, 512)[0] < ALPHA
    assert two_sample(a, c, 512)[0] > ALPHA
