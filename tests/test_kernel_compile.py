"""Every Triton kernel of the package compiles for the GPUs users serve on (A100 sm_80,
L40S sm_89, H100/H200 sm_90), on a machine without a GPU, at the released drafter's and
the SmolLM2 pair's shapes, with the block sizes its launcher picks there.

The interpreter tests check the math but not what the compiler accepts (dot shapes,
dtype mixes, constexpr branches, types of loop-carried values). Triton's wheel carries
ptxas, so `bench/lib/kernel_cases.py` compiles each launcher's recorded launches to a
cubin per target (`vllm_dspine/kernels/aot.py`), in a subprocess: under
TRITON_INTERPRET=1 (set by conftest for this process) `triton.jit` yields interpreted
functions that cannot be compiled. Nothing is launched. About 30 s cold, a few seconds
with Triton's cache warm for the three targets; the default tier compiles for sm_90 only
(and the fp8 case everywhere), the `full` tier for all three (docs/testing.md).
"""

from __future__ import annotations

import pathlib
import re

import pytest
import torch

from kernel_builds import compiled_rows, start_compile

pytestmark = pytest.mark.triton

REPO = pathlib.Path(__file__).resolve().parents[1]

def package_kernels() -> set[str]:
    """Names of the `@triton.jit` kernels of the package (helpers start with `_`)."""
    names = set()
    for path in (REPO / "vllm_dspine").rglob("*.py"):
        text = path.read_text()
        for m in re.finditer(r"@triton\.jit[^\n]*\n(?:\s*@[^\n]*\n)*\s*def (\w+)", text):
            if not m.group(1).startswith("_"):
                names.add(m.group(1))
    return names


# Default tier: every case for sm_90 (H100/H200, the wgmma paths), the fp8 retrieval case
# on every target (its refusal on sm_80): 19 of the 37 case-target compilations of all
# three targets, which the `full` tier compiles (`rows_all`). The sm_90 compilation is
# started with the session (conftest.py's `kernel_compile_sm90`, in a subprocess).
@pytest.fixture(scope="module")
def rows(kernel_compile_sm90):
    return compiled_rows(kernel_compile_sm90)


@pytest.fixture(scope="module")
def rows_all(tmp_path_factory):
    return compiled_rows(start_compile([80, 89, 90], tmp_path_factory.mktemp("kc_all")))


def _check_every_kernel_compiles(rows, ccs) -> None:
    kernels = package_kernels()
    assert len(kernels) >= 11, kernels  # bridge 4, retrieval 1, tail 1, verify 3, replay 2
    for cc in ccs:
        compiled = {r["kernel"] for r in rows if r["cc"] == cc and r["kernel"]}
        expected = kernels - ({"fp8_head_scores_kernel"} if cc == 80 else set())
        assert compiled == expected, (cc, expected - compiled, compiled - expected)


def test_every_kernel_compiles_for_sm90(rows):
    _check_every_kernel_compiles(rows, (90,))


@pytest.mark.full
def test_every_kernel_compiles_for_every_target(rows_all):
    _check_every_kernel_compiles(rows_all, (80, 89, 90))


@pytest.mark.parametrize("which", ["rows", pytest.param("rows_all", marks=pytest.mark.full)])
def test_no_spills_and_shared_memory_within_each_target(request, which):
    for r in request.getfixturevalue(which):
        if r["kernel"]:
            assert r["local"] == 0, f"{r['kernel']} ({r['case']}, {r['dims']}) spills on " \
                                    f"sm_{r['cc']}: {r['local']} B local memory per thread"
            assert r["smem"] <= r["limit"], f"{r['kernel']} ({r['case']}) needs {r['smem']} B " \
                                            f"of shared memory on sm_{r['cc']} > {r['limit']}"
            assert r["fits"]


def test_fp8_retrieval_is_refused_below_sm89_and_compiled_above(rows):
    fp8 = [r for r in rows if r["case"] == "fp8 retrieval"]
    assert {r["dims"] for r in fp8} == {"released", "smollm2"}
    for r in fp8:
        if r["cc"] == 80:
            assert r["kernel"] is None and "8.0" in r["refused"] and "sm_80" in r["refused"]
        else:
            assert r["kernel"] == "fp8_head_scores_kernel" and not r["refused"]


def test_bridge_bf16_read_uses_hopper_tensor_cores(rows):
    reads = [r for r in rows if r["kernel"] == "bridge_read_kernel" and r["cc"] == 90
             and r["dims"] in ("released", "smollm2")]
    assert reads and all(r["wgmma"] for r in reads), "bf16 read product should use wgmma"


def test_bridge_variants_compile_for_sm90(rows):
    # The fp32 model (fp32 tl.dot, row tile 16) and the launcher's no-dot path (row tile 4,
    # fp32 activations with bf16 weights): the variants tests/test_bridge_compile.py held.
    variants = {(r["case"], r["kernel"]) for r in rows if r["dims"] == "smollm2-fp32"}
    for case in ("bridge read", "bridge read, row tile 4, bf16 weights"):
        assert {(case, "bridge_read_kernel"), (case, "bridge_read_finish_kernel")} <= variants
    for case in ("bridge write", "bridge write, row tile 4, bf16 weights"):
        assert {(case, "bridge_message_kernel"), (case, "bridge_write_kernel")} <= variants


def test_fp8_launcher_refuses_sm80_naming_the_capability():
    from vllm_dspine.kernels.retrieval import FP8Head, fp8_head_scores_fwd

    head = FP8Head(torch.empty(64, 32, dtype=torch.float8_e4m3fn, device="meta"),
                   torch.empty(64, device="meta"))
    hidden = torch.empty(4, 32, dtype=torch.bfloat16, device="meta")
    with pytest.raises(ValueError, match=r"8\.0 \(sm_80\).*'bf16'"):
        fp8_head_scores_fwd(hidden, head, capability=(8, 0))
    with pytest.raises(ValueError, match=r"8\.6 \(sm_86\)"):
        fp8_head_scores_fwd(hidden, head, capability=(8, 6))
