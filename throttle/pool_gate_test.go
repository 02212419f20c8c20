package throttle_test

import (
	"context"
	"errors"
	"net"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/slotbook/slotbook/internal/redistest"
	"github.com/slotbook/slotbook/throttle"
)

// holdPool keeps n connections of rdb busy with a BLPOP of d (other work
// on a client the engine shares: package lease, asynq) and returns when
// they are under way; wait waits for them to end.
func holdPool(t *testing.T, rdb *redis.Client, key string, n int, d time.Duration) (wait func()) {
	t.Helper()
	var wg sync.WaitGroup
	for range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			_ = rdb.BLPop(context.Background(), d, key).Err()
		}()
	}
	// The BLPOPs are blocked in Redis once the server counts them.
	deadline := time.Now().Add(10 * time.Second)
	for {
		ps := rdb.PoolStats()
		blocked := int(ps.TotalConns - ps.IdleConns)
		if blocked >= n {
			break
		}
		require.True(t, time.Now().Before(deadline), "the BLPOPs never took the pool (%d of %d)", blocked, n)
		time.Sleep(time.Millisecond)
	}
	return wg.Wait
}

// TestPoolWaitIsNotRedisDown: other work holds every connection of the
// client the engine uses (two BLPOPs on a pool of 2), so an engine call
// waits inside go-redis for a connection until its timeout (the engine's
// gate counts its own calls only). The call never left the client: it
// fails as "client saturated", ErrUnavailable without ErrReplyLost, and
// the healthy node's breaker stays closed. The same when the caller's own
// deadline ends the wait: no ErrReplyLost. Both with ContextTimeoutEnabled
// true and false (go-redis bounds the pool wait by the context either
// way).
func TestPoolWaitIsNotRedisDown(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	for _, cte := range []bool{true, false} {
		o := srv.Options()
		o.PoolSize = 2
		o.ContextTimeoutEnabled = cte
		rdb := redis.NewClient(o)
		t.Cleanup(func() { _ = rdb.Close() })
		log := &nodeLog{}
		opts := []throttle.Option{throttle.WithPrefix(redistest.Prefix(t)), throttle.WithObserver(log)}
		if !cte {
			opts = append(opts, throttle.WithTimeout(0))
		}
		eng, err := throttle.New(rdb, opts...)
		require.NoError(t, err)
		ctx := context.Background()
		lim := throttle.PerSecond(1000, 1000)
		redistest.UntilOK(t, func() error { _, err := eng.Allow(ctx, "warm", lim); return err })
		t.Logf("breaker changes during the warm-up: %v", log.getNodes())
		log.reset()

		wait := holdPool(t, rdb, redistest.Prefix(t)+"nothing", o.PoolSize, time.Second)
		if cte {
			_, err = eng.Allow(ctx, "k", lim) // the engine's timeout ends the wait
			t.Logf("ContextTimeoutEnabled, engine's timeout: %v", err)
			require.ErrorIs(t, err, throttle.ErrUnavailable)
			require.NotErrorIs(t, err, throttle.ErrReplyLost, "the call never left the pool")
		}
		cctx, cancel := context.WithTimeout(ctx, 30*time.Millisecond) // the caller's deadline ends it
		_, err = eng.Allow(cctx, "k", lim)
		cancel()
		t.Logf("ContextTimeoutEnabled %v, caller's deadline: %v", cte, err)
		require.ErrorIs(t, err, context.DeadlineExceeded)
		require.NotErrorIs(t, err, throttle.ErrReplyLost, "the call never left the pool")
		wait()

		require.Empty(t, log.getNodes(), "no breaker changed on a healthy Redis")
		_, err = eng.Allow(ctx, "k", lim)
		require.NoError(t, err, "served once the pool is free")
	}
}

// TestClusterPoolWaitIsNotRedisDown is TestPoolWaitIsNotRedisDown for a
// Cluster client: the master of the subject's slot has a pool of 2, both
// held by BLPOPs on that master.
func TestClusterPoolWaitIsNotRedisDown(t *testing.T) {
	t.Parallel()
	cluster := redistest.StartCluster(t, 3)
	cc := redis.NewClusterClient(&redis.ClusterOptions{Addrs: cluster.Addrs, ContextTimeoutEnabled: true, PoolSize: 2, MaxRetries: -1})
	t.Cleanup(func() { _ = cc.Close() })
	log := &nodeLog{}
	eng, err := throttle.New(cc, throttle.WithObserver(log))
	require.NoError(t, err)
	ctx := context.Background()
	lim := throttle.PerSecond(1000, 1000)
	subject := subjectOn(t, cc, throttle.DefaultPrefix, cluster.Addrs[0])
	redistest.UntilOK(t, func() error { _, err := eng.Allow(ctx, subject, lim); return err })
	t.Logf("breaker changes during the warm-up: %v", log.getNodes())
	log.reset()
	node, err := cc.MasterForKey(ctx, throttle.DefaultPrefix+subject)
	require.NoError(t, err)
	wait := holdPool(t, node, "{"+throttle.DefaultPrefix+subject+"}:nothing", 2, time.Second)
	_, err = eng.Allow(ctx, subject, lim)
	wait()
	t.Logf("Allow while other work held the node's pool: %v", err)
	require.ErrorIs(t, err, throttle.ErrUnavailable)
	require.NotErrorIs(t, err, throttle.ErrReplyLost, "the call never left the pool")
	require.Empty(t, log.getNodes(), "no breaker changed on a healthy Redis")
}

// TestLateConnectionIsNotRedisDown: a call that has its connection only
// once its timeout has passed (here a new connection's OnConnect, the
// client's own code, takes longer than the timeout; under load, a turn in
// the pool freed at the last moment does the same) fails on writing, with
// nothing sent: ErrUnavailable without ErrReplyLost, and the healthy
// node's breaker stays closed.
func TestLateConnectionIsNotRedisDown(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	o := srv.Options()
	o.MaxRetries = -1
	o.OnConnect = func(context.Context, *redis.Conn) error {
		time.Sleep(150 * time.Millisecond) // three times the engine's timeout
		return nil
	}
	rdb := redis.NewClient(o)
	t.Cleanup(func() { _ = rdb.Close() })
	log := &nodeLog{}
	eng, err := throttle.New(rdb, throttle.WithPrefix(redistest.Prefix(t)), throttle.WithObserver(log))
	require.NoError(t, err)
	_, err = eng.Allow(context.Background(), "k", throttle.PerSecond(10, 5))
	t.Logf("a call whose connection came late: %v", err)
	var op *net.OpError
	require.True(t, errors.As(err, &op) && op.Op == "write" && op.Timeout(), "want a write that timed out: %v", err)
	require.ErrorIs(t, err, throttle.ErrUnavailable)
	require.NotErrorIs(t, err, throttle.ErrReplyLost, "nothing was sent")
	require.Empty(t, log.getNodes(), "no breaker changed on a healthy Redis")
	n, err := rdb.Exists(context.Background(), redistest.Prefix(t)+"k").Result()
	require.NoError(t, err)
	require.Zero(t, n, "the script never ran")
}

// slowFirstWrite delays the first write on a connection: the HELLO of a
// new connection, as when the goroutine that dialed is descheduled on a
// busy machine.
type slowFirstWrite struct {
	net.Conn
	once sync.Once
	d    time.Duration
}

func (c *slowFirstWrite) Write(b []byte) (int, error) {
	c.once.Do(func() { time.Sleep(c.d) })
	return c.Conn.Write(b)
}

// TestFailedHandshakeNotSent: a call that needs a new connection whose
// handshake (HELLO) fails never sent its script, whether the handshake was
// written after the call's time was up (a healthy server) or went to a
// stopped server (SIGSTOP: the kernel accepts, nothing answers). go-redis
// hands back the bare cause of such a failure (an i/o timeout, unwrapped
// from its *net.OpError): ErrUnavailable without ErrReplyLost, and the key
// untouched. The breaker opens in both cases: the two cannot be told
// apart, and a stopped server must not make every caller wait.
func TestFailedHandshakeNotSent(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	lim := throttle.PerSecond(10, 5)
	check := func(t *testing.T, srv *redistest.Server, prefix string, err error, log *nodeLog) {
		t.Helper()
		t.Logf("%v; breaker changes %v", err, log.getNodes())
		require.ErrorIs(t, err, throttle.ErrUnavailable)
		require.NotErrorIs(t, err, throttle.ErrReplyLost, "only the handshake was sent")
		n, err := srv.Client(t).Exists(ctx, prefix+"k").Result()
		require.NoError(t, err)
		require.Zero(t, n, "the script never ran")
		require.Equal(t, []nodeChange{{srv.Addr, true}}, log.getNodes())
	}
	t.Run("late HELLO", func(t *testing.T) {
		t.Parallel()
		srv := redistest.Start(t)
		o := srv.Options()
		o.Dialer = func(ctx context.Context, network, addr string) (net.Conn, error) {
			c, err := (&net.Dialer{}).DialContext(ctx, network, addr)
			if err != nil {
				return nil, err
			}
			return &slowFirstWrite{Conn: c, d: 80 * time.Millisecond}, nil // past the 50ms timeout
		}
		rdb := redis.NewClient(o)
		t.Cleanup(func() { _ = rdb.Close() })
		log := &nodeLog{}
		prefix := redistest.Prefix(t)
		eng, err := throttle.New(rdb, throttle.WithPrefix(prefix), throttle.WithObserver(log))
		require.NoError(t, err)
		_, err = eng.Allow(ctx, "k", lim)
		check(t, srv, prefix, err, log)
	})
	t.Run("stopped server", func(t *testing.T) {
		t.Parallel()
		srv := redistest.Start(t)
		log := &nodeLog{}
		prefix := redistest.Prefix(t)
		eng, err := throttle.New(srv.Client(t), throttle.WithPrefix(prefix), throttle.WithObserver(log))
		require.NoError(t, err)
		require.NoError(t, syscall.Kill(srv.Pid(), syscall.SIGSTOP))
		t.Cleanup(func() { _ = syscall.Kill(srv.Pid(), syscall.SIGCONT) })
		_, err = eng.Allow(ctx, "k", lim)
		require.NoError(t, syscall.Kill(srv.Pid(), syscall.SIGCONT))
		check(t, srv, prefix, err, log)
	})
}

// TestBlockingCommandsDoNotOpenBreaker: blocking commands of the user's
// own (BLPOP) on the engine's client hold every pooled connection. The
// limiter's calls on the same client wait for a connection: they may fail
// (the client is saturated, a pool too small for its blocking work), as
// ErrUnavailable, without ErrReplyLost unless the call had its turn just
// before its timeout and was sent; and the healthy node's breaker never
// opens, so a fallback is never handed the limit. (This was
// TestLeaseWaitersDoNotOpenBreaker, whose lease waiters, one blocking read
// per key, held the pool; since 83dbfce a process's lease waiters on a
// single node share one read, and cannot.)
func TestBlockingCommandsDoNotOpenBreaker(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	o := srv.Options()
	o.PoolSize = 4
	rdb := redis.NewClient(o)
	t.Cleanup(func() { _ = rdb.Close() })
	log := &nodeLog{}
	prefix := redistest.Prefix(t)
	eng, err := throttle.New(rdb, throttle.WithPrefix(prefix), throttle.WithObserver(log))
	require.NoError(t, err)
	ctx := context.Background()
	lim := throttle.PerSecond(1000, 1000)
	redistest.UntilOK(t, func() error { _, err := eng.Allow(ctx, "warm", lim); return err })
	var wg sync.WaitGroup
	// The blocking commands last until the limiter calls are done.
	wctx, stopBlocking := context.WithTimeout(ctx, 30*time.Second)
	defer stopBlocking()
	for i := range o.PoolSize {
		wg.Add(1)
		go func() {
			defer wg.Done()
			_ = rdb.BLPop(wctx, 25*time.Second, prefix+"pushed-at-end-"+string(rune('a'+i))).Err()
		}()
	}
	// Blocked once they hold every connection.
	deadline := time.Now().Add(10 * time.Second)
	for ps := rdb.PoolStats(); ps.TotalConns-ps.IdleConns < uint32(o.PoolSize); ps = rdb.PoolStats() {
		require.True(t, time.Now().Before(deadline), "the blocking commands never took the pool: %+v", ps)
		time.Sleep(time.Millisecond)
	}
	failed, lost := 0, 0
	for range 20 {
		if _, err := eng.Allow(ctx, "k", lim); err != nil {
			failed++
			require.ErrorIs(t, err, throttle.ErrUnavailable)
			if errors.Is(err, throttle.ErrReplyLost) {
				// A call that had its turn in the pool only just before
				// its timeout was sent, and its reply came too late.
				var op *net.OpError
				require.True(t, errors.As(err, &op) && op.Op == "read", "a lost reply is a read that timed out: %v", err)
				lost++
			}
		}
		time.Sleep(20 * time.Millisecond)
	}
	stopBlocking()
	push := srv.Client(t) // ends the blocking commands
	for i := range o.PoolSize {
		require.NoError(t, push.RPush(ctx, prefix+"pushed-at-end-"+string(rune('a'+i)), "x").Err())
	}
	wg.Wait()
	t.Logf("limiter calls failed: %d of 20 (%d of them sent, the reply late); node breaker changes %v", failed, lost, log.getNodes())
	require.Empty(t, log.getNodes(), "blocking commands on the engine's client opened the breaker of a healthy Redis")
}

// blackhole returns the address of a loopback listener whose accept queue
// is full and never drained: a new connection to it is never accepted (the
// kernel drops its SYNs), as with a host that went away.
func blackhole(t *testing.T) string {
	t.Helper()
	fd, err := syscall.Socket(syscall.AF_INET, syscall.SOCK_STREAM, 0)
	require.NoError(t, err)
	t.Cleanup(func() { _ = syscall.Close(fd) })
	require.NoError(t, syscall.Bind(fd, &syscall.SockaddrInet4{Addr: [4]byte{127, 0, 0, 1}}))
	require.NoError(t, syscall.Listen(fd, 0))
	sa, err := syscall.Getsockname(fd)
	require.NoError(t, err)
	addr := (&net.TCPAddr{IP: net.IPv4(127, 0, 0, 1), Port: sa.(*syscall.SockaddrInet4).Port}).String()
	for i := 0; ; i++ {
		c, err := net.DialTimeout("tcp", addr, 200*time.Millisecond)
		if err != nil {
			require.True(t, errors.Is(err, context.DeadlineExceeded) || isTimeout(err), "want a dial that hangs: %v", err)
			return addr
		}
		t.Cleanup(func() { _ = c.Close() })
		require.Less(t, i, 64, "the accept queue never filled")
	}
}

func isTimeout(err error) bool {
	var ne net.Error
	return errors.As(err, &ne) && ne.Timeout()
}

// TestDialHangOpensBreaker is the other side of TestPoolWaitIsNotRedisDown:
// a call that waits inside the client for a connection that cannot be made
// (a dial that hangs: a host gone without a reset) says the node is down.
// Its breaker opens, and the error does not claim a lost reply: nothing
// was sent.
func TestDialHangOpensBreaker(t *testing.T) {
	t.Parallel()
	addr := blackhole(t)
	rdb := redis.NewClient(&redis.Options{Addr: addr, ContextTimeoutEnabled: true, MaxRetries: -1, PoolSize: 2})
	t.Cleanup(func() { _ = rdb.Close() })
	log := &nodeLog{}
	eng, err := throttle.New(rdb, throttle.WithObserver(log), throttle.WithProbeBackoff(time.Minute, time.Minute))
	require.NoError(t, err)
	_, err = eng.Allow(context.Background(), "k", throttle.PerSecond(10, 5))
	t.Logf("a call whose dial hangs: %v", err)
	require.ErrorIs(t, err, throttle.ErrUnavailable)
	require.NotErrorIs(t, err, throttle.ErrReplyLost, "nothing was sent")
	require.Equal(t, []nodeChange{{addr, true}}, log.getNodes(), "the node's breaker opened")
}
