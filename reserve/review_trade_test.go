package reserve_test

// helper-92's review of throttle.Booking.Before and reserve.Reservation.Trade
// (commits 1641146, c468149). Oracle: a textbook GCRA replay (virtual
// scheduling, tolerance Burst intervals) of the slots that actually ran,
// on the Redis clock (Booking().At), never the scripts' arithmetic.

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/slotbook/slotbook/deadline"
	"github.com/slotbook/slotbook/internal/redistest"
	"github.com/slotbook/slotbook/internal/testhook"
	"github.com/slotbook/slotbook/reserve"
	"github.com/slotbook/slotbook/throttle"
)

// trRun is n units that ran at at (Redis clock).
type trRun struct {
	at time.Time
	n  int
}

// trEarliest is the textbook GCRA: the earliest time, not before t, at
// which n units conform to lim after runs (each run conforming, replayed
// in time order): n units at s conform iff s >= TAT + (n-1)*I - tau, with
// tau = Burst*I; each run sets TAT = max(TAT, at) + n*I.
func trEarliest(t *testing.T, lim throttle.Limit, runs []trRun, at time.Time, n int) time.Time {
	t.Helper()
	I := lim.Interval()
	tau := time.Duration(lim.Burst) * I
	rs := slices.Clone(runs)
	slices.SortStableFunc(rs, func(a, b trRun) int { return a.at.Compare(b.at) })
	var tat time.Time
	set := false
	for _, r := range rs {
		if set {
			require.False(t, r.at.Before(tat.Add(time.Duration(r.n-1)*I-tau)), "test bug: a run that the textbook would not let through")
		}
		if !set || r.at.After(tat) {
			tat = r.at
		}
		set = true
		tat = tat.Add(time.Duration(r.n) * I)
	}
	if !set {
		return at
	}
	e := tat.Add(time.Duration(n-1)*I - tau)
	if e.Before(at) {
		return at
	}
	return e
}

// trCheckNext books n units of key on l (ctx) and checks its slot against
// the textbook after runs: never earlier (nothing let through early) and,
// if exact, never later (no room lost).
func trCheckNext(t *testing.T, l *reserve.Limiter, ctx context.Context, key string, runs []trRun, n int, exact bool) {
	t.Helper()
	next, err := l.ReserveN(ctx, key, n)
	require.NoError(t, err)
	require.True(t, next.OK(), "%v", next.Err())
	b := next.Booking()
	decided := b.At.Add(-b.Wait)
	want := time.Time{}
	for _, lim := range l.Limits() {
		if e := trEarliest(t, lim, runs, decided, n); e.After(want) {
			want = e
		}
	}
	t.Logf("next %d units: slot %v after the decision, textbook %v", n, b.At.Sub(decided), want.Sub(decided))
	require.False(t, b.At.Before(want), "LET THROUGH EARLY: next %d units booked at %v, the textbook allows them only at %v (%v early)",
		n, b.At.Format("15:04:05.000000"), want.Format("15:04:05.000000"), want.Sub(b.At))
	if exact {
		require.False(t, b.At.After(want), "ROOM LOST: next %d units booked at %v, the textbook has room at %v (%v lost)",
			n, b.At.Format("15:04:05.000000"), want.Format("15:04:05.000000"), b.At.Sub(want))
	}
}

// trReplyDelay is how long trLimiter's engine holds back every reply, and
// trLateIn the deadline of trBatch's late requests: Redis books them at
// once, and the reply makes them late. Each side of trLateIn leaves 50 ms
// for a busy machine's stalls: CI once took more than 20 ms between
// making a 20 ms deadline and reading the clock for the call's budget,
// which refused the request unsent (holding nothing) and broke the
// premise.
const (
	trReplyDelay = 100 * time.Millisecond
	trLateIn     = trReplyDelay / 2
)

// trLimiter is a limiter on a fresh engine whose every reply is held back
// trReplyDelay.
func trLimiter(t *testing.T, lim throttle.Limit, opts ...reserve.Option) (*reserve.Limiter, *redistest.Proxy) {
	t.Helper()
	eng, p, _ := latencyEngine(t)
	p.SetReplyDelay(trReplyDelay)
	l, err := reserve.New(eng, "tr", lim, append([]reserve.Option{reserve.WithoutMaxWait()}, opts...)...)
	require.NoError(t, err)
	return l, p
}

// trBatch books ns in one ReserveBatch on ctx, the requests at lateIdx
// with a deadline trLateIn away (made late by the reply delay) and held;
// the others held too, without a deadline.
func trBatch(t *testing.T, l *reserve.Limiter, ctx context.Context, key string, ns []int, lateIdx ...int) []*reserve.Reservation {
	t.Helper()
	reqs := make([]reserve.BatchRequest, len(ns))
	for i, n := range ns {
		reqs[i] = reserve.BatchRequest{N: n, HoldLate: true}
		if slices.Contains(lateIdx, i) {
			dl, cancel := context.WithTimeout(context.Background(), trLateIn)
			t.Cleanup(cancel)
			reqs[i].Context = dl
		}
	}
	rs, err := l.ReserveBatch(ctx, key, reqs)
	require.NoError(t, err)
	for i, r := range rs {
		if slices.Contains(lateIdx, i) {
			require.ErrorIs(t, r.Err(), deadline.ErrWouldExceedDeadline, "premise: request %d refused late", i)
			require.True(t, r.Booking().OK, "premise: request %d held", i)
		} else {
			require.True(t, r.OK(), "premise: request %d booked: %v", i, r.Err())
		}
	}
	return rs
}

// TestReviewTRMixedUnitsEarly: failed on c468149 (fixed by f4a4d17:
// Trade refuses bookings of different sizes). A late refusal of 1
// unit held under own, a booking of 2 units of the same slot in the same
// call (burst room for 3). Trade does not look at the units: own's holder,
// who acts with 2 units, gets the 1-unit booking, and the 2-unit one goes
// back (spare.Cancel, RefundUnused): 2 units ran, the key counts 1, and
// the next 3 units are booked half a second before the textbook allows.
func TestReviewTRMixedUnitsEarly(t *testing.T) {
	t.Parallel()
	lim := throttle.PerSecond(2, 2) // 500 ms apart, 3 at once
	l, _ := trLimiter(t, lim)
	ctx := context.Background()
	rs := trBatch(t, l, ctx, "mixed", []int{1, 2}, 0)
	r, own := rs[0], rs[1]
	require.Equal(t, r.Booking().At, own.Booking().At, "premise: one slot")
	require.True(t, r.Booking().Before(own.Booking()))

	runs := []trRun{{own.Booking().At, own.Booking().N}} // own's holder acts in its slot, with its units
	claimed, spare := r.Trade(own)
	if claimed == nil {
		t.Log("Trade refused the 1-for-2 trade")
		require.NoError(t, r.Cancel(ctx))
	} else {
		t.Logf("traded: claimed holds %d unit(s), spare %d; own's holder acts with %d", claimed.Booking().N, spare.Booking().N, own.Booking().N)
		require.NoError(t, spare.Cancel(ctx))
	}
	trCheckNext(t, l, ctx, "mixed", runs, 3, false)
}

// TestReviewTRMixedUnitsRoom: on c468149 a held refusal of 2 units
// under own of 1 unit traded, and the key still counted 2 units for the 1
// that ran. Since f4a4d17 Trade refuses bookings of different sizes: the
// held room is then lost under own, as any late refusal's under a later
// booking that stands (a trade could not give it all back either).
func TestReviewTRMixedUnitsRoom(t *testing.T) {
	t.Parallel()
	lim := throttle.PerSecond(2, 2)
	l, _ := trLimiter(t, lim)
	ctx := context.Background()
	rs := trBatch(t, l, ctx, "mixed21", []int{2, 1}, 0)
	r, own := rs[0], rs[1]
	require.Equal(t, r.Booking().At, own.Booking().At, "premise: one slot")
	claimed, spare := r.Trade(own)
	require.Nil(t, claimed, "2 units held under 1")
	require.Nil(t, spare)
	require.NotNil(t, r.Claim(), "unchanged: still claimable")
}

// TestReviewTRExact: control and side paths that must hold. Equal units
// (1 and 2), within one call and across calls (test clock), a layered
// limiter, chains (spare.Trade, spare.Claim): after the trades and the
// spares' Cancel the key holds exactly the units that ran, on the
// textbook, no earlier and no later.
func TestReviewTRExact(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	t.Run("one call n=1", func(t *testing.T) {
		t.Parallel()
		lim := throttle.PerSecond(2, 2)
		l, _ := trLimiter(t, lim)
		rs := trBatch(t, l, ctx, "k", []int{1, 1}, 0)
		c, s := rs[0].Trade(rs[1])
		require.NotNil(t, c)
		require.True(t, c.OK())
		require.False(t, s.OK())
		require.NoError(t, s.Cancel(ctx))
		require.NoError(t, s.Cancel(ctx), "twice")
		trCheckNext(t, l, ctx, "k", []trRun{{c.Booking().At, 1}}, 3, true)
	})
	t.Run("one call n=2", func(t *testing.T) {
		t.Parallel()
		lim := throttle.PerSecond(2, 3)
		l, _ := trLimiter(t, lim)
		rs := trBatch(t, l, ctx, "k", []int{2, 2}, 0)
		require.Equal(t, rs[0].Booking().At, rs[1].Booking().At)
		c, s := rs[0].Trade(rs[1])
		require.NotNil(t, c)
		require.NoError(t, s.Cancel(ctx))
		trCheckNext(t, l, ctx, "k", []trRun{{c.Booking().At, 2}}, 4, true)
	})
	t.Run("chain", func(t *testing.T) {
		t.Parallel()
		lim := throttle.PerSecond(2, 3)
		l, _ := trLimiter(t, lim)
		// r1 r2 late, o1 o2 acting, all one slot: r1 < r2 < o1 < o2.
		rs := trBatch(t, l, ctx, "k", []int{1, 1, 1, 1}, 0, 1)
		r1, r2, o1, o2 := rs[0], rs[1], rs[2], rs[3]
		c2, s2 := r2.Trade(o2)
		require.NotNil(t, c2)
		c1, s1 := r1.Trade(o1)
		require.NotNil(t, c1)
		// s1 (o1's booking) lies above c2 (r2's): no trade that way.
		require.False(t, s1.Booking().Before(c2.Booking()))
		a, b := s1.Trade(c2)
		require.Nil(t, a)
		require.Nil(t, b)
		// Give back the spares latest first: o2's, then o1's.
		require.NoError(t, s2.Cancel(ctx))
		require.NoError(t, s1.Cancel(ctx))
		trCheckNext(t, l, ctx, "k", []trRun{{c1.Booking().At, 1}, {c2.Booking().At, 1}}, 4, true)
	})
	t.Run("spare traded on", func(t *testing.T) {
		t.Parallel()
		lim := throttle.PerSecond(2, 3)
		l, _ := trLimiter(t, lim)
		// r late < o1 < o2: o1 trades with r, its spare (o1's booking)
		// lies under o2, whose holder trades with it.
		rs := trBatch(t, l, ctx, "k", []int{1, 1, 1}, 0)
		r, o1, o2 := rs[0], rs[1], rs[2]
		c1, s1 := r.Trade(o1)
		require.NotNil(t, c1)
		c2, s2 := s1.Trade(o2)
		require.NotNil(t, c2, "a spare hands its booking on")
		require.Equal(t, o1.Booking(), c2.Booking())
		require.Nil(t, s1.Claim(), "traded on: nothing to claim")
		require.NoError(t, s1.Cancel(ctx), "traded on: nothing")
		require.NoError(t, s2.Cancel(ctx))
		trCheckNext(t, l, ctx, "k", []trRun{{c1.Booking().At, 1}, {c2.Booking().At, 1}}, 4, true)
	})
	t.Run("spare claimed", func(t *testing.T) {
		t.Parallel()
		lim := throttle.PerSecond(2, 2)
		l, _ := trLimiter(t, lim)
		rs := trBatch(t, l, ctx, "k", []int{1, 1}, 0)
		c, s := rs[0].Trade(rs[1])
		require.NotNil(t, c)
		cl := s.Claim()
		require.NotNil(t, cl, "a spare can be claimed")
		require.True(t, cl.OK())
		require.NoError(t, s.Cancel(ctx), "claimed from: nothing")
		require.NoError(t, cl.Cancel(ctx), "its slot has come: nothing")
		trCheckNext(t, l, ctx, "k", []trRun{{c.Booking().At, 1}, {cl.Booking().At, 1}}, 3, true)
	})
	t.Run("across calls", func(t *testing.T) {
		t.Parallel()
		lim := throttle.PerSecond(2, 2)
		l, _ := trLimiter(t, lim)
		t0 := time.Now().Add(time.Hour).Truncate(time.Second)
		tctx := testhook.WithNow(context.Background(), t0.UnixMicro())
		r := trBatch(t, l, tctx, "k", []int{1}, 0)[0]
		x, err := l.Reserve(tctx, "k")
		require.NoError(t, err)
		own, err := l.Reserve(tctx, "k")
		require.NoError(t, err)
		require.Equal(t, r.Booking().At, own.Booking().At)
		c, s := r.Trade(own)
		require.NotNil(t, c)
		require.NoError(t, s.Cancel(tctx))
		trCheckNext(t, l, tctx, "k", []trRun{{x.Booking().At, 1}, {c.Booking().At, 1}}, 3, true)
	})
	t.Run("layered", func(t *testing.T) {
		t.Parallel()
		l, _ := trLimiter(t, throttle.PerSecond(2, 2), reserve.WithLimit(throttle.PerMinute(60, 3)))
		rs := trBatch(t, l, ctx, "k", []int{1, 1}, 0)
		c, s := rs[0].Trade(rs[1])
		require.NotNil(t, c)
		require.NoError(t, s.Cancel(ctx))
		trCheckNext(t, l, ctx, "k", []trRun{{c.Booking().At, 1}}, 3, true)
	})
}

// TestReviewTRRefused: Trade is nil, and changes nothing, for own of
// another Limiter of the same name, of a view (With), own under r,
// own at another slot, and after own or r was cancelled (a Cancel that
// made no call, as own's slot had come).
func TestReviewTRRefused(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	lim := throttle.PerSecond(2, 2)
	eng, p, _ := latencyEngine(t)
	p.SetReplyDelay(trReplyDelay)
	l, err := reserve.New(eng, "tr", lim, reserve.WithoutMaxWait())
	require.NoError(t, err)
	other, err := reserve.New(eng, "tr", lim, reserve.WithoutMaxWait())
	require.NoError(t, err)
	view, err := l.With()
	require.NoError(t, err)
	t0 := time.Now().Add(time.Hour).Truncate(time.Second)
	tctx := testhook.WithNow(ctx, t0.UnixMicro())

	r := trBatch(t, l, tctx, "k", []int{1}, 0)[0]
	for name, lm := range map[string]*reserve.Limiter{"another limiter": other, "a With view": view} {
		o, err := lm.Reserve(tctx, "k")
		require.NoError(t, err)
		require.Equal(t, r.Booking().At, o.Booking().At)
		require.True(t, r.Booking().Before(o.Booking()))
		c, s := r.Trade(o)
		require.Nil(t, c, name)
		require.Nil(t, s, name)
	}
	// own under r (r booked after it), same slot: nil.
	rs := trBatch(t, l, ctx, "under", []int{1, 1}, 1)
	c, s := rs[1].Trade(rs[0])
	require.Nil(t, c)
	require.Nil(t, s)
	// own cancelled after its slot came (no call): nil.
	rs = trBatch(t, l, ctx, "cancelled", []int{1, 1}, 0)
	require.NoError(t, rs[1].Cancel(ctx))
	c, s = rs[0].Trade(rs[1])
	require.Nil(t, c)
	require.Nil(t, s)
	// r claimed: nil.
	rs = trBatch(t, l, ctx, "claimed", []int{1, 1}, 0)
	require.NotNil(t, rs[0].Claim())
	c, s = rs[0].Trade(rs[1])
	require.Nil(t, c)
	require.Nil(t, s)
}

// TestReviewTRAfterLostCancel: a Cancel whose reply is lost (the proxy
// holds it back, then drops the connection) leaves r, or own, untradable
// (Trade nil), and the retried Cancel gives back exactly once. The
// spare's Cancel, reply lost and retried, gives own's room back exactly
// once.
func TestReviewTRAfterLostCancel(t *testing.T) {
	t.Parallel()
	lim := throttle.PerSecond(2, 2)
	ctx := context.Background()
	lose := func(t *testing.T, p *redistest.Proxy, cancel func() error) {
		t.Helper()
		p.SetReplyDelay(2 * time.Second)
		errc := make(chan error, 1)
		go func() { errc <- cancel() }()
		time.Sleep(150 * time.Millisecond)
		p.Sever()
		require.Error(t, <-errc, "a Cancel whose reply was lost")
		p.SetReplyDelay(trReplyDelay)
	}
	t.Run("r", func(t *testing.T) {
		t.Parallel()
		l, p := trLimiter(t, lim)
		rs := trBatch(t, l, ctx, "k", []int{1, 1}, 0)
		r, own := rs[0], rs[1]
		lose(t, p, func() error { return r.Cancel(ctx) })
		c, s := r.Trade(own)
		require.Nil(t, c, "a Cancel that may have given r back")
		require.Nil(t, s)
		redistest.UntilOK(t, func() error { return r.Cancel(ctx) })
		// r under own, which ran: r gives nothing back (own stands on it).
		trCheckNext(t, l, ctx, "k", []trRun{{own.Booking().At, 1}}, 3, false)
	})
	t.Run("own", func(t *testing.T) {
		t.Parallel()
		l, p := trLimiter(t, lim)
		t0 := time.Now().Add(time.Hour).Truncate(time.Second)
		// own's slot still to come on the test clock: its Cancel makes a call.
		tctx := testhook.WithNow(ctx, t0.UnixMicro())
		rs := trBatch(t, l, tctx, "k", []int{1, 1}, 0)
		r, own := rs[0], rs[1]
		lose(t, p, func() error { return own.Cancel(testhook.WithNow(ctx, t0.Add(-time.Second).UnixMicro())) })
		c, s := r.Trade(own)
		require.Nil(t, c, "a Cancel that may have given own back")
		require.Nil(t, s)
	})
	t.Run("spare", func(t *testing.T) {
		t.Parallel()
		l, p := trLimiter(t, lim)
		rs := trBatch(t, l, ctx, "k", []int{1, 1}, 0)
		c, s := rs[0].Trade(rs[1])
		require.NotNil(t, c)
		lose(t, p, func() error { return s.Cancel(ctx) })
		require.Nil(t, s.Claim(), "tried: no Claim")
		a, b := s.Trade(rs[1])
		require.Nil(t, a)
		require.Nil(t, b)
		redistest.UntilOK(t, func() error { return s.Cancel(ctx) })
		require.NoError(t, s.Cancel(ctx))
		trCheckNext(t, l, ctx, "k", []trRun{{c.Booking().At, 1}}, 3, true)
	})
}

// TestReviewTRRace: Trade racing Cancel, Claim, Wait and View on r and
// own, many rounds under -race: at most one of Trade and Claim gets r's
// booking; whoever holds what, giving back what no one ran leaves the key
// exactly as the textbook has it.
func TestReviewTRRace(t *testing.T) {
	t.Parallel()
	lim := throttle.PerSecond(2, 2)
	l, _ := trLimiter(t, lim)
	ctx := context.Background()
	for round := range 8 {
		key := fmt.Sprintf("race%d", round)
		rs := trBatch(t, l, ctx, key, []int{1, 1}, 0)
		r, own := rs[0], rs[1]
		var (
			wg             sync.WaitGroup
			claimed, spare *reserve.Reservation
			cl             *reserve.Reservation
			rCancel        bool
		)
		wg.Add(5)
		go func() { defer wg.Done(); claimed, spare = r.Trade(own) }()
		go func() { defer wg.Done(); cl = r.Claim() }()
		go func() { defer wg.Done(); _ = own.Wait(ctx); _ = own.View().Cancel(ctx) }()
		go func() { defer wg.Done(); _ = r.View().Cancel(ctx); _, _ = r.View().Trade(own) }()
		go func() {
			defer wg.Done()
			if round%2 == 0 {
				rCancel = r.Cancel(ctx) == nil
			}
		}()
		wg.Wait()
		require.False(t, claimed != nil && cl != nil, "r handed out twice")
		// own's holder acted in its slot (Wait returned).
		var runs []trRun
		switch {
		case claimed != nil:
			runs = append(runs, trRun{claimed.Booking().At, 1})
			require.NoError(t, spare.Cancel(ctx))
		case cl != nil:
			// The claimant acts too, on r's booking.
			runs = append(runs, trRun{own.Booking().At, 1}, trRun{cl.Booking().At, 1})
		default:
			runs = append(runs, trRun{own.Booking().At, 1})
		}
		t.Logf("round %d: traded %v, claimed %v, r cancelled %v", round, claimed != nil, cl != nil, rCancel)
		exact := claimed != nil || cl != nil // r cancelled under own: its room is lost, as documented
		trCheckNext(t, l, ctx, key, runs, 3, exact)
	}
}

// TestReviewTRActsLate: own's holder acts well after its slot; the spare
// is given back before that. The next booking is judged on the Redis
// clock against the textbook with the holder's slot (At): the trade lets
// nothing through earlier than the same run without a trade would.
func TestReviewTRActsLate(t *testing.T) {
	t.Parallel()
	lim := throttle.PerSecond(4, 1) // 250 ms apart, 2 at once
	l, _ := trLimiter(t, lim)
	ctx := context.Background()
	rs := trBatch(t, l, ctx, "k", []int{1, 1}, 0)
	c, s := rs[0].Trade(rs[1])
	require.NotNil(t, c)
	require.NoError(t, s.Cancel(ctx))
	// A follower books before the holder acts.
	trCheckNext(t, l, ctx, "k", []trRun{{c.Booking().At, 1}}, 2, true)
	time.Sleep(300 * time.Millisecond) // the holder acts now, late
	require.NoError(t, c.Cancel(ctx), "its slot has come: nothing")
}

// TestReviewTRFallback: own answered by the fallback (FailOpen, Redis
// unreachable) cannot be traded for a held refusal booked by Redis.
func TestReviewTRFallback(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	for name, fb := range map[string]reserve.Fallback{"FailOpen": reserve.FailOpen(), "LocalShare": reserve.LocalShare(time.Second, 1, 100)} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			l, p := trLimiter(t, throttle.PerSecond(2, 2), reserve.WithFallback(fb))
			r := trBatch(t, l, ctx, "k", []int{1}, 0)[0]
			p.Close()
			own, err := l.Reserve(ctx, "k")
			require.NoError(t, err)
			require.True(t, own.Fallback())
			c, s := r.Trade(own)
			require.Nil(t, c)
			require.Nil(t, s)
		})
	}
}
