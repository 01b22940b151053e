// gcp-baseline: go-control-plane as an operator of identical proxies runs it, for loadgen (bench/).
// One SnapshotCache snapshot serves the whole fleet (every node hashes to one key), built from
// go-control-plane's own server/v3 and cache/v3, serving ADS in both variants. It is the
// baseline users would pick instead of the relay, and an upstream for the relay.
//
// It speaks loadgen's child-server protocol (bench/src/server_proc.rs): argv carries the
// workload as JSON (--workload); the first stdout line is "listening <addr>"; stdin carries one
// JSON command per line ({"Push":{"generation":G,"changed":{"names":[[..],[..],[..]]}}} or
// "Stats", answered with one JSON line of totals); it exits when stdin closes.
//
// Resources are real Cluster, Listener and ClusterLoadAssignment messages named as loadgen names
// them (field 1), carrying the generation that last changed them in field 1000 and padding in
// field 1001 (unknown fields, kept verbatim by Go's protobuf runtime), the layout of
// bench/src/workload.rs. Each type's snapshot version moves only when one of its resources
// changes, so a SotW client is sent only the type that changed.
package main

import (
	"bufio"
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"net"
	"os"
	"strconv"
	"sync/atomic"

	cluster "github.com/envoyproxy/go-control-plane/envoy/config/cluster/v3"
	core "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	endpoint "github.com/envoyproxy/go-control-plane/envoy/config/endpoint/v3"
	listener "github.com/envoyproxy/go-control-plane/envoy/config/listener/v3"
	discoverygrpc "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"github.com/envoyproxy/go-control-plane/pkg/cache/types"
	"github.com/envoyproxy/go-control-plane/pkg/cache/v3"
	"github.com/envoyproxy/go-control-plane/pkg/server/v3"
	"google.golang.org/grpc"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
)

// workload mirrors bench/src/workload.rs's Workload.
type workload struct {
	Clusters      uint32 `json:"clusters"`
	Listeners     uint32 `json:"listeners"`
	EdsPool       uint32 `json:"eds_pool"`
	ResourceBytes int    `json:"resource_bytes"`
}

type push struct {
	Generation uint32 `json:"generation"`
	Changed    struct {
		Names [3][]uint32 `json:"names"`
	} `json:"changed"`
}

// The three kinds in loadgen's order (workload::Kind).
var kinds = [3]struct {
	prefix string
	typ    types.ResponseType
}{
	{"cluster-", types.Cluster},
	{"listener-", types.Listener},
	{"eds-", types.Endpoint},
}

// fleet hashes every node to one snapshot: identical proxies share one configuration.
type fleet struct{}

func (fleet) ID(*core.Node) string { return "fleet" }

// resourceFor builds resource `index` of kind `k` at `generation`, about `size` bytes encoded.
func resourceFor(k int, index, generation uint32, size int) types.Resource {
	name := kinds[k].prefix + strconv.FormatUint(uint64(index), 10)
	var m proto.Message
	switch k {
	case 0:
		m = &cluster.Cluster{Name: name}
	case 1:
		m = &listener.Listener{Name: name}
	default:
		m = &endpoint.ClusterLoadAssignment{ClusterName: name}
	}
	extra := protowire.AppendTag(nil, 1000, protowire.BytesType)
	extra = protowire.AppendString(extra, "u"+strconv.FormatUint(uint64(generation), 10))
	base := proto.Size(m) + len(extra)
	pad := 0
	if size > base+4 {
		pad = size - base - 4
	}
	extra = protowire.AppendTag(extra, 1001, protowire.BytesType)
	extra = protowire.AppendBytes(extra, make([]byte, pad))
	m.ProtoReflect().SetUnknown(extra)
	return m
}

type state struct {
	w         workload
	gens      [3][]uint32
	typeGen   [3]uint32
	snapshots cache.SnapshotCache
}

func (s *state) publish() error {
	snap := &cache.Snapshot{}
	for k := range kinds {
		items := make([]types.Resource, len(s.gens[k]))
		for i, g := range s.gens[k] {
			items[i] = resourceFor(k, uint32(i), g, s.w.ResourceBytes)
		}
		snap.Resources[kinds[k].typ] = cache.NewResources("u"+strconv.FormatUint(uint64(s.typeGen[k]), 10), items)
	}
	return s.snapshots.SetSnapshot(context.Background(), "fleet", snap)
}

type counters struct {
	streamsOpened, activeStreams, requests atomic.Int64
}

func (c *counters) callbacks() server.Callbacks {
	open := func(context.Context, int64, string) error {
		c.streamsOpened.Add(1)
		c.activeStreams.Add(1)
		return nil
	}
	closed := func(int64, *core.Node) { c.activeStreams.Add(-1) }
	return server.CallbackFuncs{
		StreamOpenFunc:        open,
		DeltaStreamOpenFunc:   open,
		StreamClosedFunc:      closed,
		DeltaStreamClosedFunc: closed,
		StreamRequestFunc: func(int64, *discoverygrpc.DiscoveryRequest) error {
			c.requests.Add(1)
			return nil
		},
		StreamDeltaRequestFunc: func(int64, *discoverygrpc.DeltaDiscoveryRequest) error {
			c.requests.Add(1)
			return nil
		},
	}
}

func main() {
	spec := flag.String("workload", "", "the workload as JSON (loadgen passes it)")
	listen := flag.String("listen", "127.0.0.1:0", "xDS listen address")
	flag.Parse()
	var w workload
	if err := json.Unmarshal([]byte(*spec), &w); err != nil {
		fmt.Fprintf(os.Stderr, "gcp-baseline: --workload: %v\n", err)
		os.Exit(64)
	}
	s := &state{w: w, snapshots: cache.NewSnapshotCache(false, fleet{}, nil)}
	for k, n := range [3]uint32{w.Clusters, w.Listeners, w.EdsPool} {
		s.gens[k] = make([]uint32, n)
	}
	if err := s.publish(); err != nil {
		fmt.Fprintf(os.Stderr, "gcp-baseline: snapshot: %v\n", err)
		os.Exit(1)
	}
	var c counters
	lis, err := net.Listen("tcp", *listen)
	if err != nil {
		fmt.Fprintf(os.Stderr, "gcp-baseline: listen: %v\n", err)
		os.Exit(1)
	}
	// As go-control-plane's example server: no practical limit on streams per connection.
	g := grpc.NewServer(grpc.MaxConcurrentStreams(1000000))
	discoverygrpc.RegisterAggregatedDiscoveryServiceServer(g, server.NewServer(context.Background(), s.snapshots, c.callbacks()))
	go func() {
		if err := g.Serve(lis); err != nil {
			fmt.Fprintf(os.Stderr, "gcp-baseline: serve: %v\n", err)
			os.Exit(1)
		}
	}()
	fmt.Printf("listening %s\n", lis.Addr())

	in := bufio.NewScanner(os.Stdin)
	in.Buffer(make([]byte, 1<<20), 64<<20)
	for in.Scan() {
		line := in.Bytes()
		if string(line) == `"Stats"` {
			out, _ := json.Marshal(map[string]int64{
				"streams_opened": c.streamsOpened.Load(),
				"active_streams": c.activeStreams.Load(),
				"requests":       c.requests.Load(),
			})
			fmt.Println(string(out))
			continue
		}
		var cmd struct{ Push *push }
		if err := json.Unmarshal(line, &cmd); err != nil || cmd.Push == nil {
			fmt.Fprintf(os.Stderr, "gcp-baseline: bad command %q: %v\n", line, err)
			os.Exit(1)
		}
		for k, names := range cmd.Push.Changed.Names {
			for _, i := range names {
				if int(i) < len(s.gens[k]) {
					s.gens[k][i] = cmd.Push.Generation
					s.typeGen[k] = cmd.Push.Generation
				}
			}
		}
		if err := s.publish(); err != nil {
			fmt.Fprintf(os.Stderr, "gcp-baseline: snapshot: %v\n", err)
			os.Exit(1)
		}
	}
}
