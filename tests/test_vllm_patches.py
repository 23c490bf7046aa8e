"""The patch table (vllm_dspine/plugin/patches/): every row's vLLM symbols are in the
pinned vLLM as the row says, at run time and in the installed source; each row is applied
once, at registration and not on import, and a second `apply_patches()` changes nothing;
README.md is the table's rendering; another vLLM is refused. Each fix is also tested
against the bug it fixes (docs/measured.md).

The checks that need an unpatched vLLM run in a fresh interpreter (`fresh`,
tests/fresh_vllm.py, shared with tests/test_step_profile.py: one import of vLLM, ~17 s on
a slow core, for both): an earlier test module of the same session may have applied the
patches in this one, and they cannot be undone."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from engine_utils import engine_env
from vllm_dspine.plugin.patches.table import PATCHES

engine_env()

ROW_IDS = [p.id for p in PATCHES]

@pytest.fixture(scope="module")
def fresh(fresh_vllm) -> dict:
    """conftest.py's `fresh_vllm`: tests/fresh_vllm.py's probe, run once per session in a
    fresh interpreter (one JSON object)."""
    return fresh_vllm


@pytest.fixture(scope="module")
def patched():
    from vllm_dspine.plugin.patches import apply_patches

    apply_patches()
    apply_patches()  # idempotent
    return True


# ------------------------------------------------------------------ the table itself
@pytest.mark.parametrize("patch_id", ROW_IDS)
def test_row_symbols_are_in_the_pinned_vllm(fresh, patch_id):
    """Module, class / function, parameters and referred names as the row says, checked
    where registration checks them (before the row is applied) and after all are."""
    assert fresh["before"][patch_id] == []
    assert fresh["after"][patch_id] == []


@pytest.mark.parametrize("patch_id", ROW_IDS)
def test_row_applied_once_at_registration_not_on_import(fresh, patch_id):
    row = next(p for p in PATCHES if p.id == patch_id)
    assert fresh["marked_after_import"][patch_id] == []
    if row.when == "step-profile":
        assert not fresh["installed"][patch_id]  # the variable is unset here
    else:
        assert fresh["installed"][patch_id]  # CPU, no torchvision: all other rows
    expected = [s.path for s in row.changes] if fresh["installed"][patch_id] else []
    assert fresh["marked"][patch_id] == expected
    assert fresh["unchanged_by_reapply"][patch_id]


@pytest.mark.parametrize("patch_id", ROW_IDS)
def test_row_symbols_are_in_the_installed_source(patch_id):
    """The static checker (check_source.py) on the installed vLLM 0.32.0 agrees."""
    import vllm

    from vllm_dspine.plugin.patches.check_source import check_source

    problems, skipped = check_source(Path(vllm.__file__).parent)[patch_id]
    assert problems == []
    assert all(not path.startswith("vllm") for path in skipped)


def test_readme_is_rendered_from_the_table():
    from vllm_dspine.plugin.patches.readme import README, render_index

    assert README.read_text() == render_index(), (
        "run `python -m vllm_dspine.plugin.patches.readme --write`")


def test_every_row_names_an_apply_function_and_a_known_condition():
    import importlib

    from vllm_dspine.plugin.patches.table import WHEN

    for p in PATCHES:
        module, _, function = p.apply.partition(":")
        assert callable(getattr(importlib.import_module(
            f"vllm_dspine.plugin.patches.{module}"), function)), p.id
        assert p.when in WHEN and p.why and p.how and p.retire, p.id


FAKE_VLLM = {
    "vllm/__init__.py": "",
    "vllm/base.py": "class Base:\n    def inherited(self, a):\n        return a.used_name\n",
    "vllm/mod.py": textwrap.dedent("""
        from .base import Base
        from vllm.other import helper as aliased
        from transformers.x import external

        class Thing(Base):
            field: int = 0

            @classmethod
            def build(cls, config):
                return cls()

            def method(self, a, b=1, *args, c, **kwargs):
                return a.kept()
    """),
    "vllm/other.py": "def helper(x, y):\n    pass\n",
}


@pytest.mark.parametrize("path, params, uses, imported_from, problem", [
    pytest.param("vllm.mod:Thing.method", ("self", "a", "b", "args", "c", "kwargs"),
                 ("kept",), None, None, id="method"),
    pytest.param("vllm.mod:Thing.build", ("config",), (), None, None,
                 id="classmethod-without-cls"),
    pytest.param("vllm.mod:Thing.field", None, (), None, None, id="dataclass-field"),
    pytest.param("vllm.mod:Thing.inherited", ("self", "a"), ("used_name",), None, None,
                 id="from-base-class"),
    pytest.param("vllm.mod:aliased", ("x", "y"), (), "vllm.other:helper", None,
                 id="import-alias"),
    pytest.param("vllm.mod:external", None, (), "transformers.x:external", None,
                 id="outside-the-tree"),
    pytest.param("vllm.gone:Thing", None, (), None, "module `vllm.gone` is missing",
                 id="missing-module"),
    pytest.param("vllm.mod:Thing.absent", None, (), None, "`Thing` has no `absent`",
                 id="missing-attribute"),
    pytest.param("vllm.mod:Thing.method", ("self", "a"), (), None, "has parameters",
                 id="changed-parameters"),
    pytest.param("vllm.mod:Thing.method", None, ("gone",), None, "no longer refers",
                 id="changed-body"),
    pytest.param("vllm.mod:aliased", None, (), "vllm.base:helper", "is not imported from",
                 id="changed-import"),
])
def test_check_source_reads_a_tree(tmp_path, path, params, uses, imported_from, problem):
    from vllm_dspine.plugin.patches.check_source import SourceTree
    from vllm_dspine.plugin.patches.table import Symbol

    for name, text in FAKE_VLLM.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    found = SourceTree(tmp_path).check_symbol(Symbol(path, params, uses, imported_from))
    if problem is None:
        assert found == []
    else:
        assert len(found) == 1 and problem in found[0], found


def test_check_source_cli_reports_all_rows_ok_on_the_installed_vllm():
    import vllm

    run = subprocess.run([sys.executable, "-m", "vllm_dspine.plugin.patches.check_source",
                          str(Path(vllm.__file__).parent)], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    assert f"{len(PATCHES)} of {len(PATCHES)} rows would apply unchanged" in run.stdout


# --------------------------------------------------------------- the fixes themselves
def test_vllm_cpu_expand_override_is_broken_for_floats(fresh):
    """The bug itself: vLLM's CPU override writes into an int64 copy of a float
    output and never copies back, so the output keeps whatever it held."""
    assert not fresh["vanilla_expand_marked"]  # the vanilla function, in a fresh process
    assert fresh["vanilla_expand_all_nan"]


def test_expand_batch_to_tokens_correct_after_patch(patched):
    """docs/measured.md's reproducer: per-token temperatures must be [1.5, 1.5, 1.5, 0.7, 0.7]."""
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


# Run in a fresh interpreter: once llvmlite is loaded, vLLM's own scan fails in every
# later module of the session that registers kernel overrides (docs/testing.md).
_SCAN_PROBE = textwrap.dedent("""
    import json, sys, types
    import llvmlite.binding.ffi  # what numba loads (vLLM's n-gram matcher)
    from vllm.triton_utils import dispatcher

    out = {}
    try:  # nothing to rebind: only the scan itself
        dispatcher._rebind_kernels([(object(), object())])
        out["vanilla"] = "ok"
    except AttributeError as e:
        out["vanilla"] = str(e)
    from vllm_dspine.plugin.patches import apply_patches
    apply_patches()

    def rebind():  # kernel and wrapper live here, in the probe module and in holder only
        def kernel(): pass
        def wrapper(): pass
        holder = types.SimpleNamespace(kernel=kernel, _kernel_arg_names=("x",))
        probe = types.ModuleType("dspine_scan_probe")
        probe.copied, probe.holder = kernel, holder
        sys.modules[probe.__name__] = probe
        dispatcher._rebind_kernels([(kernel, wrapper)])
        out["copied"] = probe.copied is wrapper
        out["holder"] = holder.kernel is wrapper
        out["arg_names_dropped"] = "_kernel_arg_names" not in vars(holder)

    rebind()
    from vllm.platforms.cpu import CpuPlatform
    CpuPlatform.import_kernels()
    CpuPlatform.register_triton_kernel_overrides()  # what each CPU engine start runs
    out["registered"] = True
    print(json.dumps(out))
""")


def test_kernel_override_scan_survives_llvmlite():
    """Row kernel-override-scan: with llvmlite loaded, vLLM's scan raises (the bug, so the
    test fails if a vLLM fixes it and the row can go), the patched scan rebinds a copied
    kernel and a holder's `kernel` as vLLM's does, and the CPU platform registers its
    overrides."""
    run = subprocess.run([sys.executable, "-c", _SCAN_PROBE], capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert "'_lib_fn_wrapper' object has no attribute 'get'" in out["vanilla"]
    assert out["copied"] and out["holder"] and out["arg_names_dropped"]
    assert out["registered"]


def test_dspine_method_translated_and_options_checked(patched):
    from vllm_dspine.plugin.options import split_dspine_options

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
    """Row cpu-causal-conv1d-fp32: the fp32-tap conv gives vLLM's `causal_conv1d_fn_cpu`
    outputs and window updates (sequences of 0..9 tokens, with and without an initial
    window, one on the pad slot), bit for bit, and the GDN module now calls it (vLLM's
    bf16 `F.conv1d` accumulates in fp32 and rounds once, as this does; with the taps
    reversed 0.5 % of the outputs still agree, measured)."""
    from vllm.model_executor.layers.mamba.ops.cpu import gdn_attention
    from vllm.model_executor.layers.mamba.ops.cpu.causal_conv1d import causal_conv1d_fn_cpu
    from vllm.v1.attention.backends.utils import PAD_SLOT_ID

    from vllm_dspine.kernels.cpu_replacements import causal_conv1d_fp32_cpu
    from vllm_dspine.plugin.patches import is_applied

    assert is_applied(gdn_attention.causal_conv1d_torch, "cpu-causal-conv1d-fp32")
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
    got = causal_conv1d_fp32_cpu(x, weight, bias, got_states, qsl, slots, initial,
                                 activation=activation, pad_slot_id=PAD_SLOT_ID)
    assert got.dtype == want.dtype and got.shape == want.shape
    live = torch.cat([torch.arange(int(qsl[i]), int(qsl[i + 1])) for i in range(len(lens))
                      if int(slots[i]) != PAD_SLOT_ID])
    assert torch.equal(got[:, live], want[:, live])
    assert torch.equal(got_states, want_states)
    # The installed wrapper (vLLM's signature, its default pad slot) gives the same.
    wired_states = states.clone()
    wired = gdn_attention.causal_conv1d_torch(x, weight, bias, wired_states, qsl, slots,
                                              initial, activation=activation)
    assert torch.equal(wired[:, live], got[:, live]) and torch.equal(wired_states, got_states)
