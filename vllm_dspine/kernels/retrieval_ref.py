"""Plain PyTorch reference of candidate retrieval (docs/design.md section 1.4).

The FP8 copy of the output head, the coarse FP8 scores (the oracle of
`fp8_head_scores_kernel` in `retrieval.py`, and its CPU path) and the exact rescoring.

    N rows to score, H hidden size, V vocabulary size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite float8_e4m3fn

# Rows quantized / dequantized per step: bounds the fp32 temporaries at real sizes
# (16,384 x 5,120 x 4 B = 320 MiB) instead of materialising the whole head in fp32.
_CHUNK_ROWS = 16384
# fp32 elements of one exact-rescoring temporary on CPU (1 MiB; `exact_scores_ref`).
_RESCORE_ELEMENTS = 1 << 18


@dataclass
class FP8Head:
    """A row-scaled float8_e4m3fn copy of the output head, built once at load.

    head[v] ~= weight[v].float() * scale[v], scale[v] = amax_i |head[v, i]| / 448.
    """

    weight: torch.Tensor  # [V, H] float8_e4m3fn
    scale: torch.Tensor  # [V] float32

    def __post_init__(self) -> None:
        assert self.weight.dtype == FP8_DTYPE, self.weight.dtype
        assert self.weight.ndim == 2 and self.scale.shape == self.weight.shape[:1]
        assert self.scale.dtype == torch.float32

    @property
    def vocab_size(self) -> int:
        return self.weight.shape[0]

    @property
    def hidden_size(self) -> int:
        return self.weight.shape[1]

    @classmethod
    def from_head(cls, head_weight: torch.Tensor) -> "FP8Head":
        """Quantize `head_weight` [V, H] (bf16/fp16/fp32) row by row."""
        if head_weight.ndim != 2:
            raise ValueError(f"head_weight must be [vocab_size, hidden_size], got shape "
                             f"{tuple(head_weight.shape)}")
        if not head_weight.is_floating_point() or head_weight.dtype == FP8_DTYPE:
            raise ValueError(f"head_weight must be bf16, fp16 or fp32, got {head_weight.dtype}; "
                             f"pass the unquantized output head")
        V, H = head_weight.shape
        weight = torch.empty(V, H, dtype=FP8_DTYPE, device=head_weight.device)
        scale = torch.empty(V, dtype=torch.float32, device=head_weight.device)
        for start in range(0, V, _CHUNK_ROWS):
            rows = head_weight[start:start + _CHUNK_ROWS].float()  # [chunk, H]
            amax = rows.abs().amax(dim=1)  # [chunk]
            # An all-zero row keeps scale 1 (its codes are all 0), never 0/0.
            s = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
            weight[start:start + _CHUNK_ROWS] = (rows / s[:, None]).clamp_(
                -FP8_MAX, FP8_MAX).to(FP8_DTYPE)
            scale[start:start + _CHUNK_ROWS] = s
        return cls(weight=weight, scale=scale)

    def dequantize(self) -> torch.Tensor:
        """The whole head in fp32 [V, H] (tests only; 5 GB at real sizes)."""
        return self.weight.float() * self.scale[:, None]


def fp8_head_scores_ref(
    hidden: torch.Tensor,  # [N, H]  final hidden states (after the final norm)
    fp8_head: FP8Head,
) -> torch.Tensor:
    """Approximate logits with the FP8 head: dequantize rows, fp32 matmul.  -> [N, V] fp32

    The head is dequantized `_CHUNK_ROWS` vocabulary rows at a time so that the CPU path
    never holds more than one chunk in fp32.
    """
    assert hidden.ndim == 2 and hidden.shape[1] == fp8_head.hidden_size
    x = hidden.float()  # [N, H]
    V = fp8_head.vocab_size
    out = torch.empty(x.shape[0], V, dtype=torch.float32, device=x.device)
    for start in range(0, V, _CHUNK_ROWS):
        stop = min(start + _CHUNK_ROWS, V)
        w = fp8_head.weight[start:stop].float() * fp8_head.scale[start:stop, None]  # [chunk, H]
        out[:, start:stop] = x @ w.t()
    return out


def exact_scores_ref(
    hidden: torch.Tensor,  # [N, H]
    head_weight: torch.Tensor,  # [V, H]
    ids: torch.Tensor,  # [N, n] int64
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Exact scores of chosen rows: <head[ids[r, j]], hidden[r]> in fp32.  -> [N, n]

    "Exact" means the head's stored values (bf16 or fp32) upcast to fp32, fp32 products
    and fp32 accumulation (`dtype` float64: the same in float64, for the tail's tables).
    """
    N, n = ids.shape
    x = hidden.to(dtype)
    if head_weight.device.type != "cpu":
        return torch.einsum("nkh,nh->nk", head_weight[ids].to(dtype), x)
    # On CPU: index_select of the flat ids (faster than advanced indexing here), then the
    # element-wise product and sum (faster than einsum's batched matmul at a step's
    # rows), a few rows at a time: temporaries of more than a few MB are fresh pages on
    # every call, whose faults made the rescore of 60 rows x 48 ids x 576 far slower per
    # row than that of 15 (one thread, this project's CPU; seen with a scratch timer).
    H = head_weight.shape[1]
    chunk = max(1, _RESCORE_ELEMENTS // (n * H))
    out = torch.empty(N, n, dtype=dtype, device=x.device)
    for start in range(0, N, chunk):
        stop = min(start + chunk, N)
        rows = head_weight.index_select(0, ids[start:stop].reshape(-1)).view(
            stop - start, n, H).to(dtype)  # [chunk, n, H]
        out[start:stop] = (rows * x[start:stop, None, :]).sum(dim=-1)
    return out
