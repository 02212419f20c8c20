package reserve_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/slotbook/slotbook/deadline"
	"github.com/slotbook/slotbook/reserve"
	"github.com/slotbook/slotbook/throttle"
)

// lateBatch books, for a fresh key of l, a head, then in one ReserveBatch
// a request whose deadline a 40 ms reply delay makes it miss and a later
// request without one.
func lateBatch(t *testing.T, l *reserve.Limiter, key string, hold bool) (head, late, after *reserve.Reservation) {
	t.Helper()
	ctx := context.Background()
	head, err := l.Reserve(ctx, key)
	require.NoError(t, err)
	require.True(t, head.OK())
	interval := l.Limits()[0].Interval()
	// Redis books it within its budget (its wait counts from Redis's
	// clock, 40 ms before the reply came), but acting 40 ms after that
	// would end 20 ms past the deadline.
	dl, cancel := context.WithDeadline(ctx, head.Booking().At.Add(interval+20*time.Millisecond))
	t.Cleanup(cancel)
	rs, err := l.ReserveBatch(ctx, key, []reserve.BatchRequest{
		{Context: dl, N: 1, HoldLate: hold},
		{N: 1, HoldLate: hold},
	})
	require.NoError(t, err)
	return head, rs[0], rs[1]
}

// TestBatchHoldLate: with every reply held back 40 ms, a batch request
// whose slot Redis books within its budget but whose reply comes too late
// for its deadline is refused. With HoldLate it holds its booking
// (Booking().OK, SlotAt zero), and cancelling the batch's bookings latest
// first gives both rooms back: the next booking takes the late one's
// slot, on the Redis clock. Without HoldLate (the control, same run)
// ReserveBatch gives it back itself, and its Reservation holds nothing.
func TestBatchHoldLate(t *testing.T) {
	t.Parallel()
	eng, p, calls := latencyEngine(t)
	p.SetReplyDelay(40 * time.Millisecond)
	l, err := reserve.New(eng, "api", throttle.PerSecond(2, 0)) // 500 ms apart
	require.NoError(t, err)
	ctx := context.Background()

	for _, hold := range []bool{true, false} {
		t.Run(fmt.Sprintf("hold=%v", hold), func(t *testing.T) {
			key := fmt.Sprintf("k-%v", hold)
			_, late, after := lateBatch(t, l, key, hold)
			require.False(t, late.OK())
			require.ErrorIs(t, late.Err(), deadline.ErrWouldExceedDeadline)
			require.True(t, late.SlotAt().IsZero(), "a refusal's SlotAt")
			require.Equal(t, hold, late.Booking().OK, "Booking().OK: a booking held")
			require.True(t, after.OK(), "the request after the late one: %v", after.Err())
			if !hold {
				before := calls.Load()
				require.NoError(t, late.Cancel(ctx))
				require.Equal(t, before, calls.Load(), "a refusal holding nothing: Cancel makes no call")
				return
			}
			lateAt := late.Booking().At
			require.NoError(t, after.Cancel(ctx))
			require.NoError(t, late.Cancel(ctx))
			before := calls.Load()
			require.NoError(t, late.Cancel(ctx), "twice")
			require.NoError(t, late.View().Cancel(ctx), "a view")
			require.Equal(t, before, calls.Load(), "Cancel twice, or a view's: no call")
			next, err := l.Reserve(ctx, key)
			require.NoError(t, err)
			require.True(t, next.OK())
			require.Equal(t, lateAt, next.Booking().At,
				"the next booking takes the late one's slot: both rooms came back")
		})
	}
}

// TestViewCancelGivesNothingBack: a View answers as its reservation does,
// but its Cancel (and its Wait, cut short) gives nothing back and makes no
// call; the reservation itself can still give its room back after.
func TestViewCancelGivesNothingBack(t *testing.T) {
	t.Parallel()
	l, r, calls := futureBooking(t, 0)
	ctx := context.Background()
	v := r.View()
	require.Equal(t, r.OK(), v.OK())
	require.Equal(t, r.Booking(), v.Booking())
	require.Equal(t, r.SlotAt(), v.SlotAt())
	require.Equal(t, r.RetryAfter(), v.RetryAfter())
	before := calls.Load()
	require.NoError(t, v.Cancel(ctx))
	short, cancel := context.WithTimeout(ctx, time.Millisecond)
	defer cancel()
	require.ErrorIs(t, v.Wait(short), context.DeadlineExceeded)
	require.Equal(t, before, calls.Load(), "a view's Cancel and Wait: no call")
	interval := l.Limits()[0].Interval()
	next, err := l.Reserve(ctx, "k")
	require.NoError(t, err)
	require.Equal(t, r.Booking().At.Add(interval), next.Booking().At, "the view gave nothing back")
	require.NoError(t, next.Cancel(ctx))
	require.NoError(t, r.Cancel(ctx))
	again, err := l.Reserve(ctx, "k")
	require.NoError(t, err)
	require.Equal(t, r.Booking().At, again.Booking().At, "the reservation itself gave its room back")
}

// TestBatchHoldLateClaim: a late refusal's held booking, claimed, is an
// OK Reservation of the same slot (Booking().At on the Redis clock, and a
// SlotAt), which a caller may act in; the refusal then holds nothing (its
// Cancel makes no call), and the claimed one's Cancel, before its slot,
// gives the room back: after the batch's later booking is cancelled too,
// the next booking takes the late one's slot. Claim of anything else
// (an OK Reservation, a refusal holding nothing, a view, a held one
// claimed or cancelled already) is nil.
func TestBatchHoldLateClaim(t *testing.T) {
	t.Parallel()
	eng, p, calls := latencyEngine(t)
	p.SetReplyDelay(40 * time.Millisecond)
	l, err := reserve.New(eng, "api", throttle.PerSecond(2, 0)) // 500 ms apart
	require.NoError(t, err)
	ctx := context.Background()

	head, late, after := lateBatch(t, l, "claim", true)
	require.ErrorIs(t, late.Err(), deadline.ErrWouldExceedDeadline, "the test's premise")
	require.True(t, late.Booking().OK, "the test's premise: held")
	require.Nil(t, head.Claim(), "an OK Reservation")
	require.Nil(t, late.View().Claim(), "a view")

	c := late.Claim()
	require.NotNil(t, c)
	require.True(t, c.OK(), "%v", c.Err())
	require.Equal(t, late.Booking().At, c.Booking().At, "the held slot")
	require.False(t, c.SlotAt().IsZero())
	require.Positive(t, c.Delay(), "the slot is ahead (500 ms after the head's)")
	require.Nil(t, late.Claim(), "claimed twice")

	before := calls.Load()
	require.NoError(t, late.Cancel(ctx))
	require.Equal(t, before, calls.Load(), "a claimed refusal holds nothing: Cancel makes no call")

	require.NoError(t, after.Cancel(ctx))
	require.NoError(t, c.Cancel(ctx))
	next, err := l.Reserve(ctx, "claim")
	require.NoError(t, err)
	require.Equal(t, late.Booking().At, next.Booking().At, "the claimed booking's room came back with its Cancel")

	// A held booking cancelled first cannot be claimed.
	_, late, _ = lateBatch(t, l, "cancelled", true)
	require.True(t, late.Booking().OK, "the test's premise: held")
	require.NoError(t, late.Cancel(ctx))
	require.Nil(t, late.Claim(), "cancelled")
	// A late refusal not held holds nothing to claim.
	_, late, _ = lateBatch(t, l, "unheld", false)
	require.Nil(t, late.Claim(), "not held")
}

// TestBatchHoldLateGone: with every reply held back 100 ms, a batch
// request whose Context is cancelled while the call is out (50 ms after
// the call starts: each side leaves 50 ms for a busy machine's stalls; a
// stall past a 10 ms cancel refused the request unsent, holding nothing),
// its slot immediate. With HoldLate it is refused with the context's error and
// holds its booking (Booking().OK), whose Cancel gives the room back
// though the slot has come, for no one acted on it: the next booking
// finds the key idle (Wait 0 on the Redis clock). Before, it was answered
// OK, and its Cancel, the slot come, gave nothing back (the next booking
// waited an interval). Without HoldLate, ReserveBatch gives it back
// itself and it holds nothing.
func TestBatchHoldLateGone(t *testing.T) {
	t.Parallel()
	eng, p, _ := latencyEngine(t)
	p.SetReplyDelay(100 * time.Millisecond)
	l, err := reserve.New(eng, "gone", throttle.PerSecond(2, 0)) // 500 ms apart
	require.NoError(t, err)
	ctx := context.Background()
	for _, hold := range []bool{true, false} {
		key := fmt.Sprintf("k-%v", hold)
		cctx, cancel := context.WithCancel(ctx)
		time.AfterFunc(50*time.Millisecond, cancel) // the call is out by then, its reply not in
		rs, err := l.ReserveBatch(ctx, key, []reserve.BatchRequest{{Context: cctx, N: 1, HoldLate: hold}})
		require.NoError(t, err)
		r := rs[0]
		require.False(t, r.OK())
		require.ErrorIs(t, r.Err(), context.Canceled)
		require.Equal(t, hold, r.Booking().OK, "hold=%v: holds its booking", hold)
		require.NoError(t, r.Cancel(ctx))
		next, err := l.Reserve(ctx, key)
		require.NoError(t, err)
		require.True(t, next.OK())
		require.Zero(t, next.Booking().Wait, "hold=%v: the gone request's room came back", hold)
	}
}
