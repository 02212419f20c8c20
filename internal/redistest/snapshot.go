package redistest

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
)

// StartSnapshot starts a redis-server of the test's own that loads the
// snapshot (an RDB file) at rdb, and returns as soon as the server answers
// at all: it may still be loading, and answers -LOADING until it is done.
// extra is passed to redis-server; Redis 7's hidden settings
// "--key-load-delay" (microseconds of delay per key loaded) and
// "--loading-process-events-interval-bytes" (how often it answers clients
// while loading) keep a small snapshot loading long enough for a test to
// see. The server is stopped when the test ends. It skips the test where
// there is no redis-server (fails it under SLOTBOOK_REQUIRE_REDIS=1).
func StartSnapshot(tb testing.TB, rdb string, extra ...string) *Server {
	tb.Helper()
	path, err := exec.LookPath("redis-server")
	if err != nil {
		missing(tb)
	}
	var s *Server
	for attempt := 0; attempt < 5; attempt++ {
		if s, err = launchSnapshot(path, rdb, extra...); err == nil {
			break
		}
	}
	if err != nil {
		tb.Fatalf("redistest: %v", err)
	}
	tb.Cleanup(s.Stop)
	return s
}

// launchSnapshot starts redis-server on a free port, in a temporary
// directory holding a copy of rdb as its dump.rdb, and waits until it
// answers PING with anything Redis says (PONG, or an error reply such as
// LOADING).
func launchSnapshot(path, rdb string, extra ...string) (*Server, error) {
	port, err := freePort()
	if err != nil {
		return nil, err
	}
	dir, err := os.MkdirTemp("", "slotbook-redis-")
	if err != nil {
		return nil, err
	}
	if err := copyFile(rdb, filepath.Join(dir, "dump.rdb")); err != nil {
		os.RemoveAll(dir)
		return nil, err
	}
	args := append([]string{
		"--port", strconv.Itoa(port), "--bind", "127.0.0.1",
		"--save", "", "--appendonly", "no", "--dir", dir, "--dbfilename", "dump.rdb",
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
		var rerr redis.Error
		if err == nil || errors.As(err, &rerr) {
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
		case <-time.After(5 * time.Millisecond):
		}
	}
}

func copyFile(from, to string) error {
	b, err := os.ReadFile(from)
	if err != nil {
		return err
	}
	return os.WriteFile(to, b, 0o600)
}
