"""A tiny target + drafter pair written offline, for tests and CPU examples.

`write_tiny_pair(out_dir)` writes
  - `target/`: a dense fp32 Qwen3 (`Qwen3ForCausalLM`, HF layout) that vLLM 0.32.0 runs on
    CPU, with a byte-level tokenizer built with `tokenizers` (no hub access);
  - `draft/`: a random DSpine drafter (docs/design.md section 2) that fits the target.

The target is random except for one planted habit: its output head favours a fixed
successor of the current byte ("a" -> "b", ..., "~" -> " "), so greedy text is readable
and predictable enough to accept drafts, while the random layers keep it context-dependent.

    python -m vllm_dspine.pairs tiny --out DIR   (the pair with its distilled drafter)
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch
from safetensors.torch import save_file

from vllm_dspine.model.checkpoint import random_draft_tensors, save_draft_checkpoint
from vllm_dspine.config import ARCHITECTURE, MODEL_TYPE, DSpineConfig

# Tokenizer layout: ids 0..255 are the bytes, then the special tokens, then reserved fill.
EOS_TOKEN = "<|endoftext|>"
MASK_TOKEN = "<|mask|>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = (EOS_TOKEN, MASK_TOKEN, IM_START, IM_END)
EOS_TOKEN_ID = 256
MASK_TOKEN_ID = 257

# A ChatML template: what `vllm serve` renders for /v1/chat/completions.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

TARGET_SIZES = dict(
    vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=6,
    num_attention_heads=4, num_key_value_heads=2, head_dim=32,  # vLLM CPU needs head_dim>=32
    max_position_embeddings=2048, rms_norm_eps=1e-6, rope_theta=10000.0,
)


@dataclass(frozen=True)
class TinyPair:
    target_dir: str
    draft_dir: str
    mask_token_id: int = MASK_TOKEN_ID
    eos_token_id: int = EOS_TOKEN_ID


# ------------------------------------------------------------------------- tokenizer
def _byte_chars() -> list[str]:
    """The printable stand-in character of each byte, as byte-level BPE vocabularies use.

    Printable Latin-1 bytes stand for themselves; the others are moved to 256 + k so that
    every token string is visible text.
    """
    keep = set(range(ord("!"), ord("~") + 1)) | set(range(0xA1, 0xAD)) | set(range(0xAE, 0x100))
    chars, k = [], 0
    for b in range(256):
        if b in keep:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + k))
            k += 1
    return chars


def _write_tokenizer(target_dir: str, vocab_size: int) -> None:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    n_reserved = vocab_size - 256 - len(SPECIAL_TOKENS)
    if n_reserved < 0:
        raise ValueError(f"write_tiny_pair: vocab_size must be >= {256 + len(SPECIAL_TOKENS)} "
                         f"(256 bytes + special tokens), got {vocab_size}")
    vocab = {c: i for i, c in enumerate(_byte_chars())}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))  # no merges: one token per byte
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    specials = list(SPECIAL_TOKENS) + [f"<|reserved_{i}|>" for i in range(n_reserved)]
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    assert tok.get_vocab_size() == vocab_size
    assert tok.token_to_id(EOS_TOKEN) == EOS_TOKEN_ID
    assert tok.token_to_id(MASK_TOKEN) == MASK_TOKEN_ID
    tok.save(os.path.join(target_dir, "tokenizer.json"))

    added = {str(256 + i): {"content": s, "lstrip": False, "normalized": False,
                            "rstrip": False, "single_word": False, "special": True}
             for i, s in enumerate(specials)}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "bos_token": None,
        "eos_token": EOS_TOKEN,
        "pad_token": EOS_TOKEN,
        "mask_token": MASK_TOKEN,
        "unk_token": None,
        "additional_special_tokens": [IM_START, IM_END],
        "clean_up_tokenization_spaces": False,
        "model_max_length": TARGET_SIZES["max_position_embeddings"],
        "chat_template": CHAT_TEMPLATE,
    }
    _write_json(os.path.join(target_dir, "tokenizer_config.json"), config)


# ---------------------------------------------------------------------------- target
def _successor_map(vocab_size: int) -> torch.Tensor:
    """succ[t]: the byte the planted habit predicts after token t (printable ASCII cycle)."""
    t = torch.arange(vocab_size)
    lo, n = 32, 95  # " " .. "~"
    return lo + torch.where((t >= lo) & (t < lo + n), t - lo + 1, t) % n  # [V]


def _target_tensors(seed: int, habit: float) -> dict[str, torch.Tensor]:
    s = TARGET_SIZES
    V, H, I = s["vocab_size"], s["hidden_size"], s["intermediate_size"]
    D, nq, nkv = s["head_dim"], s["num_attention_heads"], s["num_key_value_heads"]
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape: int, std: float) -> torch.Tensor:
        return torch.randn(shape, generator=gen) * std

    # Unit-RMS embeddings; each layer writes ~0.3 RMS back, so after 6 layers the current
    # token's embedding still stands out in the residual stream.
    embed = randn(V, H, std=1.0)  # [V, H]
    out: dict[str, torch.Tensor] = {"model.embed_tokens.weight": embed}
    for l in range(s["num_hidden_layers"]):
        p = f"model.layers.{l}."
        out[p + "input_layernorm.weight"] = torch.ones(H)
        out[p + "post_attention_layernorm.weight"] = torch.ones(H)
        out[p + "self_attn.q_proj.weight"] = randn(nq * D, H, std=H ** -0.5)
        out[p + "self_attn.k_proj.weight"] = randn(nkv * D, H, std=H ** -0.5)
        out[p + "self_attn.v_proj.weight"] = randn(nkv * D, H, std=H ** -0.5)
        out[p + "self_attn.o_proj.weight"] = randn(H, nq * D, std=0.3 * (nq * D) ** -0.5)
        out[p + "self_attn.q_norm.weight"] = torch.ones(D)
        out[p + "self_attn.k_norm.weight"] = torch.ones(D)
        out[p + "mlp.gate_proj.weight"] = randn(I, H, std=H ** -0.5)
        out[p + "mlp.up_proj.weight"] = randn(I, H, std=H ** -0.5)
        out[p + "mlp.down_proj.weight"] = randn(H, I, std=0.6 * I ** -0.5)
    out["model.norm.weight"] = torch.ones(H)
    # Head row v points at the embeddings of the tokens whose successor is v, plus noise.
    succ = _successor_map(V)  # [V]
    planted = torch.zeros(V, H).index_add_(0, succ, embed)  # [V, H]
    out["lm_head.weight"] = habit * H ** -0.5 * planted + randn(V, H, std=H ** -0.5)
    return {k: v.contiguous() for k, v in out.items()}


def _target_config() -> dict:
    s = TARGET_SIZES
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        **{k: s[k] for k in ("vocab_size", "hidden_size", "intermediate_size",
                             "num_hidden_layers", "num_attention_heads",
                             "num_key_value_heads", "head_dim", "max_position_embeddings",
                             "rms_norm_eps")},
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "rope_theta": s["rope_theta"],  # transformers < 5 and vLLM read this ...
        "rope_parameters": {"rope_type": "default", "rope_theta": s["rope_theta"]},  # ... 5.x
        "rope_scaling": None,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": s["num_hidden_layers"],
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "dtype": "float32",
        "bos_token_id": None,
        "eos_token_id": EOS_TOKEN_ID,
        "pad_token_id": EOS_TOKEN_ID,
        "initializer_range": 0.02,
        "use_cache": True,
    }


# Not the target's last layer (5): transformers' last `hidden_states` entry is
# final-normed while vLLM's auxiliary output is the raw residual stream, and the tests
# and the distillation compute features with transformers.
def small_draft_config(sizes: dict, *, target_layer_ids: tuple[int, ...], head_dim: int,
                       code_dim: int, message_dim: int, torch_dtype: str,
                       sliding_window: int | None = None, where: str) -> DSpineConfig:
    """A two-layer test drafter's config for a target of `sizes` (its width, vocabulary,
    norm and RoPE settings); the tiny and the hybrid pair differ in the rest."""
    return DSpineConfig.from_dict({
        "architectures": [ARCHITECTURE], "model_type": MODEL_TYPE,
        "hidden_size": sizes["hidden_size"], "intermediate_size": sizes["intermediate_size"],
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": head_dim, "rms_norm_eps": sizes["rms_norm_eps"],
        "rope_theta": sizes["rope_theta"],
        "max_position_embeddings": sizes["max_position_embeddings"],
        "sliding_window": sliding_window, "vocab_size": sizes["vocab_size"],
        "torch_dtype": torch_dtype,
        "dspine_config": {
            "block_size": 16, "target_layer_ids": list(target_layer_ids),
            "mask_token_id": MASK_TOKEN_ID, "causal": True, "code_dim": code_dim,
            "message_dim": message_dim, "head_topk": 16, "coarse_topk": 64,
            "bridge_eps": 1e-6,
        },
    }, where=where)


def draft_config(target_layer_ids: tuple[int, ...] = (1, 3, 4),
                 sliding_window: int | None = None) -> DSpineConfig:
    """The tiny drafter's config: the target's width and vocabulary, two layers."""
    return small_draft_config(TARGET_SIZES, target_layer_ids=target_layer_ids, head_dim=32,
                              code_dim=48, message_dim=24, torch_dtype="float32",
                              sliding_window=sliding_window, where="tiny draft config")


def _write_json(path: str, obj: dict) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.write("\n")


def write_pair_folders(out_dir: str, target_config: dict,
                       target_tensors: dict[str, torch.Tensor], sizes: dict,
                       draft_cfg: DSpineConfig, draft_tensors: dict[str, torch.Tensor],
                       where: str) -> tuple[str, str]:
    """`out_dir/target` (config, generation config, weights, the byte-level tokenizer)
    and `out_dir/draft` (the drafter checked against the target first) of a test pair;
    returns (target_dir, draft_dir)."""
    target_dir = os.path.join(out_dir, "target")
    draft_dir = os.path.join(out_dir, "draft")
    os.makedirs(target_dir, exist_ok=True)
    os.makedirs(draft_dir, exist_ok=True)
    _write_json(os.path.join(target_dir, "config.json"), target_config)
    _write_json(os.path.join(target_dir, "generation_config.json"), {
        "eos_token_id": EOS_TOKEN_ID, "pad_token_id": EOS_TOKEN_ID, "do_sample": False,
    })
    save_file(target_tensors, os.path.join(target_dir, "model.safetensors"),
              metadata={"format": "pt"})
    _write_tokenizer(target_dir, sizes["vocab_size"])
    draft_cfg.check_target(hidden_size=sizes["hidden_size"], vocab_size=sizes["vocab_size"],
                           num_layers=sizes["num_hidden_layers"], where=where)
    save_draft_checkpoint(draft_dir, draft_cfg, draft_tensors)
    return target_dir, draft_dir


def write_tiny_pair(out_dir: str, seed: int = 0, *, habit: float = 0.5,
                    target_layer_ids: tuple[int, ...] = (1, 3, 4),
                    draft_sliding_window: int | None = None,
                    trained: bool = False) -> TinyPair:
    """Write `out_dir/target` and `out_dir/draft`; the same seed gives the same bytes.

    habit: strength of the planted successor habit in the target's head (0: pure noise).
    trained: distil the drafter from the target (`train.tiny_drafter.train_tiny_drafter`, about
    a minute and a half on 2 CPU cores) instead of leaving it random.
    """
    cfg = draft_config(target_layer_ids, draft_sliding_window)
    # A different stream from the target's, so the drafter is not a copy of its weights.
    target_dir, draft_dir = write_pair_folders(
        out_dir, _target_config(), _target_tensors(seed, habit), TARGET_SIZES, cfg,
        random_draft_tensors(cfg, seed + 1_000_003), where="tiny target")
    if trained:
        from vllm_dspine.train import tiny_drafter  # transformers + training: only when asked

        tiny_drafter.train_tiny_drafter(target_dir, draft_dir, seed=seed, evaluate=False)
    return TinyPair(target_dir=target_dir, draft_dir=draft_dir)
