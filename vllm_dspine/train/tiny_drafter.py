"""Distil the tiny pair's drafter from its own target, offline and deterministically.

`write_tiny_pair` writes a random drafter, which almost never proposes what the target
says. `train_tiny_drafter` turns it into one that does:

1. Text from the target itself: short random printable prompts, continued by the target
   (transformers, fp32 CPU), greedy for some sequences and sampled at temperature 1.0
   for the others, from one seeded generator.
2. Target features: the residual stream after each decoder layer in `target_layer_ids`
   (what vLLM hands the drafter: the un-normalised `hidden + residual` after layer i).
   Caution: transformers' `output_hidden_states[i + 1]` is that for every layer but the
   last, whose entry has the final norm applied; forward hooks read the layer outputs.
3. Blocks as docs/design.md section 1 runs them: anchor `ids[p]` at position p, mask rows at
   p+1..p+15, context = features of 0..p-1; row t's logits are trained with
   cross-entropy against `ids[p + t]` (rows 1..15), weighted towards early rows.
   Every drafter tensor is trained (fc, hidden_norm, layers, norm, bridge.*) with AdamW;
   the embedding and output head are the target's, frozen.

The forward is `model/drafter.py`'s `block_forward`, the statement of the model (the
same function the tests use as the oracle of the vLLM model class).

    python -m vllm_dspine.pairs tiny --out DIR [--seed N] [--steps N] [--habit H]

    S sequences, T sequence length, nb blocks per sequence, B block size, H hidden,
    F target feature layers, KVH kv heads, D head dim, V vocabulary.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from vllm_dspine.config import DSpineConfig
from vllm_dspine.model.checkpoint import load_draft_checkpoint, save_draft_checkpoint
from vllm_dspine.model.drafter import block_forward
from vllm_dspine.train.acceptance import greedy_acceptance, sampled_acceptance
from vllm_dspine.train.target_data import generate_with_features, load_target


@dataclass(frozen=True)
class TrainSettings:
    """What `train_tiny_drafter` does; the defaults fit ~1 minute on a busy 2-core CPU."""

    steps: int = 240
    train_seqs: int = 320  # target-written sequences to train on (more data > more steps)
    eval_seqs: int = 16  # held-out sequences to measure acceptance on
    prompt_len: int = 8
    new_tokens: int = 88  # continuation length per sequence
    greedy_share: float = 0.75  # share of training sequences continued greedily
    sample_temperature: float = 1.0  # the other sequences are sampled at this temperature
    seqs_per_step: int = 8
    blocks_per_seq: int = 8  # 64 blocks (1,024 rows) per step
    lr: float = 6e-3
    weight_decay: float = 0.01
    warmup: int = 20
    row_decay: float = 7.0  # loss weight of row t: exp(-(t - 1) / row_decay)
    grad_clip: float = 1.0
    sampled_temperatures: tuple[float, ...] = (1.0, 0.5)  # where sampled acceptance is measured


# ------------------------------------------------------------------------- helpers
@contextlib.contextmanager
def _single_thread():
    """One intra-op thread while training: reproducible sums, no fight over 2 cores."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(old)


# -------------------------------------------------------------------------- training
def _lr_at(step: int, s: TrainSettings) -> float:
    if step < s.warmup:
        return s.lr * (step + 1) / s.warmup
    frac = (step - s.warmup) / max(1, s.steps - s.warmup)
    return s.lr * 0.5 * (1.0 + math.cos(math.pi * frac))


def _block_loss(cfg: DSpineConfig, w: dict[str, torch.Tensor],
                embed: torch.Tensor,  # [V, H]
                head: torch.Tensor,  # [V, H]
                ids: torch.Tensor,  # [S, T]
                feats: torch.Tensor,  # [S, T, F*H]
                anchors: torch.Tensor,  # [S, nb]
                row_weights: torch.Tensor,  # [K]  loss weight of rows 1..K
                ) -> torch.Tensor:
    """Row-weighted mean cross-entropy of rows 1.. against the text.  -> scalar"""
    B = cfg.block_size
    out = block_forward(cfg, w, embed, head, ids, feats, anchors)
    S, nb = anchors.shape
    labels = ids.gather(1, (anchors[..., None] + torch.arange(1, B)).view(S, -1)
                        ).view(S, nb, B - 1)  # [S, nb, K]
    ce = F.cross_entropy(out.logits[:, :, 1:].reshape(-1, out.logits.shape[-1]),
                         labels.reshape(-1), reduction="none").view(S, nb, B - 1)
    return (ce * row_weights).sum(-1).mean() / row_weights.sum()


def _check_settings(s: TrainSettings) -> None:
    where = "train_tiny_drafter"
    if s.steps < 0:
        raise ValueError(f"{where}: steps must be >= 0, got {s.steps}")
    if not 0 < s.seqs_per_step <= s.train_seqs:
        raise ValueError(f"{where}: seqs_per_step must be in 1..train_seqs ({s.train_seqs}), "
                         f"got {s.seqs_per_step}; lower it or generate more sequences")
    if not 0.0 <= s.greedy_share <= 1.0:
        raise ValueError(f"{where}: greedy_share must be in [0, 1], got {s.greedy_share}")
    if s.sample_temperature <= 0 or any(t <= 0 for t in s.sampled_temperatures):
        raise ValueError(f"{where}: temperatures must be > 0 (greedy text comes from "
                         f"greedy_share), got {s.sample_temperature}, {s.sampled_temperatures}")
    if s.prompt_len < 1 or s.blocks_per_seq < 1 or s.eval_seqs < 1:
        raise ValueError(f"{where}: prompt_len, blocks_per_seq and eval_seqs must be >= 1, "
                         f"got {s.prompt_len}, {s.blocks_per_seq}, {s.eval_seqs}")


def train_tiny_drafter(target_dir: str, draft_dir: str, *, seed: int = 0,
                       steps: int | None = None, out_dir: str | None = None,
                       settings: TrainSettings | None = None,
                       evaluate: bool = True, log_every: int = 0) -> dict:
    """Train the drafter in `draft_dir` on its target; save it to `out_dir` (default:
    over `draft_dir`, same config.json). Returns stats (losses, acceptance, seconds).

    Deterministic for a seed: every draw comes from generators seeded by `seed`, and
    the work runs on one intra-op thread (restored afterwards).
    """
    s = settings or TrainSettings()
    if steps is not None:
        s = replace(s, steps=steps)
    _check_settings(s)
    out_dir = draft_dir if out_dir is None else out_dir
    t_start = time.perf_counter()
    stats: dict = {"seed": seed, "steps": s.steps}
    with _single_thread():
        torch.manual_seed(seed)
        cfg, init = load_draft_checkpoint(draft_dir, dtype=torch.float32)
        model = load_target(target_dir)
        embed = model.model.embed_tokens.weight.detach().float()  # [V, H]
        head = model.lm_head.weight.detach().float()  # [V, H]
        cfg.check_target(hidden_size=embed.shape[1], vocab_size=embed.shape[0],
                         num_layers=model.config.num_hidden_layers, where=target_dir)
        B = cfg.block_size
        T = s.prompt_len + s.new_tokens
        if T < s.prompt_len + B:
            raise ValueError(f"train_tiny_drafter: new_tokens ({s.new_tokens}) must be >= "
                             f"the block size ({B})")

        gen = torch.Generator().manual_seed(seed)
        t0 = time.perf_counter()
        layer_ids = cfg.target_layer_ids
        train_ids, train_feats = generate_with_features(
            model, layer_ids, s.train_seqs, s.prompt_len, s.new_tokens, s.greedy_share, gen,
            s.sample_temperature)  # [N, T], [N, T, F*H]
        sampled_eval = []  # (temperature, ids, features): held-out sampled text
        if evaluate:  # held-out prompts: generators of their own
            eval_gen = torch.Generator().manual_seed(seed + 7919)
            eval_ids, eval_feats = generate_with_features(
                model, layer_ids, s.eval_seqs, s.prompt_len, s.new_tokens, 1.0, eval_gen)
            for i, temp in enumerate(s.sampled_temperatures):
                g = torch.Generator().manual_seed(seed + 104_729 * (i + 1))
                sampled_eval.append((temp, *generate_with_features(
                    model, layer_ids, s.eval_seqs, s.prompt_len, s.new_tokens, 0.0, g, temp)))
        stats["data_seconds"] = time.perf_counter() - t0

        params = {n: torch.nn.Parameter(t.clone()) for n, t in init.items()}
        decay = [p for n, p in params.items() if p.ndim == 2]
        no_decay = [p for n, p in params.items() if p.ndim < 2]
        opt = torch.optim.AdamW([{"params": decay, "weight_decay": s.weight_decay},
                                 {"params": no_decay, "weight_decay": 0.0}],
                                lr=s.lr, betas=(0.9, 0.98), eps=1e-8)
        row_w = torch.exp(-torch.arange(B - 1, dtype=torch.float32) / s.row_decay)  # [K]
        lo, hi = s.prompt_len, T - B  # anchors in the generated text, full labels

        if evaluate:
            stats["before"] = greedy_acceptance(cfg, params, embed, head, eval_ids,
                                                eval_feats, lo, tail=False)
        t0 = time.perf_counter()
        losses = []
        for step in range(s.steps):
            seq = torch.randperm(s.train_seqs, generator=gen)[:s.seqs_per_step]  # [S]
            anchors = torch.randint(lo, hi + 1, (len(seq), s.blocks_per_seq), generator=gen)
            for g in opt.param_groups:
                g["lr"] = _lr_at(step, s)
            loss = _block_loss(cfg, params, embed, head, train_ids[seq], train_feats[seq],
                               anchors, row_w)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(list(params.values()), s.grad_clip)
            opt.step()
            losses.append(loss.item())
            if log_every and (step % log_every == 0 or step == s.steps - 1):
                print(f"step {step:4d}  loss {loss.item():.4f}  "
                      f"{time.perf_counter() - t0:.1f}s", flush=True)
        stats["train_seconds"] = time.perf_counter() - t0
        stats["loss_first"] = losses[0] if losses else float("nan")
        stats["loss_last10"] = sum(losses[-10:]) / max(1, len(losses[-10:]))
        tensors = {n: p.detach().clone() for n, p in params.items()}
        if evaluate:
            t0 = time.perf_counter()
            stats["after"] = greedy_acceptance(cfg, tensors, embed, head, eval_ids,
                                               eval_feats, lo, tail=True)
            sgen = torch.Generator().manual_seed(seed + 15_485_863)
            for temp, sids, sfeats in sampled_eval:
                stats["after"][f"acceptance_sampled_t{temp:g}"] = sampled_acceptance(
                    cfg, tensors, embed, head, model, sids, sfeats,
                    list(range(lo, T - B + 1, 16)), temp, sgen)
            stats["eval_seconds"] = time.perf_counter() - t0
        os.makedirs(out_dir, exist_ok=True)
        save_draft_checkpoint(out_dir, cfg, tensors)
    stats["total_seconds"] = time.perf_counter() - t_start
    return stats
