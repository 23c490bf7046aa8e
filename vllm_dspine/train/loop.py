"""The block-distillation loop for real targets: packed blocks, restricted vocabulary,
progress bar, resumable checkpoints, a loss curve, and data parallelism by
torch.distributed (DDP, launched with torchrun; gloo on CPU, nccl on CUDA).

One training example is a block exactly as DESIGN section 1 runs it: anchor `ids[p]` at
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

import json
import math
import os
import time
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from vllm_dspine.config import DSpineConfig
from vllm_dspine.model.drafter import block_forward

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
    pos = anchors[..., None] + torch.arange(1, block_size)  # [S, nb, K]
    end = torch.full((S,), T) if lengths is None else lengths
    valid = pos < end[:, None, None]
    labels = ids.gather(1, pos.clamp(max=T - 1).view(S, -1)).view_as(pos)
    return torch.where(valid, labels, torch.full_like(labels, IGNORE))


def block_loss(cfg: DSpineConfig, w: dict[str, torch.Tensor],
               embed: torch.Tensor,  # [V, H]  the target's, frozen
               head: torch.Tensor,  # [V', H]  the target's head rows of the loss vocabulary
               ids: torch.Tensor,  # [S, T]
               feats: torch.Tensor,  # [S, T, F*H]
               anchors: torch.Tensor,  # [S, nb]
               labels: torch.Tensor,  # [S, nb, K]  ids in head's row numbering, or IGNORE
               weights: torch.Tensor,  # [K]
               total_weight: torch.Tensor | None = None,  # scalar
               ) -> torch.Tensor:
    """Row-weighted mean cross-entropy of rows 1..K (ignored rows excluded).  -> scalar

    The weighted sum is divided by `total_weight`, by default this batch's own sum of
    weights (the mean). Under DDP each rank passes the GLOBAL batch's sum / world size
    instead: DDP averages the ranks' gradients with equal weight, which is the global
    mean only if every rank divides by the same total. With ranks' own totals a rank
    holding more ignored rows (past the end of a text) would count for more per row.
    """
    out = block_forward(cfg, w, embed, head, ids, feats, anchors)
    logits = out.logits[:, :, 1:]  # [S, nb, K, V']
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                         ignore_index=IGNORE, reduction="none").view(labels.shape)
    wt = weights * (labels != IGNORE)  # [S, nb, K]
    if total_weight is None:
        total_weight = wt.sum()
    return (ce * wt).sum() / total_weight.clamp(min=1e-9)


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

    def forward(self, cfg, embed, head, ids, feats, anchors, labels, weights,
                total_weight=None):
        return block_loss(cfg, self.tensors(), embed, head, ids, feats, anchors, labels,
                          weights, total_weight)


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


@dataclass
class DistillData:
    """Token ids and target features of the training text, per sequence."""

    ids: list[torch.Tensor]  # n x [T_i]  int64
    feats: list[torch.Tensor]  # n x [T_i, F*H]
    first_anchor: list[int]  # n: first decode position (the prompt's length)

    def vocab_ids(self) -> torch.Tensor:
        """Sorted ids of every token in the text (the loss vocabulary).  -> [V']"""
        return torch.unique(torch.cat(self.ids))


def sample_batch(data: DistillData, seqs: list[int], blocks_per_seq: int, block_size: int,
                 gen: torch.Generator):
    """Blocks of `seqs`: anchors drawn uniformly in [first_anchor, T - 2], sequences cut
    after the last anchor's block and right-padded to one length.
    -> ids [S, T], feats [S, T, F*H], anchors [S, nb], lengths [S]"""
    rows, anchors = [], []
    for i in seqs:
        T = len(data.ids[i])
        lo = min(data.first_anchor[i], T - 2)
        a = torch.randint(lo, T - 1, (blocks_per_seq,), generator=gen)  # [nb]
        anchors.append(a)
        rows.append(min(T, int(a.max()) + block_size))
    Tm = max(rows)
    fh = data.feats[seqs[0]].shape[1]
    ids = torch.zeros(len(seqs), Tm, dtype=torch.long)
    feats = torch.zeros(len(seqs), Tm, fh)
    for r, (i, t) in enumerate(zip(seqs, rows)):
        ids[r, :t] = data.ids[i][:t]
        feats[r, :t] = data.feats[i][:t]
    return ids, feats, torch.stack(anchors), torch.tensor(rows)


def _save_state(path: str, state: dict) -> None:
    tmp = path + ".tmp"
    torch.save(state, tmp)
    os.replace(tmp, path)  # a crash mid-write never leaves a torn checkpoint


def plot_loss(losses: list[float], path: str, title: str) -> None:
    """Loss per step and its 50-step running mean, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    ax.plot(losses, lw=0.5, alpha=0.4, label="step")
    k = 50
    if len(losses) >= k:
        run = torch.tensor(losses).unfold(0, k, 1).mean(1).tolist()
        ax.plot(range(k - 1, len(losses)), run, lw=1.5, label=f"{k}-step mean")
    ax.set_xlabel("step")
    ax.set_ylabel("row-weighted cross-entropy")
    ax.set_title(title)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def distill(cfg: DSpineConfig, init: dict[str, torch.Tensor], embed: torch.Tensor,
            head: torch.Tensor, data: DistillData, s: DistillSettings, work_dir: str,
            progress: bool = True, frozen: frozenset[str] = frozenset(),
            ) -> tuple[dict[str, torch.Tensor], dict]:
    """Train the drafter tensors `init` on `data`; resumes from `work_dir/train_state.pt`.

    Under torch.distributed (torchrun), each rank takes its share of every global batch
    (the same global batch as one process: all ranks draw the same sequences and
    anchors from the same seeded generator, rank r keeps sequences r, r + world, ...)
    and DDP averages the gradients. Tensors named in `frozen` keep their initial values
    (the no-bridge ablation holds the bridge writes at zero). -> (trained tensors, stats)
    """
    import torch.distributed as dist

    distributed = dist.is_available() and dist.is_initialized()
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    if s.seqs_per_step % world:
        raise ValueError(f"distill: seqs_per_step ({s.seqs_per_step}) must be a multiple of "
                         f"the number of processes ({world})")
    os.makedirs(work_dir, exist_ok=True)
    state_path = os.path.join(work_dir, "train_state.pt")
    vocab = data.vocab_ids()  # [V']
    remap = torch.full((embed.shape[0],), IGNORE, dtype=torch.long)
    remap[vocab] = torch.arange(len(vocab))
    head_v = head[vocab].contiguous()  # [V', H]
    weights = row_weights(cfg.block_size, s.row_decay)

    module = DrafterParams(init, frozen)
    trained = [p for p in module.p.values() if p.requires_grad]
    decay = [p for p in trained if p.ndim == 2]
    no_decay = [p for p in trained if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": s.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=s.lr, betas=(0.9, 0.98), eps=1e-8)
    gen = torch.Generator().manual_seed(s.seed)
    step0, losses = 0, []
    if os.path.exists(state_path):
        st = torch.load(state_path, weights_only=False)
        module.load_state_dict(st["module"])
        opt.load_state_dict(st["opt"])
        gen.set_state(st["gen"])
        step0, losses = st["step"], st["losses"]
    model = module
    if distributed:
        model = torch.nn.parallel.DistributedDataParallel(module)

    bar = None
    if progress and rank == 0:
        from tqdm import tqdm

        bar = tqdm(total=s.steps, initial=step0, desc="distill", unit="step",
                   dynamic_ncols=True)
    t0 = time.perf_counter()
    n = len(data.ids)
    for step in range(step0, s.steps):
        seqs = torch.randperm(n, generator=gen)[:s.seqs_per_step].tolist()
        ids, feats, anchors, lengths = sample_batch(data, seqs, s.blocks_per_seq,
                                                    cfg.block_size, gen)
        mine = slice(rank, None, world)
        labels = block_labels(ids, anchors, cfg.block_size, lengths)
        labels = torch.where(labels == IGNORE, labels, remap[labels.clamp(min=0)])
        for g in opt.param_groups:
            g["lr"] = cosine_lr(step, s.steps, s.lr, s.warmup)
        # Every rank divides its weighted sum by the global batch's total weight / world,
        # so that DDP's average of the ranks' losses and gradients is the global
        # row-weighted mean however the ignored rows fall between ranks (one process:
        # the batch's own total, the plain mean).
        total = (weights * (labels != IGNORE)).sum() / world
        loss = model(cfg, embed, head_v, ids[mine], feats[mine], anchors[mine],
                     labels[mine], weights, total)
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
        if rank == 0 and ((step + 1) % s.ckpt_every == 0 or step + 1 == s.steps):
            _save_state(state_path, {"module": module.state_dict(), "opt": opt.state_dict(),
                                     "gen": gen.get_state(), "step": step + 1,
                                     "losses": losses, "settings": asdict(s)})
            plot_loss(losses, os.path.join(work_dir, "loss.png"),
                      f"DSpine distillation ({len(losses)} steps)")
    if bar is not None:
        bar.close()
    stats = {"steps": s.steps, "resumed_at": step0, "loss_first": losses[0] if losses else None,
             "loss_last50": sum(losses[-50:]) / max(1, len(losses[-50:])),
             "train_seconds_this_run": time.perf_counter() - t0,
             "loss_vocab": len(vocab), "sequences": n,
             "tokens": int(sum(len(x) for x in data.ids))}
    if rank == 0:
        with open(os.path.join(work_dir, "losses.json"), "w") as f:
            json.dump(losses, f)
    tensors = {k: v.detach().clone() for k, v in module.tensors().items()}
    return tensors, stats
