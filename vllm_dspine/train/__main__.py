"""Train a DSpine drafter for a Llama- or Qwen3-family target: one command, fixed seeds.

    python -m vllm_dspine.train --target DIR --corpus CORPUS --work WORK [--out DRAFT]
        [--preset smollm2] [--held-out-corpus EVAL] [--init-from DRAFT] [--steps N]
        [--out-packed PACKED] ...

Stages, each cached in WORK so a stopped run resumes where it was:
1. features: the target's layer outputs and top-k next-token distribution of every
   corpus shard (`train/feature_store.py`, memory-mapped bf16; shards added to the
   corpus since the last run are added here too);
2. loss vocabulary: the most frequent tokens of the corpus until `--vocab-coverage` of
   its tokens is covered (also the drafter's retrieval vocabulary);
3. drafter: initialised from the target's top layers (or `--init-from` a drafter of the
   same shape: training continues from it, its record's stages carried over), then block
   distillation (`train/loop.py`): the target's top-k distribution, the last write also
   trained on the true previous token (the tail's input on accepted prefixes), the first
   `--train-rows` rows of each block; with `--val-seqs` a validation split of the
   corpus is held out and the drafter of its best point is the one exported;
4. export: the drafter in bf16 with `training.json` (every stage: data size, steps,
   losses, held-out figures) and `loss.png`; held-out acceptance computed as vLLM serves
   it (bf16 weights, the retrieval vocabulary, the DSpine tail) on `--held-out-corpus`;
   with `--out-packed`, also packed as committed drafters are stored (`model/packed.py`),
   so `--init-from X --out-packed X` continues a committed drafter in place.

The corpus comes from `python -m vllm_dspine.train.corpus`; docs/training.md tells how to
train a drafter for another model, on one machine or several (torchrun).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
import time

import numpy as np
import torch

from vllm_dspine.train.corpus import coverage_vocab, covered_share

from vllm_dspine.config import ARCHITECTURE, MODEL_TYPE, DSpineConfig

PRESETS = {
    # SmolLM2-135M-Instruct (30 layers, H 576): the pair `python -m vllm_dspine.pairs
    # smollm2` writes. Mask token 16 is "<empty_output>", which its chat text never holds.
    "smollm2": {"layers": 3, "target_layers": "1,8,15,22,26", "mask_token_id": 16,
                "code_dim": 256, "message_dim": 128},
}


def _log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def default_target_layers(num_target_layers: int, draft_layers: int) -> tuple[int, ...]:
    """Five layers from 1 to the one just below the layers that seed the drafter."""
    last = num_target_layers - draft_layers - 1
    return tuple(sorted({round(1 + i * (last - 1) / 4) for i in range(5)}))


def draft_config_for(target_cfg, layers: int, code_dim: int, message_dim: int,
                     target_layers: tuple[int, ...], mask_token_id: int) -> DSpineConfig:
    """A drafter with the target's layer geometry (so its top layers can seed it)."""
    head_dim = getattr(target_cfg, "head_dim", None) or (
        target_cfg.hidden_size // target_cfg.num_attention_heads)
    return DSpineConfig.from_dict({
        "architectures": [ARCHITECTURE], "model_type": MODEL_TYPE,
        "hidden_size": target_cfg.hidden_size,
        "intermediate_size": target_cfg.intermediate_size, "num_hidden_layers": layers,
        "num_attention_heads": target_cfg.num_attention_heads,
        "num_key_value_heads": target_cfg.num_key_value_heads, "head_dim": head_dim,
        "rms_norm_eps": target_cfg.rms_norm_eps,
        "rope_theta": float(getattr(target_cfg, "rope_theta", None) or
                            target_cfg.rope_parameters["rope_theta"]),
        "max_position_embeddings": target_cfg.max_position_embeddings,
        "sliding_window": None, "vocab_size": target_cfg.vocab_size,
        "torch_dtype": "bfloat16",
        "dspine_config": {
            "block_size": 16, "target_layer_ids": list(target_layers),
            "mask_token_id": mask_token_id, "causal": True, "code_dim": code_dim,
            "message_dim": message_dim, "head_topk": 16, "coarse_topk": 128,
            "bridge_eps": 1e-6,
        },
    }, where="draft config")


def init_from_target(cfg: DSpineConfig, target, seed: int) -> dict[str, torch.Tensor]:
    """Draft layer l <- target layer (N - L + l) (Llama and Qwen3 names; Qwen3's QK-norm
    copied, Llama's absent one left at 1); fc <- identity on the last feature slice (the
    output of the layer below the copied ones: their own input in the target);
    hidden_norm <- the first copied layer's input norm; norm <- the target's final norm;
    the bridge random with small writes."""
    from vllm_dspine.model.checkpoint import random_draft_tensors

    w = random_draft_tensors(cfg, seed)
    sd = {k: v.detach().float() for k, v in target.state_dict().items()}
    N, L, H = target.config.num_hidden_layers, cfg.num_hidden_layers, cfg.hidden_size
    first = N - L
    for l in range(L):
        src = f"model.layers.{first + l}."
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                     "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
                     "input_layernorm", "post_attention_layernorm", "self_attn.q_norm",
                     "self_attn.k_norm"):
            if src + name + ".weight" in sd:
                w[f"layers.{l}.{name}.weight"] = sd[src + name + ".weight"].clone()
    F = cfg.num_target_features
    fc = torch.zeros(H, F * H)
    fc[:, (F - 1) * H:] = torch.eye(H)
    w["fc.weight"] = fc
    w["hidden_norm.weight"] = sd[f"model.layers.{first}.input_layernorm.weight"].clone()
    w["norm.weight"] = sd["model.norm.weight"].clone()
    return w


def load_corpus_data(corpus_dir: str, store: str, limit_shards: int | None = None):
    """The corpus shards that have features in `store` (of the corpus's first
    `limit_shards` when given), with their features (memory-mapped), top-k ids and
    log-probabilities per sequence."""
    from vllm_dspine.train.corpus import Corpus, first_shards
    from vllm_dspine.train.feature_store import FeatureStore

    shards = FeatureStore.shards_in(store)
    if limit_shards is not None:
        first = first_shards(corpus_dir, limit_shards)
        shards = [s for s in shards if s in first]
    corpus = Corpus(corpus_dir, shards)
    fs = FeatureStore(store, shards)
    feats, tids, tlp = [], [], []
    for si, shard in enumerate(shards):
        rows = [i for i, s in enumerate(corpus.shard_of) if s == shard]
        off = 0
        for i in rows:
            n = len(corpus.sequences[i])
            feats.append(fs.feats[si][off:off + n])
            tids.append(fs.topk_ids[si][off:off + n])
            tlp.append(fs.topk_logp[si][off:off + n])
            off += n
    return corpus, feats, tids, tlp


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m vllm_dspine.train",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--target", required=True, help="the target's Hugging Face folder")
    ap.add_argument("--corpus", required=True, help="corpus folder (train/corpus.py)")
    ap.add_argument("--shards", type=int, default=None,
                    help="train on the corpus's first N shards only (default: all); "
                         "features are computed for those alone")
    ap.add_argument("--work", required=True, help="working folder (features, state)")
    ap.add_argument("--out", default=None, help="the drafter's folder (default WORK/draft)")
    ap.add_argument("--no-lookup-corpus", dest="lookup_corpus", action="store_false",
                    help="do not write OUT/lookup_corpus.npz, the answers of this run's corpus "
                         "shards for DSpine's corpus lookup (docs/lookup.md)")
    ap.add_argument("--out-packed", default=None,
                    help="also write the drafter packed here (model/packed.py: the codebook "
                         "rows of the corpus's tokens, as the committed drafters are stored); "
                         "may be the --init-from folder itself")
    ap.add_argument("--held-out-corpus", default=None,
                    help="a corpus of other prompt sources for held-out figures")
    ap.add_argument("--held-out-seqs", type=int, default=24)
    ap.add_argument("--preset", choices=sorted(PRESETS), default=None)
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--code-dim", type=int, default=None)
    ap.add_argument("--message-dim", type=int, default=None)
    ap.add_argument("--target-layers", default=None, help="comma-separated layer ids")
    ap.add_argument("--mask-token-id", type=int, default=None)
    ap.add_argument("--init", choices=["target", "random"], default="target")
    ap.add_argument("--init-from", default=None,
                    help="continue from this drafter (a checkpoint or a packed folder)")
    ap.add_argument("--init-norm-scale", type=float, default=1.0,
                    help="--init target: the final norm's weight times this")
    ap.add_argument("--variant", choices=["full", "no-bridge"], default="full")
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--seqs-per-step", type=int, default=4)
    ap.add_argument("--blocks-per-seq", type=int, default=16)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--loss", choices=["soft", "hard"], default="soft",
                    help="soft: the target's top-k distribution; hard: the text's token")
    ap.add_argument("--topk", type=int, default=32)
    ap.add_argument("--tail-weight", type=float, default=1.0)
    ap.add_argument("--train-rows", type=int, default=None)
    ap.add_argument("--row-decay", type=float, default=7.0,  # DistillSettings.row_decay
                    help="loss weight of block row t: exp(-(t - 1) / ROW_DECAY) (7: DFlash's; "
                         "docs/training.md, 'Rows where the acceptance is')")
    ap.add_argument("--vocab-coverage", type=float, default=0.995)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--device", default="auto",
                    help="torch device of the features and the training (auto: the GPU "
                         "where one is visible, else cpu; under torchrun cuda:LOCAL_RANK)")
    ap.add_argument("--time-budget", type=float, default=None, metavar="SECONDS",
                    help="train as many of --steps as end SECONDS after this command "
                         "started (features included; for a machine lent for a fixed "
                         "time): fixed after the first timed steps and recorded, so "
                         "--steps with that number repeats the run")
    ap.add_argument("--val-seqs", type=int, default=0, metavar="N",
                    help="hold N corpus sequences out of training (a seeded choice) and "
                         "measure them (loss, drafts a block accepted) before the first "
                         "step, every --val-every steps and after the last; the drafter "
                         "exported is the best by --val-metric (--val-keep best) or the "
                         "last step's")
    ap.add_argument("--val-every", type=int, default=100, metavar="STEPS")
    ap.add_argument("--val-keep", choices=["best", "last"], default="best")
    ap.add_argument("--val-metric", choices=["accepted", "loss"], default="accepted")
    ap.add_argument("--feature-batch-tokens", type=int, default=4096,
                    help="padded tokens per target forward while computing features")
    ap.add_argument("--name", default=None, help="run name (WORK/train-NAME)")
    args = ap.parse_args(argv)
    preset = PRESETS.get(args.preset, {})
    for key in ("layers", "code_dim", "message_dim", "target_layers", "mask_token_id"):
        if getattr(args, key) is None and key in preset:
            setattr(args, key, preset[key])
    if args.threads:
        torch.set_num_threads(args.threads)
    from transformers import AutoConfig

    from vllm_dspine.cpu_env import set_cpu_defaults
    from vllm_dspine.model.checkpoint import save_draft_checkpoint
    from vllm_dspine.model.packed import (is_packed_drafter, load_drafter, pack_drafter,
                                          packed_row_ids)
    from vllm_dspine.train.feature_store import build_store
    from vllm_dspine.train.loop import DistillData, DistillSettings, distill
    from vllm_dspine.train.target_data import load_target

    set_cpu_defaults()
    t_start = time.time()
    work = os.path.abspath(args.work)
    # Under torchrun: rank 0 builds the feature store, the others wait for it, then every
    # rank trains on its share of each global batch (DDP, `train/loop.py`); rank 0 exports.
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and world > 1:
        device = f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
    if device.startswith("cuda:"):
        torch.cuda.set_device(torch.device(device))
    if world > 1:
        import torch.distributed as dist

        dist.init_process_group("nccl" if device.startswith("cuda") else "gloo")
    tcfg = AutoConfig.from_pretrained(args.target)
    if args.mask_token_id is None:
        raise ValueError("--mask-token-id is required without a --preset: the id of a "
                         "special token the target's text never contains")
    layers = args.layers or 3
    target_layers = (tuple(int(x) for x in args.target_layers.split(","))
                     if args.target_layers else default_target_layers(
                         tcfg.num_hidden_layers, layers))
    cfg = draft_config_for(tcfg, layers, args.code_dim or 256, args.message_dim or 128,
                           target_layers, args.mask_token_id)
    if args.init_from:
        # Loaded before the features are built (minutes to hours), so a drafter of another
        # shape is refused at once rather than as a missing tensor mid-training.
        init_cfg, init = load_drafter(args.init_from)
        differ = [f"{k} {getattr(init_cfg, k)} (this run: {getattr(cfg, k)})"
                  for k in ("num_hidden_layers", "hidden_size", "intermediate_size",
                            "code_dim", "message_dim")
                  if getattr(init_cfg, k) != getattr(cfg, k)]
        if tuple(init_cfg.target_layer_ids) != tuple(cfg.target_layer_ids):
            differ.append(f"target_layer_ids {tuple(init_cfg.target_layer_ids)} "
                          f"(this run: {tuple(cfg.target_layer_ids)})")
        if differ:
            raise ValueError(
                f"--init-from {args.init_from} is a drafter of another shape: "
                f"{', '.join(differ)}; pass the matching --layers / --code-dim / "
                f"--message-dim / --target-layers, or leave out --init-from to train a "
                f"new drafter")
    store = os.path.join(work, "features")
    if rank == 0:
        build_store(args.target, args.corpus, store, target_layers, args.topk, args.shards,
                    device, args.feature_batch_tokens)
    if world > 1:
        dist.barrier()
    corpus, feats, tids, tlp = load_corpus_data(args.corpus, store, args.shards)
    vocab = coverage_vocab(corpus.sequences, args.vocab_coverage, tcfg.vocab_size)
    _log(f"corpus: {len(corpus)} sequences, {corpus.answer_tokens()} answer tokens; "
         f"loss vocabulary {len(vocab)} ids")
    target = load_target(args.target)
    embed = target.model.embed_tokens.weight.detach().float()
    head = target.lm_head.weight.detach().float()
    record_prev: dict = {}
    kept_rows = torch.zeros(0, dtype=torch.long)  # codebook rows an --init-from kept packed
    if args.init_from:
        if is_packed_drafter(args.init_from):
            kept_rows = packed_row_ids(args.init_from)
        init = {k: v.float() for k, v in init.items()}
        if args.steps == 0 and init_cfg.retrieval_vocab is not None:
            # evaluation only: the drafter as it is served, with its own vocabulary
            vocab = torch.tensor(init_cfg.retrieval_vocab, dtype=torch.long)
        elif init_cfg.retrieval_vocab is not None:
            # A continued drafter keeps every id it could draft: its vocabulary grows
            # with new text and never shrinks to a run's fewer shards (which would lower
            # its coverage of held-out text).
            before = len(vocab)
            vocab = torch.unique(torch.cat([
                vocab.long(), torch.tensor(init_cfg.retrieval_vocab, dtype=torch.long)]))
            _log(f"loss vocabulary {len(vocab)} ids: this corpus's {before} and the "
                 f"--init-from drafter's {len(init_cfg.retrieval_vocab)}")
        prev = os.path.join(args.init_from, "training.json")
        if os.path.exists(prev):
            with open(prev) as f:
                record_prev = json.load(f)
    elif args.init == "target":
        init = init_from_target(cfg, target, args.seed)
        # The target's final norm on the copied layers' output gives confident logits
        # (first loss above a uniform guess): a smaller norm weight starts the drafter
        # unsure; training grows it where it pays (docs/smollm2-drafter.md, the figures).
        init["norm.weight"] = init["norm.weight"] * args.init_norm_scale
    else:
        from vllm_dspine.model.checkpoint import random_draft_tensors

        init = random_draft_tensors(cfg, args.seed)
    if len(vocab) < cfg.coarse_topk:
        # A small corpus (a test's, a first shard): retrieval's coarse pass takes the whole
        # vocabulary; a config listing fewer ids than it would be refused at load time.
        if len(vocab) < cfg.head_topk:
            raise ValueError(f"the loss vocabulary has {len(vocab)} ids, fewer than the "
                             f"drafter's head_topk ({cfg.head_topk}): train on more text "
                             f"(--corpus, --shards) or raise --vocab-coverage")
        cfg = dataclasses.replace(cfg, coarse_topk=len(vocab))
        _log(f"coarse_topk lowered to the vocabulary's {len(vocab)} ids")
    frozen: frozenset[str] = frozenset()
    if args.variant == "no-bridge":
        for l in range(cfg.num_hidden_layers):
            init[f"bridge.write.{l}.weight"] = torch.zeros_like(init[f"bridge.write.{l}.weight"])
        frozen = frozenset(n for n in init if n.startswith("bridge."))
    data = DistillData(ids=[torch.from_numpy(s) for s in corpus.sequences], feats=feats,
                       first_anchor=corpus.answer_start, topk_ids=tids, topk_logp=tlp,
                       vocab=vocab)
    settings = DistillSettings(steps=args.steps, seqs_per_step=args.seqs_per_step,
                               blocks_per_seq=args.blocks_per_seq, lr=args.lr,
                               seed=args.seed, soft=args.loss == "soft",
                               tail_weight=args.tail_weight if args.variant == "full" else 0.0,
                               train_rows=args.train_rows, row_decay=args.row_decay,
                               val_seqs=args.val_seqs,
                               val_every=args.val_every, keep_best=args.val_keep == "best",
                               val_metric=args.val_metric,
                               time_budget=None if args.time_budget is None else
                               args.time_budget - (time.time() - t_start))
    if settings.time_budget is not None and settings.time_budget <= 0:
        raise ValueError(f"--time-budget {args.time_budget:.0f} s is spent before training "
                         f"starts ({time.time() - t_start:.0f} s for features and set-up): "
                         f"give more")
    name = args.name or args.variant
    train_dir = os.path.join(work, f"train-{name}")
    _log(f"distilling {name}: {settings}")
    tensors, stats = distill(cfg, init, embed, head, data, settings, train_dir, frozen=frozen,
                             device=device)
    if rank != 0:
        return 0
    out = os.path.abspath(args.out or os.path.join(work, f"draft-{name}"))
    os.makedirs(out, exist_ok=True)
    cfg = dataclasses.replace(cfg, retrieval_vocab=tuple(vocab.tolist()))
    bf16 = {k: v.to(torch.bfloat16) for k, v in tensors.items()}
    save_draft_checkpoint(out, cfg, bf16)
    if args.variant == "no-bridge":
        from vllm_dspine.model.checkpoint import save_dflash_checkpoint

        save_dflash_checkpoint(out + "-dflash", cfg, bf16)
    stage = {"date": time.strftime("%Y-%m-%d"), "command": "python -m vllm_dspine.train " +
             " ".join(argv if argv is not None else sys.argv[1:]),
             "corpus_shards": len(set(corpus.shard_of)), "sequences": len(corpus),
             "answer_tokens": corpus.answer_tokens(), "loss_vocab": len(vocab),
             "settings": dataclasses.asdict(settings), **stats}
    if args.held_out_corpus:
        held_store = os.path.join(work, "features-held-out")
        build_store(args.target, args.held_out_corpus, held_store, target_layers, args.topk,
                    device=device, batch_tokens=args.feature_batch_tokens)
        ho, hf, _, _ = load_corpus_data(args.held_out_corpus, held_store)
        stage["held_out"] = held_out_acceptance(
            cfg, {k: v.float() for k, v in bf16.items()}, embed, head, vocab, ho, hf,
            args.held_out_seqs)
        stage["held_out"]["vocab_coverage"] = covered_share(
            ho.answers(), vocab, tcfg.vocab_size)
        _log(f"held out: {json.dumps(stage['held_out'])}")
    if os.path.exists(os.path.join(train_dir, "loss.png")):  # none after --steps 0
        shutil.copyfile(os.path.join(train_dir, "loss.png"), os.path.join(out, "loss.png"))
    stages = record_stages(record_prev)
    if args.steps == 0 and args.init_from and stages and "held_out" in stage:
        # An evaluation trains nothing: its figures belong to the stage that made the
        # drafter (a GPU stage's, say, computed later on a CPU), with the command that
        # measured them.
        stages[-1] = {**stages[-1], "held_out": stage["held_out"],
                      "held_out_command": stage["command"], "held_out_date": stage["date"]}
    else:
        stages.append(stage)
    record = {"variant": args.variant, "stages": stages,
              "wall_seconds_this_run": round(time.time() - t_start, 1)}
    with open(os.path.join(out, "training.json"), "w") as f:
        json.dump(record, f, indent=2)
    if args.lookup_corpus:
        # The corpus lookup's text (docs/lookup.md "The corpus lookup"): this run's
        # answers, beside the drafter that learned them (copied when packed).
        from vllm_dspine.model.lookup_corpus import LOOKUP_CORPUS_FILE, write_lookup_corpus

        lc = write_lookup_corpus(corpus.answers(), os.path.join(out, LOOKUP_CORPUS_FILE))
        _log(f"lookup corpus: {lc}")
    if args.out_packed:
        # The rows training moved (every token of the corpus read, the loss vocabulary)
        # and those the starting drafter kept: nothing it had learned is dropped.
        rows = torch.cat([torch.from_numpy(corpus.token_ids()), vocab.long(), kept_rows])
        packed = pack_drafter(out, args.out_packed, rows)
        _log(f"packed into {args.out_packed}: {packed}")
    _log(json.dumps(stage, indent=2, default=str)[:4000])
    return 0


def record_stages(record: dict) -> list[dict]:
    """The stages of a drafter's `training.json`; a record from before stages were kept
    (the 2026-12-01 SmolLM2 drafter's: one flat dict) is its single stage."""
    if not record:
        return []
    return list(record["stages"]) if "stages" in record else [record]


def held_out_acceptance(cfg, w, embed, head, vocab, corpus, feats, limit: int) -> dict:
    """Greedy acceptance offline as vLLM serves it (bf16 weights `w`, the retrieval
    vocabulary, the tail) on the greedy sequences of a held-out corpus (at most `limit`),
    averaged over sequences; by prompt source too."""
    from vllm_dspine.train.acceptance import greedy_acceptance
    from vllm_dspine.train.feature_store import bf16_from_bits

    greedy = [i for i in range(len(corpus)) if corpus.temperature[i] == 0.0]
    sources = sorted({corpus.source[i] for i in greedy})
    per_source = -(-limit // max(1, len(sources)))  # the same number from every source
    rows = [i for src in sources
            for i in [j for j in greedy if corpus.source[j] == src][:per_source]]
    per: dict[str, list[float]] = {}
    by_source: dict[str, list[float]] = {}
    for i in rows:
        x = torch.from_numpy(corpus.sequences[i])
        p = corpus.answer_start[i]
        if len(x) < p + cfg.block_size + 1:
            continue
        f = bf16_from_bits(np.asarray(feats[i]))
        st = greedy_acceptance(cfg, w, embed, head, x[None], f[None], p, tail=True,
                               vocab=vocab)
        for k, v in st.items():
            per.setdefault(k, []).append(v)
        by_source.setdefault(corpus.source[i], []).append(st["acceptance_tail_decode"])
    out = {k: (np.mean(v, axis=0).tolist() if isinstance(v[0], list) else float(np.mean(v)))
           for k, v in per.items()}
    out["sequences"] = len(per.get("eval_loss", []))
    out["tail_decode_by_source"] = {k: float(np.mean(v)) for k, v in by_source.items()}
    return out


if __name__ == "__main__":
    sys.exit(main())
