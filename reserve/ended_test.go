package reserve_test

import (
	"context"
	"errors"
	"math/rand/v2"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/slotbook/slotbook/deadline"
	"github.com/slotbook/slotbook/internal/testhook"
	"github.com/slotbook/slotbook/reserve"
	"github.com/slotbook/slotbook/throttle"
)

// gcraOracle is a textbook GCRA (virtual scheduling) over several limits at
// a frozen clock: each limit keeps a theoretical arrival time; n units
// conform at the earliest t >= now with t >= TAT + (n-1)*T - tau for every
// limit, and booking them at t moves each TAT to max(TAT, t) + n*T.
type gcraOracle struct {
	now  time.Time
	lims []throttle.Limit
	tat  []time.Time
}

func newOracle(now time.Time, lims []throttle.Limit) *gcraOracle {
	o := &gcraOracle{now: now, lims: lims}
	for range lims {
		o.tat = append(o.tat, now)
	}
	return o
}

func (o *gcraOracle) slot(n int) time.Time {
	at := o.now
	for i, lim := range o.lims {
		T := lim.Interval()
		tau := time.Duration(lim.Burst) * T
		if t := o.tat[i].Add(time.Duration(n-1)*T - tau); t.After(at) {
			at = t
		}
	}
	return at
}

func (o *gcraOracle) book(n int, at time.Time) {
	for i, lim := range o.lims {
		base := o.tat[i]
		if at.After(base) {
			base = at
		}
		o.tat[i] = base.Add(time.Duration(n) * lim.Interval())
	}
}

// TestBatchEndedMixMatchesGCRA: batches mixing cancelled, live and
// deadline-passed requests of 1 to 3 units, on two layered limits, with a
// max wait that refuses some live requests between bookings: every live
// request's answer is the textbook GCRA's, and the same as in a batch of
// the live requests alone on a fresh key; ended requests book nothing; a
// batch makes one call if any request is live, none otherwise.
func TestBatchEndedMixMatchesGCRA(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	lims := []throttle.Limit{throttle.PerSecond(10, 2), throttle.PerMinute(20, 4)}
	l, err := reserve.New(e.eng, "api", lims[0], reserve.WithLimit(lims[1]), reserve.WithMaxWait(4*time.Second))
	require.NoError(t, err)
	now := time.UnixMicro(time.Now().UnixMicro())
	base := testhook.WithNow(context.Background(), now.UnixMicro())
	require.NoError(t, e.eng.Load(base))
	cancelled, cancel := context.WithCancel(base)
	cancel()
	expired, cancel2 := context.WithDeadline(base, time.Now().Add(-time.Second))
	defer cancel2()

	rng := rand.New(rand.NewPCG(1, uint64(time.Now().UnixNano())))
	o := newOracle(now, lims)
	for round := 0; round < 12; round++ {
		var mixed, live []reserve.BatchRequest
		size := 1 + rng.IntN(8)
		for i := 0; i < size; i++ {
			r := reserve.BatchRequest{N: 1 + rng.IntN(3)}
			switch rng.IntN(3) {
			case 0:
				r.Context = cancelled
			case 1:
				r.Context = expired
			default:
				live = append(live, r)
			}
			mixed = append(mixed, r)
		}
		before := e.calls.Load()
		rs, err := l.ReserveBatch(base, "mix", mixed)
		require.NoError(t, err)
		require.Len(t, rs, len(mixed))
		wantCalls := int64(0)
		if len(live) > 0 {
			wantCalls = 1
		}
		require.Equal(t, wantCalls, e.calls.Load()-before, "round %d: calls for %d live of %d", round, len(live), len(mixed))

		var ctl []*reserve.Reservation
		if len(live) > 0 {
			// The control key gets the live requests of every round alone.
			ctl, err = l.ReserveBatch(base, "ctl", live)
			require.NoError(t, err)
		}
		li := 0
		for i, r := range rs {
			switch mixed[i].Context {
			case cancelled:
				require.False(t, r.OK(), "round %d request %d", round, i)
				require.ErrorIs(t, r.Err(), context.Canceled, "round %d request %d", round, i)
				require.Zero(t, r.Booking(), "round %d request %d", round, i)
			case expired:
				require.False(t, r.OK(), "round %d request %d", round, i)
				require.Zero(t, r.Booking(), "round %d request %d", round, i)
			default:
				want := o.slot(mixed[i].N)
				if want.Sub(now) > 4*time.Second {
					require.False(t, r.OK(), "round %d request %d: textbook slot %v past the max wait", round, i, want.Sub(now))
					require.ErrorIs(t, r.Err(), reserve.ErrMaxWaitExceeded)
					require.Equal(t, want.Sub(now), r.RetryAfter(), "round %d request %d", round, i)
				} else {
					require.True(t, r.OK(), "round %d request %d: %v", round, i, r.Err())
					require.Equal(t, want, r.Booking().At, "round %d request %d of %d units", round, i, mixed[i].N)
					require.Equal(t, want.Sub(now), r.Booking().Wait, "round %d request %d", round, i)
					o.book(mixed[i].N, want)
				}
				c := ctl[li]
				require.Equal(t, c.OK(), r.OK(), "round %d request %d: as without the ended ones", round, i)
				cb, rb := c.Booking(), r.Booking()
				require.Equal(t, [3]any{cb.OK, cb.N, cb.Wait}, [3]any{rb.OK, rb.N, rb.Wait}, "round %d request %d: as without the ended ones", round, i)
				require.True(t, cb.At.Equal(rb.At), "round %d request %d: at %v, %v without the ended ones", round, i, rb.At.Sub(now), cb.At.Sub(now))
				require.Equal(t, c.RetryAfter(), r.RetryAfter(), "round %d request %d", round, i)
				li++
			}
		}
		require.Equal(t, len(live), li)
	}
	// Nothing else was booked: a one-unit request with a longer budget
	// lands where the oracle says.
	unc, err := l.With(reserve.WithoutMaxWait())
	require.NoError(t, err)
	r, err := unc.Reserve(base, "mix")
	require.NoError(t, err)
	require.True(t, r.OK())
	require.Equal(t, o.slot(1), r.Booking().At)
}

// TestBatchEndedErrMatchesReserveN: for each way a request's context can
// have ended, the Err of its ReserveBatch answer is what ReserveN returns
// for the same context, as the ReserveBatch doc says ("its Err is the
// context's error").
func TestBatchEndedErrMatchesReserveN(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	base := testhook.WithNow(context.Background(), time.Now().UnixMicro())
	require.NoError(t, e.eng.Load(base))
	cancelled, cancel := context.WithCancel(base)
	cancel()
	expired, cancel2 := context.WithDeadline(base, time.Now().Add(-time.Millisecond))
	defer cancel2()
	// Cancelled, with a deadline still ahead but closer than the work.
	cancelledSoon, cancel3 := context.WithDeadline(base, time.Now().Add(time.Second))
	cancel3()
	for _, tc := range []struct {
		name string
		ctx  context.Context
		opts []reserve.Option
	}{
		{"cancelled", cancelled, nil},
		{"deadline passed", expired, nil},
		{"cancelled, deadline within the work estimate", cancelledSoon, []reserve.Option{reserve.WithWorkEstimate(time.Minute)}},
		{"cancelled, max wait 0", cancelled, []reserve.Option{reserve.WithMaxWait(0)}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			for _, coalesce := range []bool{true, false} {
				l := e.limiter(t, throttle.PerSecond(10, 1), append(tc.opts, reserve.WithCoalescing(coalesce))...)
				want := tc.ctx.Err()
				r, err := l.ReserveN(tc.ctx, "e", 1)
				require.Nil(t, r)
				require.Equal(t, want, err, "ReserveN")
				before := e.calls.Load()
				rs, err := l.ReserveBatch(base, "e", []reserve.BatchRequest{{Context: tc.ctx, N: 1}})
				require.NoError(t, err)
				require.Equal(t, before, e.calls.Load(), "no call")
				require.False(t, rs[0].OK())
				require.Equal(t, want, rs[0].Err(), "ReserveBatch's Err for an ended context (ReserveN gave %v)", want)
			}
		})
	}
}

// TestEndedReservationInert: every method of the answer to an ended
// request is safe and makes no call: Cancel is a no-op, Wait returns Err.
func TestEndedReservationInert(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	l := e.limiter(t, throttle.PerSecond(10, 0))
	base := testhook.WithNow(context.Background(), time.Now().UnixMicro())
	require.NoError(t, e.eng.Load(base))
	fill(t, l, base)
	cancelled, cancel := context.WithCancel(base)
	cancel()
	rs, err := l.ReserveBatch(base, "k", []reserve.BatchRequest{{Context: cancelled, N: 1}})
	require.NoError(t, err)
	r := rs[0]
	before := e.calls.Load()
	require.False(t, r.OK())
	require.ErrorIs(t, r.Err(), context.Canceled)
	require.False(t, r.Fallback())
	require.Zero(t, r.RetryAfter())
	require.Zero(t, r.Booking())
	require.True(t, r.SlotAt().IsZero())
	require.Zero(t, r.Delay())
	require.Zero(t, r.DelayFrom(time.Now()))
	require.NoError(t, r.Cancel(base))
	require.NoError(t, r.Cancel(cancelled))
	require.ErrorIs(t, r.Wait(base), context.Canceled)
	var de *deadline.Error
	require.False(t, errors.As(r.Err(), &de), "not a refusal")
	_, ok := deadline.RetryAfterOf(r.Err())
	require.False(t, ok)
	require.Equal(t, before, e.calls.Load(), "no call from the ended reservation's methods")
	// The key is as fill left it: the next slot is one interval on.
	next, err := l.Reserve(base, "k")
	require.NoError(t, err)
	require.Equal(t, 100*time.Millisecond, next.Booking().Wait)
}

// TestCoalescedRandomCancels: many callers of one key, through a slow
// Redis, each cancelling at a random time. Every caller gets either an OK
// reservation and no error, or (nil, context.Canceled); the OK callers'
// slots are the distinct textbook slots 0..k-1 after the ones before them;
// and the key's next slot is at least after every OK booking and at most
// after every booking any caller could have had (a give-back only returns
// room no later booking stands on).
func TestCoalescedRandomCancels(t *testing.T) {
	t.Parallel()
	eng, p, _ := proxiedEngine(t, 8)
	const burst = 0
	limit := throttle.PerSecond(100, burst) // 10 ms apart
	l, err := reserve.New(eng, "api", limit)
	require.NoError(t, err)
	now := time.UnixMicro(time.Now().UnixMicro())
	base := testhook.WithNow(context.Background(), now.UnixMicro())
	p.SetLatency(15 * time.Millisecond)
	const callers = 48
	var (
		mu    sync.Mutex
		slots = map[time.Time]int{}
		oks   int
		errs  int
		wg    sync.WaitGroup
	)
	for g := 0; g < callers; g++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			ctx, cancel := context.WithCancel(base)
			defer cancel()
			d := time.Duration(rand.IntN(300)) * time.Millisecond
			stop := time.AfterFunc(d, cancel)
			defer stop.Stop()
			r, err := l.Reserve(ctx, "k")
			mu.Lock()
			defer mu.Unlock()
			switch {
			case err == nil:
				if r == nil || !r.OK() {
					t.Errorf("nil error without an OK reservation: %v", r)
					return
				}
				oks++
				slots[r.Booking().At]++
			case errors.Is(err, context.Canceled):
				errs++
				if r != nil {
					t.Errorf("an error and a reservation: %v, OK %v", err, r.OK())
				}
			default:
				t.Errorf("unexpected error %v", err)
			}
		}()
	}
	wg.Wait()
	p.SetLatency(0)
	for at, n := range slots {
		require.Equal(t, 1, n, "slot %v booked %d times", at.Sub(now), n)
	}
	next, err := l.Reserve(base, "k")
	require.NoError(t, err)
	require.True(t, next.OK())
	iv := limit.Interval()
	require.GreaterOrEqual(t, next.Booking().Wait, time.Duration(oks)*iv, "every OK booking still stands")
	require.LessOrEqual(t, next.Booking().Wait, time.Duration(callers)*iv)
	t.Logf("%d OK, %d cancelled, next slot %v (OK alone: %v)", oks, errs, next.Booking().Wait, time.Duration(oks)*iv)
}
