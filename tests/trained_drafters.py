"""The distilled drafters of the tiny and the hybrid test pairs, committed under
tests/data/ so that a test session does not distil them again (1.5 and ~1 minutes of one
core), and the recipe that made them.

- `tests/data/tiny-trained-draft/`: `write_tiny_pair(seed=0)`'s drafter distilled from its
  target (`train_tiny_drafter(seed=0)`, the default settings: what
  `write_tiny_pair(seed=0, trained=True)` writes).
- `tests/data/hybrid-trained-draft/`: `write_hybrid_pair(seed=0)`'s drafter distilled for
  a short while (`HYBRID_SETTINGS`), so that drafts are accepted (~0.3 tokens a block) and
  the replay commit commits more than one position on some steps.

Each folder holds the drafter's `config.json` and `model.safetensors` as the trainer wrote
them and `record.json`: how it was made, the sha256 of the target it was distilled from
(a pair whose target bytes differ is refused: the drafter would not fit it), and the
trainer's held-out acceptance. tests/test_trained_drafters.py distils both again and
compares with these files. Made again (after a change of the pairs or the trainer) with

    python tests/trained_drafters.py
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import sys
from pathlib import Path

DATA = Path(__file__).resolve().parent / "data"
TINY = DATA / "tiny-trained-draft"
HYBRID = DATA / "hybrid-trained-draft"
FILES = ("config.json", "model.safetensors")


def hybrid_settings():
    from vllm_dspine.train.tiny_drafter import TrainSettings

    return TrainSettings(steps=160, train_seqs=192)


def sha256(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def machine() -> dict:
    """What decides the trainer's float rounding: torch's version and the CPU's widest
    vector unit (the trainer runs on one thread, so one machine repeats it bit for bit)."""
    import torch

    flags = ""
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    return {"torch": torch.__version__, "machine": platform.machine(),
            "avx512f": " avx512f" in flags}


def distil_tiny(out_dir: str, evaluate: bool = True) -> tuple[object, dict]:
    """The tiny pair with its drafter distilled (`evaluate`: with the trainer's held-out
    acceptance in the stats; the tensors are the same either way)."""
    from vllm_dspine.pairs.tiny import write_tiny_pair
    from vllm_dspine.train.tiny_drafter import train_tiny_drafter

    pair = write_tiny_pair(out_dir, seed=0)
    stats = train_tiny_drafter(pair.target_dir, pair.draft_dir, seed=0, evaluate=evaluate)
    return pair, stats


def distil_hybrid(out_dir: str, evaluate: bool = True) -> tuple[object, dict]:
    """The hybrid pair with its drafter distilled for `hybrid_settings()`."""
    from vllm_dspine.pairs.hybrid import write_hybrid_pair
    from vllm_dspine.train.tiny_drafter import train_tiny_drafter

    pair = write_hybrid_pair(out_dir, seed=0)
    stats = train_tiny_drafter(pair.target_dir, pair.draft_dir, seed=0, evaluate=evaluate,
                               settings=hybrid_settings())
    return pair, stats


def _write_pair(kind: str, out_dir: str):
    if kind == "tiny":
        from vllm_dspine.pairs.tiny import write_tiny_pair

        return write_tiny_pair(out_dir, seed=0)
    from vllm_dspine.pairs.hybrid import write_hybrid_pair

    return write_hybrid_pair(out_dir, seed=0)


def committed(kind: str) -> Path:
    return {"tiny": TINY, "hybrid": HYBRID}[kind]


def record(kind: str) -> dict:
    with open(committed(kind) / "record.json") as f:
        return json.load(f)


def pair_with_committed_drafter(kind: str, out_dir: str):
    """`write_{kind}_pair(out_dir, seed=0)` with the committed distilled drafter in its
    draft folder. Refuses (AssertionError naming the fix) a target whose bytes are not the
    ones the drafter was distilled from, or a drafter config the pair no longer writes."""
    pair = _write_pair(kind, out_dir)
    src, rec = committed(kind), record(kind)
    target = sha256(os.path.join(pair.target_dir, "model.safetensors"))
    assert target == rec["target_sha256"], (
        f"the {kind} pair's target is not the one {src} was distilled from (sha256 "
        f"{target[:12]}, recorded {rec['target_sha256'][:12]}): make the drafters again "
        f"with `python tests/trained_drafters.py`")
    with open(os.path.join(pair.draft_dir, "config.json")) as f:
        written = json.load(f)
    with open(src / "config.json") as f:
        kept = json.load(f)
    assert written == kept, (f"the {kind} pair's draft config.json differs from {src}'s: "
                             f"make the drafters again with "
                             f"`python tests/trained_drafters.py`")
    for name in FILES:
        shutil.copyfile(src / name, os.path.join(pair.draft_dir, name))
    return pair


def _save(kind: str, pair, stats: dict, command: str) -> None:
    dst = committed(kind)
    dst.mkdir(parents=True, exist_ok=True)
    for name in FILES:
        shutil.copyfile(os.path.join(pair.draft_dir, name), dst / name)
    rec = {
        "made_by": "python tests/trained_drafters.py",
        "recipe": command,
        "target_sha256": sha256(os.path.join(pair.target_dir, "model.safetensors")),
        "draft_sha256": sha256(dst / "model.safetensors"),
        "machine": machine(),
        "after": stats.get("after"),
        "loss_first": stats.get("loss_first"),
        "loss_last10": stats.get("loss_last10"),
    }
    with open(dst / "record.json", "w") as f:
        json.dump(rec, f, indent=2, sort_keys=True)
        f.write("\n")


def main() -> int:
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        pair, stats = distil_tiny(os.path.join(tmp, "tiny"))
        _save("tiny", pair, stats, "write_tiny_pair(seed=0); train_tiny_drafter(seed=0)")
        pair, stats = distil_hybrid(os.path.join(tmp, "hybrid"))
        _save("hybrid", pair, stats, "write_hybrid_pair(seed=0); train_tiny_drafter("
              "seed=0, settings=TrainSettings(steps=160, train_seqs=192))")
    print(f"wrote {TINY} and {HYBRID}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
