"""vLLM's model runner (`GPUModelRunner`, which the CPU runner inherits): rows
`dspine-proposer`, `logitsprocs-for-dspine`, `cpu-seeded-prefill-rewind` and
`context-log-before-step` of table.py."""

from __future__ import annotations

import functools

import torch

from vllm_dspine.plugin.patches.guard import is_applied, mark_applied


def patch_dspine_proposer() -> None:
    from vllm.v1.spec_decode.dflash import DFlashProposer
    from vllm.v1.worker import gpu_model_runner

    current = gpu_model_runner.DFlashProposer
    if is_applied(current, "dspine-proposer"):
        return
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

    gpu_model_runner.DFlashProposer = mark_applied(DFlashOrDSpineProposer, "dspine-proposer")


def patch_build_logitsprocs() -> None:
    import vllm.v1.worker.gpu_model_runner as gmr
    from vllm.v1.sample.logits_processor import BUILTIN_LOGITS_PROCESSORS, LogitsProcessors

    original = gmr.build_logitsprocs
    if is_applied(original, "logitsprocs-for-dspine"):
        return

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

    gmr.build_logitsprocs = mark_applied(build_logitsprocs, "logitsprocs-for-dspine")


class RewoundCPUGenerator(torch.Generator):
    """A CPU generator whose offset calls are no-ops: its rewind is done by state
    snapshots around sampling (see `patch_cpu_generator_rewind`)."""

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


def patch_cpu_generator_rewind() -> None:
    import numpy as np
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    original = GPUModelRunner._sample
    if is_applied(original, "cpu-seeded-prefill-rewind"):
        return

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

    GPUModelRunner._sample = mark_applied(_sample, "cpu-seeded-prefill-rewind")


def patch_context_log_before_step() -> None:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    original = GPUModelRunner.execute_model
    if is_applied(original, "context-log-before-step"):
        return

    @functools.wraps(original)
    def execute_model(self, scheduler_output, intermediate_tensors=None):
        before = getattr(getattr(self, "drafter", None), "before_step", None)
        if before is not None:
            before(scheduler_output)
        return original(self, scheduler_output, intermediate_tensors)

    GPUModelRunner.execute_model = mark_applied(execute_model, "context-log-before-step")
