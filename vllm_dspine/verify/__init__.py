"""Exact speculative sampling against the target with the drafter's sparse q.

Public pieces:
  * `SparseDraftProbs`: the retained draft distribution handed to verification.
  * `sparse_rejection_sample`: the sampler in vLLM's flattened layout (CUDA: Triton,
    CPU: the PyTorch reference), with `generate_uniform_probs` / `generate_inv_exp`
    drawing randomness exactly as vLLM 0.32.0's `rejection_sample` does.
  * `SparseRejectionSampler`: vLLM's `RejectionSampler` with a sparse q.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_dspine.verify.sampler import SparseRejectionSampler
from vllm_dspine.verify.sparse_rejection import sparse_rejection_sample
from vllm_dspine.verify.sparse_rejection_ref import (
    generate_inv_exp,
    generate_uniform_probs,
    sparse_rejection_sample_ref,
    sparse_to_dense_probs,
)


@dataclass
class SparseDraftProbs:
    """The distribution each draft token was drawn from, kept sparse (docs/design.md 1.5).

    Row i belongs to draft token i of vLLM's flattened batch. The ids of a row are
    distinct; -1 pads a row with fewer candidates (its probability is 0); the
    probabilities of a row sum to 1. q(v) = the probability of v if v is an id of the
    row, else 0.
    """

    cand_ids: torch.Tensor  # [num_tokens, topk] int64
    cand_probs: torch.Tensor  # [num_tokens, topk] float32

    def __post_init__(self) -> None:
        if self.cand_ids.ndim != 2 or self.cand_ids.shape != self.cand_probs.shape:
            raise ValueError(
                f"cand_ids {tuple(self.cand_ids.shape)} and cand_probs "
                f"{tuple(self.cand_probs.shape)} must both be [num_tokens, topk]."
            )
        if self.cand_ids.dtype != torch.int64 or self.cand_probs.dtype != torch.float32:
            raise ValueError(
                f"cand_ids must be int64 and cand_probs float32, got "
                f"{self.cand_ids.dtype} and {self.cand_probs.dtype}; convert them."
            )

    @property
    def num_tokens(self) -> int:
        return self.cand_ids.shape[0]

    @property
    def topk(self) -> int:
        return self.cand_ids.shape[1]

    @classmethod
    def from_padded(
        cls,
        cand_ids: torch.Tensor,  # [num_reqs, K, topk] int64
        cand_probs: torch.Tensor,  # [num_reqs, K, topk] float32
        num_draft_tokens: list[int],  # [num_reqs], each <= K
    ) -> "SparseDraftProbs":
        """Flatten per-request padded rows (e.g. `SparseProposal.cand_ids`) into
        vLLM's layout, keeping the first num_draft_tokens[r] rows of request r.
        E.g. K 3, num_draft_tokens [2, 0, 3] -> rows (0,0) (0,1) (2,0) (2,1) (2,2)."""
        num_reqs, k = cand_ids.shape[:2]
        if len(num_draft_tokens) != num_reqs or max(num_draft_tokens, default=0) > k:
            raise ValueError(
                f"num_draft_tokens {num_draft_tokens} must give one count <= {k} per "
                f"request ({num_reqs})."
            )
        counts = torch.tensor(num_draft_tokens, device=cand_ids.device)
        keep = torch.arange(k, device=cand_ids.device)[None, :] < counts[:, None]
        return cls(cand_ids[keep], cand_probs[keep])

    def to_dense(self, vocab_size: int) -> torch.Tensor:
        """q scattered over the vocabulary: [num_tokens, vocab_size] float32."""
        return sparse_to_dense_probs(self.cand_ids, self.cand_probs, vocab_size)


__all__ = [
    "SparseDraftProbs",
    "SparseRejectionSampler",
    "generate_inv_exp",
    "generate_uniform_probs",
    "sparse_rejection_sample",
    "sparse_rejection_sample_ref",
    "sparse_to_dense_probs",
]
