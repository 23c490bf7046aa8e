"""Front end: engine arguments and request parameters (rows `dspine-method` and
`min-p-logit-bias-for-dspine` of table.py, which say why and when each can go)."""

from __future__ import annotations

import functools

from vllm_dspine.plugin.patches.guard import is_applied, mark_applied


def patch_dspine_method() -> None:
    from vllm.engine.arg_utils import EngineArgs

    from vllm_dspine.plugin.options import split_dspine_options

    original = EngineArgs.create_speculative_config
    if is_applied(original, "dspine-method"):
        return

    @functools.wraps(original)
    def create_speculative_config(self, target_model_config, target_parallel_config):
        spec = self.speculative_config
        if not (isinstance(spec, dict) and spec.get("method") == "dspine"):
            return original(self, target_model_config, target_parallel_config)
        vllm_spec, options = split_dspine_options(spec)
        self.speculative_config = vllm_spec
        try:
            config = original(self, target_model_config, target_parallel_config)
        finally:
            self.speculative_config = spec
        from vllm_dspine.proposer.validation import (
            shortens_verification,
            validate_dspine_speculative_config,
        )

        cfg = validate_dspine_speculative_config(config, options)
        resolved = config.draft_model_config.hf_config.dspine_options
        if shortens_verification(resolved, cfg):
            if self.async_scheduling:
                raise ValueError(
                    "async_scheduling=True cannot carry DSpine's shortened verification "
                    "(dspine_verify 'dynamic' or dspine_verify_max < "
                    f"{cfg.num_proposals}): vLLM's asynchronous scheduler reserves a fixed "
                    "number of draft slots before the drafter runs. Leave async "
                    "scheduling unset (DSpine turns it off) or set dspine_verify 'fixed'")
            if self.async_scheduling is None:
                self.async_scheduling = False
        return config

    EngineArgs.create_speculative_config = mark_applied(create_speculative_config,
                                                        "dspine-method")


def patch_min_p_logit_bias() -> None:
    from vllm.sampling_params import SamplingParams

    original = SamplingParams._validate_spec_decode
    if is_applied(original, "min-p-logit-bias-for-dspine"):
        return

    @functools.wraps(original)
    def _validate_spec_decode(self, speculative_config):
        from vllm_dspine.hf_config import is_dspine_draft

        if is_dspine_draft(speculative_config):
            return  # min_p and logit_bias are applied exactly by DSpine's verifier
        return original(self, speculative_config)

    SamplingParams._validate_spec_decode = mark_applied(_validate_spec_decode,
                                                        "min-p-logit-bias-for-dspine")
