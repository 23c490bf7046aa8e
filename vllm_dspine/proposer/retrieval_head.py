"""The proposer's candidate retrieval: which copy of the target's head it scores and
how, chosen once at load (`RetrievalHead.build`), then `candidates` per step.

    N proposal rows, H hidden, V vocabulary, V' rows of the drafter's
    `retrieval_vocab` (when it lists one), k = head_topk.
"""

from __future__ import annotations

import torch

from vllm_dspine.kernels.cpu_gemm import FixedWeightMatmul, native_bf16_cpu
from vllm_dspine.kernels.retrieval import (
    FP8Head,
    fp8_matmul_available,
    retrieve_candidates,
    retrieve_candidates_certified,
)

# An fp32 head (vLLM on CPU) with at most this many retrieval rows is scored in fp32
# whole; above it a bf16 copy scores coarsely and the best 128 are rescored in fp32.
# Measured (`python bench/bench_tail.py --dtype fp32 --hidden 576 --code 64 --message 32
# --vocab V --reqs R --no-docs`, one thread): at 8 x 15 rows, V 6,227: 10.7 vs 37 ms;
# V 16,384: 35 vs 45 ms; V 49,152: 90 vs 62 ms (the rescore's [rows, 128, H] gather is
# what the copy costs; it pays only over the large product it saves).
EXACT_FP32_MAX_VOCAB = 24_576

# On a CPU with native bf16 (AVX512-BF16 or AMX) an fp32 head of any size is scored by
# its bf16 copy through vLLM's oneDNN GEMM and the best CERTIFIED_WINDOW rescored in fp32,
# which proves the fp32 top 16 or scores the row in fp32 whole
# (`retrieve_candidates_certified`). Rows the window does not prove try 256 before the
# fp32 product. On the target's own final hidden states over the SmolLM2 drafter's
# 20,500-id head (`python bench/bench_cpu_ops.py`) the window of 48 proved 93.7 % of the
# rows and 256 all of the others; the drafter's own proposal rows, looked at with a
# scratch script (not committed), were proved more often at 48.
CERTIFIED_WINDOW = 48




class RetrievalHead:
    """The rows of the target's head that retrieval scores, and one way to score them:

    - an FP8 copy (`FP8Head`) where the GPU has FP8 matmul, rescored exactly;
    - else, for an fp32 head on a CPU with native bf16, a bf16 copy through vLLM's
      oneDNN GEMM whose best CERTIFIED_WINDOW are rescored, the fp32 top 16 proved per
      row (`certified_matmul`, `row_norms`; unproved rows through `matmul`);
    - else, for an fp32 head of more than EXACT_FP32_MAX_VOCAB rows, a bf16 copy scored
      coarsely and rescored with the fp32 head (`coarse_head`);
    - else the head itself, through vLLM's oneDNN matmul on CPU (`FixedWeightMatmul`).
    """

    def __init__(self, weight: torch.Tensor, token_ids: torch.Tensor | None,
                 fp8_head: FP8Head | None, coarse_head: torch.Tensor | None,
                 matmul: FixedWeightMatmul | None,
                 certified_matmul: FixedWeightMatmul | None = None,
                 row_norms: torch.Tensor | None = None) -> None:
        self.weight = weight  # [V' or V, H]
        self.token_ids = token_ids  # [V'] the token id of each row, None: row = id
        self.fp8_head = fp8_head
        self.coarse_head = coarse_head  # [V' or V, H] bf16 copy of an fp32 head
        self.matmul = matmul
        self.certified_matmul = certified_matmul  # over the head's bf16 copy
        self.row_norms = row_norms  # [V' or V] fp32, upper bounds on the rows' norms
        # Rows the certified path's first window did not prove, and of them those its
        # wider window did not prove either (scored in fp32 whole), counted.
        self.rows_beyond_window = 0
        self.rows_scored_whole = 0

    @classmethod
    def build(cls, head: torch.Tensor,  # [V, H] the target's head (shared, never copied)
              retrieval_vocab: list[int] | None, mode: str) -> "RetrievalHead":
        """mode: the `dspine_retrieval` option ("auto", "fp8" or "bf16")."""
        # The whole head, or the rows of the drafter's `retrieval_vocab` (a copy, [V', H];
        # its candidates are mapped back to ids).
        token_ids = (None if retrieval_vocab is None else
                     torch.tensor(retrieval_vocab, dtype=torch.long, device=head.device))
        weight = head if token_ids is None else head[token_ids].contiguous()
        if mode == "fp8" and not fp8_matmul_available(head.device):
            raise ValueError(
                "speculative_config['dspine_retrieval'] = 'fp8' needs FP8 matmul (CUDA, "
                "compute capability >= 8.9); use 'auto' or 'bf16' on this device")
        fp8_head = coarse_head = matmul = certified_matmul = row_norms = None
        if mode != "bf16" and fp8_matmul_available(head.device):
            fp8_head = FP8Head.from_head(weight)
        elif (head.dtype == torch.float32 and mode != "fp8" and head.device.type == "cpu"
              and native_bf16_cpu() and weight.shape[0] >= CERTIFIED_WINDOW):
            # The fp32 head itself (`matmul`, below) scores the rows it does not prove.
            certified_matmul = FixedWeightMatmul(weight.to(torch.bfloat16).contiguous())
            # Norms in float64, rounded up past fp32's rounding: upper bounds.
            row_norms = (weight.double().norm(dim=1) * (1 + 2.0 ** -20)).float()
        elif (head.dtype == torch.float32 and mode != "fp8"
              and weight.shape[0] > EXACT_FP32_MAX_VOCAB):
            # An fp32 model (CPU): coarse scores from a bf16 copy of the head, the best
            # coarse_topk rescored with the fp32 head (kernels/retrieval.py). Smaller
            # heads are scored in fp32 whole: exact, and faster (EXACT_FP32_MAX_VOCAB).
            coarse_head = weight.to(torch.bfloat16).contiguous()
        if fp8_head is None and coarse_head is None:
            # The whole head is scored in its own dtype: vLLM's oneDNN matmul on CPU
            # (kernels/cpu_gemm.py), torch's elsewhere.
            matmul = FixedWeightMatmul(weight)
        return cls(weight, token_ids, fp8_head, coarse_head, matmul, certified_matmul,
                   row_norms)

    @property
    def num_rows(self) -> int:
        return self.weight.shape[0]

    def describe(self) -> str:
        if self.fp8_head is not None:
            return "fp8+rescore"
        if self.certified_matmul is not None:
            return (f"bf16 copy of the fp32 head (oneDNN), best {CERTIFIED_WINDOW} rescored, "
                    "the fp32 top candidates proved per row")
        if self.coarse_head is not None:
            return "bf16 copy of the fp32 head+rescore"
        return f"{str(self.weight.dtype).replace('torch.', '')} full vocab"

    def candidates(self, final_hidden: torch.Tensor,  # [N, H] final-normed proposal rows
                   head_topk: int, coarse_topk: int) -> torch.Tensor:
        """The `head_topk` best token ids per row, by exact score.  -> [N, k] int64"""
        if self.certified_matmul is not None and final_hidden.dtype == torch.float32:
            found = retrieve_candidates_certified(
                final_hidden, self.weight, head_topk,
                min(max(CERTIFIED_WINDOW, head_topk), self.num_rows),
                self.certified_matmul, self.row_norms, self.matmul)
            self.rows_beyond_window += int((~found.decided).sum())
            self.rows_scored_whole += found.scored_whole
            rows = found.ids  # [N, k]
            return self.token_ids[rows] if self.token_ids is not None else rows
        rows = retrieve_candidates(
            final_hidden, self.weight, head_topk, coarse_topk, self.fp8_head,
            mode="auto" if self.fp8_head is not None else "bf16",
            coarse_head=self.coarse_head, head_matmul=self.matmul)  # [N, k]
        if self.token_ids is not None:
            return self.token_ids[rows]  # rows of the sub-head -> token ids
        return rows
