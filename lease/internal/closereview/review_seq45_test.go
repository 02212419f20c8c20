package closereview_test

// Review of e8dcbe7 and 9c014e6 (helper-123): numbered leaving entries
// (gone.seq) and the keeper's leave calls with a spare token. The rigs
// are helper-122's (review_spare45_test.go): a go-redis hook holds or
// fails chosen script calls of one process (B).

import (
	"context"
	"sort"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/slotbook/slotbook/lease"
	"github.com/slotbook/slotbook/lease/internal/leasetest"
)

// TestReviewSeq45CloseDropsReplacedLeave: abandon's granted branch as in
// TestReviewSpare45AbandonGrantedLeaveFails: B's waiter gives up as its
// grant is read while a keep call that refreshed it is out; the keep
// reply asks for a leave call with the lease's token (spare), held at
// the hook; abandon's own leave call (no token) fails (an error Redis
// answers, which leaves the engine's breaker closed) and is
// handed to the keeper (retryLeave), replacing the entry (a new seq).
// Then B's Close begins, and the held leave call with the token is let
// go and succeeds. The doc (sendLeaves): "after Close, every one is
// tried once". Abandon's leave call, pending at Close, must be tried:
// once Close has returned, B's id holds no lease in Redis. Control, in
// the same run: no keep call out (the keeper holds abandon's entry
// alone at Close).
func TestReviewSeq45CloseDropsReplacedLeave(t *testing.T) {
	const ttl, poll = 3 * time.Second, 100 * time.Millisecond
	got := map[string]int{}
	for round := 0; round < 16 && (got["granted"] < 2 || got["control"] < 2); round++ {
		branch, left := sq45CloseAbandon(t, round%2 == 0, ttl, poll)
		t.Logf("round %d: %s: B's abandoned lease in Redis once Close returned: %v", round, branch, left)
		got[branch]++
		if branch == "granted" || branch == "control" {
			assert.Zero(t, left, "%s: the lease of a waiter that gave up as it was granted (its leave call failed before Close) still stands once Close returned", branch)
		}
	}
	t.Logf("rounds by case: %v", got)
	require.NotZero(t, got["granted"], "abandon's granted branch never taken with the keep call out")
	require.NotZero(t, got["control"], "no control round")
}

// sq45CloseAbandon runs one round of TestReviewSeq45CloseDropsReplacedLeave
// and returns its case (see sp45Abandon) and how long Redis still holds
// B's waiter's lease once Close returned (0: none).
func sq45CloseAbandon(t *testing.T, keepOut bool, ttl, poll time.Duration) (string, time.Duration) {
	t.Helper()
	e := leasetest.NewEnv(t)
	ctx := context.Background()
	h := newSp45Hook()
	// An error Redis answers (as a READONLY or BUSY would): it leaves the
	// engine's breaker closed, so that the calls after it reach Redis.
	h.leave.fail = e.Rdb.Eval(ctx, "return redis.error_reply('ERR injected: leave refused')", nil).Err()
	require.Error(t, h.leave.fail)
	sc := sp45AbandonScene(t, e, h, keepOut, ttl, poll)
	if sc.branch == "delivered" {
		return sc.branch, 0
	}
	id, _ := sc.leave[3].(string)
	close(h.leave.open)
	require.Equal(t, h.leave.fail, leasetest.Recv(t, h.leave.ran, "abandon's leave call"))
	require.ErrorIs(t, leasetest.Recv(t, sc.got, "B's Acquire").Err, context.Canceled) // retryLeave has run
	closed := make(chan error, 1)
	cctx, ccancel := context.WithTimeout(ctx, 10*time.Second)
	defer ccancel()
	go func() { closed <- sc.b.Close(cctx) }()
	time.Sleep(50 * time.Millisecond) // Close has begun
	if keepOut {
		close(h.spare.open)
		require.NoError(t, leasetest.Recv(t, h.spare.ran, "the keeper's leave call"))
	}
	require.NoError(t, leasetest.Recv(t, closed, "B's Close"))
	hs, _, _ := sp45State(e, "g")
	return sc.branch, hs[id]
}

// sq45Counter is a hook on B's client: it counts B's leave calls per id
// (with the time of each, Redis-clock-free: since base) and, while
// failing is set, answers them with a Redis error instead of running
// them.
type sq45Counter struct {
	mu      sync.Mutex
	calls   map[string][]time.Duration
	base    time.Time
	failing atomic.Bool
}

func (c *sq45Counter) DialHook(next redis.DialHook) redis.DialHook { return next }
func (c *sq45Counter) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}
func (c *sq45Counter) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		argv, _ := leasetest.ScriptArgs(cmd)
		if len(argv) < 4 {
			return next(ctx, cmd)
		}
		id, isID := argv[3].(string)
		leave := isID && (len(argv) == 5 || len(argv) == 4 && ctx.Value(sp45Rel{}) == nil)
		if !leave {
			return next(ctx, cmd)
		}
		c.mu.Lock()
		c.calls[id] = append(c.calls[id], time.Since(c.base))
		c.mu.Unlock()
		if c.failing.Load() {
			sub := redis.NewCmd(ctx, "eval", "return redis.error_reply('ERR injected: leave refused')", 0)
			_ = next(ctx, sub)
			cmd.SetErr(sub.Err())
			return sub.Err()
		}
		return next(ctx, cmd)
	}
}

// TestReviewSeq45LeaveCallsPerWaiter: B's waiters give up, and every
// leave call of B's is refused (an error Redis answers) from then on.
// The doc: the keeper sends a failed leave call again every poll
// interval until it succeeds or the TTL has passed. Counted, per gone
// waiter, the leave calls sent and when the last went, in three cases
// run one after another: "plain" (a waiter cancelled while queued, no keep
// call out: the control), "keep-out" (cancelled while a keep call that
// refreshed it is out: the keep reply asks for a leave call again, with
// a new seq), and "many" (five waiters cancelled together). Checks: no
// case sends more than the control's count plus two per waiter, nor
// after the control's last call plus three polls (the doc's one call a
// poll for a TTL where it allows more); and the keeper of
// every case stops (its Semaphore's goroutines end within 2 s of Close).
func TestReviewSeq45LeaveCallsPerWaiter(t *testing.T) {
	const ttl, poll = 900 * time.Millisecond, 50 * time.Millisecond
	type res struct {
		counts []int
		last   time.Duration // latest leave call, after the first failure
	}
	run := func(t *testing.T, how string) res {
		e := leasetest.NewEnv(t)
		ctx := context.Background()
		c := &sq45Counter{calls: map[string][]time.Duration{}, base: time.Now()}
		kh := newSp45Hook()
		a := leasetest.SemOn(t, e.Eng, 1, lease.WithTTL(ttl), lease.WithPollInterval(poll))
		eng := leasetest.Direct(t, e, 5*time.Second, kh, c)
		b, err := lease.New(eng, "partner", 1, lease.WithTTL(ttl), lease.WithPollInterval(poll))
		require.NoError(t, err)
		require.NoError(t, b.Load(ctx))
		first, err := a.Acquire(ctx, "n")
		require.NoError(t, err)
		n := 1
		if how == "many" {
			n = 5
		}
		actx, cancel := context.WithCancel(ctx)
		got := make(chan leasetest.Got, n)
		for i := 0; i < n; i++ {
			leasetest.AcquireAsync(actx, e, b, "b", "n", got)
			e.Queued(t, "n", int64(i+1))
		}
		if how == "keep-out" {
			kh.keep.reply = make(chan struct{})
			kh.keep.armed.Store(true)
			leasetest.Recv(t, kh.keep.caught, "the keep call refreshing B's waiter")
			close(kh.keep.open)
			require.NoError(t, leasetest.Recv(t, kh.keep.ran, "the keep call"))
		}
		c.failing.Store(true)
		c.mu.Lock()
		c.base = time.Now()
		c.mu.Unlock()
		cancel()
		for i := 0; i < n; i++ {
			require.ErrorIs(t, leasetest.Recv(t, got, "B's Acquire").Err, context.Canceled)
		}
		if how == "keep-out" {
			close(kh.keep.reply)
		}
		time.Sleep(2*ttl + 4*poll)
		var r res
		c.mu.Lock()
		for _, ts := range c.calls {
			r.counts = append(r.counts, len(ts))
			r.last = max(r.last, ts[len(ts)-1])
		}
		c.mu.Unlock()
		sort.Ints(r.counts)
		require.NoError(t, first.Release(ctx))
		cctx, ccancel := context.WithTimeout(ctx, 5*time.Second)
		defer ccancel()
		start := time.Now()
		require.NoError(t, b.Close(cctx))
		t.Logf("%s: leave calls per gone waiter %v, the last %v after the first failure (TTL %v, poll %v); Close took %v",
			how, r.counts, r.last, ttl, poll, time.Since(start))
		return r
	}
	// The bounds are the control's, or the doc's where that is higher: on
	// a starved machine the control's keeper, run before the others, was
	// held back and sent 15 calls where the next case sent 19, fewer than
	// the doc allows (one a poll for a TTL).
	byDoc := int(ttl/poll) + 1
	for round := 0; round < 2; round++ {
		ctl := run(t, "plain")
		require.NotEmpty(t, ctl.counts)
		most := max(ctl.counts[len(ctl.counts)-1], byDoc) + 2
		for _, how := range []string{"keep-out", "many"} {
			r := run(t, how)
			require.NotEmpty(t, r.counts, how)
			assert.LessOrEqual(t, r.counts[len(r.counts)-1], most, "%s: leave calls for one gone waiter (control %v, the doc's %d)", how, ctl.counts, byDoc)
			assert.LessOrEqual(t, r.last, max(ctl.last, ttl)+3*poll, "%s: a leave call after the TTL (control's last %v)", how, ctl.last)
		}
	}
	leasetest.Settled(t, 2*time.Second)
}

// sq45Hang makes B's leave calls fail (an error Redis answers) while
// failing is set, and the first after hang is set hang until its context
// ends (one slow reply),
// counting those that reach it after Close has begun (after).
type sq45Hang struct {
	failing, hang, closing atomic.Bool
	after                  sync.Map // id -> *atomic.Int64
	hung                   atomic.Value
}

// hungID reports whether id's leave call was the one that hung.
func (c *sq45Hang) hungID(id string) bool { v, _ := c.hung.Load().(string); return v == id }

func (c *sq45Hang) DialHook(next redis.DialHook) redis.DialHook { return next }
func (c *sq45Hang) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}
func (c *sq45Hang) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		argv, _ := leasetest.ScriptArgs(cmd)
		id, isID := "", false
		if len(argv) >= 4 {
			id, isID = argv[3].(string)
		}
		if !isID || !(len(argv) == 5 || len(argv) == 4 && ctx.Value(sp45Rel{}) == nil) {
			return next(ctx, cmd)
		}
		if c.closing.Load() {
			n, _ := c.after.LoadOrStore(id, new(atomic.Int64))
			n.(*atomic.Int64).Add(1)
		}
		switch {
		case c.hang.CompareAndSwap(true, false):
			c.hung.Store(id)
			<-ctx.Done()
			cmd.SetErr(ctx.Err())
			return ctx.Err()
		case c.failing.Load():
			sub := redis.NewCmd(ctx, "eval", "return redis.error_reply('ERR injected: leave refused')", 0)
			_ = next(ctx, sub)
			cmd.SetErr(sub.Err())
			return sub.Err()
		}
		return next(ctx, cmd)
	}
}

// TestReviewSeq45CloseWithLeavesOut: B has k gone waiters whose leave
// calls failed (so the keeper holds their entries); then the first of
// B's leave calls to go out after Close begins hangs until its context
// ends (one slow reply: Redis answers the others), and B's Close is
// called. The doc (sendLeaves): after Close, each is tried until its
// call reaches Redis; the hung call ends with its context's error before
// it is written, which the engine reports as a call that reached no Redis
// (ErrUnavailable without ErrReplyLost). Checks: every pending leave call
// reaches the client exactly once after Close began, the hung one twice
// (until stop 47 it was not sent again, and its waiter stood); with k = 6
// Close takes no longer than with k = 1 (the control, same run) plus a
// second; once Close has returned, none of B's ids stands in Redis
// (queued, or holding a lease nobody holds); no goroutine of package
// lease is left 2 s after Close.
func TestReviewSeq45CloseWithLeavesOut(t *testing.T) {
	const ttl, poll = 3 * time.Second, 100 * time.Millisecond
	run := func(t *testing.T, k int, engTimeout time.Duration) time.Duration {
		e := leasetest.NewEnv(t)
		ctx := context.Background()
		c := &sq45Hang{}
		a := leasetest.SemOn(t, e.Eng, 1, lease.WithTTL(ttl), lease.WithPollInterval(poll))
		b, err := lease.New(leasetest.Direct(t, e, engTimeout, c), "partner", 1, lease.WithTTL(ttl), lease.WithPollInterval(poll))
		require.NoError(t, err)
		require.NoError(t, b.Load(ctx))
		first, err := a.Acquire(ctx, "c")
		require.NoError(t, err)
		actx, cancel := context.WithCancel(ctx)
		got := make(chan leasetest.Got, k)
		for i := 0; i < k; i++ {
			leasetest.AcquireAsync(actx, e, b, "b", "c", got)
			e.Queued(t, "c", int64(i+1))
		}
		c.failing.Store(true)
		cancel()
		for i := 0; i < k; i++ {
			require.ErrorIs(t, leasetest.Recv(t, got, "B's Acquire").Err, context.Canceled)
		}
		c.hang.Store(true)
		c.closing.Store(true)
		c.failing.Store(false) // from now on Redis answers every leave call but the one that hangs
		cctx, ccancel := context.WithTimeout(ctx, 30*time.Second)
		defer ccancel()
		start := time.Now()
		assert.NoError(t, b.Close(cctx))
		took := time.Since(start)
		counts := map[string]int64{}
		c.after.Range(func(id, n any) bool { counts[id.(string)] = n.(*atomic.Int64).Load(); return true })
		t.Logf("k = %d, engine timeout %v: Close took %v; leave calls per id after Close began %v", k, engTimeout, took, counts)
		assert.Len(t, counts, k, "gone waiters whose leave call was tried after Close")
		for id, n := range counts {
			want := int64(1)
			if c.hungID(id) {
				want = 2 // it reached no Redis: sent again
			}
			assert.Equal(t, want, n, "leave calls of %s after Close began (hung: %v)", id, c.hungID(id))
		}
		_, q, w := sp45State(e, "c")
		assert.Empty(t, append(q, w...), "B's gone waiters still queued in Redis once Close returned (after one slow leave reply), k = %d", k)
		require.NoError(t, first.Release(ctx))
		return took
	}
	for _, to := range []time.Duration{50 * time.Millisecond, time.Second} {
		ctl := run(t, 1, to)
		many := run(t, 6, to)
		assert.Less(t, many, ctl+time.Second, "Close with 6 leave calls hanging, against 1 (engine timeout %v)", to)
	}
	leasetest.Settled(t, 2*time.Second)
}
