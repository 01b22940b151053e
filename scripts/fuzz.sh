#!/usr/bin/env bash
# Coverage-guided fuzzing of the protocol core (fuzz/, cargo-fuzz + libFuzzer): builds every target
# once, then runs each. Fails on any crash, assertion, leak, timeout or OOM and prints the
# reproducer's path; prints each target's executions.
#
#   scripts/fuzz.sh --gate                   CI's gate: deterministic (see below)
#   scripts/fuzz.sh SECONDS_PER_TARGET       open-ended exploration, e.g. 600
#   FUZZ_TARGETS="constraints delta_requests" scripts/fuzz.sh 60    a subset
#   scripts/fuzz.sh --seeds                  regenerate fuzz/corpus/<target>/seed-* (then commit)
#
# The gate runs every committed seed and past crash once, then makes a fixed number of mutations
# (FUZZ_GATE_RUNS, default 20000) from a fixed seed and an empty corpus: nothing depends on the order
# a directory lists its files in (libFuzzer's load order, hence its mutations, follows it, and it
# differs between clones), so the same commit gets the same verdict on every machine, and a gate
# run cannot fail for a bug a change did not bring. Exploration is time-bounded, uses (and grows) the local corpus in fuzz/target/corpus, and
# explores differently on each run unless FUZZ_SEED is set; what it finds goes to fuzz/regressions/.
#
# Toolchain: nightly when installed, else stable with RUSTC_BOOTSTRAP=1 (cargo-fuzz needs -Z flags).
# FUZZ_SANITIZER (default address; "none" is faster) is passed to cargo fuzz -s.
# FUZZ_SEED fixes libFuzzer's seed (CI sets it; unset, every run explores differently).
# New inputs found go to fuzz/target/corpus/<target> (kept between local runs, never committed);
# fuzz/corpus/<target> (seeds) and fuzz/regressions/<target> (past crashes) are only read.
# Reproduce a crash: cargo +nightly fuzz run <target> <crash file>   (from fuzz/)
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root/fuzz"
all_targets=(delta_requests sotw_requests upstream_response constraints)
read -r -a targets <<<"${FUZZ_TARGETS:-${all_targets[*]}}"
sanitizer=${FUZZ_SANITIZER:-address}
triple=$(rustc -vV | sed -n 's/^host: //p')

if ! cargo fuzz --version >/dev/null 2>&1; then
    echo "== installing cargo-fuzz"
    cargo install cargo-fuzz --locked
fi

toolchain=()
if rustup toolchain list 2>/dev/null | grep -q '^nightly'; then
    toolchain=(+nightly)
else
    echo "== no nightly toolchain: using stable with RUSTC_BOOTSTRAP=1"
    export RUSTC_BOOTSTRAP=1
fi

echo "== building fuzz targets (sanitizer: $sanitizer)"
build_start=$SECONDS
cargo "${toolchain[@]}" fuzz build -s "$sanitizer"
echo "== built in $((SECONDS - build_start)) s"

if [[ ${1:-} == --seeds ]]; then
    "target/$triple/release/write_seeds" corpus
    exit 0
fi
gate=false
if [[ ${1:-} == --gate ]]; then
    gate=true
    runs=${FUZZ_GATE_RUNS:-20000}
else
    secs=${1:-}
    if ! [[ $secs =~ ^[0-9]+$ ]] || ((secs == 0)); then
        echo "usage: scripts/fuzz.sh --gate | SECONDS_PER_TARGET | --seeds" >&2
        exit 2
    fi
fi

failed=()
for t in "${targets[@]}"; do
    mkdir -p "artifacts/$t"
    committed=("corpus/$t")
    [[ -d regressions/$t ]] && committed+=("regressions/$t")
    log="target/fuzz-$t.log"
    status=0
    if $gate; then
        # Two steps, neither depending on the order a directory lists its files in (which differs
        # between clones, and libFuzzer's load order, hence its mutations, follows it): every
        # committed input run once; then mutations from an empty corpus and a fixed seed.
        work="target/gate-corpus/$t"
        rm -rf "$work"
        mkdir -p "$work"
        echo "== $t: committed inputs once each, then $runs runs from seed 1 and an empty corpus"
        cargo "${toolchain[@]}" fuzz run -s "$sanitizer" "$t" "${committed[@]}" -- \
            -runs=0 -timeout=10 -rss_limit_mb=2048 >"$log" 2>&1 || status=$?
        if ((status == 0)); then
            cargo "${toolchain[@]}" fuzz run -s "$sanitizer" "$t" "$work" -- \
                -runs="$runs" -seed=1 -print_final_stats=1 -timeout=10 -rss_limit_mb=2048 \
                >>"$log" 2>&1 || status=$?
        fi
    else
        work="target/corpus/$t"
        mkdir -p "$work"
        seed=()
        [[ -n ${FUZZ_SEED:-} ]] && seed=(-seed="$FUZZ_SEED")
        echo "== $t: ${secs}s"
        cargo "${toolchain[@]}" fuzz run -s "$sanitizer" "$t" "$work" "${committed[@]}" -- \
            -max_total_time="$secs" -print_final_stats=1 -timeout=10 -rss_limit_mb=2048 "${seed[@]}" \
            >"$log" 2>&1 || status=$?
    fi
    execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -n 1)
    echo "   $t: ${execs:-?} executions, exit status $status"
    if ((status != 0)); then
        # The assertion or sanitizer report, then libFuzzer's last words.
        grep -m 1 -A 3 -E "panicked at|ERROR: (AddressSanitizer|libFuzzer)" "$log" || tail -n 20 "$log"
        artifact=$(sed -n 's/.*Test unit written to \(.*\)$/\1/p' "$log" | tail -n 1)
        echo "!! $t failed; reproducer: ${artifact:-<none written, see fuzz/$log>}"
        failed+=("$t")
    fi
done

if ((${#failed[@]})); then
    echo "FUZZING FAILED: ${failed[*]} (logs: fuzz/target/fuzz-<target>.log)"
    exit 1
fi
if $gate; then
    echo "== fuzzing gate passed: ${targets[*]} (committed inputs + $runs runs each from seed 1)"
else
    echo "== fuzzing passed: ${targets[*]} (${secs}s each)"
fi
