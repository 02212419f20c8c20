package throttle_test

// Review (helper-154) of 4d33a5d (with dbba724 before it): sweepRing and
// sweep trust the lock-free count of open breakers (anyOpen) and take no
// second look under the lock, and holdConn tells a Ring by e.ring. Through
// the public API only: a Cluster master paused and resumed while callers
// on every master go on (the slot map is re-read while the breaker is
// open, and never while none is: counted as the CLUSTER SLOTS commands
// the client's node clients send), a Ring whose heartbeat's view of its
// shards flaps while shards are paused, slowed and severed under callers
// of every kind (the observer's log checks the open count), a Ring's
// allocations per call before and after its breakers opened and closed
// (against a control with one open), a Ring shard stopped for good and
// one restarted empty (judged against the Ring's own view and a direct
// PING in the same run), and HoldConn on a Ring and on a wrapped one.
//
// The log and its check (r49bLog, r49bCheck) are helper-150's, from
// review_ring49b_test.go: each node's changes alternate, and the
// engine-wide ObserveBreaker comes exactly when the count of open
// breakers goes from 0 to 1 and from 1 to 0, which is the count anyOpen
// reads.

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"runtime"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/slotbook/slotbook/internal/redistest"
	"github.com/slotbook/slotbook/reserve"
	"github.com/slotbook/slotbook/throttle"
)

// sw50Key forms the i-th subject key of a test.
func sw50Key(i int) string { return "sw50:" + strconv.Itoa(i) }

// sw50KeyOn returns a key that eng places on node.
func sw50KeyOn(t *testing.T, eng *throttle.Engine, node string) string {
	t.Helper()
	for i := 0; i < 5000; i++ {
		if eng.Node(context.Background(), sw50Key(i)) == node {
			return sw50Key(i)
		}
	}
	t.Fatalf("no key on %s (sw50:0 is on %s)", node, eng.Node(context.Background(), sw50Key(0)))
	return ""
}

// sw50Callers runs callers of Allow on keys until stop is closed, and
// records any error that is not ErrUnavailable.
type sw50Callers struct {
	stop chan struct{}
	wg   sync.WaitGroup
	bad  atomic.Value
	n    atomic.Int64
}

func sw50Start(eng *throttle.Engine, keys []string, per int) *sw50Callers {
	c := &sw50Callers{stop: make(chan struct{})}
	lim := throttle.PerSecond(100000, 100000)
	for _, k := range keys {
		for g := 0; g < per; g++ {
			c.wg.Add(1)
			go func() {
				defer c.wg.Done()
				for {
					select {
					case <-c.stop:
						return
					default:
					}
					_, err := eng.Allow(context.Background(), k, lim)
					c.n.Add(1)
					if err != nil && !errors.Is(err, throttle.ErrUnavailable) {
						c.bad.Store(err)
					}
					if err != nil {
						time.Sleep(time.Millisecond) // refused at once: do not spin
					}
				}
			}()
		}
	}
	return c
}

func (c *sw50Callers) end(t *testing.T) {
	t.Helper()
	close(c.stop)
	c.wg.Wait()
	if err, _ := c.bad.Load().(error); err != nil {
		require.NoError(t, err, "a call failed otherwise than as unavailable")
	}
}

// sw50SlotsCounter counts the CLUSTER SLOTS commands sent through the
// node clients it hooks: each reading of a Cluster's slot map sends one
// (more, where a node does not answer).
type sw50SlotsCounter struct{ atomic.Int64 }

func (c *sw50SlotsCounter) DialHook(next redis.DialHook) redis.DialHook { return next }
func (c *sw50SlotsCounter) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		if a := cmd.Args(); len(a) == 2 && strings.EqualFold(cmd.Name(), "cluster") && strings.EqualFold(fmt.Sprint(a[1]), "slots") {
			c.Add(1)
		}
		return next(ctx, cmd)
	}
}
func (c *sw50SlotsCounter) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}

// TestReviewSweep50ClusterSweepsOnlyWhileOpen: a Cluster of three masters,
// callers on every master's keys all along. Master 0 is paused (SIGSTOP)
// for a second, less than the cluster's node timeout (no failover), and
// resumed. While its breaker is open the engine re-reads the slot map
// (counted as the CLUSTER SLOTS commands its node clients send): at least twice in the second. Once the master answers a
// direct PING (the control), every breaker closes within the longest
// probe interval plus a second, the observer is told the last one
// closed, and in the second after that the map is read no more than the
// client's own doing allows, as in a second before the pause (a sweep
// with nothing open would read it about ten times at a 100 ms probe
// maximum).
func TestReviewSweep50ClusterSweepsOnlyWhileOpen(t *testing.T) {
	t.Parallel()
	cl := redistest.StartCluster(t, 3, "--cluster-require-full-coverage", "no")
	direct := redis.NewClient(&redis.Options{Addr: cl.Addrs[0], ContextTimeoutEnabled: true, MaxRetries: -1})
	t.Cleanup(func() { _ = direct.Close() })
	loads := &sw50SlotsCounter{}
	cc := redis.NewClusterClient(&redis.ClusterOptions{Addrs: slices.Clone(cl.Addrs), ContextTimeoutEnabled: true, MaxRetries: -1,
		NewClient: func(o *redis.Options) *redis.Client {
			c := redis.NewClient(o)
			c.AddHook(loads)
			return c
		}})
	t.Cleanup(func() { _ = cc.Close() })
	log := &r49bLog{}
	const probeMax = 100 * time.Millisecond
	eng, err := throttle.New(cc, throttle.WithPrefix(redistest.Prefix(t)), throttle.WithTimeout(150*time.Millisecond),
		throttle.WithProbeBackoff(25*time.Millisecond, probeMax), throttle.WithObserver(log))
	require.NoError(t, err)
	ctx := context.Background()
	lim := throttle.PerSecond(100000, 100000)
	var keys []string
	for _, a := range cl.Addrs {
		k := sw50KeyOn(t, eng, a)
		redistest.UntilOK(t, func() error { _, err := eng.Allow(ctx, k, lim); return err })
		keys = append(keys, k)
	}
	c := sw50Start(eng, keys, 2)
	defer func() {
		if c != nil {
			c.end(t)
		}
	}()

	// Healthy: the baseline of the client's own loads.
	time.Sleep(200 * time.Millisecond)
	l0 := loads.Load()
	time.Sleep(time.Second)
	healthy := loads.Load() - l0
	open, _ := eng.Unavailable()
	require.False(t, open, "healthy cluster")

	pid := cl.Node(0).Pid()
	require.NoError(t, syscall.Kill(pid, syscall.SIGSTOP))
	resumed := false
	defer func() {
		if !resumed {
			_ = syscall.Kill(pid, syscall.SIGCONT)
		}
	}()
	require.Eventually(t, func() bool { o, _ := eng.UnavailableFor(ctx, keys[0]); return o },
		5*time.Second, 5*time.Millisecond, "master 0's breaker opens")
	l1 := loads.Load()
	time.Sleep(time.Second)
	whileOpen := loads.Load() - l1
	for _, k := range keys[1:] {
		o, _ := eng.UnavailableFor(ctx, k)
		require.False(t, o, "a master that answers has its breaker closed")
	}
	require.NoError(t, syscall.Kill(pid, syscall.SIGCONT))
	resumed = true

	// Control: master 0 answers a direct PING.
	redistest.UntilOK(t, func() error { return direct.Ping(ctx).Err() })
	answered := time.Now()
	require.Eventually(t, func() bool { o, _ := eng.Unavailable(); return !o }, 10*time.Second, 2*time.Millisecond,
		"every breaker closes once master 0 answers")
	late := time.Since(answered)
	require.LessOrEqual(t, late, probeMax+time.Second, "breaker closed %v after master 0 answered a PING", late)

	l2 := loads.Load()
	time.Sleep(time.Second)
	after := loads.Load() - l2
	calls := c.n.Load()
	c.end(t)
	c = nil
	t.Logf("slot map loads per second: healthy %d, breaker open %d, after %d; closed %v after the control; %d calls",
		healthy, whileOpen, after, late, calls)
	require.GreaterOrEqual(t, whileOpen, int64(2), "the slot map is re-read while master 0's breaker is open")
	require.LessOrEqual(t, healthy, int64(3), "no sweep on a healthy cluster")
	require.LessOrEqual(t, after, int64(3), "no sweep once every breaker has closed")
	ev := log.get()
	r49bCheck(t, ev, true)
	require.NotEmpty(t, ev)
	require.Equal(t, r49bEvent{"", false}, ev[len(ev)-1], "the observer is told the last breaker closed: %v", ev)
}

// TestReviewSweep50RingChaos: a Ring of three shards whose heartbeat (a
// HeartbeatFn of the test's) reports each shard down or up at random
// every few milliseconds, on top of a real PING, so that sweepRing
// retires breakers while probes, successes and failures race with it;
// meanwhile shard b is paused and resumed (SIGSTOP), and shard c, behind
// a Proxy, is slowed by 40 ms each way (past the engine's timeout: its
// replies are lost) and severed. Callers on many goroutines use every
// entry point: Book, Allow, RunScript, RunScriptPastBreaker, HoldConn,
// Unavailable, UnavailableFor, Node, and a reserve Limiter with a
// fallback. Every failure matches ErrUnavailable. Once every shard is up
// and reported up, every key is served, no breaker is left open, and
// the observer's log holds together: the engine-wide changes fall
// exactly where the count of open breakers (what anyOpen reads) goes
// from 0 to 1 and back, so the count was never off.
func TestReviewSweep50RingChaos(t *testing.T) {
	t.Parallel()
	a, b, c := redistest.Start(t), redistest.Start(t), redistest.Start(t)
	px := redistest.NewProxy(t, c.Addr)
	addrs := []string{a.Addr, b.Addr, px.Addr()}
	var forced [3]atomic.Bool // the heartbeat reports shard i down
	idx := map[string]int{a.Addr: 0, b.Addr: 1, px.Addr(): 2}
	ring := redis.NewRing(&redis.RingOptions{
		Addrs:                 map[string]string{"a": addrs[0], "b": addrs[1], "c": addrs[2]},
		ContextTimeoutEnabled: true, MaxRetries: -1, DialTimeout: 200 * time.Millisecond,
		HeartbeatFrequency: 5 * time.Millisecond,
		HeartbeatFn: func(ctx context.Context, cl *redis.Client) bool {
			if forced[idx[cl.Options().Addr]].Load() {
				return false
			}
			pctx, cancel := context.WithTimeout(ctx, 50*time.Millisecond)
			defer cancel()
			return cl.Ping(pctx).Err() == nil
		},
	})
	t.Cleanup(func() { _ = ring.Close() })
	log := &r49bLog{}
	eng, err := throttle.New(ring, throttle.WithPrefix(redistest.Prefix(t)), throttle.WithTimeout(60*time.Millisecond),
		throttle.WithProbeBackoff(10*time.Millisecond, 50*time.Millisecond), throttle.WithObserver(log))
	require.NoError(t, err)
	ctx := context.Background()
	lim := throttle.PerSecond(100000, 100000)
	l, err := reserve.New(eng, "sw50c", lim, reserve.WithFallback(reserve.FailOpen()), reserve.WithMaxWait(time.Second))
	require.NoError(t, err)
	script := throttle.NewScript(`return redis.call('INCR', KEYS[1])`)
	const nKeys = 48
	for i := 0; i < nKeys; i++ {
		redistest.UntilOK(t, func() error { _, err := eng.Allow(ctx, sw50Key(i), lim); return err })
	}

	stop := make(chan struct{})
	var wg sync.WaitGroup
	var bad atomic.Value
	var calls, fails atomic.Int64
	for g := 0; g < 10; g++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				select {
				case <-stop:
					return
				default:
				}
				k := sw50Key(rand.IntN(nKeys))
				var err error
				switch g % 7 {
				case 0:
					_, err = eng.Book(ctx, k, lim, throttle.Request{N: 1, MaxWait: time.Second})
				case 1:
					_, err = eng.Allow(ctx, k, lim)
				case 2:
					_, err = eng.RunScript(ctx, script, []string{k + ":n"})
				case 3:
					_, err = eng.RunScriptPastBreaker(ctx, script, []string{k + ":n"})
				case 4:
					if release, ok := eng.HoldConn(ctx, k); ok {
						time.Sleep(time.Millisecond)
						release()
						release()
					}
				case 5:
					_, err = l.Allow(ctx, strconv.Itoa(rand.IntN(nKeys)))
				case 6:
					eng.Unavailable()
					eng.UnavailableFor(ctx, k)
					if n := eng.Node(ctx, k); n != "redis" && !slices.Contains(addrs, n) {
						bad.Store(errors.New("node " + n))
					}
					time.Sleep(time.Millisecond)
				}
				calls.Add(1)
				if err != nil {
					fails.Add(1)
					if !errors.Is(err, throttle.ErrUnavailable) {
						bad.Store(err)
					}
					time.Sleep(time.Millisecond)
				}
			}
		}()
	}
	// The heartbeat's view flaps.
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			select {
			case <-stop:
				return
			case <-time.After(time.Duration(2+rand.IntN(20)) * time.Millisecond):
			}
			forced[rand.IntN(3)].Store(rand.IntN(3) == 0)
		}
	}()
	pid := b.Pid()
	paused := false
	defer func() {
		if paused {
			_ = syscall.Kill(pid, syscall.SIGCONT)
		}
	}()
	for round := 0; round < 3; round++ {
		require.NoError(t, syscall.Kill(pid, syscall.SIGSTOP))
		paused = true
		px.SetLatency(40 * time.Millisecond)
		time.Sleep(300 * time.Millisecond)
		px.Sever()
		time.Sleep(100 * time.Millisecond)
		require.NoError(t, syscall.Kill(pid, syscall.SIGCONT))
		paused = false
		time.Sleep(200 * time.Millisecond)
		px.SetLatency(0)
		time.Sleep(200 * time.Millisecond)
	}
	close(stop)
	wg.Wait()
	for i := range forced {
		forced[i].Store(false)
	}
	t.Logf("calls %d, failed %d", calls.Load(), fails.Load())
	if err, _ := bad.Load().(error); err != nil {
		require.NoError(t, err, "a call failed otherwise than as unavailable")
	}
	require.Eventually(t, func() bool {
		if len(ring.GetShardClients()) != 3 {
			return false
		}
		for k := 0; k < nKeys; k++ {
			if _, err := eng.Allow(ctx, sw50Key(k), lim); err != nil {
				return false
			}
		}
		open, _ := eng.Unavailable()
		return !open
	}, 10*time.Second, 10*time.Millisecond, "served again, no breaker open")
	r49bCheck(t, log.get(), true)
}

// sw50Mallocs returns the heap allocations per call of f, the median of
// five runs of n calls (runtime.MemStats counts the whole process's: the
// median keeps another goroutine's burst out).
func sw50Mallocs(n int, f func()) float64 {
	var runs []float64
	for r := 0; r < 5; r++ {
		var m0, m1 runtime.MemStats
		runtime.ReadMemStats(&m0)
		for i := 0; i < n; i++ {
			f()
		}
		runtime.ReadMemStats(&m1)
		runs = append(runs, float64(m1.Mallocs-m0.Mallocs)/float64(n))
	}
	sort.Float64s(runs)
	return runs[2]
}

// TestReviewSweep50RingAllocs: a healthy Ring's call allocates no more
// once its breakers have opened and closed than before (a count of open
// breakers left above 0 would have sweepRing build its map of shards at
// every probe maximum, 1 ms here). The control: the same calls while
// another shard's breaker is open allocate more, so the measure sees a
// sweep. The Ring's heartbeat is an hour apart: the shard stopped keeps
// its keys, and its breaker closes by a probe once it is restarted.
func TestReviewSweep50RingAllocs(t *testing.T) {
	a, b := redistest.Start(t), redistest.Start(t)
	ring := redis.NewRing(&redis.RingOptions{Addrs: map[string]string{"a": a.Addr, "b": b.Addr},
		ContextTimeoutEnabled: true, MaxRetries: -1, HeartbeatFrequency: time.Hour, DialTimeout: time.Second})
	t.Cleanup(func() { _ = ring.Close() })
	log := &r49bLog{}
	eng, err := throttle.New(ring, throttle.WithPrefix(redistest.Prefix(t)), throttle.WithTimeout(time.Second),
		throttle.WithProbeBackoff(time.Millisecond, time.Millisecond), throttle.WithObserver(log))
	require.NoError(t, err)
	ctx := context.Background()
	lim := throttle.PerSecond(1000000, 1000000)
	ka, kb := sw50KeyOn(t, eng, a.Addr), sw50KeyOn(t, eng, b.Addr)
	for _, k := range []string{ka, kb} {
		redistest.UntilOK(t, func() error { _, err := eng.Allow(ctx, k, lim); return err })
	}
	call := func() {
		if _, err := eng.Allow(ctx, ka, lim); err != nil {
			t.Errorf("Allow on shard a: %v", err)
		}
	}
	slept := func() { call(); time.Sleep(time.Millisecond) }
	const n = 200
	before := sw50Mallocs(n, call)
	beforeSlept := sw50Mallocs(n, slept)

	b.Stop()
	require.Eventually(t, func() bool {
		_, err := eng.Allow(ctx, kb, lim)
		o, _ := eng.UnavailableFor(ctx, kb)
		return err != nil && o
	}, 5*time.Second, time.Millisecond, "shard b's breaker opens")
	// A call 1 ms after the last finds a sweep due (1 ms apart).
	withOpen := sw50Mallocs(n, slept)
	b.Restart(t)
	require.Eventually(t, func() bool {
		_, err := eng.Allow(ctx, kb, lim)
		o, _ := eng.Unavailable()
		return err == nil && !o
	}, 10*time.Second, time.Millisecond, "shard b's breaker closes")
	afterSlept := sw50Mallocs(n, slept)
	t.Logf("allocations per call, 1 ms apart: before %.2f (%.2f back to back), with b open %.2f, after %.2f",
		beforeSlept, before, withOpen, afterSlept)
	require.Less(t, beforeSlept, before+0.5, "no sweep on a healthy Ring")
	require.Greater(t, withOpen, beforeSlept+0.5, "control: a sweep shows in the count")
	require.Less(t, afterSlept, beforeSlept+0.5, "no sweep once every breaker has closed")
	ev := log.get()
	r49bCheck(t, ev, true)
	require.Equal(t, r49bEvent{"", false}, ev[len(ev)-1], "the observer is told the last breaker closed: %v", ev)
}

// TestReviewSweep50RingStoppedForGood: a shard of three stopped for good,
// callers on every shard's keys. Once the Ring's own heartbeat has marked
// it down and routes its keys elsewhere (the control, Engine.Node, the
// Ring's own choice), its breaker is retired
// within the longest probe interval plus a second: Unavailable is false
// while the shard is still down, and every key is served (they went to
// the other shards) without paying the timeout. Then another shard is
// restarted empty (its scripts gone): once it answers a direct PING its
// breaker is closed within the same bound.
func TestReviewSweep50RingStoppedForGood(t *testing.T) {
	t.Parallel()
	srv := []*redistest.Server{redistest.Start(t), redistest.Start(t), redistest.Start(t)}
	ring := redis.NewRing(&redis.RingOptions{
		Addrs:                 map[string]string{"a": srv[0].Addr, "b": srv[1].Addr, "c": srv[2].Addr},
		ContextTimeoutEnabled: true, MaxRetries: -1, HeartbeatFrequency: 50 * time.Millisecond, DialTimeout: time.Second})
	t.Cleanup(func() { _ = ring.Close() })
	log := &r49bLog{}
	const probeMax = 200 * time.Millisecond
	const timeout = 2 * time.Second
	eng, err := throttle.New(ring, throttle.WithPrefix(redistest.Prefix(t)), throttle.WithTimeout(timeout),
		throttle.WithProbeBackoff(25*time.Millisecond, probeMax), throttle.WithObserver(log))
	require.NoError(t, err)
	ctx := context.Background()
	lim := throttle.PerSecond(100000, 100000)
	var keys []string // three per shard, in the order of srv
	for _, s := range srv {
		for i, n := 0, 0; n < 3; i++ {
			require.Less(t, i, 5000, "keys on %s", s.Addr)
			if eng.Node(ctx, sw50Key(i)) == s.Addr {
				keys = append(keys, sw50Key(i))
				n++
			}
		}
	}
	for _, k := range keys {
		redistest.UntilOK(t, func() error { _, err := eng.Allow(ctx, k, lim); return err })
	}
	c := sw50Start(eng, keys, 1)
	defer func() {
		if c != nil {
			c.end(t)
		}
	}()
	// The control: the Ring routes none of shard a's keys to it. (Its
	// GetShardClients leaves a out a little earlier: the heartbeat marks
	// a shard down, pings the others, and only then rehashes the keys.)
	routedAway := func() bool {
		for _, k := range keys[:3] {
			if eng.Node(ctx, k) == srv[0].Addr {
				return false
			}
		}
		return true
	}

	srv[0].Stop()
	require.Eventually(t, routedAway, 10*time.Second, time.Millisecond, "the Ring routes shard a's keys elsewhere")
	markedDown := time.Now()
	require.Eventually(t, func() bool { o, _ := eng.Unavailable(); return !o }, 10*time.Second, time.Millisecond,
		"shard a's breaker is retired")
	late := time.Since(markedDown)
	require.LessOrEqual(t, late, probeMax+time.Second, "retired %v after the Ring marked shard a down", late)
	for _, k := range keys {
		start := time.Now()
		_, err := eng.Allow(ctx, k, lim)
		require.NoError(t, err, "key %s (on %s) served by a shard up", k, eng.Node(ctx, k))
		require.Less(t, time.Since(start), timeout/2, "key %s did not pay the timeout", k)
	}

	srv[1].Restart(t) // empty: no key, no script
	direct := srv[1].Client(t)
	redistest.UntilOK(t, func() error { return direct.Ping(ctx).Err() })
	answered := time.Now()
	require.Eventually(t, func() bool {
		o, _ := eng.Unavailable()
		if o {
			return false
		}
		for _, k := range keys[3:6] {
			if _, err := eng.Allow(ctx, k, lim); err != nil {
				return false
			}
		}
		return true
	}, 10*time.Second, time.Millisecond, "shard b served again")
	late = time.Since(answered)
	require.LessOrEqual(t, late, probeMax+time.Second, "served %v after shard b answered a PING", late)
	c.end(t)
	c = nil
	open, _ := eng.Unavailable()
	require.False(t, open, "no breaker open while shard a is still down")
	ev := log.get()
	r49bCheck(t, ev, true)
}

// ringScripter is a Ring behind a Scripter of the caller's own: the
// engine does not know it for a Ring.
type ringScripter struct{ redis.Scripter }

// TestReviewSweep50HoldConnRing: HoldConn on a Ring lets blocking commands
// hold at most half a shard's pool at once (PoolSize 4: two), over and
// over, and a release called twice gives back one; through a Scripter
// that wraps the Ring (a client of another kind for the engine) it holds
// nothing and always says ok.
func TestReviewSweep50HoldConnRing(t *testing.T) {
	t.Parallel()
	a := redistest.Start(t)
	ring := redis.NewRing(&redis.RingOptions{Addrs: map[string]string{"a": a.Addr}, ContextTimeoutEnabled: true, PoolSize: 4})
	t.Cleanup(func() { _ = ring.Close() })
	eng, err := throttle.New(ring, throttle.WithPrefix(redistest.Prefix(t)))
	require.NoError(t, err)
	ctx := context.Background()
	for round := 0; round < 3; round++ {
		r1, ok1 := eng.HoldConn(ctx, "k1")
		r2, ok2 := eng.HoldConn(ctx, "k2")
		require.True(t, ok1 && ok2, "round %d: two holds", round)
		_, ok3 := eng.HoldConn(ctx, "k3")
		require.False(t, ok3, "round %d: a third hold is refused", round)
		r1()
		r1()
		r3, ok3 := eng.HoldConn(ctx, "k3")
		require.True(t, ok3, "round %d: a hold after a release", round)
		_, ok4 := eng.HoldConn(ctx, "k4")
		require.False(t, ok4, "round %d: a release called twice gives back one hold", round)
		r2()
		r3()
	}
	wrapped, err := throttle.New(ringScripter{ring}, throttle.WithPrefix(redistest.Prefix(t)))
	require.NoError(t, err)
	for i := 0; i < 10; i++ {
		_, ok := wrapped.HoldConn(ctx, "k"+strconv.Itoa(i))
		require.True(t, ok, "a client of another kind: hold %d", i)
	}
}

// sw50Slow is a call for a key that failed after paying (most of) the
// engine's timeout: it went to a node that did not answer.
type sw50Slow struct {
	key        string
	start, end time.Time
}

// TestReviewSweep50RingRetiredWhileRouted: two shards of three paused at
// once (SIGSTOP: a host that hangs), callers on their keys, the Ring's
// default heartbeat (each ping of a paused shard waits out the read
// timeout). The heartbeat marks one of them down on its third failed
// ping, then pings the other (a read timeout more), and only then
// rehashes the keys: meanwhile the shard is left out of GetShardClients,
// which sweepRing reads, while its keys still go to it. A breaker that
// is not closed lets one call at a time (the probe) reach a node that
// does not answer; here two calls for one paused shard's keys, both
// started after its breaker opened, must not wait out the timeout side by
// side.
//
// It FAILS on 4d33a5d (3 of 3 runs, 14 and 15 overlapping calls per
// shard), and passes with sweepRing never run: the finding is sweepRing's
// (504e874), not the change's. It is skipped unless
// SLOTBOOK_REVIEW_PROVED=1 until sweepRing is fixed.
func TestReviewSweep50RingRetiredWhileRouted(t *testing.T) {
	if os.Getenv("SLOTBOOK_REVIEW_PROVED") != "1" {
		t.Skip("helper-154's finding, open: sweepRing retires a shard the Ring still routes to (set SLOTBOOK_REVIEW_PROVED=1)")
	}
	t.Parallel()
	srv := []*redistest.Server{redistest.Start(t), redistest.Start(t), redistest.Start(t)}
	ring := redis.NewRing(&redis.RingOptions{
		Addrs:                 map[string]string{"a": srv[0].Addr, "b": srv[1].Addr, "c": srv[2].Addr},
		ContextTimeoutEnabled: true, MaxRetries: -1, HeartbeatFrequency: 10 * time.Millisecond,
		DialTimeout: 500 * time.Millisecond, ReadTimeout: 500 * time.Millisecond, WriteTimeout: 500 * time.Millisecond})
	t.Cleanup(func() { _ = ring.Close() })
	const timeout = 150 * time.Millisecond
	eng, err := throttle.New(ring, throttle.WithPrefix(redistest.Prefix(t)), throttle.WithTimeout(timeout),
		throttle.WithProbeBackoff(10*time.Millisecond, 50*time.Millisecond))
	require.NoError(t, err)
	ctx := context.Background()
	lim := throttle.PerSecond(100000, 100000)
	var keys []string // two per paused shard
	for _, s := range srv[:2] {
		for i, n := 0, 0; n < 2; i++ {
			require.Less(t, i, 5000, "keys on %s", s.Addr)
			if eng.Node(ctx, sw50Key(i)) == s.Addr {
				keys = append(keys, sw50Key(i))
				n++
			}
		}
	}
	for _, k := range keys {
		redistest.UntilOK(t, func() error { _, err := eng.Allow(ctx, k, lim); return err })
	}
	home := map[string]string{}
	for _, k := range keys {
		home[k] = eng.Node(ctx, k)
	}

	var mu sync.Mutex // guards slow
	var slow []sw50Slow
	stop := make(chan struct{})
	var wg sync.WaitGroup
	for _, k := range keys {
		for g := 0; g < 3; g++ {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for {
					select {
					case <-stop:
						return
					default:
					}
					start := time.Now()
					_, err := eng.Allow(ctx, k, lim)
					end := time.Now()
					if err != nil && end.Sub(start) >= timeout*9/10 {
						mu.Lock()
						slow = append(slow, sw50Slow{k, start, end})
						mu.Unlock()
					}
					if err != nil {
						time.Sleep(time.Millisecond)
					}
				}
			}()
		}
	}
	for _, s := range srv[:2] {
		require.NoError(t, syscall.Kill(s.Pid(), syscall.SIGSTOP))
	}
	defer func() {
		for _, s := range srv[:2] {
			_ = syscall.Kill(s.Pid(), syscall.SIGCONT)
		}
	}()
	// Until the Ring routes every key away from the paused shards, and a
	// little longer.
	require.Eventually(t, func() bool {
		for _, k := range keys {
			if eng.Node(ctx, k) == home[k] {
				return false
			}
		}
		return true
	}, 15*time.Second, 5*time.Millisecond, "the Ring routes the paused shards' keys elsewhere")
	time.Sleep(2 * timeout)
	close(stop)
	wg.Wait()

	// Per paused shard: the first slow call's end is when its breaker had
	// opened at the latest; slow calls started after it overlap only if
	// the breaker was closed with the shard still paused.
	for _, node := range []string{srv[0].Addr, srv[1].Addr} {
		var calls []sw50Slow
		for _, c := range slow {
			if home[c.key] == node {
				calls = append(calls, c)
			}
		}
		require.NotEmpty(t, calls, "calls for %s paid the timeout at first", node)
		opened := calls[0].end
		for _, c := range calls {
			if c.end.Before(opened) {
				opened = c.end
			}
		}
		var after []sw50Slow
		for _, c := range calls {
			if c.start.After(opened) {
				after = append(after, c)
			}
		}
		sort.Slice(after, func(i, j int) bool { return after[i].start.Before(after[j].start) })
		overlaps := 0
		for i := 1; i < len(after); i++ {
			if after[i].start.Before(after[i-1].end) {
				overlaps++
			}
		}
		t.Logf("%s: %d slow calls, %d after its breaker opened, %d of them side by side with another", node, len(calls), len(after), overlaps)
		require.Zero(t, overlaps, "calls for paused shard %s waited out the timeout side by side after its breaker opened", node)
	}
}
