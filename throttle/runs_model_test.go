package throttle_test

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"strconv"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/slotbook/slotbook/internal/redistest"
	"github.com/slotbook/slotbook/internal/testhook"
	"github.com/slotbook/slotbook/throttle"
)

// reviewGCRA is a textbook GCRA (virtual scheduling), written for this
// review without the library's arithmetic: one TAT per limit, integer
// microseconds, with refunds as documented in docs/PROTOCOL.md (a key goes
// back to its TAT before the booking only while it still holds the
// booking's end; one refund per booking).
type reviewGCRA struct {
	I, tau []int64
	tat    []int64 // absolute TAT; 0 means absent
	tomb   map[int]bool
}

type reviewBooked struct {
	ok            bool
	wait          int64
	now           int64
	before, after []int64
}

func newReviewGCRA(limits []throttle.Limit) *reviewGCRA {
	g := &reviewGCRA{tomb: map[int]bool{}}
	for _, l := range limits {
		// Period/Rate in ns rounded up, then to µs rounded up.
		ns := (l.Period.Nanoseconds() + int64(l.Rate) - 1) / int64(l.Rate)
		us := ns / 1000
		if ns%1000 != 0 {
			us++
		}
		g.I = append(g.I, us)
		g.tau = append(g.tau, us*int64(l.Burst))
		g.tat = append(g.tat, 0)
	}
	return g
}

// book judges one request of n units, accepting a wait of at most maxWait
// microseconds. A request conforms when each of its n cells does: cell j
// conforms at t if t >= TAT + j*I - tau.
func (g *reviewGCRA) book(now int64, n int, maxWait int64) reviewBooked {
	r := reviewBooked{now: now}
	slot := now
	for i := range g.I {
		t := max(g.tat[i], now)
		r.before = append(r.before, t)
		last := t + int64(n-1)*g.I[i] - g.tau[i]
		slot = max(slot, last)
	}
	r.wait = slot - now
	if r.wait > maxWait {
		r.after = r.before
		return r
	}
	r.ok = true
	for i := range g.I {
		t := r.before[i]
		for j := 0; j < n; j++ {
			t = max(t, slot) + g.I[i]
		}
		g.tat[i] = t
		r.after = append(r.after, t)
	}
	return r
}

// refund is what refund.lua is documented to do.
func (g *reviewGCRA) refund(now int64, id int, b reviewBooked) []int64 {
	given := make([]int64, len(g.I))
	if !b.ok || now+0 >= b.now+b.wait || g.tomb[id] {
		return given
	}
	g.tomb[id] = true
	for i := range g.I {
		if g.tat[i] != 0 && g.tat[i] == b.after[i] {
			given[i] = b.after[i] - max(b.before[i], now)
			if b.before[i] > now {
				g.tat[i] = b.before[i]
			} else {
				g.tat[i] = 0
			}
		}
	}
	return given
}

func reviewCheckKeys(t *testing.T, rdb *redis.Client, prefix string, keys []string, g *reviewGCRA, now int64, what string) {
	t.Helper()
	for i, k := range keys {
		v, err := rdb.Get(context.Background(), prefix+k).Result()
		if errors.Is(err, redis.Nil) {
			require.True(t, g.tat[i] == 0 || g.tat[i] <= now, "%s: key %d absent, model holds %d", what, i, g.tat[i])
			continue
		}
		require.NoError(t, err)
		got, err := strconv.ParseInt(v, 10, 64)
		require.NoError(t, err)
		require.Equal(t, g.tat[i], got, "%s: key %d", what, i)
	}
}

// reviewMaxWaits: max waits that are alike after rounding down to a whole
// microsecond but differ in nanoseconds, ones a single microsecond apart,
// zero, Forever, and ones beyond MaxHorizon (capped).
func reviewMaxWait(rng *rand.Rand, base time.Duration) time.Duration {
	switch rng.IntN(7) {
	case 0:
		return 0
	case 1:
		return throttle.Forever
	case 2:
		return throttle.MaxHorizon + time.Duration(rng.IntN(3))*time.Hour + time.Duration(rng.IntN(1000))
	case 3:
		return base + time.Duration(rng.IntN(1000)) // same µs as base
	case 4:
		return base + time.Microsecond + time.Duration(rng.IntN(1000))
	case 5:
		return base - time.Microsecond
	default:
		return time.Duration(rng.Int64N(int64(5 * time.Second)))
	}
}

// TestRunsRandomBatchesAndRefundOrders: random batches of runs and
// singletons (max waits alike only to the microsecond, capped at the
// horizon, a microsecond apart), under one to three limits, against an
// independent GCRA; then bookings given back in random orders (middle
// first, latest first, the same one twice), each refund's give and every
// key's stored value checked against the model. Half the rounds flush the
// script cache between calls.
func TestRunsRandomBatchesAndRefundOrders(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t) // its own: SCRIPT FLUSH below would make other tests' calls on the shared one go twice (NOSCRIPT, then EVAL)
	rdb := srv.Client(t)
	eng, prefix := textbookEngine(t, rdb)
	all := []throttle.Limit{throttle.Every(time.Second, 7, 3), throttle.Every(time.Minute, 90, 5), throttle.Every(3*time.Second+333, 11, 8)}
	rng := rand.New(rand.NewPCG(7, 77))
	var refusedInRun, midRefundsGiven, sameBase int
	for round := 0; round < 60; round++ {
		m := 1 + round%3
		limits := all[:m]
		keys := make([]string, m)
		for i := range keys {
			keys[i] = fmt.Sprintf("{rv%d}:%d", round, i)
		}
		g := newReviewGCRA(limits)
		now := int64(1_800_000_000_000_000) + int64(round)*10_000_000_000
		ctx := testhook.WithNow(context.Background(), now)
		var reqs []throttle.Request
		size := 1 + rng.IntN(200)
		if round%10 == 9 {
			size = throttle.MaxBatch
		}
		base := time.Duration(rng.Int64N(int64(3*time.Second))) + time.Microsecond
		for len(reqs) < size {
			r := throttle.Request{N: 1 + rng.IntN(4), MaxWait: reviewMaxWait(rng, base)}
			run := 1 + rng.IntN(40)
			if rng.IntN(3) == 0 {
				run = 1
			}
			for j := 0; j < run && len(reqs) < size; j++ {
				rr := r
				if r.MaxWait != throttle.Forever && r.MaxWait < throttle.MaxHorizon && rng.IntN(2) == 0 {
					// Differ by under a microsecond, never across one.
					rr.MaxWait = r.MaxWait.Truncate(time.Microsecond) + time.Duration(rng.IntN(1000))
					sameBase++
				}
				reqs = append(reqs, rr)
			}
		}
		if round%2 == 1 {
			require.NoError(t, rdb.ScriptFlush(context.Background()).Err())
		}
		bs, err := eng.BookAll(ctx, keys, limits, reqs)
		require.NoError(t, err)
		require.Len(t, bs, len(reqs))
		model := make([]reviewBooked, len(reqs))
		for i, r := range reqs {
			mw := int64(min(r.MaxWait, throttle.MaxHorizon) / time.Microsecond)
			model[i] = g.book(now, r.N, mw)
			require.Equal(t, model[i].ok, bs[i].OK, "round %d request %d %+v", round, i, r)
			require.Equal(t, model[i].wait, bs[i].Wait.Microseconds(), "round %d request %d wait", round, i)
			require.Equal(t, now+model[i].wait, bs[i].At.UnixMicro(), "round %d request %d slot", round, i)
			require.Equal(t, r.N, bs[i].N)
			if !model[i].ok && i > 0 && i+1 < len(reqs) && reqs[i-1].N == r.N && reqs[i+1].N == r.N {
				refusedInRun++
			}
		}
		reviewCheckKeys(t, rdb, prefix, keys, g, now, fmt.Sprintf("round %d after booking", round))

		// Refunds: the clock moves forward a little (some slots come),
		// then an order: random, or a middle one first then latest
		// first, with some refunds repeated.
		later := now + rng.Int64N(400_000)
		lctx := testhook.WithNow(context.Background(), later)
		order := rng.Perm(len(reqs))
		if round%3 == 0 {
			mid := len(reqs) / 2
			order = append([]int{mid}, order[:0]...)
			for i := len(reqs) - 1; i >= 0; i-- {
				order = append(order, i)
			}
		}
		for j, i := range order {
			if round%2 == 1 && j%50 == 0 {
				require.NoError(t, rdb.ScriptFlush(context.Background()).Err())
			}
			got, err := eng.RefundAll(lctx, keys, limits, bs[i])
			require.NoError(t, err)
			want := g.refund(later, i, model[i])
			for k := range keys {
				require.Equal(t, time.Duration(want[k])*time.Microsecond, got[k], "round %d refund %d (order %d) limit %d", round, i, j, k)
			}
			if want[0] > 0 && i != len(reqs)-1 {
				midRefundsGiven++
			}
			reviewCheckKeys(t, rdb, prefix, keys, g, later, fmt.Sprintf("round %d after refund %d", round, i))
		}
	}
	require.Positive(t, refusedInRun)
	require.Positive(t, midRefundsGiven)
	require.Positive(t, sameBase)
	t.Logf("%d refusals inside a run, %d refunds given by other than the batch's last, %d max waits moved under a microsecond", refusedInRun, midRefundsGiven, sameBase)
}

// TestRunsRedisClock: the same check on the Redis clock: each
// batch's decision time is At - Wait of its bookings (one for the batch),
// the model judges at it, and the key's value after is the model's.
func TestRunsRedisClock(t *testing.T) {
	t.Parallel()
	srv := redistest.Shared(t)
	rdb := srv.Client(t)
	eng, prefix := textbookEngine(t, rdb)
	limits := []throttle.Limit{throttle.PerSecond(50, 4), throttle.PerMinute(600, 20)}
	keys := []string{"{rvclock}:a", "{rvclock}:b"}
	g := newReviewGCRA(limits)
	rng := rand.New(rand.NewPCG(3, 9))
	for round := 0; round < 30; round++ {
		var reqs []throttle.Request
		for len(reqs) < 64 {
			r := throttle.Request{N: 1 + rng.IntN(3), MaxWait: time.Duration(rng.IntN(400)) * time.Millisecond}
			for j := rng.IntN(20); j >= 0 && len(reqs) < 64; j-- {
				reqs = append(reqs, r)
			}
		}
		bs, err := eng.BookAll(context.Background(), keys, limits, reqs)
		require.NoError(t, err)
		now := bs[0].At.UnixMicro() - bs[0].Wait.Microseconds()
		for i, r := range reqs {
			require.Equal(t, now, bs[i].At.UnixMicro()-bs[i].Wait.Microseconds(), "one decision time per batch")
			want := g.book(now, r.N, int64(r.MaxWait/time.Microsecond))
			require.Equal(t, want.ok, bs[i].OK, "round %d request %d", round, i)
			require.Equal(t, want.wait, bs[i].Wait.Microseconds(), "round %d request %d", round, i)
		}
		reviewCheckKeys(t, rdb, prefix, keys, g, now, fmt.Sprintf("round %d", round))
	}
}

// TestRunsOverHorizon: max waits beyond MaxHorizon are capped, so
// a run of them with nanosecond differences and a run at exactly
// MaxHorizon are judged alike, and a wait beyond the horizon is refused
// whatever the max wait.
func TestRunsOverHorizon(t *testing.T) {
	t.Parallel()
	srv := redistest.Shared(t)
	rdb := srv.Client(t)
	eng, prefix := textbookEngine(t, rdb)
	lim := throttle.Every(150*24*time.Hour, 1, 0) // one per 150 days
	now := int64(1_800_000_000_000_000)
	ctx := testhook.WithNow(context.Background(), now)
	reqs := []throttle.Request{
		{N: 1, MaxWait: throttle.MaxHorizon},
		{N: 1, MaxWait: throttle.MaxHorizon + 1},
		{N: 1, MaxWait: throttle.Forever},
		{N: 1, MaxWait: throttle.MaxHorizon + time.Hour},
		{N: 1, MaxWait: throttle.MaxHorizon - time.Nanosecond}, // a microsecond less after rounding
	}
	bs, err := eng.BookBatch(ctx, "{rvhz}", lim, reqs)
	require.NoError(t, err)
	g := newReviewGCRA([]throttle.Limit{lim})
	for i, r := range reqs {
		want := g.book(now, r.N, int64(min(r.MaxWait, throttle.MaxHorizon)/time.Microsecond))
		require.Equal(t, want.ok, bs[i].OK, "request %d", i)
		require.Equal(t, want.wait, bs[i].Wait.Microseconds(), "request %d", i)
	}
	// 0, 150 and 300 days booked; 450 days is beyond any max wait.
	require.True(t, bs[2].OK)
	require.False(t, bs[3].OK)
	require.Equal(t, 3*150*24*time.Hour, bs[3].Wait)
	reviewCheckKeys(t, rdb, prefix, []string{"{rvhz}"}, g, now, "after")
}

// TestRunsCorruptKey: a corrupt value in the second of two keys
// fails a whole batch of runs with ErrCorruptState and writes nothing in
// the first key.
func TestRunsCorruptKey(t *testing.T) {
	t.Parallel()
	srv := redistest.Shared(t)
	rdb := srv.Client(t)
	eng, prefix := textbookEngine(t, rdb)
	limits := []throttle.Limit{throttle.PerSecond(10, 2), throttle.PerMinute(100, 10)}
	keys := []string{"{rvbad}:a", "{rvbad}:b"}
	require.NoError(t, rdb.Set(context.Background(), prefix+keys[1], "12x", 0).Err())
	reqs := make([]throttle.Request, 30)
	for i := range reqs {
		reqs[i] = throttle.Request{N: 1, MaxWait: throttle.Forever}
	}
	_, err := eng.BookAll(context.Background(), keys, limits, reqs)
	require.ErrorIs(t, err, throttle.ErrCorruptState)
	n, err := rdb.Exists(context.Background(), prefix+keys[0]).Result()
	require.NoError(t, err)
	require.Zero(t, n)
	// One key, one request (book1), and one key, a run (book).
	require.NoError(t, rdb.Set(context.Background(), prefix+"{rvbad1}", "-3", 0).Err())
	_, err = eng.Book(context.Background(), "{rvbad1}", limits[0], reqs[0])
	require.ErrorIs(t, err, throttle.ErrCorruptState)
	_, err = eng.BookBatch(context.Background(), "{rvbad1}", limits[0], reqs)
	require.ErrorIs(t, err, throttle.ErrCorruptState)
}
