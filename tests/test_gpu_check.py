"""bench/gpu_check.py end to end at toy sizes on the CPU (Triton interpreter), with vLLM
made unimportable: the script a GPU machine without vLLM runs, checked here before it
travels (docs/gpu.md)."""

from __future__ import annotations

import json
import pathlib
import sys

import pytest

pytestmark = pytest.mark.triton

REPO = pathlib.Path(__file__).resolve().parents[1]


def test_gpu_check_runs_without_vllm(gpu_check_run):
    """conftest.py's `gpu_check_run` (started with the session, in a subprocess):
    `bench/gpu_check.py --small --device cpu` with `sys.modules["vllm"] = None`."""
    done = gpu_check_run.wait(300)
    out = gpu_check_run.out_dir
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((out / "gpu_check.json").read_text())
    rows = report["rows"]
    assert all(r["ok"] is not False for r in rows), [r for r in rows if r["ok"] is False]
    names = " | ".join(r["name"] for r in rows)
    for part in ("bridge", "FP8 head scores", "tail walk, greedy", "tail walk, sampled",
                 "sparse rejection", "GDN replay", "FP8 vs BF16 top 16",
                 "dense Qwen3 layers", "DSpine's part"):
        assert part in names, part
    assert sum(r["ok"] is True for r in rows) >= 7
    md = (out / "gpu_check.md").read_text()
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
