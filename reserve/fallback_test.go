package reserve_test

import (
	"context"
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

// outage starts a server of the test's own, returns an engine on it, and a
// function that kills the server.
func outage(t *testing.T) (*throttle.Engine, *redistest.Server, func()) {
	t.Helper()
	srv := redistest.Start(t)
	eng, err := throttle.New(srv.Client(t), throttle.WithPrefix(redistest.Prefix(t)))
	require.NoError(t, err)
	require.NoError(t, eng.Load(context.Background()))
	return eng, srv, func() { require.NoError(t, syscall.Kill(srv.Pid(), syscall.SIGKILL)) }
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
			require.NoError(t, l.Acquire(ctx, "k"))
			kill()
			for i := 0; i < 20; i++ {
				start := time.Now()
				r, err := l.Reserve(ctx, "k")
				require.Less(t, time.Since(start), throttle.DefaultTimeout+20*time.Millisecond)
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
				require.Equal(t, tc.allowed, res.Allowed)
				if !tc.allowed {
					require.ErrorIs(t, r.Err(), throttle.ErrUnavailable)
					var fe *reserve.FallbackError
					require.ErrorAs(t, r.Err(), &fe)
					require.ErrorIs(t, l.Acquire(ctx, "k"), throttle.ErrUnavailable)
				} else {
					require.Zero(t, r.Delay())
					require.NoError(t, r.Cancel(ctx))
				}
			}
		})
	}
}

// TestLocalShare: two processes heartbeat while Redis is up; during an
// outage one of them admits about half the limit, locally, and shared
// limiting returns once Redis does.
func TestLocalShare(t *testing.T) {
	t.Parallel()
	eng, srv, kill := outage(t)
	limit := throttle.PerSecond(100, 0)
	l, err := reserve.New(eng, "api", limit, reserve.WithFallback(reserve.LocalShare(50*time.Millisecond, 1, 100)))
	require.NoError(t, err)
	ctx := context.Background()
	// Another process of the same limiter, heartbeating.
	_, err = eng.Heartbeat(ctx, "api", "other-process", time.Minute)
	require.NoError(t, err)
	require.NoError(t, l.Acquire(ctx, "k")) // this one's heartbeat: 2 instances
	time.Sleep(60 * time.Millisecond)
	require.NoError(t, l.Acquire(ctx, "k"))

	kill()
	// Four callers keep asking for a second; a probe of Redis holds one of
	// them for up to the timeout, the others go on.
	start := time.Now()
	var allowed atomic.Int64
	var wg sync.WaitGroup
	for g := 0; g < 4; g++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for time.Since(start) < time.Second {
				r, err := l.Allow(ctx, "k")
				if err != nil {
					t.Error(err)
					return
				}
				if r.Allowed {
					allowed.Add(1)
				}
				time.Sleep(500 * time.Microsecond)
			}
		}()
	}
	wg.Wait()
	t.Logf("local share admitted %d in 1 s (limit/instances = 50)", allowed.Load())
	require.InDelta(t, 50, allowed.Load(), 10, "within 20%% of limit/instances")

	// Reservations wait for their local slots, 20ms apart.
	r1, err := l.Reserve(ctx, "k")
	require.NoError(t, err)
	r2, err := l.Reserve(ctx, "k")
	require.NoError(t, err)
	require.True(t, r1.Fallback() && r2.Fallback())
	require.True(t, r1.OK() && r2.OK())
	require.InDelta(t, float64(20*time.Millisecond), float64(r2.SlotAt().Sub(r1.SlotAt())), float64(2*time.Millisecond))
	require.NoError(t, r2.Cancel(ctx))
	require.NoError(t, r1.Cancel(ctx))

	srv.Restart(t)
	back := time.Now()
	require.Eventually(t, func() bool {
		r, err := l.Reserve(ctx, "k")
		return err == nil && !r.Fallback()
	}, time.Second, time.Millisecond, "shared limiting back within 1 s of Redis")
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
