"""What the hybrid-pair test modules share (tests/test_hybrid_*.py): the autouse fixture
that keeps transformers off the model hub, the engine settings and helpers of the
engine modules (their engines come from the session's registry, conftest.py), the greedy
workload and its comparison with plain vLLM up to bf16 near-ties, the two-sample
check of tests/test_hybrid_sampled.py and
the own-law check (tests/test_hybrid_sliding_window.py). Import the
fixture into a module (`from hybrid_fixtures import offline`) for it to apply there. The
trained hybrid pair is the session fixture `hybrid_trained_pair` of conftest.py (the
committed distilled drafter, tests/trained_drafters.py, for tests/test_hybrid_engine.py
and tests/test_hybrid_sampled.py)."""

from __future__ import annotations

import importlib

import pytest
import torch

# bf16: the only dtype vLLM's CPU GDN path runs.
ENGINE_KW = dict(dtype="bfloat16", enable_prefix_caching=False, max_num_seqs=16)
# Plain vLLM on the hybrid pair's target: one engine from the session's registry serves
# tests/test_hybrid_engine.py and tests/test_hybrid_sliding_window.py (2048: the
# sliding-window module's context, above its drafter's 64-position window and below its
# 8192 one).
PLAIN_KW = dict(ENGINE_KW, max_model_len=2048)


# The dynamic policy with a cost model injected instead of measured (docs/serving.md,
# `dspine_verify_cost`): a verification step costs 20 ms plus 0.02 ms a target token,
# the drafter 1 ms. The lengths it verifies then follow the drafts' confidence and the
# acceptance observed, not step times measured on a machine that may be busy (a measured
# model made the greedy test fail once under load: it verified other lengths, which moved
# the bf16 near-ties). Measured with this model on `greedy_workload` (the drafter without
# a window), twice: drafts accepted at positions 1-3 [146, 13, 1] and [145, 14, 1], 124
# and 96 of 714 request-steps without drafts (with the drafter at 5 ms: [38, 4, 1], too
# few at position 2 for a margin). The measured model's choices are tested without an
# engine (tests/test_dynamic_policy.py, `test_measured_cost_*`).
INJECTED_COST = {"step_s": 0.02, "token_s": 0.00002, "draft_s": 0.001}


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")


def qwen3_5_importable() -> bool:
    """vLLM's Qwen3.5 module imports its vision sibling, which needs torchvision (absent
    here); the plugin's patches must make the text model importable without it."""
    from vllm_dspine.plugin import register

    register()
    try:
        importlib.import_module("vllm.model_executor.models.qwen3_5")
    except ImportError:
        return False
    return True


def engine_kw(**kw) -> dict:
    """ENGINE_KW overridden by `kw`: the arguments of a hybrid engine from the session's
    registry (`engines.get(target, spec, **engine_kw(...))`, conftest.py)."""
    return {**ENGINE_KW, **kw}


def engine_metric(llm, name: str):
    """vLLM's metric object `name` of an engine in this process (`LLM.get_metrics()`)."""
    for m in llm.get_metrics():
        if m.name == name:
            return m
    raise KeyError(f"vLLM exposes no metric {name!r}")


def tokens_of(outs) -> list[list[int]]:
    """The generated token ids of each of vLLM's request outputs."""
    return [list(o.outputs[0].token_ids) for o in outs]


def greedy_workload(n: int = 32):
    """n prompts of 3..300 tokens (longer than a 64-position drafter window); max_tokens
    1..40, a few of them 1-3 (so requests meet max_tokens with drafts cut short or none:
    zero-draft steps)."""
    from vllm import SamplingParams

    from engine_utils import prompts_of_lengths

    prompts = prompts_of_lengths(n, longest=300)
    lens = [(1, 2, 3)[i // 8] if i % 8 == 0 and i < 24 else 24 + (5 * i) % 17
            for i in range(n)]
    return prompts, [SamplingParams(temperature=0.0, max_tokens=m) for m in lens]


# bf16 is the only dtype vLLM's CPU GDN path runs, and DSpine's verify forward and replay
# commit reach the same state as plain decoding through different kernels (fp32
# differences ~1e-3 relative; a preempted request is recomputed by the chunked prefill
# kernel): greedy outputs are compared as equal up to the first bf16 near-tie, where
# both engines' tokens have fp32 reference logits (~10-14 here, bf16 spacing 0.0625)
# within NEAR_TIE of the best (usually the top-2; on 2026-12-02 a fork after preemption
# took a token outside the top-2, whose logits were 0.033 apart, so membership of the
# top-2 is not the criterion). Measured (docs/hybrid.md, "Exactness on CPU"): with the
# replay commit every fork at a gap <= 0.14 (0.21 once, after a preemption); with a
# commit one position short, 0 of 32 prompts identical and most forks at gaps 0.4 .. 5.4.
NEAR_TIE = 0.25


def fp32_logits(reference, prefix: list[int]) -> torch.Tensor:
    """The fp32 reference's next-token logits after `prefix` (no cache: transformers'
    cache of an all-GDN model has no length to report; a whole-prefix forward runs the
    same chunked kernels either way)."""
    with torch.no_grad():
        return reference(torch.tensor([prefix]), use_cache=False).logits[0, -1]  # [vocab]


def assert_equal_up_to_near_ties(reference, outs, want, min_identical: float = 0.4):
    """Every request's greedy tokens equal `want`'s, or fork where both tokens' fp32
    reference logits on the common prefix lie within NEAR_TIE of the best one (a bf16
    near-tie: two, sometimes three, tokens that close); at least `min_identical` of the
    requests identical throughout."""
    identical, gaps = 0, []
    for i, (o, w) in enumerate(zip(outs, want)):
        g = list(o.outputs[0].token_ids)
        if g == w:
            identical += 1
            continue
        d = next((t for t in range(min(len(g), len(w))) if g[t] != w[t]), None)
        assert d is not None, f"request {i}: {len(g)} tokens, plain vLLM {len(w)}"
        logits = fp32_logits(reference, list(o.prompt_token_ids) + w[:d])
        best = float(logits.max())
        ours, theirs = best - float(logits[g[d]]), best - float(logits[w[d]])
        gap = max(ours, theirs)
        gaps.append(gap)
        top = logits.topk(3)
        assert gap < NEAR_TIE, \
            f"request {i} forks from plain vLLM at token {d} ({g[d]} vs {w[d]}, " \
            f"{ours:.3f} and {theirs:.3f} below the fp32 best; fp32 top-3 " \
            f"{top.indices.tolist()} at {[round(float(v), 3) for v in top.values]}): " \
            f"not a near-tie"
    print(f"identical {identical} of {len(want)}; fork gaps "
          f"{[round(x, 3) for x in sorted(gaps)]}")  # pytest -s: the figures docs/hybrid.md cites
    assert identical >= min_identical * len(want), (identical, len(want))


# The two-sample check of the sampled tests: vLLM runs the hybrid target in bf16 only, so
# DSpine's tokens are compared with plain vLLM's samples (tests/test_hybrid_sampled.py's
# docstring derives the power). Threshold and power of every sampled hybrid test:
ALPHA = 1e-3
POWER = 0.9


def two_sample(x: torch.Tensor, y: torch.Tensor, V: int) -> tuple[float, int]:
    """Chi-square homogeneity of two token samples over bins (tokens >= 2 % of the pooled
    sample alone, the rest together). Returns (p-value, degrees of freedom)."""
    from scipy.stats import chi2_contingency

    cx, cy = torch.bincount(x, minlength=V).double(), torch.bincount(y, minlength=V).double()
    pooled = (cx + cy) / (cx.sum() + cy.sum())
    big = pooled >= 0.02
    table = torch.stack([torch.cat([c[big], c[~big].sum().view(1)]) for c in (cx, cy)])
    table = table[:, table.sum(0) > 0]
    return float(chi2_contingency(table.numpy())[1]), table.shape[1] - 1


def two_sample_detectable_tv(df: int, n: int) -> float:
    """The smallest TV the two-sample test (two samples of n, df, threshold ALPHA)
    detects with power POWER in the worst case (noncentrality 2 n TV^2)."""
    from scipy.optimize import brentq
    from scipy.stats import chi2, ncx2

    crit = chi2.isf(ALPHA, df)
    return float(brentq(lambda tv: ncx2.sf(crit, df, 2 * n * tv * tv) - POWER, 1e-5, 1.0))


# The own-law check (tests/test_hybrid_sliding_window.py's sampled test): each sampled token
# against the law the target's forward computed for it, read from vLLM's logprobs. On this
# bf16-only target two engines' forwards differ by more than the sampler errors a test
# should see (docs/hybrid.md, "KV cache groups": plain vLLM's decode step and DSpine's
# verify forward are 0.024 apart in TV, identical requests get 10-11 laws per engine), so
# exactness of the sampling is tested given the law each token was drawn from, not
# against another engine's samples.
#
# Statistic. Sample i has the law p_i (its row's softmax) and the token x_i. O_v =
# #{i: x_i = v}, E_v = sum_i p_i(v). Under H0 (x_i ~ p_i given everything before it) O - E
# is a sum of martingale differences with covariance S = diag(E) - sum_i p_i p_i^T, so
# X = sum_v (O_v - E_v)^2 / E_v over the bins tends to sum_k w_k chi2_1 with w_k the
# eigenvalues of I - (1/N) sum_i a_i a_i^T, a_i = p_i / sqrt(E / N): one of them is 0
# (eigenvector sqrt(E)), the others lie in [0, 1] (1 when all p_i are equal). X is then
# stochastically at most chi2(bins - 1): the p-value of chi2(bins - 1) is conservative.
# Power: samples drawn from q_i instead, whose mean law is at total variation TV from the
# mean of the p_i on the bins: E[O - E] = N d (d the difference of the mean laws), and the
# noncentrality N sum_v d_v^2 / pbar_v >= N (sum_v |d_v|)^2 = 4 N TV^2 (Cauchy-Schwarz):
# twice the two-sample test's 2 n TV^2 per sample, so half the samples for the same power.
def own_law(observed: torch.Tensor, expected: torch.Tensor,
            min_share: float = 0.02) -> tuple[float, int]:
    """Pearson chi-square of token counts `observed` [V] against `expected` [V] (the sum
    over the samples of each sample's own law) over bins: tokens with `expected` >=
    `min_share` of the samples alone, the rest pooled. Returns (p-value of chi2(bins - 1),
    degrees of freedom)."""
    from scipy.stats import chi2

    o, e = observed.double(), expected.double()
    n = float(o.sum())
    assert abs(float(e.sum()) - n) < 1e-3 * n, (float(e.sum()), n)  # laws sum to 1
    big = e >= min_share * n
    o = torch.cat([o[big], o[~big].sum().view(1)])
    e = torch.cat([e[big], e[~big].sum().view(1)])
    keep = e > 0
    assert bool((o[~keep] == 0).all()), "a token of law 0 was sampled"
    o, e = o[keep], e[keep]
    df = int(o.numel()) - 1
    return float(chi2.sf(float(((o - e) ** 2 / e).sum()), df)), df


def own_law_detectable_tv(df: int, n: int) -> float:
    """The smallest TV the own-law check (n samples, df, threshold ALPHA) detects with
    power POWER in the worst case (noncentrality 4 n TV^2)."""
    from scipy.optimize import brentq
    from scipy.stats import chi2, ncx2

    crit = chi2.isf(ALPHA, df)
    return float(brentq(lambda tv: ncx2.sf(crit, df, 4 * n * tv * tv) - POWER, 1e-5, 1.0))
