package reserve_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/slotbook/slotbook/deadline"
	"github.com/slotbook/slotbook/reserve"
	"github.com/slotbook/slotbook/throttle"
)

// TestReserveWithin: a call's own max wait, shorter than the limiter's,
// refuses a slot beyond it (booking nothing, with the exact retry-after);
// a longer one is cut to the limiter's; a negative one is bad input with no
// Redis call.
func TestReserveWithin(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	// One every 2 s, no burst; the limiter allows 5 s of waiting. (Waits
	// are judged on the Redis clock, with a second's room for a busy
	// machine between calls.)
	l := e.limiter(t, throttle.Every(2*time.Second, 1, 0), reserve.WithMaxWait(5*time.Second))

	first, err := l.Reserve(ctx, "k")
	require.NoError(t, err)
	require.True(t, first.OK())

	// The next slot is 2 s away: beyond a 1 s max wait of the call's.
	r, err := l.ReserveWithin(ctx, "k", 1, time.Second)
	require.NoError(t, err)
	require.False(t, r.OK())
	require.ErrorIs(t, r.Err(), reserve.ErrMaxWaitExceeded)
	ra, ok := deadline.RetryAfterOf(r.Err())
	require.True(t, ok)
	require.Greater(t, ra, time.Second, "retry-after: when the slot comes")
	require.LessOrEqual(t, ra, 2*time.Second, "retry-after: when the slot comes")

	// Nothing was booked: a call allowing 3 s gets the slot 2 s away.
	r, err = l.ReserveWithin(ctx, "k", 1, 3*time.Second)
	require.NoError(t, err)
	require.True(t, r.OK())
	require.Greater(t, r.Booking().Wait, time.Second)
	require.LessOrEqual(t, r.Booking().Wait, 2*time.Second)

	// A max wait longer than the limiter's is cut to it: after one more
	// (4 s away), the next slot, 6 s away, is refused under the limiter's
	// 5 s.
	r, err = l.Reserve(ctx, "k")
	require.NoError(t, err)
	require.True(t, r.OK())
	r, err = l.ReserveWithin(ctx, "k", 1, time.Hour)
	require.NoError(t, err)
	require.False(t, r.OK())
	require.ErrorIs(t, r.Err(), reserve.ErrMaxWaitExceeded)

	before := e.calls.Load()
	_, err = l.ReserveWithin(ctx, "k", 1, -time.Millisecond)
	require.Error(t, err)
	require.False(t, errors.Is(err, reserve.ErrMaxWaitExceeded))
	require.Equal(t, before, e.calls.Load(), "no Redis call for a negative max wait")
}
