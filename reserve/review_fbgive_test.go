package reserve_test

// Adversarial review (helper-83) of 45ba677 / 2f79973: the fallback's
// give-back of an unused local slot at its own time to act, and an ended
// ReserveBatch booking no local slot.
//
// Redis is made unavailable by closing the proxy in front of it (connections
// refused, the breaker opens at the first failure). An Observer hook runs
// inside book, synchronously, at each fallback decision: it ends a caller's
// context "right after the fallback answered" (the window between book's
// check and finish's / ReserveBatch's), deterministically.
//
// The limits are slow (one a minute locally, burst+1 tokens), so the refill
// during a test is negligible and every oracle is a matter of minutes
// against milliseconds. Oracle: a textbook token bucket of the local share
// (rate r, burst+1 tokens for FailOpen), replayed with the bookings that
// stand; a request of k units waits max(0, k - tokens)/r.

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/slotbook/slotbook/reserve"
	"github.com/slotbook/slotbook/throttle"
)

// fbgObs counts decisions and calls a hook at each one (and at each call).
type fbgObs struct {
	n      [throttle.FallbackRefused + 1]atomic.Int64
	calls  atomic.Int64
	opens  atomic.Int64
	onDec  atomic.Pointer[func(throttle.Outcome)]
	onCall atomic.Pointer[func(error)]
}

func (o *fbgObs) ObserveDecision(_ string, oc throttle.Outcome, _ time.Duration) {
	o.n[oc].Add(1)
	if f := o.onDec.Load(); f != nil {
		(*f)(oc)
	}
}

func (o *fbgObs) ObserveCall(_ string, _ time.Duration, err error) {
	o.calls.Add(1)
	if f := o.onCall.Load(); f != nil {
		(*f)(err)
	}
}
func (o *fbgObs) ObserveRefund(string, time.Duration) {}
func (o *fbgObs) ObserveBreaker(open bool) {
	if open {
		o.opens.Add(1)
	}
}

func (o *fbgObs) hook(f func(throttle.Outcome)) { o.onDec.Store(&f) }
func (o *fbgObs) unhook()                       { o.onDec.Store(nil); o.onCall.Store(nil) }

// fbgMin is the local rate of every test: one a minute.
const fbgMin = time.Minute

// fbgDown returns a Limiter named name on an engine whose Redis is gone
// (its proxy closed), the breaker already open and the fallback answering,
// and its observer.
func fbgDown(t *testing.T, name string, lim throttle.Limit, fb reserve.Fallback, opts ...reserve.Option) (*reserve.Limiter, *fbgObs) {
	t.Helper()
	obs := &fbgObs{}
	eng, p, _ := proxiedEngine(t, 8, throttle.WithTimeout(time.Second), throttle.WithObserver(obs))
	l, err := reserve.New(eng, name, lim, append([]reserve.Option{reserve.WithFallback(fb), reserve.WithoutMaxWait()}, opts...)...)
	require.NoError(t, err)
	p.Close()
	fbgWarm(t, l, obs)
	return l, obs
}

// fbgWarm books (and gives back) on a key of its own until the fallback
// answers: the breaker is open.
func fbgWarm(t *testing.T, l *reserve.Limiter, obs *fbgObs) {
	t.Helper()
	bg := context.Background()
	for i := 0; i < 50; i++ {
		r, err := l.ReserveN(bg, "warm", 1)
		if err == nil && r.Fallback() {
			require.NoError(t, r.Cancel(bg))
			return
		}
		time.Sleep(20 * time.Millisecond)
	}
	t.Fatalf("the fallback never answered: allowed %d, opens %d", obs.n[throttle.FallbackAllowed].Load(), obs.opens.Load())
}

// fbgLocal books n units of key with a fresh context and requires a local
// (fallback) answer that is OK.
func fbgLocal(t *testing.T, l *reserve.Limiter, key string, n int) *reserve.Reservation {
	t.Helper()
	r, err := l.ReserveN(context.Background(), key, n)
	require.NoError(t, err)
	require.True(t, r.Fallback(), "not the fallback's answer")
	require.True(t, r.OK(), "refused: %v", r.Err())
	return r
}

// fbgProbe is the local wait of a request of n units of key (booked and
// kept: a probe is the last thing a subject sees).
func fbgProbe(t *testing.T, l *reserve.Limiter, key string, n int) time.Duration {
	t.Helper()
	return fbgLocal(t, l, key, n).Delay()
}

// ---------------------------------------------------------------------------
// Findings
// ---------------------------------------------------------------------------

// TestReviewFBGBatchEndedAfterAnswerGivesAllBack FAILS (PROVEN): a
// ReserveBatch whose ctx ends just after the fallback answered it (after
// book's check, before ReserveBatch's: here, from the Observer at the
// first fallback decision), its requests carrying live Contexts of their
// own, so each got a local slot. ReserveBatch returns ctx's error and
// giveBackEnded gives every slot back, unused, latest first. Only the
// latest comes back: its give-back records the key's last time (now), and
// every earlier slot, whose time to act (the booking's own instant, no
// wait) is now before that, gives nothing. The caller never had any of
// them; a bucket that never saw the batch is full.
func TestReviewFBGBatchEndedAfterAnswerGivesAllBack(t *testing.T) {
	t.Parallel()
	lim := throttle.PerHour(60, 3) // 1/min locally, 4 tokens
	l, obs := fbgDown(t, "fbgbatch", lim, reserve.FailOpen())
	bg := context.Background()
	for i, ns := range [][]int{{2, 2}, {1, 1, 1, 1}, {4, 2}, {3}} {
		key := fmt.Sprintf("s%d", i)
		t.Run(fmt.Sprint(ns), func(t *testing.T) {
			ctx, cancel := context.WithCancel(bg)
			defer cancel()
			var once sync.Once
			obs.hook(func(oc throttle.Outcome) {
				if oc == throttle.FallbackAllowed {
					once.Do(cancel)
				}
			})
			defer obs.unhook()
			reqs := make([]reserve.BatchRequest, len(ns))
			for j, n := range ns {
				reqs[j] = reserve.BatchRequest{N: n, Context: bg}
			}
			before := obs.n[throttle.FallbackAllowed].Load()
			rs, err := l.ReserveBatch(ctx, key, reqs)
			require.ErrorIs(t, err, context.Canceled, "reservations %v", rs)
			require.Nil(t, rs)
			obs.unhook()
			require.Equal(t, int64(len(ns)), obs.n[throttle.FallbackAllowed].Load()-before,
				"every request had its local slot before the ctx ended")
			got := fbgProbe(t, l, key, lim.Burst+1)
			t.Logf("batch %v ended just after the answer: a whole burst on its key waits %v (textbook 0)", ns, got)
			require.Less(t, got, 10*time.Second,
				"BUG: the ended batch's unused local slots were kept: a whole burst waits %v where a bucket that never saw them waits 0", got)
		})
	}
}

// TestReviewFBGCoalescedEndedAfterAnswerGivesAllBack FAILS (PROVEN): the
// same through coalescing: six callers of one key queued behind a call in
// flight go out in one batch; the fallback answers them all, and their
// (shared) context ends right after (at the batch's last decision). Each
// caller's finish gives its slot back unused, on its own goroutine: the
// first give-back records the key's last time, and the other five give
// nothing. Four earlier callers (one each, live) stand.
func TestReviewFBGCoalescedEndedAfterAnswerGivesAllBack(t *testing.T) {
	t.Parallel()
	lim := throttle.PerHour(60, 15) // 1/min locally, 16 tokens
	l, obs := fbgDown(t, "fbgcoal", lim, reserve.FailOpen())
	bg := context.Background()
	const standing, queued = 4, 6
	grp, cancelGrp := context.WithCancel(bg)
	defer cancelGrp()
	release := make(chan struct{})
	var count atomic.Int64
	obs.hook(func(oc throttle.Outcome) {
		if oc != throttle.FallbackAllowed {
			return
		}
		switch k := count.Add(1); {
		case k <= standing:
			<-release // the call in flight (and three sent alone beside it) held
		case k == standing+queued:
			cancelGrp() // the queued batch's callers end right after its answer
		}
	})
	defer obs.unhook()

	var wg sync.WaitGroup
	errs := make([]error, standing+queued)
	for i := 0; i < standing; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			_, errs[i] = l.ReserveN(bg, "s", 1)
		}()
		require.Eventually(t, func() bool { return count.Load() == int64(i+1) }, 10*time.Second, time.Millisecond)
	}
	for i := standing; i < standing+queued; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			_, errs[i] = l.ReserveN(grp, "s", 1)
		}()
	}
	time.Sleep(300 * time.Millisecond) // the six queue behind the call in flight
	close(release)
	wg.Wait()
	obs.unhook()
	if count.Load() != standing+queued {
		t.Skipf("%d fallback decisions, want %d: the callers did not go out as planned", count.Load(), standing+queued)
	}
	for i := 0; i < standing; i++ {
		require.NoError(t, errs[i])
	}
	for i := standing; i < standing+queued; i++ {
		require.ErrorIs(t, errs[i], context.Canceled)
	}
	// Standing: four units; the bucket holds 12 of 16.
	got := fbgProbe(t, l, "s", lim.Burst+1-standing)
	t.Logf("12 units after %d standing and %d unused: wait %v (textbook 0)", standing, queued, got)
	require.Less(t, got, 10*time.Second,
		"BUG: the coalesced callers' unused local slots were kept: 12 units wait %v where a bucket that saw only the standing ones waits 0", got)
}

// TestReviewFBGRefusalBehindUnusedKeepsRoom FAILS (PROVEN): an unused slot
// gives nothing back when a request refused by the fallback (its local
// wait past its budget: it booked nothing) came after it.
//
// batch: a ReserveBatch, ctx ending right after the answer, of a slot of 2
// (live Context) and a request of 4 with a 10 s deadline (refused locally:
// it would wait 2 min). Both at the batch's one instant; the refusal's
// CancelAt leaves x/time/rate's lastEvent at the refused request's time to
// act (2 min ahead), so cancelling the slot of 2 at its time to act
// "restores" 2 - 2 = 0.
//
// nested: a ReserveN of 2 whose ctx ends right after its answer; meanwhile
// another caller's request of 4 on the key is refused locally (max wait 1
// s). The refusal recorded the key's last time, after the slot's time, so
// the give-back gives nothing. README: "given back whole, unless the key
// was booked or given back locally since" — a refusal is neither.
func TestReviewFBGRefusalBehindUnusedKeepsRoom(t *testing.T) {
	t.Parallel()
	lim := throttle.PerHour(60, 3) // 1/min locally, 4 tokens
	l, obs := fbgDown(t, "fbgrefused", lim, reserve.FailOpen())
	bg := context.Background()
	strict, err := l.With(reserve.WithMaxWait(time.Second))
	require.NoError(t, err)

	t.Run("batch", func(t *testing.T) {
		ctx, cancel := context.WithCancel(bg)
		defer cancel()
		var once sync.Once
		obs.hook(func(oc throttle.Outcome) {
			if oc == throttle.FallbackAllowed {
				once.Do(cancel)
			}
		})
		defer obs.unhook()
		tight, stop := context.WithTimeout(bg, 10*time.Second)
		defer stop()
		refused := obs.n[throttle.FallbackRefused].Load()
		rs, err := l.ReserveBatch(ctx, "b", []reserve.BatchRequest{{N: 2, Context: bg}, {N: 4, Context: tight}})
		require.ErrorIs(t, err, context.Canceled, "reservations %v", rs)
		obs.unhook()
		require.Equal(t, refused+1, obs.n[throttle.FallbackRefused].Load(), "the request of 4 was refused locally")
		got := fbgProbe(t, l, "b", lim.Burst+1)
		t.Logf("a whole burst after the ended batch: wait %v (textbook 0)", got)
		require.Less(t, got, 10*time.Second,
			"BUG: the unused slot of 2 kept its room because a refused request (which booked nothing) came after it: a whole burst waits %v, textbook 0", got)
	})

	t.Run("nested", func(t *testing.T) {
		ctx, cancel := context.WithCancel(bg)
		defer cancel()
		var once sync.Once
		obs.hook(func(oc throttle.Outcome) {
			if oc != throttle.FallbackAllowed {
				return
			}
			once.Do(func() {
				cancel()
				r, err := strict.ReserveN(bg, "n", 4) // another caller, refused locally
				if err == nil && r.OK() {
					_ = r.Cancel(bg)
				}
			})
		})
		defer obs.unhook()
		refused := obs.n[throttle.FallbackRefused].Load()
		_, err := l.ReserveN(ctx, "n", 2)
		require.ErrorIs(t, err, context.Canceled)
		obs.unhook()
		require.Equal(t, refused+1, obs.n[throttle.FallbackRefused].Load(), "the other request was refused locally")
		got := fbgProbe(t, l, "n", lim.Burst+1)
		t.Logf("a whole burst after the unused slot: wait %v (textbook 0)", got)
		require.Less(t, got, 10*time.Second,
			"BUG: the unused slot of 2 kept its room because another request was refused since: a whole burst waits %v, textbook 0", got)
	})
}

// TestReviewFBGCancelGivesBackMoreThanBooked FAILS (PROVEN, the worst
// kind, not new in 45ba677: x/time/rate's CancelAt, which every fallback
// Cancel is). With FailOpen, 1/min and 4 tokens locally, all within
// milliseconds on one key:
//
//	a: 4 units, no wait, stands (acted on)
//	b: 4 units (4 min), c: 1 unit (5 min); b.Cancel (gives 3: c stands on 1)
//	d: 4 units (6 min), or a request of 4 refused locally; d.Cancel
//	c.Cancel
//
// d's book-and-cancel moves x/time/rate's lastEvent back to 2 min, before
// c's time to act, so c's Cancel "restores" 1 - (2-5) = 4 units for a
// booking of 1. Only a stands: a bucket that saw it (4 units at t0) lets 4
// more through at t0+4 min at the earliest. The fallback lets a request of
// 4 act at t0+2 min: two minutes early, 8 units in 2 minutes where the
// limit allows 6.
func TestReviewFBGCancelGivesBackMoreThanBooked(t *testing.T) {
	t.Parallel()
	lim := throttle.PerHour(60, 3) // 1/min locally, 4 tokens
	l, obs := fbgDown(t, "fbgmore", lim, reserve.FailOpen())
	_ = obs
	bg := context.Background()
	strict, err := l.With(reserve.WithMaxWait(time.Second))
	require.NoError(t, err)
	for _, refusal := range []bool{false, true} {
		key := fmt.Sprintf("refusal-%v", refusal)
		t.Run(key, func(t *testing.T) {
			t0 := time.Now()
			a := fbgLocal(t, l, key, 4)
			require.Zero(t, a.Delay())
			b := fbgLocal(t, l, key, 4)
			c := fbgLocal(t, l, key, 1)
			require.InDelta(t, float64(4*fbgMin), float64(b.Delay()), float64(5*time.Second))
			require.InDelta(t, float64(5*fbgMin), float64(c.Delay()), float64(5*time.Second))
			require.NoError(t, b.Cancel(bg))
			if refusal {
				r, err := strict.ReserveN(bg, key, 4)
				require.NoError(t, err)
				require.True(t, r.Fallback())
				require.False(t, r.OK(), "the request of 4 is refused locally (its wait past 1 s)")
			} else {
				d := fbgLocal(t, l, key, 4)
				require.NoError(t, d.Cancel(bg))
			}
			require.NoError(t, c.Cancel(bg))
			p := fbgLocal(t, l, key, 4)
			// Oracle: only a stands (4 units at t0 <= a's slot): 4 more act
			// no sooner than 4 min after a.
			earliest := a.SlotAt().Add(4 * fbgMin)
			t.Logf("probe of 4 at +%v may act at +%v; textbook earliest +%v",
				time.Since(t0).Round(time.Millisecond), p.SlotAt().Sub(t0).Round(time.Second), earliest.Sub(t0).Round(time.Second))
			require.False(t, p.SlotAt().Before(earliest.Add(-5*time.Second)),
				"BUG: through early: after a (4 units, stands) and cancelled b, c%s, a request of 4 may act %v after a, where a token bucket of 1/min and 4 tokens allows it only after 4m0s (c's Cancel gave back more than c booked)",
				map[bool]string{true: ", a refused request", false: ", d"}[refusal], p.SlotAt().Sub(a.SlotAt()).Round(time.Second))
		})
	}
}

// ---------------------------------------------------------------------------
// Side paths that PASS
// ---------------------------------------------------------------------------

// TestReviewFBGSingleEndedAfterAnswer: one caller (ReserveN, Reserve,
// Acquire; a layered limiter; LocalShare; a view probing) whose ctx ends
// right after the fallback's answer gets ctx's error and its slot back
// whole: a whole burst passes at once on its key (textbook: a bucket that
// never saw it).
func TestReviewFBGSingleEndedAfterAnswer(t *testing.T) {
	t.Parallel()
	bg := context.Background()
	main := throttle.PerHour(60, 3) // 1/min, 4 tokens
	day := throttle.PerDay(24*4, 1) // 4/h, 2 tokens
	type subject struct {
		name string
		lim  *reserve.Limiter
		obs  *fbgObs
		n    int
		call func(l *reserve.Limiter, ctx context.Context, key string, n int) error
	}
	reserveN := func(l *reserve.Limiter, ctx context.Context, key string, n int) error {
		_, err := l.ReserveN(ctx, key, n)
		return err
	}
	acquire := func(l *reserve.Limiter, ctx context.Context, key string, n int) error {
		return l.AcquireN(ctx, key, n)
	}
	reserve1 := func(l *reserve.Limiter, ctx context.Context, key string, _ int) error {
		_, err := l.Reserve(ctx, key)
		return err
	}
	fo, foObs := fbgDown(t, "fbgsingle", main, reserve.FailOpen())
	lay, layObs := fbgDown(t, "fbglayer", main, reserve.FailOpen(), reserve.WithLimit(day))
	ls, lsObs := fbgDown(t, "fbgshare", main, reserve.LocalShare(time.Hour, 1, 100))
	nc, err := fo.With(reserve.WithCoalescing(false))
	require.NoError(t, err)
	for _, s := range []subject{
		{"ReserveN", fo, foObs, 3, reserveN},
		{"Reserve", fo, foObs, 1, reserve1},
		{"Acquire", fo, foObs, 4, acquire},
		{"uncoalesced view", nc, foObs, 4, reserveN},
		{"layered", lay, layObs, 2, reserveN},
		{"LocalShare", ls, lsObs, 4, reserveN},
	} {
		t.Run(s.name, func(t *testing.T) {
			ctx, cancel := context.WithCancel(bg)
			defer cancel()
			s.obs.hook(func(oc throttle.Outcome) {
				if oc == throttle.FallbackAllowed {
					cancel()
				}
			})
			err := s.call(s.lim, ctx, s.name, s.n)
			s.obs.unhook()
			require.ErrorIs(t, err, context.Canceled)
			probeN := main.Burst + 1
			if s.name == "layered" {
				probeN = day.Burst + 1
			}
			// The probe through the base limiter: views share its state.
			base := map[string]*reserve.Limiter{"layered": lay, "LocalShare": ls}[s.name]
			if base == nil {
				base = fo
			}
			got := fbgProbe(t, base, s.name, probeN)
			require.Less(t, got, 10*time.Second, "the unused slot kept room: a whole burst waits %v", got)
		})
	}
}

// TestReviewFBGNoEarlyAfterUnused: an unused slot's give-back never lends
// room a standing booking took: with a (2 units) standing before the unused
// b (2 units), or c (2 units) booked by another caller after b's answer and
// before its give-back, a request of 3 waits at least a minute (textbook:
// 2 tokens left, the third a minute away), and with both, 3 minutes.
// Repeated Cancel of the ended caller's (never handed) slot can't be
// tried; a second ended caller on the same key follows.
func TestReviewFBGNoEarlyAfterUnused(t *testing.T) {
	t.Parallel()
	lim := throttle.PerHour(60, 3) // 1/min, 4 tokens
	l, obs := fbgDown(t, "fbgnoearly", lim, reserve.FailOpen())
	bg := context.Background()
	for _, tc := range []struct {
		before, after bool
		want          time.Duration // textbook wait of 3 units
	}{{true, false, fbgMin}, {false, true, fbgMin}, {true, true, 3 * fbgMin}} {
		key := fmt.Sprintf("before-%v-after-%v", tc.before, tc.after)
		t.Run(key, func(t *testing.T) {
			if tc.before {
				fbgLocal(t, l, key, 2)
			}
			ctx, cancel := context.WithCancel(bg)
			defer cancel()
			var first atomic.Bool
			obs.hook(func(oc throttle.Outcome) {
				if oc != throttle.FallbackAllowed || !first.CompareAndSwap(false, true) {
					return
				}
				cancel()
				if tc.after {
					r, err := l.ReserveN(bg, key, 2)
					if err != nil || !r.OK() {
						t.Errorf("c: %v %v", r, err)
					}
				}
			})
			_, err := l.ReserveN(ctx, key, 2)
			obs.unhook()
			require.ErrorIs(t, err, context.Canceled)
			got := fbgProbe(t, l, key, 3)
			t.Logf("3 units wait %v (textbook %v)", got, tc.want)
			require.GreaterOrEqual(t, got, tc.want-5*time.Second, "through early: the give-back lent room a standing booking holds")
		})
	}
}

// TestReviewFBGCancelUsedAndRepeated: the holder's own Cancel of a local
// slot whose time has come gives nothing back (it may have acted), however
// often; a View's Cancel gives nothing; a Cancel of a slot not yet come,
// twice, gives it back once: exactly the textbook's room, never more.
func TestReviewFBGCancelUsedAndRepeated(t *testing.T) {
	t.Parallel()
	lim := throttle.PerHour(60, 3)
	l, _ := fbgDown(t, "fbgused", lim, reserve.FailOpen())
	bg := context.Background()

	a := fbgLocal(t, l, "used", 2)
	require.NoError(t, a.View().Cancel(bg))
	require.NoError(t, a.Cancel(bg))
	require.NoError(t, a.Cancel(bg))
	got := fbgProbe(t, l, "used", 4)
	require.GreaterOrEqual(t, got, 2*fbgMin-5*time.Second, "a used slot gave room back: 4 units wait %v, textbook 2m", got)

	fbgLocal(t, l, "pending", 4)
	b := fbgLocal(t, l, "pending", 3) // 3 min ahead
	require.NoError(t, b.Cancel(bg))
	require.NoError(t, b.Cancel(bg))
	require.NoError(t, b.View().Cancel(bg))
	got = fbgProbe(t, l, "pending", 2)
	require.InDelta(t, float64(2*fbgMin), float64(got), float64(5*time.Second), "2 units after a (4) stands and b was given back: textbook 2m")
}

// TestReviewFBGEndedBatchBeforeAnswer (2f79973): a ReserveBatch whose ctx
// ends while its call is out (here as the engine reports the failed call,
// before the fallback is asked), its requests with live Contexts of their
// own: no local slot for any, no fallback decision, and the key's room
// whole.
func TestReviewFBGEndedBatchBeforeAnswer(t *testing.T) {
	t.Parallel()
	obs := &fbgObs{}
	eng, p, _ := proxiedEngine(t, 8, throttle.WithTimeout(time.Second), throttle.WithObserver(obs))
	lim := throttle.PerHour(60, 3)
	l, err := reserve.New(eng, "fbgbefore", lim, reserve.WithFallback(reserve.FailOpen()), reserve.WithoutMaxWait())
	require.NoError(t, err)
	p.Close() // the breaker still closed: the batch's call is sent, and fails
	bg := context.Background()
	ctx, cancel := context.WithCancel(bg)
	defer cancel()
	f := func(err error) {
		if err != nil {
			cancel()
		}
	}
	obs.onCall.Store(&f)
	rs, err := l.ReserveBatch(ctx, "s", []reserve.BatchRequest{{N: 2, Context: bg}, {N: 1}, {N: 1, Context: bg, HoldLate: true}})
	obs.unhook()
	require.ErrorIs(t, err, context.Canceled, "reservations %v", rs)
	require.Nil(t, rs)
	if obs.opens.Load() == 0 {
		t.Skip("the breaker did not open")
	}
	require.Zero(t, obs.n[throttle.FallbackAllowed].Load(), "the fallback answered a gone batch")
	got := fbgProbe(t, l, "s", lim.Burst+1)
	require.Less(t, got, 10*time.Second, "the ended batch kept local room: %v", got)
}

// TestReviewFBGEvictedAndReset: LocalShare with maxKeys 1. An unused slot
// on s whose key's limiters are dropped (another key booked) before its
// give-back: the give-back goes to the dropped limiters, the new ones for s
// are whole, and another key's room is untouched by it. A Reset while Redis
// is down fails and forgets nothing; the give-back after it is whole.
func TestReviewFBGEvictedAndReset(t *testing.T) {
	t.Parallel()
	lim := throttle.PerHour(60, 3)
	l, obs := fbgDown(t, "fbgevict", lim, reserve.LocalShare(time.Hour, 1, 1))
	bg := context.Background()

	ctx, cancel := context.WithCancel(bg)
	defer cancel()
	var first atomic.Bool
	obs.hook(func(oc throttle.Outcome) {
		if oc == throttle.FallbackAllowed && first.CompareAndSwap(false, true) {
			cancel()
			r, err := l.ReserveN(bg, "x", 4) // drops s's limiters
			if err != nil || !r.OK() {
				t.Errorf("x: %v %v", r, err)
			}
		}
	})
	_, err := l.ReserveN(ctx, "s", 2)
	obs.unhook()
	require.ErrorIs(t, err, context.Canceled)
	got := fbgProbe(t, l, "s", 4)
	require.Less(t, got, 10*time.Second, "s after its unused slot: %v", got)

	ctx, cancel = context.WithCancel(bg)
	defer cancel()
	var once2 sync.Once
	obs.hook(func(oc throttle.Outcome) {
		if oc == throttle.FallbackAllowed {
			once2.Do(func() {
				cancel()
				if err := l.Reset(bg, "r"); err == nil || !errors.Is(err, throttle.ErrUnavailable) {
					t.Errorf("Reset with Redis down: %v", err)
				}
			})
		}
	})
	_, err = l.ReserveN(ctx, "r", 3)
	obs.unhook()
	require.ErrorIs(t, err, context.Canceled)
	got = fbgProbe(t, l, "r", 4)
	require.Less(t, got, 10*time.Second, "r after its unused slot and a failed Reset: %v", got)
}
