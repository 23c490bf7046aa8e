"""Carrying the sparse q from the proposer to verification through vLLM's model runner.

vLLM 0.32.0's runner already keeps a drafter's `take_last_draft_probs()` per request
id and, at the next step, gathers the rows of the requests that were scheduled with
drafts, in the new batch order, sliced to the number of drafts each got, and passes
them to `runner.rejection_sampler` as `draft_probs` [num_tokens, ...]. We use that
bookkeeping unchanged (no patch): the sparse q travels packed as one float64 tensor
`[num_reqs, K, 2k]` = ids (exact in float64) then probabilities, and the rejection
sampler we install unpacks it.

One gap: when a single request with drafts has no cached q, vLLM's gather
(`GPUModelRunner._get_spec_decode_draft_probs`) returns None for the whole step. Given
the runner, `DSpineRejectionSampler` then redoes the gather itself from the runner's
cache, so only the request without q loses its drafts.
"""

from __future__ import annotations

import torch

from vllm.logger import init_logger

from vllm_dspine.verify.sampler import SparseRejectionSampler, samples_as_plain_decoding

logger = init_logger(__name__)


def pack_sparse_q(
    cand_ids: torch.Tensor,  # [num_reqs, K, k] int64
    cand_probs: torch.Tensor,  # [num_reqs, K, k] float32
) -> torch.Tensor:  # [num_reqs, K, 2k] float64
    return torch.cat([cand_ids.double(), cand_probs.double()], dim=-1).contiguous()


def unpack_sparse_q(packed: torch.Tensor  # [num_tokens, 2k] float64
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    k = packed.shape[-1] // 2
    return packed[:, :k].long().contiguous(), packed[:, k:].float().contiguous()


def gather_sparse_q_per_request(
    cached_q: torch.Tensor | None,  # [num_cached_reqs, K, 2k] packed, or None
    cached_req_ids: list[str] | None,  # [num_cached_reqs]
    req_ids: list[str],  # [num_reqs]  this step's batch order
    num_draft_tokens: list[int],  # [num_reqs]
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
    """vLLM's per-request gather, but a request without cached q gets q = 0 rows
    (ids -1, probabilities 0: its drafts are never accepted) instead of the whole
    step losing q.  -> cand_ids [num_tokens, k] int64, cand_probs [num_tokens, k]
    float32, the ids of the requests that had no q.

    E.g. cached for [a, b], step [b, c, a] with drafts [2, 3, 1] ->
    rows b0 b1, three q = 0 rows for c, a0.
    """
    k = cached_q.shape[-1] // 2 if cached_q is not None else 1
    row_of = {rid: i for i, rid in enumerate(cached_req_ids or [])}
    ids_parts: list[torch.Tensor] = []
    probs_parts: list[torch.Tensor] = []
    missing: list[str] = []
    for req_id, n in zip(req_ids, num_draft_tokens):
        if n == 0:
            continue
        row = row_of.get(req_id) if cached_q is not None else None
        if row is None or cached_q.shape[1] < n:
            missing.append(req_id)
            ids_parts.append(torch.full((n, k), -1, dtype=torch.long, device=device))
            probs_parts.append(torch.zeros((n, k), dtype=torch.float32, device=device))
            continue
        ids, probs = unpack_sparse_q(cached_q[row, :n].to(device))
        ids_parts.append(ids)
        probs_parts.append(probs)
    if not ids_parts:
        return (torch.empty((0, k), dtype=torch.long, device=device),
                torch.empty((0, k), dtype=torch.float32, device=device), missing)
    return torch.cat(ids_parts), torch.cat(probs_parts), missing


class DSpineRejectionSampler(SparseRejectionSampler):
    """The runner's rejection sampler while DSpine drafts.

    `draft_probs` is the packed sparse q the runner gathered for this step's drafts.
    When it is missing (vLLM found no cached q for some request with drafts, e.g. one
    it re-scheduled after preemption), the q of every request that has one is taken
    from the runner's cache (`runner` given) and only the requests without q get q = 0:
    none of their drafts is accepted and their first token is drawn from the target's
    p, which stays exact. Without a runner every request of such a step gets q = 0.
    """

    def __init__(self, sampler, spec_config=None, device=None, runner=None):
        super().__init__(sampler, spec_config, device)
        # The model runner whose `_draft_probs` / `_draft_prob_req_ids` cache and
        # `input_batch.req_ids` vLLM's own gather reads (plain attribute, not a module).
        self._runner = runner

    def _draft_q(self, metadata, draft_probs, device
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        num_tokens = metadata.draft_token_ids.shape[0]
        if draft_probs is not None and draft_probs.shape[0] == num_tokens:
            return unpack_sparse_q(draft_probs)
        runner = self._runner
        if runner is not None:
            cand_ids, cand_probs, missing = gather_sparse_q_per_request(
                getattr(runner, "_draft_probs", None),
                getattr(runner, "_draft_prob_req_ids", None),
                list(runner.input_batch.req_ids), list(metadata.num_draft_tokens), device)
            if cand_ids.shape[0] == num_tokens:
                if missing:
                    logger.debug("dspine: no sparse q for %d request(s) %s; their drafts "
                                 "are verified with q = 0", len(missing), missing[:8])
                return cand_ids, cand_probs
        return (torch.full((num_tokens, 1), -1, dtype=torch.long, device=device),
                torch.zeros((num_tokens, 1), dtype=torch.float32, device=device))

    def forward(self, metadata, draft_probs, logits, sampling_metadata):
        if samples_as_plain_decoding(metadata, sampling_metadata):  # needs no q
            return super().forward(metadata, None, None, logits, sampling_metadata)
        cand_ids, cand_probs = self._draft_q(metadata, draft_probs, logits.device)
        return super().forward(metadata, cand_ids, cand_probs, logits, sampling_metadata)
