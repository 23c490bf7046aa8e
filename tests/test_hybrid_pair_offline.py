"""The hybrid pair (`python -m vllm_dspine.pairs hybrid`): a Qwen3.5 text target with
3 Gated DeltaNet : 1 attention layers and a DSpine drafter, written offline; and what the
plugin decides from a hybrid's config without starting an engine (block size, refused
mixers, shortened verification).

Also ties the replay commit's reference formula (`commit/gdn_ref.py`) to transformers'
own Qwen3.5 GDN layer, an implementation written independently of vLLM's.

The other hybrid tests: tests/test_hybrid_engine.py (DSpine's engine against plain vLLM),
tests/test_hybrid_commit_fake_runner.py (`commit/runner.py` on vLLM's CPU GDN ops),
tests/test_hybrid_sampled.py (the sampled law).
"""

from __future__ import annotations

import hashlib
import json
import os

import pytest
import torch

from hybrid_fixtures import offline  # noqa: F401 - autouse: no model hub
from vllm_dspine.model.checkpoint import load_draft_checkpoint
from vllm_dspine.pairs.hybrid import LAYER_TYPES, TARGET_SIZES, write_hybrid_pair
from vllm_dspine.pairs.tiny import EOS_TOKEN_ID, MASK_TOKEN_ID


@pytest.fixture(scope="module")
def pair_dir(tmp_path_factory):
    from vllm_dspine.pairs.__main__ import main

    out = tmp_path_factory.mktemp("hybrid")
    assert main(["hybrid", "--out", str(out)]) == 0
    return out


def _digest(path) -> str:
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


def test_cli_writes_and_reuses(pair_dir, capsys):
    from vllm_dspine.pairs.__main__ import main

    record = json.loads((pair_dir / "pair.json").read_text())
    assert {k: v for k, v in record.items() if k != "files"} == {"name": "hybrid", "seed": 0}
    stamp = (pair_dir / "target" / "model.safetensors").stat().st_mtime_ns
    assert main(["hybrid", "--out", str(pair_dir)]) == 0
    assert "reused" in capsys.readouterr().out
    assert (pair_dir / "target" / "model.safetensors").stat().st_mtime_ns == stamp


def test_same_seed_same_bytes(pair_dir, tmp_path):
    again = write_hybrid_pair(str(tmp_path / "again"), seed=0)
    for sub in ("target/model.safetensors", "target/config.json", "target/tokenizer.json",
                "draft/model.safetensors", "draft/config.json"):
        assert _digest(pair_dir / sub) == _digest(os.path.join(tmp_path, "again", sub)), sub
    other = write_hybrid_pair(str(tmp_path / "other"), seed=1)
    assert _digest(os.path.join(other.target_dir, "model.safetensors")) != _digest(
        pair_dir / "target" / "model.safetensors")


def test_target_is_a_qwen3_5_text_model_transformers_loads(pair_dir):
    """The architecture vLLM 0.32.0 registers (`Qwen3_5ForCausalLM`), 3 GDN : 1 attention,
    GDN head dims 128 (what vLLM's CPU GDN kernels accept), bf16 weights; transformers
    loads it with no missing or unexpected tensor and runs it."""
    from transformers import AutoTokenizer, Qwen3_5ForCausalLM

    target = pair_dir / "target"
    cfg = json.loads((target / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3_5ForCausalLM"]
    assert cfg["model_type"] == "qwen3_5_text"
    assert cfg["layer_types"] == list(LAYER_TYPES) == ["linear_attention"] * 3 + ["full_attention"]
    assert cfg["linear_key_head_dim"] == cfg["linear_value_head_dim"] == 128
    assert cfg["torch_dtype"] == "bfloat16" and cfg["mamba_ssm_dtype"] == "float32"
    model, info = Qwen3_5ForCausalLM.from_pretrained(str(target), dtype=torch.float32,
                                                     output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert not info["mismatched_keys"], info
    tok = AutoTokenizer.from_pretrained(str(target))
    assert len(tok) == TARGET_SIZES["vocab_size"]
    assert tok.eos_token_id == EOS_TOKEN_ID and tok.mask_token_id == MASK_TOKEN_ID
    ids = torch.tensor([tok.encode("the quick brown fox", add_special_tokens=False)])
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], TARGET_SIZES["vocab_size"])
    assert torch.isfinite(logits).all()
    # Not degenerate: the greedy tokens vary along the prompt.
    assert logits[0].argmax(-1).unique().numel() > 3


def test_drafter_fits_the_target(pair_dir):
    cfg, tensors = load_draft_checkpoint(str(pair_dir / "draft"))
    cfg.check_target(hidden_size=TARGET_SIZES["hidden_size"],
                     vocab_size=TARGET_SIZES["vocab_size"],
                     num_layers=TARGET_SIZES["num_hidden_layers"], where="hybrid target")
    assert cfg.torch_dtype == "bfloat16" and cfg.mask_token_id == MASK_TOKEN_ID
    assert all(t.dtype == torch.bfloat16 for t in tensors.values())
    assert max(cfg.target_layer_ids) < TARGET_SIZES["num_hidden_layers"] - 1


def test_reference_formula_matches_transformers_gdn_layer():
    """`gdn_forward_ref` from the zero state, followed by the layer's own gated norm and
    output projection, gives transformers' `Qwen3_5GatedDeltaNet` output (its chunked
    algorithm, fp32), with GQA (4 value heads on 2 key heads) and K != V."""
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet

    from vllm_dspine.commit.gdn_ref import GDNWeights, gdn_forward_ref

    H, HV, K, V, Hd, T = 2, 4, 32, 16, 64, 20
    cfg = Qwen3_5TextConfig(hidden_size=Hd, linear_num_key_heads=H, linear_num_value_heads=HV,
                            linear_key_head_dim=K, linear_value_head_dim=V,
                            linear_conv_kernel_dim=4, num_hidden_layers=1,
                            layer_types=["linear_attention"], hidden_act="silu")
    g = torch.Generator().manual_seed(0)
    layer = Qwen3_5GatedDeltaNet(cfg, 0).eval()
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
        layer.A_log.copy_(torch.rand(HV, generator=g).log())
        layer.norm.weight.fill_(1.0)
        h = torch.randn(1, T, Hd, generator=g)
        want = layer(h)
        w = GDNWeights(conv_weight=layer.conv1d.weight[:, 0], conv_bias=None,
                       A_log=layer.A_log, dt_bias=layer.dt_bias, num_k_heads=H,
                       head_k_dim=K, head_v_dim=V)
        x, a, b = layer.in_proj_qkv(h)[0], layer.in_proj_a(h)[0], layer.in_proj_b(h)[0]
        z = layer.in_proj_z(h)[0].reshape(T * HV, V)
        o, _, _ = gdn_forward_ref(torch.zeros(HV, V, K), torch.zeros(w.conv_dim, 3), x, a, b, w)
        got = layer.out_proj(layer.norm(o.reshape(T * HV, V), z).reshape(1, T, HV * V))
    err = ((got - want).pow(2).mean().sqrt() / want.pow(2).mean().sqrt()).item()
    assert err < 1e-5, err


def test_cpu_block_size_survives_the_engine_core_config_rerun(pair_dir):
    """Patch 12: vLLM's engine core re-runs `VllmConfig.__post_init__` after its start-up
    handshake; on CPU that reset the hybrid's 384-token block size to 128, and the
    scheduler then ended prefill chunks off the mamba block boundaries. The block size
    now survives the re-run (a dense target's is untouched by the patch)."""
    from engine_utils import dspine_spec, engine_env

    engine_env()
    from vllm.engine.arg_utils import EngineArgs

    from vllm_dspine.plugin import register

    register()
    args = EngineArgs(model=str(pair_dir / "target"), dtype="bfloat16", max_model_len=512,
                      enforce_eager=True, enable_prefix_caching=True,
                      speculative_config=dspine_spec(pair_dir / "draft"))
    config = args.create_engine_config()
    assert config.cache_config.mamba_cache_mode == "align"
    assert config.cache_config.block_size == 128
    config.cache_config.block_size = 384  # what the KV cache groups set at start
    config.__post_init__()
    assert config.cache_config.block_size == 384


def test_other_hybrid_mixers_refused():
    """Recurrent mixers other than Qwen3.5 / Qwen3-Next GDN are refused with a message."""
    import types

    from vllm_dspine.proposer.validation import check_hybrid_target

    for arch in ("FalconH1ForCausalLM", "KimiLinearForCausalLM", "Lfm2ForCausalLM"):
        target = types.SimpleNamespace(is_hybrid=True, has_inner_state=True,
                                       architectures=[arch], model="m")
        with pytest.raises(ValueError, match="only Gated DeltaNet"):
            check_hybrid_target(target)
    check_hybrid_target(types.SimpleNamespace(is_hybrid=False, has_inner_state=False,
                                              architectures=["Qwen3ForCausalLM"], model="m"))


def test_gdn_hybrid_takes_shortened_verification():
    """With the replay commit a GDN hybrid verifies blocks of any length: 'dynamic' is
    its default, and dspine_verify_max / a batch-size schedule are accepted."""
    from types import SimpleNamespace

    from vllm_dspine.proposer.validation import check_verification_options
    from vllm_dspine.pairs.hybrid import draft_config

    cfg = draft_config()
    target = SimpleNamespace(is_hybrid=True, has_inner_state=True,
                             architectures=["Qwen3_5ForCausalLM"])
    spec = SimpleNamespace(num_speculative_tokens_per_batch_size=None,
                           target_model_config=target)
    assert check_verification_options(spec, cfg, {})["dspine_verify"] == "dynamic"
    assert check_verification_options(spec, cfg, {"dspine_verify_max": 4})[
        "dspine_verify_max"] == 4
    spec.num_speculative_tokens_per_batch_size = [[1, 8, 3]]
    assert check_verification_options(spec, cfg, {"dspine_verify": "fixed"})[
        "dspine_verify"] == "fixed"
