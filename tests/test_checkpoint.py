"""Draft checkpoint format (docs/design.md section 2): table, loader refusals, writer round
trip."""

import copy
import json
import os

import pytest
import torch
from safetensors.torch import save_file

from vllm_dspine.model.checkpoint import (
    INDEX_NAME,
    bridge_weights,
    check_target_fits,
    expected_tensor_shapes,
    load_draft_checkpoint,
    random_draft_tensors,
    save_draft_checkpoint,
)
from vllm_dspine.config import RELEASED_QWEN38_27B, DSpineConfig
from vllm_dspine.kernels.bridge_ref import code_bridge_ref

# Small but awkward sizes: 3 layers, F=2, vocab not a power of two.
SMALL = {
    "architectures": ["DSpineDraftModel"], "model_type": "dspine",
    "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 3,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 1024,
    "sliding_window": 256, "vocab_size": 301, "torch_dtype": "float32",
    "dspine_config": {
        "block_size": 16, "target_layer_ids": [0, 2], "mask_token_id": 300,
        "causal": True, "code_dim": 40, "message_dim": 20, "head_topk": 16,
        "coarse_topk": 32, "bridge_eps": 1e-6,
    },
}


@pytest.fixture
def cfg() -> DSpineConfig:
    return DSpineConfig.from_dict(copy.deepcopy(SMALL))


def _write_raw(path, cfg, tensors):
    """Write a folder without the writer's checks, to build broken checkpoints."""
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg.to_dict(), f)
    save_file(tensors, os.path.join(path, "model.safetensors"))


# ------------------------------------------------------------------------------ table
def test_table_released_dims():
    cfg = DSpineConfig.from_dict(RELEASED_QWEN38_27B)
    shapes = expected_tensor_shapes(cfg)
    L = 5
    assert len(shapes) == 2 + 11 * L + 1 + 1 + L + 4 + L
    assert shapes["fc.weight"] == (5120, 5 * 5120)
    assert shapes["layers.4.self_attn.q_proj.weight"] == (32 * 128, 5120)
    assert shapes["layers.0.self_attn.k_proj.weight"] == (8 * 128, 5120)
    assert shapes["layers.2.self_attn.o_proj.weight"] == (5120, 32 * 128)
    assert shapes["layers.1.self_attn.k_norm.weight"] == (128,)
    assert shapes["layers.3.mlp.down_proj.weight"] == (5120, 17408)
    assert shapes["bridge.codebook"] == (248320, 1024)
    assert shapes["bridge.read.4.weight"] == (1024, 5120)
    assert shapes["bridge.gate_pred.weight"] == (512, 1024)
    assert shapes["bridge.gate_bias"] == (512,)
    assert shapes["bridge.write.0.weight"] == (5120, 512)
    assert "layers.5.input_layernorm.weight" not in shapes


# ------------------------------------------------------------------------- round trip
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("max_shard_bytes", [None, 20_000], ids=["single", "sharded"])
def test_round_trip_bit_exact(tmp_path, cfg, dtype, max_shard_bytes):
    tensors = random_draft_tensors(cfg, seed=3, dtype=dtype)
    files = save_draft_checkpoint(str(tmp_path), cfg, tensors, max_shard_bytes=max_shard_bytes)
    if max_shard_bytes is None:
        assert files == ["model.safetensors"]
        assert not (tmp_path / INDEX_NAME).exists()
    else:
        assert len(files) > 3
        index = json.loads((tmp_path / INDEX_NAME).read_text())
        assert set(index["weight_map"]) == set(tensors)
    cfg2, loaded = load_draft_checkpoint(str(tmp_path))
    assert cfg2 == cfg
    assert list(loaded) == list(expected_tensor_shapes(cfg))
    for name, t in tensors.items():
        assert loaded[name].dtype == dtype, name
        assert torch.equal(loaded[name], t), name


def test_load_casts_dtype(tmp_path, cfg):
    tensors = random_draft_tensors(cfg, seed=0)
    save_draft_checkpoint(str(tmp_path), cfg, tensors)
    _, loaded = load_draft_checkpoint(str(tmp_path), dtype=torch.bfloat16)
    assert all(t.dtype == torch.bfloat16 for t in loaded.values())
    assert torch.equal(loaded["fc.weight"], tensors["fc.weight"].to(torch.bfloat16))


def test_writer_is_deterministic(tmp_path, cfg):
    for d in ("a", "b"):
        save_draft_checkpoint(str(tmp_path / d), cfg, random_draft_tensors(cfg, seed=5),
                              max_shard_bytes=30_000)
    names = sorted(os.listdir(tmp_path / "a"))
    assert names == sorted(os.listdir(tmp_path / "b"))
    for n in names:
        assert (tmp_path / "a" / n).read_bytes() == (tmp_path / "b" / n).read_bytes(), n


def test_writer_refuses_stale_shards_and_bad_tensors(tmp_path, cfg):
    tensors = random_draft_tensors(cfg, seed=0)
    save_draft_checkpoint(str(tmp_path), cfg, tensors, max_shard_bytes=20_000)
    with pytest.raises(ValueError, match="model-00001-of-"):
        save_draft_checkpoint(str(tmp_path), cfg, tensors)  # sharded files would linger
    bad = dict(tensors)
    del bad["bridge.gate_bias"]
    with pytest.raises(ValueError, match="bridge.gate_bias"):
        save_draft_checkpoint(str(tmp_path / "x"), cfg, bad)


# ------------------------------------------------------------------------- refusals
def test_refuses_missing_tensor(tmp_path, cfg):
    tensors = random_draft_tensors(cfg, seed=0)
    del tensors["layers.1.mlp.up_proj.weight"]
    _write_raw(tmp_path, cfg, tensors)
    with pytest.raises(ValueError) as e:
        load_draft_checkpoint(str(tmp_path))
    msg = str(e.value)
    assert "missing tensor 'layers.1.mlp.up_proj.weight'" in msg
    assert "[96, 64]" in msg  # the expected shape
    assert "re-export" in msg  # the fix


def test_refuses_extra_tensor(tmp_path, cfg):
    tensors = random_draft_tensors(cfg, seed=0)
    tensors["bridge.write.3.weight"] = torch.zeros(64, 20)  # a fourth layer's write
    _write_raw(tmp_path, cfg, tensors)
    with pytest.raises(ValueError, match=r"unexpected tensor 'bridge\.write\.3\.weight'.*"
                                         r"\[64, 20\]"):
        load_draft_checkpoint(str(tmp_path))


def test_refuses_misshaped_tensor(tmp_path, cfg):
    tensors = random_draft_tensors(cfg, seed=0)
    tensors["bridge.codebook"] = torch.zeros(300, 40)  # one row short
    _write_raw(tmp_path, cfg, tensors)
    with pytest.raises(ValueError) as e:
        load_draft_checkpoint(str(tmp_path))
    msg = str(e.value)
    assert "'bridge.codebook'" in msg
    assert "has shape [300, 40], expected [301, 40]" in msg
    assert "config.json" in msg


def test_refuses_tensor_in_two_shards(tmp_path, cfg):
    tensors = random_draft_tensors(cfg, seed=0)
    save_draft_checkpoint(str(tmp_path), cfg, tensors)
    save_file({"norm.weight": tensors["norm.weight"]}, str(tmp_path / "stale.safetensors"))
    with pytest.raises(ValueError, match=r"'norm\.weight' is stored twice.*stale\.safetensors"):
        load_draft_checkpoint(str(tmp_path))


def test_refuses_index_that_disagrees(tmp_path, cfg):
    save_draft_checkpoint(str(tmp_path), cfg, random_draft_tensors(cfg, seed=0),
                          max_shard_bytes=20_000)
    index_path = tmp_path / INDEX_NAME
    index = json.loads(index_path.read_text())
    files = sorted(set(index["weight_map"].values()))
    wrong = files[1] if index["weight_map"]["fc.weight"] == files[0] else files[0]
    index["weight_map"]["fc.weight"] = wrong
    index_path.write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"'fc\.weight'.*but it is stored in"):
        load_draft_checkpoint(str(tmp_path))

    del index["weight_map"]["fc.weight"]
    index_path.write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"'fc\.weight'.* not in the index"):
        load_draft_checkpoint(str(tmp_path))


def test_refuses_folder_without_tensors(tmp_path, cfg):
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_dict()))
    with pytest.raises(ValueError, match="no \\*.safetensors"):
        load_draft_checkpoint(str(tmp_path))


# ---------------------------------------------------------------------- config errors
@pytest.mark.parametrize("edit, field", [
    pytest.param(lambda d: d.pop("hidden_size"), "hidden_size", id="missing-top"),
    pytest.param(lambda d: d["dspine_config"].pop("code_dim"), "code_dim", id="missing-nested"),
    pytest.param(lambda d: d.update(head_dim="128"), "head_dim", id="str-for-int"),
    pytest.param(lambda d: d.update(num_hidden_layers=True), "num_hidden_layers",
                 id="bool-for-int"),
    pytest.param(lambda d: d["dspine_config"].update(mask_token_id=301), "mask_token_id",
                 id="mask-out-of-range"),
    pytest.param(lambda d: d["dspine_config"].update(target_layer_ids=[2, 0]),
                 "target_layer_ids", id="layers-unsorted"),
])
def test_config_errors_name_the_field(edit, field):
    d = copy.deepcopy(SMALL)
    edit(d)
    with pytest.raises(ValueError, match=f"'{field}'"):
        DSpineConfig.from_dict(d)


@pytest.mark.parametrize("vocab, words", [
    pytest.param(list(range(5, 300, 2))[::-1], "strictly increasing", id="unsorted"),
    pytest.param([1, 1] + list(range(2, 200)), "strictly increasing", id="repeated"),
    pytest.param(list(range(100, 302)), r"\[0, vocab_size", id="out-of-range"),
    pytest.param(list(range(10)), "fewer than 'coarse_topk'", id="too-few"),
    pytest.param("all", "strictly increasing", id="not-a-list"),
])
def test_retrieval_vocab_errors_name_the_field(vocab, words):
    d = copy.deepcopy(SMALL)
    d["dspine_config"]["retrieval_vocab"] = vocab
    with pytest.raises(ValueError, match=f"'retrieval_vocab'.*{words}|{words}.*'retrieval_vocab'"):
        DSpineConfig.from_dict(d)


def test_retrieval_vocab_round_trips():
    d = copy.deepcopy(SMALL)
    assert DSpineConfig.from_dict(d).retrieval_vocab is None
    assert "retrieval_vocab" not in DSpineConfig.from_dict(d).to_dict()["dspine_config"]
    vocab = list(range(3, 300, 2))
    d["dspine_config"]["retrieval_vocab"] = vocab
    cfg = DSpineConfig.from_dict(d)
    assert cfg.retrieval_vocab == tuple(vocab)
    again = DSpineConfig.from_dict(json.loads(json.dumps(cfg.to_dict())))
    assert again == cfg and again.retrieval_vocab == tuple(vocab)


def test_loader_reports_config_field(tmp_path, cfg):
    save_draft_checkpoint(str(tmp_path), cfg, random_draft_tensors(cfg, seed=0))
    d = cfg.to_dict()
    d["dspine_config"]["mask_token_id"] = -1
    (tmp_path / "config.json").write_text(json.dumps(d))
    with pytest.raises(ValueError, match=r"config\.json.*'mask_token_id'"):
        load_draft_checkpoint(str(tmp_path))


def test_check_target_fits(cfg):
    check_target_fits(cfg, hidden_size=64, vocab_size=301, num_layers=3)
    with pytest.raises(ValueError, match="hidden size 128"):
        check_target_fits(cfg, hidden_size=128, vocab_size=301, num_layers=3)
    with pytest.raises(ValueError, match="vocabulary size 300"):
        check_target_fits(cfg, hidden_size=64, vocab_size=300, num_layers=3)
    with pytest.raises(ValueError, match=r"'target_layer_ids' lists \[2\]"):
        check_target_fits(cfg, hidden_size=64, vocab_size=301, num_layers=2)


# ------------------------------------------------------------------------ random init
def test_random_init_seeded_and_scaled(cfg):
    a = random_draft_tensors(cfg, seed=11)
    b = random_draft_tensors(cfg, seed=11)
    c = random_draft_tensors(cfg, seed=12)
    assert all(torch.equal(a[n], b[n]) for n in a)
    assert not torch.equal(a["fc.weight"], c["fc.weight"])
    assert torch.equal(a["norm.weight"], torch.ones(64))
    # sqrt(C) * E has unit-RMS entries: 301*40 draws, RMS within 5 % (std of the
    # estimate ~ 1/sqrt(2*12040) ~ 0.6 %).
    code_rms = (cfg.code_scale * a["bridge.codebook"]).pow(2).mean().sqrt()
    assert abs(code_rms.item() - 1.0) < 0.05
    bf = random_draft_tensors(cfg, seed=11, dtype=torch.bfloat16)
    assert torch.equal(bf["fc.weight"], a["fc.weight"].to(torch.bfloat16))


def test_random_drafter_bridge_is_finite_and_not_degenerate(cfg):
    """The bridge on random weights: finite, writes a visible but small update."""
    tensors = random_draft_tensors(cfg, seed=1)
    w = bridge_weights(cfg, tensors)
    gen = torch.Generator().manual_seed(0)
    N = 2 * cfg.block_size
    x = torch.randn(N, cfg.hidden_size, generator=gen)  # [N, H]
    token_ids = torch.randint(0, cfg.vocab_size, (N,), generator=gen)  # [N]
    is_anchor = torch.zeros(N, dtype=torch.bool)
    is_anchor[:: cfg.block_size] = True
    for layer in range(cfg.num_hidden_layers):
        x_new, codes, rms = code_bridge_ref(x, layer, w, token_ids, is_anchor)
        assert torch.isfinite(x_new).all() and torch.isfinite(codes).all()
        rel = (x_new - x).norm(dim=-1) / x.norm(dim=-1)  # [N]
        assert torch.all(rel[is_anchor] == 0)  # no write into anchor rows
        # Writes N(0, 0.02^2) over M=20 message entries of size <~1: relative update
        # ~0.02*sqrt(20)*0.5 ~ 0.04; far from 0 and far from swamping x.
        assert 1e-3 < rel[~is_anchor].mean().item() < 0.5
        # Codes are distinct per row (a degenerate read would collapse them).
        assert codes[~is_anchor].std(dim=0).mean().item() > 0.5
        x = x_new
