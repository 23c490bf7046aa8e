"""The block-distillation loop (`train/loop.py`) on the tiny pair: data parallelism gives
the one-process run, a resumed run is the uninterrupted one bit for bit, labels and
batches are cut where the text ends, the loss curve is a PNG; and the drafter's xformers
attention path (CUDA) is the SDPA one.

    S sequences, T length, nb blocks per sequence, B block size, K = B - 1.
"""

import json
import os
import socket
import sys

import pytest
import torch

from vllm_dspine.model.checkpoint import random_draft_tensors
from vllm_dspine.model.drafter import _xformers_ops, attention_backend, block_forward
from vllm_dspine.pairs.tiny import draft_config, write_tiny_pair
from vllm_dspine.train import loop
from vllm_dspine.train.loop import (IGNORE, DistillData, DistillSettings, block_labels,
                                    BlockTargets, block_loss, distill, row_weights,
                                    sample_batch)
from vllm_dspine.train.target_data import generate_text, target_features

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py

# Small enough for seconds on a busy 2-core CPU: 4 sequences of 4 blocks per step.
SETTINGS = DistillSettings(steps=3, seqs_per_step=4, blocks_per_seq=4, lr=1e-3, warmup=1,
                           ckpt_every=100, seed=0)
PROMPT = 8


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return write_tiny_pair(str(tmp_path_factory.mktemp("tiny")), seed=0)


@pytest.fixture(scope="module")
def target(pair):
    from vllm_dspine.train.target_data import load_target

    return load_target(pair.target_dir)


@pytest.fixture(scope="module")
def inputs(target):
    """(cfg, init tensors, embed, head, data): six texts cut to different lengths, so
    that blocks near an end (ignored rows) fall unevenly between ranks."""
    cfg, threads = draft_config(), torch.get_num_threads()
    torch.set_num_threads(1)  # module fixtures run before the per-test `one_thread`
    try:
        ids = generate_text(target, 6, PROMPT, 24, 0.5, torch.Generator().manual_seed(0))
        feats = target_features(target, ids, cfg.target_layer_ids)  # [6, 32, 384]
    finally:
        torch.set_num_threads(threads)
    # Features of a prefix are those of the full text (the target is causal).
    lengths = [32, 21, 27, 32, 18, 25]
    data = DistillData(ids=[ids[i, :n].clone() for i, n in enumerate(lengths)],
                       feats=[feats[i, :n].clone() for i, n in enumerate(lengths)],
                       first_anchor=[PROMPT] * len(lengths))
    embed, head = target.model.embed_tokens.weight.detach(), target.lm_head.weight.detach()
    return cfg, random_draft_tensors(cfg, seed=1), embed, head, data


def _run(inputs, work_dir, settings=SETTINGS):
    cfg, init, embed, head, data = inputs
    return distill(cfg, init, embed, head, data, settings, str(work_dir), progress=False)


def _losses(work_dir) -> list[float]:
    with open(os.path.join(work_dir, "losses.json")) as f:
        return json.load(f)


# ------------------------------------------------------------------ two-process DDP
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ddp_worker(rank: int, world: int, port: int, inputs_path: str, work_dir: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    try:
        cfg_inputs = (draft_config(), *torch.load(inputs_path, weights_only=False))
        tensors, _ = _run(cfg_inputs, work_dir)
        torch.save(tensors, os.path.join(work_dir, f"tensors_rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_two_process_ddp_matches_one_process(inputs, tmp_path):
    import torch.multiprocessing as mp

    single, _ = _run(inputs, tmp_path / "single")
    _, init, embed, head, data = inputs
    torch.save((init, embed, head, data), tmp_path / "inputs.pt")
    ddp_dir = tmp_path / "ddp"
    ddp_dir.mkdir()
    mp.spawn(_ddp_worker, args=(2, _free_port(), str(tmp_path / "inputs.pt"), str(ddp_dir)),
             nprocs=2, join=True)

    # Not bit-equal: DDP's gradient all-reduce adds the two ranks' partial sums (each a
    # sum over its half of the batch) in another order than one process's single sum
    # over the whole batch, so fp32 rounding differs in the last bits (and Adam carries
    # that on); with equal normalisation the difference is rounding only. (Each rank
    # dividing by its own total weight, as the loop did before, moves the loss by ~2%.)
    assert len(_losses(ddp_dir)) == len(_losses(tmp_path / "single")) == SETTINGS.steps
    torch.testing.assert_close(torch.tensor(_losses(ddp_dir)),
                               torch.tensor(_losses(tmp_path / "single")),
                               atol=1e-5, rtol=1e-5)
    ranks = [torch.load(ddp_dir / f"tensors_rank{r}.pt") for r in range(2)]
    for name, t in single.items():
        assert torch.equal(ranks[0][name], ranks[1][name]), name  # DDP keeps ranks equal
        torch.testing.assert_close(ranks[0][name], t, atol=1e-5, rtol=1e-5, msg=name)
    assert not torch.equal(single["fc.weight"], init["fc.weight"])  # it did train


def test_ddp_gradient_is_the_global_gradient(inputs):
    """One global batch: the mean of the two ranks' gradients (what DDP applies) equals
    the one-process gradient, also when the ignored rows fall unevenly on the ranks."""
    cfg, init, embed, head, data = inputs
    vocab = data.vocab_ids()
    remap = torch.full((embed.shape[0],), IGNORE, dtype=torch.long)
    remap[vocab] = torch.arange(len(vocab))
    head_v = head[vocab]
    weights = row_weights(cfg.block_size, SETTINGS.row_decay)
    ids, feats, anchors, lengths, _ = sample_batch(data, [1, 0, 4, 3], 4, cfg.block_size,
                                                   torch.Generator().manual_seed(5))
    labels = block_labels(ids, anchors, cfg.block_size, lengths)
    labels = torch.where(labels == IGNORE, labels, remap[labels.clamp(min=0)])
    wt = weights * (labels != IGNORE)  # [S, nb, K]
    halves = [slice(0, None, 2), slice(1, None, 2)]  # rank r's sequences, as in distill
    # The case the normalisation is for: the ranks hold different total weights.
    assert abs(wt[halves[0]].sum() - wt[halves[1]].sum()) > 1.0

    def grads(sl, total):
        w = {n: t.clone().requires_grad_(True) for n, t in init.items()}
        loss = block_loss(cfg, w, embed, head_v, ids[sl], feats[sl], anchors[sl],
                          BlockTargets(labels[sl]), weights, total)
        return loss.detach(), torch.autograd.grad(loss, list(w.values()))

    loss_one, g_one = grads(slice(None), None)
    parts = [grads(sl, wt.sum() / 2) for sl in halves]
    torch.testing.assert_close((parts[0][0] + parts[1][0]) / 2, loss_one, atol=0, rtol=1e-6)
    for name, g, g0, g1 in zip(init, g_one, parts[0][1], parts[1][1]):
        err = ((g0 + g1) / 2 - g).norm()
        assert err <= 1e-6 * g.norm() + 1e-12, (name, float(err), float(g.norm()))
    # Each rank's own mean (the old normalisation) averages to something else.
    own = [grads(sl, None) for sl in halves]
    assert abs((own[0][0] + own[1][0]) / 2 - loss_one) > 1e-4 * loss_one


# ------------------------------------------------------------------------- resume
def _run_interrupted_after(inputs, out, settings, step, monkeypatch) -> None:
    """`_run` into `out`, crashing right after its step-`step` checkpoint is saved."""

    class Interrupted(Exception):
        pass

    real_save = loop._save_state

    def save_then_stop(path, state):
        real_save(path, state)
        if state["step"] == step:
            raise Interrupted

    monkeypatch.setattr(loop, "_save_state", save_then_stop)
    with pytest.raises(Interrupted):
        _run(inputs, out, settings)
    monkeypatch.setattr(loop, "_save_state", real_save)


def test_resume_is_bit_identical(inputs, tmp_path, monkeypatch):
    s = DistillSettings(**{**SETTINGS.__dict__, "steps": 6, "ckpt_every": 3})
    full, stats_full = _run(inputs, tmp_path / "full", s)
    assert stats_full["resumed_at"] == 0

    _run_interrupted_after(inputs, tmp_path / "resumed", s, 3, monkeypatch)
    assert not os.path.exists(tmp_path / "resumed" / "losses.json")
    resumed, stats = _run(inputs, tmp_path / "resumed", s)

    assert stats["resumed_at"] == 3
    assert _losses(tmp_path / "resumed") == _losses(tmp_path / "full")
    assert len(_losses(tmp_path / "full")) == 6
    for name in full:
        assert torch.equal(resumed[name], full[name]), name


# ------------------------------------------------------------------ validation split
VAL_SETTINGS = DistillSettings(steps=6, seqs_per_step=2, blocks_per_seq=4, lr=3e-2,
                               warmup=1, ckpt_every=3, seed=0, val_seqs=2, val_every=2)


def _val_point(inputs, s, tensors) -> dict:
    """The validation point `distill` measures, of `tensors`, recomputed from outside."""
    cfg, init, embed, head, data = inputs
    vocab = data.vocab_ids()
    remap = torch.full((embed.shape[0],), IGNORE, dtype=torch.long)
    remap[vocab] = torch.arange(len(vocab))
    split = loop.ValidationSplit(data, s, cfg.block_size)
    return split.measure(loop.DrafterParams(tensors), cfg, s, embed.float(),
                         head.float()[vocab], remap,
                         row_weights(cfg.block_size, s.row_decay), data, None,
                         torch.device("cpu"))


def test_validation_split_is_never_trained_on_and_the_best_point_is_kept(
        inputs, tmp_path, monkeypatch):
    """With `val_seqs`, training draws only the other sequences; the split is measured
    before the first step, every `val_every` steps and after the last; the tensors
    returned are those of the best point (by accepted drafts a block), which measure the
    same again."""
    drawn = []
    real_sample = loop.sample_batch

    def record(data, seqs, *a, **k):
        drawn.extend(seqs)
        return real_sample(data, seqs, *a, **k)

    monkeypatch.setattr(loop, "sample_batch", record)
    best, stats = _run(inputs, tmp_path / "best", VAL_SETTINGS)
    monkeypatch.setattr(loop, "sample_batch", real_sample)
    val = stats["val"]
    held = loop.ValidationSplit(inputs[4], VAL_SETTINGS, inputs[0].block_size).seqs
    assert len(held) == 2 and not set(drawn) & set(held)
    assert len(set(drawn)) == 4  # every other sequence is trained on
    assert [p["step"] for p in val["points"]] == [0, 2, 4, 6]
    assert val["metric"] == "accepted" and val["returned"] == "best"
    top = max(val["points"], key=lambda p: p["accepted"])  # the first of equals
    assert val["best_step"] == top["step"]
    again = _val_point(inputs, VAL_SETTINGS, best)
    assert again["loss"] == pytest.approx(top["loss"], abs=1e-4)
    assert again["accepted"] == pytest.approx(top["accepted"], abs=1e-6)


def test_validation_accepted_counts_leading_argmax_hits(inputs, tmp_path):
    """`accepted` is the mean over blocks of the leading rows whose argmax is the text's
    token, and `rows` the share of blocks whose leading hits reach each row: checked
    against a loop over the blocks of the same forward, for a drafter trained enough to
    hit some rows."""
    cfg, _, embed, head, data = inputs
    s = VAL_SETTINGS
    init, _ = _run(inputs, tmp_path / "trained",
                   DistillSettings(**{**s.__dict__, "steps": 30, "lr": 1e-2, "val_seqs": 0}))
    vocab = data.vocab_ids()
    remap = torch.full((embed.shape[0],), IGNORE, dtype=torch.long)
    remap[vocab] = torch.arange(len(vocab))
    split = loop.ValidationSplit(data, s, cfg.block_size)
    point = _val_point(inputs, s, init)
    got = point["accepted"]
    total = blocks = 0
    reached = [0] * (cfg.block_size - 1)  # blocks whose rows 1..t all hit
    for seqs, anchors, rows in split.batches:
        ids, feats, lengths, _ = loop.gather_batch(data, seqs, rows)
        logits = block_forward(cfg, {k: v.float() for k, v in init.items()}, embed.float(),
                               head.float()[vocab], ids, feats, anchors).logits
        labels = block_labels(ids, anchors, cfg.block_size, lengths)
        for r in range(anchors.shape[0]):
            for b in range(anchors.shape[1]):
                n = 0
                for k in range(cfg.block_size - 1):
                    lab = int(labels[r, b, k])
                    if lab == IGNORE or int(logits[r, b, k + 1].argmax()) != int(remap[lab]):
                        break
                    reached[k] += 1
                    n += 1
                total, blocks = total + n, blocks + 1
    assert total > 0 and got == pytest.approx(total / blocks, abs=1e-9)
    # per row: the share of blocks whose leading rows reach it (rounded to 4 places)
    assert point["rows"] == pytest.approx([x / blocks for x in reached], abs=1e-4)


def test_validation_returns_the_best_point_not_the_last(inputs, tmp_path):
    """At a learning rate of 1 the validation loss falls, then rises past its low
    (6.13, 5.12, 7.38, 6.38 after 0, 2, 4, 6 steps with these seeds): by loss,
    keep_best returns the tensors of the low point, keep_best=False the last step's;
    each measures its own recorded loss again."""
    s = DistillSettings(**{**VAL_SETTINGS.__dict__, "lr": 1.0, "val_metric": "loss"})
    kept, stats = _run(inputs, tmp_path / "best", s)
    pts = stats["val"]["points"]
    low = min(pts, key=lambda p: p["loss"])
    assert stats["val"]["best_step"] == low["step"] < 6
    assert pts[-1]["loss"] > low["loss"] + 0.5
    assert _val_point(inputs, s, kept)["loss"] == pytest.approx(low["loss"], abs=1e-4)
    last_s = DistillSettings(**{**s.__dict__, "keep_best": False})
    last, stats = _run(inputs, tmp_path / "last", last_s)
    assert stats["val"]["returned"] == "last" and stats["val"]["points"] == pts
    assert _val_point(inputs, last_s, last)["loss"] == pytest.approx(pts[-1]["loss"],
                                                                     abs=1e-4)
    assert any(not torch.equal(kept[n], last[n]) for n in kept)


def test_validation_resume_is_bit_identical(inputs, tmp_path, monkeypatch):
    """A run with a validation split, stopped after a checkpoint and resumed, measures
    the same points and returns the same (best) tensors."""
    full, stats_full = _run(inputs, tmp_path / "full", VAL_SETTINGS)
    _run_interrupted_after(inputs, tmp_path / "resumed", VAL_SETTINGS, 3, monkeypatch)
    resumed, stats = _run(inputs, tmp_path / "resumed", VAL_SETTINGS)
    assert stats["resumed_at"] == 3
    assert stats["val"] == stats_full["val"]
    for name in full:
        assert torch.equal(resumed[name], full[name]), name


def test_validation_on_the_device_path_is_the_host_path(inputs, tmp_path):
    """The validation split measured through `DeviceData` (the GPU path, run here on the
    CPU) gives the host path's points, soft targets and tail loss on."""
    cfg, init, embed, head, data = inputs
    data = _bf16_data(data)
    s = DistillSettings(**{**VAL_SETTINGS.__dict__, "soft": True, "tail_weight": 1.0})
    points = {}
    for on in (False, True):
        _, stats = distill(cfg, init, embed, head, data, s, str(tmp_path / str(on)),
                           progress=False, device_data=on)
        points[on] = stats["val"]["points"]
    assert [p["step"] for p in points[True]] == [p["step"] for p in points[False]]
    for a, b in zip(points[True], points[False]):
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-4)
        assert a["accepted"] == pytest.approx(b["accepted"], abs=1e-9)


def test_validation_settings_are_checked(inputs, tmp_path):
    with pytest.raises(ValueError, match=r"val_seqs \(6\) must leave training sequences"):
        _run(inputs, tmp_path / "all", DistillSettings(**{**VAL_SETTINGS.__dict__,
                                                          "val_seqs": 6}))
    with pytest.raises(ValueError, match="val_metric 'kl': 'accepted' or 'loss'"):
        _run(inputs, tmp_path / "kl", DistillSettings(**{**VAL_SETTINGS.__dict__,
                                                         "val_metric": "kl"}))


# --------------------------------------------------------------- labels and batches
def test_block_labels_ignore_past_the_end():
    ids = torch.tensor([[10, 11, 12, 13, 14, 15],
                        [20, 21, 22, 23, 0, 0]])  # row 1: length 4, then padding
    anchors = torch.tensor([[1, 4], [0, 2]])
    I = IGNORE
    got = block_labels(ids, anchors, 4, torch.tensor([6, 4]))  # K = 3
    assert got.tolist() == [[[12, 13, 14], [15, I, I]],
                            [[21, 22, 23], [23, I, I]]]
    # Without lengths only the tensor's end counts: padding would become labels.
    assert block_labels(ids, anchors, 4)[1, 1].tolist() == [23, 0, 0]


def test_sample_batch_anchors_and_cut():
    lengths, first = [20, 33, 26], [8, 10, 5]
    data = DistillData(ids=[torch.arange(n) + 1 for n in lengths],
                       feats=[torch.randn(n, 3) for n in lengths], first_anchor=first)
    gen = torch.Generator().manual_seed(0)
    B, seen = 16, [set() for _ in lengths]
    for _ in range(40):
        ids, feats, anchors, rows, _ = sample_batch(data, [2, 0, 1], 8, B, gen)
        for r, i in enumerate([2, 0, 1]):
            T = lengths[i]
            assert first[i] <= int(anchors[r].min()) and int(anchors[r].max()) <= T - 2
            seen[i].update(anchors[r].tolist())
            n = min(T, int(anchors[r].max()) + B)
            assert int(rows[r]) == n
            assert torch.equal(ids[r, :n], data.ids[i][:n]) and not ids[r, n:].any()
            assert torch.equal(feats[r, :n], data.feats[i][:n]) and not feats[r, n:].any()
    for i, T in enumerate(lengths):  # both ends of [first_anchor, T - 2] are drawn
        assert min(seen[i]) == first[i] and max(seen[i]) == T - 2


def _bf16_data(data: DistillData, k: int = 5) -> DistillData:
    """`data` as the feature store hands it over: features as bf16 bits (uint16 arrays),
    and a made-up top-k (ids, log-probabilities) per position."""
    from vllm_dspine.train.feature_store import _bf16_bits

    gen = torch.Generator().manual_seed(3)
    V = int(torch.cat(data.ids).max()) + 1
    tids = [torch.randint(0, V, (len(x), k), generator=gen).int().numpy() for x in data.ids]
    tlp = [torch.randn(len(x), k, generator=gen).half().numpy() for x in data.ids]
    return DistillData(ids=data.ids, feats=[_bf16_bits(f) for f in data.feats],
                       first_anchor=data.first_anchor, topk_ids=tids, topk_logp=tlp)


def test_device_batches_are_the_host_batches(inputs):
    """`DeviceData.batch` (everything concatenated once, gathered by index: the GPU path)
    gives exactly `sample_batch`'s tensors for the same draws, padding included."""
    data = _bf16_data(inputs[4])
    dev = loop.DeviceData(data, torch.device("cpu"))
    g1, g2 = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    for seqs in ([0, 4, 2], [5, 1], [3, 3, 0, 4]):
        ids, feats, anchors, rows, topk = sample_batch(data, seqs, 4, 8, g1)
        a2, r2 = loop.draw_anchors(data, seqs, 4, 8, g2)
        ids2, feats2, rows2, topk2 = dev.batch(seqs, r2)
        assert torch.equal(anchors, a2) and torch.equal(rows, rows2)
        assert torch.equal(ids, ids2) and torch.equal(feats, feats2)
        assert torch.equal(topk[0], topk2[0]) and torch.equal(topk[1], topk2[1])


def test_device_data_path_trains_as_the_host_path(inputs, tmp_path):
    """The training loop through `DeviceData` (what runs on a GPU) takes the same steps
    as through `sample_batch`: same losses (soft targets, tail loss on) to fp32 rounding,
    so the GPU path is this loop, not another one."""
    cfg, init, embed, head, data = inputs
    data = _bf16_data(data)
    s = DistillSettings(steps=3, seqs_per_step=3, blocks_per_seq=4, lr=1e-3, warmup=1,
                        ckpt_every=100, seed=0, soft=True, tail_weight=1.0)
    out = {}
    for on in (False, True):
        distill(cfg, init, embed, head, data, s, str(tmp_path / str(on)), progress=False,
                device_data=on)
        out[on] = _losses(tmp_path / str(on))
    # The two paths feed identical batches; only summation order may differ (1e-5).
    assert torch.allclose(torch.tensor(out[True]), torch.tensor(out[False]), atol=1e-5)


def test_time_budget_fixes_the_steps(inputs, tmp_path):
    """--time-budget: the steps are chosen after the probe steps and recorded; a budget
    already spent stops right after the probe, an ample one keeps `steps`."""
    s = DistillSettings(steps=14, seqs_per_step=2, blocks_per_seq=2, lr=1e-3, warmup=10,
                        ckpt_every=100, seed=0, time_budget=0.0, probe_steps=7)
    _, stats = _run(inputs, tmp_path / "spent", s)
    assert stats["steps"] == 8 and len(_losses(tmp_path / "spent")) == 8
    _, stats = _run(inputs, tmp_path / "ample",
                    DistillSettings(**{**s.__dict__, "time_budget": 1e6}))
    assert stats["steps"] == 14 and len(_losses(tmp_path / "ample")) == 14


def test_time_budget_resume_keeps_the_recorded_steps(inputs, tmp_path, monkeypatch, capsys):
    """A --time-budget run resumed from a checkpoint keeps the steps the probe chose
    before it (recorded in the checkpoint) and does not probe again, even where the
    resumed run's steps are slower (another machine): the resumed run is the
    uninterrupted one bit for bit. (Probing again refitted the steps mid-schedule: here
    18 instead of 20, with another learning-rate schedule.)

    A fake clock makes the probe exact: every step costs `cost[0]` seconds."""
    cost, now = [1.0], [0.0]

    def clock():
        return now[0]

    real_sample = loop.sample_batch

    def timed_sample(*a, **k):  # once per step, after the probe has read the clock
        now[0] += cost[0]
        return real_sample(*a, **k)

    monkeypatch.setattr(loop, "time", type("FakeTime", (), {"perf_counter": staticmethod(clock)}))
    monkeypatch.setattr(loop, "sample_batch", timed_sample)
    # Probe: steps PROBE_WARM..7 timed (1 s each), 20 s budget, 7 s spent -> 7 + 13 = 20.
    s = DistillSettings(steps=40, seqs_per_step=2, blocks_per_seq=2, lr=1e-3, warmup=10,
                        ckpt_every=10, seed=0, time_budget=20.0, probe_steps=7)
    assert loop.PROBE_WARM < s.probe_steps < s.ckpt_every  # the probe precedes the checkpoint
    full, stats_full = _run(inputs, tmp_path / "full", s)
    assert stats_full["steps"] == 20 and len(_losses(tmp_path / "full")) == 20
    assert capsys.readouterr().out.count("steps fit") == 1

    _run_interrupted_after(inputs, tmp_path / "resumed", s, 10, monkeypatch)
    capsys.readouterr()
    st = torch.load(tmp_path / "resumed" / "train_state.pt", weights_only=False)
    assert st["step"] == 10 and st["settings"]["steps"] == 20  # the probe's choice, recorded

    # Resumed at 3 s a step: a second probe would fit 10 + int((20 - 21) / 3) -> 18 steps.
    cost[0], now[0] = 3.0, 0.0
    resumed, stats = _run(inputs, tmp_path / "resumed", s)
    assert "steps fit" not in capsys.readouterr().out  # no second probe
    assert stats["resumed_at"] == 10 and stats["steps"] == 20
    assert _losses(tmp_path / "resumed") == _losses(tmp_path / "full")
    for name in full:
        assert torch.equal(resumed[name], full[name]), name


# ---------------------------------------------------------------------- loss curve
def _assert_png(path):
    with open(path, "rb") as f:
        head = f.read(24)
    assert head[:8] == b"\x89PNG\r\n\x1a\n" and head[12:16] == b"IHDR"
    import matplotlib.image

    img = matplotlib.image.imread(path)
    assert img.ndim == 3 and img.shape[0] > 100 and img.shape[1] > 100


def test_loss_png(inputs, tmp_path):
    _run(inputs, tmp_path / "run")
    _assert_png(tmp_path / "run" / "loss.png")
    # Long enough for the running mean as well.
    loop.plot_loss([5.0 - 0.01 * i for i in range(60)], str(tmp_path / "long.png"), "t")
    _assert_png(tmp_path / "long.png")


# ----------------------------------------------------------------- attention paths
class _StandInBias:
    """xformers' BlockDiagonalCausal[LocalAttention]FromBottomRightMask as its docs state
    it: block i's query t (of q) sees key j (of k) iff j <= t + k - q and, with a window,
    t + k - q - j < window."""

    def __init__(self, q_seqlen, kv_seqlen, window=None):
        self.q, self.kv, self.window = list(q_seqlen), list(kv_seqlen), window

    @classmethod
    def from_seqlens(cls, q_seqlen, kv_seqlen):
        return cls(q_seqlen, kv_seqlen)

    def make_local_attention_from_bottomright(self, window_size):
        return _StandInBias(self.q, self.kv, window_size)

    def materialize(self) -> torch.Tensor:  # [sum q, sum kv]  True = attend
        m = torch.zeros(sum(self.q), sum(self.kv), dtype=torch.bool)
        q0 = k0 = 0
        for q, k in zip(self.q, self.kv):
            t, j = torch.arange(q)[:, None], torch.arange(k)[None, :]
            ok = j <= t + k - q
            if self.window is not None:
                ok &= (t + k - q - j) < self.window
            m[q0:q0 + q, k0:k0 + k] = ok
            q0, k0 = q0 + q, k0 + k
        return m


def _stand_in_attention(q, k, v, attn_bias, scale):  # [1, M, heads, D] like xformers
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
        attn_mask=attn_bias.materialize(), scale=scale)
    return out.transpose(1, 2)


@pytest.mark.parametrize("sliding_window", [None, 6], ids=["full", "window6"])
def test_xformers_path_on_cpu_with_a_stand_in(inputs, batch, sliding_window, monkeypatch):
    """The xformers path's packing (keys gathered per block, bias lengths, GQA, output
    layout) on CPU, with xformers replaced by a dense stand-in that follows its
    documented mask semantics: the same logits and gradients as the SDPA path."""
    import types

    from vllm_dspine.model import drafter

    for name in ("xformers", "xformers.ops", "xformers.ops.fmha",
                 "xformers.ops.fmha.attn_bias"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    sys.modules["xformers.ops.fmha.attn_bias"].BlockDiagonalCausalFromBottomRightMask = \
        _StandInBias
    monkeypatch.setattr(drafter, "_xformers_ops", lambda: types.SimpleNamespace(
        memory_efficient_attention=_stand_in_attention))
    monkeypatch.setattr(drafter, "attention_backend", lambda attention, *a: attention)
    _, init, embed, head, _ = inputs
    cfg = draft_config(sliding_window=sliding_window)
    ids, feats, anchors = batch

    def logits_and_grads(attention):
        w = {n: t.clone().requires_grad_(True) for n, t in init.items()}
        out = block_forward(cfg, w, embed, head, ids, feats, anchors, attention=attention)
        loss = out.logits.logsumexp(-1).mean()
        return out.logits.detach(), torch.autograd.grad(loss, list(w.values()))

    logits_x, g_x = logits_and_grads("xformers")
    logits_s, g_s = logits_and_grads("sdpa")
    torch.testing.assert_close(logits_x, logits_s, atol=1e-5, rtol=1e-5)
    for name, gx, gs in zip(init, g_x, g_s):
        torch.testing.assert_close(gx, gs, atol=1e-6, rtol=1e-5, msg=name)


@pytest.fixture(scope="module")
def batch(inputs):
    cfg, init, embed, head, data = inputs
    ids, feats, anchors, _, _ = sample_batch(data, [0, 3], 3, cfg.block_size,
                                             torch.Generator().manual_seed(2))
    return ids, feats, anchors


def test_attention_choice_on_cpu(inputs, batch):
    cfg, init, embed, head, _ = inputs
    ids, feats, anchors = batch
    with pytest.raises(ValueError, match=r"needs CUDA.*attention='sdpa'"):
        block_forward(cfg, init, embed, head, ids, feats, anchors, attention="xformers")
    with pytest.raises(ValueError, match="expected one of"):
        block_forward(cfg, init, embed, head, ids, feats, anchors, attention="flash")
    auto = block_forward(cfg, init, embed, head, ids, feats, anchors)
    sdpa = block_forward(cfg, init, embed, head, ids, feats, anchors, attention="sdpa")
    assert torch.equal(auto.logits, sdpa.logits)  # "auto" on CPU is SDPA
    cuda = torch.device("cuda")  # the choice alone; nothing runs on it
    assert attention_backend("auto", cuda, sliding_window=6) == "sdpa"
    if _xformers_ops() is None:
        assert attention_backend("auto", cuda) == "sdpa"
        with pytest.raises(ValueError, match="xformers is not installed.*pip install"):
            attention_backend("xformers", cuda)
    else:
        assert attention_backend("auto", cuda) == "xformers"


@pytest.mark.skipif(not (torch.cuda.is_available() and _xformers_ops() is not None),
                    reason="attention='xformers' runs only on CUDA with xformers installed")
@pytest.mark.parametrize("sliding_window", [None, 6], ids=["full", "window6"])
def test_xformers_matches_sdpa(inputs, batch, sliding_window):
    _, init, embed, head, _ = inputs
    cfg = draft_config(sliding_window=sliding_window)
    ids, feats, anchors = (t.cuda() for t in batch)
    labels = block_labels(ids, anchors, cfg.block_size)  # full-vocabulary ids
    weights = row_weights(cfg.block_size, 7.0).cuda()
    embed, head = embed.cuda(), head.cuda()

    def loss_and_grads(attention, grads):
        w = {n: t.cuda().requires_grad_(grads) for n, t in init.items()}
        out = block_forward(cfg, w, embed, head, ids, feats, anchors, attention=attention)
        ce = torch.nn.functional.cross_entropy(
            out.logits[:, :, 1:].reshape(-1, head.shape[0]), labels.reshape(-1),
            ignore_index=IGNORE, reduction="none").view(labels.shape)
        wt = weights * (labels != IGNORE)
        loss = (ce * wt).sum() / wt.sum()
        g = torch.autograd.grad(loss, list(w.values())) if grads else ()
        return out.logits.detach(), loss.detach(), g

    # xformers' fp32 (CUTLASS) backward has no sliding-window bias: forward only there.
    grads = sliding_window is None
    logits_x, loss_x, g_x = loss_and_grads("xformers", grads)
    logits_s, loss_s, g_s = loss_and_grads("sdpa", grads)
    torch.testing.assert_close(logits_x, logits_s, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(loss_x, loss_s, atol=1e-5, rtol=1e-5)
    for name, gx, gs in zip(init, g_x, g_s):
        torch.testing.assert_close(gx, gs, atol=1e-5, rtol=1e-4, msg=name)
