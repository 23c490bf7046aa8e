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
3. Blocks as DESIGN section 1 runs them: anchor `ids[p]` at position p, mask rows at
   p+1..p+15, context = features of 0..p-1; row t's logits are trained with
   cross-entropy against `ids[p + t]` (rows 1..15), weighted towards early rows.
   Every drafter tensor is trained (fc, hidden_norm, layers, norm, bridge.*) with AdamW;
   the embedding and output head are the target's, frozen.

`block_forward` is the batched training forward: many blocks of many sequences at once,
the same function as `ReferenceDrafter.forward_block` (tests check equality), with the
bridge computed by `kernels/bridge_ref.py` itself.

    python -m vllm_dspine.train_tiny OUT_DIR [--seed N] [--steps N] [--habit H]

    S sequences, T sequence length, nb blocks per sequence, B block size, H hidden,
    F target feature layers, KVH kv heads, D head dim, V vocabulary.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import time
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from vllm_dspine.checkpoint import (bridge_weights, load_draft_checkpoint,
                                    save_draft_checkpoint)
from vllm_dspine.config import DSpineConfig
from vllm_dspine.kernels.bridge_ref import code_bridge_ref
from vllm_dspine.reference_drafter import rms_norm, rope

# Printable ASCII: the prompts' alphabet (the planted habit cycles through it).
_PRINTABLE_LO, _PRINTABLE_HI = 32, 127


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


def _load_target(target_dir: str):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
    return model.eval()


# ---------------------------------------------------------------- target text + features
@torch.no_grad()
def generate_text(model, num_seqs: int, prompt_len: int, new_tokens: int,
                  greedy_share: float, gen: torch.Generator,
                  temperature: float = 1.0) -> torch.Tensor:
    """Random printable prompts continued by the target.  -> ids [S, prompt_len + new_tokens]

    The first round(greedy_share * S) sequences are greedy, the rest sampled at
    `temperature` (plain softmax, no filtering) from `gen`. Every position, the last
    included, goes through the target once (so hooks see the features of all T).
    """
    ids = torch.randint(_PRINTABLE_LO, _PRINTABLE_HI, (num_seqs, prompt_len),
                        generator=gen)  # [S, P]
    greedy = torch.arange(num_seqs) < round(greedy_share * num_seqs)  # [S]
    out = model(input_ids=ids, use_cache=True)
    cache = out.past_key_values
    steps = [ids]
    for _ in range(new_tokens):
        logits = out.logits[:, -1].float()  # [S, V]
        sampled = torch.multinomial((logits / temperature).softmax(-1), 1,
                                    generator=gen)[:, 0]  # [S]
        nxt = torch.where(greedy, logits.argmax(-1), sampled)[:, None]  # [S, 1]
        steps.append(nxt)
        out = model(input_ids=nxt, past_key_values=cache, use_cache=True)
        cache = out.past_key_values
    return torch.cat(steps, dim=1)


@contextlib.contextmanager
def _capture_layer_outputs(model, layer_ids: tuple[int, ...]):
    """Collect each listed decoder layer's output of every forward call, in call order.

    Yields {layer id: list of [S, t, H] fp32 chunks}. transformers' Qwen3 decoder layer
    returns the residual stream after the layer (un-normalised): vLLM's auxiliary output.
    """
    taken: dict[int, list[torch.Tensor]] = {i: [] for i in layer_ids}
    layers = model.model.layers
    hooks = []
    for i in layer_ids:
        def hook(_mod, _inp, out, i=i):
            taken[i].append((out[0] if isinstance(out, tuple) else out).float())
        hooks.append(layers[i].register_forward_hook(hook))
    try:
        yield taken
    finally:
        for h in hooks:
            h.remove()


@torch.no_grad()
def generate_with_features(model, layer_ids: tuple[int, ...], *args, **kwargs
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """`generate_text` that also returns the features of every position, read while
    generating (every token, the last one included, goes through the target once).

    -> ids [S, T], features [S, T, F*H]
    """
    with _capture_layer_outputs(model, layer_ids) as taken:
        ids = generate_text(model, *args, **kwargs)
    feats = torch.cat([torch.cat(taken[i], dim=1) for i in layer_ids], dim=-1)
    assert feats.shape[:2] == ids.shape, (feats.shape, ids.shape)
    return ids, feats


@torch.no_grad()
def target_features(model, ids: torch.Tensor, layer_ids: tuple[int, ...]) -> torch.Tensor:
    """Residual stream after each listed decoder layer, concatenated.  -> [S, T, F*H]

    Read with forward hooks: `output_hidden_states` normalises the last layer's entry.
    """
    with _capture_layer_outputs(model, layer_ids) as taken:
        model(input_ids=ids, use_cache=False)
    return torch.cat([taken[i][0] for i in layer_ids], dim=-1)


# ------------------------------------------------------------------- batched forward
def _attention(w: dict[str, torch.Tensor], cfg: DSpineConfig, l: int,
               x: torch.Tensor,  # [S, nb, B, H]  normed block rows
               positions: torch.Tensor,  # [S, nb, B]
               ctx_k: torch.Tensor,  # [S, T, KVH, D]  k_norm + RoPE applied
               ctx_v: torch.Tensor,  # [S, T, KVH, D]
               anchors: torch.Tensor,  # [S, nb]
               ) -> torch.Tensor:
    """Block rows attend to context positions < anchor and causally inside the block."""
    p = f"layers.{l}.self_attn."
    S, nb, B, H = x.shape
    nh, kvh, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    T = ctx_k.shape[1]
    flat_pos = positions.reshape(-1)  # [S*nb*B]
    q = (x @ w[p + "q_proj.weight"].t()).view(-1, nh, D)
    k = (x @ w[p + "k_proj.weight"].t()).view(-1, kvh, D)
    v = (x @ w[p + "v_proj.weight"].t()).view(-1, kvh, D)
    q = rope(rms_norm(q, w[p + "q_norm.weight"], cfg.rms_norm_eps), flat_pos,
             cfg.rope_theta).view(S, nb, B, nh, D)
    k = rope(rms_norm(k, w[p + "k_norm.weight"], cfg.rms_norm_eps), flat_pos,
             cfg.rope_theta).view(S, nb, B, kvh, D)
    v = v.view(S, nb, B, kvh, D)
    group = nh // kvh
    ck = ctx_k.repeat_interleave(group, dim=2)  # [S, T, nh, D]
    cv = ctx_v.repeat_interleave(group, dim=2)
    k = k.repeat_interleave(group, dim=3)  # [S, nb, B, nh, D]
    v = v.repeat_interleave(group, dim=3)

    scale = D ** -0.5
    s_ctx = torch.einsum("sbqhd,skhd->sbhqk", q, ck) * scale  # [S, nb, nh, B, T]
    s_blk = torch.einsum("sbqhd,sbkhd->sbhqk", q, k) * scale  # [S, nb, nh, B, B]
    # Context key j is visible to query i iff j < anchor (the context ends before the
    # block) and, with a window, pos_i - j < window. Inside the block: causal.
    key_pos = torch.arange(T)
    ctx_ok = key_pos[None, None, None, :] < anchors[:, :, None, None]  # [S, nb, 1, T]
    blk_ok = torch.ones(B, B, dtype=torch.bool).tril()  # [B, B]
    if cfg.sliding_window is not None:
        ctx_ok = ctx_ok & ((positions[..., None] - key_pos) < cfg.sliding_window)
        rel = torch.arange(B)[:, None] - torch.arange(B)[None, :]
        blk_ok = blk_ok & (rel < cfg.sliding_window)
    s_ctx = s_ctx.masked_fill(~ctx_ok[:, :, None], float("-inf"))
    s_blk = s_blk.masked_fill(~blk_ok, float("-inf"))
    probs = torch.cat([s_ctx, s_blk], dim=-1).softmax(-1)  # [S, nb, nh, B, T+B]
    out = torch.einsum("sbhqk,skhd->sbqhd", probs[..., :T], cv) \
        + torch.einsum("sbhqk,sbkhd->sbqhd", probs[..., T:], v)  # [S, nb, B, nh, D]
    return out.reshape(S, nb, B, nh * D) @ w[p + "o_proj.weight"].t()


@dataclass
class BlocksOut:
    logits: torch.Tensor  # [S, nb, B, V]
    final_hidden: torch.Tensor  # [S, nb, B, H]  after the final norm
    pre_write_state: torch.Tensor  # [S, nb, B, H]  last layer, before its bridge write
    last_codes: torch.Tensor  # [S, nb, B, C]
    last_rms: torch.Tensor  # [S, nb, B]


def block_forward(cfg: DSpineConfig, w: dict[str, torch.Tensor],
                  embed_tokens: torch.Tensor,  # [V, H]  the target's, frozen
                  lm_head: torch.Tensor,  # [V, H]  the target's, frozen
                  ids: torch.Tensor,  # [S, T]  token ids of each sequence
                  features: torch.Tensor,  # [S, T, F*H]  target layer outputs
                  anchors: torch.Tensor,  # [S, nb]  anchor positions, 0 < p < T
                  ) -> BlocksOut:
    """`ReferenceDrafter.forward_block` for every (sequence, anchor) pair at once.

    Block (s, b): row 0 is `ids[s, anchors[s, b]]` at that position, rows 1.. the mask
    token; context = features[s, :anchors[s, b]]. Differentiable in `w`.
    """
    assert ids.ndim == 2 and features.shape[:2] == ids.shape and anchors.ndim == 2
    S, T = ids.shape
    nb, B, L = anchors.shape[1], cfg.block_size, cfg.num_hidden_layers
    eps = cfg.rms_norm_eps
    kvh, D = cfg.num_key_value_heads, cfg.head_dim

    # Context K/V of every position of every sequence (a block sees a prefix of them).
    ctx = rms_norm(features @ w["fc.weight"].t(), w["hidden_norm.weight"], eps)  # [S, T, H]
    ctx_pos = torch.arange(T).repeat(S)  # [S*T]
    ctx_kv = []
    for l in range(L):
        p = f"layers.{l}.self_attn."
        k = (ctx @ w[p + "k_proj.weight"].t()).reshape(S * T, kvh, D)
        v = (ctx @ w[p + "v_proj.weight"].t()).view(S, T, kvh, D)
        k = rope(rms_norm(k, w[p + "k_norm.weight"], eps), ctx_pos, cfg.rope_theta)
        ctx_kv.append((k.view(S, T, kvh, D), v))

    positions = anchors[..., None] + torch.arange(B)  # [S, nb, B]
    tok = torch.full((S, nb, B), cfg.mask_token_id, dtype=torch.long)
    tok[:, :, 0] = ids.gather(1, anchors)
    flat_tok = tok.reshape(-1)  # [S*nb*B]
    is_anchor = (torch.arange(S * nb * B) % B) == 0  # [S*nb*B]
    bridge = bridge_weights(cfg, w)

    x = embed_tokens[tok]  # [S, nb, B, H]
    pre_write = codes = rms = None
    for l in range(L):
        p = f"layers.{l}."
        h = x + _attention(w, cfg, l, rms_norm(x, w[p + "input_layernorm.weight"], eps),
                           positions, *ctx_kv[l], anchors)
        a = rms_norm(h, w[p + "post_attention_layernorm.weight"], eps)
        mp = p + "mlp."
        x = h + (F.silu(a @ w[mp + "gate_proj.weight"].t()) * (a @ w[mp + "up_proj.weight"].t())
                 ) @ w[mp + "down_proj.weight"].t()
        pre_write = x
        x_flat, codes, rms = code_bridge_ref(x.reshape(-1, x.shape[-1]), l, bridge, flat_tok,
                                             is_anchor)
        x = x_flat.view_as(pre_write)
    final = rms_norm(x, w["norm.weight"], eps)  # [S, nb, B, H]
    return BlocksOut(logits=final @ lm_head.t(), final_hidden=final,
                     pre_write_state=pre_write, last_codes=codes.view(S, nb, B, -1),
                     last_rms=rms.view(S, nb, B))


# ------------------------------------------------------------------------ acceptance
def _leading_matches(draft: torch.Tensor, truth: torch.Tensor) -> torch.Tensor:
    """Accepted length per block: leading positions where draft == truth.  [N, K] -> [N]"""
    return (draft == truth).long().cumprod(dim=1).sum(dim=1)


def _decode_walk(accepted: torch.Tensor) -> float:
    """Mean accepted length over the anchors greedy decoding visits.

    accepted[s, j]: accepted drafts with the anchor at first_anchor + j. Decoding starts
    at j = 0 and moves to j + accepted + 1 (the accepted drafts, then the target's token,
    which is the next anchor). E.g. row [2, 0, 0, 5, 1] visits j = 0, 3 -> mean 3.5.
    """
    S, nb = accepted.shape
    visited = []
    for s in range(S):
        j = 0
        while j < nb:
            a = int(accepted[s, j])
            visited.append(a)
            j += a + 1
    return sum(visited) / len(visited)


@torch.no_grad()
def greedy_acceptance(cfg: DSpineConfig, w: dict[str, torch.Tensor], embed_tokens, lm_head,
                      ids: torch.Tensor,  # [S, T]  the target's greedy sequences
                      features: torch.Tensor,  # [S, T, F*H]
                      first_anchor: int, tail: bool = True) -> dict[str, float]:
    """Mean accepted drafts (of B - 1) over every anchor p in [first_anchor, T - B],
    and the mean cross-entropy of rows 1.. against the sequence (`eval_loss`).

    argmax: per-row argmax of the block logits. tail: DSpine's greedy (16 candidates
    per row, 16 x 16 refinement of the last write, `kernels/tail.py`).
    `*_decode`: the mean over the anchors decoding actually visits (first_anchor, then
    p + accepted + 1): after a rejection the next anchor sits where the text surprised
    the drafter, so this is lower than the mean over all anchors; it is what vLLM's
    spec-decode counters report (mean accepted tokens per draft).
    """
    S, T = ids.shape
    B = cfg.block_size
    anchors = torch.arange(first_anchor, T - B + 1).expand(S, -1).contiguous()  # [S, nb]
    nb = anchors.shape[1]
    truth = ids.gather(1, (anchors[..., None] + torch.arange(1, B)).view(S, -1)
                       ).view(S * nb, B - 1)  # [S*nb, K]
    stats: dict[str, float] = {"eval_blocks": S * nb}
    outs = [block_forward(cfg, w, embed_tokens, lm_head, ids[s:s + 1], features[s:s + 1],
                          anchors[s:s + 1]) for s in range(S)]
    logits = torch.cat([o.logits for o in outs]).view(S * nb, B, -1)
    stats["eval_loss"] = F.cross_entropy(logits[:, 1:].reshape(-1, logits.shape[-1]),
                                         truth.reshape(-1)).item()
    acc = _leading_matches(logits[:, 1:].argmax(-1), truth)  # [S*nb]
    stats["acceptance_argmax"] = acc.float().mean().item()
    stats["acceptance_argmax_decode"] = _decode_walk(acc.view(S, nb))
    stats["row1_hit_argmax"] = (logits[:, 1].argmax(-1) == truth[:, 0]).float().mean().item()
    if tail:
        from vllm_dspine.kernels.retrieval import retrieve_candidates
        from vllm_dspine.kernels.tail import TailTables, refine_last_write

        bridge = bridge_weights(cfg, w)
        final = torch.cat([o.final_hidden for o in outs]).view(S * nb, B, -1)
        cand = retrieve_candidates(final[:, 1:].reshape(-1, final.shape[-1]), lm_head,
                                   cfg.head_topk, cfg.coarse_topk, mode="bf16"
                                   ).view(S * nb, B - 1, cfg.head_topk)
        prop = refine_last_write(
            torch.cat([o.pre_write_state for o in outs]).view(S * nb, B, -1),
            torch.cat([o.last_codes for o in outs]).view(S * nb, B, -1),
            torch.cat([o.last_rms for o in outs]).view(S * nb, B),
            cand, ids.gather(1, anchors).reshape(-1),
            bridge, w["norm.weight"], cfg.rms_norm_eps, lm_head,
            temperature=torch.zeros(S * nb),
            tables=TailTables.build(bridge, lm_head, w["norm.weight"]))
        acc = _leading_matches(prop.draft_token_ids, truth)  # [S*nb]
        stats["acceptance_tail"] = acc.float().mean().item()
        stats["acceptance_tail_decode"] = _decode_walk(acc.view(S, nb))
    return stats


@torch.no_grad()
def sampled_acceptance(cfg: DSpineConfig, w: dict[str, torch.Tensor], embed_tokens, lm_head,
                       model, ids: torch.Tensor,  # [S, T]
                       features: torch.Tensor,  # [S, T, F*H]
                       anchor_positions: list[int], temperature: float,
                       gen: torch.Generator) -> float:
    """Expected accepted drafts per block under exact speculative sampling.

    For each anchor p (all S sequences at once): DSpine's sampled proposal (candidates,
    16 x 16 tail, chain drawn at `temperature`), then the target scores the drafted
    prefix; with a_t = min(1, p_t(v_t) / q_t(v_t)) (p: the target's softmax at the same
    temperature, q: the 16-way distribution v_t was drawn from) the expected accepted
    length of the block is sum_t prod_{i <= t} a_i.
    """
    from vllm_dspine.kernels.retrieval import retrieve_candidates
    from vllm_dspine.kernels.tail import TailTables, refine_last_write

    S = ids.shape[0]
    B, k = cfg.block_size, cfg.head_topk
    K = B - 1
    bridge = bridge_weights(cfg, w)
    tables = TailTables.build(bridge, lm_head, w["norm.weight"])
    lengths = []
    for p in anchor_positions:
        out = block_forward(cfg, w, embed_tokens, lm_head, ids, features,
                            torch.full((S, 1), p))
        cand = retrieve_candidates(out.final_hidden[:, 0, 1:].reshape(S * K, -1), lm_head,
                                   k, cfg.coarse_topk, mode="bf16").view(S, K, k)
        gens = [torch.Generator().manual_seed(int(torch.randint(2**62, (1,), generator=gen)))
                for _ in range(S)]
        prop = refine_last_write(out.pre_write_state[:, 0], out.last_codes[:, 0],
                                 out.last_rms[:, 0], cand, ids[:, p], bridge, w["norm.weight"],
                                 cfg.rms_norm_eps, lm_head,
                                 temperature=torch.full((S,), temperature),
                                 generators=gens, tables=tables)
        draft = prop.draft_token_ids  # [S, K]
        draft_probs = (prop.cand_probs * (prop.cand_ids == draft[..., None])).sum(-1)  # [S, K]
        seq = torch.cat([ids[:, :p + 1], draft], dim=1)  # [S, p + B]
        logits = model(input_ids=seq, use_cache=False).logits[:, p:p + K].float()  # [S, K, V]
        target_probs = (logits / temperature).softmax(-1)
        p_draft = target_probs.gather(2, draft[..., None])[..., 0]  # [S, K]
        accept = (p_draft / draft_probs).clamp(max=1.0)
        lengths.append(accept.cumprod(dim=1).sum(dim=1))
    return torch.cat(lengths).mean().item()


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
        model = _load_target(target_dir)
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


def main(argv: list[str] | None = None) -> None:
    from vllm_dspine.tiny_pair import write_tiny_pair

    ap = argparse.ArgumentParser(description="Write the tiny pair and distil its drafter.")
    ap.add_argument("out_dir")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=TrainSettings.steps)
    ap.add_argument("--habit", type=float, default=0.5,
                    help="strength of the target's planted habit (write_tiny_pair's habit)")
    ap.add_argument("--log-every", type=int, default=50)
    args = ap.parse_args(argv)
    pair = write_tiny_pair(args.out_dir, seed=args.seed, habit=args.habit)
    stats = train_tiny_drafter(pair.target_dir, pair.draft_dir, seed=args.seed,
                               steps=args.steps, log_every=args.log_every)
    print(f"target: {pair.target_dir}")
    print(f"draft:  {pair.draft_dir}")
    print(json.dumps(stats, indent=2))


if __name__ == "__main__":
    main()
