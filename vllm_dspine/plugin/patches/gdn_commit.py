"""Hybrid Gated DeltaNet targets under DSpine: the replay commit (docs/hybrid.md),
rows `gdn-*` of table.py, one function per vLLM symbol. Each installed wrapper is a
no-op unless `commit.runner.replay_active` (a DSpine draft on a Qwen3.5 / Qwen3-Next
text target, on CPU); the validation refuses every other hybrid target and CUDA at
start. The commit's logic is in `vllm_dspine/commit/runner.py`."""

from __future__ import annotations

import dataclasses
import functools

from vllm_dspine.plugin.patches.guard import (
    PINNED_VLLM_VERSION,
    installed_vllm_version,
    is_applied,
    mark_applied,
)


def patch_gdn_layer_init() -> None:
    from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import (
        QwenGatedDeltaNetAttention,
    )

    original = QwenGatedDeltaNetAttention.__init__
    if is_applied(original, "gdn-layer-one-slot"):
        return

    @functools.wraps(original)
    def __init__(self, config, vllm_config, prefix="", gqa_interleaved_layout=False,
                 reduce_results=True):
        original(self, config, vllm_config, prefix, gqa_interleaved_layout, reduce_results)
        from vllm_dspine.commit.runner import replay_active

        if not replay_active(vllm_config):
            return
        for attr in ("num_spec", "enable_fused_gdn_spec_decode"):
            if not hasattr(self, attr):
                raise RuntimeError(f"vllm-dspine: QwenGatedDeltaNetAttention has no `{attr}` "
                                   f"after __init__ in vLLM {installed_vllm_version()}")
        self.num_spec = 0
        self.enable_fused_gdn_spec_decode = False
        self._dspine_replay = True
        self._dspine_step = None

    QwenGatedDeltaNetAttention.__init__ = mark_applied(__init__, "gdn-layer-one-slot")


def patch_gdn_state_shape_from_config() -> None:
    from vllm.model_executor.layers.mamba.mamba_utils import MambaStateShapeCalculator
    from vllm.model_executor.models.qwen3_5 import Qwen3_5ForCausalLMBase
    from vllm.model_executor.models.qwen3_next import Qwen3NextForCausalLM

    for cls in (Qwen3_5ForCausalLMBase, Qwen3NextForCausalLM):
        original = cls.get_mamba_state_shape_from_config
        if is_applied(original, "gdn-state-shape-one-slot"):
            continue
        what = f"{cls.__name__}.get_mamba_state_shape_from_config"

        def make(original, what):
            @functools.wraps(original)
            def get_mamba_state_shape_from_config(_cls, vllm_config):
                shapes = original(vllm_config)
                from vllm_dspine.commit.runner import replay_active

                if not replay_active(vllm_config):
                    return shapes
                hf = vllm_config.model_config.hf_text_config
                args = (vllm_config.parallel_config.tensor_parallel_size,
                        hf.linear_num_key_heads, hf.linear_num_value_heads,
                        hf.linear_key_head_dim, hf.linear_value_head_dim,
                        hf.linear_conv_kernel_dim)
                K = vllm_config.speculative_config.num_speculative_tokens
                if tuple(MambaStateShapeCalculator.gated_delta_net_state_shape(*args, K)) \
                        != tuple(shapes):
                    raise RuntimeError(f"vllm-dspine: {what} no longer gives the GDN state "
                                       f"shapes of vLLM {PINNED_VLLM_VERSION}")
                return MambaStateShapeCalculator.gated_delta_net_state_shape(*args, 0)

            mark_applied(get_mamba_state_shape_from_config, "gdn-state-shape-one-slot")
            return classmethod(get_mamba_state_shape_from_config)

        setattr(cls, "get_mamba_state_shape_from_config", make(original, what))


def patch_gdn_kv_cache_spec() -> None:
    from vllm.model_executor.layers.mamba.abstract import MambaBase
    from vllm.v1.kv_cache_interface import MambaSpec

    original = MambaBase.get_kv_cache_spec
    if is_applied(original, "gdn-kv-spec-one-block"):
        return

    @functools.wraps(original)
    def get_kv_cache_spec(self, vllm_config):
        spec = original(self, vllm_config)
        if getattr(self, "_dspine_replay", False) and isinstance(spec, MambaSpec):
            spec = dataclasses.replace(spec, num_speculative_blocks=0)
        return spec

    MambaBase.get_kv_cache_spec = mark_applied(get_kv_cache_spec, "gdn-kv-spec-one-block")


def patch_gdn_cpu_core() -> None:
    from vllm.model_executor.layers.mamba.ops.cpu import gdn_attention

    original = gdn_attention._cpu_gdn_attention_nonspec
    if is_applied(original, "gdn-cpu-core-replay"):
        return

    @functools.wraps(original)
    def _cpu_gdn_attention_nonspec(layer, attn_metadata_i, mixed_qkv, b, a, core_attn_out):
        if not getattr(layer, "_dspine_replay", False):
            return original(layer, attn_metadata_i, mixed_qkv, b, a, core_attn_out)
        from vllm_dspine.commit.runner import gdn_core_cpu

        return gdn_core_cpu(original, layer, attn_metadata_i, mixed_qkv, b, a, core_attn_out)

    gdn_attention._cpu_gdn_attention_nonspec = mark_applied(_cpu_gdn_attention_nonspec,
                                                            "gdn-cpu-core-replay")


def patch_gdn_commit() -> None:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    original = GPUModelRunner._update_states_after_model_execute
    if is_applied(original, "gdn-commit-after-sampling"):
        return

    @functools.wraps(original)
    def _update_states_after_model_execute(self, output_token_ids, scheduler_output):
        active = getattr(self, "_dspine_replay_active", None)
        if active is None:
            from vllm_dspine.commit.runner import replay_active

            active = self._dspine_replay_active = replay_active(self.vllm_config)
        if not active:
            return original(self, output_token_ids, scheduler_output)
        if self.cache_config.mamba_cache_mode == "none":
            original(self, output_token_ids, scheduler_output)
        elif self.cache_config.mamba_cache_mode != "align":
            raise RuntimeError("vllm-dspine: the GDN replay commit knows mamba cache modes "
                               f"'none' and 'align', got {self.cache_config.mamba_cache_mode!r}")
        from vllm_dspine.commit.runner import commit_step
        from vllm_dspine.step_profile import timed

        with timed("commit"):  # the replay (bench/hybrid_commit.py reads it)
            commit_step(self, output_token_ids)
        num_reqs = output_token_ids.size(0)
        self.num_accepted_tokens.gpu[:num_reqs].fill_(1)
        self.input_batch.num_accepted_tokens_cpu_tensor[:num_reqs].fill_(1)
        if self.cache_config.mamba_cache_mode == "align":
            self.num_accepted_tokens_event.record()

    GPUModelRunner._update_states_after_model_execute = mark_applied(
        _update_states_after_model_execute, "gdn-commit-after-sampling")


def patch_gdn_mamba_bufs() -> None:
    from vllm.v1.worker import mamba_utils
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    original = GPUModelRunner._get_mamba_bufs
    if is_applied(original, "gdn-mamba-bufs-without-spec"):
        return

    @functools.wraps(original)
    def _get_mamba_bufs(self):
        from vllm_dspine.commit.runner import replay_active

        if self._mamba_bufs is None and replay_active(self.vllm_config):
            self._mamba_bufs = mamba_utils.MambaBuffers.create(
                max_num_reqs=self.max_num_reqs, kv_cache_config=self.kv_cache_config,
                copy_funcs=self._get_mamba_state_copy_funcs(),
                make_buffer=self._make_buffer, device=self.device,
                with_postprocess_align=False)
        return original(self)

    GPUModelRunner._get_mamba_bufs = mark_applied(_get_mamba_bufs,
                                                  "gdn-mamba-bufs-without-spec")
