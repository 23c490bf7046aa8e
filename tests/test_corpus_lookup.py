"""The corpus lookup (`vllm_dspine/proposer/corpus_lookup.py`, docs/lookup.md "The corpus
lookup"): its index against a brute-force scan of the corpus, the rule that takes its
drafts in `PromptLookup`, its calibrator bins, the file it is stored in, and the option
that names it. No engine (tests/test_lookup_engine.py serves it through vLLM)."""

from __future__ import annotations

import collections

import numpy as np
import pytest

from vllm_dspine.model.lookup_corpus import write_lookup_corpus
from vllm_dspine.proposer.corpus_lookup import MAX_N, MAX_VOTERS, MIN_N, CorpusIndex
from vllm_dspine.proposer.lookup import (
    CORPUS_MIN_MATCH,
    IN_ANSWER,
    IN_CORPUS,
    IN_PROMPT,
    LOOKUP_START,
    LookupCalibrator,
    PromptLookup,
    lookup_feature,
)

K = 15


def _reference_continuation(answers: list[list[int]], context: list[int], k: int):
    """The longest suffix (MIN_N..MAX_N tokens) of `context` found inside one answer, by
    scanning every answer; the continuation voted token by token over every occurrence
    (ties: the smaller id; the end of an answer votes for stopping)."""
    for n in range(min(MAX_N, len(context)), MIN_N - 1, -1):
        suffix = context[-n:]
        starts = [(a, j + n) for a in range(len(answers)) for j in range(len(answers[a]) - n + 1)
                  if answers[a][j:j + n] == suffix]
        if not starts:
            continue
        out = []
        for d in range(k):
            nxt = [answers[a][p + d] if p + d < len(answers[a]) else None for a, p in starts]
            votes = collections.Counter(nxt)
            best = max(votes.values())
            # The separator is the largest id: it wins a tie only against nothing.
            tok = min((t for t in votes if votes[t] == best),
                      key=lambda t: float("inf") if t is None else t)
            if tok is None:
                break
            out.append(tok)
            starts = [s for s, t in zip(starts, nxt) if t == tok]
        return out, n
    return [], 0


@pytest.mark.parametrize("vocab,dtype_ids", [(5, 0), (9, 0), (70000, 1)])
def test_the_index_finds_what_a_scan_of_the_corpus_finds(tmp_path, vocab, dtype_ids):
    """Random answers over small vocabularies (many matches of every length, matches that
    would cross an answer's end) and ids past uint16 (stored as int32): the longest
    suffix match and the voted continuation equal the brute-force scan's, for contexts
    cut from the answers and random ones. Matches never run across two answers."""
    rng = np.random.default_rng(vocab)
    small = max(vocab, 2) if vocab < 100 else 6
    offset = 0 if vocab < 100 else 65530  # ids 65530..65535: past uint16's separator
    answers = [(rng.integers(0, small, size=int(rng.integers(1, 40))) + offset).tolist()
               for _ in range(30)]
    path = str(tmp_path / "c.npz")
    rec = write_lookup_corpus([np.array(a) for a in answers], path)
    assert rec == {"answers": 30, "tokens": sum(map(len, answers))}
    index = CorpusIndex.load(path)
    assert index.tokens.dtype == (np.int32 if dtype_ids else np.uint16)
    assert index.num_tokens == sum(map(len, answers))
    contexts = [answers[i][:j] for i in range(10) for j in (1, 3, 7, 20)]
    contexts += [(rng.integers(0, small, size=12) + offset).tolist() for _ in range(20)]
    for ctx in contexts:
        got, n = index.continuation(np.array(ctx, dtype=np.int64), K)
        want, wn = _reference_continuation(answers, ctx, K)
        assert (got.tolist(), n) == (want, wn), ctx


def test_common_suffixes_are_voted_over_a_bounded_sample():
    """A suffix with more occurrences than MAX_VOTERS votes over MAX_VOTERS of them, evenly
    spread: 600 answers `1 2 x`, x = 7 in two thirds; the continuation of `1 2` is 7."""
    answers = [np.array([1, 2, 7 if i % 3 else 8]) for i in range(600)]
    index = CorpusIndex(np.concatenate([np.append(a, 65535) for a in answers]).astype(np.uint16))
    n, lo, hi = index.match(np.array([5, 1, 2]))
    assert (n, hi - lo) == (2, 600) and hi - lo > MAX_VOTERS
    got, m = index.continuation(np.array([5, 1, 2]), K)
    assert got.tolist() == [7] and m == 2
    # One-token matches are not proposed (MIN_N = 2), nor ids outside the corpus's range.
    assert index.continuation(np.array([9, 2]), K)[0].size == 0
    assert index.continuation(np.array([70000, 1, 2]), K)[0].tolist() == [7]


def test_the_lookup_takes_the_corpus_where_the_context_has_no_match_or_it_matches_longest():
    """PromptLookup with a corpus: the context's own continuation first; the corpus's
    where the context has none (from a CORPUS_MIN_MATCH-token match), or where the corpus
    matches MAX_N tokens; the drafts carry the corpus's calibrator feature and are marked
    from_corpus."""
    phrase = [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50]
    index = CorpusIndex(np.array(phrase + [65535, 30, 31, 32, 33, 34, 35, 36, 65535],
                                 dtype=np.uint16))
    lk = PromptLookup(2, 4, K, corpus=index)
    assert CORPUS_MIN_MATCH == 6 < MAX_N
    # No match in the context: the corpus's continuation of `30 .. 35` (match 6) ...
    b = lk.propose([np.array([9, 30, 31, 32, 33, 34, 35], dtype=np.int32)], np.array([K]),
                   np.array([1]))
    assert b.drafts[0, :1].tolist() == [36] and b.lengths[0] == 1 and b.from_corpus[0]
    assert b.conf[0, 0] == lookup_feature(6, IN_CORPUS)
    # ... but not of a 5-token match: too short to propose.
    b = lk.propose([np.array([9, 31, 32, 33, 34, 35], dtype=np.int32)], np.array([K]),
                   np.array([1]))
    assert b.lengths[0] == 0 and not b.from_corpus[0]
    assert index.continuation(np.array([31, 32, 33, 34, 35]), K)[0].tolist() == [36]
    # The context ends with 7 corpus tokens whose last two open it (a match into the
    # prompt): its own continuation wins over a corpus match shorter than MAX_N.
    own = np.array([phrase[5], phrase[6], 7, 8, 1] + phrase[:7], dtype=np.int32)
    b = lk.propose([own], np.array([K]), np.array([5]))
    assert index.match(own)[0] == 7 and not b.from_corpus[0]
    assert b.drafts[0, :3].tolist() == [7, 8, 1]
    assert b.conf[0, 0] == lookup_feature(2, IN_PROMPT)
    # Ending with MAX_N corpus tokens (and an own match `42 43` earlier): the corpus's.
    ctx = np.array([42, 43, 1] + phrase[:MAX_N], dtype=np.int32)
    b = lk.propose([ctx], np.array([K]), np.array([3]))
    assert b.from_corpus[0] and b.drafts[0, :3].tolist() == phrase[MAX_N:]
    assert b.conf[0, 0] == lookup_feature(MAX_N, IN_CORPUS)
    # The cap holds for the corpus's drafts too.
    b = lk.propose([ctx], np.array([1]), np.array([3]))
    assert b.lengths[0] == 1 and (b.drafts[0, 1:] == -1).all()


def test_corpus_matches_are_calibrated_apart():
    """The corpus's matches have bins of their own (match lengths 2, 3, 4-5, 6-7, 8),
    starting from LOOKUP_START's corpus rows, apart from the prompt's and the answer's."""
    cal = LookupCalibrator(K)
    feats = [lookup_feature(n, IN_CORPUS) for n in (2, 3, 4, 5, 6, 7, 8)]
    bins = cal._bin(np.array(feats))
    assert bins.tolist() == [10, 11, 12, 12, 13, 13, 14]
    others = cal._bin(np.array([lookup_feature(n, w) for n in range(1, 6)
                                for w in (IN_PROMPT, IN_ANSWER)]))
    assert set(others.tolist()).isdisjoint(bins.tolist())
    start = cal.predict(np.array([np.full(K, f) for f in feats]), np.ones(len(feats), bool))
    for row, b in zip(start, (0, 1, 2, 2, 3, 3, 4)):
        assert np.allclose(row[[0, 1, 3, 7]], LOOKUP_START[IN_CORPUS, b, :4])


def test_the_corpus_option_is_checked():
    from vllm_dspine.plugin.options import split_dspine_options

    base = {"method": "dspine", "model": "d", "num_speculative_tokens": 15}
    for ok in (True, False, "/some/file.npz"):
        assert split_dspine_options({**base, "dspine_lookup_corpus": ok})[1] == {
            "dspine_lookup_corpus": ok}
    for bad in ("", 1, None, ["a"]):
        with pytest.raises(ValueError, match="dspine_lookup_corpus"):
            split_dspine_options({**base, "dspine_lookup_corpus": bad})


def test_a_file_that_is_not_a_lookup_corpus_is_named(tmp_path):
    path = tmp_path / "x.npz"
    np.savez(path, other=np.zeros(3))
    with pytest.raises(ValueError, match="is not a DSpine lookup corpus"):
        CorpusIndex.load(str(path))


def test_the_command_writes_the_answers_of_a_corpus(tmp_path):
    """`python -m vllm_dspine.train.lookup_corpus`: the answers (not the prompts) of a
    corpus folder's shards, in order; a folder without shards is named."""
    from vllm_dspine.train import corpus as C
    from vllm_dspine.train.lookup_corpus import main

    folder = str(tmp_path / "corpus")
    import os
    os.makedirs(folder)
    manifest = C.read_manifest(folder)
    seqs = [[1, 2, 3, 10, 11, 12, 13], [4, 5, 20, 21]]
    manifest["shards"].append(C.write_shard(folder, "shard-00000.npz", seqs, [3, 2],
                                            ["self", "docs"], ["a#1", "b#2"], [0.0, 0.7],
                                            vocab_size=100))
    C._write_manifest(folder, manifest)
    out = str(tmp_path / "lookup_corpus.npz")
    assert main(["--corpus", folder, "--out", out]) == 0
    index = CorpusIndex.load(out)
    assert index.num_tokens == 6
    assert index.continuation(np.array([10, 11]), K)[0].tolist() == [12, 13]
    assert index.continuation(np.array([2, 3]), K)[0].size == 0  # a prompt's: not kept
    assert main(["--corpus", str(tmp_path / "empty"), "--out", out]) == 1
