package throttle_test

import (
	"context"
	"errors"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/slotbook/slotbook/internal/callcount"
	"github.com/slotbook/slotbook/internal/redistest"
	"github.com/slotbook/slotbook/throttle"
)

// TestQueuedCallsFailFastOnceOpen: with the server stopped (SIGSTOP: it
// accepts, never answers), 40 callers call at once through a pool of 2.
// The first two go out and time out, which opens the breaker; the others,
// queued at the engine's gate for a connection, must then fail at once
// when they get one, not go to the stopped server two at a time, each
// paying the timeout. With probes a minute apart, no more than the pool's
// two calls reach the server.
func TestQueuedCallsFailFastOnceOpen(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	o := srv.Options()
	o.PoolSize = 2
	rdb := redis.NewClient(o)
	t.Cleanup(func() { _ = rdb.Close() })
	sentTo := callcount.Attach(rdb) // the calls that went past the breaker and the gate
	log := &nodeLog{}
	eng, err := throttle.New(rdb, throttle.WithPrefix(redistest.Prefix(t)), throttle.WithObserver(log),
		throttle.WithProbeBackoff(time.Minute, time.Minute))
	require.NoError(t, err)
	ctx := context.Background()
	lim := throttle.PerSecond(1000, 1000)
	redistest.UntilOK(t, func() error { _, err := eng.Allow(ctx, "warm", lim); return err })
	warm := sentTo.Load()

	require.NoError(t, syscall.Kill(srv.Pid(), syscall.SIGSTOP))
	t.Cleanup(func() { _ = syscall.Kill(srv.Pid(), syscall.SIGCONT) })
	const callers = 40
	var wg sync.WaitGroup
	errs := make([]error, callers)
	start := make(chan struct{})
	for i := range callers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			<-start
			_, errs[i] = eng.Allow(ctx, "k", lim)
		}()
	}
	close(start)
	wg.Wait()
	require.NoError(t, syscall.Kill(srv.Pid(), syscall.SIGCONT))
	sent := sentTo.Load() - warm
	t.Logf("%d callers, pool of %d, server stopped: %d calls sent to it; node changes %v", callers, o.PoolSize, sent, log.getNodes())
	for _, err := range errs {
		require.ErrorIs(t, err, throttle.ErrUnavailable)
	}
	require.Equal(t, []nodeChange{{srv.Addr, true}}, log.getNodes(), "the breaker opened, once")
	require.LessOrEqual(t, sent, int64(o.PoolSize), "calls queued for a connection went to the stopped server after the breaker opened")
}

// TestLateFailureKeepsProbeTime: a call sent before the breaker opened and
// failing after it (the server stopped, so it times out later than the
// call that opened the breaker) is not the probe: it must not put the next
// probe off. The next probe time (Unavailable's wait, read right after
// each call) stays where the first failure set it; before, the late
// failure moved it by as much as it came later.
func TestLateFailureKeepsProbeTime(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	rdb := srv.Client(t)
	const timeout = 200 * time.Millisecond
	eng, err := throttle.New(rdb, throttle.WithPrefix(redistest.Prefix(t)), throttle.WithTimeout(timeout),
		throttle.WithProbeBackoff(time.Minute, time.Minute))
	require.NoError(t, err)
	ctx := context.Background()
	lim := throttle.PerSecond(1000, 1000)
	// Two warm connections, so that neither call below dials.
	var wg sync.WaitGroup
	for range 2 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			redistest.UntilOK(t, func() error { _, err := eng.Allow(ctx, "warm", lim); return err })
		}()
	}
	wg.Wait()

	require.NoError(t, syscall.Kill(srv.Pid(), syscall.SIGSTOP))
	t.Cleanup(func() { _ = syscall.Kill(srv.Pid(), syscall.SIGCONT) })
	type result struct {
		err  error
		end  time.Time
		next time.Time // when the next probe may go, as Unavailable said right after
	}
	call := func() result {
		_, err := eng.Allow(ctx, "k", lim)
		end := time.Now()
		open, in := eng.Unavailable()
		require.True(t, open)
		return result{err, end, time.Now().Add(in)}
	}
	var first, late result
	wg.Add(2)
	go func() { defer wg.Done(); first = call() }()
	go func() {
		defer wg.Done()
		time.Sleep(timeout / 2) // sent while the breaker is still closed
		late = call()
	}()
	wg.Wait()
	require.NoError(t, syscall.Kill(srv.Pid(), syscall.SIGCONT))
	t.Logf("first failure: %v; late one (%v later): %v", first.err, late.end.Sub(first.end), late.err)
	require.ErrorIs(t, first.err, throttle.ErrReplyLost, "timed out on the stopped server")
	if !errors.Is(late.err, throttle.ErrReplyLost) {
		t.Skipf("the late call was not sent before the breaker opened (a busy machine): %v", late.err)
	}
	gap := late.end.Sub(first.end)
	moved := late.next.Sub(first.next)
	t.Logf("the next probe moved by %v (the late failure came %v after the first)", moved, gap)
	require.Less(t, moved.Abs(), gap/2, "a failure while the breaker was open put the next probe off")
}

// TestProbeUnderWayNotDue: while the probe of an open breaker is under way
// (a stopped server: it waits out four timeouts), Unavailable and
// UnavailableFor say the next probe is at least the shortest probe
// interval away. They said 0 (the probe was due when it left), and
// FailClosed's retry-after then sent callers round again at once (found
// by review).
func TestProbeUnderWayNotDue(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	const timeout, probeMin = 250 * time.Millisecond, 25 * time.Millisecond
	rdb := srv.Client(t)
	sent := callcount.Attach(rdb)
	eng, err := throttle.New(rdb, throttle.WithPrefix(redistest.Prefix(t)), throttle.WithTimeout(timeout),
		throttle.WithProbeBackoff(probeMin, probeMin))
	require.NoError(t, err)
	ctx := context.Background()
	lim := throttle.PerSecond(1000, 1000)
	redistest.UntilOK(t, func() error { _, err := eng.Allow(ctx, "k", lim); return err })
	require.NoError(t, syscall.Kill(srv.Pid(), syscall.SIGSTOP))
	t.Cleanup(func() { _ = syscall.Kill(srv.Pid(), syscall.SIGCONT) })
	_, err = eng.Allow(ctx, "k", lim) // times out: the breaker opens
	require.ErrorIs(t, err, throttle.ErrUnavailable)
	time.Sleep(2 * probeMin) // the probe is due
	before := sent.Load()
	probed := make(chan error, 1)
	go func() { _, err := eng.Allow(ctx, "k", lim); probed <- err }() // the probe: up to four timeouts
	require.Eventually(t, func() bool { return sent.Load() > before }, 10*time.Second, time.Millisecond, "the probe sent")
	open, in := eng.Unavailable()
	openFor, inFor := eng.UnavailableFor(ctx, "k")
	t.Logf("while the probe is under way: Unavailable %v %v, UnavailableFor %v %v", open, in, openFor, inFor)
	require.True(t, open)
	require.True(t, openFor)
	require.GreaterOrEqual(t, in, probeMin)
	require.GreaterOrEqual(t, inFor, probeMin)
	require.ErrorIs(t, <-probed, throttle.ErrUnavailable)
}
