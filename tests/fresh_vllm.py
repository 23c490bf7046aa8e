"""One fresh interpreter for the checks that need vLLM as imported, before this
session's modules patched it (the patches cannot be undone in a process): the patch table
(tests/test_vllm_patches.py) and row step-profile (tests/test_step_profile.py). One
import of vLLM (~17 s on a slow core) for both; conftest.py's `fresh_vllm` runs it once
per session (started with the session, `_background_starts`) and hands its JSON object
to both modules."""

from __future__ import annotations

import json
import os
import sys
import textwrap
from pathlib import Path

from background import Background

# Run in a fresh interpreter (argv[1]: the step profile file of check 5); prints one
# JSON line.
FRESH_PROBE = textwrap.dedent("""
    import importlib, json, os, sys
    import torch

    out = {}
    # 1. vLLM's own CPU expand override, unpatched (the bug cpu-expand-kernel fixes).
    from vllm.platforms.cpu import CpuPlatform
    CpuPlatform.import_kernels()
    from vllm.utils import cpu_triton_utils
    from vllm_dspine.plugin.patches import is_applied
    vanilla = cpu_triton_utils._expand_kernel_impl
    out["vanilla_expand_marked"] = is_applied(vanilla, "cpu-expand-kernel")
    nan = torch.full((5,), float("nan"))
    vanilla(nan, torch.tensor([1.5, 0.7]), torch.tensor([3, 5], dtype=torch.int32), 0, 1)
    out["vanilla_expand_all_nan"] = bool(torch.isnan(nan).all())

    # 2. Importing the plugin and every patch module changes nothing.
    import vllm_dspine.plugin
    from vllm_dspine.plugin.patches import PATCHES, apply_patch, apply_patches
    from vllm_dspine.plugin.patches.apply import check_patch, installs
    for p in PATCHES:
        importlib.import_module("vllm_dspine.plugin.patches." + p.apply.split(":")[0])

    def current(symbol):
        if symbol.read_source:  # the import hook: its finder is the installed object
            return [f for f in sys.meta_path if getattr(f, "_dspine_patch_ids", ())]
        obj = importlib.import_module(symbol.module)
        for part in symbol.qualname.split("."):
            obj = getattr(obj, part)
        return [obj]

    def marked(p):
        return [s.path for s in p.changes
                if any(is_applied(o, p.id) for o in current(s))]

    # 3. Each row checked in the order registration applies them (a row may need the
    # earlier ones: qwen3_5 imports only once the torchvision hook is in), then applied.
    out["marked_after_import"], out["before"], out["installed"] = {}, {}, {}
    for p in PATCHES:
        out["before"][p.id] = check_patch(p)
        out["marked_after_import"][p.id] = marked(p) if not out["before"][p.id] else []
        out["installed"][p.id] = apply_patch(p)
    out["after"] = {p.id: check_patch(p) for p in PATCHES}
    out["marked"] = {p.id: marked(p) for p in PATCHES}
    # 4. Applying everything again leaves every changed symbol as it is (a classmethod
    # is a new bound method at each lookup: compare its function).
    def identities(p):
        return [id(getattr(o, "__func__", o)) for s in p.changes for o in current(s)]

    objects = {p.id: identities(p) for p in PATCHES}
    apply_patches()
    apply_patches()
    out["unchanged_by_reapply"] = {p.id: objects[p.id] == identities(p) for p in PATCHES}

    # 5. Row step-profile (tests/test_step_profile.py): what it wraps, first as it is
    # here (the variable unset), then with the variable set and the process's profile
    # read again (it is read once per process), the row applied twice.
    from vllm_dspine import step_profile
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    def step_profile_wrapped():
        names = ["execute_model", "sample_tokens", "_model_forward", "_sample",
                 "propose_draft_token_ids"]
        w = {n: is_applied(getattr(GPUModelRunner, n), "step-profile") for n in names}
        w["finish_requests"] = is_applied(Scheduler.finish_requests, "step-profile")
        inner = getattr(GPUModelRunner.execute_model, "__wrapped__", None)
        w["once"] = inner is not None and not is_applied(inner, "step-profile")
        return w

    assert step_profile.ENV not in os.environ
    out["step_profile"] = {"without": step_profile_wrapped()}
    os.environ[step_profile.ENV] = sys.argv[1]
    step_profile._LOADED = False
    out["step_profile"]["installed"] = [apply_patch("step-profile"),
                                        apply_patch("step-profile")]
    out["step_profile"]["with"] = step_profile_wrapped()
    print(json.dumps(out))
""")


def start_fresh_probe(out_dir) -> Background:
    """FRESH_PROBE in a fresh interpreter (VLLM_DSPINE_STEP_PROFILE unset), started and
    not waited for (`probe_result`)."""
    env = dict(os.environ)
    env.pop("VLLM_DSPINE_STEP_PROFILE", None)
    return Background([sys.executable, "-c", FRESH_PROBE, str(Path(out_dir) / "profile.json")],
                      out_dir, env=env)


def probe_result(run: Background) -> dict:
    """The probe's JSON object, once it has ended."""
    done = run.wait(600)
    assert done.returncode == 0, f"the fresh-interpreter probe failed: {done.stderr[-4000:]}"
    return json.loads(done.stdout.strip().splitlines()[-1])
