"""The table of every change vllm-dspine makes to vLLM: one `Patch` row each.

`apply_patches()` (apply.py) walks `PATCHES` in order; `check_source.py` checks the same
rows against another vLLM's source without running it; README.md in this folder is
rendered from the rows (readme.py: `python -m vllm_dspine.plugin.patches.readme --write`;
tests/test_vllm_patches.py fails when it is out of date).

A row names the vLLM symbols it changes and the ones it relies on (`Symbol`), each as
found in the pinned vLLM: the parameters `inspect.signature` reports on the attribute
(a classmethod without `cls`) and the names its body must still refer to. Pure data:
importing this module imports neither torch nor vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass

GPU_RUNNER = "vllm.v1.worker.gpu_model_runner:GPUModelRunner"
GDN_OPS = "vllm.model_executor.layers.mamba.ops.cpu.gdn_attention"
QWEN_GDN = ("vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn:"
            "QwenGatedDeltaNetAttention")
KV_CACHE_UTILS = "vllm.v1.core.kv_cache_utils"
QWEN2VL_TV_MODULE = "transformers.models.qwen2_vl.image_processing_qwen2_vl"
QWEN2VL_PIL_MODULE = "transformers.models.qwen2_vl.image_processing_pil_qwen2_vl"

# When `apply_patches()` installs a row (apply.py evaluates these).
WHEN = {
    "always": "always",
    "cpu": "on the CPU platform",
    "no-torchvision": "when torchvision is not installed",
    "step-profile": "when VLLM_DSPINE_STEP_PROFILE is set",
}


@dataclass(frozen=True)
class Symbol:
    """A vLLM symbol as the pinned version has it."""

    path: str  # "module:Qual.name", e.g. "vllm._custom_ops:rms_norm"
    params: tuple[str, ...] | None = None  # parameters in order; None: not checked
    uses: tuple[str, ...] = ()  # names its body still refers to (callees, attributes)
    imported_from: str | None = None  # "module:name" the name is imported as there
    # Checked in the source text only: importing the module is what the patch avoids.
    read_source: bool = False

    @property
    def module(self) -> str:
        return self.path.partition(":")[0]

    @property
    def qualname(self) -> str:
        return self.path.partition(":")[2]

    def describe(self) -> str:
        parts = [f"`{self.path}`"]
        if self.params is not None:
            parts.append(f"({', '.join(self.params)})")
        if self.uses:
            parts.append(f"refers to {', '.join(f'`{u}`' for u in self.uses)}")
        if self.imported_from:
            parts.append(f"imported from `{self.imported_from}`")
        return " ".join(parts)


@dataclass(frozen=True)
class Patch:
    id: str
    apply: str  # "module:function" under vllm_dspine.plugin.patches
    changes: tuple[Symbol, ...]  # what it replaces or wraps
    checks: tuple[Symbol, ...]  # what else it relies on
    when: str  # a key of WHEN: when apply_patches() installs it
    acts_on: str  # whose behaviour the installed patch changes
    why: str
    how: str
    retire: str  # the upstream vLLM change that lets it go

    def __post_init__(self):
        assert self.when in WHEN, self.when
        assert self.changes, f"{self.id}: a patch changes at least one symbol"


def _runner(name: str, params=None, uses=()) -> Symbol:
    return Symbol(f"{GPU_RUNNER}.{name}", params, uses)


PATCHES: tuple[Patch, ...] = (
    # ------------------------------------------------ front end: engine arguments
    Patch(
        id="dspine-method",
        apply="engine_args:patch_dspine_method",
        changes=(Symbol("vllm.engine.arg_utils:EngineArgs.create_speculative_config",
                        ("self", "target_model_config", "target_parallel_config")),),
        checks=(
            Symbol("vllm.engine.arg_utils:EngineArgs.async_scheduling"),
            _runner("_get_spec_decode_draft_probs", ("self", "spec_decode_metadata")),
            _runner("_get_draft_token_ids_cpu"),
            Symbol("vllm.v1.core.sched.scheduler:Scheduler.update_draft_token_ids",
                   ("self", "draft_token_ids")),
            Symbol("vllm.v1.worker.gpu_input_batch:CachedRequestState.prev_num_draft_len"),
        ),
        when="always",
        acts_on='speculative configs with `"method": "dspine"`',
        why="vLLM's `SpeculativeConfig.method` is a strict Literal, so `dspine` is refused "
            "before any plugin code runs. DSpine runs on vLLM's DFlash plumbing (parallel "
            "block drafting, auxiliary target features, draft context K/V).",
        how="The DSpine keys are taken out and checked (`plugin/options.py`), the rest is "
            "handed to vLLM as `method: dflash` (the drafter is recognised by its "
            "`dspine_config`), and the built config is validated "
            "(`proposer/validation.py`). With verification shorter than the block "
            "(`dspine_verify` 'dynamic' or `dspine_verify_max` < 15) asynchronous "
            "scheduling is turned off when unset and an explicit `async_scheduling=True` "
            "is refused: vLLM's asynchronous scheduler reserves a fixed number of draft "
            "slots before the drafter runs, its synchronous one takes per-request draft "
            "lists of any length and its runner slices each request's cached sparse q to "
            "the verified prefix (the symbols under 'checked').",
        retire="vLLM lets a plugin register a speculative method with its own keys: "
               "0.34.0 does (`register_speculative_method`, `speculator_options`; "
               "docs/compatibility.md).",
    ),
    Patch(
        id="min-p-logit-bias-for-dspine",
        apply="engine_args:patch_min_p_logit_bias",
        changes=(Symbol("vllm.sampling_params:SamplingParams._validate_spec_decode",
                        ("self", "speculative_config")),),
        checks=(),
        when="always",
        acts_on="requests to an engine with a DSpine draft",
        why="vLLM refuses `min_p` and `logit_bias` under speculative decoding because its "
            "verifier does not apply them to draft positions. DSpine's verifier does "
            "(`verify/sampler.py`).",
        how="For a DSpine draft the refusal is skipped; every other method keeps it.",
        retire="vLLM's rejection sampler applies min_p and logit_bias at draft positions, "
               "or a proposer can declare the sampling parameters it verifies exactly.",
    ),
    # ------------------------------------------------------------- model runner
    Patch(
        id="dspine-proposer",
        apply="model_runner:patch_dspine_proposer",
        changes=(Symbol("vllm.v1.worker.gpu_model_runner:DFlashProposer"),),
        checks=(Symbol("vllm.v1.spec_decode.dflash:DFlashProposer.__init__",
                       ("self", "vllm_config", "device", "runner")),),
        when="always",
        acts_on="engines with a DSpine draft (others get vLLM's DFlashProposer)",
        why="The model runner builds `DFlashProposer` (the name it imported) for "
            "`use_dflash()`, which a DSpine draft reports.",
        how="The name is replaced by a subclass whose metaclass builds `DSpineProposer` "
            "for a DSpine draft and vLLM's `DFlashProposer` otherwise; the runner's "
            "isinstance checks against the name accept either.",
        retire="The same registry as `dspine-method`: 0.34.0's runner builds the "
               "speculator class the registered method names.",
    ),
    Patch(
        id="logitsprocs-for-dspine",
        apply="model_runner:patch_build_logitsprocs",
        changes=(Symbol("vllm.v1.worker.gpu_model_runner:build_logitsprocs",
                        ("vllm_config", "device", "is_pin_memory", "is_pooling_model",
                         "custom_logitsprocs")),),
        checks=(Symbol("vllm.v1.sample.logits_processor:BUILTIN_LOGITS_PROCESSORS"),
                Symbol("vllm.v1.sample.logits_processor:LogitsProcessors")),
        when="always",
        acts_on="engines with a DSpine draft and no custom logits processors",
        why="vLLM's `build_logitsprocs` (imported by name into the runner, which the CPU "
            "runner inherits) builds only MinTokens once speculation is configured, so "
            "min_p and logit_bias would be silently ignored under DSpine "
            "(`min-p-logit-bias-for-dspine` lifts the request-time refusal).",
        how="For a DSpine draft vLLM's full built-in set is built, as without speculation.",
        retire="vLLM builds the built-in processors under speculative decoding (0.34.0's "
               "only runner, V2, always builds min-p and logit-bias state).",
    ),
    Patch(
        id="cpu-seeded-prefill-rewind",
        apply="model_runner:patch_cpu_generator_rewind",
        changes=(_runner("_sample", ("self", "logits", "spec_decode_metadata")),),
        checks=(_runner("__init__", uses=("discard_request_mask",)),),
        when="always",
        acts_on="CPU runners: seeded requests whose prompt is chunked",
        why="For a partial prefill vLLM discards the sampled token and rewinds the "
            "request's generator with `set_offset`, which CPU generators do not support "
            "('CPU Generator does not use offset'): the engine dies.",
        how="On CPU the generators of discarded rows are snapshotted before sampling and "
            "restored after (the rewind vLLM means: the discarded draw consumes nothing), "
            "and swapped for a `torch.Generator` subclass whose offset calls are no-ops.",
        retire="vLLM rewinds CPU generators without offsets, or torch's CPU generator "
               "supports `set_offset` (0.34.0's runner draws seeded requests from seeded "
               "Gumbel noise, no generator).",
    ),
    Patch(
        id="context-log-before-step",
        apply="model_runner:patch_context_log_before_step",
        changes=(_runner("execute_model", ("self", "scheduler_output",
                                           "intermediate_tensors")),),
        checks=(Symbol("vllm.v1.core.sched.output:SchedulerOutput.finished_req_ids"),
                Symbol("vllm.v1.core.sched.output:SchedulerOutput.preempted_req_ids")),
        when="always",
        acts_on="engines with a DSpine draft (a drafter with `before_step`)",
        why="The draft context K/V writes the proposer logged in steps without a block "
            "(`DSpineProposer._store_context_only`) must land before the scheduler reuses "
            "freed KV blocks: this step's target forward may write into them.",
        how="Before the step runs, the drafter's `before_step(scheduler_output)` applies "
            "the logged writes when the scheduler has freed blocks since the last step "
            "(`finished_req_ids`, `preempted_req_ids`). Nothing else changes.",
        retire="A proposer hook vLLM calls before each step with the scheduler output.",
    ),
    # ------------------------------------------------------- KV cache groups
    Patch(
        id="dspine-kv-cache-groups",
        apply="kv_cache:patch_kv_cache_groups",
        changes=(Symbol(f"{KV_CACHE_UTILS}:get_kv_cache_groups",
                        ("vllm_config", "kv_cache_spec"),
                        uses=("_get_kv_cache_groups_uniform_page_size",
                              "unify_kv_cache_spec_page_size")),
                 Symbol(f"{KV_CACHE_UTILS}:_get_kv_cache_groups_uniform_page_size",
                        ("kv_cache_spec",),
                        uses=("merge", "cdiv", "create_kv_cache_group_specs"))),
        checks=(Symbol(f"{KV_CACHE_UTILS}:create_kv_cache_group_specs",
                       ("kv_cache_spec", "grouped_layer_names")),
                Symbol(f"{KV_CACHE_UTILS}:_max_memory_usage_bytes_from_groups",
                       ("vllm_config", "kv_cache_groups")),
                Symbol(f"{KV_CACHE_UTILS}:_pool_bytes_per_block",
                       ("vllm_config", "kv_cache_groups")),
                Symbol("vllm.v1.kv_cache_interface:replace_as",
                       ("spec", "target_cls", "drop", "changes")),
                Symbol("vllm.v1.spec_decode.llm_base_proposer:"
                       "SpecDecodeBaseProposer.validate_same_kv_cache_group",
                       ("self", "kv_cache_config")),
                Symbol("vllm.model_executor.models.qwen3_dflash:"
                       "DFlashQwen3ForCausalLM.__init__", ("self", "vllm_config", "prefix"),
                       uses=("get_total_num_hidden_layers",)),
                Symbol("vllm.model_executor.models.utils:extract_layer_index",
                       ("layer_name", "num_attn_module"))),
        when="always",
        acts_on="engines with a DSpine draft whose layers do not all share one KV spec "
                "(hybrid targets, sliding-window drafters)",
        why="vLLM splits every bucket of same-spec layers into groups of the smallest "
            "bucket's size and pads the rest (docs/hybrid.md, 'KV cache groups'). A "
            "hybrid target with one full-attention layer put the sliding-window "
            "drafter's two layers in two groups, and the engine died on vLLM's "
            "`All drafting layers should belong to the same kv cache group`; at "
            "Qwen3.8-27B-like sizes (48 GDN + 16 attention layers, 5 draft layers) the "
            "group size became 5 and the target's attention KV was allocated for 20 "
            "layers, 16 used (25 % more than needed).",
        how="Inside `get_kv_cache_groups` of an engine with a DSpine draft, the split vLLM "
            "makes once pages share one size is replaced by "
            "`model/kv_cache_groups.py:plan_kv_cache_groups`: of the splits vLLM's rule "
            "can make (any group size; the draft's sliding-window layers kept, or "
            "allocated as full attention when the window covers max_model_len, attention "
            "still windowed; a draft sharing a spec with target layers in their bucket or "
            "in its own) that keep the draft in one group, the one with the fewest KV "
            "bytes per request at max_model_len by vLLM's own count "
            "(`_max_memory_usage_bytes_from_groups`); ties keep vLLM's grouping. "
            "Everything else in `get_kv_cache_groups` is vLLM's; a draft its other paths "
            "split is refused with a message naming the setting.",
        retire="vLLM picks KV cache group sizes without padding (its FIXME in "
               "`_get_kv_cache_groups_uniform_page_size`: e.g. the gcd of the bucket "
               "sizes) and keeps a drafter's layers in one group, or its proposer "
               "drafts across several groups.",
    ),
    # ---------------------------------------------------- CPU platform and kernels
    Patch(
        id="cpu-expand-kernel",
        apply="cpu_kernels:patch_expand_kernel",
        changes=(Symbol("vllm.utils.cpu_triton_utils:_expand_kernel_impl",
                        ("output", "input_val", "cu_num_tokens", "replace_from",
                         "replace_to", "MAX_NUM_TOKENS")),),
        checks=(Symbol("vllm.triton_utils.dispatcher:_registry"),
                Symbol("vllm.triton_utils.dispatcher:KernelOverride.__init__",
                       uses=("_impl", "func")),
                Symbol("vllm.v1.sample.rejection_sampler:expand_kernel")),
        when="always",
        acts_on="every engine on CPU with speculative decoding (any method)",
        why="vLLM's CPU override of `rejection_sampler.expand_kernel` writes into an int64 "
            "copy of a float output and never copies back, so per-token temperature and "
            "top-p under speculative decoding are uninitialised memory (sampling is then "
            "not lossless).",
        how="Replaced by `kernels/cpu_replacements.py:expand_to_tokens_cpu` (in the "
            "output's own dtype); the CPU platform's registered wrapper, if any, is "
            "pointed at it too.",
        retire="vLLM's `_expand_kernel_impl` copies the result back into a float output "
               "(0.34.0 deleted it with the V1 runner).",
    ),
    Patch(
        id="cpu-grouped-rms-norm",
        apply="cpu_kernels:patch_grouped_rms_norm",
        changes=(Symbol("vllm._custom_ops:rms_norm",
                        ("out", "input", "weight", "epsilon")),),
        checks=(),
        when="always",
        acts_on="CPU tensors with a 2-D weight (DFlash context keys); the rest goes to vLLM",
        why="vLLM's DFlash context path normalises the context keys of all draft layers in "
            "one call with a stacked `[num_layers, head_dim]` k_norm weight; the CPU kernel "
            "uses only its first row, so every draft layer got layer 0's k_norm.",
        how="A 2-D weight on CPU is applied per outermost group "
            "(`kernels/cpu_replacements.py:grouped_rms_norm_cpu`).",
        retire="vLLM's CPU rms_norm honours a 2-D weight, or the DFlash context path "
               "normalises per layer.",
    ),
    Patch(
        id="cpu-causal-conv1d-fp32",
        apply="cpu_kernels:patch_causal_conv1d",
        changes=(Symbol(f"{GDN_OPS}:causal_conv1d_torch",
                        ("x", "weight", "bias", "conv_states", "query_start_loc",
                         "cache_indices", "has_initial_state", "activation", "pad_slot_id",
                         "kwargs")),),
        checks=(Symbol("vllm.v1.attention.backends.utils:PAD_SLOT_ID"),),
        when="cpu",
        acts_on="Gated DeltaNet hybrid targets (plain decoding too) on CPUs where vLLM's "
                "C++ conv is not used",
        why="Where vLLM's C++ kernel is not used (CPUs without AVX512-BF16, e.g. AVX2-only "
            "AMD EPYC) its CPU GDN prefill conv is one bf16 `F.conv1d` per sequence and "
            "layer, 6-12 ms a call (measured 2026-12-02): hybrid targets ran ~10x slower.",
        how="The same computation with the W taps summed in fp32 and rounded as vLLM's "
            "(`kernels/cpu_replacements.py:causal_conv1d_fp32_cpu`): same arguments, "
            "outputs and window updates.",
        retire="A fast CPU conv for GDN prefill in vLLM without AVX512-BF16.",
    ),
    Patch(
        id="cpu-hybrid-block-size-kept",
        apply="cpu_kernels:patch_hybrid_block_size_kept",
        changes=(Symbol("vllm.platforms.cpu:CpuPlatform.check_and_update_config",
                        ("vllm_config",)),),
        checks=(Symbol("vllm.v1.engine.core:EngineCoreProc._perform_handshakes",
                       uses=("__post_init__",)),
                Symbol("vllm.config.cache:CacheConfig.user_specified_block_size"),
                Symbol("vllm.config.model:ModelConfig.is_hybrid")),
        when="always",
        acts_on="hybrid targets on CPU (plain decoding included)",
        why="The engine core re-runs `VllmConfig.__post_init__` after its start-up "
            "handshake and the CPU platform then resets an unspecified block size to 128, "
            "undoing the block size the hybrid alignment fixed (384 tokens for the hybrid "
            "test pair). With prefix caching the scheduler then ends prefill chunks at "
            "128-token boundaries while mamba state blocks hold 384, so a block can be "
            "cached with the state of a position short of its boundary (docs/hybrid.md, "
            "'Prefix caching').",
        how="A block size already set is not lowered for a hybrid model unless the user "
            "set it.",
        retire="`CpuPlatform.check_and_update_config` keeps a block size set earlier: "
               "vLLM 0.33.0 moved the reset to `update_block_size_for_backend` "
               "(docs/compatibility.md).",
    ),
    Patch(
        id="kernel-override-scan",
        apply="cpu_kernels:patch_kernel_override_scan",
        changes=(Symbol("vllm.triton_utils.dispatcher:_rebind_kernels", ("overrides",)),),
        checks=(Symbol("vllm.triton_utils.dispatcher:register_kernels",
                       uses=("_rebind_kernels",)),),
        when="always",
        acts_on="every process that registers platform kernel overrides (the CPU "
                "platform does, at each engine start) after numba/llvmlite were loaded",
        why="vLLM's scan for holders of an overridden kernel reads `vars(value).get` on "
            "every module attribute with a `__dict__`. llvmlite's `ffi.lib`, loaded with "
            "numba (vLLM's n-gram matcher, used by `ngram` and by `dspine_lookup`), "
            "answers `__dict__` with a function wrapper, so `register_kernels` raises "
            "`AttributeError: '_lib_fn_wrapper' object has no attribute 'get'`: a second "
            "in-process engine (or any engine started after numba was imported) fails "
            "to start (found in this project's test suite, docs/testing.md).",
        how="The same scan, written here (`cpu_kernels.py:_rebind_kernels`), skipping an "
            "object whose `__dict__` is not a mapping.",
        retire="vLLM's `_rebind_kernels` checks that an instance dict is a mapping before "
               "reading it (not in 0.32.0).",
    ),
    # ------------------------------------------------------------------ metrics
    Patch(
        id="verified-drafts-metric",
        apply="metrics:patch_verified_drafts_metric",
        changes=(Symbol("vllm.v1.metrics.loggers:PrometheusStatLogger._spec_decoding_cls"),
                 Symbol("vllm.v1.metrics.loggers:PrometheusStatLogger.record",
                        ("self", "scheduler_stats", "iteration_stats", "mm_cache_stats",
                         "engine_idx"))),
        checks=(Symbol("vllm.v1.spec_decode.metrics:SpecDecodingProm.__init__",
                       ("self", "speculative_config", "labelnames",
                        "per_engine_labelvalues", "is_diffusion")),
                Symbol("vllm.v1.spec_decode.metrics:SpecDecodingProm.observe",
                       ("self", "spec_decoding_stats", "engine_idx")),
                Symbol("vllm.v1.spec_decode.metrics:"
                       "SpecDecodingStats.num_draft_tokens_per_pos"),
                Symbol("vllm.v1.metrics.utils:create_metric_per_engine"),
                Symbol("vllm.v1.metrics.stats:IterationStats.__init__",
                       uses=("inter_token_latencies_iter",))),
        when="always",
        acts_on="Prometheus metrics of engines with a DSpine draft",
        why="The histogram `vllm:dspine_verified_drafts` of drafts verified per request "
            "and step (docs/dynamic-verification.md) has no place in vLLM's metrics.",
        how="vLLM's spec-decode Prometheus class gets a subclass with the histogram: "
            "lengths 1..15 from the `num_draft_tokens_per_pos` vLLM's scheduler already "
            "ships, length 0 from the step's decode outputs that came without drafts (a "
            "wrapper on `record`). vLLM's own metrics are unchanged.",
        retire="vLLM exports drafts verified per request and step.",
    ),
    # ------------------------------------------------------------- import hooks
    Patch(
        id="qwen3_5-text-without-torchvision",
        apply="import_hooks:patch_qwen3_5_text_without_torchvision",
        changes=(Symbol("vllm.model_executor.models.qwen3_vl:image_smart_resize",
                        imported_from=f"{QWEN2VL_TV_MODULE}:smart_resize",
                        read_source=True),),
        checks=(Symbol(f"{QWEN2VL_PIL_MODULE}:smart_resize", read_source=True),),
        when="no-torchvision",
        acts_on="Qwen3.5 text targets (vLLM's `qwen3_5` imports `qwen3_vl`)",
        why="vLLM's `qwen3_vl` imports `smart_resize` from a transformers module that "
            "imports torchvision at its top (transformers 5.19); without torchvision the "
            "text model fails 'to be inspected'.",
        how="An import hook on `sys.meta_path` (not a symbol swap) serves that module as "
            "one holding only `smart_resize`, taken from its PIL sibling (identical "
            "source); image inputs still fail loudly (docs/hybrid.md).",
        retire="vLLM's `qwen3_vl` imports `smart_resize` lazily or from a torchvision-free "
               "module (or transformers stops importing torchvision there).",
    ),
    # ---------------------------------------- hybrid GDN targets: the replay commit
    Patch(
        id="gdn-layer-one-slot",
        apply="gdn_commit:patch_gdn_layer_init",
        changes=(Symbol(f"{QWEN_GDN}.__init__",
                        ("self", "config", "vllm_config", "prefix", "gqa_interleaved_layout",
                         "reduce_results"),
                        uses=("enable_fused_gdn_spec_decode",)),),
        checks=(Symbol("vllm.model_executor.layers.mamba.gdn.base:"
                       "GatedDeltaNetAttention.__init__", uses=("num_spec",)),
                Symbol(f"{QWEN_GDN}.get_state_shape", ("self",), uses=("num_spec",))),
        when="always",
        acts_on="a DSpine draft on a Qwen3.5 / Qwen3-Next GDN target "
                "(`commit.runner.replay_active`)",
        why="vLLM keeps 1 + K speculative state slots per request and writes every "
            "drafted position's state; the replay commit (docs/hybrid.md) keeps one slot "
            "and rebuilds it through the accepted prefix.",
        how="After vLLM's init: `num_spec = 0` (its `get_state_shape` then gives one slot "
            "with a W - 1 window), no fused spec decode, and the `_dspine_replay` mark the "
            "other GDN rows key on.",
        retire="vLLM's GDN layers commit verified blocks of any length with one state "
               "slot (its `use_replayssm` path for GDN on CPU).",
    ),
    Patch(
        id="gdn-state-shape-one-slot",
        apply="gdn_commit:patch_gdn_state_shape_from_config",
        changes=(Symbol("vllm.model_executor.models.qwen3_5:"
                        "Qwen3_5ForCausalLMBase.get_mamba_state_shape_from_config",
                        ("vllm_config",)),
                 Symbol("vllm.model_executor.models.qwen3_next:"
                        "Qwen3NextForCausalLM.get_mamba_state_shape_from_config",
                        ("vllm_config",))),
        checks=(Symbol("vllm.model_executor.layers.mamba.mamba_utils:"
                       "MambaStateShapeCalculator.gated_delta_net_state_shape",
                       ("tp_world_size", "num_k_heads", "num_v_heads", "head_k_dim",
                        "head_v_dim", "conv_kernel_size", "num_spec")),),
        when="always",
        acts_on="a DSpine draft on a Qwen3.5 / Qwen3-Next GDN target",
        why="`Platform._align_hybrid_block_size` plans KV pages with these shapes; they "
            "must match the one-slot layers of `gdn-layer-one-slot`.",
        how="The shapes with `num_spec = 0`, after checking that vLLM's own are the "
            "pinned formula's with K speculative tokens.",
        retire="As `gdn-layer-one-slot`.",
    ),
    Patch(
        id="gdn-kv-spec-one-block",
        apply="gdn_commit:patch_gdn_kv_cache_spec",
        changes=(Symbol("vllm.model_executor.layers.mamba.abstract:"
                        "MambaBase.get_kv_cache_spec", ("self", "vllm_config")),),
        checks=(Symbol("vllm.v1.kv_cache_interface:MambaSpec.num_speculative_blocks"),),
        when="always",
        acts_on="GDN layers marked by `gdn-layer-one-slot`",
        why="vLLM allocates K speculative state blocks per request for speculative "
            "decoding; the replay commit needs none.",
        how="`num_speculative_blocks = 0` for marked layers (as vLLM does itself under "
            "`use_replayssm`).",
        retire="As `gdn-layer-one-slot`.",
    ),
    Patch(
        id="gdn-cpu-core-replay",
        apply="gdn_commit:patch_gdn_cpu_core",
        changes=(Symbol(f"{GDN_OPS}:_cpu_gdn_attention_nonspec",
                        ("layer", "attn_metadata_i", "mixed_qkv", "b", "a",
                         "core_attn_out")),),
        checks=(Symbol(f"{GDN_OPS}:cpu_gdn_attention_core",
                       uses=("_cpu_gdn_attention_nonspec",)),
                Symbol(f"{GDN_OPS}:causal_conv1d_torch"),
                Symbol(f"{GDN_OPS}:is_arm_bf16"),
                Symbol(f"{GDN_OPS}:_unpacked_conv_weight"),
                Symbol("vllm._custom_ops:causal_conv1d_fwd_cpu"),
                Symbol("vllm._custom_ops:fused_sigmoid_gating_delta_rule_update_spec_cpu")),
        when="cpu",
        acts_on="GDN layers marked by `gdn-layer-one-slot` with speculative rows",
        why="vLLM's CPU GDN core (reached for a W - 1 window, looked up by name at each "
            "call) would write the drafted positions' states into the request's only slot.",
        how="`commit.runner.gdn_core_cpu`: speculative rows run from scratch copies of the "
            "slot and their inputs are recorded for the commit; the rest goes through "
            "vLLM's function.",
        retire="As `gdn-layer-one-slot`.",
    ),
    Patch(
        id="gdn-commit-after-sampling",
        apply="gdn_commit:patch_gdn_commit",
        changes=(_runner("_update_states_after_model_execute",
                         ("self", "output_token_ids", "scheduler_output"),
                         uses=("postprocess_mamba_align_gpu", "num_accepted_tokens_event")),),
        checks=(),
        when="always",
        acts_on="a DSpine draft on a Qwen3.5 / Qwen3-Next GDN target",
        why="The recurrent state must hold exactly the accepted prefix after each step. "
            "In mamba cache mode 'align' (prefix caching) vLLM's update would run its "
            "fused align postprocess, a Triton-only kernel over 1 + K speculative blocks "
            "that the replay commit does not have.",
        how="vLLM's update (its accepted counts; skipped in 'align' mode), then the replay "
            "commit of every marked layer (`commit.runner.commit_step`, which also stores "
            "block-boundary states), then `num_accepted_tokens` = 1; in 'align' mode only "
            "the event vLLM's next step waits on is recorded.",
        retire="As `gdn-layer-one-slot`.",
    ),
    Patch(
        id="gdn-mamba-bufs-without-spec",
        apply="gdn_commit:patch_gdn_mamba_bufs",
        changes=(_runner("_get_mamba_bufs", ("self",), uses=("_mamba_bufs",)),),
        checks=(Symbol("vllm.v1.worker.mamba_utils:MambaBuffers.create",
                       ("max_num_reqs", "kv_cache_config", "copy_funcs", "make_buffer",
                        "device", "with_postprocess_align")),),
        when="always",
        acts_on="a DSpine draft on a GDN target in mamba cache mode 'align' (prefix caching)",
        why="With the speculative-decoding postprocess context vLLM's `preprocess_mamba` "
            "takes the Triton-only fused pre-copy.",
        how="vLLM's buffers are built without that context, so each request's running "
            "state moves to its new block through the scalar copy path "
            "(`collect_mamba_copy_meta`, with the accepted-token offset 0 the commit "
            "leaves) and the fused postprocess staging is skipped.",
        retire="As `gdn-layer-one-slot`.",
    ),
    # ---------------------------------------------------------------- profiling
    Patch(
        id="step-profile",
        apply="profiling:patch_step_profile",
        changes=(_runner("execute_model"), _runner("sample_tokens"),
                 _runner("_model_forward"), _runner("_sample"),
                 _runner("propose_draft_token_ids"),
                 Symbol("vllm.v1.core.sched.scheduler:Scheduler.finish_requests",
                        ("self", "request_ids", "finished_status"))),
        checks=(Symbol("vllm.v1.request:RequestStatus.FINISHED_ABORTED"),),
        when="step-profile",
        acts_on="every engine of a process started with the variable (bench/e2e.py)",
        why="bench/e2e.py splits the engine's time per step (target forward, sampler, "
            "drafter, host) and times aborts.",
        how="Wall-time timers around the runner's methods and the moment "
            "`Scheduler.finish_requests` has freed an aborted request's KV blocks, "
            "written by `vllm_dspine/step_profile.py`. Behaviour is unchanged.",
        retire="Not a fix: a measuring aid, off unless the variable is set.",
    ),
)

BY_ID = {p.id: p for p in PATCHES}
assert len(BY_ID) == len(PATCHES), "patch ids must be unique"
