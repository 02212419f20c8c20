// Package redistest gives the module's tests a Redis to talk to: a real
// redis-server started on a free 127.0.0.1 port (stopped by its pid), the
// server named by SLOTBOOK_REDIS_URL, or, when redis-server is not on PATH,
// an embedded miniredis, with a note saying so. With SLOTBOOK_REQUIRE_REDIS=1
// a missing redis-server fails the tests instead.
//
// A test package calls Main from its TestMain; every test then calls
// Shared(t).Client(t) for a client, and Prefix(t) for a key prefix of its
// own, so tests can run in parallel against one server.
package redistest

import (
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"
	"go.uber.org/goleak"
)

// Server is a Redis the tests may use.
type Server struct {
	Addr string // host:port
	Real bool   // a real redis-server (false: miniredis)

	opts *redis.Options // from SLOTBOOK_REDIS_URL, if set
	cmd  *exec.Cmd
	done chan struct{} // closed when cmd has exited
	dir  string
	port int
	mini *miniredis.Miniredis
}

var (
	sharedOnce sync.Once
	shared     *Server
	sharedErr  error
)

// Main runs the package's tests, stops the shared server, and then fails
// the run if any goroutine is left behind (go.uber.org/goleak).
func Main(m *testing.M) {
	// go-redis logs every failed dial; the fault tests make many on purpose.
	redis.SetLogger(quiet{})
	code := m.Run()
	if shared != nil {
		shared.Stop()
	}
	if code == 0 {
		if err := goleak.Find(); err != nil {
			fmt.Fprintf(os.Stderr, "goroutines left behind after the tests: %v\n", err)
			code = 1
		}
	}
	os.Exit(code)
}

// Shared returns the server shared by the package's tests, starting it on
// first use. It fails tb if no Redis can be had.
func Shared(tb testing.TB) *Server {
	tb.Helper()
	sharedOnce.Do(func() { shared, sharedErr = start(true) })
	if sharedErr != nil {
		tb.Fatalf("redistest: %v", sharedErr)
	}
	return shared
}

// Start starts a redis-server of the test's own, stopped when the test ends.
// It skips the test where there is no redis-server (fails it under
// SLOTBOOK_REQUIRE_REDIS=1). Fault tests that kill or pause the server use it.
// extra is passed to redis-server (for instance "--cluster-enabled", "yes").
func Start(tb testing.TB, extra ...string) *Server {
	tb.Helper()
	path, err := exec.LookPath("redis-server")
	if err != nil {
		missing(tb)
	}
	s, err := startReal(path, 0, extra...)
	if err != nil {
		tb.Fatalf("redistest: %v", err)
	}
	tb.Cleanup(s.Stop)
	return s
}

// RequireReal skips the test, with the reason, unless s is a real
// redis-server.
func (s *Server) RequireReal(tb testing.TB) {
	tb.Helper()
	if !s.Real {
		tb.Skip("redistest: needs a real redis-server; install one (or unset SLOTBOOK_REDIS_URL pointing elsewhere)")
	}
}

// Client returns a client of s, closed when the test ends.
func (s *Server) Client(tb testing.TB) *redis.Client {
	tb.Helper()
	c := redis.NewClient(s.Options())
	tb.Cleanup(func() { _ = c.Close() })
	return c
}

// Options returns client options for s.
func (s *Server) Options() *redis.Options {
	if s.opts != nil {
		o := *s.opts
		return &o
	}
	return &redis.Options{
		Addr:                  s.Addr,
		ContextTimeoutEnabled: true,
		// Keep retries from hiding faults in tests that make them.
		MaxRetries: -1,
	}
}

// Port returns the server's TCP port.
func (s *Server) Port() int { return s.port }

// Pid returns the redis-server's process id, or 0 for miniredis.
func (s *Server) Pid() int {
	if s.cmd == nil || s.cmd.Process == nil {
		return 0
	}
	return s.cmd.Process.Pid
}

// Restart starts a new redis-server on the same port after Stop (or a kill).
func (s *Server) Restart(tb testing.TB) {
	tb.Helper()
	s.Stop()
	path, err := exec.LookPath("redis-server")
	if err != nil {
		tb.Fatal(err)
	}
	ns, err := startReal(path, s.port)
	if err != nil {
		tb.Fatalf("redistest: restart: %v", err)
	}
	s.cmd, s.done, s.dir = ns.cmd, ns.done, ns.dir
}

// Stop stops the server by its pid and waits for it to exit.
func (s *Server) Stop() {
	if s.mini != nil {
		s.mini.Close()
		return
	}
	if s.cmd == nil || s.cmd.Process == nil {
		return
	}
	pid := s.cmd.Process.Pid
	_ = syscall.Kill(pid, syscall.SIGCONT) // in case a test paused it
	_ = syscall.Kill(pid, syscall.SIGTERM)
	select {
	case <-s.done:
	case <-time.After(5 * time.Second):
		_ = syscall.Kill(pid, syscall.SIGKILL)
		<-s.done
	}
	s.cmd = nil
	if s.dir != "" {
		_ = os.RemoveAll(s.dir)
	}
}

// Prefix returns a key prefix unique to the test, ending in ":".
func Prefix(tb testing.TB) string {
	tb.Helper()
	return "t:" + strings.NewReplacer("/", ":", " ", "_").Replace(tb.Name()) + ":" +
		strconv.FormatInt(time.Now().UnixNano(), 36) + ":"
}

func missing(tb testing.TB) {
	tb.Helper()
	if os.Getenv("SLOTBOOK_REQUIRE_REDIS") == "1" {
		tb.Fatal("redistest: redis-server is not on PATH and SLOTBOOK_REQUIRE_REDIS=1")
	}
	tb.Skip("redistest: redis-server is not on PATH")
}

func start(sharedServer bool) (*Server, error) {
	if u := os.Getenv("SLOTBOOK_REDIS_URL"); u != "" {
		opts, err := redis.ParseURL(u)
		if err != nil {
			return nil, fmt.Errorf("SLOTBOOK_REDIS_URL: %w", err)
		}
		opts.ContextTimeoutEnabled = true
		return &Server{Addr: opts.Addr, Real: true, opts: opts}, nil
	}
	path, err := exec.LookPath("redis-server")
	if err != nil {
		if os.Getenv("SLOTBOOK_REQUIRE_REDIS") == "1" {
			return nil, fmt.Errorf("redis-server is not on PATH and SLOTBOOK_REQUIRE_REDIS=1")
		}
		m, err := miniredis.Run()
		if err != nil {
			return nil, err
		}
		fmt.Fprintln(os.Stderr, "redistest: redis-server not on PATH; using embedded miniredis (tests needing a real server skip)")
		return &Server{Addr: m.Addr(), mini: m}, nil
	}
	s, err := startReal(path, 0)
	if err != nil || !sharedServer {
		return s, err
	}
	// The shared server refuses SCRIPT FLUSH, FLUSHALL and FLUSHDB: a test
	// that flushed it would make other tests' calls go twice (NOSCRIPT,
	// then EVAL) or lose their keys, now and then, by timing. Such a test
	// starts a server of its own (Start); here it fails at once, NOPERM.
	c := redis.NewClient(s.Options())
	defer c.Close()
	if err := c.Do(context.Background(), "ACL", "SETUSER", "default", "-script|flush", "-flushall", "-flushdb").Err(); err != nil {
		s.Stop()
		return nil, fmt.Errorf("shared redis-server: ACL SETUSER: %w", err)
	}
	return s, nil
}

// startReal starts redis-server on port (0: a free one) and waits until it
// answers PING.
func startReal(path string, port int, extra ...string) (*Server, error) {
	var lastErr error
	for attempt := 0; attempt < 5; attempt++ {
		p := port
		if p == 0 {
			var err error
			if p, err = freePort(); err != nil {
				return nil, err
			}
		}
		s, err := launch(path, p, extra...)
		if err == nil {
			return s, nil
		}
		lastErr = err
		if port != 0 {
			time.Sleep(200 * time.Millisecond) // the old one may still hold it
		}
	}
	return nil, lastErr
}

func launch(path string, port int, extra ...string) (*Server, error) {
	dir, err := os.MkdirTemp("", "slotbook-redis-")
	if err != nil {
		return nil, err
	}
	return launchIn(path, port, dir, func(err error) bool { return err == nil }, extra...)
}

// launchIn starts redis-server on port with dir as its directory (removed
// when it stops) and waits until up(err) holds for a PING's error.
func launchIn(path string, port int, dir string, up func(error) bool, extra ...string) (*Server, error) {
	args := append([]string{
		"--port", strconv.Itoa(port), "--bind", "127.0.0.1",
		"--save", "", "--appendonly", "no", "--dir", dir,
		"--loglevel", "warning", "--logfile", "redis.log", "--daemonize", "no",
	}, extra...)
	cmd := exec.Command(path, args...)
	cmd.SysProcAttr = sysProcAttr()
	if err := cmd.Start(); err != nil {
		os.RemoveAll(dir)
		return nil, err
	}
	s := &Server{Addr: net.JoinHostPort("127.0.0.1", strconv.Itoa(port)), Real: true,
		cmd: cmd, done: make(chan struct{}), dir: dir, port: port}
	go func() { _ = cmd.Wait(); close(s.done) }()
	c := redis.NewClient(&redis.Options{Addr: s.Addr, MaxRetries: -1, DialTimeout: 200 * time.Millisecond})
	defer c.Close()
	deadline := time.Now().Add(10 * time.Second)
	for {
		ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
		err := c.Ping(ctx).Err()
		cancel()
		if up(err) {
			return s, nil
		}
		if time.Now().After(deadline) {
			s.Stop()
			return nil, fmt.Errorf("redis-server on port %d did not answer: %w", port, err)
		}
		select {
		case <-s.done:
			os.RemoveAll(dir)
			return nil, fmt.Errorf("redis-server on port %d exited: %w", port, err)
		case <-time.After(20 * time.Millisecond):
		}
	}
}

func freePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}

type quiet struct{}

func (quiet) Printf(context.Context, string, ...any) {}

// Cluster is a Redis Cluster of real redis-server processes on loopback.
type Cluster struct {
	// Addrs are the masters' addresses, with no room to spare: go-redis
	// appends each node it learns of (a replica, say) to the Addrs slice
	// of its ClusterOptions, so clients made from one slice with room
	// would all write into its array (a data race).
	Addrs []string
	nodes []*Server
}

// StartCluster starts n (at least 3) redis-server processes with
// --cluster-enabled yes on free 127.0.0.1 ports, joins them with
// redis-cli --cluster create, waits until the cluster is ok, and stops them
// when the test ends. It skips the test where redis-server or redis-cli is
// missing (fails it under SLOTBOOK_REQUIRE_REDIS=1). extra is passed to
// every redis-server (for instance "--cluster-require-full-coverage", "no",
// so that the other masters keep serving while one is stopped).
func StartCluster(tb testing.TB, n int, extra ...string) *Cluster {
	tb.Helper()
	server, err1 := exec.LookPath("redis-server")
	cli, err2 := exec.LookPath("redis-cli")
	if err1 != nil || err2 != nil {
		missing(tb)
	}
	c := &Cluster{}
	for i := 0; i < n; i++ {
		s, err := startReal(server, 0, append([]string{"--cluster-enabled", "yes", "--cluster-node-timeout", "2000"}, extra...)...)
		if err != nil {
			tb.Fatalf("redistest: cluster node: %v", err)
		}
		tb.Cleanup(s.Stop)
		c.nodes = append(c.nodes, s)
		c.Addrs = append(c.Addrs, s.Addr)
	}
	c.Addrs = slices.Clip(c.Addrs)
	args := append([]string{"--cluster", "create"}, c.Addrs...)
	args = append(args, "--cluster-replicas", "0", "--cluster-yes")
	if out, err := exec.Command(cli, args...).CombinedOutput(); err != nil {
		tb.Fatalf("redistest: redis-cli --cluster create: %v\n%s", err, out)
	}
	deadline := time.Now().Add(20 * time.Second)
	for _, s := range c.nodes {
		cl := redis.NewClient(&redis.Options{Addr: s.Addr})
		for {
			info, err := cl.ClusterInfo(context.Background()).Result()
			if err == nil && strings.Contains(info, "cluster_state:ok") {
				break
			}
			if time.Now().After(deadline) {
				cl.Close()
				tb.Fatalf("redistest: cluster not ok: %v %s", err, info)
			}
			time.Sleep(50 * time.Millisecond)
		}
		cl.Close()
	}
	return c
}

// Node returns the cluster's i-th node (a master; Addrs[i]), for a test
// that stops it.
func (c *Cluster) Node(i int) *Server { return c.nodes[i] }

// AddReplica starts a redis-server with --cluster-enabled yes, joins it
// to the cluster (CLUSTER MEET) as a replica of master i (CLUSTER
// REPLICATE, retried until the node has learnt of the master, up to 30
// s), and returns it, stopped when the test ends. It does not wait for
// the replica to sync, nor for the other nodes' slot maps to list it.
func (c *Cluster) AddReplica(tb testing.TB, i int) *Server {
	tb.Helper()
	ctx := context.Background()
	rep := Start(tb, "--cluster-enabled", "yes", "--cluster-node-timeout", "2000")
	rc := rep.Client(tb)
	host, port, _ := strings.Cut(c.Addrs[i], ":")
	if err := rc.Do(ctx, "CLUSTER", "MEET", host, port).Err(); err != nil {
		tb.Fatalf("redistest: CLUSTER MEET: %v", err)
	}
	id, err := c.nodes[i].Client(tb).Do(ctx, "CLUSTER", "MYID").Text()
	if err != nil {
		tb.Fatalf("redistest: CLUSTER MYID: %v", err)
	}
	deadline := time.Now().Add(30 * time.Second)
	for {
		err := rc.Do(ctx, "CLUSTER", "REPLICATE", id).Err()
		if err == nil {
			return rep
		}
		if time.Now().After(deadline) {
			tb.Fatalf("redistest: CLUSTER REPLICATE: %v", err)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// Client returns a cluster client, closed when the test ends.
func (c *Cluster) Client(tb testing.TB) *redis.ClusterClient {
	tb.Helper()
	cc := redis.NewClusterClient(&redis.ClusterOptions{Addrs: slices.Clone(c.Addrs), ContextTimeoutEnabled: true})
	tb.Cleanup(func() { _ = cc.Close() })
	return cc
}

// Launch starts a redis-server from PATH on a free 127.0.0.1 port, for
// programs (the benchmark command) rather than tests; Stop stops it.
func Launch() (*Server, error) {
	path, err := exec.LookPath("redis-server")
	if err != nil {
		return nil, fmt.Errorf("redis-server is not on PATH (apt-get install redis-server), or pass -redis URL")
	}
	return startReal(path, 0)
}

// UntilOK retries f until it returns nil, for at most 10 s: a test's setup
// call must reach a working Redis, and on a busy machine one may miss a
// tight timeout (opening the engine's breaker, which a later success
// closes). It fails tb with f's last error.
func UntilOK(tb testing.TB, f func() error) {
	tb.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		err := f()
		if err == nil {
			return
		}
		if !time.Now().Before(deadline) {
			tb.Fatalf("Redis never answered within the timeout: %v", err)
		}
		time.Sleep(time.Millisecond)
	}
}
