package throttle_test

// Review of 7477926 (merging single bookings that find every connection
// busy into one bookmany.lua call) through the public API. Timing is
// judged on the Redis clock (Booking().At - Booking().Wait is a booking's
// decision time); bookings are replayed through the independent textbook
// GCRA of textbook_test.go.

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/slotbook/slotbook/internal/callcount"
	"github.com/slotbook/slotbook/internal/redistest"
	"github.com/slotbook/slotbook/throttle"
)

// reviewProxied is proxiedMergeEngine on a server of the caller's choice,
// with the client's options tweaked and the engine's options added: one
// connection (unless tweaked), its replies held back by delay once the
// connection is open.
func reviewProxied(t *testing.T, srv *redistest.Server, delay time.Duration, tweak func(*redis.Options), opts ...throttle.Option) (*throttle.Engine, *redis.Client, string, *redistest.Proxy, *callcount.Counter) {
	t.Helper()
	p := redistest.NewProxy(t, srv.Addr)
	rdb := p.Client(t, srv, func(o *redis.Options) {
		o.PoolSize = 1
		if tweak != nil {
			tweak(o)
		}
	})
	prefix := redistest.Prefix(t)
	eng, err := throttle.New(rdb, append([]throttle.Option{throttle.WithPrefix(prefix), throttle.WithTimeout(5 * time.Second)}, opts...)...)
	require.NoError(t, err)
	require.NoError(t, eng.Load(context.Background()))
	require.NoError(t, rdb.Ping(context.Background()).Err())
	p.SetReplyDelay(delay)
	return eng, srv.Client(t), prefix, p, callcount.Attach(rdb)
}

// bookAt books one request on each of keys at once, through eng, and
// returns the bookings and errors in keys' order.
func bookAt(eng *throttle.Engine, keys []string, lim throttle.Limit, req throttle.Request) ([]throttle.Booking, []error) {
	var wg sync.WaitGroup
	bs := make([]throttle.Booking, len(keys))
	errs := make([]error, len(keys))
	for i, k := range keys {
		wg.Go(func() {
			bs[i], errs[i] = eng.Book(context.Background(), k, lim, req)
		})
	}
	wg.Wait()
	return bs, errs
}

// TestReviewMergeACLOtherKeyFailsNoOne: the engine runs as a Redis user
// allowed only keys under "<prefix>ok". While the one connection is busy,
// single bookings on two allowed keys and one key outside the pattern are
// merged. Alone (the control, WithMerging(false)) the outsider gets
// NOPERM and the two allowed keys are booked; merged, each allowed key
// must still be booked (once), and only the outsider refused. Failed on
// 7477926: every merged caller got NOPERM.
func TestReviewMergeACLOtherKeyFailsNoOne(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	admin := srv.Client(t)
	ctx := context.Background()
	for _, merging := range []bool{false, true} {
		t.Run(fmt.Sprintf("merging=%v", merging), func(t *testing.T) {
			prefix := redistest.Prefix(t)
			user := fmt.Sprintf("rev%v", merging)
			require.NoError(t, admin.Do(ctx, append([]any{"ACL", "SETUSER", user, "on", ">secret", "resetkeys", "~" + prefix + "ok*", "resetchannels", "-@all"},
				splitAny(aclCommands)...)...).Err())
			p := redistest.NewProxy(t, srv.Addr)
			rdb := p.Client(t, srv, func(o *redis.Options) {
				o.PoolSize = 1
				o.Username, o.Password = user, "secret"
			})
			eng, err := throttle.New(rdb, throttle.WithPrefix(prefix), throttle.WithTimeout(5*time.Second), throttle.WithMerging(merging))
			require.NoError(t, err)
			require.NoError(t, eng.Load(ctx))
			require.NoError(t, rdb.Ping(ctx).Err())
			calls := callcount.Attach(rdb)
			p.SetReplyDelay(300 * time.Millisecond)
			lim := throttle.PerMinute(6, 0)
			for round := range 2 {
				key := func(k string) string { return fmt.Sprintf("%s-%d", k, round) }
				before := calls.Load()
				held := holdConnection(t, eng, key("ok-holder"))
				keys := []string{key("ok1"), key("outsider"), key("ok2")}
				bs, errs := bookAt(eng, keys, lim, throttle.Request{N: 1, MaxWait: throttle.Forever})
				require.NoError(t, <-held)
				t.Logf("round %d: %d calls; errors %v", round, calls.Load()-before, errs)
				require.ErrorContains(t, errs[1], "NOPERM", "the outsider")
				for _, i := range []int{0, 2} {
					require.NoError(t, errs[i], "allowed key %s, merged with an outsider", keys[i])
					require.True(t, bs[i].OK)
					require.Zero(t, bs[i].Wait)
				}
			}
		})
	}
}

// callLog is an Observer that keeps every call it is told of.
type callLog struct {
	mu    sync.Mutex
	calls []loggedCall
}

type loggedCall struct {
	limiter string
	err     error
}

func (o *callLog) ObserveDecision(string, throttle.Outcome, time.Duration) {}
func (o *callLog) ObserveRefund(string, time.Duration)                     {}
func (o *callLog) ObserveBreaker(bool)                                     {}
func (o *callLog) ObserveCall(limiter string, _ time.Duration, err error) {
	o.mu.Lock()
	o.calls = append(o.calls, loggedCall{limiter, err})
	o.mu.Unlock()
}

// TestReviewMergeLostReplySeenPerLimiter: single bookings of two limiters
// ("alpha" and "beta" keys) are merged into one call whose reply is lost.
// Every caller gets ErrReplyLost (it may have booked: quota wasted). The
// Observer, whose calls package metrics counts per limiter as
// slotbook_lost_replies_total{limiter} ("script calls sent whose reply
// never came: each may have booked slots nobody will use"), must hear of
// a lost call for each limiter whose bookings were in it; without merging
// (the control) each limiter hears of its own. Failed on 7477926: only the
// first key's limiter heard of it.
func TestReviewMergeLostReplySeenPerLimiter(t *testing.T) {
	t.Parallel()
	for _, merging := range []bool{false, true} {
		t.Run(fmt.Sprintf("merging=%v", merging), func(t *testing.T) {
			log := &callLog{}
			eng, direct, prefix, p, _ := reviewProxied(t, redistest.Shared(t), 150*time.Millisecond, nil,
				throttle.WithTimeout(500*time.Millisecond), throttle.WithObserver(log), throttle.WithMerging(merging))
			held := holdConnection(t, eng, "holder")
			awaitHolderReply(t, direct, prefix+"holder")
			p.SetReplyDelay(time.Second)
			keys := []string{"alpha:a", "alpha:b", "beta:a", "beta:b"}
			_, errs := bookAt(eng, keys, throttle.PerSecond(10, 0), throttle.Request{N: 1, MaxWait: throttle.Forever})
			<-held
			lostFor := map[string]bool{}
			for i, err := range errs {
				if errors.Is(err, throttle.ErrReplyLost) {
					name, _, _ := strings.Cut(keys[i], ":")
					lostFor[name] = true
				}
			}
			log.mu.Lock()
			seen := map[string]bool{}
			for _, c := range log.calls {
				if errors.Is(c.err, throttle.ErrReplyLost) {
					seen[c.limiter] = true
				}
			}
			log.mu.Unlock()
			t.Logf("callers with lost replies: %v; lost calls observed for: %v", lostFor, seen)
			for lim := range lostFor {
				require.True(t, seen[lim], "limiter %q: its callers got ErrReplyLost, its Observer heard of no lost call", lim)
			}
		})
	}
}

// judgeInOrder looks for an order of group (bookings of one key decided
// at one Redis time, as in one merged call) in which the textbook model,
// from m, gives each its reply; it leaves m as that order leaves it.
func judgeInOrder(m *textbookModel, group []mergeRecord) bool {
	if len(group) == 0 {
		return true
	}
	for i, r := range group {
		c := &textbookModel{limits: m.limits, tat: slices.Clone(m.tat), known: slices.Clone(m.known)}
		now := r.b.At.UnixMicro() - r.b.Wait.Microseconds()
		ok, wait, _ := c.judge(now, r.n, min(r.maxWait, throttle.MaxHorizon).Microseconds())
		if ok != r.b.OK || wait != r.b.Wait.Microseconds() {
			continue
		}
		rest := append(slices.Clone(group[:i]), group[i+1:]...)
		if judgeInOrder(c, rest) {
			copy(m.tat, c.tat)
			copy(m.known, c.known)
			return true
		}
	}
	return false
}

// replaySharedKeys replays each key's bookings, made by several callers at
// once, through the textbook GCRA: by decision time on the Redis clock,
// and within one decision time (one call) in some order that explains
// every reply.
func replaySharedKeys(t *testing.T, recs map[string][]mergeRecord) {
	t.Helper()
	for key, rs := range recs {
		decided := func(r mergeRecord) int64 { return r.b.At.UnixMicro() - r.b.Wait.Microseconds() }
		slices.SortStableFunc(rs, func(a, b mergeRecord) int { return int(decided(a) - decided(b)) })
		model := &textbookModel{limits: []throttle.Limit{rs[0].limit}, tat: make([]int64, 1), known: make([]bool, 1)}
		for i := 0; i < len(rs); {
			j := i
			for j < len(rs) && decided(rs[j]) == decided(rs[i]) {
				j++
			}
			require.True(t, judgeInOrder(model, rs[i:j]), "key %s: bookings %d to %d (decided at %d) fit no order of a textbook GCRA: %+v",
				key, i, j-1, decided(rs[i]), rs[i:j])
			i = j
		}
	}
}

// TestReviewMergeSharedKeysMatchTextbook: 24 callers book single requests
// (n from 1 to burst+1, max waits from 0 to Forever) on five shared keys
// through a client of 1 to 4 connections, so that merged calls carry the
// same key several times. Each key's bookings, merged or not, must be
// what a textbook GCRA gives, in Redis's order.
func TestReviewMergeSharedKeysMatchTextbook(t *testing.T) {
	t.Parallel()
	for _, pool := range []int{1, 2, 4} {
		t.Run(fmt.Sprintf("pool=%d", pool), func(t *testing.T) {
			eng, _, _, calls := mergeEngine(t, pool)
			before := calls.Load()
			var (
				mu   sync.Mutex
				recs = map[string][]mergeRecord{}
				wg   sync.WaitGroup
			)
			limits := []throttle.Limit{throttle.PerSecond(20, 3), throttle.Every(time.Minute, 50, 2), throttle.Every(2*time.Second, 9, 0)}
			errs := make(chan error, 24)
			for w := range 24 {
				wg.Go(func() {
					rng := rand.New(rand.NewPCG(uint64(pool), uint64(w)))
					for range 30 {
						k := rng.IntN(5)
						lim := limits[k%len(limits)]
						n := 1 + rng.IntN(lim.Burst+1)
						mw := [...]time.Duration{0, 80 * time.Millisecond, time.Second, throttle.Forever}[rng.IntN(4)]
						key := fmt.Sprintf("shared%d", k)
						b, err := eng.Book(context.Background(), key, lim, throttle.Request{N: n, MaxWait: mw})
						if err != nil {
							errs <- err
							return
						}
						mu.Lock()
						recs[key] = append(recs[key], mergeRecord{key, lim, n, mw, b})
						mu.Unlock()
					}
				})
			}
			wg.Wait()
			close(errs)
			for err := range errs {
				require.NoError(t, err)
			}
			t.Logf("pool %d: %d bookings in %d calls", pool, 24*30, calls.Load()-before)
			replaySharedKeys(t, recs)
		})
	}
}

// TestReviewMergeSameKeyRefundLatestFirst: one key booked three times in
// one merged call (n=2, 1 and 2; burst 1), after a first booking of 2:
// given back latest first, each gives its whole room back, and the key is
// then exactly where the first booking left it.
func TestReviewMergeSameKeyRefundLatestFirst(t *testing.T) {
	t.Parallel()
	eng, _, _, p, calls := proxiedMergeEngine(t, 200*time.Millisecond, 5*time.Second)
	ctx := context.Background()
	lim := throttle.Every(10*time.Second, 1, 1) // I = 10 s, tau = 10 s
	first, err := eng.Book(ctx, "k", lim, throttle.Request{N: 2, MaxWait: throttle.Forever})
	require.NoError(t, err)
	require.True(t, first.OK)
	before := calls.Load()
	held := holdConnection(t, eng, "holder")
	ns := []int{2, 1, 2}
	bs := make([]throttle.Booking, len(ns))
	errs := make([]error, len(ns))
	var wg sync.WaitGroup
	for i, n := range ns {
		wg.Go(func() {
			bs[i], errs[i] = eng.Book(ctx, "k", lim, throttle.Request{N: n, MaxWait: throttle.Forever})
		})
		time.Sleep(5 * time.Millisecond)
	}
	wg.Wait()
	require.NoError(t, <-held)
	for _, err := range errs {
		require.NoError(t, err)
	}
	t.Logf("%d calls for the holder and three bookings", calls.Load()-before)
	p.SetReplyDelay(0)
	slices.SortFunc(bs, func(a, b throttle.Booking) int { return a.At.Compare(b.At) })
	for i := len(bs) - 1; i >= 0; i-- {
		given, err := eng.Refund(ctx, "k", lim, bs[i])
		require.NoError(t, err)
		// Each booking's room is its n intervals (the slots are spaced by
		// the textbook: a booking of n after tat ends n*I later).
		require.Equal(t, time.Duration(bs[i].N)*lim.Interval(), given, "booking %d (n=%d, slot %v) gave back", i, bs[i].N, bs[i].At)
	}
	next, err := eng.Book(ctx, "k", lim, throttle.Request{N: 1, MaxWait: throttle.Forever})
	require.NoError(t, err)
	// first (n=2, burst 1) left the key two intervals on: a single booking
	// after it alone comes one interval after first's slot.
	require.Equal(t, first.At.Add(lim.Interval()), next.At, "after the refunds the next single booking comes right after first's room")
}

// TestReviewMergeSeveredNotRetried: a merged call whose connection is
// severed while its reply is held back, on a client that retries (go-redis
// MaxRetries 3, the default): each caller gets ErrReplyLost, and each key
// was booked exactly once (the script ran once; a retry would have booked
// again): a new booking on it waits one interval from the lost one.
func TestReviewMergeSeveredNotRetried(t *testing.T) {
	t.Parallel()
	eng, direct, prefix, p, calls := reviewProxied(t, redistest.Shared(t), 300*time.Millisecond,
		func(o *redis.Options) { o.MaxRetries = 3 })
	ctx := context.Background()
	lim := throttle.PerMinute(6, 0) // I = 10 s
	before := calls.Load()
	held := holdConnection(t, eng, "holder")
	keys := []string{"s0", "s1", "s2", "s3"}
	var wg sync.WaitGroup
	errs := make([]error, len(keys))
	for i, k := range keys {
		wg.Go(func() {
			_, errs[i] = eng.Book(ctx, k, lim, throttle.Request{N: 1, MaxWait: throttle.Forever})
		})
	}
	require.NoError(t, <-held)
	time.Sleep(120 * time.Millisecond) // the merged call is sent, its reply held back
	p.Sever()
	wg.Wait()
	t.Logf("%d calls; errors %v", calls.Load()-before, errs)
	for i, err := range errs {
		require.ErrorIs(t, err, throttle.ErrReplyLost, keys[i])
	}
	for _, k := range keys {
		v, err := direct.Get(ctx, prefix+k).Int64()
		require.NoError(t, err, "key %s: the severed call did not book", k)
		tm, err := direct.Time(ctx).Result()
		require.NoError(t, err)
		ahead := time.Duration(v-tm.UnixMicro()) * time.Microsecond
		require.Greater(t, ahead, 8*time.Second, "key %s", k)
		require.LessOrEqual(t, ahead, lim.Interval(), "key %s booked more than once", k)
	}
}

// TestReviewMergeScriptFlushed: with the scripts flushed from Redis
// (NOSCRIPT), a merged call falls back to EVAL: every request is booked,
// once.
func TestReviewMergeScriptFlushed(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	eng, direct, _, _, calls := reviewProxied(t, srv, 200*time.Millisecond, nil)
	ctx := context.Background()
	require.NoError(t, direct.ScriptFlush(ctx).Err())
	lim := throttle.PerMinute(6, 0)
	before := calls.Load()
	held := holdConnection(t, eng, "holder")
	keys := []string{"f0", "f1", "f2", "f0"}
	bs, errs := bookAt(eng, keys, lim, throttle.Request{N: 1, MaxWait: throttle.Forever})
	require.NoError(t, <-held)
	t.Logf("%d calls", calls.Load()-before)
	for i := range keys {
		require.NoError(t, errs[i], keys[i])
		require.True(t, bs[i].OK)
	}
	ws := []time.Duration{bs[0].Wait, bs[3].Wait}
	slices.Sort(ws)
	require.Zero(t, ws[0])
	require.Greater(t, ws[1], 9*time.Second, "f0's second booking")
}

// TestReviewMergeLayeredNotMerged: bookings under two limits at once
// (BookAll of two keys) are never merged, even with every connection
// busy: each is a call of its own.
func TestReviewMergeLayeredNotMerged(t *testing.T) {
	t.Parallel()
	// A server of its own: another test's SCRIPT FLUSH on the shared one
	// adds EVAL retries to the count (8 calls once in CI).
	eng, _, _, _, calls := reviewProxied(t, redistest.Start(t), 100*time.Millisecond, nil)
	ctx := context.Background()
	lims := []throttle.Limit{throttle.PerSecond(10, 0), throttle.PerMinute(100, 0)}
	before := calls.Load()
	held := holdConnection(t, eng, "holder")
	var wg sync.WaitGroup
	errs := make([]error, 4)
	for i := range errs {
		wg.Go(func() {
			k := fmt.Sprintf("{l%d}", i)
			_, errs[i] = eng.BookAll(ctx, []string{k, k + ":60000ms"}, lims, []throttle.Request{{N: 1, MaxWait: throttle.Forever}})
		})
	}
	wg.Wait()
	require.NoError(t, <-held)
	for _, err := range errs {
		require.NoError(t, err)
	}
	require.Equal(t, int64(1+len(errs)), calls.Load()-before, "calls for the holder and four layered bookings")
}

// TestReviewMergeRedisGoneFailsFast: while a batch waits behind a call in
// flight, Redis becomes unreachable (the proxy closes). The call in flight
// fails (its reply lost); every merged request then fails with
// ErrUnavailable, and none claims a lost reply: nothing of theirs was
// sent. None hangs.
func TestReviewMergeRedisGoneFailsFast(t *testing.T) {
	t.Parallel()
	eng, _, _, p, _ := reviewProxied(t, redistest.Shared(t), 300*time.Millisecond, nil, throttle.WithTimeout(2*time.Second))
	held := holdConnection(t, eng, "holder")
	done := make(chan []error, 1)
	go func() {
		_, errs := bookAt(eng, []string{"g0", "g1", "g2"}, throttle.PerSecond(10, 0), throttle.Request{N: 1, MaxWait: throttle.Forever})
		done <- errs
	}()
	time.Sleep(50 * time.Millisecond)
	p.Close()
	require.ErrorIs(t, <-held, throttle.ErrReplyLost)
	var errs []error
	select {
	case errs = <-done:
	case <-time.After(10 * time.Second):
		t.Fatal("merged requests hang after Redis went away")
	}
	for i, err := range errs {
		require.ErrorIs(t, err, throttle.ErrUnavailable, "request %d", i)
		require.NotErrorIs(t, err, throttle.ErrReplyLost, "request %d was never sent", i)
	}
}

// TestReviewMergeRefundLostRetriedOnce: a merged booking given back with a
// lost reply, then again: the room comes back once. Two bookings on "r"
// stand after a first one; the last's refund reply is lost (held back
// past the engine's timeout) and retried (gives nothing more); the next
// booking then takes the last's slot, not the one before it.
func TestReviewMergeRefundLostRetriedOnce(t *testing.T) {
	t.Parallel()
	eng, _, _, p, _ := proxiedMergeEngine(t, 200*time.Millisecond, time.Second)
	ctx := context.Background()
	lim := throttle.PerMinute(6, 0) // I = 10 s
	held := holdConnection(t, eng, "holder")
	bs, errs := bookAt(eng, []string{"r", "r", "r"}, lim, throttle.Request{N: 1, MaxWait: throttle.Forever})
	require.NoError(t, <-held)
	for _, err := range errs {
		require.NoError(t, err)
	}
	slices.SortFunc(bs, func(a, b throttle.Booking) int { return a.At.Compare(b.At) })
	last := bs[2]
	p.SetReplyDelay(1500 * time.Millisecond)
	_, err := eng.Refund(ctx, "r", lim, last)
	require.ErrorIs(t, err, throttle.ErrReplyLost)
	p.SetReplyDelay(0)
	var again time.Duration
	redistest.UntilOK(t, func() error { // the breaker opened on the lost reply: wait for its probe
		var err error
		again, err = eng.Refund(ctx, "r", lim, last)
		return err
	})
	require.Zero(t, again, "the retried refund gave back again")
	next, err := eng.Book(ctx, "r", lim, throttle.Request{N: 1, MaxWait: throttle.Forever})
	require.NoError(t, err)
	require.Equal(t, last.At, next.At, "the next booking takes the given-back slot")
}

// TestReviewMergeWaitersLeaveAroundTake: rounds of six single bookings
// merged behind a call in flight, whose contexts end around the moment the
// connection frees and the leader takes the batch (before, at, after; the
// leader's and the followers' in every order; some without an end). A
// caller that gets its context's error booked nothing (its key is empty);
// one that gets a booking booked once (its key holds exactly one
// interval); no other outcome, and none hangs.
func TestReviewMergeWaitersLeaveAroundTake(t *testing.T) {
	t.Parallel()
	const delay = 150 * time.Millisecond
	eng, direct, prefix, _, calls := proxiedMergeEngine(t, delay, 5*time.Second)
	ctx := context.Background()
	lim := throttle.PerMinute(6, 0) // I = 10 s
	rng := rand.New(rand.NewPCG(7, 7))
	left, booked := 0, 0
	for round := range 8 {
		before := calls.Load()
		held := holdConnection(t, eng, fmt.Sprintf("holder-%d", round)) // its reply comes about delay-50ms from now
		keys := make([]string, 6)
		errs := make([]error, 6)
		bs := make([]throttle.Booking, 6)
		var wg sync.WaitGroup
		for i := range keys {
			keys[i] = fmt.Sprintf("w%d-%d", round, i)
			var end time.Duration // 0: no end
			if rng.IntN(5) > 0 {
				end = delay - 50*time.Millisecond - 40*time.Millisecond + time.Duration(rng.IntN(80))*time.Millisecond
			}
			wg.Go(func() {
				c, cancel := ctx, context.CancelFunc(func() {})
				if end > 0 {
					c, cancel = context.WithTimeout(ctx, end)
				}
				defer cancel()
				bs[i], errs[i] = eng.Book(c, keys[i], lim, throttle.Request{N: 1, MaxWait: throttle.Forever})
			})
			time.Sleep(time.Millisecond)
		}
		done := make(chan struct{})
		go func() { wg.Wait(); close(done) }()
		select {
		case <-done:
		case <-time.After(10 * time.Second):
			t.Fatalf("round %d: a merged caller hangs", round)
		}
		require.NoError(t, <-held)
		tm, err := direct.Time(ctx).Result()
		require.NoError(t, err)
		for i, k := range keys {
			v, gerr := direct.Get(ctx, prefix+k).Int64()
			switch {
			case errs[i] == nil:
				booked++
				require.True(t, bs[i].OK)
				require.NoError(t, gerr, "%s: booked, but its key is empty", k)
				ahead := time.Duration(v-tm.UnixMicro()) * time.Microsecond
				require.Greater(t, ahead, 9*time.Second, k)
				require.LessOrEqual(t, ahead, lim.Interval(), "%s booked more than once", k)
			case errors.Is(errs[i], context.DeadlineExceeded):
				left++
				require.ErrorIs(t, gerr, redis.Nil, "%s: left with %v, yet booked", k, errs[i])
				require.NotErrorIs(t, errs[i], throttle.ErrReplyLost, k)
			default:
				t.Fatalf("%s: unexpected error %v", k, errs[i])
			}
		}
		t.Logf("round %d: %d calls", round, calls.Load()-before)
	}
	t.Logf("%d left, %d booked", left, booked)
}

// TestReviewMergeSlotCheckingServer: a plain client (not a ClusterClient)
// in front of a server that requires a script's keys to share a hash slot,
// as a single-shard Redis Cluster does (and as proxies that front a
// sharded database do): single bookings on keys of their own work alone
// (the control, WithMerging(false)), as each call's keys share a slot;
// merged, they must still be booked. Failed on 7477926: every merged
// caller got CROSSSLOT.
func TestReviewMergeSlotCheckingServer(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t, "--cluster-enabled", "yes")
	admin := srv.Client(t)
	ctx := context.Background()
	require.NoError(t, admin.Do(ctx, "CLUSTER", "ADDSLOTSRANGE", 0, 16383).Err())
	redistest.UntilOK(t, func() error {
		info, err := admin.ClusterInfo(ctx).Result()
		if err == nil && !strings.Contains(info, "cluster_state:ok") {
			err = errors.New("cluster not ok")
		}
		return err
	})
	for _, merging := range []bool{false, true} {
		t.Run(fmt.Sprintf("merging=%v", merging), func(t *testing.T) {
			eng, _, _, _, calls := reviewProxied(t, srv, 200*time.Millisecond, nil, throttle.WithMerging(merging))
			before := calls.Load()
			held := holdConnection(t, eng, "holder")
			keys := []string{"x1", "x2", "x3"}
			bs, errs := bookAt(eng, keys, throttle.PerSecond(10, 0), throttle.Request{N: 1, MaxWait: throttle.Forever})
			require.NoError(t, <-held)
			t.Logf("%d calls; errors %v", calls.Load()-before, errs)
			for i, k := range keys {
				require.NoError(t, errs[i], k)
				require.True(t, bs[i].OK, k)
			}
		})
	}
}

// TestReviewMergeBadKeysAmongMany: merged behind a call in flight, single
// bookings on a corrupt key (twice), a list, a TAT beyond the horizon, a
// busy key asked with MaxWait 0 (refused), and good keys (n=2, burst 1).
// Each bad key's caller gets its own error (ErrCorruptState; WRONGTYPE);
// the refused request books nothing; each good key is booked once.
func TestReviewMergeBadKeysAmongMany(t *testing.T) {
	t.Parallel()
	eng, direct, prefix, _, calls := proxiedMergeEngine(t, 250*time.Millisecond, 5*time.Second)
	ctx := context.Background()
	lim := throttle.Every(10*time.Second, 1, 1) // I = 10 s, tau = 10 s
	require.NoError(t, direct.Set(ctx, prefix+"corrupt", "12x", time.Minute).Err())
	require.NoError(t, direct.RPush(ctx, prefix+"list", "a").Err())
	tm, err := direct.Time(ctx).Result()
	require.NoError(t, err)
	far := tm.UnixMicro() + (throttle.MaxHorizon + time.Hour).Microseconds()
	require.NoError(t, direct.Set(ctx, prefix+"far", far, time.Minute).Err())
	busy, err := eng.Book(ctx, "busy", lim, throttle.Request{N: 2, MaxWait: 0}) // the key's room is spent
	require.NoError(t, err)
	require.True(t, busy.OK)
	before := calls.Load()
	held := holdConnection(t, eng, "holder")
	type req struct {
		key     string
		maxWait time.Duration
	}
	reqs := []req{{"good1", throttle.Forever}, {"corrupt", throttle.Forever}, {"busy", 0}, {"list", throttle.Forever},
		{"good2", throttle.Forever}, {"far", throttle.Forever}, {"corrupt", throttle.Forever}, {"good3", 0}}
	bs := make([]throttle.Booking, len(reqs))
	errs := make([]error, len(reqs))
	var wg sync.WaitGroup
	for i, r := range reqs {
		wg.Go(func() {
			bs[i], errs[i] = eng.Book(ctx, r.key, lim, throttle.Request{N: 2, MaxWait: r.maxWait})
		})
	}
	wg.Wait()
	require.NoError(t, <-held)
	t.Logf("%d calls", calls.Load()-before)
	for i, r := range reqs {
		switch r.key {
		case "corrupt", "far":
			require.ErrorIs(t, errs[i], throttle.ErrCorruptState, r.key)
		case "list":
			require.ErrorContains(t, errs[i], "WRONGTYPE")
		case "busy":
			require.NoError(t, errs[i])
			require.False(t, bs[i].OK, "busy with MaxWait 0")
		default:
			require.NoError(t, errs[i], r.key)
			require.True(t, bs[i].OK, r.key)
			require.Zero(t, bs[i].Wait, r.key)
		}
	}
	// Room, judged by the next booking of one unit on each key: a good key
	// booked once (n=2 at its decision time) lets the next in one interval
	// after it; busy is where its first booking left it.
	for _, k := range []string{"good1", "good2", "good3", "busy"} {
		next, err := eng.Book(ctx, k, lim, throttle.Request{N: 1, MaxWait: throttle.Forever})
		require.NoError(t, err)
		var first throttle.Booking
		if k == "busy" {
			first = busy
		} else {
			first = bs[slices.IndexFunc(reqs, func(r req) bool { return r.key == k })]
		}
		require.Equal(t, first.At.Add(lim.Interval()), next.At, "key %s", k)
	}
}
