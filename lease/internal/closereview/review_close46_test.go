package closereview_test

// Review of b7e5875 and ed0436c (helper-137): after Close, pending leave
// calls go out side by side (an errgroup, at most 16 a key), and a call
// that failed in a round begun before Close, its reply coming after, is
// tried again. The side path here is the leave call a giving-up Acquire
// sends itself (abandon), not a keeper round's: begun before Close, its
// failure (an error Redis answers) coming while Close is under way.

import (
	"context"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/slotbook/slotbook/lease"
	"github.com/slotbook/slotbook/lease/internal/leasetest"
)

// cl46Gate holds, once armed, the next script call of four or more
// arguments on subject's keys whose fourth argument is an id (a leave or
// release call; an acquire call has five, its last a mode string, and is
// let through): caught is closed when it reaches the hook, and it waits
// there until open is closed; then, if fail, it fails with an error Redis
// answers (the call itself is not run), else it is sent.
type cl46Gate struct {
	subject      string
	armed        atomic.Bool
	fail         bool
	caught, open chan struct{}
	tries        atomic.Int32 // such calls seen on subject, armed or not
}

func newCl46Gate(subject string, fail bool) *cl46Gate {
	return &cl46Gate{subject: subject, fail: fail, caught: make(chan struct{}), open: make(chan struct{})}
}

type cl46Hook struct{ gates []*cl46Gate }

func (h cl46Hook) DialHook(next redis.DialHook) redis.DialHook { return next }
func (h cl46Hook) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}
func (h cl46Hook) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		argv, keys := leasetest.ScriptArgs(cmd)
		if len(argv) < 4 || len(keys) == 0 {
			return next(ctx, cmd)
		}
		if _, ok := argv[3].(string); !ok {
			return next(ctx, cmd)
		}
		if len(argv) == 5 {
			if _, mode := argv[4].(string); mode {
				return next(ctx, cmd) // an acquire call
			}
		}
		for _, g := range h.gates {
			if !strings.Contains(keys[0], "{"+g.subject+"}") {
				continue
			}
			g.tries.Add(1)
			if !g.armed.CompareAndSwap(true, false) {
				break
			}
			close(g.caught)
			<-g.open
			if g.fail {
				sub := redis.NewCmd(ctx, "eval", "return redis.error_reply('ERR injected: leave refused')", 0)
				_ = next(ctx, sub)
				cmd.SetErr(sub.Err())
				return sub.Err()
			}
			break
		}
		return next(ctx, cmd)
	}
}

// TestReviewClose46AbandonFailsDuringClose: A holds g's one lease; B
// (its own engine, hooked) holds h's and has one waiter queued on g,
// which gives up: its own leave call (abandon's) is held at the hook.
// Close is called; B's release of h, which Close sends, is held too, so
// that Close is under way. The leave call then fails with an error Redis
// answers (fail) or goes through (control), and the giving-up Acquire
// returns; then the release goes through and Close returns. Check: once
// Close has returned, with Redis answering all along, B's gone waiter
// does not stand in g's queue or waiters. Also: no goroutine of package
// lease is left 2 s after, and the leave was tried at least once after
// the failure when it failed.
func TestReviewClose46AbandonFailsDuringClose(t *testing.T) {
	testClose46(t, false)
}

// TestReviewClose46ClosedWaiterFails is the same with B's waiter still
// waiting when Close is called: Close's doc says a waiting Acquire caller
// gets ErrClosed and leaves the queue; its leave call (sent by the
// Acquire, while Close is under way) fails once with an error Redis
// answers.
func TestReviewClose46ClosedWaiterFails(t *testing.T) {
	testClose46(t, true)
}

func testClose46(t *testing.T, byClose bool) {
	const ttl, poll = 3 * time.Second, 100 * time.Millisecond
	run := func(t *testing.T, fail bool) (q, w []string, tries int32) {
		ctx := context.Background()
		e := leasetest.NewEnv(t)
		leave := newCl46Gate("g", fail)
		rel := newCl46Gate("h", false)
		eng := leasetest.Direct(t, e, time.Second, cl46Hook{gates: []*cl46Gate{leave, rel}})
		a := leasetest.SemOn(t, e.Eng, 1, lease.WithTTL(ttl), lease.WithPollInterval(poll))
		b, err := lease.New(eng, "partner", 1, lease.WithTTL(ttl), lease.WithPollInterval(poll))
		require.NoError(t, err)
		require.NoError(t, b.Load(ctx))
		first, err := a.Acquire(ctx, "g")
		require.NoError(t, err)
		_, err = b.Acquire(ctx, "h")
		require.NoError(t, err)
		actx, cancel := context.WithCancel(ctx)
		acq := make(chan error, 1)
		go func() { _, err := b.Acquire(actx, "g"); acq <- err }()
		e.Queued(t, "g", 1)
		defer cancel()
		leave.armed.Store(true)
		want := lease.ErrClosed
		if !byClose {
			want = context.Canceled
			cancel()
			leasetest.Recv(t, leave.caught, "B's leave call (abandon's)")
		}
		rel.armed.Store(true)
		closed := make(chan error, 1)
		cctx, ccancel := context.WithTimeout(ctx, 10*time.Second)
		defer ccancel()
		go func() { closed <- b.Close(cctx) }()
		leasetest.Recv(t, rel.caught, "Close's release of h") // Close is under way
		if byClose {
			leasetest.Recv(t, leave.caught, "B's leave call (the closed Acquire's)")
		}
		before := leave.tries.Load()
		close(leave.open)
		require.ErrorIs(t, leasetest.Recv(t, acq, "B's Acquire"), want)
		close(rel.open)
		require.NoError(t, leasetest.Recv(t, closed, "B's Close"))
		_, q, w = sp45State(e, "g")
		require.NoError(t, first.Release(ctx))
		require.NoError(t, a.Close(ctx))
		leasetest.Settled(t, 2*time.Second)
		return q, w, leave.tries.Load() - before
	}
	for round := 0; round < 3; round++ {
		q, w, _ := run(t, false)
		assert.Empty(t, q, "control: g's queue once Close returned")
		assert.Empty(t, w, "control: g's waiters once Close returned")
		q, w, tries := run(t, true)
		t.Logf("leave call failing during Close (by Close %v): queue %v, waiters %v once Close returned; leave calls tried after the failure: %d", byClose, q, w, tries)
		assert.Empty(t, q, "abandon's leave call failing during Close (Redis answering): B's gone waiter in g's queue once Close returned")
		assert.Empty(t, w, "abandon's leave call failing during Close: B's gone waiter in g's waiters once Close returned")
	}
}

// cl46HoldAll holds, while hold is set, every leave call of B's on
// subject (a script call whose fourth argument is an id and, if it has a
// fifth, a spare token, not an acquire call's mode) until release is closed; the call is then sent and its
// reply reported lost (it ran) if lose. held counts the calls held.
type cl46HoldAll struct {
	subject string
	lose    bool // report a held call's reply lost (it ran); else pass it
	hold    atomic.Bool
	release chan struct{}
	held    atomic.Int32
}

func (h *cl46HoldAll) DialHook(next redis.DialHook) redis.DialHook { return next }
func (h *cl46HoldAll) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}
func (h *cl46HoldAll) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		argv, keys := leasetest.ScriptArgs(cmd)
		if !h.hold.Load() || len(argv) < 4 || len(keys) == 0 || !strings.Contains(keys[0], "{"+h.subject+"}") {
			return next(ctx, cmd)
		}
		if _, ok := argv[3].(string); !ok {
			return next(ctx, cmd)
		}
		if len(argv) == 5 {
			if _, spare := argv[4].(int64); !spare {
				return next(ctx, cmd) // an acquire call
			}
		}
		h.held.Add(1)
		<-h.release
		if err := next(ctx, cmd); err != nil || !h.lose {
			return err
		}
		cmd.SetErr(leasetest.ErrLostRead)
		return leasetest.ErrLostRead
	}
}

// TestReviewClose46ConcurrentCloseShortCtx: B has k gone waiters on f
// whose leave calls failed (an error Redis answers), held by its keeper.
// Redis then answers, but every leave call after Close is held at the
// hook. Two Closes are called at once: one whose context ends 300 ms on,
// one with 20 s. Checks: the short one returns, with its context's
// error, before the held calls are let go (it returns within its
// context); the held calls then run, their replies passed (controls) or
// lost (the reply of a call Redis ran, as on a network glitch); the long
// Close returns, each id's leave call was tried a bounded number of times
// after Close (at most 2), no gone waiter stands in Redis, and no
// goroutine of package lease is left 2 s after. Runs: k = 16 with
// replies lost, and k = 24 with replies passed (controls); k = 24 with
// replies lost: the first 16 calls' lost replies open the engine's
// breaker, and the other 8 calls are refused unsent and dropped.
func TestReviewClose46ConcurrentCloseShortCtx(t *testing.T) {
	// A TTL well above Close's rounds: with every reply lost, the calls
	// the breaker refuses go one probe at a time, the probes' interval
	// doubling (about 2 s for 8), and an entry past its TTL is dropped
	// unsent (Redis has dropped its waiter: lazily, so the raw state read
	// here would still show it).
	const ttl, poll = 10 * time.Second, 100 * time.Millisecond
	for _, tc := range []struct {
		k    int
		lose bool
	}{{16, true}, {24, false}, {24, true}, {16, true}, {24, false}, {24, true}} {
		k := tc.k
		ctx := context.Background()
		e := leasetest.NewEnv(t)
		h := newCl45Hook()
		hold := &cl46HoldAll{subject: "f", lose: tc.lose, release: make(chan struct{})}
		eng := leasetest.Direct(t, e, time.Second, h, hold)
		a := leasetest.SemOn(t, e.Eng, 1, lease.WithTTL(ttl), lease.WithPollInterval(poll))
		b, err := lease.New(eng, "partner", 1, lease.WithTTL(ttl), lease.WithPollInterval(poll))
		require.NoError(t, err)
		require.NoError(t, b.Load(ctx))
		first, err := a.Acquire(ctx, "f")
		require.NoError(t, err)
		actx, cancel := context.WithCancel(ctx)
		got := make(chan leasetest.Got, k)
		for i := 0; i < k; i++ {
			leasetest.AcquireAsync(actx, e, b, "b", "f", got)
			e.Queued(t, "f", int64(i+1))
		}
		h.mode.Store(1)
		cancel()
		for i := 0; i < k; i++ {
			require.ErrorIs(t, leasetest.Recv(t, got, "B's Acquire").Err, context.Canceled)
		}
		time.Sleep(2 * poll) // a keeper round has failed them again
		h.mode.Store(0)
		hold.hold.Store(true)
		h.closing.Store(true)
		short, long := make(chan error, 1), make(chan error, 1)
		sctx, scancel := context.WithTimeout(ctx, 300*time.Millisecond)
		lctx, lcancel := context.WithTimeout(ctx, 20*time.Second)
		go func() { short <- b.Close(sctx) }()
		closeAt := time.Now()
		go func() { long <- b.Close(lctx) }()
		serr := leasetest.Recv(t, short, "the short Close")
		require.ErrorIs(t, serr, context.DeadlineExceeded, "the short Close, its context ended while leave calls were held")
		heldAt := hold.held.Load()
		close(hold.release)
		require.NoError(t, leasetest.Recv(t, long, "the long Close"))
		took := time.Since(closeAt)
		left := cl45Standing(e, []string{"f"})
		_, after, ran := h.snapshot()
		maxAfter := 0
		for _, n := range after {
			maxAfter = max(maxAfter, n)
		}
		t.Logf("k %d, replies lost %v: %d leave calls held when the short Close returned; the long Close took %v; per-id calls after Close max %d, ids whose reply came back %d of %d; standing %v", k, tc.lose, heldAt, took, maxAfter, len(ran), k, left)
		require.LessOrEqual(t, maxAfter, 2, "leave calls of one id after Close")
		assert.Empty(t, left, "k %d, replies lost %v: B's gone waiters standing in Redis once Close returned", k, tc.lose)
		require.NoError(t, first.Release(ctx))
		require.NoError(t, a.Close(ctx))
		scancel()
		lcancel()
		leasetest.Settled(t, 2*time.Second)
	}
}

// TestReviewClose46ManyKeysLatency: B, over a proxy adding 40 ms each
// way, has W = 18 gone waiters on each of K = 4 keys (more than the 16 a
// key sendLeaves has out at once), whose leave calls failed (an error
// Redis answers); then Redis answers and B's Close is called. Control in
// the same run: K = W = 1, and K = 1, W = 18 (Close's times are logged,
// not judged: the calls share the client's pool, whose dials pay the
// proxy's latency). Checks: every id's leave call is tried at most twice
// after Close; none
// of B's gone waiters stands in Redis once Close returned; no goroutine
// of package lease is left 2 s after.
func TestReviewClose46ManyKeysLatency(t *testing.T) {
	const ttl, poll = 5 * time.Second, 100 * time.Millisecond
	run := func(t *testing.T, nk, w int) time.Duration {
		ctx := context.Background()
		e := leasetest.NewEnv(t)
		h := newCl45Hook()
		px, eng := leasetest.Proxied(t, e, 2*time.Second, nil, h)
		a := leasetest.SemOn(t, e.Eng, 1, lease.WithTTL(ttl), lease.WithPollInterval(poll))
		b, err := lease.New(eng, "partner", 1, lease.WithTTL(ttl), lease.WithPollInterval(poll))
		require.NoError(t, err)
		require.NoError(t, b.Load(ctx))
		px.SetLatency(40 * time.Millisecond)
		var keys []string
		var firsts []*lease.Lease
		actx, cancel := context.WithCancel(ctx)
		got := make(chan leasetest.Got, nk*w)
		for i := 0; i < nk; i++ {
			key := "m" + string(rune('a'+i))
			keys = append(keys, key)
			f, err := a.Acquire(ctx, key)
			require.NoError(t, err)
			firsts = append(firsts, f)
			for j := 0; j < w; j++ {
				leasetest.AcquireAsync(actx, e, b, "b", key, got)
			}
		}
		for _, key := range keys {
			e.Queued(t, key, int64(w))
		}
		h.mode.Store(1)
		cancel()
		for i := 0; i < nk*w; i++ {
			require.ErrorIs(t, leasetest.Recv(t, got, "B's Acquire").Err, context.Canceled)
		}
		time.Sleep(3 * poll)
		h.mode.Store(0)
		h.closing.Store(true)
		cctx, ccancel := context.WithTimeout(ctx, 20*time.Second)
		defer ccancel()
		t0 := time.Now()
		require.NoError(t, b.Close(cctx))
		took := time.Since(t0)
		left := cl45Standing(e, keys)
		_, after, _ := h.snapshot()
		maxAfter := 0
		for _, n := range after {
			maxAfter = max(maxAfter, n)
		}
		t.Logf("K %d, W %d: Close took %v; ids tried after Close %d, most calls of one id %d; standing %d", nk, w, took, len(after), maxAfter, len(left))
		assert.LessOrEqual(t, maxAfter, 2, "leave calls of one id after Close")
		assert.Empty(t, left, "B's gone waiters standing in Redis once Close returned")
		for _, f := range firsts {
			require.NoError(t, f.Release(ctx))
		}
		require.NoError(t, a.Close(ctx))
		leasetest.Settled(t, 2*time.Second)
		return took
	}
	for round := 0; round < 2; round++ {
		ctl := run(t, 1, 1)
		one := run(t, 1, 18)
		took := run(t, 4, 18)
		// Not asserted: 72 calls share the client's pool (dials through
		// the proxy pay its latency too); logged for the report.
		t.Logf("Close: K=W=1 %v, K=1 W=18 %v, K=4 W=18 %v", ctl, one, took)
	}
}
