"""The CPU operations whose cost shapes a DSpine step on this machine, each beside the
alternative it replaced (one thread, fp32; figures quoted in docs/dynamic-verification.md,
docs/verify.md and docs/kernels.md come from this script):

  1. target layers: SmolLM2's 30 layers of GEMMs (q/k/v, o, gate/up, down) through
     vLLM's oneDNN handles, weights streamed from memory, for M = 1 .. 16 rows (the
     target tokens of a step at concurrency 1: 1 + verified drafts). Shows why the
     step-cost curve is not made monotonic (proposer/dynamic.py, MeasuredStepCost).
  1b. the drafter's 3 layers (the target's shapes) at the rows of a draft block: vLLM's
     oneDNN fp32 handle against `Bf16Linear` (`dspine_draft_gemm` bf16).
  2. candidate retrieval over SmolLM2's head restricted to the committed drafter's
     retrieval vocabulary (20,500 ids), rows from the target's final hidden states:
     torch's F.linear (MKL), `FixedWeightMatmul` (vLLM's oneDNN fp32, kernels/cpu_gemm.py)
     and the certified bf16 path (kernels/retrieval.py `retrieve_candidates_certified`).
  3. top-p of verified draft rows at vocabulary 49,152, on rows shaped like a language
     model's at temperature 0.7 (`verify.synthetic.language_model_logits`) and on
     Gaussian ones (flat: the cut beyond the 256 largest, so the sort decides): vLLM's
     `apply_top_k_top_p_pytorch` against verify/top_k_top_p.py's sort of the values
     alone (`_apply_sorted`, every row) and what serving runs
     (`apply_top_k_top_p_values_sorted`: the 256 largest values where they decide, the
     sort for the rest); all three return the same tensor.
  4. the whole verification sampler of a step (`SparseRejectionSampler`) at
     temperature 0.7 / top-p 0.95, vocabulary 49,152, R requests of which d verify k
     drafts each: the exponentials of the recovered tokens drawn for every request
     (vLLM's order, `recovered_draw = "vllm"`), for the drafted requests only
     (`"drafted"`), and one uniform per drafted request, the recovered token by inverse
     CDF (`"inverse_cdf"`, what serving runs). d = 0 is plain decoding's path.

Sizes are interleaved round by round and the median taken (this machine's speed drifts).

    source scripts/env.sh
    OMP_NUM_THREADS=1 taskset -c 0 .venv/bin/python bench/bench_cpu_ops.py

Prints markdown tables and replaces its section of docs/benchmarks.md (`--no-doc`:
print only).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
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


def drafter_layers(rounds: int, sizes: list[int], num_layers: int = 3
                   ) -> dict[int, tuple[float, float]]:
    """The SmolLM2 drafter's layer products (its `num_layers` layers have the target's
    shapes, LAYER_SHAPES) for M block rows: vLLM's oneDNN fp32 handle (what an fp32
    engine builds) against `Bf16Linear` (`dspine_draft_gemm` bf16, kernels/cpu_gemm.py)."""
    from vllm import _custom_ops as ops

    from vllm_dspine.kernels.cpu_gemm import Bf16Linear

    g = torch.Generator().manual_seed(1)
    weights = [[torch.randn(N, K, generator=g) * 0.02 for K, N in LAYER_SHAPES]
               for _ in range(num_layers)]
    fp32 = [[(ops.create_onednn_mm(w.t(), 32), w.shape[1]) for w in ws] for ws in weights]
    bf16 = [[(Bf16Linear(w), w.shape[1]) for w in ws] for ws in weights]
    xs = {M: {K: torch.randn(M, K, generator=g) for K in (576, 1536)} for M in sizes}
    times: dict[int, tuple[list[float], list[float]]] = {M: ([], []) for M in sizes}
    for _ in range(rounds):
        for M in sizes:
            t0 = time.perf_counter()
            for handles in fp32:
                for h, K in handles:
                    ops.onednn_mm(h, xs[M][K], None)
            t1 = time.perf_counter()
            for linears in bf16:
                for linear, K in linears:
                    linear(xs[M][K])
            times[M][0].append(t1 - t0)
            times[M][1].append(time.perf_counter() - t1)
    return {M: (_median_ms(a), _median_ms(b)) for M, (a, b) in times.items()}


def retrieval_head(rounds: int, sizes: list[int], head: torch.Tensor, rows: torch.Tensor
                   ) -> tuple[dict[int, tuple[float, float, float]], tuple[float, float]]:
    """The drafter's candidate retrieval over `head` [V', H] (fp32) for M of `rows`: torch's
    F.linear + top 16, vLLM's oneDNN fp32 GEMM + top 16 (the path of a CPU without native
    bf16), and the certified bf16 path (`RetrievalHead` on a CPU with native bf16). Also
    the shares of `rows` its window of 48 proves, and it or the window of 256."""
    from vllm_dspine.kernels.cpu_gemm import FixedWeightMatmul
    from vllm_dspine.proposer.retrieval_head import RetrievalHead

    # The fp32 head scored whole through oneDNN (what `build` picks without native bf16).
    fp32 = RetrievalHead(head, None, None, None, FixedWeightMatmul(head))
    assert fp32.matmul.uses_onednn, "vLLM's oneDNN matmul is not available in this build"
    certified = RetrievalHead.build(head, None, "auto")
    assert certified.certified_matmul is not None, "this CPU has no native bf16"
    exact = torch.cat([fp32.candidates(rows[i:i + 64], 16, 128)
                       for i in range(0, len(rows), 64)])
    found = torch.cat([certified.candidates(rows[i:i + 64], 16, 128)
                       for i in range(0, len(rows), 64)])
    # The same 16 ids (fp32 near-ties aside: two summation orders may swap equal scores).
    assert (found.sort(1).values == exact.sort(1).values).all(1).float().mean() > 0.999
    proved = (1 - certified.rows_beyond_window / len(rows),
              1 - certified.rows_scored_whole / len(rows))
    paths = (lambda x: torch.nn.functional.linear(x, head).topk(16, dim=1).indices,
             lambda x: fp32.candidates(x, 16, 128),
             lambda x: certified.candidates(x, 16, 128))
    times = {M: ([], [], []) for M in sizes}
    for r in range(rounds):
        for M in sizes:
            x = rows[(r * M) % (len(rows) - M):][:M].contiguous()
            for i, f in enumerate(paths):
                t0 = time.perf_counter()
                f(x)
                times[M][i].append(time.perf_counter() - t0)
    return {M: tuple(_median_ms(t) for t in ts) for M, ts in times.items()}, proved


def retrieval_rows(target: str | None, vocab: list[int] | None, final: torch.Tensor | None
                   ) -> tuple[torch.Tensor, torch.Tensor, str]:
    """The retrieval head and rows to score: SmolLM2's own head restricted to the
    committed drafter's retrieval vocabulary, and the target's final-normed hidden states
    (stand-ins for the drafter's proposal rows: the same head scores both), when the pair
    is there; else random ones of the same shape."""
    if target is not None and vocab is not None and final is not None:
        from safetensors.torch import load_file

        weights = load_file(str(pathlib.Path(target) / "model.safetensors"))
        name = "lm_head.weight" if "lm_head.weight" in weights else "model.embed_tokens.weight"
        head = weights[name].float()[vocab].contiguous()
        return head, final, (f"SmolLM2's head over the committed drafter's {len(vocab):,}-id "
                             f"retrieval vocabulary; rows: the target's final-normed hidden "
                             f"states on the corpus answers below ({len(final):,})")
    g = torch.Generator().manual_seed(1)
    head = torch.randn(20500, 576, generator=g) / 24
    return head, torch.randn(4096, 576, generator=g), "random [20500, 576] head and rows"


def target_logits(target: str, corpus: str, seqs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's own logits at temperature 0.7 on the answers of the first `seqs`
    sequences of the corpus's last shard (chat-heavy), [rows, vocab], and its final-normed
    hidden states there, [rows, H]."""
    import numpy as np
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(target, torch_dtype=torch.float32)
    shards = json.loads((pathlib.Path(corpus) / "manifest.json").read_text())["shards"]
    shard = np.load(pathlib.Path(corpus) / shards[-1]["file"])
    rows, finals = [], []
    for i in range(seqs):
        start, end = shard["offsets"][i], shard["offsets"][i + 1]
        ids = torch.from_numpy(shard["tokens"][start:end].astype(np.int64))[None, :512]
        with torch.no_grad():
            out = model(ids, output_hidden_states=True)
        answer = int(shard["answer_start"][i])
        rows.append(out.logits[0][answer:])  # [tokens, vocab]
        finals.append(out.hidden_states[-1][0][answer:])  # [tokens, H]  after the final norm
    return torch.cat(rows) / 0.7, torch.cat(finals)


def top_p_rows(rounds: int, sizes: list[int], real: torch.Tensor | None
               ) -> tuple[dict[tuple[str, int], tuple[float, float, float]], dict[str, float]]:
    import numpy as np
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch

    from vllm_dspine.verify.synthetic import language_model_logits
    from vllm_dspine.verify.top_k_top_p import (_apply_sorted, _top_p_from_top_values,
                                                apply_top_k_top_p_values_sorted)

    g = torch.Generator().manual_seed(2)
    kinds = {"language model": lambda R: language_model_logits(R, 49152, g),
             "Gaussian": lambda R: torch.randn(R, 49152, generator=g) * 3 / 0.7}
    if real is not None:
        kinds["SmolLM2's own"] = lambda R: real[torch.randint(len(real), (R,), generator=g)]
    # The share of rows the 256 largest values decide (the rest are sorted).
    shares = {}
    for kind, make in kinds.items():
        x = real if kind == "SmolLM2's own" else make(512)
        count, slack = 0, 0.0
        for chunk in x.split(256):
            found = _top_p_from_top_values(chunk, torch.full((len(chunk),), 0.95))
            count += int((found.decided | found.keep_all).sum())
            # vLLM's own float32 cumulative probabilities at the same cuts (its sorted
            # softmax and cumsum), against the bound the fast path allows them
            vllm_cum = torch.cumsum(torch.from_numpy(
                np.sort(chunk.numpy(), axis=-1)).softmax(dim=-1), dim=-1)
            at_cut = vllm_cum[:, -1 - torch.arange(found.cumulative.shape[1])].double()
            slack = max(slack, float(((at_cut - found.cumulative).abs()
                                      / found.error).max()))
        shares[kind] = (count / len(x), len(x), slack)
    times = {(kind, R): ([], [], []) for kind in kinds for R in sizes}
    for _ in range(rounds):
        for kind, make in kinds.items():
            for R in sizes:
                logits = make(R)
                p = torch.full((R,), 0.95)
                want = None
                for i, f in enumerate((
                        lambda x: apply_top_k_top_p_pytorch(x, None, p, allow_cpu_sync=True),
                        lambda x: _apply_sorted(x, None, p),
                        lambda x: apply_top_k_top_p_values_sorted(x, None, p))):
                    x = logits.clone()
                    t0 = time.perf_counter()
                    out = f(x)
                    times[(kind, R)][i].append(time.perf_counter() - t0)
                    if want is None:
                        want = out
                    else:
                        assert torch.equal(out, want), "the top-p functions disagree"
    return {key: tuple(_median_ms(t) for t in ts) for key, ts in times.items()}, shares


SAMPLER_DRAWS = ("vllm", "drafted", "inverse_cdf")


def sampler_steps(rounds: int, cases: list[tuple[int, int, int]]
                  ) -> dict[tuple[int, int, int], tuple[float, ...]]:
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.metadata import SamplingMetadata
    from vllm.v1.sample.sampler import Sampler
    from vllm.v1.spec_decode.metadata import SpecDecodeMetadata

    from vllm_dspine.verify.sampler import SparseRejectionSampler
    from vllm_dspine.verify.synthetic import language_model_logits

    vocab = 49152
    g = torch.Generator().manual_seed(3)
    samplers = []
    for draw in SAMPLER_DRAWS:
        samplers.append(SparseRejectionSampler(Sampler()))
        samplers[-1].recovered_draw = draw
    times = {c: tuple([] for _ in samplers) for c in cases}
    for _ in range(rounds):
        for R, d, k in cases:
            num_draft = [k] * d + [0] * (R - d)
            # Rows: each request's drafts, then its bonus row (vLLM's layout).
            target = [i * (k + 1) + j for i in range(d) for j in range(k)]
            bonus = [i * (k + 1) + k for i in range(d)] + list(range(d * (k + 1), d * k + R))
            rows = d * k  # draft rows
            meta = SpecDecodeMetadata(
                draft_token_ids=torch.randint(vocab, (rows,), generator=g, dtype=torch.int32),
                num_draft_tokens=num_draft,
                cu_num_draft_tokens=torch.tensor(num_draft).cumsum(0).to(torch.int32),
                cu_num_sampled_tokens=torch.tensor([n + 1 for n in num_draft]).cumsum(0)
                .to(torch.int32),
                target_logits_indices=torch.tensor(target, dtype=torch.int32),
                bonus_logits_indices=torch.tensor(bonus, dtype=torch.int32),
                logits_indices=torch.arange(rows + R, dtype=torch.int32))
            sm = SamplingMetadata(
                temperature=torch.full((R,), 0.7), all_greedy=False, all_random=True,
                top_p=torch.full((R,), 0.95), top_k=None, generators={},
                max_num_logprobs=None, no_penalties=True, prompt_token_ids=None,
                frequency_penalties=torch.zeros(R), presence_penalties=torch.zeros(R),
                repetition_penalties=torch.ones(R),
                output_token_ids=[[] for _ in range(R)], allowed_token_ids_mask=None,
                bad_words_token_ids={}, logitsprocs=LogitsProcessors(),
                spec_token_ids=[[0] * n for n in num_draft])
            logits = language_model_logits(rows + R, vocab, g, temperature=1.0)
            cand_ids = torch.stack([torch.randperm(vocab, generator=g)[:16]
                                    for _ in range(rows)]) if rows else torch.zeros(0, 16).long()
            cand_probs = torch.full((rows, 16), 1 / 16)
            for i, sampler in enumerate(samplers):
                x = logits.clone()
                t0 = time.perf_counter()
                sampler(meta, cand_ids, cand_probs, x, sm)
                times[(R, d, k)][i].append(time.perf_counter() - t0)
    return {c: tuple(_median_ms(t) for t in ts) for c, ts in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--no-doc", action="store_true")
    ap.add_argument("--doc", default=str(DOC))
    ap.add_argument("--target", default="artifacts/smollm2/target",
                    help="the target whose own logits the top-p rows add, if it is there "
                         "(`python -m vllm_dspine.pairs smollm2 --out artifacts/smollm2`)")
    ap.add_argument("--corpus", default="data/corpus/smollm2")
    ap.add_argument("--target-seqs", type=int, default=40)
    ap.add_argument("--drafter", default="vllm_dspine/pairs/drafters/smollm2",
                    help="the drafter whose retrieval vocabulary the retrieval rows use")
    args = ap.parse_args()
    from vllm.platforms.cpu import CpuPlatform

    CpuPlatform.import_kernels()
    torch.set_num_threads(1)
    t0 = time.time()
    layer_sizes = [1, 2, 3, 4, 5, 6, 8, 9, 16]
    layers = target_layers(args.rounds, layer_sizes)
    draft_sizes = [1, 4, 16, 20, 32]
    draft = drafter_layers(args.rounds * 4, draft_sizes)
    have_target = pathlib.Path(args.target, "config.json").exists()
    real, final = (target_logits(args.target, args.corpus, args.target_seqs)
                   if have_target else (None, None))
    vocab_file = pathlib.Path(args.drafter) / "config.json"
    vocab = (json.loads(vocab_file.read_text())["dspine_config"].get("retrieval_vocab")
             if vocab_file.exists() else None)
    ret_head, ret_rows, ret_what = retrieval_rows(args.target if have_target else None,
                                                  vocab, final)
    head, proved = retrieval_head(args.rounds * 4, [1, 2, 4, 8, 15, 60], ret_head, ret_rows)
    top_p, shares = top_p_rows(max(3, args.rounds // 3), [1, 4, 16], real)
    steps = sampler_steps(max(3, args.rounds // 3),
                          [(1, 0, 0), (1, 1, 2), (1, 1, 4), (8, 0, 0), (8, 1, 1),
                           (8, 2, 1), (8, 4, 2), (32, 0, 0), (32, 1, 1), (32, 4, 1),
                           (32, 16, 2)])
    cores = ",".join(str(c) for c in sorted(os.sched_getaffinity(0)))
    out = [f"### CPU operations of a DSpine step (bench/bench_cpu_ops.py), "
           f"{datetime.date.today().isoformat()}\n",
           f"Machine: {machine()}; torch {torch.__version__}, one thread, fp32. Command: "
           f"`OMP_NUM_THREADS=1 taskset -c {cores} python bench/bench_cpu_ops.py "
           f"{' '.join(sys.argv[1:])}`. Medians of {args.rounds} interleaved rounds "
           f"(retrieval: {args.rounds * 4}, top-p: {max(3, args.rounds // 3)}). "
           f"Wall {time.time() - t0:.0f} s.\n",
           "SmolLM2's 30 target layers (GEMMs only, vLLM's oneDNN, weights streamed from "
           "memory), by rows M (at concurrency 1: 1 + verified drafts):\n",
           "| M | " + " | ".join(str(M) for M in layer_sizes) + " |",
           "| --- |" + " ---: |" * len(layer_sizes),
           "| ms | " + " | ".join(f"{layers[M]:.1f}" for M in layer_sizes) + " |\n",
           "The SmolLM2 drafter's 3 layers (the same shapes; GEMMs only), by block rows M "
           "(16 at concurrency 1, plus the step's context rows): vLLM's oneDNN fp32 handle "
           "(an fp32 engine's) against `Bf16Linear` (`dspine_draft_gemm` bf16: weight and "
           "input rounded to bf16, fp32 sums, the input's cast included), ms:\n",
           "| M | oneDNN fp32 | Bf16Linear | fp32 / bf16 |",
           "| ---: | ---: | ---: | ---: |",
           *[f"| {M} | {a:.2f} | {b:.2f} | {a / b:.2f}x |" for M, (a, b) in draft.items()],
           "",
           f"Candidate retrieval (the 16 best ids of each row, fp32 head "
           f"{list(ret_head.shape)}; {ret_what}), ms: torch's F.linear, vLLM's oneDNN fp32 "
           f"GEMM (`FixedWeightMatmul`, a CPU without native bf16), and the bf16 copy through "
           f"oneDNN with the best 48 rescored and the fp32 top 16 proved per row "
           f"(`retrieve_candidates_certified`, what serving runs on a CPU with native bf16; "
           f"the window of 48 proved {proved[0]:.2%} of the rows, with the window of 256 for "
           f"the others {proved[1]:.2%}; the rest were scored in fp32 whole):\n",
           "| rows | torch F.linear | oneDNN fp32 | certified bf16 | fp32 / certified |",
           "| ---: | ---: | ---: | ---: | ---: |"]
    out += [f"| {M} | {a:.2f} | {b:.2f} | {c:.2f} | {b / c:.2f}x |"
            for M, (a, b, c) in head.items()]
    out += ["", "Top-p 0.95 on draft rows at vocabulary 49,152 (temperature 0.7 logits: "
            "shaped like a language model's, and Gaussian), ms; all three return the same "
            "tensor (asserted):\n",
            "| logits | rows | vLLM apply_top_k_top_p_pytorch | values sorted (_apply_sorted) "
            "| serving (apply_top_k_top_p_values_sorted) | vLLM / serving |",
            "| --- | ---: | ---: | ---: | ---: | ---: |"]
    out += [f"| {kind} | {R} | {a:.2f} | {b:.2f} | {c:.2f} | {a / c:.1f}x |"
            for (kind, R), (a, b, c) in top_p.items()]
    out += ["", "Rows the 256 largest values decide at top-p 0.95 (the rest are sorted), and "
            "the largest deviation of vLLM's float32 cumulative probability at a cut among "
            "them from the fast path's float64 value, as a share of the error bound it "
            "allows: "
            + "; ".join(f"{kind} {share:.1%} of {n:,} ({slack:.2%})"
                        for kind, (share, n, slack) in shares.items())
            + (f" (SmolLM2's own: the target's logits / 0.7 on the answers of the first "
               f"{args.target_seqs} sequences of the corpus's last shard)." if real is not None
               else ".")]
    out += ["", "The verification sampler of one step (`SparseRejectionSampler`, bonus rows "
            "through vLLM's sampler as in plain decoding), temperature 0.7, top-p 0.95, "
            "vocabulary 49,152, logits shaped like a language model's: R requests, d of them "
            "verifying k drafts; the recovered tokens' exponentials drawn for all R requests "
            "(vLLM's order) or for the d drafted ones, or one uniform per drafted request and "
            "the inverse CDF of the residual, the rows verified position by position "
            "(serving), ms:\n",
            "| R | d | k | exponentials for all R | for the d drafted | inverse CDF | "
            "all R / inverse CDF |",
            "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    out += [f"| {R} | {d} | {k} | {a:.1f} | {b:.1f} | {c:.1f} | {a / c:.2f}x |"
            for (R, d, k), (a, b, c) in steps.items()]
    body = "\n".join(out) + "\n"
    print(body)
    if not args.no_doc:
        replace_section(args.doc, SECTION, body)


if __name__ == "__main__":
    main()
