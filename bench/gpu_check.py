"""The GPU check: every Triton kernel of the package at the released drafter's sizes
against its reference, timed, the FP8 retrieval's recall, and the drafter-side cycle
beside dense drafter layers of the same shape. One command, one table.

    python bench/gpu_check.py --out gpu-check                  # a CUDA GPU, ~3-5 min
    python bench/gpu_check.py --out gpu-check --target DIR     # + recall on DIR's head
    TRITON_INTERPRET=1 python bench/gpu_check.py --small --device cpu --out /tmp/gc

Needs PyTorch and Triton only (no vLLM is imported: `vllm_dspine/verify/__init__.py`
imports vLLM's sampler, so the sparse-rejection kernels are loaded from their module
file, and their reference is the dense statement below, since `sparse_rejection_ref.py`
imports vLLM). Sizes: `RELEASED_QWEN38_27B` (H 5,120, C 1,024, M 512, V 248,320, 5
layers, K 15 drafts x 16 candidates), 8 requests a step; the GDN replay at the assumed
Qwen3.8-27B GDN layer (docs/hybrid.md). `--small` runs the same code at toy sizes (the
check of this script: tests/test_gpu_check.py).

Parts (one row each in the table; a failed check or an error makes the exit status 1):
  kernels    each Triton path against its PyTorch reference on the same inputs (error
             relative to the reference's RMS, or exact equality where the result is
             discrete), medians of CUDA-event times of both
  recall     FP8 coarse scoring (+ exact rescoring of the best 128) against the BF16
             path's top 16, on random heads (Gaussian; log-normal row norms) and the
             head of `--target DIR` (a model folder, or a pair folder with target/):
             lm_head.weight, else the tied embed_tokens.weight; hidden states random
  cycle      one step's drafter side, 8 requests: 5 x (dense Qwen3 layer, plain torch
             matmuls, attention inside each request's 16-row block) vs 5 bridges +
             retrieval + tail tables + walk; and whether that DSpine part, and the
             verify kernels, run without a host synchronisation
             (`torch.cuda.set_sync_debug_mode("error")`)
Writes DIR/gpu_check.md and DIR/gpu_check.json.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import math
import os
import pathlib
import statistics
import sys
import time
import traceback
from dataclasses import asdict, dataclass

import torch

REPO = pathlib.Path(__file__).resolve().parents[1]
if not __package__:  # `python bench/gpu_check.py`: import `bench` from the repository root
    sys.path[0] = str(REPO)

from bench.lib.report import git_rev, machine  # noqa: E402
from vllm_dspine.commit.gdn_ref import GDNWeights, VerifiedBlockInputs, replay_commit_ref  # noqa: E402
from vllm_dspine.commit.replay import gdn_replay  # noqa: E402
from vllm_dspine.config import RELEASED_QWEN38_27B  # noqa: E402
from vllm_dspine.kernels.bridge import code_bridge  # noqa: E402
from vllm_dspine.kernels.bridge_ref import BridgeWeights  # noqa: E402
from vllm_dspine.kernels.retrieval import (FP8Head, fp8_head_scores,  # noqa: E402
                                           fp8_matmul_available, retrieve_candidates)
from vllm_dspine.kernels.retrieval_ref import fp8_head_scores_ref  # noqa: E402
from vllm_dspine.kernels.tail import (LastWriteInputs, TailTables, TailWeights,  # noqa: E402
                                      serial_tail, tail_score_tables)
from vllm_dspine.kernels.tail_ref import rms_norm_ref  # noqa: E402


def _load_sparse_rejection():
    """vllm_dspine.verify.sparse_rejection, loaded from its file: importing it as usual
    runs vllm_dspine/verify/__init__.py, which imports vLLM's sampler."""
    name = "vllm_dspine.verify.sparse_rejection"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            name, REPO / "vllm_dspine" / "verify" / "sparse_rejection.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


# The assumed Qwen3.8-27B GDN layer: `QWEN38_27B_GDN` of vllm_dspine/model/memory.py
# (restated: that module needs safetensors; tests/test_gpu_check.py compares).
GDN_27B = dict(num_k_heads=16, num_v_heads=48, head_k_dim=128, head_v_dim=128, conv_width=4)


@dataclass(frozen=True)
class Dims:
    hidden: int  # H
    code: int  # C
    message: int  # M
    vocab: int  # V
    layers: int  # drafter layers (one bridge each)
    proposals: int  # K
    topk: int  # k
    coarse_topk: int
    intermediate: int  # dense layer MLP width
    heads: int
    kv_heads: int
    head_dim: int
    reqs: int
    gdn: dict

    @property
    def rows(self) -> int:  # block rows of a step
        return self.reqs * (self.proposals + 1)


def released_dims(reqs: int) -> Dims:
    c = RELEASED_QWEN38_27B
    d = c["dspine_config"]
    return Dims(c["hidden_size"], d["code_dim"], d["message_dim"], c["vocab_size"],
                c["num_hidden_layers"], d["block_size"] - 1, d["head_topk"], d["coarse_topk"],
                c["intermediate_size"], c["num_attention_heads"], c["num_key_value_heads"],
                c["head_dim"], reqs, GDN_27B)


SMALL = Dims(hidden=64, code=32, message=16, vocab=2053, layers=2, proposals=15, topk=16,
             coarse_topk=32, intermediate=96, heads=4, kv_heads=2, head_dim=16, reqs=2,
             gdn=dict(num_k_heads=1, num_v_heads=2, head_k_dim=16, head_v_dim=16,
                      conv_width=4))


# ----------------------------------------------------------------------------- helpers
class Clock:
    """Median wall time of a callable: CUDA events on a GPU, perf_counter on the CPU."""

    def __init__(self, device: torch.device, iters: int, warmup: int):
        self.device, self.iters, self.warmup = device, iters, warmup

    def __call__(self, fn, iters: int | None = None) -> float:
        iters = iters or self.iters
        for _ in range(self.warmup):
            fn()
        if self.device.type != "cuda":
            times = []
            for _ in range(iters):
                t0 = time.perf_counter()
                fn()
                times.append(1e3 * (time.perf_counter() - t0))
            return statistics.median(times)
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(iters)]
        for start, end in events:
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize()
        return statistics.median(s.elapsed_time(e) for s, e in events)


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    """max |got - ref| / RMS(ref), in float64."""
    ref = ref.double()
    return float((got.double() - ref).abs().max() / ref.pow(2).mean().sqrt().clamp_min(1e-30))


def randn(*shape, gen, device, dtype=torch.float32, scale=1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=gen, device=device) * scale).to(dtype)


@dataclass
class Row:
    part: str
    name: str
    check: str = ""
    ok: bool | None = None  # None: a figure, nothing to pass
    triton_ms: float | None = None
    reference_ms: float | None = None
    note: str = ""


class Check:
    """Random weights and inputs of one size, and the rows measured on them."""

    def __init__(self, dims: Dims, device: torch.device, dtype: torch.dtype, clock: Clock,
                 seed: int = 0):
        self.d, self.device, self.dtype, self.clock = dims, device, dtype, clock
        self.gen = torch.Generator(device=device).manual_seed(seed)
        self.rows: list[Row] = []
        d, g = dims, self.gen
        H, C, M, V = d.hidden, d.code, d.message, d.vocab
        self.bridge = BridgeWeights(
            codebook=randn(V, C, gen=g, device=device, dtype=dtype, scale=C ** -0.5),
            read=[randn(C, H, gen=g, device=device, dtype=dtype, scale=H ** -0.5)
                  for _ in range(d.layers)],
            gate_recv=randn(M, C, gen=g, device=device, dtype=dtype, scale=C ** -0.5),
            gate_pred=randn(M, C, gen=g, device=device, dtype=dtype, scale=C ** -0.5),
            value=randn(M, C, gen=g, device=device, dtype=dtype, scale=C ** -0.5),
            gate_bias=randn(M, gen=g, device=device, dtype=dtype, scale=0.1),
            write=[randn(H, M, gen=g, device=device, dtype=dtype, scale=0.1 * M ** -0.5)
                   for _ in range(d.layers)],
            eps=1e-6)
        self.head = randn(V, H, gen=g, device=device, dtype=dtype, scale=H ** -0.5)
        self.norm_weight = 1 + randn(H, gen=g, device=device, scale=0.1)
        R, B = d.reqs, d.proposals + 1
        self.x = randn(d.rows, H, gen=g, device=device, dtype=dtype)  # [R * B, H]
        self.is_anchor = (torch.arange(d.rows, device=device) % B) == 0  # [R * B]
        self.token_ids = torch.randint(0, V, (d.rows,), generator=g, device=device)
        self._tables: TailTables | None = None
        self._fp8: FP8Head | None = None

    @property
    def tables(self) -> TailTables:
        if self._tables is None:
            self._tables = TailTables.build(self.bridge, self.head, self.norm_weight)
        return self._tables

    @property
    def fp8(self) -> FP8Head:
        if self._fp8 is None:
            self._fp8 = FP8Head.from_head(self.head)
        return self._fp8

    def add(self, row: Row) -> None:
        self.rows.append(row)
        print(format_row(row), flush=True)

    def guarded(self, part: str, name: str, fn) -> None:
        """Run one measurement; an exception becomes a failed row, the rest goes on."""
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - a check reports every failure
            traceback.print_exc()
            self.add(Row(part, name, f"error: {type(e).__name__}: {e}"[:300], False))

    # ------------------------------------------------------------------------ kernels
    def check_bridge(self) -> None:
        args = (self.x, 0, self.bridge, self.token_ids, self.is_anchor)
        x_k, codes_k, rms_k = code_bridge(*args, use_triton=True)
        x_r, codes_r, rms_r = code_bridge(*args, use_triton=False)
        tol = 2e-2 if self.dtype == torch.bfloat16 else 1e-5
        errs = dict(codes=rel_err(codes_k, codes_r), rms=rel_err(rms_k, rms_r),
                    update=rel_err(x_k.float() - self.x.float(), x_r.float() - self.x.float()))
        ok = errs["codes"] < tol and errs["rms"] < 1e-5 and errs["update"] < 2.5 * tol
        self.add(Row("kernels", "bridge (read + message + write), one layer",
                     ", ".join(f"{k} {v:.1e}" for k, v in errs.items()), ok,
                     self.clock(lambda: code_bridge(*args, use_triton=True)),
                     self.clock(lambda: code_bridge(*args, use_triton=False))))

    def check_fp8_scores(self) -> None:
        if self.device.type == "cuda" and not fp8_matmul_available(self.device):
            cc = torch.cuda.get_device_capability(self.device)
            self.add(Row("kernels", "FP8 head scores", f"skipped: sm_{cc[0]}{cc[1]} < sm_89"))
            return
        fp8 = self.fp8
        hidden = randn(self.d.reqs * self.d.proposals, self.d.hidden, gen=self.gen,
                       device=self.device, dtype=self.dtype)
        got = fp8_head_scores(hidden, fp8, use_triton=True)
        ref = fp8_head_scores_ref(hidden, fp8)
        err = rel_err(got, ref)
        self.add(Row("kernels", "FP8 head scores [rows, V]", f"err {err:.1e}", err < 1e-3,
                     self.clock(lambda: fp8_head_scores(hidden, fp8, use_triton=True)),
                     self.clock(lambda: fp8_head_scores_ref(hidden, fp8), iters=3)))

    def tail_inputs(self):
        d, g, dev = self.d, self.gen, self.device
        R, B, K, k = d.reqs, d.proposals + 1, d.proposals, d.topk
        inputs = LastWriteInputs(
            pre_write_state=self.x.view(R, B, -1),
            codes=math.sqrt(d.code) * torch.nn.functional.normalize(
                randn(R, B, d.code, gen=g, device=dev), dim=-1),
            rms=(self.x.float().pow(2).mean(-1).sqrt()).view(R, B),
            anchor_ids=self.token_ids.view(R, B)[:, 0])
        cand = torch.stack([torch.randperm(d.vocab, generator=g, device=dev)[:k]
                            for _ in range(R * K)]).view(R, K, k)
        weights = TailWeights(self.bridge, self.norm_weight, 1e-6, self.head)
        return inputs, cand, weights

    def check_tail(self) -> None:
        d, dev = self.d, self.device
        inputs, cand, weights = self.tail_inputs()
        tables = self.tables
        S32 = tail_score_tables(inputs, cand, weights, tables, torch.float32)
        S_direct = tail_score_tables(inputs, cand, weights, None, torch.float32)
        err = rel_err(S32, S_direct)
        self.add(Row("kernels", "tail tables (torch): TailTables vs direct formula",
                     f"err {err:.1e}", err < 1e-3,
                     self.clock(lambda: tail_score_tables(inputs, cand, weights, tables,
                                                          torch.float32)),
                     self.clock(lambda: tail_score_tables(inputs, cand, weights, None,
                                                          torch.float32), iters=3),
                     "Triton column: tables path, reference column: direct"))
        S64 = tail_score_tables(inputs, cand, weights, tables, torch.float64)
        R, K = d.reqs, d.proposals
        gen = torch.Generator().manual_seed(1)
        u = torch.rand(R, K, dtype=torch.float64, generator=gen).to(dev)
        temp = torch.linspace(0.0, 1.5, R, device=dev)  # request 0 greedy, others sampled
        kw = dict(top_k=torch.full((R,), 12, dtype=torch.int32, device=dev),
                  top_p=torch.full((R,), 0.9, device=dev),
                  min_p=torch.full((R,), 0.02, device=dev))
        for name, S, t, filt in (("greedy", S32, torch.zeros(R, device=dev), {}),
                                 ("sampled + filters", S64, temp, kw)):
            ref = serial_tail(S, cand, t, uniforms=u, use_triton=False, **filt)
            got = serial_tail(S, cand, t, uniforms=u, use_triton=True, **filt)
            same = torch.equal(got.draft_token_ids, ref.draft_token_ids)
            perr = float((got.cand_probs - ref.cand_probs).abs().max())
            self.add(Row("kernels", f"tail walk, {name} ({R} x {K} steps)",
                         f"tokens {'equal' if same else 'DIFFER'}, probs err {perr:.1e}",
                         same and perr < 1e-6,
                         self.clock(lambda: serial_tail(S, cand, t, uniforms=u,
                                                        use_triton=True, **filt)),
                         self.clock(lambda: serial_tail(S, cand, t, uniforms=u,
                                                        use_triton=False, **filt))))

    def check_sparse_rejection(self) -> None:
        sr = _load_sparse_rejection()
        d, g, dev = self.d, self.gen, self.device
        R, K, k, V = d.reqs, d.proposals, d.topk, d.vocab
        T = R * K
        cand = torch.stack([torch.randperm(V, generator=g, device=dev)[:k] for _ in range(T)])
        q = torch.softmax(randn(T, k, gen=g, device=dev, scale=2.0), -1)  # [T, k]
        draft = cand.gather(1, torch.multinomial(q, 1, generator=g)).view(T)
        q_dense = torch.zeros(T, V, device=dev).scatter_(1, cand, q)
        p = 0.7 * q_dense + 0.3 * torch.softmax(randn(T, V, gen=g, device=dev, scale=3.0), -1)
        num_draft = [K] * R
        cu = torch.tensor(num_draft, device=dev).cumsum(0).to(torch.int32)
        bonus = torch.randint(0, V, (R, 1), generator=g, device=dev, dtype=torch.int32)
        is_greedy = torch.arange(R, device=dev) % 3 == 0
        uniform = torch.rand(T, generator=g, device=dev, dtype=torch.float64)
        inv_exp = 1.0 / torch.empty(R, V, device=dev).exponential_(generator=g)
        target_argmax = p.argmax(-1)  # [T]
        args = (draft, num_draft, K, cu, cand, q, p, bonus, is_greedy, target_argmax, uniform,
                inv_exp)
        oracle_args = (draft, K, q_dense, p, target_argmax, bonus, is_greedy, uniform, inv_exp,
                       sr.PLACEHOLDER_TOKEN_ID)
        got = sr.sparse_rejection_sample(*args, use_triton=True)
        want = dense_rejection_oracle(*oracle_args)
        same = torch.equal(got.cpu(), want.cpu())
        accepted = int((got[:, :K] == draft.view(R, K).to(got.dtype)).sum())
        self.add(Row("kernels", f"sparse rejection: {R} requests x {K} drafts, V {V}",
                     f"output {'equal' if same else 'DIFFERS'} (dense statement); "
                     f"{accepted} of {T} drafts accepted", same,
                     self.clock(lambda: sr.sparse_rejection_sample(*args, use_triton=True)),
                     self.clock(lambda: dense_rejection_oracle(*oracle_args), iters=3),
                     "reference column: the dense statement (a loop, not a fast path)"))

    def check_replay(self) -> None:
        d, g, dev = self.d, self.gen, self.device
        c = d.gdn
        H, HV, Kd, Vd, W = (c["num_k_heads"], c["num_v_heads"], c["head_k_dim"],
                            c["head_v_dim"], c["conv_width"])
        D = 2 * H * Kd + HV * Vd
        R, B = d.reqs, d.proposals + 1
        w = GDNWeights(conv_weight=randn(D, W, gen=g, device=dev, dtype=self.dtype,
                                         scale=W ** -0.5),
                       conv_bias=None, A_log=randn(HV, gen=g, device=dev, scale=0.5),
                       dt_bias=randn(HV, gen=g, device=dev, scale=0.5), num_k_heads=H,
                       head_k_dim=Kd, head_v_dim=Vd)
        inputs = VerifiedBlockInputs(
            mixed_qkv=randn(R * B, D, gen=g, device=dev, dtype=self.dtype),
            a=randn(R * B, HV, gen=g, device=dev, dtype=self.dtype),
            b=randn(R * B, HV, gen=g, device=dev, dtype=self.dtype),
            query_start_loc=torch.arange(0, R * B + 1, B, device=dev, dtype=torch.int32))
        state = randn(R, HV, Vd, Kd, gen=g, device=dev, scale=0.1)  # fp32, as vLLM's pool
        window = randn(R, W - 1, D, gen=g, device=dev, dtype=self.dtype).transpose(1, 2)
        accepted = torch.randint(0, B + 1, (R,), generator=g, device=dev, dtype=torch.int32)
        ref_state, ref_window = replay_commit_ref(state, window, inputs, accepted, w)
        s, cw = state.clone(), window.clone()
        gdn_replay(s, cw, inputs, accepted, w, use_triton=True)
        err = rel_err(s, ref_state)
        same_window = torch.equal(cw, ref_window)
        self.add(Row("kernels", f"GDN replay, one layer ({HV} value heads, {R} requests)",
                     f"state err {err:.1e}, window {'equal' if same_window else 'DIFFERS'}",
                     err < 1e-5 and same_window,
                     self.clock(lambda: gdn_replay(s, cw, inputs, accepted, w,
                                                   use_triton=True)),
                     self.clock(lambda: replay_commit_ref(state, window, inputs, accepted, w),
                                iters=3),
                     "x 48 GDN layers a step on the 27B target"))

    # ------------------------------------------------------------------------- recall
    def check_recall(self, name: str, head: torch.Tensor) -> None:
        if self.device.type == "cuda" and not fp8_matmul_available(self.device):
            self.add(Row("recall", name, "skipped: no FP8 on this GPU (< sm_89)"))
            return
        d = self.d
        N = d.reqs * d.proposals
        hidden = randn(N, head.shape[1], gen=self.gen, device=self.device, dtype=self.dtype)
        head = head.to(self.device, self.dtype)
        fp8 = self.fp8 if head is self.head else FP8Head.from_head(head)
        bf16 = retrieve_candidates(hidden, head, d.topk, d.coarse_topk, mode="bf16")
        got = retrieve_candidates(hidden, head, d.topk, d.coarse_topk, fp8, mode="fp8")
        hits = (got[:, :, None] == bf16[:, None, :]).any(-1).float().mean(-1)  # [N]
        self.add(Row("recall", f"FP8 vs BF16 top {d.topk}: {name}",
                     f"recall {float(hits.mean()):.4f} (worst row {float(hits.min()):.3f}, "
                     f"{N} rows, V {head.shape[0]})", None,
                     self.clock(lambda: retrieve_candidates(hidden, head, d.topk,
                                                            d.coarse_topk, fp8, mode="fp8")),
                     self.clock(lambda: retrieve_candidates(hidden, head, d.topk,
                                                            d.coarse_topk, mode="bf16")),
                     "Triton column: FP8 path, reference column: BF16 path"))

    # -------------------------------------------------------------------------- cycle
    def check_cycle(self) -> None:
        d, dev = self.d, self.device
        layer = DenseLayer(d, self.gen, dev, self.dtype)
        inputs, _, weights = self.tail_inputs()
        tables = self.tables
        use_fp8 = dev.type == "cpu" or fp8_matmul_available(dev)
        fp8 = self.fp8 if use_fp8 else None
        mode = "fp8" if use_fp8 else "bf16"
        R, K = d.reqs, d.proposals
        temperature = torch.ones(R, device=dev)

        def bridges():
            x = self.x
            for l in range(d.layers):
                x, _, _ = code_bridge(x, l, self.bridge, self.token_ids, self.is_anchor)
            return x

        def retrieval():
            hidden = self.x.view(R, K + 1, -1)[:, 1:].reshape(R * K, -1)
            return retrieve_candidates(hidden, self.head, d.topk, d.coarse_topk, fp8,
                                       mode=mode).view(R, K, d.topk)

        cand = retrieval()

        def tail():
            S = tail_score_tables(inputs, cand, weights, tables, torch.float64)
            return serial_tail(S, cand, temperature)

        def dense():
            x = self.x
            for _ in range(d.layers):
                x = layer(x)
            return x

        def dspine():
            bridges()
            c = retrieval()
            S = tail_score_tables(inputs, c, weights, tables, torch.float64)
            return serial_tail(S, c, temperature)

        parts = dict(bridges=self.clock(bridges), retrieval=self.clock(retrieval),
                     tail=self.clock(tail), dense=self.clock(dense))
        L = d.layers
        self.add(Row("cycle", f"{L} dense Qwen3 layers (plain torch), {d.rows} rows", "", None,
                     parts["dense"]))
        self.add(Row("cycle", f"{L} bridges", "", None, parts["bridges"],
                     note="Triton on CUDA, the reference on CPU"))
        self.add(Row("cycle", f"retrieval ({mode}, {R * K} rows)", "", None,
                     parts["retrieval"]))
        self.add(Row("cycle", "tail: tables (float64) + sampled walk", "", None, parts["tail"]))
        added = parts["bridges"] + parts["retrieval"] + parts["tail"]
        self.add(Row("cycle", "DSpine's part / the dense layers",
                     f"{added:.2f} ms / {parts['dense']:.2f} ms = "
                     f"{added / parts['dense']:.2f}", None, self.clock(dspine),
                     note="Triton column: bridges + retrieval + tail in one go"))
        if dev.type == "cuda":
            self.check_no_sync("cycle", "DSpine's part (bridges, retrieval, tables, walk)",
                               dspine)

    def check_no_sync(self, part: str, name: str, fn) -> None:
        fn()  # compiled and warm: what is left is the step itself
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            fn()
            self.add(Row(part, f"no host sync: {name}", "none", True))
        except RuntimeError as e:
            self.add(Row(part, f"no host sync: {name}", f"synchronises: {e}"[:300], False))
        finally:
            torch.cuda.set_sync_debug_mode("default")

    def check_verify_no_sync(self) -> None:
        sr = _load_sparse_rejection()
        d, g, dev = self.d, self.gen, self.device
        R, K, k, V = d.reqs, d.proposals, d.topk, d.vocab
        T = R * K
        cand = torch.stack([torch.randperm(V, generator=g, device=dev)[:k] for _ in range(T)])
        q = torch.softmax(randn(T, k, gen=g, device=dev), -1)
        p = torch.softmax(randn(T, V, gen=g, device=dev), -1)
        args = (cand[:, 0].contiguous(), [K] * R, K,
                torch.full((R,), K, device=dev, dtype=torch.int32).cumsum(0).to(torch.int32),
                cand, q, p, torch.zeros(R, 1, device=dev, dtype=torch.int32),
                torch.zeros(R, dtype=torch.bool, device=dev), None,
                torch.rand(T, generator=g, device=dev, dtype=torch.float64),
                torch.ones(R, V, device=dev))
        self.check_no_sync("kernels", "sparse rejection sampling",
                           lambda: sr.sparse_rejection_sample(*args, use_triton=True))


def dense_rejection_oracle(draft, K, q_dense, p, target_argmax, bonus, is_greedy, uniform,
                           inv_exp, placeholder) -> torch.Tensor:
    """What `sparse_rejection_ref.py` specifies, stated densely, one request at a time:
    greedy requests accept while the draft is the target's argmax (emitting it); random
    ones while q(v) > 0 and p(v) / q(v) >= u; a rejected row emits
    argmax_v max(p - q, 0)(v) * inv_exp[r, v] (lowest id on ties; NaN counts 0), or
    argmax p * inv_exp where the residual is 0 everywhere, or 0 where p is; a request
    with no rejection appends its bonus token.  -> [R, K + 1] int32"""
    R = bonus.shape[0]
    out = torch.full((R, K + 1), placeholder, dtype=torch.int32)
    # The kernels' arithmetic: fp32 probabilities and noise, the float64 uniforms.
    draft, q_dense, p = draft.cpu().long(), q_dense.cpu().float(), p.cpu().float()
    uniform, inv_exp = uniform.cpu().double(), inv_exp.cpu()
    argmax = target_argmax.cpu()
    for r in range(R):
        for t in range(K):
            i, v = r * K + t, int(draft[r * K + t])
            if bool(is_greedy[r]):
                out[r, t] = int(argmax[i])
                if int(argmax[i]) != v:
                    break
            else:
                qv, pv = q_dense[i, v], p[i, v]
                if qv > 0 and float(pv / qv) >= float(uniform[i]):
                    out[r, t] = v
                    continue
                resid = torch.nan_to_num((p[i] - q_dense[i]).clamp_min(0) * inv_exp[r])
                if float(resid.max()) > 0:
                    out[r, t] = int(resid.argmax())
                else:
                    full = torch.nan_to_num(p[i] * inv_exp[r])
                    out[r, t] = int(full.argmax()) if float(full.max()) > 0 else 0
                break
        else:
            out[r, K] = int(bonus[r, 0])
    return out


class DenseLayer:
    """A Qwen3 decoder layer in plain torch: RMSNorm, q/k/v, per-head q/k RMSNorm,
    attention inside each request's block (causal), o, RMSNorm, SwiGLU MLP."""

    def __init__(self, d: Dims, gen, device, dtype):
        H, I = d.hidden, d.intermediate
        self.d = d

        def w(o, i):
            return randn(o, i, gen=gen, device=device, dtype=dtype, scale=i ** -0.5)

        self.q, self.k = w(d.heads * d.head_dim, H), w(d.kv_heads * d.head_dim, H)
        self.v, self.o = w(d.kv_heads * d.head_dim, H), w(H, d.heads * d.head_dim)
        self.gate, self.up, self.down = w(I, H), w(I, H), w(H, I)
        self.ln1 = torch.ones(H, device=device)
        self.ln2 = torch.ones(H, device=device)
        self.qn = torch.ones(d.head_dim, device=device)
        self.dtype = dtype

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [R * B, H]
        d = self.d
        R, B = d.reqs, d.proposals + 1
        h = rms_norm_ref(x.float(), self.ln1, 1e-6).to(self.dtype)
        q = (h @ self.q.t()).view(R, B, d.heads, d.head_dim)
        k = (h @ self.k.t()).view(R, B, d.kv_heads, d.head_dim)
        v = (h @ self.v.t()).view(R, B, d.kv_heads, d.head_dim)
        q = rms_norm_ref(q.float(), self.qn, 1e-6).to(self.dtype)
        k = rms_norm_ref(k.float(), self.qn, 1e-6).to(self.dtype)
        rep = d.heads // d.kv_heads
        a = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.repeat_interleave(rep, 2).transpose(1, 2),
            v.repeat_interleave(rep, 2).transpose(1, 2), is_causal=True)  # [R, heads, B, hd]
        x = x + a.transpose(1, 2).reshape(R * B, -1) @ self.o.t()
        h = rms_norm_ref(x.float(), self.ln2, 1e-6).to(self.dtype)
        return x + (torch.nn.functional.silu(h @ self.gate.t()) * (h @ self.up.t())) \
            @ self.down.t()


def load_target_head(folder: pathlib.Path) -> torch.Tensor:
    """The output head of a Hugging Face model folder (or a pair folder's target/):
    lm_head.weight, else the tied model.embed_tokens.weight."""
    from safetensors import safe_open

    if (folder / "target").is_dir():
        folder = folder / "target"
    for key in ("lm_head.weight", "model.embed_tokens.weight"):
        for file in sorted(folder.glob("*.safetensors")):
            with safe_open(str(file), framework="pt") as f:
                if key in f.keys():
                    return f.get_tensor(key)
    raise ValueError(f"{folder}: no lm_head.weight or model.embed_tokens.weight in its "
                     "*.safetensors; pass a target model folder (or a pair folder)")


def format_row(r: Row) -> str:
    f = lambda x: "" if x is None else f"{x:.3f}"  # noqa: E731
    ok = {True: "ok", False: "FAIL", None: ""}[r.ok]
    return f"| {r.part} | {r.name} | {r.check} | {ok} | {f(r.triton_ms)} | {f(r.reference_ms)} " \
           f"| {r.note} |"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="folder for gpu_check.md and gpu_check.json")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--small", action="store_true", help="toy sizes (checks this script)")
    ap.add_argument("--reqs", type=int, default=8, help="requests a step (released sizes)")
    ap.add_argument("--iters", type=int, default=20, help="timed repetitions (median)")
    ap.add_argument("--target", type=pathlib.Path, default=None,
                    help="a target model folder (or pair folder): FP8 recall on its head")
    args = ap.parse_args(argv)

    t_start = time.time()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("gpu_check: no CUDA device; on a CPU use --small --device cpu with "
                 "TRITON_INTERPRET=1")
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("gpu_check: the Triton kernels run on CPU tensors only under "
                 "TRITON_INTERPRET=1 (set it before starting)")
    dims = SMALL if args.small else released_dims(args.reqs)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    iters = args.iters if device.type == "cuda" else 1
    clock = Clock(device, iters, warmup=3 if device.type == "cuda" else 0)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.backends.cuda.matmul.allow_tf32 = False

    print("| part | what | check | ok | Triton ms | reference ms | note |\n"
          "| --- | --- | --- | --- | ---: | ---: | --- |", flush=True)
    c = Check(dims, device, dtype, clock)
    c.guarded("kernels", "bridge", c.check_bridge)
    c.guarded("kernels", "FP8 head scores", c.check_fp8_scores)
    c.guarded("kernels", "tail", c.check_tail)
    c.guarded("kernels", "sparse rejection", c.check_sparse_rejection)
    c.guarded("kernels", "GDN replay", c.check_replay)
    if device.type == "cuda":
        c.guarded("kernels", "no host sync: sparse rejection", c.check_verify_no_sync)
    c.guarded("recall", "Gaussian head", lambda: c.check_recall("random Gaussian head", c.head))
    lognormal = c.head * torch.exp(randn(dims.vocab, 1, gen=c.gen, device=device,
                                         scale=0.5)).to(dtype)
    c.guarded("recall", "log-normal rows",
              lambda: c.check_recall("random head, log-normal row norms", lognormal))
    del lognormal
    if args.target is not None:
        c.guarded("recall", str(args.target), lambda: c.check_recall(
            f"head of {args.target.name}", load_target_head(args.target)))
    c.guarded("cycle", "drafter-side cycle", c.check_cycle)

    seconds = time.time() - t_start
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "none (interpreter)"
    meta = dict(date=datetime.date.today().isoformat(), machine=machine(), gpu=gpu,
                torch=torch.__version__, triton=_triton_version(), git=git_rev(),
                dims=asdict(dims), dtype=str(dtype), iters=iters, seconds=round(seconds, 1),
                small=args.small)
    failed = [r for r in c.rows if r.ok is False]
    md = [f"### GPU check (bench/gpu_check.py), {meta['date']}", "",
          f"GPU: {gpu}; {meta['machine']}; torch {meta['torch']}, Triton {meta['triton']}, "
          f"git {meta['git']}; {dims.reqs} requests x {dims.proposals} drafts, H "
          f"{dims.hidden}, C {dims.code}, M {dims.message}, V {dims.vocab}, {dtype}; "
          f"medians of {iters} runs; {seconds:.0f} s.", "",
          "| part | what | check | ok | Triton ms | reference ms | note |",
          "| --- | --- | --- | --- | ---: | ---: | --- |",
          *[format_row(r) for r in c.rows], "",
          f"{len(failed)} failed check(s)." if failed else "Every check passed."]
    (out / "gpu_check.md").write_text("\n".join(md) + "\n")
    (out / "gpu_check.json").write_text(json.dumps(
        dict(meta=meta, rows=[asdict(r) for r in c.rows]), indent=1) + "\n")
    print("\n".join(md[-1:]))
    print(f"wrote {out / 'gpu_check.md'} and {out / 'gpu_check.json'} ({seconds:.0f} s)")
    return 1 if failed else 0


def _triton_version() -> str:
    import triton

    return triton.__version__


if __name__ == "__main__":
    sys.exit(main())
