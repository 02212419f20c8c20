package leasereview_test

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
			sp45Wait(t, leave.caught, "B's leave call (abandon's)")
		}
		rel.armed.Store(true)
		closed := make(chan error, 1)
		cctx, ccancel := context.WithTimeout(ctx, 10*time.Second)
		defer ccancel()
		go func() { closed <- b.Close(cctx) }()
		sp45Wait(t, rel.caught, "Close's release of h") // Close is under way
		if byClose {
			sp45Wait(t, leave.caught, "B's leave call (the closed Acquire's)")
		}
		before := leave.tries.Load()
		close(leave.open)
		require.ErrorIs(t, sp45Wait(t, acq, "B's Acquire"), want)
		close(rel.open)
		require.NoError(t, sp45Wait(t, closed, "B's Close"))
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
