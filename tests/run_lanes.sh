#!/usr/bin/env bash
# Runs `make test`'s two lanes at once: "$1", the shared lane (work that can share a core:
# type checks and the tests that start no timed world), at the lowest CPU priority, and "$2",
# the timed lane (the worlds whose verdicts are timed), at normal priority. The timed worlds
# leave the cores idle most of the time (their ranks sleep through steps, windows, budgets and
# alert timings); the shared lane fills that idle time. Under the idle scheduling policy a
# waking timed rank takes the core from it at once (without chrt: nice 19, a weight of 15
# against normal's 1024). The shared lane's output is kept in a file and printed after the
# timed lane's. Exits non-zero when either lane failed.
set -u

log=$(mktemp "${TMPDIR:-/tmp}/shared-lane.XXXXXX")
low=(nice -n 19)
if chrt --idle 0 true 2>/dev/null; then
    low=(chrt --idle 0)
fi
"${low[@]}" bash -c "$1" >"$log" 2>&1 &
shared_pid=$!

bash -c "$2"
timed_status=$?

wait "$shared_pid"
shared_status=$?
echo
echo "---- the shared lane (lowest CPU priority), exit status $shared_status ----"
cat "$log"
rm -f "$log"

echo "---- the timed lane: exit status $timed_status; the shared lane: $shared_status ----"
[ "$timed_status" -eq 0 ] && [ "$shared_status" -eq 0 ]
