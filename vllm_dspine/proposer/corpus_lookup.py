"""The corpus lookup (`dspine_lookup_corpus`, docs/lookup.md "The corpus lookup"): drafts
copied from the target's own answers in the drafter's distillation corpus, a third source
beside the prompt lookup (`lookup.py`) and the drafter's block.

A drafter trained on the corpus predicts its frequent continuations but loses them within
a few positions (on SmolLM2, acceptance ~0 past draft 4); the target repeats whole phrases
of its own answers ("Here are some tips", the shape of a docstring, a common idiom) for
many tokens. The lookup finds the longest suffix of a request's context, 2 to 8 tokens
(served from 6: `lookup.CORPUS_MIN_MATCH`), that occurs in the corpus, and proposes the
continuation most of those occurrences share, token by token (at each position the token
most of the still-agreeing occurrences have next). Deterministic given the context and
the corpus, so its drafts are verified with q = 1 at the drafted token, like the prompt
lookup's (`lookup_sparse_q`): exact.

    N = the corpus's tokens (answers, each followed by a separator), MAX_N = 8.

The index: every position p that follows a corpus token, sorted by the tokens before it,
most recent first (corpus[p-1], then corpus[p-2], ...; a sequence boundary is a separator
that no context token equals); `_before[n][j]` is the n-th token before the j-th sorted
position. Matching a context's last tokens one by one narrows a range of that order with
two binary searches a token, O(MAX_N log N); the vote then reads at most MAX_VOTERS
continuations a draft. Memory: the corpus, the order and MAX_N columns, ~(2 + 4 + 8 x 2)
bytes a token for a vocabulary under 65,535 (~35 MB for SmolLM2's 1.6M answer tokens),
built at load (0.3-0.4 s for those on one core; a lookup, match and vote, 29 us on
average and 148 us at the 99th percentile over `python bench/corpus_walk.py`'s steps).
"""

from __future__ import annotations

import numpy as np

from vllm_dspine.model.lookup_corpus import read_lookup_corpus

# The longest suffix matched, and the shortest a continuation is proposed for.
MAX_N, MIN_N = 8, 2
# Occurrences a continuation is voted over (evenly spaced over the matched range): the
# vote's cost per request stays bounded however common the suffix.
MAX_VOTERS = 256


class CorpusIndex:
    """The longest-suffix index of one lookup corpus (module doc)."""

    def __init__(self, tokens: np.ndarray) -> None:
        if tokens.dtype not in (np.uint16, np.int32):
            raise ValueError(f"a lookup corpus holds uint16 or int32 token ids, not {tokens.dtype}")
        self.sep = np.iinfo(tokens.dtype).max
        # A separator at the end: every continuation stops before the end of the array.
        if tokens.shape[0] == 0 or tokens[-1] != self.sep:
            tokens = np.append(tokens, np.array([self.sep], dtype=tokens.dtype))
        self.tokens = tokens  # [N]
        N = tokens.shape[0]
        # [N - 1] positions that follow a corpus token (not a separator).
        pos = np.nonzero(tokens[:-1] != self.sep)[0] + 1
        # before[n][p] = the n-th token before p, the separator past a boundary.
        cols = []
        valid = np.ones(pos.shape[0], dtype=bool)
        for n in range(1, MAX_N + 1):
            src = pos - n
            col = np.full(pos.shape[0], self.sep, dtype=tokens.dtype)
            ok = valid & (src >= 0)
            col[ok] = tokens[src[ok]]
            valid = ok & (col != self.sep)
            col[~valid] = self.sep
            cols.append(col)
        # lexsort: the last key is the primary one (the token just before p).
        order = np.lexsort([pos] + cols[::-1])
        self.pos = pos[order].astype(np.int64 if N > np.iinfo(np.int32).max else np.int32)
        self._before = [c[order] for c in cols]  # [MAX_N] x [len(pos)]

    @classmethod
    def load(cls, path: str) -> "CorpusIndex":
        return cls(read_lookup_corpus(path))

    @property
    def num_tokens(self) -> int:
        return int(self.pos.shape[0])

    def match(self, context: np.ndarray) -> tuple[int, int, int]:
        """(match length n, lo, hi): the longest suffix of `context` (at most MAX_N
        tokens) that occurs in the corpus, and the range of sorted positions following
        it; n = 0 without one."""
        lo, hi, n = 0, self.pos.shape[0], 0
        for j in range(1, min(MAX_N, int(context.shape[0])) + 1):
            t = int(context[-j])
            if t < 0 or t >= self.sep:
                break
            col = self._before[j - 1][lo:hi]
            # In the column's own dtype: a Python int would make numpy cast the slice.
            key = col.dtype.type(t)
            a = lo + int(np.searchsorted(col, key, side="left"))
            b = lo + int(np.searchsorted(col, key, side="right"))
            if a == b:
                break
            lo, hi, n = a, b, j
        return n, lo, hi

    def continuation(self, context: np.ndarray, k: int, min_n: int = MIN_N
                     ) -> tuple[np.ndarray, int]:
        """(at most k drafts, the match length) for the longest suffix match of at least
        `min_n` tokens; (empty, 0) without one: `match`, then `vote`."""
        n, lo, hi = self.match(context)
        if n < max(min_n, MIN_N):
            return np.zeros(0, dtype=np.int64), 0
        return self.vote(lo, hi, k), n

    def vote(self, lo: int, hi: int, k: int) -> np.ndarray:
        """At most k drafts continuing the sorted positions lo..hi (a `match` range):
        each the token most of the occurrences that agreed so far have next (ties: the
        smaller id), over at most MAX_VOTERS of them."""
        if k <= 0:
            return np.zeros(0, dtype=np.int64)
        count = hi - lo
        pick = lo + (np.arange(MAX_VOTERS) * count) // MAX_VOTERS if count > MAX_VOTERS \
            else np.arange(lo, hi)
        at = self.pos[pick].astype(np.int64)  # [voters] where each continuation starts
        out = []
        for d in range(k):
            nxt = self.tokens[at + d]
            if (nxt == nxt[0]).all():  # unanimous (most steps of a long match)
                tok = nxt[0]
            else:
                ids, votes = np.unique(nxt, return_counts=True)
                tok = ids[int(np.argmax(votes))]
            if tok == self.sep:
                break
            out.append(int(tok))
            at = at[nxt == tok]
        return np.asarray(out, dtype=np.int64)
