"""The drafter's configuration: one typed, validated object built from `config.json`.

docs/design.md section 2 fixes the format. Every wrong or missing field raises `ValueError`
naming the field, what was expected and what was found.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field
from typing import Any

ARCHITECTURE = "DSpineDraftModel"
MODEL_TYPE = "dspine"


def _require(d: dict, key: str, kind: type | tuple, where: str) -> Any:
    if key not in d:
        raise ValueError(f"{where}: missing field '{key}'; add it to config.json")
    value = d[key]
    # bool is an int subclass; a flag where a size is expected is a mistake.
    if isinstance(value, bool) and kind is not bool and bool not in (
        kind if isinstance(kind, tuple) else (kind,)
    ):
        raise ValueError(f"{where}: field '{key}' must be {_kind_name(kind)}, got {value!r}")
    if kind is float and isinstance(value, int):
        value = float(value)
    if not isinstance(value, kind):
        raise ValueError(f"{where}: field '{key}' must be {_kind_name(kind)}, got {value!r}")
    return value


def _kind_name(kind: type | tuple) -> str:
    if isinstance(kind, tuple):
        return " or ".join(k.__name__ for k in kind)
    return kind.__name__


def _positive(where: str, name: str, value: int | float) -> None:
    if value <= 0:
        raise ValueError(f"{where}: field '{name}' must be > 0, got {value!r}")


@dataclass(frozen=True)
class DSpineConfig:
    """Sizes and settings of a DSpine drafter.

    H = hidden_size, C = code_dim, M = message_dim, V = vocab_size,
    L = num_hidden_layers, F = len(target_layer_ids).
    """

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    sliding_window: int | None
    vocab_size: int
    torch_dtype: str
    # dspine_config
    block_size: int
    target_layer_ids: tuple[int, ...]
    mask_token_id: int
    causal: bool
    code_dim: int
    message_dim: int
    head_topk: int
    coarse_topk: int
    bridge_eps: float
    # Optional: the token ids candidate retrieval scores (sorted, unique), e.g. the
    # drafter's training vocabulary; None = the whole vocabulary (docs/design.md section 1.4).
    retrieval_vocab: tuple[int, ...] | None = None
    extra: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def num_proposals(self) -> int:
        """Draft tokens per block: every row but the anchor."""
        return self.block_size - 1

    @property
    def num_target_features(self) -> int:
        return len(self.target_layer_ids)

    @property
    def code_scale(self) -> float:
        return math.sqrt(self.code_dim)

    # ------------------------------------------------------------------ parsing
    @classmethod
    def from_dict(cls, d: dict, where: str = "config.json") -> "DSpineConfig":
        if not isinstance(d, dict):
            raise ValueError(f"{where}: expected a JSON object, got {type(d).__name__}")
        archs = d.get("architectures")
        if archs != [ARCHITECTURE]:
            raise ValueError(
                f"{where}: field 'architectures' must be [\"{ARCHITECTURE}\"], got {archs!r}"
            )
        if d.get("model_type") != MODEL_TYPE:
            raise ValueError(
                f"{where}: field 'model_type' must be \"{MODEL_TYPE}\", got {d.get('model_type')!r}"
            )
        ds = _require(d, "dspine_config", dict, where)
        dw = f"{where} dspine_config"

        ints = {}
        for name in ("hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim",
                     "max_position_embeddings", "vocab_size"):
            ints[name] = _require(d, name, int, where)
            _positive(where, name, ints[name])
        rms_norm_eps = _require(d, "rms_norm_eps", float, where)
        _positive(where, "rms_norm_eps", rms_norm_eps)
        rope_theta = _require(d, "rope_theta", float, where)
        _positive(where, "rope_theta", rope_theta)
        sliding_window = d.get("sliding_window")
        if sliding_window is not None:
            if isinstance(sliding_window, bool) or not isinstance(sliding_window, int) \
                    or sliding_window <= 0:
                raise ValueError(
                    f"{where}: field 'sliding_window' must be a positive int or null, "
                    f"got {sliding_window!r}")
        torch_dtype = _require(d, "torch_dtype", str, where)
        if torch_dtype not in ("bfloat16", "float16", "float32"):
            raise ValueError(
                f"{where}: field 'torch_dtype' must be one of bfloat16, float16, float32, "
                f"got {torch_dtype!r}")

        dint = {}
        for name in ("block_size", "code_dim", "message_dim", "head_topk", "coarse_topk"):
            dint[name] = _require(ds, name, int, dw)
            _positive(dw, name, dint[name])
        mask_token_id = _require(ds, "mask_token_id", int, dw)
        causal = _require(ds, "causal", bool, dw)
        bridge_eps = _require(ds, "bridge_eps", float, dw)
        _positive(dw, "bridge_eps", bridge_eps)
        layer_ids = _require(ds, "target_layer_ids", list, dw)
        if not layer_ids or not all(
                isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in layer_ids):
            raise ValueError(
                f"{dw}: field 'target_layer_ids' must be a non-empty list of layer indices "
                f">= 0, got {layer_ids!r}")
        if len(set(layer_ids)) != len(layer_ids) or sorted(layer_ids) != layer_ids:
            raise ValueError(
                f"{dw}: field 'target_layer_ids' must be strictly increasing, got {layer_ids!r}")

        # Relations between fields.
        if ints["num_attention_heads"] % ints["num_key_value_heads"]:
            raise ValueError(
                f"{where}: 'num_attention_heads' ({ints['num_attention_heads']}) must be a "
                f"multiple of 'num_key_value_heads' ({ints['num_key_value_heads']})")
        if not 0 <= mask_token_id < ints["vocab_size"]:
            raise ValueError(
                f"{dw}: field 'mask_token_id' must be a token id in [0, vocab_size="
                f"{ints['vocab_size']}), got {mask_token_id}")
        if dint["block_size"] < 2:
            raise ValueError(f"{dw}: field 'block_size' must be >= 2 (anchor + at least one "
                             f"proposal), got {dint['block_size']}")
        if not causal:
            raise ValueError(f"{dw}: field 'causal' must be true: DSpine's bridge and serial "
                             f"tail assume causal block attention")
        if dint["head_topk"] > dint["coarse_topk"]:
            raise ValueError(
                f"{dw}: 'head_topk' ({dint['head_topk']}) must be <= 'coarse_topk' "
                f"({dint['coarse_topk']})")
        if dint["coarse_topk"] > ints["vocab_size"]:
            raise ValueError(
                f"{dw}: 'coarse_topk' ({dint['coarse_topk']}) must be <= vocab_size "
                f"({ints['vocab_size']})")

        retrieval_vocab = ds.get("retrieval_vocab")
        if retrieval_vocab is not None:
            ok = isinstance(retrieval_vocab, list) and all(
                isinstance(i, int) and not isinstance(i, bool) for i in retrieval_vocab)
            if not ok or any(b <= a for a, b in zip(retrieval_vocab, retrieval_vocab[1:])) \
                    or not retrieval_vocab or retrieval_vocab[0] < 0 \
                    or retrieval_vocab[-1] >= ints["vocab_size"]:
                raise ValueError(
                    f"{dw}: field 'retrieval_vocab' must be a strictly increasing list of "
                    f"token ids in [0, vocab_size={ints['vocab_size']}) (or absent: the "
                    f"whole vocabulary)")
            if len(retrieval_vocab) < dint["coarse_topk"]:
                raise ValueError(
                    f"{dw}: 'retrieval_vocab' has {len(retrieval_vocab)} ids, fewer than "
                    f"'coarse_topk' ({dint['coarse_topk']}); list more ids or drop the field")
            retrieval_vocab = tuple(retrieval_vocab)

        known = {"architectures", "model_type", "dspine_config", "sliding_window",
                 "rms_norm_eps", "rope_theta", "torch_dtype", *ints}
        return cls(
            **ints,
            rms_norm_eps=rms_norm_eps,
            rope_theta=rope_theta,
            sliding_window=sliding_window,
            torch_dtype=torch_dtype,
            block_size=dint["block_size"],
            target_layer_ids=tuple(layer_ids),
            mask_token_id=mask_token_id,
            causal=causal,
            code_dim=dint["code_dim"],
            message_dim=dint["message_dim"],
            head_topk=dint["head_topk"],
            coarse_topk=dint["coarse_topk"],
            bridge_eps=bridge_eps,
            retrieval_vocab=retrieval_vocab,
            extra={k: v for k, v in d.items() if k not in known},
        )

    @classmethod
    def from_pretrained(cls, path: str) -> "DSpineConfig":
        cfg_path = os.path.join(path, "config.json")
        if not os.path.isfile(cfg_path):
            raise ValueError(f"{path}: no config.json; a DSpine draft folder holds config.json "
                             f"and *.safetensors (docs/design.md section 2)")
        with open(cfg_path) as f:
            try:
                d = json.load(f)
            except json.JSONDecodeError as e:
                raise ValueError(f"{cfg_path}: not valid JSON ({e})") from e
        return cls.from_dict(d, where=cfg_path)

    def to_dict(self) -> dict:
        d = asdict(self)
        extra = d.pop("extra")
        ds = {k: d.pop(k) for k in ("block_size", "target_layer_ids", "mask_token_id",
                                    "causal", "code_dim", "message_dim", "head_topk",
                                    "coarse_topk", "bridge_eps")}
        ds["target_layer_ids"] = list(ds["target_layer_ids"])
        vocab = d.pop("retrieval_vocab")
        if vocab is not None:
            ds["retrieval_vocab"] = list(vocab)
        out = {"architectures": [ARCHITECTURE], "model_type": MODEL_TYPE, **d,
               "dspine_config": ds}
        out.update(extra)
        return out

    # --------------------------------------------------------------- the target
    def check_target(self, *, hidden_size: int, vocab_size: int, num_layers: int,
                     where: str = "target") -> None:
        """Refuse a target whose sizes do not fit this drafter."""
        if hidden_size != self.hidden_size:
            raise ValueError(
                f"{where}: hidden size {hidden_size} does not match the drafter's "
                f"'hidden_size' {self.hidden_size}; use the drafter trained for this target")
        if vocab_size != self.vocab_size:
            raise ValueError(
                f"{where}: vocabulary size {vocab_size} does not match the drafter's "
                f"'vocab_size' {self.vocab_size}; use the drafter trained for this target")
        bad = [i for i in self.target_layer_ids if i >= num_layers]
        if bad:
            raise ValueError(
                f"{where}: has {num_layers} decoder layers but the drafter's "
                f"'target_layer_ids' lists {bad}; use the drafter trained for this target")


# The released Qwen3.8-27B drafter's sizes (docs/design.md section 2); used by the memory
# report and benchmarks at real dimensions.
RELEASED_QWEN38_27B = {
    "architectures": [ARCHITECTURE], "model_type": MODEL_TYPE,
    "hidden_size": 5120, "intermediate_size": 17408, "num_hidden_layers": 5,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
    "rms_norm_eps": 1e-6, "rope_theta": 10000000.0, "max_position_embeddings": 262144,
    "sliding_window": 8192, "vocab_size": 248320, "torch_dtype": "bfloat16",
    "dspine_config": {
        "block_size": 16, "target_layer_ids": [1, 16, 31, 46, 61],
        "mask_token_id": 248319, "causal": True,
        "code_dim": 1024, "message_dim": 512, "head_topk": 16, "coarse_topk": 128,
        "bridge_eps": 1e-6,
    },
}
