#!/usr/bin/env bash
# Builds loadgen's go-control-plane baseline (bench/gcp-baseline: server/v3 + one SnapshotCache
# snapshot for the fleet) into target/interop/gcp-baseline, for `loadgen --with-gcp` and
# `loadgen --relay-upstream gcp`. Needs Go >= 1.26; modules come from the Go module proxy, pinned by
# bench/gcp-baseline/go.sum. Safe to re-run.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

if ! command -v go >/dev/null 2>&1; then
    echo "setup-bench.sh: 'go' not found on PATH; install Go 1.26 or newer" >&2
    exit 1
fi

mkdir -p "$root/target/interop"
cd "$root/bench/gcp-baseline"
go build -mod=readonly -o "$root/target/interop/gcp-baseline" .
echo "built $root/target/interop/gcp-baseline"
