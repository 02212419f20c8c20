package reserve_test

// Review of 7477926 (the engine merges single bookings that find every
// connection busy into one call) through package reserve: callers alone
// (what a Limiter sends for one caller) are merged, across Limiters and
// keys. Bookings are replayed through a textbook GCRA written here, on
// the Redis clock (Booking().At - Booking().Wait is the decision time).

import (
	"context"
	"fmt"
	"math/rand/v2"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/slotbook/slotbook/deadline"
	"github.com/slotbook/slotbook/internal/callcount"
	"github.com/slotbook/slotbook/internal/redistest"
	"github.com/slotbook/slotbook/reserve"
	"github.com/slotbook/slotbook/throttle"
)

// reviewMergeEngine is an engine (merging on, the default) whose client
// has pool connections, through a proxy, and the proxy.
func reviewMergeEngine(t *testing.T, srv *redistest.Server, pool int, opts ...throttle.Option) (*throttle.Engine, *redistest.Proxy, *callcount.Counter) {
	t.Helper()
	p := redistest.NewProxy(t, srv.Addr)
	rdb := p.Client(t, srv, func(o *redis.Options) { o.PoolSize = pool })
	eng, err := throttle.New(rdb, append([]throttle.Option{throttle.WithPrefix(redistest.Prefix(t)), throttle.WithTimeout(5 * time.Second)}, opts...)...)
	require.NoError(t, err)
	require.NoError(t, eng.Load(context.Background()))
	require.NoError(t, rdb.Ping(context.Background()).Err())
	return eng, p, callcount.Attach(rdb)
}

// gcra is a textbook GCRA for one limit, cell by cell: cell j of a
// request of n conforms at t if t >= tat + j*I - tau; the request's slot
// is the earliest t >= now at which all its cells conform, and it is
// booked if slot - now <= maxWait.
type gcra struct {
	I, tau, tat int64 // µs; tat 0 = never booked
}

func (g gcra) judge(now int64, n int, maxWait int64) (next gcra, ok bool, wait int64) {
	tat := max(g.tat, now)
	slot := now
	for j := range n {
		slot = max(slot, tat+int64(j)*g.I-g.tau)
	}
	if slot-now > maxWait {
		return g, false, slot - now
	}
	for range n {
		tat = max(tat, slot) + g.I
	}
	g.tat = tat
	return g, true, slot - now
}

type revBooking struct {
	n       int
	maxWait int64 // µs
	b       throttle.Booking
}

func decided(r revBooking) int64 { return r.b.At.UnixMicro() - r.b.Wait.Microseconds() }

// fitsInSomeOrder reports whether some order of group (decided at one
// Redis time: one call) gives every reply from g, and g as it leaves it.
func fitsInSomeOrder(g gcra, group []revBooking) (gcra, bool) {
	if len(group) == 0 {
		return g, true
	}
	for i, r := range group {
		next, ok, wait := g.judge(decided(r), r.n, r.maxWait)
		if ok != r.b.OK || wait != r.b.Wait.Microseconds() {
			continue
		}
		if end, ok := fitsInSomeOrder(next, append(slices.Clone(group[:i]), group[i+1:]...)); ok {
			return end, true
		}
	}
	return g, false
}

// TestReviewMergeReserveSameNameMatchesTextbook: two Limiters of one name
// and limit (one coalescing, one not; different max waits) serve 24
// callers on four subjects through a client of one or two connections,
// so that merged calls carry one key several times, beside coalesced
// batches. Every booking's reply is what a textbook GCRA gives in Redis's
// order.
func TestReviewMergeReserveSameNameMatchesTextbook(t *testing.T) {
	t.Parallel()
	for _, pool := range []int{1, 2} {
		t.Run(fmt.Sprintf("pool=%d", pool), func(t *testing.T) {
			eng, _, calls := reviewMergeEngine(t, redistest.Shared(t), pool)
			before := calls.Load()
			lim := throttle.PerSecond(40, 2)
			a, err := reserve.New(eng, "same", lim, reserve.WithMaxWait(0))
			require.NoError(t, err)
			b, err := reserve.New(eng, "same", lim, reserve.WithMaxWait(200*time.Millisecond), reserve.WithCoalescing(false))
			require.NoError(t, err)
			var (
				mu   sync.Mutex
				recs = map[string][]revBooking{}
				wg   sync.WaitGroup
			)
			errs := make(chan error, 24)
			for w := range 24 {
				wg.Go(func() {
					rng := rand.New(rand.NewPCG(uint64(pool), uint64(w)))
					for range 25 {
						l, mw := a, int64(0)
						if rng.IntN(2) == 1 {
							l, mw = b, 200000
						}
						key := fmt.Sprintf("s%d", rng.IntN(4))
						n := 1 + rng.IntN(lim.Burst+1)
						r, err := l.ReserveN(context.Background(), key, n)
						if err != nil {
							errs <- err
							return
						}
						if r.Booking().At.IsZero() {
							continue // refused before any call
						}
						mu.Lock()
						recs[key] = append(recs[key], revBooking{n, mw, r.Booking()})
						mu.Unlock()
					}
				})
			}
			wg.Wait()
			close(errs)
			for err := range errs {
				require.NoError(t, err)
			}
			total := 0
			for _, rs := range recs {
				total += len(rs)
			}
			used := calls.Load() - before
			t.Logf("%d bookings replayed, %d calls", total, used)
			if pool == 1 {
				require.Less(t, used, int64(total), "none merged")
			}
			I := lim.Interval().Microseconds()
			for key, rs := range recs {
				slices.SortStableFunc(rs, func(x, y revBooking) int { return int(decided(x) - decided(y)) })
				g := gcra{I: I, tau: I * int64(lim.Burst)}
				for i := 0; i < len(rs); {
					j := i
					for j < len(rs) && decided(rs[j]) == decided(rs[i]) {
						j++
					}
					var ok bool
					g, ok = fitsInSomeOrder(g, rs[i:j])
					require.True(t, ok, "key %s: bookings %d to %d (one call) fit no order of a textbook GCRA: %+v", key, i, j-1, rs[i:j])
					i = j
				}
			}
		})
	}
}

// TestReviewMergeReserveFallbackWhenGone: callers alone, merged behind a
// call in flight, when Redis goes away (the proxy closes): each is
// answered by the FailClosed fallback (refused, not an error) at once
// once the call ahead fails, none hangs.
func TestReviewMergeReserveFallbackWhenGone(t *testing.T) {
	t.Parallel()
	eng, p, _ := reviewMergeEngine(t, redistest.Shared(t), 1, throttle.WithTimeout(2*time.Second))
	p.SetReplyDelay(300 * time.Millisecond)
	l, err := reserve.New(eng, "gone", throttle.PerSecond(10, 0), reserve.WithFallback(reserve.FailClosed()), reserve.WithCoalescing(false))
	require.NoError(t, err)
	holder := make(chan error, 1)
	go func() {
		_, err := l.Reserve(context.Background(), "holder")
		holder <- err
	}()
	time.Sleep(50 * time.Millisecond)
	type result struct {
		r   *reserve.Reservation
		err error
	}
	out := make(chan result, 3)
	for i := range 3 {
		go func() {
			r, err := l.Reserve(context.Background(), fmt.Sprintf("k%d", i))
			out <- result{r, err}
		}()
	}
	time.Sleep(50 * time.Millisecond)
	p.Close()
	<-holder
	for range 3 {
		select {
		case res := <-out:
			require.NoError(t, res.err)
			require.False(t, res.r.OK())
			require.True(t, res.r.Fallback(), "answered by the fallback: %v", res.r.Err())
		case <-time.After(10 * time.Second):
			t.Fatal("a merged caller hangs after Redis went away")
		}
	}
}

// TestReviewMergeReserveLateGivenBack: a caller alone with a deadline,
// merged behind a call in flight, whose merged booking (a slot 750 ms
// ahead, within its budget) comes back too late to act on before its
// deadline: ReserveN refuses it (ErrWouldExceedDeadline) and gives the
// slot back, so the subject's next booking takes that slot again (one
// interval after the booking before it, on the Redis clock).
func TestReviewMergeReserveLateGivenBack(t *testing.T) {
	t.Parallel()
	eng, p, _ := reviewMergeEngine(t, redistest.Shared(t), 1)
	lim := throttle.PerSecond(1, 0) // I = 1 s
	l, err := reserve.New(eng, "late", lim, reserve.WithCoalescing(false))
	require.NoError(t, err)
	first, err := l.Reserve(context.Background(), "k")
	require.NoError(t, err)
	require.True(t, first.OK())
	p.SetReplyDelay(250 * time.Millisecond)
	holder := make(chan error, 1)
	go func() {
		_, err := l.Reserve(context.Background(), "holder")
		holder <- err
	}()
	time.Sleep(50 * time.Millisecond)
	ctx, cancel := context.WithTimeout(context.Background(), 900*time.Millisecond)
	defer cancel()
	r, err := l.Reserve(ctx, "k")
	require.NoError(t, <-holder)
	require.NoError(t, err)
	t.Logf("late caller: booked at %v (%v after first), err %v", r.Booking().At, r.Booking().At.Sub(first.Booking().At), r.Err())
	require.False(t, r.OK(), "acts past its deadline")
	require.ErrorIs(t, r.Err(), deadline.ErrWouldExceedDeadline)
	p.SetReplyDelay(0)
	next, err := l.Reserve(context.Background(), "k")
	require.NoError(t, err)
	require.True(t, next.OK())
	require.Equal(t, first.Booking().At.Add(lim.Interval()), next.Booking().At, "the late caller's slot was not given back")
}
