"""Shared helpers for tests that start vLLM engines (slow: ~25 s each on 2 cores).

`vllm serve` subprocesses: `vllm_dspine.serving.openai_server.VllmServer`; vLLM's
spec-decode counters and /metrics pages: `vllm_dspine.serving.metrics` (the same code the
benchmarks and examples use)."""

from __future__ import annotations


DSPINE_K = 15


def engine_env() -> None:
    # What scripts/env.sh sets for the README's commands; tests may run without it.
    from vllm_dspine.cpu_env import set_cpu_defaults

    set_cpu_defaults()


# The tiny pair's injected cost model (`dspine_verify_cost`, docs/serving.md): a
# verification step costs 20 ms plus 0.02 ms a target token, the drafter 5 ms. At the
# batch sizes of tests/test_dynamic_engine.py and tests/test_robust_engine.py (which share
# the engine) the policy then verifies some drafts of some requests, not all or none,
# and the lengths it picks do not depend on the machine's load (a measured model's do).
TINY_INJECTED_COST = {"step_s": 0.02, "token_s": 0.00002, "draft_s": 0.005}


def dspine_spec(draft_dir: str, **extra) -> dict:
    return {"method": "dspine", "model": str(draft_dir),
            "num_speculative_tokens": DSPINE_K, **extra}


# A 2048-token step budget: 50+ prompts of up to ~400 tokens cannot all prefill in one
# step, so prefills are chunked and arrive while other requests decode, and 48 decoding
# requests x 16 verified positions still fit in one step.
ENGINE_DEFAULTS = dict(dtype="float32", max_model_len=512, enforce_eager=True,
                       max_num_seqs=48, max_num_batched_tokens=2048, seed=0,
                       gpu_memory_utilization=0.15, disable_log_stats=False)


def make_llm(target_dir: str, spec: dict | None = None, **kwargs):
    """`vllm.LLM` on `target_dir` with ENGINE_DEFAULTS (overridden by `kwargs`). Tests get
    their engines from conftest.py's `engines` registry, which calls this."""
    engine_env()
    from vllm import LLM

    return LLM(str(target_dir), speculative_config=spec, **{**ENGINE_DEFAULTS, **kwargs})


# `vllm serve` flags of the tiny pair's servers (conftest.py's `tiny_server`, the Ray
# Serve replicas of tests/test_ray_serve.py): the same engine settings as make_llm's.
SERVE_ARGS = ["--dtype", "float32", "--max-model-len", "512", "--enforce-eager",
              "--gpu-memory-utilization", "0.15", "--seed", "0", "--served-model-name", "tiny"]


def prompts_of_lengths(n: int, longest: int = 400) -> list[str]:
    """n prompts of 3..longest characters (one token per character), many sharing
    prefixes (so the prefix cache is hit)."""
    base = ("the quick brown fox jumps over the lazy dog while five wizards box "
            "jackdaws quickly and the sphinx of black quartz judges my vow ") * 8
    return [base[(7 * i) % 40: (7 * i) % 40 + 3 + (97 * i) % (longest - 3)]
            for i in range(n)]


def sse_payloads(response):
    """The JSON payloads of an OpenAI-style server-sent-event stream, in order; raises
    AssertionError if the stream ends without its `data: [DONE]` line."""
    import json

    for line in response.iter_lines():
        if not line.startswith("data: "):
            continue
        if line == "data: [DONE]":
            return
        yield json.loads(line[6:])
    raise AssertionError("stream ended without 'data: [DONE]'")


VERIFIED_DRAFTS = "vllm:dspine_verified_drafts"  # row verified-drafts-metric, plugin/patches/


def check_counters_account_for(before: dict, after: dict, tokens: list[int],
                               where: str = "") -> dict:
    """One engine's /metrics (`vllm_dspine.serving.metrics.metric_page`) before and
    after it answered requests whose completion_tokens are `tokens` (greedy,
    ignore_eos, no stop: each ran to max_tokens), with no other traffic in between.
    The counters must account for exactly those answers, recomputed from the
    responses:

    - request_success and generation_tokens grew by len(tokens) and sum(tokens);
    - each generated token is the request's first token, the one token each decode
      step emits (the target's own), or an accepted draft; DSpine's verified-length
      histogram observes every decode request-step (0 drafts included), so
      sum(tokens - 1) = steps + accepted (no draft accepted past max_tokens: the
      default dynamic policy caps verified drafts at the remaining budget);
    - the histogram's sum is vLLM's draft-token counter, its non-zero observations
      vLLM's draft counter, and 0 < accepted <= draft tokens (a distilled drafter).
    Returns the deltas."""
    d = {k: after.get(k, 0) - before.get(k, 0) for k in set(after) | set(before)}
    info = (where, tokens, {k: v for k, v in sorted(d.items())
                            if v and ("spec_decode" in k or k.startswith(VERIFIED_DRAFTS))})
    assert d.get("vllm:request_success_total") == len(tokens), info
    assert d.get("vllm:generation_tokens_total") == sum(tokens), info
    steps = d.get(VERIFIED_DRAFTS + "_count", 0)
    accepted = d.get("vllm:spec_decode_num_accepted_tokens_total", 0)
    draft_tokens = d.get("vllm:spec_decode_num_draft_tokens_total", 0)
    drafts = d.get("vllm:spec_decode_num_drafts_total", 0)
    assert sum(t - 1 for t in tokens) == steps + accepted, info
    assert d.get(VERIFIED_DRAFTS + "_sum", 0) == draft_tokens, info
    assert drafts == steps - d.get(VERIFIED_DRAFTS + "_bucket|le=0", 0), info
    assert 0 < accepted <= draft_tokens and drafts > 0, info
    return d


def assert_candidates_match_reference(final_rows, head, ref_cand, cand, where: str) -> bool:
    """The engine's retrieval candidates `cand` [K, k] against the reference's `ref_cand`
    [K, k] for the same final states `final_rows` [K, H] and output head [V, H] (both
    as token ids). Equal, or a near-tie: the engine scores its head through vLLM's
    oneDNN matmul and gets its features from vLLM's target forward, the reference uses
    torch and transformers; the two agree to ~1e-6, so two ids whose scores tie to that
    level may swap places (or the k-th and (k+1)-th trade). Any other difference fails.
    Returns True when the two were not identical (a near-tie was accepted)."""
    import torch

    if torch.equal(ref_cand, cand):
        return False
    scores = final_rows.double() @ head.double().t()  # [K, V]
    want = scores.gather(1, ref_cand)  # [K, k] reference top-k, descending
    have = scores.gather(1, cand)  # [K, k] the engine's picks, same scale
    gap = float((want - have).abs().max())
    # 1e-3 on logits of size ~10: a thousand times the disagreement of the two
    # computations, far below the gap a real retrieval error would leave between tokens.
    assert gap < 1e-3, (f"{where}: engine candidates are not the reference top-"
                        f"{ref_cand.shape[1]} (score gap {gap:.3g})")
    return True


def target_features(target_dir: str, layer_ids, token_ids: list[int]):
    """Residual-stream outputs of the target's layers `layer_ids` on `token_ids` (vLLM's
    auxiliary states), [T, len(layer_ids) H], and the fp32 transformers target."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
    with torch.no_grad():
        out = model(torch.tensor([token_ids]), output_hidden_states=True)
    return torch.cat([out.hidden_states[i + 1][0] for i in layer_ids], dim=-1), model


def check_drafts_against_reference(pair, dump_dir: str, seqs: dict[str, list[int]],
                                   vocab=None) -> tuple[int, list[int]]:
    """Each drafting step an engine dumped (VLLM_DSPINE_DEBUG_DUMP) into `dump_dir`
    against the reference drafter (model/drafter.py) on the committed text `seqs`
    (request id -> prompt + output token ids): the vLLM model's final states of the
    block's proposal rows to fp32 tolerance (1e-4), its retrieval candidates equal up to
    near-ties (`assert_candidates_match_reference`; over the head rows `vocab` only,
    mapped back to token ids, when the drafter has a retrieval vocabulary), and its
    greedy drafts equal to the reference tail's on the engine's own candidates. A step
    that drafted only the block's first K rows (a schedule or the policy capped
    verification at K) must equal the first K rows of the reference's full block.
    Returns (number of (step, request) checked, rows per request of each checked
    step)."""
    import glob
    import os

    import torch

    from vllm_dspine.kernels.retrieval import retrieve_candidates
    from vllm_dspine.kernels.tail import LastWriteInputs, refine_last_write
    from vllm_dspine.model.checkpoint import load_draft_checkpoint, tail_weights
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
                # Drafted in the step that finished the request: its accepted tokens
                # ran past max_tokens and were cut, so the anchor is not in the output.
                continue
            assert seq[p] == int(step["anchor_ids"][r])
            if req_id not in cache:
                cache[req_id] = target_features(pair.target_dir, cfg.target_layer_ids, seq)
            feats, target = cache[req_id]
            head = target.lm_head.weight.detach()
            # The statement of the model (model/drafter.py) on this one block.
            out = block_forward(cfg, tensors, target.model.embed_tokens.weight.detach(),
                                head, torch.tensor([seq]), feats[None], torch.tensor([[p]]))
            final = out.final_hidden[0, 0]  # [B, H]
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
                tail_weights(cfg, tensors, head),
                torch.zeros(1))
            assert torch.equal(proposal.draft_token_ids[0, :K], step["draft_token_ids"][r])
            checked += 1
            rows_seen.append(K)
    return checked, rows_seen
