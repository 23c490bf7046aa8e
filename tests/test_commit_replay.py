"""The GDN replay commit (vllm_dspine/commit/) against an independent float64 recurrence.

Each request has a history (a prefix of tokens, run from the zero state as vLLM starts a
fresh sequence) and a verified block of T_r positions (row 0: the token sampled last
step; rows 1..: drafts). The checkpoint is the prefix's state and conv window; the
replay commit with `n` accepted positions must equal the float64 recurrence over
prefix + the first n block tokens, for every accepted-draft count 0..15 (n = 1..16),
and leave a request with n = 0 unchanged. Requests in one batch get different block
lengths (full 16, short, zero drafts) and different accepted counts.

The oracle below is written separately from `gdn_ref.py` on purpose (per value head and
token, explicit conv taps from a list of past inputs, log1p softplus); it shares only the
definition in the `gdn_ref` docstring, including that the conv output is rounded to the
activation dtype (vLLM's conv kernels write it in that dtype).

Errors are relative to the oracle's RMS. Triton cases run under TRITON_INTERPRET=1
(tests/conftest.py) on small shapes.
"""

from __future__ import annotations

import math

import pytest
import torch

from vllm_dspine.commit import GDNWeights, VerifiedBlockInputs, gdn_replay, replay_commit_ref

W = 4  # conv width of Qwen3.5 / Qwen3-Next (linear_conv_kernel_dim)
MAX_BLOCK = 16  # anchor + 15 drafts


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    """Tiny tensors: one intra-op thread. With several, each small op waits on its thread
    pool, ~100x slower here while a background job holds the cores."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


def rel_rms(x: torch.Tensor, ref: torch.Tensor) -> float:
    x, ref = x.double(), ref.double()
    return ((x - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt().clamp_min(1e-30)).item()


# ----------------------------------------------------------------------------- oracle
def oracle_states(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, w: GDNWeights,
                  act_dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """float64 GDN over one sequence from the zero state: [(state [HV, V, K], window
    [D, W-1]) after 0, 1, ..., len(x) tokens]."""
    H, HV, K, V, D = w.num_k_heads, w.num_v_heads, w.head_k_dim, w.head_v_dim, w.conv_dim
    cw = w.conv_weight.double()
    bias = w.conv_bias.double() if w.conv_bias is not None else torch.zeros(D, dtype=torch.float64)
    A = torch.exp(w.A_log.double())
    dt_bias = w.dt_bias.double()
    past = [torch.zeros(D, dtype=torch.float64) for _ in range(W - 1)]  # oldest first
    S = [torch.zeros(V, K, dtype=torch.float64) for _ in range(HV)]
    out = [(torch.stack(S), torch.stack(past, dim=1))]
    for t in range(x.shape[0]):
        xt = x[t].double()
        taps = past + [xt]
        y = bias.clone()
        for tap in range(W):
            y = y + cw[:, tap] * taps[tap]
        y = y * torch.sigmoid(y)  # silu
        y = y.to(act_dtype).double()
        for j in range(HV):
            i = j // (HV // H)
            k = y[H * K + i * K:H * K + (i + 1) * K]
            k = k / math.sqrt(float(k @ k) + 1e-6)
            v = y[2 * H * K + j * V:2 * H * K + (j + 1) * V]
            z = float(a[t, j]) + float(dt_bias[j])
            softplus = z if z > 20.0 else math.log1p(math.exp(z))
            decay = math.exp(-float(A[j]) * softplus)
            beta = 1.0 / (1.0 + math.exp(-float(b[t, j])))
            Sj = S[j] * decay
            delta = beta * (v - Sj @ k)
            S[j] = Sj + torch.outer(delta, k)
        past = past[1:] + [xt]
        out.append((torch.stack(S), torch.stack(past, dim=1)))
    return out


# ------------------------------------------------------------------------- test data
def make_weights(H: int, HV: int, K: int, V: int, dtype: torch.dtype, seed: int,
                 conv_bias: bool = False) -> GDNWeights:
    g = torch.Generator().manual_seed(seed)
    D = 2 * H * K + HV * V
    return GDNWeights(
        conv_weight=(torch.randn(D, W, generator=g) * 0.5).to(dtype),
        conv_bias=(torch.randn(D, generator=g) * 0.1).to(dtype) if conv_bias else None,
        # decays exp(g) between ~0.2 and ~1, as trained layers have (A = exp(A_log) <= 1)
        A_log=torch.rand(HV, generator=g).clamp_min(0.05).log(),
        dt_bias=torch.randn(HV, generator=g) * 0.5,
        num_k_heads=H, head_k_dim=K, head_v_dim=V)


def make_tokens(n: int, w: GDNWeights, dtype: torch.dtype, g: torch.Generator):
    """Pre-conv inputs x [n, D] and gate inputs a, b [n, HV] of n tokens."""
    x = torch.randn(n, w.conv_dim, generator=g).to(dtype)
    a = (torch.randn(n, w.num_v_heads, generator=g) * 2).to(dtype)
    b = (torch.randn(n, w.num_v_heads, generator=g) * 2).to(dtype)
    return x, a, b


class Batch:
    """R requests: prefix (history) + verified block each, with the oracle's states."""

    def __init__(self, w: GDNWeights, prefix_lens: list[int], block_lens: list[int],
                 dtype: torch.dtype, state_dtype: torch.dtype, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.w, self.block_lens = w, block_lens
        xs, as_, bs, ckpt, win, self.truth = [], [], [], [], [], []
        for P, T in zip(prefix_lens, block_lens):
            x, a, b = make_tokens(P + T, w, dtype, g)
            states = oracle_states(x, a, b, w, dtype)
            ckpt.append(states[P][0].to(state_dtype))
            win.append(states[P][1].to(dtype))  # raw inputs: exact in their own dtype
            self.truth.append(states[P:])  # [n] = after n block tokens
            xs.append(x[P:]), as_.append(a[P:]), bs.append(b[P:])
        qsl = torch.tensor([0] + block_lens).cumsum(0)
        self.inputs = VerifiedBlockInputs(mixed_qkv=torch.cat(xs), a=torch.cat(as_),
                                          b=torch.cat(bs), query_start_loc=qsl)
        self.checkpoint = torch.stack(ckpt)  # [R, HV, V, K]
        self.window = torch.stack(win)  # [R, D, W-1]

    def expected(self, counts: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        return (torch.stack([t[n][0] for t, n in zip(self.truth, counts)]),
                torch.stack([t[n][1] for t, n in zip(self.truth, counts)]))


def accepted_counts(drafts_accepted: int, block_lens: list[int]) -> list[int]:
    """num_accepted_tokens per request for one step: request 0 (a full block) accepts
    `drafts_accepted` drafts; the others accept a different share of theirs; a 1-token
    block (zero drafts) commits its one position, except once where it is padding (0)."""
    counts = []
    for r, T in enumerate(block_lens):
        if r == 0:
            assert T == MAX_BLOCK
            counts.append(drafts_accepted + 1)
        elif T == 1:
            counts.append(0 if drafts_accepted == 15 else 1)
        else:
            counts.append((drafts_accepted * (r + 2)) % T + 1)
    return counts


# Tolerances on the error relative to the oracle's RMS, by (input dtype, state dtype).
# fp32: the replay's fp32 arithmetic against float64: ~2e-7 seen, 1e-5.
# bf16 inputs, fp32 state: as fp32 (~1.5e-7 seen), plus, rarely, a one-ulp difference
#   where the oracle's float64 conv sum and the replay's fp32 sum round to different bf16
#   neighbours: 1e-4. Not rounding the conv output to bf16 at all gives ~2e-3.
# bf16 state: the committed state is rounded to bf16 (2^-9 relative), and so was the
#   checkpoint: ~2.2e-3 seen, 6e-3. One position too few gives ~0.6; a wrong decay, gate
#   or GQA head errors of order 0.1 to 1.
TOL = {(torch.float32, torch.float32): 1e-5, (torch.bfloat16, torch.float32): 1e-4,
       (torch.bfloat16, torch.bfloat16): 6e-3}

REF_CASES = [
    # (H, HV, K, V, prefix lengths, block lengths)
    pytest.param(1, 1, 32, 32, [5], [16], id="K32-V32-H1-HV1-R1"),
    pytest.param(2, 4, 64, 64, [0, 9, 30], [16, 5, 1], id="K64-V64-H2-HV4-R3"),
    pytest.param(1, 2, 128, 128, [23, 2], [16, 16], id="K128-V128-H1-HV2-R2"),
    pytest.param(4, 4, 32, 64, [3, 11, 1], [16, 1, 9], id="K32-V64-H4-HV4-R3"),
]
DTYPES = [
    # (input dtype, state dtype)
    pytest.param(torch.float32, torch.float32, id="fp32"),
    pytest.param(torch.bfloat16, torch.float32, id="bf16-in"),
    pytest.param(torch.bfloat16, torch.bfloat16, id="bf16-state"),
]


@pytest.mark.parametrize("dtype,state_dtype", DTYPES)
@pytest.mark.parametrize("H,HV,K,V,prefix_lens,block_lens", REF_CASES)
def test_reference_replay_every_accepted_length(H, HV, K, V, prefix_lens, block_lens,
                                                dtype, state_dtype):
    w = make_weights(H, HV, K, V, dtype, seed=H * 1000 + K)
    batch = Batch(w, prefix_lens, block_lens, dtype, state_dtype, seed=V + len(block_lens))
    for drafts in range(MAX_BLOCK):
        counts = accepted_counts(drafts, block_lens)
        state, window = replay_commit_ref(batch.checkpoint, batch.window, batch.inputs,
                                          torch.tensor(counts), w)
        want_state, want_window = batch.expected(counts)
        assert state.dtype == state_dtype and window.dtype == dtype
        err = rel_rms(state, want_state)
        assert err < TOL[dtype, state_dtype], (drafts, counts, err)
        # The window holds raw inputs: exact.
        assert torch.equal(window.double(), want_window), (drafts, counts)
        for r, n in enumerate(counts):
            if n == 0:
                assert torch.equal(state[r], batch.checkpoint[r])
                assert torch.equal(window[r], batch.window[r])


def test_replay_is_the_forward_prefix():
    """Committing n positions equals running the layer over n tokens, and (for n = T) is
    where vLLM's speculative layout would put slot T - 1: one more check that 'accepted
    length' counts the anchor position."""
    from vllm_dspine.commit.gdn_ref import gdn_forward_ref

    w = make_weights(1, 2, 32, 32, torch.float32, seed=3)
    batch = Batch(w, [4], [16], torch.float32, torch.float32, seed=4)
    x, a, b = batch.inputs.mixed_qkv, batch.inputs.a, batch.inputs.b
    for n in (1, 7, 16):
        _, s, cw = gdn_forward_ref(batch.checkpoint[0], batch.window[0], x[:n], a[:n], b[:n], w)
        state, window = replay_commit_ref(batch.checkpoint, batch.window, batch.inputs,
                                          torch.tensor([n]), w)
        assert torch.equal(state[0], s) and torch.equal(window[0], cw)


# ------------------------------------------------------------------ public entry, pools
def _pools(batch: Batch, num_slots: int, slots: list[int], sd_layout: bool, seed: int):
    """vLLM-like pools holding the checkpoints at `slots` and junk elsewhere.
    sd_layout: the conv pool is stored [num_slots, W-1, D] and passed as its [.., D, W-1]
    transpose (vLLM's SD layout)."""
    g = torch.Generator().manual_seed(seed)
    R, HV, V, K = batch.checkpoint.shape
    D = batch.window.shape[1]
    ssm = torch.randn(num_slots, HV, V, K, generator=g).to(batch.checkpoint.dtype)
    if sd_layout:
        conv = torch.randn(num_slots, W - 1, D, generator=g).to(batch.window.dtype)
        conv = conv.transpose(1, 2)
    else:
        conv = torch.randn(num_slots, D, W - 1, generator=g).to(batch.window.dtype)
    idx = torch.tensor(slots)
    ssm[idx] = batch.checkpoint
    conv[idx] = batch.window
    return ssm, conv


@pytest.mark.parametrize("use_triton", [
    pytest.param(False, id="reference"),
    pytest.param(True, id="triton", marks=pytest.mark.triton),
])
def test_gdn_replay_in_place_on_pools(use_triton):
    """`gdn_replay` commits in place at the requests' slots (any order), leaves other
    slots alone, and reads the conv pool through strides (SD layout transposed)."""
    w = make_weights(2, 2, 32, 40, torch.bfloat16, seed=7, conv_bias=True)
    batch = Batch(w, [6, 0, 13], [16, 3, 1], torch.bfloat16, torch.float32, seed=8)
    slots = [5, 1, 3]
    ssm, conv = _pools(batch, 6, slots, sd_layout=True, seed=9)
    before_ssm, before_conv = ssm.clone(), conv.clone()
    counts = [11, 3, 1]
    gdn_replay(ssm, conv, batch.inputs, torch.tensor(counts, dtype=torch.int32), w,
               state_indices=torch.tensor(slots, dtype=torch.int32), use_triton=use_triton)
    want_state, want_window = batch.expected(counts)
    idx = torch.tensor(slots)
    assert rel_rms(ssm[idx], want_state) < TOL[torch.bfloat16, torch.float32]
    assert torch.equal(conv[idx].double(), want_window)
    others = torch.tensor([0, 2, 4])
    assert torch.equal(ssm[others], before_ssm[others])
    assert torch.equal(conv[others], before_conv[others])


ALL_LENGTHS = ([MAX_BLOCK] * MAX_BLOCK + [5, 1, 1],  # block lengths
               list(range(1, MAX_BLOCK + 1)) + [4, 1, 0])  # num_accepted_tokens
FEW_LENGTHS = ([MAX_BLOCK, 7, 1], [13, 7, 0])

TRITON_CASES = [
    # (H, HV, K, V, dtype, state dtype, conv bias, (block lengths, counts)):
    # the first two cover every accepted length in one launch; awkward K / V give
    # partial tiles (K 48 in a 64 tile, V 40 over two 32 tiles).
    pytest.param(1, 2, 32, 32, torch.float32, torch.float32, False, ALL_LENGTHS,
                 id="K32-V32-GQA2-fp32-all"),
    pytest.param(1, 1, 32, 32, torch.bfloat16, torch.float32, False, ALL_LENGTHS,
                 id="K32-V32-bf16-in-all"),
    pytest.param(2, 4, 48, 40, torch.float32, torch.float32, True, FEW_LENGTHS,
                 id="K48-V40-GQA2-bias"),
    pytest.param(1, 1, 32, 64, torch.bfloat16, torch.bfloat16, False, FEW_LENGTHS,
                 id="K32-V64-bf16-state"),
]


@pytest.mark.triton
@pytest.mark.parametrize("H,HV,K,V,dtype,state_dtype,bias,lengths", TRITON_CASES)
def test_triton_replay_matches_reference(H, HV, K, V, dtype, state_dtype, bias, lengths):
    """Batched launches with full, short and zero-draft blocks and a padding row (n = 0);
    against the reference (the same arithmetic: fp32 rounding apart, and bit-equal
    rounding to bf16, see `_bf16_rtne`) and against the float64 oracle."""
    block_lens, counts = lengths
    w = make_weights(H, HV, K, V, dtype, seed=11 + K, conv_bias=bias)
    prefix_lens = [(7 * r) % 5 for r in range(len(block_lens))]
    batch = Batch(w, prefix_lens, block_lens, dtype, state_dtype, seed=12)
    num_accepted = torch.tensor(counts)
    ref_state, ref_window = replay_commit_ref(batch.checkpoint, batch.window,
                                              batch.inputs, num_accepted, w)
    ssm, conv = batch.checkpoint.clone(), batch.window.clone()
    gdn_replay(ssm, conv, batch.inputs, num_accepted, w, use_triton=True)
    assert rel_rms(ssm, ref_state) < (1e-6 if state_dtype == torch.float32 else 1e-5)
    assert torch.equal(conv, ref_window)
    want_state, want_window = batch.expected(counts)
    assert rel_rms(ssm, want_state) < TOL[dtype, state_dtype]
    assert torch.equal(conv.double(), want_window)


# ------------------------------------------------------------------------ validation
def test_gdn_replay_refuses_bad_arguments(monkeypatch):
    w = make_weights(1, 2, 32, 32, torch.float32, seed=1)
    batch = Batch(w, [2, 2], [4, 3], torch.float32, torch.float32, seed=2)
    ssm, conv = batch.checkpoint.clone(), batch.window.clone()

    def call(**kw):
        args = dict(ssm_state=ssm, conv_state=conv, inputs=batch.inputs,
                    num_accepted_tokens=torch.tensor([4, 3]), weights=w)
        args.update(kw)
        gdn_replay(**args)

    with pytest.raises(ValueError, match="num_accepted_tokens must lie in 0 .. query length"):
        call(num_accepted_tokens=torch.tensor([5, 1]))
    with pytest.raises(ValueError, match="num_accepted_tokens must lie in 0 .. query length"):
        call(num_accepted_tokens=torch.tensor([-1, 1]))
    wide = torch.zeros(2, w.conv_dim, W - 1 + 15)  # vLLM's speculative-width window
    with pytest.raises(ValueError, match="not a replay window"):
        call(conv_state=wide)
    with pytest.raises(ValueError, match=r"ssm_state must be \[num_slots, HV=2, V=32, K=32\]"):
        call(ssm_state=ssm.transpose(2, 3)[:, :, :16])
    with pytest.raises(ValueError, match="state_indices must be distinct slots"):
        call(state_indices=torch.tensor([1, 1]))
    with pytest.raises(ValueError, match=r"a must be \[num_tokens=7, HV=2\]"):
        call(inputs=VerifiedBlockInputs(batch.inputs.mixed_qkv, batch.inputs.a[:, :1],
                                        batch.inputs.b, batch.inputs.query_start_loc))
    import vllm_dspine.commit.replay as replay

    monkeypatch.setattr(replay, "_interpret", lambda: False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        call(use_triton=True)


# ---------------------------------------------------------------------------- memory
def test_state_memory_one_slot_vs_speculative_layout():
    """The memory planner's hybrid-state figures at the assumed Qwen3.8-27B GDN dims
    (docs/hybrid.md): per GDN layer and request, vLLM keeps 1 + K pages of conv window
    (W - 1 + K wide) + fp32 state; the replay keeps one page of W - 1 + state, plus the
    block's per-position inputs while a step is in flight."""
    from vllm_dspine.model.memory import QWEN38_27B_GDN, MiB, gdn_state_memory

    m = gdn_state_memory(QWEN38_27B_GDN, num_spec=15)
    D = 2 * 16 * 128 + 48 * 128  # 10,240 conv channels
    state = 48 * 128 * 128 * 4  # 3 MiB fp32
    assert m.conv_dim == D and m.state_bytes == state
    assert m.speculative_page_bytes == D * (3 + 15) * 2 + state
    assert m.replay_page_bytes == D * 3 * 2 + state
    assert m.replay_inputs_bytes == 16 * (D + 2 * 48) * 2
    assert m.num_gdn_layers == 48
    assert m.speculative_per_request == 48 * 16 * m.speculative_page_bytes
    assert m.replay_per_request == 48 * (m.replay_page_bytes + m.replay_inputs_bytes)
    assert round(m.speculative_per_request / MiB) == 2574
    assert round(m.replay_per_request / MiB) == 162
