"""The engine step profile bench/e2e.py reads (vllm_dspine/step_profile.py and
row step-profile of plugin/patches/table.py): nothing is wrapped without
VLLM_DSPINE_STEP_PROFILE; with it, the runner's methods and the scheduler's abort path
are wrapped, sections add up and the file is rewritten whole."""

from __future__ import annotations

import json


def test_nothing_is_wrapped_without_the_variable(fresh_vllm):
    """In a fresh interpreter (conftest.py's `fresh_vllm`, tests/fresh_vllm.py, check 5)
    with every row applied and the variable unset: nothing is wrapped."""
    wrapped = fresh_vllm["step_profile"]["without"]
    assert not any(v for k, v in wrapped.items() if k != "once"), wrapped


def test_runner_and_scheduler_are_wrapped_with_the_variable(fresh_vllm):
    """The same interpreter with the variable set: the row applies (twice), the runner's
    methods and the scheduler's abort path are wrapped, once."""
    probe = fresh_vllm["step_profile"]
    assert probe["installed"] == [True, True]
    assert all(probe["with"].values()), probe


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
