package closereview_test

// Review of 99fe34e..62f67bf (helper-139): after Close, the keepers send
// the gone waiters' leave calls side by side past the engine's breaker,
// send again those that reached no Redis, and drop what they owe once
// every Close under way has returned with its context's error (giveUp);
// abandon keeps its room while its own leave call is out (room.out); a
// leave call stands for a replacement made before it went (covers).

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"strings"
	"sync"
	"sync/atomic"
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

// c47bTag marks the context of the Close whose release calls c47bHook
// holds.
type c47bTag struct{}

// c47bHook, for B's client: a script call on key relKey made under a
// context tagged c47bTag (the releases of one Close) signals relAt
// (once) and is held relDelay before it is sent; while busy is set, a
// lease script call on goneKey naming a waiter (argv[3] a string: a
// leave call, after its Acquire has returned) fails unsent as a client
// with no connection free in time does (redis.ErrPoolTimeout: the
// engine's breaker stays closed, and Redis answers every call that is
// sent). Once armed, it counts the leave calls refused and sent, and
// holds a waiter's own leave call (abandon's: four arguments; the
// keeper's carry a fifth, the spare token) holdAbandon before that.
type c47bHook struct {
	relKey, goneKey string
	relDelay        time.Duration
	holdAbandon     time.Duration
	relAt           chan struct{}
	relOnce         sync.Once
	busy, armed     atomic.Bool // armed: count the leave calls from then on
	refused, passed atomic.Int32
}

func (h *c47bHook) DialHook(next redis.DialHook) redis.DialHook { return next }
func (h *c47bHook) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}
func (h *c47bHook) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		argv, keys := leasetest.ScriptArgs(cmd)
		if len(keys) == 0 {
			return next(ctx, cmd)
		}
		if ctx.Value(c47bTag{}) != nil && strings.Contains(keys[0], "{"+h.relKey+"}") {
			h.relOnce.Do(func() { close(h.relAt) })
			time.Sleep(h.relDelay)
			return next(ctx, cmd)
		}
		if strings.Contains(keys[0], "{"+h.goneKey+"}") && len(argv) >= 4 {
			if _, id := argv[3].(string); id {
				if len(argv) == 4 && h.holdAbandon > 0 && h.armed.Load() {
					time.Sleep(h.holdAbandon) // abandon's own call (the keeper's carry a spare token)
				}
				if h.busy.Load() {
					h.refused.Add(1)
					cmd.SetErr(redis.ErrPoolTimeout)
					return redis.ErrPoolTimeout
				}
				if h.armed.Load() {
					h.passed.Add(1)
				}
			}
		}
		return next(ctx, cmd)
	}
}

// TestReviewClose47bSecondCloseGivesUpForFirst: B (N = 1, TTL 10 s)
// holds key rel's one lease and has W = 4 waiters queued on key gone
// (whose one lease A holds). B's Close (ctx 20 s: "long") is called;
// its release of rel's lease is slow (held 400 ms at B's client, as on a
// slow link), and for the first 150 ms the leave calls of the waiters it
// ends find no connection free in B's client (the engine's breaker stays
// closed; Redis answers every call sent). In the second scene, while the
// long Close is still releasing, a second Close of B is called with a
// context already ended ("short"), and returns at once with its error.
//
// Close's doc: "once every Close under way has returned with its ctx's
// error, the calls still owed are dropped"; "one that reaches no Redis is
// sent again, until it reaches Redis or its waiter's TTL has passed ...
// Only when Redis is away (two rounds reach none of it, the breaker open)
// are they dropped". The long Close is under way when the short one
// returns, Redis is not away, and the long Close returns nil. Package
// definition: once it has returned, with Redis answering, none of B's
// gone waiters stands in gone's queue or waiters.
//
// Control (first scene, same run): the long Close alone.
func TestReviewClose47bSecondCloseGivesUpForFirst(t *testing.T) {
	const ttl, poll, w = 10 * time.Second, 100 * time.Millisecond, 4
	const relDelay, busyFor = 400 * time.Millisecond, 150 * time.Millisecond
	type outcome struct {
		left              []string
		longErr, shortErr error
		took              time.Duration
		refused, passed   int32
	}
	run := func(t *testing.T, second bool) (o outcome) {
		ctx := context.Background()
		e := leasetest.NewEnv(t)
		h := &c47bHook{relKey: "rel47b", goneKey: "gone47b", relDelay: relDelay, relAt: make(chan struct{})}
		eng := leasetest.Direct(t, e, time.Second, h)
		a := leasetest.SemOn(t, e.Eng, 1, lease.WithTTL(ttl), lease.WithPollInterval(poll))
		b, err := lease.New(eng, "partner", 1, lease.WithTTL(ttl), lease.WithPollInterval(poll))
		require.NoError(t, err)
		leasetest.CloseAtEnd(t, b)
		require.NoError(t, b.Load(ctx))
		first, err := a.Acquire(ctx, "gone47b")
		require.NoError(t, err)
		_, err = b.Acquire(ctx, "rel47b")
		require.NoError(t, err)
		got := make(chan leasetest.Got, w)
		for i := 0; i < w; i++ {
			leasetest.AcquireAsync(ctx, e, b, "b", "gone47b", got)
			e.Queued(t, "gone47b", int64(i+1))
		}
		time.Sleep(2 * poll)

		h.armed.Store(true)
		h.busy.Store(true)
		time.AfterFunc(busyFor, func() { h.busy.Store(false) })
		lctx, lcancel := context.WithTimeout(context.WithValue(ctx, c47bTag{}, true), 20*time.Second)
		defer lcancel()
		start := time.Now()
		longDone := make(chan error, 1)
		go func() { longDone <- b.Close(lctx) }()
		if second {
			<-h.relAt // the long Close is releasing rel's lease
			sctx, scancel := context.WithCancel(ctx)
			scancel()
			o.shortErr = b.Close(sctx)
		}
		o.longErr = <-longDone
		o.took = time.Since(start)
		for i := 0; i < w; i++ {
			require.ErrorIs(t, leasetest.Recv(t, got, "B's Acquire").Err, lease.ErrClosed)
		}
		require.False(t, h.busy.Load(), "B's client was still busy when the long Close returned")
		o.left = cl45Standing(e, []string{"gone47b"})
		o.refused, o.passed = h.refused.Load(), h.passed.Load()
		require.NoError(t, first.Release(ctx))
		return o
	}
	for round := 0; round < 2; round++ {
		o := run(t, false)
		t.Logf("control, the long Close alone: took %v, error %v; leave calls refused unsent %d, sent %d; B's gone waiters standing once it returned %v",
			o.took, o.longErr, o.refused, o.passed, o.left)
		require.NoError(t, o.longErr)
		assert.Empty(t, o.left, "control: B's gone waiters standing once the long Close returned (Redis answering)")

		o = run(t, true)
		t.Logf("a second Close, its ctx ended, while the long Close releases: the long Close took %v, error %v; the short Close's error %v; leave calls refused unsent %d, sent %d; B's gone waiters standing once the long Close returned %v",
			o.took, o.longErr, o.shortErr, o.refused, o.passed, o.left)
		require.NoError(t, o.longErr, "the long Close")
		require.True(t, errors.Is(o.shortErr, context.Canceled), "the short Close's error: %v", o.shortErr)
		assert.Empty(t, o.left, "the long Close was under way when the short one returned: B's gone waiters standing once it returned nil (Redis answering)")
	}
	leasetest.Settled(t, ttl/3+2*time.Second)
}

// c47bStanding returns the ids in key's queue and waiters sets, and its
// holders, under prefix (Semaphore partner).
func c47bStanding(rdb *redis.Client, prefix string, keys []string) (q, w, h int) {
	ctx := context.Background()
	for _, k := range keys {
		base := prefix + "partner:{" + k + "}:lease:"
		q += int(rdb.ZCard(ctx, base+"q").Val())
		w += int(rdb.ZCard(ctx, base+"w").Val())
		h += int(rdb.ZCard(ctx, base+"h").Val())
	}
	return q, w, h
}

// TestReviewClose47bPausedAtClose: B (engine timeout 50 ms, the default;
// N = 1, TTL 3 s) holds the one lease of each of K keys and has W
// waiters queued on each; then its Redis is paused (SIGSTOP: the kernel
// accepts connections, nothing answers) and B's Close is called, with a
// context of 5 s, then (a fresh scene) 300 ms. Close ends the waiters,
// whose leave calls, and the releases, cannot be answered. K×W = 1×8
// (control) and 12×8.
//
// Close's doc: "ctx bounds the wait"; "Only when Redis is away (two
// rounds reach none of it, the breaker open) are they dropped, and Redis
// drops their waiters within the TTL". STYLE: goroutines you start, you
// stop. Checks: Close returns within its context (with its error if that
// ended first); no goroutine of package lease is left 3 s after Close
// returned, Redis still paused (the waker's blocking read, which Close
// waits for, may take a second and four engine timeouts more than its
// second); once Redis is resumed, another process's waiter on each key
// is served within the TTL and a second (the package doc: Redis drops
// the waiters, and leases, of a process that stops refreshing them
// within the TTL). What stands in Redis 500 ms after resuming, and the
// times, are logged (for a comparison with 4611850).
func TestReviewClose47bPausedAtClose(t *testing.T) {
	const ttl, poll, w = 3 * time.Second, 100 * time.Millisecond, 8
	run := func(t *testing.T, nk int, cdur time.Duration) {
		ctx := context.Background()
		srv := redistest.Start(t)
		rdb := srv.Client(t)
		prefix := redistest.Prefix(t)
		eng, err := throttle.New(srv.Client(t), throttle.WithPrefix(prefix))
		require.NoError(t, err)
		b, err := lease.New(eng, "partner", 1, lease.WithTTL(ttl), lease.WithPollInterval(poll))
		require.NoError(t, err)
		leasetest.CloseAtEnd(t, b)
		redistest.UntilOK(t, func() error { return b.Load(ctx) })
		var keys []string
		got := make(chan error, nk*w)
		for i := 0; i < nk; i++ {
			key := fmt.Sprint("p47b-", i)
			keys = append(keys, key)
			_, err := b.Acquire(ctx, key)
			require.NoError(t, err)
			for j := 0; j < w; j++ {
				go func() { _, err := b.Acquire(ctx, key); got <- err }()
			}
		}
		leasetest.WaitFor(t, func() bool {
			select {
			case err := <-got:
				if errors.Is(err, throttle.ErrUnavailable) {
					// B's engine has the default 50 ms timeout, which the
					// scene needs; on a busy machine (CI, stop 47) a set-up
					// Acquire missed it, and the scene was not set.
					t.Skipf("set-up: an Acquire of B's failed before the pause on a busy machine: %v", err)
				}
				t.Fatalf("an Acquire of B's returned before the pause: %v", err)
			default:
			}
			q, _, _ := c47bStanding(rdb, prefix, keys)
			return q == nk*w
		})
		time.Sleep(2 * poll)
		pid := srv.Pid()
		require.NoError(t, syscall.Kill(pid, syscall.SIGSTOP))
		resumed := false
		defer func() {
			if !resumed {
				_ = syscall.Kill(pid, syscall.SIGCONT)
			}
		}()
		cctx, cancel := context.WithTimeout(ctx, cdur)
		defer cancel()
		start := time.Now()
		cerr := b.Close(cctx)
		took := time.Since(start)
		for i := 0; i < nk*w; i++ {
			select {
			case err := <-got:
				require.ErrorIs(t, err, lease.ErrClosed)
			case <-time.After(10 * time.Second):
				t.Fatal("an Acquire of B's did not return within 10 s of Close")
			}
		}
		settle := leasetest.SettleTime(10 * time.Second)
		require.NoError(t, syscall.Kill(pid, syscall.SIGCONT))
		resumed = true
		back := time.Now()
		time.Sleep(500 * time.Millisecond)
		q0, w0, h0 := c47bStanding(rdb, prefix, keys)
		// Another process's waiter on each key: granted once Redis has
		// dropped B's gone waiters and lapsed leases (within the TTL).
		eng2, err := throttle.New(srv.Client(t), throttle.WithPrefix(prefix), throttle.WithTimeout(time.Second))
		require.NoError(t, err)
		c, err := lease.New(eng2, "partner", 1, lease.WithTTL(ttl), lease.WithPollInterval(poll))
		require.NoError(t, err)
		leasetest.CloseAtEnd(t, c)
		var served time.Duration
		for _, k := range keys {
			actx, acancel := context.WithTimeout(ctx, 3*ttl)
			l, err := c.Acquire(actx, k)
			acancel()
			require.NoError(t, err, "C's Acquire of %s", k)
			served = time.Since(back)
			require.NoError(t, l.Release(ctx))
		}
		require.NoError(t, c.Close(ctx))
		first, nerr := "", 0
		if cerr != nil {
			first, _, _ = strings.Cut(cerr.Error(), "\n")
			nerr = strings.Count(cerr.Error(), "\n") + 1
		}
		t.Logf("K %d, W %d, Close's ctx %v: Close took %v, %d errors (%s); lease goroutines gone %v after (Redis paused); 500 ms after resuming: queued %d, waiters %d, holders %d; every key served to another process %v after resuming",
			nk, w, cdur, took, nerr, first, settle, q0, w0, h0, served)
		if took >= cdur {
			assert.ErrorIs(t, cerr, context.DeadlineExceeded, "K %d, Close's ctx %v", nk, cdur)
		}
		assert.Less(t, took, cdur+time.Second, "K %d: Close's duration against its ctx %v", nk, cdur)
		assert.Less(t, settle, 3*time.Second, "K %d, Close's ctx %v: lease goroutines left after Close returned (Redis paused)", nk, cdur)
		assert.Less(t, served, ttl+time.Second, "K %d: a key still blocked by B's gone waiters or leases past the TTL", nk)
	}
	for _, nk := range []int{1, 12} {
		for _, cdur := range []time.Duration{5 * time.Second, 300 * time.Millisecond} {
			run(t, nk, cdur)
		}
	}
}

// TestReviewClose47bCtxEndsWhileAbandonOut: B (N = 1, TTL 10 s) has W = 4
// waiters queued on key gone (whose one lease A holds). B's Close is
// called with a context of 50 ms ("short"): it ends the waiters, whose
// own leave calls (abandon's) are slow (held 300 ms at B's client), and
// then find no connection free in B's client (redis.ErrPoolTimeout: the
// engine's breaker stays closed) until 500 ms after the short Close
// began; Redis answers every call sent. The short Close returns its
// context's error at 50 ms. At 100 ms, the leave calls still out, a
// second Close of B is called with a context of 10 s ("long").
//
// Close's doc: "those out when Close begins are waited for, and one that
// fails is sent once more. After Close they go side by side ...; one
// that reaches no Redis is sent again, until it reaches Redis or its
// waiter's TTL has passed ... Only when Redis is away (two rounds reach
// none of it, the breaker open) are they dropped"; "once every Close
// under way has returned with its ctx's error, the calls still owed are
// dropped". When the leave calls fail (300 ms), the long Close is under
// way. Package definition: once the long Close has returned nil, with
// Redis answering (checked after 500 ms), none of B's gone waiters
// stands in gone's queue or waiters.
//
// Control (same run, same timings): the long Close alone, called at
// 100 ms.
func TestReviewClose47bCtxEndsWhileAbandonOut(t *testing.T) {
	const ttl, poll, w = 10 * time.Second, 100 * time.Millisecond, 4
	const hold, busyFor, shortCtx, longAt = 300 * time.Millisecond, 500 * time.Millisecond, 50 * time.Millisecond, 100 * time.Millisecond
	type outcome struct {
		left              []string
		shortErr, longErr error
		longTook          time.Duration
		refused, passed   int32
	}
	run := func(t *testing.T, short bool) (o outcome) {
		ctx := context.Background()
		e := leasetest.NewEnv(t)
		h := &c47bHook{relKey: "rel47c", goneKey: "gone47c", holdAbandon: hold, relAt: make(chan struct{})}
		eng := leasetest.Direct(t, e, time.Second, h)
		a := leasetest.SemOn(t, e.Eng, 1, lease.WithTTL(ttl), lease.WithPollInterval(poll))
		b, err := lease.New(eng, "partner", 1, lease.WithTTL(ttl), lease.WithPollInterval(poll))
		require.NoError(t, err)
		leasetest.CloseAtEnd(t, b)
		require.NoError(t, b.Load(ctx))
		first, err := a.Acquire(ctx, "gone47c")
		require.NoError(t, err)
		got := make(chan leasetest.Got, w)
		for i := 0; i < w; i++ {
			leasetest.AcquireAsync(ctx, e, b, "b", "gone47c", got)
			e.Queued(t, "gone47c", int64(i+1))
		}
		time.Sleep(2 * poll)

		h.armed.Store(true)
		h.busy.Store(true)
		start := time.Now()
		time.AfterFunc(busyFor, func() { h.busy.Store(false) })
		shortDone := make(chan error, 1)
		if short {
			go func() {
				sctx, scancel := context.WithTimeout(ctx, shortCtx)
				defer scancel()
				shortDone <- b.Close(sctx)
			}()
		} else {
			shortDone <- nil // control: the long Close ends the waiters
		}
		time.Sleep(longAt - time.Since(start))
		lctx, lcancel := context.WithTimeout(ctx, 10*time.Second)
		defer lcancel()
		lstart := time.Now()
		o.longErr = b.Close(lctx)
		o.longTook = time.Since(lstart)
		o.shortErr = <-shortDone
		for i := 0; i < w; i++ {
			require.ErrorIs(t, leasetest.Recv(t, got, "B's Acquire").Err, lease.ErrClosed)
		}
		time.Sleep(time.Until(start.Add(busyFor + 100*time.Millisecond)))
		o.left = cl45Standing(e, []string{"gone47c"})
		o.refused, o.passed = h.refused.Load(), h.passed.Load()
		require.NoError(t, first.Release(ctx))
		return o
	}
	for round := 0; round < 2; round++ {
		o := run(t, false)
		t.Logf("control, the long Close alone at %v: took %v, error %v; leave calls refused unsent %d, sent %d; B's gone waiters standing %v",
			longAt, o.longTook, o.longErr, o.refused, o.passed, o.left)
		require.NoError(t, o.longErr)
		assert.Empty(t, o.left, "control: B's gone waiters standing once the long Close returned (Redis answering)")

		o = run(t, true)
		t.Logf("a Close of %v, then a long one at %v while the leave calls are out: short Close's error %v; the long Close took %v, error %v; leave calls refused unsent %d, sent %d; B's gone waiters standing %v",
			shortCtx, longAt, o.shortErr, o.longTook, o.longErr, o.refused, o.passed, o.left)
		require.ErrorIs(t, o.shortErr, context.DeadlineExceeded, "the short Close")
		require.NoError(t, o.longErr, "the long Close")
		assert.Empty(t, o.left, "the long Close was under way when the leave calls failed: B's gone waiters standing once it returned nil (Redis answering)")
	}
	leasetest.Settled(t, ttl/3+2*time.Second)
}

// c47bCalls is an observer that counts the engine's calls by outcome once
// on is set: answered, reply lost, unavailable unsent, and ended by the
// caller's context alone (none of those). A call whose context ended
// while it queued at the engine's gate is not told to the observer.
type c47bCalls struct {
	on                                   atomic.Bool
	ok, lost, unsent, ctxOnly, otherErrs atomic.Int32
}

func (o *c47bCalls) ObserveDecision(string, throttle.Outcome, time.Duration) {}
func (o *c47bCalls) ObserveRefund(string, time.Duration)                     {}
func (o *c47bCalls) ObserveBreaker(bool)                                     {}
func (o *c47bCalls) ObserveCall(_ string, _ time.Duration, err error) {
	if !o.on.Load() {
		return
	}
	switch {
	case err == nil:
		o.ok.Add(1)
	case errors.Is(err, throttle.ErrReplyLost):
		o.lost.Add(1)
	case errors.Is(err, throttle.ErrUnavailable):
		o.unsent.Add(1)
	case errors.Is(err, context.DeadlineExceeded) || errors.Is(err, context.Canceled):
		o.ctxOnly.Add(1)
	default:
		o.otherErrs.Add(1)
	}
}

func (o *c47bCalls) String() string {
	return fmt.Sprintf("answered %d, reply lost %d, unavailable unsent %d, caller's context alone %d, other errors %d",
		o.ok.Load(), o.lost.Load(), o.unsent.Load(), o.ctxOnly.Load(), o.otherErrs.Load())
}

// TestReviewClose47bGateQueueSlowLink: B, through a proxy, engine timeout
// 250 ms, has W = 16 gone waiters on each of K keys, whose leave calls
// failed (an error Redis answers). Then Redis answers every call, the
// proxy adds 40 ms each way (a call takes 80 ms, well inside the
// timeout), and B's Close is called: each keeper sends its 16 at once,
// K*16 calls queued for the engine's connection gate (one token per
// connection of B's client's pool: 10 a CPU). A leave call's own bound
// is max(1 s, 4 timeouts) = 1 s; a call still queued at the gate then
// fails with its context's error, unsent. Close's doc: "one that reaches
// no Redis is sent again, until it reaches Redis or its waiter's TTL has
// passed". K = 48 (768 calls, some 3 s of queue); control, same run:
// K = 4 (64 calls). Check: once Close has returned nil, with Redis
// answering, none of B's gone waiters stands in Redis.
func TestReviewClose47bGateQueueSlowLink(t *testing.T) {
	const ttl, poll, w = 10 * time.Second, 100 * time.Millisecond, 16
	run := func(t *testing.T, nk int) []string {
		ctx := context.Background()
		obs := &c47bCalls{}
		sc := cl47Setup(t, nk, w, true, 250*time.Millisecond, ttl, poll, 1, throttle.WithObserver(obs))
		time.Sleep(3 * poll) // a keeper round has failed them again
		obs.on.Store(true)
		sc.px.SetLatency(40 * time.Millisecond)
		sc.h.mode.Store(0)
		sc.h.closing.Store(true)
		cctx, ccancel := context.WithTimeout(ctx, 30*time.Second)
		defer ccancel()
		start := time.Now()
		require.NoError(t, sc.b.Close(cctx))
		took := time.Since(start)
		left := cl45Standing(sc.e, sc.keys)
		ids, most := sc.maxAfter()
		// The standing ids by what became of their leave calls after
		// Close: none reached B's client (left queued at the engine's
		// gate), some reached it and none was answered, one was answered.
		_, after, ran := sc.h.snapshot()
		standing := map[string]bool{}
		for _, id := range left {
			standing[id] = true
		}
		var unsent, failed, answered int
		for id := range standing {
			switch {
			case after[id] == 0:
				unsent++
			case ran[id] == 0:
				failed++
			default:
				answered++
			}
		}
		t.Logf("K %d, W %d, 40 ms each way, engine timeout 250 ms: Close took %v; ids reaching B's client after Close %d of %d, most calls of one id %d; B's gone waiters standing once Close returned %d: no leave call reached B's client %d, none answered %d, one answered %d; B's engine's calls after Close (observer): %s",
			nk, w, took, ids, nk*w, most, len(standing), unsent, failed, answered, obs)
		sc.px.SetLatency(0)
		sc.release(t)
		return left
	}
	left := run(t, 4)
	assert.Empty(t, left, "control, K 4: B's gone waiters standing in Redis once Close returned")
	left = run(t, 48)
	assert.Empty(t, left, "K 48: B's gone waiters standing in Redis once Close returned nil (Redis answering)")
	leasetest.Settled(t, ttl/3+2*time.Second)
}

// c47bLossy, while on, loses the reply of a share p of a process's lease
// script calls: the call is sent and runs, and its reply is reported lost
// (a read timeout: throttle.ErrReplyLost).
type c47bLossy struct {
	on   atomic.Bool
	p    float64
	lost atomic.Int32
}

func (h *c47bLossy) DialHook(next redis.DialHook) redis.DialHook { return next }
func (h *c47bLossy) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}
func (h *c47bLossy) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		_, keys := leasetest.ScriptArgs(cmd)
		err := next(ctx, cmd)
		if err == nil && h.on.Load() && len(keys) > 0 && strings.Contains(keys[0], "partner:{") && rand.Float64() < h.p {
			h.lost.Add(1)
			cmd.SetErr(leasetest.ErrLostRead)
			return leasetest.ErrLostRead
		}
		return err
	}
}

// TestReviewClose47bChurnLostReplies: three processes (N = 2 per key, TTL
// 3 s, poll 100 ms), each through a proxy adding 40 ms each way, with a
// tenth of their lease script calls' replies lost (the call runs); six
// workers each acquire one of two keys with a context of 20 to 300 ms
// (many give up: queued, granted as they give up, their leave calls'
// replies lost while keep calls are out), hold a lease 0 to 150 ms and
// release it, for 6 s; then the losses stop and every process is closed
// (ctx 10 s), after the workers have stopped, or while they still work
// (closeMid). Also with 3 % of the replies lost. Package definitions checked: at most N leases of a key
// believed held at once (from Acquire's return to the Release call, or
// until Lost); Release of a lease whose Lost was not closed never returns
// ErrLost (TTL 3 s, holds under 200 ms: Redis held it); and once every
// Close has returned nil, with Redis answering, nobody stands in the
// keys' queues or waiters, and every holder left in Redis is a lease
// some Acquire returned (none granted to a gone waiter).
func TestReviewClose47bChurnLostReplies(t *testing.T) {
	for _, p := range []float64{0.03, 0.1} {
		for _, mid := range []bool{false, true} {
			t.Run(fmt.Sprintf("p=%v/closeMid=%v", p, mid), func(t *testing.T) { c47bChurn(t, p, mid) })
		}
	}
	leasetest.Settled(t, 2*time.Second)
}

// c47bChurn is one scene of TestReviewClose47bChurnLostReplies: a share p
// of replies lost; if mid, the processes are closed while the workers
// still acquire, hold and give up (they end with ErrClosed).
func c47bChurn(t *testing.T, p float64, mid bool) {
	const ttl, poll, n, procs, workers = 3 * time.Second, 100 * time.Millisecond, 2, 3, 6
	ctx := context.Background()
	e := leasetest.NewEnv(t)
	keys := []string{"ch47b-0", "ch47b-1"}
	var sems []*lease.Semaphore
	var lossy []*c47bLossy
	for range procs {
		h := &c47bLossy{p: p}
		px, eng := leasetest.Proxied(t, e, time.Second, nil, h)
		px.SetLatency(40 * time.Millisecond)
		s, err := lease.New(eng, "partner", n, lease.WithTTL(ttl), lease.WithPollInterval(poll))
		require.NoError(t, err)
		leasetest.CloseAtEnd(t, s)
		require.NoError(t, s.Load(ctx))
		sems = append(sems, s)
		lossy = append(lossy, h)
	}
	var (
		mu       sync.Mutex
		held     = map[string]int{}
		most     int
		over     []string
		tokens   = map[string]map[int64]bool{keys[0]: {}, keys[1]: {}}
		errLost  []string
		acquired atomic.Int32
		gaveUp   atomic.Int32
		otherErr atomic.Int32
	)
	for _, h := range lossy {
		h.on.Store(true)
	}
	stop := make(chan struct{})
	var wg sync.WaitGroup
	for _, s := range sems {
		for range workers {
			wg.Go(func() {
				for {
					select {
					case <-stop:
						return
					default:
					}
					key := keys[rand.IntN(len(keys))]
					actx, cancel := context.WithTimeout(ctx, time.Duration(20+rand.IntN(280))*time.Millisecond)
					l, err := s.Acquire(actx, key)
					cancel()
					if errors.Is(err, lease.ErrClosed) {
						return
					}
					if err != nil {
						if errors.Is(err, context.DeadlineExceeded) {
							gaveUp.Add(1)
						} else {
							otherErr.Add(1)
						}
						continue
					}
					acquired.Add(1)
					mu.Lock()
					tokens[key][l.Token()] = true
					held[key]++
					most = max(most, held[key])
					if held[key] > n {
						over = append(over, fmt.Sprintf("%s: %d held at once (token %d)", key, held[key], l.Token()))
					}
					mu.Unlock()
					lost := false
					select {
					case <-time.After(time.Duration(rand.IntN(150)) * time.Millisecond):
					case <-l.Lost():
						lost = true
					}
					mu.Lock()
					held[key]--
					mu.Unlock()
					if err := l.Release(ctx); errors.Is(err, lease.ErrLost) && !lost {
						mu.Lock()
						errLost = append(errLost, fmt.Sprintf("%s token %d", key, l.Token()))
						mu.Unlock()
					}
				}
			})
		}
	}
	time.Sleep(6 * time.Second)
	if !mid {
		close(stop)
		wg.Wait()
	}
	var lostReplies int32
	for _, h := range lossy {
		h.on.Store(false)
		lostReplies += h.lost.Load()
	}
	cctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	for _, s := range sems {
		require.NoError(t, s.Close(cctx))
	}
	if mid {
		close(stop)
		wg.Wait()
	}
	var standing, ghosts []string
	for _, k := range keys {
		hs, q, w := sp45State(e, k)
		standing = append(standing, q...)
		standing = append(standing, w...)
		for id := range hs {
			tok, err := e.Rdb.HGet(ctx, e.Key(k, "t"), id).Int64()
			if err != nil || !tokens[k][tok] {
				ghosts = append(ghosts, fmt.Sprintf("%s: %s (token %d, %v)", k, id, tok, hs[id]))
			}
		}
	}
	t.Logf("p %v, Close mid-churn %v: acquired %d, gave up %d, other errors %d; replies lost %d; most held at once %d; Release ErrLost with Lost open %d; standing after Close %d, holders no Acquire returned %d",
		p, mid, acquired.Load(), gaveUp.Load(), otherErr.Load(), lostReplies, most, len(errLost), len(standing), len(ghosts))
	require.Positive(t, acquired.Load())
	require.Positive(t, gaveUp.Load())
	assert.Empty(t, over, "more than N leases of a key believed held at once")
	assert.Empty(t, errLost, "Release returned ErrLost for a lease whose Lost was not closed (Redis held it)")
	assert.Empty(t, standing, "gone waiters standing in the queues or waiters once every Close returned (Redis answering)")
	assert.Empty(t, ghosts, "leases held in Redis that no Acquire returned (granted to a gone waiter) once every Close returned")
}

// TestReviewClose47bStoppedCloseLocksOutClient: one engine (timeout 50 ms)
// serves B (a Semaphore: N = 1, TTL 3 s) and U, another user of the same
// engine booking rate slots (Allow) every millisecond. B holds the one
// lease of each of K = 4 keys and, but for the control, has W = 8
// waiters queued on each. Redis is stopped (refused dials); once the
// engine's breaker is open, B is closed (ctx 3 s): its waiters end, and
// their leave calls go past the open breaker, side by side. Then Redis
// is restarted, 300, 600 or 900 ms after Close began (the client's
// lockout, if any, ends at a dial it makes once a second). The design: "A breaker stops every call from paying the
// timeout; a probe restores Redis as soon as it answers." Checks: once
// Redis listens again, none of U's calls fails with a refused
// connection (go-redis's pool, after PoolSize dial errors in a row,
// fails every dial at once until its own background dial, once a
// second, succeeds: the engine's probe then fails although Redis
// answers), as in the control; U's time to its first success is logged.
func TestReviewClose47bStoppedCloseLocksOutClient(t *testing.T) {
	const ttl, nk, w = 3 * time.Second, 4, 8
	run := func(t *testing.T, waiters bool, before time.Duration) (took, recovered time.Duration, refused int) {
		return c47bStoppedScene(t, ttl, nk, w, "lo47b-", waiters, true, before)
	}
	for _, before := range []time.Duration{300 * time.Millisecond, 600 * time.Millisecond, 900 * time.Millisecond} {
		took, rec, refused := run(t, false, before)
		t.Logf("control, B without waiters, restart %v after Close began: Close took %v; U served %v after the restart, %d of its calls refused a connection before", before, took, rec, refused)
		assert.Zero(t, refused, "control: U's calls refused a connection once Redis listened again")
		took, rec, refused = run(t, true, before)
		t.Logf("B with %d gone waiters on each of %d keys, restart %v after Close began: Close took %v; U served %v after the restart, %d of its calls refused a connection before", w, nk, before, took, rec, refused)
		if knownLimits {
			assert.Zero(t, refused, "restart %v after Close began: U's calls refused a connection once Redis listened again (B's leave calls past the breaker tripped the client's dial lockout)", before)
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
}

// c47bStoppedScene: B (N = 1, TTL ttl, poll 100 ms, engine timeout 1 s)
// holds the one lease of each of nk keys (name+"0" ...) and, if waiters,
// has w waiters queued on each; U is another user of B's engine, served
// before Redis is stopped. If openFirst, B's breaker is opened (by U's
// calls) and 300 ms pass; then B's Close is called with
// context.Background(). Redis is restarted restartAfter after Close began,
// and U calls until it is served. It returns Close's time, how long U took
// to be served after the restart, and how many of U's calls were refused a
// connection (ECONNREFUSED: go-redis's dial lockout, once Redis listens).
func c47bStoppedScene(t *testing.T, ttl time.Duration, nk, w int, name string, waiters, openFirst bool, restartAfter time.Duration) (took, recovered time.Duration, refused int) {
	ctx := context.Background()
	srv := redistest.Start(t)
	eng, err := throttle.New(srv.Client(t), throttle.WithPrefix(redistest.Prefix(t)), throttle.WithTimeout(time.Second)) // not 50 ms: the set-up's Acquires timed out on a busy machine
	require.NoError(t, err)
	b, err := lease.New(eng, "partner", 1, lease.WithTTL(ttl), lease.WithPollInterval(100*time.Millisecond))
	require.NoError(t, err)
	leasetest.CloseAtEnd(t, b)
	redistest.UntilOK(t, func() error { return b.Load(ctx) })
	got := make(chan error, nk*w)
	for i := 0; i < nk; i++ {
		key := fmt.Sprint(name, i)
		_, err := b.Acquire(ctx, key)
		require.NoError(t, err)
		if waiters {
			for range w {
				go func() { _, err := b.Acquire(ctx, key); got <- err }()
			}
		}
	}
	if waiters {
		rdb := srv.Client(t)
		leasetest.WaitFor(t, func() bool {
			n := 0
			for i := 0; i < nk; i++ {
				n += int(rdb.ZCard(ctx, eng.Prefix()+fmt.Sprintf("partner:{%s%d}:lease:q", name, i)).Val())
			}
			return n == nk*w
		})
	}
	lim := throttle.PerSecond(1000, 1000)
	u := func() error { _, err := eng.Allow(ctx, "u-"+name, lim); return err }
	redistest.UntilOK(t, u)
	srv.Stop()
	if openFirst {
		leasetest.WaitFor(t, func() bool { _ = u(); open, _ := eng.Unavailable(); return open })
		time.Sleep(300 * time.Millisecond)
	}
	start := time.Now()
	_ = b.Close(ctx)
	took = time.Since(start)
	if waiters {
		for range nk * w {
			require.ErrorIs(t, leasetest.Recv(t, got, "B's Acquire"), lease.ErrClosed)
		}
	}
	time.Sleep(time.Until(start.Add(restartAfter)))
	srv.Restart(t)
	back := time.Now()
	for {
		err := u()
		if err == nil {
			break
		}
		if errors.Is(err, syscall.ECONNREFUSED) {
			refused++
		}
		require.Less(t, time.Since(back), 10*time.Second, "U not served within 10 s of the restart: %v", err)
		time.Sleep(time.Millisecond)
	}
	return took, time.Since(back), refused
}

// c47bRel marks the context of a test's Release, for c47bKinds.
type c47bRel struct{}

// c47bKinds counts a client's commands by kind once on is set: lease
// script calls by their arguments (acquire, keep, release: a Release
// under a c47bRel context, leave: a waiter's own, leave with a spare
// token: the keeper's), blocking reads, and the rest. failLeave, while
// set, fails a waiter's own leave call unsent (a refused dial) once.
type c47bKinds struct {
	on, failLeave                                     atomic.Bool
	acquire, keep, release, leave, spare, read, other atomic.Int32
}

func (h *c47bKinds) DialHook(next redis.DialHook) redis.DialHook { return next }
func (h *c47bKinds) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}
func (h *c47bKinds) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		if !h.on.Load() {
			return next(ctx, cmd)
		}
		argv, _ := leasetest.ScriptArgs(cmd)
		_, id := func() (string, bool) {
			if len(argv) < 4 {
				return "", false
			}
			s, ok := argv[3].(string)
			return s, ok
		}()
		switch {
		case cmd.Name() == "blpop":
			h.read.Add(1)
		case leasetest.IsKeep(cmd):
			h.keep.Add(1)
		case id && len(argv) == 5:
			if _, mode := argv[4].(string); mode {
				h.acquire.Add(1)
			} else {
				h.spare.Add(1)
			}
		case id && ctx.Value(c47bRel{}) != nil:
			h.release.Add(1)
		case id:
			h.leave.Add(1)
			if h.failLeave.CompareAndSwap(true, false) {
				cmd.SetErr(leasetest.ErrNotSent)
				return leasetest.ErrNotSent
			}
		default:
			h.other.Add(1)
		}
		return next(ctx, cmd)
	}
}

func (h *c47bKinds) String() string {
	return fmt.Sprintf("acquire %d, keep %d, release %d, leave %d, leave with a token %d, blocking reads %d, other %d",
		h.acquire.Load(), h.keep.Load(), h.release.Load(), h.leave.Load(), h.spare.Load(), h.read.Load(), h.other.Load())
}

// TestReviewClose47bOrdinaryCalls: B's calls (counted at its client) on
// ordinary paths, without Close: 20 uncontended Acquire and Release; 5
// waiters queued behind A's lease that give up; one whose leave call
// fails unsent once (the keeper sends it again); one served when A
// releases, then released. TTL 30 s, poll 1 s (no extension, and no
// poll but by chance, in the test's time). The counts are logged, for a
// comparison with 4611850 (the same test there). Checks, from the
// package doc's Cost: Acquire without contention one call, Release one;
// a waiter that gives up one leave call (two with its failure).
func TestReviewClose47bOrdinaryCalls(t *testing.T) {
	const ttl, poll = 30 * time.Second, time.Second
	ctx := context.Background()
	rel := context.WithValue(ctx, c47bRel{}, true)
	e := leasetest.NewEnv(t)
	h := &c47bKinds{}
	eng := leasetest.Direct(t, e, 5*time.Second, h)
	a := leasetest.SemOn(t, e.Eng, 1, lease.WithTTL(ttl), lease.WithPollInterval(poll))
	b := leasetest.SemOn(t, eng, 1, lease.WithTTL(ttl), lease.WithPollInterval(poll))
	require.NoError(t, b.Load(ctx))
	h.on.Store(true)
	for range 20 {
		l, err := b.Acquire(ctx, "oc47b-free")
		require.NoError(t, err)
		require.NoError(t, l.Release(rel))
	}
	free := h.String()
	la, err := a.Acquire(ctx, "oc47b")
	require.NoError(t, err)
	for i := range 6 {
		if i == 5 {
			h.failLeave.Store(true)
		}
		actx, cancel := context.WithCancel(ctx)
		got := make(chan leasetest.Got, 1)
		leasetest.AcquireAsync(actx, e, b, "b", "oc47b", got)
		e.Queued(t, "oc47b", 1)
		cancel()
		require.ErrorIs(t, leasetest.Recv(t, got, "B's Acquire").Err, context.Canceled)
	}
	e.Queued(t, "oc47b", 0)
	got := make(chan leasetest.Got, 1)
	leasetest.AcquireAsync(ctx, e, b, "b", "oc47b", got)
	e.Queued(t, "oc47b", 1)
	require.NoError(t, la.Release(ctx))
	g := leasetest.Recv(t, got, "B's Acquire")
	require.NoError(t, g.Err)
	require.NoError(t, g.L.Release(rel))
	time.Sleep(200 * time.Millisecond)
	h.on.Store(false)
	t.Logf("uncontended (20 Acquire and Release): %s", free)
	t.Logf("in all: %s", h)
	assert.Equal(t, int32(27), h.acquire.Load(), "acquire calls (20 uncontended, then 7 waiters)")
	assert.Equal(t, int32(21), h.release.Load(), "release calls")
	assert.Equal(t, int32(6), h.leave.Load(), "the waiters' own leave calls")
	assert.Equal(t, int32(1), h.spare.Load(), "the keeper's leave calls (the one that failed, sent again)")
}
