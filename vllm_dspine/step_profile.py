"""Where an engine step's time goes, measured inside the engine (for bench/e2e.py).

Off unless `VLLM_DSPINE_STEP_PROFILE=<path>` is set in the environment of the process
that starts vLLM: then the engine-core process (scheduler and, with one GPU/CPU worker,
the model runner) adds up wall time per section and rewrites `<path>` (JSON) after every
step, so a reader sees totals that are at most one step old. Sections:

    step            GPUModelRunner.execute_model + sample_tokens (one engine step)
    target_forward  GPUModelRunner._model_forward (the target: prefill, decode, verify)
    sampler         GPUModelRunner._sample (sampler or rejection sampler)
    drafter         GPUModelRunner.propose_draft_token_ids (any method's drafter)
    draft_forward   DSpine: the drafter's layers (block rows, or context K/V only)
    retrieval_tail  DSpine: candidate retrieval + serial tail + sparse q (+ confidences)
    commit          hybrid GDN targets: the replay commit after sampling (docs/hybrid.md)

host overhead = step - target_forward - sampler - drafter (input preparation, metadata,
bookkeeping). Counts (`count`): DSpine's request-steps whose verified drafts came from
the drafter (`drafter_request_steps`) or from the prompt lookup (`lookup_request_steps`,
docs/lookup.md) and their drafts (`drafter_drafts`, `lookup_drafts`). Also written: steps, peak resident memory of the process (`ru_maxrss`),
and for the last abort the wall-clock time at which the scheduler had freed its KV
blocks and the KV usage then (bench/e2e.py compares it with the time it asked).

On CUDA every section boundary synchronises the device (profiling only: it removes
the overlap of host and device work that an unprofiled run has).
"""

from __future__ import annotations

import json
import os
import resource
import time
from contextlib import contextmanager

import torch

ENV = "VLLM_DSPINE_STEP_PROFILE"
SECTIONS = ("step", "target_forward", "sampler", "drafter", "draft_forward",
            "retrieval_tail", "commit")


class StepProfile:
    def __init__(self, path: str) -> None:
        self.path = path
        self.seconds = dict.fromkeys(SECTIONS, 0.0)
        self.steps = 0
        self.counts: dict[str, int] = {}
        self.abort_freed_at: float | None = None  # time.time() of the last abort's free
        self.kv_usage_after_abort: float | None = None
        self._sync = torch.cuda.is_available()

    def now(self) -> float:
        if self._sync:
            torch.cuda.synchronize()
        return time.perf_counter()

    def add(self, section: str, seconds: float) -> None:
        self.seconds[section] += seconds

    def count(self, name: str, n: int) -> None:
        self.counts[name] = self.counts.get(name, 0) + int(n)

    def aborted(self, kv_usage: float) -> None:
        self.abort_freed_at = time.time()
        self.kv_usage_after_abort = float(kv_usage)
        self.write()

    def write(self) -> None:
        data = {"seconds": self.seconds, "steps": self.steps, "counts": self.counts,
                "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                "abort_freed_at": self.abort_freed_at,
                "kv_usage_after_abort": self.kv_usage_after_abort, "pid": os.getpid()}
        tmp = f"{self.path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(data, f)
        os.replace(tmp, self.path)


_PROFILE: StepProfile | None = None
_LOADED = False


def profile() -> StepProfile | None:
    """The process's profile, or None when `VLLM_DSPINE_STEP_PROFILE` is unset."""
    global _PROFILE, _LOADED
    if not _LOADED:
        path = os.environ.get(ENV)
        _PROFILE = StepProfile(path) if path else None
        _LOADED = True
    return _PROFILE


@contextmanager
def timed(section: str):
    """Adds the block's wall time to `section` (no-op when profiling is off)."""
    p = profile()
    if p is None:
        yield
        return
    t0 = p.now()
    try:
        yield
    finally:
        p.add(section, p.now() - t0)


def read(path: str) -> dict | None:
    """The last totals an engine wrote to `path` (None before its first step)."""
    try:
        with open(path) as f:
            return json.load(f)
    except (FileNotFoundError, json.JSONDecodeError):
        return None
