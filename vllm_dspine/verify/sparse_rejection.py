"""Triton kernels of exact speculative sampling with a sparse draft q (docs/design.md 1.6).

Three kernels, one program per request, run in order:
  1. `sparse_rejection_greedy_sample_kernel`: greedy requests (draft == target argmax).
  2. `sparse_rejection_random_sample_kernel`: random requests; accepts v while
     `p(v) / q(v) >= u` (q read from the 16 candidates, never densified), writes the
     accepted prefix and the bonus, and records the first rejected position.
  3. `sparse_recovered_tokens_kernel`: for a random request with a rejection, the
     token `argmax_v max(p - q, 0)(v) * inv_exp[req, v]` over the vocabulary. q is
     non-zero only at the candidate ids, so the sweep scores every id by
     `p * inv_exp`, leaves the candidates out, and scores the candidates apart with
     their residual; the two maxima are merged with vLLM's tie rule (lowest id).
vLLM scores every draft row over the vocabulary; only the rejected row is needed
(the exponentials are per request), so this scores one row per rejected request.

The plain PyTorch twin is `sparse_rejection_ref.py` (the CPU path and the oracle).
Shapes: B requests, T = num_tokens draft rows, V vocabulary, K = topk candidates.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# vLLM's PLACEHOLDER_TOKEN_ID (vllm/v1/sample/rejection_sampler.py), the value after a
# row's last token. Stated, not imported, and the reference imported where the CPU path
# needs it: this module then loads without vLLM (bench/gpu_check.py runs the kernels on
# a machine without it; tests/test_gpu_check.py checks the value is vLLM's).
PLACEHOLDER_TOKEN_ID = -1


@triton.jit(do_not_specialize=["max_spec_len"])
def sparse_rejection_greedy_sample_kernel(
    output_token_ids_ptr,  # [B, max_spec_len + 1] int32
    cu_num_draft_tokens_ptr,  # [B] int32
    draft_token_ids_ptr,  # [T]
    target_argmax_ptr,  # [T]
    bonus_token_ids_ptr,  # [B]
    is_greedy_ptr,  # [B] bool, or None when every request is greedy
    max_spec_len,
    HAS_IS_GREEDY: tl.constexpr,
):
    req_idx = tl.program_id(0)
    if HAS_IS_GREEDY:
        if not tl.load(is_greedy_ptr + req_idx):
            return
    start_idx = 0
    if req_idx > 0:
        start_idx = tl.load(cu_num_draft_tokens_ptr + req_idx - 1).to(tl.int32)
    end_idx = tl.load(cu_num_draft_tokens_ptr + req_idx).to(tl.int32)
    num_draft_tokens = end_idx - start_idx
    out_row_ptr = output_token_ids_ptr + req_idx * (max_spec_len + 1)

    rejected = False
    for pos in range(num_draft_tokens):
        if not rejected:
            draft_id = tl.load(draft_token_ids_ptr + start_idx + pos).to(tl.int64)
            argmax_id = tl.load(target_argmax_ptr + start_idx + pos).to(tl.int64)
            tl.store(out_row_ptr + pos, argmax_id.to(tl.int32))
            rejected = draft_id != argmax_id
    if not rejected:
        bonus_id = tl.load(bonus_token_ids_ptr + req_idx)
        tl.store(out_row_ptr + num_draft_tokens, bonus_id.to(tl.int32))


@triton.jit(do_not_specialize=["max_spec_len"])
def sparse_rejection_random_sample_kernel(
    output_token_ids_ptr,  # [B, max_spec_len + 1] int32
    rejected_pos_ptr,  # [B] int32 out: first rejected position, -1 if none
    cu_num_draft_tokens_ptr,  # [B] int32
    draft_token_ids_ptr,  # [T]
    draft_cand_ids_ptr,  # [T, K] int64
    draft_cand_probs_ptr,  # [T, K] float32
    target_probs_ptr,  # [T, V] float32
    bonus_token_ids_ptr,  # [B]
    uniform_probs_ptr,  # [T] float64
    is_greedy_ptr,  # [B] bool, or None when every request is random
    max_spec_len,
    vocab_size,
    TOPK: tl.constexpr,
    TOPK_BLOCK: tl.constexpr,
    HAS_IS_GREEDY: tl.constexpr,
):
    req_idx = tl.program_id(0)
    if HAS_IS_GREEDY:
        if tl.load(is_greedy_ptr + req_idx):
            tl.store(rejected_pos_ptr + req_idx, -1)
            return
    start_idx = 0
    if req_idx > 0:
        start_idx = tl.load(cu_num_draft_tokens_ptr + req_idx - 1).to(tl.int32)
    end_idx = tl.load(cu_num_draft_tokens_ptr + req_idx).to(tl.int32)
    num_draft_tokens = end_idx - start_idx
    out_row_ptr = output_token_ids_ptr + req_idx * (max_spec_len + 1)
    cand_offs = tl.arange(0, TOPK_BLOCK)
    cand_mask = cand_offs < TOPK

    rejected = False
    rejected_pos = -1
    for pos in range(num_draft_tokens):
        if not rejected:
            token_idx = (start_idx + pos).to(tl.int64)
            draft_id = tl.load(draft_token_ids_ptr + token_idx).to(tl.int64)
            uniform = tl.load(uniform_probs_ptr + token_idx)
            cand_ids = tl.load(
                draft_cand_ids_ptr + token_idx * TOPK + cand_offs,
                mask=cand_mask, other=-1,
            ).to(tl.int64)
            cand_probs = tl.load(
                draft_cand_probs_ptr + token_idx * TOPK + cand_offs,
                mask=cand_mask, other=0.0,
            )
            # Candidate ids are distinct: at most one term is non-zero.
            draft_prob = tl.sum(tl.where(cand_ids == draft_id, cand_probs, 0.0))
            in_vocab = (draft_id >= 0) & (draft_id < vocab_size)
            target_prob = tl.load(
                target_probs_ptr + token_idx * vocab_size + draft_id,
                mask=in_vocab, other=0.0,
            )
            # q == 0 (absent, padding) is never accepted; guard the division.
            ratio = target_prob / tl.where(draft_prob > 0, draft_prob, 1.0)
            accepted = in_vocab & (draft_prob > 0) & (ratio >= uniform)
            if accepted:
                tl.store(out_row_ptr + pos, draft_id.to(tl.int32))
            else:
                rejected = True
                rejected_pos = pos
    if not rejected:
        bonus_id = tl.load(bonus_token_ids_ptr + req_idx)
        tl.store(out_row_ptr + num_draft_tokens, bonus_id.to(tl.int32))
    tl.store(rejected_pos_ptr + req_idx, rejected_pos)


@triton.jit(do_not_specialize=["max_spec_len"])
def sparse_recovered_tokens_kernel(
    output_token_ids_ptr,  # [B, max_spec_len + 1] int32
    rejected_pos_ptr,  # [B] int32, -1: nothing to recover
    cu_num_draft_tokens_ptr,  # [B] int32
    draft_cand_ids_ptr,  # [T, K] int64
    draft_cand_probs_ptr,  # [T, K] float32
    target_probs_ptr,  # [T, V] float32
    inv_exp_ptr,  # [B, V] float32 or float64
    max_spec_len,
    vocab_size,
    TOPK: tl.constexpr,
    TOPK_BLOCK: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    USE_FP64: tl.constexpr,
):
    req_idx = tl.program_id(0)
    pos = tl.load(rejected_pos_ptr + req_idx)
    if pos < 0:
        return
    start_idx = 0
    if req_idx > 0:
        start_idx = tl.load(cu_num_draft_tokens_ptr + req_idx - 1).to(tl.int32)
    token_idx = (start_idx + pos).to(tl.int64)
    p_row_ptr = target_probs_ptr + token_idx * vocab_size
    e_row_ptr = inv_exp_ptr + req_idx.to(tl.int64) * vocab_size

    # The candidates, scored with their residual max(p - q, 0).
    cand_offs = tl.arange(0, TOPK_BLOCK)
    cand_ids = tl.load(
        draft_cand_ids_ptr + token_idx * TOPK + cand_offs,
        mask=cand_offs < TOPK, other=-1,
    ).to(tl.int64)
    cand_probs = tl.load(
        draft_cand_probs_ptr + token_idx * TOPK + cand_offs,
        mask=cand_offs < TOPK, other=0.0,
    )
    cand_real = (cand_ids >= 0) & (cand_ids < vocab_size)
    cand_p = tl.load(p_row_ptr + cand_ids, mask=cand_real, other=0.0)
    cand_e = tl.load(e_row_ptr + cand_ids, mask=cand_real, other=0.0)
    cand_score = tl.maximum(cand_p - cand_probs, 0.0) * cand_e
    cand_score = tl.where(cand_score == cand_score, cand_score, 0.0)  # NaN -> 0
    cand_score = tl.where(cand_real, cand_score, float("-inf"))
    cand_best = tl.max(cand_score, axis=0)
    cand_best_id = tl.min(
        tl.where(cand_real & (cand_score == cand_best), cand_ids, vocab_size), axis=0
    )

    # The sweep: every id scored by p * inv_exp. `rest_*` leaves the candidates out
    # (their dense score is the residual above); `full_*` is the fallback draw from p.
    if USE_FP64:
        rest_best = tl.full((), float("-inf"), tl.float64)
        full_best = tl.full((), float("-inf"), tl.float64)
    else:
        rest_best = tl.full((), float("-inf"), tl.float32)
        full_best = tl.full((), float("-inf"), tl.float32)
    rest_id = tl.zeros((), tl.int64)
    full_id = tl.zeros((), tl.int64)
    for v in range(0, vocab_size, BLOCK_SIZE):
        offs = v + tl.arange(0, BLOCK_SIZE)
        in_vocab = offs < vocab_size
        p = tl.load(p_row_ptr + offs, mask=in_vocab, other=0.0)
        e = tl.load(e_row_ptr + offs, mask=in_vocab, other=0.0)
        score = p * e
        score = tl.where(score == score, score, 0.0)  # NaN -> 0
        score = tl.where(in_vocab, score, float("-inf"))
        tile_best, tile_arg = tl.max(score, axis=0, return_indices=True)
        if tile_best > full_best:
            full_best = tile_best
            full_id = v + tile_arg.to(tl.int64)
        # [BLOCK_SIZE, TOPK_BLOCK] membership test of each id in the candidates.
        is_cand = tl.sum(
            ((offs[:, None] == cand_ids[None, :]) & cand_real[None, :]).to(tl.int32),
            axis=1,
        ) > 0
        score = tl.where(is_cand, float("-inf"), score)
        tile_best, tile_arg = tl.max(score, axis=0, return_indices=True)
        if tile_best > rest_best:
            rest_best = tile_best
            rest_id = v + tile_arg.to(tl.int64)

    # Merge: larger score wins, equal scores go to the lower id (vLLM's argmax).
    best = rest_best
    best_id = rest_id
    if (cand_best > rest_best) | ((cand_best == rest_best) & (cand_best_id < rest_id)):
        best = cand_best
        best_id = cand_best_id
    if not (best > 0):
        # The residual vanished everywhere: draw from p; p == 0 everywhere -> 0.
        best_id = full_id
        if not (full_best > 0):
            best_id = tl.zeros((), tl.int64)  # int64 as in both branches (compiled Triton)
    tl.store(
        output_token_ids_ptr + req_idx * (max_spec_len + 1) + pos,
        best_id.to(tl.int32),
    )


def _next_power_of_2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def sparse_rejection_sample_fwd(
    draft_token_ids: torch.Tensor,  # [T]
    num_draft_tokens: list[int],  # [B]
    max_spec_len: int,
    cu_num_draft_tokens: torch.Tensor,  # [B] int32
    draft_cand_ids: torch.Tensor | None,  # [T, K] int64
    draft_cand_probs: torch.Tensor | None,  # [T, K] float32
    target_probs: torch.Tensor | None,  # [T, V] float32
    bonus_token_ids: torch.Tensor,  # [B, 1]
    is_greedy: torch.Tensor | None,  # [B] bool
    target_argmax: torch.Tensor | None,  # [T]
    uniform_probs: torch.Tensor | None,  # [T] float64
    inv_exp: torch.Tensor | None,  # [B, V]
    block_size: int = 2048,
) -> torch.Tensor:
    """Launcher: allocates the output, launches the three kernels (grid: B)."""
    num_reqs = len(num_draft_tokens)
    device = draft_token_ids.device
    output = torch.full(
        (num_reqs, max_spec_len + 1), PLACEHOLDER_TOKEN_ID, dtype=torch.int32,
        device=device,
    )
    if num_reqs == 0:
        return output
    bonus = bonus_token_ids.reshape(num_reqs).contiguous()
    all_greedy = target_probs is None
    all_random = is_greedy is None and not all_greedy
    if not all_random:
        if target_argmax is None:
            target_argmax = target_probs.argmax(dim=-1)
        sparse_rejection_greedy_sample_kernel[(num_reqs,)](
            output, cu_num_draft_tokens, draft_token_ids, target_argmax, bonus,
            None if all_greedy else is_greedy, max_spec_len,
            HAS_IS_GREEDY=not all_greedy,
        )
    if all_greedy:
        return output

    topk = draft_cand_ids.shape[1]
    vocab_size = target_probs.shape[1]
    rejected_pos = torch.empty(num_reqs, dtype=torch.int32, device=device)
    sparse_rejection_random_sample_kernel[(num_reqs,)](
        output, rejected_pos, cu_num_draft_tokens, draft_token_ids,
        draft_cand_ids, draft_cand_probs, target_probs, bonus, uniform_probs,
        is_greedy, max_spec_len, vocab_size,
        TOPK=topk, TOPK_BLOCK=_next_power_of_2(topk), HAS_IS_GREEDY=not all_random,
    )
    sparse_recovered_tokens_kernel[(num_reqs,)](
        output, rejected_pos, cu_num_draft_tokens, draft_cand_ids, draft_cand_probs,
        target_probs, inv_exp, max_spec_len, vocab_size,
        TOPK=topk, TOPK_BLOCK=_next_power_of_2(topk),
        BLOCK_SIZE=min(block_size, _next_power_of_2(vocab_size)),
        USE_FP64=inv_exp.dtype == torch.float64,
    )
    return output


def _check_inputs(
    draft_token_ids, num_draft_tokens, max_spec_len, cu_num_draft_tokens,
    draft_cand_ids, draft_cand_probs, target_probs, bonus_token_ids, is_greedy,
    target_argmax, uniform_probs, inv_exp, recovered_uniforms=None,
) -> None:
    """ValueError naming the problem and the fix for bad input."""
    num_reqs = len(num_draft_tokens)
    num_tokens = sum(num_draft_tokens)
    if draft_token_ids.shape != (num_tokens,):
        raise ValueError(
            f"draft_token_ids has shape {tuple(draft_token_ids.shape)}, expected "
            f"({num_tokens},) = sum(num_draft_tokens); pass the flattened drafts."
        )
    if max(num_draft_tokens, default=0) > max_spec_len:
        raise ValueError(
            f"a request has {max(num_draft_tokens)} drafts > max_spec_len "
            f"{max_spec_len}; pass max_spec_len >= max(num_draft_tokens)."
        )
    if cu_num_draft_tokens.shape != (num_reqs,) or cu_num_draft_tokens.dtype not in (
        torch.int32, torch.int64,
    ):
        raise ValueError(
            f"cu_num_draft_tokens must be int32/int64 of shape ({num_reqs},) (vLLM's "
            f"inclusive cumsum), got {cu_num_draft_tokens.dtype} "
            f"{tuple(cu_num_draft_tokens.shape)}."
        )
    if bonus_token_ids.numel() != num_reqs:
        raise ValueError(
            f"bonus_token_ids has {bonus_token_ids.numel()} entries, expected one "
            f"per request ({num_reqs}); pass [num_reqs, 1]."
        )
    if target_probs is None:
        if target_argmax is None:
            raise ValueError(
                "target_probs is None (all-greedy batch) but target_argmax is None; "
                "pass the argmax of the processed target logits."
            )
        return
    if target_probs.ndim != 2 or target_probs.shape[0] != num_tokens:
        raise ValueError(
            f"target_probs has shape {tuple(target_probs.shape)}, expected "
            f"({num_tokens}, vocab_size)."
        )
    if target_probs.dtype != torch.float32:
        raise ValueError(
            f"target_probs is {target_probs.dtype}; pass float32 probabilities "
            "(softmax(..., dtype=torch.float32)) as vLLM does."
        )
    # With target_probs given, random rows may exist: q and the random draws are
    # required (checking is_greedy.all() would cost a device sync).
    vocab_size = target_probs.shape[1]
    for name, t in (("draft_cand_ids", draft_cand_ids),
                    ("draft_cand_probs", draft_cand_probs)):
        if t is None or t.ndim != 2 or t.shape[0] != num_tokens:
            raise ValueError(
                f"{name} must be [{num_tokens}, topk] when target_probs is given "
                f"(random requests), got {None if t is None else tuple(t.shape)}; "
                "for an all-greedy batch pass target_probs=None."
            )
    if draft_cand_ids.shape != draft_cand_probs.shape:
        raise ValueError(
            f"draft_cand_ids {tuple(draft_cand_ids.shape)} and draft_cand_probs "
            f"{tuple(draft_cand_probs.shape)} differ; pass one prob per id."
        )
    if draft_cand_ids.dtype != torch.int64 or draft_cand_probs.dtype != torch.float32:
        raise ValueError(
            f"draft_cand_ids must be int64 and draft_cand_probs float32, got "
            f"{draft_cand_ids.dtype} and {draft_cand_probs.dtype}."
        )
    if uniform_probs is None or uniform_probs.shape != (num_tokens,):
        raise ValueError(
            f"uniform_probs must be [{num_tokens}] float64 "
            "(generate_uniform_probs) for a batch with random requests."
        )
    if recovered_uniforms is not None:
        if inv_exp is not None:
            raise ValueError(
                "pass either inv_exp (the exponential race) or recovered_uniforms "
                "(inverse CDF) for the recovered tokens, not both."
            )
        if recovered_uniforms.shape != (num_reqs,) or \
                recovered_uniforms.dtype != torch.float64:
            raise ValueError(
                f"recovered_uniforms must be [{num_reqs}] float64 "
                f"(generate_recovered_uniforms), got {recovered_uniforms.dtype} "
                f"{tuple(recovered_uniforms.shape)}."
            )
        return
    if inv_exp is None or inv_exp.shape != (num_reqs, vocab_size):
        raise ValueError(
            f"inv_exp must be [{num_reqs}, {vocab_size}] (generate_inv_exp), or "
            f"recovered_uniforms given instead, for a batch with random requests, got "
            f"{None if inv_exp is None else tuple(inv_exp.shape)}."
        )


def drop_invalid_q(
    draft_cand_ids: torch.Tensor,  # [num_tokens, topk] int64
    draft_cand_probs: torch.Tensor,  # [num_tokens, topk] float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows whose q is not a distribution (a NaN, inf or negative entry, e.g. from a
    drafter whose weights overflow) become q = 0 (ids -1, probabilities 0): none of
    their drafts is accepted and the token is drawn from p, which is exact whatever the
    draft was. (Left as they are, NaN residuals would count as 0 and the row's 16
    candidates could never be emitted.) No host sync: a `where` over [T, topk]."""
    bad = ~(torch.isfinite(draft_cand_probs) & (draft_cand_probs >= 0)).all(dim=1)
    ids = torch.where(bad[:, None], -1, draft_cand_ids)
    probs = torch.where(bad[:, None], 0.0, draft_cand_probs)
    return ids, probs


def sparse_rejection_sample(
    draft_token_ids: torch.Tensor,  # [num_tokens] int
    num_draft_tokens: list[int],  # [num_reqs]
    max_spec_len: int,
    cu_num_draft_tokens: torch.Tensor,  # [num_reqs] int32, inclusive cumsum
    draft_cand_ids: torch.Tensor | None,  # [num_tokens, topk] int64, -1 = padding
    draft_cand_probs: torch.Tensor | None,  # [num_tokens, topk] float32
    target_probs: torch.Tensor | None,  # [num_tokens, V] float32 (None: all greedy)
    bonus_token_ids: torch.Tensor,  # [num_reqs, 1]
    is_greedy: torch.Tensor | None,  # [num_reqs] bool; None: all random
    target_argmax: torch.Tensor | None,  # [num_tokens]; None: from target_probs
    uniform_probs: torch.Tensor | None,  # [num_tokens] float64
    inv_exp: torch.Tensor | None,  # [num_reqs, V] float32/float64
    use_triton: bool | None = None,
    recovered_uniforms: torch.Tensor | None = None,  # [num_reqs] float64
) -> torch.Tensor:
    """Exact speculative sampling with a sparse q, in vLLM's layout:
    [num_reqs, max_spec_len + 1] int32, -1 after the correction/bonus token.

    See `sparse_rejection_sample_ref` for the semantics. Dispatch: CUDA tensors run
    the Triton kernels, CPU tensors the reference; `use_triton` forces either (tests
    force Triton on CPU under TRITON_INTERPRET=1). `recovered_uniforms` in place of
    `inv_exp` draws the recovered tokens by inverse CDF (the reference only; what the
    sampler runs on CPU, docs/verify.md).
    """
    _check_inputs(
        draft_token_ids, num_draft_tokens, max_spec_len, cu_num_draft_tokens,
        draft_cand_ids, draft_cand_probs, target_probs, bonus_token_ids, is_greedy,
        target_argmax, uniform_probs, inv_exp, recovered_uniforms,
    )
    if recovered_uniforms is not None and use_triton:
        raise ValueError(
            "the Triton kernels draw recovered tokens with inv_exp only; pass "
            "inv_exp (generate_inv_exp) or use_triton=False."
        )
    if target_probs is not None:  # random rows read q (greedy rows never do)
        draft_cand_ids, draft_cand_probs = drop_invalid_q(draft_cand_ids, draft_cand_probs)
    if use_triton is None:
        use_triton = draft_token_ids.is_cuda and recovered_uniforms is None
    args = (
        draft_token_ids, num_draft_tokens, max_spec_len, cu_num_draft_tokens,
        draft_cand_ids, draft_cand_probs, target_probs, bonus_token_ids, is_greedy,
        target_argmax, uniform_probs, inv_exp,
    )
    if not use_triton:
        from vllm_dspine.verify.sparse_rejection_ref import sparse_rejection_sample_ref

        return sparse_rejection_sample_ref(*args, recovered_uniforms=recovered_uniforms)
    contiguous = [t.contiguous() if isinstance(t, torch.Tensor) else t for t in args]
    return sparse_rejection_sample_fwd(*contiguous)
