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

// TestFallbackEndedBatchTakesNoLocalSlot: a ReserveBatch whose context
// ends while its call is out, the call then failing with Redis
// unavailable (the breaker open), returns the context's error, and the
// fallback answers none of its requests, not even one with a live Context
// of its own: no one would act on the answer. Nothing is counted as
// allowed by the fallback, and the subject's local room is whole: the
// batch's whole burst passes at once, as for a subject never asked for.
func TestFallbackEndedBatchTakesNoLocalSlot(t *testing.T) {
	t.Parallel()
	obs := &outcomes{}
	eng, p, _ := proxiedEngine(t, 8, throttle.WithTimeout(150*time.Millisecond), throttle.WithObserver(obs))
	lim := throttle.PerHour(3600, 3)
	l, err := reserve.New(eng, "fbend", lim, reserve.WithFallback(reserve.FailOpen()), reserve.WithoutMaxWait())
	require.NoError(t, err)
	bg := context.Background()
	_, err = l.Reserve(bg, "warm") // a connection in the pool: the call below is sent at once
	require.NoError(t, err)
	p.SetReplyDelay(3 * time.Second)
	t.Cleanup(func() { p.SetReplyDelay(0) })

	ctx, cancel := context.WithTimeout(bg, 60*time.Millisecond)
	defer cancel()
	own, stop := context.WithCancel(bg)
	defer stop()
	rs, err := l.ReserveBatch(ctx, "s", []reserve.BatchRequest{{N: 1}, {N: 2, Context: own}})
	require.ErrorIs(t, err, context.DeadlineExceeded)
	require.Nil(t, rs)
	if obs.opens.Load() == 0 {
		t.Skip("the call's timeout did not open the breaker: the fallback was not asked")
	}
	require.Zero(t, obs.n[throttle.FallbackAllowed].Load(), "the fallback answered a gone caller: %v", obs)

	r, err := l.ReserveN(bg, "s", lim.Burst+1)
	require.NoError(t, err)
	require.True(t, r.Fallback(), "Redis answered while its replies are held back")
	require.Zero(t, r.Delay(), "the ended batch kept local room")
}
