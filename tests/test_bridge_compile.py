"""The bridge kernels compile for an H100/H200 (sm_90) on a machine without a GPU.

The interpreter tests check the math but not what the compiler accepts (dot shapes,
dtype mixes, constexpr branches). Triton's wheel carries ptxas, so the kernels are
compiled here ahead of time to a cubin for sm_90, in a subprocess: under
TRITON_INTERPRET=1 (set by conftest for this process) `triton.jit` yields interpreted
functions that cannot be compiled. Nothing is launched.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.triton

SCRIPT = textwrap.dedent('''
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from vllm_dspine.kernels import bridge as B

    TARGET = GPUTarget("cuda", 90, 32)

    def build(fn, sig, consts):
        full = dict(sig)
        full.update({k: "constexpr" for k in consts})
        k = triton.compile(ASTSource(fn, full, consts), target=TARGET)
        assert k.asm["cubin"], fn.__name__
        return k.asm["ptx"]

    for x_dt, w_dt, bn in (("bf16", "bf16", 64), ("fp32", "fp32", 16), ("fp32", "bf16", 4)):
        flags = dict(USE_DOT=bn >= 16, W_FP32=w_dt == "fp32", INTERPRET=False)
        ptx = build(B.bridge_read_kernel, dict(
            x_ptr=f"*{x_dt}", read_weight_ptr=f"*{w_dt}", zpart_ptr="*fp32",
            sqpart_ptr="*fp32", N="i32", H="i32", C="i32", stride_x="i32", stride_w="i32"),
            dict(H_PER_SPLIT=1280, BLOCK_N=bn, BLOCK_H=64, BLOCK_C=64, **flags))
        if w_dt == "bf16" and bn >= 16:
            assert "wgmma" in ptx, "bf16 read product should use Hopper tensor cores"
        build(B.bridge_message_kernel, dict(
            codes_ptr="*fp32", is_anchor_ptr="*u8", gate_recv_ptr=f"*{w_dt}",
            gate_pred_ptr=f"*{w_dt}", value_ptr=f"*{w_dt}", gate_bias_ptr=f"*{w_dt}",
            msg_ptr="*fp32", N="i32", C="i32", M="i32", stride_c="i32", stride_g="i32",
            stride_gp="i32", stride_a="i32", stride_m="i32"),
            dict(BLOCK_N=bn, BLOCK_M=64, BLOCK_C=64, **flags))
        build(B.bridge_write_kernel, dict(
            x_ptr=f"*{x_dt}", rms_ptr="*fp32", msg_ptr="*fp32", is_anchor_ptr="*u8",
            write_weight_ptr=f"*{w_dt}", out_ptr=f"*{x_dt}", N="i32", H="i32", M="i32",
            stride_x="i32", stride_m="i32", stride_w="i32", stride_o="i32"),
            dict(BLOCK_N=bn, BLOCK_H=64, BLOCK_M=64, **flags))
        build(B.bridge_read_finish_kernel, dict(
            zpart_ptr="*fp32", sqpart_ptr="*fp32", codebook_ptr=f"*{w_dt}",
            token_ids_ptr="*i64", is_anchor_ptr="*u8", codes_ptr="*fp32", rms_ptr="*fp32",
            N="i32", H="i32", C="i32", stride_e="i32", stride_c="i32", eps="fp32",
            scale="fp32"),
            dict(NUM_SPLITS=4, BLOCK_R=4, BLOCK_C=1024))
    print("compiled")
''')


def test_kernels_compile_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9's default, stated
    proc = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True,
                          text=True, timeout=600)
    if proc.returncode != 0 and "ptxas" in proc.stderr and "not found" in proc.stderr:
        pytest.skip("this Triton install has no ptxas")
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "compiled" in proc.stdout
