package throttle_test

// Review (helper F42) of 03a3acc: the Cluster slot-map sweep runs on a
// goroutine of its own (Engine.sweep / sweepNow), and WithPrefix refuses
// braces. Attacked through the public API on real Redis Clusters
// (redistest.StartCluster): a failover with the default client and with
// one that reloads its slot map hourly, a hung master while calls keep
// coming (how many sweep goroutines live at once, and after the calls
// stop), an engine without a timeout (WithTimeout(0)) whose client has no
// read timeout of its own, a plain client (no sweep), and prefixes.
//
// Sweep goroutines are counted precisely from the goroutine dump: those
// running throttle.(*Engine).sweepNow with a given engine as receiver.

import (
	"context"
	"errors"
	"fmt"
	"net"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/slotbook/slotbook/internal/redistest"
	"github.com/slotbook/slotbook/throttle"
)

// swSweepers counts the goroutines running eng's sweepNow.
func swSweepers(eng *throttle.Engine) int {
	buf := make([]byte, 1<<20)
	for {
		n := runtime.Stack(buf, true)
		if n < len(buf) {
			buf = buf[:n]
			break
		}
		buf = make([]byte, 2*len(buf))
	}
	needle := fmt.Sprintf("throttle.(*Engine).sweepNow(%p", eng)
	c := 0
	for _, g := range strings.Split(string(buf), "\n\n") {
		if strings.Contains(g, needle) {
			c++
		}
	}
	return c
}

// swSampler samples swSweepers(eng) every few milliseconds until stop,
// and keeps the largest count.
type swSampler struct {
	max  atomic.Int64
	stop chan struct{}
	done chan struct{}
}

func swSample(engs ...*throttle.Engine) []*swSampler {
	var out []*swSampler
	for _, eng := range engs {
		s := &swSampler{stop: make(chan struct{}), done: make(chan struct{})}
		go func() {
			defer close(s.done)
			for {
				if n := int64(swSweepers(eng)); n > s.max.Load() {
					s.max.Store(n)
				}
				select {
				case <-s.stop:
					return
				case <-time.After(5 * time.Millisecond):
				}
			}
		}()
		out = append(out, s)
	}
	return out
}

func (s *swSampler) end() int {
	close(s.stop)
	<-s.done
	return int(s.max.Load())
}

// swSigstop stops node i of the cluster (SIGSTOP: it hangs, connections
// accepted by the kernel, no answer) and returns its resume, also run
// when the test ends (before the node is stopped for good).
func swSigstop(t *testing.T, cluster *redistest.Cluster, i int) (resume func()) {
	t.Helper()
	pid := cluster.Node(i).Pid()
	require.NoError(t, syscall.Kill(pid, syscall.SIGSTOP))
	var once sync.Once
	resume = func() { once.Do(func() { _ = syscall.Kill(pid, syscall.SIGCONT) }) }
	t.Cleanup(resume)
	return resume
}

// swClusterOK waits until every node in idx reports cluster_state:ok.
func swClusterOK(t *testing.T, cluster *redistest.Cluster, idx ...int) {
	t.Helper()
	for _, i := range idx {
		c := cluster.Node(i).Client(t)
		require.Eventually(t, func() bool {
			info, err := c.ClusterInfo(context.Background()).Result()
			return err == nil && strings.Contains(info, "cluster_state:ok")
		}, 30*time.Second, 50*time.Millisecond, "node %d cluster_state:ok", i)
	}
}

// requireEngineWideAlternates checks that engine-wide changes alternate,
// open first, and end closed.
func requireEngineWideAlternates(t *testing.T, got []bool) {
	t.Helper()
	require.NotEmpty(t, got)
	for i, open := range got {
		require.Equal(t, i%2 == 0, open, "engine-wide change %d: %v", i, got)
	}
	require.False(t, got[len(got)-1], "engine-wide ends closed: %v", got)
}

// TestReviewSWFailoverBothClients: one failover (master 0 stopped, its
// replica takes over), two engines watching it at once: one on the
// default cluster client (the control), one on a client that would not
// reload its slot map for an hour. Four goroutines per engine keep
// calling (the subject of the dead master and subjects elsewhere). Both
// engines must serve the subject again from the promoted replica within
// the same order of time, the dead master's breaker must close (observer
// changes alternate, open first, end closed; Unavailable false; gauges 0),
// sweeps must not pile up (at most timeout/max+2 at once), and none may be
// left once the timeout has passed after the last call.
func TestReviewSWFailoverBothClients(t *testing.T) {
	cluster, rc := withReplica(t)
	ctx := context.Background()
	ccDef := cluster.Client(t)
	ccHour := redis.NewClusterClient(&redis.ClusterOptions{Addrs: cluster.Addrs, ContextTimeoutEnabled: true,
		ClusterStateReloadInterval: time.Hour})
	t.Cleanup(func() { _ = ccHour.Close() })
	const timeout = time.Second
	lim := throttle.PerSecond(100000, 100000)
	old := cluster.Addrs[0]
	repAddr := rc.Options().Addr

	type side struct {
		name    string
		cc      *redis.ClusterClient
		eng     *throttle.Engine
		obs     teeObserver
		reg     *prometheus.Registry
		subject string
		servedN atomic.Int64 // ns after the takeover of the subject's first success
		flaps   atomic.Int64 // failures of the subject after its first success
	}
	var sides []*side
	for _, x := range []struct {
		name string
		cc   *redis.ClusterClient
	}{{"default", ccDef}, {"hour", ccHour}} {
		s := &side{name: x.name, cc: x.cc}
		obs, reg := newTee(t)
		s.obs = obs
		s.reg = reg
		var err error
		s.eng, err = throttle.New(x.cc, throttle.WithObserver(obs), throttle.WithTimeout(timeout))
		require.NoError(t, err)
		s.subject = subjectOn(t, x.cc, throttle.DefaultPrefix, old)
		redistest.UntilOK(t, func() error { _, err := s.eng.Allow(ctx, s.subject, lim); return err })
		for i := 0; i < 20; i++ {
			redistest.UntilOK(t, func() error { _, err := s.eng.Allow(ctx, "w"+strconv.Itoa(i), lim); return err })
		}
		obs.reset()
		sides = append(sides, s)
	}
	baseG := runtime.NumGoroutine()

	cluster.Node(0).Stop()
	for _, s := range sides {
		_, err := s.eng.Allow(ctx, s.subject, lim)
		require.ErrorIs(t, err, throttle.ErrUnavailable, "%s: a call to the stopped master", s.name)
		open, _ := s.eng.Unavailable()
		require.True(t, open, "%s: the stopped master's breaker is open", s.name)
	}
	samplers := swSample(sides[0].eng, sides[1].eng)
	require.NoError(t, rc.Do(ctx, "CLUSTER", "FAILOVER", "TAKEOVER").Err())
	tookOver := time.Now()

	stop := make(chan struct{})
	var wg sync.WaitGroup
	var maxG atomic.Int64
	for _, s := range sides {
		for g := 0; g < 4; g++ {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for i := 0; ; i++ {
					select {
					case <-stop:
						return
					default:
					}
					key := s.subject
					if g > 0 {
						key = fmt.Sprintf("o%d-%d", g, i%50)
					}
					_, err := s.eng.Allow(ctx, key, lim)
					if g == 0 {
						if err == nil && s.servedN.Load() == 0 {
							s.servedN.Store(int64(max(time.Since(tookOver), 1)))
						} else if err != nil && s.servedN.Load() != 0 {
							s.flaps.Add(1)
						}
					}
					if n := int64(runtime.NumGoroutine()); n > maxG.Load() {
						maxG.Store(n)
					}
					time.Sleep(2 * time.Millisecond)
				}
			}()
		}
	}
	deadline := time.Now().Add(40 * time.Second)
	for time.Now().Before(deadline) && (sides[0].servedN.Load() == 0 || sides[1].servedN.Load() == 0) {
		time.Sleep(20 * time.Millisecond)
	}
	time.Sleep(2 * time.Second) // calls go on after both serve again
	close(stop)
	wg.Wait()
	maxSweep := []int{samplers[0].end(), samplers[1].end()}

	m := masters(t, ccDef)
	t.Logf("masters after the takeover: %v (replica %s, old %s)", m, repAddr, old)
	for i, s := range sides {
		t.Logf("%s client: subject served again %v after the takeover; %d failures of it after that; node changes %v; engine-wide %v; most sweep goroutines at once %d",
			s.name, time.Duration(s.servedN.Load()), s.flaps.Load(), s.obs.getNodes(), s.obs.get(), maxSweep[i])
	}
	t.Logf("goroutines: %d before the outage, at most %d during it", baseG, maxG.Load())
	for i, s := range sides {
		require.NotZero(t, s.servedN.Load(), "%s client: the promoted replica never served the subject (changes %v)", s.name, s.obs.getNodes())
		// timeout 1 s, sweep at most every 400 ms: at most 3 under way.
		require.LessOrEqual(t, maxSweep[i], int(timeout/throttle.DefaultProbeMax)+2, "%s: sweep goroutines at once", s.name)
	}
	require.LessOrEqual(t, time.Duration(sides[1].servedN.Load()), time.Duration(sides[0].servedN.Load())+5*time.Second,
		"the hourly-reload client served again much later than the default client")

	// Calls for many subjects: every breaker ends closed.
	for _, s := range sides {
		for i := 0; i < 20; i++ {
			redistest.UntilOK(t, func() error { _, err := s.eng.Allow(ctx, "s"+strconv.Itoa(i), lim); return err })
		}
		redistest.UntilOK(t, func() error { _, err := s.eng.Allow(ctx, s.subject, lim); return err })
	}
	for _, s := range sides {
		var open bool
		require.Eventually(t, func() bool {
			_, _ = s.eng.Allow(ctx, "z", lim)
			open, _ = s.eng.Unavailable()
			return !open
		}, 10*time.Second, 50*time.Millisecond, "%s: a breaker stays open: %v", s.name, s.obs.getNodes())
		requireAllClosed(t, s.eng, s.obs, s.reg, old)
		requireEngineWideAlternates(t, s.obs.get())
		f, _ := s.eng.UnavailableFor(ctx, s.subject)
		require.False(t, f, "%s: UnavailableFor the subject", s.name)
	}
	// No sweep outlives the last call by more than the timeout. The last
	// call is the last of the checks above (a call starts a sweep while a
	// breaker is open, as it may still be during them), not the callers'
	// last, which those checks follow by as long as they take.
	lastCall := time.Now()
	time.Sleep(time.Until(lastCall.Add(timeout + 500*time.Millisecond)))
	for _, s := range sides {
		require.Zero(t, swSweepers(s.eng), "%s: sweep goroutines alive %v after the last call (timeout %v)", s.name, time.Since(lastCall), timeout)
	}
}

// TestReviewSWHungMaster (subtest "timeout0" FAILS on 03a3acc; "bounded"
// passes): master 0 hangs (SIGSTOP) for a few seconds
// while callers keep calling its subject and subjects of the other
// masters. The sweep reads the slot map every max probe interval, and
// go-redis may ask the hung master: each such sweep waits out the
// engine's timeout. Sweep goroutines must stay bounded (timeout/max + 2 at
// once) and be gone within the timeout after the calls stop, for an
// engine with the default probe backoff (the control) and one whose max
// interval is far below its timeout; callers of the live masters of the
// first engine (1 s timeout) are all served.
//
// Then (part "timeout0"): the same cluster with master 2 killed (its
// breaker opens: connections refused) and master 1 hung, through clients
// with no read timeout of their own (ReadTimeout: -1, as a client that
// leaves every bound to the caller's context has). An engine with
// WithTimeout(0) ("no bound beyond the caller's context and the client's
// own timeouts") has its sweeps run on context.WithoutCancel of the
// caller's: no deadline. Every caller has a 1 s deadline. The control is
// an engine with WithTimeout(300ms) on a client built the same way.
func TestReviewSWHungMaster(t *testing.T) {
	cluster := redistest.StartCluster(t, 3, "--cluster-require-full-coverage", "no")
	ctx := context.Background()
	lim := throttle.PerSecond(100000, 100000)

	t.Run("bounded", func(t *testing.T) {
		ccA, ccB := cluster.Client(t), cluster.Client(t)
		const toA, toB = time.Second, 300 * time.Millisecond
		const maxB = 20 * time.Millisecond
		engA, err := throttle.New(ccA, throttle.WithTimeout(toA))
		require.NoError(t, err)
		engB, err := throttle.New(ccB, throttle.WithTimeout(toB), throttle.WithProbeBackoff(5*time.Millisecond, maxB))
		require.NoError(t, err)
		hung := subjectOn(t, ccA, throttle.DefaultPrefix, cluster.Addrs[0])
		live := []string{subjectOn(t, ccA, throttle.DefaultPrefix, cluster.Addrs[1]), subjectOn(t, ccA, throttle.DefaultPrefix, cluster.Addrs[2])}
		for _, eng := range []*throttle.Engine{engA, engB} {
			for _, s := range append([]string{hung}, live...) {
				redistest.UntilOK(t, func() error { _, err := eng.Allow(ctx, s, lim); return err })
			}
		}
		baseG := runtime.NumGoroutine()
		samplers := swSample(engA, engB)
		resume := swSigstop(t, cluster, 0)
		hungAt := time.Now()
		var liveFail atomic.Int64
		var liveErrs sync.Map
		var wg sync.WaitGroup
		var maxG atomic.Int64
		for gi, eng := range []*throttle.Engine{engA, engB} {
			for g := 0; g < 3; g++ {
				wg.Add(1)
				go func() {
					defer wg.Done()
					for i := 0; time.Since(hungAt) < 3500*time.Millisecond; i++ {
						key := hung
						if g > 0 {
							key = live[g-1]
						}
						_, err := eng.Allow(ctx, key, lim)
						if g > 0 && gi == 0 && err != nil {
							liveFail.Add(1)
							liveErrs.Store(err.Error(), true)
						}
						if n := int64(runtime.NumGoroutine()); n > maxG.Load() {
							maxG.Store(n)
						}
						time.Sleep(time.Millisecond)
					}
				}()
			}
		}
		wg.Wait()
		lastCall := time.Now()
		mA, mB := samplers[0].end(), samplers[1].end()
		openA, _ := engA.Unavailable()
		t.Logf("goroutines: %d before, at most %d during the hang; most sweep goroutines at once: default backoff %d, max %v: %d; engine A breaker open %v",
			baseG, maxG.Load(), mA, maxB, mB, openA)
		var errs []string
		liveErrs.Range(func(k, _ any) bool { errs = append(errs, k.(string)); return true })
		require.True(t, openA, "the hung master's breaker opened")
		require.Zero(t, liveFail.Load(), "callers of live masters failed during the hang: %v", errs)
		require.LessOrEqual(t, mA, int(toA/throttle.DefaultProbeMax)+2, "sweep goroutines at once, default backoff")
		require.LessOrEqual(t, mB, int(toB/maxB)+2, "sweep goroutines at once, max %v", maxB)
		time.Sleep(time.Until(lastCall.Add(toA + 500*time.Millisecond)))
		a, b := swSweepers(engA), swSweepers(engB)
		require.Zero(t, a+b, "sweep goroutines alive %v after the last call (timeouts %v, %v): %d, %d", time.Since(lastCall), toA, toB, a, b)
		resume()
		swClusterOK(t, cluster, 0, 1, 2)
	})

	t.Run("timeout0", func(t *testing.T) {
		noRT := func() *redis.ClusterClient {
			cc := redis.NewClusterClient(&redis.ClusterOptions{Addrs: cluster.Addrs, ContextTimeoutEnabled: true,
				ReadTimeout: -1, WriteTimeout: -1})
			t.Cleanup(func() { _ = cc.Close() })
			return cc
		}
		ccZ, ccC := noRT(), noRT()
		const maxP = 100 * time.Millisecond
		engZ, err := throttle.New(ccZ, throttle.WithTimeout(0), throttle.WithProbeBackoff(5*time.Millisecond, maxP))
		require.NoError(t, err)
		engC, err := throttle.New(ccC, throttle.WithTimeout(300*time.Millisecond), throttle.WithProbeBackoff(5*time.Millisecond, maxP))
		require.NoError(t, err)
		cc := cluster.Client(t)
		ok0 := subjectOn(t, cc, throttle.DefaultPrefix, cluster.Addrs[0])
		dead2 := subjectOn(t, cc, throttle.DefaultPrefix, cluster.Addrs[2])
		for _, eng := range []*throttle.Engine{engZ, engC} {
			for _, s := range []string{ok0, dead2} {
				redistest.UntilOK(t, func() error { _, err := eng.Allow(ctx, s, lim); return err })
			}
		}
		baseG := runtime.NumGoroutine()
		cluster.Node(2).Stop()
		for _, eng := range []*throttle.Engine{engZ, engC} {
			require.Eventually(t, func() bool {
				_, err := eng.Allow(ctx, dead2, lim)
				open, _ := eng.UnavailableFor(ctx, dead2)
				return err != nil && open
			}, 10*time.Second, 10*time.Millisecond, "the killed master's breaker opens")
		}
		swSigstop(t, cluster, 1)
		start := time.Now()
		var wg sync.WaitGroup
		for _, eng := range []*throttle.Engine{engZ, engC} {
			for _, key := range []string{ok0, dead2} {
				wg.Add(1)
				go func() {
					defer wg.Done()
					for time.Since(start) < 2*time.Second {
						cctx, cancel := context.WithTimeout(ctx, time.Second)
						_, _ = eng.Allow(cctx, key, lim)
						cancel()
						time.Sleep(2 * time.Millisecond)
					}
				}()
			}
		}
		wg.Wait()
		lastCall := time.Now()
		// Every caller's deadline (1 s) has passed, and the control's
		// timeout (300 ms) many times over.
		time.Sleep(1500 * time.Millisecond)
		z1, c1 := swSweepers(engZ), swSweepers(engC)
		time.Sleep(2 * time.Second)
		z2, c2 := swSweepers(engZ), swSweepers(engC)
		t.Logf("goroutines: %d before, %d now; sweep goroutines of the WithTimeout(0) engine %v / %v after the last call: %d / %d; of the WithTimeout(300ms) control: %d / %d",
			baseG, runtime.NumGoroutine(), 1500*time.Millisecond, time.Since(lastCall), z1, z2, c1, c2)
		require.Zero(t, c2, "control: sweep goroutines of the engine with a timeout")
		require.Zero(t, z2, "WithTimeout(0), a client without a read timeout: %d sweep goroutines still hang on the stopped master %v after the last call "+
			"(every caller had a 1 s deadline; %d were alive %v earlier: none ended), one more each time the sweep comes due and go-redis asks that master; "+
			"the sweep drops the caller's deadline (context.WithoutCancel) and has no bound of its own", z2, time.Since(lastCall), z1, 2*time.Second)
	})
}

// TestReviewSWPlainNoSweep: a plain client (no Cluster) never starts a
// sweep: with the server stopped and calls coming for a second, no sweep
// goroutine runs, and the goroutine count stays near its control.
func TestReviewSWPlainNoSweep(t *testing.T) {
	srv := redistest.Start(t)
	rdb := srv.Client(t)
	eng, err := throttle.New(rdb, throttle.WithTimeout(200*time.Millisecond), throttle.WithProbeBackoff(time.Millisecond, 5*time.Millisecond))
	require.NoError(t, err)
	ctx := context.Background()
	lim := throttle.PerSecond(1000, 1000)
	redistest.UntilOK(t, func() error { _, err := eng.Allow(ctx, "k", lim); return err })
	base := runtime.NumGoroutine()
	srv.Stop()
	s := swSample(eng)[0]
	var maxG int
	for t0 := time.Now(); time.Since(t0) < time.Second; {
		_, err := eng.Allow(ctx, "k", lim)
		require.Error(t, err)
		maxG = max(maxG, runtime.NumGoroutine())
		time.Sleep(time.Millisecond)
	}
	m := s.end()
	open, _ := eng.Unavailable()
	t.Logf("goroutines %d before, at most %d during the outage; sweep goroutines at most %d; open %v", base, maxG, m, open)
	require.True(t, open)
	require.Zero(t, m, "sweep goroutines for a plain client")
	require.LessOrEqual(t, maxG, base+10, "goroutines grew during the outage")
}

// TestReviewSWPrefix: every prefix the docs, examples and commands use is
// accepted; one with a brace is refused by New, with the prefix named,
// before any Redis call (a hook counts them); an engine built with an
// accepted prefix reports it; lease and httplimit take an engine, so the
// refusal is New's.
func TestReviewSWPrefix(t *testing.T) {
	var calls atomic.Int64
	rdb := redis.NewClient(&redis.Options{Addr: "127.0.0.1:1", ContextTimeoutEnabled: true})
	rdb.AddHook(swCountHook{&calls})
	t.Cleanup(func() { _ = rdb.Close() })
	for _, p := range []string{throttle.DefaultPrefix, "", "slotbook-demo:" + strconv.FormatInt(time.Now().UnixNano(), 36) + ":",
		"slotbench:run1:", "rate:", "rate:run1:", redistest.Prefix(t), "t:TestX/sub_name:", "a b:", "\xff:", "[x]:", "(x):"} {
		eng, err := throttle.New(rdb, throttle.WithPrefix(p))
		require.NoError(t, err, "prefix %q", p)
		require.Equal(t, p, eng.Prefix())
	}
	for _, p := range []string{"{", "}", "{a}", "a{", "a}", "slotbook:{tenant}:", "}{", "\xff{", "x:{}:"} {
		_, err := throttle.New(rdb, throttle.WithPrefix(p))
		require.Error(t, err, "prefix %q", p)
		require.Contains(t, err.Error(), fmt.Sprintf("%q", p), "the error names the prefix")
		// Given after other options, and before: refused all the same.
		_, err = throttle.New(rdb, throttle.WithTimeout(time.Second), throttle.WithPrefix("ok:"), throttle.WithPrefix(p))
		require.Error(t, err, "prefix %q last", p)
	}
	// Fullwidth braces are not Redis's hash-tag bytes: accepted.
	_, err := throttle.New(rdb, throttle.WithPrefix("\uff5bx\uff5d:"))
	require.NoError(t, err)
	require.Zero(t, calls.Load(), "Redis calls made while building engines")
	var ie error = throttle.ErrInvalidRequest
	_, err = throttle.New(rdb, throttle.WithPrefix("{a}"))
	t.Logf("refusal: %v (matches ErrInvalidRequest: %v)", err, errors.Is(err, ie))
}

type swCountHook struct{ n *atomic.Int64 }

func (h swCountHook) DialHook(next redis.DialHook) redis.DialHook {
	return func(ctx context.Context, network, addr string) (net.Conn, error) {
		h.n.Add(1)
		return next(ctx, network, addr)
	}
}
func (h swCountHook) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error { h.n.Add(1); return next(ctx, cmd) }
}
func (h swCountHook) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error { h.n.Add(1); return next(ctx, cmds) }
}
