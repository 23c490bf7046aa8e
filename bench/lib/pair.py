"""The pair a benchmark runs on, never stale.

A benchmark's `--pair DIR` is a folder with `target/` and `draft/`. Where it was made by
`python -m vllm_dspine.pairs NAME` (its `pair.json` says so), it is brought up to date
the same way first: a folder made before the committed drafter changed is made again
(the record holds the committed drafter's digest), so a benchmark cannot measure an old
drafter while the doc it writes names today's. A folder without that record (a user's own
target and drafter) is used as it is. `drafter_summary` names what was measured.
"""

from __future__ import annotations

import json
import os


def ensure_pair(pair_dir: str) -> str:
    """Refresh `pair_dir` through the pairs command when it made it for SmolLM2 (the pair
    whose drafter is committed and changes; the synthetic pairs are fixed by their
    arguments, which their record keeps).  -> pair_dir"""
    record = os.path.join(pair_dir, "pair.json")
    if not os.path.isfile(record):
        return pair_dir
    with open(record) as f:
        if json.load(f).get("name") != "smollm2":
            return pair_dir
    from vllm_dspine.pairs.__main__ import main as pairs_main

    if pairs_main(["smollm2", "--out", pair_dir]) != 0:
        raise SystemExit(f"python -m vllm_dspine.pairs smollm2 --out {pair_dir} failed "
                         f"(above); fix it or give a complete --pair folder")
    return pair_dir


def drafter_summary(draft_dir: str) -> str:
    """One line for a benchmark's doc: the drafter's training stages and their data."""
    path = os.path.join(draft_dir, "training.json")
    if not os.path.isfile(path):
        return f"drafter {draft_dir} (no training.json)"
    with open(path) as f:
        rec = json.load(f)
    stages = rec.get("stages", [rec])
    last = stages[-1]
    steps = sum(int(s.get("steps", 0)) for s in stages)
    return (f"drafter: {len(stages)} training stage(s), {steps} steps in all, the last "
            f"{last.get('date', '?')} on {last.get('answer_tokens', '?')} answer tokens")
