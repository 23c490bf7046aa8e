"""DSpine through vLLM on CPU, end to end, on the small pair the project writes.

Engines are expensive (~25 s to start on 2 cores), so this module starts two and shares
them: a plain engine and a DSpine engine over the same target. The DSpine engine dumps
each drafting step (VLLM_DSPINE_DEBUG_DUMP) so the vLLM model class can be checked
against the plain-PyTorch reference drafter.
"""

from __future__ import annotations

import glob
import os

import pytest
import torch

from engine_utils import dspine_spec, make_llm, prompts_of_lengths, spec_metrics

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    from vllm_dspine.pairs.tiny import write_tiny_pair

    # The distilled drafter: drafts get accepted, so the sampled test compares
    # accepted drafts, not only corrections.
    return write_tiny_pair(str(tmp_path_factory.mktemp("pair")), seed=0, trained=True)


@pytest.fixture(scope="module")
def dump_dir(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("dspine_dump"))
    os.environ["VLLM_DSPINE_DEBUG_DUMP"] = d
    yield d
    os.environ.pop("VLLM_DSPINE_DEBUG_DUMP", None)


@pytest.fixture(scope="module")
def plain_llm(pair):
    return make_llm(pair.target_dir)


@pytest.fixture(scope="module")
def spec_llm(pair, dump_dir, plain_llm):
    # Built after plain_llm on purpose: an LLM's Prometheus logger unregisters the
    # metrics of engines built before it in the same process, and the tests read the
    # DSpine engine's spec-decode counters.
    return make_llm(pair.target_dir, dspine_spec(pair.draft_dir))


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


def test_spec_decode_metrics_counted(spec_llm):
    """vLLM's own counters see the drafts and the accepted ones, per position."""
    from vllm import SamplingParams

    # Prompts the planted habit continues ("abcd" -> "efgh..."): some drafts accepted.
    spec_llm.generate(["abcdefgh", "klmnopq", "0123456"],
                      SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True))
    m = spec_metrics(spec_llm)
    assert m["vllm:spec_decode_num_draft_tokens"] > 0
    assert m["vllm:spec_decode_num_accepted_tokens"] > 0, m
    per_pos = m["vllm:spec_decode_num_accepted_tokens_per_pos"]
    assert len(per_pos) == 15 and sum(per_pos) == m["vllm:spec_decode_num_accepted_tokens"]


def test_mixed_batch_greedy_exact_and_seeds_reproduce(plain_llm, spec_llm):
    """Greedy and sampled requests with different temperature/top-p/top-k/min-p/seed in
    one batch: the greedy ones equal plain greedy decoding, the seeded sampled ones give
    the same tokens when run again."""
    from vllm import SamplingParams

    prompts = prompts_of_lengths(16)
    params = []
    for i in range(16):
        if i % 4 == 0:
            params.append(SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True))
        else:
            params.append(SamplingParams(
                temperature=[0.5, 1.0, 1.5][i % 3], top_p=[1.0, 0.9, 0.7][i % 3],
                top_k=[-1, 50, 5][(i // 3) % 3], min_p=[0.0, 0.05][i % 2],
                seed=1000 + i, max_tokens=32, ignore_eos=True))
    first = [o.outputs[0].token_ids for o in spec_llm.generate(prompts, params)]
    again = [o.outputs[0].token_ids for o in spec_llm.generate(prompts, params)]
    greedy = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    plain = [o.outputs[0].token_ids for o in plain_llm.generate(prompts[::4], greedy)]
    for j, i in enumerate(range(0, 16, 4)):
        assert list(first[i]) == list(plain[j]), f"greedy request {i} differs in a mixed batch"
    for i in range(16):
        assert list(first[i]) == list(again[i]), f"seeded request {i} did not reproduce"
        assert len(first[i]) == 32


def _two_sample_chi2_pvalue(a: list[int], b: list[int], min_count: int = 10) -> float:
    """Chi-square test that two samples of token ids come from one distribution; tokens
    seen fewer than `min_count` times in both samples together share one bin."""
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


def test_sampled_distribution_matches_plain(plain_llm, spec_llm):
    """At temperature 0.5 the 2nd and 3rd generated tokens (the ones speculation
    produces: verified drafts, corrections, bonus) are distributed as without
    speculation: 4,000 seeded samples per engine, two-sample chi-square per position.

    Threshold: p > 1e-3 (seeds are fixed, so the outcome is deterministic; a correct
    sampler would fail one comparison in a thousand before the seeds were fixed). With
    4,000 samples this catches a distortion of a few percent in total variation on the
    frequent tokens; the 1% level is checked on the verifier itself with 10^5 samples
    (tests/test_verify_ref.py). The test also requires drafts to be accepted, so that
    the acceptance path (not only corrections) is what is being compared."""
    from vllm import SamplingParams

    n, prompt = 4000, "abcdefg"

    def sample(llm, seed0):
        # T 0.5: the small target is too flat at T 1 for a good share of accepted
        # drafts (docs/tiny-pair-training.md).
        params = [SamplingParams(temperature=0.5, max_tokens=3, seed=seed0 + i,
                                 ignore_eos=True) for i in range(n)]
        return [list(o.outputs[0].token_ids) for o in llm.generate([prompt] * n, params)]

    before = spec_metrics(spec_llm)
    spec = sample(spec_llm, 10_000)
    after = spec_metrics(spec_llm)
    plain = sample(plain_llm, 50_000)

    drafts = after["vllm:spec_decode_num_drafts"] - before.get("vllm:spec_decode_num_drafts", 0)
    per_pos = [x - y for x, y in zip(
        after["vllm:spec_decode_num_accepted_tokens_per_pos"],
        before.get("vllm:spec_decode_num_accepted_tokens_per_pos") or [0] * 15)]
    rate1, rate2 = per_pos[0] / drafts, per_pos[1] / drafts
    print(f"sampled T=0.5: {drafts} verification steps; draft acceptance rate at "
          f"position 1: {rate1:.3f}, position 2: {rate2:.3f}")
    assert rate1 > 0.1, f"too few drafts accepted ({rate1:.3f}) for a meaningful test"
    for pos in (1, 2):
        p = _two_sample_chi2_pvalue([s[pos] for s in spec], [s[pos] for s in plain])
        assert p > 1e-3, f"token {pos + 1}: speculative and plain distributions differ " \
                         f"(chi-square p = {p:.2e})"


def _target_features(target_dir, layer_ids, token_ids):
    """Residual-stream outputs of the target's layers (vLLM's auxiliary states)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
    with torch.no_grad():
        out = model(torch.tensor([token_ids]), output_hidden_states=True)
    return torch.cat([out.hidden_states[i + 1][0] for i in layer_ids], dim=-1), model


def _check_against_reference(pair, llm, dump_dir, prompts, max_tokens) -> int:
    """Runs greedy `prompts` on `llm` (dumping every drafting step) and checks each step
    against the reference drafter; returns the number of (step, request) checked."""
    from vllm import SamplingParams

    from vllm_dspine.model.checkpoint import load_draft_checkpoint
    from vllm_dspine.kernels.retrieval import retrieve_candidates
    from vllm_dspine.kernels.tail import refine_last_write
    from vllm_dspine.model.checkpoint import bridge_weights
    from vllm_dspine.model.drafter import block_forward

    _clear(dump_dir)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                ignore_eos=True))
    seqs = {o.request_id: list(o.prompt_token_ids) + list(o.outputs[0].token_ids)
            for o in outs}
    cfg, tensors = load_draft_checkpoint(pair.draft_dir)
    K = cfg.num_proposals
    checked = 0
    cache = {}
    for path in sorted(glob.glob(os.path.join(dump_dir, "*.pt"))):
        step = torch.load(path)
        for r, req_id in enumerate(step["req_ids"]):
            seq = seqs[req_id.split("-")[0]]
            p = int(step["anchor_positions"][r])
            if p >= len(seq):
                # Drafted in the step that finished the request: its accepted tokens
                # ran past max_tokens and were cut, so the anchor is not in the output.
                continue
            assert seq[p] == int(step["anchor_ids"][r])
            if req_id not in cache:
                cache[req_id] = _target_features(pair.target_dir, cfg.target_layer_ids, seq)
            feats, target = cache[req_id]
            embed = target.model.embed_tokens.weight.detach()
            head = target.lm_head.weight.detach()
            # The statement of the model (model/drafter.py) on this one block.
            out = block_forward(cfg, tensors, embed, head, torch.tensor([seq]), feats[None],
                                torch.tensor([[p]]))
            final = out.final_hidden[0, 0]  # [B, H]
            vllm_final = step["final_hidden"][r * K:(r + 1) * K]
            torch.testing.assert_close(vllm_final, final[1:], rtol=1e-4, atol=1e-4)
            cand = retrieve_candidates(final[1:], head, cfg.head_topk, cfg.coarse_topk, None,
                                       mode="bf16")
            assert torch.equal(cand, step["cand_ids"][r])
            proposal = refine_last_write(
                out.pre_write_state[0], out.last_codes[0], out.last_rms[0],
                cand[None], torch.tensor([seq[p]]), bridge_weights(cfg, tensors),
                tensors["norm.weight"], cfg.rms_norm_eps, head, torch.zeros(1))
            assert torch.equal(proposal.draft_token_ids[0], step["draft_token_ids"][r])
            checked += 1
    return checked


def test_vllm_drafter_matches_reference_drafter(pair, spec_llm, dump_dir):
    """The vLLM model class (inside the engine, with its KV cache and batch layout)
    computes what the reference drafter computes: final states of every proposal row
    to fp32 tolerance, and the same candidates and greedy drafts."""
    checked = _check_against_reference(pair, spec_llm, dump_dir,
                                       ["abcdefgh", "hello there", "xyz"], 40)
    assert checked >= 6, f"only {checked} drafting steps were checked"


def test_sliding_window_drafter_matches_reference(tmp_path_factory, dump_dir):
    """A drafter with a 32-position window, on contexts longer than the window: vLLM's
    sliding-window KV for the draft layers agrees with the reference's window mask."""
    from vllm_dspine.pairs.tiny import write_tiny_pair

    pair = write_tiny_pair(str(tmp_path_factory.mktemp("pair_sw")), seed=1,
                           draft_sliding_window=32)
    llm = make_llm(pair.target_dir, dspine_spec(pair.draft_dir), max_num_seqs=4)
    long_prompt = "the quick brown fox jumps over the lazy dog " * 2
    checked = _check_against_reference(pair, llm, dump_dir, [long_prompt, "abc"], 48)
    assert checked >= 4
    del llm
