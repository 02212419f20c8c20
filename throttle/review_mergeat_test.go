package throttle_test

// Review of WithMergeAt (at most k single bookings and merged calls in
// flight per engine; the others merge) through the public API, on its
// side paths, most with WithMergeWait(Forever), so that the count holds
// strictly and a batch waits behind the calls in flight: callers leaving
// while a batch waits for a flight token, lost replies, Redis stopped, a
// mixed load at 40 ms each way checked against a textbook GCRA of its
// own, the option's corners, and an Observer that panics inside a merged
// call. Whether the flight tokens all came back is seen from outside: k
// concurrent bookings through a proxy that holds replies back must all be
// in flight at once (a lost token holds the k-th back until another call
// lands).

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"sort"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/slotbook/slotbook/internal/callcount"
	"github.com/slotbook/slotbook/internal/limitcheck"
	"github.com/slotbook/slotbook/internal/redistest"
	"github.com/slotbook/slotbook/internal/testhook"
	"github.com/slotbook/slotbook/throttle"
)

// rmaRig is an engine through a proxy, with a hook that counts script
// calls in flight and a call counter on the proxied client.
type rmaRig struct {
	eng    *throttle.Engine
	rdb    *redis.Client // through the proxy
	direct *redis.Client
	prefix string
	p      *redistest.Proxy
	fl     *inFlight
	calls  *callcount.Counter
}

// rmaEngine builds an rmaRig on srv with a pool of pool connections, all
// opened before the proxy's reply delay is set.
func rmaEngine(t *testing.T, srv *redistest.Server, pool int, delay time.Duration, opts ...throttle.Option) *rmaRig {
	t.Helper()
	p := redistest.NewProxy(t, srv.Addr)
	rdb := p.Client(t, srv, func(o *redis.Options) { o.PoolSize = pool; o.MinIdleConns = pool })
	prefix := redistest.Prefix(t)
	eng, err := throttle.New(rdb, append([]throttle.Option{throttle.WithPrefix(prefix), throttle.WithTimeout(5 * time.Second)}, opts...)...)
	require.NoError(t, err)
	require.NoError(t, eng.Load(context.Background()))
	require.NoError(t, rdb.Ping(context.Background()).Err())
	fl := new(inFlight)
	rdb.AddHook(fl)
	p.SetReplyDelay(delay)
	return &rmaRig{eng: eng, rdb: rdb, direct: srv.Client(t), prefix: prefix, p: p, fl: fl, calls: callcount.Attach(rdb)}
}

var rmaLim = throttle.PerMinute(6, 0) // I = 10 s: a key booked twice shows it

// concurrentPeak books k fresh keys at once (each caller bounded by 10 s)
// and returns the most booking calls in flight at once, and the number of
// calls made. The proxy's reply delay must be set.
func (r *rmaRig) concurrentPeak(t *testing.T, tag string, k int) (peak, calls int64) {
	t.Helper()
	r.fl.most.Store(0)
	before := r.calls.Load()
	var wg sync.WaitGroup
	errs := make([]error, k)
	for i := range k {
		wg.Go(func() {
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			var b throttle.Booking
			b, errs[i] = r.eng.Book(ctx, fmt.Sprintf("peak-%s-%d", tag, i), rmaLim, throttle.Request{N: 1, MaxWait: throttle.Forever})
			if errs[i] == nil && !b.OK {
				errs[i] = errors.New("an idle key refused")
			}
		})
	}
	wg.Wait()
	for i, err := range errs {
		require.NoError(t, err, "%s: booking %d", tag, i)
	}
	return r.fl.most.Load(), r.calls.Load() - before
}

// requireFlightsBack checks that k (the engine's WithMergeAt) bookings at
// once all go out at once: every flight token is back. A busy machine may
// start a goroutine late, so one of three tries must show it.
func (r *rmaRig) requireFlightsBack(t *testing.T, k int, delay time.Duration) {
	t.Helper()
	r.p.SetReplyDelay(delay)
	defer r.p.SetReplyDelay(0)
	var peaks []int64
	for try := range 3 {
		peak, calls := r.concurrentPeak(t, fmt.Sprintf("back%d-%d", try, time.Now().UnixNano()), k)
		require.Equal(t, int64(k), calls, "calls for %d bookings with room for %d in flight", k, k)
		if peak == int64(k) {
			return
		}
		peaks = append(peaks, peak)
	}
	t.Fatalf("%d bookings at once with WithMergeAt(%d): at most %v in flight in three tries (a flight token lost)", k, k, peaks)
}

// requireEmpty checks that key holds nothing (nothing was booked on it).
func (r *rmaRig) requireEmpty(t *testing.T, key string, why string) {
	t.Helper()
	err := r.direct.Get(context.Background(), r.prefix+key).Err()
	require.ErrorIs(t, err, redis.Nil, "%s: key %s holds a booking", why, key)
}

// requireBookedOnce checks that key holds exactly one booking of rmaLim.
func (r *rmaRig) requireBookedOnce(t *testing.T, key string) {
	t.Helper()
	ctx := context.Background()
	v, err := r.direct.Get(ctx, r.prefix+key).Int64()
	require.NoError(t, err, key)
	tm, err := r.direct.Time(ctx).Result()
	require.NoError(t, err)
	ahead := time.Duration(v-tm.UnixMicro()) * time.Microsecond
	require.Greater(t, ahead, rmaLim.Interval()-2*time.Second, "%s: not booked", key)
	require.LessOrEqual(t, ahead, rmaLim.Interval(), "%s: booked more than once", key)
}

// waitAll waits for wg, failing the test if it takes over d.
// awaitHolders waits until the n holders' booking calls, started after
// r.calls read calls0, are in flight (each holding a flight token: the
// inFlight hook counts a call before callcount does), and returns r.calls
// then: the callers that follow find the tokens taken, and their calls
// are counted apart. It replaces sleeps of 40 and 60 ms, which a stall of
// the holders' goroutines outran (their calls then came after the
// others', and were counted with them).
func (r *rmaRig) awaitHolders(t *testing.T, calls0 int64, n int) int64 {
	t.Helper()
	require.Eventually(t, func() bool {
		return r.fl.now.Load() >= int64(n) && r.calls.Load()-calls0 >= int64(n)
	}, 5*time.Second, time.Millisecond, "%d holders in flight", n)
	return r.calls.Load()
}

func waitAll(t *testing.T, wg *sync.WaitGroup, d time.Duration, what string) {
	t.Helper()
	done := make(chan struct{})
	go func() { wg.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(d):
		t.Fatalf("%s: callers still waiting after %v", what, d)
	}
}

// TestReviewMergeAtLeaveWhileBoarding: with WithMergeAt(2),
// WithMergeWait(Forever) and a pool of 6 (connections free), two lone
// bookings hold both flight tokens while their replies are held back 500 ms; a batch forms behind them, whose
// leader waits for a flight token. Callers of the batch leave while it
// waits (by deadline or cancel; the leader first, a follower first, or
// every one of them): each gets its context's error, not a lost reply,
// and its key stays empty; a caller without an end is booked once, in a
// call of its own behind the holders. No caller hangs, and afterwards two
// bookings at once both go out at once (the tokens came back).
func TestReviewMergeAtLeaveWhileBoarding(t *testing.T) {
	t.Parallel()
	type caller struct {
		name string
		end  time.Duration // 0: none
		stop bool          // cancel at end rather than a deadline
	}
	cases := map[string][]caller{
		"leaderFirst":   {{"lead", 100 * time.Millisecond, false}, {"fol", 180 * time.Millisecond, false}, {"stay", 0, false}},
		"followerFirst": {{"lead", 180 * time.Millisecond, false}, {"fol", 100 * time.Millisecond, false}, {"stay", 0, false}},
		"cancelled":     {{"lead", 100 * time.Millisecond, true}, {"stay", 0, false}, {"fol", 150 * time.Millisecond, true}},
		"everyoneLeaves": {{"lead", 100 * time.Millisecond, false}, {"fol", 120 * time.Millisecond, true},
			{"fol2", 140 * time.Millisecond, false}},
	}
	srv := redistest.Start(t)
	for name, callers := range cases {
		t.Run(name, func(t *testing.T) {
			r := rmaEngine(t, srv, 6, 500*time.Millisecond, throttle.WithMergeAt(2), throttle.WithMergeWait(throttle.Forever))
			var hold sync.WaitGroup
			holdErrs := make([]error, 2)
			calls0 := r.calls.Load()
			for i := range 2 {
				hold.Go(func() {
					_, holdErrs[i] = r.eng.Book(context.Background(), fmt.Sprintf("holder%d", i), rmaLim, throttle.Request{N: 1, MaxWait: throttle.Forever})
				})
			}
			before := r.awaitHolders(t, calls0, 2) // both holders hold a flight token
			errs := make([]error, len(callers))
			var wg sync.WaitGroup
			for i, c := range callers {
				ctx, cancel := context.Background(), context.CancelFunc(func() {})
				switch {
				case c.end > 0 && c.stop:
					ctx, cancel = context.WithCancel(ctx)
					time.AfterFunc(c.end, cancel)
				case c.end > 0:
					ctx, cancel = context.WithTimeout(ctx, c.end)
				}
				wg.Go(func() {
					defer cancel()
					_, errs[i] = r.eng.Book(ctx, c.name, rmaLim, throttle.Request{N: 1, MaxWait: throttle.Forever})
				})
				time.Sleep(15 * time.Millisecond) // in order: the first leads
			}
			waitAll(t, &wg, 10*time.Second, "batch")
			waitAll(t, &hold, 10*time.Second, "holders")
			for _, err := range holdErrs {
				require.NoError(t, err)
			}
			stayed := 0
			for i, c := range callers {
				if c.end == 0 {
					stayed++
					require.NoError(t, errs[i], c.name)
					r.requireBookedOnce(t, c.name)
					continue
				}
				want := context.DeadlineExceeded
				if c.stop {
					want = context.Canceled
				}
				require.ErrorIs(t, errs[i], want, c.name)
				require.NotErrorIs(t, errs[i], throttle.ErrReplyLost, c.name)
				r.requireEmpty(t, c.name, "left while waiting for a flight token")
			}
			require.Equal(t, int64(stayed), r.calls.Load()-before, "calls for the batch behind the holders")
			r.requireFlightsBack(t, 2, 300*time.Millisecond)
		})
	}
}

// TestReviewMergeAtRepliesLost: WithMergeAt(2), WithMergeWait(Forever), pool 6, an engine timeout
// of 600 ms, replies held back 1.2 s. Two lone bookings and a batch of
// four behind them all fail (a lost reply, or ErrUnavailable once the
// breaker opened), none hangs; once replies come in time again, bookings
// succeed, and two at once both go out at once.
func TestReviewMergeAtRepliesLost(t *testing.T) {
	t.Parallel()
	r := rmaEngine(t, redistest.Start(t), 6, 1200*time.Millisecond, throttle.WithMergeAt(2), throttle.WithMergeWait(throttle.Forever), throttle.WithTimeout(600*time.Millisecond),
		throttle.WithProbeBackoff(50*time.Millisecond, 200*time.Millisecond))
	var wg sync.WaitGroup
	errs := make([]error, 6)
	for i := range 6 {
		wg.Go(func() {
			_, errs[i] = r.eng.Book(context.Background(), fmt.Sprintf("lost%d", i), rmaLim, throttle.Request{N: 1, MaxWait: throttle.Forever})
		})
		if i < 2 {
			time.Sleep(20 * time.Millisecond)
		}
	}
	waitAll(t, &wg, 10*time.Second, "lost replies")
	for i, err := range errs {
		require.ErrorIs(t, err, throttle.ErrUnavailable, "booking %d", i)
	}
	r.p.SetReplyDelay(0)
	redistest.UntilOK(t, func() error {
		_, err := r.eng.Book(context.Background(), "after", rmaLim, throttle.Request{N: 1, MaxWait: throttle.Forever})
		return err
	})
	// The pool's connections closed on the lost replies: open them again
	// before replies are held back (a handshake through the proxy costs
	// round trips of its own).
	var warm sync.WaitGroup
	for range 6 {
		warm.Go(func() { _ = r.rdb.Ping(context.Background()).Err() })
	}
	warm.Wait()
	r.requireFlightsBack(t, 2, 150*time.Millisecond)
}

// TestReviewMergeAtRedisStopped: Redis stops while two lone bookings hold
// the flight tokens (WithMergeAt(2), WithMergeWait(Forever), pool 6) and a batch waits behind
// them: every caller gets ErrUnavailable, none hangs; the breaker is open,
// so the next bookings fail without a call; once Redis is back they
// succeed, and two at once both go out at once.
func TestReviewMergeAtRedisStopped(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	r := rmaEngine(t, srv, 6, 300*time.Millisecond, throttle.WithMergeAt(2), throttle.WithMergeWait(throttle.Forever),
		throttle.WithProbeBackoff(50*time.Millisecond, 200*time.Millisecond))
	var wg sync.WaitGroup
	errs := make([]error, 6)
	for i := range 6 {
		wg.Go(func() {
			_, errs[i] = r.eng.Book(context.Background(), fmt.Sprintf("stop%d", i), rmaLim, throttle.Request{N: 1, MaxWait: throttle.Forever})
		})
		time.Sleep(10 * time.Millisecond)
	}
	time.Sleep(50 * time.Millisecond)
	srv.Stop()
	waitAll(t, &wg, 15*time.Second, "Redis stopped")
	failed := 0
	for i, err := range errs {
		// A lone booking's request reached Redis before it stopped; its
		// reply, held in the proxy, may still come.
		if err != nil {
			failed++
			require.ErrorIs(t, err, throttle.ErrUnavailable, "booking %d", i)
		}
	}
	require.Positive(t, failed, "every booking succeeded with Redis stopped")
	// The breaker is open: calls fail fast, none sent.
	before := r.calls.Load()
	var fast sync.WaitGroup
	for i := range 8 {
		fast.Go(func() {
			_, err := r.eng.Book(context.Background(), fmt.Sprintf("fast%d", i), rmaLim, throttle.Request{N: 1, MaxWait: throttle.Forever})
			if !errors.Is(err, throttle.ErrUnavailable) {
				t.Errorf("booking %d while Redis is down: %v", i, err)
			}
		})
	}
	waitAll(t, &fast, 15*time.Second, "breaker open")
	t.Logf("%d calls sent for 8 bookings while the breaker was open (probes)", r.calls.Load()-before)
	srv.Restart(t)
	r.p.SetReplyDelay(0)
	redistest.UntilOK(t, func() error {
		_, err := r.eng.Book(context.Background(), "back", rmaLim, throttle.Request{N: 1, MaxWait: throttle.Forever})
		return err
	})
	r.requireFlightsBack(t, 2, 300*time.Millisecond)
}

// rmaKey is one key of the mixed load with its textbook state.
type rmaKey struct {
	mu    sync.Mutex // one operation on the key at a time: its order is known
	name  string
	lim   throttle.Limit
	tat   int64 // µs, Redis clock; 0: never written
	last  int64 // the latest decision time known on the key
	stand []rmaBooking
	cells []rmaCell // every unit that stands (booked, not given back)
}

type rmaBooking struct {
	b       throttle.Booking
	before  int64 // the model's TAT before it (the decision time if idle)
	after   int64
	n       int
	refunds bool // given back (its cells do not stand)
	cell    int  // index of its first cell
}

type rmaCell struct {
	at     int64
	given  bool
	source string
}

// textbook judge (virtual scheduling, cell by cell) of n units at now with
// max wait mw (µs) under lim on k's TAT; it books them if they fit.
func (k *rmaKey) judge(now int64, n int, mw int64) (ok bool, wait, before, after int64) {
	I := limitcheck.Interval(k.lim)
	tau := I * int64(k.lim.Burst)
	tat := max(k.tat, now)
	slot := now
	for j := range n {
		slot = max(slot, tat+int64(j)*I-tau)
	}
	wait = slot - now
	if wait > mw {
		return false, wait, tat, tat
	}
	after = tat
	for range n {
		after = max(after, slot) + I
	}
	return true, wait, tat, after
}

// TestReviewMergeAtMixedLatency: 40 ms each way, a pool of 8, WithMergeAt's
// default count, WithMergeWait(Forever) (at this latency the default wait
// sends most single bookings alone). Sixteen callers mix single bookings (merged or alone), BookAll
// batches of several requests, Refunds of the latest booking and Allows
// on ten shared keys, one operation on a key at a time (so that each
// key's order is known). Every booking and Allow is what a textbook GCRA
// gives at its Redis time; each key's standing units never exceed the
// limit in any window on the Redis clock (Booking().At); fewer calls than
// single bookings went out (some merged).
func TestReviewMergeAtMixedLatency(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	r := rmaEngine(t, srv, 8, 0, throttle.WithMergeWait(throttle.Forever))
	r.p.SetLatency(40 * time.Millisecond)
	limits := []throttle.Limit{throttle.PerSecond(20, 2), throttle.PerSecond(5, 1), throttle.Every(time.Second, 3, 3)}
	keys := make([]*rmaKey, 10)
	for i := range keys {
		keys[i] = &rmaKey{name: fmt.Sprintf("mix%d", i), lim: limits[i%len(limits)]}
	}
	ctx := context.Background()
	var singles, others, refundsGiven, allowsSeen atomic.Int64
	var wg sync.WaitGroup
	errc := make(chan error, 16)
	report := func(format string, args ...any) {
		select {
		case errc <- fmt.Errorf(format, args...):
		default:
		}
	}
	start := r.calls.Load()
	for g := range 16 {
		wg.Go(func() {
			rng := rand.New(rand.NewPCG(uint64(g), 99))
			for range 24 {
				k := keys[rng.IntN(len(keys))]
				k.mu.Lock()
				err := r.mixedOp(ctx, rng, k, &singles, &others, &refundsGiven, &allowsSeen)
				k.mu.Unlock()
				if err != nil {
					report("%s: %v", k.name, err)
					return
				}
			}
		})
	}
	waitAll(t, &wg, 2*time.Minute, "mixed load")
	close(errc)
	for err := range errc {
		require.NoError(t, err)
	}
	calls := r.calls.Load() - start
	t.Logf("%d single bookings, %d other calls (BookAll, Allow, Refund), %d refunds given, %d allows; %d calls in all", singles.Load(), others.Load(), refundsGiven.Load(), allowsSeen.Load(), calls)
	require.Less(t, calls, singles.Load()+others.Load(), "no single booking merged")
	for _, k := range keys {
		requireWithinLimit(t, k)
	}
}

// mixedOp runs one random operation on k (whose lock is held) and checks
// it against k's textbook state.
func (r *rmaRig) mixedOp(ctx context.Context, rng *rand.Rand, k *rmaKey, singles, others, refunds, allows *atomic.Int64) error {
	I := limitcheck.Interval(k.lim)
	switch op := rng.IntN(10); {
	case op < 5 || (op < 7 && len(k.stand) == 0): // single booking (merged or alone)
		n := 1 + rng.IntN(k.lim.Burst+1)
		mw := [...]time.Duration{0, 100 * time.Millisecond, 3 * time.Second, throttle.Forever}[rng.IntN(4)]
		b, err := r.eng.Book(ctx, k.name, k.lim, throttle.Request{N: n, MaxWait: mw})
		if err != nil {
			return err
		}
		singles.Add(1)
		return k.check(b, n, mw, "Book")
	case op < 7: // refund of the latest booking that stands
		last := &k.stand[len(k.stand)-1]
		tm, err := r.direct.Time(ctx).Result()
		if err != nil {
			return err
		}
		if last.refunds || last.b.At.UnixMicro() < tm.UnixMicro()+500_000 {
			return nil // its slot may come before the refund runs: not modelled
		}
		others.Add(1)
		given, err := r.eng.Refund(ctx, k.name, k.lim, last.b)
		if err != nil {
			return err
		}
		latest := k.tat == last.after
		if !latest {
			if given != 0 {
				return fmt.Errorf("refund of a booking others were built on gave back %v", given)
			}
			return nil
		}
		if given <= 0 || given.Microseconds() > last.after-last.before {
			return fmt.Errorf("refund of the latest booking gave back %v (booking spans %d µs)", given, last.after-last.before)
		}
		refunds.Add(1)
		last.refunds = true
		for j := range last.n {
			k.cells[last.cell+j].given = true
		}
		k.tat = last.before
		k.stand = k.stand[:len(k.stand)-1]
		return nil
	case op < 8: // BookAll: several requests on the key
		reqs := make([]throttle.Request, 2+rng.IntN(3))
		for i := range reqs {
			reqs[i] = throttle.Request{N: 1 + rng.IntN(k.lim.Burst+1), MaxWait: [...]time.Duration{0, 200 * time.Millisecond, throttle.Forever}[rng.IntN(3)]}
		}
		others.Add(1)
		bs, err := r.eng.BookAll(ctx, []string{k.name}, []throttle.Limit{k.lim}, reqs)
		if err != nil {
			return err
		}
		now := bs[0].At.UnixMicro() - bs[0].Wait.Microseconds()
		for i, b := range bs {
			if got := b.At.UnixMicro() - b.Wait.Microseconds(); got != now {
				return fmt.Errorf("BookAll request %d decided at %d, the first at %d", i, got, now)
			}
			if err := k.check(b, reqs[i].N, reqs[i].MaxWait, fmt.Sprintf("BookAll[%d]", i)); err != nil {
				return err
			}
		}
		return nil
	default: // Allow: one unit now
		others.Add(1)
		res, err := r.eng.Allow(ctx, k.name, k.lim)
		if err != nil {
			return err
		}
		allows.Add(1)
		tau := I * int64(k.lim.Burst)
		if !res.Allowed {
			// Refused: RetryAfter is the wait to TAT - tau, so it tells
			// the decision time.
			now := k.tat - tau - res.RetryAfter.Microseconds()
			if k.tat == 0 || now < k.last || res.RetryAfter <= 0 {
				return fmt.Errorf("Allow refused (retry after %v) on a TAT of %d after a decision at %d", res.RetryAfter, k.tat, k.last)
			}
			if res.ResetAfter.Microseconds() != k.tat-now {
				return fmt.Errorf("Allow refused: ResetAfter %v, want %dµs", res.ResetAfter, k.tat-now)
			}
			k.last = now
			return nil
		}
		// Allowed: the key's TAT is now max(TAT, now) + I. Read it (the
		// lock keeps it) to tell an idle key (TAT now + I, which gives the
		// decision time) from a busy one (TAT + I; the decision time is
		// not pinned down, and its unit stays out of the window check).
		v, err := r.direct.Get(ctx, r.prefix+k.name).Int64()
		if errors.Is(err, redis.Nil) {
			// Expired since: the reply's 40 ms back and a busy machine can
			// outlast a TAT one interval ahead. The key is idle now, and
			// the Allow's decision time is not pinned down: its unit stays
			// out of the window check.
			k.tat = 0
			return nil
		}
		if err != nil {
			return err
		}
		switch {
		case v == k.tat+I && k.tat >= k.last:
			// Busy: allowed only if TAT - tau had come.
			tm, err := r.direct.Time(ctx).Result()
			if err != nil {
				return err
			}
			if k.tat-tau > tm.UnixMicro() {
				return fmt.Errorf("Allow allowed before TAT - tau (%d) came (Redis time %d)", k.tat-tau, tm.UnixMicro())
			}
		case v-I >= max(k.last, k.tat):
			now := v - I
			if res.ResetAfter != time.Duration(I)*time.Microsecond {
				return fmt.Errorf("Allow on an idle key: ResetAfter %v, want %v", res.ResetAfter, time.Duration(I)*time.Microsecond)
			}
			k.cells = append(k.cells, rmaCell{at: now, source: "Allow"})
			k.last = now
		default:
			return fmt.Errorf("Allow allowed, TAT now %d: neither the textbook's busy key (TAT %d + I %d) nor an idle one after %d", v, k.tat, I, k.last)
		}
		k.tat = v
		return nil
	}
}

// check judges b (n units, max wait mw) on k's textbook state at its
// decision time, and records it.
func (k *rmaKey) check(b throttle.Booking, n int, mw time.Duration, what string) error {
	now := b.At.UnixMicro() - b.Wait.Microseconds()
	if now < k.last {
		return fmt.Errorf("%s decided at %d, before the key's last decision at %d", what, now, k.last)
	}
	k.last = now
	ok, wait, before, after := k.judge(now, n, min(mw, throttle.MaxHorizon).Microseconds())
	if ok != b.OK || wait != b.Wait.Microseconds() {
		return fmt.Errorf("%s n=%d max wait %v at %d: got ok=%v wait=%dµs, textbook ok=%v wait=%dµs (TAT %d)", what, n, mw, now, b.OK, b.Wait.Microseconds(), ok, wait, k.tat)
	}
	if !ok {
		return nil
	}
	k.stand = append(k.stand, rmaBooking{b: b, before: before, after: after, n: n, cell: len(k.cells)})
	for range n {
		k.cells = append(k.cells, rmaCell{at: b.At.UnixMicro(), source: what})
	}
	k.tat = after
	return nil
}

// requireWithinLimit checks that k's standing units, at their slots on the
// Redis clock, never exceed the limit: in any window from one unit's slot
// to another's, at most Burst+1 units plus one per whole interval.
func requireWithinLimit(t *testing.T, k *rmaKey) {
	t.Helper()
	var at []int64
	for _, c := range k.cells {
		if !c.given {
			at = append(at, c.at)
		}
	}
	sort.Slice(at, func(i, j int) bool { return at[i] < at[j] })
	I := limitcheck.Interval(k.lim)
	for i := range at {
		for j := i; j < len(at); j++ {
			if int64(j-i+1) > (at[j]-at[i])/I+int64(k.lim.Burst)+1 {
				t.Fatalf("%s: %d units in %d µs (I=%d, burst %d)", k.name, j-i+1, at[j]-at[i], I, k.lim.Burst)
			}
		}
	}
}

// TestReviewMergeAtCorners: through a proxy holding replies back 250 ms,
// six single bookings at once with a pool of 6: WithMergeAt(1) with
// WithMergeWait(Forever) lets one call out at a time (and merges); WithMergeAt(8), above the pool, and
// WithMerging(false) with WithMergeAt(2) and a test clock with
// WithMergeAt(2) send six calls, all at once. Every booking is booked.
func TestReviewMergeAtCorners(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	type corner struct {
		opts     []throttle.Option
		clock    bool
		maxPeak  int64
		minPeak  int64
		allAlone bool
	}
	corners := map[string]corner{
		"at1":            {opts: []throttle.Option{throttle.WithMergeAt(1), throttle.WithMergeWait(throttle.Forever)}, maxPeak: 1, minPeak: 1},
		"abovePool":      {opts: []throttle.Option{throttle.WithMergeAt(8)}, maxPeak: 6, minPeak: 5, allAlone: true},
		"mergingOff":     {opts: []throttle.Option{throttle.WithMerging(false), throttle.WithMergeAt(2)}, maxPeak: 6, minPeak: 5, allAlone: true},
		"testClockAlone": {opts: []throttle.Option{throttle.WithMergeAt(2)}, clock: true, maxPeak: 6, minPeak: 5, allAlone: true},
	}
	for name, c := range corners {
		t.Run(name, func(t *testing.T) {
			r := rmaEngine(t, srv, 6, 250*time.Millisecond, c.opts...)
			if !c.clock {
				peak, calls := r.concurrentPeak(t, name, 6)
				t.Logf("peak %d, %d calls", peak, calls)
				require.LessOrEqual(t, peak, c.maxPeak)
				require.GreaterOrEqual(t, peak, c.minPeak)
				if c.allAlone {
					require.Equal(t, int64(6), calls)
				} else {
					require.Less(t, calls, int64(6), "WithMergeAt(1): none merged")
				}
				return
			}
			r.fl.most.Store(0)
			before := r.calls.Load()
			now := time.Now().UnixMicro()
			var wg sync.WaitGroup
			bs := make([]throttle.Booking, 6)
			for i := range 6 {
				wg.Go(func() {
					var err error
					bs[i], err = r.eng.Book(testhook.WithNow(context.Background(), now), "clock", rmaLim, throttle.Request{N: 1, MaxWait: throttle.Forever})
					if err != nil {
						t.Error(err)
					}
				})
			}
			wg.Wait()
			require.Equal(t, int64(6), r.calls.Load()-before, "calls at a test clock")
			require.GreaterOrEqual(t, r.fl.most.Load(), c.minPeak)
			slots := make([]int64, 6)
			for i, b := range bs {
				require.True(t, b.OK)
				require.Equal(t, now, b.At.UnixMicro()-b.Wait.Microseconds(), "decided at the test clock")
				slots[i] = b.At.UnixMicro()
			}
			slices.Sort(slots)
			for i := range slots {
				require.Equal(t, now+int64(i)*limitcheck.Interval(rmaLim), slots[i], "slot %d at the test clock", i)
			}
		})
	}
}

// clusterCalls counts the script calls of a ClusterClient.
type clusterCalls struct{ n atomic.Int64 }

func (h *clusterCalls) DialHook(next redis.DialHook) redis.DialHook { return next }
func (h *clusterCalls) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}
func (h *clusterCalls) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		if n := cmd.Name(); n == "evalsha" || n == "eval" {
			h.n.Add(1)
		}
		return next(ctx, cmd)
	}
}

// TestReviewMergeAtCluster: on a Cluster client, WithMergeAt(1) is taken
// and merges nothing: 24 single bookings at once are 24 calls, each
// booked as a textbook GCRA books it.
func TestReviewMergeAtCluster(t *testing.T) {
	t.Parallel()
	cc := redistest.StartCluster(t, 3).Client(t)
	eng, err := throttle.New(cc, throttle.WithPrefix(redistest.Prefix(t)), throttle.WithTimeout(5*time.Second), throttle.WithMergeAt(1))
	require.NoError(t, err)
	require.NoError(t, eng.Load(context.Background()))
	h := new(clusterCalls)
	cc.AddHook(h)
	var wg sync.WaitGroup
	recs := make(map[string][]mergeRecord)
	var mu sync.Mutex
	for i := range 24 {
		wg.Go(func() {
			key := fmt.Sprintf("c%d", i)
			b, err := eng.Book(context.Background(), key, rmaLim, throttle.Request{N: 1, MaxWait: throttle.Forever})
			if err != nil {
				t.Error(err)
				return
			}
			mu.Lock()
			recs[key] = append(recs[key], mergeRecord{key, rmaLim, 1, throttle.Forever, b})
			mu.Unlock()
		})
	}
	wg.Wait()
	require.Equal(t, int64(24), h.n.Load(), "calls for 24 bookings on a Cluster")
	replayTextbook(t, recs)
}

// panicky is an Observer that panics on a call of the "boom" limiter.
type panicky struct{ armed atomic.Bool }

func (*panicky) ObserveDecision(string, throttle.Outcome, time.Duration) {}
func (p *panicky) ObserveCall(limiter string, _ time.Duration, _ error) {
	if limiter == "boom" && p.armed.Load() {
		panic("observer: boom")
	}
}
func (*panicky) ObserveRefund(string, time.Duration) {}
func (*panicky) ObserveBreaker(bool)                 {}

// TestReviewMergeAtObserverPanics: WithMergeAt(1) and WithMergeWait(Forever),
// a pool of 4, replies held back 250 ms. A lone booking on "calm" holds the flight token; three
// bookings on "boom:*" merge behind it, and the Observer panics in their
// merged call. The panic goes up the leader's stack (the caller recovers
// it); the batch's other callers must get an error rather than wait for
// ever (as package reserve does for its batches: "the batch's other
// callers get an error"); the flight token and the connection token come
// back: afterwards one booking goes out (the token), and four Allows at
// once are all in flight at once (the pool's four connection tokens).
func TestReviewMergeAtObserverPanics(t *testing.T) {
	t.Parallel()
	obs := new(panicky)
	r := rmaEngine(t, redistest.Start(t), 4, 250*time.Millisecond, throttle.WithMergeAt(1), throttle.WithMergeWait(throttle.Forever), throttle.WithObserver(obs))
	obs.armed.Store(true)
	var hold sync.WaitGroup
	calls0 := r.calls.Load()
	hold.Go(func() {
		if _, err := r.eng.Book(context.Background(), "calm:h", rmaLim, throttle.Request{N: 1, MaxWait: throttle.Forever}); err != nil {
			t.Error(err)
		}
	})
	r.awaitHolders(t, calls0, 1)
	var wg sync.WaitGroup
	var panicked atomic.Int64
	results := make([]error, 3)
	answered := make([]bool, 3)
	for i := range 3 {
		wg.Go(func() {
			defer func() {
				if p := recover(); p != nil {
					panicked.Add(1)
					results[i] = fmt.Errorf("panicked: %v", p)
				}
			}()
			_, results[i] = r.eng.Book(context.Background(), fmt.Sprintf("boom:%d", i), rmaLim, throttle.Request{N: 1, MaxWait: throttle.Forever})
			answered[i] = true
		})
		time.Sleep(5 * time.Millisecond)
	}
	hold.Wait()
	done := make(chan struct{})
	go func() { wg.Wait(); close(done) }()
	var hung bool
	select {
	case <-done:
	case <-time.After(5 * time.Second):
		hung = true
	}
	obs.armed.Store(false)
	r.p.SetReplyDelay(0)
	// The flight token: one booking goes out.
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
	defer cancel()
	_, err := r.eng.Book(ctx, "calm:after", rmaLim, throttle.Request{N: 1, MaxWait: throttle.Forever})
	require.NoError(t, err, "a booking after the panic (the flight token lost?)")
	// The connection tokens: four Allows at once, all in flight at once.
	r.p.SetReplyDelay(300 * time.Millisecond)
	var peak int64
	for try := range 3 {
		r.fl.most.Store(0)
		var aw sync.WaitGroup
		for i := range 4 {
			aw.Go(func() {
				ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
				defer cancel()
				_, err := r.eng.Allow(ctx, fmt.Sprintf("calm:allow%d-%d", try, i), rmaLim)
				if err != nil {
					t.Errorf("Allow after the panic: %v", err)
				}
			})
		}
		aw.Wait()
		if peak = r.fl.most.Load(); peak == 4 {
			break
		}
	}
	if hung {
		t.Errorf("after a panic in their merged call, %d caller(s) panicked and the others never returned (answered: %v)", panicked.Load(), answered)
	}
	if peak != 4 {
		t.Errorf("Allows in flight at once on a pool of 4 after the panic: %d (a connection token lost)", peak)
	}
}
