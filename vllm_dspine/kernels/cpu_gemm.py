"""`x @ weight.T` for a weight fixed at load, through vLLM's oneDNN matmul on CPU.

vLLM's own linear layers on CPU run through a oneDNN handle built once per weight
(`vllm._custom_ops.create_onednn_mm`, see `dispatch_cpu_unquantized_gemm`); a plain
`torch.nn.functional.linear` there goes through MKL, which at the few rows a draft
block has is 1.3-2.5x slower. Measured (bench/bench_cpu_ops.py: one thread, this
project's 2-core CPU, fp32, the `[20500, 576]` retrieval head of SmolLM2's drafter, the
top 16 of each row included): F.linear 4.32 / 9.06 / 7.06 / 8.20 / 11.20 ms for 1 / 2 /
4 / 8 / 15 rows, oneDNN 3.33 / 3.97 / 2.87 / 3.84 / 5.35 ms (docs/benchmarks.md,
"bench_cpu_ops"). The drafter's retrieval scores its whole head every drafted step, so
this is its largest single product after the layers.

Off CPU, for dtypes oneDNN does not take, or when vLLM's build lacks oneDNN, the call
is `F.linear` itself. The two differ only in floating-point summation order.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _onednn_handle(weight: torch.Tensor):
    """vLLM's oneDNN matmul handle for `weight` [N, K], or None where it does not apply."""
    if weight.device.type != "cpu" or weight.dtype not in (torch.float32, torch.bfloat16):
        return None
    try:
        from vllm import _custom_ops as ops
    except ImportError:  # pragma: no cover - vLLM is a dependency
        return None
    if not getattr(ops, "_supports_onednn", False):
        return None
    try:
        return ops.create_onednn_mm(weight.t(), 32)
    except RuntimeError:  # vLLM falls back to torch the same way
        return None


class FixedWeightMatmul:
    """y = x @ weight.T for one weight [N, K] kept for the engine's life."""

    def __init__(self, weight: torch.Tensor):  # [N, K]
        if weight.ndim != 2:
            raise ValueError(f"weight must be 2-D [N, K], got shape {tuple(weight.shape)}")
        self.weight = weight
        self._handle = _onednn_handle(weight)

    @property
    def uses_onednn(self) -> bool:
        return self._handle is not None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [M, K] -> [M, N]
        if (self._handle is not None and x.dtype == self.weight.dtype
                and x.device == self.weight.device):
            from vllm import _custom_ops as ops

            return ops.onednn_mm(self._handle, x.contiguous(), None)
        return F.linear(x.to(self.weight.dtype), self.weight)


def native_bf16_cpu() -> bool:
    """Whether this CPU multiplies bf16 natively (AVX-512 BF16 or AMX; else oneDNN
    emulates it, slower than fp32)."""
    return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())


class Bf16Linear:
    """y = x @ weight.T with the weight and the input rounded to bf16, products summed in
    fp32 (oneDNN on CPU) and the sum rounded to bf16 (oneDNN's output type), returned in
    x's dtype: [M, K] -> [M, N].

    For a drafter served in fp32 on a CPU with native bf16 (the DSpine drafter's layers,
    `dspine_draft_gemm`, docs/serving.md): half the weight bytes and twice the multiply
    rate of fp32 at the few rows of a draft block. Only the drafts change, never an
    output distribution (verification reads the q the drafter drew)."""

    def __init__(self, weight: torch.Tensor):  # [N, K], any float dtype
        self.matmul = FixedWeightMatmul(weight.detach().to(torch.bfloat16).contiguous())

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        y = self.matmul(x.to(torch.bfloat16)).to(x.dtype)  # [M, N]
        return y if bias is None else y.add_(bias)

