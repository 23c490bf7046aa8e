"""The patch module: each patch does what it says, is idempotent, and refuses another
vLLM version. The CPU expand fix is tested against the bug it fixes (FINDINGS.md)."""

from __future__ import annotations

import pytest
import torch

from engine_utils import engine_env

engine_env()


@pytest.fixture(scope="module")
def patched():
    from vllm_dspine.plugin.patches import apply_patches

    apply_patches()
    apply_patches()  # idempotent
    return True


def test_vllm_cpu_expand_override_is_broken_for_floats():
    """The bug itself: vLLM's CPU override writes into an int64 copy of a float
    output and never copies back, so the output keeps whatever it held."""
    from vllm.platforms.cpu import CpuPlatform

    CpuPlatform.import_kernels()
    from vllm.utils import cpu_triton_utils
    from vllm_dspine.plugin import patches as vllm_patches

    vanilla = cpu_triton_utils._expand_kernel_impl
    if vanilla is vllm_patches._expand_kernel_impl:
        pytest.skip("patched in this process already; the vanilla function is gone")
    out = torch.full((5,), float("nan"))
    vanilla(out, torch.tensor([1.5, 0.7]), torch.tensor([3, 5], dtype=torch.int32), 0, 1)
    assert torch.isnan(out).all()


def test_expand_batch_to_tokens_correct_after_patch(patched):
    """FINDINGS' reproducer: per-token temperatures must be [1.5, 1.5, 1.5, 0.7, 0.7]."""
    from vllm.platforms.cpu import CpuPlatform

    CpuPlatform.import_kernels()
    CpuPlatform.register_triton_kernel_overrides()
    from vllm.v1.sample.rejection_sampler import expand_batch_to_tokens

    out = expand_batch_to_tokens(torch.tensor([1.5, 0.7]),
                                 torch.tensor([3, 5], dtype=torch.int32), 5, 0, 1)
    assert torch.equal(out, torch.tensor([1.5, 1.5, 1.5, 0.7, 0.7]))
    # Greedy temperature 0 is replaced (replace_from=0 -> replace_to=1), ints too.
    out = expand_batch_to_tokens(torch.tensor([0.0, 2.0, 0.5]),
                                 torch.tensor([1, 1, 3], dtype=torch.int32), 3, 0, 1)
    assert torch.equal(out, torch.tensor([1.0, 0.5, 0.5]))
    ints = expand_batch_to_tokens(torch.tensor([7, 9]), torch.tensor([2, 3]), 3)
    assert torch.equal(ints, torch.tensor([7, 7, 9]))


def test_dspine_method_translated_and_options_checked(patched):
    from vllm_dspine.plugin.patches import split_dspine_options

    spec, opts = split_dspine_options({"method": "dspine", "model": "/d",
                                       "num_speculative_tokens": 15,
                                       "dspine_retrieval": "bf16"})
    assert spec == {"method": "dflash", "model": "/d", "num_speculative_tokens": 15}
    assert opts == {"dspine_retrieval": "bf16"}
    with pytest.raises(ValueError, match="needs 'model'"):
        split_dspine_options({"method": "dspine"})


def test_other_vllm_version_refused(monkeypatch):
    import vllm

    from vllm_dspine.plugin.patches import apply_patches

    monkeypatch.setattr(vllm, "__version__", "0.33.0")
    with pytest.raises(RuntimeError, match=r"pinned to vLLM 0.32.0.*0.33.0 is installed"):
        apply_patches()


def test_min_p_and_logit_bias_allowed_only_for_dspine(patched):
    from types import SimpleNamespace

    from vllm import SamplingParams

    sp = SamplingParams(min_p=0.1, logit_bias={3: 1.0})
    dspine = SimpleNamespace(draft_model_config=SimpleNamespace(
        hf_config=SimpleNamespace(dspine_config={"block_size": 16})))
    other = SimpleNamespace(draft_model_config=SimpleNamespace(
        hf_config=SimpleNamespace()))
    sp._validate_spec_decode(dspine)  # DSpine verifies min_p/logit_bias exactly
    with pytest.raises(Exception, match="min_p and logit_bias"):
        sp._validate_spec_decode(other)


def _grouped_reference(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w[:, None, None, :]


def test_vllm_cpu_rms_norm_ignores_grouped_weights():
    """The bug: with a stacked [layers, head_dim] weight (vLLM's DFlash context keys)
    the CPU kernel applies row 0 to every layer."""
    from vllm.platforms.cpu import CpuPlatform

    CpuPlatform.import_kernels()
    torch.manual_seed(0)
    x, w = torch.randn(3, 5, 2, 32), torch.rand(3, 32) + 0.5
    out = torch.empty_like(x)
    torch.ops._C.rms_norm(out, x, w, 1e-6)
    ref = _grouped_reference(x, w, 1e-6)
    assert torch.allclose(out[0], ref[0], atol=1e-5)
    assert not torch.allclose(out[1], ref[1], atol=1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_rms_norm_correct_after_patch(patched, dtype):
    from vllm import _custom_ops as ops

    torch.manual_seed(1)
    x, w = torch.randn(3, 7, 2, 32), torch.rand(3, 32) + 0.5
    out = torch.empty_like(x, dtype=dtype)
    ops.rms_norm(out, x.to(dtype), w.to(dtype), 1e-6)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out.float(), _grouped_reference(x, w, 1e-6), atol=tol,
                               rtol=tol)
    # A plain [D] weight still goes to vLLM's kernel.
    out1 = torch.empty_like(x[0])
    ops.rms_norm(out1, x[0].contiguous(), w[0].contiguous(), 1e-6)
    torch.testing.assert_close(out1, _grouped_reference(x[:1], w[:1], 1e-6)[0])


@pytest.mark.parametrize("state_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("activation", ["silu", None])
def test_cpu_causal_conv1d_equals_vllms(patched, state_dtype, with_bias, activation):
    """Patch 13: the fp32-tap conv gives vLLM's `causal_conv1d_fn_cpu` outputs and
    window updates (sequences of 0..9 tokens, with and without an initial window, one on
    the pad slot), bit for bit, and the GDN module now calls it (vLLM's bf16 `F.conv1d`
    accumulates in fp32 and rounds once, as this does; with the taps reversed 0.5 % of
    the outputs still agree, measured)."""
    from vllm.model_executor.layers.mamba.ops.cpu import gdn_attention
    from vllm.model_executor.layers.mamba.ops.cpu.causal_conv1d import causal_conv1d_fn_cpu
    from vllm.v1.attention.backends.utils import PAD_SLOT_ID

    from vllm_dspine.plugin.patches import _causal_conv1d_fp32_cpu

    assert gdn_attention.causal_conv1d_torch._dspine_patched
    g = torch.Generator().manual_seed(0)
    D, W, lens = 96, 4, [3, 0, 1, 9, 2, 5]
    qsl = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    x = torch.randn(D, sum(lens), generator=g).to(torch.bfloat16)  # [D, T]
    weight = (torch.randn(D, W, generator=g) * 0.5).to(torch.bfloat16)
    bias = (torch.randn(D, generator=g) * 0.1).to(torch.bfloat16) if with_bias else None
    states = torch.randn(8, D, W - 1, generator=g).to(state_dtype)  # [slots, D, W-1]
    slots = torch.tensor([5, 1, PAD_SLOT_ID, 0, 3, 6], dtype=torch.int32)
    initial = torch.tensor([True, False, True, False, True, True])
    want_states, got_states = states.clone(), states.clone()
    want = causal_conv1d_fn_cpu(x, weight, bias, want_states, qsl, slots, initial,
                                activation=activation)
    got = _causal_conv1d_fp32_cpu(x, weight, bias, got_states, qsl, slots, initial,
                                  activation=activation)
    assert got.dtype == want.dtype and got.shape == want.shape
    live = torch.cat([torch.arange(int(qsl[i]), int(qsl[i + 1])) for i in range(len(lens))
                      if int(slots[i]) != PAD_SLOT_ID])
    assert torch.equal(got[:, live], want[:, live])
    assert torch.equal(got_states, want_states)
