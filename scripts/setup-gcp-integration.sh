#!/usr/bin/env bash
# Builds go-control-plane's own integration-test program (package pkg/test/main of
# github.com/envoyproxy/go-control-plane v0.14.0, unchanged, with its envoy module v1.40.0) into
# target/interop/gcp-integration, for tests/go_control_plane_integration.rs. The versions are
# pinned by tests/interop/go-control-plane-integration/go.mod and go.sum (the program is declared
# there as a `tool`); modules come from the Go module proxy. Needs Go >= 1.26. Safe to re-run: Go's
# build cache makes a second run quick.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
module="$root/tests/interop/go-control-plane-integration"
out="$root/target/interop/gcp-integration"

if ! command -v go >/dev/null 2>&1; then
    echo "setup-gcp-integration.sh: 'go' not found on PATH; install Go 1.26 or newer" >&2
    exit 1
fi
if [ ! -f "$module/go.mod" ] || [ ! -f "$module/go.sum" ]; then
    echo "setup-gcp-integration.sh: $module/go.mod or go.sum is missing" >&2
    exit 1
fi

mkdir -p "$(dirname "$out")"
cd "$module"
# -mod=readonly: fail rather than silently re-resolve if go.mod/go.sum do not pin everything.
go build -mod=readonly -o "$out.tmp" github.com/envoyproxy/go-control-plane/pkg/test/main
mv -f "$out.tmp" "$out"
"$out" -h >/dev/null 2>&1 || [ $? -eq 2 ] || {
    echo "setup-gcp-integration.sh: built $out does not run" >&2
    exit 1
}
echo "built $out"
