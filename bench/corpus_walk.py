"""The corpus lookup offline (docs/lookup.md "The corpus lookup"): an exact greedy walk
over held-out target answers, with and without the corpus lookup, and the acceptance of
the corpus's drafts per match-length bin and draft position group (the starting guesses
of `LOOKUP_START`'s corpus rows, vllm_dspine/proposer/lookup.py).

Held out: the corpus's last shard; the index is built from the others. The answers are
the target's own (greedy ones only: greedy verification accepts a draft iff it is the
target's argmax, so on a greedy answer every step's accepted length is known without
the target). A step takes the prompt lookup's drafts (vLLM's matcher, 2-4 tokens), or
the corpus lookup's where `PromptLookup.propose` would (no own match, or a corpus match
of MAX_N tokens; corpus matches from `--min-match` tokens), and commits the accepted drafts plus one token. No drafter: this is
what the two lookups alone reach.

    python bench/corpus_walk.py [--corpus data/corpus/smollm2] [--answers N]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from vllm_dspine.model.lookup_corpus import write_lookup_corpus  # noqa: E402
from vllm_dspine.proposer.corpus_lookup import MAX_N, CorpusIndex  # noqa: E402
from vllm_dspine.proposer.lookup import (  # noqa: E402
    CORPUS_MIN_MATCH,
    _corpus_length_bin,
    longest_match_continuation,
)
from vllm_dspine.train.corpus import SOURCES, Corpus, first_shards  # noqa: E402

K = 15
GROUPS = ("1", "2-3", "4-7", "8-15")
CONTINUATION_S: list[float] = []  # each corpus lookup's time (match + vote), one core
BINS = ("2", "3", "4-5", "6-7", "8")


def _group(t: int) -> int:
    return 0 if t == 0 else 1 if t < 3 else 2 if t < 7 else 3


def walk(index: CorpusIndex | None, prompt: np.ndarray, answer: np.ndarray, table,
         min_match: int = CORPUS_MIN_MATCH) -> tuple[int, int]:
    """(tokens, steps) of the greedy walk over one answer; counts the corpus's drafts
    into table [bins, groups, (accepted, tested)]."""
    p = steps = 0
    while p < len(answer):
        ctx = np.concatenate([prompt, answer[:p]]).astype(np.int32)
        truth = answer[p:p + K]
        rest, _ = longest_match_continuation(ctx, 2, 4)
        drafts, from_corpus, cm = rest[:K], False, 0
        if index is not None:
            t0 = time.perf_counter()
            found, cm = index.continuation(ctx, K, min_match)
            CONTINUATION_S.append(time.perf_counter() - t0)
            if found.shape[0] and (cm >= MAX_N or rest.shape[0] == 0):
                drafts, from_corpus = found, True
        a = 0
        for t in range(min(len(drafts), len(truth))):
            ok = int(drafts[t]) == int(truth[t])
            if from_corpus:
                table[_corpus_length_bin(cm), _group(t), 0] += ok
                table[_corpus_length_bin(cm), _group(t), 1] += 1
            if not ok:
                break
            a += 1
        p += a + 1
        steps += 1
    return len(answer), steps


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--corpus", default="data/corpus/smollm2")
    ap.add_argument("--answers", type=int, default=None, help="the first N held-out answers")
    ap.add_argument("--min-match", type=int, default=CORPUS_MIN_MATCH,
                    help=f"the shortest corpus match proposed (served: {CORPUS_MIN_MATCH}; "
                         f"2 gives every row of the acceptance table)")
    args = ap.parse_args(argv)
    names = first_shards(args.corpus)
    if len(names) < 2:
        raise SystemExit(f"{args.corpus}: needs two shards or more (one is held out)")
    train = Corpus(args.corpus, names[:-1])
    held = Corpus(args.corpus, names[-1:])
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "lookup_corpus.npz")
        rec = write_lookup_corpus(train.answers(), path)
        t0 = time.time()
        index = CorpusIndex.load(path)
        build_s = time.time() - t0
    rows = [i for i in range(len(held)) if held.temperature[i] == 0.0][:args.answers]
    table = np.zeros((len(BINS), len(GROUPS), 2))
    by_source: dict[str, list[int]] = {}
    for i in rows:
        s, a = held.sequences[i], held.answer_start[i]
        src = held.source[i]
        acc = by_source.setdefault(src, [0, 0, 0, 0])
        t, n = walk(None, s[:a], s[a:], np.zeros_like(table))
        acc[0] += t
        acc[1] += n
        t, n = walk(index, s[:a], s[a:], table, args.min_match)
        acc[2] += t
        acc[3] += n
    print(f"Index: {rec['tokens']} answer tokens of {len(names) - 1} shards, built in "
          f"{build_s:.2f} s; held out: {names[-1]}, {len(rows)} greedy answers; corpus "
          f"matches from {args.min_match} tokens; a corpus lookup (match and vote, up to "
          f"{K} drafts) took {1e6 * np.mean(CONTINUATION_S):.0f} us on average, "
          f"{1e6 * np.percentile(CONTINUATION_S, 99):.0f} us at the 99th percentile, over "
          f"{len(CONTINUATION_S)} steps.\n")
    print("| source | answers' tokens | steps, prompt lookup | tokens a step | steps, "
          "with the corpus lookup | tokens a step |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for src in SOURCES:
        if src in by_source:
            t0_, n0, t1, n1 = by_source[src]
            print(f"| {src} | {t0_} | {n0} | {t0_ / n0:.2f} | {n1} | {t1 / n1:.2f} |")
    print("\nThe corpus's drafts: acceptance of a draft given the earlier ones accepted "
          "(tested drafts in brackets), per match length and draft position:\n")
    print("| match length | " + " | ".join(f"draft {g}" for g in GROUPS) + " |")
    print("| --- | " + " | ".join("---:" for _ in GROUPS) + " |")
    for b, name in enumerate(BINS):
        cells = [f"{table[b, g, 0] / max(table[b, g, 1], 1):.2f} ({int(table[b, g, 1])})"
                 for g in range(len(GROUPS))]
        print(f"| {name} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
