"""Target features and target distributions of a corpus, on disk, memory-mapped.

    python -m vllm_dspine.train.feature_store --target DIR --corpus CORPUS --store STORE

For every shard of the corpus (`train/corpus.py`) and every position of its sequences:
- the residual stream after each `target_layer_ids` layer, in bf16 (what vLLM hands
  the drafter), `<shard>.feats` as raw uint16 bits [N, F*H];
- the target's next-token distribution at that position as its `topk` most probable
  ids and their log-probabilities (`<shard>.topk_ids` int32 [N, k], `<shard>.topk_logp`
  float16 [N, k]): what distillation to the target's distribution trains on.
Files are written per shard and never rewritten, so the store grows with the corpus; a
million tokens take ~5.8 GB at SmolLM2's width (5 x 576 bf16), read through `np.memmap`
so they need not fit in RAM. The store lives beside the training run (never in git):
anyone can rebuild it from the committed corpus.

    N tokens of a shard, F feature layers, H hidden, k top-k.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np
import torch

from vllm_dspine.train.corpus import Corpus, first_shards
from vllm_dspine.train.target_data import _capture_layer_outputs, padded_batches

STORE_FORMAT = 1


def _bf16_bits(x: torch.Tensor) -> np.ndarray:
    return x.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)


def bf16_tensor_from_bits(bits: np.ndarray) -> torch.Tensor:
    """uint16 bf16 bits -> bf16 tensor (a copy, not widened)."""
    return torch.from_numpy(np.array(bits, dtype=np.uint16).view(np.int16)).view(
        torch.bfloat16)


def bf16_from_bits(bits: np.ndarray) -> torch.Tensor:
    """uint16 bf16 bits -> fp32 tensor (a copy)."""
    return bf16_tensor_from_bits(bits).float()


@torch.no_grad()
def features_and_topk(model, ids: torch.Tensor,  # [S, T]
                      layer_ids: tuple[int, ...], topk: int
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One target forward: features [S, T, F*H], top-k ids [S, T, k] and their
    log-probabilities [S, T, k] of the next-token distribution at every position."""
    with _capture_layer_outputs(model, layer_ids) as taken:
        logits = model(input_ids=ids.to(model.device), use_cache=False).logits.float()  # [S, T, V]
    feats = torch.cat([taken[i][0] for i in layer_ids], dim=-1)
    logp = torch.log_softmax(logits, dim=-1)
    top = logp.topk(topk, dim=-1)
    return feats, top.indices, top.values


def write_shard_features(model, corpus: Corpus, shard: str, store: str,
                         layer_ids: tuple[int, ...], topk: int,
                         batch_tokens: int = 4096) -> dict:
    """Features and top-k of every sequence of one shard, in the shard's order."""
    rows = [i for i, s in enumerate(corpus.shard_of) if s == shard]
    seqs = [corpus.sequences[i] for i in rows]
    N = int(sum(len(s) for s in seqs))
    base = os.path.join(store, shard.replace(".npz", ""))
    FH = model.config.hidden_size * len(layer_ids)
    feats = np.lib.format.open_memmap(base + ".feats.tmp.npy", mode="w+", dtype=np.uint16,
                                      shape=(N, FH))
    tids = np.lib.format.open_memmap(base + ".topk_ids.tmp.npy", mode="w+", dtype=np.int32,
                                     shape=(N, topk))
    tlp = np.lib.format.open_memmap(base + ".topk_logp.tmp.npy", mode="w+",
                                    dtype=np.float16, shape=(N, topk))
    offsets = np.zeros(len(seqs) + 1, dtype=np.int64)
    offsets[1:] = np.cumsum([len(s) for s in seqs])
    for group, ids in padded_batches(seqs, batch_tokens):
        f, ti, tl = features_and_topk(model, ids, layer_ids, topk)
        f, ti, tl = f.to(torch.bfloat16).cpu(), ti.cpu(), tl.cpu()  # one copy a batch
        for r, g in enumerate(group):
            a, b = offsets[g], offsets[g + 1]
            n = b - a
            feats[a:b] = _bf16_bits(f[r, :n])
            tids[a:b] = ti[r, :n].numpy()
            tlp[a:b] = tl[r, :n].numpy().astype(np.float16)
    for arr, name in ((feats, "feats"), (tids, "topk_ids"), (tlp, "topk_logp")):
        arr.flush()
        del arr
        os.replace(f"{base}.{name}.tmp.npy", f"{base}.{name}.npy")
    return {"shard": shard, "sequences": len(seqs), "tokens": N}


def build_store(target_dir: str, corpus_dir: str, store: str, layer_ids: tuple[int, ...],
                topk: int = 32, limit_shards: int | None = None, device: str = "cpu",
                batch_tokens: int = 4096) -> dict:
    """Features of every corpus shard not yet in the store, the target run on `device`
    (fp32, no TF32: the features vLLM hands the drafter), `batch_tokens` padded tokens a
    forward. -> the store's index"""
    from vllm_dspine.train.target_data import load_target

    os.makedirs(store, exist_ok=True)
    index_path = os.path.join(store, "index.json")
    index = {"format": STORE_FORMAT, "layer_ids": list(layer_ids), "topk": topk,
             "shards": []}
    if os.path.exists(index_path):
        with open(index_path) as f:
            index = json.load(f)
        if index["layer_ids"] != list(layer_ids) or index["topk"] != topk:
            raise ValueError(f"feature store {store} holds layers {index['layer_ids']}, "
                             f"top-{index['topk']}; asked for {list(layer_ids)}, top-{topk}: "
                             f"use another --store folder")
    done = {s["shard"] for s in index["shards"]}
    todo = [s for s in first_shards(corpus_dir, limit_shards) if s not in done]
    if not todo:
        return index
    model = load_target(target_dir).to(device)
    if model.device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
    for shard in todo:
        t0 = time.time()
        corpus = Corpus(corpus_dir, [shard])
        entry = write_shard_features(model, corpus, shard, store, layer_ids, topk,
                                     batch_tokens)
        entry["seconds"] = round(time.time() - t0, 1)
        index["shards"].append(entry)
        with open(index_path + ".tmp", "w") as f:
            json.dump(index, f, indent=1)
        os.replace(index_path + ".tmp", index_path)
        print(f"[{time.strftime('%H:%M:%S')}] features {entry}", flush=True)
    return index


class FeatureStore:
    """Read side: per sequence of the listed shards, its features (memory-mapped bf16
    bits), top-k ids and log-probabilities, in the corpus' sequence order."""

    def __init__(self, store: str, shards: list[str]):
        self.feats, self.topk_ids, self.topk_logp = [], [], []
        for shard in shards:
            base = os.path.join(store, shard.replace(".npz", ""))
            self.feats.append(np.load(base + ".feats.npy", mmap_mode="r"))
            self.topk_ids.append(np.load(base + ".topk_ids.npy", mmap_mode="r"))
            self.topk_logp.append(np.load(base + ".topk_logp.npy", mmap_mode="r"))

    @staticmethod
    def shards_in(store: str) -> list[str]:
        with open(os.path.join(store, "index.json")) as f:
            return [s["shard"] for s in json.load(f)["shards"]]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m vllm_dspine.train.feature_store",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--target", required=True)
    ap.add_argument("--corpus", required=True)
    ap.add_argument("--store", required=True)
    ap.add_argument("--layers", default="1,8,15,22,26",
                    help="target layer ids (0-based), comma-separated")
    ap.add_argument("--topk", type=int, default=32)
    ap.add_argument("--shards", type=int, default=None, help="only the first N shards")
    args = ap.parse_args(argv)
    build_store(args.target, args.corpus, args.store,
                tuple(int(x) for x in args.layers.split(",")), args.topk, args.shards)
    return 0


if __name__ == "__main__":
    sys.exit(main())
