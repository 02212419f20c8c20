package lease_test

// Adversarial review of the waker (commit 83dbfce): one BLPOP per
// Semaphore on a single node, for every key with waiters, kicked by a push
// to the process's own list.

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"math/rand/v2"
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

var rwBlpopErr atomic.Int64 // BLPOPs of every rwCount that ended early, empty

// rwCount counts a client's commands by kind.
type rwCount struct {
	blpops, kicks, keeps, calls atomic.Int64
}

func (c *rwCount) hook() leasetest.Hook {
	return leasetest.Hook{
		Before: func(cmd redis.Cmder) {
			c.calls.Add(1)
			switch {
			case cmd.Name() == "blpop":
				c.blpops.Add(1)
			case leasetest.IsKeep(cmd):
				c.keeps.Add(1)
			default:
				if _, ks := leasetest.ScriptArgs(cmd); len(ks) == 1 && strings.Contains(ks[0], ":lease:wake:") {
					c.kicks.Add(1)
				}
			}
		},
		After: func(cmd redis.Cmder, took time.Duration) {
			// cmd.Err() is set only after the hooks have run: a
			// BLPOP with neither a value nor the time it was given
			// ended in an error.
			if c, ok := cmd.(*redis.StringSliceCmd); ok && cmd.Name() == "blpop" && len(c.Val()) == 0 && took < 500*time.Millisecond {
				rwBlpopErr.Add(1)
			}
		},
	}
}

// rwProc is one waiting process: a Semaphore on a client (through a
// proxy) named name, with its commands counted.
type rwProc struct {
	name string
	cnt  *rwCount
	eng  *throttle.Engine
	sem  *lease.Semaphore
	scn  *wakeScene // for blocked()
}

func rwNewProc(t *testing.T, e *leasetest.Env, tag string, n int, ttl, poll, latency time.Duration, tweak func(*redis.Options), opts ...lease.Option) (*rwProc, func(time.Duration), func()) {
	t.Helper()
	p := &rwProc{name: strings.ReplaceAll(e.Prefix, ":", "-") + tag, cnt: &rwCount{}}
	px, eng := leasetest.Proxied(t, e, 5*time.Second, func(o *redis.Options) {
		o.ClientName = p.name
		if tweak != nil {
			tweak(o)
		}
	}, p.cnt.hook())
	px.SetLatency(latency)
	p.eng = eng
	p.sem = leasetest.SemOn(t, eng, n, append([]lease.Option{lease.WithTTL(ttl), lease.WithPollInterval(poll)}, opts...)...)
	p.scn = &wakeScene{e: e, name: p.name}
	return p, px.SetLatency, px.Sever
}

// TestReviewWakerBurstRelease: process A (40 ms round trips) waits on 40
// keys held by B, with a 10 s poll. B releases them all at once. Each
// waiter must be woken within a few round trips of the release, not one
// BLPOP round trip after another (a BLPOP pops one wake-up, so 40 keys
// released together take 40 sequential reads). Judged against a control
// in the same run: one key alone, released the same way.
func TestReviewWakerBurstRelease(t *testing.T) {
	e := leasetest.NewEnv(t)
	ctx := context.Background()
	const keys, poll, ttl = 40, 10 * time.Second, 60 * time.Second
	a, _, _ := rwNewProc(t, e, "a", 1, ttl, poll, 20*time.Millisecond, nil)
	b := leasetest.SemOn(t, e.Eng, 1, lease.WithTTL(ttl))
	require.NoError(t, a.sem.Load(ctx))

	round := func(n int, tag string) (took []time.Duration) {
		q := queueBehind(t, e, a.sem, b, tag, n, 3*poll)
		time.Sleep(1500 * time.Millisecond) // past the kicks; a read names every key
		start := time.Now()
		q.releaseAll(t)
		for range n {
			select {
			case at := <-q.got:
				took = append(took, at.Sub(start))
			case err := <-q.errs:
				t.Fatalf("acquire: %v", err)
			}
		}
		slices.Sort(took)
		return took
	}
	control := round(1, "c")[0]
	b0 := a.cnt.blpops.Load()
	took := round(keys, "k")
	t.Logf("control %v; %d keys: first %v, median %v, last %v; BLPOPs %d", control, keys, took[0], took[keys/2], took[keys-1], a.cnt.blpops.Load()-b0)
	require.Less(t, took[keys-1], 5*control+200*time.Millisecond,
		"last of %d keys released together woken %v after the release, one alone %v (poll %v): wake-ups read one BLPOP round trip after another", keys, took[keys-1], control, poll)
}

// TestReviewWakerChurn: three processes (one direct, two through proxies
// with 40 ms round trips, one of them on a pool of 30; on a pool of 3
// its waiters wait seconds: see TestReviewWakerBusyPool) take and give back
// leases (N = 2) on 24 keys, some of them with TryAcquire and some with
// Acquire whose context ends, for 6 s, with a 10 s poll and a 30 s TTL.
// Checked: at no time more than N believed holders of a key; each lease
// Acquire returns is held in Redis; no Acquire waits as long as a poll
// (a wake-up missed); kicks and BLPOPs per lease stay bounded; no process
// ever has two connections blocked at once; nothing left after Close.
func TestReviewWakerChurn(t *testing.T) {
	e := leasetest.NewEnv(t)
	ctx := context.Background()
	const n, keys, poll, ttl, run = 2, 24, 10 * time.Second, 30 * time.Second, 6 * time.Second
	a, _, _ := rwNewProc(t, e, "a", n, ttl, poll, 0, nil)
	b, _, _ := rwNewProc(t, e, "b", n, ttl, poll, 20*time.Millisecond, nil)
	c, _, _ := rwNewProc(t, e, "c", n, ttl, poll, 20*time.Millisecond, func(o *redis.Options) { o.PoolSize = 30 })
	procs := []*rwProc{a, b, c}

	var (
		mu        sync.Mutex
		believed  = map[string]map[int64]bool{}
		viols     []string
		leases    atomic.Int64
		maxWait   atomic.Int64
		handedOut = map[string]bool{}
	)
	// Each process's id, seen in its calls' first argument.
	var idMu sync.Mutex
	ids := map[string]string{}
	for _, p := range procs {
		p.eng.Client().(*redis.Client).AddHook(leasetest.Hook{Before: func(cmd redis.Cmder) {
			if argv, _ := leasetest.ScriptArgs(cmd); len(argv) > 0 {
				idMu.Lock()
				ids[fmt.Sprint(argv[0])] = p.name[len(p.name)-1:]
				idMu.Unlock()
			}
		}})
	}
	procIDs := func() map[string]string { idMu.Lock(); defer idMu.Unlock(); return maps.Clone(ids) }
	viol := func(f string, args ...any) {
		mu.Lock()
		viols = append(viols, fmt.Sprintf(f, args...))
		mu.Unlock()
	}
	hold := func(key string, l *lease.Lease) {
		mu.Lock()
		handedOut[key+"/"+fmt.Sprint(l.Token())] = true
		if believed[key] == nil {
			believed[key] = map[int64]bool{}
		}
		believed[key][l.Token()] = true
		if len(believed[key]) > n {
			viols = append(viols, fmt.Sprintf("key %s: %d believed holders %v", key, len(believed[key]), believed[key]))
		}
		mu.Unlock()
		left, err := redisLeft(ctx, e, key)
		if err == nil {
			if _, ok := left[l.Token()]; !ok {
				select {
				case <-l.Lost():
				default:
					viol("key %s: lease %d handed out, Redis holds %v", key, l.Token(), left)
				}
			}
		}
	}
	drop := func(key string, l *lease.Lease) {
		mu.Lock()
		delete(believed[key], l.Token())
		mu.Unlock()
	}

	// Blocked connections, sampled all along.
	stopSample := make(chan struct{})
	var sampled sync.WaitGroup
	maxBlocked := make([]int, len(procs))
	sampled.Go(func() {
		for {
			select {
			case <-stopSample:
				return
			case <-time.After(20 * time.Millisecond):
			}
			for i, p := range procs {
				maxBlocked[i] = max(maxBlocked[i], p.scn.blocked(t))
			}
		}
	})

	end := time.Now().Add(run)
	var wg sync.WaitGroup
	for pi, p := range procs {
		for w := range 8 {
			wg.Go(func() {
				rng := rand.New(rand.NewPCG(uint64(pi), uint64(w)))
				for time.Now().Before(end) {
					key := fmt.Sprint("k", rng.IntN(keys))
					var l *lease.Lease
					var err error
					t0 := time.Now()
					switch rng.IntN(6) {
					case 0:
						var ok bool
						l, ok, err = p.sem.TryAcquire(ctx, key)
						if err == nil && !ok {
							continue
						}
					case 1:
						actx, cancel := context.WithTimeout(ctx, time.Duration(rng.IntN(80))*time.Millisecond)
						l, err = p.sem.Acquire(actx, key)
						cancel()
						if errors.Is(err, context.DeadlineExceeded) {
							continue
						}
					default:
						actx, cancel := context.WithTimeout(ctx, 3*poll)
						l, err = p.sem.Acquire(actx, key)
						cancel()
					}
					if err != nil {
						viol("acquire %s: %v", key, err)
						return
					}
					if d := time.Since(t0); int64(d) > maxWait.Load() {
						maxWait.Store(int64(d))
						if d > time.Second {
							t.Logf("proc %d worker %d key %s waited %v from %v", pi, w, key, d, t0.Sub(end.Add(-run)))
						}
					}
					leases.Add(1)
					hold(key, l)
					time.Sleep(time.Duration(rng.IntN(30)) * time.Millisecond)
					drop(key, l)
					if err := l.Release(ctx); err != nil {
						viol("release %s: %v", key, err)
					}
				}
			})
		}
	}
	wg.Wait()
	close(stopSample)
	sampled.Wait()
	for _, p := range procs {
		cctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		require.NoError(t, p.sem.Close(cctx))
		cancel()
	}
	leasetest.Settled(t, 3*time.Second)

	mu.Lock()
	defer mu.Unlock()
	var kicks, blpops int64
	for _, p := range procs {
		kicks += p.cnt.kicks.Load()
		blpops += p.cnt.blpops.Load()
	}
	t.Logf("%d leases; max wait %v; kicks %d, BLPOPs %d; max blocked %v", leases.Load(), time.Duration(maxWait.Load()), kicks, blpops, maxBlocked)
	require.Empty(t, viols)
	require.Less(t, time.Duration(maxWait.Load()), poll/2, "an Acquire waited as long as half a poll: a wake-up missed")
	require.LessOrEqual(t, kicks, leases.Load()+10, "kicks per lease")
	require.LessOrEqual(t, blpops, 3*leases.Load()+30, "BLPOPs per lease")
	for i := range procs {
		require.LessOrEqual(t, maxBlocked[i], 1, "connections of process %d blocked at once", i)
	}
	for k := range keys {
		key := fmt.Sprint("k", k)
		if hs := e.Rdb.ZRangeWithScores(ctx, e.Key(key, "h"), 0, -1).Val(); len(hs) > 0 {
			toks := e.Rdb.HGetAll(ctx, e.Key(key, "t")).Val()
			for _, h := range hs {
				id := fmt.Sprint(h.Member)
				tok := toks[id]
				_, handed := handedOut[key+"/"+tok] // mu is held
				t.Errorf("key %s: holder %s (token %s, handed to a worker: %v) left after Close; procs' ids: %v", key, id, tok, handed, procIDs())
			}
		}
		require.Zero(t, e.Rdb.ZCard(ctx, e.Key(key, "h")).Val(), "holders of %s after Close", key)
		require.Zero(t, e.Rdb.ZCard(ctx, e.Key(key, "q")).Val(), "queue of %s after Close", key)
	}
}

// TestReviewWakerBusyPool: process A's client has a pool of 4 (the engine
// lets blocking reads take 2) and its calls keep every connection busy (16
// goroutines taking and giving back leases on other keys, 40 ms round
// trips). A waiter of A on key w, held by B, must still be woken within a
// few round trips of B's release, not at its poll (10 s): the waker's read
// is one connection for every key, and its HoldConn gives up at once
// while calls hold every token, then sleeps a second before trying again.
// Control: the same release with the load stopped.
func TestReviewWakerBusyPool(t *testing.T) {
	e := leasetest.NewEnv(t)
	ctx := context.Background()
	const poll, ttl = 10 * time.Second, 30 * time.Second
	a, _, _ := rwNewProc(t, e, "a", 1, ttl, poll, 20*time.Millisecond, func(o *redis.Options) { o.PoolSize = 4 })
	b := leasetest.SemOn(t, e.Eng, 1, lease.WithTTL(ttl))

	wakeOnce := func(key string) time.Duration {
		return wakeAfter(t, e, b, a.sem, key, 1500*time.Millisecond, poll)
	}
	control := wakeOnce("c")

	stop := make(chan struct{})
	var wg sync.WaitGroup
	var loadLeases atomic.Int64
	for g := range 16 {
		wg.Go(func() {
			key := fmt.Sprint("load", g)
			for {
				select {
				case <-stop:
					return
				default:
				}
				l, ok, err := a.sem.TryAcquire(ctx, key)
				if err == nil && ok {
					loadLeases.Add(1)
					_ = l.Release(ctx)
				}
			}
		})
	}
	b0 := a.cnt.blpops.Load()
	var took []time.Duration
	for i := range 3 {
		took = append(took, wakeOnce(fmt.Sprint("w", i)))
	}
	close(stop)
	wg.Wait()
	t.Logf("control %v; under load %v (load leases %d, A's BLPOPs meanwhile %d)", control, took, loadLeases.Load(), a.cnt.blpops.Load()-b0)
	for i, d := range took {
		require.Less(t, d, 10*control+500*time.Millisecond, "waiter %d woken %v after the release under load, %v without (poll %v)", i, d, control, poll)
	}
}

// TestReviewWakerCloseWhileKickOut: A waits on 8 keys (a read out, 40 ms
// round trips); a ninth key begins waiting, and Close is called while its
// kick is on its way (held back 150 ms in the hook). Close must return
// well inside a poll (10 s), every Acquire ErrClosed, every queue empty
// in Redis, and no goroutine of package lease left. Repeated 3 times.
func TestReviewWakerCloseWhileKickOut(t *testing.T) {
	for round := range 3 {
		t.Run(fmt.Sprint(round), func(t *testing.T) {
			e := leasetest.NewEnv(t)
			ctx := context.Background()
			const poll, ttl = 10 * time.Second, 30 * time.Second
			kicking := make(chan struct{}, 1)
			var armed atomic.Bool
			tag := fmt.Sprint("a", round)
			name := strings.ReplaceAll(e.Prefix, ":", "-") + tag
			cnt := &rwCount{}
			px, eng := leasetest.Proxied(t, e, 5*time.Second, func(o *redis.Options) { o.ClientName = name }, cnt.hook(), leasetest.Hook{Before: func(cmd redis.Cmder) {
				if _, ks := leasetest.ScriptArgs(cmd); len(ks) == 1 && strings.Contains(ks[0], ":lease:wake:") && armed.CompareAndSwap(true, false) {
					kicking <- struct{}{}
					time.Sleep(150 * time.Millisecond)
				}
			}})
			px.SetLatency(20 * time.Millisecond)
			s, err := lease.New(eng, "partner", 1, lease.WithTTL(ttl), lease.WithPollInterval(poll))
			require.NoError(t, err)
			b := leasetest.SemOn(t, e.Eng, 1, lease.WithTTL(ttl))
			errs := make(chan error, 9)
			for k := range 9 {
				_, err := b.Acquire(ctx, fmt.Sprint("k", k))
				require.NoError(t, err)
			}
			for k := range 8 {
				go func() { _, err := s.Acquire(ctx, fmt.Sprint("k", k)); errs <- err }()
				e.Queued(t, fmt.Sprint("k", k), 1)
			}
			time.Sleep(1200 * time.Millisecond) // a read names all eight
			armed.Store(true)
			go func() { _, err := s.Acquire(ctx, "k8"); errs <- err }()
			select {
			case <-kicking:
			case <-time.After(5 * time.Second):
				t.Fatal("no kick for a ninth key beginning to wait")
			}
			start := time.Now()
			cctx, cancel := context.WithTimeout(ctx, 8*time.Second)
			defer cancel()
			require.NoError(t, s.Close(cctx))
			took := time.Since(start)
			for range 9 {
				require.ErrorIs(t, <-errs, lease.ErrClosed)
			}
			require.Less(t, took, 3*time.Second, "Close took %v (poll %v)", took, poll)
			require.NoError(t, b.Close(ctx))
			leasetest.Settled(t, 3*time.Second)
			time.Sleep(200 * time.Millisecond)
			for k := range 9 {
				key := fmt.Sprint("k", k)
				require.Zero(t, e.Rdb.ZCard(ctx, e.Key(key, "q")).Val(), "queue of %s after Close", key)
			}
			t.Logf("Close took %v; kicks %d, BLPOPs %d", took, cnt.kicks.Load(), cnt.blpops.Load())
		})
	}
}

// TestReviewWakerRedisAway: A waits on 6 keys (poll 10 s). Redis is paused
// for 2.5 s (CLIENT PAUSE ALL), then A's connections are severed every
// 100 ms for 2.5 s. Meanwhile A's BLPOPs must stay bounded (no spin on
// errors: about one a second), with no kick storm; once Redis is back, a
// release must wake A's waiter within a few round trips, as before.
func TestReviewWakerRedisAway(t *testing.T) {
	e := leasetest.NewEnv(t)
	ctx := context.Background()
	const poll, ttl = 10 * time.Second, 30 * time.Second
	a, _, sever := rwNewProc(t, e, "a", 1, ttl, poll, 0, nil)
	b := leasetest.SemOn(t, e.Eng, 1, lease.WithTTL(ttl))
	held := make([]*lease.Lease, 6)
	got := make(chan time.Time, 6)
	for k := range held {
		var err error
		held[k], err = b.Acquire(ctx, fmt.Sprint("k", k))
		require.NoError(t, err)
		go func() {
			l, err := a.sem.Acquire(ctx, fmt.Sprint("k", k))
			if err == nil {
				got <- time.Now()
				_ = l.Release(ctx)
			}
		}()
		e.Queued(t, fmt.Sprint("k", k), 1)
	}
	time.Sleep(1200 * time.Millisecond)

	b0, k0, e0 := a.cnt.blpops.Load(), a.cnt.kicks.Load(), rwBlpopErr.Load()
	require.NoError(t, e.Rdb.Do(ctx, "client", "pause", "2500", "all").Err())
	time.Sleep(2600 * time.Millisecond)
	b1, k1 := a.cnt.blpops.Load(), a.cnt.kicks.Load()
	t.Logf("paused 2.5 s: BLPOPs %d, kicks %d", b1-b0, k1-k0)
	stop := time.Now().Add(2500 * time.Millisecond)
	for time.Now().Before(stop) {
		sever()
		time.Sleep(100 * time.Millisecond)
	}
	b2, k2, e2 := a.cnt.blpops.Load(), a.cnt.kicks.Load(), rwBlpopErr.Load()
	t.Logf("severed every 100 ms for 2.5 s: BLPOPs %d (%d ended early, empty, in all), kicks %d", b2-b1, e2-e0, k2-k1)
	require.LessOrEqual(t, b2-b0, int64(12), "BLPOPs over 5 s of Redis away")
	require.LessOrEqual(t, k2-k0, int64(2), "kicks over 5 s of Redis away")
	time.Sleep(1500 * time.Millisecond) // back
	for i, l := range held {
		start := time.Now()
		require.NoError(t, l.Release(ctx))
		select {
		case at := <-got:
			require.Less(t, at.Sub(start), 2*time.Second, "waiter %d woken late after Redis came back (poll %v)", i, poll)
		case <-time.After(2 * poll):
			t.Fatalf("waiter %d never woken", i)
		}
	}
	require.NoError(t, a.sem.Close(ctx))
	leasetest.Settled(t, 3*time.Second)
}

// TestReviewWakerBeyond512: A waits on 600 keys at once (more than one
// read names, 512), held by B; B releases them all at once. Every waiter
// must be served, long before the 10 s poll; kicks stay bounded (none for
// keys left out of a full read), and A never blocks on two connections.
func TestReviewWakerBeyond512(t *testing.T) {
	e := leasetest.NewEnv(t)
	const keys, poll, ttl = 600, 10 * time.Second, 60 * time.Second
	a, _, _ := rwNewProc(t, e, "a", 1, ttl, poll, 0, nil)
	b := leasetest.SemOn(t, e.Eng, 1, lease.WithTTL(ttl))
	q := queueBehind(t, e, a.sem, b, "k", keys, 3*poll)
	time.Sleep(1500 * time.Millisecond)
	k0 := a.cnt.kicks.Load()
	maxB := 0
	for range 10 {
		maxB = max(maxB, a.scn.blocked(t))
		time.Sleep(100 * time.Millisecond)
	}
	idleKicks := a.cnt.kicks.Load() - k0
	b0 := a.cnt.blpops.Load()
	start := time.Now()
	q.releaseAll(t)
	var last time.Duration
	for range keys {
		select {
		case at := <-q.got:
			last = max(last, at.Sub(start))
		case err := <-q.errs:
			t.Fatalf("acquire: %v", err)
		}
	}
	t.Logf("all kicks %d (idle %d); BLPOPs after release %d; last woken %v; max blocked %d", a.cnt.kicks.Load(), idleKicks, a.cnt.blpops.Load()-b0, last, maxB)
	require.Zero(t, idleKicks, "kicks while 600 keys wait, nothing changing")
	require.LessOrEqual(t, maxB, 1)
	require.Less(t, last, poll/2, "last of %d waiters woken %v after the release (poll %v)", keys, last, poll)
	require.LessOrEqual(t, a.cnt.kicks.Load(), int64(keys), "kicks for %d keys", keys)
}
