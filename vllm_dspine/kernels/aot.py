"""Compile the package's Triton kernels ahead of time for GPUs that are not here.

Triton's wheel carries ptxas, so a kernel compiles to a cubin for any CUDA target on a
machine without a GPU. What to compile comes from the launchers themselves:
`captured_launches(call)` runs a launcher (`bridge_read_fwd`, `serial_tail_fwd`, ...) on
meta tensors (shapes and dtypes, no memory) with Triton's launch step replaced by a
recorder, so the block sizes, grid, constexpr flags and `num_warps` are exactly the ones
the launcher picks at those shapes. `compile_launch(launch, target)` binds the recorded
arguments as Triton's JIT does at a launch (the same specialization: integers divisible
by 16, 16-byte aligned pointers; a meta tensor's address is 0) and compiles for the
target; `KernelBuild` holds what ptxas made of it (registers, local memory, shared
memory, warps, stages).

It needs real `triton.jit` functions: call it in a process without TRITON_INTERPRET=1
(tests start a subprocess). It uses Triton 3.9's JIT internals
(`create_function_from_signature`, `JITFunction._pack_args`: the pinned vLLM's Triton);
another Triton version may need this module adapted, never the kernels.
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from dataclasses import dataclass, field
from typing import Any, Callable

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.runtime.jit import JITFunction, create_function_from_signature


@dataclass(frozen=True)
class GpuTarget:
    """A GPU generation users serve on; the figures are NVIDIA's per-device limits."""

    name: str  # the devices of this compute capability we mean
    capability: int  # 80 = sm_80
    num_sms: int  # launchers size split-K grids by it
    max_shared_bytes: int  # opt-in shared memory per block

    @property
    def triton_target(self) -> GPUTarget:
        return GPUTarget("cuda", self.capability, 32)


A100 = GpuTarget("A100", 80, 108, 163 * 1024)
L40S = GpuTarget("L40S", 89, 142, 99 * 1024)  # the smallest FP8 target (sm_89)
H100 = GpuTarget("H100/H200", 90, 132, 227 * 1024)
TARGETS = (A100, L40S, H100)


@dataclass
class Launch:
    """One `kernel[grid](*args, **kwargs)` call as a launcher made it."""

    kernel: JITFunction
    args: tuple
    kwargs: dict[str, Any]
    grid: tuple

    @property
    def name(self) -> str:
        return self.kernel.__name__


def captured_launches(call: Callable[[], object]) -> list[Launch]:
    """Run `call` (a launcher on meta tensors) and return its kernel launches, in order,
    instead of running them. `triton.heuristics` wrappers add their values first."""
    launches: list[Launch] = []

    def record(self, *args, grid, warmup, **kwargs):
        if not isinstance(self, JITFunction):
            raise TypeError(f"{self!r} is not a triton.jit function; unset TRITON_INTERPRET")
        launches.append(Launch(self, args, kwargs, tuple(grid)))

    real_run = JITFunction.run
    JITFunction.run = record
    try:
        call()
    finally:
        JITFunction.run = real_run
    return launches


@dataclass
class KernelBuild:
    """A kernel compiled for one target, and what ptxas made of it."""

    kernel: str
    target: GpuTarget
    registers: int  # per thread
    local_bytes: int  # local memory per thread: register spills (0: none)
    shared_bytes: int  # shared memory per block (Triton's allocation)
    num_warps: int
    num_stages: int
    grid: tuple
    constexprs: dict[str, Any] = field(default_factory=dict)
    ptx: str = field(default="", repr=False)

    @property
    def fits(self) -> bool:
        """No spills, and the shared memory fits the target's per-block limit."""
        return self.local_bytes == 0 and self.shared_bytes <= self.target.max_shared_bytes


def compile_launch(launch: Launch, target: GpuTarget) -> KernelBuild:
    """Compile a recorded launch for `target` as Triton's JIT would at that launch
    (`JITFunction.run`: the same binder, options and specialization)."""
    fn = launch.kernel
    backend = make_backend(target.triton_target)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    kwargs = dict(launch.kwargs)
    kwargs.setdefault("debug", fn.debug or triton.knobs.runtime.debug)
    kwargs["instrumentation_mode"] = triton.knobs.compilation.instrumentation_mode
    kwargs["fpsan_homomorphic_casts"] = triton.knobs.compilation.fpsan_homomorphic_casts
    bound, specialization, options = binder(*launch.args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound,
                                                          specialization, options)
    compiled = triton.compile(ASTSource(fn, signature, constexprs, attrs),
                              target=target.triton_target, options=options.__dict__)
    registers, local_bytes = _resource_usage(compiled.asm["cubin"], fn.__name__)
    names = [p.name for p in fn.params]
    return KernelBuild(
        kernel=fn.__name__, target=target, registers=registers, local_bytes=local_bytes,
        shared_bytes=compiled.metadata.shared, num_warps=compiled.metadata.num_warps,
        num_stages=compiled.metadata.num_stages, grid=launch.grid,
        constexprs={names[i[0]]: v for i, v in constexprs.items()}, ptx=compiled.asm["ptx"])


def _resource_usage(cubin: bytes, name: str) -> tuple[int, int]:
    """(registers per thread, local bytes per thread) of `name` in a cubin, as
    `cuobjdump -res-usage` (shipped with Triton) reports them."""
    tool = triton.knobs.nvidia.cuobjdump.path
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        out = subprocess.run([tool, "-res-usage", path], capture_output=True, text=True,
                             check=True).stdout
    m = re.search(rf"Function {re.escape(name)}:\s*\n\s*REG:(\d+) STACK:(\d+) SHARED:\d+ "
                  rf"LOCAL:(\d+)", out)
    if m is None:
        raise RuntimeError(f"cuobjdump printed no resource usage for {name}:\n{out}")
    return int(m.group(1)), int(m.group(2)) + int(m.group(3))
