# The timeline of scripts/gpu/check.sh, sourced by it (and by tests/gpu/test_check_budget.py):
# each part runs as a step with a budget (the seconds it is expected to take, projected from the
# last GPU runs) and a hard limit (its timeout), both capped by the whole check's deadline, so a
# stuck part costs its own limit and every part after it still gets its turn or is recorded as
# skipped. Each step prints its start and end (seconds since the check began) as it runs and
# appends one line to $STEPS:
#   {"step", "rc", "ms", "budget", "limit", "start_s", "end_s"}   rc 124/137: timed out
#   {"step", "rc": null, "skipped": "...", "budget", "start_s"}    the deadline left it no time
# Needs, exported: RESULT_DIR (each step's output is RESULT_DIR/<step>.log), STEPS,
# CHECK_START (date +%s%N at the check's start), CHECK_DEADLINE_S (seconds from CHECK_START by
# which every step has ended), CHECK_MIN_S (a step is skipped with less than this left); and
# PACK_DIR where the results go back through the device tool (see pack_results).

# pack_results: the device tool brings back at most 8 files from $OUT, two folders deep. With
# PACK_DIR set, after each step: the report's files and the results it reads as files of their own
# there, and everything else the check wrote (logs, each run's results; not the NVMe offload's swap
# files) as one archive, each replaced whole (copied beside, then renamed).
PACKED="gpu-check.md gpu-check.json steps.jsonl env.json peer_bench.json gpu_engine_bench.json"
pack_results() {
    [ -n "${PACK_DIR:-}" ] || return 0
    local f part="part$BASHPID"
    for f in $PACKED; do
        [ -e "$RESULT_DIR/$f" ] && cp "$RESULT_DIR/$f" "$PACK_DIR/$f.$part" && mv "$PACK_DIR/$f.$part" "$PACK_DIR/$f"
    done
    tar czf "$PACK_DIR/gpu-check-files.tar.gz.$part" -C "$RESULT_DIR" --exclude='nvme*' . 2>/dev/null
    mv "$PACK_DIR/gpu-check-files.tar.gz.$part" "$PACK_DIR/gpu-check-files.tar.gz"
}

# check_elapsed_ms: milliseconds since the check began.
check_elapsed_ms() {
    echo $((($(date +%s%N) - CHECK_START) / 1000000))
}

# check_seconds MS: "12.3"
check_seconds() {
    printf '%d.%d' $(($1 / 1000)) $(($1 % 1000 / 100))
}

# check_clock MS: "[  12.3s]"
check_clock() {
    printf '[%8ss]' "$(check_seconds "$1")"
}

# step NAME BUDGET LIMIT CMD...: run CMD (a command or an exported function) under
# min(LIMIT, time left before the deadline); its status is step's.
step() {
    local name=$1 budget=$2 limit=$3 start end left rc over=""
    shift 3
    start=$(check_elapsed_ms)
    left=$((CHECK_DEADLINE_S - start / 1000))
    if [ "$left" -lt "${CHECK_MIN_S:-5}" ]; then
        echo "$(check_clock "$start") -- $name skipped: ${left}s left before the check's ${CHECK_DEADLINE_S}s deadline"
        printf '{"step": "%s", "rc": null, "skipped": "%ds left before the %ds deadline", "budget": %d, "start_s": %s}\n' \
            "$name" "$left" "$CHECK_DEADLINE_S" "$budget" "$(check_seconds "$start")" >>"$STEPS"
        return 125
    fi
    [ "$left" -lt "$limit" ] && limit=$left
    echo "$(check_clock "$start") == $name (budget ${budget}s, limit ${limit}s): $*"
    timeout -k 5 "$limit" bash -c '"$@"' "$name" "$@" >"$RESULT_DIR/$name.log" 2>&1
    rc=$?
    end=$(check_elapsed_ms)
    [ $((end - start)) -gt $((budget * 1000)) ] && over=", OVER its budget"
    case $rc in 124 | 137) over="$over, TIMED OUT at its limit" ;; esac
    printf '{"step": "%s", "rc": %d, "ms": %d, "budget": %d, "limit": %d, "start_s": %s, "end_s": %s}\n' \
        "$name" "$rc" $((end - start)) "$budget" "$limit" "$(check_seconds "$start")" "$(check_seconds "$end")" >>"$STEPS"
    echo "$(check_clock "$end")    $name rc=$rc in $(check_seconds $((end - start)))s$over" \
        "($(tail -n 1 "$RESULT_DIR/$name.log" | cut -c1-140))"
    pack_results
    return "$rc"
}

# wait_for NAME PID: wait for a step started in the background; the wait itself is a line of
# $STEPS (how long the timed parts stood waiting for it).
wait_for() {
    local name=$1 pid=$2 start end rc
    start=$(check_elapsed_ms)
    wait "$pid"
    rc=$?
    end=$(check_elapsed_ms)
    printf '{"step": "%s", "rc": %d, "ms": %d, "budget": 0, "limit": 0, "start_s": %s, "end_s": %s}\n' \
        "wait_$name" "$rc" $((end - start)) "$(check_seconds "$start")" "$(check_seconds "$end")" >>"$STEPS"
    echo "$(check_clock "$end")    waited $(check_seconds $((end - start)))s for $name (rc=$rc)"
    pack_results
    return "$rc"
}
export PACKED
export -f check_elapsed_ms check_seconds check_clock step wait_for pack_results
