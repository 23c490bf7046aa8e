"""Prompt lookup inside the DSpine proposal (`dspine_lookup`, docs/lookup.md): the
continuation that a suffix match in the request's own prompt and output proposes, as
vLLM's ngram method finds it, offered to the dynamic-verification policy (`dynamic.py`)
as a second source of drafts beside the drafter's block.

    R requests, K = the block's 15 drafts.

The match is vLLM's own (`_find_longest_matched_ngram_and_propose_tokens` of
`vllm/v1/spec_decode/ngram_proposer.py`, the numba KMP its ngram method runs): the
longest suffix of the context, of `min_n .. max_n` tokens, that occurred earlier, the
earliest such occurrence (vLLM's scan keeps the first position where the longest match
is found: in an answer repeating itself the continuation runs from the first repetition,
`tests/test_lookup_policy.py::test_the_continuation_follows_the_earliest_occurrence`);
the drafts are the tokens that followed it. The lookup is
deterministic given the context, so its drafts reach verification with q = 1 at the
drafted token (`lookup_sparse_q`): accepted with probability p(d), the correction drawn
from p without d, exact speculative sampling like any other q.

What the policy reads besides the drafts: the match length, which the lookup's own
`AcceptanceCalibrator` (separate from the drafter's) maps to an acceptance per draft
position, through the confidence `LOOKUP_CONFIDENCE` gives each length (a bin per
length, and its starting guess).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

# The calibrator's confidence of a lookup draft by match length (1, 2, 3, 4, >= 5
# tokens): each length a bin of its own in `AcceptanceCalibrator.EDGES`, and the bin's
# centre its starting guess, which observed acceptance then replaces.
LOOKUP_CONFIDENCE = (0.45, 0.55, 0.65, 0.75, 0.85)


def lookup_confidence(match_len: int) -> float:
    return LOOKUP_CONFIDENCE[min(max(match_len, 1), len(LOOKUP_CONFIDENCE)) - 1]


def _matcher():
    from vllm.v1.spec_decode.ngram_proposer import (
        _find_longest_matched_ngram_and_propose_tokens,
    )

    return _find_longest_matched_ngram_and_propose_tokens


def longest_match_continuation(context: np.ndarray, min_n: int, max_n: int
                               ) -> tuple[np.ndarray, int]:
    """(everything that followed the match in `context`, the match length) for vLLM's
    longest suffix match of min_n..max_n tokens; (empty, 0) without one.

    vLLM's matcher returns only the tokens after the match (at most k of them); asked
    for all of them (k = len(context)), their count gives where the match ended, and
    the match length is read off the context there (capped at max_n, as the matcher's)."""
    total = int(context.shape[0])
    if total < max(min_n, 2):
        return context[:0], 0
    rest = _matcher()(context, min_n, max_n, 2 * total + 1, total)
    if rest.shape[0] == 0:
        return rest, 0
    start = total - int(rest.shape[0])
    m = 0
    while m < max_n and start - 1 - m >= 0 and context[start - 1 - m] == context[total - 1 - m]:
        m += 1
    return rest, m


@dataclass
class LookupBatch:
    """One step's lookup proposals: drafts [R, K] int64 (-1 past each length), lengths
    [R], the calibrator's confidence per draft [R, K] (0 past each length)."""

    drafts: np.ndarray
    lengths: np.ndarray
    conf: np.ndarray

    @property
    def any(self) -> bool:
        return bool((self.lengths > 0).any())


class PromptLookup:
    """Per request, the lookup continuation of its context (prompt + output + the
    tokens this step committed), at most `cap` drafts."""

    def __init__(self, min_n: int, max_n: int, num_proposals: int) -> None:
        assert 1 <= min_n <= max_n, (min_n, max_n)
        self.min_n, self.max_n, self.K = int(min_n), int(max_n), int(num_proposals)
        # numba compiles the matcher on its first call (~1 s): here, not in a step.
        longest_match_continuation(np.array([1, 2, 1, 2, 1], dtype=np.int32),
                                   self.min_n, self.max_n)

    def propose(self, contexts: list[np.ndarray | None], caps: np.ndarray) -> LookupBatch:
        """contexts[i]: request i's tokens (int32), None for no lookup; caps [R]."""
        R, K = len(contexts), self.K
        drafts = np.full((R, K), -1, dtype=np.int64)
        lengths = np.zeros(R, dtype=np.int64)
        conf = np.zeros((R, K), dtype=np.float64)
        for i, ctx in enumerate(contexts):
            cap = min(int(caps[i]), K)
            if ctx is None or cap <= 0:
                continue
            rest, m = longest_match_continuation(ctx, self.min_n, self.max_n)
            n = min(cap, int(rest.shape[0]))
            if n <= 0:
                continue
            drafts[i, :n] = rest[:n]
            lengths[i] = n
            conf[i, :n] = lookup_confidence(m)
        return LookupBatch(drafts, lengths, conf)


def lookup_sparse_q(drafts: torch.Tensor,  # [n, K'] int64, the lookup's drafts (-1 pad)
                    head_topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The q a lookup draft was proposed with: probability 1 at the drafted token.
    -> cand_ids [n, K', k] (the draft, then -1 padding), cand_probs [n, K', k]."""
    n, K = drafts.shape
    ids = torch.full((n, K, head_topk), -1, dtype=torch.int64, device=drafts.device)
    probs = torch.zeros((n, K, head_topk), dtype=torch.float32, device=drafts.device)
    ids[:, :, 0] = drafts
    probs[:, :, 0] = (drafts >= 0).float()
    return ids, probs
