"""A per-request drafter for tests: an independent check of `model/drafter.py`.

The statement of the model is the batched `block_forward` (many blocks of many
sequences packed along rows, kept apart by a block-causal mask). This helper computes
the same block one request at a time, with the context handed in as explicit K/V at
explicit positions and the mask built from positions alone (no packing, no block
bookkeeping), so a wrong packed mask, a row leaking across blocks or a context offset
in `block_forward` shows as a difference. It shares only `rms_norm`, `rope` and the
bridge reference with the model; it is not used outside tests.

    H hidden, F number of target feature layers, B block size, P context length,
    KVH kv heads, D head dim, V vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from vllm_dspine.config import DSpineConfig
from vllm_dspine.kernels.bridge_ref import code_bridge_ref
from vllm_dspine.model.checkpoint import bridge_weights
from vllm_dspine.model.drafter import rms_norm, rope


@dataclass
class ContextKV:
    """Draft context K/V of one request, per layer."""

    keys: list[torch.Tensor]  # L x [P, KVH, D]  (k_norm + RoPE applied)
    values: list[torch.Tensor]  # L x [P, KVH, D]
    positions: torch.Tensor  # [P]


@dataclass
class BlockOutput:
    final_hidden: torch.Tensor  # [B, H]  after the final norm
    logits: torch.Tensor  # [B, V]
    pre_write_state: torch.Tensor  # [B, H]  last layer's post-MLP residual, before its write
    last_codes: torch.Tensor  # [B, C]  that layer's read codes (row 0: sqrt(C) E[anchor])
    last_rms: torch.Tensor  # [B]
    layer_codes: list[torch.Tensor]  # L x [B, C]


class NaiveDrafter:
    """Weights by checkpoint name (docs/design.md section 2) plus the target's
    embedding/head."""

    def __init__(self, cfg: DSpineConfig, tensors: dict[str, torch.Tensor],
                 embed_tokens: torch.Tensor, lm_head: torch.Tensor):
        self.cfg = cfg
        self.w = {k: v.float() for k, v in tensors.items()}
        self.embed_tokens = embed_tokens.float()  # [V, H]
        self.lm_head = lm_head.float()  # [V, H]
        self.bridge = bridge_weights(cfg, self.w)

    # ---------------------------------------------------------------- context
    def context_kv(self, features: torch.Tensor, positions: torch.Tensor) -> ContextKV:
        """features: [P, F*H] concatenated target layer outputs at `positions` [P]."""
        cfg, w = self.cfg, self.w
        ctx = rms_norm(features.float() @ w["fc.weight"].t(), w["hidden_norm.weight"],
                       cfg.rms_norm_eps)  # [P, H]
        keys, values = [], []
        for l in range(cfg.num_hidden_layers):
            p = f"layers.{l}.self_attn."
            k = (ctx @ w[p + "k_proj.weight"].t()).view(-1, cfg.num_key_value_heads,
                                                        cfg.head_dim)
            v = (ctx @ w[p + "v_proj.weight"].t()).view(-1, cfg.num_key_value_heads,
                                                        cfg.head_dim)
            k = rope(rms_norm(k, w[p + "k_norm.weight"], cfg.rms_norm_eps), positions,
                     cfg.rope_theta)
            keys.append(k)
            values.append(v)
        return ContextKV(keys, values, positions.clone())

    # ------------------------------------------------------------------ block
    def _attention(self, l: int, x: torch.Tensor, positions: torch.Tensor,
                   context: ContextKV | None) -> torch.Tensor:
        cfg, w = self.cfg, self.w
        p = f"layers.{l}.self_attn."
        nh, kvh, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        q = (x @ w[p + "q_proj.weight"].t()).view(-1, nh, D)
        k = (x @ w[p + "k_proj.weight"].t()).view(-1, kvh, D)
        v = (x @ w[p + "v_proj.weight"].t()).view(-1, kvh, D)
        q = rope(rms_norm(q, w[p + "q_norm.weight"], cfg.rms_norm_eps), positions,
                 cfg.rope_theta)
        k = rope(rms_norm(k, w[p + "k_norm.weight"], cfg.rms_norm_eps), positions,
                 cfg.rope_theta)
        if context is not None:
            k = torch.cat([context.keys[l], k])
            v = torch.cat([context.values[l], v])
            key_pos = torch.cat([context.positions, positions])
        else:
            key_pos = positions
        # Causal inside the block, all earlier context visible, within the window:
        # query at position i sees key position j iff j <= i and i - j < window.
        allowed = key_pos[None, :] <= positions[:, None]  # [B, P+B]
        if cfg.sliding_window is not None:
            allowed &= (positions[:, None] - key_pos[None, :]) < cfg.sliding_window
        group = nh // kvh
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) / D**0.5
        scores = scores.masked_fill(~allowed[None], float("-inf"))
        out = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(-1, nh * D)
        return out @ w[p + "o_proj.weight"].t()

    def _mlp(self, l: int, x: torch.Tensor) -> torch.Tensor:
        w = self.w
        p = f"layers.{l}.mlp."
        return (F.silu(x @ w[p + "gate_proj.weight"].t()) * (x @ w[p + "up_proj.weight"].t())) \
            @ w[p + "down_proj.weight"].t()

    def forward_block(self, anchor_id: int, anchor_position: int,
                      context: ContextKV | None) -> BlockOutput:
        """Draft one block: row 0 the anchor at `anchor_position`, rows 1.. the mask."""
        cfg, w = self.cfg, self.w
        B = cfg.block_size
        ids = torch.full((B,), cfg.mask_token_id, dtype=torch.long)
        ids[0] = anchor_id
        positions = anchor_position + torch.arange(B)
        is_anchor = torch.zeros(B, dtype=torch.bool)
        is_anchor[0] = True

        x = self.embed_tokens[ids]  # [B, H]
        layer_codes = []
        pre_write = codes = rms = None
        for l in range(cfg.num_hidden_layers):
            p = f"layers.{l}."
            h = x + self._attention(l, rms_norm(x, w[p + "input_layernorm.weight"],
                                                cfg.rms_norm_eps), positions, context)
            x = h + self._mlp(l, rms_norm(h, w[p + "post_attention_layernorm.weight"],
                                          cfg.rms_norm_eps))
            pre_write = x
            x, codes, rms = code_bridge_ref(x, l, self.bridge, ids, is_anchor)
            layer_codes.append(codes)
        final = rms_norm(x, w["norm.weight"], cfg.rms_norm_eps)
        return BlockOutput(final_hidden=final, logits=final @ self.lm_head.t(),
                           pre_write_state=pre_write, last_codes=codes, last_rms=rms,
                           layer_codes=layer_codes)
