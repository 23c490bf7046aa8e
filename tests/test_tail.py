"""Serial tail score tables (docs/design.md section 1.5): the direct formula and the accelerated
tables against an independent loop-by-loop brute force, and the greedy walk."""

import math

import pytest
import torch

from vllm_dspine.kernels.bridge_ref import BridgeWeights, bridge_read_ref
from vllm_dspine.kernels.retrieval import retrieve_candidates
from vllm_dspine.kernels.tail import (
    LastWriteInputs,
    TailTables,
    TailWeights,
    refine_last_write,
    serial_tail,
    tail_score_tables,
)
from vllm_dspine.kernels.tail_ref import rms_norm_ref

NORM_EPS = 1e-6


def make_case(R, B, H, C, M, V, k, seed, head_dtype=torch.float32):
    """Random drafter weights and a last-layer state, with codes read by the bridge and
    candidates retrieved from the unrefined final state (as the proposer does): the
    tail's three arguments by name (inputs, cand_ids, weights)."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape, scale=1.0):
        return torch.randn(*shape, generator=gen) * scale

    L = 2
    # Scales chosen so that the message moves x' by about as much as x itself: then the
    # predecessor candidate changes the table and the test can tell right from wrong.
    weights = BridgeWeights(
        codebook=randn(V, C, scale=C ** -0.5),
        read=[randn(C, H, scale=H ** -0.5) for _ in range(L)],
        gate_recv=randn(M, C, scale=C ** -0.5),
        gate_pred=randn(M, C, scale=C ** -0.5),
        value=randn(M, C, scale=C ** -0.5),
        gate_bias=randn(M, scale=0.1),
        write=[randn(H, M, scale=M ** -0.5) for _ in range(L)],
        eps=1e-6,
    )
    head = randn(V, H).to(head_dtype)  # [V, H]
    norm_weight = 1 + randn(H, scale=0.1)  # [H]
    x_last = randn(R, B, H, scale=2.0)  # [R, B, H]
    anchor_ids = torch.randint(0, V, (R,), generator=gen)  # [R]
    is_anchor = torch.zeros(R, B, dtype=torch.bool)
    is_anchor[:, 0] = True
    tokens = torch.zeros(R, B, dtype=torch.long)
    tokens[:, 0] = anchor_ids
    codes, rms = bridge_read_ref(x_last.reshape(-1, H), weights.read[-1], weights.codebook,
                                 tokens.reshape(-1), is_anchor.reshape(-1), weights.eps)
    final = rms_norm_ref(x_last[:, 1:].reshape(-1, H), norm_weight, NORM_EPS)
    cand_ids = retrieve_candidates(final, head, k, k, mode="bf16").view(R, B - 1, k)
    inputs = LastWriteInputs(pre_write_state=x_last, codes=codes.view(R, B, C),
                             rms=rms.view(R, B), anchor_ids=anchor_ids)
    return dict(inputs=inputs, cand_ids=cand_ids,
                weights=TailWeights(bridge=weights, norm_weight=norm_weight,
                                    norm_eps=NORM_EPS, head_weight=head))


def build_tables(case, dtype=torch.float32):
    w = case["weights"]
    return TailTables.build(w.bridge, w.head_weight, w.norm_weight, dtype=dtype)


def brute_force_scores(case):
    """Every (row, predecessor, candidate) by loops, float64, from the formula in docs/design.md
    section 1.5 written out here independently of the library."""
    inp, tw = case["inputs"], case["weights"]
    w = tw.bridge
    x, codes, rms = inp.pre_write_state.double(), inp.codes.double(), inp.rms.double()
    cand, anchor = case["cand_ids"], inp.anchor_ids
    head, g = tw.head_weight.double(), tw.norm_weight.double()
    G, Gp, A = w.gate_recv.double(), w.gate_pred.double(), w.value.double()
    b, W, E = w.gate_bias.double(), w.write[-1].double(), w.codebook.double()
    R, K, k = cand.shape
    H, C = x.shape[-1], E.shape[1]
    S = torch.empty(R, K, k, k, dtype=torch.float64)
    for r in range(R):
        for t in range(1, K + 1):
            for i in range(k):
                u = int(anchor[r]) if t == 1 else int(cand[r, t - 2, i])
                pred = math.sqrt(C) * E[u]
                m = torch.sigmoid(G @ codes[r, t] + Gp @ pred + b) * (A @ pred)
                x_new = x[r, t] + rms[r, t] * (W @ m)
                y = x_new / torch.sqrt((x_new * x_new).sum() / H + tw.norm_eps) * g
                for j in range(k):
                    S[r, t - 1, i, j] = torch.dot(head[int(cand[r, t - 1, j])], y)
    return S


def brute_force_greedy(S, cand):
    R, K, k, _ = S.shape
    drafts = []
    for r in range(R):
        prev, row = 0, []
        for t in range(K):
            scores = S[r, t, prev].tolist()
            prev = max(range(k), key=lambda j: scores[j])
            row.append(int(cand[r, t, prev]))
        drafts.append(row)
    return drafts


def _rel(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().pow(2).mean().sqrt()).item()


@pytest.mark.parametrize("head_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_greedy_walk_equals_brute_force(head_dtype):
    case = make_case(R=3, B=6, H=64, C=32, M=16, V=300, k=8, seed=0, head_dtype=head_dtype)
    S_brute = brute_force_scores(case)
    expected = brute_force_greedy(S_brute, case["cand_ids"])
    tables = build_tables(case)
    R = case["inputs"].anchor_ids.shape[0]
    for tab in (None, tables):
        S = tail_score_tables(**case, tables=tab)
        assert S.dtype == torch.float32
        assert _rel(S, S_brute) < 1e-5
        prop = serial_tail(S, case["cand_ids"], temperature=torch.zeros(R))
        assert prop.draft_token_ids.tolist() == expected
        # Greedy rows retain a one-hot distribution at the chosen candidate.
        assert torch.all(prop.cand_probs.sum(-1) == 1) and torch.all(
            prop.cand_probs.max(-1).values == 1)
        chosen = prop.cand_probs.argmax(-1, keepdim=True)
        assert torch.equal(prop.cand_ids.gather(2, chosen).squeeze(2), prop.draft_token_ids)
    # The case is informative: the predecessor changes the best candidate somewhere, and
    # the walk leaves the unrefined top candidate somewhere.
    best_per_pred = S_brute[:, 1:].argmax(-1)  # [R, K-1, k(u)]
    assert (best_per_pred != best_per_pred[..., :1]).any()
    assert any(d != c for d, c in zip(sum(expected, []),
                                      case["cand_ids"][:, :, 0].flatten().tolist()))


@pytest.mark.parametrize("R,B,k,dtype", [
    pytest.param(1, 2, 4, torch.float32, id="R1-B2-k4-fp32"),  # a single proposal row
    pytest.param(3, 16, 16, torch.float32, id="R3-B16-k16-fp32"),
    pytest.param(3, 16, 16, torch.float64, id="R3-B16-k16-fp64"),
])
def test_tables_path_equals_direct_path(R, B, k, dtype):
    case = make_case(R=R, B=B, H=96, C=64, M=32, V=500, k=k, seed=1)
    tables = build_tables(case, dtype=dtype)
    direct = tail_score_tables(**case, dtype=dtype)
    fast = tail_score_tables(**case, tables=tables, dtype=dtype)
    assert direct.shape == fast.shape == (R, B - 1, k, k)
    assert direct.dtype == fast.dtype == dtype
    # fp32 rounding of the message and of the expanded norm: measured ~5e-7 of the RMS of S,
    # in float64 too (the direct path's message comes from bridge_message_ref in fp32).
    assert _rel(fast, direct) < 1e-5
    # Row 1's table is the anchor's for every predecessor index.
    assert torch.equal(fast[:, 0], fast[:, 0, :1].expand_as(fast[:, 0]))


def test_refine_last_write_picks_dtype_and_matches_parts():
    case = make_case(R=2, B=5, H=64, C=32, M=16, V=300, k=8, seed=3)
    temperature = torch.tensor([0.0, 0.8])
    gens = [None, torch.Generator().manual_seed(11)]
    prop = refine_last_write(**case, temperature=temperature, generators=gens)
    S = tail_score_tables(**case, dtype=torch.float64)
    again = serial_tail(S, case["cand_ids"], temperature,
                        generators=[None, torch.Generator().manual_seed(11)])
    assert torch.equal(prop.draft_token_ids, again.draft_token_ids)
    assert torch.equal(prop.cand_probs, again.cand_probs)


def test_bad_inputs_raise():
    case = make_case(R=2, B=4, H=64, C=32, M=16, V=300, k=8, seed=4)
    with pytest.raises(ValueError, match="float32 or float64"):
        tail_score_tables(**case, dtype=torch.bfloat16)
    bad = dict(case, cand_ids=case["cand_ids"][:, :2])
    with pytest.raises(ValueError, match="block_size - 1"):
        tail_score_tables(**bad)
    other = make_case(R=2, B=4, H=64, C=32, M=16, V=200, k=8, seed=4)
    tables = build_tables(other)
    with pytest.raises(ValueError, match="rebuild them"):
        tail_score_tables(**case, tables=tables)
