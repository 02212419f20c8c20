package keepreview_test

// Review of dbfe776 (a waiter whose keeper's poll fails with WRONGTYPE
// gets the error and leaves the queue) and fab2dc7 (holdersKey, keyBase,
// wakeList), through the public API only: a key's Redis keys are
// corrupted and restored with plain commands on the test's Redis.

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/slotbook/slotbook/lease"
	"github.com/slotbook/slotbook/lease/internal/leasetest"
	"github.com/slotbook/slotbook/throttle"
)

// wt45Corrupt overwrites subject's part (w, q, h, ...) with a string.
func wt45Corrupt(t *testing.T, e *leasetest.Env, subject, part string) {
	t.Helper()
	require.NoError(t, e.Rdb.Set(context.Background(), e.Key(subject, part), "x", 0).Err())
}

// TestReviewWrongType45FailedWaitersStayQueued: A's three waiters of a
// key (N = 1, TTL 1.2 s, poll 300 ms) get WRONGTYPE from their Acquire
// when the key's waiters set is overwritten with a string, and leave the
// queue, as a cancelled waiter does. Their leave calls fail too (the key
// is still corrupted), and the keeper tries them again for a TTL. The key
// is restored (DEL) a TTL and a poll after the waiters returned, after
// the keeper has given their leave calls up: by the package doc, "Redis drops the
// waiter, and a lease granted to it, within the TTL in any case", and the
// holder's lease, unextended, has lapsed. A new waiter from another
// process must then be granted the key's one lease within a TTL of the
// restore. (Before dbfe776 the three waiters kept waiting, and were
// served, and released, once the key was restored.) Their ids may still
// stand in the queue at the restore; none may be granted, and none may
// stand there once the new waiter is served.
func TestReviewWrongType45FailedWaitersStayQueued(t *testing.T) {
	e, _, engA := kr44Env(t, "wt45q:")
	ctx := context.Background()
	const ttl, poll = 1200 * time.Millisecond, 300 * time.Millisecond
	a := leasetest.SemOn(t, engA, 1, lease.WithTTL(ttl), lease.WithPollInterval(poll))
	b := leasetest.SemOn(t, e.Eng, 1, lease.WithTTL(ttl), lease.WithPollInterval(poll))
	c := leasetest.SemOn(t, leasetest.Direct(t, e, 5*time.Second), 1, lease.WithTTL(ttl), lease.WithPollInterval(poll))
	held, err := b.Acquire(ctx, "o")
	require.NoError(t, err)
	actx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	got := make(chan leasetest.Got, 4)
	for i := range 3 {
		leasetest.AcquireAsync(actx, e, a, fmt.Sprint("a", i), "o", got)
		e.Queued(t, "o", int64(i+1))
	}
	broke := leasetest.RedisNow(e.Rdb)
	wt45Corrupt(t, e, "o", "w")
	for range 3 {
		g := <-got
		require.Error(t, g.Err, "%s", g.Who)
		assert.True(t, redis.HasErrorPrefix(g.Err, "WRONGTYPE"), "%s: %v", g.Who, g.Err)
		t.Logf("%s returned %v after the corruption: %v", g.Who, leasetest.Ms(g.At-broke), g.Err)
	}
	failed := time.Now()
	<-held.Lost() // its extensions fail too
	// The leave calls are tried again for a TTL from their first failure;
	// the queue's expiry, set by the last call that succeeded, is a TTL
	// and a second after the waiters' last refresh. Restore in between.
	time.Sleep(time.Until(failed.Add(ttl + poll + 150*time.Millisecond)))
	require.NoError(t, e.Rdb.Del(ctx, e.Key("o", "w")).Err())
	restored := leasetest.RedisNow(e.Rdb)
	q, err := e.Rdb.ZRange(ctx, e.Key("o", "q"), 0, -1).Result()
	require.NoError(t, err)
	t.Logf("queue after the restore (every waiter returned its error %v ago): %q", leasetest.Ms(restored-broke), q)

	xctx, xcancel := context.WithTimeout(ctx, 10*time.Second)
	defer xcancel()
	leasetest.AcquireAsync(xctx, e, c, "x", "o", got)
	g := <-got
	require.NoError(t, g.Err)
	waited := leasetest.Ms(g.At - restored)
	t.Logf("a new waiter was granted the key's one lease %v after the restore (Redis clock; TTL %v)", waited, ttl)
	// The ids of the waiters that gave up may still stand in the queue
	// (their leave calls failed), but none may be granted the lease: the
	// new waiter gets it within a TTL of the restore, and by then the
	// queue holds none of them.
	qAfter, err := e.Rdb.ZRange(ctx, e.Key("o", "q"), 0, -1).Result()
	require.NoError(t, err)
	holders, err := e.Rdb.ZRange(ctx, e.Key("o", "h"), 0, -1).Result()
	require.NoError(t, err)
	t.Logf("once the new waiter was served: queue %q, holders %q", qAfter, holders)
	require.NoError(t, g.L.Release(ctx))
	assert.Less(t, waited, ttl, "the key's one lease went to waiters that had given up, a TTL each")
	for _, id := range q {
		assert.NotContains(t, qAfter, id, "a waiter that gave up still stands in the queue once a later one was served")
		assert.NotContains(t, holders, id, "a waiter that gave up holds the lease")
	}
}

// wt45Gaps returns the longest gap between two keep calls of subject
// among h's calls in [from, to): the keeper's poll as it ran in this run.
func wt45Gaps(h *kr44Hook, e *leasetest.Env, subject string, from, to time.Duration) time.Duration {
	var last, most time.Duration
	for _, c := range h.calls(from, to) {
		if c.key != e.Key(subject, "h") {
			continue
		}
		if last != 0 {
			most = max(most, c.at-last)
		}
		last = c.at
	}
	return most
}

// TestReviewWrongType45TwoProcesses: three waiters in A and three in B
// (two Semaphores on two engines, poll 300 ms) wait for a key held by H.
// The key's waiters set is overwritten with a string: every one of the
// six Acquire calls must return WRONGTYPE within three of the longest gaps
// between two of its keeper's polls measured before (the control), on
// Redis's clock, not at its context's end (20 s). The key is restored
// (DEL) at once: H's lease is still held and extended, later Acquire
// calls of A and B are served, and after every lease is released and the
// TTL has passed nothing but the token counter is left in Redis.
func TestReviewWrongType45TwoProcesses(t *testing.T) {
	e, hA, engA := kr44Env(t, "wt45p:")
	ctx := context.Background()
	const ttl, poll = 3 * time.Second, 300 * time.Millisecond
	hB := newKr44Hook()
	engB := leasetest.Direct(t, e, 50*time.Millisecond, hB)
	a := leasetest.SemOn(t, engA, 1, lease.WithTTL(ttl), lease.WithPollInterval(poll))
	b := leasetest.SemOn(t, engB, 1, lease.WithTTL(ttl), lease.WithPollInterval(poll))
	hs := leasetest.SemOn(t, e.Eng, 1, lease.WithTTL(ttl), lease.WithPollInterval(poll))
	held, err := hs.Acquire(ctx, "p")
	require.NoError(t, err)
	actx, cancel := context.WithTimeout(ctx, 20*time.Second)
	defer cancel()
	got := make(chan leasetest.Got, 6)
	for i := range 6 {
		s, who := a, fmt.Sprint("a", i)
		if i%2 == 1 {
			s, who = b, fmt.Sprint("b", i)
		}
		leasetest.AcquireAsync(actx, e, s, who, "p", got)
		e.Queued(t, "p", int64(i+1))
	}
	c0a, c0b := time.Since(hA.base), time.Since(hB.base)
	time.Sleep(5 * poll)
	ctl := max(wt45Gaps(hA, e, "p", c0a, time.Since(hA.base)), wt45Gaps(hB, e, "p", c0b, time.Since(hB.base)))
	require.NotZero(t, ctl)
	broke := leasetest.RedisNow(e.Rdb)
	wt45Corrupt(t, e, "p", "w")
	var slowest time.Duration
	for range 6 {
		g := <-got
		took := leasetest.Ms(g.At - broke)
		slowest = max(slowest, took)
		t.Logf("%s returned %v after the corruption: %v", g.Who, took, g.Err)
		require.Nil(t, g.L, "%s", g.Who)
		assert.True(t, redis.HasErrorPrefix(g.Err, "WRONGTYPE"), "%s returned %v", g.Who, g.Err)
		assert.LessOrEqual(t, took, 3*ctl, "%s returned %v after the corruption; the longest gap between two polls before it was %v", g.Who, took, ctl)
	}
	require.NoError(t, e.Rdb.Del(ctx, e.Key("p", "w")).Err())
	select {
	case <-held.Lost():
		t.Fatalf("H's lease was given up, though the key was restored %v after the corruption", slowest)
	default:
	}
	require.True(t, leasetest.Look(ctx, e.Rdb, e, "p", held.Token()).Held, "Redis no longer holds H's lease")
	require.NoError(t, held.Release(ctx))
	for _, s := range []*lease.Semaphore{a, b, a, b} {
		lctx, lcancel := context.WithTimeout(ctx, 2*ttl)
		l, err := s.Acquire(lctx, "p")
		lcancel()
		require.NoError(t, err, "an Acquire after the restore")
		require.True(t, leasetest.Look(ctx, e.Rdb, e, "p", l.Token()).Held)
		require.NoError(t, l.Release(ctx))
	}
	time.Sleep(ttl + 1500*time.Millisecond)
	left := e.KeysBut(t, "p", ttl)
	assert.Equal(t, []string{e.Key("p", "c")}, left, "keys left after every lease was released and the TTL passed")
}

// TestReviewWrongType45GrantRace: H holds both leases of a key (N = 2,
// TTL 1.5 s), A has two waiters. H releases one lease while the key's
// waiters set (even rounds) or A's wake-up list (odd rounds) is
// overwritten with a string, a few hundred µs apart either way. Each of
// A's waiters must return a lease that Redis holds (never two: H still
// holds the other) or the error; none hangs. The key is then restored:
// within the TTL and a few polls both leases can be taken again, by
// another Semaphore.
func TestReviewWrongType45GrantRace(t *testing.T) {
	e, _, engA := kr44Env(t, "wt45g:")
	ctx := context.Background()
	const ttl, poll, rounds = 1500 * time.Millisecond, 200 * time.Millisecond, 16
	a := leasetest.SemOn(t, engA, 2, lease.WithTTL(ttl), lease.WithPollInterval(poll))
	hs := leasetest.SemOn(t, e.Eng, 2, lease.WithTTL(ttl), lease.WithPollInterval(poll))
	chk := leasetest.SemOn(t, leasetest.Direct(t, e, 5*time.Second), 2, lease.WithTTL(ttl), lease.WithPollInterval(poll))
	granted, failed, relFailed, lateWaiters := 0, 0, 0, 0
	var slowest time.Duration
	for i := range rounds {
		key := fmt.Sprint("g", i)
		l1, err := hs.Acquire(ctx, key)
		require.NoError(t, err)
		l2, err := hs.Acquire(ctx, key)
		require.NoError(t, err)
		actx, cancel := context.WithTimeout(ctx, 10*time.Second)
		got := make(chan leasetest.Got, 2)
		leasetest.AcquireAsync(actx, e, a, "a0", key, got)
		e.Queued(t, key, 1)
		leasetest.AcquireAsync(actx, e, a, "a1", key, got)
		e.Queued(t, key, 2)
		ids, err := e.Rdb.ZRange(ctx, e.Key(key, "q"), 0, 0).Result()
		require.NoError(t, err)
		part := "w"
		if i%2 == 1 {
			part = "n:" + ids[0][:strings.LastIndex(ids[0], ".")] // a waiter's id is its process's, a dot, a number
		}
		stagger := time.Duration(rand.IntN(800)-400) * time.Microsecond
		broke := leasetest.RedisNow(e.Rdb)
		var relErr error
		var wg sync.WaitGroup
		wg.Go(func() {
			if stagger < 0 {
				time.Sleep(-stagger)
			}
			relErr = l1.Release(ctx)
		})
		wg.Go(func() {
			if stagger > 0 {
				time.Sleep(stagger)
			}
			wt45Corrupt(t, e, key, part)
		})
		wg.Wait()
		var mine []*lease.Lease
		take := func(g leasetest.Got) {
			took := leasetest.Ms(g.At - broke)
			slowest = max(slowest, took)
			if g.L != nil {
				granted++
				mine = append(mine, g.L)
				select {
				case <-g.L.Lost():
				default:
					seen := leasetest.Look(ctx, e.Rdb, e, key, g.L.Token())
					assert.True(t, seen.Held && seen.Margin() > 0, "round %d (%s): %s returned a lease Redis does not hold: %+v", i, part, g.Who, seen)
				}
				return
			}
			failed++
			assert.True(t, redis.HasErrorPrefix(g.Err, "WRONGTYPE"), "round %d (%s): %s returned %v after %v", i, part, g.Who, g.Err, took)
		}
		// A waiter whose keep calls still succeed (its process's wake-up
		// list corrupted after its grant was read: the key full, its
		// polls touch no list) waits on: it is served once the key is
		// restored and a lease given back.
		pending := 2
		for wait := time.After(8 * poll); pending > 0; pending-- {
			var g leasetest.Got
			select {
			case g = <-got:
			case <-wait:
			}
			if g.Who == "" {
				break
			}
			take(g)
		}
		assert.LessOrEqual(t, len(mine), 1, "round %d (%s): A holds %d leases while H holds one of 2", i, part, len(mine))
		if relErr != nil {
			relFailed++
		}
		require.NoError(t, e.Rdb.Del(ctx, e.Key(key, part)).Err())
		restored := leasetest.RedisNow(e.Rdb)
		for _, l := range mine {
			_ = l.Release(ctx)
		}
		_ = l2.Release(ctx)
		mine = nil
		for ; pending > 0; pending-- {
			g := <-got
			require.NoError(t, g.Err, "round %d (%s): %s, still waiting when the key was restored", i, part, g.Who)
			lateWaiters++
			take(g)
			t.Logf("round %d (%s): %s, still waiting when the key was restored, was granted %v after", i, part, g.Who, leasetest.Ms(g.At-restored))
			require.NoError(t, g.L.Release(ctx))
		}
		cancel()
		var back []*lease.Lease
		for range 2 {
			cctx, ccancel := context.WithTimeout(ctx, ttl+4*poll)
			l, err := chk.Acquire(cctx, key)
			ccancel()
			if !assert.NoError(t, err, "round %d (%s): a lease of the restored key within the TTL and 4 polls", i, part) {
				break
			}
			back = append(back, l)
		}
		t.Logf("round %d (%s, stagger %v): release error %v; A got %d lease(s); both leases back %v after the restore",
			i, part, stagger, relErr, len(mine), leasetest.Ms(leasetest.RedisNow(e.Rdb)-restored))
		for _, l := range back {
			require.NoError(t, l.Release(ctx))
		}
	}
	t.Logf("%d rounds: %d waiters granted (%d of them after the restore), %d failed, %d releases failed; slowest waiter %v after the corruption",
		rounds, granted, lateWaiters, failed, relFailed, slowest)
}

// wt45Passing has A (poll 200 ms) wait for a key held by H on e's own
// server, runs trouble (which makes A's keep calls fail for a while and
// returns once they may pass again), then has H release: A's waiter must
// be served, not fail. It returns the errors A's keep calls met.
func wt45Passing(t *testing.T, e *leasetest.Env, h *kr44Hook, engA *throttle.Engine, trouble func()) []string {
	t.Helper()
	ctx := context.Background()
	const ttl, poll = 3 * time.Second, 200 * time.Millisecond
	a := leasetest.SemOn(t, engA, 1, lease.WithTTL(ttl), lease.WithPollInterval(poll))
	hs := leasetest.SemOn(t, e.Eng, 1, lease.WithTTL(ttl), lease.WithPollInterval(poll))
	held, err := hs.Acquire(ctx, "s")
	require.NoError(t, err)
	actx, cancel := context.WithTimeout(ctx, 20*time.Second)
	defer cancel()
	got := make(chan leasetest.Got, 1)
	leasetest.AcquireAsync(actx, e, a, "a", "s", got)
	e.Queued(t, "s", 1)
	t0 := time.Since(h.base)
	trouble()
	t1 := time.Since(h.base)
	select {
	case g := <-got:
		t.Fatalf("the waiter returned during the trouble: %v, %v", g.L, g.Err)
	default:
	}
	time.Sleep(2 * poll)
	require.NoError(t, held.Release(ctx))
	g := <-got
	require.NoError(t, g.Err, "the waiter, once Redis was back")
	require.NoError(t, g.L.Release(ctx))
	var errs []string
	for _, c := range h.calls(t0, t1+poll) {
		if c.err != nil {
			errs = append(errs, c.err.Error())
		}
	}
	return errs
}

// TestReviewWrongType45BusyPasses: a script of someone else's runs for
// 1.5 s, past a busy-reply-threshold of 50 ms: Redis answers BUSY to A's
// keep calls. The waiter must not get the error; it is served once the
// script has ended.
func TestReviewWrongType45BusyPasses(t *testing.T) {
	e, h, engA := kr44Env(t, "wt45b:")
	ctx := context.Background()
	require.NoError(t, e.Rdb.ConfigSet(ctx, "busy-reply-threshold", "50").Err())
	errs := wt45Passing(t, e, h, engA, func() {
		busy := e.Srv.Client(t)
		require.NoError(t, busy.Eval(ctx, `local t0 = redis.call('TIME')
local s0 = tonumber(t0[1]) * 1000000 + tonumber(t0[2])
while true do
  local t = redis.call('TIME')
  if tonumber(t[1]) * 1000000 + tonumber(t[2]) - s0 > tonumber(ARGV[1]) then return 1 end
end`, nil, 1500000).Err())
	})
	t.Logf("A's keep calls met %d errors: %q", len(errs), errs)
	busy := 0
	for _, m := range errs {
		if strings.Contains(m, "BUSY") {
			busy++
		}
	}
	require.NotZero(t, busy, "no keep call met BUSY: the test tested nothing")
}

// TestReviewWrongType45NoPermPasses: A's Redis user loses EVALSHA and EVAL
// for 700 ms (NOPERM on its keep calls), then gets them back. The waiter
// must not get the error; it is served once it may run scripts again.
func TestReviewWrongType45NoPermPasses(t *testing.T) {
	e, _, _ := kr44Env(t, "wt45n:")
	ctx := context.Background()
	require.NoError(t, e.Rdb.Do(ctx, "ACL", "SETUSER", "wt45", "on", ">wt45pw", "~*", "&*", "+@all").Err())
	opts := e.Srv.Options()
	opts.Username, opts.Password = "wt45", "wt45pw"
	c := redis.NewClient(opts)
	t.Cleanup(func() { _ = c.Close() })
	h := newKr44Hook()
	c.AddHook(h)
	engA, err := throttle.New(c, throttle.WithPrefix(e.Prefix))
	require.NoError(t, err)
	errs := wt45Passing(t, e, h, engA, func() {
		require.NoError(t, e.Rdb.Do(ctx, "ACL", "SETUSER", "wt45", "-evalsha", "-eval").Err())
		time.Sleep(700 * time.Millisecond)
		require.NoError(t, e.Rdb.Do(ctx, "ACL", "SETUSER", "wt45", "+@all").Err())
	})
	t.Logf("A's keep calls met %d errors: %q", len(errs), errs)
	noperm := 0
	for _, m := range errs {
		if strings.Contains(m, "NOPERM") {
			noperm++
		}
	}
	require.NotZero(t, noperm, "no keep call met NOPERM: the test tested nothing")
}

// TestReviewWrongType45CloseOrCancelAtError: a waiter of A's whose keeper's
// keep call has just come back with WRONGTYPE is cancelled, or A is
// closed, a few hundred µs either side of that moment (from a hook on A's
// client, as the reply comes in), 8 rounds each. Its Acquire returns an
// error (WRONGTYPE, its context's, or ErrClosed), never a lease, and
// promptly; the key restored, H's release leaves no holder behind but
// those the checker takes; both leases can be taken within the TTL and a
// few polls. After every Semaphore is closed, no goroutine of the package
// is left (polled for 2 s).
func TestReviewWrongType45CloseOrCancelAtError(t *testing.T) {
	e, _, _ := kr44Env(t, "wt45c:")
	ctx := context.Background()
	const ttl, poll = 1500 * time.Millisecond, 200 * time.Millisecond
	var trigger atomic.Pointer[func()]
	engA := leasetest.Direct(t, e, 50*time.Millisecond, leasetest.Hook{After: func(cmd redis.Cmder, _ time.Duration) {
		if !leasetest.IsKeep(cmd) || !redis.HasErrorPrefix(cmd.Err(), "WRONGTYPE") {
			return
		}
		if f := trigger.Swap(nil); f != nil {
			d := time.Duration(rand.IntN(400)) * time.Microsecond
			go func() { time.Sleep(d); (*f)() }()
			time.Sleep(time.Duration(rand.IntN(2000)) * time.Microsecond) // the reply held back: either may come first
		}
	}})
	hs := leasetest.SemOn(t, e.Eng, 2, lease.WithTTL(ttl), lease.WithPollInterval(poll))
	chk := leasetest.SemOn(t, leasetest.Direct(t, e, 5*time.Second), 2, lease.WithTTL(ttl), lease.WithPollInterval(poll))
	outcomes := map[string]int{}
	var sems []*lease.Semaphore
	for i := range 16 {
		mode := []string{"cancel", "close"}[i%2]
		key := fmt.Sprint("c", i)
		a, err := lease.New(engA, "partner", 2, lease.WithTTL(ttl), lease.WithPollInterval(poll))
		require.NoError(t, err)
		sems = append(sems, a)
		l1, err := hs.Acquire(ctx, key)
		require.NoError(t, err)
		l2, err := hs.Acquire(ctx, key)
		require.NoError(t, err)
		actx, cancel := context.WithTimeout(ctx, 10*time.Second)
		f := func() {
			if mode == "cancel" {
				cancel()
				return
			}
			cctx, ccancel := context.WithTimeout(ctx, 5*time.Second)
			defer ccancel()
			_ = a.Close(cctx)
		}
		trigger.Store(&f)
		got := make(chan leasetest.Got, 1)
		leasetest.AcquireAsync(actx, e, a, "a", key, got)
		e.Queued(t, key, 1)
		broke := leasetest.RedisNow(e.Rdb)
		wt45Corrupt(t, e, key, "w")
		g := <-got
		cancel()
		took := leasetest.Ms(g.At - broke)
		require.Nil(t, g.L, "round %d (%s)", i, mode)
		switch {
		case redis.HasErrorPrefix(g.Err, "WRONGTYPE"):
			outcomes[mode+" wrongtype"]++
		case errors.Is(g.Err, context.Canceled):
			outcomes[mode+" canceled"]++
		case errors.Is(g.Err, lease.ErrClosed):
			outcomes[mode+" closed"]++
		default:
			t.Errorf("round %d (%s): %v after %v", i, mode, g.Err, took)
		}
		assert.Less(t, took, 4*poll+time.Second, "round %d (%s): returned %v after the corruption", i, mode, took)
		require.NoError(t, e.Rdb.Del(ctx, e.Key(key, "w")).Err())
		restored := leasetest.RedisNow(e.Rdb)
		_ = l1.Release(ctx)
		_ = l2.Release(ctx)
		var back []*lease.Lease
		for range 2 {
			cctx, ccancel := context.WithTimeout(ctx, ttl+4*poll)
			l, err := chk.Acquire(cctx, key)
			ccancel()
			if !assert.NoError(t, err, "round %d (%s): a lease of the restored key within the TTL and 4 polls", i, mode) {
				break
			}
			back = append(back, l)
		}
		t.Logf("round %d (%s): %v after %v; both leases back %v after the restore", i, mode, g.Err, took, leasetest.Ms(leasetest.RedisNow(e.Rdb)-restored))
		for _, l := range back {
			require.NoError(t, l.Release(ctx))
		}
	}
	t.Logf("outcomes: %v", outcomes)
	for _, s := range append(sems, hs, chk) {
		cctx, ccancel := context.WithTimeout(ctx, 5*time.Second)
		require.NoError(t, s.Close(cctx))
		ccancel()
	}
	leasetest.Settled(t, 2*time.Second)
}
