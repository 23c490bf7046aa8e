"""Engine step timers for bench/e2e.py: row `step-profile` of table.py, installed only
with `VLLM_DSPINE_STEP_PROFILE` set (`vllm_dspine/step_profile.py` writes the file)."""

from __future__ import annotations

import functools

from vllm_dspine.plugin.patches.guard import is_applied, mark_applied


def patch_step_profile() -> None:
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.request import RequestStatus
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from vllm_dspine.step_profile import profile

    prof = profile()
    if prof is None:
        return

    def wrap(owner, name: str, section: str, count_step: bool = False) -> None:
        original = getattr(owner, name)
        if is_applied(original, "step-profile"):
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

        setattr(owner, name, mark_applied(timed_method, "step-profile"))

    wrap(GPUModelRunner, "execute_model", "step")
    wrap(GPUModelRunner, "sample_tokens", "step", count_step=True)
    wrap(GPUModelRunner, "_model_forward", "target_forward")
    wrap(GPUModelRunner, "_sample", "sampler")
    wrap(GPUModelRunner, "propose_draft_token_ids", "drafter")

    finish = Scheduler.finish_requests
    if is_applied(finish, "step-profile"):
        return

    @functools.wraps(finish)
    def finish_requests(self, request_ids, finished_status):
        out = finish(self, request_ids, finished_status)
        if finished_status == RequestStatus.FINISHED_ABORTED and out:
            prof.aborted(self.kv_cache_manager.usage)
        return out

    Scheduler.finish_requests = mark_applied(finish_requests, "step-profile")
