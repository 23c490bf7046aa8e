"""How wide the retrieval vocabulary can be: held-out greedy acceptance of one drafter
served with its own `retrieval_vocab`, with every id of a corpus, and with the whole
vocabulary (offline, as vLLM serves it: bf16 weights, the tail; `train/__main__.py`'s
`held_out_acceptance`), and how much of the held-out answers each covers.

    python bench/retrieval_vocab.py --draft PAIR/draft --target PAIR/target \\
        --held-out WORK/held-out --held-out-store WORK/features-held-out \\
        --corpus data/corpus/smollm2 [--seqs 40]

The held-out store is the one `python -m vllm_dspine.train ... --held-out-corpus` builds
(or `python -m vllm_dspine.train.feature_store --store ...`). Prints one table.
"""

from __future__ import annotations

import argparse
import sys

if not __package__:  # `python bench/retrieval_vocab.py`: import `bench` from the root
    import os

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--draft", required=True)
    ap.add_argument("--target", required=True)
    ap.add_argument("--held-out", required=True, help="held-out corpus folder")
    ap.add_argument("--held-out-store", required=True, help="its feature store")
    ap.add_argument("--corpus", required=True, help="the training corpus folder")
    ap.add_argument("--seqs", type=int, default=40)
    args = ap.parse_args()

    import torch

    from vllm_dspine.model.checkpoint import load_draft_checkpoint
    from vllm_dspine.train.__main__ import held_out_acceptance, load_corpus_data
    from vllm_dspine.train.corpus import Corpus, covered_share
    from vllm_dspine.train.target_data import load_target

    cfg, w = load_draft_checkpoint(args.draft)
    if cfg.retrieval_vocab is None:
        raise SystemExit(f"{args.draft}: the drafter has no retrieval_vocab to compare with")
    w = {k: v.float() for k, v in w.items()}
    target = load_target(args.target)
    embed = target.model.embed_tokens.weight.detach().float()
    head = target.lm_head.weight.detach().float()
    V = head.shape[0]
    ho, hf, _, _ = load_corpus_data(args.held_out, args.held_out_store)
    answers = ho.answers()
    corpus_ids = Corpus(args.corpus).token_ids()
    vocabs = {"its own retrieval_vocab": torch.tensor(cfg.retrieval_vocab, dtype=torch.long),
              "every id of the corpus": torch.from_numpy(corpus_ids),
              "the whole vocabulary": torch.arange(V)}
    print("| retrieval vocabulary | ids | held-out answers covered | accepted/block, tail "
          "| HumanEval | chat | held-out loss |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, vocab in vocabs.items():
        r = held_out_acceptance(cfg, w, embed, head, vocab, ho, hf, args.seqs)
        src = r["tail_decode_by_source"]
        print(f"| {name} | {len(vocab):,} | {100 * covered_share(answers, vocab, V):.1f} % "
              f"| {r['acceptance_tail_decode']:.3f} | {src.get('humaneval', float('nan')):.3f} "
              f"| {src.get('bench-chat', float('nan')):.3f} | {r['eval_loss']:.2f} |",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
