"""DSpine under faults: preemption forced by a small KV budget, and a drafter whose
weights produce inf/NaN. Each DSpine engine is private to the one test that needs it
(started and shut down by the session's registry, conftest.py); the shared plain engine
over the same target is the reference for both.

Tiers (docs/testing.md): preemption runs in the default tier; the NaN drafter (an engine
for each verification mode) runs in `full`. That a NaN q is verified as q = 0 and the
output then follows p is tested without an engine in the default tier
(tests/test_verify_ref.py).
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from engine_utils import dspine_spec, prompts_of_lengths

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def pair(tiny_trained_pair):
    return tiny_trained_pair  # conftest.py: written once per session


def _metric(llm, name: str) -> float:
    for m in llm.get_metrics():
        if m.name == name:
            return getattr(m, "value", 0) or 0
    raise KeyError(f"vLLM exposes no metric {name!r}")


def _tokens(outs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outs]


def test_preemption_with_a_small_kv_budget(engines, pair, plain_llm):
    """24 long greedy requests on 12 KV blocks of 128 positions (each request needs 1-3
    blocks by its end, most 2, plus the drafter's look-ahead; 16 run at once): vLLM must
    preempt and recompute
    requests, and the DSpine engine's outputs are token-identical to plain decoding's,
    none lost, none duplicated, every one exactly max_tokens long. After preemption the
    runner's cached sparse q of the re-scheduled requests is gone; their drafts must
    be dropped alone (verify/ and proposer/sparse_q.py)."""
    from vllm import SamplingParams

    prompts = prompts_of_lengths(24, longest=160)
    params = [SamplingParams(temperature=0.0, max_tokens=64 + (17 * i) % 64,
                             ignore_eos=True) for i in range(len(prompts))]
    want = _tokens(plain_llm.generate(prompts, params))
    with engines.private(pair.target_dir, dspine_spec(pair.draft_dir),
                         num_gpu_blocks_override=12, max_num_seqs=16) as llm:
        outs = llm.generate(prompts, params)
        preemptions = _metric(llm, "vllm:num_preemptions")
    assert preemptions > 0, "the KV budget did not force any preemption"
    assert sorted(o.request_id for o in outs) == sorted({o.request_id for o in outs})
    got = _tokens(outs)
    for i, (g, w) in enumerate(zip(got, want)):
        assert len(g) == params[i].max_tokens, i
        assert g == w, f"request {i} differs after preemption"


def _poisoned_draft(pair, out_dir: str) -> str:
    """A copy of the draft whose `fc` has one inf entry: the context projection
    overflows, and every draft state, candidate score and q is inf/NaN."""
    from safetensors.torch import load_file, save_file

    dst = os.path.join(out_dir, "draft_inf")
    shutil.copytree(pair.draft_dir, dst)
    for name in os.listdir(dst):
        if name.endswith(".safetensors"):
            path = os.path.join(dst, name)
            tensors = load_file(path)
            if "fc.weight" in tensors:
                tensors["fc.weight"][0, 0] = float("inf")
                save_file(tensors, path, metadata={"format": "pt"})
    return dst


def _allowed_top_k(logits: torch.Tensor, k: int) -> torch.Tensor:
    """bool [T, V]: the k largest logits of each row (ties at the k-th kept)."""
    kth = logits.topk(k, dim=-1).values[:, -1:]
    return logits >= kth - 1e-4


@pytest.mark.full  # an engine of its own (~35 s on a slow core): docstring of the module
@pytest.mark.parametrize("verify", [
    pytest.param({"dspine_verify": "fixed"}, id="fixed"),
    pytest.param({}, id="dynamic-default"),
])
def test_drafter_producing_nan_is_answered_by_the_target(engines, pair, plain_llm, tmp_path,
                                                         verify):
    """A drafter whose weights overflow to inf/NaN, with every draft verified and with
    the default dynamic policy (which reads the NaN tables for its confidence): the
    engine starts, nothing hangs, greedy requests equal plain decoding, and sampled
    requests (top-k 3) only emit tokens their filter allows. A NaN q is verified as
    q = 0 (never accepted, token drawn from the target's p), never as a distribution;
    that the output then follows p is tested in tests/test_verify_ref.py."""
    from transformers import AutoModelForCausalLM
    from vllm import SamplingParams

    draft = _poisoned_draft(pair, str(tmp_path))
    prompts = prompts_of_lengths(12, longest=120)
    greedy = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    sampled = [SamplingParams(temperature=1.0, top_k=3, seed=i, max_tokens=40,
                              ignore_eos=True) for i in range(len(prompts))]
    want = _tokens(plain_llm.generate(prompts, greedy))
    with engines.private(pair.target_dir, dspine_spec(draft, **verify)) as llm:
        got = _tokens(llm.generate(prompts, greedy))
        mixed = llm.generate(prompts + prompts, [greedy] * len(prompts) + sampled)
    assert got == want
    assert _tokens(mixed[:len(prompts)]) == want  # greedy neighbours of sampled ones
    target = AutoModelForCausalLM.from_pretrained(pair.target_dir, dtype=torch.float32)
    for o in mixed[len(prompts):]:
        prompt, gen = list(o.prompt_token_ids), list(o.outputs[0].token_ids)
        assert len(gen) == 40
        with torch.no_grad():
            logits = target(torch.tensor([prompt + gen])).logits[0]
        ok = _allowed_top_k(logits[len(prompt) - 1: len(prompt) - 1 + len(gen)], 3)
        assert all(ok[j, t] for j, t in enumerate(gen)), (o.request_id, gen)
