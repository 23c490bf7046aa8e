"""The tiny target + drafter pair: deterministic, loadable offline, and matching."""

import json
import os

import pytest
import torch

from vllm_dspine.model.checkpoint import check_target_fits, load_draft_checkpoint
from vllm_dspine.pairs.tiny import EOS_TOKEN_ID, MASK_TOKEN_ID, write_tiny_pair


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return write_tiny_pair(str(tmp_path_factory.mktemp("tiny")), seed=0)


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    # Nothing here may reach the hub: a lookup would fail instead of hanging.
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")


def _files(root):
    out = {}
    for d, _, names in os.walk(root):
        for n in names:
            p = os.path.join(d, n)
            out[os.path.relpath(p, root)] = open(p, "rb").read()
    return out


def test_same_seed_same_bytes(pair, tmp_path):
    again = write_tiny_pair(str(tmp_path / "again"), seed=0)
    a, b = _files(os.path.dirname(pair.target_dir)), _files(os.path.dirname(again.target_dir))
    assert sorted(a) == sorted(b)
    assert {"target/config.json", "target/model.safetensors", "target/tokenizer.json",
            "target/tokenizer_config.json", "target/generation_config.json",
            "draft/config.json", "draft/model.safetensors"} <= set(a)
    for name in a:
        assert a[name] == b[name], name
    other = write_tiny_pair(str(tmp_path / "other"), seed=1)
    assert _files(other.target_dir)["model.safetensors"] != a["target/model.safetensors"]


def test_tokenizer_offline(pair):
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    tok = AutoTokenizer.from_pretrained(pair.target_dir)
    assert isinstance(tok, PreTrainedTokenizerFast)
    assert len(tok) == 512
    assert tok.mask_token == "<|mask|>" and tok.mask_token_id == MASK_TOKEN_ID
    assert tok.convert_tokens_to_ids("<|mask|>") == MASK_TOKEN_ID
    assert tok.eos_token_id == EOS_TOKEN_ID
    for text in ["Hello, world!", "  two  spaces\nand a line", "naïve café 日本語 🙂", ""]:
        ids = tok.encode(text, add_special_tokens=False)
        assert all(0 <= i < 256 for i in ids)  # bytes only: no special token sneaks in
        assert tok.decode(ids) == text
    ids = tok.encode("a<|mask|>b", add_special_tokens=False)
    assert ids == [ord("a"), MASK_TOKEN_ID, ord("b")]
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                   add_generation_prompt=True)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_target_loads_and_runs(pair):
    from transformers import AutoModelForCausalLM

    cfg = json.load(open(os.path.join(pair.target_dir, "config.json")))
    assert cfg["architectures"] == ["Qwen3ForCausalLM"] and cfg["head_dim"] >= 32
    model = AutoModelForCausalLM.from_pretrained(pair.target_dir)
    assert type(model).__name__ == "Qwen3ForCausalLM"
    assert model.dtype == torch.float32
    ids = torch.tensor([list(b"The quick brown fox jumps")])  # [1, 25]
    with torch.no_grad():
        logits = model(ids).logits  # [1, 25, 512]
    assert logits.shape == (1, 25, 512)
    assert torch.isfinite(logits).all()
    # Not degenerate: the greedy next token varies along the prompt.
    assert logits[0].argmax(-1).unique().numel() > 5


def test_draft_loads_and_fits_target(pair):
    cfg, tensors = load_draft_checkpoint(pair.draft_dir)
    target = json.load(open(os.path.join(pair.target_dir, "config.json")))
    check_target_fits(cfg, hidden_size=target["hidden_size"], vocab_size=target["vocab_size"],
                      num_layers=target["num_hidden_layers"])
    assert cfg.mask_token_id == MASK_TOKEN_ID
    assert cfg.target_layer_ids == (1, 3, 4)
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.code_dim, cfg.message_dim) == \
        (128, 2, 48, 24)
    assert all(t.dtype == torch.float32 and torch.isfinite(t).all() for t in tensors.values())


def test_pairs_cli_tiny_writes_then_reuses(tiny_cli_run):
    """`python -m vllm_dspine.pairs tiny --out DIR --steps 2`: writes the target and a
    distilled drafter; the same command again reuses them (files untouched); other
    arguments (--steps 3) are another pair, made anew. Run in one interpreter started
    with the session (conftest.py's `tiny_cli_run`, TINY_CLI_RUNS)."""
    done = tiny_cli_run.wait(600)
    assert done.returncode == 0, done.stderr[-4000:]
    res = json.loads(done.stdout.strip().splitlines()[-1])
    out = tiny_cli_run.out_dir / "pair"
    assert res["rc"] == [0, 0, 0]
    first, second, third = res["printed"]
    assert str(out / "target") in first and str(out / "draft") in first
    assert res["stamps"][0] is not None and res["target_file"]
    assert res["distilled"]  # the drafter's weights are not the random ones
    assert "reused" in second
    assert res["stamps"][1] == res["stamps"][0]
    # Other arguments are another pair: made anew, not reused.
    assert "reused" not in third
