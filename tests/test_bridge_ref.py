"""The bridge reference (`bridge_ref.py`) against docs/design.md section 1.3, and its
layout rules.

The float64 oracle below is transcribed from the text of docs/design.md, one block and one
row at a time, without reading `bridge_ref.py`: if both were written from the same
misreading the test could not see it, so keep it independent.
"""

from __future__ import annotations

import math

import pytest
import torch

from vllm_dspine.kernels.bridge import bridge_read, bridge_write, code_bridge
from vllm_dspine.kernels.bridge_ref import (
    BridgeWeights,
    bridge_read_ref,
    bridge_write_ref,
    code_bridge_ref,
)

EPS = 1e-6


def make_weights(H: int, C: int, M: int, V: int, L: int, dtype: torch.dtype,
                 seed: int) -> BridgeWeights:
    """Random bridge weights scaled so every stage is O(1): codes have entries ~1,
    m ~0.5 and r * W m is about half of x, so an error in the write is not hidden by x."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape: int, fan_in: int = 1) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) / math.sqrt(fan_in)).to(dtype)

    return BridgeWeights(
        codebook=rand(V, C, fan_in=C),  # [V, C], rows of norm ~1
        read=[rand(C, H, fan_in=H) for _ in range(L)],  # L x [C, H]
        gate_recv=rand(M, C, fan_in=C),  # [M, C]
        gate_pred=rand(M, C, fan_in=C),  # [M, C]
        value=rand(M, C, fan_in=C),  # [M, C]
        gate_bias=rand(M),  # [M]
        write=[rand(H, M, fan_in=M) for _ in range(L)],  # L x [H, M]
        eps=EPS,
    )


def make_rows(block_sizes: list[int], H: int, V: int, dtype: torch.dtype, seed: int):
    """Rows of one block per request, flattened; returns x [N, H], token_ids [N],
    is_anchor [N] and the (start, end) row range of each request."""
    g = torch.Generator().manual_seed(seed + 1)
    N = sum(block_sizes)
    x = (3.0 * torch.randn(N, H, generator=g)).to(dtype)  # [N, H], RMS ~3 (not 1)
    token_ids = torch.randint(0, V, (N,), generator=g)  # [N]; only anchors' are used
    is_anchor = torch.zeros(N, dtype=torch.bool)  # [N]
    spans, start = [], 0
    for size in block_sizes:
        is_anchor[start] = True
        spans.append((start, start + size))
        start += size
    return x, token_ids, is_anchor, spans


def design_bridge_f64(x, layer, w: BridgeWeights, token_ids, is_anchor):
    """docs/design.md section 1.3 in float64, block by block, row by row.
    Returns (x', codes, rms)."""
    x = x.double()
    R, E = w.read[layer].double(), w.codebook.double()
    G, Gp, A = w.gate_recv.double(), w.gate_pred.double(), w.value.double()
    b, W = w.gate_bias.double(), w.write[layer].double()
    N, H = x.shape
    C = R.shape[0]
    eps = w.eps
    codes = torch.zeros(N, C, dtype=torch.float64)
    rms = torch.zeros(N, dtype=torch.float64)
    x_new = x.clone()
    starts = [i for i in range(N) if bool(is_anchor[i])]
    assert starts and starts[0] == 0
    for block, start in enumerate(starts):
        end = starts[block + 1] if block + 1 < len(starts) else N
        for t in range(end - start):
            i = start + t
            r = math.sqrt(sum(float(v) ** 2 for v in x[i]) / H)  # r_t = sqrt(mean x^2)
            rms[i] = r
            if t == 0:  # c_0 = sqrt(C) E[a]; m_0 = 0: the anchor row is not written
                codes[i] = math.sqrt(C) * E[int(token_ids[i])]
                continue
            z = R @ (x[i] / (r + eps))  # z_t = R_l (x_t / (r_t + eps))
            codes[i] = math.sqrt(C) * z / (math.sqrt(float(z @ z)) + eps)
            c_t, c_prev = codes[i], codes[i - 1]  # c_{t-1}: same block, same layer
            gate = 1.0 / (1.0 + torch.exp(-(G @ c_t + Gp @ c_prev + b)))
            m = gate * (A @ c_prev)  # m_t, [M]
            x_new[i] = x[i] + r * (W @ m)  # x'_t = x_t + r_t (W_l m_t)
    return x_new, codes, rms


def err_ratio(out: torch.Tensor, ref: torch.Tensor) -> float:
    """RMS of the error over the RMS of the reference (flash-linear-attention's measure)."""
    out, ref = out.double(), ref.double()
    return ((out - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt()).item()


@pytest.mark.parametrize("H, C, M, block_sizes", [
    pytest.param(96, 40, 24, [16], id="H96-C40-M24-1req"),
    pytest.param(100, 60, 36, [4, 16, 7], id="H100-C60-M36-3req"),
    pytest.param(64, 36, 40, [1, 5, 16, 2, 9], id="H64-C36-M40-5req-with-1-row-block"),
])
def test_reference_matches_design_float64(H, C, M, block_sizes):
    V, L, layer = 50, 2, 1
    w = make_weights(H, C, M, V, L, torch.float32, seed=H + C)
    x, token_ids, is_anchor, _ = make_rows(block_sizes, H, V, torch.float32, seed=M)
    x_new, codes, rms = code_bridge_ref(x, layer, w, token_ids, is_anchor)
    x_d, codes_d, rms_d = design_bridge_f64(x, layer, w, token_ids, is_anchor)
    # fp32 against float64 on O(1) values through sums of <= 100 terms: the relative
    # RMS error is ~1e-7; 1e-5 leaves room yet fails on any formula change (>= 1e-2).
    assert err_ratio(rms, rms_d) < 1e-5
    assert err_ratio(codes, codes_d) < 1e-5
    assert err_ratio(x_new, x_d) < 1e-5
    update, update_d = x_new.double() - x.double(), x_d - x.double()
    assert update_d.abs().max() > 0.1  # the write is not negligible, so it is tested
    assert err_ratio(update, update_d) < 1e-5


def test_reference_anchor_rows_are_not_written():
    H, C, M, V = 100, 60, 36, 50
    for dtype in (torch.float32, torch.bfloat16):
        w = make_weights(H, C, M, V, 1, dtype, seed=3)
        x, token_ids, is_anchor, _ = make_rows([3, 16, 6], H, V, dtype, seed=4)
        x_new, codes, _ = code_bridge_ref(x, 0, w, token_ids, is_anchor)
        assert torch.equal(x_new[is_anchor], x[is_anchor])
        assert not torch.equal(x_new[~is_anchor], x[~is_anchor])
        scale = math.sqrt(C)
        assert torch.equal(codes[is_anchor], scale * w.codebook.float()[token_ids[is_anchor]])


def test_reference_requests_are_independent():
    """Changing one request's rows (hidden state and anchor token) changes nothing in
    another request's outputs, bit for bit: no predecessor crosses a block boundary."""
    H, C, M, V = 96, 40, 24, 50
    w = make_weights(H, C, M, V, 1, torch.float32, seed=5)
    x, token_ids, is_anchor, spans = make_rows([6, 16, 4], H, V, torch.float32, seed=6)
    before = code_bridge_ref(x, 0, w, token_ids, is_anchor)
    s, e = spans[1]  # the middle request: its last row precedes request 2's anchor
    x2, tok2 = x.clone(), token_ids.clone()
    x2[s:e] = torch.randn(e - s, H, generator=torch.Generator().manual_seed(7))
    tok2[s] = (tok2[s] + 1) % V
    after = code_bridge_ref(x2, 0, w, tok2, is_anchor)
    others = torch.ones(x.shape[0], dtype=torch.bool)
    others[s:e] = False
    for out_before, out_after in zip(before, after):
        assert torch.equal(out_before[others], out_after[others])
        assert not torch.equal(out_before[s:e], out_after[s:e])


def test_public_functions_use_reference_on_cpu():
    """use_triton=None on CPU tensors is the reference path, bit for bit."""
    H, C, M, V = 96, 40, 24, 50
    w = make_weights(H, C, M, V, 1, torch.bfloat16, seed=8)
    x, token_ids, is_anchor, _ = make_rows([5, 11], H, V, torch.bfloat16, seed=9)
    got = code_bridge(x, 0, w, token_ids, is_anchor)
    want = code_bridge_ref(x, 0, w, token_ids, is_anchor)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    codes, rms = bridge_read(x, w.read[0], w.codebook, token_ids, is_anchor, EPS)
    assert torch.equal(codes, want[1]) and torch.equal(rms, want[2])


def _inputs():
    H, C, M, V = 96, 40, 24, 50
    w = make_weights(H, C, M, V, 1, torch.float32, seed=10)
    x, token_ids, is_anchor, _ = make_rows([4, 4], H, V, torch.float32, seed=11)
    return w, x, token_ids, is_anchor


@pytest.mark.parametrize("case, match", [
    ("x_1d", "x must have shape"),
    ("read_weight_wrong_H", "read_weight must have shape"),
    ("codebook_wrong_C", "codebook must have shape"),
    ("is_anchor_int", "is_anchor must be a bool tensor"),
    ("token_ids_short", "token_ids must have 8 rows"),
    ("token_ids_float", "token_ids must be a 1-D int32/int64"),
    ("read_weight_int", "read_weight must be float32"),
    ("read_weight_strided", "contiguous last dimension"),
])
def test_bridge_read_rejects_bad_input(case, match):
    w, x, token_ids, is_anchor = _inputs()
    R, E = w.read[0], w.codebook
    if case == "x_1d":
        x = x[0]
    elif case == "read_weight_wrong_H":
        R = R[:, :-1]
    elif case == "codebook_wrong_C":
        E = E[:, :-1]
    elif case == "is_anchor_int":
        is_anchor = is_anchor.int()
    elif case == "token_ids_short":
        token_ids = token_ids[:-1]
    elif case == "token_ids_float":
        token_ids = token_ids.float()
    elif case == "read_weight_int":
        R = R.int()
    elif case == "read_weight_strided":
        R = torch.cat([R, R], dim=1)[:, ::2]
    with pytest.raises(ValueError, match=match):
        bridge_read(x, R, E, token_ids, is_anchor, EPS)


@pytest.mark.parametrize("case, match", [
    ("codes_wrong_rows", "codes must have shape"),
    ("gate_pred_wrong_M", "gate_pred must have shape"),
    ("write_weight_transposed", "write_weight must have shape"),
    ("gate_bias_wrong_M", "gate_bias must have shape"),
    ("rms_wrong_rows", "rms must have shape"),
    ("value_other_dtype", "must share one dtype"),
])
def test_bridge_write_rejects_bad_input(case, match):
    w, x, token_ids, is_anchor = _inputs()
    codes, rms = bridge_read_ref(x, w.read[0], w.codebook, token_ids, is_anchor, EPS)
    args = dict(x=x, rms=rms, codes=codes, is_anchor=is_anchor, gate_recv=w.gate_recv,
                gate_pred=w.gate_pred, value=w.value, gate_bias=w.gate_bias,
                write_weight=w.write[0])
    if case == "codes_wrong_rows":
        args["codes"] = codes[:-1]
    elif case == "gate_pred_wrong_M":
        args["gate_pred"] = w.gate_pred[:-1]
    elif case == "write_weight_transposed":
        args["write_weight"] = w.write[0].t().contiguous()
    elif case == "gate_bias_wrong_M":
        args["gate_bias"] = w.gate_bias[:-1]
    elif case == "rms_wrong_rows":
        args["rms"] = rms[:-1]
    elif case == "value_other_dtype":
        args["value"] = w.value.bfloat16()
    with pytest.raises(ValueError, match=match):
        bridge_write(**args)


def test_code_bridge_rejects_bad_layer():
    w, x, token_ids, is_anchor = _inputs()
    with pytest.raises(ValueError, match="layer 1 out of range"):
        code_bridge(x, 1, w, token_ids, is_anchor)


def test_forcing_triton_on_cpu_needs_the_interpreter(monkeypatch):
    w, x, token_ids, is_anchor = _inputs()
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        code_bridge(x, 0, w, token_ids, is_anchor, use_triton=True)


def test_bridge_write_ref_keeps_dtype():
    w, x, token_ids, is_anchor = _inputs()
    xb = x.bfloat16()
    codes, rms = bridge_read_ref(xb, w.read[0], w.codebook, token_ids, is_anchor, EPS)
    out = bridge_write_ref(xb, rms, codes, is_anchor, w.gate_recv, w.gate_pred, w.value,
                           w.gate_bias, w.write[0])
    assert out.dtype == torch.bfloat16 and out.shape == xb.shape
