"""The sparse proposal the drafter hands to verification (docs/design.md section 1.5-1.6).

    R = num_reqs, K = drafts per request (block_size - 1), k = head_topk (16).

For every draft position the verifier needs the drafted token, the candidate ids and
the probabilities of the distribution the token was actually drawn from (`draft_probs`
in the verifier's words). On its way to verification vLLM's runner gathers it per request
into `[num_tokens, ...]` rows (`proposer/sparse_q.py`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SparseProposal:
    """One cycle's drafts with their sparse draft distributions.

    Greedy rows (temperature 0) carry a one-hot `cand_probs` at the chosen candidate.
    Sampled rows carry the filtered, renormalised 16-way distribution `q_t(. | v_{t-1})`
    the draft was drawn from; it sums to 1 and is > 0 at the drafted candidate.
    """

    draft_token_ids: torch.Tensor  # [R, K] int64
    cand_ids: torch.Tensor  # [R, K, k] int64
    cand_probs: torch.Tensor  # [R, K, k] float32

    def __post_init__(self) -> None:
        R, K = self.draft_token_ids.shape
        assert self.cand_ids.shape[:2] == (R, K), (self.cand_ids.shape, (R, K))
        assert self.cand_probs.shape == self.cand_ids.shape, (
            self.cand_probs.shape, self.cand_ids.shape)
        assert self.draft_token_ids.dtype == torch.int64
        assert self.cand_ids.dtype == torch.int64
        assert self.cand_probs.dtype == torch.float32

    @property
    def num_reqs(self) -> int:
        return self.draft_token_ids.shape[0]

    @property
    def num_drafts(self) -> int:
        return self.draft_token_ids.shape[1]

    @property
    def head_topk(self) -> int:
        return self.cand_ids.shape[2]
