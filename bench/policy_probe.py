"""One engine in this process, one method, one concurrency: what dynamic verification
chose and why. For looking into the policy; bench/e2e.py is the side-by-side benchmark.

    source scripts/env.sh
    OMP_NUM_THREADS=1 taskset -c 0 python bench/policy_probe.py dspine-dynamic --concurrency 1
    python bench/policy_probe.py plain --concurrency 32 --max-tokens 96
    python bench/policy_probe.py dspine-dynamic --concurrency 8 --prompts 8 \
        --temperature 0.7 --verify-cost '{"step_s": 10, "token_s": 1, "draft_s": 10}'

Runs `--concurrency` HumanEval prompts at a time (greedy or `--temperature`, `ignore_eos`,
chat template applied) through `LLM.generate` after a 16-token warm-up request, with the engine's step
profile on (`VLLM_DSPINE_STEP_PROFILE`) and vLLM's engine core in this process
(`VLLM_ENABLE_V1_MULTIPROCESSING=0`), so the proposer's `DynamicVerifier` can be read at
the end. Prints tokens/s, the step profile per step (ms), and for a DSpine method the
verifier's summary (verified-length histogram, drafted vs context-only steps, drafts
accepted against what the policy expected, the step-cost curve) and its greedy
calibration table (per position group: confidence bin centre: observations / accepted
share). The summary counts since the verifier's last 30-second log line.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import tempfile
import time

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("method", help="a method of bench/e2e.py (plain, ngram, dspine, "
                    "dspine-dynamic, ...)")
    ap.add_argument("--pair", default=str(HERE.parent / "artifacts" / "smollm2"))
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument("--prompts", type=int, default=2,
                    help="prompts in all (at least --concurrency)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--verify-cost", default=None,
                    help="a dspine_verify_cost JSON for a DSpine method (a cost model "
                    "that never pays gives the steps without drafts)")
    args = ap.parse_args()

    from vllm_dspine.plugin.cpu_env import set_cpu_defaults

    set_cpu_defaults()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    profile_path = os.path.join(tempfile.mkdtemp(prefix="dspine-probe-"), "profile.json")
    os.environ["VLLM_DSPINE_STEP_PROFILE"] = profile_path
    from e2e import spec_of
    from workloads import humaneval_prompts

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from vllm_dspine.plugin.step_profile import read

    pair = pathlib.Path(args.pair)
    conc = max(1, args.concurrency)
    spec = spec_of(args.method, pair)
    if args.verify_cost is not None:
        if spec is None or spec.get("method") != "dspine":
            raise SystemExit("--verify-cost needs a DSpine method")
        spec["dspine_verify_cost"] = json.loads(args.verify_cost)
    llm = LLM(str(pair / "target"), speculative_config=spec,
              dtype="float32", enforce_eager=True, max_model_len=2048, max_num_seqs=conc,
              seed=0, gpu_memory_utilization=0.15)
    tok = llm.get_tokenizer()
    texts = humaneval_prompts(str(pair / "cache"))[:max(args.prompts, conc)]
    ids = [tok(tok.apply_chat_template([{"role": "user", "content": t}],
                                       add_generation_prompt=True, tokenize=False),
               add_special_tokens=False)["input_ids"] for t in texts]
    llm.generate([TokensPrompt(prompt_token_ids=ids[0])], SamplingParams(max_tokens=16),
                 use_tqdm=False)
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens,
                            ignore_eos=True)
    before = read(profile_path)
    t0, tokens = time.perf_counter(), 0
    for i in range(0, len(ids), conc):
        outs = llm.generate([TokensPrompt(prompt_token_ids=x) for x in ids[i:i + conc]],
                            params, use_tqdm=False)
        tokens += sum(len(o.outputs[0].token_ids) for o in outs)
    seconds = time.perf_counter() - t0
    after = read(profile_path)
    steps = after["steps"] - before["steps"]
    per_step = {k: round(1e3 * (v - before["seconds"][k]) / max(steps, 1), 2)
                for k, v in after["seconds"].items()}
    print(f"{args.method} c={conc}: {tokens / seconds:.1f} tok/s, {steps} steps, "
          f"{tokens} tokens; ms per step {per_step}")

    core = llm.llm_engine.engine_core.engine_core
    runner = core.model_executor.driver_worker.worker.model_runner
    verifier = getattr(getattr(runner, "drafter", None), "_verifier", None)
    if verifier is None:
        return
    print("policy:", json.dumps(verifier.summary()), "row budget", verifier.row_budget)
    cal = verifier.calibrator
    centres = (cal.EDGES[:-1] + cal.EDGES[1:]) / 2
    for group, name in enumerate(("draft 1", "drafts 2-3", "drafts 4-7", "drafts 8-15")):
        cells = [f"{centres[b]:.2f}: {int(n)} / {cal.success[0, group, b] / n:.2f}"
                 for b, n in enumerate(cal.trials[0, group]) if n > 0]
        print(f"greedy calibration, {name}:", ", ".join(cells) or "-")


if __name__ == "__main__":
    main()
