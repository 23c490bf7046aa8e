"""The DSpine drafter in plain PyTorch, readable top to bottom (docs/design.md sections 1.1-1.3).

`block_forward` is the statement of the model: the oracle the vLLM model class
(`model/vllm_model.py`) is tested against, the training forward (`train/`), and the
forward every test of the math uses. It drafts many blocks of many sequences at once
and is differentiable in the drafter's weights:

    features [S, T, F*H] --fc, hidden_norm--> ctx [S, T, H] --k/v per layer--> context K/V
    block rows [S, nb*B, H] (anchor embedding, then mask embeddings)
      -> L x (pre-norm attention over context K/V + the block, SwiGLU MLP, code bridge)
      -> final norm -> logits [S, nb, B, V]

Blocks of one sequence are packed side by side along the row axis and kept apart by a
block-causal mask (`block_attention_mask`): row t of block b sees the context positions
before its anchor and rows 0..t of its own block, nothing of another block. On CUDA with
xformers installed the same attention runs as xformers' memory-efficient kernel over
packed per-block key sequences (`packed_blocks`), without the dense [S, N, T + N] mask.

    S sequences, T sequence length, nb blocks per sequence, B block size, N = nb*B rows
    per sequence, H hidden, F target feature layers, KVH kv heads, D head dim, V vocab.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from vllm_dspine.config import DSpineConfig
from vllm_dspine.kernels.bridge_ref import bridge_message_ref, code_bridge_ref
from vllm_dspine.model.checkpoint import bridge_weights


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Neox-style rotary embedding.  x: [T, heads, D], positions: [T]."""
    D = x.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, D, 2, dtype=torch.float64,
                                             device=positions.device) / D))
    angles = positions.double()[:, None] * inv_freq[None, :]  # [T, D/2]
    cos = angles.cos().float()[:, None, :].to(x.device)
    sin = angles.sin().float()[:, None, :].to(x.device)
    x1, x2 = x[..., : D // 2], x[..., D // 2:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


# ------------------------------------------------------------------------- context
@dataclass
class DraftContext:
    """Draft context K/V of S sequences, per draft layer (docs/design.md section 1.1)."""

    keys: list[torch.Tensor]  # L x [S, T, KVH, D]  k_norm + RoPE applied
    values: list[torch.Tensor]  # L x [S, T, KVH, D]


def context_kv(cfg: DSpineConfig, w: dict[str, torch.Tensor],
               features: torch.Tensor,  # [S, T, F*H]  target layer outputs at 0..T-1
               ) -> DraftContext:
    """ctx = hidden_norm(fc(features)); per layer k = RoPE(k_norm(k_proj(ctx))),
    v = v_proj(ctx). No input layernorm on ctx, as in DFlash."""
    S, T = features.shape[:2]
    kvh, D, eps = cfg.num_key_value_heads, cfg.head_dim, cfg.rms_norm_eps
    ctx = rms_norm(features.float() @ w["fc.weight"].float().t(), w["hidden_norm.weight"],
                   eps)  # [S, T, H]
    pos = torch.arange(T, device=features.device).repeat(S)  # [S*T]
    keys, values = [], []
    for l in range(cfg.num_hidden_layers):
        p = f"layers.{l}.self_attn."
        k = (ctx @ w[p + "k_proj.weight"].t()).reshape(S * T, kvh, D)
        k = rope(rms_norm(k, w[p + "k_norm.weight"], eps), pos, cfg.rope_theta)
        keys.append(k.view(S, T, kvh, D))
        values.append((ctx @ w[p + "v_proj.weight"].t()).view(S, T, kvh, D))
    return DraftContext(keys, values)


def block_attention_mask(anchors: torch.Tensor,  # [S, nb]  anchor positions
                         T: int, B: int, sliding_window: int | None) -> torch.Tensor:
    """Which keys each packed block row may see.  -> bool [S, N, T + N], True = attend.

    Keys are the T context positions, then the N = nb*B block rows. Row t of block b
    (position anchors[b] + t) sees context position j iff j < anchors[b] (the target has
    produced features for 0 .. anchor-1 only) and, with a window, pos - j < window; of
    the block rows it sees rows 0..t of its own block (causal inside the block).
    E.g. nb = 2, B = 2: rows [b0r0, b0r1, b1r0, b1r1] see block rows
    [[1,0,0,0], [1,1,0,0], [0,0,1,0], [0,0,1,1]].
    """
    S, nb = anchors.shape
    N, dev = nb * B, anchors.device
    positions = (anchors[..., None] + torch.arange(B, device=dev)).reshape(S, N)  # [S, N]
    key_pos = torch.arange(T, device=dev)
    row_anchor = anchors.repeat_interleave(B, dim=1)  # [S, N]
    ctx_ok = key_pos[None, None, :] < row_anchor[..., None]  # [S, N, T]
    block_of = torch.arange(N, device=dev) // B
    row_in = torch.arange(N, device=dev) % B
    blk_ok = (block_of[:, None] == block_of[None, :]) & (row_in[None, :] <= row_in[:, None])
    if sliding_window is not None:
        ctx_ok &= (positions[..., None] - key_pos) < sliding_window
        blk_ok &= (row_in[:, None] - row_in[None, :]) < sliding_window
    return torch.cat([ctx_ok, blk_ok.expand(S, N, N)], dim=-1)


# ------------------------------------------------------- the xformers attention path
ATTENTION_CHOICES = ("auto", "sdpa", "xformers")


@functools.lru_cache(maxsize=None)
def _xformers_ops():
    """`xformers.ops`, or None when xformers is not installed."""
    try:
        import xformers.ops
    except ImportError:
        return None
    return xformers.ops


def attention_backend(attention: str, device: torch.device,
                      sliding_window: int | None = None) -> str:
    """`block_forward`'s `attention` choice resolved for tensors on `device`.
    -> "sdpa" or "xformers". "auto": xformers on CUDA when importable and the attention
    is full (xformers' fp32 backward, CUTLASS, has no sliding-window variant of the
    bias; an explicit "xformers" with a window runs forward-only), else SDPA."""
    if attention not in ATTENTION_CHOICES:
        raise ValueError(f"block_forward: attention={attention!r}; expected one of "
                         f"{ATTENTION_CHOICES}")
    usable = device.type == "cuda" and _xformers_ops() is not None
    if attention == "xformers" and not usable:
        why = ("the tensors are on " + device.type if device.type != "cuda"
               else "xformers is not installed")
        raise ValueError(f"block_forward: attention='xformers' needs CUDA tensors and the "
                         f"xformers package, but {why}; move the drafter's tensors to CUDA "
                         f"and `pip install xformers`, or pass attention='sdpa' (or "
                         f"'auto', which falls back to SDPA)")
    if attention == "auto":
        return "xformers" if usable and sliding_window is None else "sdpa"
    return attention


@dataclass
class PackedBlocks:
    """The block-causal mask as xformers takes it: block (s, b) is one query sequence
    (its B rows) against one key sequence (context positions 0..anchor-1, then its own
    B rows), all blocks packed one after another and kept apart by a block-diagonal bias.
    In a block's key sequence key j sits at position j, so xformers' causal-from-bottom-
    right rule (query t of B sees keys 0..anchor+t) is exactly `block_attention_mask`."""

    key_rows: torch.Tensor  # [Mk]  rows of keys.view(S*(T+N), ...), Mk = sum(anchor + B)
    bias: object  # xformers BlockDiagonalCausal[LocalAttention]FromBottomRightMask


def packed_key_rows(anchors: torch.Tensor,  # [S, nb]
                    T: int, B: int) -> tuple[torch.Tensor, list[int]]:
    """Per block, the rows of keys.view(S*(T+N), ...) it attends over, in position order
    (context 0..anchor-1, then its own B rows), blocks one after another.
    -> key rows [Mk], key sequence lengths [S*nb] (anchor + B each; Mk their sum)"""
    S, nb = anchors.shape
    N, dev = nb * B, anchors.device
    col = torch.arange(T + N, device=dev)  # key columns: T context, then N block rows
    ctx = col[:T] < anchors[..., None]  # [S, nb, T]  context before the block's anchor
    own = (col[T:] - T) // B == torch.arange(nb, device=dev)[:, None]  # [nb, N]  its rows
    keep = torch.cat([ctx, own.expand(S, nb, N)], dim=-1)  # [S, nb, T+N]
    s, _, c = keep.nonzero(as_tuple=True)  # row-major: block by block, keys in order
    return s * (T + N) + c, (anchors + B).reshape(-1).tolist()


def packed_blocks(anchors: torch.Tensor,  # [S, nb]
                  T: int, B: int, sliding_window: int | None) -> PackedBlocks:
    """`block_attention_mask` in xformers' form (CUDA, xformers installed)."""
    from xformers.ops.fmha.attn_bias import BlockDiagonalCausalFromBottomRightMask

    key_rows, kv_seqlen = packed_key_rows(anchors, T, B)
    bias = BlockDiagonalCausalFromBottomRightMask.from_seqlens([B] * len(kv_seqlen),
                                                               kv_seqlen)
    if sliding_window is not None:  # also drop keys with position q - k >= window
        bias = bias.make_local_attention_from_bottomright(sliding_window)
    return PackedBlocks(key_rows=key_rows, bias=bias)


# ------------------------------------------------------------------- one draft layer
def _attention(cfg: DSpineConfig, w: dict[str, torch.Tensor], l: int,
               x: torch.Tensor,  # [S, N, H]  normed block rows
               positions: torch.Tensor,  # [S, N]
               context: DraftContext,
               mask: torch.Tensor | PackedBlocks,  # [S, N, T + N] bool (SDPA), or xformers'
               ) -> torch.Tensor:
    p = f"layers.{l}.self_attn."
    S, N, _ = x.shape
    nh, kvh, D, eps = (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                       cfg.rms_norm_eps)
    flat_pos = positions.reshape(-1)  # [S*N]
    q = (x @ w[p + "q_proj.weight"].t()).view(S * N, nh, D)
    k = (x @ w[p + "k_proj.weight"].t()).view(S * N, kvh, D)
    v = (x @ w[p + "v_proj.weight"].t()).view(S, N, kvh, D)
    q = rope(rms_norm(q, w[p + "q_norm.weight"], eps), flat_pos, cfg.rope_theta)
    k = rope(rms_norm(k, w[p + "k_norm.weight"], eps), flat_pos, cfg.rope_theta)
    keys = torch.cat([context.keys[l], k.view(S, N, kvh, D)], dim=1)  # [S, T+N, KVH, D]
    values = torch.cat([context.values[l], v], dim=1)  # [S, T+N, KVH, D]
    group = nh // kvh
    if isinstance(mask, PackedBlocks):  # one packed key sequence per block
        k_packed = keys.reshape(-1, kvh, D)[mask.key_rows]  # [Mk, KVH, D]
        v_packed = values.reshape(-1, kvh, D)[mask.key_rows]  # [Mk, KVH, D]
        out = _xformers_ops().memory_efficient_attention(
            q.view(1, S * N, nh, D),  # the rows are already block by block
            k_packed.repeat_interleave(group, dim=1)[None],  # [1, Mk, nh, D]
            v_packed.repeat_interleave(group, dim=1)[None],
            attn_bias=mask.bias, scale=D ** -0.5)  # [1, S*N, nh, D]
        return out.reshape(S, N, nh * D) @ w[p + "o_proj.weight"].t()
    out = F.scaled_dot_product_attention(
        q.view(S, N, nh, D).transpose(1, 2),  # [S, nh, N, D]
        keys.repeat_interleave(group, dim=2).transpose(1, 2),  # [S, nh, T+N, D]
        values.repeat_interleave(group, dim=2).transpose(1, 2),
        attn_mask=mask[:, None], scale=D ** -0.5)  # [S, nh, N, D]
    return out.transpose(1, 2).reshape(S, N, nh * D) @ w[p + "o_proj.weight"].t()


def _mlp(w: dict[str, torch.Tensor], l: int, x: torch.Tensor) -> torch.Tensor:
    p = f"layers.{l}.mlp."
    return (F.silu(x @ w[p + "gate_proj.weight"].t()) * (x @ w[p + "up_proj.weight"].t())) \
        @ w[p + "down_proj.weight"].t()


# ------------------------------------------------------------------------ the block
@dataclass
class BlocksOut:
    logits: torch.Tensor | None  # [S, nb, B, V]  (None when not asked for)
    final_hidden: torch.Tensor  # [S, nb, B, H]  after the final norm
    pre_write_state: torch.Tensor  # [S, nb, B, H]  last layer's post-MLP residual, before its write
    last_codes: torch.Tensor  # [S, nb, B, C]  that layer's read codes (row 0: sqrt(C) E[anchor])
    last_rms: torch.Tensor  # [S, nb, B]


def block_forward(cfg: DSpineConfig, w: dict[str, torch.Tensor],
                  embed_tokens: torch.Tensor,  # [V, H]  the target's, shared
                  lm_head: torch.Tensor,  # [V, H]  the target's, shared
                  ids: torch.Tensor,  # [S, T]  token ids of each sequence
                  features: torch.Tensor,  # [S, T, F*H]  target layer outputs
                  anchors: torch.Tensor,  # [S, nb]  anchor positions, 0 < p < T
                  logits: bool = True,
                  attention: str = "auto",
                  ) -> BlocksOut:
    """Draft block (s, b) for every sequence s and anchor p = anchors[s, b] at once.

    Row 0 is `ids[s, p]` at position p, rows 1..B-1 the mask token at p+1..p+B-1; the
    context is features[s, :p]. `w` holds the drafter's tensors by checkpoint name
    (docs/design.md section 2); autograd flows through them. attention: "sdpa" (dense block-causal
    mask, any device), "xformers" (CUDA with xformers installed; ValueError otherwise) or
    "auto" (xformers where it can run forward and backward, else SDPA; see
    `attention_backend`); the same attention either way.
    """
    assert ids.ndim == 2 and features.shape[:2] == ids.shape and anchors.ndim == 2
    S, T = ids.shape
    nb, B, L, eps = anchors.shape[1], cfg.block_size, cfg.num_hidden_layers, cfg.rms_norm_eps
    N = nb * B
    dev = ids.device
    context = context_kv(cfg, w, features)
    if attention_backend(attention, features.device, cfg.sliding_window) == "xformers":
        mask = packed_blocks(anchors, T, B, cfg.sliding_window)
    else:
        mask = block_attention_mask(anchors, T, B, cfg.sliding_window)  # [S, N, T+N]
    positions = (anchors[..., None] + torch.arange(B, device=dev)).reshape(S, N)  # [S, N]
    tok = torch.full((S, nb, B), cfg.mask_token_id, dtype=torch.long, device=dev)
    tok[:, :, 0] = ids.gather(1, anchors)
    flat_tok = tok.reshape(-1)  # [S*N]
    is_anchor = (torch.arange(S * N, device=dev) % B) == 0  # [S*N]
    bridge = bridge_weights(cfg, w)

    x = embed_tokens.float()[tok].view(S, N, -1)  # [S, N, H]
    pre_write = codes = rms = None
    for l in range(L):
        p = f"layers.{l}."
        h = x + _attention(cfg, w, l, rms_norm(x, w[p + "input_layernorm.weight"], eps),
                           positions, context, mask)
        x = h + _mlp(w, l, rms_norm(h, w[p + "post_attention_layernorm.weight"], eps))
        pre_write = x
        x_flat, codes, rms = code_bridge_ref(x.reshape(S * N, -1), l, bridge, flat_tok,
                                             is_anchor)
        x = x_flat.view(S, N, -1)
    final = rms_norm(x, w["norm.weight"], eps).view(S, nb, B, -1)  # [S, nb, B, H]
    return BlocksOut(
        logits=final @ lm_head.float().t() if logits else None, final_hidden=final,
        pre_write_state=pre_write.view(S, nb, B, -1),
        last_codes=codes.view(S, nb, B, -1), last_rms=rms.view(S, nb, B))


def last_write_with_predecessor(cfg: DSpineConfig, w: dict[str, torch.Tensor],
                                out: BlocksOut,
                                pred_ids: torch.Tensor,  # [S, nb, B]  token before each row
                                ) -> torch.Tensor:
    """The final state of every row when its last bridge write reads the code of a
    discrete predecessor token u = pred_ids (sqrt(C) E[u]) instead of the predecessor
    row's continuous code: what the serial tail scores (docs/design.md section 1.5,
    `kernels/tail_ref.py` computes the same write for 16 candidates). Training calls it
    with the true previous tokens, the inputs the tail sees on every accepted prefix.
    -> final hidden [S, nb, B, H] (after the final norm; logits = it @ head.T)"""
    bridge = bridge_weights(cfg, w)
    S, nb, B, C = out.last_codes.shape
    pred_codes = math.sqrt(C) * bridge.codebook[pred_ids].float()  # [S, nb, B, C]
    m = bridge_message_ref(out.last_codes.reshape(-1, C), pred_codes.reshape(-1, C),
                           bridge.gate_recv, bridge.gate_pred, bridge.value,
                           bridge.gate_bias)  # [S*nb*B, M]
    x = out.pre_write_state.float() + out.last_rms[..., None].float() * (
        m @ bridge.write[-1].float().t()).view(S, nb, B, -1)  # [S, nb, B, H]
    return rms_norm(x, w["norm.weight"], cfg.rms_norm_eps)
