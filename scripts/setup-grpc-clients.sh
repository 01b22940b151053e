#!/usr/bin/env bash
# Builds the gRPC-Go and gRPC-Java xDS interop clients that tests/grpc_go_java_interop.rs runs:
#
#   target/interop/grpc-go-greeter        Go (google.golang.org/grpc + its xds package): the
#                                         greeter server the test's backends run, and the client
#   target/interop/grpc-java-greeter.jar  Java (io.grpc grpc-xds), runnable: java -jar ... call ...
#
# Sources: tests/interop/grpc-go (go.sum committed) and tests/interop/grpc-java (Maven). Needs Go
# >= 1.26, Java 17 and Maven 3.8. Go modules and Maven artifacts are fetched once (Go module
# proxy, Maven Central) and then come from the local caches: Maven runs offline when it can.
# Idempotent: safe to rerun, rebuilds what changed.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
out="$root/target/interop"
mkdir -p "$out"

die() {
    echo "setup-grpc-clients: $*" >&2
    exit 1
}

command -v go >/dev/null || die "go not found (need Go >= 1.26)"
command -v java >/dev/null || die "java not found (need Java 17)"
command -v mvn >/dev/null || die "mvn not found (need Maven 3.8)"
command -v unzip >/dev/null || die "unzip not found (used to check the jar)"

echo "setup-grpc-clients: building gRPC-Go greeter ($(go version))"
(
    cd "$root/tests/interop/grpc-go"
    # -mod=readonly: go.mod and go.sum are committed and must already be complete.
    go build -mod=readonly -trimpath -o "$out/grpc-go-greeter.tmp" .
)
mv -f "$out/grpc-go-greeter.tmp" "$out/grpc-go-greeter"

echo "setup-grpc-clients: building gRPC-Java greeter"
pom="$root/tests/interop/grpc-java/pom.xml"
if ! mvn -B -q -o -Dstyle.color=never -f "$pom" package; then
    echo "setup-grpc-clients: offline Maven build failed; fetching from Maven Central" >&2
    mvn -B -q -Dstyle.color=never -f "$pom" package || die "Maven build of $pom failed"
fi
jar="$out/grpc-java-build/grpc-java-greeter.jar"
[[ -f "$jar" ]] || die "Maven did not produce $jar"
cp -f "$jar" "$out/grpc-java-greeter.jar.tmp"
mv -f "$out/grpc-java-greeter.jar.tmp" "$out/grpc-java-greeter.jar"

# Smoke checks: both run, and the jar carries grpc-xds's resolver registration.
"$out/grpc-go-greeter" call 2>/dev/null && die "grpc-go-greeter: expected a usage error without --target"
unzip -p "$out/grpc-java-greeter.jar" META-INF/services/io.grpc.NameResolverProvider 2>/dev/null |
    grep -q XdsNameResolverProvider ||
    die "$out/grpc-java-greeter.jar does not register io.grpc.xds.XdsNameResolverProvider"

echo "setup-grpc-clients: ok: $out/grpc-go-greeter, $out/grpc-java-greeter.jar"
