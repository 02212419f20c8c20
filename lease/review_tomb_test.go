package lease_test

// Review of 39656c1 (leave tombstones, :lease:l) and 98ad61c (the waker's
// drain script and HoldConnWait), through the public API only.

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/slotbook/slotbook/lease"
	"github.com/slotbook/slotbook/lease/internal/leasetest"
	"github.com/slotbook/slotbook/throttle"
)

// rtIsDrain tells the waker's drain call: a script with no ARGV whose
// keys are wake-up lists, the last the waker's own.
func rtIsDrain(cmd redis.Cmder) bool {
	argv, keys := leasetest.ScriptArgs(cmd)
	return len(keys) >= 2 && len(argv) == 0 && strings.Contains(keys[len(keys)-1], ":lease:wake:")
}

// rtDrainDrop, once armed, runs the next drain call after delay, then
// reports its reply lost (a read timeout): the entries it popped are gone.
type rtDrainDrop struct {
	armed   atomic.Bool
	delay   time.Duration
	dropped atomic.Int64
}

func (h *rtDrainDrop) DialHook(next redis.DialHook) redis.DialHook { return next }
func (h *rtDrainDrop) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		if !rtIsDrain(cmd) || !h.armed.Load() {
			return next(ctx, cmd)
		}
		time.Sleep(h.delay)
		if err := next(ctx, cmd); err != nil {
			return err
		}
		if v, ok := cmd.(interface{ Val() any }); ok {
			if a, ok := v.Val().([]any); ok && len(a) > 0 {
				h.armed.Store(false)
				h.dropped.Add(int64(len(a) / 2))
			}
		}
		err := leasetest.ErrLostRead
		cmd.SetErr(err)
		return err
	}
}
func (h *rtDrainDrop) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}

// TestReviewTombDrainReplyLost: A (a waker, 2 s poll) waits on 6 keys held
// by B; B releases them together; the waker's BLPOP pops one wake-up and
// its drain pops the others, but the drain's reply is lost. The grants
// are in Redis (tokens), so the keepers' polls must still find them:
// every waiter served within about a poll, none stranded, nothing left.
func TestReviewTombDrainReplyLost(t *testing.T) {
	e := leasetest.NewEnv(t)
	ctx := context.Background()
	const n, poll, ttl = 6, 2 * time.Second, 30 * time.Second
	drop := &rtDrainDrop{delay: 100 * time.Millisecond}
	engA := leasetest.Direct(t, e, 5*time.Second, drop)
	a := leasetest.SemOn(t, engA, 1, lease.WithTTL(ttl), lease.WithPollInterval(poll))
	b := leasetest.SemOn(t, e.Eng, 1, lease.WithTTL(ttl))
	require.NoError(t, a.Load(ctx))
	q := queueBehind(t, e, a, b, "d", n, 5*poll)
	time.Sleep(300 * time.Millisecond) // a read names every key
	drop.armed.Store(true)
	start := time.Now()
	q.releaseAll(t)
	var took []time.Duration
	for range n {
		select {
		case at := <-q.got:
			took = append(took, at.Sub(start))
		case err := <-q.errs:
			t.Fatalf("a live waiter was refused: %v (took so far %v, drain entries dropped %d)", err, took, drop.dropped.Load())
		}
	}
	slices.Sort(took)
	t.Logf("drain entries dropped %d; woken after %v", drop.dropped.Load(), took)
	require.Less(t, took[n-1], poll+time.Second, "a grant whose drained wake-up was lost waited past a poll")
	require.NoError(t, a.Close(ctx))
	require.NoError(t, b.Close(ctx))
	e.NoGhosts(t, q.keys)
	leasetest.Settled(t, 2*time.Second)
}

// TestReviewTombLateAcquire: the acquire call of a waiter that gave up
// reaches Redis after its leave call, later than the TTL: the tombstone
// has expired, so the waiter is queued again and granted a lease nobody
// holds. (TestAcquireOvertakenByItsLeave does the same within the TTL.)
// The ghost is bounded by the TTL; this shows the tombstone's reach.
// (Kept, by the author of 39656c1, as a check of that bound: the lease
// nobody holds lapses within its TTL, and k is free again then.)
func TestReviewTombLateAcquire(t *testing.T) {
	e := leasetest.NewEnv(t)
	ctx := context.Background()
	const ttl = 300 * time.Millisecond
	o := &overtaken{mark: "wait", late: e.Srv.Client(t), delay: ttl + 150*time.Millisecond, arrived: make(chan struct{})}
	engA := leasetest.Direct(t, e, 5*time.Second, o)
	a := leasetest.SemOn(t, engA, 1, lease.WithTTL(ttl))
	b := leasetest.SemOn(t, e.Eng, 1, lease.WithTTL(ttl))
	held, err := b.Acquire(ctx, "k")
	require.NoError(t, err)
	o.armed.Store(true)
	actx, cancel := context.WithTimeout(ctx, 50*time.Millisecond)
	_, err = a.Acquire(actx, "k")
	cancel()
	require.Error(t, err)
	<-o.arrived
	require.NoError(t, held.Release(ctx))
	time.Sleep(20 * time.Millisecond)
	hs := e.Rdb.ZRange(ctx, e.Key("k", "h"), 0, -1).Val()
	t.Logf("holders of k nobody holds right after the release (acquire call %v after its leave, TTL %v): %v", o.delay, ttl, hs)
	// Within the TTL (and the sweep of the next call), k is free again.
	require.Eventually(t, func() bool {
		l, ok, err := b.TryAcquire(ctx, "k")
		if err != nil || !ok {
			return false
		}
		return l.Release(ctx) == nil
	}, ttl+500*time.Millisecond, 10*time.Millisecond, "k not free again within the TTL")
}

// TestReviewTombBusyPoolHold: A on a pool of 2 (the waker may hold 1),
// its reads 50 ms long (ReadTimeout 100 ms), so that the waker's wait for
// a connection often ends as one frees, while 6 goroutines keep the pool
// busy with TryAcquire/Release. Waiters on other keys are woken by
// releases of B meanwhile (10 s poll). Checked: the load's calls are
// served; every waiter is woken well inside the poll, during the load and
// after it (a token or a blocking count held for ever would leave the
// waker unable to read: the poll alone); nothing is left after Close.
func TestReviewTombBusyPoolHold(t *testing.T) {
	e := leasetest.NewEnv(t)
	ctx := context.Background()
	const poll, ttl = 10 * time.Second, 30 * time.Second
	_, engA := leasetest.Proxied(t, e, 2*time.Second, func(o *redis.Options) {
		o.PoolSize = 2
		o.ReadTimeout = 100 * time.Millisecond
		o.WriteTimeout = 100 * time.Millisecond
	})
	a := leasetest.SemOn(t, engA, 1, lease.WithTTL(ttl), lease.WithPollInterval(poll))
	b := leasetest.SemOn(t, e.Eng, 1, lease.WithTTL(ttl))

	var keys []string
	wakeOnce := func(key string) time.Duration {
		keys = append(keys, key)
		held, err := b.Acquire(ctx, key)
		require.NoError(t, err)
		got := make(chan time.Time, 1)
		gerr := make(chan error, 1)
		go func() {
			actx, cancel := context.WithTimeout(ctx, 2*poll)
			defer cancel()
			l, err := a.Acquire(actx, key)
			if err != nil {
				gerr <- err
				return
			}
			got <- time.Now()
			_ = l.Release(ctx)
		}()
		e.Queued(t, key, 1)
		time.Sleep(300 * time.Millisecond)
		start := time.Now()
		require.NoError(t, held.Release(ctx))
		select {
		case at := <-got:
			return at.Sub(start)
		case err := <-gerr:
			t.Fatalf("waiter on %s: %v", key, err)
		}
		return 0
	}
	control := wakeOnce("c")

	stop := make(chan struct{})
	var wg sync.WaitGroup
	var loadOK, loadErr atomic.Int64
	var firstErr atomic.Value
	for g := range 6 {
		wg.Go(func() {
			key := fmt.Sprint("load", g)
			for {
				select {
				case <-stop:
					return
				default:
				}
				cctx, cancel := context.WithTimeout(ctx, time.Second)
				l, ok, err := a.TryAcquire(cctx, key)
				if err == nil && ok {
					err = l.Release(cctx)
				}
				cancel()
				if err != nil && !errors.Is(err, lease.ErrClosed) {
					if loadErr.Add(1) == 1 {
						firstErr.Store(err.Error())
					}
				} else {
					loadOK.Add(1)
				}
			}
		})
	}
	var took []time.Duration
	for i := range 6 {
		took = append(took, wakeOnce(fmt.Sprint("w", i)))
	}
	close(stop)
	wg.Wait()
	time.Sleep(200 * time.Millisecond)
	after := wakeOnce("after")
	t.Logf("control %v; under load %v; after %v; load calls ok %d, failed %d (%v)", control, took, after, loadOK.Load(), loadErr.Load(), firstErr.Load())
	require.Greater(t, loadOK.Load(), int64(50), "the busy pool's calls starved")
	for i, d := range took {
		require.Less(t, d, poll/2, "waiter %d woken %v after the release under load (control %v, poll %v)", i, d, control, poll)
	}
	require.Less(t, after, 10*control+500*time.Millisecond, "after the load the waker no longer reads (token or blocking count kept?)")
	require.NoError(t, a.Close(ctx))
	require.NoError(t, b.Close(ctx))
	e.NoGhosts(t, keys)
	leasetest.Settled(t, 2*time.Second)
}

var _ = throttle.ErrReplyLost

// TestReviewTombShortReadTimeout: blockBound keeps a read at half the
// client's ReadTimeout (here 100 ms: reads of 50 ms) so that the client
// never gives up on it. Redis times blocked clients out on its own cron
// (hz 10: every 100 ms), so on an idle server a 50 ms BLPOP can answer
// after the client's ReadTimeout: the read fails, the connection is
// dropped, and the waker sleeps a whole maxBlock (1 s) before reading
// again. A waiter is then woken up to a second after its release, against
// a few ms for a process on the default ReadTimeout (same run, same
// server, 10 s poll).
func TestReviewTombShortReadTimeout(t *testing.T) {
	e := leasetest.NewEnv(t)
	const poll, ttl = 10 * time.Second, 30 * time.Second
	var blpops, failed atomic.Int64
	hook := leasetest.Hook{After: func(cmd redis.Cmder, took time.Duration) {
		if cmd.Name() == "blpop" {
			blpops.Add(1)
			if c, ok := cmd.(*redis.StringSliceCmd); ok && len(c.Val()) == 0 && took >= 90*time.Millisecond {
				failed.Add(1)
			}
		}
	}}
	errHook := &rtErrs{}
	_, engShort := leasetest.Proxied(t, e, 2*time.Second, func(o *redis.Options) { o.ReadTimeout = 100 * time.Millisecond }, hook, errHook)
	_, engCtl := leasetest.Proxied(t, e, 2*time.Second, nil)
	short := leasetest.SemOn(t, engShort, 1, lease.WithTTL(ttl), lease.WithPollInterval(poll))
	ctl := leasetest.SemOn(t, engCtl, 1, lease.WithTTL(ttl), lease.WithPollInterval(poll))
	b := leasetest.SemOn(t, e.Eng, 1, lease.WithTTL(ttl))
	wake := func(s *lease.Semaphore, key string) time.Duration {
		return wakeAfter(t, e, b, s, key, 700*time.Millisecond, poll)
	}
	var ctlTook, shortTook []time.Duration
	for i := range 4 {
		ctlTook = append(ctlTook, wake(ctl, fmt.Sprint("ctl", i)))
		shortTook = append(shortTook, wake(short, fmt.Sprint("short", i)))
	}
	slices.Sort(ctlTook)
	slices.Sort(shortTook)
	t.Logf("default ReadTimeout: %v; ReadTimeout 100 ms: %v; its BLPOPs %d, of which %d came back empty after >= 90 ms; BLPOP errors %d (first: %v)", ctlTook, shortTook, blpops.Load(), failed.Load(), errHook.n.Load(), errHook.first.Load())
	require.Less(t, shortTook[len(shortTook)/2], 5*ctlTook[len(ctlTook)-1]+100*time.Millisecond,
		"with ReadTimeout 100 ms the waker's reads fail on the client's timeout and it sleeps 1 s: median wake %v vs %v on the default ReadTimeout", shortTook[len(shortTook)/2], ctlTook[len(ctlTook)-1])
}

// rtErrs records the errors of BLPOPs.
type rtErrs struct {
	n     atomic.Int64
	first atomic.Value
}

func (h *rtErrs) DialHook(next redis.DialHook) redis.DialHook { return next }
func (h *rtErrs) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		err := next(ctx, cmd)
		if cmd.Name() == "blpop" && err != nil && !errors.Is(err, redis.Nil) {
			if h.n.Add(1) == 1 {
				h.first.Store(err.Error())
			}
		}
		return err
	}
}
func (h *rtErrs) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}
