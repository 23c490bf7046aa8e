"""Goodness of fit of vLLM + dspine samples against the target's *exact* distribution.

On the tiny pair (vocabulary 512, distilled drafter) the marginal distributions of the
2nd and 3rd generated tokens (the ones speculation produces: accepted drafts,
corrections, bonus tokens) are computed exactly, by enumerating the 1st and 2nd tokens
with the target itself (transformers, float64) and applying each request's processing
as vLLM 0.32.0 defines it (logit bias, then repetition/frequency/presence penalties,
then temperature, min-p, top-k, top-p; `vllm/v1/sample/sampler.py`). One DSpine engine
samples every case in one mixed batch (so each step's batch mixes all the cases'
parameters) and a chi-square goodness-of-fit test per case and position compares the
counts with the exact marginal. The engine verifies exactly 2 drafts per step
(`dspine_verify: fixed`, `dspine_verify_max: 2`): tokens 2 and 3 then come from the
acceptance of draft 1 and 2, their corrections, or a bonus token, and a step costs 3
target positions per request instead of 16.

Power. For a sampler whose output law q is at total variation TV from the exact p on
the test's bins, the chi-square statistic is noncentral with lambda = N sum (q-p)^2/p
>= 4 N TV^2 (Cauchy-Schwarz; equality only for the least detectable deviation, q - p
proportional to p with signs splitting p's mass in halves, `_least_detectable`).
`_detectable_tv` is the TV at which that bound gives power 0.9 for the test's own
degrees of freedom and threshold; each test prints it with the power at TV 0.01 and
asserts it. Detecting TV 0.01 at power 0.9 needs ~50,000-90,000 samples per case
(df 1-11); this machine draws ~375 samples/s through the drafter (measured, 8 cases x
16,000 in 342 s), so the default (`DSPINE_EXACT_SAMPLES`, 16,000 per case, ~7 minutes
for the file) detects TV 0.020-0.024 at power 0.9 (asserted <= 0.025; its power at
TV 0.01 is only 0.04-0.12, printed), and `DSPINE_EXACT_SAMPLES=100000` reaches the 0.01
level (asserted from 100,000; 64,000 was measured to fall short: TV 0.0101-0.0119 at
power 0.9 for df 3-11). Measured 2026-12-01 with 100,000: 12 passed in 18 minutes on one
core beside other work, all 16 p-values 0.12-0.94, TV at power 0.9 0.0077-0.0097. Bins: every token expected >= 2 % alone, the rest
together, so the TV that counts is that of this binning (mass moved only among tokens
rarer than 2 % can hide; the support check still sees any emitted token of exact
probability 0, at any sample size).

Threshold: p-value > 1e-3 per test (16 tests: a correct sampler fails one with
probability < 2 %; the engine seed is fixed, so the outcome is reproducible).

Exactness of the reference: paths of probability < 1e-8 are pruned (the pruned mass
is asserted < 5e-4, see `test_reference_is_exact_enough`), and the mass of tokens within
1e-5 of a top-k/top-p/min-p threshold (where float32 rounding could decide the other
way) is asserted < 1e-5.
"""

from __future__ import annotations

import copy
import os
import time
from dataclasses import dataclass, field

import pytest
import torch

from engine_utils import dspine_spec, make_llm
from vllm_dspine.serving.metrics import spec_decode_counters

pytestmark = pytest.mark.engine

PROMPT = list(b"abcdefg")  # byte tokens; the planted habit continues with "hij..."
TV = 0.01
ALPHA = 1e-3
POWER = 0.9
PRUNE = 1e-8  # paths below this probability are not enumerated
AMBIGUITY = 1e-5  # relative slack within which a threshold decision counts as ambiguous
BIN_MIN = 0.02  # tokens expected at least this often get a bin of their own
# Samples per case (module docstring): the TV each test must detect at power 0.9.
SAMPLES = int(os.environ.get("DSPINE_EXACT_SAMPLES", "16000"))
ASSERTED_TV = 0.01 if SAMPLES >= 100000 else 0.025


@dataclass(frozen=True)
class Case:
    name: str
    temperature: float
    prompt: tuple[int, ...] = tuple(PROMPT)
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)

    def sampling_params(self):
        from vllm import SamplingParams

        return SamplingParams(
            temperature=self.temperature, top_k=self.top_k, top_p=self.top_p,
            min_p=self.min_p, repetition_penalty=self.repetition_penalty,
            frequency_penalty=self.frequency_penalty,
            presence_penalty=self.presence_penalty,
            logit_bias=dict(self.logit_bias) or None, max_tokens=3, ignore_eos=True,
            detokenize=False)


# Each feature on its own, at a temperature where the enumeration is cheap (the tiny
# target is flat: at T 1 its 99.9 % support is ~500 tokens) and drafts are accepted.
# Logit bias bans the habit's continuations 'h' and 'i' and favours 'x': the drafter
# (which never sees the bias) keeps proposing them, so the verifier must apply it.
CASES = [
    Case("plain", temperature=0.35),
    Case("top_k", temperature=0.8, top_k=6),
    Case("top_p", temperature=0.6, top_p=0.75),
    Case("min_p", temperature=0.7, min_p=0.12),
    # The habit's continuations h, i, j are in this prompt: the penalty hits them.
    Case("repetition", temperature=0.35, prompt=tuple(b"hijkabcdefg"),
         repetition_penalty=1.6),
    # Negative (allowed: [-2, 2]) so that the penalty bites at tokens 2 and 3: the
    # habit rarely repeats a token, so a positive one would change almost nothing.
    Case("frequency", temperature=0.5, frequency_penalty=-2.0),
    Case("presence", temperature=0.5, presence_penalty=-2.0),
    Case("logit_bias", temperature=0.35, logit_bias={ord("h"): -100.0, ord("q"): 3.0}),
]


# --------------------------------------------------------------- exact reference
def _processed_probs(case: Case, logits: torch.Tensor, prompt: list[int],
                     outputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's processing of one sampling step, in float64, for a batch of histories.

    logits [B, V] raw; outputs [B, n] the tokens generated so far (n may be 0).
    Returns (probs [B, V], ambiguous [B]): the processed distribution and, per row, the
    probability of tokens whose fate at a min-p/top-k/top-p threshold is within
    `AMBIGUITY` (float32 rounding could decide it the other way).
    """
    x = logits.double().clone()
    B, V = x.shape
    for tok, bias in case.logit_bias.items():  # LogitBiasLogitsProcessor
        x[:, tok] += bias
    counts = torch.zeros(B, V, dtype=torch.float64)
    if outputs.numel():
        counts.scatter_add_(1, outputs, torch.ones_like(outputs, dtype=torch.float64))
    seen_out = counts > 0
    if case.repetition_penalty != 1.0:  # apply_repetition_penalties: prompt | output
        seen = seen_out.clone()
        seen[:, prompt] = True
        rp = case.repetition_penalty
        x = torch.where(seen, torch.where(x > 0, x / rp, x * rp), x)
    x = x - case.frequency_penalty * counts - case.presence_penalty * seen_out.double()
    x = x / case.temperature
    ambiguous = torch.zeros(B, dtype=torch.float64)
    probs = x.softmax(-1)
    if case.min_p > 0:  # MinPLogitsProcessor: drop p < min_p * max p
        thresh = case.min_p * probs.amax(-1, keepdim=True)
        near = (probs - thresh).abs() <= AMBIGUITY * thresh
        ambiguous += (probs * near).sum(-1)
        x = torch.where(probs < thresh, float("-inf"), x)
    if case.top_k > 0:  # keep logits >= the k-th largest
        top = x.topk(case.top_k + 1, dim=-1).values
        kth, nxt = top[:, -2:-1], top[:, -1:]
        # A near-tie between the k-th and the (k+1)-th: the (k+1)-th token's fate.
        tie = ((kth - nxt).abs() <= AMBIGUITY * kth.abs().clamp(min=1.0)).squeeze(1)
        ambiguous += torch.where(tie, (nxt.squeeze(1) - x.logsumexp(-1)).exp(), 0.0)
        x = torch.where(x < kth, float("-inf"), x)
    if case.top_p < 1.0:  # ascending cumulative mass <= 1 - top_p is dropped
        p_now = x.softmax(-1)
        sorted_p, order = p_now.sort(-1)
        cum = sorted_p.cumsum(-1)
        drop = cum <= 1 - case.top_p
        drop[:, -1] = False
        near = (cum - (1 - case.top_p)).abs() <= AMBIGUITY
        ambiguous += (sorted_p * near).sum(-1)
        x = x.scatter(1, order, torch.where(drop, float("-inf"), x.gather(1, order)))
    return x.softmax(-1), ambiguous


@dataclass
class Exact:
    token2: torch.Tensor  # [V] marginal of the 2nd generated token
    token3: torch.Tensor  # [V] marginal of the 3rd
    support1: torch.Tensor  # [V] bool: tokens the 1st step can emit
    prob1: torch.Tensor  # [V] the 1st token's law
    pruned1: float  # probability of the 1st tokens not enumerated
    pruned: float  # probability of the paths not enumerated (1st and 2nd tokens)
    ambiguous: float  # probability of threshold decisions within rounding


@torch.no_grad()
def exact_marginals(model, case: Case) -> Exact:
    """Enumerate token 1 and token 2 (all paths of probability >= PRUNE) with the
    target in float64, reusing the KV cache of prompt + token 1 for token 3."""
    PROMPT = list(case.prompt)
    prompt = torch.tensor([PROMPT])
    V = model.config.vocab_size
    none = torch.zeros(1, 0, dtype=torch.long)
    out0 = model(prompt, use_cache=True)
    p1, amb1 = _processed_probs(case, out0.logits[:, -1], PROMPT, none)  # [1, V]
    p1 = p1[0]
    t1 = torch.nonzero(p1 >= PRUNE).squeeze(1)  # [n1]
    pruned1 = float(p1[p1 < PRUNE].sum())
    pruned = pruned1
    ambiguous = float(amb1[0])

    cache = copy.deepcopy(out0.past_key_values)
    cache.reorder_cache(torch.zeros(len(t1), dtype=torch.long))
    out1 = model(t1[:, None], past_key_values=cache, use_cache=True)
    p2, amb2 = _processed_probs(case, out1.logits[:, -1], PROMPT, t1[:, None])  # [n1, V]
    w1 = p1[t1]  # [n1]
    token2 = (w1[:, None] * p2).sum(0)
    ambiguous += float((w1 * amb2).sum())

    joint = w1[:, None] * p2  # [n1, V]
    keep = joint >= PRUNE
    pruned += float(joint[~keep].sum())
    rows, t2 = torch.nonzero(keep, as_tuple=True)  # pairs (t1 index, t2)
    token3 = torch.zeros(V, dtype=torch.float64)
    chunk = 4096
    for lo in range(0, len(rows), chunk):
        r, t = rows[lo:lo + chunk], t2[lo:lo + chunk]
        c = copy.deepcopy(out1.past_key_values)
        c.reorder_cache(r)
        out2 = model(t[:, None], past_key_values=c, use_cache=True)
        hist = torch.stack([t1[r], t], dim=1)  # [n, 2]
        p3, amb3 = _processed_probs(case, out2.logits[:, -1], PROMPT, hist)
        w = joint[r, t]  # [n]
        token3 += (w[:, None] * p3).sum(0)
        ambiguous += float((w * amb3).sum())
    return Exact(token2=token2, token3=token3, support1=p1 > 0, prob1=p1, pruned1=pruned1,
                 pruned=pruned, ambiguous=ambiguous)


# ------------------------------------------------------------------ statistics
def _bins(p: torch.Tensor, n: int) -> list[torch.Tensor]:
    """Token groups: every token with probability >= BIN_MIN alone, the rest together
    (dropped if it expects fewer than 5 samples)."""
    big = torch.nonzero(p >= BIN_MIN).squeeze(1)
    rest = torch.nonzero((p < BIN_MIN) & (p > 0)).squeeze(1)
    groups = [big[i:i + 1] for i in range(len(big))]
    if float(p[rest].sum()) * n >= 5:
        groups.append(rest)
    return groups


def _power_at_tv(df: int, n: int, tv: float = TV, alpha: float = ALPHA) -> float:
    """Power of the chi-square test (df, threshold alpha, n samples) against the least
    detectable law at total variation tv (noncentrality 4 n tv^2)."""
    from scipy.stats import chi2, ncx2

    return float(ncx2.sf(chi2.isf(alpha, df), df, 4 * n * tv * tv))


def _detectable_tv(df: int, n: int, power: float = POWER) -> float:
    """The smallest TV detected with `power` in the worst case."""
    from scipy.optimize import brentq

    return float(brentq(lambda tv: _power_at_tv(df, n, tv) - power, 1e-5, 1.0))


def _gof(tokens: torch.Tensor, p: torch.Tensor) -> tuple[float, int, float]:
    """Chi-square goodness of fit of the sampled tokens to p over `_bins`.
    Returns (p-value, degrees of freedom, power against TV 0.01)."""
    from scipy.stats import chisquare

    n = tokens.numel()
    counts = torch.bincount(tokens, minlength=p.numel()).double()
    groups = _bins(p, n)
    obs = torch.stack([counts[g].sum() for g in groups])
    exp = torch.stack([p[g].sum() for g in groups]) * n
    # Tokens outside every bin (probability too small to bin): pooled with the last.
    covered = torch.cat(groups)
    stray = float(counts.sum() - counts[covered].sum())
    obs[-1] += stray
    exp = exp * obs.sum() / exp.sum()
    df = len(groups) - 1
    return float(chisquare(obs.numpy(), exp.numpy()).pvalue), df, _power_at_tv(df, n)


# ---------------------------------------------------------------------- engine
@pytest.fixture(scope="module")
def pair(tiny_trained_pair):
    return tiny_trained_pair  # conftest.py: written once per session


@pytest.fixture(scope="module")
def exact(pair):
    from transformers import AutoModelForCausalLM

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = AutoModelForCausalLM.from_pretrained(pair.target_dir,
                                                     dtype=torch.float64).eval()
        t0 = time.perf_counter()
        out = {case.name: exact_marginals(model, case) for case in CASES}
        print(f"exact marginals of {len(CASES)} cases: {time.perf_counter() - t0:.1f} s")
    finally:
        torch.set_num_threads(threads)
    return out


@pytest.fixture(scope="module")
def samples(pair):
    """SAMPLES requests per case, all cases interleaved in one generate call (so each
    step's batch mixes every case's parameters)."""
    from vllm import TokensPrompt

    llm = make_llm(pair.target_dir,
                   dspine_spec(pair.draft_dir, dspine_verify="fixed", dspine_verify_max=2),
                   max_num_seqs=256, max_num_batched_tokens=256 * 16, max_model_len=64)
    prompts = [TokensPrompt(prompt_token_ids=list(c.prompt)) for c in CASES]
    params = [c.sampling_params() for c in CASES]
    n_cases = len(CASES)
    t0 = time.perf_counter()
    outs = llm.generate([prompts[i % n_cases] for i in range(SAMPLES * n_cases)],
                        [params[i % n_cases] for i in range(SAMPLES * n_cases)],
                        use_tqdm=False)
    m = spec_decode_counters(llm)
    print(f"{SAMPLES * n_cases} samples: {time.perf_counter() - t0:.1f} s; spec-decode "
          f"counters {m}")
    tokens = torch.tensor([list(o.outputs[0].token_ids) for o in outs])  # [n, 3]
    assert tokens.shape == (SAMPLES * n_cases, 3)
    import vllm.v1.worker.gpu_model_runner as gmr

    from vllm_dspine.plugin.patches import is_applied

    processors_built = is_applied(gmr.build_logitsprocs, "logitsprocs-for-dspine")
    del llm
    return {c.name: tokens[i::n_cases] for i, c in enumerate(CASES)}, m, processors_built


def test_reference_is_exact_enough(exact):
    """Mass not enumerated <= 5e-4 (measured 1e-5 .. 3e-4): wherever it goes it moves the
    expected bin probabilities by at most that, which adds < N * (5e-4)^2 / 0.02 < 1.3 to
    the noncentrality at N = 100,000 (bins hold >= 2 %) against critical values >= 10."""
    for name, e in exact.items():
        assert e.pruned < 5e-4 and e.ambiguous < 1e-5, (name, e.pruned, e.ambiguous)
        assert abs(float(e.token2.sum()) + e.pruned1 - 1.0) < 1e-9, name
        assert abs(float(e.token3.sum()) + e.pruned - 1.0) < 1e-9, name


def test_drafts_are_accepted(samples):
    """The acceptance path is what is tested, not only corrections: draft 1 and draft
    2 of a block are accepted in a good share of verification steps (measured 0.35 and
    0.12), and every step verified both drafts."""
    m = samples[1]
    drafts = m["vllm:spec_decode_num_drafts"]
    per_pos = m["vllm:spec_decode_num_accepted_tokens_per_pos"]
    assert m["vllm:spec_decode_num_draft_tokens"] == 2 * drafts
    assert per_pos[0] / drafts > 0.2 and per_pos[1] / drafts > 0.05, (per_pos, drafts)
    assert sum(per_pos[2:]) == 0


# vLLM 0.32.0's `build_logitsprocs` (vllm/v1/sample/logits_processor/__init__.py) builds
# only MinTokensLogitsProcessor when speculative decoding is on, so with dspine the
# MinP and LogitBias processors do not exist: min_p and logit_bias are silently ignored
# at every position, the first token included (the patch min-p-logit-bias-for-dspine
# only lifts vLLM's refusal). The fix is the patch logitsprocs-for-dspine (it builds the
# built-in processors for DSpine drafts); without it these two cases are expected to fail.
NEEDS_BUILTIN_PROCESSORS = {"min_p", "logit_bias"}


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_generated_tokens_follow_the_exact_distribution(case, exact, samples):
    tokens_of, _, processors_built = samples
    tokens = tokens_of[case.name]  # [N, 3]
    e = exact[case.name]
    try:
        _check_case(case, tokens, e)
    except AssertionError as err:
        if case.name in NEEDS_BUILTIN_PROCESSORS and not processors_built:
            pytest.xfail(f"min_p/logit_bias processors are not built under speculative "
                         f"decoding (vLLM build_logitsprocs; fix in plugin/patches/): "
                         f"{err}")
        raise


def _check_case(case: Case, tokens: torch.Tensor, e: Exact) -> None:
    n = tokens.shape[0]
    # Support: a token of exact probability 0 (cut by top-k/top-p/min-p) must never be
    # emitted, whatever the sample size; a banned (bias -100) token has probability
    # ~e^-285, i.e. never either.
    assert bool(e.support1[tokens[:, 0]].all()), f"{case.name}: token 1 outside support"
    assert bool((e.prob1[tokens[:, 0]] >= 1e-30).all()), f"{case.name}: banned token 1"
    for pos, p in ((1, e.token2), (2, e.token3)):
        col = tokens[:, pos]
        outside = col[p[col] < 1e-30]
        assert outside.numel() == 0, \
            f"{case.name}: token {pos + 1} emitted ids {outside.unique().tolist()[:10]} " \
            f"of exact probability 0"
        pvalue, df, power = _gof(col, p)
        tv90 = _detectable_tv(df, n)
        print(f"{case.name} token {pos + 1}: chi-square p = {pvalue:.3g}, df {df}, "
              f"N {n}: power {power:.2f} at TV {TV}, TV {tv90:.4f} at power {POWER}")
        assert pvalue > ALPHA, f"{case.name}: token {pos + 1} does not follow the " \
                               f"target's distribution (chi-square p = {pvalue:.2e})"
        assert tv90 <= ASSERTED_TV, f"{case.name}: detects only TV {tv90:.4f} (df {df})"


def _least_detectable(p: torch.Tensor, n: int, tv: float = TV) -> torch.Tensor:
    """q at total variation `tv` from p in the way the chi-square test sees worst:
    q - p proportional to p, + on bins holding about half of p's mass, - on the rest."""
    groups = sorted(_bins(p, n), key=lambda g: -float(p[g].sum()))
    plus, minus, mass_plus, mass_minus = [], [], 0.0, 0.0
    for g in groups:  # greedy halves
        if mass_plus <= mass_minus:
            plus.append(g)
            mass_plus += float(p[g].sum())
        else:
            minus.append(g)
            mass_minus += float(p[g].sum())
    q = p.clone()
    for g in plus:
        q[g] *= 1 + tv / mass_plus
    for g in minus:
        q[g] *= 1 - tv / mass_minus
    return q / q.sum()


@pytest.mark.parametrize("name", ["plain", "top_p"])
def test_gof_detects_the_asserted_error(exact, name):
    """The check can fail: SAMPLES draws from the least detectable law at the asserted
    TV from the exact token-3 marginal are rejected by the same test (a correct
    sampler's draws, with the same seed, are not)."""
    p = exact[name].token3
    g = torch.Generator().manual_seed(1)
    q = _least_detectable(p, SAMPLES, ASSERTED_TV)
    assert abs(0.5 * float((q - p).abs().sum()) - ASSERTED_TV) < 1e-3
    wrong = torch.multinomial(q.float(), SAMPLES, True, generator=g)
    assert _gof(wrong, p)[0] < ALPHA
    good = torch.multinomial(p.float(), SAMPLES, True, generator=g)
    assert _gof(good, p)[0] > ALPHA
