"""vLLM's CPU platform and CPU ops: rows `cpu-expand-kernel`, `cpu-grouped-rms-norm`,
`cpu-causal-conv1d-fp32`, `cpu-hybrid-block-size-kept` and `kernel-override-scan` of
table.py. The replacement
maths is in `vllm_dspine/kernels/cpu_replacements.py`; this module only wires it in."""

from __future__ import annotations

import functools
import sys
from collections.abc import Mapping

from vllm_dspine.kernels.cpu_replacements import (
    causal_conv1d_fp32_cpu,
    expand_to_tokens_cpu,
    grouped_rms_norm_cpu,
)
from vllm_dspine.plugin.patches.guard import is_applied, mark_applied


def _expand_kernel_impl(output, input_val, cu_num_tokens, replace_from, replace_to,
                        MAX_NUM_TOKENS=None):
    """vLLM's `_expand_kernel_impl` signature; MAX_NUM_TOKENS is a Triton block hint."""
    expand_to_tokens_cpu(output, input_val, cu_num_tokens, replace_from, replace_to)


mark_applied(_expand_kernel_impl, "cpu-expand-kernel")


def patch_expand_kernel() -> None:
    from vllm.utils import cpu_triton_utils

    if is_applied(cpu_triton_utils._expand_kernel_impl, "cpu-expand-kernel"):
        return
    cpu_triton_utils._expand_kernel_impl = _expand_kernel_impl
    # If the CPU platform already registered its overrides (it does so right after the
    # plugins load in a worker, but a process may have done it earlier), point the
    # registered wrapper at the fixed function too.
    from vllm.triton_utils import dispatcher
    from vllm.v1.sample import rejection_sampler

    name = "vllm.v1.sample.rejection_sampler.expand_kernel"
    if name in dispatcher._registry:
        wrapper = rejection_sampler.expand_kernel
        if isinstance(wrapper, dispatcher.KernelOverride):
            wrapper._impl = _expand_kernel_impl
            wrapper.func = _expand_kernel_impl
        dispatcher._registry[name] = (dispatcher._registry[name][0], _expand_kernel_impl)


def patch_grouped_rms_norm() -> None:
    from vllm import _custom_ops

    original = _custom_ops.rms_norm
    if is_applied(original, "cpu-grouped-rms-norm"):
        return

    @functools.wraps(original)
    def rms_norm(out, input, weight, epsilon):
        if weight is not None and weight.ndim == 2 and input.device.type == "cpu":
            if weight.shape[0] != input.shape[0] or weight.shape[1] != input.shape[-1]:
                raise ValueError(f"grouped rms_norm: weight {tuple(weight.shape)} does not "
                                 f"fit input {tuple(input.shape)}")
            return grouped_rms_norm_cpu(out, input, weight, epsilon)
        return original(out, input, weight, epsilon)

    _custom_ops.rms_norm = mark_applied(rms_norm, "cpu-grouped-rms-norm")


def patch_causal_conv1d() -> None:
    from vllm.model_executor.layers.mamba.ops.cpu import gdn_attention
    from vllm.v1.attention.backends.utils import PAD_SLOT_ID

    original = gdn_attention.causal_conv1d_torch
    if is_applied(original, "cpu-causal-conv1d-fp32"):
        return

    @functools.wraps(original)
    def causal_conv1d_torch(x, weight, bias, conv_states, query_start_loc,
                            cache_indices=None, has_initial_state=None, activation="silu",
                            pad_slot_id=PAD_SLOT_ID, **kwargs):
        # kwargs: vLLM's signature takes and ignores more (e.g. metadata).
        return causal_conv1d_fp32_cpu(x, weight, bias, conv_states, query_start_loc,
                                      cache_indices, has_initial_state, activation,
                                      pad_slot_id=PAD_SLOT_ID if pad_slot_id is None
                                      else pad_slot_id)

    gdn_attention.causal_conv1d_torch = mark_applied(causal_conv1d_torch,
                                                     "cpu-causal-conv1d-fp32")


def patch_hybrid_block_size_kept() -> None:
    from vllm.platforms.cpu import CpuPlatform

    original = CpuPlatform.check_and_update_config
    if is_applied(original, "cpu-hybrid-block-size-kept"):
        return

    @functools.wraps(original)
    def check_and_update_config(cls, vllm_config):
        cache = vllm_config.cache_config
        before = cache.block_size
        original(vllm_config)
        model = vllm_config.model_config
        if (before is not None and cache.block_size is not None
                and cache.block_size < before and not cache.user_specified_block_size
                and model is not None and model.is_hybrid):
            cache.block_size = before

    mark_applied(check_and_update_config, "cpu-hybrid-block-size-kept")
    CpuPlatform.check_and_update_config = classmethod(check_and_update_config)


def _rebind_kernels(overrides) -> None:
    """vLLM's `triton_utils.dispatcher._rebind_kernels` (same arguments, same effect): point
    every module attribute holding an original kernel, and every object whose instance
    dict holds one as `kernel`, at its wrapper. The difference: an object whose
    `__dict__` is not a mapping is skipped. llvmlite's `ffi.lib` (loaded with numba, e.g.
    by vLLM's n-gram matcher, which `dspine_lookup` uses) answers every attribute,
    `__dict__` included, with a function wrapper, and vLLM's `vars(value).get` then
    raises, so no engine can register its CPU kernel overrides in that process."""
    wrappers = {id(original): (original, wrapper) for original, wrapper in overrides}

    def wrapper_of(value):
        # identity only, as vLLM's scan: some attribute values fail on hash or eq
        hit = wrappers.get(id(value))
        return hit[1] if hit is not None and hit[0] is value else None

    for module in list(sys.modules.values()):
        namespace = getattr(module, "__dict__", None)
        if not isinstance(namespace, Mapping) or not namespace:
            continue
        for attr, value in list(namespace.items()):
            wrapper = wrapper_of(value)
            if wrapper is not None:
                setattr(module, attr, wrapper)
                continue
            if not hasattr(value, "__dict__"):
                continue
            instance_dict = vars(value)
            if not isinstance(instance_dict, Mapping):
                continue
            wrapper = wrapper_of(instance_dict.get("kernel"))
            if wrapper is None:
                continue
            value.kernel = wrapper
            if not isinstance(value, type):
                value.__dict__.pop("_kernel_arg_names", None)


mark_applied(_rebind_kernels, "kernel-override-scan")


def patch_kernel_override_scan() -> None:
    from vllm.triton_utils import dispatcher

    if is_applied(dispatcher._rebind_kernels, "kernel-override-scan"):
        return
    dispatcher._rebind_kernels = _rebind_kernels
