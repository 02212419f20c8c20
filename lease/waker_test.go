package lease_test

import (
	"context"
	"fmt"
	"net"
	"regexp"
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

// wakeScene: process B holds the one lease of each of keys keys, and
// process A (a client of PoolSize 4 named name, poll interval poll) has a
// waiter in the queue of each.
type wakeScene struct {
	e     *leasetest.Env
	name  string
	held  []*lease.Lease
	out   chan wakeGot
	wg    sync.WaitGroup
	kicks atomic.Int64 // A's pushes to its waker's own list
}

type wakeGot struct {
	k   int
	at  time.Time
	err error
}

func newWakeScene(t *testing.T, keys int, poll time.Duration, maxLists int) *wakeScene {
	t.Helper()
	e := leasetest.NewEnv(t)
	ctx := context.Background()
	w := &wakeScene{e: e, name: strings.ReplaceAll(e.Prefix, ":", "-") + "waiter", out: make(chan wakeGot, keys)}
	opts := e.Srv.Options()
	opts.PoolSize = 4 // blocking reads may take 2
	opts.ClientName = w.name
	rdb := redis.NewClient(opts)
	t.Cleanup(func() { _ = rdb.Close() })
	rdb.AddHook(leasetest.Hook{Before: func(cmd redis.Cmder) {
		if _, ks := leasetest.ScriptArgs(cmd); len(ks) == 1 && strings.Contains(ks[0], ":lease:wake:") {
			w.kicks.Add(1)
		}
	}})
	engA, err := throttle.New(rdb, throttle.WithPrefix(e.Prefix), throttle.WithTimeout(5*time.Second))
	require.NoError(t, err)
	const ttl = 60 * time.Second
	a := leasetest.SemOn(t, engA, 1, lease.WithTTL(ttl), lease.WithPollInterval(poll))
	if maxLists > 0 {
		lease.SetMaxWakeLists(a, maxLists)
	}
	b := leasetest.SemOn(t, e.Eng, 1, lease.WithTTL(ttl))
	w.held = make([]*lease.Lease, keys)
	for k := range keys {
		w.held[k], err = b.Acquire(ctx, fmt.Sprint("k", k))
		require.NoError(t, err)
	}
	for k := range keys {
		w.wg.Add(1)
		go func() {
			defer w.wg.Done()
			actx, cancel := context.WithTimeout(ctx, 3*poll+10*time.Second)
			defer cancel()
			l, err := a.Acquire(actx, fmt.Sprint("k", k))
			if err == nil {
				defer l.Release(ctx)
			}
			w.out <- wakeGot{k, time.Now(), err}
		}()
	}
	for k := range keys { // every waiter in the queue
		require.Eventually(t, func() bool {
			return e.Rdb.ZCard(ctx, e.Key(fmt.Sprint("k", k), "q")).Val() == 1
		}, 10*time.Second, 5*time.Millisecond)
	}
	return w
}

// blockedAtMost samples A's connections blocked in BLPOP 20 times over a
// second, and checks that it never has more than most, and most at some
// time (a read that has just ended leaves none for an instant).
func (w *wakeScene) blockedAtMost(t *testing.T, most int) {
	t.Helper()
	seen := make([]int, 20)
	for i := range seen {
		seen[i] = w.blocked(t)
		time.Sleep(50 * time.Millisecond)
	}
	require.LessOrEqual(t, slices.Max(seen), most, "blocking reads of the waiting process: %v", seen)
	require.Contains(t, seen, most, "blocking reads of the waiting process")
}

var blockedFlag = regexp.MustCompile(` flags=[a-zA-Z]*b`)

// blocked counts A's connections blocked (in BLPOP).
func (w *wakeScene) blocked(t *testing.T) int {
	list, err := w.e.Rdb.ClientList(context.Background()).Result()
	require.NoError(t, err)
	n := 0
	for _, line := range strings.Split(list, "\n") {
		// Blocked now (flag b); cmd is only the last command of the
		// connection, which may be back in the pool.
		if strings.Contains(line, " name="+w.name+" ") && blockedFlag.MatchString(line) {
			n++
		}
	}
	return n
}

// release releases B's leases, waits for A's waiters and returns when
// each was granted after the release began, by key.
func (w *wakeScene) release(t *testing.T) (took []time.Duration, released time.Duration) {
	start := time.Now()
	for _, l := range w.held {
		require.NoError(t, l.Release(context.Background()))
	}
	released = time.Since(start)
	w.wg.Wait()
	close(w.out)
	took = make([]time.Duration, len(w.held))
	for g := range w.out {
		require.NoError(t, g.err, "key k%d", g.k)
		took[g.k] = g.at.Sub(start)
	}
	return took, released
}

// TestWakeUpsOnManyKeysSmallPool: a process waits on more keys at once
// (12) than its client's pool could give a blocking read each, with a
// poll interval of 10 s. When the other process releases every key,
// every waiter must be woken by its wake-up, long before any poll, and
// the waiting process blocks on one connection for all its keys.
func TestWakeUpsOnManyKeysSmallPool(t *testing.T) {
	const keys, poll = 12, 10 * time.Second
	w := newWakeScene(t, keys, poll, 0)
	time.Sleep(300 * time.Millisecond) // past the kicks of the keys' arrivals
	w.blockedAtMost(t, 1)
	took, released := w.release(t)
	for k, d := range took {
		// A poll would come up to 10 s after the last; a wake-up comes
		// within a few round trips of the release.
		require.Less(t, d, released+2*time.Second, "key k%d woken late (poll %v)", k, poll)
	}
}

// TestWakeUpsBeyondOneRead: more keys wait (10) than one read names (4,
// set low for the test). The keys left out must not kick the read again
// and again (each kick is a call), and every waiter is served all the
// same: by a read that names its key, or by its poll (500 ms).
func TestWakeUpsBeyondOneRead(t *testing.T) {
	const keys, poll = 10, 500 * time.Millisecond
	w := newWakeScene(t, keys, poll, 4)
	time.Sleep(300 * time.Millisecond)
	before := w.kicks.Load()
	time.Sleep(4 * poll) // every keeper polls, and finds its key left out or not
	require.Zero(t, w.kicks.Load()-before, "kicks while %d keys wait, 4 a read", keys)
	w.blockedAtMost(t, 1)
	took, released := w.release(t)
	for k, d := range took {
		require.Less(t, d, released+poll+2*time.Second, "key k%d", k)
	}
}

// TestWakeUpsShortReadTimeout: on a client whose ReadTimeout (300 ms) is
// shorter than a blocking read's second, the reads must end before the
// client gives up on them: a read the client times out costs its
// connection, and the wake-ups wait. A waiter blocks for 2.5 s, and is
// then woken by a release within a few round trips.
func TestWakeUpsShortReadTimeout(t *testing.T) {
	for _, ring := range []bool{false, true} {
		// A one-shard Ring: each key's keeper blocks on its own list.
		t.Run(map[bool]string{false: "node", true: "ring"}[ring], func(t *testing.T) {
			e := leasetest.NewEnv(t)
			ctx := context.Background()
			const rt = 300 * time.Millisecond
			// Blocking reads that ended in an error (a Ring's), and
			// connections dialled (a Client retries a read that timed out,
			// on a new connection, and may answer without an error).
			var failed, dials atomic.Int64
			hook := leasetest.Hook{After: func(cmd redis.Cmder, _ time.Duration) {
				if cmd.Name() == "blpop" && cmd.Err() != nil && cmd.Err() != redis.Nil {
					failed.Add(1)
				}
			}}
			var rdb redis.UniversalClient
			if ring {
				r := redis.NewRing(&redis.RingOptions{Addrs: map[string]string{"a": e.Srv.Addr}, ReadTimeout: rt, ContextTimeoutEnabled: true})
				r.AddHook(hook)
				rdb = r
			} else {
				opts := e.Srv.Options()
				opts.ReadTimeout = rt
				c := redis.NewClient(opts)
				c.AddHook(hook)
				c.AddHook(dialHook(func() { dials.Add(1) }))
				rdb = c
			}
			t.Cleanup(func() { _ = rdb.Close() })
			engA, err := throttle.New(rdb, throttle.WithPrefix(e.Prefix), throttle.WithTimeout(5*time.Second))
			require.NoError(t, err)
			const poll = 10 * time.Second
			a := leasetest.SemOn(t, engA, 1, lease.WithTTL(60*time.Second), lease.WithPollInterval(poll))
			b := leasetest.SemOn(t, e.Eng, 1, lease.WithTTL(60*time.Second))
			held, err := b.Acquire(ctx, "k")
			require.NoError(t, err)
			got := make(chan error, 1)
			go func() {
				l, err := a.Acquire(ctx, "k")
				if err == nil {
					defer l.Release(ctx)
				}
				got <- err
			}()
			require.Eventually(t, func() bool { return e.Rdb.ZCard(ctx, e.Key("k", "q")).Val() == 1 }, 10*time.Second, 5*time.Millisecond)
			dialled := dials.Load()
			time.Sleep(2500 * time.Millisecond)
			require.Zero(t, failed.Load(), "blocking reads failed while a waiter waited 2.5 s")
			require.Zero(t, dials.Load()-dialled, "connections dialled while a waiter waited 2.5 s")
			start := time.Now()
			require.NoError(t, held.Release(ctx))
			select {
			case err := <-got:
				require.NoError(t, err)
			case <-time.After(time.Second):
				t.Fatalf("not woken %v after the release (poll %v)", time.Since(start), poll)
			}
		})
	}
}

// dialHook is a redis.Hook that calls dialled for each connection its
// client opens.
type dialHook func()

func (d dialHook) DialHook(next redis.DialHook) redis.DialHook {
	return func(ctx context.Context, network, addr string) (net.Conn, error) {
		d()
		return next(ctx, network, addr)
	}
}
func (d dialHook) ProcessHook(next redis.ProcessHook) redis.ProcessHook { return next }
func (d dialHook) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}

// TestWakerStaleReadNotDelivered: on a single node the waker's reads run
// beside the keeper's calls. Process A waits, B holds, then has a waiter
// of its own. A's keep call is slow (its reply seen 1.5 s late, a TTL and
// a half), and B releases meanwhile, granting A's waiter: A's waker pops
// the wake-up at once, but its reply is seen 2.5 s late. The lease lapses
// unextended, A's next keep call sweeps it and finds A's waiter not
// granted (B's is granted), and only then is the popped wake-up read.
// Acquire must not hand A that lease (Redis no longer holds it, and B
// holds the place): it answers ErrLost, or a lease Redis holds (once
// B's waiter has given it back, if A's waiter went back in the queue).
func TestWakerStaleReadNotDelivered(t *testing.T) {
	e := leasetest.NewEnv(t)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	const ttl = time.Second
	var keepArmed, readArmed atomic.Pointer[func()]
	engA := leasetest.Direct(t, e, 5*time.Second, leasetest.Hook{After: func(cmd redis.Cmder, _ time.Duration) {
		if f := keepArmed.Load(); f != nil && leasetest.IsKeep(cmd) && keepArmed.CompareAndSwap(f, nil) {
			(*f)()
		}
		if c, ok := cmd.(*redis.StringSliceCmd); ok && cmd.Name() == "blpop" && c.Err() == nil &&
			len(c.Val()) == 2 && strings.Contains(c.Val()[0], "{k}") {
			if f := readArmed.Load(); f != nil && readArmed.CompareAndSwap(f, nil) {
				(*f)()
			}
		}
	}})
	opts := []lease.Option{lease.WithTTL(ttl), lease.WithPollInterval(100 * time.Millisecond)}
	a := leasetest.SemOn(t, engA, 1, opts...)
	b := leasetest.SemOn(t, e.Eng, 1, opts...)

	l1, gotA, gotB := queueAThenB(t, e, ctx, a, b)
	time.Sleep(200 * time.Millisecond) // A's waker reads {k}'s list

	slowRead := func() { time.Sleep(ttl * 5 / 2) }
	readArmed.Store(&slowRead)
	slowKeep := func() {
		require.NoError(t, l1.Release(ctx)) // grants A's waiter, at the head of the queue
		time.Sleep(ttl * 3 / 2)
	}
	keepArmed.Store(&slowKeep)

	// checkA judges A's answer: ErrLost, or a lease Redis holds.
	checkA := func(r acquired) {
		t.Helper()
		if r.err != nil {
			require.ErrorIs(t, r.err, lease.ErrLost)
			t.Logf("A: %v", r.err) // a grant given up as late is the safe answer
			return
		}
		releaseHeld(t, e, ctx, r.l)
	}
	select {
	case r := <-gotA: // before B's waiter
		checkA(r)
		r = <-gotB
		require.NoError(t, r.err)
		require.NoError(t, r.l.Release(ctx))
	case r := <-gotB: // A's waiter went back in the queue, behind B's
		require.NoError(t, r.err)
		select {
		case ra := <-gotA:
			checkA(ra)
			require.ErrorIs(t, ra.err, lease.ErrLost, "A handed a lease while B holds the only one")
		case <-time.After(2 * ttl): // past the read's reply, seen 2.5 TTLs after the grant
		}
		require.NoError(t, r.l.Release(ctx))
		select {
		case ra := <-gotA:
			checkA(ra)
		case <-ctx.Done():
		}
	case <-ctx.Done():
	}
	require.NoError(t, ctx.Err(), "A or B never answered")
	require.Nil(t, readArmed.Load(), "the wake-up was not read through the hook")
}
