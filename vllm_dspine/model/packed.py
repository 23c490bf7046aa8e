"""Drafters stored compactly: the codebook keeps only the rows training touched.

The codebook E [V, C] is half of the SmolLM2 drafter's bytes (49,152 x 256 in bf16,
25 MB), yet training only moves the rows of tokens it sees (as anchors, predecessors of
the tail, or through the loss vocabulary); the others keep their random start and mean
nothing. A packed drafter folder holds:

- `drafter.packed`: safetensors bytes with every tensor of the checkpoint but
  `bridge.codebook`, plus `bridge.codebook_rows` [R, C] and `bridge.codebook_row_ids` [R];
- `config.json`, `training.json`, `loss.png` as the trainer wrote them.

`load_packed_drafter` gives the checkpoint a packed folder stands for (docs/design.md
section 2, what vLLM loads) with the other codebook rows zero: a token never seen in
training then writes no message (m = sigmoid(.) * A 0 = 0) instead of random noise.
`load_drafter` reads either kind of folder, so training continues from a committed
(packed) drafter directly. The extension is not `.safetensors` on purpose: the
checkpoint loader reads every `*.safetensors` of a folder and must never take a packed
folder for a checkpoint.

The command line (`python -m vllm_dspine.pairs.packed`) lives with the pairs, which
also know which corpus a drafter was trained on.
"""

from __future__ import annotations

import os
import shutil

import torch

from vllm_dspine.config import DSpineConfig
from vllm_dspine.model.checkpoint import load_draft_checkpoint, save_draft_checkpoint
from vllm_dspine.model.lookup_corpus import LOOKUP_CORPUS_FILE

PACKED = "drafter.packed"
SIDE_FILES = ("config.json", "training.json", "loss.png", LOOKUP_CORPUS_FILE)


def is_packed_drafter(folder: str) -> bool:
    return os.path.isfile(os.path.join(folder, PACKED))


def pack_drafter(draft_dir: str, out_dir: str, row_ids: torch.Tensor | None = None) -> dict:
    """Pack a drafter checkpoint; `row_ids` (token ids) are the codebook rows kept, by
    default the drafter's retrieval vocabulary. -> {"rows": R, "bytes": size}"""
    from safetensors.torch import save_file

    cfg, tensors = load_draft_checkpoint(draft_dir)
    if row_ids is None:
        if cfg.retrieval_vocab is None:
            raise ValueError(f"{draft_dir}: no retrieval_vocab in config.json; pass the "
                             f"codebook rows to keep (--corpus)")
        row_ids = torch.tensor(cfg.retrieval_vocab, dtype=torch.long)
    row_ids = torch.unique(row_ids.long())  # sorted
    out = {k: v.contiguous() for k, v in tensors.items() if k != "bridge.codebook"}
    out["bridge.codebook_rows"] = tensors["bridge.codebook"][row_ids].contiguous()  # [R, C]
    out["bridge.codebook_row_ids"] = row_ids.to(torch.int32)  # [R]
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, PACKED)
    save_file(out, path + ".tmp", metadata={"format": "pt"})
    os.replace(path + ".tmp", path)
    if os.path.abspath(draft_dir) != os.path.abspath(out_dir):
        for name in SIDE_FILES:
            if os.path.exists(os.path.join(draft_dir, name)):
                shutil.copyfile(os.path.join(draft_dir, name), os.path.join(out_dir, name))
    return {"rows": len(row_ids), "bytes": os.path.getsize(path)}


def load_packed_drafter(packed_dir: str) -> tuple[DSpineConfig, dict[str, torch.Tensor]]:
    """The checkpoint a packed folder stands for (codebook rows not kept: zero)."""
    from safetensors.torch import load_file

    from vllm_dspine.model.checkpoint import check_tensor_shapes, expected_tensor_shapes

    path = os.path.join(packed_dir, PACKED)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{packed_dir}: no {PACKED} (a packed drafter folder holds "
                                f"{PACKED} and config.json)")
    cfg = DSpineConfig.from_pretrained(packed_dir)
    tensors = load_file(path)
    rows = tensors.pop("bridge.codebook_rows")  # [R, C]
    ids = tensors.pop("bridge.codebook_row_ids").long()  # [R]
    codebook = torch.zeros(cfg.vocab_size, rows.shape[1], dtype=rows.dtype)  # [V, C]
    codebook[ids] = rows
    tensors["bridge.codebook"] = codebook
    check_tensor_shapes(cfg, {k: tuple(v.shape) for k, v in tensors.items()}, packed_dir)
    return cfg, {n: tensors[n] for n in expected_tensor_shapes(cfg)}


def packed_row_ids(packed_dir: str) -> torch.Tensor:
    """The token ids whose codebook rows a packed folder keeps.  -> sorted int64 [R]"""
    from safetensors import safe_open

    with safe_open(os.path.join(packed_dir, PACKED), framework="pt") as f:
        return f.get_tensor("bridge.codebook_row_ids").long()


def load_drafter(folder: str) -> tuple[DSpineConfig, dict[str, torch.Tensor]]:
    """A drafter folder as a checkpoint, whether it is one or a packed folder."""
    if is_packed_drafter(folder):
        return load_packed_drafter(folder)
    return load_draft_checkpoint(folder)


def unpack_drafter(packed_dir: str, out_dir: str) -> str:
    """Write the checkpoint a packed folder stands for, with its record beside it."""
    cfg, tensors = load_packed_drafter(packed_dir)
    os.makedirs(out_dir, exist_ok=True)
    save_draft_checkpoint(out_dir, cfg, tensors)
    for name in SIDE_FILES[1:]:
        if os.path.exists(os.path.join(packed_dir, name)):
            shutil.copyfile(os.path.join(packed_dir, name), os.path.join(out_dir, name))
    return out_dir
