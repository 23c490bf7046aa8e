"""The CPU operations whose cost shapes a DSpine step on this machine, each beside the
alternative it replaced (one thread, fp32; figures quoted in docs/dynamic-verification.md,
docs/verify.md and docs/kernels.md come from this script):

  1. target layers: SmolLM2's 30 layers of GEMMs (q/k/v, o, gate/up, down) through
     vLLM's oneDNN handles, weights streamed from memory, for M = 1 .. 16 rows (the
     target tokens of a step at concurrency 1: 1 + verified drafts). Shows why the
     step-cost curve is not made monotonic (proposer/dynamic.py, MeasuredStepCost).
  2. retrieval head [6227, 576] (the SmolLM2 drafter's retrieval vocabulary): torch's
     F.linear (MKL) against `FixedWeightMatmul` (vLLM's oneDNN), kernels/cpu_gemm.py.
  3. top-k/top-p of verified draft rows at vocabulary 49,152: vLLM's
     `apply_top_k_top_p_pytorch` against `apply_top_k_top_p_values_sorted`
     (verify/top_k_top_p.py), which returns the same tensor.

Sizes are interleaved round by round and the median taken (this machine's speed drifts).

    source scripts/env.sh
    OMP_NUM_THREADS=1 taskset -c 0 .venv/bin/python bench/bench_cpu_ops.py

Prints markdown tables and replaces its section of docs/benchmarks.md (`--no-doc`:
print only).
"""

from __future__ import annotations

import argparse
import datetime
import pathlib
import statistics
import sys
import time

import torch

if not __package__:  # `python bench/bench_cpu_ops.py`: import `bench` from the repository root
    sys.path[0] = str(pathlib.Path(__file__).resolve().parents[1])

from bench.lib.report import DOC, machine, replace_section  # noqa: E402

SECTION = "bench_cpu_ops"
# SmolLM2-135M: hidden 576, 9 heads / 3 KV heads of 64, FFN 1536, 30 layers.
LAYER_SHAPES = [(576, 576 + 2 * 192), (576, 576), (576, 2 * 1536), (1536, 576)]  # (K, N)


def _median_ms(samples: list[float]) -> float:
    return 1e3 * statistics.median(samples)


def target_layers(rounds: int, sizes: list[int]) -> dict[int, float]:
    from vllm import _custom_ops as ops

    g = torch.Generator().manual_seed(0)
    layers = [[(ops.create_onednn_mm(torch.randn(N, K, generator=g).t(), 32), K)
               for K, N in LAYER_SHAPES] for _ in range(30)]
    xs = {M: {K: torch.randn(M, K, generator=g) for K in (576, 1536)} for M in sizes}
    times: dict[int, list[float]] = {M: [] for M in sizes}
    for _ in range(rounds):
        for M in sizes:
            t0 = time.perf_counter()
            for handles in layers:
                for h, K in handles:
                    ops.onednn_mm(h, xs[M][K], None)
            times[M].append(time.perf_counter() - t0)
    return {M: _median_ms(t) for M, t in times.items()}


def retrieval_head(rounds: int, sizes: list[int]) -> dict[int, tuple[float, float]]:
    from vllm_dspine.kernels.cpu_gemm import FixedWeightMatmul

    g = torch.Generator().manual_seed(1)
    head = torch.randn(6227, 576, generator=g)
    fast = FixedWeightMatmul(head)
    assert fast.uses_onednn, "vLLM's oneDNN matmul is not available in this build"
    xs = {M: torch.randn(M, 576, generator=g) for M in sizes}
    times = {M: ([], []) for M in sizes}
    for _ in range(rounds):
        for M in sizes:
            for i, f in enumerate((lambda x: torch.nn.functional.linear(x, head), fast)):
                t0 = time.perf_counter()
                f(xs[M])
                times[M][i].append(time.perf_counter() - t0)
    return {M: (_median_ms(a), _median_ms(b)) for M, (a, b) in times.items()}


def top_p_rows(rounds: int, sizes: list[int]) -> dict[int, tuple[float, float]]:
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch

    from vllm_dspine.verify.top_k_top_p import apply_top_k_top_p_values_sorted

    g = torch.Generator().manual_seed(2)
    times = {R: ([], []) for R in sizes}
    for _ in range(rounds):
        for R in sizes:
            logits = torch.randn(R, 49152, generator=g) * 3 / 0.7
            p = torch.full((R,), 0.95)
            want = None
            for i, f in enumerate((
                    lambda x: apply_top_k_top_p_pytorch(x, None, p, allow_cpu_sync=True),
                    lambda x: apply_top_k_top_p_values_sorted(x, None, p))):
                x = logits.clone()
                t0 = time.perf_counter()
                out = f(x)
                times[R][i].append(time.perf_counter() - t0)
                if want is None:
                    want = out
                else:
                    assert torch.equal(out, want), "the two top-p functions disagree"
    return {R: (_median_ms(a), _median_ms(b)) for R, (a, b) in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--no-doc", action="store_true")
    ap.add_argument("--doc", default=str(DOC))
    args = ap.parse_args()
    from vllm.platforms.cpu import CpuPlatform

    CpuPlatform.import_kernels()
    torch.set_num_threads(1)
    t0 = time.time()
    layer_sizes = [1, 2, 3, 4, 5, 6, 8, 9, 16]
    layers = target_layers(args.rounds, layer_sizes)
    head = retrieval_head(args.rounds * 4, [1, 2, 3, 5, 16])
    top_p = top_p_rows(max(3, args.rounds // 3), [1, 4, 16])
    out = [f"### CPU operations of a DSpine step (bench/bench_cpu_ops.py), "
           f"{datetime.date.today().isoformat()}\n",
           f"Machine: {machine()}; torch {torch.__version__}, one thread, fp32. Command: "
           f"`OMP_NUM_THREADS=1 taskset -c 0 python bench/bench_cpu_ops.py "
           f"{' '.join(sys.argv[1:])}`. Medians of {args.rounds} interleaved rounds "
           f"(retrieval: {args.rounds * 4}, top-p: {max(3, args.rounds // 3)}). "
           f"Wall {time.time() - t0:.0f} s.\n",
           "SmolLM2's 30 target layers (GEMMs only, vLLM's oneDNN, weights streamed from "
           "memory), by rows M (at concurrency 1: 1 + verified drafts):\n",
           "| M | " + " | ".join(str(M) for M in layer_sizes) + " |",
           "| --- |" + " ---: |" * len(layer_sizes),
           "| ms | " + " | ".join(f"{layers[M]:.1f}" for M in layer_sizes) + " |\n",
           "Retrieval head [6227, 576] (`x @ head.T`), ms:\n",
           "| rows | torch F.linear | FixedWeightMatmul (oneDNN) | ratio |",
           "| ---: | ---: | ---: | ---: |"]
    out += [f"| {M} | {a:.3f} | {b:.3f} | {a / b:.1f}x |" for M, (a, b) in head.items()]
    out += ["", "Top-p 0.95 on draft rows at vocabulary 49,152 (temperature 0.7 logits), ms; "
            "both return the same tensor (asserted):\n",
            "| rows | vLLM apply_top_k_top_p_pytorch | apply_top_k_top_p_values_sorted | ratio |",
            "| ---: | ---: | ---: | ---: |"]
    out += [f"| {R} | {a:.1f} | {b:.1f} | {a / b:.1f}x |" for R, (a, b) in top_p.items()]
    body = "\n".join(out) + "\n"
    print(body)
    if not args.no_doc:
        replace_section(args.doc, SECTION, body)


if __name__ == "__main__":
    main()
