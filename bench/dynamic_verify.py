"""Dynamic verification side by side: plain decoding, DSpine verifying all 15 drafts
(`dspine_verify: fixed`) and DSpine with the dynamic policy (the default), in one run,
at each concurrency and sampling (docs/dynamic-verification.md, issue 14).

For every (sampling, concurrency): output tokens/s of each method; for DSpine the mean
acceptance length from vLLM's counters and, from `vllm:dspine_verified_drafts`, the
drafts verified per request-step and the share of request-steps verifying none.
Concurrency c: the prompts are submitted c at a time (one `generate` per wave), so at
most c requests decode together. Sampled requests carry no seed (a seeded request keeps
the fixed length). Every engine first runs one untimed warm-up wave.

    source scripts/env.sh
    python bench/dynamic_verify.py --pair artifacts/smollm2 \
        [--concurrency 1,8,32] [--sampling greedy,t0.7] [--prompts 32] [--max-tokens 256]
    # seconds-long check on the tiny pair (python -m vllm_dspine.pairs tiny --out DIR):
    python bench/dynamic_verify.py --pair DIR --workload tiny --concurrency 1,4 \
        --prompts 4 --max-tokens 16 --max-model-len 512

Prints a markdown table (and `--json PATH` writes every run).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import platform
import sys
import time

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

METHODS = ("plain", "fixed", "dynamic")
TINY_PROMPTS = ("abcdefgh", "hello there", "the quick brown fox", "0123456789",
                "klmnopq", "xyz", "one two three four", "a b c d e f")


def spec_of(method: str, pair: str) -> dict | None:
    if method == "plain":
        return None
    spec = {"method": "dspine", "model": os.path.join(pair, "draft"),
            "num_speculative_tokens": 15}
    if method == "fixed":
        spec["dspine_verify"] = "fixed"
    return spec


def snapshot(llm) -> dict:
    out = {"hist": [0] * 16}
    for m in llm.get_metrics():
        if m.name.startswith("vllm:spec_decode"):
            out[m.name] = getattr(m, "values", None) or getattr(m, "value", None)
        elif m.name == "vllm:dspine_verified_drafts":
            cum = [m.buckets[f"{float(n)}"] for n in range(16)]
            out["hist"] = [cum[0]] + [cum[n] - cum[n - 1] for n in range(1, 16)]
    return out


def spec_stats(before: dict, after: dict) -> dict:
    d = {k: (after.get(k) or 0) - (before.get(k) or 0) for k in (
        "vllm:spec_decode_num_drafts", "vllm:spec_decode_num_accepted_tokens",
        "vllm:spec_decode_num_draft_tokens")}
    hist = [a - b for a, b in zip(after["hist"], before["hist"])]
    steps = sum(hist)
    drafts = d["vllm:spec_decode_num_drafts"]
    return {
        "acceptance_length": (1 + d["vllm:spec_decode_num_accepted_tokens"] / drafts)
        if drafts else None,
        "verified_per_step": (sum(n * c for n, c in enumerate(hist)) / steps) if steps
        else None,
        "zero_share": hist[0] / steps if steps else None,
        "hist": hist,
    }


def run_method(method: str, args, prompts: list, samplings: list[str],
               concurrencies: list[int], log) -> list[dict]:
    from vllm import LLM, SamplingParams

    llm = LLM(os.path.join(args.pair, "target"), speculative_config=spec_of(method, args.pair),
              dtype="float32", enforce_eager=True, max_model_len=args.max_model_len,
              max_num_seqs=max(concurrencies), seed=0, disable_log_stats=False,
              gpu_memory_utilization=0.15)
    inputs = prompts_for(llm, prompts, args.workload)

    def params(sname):
        if sname == "greedy":
            return SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
        return SamplingParams(temperature=float(sname[1:]), max_tokens=args.max_tokens)

    llm.generate(inputs[:max(concurrencies)], params(samplings[0]), use_tqdm=False)  # warm-up
    rows = []
    for sname in samplings:
        for c in concurrencies:
            n = max(args.prompts, c)
            batch = [inputs[i % len(inputs)] for i in range(n)]
            before = snapshot(llm)
            start = time.perf_counter()
            tokens = 0
            for i in range(0, n, c):
                res = llm.generate(batch[i:i + c], params(sname), use_tqdm=False)
                tokens += sum(len(o.outputs[0].token_ids) for o in res)
            elapsed = time.perf_counter() - start
            row = {"method": method, "sampling": sname, "concurrency": c, "requests": n,
                   "tokens": tokens, "seconds": elapsed, "tok_per_s": tokens / elapsed}
            if method != "plain":
                row.update(spec_stats(before, snapshot(llm)))
            rows.append(row)
            log(f"{method:>8} {sname:>6} c={c:<3} {row['tok_per_s']:8.1f} tok/s"
                + (f"  verified/step {row['verified_per_step']:.2f}"
                   if row.get("verified_per_step") is not None else ""))
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:  # noqa: BLE001
        pass
    del llm
    return rows


def prompts_for(llm, prompts: list[str], workload: str):
    from vllm.inputs import TokensPrompt

    if workload == "tiny":
        return list(prompts)
    tok = llm.get_tokenizer()
    return [TokensPrompt(prompt_token_ids=tok(
        tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                tokenize=False), add_special_tokens=False)["input_ids"])
        for p in prompts]


def table(rows: list[dict]) -> str:
    by = {(r["method"], r["sampling"], r["concurrency"]): r for r in rows}
    keys = sorted({(r["sampling"], r["concurrency"]) for r in rows},
                  key=lambda k: (k[0] != "greedy", k[0], k[1]))
    out = ["| sampling | conc. | plain tok/s | fixed-15 tok/s | x plain | dynamic tok/s "
           "| x plain | x fixed | dyn. verified / req-step | dyn. steps with 0 "
           "| acc. length fixed / dyn. |",
           "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    goals = []
    for s, c in keys:
        p, f, d = (by.get((m, s, c)) for m in METHODS)

        def ratio(a, b):
            return f"{a['tok_per_s'] / b['tok_per_s']:.2f}" if a and b else ""

        def fmt(x, spec="{:.2f}"):
            return "" if x is None else spec.format(x)

        out.append(
            f"| {s} | {c} | {fmt(p and p['tok_per_s'], '{:.1f}')} "
            f"| {fmt(f and f['tok_per_s'], '{:.1f}')} | {ratio(f, p)} "
            f"| {fmt(d and d['tok_per_s'], '{:.1f}')} | {ratio(d, p)} | {ratio(d, f)} "
            f"| {fmt(d and d.get('verified_per_step'))} "
            f"| {fmt(d and d.get('zero_share'), '{:.0%}')} "
            f"| {fmt(f and f.get('acceptance_length'))} / "
            f"{fmt(d and d.get('acceptance_length'))} |")
        if p and f and d:
            goals.append(d["tok_per_s"] >= f["tok_per_s"]
                         and d["tok_per_s"] >= 0.95 * p["tok_per_s"])
    if goals:
        out.append("")
        out.append(f"Goal (dynamic >= fixed-15 and >= 0.95x plain): met in {sum(goals)} of "
                   f"{len(goals)} settings.")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pair", default="artifacts/smollm2")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--workload", default="chat", choices=("chat", "humaneval", "tiny"))
    ap.add_argument("--sampling", default="greedy,t0.7")
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    from vllm_dspine.plugin.cpu_env import set_cpu_defaults

    set_cpu_defaults()
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    if args.workload == "tiny":
        prompts = list(TINY_PROMPTS)
    else:
        from workloads import CHAT_PROMPTS, humaneval_prompts

        prompts = (list(CHAT_PROMPTS) if args.workload == "chat"
                   else humaneval_prompts(os.path.join(args.pair, "cache")))
    samplings = args.sampling.split(",")
    concs = [int(c) for c in args.concurrency.split(",")]
    t0 = time.time()

    def log(msg):
        print(f"[{time.time() - t0:6.0f}s] {msg}", flush=True)

    rows = []
    for m in args.methods.split(","):
        log(f"starting {m} ...")
        rows.extend(run_method(m, args, prompts, samplings, concs, log))
    import torch

    head = (f"### Dynamic verification (bench/dynamic_verify.py), "
            f"{datetime.date.today().isoformat()}\n\n"
            f"Pair {args.pair}, workload {args.workload}; {os.cpu_count()}-core "
            f"{platform.machine()}, torch {torch.__version__}, vLLM 0.32.0, fp32, eager; "
            f"{args.prompts} requests per setting (at least the concurrency), "
            f"{args.max_tokens} new tokens at most; sampled requests unseeded. "
            f"Command: `python bench/dynamic_verify.py {' '.join(sys.argv[1:])}`. "
            f"Wall {time.time() - t0:.0f} s.\n")
    print("\n" + head + "\n" + table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f)


if __name__ == "__main__":
    main()
