"""The README's main job: DSpine speculative decoding through vLLM on CPU.

Writes the small embedded target/drafter pair (a 6-layer Qwen3 target and its 2-layer
DSpine drafter, distilled from it when the trainer is available), then runs the same
prompts through vLLM without and with `"method": "dspine"` and prints the generations,
vLLM's own spec-decode counters (mean acceptance length, acceptance per draft position)
and tokens/s of both.

    python examples/demo.py [--out artifacts/tiny-pair] [--prompts 16] [--max-tokens 96]
"""

from __future__ import annotations

import argparse
import os
import time


def _env() -> None:
    from vllm_dspine.plugin.cpu_env import set_cpu_defaults

    set_cpu_defaults()
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


def write_pair(out: str):
    """The small pair with its distilled drafter, written once (~1 minute) and reused."""
    from vllm_dspine.pairs.tiny import EOS_TOKEN_ID, MASK_TOKEN_ID, TinyPair, write_tiny_pair

    marker = os.path.join(out, ".complete")
    if os.path.exists(marker):
        return TinyPair(os.path.join(out, "target"), os.path.join(out, "draft"),
                        MASK_TOKEN_ID, EOS_TOKEN_ID)
    print(f"writing the small pair and distilling its drafter to {out} ...", flush=True)
    pair = write_tiny_pair(out, seed=0, trained=True)
    open(marker, "w").close()
    return pair


def run(llm, prompts, params):
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return outs, tokens / elapsed


def spec_counters(llm) -> dict:
    out = {}
    for m in llm.get_metrics():
        if m.name.startswith("vllm:spec_decode"):
            out[m.name] = getattr(m, "values", None) or getattr(m, "value", None)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="artifacts/tiny-pair")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=96)
    args = ap.parse_args()
    _env()

    from vllm import LLM, SamplingParams

    pair = write_pair(args.out)
    seeds = ["abcdef", "the quick brown", "hello world. ", "klmno", "0123",
             "vllm serves ", "spec decode ", "xyz "]
    prompts = [seeds[i % len(seeds)] * (1 + i // len(seeds)) for i in range(args.prompts)]
    greedy = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    sampled = SamplingParams(temperature=0.8, top_p=0.95, seed=7,
                             max_tokens=args.max_tokens, ignore_eos=True)
    common = dict(dtype="float32", max_model_len=1024, enforce_eager=True, seed=0,
                  max_num_seqs=max(8, args.prompts), gpu_memory_utilization=0.15,
                  disable_log_stats=False)

    print("starting vLLM without speculation ...", flush=True)
    plain = LLM(pair.target_dir, **common)
    plain_outs, plain_tps = run(plain, prompts, greedy)
    _, plain_tps_s = run(plain, prompts, sampled)
    del plain

    print("starting vLLM with DSpine ...", flush=True)
    spec = {"method": "dspine", "model": pair.draft_dir, "num_speculative_tokens": 15}
    llm = LLM(pair.target_dir, speculative_config=spec, **common)
    spec_outs, spec_tps = run(llm, prompts, greedy)
    greedy_counters = spec_counters(llm)
    _, spec_tps_s = run(llm, prompts, sampled)
    counters = spec_counters(llm)

    print("\n=== generations (greedy, DSpine; distilled drafter) ===")
    same = 0
    for p, o, q in zip(prompts, spec_outs, plain_outs):
        same += list(o.outputs[0].token_ids) == list(q.outputs[0].token_ids)
        print(f"{p!r:>28} -> {o.outputs[0].text[:60]!r}")
    print(f"greedy outputs identical to plain decoding: {same}/{len(prompts)}")

    def report(title, c, base=None):
        drafts = c.get("vllm:spec_decode_num_drafts", 0) - (base or {}).get(
            "vllm:spec_decode_num_drafts", 0)
        acc = c.get("vllm:spec_decode_num_accepted_tokens", 0) - (base or {}).get(
            "vllm:spec_decode_num_accepted_tokens", 0)
        per_pos = c.get("vllm:spec_decode_num_accepted_tokens_per_pos") or []
        if base:
            per_pos = [a - b for a, b in zip(per_pos, base.get(
                "vllm:spec_decode_num_accepted_tokens_per_pos") or [0] * len(per_pos))]
        print(f"\n=== {title} ===")
        if not drafts:
            print("no drafts")
            return
        print(f"verification steps: {drafts}, mean acceptance length "
              f"(tokens per step, incl. the target's own): {1 + acc / drafts:.2f}")
        print("acceptance rate per draft position: " + " ".join(
            f"{i + 1}:{n / drafts:.2f}" for i, n in enumerate(per_pos)))

    report("acceptance, greedy", greedy_counters)
    report("acceptance, sampled (T=0.8, top_p=0.95)", counters, greedy_counters)
    print("\n=== throughput (2-core CPU; tiny target, so per-step overhead dominates) ===")
    print(f"{'':>10} {'plain tok/s':>12} {'DSpine tok/s':>13}")
    print(f"{'greedy':>10} {plain_tps:>12.1f} {spec_tps:>13.1f}")
    print(f"{'sampled':>10} {plain_tps_s:>12.1f} {spec_tps_s:>13.1f}")


if __name__ == "__main__":
    main()
