package reserve_test

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"runtime"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/slotbook/slotbook/internal/limitcheck"
	"github.com/slotbook/slotbook/internal/redistest"
	"github.com/slotbook/slotbook/pool"
	"github.com/slotbook/slotbook/reserve"
	"github.com/slotbook/slotbook/throttle"
)

// Review (helper-75) of 33736e2 / 708c745 (booking calls sent on
// waitbound.WithoutDeadline(callerCtx); an ended caller's bookings go
// back; a held refusal's Cancel uses RefundUnused), through the public API.
// Its three failing tests pass since the engine judges a call on a context
// without the caller's deadline by the caller's own (Engine.callerEnded),
// and ReserveN's doc says what bounds a shared call without a timeout.
// Helpers dlfLim, dlfProbeEngine, dlfStanding, dlfIsCtxErr come from
// review_dlflight_test.go; proxiedEngine(On) from
// coalesce_solo_sidepaths_test.go.

// nodlTextbook replays slots (Redis clock) that actually ran through a
// textbook GCRA (virtual scheduling, one unit each): a slot earlier than
// TAT - tau is let through early. It returns the violations.
func nodlTextbook(lim throttle.Limit, slots []time.Time) []string {
	ts := make([]int64, len(slots))
	for i, s := range slots {
		ts[i] = s.UnixMicro()
	}
	slices.Sort(ts)
	iv := limitcheck.Interval(lim)
	tau := iv * int64(lim.Burst)
	var tat int64
	var bad []string
	for i, t := range ts {
		if tat-t > tau {
			bad = append(bad, fmt.Sprintf("slot %d at +%dus ran %dus early (TAT %d)", i, t-ts[0], tat-t-tau, tat-ts[0]))
		}
		tat = max(tat, t) + iv
	}
	return bad
}

// ---------------------------------------------------------------------------
// 1. Held refusals (RefundUnused) mixed with OK bookings that are acted on.

// TestReviewNoDLHeldRefusalTextbook: one key, 20 ms interval, burst 2;
// reply latency 15 ms each way. A pool (HoldLate, gives back latest first)
// runs jobs, a third with tight deadlines (so some are refused late and
// held), a third cancelled at random times, a third free; beside it,
// direct ReserveBatch callers mix a free request (acted on: Wait, then
// recorded) with HoldLate requests of tight deadlines whose held refusals
// are cancelled at random delays, often after their slot has come, and
// direct Reserve+Wait callers. Every slot that ran (pool jobs started,
// direct Waits returned nil) is replayed through a textbook GCRA.
func TestReviewNoDLHeldRefusalTextbook(t *testing.T) {
	t.Parallel()
	eng, p, _ := proxiedEngine(t, 32)
	lim := throttle.PerSecond(50, 2)
	l, err := reserve.New(eng, "nodl1", lim, reserve.WithMaxWait(3*time.Second))
	require.NoError(t, err)
	bg := context.Background()
	require.NoError(t, eng.Client().(*redis.Client).Ping(bg).Err())
	p.SetLatency(25 * time.Millisecond)
	defer p.SetLatency(0)
	pl, err := pool.New(l, pool.WithWorkers(16))
	require.NoError(t, err)

	var mu sync.Mutex
	var ran []time.Time
	var heldCancels, heldAfterSlot, lastDelay atomic.Int64
	record := func(at time.Time) { mu.Lock(); ran = append(ran, at); mu.Unlock() }

	stop := time.Now().Add(4 * time.Second)
	var wg sync.WaitGroup
	// Pool jobs.
	var jobs []*pool.Job
	var jmu sync.Mutex
	wg.Add(1)
	go func() {
		defer wg.Done()
		for time.Now().Before(stop) {
			var ctx context.Context
			var cancel context.CancelFunc
			switch rand.IntN(3) {
			case 0:
				ctx, cancel = context.WithTimeout(bg, time.Duration(20+rand.IntN(200))*time.Millisecond)
			case 1:
				ctx, cancel = context.WithCancel(bg)
				time.AfterFunc(time.Duration(rand.IntN(300))*time.Millisecond, cancel)
			default:
				ctx, cancel = context.WithCancel(bg)
			}
			j, err := pl.Submit(ctx, "k", func(context.Context) error { return nil })
			if err != nil {
				cancel()
				continue
			}
			go func() { <-j.Done(); cancel() }()
			jmu.Lock()
			jobs = append(jobs, j)
			jmu.Unlock()
			time.Sleep(time.Duration(5+rand.IntN(20)) * time.Millisecond)
		}
	}()
	// Direct batches with held refusals, and direct reservations.
	for g := range 6 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for time.Now().Before(stop) {
				if g%3 != 2 {
					reqs := []reserve.BatchRequest{{N: 1, HoldLate: true}}
					var cancels []context.CancelFunc
					for range 1 + rand.IntN(3) {
						// Aim at the window where Redis books within the
						// budget but the reply's latency makes it late: the
						// key's current wait plus a little.
						d := time.Duration(lastDelay.Load()) + time.Duration(rand.IntN(90)-20)*time.Millisecond
						rctx, c := context.WithTimeout(bg, max(5*time.Millisecond, d))
						cancels = append(cancels, c)
						reqs = append(reqs, reserve.BatchRequest{Context: rctx, N: 1, HoldLate: true})
					}
					if rand.IntN(2) == 0 {
						reqs[0], reqs[len(reqs)-1] = reqs[len(reqs)-1], reqs[0]
					}
					rs, err := l.ReserveBatch(bg, "k", reqs)
					for _, c := range cancels {
						c()
					}
					if err != nil {
						t.Errorf("batch: %v", err)
						return
					}
					var acting []*reserve.Reservation
					var held []*reserve.Reservation
					for _, r := range rs {
						switch {
						case r.OK():
							acting = append(acting, r)
						case r.Booking().OK:
							held = append(held, r)
						}
					}
					// Held refusals: cancelled at random delays (often after
					// their slot has come), latest first as a pool does,
					// concurrently with the OK ones waiting and acting.
					var hw sync.WaitGroup
					hw.Add(1)
					go func() {
						defer hw.Done()
						time.Sleep(time.Duration(rand.IntN(120)) * time.Millisecond)
						for _, r := range slices.Backward(held) {
							if !time.Now().Before(r.SlotAt()) {
								heldAfterSlot.Add(1)
							}
							heldCancels.Add(1)
							_ = r.Cancel(bg)
						}
					}()
					for _, r := range acting {
						lastDelay.Store(int64(r.Delay()))
						if err := r.Wait(bg); err == nil {
							record(r.Booking().At)
						}
					}
					hw.Wait()
				} else {
					ctx, cancel := context.WithTimeout(bg, time.Duration(20+rand.IntN(400))*time.Millisecond)
					r, err := l.Reserve(ctx, "k")
					if err == nil && r.OK() {
						if rand.IntN(4) == 0 {
							_ = r.Cancel(bg)
						} else if r.Wait(ctx) == nil {
							record(r.Booking().At)
						}
					}
					cancel()
				}
			}
		}()
	}
	wg.Wait()
	cctx, ccancel := context.WithTimeout(bg, 10*time.Second)
	defer ccancel()
	require.NoError(t, pl.Wait(cctx))
	require.NoError(t, pl.Close(cctx))
	started := 0
	for _, j := range jobs {
		if !j.Started().IsZero() {
			started++
			record(j.Reservation().Booking().At)
		}
	}
	t.Logf("slots run %d (pool jobs %d of %d), held refusals cancelled %d (%d at or after their slot)",
		len(ran), started, len(jobs), heldCancels.Load(), heldAfterSlot.Load())
	require.Greater(t, heldCancels.Load(), int64(0), "the test made no held refusal")
	bad := nodlTextbook(lim, ran)
	require.Empty(t, bad, "slots run early against the textbook GCRA")
}

// TestReviewNoDLHeldAfterSlotUnderActor: deterministic. A batch books an
// OK request (acted on at once: its slot is immediate) and a HoldLate one
// with a tight deadline, refused late and held (idle key, burst 3, so its
// slot is immediate too). Then an outside caller books and acts; then the
// held refusal is cancelled after its slot came (RefundUnused). The next
// bookings must still conform to the textbook with the ones that ran.
func TestReviewNoDLHeldAfterSlotUnderActor(t *testing.T) {
	t.Parallel()
	eng, p, prefix := proxiedEngine(t, 8)
	probe := dlfProbeEngine(t, redistest.Shared(t), prefix)
	lim := throttle.PerSecond(5, 3) // 200 ms, 4 at once
	l, err := reserve.New(eng, "nodlh", lim, reserve.WithCoalescing(false), reserve.WithMaxWait(5*time.Second))
	require.NoError(t, err)
	bg := context.Background()
	require.NoError(t, eng.Client().(*redis.Client).Ping(bg).Err())
	for _, order := range []string{"held-last", "held-first"} {
		key := order
		var ran []time.Time
		p.SetReplyDelay(100 * time.Millisecond)
		rctx, cancel := context.WithTimeout(bg, 50*time.Millisecond)
		reqs := []reserve.BatchRequest{{N: 1}, {Context: rctx, N: 1, HoldLate: true}}
		if order == "held-first" {
			reqs[0], reqs[1] = reqs[1], reqs[0]
		}
		rs, err := l.ReserveBatch(bg, key, reqs)
		cancel()
		p.SetReplyDelay(0)
		require.NoError(t, err)
		var held *reserve.Reservation
		for _, r := range rs {
			if r.OK() {
				require.NoError(t, r.Wait(bg))
				ran = append(ran, r.Booking().At)
			} else {
				require.True(t, r.Booking().OK, "%s: held late", order)
				held = r
			}
		}
		require.NotNil(t, held)
		// An outsider books and acts.
		r2, err := l.Reserve(bg, key)
		require.NoError(t, err)
		require.NoError(t, r2.Wait(bg))
		ran = append(ran, r2.Booking().At)
		time.Sleep(50 * time.Millisecond)
		require.NoError(t, held.Cancel(bg))
		require.NoError(t, held.Cancel(bg))
		// Book everything left and act on it.
		for range 6 {
			r, err := l.Reserve(bg, key)
			require.NoError(t, err)
			require.True(t, r.OK())
			require.NoError(t, r.Wait(bg))
			ran = append(ran, r.Booking().At)
		}
		require.Empty(t, nodlTextbook(lim, ran), order)
		_ = probe
	}
}

// ---------------------------------------------------------------------------
// 2. Done firing mid-read (cancel, not deadline).

// TestReviewNoDLCancelMidRead: reply held 150 ms, the caller's context
// cancelled (no deadline) at 50 ms. Every path: the caller gets
// context.Canceled, not a lost reply, and nothing stands (the reply was
// read and the booking given back). With the engine's timeout and with
// WithTimeout(0). A coalesced group of six on one key, half cancelled:
// the units standing equal those the others hold.
func TestReviewNoDLCancelMidRead(t *testing.T) {
	t.Parallel()
	for _, timeout := range []time.Duration{10 * time.Second, 0} {
		eng, p, prefix := proxiedEngine(t, 16, throttle.WithTimeout(timeout))
		probe := dlfProbeEngine(t, redistest.Shared(t), prefix)
		lim := dlfLim(31)
		name := fmt.Sprintf("cm%d", timeout/time.Second)
		unco, err := reserve.New(eng, name, lim, reserve.WithCoalescing(false))
		require.NoError(t, err)
		co, err := reserve.New(eng, name, lim)
		require.NoError(t, err)
		bg := context.Background()
		require.NoError(t, eng.Client().(*redis.Client).Ping(bg).Err())
		runs := []struct {
			name string
			run  func(ctx context.Context, s string) error
		}{
			{"unco", func(ctx context.Context, s string) error { _, err := unco.ReserveN(ctx, s, 2); return err }},
			{"co", func(ctx context.Context, s string) error { _, err := co.ReserveN(ctx, s, 2); return err }},
			{"acquire", func(ctx context.Context, s string) error { return unco.AcquireN(ctx, s, 2) }},
			{"batch", func(ctx context.Context, s string) error {
				_, err := unco.ReserveBatch(ctx, s, []reserve.BatchRequest{{N: 1}, {N: 2, HoldLate: true}, {N: 1, Context: bg}})
				return err
			}},
		}
		for _, tc := range runs {
			s := tc.name
			p.SetReplyDelay(150 * time.Millisecond)
			ctx, cancel := context.WithCancel(bg)
			time.AfterFunc(50*time.Millisecond, cancel)
			start := time.Now()
			err := tc.run(ctx, s)
			took := time.Since(start)
			p.SetReplyDelay(0)
			require.ErrorIs(t, err, context.Canceled, "timeout %v %s", timeout, tc.name)
			require.False(t, errors.Is(err, throttle.ErrReplyLost), "timeout %v %s: reply lost: %v", timeout, tc.name, err)
			require.Equal(t, 0, dlfStanding(t, probe, name+":{"+s+"}", lim), "timeout %v %s (took %v): units stand", timeout, tc.name, took)
		}
		// Coalesced group.
		p.SetReplyDelay(150 * time.Millisecond)
		var held atomic.Int64
		var wg sync.WaitGroup
		for i := range 6 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				ctx, cancel := context.WithCancel(bg)
				defer cancel()
				if i%2 == 0 {
					time.AfterFunc(50*time.Millisecond, cancel)
				}
				r, err := co.ReserveN(ctx, "grp", 1)
				switch {
				case err == nil && r.OK():
					held.Add(1)
				case err != nil && errors.Is(err, context.Canceled) && i%2 == 0:
					if errors.Is(err, throttle.ErrReplyLost) {
						t.Errorf("reply lost: %v", err)
					}
				default:
					t.Errorf("caller %d: %v %v", i, r, err)
				}
			}()
		}
		wg.Wait()
		p.SetReplyDelay(0)
		st := dlfStanding(t, probe, name+":{grp}", lim)
		t.Logf("timeout %v: coalesced group held %d, standing %d", timeout, held.Load(), st)
		require.GreaterOrEqual(t, st, int(held.Load()))
	}
}

// ---------------------------------------------------------------------------
// 3. The breaker and an ended caller on a paused Redis.

// TestReviewNoDLPausedBreaker: Redis paused (CLIENT PAUSE ALL, 2.5 s),
// engine timeout 300 ms. Two engines, each its own breaker. On the first, a
// caller whose 60 ms deadline passes while the call is out: the call now
// runs to the engine's timeout (the deadline is hidden from go-redis) and
// fails on it, as the control's does. On the second, the control: a
// caller with no end. Then a caller with no end on each engine. The
// control's breaker opened (its second caller fails fast); the ended
// caller's call met the same timeout on the same paused Redis, so the
// breaker's view should be the same. (At 33736e2 the ended caller's
// timeout was judged "caller gave up", and its breaker stayed closed.)
func TestReviewNoDLPausedBreaker(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	bg := context.Background()
	mk := func() (*throttle.Engine, *reserve.Limiter) {
		prefix := redistest.Prefix(t)
		eng, err := throttle.New(srv.Client(t), throttle.WithPrefix(prefix), throttle.WithTimeout(300*time.Millisecond))
		require.NoError(t, err)
		require.NoError(t, eng.Load(bg))
		l, err := reserve.New(eng, "pb", dlfLim(9), reserve.WithCoalescing(false))
		require.NoError(t, err)
		return eng, l
	}
	engE, lE := mk()
	engC, lC := mk()
	// Warm connections.
	for _, l := range []*reserve.Limiter{lE, lC} {
		r, err := l.Reserve(bg, "warm")
		require.NoError(t, err)
		require.NoError(t, r.Cancel(bg))
	}
	require.NoError(t, srv.Client(t).Do(bg, "CLIENT", "PAUSE", 2500, "ALL").Err())
	type out struct {
		first, second         error
		firstTook, secondTook time.Duration
		openAfterFirst        bool
	}
	run := func(l *reserve.Limiter, eng *throttle.Engine, firstCtx func() (context.Context, context.CancelFunc)) out {
		var o out
		ctx, cancel := firstCtx()
		start := time.Now()
		_, o.first = l.ReserveN(ctx, "k", 1)
		o.firstTook = time.Since(start)
		cancel()
		o.openAfterFirst, _ = eng.Unavailable()
		start = time.Now()
		_, o.second = l.ReserveN(bg, "k2", 1)
		o.secondTook = time.Since(start)
		return o
	}
	var e, c out
	var wg sync.WaitGroup
	wg.Add(2)
	go func() {
		defer wg.Done()
		e = run(lE, engE, func() (context.Context, context.CancelFunc) { return context.WithTimeout(bg, 60*time.Millisecond) })
	}()
	go func() {
		defer wg.Done()
		c = run(lC, engC, func() (context.Context, context.CancelFunc) { return context.WithCancel(bg) })
	}()
	wg.Wait()
	t.Logf("ended caller: %v in %v; breaker open after: %v; next caller: %v in %v", e.first, e.firstTook, e.openAfterFirst, e.second, e.secondTook)
	t.Logf("control:      %v in %v; breaker open after: %v; next caller: %v in %v", c.first, c.firstTook, c.openAfterFirst, c.second, c.secondTook)
	require.ErrorIs(t, e.first, context.DeadlineExceeded)
	require.ErrorIs(t, c.first, throttle.ErrUnavailable)
	require.True(t, c.openAfterFirst, "control: the breaker opened")
	// The ended caller's call was cut by the engine's own timeout on a
	// paused server, not by the caller: the same evidence as the control's.
	require.Greater(t, e.firstTook, 250*time.Millisecond, "the ended caller's call ran to the engine's timeout")
	require.Equal(t, c.openAfterFirst, e.openAfterFirst,
		"a call that ran to the engine's timeout on a paused Redis left the breaker closed because its caller's deadline (hidden from go-redis) had passed: the next caller waits the timeout again (%v vs the control's %v)", e.secondTook, c.secondTook)
}

// TestReviewNoDLPausedCancelled: the same with a caller cancelled (no
// deadline) mid-call, and many such callers in turn: is any later caller
// misjudged (breaker open after Redis is back, or still closed while it
// is paused)? Logged per caller, asserted only that once the pause ends
// a caller with no end is served by Redis within the probe backoff.
func TestReviewNoDLPausedCancelled(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	bg := context.Background()
	prefix := redistest.Prefix(t)
	eng, err := throttle.New(srv.Client(t), throttle.WithPrefix(prefix), throttle.WithTimeout(300*time.Millisecond))
	require.NoError(t, err)
	require.NoError(t, eng.Load(bg))
	l, err := reserve.New(eng, "pc", dlfLim(9), reserve.WithCoalescing(false))
	require.NoError(t, err)
	r, err := l.Reserve(bg, "warm")
	require.NoError(t, err)
	require.NoError(t, r.Cancel(bg))
	require.NoError(t, srv.Client(t).Do(bg, "CLIENT", "PAUSE", 1500, "ALL").Err())
	pauseEnd := time.Now().Add(1500 * time.Millisecond)
	var timeouts int
	for i := 0; time.Now().Before(pauseEnd.Add(-350 * time.Millisecond)); i++ {
		ctx, cancel := context.WithCancel(bg)
		time.AfterFunc(30*time.Millisecond, cancel)
		start := time.Now()
		_, err := l.ReserveN(ctx, fmt.Sprintf("c%d", i), 1)
		took := time.Since(start)
		cancel()
		open, _ := eng.Unavailable()
		if took > 250*time.Millisecond {
			timeouts++
		}
		t.Logf("cancelled caller %d: %v in %v, breaker open %v", i, err, took, open)
	}
	t.Logf("%d cancelled callers each waited out the engine's timeout on the paused Redis", timeouts)
	time.Sleep(time.Until(pauseEnd) + 200*time.Millisecond)
	redistest.UntilOK(t, func() error {
		r, err := l.ReserveN(bg, "after", 1)
		if err != nil {
			return err
		}
		return r.Cancel(bg)
	})
}

// ---------------------------------------------------------------------------
// 4. Coalesced callers with deadlines around the reply.

// TestReviewNoDLCoalescedDeadlines: 32 goroutines on one key, coalescing
// on, replies held 30 ms, deadlines 20..45 ms from each call, 4 rounds.
// Hard: no OK Reservation whose slot (local act time) is past its
// caller's deadline; standing units never fewer than held ones. Logged:
// room lost (standing - held) and OK answers returned after the deadline.
func TestReviewNoDLCoalescedDeadlines(t *testing.T) {
	t.Parallel()
	eng, p, prefix := proxiedEngine(t, 16)
	probe := dlfProbeEngine(t, redistest.Shared(t), prefix)
	lim := dlfLim(511)
	l, err := reserve.New(eng, "cd", lim, reserve.WithCoalescing(true))
	require.NoError(t, err)
	bg := context.Background()
	require.NoError(t, eng.Client().(*redis.Client).Ping(bg).Err())
	p.SetReplyDelay(30 * time.Millisecond)
	var held, oks, okLateReturn, ctxErrs, refused atomic.Int64
	var bad []string
	var mu sync.Mutex
	var wg sync.WaitGroup
	for g := range 32 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for range 4 {
				ctx, cancel := context.WithTimeout(bg, time.Duration(20000+rand.IntN(25000))*time.Microsecond)
				dl, _ := ctx.Deadline()
				r, err := l.ReserveN(ctx, "k", 1+g%2)
				back := time.Now()
				cancel()
				switch {
				case err == nil && r.OK():
					held.Add(int64(1 + g%2))
					oks.Add(1)
					if r.SlotAt().After(dl) {
						mu.Lock()
						bad = append(bad, fmt.Sprintf("OK with slot %v past the deadline", r.SlotAt().Sub(dl)))
						mu.Unlock()
					}
					if back.After(dl) {
						okLateReturn.Add(1)
					}
				case err == nil || errors.Is(err, reserve.ErrWouldExceedDeadline):
					refused.Add(1)
				case dlfIsCtxErr(err):
					ctxErrs.Add(1)
				default:
					t.Errorf("unexpected: %v", err)
				}
			}
		}()
	}
	wg.Wait()
	p.SetReplyDelay(0)
	st := dlfStanding(t, probe, "cd:{k}", lim)
	t.Logf("held %d standing %d (room lost %d); ok %d (returned after deadline %d) ctxErr %d refused %d",
		held.Load(), st, st-int(held.Load()), oks.Load(), okLateReturn.Load(), ctxErrs.Load(), refused.Load())
	require.Empty(t, bad)
	require.GreaterOrEqual(t, st, int(held.Load()), "a give-back took room a caller holds")
}

// ---------------------------------------------------------------------------
// 5. Leaks, Cancel twice, Cancel after ReserveBatch's error.

// TestReviewNoDLLeaksAndCancelAfterBatchErr: 30 rounds of every path
// cancelled mid-read leave no goroutines behind. A batch B1 that stands,
// then a batch B2 on the same key whose ctx is cancelled in flight
// (error, its bookings given back latest first); then B1's Reservations
// cancelled twice each, latest first: everything comes back. A booking
// made afterwards is not given back by any further Cancel. Not parallel,
// so that other tests' goroutines do not count.
func TestReviewNoDLLeaksAndCancelAfterBatchErr(t *testing.T) {
	// Not parallel: the goroutine count must be this test's alone.
	eng, p, prefix := proxiedEngine(t, 8)
	probe := dlfProbeEngine(t, redistest.Shared(t), prefix)
	lim := dlfLim(63)
	unco, err := reserve.New(eng, "lk", lim, reserve.WithCoalescing(false))
	require.NoError(t, err)
	co, err := reserve.New(eng, "lk", lim)
	require.NoError(t, err)
	bg := context.Background()
	require.NoError(t, eng.Client().(*redis.Client).Ping(bg).Err())
	round := func() {
		p.SetReplyDelay(30 * time.Millisecond)
		defer p.SetReplyDelay(0)
		var wg sync.WaitGroup
		for j, run := range []func(ctx context.Context) error{
			func(ctx context.Context) error { _, err := unco.ReserveN(ctx, "a", 1); return err },
			func(ctx context.Context) error { _, err := co.ReserveN(ctx, "b", 1); return err },
			func(ctx context.Context) error { return unco.AcquireN(ctx, "c", 1) },
			func(ctx context.Context) error {
				_, err := unco.ReserveBatch(ctx, "d", []reserve.BatchRequest{{N: 1}, {N: 1, HoldLate: true}, {N: 2}})
				return err
			},
		} {
			wg.Add(1)
			go func() {
				defer wg.Done()
				ctx, cancel := context.WithCancel(bg)
				time.AfterFunc(10*time.Millisecond, cancel)
				if err := run(ctx); !errors.Is(err, context.Canceled) {
					t.Errorf("path %d: %v", j, err)
				}
			}()
		}
		wg.Wait()
	}
	round()
	settle := func() int {
		n := runtime.NumGoroutine()
		for range 100 {
			time.Sleep(20 * time.Millisecond)
			m := runtime.NumGoroutine()
			if m == n {
				break
			}
			n = m
		}
		return n
	}
	before := settle()
	for range 30 {
		round()
	}
	after := settle()
	t.Logf("goroutines %d -> %d", before, after)
	require.LessOrEqual(t, after, before+10)
	for _, k := range []string{"a", "b", "c", "d"} {
		require.Equal(t, 0, dlfStanding(t, probe, "lk:{"+k+"}", lim), "key %s", k)
	}

	// B1 stands (its slots hours ahead, behind a filler of the whole
	// burst), B2 ends in flight.
	lim3 := dlfLim(3)
	l3, err := reserve.New(eng, "lk3", lim3, reserve.WithCoalescing(false), reserve.WithoutMaxWait())
	require.NoError(t, err)
	filler, err := l3.ReserveN(bg, "e", 4)
	require.NoError(t, err)
	require.True(t, filler.OK())
	b1, err := l3.ReserveBatch(bg, "e", []reserve.BatchRequest{{N: 1}, {N: 2, HoldLate: true}})
	require.NoError(t, err)
	for _, r := range b1 {
		require.True(t, r.OK())
		require.Greater(t, r.Delay(), 30*time.Minute)
	}
	p.SetReplyDelay(100 * time.Millisecond)
	ctx, cancel := context.WithCancel(bg)
	time.AfterFunc(30*time.Millisecond, cancel)
	b2, err := l3.ReserveBatch(ctx, "e", []reserve.BatchRequest{{N: 1}, {N: 1, HoldLate: true}, {N: 3}})
	p.SetReplyDelay(0)
	require.ErrorIs(t, err, context.Canceled)
	require.Nil(t, b2)
	for _, r := range slices.Backward(b1) {
		require.NoError(t, r.Cancel(bg))
		require.NoError(t, r.Cancel(bg))
	}
	r3, err := l3.ReserveN(bg, "e", 2)
	require.NoError(t, err)
	require.True(t, r3.OK())
	for _, r := range b1 {
		require.NoError(t, r.Cancel(bg))
	}
	require.Equal(t, 4+2, dlfStanding(t, probe, "lk3:{e}", lim3), "B1 and B2 all given back; the filler and r3 stand")
}

// TestReviewNoDLCoalescedAllEnded: 16 callers of one key, coalescing on,
// replies held 120 ms, every caller's deadline 40 ms: every caller gets
// its context's error and no one holds anything, so by the textbook
// nothing stands. (ReserveBatch gives an ended caller's bookings back
// latest first for this reason; the members of a coalesced batch each give
// theirs back on their own, at once.)
func TestReviewNoDLCoalescedAllEnded(t *testing.T) {
	t.Parallel()
	eng, p, prefix := proxiedEngine(t, 16)
	probe := dlfProbeEngine(t, redistest.Shared(t), prefix)
	lim := dlfLim(255)
	l, err := reserve.New(eng, "ae", lim, reserve.WithCoalescing(true))
	require.NoError(t, err)
	bg := context.Background()
	require.NoError(t, eng.Client().(*redis.Client).Ping(bg).Err())
	p.SetReplyDelay(120 * time.Millisecond)
	var wg sync.WaitGroup
	var ctxErrs atomic.Int64
	for range 16 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			ctx, cancel := context.WithTimeout(bg, 40*time.Millisecond)
			defer cancel()
			_, err := l.ReserveN(ctx, "k", 1)
			if dlfIsCtxErr(err) {
				ctxErrs.Add(1)
			} else {
				t.Errorf("unexpected: %v", err)
			}
		}()
	}
	wg.Wait()
	p.SetReplyDelay(0)
	st := dlfStanding(t, probe, "ae:{k}", lim)
	t.Logf("%d callers ended in flight; units standing held by no one: %d", ctxErrs.Load(), st)
	// Logged, not asserted: the callers sent alone (fewer than four others
	// in flight) book one after another and give back as their replies
	// come, the earliest first, so the earlier ones find a later booking
	// standing and give nothing (Cancel's documented rule). 0-2 units here.
	_ = st
}

// TestReviewNoDLNoTimeoutCoalescedBatch: WithTimeout(0), where ReserveN's
// doc at 33736e2 said "with no engine timeout, ctx bounds the call as it
// would any other", which held only for a call of one caller (older than
// 33736e2); the doc now says the client's own timeouts bound a call shared
// with other callers, and this test checks that. Four callers of one key (deadlines 5 s) go out with
// replies held 300 ms; then replies are held 2 s and six more callers,
// deadlines 500 ms, come: coalesced, they queue behind the four and go out
// as one batch once the first is back (sent on context.WithoutCancel: no
// deadline, no end, and the queued callers wait for it without watching
// their own context). Control: the same callers uncoalesced (each bound by
// its own context). Each caller's return past its own deadline. An engine
// per mode (see TestReviewNoDLNoTimeoutBreaker).
func TestReviewNoDLNoTimeoutCoalescedBatch(t *testing.T) {
	t.Parallel()
	lim := dlfLim(63)
	bg := context.Background()
	worst := map[bool]time.Duration{}
	for _, coalesce := range []bool{false, true} {
		eng, p, _ := proxiedEngine(t, 32, throttle.WithTimeout(0))
		require.NoError(t, eng.Client().(*redis.Client).Ping(bg).Err())
		l, err := reserve.New(eng, "nt", lim, reserve.WithCoalescing(coalesce))
		require.NoError(t, err)
		p.SetReplyDelay(300 * time.Millisecond)
		var wg sync.WaitGroup
		var mu sync.Mutex
		for i := range 10 {
			if i == 4 {
				time.Sleep(30 * time.Millisecond) // the first four in flight
				p.SetReplyDelay(2 * time.Second)
			}
			wg.Add(1)
			go func() {
				defer wg.Done()
				d := 5 * time.Second
				if i >= 4 {
					d = 500 * time.Millisecond
				}
				ctx, cancel := context.WithTimeout(bg, d)
				defer cancel()
				dl, _ := ctx.Deadline()
				r, err := l.ReserveN(ctx, "k", 1)
				past := time.Since(dl)
				if i < 4 {
					if err == nil {
						_ = r.Cancel(bg)
					}
					return
				}
				if !dlfIsCtxErr(err) {
					t.Errorf("coalesce %v caller %d: %v", coalesce, i, err)
				}
				mu.Lock()
				worst[coalesce] = max(worst[coalesce], past)
				mu.Unlock()
			}()
		}
		wg.Wait()
		p.SetReplyDelay(0)
	}
	t.Logf("WithTimeout(0): latest return past a 500 ms deadline: uncoalesced %v, coalesced %v", worst[false], worst[true])
	require.Less(t, worst[false], 300*time.Millisecond, "WithTimeout(0): a caller alone is bounded by its own context")
	// go-redis's default ReadTimeout, 3 s, bounds the shared call.
	require.Less(t, worst[true], 3*time.Second+300*time.Millisecond,
		"WithTimeout(0): a call shared by coalesced callers is bounded by the client's ReadTimeout (ReserveN's doc)")
}

// TestReviewNoDLNoTimeoutBreaker: WithTimeout(0): the engine bounds the
// call by the caller's own context (waitbound.Of), so the socket's read
// deadline is the caller's deadline; but the engine classifies the error
// on the context reserve handed it, WithoutDeadline's, which reports no
// deadline. When the socket's deadline fires before the context's timer
// has set Err (the throttle doc's own caveat: "the socket's deadline can
// fire before the context says so"), callerEnded finds neither an Err nor
// a deadline and classed the caller's own timeout as Redis down (at
// 33736e2): the breaker opened and every later caller failed fast on a
// healthy Redis.
// Control: the engine's AllowN on the same kind of context, whose deadline
// callerEnded can see. Thirty trials each, a fresh engine per trial.
func TestReviewNoDLNoTimeoutBreaker(t *testing.T) {
	t.Parallel()
	bg := context.Background()
	lim := dlfLim(9)
	opened := map[string]int{}
	for trial := range 30 {
		for _, mode := range []string{"reserve", "engine"} {
			eng, p, _ := proxiedEngine(t, 8, throttle.WithTimeout(0))
			require.NoError(t, eng.Client().(*redis.Client).Ping(bg).Err())
			l, err := reserve.New(eng, "nb", lim, reserve.WithCoalescing(false))
			require.NoError(t, err)
			p.SetReplyDelay(500 * time.Millisecond)
			ctx, cancel := context.WithTimeout(bg, 60*time.Millisecond)
			if mode == "reserve" {
				_, err = l.ReserveN(ctx, fmt.Sprint("k", trial), 1)
			} else {
				_, err = eng.AllowN(ctx, "nb:{x}", lim, 1)
			}
			cancel()
			p.SetReplyDelay(0)
			if open, _ := eng.Unavailable(); open {
				opened[mode]++
				t.Logf("trial %d %s: breaker opened by a caller's own deadline: %v", trial, mode, err)
			}
			p.Close()
		}
	}
	t.Logf("breaker opened in %d of 30 trials through reserve, %d of 30 through the engine", opened["reserve"], opened["engine"])
	require.Zero(t, opened["engine"], "control")
	require.Zero(t, opened["reserve"], "WithTimeout(0): a caller's deadline passing in flight opened the breaker (classified as Redis down)")
}
