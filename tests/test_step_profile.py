"""The engine step profile bench/e2e.py reads (vllm_dspine/step_profile.py and
row step-profile of plugin/patches/table.py): nothing is wrapped without
VLLM_DSPINE_STEP_PROFILE; with it, the runner's methods and the scheduler's abort path
are wrapped, sections add up and the file is rewritten whole."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

from engine_utils import engine_env

CHECK = textwrap.dedent("""
    import json, os, sys
    from vllm_dspine.plugin.patches import apply_patch, is_applied
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    apply_patch("step-profile")
    apply_patch("step-profile")  # twice: wrapped once
    names = ["execute_model", "sample_tokens", "_model_forward", "_sample",
             "propose_draft_token_ids"]
    wrapped = {n: is_applied(getattr(GPUModelRunner, n), "step-profile") for n in names}
    wrapped["finish_requests"] = is_applied(Scheduler.finish_requests, "step-profile")
    once = GPUModelRunner.execute_model.__wrapped__
    wrapped["once"] = not is_applied(once, "step-profile")
    print(json.dumps(wrapped))
""")


def _run(env_extra: dict) -> dict:
    engine_env()
    env = dict(os.environ)
    env.pop("VLLM_DSPINE_STEP_PROFILE", None)
    env.update(env_extra)
    out = subprocess.run([sys.executable, "-c", CHECK], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_nothing_is_wrapped_without_the_variable():
    wrapped = _run({})
    assert not any(v for k, v in wrapped.items() if k != "once"), wrapped


def test_runner_and_scheduler_are_wrapped_with_the_variable(tmp_path):
    wrapped = _run({"VLLM_DSPINE_STEP_PROFILE": str(tmp_path / "p.json")})
    assert all(wrapped.values()), wrapped


def test_profile_sections_and_file(tmp_path, monkeypatch):
    from vllm_dspine import step_profile

    path = tmp_path / "prof.json"
    monkeypatch.setenv(step_profile.ENV, str(path))
    monkeypatch.setattr(step_profile, "_LOADED", False)
    monkeypatch.setattr(step_profile, "_PROFILE", None)
    prof = step_profile.profile()
    assert prof is not None and step_profile.profile() is prof
    with step_profile.timed("draft_forward"):
        sum(range(10000))
    prof.add("step", 0.25)
    prof.steps += 2
    prof.write()
    data = json.loads(path.read_text())
    assert data["steps"] == 2 and data["seconds"]["step"] == 0.25
    assert data["seconds"]["draft_forward"] > 0 and data["seconds"]["retrieval_tail"] == 0
    assert data["peak_rss_mib"] > 10 and data["abort_freed_at"] is None
    prof.aborted(0.0)
    again = step_profile.read(str(path))
    assert again["abort_freed_at"] is not None and again["kv_usage_after_abort"] == 0.0
    assert step_profile.read(str(tmp_path / "missing.json")) is None
    assert not list(tmp_path.glob("*.tmp"))  # written through a temporary, replaced whole
