"""A small hybrid target (Gated DeltaNet + attention) and a DSpine drafter, random weights.

`write_hybrid_pair(out_dir)` writes
  - `target/`: a Qwen3.5 text model (`Qwen3_5ForCausalLM`, `model_type: qwen3_5_text`, the
    architecture vLLM 0.32.0 registers for the dense Qwen3.5 / Qwen3.8-27B text stack): 4
    layers, 3 GDN (`linear_attention`) then 1 gated full attention, in bf16 (vLLM's CPU
    GDN path runs bf16 only), with the tiny pair's byte-level tokenizer (written offline);
  - `draft/`: a random DSpine drafter (docs/design.md section 2) that fits it.

Sizes are what vLLM 0.32.0's CPU kernels accept: GDN key and value head dim 128 (the CPU
prefill kernel refuses 32), attention head dim 64. One key head read by two value heads,
so the GQA mapping of the recurrence is exercised. Like the tiny target, the head carries
a planted successor habit ("a" -> "b", ...) so greedy text is readable and not all ties.

    python -m vllm_dspine.pairs hybrid --out DIR
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_dspine.config import DSpineConfig
from vllm_dspine.model.checkpoint import random_draft_tensors
from vllm_dspine.pairs.tiny import (
    EOS_TOKEN_ID,
    MASK_TOKEN_ID,
    _successor_map,
    small_draft_config,
    write_pair_folders,
)

# 3 GDN layers : 1 attention layer, as Qwen3.5's full_attention_interval 4.
LAYER_TYPES = ("linear_attention", "linear_attention", "linear_attention", "full_attention")

TARGET_SIZES = dict(
    vocab_size=512, hidden_size=256, intermediate_size=512,
    num_hidden_layers=len(LAYER_TYPES),
    # full attention (Qwen3.5: gated output, QK-norm, partial RoPE)
    num_attention_heads=4, num_key_value_heads=2, head_dim=64,
    # Gated DeltaNet
    linear_num_key_heads=1, linear_num_value_heads=2, linear_key_head_dim=128,
    linear_value_head_dim=128, linear_conv_kernel_dim=4,
    max_position_embeddings=2048, rms_norm_eps=1e-6, rope_theta=10000.0,
    partial_rotary_factor=0.25,
)

# Strength of the planted successor habit. Lower than the tiny pair's 0.5: here the GDN
# layers write at full scale (out_proj N(0, 1/(HV V))), and at 0.25 the greedy token is the
# planted successor ~30 % of the time while the distant context (the recurrent state)
# changes it about half the time, so a wrong state commit shows in the output.
HABIT = 0.25
# Logit scale of the head: the argmax is unchanged, the gaps between logits grow (at 1
# about a fifth of the greedy steps are within 0.1 of a tie; at 4 about one in twenty).
HEAD_SCALE = 4.0

# Drafter features: not the last layer (transformers' last `hidden_states` entry is
# final-normed, vLLM's auxiliary output is not; see pairs/tiny.py).
DRAFT_TARGET_LAYER_IDS = (0, 1, 2)


@dataclass(frozen=True)
class HybridPair:
    target_dir: str
    draft_dir: str
    mask_token_id: int = MASK_TOKEN_ID
    eos_token_id: int = EOS_TOKEN_ID


def target_config(layer_types: tuple[str, ...] = LAYER_TYPES) -> dict:
    """The target's config.json (a `Qwen3_5TextConfig`)."""
    s = {**TARGET_SIZES, "num_hidden_layers": len(layer_types)}
    return {
        "architectures": ["Qwen3_5ForCausalLM"],
        "model_type": "qwen3_5_text",
        **{k: s[k] for k in ("vocab_size", "hidden_size", "intermediate_size",
                             "num_hidden_layers", "num_attention_heads",
                             "num_key_value_heads", "head_dim", "linear_num_key_heads",
                             "linear_num_value_heads", "linear_key_head_dim",
                             "linear_value_head_dim", "linear_conv_kernel_dim",
                             "max_position_embeddings", "rms_norm_eps")},
        "layer_types": list(layer_types),
        "full_attention_interval": 4,
        "hidden_act": "silu",
        "attn_output_gate": True,
        "attention_bias": False,
        "attention_dropout": 0.0,
        # No mrope_section: plain 1-D RoPE (Qwen3.5's M-RoPE equals it on text).
        "rope_parameters": {"rope_type": "default", "rope_theta": s["rope_theta"],
                            "partial_rotary_factor": s["partial_rotary_factor"]},
        "mamba_ssm_dtype": "float32",  # as Qwen3.5's configs: fp32 recurrent state
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "dtype": "bfloat16",
        "bos_token_id": None,
        "eos_token_id": EOS_TOKEN_ID,
        "pad_token_id": EOS_TOKEN_ID,
        "initializer_range": 0.02,
        "use_cache": True,
    }


def _target_tensors(seed: int, habit: float,
                    layer_types: tuple[str, ...] = LAYER_TYPES) -> dict[str, torch.Tensor]:
    """HF tensor names of `Qwen3_5ForCausalLM`, drawn in fp32 in a fixed order, saved bf16.

    Qwen3.5's RMSNorms scale by (1 + weight): their weights are 0. GDN: A = exp(A_log) in
    0.1 .. 0.5 and dt_bias 0, so the decays exp(-A softplus(a)) lie mostly in 0.5 .. 0.97
    and the state carries over many tokens; conv taps N(0, 1/W)."""
    s = TARGET_SIZES
    V, Hd, I = s["vocab_size"], s["hidden_size"], s["intermediate_size"]
    nq, nkv, hd = s["num_attention_heads"], s["num_key_value_heads"], s["head_dim"]
    H, HV = s["linear_num_key_heads"], s["linear_num_value_heads"]
    K, Vd, W = s["linear_key_head_dim"], s["linear_value_head_dim"], s["linear_conv_kernel_dim"]
    D = 2 * H * K + HV * Vd  # conv channels: q | k | v
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape: int, std: float) -> torch.Tensor:
        return torch.randn(shape, generator=gen) * std

    embed = randn(V, Hd, std=1.0)  # [V, Hd], unit RMS
    out: dict[str, torch.Tensor] = {"model.embed_tokens.weight": embed}
    for l, kind in enumerate(layer_types):
        p = f"model.layers.{l}."
        out[p + "input_layernorm.weight"] = torch.zeros(Hd)
        out[p + "post_attention_layernorm.weight"] = torch.zeros(Hd)
        if kind == "linear_attention":
            a = p + "linear_attn."
            out[a + "in_proj_qkv.weight"] = randn(D, Hd, std=Hd ** -0.5)
            out[a + "in_proj_z.weight"] = randn(HV * Vd, Hd, std=Hd ** -0.5)
            out[a + "in_proj_b.weight"] = randn(HV, Hd, std=Hd ** -0.5)
            out[a + "in_proj_a.weight"] = randn(HV, Hd, std=Hd ** -0.5)
            out[a + "conv1d.weight"] = randn(D, 1, W, std=W ** -0.5)
            out[a + "dt_bias"] = torch.zeros(HV)
            out[a + "A_log"] = (0.1 + 0.4 * torch.rand(HV, generator=gen)).log()
            out[a + "norm.weight"] = torch.ones(Vd)  # the gated norm scales by weight
            out[a + "out_proj.weight"] = randn(Hd, HV * Vd, std=(HV * Vd) ** -0.5)
        else:
            a = p + "self_attn."
            out[a + "q_proj.weight"] = randn(2 * nq * hd, Hd, std=Hd ** -0.5)  # q | gate
            out[a + "k_proj.weight"] = randn(nkv * hd, Hd, std=Hd ** -0.5)
            out[a + "v_proj.weight"] = randn(nkv * hd, Hd, std=Hd ** -0.5)
            out[a + "o_proj.weight"] = randn(Hd, nq * hd, std=0.3 * (nq * hd) ** -0.5)
            out[a + "q_norm.weight"] = torch.zeros(hd)
            out[a + "k_norm.weight"] = torch.zeros(hd)
        out[p + "mlp.gate_proj.weight"] = randn(I, Hd, std=Hd ** -0.5)
        out[p + "mlp.up_proj.weight"] = randn(I, Hd, std=Hd ** -0.5)
        out[p + "mlp.down_proj.weight"] = randn(Hd, I, std=0.6 * I ** -0.5)
    out["model.norm.weight"] = torch.zeros(Hd)
    # Head row v points at the embeddings of the tokens whose successor is v, plus noise;
    # x HEAD_SCALE so that few greedy steps are bf16 near-ties (top-2 logits within 0.1).
    planted = torch.zeros(V, Hd).index_add_(0, _successor_map(V), embed)  # [V, Hd]
    head = habit * Hd ** -0.5 * planted + randn(V, Hd, std=Hd ** -0.5)
    out["lm_head.weight"] = HEAD_SCALE * head
    return {k: v.to(torch.bfloat16).contiguous() for k, v in out.items()}


def draft_config(sliding_window: int | None = None) -> DSpineConfig:
    """The drafter's config: the target's width and vocabulary, two layers, bf16; every
    layer attends `sliding_window` positions back at most (None: the whole context)."""
    return small_draft_config(TARGET_SIZES, target_layer_ids=DRAFT_TARGET_LAYER_IDS,
                              head_dim=64, code_dim=64, message_dim=32,
                              torch_dtype="bfloat16", sliding_window=sliding_window,
                              where="hybrid draft config")


def write_hybrid_pair(out_dir: str, seed: int = 0, *, habit: float = HABIT,
                      layer_types: tuple[str, ...] = LAYER_TYPES,
                      draft_sliding_window: int | None = None) -> HybridPair:
    """Write `out_dir/target` and `out_dir/draft`; the same seed gives the same bytes.

    habit: strength of the planted successor habit in the target's head (0: none).
    layer_types: the target's layers, "linear_attention" (GDN) or "full_attention", in
    order (at least 3 + 1: the drafter reads layers 0, 1, 2 and never the last).
    draft_sliding_window: the drafter's `sliding_window` (the released drafter's is
    8,192; None: full attention)."""
    if len(layer_types) <= max(DRAFT_TARGET_LAYER_IDS) + 1 or \
            not set(layer_types) <= {"linear_attention", "full_attention"}:
        raise ValueError(f"write_hybrid_pair: layer_types must be at least "
                         f"{max(DRAFT_TARGET_LAYER_IDS) + 2} of 'linear_attention' / "
                         f"'full_attention', got {layer_types!r}")
    cfg = draft_config(draft_sliding_window)
    sizes = {**TARGET_SIZES, "num_hidden_layers": len(layer_types)}
    target_dir, draft_dir = write_pair_folders(
        out_dir, target_config(tuple(layer_types)),
        _target_tensors(seed, habit, tuple(layer_types)), sizes, cfg,
        random_draft_tensors(cfg, seed + 1_000_003, dtype=torch.bfloat16),
        where="hybrid target")
    return HybridPair(target_dir=target_dir, draft_dir=draft_dir)
