"""The drafter's linear layers in bf16 on an fp32 CPU engine (`dspine_draft_gemm`,
vllm_dspine/kernels/cpu_gemm.py `Bf16Linear`, vllm_dspine/model/vllm_model.py
`Bf16CpuLinearMethod`): the product against its definition, and the wiring into vLLM's
own linear layer. Served end to end on the SmolLM2 pair (auto picks bf16 on a CPU with
native bf16) by tests/test_smollm2_pair.py: greedy output equal to plain decoding."""

from __future__ import annotations

import pytest
import torch

from vllm_dspine.kernels.cpu_gemm import Bf16Linear, native_bf16_cpu


@pytest.fixture(scope="module", autouse=True)
def _vllm_cpu_kernels():
    from vllm.platforms.cpu import CpuPlatform

    CpuPlatform.import_kernels()


def _bf16_reference(x, weight, bias=None):
    """The definition: inputs rounded to bf16, exact products summed in float64 here,
    the sum rounded to bf16, bias added in fp32."""
    y = (x.to(torch.bfloat16).double() @ weight.to(torch.bfloat16).double().t())
    y = y.to(torch.bfloat16).float()
    return y if bias is None else y + bias


@pytest.mark.parametrize("M,N,K", [(1, 576, 576), (16, 1536, 576), (17, 576, 1536),
                                   (3, 37, 100)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_bf16_linear_is_its_definition(M, N, K, with_bias):
    """Within one bf16 rounding of the output (2^-8 relative: the fp32 sum's order may
    round the other way), fp32 out; a wrong transpose or a missing rounding of the
    input is off by far more (the second assertion: the fp32 product differs)."""
    g = torch.Generator().manual_seed(M * N + K)
    weight = torch.randn(N, K, generator=g) * 0.05
    x = torch.randn(M, K, generator=g)
    bias = torch.randn(N, generator=g) if with_bias else None
    got = Bf16Linear(weight)(x, bias)
    assert got.dtype == torch.float32 and got.shape == (M, N)
    want = _bf16_reference(x, weight, bias)
    scale = want.abs().clamp_min(1e-3)
    assert float(((got - want).abs() / scale).max()) <= 2.0 ** -7
    exact = x.double() @ weight.double().t() + (0 if bias is None else bias.double())
    assert float((got.double() - exact).abs().max()) > 1e-6  # it is a bf16 product


def test_which_engines_multiply_in_bf16():
    from vllm_dspine.model.vllm_model import layer_gemms_in_bf16

    assert not layer_gemms_in_bf16("fp32", torch.float32)
    assert not layer_gemms_in_bf16("bf16", torch.bfloat16)  # bf16 already
    assert layer_gemms_in_bf16("bf16", torch.float32)
    assert layer_gemms_in_bf16("auto", torch.float32) == native_bf16_cpu()


def test_vllm_linear_method_runs_the_bf16_product():
    """`use_bf16_layer_gemms` switches every unquantized vLLM linear layer (once); after
    vLLM's own `process_weights_after_loading` (which frees the fp32 weight) the layer's
    product is the bf16 product of the weight it had at load. (A vLLM layer built here
    would need a tensor-parallel group: the layer is vLLM's `LinearBase` with its
    construction skipped.)"""
    from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod

    from vllm_dspine.model.vllm_model import Bf16CpuLinearMethod, use_bf16_layer_gemms

    class Layer(LinearBase):
        def __init__(self, weight):
            torch.nn.Module.__init__(self)
            self.weight = torch.nn.Parameter(weight.clone(), requires_grad=False)
            self.quant_method = UnquantizedLinearMethod()

    g = torch.Generator().manual_seed(3)
    weight = torch.randn(96, 64, generator=g) * 0.1
    layer = Layer(weight)
    container = torch.nn.ModuleList([layer, torch.nn.Linear(4, 4)])
    assert use_bf16_layer_gemms(container) == 1  # torch's own Linear is not vLLM's
    assert isinstance(layer.quant_method, Bf16CpuLinearMethod)
    assert use_bf16_layer_gemms(container) == 0  # switched once
    layer.quant_method.process_weights_after_loading(layer)
    assert layer.weight.numel() == 0  # vLLM's dispatch freed the fp32 weight
    x = torch.randn(5, 64, generator=g)
    out = layer.quant_method.apply(layer, x)
    torch.testing.assert_close(out, Bf16Linear(weight)(x), rtol=0, atol=0)
