"""Engines in this process, one concurrency: what dynamic verification chose and why, and
several methods side by side in short interleaved rounds. For looking into the policy
and into where a step's time goes; bench/e2e.py is the benchmark of record.

    source scripts/env.sh
    OMP_NUM_THREADS=1 taskset -c 0 python bench/policy_probe.py dspine-dynamic --concurrency 1
    python bench/policy_probe.py plain --concurrency 32 --max-tokens 96
    python bench/policy_probe.py dspine-dynamic --concurrency 8 --prompts 8 \\
        --temperature 0.7 --verify-cost '{"step_s": 10, "token_s": 1, "draft_s": 10}'
    python bench/policy_probe.py plain,dspine-dynamic,dspine-fixed4 --rounds 10 \\
        --max-tokens 64          # three engines, ten interleaved rounds

METHODS is one method of bench/lib/engines.py (plain, ngram, dspine, dspine-dynamic,
dspine-skip, `dspine-fixedN`: DSpine verifying N drafts every step, ...) or several
separated by commas. Each round runs `--concurrency`
HumanEval (or `--workload chat`) prompts at a time (greedy or `--temperature` with top-p 0.95, `ignore_eos`,
chat template applied; `--prompts` of them, a different slice each round) through
`LLM.generate` on every engine, the order rotated round to round, after a 16-token
warm-up request each (none with `--no-warmup`: the rounds then hold the dynamic policy's
own warm-up at their concurrency, docs/dynamic-verification.md "The warm-up"). Prefix
caching is off (a draft model loses the last cached block, bench/e2e.py). vLLM's engine cores run in this process
(`VLLM_ENABLE_V1_MULTIPROCESSING=0`) with the step profile on (`VLLM_DSPINE_STEP_PROFILE`),
so each proposer's `DynamicVerifier` can be read at the end.

Prints per method its tokens/s over the first method's per round and their median, the
median step profile (ms per step), and for a dynamic DSpine method the verifier's summary
(verified-length histogram, drafted vs context-only steps, drafts accepted against what the
policy expected, the step-cost curve) and its greedy calibration table (per position
group: confidence bin centre: observations / accepted share). The summary counts since the
verifier's last 30-second log line; below it, over the measured rounds, the steps it
saw, those that verified drafts and those whose drafter ran its block (`StepCounts`).

`--steps` records every request-step of the rounds that verified drafts (source,
drafts verified, accepted drafts the policy expected, accepted drafts vLLM reported) and
prints per source the request-steps and accepted drafts a step, vLLM's mean acceptance
length over them, and what that mean would be had the drafter's request-steps whose
expected accepted drafts fall below x not been verified (x = 0.3 .. 0.9), with the
accepted drafts that would cost (docs/lookup.md, "What is left"); `--steps-json FILE`
writes the records.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys
import tempfile
import time

if not __package__:  # `python bench/policy_probe.py`: import `bench` from the repository root
    sys.path[0] = str(pathlib.Path(__file__).resolve().parents[1])

from bench.lib.engines import spec_of  # noqa: E402
from bench.lib.pair import ensure_pair  # noqa: E402
from bench.lib.report import REPO  # noqa: E402
from bench.lib.workloads import CHAT_PROMPTS, humaneval_prompts  # noqa: E402


def verifier_of(llm):
    """The `DynamicVerifier` of an engine in this process (None: not dynamic DSpine)."""
    core = llm.llm_engine.engine_core.engine_core
    runner = core.model_executor.driver_worker.worker.model_runner
    return getattr(getattr(runner, "drafter", None), "_verifier", None)


class StepRecorder:
    """Every request-step a `DynamicVerifier` sends drafts to verification: its source
    (DRAFTER / LOOKUP), drafts verified, accepted drafts the policy expected, and accepted
    drafts vLLM reported (read at the next step's `begin`). Wraps the instance's methods."""

    def __init__(self, verifier) -> None:
        self.rows: list[dict] = []
        self._open: dict[str, dict] = {}
        begin, choose, lookup_only = (verifier.begin, verifier.choose,
                                      verifier.choose_lookup_only)

        def recorded_begin(req_ids, verified, rejected, num_tokens):
            begin(req_ids, verified, rejected, num_tokens)
            for rid, (_, accepted) in verifier._observed.items():
                if rid in self._open:
                    self._open[rid]["accepted"] = accepted
            self._open = {}

        def record(req_ids, lengths):
            for i, rid in enumerate(req_ids):
                _, _, expected, source = verifier._last.get(rid, (None,) * 4)
                if lengths[i] > 0 and source is not None:
                    row = {"request": rid, "source": int(source),
                           "verified": int(lengths[i]), "expected": expected}
                    self.rows.append(row)
                    self._open[rid] = row
            return lengths

        verifier.begin = recorded_begin
        verifier.choose = lambda req_ids, *a, **k: record(req_ids, choose(req_ids, *a, **k))
        verifier.choose_lookup_only = lambda req_ids, *a, **k: record(
            req_ids, lookup_only(req_ids, *a, **k))

    def report(self, name: str) -> None:
        from vllm_dspine.proposer.dynamic import DRAFTER, LOOKUP

        rows = [r for r in self.rows if "accepted" in r]
        if not rows:
            return
        accepted = sum(r["accepted"] for r in rows)
        print(f"steps of {name}: {len(rows)} request-steps verified drafts, mean acceptance "
              f"length {1 + accepted / len(rows):.2f} (vLLM's counter over them)")
        for source, label in ((LOOKUP, "lookup"), (DRAFTER, "drafter")):
            mine = [r for r in rows if r["source"] == source]
            if mine:
                print(f"  {label}: {len(mine)} request-steps, "
                      f"{sum(r['accepted'] for r in mine) / len(mine):.2f} accepted and "
                      f"{sum(r['verified'] for r in mine) / len(mine):.2f} verified a step")
        for x in (0.3, 0.5, 0.7, 0.9):
            drop = [r for r in rows if r["source"] == DRAFTER and r["expected"] is not None
                    and r["expected"] < x]
            kept = len(rows) - len(drop)
            lost = sum(r["accepted"] for r in drop)
            if kept:
                print(f"  without the drafter's request-steps expected below {x}: "
                      f"{len(drop)} fewer, mean acceptance length "
                      f"{1 + (accepted - lost) / kept:.2f}, {lost} accepted drafts "
                      f"({sum(r['verified'] for r in drop)} verified) not taken")


class StepCounts:
    """Over the measured rounds (installed after the warm-up): the engine steps a dynamic
    DSpine verifier saw, those that verified any drafts, and those in which the drafter
    ran its block (`end(drafted=True)`; the others wrote its context only: the drafter
    skipped, or the prompt lookup in its place). Wraps the instance."""

    def __init__(self, verifier) -> None:
        self.steps = self.verified = self.blocks = 0
        begin, end = verifier.begin, verifier.end

        def counted_begin(req_ids, verified, rejected, num_tokens):
            self.steps += 1
            self.verified += int(sum(verified) > 0)
            return begin(req_ids, verified, rejected, num_tokens)

        def counted_end(req_ids, drafted):
            self.blocks += int(drafted)
            return end(req_ids, drafted)

        verifier.begin, verifier.end = counted_begin, counted_end

    def report(self, name: str) -> None:
        print(f"steps of {name} in the rounds: {self.steps}, {self.verified} of them "
              f"verified drafts; the drafter's block ran in {self.blocks} (the others: "
              f"its context only)")


def print_policy(name: str, llm) -> None:
    verifier = verifier_of(llm)
    if verifier is None:
        return
    print(f"policy of {name}:", json.dumps(verifier.summary()), "row budget",
          verifier.row_budget)
    cal = verifier.calibrator
    centres = (cal.EDGES[:-1] + cal.EDGES[1:]) / 2
    for group, label in enumerate(("draft 1", "drafts 2-3", "drafts 4-7", "drafts 8-15")):
        cells = [f"{centres[b]:.2f}: {int(n)} / {cal.success[0, group, b] / n:.2f}"
                 for b, n in enumerate(cal.trials[0, group]) if n > 0]
        print(f"  greedy calibration, {label}:", ", ".join(cells) or "-")
    lk = verifier.lookup_calibrator
    for group, label in enumerate(("draft 1", "drafts 2-3", "drafts 4-7", "drafts 8-15")):
        # Bins of the lookup's calibrator: (where the match lies, match length).
        cells = [f"{('prompt', 'answer')[b // 5]}/{b % 5 + 1}: {int(n)} / "
                 f"{lk.success[0, group, b] / n:.2f}"
                 for b, n in enumerate(lk.trials[0, group]) if n > 0]
        if cells:
            print(f"  lookup greedy calibration, {label}:", ", ".join(cells))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("methods", help="method(s) of bench/lib/engines.py, comma-separated; "
                    "dspine-fixedN verifies N drafts every step")
    ap.add_argument("--pair", default=str(REPO / "artifacts" / "smollm2"))
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument("--prompts", type=int, default=2,
                    help="prompts per round (at least --concurrency)")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--workload", choices=("humaneval", "chat"), default="humaneval",
                    help="HumanEval prompts or bench/lib/workloads.py's chat prompts")
    ap.add_argument("--verify-cost", default=None,
                    help="a dspine_verify_cost JSON for the DSpine methods (a cost model "
                    "that never pays gives the steps without drafts)")
    ap.add_argument("--no-warmup", action="store_true",
                    help="no 16-token request before the rounds: they then include the "
                    "policy's own warm-up (its cost model empty) at this concurrency")
    ap.add_argument("--steps", action="store_true",
                    help="record the request-steps that verified drafts (module doc)")
    ap.add_argument("--steps-json", default=None, help="write those records here")
    args = ap.parse_args()

    from vllm_dspine.cpu_env import set_cpu_defaults

    set_cpu_defaults()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    profile_path = os.path.join(tempfile.mkdtemp(prefix="dspine-probe-"), "profile.json")
    os.environ["VLLM_DSPINE_STEP_PROFILE"] = profile_path
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from vllm_dspine.step_profile import profile

    pair = pathlib.Path(ensure_pair(args.pair))
    conc = max(1, args.concurrency)
    per_round = max(args.prompts, conc)
    names = args.methods.split(",")
    engines = {}
    for name in names:
        spec = spec_of(name, str(pair))
        if args.verify_cost is not None and spec is not None and spec["method"] == "dspine":
            spec["dspine_verify_cost"] = json.loads(args.verify_cost)
        engines[name] = LLM(str(pair / "target"), speculative_config=spec,
                            dtype="float32", enforce_eager=True, max_model_len=2048,
                            max_num_seqs=conc, seed=0, gpu_memory_utilization=0.1,
                            enable_prefix_caching=False)
    tok = engines[names[0]].get_tokenizer()
    texts = (humaneval_prompts(str(pair / "cache")) if args.workload == "humaneval"
             else list(CHAT_PROMPTS))
    ids = [tok(tok.apply_chat_template([{"role": "user", "content": t}],
                                       add_generation_prompt=True, tokenize=False),
               add_special_tokens=False)["input_ids"] for t in texts]
    for llm in engines.values() if not args.no_warmup else ():
        llm.generate([TokensPrompt(prompt_token_ids=ids[-1])], SamplingParams(max_tokens=16),
                     use_tqdm=False)
    params = SamplingParams(temperature=args.temperature,
                            top_p=0.95 if args.temperature > 0 else 1.0,
                            max_tokens=args.max_tokens, ignore_eos=True)
    prof = profile()  # the engines share this process's step profile; one runs at a time
    recorders = {}
    counts = {name: StepCounts(v) for name, v in
              ((n, verifier_of(llm)) for n, llm in engines.items()) if v is not None}
    if args.steps or args.steps_json:
        for name, llm in engines.items():
            verifier = verifier_of(llm)
            if verifier is not None:  # installed after the warm-up requests
                recorders[name] = StepRecorder(verifier)
    rows: dict[str, list[dict]] = {n: [] for n in names}
    for r in range(args.rounds):
        batch = [ids[(r * per_round + j) % len(ids)] for j in range(per_round)]
        for name in names[r % len(names):] + names[:r % len(names)]:
            before, steps0 = dict(prof.seconds), prof.steps
            t0, tokens = time.perf_counter(), 0
            for i in range(0, per_round, conc):
                outs = engines[name].generate(
                    [TokensPrompt(prompt_token_ids=x) for x in batch[i:i + conc]], params,
                    use_tqdm=False)
                tokens += sum(len(o.outputs[0].token_ids) for o in outs)
            seconds = time.perf_counter() - t0
            steps = max(prof.steps - steps0, 1)
            rows[name].append({"tok_s": tokens / seconds, "steps": steps, **{
                k: 1e3 * (v - before[k]) / steps for k, v in prof.seconds.items()}})
    base = names[0]
    for name in names:
        ratios = [a["tok_s"] / b["tok_s"] for a, b in zip(rows[name], rows[base])]
        med = {k: round(statistics.median(x[k] for x in rows[name]), 2)
               for k in rows[name][0]}
        print(f"{name} c={conc}: {med['tok_s']:.1f} tok/s (median of {args.rounds} rounds),"
              f" x {base} {statistics.median(ratios):.3f} (rounds "
              f"{' / '.join(f'{x:.2f}' for x in ratios)}); ms per step "
              f"{ {k: v for k, v in med.items() if k != 'tok_s'} }")
    for name in names:
        print_policy(name, engines[name])
    for name, c in counts.items():
        c.report(name)
    for name, rec in recorders.items():
        rec.report(name)
    if args.steps_json:
        with open(args.steps_json, "w") as f:
            json.dump({n: r.rows for n, r in recorders.items()}, f)


if __name__ == "__main__":
    main()
