"""Every Triton kernel of the package at the shapes users run, compiled for the GPUs they
run on (bench/kernel_compile.py prints the table, tests/test_kernel_compile.py checks it).

Each case calls a launcher (`bridge_read_fwd`, `fp8_head_scores_fwd`,
`sparse_rejection_sample_fwd`, `gdn_replay_fwd`, `serial_tail_fwd`, ...) on meta tensors
of one shape set; `vllm_dspine.kernels.aot` records the launches instead of running them
and compiles them for each target, so block sizes, grids and flags are the launcher's
own choice at those shapes. Shape sets:

  released  the released Qwen3.8-27B drafter (`RELEASED_QWEN38_27B`: H 5,120, C 1,024,
            M 512, V 248,320, bf16), K 15 drafts x 16 candidates, 8 requests; the
            replay at the assumed Qwen3.8-27B GDN dimensions (`QWEN38_27B_GDN`)
  smollm2   the SmolLM2 pair's drafter (its config.json: H 576, C 256, M 128,
            V 49,152, bf16), 8 requests
  smollm2-fp32  the same drafter served in fp32, 1 request (row tile 16: fp32 tl.dot),
            and a forced row tile of 4 (the launcher's no-dot path), on sm_90 only

Needs real `triton.jit` functions: import it in a process without TRITON_INTERPRET=1.
"""

from __future__ import annotations

import json
import pathlib
from dataclasses import dataclass
from typing import Callable

import torch

from vllm_dspine.commit.gdn_ref import GDNWeights, VerifiedBlockInputs
from vllm_dspine.commit.replay import gdn_replay_fwd
from vllm_dspine.config import RELEASED_QWEN38_27B
from vllm_dspine.kernels.aot import TARGETS, GpuTarget, KernelBuild, captured_launches, \
    compile_launch
from vllm_dspine.kernels.bridge import bridge_read_fwd, bridge_write_fwd
from vllm_dspine.kernels.retrieval import FP8Head, fp8_head_scores_fwd
from vllm_dspine.kernels.tail_walk import serial_tail_fwd
from vllm_dspine.model.memory import QWEN38_27B_GDN

SMOLLM2_CONFIG = (pathlib.Path(__file__).resolve().parents[2] / "vllm_dspine" / "pairs"
                  / "drafters" / "smollm2" / "config.json")
REQS = 8  # requests per step in the compiled cases


@dataclass(frozen=True)
class DrafterDims:
    """The sizes a drafter's kernels see."""

    name: str
    hidden: int  # H
    code: int  # C
    message: int  # M
    vocab: int  # V
    proposals: int  # K: drafts per request (block rows - 1)
    head_topk: int  # k: candidates per row
    dtype: torch.dtype  # activations and weights

    @classmethod
    def from_config(cls, name: str, config: dict, dtype: torch.dtype | None = None
                    ) -> "DrafterDims":
        d = config["dspine_config"]
        return cls(name, config["hidden_size"], d["code_dim"], d["message_dim"],
                   config["vocab_size"], d["block_size"] - 1, d["head_topk"],
                   dtype or getattr(torch, config["torch_dtype"]))


RELEASED = DrafterDims.from_config("released", RELEASED_QWEN38_27B)
SMOLLM2 = DrafterDims.from_config("smollm2", json.loads(SMOLLM2_CONFIG.read_text()))
SMOLLM2_FP32 = DrafterDims.from_config("smollm2-fp32", json.loads(SMOLLM2_CONFIG.read_text()),
                                       torch.float32)


def _meta(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.empty(*shape, dtype=dtype, device="meta")


# ------------------------------------------------------------------- launcher calls
# Each takes (dims, reqs, target) and calls one public launcher on meta tensors.

def bridge_read(d: DrafterDims, reqs: int, target: GpuTarget, weight_dtype=None,
                block_n: int | None = None) -> None:
    N = reqs * (d.proposals + 1)
    w = weight_dtype or d.dtype
    bridge_read_fwd(_meta(N, d.hidden, dtype=d.dtype), _meta(d.code, d.hidden, dtype=w),
                    _meta(d.vocab, d.code, dtype=w), _meta(N, dtype=torch.int64),
                    _meta(N, dtype=torch.bool), 1e-6, block_n=block_n,
                    num_sms=target.num_sms)


def bridge_write(d: DrafterDims, reqs: int, target: GpuTarget, weight_dtype=None,
                 block_n: int | None = None) -> None:
    N = reqs * (d.proposals + 1)
    w = weight_dtype or d.dtype
    C, M, H = d.code, d.message, d.hidden
    bridge_write_fwd(_meta(N, H, dtype=d.dtype), _meta(N), _meta(N, C),
                     _meta(N, dtype=torch.bool), _meta(M, C, dtype=w), _meta(M, C, dtype=w),
                     _meta(M, C, dtype=w), _meta(M, dtype=w), _meta(H, M, dtype=w),
                     block_n=block_n)


def fp8_retrieval(d: DrafterDims, reqs: int, target: GpuTarget) -> None:
    head = FP8Head(_meta(d.vocab, d.hidden, dtype=torch.float8_e4m3fn), _meta(d.vocab))
    fp8_head_scores_fwd(_meta(reqs * d.proposals, d.hidden, dtype=torch.bfloat16), head,
                        capability=divmod(target.capability, 10))


def tail_walk(d: DrafterDims, reqs: int, target: GpuTarget, sampled: bool = True) -> None:
    K, k = d.proposals, d.head_topk
    settings = ((_meta(reqs, dtype=torch.int32), _meta(reqs), _meta(reqs)) if sampled
                else (None, None, None))
    serial_tail_fwd(_meta(reqs, K, k, k, dtype=torch.float64 if sampled else torch.float32),
                    _meta(reqs, K, k, dtype=torch.int64), _meta(reqs), *settings,
                    _meta(reqs, K, dtype=torch.float64))


def sparse_rejection(d: DrafterDims, reqs: int, target: GpuTarget) -> None:
    from vllm_dspine.verify.sparse_rejection import sparse_rejection_sample_fwd

    T, k = reqs * d.proposals, d.head_topk
    sparse_rejection_sample_fwd(
        _meta(T, dtype=torch.int32), [d.proposals] * reqs, d.proposals,
        _meta(reqs, dtype=torch.int32), _meta(T, k, dtype=torch.int64), _meta(T, k),
        _meta(T, d.vocab), _meta(reqs, 1, dtype=torch.int32), _meta(reqs, dtype=torch.bool),
        _meta(T, dtype=torch.int64), _meta(T, dtype=torch.float64), _meta(reqs, d.vocab))


def gdn_replay(d: DrafterDims, reqs: int, target: GpuTarget) -> None:
    """The replay commit of one GDN layer of the target (vLLM's pools: fp32 state, bf16
    conv window in its [slots, W-1, D] layout viewed as [slots, D, W-1])."""
    g = QWEN38_27B_GDN
    H, HV = g.linear_num_key_heads, g.linear_num_value_heads
    K, V, W = g.linear_key_head_dim, g.linear_value_head_dim, g.linear_conv_kernel_dim
    D = 2 * H * K + HV * V
    tokens = reqs * (d.proposals + 1)
    weights = GDNWeights(conv_weight=_meta(D, W, dtype=torch.bfloat16), conv_bias=None,
                         A_log=_meta(HV), dt_bias=_meta(HV), num_k_heads=H, head_k_dim=K,
                         head_v_dim=V)
    inputs = VerifiedBlockInputs(
        mixed_qkv=_meta(tokens, D, dtype=torch.bfloat16),
        a=_meta(tokens, HV, dtype=torch.bfloat16), b=_meta(tokens, HV, dtype=torch.bfloat16),
        query_start_loc=_meta(reqs + 1, dtype=torch.int32))
    slots = 2 * reqs
    gdn_replay_fwd(_meta(slots, HV, V, K), _meta(slots, W - 1, D, dtype=torch.bfloat16
                                                 ).transpose(1, 2),
                   inputs, _meta(reqs, dtype=torch.int32), _meta(reqs, dtype=torch.int32),
                   weights)


@dataclass(frozen=True)
class Case:
    """One launcher call at one shape set; compiled for `targets`."""

    name: str
    dims: DrafterDims
    reqs: int
    call: Callable[[DrafterDims, int, GpuTarget], None]
    targets: tuple[GpuTarget, ...] = TARGETS
    kwargs: tuple = ()


def _cases() -> list[Case]:
    h100 = tuple(t for t in TARGETS if t.capability == 90)
    out = []
    for d in (RELEASED, SMOLLM2):
        out += [Case("bridge read", d, REQS, bridge_read),
                Case("bridge write", d, REQS, bridge_write),
                Case("fp8 retrieval", d, REQS, fp8_retrieval)]
    out += [Case("tail walk, sampled + filters", RELEASED, REQS, tail_walk),
            Case("tail walk, greedy", RELEASED, REQS, tail_walk,
                 kwargs=(("sampled", False),)),
            Case("sparse rejection", RELEASED, REQS, sparse_rejection),
            Case("sparse rejection", SMOLLM2, REQS, sparse_rejection),
            Case("gdn replay (27B GDN)", RELEASED, REQS, gdn_replay),
            Case("bridge read", SMOLLM2_FP32, 1, bridge_read, h100),
            Case("bridge write", SMOLLM2_FP32, 1, bridge_write, h100),
            Case("bridge read, row tile 4, bf16 weights", SMOLLM2_FP32, 1, bridge_read, h100,
                 (("weight_dtype", torch.bfloat16), ("block_n", 4))),
            Case("bridge write, row tile 4, bf16 weights", SMOLLM2_FP32, 1, bridge_write,
                 h100, (("weight_dtype", torch.bfloat16), ("block_n", 4)))]
    return out


CASES = _cases()


@dataclass
class CaseResult:
    """A case on one target: its kernels' builds, or the launcher's refusal."""

    case: Case
    target: GpuTarget
    builds: list[KernelBuild]
    refused: str | None = None  # the launcher's ValueError


def compile_case(case: Case, target: GpuTarget) -> CaseResult:
    try:
        launches = captured_launches(
            lambda: case.call(case.dims, case.reqs, target, **dict(case.kwargs)))
    except ValueError as e:
        return CaseResult(case, target, [], refused=str(e))
    return CaseResult(case, target, [compile_launch(launch, target) for launch in launches])


def compile_all(cases: list[Case] | None = None, log=None) -> list[CaseResult]:
    """Every case on each of its targets, in order."""
    results = []
    for case in cases or CASES:
        for target in case.targets:
            if log is not None:
                log(f"{case.name} [{case.dims.name}] sm_{target.capability}")
            results.append(compile_case(case, target))
    return results
