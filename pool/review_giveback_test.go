package pool_test

// Review of 04c667a (give-backs on a goroutine of their own, their keys
// not booked meanwhile; lease goroutines wait on a Cond for their key's
// give-backs; a late booking stays refunding until given back) through the
// public API. Room is judged by reviewEnv.check (the stored TATs against a
// textbook GCRA of the jobs that ran) and by where a booking lands on the
// Redis clock (Booking().At) against the bookings that stand.

import (
	"context"
	"fmt"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/slotbook/slotbook/lease"
	"github.com/slotbook/slotbook/pool"
)

// gbNop is a job's function.
func gbNop(context.Context) error { return nil }

// gbIntervals returns how many intervals of the first limit b lies after
// head (µs on the Redis clock).
func gbIntervals(head, b int64) int64 {
	return (b - head) / reviewInterval(reviewLimits[0])
}

// TestReviewGiveBackWaves: 40 ms each way, 6 keys, 6 jobs per key after
// each key's head, in three waves of two per key (a context per wave).
// The waves are cancelled in a random order 30 ms apart, so that each
// wave's cancellation lands while the give-backs of the one before are in
// flight (some jobs owed under a later wave, some on a key being given
// back); then Wait, Close. Nothing runs, Close returns, and every key
// holds exactly what its head left.
func TestReviewGiveBackWaves(t *testing.T) {
	t.Parallel()
	e := newReviewEnv(t, 40*time.Millisecond)
	for round := range 2 {
		t.Run(fmt.Sprint(round), func(t *testing.T) {
			name := fmt.Sprintf("gbw%d", round)
			p, err := pool.New(e.limiter(t, name), pool.WithWorkers(160))
			require.NoError(t, err)
			defer func() { _ = p.Close(context.Background()) }()
			var keys []string
			for k := range 6 {
				keys = append(keys, fmt.Sprintf("k%d", k))
			}
			heads, at := reviewHeads(t, p, keys)
			jobs := make(map[string][]*pool.Job)
			for i, k := range keys {
				jobs[k] = []*pool.Job{heads[i]}
			}
			var cancels []context.CancelFunc
			for range 3 {
				ctx, cancel := context.WithCancel(context.Background())
				defer cancel()
				cancels = append(cancels, cancel)
				for range 2 {
					for _, k := range keys {
						j, err := p.Submit(ctx, k, gbNop)
						require.NoError(t, err)
						jobs[k] = append(jobs[k], j)
					}
				}
			}
			require.Eventually(t, func() bool {
				for i, k := range keys {
					if e.booked(name, k, at[i]) != 6 {
						return false
					}
				}
				return true
			}, 5*time.Second, time.Millisecond, "every job booked")
			for _, w := range rand.Perm(3) {
				cancels[w]()
				time.Sleep(30 * time.Millisecond)
			}
			wctx, wcancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer wcancel()
			require.NoError(t, p.Wait(wctx))
			require.NoError(t, p.Close(wctx), "Close while give-backs are in flight")
			for _, k := range keys {
				e.check(t, name, k, jobs[k], nil, context.Canceled)
			}
		})
	}
}

// TestReviewGiveBackCloseInFlight: 40 ms each way, 6 keys with 5 jobs
// each booked after its head; all cancelled at once and the pool closed
// 10 ms later, while the give-backs are in flight (or, how=close-first,
// closed first and cancelled as it closes). Close returns (within 10 s),
// Wait too, and everything is given back.
func TestReviewGiveBackCloseInFlight(t *testing.T) {
	t.Parallel()
	e := newReviewEnv(t, 40*time.Millisecond)
	for _, how := range []string{"cancel-first", "close-first"} {
		t.Run(how, func(t *testing.T) {
			name := "gbc" + how
			p, err := pool.New(e.limiter(t, name), pool.WithWorkers(200))
			require.NoError(t, err)
			defer func() { _ = p.Close(context.Background()) }()
			var keys []string
			for k := range 6 {
				keys = append(keys, fmt.Sprintf("k%d", k))
			}
			heads, at := reviewHeads(t, p, keys)
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			jobs := make(map[string][]*pool.Job)
			for i, k := range keys {
				jobs[k] = []*pool.Job{heads[i]}
				for range 5 {
					j, err := p.Submit(ctx, k, gbNop)
					require.NoError(t, err)
					jobs[k] = append(jobs[k], j)
				}
			}
			require.Eventually(t, func() bool {
				for i, k := range keys {
					if e.booked(name, k, at[i]) != 5 {
						return false
					}
				}
				return true
			}, 5*time.Second, time.Millisecond)
			cctx, ccancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer ccancel()
			if how == "cancel-first" {
				cancel()
				time.Sleep(10 * time.Millisecond)
			} else {
				go func() { time.Sleep(2 * time.Millisecond); cancel() }()
			}
			require.NoError(t, p.Close(cctx), "Close must not hang")
			require.NoError(t, p.Wait(cctx))
			for _, k := range keys {
				e.check(t, name, k, jobs[k], nil, context.Canceled, pool.ErrClosed)
			}
		})
	}
}

// gbLeaseRound: 40 ms each way, keys k0..k3, a lease of 5 per key (256
// workers, so that the pool books each job as it comes). On each key,
// after the head, five jobs are booked (j1..j5, each holding a lease)
// and a sixth, jw, waits for a lease. j3..j5 of every key are cancelled
// (one context): their give-backs take some 1 s (80 ms each). 30 ms
// later j1 and j2 are cancelled: with their key's give-backs in flight
// they are owed and done at once, which frees their leases: jw takes one
// and (WithLease) waits for its key's give-backs before booking. Nothing
// stands after the head by then but what is being given back, and j1 and
// j2's bookings are to be given back once those are in. jw must then book
// the slot right after the head: any later and the room of j1, j2 is lost
// to it while it stands (it stands on them). The control (withLease
// false) has no lease: jw is submitted right after j1 and j2 are
// cancelled, while the give-backs are in flight. Returns, per key, jw's
// slot in intervals after the head's; then cancels jw, closes and checks
// that every room came back.
func gbLeaseRound(t *testing.T, e *reviewEnv, name string, withLease bool) []int64 {
	keys := []string{"k0", "k1", "k2", "k3"}
	opts := []pool.Option{pool.WithWorkers(256)}
	if withLease {
		sem, err := lease.New(e.eng, name, 5, lease.WithTTL(30*time.Second), lease.WithPollInterval(5*time.Millisecond))
		require.NoError(t, err)
		defer func() { _ = sem.Close(context.Background()) }()
		opts = append(opts, pool.WithLease(sem))
	}
	p, err := pool.New(e.limiter(t, name), opts...)
	require.NoError(t, err)
	defer func() { _ = p.Close(context.Background()) }()
	heads, at := reviewHeads(t, p, keys)
	ctxA, cancelA := context.WithCancel(context.Background())
	defer cancelA()
	ctxB, cancelB := context.WithCancel(context.Background())
	defer cancelB()
	jobs := make([][]*pool.Job, len(keys))
	for k := range keys {
		jobs[k] = []*pool.Job{heads[k]}
	}
	for i := range 5 {
		ctx := ctxB
		if i < 2 {
			ctx = ctxA
		}
		for k, key := range keys {
			j, err := p.Submit(ctx, key, gbNop)
			require.NoError(t, err)
			jobs[k] = append(jobs[k], j)
		}
		// One at a time, so that j1..j7 book in order.
		for k, key := range keys {
			require.Eventually(t, func() bool { return e.booked(name, key, at[k]) == int64(i+1) }, 5*time.Second, time.Millisecond, "%s: j%d booked", key, i+1)
		}
	}
	ctxW, cancelW := context.WithCancel(context.Background())
	defer cancelW()
	submitW := func() {
		for k, key := range keys {
			jw, err := p.Submit(ctxW, key, gbNop)
			require.NoError(t, err)
			jobs[k] = append(jobs[k], jw)
		}
	}
	if withLease {
		submitW()
		time.Sleep(100 * time.Millisecond) // jw waits for a lease
		for k, key := range keys {
			require.Equal(t, int64(5), e.booked(name, key, at[k]), "%s: jw has not booked", key)
		}
	}
	cancelB()
	time.Sleep(30 * time.Millisecond)
	cancelA()
	if !withLease {
		submitW()
	}
	// The give-backs (one after the other, 80 ms each) take some 1.3 s;
	// jw books once they are in (its Reservation is to be had only once it
	// is done).
	time.Sleep(2500 * time.Millisecond)
	cancelW()
	var got []int64
	for k := range keys {
		jw := jobs[k][len(jobs[k])-1]
		<-jw.Done()
		r := jw.Reservation()
		require.NotNil(t, r, "jw booked (%v)", jw.Err())
		require.True(t, r.Booking().OK, "jw booked (%v)", jw.Err())
		got = append(got, gbIntervals(at[k], r.Booking().At.UnixMicro()))
	}
	wctx, wcancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer wcancel()
	require.NoError(t, p.Wait(wctx))
	require.NoError(t, p.Close(wctx))
	for k, key := range keys {
		e.check(t, name, key, jobs[k], nil, context.Canceled)
	}
	return got
}

// TestReviewGiveBackLeaseOwedRace: see gbLeaseRound. On every key jw must
// book one interval after the head, with a lease as without (the
// control). With a lease, jw's goroutine, woken when the key's give-backs
// are in, races the dispatcher, which would take j1 and j2's owed
// bookings to give back: when it wins, it books on top of them.
// Failed (5 of 5, lease=true) before lease goroutines also waited for owed
// bookings with nothing wanted on them.
func TestReviewGiveBackLeaseOwedRace(t *testing.T) {
	t.Parallel()
	e := newReviewEnv(t, 40*time.Millisecond)
	for _, withLease := range []bool{false, true} {
		t.Run(fmt.Sprintf("lease=%v", withLease), func(t *testing.T) {
			lost := 0
			const rounds = 2
			for i := range rounds {
				for k, n := range gbLeaseRound(t, e, fmt.Sprintf("gbl%v%d", withLease, i), withLease) {
					if n != 1 {
						lost++
						t.Logf("round %d, key k%d: jw booked %d intervals after the head, not 1: the room of %d cancelled bookings lost to it", i, k, n, n-1)
					}
				}
			}
			require.Zero(t, lost, "keys (of %d) on which jw booked on top of bookings owed", rounds*4)
		})
	}
}
