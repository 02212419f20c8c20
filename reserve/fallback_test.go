package reserve_test

import (
	"context"
	"errors"
	"fmt"
	"net"
	"slices"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/slotbook/slotbook/internal/redistest"
	"github.com/slotbook/slotbook/reserve"
	"github.com/slotbook/slotbook/throttle"
)

// outage starts a server of the test's own, returns an engine on it (with
// the default 50ms timeout, which these tests are about), and a function
// that kills the server.
func outage(t *testing.T) (*throttle.Engine, *redistest.Server, func()) {
	t.Helper()
	srv := redistest.Start(t)
	eng, err := throttle.New(srv.Client(t), throttle.WithPrefix(redistest.Prefix(t)))
	require.NoError(t, err)
	redistest.UntilOK(t, func() error { return eng.Load(context.Background()) })
	return eng, srv, func() {
		require.NoError(t, syscall.Kill(srv.Pid(), syscall.SIGKILL))
		// Gone once it refuses connections (its sockets closed with it): no
		// call below waits on a server a busy machine is still tearing down.
		require.Eventually(t, func() bool {
			c, err := net.DialTimeout("tcp", srv.Addr, time.Second)
			if err == nil {
				c.Close()
			}
			return err != nil
		}, 10*time.Second, time.Millisecond, "the killed server still accepts connections")
	}
}

// bookedByRedis reserves for key until Redis itself answers (a call that
// missed the timeout is answered by the fallback, or fails): the setup of a
// test that needs a working Redis first. A fallback's booking is given
// back.
func bookedByRedis(t *testing.T, l *reserve.Limiter) {
	t.Helper()
	ctx := context.Background()
	redistest.UntilOK(t, func() error {
		r, err := l.Reserve(ctx, "k")
		switch {
		case err != nil:
			return err
		case r.Fallback():
			_ = r.Cancel(ctx)
			return errors.New("answered by the fallback")
		}
		return nil
	})
}

func TestFallbackPolicies(t *testing.T) {
	t.Parallel()
	limit := throttle.PerSecond(10, 0)
	tests := []struct {
		name     string
		opts     []reserve.Option
		allowed  bool
		fallback bool
	}{
		{"no policy: an error", nil, false, false},
		{"fail open", []reserve.Option{reserve.WithFallback(reserve.FailOpen())}, true, true},
		{"fail closed", []reserve.Option{reserve.WithFallback(reserve.FailClosed())}, false, true},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			eng, _, kill := outage(t)
			l, err := reserve.New(eng, "api", limit, tc.opts...)
			require.NoError(t, err)
			ctx := context.Background()
			bookedByRedis(t, l)
			kill()
			killed := time.Now()
			var durations []time.Duration
			allowedChecks := 0
			for i := 0; i < 20; i++ {
				start := time.Now()
				r, err := l.Reserve(ctx, "k")
				durations = append(durations, time.Since(start))
				res, aerr := l.Allow(ctx, "k")
				if !tc.fallback {
					require.ErrorIs(t, err, throttle.ErrUnavailable)
					require.ErrorIs(t, aerr, throttle.ErrUnavailable)
					continue
				}
				require.NoError(t, err)
				require.NoError(t, aerr)
				require.True(t, r.Fallback())
				require.Equal(t, tc.allowed, r.OK())
				if res.Allowed {
					allowedChecks++
				}
				if !tc.allowed {
					require.ErrorIs(t, r.Err(), throttle.ErrUnavailable)
					var fe *reserve.FallbackError
					require.ErrorAs(t, r.Err(), &fe)
					require.ErrorIs(t, l.Acquire(ctx, "k"), throttle.ErrUnavailable)
				} else {
					// FailOpen enforces the whole limit in this process: a
					// slot now or one interval on, given back at once.
					require.LessOrEqual(t, r.Delay(), limit.Interval())
					require.NoError(t, r.Cancel(ctx))
				}
			}
			answeredAtOnce(t, durations)
			if tc.allowed {
				// 10/s burst 0 in this process: at most one check per
				// interval passes, never all 20.
				elapsed := time.Since(killed)
				require.LessOrEqual(t, allowedChecks, 2+int(elapsed/limit.Interval()), "checks passed locally in %v", elapsed)
			} else {
				require.Zero(t, allowedChecks)
			}
		})
	}
}

// answeredAtOnce checks the durations of calls made while Redis was down,
// without a wall-clock bound a busy machine cannot keep: none waited
// anywhere near what a call without the engine's timeout could (go-redis
// dials a refused address five times, 100ms apart, and reads for 3 s;
// half a second is far below that, and ten times the timeout), and most
// (more than half) took well under the timeout: answered at once by the
// open breaker, not after trying Redis.
func answeredAtOnce(t *testing.T, durations []time.Duration) {
	t.Helper()
	fast := 0
	for _, d := range durations {
		if d < throttle.DefaultTimeout/2 {
			fast++
		}
	}
	slowest := slices.Max(durations)
	t.Logf("%d calls while Redis was down, %d under half the timeout, slowest %v", len(durations), fast, slowest)
	require.Less(t, slowest, 500*time.Millisecond, "a call waited for Redis instead of its timeout")
	require.Greater(t, 2*fast, len(durations), "most calls must be answered much faster than the timeout")
}

// TestLocalShare: two processes heartbeat while Redis is up; during an
// outage one of them admits about half the limit, locally, and shared
// limiting returns once Redis does.
func TestLocalShare(t *testing.T) {
	t.Parallel()
	eng, srv, kill := outage(t)
	limit := throttle.PerSecond(100, 0)
	// Heartbeats every second, each kept three: the set below outlives any
	// stall of a busy machine between the two processes' heartbeats.
	l, err := reserve.New(eng, "api", limit, reserve.WithFallback(reserve.LocalShare(time.Second, 1, 100)))
	require.NoError(t, err)
	ctx := context.Background()
	// Another process of the same limiter heartbeats, and so does this one,
	// after a call Redis answered, on a goroutine of its own (once a second
	// at most). Call until that goroutine has taken the count of two in:
	// seeing both in Redis's set is not enough, since its reply may miss
	// the timeout or reach a goroutine a busy machine holds off the CPU.
	redistest.UntilOK(t, func() error {
		_, _ = eng.Heartbeat(ctx, "api", "other-process", time.Minute)
		bookedByRedis(t, l)
		if n := reserve.Instances(l); n != 2 {
			time.Sleep(10 * time.Millisecond)
			return fmt.Errorf("the local share divides by %d processes, not 2 yet", n)
		}
		return nil
	})

	kill()
	// Four callers keep asking for a second; a probe of Redis holds one of
	// them for up to the timeout, the others go on.
	start := time.Now()
	var (
		allowed   atomic.Int64
		mu        sync.Mutex    // guards retryMax
		retryMax  time.Duration // the longest retry-after, less its call's duration
		wg        sync.WaitGroup
		shareRate = 50.0                  // limit/instances, per second
		shareI    = 20 * time.Millisecond // its interval
	)
	for g := 0; g < 4; g++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for time.Since(start) < time.Second {
				called := time.Now()
				r, err := l.Allow(ctx, "k")
				took := time.Since(called)
				if err != nil {
					t.Error(err)
					return
				}
				if r.Allowed {
					allowed.Add(1)
				} else {
					mu.Lock()
					retryMax = max(retryMax, r.RetryAfter-took)
					mu.Unlock()
				}
				time.Sleep(500 * time.Microsecond)
			}
		}()
	}
	wg.Wait()
	elapsed := time.Since(start)
	t.Logf("local share admitted %d in %v (limit/instances = 50/s); longest retry-after %v (less its call's duration)",
		allowed.Load(), elapsed, retryMax)
	// Judged on the local share's own terms, whatever the machine's speed:
	// no more than its burst (1) plus its rate over the time the callers
	// asked, and a denied caller never told to wait more than one interval
	// of its rate (a smaller share would say longer) from some instant of
	// its call.
	require.LessOrEqual(t, float64(allowed.Load()), 1+shareRate*elapsed.Seconds(), "admitted beyond limit/instances")
	require.Greater(t, allowed.Load(), int64(1), "the local share admits past its burst")
	require.Positive(t, retryMax, "callers asking every half millisecond were denied in between")
	require.LessOrEqual(t, retryMax, shareI, "a denial's retry-after under limit/instances")

	// Reservations wait for their local slots, 20ms apart: exactly, if the
	// second was booked before the first's slot plus an interval (else the
	// second's slot is when it was booked, later still).
	r1, err := l.Reserve(ctx, "k")
	require.NoError(t, err)
	r2, err := l.Reserve(ctx, "k")
	booked2 := time.Now()
	require.NoError(t, err)
	require.True(t, r1.Fallback() && r2.Fallback())
	require.True(t, r1.OK() && r2.OK())
	gap := r2.SlotAt().Sub(r1.SlotAt())
	if booked2.Before(r1.SlotAt().Add(shareI)) {
		require.InDelta(t, float64(shareI), float64(gap), float64(time.Millisecond))
	} else {
		require.GreaterOrEqual(t, gap, shareI-time.Millisecond)
		require.LessOrEqual(t, gap, booked2.Sub(r1.SlotAt()))
	}
	require.NoError(t, r2.Cancel(ctx))
	require.NoError(t, r1.Cancel(ctx))

	srv.Restart(t)
	// The breaker's next probe is at most DefaultProbeMax away: it brings
	// shared limiting back, with room to spare for a busy machine.
	_, probeIn := eng.Unavailable()
	require.LessOrEqual(t, probeIn, throttle.DefaultProbeMax)
	back := time.Now()
	require.Eventually(t, func() bool {
		r, err := l.Reserve(ctx, "k")
		return err == nil && !r.Fallback()
	}, probeIn+throttle.DefaultProbeMax+5*time.Second, 10*time.Millisecond, "shared limiting back at the breaker's next probe (or the one after, should a busy machine make the first probe fail)")
	t.Logf("shared again %v after the restart", time.Since(back))
}

func TestFallbackBadInput(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	for name, f := range map[string]reserve.Fallback{
		"zero":                 {},
		"short interval":       reserve.LocalShare(time.Millisecond, 1, 10),
		"no instances assumed": reserve.LocalShare(time.Second, 0, 10),
		"no keys":              reserve.LocalShare(time.Second, 1, 0),
	} {
		if _, err := reserve.New(e.eng, "api", throttle.PerSecond(1, 0), reserve.WithFallback(f)); err == nil {
			t.Errorf("%s: New succeeded", name)
		}
	}
}
