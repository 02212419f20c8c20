package closereview_test

// Review of 3e30840 (helper-140): Close with Redis stopped for good and
// many keys; the giveUp channel under concurrent Closes.

import (
	"context"
	"fmt"
	"math/rand/v2"
	"slices"
	"syscall"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/slotbook/slotbook/internal/redistest"
	"github.com/slotbook/slotbook/lease"
	"github.com/slotbook/slotbook/lease/internal/leasetest"
	"github.com/slotbook/slotbook/throttle"
)

// TestReviewClose47cStoppedManyKeys: one engine (timeout 50 ms) serves B
// (a Semaphore: N = 1, TTL 20 s) and U, another user booking rate slots.
// B holds the one lease of each of K = 32 keys and, but for the control,
// has W = 6 waiters queued on each. Redis is stopped for good (refused
// dials), either once the engine's breaker is open (U called), or just
// before Close with the breaker still closed. B is closed with
// context.Background(). Close's doc: the leave calls are dropped "only
// when Redis is away (two rounds in a row reach none of it ...)": Close
// must return long before the TTL. Then Redis is restarted 1.5 s after
// Close began. The design: "a probe restores Redis as soon as it
// answers": none of U's calls may fail with a refused connection once
// Redis listens (go-redis's dial lockout, tripped by PoolSize dial
// errors), as in the control (checked with the breaker open at Close:
// with it closed, the control's releases alone may trip it, logged).
func TestReviewClose47cStoppedManyKeys(t *testing.T) {
	const ttl, nk, w = 20 * time.Second, 32, 6
	run := func(t *testing.T, waiters, openFirst bool) (took, recovered time.Duration, refused int) {
		return c47bStoppedScene(t, ttl, nk, w, "c47c-", waiters, openFirst, 1500*time.Millisecond)
	}
	for _, openFirst := range []bool{true, false} {
		t.Run(fmt.Sprint("breakerOpenAtClose=", openFirst), func(t *testing.T) {
			took, rec, refused := run(t, false, openFirst)
			t.Logf("control, B without waiters: Close took %v; U served %v after the restart, %d of its calls refused a connection before", took, rec, refused)
			if openFirst {
				// With the breaker closed at Close, the control's own releases, side by
				// side, may trip the lockout (an engine matter, not Close's): logged only.
				assert.Zero(t, refused, "control: U's calls refused a connection once Redis listened again")
			}
			took, rec, refused = run(t, true, openFirst)
			t.Logf("B with %d gone waiters on each of %d keys: Close took %v; U served %v after the restart, %d of its calls refused a connection before", w, nk, took, rec, refused)
			assert.Less(t, took, ttl/4, "Close(Background) with Redis stopped for good took %v: not dropped when Redis was away (TTL %v)", took, ttl)
			if openFirst {
				if knownLimits {
					assert.Zero(t, refused, "U's calls refused a connection once Redis listened again (B's leave calls tripped the client's dial lockout)")
				} else if refused > 0 {
					// A known limit (stop 47's note): on a busy machine the
					// client's dial lockout is tripped now and then. Stop 48
					// (helper-141's counts by command) found it set before
					// Close began, by B's keepers' polls before the breaker
					// opened; Close's share was 3 or 4 of PoolSize's 20.
					// Logged, failed only under the build tag
					// slotbook_known_limits.
					t.Logf("known limit: %d of U's calls refused a connection once Redis listened again", refused)
				}
			}
		})
	}
}

// TestReviewClose47cManyClosesMixed: A (on the Env's engine) holds the
// one lease of each of K = 8 keys; B (N = 1, TTL 20 s, an engine with a
// timeout of 200 ms over a proxy adding 15 ms each way, PoolSize 2) has
// W = 6 waiters queued on each. A first Close of B with
// context.Background() begins (its waiters get ErrClosed); then, side by
// side, 12 more: 3 with context.Background(), 9 with a context already
// ended or ending within 1 to 40 ms, in random order. Close's doc: "once
// every Close under way has returned with its ctx's error, the calls
// still owed are dropped"; a Close with context.Background() is under way
// until it returns, and Redis is never away. Checks: every Background
// Close returns nil; once they all have, none of B's gone waiters stands
// in Redis (Redis answering throughout).
func TestReviewClose47cManyClosesMixed(t *testing.T) {
	const ttl, poll, nk, w = 20 * time.Second, 100 * time.Millisecond, 8, 6
	for round := 0; round < 3; round++ {
		ctx := context.Background()
		e := leasetest.NewEnv(t)
		p, eng := leasetest.Proxied(t, e, 200*time.Millisecond, func(o *redis.Options) { o.PoolSize = 2 })
		p.SetLatency(15 * time.Millisecond)
		a := leasetest.SemOn(t, e.Eng, 1, lease.WithTTL(ttl), lease.WithPollInterval(poll))
		b, err := lease.New(eng, "partner", 1, lease.WithTTL(ttl), lease.WithPollInterval(poll))
		require.NoError(t, err)
		leasetest.CloseAtEnd(t, b)
		keys := make([]string, nk)
		var held []*lease.Lease
		got := make(chan leasetest.Got, nk*w)
		for i := range keys {
			keys[i] = fmt.Sprint("mc47c-", round, "-", i)
			l, err := a.Acquire(ctx, keys[i])
			require.NoError(t, err)
			held = append(held, l)
			for j := 0; j < w; j++ {
				leasetest.AcquireAsync(ctx, e, b, "b", keys[i], got)
			}
		}
		for _, k := range keys {
			e.Queued(t, k, w)
		}
		first := make(chan error, 1)
		start := time.Now()
		go func() { first <- b.Close(ctx) }()
		for range nk * w {
			require.ErrorIs(t, leasetest.Recv(t, got, "B's Acquire").Err, lease.ErrClosed)
		}
		var errs []chan error
		var bg []int
		for i := 0; i < 12; i++ {
			ch := make(chan error, 1)
			errs = append(errs, ch)
			background := i%4 == 0
			if background {
				bg = append(bg, i)
			}
			go func() {
				time.Sleep(time.Duration(rand.IntN(20)) * time.Millisecond)
				c := ctx
				if !background {
					var cancel context.CancelFunc
					c, cancel = context.WithTimeout(ctx, time.Duration(rand.IntN(41))*time.Millisecond)
					defer cancel()
				}
				ch <- b.Close(c)
			}()
		}
		assert.NoError(t, leasetest.Recv(t, first, "the first Close"), "the first Close (Background)")
		for i, ch := range errs {
			err := leasetest.Recv(t, ch, "a Close")
			if slices.Contains(bg, i) {
				assert.NoError(t, err, "Close %d (Background)", i)
			}
		}
		took := time.Since(start)
		left := cl45Standing(e, keys)
		t.Logf("round %d: every Close returned %v after the first began; B's gone waiters standing then: %d %v", round, took, len(left), left)
		assert.Empty(t, left, "round %d: B's gone waiters standing once every Close returned, Background ones under way throughout (Redis answering)", round)
		for _, l := range held {
			require.NoError(t, l.Release(ctx))
		}
	}
}

// TestReviewClose47cClusterStopped: a 3-master Cluster; B (N = 1, TTL
// 20 s, engine timeout 50 ms) holds the one lease of each of K = 12 keys
// (spread over the masters) and has W = 4 waiters queued on each. Then
// every master is stopped for good (refused dials), or (a fresh scene)
// one; once the engine reports a breaker open, B is closed with
// context.Background(). Close's doc: the leave calls are dropped "only
// when Redis is away (two rounds in a row reach none of it, a call let by
// the breaker failing, the breaker open after)"; the engine's breakers
// are per node. Check: Close returns well before the TTL (its waiters'
// calls otherwise sent again until the TTL has passed); the time is
// logged.
func TestReviewClose47cClusterStopped(t *testing.T) {
	const ttl, poll, nk, w = 20 * time.Second, 100 * time.Millisecond, 12, 4
	for _, all := range []bool{false, true} {
		t.Run(fmt.Sprint("allMasters=", all), func(t *testing.T) {
			ctx := context.Background()
			// Runs last: go-redis's background dial (tryDial, once the dial
			// lockout trips) sees its closed pool only after its 1 s sleep.
			t.Cleanup(func() { time.Sleep(1500 * time.Millisecond) })
			cluster := redistest.StartCluster(t, 3)
			prefix := redistest.Prefix(t)
			cc := redis.NewClusterClient(&redis.ClusterOptions{Addrs: cluster.Addrs, ContextTimeoutEnabled: true})
			t.Cleanup(func() { _ = cc.Close() })
			eng, err := throttle.New(cc, throttle.WithPrefix(prefix), throttle.WithTimeout(50*time.Millisecond))
			require.NoError(t, err)
			b, err := lease.New(eng, "partner", 1, lease.WithTTL(ttl), lease.WithPollInterval(poll))
			require.NoError(t, err)
			leasetest.CloseAtEnd(t, b)
			redistest.UntilOK(t, func() error { return b.Load(ctx) })
			got := make(chan error, nk*w)
			for i := 0; i < nk; i++ {
				key := fmt.Sprint("cs47c", i)
				redistest.UntilOK(t, func() error { _, err := b.Acquire(ctx, key); return err })
				for range w {
					go func() { _, err := b.Acquire(ctx, key); got <- err }()
				}
			}
			leasetest.WaitFor(t, func() bool {
				n := 0
				for i := 0; i < nk; i++ {
					n += int(cc.ZCard(ctx, prefix+fmt.Sprintf("partner:{cs47c%d}:lease:q", i)).Val())
				}
				return n == nk*w
			})
			for i := 0; i < 3; i++ {
				if all || i == 0 {
					cluster.Node(i).Stop()
				}
			}
			lim := throttle.PerSecond(1000, 1000)
			leasetest.WaitFor(t, func() bool {
				for i := 0; i < nk; i++ {
					_, _ = eng.Allow(ctx, fmt.Sprint("{cs47c", i, "}u"), lim)
				}
				open, _ := eng.Unavailable()
				return open
			})
			start := time.Now()
			done := make(chan error, 1)
			go func() { done <- b.Close(ctx) }()
			var cerr error
			select {
			case cerr = <-done:
			case <-time.After(ttl + 5*time.Second):
				t.Fatalf("Close(Background) not returned within the TTL and 5 s")
			}
			took := time.Since(start)
			t.Logf("all masters stopped %v: Close(Background) took %v, error %v", all, took, cerr)
			assert.Less(t, took, ttl/4, "all masters stopped %v: Close(Background) took %v with Redis stopped for good (TTL %v)", all, took, ttl)
			for range nk * w {
				require.ErrorIs(t, leasetest.Recv(t, got, "B's Acquire"), lease.ErrClosed)
			}
		})
	}
}

// TestReviewClose47cGiveUpThenClose: B (N = 1, TTL 20 s, engine timeout
// 50 ms) has W = 6 waiters queued on each of K = 16 keys (A holding each
// key's lease). Redis is paused (SIGSTOP; the breaker opened), and a Close of B
// with a context of 30 ms gives up; 300 ms later (B's keepers have acted
// on the give-up by then) Redis is resumed and a Close with
// context.Background() is made.
// What of B's gone waiters stands in Redis once it has returned is
// logged, against the control (the same with no first Close, the second
// made once Redis answers again). Close's doc: "a Close called after
// makes a new giveUp"; and of the Close with context.Background():
// "Before it returns, the leave call of every waiter that has gone ... is
// sent ... one that reaches no Redis is sent again, until it reaches Redis
// or its waiter's TTL has passed". Check: once it has returned nil, Redis
// answering, none of B's gone waiters stands (1 s later), as in the
// control. (The
// give-up sentence, "once every Close under way has returned with its
// ctx's error, the calls still owed are dropped", can be read to allow
// the drop, since the later Close was not under way then: a user who
// retries a timed-out Close, Close being idempotent, then gets nil with
// waiters left standing for the TTL.) Stop 47 kept this as a known limit
// (2 to 4 runs in 5 or 6 failed, without the 300 ms); stop 48 mends it:
// the keepers a give-up ends keep what their rooms owe, and a later Close
// starts keepers afresh to send it.
func TestReviewClose47cGiveUpThenClose(t *testing.T) {
	const ttl, poll, nk, w = 20 * time.Second, 100 * time.Millisecond, 16, 6
	for _, giveUp := range []bool{false, true} {
		ctx := context.Background()
		srv := redistest.Start(t)
		rdb := srv.Client(t)
		prefix := redistest.Prefix(t)
		aEng, err := throttle.New(rdb, throttle.WithPrefix(prefix))
		require.NoError(t, err)
		a, err := lease.New(aEng, "partner", 1, lease.WithTTL(ttl))
		require.NoError(t, err)
		leasetest.CloseAtEnd(t, a)
		eng, err := throttle.New(srv.Client(t), throttle.WithPrefix(prefix))
		require.NoError(t, err)
		b, err := lease.New(eng, "partner", 1, lease.WithTTL(ttl), lease.WithPollInterval(poll))
		require.NoError(t, err)
		leasetest.CloseAtEnd(t, b)
		// The server is new: without its scripts loaded, a leave call
		// sent into the paused server (its reply lost, so counted as
		// tried) runs as NOSCRIPT once Redis is resumed, and its waiter
		// stands (stop 48 saw 2 of 96, every run). A restarted Redis
		// does the same: a known limit of any lost reply, not Close's.
		redistest.UntilOK(t, func() error { return b.Load(ctx) })
		keys := make([]string, nk)
		got := make(chan error, nk*w)
		for i := range keys {
			keys[i] = fmt.Sprint("gu47c", i)
			redistest.UntilOK(t, func() error { _, err := a.Acquire(ctx, keys[i]); return err })
			for range w {
				go func() { _, err := b.Acquire(ctx, keys[i]); got <- err }()
			}
		}
		leasetest.WaitFor(t, func() bool { q, ww, _ := c47bStanding(rdb, prefix, keys); return q+ww >= nk*w })
		pid := srv.Pid()
		require.NoError(t, syscall.Kill(pid, syscall.SIGSTOP))
		lim := throttle.PerSecond(1000, 1000)
		leasetest.WaitFor(t, func() bool { _, _ = eng.Allow(ctx, "gu47c-u", lim); open, _ := eng.Unavailable(); return open })
		var shortErr error
		if giveUp {
			sctx, cancel := context.WithTimeout(ctx, 30*time.Millisecond)
			shortErr = b.Close(sctx)
			cancel()
			time.Sleep(300 * time.Millisecond)
		}
		require.NoError(t, syscall.Kill(pid, syscall.SIGCONT))
		if !giveUp {
			redistest.UntilOK(t, func() error { _, err := aEng.Allow(ctx, "gu47c-v", lim); return err })
		}
		start := time.Now()
		longErr := b.Close(ctx)
		took := time.Since(start)
		for range nk * w {
			// Ended by Close, or failed while Redis was stopped (gone then).
			err := leasetest.Recv(t, got, "B's Acquire")
			require.Error(t, err, "B's Acquire (A holds the key)")
		}
		q0, ww0, _ := c47bStanding(rdb, prefix, keys)
		time.Sleep(time.Second) // anything still in the paused server's sockets has run by then
		q, ww, _ := c47bStanding(rdb, prefix, keys)
		t.Logf("give-up first %v (its error %v): the Background Close took %v, error %v; B's gone waiters standing then: queue %d, waiters %d, and 1 s later %d, %d, of %d", giveUp, shortErr, took, longErr, q0, ww0, q, ww, nk*w)
		assert.NoError(t, longErr)
		assert.Zero(t, q+ww, "give-up first %v: B's gone waiters standing once a Close with context.Background() returned nil (Redis answering)", giveUp)
		require.NoError(t, a.Close(ctx))
	}
}
