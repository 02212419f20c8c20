package throttle_test

// Adversarial review of WithMergeWait (8183994: a merged batch waits for a
// flight token at most d, then goes without one and gives none back) and
// of e6b1ed5 (a reply that came but cannot be read matches ErrReplyLost),
// through the public API only. Token counts are seen from outside: with a
// reply delay shorter than the engine's WithMergeWait, k bookings at once
// must all be in flight at once (a lost token holds the k-th back until a
// call lands), and k+1 at once must not be (an extra token lets it fly).

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"math/rand/v2"
	"net"
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
	"github.com/slotbook/slotbook/throttle"
)

var mwForever = throttle.Request{N: 1, MaxWait: throttle.Forever}

// mwRequireTokens checks that exactly k flight tokens exist: k bookings at
// once all fly at once, and (in one of three tries) k+1 at once do not.
// delay must be well below the engine's WithMergeWait.
func (r *rmaRig) mwRequireTokens(t *testing.T, k int, delay time.Duration) {
	t.Helper()
	r.requireFlightsBack(t, k, delay)
	r.p.SetReplyDelay(delay)
	defer r.p.SetReplyDelay(0)
	var peaks []int64
	for try := range 3 {
		peak, _ := r.concurrentPeak(t, fmt.Sprintf("extra%d-%d", try, time.Now().UnixNano()), k+1)
		if peak <= int64(k) {
			return
		}
		peaks = append(peaks, peak)
	}
	t.Fatalf("%d bookings at once with WithMergeAt(%d): %v in flight in three tries (an extra flight token)", k+1, k, peaks)
}

// mwEngine is rmaEngine with every connection of its pool open (its
// handshake done) before the reply delay is set.
func mwEngine(t *testing.T, srv *redistest.Server, pool int, delay time.Duration, opts ...throttle.Option) *rmaRig {
	t.Helper()
	r := rmaEngine(t, srv, pool, 0, opts...)
	r.mwWarm(pool)
	r.p.SetReplyDelay(delay)
	return r
}

// mwWarm opens n connections of r's client (after lost replies closed them).
func (r *rmaRig) mwWarm(n int) {
	var warm sync.WaitGroup
	for range n {
		warm.Go(func() { _ = r.rdb.Ping(context.Background()).Err() })
	}
	warm.Wait()
}

// mwOutcome is what one caller heard.
type mwOutcome struct {
	key string
	b   throttle.Booking
	err error
}

// mwCheck judges o: booked once on success; an empty key when the caller
// left before its request was sent (its context's error, no lost reply).
func (r *rmaRig) mwCheck(t *testing.T, o mwOutcome) {
	t.Helper()
	switch err := o.err; {
	case err == nil:
		r.mwBookedOnce(t, o)
	case errors.Is(err, throttle.ErrReplyLost):
		// Sent, its caller gone: it may hold its booking.
	case errors.Is(err, context.DeadlineExceeded), errors.Is(err, context.Canceled):
		r.requireEmpty(t, o.key, "left before being sent")
	default:
		t.Fatalf("%s: unexpected error %v", o.key, err)
	}
}

// mwBookedOnce checks that o's fresh key (one unit of rmaLim, booked)
// holds exactly its booking: TAT = decision time + I.
func (r *rmaRig) mwBookedOnce(t *testing.T, o mwOutcome) {
	t.Helper()
	require.True(t, o.b.OK, "%s: an idle key refused", o.key)
	require.Zero(t, o.b.Wait, "%s: an idle key's wait", o.key)
	v, err := r.direct.Get(context.Background(), r.prefix+o.key).Int64()
	require.NoError(t, err, o.key)
	require.Equal(t, mwDecided(o.b)+limitcheck.Interval(rmaLim), v, "%s: TAT after one booking (none twice, none lost)", o.key)
}

// mwCtx is a context that ends after end (a deadline, or a cancel if stop);
// none if end is 0.
func mwCtx(end time.Duration, stop bool) (context.Context, context.CancelFunc) {
	switch {
	case end <= 0:
		return context.Background(), func() {}
	case stop:
		ctx, cancel := context.WithCancel(context.Background())
		tm := time.AfterFunc(end, cancel)
		return ctx, func() { tm.Stop(); cancel() }
	default:
		return context.WithTimeout(context.Background(), end)
	}
}

// mwHolders starts n lone bookings that take the flight tokens, and
// returns once they are in flight; wait returns their errors.
func (r *rmaRig) mwHolders(t *testing.T, tag string, n int) (wait func() []error) {
	t.Helper()
	var wg sync.WaitGroup
	errs := make([]error, n)
	calls0 := r.calls.Load()
	for i := range n {
		wg.Go(func() {
			_, errs[i] = r.eng.Book(context.Background(), fmt.Sprintf("%s-holder%d", tag, i), rmaLim, mwForever)
		})
	}
	r.awaitHolders(t, calls0, n)
	return func() []error {
		waitAll(t, &wg, 20*time.Second, tag+" holders")
		return errs
	}
}

// TestReviewMWBadWait: WithMergeWait of 0 or below is an error from New,
// before any Redis call (not even a dial); Forever and 1ns are taken.
func TestReviewMWBadWait(t *testing.T) {
	t.Parallel()
	srv := redistest.Shared(t)
	rdb := srv.Client(t)
	var dials, cmds atomic.Int64
	rdb.AddHook(mwCount{&dials, &cmds})
	for _, d := range []time.Duration{0, -1, -time.Millisecond, -throttle.Forever, time.Duration(-1 << 63)} {
		eng, err := throttle.New(rdb, throttle.WithMergeWait(d))
		require.Error(t, err, "WithMergeWait(%v)", d)
		require.Nil(t, eng)
		require.ErrorContains(t, err, "WithMergeWait")
	}
	for _, d := range []time.Duration{time.Nanosecond, throttle.Forever, throttle.Forever - 1} {
		_, err := throttle.New(rdb, throttle.WithMergeWait(d), throttle.WithMergeAt(1))
		require.NoError(t, err, "WithMergeWait(%v)", d)
	}
	require.Zero(t, dials.Load(), "dials by New")
	require.Zero(t, cmds.Load(), "commands by New")
}

// mwCount counts dials and commands of a client.
type mwCount struct{ dials, cmds *atomic.Int64 }

func (h mwCount) DialHook(next redis.DialHook) redis.DialHook {
	return func(ctx context.Context, network, addr string) (net.Conn, error) {
		h.dials.Add(1)
		return next(ctx, network, addr)
	}
}
func (h mwCount) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		h.cmds.Add(1)
		return next(ctx, cmds)
	}
}
func (h mwCount) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		h.cmds.Add(1)
		return next(ctx, cmd)
	}
}

// TestReviewMWTokensAfterTokenless: WithMergeAt(2), WithMergeWait(60ms),
// replies held back 250 ms, pool 10. Four rounds: two holders take the
// tokens; 24 callers arrive over ~100 ms, a third without an end, the
// others with a deadline or a cancel between 10 and 140 ms, so batches go
// without a token while their members leave. Every caller is answered,
// each as it should be (booked once, or its context's error and an empty
// key); token-less calls did fly (more than two in flight); afterwards
// exactly two tokens exist.
func TestReviewMWTokensAfterTokenless(t *testing.T) {
	t.Parallel()
	const d = 60 * time.Millisecond
	r := mwEngine(t, redistest.Start(t), 10, 250*time.Millisecond, throttle.WithMergeAt(2), throttle.WithMergeWait(d))
	rng := rand.New(rand.NewPCG(7, 11))
	var most int64
	for round := range 4 {
		r.fl.most.Store(0)
		wait := r.mwHolders(t, fmt.Sprintf("r%d", round), 2)
		outs := make([]mwOutcome, 24)
		var wg sync.WaitGroup
		for i := range outs {
			end := time.Duration(10+rng.IntN(131)) * time.Millisecond
			kind := rng.IntN(3)
			if kind == 0 {
				end = 0
			}
			ctx, cancel := mwCtx(end, kind == 2)
			key := fmt.Sprintf("r%d-c%d", round, i)
			wg.Go(func() {
				defer cancel()
				b, err := r.eng.Book(ctx, key, rmaLim, mwForever)
				outs[i] = mwOutcome{key, b, err}
			})
			time.Sleep(time.Duration(rng.IntN(9)) * time.Millisecond)
		}
		waitAll(t, &wg, 20*time.Second, fmt.Sprintf("round %d", round))
		for _, err := range wait() {
			require.NoError(t, err)
		}
		for _, o := range outs {
			r.mwCheck(t, o)
		}
		most = max(most, r.fl.most.Load())
	}
	t.Logf("most booking calls in flight in a round: %d", most)
	require.Greater(t, most, int64(2), "no batch went without a token")
	r.p.SetReplyDelay(0)
	r.mwRequireTokens(t, 2, 20*time.Millisecond)
}

// TestReviewMWLeaveAtWaitEnd: WithMergeAt(1), WithMergeWait(40ms), replies
// held back 150 ms. Twenty rounds of a holder, then a leader and followers
// whose contexts end (deadline or cancel) within a few ms of the moment
// the leader's wait runs out, and a follower without an end. Each caller
// is answered as it should be, the one without an end is booked, nothing
// hangs, and afterwards exactly one token exists.
func TestReviewMWLeaveAtWaitEnd(t *testing.T) {
	t.Parallel()
	const d = 40 * time.Millisecond
	r := mwEngine(t, redistest.Start(t), 8, 150*time.Millisecond, throttle.WithMergeAt(1), throttle.WithMergeWait(d))
	rng := rand.New(rand.NewPCG(3, 5))
	for round := range 20 {
		wait := r.mwHolders(t, fmt.Sprintf("e%d", round), 1)
		type caller struct {
			name string
			end  time.Duration
			stop bool
		}
		jit := func() time.Duration { return time.Duration(rng.IntN(7)-3) * time.Millisecond }
		callers := []caller{
			{"lead", d + jit(), rng.IntN(2) == 0},
			{"f1", d + jit(), rng.IntN(2) == 0},
			{"stay", 0, false},
			{"f2", d - 2*time.Millisecond + jit(), rng.IntN(2) == 0},
		}
		outs := make([]mwOutcome, len(callers))
		var wg sync.WaitGroup
		for i, c := range callers {
			ctx, cancel := mwCtx(c.end, c.stop)
			key := fmt.Sprintf("e%d-%s", round, c.name)
			wg.Go(func() {
				defer cancel()
				b, err := r.eng.Book(ctx, key, rmaLim, mwForever)
				outs[i] = mwOutcome{key, b, err}
			})
			time.Sleep(time.Millisecond)
		}
		waitAll(t, &wg, 10*time.Second, fmt.Sprintf("round %d", round))
		for _, err := range wait() {
			require.NoError(t, err)
		}
		for i, o := range outs {
			if callers[i].end == 0 {
				require.NoError(t, o.err, o.key)
			}
			r.mwCheck(t, o)
		}
	}
	r.p.SetReplyDelay(0)
	r.mwRequireTokens(t, 1, 15*time.Millisecond)
}

// mwDecided is the decision time of b on the Redis clock (µs).
func mwDecided(b throttle.Booking) int64 { return b.At.UnixMicro() - b.Wait.Microseconds() }

// TestReviewMWLeaderLeavingRestartsWait: WithMergeWait's doc says "a
// booking waits at most d longer than it would alone (and its call's
// round trip)". WithMergeAt(1), WithMergeWait(300ms), replies held back
// 3 s, so the one token stays with a holder and a batch must go without
// it. Control: a lone booking behind the holder is decided (Redis clock)
// about d after it started. Then a batch whose leader's deadline ends at
// 250 ms, a second member whose deadline ends at 280 ms, and a member
// without an end: each leader that leaves hands the lead on. The batch's
// wait runs from when it formed, so the member without an end is decided
// about d after it started (when each new leader started a fresh wait of
// d, it was about 1.9 d).
func TestReviewMWLeaderLeavingRestartsWait(t *testing.T) {
	t.Parallel()
	const d = 300 * time.Millisecond
	r := mwEngine(t, redistest.Start(t), 6, 3*time.Second, throttle.WithMergeAt(1), throttle.WithMergeWait(d))
	ctx := context.Background()
	redisNow := func() int64 {
		tm, err := r.direct.Time(ctx).Result()
		require.NoError(t, err)
		return tm.UnixMicro()
	}

	// Control.
	wait := r.mwHolders(t, "ctl", 1)
	start := redisNow()
	b, err := r.eng.Book(ctx, "ctl", rmaLim, mwForever)
	require.NoError(t, err)
	control := time.Duration(mwDecided(b)-start) * time.Microsecond
	for _, err := range wait() {
		require.NoError(t, err)
	}

	// Leaders leave one after another.
	wait = r.mwHolders(t, "lv", 1)
	var wg sync.WaitGroup
	outs := make([]mwOutcome, 3)
	for i, end := range []time.Duration{250 * time.Millisecond, 280 * time.Millisecond} {
		c, cancel := context.WithTimeout(ctx, end)
		key := fmt.Sprintf("lv%d", i)
		wg.Go(func() {
			defer cancel()
			b, err := r.eng.Book(c, key, rmaLim, mwForever)
			outs[i] = mwOutcome{key, b, err}
		})
		time.Sleep(10 * time.Millisecond)
	}
	stayStart := redisNow()
	wg.Go(func() {
		b, err := r.eng.Book(ctx, "stay", rmaLim, mwForever)
		outs[2] = mwOutcome{"stay", b, err}
	})
	waitAll(t, &wg, 15*time.Second, "leavers")
	for _, err := range wait() {
		require.NoError(t, err)
	}
	for i := range 2 {
		require.ErrorIs(t, outs[i].err, context.DeadlineExceeded, outs[i].key)
		r.requireEmpty(t, outs[i].key, "left while its batch waited")
	}
	require.NoError(t, outs[2].err)
	r.mwBookedOnce(t, outs[2])
	stayed := time.Duration(mwDecided(outs[2].b)-stayStart) * time.Microsecond
	t.Logf("WithMergeWait %v: a lone booking behind the holder decided %v after it started; the member of a batch whose leaders left, %v", d, control, stayed)
	require.LessOrEqual(t, stayed, max(control, d)+150*time.Millisecond,
		"a booking of a batch whose leaders left waited %v on the Redis clock; the doc bounds its extra wait by WithMergeWait (%v)", stayed, d)
}

// TestReviewMWBatchesBeyondTheCount: WithMergeWait's doc says the calls
// beyond the count carry full batches (64 bookings) or batches that
// waited d, at most one that is not full per d. WithMergeAt(1),
// WithMergeWait(300ms), replies held back 2.5 s, pool 12, a holder takes
// the token. 200 bookings arrive at once (three full batches), then one
// every 20 ms for 1.2 s. Each booking is booked once, one call a batch;
// the batches that are not full are decided (Redis clock) at least d
// apart (less a margin), so the stream merges too.
func TestReviewMWBatchesBeyondTheCount(t *testing.T) {
	t.Parallel()
	const d = 300 * time.Millisecond
	r := mwEngine(t, redistest.Start(t), 12, 2500*time.Millisecond, throttle.WithMergeAt(1), throttle.WithMergeWait(d))
	wait := r.mwHolders(t, "full", 1)
	before := r.calls.Load()
	outs := make([]mwOutcome, 200)
	var wg sync.WaitGroup
	for i := range outs {
		key := fmt.Sprintf("full%d", i)
		wg.Go(func() {
			b, err := r.eng.Book(context.Background(), key, rmaLim, mwForever)
			outs[i] = mwOutcome{key, b, err}
		})
	}
	// The stream, beside the burst's batches.
	stream := make([]mwOutcome, 60)
	for i := range stream {
		key := fmt.Sprintf("stream%d", i)
		wg.Go(func() {
			b, err := r.eng.Book(context.Background(), key, rmaLim, mwForever)
			stream[i] = mwOutcome{key, b, err}
		})
		time.Sleep(20 * time.Millisecond)
	}
	waitAll(t, &wg, 20*time.Second, "batches")
	for _, err := range wait() {
		require.NoError(t, err)
	}
	calls := r.calls.Load() - before
	// The calls, by decision time on the Redis clock (one a call).
	decided := map[int64]int{}
	for _, o := range append(outs, stream...) {
		require.NoError(t, o.err, o.key)
		r.mwBookedOnce(t, o)
		decided[mwDecided(o.b)]++
	}
	times := slices.Sorted(maps.Keys(decided))
	var sizes []int
	var partial []int64 // decision times of the calls that were not full
	for _, at := range times {
		sizes = append(sizes, decided[at])
		if decided[at] < 64 {
			partial = append(partial, at)
		}
	}
	var gaps []time.Duration
	for i := 1; i < len(partial); i++ {
		gaps = append(gaps, time.Duration(partial[i]-partial[i-1])*time.Microsecond)
	}
	t.Logf("%d calls after the holder's, of %v bookings; those not full decided apart by %v", calls, sizes, gaps)
	require.Equal(t, int64(len(times)), calls, "calls: one a batch")
	require.GreaterOrEqual(t, slices.Max(sizes), 64, "no full batch")
	require.Less(t, len(partial), 1+len(stream)/3, "the stream's bookings hardly merged")
	for _, g := range gaps {
		require.GreaterOrEqual(t, g, d-50*time.Millisecond, "batches that are not full decided %v apart; the doc allows one per WithMergeWait (%v)", gaps, d)
	}
}

// TestReviewMWAloneResends: bookings answered "alone" by a merged call
// are sent again alone, each waiting for a flight token at most d, so they
// may go out together beside the count (the doc says so): WithMergeAt(1),
// WithMergeWait(100ms), replies held back 400 ms, pool 32. A holder takes
// the token; 20 bookings merge behind it (corrupt keys; or 19 allowed keys
// and one outside the ACL user's keys, NOPERM for the whole call). Each is
// answered as it should be (ErrCorruptState / NOPERM, or booked once), and
// no token is lost or added.
func TestReviewMWAloneResends(t *testing.T) {
	t.Parallel()
	const d = 100 * time.Millisecond
	const delay = 400 * time.Millisecond
	for _, mode := range []string{"corrupt", "noperm"} {
		t.Run(mode, func(t *testing.T) {
			t.Parallel()
			srv := redistest.Start(t)
			var r *rmaRig
			outsider := ""
			if mode == "corrupt" {
				r = mwEngine(t, srv, 32, delay, throttle.WithMergeAt(1), throttle.WithMergeWait(d))
			} else {
				prefix := redistest.Prefix(t)
				admin := srv.Client(t)
				require.NoError(t, admin.Do(context.Background(), append([]any{"ACL", "SETUSER", "mw", "on", ">secret", "resetkeys", "~" + prefix + "ok*", "~" + prefix + "peak-*", "resetchannels", "-@all"},
					splitAny(aclCommands)...)...).Err())
				r = mwACLEngine(t, srv, prefix, 32, delay, throttle.WithMergeAt(1), throttle.WithMergeWait(d))
				outsider = "outsider"
			}
			keys := make([]string, 20)
			for i := range keys {
				keys[i] = fmt.Sprintf("ok%d", i)
				if mode == "corrupt" {
					require.NoError(t, r.direct.Set(context.Background(), r.prefix+keys[i], "not a tat", time.Minute).Err())
				}
			}
			if outsider != "" {
				keys[7] = outsider
			}
			wait := r.mwHolders(t, "ok", 1)
			r.fl.most.Store(0)
			outs := make([]mwOutcome, len(keys))
			var wg sync.WaitGroup
			for i, k := range keys {
				wg.Go(func() {
					b, err := r.eng.Book(context.Background(), k, rmaLim, mwForever)
					outs[i] = mwOutcome{k, b, err}
				})
			}
			waitAll(t, &wg, 20*time.Second, "alone resends")
			for _, err := range wait() {
				require.NoError(t, err)
			}
			peak := r.fl.most.Load()
			for _, o := range outs {
				switch {
				case mode == "corrupt":
					require.ErrorIs(t, o.err, throttle.ErrCorruptState, o.key)
					require.NotErrorIs(t, o.err, throttle.ErrReplyLost, o.key)
				case o.key == outsider:
					require.ErrorContains(t, o.err, "NOPERM")
				default:
					require.NoError(t, o.err, o.key)
					r.mwBookedOnce(t, o)
				}
			}
			r.p.SetReplyDelay(0)
			r.mwRequireTokens(t, 1, 30*time.Millisecond)
			t.Logf("%s: most booking calls in flight at once %d (WithMergeAt(1), WithMergeWait %v, replies %v later)", mode, peak, d, delay)
		})
	}
}

// mwACLEngine is rmaEngine as the ACL user "mw" (password "secret"),
// with prefix.
func mwACLEngine(t *testing.T, srv *redistest.Server, prefix string, pool int, delay time.Duration, opts ...throttle.Option) *rmaRig {
	t.Helper()
	p := redistest.NewProxy(t, srv.Addr)
	rdb := p.Client(t, srv, func(o *redis.Options) {
		o.PoolSize, o.MinIdleConns = pool, pool
		o.Username, o.Password = "mw", "secret"
	})
	eng, err := throttle.New(rdb, append([]throttle.Option{throttle.WithPrefix(prefix), throttle.WithTimeout(5 * time.Second)}, opts...)...)
	require.NoError(t, err)
	require.NoError(t, eng.Load(context.Background()))
	require.NoError(t, rdb.Ping(context.Background()).Err())
	r := &rmaRig{eng: eng, rdb: rdb, direct: srv.Client(t), prefix: prefix, p: p, fl: new(inFlight)}
	rdb.AddHook(r.fl)
	r.calls = callcount.Attach(rdb)
	r.mwWarm(pool)
	p.SetReplyDelay(delay)
	return r
}

// mwSharedRec is one booking of a key shared between callers.
type mwSharedRec struct {
	n int
	b throttle.Booking
}

// TestReviewMWLatencyTextbook: 40 ms each way, a pool of 8, the default
// WithMergeAt and WithMergeWait (250µs, far below a round trip, so batches
// go beside the calls in flight). 24 callers, 14 bookings each: on keys
// of their own (random sizes and max waits; replayed in the caller's
// order) and on four keys shared by all (random sizes, no max wait;
// replayed in the order of their decision times and slots). Every booking
// is what a textbook GCRA gives on the Redis clock; each key's TAT in
// Redis is the textbook's last (nothing booked twice or lost); some
// bookings merged.
func TestReviewMWLatencyTextbook(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	r := rmaEngine(t, srv, 8, 0)
	r.mwWarm(8)
	r.p.SetLatency(40 * time.Millisecond)
	ownLimits := []throttle.Limit{throttle.Every(time.Minute, 7, 2), rmaLim, throttle.Every(20*time.Second, 4, 3)}
	shared := throttle.Every(10*time.Second, 20, 3) // I = 500 ms
	var mu sync.Mutex
	own := map[string][]mergeRecord{}
	sh := map[string][]mwSharedRec{}
	var bookings atomic.Int64
	before := r.calls.Load()
	var wg sync.WaitGroup
	for g := range 24 {
		wg.Go(func() {
			rng := rand.New(rand.NewPCG(uint64(g), 99))
			for i := range 14 {
				ctx := context.Background()
				if rng.IntN(2) == 0 {
					key := fmt.Sprintf("own%d-%d", g, i%3)
					lim := ownLimits[i%3]
					n := 1 + rng.IntN(lim.Burst+1)
					mw := [...]time.Duration{0, 100 * time.Millisecond, 10 * time.Second, throttle.Forever}[rng.IntN(4)]
					b, err := r.eng.Book(ctx, key, lim, throttle.Request{N: n, MaxWait: mw})
					if err != nil {
						t.Errorf("%s: %v", key, err)
						return
					}
					mu.Lock()
					own[key] = append(own[key], mergeRecord{key, lim, n, mw, b})
					mu.Unlock()
				} else {
					key := fmt.Sprintf("shared%d", rng.IntN(4))
					n := 1 + rng.IntN(shared.Burst+1)
					b, err := r.eng.Book(ctx, key, shared, throttle.Request{N: n, MaxWait: throttle.Forever})
					if err != nil {
						t.Errorf("%s: %v", key, err)
						return
					}
					mu.Lock()
					sh[key] = append(sh[key], mwSharedRec{n, b})
					mu.Unlock()
				}
				bookings.Add(1)
			}
		})
	}
	waitAll(t, &wg, 3*time.Minute, "latency load")
	require.False(t, t.Failed())
	calls := r.calls.Load() - before
	t.Logf("%d bookings in %d calls; most in flight at once %d", bookings.Load(), calls, r.fl.most.Load())
	require.Less(t, calls, bookings.Load(), "no booking merged")
	replayTextbook(t, own)
	ctx := context.Background()
	tm, err := r.direct.Time(ctx).Result()
	require.NoError(t, err)
	now := tm.UnixMicro()
	finalOf := func(key string, tat int64) {
		t.Helper()
		if tat < now+time.Second.Microseconds() {
			return // may have expired
		}
		v, err := r.direct.Get(ctx, r.prefix+key).Int64()
		require.NoError(t, err, key)
		require.Equal(t, tat, v, "%s: TAT in Redis against the textbook's (a booking lost or made twice)", key)
	}
	for key, rs := range own {
		m := &textbookModel{limits: []throttle.Limit{rs[0].limit}, tat: make([]int64, 1), known: make([]bool, 1)}
		for _, rec := range rs {
			m.judge(mwDecided(rec.b), rec.n, min(rec.maxWait, throttle.MaxHorizon).Microseconds())
		}
		finalOf(key, m.tat[0])
	}
	for key, rs := range sh {
		sort.Slice(rs, func(i, j int) bool {
			a, b := rs[i].b, rs[j].b
			if mwDecided(a) != mwDecided(b) {
				return mwDecided(a) < mwDecided(b)
			}
			return a.At.Before(b.At)
		})
		m := &textbookModel{limits: []throttle.Limit{shared}, tat: make([]int64, 1), known: make([]bool, 1)}
		for i, rec := range rs {
			ok, wait, _ := m.judge(mwDecided(rec.b), rec.n, throttle.MaxHorizon.Microseconds())
			require.True(t, ok && rec.b.OK, "%s booking %d refused", key, i)
			require.Equal(t, wait, rec.b.Wait.Microseconds(), "%s booking %d (n=%d): wait in µs", key, i, rec.n)
		}
		finalOf(key, m.tat[0])
	}
}

// TestReviewMWRedisAway: WithMergeAt(2), WithMergeWait(150ms), replies
// held back 400 ms, pool 10. Holders take the tokens, callers arrive every
// 15 ms so that batches wait and go without tokens, and Redis stops while
// they do. Every caller is answered (a booking, or ErrUnavailable), none
// hangs; after a restart bookings succeed and exactly two tokens exist.
func TestReviewMWRedisAway(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	r := mwEngine(t, srv, 10, 400*time.Millisecond, throttle.WithMergeAt(2), throttle.WithMergeWait(150*time.Millisecond),
		throttle.WithProbeBackoff(50*time.Millisecond, 200*time.Millisecond))
	for round := range 2 {
		var wg sync.WaitGroup
		outs := make([]mwOutcome, 22)
		for i := range outs {
			key := fmt.Sprintf("away%d-%d", round, i)
			wg.Go(func() {
				b, err := r.eng.Book(context.Background(), key, rmaLim, mwForever)
				outs[i] = mwOutcome{key, b, err}
			})
			if i == 12 {
				srv.Stop()
			}
			time.Sleep(15 * time.Millisecond)
		}
		waitAll(t, &wg, 30*time.Second, "Redis stopped")
		failed := 0
		for _, o := range outs {
			if o.err != nil {
				failed++
				require.ErrorIs(t, o.err, throttle.ErrUnavailable, o.key)
			}
		}
		require.Positive(t, failed)
		srv.Restart(t)
		r.p.SetReplyDelay(0)
		redistest.UntilOK(t, func() error {
			_, err := r.eng.Book(context.Background(), fmt.Sprintf("back%d", round), rmaLim, mwForever)
			return err
		})
		require.NoError(t, r.eng.Load(context.Background()))
		r.mwWarm(10)
		for _, o := range outs {
			if o.err == nil {
				require.True(t, o.b.OK)
			}
		}
		r.p.SetReplyDelay(400 * time.Millisecond)
	}
	r.p.SetReplyDelay(0)
	r.mwWarm(10)
	r.mwRequireTokens(t, 2, 40*time.Millisecond)
}

// TestReviewMWRepliesLostTokenless: WithMergeAt(1), WithMergeWait(120ms),
// engine timeout 400 ms, replies held back 900 ms. A holder, then a batch
// of three that goes without the token, then two more that form the next
// batch: each hears ErrUnavailable, and those whose call was sent before
// the breaker opened ErrReplyLost too (the holder and the first batch
// certainly); none hangs; once replies come in time, exactly one token
// exists.
func TestReviewMWRepliesLostTokenless(t *testing.T) {
	t.Parallel()
	r := rmaEngine(t, redistest.Start(t), 8, 0, throttle.WithMergeAt(1), throttle.WithMergeWait(120*time.Millisecond),
		throttle.WithTimeout(400*time.Millisecond), throttle.WithProbeBackoff(50*time.Millisecond, 200*time.Millisecond))
	r.mwWarm(8) // every connection open: no call waits on a handshake behind the delay
	r.p.SetReplyDelay(900 * time.Millisecond)
	var wg sync.WaitGroup
	outs := make([]mwOutcome, 6)
	for i := range outs {
		key := fmt.Sprintf("lost%d", i)
		wg.Go(func() {
			b, err := r.eng.Book(context.Background(), key, rmaLim, mwForever)
			outs[i] = mwOutcome{key, b, err}
		})
		switch i {
		case 0:
			time.Sleep(30 * time.Millisecond)
		case 3:
			time.Sleep(140 * time.Millisecond) // the first batch is sent; the next forms
		}
	}
	waitAll(t, &wg, 15*time.Second, "lost replies")
	for i, o := range outs {
		require.ErrorIs(t, o.err, throttle.ErrUnavailable, o.key)
		if i < 4 {
			require.ErrorIs(t, o.err, throttle.ErrReplyLost, o.key)
		}
	}
	r.p.SetReplyDelay(0)
	redistest.UntilOK(t, func() error {
		_, err := r.eng.Book(context.Background(), "after", rmaLim, mwForever)
		return err
	})
	r.mwWarm(8)
	r.mwRequireTokens(t, 1, 40*time.Millisecond)
}

// TestReviewMWCallerEndsAfterSend: WithMergeAt(1), WithMergeWait(50ms),
// replies held back 500 ms. A batch goes without the token at ~50 ms; a
// member whose context ends at 200 ms (after its call was sent, before
// its reply) gets its context's error, not ErrReplyLost, and its booking
// is given back, as the package doc says (a deadline and a cancel); a
// member whose context ended at 20 ms (before) left with its error.
func TestReviewMWCallerEndsAfterSend(t *testing.T) {
	t.Parallel()
	r := mwEngine(t, redistest.Start(t), 6, 500*time.Millisecond, throttle.WithMergeAt(1), throttle.WithMergeWait(50*time.Millisecond))
	wait := r.mwHolders(t, "send", 1)
	var wg sync.WaitGroup
	ends := []time.Duration{0, 200 * time.Millisecond, 20 * time.Millisecond, 200 * time.Millisecond}
	outs := make([]mwOutcome, len(ends))
	for i, end := range ends {
		ctx, cancel := mwCtx(end, i == 3)
		key := fmt.Sprintf("send%d", i)
		wg.Go(func() {
			defer cancel()
			b, err := r.eng.Book(ctx, key, rmaLim, mwForever)
			outs[i] = mwOutcome{key, b, err}
		})
	}
	waitAll(t, &wg, 10*time.Second, "batch")
	for _, err := range wait() {
		require.NoError(t, err)
	}
	for i, o := range outs {
		switch i {
		case 2:
			require.ErrorIs(t, o.err, context.DeadlineExceeded)
			r.requireEmpty(t, o.key, "left before its batch was sent")
		case 1, 3:
			want := map[int]error{1: context.DeadlineExceeded, 3: context.Canceled}[i]
			require.ErrorIs(t, o.err, want, o.key)
			require.NotErrorIs(t, o.err, throttle.ErrReplyLost, o.key)
			// Given back: the key holds no TAT ahead of Redis's clock.
			v, err := r.direct.Get(context.Background(), r.prefix+o.key).Int64()
			if !errors.Is(err, redis.Nil) {
				require.NoError(t, err, o.key)
				tm, err := r.direct.Time(context.Background()).Result()
				require.NoError(t, err)
				require.LessOrEqual(t, v, tm.UnixMicro(), "%s: its booking given back", o.key)
			}
		default:
			require.NoError(t, o.err, o.key)
			r.mwBookedOnce(t, o)
		}
	}
}

// TestReviewMWUnreadableTokenless: a batch that went without a token and
// whose reply cannot be read: each member hears ErrReplyLost, not
// ErrUnavailable; its key holds its booking; the breaker stays closed;
// exactly one token exists afterwards.
func TestReviewMWUnreadableTokenless(t *testing.T) {
	t.Parallel()
	r := mwEngine(t, redistest.Start(t), 6, 300*time.Millisecond, throttle.WithMergeAt(1), throttle.WithMergeWait(100*time.Millisecond))
	g := garble()
	r.rdb.AddHook(g)
	g.on.Store(true)
	wait := r.mwHolders(t, "gb", 1)
	before := r.calls.Load()
	r.fl.most.Store(0)
	var wg sync.WaitGroup
	outs := make([]mwOutcome, 3)
	for i := range outs {
		key := fmt.Sprintf("gb%d", i)
		wg.Go(func() {
			b, err := r.eng.Book(context.Background(), key, rmaLim, mwForever)
			outs[i] = mwOutcome{key, b, err}
		})
	}
	waitAll(t, &wg, 10*time.Second, "garbled")
	holderErrs := wait()
	require.ErrorIs(t, holderErrs[0], throttle.ErrReplyLost)
	require.Equal(t, int64(1), r.calls.Load()-before, "one merged call")
	require.Equal(t, int64(2), r.fl.most.Load(), "the batch flew beside the holder")
	for _, o := range outs {
		require.ErrorIs(t, o.err, throttle.ErrReplyLost, o.key)
		require.NotErrorIs(t, o.err, throttle.ErrUnavailable, o.key)
		r.requireBookedOnce(t, o.key)
	}
	open, _ := r.eng.Unavailable()
	require.False(t, open, "breaker after unreadable replies")
	g.on.Store(false)
	r.p.SetReplyDelay(0)
	r.mwRequireTokens(t, 1, 30*time.Millisecond)
}

// TestReviewMWHeartbeatUnreadable: the package doc's table says a reply
// that came but is not what the script answers is ErrReplyLost. Heartbeat
// (a script that writes) with a garbled reply.
func TestReviewMWHeartbeatUnreadable(t *testing.T) {
	t.Parallel()
	g := garble()
	e := hookedEnv(t, g)
	g.on.Store(true)
	_, err := e.eng.Heartbeat(context.Background(), "hb", "p1", time.Minute)
	require.Error(t, err)
	require.ErrorIs(t, err, throttle.ErrReplyLost, "Heartbeat with an unreadable reply: %v", err)
}

// TestReviewMWHeartbeatRefused: the package doc's table says a dial that
// failed (connection refused) is ErrUnavailable. Heartbeat on a port
// where nothing listens.
func TestReviewMWHeartbeatRefused(t *testing.T) {
	t.Parallel()
	rdb := redis.NewClient(&redis.Options{Addr: "127.0.0.1:1", ContextTimeoutEnabled: true, MaxRetries: -1})
	defer rdb.Close()
	eng, err := throttle.New(rdb, throttle.WithTimeout(time.Second))
	require.NoError(t, err)
	_, err = eng.Heartbeat(context.Background(), "hb", "p1", time.Minute)
	require.Error(t, err)
	require.ErrorIs(t, err, throttle.ErrUnavailable, "Heartbeat with Redis refusing connections: %v", err)
	_, err = eng.Book(context.Background(), "k", rmaLim, mwForever)
	require.ErrorIs(t, err, throttle.ErrUnavailable, "Book with Redis refusing connections (the control)")
}

// TestReviewMWChurn: WithMergeAt(3), WithMergeWait(25ms), replies held back
// 50 ms (so batches often go without a token), pool 12. Sixteen callers
// book fresh keys in a closed loop for 2 s, most with a deadline or a
// cancel at a random point up to 80 ms (before, around or after their
// batch is sent), one in five a corrupt key (answered alone, sent again
// alone). Each caller is answered as it should be, none hangs; afterwards
// exactly three tokens exist.
func TestReviewMWChurn(t *testing.T) {
	t.Parallel()
	r := mwEngine(t, redistest.Start(t), 12, 50*time.Millisecond, throttle.WithMergeAt(3), throttle.WithMergeWait(25*time.Millisecond))
	end := time.Now().Add(2 * time.Second)
	var wg sync.WaitGroup
	var n, left, corrupt atomic.Int64
	outc := make(chan mwOutcome, 4096)
	for g := range 16 {
		wg.Go(func() {
			rng := rand.New(rand.NewPCG(uint64(g), 42))
			for i := 0; time.Now().Before(end); i++ {
				key := fmt.Sprintf("ch%d-%d", g, i)
				bad := rng.IntN(5) == 0
				if bad {
					key = "bad-" + key
					if err := r.direct.Set(context.Background(), r.prefix+key, "x", time.Minute).Err(); err != nil {
						t.Error(err)
						return
					}
				}
				var stop time.Duration
				if rng.IntN(4) != 0 {
					stop = time.Duration(1+rng.IntN(80)) * time.Millisecond
				}
				ctx, cancel := mwCtx(stop, rng.IntN(2) == 0)
				b, err := r.eng.Book(ctx, key, rmaLim, mwForever)
				cancel()
				n.Add(1)
				if bad {
					corrupt.Add(1)
					if err == nil || !(errors.Is(err, throttle.ErrCorruptState) || errors.Is(err, context.DeadlineExceeded) || errors.Is(err, context.Canceled)) {
						t.Errorf("%s: corrupt key: %v", key, err)
					}
					continue
				}
				if err != nil {
					left.Add(1)
				}
				select {
				case outc <- mwOutcome{key, b, err}:
				default:
				}
			}
		})
	}
	waitAll(t, &wg, 60*time.Second, "churn")
	close(outc)
	for o := range outc {
		r.mwCheck(t, o)
	}
	t.Logf("%d bookings (%d on corrupt keys), %d good ones left or lost; most in flight %d", n.Load(), corrupt.Load(), left.Load(), r.fl.most.Load())
	r.p.SetReplyDelay(0)
	r.mwRequireTokens(t, 3, 8*time.Millisecond)
}
