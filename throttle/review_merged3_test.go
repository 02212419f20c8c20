package throttle_test

// Review of 8c7a33a (each answer of a merged call, bookmany.lua's, is
// checked against the TAT it gives and the request's max wait, else
// ErrReplyLost) through the public API, with real Redis and no reply
// rewriting: no correct reply may be rejected. Every booking (booked or
// refused) is replayed, key by key, on a textbook GCRA (virtual
// scheduling, cell by cell) on the Redis clock: its decision time is
// Booking.At - Booking.Wait; bookings of one key decided at the same
// time (one merged call holding the key more than once) may come in any
// order, and the replay looks for one order that explains them all.

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/slotbook/slotbook/internal/limitcheck"
	"github.com/slotbook/slotbook/internal/redistest"
	"github.com/slotbook/slotbook/throttle"
)

// m3Key is one key of a run: its limit, how it was seeded, and what was
// booked on it.
type m3Key struct {
	name string
	lim  throttle.Limit
	seed string
	tat0 int64
	mu   sync.Mutex
	recs []limitcheck.Outcome
}

var m3Limits = []throttle.Limit{
	throttle.PerSecond(3, 2),                                  // I = 333334 µs
	throttle.Every(7*time.Millisecond, 1, 5),                  // I = 7000 µs
	throttle.Every(7*time.Millisecond, 3, 4),                  // I = 2334 µs
	throttle.Every(time.Second, 7, 0),                         // I = 142858 µs
	throttle.PerSecond(1000, 3),                               // I = 1000 µs
	throttle.Every(10*time.Millisecond+time.Nanosecond, 3, 2), // I = 3334 µs
	throttle.Every(time.Microsecond*1001, 1000, 1),            // 1001 ns: I = 2 µs
}

var m3MaxWaits = []time.Duration{0, 999 * time.Nanosecond, time.Microsecond, 1001 * time.Nanosecond, 3 * time.Millisecond,
	50 * time.Millisecond, time.Second, 10 * time.Minute, throttle.MaxHorizon - time.Second, throttle.MaxHorizon,
	throttle.MaxHorizon + time.Hour, throttle.Forever}

// m3Seed gives key k its starting state, by kind, and records its TAT.
func m3Seed(t *testing.T, r *rmaRig, k *m3Key) {
	t.Helper()
	ctx := context.Background()
	tm, err := r.direct.Time(ctx).Result()
	require.NoError(t, err)
	now := tm.UnixMicro()
	I := limitcheck.Interval(k.lim)
	tau := I * int64(k.lim.Burst)
	full := r.prefix + k.name
	switch k.seed {
	case "fresh":
	case "past": // a TAT passed, still stored (no expiry)
		require.NoError(t, r.direct.Set(ctx, full, fmt.Sprint(now-3_000_000), 0).Err())
	case "pastjust":
		require.NoError(t, r.direct.Set(ctx, full, fmt.Sprint(now-1), 0).Err())
	case "expiring": // expires a few ms in
		require.NoError(t, r.direct.Set(ctx, full, fmt.Sprint(now+20_000), 21*time.Millisecond).Err())
	case "ahead": // half a year ahead
		require.NoError(t, r.direct.Set(ctx, full, fmt.Sprint(now+throttle.MaxHorizon.Microseconds()/2), 0).Err())
	case "edge": // as far ahead as a stored TAT may be, less a second
		require.NoError(t, r.direct.Set(ctx, full, fmt.Sprint(now+throttle.MaxHorizon.Microseconds()+2*(tau+I)-1_000_000), 0).Err())
	case "horizon": // just inside the horizon for a single unit
		require.NoError(t, r.direct.Set(ctx, full, fmt.Sprint(now+throttle.MaxHorizon.Microseconds()+tau-2_000_000), 0).Err())
	case "block":
		require.NoError(t, r.eng.BlockAll(ctx, []string{k.name}, []throttle.Limit{k.lim}, 200*time.Millisecond))
	case "blocklong":
		require.NoError(t, r.eng.Block(ctx, k.name, k.lim, time.Hour))
	default:
		t.Fatalf("seed %q", k.seed)
	}
	v, err := r.direct.Get(ctx, full).Int64()
	if errors.Is(err, redis.Nil) {
		v, err = 0, nil
	}
	require.NoError(t, err)
	k.tat0 = v
}

// m3Run books, from callers goroutines of rounds bookings each, random
// requests on keys through r (whose single bookings merge), and checks
// every answer.
func m3Run(t *testing.T, r *rmaRig, callers, rounds int, seeds []string) {
	var keys []*m3Key
	for i, seed := range seeds {
		for j, lim := range m3Limits {
			keys = append(keys, &m3Key{name: fmt.Sprintf("m3-%s-%d-%d", seed, i, j), lim: lim, seed: seed})
		}
	}
	for _, k := range keys {
		m3Seed(t, r, k)
	}
	var wg sync.WaitGroup
	var nerr atomic.Int64
	errc := make(chan error, callers)
	start := r.calls.Load()
	var books atomic.Int64
	for g := range callers {
		wg.Go(func() {
			rng := rand.New(rand.NewPCG(uint64(g), 3))
			for range rounds {
				k := keys[rng.IntN(len(keys))]
				n := 1 + rng.IntN(k.lim.Burst+1)
				mw := m3MaxWaits[rng.IntN(len(m3MaxWaits))]
				b, err := r.eng.Book(context.Background(), k.name, k.lim, throttle.Request{N: n, MaxWait: mw})
				books.Add(1)
				if err != nil {
					if nerr.Add(1) == 1 {
						errc <- fmt.Errorf("%s (%v, seeded %s) n=%d max wait %v: %w", k.name, k.lim, k.seed, n, mw, err)
					}
					continue
				}
				k.mu.Lock()
				k.recs = append(k.recs, limitcheck.Outcome{Booking: b, N: n, MaxWait: mw})
				k.mu.Unlock()
			}
		})
	}
	waitAll(t, &wg, 3*time.Minute, "merged bookings")
	close(errc)
	calls := r.calls.Load() - start
	t.Logf("%d bookings in %d calls; %d errors", books.Load(), calls, nerr.Load())
	for err := range errc {
		t.Errorf("a booking failed (spurious? ErrReplyLost: %v): %v", errors.Is(err, throttle.ErrReplyLost), err)
	}
	require.Less(t, calls, books.Load()*3/4, "too few bookings merged for the test to mean anything")
	booked := 0
	for _, k := range keys {
		end, err := limitcheck.Replay(k.lim, k.tat0, k.recs)
		require.NoError(t, err, "%s (%v, seeded %s, TAT0 %d)", k.name, k.lim, k.seed, k.tat0)
		// The state left: a probe (alone is fine) sees the replay's TAT.
		b, err := r.eng.Book(context.Background(), k.name, k.lim, throttle.Request{N: 1, MaxWait: 0})
		require.NoError(t, err)
		ok, wait, _ := limitcheck.Judge(k.lim, end, b.At.UnixMicro()-b.Wait.Microseconds(), 1, 0)
		require.Equal(t, ok, b.OK, "%s: probe", k.name)
		require.Equal(t, wait, b.Wait.Microseconds(), "%s: probe wait", k.name)
		rk := &rmaKey{name: k.name, lim: k.lim}
		for _, x := range k.recs {
			if x.Booking.OK {
				booked++
				for range x.N {
					rk.cells = append(rk.cells, rmaCell{at: x.Booking.At.UnixMicro()})
				}
			}
		}
		requireWithinLimit(t, rk)
	}
	t.Logf("%d booked", booked)
}

// TestReviewM3MergedAnswersTextbook: WithMergeAt(1) and WithMergeWait
// (Forever), every reply held back 15 ms, so that all but one booking in
// flight go merged; keys seeded idle, with a passed TAT (stored and
// expired), far ahead (half a year, at the horizon's edge), or paused;
// limits whose intervals do not divide evenly; N from 1 to Burst+1; max
// waits from 0 to past MaxHorizon. No booking fails and every answer is
// the textbook's.
func TestReviewM3MergedAnswersTextbook(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	r := rmaEngine(t, srv, 16, 0, throttle.WithMergeAt(1), throttle.WithMergeWait(throttle.Forever))
	r.p.SetReplyDelay(15 * time.Millisecond)
	m3Run(t, r, 32, 30, []string{"fresh", "past", "pastjust", "expiring", "ahead", "edge", "horizon", "block", "blocklong"})
}

// TestReviewM3HotKeysMerged: few keys, many callers: one merged call holds
// a key many times over, each request seeing the ones before it.
func TestReviewM3HotKeysMerged(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	r := rmaEngine(t, srv, 16, 0, throttle.WithMergeAt(1), throttle.WithMergeWait(throttle.Forever))
	r.p.SetReplyDelay(10 * time.Millisecond)
	m3Run(t, r, 24, 25, []string{"fresh"})
}

// TestReviewM3DefaultMerging: the default WithMergeAt (4) and WithMergeWait
// (250 µs), a pool of 4 at 5 ms each way: merges come from the flight
// count and the full pool.
func TestReviewM3DefaultMerging(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	r := rmaEngine(t, srv, 4, 0)
	r.p.SetLatency(5 * time.Millisecond)
	m3Run(t, r, 32, 20, []string{"fresh", "past", "block", "ahead"})
}
