package closereview_test

// Review of e8dcbe7 (helper-122): a keep call's leave call for a waiter
// granted and released while the call was out carries the released
// lease's token (spare), and leave.lua leaves that lease to its release.
// Each test holds the calls of one process (B) at a go-redis hook, so
// that the events {keep call reaches Redis, grant, Release called,
// release call reaches Redis, keep reply arrives, leave call reaches
// Redis} happen in a chosen order.

import (
	"context"
	"errors"
	"fmt"
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

// sp45Rel tags the test's Release calls (and Close's), so that the hook
// tells a release call from a leave call of four arguments.
type sp45Rel struct{}

// sp45Gate holds one call, once armed: caught gets its ARGV when it
// reaches the hook, and it waits there until open is closed; then it
// fails without being sent (fail), or is sent and its reply is lost
// (lose) or held until reply is closed (if not nil). ran gets its
// outcome at the hook.
type sp45Gate struct {
	armed  atomic.Bool
	caught chan []any
	open   chan struct{}
	fail   error
	lose   error
	ran    chan error
	reply  chan struct{}
}

func newSp45Gate() *sp45Gate {
	return &sp45Gate{caught: make(chan []any, 1), open: make(chan struct{}), ran: make(chan error, 1)}
}

func (g *sp45Gate) pass(ctx context.Context, cmd redis.Cmder, argv []any, next redis.ProcessHook) error {
	g.caught <- argv
	<-g.open
	if g.fail != nil {
		cmd.SetErr(g.fail)
		g.ran <- g.fail
		return g.fail
	}
	err := next(ctx, cmd)
	if err == nil && g.lose != nil {
		err = g.lose
		cmd.SetErr(err)
	}
	g.ran <- err
	if g.reply != nil {
		<-g.reply
	}
	return err
}

// sp45Hook holds, each once armed: the first keep call that refreshes a
// waiter (keep), the test's release call (rel), a leave call with a
// spare token (spare: five arguments), a leave call of four arguments
// (leave: abandon's). wake, if set, runs once after a blocking read that
// returned a wake-up, before it is delivered. spares counts the leave
// calls with a spare token sent.
type sp45Hook struct {
	keep, rel, spare, leave *sp45Gate
	wake                    atomic.Pointer[func()]
	spares                  atomic.Int64
}

func newSp45Hook() *sp45Hook {
	return &sp45Hook{keep: newSp45Gate(), rel: newSp45Gate(), spare: newSp45Gate(), leave: newSp45Gate()}
}

func (h *sp45Hook) DialHook(next redis.DialHook) redis.DialHook { return next }
func (h *sp45Hook) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}
func (h *sp45Hook) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		if cmd.Name() == "blpop" {
			err := next(ctx, cmd)
			if v, ok := cmd.(*redis.StringSliceCmd); ok && err == nil && len(v.Val()) == 2 && strings.Contains(v.Val()[1], " ") {
				if f := h.wake.Swap(nil); f != nil {
					(*f)()
				}
			}
			return err
		}
		argv, _ := leasetest.ScriptArgs(cmd)
		if len(argv) < 4 {
			return next(ctx, cmd)
		}
		var g *sp45Gate
		switch hn, isKeep := argv[3].(int); {
		case isKeep:
			if len(argv) > 4+hn {
				g = h.keep
			}
		case len(argv) == 5:
			if _, ok := argv[4].(int64); ok {
				h.spares.Add(1)
				g = h.spare
			}
		case len(argv) == 4 && ctx.Value(sp45Rel{}) != nil:
			g = h.rel
		case len(argv) == 4:
			g = h.leave
		}
		if g != nil && g.armed.CompareAndSwap(true, false) {
			return g.pass(ctx, cmd, argv, next)
		}
		return next(ctx, cmd)
	}
}

// sp45Orders returns every order of the events K (keep call reaches
// Redis), G (grant, delivered), R (Release called), S (release call
// reaches Redis), P (keep reply arrives) and V (leave call reaches
// Redis), with G<R<S and K<P<V; V is there only when R<P (otherwise no
// leave call is sent).
func sp45Orders() []string {
	var out []string
	var perm func(pre string, rest string)
	perm = func(pre, rest string) {
		if rest == "" {
			at := func(c byte) int { return strings.IndexByte(pre, c) }
			if at('G') < at('R') && at('R') < at('S') && at('K') < at('P') {
				v := at('V')
				if (v < 0 && at('P') < at('R')) || (v >= 0 && at('R') < at('P') && at('P') < v) {
					out = append(out, pre)
				}
			}
			return
		}
		for i := range rest {
			perm(pre+rest[i:i+1], rest[:i]+rest[i+1:])
		}
	}
	perm("", "KGRSPV")
	perm("", "KGRSP")
	return out
}

// sp45State returns the ids in key's holders (with the time Redis holds
// each for), queue and waiters sets.
func sp45State(e *leasetest.Env, key string) (h map[string]time.Duration, q, w []string) {
	ctx := context.Background()
	now := leasetest.RedisNow(e.Rdb)
	zs, _ := e.Rdb.ZRangeWithScores(ctx, e.Key(key, "h"), 0, -1).Result()
	h = map[string]time.Duration{}
	for _, z := range zs {
		h[fmt.Sprint(z.Member)] = leasetest.Ms(int64(z.Score) - now)
	}
	q, _ = e.Rdb.ZRange(ctx, e.Key(key, "q"), 0, -1).Result()
	w, _ = e.Rdb.ZRange(ctx, e.Key(key, "w"), 0, -1).Result()
	return h, q, w
}

// TestReviewSpare45Orders: every order of the six events, with the
// release call sent (ok), its reply lost after it ran (lost), or failing
// unsent (unsent: Redis briefly away), with and without a third waiter
// C (another process) queued behind B's. Checks: B's Acquire gets the
// lease; Release never returns ErrLost (Redis held the lease until the
// release, or, unsent, still holds it); C is never granted before B's
// Release is called, and its token is larger; the lease's expiry in
// Redis never moves after Release is called; and within two polls of the
// last event the holders are only those believed held (C's lease; unsent,
// the lease B released is given back by B's own leave call: until stop
// 49 it lapsed at its TTL), with nobody queued.
func TestReviewSpare45Orders(t *testing.T) {
	const ttl, poll = 3 * time.Second, 100 * time.Millisecond
	orders := sp45Orders()
	t.Logf("%d orders", len(orders))
	runs := 0
	for _, mode := range []string{"ok", "lost", "unsent"} {
		for _, withC := range []bool{false, true} {
			for _, order := range orders {
				name := fmt.Sprintf("%s/C=%v/%s", mode, withC, order)
				t.Run(name, func(t *testing.T) {
					runs++
					sp45Order(t, order, mode, withC, ttl, poll)
				})
			}
		}
	}
	t.Logf("%d runs", runs)
}

func sp45Order(t *testing.T, order, mode string, withC bool, ttl, poll time.Duration) {
	e := leasetest.NewEnv(t)
	ctx := context.Background()
	h := newSp45Hook()
	switch mode {
	case "lost":
		h.rel.lose = leasetest.ErrLostRead
	case "unsent":
		h.rel.fail = leasetest.ErrNotSent
	}
	a := leasetest.SemOn(t, e.Eng, 1, lease.WithTTL(ttl), lease.WithPollInterval(poll))
	b := leasetest.SemOn(t, leasetest.Direct(t, e, 5*time.Second, h), 1, lease.WithTTL(ttl), lease.WithPollInterval(poll))
	require.NoError(t, b.Load(ctx))
	first, err := a.Acquire(ctx, "o")
	require.NoError(t, err)
	actx, cancel := context.WithTimeout(ctx, 20*time.Second)
	defer cancel()
	got := make(chan leasetest.Got, 1)
	leasetest.AcquireAsync(actx, e, b, "b", "o", got)
	e.Queued(t, "o", 1)
	var released atomic.Bool // B's Release has been called
	type cGot struct {
		l      *lease.Lease
		err    error
		before bool // granted before B's Release was called
	}
	cgot := make(chan cGot, 1)
	if withC {
		c := leasetest.SemOn(t, e.Eng, 1, lease.WithTTL(ttl), lease.WithPollInterval(poll))
		go func() {
			l, err := c.Acquire(actx, "o")
			cgot <- cGot{l, err, !released.Load()}
		}()
		e.Queued(t, "o", 2)
	}
	h.keep.reply = make(chan struct{})
	h.keep.armed.Store(true)
	h.rel.armed.Store(true)
	spare := strings.Contains(order, "V")
	h.spare.armed.Store(spare)
	leasetest.Recv(t, h.keep.caught, "the keep call refreshing B's waiter")

	var l *lease.Lease
	var exp0 int64 // the lease's expiry in Redis when Release is called
	relErr := make(chan error, 1)
	for _, ev := range order {
		switch ev {
		case 'K':
			close(h.keep.open)
			require.NoError(t, leasetest.Recv(t, h.keep.ran, "the keep call"))
		case 'G':
			require.NoError(t, first.Release(ctx))
			g := leasetest.Recv(t, got, "B's Acquire")
			require.NoError(t, g.Err)
			l = g.L
		case 'R':
			exp0 = leasetest.Look(ctx, e.Rdb, e, "o", l.Token()).Expiry
			released.Store(true)
			go func() { relErr <- l.Release(context.WithValue(ctx, sp45Rel{}, true)) }()
			leasetest.Recv(t, h.rel.caught, "B's release call")
		case 'S':
			close(h.rel.open)
			leasetest.Recv(t, h.rel.ran, "B's release call")
		case 'P':
			close(h.keep.reply)
			if spare {
				leasetest.Recv(t, h.spare.caught, "B's leave call with the released lease's token")
			}
		case 'V':
			close(h.spare.open)
			leasetest.Recv(t, h.spare.ran, "B's leave call")
		}
	}
	rerr := leasetest.Recv(t, relErr, "B's Release")
	switch mode {
	case "ok":
		assert.NoError(t, rerr, "Release of a lease Redis held until its release call")
	default:
		assert.Error(t, rerr)
		assert.NotErrorIs(t, rerr, lease.ErrLost, "Release of a lease Redis held until its release call")
	}
	seen := leasetest.Look(ctx, e.Rdb, e, "o", l.Token())
	if seen.Held {
		assert.LessOrEqual(t, seen.Expiry, exp0, "B's released lease extended after its Release")
	}
	var c cGot
	if withC {
		c = leasetest.Recv(t, cgot, "C's Acquire")
		require.NoError(t, c.err)
		assert.False(t, c.before, "C granted before B's Release was called (N = 1)")
		assert.Greater(t, c.l.Token(), l.Token())
	}
	// Within a poll of the last event: only the believed holders.
	believed := map[string]bool{}
	if c.l != nil {
		believed[leasetest.Look(ctx, e.Rdb, e, "o", c.l.Token()).ID] = true
	}
	// Unsent, the lease B released is given back by B's own leave call
	// once Redis answers (Release's doc, since stop 49; until then it
	// lapsed at its TTL, with C waiting for it), so no holder is believed
	// but C.
	deadline := time.Now().Add(2 * poll)
	for {
		hs, q, w := sp45State(e, "o")
		stray := map[string]time.Duration{}
		for id, d := range hs {
			if !believed[id] {
				stray[id] = d
			}
		}
		if len(stray) == 0 && len(q) == 0 && len(w) == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Errorf("two polls after the last event: holders nobody believes they hold %v (B's lease %d: %v), queue %v, waiters %v; spare leave calls %d",
				stray, l.Token(), seen.ID, q, w, h.spares.Load())
			break
		}
		time.Sleep(5 * time.Millisecond)
	}
	if c.l != nil {
		assert.NoError(t, c.l.Release(ctx))
	}
}

// TestReviewSpare45AbandonGrantedLeaveFails: B's waiter, refreshed by a
// keep call whose reply is held, is granted (a wake-up) and gives up at
// that moment (its context is cancelled as the wake-up is read), so that
// abandon takes its granted branch: the lease is marked released and its
// leave call (no token) gives it back. That call fails unsent (Redis
// briefly away) and is handed to the keeper (retryLeave). Meanwhile the
// keep reply came, and the keeper is sending the leave call with the
// lease's token (spare) for the same id. The doc: the failed leave call
// is sent again every poll interval until it succeeds. Judged: the key
// is free for another process within a few polls of the failure, against
// a control in the same run where no keep call is out (the failed leave
// call retried by the keeper alone).
//
// Fails at e8dcbe7 (3 of 3 rounds, the key full for the whole TTL): the
// keeper's leave call with the token, sent as abandon's call failed,
// succeeds and deletes the id's leaving entry, which retryLeave had
// replaced meanwhile with one without a token: the retry is never sent.
func TestReviewSpare45AbandonGrantedLeaveFails(t *testing.T) {
	const ttl, poll = 3 * time.Second, 100 * time.Millisecond
	free := map[string][]time.Duration{}
	branches := map[string]int{}
	for round := 0; round < 16 && (len(free["granted"]) < 3 || len(free["control"]) < 3); round++ {
		d, branch := sp45Abandon(t, round%2 == 0, ttl, poll)
		t.Logf("round %d: %s %v", round, branch, d)
		branches[branch]++
		free[branch] = append(free[branch], d)
	}
	t.Logf("rounds by case: %v; time from the failed leave call to the key free (Redis clock): %v (poll %v, TTL %v)",
		branches, free, poll, ttl)
	require.NotEmpty(t, free["control"], "no control round")
	require.NotEmpty(t, free["granted"], "abandon's granted branch never taken with the keep call out")
	var ctl time.Duration
	for _, d := range free["control"] {
		ctl = max(ctl, d)
	}
	for _, d := range free["granted"] {
		assert.Less(t, d, ctl+5*poll, "the lease of a waiter that gave up as it was granted, its leave call failed, stood on after the keeper's retries were due (control: %v)", free["control"])
	}
}

// sp45Abandon runs one round: it returns how long (Redis clock) after the
// failure of abandon's leave call the key was free, and the case:
// "control" (no keep call out), "granted" (abandon's granted branch:
// the keep reply asks for a leave call with the lease's token), "given
// up first" (its other branch), "delivered" (the lease reached the
// caller: no case).
func sp45Abandon(t *testing.T, keepOut bool, ttl, poll time.Duration) (time.Duration, string) {
	t.Helper()
	e := leasetest.NewEnv(t)
	ctx := context.Background()
	h := newSp45Hook()
	h.leave.fail = leasetest.ErrNotSent
	sc := sp45AbandonScene(t, e, h, keepOut, ttl, poll)
	if sc.branch == "delivered" {
		return 0, sc.branch
	}
	close(h.leave.open)
	require.ErrorIs(t, leasetest.Recv(t, h.leave.ran, "abandon's leave call"), leasetest.ErrNotSent)
	failed := leasetest.RedisNow(e.Rdb)
	require.ErrorIs(t, leasetest.Recv(t, sc.got, "B's Acquire").Err, context.Canceled) // abandon has handed its leave call to the keeper
	if keepOut {
		close(h.spare.open)
		require.NoError(t, leasetest.Recv(t, h.spare.ran, "the keeper's leave call"))
	}
	other := leasetest.SemOn(t, e.Eng, 1, lease.WithTTL(ttl))
	for {
		l, ok, err := other.TryAcquire(ctx, "g")
		require.NoError(t, err)
		if ok {
			took := leasetest.Ms(leasetest.RedisNow(e.Rdb) - failed)
			require.NoError(t, l.Release(ctx))
			return took, sc.branch
		}
		if d := leasetest.Ms(leasetest.RedisNow(e.Rdb) - failed); d > ttl+time.Second {
			t.Fatalf("key still full %v after the failed leave call", d)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// sp45Abandoned is where sp45AbandonScene leaves a round.
type sp45Abandoned struct {
	b      *lease.Semaphore
	got    chan leasetest.Got // B's Acquire's outcome
	branch string             // see sp45Abandon
	leave  []any              // abandon's leave call's ARGV, held at h.leave (nil if delivered)
}

// sp45AbandonScene sets the scene of sp45Abandon and sq45CloseAbandon on
// e, with h on B's client: A holds g, B's waiter is queued behind; with
// keepOut, a keep call refreshing it runs and its reply is held. The
// waiter gives up as its wake-up is read, and A releases g. If the lease
// reached the caller first ("delivered") it is released and nothing is
// held; otherwise abandon's leave call is held at h.leave (not yet let
// go) and, with keepOut, the keep reply let go and the keeper's leave
// call held at h.spare, its ARGV telling the branch.
func sp45AbandonScene(t *testing.T, e *leasetest.Env, h *sp45Hook, keepOut bool, ttl, poll time.Duration) sp45Abandoned {
	t.Helper()
	ctx := context.Background()
	a := leasetest.SemOn(t, e.Eng, 1, lease.WithTTL(ttl), lease.WithPollInterval(poll))
	b := leasetest.SemOn(t, leasetest.Direct(t, e, 5*time.Second, h), 1, lease.WithTTL(ttl), lease.WithPollInterval(poll))
	require.NoError(t, b.Load(ctx))
	first, err := a.Acquire(ctx, "g")
	require.NoError(t, err)
	actx, cancel := context.WithCancel(ctx)
	defer cancel()
	got := make(chan leasetest.Got, 1)
	leasetest.AcquireAsync(actx, e, b, "b", "g", got)
	e.Queued(t, "g", 1)
	if keepOut {
		h.keep.reply = make(chan struct{})
		h.keep.armed.Store(true)
		leasetest.Recv(t, h.keep.caught, "the keep call refreshing B's waiter")
		close(h.keep.open)
		require.NoError(t, leasetest.Recv(t, h.keep.ran, "the keep call"))
		h.spare.armed.Store(true)
	}
	h.leave.armed.Store(true)
	f := func() { cancel() } // gives up as the wake-up is read, before it is delivered
	h.wake.Store(&f)
	require.NoError(t, first.Release(ctx))
	sc := sp45Abandoned{b: b, got: got}
	select {
	case g := <-got: // the lease reached the caller first: not this round's case
		require.NoError(t, g.Err)
		h.leave.armed.Store(false)
		h.spare.armed.Store(false)
		require.NoError(t, g.L.Release(ctx))
		if keepOut {
			close(h.keep.reply)
		}
		sc.branch = "delivered"
		return sc
	case sc.leave = <-h.leave.caught: // abandon's (Acquire returns once it is done)
	case <-time.After(10 * time.Second):
		t.Fatal("neither a lease nor a leave call")
	}
	sc.branch = "control"
	if keepOut {
		close(h.keep.reply)
		sa := leasetest.Recv(t, h.spare.caught, "the keeper's leave call")
		sc.branch = "given up first"
		if sa[4] != int64(0) {
			sc.branch = "granted"
		}
		t.Logf("keep reply: the keeper's leave call %v", sa[3:])
	}
	return sc
}

// TestReviewSpare45LapseWhileKeepOut: B's waiter is granted while a keep
// call that refreshed it is out (its reply held, or the call itself held
// before it is sent), and the lease lapses locally (Lost) while it is
// out (the keeper, blocked, extends nothing); the holder then calls
// Release (ErrLost, after Lost). C waits behind. Checks: C is granted
// only once B's Lost has closed; within a poll of the keep reply, the
// holders are only C's lease and nobody is queued.
//
// sent-after-lapse/release=false fails at e8dcbe7 (passes at its
// parent): the keep call, sent after Redis dropped the lease, queues the
// waiter again; its reply no longer asks for a leave call for a waiter
// whose lease lapsed (left to lapseLocked's), and lapseLocked's entry is
// past its until by then, so sendLeaves drops it unsent. The waiter nobody
// waits for stays queued for a TTL, to be granted a lease nobody holds.
func TestReviewSpare45LapseWhileKeepOut(t *testing.T) {
	const ttl, poll = 600 * time.Millisecond, 100 * time.Millisecond
	runs := 0
	for _, how := range []string{"reply-held", "sent-after-lapse", "sent-after-release"} {
		for _, release := range []bool{false, true} {
			t.Run(fmt.Sprintf("%s/release=%v", how, release), func(t *testing.T) {
				runs++
				e := leasetest.NewEnv(t)
				ctx := context.Background()
				h := newSp45Hook()
				a := leasetest.SemOn(t, e.Eng, 1, lease.WithTTL(ttl), lease.WithPollInterval(poll))
				b := leasetest.SemOn(t, leasetest.Direct(t, e, 5*time.Second, h), 1, lease.WithTTL(ttl), lease.WithPollInterval(poll))
				c := leasetest.SemOn(t, e.Eng, 1, lease.WithTTL(ttl), lease.WithPollInterval(poll))
				require.NoError(t, b.Load(ctx))
				first, err := a.Acquire(ctx, "z")
				require.NoError(t, err)
				actx, cancel := context.WithTimeout(ctx, 20*time.Second)
				defer cancel()
				got := make(chan leasetest.Got, 1)
				leasetest.AcquireAsync(actx, e, b, "b", "z", got)
				e.Queued(t, "z", 1)
				var bl atomic.Pointer[lease.Lease]
				type cGot struct {
					l      *lease.Lease
					err    error
					before bool
				}
				cgot := make(chan cGot, 1)
				go func() {
					l, err := c.Acquire(actx, "z")
					b := bl.Load()
					cgot <- cGot{l, err, b == nil || !leasetest.IsLost(b)}
				}()
				e.Queued(t, "z", 2)
				h.keep.reply = make(chan struct{})
				h.keep.armed.Store(true)
				leasetest.Recv(t, h.keep.caught, "the keep call refreshing B's waiter")
				if how == "reply-held" {
					close(h.keep.open)
					require.NoError(t, leasetest.Recv(t, h.keep.ran, "the keep call"))
				}
				require.NoError(t, first.Release(ctx))
				g := leasetest.Recv(t, got, "B's Acquire")
				require.NoError(t, g.Err)
				bl.Store(g.L)
				leasetest.Recv(t, g.L.Lost(), "B's Lost (no extension while the keeper is blocked)")
				var rerr error
				if release {
					rerr = g.L.Release(context.WithValue(ctx, sp45Rel{}, true))
					if !errors.Is(rerr, lease.ErrLost) {
						t.Errorf("Release after Lost: %v, want ErrLost", rerr)
					}
				}
				if how == "sent-after-lapse" || how == "sent-after-release" {
					if how == "sent-after-lapse" {
						time.Sleep(ttl) // Redis has dropped the lease too
					}
					close(h.keep.open)
					require.NoError(t, leasetest.Recv(t, h.keep.ran, "the keep call"))
				}
				close(h.keep.reply)
				cg := leasetest.Recv(t, cgot, "C's Acquire")
				require.NoError(t, cg.err)
				assert.False(t, cg.before, "C granted while B's lease was believed held (Lost open)")
				cid := leasetest.Look(ctx, e.Rdb, e, "z", cg.l.Token()).ID
				deadline := time.Now().Add(poll)
				for {
					hs, q, w := sp45State(e, "z")
					delete(hs, cid)
					if len(hs) == 0 && len(q) == 0 && len(w) == 0 {
						break
					}
					if time.Now().After(deadline) {
						t.Errorf("a poll after the keep reply: holders nobody believes they hold %v, queue %v, waiters %v (Release: %v)", hs, q, w, rerr)
						break
					}
					time.Sleep(5 * time.Millisecond)
				}
				require.NoError(t, cg.l.Release(ctx))
			})
		}
	}
	t.Logf("%d runs", runs)
}

// TestReviewSpare45CloseRaces: B's Close at each point of an order of
// the events (keep call out, grant, Release, release call, keep reply,
// leave call), the held calls then let go. Checks: Close returns within
// its context; B's Release never returns ErrLost; once Close has
// returned, no id of B's is held, queued or waiting in Redis (leave
// calls after Close are tried once, and these succeed); and no goroutine
// of package lease is left 2 s after every Semaphore is closed.
func TestReviewSpare45CloseRaces(t *testing.T) {
	const ttl, poll = 3 * time.Second, 100 * time.Millisecond
	runs := 0
	for _, order := range []string{"KGRPSV", "GRKPVS", "GRSKPV", "KGPRS"} {
		for at := 0; at <= len(order); at++ {
			t.Run(fmt.Sprintf("%s/close@%d", order, at), func(t *testing.T) {
				runs++
				sp45Close(t, order, at, ttl, poll)
			})
		}
	}
	t.Logf("%d runs", runs)
}

func sp45Close(t *testing.T, order string, at int, ttl, poll time.Duration) {
	e := leasetest.NewEnv(t)
	ctx := context.Background()
	h := newSp45Hook()
	a, err := lease.New(e.Eng, "partner", 1, lease.WithTTL(ttl), lease.WithPollInterval(poll))
	require.NoError(t, err)
	b, err := lease.New(leasetest.Direct(t, e, 5*time.Second, h), "partner", 1, lease.WithTTL(ttl), lease.WithPollInterval(poll))
	require.NoError(t, err)
	t.Cleanup(func() {
		cctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_ = a.Close(cctx)
		_ = b.Close(cctx)
	})
	require.NoError(t, b.Load(ctx))
	first, err := a.Acquire(ctx, "x")
	require.NoError(t, err)
	actx, cancel := context.WithTimeout(ctx, 20*time.Second)
	defer cancel()
	got := make(chan leasetest.Got, 1)
	leasetest.AcquireAsync(actx, e, b, "b", "x", got)
	e.Queued(t, "x", 1)
	h.keep.reply = make(chan struct{})
	h.keep.armed.Store(true)
	h.rel.armed.Store(true)
	h.spare.armed.Store(strings.Contains(order, "V"))
	proc := fmt.Sprint(leasetest.Recv(t, h.keep.caught, "the keep call refreshing B's waiter")[0]) + "."
	closed := make(chan error, 1)
	var l *lease.Lease
	relErr := make(chan error, 1)
	relCalled := false
	opened := map[byte]bool{}
	open := func(ev byte) {
		if opened[ev] {
			return
		}
		opened[ev] = true
		switch ev {
		case 'K':
			close(h.keep.open)
		case 'S':
			close(h.rel.open)
		case 'P':
			close(h.keep.reply)
		case 'V':
			close(h.spare.open)
		}
	}
	closing := false
	for i := 0; i <= len(order); i++ {
		if i == at {
			closing = true
			cctx, ccancel := context.WithTimeout(context.WithValue(ctx, sp45Rel{}, true), 10*time.Second)
			go func() { closed <- b.Close(cctx); ccancel() }()
			time.Sleep(20 * time.Millisecond)
		}
		if i == len(order) {
			break
		}
		ev := order[i]
		if closing {
			// The rest go without waiting on each: Close may have made
			// some of them moot.
			switch ev {
			case 'G':
				require.NoError(t, first.Release(ctx))
			case 'R':
				if l != nil {
					relCalled = true
					go func() { relErr <- l.Release(context.WithValue(ctx, sp45Rel{}, true)) }()
				}
			default:
				open(ev)
			}
			continue
		}
		switch ev {
		case 'K':
			open('K')
			require.NoError(t, leasetest.Recv(t, h.keep.ran, "the keep call"))
		case 'G':
			require.NoError(t, first.Release(ctx))
			g := leasetest.Recv(t, got, "B's Acquire")
			require.NoError(t, g.Err)
			l = g.L
		case 'R':
			relCalled = true
			go func() { relErr <- l.Release(context.WithValue(ctx, sp45Rel{}, true)) }()
			leasetest.Recv(t, h.rel.caught, "B's release call")
		case 'S':
			open('S')
			leasetest.Recv(t, h.rel.ran, "B's release call")
		case 'P':
			open('P')
			if strings.Contains(order, "V") {
				leasetest.Recv(t, h.spare.caught, "the leave call with the token")
			}
		case 'V':
			open('V')
			leasetest.Recv(t, h.spare.ran, "the leave call")
		}
	}
	for _, ev := range []byte("KSPV") { // anything still held goes now
		open(ev)
	}
	assert.NoError(t, leasetest.Recv(t, closed, "B's Close"), "B's Close")
	var bErr error
	if l == nil {
		g := leasetest.Recv(t, got, "B's Acquire")
		bErr = g.Err
		l = g.L
	}
	if relCalled {
		assert.NotErrorIs(t, leasetest.Recv(t, relErr, "B's Release"), lease.ErrLost, "B's Release")
	}
	hs, q, w := sp45State(e, "x")
	var left []string
	for id, d := range hs {
		if strings.HasPrefix(id, proc) {
			left = append(left, fmt.Sprint("held ", id, " ", d))
		}
	}
	for _, id := range append(q, w...) {
		if strings.HasPrefix(id, proc) {
			left = append(left, "queued "+id)
		}
	}
	assert.Empty(t, left, "B's ids in Redis once Close (and B's Release) returned (B's Acquire: %v)", bErr)
	cctx, ccancel := context.WithTimeout(ctx, 5*time.Second)
	defer ccancel()
	require.NoError(t, a.Close(cctx))
	leasetest.Settled(t, 2*time.Second)
}
