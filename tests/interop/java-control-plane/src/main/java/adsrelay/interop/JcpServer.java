// jcp-server: a java-control-plane xDS management server driven over stdin, used by adsrelay's
// interop tests as the relay's upstream. The same command protocol as tests/interop/go-control-plane
// (gcp-server); see tests/support/jcp.rs.
//
//   java -jar jcp-server.jar --listen 127.0.0.1:PORT --node-id ID [--state FILE]
//
// stdin: `set FILE` (a state {"version": "v1", "resources": [protojson Any, ...]} becomes the
// node's Snapshot), `quit`. stdout: one JSON event a line (listening, stream_open, stream_closed,
// request, response, applied, error), from java-control-plane's DiscoveryServerCallbacks.
package adsrelay.interop;

import com.google.gson.JsonArray;
import com.google.gson.JsonElement;
import com.google.gson.JsonObject;
import com.google.gson.JsonParser;
import com.google.protobuf.Any;
import com.google.protobuf.util.JsonFormat;
import io.envoyproxy.controlplane.cache.Resources;
import io.envoyproxy.controlplane.cache.v3.SimpleCache;
import io.envoyproxy.controlplane.cache.v3.Snapshot;
import io.envoyproxy.controlplane.server.DiscoveryServerCallbacks;
import io.envoyproxy.controlplane.server.V3DiscoveryServer;
import io.envoyproxy.envoy.config.cluster.v3.Cluster;
import io.envoyproxy.envoy.config.core.v3.Node;
import io.envoyproxy.envoy.config.endpoint.v3.ClusterLoadAssignment;
import io.envoyproxy.envoy.config.listener.v3.Listener;
import io.envoyproxy.envoy.config.route.v3.RouteConfiguration;
import io.envoyproxy.envoy.extensions.filters.http.router.v3.Router;
import io.envoyproxy.envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager;
import io.envoyproxy.envoy.service.discovery.v3.DeltaDiscoveryRequest;
import io.envoyproxy.envoy.service.discovery.v3.DeltaDiscoveryResponse;
import io.envoyproxy.envoy.service.discovery.v3.DiscoveryRequest;
import io.envoyproxy.envoy.service.discovery.v3.DiscoveryResponse;
import io.envoyproxy.envoy.service.discovery.v3.Resource;
import io.grpc.Metadata;
import io.grpc.Server;
import io.grpc.ServerCall;
import io.grpc.ServerCallHandler;
import io.grpc.ServerInterceptor;
import io.grpc.netty.shaded.io.grpc.netty.NettyServerBuilder;
import java.io.BufferedReader;
import java.io.IOException;
import java.io.InputStreamReader;
import java.io.PrintStream;
import java.net.InetSocketAddress;
import java.nio.charset.StandardCharsets;
import java.nio.file.Files;
import java.nio.file.Path;
import java.util.ArrayList;
import java.util.Collection;
import java.util.List;
import java.util.Map;
import java.util.concurrent.ConcurrentHashMap;

public final class JcpServer {
  /** The Envoy types a state file may carry, for protojson's Any resolution. */
  private static final JsonFormat.TypeRegistry TYPES = JsonFormat.TypeRegistry.newBuilder()
      .add(Cluster.getDescriptor())
      .add(ClusterLoadAssignment.getDescriptor())
      .add(Listener.getDescriptor())
      .add(RouteConfiguration.getDescriptor())
      .add(HttpConnectionManager.getDescriptor())
      .add(Router.getDescriptor())
      .build();

  private static final JsonFormat.Parser PARSER = JsonFormat.parser().usingTypeRegistry(TYPES);

  /** Events: one JSON object per line on stdout. */
  static final class Events {
    private final PrintStream out =
        new PrintStream(new java.io.FileOutputStream(java.io.FileDescriptor.out), false,
            StandardCharsets.UTF_8);

    synchronized void emit(JsonObject event) {
      out.println(event.toString());
      out.flush();
    }

    void error(String message) {
      JsonObject e = event("error");
      e.addProperty("message", message);
      emit(e);
    }

    static JsonObject event(String name) {
      JsonObject e = new JsonObject();
      e.addProperty("event", name);
      return e;
    }
  }

  static JsonArray strings(Collection<String> values) {
    JsonArray a = new JsonArray();
    values.forEach(a::add);
    return a;
  }

  static JsonObject stringMap(Map<String, String> values) {
    JsonObject o = new JsonObject();
    values.forEach(o::addProperty);
    return o;
  }

  /**
   * Set while gRPC opens a stream: java-control-plane's onStreamOpen runs synchronously inside the
   * service method, on the thread that the interceptor below runs on, and does not say whether the
   * stream is Delta.
   */
  private static final ThreadLocal<Boolean> OPENING_DELTA = ThreadLocal.withInitial(() -> false);

  /** Marks Delta streams (DeltaAggregatedResources, DeltaClusters, ...) while they open. */
  static final class DeltaMarker implements ServerInterceptor {
    @Override
    public <ReqT, RespT> ServerCall.Listener<ReqT> interceptCall(
        ServerCall<ReqT, RespT> call, Metadata headers, ServerCallHandler<ReqT, RespT> next) {
      OPENING_DELTA.set(call.getMethodDescriptor().getBareMethodName().startsWith("Delta"));
      try {
        return next.startCall(call, headers);
      } finally {
        OPENING_DELTA.remove();
      }
    }
  }

  /** java-control-plane's server callbacks as JSON events. */
  static final class Callbacks implements DiscoveryServerCallbacks {
    private final Events events;
    private final Map<Long, Boolean> delta = new ConcurrentHashMap<>();
    /** The node of each stream: xDS sends it on the first request only (it may on every one). */
    private final Map<Long, Node> nodes = new ConcurrentHashMap<>();

    Callbacks(Events events) {
      this.events = events;
    }

    @Override
    public void onStreamOpen(long streamId, String typeUrl) {
      boolean isDelta = OPENING_DELTA.get();
      delta.put(streamId, isDelta);
      JsonObject e = Events.event("stream_open");
      e.addProperty("stream", streamId);
      e.addProperty("delta", isDelta);
      e.addProperty("type", typeUrl);
      events.emit(e);
    }

    @Override
    public void onStreamClose(long streamId, String typeUrl) {
      closed(streamId, "");
    }

    @Override
    public void onStreamCloseWithError(long streamId, String typeUrl, Throwable error) {
      closed(streamId, String.valueOf(error));
    }

    private void closed(long streamId, String error) {
      Boolean isDelta = delta.remove(streamId);
      nodes.remove(streamId);
      JsonObject e = Events.event("stream_closed");
      e.addProperty("stream", streamId);
      e.addProperty("delta", isDelta != null && isDelta);
      e.addProperty("error", error);
      events.emit(e);
    }

    private Node node(long streamId, Node sent) {
      if (sent != null && !sent.equals(Node.getDefaultInstance())) {
        nodes.put(streamId, sent);
        return sent;
      }
      return nodes.getOrDefault(streamId, Node.getDefaultInstance());
    }

    private JsonObject request(long streamId, boolean isDelta, Node sent, String typeUrl) {
      Node node = node(streamId, sent);
      JsonObject e = Events.event("request");
      e.addProperty("stream", streamId);
      e.addProperty("delta", isDelta);
      e.addProperty("node_id", node.getId());
      e.addProperty("node_cluster", node.getCluster());
      e.addProperty("type", typeUrl);
      return e;
    }

    @Override
    public void onV3StreamRequest(long streamId, DiscoveryRequest r) {
      JsonObject e = request(streamId, false, r.hasNode() ? r.getNode() : null, r.getTypeUrl());
      e.add("names", strings(r.getResourceNamesList()));
      e.add("unsubscribe", new JsonArray());
      e.add("initial_versions", new JsonObject());
      e.addProperty("nonce", r.getResponseNonce());
      e.addProperty("version", r.getVersionInfo());
      e.addProperty("nack", r.hasErrorDetail());
      e.addProperty("error", r.getErrorDetail().getMessage());
      events.emit(e);
    }

    @Override
    public void onV3StreamDeltaRequest(long streamId, DeltaDiscoveryRequest r) {
      JsonObject e = request(streamId, true, r.hasNode() ? r.getNode() : null, r.getTypeUrl());
      e.add("names", strings(r.getResourceNamesSubscribeList()));
      e.add("unsubscribe", strings(r.getResourceNamesUnsubscribeList()));
      e.add("initial_versions", stringMap(r.getInitialResourceVersionsMap()));
      e.addProperty("nonce", r.getResponseNonce());
      e.addProperty("version", "");
      e.addProperty("nack", r.hasErrorDetail());
      e.addProperty("error", r.getErrorDetail().getMessage());
      events.emit(e);
    }

    @Override
    public void onV3StreamResponse(long streamId, DiscoveryRequest request, DiscoveryResponse r) {
      List<String> names = new ArrayList<>();
      for (Any any : r.getResourcesList()) {
        names.add(Resources.getResourceName(any));
      }
      events.emit(response(streamId, false, r.getTypeUrl(), r.getNonce(), r.getVersionInfo(),
          names, List.of()));
    }

    @Override
    public void onV3StreamDeltaResponse(long streamId, DeltaDiscoveryRequest request,
        DeltaDiscoveryResponse r) {
      List<String> names = new ArrayList<>();
      for (Resource res : r.getResourcesList()) {
        names.add(res.getName());
      }
      events.emit(response(streamId, true, r.getTypeUrl(), r.getNonce(), r.getSystemVersionInfo(),
          names, r.getRemovedResourcesList()));
    }

    private static JsonObject response(long streamId, boolean isDelta, String typeUrl,
        String nonce, String version, List<String> names, List<String> removed) {
      JsonObject e = Events.event("response");
      e.addProperty("stream", streamId);
      e.addProperty("delta", isDelta);
      e.addProperty("type", typeUrl);
      e.addProperty("nonce", nonce);
      e.addProperty("version", version);
      e.add("resources", strings(names));
      e.add("removed", strings(removed));
      return e;
    }
  }

  /** Reads a state file into a Snapshot at its version (every resource type at that version). */
  static Snapshot load(Path path, String[] versionOut) throws IOException {
    JsonElement parsed = JsonParser.parseString(Files.readString(path));
    if (!parsed.isJsonObject()) {
      throw new IOException(path + ": not a JSON object");
    }
    JsonObject state = parsed.getAsJsonObject();
    if (!state.has("version") || state.get("version").getAsString().isEmpty()) {
      throw new IOException(path + ": missing version");
    }
    String version = state.get("version").getAsString();
    List<Cluster> clusters = new ArrayList<>();
    List<ClusterLoadAssignment> endpoints = new ArrayList<>();
    List<Listener> listeners = new ArrayList<>();
    List<RouteConfiguration> routes = new ArrayList<>();
    JsonArray resources = state.has("resources") ? state.getAsJsonArray("resources")
        : new JsonArray();
    for (int i = 0; i < resources.size(); i++) {
      Any.Builder packed = Any.newBuilder();
      try {
        PARSER.merge(resources.get(i).toString(), packed);
        Any any = packed.build();
        switch (any.getTypeUrl()) {
          case Resources.V3.CLUSTER_TYPE_URL -> clusters.add(any.unpack(Cluster.class));
          case Resources.V3.ENDPOINT_TYPE_URL ->
              endpoints.add(any.unpack(ClusterLoadAssignment.class));
          case Resources.V3.LISTENER_TYPE_URL -> listeners.add(any.unpack(Listener.class));
          case Resources.V3.ROUTE_TYPE_URL -> routes.add(any.unpack(RouteConfiguration.class));
          default -> throw new IOException("unsupported type " + any.getTypeUrl());
        }
      } catch (IOException e) {
        throw new IOException(path + ": resource " + i + ": " + describe(e), e);
      }
    }
    versionOut[0] = version;
    return Snapshot.create(clusters, endpoints, listeners, routes, List.of(), version);
  }

  /** An exception as one line: NoSuchFileException's message alone is only the path. */
  static String describe(Exception e) {
    return e.getClass().getSimpleName() + ": " + e.getMessage();
  }

  private static String flag(String[] args, String name, String fallback) {
    for (int i = 0; i + 1 < args.length; i++) {
      if (args[i].equals(name)) {
        return args[i + 1];
      }
    }
    return fallback;
  }

  public static void main(String[] args) throws Exception {
    for (int i = 0; i < args.length; i += 2) {
      if (!List.of("--listen", "--node-id", "--state").contains(args[i]) || i + 1 >= args.length) {
        System.err.println("usage: jcp-server --listen HOST:PORT --node-id ID [--state FILE]");
        System.exit(2);
      }
    }
    String listen = flag(args, "--listen", "127.0.0.1:0");
    String nodeId = flag(args, "--node-id", "adsrelay");
    String statePath = flag(args, "--state", "");

    Events events = new Events();
    // One snapshot, keyed by the node id: every node presenting that id shares it.
    SimpleCache<String> cache = new SimpleCache<>(Node::getId);
    if (!statePath.isEmpty()) {
      try {
        String[] version = new String[1];
        cache.setSnapshot(nodeId, load(Path.of(statePath), version));
      } catch (IOException | RuntimeException e) {
        System.err.println("jcp-server: initial state: " + describe(e));
        System.exit(2);
      }
    }

    V3DiscoveryServer discovery = new V3DiscoveryServer(new Callbacks(events), cache);
    int colon = listen.lastIndexOf(':');
    InetSocketAddress address = new InetSocketAddress(listen.substring(0, colon),
        Integer.parseInt(listen.substring(colon + 1)));
    Server server;
    try {
      server = NettyServerBuilder.forAddress(address)
          .addService(discovery.getAggregatedDiscoveryServiceImpl())
          .addService(discovery.getClusterDiscoveryServiceImpl())
          .addService(discovery.getEndpointDiscoveryServiceImpl())
          .addService(discovery.getListenerDiscoveryServiceImpl())
          .addService(discovery.getRouteDiscoveryServiceImpl())
          .intercept(new DeltaMarker())
          .build()
          .start();
    } catch (IOException e) {
      System.err.println("jcp-server: listen on " + listen + ": " + e);
      System.exit(1);
      return;
    }
    JsonObject listening = Events.event("listening");
    InetSocketAddress bound = (InetSocketAddress) server.getListenSockets().get(0);
    listening.addProperty("addr", bound.getHostString() + ":" + bound.getPort());
    events.emit(listening);

    BufferedReader stdin =
        new BufferedReader(new InputStreamReader(System.in, StandardCharsets.UTF_8));
    String line;
    while ((line = stdin.readLine()) != null) {
      String trimmed = line.trim();
      String[] parts = trimmed.split("\\s+", 2);
      switch (parts[0]) {
        case "" -> {
        }
        case "quit" -> {
          server.shutdownNow();
          System.exit(0);
        }
        case "set" -> {
          if (parts.length < 2 || parts[1].isBlank()) {
            events.error("set: missing FILE");
            continue;
          }
          try {
            String[] version = new String[1];
            cache.setSnapshot(nodeId, load(Path.of(parts[1].trim()), version));
            JsonObject applied = Events.event("applied");
            applied.addProperty("version", version[0]);
            events.emit(applied);
          } catch (IOException | RuntimeException e) {
            events.error("set: " + describe(e));
          }
        }
        default -> events.error("unknown command \"" + parts[0] + "\"");
      }
    }
    server.shutdownNow();
    System.exit(0);
  }
}
