"""Dynamic verification through vLLM on CPU, on the distilled tiny pair: fewer drafts
never change the output, the sparse q of a verified prefix is the one drawn, the draft
KV stays right through steps that skip the block, and vLLM's batch-size schedule is
exact. Engines are expensive (~25 s each on 2 cores): one plain engine, and one DSpine
engine at a time (each shut down before the next starts). An LLM's Prometheus logger
unregisters the metrics of engines built before it, so each engine's metrics are read
while it is the newest one."""

from __future__ import annotations

import glob
import os

import pytest
import torch

from engine_utils import (assert_candidates_match_reference, dspine_spec, make_llm,
                          prompts_of_lengths)
from vllm_dspine.serving.metrics import spec_decode_counters

pytestmark = pytest.mark.engine

# Verification costs a fixed step part of 20 ms plus 0.02 ms a target token, the drafter
# 5 ms: at the batch sizes below this makes the policy verify some drafts of some
# requests, not all or none (and timing does not enter, unlike a measured model).
INJECTED_COST = {"step_s": 0.02, "token_s": 0.00002, "draft_s": 0.005}
SCHEDULE = [[1, 2, 15], [3, 8, 4], [9, 64, 0]]


@pytest.fixture(scope="module")
def pair(tiny_trained_pair):
    return tiny_trained_pair  # conftest.py: written once per session


class _Slot:
    """One DSpine engine alive at a time."""

    llm = None
    name = None


def _shutdown(llm) -> None:
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:  # noqa: BLE001 - best effort; the process exits at the end anyway
        pass


def _dspine_engine(name, pair, spec, dump_dir=None):
    if _Slot.name == name:
        return _Slot.llm
    if _Slot.llm is not None:
        _shutdown(_Slot.llm)
        _Slot.llm = _Slot.name = None
    if dump_dir:
        os.environ["VLLM_DSPINE_DEBUG_DUMP"] = dump_dir
    try:
        llm = make_llm(pair.target_dir, spec)
    finally:
        os.environ.pop("VLLM_DSPINE_DEBUG_DUMP", None)
    _Slot.llm, _Slot.name = llm, name
    return llm


@pytest.fixture(scope="module", autouse=True)
def _close_last():
    yield
    if _Slot.llm is not None:
        _shutdown(_Slot.llm)


def verified_hist(llm) -> list[int]:
    """vllm:dspine_verified_drafts as counts per verified length 0..15."""
    for m in llm.get_metrics():
        if m.name == "vllm:dspine_verified_drafts":
            cum = [m.buckets[f"{float(n)}"] for n in range(16)]
            return [cum[0]] + [cum[n] - cum[n - 1] for n in range(1, 16)]
    raise AssertionError("no vllm:dspine_verified_drafts metric")


def _delta(a: list[int], b: list[int]) -> list[int]:
    return [x - y for x, y in zip(a, b)]


def _greedy_params(n: int):
    from vllm import SamplingParams

    return [SamplingParams(temperature=0.0, max_tokens=16 + (13 * i) % 49, ignore_eos=True)
            for i in range(n)]


def _greedy_identical(plain_llm, llm, prompts, params) -> None:
    plain = [o.outputs[0].token_ids for o in plain_llm.generate(prompts, params)]
    spec = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    for i, (a, b) in enumerate(zip(plain, spec)):
        assert list(a) == list(b), f"prompt {i} ({len(prompts[i])} tokens) differs"


# ------------------------------------------------- the policy, injected cost model
@pytest.fixture
def dyn_llm(pair, plain_llm):
    return _dspine_engine("dyn", pair, dspine_spec(pair.draft_dir,
                                                  dspine_verify_cost=INJECTED_COST))


def test_greedy_identical_with_the_policy_choosing_lengths(plain_llm, dyn_llm):
    """24 prompts of 3..400 tokens, 16..64 new tokens each, with the policy on: greedy
    output identical to plain decoding while the verified lengths vary between requests
    and steps (several lengths strictly between 0 and 15 are used)."""
    prompts = prompts_of_lengths(24)
    before = verified_hist(dyn_llm)
    _greedy_identical(plain_llm, dyn_llm, prompts, _greedy_params(len(prompts)))
    hist = _delta(verified_hist(dyn_llm), before)
    print("verified drafts per request-step (length: count):",
          {n: c for n, c in enumerate(hist) if c})
    assert sum(hist) > 0
    assert sum(1 for n in range(1, 15) if hist[n]) >= 3, hist
    assert sum(hist[1:]) > 0


def _two_sample_chi2_pvalue(a: list[int], b: list[int], min_count: int = 10) -> float:
    from collections import Counter

    from scipy.stats import chi2_contingency

    ca, cb = Counter(a), Counter(b)
    common = [t for t in set(ca) | set(cb) if ca[t] + cb[t] >= min_count]
    rest_a = len(a) - sum(ca[t] for t in common)
    rest_b = len(b) - sum(cb[t] for t in common)
    table = [[ca[t] for t in common] + [rest_a], [cb[t] for t in common] + [rest_b]]
    if rest_a + rest_b == 0:
        table = [row[:-1] for row in table]
    return chi2_contingency(table)[1]


def test_sampled_distribution_matches_plain_with_the_policy(plain_llm, dyn_llm):
    """At temperature 0.5 the 2nd, 3rd and 4th generated tokens (those verification
    produces: accepted drafts of a shortened prefix, corrections, bonus tokens) are
    distributed as without speculation: 4,000 samples of 6 tokens per engine, two-sample
    chi-square per position, while the policy verifies prefixes of several lengths (at
    most 4 drafts after the first token: a request verifies no more than its max_tokens
    can use).

    The DSpine requests carry no seed of their own (a seeded request keeps the fixed
    length, docs/dynamic-verification.md): their randomness is the engine's global
    generator (engine seed 0), the plain ones are seeded, and the policy's cost model is
    injected, not measured. The outcome is still not bit-reproducible: the engine core
    starts stepping while the 4,000 requests arrive, so batch composition (and with it
    the global stream's use) varies run to run; with a correct sampler each of the three
    comparisons fails with probability 1e-3 (threshold p > 1e-3). With 4,000 samples a
    distortion of a few percent in total variation on the frequent tokens fails it (the
    power of the sampled test the project had in tests/test_vllm_e2e.py). That the rule
    itself is exact, and that the tempting rule (confidence q_t(v_t) of the drawn token)
    is not, is checked exactly in tests/test_dynamic_policy.py."""
    from vllm import SamplingParams

    n, prompt = 4000, "abcdefg"
    before_m, before_h = spec_decode_counters(dyn_llm), verified_hist(dyn_llm)
    spec = [list(o.outputs[0].token_ids) for o in dyn_llm.generate(
        [prompt] * n, SamplingParams(temperature=0.5, max_tokens=6, ignore_eos=True))]
    after_m, hist = spec_decode_counters(dyn_llm), _delta(verified_hist(dyn_llm), before_h)
    plain = [list(o.outputs[0].token_ids) for o in plain_llm.generate(
        [prompt] * n, [SamplingParams(temperature=0.5, max_tokens=6, seed=50_000 + i,
                                      ignore_eos=True) for i in range(n)])]
    drafts = after_m["vllm:spec_decode_num_drafts"] - before_m.get(
        "vllm:spec_decode_num_drafts", 0)
    per_pos = [x - y for x, y in zip(
        after_m["vllm:spec_decode_num_accepted_tokens_per_pos"],
        before_m.get("vllm:spec_decode_num_accepted_tokens_per_pos") or [0] * 15)]
    print(f"sampled T=0.5: {drafts} verifications, acceptance at position 1 "
          f"{per_pos[0] / max(drafts, 1):.3f}; verified lengths "
          f"{ {k: c for k, c in enumerate(hist) if c} }")
    assert per_pos[0] / drafts > 0.1, "too few drafts accepted for a meaningful test"
    assert sum(1 for k in range(16) if hist[k]) >= 3 and sum(hist[1:]) > 100, hist
    for pos in (1, 2, 3):
        p = _two_sample_chi2_pvalue([s[pos] for s in spec], [s[pos] for s in plain])
        assert p > 1e-3, f"token {pos + 1}: speculative and plain distributions differ " \
                         f"(chi-square p = {p:.2e})"


# ------------------------------------------------- the policy, measured cost model
def test_greedy_identical_with_the_measured_policy(pair, plain_llm):
    """The default settings (cost measured on this engine while it runs): greedy output
    identical to plain decoding for 24 prompts; the histogram records every decode
    request-step."""
    llm = _dspine_engine("measured", pair, dspine_spec(pair.draft_dir))
    prompts = prompts_of_lengths(24)
    params = _greedy_params(len(prompts))
    _greedy_identical(plain_llm, llm, prompts, params)
    hist = verified_hist(llm)
    print("measured policy, verified drafts per request-step:",
          {n: c for n, c in enumerate(hist) if c})
    # A request's first token comes from its prefill; the rest take at least one
    # request-step per 16 tokens.
    assert sum(hist) >= sum(p.max_tokens - 1 for p in params) // 16


# ------------------------------------------------- vLLM's batch-size schedule
def _check_drafts_against_reference(pair, dump_dir, seqs, vocab=None) -> int:
    """Each dumped drafting step against the reference drafter (model/drafter.py) on
    the committed text: final states, candidates and greedy drafts. A step that drafted
    only the block's first n rows (the schedule or the policy capped verification at n)
    must equal the first n rows of the reference's full 16-row block. Returns
    (number of (step, request) checked, rows per request of each checked step)."""
    from test_vllm_e2e import _target_features

    from vllm_dspine.kernels.retrieval import retrieve_candidates
    from vllm_dspine.kernels.tail import LastWriteInputs, TailWeights, refine_last_write
    from vllm_dspine.model.checkpoint import bridge_weights, load_draft_checkpoint
    from vllm_dspine.model.drafter import block_forward

    cfg, tensors = load_draft_checkpoint(pair.draft_dir)
    cache, checked, rows_seen = {}, 0, []
    for path in sorted(glob.glob(os.path.join(dump_dir, "*.pt"))):
        step = torch.load(path)
        K = step["draft_token_ids"].shape[1]  # drafts this step's block computed
        for r, req_id in enumerate(step["req_ids"]):
            seq = seqs[req_id.split("-")[0]]
            p = int(step["anchor_positions"][r])
            if p >= len(seq):
                continue  # drafted in the step that finished the request
            assert seq[p] == int(step["anchor_ids"][r])
            if req_id not in cache:
                cache[req_id] = _target_features(pair.target_dir, cfg.target_layer_ids, seq)
            feats, target = cache[req_id]
            head = target.lm_head.weight.detach()
            out = block_forward(cfg, tensors, target.model.embed_tokens.weight.detach(),
                                head, torch.tensor([seq]), feats[None], torch.tensor([[p]]))
            final = out.final_hidden[0, 0]
            torch.testing.assert_close(step["final_hidden"][r * K:(r + 1) * K],
                                       final[1:K + 1], rtol=1e-4, atol=1e-4)
            if vocab is None:
                cand = retrieve_candidates(final[1:], head, cfg.head_topk, cfg.coarse_topk,
                                           None, mode="bf16")
            else:  # retrieval over the listed head rows only, mapped back to token ids
                cand = vocab[retrieve_candidates(final[1:], head[vocab], cfg.head_topk,
                                                 cfg.coarse_topk, None, mode="bf16")]
            # Equal up to near-ties; the tail is then checked on the engine's own
            # candidates, so a near-tie costs no coverage.
            assert_candidates_match_reference(final[1:K + 1], head, cand[:K],
                                              step["cand_ids"][r], f"{req_id} anchor {p}")
            cand = torch.cat([step["cand_ids"][r], cand[K:]])  # [B - 1, k] the engine's first K
            proposal = refine_last_write(
                LastWriteInputs(out.pre_write_state[0], out.last_codes[0],
                                out.last_rms[0], torch.tensor([seq[p]])),
                cand[None],
                TailWeights(bridge_weights(cfg, tensors), tensors["norm.weight"],
                            cfg.rms_norm_eps, head),
                torch.zeros(1))
            assert torch.equal(proposal.draft_token_ids[0, :K], step["draft_token_ids"][r])
            checked += 1
            rows_seen.append(K)
    return checked, rows_seen


def test_batch_size_schedule_is_exact(pair, plain_llm, tmp_path):
    """`num_speculative_tokens_per_batch_size` [[1, 2, 15], [3, 8, 4], [9, 64, 0]] with
    the fixed length: 12 requests of different lengths finish one by one, so the batch
    shrinks through all three ranges. Every request-step verifies exactly the schedule's
    count (histogram only at 0, 4 and 15, each used); greedy output equals plain; and
    the drafts of steps after steps that drafted nothing (the block forward skipped,
    only the draft context K/V written) equal the reference drafter's on the committed
    text, so the draft KV stayed right."""
    from vllm import SamplingParams

    dump_dir = str(tmp_path / "dump")
    os.makedirs(dump_dir)
    llm = _dspine_engine("schedule", pair, dspine_spec(
        pair.draft_dir, dspine_verify="fixed",
        num_speculative_tokens_per_batch_size=SCHEDULE), dump_dir=dump_dir)
    prompts = prompts_of_lengths(12, longest=80)
    params = [SamplingParams(temperature=0.0, max_tokens=8 + 6 * i, ignore_eos=True)
              for i in range(len(prompts))]
    before = verified_hist(llm)
    plain = [o.outputs[0].token_ids for o in plain_llm.generate(prompts, params)]
    outs = llm.generate(prompts, params)
    for i, (a, o) in enumerate(zip(plain, outs)):
        assert list(a) == list(o.outputs[0].token_ids), f"prompt {i} differs"
    hist = _delta(verified_hist(llm), before)
    print("schedule, verified drafts per request-step:",
          {n: c for n, c in enumerate(hist) if c})
    assert all(c == 0 for n, c in enumerate(hist) if n not in (0, 4, 15)), hist
    assert hist[0] > 0 and hist[4] > 0 and hist[15] > 0, hist
    seqs = {o.request_id: list(o.prompt_token_ids) + list(o.outputs[0].token_ids)
            for o in outs}
    checked, rows = _check_drafts_against_reference(pair, dump_dir, seqs)
    assert checked >= 8, f"only {checked} drafting steps were checked"
    # The schedule's 4-draft steps drafted a 5-row block, the 15-draft steps all 16 rows.
    assert set(rows) == {4, 15}, sorted(set(rows))


# ------------------------------------------------- a drafter's retrieval vocabulary
def test_retrieval_vocab_restricts_the_candidates(pair, plain_llm, tmp_path):
    """A drafter whose config.json lists `retrieval_vocab` (two thirds of the ids):
    every candidate of every step is one of them, the candidates and greedy drafts equal
    the reference retrieval over those head rows, and greedy output equals plain."""
    import json
    import shutil

    from vllm import SamplingParams

    draft = tmp_path / "draft"
    shutil.copytree(pair.draft_dir, draft)
    cfg = json.loads((draft / "config.json").read_text())
    vocab = [i for i in range(cfg["vocab_size"]) if i % 3]
    cfg["dspine_config"]["retrieval_vocab"] = vocab
    (draft / "config.json").write_text(json.dumps(cfg))
    dump_dir = str(tmp_path / "dump")
    os.makedirs(dump_dir)
    llm = _dspine_engine("vocab", pair, dspine_spec(str(draft), dspine_verify="fixed"),
                         dump_dir=dump_dir)
    prompts = prompts_of_lengths(6, longest=60)
    params = [SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)] * len(prompts)
    plain = [o.outputs[0].token_ids for o in plain_llm.generate(prompts, params)]
    outs = llm.generate(prompts, params)
    for i, (a, o) in enumerate(zip(plain, outs)):
        assert list(a) == list(o.outputs[0].token_ids), f"prompt {i} differs"
    allowed = torch.tensor(vocab)
    dumps = sorted(glob.glob(os.path.join(dump_dir, "*.pt")))
    assert dumps
    for path in dumps:
        assert torch.isin(torch.load(path)["cand_ids"], allowed).all(), path
    seqs = {o.request_id: list(o.prompt_token_ids) + list(o.outputs[0].token_ids)
            for o in outs}
    checked, _ = _check_drafts_against_reference(pair, dump_dir, seqs, vocab=allowed)
    assert checked >= 6, f"only {checked} drafting steps were checked"
