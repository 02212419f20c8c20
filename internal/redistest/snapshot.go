package redistest

import (
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"testing"

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
	return launchIn(path, port, dir, func(err error) bool {
		var rerr redis.Error
		return err == nil || errors.As(err, &rerr)
	}, extra...)
}

func copyFile(from, to string) error {
	b, err := os.ReadFile(from)
	if err != nil {
		return err
	}
	return os.WriteFile(to, b, 0o600)
}
