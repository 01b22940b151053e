package adsrelay.interop;

import io.grpc.CallOptions;
import io.grpc.Grpc;
import io.grpc.InsecureChannelCredentials;
import io.grpc.ManagedChannel;
import io.grpc.MethodDescriptor;
import io.grpc.Status;
import io.grpc.StatusRuntimeException;
import io.grpc.stub.ClientCalls;
import java.io.ByteArrayInputStream;
import java.io.File;
import java.io.IOException;
import java.io.InputStream;
import java.io.PrintStream;
import java.nio.charset.StandardCharsets;
import java.util.concurrent.TimeUnit;

/**
 * The gRPC-Java side of the xDS interop tests (tests/grpc_go_java_interop.rs): an xDS client of
 * the greeter in tests/interop/greeter.py and tests/interop/grpc-go (same protocol).
 *
 * <p>No generated stubs: one unary method, /demo.Greeter/SayHello, whose request and reply are raw
 * bytes (the reply is the server's name).
 *
 * <pre>
 * call --target TARGET [--bootstrap FILE] [--interval-ms MS] [--rpc-timeout-ms MS] [--count N]
 *     Calls TARGET (e.g. xds:///greeter.example:50051) on one channel, one call every MS
 *     milliseconds, and prints one line per call on stdout: "OK NAME" (the backend that answered)
 *     or "ERR CODE: message". Stops after N calls (0: until stdin closes). --bootstrap sets the
 *     io.grpc.xds.bootstrap system property (GRPC_XDS_BOOTSTRAP works too). Diagnostics go to
 *     stderr.
 * </pre>
 */
public final class Greeter {
  private static final MethodDescriptor.Marshaller<byte[]> RAW =
      new MethodDescriptor.Marshaller<byte[]>() {
        @Override
        public InputStream stream(byte[] value) {
          return new ByteArrayInputStream(value);
        }

        @Override
        public byte[] parse(InputStream stream) {
          try {
            return stream.readAllBytes();
          } catch (IOException e) {
            throw Status.INTERNAL.withCause(e).asRuntimeException();
          }
        }
      };

  private static final MethodDescriptor<byte[], byte[]> SAY_HELLO =
      MethodDescriptor.<byte[], byte[]>newBuilder()
          .setType(MethodDescriptor.MethodType.UNARY)
          .setFullMethodName(MethodDescriptor.generateFullMethodName("demo.Greeter", "SayHello"))
          .setRequestMarshaller(RAW)
          .setResponseMarshaller(RAW)
          .build();

  private static volatile boolean stdinClosed = false;

  private static void usage(String message) {
    System.err.println("greeter call: " + message);
    System.err.println(
        "usage: call --target TARGET [--bootstrap FILE] [--interval-ms MS] [--rpc-timeout-ms MS]"
            + " [--count N]");
    System.exit(2);
  }

  public static void main(String[] args) throws Exception {
    if (args.length < 1 || !args[0].equals("call")) {
      usage("the only mode is call");
    }
    String target = null;
    String bootstrap = null;
    long intervalMs = 100;
    long rpcTimeoutMs = 2000;
    long count = 0;
    for (int i = 1; i < args.length; i++) {
      String flag = args[i];
      if (i + 1 >= args.length) {
        usage(flag + " needs a value");
      }
      String value = args[++i];
      switch (flag) {
        case "--target":
          target = value;
          break;
        case "--bootstrap":
          bootstrap = value;
          break;
        case "--interval-ms":
          intervalMs = Long.parseLong(value);
          break;
        case "--rpc-timeout-ms":
          rpcTimeoutMs = Long.parseLong(value);
          break;
        case "--count":
          count = Long.parseLong(value);
          break;
        default:
          usage("unknown flag " + flag);
      }
    }
    if (target == null) {
      usage("--target is required");
    }
    if (bootstrap != null) {
      if (!new File(bootstrap).isFile()) {
        System.err.println("greeter call: bootstrap " + bootstrap + " not found");
        System.exit(2);
      }
      // Read when the first xds: channel is created, so set it before that.
      System.setProperty("io.grpc.xds.bootstrap", new File(bootstrap).getAbsolutePath());
    } else if (target.startsWith("xds:") && System.getenv("GRPC_XDS_BOOTSTRAP") == null) {
      System.err.println("greeter call: an xds: target needs --bootstrap or GRPC_XDS_BOOTSTRAP");
      System.exit(2);
    }

    if (count == 0) {
      Thread watch =
          new Thread(
              () -> {
                try {
                  while (System.in.read() != -1) {}
                } catch (IOException e) {
                  // Treated as closed.
                }
                stdinClosed = true;
              },
              "stdin-watch");
      watch.setDaemon(true);
      watch.start();
    }

    PrintStream out = new PrintStream(System.out, true, StandardCharsets.UTF_8);
    ManagedChannel channel =
        Grpc.newChannelBuilder(target, InsecureChannelCredentials.create()).build();
    try {
      byte[] hello = "hello".getBytes(StandardCharsets.UTF_8);
      for (long i = 0; count == 0 || i < count; i++) {
        if (stdinClosed) {
          break;
        }
        try {
          byte[] reply =
              ClientCalls.blockingUnaryCall(
                  channel,
                  SAY_HELLO,
                  CallOptions.DEFAULT.withDeadlineAfter(rpcTimeoutMs, TimeUnit.MILLISECONDS),
                  hello);
          out.println("OK " + new String(reply, StandardCharsets.UTF_8));
        } catch (StatusRuntimeException e) {
          Status s = e.getStatus();
          String description = s.getDescription() == null ? "" : s.getDescription();
          out.println("ERR " + s.getCode() + ": " + description.replace('\n', ' '));
        }
        Thread.sleep(intervalMs);
      }
    } finally {
      channel.shutdownNow();
      channel.awaitTermination(5, TimeUnit.SECONDS);
    }
    // Netty and xDS threads are not all daemons.
    System.exit(0);
  }
}
