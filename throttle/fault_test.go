package throttle_test

import (
	"context"
	"errors"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/slotbook/slotbook/internal/redistest"
	"github.com/slotbook/slotbook/throttle"
)

// breakerLog records breaker changes.
type breakerLog struct {
	nopObserverForTest
	mu      sync.Mutex // guards changes
	changes []bool
}

func (b *breakerLog) ObserveBreaker(open bool) {
	b.mu.Lock()
	b.changes = append(b.changes, open)
	b.mu.Unlock()
}

func (b *breakerLog) get() []bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	return append([]bool(nil), b.changes...)
}

type nopObserverForTest struct{}

func (nopObserverForTest) ObserveDecision(string, throttle.Outcome, time.Duration) {}
func (nopObserverForTest) ObserveCall(string, time.Duration, error)                {}
func (nopObserverForTest) ObserveRefund(string, time.Duration)                     {}

// TestPausedRedis: with the server stopped (SIGSTOP), a call gives up at its
// timeout with ErrUnavailable, the breaker opens and later calls fail at
// once; after SIGCONT a probe restores shared limiting within a second.
func TestPausedRedis(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	rdb := srv.Client(t)
	log := &breakerLog{}
	eng, err := throttle.New(rdb, throttle.WithPrefix(redistest.Prefix(t)), throttle.WithObserver(log))
	require.NoError(t, err)
	ctx := context.Background()
	_, err = eng.Allow(ctx, "k", tenPerSecond)
	require.NoError(t, err)

	require.NoError(t, syscall.Kill(srv.Pid(), syscall.SIGSTOP))
	var slowest time.Duration
	deadline := time.Now().Add(time.Second)
	calls := 0
	for time.Now().Before(deadline) {
		start := time.Now()
		_, err := eng.Allow(ctx, "k", tenPerSecond)
		slowest = max(slowest, time.Since(start))
		require.ErrorIs(t, err, throttle.ErrUnavailable)
		calls++
		time.Sleep(time.Millisecond)
	}
	t.Logf("%d calls while paused, slowest %v", calls, slowest)
	require.Less(t, slowest, throttle.DefaultTimeout+20*time.Millisecond, "no call waits past its timeout")
	require.Greater(t, calls, 100, "the breaker makes most calls fail at once")
	open, _ := eng.Unavailable()
	require.True(t, open)

	require.NoError(t, syscall.Kill(srv.Pid(), syscall.SIGCONT))
	resumed := time.Now()
	for {
		_, err := eng.Allow(ctx, "k", tenPerSecond)
		if err == nil {
			break
		}
		require.ErrorIs(t, err, throttle.ErrUnavailable)
		require.Less(t, time.Since(resumed), time.Second, "shared limiting back within 1 s")
		time.Sleep(time.Millisecond)
	}
	t.Logf("back after %v", time.Since(resumed))
	require.Equal(t, []bool{true, false}, log.get(), "breaker opened once and closed once")
}

// TestKilledRedisRestarted: calls fail fast while the server is gone, and
// after a restart on the same port (empty script cache) the first call
// succeeds: NOSCRIPT never reaches the caller.
func TestKilledRedisRestarted(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	rdb := srv.Client(t)
	eng, err := throttle.New(rdb, throttle.WithPrefix(redistest.Prefix(t)))
	require.NoError(t, err)
	ctx := context.Background()
	require.NoError(t, eng.Load(ctx))
	_, err = eng.Allow(ctx, "k", tenPerSecond)
	require.NoError(t, err)

	require.NoError(t, syscall.Kill(srv.Pid(), syscall.SIGKILL))
	for i := 0; i < 50; i++ {
		start := time.Now()
		_, err := eng.Allow(ctx, "k", tenPerSecond)
		require.ErrorIs(t, err, throttle.ErrUnavailable)
		require.Less(t, time.Since(start), throttle.DefaultTimeout+20*time.Millisecond)
	}
	srv.Restart(t)
	back := time.Now()
	require.Eventually(t, func() bool {
		_, err := eng.Allow(ctx, "k", tenPerSecond)
		if err != nil && !errors.Is(err, throttle.ErrUnavailable) {
			t.Errorf("after restart: %v", err)
		}
		return err == nil
	}, time.Second, time.Millisecond, "shared limiting back within 1 s")
	t.Logf("back %v after the restart", time.Since(back))
	require.NoError(t, rdb.ScriptFlush(ctx).Err())
	_, err = eng.Allow(ctx, "k", tenPerSecond)
	require.NoError(t, err, "SCRIPT FLUSH: the script is sent again")
}

// TestScriptErrorIsNotUnavailable: an error reply from Redis is an error,
// not an outage, and does not open the breaker.
func TestScriptErrorIsNotUnavailable(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	ctx := context.Background()
	require.NoError(t, e.rdb.HSet(ctx, e.prefix+"k", "a", 1).Err())
	_, err := e.eng.Allow(ctx, "k", tenPerSecond)
	require.Error(t, err)
	require.NotErrorIs(t, err, throttle.ErrUnavailable)
	open, _ := e.eng.Unavailable()
	require.False(t, open)
}

// TestCallerCancelIsNotUnavailable: a caller giving up is not Redis's
// fault.
func TestCallerCancelIsNotUnavailable(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	_, err := e.eng.Allow(ctx, "k", tenPerSecond)
	require.ErrorIs(t, err, context.Canceled)
	open, _ := e.eng.Unavailable()
	require.False(t, open)
}
