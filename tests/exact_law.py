"""The exact law of a request's generated tokens on the tiny target, and the goodness-of-fit
test of engine samples against it (tests/test_exact_distribution.py,
tests/test_dynamic_engine.py).

Exact law: the marginal distribution of each of the first generated tokens, computed by
enumerating every history (paths of probability >= PRUNE) with the target itself
(transformers, float64) and applying the request's processing as vLLM 0.32.0 defines it
(logit bias, then repetition/frequency/presence penalties, then temperature, min-p,
top-k, top-p; `vllm/v1/sample/sampler.py`). The pruned mass and the mass of threshold
decisions within float32 rounding (`AMBIGUITY`) are returned with it.

Power. For a sampler whose output law q is at total variation TV from the exact p on the
test's bins, the chi-square statistic is noncentral with lambda = N sum (q-p)^2/p >=
4 N TV^2 (Cauchy-Schwarz; equality only for the least detectable deviation, q - p
proportional to p with signs splitting p's mass in halves, `least_detectable`).
`detectable_tv` is the TV at which that bound gives power 0.9 for the test's own degrees
of freedom and threshold. Bins: every token expected >= 2 % alone, the rest together, so
the TV that counts is that of this binning (mass moved only among tokens rarer than 2 %
can hide; a support check still sees any emitted token of exact probability 0, at any
sample size).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch

PROMPT = tuple(b"abcdefg")  # byte tokens; the planted habit continues with "hij..."
TV = 0.01
ALPHA = 1e-3
POWER = 0.9
PRUNE = 1e-8  # histories below this probability are not enumerated
AMBIGUITY = 1e-5  # relative slack within which a threshold decision counts as ambiguous
BIN_MIN = 0.02  # tokens expected at least this often get a bin of their own
CHUNK = 4096  # histories per forward of the enumeration


@dataclass(frozen=True)
class Case:
    name: str
    temperature: float
    prompt: tuple[int, ...] = PROMPT
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)

    def sampling_params(self, max_tokens: int = 3, **extra):
        from vllm import SamplingParams

        return SamplingParams(
            temperature=self.temperature, top_k=self.top_k, top_p=self.top_p,
            min_p=self.min_p, repetition_penalty=self.repetition_penalty,
            frequency_penalty=self.frequency_penalty,
            presence_penalty=self.presence_penalty,
            logit_bias=dict(self.logit_bias) or None, max_tokens=max_tokens,
            ignore_eos=True, detokenize=False, **extra)


# --------------------------------------------------------------- exact reference
def processed_probs(case: Case, logits: torch.Tensor, prompt: list[int],
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
    laws: list[torch.Tensor]  # laws[j] [V]: marginal law of generated token j + 1
    pruned: list[float]  # pruned[j]: probability of the histories left out of laws[j]
    ambiguous: float  # probability of threshold decisions within rounding

    @property
    def prob1(self) -> torch.Tensor:  # [V] the 1st token's law
        return self.laws[0]

    @property
    def support1(self) -> torch.Tensor:  # [V] bool: tokens the 1st step can emit
        return self.laws[0] > 0

    @property
    def token2(self) -> torch.Tensor:
        return self.laws[1]

    @property
    def token3(self) -> torch.Tensor:
        return self.laws[2]


@torch.no_grad()
def exact_marginals(model, case: Case, tokens: int = 3) -> Exact:
    """The laws of generated tokens 1..`tokens`: every history of probability >= PRUNE
    enumerated with the target in float64, each level reusing the KV cache of the one
    before (in chunks of CHUNK histories). Runs on one intra-op thread (restored after):
    the tiny target's small ops only wait on a thread pool, the more so beside engines."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _enumerate(model, case, tokens)
    finally:
        torch.set_num_threads(threads)


def _enumerate(model, case: Case, tokens: int) -> Exact:
    prompt = list(case.prompt)
    V = model.config.vocab_size
    none = torch.zeros(1, 0, dtype=torch.long)
    out0 = model(torch.tensor([prompt]), use_cache=True)
    p1, amb1 = processed_probs(case, out0.logits[:, -1], prompt, none)  # [1, V]
    p1 = p1[0]
    later = [torch.zeros(V, dtype=torch.float64) for _ in range(tokens - 1)]
    acc = Exact(laws=[p1] + later, pruned=[0.0] * tokens, ambiguous=float(amb1[0]))
    t1 = torch.nonzero(p1 >= PRUNE).squeeze(1)  # [n1]
    for j in range(1, tokens):
        acc.pruned[j] += float(p1[p1 < PRUNE].sum())
    if tokens > 1:
        for lo in range(0, len(t1), CHUNK):
            t = t1[lo:lo + CHUNK]
            cache = copy.deepcopy(out0.past_key_values)
            cache.reorder_cache(torch.zeros(len(t), dtype=torch.long))
            _descend(model, case, prompt, cache, t[:, None], p1[t], acc, tokens)
    return acc


def _descend(model, case, prompt, cache, hist, w, acc: Exact, tokens: int) -> None:
    """Histories hist [n, k] of probability w [n] (cache: prompt + hist[:, :-1] per
    row): adds their next token's law to acc.laws[k], then enumerates one token more."""
    k = hist.shape[1]
    out = model(hist[:, -1:], past_key_values=cache, use_cache=True)
    p, amb = processed_probs(case, out.logits[:, -1], prompt, hist)  # [n, V]
    acc.laws[k] += (w[:, None] * p).sum(0)
    acc.ambiguous += float((w * amb).sum())
    if k + 1 == tokens:
        return
    joint = w[:, None] * p  # [n, V]
    keep = joint >= PRUNE
    for j in range(k + 1, tokens):
        acc.pruned[j] += float(joint[~keep].sum())
    rows, nxt = torch.nonzero(keep, as_tuple=True)
    for lo in range(0, len(rows), CHUNK):
        r, t = rows[lo:lo + CHUNK], nxt[lo:lo + CHUNK]
        c = copy.deepcopy(out.past_key_values)
        c.reorder_cache(r)
        _descend(model, case, prompt, c, torch.cat([hist[r], t[:, None]], 1), joint[r, t],
                 acc, tokens)


def load_float64_target(target_dir: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float64).eval()


# ------------------------------------------------------------------ statistics
def bins(p: torch.Tensor, n: int) -> list[torch.Tensor]:
    """Token groups: every token with probability >= BIN_MIN alone, the rest together
    (dropped if it expects fewer than 5 samples)."""
    big = torch.nonzero(p >= BIN_MIN).squeeze(1)
    rest = torch.nonzero((p < BIN_MIN) & (p > 0)).squeeze(1)
    groups = [big[i:i + 1] for i in range(len(big))]
    if float(p[rest].sum()) * n >= 5:
        groups.append(rest)
    return groups


def power_at_tv(df: int, n: int, tv: float = TV, alpha: float = ALPHA) -> float:
    """Power of the chi-square test (df, threshold alpha, n samples) against the least
    detectable law at total variation tv (noncentrality 4 n tv^2)."""
    from scipy.stats import chi2, ncx2

    return float(ncx2.sf(chi2.isf(alpha, df), df, 4 * n * tv * tv))


def detectable_tv(df: int, n: int, power: float = POWER) -> float:
    """The smallest TV detected with `power` in the worst case."""
    from scipy.optimize import brentq

    return float(brentq(lambda tv: power_at_tv(df, n, tv) - power, 1e-5, 1.0))


def gof(tokens: torch.Tensor, p: torch.Tensor) -> tuple[float, int, float]:
    """Chi-square goodness of fit of the sampled tokens to p over `bins`.
    Returns (p-value, degrees of freedom, power against TV 0.01)."""
    from scipy.stats import chisquare

    n = tokens.numel()
    counts = torch.bincount(tokens, minlength=p.numel()).double()
    groups = bins(p, n)
    obs = torch.stack([counts[g].sum() for g in groups])
    exp = torch.stack([p[g].sum() for g in groups]) * n
    # Tokens outside every bin (probability too small to bin): pooled with the last.
    covered = torch.cat(groups)
    stray = float(counts.sum() - counts[covered].sum())
    obs[-1] += stray
    exp = exp * obs.sum() / exp.sum()
    df = len(groups) - 1
    return float(chisquare(obs.numpy(), exp.numpy()).pvalue), df, power_at_tv(df, n)


def check_follows(name: str, tokens: torch.Tensor, e: Exact, positions, asserted_tv: float
                  ) -> None:
    """Samples tokens [N, n] of one case against its exact laws: no emitted token of exact
    probability 0 at any position; at each of `positions` (0-based) the chi-square
    p-value > ALPHA and the test detects TV `asserted_tv` at power POWER."""
    n = tokens.shape[0]
    # Support: a token of exact probability 0 (cut by top-k/top-p/min-p) must never be
    # emitted, whatever the sample size; a banned (bias -100) token has probability
    # ~e^-285, i.e. never either.
    assert bool(e.support1[tokens[:, 0]].all()), f"{name}: token 1 outside support"
    assert bool((e.prob1[tokens[:, 0]] >= 1e-30).all()), f"{name}: banned token 1"
    for pos in positions:
        p = e.laws[pos]
        col = tokens[:, pos]
        outside = col[p[col] < 1e-30]
        assert outside.numel() == 0, \
            f"{name}: token {pos + 1} emitted ids {outside.unique().tolist()[:10]} " \
            f"of exact probability 0"
        pvalue, df, power = gof(col, p)
        tv90 = detectable_tv(df, n)
        print(f"{name} token {pos + 1}: chi-square p = {pvalue:.3g}, df {df}, "
              f"N {n}: power {power:.2f} at TV {TV}, TV {tv90:.4f} at power {POWER}")
        assert pvalue > ALPHA, f"{name}: token {pos + 1} does not follow the " \
                               f"target's distribution (chi-square p = {pvalue:.2e})"
        assert tv90 <= asserted_tv, f"{name}: detects only TV {tv90:.4f} (df {df})"


def least_detectable(p: torch.Tensor, n: int, tv: float = TV) -> torch.Tensor:
    """q at total variation `tv` from p in the way the chi-square test sees worst:
    q - p proportional to p, + on bins holding about half of p's mass, - on the rest."""
    groups = sorted(bins(p, n), key=lambda g: -float(p[g].sum()))
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
