package reserve_test

import (
	"context"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/slotbook/slotbook/internal/callcount"
	"github.com/slotbook/slotbook/internal/redistest"
	"github.com/slotbook/slotbook/reserve"
	"github.com/slotbook/slotbook/throttle"
)

// TestPausedServerCallsQueuedFailFast: the limiter's Redis is stopped
// (SIGSTOP: connections accepted, no answer) for 1.5 s while 2,000
// goroutines call Allow with FailOpen. Once the breaker is open, callers
// that queued for a connection before it opened must not go to the
// stopped server one pool's worth at a time, each paying the timeout (the
// review saw 2,001 calls sent and a caller wait 5.2 s): with probes a
// minute apart, no more calls reach the server than the pool has
// connections. Latency is logged, not judged (a busy machine).
func TestPausedServerCallsQueuedFailFast(t *testing.T) {
	srv := redistest.Start(t)
	rdb := srv.Client(t)
	sentTo := callcount.Attach(rdb) // the calls that went past the breaker and the gate
	co := &outcomes{}
	eng, err := throttle.New(rdb, throttle.WithPrefix(redistest.Prefix(t)), throttle.WithObserver(co),
		throttle.WithProbeBackoff(time.Minute, time.Minute))
	require.NoError(t, err)
	l, err := reserve.New(eng, "api", throttle.PerSecond(10, 5), reserve.WithFallback(reserve.FailOpen()))
	require.NoError(t, err)
	redistest.UntilOK(t, func() error { _, err := l.Allow(context.Background(), "warm"); return err })
	warm := sentTo.Load()

	var maxLat, calls atomic.Int64
	var wg sync.WaitGroup
	start := time.Now()
	stop := start.Add(1500 * time.Millisecond)
	require.NoError(t, syscall.Kill(srv.Pid(), syscall.SIGSTOP))
	t.Cleanup(func() { _ = syscall.Kill(srv.Pid(), syscall.SIGCONT) })
	for range 2000 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for time.Now().Before(stop) {
				t0 := time.Now()
				_, _ = l.Allow(context.Background(), "k")
				d := int64(time.Since(t0))
				calls.Add(1)
				for old := maxLat.Load(); d > old && !maxLat.CompareAndSwap(old, d); old = maxLat.Load() {
				}
				time.Sleep(10 * time.Millisecond)
			}
		}()
	}
	wg.Wait()
	require.NoError(t, syscall.Kill(srv.Pid(), syscall.SIGCONT))
	sent := sentTo.Load() - warm
	pool := rdb.Options().PoolSize
	t.Logf("Redis stopped for %v: %d Allow calls, longest %v; %d calls sent to the stopped server (pool of %d); %v",
		time.Since(start), calls.Load(), time.Duration(maxLat.Load()), sent, pool, co)
	require.Equal(t, int64(1), co.opens.Load(), "the breaker opened, once")
	require.LessOrEqual(t, sent, int64(pool), "calls queued for a connection went to the stopped server after the breaker opened")
}
