"""The distillation recipe on the tiny pair, without an engine: the corpus shards and
their provenance, the feature store, distillation to the target's top-k distribution,
the last write trained on the true previous token exactly as the serial tail scores it,
training fewer block rows, the loss vocabulary by coverage, and the general command.

    S sequences, T length, nb blocks per sequence, B block size, K = B - 1, k top-k.
"""

import json
import math
import os

import numpy as np
import pytest
import torch

from vllm_dspine.kernels.bridge_ref import BridgeWeights  # noqa: F401  (tail weights below)
from vllm_dspine.model.checkpoint import random_draft_tensors, tail_weights
from vllm_dspine.model.drafter import block_forward, last_write_with_predecessor
from vllm_dspine.pairs.tiny import draft_config, write_tiny_pair
from vllm_dspine.train import corpus as C
from vllm_dspine.train.loop import (IGNORE, BlockTargets, DistillData, DistillSettings,
                                    block_labels, block_loss, distill, row_weights,
                                    sample_batch, soft_targets)
from vllm_dspine.train.target_data import generate_text, load_target

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return write_tiny_pair(str(tmp_path_factory.mktemp("tiny")), seed=0)


@pytest.fixture(scope="module")
def target(pair):
    return load_target(pair.target_dir)


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory, target):
    """A two-shard corpus of the tiny target's own text (written without vLLM: the
    shard format is what is under test here)."""
    folder = str(tmp_path_factory.mktemp("corpus"))
    ids = generate_text(target, 8, 6, 34, 0.5, torch.Generator().manual_seed(1))  # [8, 40]
    manifest = C.read_manifest(folder)
    for k in range(2):
        rows = range(4 * k, 4 * k + 4)
        seqs = [ids[i, :30 + i].tolist() for i in rows]
        entry = C.write_shard(folder, f"shard-{k:05d}.npz", seqs, [6] * 4,
                              ["self", "debian", "python", "docs"],
                              [f"test:{i}#{C.prompt_hash(str(i))}" for i in rows],
                              [0.0, 0.0, 0.7, 0.7], vocab_size=target.config.vocab_size)
        manifest["shards"].append(entry)
    C._write_manifest(folder, manifest)
    return folder


def test_corpus_shards_round_trip(corpus_dir, target):
    corpus = C.Corpus(corpus_dir)
    assert len(corpus) == 8
    assert [len(s) for s in corpus.sequences] == [30 + i for i in range(8)]
    assert corpus.source[:4] == ["self", "debian", "python", "docs"]
    assert corpus.temperature[2] == pytest.approx(0.7)
    assert corpus.answer_tokens() == sum(30 + i - 6 for i in range(8))
    m = C.read_manifest(corpus_dir)
    assert [s["file"] for s in m["shards"]] == ["shard-00000.npz", "shard-00001.npz"]
    assert m["shards"][0]["by_source"] == {"self": 1, "debian": 1, "python": 1, "docs": 1}
    # `--shards N` (features and training alike) takes the first N in the order added
    assert C.first_shards(corpus_dir) == ["shard-00000.npz", "shard-00001.npz"]
    assert C.first_shards(corpus_dir, 1) == ["shard-00000.npz"]


def test_shard_prompts_take_shares_and_never_repeat():
    static = {"debian": [(f"d{i}", f"debian prompt {i}") for i in range(300)],
              "python": [(f"p{i}", f"python prompt {i}") for i in range(300)],
              "docs": [(f"x{i}", f"doc prompt {i}") for i in range(5)]}  # runs short
    seen: set[str] = set()
    shards = [C.shard_prompts(k, 100, static, [(f"s{k}.{i}", f"self {k} {i}")
                                                for i in range(40)], seen)
              for k in range(3)]
    for k, shard in enumerate(shards):
        assert len(shard) == 100
        by = {s: sum(1 for x in shard if x[0] == s) for s in C.SOURCES}
        # docs has 5 prompts in all: shard 0 takes them, the others fill its place
        assert by["self"] >= 35 and by["debian"] >= 25 and by["python"] >= 30
        assert by["docs"] == (5 if k == 0 else 0)
    prompts = [p for shard in shards for _, _, p in shard]
    assert len(prompts) == len(set(prompts)), "a prompt was used twice"
    keys = [key for shard in shards for _, key, _ in shard]
    assert all("#" in key for key in keys)  # provenance key + prompt hash


def test_shard_prompts_take_given_shares():
    """--shares: a chat-heavy mix takes its quotas (self 60, debian 15, python 20, docs
    5 of 100); bad mixes are refused by name."""
    static = {"debian": [(f"d{i}", f"debian prompt {i}") for i in range(300)],
              "python": [(f"p{i}", f"python prompt {i}") for i in range(300)],
              "docs": [(f"x{i}", f"doc prompt {i}") for i in range(300)]}
    shares = C.parse_shares("self=0.6,debian=0.15,python=0.2,docs=0.05")
    shard = C.shard_prompts(1, 100, static, [(f"s{i}", f"self {i}") for i in range(80)],
                            set(), shares)
    by = {s: sum(1 for x in shard if x[0] == s) for s in C.TRAIN_SOURCES}
    assert by == {"self": 60, "debian": 15, "python": 20, "docs": 5}
    for bad, why in [("self=0.6,debian=0.4", "give every source"),
                     ("self=0.5,debian=0.2,python=0.2,docs=0.2", "summing to 1"),
                     ("self=0.6,chat=0.15,python=0.2,docs=0.05", "'chat' is not"),
                     ("self=x,debian=0.15,python=0.2,docs=0.05", "is not a number")]:
        with pytest.raises(ValueError, match=why):
            C.parse_shares(bad)


def test_feature_store_matches_the_target(corpus_dir, target, pair, tmp_path):
    from vllm_dspine.train.feature_store import FeatureStore, bf16_from_bits, build_store
    from vllm_dspine.train.target_data import target_features

    cfg = draft_config()
    store = str(tmp_path / "store")
    index = build_store(pair.target_dir, corpus_dir, store, cfg.target_layer_ids, topk=8)
    assert [s["shard"] for s in index["shards"]] == ["shard-00000.npz", "shard-00001.npz"]
    # a second call adds nothing (and does not load the target)
    assert build_store(pair.target_dir, corpus_dir, store, cfg.target_layer_ids, 8) == index
    fs = FeatureStore(store, FeatureStore.shards_in(store))
    corpus = C.Corpus(corpus_dir)
    seq = torch.from_numpy(corpus.sequences[5])  # shard 1, second sequence
    off = len(corpus.sequences[4])
    feats = bf16_from_bits(fs.feats[1][off:off + len(seq)])
    ref = target_features(target, seq[None], cfg.target_layer_ids)[0]
    torch.testing.assert_close(feats, ref.to(torch.bfloat16).float(), atol=0, rtol=0)
    logits = target(input_ids=seq[None]).logits[0].float()
    top = torch.log_softmax(logits, -1).topk(8, -1)
    assert torch.equal(torch.from_numpy(np.asarray(fs.topk_ids[1][off:off + len(seq)])).long(),
                       top.indices)
    torch.testing.assert_close(
        torch.from_numpy(np.asarray(fs.topk_logp[1][off:off + len(seq)])).float(),
        top.values, atol=2e-3, rtol=2e-3)  # stored in float16
    with pytest.raises(ValueError, match="another --store"):
        build_store(pair.target_dir, corpus_dir, store, cfg.target_layer_ids, topk=4)


def test_transformers_engine_generates_what_the_target_decodes(pair, target):
    """The corpus engine for machines without vLLM (`TransformersEngine`, a GPU's):
    left-padded batches of unequal prompts decode greedily exactly what one unpadded
    sequence decodes token by token, an answer ends after its first end-of-sequence
    token (kept), and sampled answers are repeatable under the same seed."""
    from vllm_dspine.train.target_data import TransformersEngine

    eng = TransformersEngine(pair.target_dir, "cpu", batch_size=3)
    eng.model = target  # the module fixture's copy: same weights
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(32, 127, (n,), generator=gen).tolist() for n in (3, 9, 5, 12)]
    eos = int(eng.eos[0])
    out = eng.generate(prompts, 10, [0.0] * 4, seed=0)
    for p, new in zip(prompts, out):
        cur = list(p)
        with torch.no_grad():
            for _ in range(10):
                cur.append(int(target(input_ids=torch.tensor([cur])).logits[0, -1].argmax()))
                if cur[-1] == eos:
                    break
        assert new == cur[len(p):]
        assert eos not in new[:-1]
    temps = [0.7, 1.0, 0.0, 0.7]
    a, b = eng.generate(prompts, 10, temps, seed=3), eng.generate(prompts, 10, temps, seed=3)
    assert a == b and a[2] == out[2] and len(a[0]) >= 1


def test_soft_targets_read_the_distribution_that_predicted_each_row():
    """Row t of the block anchored at p is the token at p + t; the target predicted it
    at position p + t - 1, so that position's top-k is its target."""
    T, k, V = 12, 3, 10
    topk_ids = torch.arange(T)[None, :, None].expand(1, T, k) % V  # [1, T, k] id = position
    topk_ids = (topk_ids + torch.tensor([0, 1, 2])) % V
    topk_logp = torch.log(torch.tensor([0.5, 0.3, 0.2])).expand(1, T, k)
    remap = torch.arange(V)
    remap[9] = IGNORE  # id 9 is outside the loss vocabulary
    ids, probs = soft_targets(topk_ids, topk_logp, torch.tensor([[2, 5]]), 4, remap)
    assert ids.shape == (1, 2, 3, k)
    # block at anchor 2, row 1: position 2's top-k = ids 2, 3, 4
    assert ids[0, 0, 0].tolist() == [2, 3, 4]
    torch.testing.assert_close(probs[0, 0, 0], torch.tensor([0.5, 0.3, 0.2]))
    # block at anchor 5, row 3: position 7's top-k = 7, 8, 9 with 9 dropped, renormalised
    assert ids[0, 1, 2].tolist() == [7, 8, IGNORE]
    torch.testing.assert_close(probs[0, 1, 2], torch.tensor([0.625, 0.375, 0.0]))


@pytest.fixture(scope="module")
def trained_like(target):
    """Drafter tensors with a non-trivial bridge (random writes scaled up) and one text."""
    cfg = draft_config()
    w = random_draft_tensors(cfg, seed=3)
    for l in range(cfg.num_hidden_layers):
        w[f"bridge.write.{l}.weight"] = w[f"bridge.write.{l}.weight"] * 50
    ids = generate_text(target, 2, 6, 26, 1.0, torch.Generator().manual_seed(4))  # [2, 32]
    from vllm_dspine.train.target_data import target_features

    feats = target_features(target, ids, cfg.target_layer_ids)
    embed = target.model.embed_tokens.weight.detach().float()
    head = target.lm_head.weight.detach().float()
    return cfg, w, ids, feats, embed, head


def test_training_write_is_what_the_tail_scores(trained_like):
    """`last_write_with_predecessor` with predecessor u, dotted with head[v], is the
    serial tail's S_t(u, v) (`kernels/tail_ref.tail_score_tables_ref`): training the
    last write on the true previous token trains exactly what serving scores."""
    from vllm_dspine.kernels.tail_ref import LastWriteInputs, tail_score_tables_ref

    cfg, w, ids, feats, embed, head = trained_like
    anchors = torch.tensor([[7, 12], [9, 15]])
    out = block_forward(cfg, w, embed, head, ids, feats, anchors)
    S, nb, B = 2, 2, cfg.block_size
    gen = torch.Generator().manual_seed(0)
    cand = torch.randint(0, head.shape[0], (S * nb, B - 1, 16), generator=gen)  # [R, K, k]
    inputs = LastWriteInputs(pre_write_state=out.pre_write_state.reshape(S * nb, B, -1),
                             codes=out.last_codes.reshape(S * nb, B, -1),
                             rms=out.last_rms.reshape(S * nb, B),
                             anchor_ids=ids.gather(1, anchors).reshape(-1))
    weights = tail_weights(cfg, w, head)
    table = tail_score_tables_ref(inputs, cand, weights, dtype=torch.float64)  # [R, K, k, k]
    # predecessor of row t (t >= 2) = candidate i = 3 of row t - 1; row 1's = the anchor
    i = 3
    pred = torch.empty(S * nb, B, dtype=torch.long)
    pred[:, 0] = inputs.anchor_ids
    pred[:, 1] = inputs.anchor_ids
    pred[:, 2:] = cand[:, :-1, i]
    final = last_write_with_predecessor(cfg, w, out, pred.view(S, nb, B)).reshape(S * nb, B, -1)
    scores = torch.einsum("rth,rtjh->rtj", final[:, 1:].double(),
                          head[cand].double())  # [R, K, k]
    torch.testing.assert_close(scores[:, 1:], table[:, 1:, i], atol=2e-4, rtol=2e-4)
    torch.testing.assert_close(scores[:, 0], table[:, 0, 0], atol=2e-4, rtol=2e-4)


def test_training_fewer_rows_gives_those_rows_the_same_loss(trained_like):
    """Rows are causal inside a block: a block of 1 + R rows computes rows 1..R exactly
    as the full block does, so `train_rows` changes cost, not what those rows learn."""
    import dataclasses

    cfg, w, ids, feats, embed, head = trained_like
    anchors = torch.tensor([[7, 12], [9, 15]])
    full = block_forward(cfg, w, embed, head, ids, feats, anchors)
    short_cfg = dataclasses.replace(cfg, block_size=6)
    short = block_forward(short_cfg, w, embed, head, ids, feats, anchors)
    torch.testing.assert_close(short.logits, full.logits[:, :, :6], atol=1e-4, rtol=1e-4)


def test_tail_loss_enters_block_loss(trained_like):
    """tail_weight adds the discrete-predecessor loss of rows 2..K; 0 leaves the
    continuous loss alone; the soft loss at a one-hot target is the hard loss."""
    cfg, w, ids, feats, embed, head = trained_like
    anchors = torch.tensor([[7, 12], [9, 15]])
    labels = block_labels(ids, anchors, cfg.block_size)
    weights = row_weights(cfg.block_size, 7.0)
    hard = BlockTargets(labels)
    base = block_loss(cfg, w, embed, head, ids, feats, anchors, hard, weights)
    with_tail = block_loss(cfg, w, embed, head, ids, feats, anchors, hard, weights,
                           tail_weight=0.5)
    assert with_tail > base
    one_hot = BlockTargets(labels, labels[..., None].clamp(min=0),
                           (labels[..., None] != IGNORE).float())
    soft = block_loss(cfg, w, embed, head, ids, feats, anchors, one_hot, weights)
    torch.testing.assert_close(soft, base, atol=1e-4, rtol=1e-5)


def test_coverage_vocab():
    from vllm_dspine.train.corpus import coverage_vocab, covered_share

    texts = [np.array([1, 1, 1, 1, 2, 2, 3, 4, 5, 1])]  # 1: 50 %, 2: 20 %, rest 10 % each
    assert coverage_vocab(texts, 0.5, 8).tolist() == [1]
    assert coverage_vocab(texts, 0.7, 8).tolist() == [1, 2]
    assert coverage_vocab(texts, 0.75, 8).tolist() == [1, 2, 3]
    assert covered_share(texts, torch.tensor([1, 2]), 8) == pytest.approx(0.7)



def test_coverage_growth_table(corpus_dir, pair, capsys):
    """The corpus's vocabulary against held-out answers, shard by shard: here the held-out
    corpus is the corpus itself, so all its shards cover it whole and one shard covers
    exactly the share of answer tokens whose ids shard 0 holds (computed by hand)."""
    rows = C.coverage_growth(corpus_dir, corpus_dir, vocab_size=512)  # the tiny target's
    assert [r["shards"] for r in rows] == [1, 2]
    assert rows[-1]["held_out_covered"] == pytest.approx(1.0)
    corpus = C.Corpus(corpus_dir)
    answers = [s[a:] for s, a in zip(corpus.sequences, corpus.answer_start)]
    seen0 = set(np.concatenate(corpus.sequences[:4]).tolist())
    inside = sum(int(t in seen0) for a in answers for t in a.tolist())
    assert rows[0]["held_out_covered"] == pytest.approx(inside / sum(len(a) for a in answers))
    assert rows[0]["answer_tokens"] == sum(len(a) for a in answers[:4])
    assert rows[1]["ids"] == len(set(np.concatenate(corpus.sequences).tolist()))
    assert C.main(["--target", pair.target_dir, "--corpus", corpus_dir,
                   "--coverage-of", corpus_dir]) == 0
    out = capsys.readouterr().out
    assert "| 2 |" in out and "100.0 %" in out


def test_general_command_trains_exports_and_continues(corpus_dir, pair, tmp_path):
    """`python -m vllm_dspine.train` on the tiny corpus: features, training (soft loss,
    tail loss, fewer rows), a loadable bf16 drafter with its retrieval vocabulary and a
    record; a second run from that drafter keeps the first stage in its record and the
    first run's vocabulary."""
    from vllm_dspine.model.checkpoint import load_draft_checkpoint
    from vllm_dspine.train.__main__ import main

    cfg = draft_config()
    common = ["--target", pair.target_dir, "--corpus", corpus_dir, "--work",
              str(tmp_path / "work"), "--held-out-corpus", corpus_dir,
              "--layers", str(cfg.num_hidden_layers), "--code-dim", str(cfg.code_dim),
              "--message-dim", str(cfg.message_dim), "--target-layers",
              ",".join(map(str, cfg.target_layer_ids)),
              "--mask-token-id", str(cfg.mask_token_id), "--topk", "8",
              "--seqs-per-step", "2", "--blocks-per-seq", "2", "--train-rows", "5",
              "--held-out-seqs", "2", "--vocab-coverage", "1.0"]
    out1 = str(tmp_path / "d1")
    assert main(common + ["--steps", "2", "--out", out1, "--init", "random"]) == 0
    dcfg, tensors = load_draft_checkpoint(out1)
    assert dcfg.block_size == 16 and dcfg.retrieval_vocab is not None
    assert all(t.dtype == torch.bfloat16 for t in tensors.values())
    rec = json.load(open(os.path.join(out1, "training.json")))
    assert len(rec["stages"]) == 1 and rec["stages"][0]["steps"] == 2
    ho = rec["stages"][0]["held_out"]
    assert ho["vocab_coverage"] == pytest.approx(1.0)
    assert len(ho["tail_accept_by_position"]) == 15
    out2 = str(tmp_path / "d2")
    # continued on the first shard only (`--shards 1`): the store keeps both shards'
    # features, the run reads shard 0's four sequences alone, one of them held out as
    # the validation split
    assert main(common + ["--steps", "1", "--out", out2, "--init-from", out1,
                          "--name", "again", "--shards", "1", "--val-seqs", "1",
                          "--val-every", "1"]) == 0
    rec2 = json.load(open(os.path.join(out2, "training.json")))
    assert len(rec2["stages"]) == 2 and rec2["stages"][0] == rec["stages"][0]
    val = rec2["stages"][1]["val"]
    assert val["seqs"] == 1 and [p["step"] for p in val["points"]] == [0, 1]
    assert val["returned"] == "best" and val["metric"] == "accepted"
    assert "val" not in rec["stages"][0]  # none without --val-seqs
    # a drafter of another layer count is refused by name before anything is trained
    with pytest.raises(ValueError, match="another shape: num_hidden_layers"):
        main(common + ["--steps", "1", "--out", str(tmp_path / "bad"), "--init-from", out1,
                       "--layers", str(dcfg.num_hidden_layers + 1)])
    assert not os.path.exists(tmp_path / "bad")
    assert rec["stages"][0]["sequences"] == 8
    assert rec2["stages"][1]["sequences"] == 4 and rec2["stages"][1]["corpus_shards"] == 1
    # beside each drafter, the corpus lookup's text: the answers of the run's shards
    from vllm_dspine.proposer.corpus_lookup import CorpusIndex

    corpus = C.Corpus(corpus_dir)
    answers = corpus.answers()
    assert CorpusIndex.load(os.path.join(out1, "lookup_corpus.npz")).num_tokens == \
        sum(map(len, answers)) == corpus.answer_tokens()
    assert CorpusIndex.load(os.path.join(out2, "lookup_corpus.npz")).num_tokens == \
        sum(map(len, answers[:4]))
    # continued on fewer shards, the drafter keeps its vocabulary (both shards' ids)
    dcfg2, _ = load_draft_checkpoint(out2)
    assert dcfg2.retrieval_vocab == dcfg.retrieval_vocab
    assert dcfg2.coarse_topk == dcfg.coarse_topk
    # a new drafter on one shard: it has fewer distinct ids than retrieval's coarse pass
    # takes, so the exported config lowers coarse_topk to them instead of writing a
    # folder no loader accepts
    small = str(tmp_path / "small")
    assert main(common + ["--steps", "1", "--out", small, "--init", "random",
                          "--name", "small", "--shards", "1"]) == 0
    scfg, _ = load_draft_checkpoint(small)
    assert set(scfg.retrieval_vocab) < set(dcfg.retrieval_vocab)
    assert scfg.coarse_topk == len(scfg.retrieval_vocab) < dcfg.coarse_topk
    # an evaluation (--steps 0) trains nothing: its held-out figures replace the last
    # stage's, with the command that measured them, and no stage is added
    out3 = str(tmp_path / "d3")
    assert main(common + ["--steps", "0", "--out", out3, "--init-from", out2,
                          "--name", "eval"]) == 0
    rec3 = json.load(open(os.path.join(out3, "training.json")))
    assert len(rec3["stages"]) == 2 and rec3["stages"][0] == rec2["stages"][0]
    last, before = rec3["stages"][1], rec2["stages"][1]
    assert "--steps 0" in last["held_out_command"] and "held_out_command" not in before
    assert {k: v for k, v in last.items() if not k.startswith("held_out")} == \
        {k: v for k, v in before.items() if k != "held_out"}
    assert last["held_out"].keys() == before["held_out"].keys()


def test_general_command_continues_a_packed_drafter_in_place(corpus_dir, pair, tmp_path):
    """`--out-packed` stores the drafter as committed drafters are (model/packed.py): the
    codebook rows of every token the run read plus its vocabulary, the rest zero; and
    `--init-from P --out-packed P` continues a packed drafter in place, its record grown
    by one stage and the rows it kept not dropped when the next run reads fewer tokens."""
    from vllm_dspine.model.checkpoint import load_draft_checkpoint
    from vllm_dspine.model.packed import PACKED, is_packed_drafter, load_drafter
    from vllm_dspine.train.__main__ import main

    cfg = draft_config()
    common = ["--target", pair.target_dir, "--corpus", corpus_dir, "--work",
              str(tmp_path / "work"), "--layers", str(cfg.num_hidden_layers),
              "--code-dim", str(cfg.code_dim), "--message-dim", str(cfg.message_dim),
              "--target-layers", ",".join(map(str, cfg.target_layer_ids)),
              "--mask-token-id", str(cfg.mask_token_id), "--topk", "8",
              "--seqs-per-step", "2", "--blocks-per-seq", "2", "--train-rows", "5",
              "--vocab-coverage", "1.0"]
    packed = str(tmp_path / "packed")
    out1 = str(tmp_path / "d1")
    assert main(common + ["--steps", "2", "--out", out1, "--init", "random",
                          "--out-packed", packed]) == 0
    assert is_packed_drafter(packed)
    assert not [f for f in os.listdir(packed) if f.endswith(".safetensors")]
    full_cfg, full = load_draft_checkpoint(out1)
    pcfg, pk = load_drafter(packed)
    assert pcfg.retrieval_vocab == full_cfg.retrieval_vocab
    corpus = C.Corpus(corpus_dir)
    seen = torch.from_numpy(np.unique(np.concatenate(corpus.sequences))).long()
    kept = torch.nonzero(pk["bridge.codebook"].abs().sum(-1)).flatten()
    assert set(kept.tolist()) == set(seen.tolist()) | set(full_cfg.retrieval_vocab)
    assert torch.equal(pk["bridge.codebook"][kept], full["bridge.codebook"][kept])
    for name, t in full.items():
        if name != "bridge.codebook":
            assert torch.equal(pk[name], t), name
    size = os.path.getsize(os.path.join(packed, PACKED))
    # continue in place on the first shard only: shard 1's rows must stay kept
    assert main(common + ["--steps", "1", "--out", str(tmp_path / "d2"), "--init-from",
                          packed, "--out-packed", packed, "--shards", "1",
                          "--name", "again"]) == 0
    _, pk2 = load_drafter(packed)
    kept2 = torch.nonzero(pk2["bridge.codebook"].abs().sum(-1)).flatten()
    assert set(kept.tolist()) <= set(kept2.tolist())
    assert os.path.getsize(os.path.join(packed, PACKED)) >= size
    rec = json.load(open(os.path.join(packed, "training.json")))
    assert [s["sequences"] for s in rec["stages"]] == [8, 4]
    assert not torch.equal(pk2["fc.weight"], pk["fc.weight"])  # it trained


def test_a_flat_record_is_kept_as_the_first_stage():
    """The committed SmolLM2 drafter's record predates `stages`: a run continuing from it
    keeps it whole as stage one instead of dropping it."""
    from vllm_dspine.train.__main__ import record_stages

    flat = {"command": "python -m vllm_dspine.train.smollm2 ...", "steps": 1200}
    assert record_stages(flat) == [flat]
    assert record_stages({"variant": "full", "stages": [flat, {"steps": 2}]}) == [
        flat, {"steps": 2}]
    assert record_stages({}) == []


def test_committed_corpus_is_complete_and_clean():
    """Every shard the committed manifest lists is in the tree with the counts it
    records, its prompts come from training sources only (never a benchmark), and no
    prompt repeats across shards."""
    folder = os.path.join(os.path.dirname(__file__), "..", "data", "corpus", "smollm2")
    manifest = C.read_manifest(folder)
    assert manifest["shards"], "no committed corpus"
    corpus = C.Corpus(folder)
    assert len(corpus) == sum(s["sequences"] for s in manifest["shards"])
    assert corpus.answer_tokens() == sum(s["answer_tokens"] for s in manifest["shards"])
    assert set(corpus.source) <= set(C.TRAIN_SOURCES)
    hashes = [k.split("#")[-1] for k in corpus.key]
    assert len(hashes) == len(set(hashes)), "a prompt appears in two shards"
    assert all(0 < a < len(s) for s, a in zip(corpus.sequences, corpus.answer_start))
