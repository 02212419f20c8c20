package throttle_test

import (
	"context"
	"errors"
	"net"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/slotbook/slotbook/internal/redistest"
	"github.com/slotbook/slotbook/throttle"
)

// TestErrorClasses makes each kind of Redis failure on a real server and
// checks the class the package doc's table gives it: unavailable (matches
// ErrUnavailable; the node's breaker opens, so a fallback answers),
// unavailable with the reply lost (ErrReplyLost too: the script may run
// later), the client's own saturation (ErrUnavailable, nothing sent, the
// breaker stays closed), or a configuration error (returned as Redis said
// it, not ErrUnavailable: no fallback hides it, the breaker stays closed).
func TestErrorClasses(t *testing.T) {
	t.Parallel()
	type class int
	const (
		unavailable class = iota // ErrUnavailable, nothing ran, breaker opens
		replyLost                // ErrUnavailable + ErrReplyLost, breaker opens
		saturated                // ErrUnavailable, nothing ran, breaker closed
		config                   // Redis's error as is, breaker closed
	)
	ctx := context.Background()
	// Each case returns the client the engine uses, after making the fault
	// on a server of its own.
	cases := []struct {
		name   string
		prefix string // of Redis's error, "" for no check
		class  class
		fault  func(t *testing.T) redis.UniversalClient
	}{
		{"READONLY: a replica after a failover", "READONLY", unavailable, func(t *testing.T) redis.UniversalClient {
			primary, replica := redistest.Start(t), redistest.Start(t)
			rdb := replica.Client(t)
			require.NoError(t, rdb.Do(ctx, "REPLICAOF", "127.0.0.1", primary.Port()).Err())
			waitReplicaSynced(t, rdb)
			return rdb
		}},
		{"MASTERDOWN: a replica that serves no stale data", "MASTERDOWN", unavailable, func(t *testing.T) redis.UniversalClient {
			replica := redistest.Start(t)
			rdb := replica.Client(t)
			require.NoError(t, rdb.ConfigSet(ctx, "replica-serve-stale-data", "no").Err())
			require.NoError(t, rdb.Do(ctx, "REPLICAOF", "127.0.0.1", freeClosedPort(t)).Err())
			return rdb
		}},
		{"OOM: maxmemory with noeviction", "OOM", unavailable, func(t *testing.T) redis.UniversalClient {
			rdb := redistest.Start(t).Client(t)
			require.NoError(t, rdb.ConfigSet(ctx, "maxmemory-policy", "noeviction").Err())
			require.NoError(t, rdb.ConfigSet(ctx, "maxmemory", "1").Err())
			return rdb
		}},
		{"NOREPLICAS: too few replicas to write", "NOREPLICAS", unavailable, func(t *testing.T) redis.UniversalClient {
			rdb := redistest.Start(t).Client(t)
			require.NoError(t, rdb.ConfigSet(ctx, "min-replicas-to-write", "1").Err())
			return rdb
		}},
		{"MISCONF: the last snapshot failed", "MISCONF", unavailable, func(t *testing.T) redis.UniversalClient {
			rdb := redistest.Start(t).Client(t)
			// The server's own temporary directory, removed under it: the
			// snapshot cannot be written.
			dir, err := rdb.ConfigGet(ctx, "dir").Result()
			require.NoError(t, err)
			require.True(t, strings.HasPrefix(dir["dir"], os.TempDir()), "a directory of the test's own: %q", dir["dir"])
			require.NoError(t, rdb.ConfigSet(ctx, "stop-writes-on-bgsave-error", "yes").Err())
			require.NoError(t, rdb.ConfigSet(ctx, "save", "3600 1").Err()) // snapshots configured
			// None at shutdown (it would fail and hold up the server's exit).
			t.Cleanup(func() { _ = rdb.ConfigSet(context.Background(), "save", "").Err() })
			require.NoError(t, os.RemoveAll(dir["dir"]))
			require.NoError(t, rdb.BgSave(ctx).Err())
			require.Eventually(t, func() bool {
				info, err := rdb.Info(ctx, "persistence").Result()
				return err == nil && strings.Contains(info, "rdb_last_bgsave_status:err")
			}, 10*time.Second, 10*time.Millisecond, "the snapshot failed")
			return rdb
		}},
		{"CLUSTERDOWN: a slot no node serves", "CLUSTERDOWN", unavailable, func(t *testing.T) redis.UniversalClient {
			// A cluster-enabled server with no slots assigned.
			srv := redistest.Start(t, "--cluster-enabled", "yes")
			return srv.Client(t)
		}},
		{"BUSY: a script running too long", "BUSY", unavailable, func(t *testing.T) redis.UniversalClient {
			srv := redistest.Start(t)
			rdb := srv.Client(t)
			require.NoError(t, rdb.ConfigSet(ctx, "busy-reply-threshold", "10").Err())
			busy := srv.Client(t)
			started := make(chan struct{})
			done := make(chan struct{})
			go func() {
				defer close(done)
				close(started)
				// Spins for 3 s of server time, then ends by itself.
				_ = busy.Eval(context.Background(),
					"local t = redis.call('TIME') local e = t[1] + 3 while tonumber(redis.call('TIME')[1]) < e do end return 1", nil).Err()
			}()
			t.Cleanup(func() { <-done })
			<-started
			require.Eventually(t, func() bool {
				return redis.HasErrorPrefix(rdb.Ping(ctx).Err(), "BUSY")
			}, 5*time.Second, time.Millisecond, "the script is running")
			return rdb
		}},
		{"CLIENT PAUSE: the server holds the call", "", replyLost, func(t *testing.T) redis.UniversalClient {
			srv := redistest.Start(t)
			rdb := srv.Client(t)
			require.NoError(t, rdb.Ping(ctx).Err())
			admin := srv.Client(t)
			require.NoError(t, admin.Do(ctx, "CLIENT", "PAUSE", 2000, "ALL").Err())
			t.Cleanup(func() { _ = admin.Do(context.Background(), "CLIENT", "UNPAUSE").Err() })
			return rdb
		}},
		{"pool timeout: the client's own pool is busy", "", saturated, func(t *testing.T) redis.UniversalClient {
			srv := redistest.Start(t)
			o := srv.Options()
			o.PoolSize, o.PoolTimeout = 1, 20*time.Millisecond
			rdb := redis.NewClient(o)
			t.Cleanup(func() { _ = rdb.Close() })
			// The pool's one connection is held by a blocking call.
			held := make(chan struct{})
			go func() {
				defer close(held)
				_ = rdb.BLPop(context.Background(), 2*time.Second, "nothing").Err()
			}()
			t.Cleanup(func() { <-held })
			require.Eventually(t, func() bool { return rdb.PoolStats().IdleConns == 0 && rdb.PoolStats().TotalConns == 1 },
				5*time.Second, time.Millisecond)
			return rdb
		}},
		{"NOAUTH: a password required, none given", "NOAUTH", config, func(t *testing.T) redis.UniversalClient {
			srv := redistest.Start(t)
			rdb := srv.Client(t)
			require.NoError(t, rdb.ConfigSet(ctx, "requirepass", "secret").Err())
			return srv.Client(t) // a new connection, without the password
		}},
		{"WRONGPASS: a wrong password", "WRONGPASS", config, func(t *testing.T) redis.UniversalClient {
			srv := redistest.Start(t)
			require.NoError(t, srv.Client(t).ConfigSet(ctx, "requirepass", "secret").Err())
			o := srv.Options()
			o.Password = "wrong"
			rdb := redis.NewClient(o)
			t.Cleanup(func() { _ = rdb.Close() })
			return rdb
		}},
		{"NOPERM: an ACL user without the keys", "NOPERM", config, func(t *testing.T) redis.UniversalClient {
			srv := redistest.Start(t)
			require.NoError(t, srv.Client(t).Do(ctx, "ACL", "SETUSER", "u", "on", ">pw", "~other:*", "+@all").Err())
			o := srv.Options()
			o.Username, o.Password = "u", "pw"
			rdb := redis.NewClient(o)
			t.Cleanup(func() { _ = rdb.Close() })
			return rdb
		}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			rdb := tc.fault(t)
			timeout := 5 * time.Second // a busy machine: only the held call times out
			if tc.class == replyLost {
				timeout = 200 * time.Millisecond
			}
			eng, err := throttle.New(rdb, throttle.WithTimeout(timeout), throttle.WithProbeBackoff(time.Minute, time.Minute))
			require.NoError(t, err)
			_, err = eng.Book(ctx, "k", throttle.PerHour(1, 0), throttle.Request{N: 1})
			t.Logf("%v", err)
			require.Error(t, err)
			if tc.prefix != "" {
				var rerr redis.Error
				require.True(t, errors.As(err, &rerr), "Redis's own error is kept: %v", err)
				require.True(t, redis.HasErrorPrefix(rerr, tc.prefix), "got %v, want %s", rerr, tc.prefix)
			}
			open, _ := eng.Unavailable()
			switch tc.class {
			case unavailable:
				require.ErrorIs(t, err, throttle.ErrUnavailable)
				require.NotErrorIs(t, err, throttle.ErrReplyLost, "refused: nothing ran")
				require.True(t, open, "the breaker opened")
			case replyLost:
				require.ErrorIs(t, err, throttle.ErrUnavailable)
				require.ErrorIs(t, err, throttle.ErrReplyLost, "held, not refused: it may run later")
				require.True(t, open, "the breaker opened")
			case saturated:
				require.ErrorIs(t, err, throttle.ErrUnavailable)
				require.NotErrorIs(t, err, throttle.ErrReplyLost, "never sent")
				require.False(t, open, "a busy client is not a Redis outage")
			case config:
				require.NotErrorIs(t, err, throttle.ErrUnavailable, "a configuration error must not be answered by a fallback")
				require.False(t, open)
			}
		})
	}
}

// waitReplicaSynced waits until the replica's link to its primary is up.
func waitReplicaSynced(t *testing.T, rdb *redis.Client) {
	t.Helper()
	require.Eventually(t, func() bool {
		info, err := rdb.Info(context.Background(), "replication").Result()
		return err == nil && strings.Contains(info, "master_link_status:up")
	}, 30*time.Second, 10*time.Millisecond, "the replica in sync")
}

// freeClosedPort returns a 127.0.0.1 port nothing listens on.
func freeClosedPort(t *testing.T) int {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	port := l.Addr().(*net.TCPAddr).Port
	require.NoError(t, l.Close())
	return port
}
