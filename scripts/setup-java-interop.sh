#!/usr/bin/env bash
# Builds the java-control-plane upstream used by tests/java_control_plane_interop.rs into
# target/interop/jcp-server.jar (runnable: java -jar target/interop/jcp-server.jar --listen ...).
#
# Source: tests/interop/java-control-plane (Maven; java-control-plane 1.0.49 with the gRPC and
# protobuf versions it is built with). Needs Java 17 and Maven 3.8. Maven artifacts are fetched
# once from Maven Central and then come from the local cache: Maven runs offline when it can.
# Idempotent: safe to rerun, rebuilds what changed.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
out="$root/target/interop"
mkdir -p "$out"

die() {
    echo "setup-java-interop: $*" >&2
    exit 1
}

command -v java >/dev/null || die "java not found (need Java 17)"
command -v mvn >/dev/null || die "mvn not found (need Maven 3.8)"
command -v unzip >/dev/null || die "unzip not found (used to check the jar)"

echo "setup-java-interop: building jcp-server (java-control-plane 1.0.49)"
pom="$root/tests/interop/java-control-plane/pom.xml"
if ! mvn -B -q -o -Dstyle.color=never -f "$pom" package; then
    echo "setup-java-interop: offline Maven build failed; fetching from Maven Central" >&2
    mvn -B -q -Dstyle.color=never -f "$pom" package || die "Maven build of $pom failed"
fi
jar="$out/jcp-build/jcp-server.jar"
[[ -f "$jar" ]] || die "Maven did not produce $jar"
cp -f "$jar" "$out/jcp-server.jar.tmp"
mv -f "$out/jcp-server.jar.tmp" "$out/jcp-server.jar"

# Smoke checks: the jar carries java-control-plane's server, and it runs (a usage error for a
# flag without its value).
unzip -Z1 "$out/jcp-server.jar" | grep -x 'io/envoyproxy/controlplane/server/V3DiscoveryServer.class' >/dev/null ||
    die "$out/jcp-server.jar does not contain java-control-plane's V3DiscoveryServer"
java -jar "$out/jcp-server.jar" --listen 2>/dev/null &&
    die "jcp-server.jar: expected a usage error for --listen without a value"

echo "setup-java-interop: ok: $out/jcp-server.jar"
