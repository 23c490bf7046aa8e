"""Dynamic verification: how many of a block's 15 drafts each request sends to the
target, chosen per step to maximise committed tokens per unit of step time
(docs/dynamic-verification.md). This module is the policy; what a step costs is
`step_cost.py`, what a draft's acceptance is `calibration.py`.

Per request i and draft position t the policy needs

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
  * the length is n = #{t : G[i, t] >= lambda} with lambda set by the previous step
    (history), not by this step's drafts; under the `fair` objective, with other
    requests in the step, n = #{t : value[i, t] >= mu}, value[i, t] = log(1 + G[i, t] /
    (1 + G[i, 1] + ... + G[i, t-1])) (G[i, <= t] only) and mu set by the previous step;
  * requests with their own seed get a length from their own history only
    (`SeededLengthRule`: what they verified and accepted last), never from timings or
    the rest of the batch, so that the seed reproduces the text (the verified length
    changes how many random numbers verification draws). With the prompt lookup on,
    such a request takes the lookup's drafts whenever its own context has a
    continuation and the lookup's own rule (a second `SeededLengthRule`, fed only by
    the steps that verified lookup drafts) gives a length; else the drafter's, by the
    drafter's rule. Both read the request's own tokens and history only.

Only the rows that can be verified are drafted. Attention is causal inside the block and
the bridge passes codes from row t - 1 to row t, so the first m + 1 rows of a block are
the same whether 16 or m + 1 rows run; `Plan.rows` (one more than the longest length
chosen in the last steps, doubled when they reach it; all 15 in the warm-up, 4 for a
probe while the drafter is skipped, twice the budget for one while drafting) is how many
drafts the proposer asks of the block forward, the retrieval and the tail this step.
Where drafting does not pay the drafter is skipped, with probes (`DrafterSkip`).
`tests/test_dynamic_policy.py` checks the rule exactly on a small vocabulary, with the
rule that uses q_t(v_t) as the negative control.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from vllm.logger import init_logger

from vllm_dspine.proposer.calibration import AcceptanceCalibrator
from vllm_dspine.proposer.lookup import LookupBatch, LookupCalibrator
from vllm_dspine.proposer.step_cost import EWLinear, InjectedStepCost, MeasuredStepCost

# Under vLLM's "vllm" logger, whose handlers vLLM configures in every process (a
# logger named after this module would print nothing in the engine process).
logger = init_logger("vllm.dspine.dynamic_verification")

# A request's kind for the policy: which rule gives its verified length.
GREEDY = 0  # temperature 0: any length is lossless; the length uses the full chain
SAMPLED = 1  # random, no own seed: length by last step's threshold (see above)
AT_CAP = 2  # verified at its cap: random with its own seed (the cap then is
#             `SeededLengthRule`'s length), or probed this step

WARMUP_CAPS = (15, 0, 8, 2, 15, 4, 1, 0)  # lengths tried while the cost model is empty
# ... each at most WARMUP_TOKENS // R (and at least 2) for a step of R requests: the
# warm-up needs two operating points a factor 2 apart, and 15 drafts for 32 requests
# made a 512-token step that cost 2.7-2.8 s on this CPU, ten plain steps (with the first
# sampled step's, `choose_lengths`, the first round at concurrency 32 and t0.7 ran at
# 0.89-0.91x plain; docs/dynamic-verification.md "The warm-up").
WARMUP_TOKENS = 16


def warmup_cap(cap: int, num_live: int) -> int:
    """The warm-up length `cap` (of WARMUP_CAPS) for a step of `num_live` requests: at
    most WARMUP_TOKENS // num_live, at least 2 (N = 3R, past the factor 2 the cost model
    needs), never above `cap` (a 0 stays 0)."""
    return min(cap, max(2, WARMUP_TOKENS // max(num_live, 1)))


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
# Weight of a drafted step in the drafter's value per request (`drafter_value`).
DRAFTER_VALUE_EW = 0.1
LOG_EVERY_S = 30.0
# Where a request's drafts come from (`dspine_lookup`, docs/lookup.md).
DRAFTER, LOOKUP = 0, 1
# The lookup's floor (`lookup_floor`, docs/lookup.md "Concurrency above 1"): a straight
# line through the last steps' times against their target tokens, each step weighted
# LINE_DECAY more than the one before (~30 steps), used once its weight reaches
# LINE_MIN_WEIGHT (about 8 steps).
LINE_DECAY = 0.97
LINE_MIN_WEIGHT = 8.0
# Each request's own lookup record (`lookup_gains`, docs/lookup.md "What a step does"): the
# calibrator's bins pool every request, and on chat a request that never repeats itself
# shares bins with one that does (expected 72.8 accepted drafts where 12 came, measured).
# A request's lookup gains are scaled by rho in [LOOKUP_RHO_MIN, 1]: after a verification
# with `a` of its lookup drafts accepted where `e` were expected, log rho moves by
# LOOKUP_RHO_STEP x log((a + 1) / (e + 1)); in its steps without one, log rho decays by
# LOOKUP_RHO_DECAY towards 0 (~35 steps to halve), so a request whose early matches failed
# is tried again.
LOOKUP_RHO_MIN = 1.0 / 16
LOOKUP_RHO_STEP = 0.5
LOOKUP_RHO_DECAY = 0.98


def _pad(a: np.ndarray, width: int) -> np.ndarray:
    """[R, w] -> [R, width] (a copy), zeros past w (w <= width)."""
    out = np.zeros((a.shape[0], width), dtype=a.dtype)
    out[:, :a.shape[1]] = a[:, :width]
    return out


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
    # mu for the next step's sampled requests under the fair objective: the log-rate a
    # draft must add to its request (None unless `fair`).
    fair_threshold: float | None = None


def _best_prefix(gains: np.ndarray, tokens0: float, n0: int, step_seconds,
                 overhead_s: float, max_extra: int) -> tuple[int, float]:
    """argmax over m of (tokens0 + sum of the m largest gains) / (T(n0 + m) + overhead_s);
    gains sorted descending. Ties go to the smaller m."""
    M = max(0, min(len(gains), max_extra))
    cum = np.concatenate([[0.0], np.cumsum(gains[:M])])
    times = step_seconds(n0 + np.arange(M + 1)) + overhead_s
    rate = (tokens0 + cum) / np.maximum(times, 1e-12)
    m = int(np.argmax(rate))
    return m, float(rate[m])


def _best_prefix_fair(values: np.ndarray, n0: int, step_seconds, overhead_s: float,
                      max_extra: int, num_live: int) -> int:
    """argmax over m of (sum of the m largest values) - num_live x log(T(n0 + m) +
    overhead_s); values (each draft's gain in log tokens of its request) sorted
    descending. Ties go to the smaller m."""
    M = max(0, min(len(values), max_extra))
    cum = np.concatenate([[0.0], np.cumsum(values[:M])])
    times = step_seconds(n0 + np.arange(M + 1)) + overhead_s
    return int(np.argmax(cum - num_live * np.log(np.maximum(times, 1e-12))))


def _midway(values: np.ndarray, m: int) -> float:
    """The threshold an optimum that takes the first m of `values` (sorted descending,
    non-empty) leaves for the next step: midway between the last it takes and the first
    it leaves out (twice the first, when it takes none; 0 past the end)."""
    taken = float(values[m - 1]) if m > 0 else 2.0 * float(values[0]) + 1e-12
    left = float(values[m]) if m < len(values) else 0.0
    return 0.5 * (taken + left)


def choose_lengths(
    G: np.ndarray,  # [R, K] cumulative acceptance, non-increasing along K
    caps: np.ndarray,  # [R] int: most drafts request i may verify (0: none)
    kinds: np.ndarray,  # [R] GREEDY / SAMPLED / AT_CAP
    threshold: float | None,  # lambda from the previous step (None: none yet)
    step_seconds,  # N -> seconds of a verification step (vectorised)
    draft_s: float,  # the drafter's time a step
    context_s: float,  # the context-only drafter path (no block) a step
    max_tokens: int,  # the step's token budget
    live: np.ndarray | None = None,  # [R] bool: requests committing a token this step
    #                                  (default caps > 0; a request may be live at cap 0)
    fair: bool = False,  # lengths by the batch's log-rates (`objective` "fair")
    fair_threshold: float | None = None,  # mu from the previous step (`fair` only)
) -> Choice:
    R, K = G.shape
    live = caps > 0 if live is None else live
    lengths = np.zeros(R, dtype=np.int64)
    num_live = int(live.sum())
    tokens0 = float(num_live)  # each request commits its bonus/correction token
    n0 = num_live
    within = np.arange(K)[None, :] < caps[:, None]  # [R, K]
    value = None
    if fair:
        # What a draft is worth to its own request: its rate (1 + E_i) / T counted in
        # log, so draft t adds log(1 + E_i with it) - log(1 + E_i without it), falling
        # along the block (G falls and E_i grows); the step's time costs every live
        # request log T. It reads G[i, <= t] only, as the threshold rule does.
        cum = np.cumsum(np.where(within, G, 0.0), axis=1)  # [R, K]
        value = np.log1p(cum) - np.log1p(np.concatenate(
            [np.zeros((R, 1)), cum[:, :-1]], axis=1))  # [R, K]
    # AT_CAP: the cap.
    at_cap = live & (kinds == AT_CAP)
    lengths[at_cap] = caps[at_cap]
    tokens0 += float((G * within)[at_cap].sum())
    n0 += int(caps[at_cap].sum())
    # SAMPLED: the previous step's threshold (a prefix: G and value fall along K); under
    # `fair` with other requests in the step, the previous step's mu on the value.
    # Before any threshold (the first step after the warm-up), the warm-up's length for
    # this batch, not every draft: 15 drafts for each of 32 sampled requests made a
    # 512-token step, ten plain steps on this CPU. Either length is fixed before the
    # step's drafts are seen.
    sampled = live & (kinds == SAMPLED)
    if fair and num_live > 1 and fair_threshold is not None:
        take = within & (value >= fair_threshold)
    elif threshold is None:
        take = within & (np.arange(K)[None, :] < warmup_cap(K, num_live))
    else:
        take = within & (G >= threshold)
    lengths[sampled] = take[sampled].sum(axis=1)
    tok_s = tokens0 + float((G * take)[sampled].sum())
    n_s = n0 + int(lengths[sampled].sum())

    def entries(mask, values=G):
        rows, cols = np.nonzero(mask[:, None] & within)
        g = values[rows, cols]
        order = np.lexsort((cols, -g))  # value descending, then position ascending
        return rows[order], g[order]

    # GREEDY: the best prefix given the others.
    greedy = live & (kinds == GREEDY)
    if fair and num_live > 1:
        rows, v = entries(greedy, value)
        m = _best_prefix_fair(v, n_s, step_seconds, draft_s, max_tokens - n_s, num_live)
    else:
        rows, g = entries(greedy)
        m, _ = _best_prefix(g, tok_s, n_s, step_seconds, draft_s, max_tokens - n_s)
    np.add.at(lengths, rows[:m], 1)
    # The threshold for the next step, and whether drafting pays: the joint optimum
    # over every request whose length the policy chooses. The threshold is the gain
    # midway between the last draft the optimum takes and the first it leaves out, so
    # that the same gains next step give the same choice. (Not the marginal value
    # rate x dT/dN: the measured curve has dips, where that slope is negative.)
    rows, g = entries(greedy | sampled)
    m, rho = _best_prefix(g, tokens0, n0, step_seconds, draft_s, max_tokens - n0)
    lam = _midway(g, m) if len(g) else threshold
    mu = fair_threshold
    if fair:  # the same midpoint for mu, at the joint optimum of the log-rates
        rows, v = entries(greedy | sampled, value)
        if len(v):
            m = _best_prefix_fair(v, n0, step_seconds, draft_s, max_tokens - n0, num_live)
            mu = _midway(v, m)
    plain_s = float(step_seconds(num_live)) + context_s
    plain = num_live / max(plain_s, 1e-12)
    return Choice(lengths, lam, rho, plain, mu)


@dataclass
class Plan:
    draft: bool
    probe: set = field(default_factory=set)  # batch indices probed: verified at the cap
    rows: int = 0  # drafts per request the block computes (its first rows + 1 rows)
    caps: np.ndarray | None = None  # [R] the caps after the seeded rules
    # [R] bool: seeded requests whose drafts this step are the lookup's (at their cap);
    # None without any.
    lookup: np.ndarray | None = None


class DrafterSkip:
    """Whether the drafter runs at all, and which requests a probe verifies at its cap.

    While drafting: every EXPLORE_EVERY steps a probe (acceptance of longer prefixes).
    After SKIP_AFTER drafted steps that did not pay (a step far from paying counts as
    several once acceptance is calibrated) the drafter is skipped; then a probe every
    `probe_interval` steps (PROBE_MIN, doubling to PROBE_MAX while probes do not pay),
    spaced further where a probe is dear (`probe_gap`, PROBE_BUDGET); requests that
    arrived since the skip began are probed sooner, PROBE_MIN steps (and the gap) after
    the last probe at the earliest, without doubling the interval. A probed step that
    pays resumes drafting.
    """

    def __init__(self) -> None:
        self.skipping = False
        self.unpaid = 0  # drafted steps that did not pay, weighted (`record`)
        self.probe_interval = PROBE_MIN
        self.since_probe = 0
        self.cursor = 0  # where the next round-robin probe starts among the requests
        self.probing = False  # this step is a probe
        self.arrival_probe = False  # ... for requests that arrived while skipping
        # While skipping: the requests there when it began, and those probed since.
        self._known: set[str] = set()

    def new_step(self) -> None:
        self.probing = self.arrival_probe = False

    def next_step(self, req_ids: list[str], dynamic: np.ndarray,
                  probe_gap: Callable[[int, int], int]) -> tuple[bool, set[int]]:
        """(draft at all?, batch indices probed this step). dynamic: batch indices
        whose length the policy chooses; probe_gap(num_reqs, probed): fewest steps from
        one probe to the next while skipping."""
        self.since_probe += 1
        arrived: list[int] = []
        if self.skipping:
            self._known.intersection_update(req_ids)  # forget finished ones
            arrived = [int(i) for i in dynamic if req_ids[i] not in self._known]
            count = len(arrived) or -(-len(dynamic) // PROBES_PER_REQUESTS)
            gap = probe_gap(len(dynamic), count)
            if self.since_probe < max(self.probe_interval, gap):
                if not (arrived and self.since_probe >= gap):
                    return False, set()
                self.arrival_probe = True  # early: does not double the interval
        elif self.since_probe < EXPLORE_EVERY:
            return True, set()
        self.since_probe = 0
        self.probing = True
        if arrived:  # new requests first, all of them
            picked = set(arrived)
        else:
            count = max(1, -(-len(dynamic) // PROBES_PER_REQUESTS))
            picked = {int(dynamic[(self.cursor + j) % len(dynamic)]) for j in range(count)}
            self.cursor += count
        self._known.update(req_ids[i] for i in picked)
        return True, picked

    def record(self, req_ids: list[str], pays: bool, shortfall: float,
               calibrated: bool) -> None:
        """After a drafted step whose lengths the cost model chose: whether its best
        rate beat plain decoding's (`pays`), and by how much it fell short of it."""
        if self.skipping:
            if pays:
                self.skipping, self.unpaid, self.probe_interval = False, 0, PROBE_MIN
            elif self.probing and not self.arrival_probe:
                self.probe_interval = min(2 * self.probe_interval, PROBE_MAX)
            return
        # Once acceptance is calibrated, a step far from paying counts as several: at
        # high load drafting can miss by half, and each such step costs the drafter's
        # whole forward; near break-even (noise), or while the estimates still start
        # from the confidences, a step counts once.
        weight = 1
        if calibrated:
            weight = max(1, math.ceil(SKIP_AFTER * shortfall / UNPAID_SHORTFALL))
        # A step that pays takes one count back (not all: at concurrency 1 a few
        # confident steps that pay must not hide a run that does not).
        self.unpaid = max(self.unpaid - 1, 0) if pays else self.unpaid + weight
        if self.unpaid >= SKIP_AFTER:
            self.skipping, self.since_probe = True, 0
            self._known = set(req_ids)


class DynamicVerifier:
    """The policy's state across steps for one engine (one proposer).

    Per step the proposer calls `begin` (with what vLLM verified since the last call),
    `plan` (draft at all?), then `choose` (after drafting) or `context_only`, and `end`.
    """

    def __init__(self, num_proposals: int, cost: InjectedStepCost | None = None,
                 max_batch_tokens: int = 1 << 30,
                 clock: Callable[[], float] = time.perf_counter,
                 objective: str = "throughput") -> None:
        self.K = num_proposals
        # "throughput": greedy lengths maximise the batch's committed tokens per second;
        # "fair": the sum of the requests' log-rates (choose_lengths' `fair`).
        self.fair = objective == "fair"
        self.injected = cost
        self.step_cost = cost if cost is not None else MeasuredStepCost()
        self.draft_cost = EWLinear()
        self.context_cost = EWLinear()
        self.calibrator = AcceptanceCalibrator(num_proposals)
        # The lookup's acceptance, calibrated apart from the drafter's and apart for
        # matches into the prompt and into the answer (docs/lookup.md).
        self.lookup_calibrator = LookupCalibrator(num_proposals)
        self.last_source = np.zeros(0, dtype=np.int64)  # `choose`'s sources, per request
        # req id -> log rho, its own lookup record (LOOKUP_RHO_*); absent: 0.
        self._lookup_log_rho: dict[str, float] = {}
        # Accepted drafts the policy expected per request from the drafter where it
        # chose the drafter's drafts (exponentially weighted; `lookup_replaces_drafter`).
        self.drafter_value: float | None = None
        # ... and the drafts it verified per such request (what those cost to verify).
        self.drafter_drafts: float | None = None
        # The last steps' times against their target tokens, a straight line
        # (`lookup_floor`); the curve `step_cost` keeps is what the rest of the policy reads.
        self.step_line = EWLinear(LINE_DECAY)
        self.max_batch_tokens = max_batch_tokens
        self.clock = clock
        self.threshold: float | None = None
        self.fair_threshold: float | None = None  # mu (`fair` only)
        self.steps = 0
        self.skip = DrafterSkip()
        # req id -> (confidences, greedy, accepted drafts the policy expected or None
        # before the cost model was ready, DRAFTER / LOOKUP) of the drafts it verified
        # last step.
        self._last: dict[str, tuple[np.ndarray, bool, float | None, int]] = {}
        self._prev_ids: set[str] = set()
        self._t_begin: float | None = None
        self._t_end: float | None = None
        self._warm = 0
        self.seeded = SeededLengthRule(num_proposals)
        # The same rule for seeded requests' lookup drafts, fed by their lookup steps only.
        self.seeded_lookup = SeededLengthRule(num_proposals)
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
        # The same for the lookup's drafts alone (a share of the two above).
        self.lookup_expected_accepted = 0.0
        self.lookup_observed_accepted = 0
        self.lookup_verified = 0
        self.steps_context = 0
        self.steps_lookup_only = 0  # steps that verified lookup drafts without the drafter
        self.lookup_request_steps = 0  # request-steps whose drafts came from the lookup
        self._last_log = clock()

    # -------------------------------------------------------------- bookkeeping
    @property
    def ready(self) -> bool:
        return self.step_cost.ready and (self.injected is not None or self.draft_cost.ready)

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
            seconds = now - self._t_end
            # The line sees decode steps only (a prefill's thousand tokens would set its
            # slope alone) and, as the curve, no idle gaps.
            if 0 < num_tokens <= len(req_ids) * (self.K + 1) and seconds > 0 and not (
                    self.step_cost.ready and seconds > 4 * float(
                        self.step_cost.step_seconds(num_tokens)) + 0.05):
                self.step_line.observe(num_tokens, seconds)
            self.step_cost.observe(num_tokens, seconds)
        self._req_ids = list(req_ids)
        self._observed = {} if rejected is None else {
            rid: (int(n), max(int(n) - int(r), 0))
            for rid, n, r in zip(req_ids, verified, rejected) if n > 0}
        rho = self._lookup_log_rho
        self._lookup_log_rho = {rid: LOOKUP_RHO_DECAY * rho[rid] for rid in req_ids
                                if rid in rho}
        if rejected is not None and self._last:
            seen: tuple[list, list] = ([], [])  # DRAFTER, LOOKUP
            for i, rid in enumerate(req_ids):
                last = self._last.get(rid)
                n = int(verified[i])
                if last is None or n <= 0:
                    continue
                conf, greedy, expected, source = last
                accepted = max(n - int(rejected[i]), 0)
                n = min(n, len(conf))
                seen[source].append((conf, greedy, min(accepted, n), n))
                if expected is not None:
                    self.expected_accepted += expected
                    self.observed_accepted += accepted
                    if source == LOOKUP:
                        self.lookup_expected_accepted += expected
                        self.lookup_observed_accepted += accepted
                        self.lookup_verified += n
                        self._lookup_log_rho[rid] = min(0.0, max(
                            math.log(LOOKUP_RHO_MIN),
                            rho.get(rid, 0.0) + LOOKUP_RHO_STEP * math.log(
                                (accepted + 1.0) / (expected + 1.0))))
            self.calibrator.observe_many(seen[DRAFTER])
            self.lookup_calibrator.observe_many(seen[LOOKUP])
        self._t_begin = now

    def plan(self, kinds: np.ndarray, caps: np.ndarray,
             lookup_lengths: np.ndarray | None = None) -> Plan:
        """Whether to draft this step, how many rows, and the caps after the seeded
        rules (requests with their own seed: `SeededLengthRule`). lookup_lengths [R]:
        the lookup's continuation length per request this step (`dspine_lookup`; None
        without it): a seeded request with one takes the lookup by its own rule."""
        self.steps += 1
        caps = np.array(caps, dtype=np.int64)
        seeded = kinds == AT_CAP  # before this step's probes: the seeded requests
        from_lookup = None
        if seeded.any():
            caps, from_lookup = self._seeded_caps(caps, seeded, lookup_lengths)
        live = caps > 0
        self.skip.new_step()
        if not live.any():
            return Plan(False, caps=caps, lookup=from_lookup)
        # Seeded requests that take the drafter need its block, at their rows.
        block = live & seeded if from_lookup is None else live & seeded & ~from_lookup
        seeded_rows = int(caps[block].max()) if block.any() else 0
        if not self.ready:  # the warm-up: this step's length (`choose`), the seeded caps
            rows = self._warmup_length(int(live.sum()))
            return Plan(True, rows=min(self.K, max(rows, seeded_rows, 1)), caps=caps,
                        lookup=from_lookup)
        if seeded_rows:
            return Plan(True, rows=max(seeded_rows, min(self.row_budget, self.K)), caps=caps,
                        lookup=from_lookup)
        dynamic = np.nonzero(live & (kinds != AT_CAP))[0]
        if not len(dynamic):  # only seeded requests on the lookup: no block
            return Plan(False, caps=caps, lookup=from_lookup)
        draft, probe = self.skip.next_step(self._req_ids, dynamic, self._probe_gap)
        if not draft:
            return Plan(False, caps=caps, lookup=from_lookup)
        if not probe:
            return Plan(True, rows=min(self.row_budget, self.K), caps=caps, lookup=from_lookup)
        # A probe drafts every request's block (vLLM's DFlash layout), so its rows are
        # what it costs: while skipping, the first PROBE_ROWS drafts (do short prefixes
        # pay again?); while drafting, twice the budget (longer prefixes, step by step).
        rows = PROBE_ROWS if self.skip.skipping else min(self.K, 2 * self.row_budget)
        return Plan(True, probe, rows=rows, caps=caps, lookup=from_lookup)

    def _warmup_length(self, num_live: int) -> int:
        """This warm-up step's length (`plan` sizes the block by it, `choose` verifies
        it): the next of WARMUP_CAPS, scaled to the batch (`warmup_cap`)."""
        return warmup_cap(WARMUP_CAPS[self._warm % len(WARMUP_CAPS)], num_live)

    def _seeded_caps(self, caps: np.ndarray, seeded: np.ndarray,
                     lookup_lengths: np.ndarray | None
                     ) -> tuple[np.ndarray, np.ndarray | None]:
        """The caps [R] of the seeded requests by their own rules, and [R] bool which
        of them take the lookup this step (None without the lookup). Each rule reads
        what the request verified and accepted last step from its own source only
        (`_last` still holds the sources of that step), so the drafter's rule never
        sees the lookup's acceptance nor the reverse."""
        if lookup_lengths is None:
            return np.minimum(caps, self.seeded.lengths(
                self._req_ids, self._observed, seeded)), None
        source = {rid: last[3] for rid, last in self._last.items()}
        mine = {DRAFTER: {}, LOOKUP: {}}
        for rid, seen in self._observed.items():
            mine[source.get(rid, DRAFTER)][rid] = seen
        n_drafter = self.seeded.lengths(self._req_ids, mine[DRAFTER], seeded)
        n_lookup = self.seeded_lookup.lengths(self._req_ids, mine[LOOKUP], seeded)
        lookup_lengths = np.asarray(lookup_lengths, dtype=np.int64)
        from_lookup = seeded & (lookup_lengths > 0) & (n_lookup > 0) & (caps > 0)
        caps = np.where(from_lookup, np.minimum(caps, np.minimum(n_lookup, lookup_lengths)),
                        np.minimum(caps, n_drafter))
        return caps, from_lookup

    def _probe_gap(self, num_reqs: int, probed: int) -> int:
        """Fewest steps from one probe to the next while skipping (at least PROBE_MIN):
        what a probe of `probed` requests adds to a step (a block of PROBE_ROWS drafts for
        all `num_reqs`, and PROBE_ROWS more target tokens per probed request), over
        PROBE_BUDGET of a step without the drafter."""
        R = max(num_reqs, 1)
        plain = float(self.step_cost.step_seconds(R)) + self.context_seconds(R)
        extra = (self.draft_seconds(R * (PROBE_ROWS + 1)) - self.context_seconds(R)
                 + float(self.step_cost.step_seconds(R + probed * PROBE_ROWS))
                 - float(self.step_cost.step_seconds(R)))
        if not plain > 0:
            return PROBE_MIN
        return max(PROBE_MIN, math.ceil(max(extra, 0.0) / (PROBE_BUDGET * plain)))

    def choose(self, req_ids: list[str], kinds: np.ndarray, caps: np.ndarray,
               conf: np.ndarray, plan: Plan, lookup: LookupBatch | None = None
               ) -> np.ndarray:
        """conf [R, rows] from `draft_confidence`; lookup: this step's lookup proposals
        (`dspine_lookup`; None without). Returns the verified length per request; where
        each request's drafts come from is then `last_source` [R] (DRAFTER / LOOKUP)."""
        greedy = kinds == GREEDY  # also the kind of what a probe of it observes
        policy = kinds != AT_CAP  # lengths the policy chooses (not seeded, not probed)
        kinds = kinds.copy()
        for i in plan.probe:
            kinds[i] = AT_CAP
            policy[i] = False
        rows = self._rows = conf.shape[1]  # drafts this block computed
        # plan.caps: the caller's caps after the seeded rules (never above them).
        caps_all = np.asarray(caps if plan.caps is None else plan.caps)
        caps = np.minimum(caps_all, rows)
        R = len(req_ids)
        source = np.full(R, DRAFTER, dtype=np.int64)
        used_conf = conf
        # Seeded requests on the lookup (`plan.lookup`): their cap, whatever the block's rows.
        seeded_lookup = plan.lookup if plan.lookup is not None else np.zeros(R, dtype=bool)
        if seeded_lookup.any():
            width = max(rows, lookup.conf.shape[1])
            caps = np.where(seeded_lookup, caps_all, caps)
            source[seeded_lookup] = LOOKUP
            used_conf = _pad(conf, width)
            used_conf[seeded_lookup] = lookup.conf[seeded_lookup, :width]
        if not self.ready:
            cap = self._warmup_length(int((caps_all > 0).sum()))
            self._warm += 1
            lengths = np.where(kinds == AT_CAP, caps, np.minimum(caps, cap))
            expected = None
        else:
            alpha = np.clip(self.calibrator.predict(conf, greedy), 0.0, 1.0)
            G = np.cumprod(alpha, axis=1)
            GL_raw = (self.lookup_gains(lookup, greedy, floor=False)
                      if lookup is not None and lookup.any else None)
            if seeded_lookup.any():  # what the policy expects of their lookup drafts
                G = _pad(G, used_conf.shape[1])
                G[seeded_lookup] = GL_raw[seeded_lookup, :G.shape[1]]
            draft_s = self.draft_seconds(R * (min(self.row_budget, self.K) + 1))
            context_s = self.context_seconds(R)
            live = caps_all > 0
            rho_without = None  # the best rate of this step without the drafter
            if GL_raw is not None:
                GL = self._floored(GL_raw, int(live.sum()))
                capsL = np.where(policy, np.minimum(np.minimum(caps_all, lookup.lengths),
                                                 (GL > 0).sum(1)), 0)
                use = self._prefer_lookup(G, caps, GL, capsL, greedy, policy)
                # The step without the drafter still verifies the seeded lookup drafts.
                capsL = np.where(seeded_lookup, caps_all, capsL)
                if use.any():
                    width = max(rows, GL.shape[1])
                    G = _pad(G, width)
                    G[use] = GL[use, :width]
                    used_conf = _pad(used_conf, width)
                    used_conf[use] = lookup.conf[use, :width]
                    caps = caps.copy()
                    caps[use] = capsL[use]
                    source[use] = LOOKUP
                rho_without = choose_lengths(
                    GL, capsL, np.where(policy, kinds, AT_CAP), self.threshold,
                    self.step_cost.step_seconds, context_s, context_s,
                    self.max_batch_tokens, live=live).rho_draft
            choice = choose_lengths(G, caps, kinds, self.threshold,
                                    self.step_cost.step_seconds, draft_s, context_s,
                                    self.max_batch_tokens, live=live, fair=self.fair,
                                    fair_threshold=self.fair_threshold)
            lengths = choice.lengths
            expected = np.where(np.arange(G.shape[1]) < lengths[:, None], G, 0.0).sum(1)
            self.threshold, self.fair_threshold = choice.threshold, choice.fair_threshold
            # Drafting pays if it beats plain decoding and, with the lookup, the step
            # the lookup alone would make without the drafter.
            rho_other = max(choice.rho_plain, rho_without or 0.0)
            pays = choice.rho_draft > rho_other
            self._update_row_budget(lengths[policy & (caps > 0) & (source == DRAFTER)],
                                    rows)
            mine = policy & (caps_all > 0) & (source == DRAFTER)
            if mine.any():
                v = float(expected[mine].mean())
                n = float(lengths[mine].mean())
                self.drafter_value = v if self.drafter_value is None else (
                    self.drafter_value + DRAFTER_VALUE_EW * (v - self.drafter_value))
                self.drafter_drafts = n if self.drafter_drafts is None else (
                    self.drafter_drafts + DRAFTER_VALUE_EW * (n - self.drafter_drafts))
            self.skip.record(req_ids, pays,
                             shortfall=1.0 - choice.rho_draft / max(rho_other, 1e-12),
                             calibrated=self.calibrator.trials.sum() >= CALIBRATED_TRIALS)
        self._remember(req_ids, used_conf, greedy, expected, lengths, source)
        np.add.at(self.hist, lengths[caps_all > 0], 1)
        self.steps_drafted += 1
        self.lookup_request_steps += int(((source == LOOKUP) & (lengths > 0)).sum())
        self.last_source = source
        return lengths

    # --------------------------------------------------------------- lookup
    def lookup_gains(self, lookup: LookupBatch, greedy: np.ndarray,
                     num_live: int | None = None, floor: bool = True) -> np.ndarray:
        """G of the lookup's drafts [R, K]: the lookup calibrator's acceptance of each
        draft, cumulated, times the request's own record rho (LOOKUP_RHO_*; history
        only, so the sampled rules stay lossless); 0 past each request's lookup length
        and (`floor`) where G is below `lookup_floor(num_live)` (num_live: the requests
        committing a token this step, default R)."""
        alpha = np.clip(self.lookup_calibrator.predict(lookup.conf, greedy), 0.0, 1.0)
        within = np.arange(lookup.conf.shape[1])[None, :] < lookup.lengths[:, None]
        G = np.where(within, np.cumprod(alpha, axis=1), 0.0)
        if self._lookup_log_rho and len(self._req_ids) == G.shape[0]:
            G = G * np.exp([self._lookup_log_rho.get(rid, 0.0)
                            for rid in self._req_ids])[:, None]
        if not floor:
            return G
        return self._floored(G, len(lookup.lengths) if num_live is None else num_live)

    def _floored(self, G: np.ndarray, num_live: int) -> np.ndarray:
        """G [R, K] with 0 where it is below `lookup_floor(num_live)`."""
        floor = self.lookup_floor(num_live)
        return np.where(G >= floor, G, 0.0) if floor > 0 else G

    def lookup_floor(self, num_live: int) -> float:
        """The least expected gain a lookup draft needs to be verified with `num_live`
        requests in the step: plain decoding's rate times the marginal cost of one more
        verified token, R b / (a + b R + context-only time), with a + b N the straight
        line through the last steps' times (`step_line`; the injected line when the cost
        is injected). Under a cost line the step's best rate is at least plain's, so a
        draft worth less lowers it whatever else is verified; the measured curve's own
        slope between R and the N the policy visits may be off (its speed factor takes
        most of a change seen at the visited N, so the rarely visited plain point drifts
        with it, docs/lookup.md), the line is refitted on every step. 0 (no floor)
        before the line has LINE_MIN_WEIGHT of steps with varying N, or where its slope
        is not positive (a dip of a CPU's curve at small N)."""
        if num_live <= 0:
            return 0.0
        if self.injected is not None:
            line = (self.injected.step_s, self.injected.token_s)
        else:
            line = self.step_line.line(LINE_MIN_WEIGHT)
        if line is None or not line[1] > 0:
            return 0.0
        a, b = line
        plain = a + b * num_live + self.context_seconds(num_live)
        return num_live * b / plain if plain > 0 else 0.0

    def _prefer_lookup(self, G: np.ndarray, caps: np.ndarray, GL: np.ndarray,
                       capsL: np.ndarray, greedy: np.ndarray, policy: np.ndarray
                       ) -> np.ndarray:
        """[R] bool: the requests whose drafts this step are the lookup's.

        Greedy requests (any choice is lossless): the source whose drafts are worth
        more above the marginal gain of the last step's optimum (lambda): sum over t of
        max(G[t] - lambda, 0) within the caps. Sampled requests: only what is known
        before the drafter's first draw may decide (otherwise the drafts verified would
        no longer be distributed as their q, dynamic.py's docstring): the lookup's
        acceptance of draft 1 against the drafter's (its confidence there is the peak
        of q_1(. | anchor), drawn from after)."""
        lam = self.threshold or 0.0
        K = max(G.shape[1], GL.shape[1])
        t = np.arange(K)[None, :]
        d = np.where(t < caps[:, None], np.maximum(_pad(G, K) - lam, 0.0), 0.0).sum(1)
        l_ = np.where(t < capsL[:, None], np.maximum(_pad(GL, K) - lam, 0.0), 0.0).sum(1)
        has = capsL > 0
        g1 = np.where(caps > 0, G[:, 0], 0.0)
        return policy & has & np.where(greedy, l_ > d, GL[:, 0] >= g1)

    def lookup_replaces_drafter(self, plan: Plan, kinds: np.ndarray,
                                lookup: LookupBatch | None) -> bool:
        """Whether this step, which the plan would draft, skips the drafter for the
        lookup alone. The drafter's drafts are not known before it runs; what the policy
        has is what its drafts have been worth: `drafter_value`, the accepted drafts it
        expected per request where the drafter was chosen (exponentially weighted). With
        E_L[i] the lookup's expected accepted drafts at the lengths the policy would
        verify, the step with the drafter is estimated at (R + sum max(E_L, value)) /
        (T + drafter time), without it (R + sum E_L) / (T + context-only time), T the
        verification of the lookup's drafts. Never while a request needs the block (a
        probe, a seeded request on the drafter) or before the drafter's value is known."""
        if (lookup is None or not lookup.any or not self.ready or not plan.draft
                or self.drafter_value is None):
            return False
        caps = plan.caps
        live = caps > 0
        seeded = live & (kinds == AT_CAP)
        if plan.lookup is not None:
            seeded &= ~plan.lookup
        if plan.probe or seeded.any():
            return False
        R = int(live.sum())
        greedy = kinds == GREEDY
        GL = self.lookup_gains(lookup, greedy, R)
        within = np.arange(GL.shape[1])[None, :] < np.minimum(caps, lookup.lengths)[:, None]
        lam = self.threshold or 0.0
        # Seeded requests on the lookup verify their cap whatever it is worth.
        fixed = (np.zeros(len(caps), dtype=bool) if plan.lookup is None
                 else plan.lookup)
        take = within & (((GL >= lam) & (GL > 0)) | fixed[:, None])
        E = np.where(take, GL, 0.0).sum(1)[live]
        n_look = take[live].sum(1)
        # Where the drafter's value beats the lookup's, its drafts are verified instead:
        # its tokens and its drafts' verification (drafter_drafts per request; before
        # that is known, as many as it is expected to have accepted).
        value = self.drafter_value
        n_draft = self.drafter_drafts if self.drafter_drafts is not None else value
        use_d = (value > E) & ~fixed[live]
        T_with = float(self.step_cost.step_seconds(
            R + float(np.where(use_d, n_draft, n_look).sum())))
        with_drafter = (R + np.where(use_d, value, E).sum()) / (
            T_with + self.draft_seconds(R * (min(self.row_budget, self.K) + 1)))
        T = float(self.step_cost.step_seconds(R + int(n_look.sum())))
        without = (R + E.sum()) / (T + self.context_seconds(R))
        return bool(without >= with_drafter)

    def choose_lookup_only(self, req_ids: list[str], kinds: np.ndarray, caps: np.ndarray,
                           lookup: LookupBatch | None,
                           seeded: np.ndarray | None = None) -> np.ndarray:
        """A step without the drafter (skipped, or replaced by the lookup): the lookup's
        drafts where they pay, by the same rule as `choose`, the step's drafter time
        being the context-only write; seeded [R] bool (`Plan.lookup`): seeded requests
        on the lookup, verified at their caps. Returns the lengths [R] (all 0: a plain
        step)."""
        caps = np.asarray(caps)
        R = len(req_ids)
        lengths = np.zeros(R, dtype=np.int64)
        live = caps > 0
        greedy = kinds == GREEDY
        policy = kinds != AT_CAP
        # (Before the cost model is ready a step with live requests is always drafted,
        # `plan`, so the seeded requests here are all past the warm-up.)
        seeded = np.zeros(R, dtype=bool) if seeded is None else seeded & live
        if lookup is not None and lookup.any and self.ready:
            GL_raw = self.lookup_gains(lookup, greedy, floor=False)
            GL = self._floored(GL_raw, int(live.sum()))
            capsL = np.where(policy, np.minimum(np.minimum(caps, lookup.lengths),
                                              (GL > 0).sum(1)), np.where(seeded, caps, 0))
            GL[seeded] = GL_raw[seeded]
            context_s = self.context_seconds(R)
            choice = choose_lengths(GL, capsL, np.where(policy, kinds, AT_CAP),
                                    self.threshold, self.step_cost.step_seconds,
                                    context_s, context_s, self.max_batch_tokens, live=live,
                                    fair=self.fair, fair_threshold=self.fair_threshold)
            lengths = choice.lengths
            self.threshold, self.fair_threshold = choice.threshold, choice.fair_threshold
            expected = np.where(np.arange(GL.shape[1]) < lengths[:, None], GL, 0.0).sum(1)
            self._remember(req_ids, lookup.conf, greedy, expected, lengths,
                           np.full(R, LOOKUP, dtype=np.int64))
        else:
            self._last = {}
        np.add.at(self.hist, lengths[live], 1)
        self.steps_context += 1
        if (lengths > 0).any():
            self.steps_lookup_only += 1
            self.lookup_request_steps += int((lengths > 0).sum())
        return lengths

    def _remember(self, req_ids, conf, greedy, expected, lengths, source) -> None:
        self._last = {rid: (conf[i], bool(greedy[i]),
                            None if expected is None else float(expected[i]),
                            int(source[i]))
                      for i, rid in enumerate(req_ids) if lengths[i] > 0}

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
            "steps_lookup_only": self.steps_lookup_only,
            "lookup_request_steps": self.lookup_request_steps,
            "lookup_verified": self.lookup_verified,
            "lookup_expected_accepted": round(self.lookup_expected_accepted, 1),
            "lookup_observed_accepted": self.lookup_observed_accepted,
            "skipping": self.skip.skipping,
            "threshold": self.threshold,
            "cost": (self.step_cost.describe() if isinstance(self.step_cost,
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
                "in %d%s (%d of them verifying lookup drafts; %d request-steps verified "
                "lookup drafts); drafts accepted %d (the policy expected %.1f); sampled "
                "threshold %s; step cost %s", s["request_steps"],
                s["mean_verified"], hist, s["steps_drafted"], s["steps_context_only"],
                " (skipping the drafter, probing)" if s["skipping"] else "",
                s["steps_lookup_only"], s["lookup_request_steps"],
                s["observed_accepted"], s["expected_accepted"],
                "none yet" if s["threshold"] is None else f"{s['threshold']:.3f}",
                s["cost"])
        self.hist[:] = 0
        self.steps_drafted = self.steps_context = 0
        self.steps_lookup_only = self.lookup_request_steps = 0
        self.expected_accepted, self.observed_accepted = 0.0, 0
        self.lookup_expected_accepted, self.lookup_observed_accepted = 0.0, 0
        self.lookup_verified = 0
        self._last_log = self.clock() if now is None else now
