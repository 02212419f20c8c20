package throttle_test

// Review tests (helper) of b081c75, fe93a63 and 6caba42 on the side
// paths, through the public API only: replies lost after the script ran
// (held back past the engine's timeout by a proxy), connections severed
// with the request or the reply in flight, and SCRIPT FLUSH between calls.
// Every outcome is judged by r3GCRA, a textbook GCRA written here on its
// own (virtual scheduling, cell by cell, every cell; a request's slot by
// bisection on "all its cells conform"): none of the script's or judge's
// closed forms, and none of review_runs2_test.go's code.

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/slotbook/slotbook/internal/redistest"
	"github.com/slotbook/slotbook/internal/testhook"
	"github.com/slotbook/slotbook/throttle"
)

// r3Micros: a limit's emission interval in whole microseconds, from its
// fields as Limit.Interval's doc says (Period/Rate, rounded up to a
// nanosecond, then to a microsecond).
func r3Micros(l throttle.Limit) int64 {
	p, r := l.Period.Nanoseconds(), int64(l.Rate)
	ns := (p + r - 1) / r
	return (ns + 999) / 1000
}

// r3GCRA is a textbook GCRA over several limits; tat[k] 0 means idle.
type r3GCRA struct {
	I, tau, tat []int64
}

func newR3GCRA(limits []throttle.Limit) *r3GCRA {
	g := &r3GCRA{}
	for _, l := range limits {
		I := r3Micros(l)
		g.I = append(g.I, I)
		g.tau = append(g.tau, I*int64(l.Burst))
		g.tat = append(g.tat, 0)
	}
	return g
}

// fits: do n cells arriving at t all conform under every limit?
func (g *r3GCRA) fits(t int64, n int) bool {
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

// take counts n cells at t under every limit.
func (g *r3GCRA) take(t int64, n int) {
	for k := range g.I {
		for c := 0; c < n; c++ {
			g.tat[k] = max(g.tat[k], t) + g.I[k]
		}
	}
}

// slot: the earliest t >= now at which n cells fit.
func (g *r3GCRA) slot(now int64, n int) int64 {
	if g.fits(now, n) {
		return now
	}
	lo, hi := now, now
	for k := range g.I {
		hi = max(hi, max(g.tat[k], now)+int64(n)*g.I[k])
	}
	for hi-lo > 1 {
		mid := lo + (hi-lo)/2
		if g.fits(mid, n) {
			hi = mid
		} else {
			lo = mid
		}
	}
	return hi
}

type r3Dec struct {
	ok            bool
	wait          int64
	before, after []int64
}

// book judges r at now (booked if its wait is within its max wait, capped
// at MaxHorizon, in whole microseconds) and counts it if booked.
func (g *r3GCRA) book(now int64, r throttle.Request) r3Dec {
	t := g.slot(now, r.N)
	d := r3Dec{wait: t - now}
	d.ok = time.Duration(d.wait)*time.Microsecond <= min(r.MaxWait, throttle.MaxHorizon)
	for k := range g.tat {
		d.before = append(d.before, max(g.tat[k], now))
	}
	if d.ok {
		g.take(t, r.N)
	}
	d.after = slices.Clone(g.tat)
	return d
}

// r3Rec is a booking the test holds, with the oracle's reading of it.
type r3Rec struct {
	b    throttle.Booking
	d    r3Dec
	slot int64
	tomb bool
}

// refund: Refund's doc, read independently: a booking gives back once,
// only while its slot has not come; each limit whose TAT is still the
// booking's end goes back to where it was before it.
func (g *r3GCRA) refund(at int64, rec *r3Rec) []int64 {
	given := make([]int64, len(g.tat))
	live := rec.d.ok && rec.slot > at && !rec.tomb
	if !live {
		return given
	}
	rec.tomb = true
	for k := range g.tat {
		if g.tat[k] == rec.d.after[k] {
			given[k] = rec.d.after[k] - max(rec.d.before[k], at)
			g.tat[k] = rec.d.before[k]
		}
	}
	return given
}

func r3CheckBooking(t *testing.T, now int64, r throttle.Request, b throttle.Booking, d r3Dec, what string) {
	t.Helper()
	require.Equal(t, d.ok, b.OK, "%s: booked (n %d, max wait %v, wait %dµs)", what, r.N, r.MaxWait, d.wait)
	require.Equal(t, time.Duration(d.wait)*time.Microsecond, b.Wait, "%s: wait", what)
	require.Equal(t, now+d.wait, b.At.UnixMicro(), "%s: At", what)
}

// r3CheckKeys: each key's stored TAT against the oracle's (both read as
// max(tat, now): a passed TAT is an idle key).
func r3CheckKeys(t *testing.T, rdb *redis.Client, prefix string, keys []string, g *r3GCRA, now int64, what string) {
	t.Helper()
	for k, key := range keys {
		got := now
		v, err := rdb.Get(context.Background(), prefix+key).Result()
		if err == nil {
			n, perr := strconv.ParseInt(v, 10, 64)
			require.NoError(t, perr, "%s: key %s holds %q", what, key, v)
			got = max(n, now)
		} else {
			require.ErrorIs(t, err, redis.Nil, what)
		}
		require.Equal(t, max(g.tat[k], now), got, "%s: key %d TAT", what, k)
	}
}

// r3Standing replays the bookings that stand (sorted by slot) through a
// fresh textbook GCRA: none may come early.
func r3Standing(t *testing.T, limits []throttle.Limit, recs []*r3Rec, what string) int {
	t.Helper()
	var st []*r3Rec
	for _, r := range recs {
		if r.d.ok && !r.tomb {
			st = append(st, r)
		}
	}
	slices.SortStableFunc(st, func(a, b *r3Rec) int { return int(a.slot - b.slot) })
	g := newR3GCRA(limits)
	for i, r := range st {
		require.True(t, g.fits(r.slot, r.b.N), "%s: booking %d of %d (n %d at %d) comes early", what, i, len(st), r.b.N, r.slot)
		g.take(r.slot, r.b.N)
	}
	return len(st)
}

func r3Keys(tag string, m int) []string {
	keys := make([]string, m)
	for i := range keys {
		keys[i] = "{" + tag + "}:" + strconv.Itoa(i)
	}
	return keys
}

// r3Batch: runs of like requests, max waits among 0, Forever, and
// values near the waits of a busy key.
func r3Batch(rng *rand.Rand, maxN, size int, I int64) []throttle.Request {
	var reqs []throttle.Request
	for len(reqs) < size {
		r := throttle.Request{N: 1 + rng.IntN(maxN)}
		switch rng.IntN(4) {
		case 0:
			r.MaxWait = 0
		case 1:
			r.MaxWait = throttle.Forever
		default:
			r.MaxWait = time.Duration(rng.Int64N(40*I)) * time.Microsecond
		}
		for c := 1 + rng.IntN(12); c > 0 && len(reqs) < size; c-- {
			reqs = append(reqs, r)
		}
	}
	return reqs
}

func r3MaxN(limits []throttle.Limit) int {
	n := limits[0].Burst + 1
	for _, l := range limits {
		n = min(n, l.Burst+1)
	}
	return n
}

// r3Lost reports whether err is a lost reply as the package doc says it
// must be reported: ErrReplyLost together with ErrUnavailable.
func r3Lost(err error) bool {
	return errors.Is(err, throttle.ErrReplyLost) && errors.Is(err, throttle.ErrUnavailable)
}

// TestReviewRuns3ReplyLostTestClock: through a proxy, an engine with a
// 250 ms timeout. Each round makes one call (a batch of runs, a single
// booking through book1.lua or BookAll, a BookRetry, or a refund of the
// latest booking) whose reply the proxy holds back past the timeout: the
// script ran, and the caller must see ErrReplyLost with ErrUnavailable.
// The call is then retried until it gets through (the breaker opened): a
// retried booking books again (its first booking is waste), a retried
// BookRetry whose lost booking was recorded recalls it, a retried refund
// gives nothing. On the test clock (so that the lost call's decision time
// is known), every answer and the keys after each round against r3GCRA
// with the lost calls applied, and at the end the bookings the test holds
// never come early.
func TestReviewRuns3ReplyLostTestClock(t *testing.T) {
	t.Parallel()
	// A server of its own: another test's SCRIPT FLUSH on the shared one
	// turns a lost call's reply into NOSCRIPT, and the script never runs.
	srv := redistest.Start(t)
	direct := srv.Client(t)
	p := redistest.NewProxy(t, srv.Addr)
	rdb := p.Client(t, srv)
	prefix := redistest.Prefix(t)
	const timeout = 250 * time.Millisecond
	eng, err := throttle.New(rdb, throttle.WithPrefix(prefix), throttle.WithTimeout(timeout), throttle.WithProbeBackoff(5*time.Millisecond, 20*time.Millisecond))
	require.NoError(t, err)
	require.NoError(t, eng.Load(context.Background()))
	// Load does not send BookRetry's script: one call on a key of its own
	// does, so that a lost call below is not a NOSCRIPT answer held back
	// (which would have run nothing).
	_, err = eng.BookRetry(context.Background(), []string{"{r3warm}:k"}, []throttle.Limit{throttle.PerSecond(1, 0)}, throttle.Request{N: 1},
		throttle.RetryIndex{Key: "{r3warm}:idx", Member: "w"})
	require.NoError(t, err)
	rng := rand.New(rand.NewPCG(3, 2026))
	sets := [][]throttle.Limit{
		{throttle.Every(time.Second, 10, 3)},
		{throttle.Every(time.Second, 4, 2), throttle.Every(time.Minute, 30, 5)},
		{throttle.Every(time.Second, 7, 0)},
	}
	var lostN, retriedLostN, recalledN, wasted int
	for set, limits := range sets {
		m := len(limits)
		maxN := r3MaxN(limits)
		tag := fmt.Sprintf("r3lost%d", set)
		keys := r3Keys(tag, m)
		g := newR3GCRA(limits)
		now := int64(1_767_225_600_000_000) + int64(set)
		var recs []*r3Rec
		index := map[string]int64{} // BookRetry's index: member -> slot
		for round := 0; round < 16; round++ {
			now += rng.Int64N(400_000)
			what := fmt.Sprintf("set %d round %d", set, round)
			kind := round % 4
			var target *r3Rec
			if kind == 3 {
				for i := len(recs) - 1; i >= 0; i-- {
					if recs[i].d.ok && !recs[i].tomb {
						target = recs[i]
						break
					}
				}
				if target == nil {
					kind = 0
				}
			}
			var reqs []throttle.Request
			switch kind {
			case 0:
				reqs = r3Batch(rng, maxN, 2+rng.IntN(60), g.I[0])
			case 1, 2:
				reqs = r3Batch(rng, maxN, 1, g.I[0])
			}
			member := fmt.Sprintf("m%d", round)
			keep := []time.Duration{0, time.Hour}[rng.IntN(2)]
			idx := throttle.RetryIndex{Key: "{" + tag + "}:idx", Member: member, KeepFrom: keep, Window: time.Second, MaxDue: 10}

			// call makes the round's call at at; model applies it to the
			// oracle and checks the answer (got nil: the reply was lost).
			type answer struct {
				bs    []throttle.Booking
				rb    throttle.RetryBooking
				given []time.Duration
			}
			call := func(at int64) (answer, error) {
				ctx := testhook.WithNow(context.Background(), at)
				var a answer
				var err error
				switch kind {
				case 0:
					if m == 1 {
						a.bs, err = eng.BookBatch(ctx, keys[0], limits[0], reqs)
					} else {
						a.bs, err = eng.BookAll(ctx, keys, limits, reqs)
					}
				case 1:
					if m == 1 {
						var b throttle.Booking
						b, err = eng.Book(ctx, keys[0], limits[0], reqs[0])
						a.bs = []throttle.Booking{b}
					} else {
						a.bs, err = eng.BookAll(ctx, keys, limits, reqs)
					}
				case 2:
					a.rb, err = eng.BookRetry(ctx, keys, limits, reqs[0], idx)
				case 3:
					a.given, err = eng.RefundAll(ctx, keys, limits, target.b)
				}
				return a, err
			}
			model := func(at int64, a *answer, what string) {
				switch kind {
				case 0, 1:
					for i, r := range reqs {
						d := g.book(at, r)
						if a == nil {
							if d.ok {
								wasted++
							}
							continue
						}
						r3CheckBooking(t, at, r, a.bs[i], d, fmt.Sprintf("%s request %d", what, i))
						recs = append(recs, &r3Rec{b: a.bs[i], d: d, slot: at + d.wait})
					}
				case 2:
					if s, ok := index[member]; ok {
						delete(index, member)
						if a != nil {
							recalledN++
							require.True(t, a.rb.Recalled, "%s: recalled", what)
							require.Equal(t, s, a.rb.At.UnixMicro(), "%s: recalled slot", what)
						}
						return
					}
					d := g.book(at, reqs[0])
					if d.ok && time.Duration(d.wait)*time.Microsecond > keep {
						index[member] = at + d.wait
					}
					if a == nil {
						if d.ok {
							wasted++
						}
						return
					}
					require.False(t, a.rb.Recalled, what)
					r3CheckBooking(t, at, reqs[0], a.rb.Booking, d, what)
					require.Equal(t, d.ok && time.Duration(d.wait)*time.Microsecond > keep, a.rb.Recorded, "%s: recorded", what)
					require.Equal(t, at, a.rb.Now.UnixMicro(), what)
					recs = append(recs, &r3Rec{b: a.rb.Booking, d: d, slot: at + d.wait})
				case 3:
					want := g.refund(at, target)
					if a == nil {
						return
					}
					for k := range want {
						require.Equal(t, time.Duration(want[k])*time.Microsecond, a.given[k], "%s: refund, key %d", what, k)
					}
				}
			}

			// An idle connection that has said HELLO: a new one's handshake
			// would be held back too, and nothing would be sent.
			require.NoError(t, rdb.Ping(context.Background()).Err())
			p.SetReplyDelay(3 * timeout)
			_, err := call(now)
			p.SetReplyDelay(0)
			require.True(t, r3Lost(err), "%s (kind %d): want ErrReplyLost and ErrUnavailable, got %v", what, kind, err)
			lostN++
			model(now, nil, what+" (lost)")

			// Retry until it gets through: the breaker is open for a while.
			at := now + rng.Int64N(3)
			end := time.Now().Add(20 * time.Second)
			for {
				a, err := call(at)
				if err == nil {
					model(at, &a, what+" (retried)")
					break
				}
				require.ErrorIs(t, err, throttle.ErrUnavailable, what)
				if errors.Is(err, throttle.ErrReplyLost) { // lost again (a slow machine): it ran
					retriedLostN++
					model(at, nil, what+" (retry lost)")
				}
				require.True(t, time.Now().Before(end), "%s: no retry got through: %v", what, err)
				time.Sleep(5 * time.Millisecond)
			}
			r3CheckKeys(t, direct, prefix, keys, g, at, what)
			now = at
		}
		n := r3Standing(t, limits, recs, fmt.Sprintf("set %d", set))
		t.Logf("set %d: %d bookings held stand", set, n)
	}
	t.Logf("%d replies lost, %d retries lost too, %d recalled, %d bookings wasted", lostN, retriedLostN, recalledN, wasted)
	require.Positive(t, recalledN)
	require.Positive(t, wasted)
}

// TestReviewRuns3ReplyLostRedisClock: on the Redis clock. A key is set
// well ahead (a batch on a direct engine, its decision time read back from
// its bookings); then a batch (runs of n 1 to 4, no max wait), a single
// booking and a BookRetry recorded in the index go out through the proxy
// with their replies held back past the timeout (ErrReplyLost), and are
// retried. With the key that far ahead every booking's slot is the same
// whenever Redis ran it, so the lost calls' effect is known: the retries'
// answers (at the decision time they report) and the key after must be
// r3GCRA's with the lost bookings counted once each, the retried
// BookRetry recalls its slot, and the bookings that stand never come
// early.
func TestReviewRuns3ReplyLostRedisClock(t *testing.T) {
	t.Parallel()
	// A server of its own: another test's SCRIPT FLUSH on the shared one
	// turns a lost call's reply into NOSCRIPT, and the script never runs.
	srv := redistest.Start(t)
	direct := srv.Client(t)
	prefix := redistest.Prefix(t)
	deng, err := throttle.New(direct, throttle.WithPrefix(prefix), throttle.WithTimeout(10*time.Second))
	require.NoError(t, err)
	p := redistest.NewProxy(t, srv.Addr)
	rdb := p.Client(t, srv)
	const timeout = 250 * time.Millisecond
	eng, err := throttle.New(rdb, throttle.WithPrefix(prefix), throttle.WithTimeout(timeout), throttle.WithProbeBackoff(5*time.Millisecond, 20*time.Millisecond))
	require.NoError(t, err)
	require.NoError(t, eng.Load(context.Background()))
	// Load does not send BookRetry's script: one call on a key of its own
	// does, so that a lost call below is not a NOSCRIPT answer held back
	// (which would have run nothing).
	_, err = eng.BookRetry(context.Background(), []string{"{r3warm}:k"}, []throttle.Limit{throttle.PerSecond(1, 0)}, throttle.Request{N: 1},
		throttle.RetryIndex{Key: "{r3warm}:idx", Member: "w"})
	require.NoError(t, err)
	limit := throttle.Every(time.Second, 20, 3) // 50 ms apart
	limits := []throttle.Limit{limit}
	key := "{r3rc}:k"
	g := newR3GCRA(limits)
	var recs []*r3Rec
	ctx := context.Background()

	setup := make([]throttle.Request, 160) // 8 s ahead
	for i := range setup {
		setup[i] = throttle.Request{N: 1, MaxWait: throttle.Forever}
	}
	bs, err := deng.BookBatch(ctx, key, limit, setup)
	require.NoError(t, err)
	now0 := bs[0].At.UnixMicro() - bs[0].Wait.Microseconds()
	for i, r := range setup {
		d := g.book(now0, r)
		r3CheckBooking(t, now0, r, bs[i], d, fmt.Sprintf("setup %d", i))
		recs = append(recs, &r3Rec{b: bs[i], d: d, slot: now0 + d.wait})
	}

	var batch []throttle.Request
	for n := 1; n <= 4; n++ {
		for c := 0; c < 5; c++ {
			batch = append(batch, throttle.Request{N: n, MaxWait: throttle.Forever})
		}
	}
	single := []throttle.Request{{N: 2, MaxWait: throttle.Forever}}
	idx := throttle.RetryIndex{Key: "{r3rc}:idx", Member: "task", KeepFrom: time.Second, Window: time.Second, MaxDue: 10}
	var retrySlot int64

	// lostThenRetried makes call with every reply held back (lost), applies
	// its effect to the oracle with apply, then retries it until it gets
	// through, and checks it with check (given its decision time).
	lostThenRetried := func(what string, call func() (int64, error), apply func(), check func(now int64)) {
		require.NoError(t, rdb.Ping(ctx).Err())
		p.SetReplyDelay(3 * timeout)
		_, err := call()
		p.SetReplyDelay(0)
		require.True(t, r3Lost(err), "%s: want ErrReplyLost and ErrUnavailable, got %v", what, err)
		apply()
		end := time.Now().Add(20 * time.Second)
		for {
			now, err := call()
			if err == nil {
				check(now)
				return
			}
			require.ErrorIs(t, err, throttle.ErrUnavailable, what)
			if errors.Is(err, throttle.ErrReplyLost) {
				apply() // it ran again
			}
			require.True(t, time.Now().Before(end), "%s: no retry got through: %v", what, err)
			time.Sleep(5 * time.Millisecond)
		}
	}
	// applyAhead counts reqs as Redis did, whenever it ran them: the key is
	// so far ahead that their slots do not depend on the time (checked at
	// two times a second apart).
	applyAhead := func(reqs []throttle.Request) {
		late := g.tat[0] - 4*time.Second.Microseconds()
		a, b := &r3GCRA{I: g.I, tau: g.tau, tat: slices.Clone(g.tat)}, &r3GCRA{I: g.I, tau: g.tau, tat: slices.Clone(g.tat)}
		for _, r := range reqs {
			da, db := a.book(now0, r), b.book(late, r)
			require.Equal(t, now0+da.wait, late+db.wait, "the lost call's slots depend on its time: the test's premise")
		}
		for _, r := range reqs {
			g.book(now0, r)
		}
	}
	var bsBatch []throttle.Booking
	lostThenRetried("batch", func() (int64, error) {
		var err error
		bsBatch, err = eng.BookBatch(ctx, key, limit, batch)
		if err != nil {
			return 0, err
		}
		return bsBatch[0].At.UnixMicro() - bsBatch[0].Wait.Microseconds(), nil
	}, func() { applyAhead(batch) }, func(now int64) {
		for i, r := range batch {
			d := g.book(now, r)
			r3CheckBooking(t, now, r, bsBatch[i], d, fmt.Sprintf("retried batch %d", i))
			recs = append(recs, &r3Rec{b: bsBatch[i], d: d, slot: now + d.wait})
		}
	})
	var bSingle throttle.Booking
	lostThenRetried("single", func() (int64, error) {
		var err error
		bSingle, err = eng.Book(ctx, key, limit, single[0])
		return bSingle.At.UnixMicro() - bSingle.Wait.Microseconds(), err
	}, func() { applyAhead(single) }, func(now int64) {
		d := g.book(now, single[0])
		r3CheckBooking(t, now, single[0], bSingle, d, "retried single")
		recs = append(recs, &r3Rec{b: bSingle, d: d, slot: now + d.wait})
	})
	var rb throttle.RetryBooking
	recalled := false
	lostThenRetried("retry", func() (int64, error) {
		var err error
		rb, err = eng.BookRetry(ctx, []string{key}, limits, single[0], idx)
		return rb.Now.UnixMicro(), err
	}, func() {
		if retrySlot != 0 {
			recalled = true // a second lost call recalled the first's entry
			return
		}
		retrySlot = g.slot(now0, single[0].N)
		applyAhead(single)
	}, func(now int64) {
		if recalled { // the entry was recalled by a lost call: this one books
			d := g.book(now, single[0])
			r3CheckBooking(t, now, single[0], rb.Booking, d, "retried BookRetry")
			return
		}
		zs, _ := direct.ZRangeWithScores(ctx, prefix+"{r3rc}:idx", 0, -1).Result()
		require.True(t, rb.Recalled, "the retried BookRetry recalls the lost one's recorded slot: %+v; index %v, now %d, slot %d", rb, zs, now, retrySlot)
		require.Equal(t, retrySlot, rb.At.UnixMicro(), "recalled slot")
		recs = append(recs, &r3Rec{b: rb.Booking, d: r3Dec{ok: true}, slot: retrySlot})
	})
	r3CheckKeys(t, direct, prefix, []string{key}, g, now0, "after the retries")
	n := r3Standing(t, limits, recs, "standing")
	t.Logf("%d bookings stand; key TAT %d µs after the setup's decision", n, g.tat[0]-now0)
}

// TestReviewRuns3SeveredInFlight: the proxy's connections are severed
// with a batch in flight, its request held back (it never reached Redis:
// nothing may be booked) or its reply held back (the script ran: booked
// once, never twice, whatever go-redis does with the broken connection).
// On the test clock, with an engine timeout far longer than the hold, so
// the sever is what ends the call. The next batch on the key and the keys
// after every step are r3GCRA's. One limit (book.lua's one-step path) and
// two (its loop).
func TestReviewRuns3SeveredInFlight(t *testing.T) {
	t.Parallel()
	// A server of its own: another test's SCRIPT FLUSH on the shared one
	// turns a lost call's reply into NOSCRIPT, and the script never runs.
	srv := redistest.Start(t)
	direct := srv.Client(t)
	p := redistest.NewProxy(t, srv.Addr)
	// go-redis's default retries: the engine must keep them from running
	// a booking twice.
	rdb := p.Client(t, srv, func(o *redis.Options) { o.MaxRetries = 3 })
	prefix := redistest.Prefix(t)
	eng, err := throttle.New(rdb, throttle.WithPrefix(prefix), throttle.WithTimeout(10*time.Second), throttle.WithProbeBackoff(5*time.Millisecond, 20*time.Millisecond))
	require.NoError(t, err)
	require.NoError(t, eng.Load(context.Background()))
	rng := rand.New(rand.NewPCG(5, 55))
	sets := [][]throttle.Limit{
		{throttle.Every(time.Second, 10, 4)},
		{throttle.Every(time.Second, 10, 4), throttle.Every(time.Minute, 100, 9)},
	}
	for set, limits := range sets {
		m := len(limits)
		keys := r3Keys(fmt.Sprintf("r3sev%d", set), m)
		g := newR3GCRA(limits)
		now := int64(1_767_225_600_000_000)
		bookAll := func(ctx context.Context, reqs []throttle.Request) ([]throttle.Booking, error) {
			if m == 1 {
				return eng.BookBatch(ctx, keys[0], limits[0], reqs)
			}
			return eng.BookAll(ctx, keys, limits, reqs)
		}
		for round := 0; round < 6; round++ {
			what := fmt.Sprintf("set %d round %d", set, round)
			now += rng.Int64N(500_000)
			reqs := r3Batch(rng, r3MaxN(limits), 2+rng.IntN(40), g.I[0])
			reqs[0].MaxWait = throttle.Forever // books at least one: the key changes
			replyHeld := round%2 == 0
			require.NoError(t, rdb.Ping(context.Background()).Err())
			before, _ := direct.Get(context.Background(), prefix+keys[0]).Result()
			if replyHeld {
				p.SetReplyDelay(5 * time.Second)
			} else {
				p.SetLatency(5 * time.Second)
			}
			done := make(chan error, 1)
			ctx := testhook.WithNow(context.Background(), now)
			go func() {
				_, err := bookAll(ctx, reqs)
				done <- err
			}()
			if replyHeld {
				// Sever once the script has run: the key has changed.
				require.Eventually(t, func() bool {
					v, _ := direct.Get(context.Background(), prefix+keys[0]).Result()
					return v != before
				}, 5*time.Second, time.Millisecond, what)
			} else {
				time.Sleep(100 * time.Millisecond)
			}
			p.Sever()
			err := <-done
			p.SetLatency(0)
			require.ErrorIs(t, err, throttle.ErrUnavailable, what)
			if replyHeld {
				require.ErrorIs(t, err, throttle.ErrReplyLost, what)
				for _, r := range reqs {
					g.book(now, r)
				}
			}
			r3CheckKeys(t, direct, prefix, keys, g, now, what+": after the sever")
			// The next batch, once the breaker lets it through.
			now += 1 + rng.Int64N(3)
			next := r3Batch(rng, r3MaxN(limits), 1+rng.IntN(40), g.I[0])
			var bs []throttle.Booking
			for end := time.Now().Add(10 * time.Second); ; {
				bs, err = bookAll(testhook.WithNow(context.Background(), now), next)
				if err == nil {
					break
				}
				require.ErrorIs(t, err, throttle.ErrUnavailable, what)
				require.False(t, errors.Is(err, throttle.ErrReplyLost), "%s: %v", what, err)
				require.True(t, time.Now().Before(end), "%s: %v", what, err)
				time.Sleep(5 * time.Millisecond)
			}
			for i, r := range next {
				r3CheckBooking(t, now, r, bs[i], g.book(now, r), fmt.Sprintf("%s: next %d", what, i))
			}
			r3CheckKeys(t, direct, prefix, keys, g, now, what+": after the next batch")
		}
	}
}

// r3NoScript counts NOSCRIPT answers to EVALSHA.
type r3NoScript struct{ n atomic.Int64 }

func (h *r3NoScript) DialHook(next redis.DialHook) redis.DialHook { return next }

func (h *r3NoScript) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		err := next(ctx, cmd)
		if err != nil && redis.HasErrorPrefix(err, "NOSCRIPT") {
			h.n.Add(1)
		}
		return err
	}
}

func (h *r3NoScript) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}

// TestReviewRuns3ScriptFlush: SCRIPT FLUSH before every call, and every
// call (a batch under one limit and under two, a single booking, a
// BookRetry, a refund, a check) must load its script again (NOSCRIPT,
// then EVAL) and answer as r3GCRA says, on the test clock; the keys after
// each call too. Half the calls go to a fresh engine (no script ever
// loaded), half to one whose scripts were flushed.
func TestReviewRuns3ScriptFlush(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	srv.RequireReal(t)
	rdb := srv.Client(t)
	hook := &r3NoScript{}
	rdb.AddHook(hook)
	prefix := redistest.Prefix(t)
	engOld, err := throttle.New(rdb, throttle.WithPrefix(prefix), throttle.WithTimeout(10*time.Second))
	require.NoError(t, err)
	rng := rand.New(rand.NewPCG(9, 99))
	sets := [][]throttle.Limit{
		{throttle.Every(time.Second, 10, 3)},
		{throttle.Every(time.Second, 10, 3), throttle.Every(time.Minute, 40, 6)},
	}
	var flushes int
	for set, limits := range sets {
		m := len(limits)
		keys := r3Keys(fmt.Sprintf("r3fl%d", set), m)
		idxKey := fmt.Sprintf("{r3fl%d}:idx", set)
		g := newR3GCRA(limits)
		now := int64(1_767_225_600_000_000)
		var recs []*r3Rec
		for step := 0; step < 40; step++ {
			what := fmt.Sprintf("set %d step %d", set, step)
			now += rng.Int64N(300_000)
			ctx := testhook.WithNow(context.Background(), now)
			require.NoError(t, rdb.ScriptFlush(context.Background()).Err())
			flushes++
			eng := engOld
			if step%2 == 1 {
				eng, err = throttle.New(rdb, throttle.WithPrefix(prefix), throttle.WithTimeout(10*time.Second))
				require.NoError(t, err)
			}
			switch rng.IntN(5) {
			case 0, 1:
				reqs := r3Batch(rng, r3MaxN(limits), 1+rng.IntN(80), g.I[0])
				var bs []throttle.Booking
				if m == 1 && len(reqs) == 1 {
					var b throttle.Booking
					b, err = eng.Book(ctx, keys[0], limits[0], reqs[0])
					bs = []throttle.Booking{b}
				} else {
					bs, err = eng.BookAll(ctx, keys, limits, reqs)
				}
				require.NoError(t, err, what)
				for i, r := range reqs {
					d := g.book(now, r)
					r3CheckBooking(t, now, r, bs[i], d, fmt.Sprintf("%s request %d", what, i))
					recs = append(recs, &r3Rec{b: bs[i], d: d, slot: now + d.wait})
				}
			case 2:
				r := r3Batch(rng, r3MaxN(limits), 1, g.I[0])[0]
				idx := throttle.RetryIndex{Key: idxKey, Member: "s" + strconv.Itoa(step), KeepFrom: time.Hour, Window: time.Second, MaxDue: 5}
				rb, err := eng.BookRetry(ctx, keys, limits, r, idx)
				require.NoError(t, err, what)
				d := g.book(now, r)
				require.False(t, rb.Recalled, what)
				r3CheckBooking(t, now, r, rb.Booking, d, what)
				recs = append(recs, &r3Rec{b: rb.Booking, d: d, slot: now + d.wait})
			case 3:
				var target *r3Rec
				for i := len(recs) - 1; i >= 0; i-- {
					if recs[i].d.ok && !recs[i].tomb {
						target = recs[i]
						break
					}
				}
				if target == nil {
					continue
				}
				given, err := eng.RefundAll(ctx, keys, limits, target.b)
				require.NoError(t, err, what)
				want := g.refund(now, target)
				for k := range want {
					require.Equal(t, time.Duration(want[k])*time.Microsecond, given[k], "%s: refund key %d", what, k)
				}
			case 4:
				n := 1 + rng.IntN(r3MaxN(limits))
				probe := &r3GCRA{I: g.I, tau: g.tau, tat: slices.Clone(g.tat)}
				d := probe.book(now, throttle.Request{N: n})
				res, err := eng.AllowAll(ctx, keys, limits, n)
				require.NoError(t, err, what)
				require.Equal(t, d.ok, res.Allowed, what)
				if d.ok {
					g.book(now, throttle.Request{N: n})
				}
			}
			r3CheckKeys(t, rdb, prefix, keys, g, now, what)
		}
		t.Logf("set %d: %d bookings stand", set, r3Standing(t, limits, recs, fmt.Sprintf("set %d", set)))
	}
	t.Logf("%d flushes, %d NOSCRIPT answers", flushes, hook.n.Load())
	require.GreaterOrEqual(t, hook.n.Load(), int64(flushes)-10, "most calls met NOSCRIPT")
}
