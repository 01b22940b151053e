// Command greeter is the gRPC-Go side of the xDS interop tests (tests/grpc_go_java_interop.rs):
// a tiny greeter server and an xDS client, speaking the same protocol as tests/interop/greeter.py.
//
// No generated stubs: one unary method, /demo.Greeter/SayHello, whose request and reply are raw
// bytes (the reply is the server's --name).
//
//	serve --port P --name NAME [--exit-on-stdin-eof]
//	    Serves on 127.0.0.1:P (P = 0 picks a free port) and prints one line once it accepts calls:
//	    "serving NAME on 127.0.0.1:PORT". With --exit-on-stdin-eof it exits when its stdin closes,
//	    so it never outlives the process that started it.
//
//	call --target TARGET [--bootstrap FILE] [--interval-ms MS] [--rpc-timeout-ms MS] [--count N]
//	    Calls TARGET (e.g. xds:///greeter.example:50051) on one channel, one call every MS
//	    milliseconds, and prints one line per call on stdout: "OK NAME" (the backend that
//	    answered) or "ERR CODE: message". Stops after N calls (0: until stdin closes). --bootstrap
//	    sets GRPC_XDS_BOOTSTRAP. Diagnostics go to stderr.
package main

import (
	"bufio"
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"os"
	"strings"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
	_ "google.golang.org/grpc/xds" // registers the xds:/// resolver and the xDS balancers
)

const (
	service    = "demo.Greeter"
	method     = "SayHello"
	fullMethod = "/" + service + "/" + method
)

// rawCodec passes messages through as bytes: the greeter's request and reply are raw bytes.
type rawCodec struct{}

func (rawCodec) Marshal(v any) ([]byte, error) {
	switch m := v.(type) {
	case []byte:
		return m, nil
	case *[]byte:
		return *m, nil
	}
	return nil, fmt.Errorf("rawCodec: cannot marshal %T", v)
}

func (rawCodec) Unmarshal(data []byte, v any) error {
	m, ok := v.(*[]byte)
	if !ok {
		return fmt.Errorf("rawCodec: cannot unmarshal into %T", v)
	}
	*m = append((*m)[:0], data...)
	return nil
}

// Name is "proto" so the content type stays application/grpc (what greeter.py expects).
func (rawCodec) Name() string { return "proto" }

func serve(args []string) int {
	fs := flag.NewFlagSet("serve", flag.ExitOnError)
	port := fs.Int("port", 0, "port on 127.0.0.1; 0 picks one")
	name := fs.String("name", "", "the reply")
	exitOnEOF := fs.Bool("exit-on-stdin-eof", false, "exit when stdin closes")
	fs.Parse(args)
	if *name == "" {
		fmt.Fprintln(os.Stderr, "greeter serve: --name is required")
		return 2
	}
	lis, err := net.Listen("tcp", fmt.Sprintf("127.0.0.1:%d", *port))
	if err != nil {
		fmt.Fprintf(os.Stderr, "greeter serve: %v\n", err)
		return 1
	}
	reply := []byte(*name)
	handler := func(_ any, ctx context.Context, dec func(any) error, _ grpc.UnaryServerInterceptor) (any, error) {
		var req []byte
		if err := dec(&req); err != nil {
			return nil, err
		}
		return reply, nil
	}
	srv := grpc.NewServer(grpc.ForceServerCodec(rawCodec{}))
	srv.RegisterService(&grpc.ServiceDesc{
		ServiceName: service,
		HandlerType: (*any)(nil),
		Methods:     []grpc.MethodDesc{{MethodName: method, Handler: handler}},
	}, struct{}{})
	fmt.Printf("serving %s on %s\n", *name, lis.Addr())
	if *exitOnEOF {
		go func() {
			io.Copy(io.Discard, os.Stdin)
			srv.Stop()
		}()
	}
	if err := srv.Serve(lis); err != nil && !errors.Is(err, grpc.ErrServerStopped) {
		fmt.Fprintf(os.Stderr, "greeter serve: %v\n", err)
		return 1
	}
	return 0
}

func call(args []string) int {
	fs := flag.NewFlagSet("call", flag.ExitOnError)
	target := fs.String("target", "", "xds:///host:port or host:port")
	bootstrap := fs.String("bootstrap", "", "gRPC xDS bootstrap file (sets GRPC_XDS_BOOTSTRAP)")
	interval := fs.Int("interval-ms", 100, "milliseconds between calls")
	rpcTimeout := fs.Int("rpc-timeout-ms", 2000, "deadline of each call")
	count := fs.Int("count", 0, "calls to make; 0: until stdin closes")
	fs.Parse(args)
	if *target == "" {
		fmt.Fprintln(os.Stderr, "greeter call: --target is required")
		return 2
	}
	if *bootstrap != "" {
		if _, err := os.Stat(*bootstrap); err != nil {
			fmt.Fprintf(os.Stderr, "greeter call: bootstrap: %v\n", err)
			return 2
		}
		// Read when the first xds: channel is created, so set it before that.
		os.Setenv("GRPC_XDS_BOOTSTRAP", *bootstrap)
	} else if strings.HasPrefix(*target, "xds:") && os.Getenv("GRPC_XDS_BOOTSTRAP") == "" {
		fmt.Fprintln(os.Stderr, "greeter call: an xds: target needs --bootstrap or GRPC_XDS_BOOTSTRAP")
		return 2
	}

	conn, err := grpc.NewClient(*target,
		grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithDefaultCallOptions(grpc.ForceCodec(rawCodec{})))
	if err != nil {
		fmt.Fprintf(os.Stderr, "greeter call: %v\n", err)
		return 1
	}
	defer conn.Close()

	stdinClosed := make(chan struct{})
	if *count == 0 {
		go func() {
			io.Copy(io.Discard, os.Stdin)
			close(stdinClosed)
		}()
	}
	out := bufio.NewWriter(os.Stdout)
	for i := 0; *count == 0 || i < *count; i++ {
		select {
		case <-stdinClosed:
			return 0
		default:
		}
		ctx, cancel := context.WithTimeout(context.Background(), time.Duration(*rpcTimeout)*time.Millisecond)
		var reply []byte
		err := conn.Invoke(ctx, fullMethod, []byte("hello"), &reply)
		cancel()
		if err != nil {
			s := status.Convert(err)
			fmt.Fprintf(out, "ERR %s: %s\n", s.Code(), strings.ReplaceAll(s.Message(), "\n", " "))
		} else {
			fmt.Fprintf(out, "OK %s\n", reply)
		}
		out.Flush()
		select {
		case <-stdinClosed:
			return 0
		case <-time.After(time.Duration(*interval) * time.Millisecond):
		}
	}
	return 0
}

func main() {
	if len(os.Args) < 2 {
		fmt.Fprintln(os.Stderr, "usage: greeter serve|call [flags]")
		os.Exit(2)
	}
	switch os.Args[1] {
	case "serve":
		os.Exit(serve(os.Args[2:]))
	case "call":
		os.Exit(call(os.Args[2:]))
	default:
		fmt.Fprintf(os.Stderr, "greeter: unknown mode %q (serve|call)\n", os.Args[1])
		os.Exit(2)
	}
}
