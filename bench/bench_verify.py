"""Sparse vs vLLM dense verification time on CPU (V 248,320, K 15, batch 1-64).

Both sides start from the processed target logits [num_tokens, V] and the drafts, and
include the softmax, the random draws (uniforms, per-request exponentials) and the
sampling; the dense side is vLLM 0.32.0's `rejection_sample` on its C++ CPU kernels
with q already dense, the sparse side our reference (the CPU path). The q column
gives the bytes of q handed to verification, and the time vLLM's side would
additionally spend scattering a 16-candidate q dense.

Run:  source scripts/env.sh && .venv/bin/python bench/bench_verify.py
Prints a markdown table and replaces its own section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import datetime
import pathlib
import statistics
import sys
import time

import torch

from vllm.platforms.cpu import CpuPlatform
from vllm.v1.sample.logits_processor import LogitsProcessors
from vllm.v1.sample.metadata import SamplingMetadata
from vllm.v1.sample.rejection_sampler import rejection_sample

from vllm_dspine.verify import (
    generate_inv_exp,
    generate_uniform_probs,
    sparse_rejection_sample,
    sparse_to_dense_probs,
)
from vllm_dspine.verify.synthetic import sample_from_sparse

if not __package__:  # `python bench/bench_verify.py`: import `bench` from the repository root
    sys.path[0] = str(pathlib.Path(__file__).resolve().parents[1])

from bench.lib.report import DOC, replace_section  # noqa: E402

SECTION = "bench_verify"
CPU = torch.device("cpu")


def _sampling_metadata(num_reqs: int) -> SamplingMetadata:
    return SamplingMetadata(
        temperature=torch.ones(num_reqs), all_greedy=False, all_random=True,
        top_p=None, top_k=None, generators={}, max_num_logprobs=None,
        no_penalties=True, prompt_token_ids=None,
        frequency_penalties=torch.zeros(num_reqs),
        presence_penalties=torch.zeros(num_reqs),
        repetition_penalties=torch.ones(num_reqs),
        output_token_ids=[[] for _ in range(num_reqs)], allowed_token_ids_mask=None,
        bad_words_token_ids={}, logitsprocs=LogitsProcessors(),
    )


def _problem(num_reqs: int, k: int, vocab_size: int, topk: int, seed: int):
    """LLM-like target logits (a long N(0, 2) tail plus `topk` head ids ~15 above
    it), q a noisy softmax over the head ids, drafts ~ q."""
    g = torch.Generator().manual_seed(seed)
    num_tokens = num_reqs * k
    logits = torch.randn(num_tokens, vocab_size, generator=g) * 2.0  # [T, V]
    ids = torch.randint(0, vocab_size, (num_tokens, 4 * topk), generator=g)
    ids = torch.stack([row.unique()[:topk] for row in ids])  # [T, topk] distinct
    head = 15.0 + 2.0 * torch.randn(ids.shape, generator=g)
    logits.scatter_(1, ids, head)
    noisy = head + 0.7 * torch.randn(ids.shape, generator=g)
    probs = noisy.softmax(dim=1)  # [T, topk]
    drafts = sample_from_sparse(ids, probs, g)  # [T]
    cu = torch.full((num_reqs,), k).cumsum(0).to(torch.int32)
    bonus = torch.randint(0, vocab_size, (num_reqs, 1), generator=g)
    return logits, ids, probs, drafts, cu, bonus


def _time(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def run(batches: list[int], k: int, vocab_size: int, topk: int) -> list[dict]:
    rows = []
    for num_reqs in batches:
        logits, ids, probs, drafts, cu, bonus = _problem(
            num_reqs, k, vocab_size, topk, seed=0
        )
        nd = [k] * num_reqs
        repeats = 5 if num_reqs <= 8 else 2
        t_scatter = _time(
            lambda: sparse_to_dense_probs(ids, probs, vocab_size), repeats
        )
        dense_q = sparse_to_dense_probs(ids, probs, vocab_size)
        sm = _sampling_metadata(num_reqs)

        def dense():
            return rejection_sample(
                drafts, nd, k, cu, dense_q, logits, bonus, sm
            )

        def sparse():
            target_probs = logits.softmax(dim=-1, dtype=torch.float32)
            uniform = generate_uniform_probs(num_reqs * k, nd, {}, CPU)
            inv_exp = generate_inv_exp(nd, vocab_size, {}, CPU)
            return sparse_rejection_sample(
                drafts, nd, k, cu, ids, probs, target_probs, bonus, None, None,
                uniform, inv_exp,
            )

        def shared():
            logits.softmax(dim=-1, dtype=torch.float32)
            generate_uniform_probs(num_reqs * k, nd, {}, CPU)
            generate_inv_exp(nd, vocab_size, {}, CPU)

        t_dense = _time(dense, repeats)
        t_sparse = _time(sparse, repeats)
        t_shared = _time(shared, repeats)
        accepted = (sparse() >= 0).sum(dim=1).float().mean().item() - 1
        rows.append(dict(
            batch=num_reqs, dense_ms=1e3 * t_dense, scatter_ms=1e3 * t_scatter,
            sparse_ms=1e3 * t_sparse, shared_ms=1e3 * t_shared, accepted=accepted,
            dense_q_mb=dense_q.numel() * 4 / 2**20,
            sparse_q_kb=(ids.numel() * 8 + probs.numel() * 4) / 2**10,
        ))
        del logits, dense_q
        print(f"batch {num_reqs}: done", flush=True)
    return rows


def to_markdown(rows: list[dict], k: int, vocab_size: int, topk: int) -> str:
    today = datetime.date.today().isoformat()
    lines = [
        f"## Sparse vs dense verification ({SECTION})",
        "",
        f"2-core CPU, no GPU, {today}. V {vocab_size:,}, K {k}, q over {topk} ids, "
        "all requests random (temperature 1). Median of 2-5 runs after a warm-up; "
        "both sides include softmax, random draws and sampling from processed "
        "logits. Dense: vLLM 0.32.0 `rejection_sample` (C++ CPU kernels), q already "
        "dense; scatter: the extra time to make a 16-id q dense. Sparse: "
        "`sparse_rejection_sample` (PyTorch reference, the CPU path).",
        "",
        "Shared: the softmax and random draws both sides make (inside both totals); "
        "the last two columns are the totals less that.",
        "",
        "| batch | mean accepted | dense ms | + scatter ms | sparse ms | "
        "dense / sparse | dense q MiB | sparse q KiB | shared ms | "
        "dense - shared | sparse - shared |",
        "|" + " ---: |" * 11,
    ]
    for r in rows:
        lines.append(
            f"| {r['batch']} | {r['accepted']:.1f} | {r['dense_ms']:.1f} | "
            f"{r['scatter_ms']:.1f} | {r['sparse_ms']:.1f} | "
            f"{r['dense_ms'] / r['sparse_ms']:.2f}x | {r['dense_q_mb']:.0f} | "
            f"{r['sparse_q_kb']:.0f} | {r['shared_ms']:.1f} | "
            f"{r['dense_ms'] - r['shared_ms']:.1f} | "
            f"{r['sparse_ms'] - r['shared_ms']:.1f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--k", type=int, default=15)
    parser.add_argument("--vocab-size", type=int, default=248_320)
    parser.add_argument("--topk", type=int, default=16)
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args()
    CpuPlatform.import_kernels()
    CpuPlatform.register_triton_kernel_overrides()
    torch.manual_seed(0)
    rows = run(args.batches, args.k, args.vocab_size, args.topk)
    markdown = to_markdown(rows, args.k, args.vocab_size, args.topk)
    print(markdown)
    if not args.no_write:
        replace_section(DOC, SECTION, markdown.rstrip("\n"))


if __name__ == "__main__":
    main()
