"""Reading, writing and checking DSpine draft checkpoints (docs/design.md section 2).

A draft folder holds `config.json` and one or more `*.safetensors` files; when there are
several, `model.safetensors.index.json` may map every tensor to its file. The tensor set
is fixed by the config: no tensor may be missing, extra, misshaped, or stored twice.

    H hidden size, I intermediate size, C code width, M message width, V vocabulary,
    L draft layers, F = len(target_layer_ids).
"""

from __future__ import annotations

import glob
import json
import math
import os

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from vllm_dspine.config import DSpineConfig
from vllm_dspine.kernels.bridge_ref import BridgeWeights
from vllm_dspine.kernels.tail_ref import TailWeights

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"

_FIX = ("re-export the checkpoint so its tensors match config.json (docs/design.md section 2), "
        "or fix config.json to describe the checkpoint you have")


# ------------------------------------------------------------------- the tensor table
def _layer_shapes(cfg: DSpineConfig, l: int) -> dict[str, tuple[int, ...]]:
    H, I, D = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q_out = cfg.num_attention_heads * D
    kv_out = cfg.num_key_value_heads * D
    p = f"layers.{l}."
    return {
        p + "input_layernorm.weight": (H,),
        p + "post_attention_layernorm.weight": (H,),
        p + "self_attn.q_proj.weight": (q_out, H),
        p + "self_attn.k_proj.weight": (kv_out, H),
        p + "self_attn.v_proj.weight": (kv_out, H),
        p + "self_attn.o_proj.weight": (H, q_out),
        p + "self_attn.q_norm.weight": (D,),
        p + "self_attn.k_norm.weight": (D,),
        p + "mlp.gate_proj.weight": (I, H),
        p + "mlp.up_proj.weight": (I, H),
        p + "mlp.down_proj.weight": (H, I),
    }


def expected_tensor_shapes(cfg: DSpineConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a draft checkpoint for `cfg` holds, with its shape (docs/design.md 2)."""
    H, C, M, V = cfg.hidden_size, cfg.code_dim, cfg.message_dim, cfg.vocab_size
    F, L = cfg.num_target_features, cfg.num_hidden_layers
    shapes: dict[str, tuple[int, ...]] = {
        "fc.weight": (H, F * H),
        "hidden_norm.weight": (H,),
    }
    for l in range(L):
        shapes.update(_layer_shapes(cfg, l))
    shapes["norm.weight"] = (H,)
    shapes["bridge.codebook"] = (V, C)
    for l in range(L):
        shapes[f"bridge.read.{l}.weight"] = (C, H)
    shapes["bridge.gate_recv.weight"] = (M, C)
    shapes["bridge.gate_pred.weight"] = (M, C)
    shapes["bridge.value.weight"] = (M, C)
    shapes["bridge.gate_bias"] = (M,)
    for l in range(L):
        shapes[f"bridge.write.{l}.weight"] = (H, M)
    return shapes


def check_tensor_shapes(cfg: DSpineConfig, shapes: dict[str, tuple[int, ...]],
                        where: str) -> None:
    """Refuse a missing, extra or wrongly shaped tensor, naming it, expected and actual."""
    expected = expected_tensor_shapes(cfg)
    missing = [n for n in expected if n not in shapes]
    if missing:
        n = missing[0]
        more = f" (and {len(missing) - 1} more: {missing[1:6]})" if len(missing) > 1 else ""
        raise ValueError(
            f"{where}: missing tensor '{n}' (expected shape {list(expected[n])}){more}; "
            f"{_FIX}")
    extra = sorted(n for n in shapes if n not in expected)
    if extra:
        n = extra[0]
        more = f" (and {len(extra) - 1} more: {extra[1:6]})" if len(extra) > 1 else ""
        raise ValueError(
            f"{where}: unexpected tensor '{n}' with shape {list(shapes[n])}, which a DSpine "
            f"drafter with {cfg.num_hidden_layers} layers does not have{more}; remove it or "
            f"{_FIX}")
    for n, shape in expected.items():
        if tuple(shapes[n]) != shape:
            raise ValueError(
                f"{where}: tensor '{n}' has shape {list(shapes[n])}, expected {list(shape)}; "
                f"{_FIX}")


# ----------------------------------------------------------------------------- loading
def _read_index(path: str) -> dict[str, str] | None:
    index_path = os.path.join(path, INDEX_NAME)
    if not os.path.isfile(index_path):
        return None
    with open(index_path) as f:
        try:
            index = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{index_path}: not valid JSON ({e})") from e
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
        raise ValueError(f"{index_path}: field 'weight_map' must map tensor names to file "
                         f"names; rewrite the index or delete it")
    return weight_map


def _scan_shards(path: str) -> tuple[dict[str, str], dict[str, tuple[int, ...]]]:
    """Names every tensor's file and shape, without reading tensor data."""
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ValueError(f"{path}: no *.safetensors file; a DSpine draft folder holds "
                         f"config.json and its tensors in safetensors files")
    owner: dict[str, str] = {}  # tensor name -> file name
    shapes: dict[str, tuple[int, ...]] = {}
    for file in files:
        fname = os.path.basename(file)
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                if name in owner:
                    raise ValueError(
                        f"{path}: tensor '{name}' is stored twice, in '{owner[name]}' and "
                        f"'{fname}'; keep one copy (delete stale shards from the folder)")
                owner[name] = fname
                shapes[name] = tuple(f.get_slice(name).get_shape())
    return owner, shapes


def _check_index(path: str, weight_map: dict[str, str], owner: dict[str, str]) -> None:
    where = os.path.join(path, INDEX_NAME)
    for name, fname in weight_map.items():
        if name not in owner:
            raise ValueError(f"{where}: lists tensor '{name}' in '{fname}', but no "
                             f"safetensors file holds it; re-export the checkpoint")
        if owner[name] != fname:
            raise ValueError(f"{where}: lists tensor '{name}' in '{fname}', but it is "
                             f"stored in '{owner[name]}'; re-export the checkpoint")
    unlisted = sorted(n for n in owner if n not in weight_map)
    if unlisted:
        n = unlisted[0]
        raise ValueError(f"{where}: tensor '{n}' in '{owner[n]}' is not in the index; "
                         f"delete stale shards from the folder or re-export the checkpoint")


def load_draft_checkpoint(
    path: str, dtype: torch.dtype | None = None, device: str | torch.device = "cpu",
) -> tuple[DSpineConfig, dict[str, torch.Tensor]]:
    """Read and check a draft folder. Tensors keep their stored dtype unless `dtype` is given.

    Shapes are checked against config.json before any tensor data is read.
    """
    cfg, owner, shapes = _checked_listing(path)

    tensors: dict[str, torch.Tensor] = {}
    by_file: dict[str, list[str]] = {}
    for name, fname in owner.items():
        by_file.setdefault(fname, []).append(name)
    for fname in sorted(by_file):
        with safe_open(os.path.join(path, fname), framework="pt", device=str(device)) as f:
            for name in by_file[fname]:
                t = f.get_tensor(name)
                tensors[name] = t if dtype is None else t.to(dtype)
    # Table order, so iteration order does not depend on how the shards were cut.
    return cfg, {n: tensors[n] for n in expected_tensor_shapes(cfg)}


def check_target_fits(cfg: DSpineConfig, *, hidden_size: int, vocab_size: int,
                      num_layers: int, where: str = "target") -> None:
    """Refuse a target whose hidden size, vocabulary or layer count do not fit `cfg`."""
    cfg.check_target(hidden_size=hidden_size, vocab_size=vocab_size, num_layers=num_layers,
                     where=where)


def bridge_weights(cfg: DSpineConfig, tensors: dict[str, torch.Tensor]) -> BridgeWeights:
    """The `bridge.*` tensors of a loaded checkpoint, as the bridge reference takes them."""
    L = cfg.num_hidden_layers
    return BridgeWeights(
        codebook=tensors["bridge.codebook"],
        read=[tensors[f"bridge.read.{l}.weight"] for l in range(L)],
        gate_recv=tensors["bridge.gate_recv.weight"],
        gate_pred=tensors["bridge.gate_pred.weight"],
        value=tensors["bridge.value.weight"],
        gate_bias=tensors["bridge.gate_bias"],
        write=[tensors[f"bridge.write.{l}.weight"] for l in range(L)],
        eps=cfg.bridge_eps,
    )


def tail_weights(cfg: DSpineConfig, tensors: dict[str, torch.Tensor],
                 head: torch.Tensor) -> TailWeights:
    """What the tail reads from a loaded checkpoint: its bridge, its final norm, and the
    target's output head `head` [V, H] (the drafter has none of its own)."""
    return TailWeights(bridge_weights(cfg, tensors), tensors["norm.weight"],
                       cfg.rms_norm_eps, head)


# ----------------------------------------------------------------------------- writing
def _shard(names: list[str], tensors: dict[str, torch.Tensor],
           max_shard_bytes: int) -> list[list[str]]:
    """Greedy, in table order: a new shard starts when the next tensor would overflow.

    A tensor bigger than the limit gets a shard of its own.
    """
    shards: list[list[str]] = [[]]
    size = 0
    for n in names:
        nbytes = tensors[n].numel() * tensors[n].element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(n)
        size += nbytes
    return shards


def save_draft_checkpoint(path: str, cfg: DSpineConfig, tensors: dict[str, torch.Tensor],
                          max_shard_bytes: int | None = None) -> list[str]:
    """Write config.json and the tensors; returns the safetensors file names written.

    One `model.safetensors`, or with `max_shard_bytes` the HF layout
    `model-0000i-of-0000n.safetensors` plus `model.safetensors.index.json`. Files are written
    in a fixed order with fixed metadata, so the same input gives the same bytes. A folder
    already holding other *.safetensors files is refused: the loader reads them all.
    """
    check_tensor_shapes(cfg, {n: tuple(t.shape) for n, t in tensors.items()},
                        where="save_draft_checkpoint")
    if max_shard_bytes is not None and max_shard_bytes <= 0:
        raise ValueError(f"save_draft_checkpoint: max_shard_bytes must be > 0 or None, "
                         f"got {max_shard_bytes}")
    names = list(expected_tensor_shapes(cfg))
    if max_shard_bytes is None:
        shards = [names]
        files = [SINGLE_NAME]
    else:
        shards = _shard(names, tensors, max_shard_bytes)
        n = len(shards)
        files = [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]

    os.makedirs(path, exist_ok=True)
    stale = sorted(os.path.basename(p) for p in glob.glob(os.path.join(path, "*.safetensors"))
                   if os.path.basename(p) not in files)
    if stale:
        raise ValueError(f"{path}: already holds {stale}, which the loader would read too; "
                         f"write into an empty folder or delete them first")
    index_path = os.path.join(path, INDEX_NAME)
    if max_shard_bytes is None and os.path.exists(index_path):
        os.remove(index_path)  # ours: a single-file checkpoint has no index

    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg.to_dict(), f, indent=2, sort_keys=True)
        f.write("\n")
    weight_map: dict[str, str] = {}
    for fname, shard in zip(files, shards):
        save_file({n: tensors[n].detach().to("cpu").contiguous() for n in shard},
                  os.path.join(path, fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in shard})
    if max_shard_bytes is not None:
        total = sum(tensors[n].numel() * tensors[n].element_size() for n in names)
        with open(index_path, "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f,
                      indent=2, sort_keys=True)
            f.write("\n")
    return files


# ------------------------------------------------------------------------- random init
def _init_std(name: str, shape: tuple[int, ...], cfg: DSpineConfig) -> float | None:
    """Standard deviation of a random tensor; None for a norm weight (all ones)."""
    if name.endswith("norm.weight"):
        return None
    if name == "bridge.gate_bias":
        return 0.0
    if name == "bridge.codebook":
        return 1.0 / math.sqrt(cfg.code_dim)  # sqrt(C) * E[a] has unit RMS entries
    if name.startswith("bridge.write."):
        return 0.02  # small writes: the bridge nudges the residual, it does not drown it
    return 1.0 / math.sqrt(shape[1])  # projections: unit-variance outputs for unit inputs


def random_draft_tensors(cfg: DSpineConfig, seed: int,
                         dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """A seeded random drafter whose forward pass gives finite, non-degenerate outputs.

    Norm weights are 1, projections N(0, 1/fan_in), codebook N(0, 1/C), writes N(0, 0.02^2),
    gate bias 0. Drawn in fp32 in table order from one generator, then cast, so the values
    do not depend on `dtype` beyond rounding.
    """
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for name, shape in expected_tensor_shapes(cfg).items():
        std = _init_std(name, shape, cfg)
        if std is None:
            t = torch.ones(shape)
        elif std == 0.0:
            t = torch.zeros(shape)
        else:
            t = torch.randn(shape, generator=gen) * std
        out[name] = t.to(dtype)
    return out


# ------------------------------------------------- the folder between start and load
# The front end validates the draft folder when vLLM builds its configs; the worker
# reads the weights later (seconds to minutes: after the target has loaded). A folder
# that changes in between (weights rewritten or deleted, config.json edited) must not
# load silently: the engine was sized and checked for what was validated. The front end
# records a fingerprint of the folder (no tensor data is read: config.json as parsed,
# every safetensors file's size and modification time, every tensor's dtype and shape);
# the worker compares the folder with it before vLLM reads the weights, and the loaded
# tensors and files with it once they have been read.

_AFTER_START = ("the engine validated the draft folder when it started and was built for "
                "what it held then; do not modify a draft folder while an engine starts "
                "from it: restore it, or restart the engine to serve the new drafter")


def _stat_files(path: str) -> dict[str, list[int]]:
    """{file name: [size, mtime_ns]} of the folder's safetensors files and index."""
    out = {}
    names = [os.path.basename(p) for p in glob.glob(os.path.join(path, "*.safetensors"))]
    if os.path.isfile(os.path.join(path, INDEX_NAME)):
        names.append(INDEX_NAME)
    for name in sorted(names):
        st = os.stat(os.path.join(path, name))
        out[name] = [int(st.st_size), int(st.st_mtime_ns)]
    return out


def _tensor_dtypes(path: str, owner: dict[str, str]) -> dict[str, str]:
    out = {}
    for fname in sorted(set(owner.values())):
        with safe_open(os.path.join(path, fname), framework="pt") as f:
            for name in f.keys():
                out[name] = str(f.get_slice(name).get_dtype())
    return out


def folder_fingerprint(path: str) -> dict:
    """What the worker checks the folder against: parsed config, files, tensor dtypes and
    shapes. Raises ValueError (naming the tensor or field) for a folder that is not a
    valid draft checkpoint."""
    cfg, owner, shapes = _checked_listing(path)
    return {"path": os.path.abspath(path), "config": cfg.to_dict(),
            "files": _stat_files(path), "dtypes": _tensor_dtypes(path, owner),
            "shapes": {n: list(s) for n, s in shapes.items()}}


def _checked_listing(path: str):
    """(config, tensor -> file, tensor -> shape) of a draft folder, checked against
    config.json without reading tensor data. Raises ValueError naming the problem."""
    if not os.path.isdir(path):
        raise ValueError(f"{path}: not a folder; pass the draft checkpoint folder "
                         f"(config.json + *.safetensors)")
    cfg = DSpineConfig.from_pretrained(path)
    owner, shapes = _scan_shards(path)
    weight_map = _read_index(path)
    if weight_map is not None:
        _check_index(path, weight_map, owner)
    check_tensor_shapes(cfg, shapes, where=path)
    return cfg, owner, shapes


def _describe_file_changes(then: dict, now: dict) -> str:
    parts = []
    for name in sorted(set(then) | set(now)):
        if name not in now:
            parts.append(f"'{name}' was deleted")
        elif name not in then:
            parts.append(f"'{name}' was added")
        elif then[name] != now[name]:
            parts.append(f"'{name}' was rewritten ({then[name][0]} -> {now[name][0]} bytes, "
                         f"modified after the start)")
    return ", ".join(parts)


def check_folder_unchanged(fingerprint: dict) -> None:
    """Before the weights are read: the folder is still what `folder_fingerprint`
    recorded. Raises ValueError naming the first change and the fix."""
    path = fingerprint["path"]
    if not os.path.isdir(path):
        raise ValueError(f"{path}: the draft folder is gone; {_AFTER_START}")
    try:
        cfg = DSpineConfig.from_pretrained(path)
    except ValueError as e:
        raise ValueError(f"{path}/config.json changed after the start and is no longer "
                         f"valid ({e}); {_AFTER_START}") from None
    now, then = cfg.to_dict(), fingerprint["config"]
    if now != then:
        def flat(d, pre=""):
            for k, v in d.items():
                if isinstance(v, dict):
                    yield from flat(v, f"{pre}{k}.")
                else:
                    yield f"{pre}{k}", v
        a, b = dict(flat(then)), dict(flat(now))
        diff = [f"'{k}' was {a.get(k)!r}, now {b.get(k)!r}" for k in sorted(set(a) | set(b))
                if a.get(k) != b.get(k)]
        raise ValueError(f"{path}/config.json changed after the start ({'; '.join(diff)}); "
                         f"{_AFTER_START}")
    try:
        _, owner, shapes = _checked_listing(path)
    except ValueError as e:
        raise ValueError(f"the draft weights changed after the start: {e} ({_AFTER_START})"
                         ) from None
    check_loaded_tensors(fingerprint, {n: (dt, tuple(shapes[n]))
                                       for n, dt in _tensor_dtypes(path, owner).items()},
                         when="after the start")
    files = _stat_files(path)
    if files != fingerprint["files"]:
        raise ValueError(f"{path}: the draft weights changed after the start "
                         f"({_describe_file_changes(fingerprint['files'], files)}); "
                         f"{_AFTER_START}")


_TORCH_DTYPE_NAMES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16",
                      torch.float64: "F64", torch.float8_e4m3fn: "F8_E4M3",
                      torch.float8_e5m2: "F8_E5M2", torch.int64: "I64",
                      torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
                      torch.uint8: "U8", torch.bool: "BOOL"}


def check_loaded_tensors(fingerprint: dict, got: dict[str, tuple], when: str) -> None:
    """`got`: name -> (dtype as safetensors names it, or a torch dtype; shape). Every
    validated tensor is there with its validated dtype and shape, and nothing else."""
    path = fingerprint["path"]
    want_dt, want_shape = fingerprint["dtypes"], fingerprint["shapes"]
    for name in want_dt:
        if name not in got:
            raise ValueError(f"{path}: tensor '{name}' disappeared {when}; {_AFTER_START}")
    for name, (dt, shape) in got.items():
        if name not in want_dt:
            raise ValueError(f"{path}: tensor '{name}' appeared {when}; {_AFTER_START}")
        dt = _TORCH_DTYPE_NAMES.get(dt, str(dt)) if isinstance(dt, torch.dtype) else dt
        if dt != want_dt[name] or list(shape) != list(want_shape[name]):
            raise ValueError(
                f"{path}: tensor '{name}' is {dt} {list(shape)} {when}, but was validated "
                f"as {want_dt[name]} {list(want_shape[name])}; {_AFTER_START}")


def check_files_unchanged(fingerprint: dict, when: str) -> None:
    path = fingerprint["path"]
    files = _stat_files(path) if os.path.isdir(path) else {}
    if files != fingerprint["files"]:
        raise ValueError(f"{path}: the draft weights changed {when} "
                         f"({_describe_file_changes(fingerprint['files'], files)}); "
                         f"{_AFTER_START}")


def save_dflash_checkpoint(path: str, cfg: DSpineConfig,
                           tensors: dict[str, torch.Tensor]) -> None:
    """A drafter without its bridge in vLLM's own `dflash` format (a Qwen3 draft config
    with `dflash_config`; the checkpoint names of docs/design.md section 2 minus
    `bridge.*`), so that vLLM's built-in method serves the same layers: the no-bridge
    ablation runs through `"method": "dflash"`."""
    import json

    from safetensors.torch import save_file as save_torch_file

    os.makedirs(path, exist_ok=True)
    d = cfg.to_dict()
    ds = d.pop("dspine_config")
    d.pop("retrieval_vocab", None)
    d.update(architectures=["DFlashDraftModel"], model_type="qwen3",
             tie_word_embeddings=False, hidden_act="silu", attention_bias=False,
             layer_types=["full_attention"] * cfg.num_hidden_layers,
             dflash_config={"mask_token_id": ds["mask_token_id"],
                            "target_layer_ids": ds["target_layer_ids"], "causal": True})
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(d, f, indent=2)
    save_torch_file({k: v.to(torch.bfloat16).contiguous() for k, v in tensors.items()
                     if not k.startswith("bridge.")}, os.path.join(path, "model.safetensors"),
                    metadata={"format": "pt"})
