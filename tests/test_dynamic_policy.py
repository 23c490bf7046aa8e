"""The dynamic-verification policy (vllm_dspine/proposer/dynamic.py) without an engine:
its choices under injected cost models, the measured cost model (step_cost.py), the
calibration (calibration.py), the drafter skip with its probes, and losslessness of the
sampled rule, checked exactly; the context log of skipped steps (context_log.py)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from engine_utils import engine_env

engine_env()

from vllm_dspine.proposer.calibration import (  # noqa: E402
    AcceptanceCalibrator,
    draft_confidence,
)
from vllm_dspine.proposer.dynamic import (  # noqa: E402
    AT_CAP,
    GREEDY,
    PROBE_MIN,
    PROBE_ROWS,
    ROWS_MIN,
    SAMPLED,
    SEEDED_START,
    SKIP_AFTER,
    WARMUP_CAPS,
    DynamicVerifier,
    choose_lengths,
)
from vllm_dspine.proposer.lookup import (  # noqa: E402
    IN_ANSWER,
    LookupCalibrator,
    lookup_feature,
)
from vllm_dspine.proposer.step_cost import InjectedStepCost, MeasuredStepCost  # noqa: E402

K = 15


class FakeClock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def _certain(cal: AcceptanceCalibrator, greedy: bool = True, n: int = 400) -> None:
    """The calibrator has seen every draft of confidence 1.0 accepted."""
    for _ in range(n):
        cal.observe(np.ones(K), greedy, K, K)


def _step(v: DynamicVerifier, req_ids, kinds, conf, rejected=None, verified=None,
          num_tokens=None, clock=None, step_s=None):
    """One engine step through the policy; returns (drafted?, lengths)."""
    R = len(req_ids)
    v.begin(req_ids, verified or [0] * R, rejected, num_tokens or R)
    caps = np.full(R, K)
    plan = v.plan(np.array(kinds), caps)
    if not plan.draft:
        v.context_only(caps)
        v.end(req_ids, drafted=False)
        return False, np.zeros(R, dtype=int)
    assert 1 <= plan.rows <= K
    # The proposer drafts only the block's first plan.rows drafts.
    lengths = v.choose(req_ids, np.array(kinds), caps, conf[:, :plan.rows], plan)
    assert (lengths <= plan.rows).all()
    v.end(req_ids, drafted=True)
    return True, lengths


# Drafting that does not pay while probes are cheap: verification nearly free, the
# drafter 15 % of a step, drafts seldom accepted. (Where verification itself is dear,
# probes are too, and PROBE_BUDGET spaces them further: its own test below.)
UNPAID_CHEAP_PROBES = InjectedStepCost(step_s=1.0, token_s=0.001, draft_s=0.15)


def test_zero_drafts_when_the_cost_model_says_verification_cannot_pay():
    """Injected cost: a verified token costs as much as a whole step's fixed part plus
    more, and no draft is certain: every request verifies 0; after SKIP_AFTER such steps
    the drafter itself is skipped, with probes at doubling intervals."""
    v = DynamicVerifier(K, InjectedStepCost(step_s=0.0, token_s=1.0, draft_s=0.0))
    ids = ["a", "b", "c", "d"]
    conf = np.full((4, K), 0.95)
    kinds = [GREEDY, GREEDY, SAMPLED, SAMPLED]
    drafted, lengths = _step(v, ids, kinds, conf)
    # Sampled: no threshold from a past step yet, so the warm-up's length for 4
    # requests (16 // 4 drafts each, `warmup_cap`); beside those 8 tokens a few
    # confident greedy drafts raise the batch's rate.
    assert drafted and list(lengths[2:]) == [4, 4]
    drafted, lengths = _step(v, ids, kinds, conf)
    assert drafted and list(lengths) == [0, 0, 0, 0]
    drafted, lengths = _step(v, ids[:2], kinds[:2], conf[:2])
    assert drafted and list(lengths) == [0, 0]  # greedy alone: nothing pays
    for _ in range(SKIP_AFTER - 3):
        assert _step(v, ids, kinds, conf)[0]
    assert v.summary()["skipping"]
    # The drafter is skipped now, except at probes: one request verified at all of the
    # probe's PROBE_ROWS drafts (and beside its tokens, a few confident drafts of the
    # others may pay).
    v = DynamicVerifier(K, UNPAID_CHEAP_PROBES)
    conf = np.full((4, K), 0.05)
    for _ in range(SKIP_AFTER):
        _step(v, ids, kinds, conf)
    assert v.summary()["skipping"]
    pattern = []
    for _ in range(PROBE_MIN * 7):
        drafted, lengths = _step(v, ids, kinds, conf)
        pattern.append(drafted)
        if drafted:
            assert lengths.max() <= PROBE_ROWS and (lengths == PROBE_ROWS).sum() >= 1
    probes = [i + 1 for i, d in enumerate(pattern) if d]
    assert probes[:3] == [PROBE_MIN, 3 * PROBE_MIN, 7 * PROBE_MIN]
    assert v.summary()["skipping"]


def test_probes_take_at_most_their_budget_of_engine_time():
    """Where verification is what does not pay (a token costs as much as a step), a
    probe costs as much as a step: probes are then spaced so that their extra cost stays
    within PROBE_BUDGET of the engine's time, arrivals included (at PROBE_MIN they would
    have taken 1 / PROBE_MIN of it)."""
    from vllm_dspine.proposer.dynamic import PROBE_BUDGET

    cost = InjectedStepCost(step_s=0.0, token_s=1.0, draft_s=0.0)
    v = DynamicVerifier(K, cost)
    ids, kinds = ["a", "b", "c", "d"], [GREEDY] * 4
    conf = np.full((4, K), 0.95)
    for _ in range(SKIP_AFTER):
        _step(v, ids, kinds, conf)
    assert v.summary()["skipping"]
    spent = extra = 0.0
    arrivals = 0
    for step in range(2000):
        if step % 50 == 0:  # a new request every 50 steps, replacing the oldest
            arrivals += 1
            ids = ids[1:] + [f"new{arrivals}"]
        drafted, lengths = _step(v, ids, kinds, conf)
        plain = float(cost.step_seconds(len(ids)))
        spent += plain
        if drafted:
            extra += float(cost.step_seconds(len(ids) + lengths.sum())) - plain
    assert 0 < extra <= PROBE_BUDGET * spent * 1.05, (extra, spent)


def test_requests_arriving_while_skipping_are_probed_soon():
    """While the drafter is skipped, probes come at doubling intervals (16, 32, 64, ...
    steps). A request that arrives meanwhile (a new workload whose acceptance nobody has
    seen) is probed PROBE_MIN steps after the last probe at the earliest, once, and that
    early probe does not double the interval; the requests there all along wait for it."""
    v = DynamicVerifier(K, UNPAID_CHEAP_PROBES)
    ids = ["a", "b", "c", "d"]
    kinds = [GREEDY] * 4
    conf = np.full((4, K), 0.05)
    for _ in range(SKIP_AFTER):
        _step(v, ids, kinds, conf)
    assert v.summary()["skipping"]
    probes = [i + 1 for i in range(7 * PROBE_MIN) if _step(v, ids, kinds, conf)[0]]
    assert probes == [PROBE_MIN, 3 * PROBE_MIN, 7 * PROBE_MIN]  # the interval is 8x now
    ids5, kinds5, conf5 = ids + ["e"], kinds + [GREEDY], np.full((5, K), 0.05)
    drafted = [_step(v, ids5, kinds5, conf5) for _ in range(9 * PROBE_MIN)]
    steps = [i + 1 for i, (d, _) in enumerate(drafted) if d]
    # "e" at PROBE_MIN steps; then the regular probe, the interval (8 x PROBE_MIN, not
    # doubled by the early probe) after it.
    assert steps == [PROBE_MIN, 9 * PROBE_MIN], steps
    lengths = drafted[PROBE_MIN - 1][1]
    assert lengths[4] == PROBE_ROWS and (lengths[:4] < PROBE_ROWS).all(), lengths
    assert v.summary()["skipping"]


def test_a_step_far_from_paying_skips_the_drafter_at_once():
    """Near break-even, or before CALIBRATED_TRIALS verified drafts were observed, a
    drafted step that does not pay counts once toward SKIP_AFTER; once calibrated, a
    step whose best rate is UNPAID_SHORTFALL or more below plain decoding's (here the
    drafter costs 5 target steps) makes the next step skip the drafter."""
    from vllm_dspine.proposer.dynamic import CALIBRATED_TRIALS, UNPAID_SHORTFALL

    ids = ["a", "b", "c", "d"]
    kinds = [GREEDY] * 4
    conf = np.full((4, K), 0.3)
    cost = InjectedStepCost(step_s=0.01, token_s=0.001, draft_s=0.05)
    v = DynamicVerifier(K, cost)
    for _ in range(SKIP_AFTER - 1):  # not calibrated yet: one count each
        assert _step(v, ids, kinds, conf)[0]
    assert not v.summary()["skipping"]
    v = DynamicVerifier(K, cost)
    v.calibrator.observe_many([(conf[0], True, 1, 4)] * (CALIBRATED_TRIALS // 2))
    assert _step(v, ids, kinds, conf)[0]  # drafted: its rate is far below plain's
    s = v.summary()
    assert s["skipping"], s
    assert not _step(v, ids, kinds, conf)[0]
    # Break-even (the drafter free, no draft worth its token): one count per step.
    v = DynamicVerifier(K, InjectedStepCost(step_s=0.0, token_s=1.0, draft_s=0.0))
    for _ in range(SKIP_AFTER - 1):
        assert _step(v, ids, kinds, conf)[0]
    assert not v.summary()["skipping"] and 0 < UNPAID_SHORTFALL < 1


def test_fifteen_drafts_when_acceptance_is_certain():
    """Every draft accepted so far at confidence 1.0, and the step has a fixed part (an
    engine step is never free): all 15 drafts are verified, greedy at once, sampled from
    the second step (their threshold comes from the step before; at the first, the
    warm-up's length for 6 requests, 16 // 6 = 2 drafts each)."""
    v = DynamicVerifier(K, InjectedStepCost(step_s=0.01, token_s=0.001, draft_s=0.002))
    _certain(v.calibrator, greedy=True)
    _certain(v.calibrator, greedy=False)
    ids = [f"r{i}" for i in range(6)]
    kinds = [GREEDY, GREEDY, GREEDY, SAMPLED, SAMPLED, SAMPLED]
    conf = np.ones((6, K))
    for step in range(3):
        drafted, lengths = _step(v, ids, kinds, conf)
        assert drafted and list(lengths) == [K] * 3 + [K if step else 2] * 3
    assert not v.summary()["skipping"]


def _seeded_lengths(v: DynamicVerifier, accepted_of, others, conf_others, steps=40):
    """Runs a seeded request "s" beside `others` (greedy); accepted_of(step, n) says how
    many of its n verified drafts were accepted. -> its verified length per step."""
    ids = ["s"] + [f"g{i}" for i in range(others)]
    kinds = [AT_CAP] + [GREEDY] * others
    conf = np.vstack([np.full((1, K), 0.5), conf_others])[: others + 1]
    out, verified, rejected = [], [0] * (others + 1), None
    for step in range(steps):
        drafted, lengths = _step(v, ids, kinds, conf, rejected=rejected, verified=verified)
        n = int(lengths[0])
        out.append(n)
        verified = [int(x) for x in lengths]
        rejected = [n - accepted_of(step, n)] + [int(x) for x in lengths[1:]]
    return out


def test_seeded_requests_follow_their_own_history():
    """A seeded request's verified length depends on what it verified and accepted
    before, nothing else (its seed must reproduce its text): the same history gives the
    same lengths whatever the cost model and whoever else is in the batch. The rule:
    all accepted -> double, else accepted + 1; two verifications with nothing accepted
    -> 0 for a wait that doubles while probes fail, then a 1-draft probe."""
    pattern = lambda step, n: n if step % 5 < 3 else 0  # noqa: E731
    a = _seeded_lengths(DynamicVerifier(K, InjectedStepCost(0.0, 1.0, 0.0)), pattern, 0,
                        np.zeros((0, K)))
    b = _seeded_lengths(DynamicVerifier(K, InjectedStepCost(0.01, 0.0001, 0.0)), pattern, 3,
                        np.ones((3, K)))
    assert a == b
    assert a[:8] == [4, 8, 15, 15, 1, 0, 0, 0]
    never = _seeded_lengths(DynamicVerifier(K, InjectedStepCost(0.0, 1.0, 0.0)),
                            lambda step, n: 0, 0, np.zeros((0, K)), steps=80)
    # 4 (nothing) -> 1 (nothing) -> wait 4 -> probe 1 ... waits 4, 8, 16, 32, 64.
    assert never[:2] == [4, 1] and never[2:6] == [0, 0, 0, 0] and never[6] == 1
    probes = [i for i, n in enumerate(never) if n]
    gaps = np.diff(probes[1:])
    assert list(gaps[:4]) == [5, 9, 17, 33]
    assert sum(never) == len(probes[1:]) + 4


def test_seeded_request_alone_does_not_force_the_drafter():
    """Once its own rule gives a seeded request 0 drafts, a batch of it and greedy
    requests whose drafts do not pay is not drafted (the fixed length used to force the
    drafter every step)."""
    v = DynamicVerifier(K, InjectedStepCost(step_s=0.0, token_s=1.0, draft_s=0.0))
    drafted = _seeded_lengths(v, lambda step, n: 0, 2, np.full((2, K), 0.02), steps=40)
    assert sum(1 for n in drafted if n) <= 6


def test_intermediate_lengths_follow_confidence():
    """A fixed step cost and a per-token cost in between: confident requests verify
    longer prefixes than unsure ones, and some verify a few, not 0 or 15."""
    v = DynamicVerifier(K, InjectedStepCost(step_s=0.004, token_s=0.001, draft_s=0.0))
    decay = np.array([0.97, 0.9, 0.7, 0.4])[:, None] ** np.arange(1, K + 1)[None, :]
    conf = np.repeat(decay[:, :1], K, axis=1)  # constant confidence per request
    _, lengths = _step(v, ["a", "b", "c", "d"], [GREEDY] * 4, conf)
    assert list(lengths) == sorted(lengths, reverse=True)
    assert lengths[0] > lengths[-1]
    assert any(0 < n < K for n in lengths)


def test_row_budget_follows_the_chosen_lengths():
    """Only rows that can be verified are drafted: with short chosen lengths the next
    blocks shrink to one more than the longest (at least ROWS_MIN), one row a step at most; when
    acceptance becomes certain the policy uses every row it has and the budget doubles
    back to 15."""
    v = DynamicVerifier(K, InjectedStepCost(step_s=0.004, token_s=0.001, draft_s=0.0))
    ids = ["a", "b"]
    budgets, longest = [], []
    for _ in range(20):
        _, lengths = _step(v, ids, [GREEDY, GREEDY], np.full((2, K), 0.6))
        budgets.append(v.row_budget)
        longest.append(int(lengths.max()))
    assert 0 < max(longest[-5:]) < 8
    assert all(b - a <= 1 for a, b in zip(budgets[1:], budgets[:-1]))  # shrinks slowly
    assert budgets[-1] == max(ROWS_MIN, longest[-1] + 1) < K
    _certain(v.calibrator)
    grown = []
    for _ in range(6):
        _, lengths = _step(v, ids, [GREEDY, GREEDY], np.ones((2, K)))
        grown.append(v.row_budget)
    assert grown[-1] == K and list(lengths) == [K, K]


def test_token_budget_is_respected():
    G = np.ones((8, K))
    lengths = choose_lengths(G, np.full(8, K), np.full(8, GREEDY), None,
                             InjectedStepCost(1.0, 0.001, 0.0).step_seconds, 0.0, 0.0, max_tokens=50).lengths
    assert lengths.sum() + 8 <= 50 and lengths.sum() == 42


def test_measured_cost_model_fits_the_engine_and_drives_the_choice():
    """The policy measured on a simulated engine whose step takes a + b N seconds: with
    b large it verifies nothing and then skips the drafter; with a large it verifies all
    of certain drafts. The model itself recovers the line."""
    for (a, b), expect in (((0.0005, 0.01), 0), ((0.05, 0.0001), K)):
        clock = FakeClock()
        v = DynamicVerifier(K, None, clock=clock)
        if expect == K:  # (a calibration that has seen only certain drafts would make
            _certain(v.calibrator)  # the 0.6-confidence drafts below certain too)
        ids = ["x", "y"]
        conf = np.ones((2, K)) if expect == K else np.full((2, K), 0.6)
        n_tokens = 2
        seen = []
        for step in range(60):
            clock.t += a + b * n_tokens  # the verification step just measured
            v.begin(ids, [0, 0], None, n_tokens)
            caps = np.full(2, K)
            plan = v.plan(np.array([GREEDY, GREEDY]), caps)
            if plan.draft:
                clock.t += 0.001
                lengths = v.choose(ids, np.array([GREEDY, GREEDY]), caps, conf, plan)
            else:
                v.context_only(caps)
                lengths = np.zeros(2, dtype=int)
            v.end(ids, plan.draft)
            n_tokens = int(2 + lengths.sum())
            seen.append((plan.draft, lengths.tolist()))
        assert v.step_cost.ready
        for n in (2, 10, 32):
            assert float(v.step_cost.step_seconds(n)) == pytest.approx(a + b * n, rel=0.05)
        late = seen[-20:]
        if expect == 0:
            assert v.summary()["skipping"]
            assert sum(d for d, _ in late) <= 2
        else:
            assert all(d and ls == [K, K] for d, ls in late)


def test_warm_up_lengths_scale_with_the_batch():
    """Until the measured cost model has two operating points a factor 2 apart, the
    warm-up cycles WARMUP_CAPS, each at most 16 drafts in all (at least 2 a request): at
    1 request its first step verifies 15 drafts, at 32 requests 2 each (a 96-token step,
    not the 512 of 15 each: on this CPU 2.7-2.8 s, ten plain steps), and the block computes
    only those rows. The model is ready as soon as at 1 request, its factor 2 reached.
    A seeded request keeps its own length (SEEDED_START) whatever the warm-up's."""
    a, b = 0.05, 0.005  # the simulated engine: a + b N seconds a step
    for R in (1, 32):
        clock = FakeClock()
        v = DynamicVerifier(K, None, clock=clock)
        ids = [f"r{i}" for i in range(R)]
        kinds = np.array([AT_CAP] + [GREEDY] * (R - 1)) if R > 1 else np.array([GREEDY])
        n_tokens, warm = R, []
        for step in range(6):
            clock.t += a + b * n_tokens
            v.begin(ids, [0] * R, None, n_tokens)
            ready = v.ready
            caps = np.full(R, K)
            plan = v.plan(kinds, caps)
            assert plan.draft
            clock.t += 0.001
            lengths = v.choose(ids, kinds, caps, np.full((R, plan.rows), 0.5), plan)
            v.end(ids, True)
            if not ready:
                warm.append((plan.rows, lengths.tolist()))
            n_tokens = int(R + lengths.sum())
        if R == 1:
            assert warm[0] == (15, [15]) and [ls for _, ls in warm] == [[15], [0]]
        else:
            # the seeded request at its own first length, the others at 2 then 0
            assert warm[0] == (SEEDED_START, [SEEDED_START] + [2] * (R - 1))
            assert warm[1][1] == [SEEDED_START] + [0] * (R - 1)
            assert WARMUP_CAPS[:2] == (15, 0) and len(warm) == 2
        assert v.ready


def test_measured_cost_ignores_idle_gaps():
    m = MeasuredStepCost()
    for n in (4, 8, 16, 32) * 5:
        m.observe(n, 0.01 + 0.001 * n)
    m.observe(16, 5.0)  # the engine sat idle between two requests
    assert float(m.step_seconds(16)) == pytest.approx(0.026, rel=0.05)


def test_measured_cost_follows_machine_speed_from_any_bin():
    """The machine slows 2x while only 1-token steps run (the drafter skipped): the
    16-token cost, not seen since, must follow, so that T(16) / T(1) - all the choice
    uses - stays the engine's. With one mean per bin T(16) stayed at its fast-phase value
    and T(16) / T(1) read 1.2 instead of 2.36 (then drafting looks cheap)."""
    m = MeasuredStepCost()
    rng = np.random.default_rng(0)
    true = lambda n: 0.10 + 0.01 * n  # noqa: E731 - T(1) = 0.11, T(16) = 0.26
    for n in (1, 16) * 60:
        m.observe(n, true(n) * rng.uniform(0.9, 1.1))
    for _ in range(200):
        m.observe(1, 2.0 * true(1) * rng.uniform(0.9, 1.1))
    t1, t16 = float(m.step_seconds(1)), float(m.step_seconds(16))
    assert t1 == pytest.approx(2 * true(1), rel=0.08)
    # The 1-token bin keeps a share of a change seen only there (~15 % of it in log
    # terms here), so the ratio reads 2.1 for 2.36; one mean per bin gave 1.17.
    assert t16 == pytest.approx(2 * true(16), rel=0.15)
    assert t16 / t1 == pytest.approx(true(16) / true(1), rel=0.15)


def test_measured_cost_learns_a_change_of_shape():
    """Only 16-token steps get dearer (1.5x) while 1-token steps keep their time: the
    change is the 16-token bin's, not the machine's."""
    m = MeasuredStepCost()
    for n in (1, 16) * 60:
        m.observe(n, 0.10 + 0.01 * n)
    for _ in range(400):
        m.observe(1, 0.11)
        m.observe(16, 1.5 * 0.26)
    # Speed first takes most of the change, then the 1-token steps pull it back and
    # the 16-token bin ends with it (within 1 % after 400 pairs; 5 % allowed).
    assert float(m.step_seconds(1)) == pytest.approx(0.11, rel=0.05)
    assert float(m.step_seconds(16)) == pytest.approx(1.5 * 0.26, rel=0.05)


def test_calibrator_follows_observed_acceptance():
    cal = AcceptanceCalibrator(K)
    conf = np.full(K, 0.85)
    rng = np.random.default_rng(0)
    for _ in range(300):  # true acceptance 0.5 per draft whatever the confidence says
        ok = rng.random(K) < 0.5
        cal.observe(conf, True, K if ok.all() else int(np.argmin(ok)), K)
    alpha = cal.predict(conf[None, :], np.array([True]))
    assert abs(alpha[0, 0] - 0.5) < 0.08
    # Sampled requests are calibrated apart: still the prior there.
    assert cal.predict(conf[None, :], np.array([False]))[0, 0] == pytest.approx(0.85)


def test_draft_confidence():
    """Greedy rows: the tail's softmax probability of the chosen candidate under the
    table row of its predecessor; sampled rows: the peak of q."""
    torch.manual_seed(0)
    R, k = 2, 4
    S = torch.randn(R, 2, k, k, dtype=torch.float64)
    cand = torch.arange(k).repeat(R, 2, 1) + 10
    j1 = S[:, 0, 0].argmax(-1)
    j2 = S[torch.arange(R), 1, j1].argmax(-1)
    draft = torch.stack([j1, j2], 1) + 10
    q = torch.softmax(torch.randn(R, 2, k), -1)
    conf = draft_confidence(S, cand, q, draft, torch.tensor([True, False]))
    expect0 = [torch.softmax(S[0, 0, 0], -1).max(), torch.softmax(S[0, 1, j1[0]], -1).max()]
    torch.testing.assert_close(conf[0].double(), torch.stack(expect0), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(conf[1], q[1].amax(-1))


# --------------------------------------------------- losslessness, exactly
def _residual(p, q):
    r = np.maximum(p - q, 0.0)
    return r / r.sum() if r.sum() > 0 else p


def _exact_first_two_tokens(p1, p2, q1, q2, length_of):
    """The exact distribution of the first two emitted tokens when the request's two
    drafts v1 ~ q1, v2 ~ q2[v1] are verified up to length_of(v1, v2) in {0, 1, 2} by
    exact speculative sampling (a token after a rejection comes from the next step,
    drawn from p2[x1])."""
    V = len(p1)
    out = np.zeros((V, V))
    for v1, v2 in itertools.product(range(V), range(V)):
        w = q1[v1] * q2[v1][v2]
        n = length_of(v1, v2)
        if n == 0:
            out += w * p1[:, None] * p2
            continue
        a1 = min(1.0, p1[v1] / q1[v1])
        r1 = _residual(p1, q1)
        out += w * (1 - a1) * r1[:, None] * p2
        if n == 1:
            out[v1] += w * a1 * p2[v1]
        else:
            a2 = min(1.0, p2[v1][v2] / q2[v1][v2])
            out[v1, v2] += w * a1 * a2
            out[v1] += w * a1 * (1 - a2) * _residual(p2[v1], q2[v1])
    return out


def _policy_length(q1, q2, v1, v2, threshold, peek_at_draws: bool, fair_threshold=None):
    """The verified length the policy's own code gives one sampled request whose drafts
    are (v1, v2). peek_at_draws: the rule that reads q(v_t), the negative control.
    fair_threshold: the `fair` objective's rule with that mu, the request beside a second
    sampled one (the rule applies with other requests in the step)."""
    cand = torch.arange(3).repeat(1, 2, 1)
    probs = torch.tensor(np.stack([q1, q2[v1]]), dtype=torch.float32)[None]
    draft = torch.tensor([[v1, v2]])
    S = torch.zeros(1, 2, 3, 3)
    if peek_at_draws:
        conf = probs[0].gather(1, draft.T).T.numpy()
    else:
        conf = draft_confidence(S, cand, probs, draft, torch.tensor([False])).numpy()
    alpha = AcceptanceCalibrator(2).predict(conf, np.array([False]))
    G = np.cumprod(alpha, axis=1)
    cost = InjectedStepCost(0.01, 0.001, 0.0).step_seconds
    if fair_threshold is not None:
        G = np.concatenate([G, [[0.5, 0.25]]])
        choice = choose_lengths(G, np.array([2, 2]), np.array([SAMPLED, SAMPLED]), threshold,
                                cost, 0.0, 0.0, 1 << 20, fair=True,
                                fair_threshold=fair_threshold)
        return int(choice.lengths[0])
    choice = choose_lengths(G, np.array([2]), np.array([SAMPLED]), threshold, cost, 0.0, 0.0,
                            1 << 20)
    return int(choice.lengths[0])


def test_sampled_rule_is_lossless_and_the_drawn_token_rule_is_not():
    """Exact enumeration over a 3-token vocabulary and two drafts: with the policy's
    rule (position t verified iff prod_{s<=t} alpha(max q_s) >= last step's threshold),
    the first two emitted tokens are distributed exactly as the target's (to 1e-12),
    although the verified length varies with v1. The same code fed q_t(v_t) (the drawn
    token's own probability) as confidence skews the output by more than 0.02 in total
    variation: the test has power against the mistake it guards."""
    p1 = np.array([0.2, 0.5, 0.3])
    p2 = np.array([[0.7, 0.2, 0.1], [0.1, 0.1, 0.8], [0.3, 0.4, 0.3]])
    q1 = np.array([0.6, 0.3, 0.1])
    q2 = np.array([[0.9, 0.05, 0.05], [0.2, 0.5, 0.3], [0.34, 0.33, 0.33]])
    target = p1[:, None] * p2
    threshold = 0.3
    good = _exact_first_two_tokens(
        p1, p2, q1, q2, lambda a, b: _policy_length(q1, q2, a, b, threshold, False))
    lengths = {_policy_length(q1, q2, a, b, threshold, False)
               for a, b in itertools.product(range(3), range(3))}
    assert len(lengths) > 1, "the test needs the length to vary"
    np.testing.assert_allclose(good, target, atol=1e-12)
    bad = _exact_first_two_tokens(
        p1, p2, q1, q2, lambda a, b: _policy_length(q1, q2, a, b, threshold, True))
    assert 0.5 * np.abs(bad - target).sum() > 0.02
    # The `fair` objective's rule (value[t] = log(1 + G[t] / (1 + G[<t] summed)) >= the
    # last step's mu): its value reads G up to t, so it is as lossless.
    mu = 0.2
    fair_len = lambda a, b: _policy_length(q1, q2, a, b, threshold, False, fair_threshold=mu)
    assert len({fair_len(a, b) for a, b in itertools.product(range(3), range(3))}) > 1
    np.testing.assert_allclose(_exact_first_two_tokens(p1, p2, q1, q2, fair_len), target,
                               atol=1e-12)


# ------------------------------------------------ context K/V writes of skipped steps
class _ContextWrites:
    """Stands in for the DFlash model's two context calls and records what reaches the
    draft KV cache (combine_hidden_states halves the features, so what was combined
    shows in the values)."""

    def __init__(self):
        self.writes = []

    def combine_hidden_states(self, hidden):
        return hidden[:, :2] * 0.5

    def precompute_and_store_context_kv(self, hidden, positions, slots):
        self.writes.append((hidden.clone(), positions.tolist(), slots.tolist()))


def _logging_proposer(log_context=True):
    """A DSpineProposer with just what `_store_context_only` and the log use; vLLM's
    layout kernel (`set_inputs_first_pass`) replaced by one that writes each step's
    positions and slots the way it does (rejected tokens -> slot -1)."""
    from types import SimpleNamespace

    from vllm_dspine.proposer.context_log import ContextLog
    from vllm_dspine.proposer.dspine_proposer import DSpineProposer

    p = object.__new__(DSpineProposer)
    p.dspine = SimpleNamespace(num_proposals=15)
    p.model = _ContextWrites()
    p._context_log = ContextLog(p._write_context, deferred=log_context)
    p._context_positions_buffer = torch.zeros(512, dtype=torch.int64)
    p._context_slot_mapping_buffer = torch.zeros(512, dtype=torch.int64)

    def set_inputs_first_pass(token_ids, next_ids, positions, hidden, sample, cad, rejected):
        n = token_ids.shape[0]
        p._dflash_num_context = n
        p._context_positions_buffer[:n] = positions
        p._context_slot_mapping_buffer[:n] = torch.where(positions % 10 == 3, -1, positions + 100)

    p.set_inputs_first_pass = set_inputs_first_pass
    return p


def _skipped_step(p, start, n):
    positions = torch.arange(start, start + n)
    hidden = positions[:, None].float().expand(n, 4).contiguous()  # [n, L_aux * H]
    p._store_context_only(dict(
        target_token_ids=positions, next_token_ids=None, target_positions=positions,
        target_hidden_states=hidden, token_indices_to_sample=None,
        common_attn_metadata=None, num_rejected_tokens_gpu=None))


def test_context_writes_of_skipped_steps_are_logged_then_applied_in_order():
    """Steps without a block log their context K/V writes; they reach the cache in one
    batch, oldest first, with each step's positions and slots (rejected -1 kept),
    before the next block (`_draft_rows`) or before a step whose scheduler freed
    blocks; a step that freed nothing leaves the log alone."""
    from types import SimpleNamespace

    from vllm_dspine.proposer.context_log import CONTEXT_LOG_TOKENS

    p = _logging_proposer()
    for step in range(3):
        _skipped_step(p, 10 * step, 2 + step)  # 2, 3, 4 tokens
    assert p.model.writes == []
    p.before_step(SimpleNamespace(finished_req_ids=set(), preempted_req_ids=None))
    assert p.model.writes == []
    p.before_step(SimpleNamespace(finished_req_ids={"req-3"}, preempted_req_ids=None))
    (hidden, positions, slots), = p.model.writes
    assert positions == [0, 1, 10, 11, 12, 20, 21, 22, 23]
    assert slots == [100, 101, 110, 111, 112, 120, 121, 122, -1]
    assert torch.equal(hidden[:, 0], torch.tensor(positions).float() * 0.5)
    assert len(p._context_log) == 0 and p._context_log.num_tokens == 0
    p.before_step(SimpleNamespace(finished_req_ids={"req-3"}, preempted_req_ids=None))
    assert len(p.model.writes) == 1  # nothing logged: nothing written twice

    _skipped_step(p, 40, 1)
    p.before_step(SimpleNamespace(finished_req_ids=set(), preempted_req_ids={"req-1"}))
    assert [w[1] for w in p.model.writes[1:]] == [[40]]

    _skipped_step(p, 50, 1)
    p._context_log.flush()  # what `_draft_rows` does before the block
    assert [w[1] for w in p.model.writes[2:]] == [[50]]

    # A full log is applied when it reaches CONTEXT_LOG_TOKENS.
    p.model.writes.clear()
    for step in range(CONTEXT_LOG_TOKENS // 32):
        _skipped_step(p, 1000 + 32 * step, 32)
    assert len(p.model.writes) == 1 and len(p.model.writes[0][1]) == CONTEXT_LOG_TOKENS


def test_context_writes_are_immediate_where_blocks_free_mid_request():
    """A sliding-window drafter or a hybrid target (the log not deferred): every skipped
    step's context K/V is written in that step."""
    p = _logging_proposer(log_context=False)
    _skipped_step(p, 0, 3)
    _skipped_step(p, 3, 2)
    assert [w[1] for w in p.model.writes] == [[0, 1, 2], [3, 4]]
    assert len(p._context_log) == 0


# ------------------------------------------------------------ prompt lookup
# The lookup calibrator's features (lookup.py): matches of 1, 2 and 4 tokens into the
# answer so far.
ANSWER1, ANSWER2, ANSWER4 = (lookup_feature(n, IN_ANSWER) for n in (1, 2, 4))

def _lookup(lengths, conf=None):
    """A LookupBatch: request i has lengths[i] lookup drafts (ids 100 + t) at `conf`
    (the calibrator's feature; default a 4-token match into the answer)."""
    from vllm_dspine.proposer.lookup import LookupBatch

    conf = ANSWER4 if conf is None else conf

    R = len(lengths)
    drafts = np.full((R, K), -1, dtype=np.int64)
    c = np.zeros((R, K))
    for i, n in enumerate(lengths):
        drafts[i, :n] = 100 + np.arange(n)
        c[i, :n] = conf
    return LookupBatch(drafts, np.array(lengths, dtype=np.int64), c)


def _lookup_certain(cal: AcceptanceCalibrator, conf=None, n: int = 400) -> None:
    conf = ANSWER4 if conf is None else conf
    for _ in range(n):
        cal.observe(np.full(K, conf), True, K, K)


def _drafter_poor(cal: AcceptanceCalibrator, n: int = 60) -> None:
    """The drafter's first drafts observed rejected (greedy)."""
    for _ in range(n):
        cal.observe(np.full(K, 0.5), True, 0, K)


def test_lookup_only_step_is_costed_without_the_drafter():
    """A step that skips the drafter for the lookup is priced as one: the drafter's time
    is left out of its rate (`choose_lookup_only`), so lookup drafts that would not pay
    beside a dear drafter are verified without it; and with the measured cost model the
    step's time goes to the verification curve (at its N target tokens) and to the
    context-only drafter path, never to the drafter's block fit."""
    # The drafter costs 50 steps: beside it nothing pays, even certain drafts.
    cost = InjectedStepCost(step_s=0.02, token_s=0.0002, draft_s=1.0)
    v = DynamicVerifier(K, cost)
    _lookup_certain(v.lookup_calibrator)
    _drafter_poor(v.calibrator)
    v.drafter_value = 0.0  # its drafts have been worth nothing where it was chosen
    ids, kinds, caps = ["a"], np.array([GREEDY]), np.array([K])
    look = _lookup([10])
    G = v.lookup_gains(look, kinds == GREEDY)
    assert G[0, :10].min() > 0.95 and G[0, 10:].max() == 0
    with_drafter = choose_lengths(G, np.array([10]), kinds, None, cost.step_seconds,
                                  cost.draft_s, 0.0, 1 << 30)
    # Charged the drafter's time, the best step with these drafts is worse than plain
    # decoding: a drafted step would not pay.
    assert with_drafter.rho_draft < with_drafter.rho_plain
    v.begin(ids, [0], None, 1)
    plan = v.plan(kinds, caps)
    assert plan.draft and v.lookup_replaces_drafter(plan, kinds, look)
    lengths = v.choose_lookup_only(ids, kinds, plan.caps, look)
    v.end(ids, drafted=False)
    assert list(lengths) == [10]
    assert v.summary()["steps_lookup_only"] == 1 and v.summary()["steps_drafted"] == 0

    # Measured: the lookup-only steps' time is verification (N = 1 + drafts) plus the
    # context-only path; the drafter's block fit sees nothing.
    clock = FakeClock()
    v = DynamicVerifier(K, None, clock=clock)
    _lookup_certain(v.lookup_calibrator)
    _drafter_poor(v.calibrator)
    v.drafter_value = 0.0
    # Make the cost model ready (two operating points, a drafter time).
    for n in (1, 4, 1, 4):
        clock.t += 0.02 + 0.001 * n
        v.begin(ids, [0], None, n)
        v.plan(kinds, caps)
        v.step_cost.observe(n, 0.02 + 0.001 * n)
    v.draft_cost.observe(2, 0.005)
    assert v.ready
    drafter_fit = v.draft_cost._s.copy()
    contexts_before = float(v.context_cost._s[0])
    n_tokens = 1
    for _ in range(5):
        clock.t += 0.02 + 0.001 * n_tokens
        v.begin(ids, [0], None, n_tokens)
        plan = v.plan(kinds, caps)
        assert v.lookup_replaces_drafter(plan, kinds, look)
        lengths = v.choose_lookup_only(ids, kinds, plan.caps, look)
        clock.t += 0.0005  # the context-only write and the lookup itself
        v.end(ids, drafted=False)
        n_tokens = 1 + int(lengths.sum())
        assert n_tokens == 11
    assert np.array_equal(v.draft_cost._s, drafter_fit)
    assert float(v.context_cost._s[0]) > contexts_before
    assert v.context_seconds(1) == pytest.approx(0.0005, rel=0.01)
    assert float(v.step_cost.step_seconds(11)) == pytest.approx(0.031, rel=0.1)


def test_lookup_and_drafter_chosen_per_request_and_calibrated_apart():
    """In one drafted step: a greedy request whose lookup is worth more verifies the
    lookup's drafts, one without a lookup the drafter's, one where neither pays none.
    What vLLM then reports accepted goes to the calibrator of the source each request
    verified."""
    cost = InjectedStepCost(step_s=0.02, token_s=0.0002, draft_s=0.002)
    v = DynamicVerifier(K, cost)
    _lookup_certain(v.lookup_calibrator, conf=ANSWER4)
    for _ in range(400):  # lookup drafts of match length 1: never accepted
        v.lookup_calibrator.observe(np.full(K, ANSWER1), True, 0, K)
    _certain(v.calibrator)  # drafts of confidence 1.0: accepted
    for _ in range(400):  # drafts of confidence 0.15: never
        v.calibrator.observe(np.full(K, 0.15), True, 0, K)
    ids = ["look", "draft", "none"]
    kinds = np.array([GREEDY, GREEDY, GREEDY])
    caps = np.full(3, K)
    look = _lookup([8, 0, 6])
    look.conf[2, :6] = ANSWER1
    conf = np.array([np.full(4, 0.15), np.ones(4), np.full(4, 0.15)])  # 4-row block
    v.begin(ids, [0, 0, 0], None, 3)
    plan = v.plan(kinds, caps)
    assert plan.draft and not v.lookup_replaces_drafter(plan, kinds, look)
    lengths = v.choose(ids, kinds, caps, conf, plan, look)
    v.end(ids, drafted=True)
    assert list(v.last_source[:2]) == [1, 0]  # LOOKUP, DRAFTER (the third: either)
    assert lengths[0] == 8 and lengths[1] == 4 and lengths[2] == 0
    v.calibrator = AcceptanceCalibrator(K)  # empty: to see where the next go
    v.lookup_calibrator = LookupCalibrator(K)
    # vLLM verified 8 lookup drafts (3 accepted, the 4th rejected) and 4 of the
    # drafter's (all accepted): 4 tested drafts to each calibrator.
    v.begin(ids, [8, 4, 0], [5, 0, 0], 15)
    assert v.lookup_calibrator.trials.sum() == 4 and v.lookup_calibrator.success.sum() == 3
    assert v.calibrator.trials.sum() == 4 and v.calibrator.success.sum() == 4


def test_sampled_requests_choose_the_source_from_draft_one_only():
    """A sampled request may take the lookup only on what is known before the drafter's
    first draw (lossless, dynamic.py): the first drafts' acceptances. A lookup whose
    first draft is less likely than the drafter's is not taken, however long; a greedy
    request with the same gains takes it (its choice may use everything)."""
    cost = InjectedStepCost(step_s=0.02, token_s=0.0002, draft_s=0.002)
    v = DynamicVerifier(K, cost)
    for _ in range(400):  # lookup: draft 1 accepted 60 %, later drafts always
        v.lookup_calibrator.observe(np.full(K, ANSWER4), True, K, K)
        v.lookup_calibrator.observe(np.full(K, ANSWER4), False, K, K)
    for _ in range(270):
        v.lookup_calibrator.observe(np.full(K, ANSWER4), True, 0, K)
        v.lookup_calibrator.observe(np.full(K, ANSWER4), False, 0, K)
    for _ in range(400):  # drafter: draft 1 accepted 90 %, draft 2 never
        for kind in (True, False):
            v.calibrator.observe(np.full(K, 0.95), kind, 1, K)
    for _ in range(45):
        for kind in (True, False):
            v.calibrator.observe(np.full(K, 0.95), kind, 0, K)
    ids = ["g", "s"]
    kinds = np.array([GREEDY, SAMPLED])
    look = _lookup([K, K])
    conf = np.full((2, 4), 0.95)
    GL = v.lookup_gains(look, kinds == GREEDY)
    alpha_d = v.calibrator.predict(conf, kinds == GREEDY)
    assert GL[0, 0] < alpha_d[0, 0] and GL[0, :].sum() > alpha_d[0, 0] * 2
    v.begin(ids, [0, 0], None, 2)
    plan = v.plan(kinds, np.full(2, K))
    v.choose(ids, kinds, np.full(2, K), conf, plan, look)
    assert list(v.last_source) == [1, 0]


def test_lookup_replaces_the_drafter_where_the_drafter_is_worth_less():
    """A whole step skips the drafter for the lookup when, with the drafter's value per
    request as observed (`drafter_value`), the step is estimated faster without it: not
    before that value is known, not when the drafter is cheap and worth more than the
    lookup's short continuation, and not while some request has no continuation and
    the drafter's value pays its time."""
    cost = InjectedStepCost(step_s=0.1, token_s=0.001, draft_s=0.005)
    v = DynamicVerifier(K, cost)
    for _ in range(100):  # lookup drafts of match length 2: half accepted
        v.lookup_calibrator.observe(np.full(K, ANSWER2), True, 1, K)
        v.lookup_calibrator.observe(np.full(K, ANSWER2), True, 0, K)
    ids, kinds, caps = ["a", "b"], np.array([GREEDY, GREEDY]), np.full(2, K)
    v.begin(ids, [0, 0], None, 2)
    plan = v.plan(kinds, caps)
    short, none_for_b = _lookup([3, 3], conf=ANSWER2), _lookup([3, 0], conf=ANSWER2)
    assert not v.lookup_replaces_drafter(plan, kinds, short)  # value unknown yet
    v.drafter_value = 0.05
    assert v.lookup_replaces_drafter(plan, kinds, short)
    v.drafter_value = 3.0  # the drafter's blocks have been worth 3 tokens
    assert not v.lookup_replaces_drafter(plan, kinds, short)
    # Worth less than the lookup's draft 1 where both have one, but its 5 ms beside a
    # 100 ms step where b has no continuation.
    v.drafter_value = 0.45
    assert v.lookup_replaces_drafter(plan, kinds, short)
    assert not v.lookup_replaces_drafter(plan, kinds, none_for_b)
