#!/usr/bin/env python3
"""A tiny gRPC greeter, server and client, for the gRPC xDS interop test (tests/grpc_xds_interop.rs).

No generated stubs: one unary method, /demo.Greeter/SayHello, whose request and reply are raw bytes
(the reply is the server's --name).

  serve --port P --name NAME [--exit-on-stdin-eof]
      Serves on 127.0.0.1:P (P = 0 picks a free port) and prints one line once it accepts calls:
      "serving NAME on 127.0.0.1:PORT". With --exit-on-stdin-eof it exits when its stdin closes, so
      it never outlives the process that started it.

  call --target TARGET [--bootstrap FILE] --expect NAME [--expect NAME2 ...] [--timeout SECS]
      Calls TARGET (e.g. xds:///greeter.example:50051, or 127.0.0.1:PORT for a direct call) until
      the reply is NAME, retrying on errors and other replies for up to SECS seconds (per expected
      name). Prints "OK NAME" on stdout for each expected name, in order, all on one channel: a
      second --expect checks that a live client follows a change. --bootstrap sets
      GRPC_XDS_BOOTSTRAP. Exits 0 when every name was seen, 1 (with the last error on stderr)
      otherwise.
"""

import argparse
import os
import sys
import threading
import time
from concurrent import futures

SERVICE = "demo.Greeter"
METHOD = "SayHello"
FULL_METHOD = f"/{SERVICE}/{METHOD}"


def serve(args):
    import grpc

    reply = args.name.encode()

    def say_hello(_request, _context):
        return reply

    handler = grpc.method_handlers_generic_handler(
        SERVICE, {METHOD: grpc.unary_unary_rpc_method_handler(say_hello)}
    )
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port(f"127.0.0.1:{args.port}")
    if port == 0:
        print(f"greeter serve: cannot listen on 127.0.0.1:{args.port}", file=sys.stderr)
        return 1
    server.start()
    print(f"serving {args.name} on 127.0.0.1:{port}", flush=True)
    if args.exit_on_stdin_eof:

        def watch_stdin():
            sys.stdin.buffer.read()
            server.stop(0)

        threading.Thread(target=watch_stdin, daemon=True).start()
    server.wait_for_termination()
    return 0


def call(args):
    if args.bootstrap:
        if not os.path.isfile(args.bootstrap):
            print(f"greeter call: bootstrap {args.bootstrap!r} not found", file=sys.stderr)
            return 2
        # Read when the first xds: channel is created, so set it before that.
        os.environ["GRPC_XDS_BOOTSTRAP"] = os.path.abspath(args.bootstrap)
    elif args.target.startswith("xds:"):
        if "GRPC_XDS_BOOTSTRAP" not in os.environ:
            print("greeter call: an xds: target needs --bootstrap", file=sys.stderr)
            return 2

    import grpc

    with grpc.insecure_channel(args.target) as channel:
        # No serializers: request and reply are raw bytes.
        say_hello = channel.unary_unary(FULL_METHOD)
        for want in args.expect:
            deadline = time.monotonic() + args.timeout
            attempts = 0
            last = "no attempt"
            while True:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    print(
                        f"greeter call: {args.target}: no reply {want!r} within {args.timeout}s "
                        f"({attempts} attempts); last: {last}",
                        file=sys.stderr,
                    )
                    return 1
                attempts += 1
                try:
                    got = say_hello(b"hello", timeout=min(5.0, remaining)).decode(errors="replace")
                    if got == want:
                        break
                    last = f"reply {got!r}"
                except grpc.RpcError as e:
                    last = f"{e.code().name}: {e.details()}"
                time.sleep(0.1)
            print(f"OK {want}", flush=True)
    return 0


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = p.add_subparsers(dest="mode", required=True)
    s = sub.add_parser("serve", help="serve SayHello, replying with --name")
    s.add_argument("--port", type=int, required=True, help="port on 127.0.0.1; 0 picks one")
    s.add_argument("--name", required=True)
    s.add_argument("--exit-on-stdin-eof", action="store_true")
    c = sub.add_parser("call", help="call SayHello until the reply is --expect")
    c.add_argument("--target", required=True, help="xds:///host:port or host:port")
    c.add_argument("--bootstrap", help="gRPC xDS bootstrap file (sets GRPC_XDS_BOOTSTRAP)")
    c.add_argument("--expect", required=True, action="append", help="reply to wait for; repeatable")
    c.add_argument("--timeout", type=float, default=30.0, help="seconds per expected reply")
    args = p.parse_args()
    try:
        return serve(args) if args.mode == "serve" else call(args)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
