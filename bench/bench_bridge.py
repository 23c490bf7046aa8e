"""Time the code bridge at the released drafter's size: reference vs Triton.

    /work/main/.venv/bin/python bench/bench_bridge.py            # real size
    /work/main/.venv/bin/python bench/bench_bridge.py --no-docs  # print only

Real size: H 5120, C 1024, M 512, N = 8 requests x 16 rows = 128 rows, bf16 weights.
The codebook is cut to --vocab rows (default 32768, not 248320): only anchor rows
gather from it, so its size does not change the time, only the set-up cost.

On CUDA it times the reference (torch on the GPU) and the Triton kernels (default tiles
and a small sweep of tile sizes), checks the Triton outputs against the reference at
this size, and reports the weight bandwidth reached (the bridge streams ~19 MB of
weights per layer for 128 rows: it is bandwidth bound). Without CUDA it times the
reference only and says so. The table replaces this script's section of
docs/benchmarks.md (between its markers).
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import pathlib
import platform
import statistics
import sys
import time

import torch

from vllm_dspine.kernels.bridge import bridge_read_fwd, bridge_write_fwd, code_bridge
from vllm_dspine.kernels.bridge_ref import (
    BridgeWeights,
    bridge_read_ref,
    bridge_write_ref,
    code_bridge_ref,
)

if not __package__:  # `python bench/bench_bridge.py`: import `bench` from the repository root
    sys.path[0] = str(pathlib.Path(__file__).resolve().parents[1])

from bench.lib.report import DOC, replace_section  # noqa: E402

SECTION = "bench_bridge"

# (block_n, block_h, block_c, block_m, read H splits) tried on CUDA besides the launcher
# defaults; None = the launcher's choice.
SWEEP = [(16, 64, 64, 64, None), (32, 64, 64, 64, None), (64, 64, 32, 32, None),
         (64, 128, 64, 64, None), (128, 64, 32, 32, None), (64, 64, 64, 64, 1),
         (64, 64, 64, 64, 8), (128, 128, 64, 64, 8)]


def make_inputs(args, device: torch.device, dtype: torch.dtype):
    g = torch.Generator().manual_seed(0)
    H, C, M, V = args.hidden, args.code, args.message, args.vocab

    def rand(*shape: int, fan_in: int = 1) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) / math.sqrt(fan_in)).to(device, dtype)

    w = BridgeWeights(
        codebook=rand(V, C, fan_in=C), read=[rand(C, H, fan_in=H)],
        gate_recv=rand(M, C, fan_in=C), gate_pred=rand(M, C, fan_in=C),
        value=rand(M, C, fan_in=C), gate_bias=rand(M), write=[rand(H, M, fan_in=M)],
        eps=1e-6)
    N = args.reqs * args.block
    x = (3.0 * torch.randn(N, H, generator=g)).to(device, dtype)  # [N, H]
    token_ids = torch.randint(0, V, (N,), generator=g).to(device)  # [N]
    is_anchor = (torch.arange(N) % args.block == 0).to(device)  # [N]
    return w, x, token_ids, is_anchor


def time_ms(fn, device: torch.device, iters: int) -> tuple[float, float]:
    """(median, min) wall time of fn in ms; CUDA: triton's do_bench (syncs, flushes L2).
    The minimum is shown because a shared CPU machine makes the median noisy."""
    if device.type == "cuda":
        import triton.testing

        med, low = triton.testing.do_bench(fn, warmup=25, rep=200, quantiles=[0.5, 0.0])
        return med, low
    fn()  # warm-up
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times), min(times)


def err_ratio(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    return ((out - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt()).item()


def weight_bytes(w: BridgeWeights) -> tuple[int, int]:
    """Bytes of weights the read and the write stream (codebook rows excluded)."""
    nbytes = lambda t: t.numel() * t.element_size()  # noqa: E731
    read = nbytes(w.read[0])
    write = sum(nbytes(t) for t in (w.gate_recv, w.gate_pred, w.value, w.gate_bias,
                                    w.write[0]))
    return read, write


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reqs", type=int, default=8)
    p.add_argument("--block", type=int, default=16)
    p.add_argument("--hidden", type=int, default=5120)
    p.add_argument("--code", type=int, default=1024)
    p.add_argument("--message", type=int, default=512)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    p.add_argument("--iters", type=int, default=10, help="CPU timing repetitions")
    p.add_argument("--no-docs", action="store_true", help="do not touch docs/benchmarks.md")
    p.add_argument("--interpret", action="store_true",
                   help="without CUDA, run the Triton rows too under TRITON_INTERPRET=1 "
                        "(slow: a check of this script on tiny sizes, not a benchmark)")
    args = p.parse_args()
    if args.interpret and os.environ.get("TRITON_INTERPRET") != "1":
        p.error("--interpret needs TRITON_INTERPRET=1 in the environment (set before "
                "triton is imported)")

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    w, x, token_ids, is_anchor = make_inputs(args, device, dtype)
    N = x.shape[0]
    read_b, write_b = weight_bytes(w)
    codes, rms = bridge_read_ref(x, w.read[0], w.codebook, token_ids, is_anchor, w.eps)
    write_args = (x, rms, codes, is_anchor, w.gate_recv, w.gate_pred, w.value, w.gate_bias,
                  w.write[0])

    rows = []  # (what, path, median ms, min ms, weight GB/s at the median, note)

    def add(what: str, path: str, ms: tuple[float, float], nbytes: int,
            note: str = "") -> None:
        rows.append((what, path, ms[0], ms[1], nbytes / (ms[0] * 1e-3) / 1e9, note))

    add("read", "reference", time_ms(
        lambda: bridge_read_ref(x, w.read[0], w.codebook, token_ids, is_anchor, w.eps),
        device, args.iters), read_b)
    add("write", "reference", time_ms(lambda: bridge_write_ref(*write_args), device,
                                      args.iters), write_b)
    add("bridge", "reference", time_ms(
        lambda: code_bridge_ref(x, 0, w, token_ids, is_anchor), device, args.iters),
        read_b + write_b)

    if cuda or args.interpret:
        got = code_bridge(x, 0, w, token_ids, is_anchor, use_triton=True)
        want = code_bridge_ref(x, 0, w, token_ids, is_anchor)
        errs = {name: (err_ratio(a, b), (a.float() - b.float()).abs().max().item())
                for name, a, b in zip(("x'", "codes", "rms"), got, want)}
        anchors_kept = torch.equal(got[0][is_anchor], x[is_anchor])
        add("read", "triton default", time_ms(lambda: bridge_read_fwd(
            x, w.read[0], w.codebook, token_ids, is_anchor, w.eps), device, args.iters),
            read_b)
        add("write", "triton default", time_ms(lambda: bridge_write_fwd(*write_args),
                                               device, args.iters), write_b)
        add("bridge", "triton default", time_ms(lambda: code_bridge(
            x, 0, w, token_ids, is_anchor, use_triton=True), device, args.iters),
            read_b + write_b)
        for bn, bh, bc, bm, splits in SWEEP:
            tag = f"triton n{bn} h{bh} c{bc} m{bm} s{splits or 'auto'}"
            c_t, r_t = bridge_read_fwd(x, w.read[0], w.codebook, token_ids, is_anchor,
                                       w.eps, block_n=bn, block_h=bh, block_c=bc,
                                       num_splits=splits)
            x_t = bridge_write_fwd(*write_args, block_n=bn, block_h=bh, block_c=bc,
                                   block_m=bm)
            note = (f"err codes {err_ratio(c_t, codes):.1e}, "
                    f"x' {err_ratio(x_t, bridge_write_ref(*write_args)):.1e}")
            add("read", tag, time_ms(lambda: bridge_read_fwd(
                x, w.read[0], w.codebook, token_ids, is_anchor, w.eps, block_n=bn,
                block_h=bh, block_c=bc, num_splits=splits), device, args.iters), read_b,
                note)
            add("write", tag, time_ms(lambda: bridge_write_fwd(
                *write_args, block_n=bn, block_h=bh, block_c=bc, block_m=bm), device,
                args.iters), write_b)
        machine = torch.cuda.get_device_name() if cuda else "CPU, Triton interpreter"
    else:
        errs, anchors_kept = None, None
        machine = f"{os.cpu_count()}-core CPU ({platform.machine()}), no GPU"

    lines = [
        f"### Code bridge (bench/bench_bridge.py), {datetime.date.today().isoformat()}",
        "",
        f"Machine: {machine}; torch {torch.__version__}. H {args.hidden}, C {args.code}, "
        f"M {args.message}, N {N} rows ({args.reqs} requests x {args.block}), "
        f"{args.dtype} inputs and weights; weights streamed per bridge: "
        f"{(read_b + write_b) / 1e6:.1f} MB (read {read_b / 1e6:.1f}, write "
        f"{write_b / 1e6:.1f}).",
        "",
        "| step | path | median ms | min ms | weight GB/s (median) | note |",
        "| --- | --- | ---: | ---: | ---: | --- |",
    ]
    for what, path, ms, low, gbs, note in rows:
        lines.append(f"| {what} | {path} | {ms:.3f} | {low:.3f} | {gbs:.1f} | {note} |")
    lines.append("")
    if errs is None:
        lines.append("Triton needs CUDA: not timed on this machine (run this script "
                     "unchanged on a GPU machine).")
    else:
        lines.append("Triton (default tiles) vs reference at this size: " + "; ".join(
            f"{k} error/RMS {e:.1e}, max abs {m:.1e}" for k, (e, m) in errs.items())
            + f"; anchor rows bit-exact: {anchors_kept}.")
    text = "\n".join(lines)
    print(text)
    if not args.no_docs:
        replace_section(DOC, SECTION, text)


if __name__ == "__main__":
    main()
