"""The methods the benchmarks compare and the engine runner they share.

`spec_of` maps a method name to vLLM's speculative config (None: plain decoding).
`Engine` is one method's vLLM `LLM` in this process (its engine core in its own process,
as users run it) with the engine step profile on (`VLLM_DSPINE_STEP_PROFILE`,
vllm_dspine/step_profile.py); each `measure` call runs one (workload, sampling,
concurrency) setting, its requests submitted as `submission` plans them (waves of c, or
one queue), and returns its row (tokens/s, vLLM's acceptance counters through
`vllm_dspine.serving.metrics`, the step profile's ms per step); `close` runs the abort
probe. `run_method` runs every setting on one engine; `run_interleaved` starts every
method's engine side by side and runs each setting round by round. bench/lib/report.py
turns the rows into tables and plots.
"""

from __future__ import annotations

import os
import re
import tempfile
import time

from vllm_dspine.serving.metrics import acceptance, read_own_metrics, spec_decode_counters

K = 15
PROFILE_ENV = "VLLM_DSPINE_STEP_PROFILE"
FIXED_METHODS = ("dflash", "dspine", "dspine-notail", "dspine-nobridge")


def spec_of(method: str, pair: str) -> dict | None:
    """vLLM's speculative config of `method` on the pair folder `pair` (target/, draft/,
    draft-no-bridge*/ as `python -m vllm_dspine.pairs` writes them); None for plain
    decoding. Methods: plain, ngram, dflash, dspine (fixed 15-draft verification),
    dspine-default (DSpine's defaults: dynamic, the lookup, `fair`), dspine-dynamic
    (dynamic, no lookup, throughput objective), dspine-lookup (dynamic with the prompt lookup, docs/lookup.md) and
    its no-lookup twin dspine-nolookup, dspine-lookup-fair (dspine-lookup with
    `dspine_verify_objective: fair`, docs/dynamic-verification.md; both without the
    corpus lookup), dspine-corpus (dspine-lookup-fair with the corpus lookup), dspine-fair
    (dspine-dynamic with that objective), dspine-skip, dspine-notail, dspine-nobridge, and dspine-fixedN
    (DSpine verifying N drafts every step)."""
    draft = os.path.join(pair, "draft")
    if method in ("dflash", "dspine-nobridge") and not os.path.isdir(
            os.path.join(pair, "draft-no-bridge")):
        raise ValueError(
            f"method {method} needs the no-bridge ablation in {pair}/draft-no-bridge "
            f"(and -dflash), which is not committed (docs/training.md, 'Ablations'): "
            f"train it with `python -m vllm_dspine.train --preset smollm2 --target "
            f"{pair}/target --corpus data/corpus/smollm2 --work WORK --variant no-bridge "
            f"--out {pair}/draft-no-bridge`, or leave {method} out of --methods")
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
    # The dynamic methods name every key that changed default: their rows stay
    # comparable across dates (the lookup and `fair` became the defaults on 2026-12-05).
    if method == "dspine-default":
        # DSpine as a user gets it without DSpine keys (docs/serving.md).
        return {"method": "dspine", "model": draft, "num_speculative_tokens": K}
    if method == "dspine":
        return {"method": "dspine", "model": draft, "num_speculative_tokens": K, **fixed}
    if method == "dspine-dynamic":
        return {"method": "dspine", "model": draft, "num_speculative_tokens": K,
                "dspine_verify": "dynamic", "dspine_lookup": False,
                "dspine_verify_objective": "throughput"}
    if method == "dspine-lookup":
        # dspine-dynamic with the prompt lookup as a second source of drafts
        # (docs/lookup.md), matching 2-4 tokens as the ngram method here does.
        return {"method": "dspine", "model": draft, "num_speculative_tokens": K,
                "dspine_verify": "dynamic", "dspine_lookup": True,
                "dspine_lookup_min": 2, "dspine_lookup_max": 4,
                "dspine_verify_objective": "throughput", "dspine_lookup_corpus": False}
    if method == "dspine-lookup-fair":
        # dspine-lookup with greedy lengths chosen by the requests' log-rates.
        return {"method": "dspine", "model": draft, "num_speculative_tokens": K,
                "dspine_verify": "dynamic", "dspine_lookup": True,
                "dspine_lookup_min": 2, "dspine_lookup_max": 4,
                "dspine_verify_objective": "fair", "dspine_lookup_corpus": False}
    if method == "dspine-corpus":
        # dspine-lookup-fair with the corpus lookup (the drafter folder's
        # lookup_corpus.npz, docs/lookup.md "The corpus lookup").
        return {**spec_of("dspine-lookup-fair", pair), "dspine_lookup_corpus": True}
    if method == "dspine-fair":
        # dspine-dynamic with lengths chosen by the requests' log-rates, no lookup.
        return {"method": "dspine", "model": draft, "num_speculative_tokens": K,
                "dspine_verify": "dynamic", "dspine_verify_objective": "fair",
                "dspine_lookup": False}
    if method == "dspine-nolookup":
        # Its no-lookup twin: the same keys, the lookup off (dspine-dynamic's settings).
        return {"method": "dspine", "model": draft, "num_speculative_tokens": K,
                "dspine_verify": "dynamic", "dspine_lookup": False,
                "dspine_verify_objective": "throughput"}
    if method == "dspine-skip":
        # Dynamic verification with a cost model under which drafting never pays: every
        # step context-only but the probes (the zero-draft path's own cost).
        return {"method": "dspine", "model": draft, "num_speculative_tokens": K,
                "dspine_verify": "dynamic", "dspine_lookup": False,
                "dspine_verify_cost": {"step_s": 10, "token_s": 1, "draft_s": 10}}
    if method == "dspine-notail":
        return {"method": "dspine", "model": draft, "num_speculative_tokens": K,
                "dspine_tail": False, **fixed}
    if method == "dspine-nobridge":
        return {"method": "dspine", "model": os.path.join(pair, "draft-no-bridge"),
                "num_speculative_tokens": K, **fixed}
    m = re.fullmatch(r"dspine-fixed(\d+)", method)
    if m:
        return {"method": "dspine", "model": draft, "num_speculative_tokens": K, **fixed,
                "dspine_verify_max": int(m.group(1))}
    raise ValueError(f"unknown method {method!r}")


def submission(n_prompts: int, c: int, prompts_c1: int | None = None,
               queued: int = 0) -> tuple[int, list[tuple[int, int]]]:
    """How `Engine.measure` submits one setting: (requests, [(first, end) of each
    `generate` call]). Waves (queued 0): max(n_prompts, c) requests (the prompts cycled
    above n_prompts; at c = 1 the first `prompts_c1` only), c per call, so a call lasts
    as long as its slowest request. Queued (queued N > 0): N requests (cycled) in one call
    to an engine of max_num_seqs = c, so a request waits for a free slot and takes it as
    soon as one frees, as a loaded server's do."""
    if c < 1 or n_prompts < 1:
        raise ValueError(f"concurrency {c} and prompts {n_prompts} must be >= 1")
    if queued:
        if queued < c:
            raise ValueError(f"queued {queued} requests cannot fill concurrency {c}")
        return queued, [(0, queued)]
    n = min(prompts_c1, n_prompts) if c == 1 and prompts_c1 else max(n_prompts, c)
    return n, [(i, min(i + c, n)) for i in range(0, n, c)]


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


def source_counts(before: dict | None, after: dict | None) -> dict:
    """DSpine's request-steps and drafts verified per source (drafter / lookup) between
    two profile snapshots (vllm_dspine/step_profile.py `count`)."""
    a = (after or {}).get("counts") or {}
    b = (before or {}).get("counts") or {}
    return {k: a[k] - b.get(k, 0) for k in a}


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
        self.max_num_seqs = max_num_seqs
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
        read_own_metrics(self.llm)
        self.tok = self.llm.get_tokenizer()

    def prompt_ids(self, prompts: list[str]) -> list[list[int]]:
        tok = self.tok
        return [tok(tok.apply_chat_template([{"role": "user", "content": p}],
                                            add_generation_prompt=True, tokenize=False),
                    add_special_tokens=False)["input_ids"] for p in prompts]

    def measure(self, wname: str, ids: list[list[int]], sname: str, c: int,
                max_tokens: int, prompts_c1: int | None = None, queued: int = 0) -> dict:
        """One (workload, sampling, concurrency) setting: its prompts submitted c at a
        time, or with `queued` N > 0 N requests at once to this engine, whose
        max_num_seqs must then be c (`submission`). Returns the row (tokens/s,
        acceptance, per-step profile, outputs)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm_dspine.step_profile import read

        llm = self.llm
        if queued and self.max_num_seqs != c:
            # The engine's max_num_seqs is what bounds the running requests of a queue.
            raise ValueError(f"a queue at concurrency {c} needs an engine of "
                             f"max_num_seqs {c}, not {self.max_num_seqs}")
        # Concurrency 1 is slow on CPU: it may run on the first prompts only; a
        # concurrency above the prompt count cycles the prompts.
        n, calls = submission(len(ids), c, prompts_c1, queued)
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
        before = spec_decode_counters(llm)
        prof0 = read(self.profile_path)
        start = time.perf_counter()
        tokens = 0
        outs = []
        for i, j in calls:
            res = llm.generate([TokensPrompt(prompt_token_ids=x) for x in run_ids[i:j]],
                               params[i:j], use_tqdm=False)
            tokens += sum(len(o.outputs[0].token_ids) for o in res)
            outs.extend(res)
        elapsed = time.perf_counter() - start
        prof1 = read(self.profile_path)
        after = spec_decode_counters(llm)
        tau, per_pos = acceptance(before, after)
        return {"method": self.method, "workload": wname, "sampling": sname,
                "concurrency": c, "prompts": n, "queued": queued, "tokens": tokens,
                "seconds": elapsed, "tok_per_s": tokens / elapsed,
                "acceptance_length": tau, "acceptance_per_pos": per_pos,
                "step_ms": profile_delta(prof0, prof1),
                "sources": source_counts(prof0, prof1),
                "peak_rss_mib": (prof1 or {}).get("peak_rss_mib"),
                "outputs": [list(o.outputs[0].token_ids) for o in outs],
                "_counters": (before, after), "_profile": (prof0, prof1)}

    def close(self, rows: list[dict], first_ids: list[list[int]], log,
              probe_abort: bool = True) -> None:
        """The abort probe (unless `probe_abort` is False), peak memory into this
        engine's rows, shutdown."""
        from vllm_dspine.step_profile import read

        # At most max_num_seqs of the probe's requests run at once: it waits for all.
        probe = (abort_probe(self.llm, first_ids, self.profile_path,
                             min(8, self.max_num_seqs)) if probe_abort
                 else {"abort_ms": None, "kv_usage_after_abort": None})
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
        + ("  sources " + ", ".join(f"{k} {v}" for k, v in sorted(row["sources"].items()))
           if row.get("sources") else "")
        + (f"  step {ms['step']:.1f} ms (target {ms['target_forward']:.1f}, "
           f"drafter {ms['drafter']:.1f})" if ms else "") + suffix)


def run_method(method: str, pair: str, workloads: dict, samplings: list[str],
               concurrencies: list[int], max_tokens: int, log,
               prompts_c1: int | None = None, profile_dir: str | None = None,
               prefix_caching: bool = False, abort_probe: bool = True,
               queued: int = 0) -> list[dict]:
    """Every setting of one method, on one engine started for it (of max_num_seqs the
    largest concurrency; with `queued` N > 0 each setting is N requests in one queue,
    `Engine.measure`, so the concurrencies must then be one)."""
    if queued and len(set(concurrencies)) != 1:
        raise ValueError("a queued run has one concurrency per engine "
                         f"(max_num_seqs = c), not {concurrencies}")
    eng = Engine(method, pair, max(concurrencies), profile_dir, prefix_caching)
    rows = []
    first_ids = None
    for wname, prompts in workloads.items():
        ids = eng.prompt_ids(prompts)
        first_ids = first_ids or ids
        for sname in samplings:
            for c in concurrencies:
                rows.append(eng.measure(wname, ids, sname, c, max_tokens, prompts_c1,
                                        queued))
                log_row(log, rows[-1])
    eng.close(rows, first_ids, log, abort_probe)
    return rows


def run_interleaved(methods: dict[str, list[int]], pair: str, workloads: dict,
                    samplings: list[str], max_tokens: int, rounds: int, log,
                    prompts_c1: int | None = None, prefix_caching: bool = False,
                    fixed_rounds: int = 0, abort_probe: bool = True,
                    queued: int = 0) -> list[dict]:
    """All methods' engines started side by side; each setting then runs `rounds`
    times, every round running each method once (the order rotated round to round), so
    a drift of the machine enters all methods of a round alike. A method's row is its
    totals over the rounds, with `x_plain_rounds`: its tokens/s over plain's of the same
    round. `methods` maps each method to its concurrencies. `fixed_rounds` > 0: the
    methods that verify all 15 drafts run in the first `fixed_rounds` rounds only (at
    concurrency 32 one of their rounds takes as long as ten of the others'). `queued` N
    > 0: each setting is N requests in one queue (`Engine.measure`) on engines of
    max_num_seqs = c, so the methods must then share one concurrency."""
    concs = sorted({c for cs in methods.values() for c in cs})
    if queued and len(concs) != 1:
        raise ValueError(f"a queued run has one concurrency per engine set, not {concs}")
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
                                                               max_tokens, prompts_c1,
                                                               queued))
                        log_row(log, per_round[m][-1], f"  (round {r + 1})")
                plain = per_round.get("plain")
                for m in todo:
                    # Each engine reads its own counters (`read_own_metrics`).
                    rows.append(_merge_rounds(per_round[m], plain))
    for m in names:
        engines[m].close([r for r in rows if r["method"] == m], first_ids, log, abort_probe)
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
    row["sources"] = source_counts(first["_profile"][0], last["_profile"][1])
    row["peak_rss_mib"] = last["peak_rss_mib"]
    if plain is not None:
        row["x_plain_rounds"] = [r["tok_per_s"] / p["tok_per_s"]
                                 for r, p in zip(rounds, plain)]
    return row
