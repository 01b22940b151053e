#!/usr/bin/env bash
# Builds the project's go-control-plane programs into target/interop: gcp-server, the upstream used
# by tests/go_control_plane_interop.rs (and the gRPC client interop tests), and gcp-baseline,
# loadgen's go-control-plane baseline (bench/gcp-baseline). Needs Go >= 1.26; modules come from the
# Go module proxy, pinned by each module's go.sum. Safe to re-run.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

if ! command -v go >/dev/null 2>&1; then
    echo "setup-go-interop.sh: 'go' not found on PATH; install Go 1.26 or newer" >&2
    exit 1
fi

mkdir -p "$root/target/interop"
for module in tests/interop/go-control-plane:gcp-server bench/gcp-baseline:gcp-baseline; do
    (cd "$root/${module%%:*}" && go build -mod=readonly -o "$root/target/interop/${module##*:}" .)
    echo "built $root/target/interop/${module##*:}"
done
