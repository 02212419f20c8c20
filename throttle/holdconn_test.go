package throttle_test

import (
	"context"
	"runtime"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/slotbook/slotbook/internal/redistest"
	"github.com/slotbook/slotbook/throttle"
)

// TestHoldConnBoundsBlockingCommands: blocking commands may hold at most
// half the client's pool through HoldConn, and while they hold it the
// engine's calls queue for the connections left instead of timing out on
// a pool the blocking commands emptied.
func TestHoldConnBoundsBlockingCommands(t *testing.T) {
	e := newEnv(t)
	proxy := redistest.NewProxy(t, e.srv.Addr)
	proxy.SetReplyDelay(150 * time.Millisecond)
	rdb := proxy.Client(t, e.srv, func(o *redis.Options) { o.PoolSize = 4 })
	// A timeout under two round trips: a call that waited inside it for
	// one of the client's connections, behind another call, would fail.
	eng, err := throttle.New(rdb, throttle.WithPrefix(e.prefix), throttle.WithTimeout(250*time.Millisecond))
	require.NoError(t, err)
	ctx := context.Background()
	// Warm up: four connections dialled, the scripts loaded, so that
	// every call below is one round trip.
	require.NoError(t, e.eng.Load(ctx)) // on the server: directly, not through the proxy
	var warm sync.WaitGroup
	for range 4 {
		warm.Add(1)
		go func() { defer warm.Done(); _ = rdb.Ping(ctx).Err() }()
	}
	warm.Wait()

	var releases []func()
	for i := range 2 {
		release, ok := eng.HoldConn(ctx, "{k}:block")
		require.True(t, ok, "hold %d of a pool of 4", i+1)
		releases = append(releases, release)
	}
	_, ok := eng.HoldConn(ctx, "{k}:block")
	require.False(t, ok, "a third hold of a pool of 4")

	// Each hold blocks a connection for 1.5 s, six times the engine's
	// timeout, while 20 calls of 150 ms each go out on the other two.
	var wg sync.WaitGroup
	for _, release := range releases {
		wg.Add(1)
		go func() {
			defer wg.Done()
			defer release()
			if err := rdb.BLPop(ctx, 1500*time.Millisecond, e.prefix+"{k}:nothing").Err(); err != redis.Nil {
				t.Errorf("BLPOP: %v, want redis.Nil", err)
			}
		}()
	}
	time.Sleep(100 * time.Millisecond) // the BLPOPs have their connections
	errs := make(chan error, 20)
	for range cap(errs) {
		wg.Add(1)
		go func() {
			defer wg.Done()
			_, err := eng.Allow(ctx, "calls", throttle.PerSecond(1000, 1000))
			errs <- err
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		require.NoError(t, err)
	}

	release, ok := eng.HoldConn(ctx, "{k}:block")
	require.True(t, ok, "a hold once the others are released")
	release()
	release() // a second release gives back nothing it does not hold
	for i := range 2 {
		release, ok := eng.HoldConn(ctx, "{k}:block")
		require.True(t, ok, "hold %d after a release called twice", i+1)
		defer release()
	}
	_, ok = eng.HoldConn(ctx, "{k}:block")
	require.False(t, ok, "a third hold after a release called twice")
}

// TestHoldConnRing: a Ring's calls are not gated, but its blocking
// commands are still bounded by half a shard's pool (go-redis's default
// pool when PoolSize is unset).
func TestHoldConnRing(t *testing.T) {
	e := newEnv(t)
	for _, tc := range []struct{ pool, holds int }{{4, 2}, {1, 0}, {0, 10 * runtime.GOMAXPROCS(0) / 2}} {
		ring := redis.NewRing(&redis.RingOptions{Addrs: map[string]string{"a": e.srv.Addr}, PoolSize: tc.pool, ContextTimeoutEnabled: true})
		t.Cleanup(func() { _ = ring.Close() })
		eng, err := throttle.New(ring, throttle.WithPrefix(e.prefix))
		require.NoError(t, err)
		var releases []func()
		for i := range tc.holds {
			release, ok := eng.HoldConn(context.Background(), "{k}:block")
			require.True(t, ok, "pool %d: hold %d", tc.pool, i+1)
			releases = append(releases, release)
		}
		_, ok := eng.HoldConn(context.Background(), "{k}:block")
		require.False(t, ok, "pool %d: a hold beyond half the pool", tc.pool)
		for _, release := range releases {
			release()
		}
		if tc.holds > 0 {
			release, ok := eng.HoldConn(context.Background(), "{k}:block")
			require.True(t, ok, "pool %d: a hold once the others are released", tc.pool)
			release()
		}
	}
}
