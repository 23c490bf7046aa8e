"""Write the benchmarks' prompts (HumanEval's 164 and the chat set) as JSON lines for a
held-out corpus: `python -m vllm_dspine.train.corpus --held-out-prompts FILE ...` makes
the target's greedy answers to them, which `python -m vllm_dspine.train --held-out-corpus`
measures acceptance on. These prompts are never trained on.

    python bench/held_out_prompts.py --out FILE [--cache artifacts/cache]
"""

import argparse
import json
import os
import pathlib
import sys

if not __package__:  # `python bench/held_out_prompts.py`: import `bench` from the root
    sys.path[0] = str(pathlib.Path(__file__).resolve().parents[1])

from bench.lib.workloads import CHAT_PROMPTS, humaneval_prompts  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--cache", default=os.path.join("artifacts", "cache"))
    args = ap.parse_args()
    with open(args.out, "w") as f:
        for i, p in enumerate(humaneval_prompts(args.cache)):
            f.write(json.dumps({"source": "humaneval", "key": f"humaneval:{i}",
                                "prompt": p}) + "\n")
        for i, p in enumerate(CHAT_PROMPTS):
            f.write(json.dumps({"source": "bench-chat", "key": f"bench-chat:{i}",
                                "prompt": p}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
