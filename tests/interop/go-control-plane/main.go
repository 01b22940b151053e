// gcp-server: a go-control-plane xDS management server driven over stdin, used by adsrelay's
// interop tests as the relay's upstream. See tests/support/gcp.rs.
//
// Flags beyond the protocol's (--listen, --node-id, --state); without them it serves everything:
//
//	--sotw-only        serve only the state-of-the-world methods (StreamAggregatedResources and the
//	                   per-type Stream*/Fetch* methods): a Delta call gets grpc-go's UNIMPLEMENTED.
//	--classify-only    the MuxCache has Classify but no ClassifyDelta, as go-control-plane's own
//	                   integration driver in its -mux mode: a Delta request crashes the process.
//	--snapshot-ads     the SnapshotCache's ads flag (default true): in ADS mode a named type is
//	                   answered only when the request names every resource of that type.
package main

import (
	"bufio"
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"net"
	"os"
	"strings"
	"sync"

	core "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	clusterservice "github.com/envoyproxy/go-control-plane/envoy/service/cluster/v3"
	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	endpointservice "github.com/envoyproxy/go-control-plane/envoy/service/endpoint/v3"
	listenerservice "github.com/envoyproxy/go-control-plane/envoy/service/listener/v3"
	routeservice "github.com/envoyproxy/go-control-plane/envoy/service/route/v3"
	runtimeservice "github.com/envoyproxy/go-control-plane/envoy/service/runtime/v3"
	secretservice "github.com/envoyproxy/go-control-plane/envoy/service/secret/v3"
	"github.com/envoyproxy/go-control-plane/pkg/cache/types"
	"github.com/envoyproxy/go-control-plane/pkg/cache/v3"
	"github.com/envoyproxy/go-control-plane/pkg/log"
	"github.com/envoyproxy/go-control-plane/pkg/resource/v3"
	"github.com/envoyproxy/go-control-plane/pkg/server/v3"
	xdstest "github.com/envoyproxy/go-control-plane/pkg/test/v3"
	"google.golang.org/grpc"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/anypb"

	// Register the resource and extension types a state file may carry, for protojson's Any
	// resolution (xDS resources, and extensions Envoy and gRPC tests commonly use).
	_ "github.com/envoyproxy/go-control-plane/envoy/config/cluster/v3"
	_ "github.com/envoyproxy/go-control-plane/envoy/config/endpoint/v3"
	_ "github.com/envoyproxy/go-control-plane/envoy/config/listener/v3"
	_ "github.com/envoyproxy/go-control-plane/envoy/config/route/v3"
	_ "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/fault/v3"
	_ "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/rbac/v3"
	_ "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/router/v3"
	_ "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/network/http_connection_manager/v3"
	_ "github.com/envoyproxy/go-control-plane/envoy/extensions/load_balancing_policies/least_request/v3"
	_ "github.com/envoyproxy/go-control-plane/envoy/extensions/load_balancing_policies/ring_hash/v3"
	_ "github.com/envoyproxy/go-control-plane/envoy/extensions/load_balancing_policies/round_robin/v3"
	_ "github.com/envoyproxy/go-control-plane/envoy/extensions/load_balancing_policies/wrr_locality/v3"
	_ "github.com/envoyproxy/go-control-plane/envoy/extensions/transport_sockets/tls/v3"
)

const (
	linearKey   = "linear"
	snapshotKey = "snapshot"
)

// events writes one JSON object per line to stdout.
type events struct {
	mu  sync.Mutex
	enc *json.Encoder
}

func (e *events) emit(fields map[string]any) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if err := e.enc.Encode(fields); err != nil {
		fmt.Fprintf(os.Stderr, "gcp-server: writing event: %v\n", err)
	}
}

func (e *events) errorf(format string, args ...any) {
	e.emit(map[string]any{"event": "error", "message": fmt.Sprintf(format, args...)})
}

// controlPlane owns the caches and applies state files to them.
type controlPlane struct {
	nodeID    string
	snapshots cache.SnapshotCache
	endpoints *cache.LinearCache
	mux       *cache.MuxCache
}

// newControlPlane builds the caches: `ads` is the SnapshotCache's ads flag; with `classifyOnly`
// the MuxCache cannot route Delta requests (nil ClassifyDelta: the first one panics the process).
func newControlPlane(nodeID string, logger log.Logger, ads, classifyOnly bool) *controlPlane {
	snapshots := cache.NewSnapshotCache(ads, cache.IDHash{}, logger)
	endpoints := cache.NewLinearCache(resource.EndpointType, cache.WithLogger(logger))
	classify := func(typeURL string) string {
		if typeURL == resource.EndpointType {
			return linearKey
		}
		return snapshotKey
	}
	mux := &cache.MuxCache{
		Classify:      func(r *cache.Request) string { return classify(r.GetTypeUrl()) },
		ClassifyDelta: func(r *cache.DeltaRequest) string { return classify(r.GetTypeUrl()) },
		Caches:        map[string]cache.Cache{linearKey: endpoints, snapshotKey: snapshots},
	}
	if classifyOnly {
		mux.ClassifyDelta = nil
	}
	return &controlPlane{nodeID: nodeID, snapshots: snapshots, endpoints: endpoints, mux: mux}
}

type stateFile struct {
	Version   string            `json:"version"`
	Resources []json.RawMessage `json:"resources"`
}

// apply replaces the whole state with the one in path and returns its version.
func (cp *controlPlane) apply(path string) (string, error) {
	raw, err := os.ReadFile(path)
	if err != nil {
		return "", err
	}
	var state stateFile
	if err := json.Unmarshal(raw, &state); err != nil {
		return "", fmt.Errorf("parsing %s: %w", path, err)
	}
	if state.Version == "" {
		return "", fmt.Errorf("%s: missing version", path)
	}
	byType := map[resource.Type][]types.Resource{}
	clas := map[string]types.Resource{}
	for i, r := range state.Resources {
		var packed anypb.Any
		if err := protojson.Unmarshal(r, &packed); err != nil {
			return "", fmt.Errorf("%s: resource %d: %w", path, i, err)
		}
		msg, err := packed.UnmarshalNew()
		if err != nil {
			return "", fmt.Errorf("%s: resource %d: %w", path, i, err)
		}
		if packed.GetTypeUrl() == resource.EndpointType {
			clas[cache.GetResourceName(msg)] = msg
		} else {
			byType[packed.GetTypeUrl()] = append(byType[packed.GetTypeUrl()], msg)
		}
	}
	snapshot, err := cache.NewSnapshot(state.Version, byType)
	if err != nil {
		return "", err
	}
	if err := cp.snapshots.SetSnapshot(context.Background(), cp.nodeID, snapshot); err != nil {
		return "", err
	}
	// Only touch what changed, so unchanged endpoints keep their versions.
	current := cp.endpoints.GetResources()
	changed := map[string]types.Resource{}
	for name, cla := range clas {
		if old, ok := current[name]; !ok || !proto.Equal(old, cla) {
			changed[name] = cla
		}
	}
	var removed []string
	for name := range current {
		if _, ok := clas[name]; !ok {
			removed = append(removed, name)
		}
	}
	if len(changed) > 0 || len(removed) > 0 {
		if err := cp.endpoints.UpdateResources(changed, removed); err != nil {
			return "", err
		}
	}
	return state.Version, nil
}

func orEmpty(names []string) []string {
	if names == nil {
		return []string{}
	}
	return names
}

func anyNames(resources []*anypb.Any) []string {
	names := []string{}
	for _, r := range resources {
		msg, err := r.UnmarshalNew()
		if err != nil {
			names = append(names, "?"+r.GetTypeUrl())
			continue
		}
		names = append(names, cache.GetResourceName(msg))
	}
	return names
}

func callbacks(ev *events) server.Callbacks {
	open := func(delta bool) func(context.Context, int64, string) error {
		return func(_ context.Context, id int64, typeURL string) error {
			ev.emit(map[string]any{"event": "stream_open", "stream": id, "delta": delta, "type": typeURL})
			return nil
		}
	}
	closed := func(delta bool) func(int64, *core.Node) {
		return func(id int64, _ *core.Node) {
			ev.emit(map[string]any{"event": "stream_closed", "stream": id, "delta": delta})
		}
	}
	request := func(id int64, delta bool, node *core.Node, typeURL string, names, unsubscribe []string,
		initial map[string]string, nonce, version string, detail interface{ GetMessage() string }, nacked bool) {
		if initial == nil {
			initial = map[string]string{}
		}
		ev.emit(map[string]any{
			"event": "request", "stream": id, "delta": delta,
			"node_id": node.GetId(), "node_cluster": node.GetCluster(), "type": typeURL,
			"names": orEmpty(names), "unsubscribe": orEmpty(unsubscribe), "initial_versions": initial,
			"nonce": nonce, "version": version, "nack": nacked, "error": detail.GetMessage(),
		})
	}
	return server.CallbackFuncs{
		StreamOpenFunc:        open(false),
		DeltaStreamOpenFunc:   open(true),
		StreamClosedFunc:      closed(false),
		DeltaStreamClosedFunc: closed(true),
		StreamRequestFunc: func(id int64, r *discovery.DiscoveryRequest) error {
			request(id, false, r.GetNode(), r.GetTypeUrl(), r.GetResourceNames(), nil, nil,
				r.GetResponseNonce(), r.GetVersionInfo(), r.GetErrorDetail(), r.GetErrorDetail() != nil)
			return nil
		},
		StreamDeltaRequestFunc: func(id int64, r *discovery.DeltaDiscoveryRequest) error {
			request(id, true, r.GetNode(), r.GetTypeUrl(), r.GetResourceNamesSubscribe(), r.GetResourceNamesUnsubscribe(),
				r.GetInitialResourceVersions(), r.GetResponseNonce(), "", r.GetErrorDetail(), r.GetErrorDetail() != nil)
			return nil
		},
		StreamResponseFunc: func(_ context.Context, id int64, _ *discovery.DiscoveryRequest, r *discovery.DiscoveryResponse) {
			ev.emit(map[string]any{
				"event": "response", "stream": id, "delta": false, "type": r.GetTypeUrl(), "nonce": r.GetNonce(),
				"version": r.GetVersionInfo(), "resources": anyNames(r.GetResources()), "removed": []string{},
			})
		},
		StreamDeltaResponseFunc: func(id int64, _ *discovery.DeltaDiscoveryRequest, r *discovery.DeltaDiscoveryResponse) {
			names := []string{}
			for _, res := range r.GetResources() {
				names = append(names, res.GetName())
			}
			ev.emit(map[string]any{
				"event": "response", "stream": id, "delta": true, "type": r.GetTypeUrl(), "nonce": r.GetNonce(),
				"version": r.GetSystemVersionInfo(), "resources": names, "removed": orEmpty(r.GetRemovedResources()),
			})
		},
	}
}

// commands reads stdin until quit or EOF.
func commands(cp *controlPlane, ev *events) {
	scanner := bufio.NewScanner(os.Stdin)
	for scanner.Scan() {
		cmd, arg, _ := strings.Cut(strings.TrimSpace(scanner.Text()), " ")
		switch cmd {
		case "":
		case "quit":
			os.Exit(0)
		case "set":
			if arg == "" {
				ev.errorf("set: missing FILE")
				continue
			}
			version, err := cp.apply(strings.TrimSpace(arg))
			if err != nil {
				ev.errorf("set: %v", err)
				continue
			}
			ev.emit(map[string]any{"event": "applied", "version": version})
		default:
			ev.errorf("unknown command %q", cmd)
		}
	}
	os.Exit(0)
}

func main() {
	listen := flag.String("listen", "127.0.0.1:0", "address to serve xDS on")
	nodeID := flag.String("node-id", "adsrelay", "node id the snapshot is keyed by")
	statePath := flag.String("state", "", "optional initial state file (same format as the set command)")
	sotwOnly := flag.Bool("sotw-only", false, "serve only the state-of-the-world methods (no Delta: UNIMPLEMENTED)")
	classifyOnly := flag.Bool("classify-only", false, "MuxCache without ClassifyDelta (a Delta request crashes the server)")
	snapshotADS := flag.Bool("snapshot-ads", true, "the SnapshotCache's ads flag")
	flag.Parse()

	ev := &events{enc: json.NewEncoder(os.Stdout)}
	logger := log.LoggerFuncs{
		WarnFunc:  func(f string, a ...any) { fmt.Fprintf(os.Stderr, "warn: "+f+"\n", a...) },
		ErrorFunc: func(f string, a ...any) { fmt.Fprintf(os.Stderr, "error: "+f+"\n", a...) },
	}
	cp := newControlPlane(*nodeID, logger, *snapshotADS, *classifyOnly)
	if *statePath != "" {
		if _, err := cp.apply(*statePath); err != nil {
			fmt.Fprintf(os.Stderr, "gcp-server: initial state: %v\n", err)
			os.Exit(2)
		}
	}

	lis, err := net.Listen("tcp", *listen)
	if err != nil {
		fmt.Fprintf(os.Stderr, "gcp-server: %v\n", err)
		os.Exit(1)
	}
	grpcServer := grpc.NewServer()
	srv := server.NewServer(context.Background(), cp.mux, callbacks(ev))
	if *sotwOnly {
		registerSotwOnly(grpcServer, srv)
	} else {
		xdstest.RegisterServer(grpcServer, srv)
	}
	ev.emit(map[string]any{"event": "listening", "addr": lis.Addr().String()})
	go commands(cp, ev)
	if err := grpcServer.Serve(lis); err != nil {
		fmt.Fprintf(os.Stderr, "gcp-server: %v\n", err)
		os.Exit(1)
	}
}

// registerSotwOnly registers the services xdstest.RegisterServer does, less every Delta method
// (and the Delta-only VirtualHostDiscoveryService): grpc-go answers a call to a method it does not
// know with UNIMPLEMENTED, as a server without Delta support does.
func registerSotwOnly(grpcServer *grpc.Server, srv server.Server) {
	for _, desc := range []*grpc.ServiceDesc{
		&discovery.AggregatedDiscoveryService_ServiceDesc,
		&endpointservice.EndpointDiscoveryService_ServiceDesc,
		&clusterservice.ClusterDiscoveryService_ServiceDesc,
		&routeservice.RouteDiscoveryService_ServiceDesc,
		&routeservice.ScopedRoutesDiscoveryService_ServiceDesc,
		&listenerservice.ListenerDiscoveryService_ServiceDesc,
		&secretservice.SecretDiscoveryService_ServiceDesc,
		&runtimeservice.RuntimeDiscoveryService_ServiceDesc,
	} {
		sotw := *desc
		sotw.Streams = nil
		for _, s := range desc.Streams {
			if !strings.HasPrefix(s.StreamName, "Delta") {
				sotw.Streams = append(sotw.Streams, s)
			}
		}
		grpcServer.RegisterService(&sotw, srv)
	}
}
