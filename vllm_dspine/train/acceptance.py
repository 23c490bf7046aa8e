"""How many drafts a drafter would get accepted, measured offline on target text.

- `greedy_acceptance`: per-row argmax and DSpine's tail (16 candidates, 16 x 16
  refinement of the last write) against the target's greedy continuation.
- `sampled_acceptance`: expected accepted length under exact speculative sampling.

    S sequences, T sequence length, nb blocks per sequence, B block size, K = B - 1.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from vllm_dspine.config import DSpineConfig
from vllm_dspine.model.checkpoint import tail_weights
from vllm_dspine.model.drafter import block_forward


def _leading_matches(draft: torch.Tensor, truth: torch.Tensor) -> torch.Tensor:
    """Accepted length per block: leading positions where draft == truth.  [N, K] -> [N]"""
    return (draft == truth).long().cumprod(dim=1).sum(dim=1)


def _decode_walk(accepted: torch.Tensor) -> float:
    """Mean accepted length over the anchors greedy decoding visits.

    accepted[s, j]: accepted drafts with the anchor at first_anchor + j. Decoding starts
    at j = 0 and moves to j + accepted + 1 (the accepted drafts, then the target's token,
    which is the next anchor). E.g. row [2, 0, 0, 5, 1] visits j = 0, 3 -> mean 3.5.
    """
    S, nb = accepted.shape
    visited = []
    for s in range(S):
        j = 0
        while j < nb:
            a = int(accepted[s, j])
            visited.append(a)
            j += a + 1
    return sum(visited) / len(visited)


@torch.no_grad()
def greedy_acceptance(cfg: DSpineConfig, w: dict[str, torch.Tensor], embed_tokens, lm_head,
                      ids: torch.Tensor,  # [S, T]  the target's greedy sequences
                      features: torch.Tensor,  # [S, T, F*H]
                      first_anchor: int, tail: bool = True,
                      vocab: torch.Tensor | None = None,  # [V']  retrieval vocabulary
                      ) -> dict[str, float]:
    """Mean accepted drafts (of B - 1) over every anchor p in [first_anchor, T - B],
    and the mean cross-entropy of rows 1.. against the sequence (`eval_loss`).

    argmax: per-row argmax of the block logits. tail: DSpine's greedy (16 candidates
    per row, 16 x 16 refinement of the last write, `kernels/tail.py`).
    `*_decode`: the mean over the anchors decoding actually visits (first_anchor, then
    p + accepted + 1): after a rejection the next anchor sits where the text surprised
    the drafter, so this is lower than the mean over all anchors; it is what vLLM's
    spec-decode counters report (mean accepted tokens per draft).
    `vocab`: the drafter's retrieval vocabulary (`retrieval_vocab` of its config): argmax
    and candidates range over those head rows only, as vLLM serves it; `eval_loss` is
    then over that vocabulary too (rows whose target token lies outside it are left out of the loss, and
    `eval_outside` says what share of the rows that was).
    """
    S, T = ids.shape
    B = cfg.block_size
    anchors = torch.arange(first_anchor, T - B + 1).expand(S, -1).contiguous()  # [S, nb]
    nb = anchors.shape[1]
    truth = ids.gather(1, (anchors[..., None] + torch.arange(1, B)).view(S, -1)
                       ).view(S * nb, B - 1)  # [S*nb, K]
    stats: dict[str, float] = {"eval_blocks": S * nb}
    head = lm_head if vocab is None else lm_head[vocab]  # [V', H]
    to_full = (lambda i: i) if vocab is None else (lambda i: vocab[i])
    outs = [block_forward(cfg, w, embed_tokens, head, ids[s:s + 1], features[s:s + 1],
                          anchors[s:s + 1]) for s in range(S)]
    logits = torch.cat([o.logits for o in outs]).view(S * nb, B, -1)
    if vocab is None:
        target = truth
    else:
        remap = torch.full((lm_head.shape[0],), -100, dtype=torch.long)
        remap[vocab] = torch.arange(len(vocab))
        target = remap[truth]
        stats["eval_outside"] = (target == -100).float().mean().item()
    stats["eval_loss"] = F.cross_entropy(logits[:, 1:].reshape(-1, logits.shape[-1]),
                                         target.reshape(-1), ignore_index=-100).item()
    acc = _leading_matches(to_full(logits[:, 1:].argmax(-1)), truth)  # [S*nb]
    stats["acceptance_argmax"] = acc.float().mean().item()
    stats["acceptance_argmax_decode"] = _decode_walk(acc.view(S, nb))
    stats["row1_hit_argmax"] = (to_full(logits[:, 1].argmax(-1)) == truth[:, 0]
                                ).float().mean().item()
    if tail:
        from vllm_dspine.kernels.retrieval import retrieve_candidates
        from vllm_dspine.kernels.tail import LastWriteInputs, TailTables, refine_last_write

        weights = tail_weights(cfg, w, lm_head)
        final = torch.cat([o.final_hidden for o in outs]).view(S * nb, B, -1)
        cand = to_full(retrieve_candidates(final[:, 1:].reshape(-1, final.shape[-1]), head,
                                           cfg.head_topk, min(cfg.coarse_topk, head.shape[0]),
                                           mode="bf16")).view(S * nb, B - 1, cfg.head_topk)
        prop = refine_last_write(
            LastWriteInputs(torch.cat([o.pre_write_state for o in outs]).view(S * nb, B, -1),
                            torch.cat([o.last_codes for o in outs]).view(S * nb, B, -1),
                            torch.cat([o.last_rms for o in outs]).view(S * nb, B),
                            ids.gather(1, anchors).reshape(-1)),
            cand, weights, temperature=torch.zeros(S * nb),
            tables=TailTables.build(weights.bridge, lm_head, weights.norm_weight))
        acc = _leading_matches(prop.draft_token_ids, truth)  # [S*nb]
        stats["acceptance_tail"] = acc.float().mean().item()
        # per position: share of blocks whose first t drafts are all accepted
        stats["tail_accept_by_position"] = [
            (acc >= t).float().mean().item() for t in range(1, B)]
        stats["acceptance_tail_decode"] = _decode_walk(acc.view(S, nb))
    return stats


@torch.no_grad()
def sampled_acceptance(cfg: DSpineConfig, w: dict[str, torch.Tensor], embed_tokens, lm_head,
                       model, ids: torch.Tensor,  # [S, T]
                       features: torch.Tensor,  # [S, T, F*H]
                       anchor_positions: list[int], temperature: float,
                       gen: torch.Generator) -> float:
    """Expected accepted drafts per block under exact speculative sampling.

    For each anchor p (all S sequences at once): DSpine's sampled proposal (candidates,
    16 x 16 tail, chain drawn at `temperature`), then the target scores the drafted
    prefix; with a_t = min(1, p_t(v_t) / q_t(v_t)) (p: the target's softmax at the same
    temperature, q: the 16-way distribution v_t was drawn from) the expected accepted
    length of the block is sum_t prod_{i <= t} a_i.
    """
    from vllm_dspine.kernels.retrieval import retrieve_candidates
    from vllm_dspine.kernels.tail import LastWriteInputs, TailTables, refine_last_write

    S = ids.shape[0]
    B, k = cfg.block_size, cfg.head_topk
    K = B - 1
    weights = tail_weights(cfg, w, lm_head)
    tables = TailTables.build(weights.bridge, lm_head, weights.norm_weight)
    lengths = []
    for p in anchor_positions:
        out = block_forward(cfg, w, embed_tokens, lm_head, ids, features,
                            torch.full((S, 1), p))
        cand = retrieve_candidates(out.final_hidden[:, 0, 1:].reshape(S * K, -1), lm_head,
                                   k, cfg.coarse_topk, mode="bf16").view(S, K, k)
        gens = [torch.Generator().manual_seed(int(torch.randint(2**62, (1,), generator=gen)))
                for _ in range(S)]
        prop = refine_last_write(LastWriteInputs(out.pre_write_state[:, 0], out.last_codes[:, 0],
                                                 out.last_rms[:, 0], ids[:, p]),
                                 cand, weights,
                                 temperature=torch.full((S,), temperature),
                                 generators=gens, tables=tables)
        draft = prop.draft_token_ids  # [S, K]
        draft_probs = (prop.cand_probs * (prop.cand_ids == draft[..., None])).sum(-1)  # [S, K]
        seq = torch.cat([ids[:, :p + 1], draft], dim=1)  # [S, p + B]
        logits = model(input_ids=seq, use_cache=False).logits[:, p:p + K].float()  # [S, K, V]
        target_probs = (logits / temperature).softmax(-1)
        p_draft = target_probs.gather(2, draft[..., None])[..., 0]  # [S, K]
        accept = (p_draft / draft_probs).clamp(max=1.0)
        lengths.append(accept.cumprod(dim=1).sum(dim=1))
    return torch.cat(lengths).mean().item()
