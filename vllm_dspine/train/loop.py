"""The block-distillation loop for real targets: packed blocks, restricted vocabulary,
progress bar, resumable checkpoints, a loss curve, and data parallelism by
torch.distributed (DDP, launched with torchrun; gloo on CPU, nccl on CUDA).

One training example is a block exactly as docs/design.md section 1 runs it: anchor `ids[p]` at
position p (p in the answer, where decoding drafts), mask rows at p+1..p+15, context =
target features of 0..p-1; row t is trained with cross-entropy against `ids[p + t]`
(rows past the end of the text are ignored), weighted towards early rows
(exp(-(t - 1) / row_decay), the DFlash weighting). Many blocks of one sequence are packed
along rows of one `block_forward` call (`model/drafter.py`, the statement of the model),
kept apart by its block-causal mask.

Restricted vocabulary: the loss normalises over the tokens that occur in the training
text (`vocab_ids`), not the whole vocabulary. The output head is the target's, frozen;
this only drops columns no label ever asks for and cuts the head's cost, which
dominates training at small hidden sizes (49,152 x 576 per row for SmolLM2).

    S sequences per step, nb blocks per sequence, B block size, K = B - 1, T length.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from dataclasses import asdict, dataclass

import numpy as np

import torch
import torch.nn.functional as F

from vllm_dspine.config import DSpineConfig
from vllm_dspine.model.drafter import BlocksOut, block_forward, last_write_with_predecessor

IGNORE = -100


def cosine_lr(step: int, steps: int, lr: float, warmup: int) -> float:
    """Linear warm-up over `warmup` steps, then cosine to 0 at `steps`."""
    if step < warmup:
        return lr * (step + 1) / warmup
    frac = (step - warmup) / max(1, steps - warmup)
    return lr * 0.5 * (1.0 + math.cos(math.pi * frac))


def row_weights(block_size: int, row_decay: float) -> torch.Tensor:
    """Loss weight of rows 1..K: exp(-(t - 1) / row_decay).  -> [K]"""
    return torch.exp(-torch.arange(block_size - 1, dtype=torch.float32) / row_decay)


def block_labels(ids: torch.Tensor,  # [S, T]
                 anchors: torch.Tensor,  # [S, nb]
                 block_size: int,
                 lengths: torch.Tensor | None = None,  # [S]  real length of each row
                 ) -> torch.Tensor:
    """Token each proposal row must predict: ids[s, anchor + t], t = 1..K; IGNORE where
    that position is past the sequence's end.  -> [S, nb, K]"""
    S, T = ids.shape
    pos = anchors[..., None] + torch.arange(1, block_size, device=ids.device)  # [S, nb, K]
    end = torch.full((S,), T, device=ids.device) if lengths is None else lengths
    valid = pos < end[:, None, None]
    labels = ids.gather(1, pos.clamp(max=T - 1).view(S, -1)).view_as(pos)
    return torch.where(valid, labels, torch.full_like(labels, IGNORE))


@dataclass
class BlockTargets:
    """What rows 1..K of each block are trained towards."""

    labels: torch.Tensor  # [S, nb, K]  next token in the loss vocabulary's numbering, or IGNORE
    soft_ids: torch.Tensor | None = None  # [S, nb, K, k]  the target's top-k ids (loss numbering, IGNORE outside)
    soft_probs: torch.Tensor | None = None  # [S, nb, K, k]  their probabilities, renormalised over the kept ids


def soft_targets(topk_ids: torch.Tensor,  # [S, T, k]  target's top-k at each position (full-vocab ids)
                 topk_logp: torch.Tensor,  # [S, T, k]
                 anchors: torch.Tensor,  # [S, nb]
                 block_size: int, remap: torch.Tensor,  # [V]  full id -> loss id or IGNORE
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's distribution of the token at position p + t, read at position
    p + t - 1 (where the target predicted it), for rows t = 1..K of every block;
    ids outside the loss vocabulary dropped and the rest renormalised.
    -> ids [S, nb, K, k] (loss numbering, IGNORE where dropped), probs [S, nb, K, k]"""
    S, T, k = topk_ids.shape
    pos = (anchors[..., None] + torch.arange(block_size - 1, device=anchors.device)
           ).clamp(max=T - 1)  # [S, nb, K]
    flat = pos.view(S, -1, 1).expand(-1, -1, k)  # [S, nb*K, k]
    ids = remap[topk_ids.gather(1, flat).long()].view(*pos.shape, k)
    probs = topk_logp.gather(1, flat).float().exp().view(*pos.shape, k)
    probs = torch.where(ids == IGNORE, torch.zeros_like(probs), probs)
    return ids, probs / probs.sum(-1, keepdim=True).clamp(min=1e-9)


def _row_losses(logits: torch.Tensor,  # [S, nb, K, V']
                targets: BlockTargets) -> torch.Tensor:
    """Cross-entropy of every row against its hard label, or against the target's
    top-k distribution when one is given.  -> [S, nb, K] (0 at ignored rows)"""
    if targets.soft_ids is None:
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                               targets.labels.reshape(-1), ignore_index=IGNORE,
                               reduction="none").view(targets.labels.shape)
    logp = torch.log_softmax(logits.float(), dim=-1)
    picked = logp.gather(-1, targets.soft_ids.clamp(min=0))  # [S, nb, K, k]
    return -(targets.soft_probs * picked).sum(-1)


def block_loss(cfg: DSpineConfig, w: dict[str, torch.Tensor],
               embed: torch.Tensor,  # [V, H]  the target's, frozen
               head: torch.Tensor,  # [V', H]  the target's head rows of the loss vocabulary
               ids: torch.Tensor,  # [S, T]
               feats: torch.Tensor,  # [S, T, F*H]
               anchors: torch.Tensor,  # [S, nb]
               targets: BlockTargets,
               weights: torch.Tensor,  # [K]
               total_weight: torch.Tensor | None = None,  # scalar
               tail_weight: float = 0.0,
               out: BlocksOut | None = None,
               ) -> torch.Tensor:
    """Row-weighted mean loss of rows 1..K (ignored rows excluded).  -> scalar

    Rows are scored twice when `tail_weight` > 0: as the block forward leaves them (the
    continuous predecessor codes: what retrieval ranks candidates with) and with the last
    write reading the code of the true previous token (`last_write_with_predecessor`:
    what the serial tail scores on an accepted prefix), rows 2..K, that loss weighted by
    `tail_weight` (row 1's predecessor is the anchor in both, already counted).

    The weighted sum is divided by `total_weight`, by default this batch's own sum of
    weights (the mean). Under DDP each rank passes the GLOBAL batch's sum / world size
    instead: DDP averages the ranks' gradients with equal weight, which is the global
    mean only if every rank divides by the same total. With ranks' own totals a rank
    holding more ignored rows (past the end of a text) would count for more per row.

    `out`: the block forward of these inputs where the caller has already run it
    (validation reads its logits too).
    """
    if out is None:
        out = block_forward(cfg, w, embed, head, ids, feats, anchors)
    ce = _row_losses(out.logits[:, :, 1:], targets)  # [S, nb, K]
    wt = weights * (targets.labels != IGNORE)  # [S, nb, K]
    if total_weight is None:
        total_weight = wt.sum()
    loss = (ce * wt).sum()
    if tail_weight > 0:
        B = cfg.block_size
        # rows past the text's end are ignored rows: any valid index serves them
        pos = (anchors[..., None] + torch.arange(B, device=ids.device) - 1
               ).clamp(0, ids.shape[1] - 1)  # [S, nb, B]
        pred = ids.gather(1, pos.view(ids.shape[0], -1)).view(pos.shape)
        pred[..., 0] = ids.gather(1, anchors)  # row 0: the anchor (never scored)
        final = last_write_with_predecessor(cfg, w, out, pred)  # [S, nb, B, H]
        tail_ce = _row_losses(final[:, :, 1:] @ head.float().t(), targets)  # [S, nb, K]
        loss = loss + tail_weight * (tail_ce[:, :, 1:] * wt[:, :, 1:]).sum()
    return loss / total_weight.clamp(min=1e-9)


class DrafterParams(torch.nn.Module):
    """The drafter's trainable tensors as one module (what DDP wraps). Checkpoint names
    contain dots, which parameter names may not: they are stored with '/' -> '__'."""

    def __init__(self, tensors: dict[str, torch.Tensor], frozen: frozenset[str] = frozenset()):
        super().__init__()
        self.names = list(tensors)
        self.p = torch.nn.ParameterDict(
            {n.replace(".", "__"): torch.nn.Parameter(t.detach().float().clone(),
                                                      requires_grad=n not in frozen)
             for n, t in tensors.items()})

    def tensors(self) -> dict[str, torch.Tensor]:
        return {n: self.p[n.replace(".", "__")] for n in self.names}

    def forward(self, cfg, embed, head, ids, feats, anchors, targets, weights,
                total_weight=None, tail_weight=0.0, out=None):
        return block_loss(cfg, self.tensors(), embed, head, ids, feats, anchors, targets,
                          weights, total_weight, tail_weight, out)


PROBE_WARM = 5  # --time-budget: steps left out of the timing (caches, kernels warming)


@dataclass(frozen=True)
class DistillSettings:
    steps: int = 2000
    seqs_per_step: int = 4  # global batch: sequences (split over ranks)
    blocks_per_seq: int = 16  # packed blocks per sequence
    lr: float = 6e-4
    weight_decay: float = 0.01
    warmup: int = 50
    row_decay: float = 7.0
    grad_clip: float = 1.0
    ckpt_every: int = 100
    seed: int = 0
    soft: bool = False  # distil to the target's top-k distribution (needs DistillData.topk_*)
    tail_weight: float = 0.0  # weight of the discrete-predecessor (tail) loss, rows 2..K
    train_rows: int | None = None  # proposal rows trained per block (None: all K)
    # Seconds of training this run may take: the steps are fixed after `probe_steps`
    # timed steps (inside the warm-up, so the schedule is that of a run given those
    # steps; the record keeps the number, and `steps` = it reproduces the run).
    time_budget: float | None = None
    probe_steps: int = 20
    # A validation split of the corpus: `val_seqs` sequences (a seeded choice) never
    # trained on, measured on fixed blocks before the first step, every `val_every`
    # steps and after the last (the loss, and the drafts a block the argmax rows would
    # have accepted); with `keep_best` the run returns the tensors of the best
    # measurement by `val_metric` (the starting tensors included), not the last step's.
    # "accepted" by default: on the SmolLM2 corpus the loss of unseen text rose while
    # its acceptance still grew (docs/training.md, "Validation split").
    val_seqs: int = 0
    val_every: int = 100
    keep_best: bool = True
    val_metric: str = "accepted"  # or "loss"


@dataclass
class DistillData:
    """Token ids and target features of the training text, per sequence."""

    ids: list[torch.Tensor]  # n x [T_i]  int64
    feats: list  # n x [T_i, F*H]: fp32 tensors, or bf16 bits as uint16 arrays (memory-mapped)
    first_anchor: list[int]  # n: first decode position (the prompt's length)
    topk_ids: list | None = None  # n x [T_i, k]  the target's top-k next-token ids
    topk_logp: list | None = None  # n x [T_i, k]  their log-probabilities
    vocab: torch.Tensor | None = None  # [V']  the loss vocabulary, sorted (None: the text's)

    def vocab_ids(self) -> torch.Tensor:
        """Sorted ids of the loss vocabulary (default: every token of the text).  -> [V']"""
        if self.vocab is not None:
            return self.vocab
        return torch.unique(torch.cat(self.ids))


def _rows(x, t: int) -> torch.Tensor:
    """The first t rows of a per-sequence array as fp32 (bf16 bits are widened)."""
    if isinstance(x, torch.Tensor):
        return x[:t].float()
    a = np.asarray(x[:t])
    if a.dtype == np.uint16:
        from vllm_dspine.train.feature_store import bf16_from_bits

        return bf16_from_bits(a)
    return torch.from_numpy(np.ascontiguousarray(a))


def sample_batch(data: DistillData, seqs: list[int], blocks_per_seq: int, block_size: int,
                 gen: torch.Generator):
    """Blocks of `seqs`: anchors drawn uniformly in [first_anchor, T - 2], sequences cut
    after the last anchor's block and right-padded to one length.
    -> ids [S, T], feats [S, T, F*H], anchors [S, nb], lengths [S], and the target's
    top-k (ids [S, T, k], log-probabilities [S, T, k]) when the data has them, else None"""
    anchors, rows = draw_anchors(data, seqs, blocks_per_seq, block_size, gen)
    ids, feats, lengths, topk = gather_batch(data, seqs, rows)
    return ids, feats, anchors, lengths, topk


def gather_batch(data: DistillData, seqs: list[int], rows: list[int]):
    """The first `rows[r]` positions of each sequence of `seqs`, right-padded to one
    length (the host twin of `DeviceData.batch`).
    -> ids [S, T], feats [S, T, F*H], lengths [S], top-k or None"""
    Tm = max(rows)
    fh = data.feats[seqs[0]].shape[1]
    ids = torch.zeros(len(seqs), Tm, dtype=torch.long)
    feats = torch.zeros(len(seqs), Tm, fh)
    topk = None
    if data.topk_ids is not None:
        k = data.topk_ids[seqs[0]].shape[1]
        topk = (torch.zeros(len(seqs), Tm, k, dtype=torch.long),
                torch.full((len(seqs), Tm, k), -1e4))
    for r, (i, t) in enumerate(zip(seqs, rows)):
        ids[r, :t] = data.ids[i][:t]
        feats[r, :t] = _rows(data.feats[i], t)
        if topk is not None:
            topk[0][r, :t] = _rows(data.topk_ids[i], t).long()
            topk[1][r, :t] = _rows(data.topk_logp[i], t).float()
    return ids, feats, torch.tensor(rows), topk


def draw_anchors(data: DistillData, seqs: list[int], blocks_per_seq: int, block_size: int,
                 gen: torch.Generator) -> tuple[torch.Tensor, list[int]]:
    """Anchors of `seqs` drawn uniformly in [first_anchor, T - 2], and how many rows of
    each sequence its last block reaches.  -> anchors [S, nb], rows (S ints)"""
    rows, anchors = [], []
    for i in seqs:
        T = len(data.ids[i])
        lo = min(data.first_anchor[i], T - 2)
        a = torch.randint(lo, T - 1, (blocks_per_seq,), generator=gen)  # [nb]
        anchors.append(a)
        rows.append(min(T, int(a.max()) + block_size))
    return torch.stack(anchors), rows


class DeviceData:
    """Every sequence of a DistillData concatenated once on `device` (features in bf16, as
    stored), so that a batch is gathered there by index: `sample_batch` copies
    memory-mapped rows on the host, which leaves a GPU waiting. Same batches as
    `sample_batch` for the same draws."""

    def __init__(self, data: DistillData, device: torch.device):
        lengths = [len(x) for x in data.ids]
        self.offsets = torch.tensor([0] + np.cumsum(lengths).tolist(),
                                    device=device)  # [n + 1]
        self.ids = torch.cat(data.ids).to(device)  # [N]
        self.feats = torch.cat([_rows_bf16(f) for f in data.feats]).to(device)  # [N, F*H]
        self.topk = None
        if data.topk_ids is not None:
            self.topk = (torch.cat([torch.as_tensor(np.asarray(x)) for x in data.topk_ids]
                                   ).to(device),  # [N, k]
                         torch.cat([torch.as_tensor(np.asarray(x)) for x in data.topk_logp]
                                   ).to(device))  # [N, k]
        self.device = device

    def batch(self, seqs: list[int], rows: list[int]):
        """-> ids [S, T], feats [S, T, F*H] fp32, lengths [S], top-k or None, as
        `sample_batch` (zeros past each row's end; top-k log-probabilities -1e4 there)."""
        dev = self.device
        lengths = torch.tensor(rows, device=dev)  # [S]
        col = torch.arange(max(rows), device=dev)  # [T]
        valid = col[None] < lengths[:, None]  # [S, T]
        idx = torch.where(valid, self.offsets[torch.tensor(seqs, device=dev)][:, None] + col,
                          0)  # [S, T]
        ids = torch.where(valid, self.ids[idx], 0)
        feats = self.feats[idx].float() * valid[..., None]
        topk = None
        if self.topk is not None:
            topk = (torch.where(valid[..., None], self.topk[0][idx].long(), 0),
                    torch.where(valid[..., None], self.topk[1][idx].float(), -1e4))
        return ids, feats, lengths, topk


def _rows_bf16(x) -> torch.Tensor:
    """A sequence's features as a bf16 tensor (bf16 bits are reinterpreted, not widened)."""
    if isinstance(x, torch.Tensor):
        return x.to(torch.bfloat16)
    a = np.asarray(x)
    if a.dtype == np.uint16:
        from vllm_dspine.train.feature_store import bf16_tensor_from_bits

        return bf16_tensor_from_bits(a)
    return torch.from_numpy(np.ascontiguousarray(a)).to(torch.bfloat16)


def _save_state(path: str, state: dict) -> None:
    tmp = path + ".tmp"
    torch.save(state, tmp)
    os.replace(tmp, path)  # a crash mid-write never leaves a torn checkpoint


def plot_loss(losses: list[float], path: str, title: str,
              val: list[dict] | None = None) -> None:
    """Loss per step and its 50-step running mean, and the validation split's points
    (`val`: {"step", "loss", "accepted"}: its loss beside the training loss, its
    accepted drafts a block on a second axis), as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    ax.plot(losses, lw=0.5, alpha=0.4, label="step")
    k = 50
    if len(losses) >= k:
        run = torch.tensor(losses).unfold(0, k, 1).mean(1).tolist()
        ax.plot(range(k - 1, len(losses)), run, lw=1.5, label=f"{k}-step mean")
    if val:
        steps = [v["step"] for v in val]
        ax.plot(steps, [v["loss"] for v in val], "o-", ms=3, lw=1, label="validation loss")
        ax2 = ax.twinx()
        ax2.plot(steps, [v["accepted"] for v in val], "s--", ms=3, lw=1, color="C3",
                 label="validation accepted")
        ax2.set_ylabel("accepted drafts a block (argmax rows)")
        ax2.legend(loc="upper center")
    ax.set_xlabel("step")
    ax.set_ylabel("row-weighted cross-entropy")
    ax.set_title(title)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _batch_labels(cfg: DSpineConfig, remap: torch.Tensor, ids, anchors, lengths
                  ) -> torch.Tensor:
    """Row labels of a batch's blocks as loss-vocabulary indices.  -> [S, nb, K]"""
    labels = block_labels(ids, anchors, cfg.block_size, lengths)
    return torch.where(labels == IGNORE, labels, remap[labels.clamp(min=0)])


def _batch_loss(model, cfg: DSpineConfig, s: DistillSettings, embed: torch.Tensor,
                head_v: torch.Tensor,  # [V', H]
                remap: torch.Tensor,  # [V]  full-vocabulary id -> loss-vocabulary index
                weights: torch.Tensor,  # [K]
                ids, feats, anchors, lengths, topk, rank: int = 0, world: int = 1,
                out: BlocksOut | None = None):
    """The row-weighted loss of one batch (this rank's share of it) and the batch's total
    row weight, as training and validation both score it (`out`: the batch's block
    forward where already run, one process only).  -> (loss, total weight)"""
    mine = slice(rank, None, world)
    labels = _batch_labels(cfg, remap, ids, anchors, lengths)
    targets = BlockTargets(labels[mine])
    if s.soft:
        sid, sp = soft_targets(topk[0][mine], topk[1][mine], anchors[mine],
                               cfg.block_size, remap)
        targets = BlockTargets(labels[mine], sid, sp)
    # Every rank divides its weighted sum by the global batch's total weight / world,
    # so that DDP's average of the ranks' losses and gradients is the global
    # row-weighted mean however the ignored rows fall between ranks (one process:
    # the batch's own total, the plain mean).
    total = (weights * (labels != IGNORE)).sum() / world
    loss = model(cfg, embed, head_v, ids[mine], feats[mine], anchors[mine],
                 targets, weights, total, s.tail_weight, out)
    return loss, total


class ValidationSplit:
    """`s.val_seqs` sequences held out of training (a seeded choice) and fixed blocks of
    them (anchors drawn once), scored in batches of `s.seqs_per_step` sequences."""

    def __init__(self, data: DistillData, s: DistillSettings, block_size: int):
        n = len(data.ids)
        if s.val_metric not in ("accepted", "loss"):
            raise ValueError(f"distill: val_metric {s.val_metric!r}: 'accepted' or 'loss'")
        if not 0 < s.val_seqs < n:
            raise ValueError(f"distill: val_seqs ({s.val_seqs}) must leave training "
                             f"sequences: the corpus has {n}")
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(s.seed + 1))
        self.seqs = perm[:s.val_seqs].sort().values.tolist()
        self.train = perm[s.val_seqs:].sort().values  # [n - val_seqs]
        gen = torch.Generator().manual_seed(s.seed + 2)
        self.batches = []  # (seqs, anchors [S, nb], rows)
        for i in range(0, len(self.seqs), s.seqs_per_step):
            seqs = self.seqs[i:i + s.seqs_per_step]
            anchors, rows = draw_anchors(data, seqs, s.blocks_per_seq, block_size, gen)
            self.batches.append((seqs, anchors, rows))

    @torch.no_grad()
    def measure(self, module, cfg, s, embed, head_v, remap, weights, data: DistillData,
                dev_data: "DeviceData | None", device: torch.device) -> dict:
        """Over every held-out block: the row-weighted mean loss, and the mean number of
        leading rows whose argmax is the text's token (the drafts a block greedy
        verification would accept without the tail, over the trained rows), and that
        per row (the share of blocks whose rows 1..t all hit; "accepted" is their sum).
        -> {"loss", "accepted", "rows"}"""
        num = den = blocks = 0.0
        rows_hit = None  # [K] blocks whose leading rows hit through row t
        for seqs, anchors, rows in self.batches:
            if dev_data is not None:
                ids, feats, lengths, topk = dev_data.batch(seqs, rows)
            else:
                ids, feats, lengths, topk = gather_batch(data, seqs, rows)
            anchors = anchors.to(device)
            out = block_forward(cfg, module.tensors(), embed, head_v, ids, feats, anchors)
            loss, total = _batch_loss(module, cfg, s, embed, head_v, remap, weights, ids,
                                      feats, anchors, lengths, topk, out=out)
            num += loss.item() * total.item()
            den += total.item()
            labels = _batch_labels(cfg, remap, ids, anchors, lengths)  # [S, nb, K]
            hit = out.logits[:, :, 1:].argmax(-1) == labels  # ignored rows never hit
            lead = hit.int().cumprod(-1).sum((0, 1)).double()  # [K]
            rows_hit = lead if rows_hit is None else rows_hit + lead
            blocks += labels.shape[0] * labels.shape[1]
        rows = (rows_hit / max(blocks, 1)).tolist()
        return {"loss": num / max(den, 1e-9), "accepted": sum(rows),
                "rows": [round(r, 4) for r in rows]}


def distill(cfg: DSpineConfig, init: dict[str, torch.Tensor], embed: torch.Tensor,
            head: torch.Tensor, data: DistillData, s: DistillSettings, work_dir: str,
            progress: bool = True, frozen: frozenset[str] = frozenset(),
            device: str | torch.device = "cpu", device_data: bool | None = None,
            ) -> tuple[dict[str, torch.Tensor], dict]:
    """Train the drafter tensors `init` on `data`; resumes from `work_dir/train_state.pt`.

    Under torch.distributed (torchrun), each rank takes its share of every global batch
    (the same global batch as one process: all ranks draw the same sequences and
    anchors from the same seeded generator, rank r keeps sequences r, r + world, ...)
    and DDP averages the gradients. Tensors named in `frozen` keep their initial values
    (the no-bridge ablation holds the bridge writes at zero). On a `device` other than
    the CPU the drafter, the target's embedding and head and the whole data
    (`DeviceData`) live there; the batches are drawn on the host generator as on the
    CPU (`device_data`: that path on any device, None: off the CPU only). With
    `s.val_seqs` a validation split is held out of training (`ValidationSplit`) and, with
    `s.keep_best`, the tensors returned are those of its lowest loss (stats["val"]).
    -> (trained tensors on the CPU, stats)
    """
    import torch.distributed as dist

    distributed = dist.is_available() and dist.is_initialized()
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    if s.seqs_per_step % world:
        raise ValueError(f"distill: seqs_per_step ({s.seqs_per_step}) must be a multiple of "
                         f"the number of processes ({world})")
    os.makedirs(work_dir, exist_ok=True)
    state_path = os.path.join(work_dir, "train_state.pt")
    device = torch.device(device)
    on_device = device.type != "cpu" if device_data is None else device_data
    vocab = data.vocab_ids()  # [V']
    remap = torch.full((embed.shape[0],), IGNORE, dtype=torch.long)
    remap[vocab] = torch.arange(len(vocab))
    head_v = head[vocab].contiguous().to(device)  # [V', H]
    embed, remap = embed.to(device), remap.to(device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True  # training's matmuls; features stay fp32
    if on_device:
        dev_data = DeviceData(data, device)
    if s.soft and data.topk_ids is None:
        raise ValueError("distill: soft=True needs the target's top-k (DistillData.topk_ids)")
    if s.train_rows is not None:
        # Rows are causal inside a block: training the first rows alone gives them the
        # same loss as in the full block, at a fraction of the cost.
        cfg = dataclasses.replace(cfg, block_size=s.train_rows + 1)
    weights = row_weights(cfg.block_size, s.row_decay).to(device)

    val = ValidationSplit(data, s, cfg.block_size) if s.val_seqs else None
    # sequences training draws from (all of them without a validation split)
    train_seqs = val.train if val is not None else torch.arange(len(data.ids))  # [n']
    module = DrafterParams(init, frozen).to(device)
    trained = [p for p in module.p.values() if p.requires_grad]
    decay = [p for p in trained if p.ndim == 2]
    no_decay = [p for p in trained if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": s.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=s.lr, betas=(0.9, 0.98), eps=1e-8)
    gen = torch.Generator().manual_seed(s.seed)
    step0, losses = 0, []
    val_points: list[dict] = []  # {"step": steps done, "loss", "accepted"}
    best: dict | None = None  # the best point so far by s.val_metric, with "tensors" (CPU)
    if os.path.exists(state_path):
        st = torch.load(state_path, weights_only=False)
        module.load_state_dict(st["module"])
        if s.time_budget is not None:
            # the budget chose the steps before the checkpoint (the probe precedes it):
            # keep them, or the schedule would change mid-run
            s = dataclasses.replace(s, steps=st["settings"]["steps"], time_budget=None)
        opt.load_state_dict(st["opt"])
        gen.set_state(st["gen"])
        step0, losses = st["step"], st["losses"]
        val_points, best = st.get("val_points", []), st.get("best")
    model = module
    if distributed:
        model = torch.nn.parallel.DistributedDataParallel(
            module, device_ids=[device.index] if device.index is not None else None)

    bar = None
    if progress and rank == 0:
        from tqdm import tqdm

        bar = tqdm(total=s.steps, initial=step0, desc="distill", unit="step",
                   dynamic_ncols=True)
    def better(a: dict, b: dict) -> bool:
        return (a["accepted"] > b["accepted"] if s.val_metric == "accepted"
                else a["loss"] < b["loss"])

    def validate(done: int) -> None:
        nonlocal best
        if val is None or rank != 0 or (val_points and val_points[-1]["step"] == done):
            return
        point = {"step": done, **val.measure(module, cfg, s, embed, head_v, remap, weights,
                                             data, dev_data if on_device else None,
                                             device)}
        val_points.append(point)
        if best is None or better(point, best):
            best = {**point, "tensors": {k: t.detach().cpu().clone()
                                         for k, t in module.tensors().items()}}
        print(f"distill: validation after {done} steps: loss {point['loss']:.4f}, "
              f"accepted {point['accepted']:.4f} a block (rows 1-4: "
              f"{' / '.join(f'{r:.3f}' for r in point['rows'][:4])}; best by "
              f"{s.val_metric}: after {best['step']})", flush=True)

    t0 = time.perf_counter()
    if step0 == 0:
        validate(0)  # the starting tensors: a continued drafter may be the best point
    step = step0
    while step < s.steps:
        if s.time_budget is not None and step == step0 + s.probe_steps:
            # steps PROBE_WARM..probe_steps timed (the first ones warm caches and kernels)
            per_step = (time.perf_counter() - t_probe) / max(1, s.probe_steps - PROBE_WARM)
            fit = step + int((s.time_budget - (time.perf_counter() - t0)) / per_step)
            s = dataclasses.replace(s, steps=max(step + 1, min(s.steps, fit)))
            if bar is not None:
                bar.total = s.steps
            if rank == 0:
                print(f"distill: {per_step * 1e3:.0f} ms a step: {s.steps} steps fit "
                      f"{s.time_budget:.0f} s", flush=True)
        if step == step0 + PROBE_WARM:
            t_probe = time.perf_counter()
        pick = torch.randperm(len(train_seqs), generator=gen)[:s.seqs_per_step]
        seqs = train_seqs[pick].tolist()
        if on_device:
            anchors, rows = draw_anchors(data, seqs, s.blocks_per_seq, cfg.block_size, gen)
            anchors = anchors.to(device)
            ids, feats, lengths, topk = dev_data.batch(seqs, rows)
        else:
            ids, feats, anchors, lengths, topk = sample_batch(data, seqs, s.blocks_per_seq,
                                                              cfg.block_size, gen)
        for g in opt.param_groups:
            g["lr"] = cosine_lr(step, s.steps, s.lr, s.warmup)
        loss, _ = _batch_loss(model, cfg, s, embed, head_v, remap, weights, ids, feats,
                              anchors, lengths, topk, rank, world)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trained, s.grad_clip)
        opt.step()
        if distributed:
            dist.all_reduce(ls := loss.detach().clone())
            losses.append(ls.item() / world)
        else:
            losses.append(loss.item())
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{sum(losses[-20:]) / len(losses[-20:]):.3f}")
        if (step + 1) % s.val_every == 0 or step + 1 == s.steps:
            validate(step + 1)
        if rank == 0 and ((step + 1) % s.ckpt_every == 0 or step + 1 == s.steps):
            _save_state(state_path, {"module": module.state_dict(), "opt": opt.state_dict(),
                                     "gen": gen.get_state(), "step": step + 1,
                                     "losses": losses, "settings": asdict(s),
                                     "val_points": val_points, "best": best})
            plot_loss(losses, os.path.join(work_dir, "loss.png"),
                      f"DSpine distillation ({len(losses)} steps)", val_points)
        step += 1
    if bar is not None:
        bar.close()
    stats = {"steps": s.steps, "resumed_at": step0, "device": str(device),
             "loss_first": losses[0] if losses else None,
             "loss_last50": sum(losses[-50:]) / max(1, len(losses[-50:])),
             "train_seconds_this_run": time.perf_counter() - t0,
             "loss_vocab": len(vocab), "sequences": len(data.ids),
             "tokens": int(sum(len(x) for x in data.ids))}
    if rank == 0:
        with open(os.path.join(work_dir, "losses.json"), "w") as f:
            json.dump(losses, f)
    tensors = {k: v.detach().cpu().clone() for k, v in module.tensors().items()}
    if val is not None and rank == 0:
        validate(step)  # a run resumed at its end measures its last point too
        stats["val"] = {"seqs": len(val.seqs), "every": s.val_every, "metric": s.val_metric,
                        "points": [{k: round(v, 5) if isinstance(v, float) else v
                                    for k, v in p.items()} for p in val_points],
                        "best_step": best["step"], "returned": "best" if s.keep_best
                        else "last"}
        if s.keep_best:
            tensors = {k: v.clone() for k, v in best["tensors"].items()}
    return tensors, stats
