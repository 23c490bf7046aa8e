"""The dynamic policy's choice of lookup drafts at concurrency above 1 (`dspine_lookup`,
docs/lookup.md "Concurrency above 1"), without an engine: the floor a lookup draft's
calibrated gain must clear (`DynamicVerifier.lookup_floor`), fitted on the steps the
policy saw, and the drafter's verification in the estimate of a step without it
(`lookup_replaces_drafter`)."""

from __future__ import annotations

import numpy as np

from engine_utils import engine_env

engine_env()

from vllm_dspine.proposer.dynamic import (  # noqa: E402
    AT_CAP,
    DRAFTER,
    GREEDY,
    LOOKUP,
    SAMPLED,
    DynamicVerifier,
    choose_lengths,
)
from vllm_dspine.proposer.lookup import (  # noqa: E402
    IN_ANSWER,
    IN_PROMPT,
    LOOKUP_START,
    LookupBatch,
    LookupCalibrator,
    lookup_feature,
)
from vllm_dspine.proposer.step_cost import InjectedStepCost  # noqa: E402

K = 15
MATCH4 = lookup_feature(4, IN_ANSWER)  # the calibrator's feature of a 4-token match


class FakeClock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def _lookup(lengths, conf=MATCH4) -> LookupBatch:
    R = len(lengths)
    drafts = np.full((R, K), -1, dtype=np.int64)
    c = np.zeros((R, K))
    for i, n in enumerate(lengths):
        drafts[i, :n] = 7
        c[i, :n] = conf
    return LookupBatch(drafts, np.array(lengths, dtype=np.int64), c)


def _calibrate_lookup(v: DynamicVerifier, alpha: float, n: int = 2000, seed: int = 0) -> None:
    """The lookup calibrator sees verifications of 15 drafts (4-token matches), greedy
    and sampled, each accepted with probability `alpha` given the earlier ones were."""
    rng = np.random.default_rng(seed)
    for _ in range(n):
        acc = 0
        while acc < K and rng.random() < alpha:
            acc += 1
        v.lookup_calibrator.observe(np.full(K, MATCH4), True, acc, K)
        v.lookup_calibrator.observe(np.full(K, MATCH4), False, acc, K)


def _run_steps(v: DynamicVerifier, clock: FakeClock, R: int, seconds_of, Ns) -> None:
    """Engine steps of N target tokens each (Ns), timed by seconds_of(N), through the
    policy as the proposer calls it for steps without a block (what the measured cost
    model and the line learn from)."""
    ids = [f"r{i}" for i in range(R)]
    kinds, caps = np.full(R, GREEDY), np.full(R, K)
    for N in Ns:
        clock.t += seconds_of(N)
        v.begin(ids, [0] * R, None, int(N))
        v.plan(kinds, caps)
        clock.t += 0.002  # the context-only write
        v.context_only(caps)
        v.end(ids, drafted=False)


def _true_rate(lengths, G, R, seconds_of, ctx=0.002) -> float:
    """Expected committed tokens per second of a step verifying `lengths` with gains G
    under the true step time."""
    gain = sum(G[i, :n].sum() for i, n in enumerate(lengths))
    return (R + gain) / (seconds_of(R + int(np.sum(lengths))) + ctx)


def _measured_verifier(R: int, first, then, steps_first=300, steps_then=150):
    """A verifier whose measured cost model saw `steps_first` steps timed by `first`
    over N = R .. 5R, then `steps_then` by `then` over N = 2R .. 4R only (the plain
    point N = R not visited again, as where the policy verifies drafts every step)."""
    clock = FakeClock()
    v = DynamicVerifier(K, None, clock=clock)
    v.draft_cost.observe(R * 3, 0.02)  # the drafter's time is known (v.ready)
    rng = np.random.default_rng(1)
    _run_steps(v, clock, R, first, rng.integers(R, 5 * R + 1, steps_first))
    _run_steps(v, clock, R, then, rng.integers(2 * R, 4 * R + 1, steps_then))
    assert v.ready
    return v


def test_batch_of_8_does_not_verify_lookup_drafts_below_the_marginal_cost():
    """Concurrency 8, lookup drafts accepted 35 % each (calibrated): under the step time
    the engine now has (a 12 ms verified token over a 100 ms step, as on the slow CPU)
    a draft must be accepted 48 % of the time to pay, so none is verified; the measured
    curve alone, which learned a cheaper token (2 ms) earlier (greedy steps before
    sampled ones, say) and whose speed factor absorbed most of the change at the N
    visited since, puts the break-even below 25 %: it would verify them and lower the
    batch's true rate. At 60 % acceptance the first drafts pay and are taken."""
    R = 8
    first = lambda n: 0.1 + 0.002 * n  # noqa: E731
    now = lambda n: 0.1 + 0.012 * n  # noqa: E731
    v = _measured_verifier(R, first, now)
    _calibrate_lookup(v, 0.35)
    ids, kinds, caps = [f"r{i}" for i in range(R)], np.full(R, GREEDY), np.full(R, K)
    look = _lookup([K] * R)

    floor = v.lookup_floor(R)
    true_floor = R * 0.012 / (0.1 + 0.012 * R + 0.002)
    assert abs(floor - true_floor) < 0.04, (floor, true_floor)
    # The curve's own break-even between R and 3R: what speed absorbed left it at ~0.18.
    T = v.step_cost.step_seconds
    assert R / T(R) * (T(3 * R) - T(R)) / (2 * R) < 0.25
    alpha = v.lookup_calibrator.predict(look.conf, kinds == GREEDY)
    G_raw = np.cumprod(alpha, axis=1)
    assert 0.30 < G_raw[0, 0] < floor - 0.05  # calibrated below the marginal cost

    # The curve alone (no floor) takes lookup drafts, and they lower the true rate.
    ctx = v.context_seconds(R)
    raw = choose_lengths(G_raw, caps, kinds, None, v.step_cost.step_seconds, ctx, ctx,
                         1 << 30)
    assert raw.lengths.sum() >= R
    assert _true_rate(raw.lengths, G_raw, R, now) < _true_rate(np.zeros(R, int), G_raw, R, now)

    # The policy: none, in a step without the drafter and in a drafted one.
    lengths = v.choose_lookup_only(ids, kinds, caps, look)
    assert lengths.sum() == 0
    v.begin(ids, [0] * R, None, R)
    plan = v.plan(kinds, caps)
    v.drafter_value = 0.0
    assert plan.draft
    lengths = v.choose(ids, kinds, caps, np.full((R, plan.rows), 0.05), plan, look)
    assert (lengths[v.last_source == 1] == 0).all()

    # Sampled requests: the same floor (from past steps only, so still lossless).
    sampled = np.full(R, SAMPLED)
    assert v.choose_lookup_only(ids, sampled, caps, look).sum() == 0

    # Drafts that cover the marginal cost are still verified, and pay.
    v.lookup_calibrator = type(v.lookup_calibrator)(K)
    _calibrate_lookup(v, 0.6)
    lengths = v.choose_lookup_only(ids, kinds, caps, look)
    assert (lengths >= 1).all()
    G = v.lookup_gains(look, kinds == GREEDY, R)
    assert _true_rate(lengths, G, R, now) > _true_rate(np.zeros(R, int), G, R, now)


def test_concurrency_1_still_takes_the_lookup_where_it_pays():
    """One request, the same machine (12 ms a verified token over a 100 ms step): the
    floor is ~0.1 (where the fixed cost of a step dominates, a draft accepted one time in
    ten pays), so the policy verifies what it verified without the floor: a HumanEval-like
    copy (each draft accepted 90 %) to 8 drafts or more, one accepted 45 % to 2 or more."""
    R = 1
    now = lambda n: 0.1 + 0.012 * n  # noqa: E731
    v = _measured_verifier(R, now, now, steps_first=200, steps_then=40)
    floor = v.lookup_floor(1)
    assert 0.08 < floor < 0.14, floor
    ids, kinds, caps = ["r0"], np.full(1, GREEDY), np.full(1, K)
    look = _lookup([K])
    for alpha, least in ((0.9, 8), (0.45, 2)):
        v.lookup_calibrator = type(v.lookup_calibrator)(K)
        _calibrate_lookup(v, alpha)
        G_raw = np.cumprod(v.lookup_calibrator.predict(look.conf, kinds == GREEDY), axis=1)
        ctx = v.context_seconds(R)
        raw = choose_lengths(G_raw, caps, kinds, None, v.step_cost.step_seconds, ctx, ctx,
                             1 << 30).lengths
        lengths = v.choose_lookup_only(ids, kinds, caps, look)
        assert lengths[0] == raw[0] >= least, (alpha, lengths, raw)


def test_floor_is_off_until_the_line_is_fitted_and_for_a_falling_line():
    """No floor before the line has seen enough steps with varying N, nor where the
    steps' time falls with N (a dip of a CPU's GEMM curve at small N); an injected cost
    gives its own line."""
    clock = FakeClock()
    v = DynamicVerifier(K, None, clock=clock)
    assert v.lookup_floor(8) == 0.0
    _run_steps(v, clock, 8, lambda n: 0.2, [8] * 50)  # N never varied: no slope
    assert v.lookup_floor(8) == 0.0
    _run_steps(v, clock, 8, lambda n: 0.3 - 0.002 * n, list(range(8, 40)) * 2)
    assert v.lookup_floor(8) == 0.0
    w = DynamicVerifier(K, InjectedStepCost(step_s=0.1, token_s=0.01, draft_s=0.01))
    assert abs(w.lookup_floor(8) - 8 * 0.01 / 0.18) < 1e-9


def test_replacing_the_drafter_counts_the_verification_of_its_drafts():
    """Concurrency 8, no continuation for half the requests: the drafter's drafts there
    are worth 1.5 tokens a request but take 3 verified drafts each (36 ms at 12 ms a
    token, on a ~0.5 s step: more than 1.5 tokens' worth): the step is faster without
    the drafter. Counting its value as free (the first rule) kept the drafter; with its
    drafts cheap to verify (1 ms a token) it is kept."""
    R = 8
    dear = InjectedStepCost(step_s=0.1, token_s=0.012, draft_s=0.01)
    v = DynamicVerifier(K, dear)
    _calibrate_lookup(v, 0.9)
    ids, kinds, caps = [f"r{i}" for i in range(R)], np.full(R, GREEDY), np.full(R, K)
    look = _lookup([6, 0] * 4)
    v.begin(ids, [0] * R, None, R)
    plan = v.plan(kinds, caps)
    v.drafter_value, v.drafter_drafts = 1.5, 3.0
    assert v.lookup_replaces_drafter(plan, kinds, look)
    # What the first rule estimated: the drafter's value at no verification cost.
    GL = v.lookup_gains(look, kinds == GREEDY, R)
    E = GL.sum(1)
    T = float(dear.step_seconds(R + int((GL > 0).sum())))
    old_with = (R + np.maximum(E, 1.5).sum()) / (T + dear.draft_s)
    old_without = (R + E.sum()) / T
    assert old_with > old_without
    cheap = DynamicVerifier(K, InjectedStepCost(step_s=0.1, token_s=0.001, draft_s=0.01))
    cheap.lookup_calibrator = v.lookup_calibrator
    cheap.begin(ids, [0] * R, None, R)
    plan = cheap.plan(kinds, caps)
    cheap.drafter_value, cheap.drafter_drafts = 1.5, 3.0
    assert not cheap.lookup_replaces_drafter(plan, kinds, look)


def test_the_continuation_follows_the_earliest_occurrence():
    """vLLM's matcher, which the lookup reuses, continues from the first occurrence of the
    longest suffix match, not the latest: in a context repeating a 5-token period the
    continuation runs from the first period to the end (20 tokens, not 5), and of two
    earlier occurrences of a 4-token suffix the first one's successor is drafted. A
    calibration feature built on the continuation's length (docs/lookup.md) must count on
    this: a long continuation may be a repeat near the end as well as a far copy. Where
    the continuation is copied from (the calibrator's feature, `PromptLookup.propose`)
    follows the same occurrence: the prompt where the first one lies in it, even if the
    suffix recurs in the answer."""
    # In a fresh interpreter: vLLM's matcher is numba code, and numba loads llvmlite,
    # whose library object answers any attribute (`__dict__` too) with a wrapper; vLLM
    # 0.32.0's triton-override scan (`triton_utils/dispatcher._rebind_kernels`, run by
    # `CpuPlatform.register_triton_kernel_overrides` in later modules of this process)
    # then fails on `vars(obj).get`. Keep numba out of the test process.
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent(f"""
        import numpy as np
        from vllm_dspine.proposer.lookup import PromptLookup, longest_match_continuation
        K = {K}
        loop = np.array([5, 6, 7, 8, 9] * 4 + [5, 6, 7, 8], dtype=np.int32)
        rest, m = longest_match_continuation(loop, 2, 4)
        assert m == 4 and len(rest) == 20 and rest[:6].tolist() == [9, 5, 6, 7, 8, 9], (m, rest)
        two = np.array([1, 2, 3, 4, 11, 20, 21, 1, 2, 3, 4, 12, 30, 31, 1, 2, 3, 4],
                       dtype=np.int32)
        rest, m = longest_match_continuation(two, 2, 4)
        assert m == 4 and rest[:3].tolist() == [11, 20, 21] and len(rest) == 14, (m, rest)
        lk = PromptLookup(2, 4, K)
        b = lk.propose([loop, two], np.array([K, 3]), np.array([3, 3]))
        assert b.lengths.tolist() == [K, 3], b.lengths
        assert b.drafts[1, :3].tolist() == [11, 20, 21] and (b.drafts[1, 3:] == -1).all()
        # Where it is copied from: the continuation's first token (index 4 in `two`)
        # before the prompt's end is a copy from the prompt, else from the answer.
        from vllm_dspine.proposer.lookup import IN_ANSWER, IN_PROMPT, lookup_feature
        for prompt_len, where in ((5, IN_PROMPT), (4, IN_ANSWER), (0, IN_ANSWER)):
            b = lk.propose([two], np.array([3]), np.array([prompt_len]))
            assert (b.conf[0, :3] == lookup_feature(4, where)).all(), (prompt_len, b.conf)
            assert (b.conf[0, 3:] == 0).all()
        print("ok")
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]


def test_matches_into_the_prompt_and_into_the_answer_are_calibrated_apart():
    """The lookup's calibrator has a bin per (where the continuation is copied from,
    match length): a 2-token match into the prompt and one into the answer start from
    their own guesses (the offline walk's, `LOOKUP_START`) and learn only from their own
    verifications, through the policy as the proposer drives it (choose, then vLLM's
    report in the next step's `begin`). Before the split both went to one bin per match
    length, so the answer's matches paid for the prompt's rejected ones."""
    prompt2, answer2 = lookup_feature(2, IN_PROMPT), lookup_feature(2, IN_ANSWER)
    cal = LookupCalibrator(K)
    assert cal._bin(np.array([prompt2]))[0] != cal._bin(np.array([answer2]))[0]
    greedy = np.array([True, True])
    start = cal.predict(np.array([np.full(K, prompt2), np.full(K, answer2)]), greedy)
    assert np.allclose(start[0, [0, 1, 3, 7]], LOOKUP_START[IN_PROMPT, 1, :4])
    assert np.allclose(start[1, [0, 1, 3, 7]], LOOKUP_START[IN_ANSWER, 1, :4])

    cost = InjectedStepCost(step_s=0.02, token_s=0.0002, draft_s=0.002)
    v = DynamicVerifier(K, cost)
    ids, kinds, caps = ["p", "a"], np.array([GREEDY, GREEDY]), np.full(2, K)
    look = _lookup([4, 4], conf=answer2)
    look.conf[0, :4] = prompt2
    v.begin(ids, [0, 0], None, 2)
    for _ in range(60):
        plan = v.plan(kinds, caps)
        lengths = v.choose_lookup_only(ids, kinds, plan.caps, look)
        v.end(ids, drafted=False)
        assert lengths[1] == 4  # the prompt's may stop being verified
        # vLLM's report: the prompt's match rejected at draft 1, the answer's all taken.
        v.begin(ids, lengths.tolist(), [int(lengths[0]), 0], 2 + int(lengths.sum()))
    alpha = v.lookup_calibrator.predict(look.conf, kinds == GREEDY)
    assert alpha[0, 0] < 0.1 < start[0, 0]  # the prompt's: rejected, learned
    assert alpha[1, 0] > 0.9 > start[1, 0]  # the answer's: accepted, learned
    # The answer's bins saw only the answer's verifications.
    b_p, b_a = cal._bin(np.array([prompt2, answer2]))
    t = v.lookup_calibrator.trials[0]
    assert t[:, b_a].sum() == v.lookup_calibrator.success[0][:, b_a].sum() > 0
    assert v.lookup_calibrator.success[0][:, b_p].sum() == 0 < t[:, b_p].sum()
    # ... and a fresh 4-token match into the answer leans on the answer's, not the
    # prompt's: its draft 1 is now above its own starting guess.
    a4 = v.lookup_calibrator.predict(np.full((1, K), lookup_feature(4, IN_ANSWER)),
                                     np.array([True]))
    assert a4[0, 0] > LOOKUP_START[IN_ANSWER, 3, 0]


def test_summary_counts_the_lookups_expectation_apart():
    """The verifier's summary (bench/policy_probe.py prints it) splits the drafts the
    policy expected to be accepted, and those vLLM then reported accepted, by source: a
    step with lookup drafts on some requests and the drafter's on others counts the
    lookup's alone in the lookup_* fields, and both in the totals."""
    R = 4
    v = DynamicVerifier(K, InjectedStepCost(0.1, 0.01, 0.02), max_batch_tokens=1 << 20)
    ids, kinds, caps = [f"r{i}" for i in range(R)], np.full(R, GREEDY), np.full(R, K)
    v.begin(ids, [0] * R, None, R)
    plan = v.plan(kinds, caps)
    _calibrate_lookup(v, 0.9)
    # Requests 0-1 have a long 4-token match (the lookup, calibrated at 90 %) and an
    # unsure drafter, 2-3 no match and a confident drafter.
    look = _lookup([K, K, 0, 0])
    conf = np.full((R, plan.rows), 0.95)
    conf[:2] = 0.05
    lengths = v.choose(ids, kinds, caps, conf, plan, look)
    v.end(ids, drafted=True)
    src = v.last_source
    assert (src[:2] == 1).all() and (src[2:] == 0).all() and (lengths > 0).all()
    # vLLM verified them: the lookup's requests accepted 3 and 5 drafts, the drafter's 1
    # and 0.
    accepted = [3, 5, 1, 0]
    v.begin(ids, lengths.tolist(), [int(n) - a for n, a in zip(lengths, accepted)], R)
    s = v.summary()
    assert s["lookup_verified"] == int(lengths[:2].sum())
    assert s["lookup_observed_accepted"] == 8
    assert s["observed_accepted"] == 9
    assert 0 < s["lookup_expected_accepted"] < s["expected_accepted"]


def _log_rates(lengths, G, T) -> float:
    """sum over requests of log((1 + accepted drafts expected) / T(N)): the objective
    `fair` maximises."""
    E = np.array([G[i, :n].sum() for i, n in enumerate(lengths)])
    return float(np.log1p(E).sum() - len(lengths) * np.log(T(len(lengths) + lengths.sum())))


def test_fair_objective_does_not_slow_the_batch_for_one_request():
    """Concurrency 8, one request repeating itself (a 4-token match into its own answer,
    conditional acceptance 0.8-0.97 as calibrated on chat) and seven without a
    continuation, at this CPU's chat cost (~3.7 ms a verified token over a ~137 ms step
    of 8): the throughput objective verifies all 15 of its drafts (the batch commits more
    tokens a second, every other request waits 40 % longer a step); the fair objective
    (the requests' log-rates) verifies the few whose gain to that request outweighs what
    the step's time costs all eight, and that choice is the best of every length for it.
    With one request both objectives are the same."""
    from vllm_dspine.proposer.dynamic import choose_lengths

    R = 8
    T = InjectedStepCost(0.107, 0.0037, 0.0).step_seconds
    G = np.zeros((R, K))
    G[0] = np.cumprod(np.r_[0.84, 0.79, 0.79, [0.94] * 4, [0.97] * 8])
    caps, kinds = np.full(R, K), np.full(R, GREEDY)
    rate = choose_lengths(G, caps, kinds, None, T, 0.0, 0.0, 1 << 30)
    fair = choose_lengths(G, caps, kinds, None, T, 0.0, 0.0, 1 << 30, fair=True)
    assert rate.lengths[0] == K and fair.lengths[1:].sum() == 0
    assert 1 <= fair.lengths[0] <= 4
    best = max(range(K + 1), key=lambda n: _log_rates(np.r_[n, [0] * (R - 1)], G, T))
    assert fair.lengths[0] == best
    # Every request with a continuation: both verify drafts for each of them.
    G_all = np.tile(np.cumprod(np.r_[0.84, 0.8, 0.8, [0.87] * 12]), (R, 1))
    fair_all = choose_lengths(G_all, caps, kinds, None, T, 0.0, 0.0, 1 << 30, fair=True)
    assert (fair_all.lengths >= 1).all()
    # One request: (1 + E) / T either way.
    rng = np.random.default_rng(0)
    for _ in range(50):
        g = np.cumprod(rng.uniform(0.3, 1.0, (1, K)), axis=1)
        a = choose_lengths(g, np.array([K]), np.array([GREEDY]), None, T, 0.01, 0.0, 1 << 30)
        b = choose_lengths(g, np.array([K]), np.array([GREEDY]), None, T, 0.01, 0.0, 1 << 30,
                           fair=True)
        assert (a.lengths == b.lengths).all()


def test_fair_objective_sets_sampled_lengths_from_the_last_steps_log_rate():
    """The same batch of 8 sampled (lengths from the previous step, history only): under
    the throughput objective the repeating request verifies all 15 drafts at the second
    step (lambda sits below its G), under `fair` the few the greedy choice takes (mu, the
    log-rate a draft must add to its request, from the step before). Before any step:
    the warm-up's length for 8 requests under both (16 // 8 = 2 drafts each)."""
    R = 8
    T = InjectedStepCost(0.107, 0.0037, 0.0).step_seconds
    G = np.zeros((R, K))
    G[0] = np.cumprod(np.r_[0.84, 0.79, 0.79, [0.94] * 4, [0.97] * 8])
    caps, sampled = np.full(R, K), np.full(R, SAMPLED)
    greedy = choose_lengths(G, caps, np.full(R, GREEDY), None, T, 0.0, 0.0, 1 << 30,
                            fair=True).lengths
    for fair in (False, True):
        first = choose_lengths(G, caps, sampled, None, T, 0.0, 0.0, 1 << 30, fair=fair)
        assert (first.lengths == 2).all()
        assert (first.fair_threshold is not None) == fair
        second = choose_lengths(G, caps, sampled, first.threshold, T, 0.0, 0.0, 1 << 30,
                                fair=fair, fair_threshold=first.fair_threshold)
        assert second.lengths[1:].sum() == 0
        if fair:
            assert second.lengths[0] == greedy[0] and 1 <= greedy[0] <= 4
        else:
            assert second.lengths[0] == K



def _proposer_step(v: DynamicVerifier, ids, kinds, conf, lookup: LookupBatch,
                   verified, rejected):
    """One engine step as `DSpineProposer.propose` drives the policy with the lookup on
    (the lookup before the plan) -> (lengths, source per request)."""
    R = len(ids)
    kinds = np.array(kinds)
    v.begin(ids, verified, rejected, R + int(sum(verified)))
    caps = np.full(R, K)
    plan = v.plan(kinds, caps, lookup.lengths)
    if not plan.draft or v.lookup_replaces_drafter(plan, kinds, lookup):
        lengths = v.choose_lookup_only(ids, kinds, plan.caps, lookup, plan.lookup)
        v.end(ids, drafted=False)
        return lengths, np.full(R, LOOKUP)
    lengths = v.choose(ids, kinds, caps, conf[:, :plan.rows], plan, lookup)
    v.end(ids, drafted=True)
    return lengths, v.last_source.copy()


def _seeded_with_lookup(v: DynamicVerifier, others: int, steps: int = 40):
    """A seeded request "s" (with greedy companions) whose context has a 6-draft lookup
    continuation in two steps of three; every lookup draft it verifies is accepted,
    none of the drafter's. -> [(length, source)] of "s" per step."""
    ids = ["s"] + [f"g{i}" for i in range(others)]
    kinds = [AT_CAP] + [GREEDY] * others
    conf = np.full((others + 1, K), 0.5)
    out, verified, rejected = [], [0] * (others + 1), None
    for step in range(steps):
        lengths = [6 if step % 3 != 2 else 0] + [3 + step % 4] * others
        lk, src = _proposer_step(v, ids, kinds, conf, _lookup(lengths), verified, rejected)
        n, source = int(lk[0]), int(src[0])
        out.append((n, source if n else None))
        verified = [int(x) for x in lk]
        accepted = n if source == LOOKUP else 0
        rejected = [n - accepted] + [int(x) // 2 for x in lk[1:]]
    return out


def test_seeded_requests_take_the_lookup_by_their_own_history():
    """A request with its own seed takes the lookup's drafts whenever its own context has
    a continuation, at the length of the lookup's own seeded rule (fed only by its lookup
    steps: all accepted, it doubles up to the continuation's 6), and the drafter's drafts
    otherwise by the drafter's rule (fed only by the drafter's steps: nothing accepted,
    it waits). The same lengths and sources whatever the cost model and whoever else is in
    the batch (the seed reproduces the text)."""
    a = _seeded_with_lookup(DynamicVerifier(K, InjectedStepCost(0.0, 1.0, 0.0)), 0)
    b = _seeded_with_lookup(DynamicVerifier(K, InjectedStepCost(0.01, 0.0001, 0.002)), 3)
    assert a == b
    on_lookup = [a[s] for s in range(len(a)) if s % 3 != 2]
    on_drafter = [a[s] for s in range(len(a)) if s % 3 == 2]
    # 4 (the rule's start), then 6: the continuation's length (the rule asks 8, then 12).
    assert on_lookup[0] == (4, LOOKUP) and set(on_lookup[1:]) == {(6, LOOKUP)}
    # The drafter's rule: 4, 1 (nothing accepted), then waits (0) with 1-draft probes.
    assert on_drafter[:2] == [(4, DRAFTER), (1, DRAFTER)]
    assert on_drafter[2] == (0, None) and all(n <= 1 for n, _ in on_drafter[2:])


def test_a_requests_own_lookup_record_scales_its_lookup_gains():
    """Two greedy requests whose lookup continuations fall in the same calibrator bin:
    one has every lookup draft accepted, the other none. The calibrator pools them;
    each request's own record (`LOOKUP_RHO_*`, dynamic.py) scales its gains, so the one
    whose drafts fail soon verifies (almost) none of them while the other keeps
    verifying its continuation; in steps without lookup drafts its record fades back."""
    v = DynamicVerifier(K, InjectedStepCost(step_s=0.02, token_s=0.002, draft_s=0.005))
    _calibrate_lookup(v, 0.9)
    ids, kinds = ["good", "bad"], [GREEDY, GREEDY]
    conf = np.full((2, K), 0.05)  # the drafter's drafts are not worth verifying
    verified, rejected, lengths = [0, 0], None, []
    for _ in range(12):
        lk, src = _proposer_step(v, ids, kinds, conf, _lookup([8, 8]), verified, rejected)
        lengths.append([int(n) if s == LOOKUP else 0 for n, s in zip(lk, src)])
        verified = [int(x) for x in lk]
        rejected = [0 if src[0] == LOOKUP else int(lk[0]), int(lk[1])]  # bad: none accepted
    assert lengths[0] == [8, 8]  # both start from the pooled bins
    assert all(good == 8 for good, _ in lengths)
    assert sum(bad for _, bad in lengths[-4:]) <= 2, lengths
    G = v.lookup_gains(_lookup([8, 8]), np.array([True, True]), floor=False)
    assert G[1].sum() < 0.5 * G[0].sum()
    low = v._lookup_log_rho["bad"]
    for _ in range(35):  # no lookup continuation for "bad": its record fades
        lk, src = _proposer_step(v, ids, kinds, conf, _lookup([8, 0]), verified, rejected)
        verified, rejected = [int(x) for x in lk], [0, int(lk[1])]
    assert low < 2 * v._lookup_log_rho["bad"] < 0
