"""The Triton compilation of tests/test_kernel_compile.py, in a subprocess (under
TRITON_INTERPRET=1, which conftest.py sets for the test process, `triton.jit` yields
interpreted functions that cannot be compiled): `bench/lib/kernel_cases.py` compiles each
launcher's recorded launches to a cubin per target. Started by `start_compile` and read by
`compiled_rows`, so that a session can start it early (conftest.py's
`kernel_compile_sm90`)."""

from __future__ import annotations

import json
import os
import pathlib
import sys
import textwrap

import pytest

from background import Background

REPO = pathlib.Path(__file__).resolve().parents[1]

# argv[1]: the capabilities to compile for (JSON list); the fp8 retrieval case is compiled
# (or refused) on every target whatever the list.
SCRIPT = textwrap.dedent('''
    import dataclasses
    import json
    import sys
    from bench.lib.kernel_cases import CASES, compile_all

    caps = set(json.loads(sys.argv[1]))
    cases = [c if c.name == "fp8 retrieval" else dataclasses.replace(
                 c, targets=tuple(t for t in c.targets if t.capability in caps))
             for c in CASES]
    rows = []
    for r in compile_all(cases):
        base = dict(case=r.case.name, dims=r.case.dims.name, cc=r.target.capability,
                    refused=r.refused)
        if r.refused:
            rows.append(dict(base, kernel=None))
        for b in r.builds:
            rows.append(dict(base, kernel=b.kernel, regs=b.registers, local=b.local_bytes,
                             smem=b.shared_bytes, limit=b.target.max_shared_bytes,
                             fits=b.fits, wgmma="wgmma" in b.ptx))
    print("ROWS " + json.dumps(rows))
''')


def start_compile(caps: list[int], out_dir) -> Background:
    """SCRIPT for the capabilities `caps`, started."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9's default, stated
    return Background([sys.executable, "-c", SCRIPT, json.dumps(caps)], out_dir, env=env,
                      cwd=REPO)


def compiled_rows(run: Background) -> list[dict]:
    """The rows SCRIPT printed (skips the test where Triton has no ptxas)."""
    done = run.wait(600)
    if done.returncode != 0 and "ptxas" in done.stderr and "not found" in done.stderr:
        pytest.skip("this Triton install has no ptxas")
    assert done.returncode == 0, done.stderr[-4000:]
    line = next(x for x in done.stdout.splitlines() if x.startswith("ROWS "))
    return json.loads(line[len("ROWS "):])
