"""Synthetic verification problems (random target p, sparse q, drafts drawn from q)
shared by the tests and bench/bench_verify.py. Not used when serving."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SparseProblem:
    """One flattened verification batch, in vLLM's layout."""

    num_draft_tokens: list[int]  # [num_reqs]
    cu_num_draft_tokens: torch.Tensor  # [num_reqs] int32, inclusive cumsum
    draft_token_ids: torch.Tensor  # [num_tokens] int64
    draft_cand_ids: torch.Tensor  # [num_tokens, topk] int64, -1 = padding
    draft_cand_probs: torch.Tensor  # [num_tokens, topk] float32
    target_logits: torch.Tensor  # [num_tokens, V] float32
    bonus_token_ids: torch.Tensor  # [num_reqs, 1] int64

    @property
    def target_probs(self) -> torch.Tensor:  # [num_tokens, V]
        return self.target_logits.softmax(dim=-1, dtype=torch.float32)


def sample_from_sparse(
    cand_ids: torch.Tensor,  # [N, topk]
    cand_probs: torch.Tensor,  # [N, topk]
    generator: torch.Generator,
) -> torch.Tensor:
    """One draw per row from the sparse q (inverse CDF): [N] int64."""
    cdf = cand_probs.double().cumsum(dim=1)  # [N, topk]
    u = torch.rand(cand_ids.shape[0], 1, dtype=torch.float64, generator=generator)
    slot = torch.searchsorted(cdf, u * cdf[:, -1:]).clamp_(max=cand_ids.shape[1] - 1)
    return cand_ids.gather(1, slot).squeeze(1)


def sparse_q_near(
    target_probs: torch.Tensor,  # [N, V]
    topk: int,
    generator: torch.Generator,
    num_top: int = 12,
    noise: float = 0.7,
    num_pad: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A sparse q resembling p: the `num_top` most likely ids of p, random other ids
    up to `topk - num_pad`, then `num_pad` padding slots (-1, prob 0); probabilities
    proportional to (p + 1e-3) * exp(noise * N(0, 1)) over the real ids."""
    n, vocab_size = target_probs.shape
    num_real = topk - num_pad
    assert num_top <= num_real <= vocab_size
    top = target_probs.topk(num_top, dim=1).indices  # [N, num_top]
    # Random distinct extra ids: random keys, the chosen ones pushed to the end.
    keys = torch.rand(n, vocab_size, generator=generator)
    keys.scatter_(1, top, 2.0)
    extra = keys.argsort(dim=1)[:, : num_real - num_top]
    ids = torch.cat([top, extra], dim=1)  # [N, num_real]
    weights = (target_probs.gather(1, ids) + 1e-3) * torch.exp(
        noise * torch.randn(ids.shape, generator=generator)
    )
    probs = (weights / weights.sum(dim=1, keepdim=True)).float()
    if num_pad:
        ids = torch.cat([ids, torch.full((n, num_pad), -1, dtype=ids.dtype)], dim=1)
        probs = torch.cat([probs, torch.zeros(n, num_pad)], dim=1)
    return ids, probs


def random_problem(
    num_draft_tokens: list[int],
    vocab_size: int,
    generator: torch.Generator,
    topk: int = 16,
    logit_scale: float = 2.0,
    num_pad: int = 0,
    top_k_mask: int | None = None,
) -> SparseProblem:
    """Random target logits (scale `logit_scale`; entries outside each row's
    `top_k_mask` largest set to -inf), a q near p, drafts drawn from q."""
    num_tokens = sum(num_draft_tokens)
    logits = torch.randn(num_tokens, vocab_size, generator=generator) * logit_scale
    if top_k_mask is not None:
        kth = logits.topk(top_k_mask, dim=1).values[:, -1:]
        logits.masked_fill_(logits < kth, float("-inf"))
    ids, probs = sparse_q_near(
        logits.softmax(dim=-1), topk, generator, num_top=min(12, topk - num_pad),
        num_pad=num_pad,
    )
    drafts = sample_from_sparse(ids, probs, generator)
    num_reqs = len(num_draft_tokens)
    return SparseProblem(
        num_draft_tokens=list(num_draft_tokens),
        cu_num_draft_tokens=torch.tensor(num_draft_tokens).cumsum(0).to(torch.int32),
        draft_token_ids=drafts,
        draft_cand_ids=ids,
        draft_cand_probs=probs,
        target_logits=logits,
        bonus_token_ids=torch.randint(
            0, vocab_size, (num_reqs, 1), generator=generator
        ),
    )


def language_model_logits(
    rows: int, vocab: int, g: torch.Generator, temperature: float = 0.7
) -> torch.Tensor:  # [rows, vocab] float32
    """Logits shaped like a language model's after temperature: Zipf-like (the id of
    rank r at -1.1 ln r, with noise, ranks shuffled over the ids), a quarter of the rows
    peaked on one id. At top-p 0.95 the cut of most rows falls in their 256 largest ids,
    as on SmolLM2's own logits (docs/verify.md, "Top-p on draft rows")."""
    ranks = torch.arange(1, vocab + 1, dtype=torch.float32)
    x = -1.1 * ranks.log().expand(rows, vocab) + 0.5 * torch.randn(rows, vocab, generator=g)
    x = x.gather(1, torch.rand(rows, vocab, generator=g).argsort(dim=1))
    x[: rows // 4, 0] += 12.0
    return x / temperature
