"""bench/gpu_check.py end to end at toy sizes on the CPU (Triton interpreter), with vLLM
made unimportable: the script a GPU machine without vLLM runs, checked here before it
travels (docs/gpu.md)."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

pytestmark = pytest.mark.triton

REPO = pathlib.Path(__file__).resolve().parents[1]

# `sys.modules["vllm"] = None` makes every `import vllm...` raise ImportError.
RUN = ("import runpy, sys; sys.modules['vllm'] = None; "
       "sys.argv = ['bench/gpu_check.py'] + sys.argv[1:]; "
       "runpy.run_path('bench/gpu_check.py', run_name='__main__')")


def test_gpu_check_runs_without_vllm(tmp_path):
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-c", RUN, "--small", "--device", "cpu",
                           "--out", str(tmp_path)], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    rows = report["rows"]
    assert all(r["ok"] is not False for r in rows), [r for r in rows if r["ok"] is False]
    names = " | ".join(r["name"] for r in rows)
    for part in ("bridge", "FP8 head scores", "tail walk, greedy", "tail walk, sampled",
                 "sparse rejection", "GDN replay", "FP8 vs BF16 top 16",
                 "dense Qwen3 layers", "DSpine's part"):
        assert part in names, part
    assert sum(r["ok"] is True for r in rows) >= 7
    md = (tmp_path / "gpu_check.md").read_text()
    assert "| part | what | check | ok |" in md and "Every check passed." in md


def test_what_gpu_check_restates_matches_the_sources():
    from vllm.v1.sample.rejection_sampler import PLACEHOLDER_TOKEN_ID

    from vllm_dspine.model.memory import QWEN38_27B_GDN
    from vllm_dspine.verify import sparse_rejection

    assert sparse_rejection.PLACEHOLDER_TOKEN_ID == PLACEHOLDER_TOKEN_ID
    sys.path.insert(0, str(REPO))
    try:
        from bench.gpu_check import GDN_27B
    finally:
        sys.path.remove(str(REPO))
    g = QWEN38_27B_GDN
    assert GDN_27B == dict(num_k_heads=g.linear_num_key_heads,
                           num_v_heads=g.linear_num_value_heads,
                           head_k_dim=g.linear_key_head_dim,
                           head_v_dim=g.linear_value_head_dim,
                           conv_width=g.linear_conv_kernel_dim)
