"""Sparse == dense: our sampler and vLLM 0.32.0's own dense `rejection_sample` (with
q scattered dense, on CPU through vLLM's C++ kernel overrides) emit identical tokens
when both draw their randomness from the same generators and global seed."""

from __future__ import annotations

import pytest
import torch

from vllm.platforms.cpu import CpuPlatform
from vllm.v1.sample.logits_processor import LogitsProcessors
from vllm.v1.sample.metadata import SamplingMetadata
from vllm.v1.sample.rejection_sampler import rejection_sample

from vllm_dspine.verify import (
    generate_inv_exp,
    generate_uniform_probs,
    sparse_rejection_sample,
    sparse_to_dense_probs,
)
from vllm_dspine.verify.synthetic import random_problem

CPU = torch.device("cpu")


@pytest.fixture(scope="module", autouse=True)
def _vllm_cpu_kernels():
    CpuPlatform.import_kernels()
    CpuPlatform.register_triton_kernel_overrides()


def make_sampling_metadata(
    temperatures: list[float],
    generators: dict[int, torch.Generator],
) -> SamplingMetadata:
    """A SamplingMetadata with only temperature and generators set (no penalties,
    no top-k/top-p: `rejection_sample` receives already processed logits)."""
    num_reqs = len(temperatures)
    temperature = torch.tensor(temperatures, dtype=torch.float32)
    return SamplingMetadata(
        temperature=temperature,
        all_greedy=bool((temperature == 0).all()),
        all_random=bool((temperature != 0).all()),
        top_p=None,
        top_k=None,
        generators=generators,
        max_num_logprobs=None,
        no_penalties=True,
        prompt_token_ids=None,
        frequency_penalties=torch.zeros(num_reqs),
        presence_penalties=torch.zeros(num_reqs),
        repetition_penalties=torch.ones(num_reqs),
        output_token_ids=[[] for _ in range(num_reqs)],
        allowed_token_ids_mask=None,
        bad_words_token_ids={},
        logitsprocs=LogitsProcessors(),
    )


CASES = [
    # (num_draft_tokens, vocab_size, greedy every n-th request (0: none), top-k mask)
    pytest.param([15] * 8, 1000, 0, None, id="K15-V1000-random"),
    pytest.param([3, 0, 7, 1, 0, 15, 4, 15, 2, 9], 8193, 3, None, id="mixed-V8193"),
    pytest.param([5, 5, 0, 5, 2, 5] * 4, 500, 4, 20, id="topk20-masked-p"),
    pytest.param([15] * 4, 50, 2, None, id="V50-half-greedy"),
]


@pytest.mark.parametrize(
    "num_draft_tokens, vocab_size, greedy_every, top_k_mask", CASES
)
def test_sparse_equals_vllm_dense(
    num_draft_tokens, vocab_size, greedy_every, top_k_mask
):
    num_reqs = len(num_draft_tokens)
    max_spec_len = max(num_draft_tokens)
    prob = random_problem(
        num_draft_tokens, vocab_size, torch.Generator().manual_seed(vocab_size),
        num_pad=2, top_k_mask=top_k_mask,
    )
    dense_q = sparse_to_dense_probs(
        prob.draft_cand_ids, prob.draft_cand_probs, vocab_size
    )
    temperatures = [
        0.0 if greedy_every and i % greedy_every == 0 else 1.0 for i in range(num_reqs)
    ]
    is_greedy = torch.tensor(temperatures) == 0
    num_rejections = 0
    for trial in range(4):
        # Seeded requests (2 of 3) use their generator, the others the global RNG.
        seeds = {i: 1000 * trial + i for i in range(num_reqs) if i % 3 != 2}

        torch.manual_seed(trial)
        gens = {i: torch.Generator().manual_seed(s) for i, s in seeds.items()}
        dense_out = rejection_sample(
            prob.draft_token_ids.clone(), num_draft_tokens, max_spec_len,
            prob.cu_num_draft_tokens, dense_q, prob.target_logits.clone(),
            prob.bonus_token_ids, make_sampling_metadata(temperatures, gens),
        )

        torch.manual_seed(trial)
        gens = {i: torch.Generator().manual_seed(s) for i, s in seeds.items()}
        uniform = None
        inv_exp = None
        if not bool(is_greedy.all()):
            uniform = generate_uniform_probs(
                prob.draft_token_ids.shape[0], num_draft_tokens, gens, CPU
            )
            inv_exp = generate_inv_exp(num_draft_tokens, vocab_size, gens, CPU)
        sparse_out = sparse_rejection_sample(
            prob.draft_token_ids, num_draft_tokens, max_spec_len,
            prob.cu_num_draft_tokens, prob.draft_cand_ids, prob.draft_cand_probs,
            prob.target_probs, prob.bonus_token_ids,
            is_greedy if greedy_every else None,
            prob.target_logits.argmax(dim=-1), uniform, inv_exp,
        )
        assert torch.equal(sparse_out, dense_out), (trial, sparse_out, dense_out)
        num_drafts = torch.tensor(num_draft_tokens)
        emitted = (sparse_out >= 0).sum(dim=1)
        num_rejections += int((emitted <= num_drafts).sum())
    # The comparison covered the correction draw, not only accepted drafts.
    assert num_rejections >= 4
