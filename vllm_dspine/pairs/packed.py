"""The command line of packed drafters (the format: `model/packed.py`).

    python -m vllm_dspine.pairs.packed pack DRAFT_DIR PACKED_DIR [--corpus DIR]
    python -m vllm_dspine.pairs.packed unpack PACKED_DIR DRAFT_DIR

`pack --corpus` keeps the codebook rows of every token of the corpus the drafter was
trained on, beside its retrieval vocabulary (what `python -m vllm_dspine.train
--out-packed` does by itself).
"""

from __future__ import annotations

import argparse
import sys

import torch

from vllm_dspine.model.packed import PACKED, SIDE_FILES, pack_drafter, unpack_drafter  # noqa: F401


def corpus_token_ids(corpus_dir: str) -> torch.Tensor:
    """Every token id of a corpus (train/corpus.py): the codebook rows training saw."""
    from vllm_dspine.train.corpus import Corpus

    return torch.from_numpy(Corpus(corpus_dir).token_ids())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m vllm_dspine.pairs.packed",
                                 description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("pack")
    p.add_argument("draft_dir")
    p.add_argument("packed_dir")
    p.add_argument("--corpus", default=None,
                   help="also keep the codebook rows of every token of this corpus")
    u = sub.add_parser("unpack")
    u.add_argument("packed_dir")
    u.add_argument("draft_dir")
    args = ap.parse_args(argv)
    if args.cmd == "pack":
        rows = None
        if args.corpus:
            from vllm_dspine.config import DSpineConfig

            cfg = DSpineConfig.from_pretrained(args.draft_dir)
            rows = corpus_token_ids(args.corpus)
            if cfg.retrieval_vocab is not None:
                rows = torch.cat([rows, torch.tensor(cfg.retrieval_vocab)])
        print(pack_drafter(args.draft_dir, args.packed_dir, rows))
    else:
        print(unpack_drafter(args.packed_dir, args.draft_dir))
    return 0


if __name__ == "__main__":
    sys.exit(main())
