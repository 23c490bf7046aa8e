"""DSpine through vLLM on CPU, end to end, on the small pair the project writes.

Engines are expensive (~25 s to start on 2 cores), so this module uses two, from the
session's registry (conftest.py): the plain engine over the target (shared with the other
modules of the tiny pair) and a DSpine engine of its own. The DSpine engine dumps
each drafting step (VLLM_DSPINE_DEBUG_DUMP) so the vLLM model class, its candidates,
greedy drafts and retained sampled q can be checked against the plain-PyTorch reference
drafter + tail, and vLLM's spec-decode counters against the dumped drafts. It verifies
every draft (`dspine_verify: fixed`), so each dumped block is what was verified; the
dynamic policy has its own engine tests (tests/test_dynamic_engine.py). The sampled
distribution is tested against the target's exact one in tests/test_exact_distribution.py.
"""

from __future__ import annotations

import glob
import os

import pytest
import torch

from engine_utils import (assert_candidates_match_reference, check_drafts_against_reference,
                          dspine_spec, prompts_of_lengths)
from vllm_dspine.serving.metrics import spec_decode_counters

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def pair(tiny_trained_pair):
    return tiny_trained_pair  # conftest.py: written once per session


@pytest.fixture(scope="module")
def dump_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("dspine_dump"))


@pytest.fixture(scope="module")
def spec_llm(engines, pair, dump_dir):
    # Each engine of the registry reads its own spec-decode counters (conftest.py).
    # fp32 layer products: its drafts are compared with the fp32 reference drafter at
    # 1e-4 (the bf16 products, `dspine_draft_gemm`, are tests/test_cpu_gemm.py's).
    return engines.get(pair.target_dir, dspine_spec(pair.draft_dir, dspine_verify="fixed",
                                                    dspine_draft_gemm="fp32"),
                       dump_dir=dump_dir)


@pytest.fixture(scope="module")
def target(pair):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(pair.target_dir, dtype=torch.float32).eval()


def _clear(dump_dir):
    for f in glob.glob(os.path.join(dump_dir, "*.pt")):
        os.remove(f)


def test_greedy_identical_to_plain_decoding(plain_llm, spec_llm, dump_dir):
    """56 prompts of 3..400 tokens with 16..64 new tokens each, on engines of 48 slots
    and a 2048-token step budget: prefills are chunked, requests finish at different
    steps and new prefills arrive while others decode, >= 32 requests are drafted in
    one step, and a second pass hits the prefix cache. Greedy output in fp32 is
    token-identical to the same engine without speculation."""
    from vllm import SamplingParams

    prompts = prompts_of_lengths(56)
    assert len({len(p) for p in prompts}) > 40 and max(map(len, prompts)) > 300
    params = [SamplingParams(temperature=0.0, max_tokens=16 + (13 * i) % 49,
                             ignore_eos=True) for i in range(len(prompts))]
    plain = [o.outputs[0].token_ids for o in plain_llm.generate(prompts, params)]
    _clear(dump_dir)
    spec = [o.outputs[0].token_ids for o in spec_llm.generate(prompts, params)]
    for i, (a, b) in enumerate(zip(plain, spec)):
        assert list(a) == list(b), f"prompt {i} ({len(prompts[i])} tokens) differs"
    steps = sorted(glob.glob(os.path.join(dump_dir, "*.pt")))
    assert steps, "the DSpine proposer never ran"
    assert max(len(torch.load(s)["req_ids"]) for s in steps) >= 32, \
        "fewer than 32 requests were ever drafted in one step"
    again = [o.outputs[0].token_ids for o in spec_llm.generate(prompts, params)]
    assert [list(a) for a in again] == [list(b) for b in plain]


def _dumps(dump_dir) -> list[dict]:
    return [torch.load(f) for f in sorted(glob.glob(os.path.join(dump_dir, "*.pt")))]


def _leading_matches(draft: list[int], truth: list[int]) -> int:
    n = 0
    for d, t in zip(draft, truth):
        if d != t:
            break
        n += 1
    return n


def test_spec_decode_counters_match_the_drafts(plain_llm, spec_llm, dump_dir):
    """vLLM's counters against what they must be, computed independently: one greedy
    request; every dumped block whose anchor is not the request's last token was
    verified (all 15 drafts: fixed verification), and its accepted length is the number
    of leading drafts equal to plain greedy decoding's continuation (generated 16
    tokens longer, so the last block's truth is known past max_tokens)."""
    from vllm import SamplingParams

    prompt, n = "abcdefgh", 64
    greedy = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    _clear(dump_dir)
    before = spec_decode_counters(spec_llm)
    out = spec_llm.generate([prompt], greedy)[0]
    after = spec_decode_counters(spec_llm)
    longer = SamplingParams(temperature=0.0, max_tokens=n + 16, ignore_eos=True)
    truth = plain_llm.generate([prompt], longer)[0]
    seq = list(truth.prompt_token_ids) + list(truth.outputs[0].token_ids)
    assert list(out.outputs[0].token_ids) == seq[len(out.prompt_token_ids):][:n]
    last = len(out.prompt_token_ids) + n - 1  # position of the last generated token
    per_pos, drafts = [0] * 15, 0
    for step in _dumps(dump_dir):
        assert len(step["req_ids"]) == 1
        p = int(step["anchor_positions"][0])
        if p >= last:  # drafted in the finishing step: never verified
            continue
        assert int(step["anchor_ids"][0]) == seq[p]
        a = _leading_matches(step["draft_token_ids"][0].tolist(), seq[p + 1:p + 16])
        drafts += 1
        for j in range(a):
            per_pos[j] += 1

    def delta(name):
        b = before.get(name) or (0 if not isinstance(after[name], list) else [0] * 15)
        if isinstance(after[name], list):
            return [x - y for x, y in zip(after[name], b)]
        return after[name] - b

    assert sum(per_pos) > 10, "too few drafts accepted for a meaningful check"
    assert delta("vllm:spec_decode_num_drafts") == drafts
    assert delta("vllm:spec_decode_num_draft_tokens") == 15 * drafts
    assert delta("vllm:spec_decode_num_accepted_tokens_per_pos") == per_pos
    assert delta("vllm:spec_decode_num_accepted_tokens") == sum(per_pos)
    # Every step emitted its accepted drafts plus one token: the output length follows.
    assert n <= 1 + drafts + sum(per_pos) <= n + 15


def _mixed_params():
    """16 requests: every 4th greedy, the others sampled with different temperature,
    top-p, top-k, min-p and seed."""
    from vllm import SamplingParams

    params = []
    for i in range(16):
        if i % 4 == 0:
            params.append(SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True))
        else:
            params.append(SamplingParams(
                temperature=[0.5, 1.0, 1.5][i % 3], top_p=[1.0, 0.9, 0.7][i % 3],
                top_k=[-1, 50, 5][(i // 3) % 3], min_p=[0.0, 0.05][i % 2],
                seed=1000 + i, max_tokens=32, ignore_eos=True))
    return params


@pytest.fixture(scope="module")
def mixed_run(spec_llm, dump_dir):
    """The mixed batch run twice on the DSpine engine; the first run's drafting steps
    are kept (dump files loaded)."""
    prompts = prompts_of_lengths(16)
    params = _mixed_params()
    _clear(dump_dir)
    first = spec_llm.generate(prompts, params)
    steps = _dumps(dump_dir)
    again = spec_llm.generate(prompts, params)
    return prompts, params, first, again, steps


def test_mixed_batch_greedy_exact_and_seeds_reproduce(plain_llm, mixed_run):
    """Greedy and sampled requests with different temperature/top-p/top-k/min-p/seed in
    one batch: the greedy ones equal plain greedy decoding, the seeded sampled ones give
    the same tokens when run again."""
    from vllm import SamplingParams

    prompts, params, first, again, _ = mixed_run
    greedy = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    plain = [o.outputs[0].token_ids for o in plain_llm.generate(prompts[::4], greedy)]
    for j, i in enumerate(range(0, 16, 4)):
        assert list(first[i].outputs[0].token_ids) == list(plain[j]), \
            f"greedy request {i} differs in a mixed batch"
    for i in range(16):
        assert list(first[i].outputs[0].token_ids) == list(again[i].outputs[0].token_ids), \
            f"seeded request {i} did not reproduce"


def _allowed(logits: torch.Tensor, params, slack: float = 1e-4) -> torch.Tensor:
    """Tokens a request's filters may emit, computed in float64 in vLLM's order
    (temperature, min-p, top-k, top-p), every threshold relaxed by `slack` so that
    float32 rounding on the engine side cannot put a legal token outside.
    logits [T, V] -> bool [T, V]."""
    x = logits.double() / params.temperature
    keep = torch.ones_like(x, dtype=torch.bool)
    if params.min_p > 0:
        probs = x.softmax(-1)
        keep &= probs >= params.min_p * probs.amax(-1, keepdim=True) * (1 - slack)
    if params.top_k > 0:
        masked = torch.where(keep, x, float("-inf"))
        kth = masked.topk(params.top_k, dim=-1).values[:, -1:]
        keep &= masked >= kth - slack
    if params.top_p < 1:
        probs = torch.where(keep, x, float("-inf")).softmax(-1)
        sorted_p, order = probs.sort(-1)
        drop = sorted_p.cumsum(-1) <= 1 - params.top_p - slack
        drop[:, -1] = False
        keep &= ~torch.zeros_like(drop).scatter(1, order, drop)
    return keep


def test_sampled_tokens_stay_in_their_filtered_support(target, mixed_run):
    """Every token a sampled request emitted is one its own top-k/top-p/min-p allow at
    that position (target logits recomputed in transformers): the per-request filters
    reach the verifier through batch reordering. (min_p needs vLLM's MinP processor,
    which vLLM 0.32.0 builds under speculative decoding only with the plugin's patch
    row logitsprocs-for-dspine.)"""
    _, params, first, _, _ = mixed_run
    cut = 0
    for i, (o, sp) in enumerate(zip(first, params)):
        if sp.temperature == 0:
            continue
        prompt, gen = list(o.prompt_token_ids), list(o.outputs[0].token_ids)
        with torch.no_grad():
            logits = target(torch.tensor([prompt + gen])).logits[0]  # [T, V]
        rows = logits[len(prompt) - 1: len(prompt) - 1 + len(gen)]
        keep = _allowed(rows, sp)
        cut += int((~keep).sum())
        bad = [j for j, t in enumerate(gen) if not keep[j, t]]
        assert not bad, f"request {i} ({sp}): tokens at {bad} are outside its filters"
    assert cut > 1000, "the filters cut nothing: the check would not see a leak"


def test_sampled_proposal_matches_reference(pair, target, mixed_run):
    """The retained q of the mixed batch (what the verifier is handed) against the
    reference drafter + tail: for up to 8 dumped blocks per request whose anchor is in
    the request's output, `block_forward` on the committed text, the same 16 candidates
    (up to near-ties of the scores, see below), the score tables by the direct formula
    (float64) on the engine's candidates, and at each row the request's
    own temperature/top-k/top-p/min-p applied to the table row of the predecessor the
    engine drew: q equals the dumped cand_probs (to 1e-4; the engine scores through the
    fp32 per-token tables), and each drawn draft has q > 0. Greedy members: the one-hot
    at the reference argmax. This covers the per-request slicing of the sampling
    parameters, the generators and the batch order (request ids of the dump)."""
    from vllm_dspine.kernels.retrieval import retrieve_candidates
    from vllm_dspine.kernels.tail import (LastWriteInputs, filter_candidate_probs,
                                          tail_score_tables)
    from vllm_dspine.model.checkpoint import load_draft_checkpoint, tail_weights
    from vllm_dspine.model.drafter import block_forward

    _, params, first, _, steps = mixed_run
    by_id = {o.request_id: (list(o.prompt_token_ids) + list(o.outputs[0].token_ids), sp)
             for o, sp in zip(first, params)}
    cfg, tensors = load_draft_checkpoint(pair.draft_dir)
    embed = target.model.embed_tokens.weight.detach()
    head = target.lm_head.weight.detach()
    K = cfg.num_proposals
    # (step, row) entries per request, at most 8 per request (spread over its steps).
    entries: dict[str, list[tuple[dict, int, int]]] = {}
    for step in steps:
        for r, req_id in enumerate(step["req_ids"]):
            seq, _ = by_id[req_id.split("-")[0]]
            p = int(step["anchor_positions"][r])
            if p >= len(seq) - 1 or seq[p] != int(step["anchor_ids"][r]):
                continue  # finishing step (never verified) or a discarded partial prefill
            entries.setdefault(req_id, []).append((step, r, p))
    checked = {"sampled": 0, "greedy": 0, "near_ties": 0}
    for req_id, todo in entries.items():
        todo = todo[:: max(1, len(todo) // 8)][:8]
        seq, sp = by_id[req_id.split("-")[0]]
        with torch.no_grad():
            hs = target(torch.tensor([seq]), output_hidden_states=True).hidden_states
        feats = torch.cat([hs[i + 1][0] for i in cfg.target_layer_ids], -1)
        anchors = torch.tensor([[p for _, _, p in todo]])  # [1, nb]
        out = block_forward(cfg, tensors, embed, head, torch.tensor([seq]), feats[None],
                            anchors)
        nb = anchors.shape[1]
        final = out.final_hidden[0]  # [nb, B, H]
        ref_cand = retrieve_candidates(final[:, 1:].reshape(nb * K, -1), head,
                                       cfg.head_topk, cfg.coarse_topk, None,
                                       mode="bf16").view(nb, K, -1)
        cand = torch.stack([step["cand_ids"][r].view(K, -1) for step, r, _ in todo])
        # Equal up to near-ties (engine_utils says why); the tail is then checked on the
        # engine's own candidates, so a near-tie costs no coverage.
        for b, (_, _, p) in enumerate(todo):
            checked["near_ties"] += assert_candidates_match_reference(
                final[b, 1:], head, ref_cand[b], cand[b], f"{req_id} anchor {p}")
        S = tail_score_tables(
            LastWriteInputs(out.pre_write_state[0], out.last_codes[0], out.last_rms[0],
                            torch.tensor([seq[p] for _, _, p in todo])),
            cand, tail_weights(cfg, tensors, head),
            None, torch.float64)  # [nb, K, k, k]
        for b, (step, r, p) in enumerate(todo):
            drafts = step["draft_token_ids"][r].view(-1).tolist()
            got = step["cand_probs"][r].double()  # [K, k]
            prev = 0
            for t in range(K):
                row = S[b, t, prev]
                if sp.temperature == 0:
                    want = torch.nn.functional.one_hot(row.argmax(), row.numel()).double()
                else:
                    want = filter_candidate_probs(
                        (row / sp.temperature)[None],
                        torch.tensor([sp.top_k]), torch.tensor([sp.top_p]),
                        torch.tensor([sp.min_p], dtype=torch.float64))[0]
                j = cand[b, t].tolist().index(drafts[t])
                # min_p requests included: their q must apply min-p too (patch row
                # logitsprocs-for-dspine builds vLLM's MinP processor under DSpine).
                assert torch.allclose(got[t], want, atol=1e-4, rtol=0), \
                    f"{req_id} anchor {p} row {t + 1} (min_p {sp.min_p}): q " \
                    f"{got[t].tolist()} != reference {want.tolist()}"
                assert want[j] > 0, f"{req_id} anchor {p} row {t + 1}: draft has q = 0"
                prev = j
            checked["greedy" if sp.temperature == 0 else "sampled"] += 1
    assert checked["sampled"] >= 20 and checked["greedy"] >= 4, checked
    # Near-ties are rare (0 in most runs, 1 seen once in ~60 blocks); many of them
    # would mean the engine's features drifted from the target's.
    assert checked["near_ties"] <= 3, checked


def _check_against_reference(pair, llm, dump_dir, prompts, max_tokens) -> int:
    """Runs greedy `prompts` on `llm` (dumping every drafting step) and checks each step
    against the reference drafter (engine_utils.check_drafts_against_reference: final
    states, candidates, greedy drafts); returns the number of (step, request) checked."""
    from vllm import SamplingParams

    _clear(dump_dir)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                ignore_eos=True))
    seqs = {o.request_id: list(o.prompt_token_ids) + list(o.outputs[0].token_ids)
            for o in outs}
    checked, _ = check_drafts_against_reference(pair, dump_dir, seqs)
    return checked


def test_vllm_drafter_matches_reference_drafter(pair, spec_llm, dump_dir):
    """The vLLM model class (inside the engine, with its KV cache and batch layout)
    computes what the reference drafter computes: final states of every proposal row
    to fp32 tolerance, and the same candidates and greedy drafts."""
    checked = _check_against_reference(pair, spec_llm, dump_dir,
                                       ["abcdefgh", "hello there", "xyz"], 40)
    assert checked >= 6, f"only {checked} drafting steps were checked"


@pytest.mark.full
def test_sliding_window_drafter_matches_reference(engines, tmp_path_factory):
    """A drafter with a 32-position window, on contexts longer than the window: vLLM's
    sliding-window KV for the draft layers agrees with the reference's window mask.
    (`full` tier: an engine of its own, ~35 s; no shipped drafter has a window.)"""
    from vllm_dspine.pairs.tiny import write_tiny_pair

    pair = write_tiny_pair(str(tmp_path_factory.mktemp("pair_sw")), seed=1,
                           draft_sliding_window=32)
    dump_dir = str(tmp_path_factory.mktemp("dspine_dump_sw"))
    with engines.private(pair.target_dir, dspine_spec(pair.draft_dir,
                                                      dspine_draft_gemm="fp32"),
                         dump_dir=dump_dir,
                         max_num_seqs=4) as llm:
        long_prompt = "the quick brown fox jumps over the lazy dog " * 2
        checked = _check_against_reference(pair, llm, dump_dir, [long_prompt, "abc"], 48)
    assert checked >= 4
