package throttle_test

import (
	"context"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/slotbook/slotbook/internal/redistest"
	"github.com/slotbook/slotbook/throttle"
)

// TestSlowLinkProbeReconnects: a round trip of 40 ms (a proxy adding 20 ms
// each way) under the engine's default 50 ms timeout. A call on a pooled
// connection fits in the timeout; one that must first dial and say HELLO
// (two round trips more) cannot, and a call that times out costs its
// connection. With every connection dropped (Sever) the breaker opens, and
// its probe must still be able to reconnect and succeed, so that the
// breaker closes again and calls are served: the probe's longer timeout
// covers a reconnect. The test then checks that, once the probe has left
// a connection in the pool, most calls of a steady caller are served.
func TestSlowLinkProbeReconnects(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	p := redistest.NewProxy(t, srv.Addr)
	p.SetLatency(20 * time.Millisecond)
	rdb := p.Client(t, srv)
	log := &nodeLog{}
	eng, err := throttle.New(rdb, throttle.WithPrefix(redistest.Prefix(t)), throttle.WithObserver(log))
	require.NoError(t, err)
	ctx := context.Background()
	lim := throttle.PerSecond(1000, 1000)
	redistest.UntilOK(t, func() error { _, err := eng.Allow(ctx, "warm", lim); return err })

	// A control: a call on the warm connection fits in the timeout.
	_, err = eng.Allow(ctx, "k", lim)
	t.Logf("a call on a warm connection: %v", err)

	// Every connection dropped: the next calls must dial. Several
	// callers at once, as under load.
	p.Sever()
	var wg sync.WaitGroup
	var failed atomic.Int64
	for range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if _, err := eng.Allow(ctx, "k", lim); err != nil {
				failed.Add(1)
			}
		}()
	}
	wg.Wait()
	t.Logf("after the connections were dropped: %d of 8 calls failed; node changes %v", failed.Load(), log.getNodes())

	// Until the breaker is closed again, or 3 s (DefaultProbeMax is
	// 400 ms: several probes).
	deadline := time.Now().Add(3 * time.Second)
	served, calls := 0, 0
	for time.Now().Before(deadline) {
		calls++
		if _, err := eng.Allow(ctx, "k", lim); err == nil {
			served++
			if open, _ := eng.Unavailable(); !open {
				break
			}
		}
		time.Sleep(10 * time.Millisecond)
	}
	open, _ := eng.Unavailable()
	t.Logf("then: %d of %d calls served; breaker open %v; node changes %v", served, calls, open, log.getNodes())
	require.False(t, open, "the breaker never closed again: its probes could not reconnect within their timeout")
	require.Positive(t, served)

	served, calls = 0, 50
	for range calls {
		if _, err := eng.Allow(ctx, "k", lim); err == nil {
			served++
		}
		time.Sleep(10 * time.Millisecond)
	}
	t.Logf("a steady caller after recovery: %d of %d calls served", served, calls)
}
