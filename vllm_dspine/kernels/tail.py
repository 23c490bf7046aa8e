"""The serial tail: score tables of the refined last write, and the walk through them
(docs/design.md section 1.5).

    R requests, B block rows (row 0 = anchor), K = B - 1 proposal rows,
    k = head_topk candidates per row, H hidden, C code width, M message width, V vocab.

Inputs, each one value: `LastWriteInputs` (the drafter's last layer, per request's
block), the candidates `cand_ids` [R, K, k] (retrieval), `TailWeights` (loaded once).
Steps, in order (`refine_last_write` runs them all):
1. `tail_score_tables`: S [R, K, k, k], S[r, t-1, i, j] = score of candidate j of row t
   when row t's predecessor is candidate i of row t-1 (the anchor for t = 1). With
   `TailTables` this costs M-wide work per pair; without, the direct H-wide formula of
   `tail_ref.py` runs.
2. `serial_tail`: the greedy walk or the sampled chain through S, per request; its
   output is the `SparseProposal` (proposal.py) handed to verification.

The tables are batched torch ops on CPU and CUDA alike (the work per pair is small).
The walk's 15 dependent steps are one Triton kernel on CUDA (`serial_tail_kernel`,
tail_walk.py: no host round trip per step) and the PyTorch loop `serial_walk_ref` on
CPU; both read the same uniforms (`draw_tail_uniforms`).
"""

from __future__ import annotations

import contextlib
import math
import os
from dataclasses import dataclass

import torch

from vllm_dspine.kernels.bridge_ref import BridgeWeights
from vllm_dspine.kernels.retrieval_ref import exact_scores_ref
from vllm_dspine.kernels.tail_ref import (
    LastWriteInputs,
    TailWeights,
    check_tail_inputs,
    predecessor_candidates,
    tail_score_tables_ref,
)
from vllm_dspine.kernels.tail_walk import SAMPLING_EPS, serial_tail_fwd
from vllm_dspine.proposal import SparseProposal

__all__ = ["SAMPLING_EPS", "LastWriteInputs", "TailWeights", "TailTables",
           "tail_score_tables", "filter_candidate_probs", "draw_tail_uniforms",
           "serial_walk_ref", "serial_tail", "continuous_score_tables",
           "refine_last_write"]

# Vocabulary rows per step when building the tables (bounds fp32 temporaries).
_CHUNK_ROWS = 16384


@dataclass
class TailTables:
    """Per-token tables that take the H-wide work out of the per-pair scores.

    pred_proj   = [E Gp^T | E A^T]     predecessor gate and value of every token
                                       (without the sqrt(C) factor)
    head_write  = (head * g) W_L       the head row seen through the last write
    gram        = W_L^T W_L            for the norm of x'
    Built once at load; fp32 by default (about 1.5 GiB at the released sizes).
    """

    pred_proj: torch.Tensor  # [V, 2M]
    head_write: torch.Tensor  # [V, M]
    gram: torch.Tensor  # [M, M]

    @property
    def message_dim(self) -> int:
        return self.gram.shape[0]

    @classmethod
    def build(
        cls,
        weights: BridgeWeights,
        head_weight: torch.Tensor,  # [V, H]
        norm_weight: torch.Tensor,  # [H]
        dtype: torch.dtype = torch.float32,
    ) -> "TailTables":
        V, H = head_weight.shape
        M = weights.message_dim
        if weights.codebook.shape[0] != V:
            raise ValueError(f"codebook has {weights.codebook.shape[0]} rows but the head has "
                             f"{V}; the drafter and target vocabularies must match")
        if norm_weight.shape != (H,):
            raise ValueError(f"norm_weight must be [{H}], got {tuple(norm_weight.shape)}")
        device = head_weight.device
        write = weights.write[-1].float()  # [H, M]
        proj = torch.cat([weights.gate_pred, weights.value], dim=0).float()  # [2M, C]
        g = norm_weight.float()  # [H]
        pred_proj = torch.empty(V, 2 * M, dtype=dtype, device=device)
        head_write = torch.empty(V, M, dtype=dtype, device=device)
        for start in range(0, V, _CHUNK_ROWS):
            stop = min(start + _CHUNK_ROWS, V)
            pred_proj[start:stop] = weights.codebook[start:stop].float() @ proj.t()
            head_write[start:stop] = (head_weight[start:stop].float() * g) @ write
        gram = (write.t() @ write).to(dtype)  # [M, M]
        return cls(pred_proj=pred_proj, head_write=head_write, gram=gram)


@contextlib.contextmanager
def _no_tf32():
    """True fp32 matmuls on CUDA while the tables are scored (restored afterwards)."""
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old


def _tail_score_tables_fast(
    inputs: LastWriteInputs,
    cand_ids: torch.Tensor,  # [R, K, k]
    weights: TailWeights,
    tables: TailTables,
    dtype: torch.dtype,
) -> torch.Tensor:
    """S by the tables: per pair only M-wide products.  -> [R, K, k, k]

    <head[v], norm(x')> = <head[v] * g, x'> / rms(x'), and with x' = x + r W_L m:
        <head[v] * g, x'> = <head[v] * g, x> + r <HW[v], m>
        rms(x')^2         = (||x||^2 + 2 r <W_L^T x, m> + r^2 m^T Gram m) / H + eps
    The H-wide terms (<head[v] * g, x>, W_L^T x, ||x||^2) are per row or per candidate.
    """
    bridge = weights.bridge
    R, B, H = inputs.pre_write_state.shape
    K, k = B - 1, cand_ids.shape[2]
    M = tables.message_dim
    scale = math.sqrt(bridge.code_dim)
    ids = cand_ids.long()
    x = inputs.pre_write_state[:, 1:].to(dtype)  # [R, K, H]
    r = inputs.rms[:, 1:].to(dtype)  # [R, K]
    recv = inputs.codes[:, 1:].to(dtype) @ bridge.gate_recv.to(dtype).t() \
        + bridge.gate_bias.to(dtype)  # [R, K, M]
    pred_ids = predecessor_candidates(ids, inputs.anchor_ids)  # [R, K, k]
    pe = tables.pred_proj[pred_ids].to(dtype)  # [R, K, k, 2M]
    m = torch.sigmoid(recv[:, :, None, :] + scale * pe[..., :M]) \
        * (scale * pe[..., M:])  # [R, K, k(u), M]

    # <head[v] * g, x> = <head[v], g * x>: the candidates' head rows gathered a few at a
    # time (exact_scores_ref), never a [R, K, k, H] copy (35 MB in float64 at 32
    # requests, fresh pages on every call on CPU).
    xg = x * weights.norm_weight.to(dtype)  # [R, K, H]
    hx = exact_scores_ref(xg.reshape(R * K, H), weights.head_weight, ids.reshape(R * K, k),
                          dtype).view(R, K, k)  # [R, K, k(v)]
    hw = tables.head_write[ids].to(dtype)  # [R, K, k(v), M]
    numer = hx[:, :, None, :] + r[:, :, None, None] * torch.einsum(
        "rtim,rtjm->rtij", m, hw)  # [R, K, k(u), k(v)]

    wtx = x @ bridge.write[-1].to(dtype)  # [R, K, M]  W_L^T x
    xx = x.pow(2).sum(dim=-1)  # [R, K]
    cross = (m * wtx[:, :, None, :]).sum(dim=-1)  # [R, K, k(u)]
    quad = ((m @ tables.gram.to(dtype)) * m).sum(dim=-1)  # [R, K, k(u)]
    mean_sq = (xx[:, :, None] + 2 * r[:, :, None] * cross
               + r[:, :, None].pow(2) * quad) / H  # [R, K, k(u)]
    return numer * torch.rsqrt(mean_sq + weights.norm_eps)[..., None]


def tail_score_tables(
    inputs: LastWriteInputs,  # the last layer's state [R, B, ...] and anchors [R]
    cand_ids: torch.Tensor,  # [R, K, k]  candidates of rows 1..K, by exact score
    weights: TailWeights,
    tables: TailTables | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """S[r, t-1, i, j] = < head[v_j], norm(x'_t(u_i)) >  -> [R, K, k, k] in `dtype`.

    u_i = cand_ids[r, t-2, i] (the anchor for t = 1), v_j = cand_ids[r, t-1, j].
    With `tables` the M-wide factorisation runs, else the direct formula. Use float64 when
    any row samples (the sampled chain's probabilities come from this table).
    """
    if dtype not in (torch.float32, torch.float64):
        raise ValueError(f"tail tables are scored in float32 or float64, got {dtype}")
    x_last = inputs.pre_write_state
    if cand_ids.ndim != 3 or x_last.ndim != 3 or cand_ids.shape[:2] != (
            x_last.shape[0], x_last.shape[1] - 1):
        raise ValueError(f"cand_ids must be [num_reqs, block_size - 1, head_topk] for "
                         f"pre_write_state {tuple(x_last.shape)}, got "
                         f"{tuple(cand_ids.shape)}")
    check_tail_inputs(inputs, cand_ids, weights)
    ctx = _no_tf32() if x_last.is_cuda else contextlib.nullcontext()
    with ctx:
        if tables is None:
            return tail_score_tables_ref(inputs, cand_ids, weights, dtype)
        if tables.head_write.shape[0] != weights.head_weight.shape[0] \
                or tables.message_dim != weights.bridge.message_dim:
            raise ValueError("TailTables do not fit these weights; rebuild them with "
                             "TailTables.build(weights.bridge, weights.head_weight, "
                             "weights.norm_weight)")
        return _tail_score_tables_fast(inputs, cand_ids, weights, tables, dtype)


def _softmax(logits: torch.Tensor) -> torch.Tensor:
    """softmax over the last dim, written out. On CPU, torch's `softmax` and `max(dim)`
    went parallel even on an [8, 16] tensor and took ~7-16 ms per call with 2 threads on a
    loaded 2-core machine (0.004 ms with 1 thread): the sampled walk took 0.4 s instead of
    7 ms. `amax` and element-wise ops stay serial at this size."""
    z = logits - logits.amax(dim=-1, keepdim=True)
    e = z.exp()
    return e / e.sum(dim=-1, keepdim=True)


def filter_candidate_probs(
    logits: torch.Tensor,  # [R, k]  S / T (already divided by the temperature)
    top_k: torch.Tensor | None,  # [R] int; <= 0 or >= k: off
    top_p: torch.Tensor | None,  # [R] float in (0, 1]; 1: off
    min_p: torch.Tensor | None,  # [R] float in [0, 1]; 0: off
) -> torch.Tensor:
    """vLLM's sampler filters, applied to a k-way distribution.  -> probs [R, k]

    Order and tie rules as vLLM 0.32.0's `Sampler.sample` (temperature, then the min-p
    processor, then top-k, then top-p, then softmax):
    - min_p: drop j with p_j < min_p * max p (p = softmax of the scaled logits).
    - top_k: keep the entries >= the k-th largest logit (ties at the boundary stay).
    - top_p: over what is left, sort ascending, drop entries whose ascending cumulative
      probability is <= 1 - top_p; the largest entry always stays.
    """
    logits = logits.clone()
    R, k = logits.shape
    neg_inf = torch.tensor(float("-inf"), dtype=logits.dtype, device=logits.device)
    if min_p is not None:
        probs = _softmax(logits)
        thresh = probs.amax(dim=-1, keepdim=True) * min_p.to(logits.dtype)[:, None]
        logits = torch.where(probs < thresh, neg_inf, logits)
    if top_k is not None:
        kk = top_k.long().clamp(min=0)
        kk = torch.where((kk <= 0) | (kk >= k), torch.full_like(kk, k), kk)  # [R]
        sorted_desc = logits.sort(dim=-1, descending=True).values  # [R, k]
        kth = sorted_desc.gather(1, (kk - 1)[:, None])  # [R, 1]
        logits = torch.where(logits < kth, neg_inf, logits)
    if top_p is not None:
        sorted_asc, idx = logits.sort(dim=-1, descending=False, stable=True)  # [R, k]
        cum = _softmax(sorted_asc).cumsum(dim=-1)  # [R, k]
        drop = cum <= (1 - top_p.to(logits.dtype))[:, None]
        drop[:, -1] = False
        sorted_asc = torch.where(drop, neg_inf, sorted_asc)
        logits = torch.empty_like(logits).scatter_(1, idx, sorted_asc)
    return _softmax(logits)


def draw_tail_uniforms(
    temperature: torch.Tensor,  # [R]  0 (below 1e-5) = greedy
    num_draws: int,
    generators: list[torch.Generator | None],
    device: torch.device,
) -> torch.Tensor | None:
    """The walk's uniforms: [R, num_draws] float64, or None when no request samples.

    A request with its own generator draws its `num_draws` uniforms from it (so the same
    seed gives the same chain whatever the batch); the others share one draw from the
    global RNG. Which requests sample is read from `temperature` where that costs
    nothing, on the CPU: greedy requests then draw nothing (and None comes back when no
    request samples). A CUDA `temperature` is not read (that would wait for the device):
    every request draws, greedy ones included, and their uniforms go unused; the global
    RNG fills all R rows in one draw and seeded rows are then drawn again from their
    generators. vLLM gives generators only to sampled requests
    (`SamplingType.RANDOM_SEED`), so a seeded stream advances alike on both; what the
    global RNG gives whom differs, which no seeded request sees.
    """
    R = temperature.shape[0]
    if temperature.is_cuda:
        u = torch.rand(R, num_draws, dtype=torch.float64, device=device)
        for i, gen in enumerate(generators):
            if gen is not None:
                u[i] = torch.rand(num_draws, dtype=torch.float64, device=device, generator=gen)
        return u
    sampled = (temperature >= SAMPLING_EPS).tolist()
    rows = [i for i in range(R) if sampled[i]]
    if not rows:
        return None
    u = torch.zeros(R, num_draws, dtype=torch.float64, device=device)
    shared = [i for i in rows if generators[i] is None]
    if shared:
        u[shared] = torch.rand(len(shared), num_draws, dtype=torch.float64, device=device)
    for i in rows:
        if generators[i] is not None:
            u[i] = torch.rand(num_draws, dtype=torch.float64, device=device,
                              generator=generators[i])
    return u


# Requests up to which the reference walk filters every (row, predecessor) distribution
# at once (`serial_walk_ref`). Measured with `python bench/bench_tail.py --dtype fp32
# --hidden 576 --code 256 --message 128 --vocab 20500 --reqs R --no-docs` (one thread,
# this project's 2-core CPU, the sampled walk at T 1, top-p 0.9): 0.8 / 1.3 / 1.8 ms at
# R = 1 / 4 / 8 against 2.1 / 2.3 / 2.3 ms filtering the chosen rows step by step (the
# same command at 6da3e1e). Above 8, filtering k times the rows costs more than the
# rounds it saves (a scratch timer at R = 32), so those steps filter their chosen rows.
WALK_BATCHED_MAX_REQS = 8


def serial_walk_ref(
    S: torch.Tensor,  # [R, K, k, k]
    cand_ids: torch.Tensor,  # [R, K, k]
    temperature: torch.Tensor,  # [R]
    top_k: torch.Tensor | None,  # [R] int
    top_p: torch.Tensor | None,  # [R] float
    min_p: torch.Tensor | None,  # [R] float
    uniforms: torch.Tensor | None,  # [R, >= K] float64; None: no request samples
) -> SparseProposal:
    """The walk in PyTorch, row by row (the CPU path; `serial_tail` states the rules):
    the oracle of `serial_tail_kernel` (tail_walk.py).

    Up to WALK_BATCHED_MAX_REQS requests, every row's distribution for every predecessor
    (`filter_candidate_probs` of S[r, t, i, :] / T, [R, K, k, k]) is computed in one
    batched call before the walk, and the serial part only reads the chosen
    predecessor's row: the same row-wise arithmetic as filtering the chosen row at each
    step, without 15 serial rounds of the filter's ~25 small ops. Above it, filtering k
    times the rows costs more than the rounds, and each step filters its chosen rows."""
    R, K, k, _ = S.shape
    device = S.device
    greedy = (temperature < SAMPLING_EPS).to(device)  # [R]
    any_sampled = bool(greedy.logical_not().any())
    assert uniforms is not None or not any_sampled, "sampled requests need uniforms"
    work = S.to(torch.float64) if any_sampled else S  # [R, K, k, k]
    arange_r = torch.arange(R, device=device)
    batched = R <= WALK_BATCHED_MAX_REQS
    if batched:
        best = work.argmax(dim=-1)  # [R, K, k]  greedy choice after each predecessor
    if any_sampled:
        temp = torch.where(greedy, torch.ones_like(temperature, dtype=torch.float64),
                           temperature.to(torch.float64))  # [R]
        u = uniforms[:, :K]  # [R, K]
    if any_sampled and not batched:
        q_out = torch.empty(R, K, k, dtype=torch.float64, device=device)  # [R, K, k]
    if any_sampled and batched:
        per_row = K * k  # filter settings per request -> per (t, predecessor) row

        def rows(v: torch.Tensor | None) -> torch.Tensor | None:
            return None if v is None else v.repeat_interleave(per_row)  # [R * K * k]

        q_all = filter_candidate_probs((work / temp[:, None, None, None]).reshape(-1, k),
                                       rows(top_k), rows(top_p), rows(min_p)
                                       ).view(R, K, k, k)  # [R, K, k(u), k(v)]
        cdf_all = q_all.cumsum(dim=-1)  # [R, K, k, k]

    prev = torch.zeros(R, dtype=torch.long, device=device)  # j_{t-1}; 0 stands for the anchor
    chosen = torch.empty(R, K, dtype=torch.long, device=device)
    for t in range(K):
        row = None if batched else work[arange_r, t, prev]  # [R, k]  S_t(j_{t-1}, .)
        j = best[arange_r, t, prev] if batched else row.argmax(dim=-1)  # [R]
        if any_sampled:
            if batched:
                cdf = cdf_all[arange_r, t, prev]  # [R, k]
            else:
                q = filter_candidate_probs(row / temp[:, None], top_k, top_p, min_p)  # [R, k]
                q_out[:, t] = q
                cdf = q.cumsum(dim=-1)  # [R, k]
            # Inverse CDF: j = #{cdf_j <= u * total}; an entry of probability 0 has an
            # empty interval and is never chosen, and j <= k - 1 because u < 1.
            j_sampled = (cdf <= (u[:, t] * cdf[:, -1])[:, None]).sum(dim=-1).clamp(max=k - 1)
            j = torch.where(greedy, j, j_sampled)
        chosen[:, t] = j
        prev = j
    one_hot = torch.nn.functional.one_hot(chosen, k).to(torch.float32)  # [R, K, k]
    if any_sampled and batched:
        # The distribution each draft was drawn from: its row after the chosen predecessor.
        prevs = torch.cat([torch.zeros(R, 1, dtype=torch.long, device=device),
                           chosen[:, :-1]], dim=1)  # [R, K]
        q_out = q_all.gather(2, prevs[:, :, None, None].expand(R, K, 1, k)).squeeze(2)
    probs_out = (torch.where(greedy[:, None, None], one_hot, q_out.to(torch.float32))
                 if any_sampled else one_hot)  # [R, K, k]
    ids = cand_ids.long()
    draft = ids.gather(2, chosen[:, :, None]).squeeze(2)  # [R, K]
    return SparseProposal(draft_token_ids=draft, cand_ids=ids, cand_probs=probs_out)


def _use_triton(S: torch.Tensor, use_triton: bool | None) -> bool:
    """CUDA -> Triton, CPU -> reference; `use_triton=True` forces Triton (tests run it
    on CPU tensors under TRITON_INTERPRET=1)."""
    if use_triton is None:
        return S.is_cuda
    if use_triton and not S.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            "serial_tail: use_triton=True on CPU tensors needs TRITON_INTERPRET=1 set "
            "before triton is imported; move the tensors to CUDA or pass use_triton=None")
    return use_triton


def serial_tail(
    S: torch.Tensor,  # [R, K, k, k]  score tables (float64 when any row samples)
    cand_ids: torch.Tensor,  # [R, K, k]
    temperature: torch.Tensor,  # [R]  0 (below 1e-5) = greedy
    top_k: torch.Tensor | None = None,  # [R] int
    top_p: torch.Tensor | None = None,  # [R] float
    min_p: torch.Tensor | None = None,  # [R] float
    generators: list[torch.Generator | None] | None = None,  # R entries; None = global RNG
    draws_per_request: int | None = None,
    uniforms: torch.Tensor | None = None,  # [R, >= K] float64; None: drawn here
    use_triton: bool | None = None,
) -> SparseProposal:
    """Walk the tables row by row.

    draws_per_request: how many uniforms a request with its own generator draws from it
    (>= K; default K). The proposer passes the block's full 15 when it drafts only the
    first K rows, so that a seeded stream advances by the same amount whatever K was
    (the seed then reproduces its text whatever the batch did to the row count).
    uniforms: the walk's uniforms, drawn by the caller (row t of request r uses
    uniforms[r, t]); by default `draw_tail_uniforms` draws them from `generators`.

    Greedy requests: j_1 = argmax_j S[0, 0, j], j_t = argmax_j S[t-1, j_{t-1}, j].
    Sampled requests: q_t(. | i) = filtered softmax of S[t-1, i, :] / T, j_1 ~ q_1(. | 0),
    j_t ~ q_t(. | j_{t-1}) by inverse CDF of one uniform per row; the q each token was drawn
    from is retained. Row 1's table rows are all the anchor's, so i = 0 stands for it.

    use_triton: None runs `serial_tail_kernel` (tail_walk.py, one program per request) on
    CUDA tensors and `serial_walk_ref` on CPU tensors; True forces the kernel (on CPU
    tensors under TRITON_INTERPRET=1), False the reference. On CUDA nothing here waits
    for the device: the settings' values are checked only when they are on the CPU.
    """
    if S.ndim != 4 or S.shape[2] != S.shape[3] or S.shape[:3] != cand_ids.shape:
        raise ValueError(f"S must be [num_reqs, K, k, k] matching cand_ids [num_reqs, K, k]; "
                         f"got S {tuple(S.shape)}, cand_ids {tuple(cand_ids.shape)}")
    R, K, k, _ = S.shape
    if temperature.shape != (R,):
        raise ValueError(f"temperature must be [{R}], got {tuple(temperature.shape)}")
    for name, t in (("top_k", top_k), ("top_p", top_p), ("min_p", min_p)):
        if t is not None and t.shape != (R,):
            raise ValueError(f"{name} must be [{R}] or None, got {tuple(t.shape)}")
    if generators is None:
        generators = [None] * R
    if len(generators) != R:
        raise ValueError(f"generators must have one entry per request ({R}), got "
                         f"{len(generators)}; use None for the global RNG")
    if not temperature.is_cuda and bool((temperature < 0).any()):
        raise ValueError(f"temperature must be >= 0, got {temperature.tolist()}")
    if top_p is not None and not top_p.is_cuda and bool(((top_p <= 0) | (top_p > 1)).any()):
        raise ValueError(f"top_p must be in (0, 1], got {top_p.tolist()}")
    if min_p is not None and not min_p.is_cuda and bool(((min_p < 0) | (min_p > 1)).any()):
        raise ValueError(f"min_p must be in [0, 1], got {min_p.tolist()}")
    if uniforms is None:
        n_draws = K if draws_per_request is None else max(K, int(draws_per_request))
        uniforms = draw_tail_uniforms(temperature, n_draws, generators, S.device)
    elif uniforms.ndim != 2 or uniforms.shape[0] != R or uniforms.shape[1] < K \
            or uniforms.dtype != torch.float64:
        raise ValueError(f"uniforms must be float64 [{R}, >= {K}], got {uniforms.dtype} "
                         f"{tuple(uniforms.shape)}")

    if not _use_triton(S, use_triton):
        return serial_walk_ref(S, cand_ids, temperature, top_k, top_p, min_p, uniforms)
    if uniforms is None:  # nothing samples: the kernel reads no uniform
        uniforms = torch.zeros(R, K, dtype=torch.float64, device=S.device)
    settings = [None if t is None else t.contiguous() for t in (top_k, top_p, min_p)]
    draft, probs = serial_tail_fwd(S.contiguous(), cand_ids.contiguous(),
                                   temperature.contiguous(), *settings,
                                   uniforms[:, :K].contiguous())
    return SparseProposal(draft_token_ids=draft, cand_ids=cand_ids.long(), cand_probs=probs)


def continuous_score_tables(
    final_hidden: torch.Tensor,  # [R, K, H]  final-normed proposal rows
    cand_ids: torch.Tensor,  # [R, K, k]
    head_weight: torch.Tensor,  # [V, H]
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """The no-tail ablation's tables: S[r, t, u, v] = <head[v], h_t> for every u.

    Each row's scores are its continuous logits restricted to its candidates, the same
    whatever the predecessor, so `serial_tail` on them drafts the per-row argmax (greedy)
    or draws each row independently from its filtered 16-way softmax (sampled), with
    the q it drew from retained exactly as for the tail.  -> [R, K, k, k]
    """
    R, K, k = cand_ids.shape
    w = head_weight[cand_ids.reshape(-1)].view(R, K, k, -1).to(dtype)  # [R, K, k, H]
    scores = torch.einsum("rtkh,rth->rtk", w, final_hidden.to(dtype))  # [R, K, k]
    return scores[:, :, None, :].expand(R, K, k, k).contiguous()


def refine_last_write(
    inputs: LastWriteInputs,
    cand_ids: torch.Tensor,  # [R, K, k]
    weights: TailWeights,
    temperature: torch.Tensor,  # [R]
    top_k: torch.Tensor | None = None,  # [R]
    top_p: torch.Tensor | None = None,  # [R]
    min_p: torch.Tensor | None = None,  # [R]
    generators: list[torch.Generator | None] | None = None,
    tables: TailTables | None = None,
) -> SparseProposal:
    """Tables (float64 if any request samples, else float32), then the serial walk."""
    any_sampled = bool((temperature >= SAMPLING_EPS).any())
    dtype = torch.float64 if any_sampled else torch.float32
    S = tail_score_tables(inputs, cand_ids, weights, tables, dtype)
    return serial_tail(S, cand_ids, temperature, top_k, top_p, min_p, generators)
