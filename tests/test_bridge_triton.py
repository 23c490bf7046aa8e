"""Triton bridge kernels (`bridge.py`) against the reference, under TRITON_INTERPRET=1.

tests/conftest.py sets TRITON_INTERPRET=1 before triton is imported, so the kernels run
on CPU tensors through `use_triton=True` (the public path) or the `*_fwd` launchers
(to pick tile sizes). The interpreter is ~1000x slower than a GPU: shapes stay small,
but odd on purpose (H 96/100, C 40/60, M 24/36: partial tiles everywhere).
"""

from __future__ import annotations

import math
import os

import pytest
import torch

from vllm_dspine.kernels.bridge import bridge_read_fwd, bridge_write_fwd, code_bridge
from vllm_dspine.kernels.bridge_ref import (
    BridgeWeights,
    bridge_read_ref,
    bridge_write_ref,
    code_bridge_ref,
)

pytestmark = pytest.mark.triton

EPS = 1e-6
V = 50

# Error relative to the reference's RMS (as flash-linear-attention measures it).
# fp32: the kernels use full fp32 products (no TF32); only the summation order differs
#   from torch, ~1e-7 observed, so 1e-5.
# bf16: x' is rounded to bf16 (2^-9 relative) by both sides and may land one ulp apart;
#   the message is rounded to bf16 before the W_l product (a tensor-core input). Seen
#   ~5e-3 on x' and ~1e-2 on the update x' - x (smaller than x', so the same absolute
#   rounding weighs more). Tolerances 2e-2 and 5e-2; a wrong predecessor, a missing gate
#   or a wrong scale gives errors of order 1.
TOL = {
    torch.float32: dict(codes=1e-5, rms=1e-5, x=1e-5, update=1e-5),
    torch.bfloat16: dict(codes=2e-2, rms=1e-5, x=2e-2, update=5e-2),
}


def make_weights(H: int, C: int, M: int, dtype: torch.dtype, seed: int) -> BridgeWeights:
    """Random weights scaled so codes ~1, m ~0.5 and r * W m ~ x / 2 (see test_bridge_ref)."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape: int, fan_in: int = 1) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) / math.sqrt(fan_in)).to(dtype)

    return BridgeWeights(
        codebook=rand(V, C, fan_in=C), read=[rand(C, H, fan_in=H)],
        gate_recv=rand(M, C, fan_in=C), gate_pred=rand(M, C, fan_in=C),
        value=rand(M, C, fan_in=C), gate_bias=rand(M), write=[rand(H, M, fan_in=M)], eps=EPS)


def make_rows(block_sizes: list[int], H: int, dtype: torch.dtype, seed: int):
    """One block per request, flattened: x [N, H], token_ids [N], is_anchor [N], spans."""
    g = torch.Generator().manual_seed(seed + 1)
    N = sum(block_sizes)
    x = (3.0 * torch.randn(N, H, generator=g)).to(dtype)  # [N, H]
    token_ids = torch.randint(0, V, (N,), generator=g)  # [N]
    is_anchor = torch.zeros(N, dtype=torch.bool)  # [N]
    spans, start = [], 0
    for size in block_sizes:
        is_anchor[start] = True
        spans.append((start, start + size))
        start += size
    return x, token_ids, is_anchor, spans


def err_ratio(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    return ((out - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt()).item()


# tiles: (block_n, block_h, block_c, block_m, num_splits) for the launchers; None = the
# launcher's default. block_n < 16 takes the broadcast-and-sum path instead of tl.dot;
# num_splits > 1 splits H across programs in the read (partials summed afterwards).
CASES = [
    pytest.param(96, 40, 24, [16], torch.float32, torch.float32, (None,) * 5,
                 id="H96-C40-M24-1req-b16-fp32-default-tiles"),
    pytest.param(100, 60, 36, [4, 16, 7], torch.float32, torch.float32, (16, 32, 16, 16, 4),
                 id="H100-C60-M36-3req-b4-16-7-fp32-tiles16-4-h-splits"),
    pytest.param(100, 40, 36, [5, 8, 4, 6], torch.float32, torch.float32, (1, 64, 64, 64, 1),
                 id="H100-C40-M36-4req-fp32-one-row-per-program"),
    pytest.param(100, 60, 36, [16, 5, 9, 4, 12], torch.bfloat16, torch.bfloat16, (None,) * 5,
                 id="H100-C60-M36-5req-b4-16-bf16-default-tiles"),
    pytest.param(96, 60, 24, [8, 13], torch.bfloat16, torch.bfloat16, (4, 32, 16, 16, 2),
                 id="H96-C60-M24-2req-bf16-rowtile4-no-dot-2-h-splits"),
    pytest.param(96, 40, 36, [10, 6, 16], torch.float32, torch.bfloat16, (16, 32, 16, 32, 3),
                 id="H96-C40-M36-3req-x-fp32-weights-bf16-3-h-splits"),
    pytest.param(100, 60, 24, [7, 11], torch.bfloat16, torch.float32, (32, 64, 32, 16, 1),
                 id="H100-C60-M24-2req-x-bf16-weights-fp32-rowtile32"),
]


@pytest.mark.parametrize("H, C, M, block_sizes, x_dtype, w_dtype, tiles", CASES)
def test_kernels_match_reference(H, C, M, block_sizes, x_dtype, w_dtype, tiles):
    assert os.environ.get("TRITON_INTERPRET") == "1"
    block_n, block_h, block_c, block_m, num_splits = tiles
    w = make_weights(H, C, M, w_dtype, seed=H + C + M)
    x, token_ids, is_anchor, _ = make_rows(block_sizes, H, x_dtype, seed=len(block_sizes))
    tol = TOL[torch.bfloat16 if torch.bfloat16 in (x_dtype, w_dtype) else torch.float32]

    codes_ref, rms_ref = bridge_read_ref(x, w.read[0], w.codebook, token_ids, is_anchor, EPS)
    codes, rms = bridge_read_fwd(x, w.read[0], w.codebook, token_ids, is_anchor, EPS,
                                 block_n=block_n, block_h=block_h, block_c=block_c,
                                 num_splits=num_splits)
    assert codes.dtype == torch.float32 and codes.shape == codes_ref.shape
    assert err_ratio(rms, rms_ref) < tol["rms"]
    assert err_ratio(codes, codes_ref) < tol["codes"]
    # Anchor rows gather the codebook: no arithmetic but the sqrt(C) scale.
    assert torch.equal(codes[is_anchor], codes_ref[is_anchor])

    # The write, fed the reference's read, so its error is its own.
    args = (x, rms_ref, codes_ref, is_anchor, w.gate_recv, w.gate_pred, w.value,
            w.gate_bias, w.write[0])
    x_ref = bridge_write_ref(*args)
    x_new = bridge_write_fwd(*args, block_n=block_n, block_h=block_h, block_c=block_c,
                             block_m=block_m)
    assert x_new.dtype == x.dtype and x_new.shape == x.shape
    assert err_ratio(x_new, x_ref) < tol["x"]
    assert err_ratio(x_new.float() - x.float(), x_ref.float() - x.float()) < tol["update"]
    assert torch.equal(x_new[is_anchor], x[is_anchor])  # anchor rows: never written
    assert not torch.equal(x_new[~is_anchor], x[~is_anchor])


@pytest.mark.parametrize("dtype", [
    pytest.param(torch.float32, id="fp32"),
    pytest.param(torch.bfloat16, id="bf16"),
])
def test_code_bridge_public_triton_path(dtype):
    """The public entry with use_triton=True (default tiles) against code_bridge_ref."""
    H, C, M = 100, 60, 36
    w = make_weights(H, C, M, dtype, seed=1)
    x, token_ids, is_anchor, _ = make_rows([16, 3, 9], H, dtype, seed=2)
    got = code_bridge(x, 0, w, token_ids, is_anchor, use_triton=True)
    want = code_bridge_ref(x, 0, w, token_ids, is_anchor)
    tol = TOL[dtype]
    for name, a, b in zip(("x", "codes", "rms"), got, want):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert err_ratio(a, b) < tol[name], name
    assert torch.equal(got[0][is_anchor], x[is_anchor])


@pytest.mark.parametrize("tiles", [
    pytest.param((16, 32, 16, 16, 3), id="rowtile16-3-h-splits"),
    pytest.param((4, 64, 64, 64, 1), id="rowtile4-no-split"),
])
def test_kernels_keep_requests_independent(tiles):
    """Changing one request's rows never changes another request's outputs, bit for bit,
    even when the requests share a row tile (blocks of 5, 16 and 9 rows, tiles of 16)."""
    block_n, block_h, block_c, block_m, num_splits = tiles
    H, C, M = 96, 40, 24
    w = make_weights(H, C, M, torch.bfloat16, seed=3)
    x, token_ids, is_anchor, spans = make_rows([5, 16, 9], H, torch.bfloat16, seed=4)

    def run(x, token_ids):
        codes, rms = bridge_read_fwd(x, w.read[0], w.codebook, token_ids, is_anchor, EPS,
                                     block_n=block_n, block_h=block_h, block_c=block_c,
                                     num_splits=num_splits)
        x_new = bridge_write_fwd(x, rms, codes, is_anchor, w.gate_recv, w.gate_pred,
                                 w.value, w.gate_bias, w.write[0], block_n=block_n,
                                 block_h=block_h, block_c=block_c, block_m=block_m)
        return x_new, codes, rms

    before = run(x, token_ids)
    s, e = spans[1]  # the middle request; its last row precedes request 2's anchor
    x2, tok2 = x.clone(), token_ids.clone()
    x2[s:e] = torch.randn(e - s, H, generator=torch.Generator().manual_seed(5)).bfloat16()
    tok2[s] = (tok2[s] + 1) % V
    after = run(x2, tok2)
    others = torch.ones(x.shape[0], dtype=torch.bool)
    others[s:e] = False
    for out_before, out_after in zip(before, after):
        assert torch.equal(out_before[others], out_after[others])
        assert not torch.equal(out_before[s:e], out_after[s:e])


def test_kernels_accept_zero_rows():
    H, C, M = 96, 40, 24
    w = make_weights(H, C, M, torch.float32, seed=6)
    x = torch.empty(0, H)
    empty_ids = torch.empty(0, dtype=torch.long)
    empty_anchor = torch.empty(0, dtype=torch.bool)
    x_new, codes, rms = code_bridge(x, 0, w, empty_ids, empty_anchor, use_triton=True)
    assert x_new.shape == (0, H) and codes.shape == (0, C) and rms.shape == (0,)
