package reserve_test

import (
	"context"
	"fmt"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/slotbook/slotbook/deadline"
	"github.com/slotbook/slotbook/reserve"
	"github.com/slotbook/slotbook/throttle"
)

// TestBatchHoldLateTrade: with every reply held back trReplyDelay, a batch
// of two on a fresh key with a burst: both land at once, the same slot
// (At), and the first is refused late (its deadline trLateIn away), held. The
// second's holder has acted in its slot, which stands on the held one, so
// the held room could never come back; Trade gives the holder the held
// booking (the same slot) and hands its own back as spare, which no one
// acts on: its Cancel gives the room back though its slot has come, and
// the next booking finds room at once on the Redis clock (Wait 0), as if
// only one request had been booked. Trade of anything else is nil and
// changes nothing; after it, the two traded hold nothing.
func TestBatchHoldLateTrade(t *testing.T) {
	t.Parallel()
	eng, p, calls := latencyEngine(t)
	p.SetReplyDelay(trReplyDelay)
	l, err := reserve.New(eng, "api", throttle.PerSecond(2, 1)) // 500 ms apart, room for two at once
	require.NoError(t, err)
	ctx := context.Background()

	batch := func(key string, lateFirst bool) (late, own *reserve.Reservation) {
		dl, cancel := context.WithTimeout(ctx, trLateIn)
		t.Cleanup(cancel)
		reqs := []reserve.BatchRequest{{Context: dl, N: 1, HoldLate: true}, {N: 1, HoldLate: true}}
		if !lateFirst {
			reqs[0], reqs[1] = reqs[1], reqs[0]
		}
		rs, err := l.ReserveBatch(ctx, key, reqs)
		require.NoError(t, err)
		if !lateFirst {
			rs[0], rs[1] = rs[1], rs[0]
		}
		late, own = rs[0], rs[1]
		require.ErrorIs(t, late.Err(), deadline.ErrWouldExceedDeadline, "the test's premise: refused late")
		require.True(t, late.Booking().OK, "the test's premise: held")
		require.True(t, own.OK(), "%v", own.Err())
		require.Equal(t, late.Booking().At, own.Booking().At, "the test's premise: one slot")
		return late, own
	}

	late, own := batch("trade", true)
	require.True(t, late.Booking().Before(own.Booking()), "booked in request order")
	other, err := l.Reserve(ctx, "other")
	require.NoError(t, err)
	for what, pair := range map[string][2]*reserve.Reservation{
		"own not OK":            {late, late},
		"the late one not held": {own, late},
		"a view of the late":    {late.View(), own},
		"a view of own":         {late, own.View()},
		"another key":           {late, other},
		"nil":                   {late, nil},
	} {
		c, s := pair[0].Trade(pair[1])
		require.Nil(t, c, what)
		require.Nil(t, s, what)
	}

	claimed, spare := late.Trade(own)
	require.NotNil(t, claimed)
	require.NotNil(t, spare)
	require.True(t, claimed.OK(), "%v", claimed.Err())
	require.Equal(t, late.Booking(), claimed.Booking(), "the holder holds the late one's booking")
	require.False(t, spare.OK())
	require.Equal(t, late.Err(), spare.Err(), "the spare stands for the refusal")
	require.Equal(t, own.Booking(), spare.Booking(), "the spare holds own's booking")
	require.True(t, spare.Booking().OK, "held")
	c, s := late.Trade(own)
	require.Nil(t, c, "traded twice")
	require.Nil(t, s)
	require.Nil(t, late.Claim(), "a traded refusal holds nothing to claim")
	before := calls.Load()
	require.NoError(t, late.Cancel(ctx))
	require.NoError(t, own.Cancel(ctx))
	require.Equal(t, before, calls.Load(), "the traded ones hold nothing: Cancel makes no call")

	// The slot has come (it came at once): the claimed one gives nothing
	// back, the spare does.
	require.NoError(t, claimed.Cancel(ctx))
	require.Equal(t, before, calls.Load(), "claimed, its slot come: no call")
	require.NoError(t, spare.Cancel(ctx))
	next, err := l.Reserve(ctx, "trade")
	require.NoError(t, err)
	require.True(t, next.OK())
	require.Zero(t, next.Booking().Wait, "one request stands: room at once")

	// The late one over own: own's holder cannot take it (the late one
	// is the key's latest, and gives its own room back).
	late, own = batch("over", false)
	require.True(t, own.Booking().Before(late.Booking()))
	c, s = late.Trade(own)
	require.Nil(t, c, "the late one over own")
	require.Nil(t, s)
	require.NoError(t, late.Cancel(ctx))
	next, err = l.Reserve(ctx, "over")
	require.NoError(t, err)
	require.Zero(t, next.Booking().Wait, "the late one's room came back")

	// Bookings of other sizes: a holder that acted on two units cannot
	// stand on one (that would let a unit through early), nor is one of
	// two units its to give up for a one-unit booking.
	l3, err := reserve.New(eng, "api3", throttle.PerSecond(2, 2)) // room for three at once
	require.NoError(t, err)
	for _, n := range [][2]int{{1, 2}, {2, 1}} {
		dl, cancel := context.WithTimeout(ctx, trLateIn)
		t.Cleanup(cancel)
		key := fmt.Sprintf("sizes-%d-%d", n[0], n[1])
		rs, err := l3.ReserveBatch(ctx, key, []reserve.BatchRequest{{Context: dl, N: n[0], HoldLate: true}, {N: n[1], HoldLate: true}})
		require.NoError(t, err)
		late, own := rs[0], rs[1]
		require.True(t, late.Booking().OK && !late.OK(), "the test's premise: held, %v", late.Err())
		require.True(t, own.OK(), "%v", own.Err())
		require.Equal(t, late.Booking().At, own.Booking().At, "the test's premise: one slot")
		c, s := late.Trade(own)
		require.Nil(t, c, "late %d units, own %d", n[0], n[1])
		require.Nil(t, s)
		require.NotNil(t, late.Claim(), "unchanged: still claimable")
	}
}

// TestReservationForgo: a booking whose slot has come gives nothing back
// by Cancel (its holder may have acted: the control, same run, whose next
// booking waits an interval). Its holder, knowing no one acted on it,
// forgoes it: the Reservation Forgo returns is refused with the error
// given and holds the booking, whose Cancel gives it back though its slot
// has come: the next booking is immediate (Wait 0, Redis clock). r then
// holds nothing. Forgo of a view, a refusal, one cancelled, or with a nil
// error is nil.
func TestReservationForgo(t *testing.T) {
	t.Parallel()
	eng, _, calls := latencyEngine(t)
	l, err := reserve.New(eng, "forgo", throttle.PerSecond(2, 0), reserve.WithMaxWait(0)) // 500 ms apart
	require.NoError(t, err)
	ctx := context.Background()
	for _, forgo := range []bool{false, true} {
		key := fmt.Sprintf("k-%v", forgo)
		r, err := l.Reserve(ctx, key)
		require.NoError(t, err)
		require.True(t, r.OK())
		require.NoError(t, r.Wait(ctx)) // immediate: its slot has come
		if !forgo {
			require.NoError(t, r.Cancel(ctx))
			next, err := l.Reserve(ctx, key)
			require.NoError(t, err)
			require.False(t, next.OK(), "control: the slot came, Cancel gave nothing back")
			continue
		}
		require.Nil(t, r.Forgo(nil), "a nil error")
		require.Nil(t, r.View().Forgo(context.Canceled), "a view")
		f := r.Forgo(context.Canceled)
		require.NotNil(t, f)
		require.False(t, f.OK())
		require.ErrorIs(t, f.Err(), context.Canceled)
		require.Equal(t, r.Booking(), f.Booking(), "holds r's booking")
		require.Nil(t, r.Forgo(context.Canceled), "forgone twice")
		before := calls.Load()
		require.NoError(t, r.Cancel(ctx))
		require.Equal(t, before, calls.Load(), "r holds nothing: no call")
		require.NoError(t, f.Cancel(ctx))
		require.Nil(t, f.Forgo(context.Canceled), "a refusal")
		next, err := l.Reserve(ctx, key)
		require.NoError(t, err)
		require.True(t, next.OK(), "the forgone booking's room came back: %v", next.Err())
		require.Zero(t, next.Booking().Wait)
	}
}
