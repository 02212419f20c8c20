package reserve_test

import (
	"context"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/slotbook/slotbook/internal/callcount"
	"github.com/slotbook/slotbook/internal/redistest"
	"github.com/slotbook/slotbook/reserve"
	"github.com/slotbook/slotbook/throttle"
)

// These tests check, through the public API and on the Redis clock
// (Booking().At), the claim behind Cancel's shortcut: a Reservation's
// SlotAt never comes before its slot on the Redis clock, so a Cancel that
// makes no call because SlotAt has come never keeps room that a refund
// would have given back.

// latencyEngine returns an engine on the shared server whose client goes
// through a latency proxy, the proxy, and a counter of the client's round
// trips. The scripts are loaded, so no NOSCRIPT retry shows in the counts.
func latencyEngine(t *testing.T) (*throttle.Engine, *redistest.Proxy, *callcount.Counter) {
	t.Helper()
	eng, p, _ := proxiedEngine(t, 32)
	return eng, p, callcount.Attach(eng.Client().(*redis.Client))
}

// engineKeys returns the engine keys of subject under l, as the package
// doc of WithLimit names them.
func engineKeys(l *reserve.Limiter, subject string) []string {
	first := l.Name() + ":{" + subject + "}"
	keys := []string{first}
	for _, lim := range l.Limits()[1:] {
		keys = append(keys, first+":"+strconv.FormatInt(lim.Period.Milliseconds(), 10)+"ms")
	}
	return keys
}

// TestSlotAtNeverBeforeRedisSlot: with every reply held back 40 ms,
// every booked Reservation, however it was made (alone, coalesced among
// concurrent callers, in a ReserveBatch, under layered limits), has a
// SlotAt at least the reply's delay after its slot on the Redis clock.
func TestSlotAtNeverBeforeRedisSlot(t *testing.T) {
	t.Parallel()
	const delay = 40 * time.Millisecond
	eng, p, _ := latencyEngine(t)
	p.SetReplyDelay(delay)
	ctx := context.Background()
	single, err := reserve.New(eng, "one", throttle.PerSecond(50, 2))
	require.NoError(t, err)
	layered, err := reserve.New(eng, "two", throttle.PerSecond(50, 2), reserve.WithLimit(throttle.PerMinute(600, 1)))
	require.NoError(t, err)

	var (
		mu  sync.Mutex
		all []*reserve.Reservation
	)
	keep := func(rs ...*reserve.Reservation) {
		mu.Lock()
		all = append(all, rs...)
		mu.Unlock()
	}
	for _, l := range []*reserve.Limiter{single, layered} {
		r, err := l.Reserve(ctx, "alone")
		require.NoError(t, err)
		keep(r)
		rs, err := l.ReserveBatch(ctx, "batch", []reserve.BatchRequest{{N: 1}, {N: 2}, {N: 1}, {N: 1}})
		require.NoError(t, err)
		keep(rs...)
		var wg sync.WaitGroup
		for range 12 { // more than sent alone: some queue and share a call
			wg.Go(func() {
				r, err := l.Reserve(ctx, "crowd")
				if err == nil {
					keep(r)
				}
			})
		}
		wg.Wait()
	}
	require.Len(t, all, 2*(1+4+12))
	for i, r := range all {
		require.True(t, r.OK(), "reservation %d: %v", i, r.Err())
		// Round(0): compare the wall clock, which Redis's TIME reads too.
		lead := r.SlotAt().Round(0).Sub(r.Booking().At)
		require.GreaterOrEqual(t, lead, delay,
			"reservation %d: SlotAt %v, Redis slot %v: the local time to act comes before the reply could have arrived",
			i, r.SlotAt(), r.Booking().At)
	}
}

// TestCancelComeKeepsOnlyWhatRefundWouldKeep: 40 ms each way. A
// future slot cancelled once its SlotAt has come makes no call, and a
// refund of the same booking sent then gives nothing back in any limit:
// the shortcut keeps no room the refund would have given. Controls in the
// same run: cancelled before its slot, the booking gives its room back
// (the next booking takes its slot, in one call); cancelled after its slot
// on the Redis clock but before SlotAt, the call is made and gives
// nothing.
func TestCancelComeKeepsOnlyWhatRefundWouldKeep(t *testing.T) {
	t.Parallel()
	const oneWay = 40 * time.Millisecond
	eng, p, calls := latencyEngine(t)
	p.SetLatency(oneWay)
	ctx := context.Background()
	l, err := reserve.New(eng, "api", throttle.PerSecond(2, 0), reserve.WithLimit(throttle.PerMinute(600, 3)))
	require.NoError(t, err)
	// The first limit's interval (the second's is 100 ms): long enough that
	// a slot is still to come after the round trips below.
	interval := 500 * time.Millisecond

	// future books the first slot of a fresh subject, then the next one,
	// an interval away, and returns the latter.
	future := func(subject string) *reserve.Reservation {
		t.Helper()
		now, err := l.Reserve(ctx, subject)
		require.NoError(t, err)
		require.Zero(t, now.Booking().Wait)
		r, err := l.Reserve(ctx, subject)
		require.NoError(t, err)
		require.True(t, r.OK(), r.Err())
		require.Positive(t, r.Booking().Wait)
		return r
	}
	next := func(subject string) throttle.Booking {
		t.Helper()
		r, err := l.Reserve(ctx, subject)
		require.NoError(t, err)
		require.True(t, r.OK(), r.Err())
		return r.Booking()
	}

	t.Run("before the slot", func(t *testing.T) {
		r := future("before")
		before := calls.Load()
		require.NoError(t, r.Cancel(ctx))
		require.Equal(t, before+1, calls.Load(), "a slot still to come: one refund call")
		require.True(t, next("before").At.Equal(r.Booking().At), "the next booking takes the given-back slot")
	})

	t.Run("after SlotAt", func(t *testing.T) {
		r := future("after")
		require.NoError(t, r.Wait(ctx))
		require.False(t, r.SlotAt().After(time.Now()))
		before := calls.Load()
		require.NoError(t, r.Cancel(ctx))
		require.Equal(t, before, calls.Load(), "SlotAt has come: no call")
		// The refund Cancel skipped, sent now: nothing to give back.
		given, err := eng.RefundAll(ctx, engineKeys(l, "after"), l.Limits(), r.Booking())
		require.NoError(t, err)
		for i, g := range given {
			require.Zero(t, g, "limit %d: the refund Cancel skipped would have given time back", i)
		}
		// Textbook GCRA, burst 0 in the first limit: after slots at a and
		// a+I, the next is no earlier than a+2I.
		require.False(t, next("after").At.Before(r.Booking().At.Add(interval)))
	})

	t.Run("between the Redis slot and SlotAt", func(t *testing.T) {
		r := future("between")
		at := r.Booking().At
		require.GreaterOrEqual(t, r.SlotAt().Round(0).Sub(at), oneWay)
		time.Sleep(time.Until(at) + 2*time.Millisecond) // wall clock, as Redis's TIME
		if !r.SlotAt().After(time.Now()) {
			t.Skip("the machine was too slow to cancel inside the window")
		}
		before := calls.Load()
		require.NoError(t, r.Cancel(ctx))
		require.Equal(t, before+1, calls.Load(), "SlotAt still to come: the refund is sent")
		require.False(t, next("between").At.Before(at.Add(interval)), "the slot had come on the Redis clock: nothing given back")
	})
}

// futureBooking returns a limiter of one slot per 500 ms over a proxy
// adding latency each way, and the reservation of its second slot, still
// to come.
func futureBooking(t *testing.T, latency time.Duration) (*reserve.Limiter, *reserve.Reservation, *callcount.Counter) {
	t.Helper()
	eng, p, calls := latencyEngine(t)
	p.SetLatency(latency)
	l, err := reserve.New(eng, "api", throttle.PerSecond(2, 0)) // 500 ms apart
	require.NoError(t, err)
	_, err = l.Reserve(context.Background(), "k")
	require.NoError(t, err)
	r, err := l.Reserve(context.Background(), "k")
	require.NoError(t, err)
	require.Positive(t, r.Booking().Wait)
	return l, r, calls
}

// TestCancelConcurrentGivesBackOnce: eight goroutines cancel one
// future booking at once: one refund call, the room comes back once (the
// next two bookings take the slot and the one an interval after it), and
// later Cancels make no call.
func TestCancelConcurrentGivesBackOnce(t *testing.T) {
	t.Parallel()
	l, r, calls := futureBooking(t, 10*time.Millisecond)
	ctx := context.Background()

	before := calls.Load()
	var wg sync.WaitGroup
	errs := make([]error, 8)
	for i := range errs {
		wg.Go(func() { errs[i] = r.Cancel(ctx) })
	}
	wg.Wait()
	for _, err := range errs {
		require.NoError(t, err)
	}
	require.Equal(t, before+1, calls.Load(), "concurrent Cancels: one refund call")
	require.NoError(t, r.Cancel(ctx))
	require.Equal(t, before+1, calls.Load(), "a second Cancel: no call")

	a, err := l.Reserve(ctx, "k")
	require.NoError(t, err)
	b, err := l.Reserve(ctx, "k")
	require.NoError(t, err)
	require.True(t, a.Booking().At.Equal(r.Booking().At), "the given-back slot is booked again")
	require.True(t, b.Booking().At.Equal(r.Booking().At.Add(500*time.Millisecond)), "given back once, not twice")
}

// TestWaitEndedGivesBackUnderLatency: 40 ms each way. A Wait whose
// context ends before the slot gives the slot back (the next booking takes
// it); a Cancel after that makes no call.
func TestWaitEndedGivesBackUnderLatency(t *testing.T) {
	t.Parallel()
	l, r, calls := futureBooking(t, 40*time.Millisecond)
	ctx := context.Background()

	wctx, cancel := context.WithTimeout(ctx, 20*time.Millisecond)
	defer cancel()
	require.ErrorIs(t, r.Wait(wctx), context.DeadlineExceeded)
	before := calls.Load()
	require.NoError(t, r.Cancel(ctx))
	require.Equal(t, before, calls.Load(), "already given back by Wait: no call")
	again, err := l.Reserve(ctx, "k")
	require.NoError(t, err)
	require.True(t, again.Booking().At.Equal(r.Booking().At), "the slot Wait gave back is booked again")
}
