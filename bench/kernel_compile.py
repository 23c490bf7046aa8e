"""What ptxas makes of every Triton kernel of the package, per GPU target, without a GPU.

    python bench/kernel_compile.py            # ~30 s on one core; replaces its section
    python bench/kernel_compile.py --no-docs  # print only

Each kernel is compiled ahead of time (`vllm_dspine/kernels/aot.py`) for A100 (sm_80),
L40S (sm_89, the smallest FP8 target) and H100/H200 (sm_90) at the shapes of
`bench/lib/kernel_cases.py` (the released Qwen3.8-27B drafter and the SmolLM2 pair's,
8 requests), with the block sizes, grid and warps its launcher picks there. Per kernel
and target: registers per thread, local memory per thread (register spills; 0 = none),
shared memory per block against the target's limit (163 / 99 / 227 KiB), warps and
pipeline stages. A compile error, a spill or shared memory over a limit exits with 1.
Nothing runs: these are compiler figures, not timings. Replaces the section
`kernel_compile` of docs/benchmarks.md. Run it with TRITON_INTERPRET unset.
"""

from __future__ import annotations

import argparse
import datetime
import os
import pathlib
import sys
import time

if os.environ.get("TRITON_INTERPRET") == "1":
    sys.exit("bench/kernel_compile.py compiles real kernels: unset TRITON_INTERPRET")
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9's default, stated

if not __package__:  # `python bench/kernel_compile.py`: import `bench` from the repository root
    sys.path[0] = str(pathlib.Path(__file__).resolve().parents[1])

import triton  # noqa: E402

from bench.lib.kernel_cases import CASES, REQS, compile_all  # noqa: E402
from bench.lib.report import DOC, git_rev, machine, replace_section  # noqa: E402
from vllm_dspine.kernels.aot import TARGETS  # noqa: E402

SECTION = "kernel_compile"
# The launcher's choices worth showing beside the figures (constexpr names).
BLOCK_KEYS = ("BLOCK_N", "BLOCK_H", "BLOCK_C", "BLOCK_M", "BLOCK_V", "BLOCK_K", "BLOCK_R",
              "BLOCK_SIZE", "H_PER_SPLIT", "NUM_SPLITS", "BV", "BK", "BD")


def _cell(build) -> str:
    """regs / spill B / shared KiB / warps x stages of one build."""
    flag = "" if build.fits else " **!**"
    return (f"{build.registers} / {build.local_bytes} / {build.shared_bytes / 1024:.1f} / "
            f"{build.num_warps}x{build.num_stages}{flag}")


def table(results) -> tuple[list[str], list[str]]:
    """Markdown rows (one per case and kernel, one column per target) and the problems
    (spills, shared memory over a limit)."""
    targets = [t for t in TARGETS]
    header = ("| kernel | case (shapes) | launcher's blocks (sm_90 grid) | "
              + " | ".join(f"sm_{t.capability} {t.name}" for t in targets) + " |")
    lines = [header, "| --- | --- | --- |" + " ---: |" * len(targets)]
    problems = []
    by_case: dict[tuple, dict] = {}
    for r in results:
        key = (r.case.name, r.case.dims.name)
        entry = by_case.setdefault(key, {"kernels": {}, "refused": {}})
        if r.refused:
            entry["refused"][r.target.capability] = r.refused
        for b in r.builds:
            entry["kernels"].setdefault(b.kernel, {})[b.target.capability] = b
            if not b.fits:
                problems.append(f"{b.kernel} ({r.case.name}, {r.case.dims.name}) on "
                                f"sm_{b.target.capability}: {b.local_bytes} B spilled, "
                                f"{b.shared_bytes} B shared (limit {b.target.max_shared_bytes})")
    for (case, dims), entry in by_case.items():
        for kernel, builds in entry["kernels"].items():
            ref = builds.get(90) or next(iter(builds.values()))
            blocks = ", ".join(f"{k} {v}" for k, v in ref.constexprs.items() if k in BLOCK_KEYS)
            grid = "x".join(str(g) for g in ref.grid)
            cells = []
            for t in targets:
                if t.capability in builds:
                    cells.append(_cell(builds[t.capability]))
                elif t.capability in entry["refused"]:
                    cells.append("refused (< sm_89)")
                else:
                    cells.append("")
            lines.append(f"| `{kernel}` | {case} ({dims}) | {blocks} ({grid}) | "
                         + " | ".join(cells) + " |")
    return lines, problems


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--no-docs", action="store_true", help="do not touch docs/benchmarks.md")
    args = p.parse_args()

    t0 = time.time()
    results = compile_all(CASES, log=lambda msg: print(f"compiling {msg}", file=sys.stderr,
                                                        flush=True))
    rows, problems = table(results)
    dims = sorted({(c.dims.name, c.dims) for c in CASES}, key=lambda x: x[0])
    text = "\n".join([
        f"### Kernels compiled for GPU targets (bench/kernel_compile.py), "
        f"{datetime.date.today().isoformat()}",
        "",
        f"Compiled ahead of time on {machine()}: nothing ran; Triton "
        f"{triton.__version__}, git {git_rev()}; {time.time() - t0:.0f} s. "
        f"{REQS} requests a step; shape sets: "
        + "; ".join(f"{name}: H {d.hidden}, C {d.code}, M {d.message}, V {d.vocab}, "
                    f"K {d.proposals}, k {d.head_topk}, {str(d.dtype).split('.')[-1]}"
                    for name, d in dims)
        + " (the replay: the assumed Qwen3.8-27B GDN layer, docs/hybrid.md). "
        "Cells: registers per thread / spilled bytes per thread / shared memory KiB per "
        "block / warps x stages; **!** marks a spill or shared memory over the target's "
        "limit (sm_80 163, sm_89 99, sm_90 227 KiB). Block sizes and grid are the "
        "launcher's choice at these shapes (grid with sm_90's 132 SMs).",
        "",
        *rows,
        "",
        "No kernel spills or exceeds a limit." if not problems else
        "Problems: " + "; ".join(problems),
    ])
    print(text)
    if not args.no_docs:
        replace_section(DOC, SECTION, text)
        print(f"wrote section {SECTION} of {DOC}", file=sys.stderr)
    if problems:
        sys.exit(1)


if __name__ == "__main__":
    main()
