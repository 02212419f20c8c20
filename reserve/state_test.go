package reserve_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/slotbook/slotbook/internal/testhook"
	"github.com/slotbook/slotbook/reserve"
	"github.com/slotbook/slotbook/throttle"
)

// TestLimiterState: State reads a subject under every limit without
// booking: the wait it reads is the wait the next Reserve gets, reading
// twice reads the same, and Reset brings the subject back to idle.
func TestLimiterState(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	perDay := throttle.PerDay(5, 1)
	l := e.limiter(t, throttle.PerSecond(10, 2), reserve.WithLimit(perDay))
	ctx := testhook.WithNow(context.Background(), time.Now().UnixMicro())

	s, err := l.State(ctx, "tenant")
	require.NoError(t, err)
	require.Len(t, s.Keys, 2)
	require.Equal(t, l.Limits()[0], s.Keys[0].Limit)
	require.Equal(t, perDay, s.Keys[1].Limit)
	require.Equal(t, 2, s.Available, "idle: the day's burst+1")
	require.Zero(t, s.Wait)

	for i := 0; i < 3; i++ {
		r, err := l.Reserve(ctx, "tenant")
		require.NoError(t, err)
		require.True(t, r.OK())
	}
	s, err = l.State(ctx, "tenant")
	require.NoError(t, err)
	again, err := l.State(ctx, "tenant")
	require.NoError(t, err)
	// A reading books nothing: the same on the same clock (but for the
	// keys' TTLs, which Redis counts down on its own clock).
	require.Equal(t, s.Wait, again.Wait)
	require.Equal(t, s.Available, again.Available)
	require.Equal(t, s.Backlog, again.Backlog)
	for i := range s.Keys {
		require.Equal(t, s.Keys[i].TAT, again.Keys[i].TAT)
	}
	require.Zero(t, s.Available)
	require.Equal(t, 2*perDay.Interval(), s.Wait, "three booked under a burst of 1: the next one two intervals away")
	for _, k := range s.Keys {
		require.True(t, k.Exists)
		require.Positive(t, k.TTL)
	}
	r, err := l.Reserve(ctx, "tenant")
	require.NoError(t, err)
	require.Equal(t, s.Wait, r.Booking().Wait)
	require.Equal(t, s.NextFree, r.Booking().At)

	require.NoError(t, l.Reset(ctx, "tenant"))
	s, err = l.State(ctx, "tenant")
	require.NoError(t, err)
	for _, k := range s.Keys {
		require.False(t, k.Exists, "reset: %s", k.Key)
	}
	require.Zero(t, s.Wait)
	require.Equal(t, 2, s.Available)
}

// TestLimiterStateBadKey: a bad key is a typed error and no Redis call.
func TestLimiterStateBadKey(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	l := e.limiter(t, throttle.PerSecond(10, 2))
	for _, key := range []string{"", strings.Repeat("k", throttle.MaxKeyLen)} {
		before := e.calls.Load()
		_, err := l.State(context.Background(), key)
		require.ErrorIs(t, err, throttle.ErrInvalidRequest)
		require.ErrorIs(t, l.Reset(context.Background(), key), throttle.ErrInvalidRequest)
		require.Equal(t, before, e.calls.Load(), "no Redis call for a bad key")
	}
}
