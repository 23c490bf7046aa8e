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

What the policy reads besides the drafts: the match length and where the continuation
is copied from (the prompt, or the answer so far: `num_prompt_tokens` of vLLM's batch),
which the lookup's own calibrator (`LookupCalibrator`, separate from the drafter's) maps
to an acceptance per draft position: a bin per (where, match length), each with its
starting guesses from an exact offline walk (`LOOKUP_START`, docs/lookup.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from vllm_dspine.proposer.calibration import AcceptanceCalibrator
from vllm_dspine.proposer.corpus_lookup import MAX_N as CORPUS_MAX_N
from vllm_dspine.proposer.corpus_lookup import CorpusIndex

# Where a continuation is copied from: its first token lies in the prompt, or in the
# answer so far, or it comes from the corpus lookup (`corpus_lookup.py`).
IN_PROMPT, IN_ANSWER, IN_CORPUS = 0, 1, 2
WHERES = 3
# Match lengths with a bin of their own: 1, 2, 3, 4, >= 5 tokens (the corpus's: 2, 3,
# 4-5, 6-7, 8, `_corpus_length_bin`).
MATCH_LENGTHS = 5

# The starting guesses of the lookup's calibrator: [where (IN_PROMPT, IN_ANSWER, IN_CORPUS), match
# length 1..>=5, draft position group (draft 1, 2-3, 4-7, 8-15, 16-)], the acceptance of
# a draft given the earlier ones were accepted, from the exact offline walk of the
# lookup (docs/lookup.md "Where the match lies"): greedy verification accepts a draft iff
# it is the target's argmax, so on plain's greedy answers (8 chat + 8 HumanEval prompts,
# 128 tokens, min_n 2 / max_n 4) every step's accepted length is known. Pooled over both
# workloads; where a (where, length, group) had fewer than 15 tested drafts (lengths 1,
# 3 and >= 5), the where's figure over all lengths; drafts 16- as 8-15. The same for
# greedy and sampled requests (the walk is greedy); observations then replace them.
LOOKUP_START = np.array([
    [[0.52, 0.78, 0.82, 0.91, 0.91],  # in the prompt, match length 1
     [0.42, 0.75, 0.82, 0.94, 0.94],  # 2
     [0.52, 0.78, 0.82, 0.91, 0.91],  # 3
     [0.94, 0.84, 0.80, 0.87, 0.87],  # 4
     [0.52, 0.78, 0.82, 0.91, 0.91]],  # >= 5
    [[0.58, 0.73, 0.91, 0.96, 0.96],  # in the answer, match length 1
     [0.51, 0.68, 0.83, 0.93, 0.93],  # 2
     [0.58, 0.73, 0.91, 0.96, 0.96],  # 3
     [0.79, 0.80, 0.98, 0.98, 0.98],  # 4
     [0.58, 0.73, 0.91, 0.96, 0.96]],  # >= 5
    # The corpus lookup, by its own match-length bins (2, 3, 4-5, 6-7, 8): the same
    # kind of walk over held-out target answers (`python bench/corpus_walk.py`: the
    # SmolLM2 corpus's last shard, its 384 temperature-0 answers; the index built from
    # the other 14 shards), counted where the rule of `PromptLookup.propose` takes the
    # corpus's drafts (docs/lookup.md "The corpus lookup"); lengths 2-5, which that rule
    # does not propose (CORPUS_MIN_MATCH), from the walk with `--min-match 2`. No
    # benchmark prompt.
    [[0.30, 0.41, 0.50, 0.75, 0.75],  # from the corpus, match length 2
     [0.43, 0.46, 0.57, 0.75, 0.75],  # 3
     [0.48, 0.51, 0.62, 0.76, 0.76],  # 4-5
     [0.54, 0.59, 0.67, 0.78, 0.78],  # 6-7
     [0.61, 0.67, 0.79, 0.91, 0.91]],  # 8
])


# The shortest corpus match whose continuation is proposed. The drafter learned the
# corpus's short-range statistics; a short match adds little it does not know and takes
# request-steps from it: on the benchmark's chat prompts with every corpus match from 2
# tokens, DSpine committed 1.84 tokens a step against 2.00 without the corpus
# (docs/benchmarks.md `bench_e2e_corpus_c1`); on held-out answers a first draft from a
# 2-token match was accepted 0.30 of the time, from 6-7 tokens 0.54 (`python
# bench/corpus_walk.py --min-match 2`; the drafter's, served on chat: 0.45-0.57).
CORPUS_MIN_MATCH = 6


def _corpus_length_bin(match_len: int) -> int:
    return {2: 0, 3: 1, 4: 2, 5: 2, 6: 3, 7: 3}.get(int(match_len), 0 if match_len < 2 else 4)


def lookup_feature(match_len: int, where: int) -> float:
    """The value a lookup draft carries in `LookupBatch.conf`: the centre of its bin of
    `LookupCalibrator.EDGES`, one bin per (where, match length)."""
    if where == IN_CORPUS:
        length = _corpus_length_bin(match_len)
    else:
        length = min(max(int(match_len), 1), MATCH_LENGTHS) - 1
    return (int(where) * MATCH_LENGTHS + length + 0.5) / (WHERES * MATCH_LENGTHS)


class LookupCalibrator(AcceptanceCalibrator):
    """The lookup's acceptance per (kind, draft position group, where, match length):
    `AcceptanceCalibrator` with a bin per `lookup_feature` value, each starting from its
    `LOOKUP_START` guess, and a bin with few observations leaning on what was observed
    over the bins of its own where (a match into the prompt never borrows the answer's
    acceptance, nor the reverse)."""

    EDGES = np.linspace(0.0, 1.0, WHERES * MATCH_LENGTHS + 1)
    POOLS = WHERES  # IN_PROMPT's bins, then IN_ANSWER's, then IN_CORPUS's

    def __init__(self, num_positions: int) -> None:
        super().__init__(num_positions)
        # [where, length, group] -> [group, bin], for both kinds.
        start = LOOKUP_START.reshape(WHERES * MATCH_LENGTHS, -1).T
        self._prior = np.broadcast_to(start, self._prior.shape).copy()
        self._pooled = self._pooled_prior()


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
    [R], the calibrator's feature per draft [R, K] (`lookup_feature`; 0 past each
    length), which requests' drafts the corpus lookup gave."""

    drafts: np.ndarray
    lengths: np.ndarray
    conf: np.ndarray
    # [R] bool: the drafts come from the corpus lookup (counted apart in the step profile).
    from_corpus: np.ndarray | None = None

    @property
    def any(self) -> bool:
        return bool((self.lengths > 0).any())


class PromptLookup:
    """Per request, the lookup continuation of its context (prompt + output + the
    tokens this step committed), at most `cap` drafts; with a `corpus`, the corpus
    lookup's continuation (from a CORPUS_MIN_MATCH-token match) where the context has
    none, or where the corpus matches its longest suffix (`corpus_lookup.MAX_N` tokens,
    the corpus's most accepted bin in bench/corpus_walk.py; this order was not compared
    served with others, docs/lookup.md)."""

    def __init__(self, min_n: int, max_n: int, num_proposals: int,
                 corpus: CorpusIndex | None = None) -> None:
        assert 1 <= min_n <= max_n, (min_n, max_n)
        self.min_n, self.max_n, self.K = int(min_n), int(max_n), int(num_proposals)
        self.corpus = corpus
        # numba compiles the matcher on its first call (~1 s): here, not in a step.
        longest_match_continuation(np.array([1, 2, 1, 2, 1], dtype=np.int32),
                                   self.min_n, self.max_n)

    def propose(self, contexts: list[np.ndarray | None], caps: np.ndarray,
                prompt_lens: np.ndarray) -> LookupBatch:
        """contexts[i]: request i's tokens (int32), None for no lookup; caps [R];
        prompt_lens [R]: how many of each context's tokens are its prompt (a
        continuation whose first token lies before that is copied from the prompt)."""
        R, K = len(contexts), self.K
        drafts = np.full((R, K), -1, dtype=np.int64)
        lengths = np.zeros(R, dtype=np.int64)
        conf = np.zeros((R, K), dtype=np.float64)
        from_corpus = np.zeros(R, dtype=bool)
        for i, ctx in enumerate(contexts):
            cap = min(int(caps[i]), K)
            if ctx is None or cap <= 0:
                continue
            rest, m = longest_match_continuation(ctx, self.min_n, self.max_n)
            start = int(ctx.shape[0]) - int(rest.shape[0])
            where = IN_PROMPT if start < int(prompt_lens[i]) else IN_ANSWER
            if self.corpus is not None:
                # Matched for every request (microseconds); voted only where taken.
                cm, lo, hi = self.corpus.match(ctx)
                if cm >= CORPUS_MIN_MATCH and (cm >= CORPUS_MAX_N or rest.shape[0] == 0):
                    found = self.corpus.vote(lo, hi, cap)
                    if found.shape[0]:
                        rest, m, where = found, cm, IN_CORPUS
            n = min(cap, int(rest.shape[0]))
            if n <= 0:
                continue
            drafts[i, :n] = rest[:n]
            lengths[i] = n
            conf[i, :n] = lookup_feature(m, where)
            from_corpus[i] = where == IN_CORPUS
        return LookupBatch(drafts, lengths, conf, from_corpus)


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
