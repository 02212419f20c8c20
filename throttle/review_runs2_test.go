package throttle_test

// Review tests (helper) of b081c75: book.lua answers how many of each run
// were booked and books a run under one limit in one step. Every check
// here goes through the public API and is judged by rv2Oracle, a GCRA
// written from the textbook's virtual scheduling rule (a cell arriving at
// t conforms if t >= TAT - tau; then TAT = max(TAT, t) + I), applied cell
// by cell, with each request's slot found by searching for the earliest
// time at which all its cells conform: none of the script's or judge's
// closed forms.

import (
	"context"
	"fmt"
	"math/rand/v2"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/slotbook/slotbook/internal/redistest"
	"github.com/slotbook/slotbook/internal/testhook"
	"github.com/slotbook/slotbook/throttle"
)

// rv2Interval: Period/Rate rounded up to a whole microsecond, worked out
// from the Limit's fields (Interval's doc), not through the engine.
func rv2Interval(l throttle.Limit) int64 {
	ns := l.Period.Nanoseconds()
	per := ns / int64(l.Rate)
	if ns%int64(l.Rate) != 0 {
		per++
	}
	us := per / 1000
	if per%1000 != 0 {
		us++
	}
	return us
}

// rv2Oracle is a textbook GCRA over several limits. tat[k] is the
// theoretical arrival time of limit k's next cell (0: never used).
type rv2Oracle struct {
	I, tau []int64
	burst  []int
	tat    []int64
}

func newRV2Oracle(limits []throttle.Limit) *rv2Oracle {
	o := &rv2Oracle{}
	for _, l := range limits {
		I := rv2Interval(l)
		o.I = append(o.I, I)
		o.tau = append(o.tau, I*int64(l.Burst))
		o.burst = append(o.burst, l.Burst)
		o.tat = append(o.tat, 0)
	}
	return o
}

func (o *rv2Oracle) clone() *rv2Oracle {
	c := *o
	c.tat = slices.Clone(o.tat)
	return &c
}

// cellsConform: would n cells, all arriving at t, conform under limit k
// given its TAT? Cell by cell (the first eight and the last: the rule only
// gets stricter cell after cell, so the last one decides; checking the
// first eight guards the model itself).
func (o *rv2Oracle) cellsConform(k int, tat, t int64, n int) bool {
	for c := 0; c < n; c++ {
		if c >= 8 && c < n-1 {
			// Jump to the last cell: TAT after c cells at t.
			tat = max(tat, t) + int64(n-1-c)*o.I[k]
			c = n - 1
		}
		if t < tat-o.tau[k] {
			return false
		}
		tat = max(tat, t) + o.I[k]
	}
	return true
}

func (o *rv2Oracle) conforms(t int64, n int) bool {
	for k := range o.I {
		if !o.cellsConform(k, o.tat[k], t, n) {
			return false
		}
	}
	return true
}

// slot: the earliest t >= now at which n cells conform under every limit,
// by bisection.
func (o *rv2Oracle) slot(now int64, n int) int64 {
	if o.conforms(now, n) {
		return now
	}
	lo, hi := now, now // lo fails, hi passes
	for k := range o.I {
		hi = max(hi, max(o.tat[k], now)+int64(n)*o.I[k])
	}
	if !o.conforms(hi, n) {
		panic("rv2Oracle: no slot")
	}
	for hi-lo > 1 {
		mid := lo + (hi-lo)/2
		if o.conforms(mid, n) {
			hi = mid
		} else {
			lo = mid
		}
	}
	return hi
}

type rv2Decision struct {
	ok            bool
	wait          int64
	before, after []int64 // each limit's TAT as seen at the decision (max(tat, now)) and after it
}

// book judges one request at now: booked if its slot is within its max
// wait (capped at MaxHorizon), each limit then takes n cells at the slot.
func (o *rv2Oracle) book(now int64, r throttle.Request) rv2Decision {
	t := o.slot(now, r.N)
	wait := t - now
	mw := min(r.MaxWait, throttle.MaxHorizon)
	d := rv2Decision{ok: time.Duration(wait)*time.Microsecond <= mw, wait: wait}
	d.before = make([]int64, len(o.I))
	for k := range o.I {
		d.before[k] = max(o.tat[k], now)
	}
	if d.ok {
		for k := range o.I {
			tat := o.tat[k]
			for c := 0; c < r.N; c++ {
				if c > 2 && c < r.N-1 { // the rest of the cells at t all advance by I
					tat = max(tat, t) + int64(r.N-1-c)*o.I[k]
					c = r.N - 1
				}
				tat = max(tat, t) + o.I[k]
			}
			o.tat[k] = tat
		}
	}
	d.after = slices.Clone(o.tat)
	return d
}

// rv2CheckBooking compares one Booking with the oracle's decision.
func rv2CheckBooking(t *testing.T, now int64, r throttle.Request, b throttle.Booking, d rv2Decision, what string) {
	t.Helper()
	require.Equal(t, d.ok, b.OK, "%s: booked (n %d, max wait %v, wait %dµs)", what, r.N, r.MaxWait, d.wait)
	require.Equal(t, d.wait, b.Wait.Microseconds(), "%s: wait", what)
	require.Equal(t, time.Duration(d.wait)*time.Microsecond, b.Wait, "%s: wait (whole microseconds)", what)
	require.Equal(t, now+d.wait, b.At.UnixMicro(), "%s: At", what)
	require.Equal(t, r.N, b.N, "%s: N", what)
}

// rv2CheckKeys compares each key's stored TAT with the oracle's: the
// same, or both passed (a passed or absent TAT means an idle key).
func rv2CheckKeys(t *testing.T, rdb *redis.Client, prefix string, keys []string, o *rv2Oracle, now int64, what string) {
	t.Helper()
	for k, key := range keys {
		v, err := rdb.Get(context.Background(), prefix+key).Result()
		got := now
		if err == nil {
			n, perr := strconv.ParseInt(v, 10, 64)
			require.NoError(t, perr, "%s: key %s holds %q", what, key, v)
			got = max(n, now)
		} else {
			require.ErrorIs(t, err, redis.Nil)
		}
		require.Equal(t, max(o.tat[k], now), got, "%s: key %d TAT", what, k)
	}
}

func rv2Engine(t *testing.T, rdb *redis.Client, opts ...throttle.Option) (*throttle.Engine, string) {
	prefix := redistest.Prefix(t)
	eng, err := throttle.New(rdb, append([]throttle.Option{throttle.WithPrefix(prefix), throttle.WithTimeout(10 * time.Second)}, opts...)...)
	require.NoError(t, err)
	return eng, prefix
}

const rv2Day = 24 * time.Hour

// rv2LimitSets: one limit and several, burst 0, tiny and huge intervals,
// intervals that round up.
var rv2LimitSets = [][]throttle.Limit{
	{throttle.PerSecond(10, 0)},
	{throttle.PerSecond(10, 4)},
	{throttle.Every(366*rv2Day, 1, 0)},
	{throttle.Every(366*rv2Day, 1, 3)},
	{throttle.PerSecond(1_000_000, 1_000_000)},
	{throttle.Every(time.Second, 3, 7)},
	{throttle.Every(7*time.Millisecond, 3, 2)},
	{throttle.PerSecond(10, 4), throttle.Every(time.Minute, 40, 6)},
	{throttle.PerSecond(1000, 5), throttle.PerHour(100, 20), throttle.Every(366*rv2Day, 1, 3)},
	{throttle.PerSecond(10, 0), throttle.PerMinute(30, 0)},
	{throttle.PerSecond(1_000_000, 1_000_000), throttle.PerSecond(500_000, 2_000_000)},
}

func rv2Keys(tag string, m int) []string {
	keys := make([]string, m)
	for i := range keys {
		keys[i] = "{" + tag + "}:" + strconv.Itoa(i)
	}
	return keys
}

func rv2MaxN(limits []throttle.Limit) int {
	n := limits[0].Burst + 1
	for _, l := range limits {
		n = min(n, l.Burst+1)
	}
	return n
}

// rv2PickN: n from 1 to burst+1, favouring the edges.
func rv2PickN(rng *rand.Rand, maxN int) int {
	switch rng.IntN(6) {
	case 0:
		return 1
	case 1:
		return maxN
	case 2:
		return max(1, maxN-1)
	case 3:
		return min(maxN, 2)
	default:
		return 1 + rng.IntN(maxN)
	}
}

// rv2Batch builds a random batch of runs against a copy of the oracle so
// that many max waits fall exactly on a request's wait, a microsecond
// either side, or a fraction of one above: the run's count then hinges on
// the script's division.
func rv2Batch(rng *rand.Rand, o *rv2Oracle, now int64, maxN, size int) []throttle.Request {
	sim := o.clone()
	var reqs []throttle.Request
	for len(reqs) < size {
		n := rv2PickN(rng, maxN)
		count := 1 + rng.IntN(min(size-len(reqs), []int{1, 3, 40, 1000}[rng.IntN(4)]))
		var mw time.Duration
		switch rng.IntN(7) {
		case 0:
			mw = 0
		case 1:
			mw = throttle.Forever
		case 2:
			mw = time.Duration(rng.Int64N(int64(2 * time.Second)))
		case 3:
			mw = throttle.MaxHorizon + time.Duration(rng.IntN(2))*time.Microsecond
		default:
			// On the j-th request's wait (as if the run were all booked), or
			// next to it.
			probe := sim.clone()
			j := rng.IntN(count)
			var w int64
			for i := 0; i <= j; i++ {
				w = probe.book(now, throttle.Request{N: n, MaxWait: throttle.Forever}).wait
			}
			mw = time.Duration(w) * time.Microsecond
			switch rng.IntN(4) {
			case 0:
				mw -= time.Microsecond
			case 1:
				mw += time.Microsecond
			case 2:
				mw += 999 * time.Nanosecond
			}
			mw = max(mw, 0)
		}
		for i := 0; i < count; i++ {
			r := throttle.Request{N: n, MaxWait: mw}
			sim.book(now, r)
			reqs = append(reqs, r)
		}
	}
	return reqs
}

// TestReviewRuns2RandomBatchesTestClock: random batches of runs (long
// runs, max waits on and next to each request's wait, 0, Forever, beyond
// the horizon) on idle keys, busy ones and keys far ahead, one limit and
// several, interleaved with Book (book1.lua), AllowN/AllowAll and BookAll
// of one request, each outcome to the microsecond against rv2Oracle, and
// the stored TATs after every call.
func TestReviewRuns2RandomBatchesTestClock(t *testing.T) {
	t.Parallel()
	srv := redistest.Shared(t)
	rdb := srv.Client(t)
	eng, prefix := rv2Engine(t, rdb)
	rng := rand.New(rand.NewPCG(2026, 1203))
	var booked, refused, divisions int
	for set, limits := range rv2LimitSets {
		m := len(limits)
		maxN := rv2MaxN(limits)
		for round := 0; round < 3; round++ {
			keys := rv2Keys(fmt.Sprintf("rv2r%d.%d", set, round), m)
			o := newRV2Oracle(limits)
			now := int64(1_767_225_600_000_001) + int64(rng.IntN(1000))
			for step := 0; step < 12; step++ {
				what := fmt.Sprintf("set %d round %d step %d", set, round, step)
				switch rng.IntN(5) {
				case 0: // idle: past every TAT
					far := now
					for _, tat := range o.tat {
						far = max(far, tat)
					}
					if far-now < int64(40*rv2Day/time.Microsecond) {
						now = far + 1 + rng.Int64N(3)
					}
				case 1:
					now += rng.Int64N(2_000_000)
				default:
					now += rng.Int64N(3)
				}
				ctx := testhook.WithNow(context.Background(), now)
				switch rng.IntN(6) {
				case 0: // one request alone: book1.lua under one limit
					r := throttle.Request{N: rv2PickN(rng, maxN), MaxWait: []time.Duration{0, throttle.Forever, time.Duration(rng.Int64N(int64(time.Second)))}[rng.IntN(3)]}
					d := o.book(now, r)
					var b throttle.Booking
					var err error
					if m == 1 {
						b, err = eng.Book(ctx, keys[0], limits[0], r)
					} else {
						var bs []throttle.Booking
						bs, err = eng.BookAll(ctx, keys, limits, []throttle.Request{r})
						if err == nil {
							b = bs[0]
						}
					}
					require.NoError(t, err, what)
					rv2CheckBooking(t, now, r, b, d, what)
				case 1: // check mode
					n := rv2PickN(rng, maxN)
					d := o.book(now, throttle.Request{N: n})
					res, err := eng.AllowAll(ctx, keys, limits, n)
					require.NoError(t, err, what)
					require.Equal(t, d.ok, res.Allowed, what)
					if d.ok {
						require.Zero(t, res.RetryAfter, what)
					} else {
						require.Equal(t, time.Duration(d.wait)*time.Microsecond, res.RetryAfter, what)
					}
					var reset int64
					for k := range o.tat {
						reset = max(reset, o.tat[k]-now)
					}
					require.Equal(t, time.Duration(reset)*time.Microsecond, res.ResetAfter, what)
				default:
					size := 1 + rng.IntN(throttle.MaxBatch)
					if rng.IntN(3) == 0 {
						size = throttle.MaxBatch
					}
					reqs := rv2Batch(rng, o, now, maxN, size)
					var bs []throttle.Booking
					var err error
					if m == 1 {
						bs, err = eng.BookBatch(ctx, keys[0], limits[0], reqs)
					} else {
						bs, err = eng.BookAll(ctx, keys, limits, reqs)
					}
					require.NoError(t, err, what)
					require.Len(t, bs, len(reqs))
					for i, r := range reqs {
						d := o.book(now, r)
						rv2CheckBooking(t, now, r, bs[i], d, fmt.Sprintf("%s request %d", what, i))
						if d.ok {
							booked++
						} else {
							refused++
						}
						if i > 0 && r == reqs[i-1] && d.ok != bs[i-1].OK {
							divisions++ // a run that booked some and refused the rest
						}
					}
				}
				rv2CheckKeys(t, rdb, prefix, keys, o, now, what)
			}
		}
	}
	t.Logf("%d booked, %d refused, %d runs cut between booked and refused", booked, refused, divisions)
	require.Positive(t, divisions)
}

// TestReviewRuns2RedisClock: the same batches on the Redis clock: the
// decision time is read back from the bookings (At - Wait, one for the
// whole batch) and every outcome must be the oracle's at that time.
func TestReviewRuns2RedisClock(t *testing.T) {
	t.Parallel()
	srv := redistest.Shared(t)
	rdb := srv.Client(t)
	eng, prefix := rv2Engine(t, rdb)
	rng := rand.New(rand.NewPCG(7, 77))
	for set, limits := range rv2LimitSets {
		m := len(limits)
		maxN := rv2MaxN(limits)
		keys := rv2Keys(fmt.Sprintf("rv2c%d", set), m)
		o := newRV2Oracle(limits)
		last := int64(0)
		for step := 0; step < 6; step++ {
			what := fmt.Sprintf("set %d step %d", set, step)
			// The batch is built for a now the server has not read yet:
			// build it a little ahead of the last one seen, so that the
			// boundaries fall near (not always on) the waits.
			guess := max(last, time.Now().UnixMicro())
			reqs := rv2Batch(rng, o, guess, maxN, 1+rng.IntN(throttle.MaxBatch))
			bs, err := eng.BookAll(context.Background(), keys, limits, reqs)
			require.NoError(t, err, what)
			now := bs[0].At.UnixMicro() - bs[0].Wait.Microseconds()
			require.GreaterOrEqual(t, now, last, what)
			last = now
			for i, r := range reqs {
				require.Equal(t, now, bs[i].At.UnixMicro()-bs[i].Wait.Microseconds(), "%s request %d: one decision time", what, i)
				rv2CheckBooking(t, now, r, bs[i], o.book(now, r), fmt.Sprintf("%s request %d", what, i))
			}
			rv2CheckKeys(t, rdb, prefix, keys, o, now, what)
		}
	}
}

// TestReviewRuns2Refunds: bookings of a batch given back latest first, at
// random, and twice (a retried refund), at the batch's time and later
// (some slots passed), against the oracle's reading of Refund's doc: a
// booking gives back, once, only while its slot has not come and each
// key's TAT is still its end; that key goes back to its TAT before it.
func TestReviewRuns2Refunds(t *testing.T) {
	t.Parallel()
	srv := redistest.Shared(t)
	rdb := srv.Client(t)
	eng, prefix := rv2Engine(t, rdb)
	rng := rand.New(rand.NewPCG(3, 33))
	var given, nothing int
	for set, limits := range rv2LimitSets {
		m := len(limits)
		maxN := rv2MaxN(limits)
		for round := 0; round < 3; round++ {
			keys := rv2Keys(fmt.Sprintf("rv2f%d.%d", set, round), m)
			o := newRV2Oracle(limits)
			now := int64(1_767_225_600_000_000) + int64(round)
			ctx := testhook.WithNow(context.Background(), now)
			type rec struct {
				b    throttle.Booking
				d    rv2Decision
				slot int64
			}
			var recs []rec
			for batch := 0; batch < 2; batch++ {
				reqs := rv2Batch(rng, o, now, maxN, 1+rng.IntN(300))
				bs, err := eng.BookAll(ctx, keys, limits, reqs)
				require.NoError(t, err)
				for i, r := range reqs {
					d := o.book(now, r)
					rv2CheckBooking(t, now, r, bs[i], d, "batch")
					if d.ok {
						recs = append(recs, rec{bs[i], d, now + d.wait})
					}
				}
			}
			// The order: latest first, shuffled, or latest first with a
			// few swapped; some refunds repeated.
			order := make([]int, len(recs))
			for i := range order {
				order[i] = len(recs) - 1 - i
			}
			switch round {
			case 1:
				rng.Shuffle(len(order), func(i, j int) { order[i], order[j] = order[j], order[i] })
			case 2:
				for s := 0; s < len(order)/4+1 && len(order) > 1; s++ {
					i := rng.IntN(len(order) - 1)
					order[i], order[i+1] = order[i+1], order[i]
				}
			}
			tomb := make([]bool, len(recs))
			at := now
			for idx, i := range order {
				if idx == len(order)/2 && round > 0 {
					at = now + rng.Int64N(2*int64(time.Second/time.Microsecond)) // some slots pass
				}
				actx := testhook.WithNow(context.Background(), at)
				for try := 0; try < 1+rng.IntN(2); try++ {
					got, err := eng.RefundAll(actx, keys, limits, recs[i].b)
					require.NoError(t, err)
					live := recs[i].slot > at && !tomb[i]
					if live {
						tomb[i] = true
					}
					for k := range keys {
						want := int64(0)
						if live && o.tat[k] == recs[i].d.after[k] {
							want = recs[i].d.after[k] - max(recs[i].d.before[k], at)
							o.tat[k] = recs[i].d.before[k]
						}
						require.Equal(t, time.Duration(want)*time.Microsecond, got[k], "set %d round %d: refund of booking %d (try %d), key %d", set, round, i, try, k)
						if want > 0 {
							given++
						} else {
							nothing++
						}
					}
				}
				rv2CheckKeys(t, rdb, prefix, keys, o, at, fmt.Sprintf("set %d round %d after refund of %d", set, round, i))
			}
			// The room given back is bookable again, as the oracle says.
			actx := testhook.WithNow(context.Background(), at)
			reqs := rv2Batch(rng, o, at, maxN, 50)
			bs, err := eng.BookAll(actx, keys, limits, reqs)
			require.NoError(t, err)
			for i, r := range reqs {
				rv2CheckBooking(t, at, r, bs[i], o.book(at, r), "after refunds")
			}
			rv2CheckKeys(t, rdb, prefix, keys, o, at, "after refunds")
		}
	}
	t.Logf("%d gives, %d refunds that gave nothing", given, nothing)
	require.Positive(t, given)
	require.Positive(t, nothing)
}

// TestReviewRuns2Concurrent: goroutines on one key, on the Redis clock,
// with Book (alone or merged: a pool of two connections), BookBatch of
// runs, AllowN, and refunds of their latest booking. The bookings that
// stand, sorted by slot, must pass the textbook GCRA cell by cell, and no
// window may hold more than burst+1 + window/I units.
func TestReviewRuns2Concurrent(t *testing.T) {
	t.Parallel()
	srv := redistest.Shared(t)
	opts := srv.Options()
	opts.PoolSize = 2
	rdb := redis.NewClient(opts)
	t.Cleanup(func() { _ = rdb.Close() })
	merged := &rv2MergeCount{}
	rdb.AddHook(merged)
	eng, prefix := rv2Engine(t, rdb, throttle.WithMerging(true))
	merged.prefix = prefix
	for _, limit := range []throttle.Limit{throttle.Every(time.Second, 1000, 6), throttle.Every(time.Second, 2000, 0)} {
		key := "rv2conc" + strconv.Itoa(limit.Burst)
		type slot struct {
			at int64
			n  int
		}
		var mu sync.Mutex
		var standing []slot
		const workers = 6
		var wg sync.WaitGroup
		errs := make(chan error, workers)
		for w := 0; w < workers; w++ {
			wg.Add(1)
			go func(w int) {
				defer wg.Done()
				rng := rand.New(rand.NewPCG(uint64(w), 99))
				var mine []throttle.Booking
				keep := func(bs ...throttle.Booking) {
					for _, b := range bs {
						if b.OK {
							mine = append(mine, b)
						}
					}
				}
				for op := 0; op < 120; op++ {
					n := 1 + rng.IntN(limit.Burst+1)
					mw := time.Duration(rng.IntN(30)) * time.Millisecond
					switch rng.IntN(5) {
					case 0, 1:
						b, err := eng.Book(context.Background(), key, limit, throttle.Request{N: n, MaxWait: mw})
						if err != nil {
							errs <- err
							return
						}
						keep(b)
					case 2:
						var reqs []throttle.Request
						for len(reqs) < 1+rng.IntN(200) {
							r := throttle.Request{N: 1 + rng.IntN(limit.Burst+1), MaxWait: time.Duration(rng.IntN(30)) * time.Millisecond}
							for c := 1 + rng.IntN(50); c > 0; c-- {
								reqs = append(reqs, r)
							}
						}
						bs, err := eng.BookBatch(context.Background(), key, limit, reqs[:min(len(reqs), throttle.MaxBatch)])
						if err != nil {
							errs <- err
							return
						}
						keep(bs...)
					case 3:
						// An allowed check counts at its decision time,
						// which AllowN does not report: it is left out of
						// the replay, which only makes the replay looser
						// (fewer cells never make a GCRA stricter).
						if _, err := eng.AllowN(context.Background(), key, limit, n); err != nil {
							errs <- err
							return
						}
					case 4:
						if len(mine) == 0 {
							continue
						}
						b := mine[len(mine)-1]
						given, err := eng.Refund(context.Background(), key, limit, b)
						if err != nil {
							errs <- err
							return
						}
						if given > 0 {
							mine = mine[:len(mine)-1]
							// A repeat gives nothing.
							again, err := eng.Refund(context.Background(), key, limit, b)
							if err != nil || again != 0 {
								errs <- fmt.Errorf("refund again: %v, %v", again, err)
								return
							}
						}
					}
				}
				mu.Lock()
				for _, b := range mine {
					standing = append(standing, slot{b.At.UnixMicro(), b.N})
				}
				mu.Unlock()
			}(w)
		}
		wg.Wait()
		close(errs)
		for err := range errs {
			require.NoError(t, err)
		}
		slices.SortFunc(standing, func(a, b slot) int { return int(a.at - b.at) })
		o := newRV2Oracle([]throttle.Limit{limit})
		for i, s := range standing {
			require.True(t, o.conforms(s.at, s.n), "booking %d of %d (n %d at %d) came early: TAT %d", i, len(standing), s.n, s.at, o.tat[0])
			o.book(s.at, throttle.Request{N: s.n})
		}
		I := rv2Interval(limit)
		for i := range standing {
			units := 0
			for j := i; j < len(standing); j++ {
				units += standing[j].n
				window := standing[j].at - standing[i].at
				require.LessOrEqual(t, int64(units), int64(limit.Burst+1)+window/I, "window from booking %d to %d", i, j)
			}
		}
		t.Logf("%v: %d bookings stand; %d merged calls so far", limit, len(standing), merged.n.Load())
		require.NotEmpty(t, standing)
	}
	require.Positive(t, merged.n.Load(), "no merged call: the test did not reach bookmany.lua")
}

// rv2MergeCount counts merged calls (bookmany.lua) on one key: a script
// call whose keys, two or more, are all the same key of this engine.
type rv2MergeCount struct {
	prefix string
	n      atomic.Int64
}

func (h *rv2MergeCount) DialHook(next redis.DialHook) redis.DialHook { return next }

func (h *rv2MergeCount) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		args := cmd.Args()
		if len(args) > 3 && (cmd.Name() == "evalsha" || cmd.Name() == "eval") {
			if nk, ok := args[2].(int); ok && nk >= 2 && len(args) >= 3+nk {
				same := true
				for _, k := range args[3 : 3+nk] {
					s, _ := k.(string)
					same = same && s == args[3].(string) && strings.HasPrefix(s, h.prefix)
				}
				if same {
					h.n.Add(1)
				}
			}
		}
		return next(ctx, cmd)
	}
}

func (h *rv2MergeCount) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}

// TestReviewRuns2AllowNSeparateKey: AllowN interleaved with batches on
// one key under the test clock, where its decision time is known.
// (Covered inside TestReviewRuns2RandomBatchesTestClock as AllowAll;
// here through AllowN on a busy key so that a denial's RetryAfter is
// the oracle's to the microsecond.)
func TestReviewRuns2AllowNSeparateKey(t *testing.T) {
	t.Parallel()
	srv := redistest.Shared(t)
	rdb := srv.Client(t)
	eng, prefix := rv2Engine(t, rdb)
	limit := throttle.Every(time.Second, 3, 7)
	o := newRV2Oracle([]throttle.Limit{limit})
	now := int64(1_767_225_600_000_000)
	rng := rand.New(rand.NewPCG(1, 2))
	for step := 0; step < 200; step++ {
		now += rng.Int64N(400_000)
		ctx := testhook.WithNow(context.Background(), now)
		n := 1 + rng.IntN(8)
		d := o.book(now, throttle.Request{N: n})
		res, err := eng.AllowN(ctx, "rv2allow", limit, n)
		require.NoError(t, err)
		require.Equal(t, d.ok, res.Allowed, "step %d", step)
		if !d.ok {
			require.Equal(t, time.Duration(d.wait)*time.Microsecond, res.RetryAfter, "step %d", step)
		}
		// Remaining: the most units that would conform now.
		rem := 0
		for k := 1; k <= limit.Burst+1; k++ {
			if o.conforms(now, k) {
				rem = k
			}
		}
		require.Equal(t, rem, res.Remaining, "step %d", step)
		rv2CheckKeys(t, rdb, prefix, []string{"rv2allow"}, o, now, fmt.Sprintf("step %d", step))
	}
}

// TestReviewRuns2BookRetry: BookRetry on one and several limits, waits
// above and below KeepFrom (and equal to it), refused requests, a member
// recalled (nothing booked, the recorded slot back), Forget; each against
// the oracle, and the keys after.
func TestReviewRuns2BookRetry(t *testing.T) {
	t.Parallel()
	srv := redistest.Shared(t)
	rdb := srv.Client(t)
	eng, prefix := rv2Engine(t, rdb)
	rng := rand.New(rand.NewPCG(8, 88))
	sets := [][]throttle.Limit{
		{throttle.PerSecond(5, 2)},
		{throttle.PerSecond(1_000_000, 1_000_000)},
		{throttle.PerSecond(5, 2), throttle.PerMinute(40, 6)},
		{throttle.PerSecond(10, 0), throttle.Every(366*rv2Day, 100_000, 3)},
	}
	var recorded, recalled, refusedN int
	for set, limits := range sets {
		m := len(limits)
		maxN := rv2MaxN(limits)
		keys := rv2Keys(fmt.Sprintf("rv2b%d", set), m)
		idxKey := fmt.Sprintf("{rv2b%d}:idx", set)
		o := newRV2Oracle(limits)
		now := int64(1_767_225_600_000_000)
		index := map[string]int64{} // member -> slot
		for step := 0; step < 60; step++ {
			now += rng.Int64N(300_000)
			ctx := testhook.WithNow(context.Background(), now)
			what := fmt.Sprintf("set %d step %d", set, step)
			if rng.IntN(3) == 0 { // a batch beside
				reqs := rv2Batch(rng, o, now, maxN, 1+rng.IntN(20))
				bs, err := eng.BookAll(ctx, keys, limits, reqs)
				require.NoError(t, err)
				for i, r := range reqs {
					rv2CheckBooking(t, now, r, bs[i], o.book(now, r), what)
				}
			}
			r := throttle.Request{N: rv2PickN(rng, maxN), MaxWait: []time.Duration{0, throttle.Forever, time.Duration(rng.Int64N(int64(3 * time.Second)))}[rng.IntN(3)]}
			// KeepFrom on the request's wait, either side of it, or far.
			probe := o.clone().book(now, r)
			keep := []time.Duration{0, time.Second, time.Duration(probe.wait) * time.Microsecond,
				time.Duration(probe.wait-1) * time.Microsecond, time.Duration(probe.wait+1) * time.Microsecond}[rng.IntN(5)]
			keep = max(keep, 0)
			member := "t" + strconv.Itoa(rng.IntN(15))
			var forget []string
			if rng.IntN(5) == 0 {
				forget = []string{"t" + strconv.Itoa(rng.IntN(15))}
			}
			for _, f := range forget {
				if f != member {
					delete(index, f)
				}
			}
			// Entries a minute past their slots are dropped first.
			for mb, s := range index {
				if s < now-int64(time.Minute/time.Microsecond) {
					delete(index, mb)
				}
			}
			idx := throttle.RetryIndex{Key: idxKey, Member: member, KeepFrom: keep, Window: 2 * time.Second, MaxDue: 100, Forget: forget}
			rb, err := eng.BookRetry(ctx, keys, limits, r, idx)
			require.NoError(t, err, what)
			require.Equal(t, now, rb.Now.UnixMicro(), what)
			slotAt, had := index[member]
			if slices.Contains(forget, member) {
				had = false // forgotten before it is looked up
				delete(index, member)
			}
			if had {
				recalled++
				require.True(t, rb.Recalled, what)
				require.True(t, rb.OK, what)
				require.Equal(t, slotAt, rb.At.UnixMicro(), what)
				require.Equal(t, time.Duration(max(0, slotAt-now))*time.Microsecond, rb.Wait, what)
				delete(index, member)
			} else {
				require.False(t, rb.Recalled, what)
				d := o.book(now, r)
				rv2CheckBooking(t, now, r, rb.Booking, d, what)
				wantRec := d.ok && time.Duration(d.wait)*time.Microsecond > keep
				require.Equal(t, wantRec, rb.Recorded, "%s: recorded (wait %dµs, keep from %v)", what, d.wait, keep)
				if wantRec {
					recorded++
					index[member] = now + d.wait
				}
				if !d.ok {
					refusedN++
				}
				if d.ok && rng.IntN(4) == 0 {
					// Give it back at once: it is the latest booking.
					got, err := eng.RefundAll(ctx, keys, limits, rb.Booking)
					require.NoError(t, err)
					for k := range keys {
						want := int64(0)
						if now+d.wait > now {
							want = d.after[k] - max(d.before[k], now)
							o.tat[k] = d.before[k]
						}
						require.Equal(t, time.Duration(want)*time.Microsecond, got[k], "%s: refund key %d", what, k)
					}
				}
			}
			// Due: the index's entries within the window, soonest first.
			due := []string{}
			for mb, s := range index {
				if s <= now+int64(2*time.Second/time.Microsecond) {
					due = append(due, mb)
				}
			}
			gotDue := make([]string, 0, len(rb.Due))
			for mb, at := range rb.Due {
				gotDue = append(gotDue, mb)
				require.Equal(t, index[mb], at.UnixMicro(), "%s: due %s", what, mb)
			}
			slices.Sort(due)
			slices.Sort(gotDue)
			require.Equal(t, due, gotDue, what)
			rv2CheckKeys(t, rdb, prefix, keys, o, now, what)
		}
	}
	t.Logf("%d recorded, %d recalled, %d refused", recorded, recalled, refusedN)
	require.Positive(t, recorded)
	require.Positive(t, recalled)
}

// TestReviewRuns2Corrupt: values that are not a TAT, or lie further ahead
// than any booking under the limit reaches, fail a batch (one limit: the
// one-step path; several: the loop) with ErrCorruptState and write
// nothing; a TAT exactly at the furthest reach is read, not corrupt.
func TestReviewRuns2Corrupt(t *testing.T) {
	t.Parallel()
	srv := redistest.Shared(t)
	rdb := srv.Client(t)
	eng, prefix := rv2Engine(t, rdb)
	bg := context.Background()
	now := int64(1_767_225_600_000_000)
	ctx := testhook.WithNow(bg, now)
	limits := []throttle.Limit{throttle.PerSecond(10, 4), throttle.PerMinute(40, 6)}
	reach := func(l throttle.Limit) int64 {
		I := rv2Interval(l)
		return int64(throttle.MaxHorizon/time.Microsecond) + 2*(I*int64(l.Burst)+I)
	}
	reqs := []throttle.Request{{N: 1, MaxWait: throttle.Forever}, {N: 1, MaxWait: throttle.Forever}, {N: 2, MaxWait: 0}}
	bad := []string{"abc", "12x", "-5", "1e5", " 12", "12345678901234567", "9007199254740993", "too far"}
	for i, v := range bad {
		for m := 1; m <= 2; m++ {
			keys := rv2Keys(fmt.Sprintf("rv2x%d.%d", i, m), m)
			corrupt := keys[m-1] // the last key
			if i == len(bad)-1 { // a microsecond past the last limit's reach
				v = strconv.FormatInt(now+reach(limits[m-1])+1, 10)
			}
			require.NoError(t, rdb.Set(bg, prefix+corrupt, v, time.Hour).Err())
			good := strconv.FormatInt(now+1_000_000, 10)
			if m == 2 {
				require.NoError(t, rdb.Set(bg, prefix+keys[0], good, time.Hour).Err())
			}
			_, err := eng.BookAll(ctx, keys, limits[:m], reqs)
			require.ErrorIs(t, err, throttle.ErrCorruptState, "value %q, %d limits", v, m)
			got, err := rdb.Get(bg, prefix+corrupt).Result()
			require.NoError(t, err)
			require.Equal(t, v, got, "corrupt value rewritten")
			if m == 2 {
				got, err := rdb.Get(bg, prefix+keys[0]).Result()
				require.NoError(t, err)
				require.Equal(t, good, got, "first key written although the second is corrupt")
			}
			if m == 1 {
				_, err = eng.Book(ctx, keys[0], limits[0], reqs[0])
				require.ErrorIs(t, err, throttle.ErrCorruptState, "value %q, Book", v)
			}
		}
	}
	// At the reach exactly: read; every request here must wait past the
	// horizon, so all are refused and nothing is written.
	for m := 1; m <= 2; m++ {
		keys := rv2Keys(fmt.Sprintf("rv2xedge%d", m), m)
		o := newRV2Oracle(limits[:m])
		for k := range keys {
			o.tat[k] = now + reach(limits[k])
			require.NoError(t, rdb.Set(bg, prefix+keys[k], strconv.FormatInt(o.tat[k], 10), time.Hour).Err())
		}
		bs, err := eng.BookAll(ctx, keys, limits[:m], reqs)
		require.NoError(t, err)
		for i, r := range reqs {
			rv2CheckBooking(t, now, r, bs[i], o.book(now, r), "at the reach")
		}
		rv2CheckKeys(t, rdb, prefix, keys, o, now, "at the reach")
	}
}

// TestReviewRuns2Precision: values near the top of what a double holds
// exactly. A limit whose burst reaches 2^52 microseconds
// (Every(366 days, 1, 140): I*(burst+2) just under 2^52) at the test
// clock's now and far later, runs whose waits sit on the horizon, rooms
// exactly divisible by the step, and a run of 1000 one-microsecond steps.
func TestReviewRuns2Precision(t *testing.T) {
	t.Parallel()
	srv := redistest.Shared(t)
	rdb := srv.Client(t)
	eng, prefix := rv2Engine(t, rdb)
	big := throttle.Every(366*rv2Day, 1, 140)
	require.NoError(t, big.Validate())
	for _, now := range []int64{1_767_225_600_000_001, 1_767_225_600_000_000, 3_000_000_000_000_001, 1<<52 + 1} {
		for _, limits := range [][]throttle.Limit{{big}, {throttle.PerSecond(1_000_000, 1_000_000)}, {throttle.Every(366*rv2Day, 1, 3)}} {
			keys := rv2Keys(fmt.Sprintf("rv2p%d.%d", now, limits[0].Burst), 1)
			o := newRV2Oracle(limits)
			ctx := testhook.WithNow(context.Background(), now)
			maxN := rv2MaxN(limits)
			plans := [][]throttle.Request{
				{{N: maxN, MaxWait: 0}, {N: 1, MaxWait: throttle.Forever}, {N: 1, MaxWait: throttle.Forever}, {N: maxN, MaxWait: throttle.Forever}},
				{{N: 1, MaxWait: throttle.Forever}, {N: maxN - 1, MaxWait: throttle.Forever}},
			}
			for p, reqs := range plans {
				if p == 1 {
					// A room exactly divisible by the step: a run of n
					// units whose last booking's wait is exactly W.
					n := max(1, maxN/2)
					probe := o.clone()
					var w int64
					for j := 0; j < 7; j++ {
						w = probe.book(now, throttle.Request{N: n, MaxWait: throttle.Forever}).wait
					}
					for j := 0; j < 9; j++ {
						reqs = append(reqs, throttle.Request{N: n, MaxWait: time.Duration(w) * time.Microsecond})
					}
					for j := 0; j < 1000-len(reqs); j++ {
						reqs = append(reqs, throttle.Request{N: 1, MaxWait: time.Duration(w+1) * time.Microsecond})
					}
					reqs = reqs[:min(len(reqs), throttle.MaxBatch)]
				}
				bs, err := eng.BookBatch(ctx, keys[0], limits[0], reqs)
				what := fmt.Sprintf("now %d limit %v plan %d", now, limits[0], p)
				require.NoError(t, err, what)
				for i, r := range reqs {
					rv2CheckBooking(t, now, r, bs[i], o.book(now, r), fmt.Sprintf("%s request %d", what, i))
				}
				rv2CheckKeys(t, rdb, prefix, keys, o, now, what)
			}
		}
	}
}

// TestReviewRuns2SubMicrosecondMaxWaits: like requests whose max waits
// differ below a microsecond (the client puts them in one run, at the
// whole microsecond below) and by the horizon's cap (Forever, MaxHorizon
// and more: one run), each booked exactly when its wait is within its own
// max wait, as the oracle says.
func TestReviewRuns2SubMicrosecondMaxWaits(t *testing.T) {
	t.Parallel()
	srv := redistest.Shared(t)
	rdb := srv.Client(t)
	eng, prefix := rv2Engine(t, rdb)
	for _, limit := range []throttle.Limit{throttle.Every(time.Second, 3, 2), throttle.PerSecond(1_000_000, 0), throttle.Every(366*rv2Day, 1, 1)} {
		key := fmt.Sprintf("rv2sub%d", rv2Interval(limit))
		o := newRV2Oracle([]throttle.Limit{limit})
		now := int64(1_767_225_600_000_003)
		ctx := testhook.WithNow(context.Background(), now)
		// Waits of a run of 60 single units, all booked.
		probe := o.clone()
		var waits []int64
		for j := 0; j < 60; j++ {
			waits = append(waits, probe.book(now, throttle.Request{N: 1, MaxWait: throttle.Forever}).wait)
		}
		w := time.Duration(waits[30]) * time.Microsecond
		var reqs []throttle.Request
		for j := 0; j < 60; j++ {
			mw := []time.Duration{w, w + 999*time.Nanosecond, w + time.Nanosecond, w - time.Nanosecond}[j%4]
			reqs = append(reqs, throttle.Request{N: 1, MaxWait: mw})
		}
		for j := 0; j < 30; j++ {
			mw := []time.Duration{throttle.Forever, throttle.MaxHorizon, throttle.MaxHorizon + time.Nanosecond, throttle.MaxHorizon + time.Hour}[j%4]
			reqs = append(reqs, throttle.Request{N: 1, MaxWait: mw})
		}
		bs, err := eng.BookBatch(ctx, key, limit, reqs)
		require.NoError(t, err)
		for i, r := range reqs {
			rv2CheckBooking(t, now, r, bs[i], o.book(now, r), fmt.Sprintf("%v request %d", limit, i))
		}
		rv2CheckKeys(t, rdb, prefix, []string{key}, o, now, limit.String())
	}
}
