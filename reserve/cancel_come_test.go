package reserve_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/slotbook/slotbook/internal/testhook"
	"github.com/slotbook/slotbook/throttle"
)

// TestCancelAfterSlotMakesNoCall: cancelling a reservation whose slot has
// come (an immediate one, or a future one once its time has passed) makes
// no Redis call, since Redis would give nothing back; the key's state is
// as if Cancel had not been called. One whose slot has not come still
// gives its room back in one call.
func TestCancelAfterSlotMakesNoCall(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	l := e.limiter(t, throttle.PerSecond(20, 0)) // 50 ms apart
	ctx := context.Background()
	require.NoError(t, e.eng.Load(ctx)) // no NOSCRIPT retry in the counts

	now, err := l.Reserve(ctx, "k")
	require.NoError(t, err)
	require.Zero(t, now.Booking().Wait)
	later, err := l.Reserve(ctx, "k")
	require.NoError(t, err)
	require.Positive(t, later.Booking().Wait)

	before := e.calls.Load()
	require.NoError(t, now.Cancel(ctx))
	require.Equal(t, before, e.calls.Load(), "the immediate slot had come: no call")

	require.NoError(t, later.Wait(ctx))
	require.NoError(t, later.Cancel(ctx))
	require.Equal(t, before, e.calls.Load(), "the waited-for slot had come: no call")

	// The room of both stays spent: the next slot is one interval after
	// the second, on the Redis clock.
	next, err := l.Reserve(ctx, "k")
	require.NoError(t, err)
	require.False(t, next.Booking().At.Before(later.Booking().At.Add(50*time.Millisecond)))

	// A slot still to come gives its room back, in one call.
	after, err := l.Reserve(ctx, "k")
	require.NoError(t, err)
	require.Positive(t, after.Booking().Wait)
	before = e.calls.Load()
	require.NoError(t, after.Cancel(ctx))
	require.Equal(t, before+1, e.calls.Load())
	again, err := l.Reserve(ctx, "k")
	require.NoError(t, err)
	require.True(t, again.Booking().At.Equal(after.Booking().At), "the next booking takes the given-back slot")
}

// TestCancelOnTestClockAsksRedis: on the module's explicit test clock,
// which does not move with local time, a slot still to come on that clock
// is given back however much local time has passed, so tests that freeze
// the clock stay exact on a slow machine.
func TestCancelOnTestClockAsksRedis(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	l := e.limiter(t, throttle.PerSecond(10, 0)) // 100 ms apart
	ctx := testhook.WithNow(context.Background(), time.Now().UnixMicro())
	first, err := l.Reserve(ctx, "k")
	require.NoError(t, err)
	require.Zero(t, first.Booking().Wait)
	r, err := l.Reserve(ctx, "k")
	require.NoError(t, err)
	require.Equal(t, 100*time.Millisecond, r.Booking().Wait)
	time.Sleep(150 * time.Millisecond) // past SlotAt on the local clock
	require.NoError(t, r.Cancel(ctx))
	again, err := l.Reserve(ctx, "k")
	require.NoError(t, err)
	require.True(t, again.Booking().At.Equal(r.Booking().At), "given back: %v, %v", again.Booking().At, r.Booking().At)
}
