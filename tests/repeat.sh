#!/usr/bin/env bash
# make test-repeat N=5: the core suite N times in a row with one busy process beside it (a
# CPU-bound loop on one core), so a test that depends on how fast something runs shows up
# here rather than on someone else's machine. Prints each run's summary and the failures,
# and exits non-zero if any run failed.
set -uo pipefail
n="${1:-5}"
python="${2:-.venv/bin/python}"
"$python" -c "while True: pass" &
busy=$!
trap 'kill "$busy" 2>/dev/null' EXIT
failed_runs=0
log="$(mktemp -d)"
for i in $(seq 1 "$n"); do
    start=$(date +%s)
    "$python" -m pytest -q -m "not full" -p no:cacheprovider >"$log/run$i.txt" 2>&1
    rc=$?
    summary="$(tail -n 1 "$log/run$i.txt")"
    echo "run $i/$n ($(( $(date +%s) - start )) s, busy process beside): $summary"
    if [ "$rc" -ne 0 ]; then
        failed_runs=$((failed_runs + 1))
        grep -E "^(FAILED|ERROR) " "$log/run$i.txt" | sed 's/^/    /'
    fi
done
echo "test-repeat: $failed_runs of $n runs failed (logs in $log)"
[ "$failed_runs" -eq 0 ]
