"""Drafters committed compactly: the codebook keeps only the rows training touched.

The codebook E [V, C] is half of the SmolLM2 drafter's bytes (49,152 x 256 in bf16,
25 MB), yet training only moves the rows of tokens it sees (as anchors, predecessors of
the tail, or through the loss vocabulary); the others keep their random start and mean
nothing. A packed drafter folder holds:

- `drafter.packed`: safetensors bytes with every tensor of the checkpoint but
  `bridge.codebook`, plus `bridge.codebook_rows` [R, C] and `bridge.codebook_row_ids` [R];
- `config.json`, `training.json`, `loss.png` as the trainer wrote them.

`unpack_drafter` writes a checkpoint of the format of docs/design.md section 2 (what vLLM
loads) with the other codebook rows zero: a token never seen in training then writes no
message (m = sigmoid(.) * A 0 = 0) instead of random noise. The extension is not
`.safetensors` on purpose: the checkpoint loader reads every `*.safetensors` of a folder
and must never take a packed folder for a checkpoint.

    python -m vllm_dspine.pairs.packed pack DRAFT_DIR PACKED_DIR [--corpus DIR]
    python -m vllm_dspine.pairs.packed unpack PACKED_DIR DRAFT_DIR
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys

import torch

PACKED = "drafter.packed"
SIDE_FILES = ("config.json", "training.json", "loss.png")


def pack_drafter(draft_dir: str, out_dir: str, row_ids: torch.Tensor | None = None) -> dict:
    """Pack a drafter checkpoint; `row_ids` (sorted token ids) are the codebook rows kept,
    by default the drafter's retrieval vocabulary. -> {"rows": R, "bytes": size}"""
    from safetensors.torch import save_file

    from vllm_dspine.model.checkpoint import load_draft_checkpoint

    cfg, tensors = load_draft_checkpoint(draft_dir)
    if row_ids is None:
        if cfg.retrieval_vocab is None:
            raise ValueError(f"{draft_dir}: no retrieval_vocab in config.json; pass the "
                             f"codebook rows to keep (--corpus)")
        row_ids = torch.tensor(cfg.retrieval_vocab, dtype=torch.long)
    row_ids = torch.unique(row_ids.long())  # sorted
    out = {k: v.contiguous() for k, v in tensors.items() if k != "bridge.codebook"}
    out["bridge.codebook_rows"] = tensors["bridge.codebook"][row_ids].contiguous()
    out["bridge.codebook_row_ids"] = row_ids.to(torch.int32)
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, PACKED)
    save_file(out, path + ".tmp", metadata={"format": "pt"})
    os.replace(path + ".tmp", path)
    for name in SIDE_FILES:
        if os.path.exists(os.path.join(draft_dir, name)):
            shutil.copyfile(os.path.join(draft_dir, name), os.path.join(out_dir, name))
    return {"rows": len(row_ids), "bytes": os.path.getsize(path)}


def unpack_drafter(packed_dir: str, out_dir: str) -> str:
    """Write the checkpoint a packed folder stands for (codebook rows not kept: zero)."""
    from safetensors.torch import load_file

    from vllm_dspine.config import DSpineConfig
    from vllm_dspine.model.checkpoint import save_draft_checkpoint

    path = os.path.join(packed_dir, PACKED)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{packed_dir}: no {PACKED} (a packed drafter folder holds "
                                f"{PACKED} and config.json)")
    cfg = DSpineConfig.from_pretrained(packed_dir)
    tensors = load_file(path)
    rows = tensors.pop("bridge.codebook_rows")  # [R, C]
    ids = tensors.pop("bridge.codebook_row_ids").long()  # [R]
    codebook = torch.zeros(cfg.vocab_size, rows.shape[1], dtype=rows.dtype)
    codebook[ids] = rows
    tensors["bridge.codebook"] = codebook
    os.makedirs(out_dir, exist_ok=True)
    save_draft_checkpoint(out_dir, cfg, tensors)
    for name in SIDE_FILES[1:]:
        if os.path.exists(os.path.join(packed_dir, name)):
            shutil.copyfile(os.path.join(packed_dir, name), os.path.join(out_dir, name))
    return out_dir


def corpus_token_ids(corpus_dir: str) -> torch.Tensor:
    """Every token id of a corpus (train/corpus.py): the codebook rows training saw."""
    import numpy as np

    from vllm_dspine.train.corpus import Corpus

    return torch.from_numpy(np.unique(np.concatenate(Corpus(corpus_dir).sequences)))


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
