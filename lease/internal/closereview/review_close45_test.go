package closereview_test

// Review of ff26d2a (helper-124): after Close, the pending leave calls of
// a key's gone waiters go out side by side (at most 16 at once), and an
// entry replaced while its call was out is sent once more. The rigs are
// helper-122's and helper-123's (review_spare45_test.go,
// review_seq45_test.go): a go-redis hook on one process's client (B)
// fails, refuses or holds chosen script calls.

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

// cl45Hook is a hook on B's client, for the script calls on keys of the
// semaphore named partner (another semaphore on the same client passes
// untouched). mode: 0 pass; 1 fail leave calls with an error Redis answers
// (the breaker stays closed); 2 down: every such script call fails unsent
// with a refused dial (the breaker opens). It counts, per waiter id, the
// leave calls attempted (tries), those attempted after closing was set
// (after), and those Redis ran (ran).
type cl45Hook struct {
	mode    atomic.Int32
	closing atomic.Bool
	// holdNext, once set, holds the next leave call failed in mode 1 at
	// the hook (held is closed) until release is closed; it then fails.
	holdNext      atomic.Bool
	held, release chan struct{}
	mu            sync.Mutex
	tries         map[string]int
	after         map[string]int
	ran           map[string]int
}

func newCl45Hook() *cl45Hook {
	return &cl45Hook{tries: map[string]int{}, after: map[string]int{}, ran: map[string]int{},
		held: make(chan struct{}), release: make(chan struct{})}
}

func (h *cl45Hook) DialHook(next redis.DialHook) redis.DialHook { return next }
func (h *cl45Hook) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}
func (h *cl45Hook) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		argv, keys := leasetest.ScriptArgs(cmd)
		if len(argv) < 4 || len(keys) == 0 || !strings.Contains(keys[0], "partner:{") {
			return next(ctx, cmd)
		}
		mode := h.mode.Load()
		if mode == 2 {
			cmd.SetErr(leasetest.ErrNotSent)
			return leasetest.ErrNotSent
		}
		id, isID := argv[3].(string)
		spare := false
		if len(argv) == 5 {
			_, spare = argv[4].(int64) // an acquire call's is its mode, a string
		}
		if !isID || !(spare || len(argv) == 4 && ctx.Value(sp45Rel{}) == nil) {
			return next(ctx, cmd)
		}
		h.mu.Lock()
		h.tries[id]++
		if h.closing.Load() {
			h.after[id]++
		}
		h.mu.Unlock()
		if mode == 1 {
			if h.holdNext.CompareAndSwap(true, false) {
				close(h.held)
				<-h.release
			}
			sub := redis.NewCmd(ctx, "eval", "return redis.error_reply('ERR injected: leave refused')", 0)
			_ = next(ctx, sub)
			cmd.SetErr(sub.Err())
			return sub.Err()
		}
		err := next(ctx, cmd)
		if err == nil {
			h.mu.Lock()
			h.ran[id]++
			h.mu.Unlock()
		}
		return err
	}
}

func (h *cl45Hook) snapshot() (tries, after, ran map[string]int) {
	h.mu.Lock()
	defer h.mu.Unlock()
	cp := func(m map[string]int) map[string]int {
		out := make(map[string]int, len(m))
		for k, v := range m {
			out[k] = v
		}
		return out
	}
	return cp(h.tries), cp(h.after), cp(h.ran)
}

// cl45Standing returns, for keys, B's ids still queued, waiting, or
// holding (every holder but the one lease per key A holds).
func cl45Standing(e *leasetest.Env, keys []string) []string {
	var out []string
	for _, k := range keys {
		hs, q, w := sp45State(e, k)
		out = append(out, q...)
		out = append(out, w...)
		if len(hs) > 1 {
			out = append(out, fmt.Sprintf("%s: %d holders", k, len(hs)))
		}
	}
	return out
}

// cl45Gone has A (on e's engine) take key's one lease, then k waiters of
// B's (on an engine of its own, 1 s timeout, its client hooked by h) join
// key's queue one after another and give up, with h in mode from then
// on: it returns once every Acquire of B's has returned. b is closed by
// the caller, not at the test's end.
func cl45Gone(t *testing.T, key string, k int, mode int32, ttl, poll time.Duration) (e *leasetest.Env, h *cl45Hook, eng *throttle.Engine, b *lease.Semaphore, first *lease.Lease) {
	t.Helper()
	e = leasetest.NewEnv(t)
	ctx := context.Background()
	h = newCl45Hook()
	eng = leasetest.Direct(t, e, time.Second, h)
	a := leasetest.SemOn(t, e.Eng, 1, lease.WithTTL(ttl), lease.WithPollInterval(poll))
	b, err := lease.New(eng, "partner", 1, lease.WithTTL(ttl), lease.WithPollInterval(poll))
	require.NoError(t, err)
	require.NoError(t, b.Load(ctx))
	first, err = a.Acquire(ctx, key)
	require.NoError(t, err)
	actx, cancel := context.WithCancel(ctx)
	got := make(chan leasetest.Got, k)
	for i := 0; i < k; i++ {
		leasetest.AcquireAsync(actx, e, b, "b", key, got)
		e.Queued(t, key, int64(i+1))
	}
	h.mode.Store(mode)
	cancel()
	for i := 0; i < k; i++ {
		require.ErrorIs(t, leasetest.Recv(t, got, "B's Acquire").Err, context.Canceled)
	}
	return e, h, eng, b, first
}

// TestReviewClose45ManyKeys: B has W gone waiters on each of K keys (N =
// 1, each key held by A), whose leave calls failed (an error Redis
// answers), so that B's keepers hold K*W entries; then Redis answers
// every call and B's Close is called. Meanwhile C, a second Semaphore on
// B's engine, acquires and releases a key of its own in a loop. Checks:
// every gone waiter's leave call reaches Redis once (twice let pass for
// one key's waiters); Close takes no more
// than with K = W = 1 (the control, same run) plus a second; C's calls
// all succeed, and none takes more than its slowest during the control's
// Close plus a second; once Close has returned none of B's waiters
// stands in Redis; no goroutine of package lease is left 2 s after.
func TestReviewClose45ManyKeys(t *testing.T) {
	const ttl, poll = 3 * time.Second, 100 * time.Millisecond
	type res struct {
		took, cMax time.Duration
		cCalls     int
		cErr       error
	}
	run := func(t *testing.T, nk, nw int) res {
		e := leasetest.NewEnv(t)
		ctx := context.Background()
		h := newCl45Hook()
		eng := leasetest.Direct(t, e, time.Second, h)
		a := leasetest.SemOn(t, e.Eng, 1, lease.WithTTL(ttl), lease.WithPollInterval(poll))
		b, err := lease.New(eng, "partner", 1, lease.WithTTL(ttl), lease.WithPollInterval(poll))
		require.NoError(t, err)
		c, err := lease.New(eng, "other", 1, lease.WithTTL(ttl), lease.WithPollInterval(poll))
		require.NoError(t, err)
		t.Cleanup(func() { _ = c.Close(context.Background()) })
		require.NoError(t, b.Load(ctx))
		keys := make([]string, nk)
		held := make([]*lease.Lease, nk)
		for i := range keys {
			keys[i] = fmt.Sprint("m", i)
			held[i], err = a.Acquire(ctx, keys[i])
			require.NoError(t, err)
		}
		actx, cancel := context.WithCancel(ctx)
		got := make(chan leasetest.Got, nk*nw)
		for _, k := range keys {
			for range nw {
				leasetest.AcquireAsync(actx, e, b, "b", k, got)
			}
		}
		leasetest.WaitFor(t, func() bool {
			for _, k := range keys {
				if e.Rdb.ZCard(ctx, e.Key(k, "q")).Val() != int64(nw) {
					return false
				}
			}
			return true
		})
		h.mode.Store(1)
		cancel()
		for range nk * nw {
			require.ErrorIs(t, leasetest.Recv(t, got, "B's Acquire").Err, context.Canceled)
		}
		time.Sleep(2 * poll) // the keepers have tried them again, and failed
		tries, _, _ := h.snapshot()
		require.Len(t, tries, nk*nw, "gone waiters whose leave call was tried")

		// C on the same engine, during Close.
		var r res
		stop := make(chan struct{})
		cdone := make(chan struct{})
		var cmu sync.Mutex
		measuring := atomic.Bool{}
		go func() {
			defer close(cdone)
			for {
				select {
				case <-stop:
					return
				default:
				}
				t0 := time.Now()
				cctx, ccancel := context.WithTimeout(ctx, 10*time.Second)
				l, err := c.Acquire(cctx, "z")
				if err == nil {
					err = l.Release(cctx)
				}
				ccancel()
				d := time.Since(t0)
				if measuring.Load() {
					cmu.Lock()
					r.cCalls++
					r.cMax = max(r.cMax, d)
					if err != nil && r.cErr == nil {
						r.cErr = err
					}
					cmu.Unlock()
				}
			}
		}()
		time.Sleep(20 * time.Millisecond)
		h.closing.Store(true)
		h.mode.Store(0)
		measuring.Store(true)
		cctx, ccancel := context.WithTimeout(ctx, 30*time.Second)
		defer ccancel()
		start := time.Now()
		assert.NoError(t, b.Close(cctx))
		r.took = time.Since(start)
		left := cl45Standing(e, keys)
		time.Sleep(20 * time.Millisecond)
		close(stop)
		<-cdone
		_, after, ran := h.snapshot()
		perID := map[int]int{} // runs in Redis -> ids
		for id := range tries {
			perID[ran[id]]++
		}
		maxAfter := 0
		for _, n := range after {
			maxAfter = max(maxAfter, n)
		}
		t.Logf("K = %d, W = %d: Close took %v; ids by leave calls Redis ran %v; most calls of one id after Close began %d; C: %d calls during Close, slowest %v, error %v; B's standing once Close returned: %d",
			nk, nw, r.took, perID, maxAfter, r.cCalls, r.cMax, r.cErr, len(left))
		// Every id's leave call reaches Redis, once. On a busy machine,
		// until stop 47, some ids' were run twice: a keeper round's call
		// went after the id's entry had been replaced (abandon's call
		// failing while the round waited), and the replacement was sent
		// again (9 to 26 of 500 ids in 2 of 24 rounds of three runs side
		// by side; 0 of 24 since the call covers a replacement made
		// before it went: see lease's covers).
		for n, ids := range perID {
			assert.Equal(t, 1, n, "%d of %d ids by leave calls Redis ran %d times (want every id once)", ids, nk*nw, n)
		}
		assert.Empty(t, left, "B's gone waiters standing in Redis once Close returned")
		assert.NoError(t, r.cErr, "C's calls during B's Close")
		for _, l := range held {
			require.NoError(t, l.Release(ctx))
		}
		return r
	}
	for round := 0; round < 2; round++ {
		ctl := run(t, 1, 1)
		many := run(t, 50, 10)
		assert.Less(t, many.took, ctl.took+time.Second, "Close with 50 x 10 pending leave calls, against 1")
		assert.Less(t, many.cMax, ctl.cMax+time.Second, "C's slowest call during B's Close, against the control's")
	}
	leasetest.Settled(t, 2*time.Second)
}

// TestReviewClose45BreakerOpenAtClose: B's gone waiters' leave calls
// failed because Redis was away (refused dials: the engine's breaker
// opened, and its probes failed until their interval grew). Then Redis
// answers again, and B's Close is called before the breaker's next probe.
// The doc (sendLeaves): "after Close, every one is tried once"; the
// changelog of ff26d2a calls leave calls refused unsent by the open
// breaker after Close a defect (their waiters stand in the queue for a
// TTL). Checks: every pending leave call reaches Redis after Close began,
// and once Close has returned none of B's waiters stands in Redis.
// Control, same run: Close called once the breaker has closed. It was a
// known limit (failing only under the build tag slotbook_known_limits)
// until stop 47: Close now sends such calls from the breaker's next probe.
func TestReviewClose45BreakerOpenAtClose(t *testing.T) {
	const ttl, poll, k = 3 * time.Second, 100 * time.Millisecond, 6
	run := func(t *testing.T, waitClosed bool) (int, []string) {
		ctx := context.Background()
		e, h, eng, b, first := cl45Gone(t, "o", k, 2, ttl, poll)
		// Redis away long enough for the probes' interval to grow.
		time.Sleep(1500 * time.Millisecond)
		open, in := eng.Unavailable()
		require.True(t, open, "B's engine's breaker after refused dials")
		if waitClosed {
			h.mode.Store(0)
			leasetest.WaitFor(t, func() bool { o, _ := eng.Unavailable(); return !o })
		} else {
			leasetest.WaitFor(t, func() bool { _, in = eng.Unavailable(); return in > 150*time.Millisecond })
			h.mode.Store(0)
		}
		h.closing.Store(true)
		cctx, ccancel := context.WithTimeout(ctx, 10*time.Second)
		defer ccancel()
		open, in = eng.Unavailable()
		start := time.Now()
		require.NoError(t, b.Close(cctx))
		took := time.Since(start)
		left := cl45Standing(e, []string{"o"})
		_, after, ran := h.snapshot()
		n := 0
		for _, c := range ran {
			n += c
		}
		t.Logf("breaker open at Close %v (next probe in %v): Close took %v; leave calls reaching the client after Close began %v; leave calls Redis ran %d of %d; B's waiters standing once Close returned %v",
			open, in, took, after, n, k, left)
		require.NoError(t, first.Release(ctx))
		return n, left
	}
	for round := 0; round < 2; round++ {
		n, left := run(t, true)
		assert.Equal(t, k, n, "control: leave calls Redis ran")
		assert.Empty(t, left, "control: B's waiters standing once Close returned")
		n, left = run(t, false)
		assert.Equal(t, k, n, "breaker open at Close: leave calls Redis ran")
		assert.Empty(t, left, "breaker open at Close: B's gone waiters standing in Redis once Close returned")
	}
	leasetest.Settled(t, 2*time.Second)
}

// TestReviewClose45NoSpin: can the closed keeper loop spin? B's k
// waiters give up while a keep call that refreshed them is held at the
// hook (so that its reply asks for their leave calls again, new entries
// replacing those of abandon's failed calls), and B's leave calls are
// refused (an error Redis answers) from then on, also after Close. Close
// begins, then the keep reply is let go. Checks: Close returns; at most
// three leave calls per id after Close began (one per entry); no
// goroutine of package lease is left 2 s after.
func TestReviewClose45NoSpin(t *testing.T) {
	const ttl, poll, k = 3 * time.Second, 100 * time.Millisecond, 20
	e := leasetest.NewEnv(t)
	ctx := context.Background()
	h := newCl45Hook()
	kh := newSp45Hook()
	eng := leasetest.Direct(t, e, time.Second, kh, h)
	a := leasetest.SemOn(t, e.Eng, 1, lease.WithTTL(ttl), lease.WithPollInterval(poll))
	b, err := lease.New(eng, "partner", 1, lease.WithTTL(ttl), lease.WithPollInterval(poll))
	require.NoError(t, err)
	require.NoError(t, b.Load(ctx))
	first, err := a.Acquire(ctx, "s")
	require.NoError(t, err)
	actx, cancel := context.WithCancel(ctx)
	got := make(chan leasetest.Got, k)
	for i := 0; i < k; i++ {
		leasetest.AcquireAsync(actx, e, b, "b", "s", got)
	}
	e.Queued(t, "s", k)
	kh.keep.reply = make(chan struct{})
	kh.keep.armed.Store(true)
	leasetest.Recv(t, kh.keep.caught, "the keep call refreshing B's waiters")
	close(kh.keep.open)
	require.NoError(t, leasetest.Recv(t, kh.keep.ran, "the keep call"))
	h.mode.Store(1)
	cancel()
	for i := 0; i < k; i++ {
		require.ErrorIs(t, leasetest.Recv(t, got, "B's Acquire").Err, context.Canceled)
	}
	h.closing.Store(true)
	closed := make(chan error, 1)
	start := time.Now()
	go func() {
		cctx, ccancel := context.WithTimeout(ctx, 10*time.Second)
		defer ccancel()
		closed <- b.Close(cctx)
	}()
	time.Sleep(50 * time.Millisecond)
	close(kh.keep.reply)
	require.NoError(t, leasetest.Recv(t, closed, "B's Close"))
	took := time.Since(start)
	time.Sleep(200 * time.Millisecond)
	_, after, _ := h.snapshot()
	most := 0
	for _, n := range after {
		most = max(most, n)
	}
	t.Logf("Close took %v (the keep reply held 50 ms of it); leave calls per id after Close began: %d ids, at most %d", took, len(after), most)
	assert.Len(t, after, k, "gone waiters whose leave call was tried after Close")
	assert.LessOrEqual(t, most, 3, "leave calls of one id after Close began")
	require.NoError(t, first.Release(ctx))
	leasetest.Settled(t, 2*time.Second)
}

// TestReviewClose45Races: Close racing Acquire cancellations, grants and
// releases, Redis answering throughout. A holds one lease per key (N = 1)
// and releases each at a random moment; B's waiters (three per key) give
// up at random moments, and those granted hold a random while and
// release; B's Close comes at a random moment. Checks: no Release of B's
// returns ErrLost; once Close has returned and B's Acquire calls have all
// returned, none of B's ids stands in Redis (queued, waiting, or holding
// a lease nobody holds); the state when Close returned is logged.
func TestReviewClose45Races(t *testing.T) {
	const ttl, poll, nk, nw = 600 * time.Millisecond, 50 * time.Millisecond, 4, 3
	rounds := 12
	atClose := 0
	for round := 0; round < rounds; round++ {
		e := leasetest.NewEnv(t)
		ctx := context.Background()
		a := leasetest.SemOn(t, e.Eng, 1, lease.WithTTL(ttl), lease.WithPollInterval(poll))
		eng := leasetest.Direct(t, e, time.Second)
		b, err := lease.New(eng, "partner", 1, lease.WithTTL(ttl), lease.WithPollInterval(poll))
		require.NoError(t, err)
		keys := make([]string, nk)
		var wg sync.WaitGroup
		var lost atomic.Int64
		var firstLost atomic.Value
		for i := range keys {
			keys[i] = fmt.Sprint("r", i)
			l, err := a.Acquire(ctx, keys[i])
			require.NoError(t, err)
			wg.Add(1)
			go func() {
				defer wg.Done()
				time.Sleep(time.Duration(rand.IntN(300)) * time.Millisecond)
				assert.NoError(t, l.Release(ctx))
			}()
		}
		var bwg sync.WaitGroup
		for _, k := range keys {
			for range nw {
				bwg.Add(1)
				go func() {
					defer bwg.Done()
					actx, cancel := context.WithTimeout(ctx, time.Duration(rand.IntN(400))*time.Millisecond)
					defer cancel()
					l, err := b.Acquire(actx, k)
					if err != nil {
						return
					}
					time.Sleep(time.Duration(rand.IntN(100)) * time.Millisecond)
					if err := l.Release(ctx); errors.Is(err, lease.ErrLost) {
						if lost.Add(1) == 1 {
							firstLost.Store(fmt.Sprintf("%s token %d", k, l.Token()))
						}
					}
				}()
			}
		}
		time.Sleep(time.Duration(rand.IntN(350)) * time.Millisecond)
		cctx, ccancel := context.WithTimeout(ctx, 10*time.Second)
		require.NoError(t, b.Close(cctx))
		ccancel()
		var standing []string
		for _, k := range keys {
			_, q, w := sp45State(e, k)
			standing = append(standing, q...)
			standing = append(standing, w...)
		}
		if len(standing) > 0 {
			atClose++
		}
		bwg.Wait()
		wg.Wait()
		time.Sleep(20 * time.Millisecond)
		var left []string
		for _, k := range keys {
			hs, q, w := sp45State(e, k)
			for id := range hs {
				left = append(left, k+" holder "+id)
			}
			left = append(left, q...)
			left = append(left, w...)
		}
		assert.Empty(t, left, "round %d: B's ids standing in Redis once Close and B's Acquire calls returned", round)
		assert.Zero(t, lost.Load(), "round %d: B's Release returned ErrLost (%v)", round, firstLost.Load())
	}
	t.Logf("%d rounds: B's ids queued or waiting in Redis at the moment Close returned (their Acquire's leave call not yet done) in %d", rounds, atClose)
	leasetest.Settled(t, 2*time.Second)
}

// TestReviewClose45FailureAfterCloseBegan: B has k gone waiters on one key
// whose leave calls fail (an error Redis answers: a READONLY during a
// failover, say), so the keeper sends them again each poll, one by one.
// One such call of a keeper round is held at the hook until B's Close
// has begun, then fails; Redis answers every call from then on. The doc
// (sendLeaves): "after Close, every one is tried once". Checks: every
// gone waiter's leave call reaches Redis, and none of B's waiters stands
// in Redis once Close has returned. Control, same run: no call out as
// Close begins.
func TestReviewClose45FailureAfterCloseBegan(t *testing.T) {
	const ttl, poll, k = 3 * time.Second, 100 * time.Millisecond, 3
	run := func(t *testing.T, hold bool) (map[string]int, []string) {
		ctx := context.Background()
		e, h, _, b, first := cl45Gone(t, "f", k, 1, ttl, poll)
		closed := make(chan error, 1)
		cctx, ccancel := context.WithTimeout(ctx, 10*time.Second)
		defer ccancel()
		if hold {
			h.holdNext.Store(true)
			leasetest.Recv(t, h.held, "a keeper round's leave call")
			h.closing.Store(true)
			go func() { closed <- b.Close(cctx) }()
			time.Sleep(50 * time.Millisecond) // Close has begun
			h.mode.Store(0)
			close(h.release)
		} else {
			h.closing.Store(true)
			h.mode.Store(0)
			go func() { closed <- b.Close(cctx) }()
		}
		require.NoError(t, leasetest.Recv(t, closed, "B's Close"))
		left := cl45Standing(e, []string{"f"})
		_, after, ran := h.snapshot()
		t.Logf("call held across Close %v: leave calls per id after Close began %v, run by Redis %v; B's waiters standing once Close returned %v", hold, after, ran, left)
		require.NoError(t, first.Release(ctx))
		return ran, left
	}
	for round := 0; round < 2; round++ {
		ran, left := run(t, false)
		assert.Len(t, ran, k, "control: ids whose leave call Redis ran")
		assert.Empty(t, left, "control: B's waiters standing once Close returned")
		ran, left = run(t, true)
		assert.Len(t, ran, k, "a call failing just after Close began: ids whose leave call Redis ran")
		assert.Empty(t, left, "a call failing just after Close began: B's gone waiters standing in Redis once Close returned")
	}
	leasetest.Settled(t, 2*time.Second)
}
