"""Write a drafter's lookup corpus: the target's answers of a distillation corpus, as the
corpus lookup serves them (`proposer/corpus_lookup.py`, docs/lookup.md "The corpus
lookup"). Put it in the drafter folder as `lookup_corpus.npz` for
`"dspine_lookup_corpus": true` (the lookup is off by default); the prompts are left out
(the lookup copies what the target writes).

    python -m vllm_dspine.train.lookup_corpus --corpus data/corpus/smollm2 \\
        --out vllm_dspine/pairs/drafters/smollm2/lookup_corpus.npz
"""

from __future__ import annotations

import argparse
import json
import sys

from vllm_dspine.model.lookup_corpus import write_lookup_corpus
from vllm_dspine.train.corpus import Corpus, first_shards


def write_from_corpus(corpus_dir: str, out: str, shards: int | None = None) -> dict:
    names = first_shards(corpus_dir, shards)
    if not names:
        raise ValueError(f"{corpus_dir} holds no corpus shards (manifest.json lists none); "
                         f"grow one with `python -m vllm_dspine.train.corpus` (docs/training.md)")
    corpus = Corpus(corpus_dir, names)
    record = write_lookup_corpus(corpus.answers(), out)
    record["shards"] = names
    return record


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--corpus", required=True, help="a corpus folder (manifest.json + shards)")
    ap.add_argument("--out", required=True, help="the .npz to write (DRAFT_DIR/lookup_corpus.npz)")
    ap.add_argument("--shards", type=int, default=None, help="the first N shards only")
    args = ap.parse_args(argv)
    try:
        record = write_from_corpus(args.corpus, args.out, args.shards)
    except (OSError, ValueError) as e:
        print(f"python -m vllm_dspine.train.lookup_corpus: {e}", file=sys.stderr)
        return 1
    print(json.dumps(record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
