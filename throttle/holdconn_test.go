package throttle_test

import (
	"context"
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
}

// TestHoldConnUnknownPool: for a client whose pool size the engine does
// not know (a Ring), HoldConn holds nothing and always lets the command
// go.
func TestHoldConnUnknownPool(t *testing.T) {
	e := newEnv(t)
	ring := redis.NewRing(&redis.RingOptions{Addrs: map[string]string{"a": e.srv.Addr}, ContextTimeoutEnabled: true})
	t.Cleanup(func() { _ = ring.Close() })
	eng, err := throttle.New(ring, throttle.WithPrefix(e.prefix))
	require.NoError(t, err)
	for range 20 {
		release, ok := eng.HoldConn(context.Background(), "{k}:block")
		require.True(t, ok)
		defer release()
	}
}
