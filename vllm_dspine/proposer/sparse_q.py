"""Carrying the sparse q from the proposer to verification through vLLM's model runner.

vLLM 0.32.0's runner already keeps a drafter's `take_last_draft_probs()` per request
id and, at the next step, gathers the rows of the requests that were scheduled with
drafts, in the new batch order, sliced to the number of drafts each got, and passes
them to `runner.rejection_sampler` as `draft_probs` [num_tokens, ...]. We use that
bookkeeping unchanged (no patch): the sparse q travels packed as one float64 tensor
`[num_reqs, K, 2k]` = ids (exact in float64) then probabilities, and the rejection
sampler we install unpacks it.
"""

from __future__ import annotations

import torch

from vllm_dspine.verify.sampler import SparseRejectionSampler


def pack_sparse_q(
    cand_ids: torch.Tensor,  # [num_reqs, K, k] int64
    cand_probs: torch.Tensor,  # [num_reqs, K, k] float32
) -> torch.Tensor:  # [num_reqs, K, 2k] float64
    return torch.cat([cand_ids.double(), cand_probs.double()], dim=-1).contiguous()


def unpack_sparse_q(packed: torch.Tensor  # [num_tokens, 2k] float64
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    k = packed.shape[-1] // 2
    return packed[:, :k].long().contiguous(), packed[:, k:].float().contiguous()


class DSpineRejectionSampler(SparseRejectionSampler):
    """The runner's rejection sampler while DSpine drafts.

    `draft_probs` is the packed sparse q the runner gathered for this step's drafts.
    When it is missing (vLLM found no cached q for some request with drafts, e.g. one
    it re-scheduled after preemption) the drafts get q = 0 everywhere: none is
    accepted and the first token is drawn from the target's p, which stays exact.
    """

    def forward(self, metadata, draft_probs, logits, sampling_metadata):
        num_tokens = metadata.draft_token_ids.shape[0]
        if draft_probs is not None and draft_probs.shape[0] == num_tokens:
            cand_ids, cand_probs = unpack_sparse_q(draft_probs)
        else:
            cand_ids = torch.full((num_tokens, 1), -1, dtype=torch.long,
                                  device=logits.device)
            cand_probs = torch.zeros((num_tokens, 1), dtype=torch.float32,
                                     device=logits.device)
        return super().forward(metadata, cand_ids, cand_probs, logits, sampling_metadata)
