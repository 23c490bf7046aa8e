"""Dynamic verification: how many of a block's 15 drafts each request sends to the
target, chosen per step to maximise committed tokens per unit of step time
(docs/dynamic-verification.md).

The block is always drafted whole; only verification is shortened. Per request i and
draft position t the policy needs

  alpha[i, t]   the probability that draft t is accepted given drafts < t were:
                `AcceptanceCalibrator` maps a confidence read off the tail
                (`draft_confidence`) to the acceptance vLLM actually observed;
  G[i, t]       = prod_{s <= t} alpha[i, s], the chance that position t is reached and
                accepted: the expected tokens verifying it adds;
  T(N)          the wall time of one engine step whose target forward holds N tokens
                (`MeasuredStepCost`, fitted on the running engine), plus the drafter's
                own time per step (fitted against the rows it drafts, requests x rows).

The batch's rate is (R + sum of the chosen G) / (T(R + chosen drafts) + drafter time);
because G[i, .] falls with t, the best choice of m drafts is the m largest G, so the
optimum is one pass over m = 0 .. 15 R.

Lossless by construction. A greedy request's output is the target's argmax chain
whatever is verified, so its length may use everything. A sampled request's draft v_t
is drawn from q_t(. | v_{t-1}); exact speculative sampling stays exact for a verified
length n only if the event {n > t} does not depend on v_t or later draws (otherwise the
verified v_t is no longer distributed as q_t). So for sampled requests:
  * the confidence of position t is max_v q_t(v | v_{t-1}) (known before v_t is drawn),
    never q_t(v_t);
  * the length is n = #{t : G[i, t] >= lambda} with lambda fixed by the previous step
    (history), not by this step's drafts;
  * requests with their own seed get a length from their own history only
    (`SeededLengthRule`: what they verified and accepted last), never from timings or
    the rest of the batch, so that the seed reproduces the text (the verified length
    changes how many random numbers verification draws).

Only the rows that can be verified are drafted. Attention is causal inside the block and
the bridge passes codes from row t - 1 to row t, so the first m + 1 rows of a block are
the same whether 16 or m + 1 rows run; `Plan.rows` (one more than the longest length chosen
in the last steps, doubled when they reach it; all 15 in the warm-up, 4 for a probe while the drafter
is skipped, twice the budget for one while drafting) is how many drafts the proposer asks
of the block forward, the retrieval and the tail this step.
`tests/test_dynamic_policy.py` checks the rule exactly on a small vocabulary, with the
rule that uses q_t(v_t) as the negative control.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from vllm.logger import init_logger

# Under vLLM's "vllm" logger, whose handlers vLLM configures in every process (a
# logger named after this module would print nothing in the engine process).
logger = init_logger("vllm.dspine.dynamic_verification")

# Kinds of request for the policy.
GREEDY = 0  # temperature 0: any length is lossless; the length uses the full chain
SAMPLED = 1  # random, no own seed: length by last step's threshold (see above)
FIXED = 2  # random with its own seed, or probed this step: verified at the step's cap

WARMUP_CAPS = (15, 0, 8, 2, 15, 4, 1, 0)  # lengths tried while the cost model is empty
SKIP_AFTER = 8  # drafted steps in a row that did not pay before the drafter is skipped
UNPAID_SHORTFALL = 0.4  # ... or one step whose best rate is this far below plain's
CALIBRATED_TRIALS = 200  # verified drafts observed before that second rule applies
PROBE_MIN, PROBE_MAX = 16, 512  # steps between probes while skipping (doubling)
# While skipping, requests that arrived since the skip began are probed, PROBE_MIN steps
# after the last probe at the earliest, whatever the doubled interval: acceptance belongs
# to the workload, and a new one should not wait up to PROBE_MAX steps to be seen.
# A probe while skipping costs its block (PROBE_ROWS drafts for every request: vLLM's
# DFlash layout drafts the whole batch) and the verification of the probed drafts; it is
# spaced so that probes take at most this share of the engine's time (by the cost model).
# At concurrency 8 on this CPU an arrival probe of 8 requests cost ~150 ms over a 110 ms
# step; every 16 steps (PROBE_MIN), as a server with steady arrivals would probe, that
# was 8 % of the time where drafting does not pay.
PROBE_BUDGET = 0.01
EXPLORE_EVERY = 64  # steps between probes while drafting (acceptance of long prefixes)
ROWS_MIN = 2  # fewest drafts a drafted block has (enough to see whether draft 2 pays)
PROBE_ROWS = 4  # drafts of a probe while the drafter is skipped
SEEDED_START = 4  # a seeded request's first verified length
SEEDED_BACKOFF = (4, 64)  # steps a seeded request waits before re-probing (doubling)
PROBES_PER_REQUESTS = 16  # one probed request per this many requests
LOG_EVERY_S = 30.0


@dataclass(frozen=True)
class FixedCost:
    """An injected cost model (the `dspine_verify_cost` option): verification step
    `step_s + token_s * N` seconds for N target tokens, the drafter `draft_s` a step."""

    step_s: float
    token_s: float
    draft_s: float

    @classmethod
    def from_option(cls, d: dict) -> "FixedCost":
        return cls(float(d["step_s"]), float(d["token_s"]), float(d["draft_s"]))

    def verify(self, n_tokens):
        return self.step_s + self.token_s * np.asarray(n_tokens, dtype=np.float64)

    @property
    def ready(self) -> bool:
        return True


class MeasuredStepCost:
    """T(N): seconds of one engine step (scheduler, target forward over N tokens,
    sampling, bookkeeping; the drafter is timed separately) as measured on the running
    engine, as T(N) = speed x shape(N).

    shape: samples pooled in quarter-octave bins of N, each in the machine speed of its
    time (seconds / speed): a bin's mean over its first samples, then an exponentially
    weighted mean of small weight (BIN_EW); the piecewise-linear curve through the
    bins as measured, extended past the ends with the slope of the nearest segment
    (never negative). Flat then linear (a GPU below its compute knee), linear, and
    the dips of a CPU's GEMM kernels all fit: the curve is not made monotonic, because
    it is not. On this CPU (oneDNN, one thread, SmolLM2's 30 layers streamed from
    memory) 2 tokens cost more than 5: 52.5 vs 34.7 ms (bench/bench_cpu_ops.py,
    docs/benchmarks.md), so a verification of 4 drafts is cheaper than one of 1, and a
    curve forced non-decreasing hid that from the policy.

    speed: follows every step whatever its N (exponentially weighted, in log space).
    A CPU's speed moves by 1.5-2x within minutes (docs/dynamic-verification.md,
    "2026-12-02"), and the policy visits most N rarely: with one mean per bin, a bin
    filled in a fast phase was compared with another filled in a slow one, and only the
    ratio T(N) / T(R) matters to the choice. A lasting change in the step time of the N
    being visited goes mostly into speed (SPEED_EW >> BIN_EW), so every bin follows it;
    a change of shape alone (one N dearer, the others not) ends in that bin, as steps at
    other N pull speed back (tests/test_dynamic_policy.py).
    Before the curve has two operating points, speed stays 1."""

    BIN_EW = 0.01  # weight of a new sample once a bin has 100
    SPEED_EW = 0.1  # weight of a step in log(speed)
    SPEED_CLIP = 0.5  # |log(seconds / T(N))| counted per step at most (a one-off spike)

    def __init__(self) -> None:
        self._bins: dict[int, list[float]] = {}  # key -> [mean N, mean shape, count]
        self._rejected_in_row = 0
        self._curve: tuple[np.ndarray, np.ndarray] | None = None
        self.speed = 1.0

    @staticmethod
    def _key(n: float) -> int:
        return int(math.floor(4 * math.log2(max(n, 1.0))))

    @property
    def ready(self) -> bool:
        c = self._points()
        return c is not None and c[0][-1] >= 2 * c[0][0]

    def observe(self, n_tokens: int, seconds: float) -> None:
        if n_tokens <= 0 or not seconds > 0:
            return
        if self.ready:
            expected = float(self.verify(n_tokens))
            # An idle gap or a step the drafter never saw: not a step of N tokens.
            if seconds > 4 * expected + 0.05 and self._rejected_in_row < 8:
                self._rejected_in_row += 1
                return
            if expected > 0:
                r = math.log(seconds / expected)
                self.speed *= math.exp(self.SPEED_EW * max(-self.SPEED_CLIP,
                                                           min(self.SPEED_CLIP, r)))
        self._rejected_in_row = 0
        x = seconds / self.speed
        b = self._bins.setdefault(self._key(n_tokens), [float(n_tokens), x, 0.0])
        b[2] += 1
        w = max(1.0 / b[2], self.BIN_EW)
        b[0] += w * (n_tokens - b[0])
        b[1] += w * (x - b[1])
        self._curve = None

    def _points(self) -> tuple[np.ndarray, np.ndarray] | None:
        """The shape's points (N, seconds at speed 1), in order of N."""
        if self._curve is None and len(self._bins) >= 2:
            pts = sorted((b[0], b[1]) for b in self._bins.values())
            self._curve = (np.array([p[0] for p in pts]), np.array([p[1] for p in pts]))
        return self._curve

    def verify(self, n_tokens):
        c = self._points()
        if c is None:
            raise RuntimeError("MeasuredStepCost has fewer than two operating points")
        n, t = c
        x = np.asarray(n_tokens, dtype=np.float64)
        y = np.interp(x, n, t)
        lo = max((t[1] - t[0]) / max(n[1] - n[0], 1e-9), 0.0)
        hi = max((t[-1] - t[-2]) / max(n[-1] - n[-2], 1e-9), 0.0)
        y = np.where(x < n[0], np.maximum(t[0] - lo * (n[0] - x), 0.0), y)
        return self.speed * np.where(x > n[-1], t[-1] + hi * (x - n[-1]), y)

    def describe(self) -> str:
        c = self._points()
        if c is None:
            return "no data"
        return ", ".join(f"T({int(round(a))})={1e3 * self.speed * b:.1f}ms"
                         for a, b in zip(*c)) + f" (speed x{self.speed:.2f})"


class EWLinear:
    """seconds ~ a + b * x by exponentially weighted least squares (the drafter's time
    against the number of requests drafted)."""

    def __init__(self, decay: float = 0.95) -> None:
        self.decay = decay
        self._s = np.zeros(5)  # sum w, w x, w x^2, w y, w x y

    @property
    def ready(self) -> bool:
        return self._s[0] > 0

    def observe(self, x: float, y: float) -> None:
        self._s *= self.decay
        self._s += np.array([1.0, x, x * x, y, x * y])

    def __call__(self, x: float) -> float:
        w, sx, sxx, sy, sxy = self._s
        if w <= 0:
            return 0.0
        det = w * sxx - sx * sx
        if det <= 1e-9 * max(w * sxx, 1e-30):
            return sy / w
        b = (w * sxy - sx * sy) / det
        a = (sy - b * sx) / w
        return max(a + b * x, 0.0)


class AcceptanceCalibrator:
    """alpha = P(draft t accepted | drafts < t accepted, confidence c), per kind (greedy
    or sampled), position group (draft 1, 2-3, 4-7, 8-15) and confidence bin. A bin
    follows the acceptances vLLM reports from a prior of two pseudo-observations at the
    acceptance seen over its whole kind and group (itself starting from the bin's
    confidence); old observations fade (counts halve past 400)."""

    EDGES = np.array([0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99, 1.0])
    PRIOR = 2.0
    MAX_TRIALS = 400.0

    def __init__(self, num_positions: int) -> None:
        nb = len(self.EDGES) - 1
        self._group = np.array([min(int(math.log2(t + 1)), 4) for t in range(num_positions)])
        centers = (self.EDGES[:-1] + self.EDGES[1:]) / 2
        self._prior = np.broadcast_to(centers, (2, 5, nb)).copy()
        self.success = np.zeros((2, 5, nb))
        self.trials = np.zeros((2, 5, nb))
        self._pooled = self._pooled_prior()  # refreshed by observe_many

    def _bin(self, conf: np.ndarray) -> np.ndarray:
        return np.clip(np.searchsorted(self.EDGES, conf, side="right") - 1, 0,
                       len(self.EDGES) - 2)

    def predict(self, conf: np.ndarray, greedy: np.ndarray) -> np.ndarray:
        """conf [R, K] in [0, 1], greedy [R] bool -> alpha [R, K]."""
        R, K = conf.shape
        kind = np.where(greedy, 0, 1)[:, None].repeat(K, axis=1)
        group = np.broadcast_to(self._group[:K], (R, K))
        b = self._bin(conf)
        s, n = self.success[kind, group, b], self.trials[kind, group, b]
        return (s + self.PRIOR * self._pooled[kind, group, b]) / (n + self.PRIOR)

    def _pooled_prior(self) -> np.ndarray:
        """[2, 5, bins]: what a bin with few observations leans on: the acceptance
        observed over all bins of its kind and position group (the bin's own confidence
        counting as PRIOR observations). A bin's raw confidence alone was optimistic by
        ~40 % on SmolLM2's drafter, whose tail probabilities are overconfident (docs/
        dynamic-verification.md)."""
        S = self.success.sum(-1, keepdims=True)
        N = self.trials.sum(-1, keepdims=True)
        return (S + self.PRIOR * self._prior) / (N + self.PRIOR)

    def observe(self, conf: np.ndarray, greedy: bool, accepted: int, verified: int) -> None:
        """One verification: drafts 0..accepted-1 accepted, draft `accepted` rejected
        (if accepted < verified); later drafts were not tested."""
        self.observe_many([(conf, greedy, accepted, verified)])

    def observe_many(self, verifications) -> None:
        """observe() for several (conf, greedy, accepted, verified) at once."""
        kinds, groups, bins, hits = [], [], [], []
        for conf, greedy, accepted, verified in verifications:
            tested = min(accepted + 1, verified)
            if tested <= 0:
                continue
            t = np.arange(tested)
            kinds.append(np.full(tested, 0 if greedy else 1))
            groups.append(self._group[t])
            bins.append(self._bin(np.asarray(conf[:tested])))
            hits.append((t < accepted).astype(np.float64))
        if not kinds:
            return
        idx = (np.concatenate(kinds), np.concatenate(groups), np.concatenate(bins))
        np.add.at(self.trials, idx, 1.0)
        np.add.at(self.success, idx, np.concatenate(hits))
        full = self.trials > self.MAX_TRIALS
        if full.any():
            self.trials[full] /= 2
            self.success[full] /= 2
        self._pooled = self._pooled_prior()


def draft_confidence(
    S: torch.Tensor,  # [R, K, k, k]  the tail's score tables
    cand_ids: torch.Tensor,  # [R, K, k]
    cand_probs: torch.Tensor,  # [R, K, k]  q each draft was drawn from (greedy: one-hot)
    draft_ids: torch.Tensor,  # [R, K]
    greedy: torch.Tensor,  # [R] bool
) -> torch.Tensor:  # [R, K] float32 in [0, 1]
    """The confidence the policy reads per draft position.

    Greedy rows: softmax (temperature 1) of the table row the walk used,
    S[t](v_{t-1}, .), at the chosen candidate (its argmax): the tail's own probability of
    its choice. Sampled rows: max_v q_t(v | v_{t-1}), the peak of the distribution the
    draft was drawn from; known before the draw, as losslessness needs (module doc)."""
    R, K, k = cand_ids.shape
    chosen = (cand_ids == draft_ids[..., None]).to(torch.int8).argmax(dim=-1)  # [R, K]
    prev = torch.cat([torch.zeros_like(chosen[:, :1]), chosen[:, :-1]], dim=1)  # [R, K]
    rows = S.gather(2, prev[:, :, None, None].expand(R, K, 1, k)).squeeze(2)  # [R, K, k]
    p = torch.softmax(rows.double(), dim=-1).gather(2, chosen[..., None]).squeeze(2)
    peak = cand_probs.double().amax(dim=-1)
    return torch.where(greedy.to(S.device)[:, None], p, peak).float()


class SeededLengthRule:
    """The verified length of a request with its own seed, from its own history only
    (so the seed reproduces its text whatever else is in the batch and however fast the
    engine runs). After a verification of n drafts with a accepted: all accepted -> 2n
    (at most the cap), else a + 1; two verifications in a row with nothing accepted ->
    0 for a wait (4 steps, doubling to 64 while probes keep failing), then 1 (a probe,
    which waits again if it fails too).
    Lossless: the length depends on past steps only, not on this step's drafts."""

    def __init__(self, num_proposals: int) -> None:
        self.K = num_proposals
        self._state: dict[str, list[int]] = {}  # req id -> [length, zeros, wait, backoff]

    def lengths(self, req_ids: list[str], observed: dict[str, tuple[int, int]],
                which: np.ndarray) -> np.ndarray:
        """observed: req id -> (drafts verified last step, accepted); which [R] bool:
        the requests the rule applies to. -> length [R] (K where it does not apply).
        Called once per step; forgets requests that left the batch."""
        out = np.full(len(req_ids), self.K, dtype=np.int64)
        state = {}
        lo, hi = SEEDED_BACKOFF
        for i, rid in enumerate(req_ids):
            if not which[i]:
                continue
            st = self._state.get(rid) or [SEEDED_START, 0, 0, lo]
            n, a = observed.get(rid, (0, 0))
            if n > 0:
                st[0] = min(self.K, 2 * n) if a >= n else a + 1
                if a > 0:
                    st[1], st[3] = 0, lo
                else:
                    st[1] += 1
                    if st[1] >= 2:
                        st[0], st[1], st[2], st[3] = 0, 0, st[3], min(2 * st[3], hi)
            elif st[0] == 0:
                st[2] -= 1
                if st[2] <= 0:
                    st[0], st[1] = 1, 1  # a probe: one more miss and it waits again
            state[rid] = st
            out[i] = st[0]
        self._state = state
        return out


@dataclass
class Choice:
    lengths: np.ndarray  # [R] int
    threshold: float | None  # lambda for the next step's sampled requests
    rho_draft: float  # best expected tokens/s with the drafter
    rho_plain: float  # expected tokens/s without it


def _best_prefix(gains: np.ndarray, tokens0: float, n0: int, verify, fixed_s: float,
                 max_extra: int) -> tuple[int, float]:
    """argmax over m of (tokens0 + sum of the m largest gains) / (T(n0 + m) + fixed_s);
    gains sorted descending. Ties go to the smaller m."""
    M = max(0, min(len(gains), max_extra))
    cum = np.concatenate([[0.0], np.cumsum(gains[:M])])
    times = verify(n0 + np.arange(M + 1)) + fixed_s
    rate = (tokens0 + cum) / np.maximum(times, 1e-12)
    m = int(np.argmax(rate))
    return m, float(rate[m])


def choose_lengths(
    G: np.ndarray,  # [R, K] cumulative acceptance, non-increasing along K
    caps: np.ndarray,  # [R] int: most drafts request i may verify (0: none)
    kinds: np.ndarray,  # [R] GREEDY / SAMPLED / FIXED
    threshold: float | None,  # lambda from the previous step (None: none yet)
    verify,  # N -> seconds of a verification step (vectorised)
    draft_s: float,  # the drafter's time a step
    context_s: float,  # the context-only drafter path (no block) a step
    max_tokens: int,  # the step's token budget
) -> Choice:
    R, K = G.shape
    live = caps > 0
    lengths = np.zeros(R, dtype=np.int64)
    tokens0 = float(live.sum())  # each request commits its bonus/correction token
    n0 = int(live.sum())
    within = np.arange(K)[None, :] < caps[:, None]  # [R, K]
    # FIXED: the cap.
    fixed = live & (kinds == FIXED)
    lengths[fixed] = caps[fixed]
    tokens0 += float((G * within)[fixed].sum())
    n0 += int(caps[fixed].sum())
    # SAMPLED: the previous step's threshold (a prefix: G falls along K).
    sampled = live & (kinds == SAMPLED)
    take = within if threshold is None else within & (G >= threshold)
    lengths[sampled] = take[sampled].sum(axis=1)
    tok_s = tokens0 + float((G * take)[sampled].sum())
    n_s = n0 + int(lengths[sampled].sum())

    def entries(mask):
        rows, cols = np.nonzero(mask[:, None] & (np.arange(K)[None, :] < caps[:, None]))
        g = G[rows, cols]
        order = np.lexsort((cols, -g))  # gain descending, then position ascending
        return rows[order], g[order]

    # GREEDY: the best prefix given the others.
    greedy = live & (kinds == GREEDY)
    rows, g = entries(greedy)
    m, _ = _best_prefix(g, tok_s, n_s, verify, draft_s, max_tokens - n_s)
    np.add.at(lengths, rows[:m], 1)
    # The threshold for the next step, and whether drafting pays: the joint optimum
    # over every request whose length the policy chooses. The threshold is the gain
    # midway between the last draft the optimum takes and the first it leaves out, so
    # that the same gains next step give the same choice. (Not the marginal value
    # rate x dT/dN: the measured curve has dips, where that slope is negative.)
    rows, g = entries(greedy | sampled)
    m, rho = _best_prefix(g, tokens0, n0, verify, draft_s, max_tokens - n0)
    lam = threshold
    if len(g):
        taken = float(g[m - 1]) if m > 0 else 2.0 * float(g[0]) + 1e-12
        left = float(g[m]) if m < len(g) else 0.0
        lam = 0.5 * (taken + left)
    plain = float(live.sum()) / max(float(verify(int(live.sum()))) + context_s, 1e-12)
    return Choice(lengths, lam, rho, plain)


@dataclass
class Plan:
    draft: bool
    probe: set = field(default_factory=set)  # batch indices verified at the cap
    rows: int = 0  # drafts per request the block computes (its first rows + 1 rows)
    caps: np.ndarray | None = None  # [R] the caps after the seeded rule


class DynamicVerifier:
    """The policy's state across steps for one engine (one proposer).

    Per step the proposer calls `begin` (with what vLLM verified since the last call),
    `plan` (draft at all?), then `choose` (after drafting) or `context_only`, and `end`.
    """

    def __init__(self, num_proposals: int, cost: FixedCost | None = None,
                 max_batch_tokens: int = 1 << 30,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.K = num_proposals
        self.injected = cost
        self.verify_cost = cost if cost is not None else MeasuredStepCost()
        self.draft_cost = EWLinear()
        self.context_cost = EWLinear()
        self.calibrator = AcceptanceCalibrator(num_proposals)
        self.max_batch_tokens = max_batch_tokens
        self.clock = clock
        self.threshold: float | None = None
        self.steps = 0
        self.skipping = False
        self.unpaid = 0
        self.probe_interval = PROBE_MIN
        self.since_probe = 0
        self.probe_cursor = 0
        self._probing = False
        self._arrival_probe = False  # this step's probe is for newly arrived requests
        # While skipping: the requests there when it began, and those probed since.
        self._skip_known: set[str] = set()
        # req id -> (confidences, greedy, accepted drafts the policy expected or None
        # before the cost model was ready) of the block it verified last step.
        self._last: dict[str, tuple[np.ndarray, bool, float | None]] = {}
        self._prev_ids: set[str] = set()
        self._t_begin: float | None = None
        self._t_end: float | None = None
        self._warm = 0
        self.seeded = SeededLengthRule(num_proposals)
        self.row_budget = num_proposals  # drafts per request the next block computes
        self._rows = num_proposals  # drafts per request of this step's block
        self._req_ids: list[str] = []
        self._observed: dict[str, tuple[int, int]] = {}  # req id -> (verified, accepted)
        # Summary since the last log line.
        self.hist = np.zeros(num_proposals + 1, dtype=np.int64)
        self.steps_drafted = 0
        # Drafts accepted: expected by the policy when it chose (sum of G over the
        # verified prefixes) and as vLLM then reported, over the same verifications.
        self.expected_accepted = 0.0
        self.observed_accepted = 0
        self.steps_context = 0
        self._last_log = clock()

    # -------------------------------------------------------------- bookkeeping
    @property
    def ready(self) -> bool:
        return self.verify_cost.ready and (self.injected is not None or self.draft_cost.ready)

    def draft_seconds(self, num_rows: int) -> float:
        """The drafter's time for a block of `num_rows` rows in all (requests x rows)."""
        return self.injected.draft_s if self.injected is not None else self.draft_cost(num_rows)

    def context_seconds(self, num_reqs: int) -> float:
        return 0.0 if self.injected is not None else self.context_cost(num_reqs)

    def begin(self, req_ids: list[str], verified: list[int], rejected: list[int] | None,
              num_tokens: int) -> None:
        """verified[i]: drafts vLLM verified for request i in the step that just ran;
        rejected[i]: how many of them it rejected (None when no request had drafts);
        num_tokens: tokens of that step's target forward."""
        now = self.clock()
        if self._t_end is not None and self.injected is None and self._prev_ids & set(req_ids):
            self.verify_cost.observe(num_tokens, now - self._t_end)
        self._req_ids = list(req_ids)
        self._observed = {} if rejected is None else {
            rid: (int(n), max(int(n) - int(r), 0))
            for rid, n, r in zip(req_ids, verified, rejected) if n > 0}
        if rejected is not None and self._last:
            seen = []
            for i, rid in enumerate(req_ids):
                last = self._last.get(rid)
                n = int(verified[i])
                if last is None or n <= 0:
                    continue
                conf, greedy, expected = last
                accepted = max(n - int(rejected[i]), 0)
                n = min(n, len(conf))
                seen.append((conf, greedy, min(accepted, n), n))
                if expected is not None:
                    self.expected_accepted += expected
                    self.observed_accepted += accepted
            self.calibrator.observe_many(seen)
        self._t_begin = now

    def plan(self, kinds: np.ndarray, caps: np.ndarray) -> Plan:
        """Whether to draft this step, how many rows, and the caps after the seeded
        rule (requests with their own seed: `SeededLengthRule`)."""
        self.steps += 1
        caps = np.array(caps, dtype=np.int64)
        seeded = kinds == FIXED
        if seeded.any():
            caps = np.minimum(caps, self.seeded.lengths(self._req_ids, self._observed, seeded))
        live = caps > 0
        self._probing = self._arrival_probe = False
        if not live.any():
            return Plan(False, caps=caps)
        if not self.ready:
            return Plan(True, rows=self.K, caps=caps)
        seeded_rows = int(caps[live & seeded].max()) if (live & seeded).any() else 0
        if seeded_rows:
            return Plan(True, rows=max(seeded_rows, min(self.row_budget, self.K)), caps=caps)
        self.since_probe += 1
        dyn = np.nonzero(live & (kinds != FIXED))[0]
        arrived: list[int] = []
        if self.skipping:
            self._skip_known.intersection_update(self._req_ids)  # forget finished ones
            arrived = [int(i) for i in dyn if self._req_ids[i] not in self._skip_known]
        if self.skipping:
            count = len(arrived) or -(-len(dyn) // PROBES_PER_REQUESTS)
            gap = self._probe_gap(len(dyn), count)
            if self.since_probe < max(self.probe_interval, gap):
                if not (arrived and self.since_probe >= gap):
                    return Plan(False, caps=caps)
                self._arrival_probe = True  # early: does not double the interval
        if not self.skipping and self.since_probe < EXPLORE_EVERY:
            return Plan(True, rows=min(self.row_budget, self.K), caps=caps)
        self.since_probe = 0
        self._probing = True
        if arrived:  # new requests first, all of them
            picked = set(arrived)
        else:
            count = max(1, -(-len(dyn) // PROBES_PER_REQUESTS))
            picked = {int(dyn[(self.probe_cursor + j) % len(dyn)]) for j in range(count)}
            self.probe_cursor += count
        self._skip_known.update(self._req_ids[i] for i in picked)
        # A probe drafts every request's block (vLLM's DFlash layout), so its rows are
        # what it costs: while skipping, the first PROBE_ROWS drafts (do short prefixes
        # pay again?); while drafting, twice the budget (longer prefixes, step by step).
        rows = PROBE_ROWS if self.skipping else min(self.K, 2 * self.row_budget)
        return Plan(True, picked, rows=rows, caps=caps)

    def _probe_gap(self, num_reqs: int, probed: int) -> int:
        """Fewest steps from one probe to the next while skipping (at least PROBE_MIN):
        what a probe of `probed` requests adds to a step (a block of PROBE_ROWS drafts for
        all `num_reqs`, and PROBE_ROWS more target tokens per probed request), over
        PROBE_BUDGET of a step without the drafter."""
        R = max(num_reqs, 1)
        plain = float(self.verify_cost.verify(R)) + self.context_seconds(R)
        extra = (self.draft_seconds(R * (PROBE_ROWS + 1)) - self.context_seconds(R)
                 + float(self.verify_cost.verify(R + probed * PROBE_ROWS))
                 - float(self.verify_cost.verify(R)))
        if not plain > 0:
            return PROBE_MIN
        return max(PROBE_MIN, math.ceil(max(extra, 0.0) / (PROBE_BUDGET * plain)))

    def choose(self, req_ids: list[str], kinds: np.ndarray, caps: np.ndarray,
               conf: np.ndarray, plan: Plan) -> np.ndarray:
        """conf [R, K] from `draft_confidence`; returns the verified length per request."""
        greedy = kinds == GREEDY  # also the kind of what a probe of it observes
        policy = kinds != FIXED  # lengths the policy chooses (not seeded, not probed)
        kinds = kinds.copy()
        for i in plan.probe:
            kinds[i] = FIXED
            policy[i] = False
        rows = self._rows = conf.shape[1]  # drafts this block computed
        # plan.caps: the caller's caps after the seeded rule (never above them).
        caps = np.minimum(caps if plan.caps is None else plan.caps, rows)
        if not self.ready:
            cap = WARMUP_CAPS[self._warm % len(WARMUP_CAPS)]
            self._warm += 1
            lengths = np.where(kinds == FIXED, caps, np.minimum(caps, cap))
            expected = None
        else:
            alpha = np.clip(self.calibrator.predict(conf, greedy), 0.0, 1.0)
            G = np.cumprod(alpha, axis=1)
            R = len(req_ids)
            choice = choose_lengths(G, caps, kinds, self.threshold, self.verify_cost.verify,
                                    self.draft_seconds(R * (min(self.row_budget, self.K) + 1)),
                                    self.context_seconds(R),
                                    self.max_batch_tokens)
            lengths = choice.lengths
            expected = np.where(np.arange(G.shape[1]) < lengths[:, None], G, 0.0).sum(1)
            self.threshold = choice.threshold
            pays = choice.rho_draft > choice.rho_plain
            self._update_row_budget(lengths[policy & (caps > 0)], rows)
            if self.skipping:
                if pays:
                    self.skipping, self.unpaid, self.probe_interval = False, 0, PROBE_MIN
                elif self._probing and not self._arrival_probe:
                    self.probe_interval = min(2 * self.probe_interval, PROBE_MAX)
            else:
                # Once acceptance is calibrated, a step far from paying counts as
                # several: at high load drafting can miss by half, and each such step
                # costs the drafter's whole forward; near break-even (noise), or while
                # the estimates still start from the confidences, a step counts once.
                shortfall = 1.0 - choice.rho_draft / max(choice.rho_plain, 1e-12)
                weight = 1
                if self.calibrator.trials.sum() >= CALIBRATED_TRIALS:
                    weight = max(1, math.ceil(SKIP_AFTER * shortfall / UNPAID_SHORTFALL))
                # A step that pays takes one count back (not all: at concurrency 1 a
                # few confident steps that pay must not hide a run that does not).
                self.unpaid = max(self.unpaid - 1, 0) if pays else self.unpaid + weight
                if self.unpaid >= SKIP_AFTER:
                    self.skipping, self.since_probe = True, 0
                    self._skip_known = set(req_ids)
        self._last = {rid: (conf[i], bool(greedy[i]),
                            None if expected is None else float(expected[i]))
                      for i, rid in enumerate(req_ids) if lengths[i] > 0}
        np.add.at(self.hist, lengths[caps > 0], 1)
        self.steps_drafted += 1
        return lengths

    def _update_row_budget(self, chosen: np.ndarray, rows: int) -> None:
        """Rows for the next blocks: doubled when the policy used every row it had
        (it might have wanted more), else one more than the longest length it chose (at
        least ROWS_MIN), shrinking by at most one row a step."""
        if chosen.size == 0:
            return
        longest = int(chosen.max())
        if longest >= rows:
            self.row_budget = min(self.K, max(2 * rows, ROWS_MIN))
        else:
            self.row_budget = min(self.K, max(ROWS_MIN, longest + 1, self.row_budget - 1))

    def context_only(self, caps: np.ndarray) -> None:
        self._last = {}
        self.hist[0] += int((caps > 0).sum())
        self.steps_context += 1

    def end(self, req_ids: list[str], drafted: bool) -> None:
        now = self.clock()
        if self._t_begin is not None:
            if drafted:  # against the block's rows: its cost grows with them
                self.draft_cost.observe(len(req_ids) * (self._rows + 1), now - self._t_begin)
            else:
                self.context_cost.observe(len(req_ids), now - self._t_begin)
        self._t_end = now
        self._prev_ids = set(req_ids)
        if now - self._last_log >= LOG_EVERY_S:
            self.log_summary(now)

    # ------------------------------------------------------------------ summary
    def summary(self) -> dict:
        total = int(self.hist.sum())
        return {
            "request_steps": total,
            "verified_hist": self.hist.tolist(),
            "mean_verified": float((self.hist * np.arange(len(self.hist))).sum() / total)
            if total else 0.0,
            "steps_drafted": self.steps_drafted,
            "expected_accepted": round(self.expected_accepted, 1),
            "observed_accepted": self.observed_accepted,
            "steps_context_only": self.steps_context,
            "skipping": self.skipping,
            "threshold": self.threshold,
            "cost": (self.verify_cost.describe() if isinstance(self.verify_cost,
                                                                MeasuredStepCost)
                     else repr(self.injected)),
        }

    def log_summary(self, now: float | None = None) -> None:
        s = self.summary()
        if s["request_steps"]:
            hist = " ".join(f"{n}:{c}" for n, c in enumerate(s["verified_hist"]) if c)
            logger.info(
                "DSpine dynamic verification: %d request-steps, %.2f drafts verified per "
                "request-step (length:count %s); drafter ran in %d steps, context only "
                "in %d%s; drafts accepted %d (the policy expected %.1f); sampled "
                "threshold %s; step cost %s", s["request_steps"],
                s["mean_verified"], hist, s["steps_drafted"], s["steps_context_only"],
                " (skipping the drafter, probing)" if s["skipping"] else "",
                s["observed_accepted"], s["expected_accepted"],
                "none yet" if s["threshold"] is None else f"{s['threshold']:.3f}",
                s["cost"])
        self.hist[:] = 0
        self.steps_drafted = self.steps_context = 0
        self.expected_accepted, self.observed_accepted = 0.0, 0
        self._last_log = self.clock() if now is None else now
