package reserve_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/slotbook/slotbook/internal/testhook"
	"github.com/slotbook/slotbook/reserve"
	"github.com/slotbook/slotbook/throttle"
)

// TestReserveBatchSkipsEndedRequests: a request whose context has already
// ended when its batch is sent is answered with that context's error and
// books nothing: no slot is taken from the requests after it, and no call
// is spent giving one back. A batch of ended requests makes no call.
func TestReserveBatchSkipsEndedRequests(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	l := e.limiter(t, throttle.PerSecond(10, 1)) // two at once, then 100 ms apart
	ctx := testhook.WithNow(context.Background(), time.Now().UnixMicro())
	require.NoError(t, e.eng.Load(ctx))
	ended, cancel := context.WithCancel(ctx)
	cancel()

	before := e.calls.Load()
	rs, err := l.ReserveBatch(ctx, "k", []reserve.BatchRequest{
		{Context: ended, N: 1}, {N: 1}, {Context: ended, N: 1}, {N: 1},
	})
	require.NoError(t, err)
	require.Equal(t, int64(1), e.calls.Load()-before, "one batch call, no refund")
	for _, i := range []int{0, 2} {
		require.False(t, rs[i].OK(), "request %d", i)
		require.ErrorIs(t, rs[i].Err(), context.Canceled, "request %d", i)
	}
	for _, i := range []int{1, 3} {
		require.True(t, rs[i].OK(), "request %d: %v", i, rs[i].Err())
		require.Zero(t, rs[i].Booking().Wait, "request %d", i)
	}

	// Nothing was booked for the ended requests: the next slot is the
	// third, one interval on.
	r, err := l.Reserve(ctx, "k")
	require.NoError(t, err)
	require.Equal(t, 100*time.Millisecond, r.Booking().Wait)

	before = e.calls.Load()
	rs, err = l.ReserveBatch(ctx, "k", []reserve.BatchRequest{{Context: ended, N: 1}, {Context: ended, N: 2}})
	require.NoError(t, err)
	require.Equal(t, e.calls.Load(), before, "no call for a batch of ended requests")
	for i, r := range rs {
		require.ErrorIs(t, r.Err(), context.Canceled, "request %d", i)
	}
	r, err = l.Reserve(ctx, "k")
	require.NoError(t, err)
	require.Equal(t, 200*time.Millisecond, r.Booking().Wait)
}
