package throttle_test

import (
	"context"
	"errors"
	"slices"
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

// outage is how long TestPausedRedis keeps the server stopped while it
// calls. A call without the engine's timeout would wait on a stopped
// server for longer than that (until go-redis's own 3 s read timeout).
const outage = time.Second

// failFast checks the durations of calls made while Redis was down,
// without a wall-clock bound a busy machine cannot keep: none waited
// anywhere near what a call without the engine's timeout would (half the
// outage, ten times the timeout, is far below it), and most (more than
// half) took well under the timeout: refused by the open breaker (or the
// kernel) rather than waiting for the server.
func failFast(t *testing.T, durations []time.Duration) {
	t.Helper()
	require.NotEmpty(t, durations)
	fast := 0
	for _, d := range durations {
		if d < throttle.DefaultTimeout/2 {
			fast++
		}
	}
	slowest := slices.Max(durations)
	t.Logf("%d calls while down, %d under half the timeout, slowest %v", len(durations), fast, slowest)
	require.Less(t, slowest, outage/2, "a call waited for the server instead of its timeout")
	require.Greater(t, 2*fast, len(durations), "most calls must fail much faster than the timeout")
}

// backWithin calls until shared limiting is back, failing the test if it
// is not within d: the next probe of an open breaker is at most
// DefaultProbeMax away, so d leaves a busy machine plenty of room while
// still failing a breaker that never closes. It returns how long it took.
func backWithin(t *testing.T, eng *throttle.Engine, d time.Duration) time.Duration {
	t.Helper()
	ctx := context.Background()
	start := time.Now()
	for {
		_, err := eng.Allow(ctx, "k", tenPerSecond)
		if err == nil {
			return time.Since(start)
		}
		require.ErrorIs(t, err, throttle.ErrUnavailable)
		require.Less(t, time.Since(start), d, "shared limiting not back: the breaker never let a probe succeed")
		time.Sleep(time.Millisecond)
	}
}

// maxSent is how many calls at most reach a stopped server within d of
// the first one, with the default timeout and probe backoff: the first
// call, failing after the timeout, then one probe after each backoff
// (DefaultProbeMin, doubling up to DefaultProbeMax), each failing after at
// least the timeout too (a probe may be given longer, which only spaces
// them further; so does a busy machine).
func maxSent(d time.Duration) int {
	n, at, backoff := 1, throttle.DefaultTimeout, throttle.DefaultProbeMin
	for at+backoff < d {
		n++
		at += backoff + throttle.DefaultTimeout
		backoff = min(2*backoff, throttle.DefaultProbeMax)
	}
	return n
}

// TestPausedRedis: with the server stopped (SIGSTOP), a call gives up at its
// timeout with ErrUnavailable, the breaker opens and later calls fail at
// once, one probe at a time reaching the server; after SIGCONT the next
// probe (due within DefaultProbeMax) restores shared limiting.
func TestPausedRedis(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	rdb := srv.Client(t)
	log := &breakerLog{}
	eng, err := throttle.New(rdb, throttle.WithPrefix(redistest.Prefix(t)), throttle.WithObserver(log))
	require.NoError(t, err)
	ctx := context.Background()
	redistest.UntilOK(t, func() error { _, err := eng.Allow(ctx, "k", tenPerSecond); return err })
	before := len(log.get()) // the warm-up may have opened and closed the breaker

	require.NoError(t, syscall.Kill(srv.Pid(), syscall.SIGSTOP))
	var durations []time.Duration
	sent := 0 // calls that reached the stopped server: the first, then probes
	deadline := time.Now().Add(outage)
	for time.Now().Before(deadline) {
		start := time.Now()
		_, err := eng.Allow(ctx, "k", tenPerSecond)
		durations = append(durations, time.Since(start))
		require.ErrorIs(t, err, throttle.ErrUnavailable)
		if errors.Is(err, throttle.ErrReplyLost) {
			sent++
		}
		time.Sleep(time.Millisecond)
	}
	failFast(t, durations)
	// The breaker lets one probe at a time through, once its backoff has
	// passed: a busy machine only spaces them further apart.
	t.Logf("%d of %d calls reached the stopped server", sent, len(durations))
	require.Positive(t, sent)
	require.LessOrEqual(t, sent, maxSent(outage), "calls reaching the stopped server: the breaker must hold the others back")
	open, probeIn := eng.Unavailable()
	require.True(t, open)
	require.LessOrEqual(t, probeIn, throttle.DefaultProbeMax, "next probe due within the backoff's cap")

	require.NoError(t, syscall.Kill(srv.Pid(), syscall.SIGCONT))
	t.Logf("back after %v", backWithin(t, eng, probeIn+2*time.Second))
	require.Equal(t, []bool{true, false}, log.get()[before:], "breaker opened once and closed once")
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
	redistest.UntilOK(t, func() error { return eng.Load(ctx) })
	redistest.UntilOK(t, func() error { _, err := eng.Allow(ctx, "k", tenPerSecond); return err })

	require.NoError(t, syscall.Kill(srv.Pid(), syscall.SIGKILL))
	var durations []time.Duration
	for i := 0; i < 50; i++ {
		start := time.Now()
		_, err := eng.Allow(ctx, "k", tenPerSecond)
		durations = append(durations, time.Since(start))
		require.ErrorIs(t, err, throttle.ErrUnavailable)
	}
	failFast(t, durations)
	srv.Restart(t)
	open, probeIn := eng.Unavailable()
	require.True(t, open)
	require.LessOrEqual(t, probeIn, throttle.DefaultProbeMax, "next probe due within the backoff's cap")
	// backWithin fails on any error but ErrUnavailable: NOSCRIPT never
	// reaches the caller.
	t.Logf("back %v after the restart", backWithin(t, eng, probeIn+2*time.Second))
	require.NoError(t, rdb.ScriptFlush(ctx).Err())
	// SCRIPT FLUSH: the script is sent again (a NOSCRIPT error would fail
	// backWithin; a missed 50ms timeout, which a busy machine may cause,
	// only delays it).
	backWithin(t, eng, throttle.DefaultProbeMax+2*time.Second)
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
