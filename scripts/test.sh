#!/usr/bin/env bash
# The README's test command: sets up .venv (first run: ~3 minutes) and runs the tests.
# Extra arguments go to pytest (e.g. `bash scripts/test.sh -m "not engine"`).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
bash scripts/setup-venv.sh
source scripts/env.sh
# --durations: the slowest tests, printed where CI shows them (the suite must fit its time limit).
exec .venv/bin/python -m pytest -q -p no:cacheprovider --durations=25 "$@"
