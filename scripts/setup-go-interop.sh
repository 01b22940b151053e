#!/usr/bin/env bash
# Builds the go-control-plane upstream used by tests/go_control_plane_interop.rs (and the gRPC
# client interop tests) into target/interop/gcp-server. Needs Go >= 1.26; modules come from the
# Go module proxy, pinned by tests/interop/go-control-plane/go.sum. Safe to re-run.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

if ! command -v go >/dev/null 2>&1; then
    echo "setup-go-interop.sh: 'go' not found on PATH; install Go 1.26 or newer" >&2
    exit 1
fi

mkdir -p "$root/target/interop"
cd "$root/tests/interop/go-control-plane"
go build -mod=readonly -o "$root/target/interop/gcp-server" .
echo "built $root/target/interop/gcp-server"
