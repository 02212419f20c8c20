package throttle_test

import (
	"context"
	"fmt"
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
	"github.com/slotbook/slotbook/metrics"
	"github.com/slotbook/slotbook/throttle"
)

// teeObserver tells every breaker change to a nodeLog and to a metrics
// Collector.
type teeObserver struct {
	*nodeLog
	m *metrics.Collector
}

func (o teeObserver) ObserveBreaker(open bool) {
	o.nodeLog.ObserveBreaker(open)
	o.m.ObserveBreaker(open)
}

func (o teeObserver) ObserveNodeBreaker(node string, open bool) {
	o.nodeLog.ObserveNodeBreaker(node, open)
	o.m.ObserveNodeBreaker(node, open)
}

// newTee returns a teeObserver and the registry its Collector is in.
func newTee(t *testing.T) (teeObserver, *prometheus.Registry) {
	t.Helper()
	m, err := metrics.New()
	require.NoError(t, err)
	reg := prometheus.NewRegistry()
	reg.MustRegister(m)
	return teeObserver{nodeLog: &nodeLog{}, m: m}, reg
}

// breakerGauges returns slotbook_breaker_open by node.
func breakerGauges(t *testing.T, reg *prometheus.Registry) map[string]float64 {
	t.Helper()
	mfs, err := reg.Gather()
	require.NoError(t, err)
	out := map[string]float64{}
	for _, mf := range mfs {
		if mf.GetName() != "slotbook_breaker_open" {
			continue
		}
		for _, mt := range mf.GetMetric() {
			for _, lp := range mt.GetLabel() {
				if lp.GetName() == "node" {
					out[lp.GetValue()] = mt.GetGauge().GetValue()
				}
			}
		}
	}
	return out
}

// requireAlternates checks that node's changes in log alternate, open
// first, and end closed.
func requireAlternates(t *testing.T, log []nodeChange, node string) {
	t.Helper()
	var got []bool
	for _, c := range log {
		if c.node == node {
			got = append(got, c.open)
		}
	}
	require.NotEmpty(t, got, "no change of %s's breaker: %v", node, log)
	for i, open := range got {
		require.Equal(t, i%2 == 0, open, "change %d of %s's breaker (all: %v)", i, node, log)
	}
	require.False(t, got[len(got)-1], "%s's breaker ends closed: %v", node, log)
}

// stopAll stops (SIGSTOP) every node of the cluster, and returns a function
// that resumes them (also called when the test ends).
func stopAll(t *testing.T, cluster *redistest.Cluster, n int) (resume func()) {
	t.Helper()
	for i := 0; i < n; i++ {
		require.NoError(t, syscall.Kill(cluster.Node(i).Pid(), syscall.SIGSTOP))
	}
	resumed := false
	resume = func() {
		if resumed {
			return
		}
		resumed = true
		for i := 0; i < n; i++ {
			_ = syscall.Kill(cluster.Node(i).Pid(), syscall.SIGCONT)
		}
	}
	t.Cleanup(resume)
	return resume
}

// withReplica starts a 3-master cluster and a replica of its first
// master, in sync, and returns the cluster and a client of the replica.
func withReplica(t *testing.T) (*redistest.Cluster, *redis.Client) {
	t.Helper()
	cluster := redistest.StartCluster(t, 3)
	rc := cluster.AddReplica(t, 0).Client(t)
	waitReplicaSynced(t, rc)
	return cluster, rc
}

// masters returns the masters' addresses in cc's slot map, reloading it.
func masters(t *testing.T, cc *redis.ClusterClient) map[string]bool {
	t.Helper()
	var mu sync.Mutex
	out := map[string]bool{}
	err := cc.ForEachMaster(context.Background(), func(_ context.Context, m *redis.Client) error {
		mu.Lock()
		out[m.Options().Addr] = true
		mu.Unlock()
		return nil
	})
	require.NoError(t, err)
	return out
}

// requireAllClosed checks that the engine reports no breaker open, that
// node's breaker changes alternate and end closed, that the engine-wide
// report ends closed, and that every metrics gauge reads 0.
func requireAllClosed(t *testing.T, eng *throttle.Engine, obs teeObserver, reg *prometheus.Registry, node string) {
	t.Helper()
	// The engine reads the slot map, which retires the breaker, on a
	// goroutine of its own that a call starts once one is due: calls for
	// a while, until the last has ended.
	deadline := time.Now().Add(5 * time.Second)
	for open, _ := eng.Unavailable(); open && time.Now().Before(deadline); open, _ = eng.Unavailable() {
		_, _ = eng.Allow(context.Background(), "z", throttle.PerSecond(1000, 1000))
		time.Sleep(20 * time.Millisecond)
	}
	open, in := eng.Unavailable()
	g := breakerGauges(t, reg)
	t.Logf("node changes %v; engine-wide %v; gauges %v; Unavailable() = %v, %v", obs.getNodes(), obs.get(), g, open, in)
	require.False(t, open, "no call maps to %s any more, yet Unavailable() = true: its breaker never closes (changes %v)", node, obs.getNodes())
	requireAlternates(t, obs.getNodes(), node)
	engineWide := obs.get()
	require.NotEmpty(t, engineWide)
	require.False(t, engineWide[len(engineWide)-1], "the engine-wide report ends with the last breaker closing: %v", engineWide)
	require.Contains(t, g, node)
	for n, v := range g {
		require.Zero(t, v, "slotbook_breaker_open{node=%q}", n)
	}
}

// failover is what failOver leaves: an engine on the cluster client, its
// observer and metrics, the address of the master it lost, a subject of
// that master, and a limit for calls.
type failover struct {
	eng          *throttle.Engine
	obs          teeObserver
	reg          *prometheus.Registry
	old, subject string
	lim          throttle.Limit
}

// failOver serves a subject of the cluster's first master through an
// engine on cc, stops that master, sees a call for the subject fail as
// unavailable (its breaker open), and has the replica (rc) take over.
func failOver(t *testing.T, cluster *redistest.Cluster, rc *redis.Client, cc *redis.ClusterClient) failover {
	t.Helper()
	ctx := context.Background()
	f := failover{old: cluster.Addrs[0], lim: throttle.PerSecond(1000, 1000)}
	f.obs, f.reg = newTee(t)
	var err error
	// A generous timeout: a busy machine.
	f.eng, err = throttle.New(cc, throttle.WithObserver(f.obs), throttle.WithTimeout(time.Second))
	require.NoError(t, err)
	f.subject = subjectOn(t, cc, throttle.DefaultPrefix, f.old)
	redistest.UntilOK(t, func() error { _, err := f.eng.Allow(ctx, f.subject, f.lim); return err })

	cluster.Node(0).Stop()
	_, err = f.eng.Allow(ctx, f.subject, f.lim)
	require.ErrorIs(t, err, throttle.ErrUnavailable, "a call to the stopped master")
	open, _ := f.eng.Unavailable()
	require.True(t, open, "the stopped master's breaker is open")
	require.NoError(t, rc.Do(ctx, "CLUSTER", "FAILOVER", "TAKEOVER").Err())
	return f
}

// TestStaleRetiredMasterBreakerCloses: a master dies, its breaker opens,
// and its replica takes its slots over (CLUSTER FAILOVER TAKEOVER). Once
// the client's slot map names the replica (here the test reloads it, as
// the client does itself every minute) and the engine's cache of the
// slot has expired, no call maps to the dead master's address, so no
// probe can close its breaker: the engine closes it when the slot map no
// longer names the address as a master, tells the observer (node and
// engine-wide, in order), and Unavailable and the metrics gauge read the
// outage's end.
func TestStaleRetiredMasterBreakerCloses(t *testing.T) {
	t.Parallel()
	cluster, rc := withReplica(t)
	ctx := context.Background()
	cc := cluster.Client(t)
	f := failOver(t, cluster, rc, cc)
	eng, obs, reg, old, subject, lim := f.eng, f.obs, f.reg, f.old, f.subject, f.lim
	repAddr := rc.Options().Addr
	require.Eventually(t, func() bool { m := masters(t, cc); return m[repAddr] && !m[old] },
		30*time.Second, 50*time.Millisecond, "the client's slot map names the promoted replica")
	// Past the engine's slot cache (1 s): the subject's slot is looked up
	// again, on the promoted replica.
	time.Sleep(1500 * time.Millisecond)

	redistest.UntilOK(t, func() error { _, err := eng.Allow(ctx, subject, lim); return err })
	for i := 0; i < 20; i++ {
		redistest.UntilOK(t, func() error { _, err := eng.Allow(ctx, "s"+strconv.Itoa(i), lim); return err })
	}
	requireAllClosed(t, eng, obs, reg, old)
	forSubject, _ := eng.UnavailableFor(ctx, subject)
	require.False(t, forSubject, "UnavailableFor the subject the promoted replica serves")
}

// TestStaleFailoverServed: the same failover, with a client that would
// not reload its slot map by itself for an hour: while the dead master's
// breaker is open the engine reads the map (at most once per probe
// interval), which reloads it, so the promoted replica serves the
// subject, and the dead master's breaker closes.
func TestStaleFailoverServed(t *testing.T) {
	t.Parallel()
	cluster, rc := withReplica(t)
	ctx := context.Background()
	cc := redis.NewClusterClient(&redis.ClusterOptions{Addrs: cluster.Addrs, ContextTimeoutEnabled: true,
		ClusterStateReloadInterval: time.Hour})
	t.Cleanup(func() { _ = cc.Close() })
	f := failOver(t, cluster, rc, cc)
	eng, obs, reg, old, subject, lim := f.eng, f.obs, f.reg, f.old, f.subject, f.lim
	tookOver := time.Now()
	// The promoted replica serves the subject once it has told the
	// cluster; the engine's calls must find it.
	require.Eventually(t, func() bool { _, err := eng.Allow(ctx, subject, lim); return err == nil },
		30*time.Second, 50*time.Millisecond, "the subject never served by the promoted replica (changes %v)", obs.getNodes())
	t.Logf("served again %v after the takeover", time.Since(tookOver))
	for i := 0; i < 20; i++ {
		redistest.UntilOK(t, func() error { _, err := eng.Allow(ctx, "s"+strconv.Itoa(i), lim); return err })
	}
	requireAllClosed(t, eng, obs, reg, old)
}

// TestStalePseudoNodeBreakerCloses: while a Cluster client cannot read
// its slot map (every node stopped before its first use), calls are
// counted against the pseudo-node "cluster", whose breaker opens. Once the
// map can be read no call maps to "cluster" again: the engine closes that
// breaker when it reads the map, tells the observer, and Unavailable and
// slotbook_breaker_open{node="cluster"} read the outage's end.
func TestStalePseudoNodeBreakerCloses(t *testing.T) {
	t.Parallel()
	cluster := redistest.StartCluster(t, 3)
	cc := cluster.Client(t) // not used yet: no slot map read
	obs, reg := newTee(t)
	eng, err := throttle.New(cc, throttle.WithObserver(obs))
	require.NoError(t, err)
	ctx := context.Background()
	lim := throttle.PerSecond(1000, 1000)

	resume := stopAll(t, cluster, 3)
	_, err = eng.Allow(ctx, "s1", lim)
	resume()
	require.ErrorIs(t, err, throttle.ErrUnavailable, "a call while every node was stopped")
	require.Equal(t, []nodeChange{{"cluster", true}}, obs.getNodes())

	redistest.UntilOK(t, func() error { _, err := eng.Allow(ctx, "s1", lim); return err })
	for i := 0; i < 20; i++ {
		redistest.UntilOK(t, func() error { _, err := eng.Allow(ctx, "s"+strconv.Itoa(i), lim); return err })
	}
	requireAllClosed(t, eng, obs, reg, "cluster")
}

// TestStaleUnreadableSlotMapFailsFast: while a Cluster client cannot read
// its slot map, the "cluster" breaker is open, and calls (and
// UnavailableFor, which FailClosed's retry-after reads) fail at once,
// rather than each trying to read the map within the engine's timeout.
func TestStaleUnreadableSlotMapFailsFast(t *testing.T) {
	t.Parallel()
	cluster := redistest.StartCluster(t, 3)
	cc := cluster.Client(t)
	// A long timeout, so that a call that waits for it stands out on a
	// busy machine, and no probe during the test.
	const timeout = time.Second
	eng, err := throttle.New(cc, throttle.WithTimeout(timeout), throttle.WithProbeBackoff(time.Minute, time.Minute))
	require.NoError(t, err)
	ctx := context.Background()
	lim := throttle.PerSecond(1000, 1000)
	stopAll(t, cluster, 3)
	t0 := time.Now()
	_, err = eng.Allow(ctx, "s1", lim)
	require.ErrorIs(t, err, throttle.ErrUnavailable, "the first call")
	t.Logf("the first call took %v", time.Since(t0))

	for i := 0; i < 5; i++ {
		t0 := time.Now()
		_, err := eng.Allow(ctx, "s"+strconv.Itoa(i), lim)
		d := time.Since(t0)
		require.ErrorIs(t, err, throttle.ErrUnavailable, "call %d", i)
		require.Less(t, d, timeout/2, "call %d with the breaker open took %v (the engine's timeout is %v)", i, d, timeout)
	}
	t0 = time.Now()
	open, in := eng.UnavailableFor(ctx, "s1")
	d := time.Since(t0)
	require.True(t, open, "UnavailableFor while the slot map cannot be read")
	require.Greater(t, in, time.Duration(0), "the next probe is ahead")
	require.Less(t, d, timeout/2, "UnavailableFor took %v", d)
}

// TestStaleUnreadableSlotMapOneLookup: while the slot map cannot be read
// (every node stopped before the client's first use), only the probe of
// the "cluster" breaker reads it. Before, a call that found the probe due
// read the map, paying the timeout, while another took the probe, and
// lookups went on while the probe was under way (due all that time): each
// such call was then refused by the open breaker after a timeout's wait,
// about four per probe. A call refused by the breaker must be refused at
// once.
func TestStaleUnreadableSlotMapOneLookup(t *testing.T) {
	t.Parallel()
	cluster := redistest.StartCluster(t, 3)
	cc := cluster.Client(t)                // not used yet: no slot map read
	const timeout = 200 * time.Millisecond // a wasted wait stands out on a busy machine
	eng, err := throttle.New(cc, throttle.WithTimeout(timeout))
	require.NoError(t, err)
	stopAll(t, cluster, 3)
	lim := throttle.PerSecond(1000, 1000)
	var calls, refused, wasted atomic.Int64
	stop := time.Now().Add(2 * time.Second)
	var wg sync.WaitGroup
	for g := 0; g < 8; g++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; time.Now().Before(stop); i++ {
				t0 := time.Now()
				_, err := eng.Allow(context.Background(), fmt.Sprintf("k%d-%d", g, i), lim)
				calls.Add(1)
				if err != nil && strings.Contains(err.Error(), "failing fast") {
					refused.Add(1)
					if time.Since(t0) >= timeout/2 {
						wasted.Add(1)
					}
				}
				time.Sleep(time.Millisecond)
			}
		}()
	}
	wg.Wait()
	t.Logf("%d calls, %d refused by the open breaker, %d of them after waiting half a timeout or more", calls.Load(), refused.Load(), wasted.Load())
	require.Positive(t, refused.Load(), "the breaker of \"cluster\" opened")
	require.Zero(t, wasted.Load(), "calls refused by the breaker after paying a slot-map lookup's timeout")
}

// TestStaleLoadOwnTimeouts: Load sends the engine's scripts within the
// engine's timeout as single calls are, not eight round trips under one
// timeout: with a round trip a fifth of the timeout, calls succeed and so
// does Load.
func TestStaleLoadOwnTimeouts(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	p := redistest.NewProxy(t, srv.Addr)
	const timeout = 200 * time.Millisecond
	p.SetLatency(timeout / 10) // a round trip of timeout/5: eight take 1.6 timeouts
	rdb := p.Client(t, srv)
	eng, err := throttle.New(rdb, throttle.WithTimeout(timeout))
	require.NoError(t, err)
	ctx := context.Background()
	redistest.UntilOK(t, func() error { _, err := eng.Allow(ctx, "k", throttle.PerSecond(10, 5)); return err }) // a warm connection
	okAllow, okLoad := 0, 0
	var last error
	for i := 0; i < 5; i++ {
		if _, err := eng.Allow(ctx, "k", throttle.PerSecond(10, 5)); err == nil {
			okAllow++
		}
		if last = eng.Load(ctx); last == nil {
			okLoad++
		}
	}
	t.Logf("round trip %v, timeout %v: Allow succeeded %d of 5, Load %d of 5 (last error: %v)", timeout/5, timeout, okAllow, okLoad, last)
	require.Positive(t, okAllow, "the control: single calls fit the timeout")
	require.Positive(t, okLoad, "single calls succeed (%d of 5) but Load never does: %v", okAllow, last)
}

// TestStaleLoadCluster: Load sends the scripts to every master of a
// Cluster.
func TestStaleLoadCluster(t *testing.T) {
	t.Parallel()
	cluster := redistest.StartCluster(t, 3)
	cc := cluster.Client(t)
	eng, err := throttle.New(cc, throttle.WithTimeout(5*time.Second))
	require.NoError(t, err)
	ctx := context.Background()
	redistest.UntilOK(t, func() error { return eng.Load(ctx) })
	for i := 0; i < 3; i++ {
		info, err := cluster.Node(i).Client(t).Info(ctx, "memory").Result()
		require.NoError(t, err)
		n := -1
		for _, line := range strings.Split(info, "\n") {
			if v, ok := strings.CutPrefix(strings.TrimSpace(line), "number_of_cached_scripts:"); ok {
				n, err = strconv.Atoi(v)
				require.NoError(t, err)
			}
		}
		require.GreaterOrEqual(t, n, 8, "scripts cached on master %s", cluster.Addrs[i])
	}
}

// TestLoadRingEveryShard: Load through a Ring sends the scripts to every
// shard (a keyless SCRIPT LOAD through a Ring goes to one shard at
// random: before, two shards held 2 and 6 of them), as many as Load
// through a plain client leaves on a fresh server.
func TestLoadRingEveryShard(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	a, b, control := redistest.Start(t), redistest.Start(t), redistest.Start(t)
	cached := func(s *redistest.Server) string {
		info, err := s.Client(t).Info(ctx, "memory").Result()
		require.NoError(t, err)
		for _, l := range strings.Split(info, "\r\n") {
			if v, ok := strings.CutPrefix(l, "number_of_cached_scripts:"); ok {
				return v
			}
		}
		t.Fatal("no number_of_cached_scripts in INFO memory")
		return ""
	}
	plain, err := throttle.New(control.Client(t), throttle.WithTimeout(2*time.Second))
	require.NoError(t, err)
	redistest.UntilOK(t, func() error { return plain.Load(ctx) })
	want := cached(control)

	ring := redis.NewRing(&redis.RingOptions{Addrs: map[string]string{"a": a.Addr, "b": b.Addr}, ContextTimeoutEnabled: true, MaxRetries: -1})
	t.Cleanup(func() { _ = ring.Close() })
	eng, err := throttle.New(ring, throttle.WithTimeout(2*time.Second))
	require.NoError(t, err)
	redistest.UntilOK(t, func() error { return eng.Load(ctx) })
	t.Logf("scripts cached: shard a %s, shard b %s, a plain client's server %s", cached(a), cached(b), want)
	require.Equal(t, want, cached(a), "shard a")
	require.Equal(t, want, cached(b), "shard b")
}
