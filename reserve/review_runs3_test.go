package reserve_test

// Review tests (helper) of b081c75 (book.lua answers per run; the engine's
// judge replays each request's wait) on package reserve's side paths:
// coalesced callers, batches, single bookings, Cancel and BookRetry
// interleaved with every reply 40 ms late each way, and Redis stopped and
// restarted under a FailOpen fallback. Judged on the Redis clock
// (Booking().At) by rr3GCRA, a textbook GCRA written here (virtual
// scheduling, cell by cell): the bookings that stand, sorted by slot,
// must all conform, and no window may hold more than it allows.

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/slotbook/slotbook/internal/redistest"
	"github.com/slotbook/slotbook/reserve"
	"github.com/slotbook/slotbook/throttle"
)

// rr3GCRA: a textbook GCRA over several limits (tat 0: idle).
type rr3GCRA struct{ I, tau, tat []int64 }

func newRR3GCRA(limits []throttle.Limit) *rr3GCRA {
	g := &rr3GCRA{}
	for _, l := range limits {
		p, r := l.Period.Nanoseconds(), int64(l.Rate)
		I := ((p+r-1)/r + 999) / 1000
		g.I = append(g.I, I)
		g.tau = append(g.tau, I*int64(l.Burst))
		g.tat = append(g.tat, 0)
	}
	return g
}

func (g *rr3GCRA) fits(t int64, n int) bool {
	for k := range g.I {
		tat := g.tat[k]
		for c := 0; c < n; c++ {
			if t < tat-g.tau[k] {
				return false
			}
			tat = max(tat, t) + g.I[k]
		}
	}
	return true
}

func (g *rr3GCRA) take(t int64, n int) {
	for k := range g.I {
		for c := 0; c < n; c++ {
			g.tat[k] = max(g.tat[k], t) + g.I[k]
		}
	}
}

type rr3Slot struct {
	at int64
	n  int
}

// rr3Judge replays slots (the bookings that stand) through a fresh GCRA
// of limits, sorted by slot, and checks each limit's windows: from any
// booking to any later one, at most burst+1 + window/I units.
func rr3Judge(t *testing.T, limits []throttle.Limit, slots []rr3Slot, what string) {
	t.Helper()
	slices.SortStableFunc(slots, func(a, b rr3Slot) int { return int(a.at - b.at) })
	g := newRR3GCRA(limits)
	for i, s := range slots {
		require.True(t, g.fits(s.at, s.n), "%s: booking %d of %d (n %d at %d) comes early (TATs %v)", what, i, len(slots), s.n, s.at, g.tat)
		g.take(s.at, s.n)
	}
	for k, l := range limits {
		I := g.I[k]
		for i := range slots {
			units := 0
			for j := i; j < len(slots); j++ {
				units += slots[j].n
				require.LessOrEqual(t, int64(units), int64(l.Burst+1)+(slots[j].at-slots[i].at)/I, "%s: limit %d, window from booking %d to %d", what, k, i, j)
			}
		}
	}
}

// TestReviewRuns3LatencyMix: every reply 40 ms late each way. Eight
// goroutines on one subject and then on three, under one limit and under
// two (WithLimit), mix coalesced ReserveN (with and without deadlines),
// ReserveBatch of runs, ReserveN on a view without coalescing, Cancel of
// their latest reservation, and the engine's BookRetry on the limiter's
// keys. The bookings that stand (booked, not cancelled) must pass
// rr3GCRA on the Redis clock.
//
// Not parallel: it ends by looking for goroutines of package reserve.
func TestReviewRuns3LatencyMix(t *testing.T) {
	eng, p, _ := latencyEngine(t)
	p.SetLatency(40 * time.Millisecond)
	one, err := reserve.New(eng, "rr3one", throttle.Every(time.Second, 40, 3))
	require.NoError(t, err)
	two, err := reserve.New(eng, "rr3two", throttle.Every(time.Second, 40, 3), reserve.WithLimit(throttle.Every(2*time.Second, 60, 5)))
	require.NoError(t, err)
	for _, tc := range []struct {
		l        *reserve.Limiter
		subjects []string
	}{
		{one, []string{"a"}},
		{one, []string{"b", "c", "d"}},
		{two, []string{"a"}},
		{two, []string{"b", "c", "d"}},
	} {
		l := tc.l
		solo, err := l.With(reserve.WithCoalescing(false))
		require.NoError(t, err)
		var mu sync.Mutex
		standing := map[string][]rr3Slot{}
		var kinds [5]atomic.Int64
		var wg sync.WaitGroup
		errs := make(chan error, 8)
		for w := 0; w < 8; w++ {
			wg.Add(1)
			go func(w int) {
				defer wg.Done()
				rng := rand.New(rand.NewPCG(uint64(w), 3))
				type held struct {
					subj string
					r    *reserve.Reservation
					b    throttle.Booking
				}
				var mine []held
				maxN := l.Limits()[0].Burst + 1
				for _, lim := range l.Limits() {
					maxN = min(maxN, lim.Burst+1)
				}
				for op := 0; op < 14; op++ {
					subj := tc.subjects[rng.IntN(len(tc.subjects))]
					ctx := context.Background()
					kind := rng.IntN(5)
					kinds[kind].Add(1)
					switch kind {
					case 0, 2: // coalesced, or alone
						var cancel context.CancelFunc = func() {}
						timed := rng.IntN(2) == 0
						if timed {
							ctx, cancel = context.WithTimeout(ctx, time.Duration(100+rng.IntN(1500))*time.Millisecond)
						}
						lim := l
						if kind == 2 {
							lim = solo
						}
						r, err := lim.ReserveN(ctx, subj, 1+rng.IntN(maxN))
						cancel()
						if timed && errors.Is(err, context.DeadlineExceeded) {
							// Its deadline (100 ms at least) passed while the call
							// was out, on a busy machine: ReserveN's documented
							// answer, and the caller holds nothing.
							continue
						}
						if err != nil {
							errs <- fmt.Errorf("ReserveN: %w", err)
							return
						}
						if r.OK() {
							mine = append(mine, held{subj, r, r.Booking()})
						}
					case 1:
						var reqs []reserve.BatchRequest
						var cancels []context.CancelFunc
						for len(reqs) < 1+rng.IntN(30) {
							br := reserve.BatchRequest{N: 1 + rng.IntN(maxN)}
							if rng.IntN(3) == 0 {
								c, cancel := context.WithTimeout(ctx, time.Duration(100+rng.IntN(1500))*time.Millisecond)
								br.Context = c
								cancels = append(cancels, cancel)
							}
							for k := 1 + rng.IntN(6); k > 0; k-- {
								reqs = append(reqs, br)
							}
						}
						rs, err := l.ReserveBatch(ctx, subj, reqs)
						for _, c := range cancels {
							c()
						}
						if err != nil {
							errs <- fmt.Errorf("ReserveBatch: %w", err)
							return
						}
						for _, r := range rs {
							if r.OK() {
								mine = append(mine, held{subj, r, r.Booking()})
							}
						}
					case 3:
						if len(mine) == 0 {
							continue
						}
						h := mine[len(mine)-1]
						mine = mine[:len(mine)-1]
						if h.r == nil {
							if _, err := eng.RefundAll(ctx, engineKeys(l, subj), l.Limits(), h.b); err != nil {
								errs <- fmt.Errorf("RefundAll: %w", err)
								return
							}
							continue
						}
						if err := h.r.Cancel(ctx); err != nil {
							errs <- fmt.Errorf("Cancel: %w", err)
							return
						}
					case 4:
						idx := throttle.RetryIndex{Key: "rr3idx:" + l.Name() + ":{" + subj + "}", Member: fmt.Sprintf("w%d.%d", w, op),
							KeepFrom: []time.Duration{0, time.Hour}[rng.IntN(2)], Window: time.Second, MaxDue: 5}
						req := throttle.Request{N: 1 + rng.IntN(maxN), MaxWait: []time.Duration{throttle.Forever, 0, time.Second}[rng.IntN(3)]}
						rb, err := eng.BookRetry(ctx, engineKeys(l, subj), l.Limits(), req, idx)
						if err != nil {
							errs <- fmt.Errorf("BookRetry: %w", err)
							return
						}
						if rb.Recalled {
							errs <- errors.New("BookRetry recalled a member never booked")
							return
						}
						if rb.OK {
							mine = append(mine, held{subj, nil, rb.Booking})
						}
					}
				}
				mu.Lock()
				for _, h := range mine {
					standing[h.subj] = append(standing[h.subj], rr3Slot{h.b.At.UnixMicro(), h.b.N})
				}
				mu.Unlock()
			}(w)
		}
		wg.Wait()
		close(errs)
		for err := range errs {
			require.NoError(t, err)
		}
		total := 0
		for subj, slots := range standing {
			rr3Judge(t, l.Limits(), slots, fmt.Sprintf("%s %s", l.Name(), subj))
			total += len(slots)
		}
		t.Logf("%s %v: %d bookings stand; ops by kind %v", l.Name(), tc.subjects, total, []int64{kinds[0].Load(), kinds[1].Load(), kinds[2].Load(), kinds[3].Load(), kinds[4].Load()})
		require.Positive(t, total)
	}
	left := reserveGoroutines()
	for end := time.Now().Add(5 * time.Second); left != "" && time.Now().Before(end); left = reserveGoroutines() {
		time.Sleep(10 * time.Millisecond)
	}
	require.Empty(t, left, "goroutines of package reserve left")
}

// TestReviewRuns3RedisStoppedFailOpen: a server of the test's own, stopped
// while coalesced callers and batches book (under FailOpen) and started
// again (empty). Every answer is either Redis's or the fallback's (an
// error only as ErrUnavailable); once Redis is back its answers resume;
// the bookings Redis made after the restart, which start from an empty
// key, pass rr3GCRA on the Redis clock; and no goroutine of package
// reserve is left.
//
// Not parallel: it ends by looking for goroutines of package reserve.
func TestReviewRuns3RedisStoppedFailOpen(t *testing.T) {
	srv := redistest.Start(t)
	srv.RequireReal(t)
	rdb := srv.Client(t)
	eng, err := throttle.New(rdb, throttle.WithPrefix(redistest.Prefix(t)), throttle.WithTimeout(300*time.Millisecond),
		throttle.WithProbeBackoff(5*time.Millisecond, 20*time.Millisecond))
	require.NoError(t, err)
	limit := throttle.Every(time.Second, 50, 4)
	l, err := reserve.New(eng, "rr3stop", limit, reserve.WithFallback(reserve.FailOpen()), reserve.WithMaxWait(3*time.Second))
	require.NoError(t, err)

	var epoch atomic.Int64 // 0 before the stop, 1 while down, 2 once restarted
	var mu sync.Mutex
	var after []rr3Slot
	var fromRedis, fromFallback, failed [3]int
	stop := make(chan struct{})
	var wg sync.WaitGroup
	errs := make(chan error, 6)
	record := func(began int64, rs ...*reserve.Reservation) {
		ended := epoch.Load()
		mu.Lock()
		defer mu.Unlock()
		for _, r := range rs {
			switch {
			case r.Fallback():
				fromFallback[ended]++
			case r.OK():
				fromRedis[ended]++
				if began == 2 && ended == 2 {
					after = append(after, rr3Slot{r.Booking().At.UnixMicro(), r.Booking().N})
				}
			}
		}
	}
	for w := 0; w < 6; w++ {
		wg.Add(1)
		go func(w int) {
			defer wg.Done()
			rng := rand.New(rand.NewPCG(uint64(w), 7))
			for {
				select {
				case <-stop:
					return
				default:
				}
				began := epoch.Load()
				if w%2 == 0 {
					r, err := l.ReserveN(context.Background(), "k", 1+rng.IntN(2))
					if err != nil {
						if !errors.Is(err, throttle.ErrUnavailable) {
							errs <- err
							return
						}
						mu.Lock()
						failed[epoch.Load()]++
						mu.Unlock()
						continue
					}
					record(began, r)
				} else {
					reqs := make([]reserve.BatchRequest, 1+rng.IntN(20))
					for i := range reqs {
						reqs[i] = reserve.BatchRequest{N: 1 + rng.IntN(3)}
					}
					rs, err := l.ReserveBatch(context.Background(), "k", reqs)
					if err != nil {
						if !errors.Is(err, throttle.ErrUnavailable) {
							errs <- err
							return
						}
						mu.Lock()
						failed[epoch.Load()]++
						mu.Unlock()
						continue
					}
					record(began, rs...)
				}
				time.Sleep(time.Duration(rng.IntN(20)) * time.Millisecond)
			}
		}(w)
	}
	time.Sleep(300 * time.Millisecond)
	epoch.Store(1)
	srv.Stop()
	time.Sleep(400 * time.Millisecond)
	srv.Restart(t)
	epoch.Store(2)
	time.Sleep(800 * time.Millisecond)
	close(stop)
	wg.Wait()
	close(errs)
	for err := range errs {
		require.NoError(t, err)
	}
	t.Logf("Redis answers by epoch %v, fallback answers %v, calls failed %v; %d Redis bookings after the restart",
		fromRedis, fromFallback, failed, len(after))
	require.Positive(t, fromRedis[0])
	require.Positive(t, fromFallback[1]+failed[1], "the stop was seen")
	require.Positive(t, len(after), "Redis answers resumed")
	rr3Judge(t, []throttle.Limit{limit}, after, "after the restart")
	left := reserveGoroutines()
	for end := time.Now().Add(5 * time.Second); left != "" && time.Now().Before(end); left = reserveGoroutines() {
		time.Sleep(10 * time.Millisecond)
	}
	require.Empty(t, left, "goroutines of package reserve left")
}
