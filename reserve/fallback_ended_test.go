package reserve_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/slotbook/slotbook/reserve"
	"github.com/slotbook/slotbook/throttle"
)

// TestFallbackBatchEndedRequests: with Redis gone, a ReserveBatch request
// whose context had ended before the batch was sent gets that context's
// error, not a fallback answer, and takes none of the fallback's local
// slots; the live requests beside it are answered by the fallback as if
// it were not there.
func TestFallbackBatchEndedRequests(t *testing.T) {
	t.Parallel()
	eng, _, kill := outage(t)
	l, err := reserve.New(eng, "api", throttle.PerSecond(10, 0),
		reserve.WithFallback(reserve.LocalShare(time.Minute, 1, 100)))
	require.NoError(t, err)
	kill()
	ctx := context.Background()
	ended, cancel := context.WithCancel(ctx)
	cancel()

	rs, err := l.ReserveBatch(ctx, "k", []reserve.BatchRequest{{Context: ended, N: 1}, {N: 1}, {Context: ended, N: 1}, {N: 1}})
	require.NoError(t, err)
	for _, i := range []int{0, 2} {
		require.ErrorIs(t, rs[i].Err(), context.Canceled, "request %d", i)
		require.False(t, rs[i].OK(), "request %d", i)
		require.False(t, rs[i].Fallback(), "request %d: not the fallback's answer", i)
	}
	// The live requests: the local share's first slot at once, the second
	// one interval (100 ms, the whole limit for one process) later, as
	// without the ended ones.
	require.True(t, rs[1].OK(), "%v", rs[1].Err())
	require.True(t, rs[1].Fallback())
	require.Zero(t, rs[1].Delay())
	require.True(t, rs[3].OK(), "%v", rs[3].Err())
	require.True(t, rs[3].Fallback())
	require.InDelta(t, float64(100*time.Millisecond), float64(rs[3].SlotAt().Sub(rs[1].SlotAt())), float64(5*time.Millisecond))

	// A batch of ended requests only: answered alike.
	rs, err = l.ReserveBatch(ctx, "k", []reserve.BatchRequest{{Context: ended, N: 1}})
	require.NoError(t, err)
	require.ErrorIs(t, rs[0].Err(), context.Canceled)
	require.False(t, rs[0].Fallback())
}
