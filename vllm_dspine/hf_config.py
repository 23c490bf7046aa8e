"""The drafter's `config.json` as a transformers config, so vLLM can load the folder.

vLLM builds the draft `ModelConfig` through transformers' `AutoConfig`; registering
`model_type: "dspine"` lets it read our folder. DSpine runs inside vLLM's DFlash
plumbing (parallel block drafting, auxiliary target features, context K/V), which reads
`dflash_config`; that view is derived here from `dspine_config`, never stored twice.
"""

from __future__ import annotations

from transformers import AutoConfig, Qwen3Config

from vllm_dspine.config import ARCHITECTURE, MODEL_TYPE, DSpineConfig


class DSpineHFConfig(Qwen3Config):
    model_type = MODEL_TYPE

    def __init__(self, dspine_config: dict | None = None, **kwargs):
        self.dspine_config = dict(dspine_config or {})
        # A plain attribute, not a property: vLLM wraps this config in its EAGLEConfig,
        # which copies `to_dict()` (instance attributes only). Derived here, once.
        kwargs.pop("dflash_config", None)
        self.dflash_config = {
            "mask_token_id": self.dspine_config.get("mask_token_id"),
            "target_layer_ids": list(self.dspine_config.get("target_layer_ids") or []),
            "causal": True,
        }
        # Qwen3Config drops `sliding_window` unless use_sliding_window is set; every
        # DSpine layer uses the same window (docs/design.md section 2), or none.
        if "num_hidden_layers" in kwargs and "layer_types" not in kwargs:
            window = kwargs.get("sliding_window")
            kwargs["use_sliding_window"] = window is not None
            kwargs["layer_types"] = [
                "sliding_attention" if window is not None else "full_attention"
            ] * int(kwargs["num_hidden_layers"])
        super().__init__(**kwargs)



_TOP_LEVEL_FIELDS = ("hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim",
                     "rms_norm_eps", "max_position_embeddings", "sliding_window",
                     "vocab_size")


def dspine_config_of(hf_config) -> DSpineConfig:
    """The validated DSpineConfig of a draft hf_config: ours, or vLLM's EAGLEConfig
    wrapper around it (which copies our attributes). Raises ValueError naming a field."""
    ds = getattr(hf_config, "dspine_config", None)
    if not isinstance(ds, dict):
        raise ValueError("draft config.json has no 'dspine_config' object; this is not a "
                         "DSpine checkpoint (docs/design.md section 2)")
    d = {k: getattr(hf_config, k, None) for k in _TOP_LEVEL_FIELDS}
    rope_theta = getattr(hf_config, "rope_theta", None)
    if rope_theta is None:
        rope_theta = (getattr(hf_config, "rope_parameters", None) or {}).get("rope_theta")
    dtype = getattr(hf_config, "torch_dtype", None) or getattr(hf_config, "dtype", None)
    d.update(architectures=[ARCHITECTURE], model_type=MODEL_TYPE, rope_theta=rope_theta,
             torch_dtype=str(dtype).replace("torch.", "") if dtype is not None else None,
             dspine_config=ds)
    d = {k: v for k, v in d.items() if v is not None or k == "sliding_window"}
    where = f"{getattr(hf_config, '_name_or_path', '') or 'draft'} config.json"
    return DSpineConfig.from_dict(d, where=where)


def register_hf_config() -> None:
    try:
        AutoConfig.register(MODEL_TYPE, DSpineHFConfig)
    except ValueError:
        # Already registered (plugins load once per process, but tests may call twice).
        pass


def is_dspine_draft(speculative_config) -> bool:
    """Whether vLLM's (dflash-method) speculative config carries a DSpine drafter."""
    if speculative_config is None or speculative_config.draft_model_config is None:
        return False
    return isinstance(getattr(speculative_config.draft_model_config.hf_config,
                              "dspine_config", None), dict)
