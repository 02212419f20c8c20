package main

// Adversarial review of slotbench's figures (reviewer B42): does each
// published number count what its label says? Each test runs slotbench's
// own functions at a small size against a redis-server of its own
// (internal/redistest, 127.0.0.1 only) and checks the figures against a
// count made independently in the same run: INFO commandstats parsed here,
// the server's CPU read from /proc, grants counted around the load's own
// operation, keys listed on each Cluster node. The last tests check that
// BENCHMARKS.md and the README could come from the code as it is.
//
// Tests marked FAILS fail on the code reviewed (7c689a5); the others pass.

import (
	"context"
	"fmt"
	"math"
	"net"
	"os"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/slotbook/slotbook/internal/callcount"
	"github.com/slotbook/slotbook/internal/contention"
	"github.com/slotbook/slotbook/internal/redistest"
	"github.com/slotbook/slotbook/reserve"
	"github.com/slotbook/slotbook/throttle"
)

// ---------------------------------------------------------------------
// Independent instruments.

// rvCmdstats parses INFO commandstats itself: command -> {calls, usec}.
func rvCmdstats(t *testing.T, c *redis.Client) map[string][2]int64 {
	t.Helper()
	info, err := c.Info(context.Background(), "commandstats").Result()
	require.NoError(t, err)
	out := map[string][2]int64{}
	for _, line := range strings.Split(info, "\n") {
		line = strings.TrimSpace(line)
		rest, ok := strings.CutPrefix(line, "cmdstat_")
		if !ok {
			continue
		}
		name, fields, _ := strings.Cut(rest, ":")
		var v [2]int64
		for _, kv := range strings.Split(fields, ",") {
			k, s, _ := strings.Cut(kv, "=")
			n, _ := strconv.ParseInt(s, 10, 64)
			switch k {
			case "calls":
				v[0] = n
			case "usec":
				v[1] = n
			}
		}
		out[name] = v
	}
	return out
}

func rvDelta(a, b map[string][2]int64, cmds ...string) (calls, usec int64) {
	for _, c := range cmds {
		calls += b[c][0] - a[c][0]
		usec += b[c][1] - a[c][1]
	}
	return
}

// rvProcCPU is the process's user + system CPU in µs, from /proc (USER_HZ
// is 100 on Linux).
func rvProcCPU(t *testing.T, pid int) float64 {
	t.Helper()
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		t.Skipf("no /proc: %v", err)
	}
	s := string(b)
	f := strings.Fields(s[strings.LastIndexByte(s, ')')+1:])
	ut, _ := strconv.ParseFloat(f[11], 64)
	st, _ := strconv.ParseFloat(f[12], 64)
	return (ut + st) * 10_000
}

func rvServer(t *testing.T) (*redistest.Server, *redis.Client) {
	t.Helper()
	if testing.Short() {
		t.Skip("needs a redis-server: skipped with -short")
	}
	srv := redistest.Start(t)
	srv.RequireReal(t)
	return srv, srv.Client(t)
}

// ---------------------------------------------------------------------
// Percentiles.

// TestReviewSBPercentilesNearestRank (FAILS): percentiles() against the
// nearest-rank definition (the p-th percentile of n sorted values is the
// ceil(p*n)-th) on 1..100 ms, and against slotbench's own histogram, which
// does use nearest rank. percentiles takes s[floor(p*n)], one order
// statistic above: p99 of 100 samples is their maximum, p50 of two is the
// larger. On 99 samples of 10µs and one of 1000µs the cost table's p99
// says 1000µs where the scaling table's says ~10µs for the same data.
func TestReviewSBPercentilesNearestRank(t *testing.T) {
	nearest := func(d []time.Duration, q float64) time.Duration {
		s := slices.Clone(d)
		slices.Sort(s)
		return s[int(math.Ceil(q*float64(len(s))))-1]
	}
	var d []time.Duration
	for i := 100; i >= 1; i-- { // unsorted on purpose
		d = append(d, time.Duration(i)*time.Millisecond)
	}
	p50, p99 := percentiles(d)
	require.Equal(t, nearest(d, 0.50), 50*time.Millisecond)
	require.Equal(t, nearest(d, 0.99), 99*time.Millisecond)

	var skew []time.Duration
	var h latencyHist
	for i := 0; i < 99; i++ {
		skew = append(skew, 10*time.Microsecond)
		h.add(10 * time.Microsecond)
	}
	skew = append(skew, 1000*time.Microsecond)
	h.add(1000 * time.Microsecond)
	_, sp99 := percentiles(skew)
	hp99 := h.quantile(0.99)
	t.Logf("1..100 ms: percentiles p50=%v p99=%v (nearest rank 50ms, 99ms); 99x10µs+1x1000µs: percentiles p99=%v, latencyHist p99=%v",
		p50, p99, sp99, hp99)

	var errs []string
	if p50 != 50*time.Millisecond || p99 != 99*time.Millisecond {
		errs = append(errs, fmt.Sprintf("percentiles(1..100ms) = p50 %v, p99 %v; nearest rank gives 50ms, 99ms (p99 is the maximum)", p50, p99))
	}
	if sp99 > 2*hp99 {
		errs = append(errs, fmt.Sprintf("same 100 samples: cost table's p99 %v, scaling table's p99 %v (two definitions in one report)", sp99, hp99))
	}
	require.Empty(t, errs)
}

// TestReviewSBHistQuantileDefinition: the histogram's quantile is the
// upper edge of the bucket holding the nearest-rank sample: never below
// the true value, at most 5% above it, on known inputs.
func TestReviewSBHistQuantileDefinition(t *testing.T) {
	for _, tc := range []struct {
		samples []time.Duration
		q       float64
		want    time.Duration
	}{
		{[]time.Duration{500 * time.Nanosecond}, 0.5, 500 * time.Nanosecond},
		{[]time.Duration{10 * time.Microsecond, 20 * time.Microsecond, 30 * time.Microsecond, 40 * time.Microsecond}, 0.5, 20 * time.Microsecond},
		{[]time.Duration{10 * time.Microsecond, 20 * time.Microsecond, 30 * time.Microsecond, 40 * time.Microsecond}, 0.99, 40 * time.Microsecond},
		{[]time.Duration{3 * time.Millisecond, time.Microsecond * 1276}, 0.5, 1276 * time.Microsecond},
	} {
		var h latencyHist
		for _, s := range tc.samples {
			h.add(s)
		}
		got := h.quantile(tc.q)
		lo := max(tc.want, time.Microsecond) // bucket 0 holds everything up to 1µs
		require.GreaterOrEqual(t, got, lo, "%v q%.2f", tc.samples, tc.q)
		require.LessOrEqual(t, float64(got), 1.0501*float64(lo), "%v q%.2f", tc.samples, tc.q)
	}
}

// ---------------------------------------------------------------------
// The scaling load: granted, errors, calls, server CPU.

// rvWrap counts, around the load's own operation, how many requests were
// made, granted and failed.
type rvWrap struct{ attempts, granted, errs atomic.Int64 }

func (w *rvWrap) wrap(l *load) {
	orig := l.op
	l.op = func(ctx context.Context, key string) (bool, time.Duration, error) {
		g, took, err := orig(ctx, key)
		w.attempts.Add(1)
		switch {
		case err != nil:
			w.errs.Add(1)
		case g:
			w.granted.Add(1)
		}
		return g, took, err
	}
}

// TestReviewSBLoadCountsMatchServer runs each scaling strategy's load
// (prepareLoad, run) on one key and on 40, and checks loadResult against
// counts made independently: grants and errors counted around the
// operation, no request neither granted nor failed (a refusal would vanish
// from the table), Redis calls against the server's own EVALSHA/EVAL
// count, server CPU (snapshot's INFO cpu delta) against /proc, the
// histogram holding every granted request.
func TestReviewSBLoadCountsMatchServer(t *testing.T) {
	srv, admin := rvServer(t)
	ctx := context.Background()
	for _, keys := range []int{1, 40} {
		for si, strat := range scaleStrategies {
			spec := loadSpec{Addrs: []string{srv.Addr}, Strategy: strat, Keys: keys, Goroutines: 8,
				Prefix: fmt.Sprintf("rv%d-%d:", keys, si), Duration: 250 * time.Millisecond}
			l, err := prepareLoad(ctx, spec)
			require.NoError(t, err, strat)
			// Closed on every way out too: rvProcCPU skips where /proc
			// cannot be read, and the pool strategy's dispatcher, left
			// behind, failed the package's end-of-run goroutine check.
			var closeOnce sync.Once
			closeLoad := func() { closeOnce.Do(l.close) }
			t.Cleanup(closeLoad)
			var w rvWrap
			w.wrap(l)
			st0 := rvCmdstats(t, admin)
			cpu0 := rvProcCPU(t, srv.Pid())
			sn0, err := snapshot(ctx, admin)
			require.NoError(t, err)
			r := l.run(ctx)
			sn1, err := snapshot(ctx, admin)
			require.NoError(t, err)
			cpu1 := rvProcCPU(t, srv.Pid())
			st1 := rvCmdstats(t, admin)
			closeLoad()

			name := fmt.Sprintf("%s, %d keys", strat, keys)
			scripts, scriptUsec := rvDelta(st0, st1, "evalsha", "eval")
			t.Logf("%s: snapshot's command µs/granted %.2f, the scripts' own µs/granted %.2f",
				name, float64(sn1.sub(sn0).cmdUsec)/float64(max(r.Granted, 1)), float64(scriptUsec)/float64(max(r.Granted, 1)))
			var histTotal int64
			for _, n := range r.Hist {
				histTotal += n
			}
			snapCPU := sn1.sub(sn0).cpuUsec
			procCPU := cpu1 - cpu0
			t.Logf("%s: granted %d (counted %d) errors %d, attempts %d; calls %d, server scripts %d; server CPU %.0fµs by INFO, %.0fµs by /proc",
				name, r.Granted, w.granted.Load(), r.Errors, w.attempts.Load(), r.Calls, scripts, snapCPU, procCPU)
			require.Positive(t, r.Granted, name)
			require.Equal(t, w.granted.Load(), r.Granted, "%s: granted", name)
			require.Equal(t, w.errs.Load(), r.Errors, "%s: errors", name)
			require.Zero(t, r.Errors, "%s: %s", name, r.FirstError)
			require.Equal(t, w.attempts.Load(), r.Granted+r.Errors, "%s: requests neither granted nor failed", name)
			require.Equal(t, r.Granted, histTotal, "%s: histogram holds the granted requests", name)
			require.Equal(t, scripts, r.Calls, "%s: Redis calls counted by the client vs scripts the server ran", name)
			require.GreaterOrEqual(t, r.Elapsed, spec.Duration, name)
			require.InDelta(t, procCPU, snapCPU, 30_000+0.15*procCPU, "%s: server CPU, INFO vs /proc", name)
		}
	}
}

// TestReviewSBSnapshotCommandTimeCountsScriptsTwice (FAILS): the scaling
// tables' "command µs/granted" is described as "the part INFO
// commandstats counts as running commands" of the server's CPU. snapshot
// sums usec over every cmdstat_ line, but Redis also lists, under their
// own names, the commands a script runs (redis.call), whose time is
// already inside the EVALSHA's. One EVALSHA whose work is a single
// SUNIONSTORE is counted about twice. (BENCHMARKS.md shows the symptom:
// rows whose command µs/granted exceed their whole server CPU µs/granted,
// e.g. 10,000 keys, 1 process, 256 goroutines, coalesced: 5.05 > 4.43.)
func TestReviewSBSnapshotCommandTimeCountsScriptsTwice(t *testing.T) {
	srv, admin := rvServer(t)
	ctx := context.Background()
	for s := 0; s < 2; s++ {
		_, err := admin.Pipelined(ctx, func(p redis.Pipeliner) error {
			for b := 0; b < 100; b++ {
				members := make([]any, 1000)
				for i := range members {
					members[i] = fmt.Sprintf("m%d-%d-%d", s, b, i)
				}
				p.SAdd(ctx, fmt.Sprintf("rv:set%d", s), members...)
			}
			return nil
		})
		require.NoError(t, err)
	}
	union := redis.NewScript(`return redis.call('SUNIONSTORE', KEYS[1], KEYS[2], KEYS[3])`)
	require.NoError(t, union.Load(ctx, admin).Err())
	st0 := rvCmdstats(t, admin)
	cpu0 := rvProcCPU(t, srv.Pid())
	sn0, err := snapshot(ctx, admin)
	require.NoError(t, err)
	for i := 0; i < 5; i++ {
		n, err := union.Run(ctx, admin, []string{"rv:dst", "rv:set0", "rv:set1"}).Int64()
		require.NoError(t, err)
		require.EqualValues(t, 200_000, n)
	}
	sn1, err := snapshot(ctx, admin)
	require.NoError(t, err)
	cpu1 := rvProcCPU(t, srv.Pid())
	st1 := rvCmdstats(t, admin)
	d := sn1.sub(sn0)
	_, evalUsec := rvDelta(st0, st1, "evalsha", "eval")
	_, innerUsec := rvDelta(st0, st1, "sunionstore")
	t.Logf("5 EVALSHA: their usec %d (of which SUNIONSTORE, listed again on its own: %d); snapshot's command usec %d; server CPU %.0fµs by /proc, %.0fµs by INFO",
		evalUsec, innerUsec, d.cmdUsec, cpu1-cpu0, d.cpuUsec)
	require.Positive(t, innerUsec, "Redis lists the script's inner command on its own")
	require.LessOrEqual(t, float64(d.cmdUsec), 1.15*float64(evalUsec)+200,
		"command µs (%d) should be the scripts' own time (%d), not that plus their inner commands' (%d)", d.cmdUsec, evalUsec, innerUsec)
}

// TestReviewSBGrantedMeansAtOnce (FAILS, latent): the scaling points count
// a reservation as granted when Reserve books a slot (r.OK()), however far
// ahead that slot is (the limiter has no max wait), while redis_rate's
// Allow counts only a request let through now. The figures are the same
// work only while the load stays under openLimit (1,000,000/s, burst
// 1,000,000); nothing checks that. Here openLimit is lowered to 100/s
// burst 10, as a faster machine would meet the real one: every strategy
// should be held to what the limit lets through at once (burst+1 plus 100
// a second, warm-up included), but the reservation strategies report
// thousands of "granted" requests, most of them booked seconds ahead.
func TestReviewSBGrantedMeansAtOnce(t *testing.T) {
	srv, _ := rvServer(t)
	ctx := context.Background()
	saved := openLimit
	openLimit = throttle.PerSecond(100, 10)
	t.Cleanup(func() { openLimit = saved })
	var errs []string
	for si, strat := range scaleStrategies {
		spec := loadSpec{Addrs: []string{srv.Addr}, Strategy: strat, Keys: 1, Goroutines: 4,
			Prefix: fmt.Sprintf("rvnow%d:", si), Duration: 300 * time.Millisecond}
		start := time.Now()
		l, err := prepareLoad(ctx, spec)
		require.NoError(t, err, strat)
		r := l.run(ctx)
		l.close()
		window := time.Since(start).Seconds()
		allowed := float64(openLimit.Burst+1) + 100*window + 5 // + 5 for the clocks' edges
		t.Logf("%s: granted %d in %.2fs (with warm-up), the limit lets %.0f through at once; p50 %v",
			strat, r.Granted, window, allowed, r.Hist.quantile(0.5))
		if float64(r.Granted) > allowed {
			errs = append(errs, fmt.Sprintf("%s: %d granted, the limit lets at most %.0f through at once", strat, r.Granted, allowed))
		}
	}
	require.Empty(t, errs, "a booking for a later slot is counted as a granted request")
}

// TestReviewSBInterleaveWindows: interleave's per-strategy figures, on a
// server of the test's own, checked against the server's own counts over
// the whole run: the points' calls plus warm-up (counted separately here)
// equal the scripts the server ran, and each point's rate is its granted
// over its seconds.
func TestReviewSBInterleaveWindows(t *testing.T) {
	srv, admin := rvServer(t)
	ctx := context.Background()
	st0 := rvCmdstats(t, admin)
	spec := loadSpec{Addrs: []string{srv.Addr}, Keys: 20, Goroutines: 4, Prefix: "rvil:", Duration: 150 * time.Millisecond}
	accs, err := interleave(ctx, spec, 1, 2, []*redis.Client{admin})
	require.NoError(t, err)
	st1 := rvCmdstats(t, admin)
	scripts, _ := rvDelta(st0, st1, "evalsha", "eval")
	var calls int64
	for _, a := range accs {
		p := a.point()
		calls += p.Calls
		require.Len(t, p.RoundPerSec, 2)
		require.InEpsilon(t, float64(p.Granted)/p.Seconds, p.PerSec, 1e-9)
		require.InEpsilon(t, float64(p.Calls)/float64(p.Granted), p.CallsPerGranted, 1e-9)
		require.InEpsilon(t, a.srv[0].cpuUsec/float64(p.Granted), p.CPUPerGranted, 1e-9)
		// Each round's rate is that round's granted over its own time:
		// their time-weighted mean is the point's rate.
		t.Logf("%s: %.0f granted/s (rounds %v), %.3f calls/granted, %.2f server µs/granted", p.Strategy, p.PerSec, p.RoundPerSec, p.CallsPerGranted, p.CPUPerGranted)
	}
	// Warm-up: max(keys, 4*goroutines) = 20 operations per strategy, each at
	// most one call (and an EVAL after a first NOSCRIPT).
	require.LessOrEqual(t, calls, scripts)
	require.LessOrEqual(t, scripts-calls, int64(4*20+8), "scripts the server ran outside the counted rounds: %d", scripts-calls)
}

// TestReviewSBRemoteRunnerCounts: a 2-process point (the test binary
// re-executed as workers): the processes' calls add up to the scripts the
// server ran in the round, and the rate's time (the longest process's own
// clock) is not far below the round's wall time.
func TestReviewSBRemoteRunnerCounts(t *testing.T) {
	srv, admin := rvServer(t)
	ctx := context.Background()
	spec := loadSpec{Addrs: []string{srv.Addr}, Strategy: stratRedisRate, Keys: 10, Goroutines: 2, Prefix: "rvrr:", Duration: 300 * time.Millisecond}
	r, err := startRunner(ctx, spec, 2)
	require.NoError(t, err)
	defer r.close()
	st0 := rvCmdstats(t, admin)
	t0 := time.Now()
	res, err := r.round(ctx)
	wall := time.Since(t0)
	require.NoError(t, err)
	st1 := rvCmdstats(t, admin)
	scripts, _ := rvDelta(st0, st1, "evalsha", "eval")
	var calls, granted int64
	var longest time.Duration
	for _, x := range res {
		calls += x.Calls
		granted += x.Granted
		longest = max(longest, x.Elapsed)
	}
	t.Logf("2 processes: granted %d, calls %d, server scripts %d; longest elapsed %v, round wall time %v", granted, calls, scripts, longest, wall)
	require.Equal(t, scripts, calls)
	require.Equal(t, granted, calls, "redis_rate: one call per request")
	require.GreaterOrEqual(t, float64(longest), 0.8*float64(wall), "rate's time vs the round's wall time")
}

// ---------------------------------------------------------------------
// Cluster.

// TestReviewSBClusterPerNode: on a 3-master cluster, the keys a load's
// per-node figures attribute to each master are the keys that master
// holds (listed on it, with a limit whose keys outlive the run), the
// granted requests attributed to a master are the scripts it ran (one call
// per request: no merging on a Cluster client, four goroutines), and
// clusterGroup's per-node CPU is that node's.
func TestReviewSBClusterPerNode(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a cluster: skipped with -short")
	}
	cl := redistest.StartCluster(t, 3)
	ctx := context.Background()
	nodes := make([]*redis.Client, 3)
	for i, a := range cl.Addrs {
		nodes[i] = redis.NewClient(&redis.Options{Addr: a})
		defer nodes[i].Close()
	}
	saved := openLimit
	openLimit = throttle.PerHour(1000, 1000) // keys live 3.6 s and more; 1,001 pass at once per key
	t.Cleanup(func() { openLimit = saved })
	for si, strat := range scaleStrategies {
		prefix := fmt.Sprintf("rvc%d:", si)
		spec := loadSpec{Addrs: cl.Addrs, Cluster: true, Strategy: strat, Keys: 60, Goroutines: 4, Prefix: prefix, Duration: 200 * time.Millisecond}
		l, err := prepareLoad(ctx, spec)
		require.NoError(t, err, strat)
		before := make([]map[string][2]int64, 3)
		for i, n := range nodes {
			before[i] = rvCmdstats(t, n)
		}
		r := l.run(ctx)
		l.close()
		require.Zero(t, r.Errors, "%s: %s", strat, r.FirstError)
		var sumKeys, sumGranted int64
		for i, n := range nodes {
			addr := cl.Addrs[i]
			listed, err := n.Keys(ctx, "rate:"+prefix+"*").Result()
			require.NoError(t, err)
			scripts, _ := rvDelta(before[i], rvCmdstats(t, n), "evalsha", "eval")
			t.Logf("%s, node %s: keys %d attributed, %d listed; granted %d attributed, scripts run %d",
				strat, addr, r.NodeKeys[addr], len(listed), r.PerNode[addr], scripts)
			require.EqualValues(t, len(listed), r.NodeKeys[addr], "%s, %s: keys attributed vs keys on the node", strat, addr)
			switch strat {
			case stratUncoalesced, stratRedisRate, stratCoalesced:
				require.Equal(t, scripts, r.PerNode[addr], "%s, %s: granted attributed vs scripts the node ran", strat, addr)
			default:
				require.LessOrEqual(t, scripts, r.PerNode[addr], strat)
			}
			sumKeys += r.NodeKeys[addr]
			sumGranted += r.PerNode[addr]
		}
		require.EqualValues(t, 60, sumKeys)
		require.Equal(t, r.Granted, sumGranted)
	}
	openLimit = saved

	// clusterGroup on one key: the node credited with the grants is the
	// one that ran them, and its CPU is its own (not an idle node's).
	c := &cluster{addrs: cl.Addrs}
	points, err := clusterGroup(ctx, c, loadSpec{Addrs: cl.Addrs, Cluster: true, Keys: 1, Goroutines: 4, Prefix: "rvcg:", Duration: 200 * time.Millisecond}, 1)
	require.NoError(t, err)
	for _, p := range points {
		var busy []NodeStat
		for _, n := range p.Nodes {
			if n.Granted > 0 {
				busy = append(busy, n)
			}
		}
		require.Len(t, busy, 1, p.Strategy)
		t.Logf("%s: all nodes %.2f µs/granted; node %s %.2f", p.Strategy, p.CPUPerGranted, busy[0].Addr, busy[0].CPUPerGranted)
		require.Greater(t, busy[0].CPUPerGranted, 0.6*p.CPUPerGranted, "%s: the busy node's CPU", p.Strategy)
		require.LessOrEqual(t, busy[0].CPUPerGranted, p.CPUPerGranted+1e-9, p.Strategy)
	}
}

// ---------------------------------------------------------------------
// Memory.

// TestReviewSBMemoryMeasuresTheKey: each strategy's fill writes exactly
// one key, the one measured (keyOf), and leaves it full (a further request
// is refused, so the key holds a limit "filled to the brim"); measureMemory's
// MEMORY USAGE per key equals the mean over every key measured here; and it
// leaves no key behind.
func TestReviewSBMemoryMeasuresTheKey(t *testing.T) {
	_, rdb := rvServer(t)
	ctx := context.Background()
	eng, err := throttle.New(rdb, throttle.WithPrefix("rate:"), throttle.WithTimeout(5*time.Second))
	require.NoError(t, err)
	require.NoError(t, eng.Load(ctx))
	strats := strategies(rdb, eng)
	for _, s := range strats {
		require.NoError(t, rdb.FlushAll(ctx).Err())
		require.NoError(t, s.fill(ctx, "rvm-one"), s.name)
		keys, err := rdb.Keys(ctx, "*").Result()
		require.NoError(t, err)
		require.Equal(t, []string{s.keyOf("rvm-one")}, keys, "%s writes only the key it measures", s.name)
		ttl, err := rdb.PTTL(ctx, keys[0]).Result()
		require.NoError(t, err)
		require.Positive(t, ttl, "%s: the key expires", s.name)
		full := false
		switch {
		case strings.HasPrefix(s.name, "slotbook"):
			r, err := eng.AllowN(ctx, "rvm-one", throttle.PerMinute(perMinute, perMinute-1), 1)
			require.NoError(t, err)
			full = !r.Allowed
		case strings.HasPrefix(s.name, "sliding"):
			r, err := eng.AllowWindow(ctx, "rvm-one", throttle.Window{Max: perMinute, Span: time.Minute}, 1)
			require.NoError(t, err)
			full = !r.Allowed
		case strings.HasPrefix(s.name, "guide"):
			v, err := floatGCRA.Run(ctx, rdb, []string{s.keyOf("rvm-one")}, 60_000, perMinute, perMinute-1, 1).Int()
			require.NoError(t, err)
			full = v == 0
		default:
			full = true // go-redis/redis_rate's fill checks Allowed == 100; the floor has no limit
		}
		require.True(t, full, "%s: the key is at its limit after the fill", s.name)

		// measureMemory against a mean of MEMORY USAGE over all keys.
		require.NoError(t, rdb.FlushAll(ctx).Err())
		const n = 300
		var sum int64
		for i := 0; i < n; i++ {
			k := fmt.Sprintf("rvmm-k%06d", i) // measureMemory's names: MEMORY USAGE counts the key's name
			require.NoError(t, s.fill(ctx, k))
			u, err := rdb.MemoryUsage(ctx, s.keyOf(k), 0).Result()
			require.NoError(t, err)
			sum += u
		}
		require.NoError(t, rdb.FlushAll(ctx).Err())
		row, err := measureMemory(ctx, rdb, s, "rvmm", n)
		require.NoError(t, err, s.name)
		t.Logf("%s: MEMORY USAGE %.1f (mine %.1f), INFO delta %.1f bytes/key", s.name, row.UsagePerKey, float64(sum)/n, row.InfoPerKey)
		require.InDelta(t, float64(sum)/n, row.UsagePerKey, 1.0, s.name)
		left, err := rdb.DBSize(ctx).Result()
		require.NoError(t, err)
		require.Zero(t, left, "%s: keys left behind", s.name)
	}
}

// ---------------------------------------------------------------------
// Cost per check.

// TestReviewSBLatencyPerCallIsPerScriptNotPerRow (FAILS, labelling): the
// cost table's "server µs/call" divides a round's EVALSHA time by its
// EVALSHA count, so a row whose timed call makes two scripts (the lease
// row: Acquire + Release, timed together, p50 for both) shows half its
// server cost beside a p50 for the whole. Here two probes run a script
// that spins 300µs on the server: once per call, and twice per call. The
// second's p50 doubles; its server µs/call does not. The lease probe makes
// two scripts per timed call (checked with the server's count).
func TestReviewSBLatencyPerCallIsPerScriptNotPerRow(t *testing.T) {
	srv, rdb := rvServer(t)
	ctx := context.Background()
	spin := redis.NewScript(`
local t = redis.call('TIME')
local t0 = t[1] * 1000000 + t[2]
repeat t = redis.call('TIME') until t[1] * 1000000 + t[2] - t0 >= 300
return 1`)
	require.NoError(t, spin.Load(ctx, rdb).Err())
	probes := []probe{
		{name: "one", command: "evalsha", call: func(ctx context.Context) error { return spin.Run(ctx, rdb, nil).Err() }},
		{name: "two", command: "evalsha", call: func(ctx context.Context) error {
			if err := spin.Run(ctx, rdb, nil).Err(); err != nil {
				return err
			}
			return spin.Run(ctx, rdb, nil).Err()
		}},
	}
	rows, err := measureLatency(ctx, rdb, probes, 200, latencyRounds(200))
	require.NoError(t, err)
	t.Logf("one script per call: p50 %v, %.1f server µs/call; two: p50 %v, %.1f server µs/call", rows[0].P50, rows[0].UsecPerCall, rows[1].P50, rows[1].UsecPerCall)

	// The lease probe: scripts per timed call, by the server's count.
	eng, err := throttle.New(rdb, throttle.WithPrefix("rate:"), throttle.WithTimeout(5*time.Second))
	require.NoError(t, err)
	require.NoError(t, eng.Load(ctx))
	lp, stop, err := leaseProbe(ctx, srv.Options(), eng, "rvlease")
	require.NoError(t, err)
	defer stop()
	require.NoError(t, lp.call(ctx)) // warm
	st0 := rvCmdstats(t, rdb)
	for i := 0; i < 50; i++ {
		require.NoError(t, lp.call(ctx))
	}
	scripts, _ := rvDelta(st0, rvCmdstats(t, rdb), "evalsha", "eval")
	t.Logf("lease probe %q: %d scripts for 50 timed calls", lp.name, scripts)
	require.EqualValues(t, 100, scripts)

	require.Greater(t, rows[1].UsecPerCall, 1.6*rows[0].UsecPerCall,
		"a row timing two scripts per call reports the server µs of one (p50 %v vs %v)", rows[1].P50, rows[0].P50)
}

// TestReviewSBLatencyWindowsApart: each probe's server µs comes from its
// own phases: a cheap probe interleaved with a 300µs one stays cheap.
func TestReviewSBLatencyWindowsApart(t *testing.T) {
	_, rdb := rvServer(t)
	ctx := context.Background()
	spin := redis.NewScript(`
local t = redis.call('TIME')
local t0 = t[1] * 1000000 + t[2]
repeat t = redis.call('TIME') until t[1] * 1000000 + t[2] - t0 >= 300
return 1`)
	require.NoError(t, spin.Load(ctx, rdb).Err())
	rows, err := measureLatency(ctx, rdb, []probe{
		{name: "spin", command: "evalsha", call: func(ctx context.Context) error { return spin.Run(ctx, rdb, nil).Err() }},
		{name: "empty", command: "evalsha", call: func(ctx context.Context) error { return emptyScript.Run(ctx, rdb, nil).Err() }},
	}, 300, latencyRounds(300))
	require.NoError(t, err)
	t.Logf("spin %.1f µs/call, empty %.1f µs/call", rows[0].UsecPerCall, rows[1].UsecPerCall)
	require.GreaterOrEqual(t, rows[0].UsecPerCall, 300.0)
	require.Less(t, rows[1].UsecPerCall, 50.0)
}

// ---------------------------------------------------------------------
// Contention and coalescing.

// TestReviewSBContentionCallsMatchServer: measureContention's Redis calls
// per mode add up to the scripts the server ran (none uncounted, e.g. the
// pool giving back after the count); in retry mode each check is one call,
// so calls = denials + through.
func TestReviewSBContentionCallsMatchServer(t *testing.T) {
	srv, admin := rvServer(t)
	ctx := context.Background()
	st0 := rvCmdstats(t, admin)
	res, err := measureContention(ctx, srv.Options(), "rvct", time.Second)
	require.NoError(t, err)
	time.Sleep(200 * time.Millisecond)
	scripts, _ := rvDelta(st0, rvCmdstats(t, admin), "evalsha", "eval")
	var calls int64
	for _, r := range res {
		calls += r.Calls
		// Elapsed (last start) shows the window "through" is counted over:
		// the run's duration for retry, plus up to the max wait for reserve
		// and pool.
		t.Logf("%s: through %d, calls %d, denials %d, %.2f calls/request, last start at %v", r.Mode, r.Through, r.Calls, r.Denials, r.CallsPerRequest, r.Elapsed)
		if r.Mode == "retry" {
			require.EqualValues(t, r.Denials+r.Through, r.Calls)
		}
		require.InEpsilon(t, float64(r.Calls)/float64(r.Through), r.CallsPerRequest, 1e-9)
	}
	require.Equal(t, scripts, calls, "calls in the table vs scripts the server ran")
}

// TestReviewSBCoalescingReservationsLabel (FAILS, nit): the coalescing
// section says "64 goroutines reserving <total> slots", but Throughput
// makes total/64*64 reservations (49,984 of 50,000; 64 of 100 here), and
// its rate and calls are per those. Counted on the server with merging
// and coalescing off (one script per reservation).
func TestReviewSBCoalescingReservationsLabel(t *testing.T) {
	_, rdb := rvServer(t)
	ctx := context.Background()
	calls := callcount.Attach(rdb)
	eng, err := throttle.New(rdb, throttle.WithPrefix("rvco:"), throttle.WithTimeout(5*time.Second), throttle.WithMerging(false))
	require.NoError(t, err)
	require.NoError(t, eng.Load(ctx))
	lim, err := reserve.New(eng, "coalesce", throttle.PerSecond(1_000_000, 1_000_000), reserve.WithCoalescing(false))
	require.NoError(t, err)
	const total = 100
	st0 := rvCmdstats(t, rdb)
	_, per, err := contention.Throughput(ctx, lim, "k", 64, total, calls.Load)
	require.NoError(t, err)
	made, _ := rvDelta(st0, rvCmdstats(t, rdb), "evalsha", "eval")
	t.Logf("Throughput(total %d): %d reservations made, %.3f calls per reservation", total, made, per)
	require.EqualValues(t, 1.0, per)
	require.EqualValues(t, total, made, "the report's Reservations (= total) vs reservations made")
}

// ---------------------------------------------------------------------
// The published figures.

func rvRead(t *testing.T, path string) string {
	t.Helper()
	b, err := os.ReadFile(path)
	require.NoError(t, err)
	return string(b)
}

// rvTable returns the rows (cells trimmed) of the first table after the
// line equal to heading.
func rvTable(t *testing.T, md, heading string) [][]string {
	t.Helper()
	lines := strings.Split(md, "\n")
	i := slices.Index(lines, heading)
	require.GreaterOrEqual(t, i, 0, "heading %q", heading)
	for i++; i < len(lines) && !strings.HasPrefix(lines[i], "|"); i++ {
	}
	var rows [][]string
	for i += 2; i < len(lines) && strings.HasPrefix(lines[i], "|"); i++ {
		cells := strings.Split(strings.Trim(lines[i], "|"), " | ")
		for k := range cells {
			cells[k] = strings.TrimSpace(cells[k])
		}
		rows = append(rows, cells)
	}
	return rows
}

func rvF(t *testing.T, s string) float64 {
	t.Helper()
	s = strings.TrimSuffix(strings.TrimSuffix(s, "µs"), "ms")
	if i := strings.Index(s, " ("); i >= 0 {
		s = s[:i]
	}
	v, err := strconv.ParseFloat(strings.ReplaceAll(s, ",", ""), 64)
	require.NoError(t, err, "%q", s)
	return v
}

func rvI(t *testing.T, s string) int { return int(rvF(t, s)) }

func rvUs(t *testing.T, s string) time.Duration {
	return time.Duration(rvF(t, s) * float64(time.Microsecond))
}

// rvPublished rebuilds a Report from BENCHMARKS.md's tables.
func rvPublished(t *testing.T, md string) *Report {
	rep := &Report{FreshServers: true}
	for _, r := range rvTable(t, md, "## Memory per key") {
		rep.Memory = append(rep.Memory, MemoryRow{Name: r[0], Keys: 10000, InfoPerKey: rvF(t, r[1]), UsagePerKey: rvF(t, r[2])})
	}
	for _, r := range rvTable(t, md, "## Cost per check") {
		rep.Latency = append(rep.Latency, LatencyRow{Name: r[0], P50: rvUs(t, r[1]), P99: rvUs(t, r[2]), PingP50: rvUs(t, r[3]), PingP99: rvUs(t, r[4]), UsecPerCall: rvF(t, r[6])})
	}
	for _, r := range rvTable(t, md, "## Contention") {
		rep.Contention = append(rep.Contention, contention.Result{Mode: r[0], Through: rvI(t, r[1]), Calls: int64(rvI(t, r[2])), Denials: rvI(t, r[3]), CallsPerRequest: rvF(t, r[4])})
	}
	co := rvTable(t, md, "## Coalescing")
	require.Len(t, co, 3)
	rep.Coalescing = CoalescingRow{Reservations: 50000,
		CoalescedPerSec: rvF(t, co[0][1]), CallsPerReservation: rvF(t, co[0][2]),
		UncoalescedPerSec: rvF(t, co[1][1]), UncoalescedCalls: rvF(t, co[1][2]),
		AlonePerSec: rvF(t, co[2][1]), AloneCalls: rvF(t, co[2][2])}
	rep.Coalescing.Speedup = rep.Coalescing.CoalescedPerSec / rep.Coalescing.AlonePerSec
	s := &ScalingReport{Seconds: 2, Rounds: 4}
	for _, r := range rvTable(t, md, "### Every point") {
		s.Points = append(s.Points, ScalePoint{Keys: rvI(t, r[0]), Procs: rvI(t, r[1]), Goroutines: rvI(t, r[2]), Strategy: r[3],
			PerSec: rvF(t, r[4]), CallsPerGranted: rvF(t, r[5]), CPUPerGranted: rvF(t, r[6]), CmdPerGranted: rvF(t, r[7]),
			ClientCPUPerGranted: rvF(t, r[8]), P50: rvUs(t, r[9]), P99: rvUs(t, r[10])})
	}
	for _, r := range rvTable(t, md, "### Memory per key at scale") {
		s.Memory = append(s.Memory, MemoryRow{Keys: rvI(t, r[0]), Name: r[1], UsagePerKey: rvF(t, r[2]), InfoPerKey: rvF(t, r[4])})
	}
	for _, r := range rvTable(t, md, "### Redis Cluster, 3 masters") {
		p := ScalePoint{Keys: rvI(t, r[0]), Procs: 1, Goroutines: rvI(t, r[1]), Strategy: r[2], PerSec: rvF(t, r[3]),
			CallsPerGranted: rvF(t, r[4]), CPUPerGranted: rvF(t, r[5])}
		for _, n := range strings.Split(r[7], "; ") {
			f := strings.Split(n, " / ")
			p.Nodes = append(p.Nodes, NodeStat{Keys: int64(rvI(t, f[0])), Granted: int64(rvI(t, f[1])), CPUPerGranted: rvF(t, f[2])})
		}
		s.Cluster = append(s.Cluster, p)
	}
	rep.Scaling = s
	return rep
}

func rvClose(a, b float64) bool {
	return math.Abs(a-b) <= 0.011+0.015*math.Max(math.Abs(a), math.Abs(b))
}

// TestReviewSBPublishedTablesFromCode rebuilds a Report from BENCHMARKS.md
// and checks that the code as it is derives the published targets, the
// side-by-side table and the memory ratios from the published raw rows,
// that the code still prints every published table header and section,
// and that the cluster rows' node figures agree with their totals.
func TestReviewSBPublishedTablesFromCode(t *testing.T) {
	md := rvRead(t, "../../BENCHMARKS.md")
	rep := rvPublished(t, md)
	rep.judge()

	var errs []string
	pub := map[string]float64{}
	for _, r := range rvTable(t, md, "## Targets") {
		pub[r[0]] = rvF(t, r[1])
	}
	got := map[string]bool{}
	for _, tg := range rep.Targets {
		got[tg.Name] = true
		v, ok := pub[tg.Name]
		switch {
		case !ok:
			errs = append(errs, "target the code produces, not published: "+tg.Name)
		case !rvClose(v, tg.Value):
			errs = append(errs, fmt.Sprintf("target %q: published %.3f, code gives %.3f from the published rows", tg.Name, v, tg.Value))
		}
	}
	for name := range pub {
		if !got[name] {
			errs = append(errs, "published target the code does not produce: "+name)
		}
	}

	gen := rep.markdown()
	// Headers and section headings the code prints now, against the file.
	lines := strings.Split(gen, "\n")
	for i, l := range lines {
		if strings.HasPrefix(l, "#") || (strings.HasPrefix(l, "| ") && i+1 < len(lines) && strings.HasPrefix(lines[i+1], "|--")) {
			if !strings.Contains(md, l+"\n") {
				errs = append(errs, "the code prints, the file lacks: "+l)
			}
		}
	}
	for _, l := range strings.Split(md, "\n") {
		if strings.HasPrefix(l, "#") && !strings.Contains(gen, l+"\n") {
			errs = append(errs, "the file has, the code no longer prints: "+l)
		}
	}
	// Derived tables: side by side, memory at scale.
	want := rvTable(t, gen, "### Side by side with redis_rate (same keys, processes and goroutines)")
	have := rvTable(t, md, "### Side by side with redis_rate (same keys, processes and goroutines)")
	require.Equal(t, len(want), len(have))
	for i := range want {
		for k := range want[i] {
			if a, b := rvF(t, want[i][k]), rvF(t, have[i][k]); !rvClose(a, b) {
				errs = append(errs, fmt.Sprintf("side by side row %d col %d: published %s, code gives %s", i, k, have[i][k], want[i][k]))
			}
		}
	}
	for i, r := range rvTable(t, md, "### Memory per key at scale") {
		g := rvTable(t, gen, "### Memory per key at scale")[i]
		if !rvClose(rvF(t, r[3]), rvF(t, g[3])) {
			errs = append(errs, fmt.Sprintf("memory at scale row %d: / floor published %s, code gives %s", i, r[3], g[3]))
		}
	}
	// Cluster rows: nodes' keys add up to the row's keys, granted to the
	// row's granted/s over the point's time, "single server's" is the
	// single server's CPU.
	for _, r := range rvTable(t, md, "### Redis Cluster, 3 masters") {
		keys, strat, perSec := rvI(t, r[0]), r[2], rvF(t, r[3])
		var nk, ng int
		for _, n := range strings.Split(r[7], "; ") {
			f := strings.Split(n, " / ")
			nk += rvI(t, f[0])
			ng += rvI(t, f[1])
		}
		if nk != keys {
			errs = append(errs, fmt.Sprintf("cluster %d keys %s: nodes hold %d keys", keys, strat, nk))
		}
		if g := float64(ng) / 2.0; g < 0.97*perSec || g > 1.03*perSec*1.1 {
			errs = append(errs, fmt.Sprintf("cluster %d keys %s: nodes' granted %d over 2 s vs %.0f granted/s", keys, strat, ng, perSec))
		}
		if sp, ok := rep.Scaling.point(strat, keys, 1, rvI(t, r[1])); ok && !rvClose(sp.CPUPerGranted, rvF(t, r[6])) {
			errs = append(errs, fmt.Sprintf("cluster %d keys %s: single server's %s vs %.2f", keys, strat, r[6], sp.CPUPerGranted))
		}
	}
	// Every point: "command µs" is documented as the part of server CPU
	// commandstats counts; a part above its whole is not that.
	for _, p := range rep.Scaling.Points {
		if p.CmdPerGranted > p.CPUPerGranted*1.001 {
			t.Logf("published row %d keys %d procs %d goroutines %s: command µs/granted %.2f > server CPU µs/granted %.2f",
				p.Keys, p.Procs, p.Goroutines, p.Strategy, p.CmdPerGranted, p.CPUPerGranted)
		}
	}
	require.Empty(t, errs)
}

// TestReviewSBReadmeFiguresMatchBenchmarks (FAILS): the figures the README
// quotes from BENCHMARKS.md's run, each against the value in the file.
func TestReviewSBReadmeFiguresMatchBenchmarks(t *testing.T) {
	md := rvRead(t, "../../BENCHMARKS.md")
	readme := strings.Join(strings.Fields(rvRead(t, "../../README.md")), " ")
	rep := rvPublished(t, md)
	rep.judge()
	target := func(prefix string) float64 {
		for _, tg := range rep.Targets {
			if strings.HasPrefix(tg.Name, prefix) {
				return tg.Value
			}
		}
		t.Fatalf("no target %q", prefix)
		return 0
	}
	lat := func(prefix string) LatencyRow { return rep.latency(prefix) }
	sp := func(strat string, keys, procs, g int) ScalePoint {
		p, ok := rep.Scaling.point(strat, keys, procs, g)
		require.True(t, ok, "%s %d %d %d", strat, keys, procs, g)
		return p
	}
	ratio := func(keys, procs, g int) float64 {
		return sp(stratCoalesced, keys, procs, g).PerSec / sp(stratRedisRate, keys, procs, g).PerSec
	}
	leaseName := lat("slotbook lease").Name
	m := regexp.MustCompile(`([0-9.]+) alone, ([0-9.]+) contended`).FindStringSubmatch(leaseName)
	require.Len(t, m, 3, leaseName)
	contended := rvF(t, m[2])
	ref := lat("reference: a script doing only TIME").UsecPerCall

	claims := []struct {
		re   string // a regexp whose first group is the figure in the README
		want float64
	}{
		{`contention \(2 processes x 8 goroutines, N = 2\) ([0-9.]+) calls per lease, wake-ups and polls included \(the lease row of BENCHMARKS\.md`, contended},
		{`memory: ([0-9]+) bytes per key by .MEMORY USAGE.`, rep.memory("slotbook").UsagePerKey},
		{`redis_rate and the float-TAT script ([0-9]+);`, rep.memory("go-redis").UsagePerKey},
		{`retrying after denial ([0-9.]+) calls per request`, rep.mode("retry").CallsPerRequest},
		{`reservation ([0-9.]+) \(one call each`, rep.mode("reserve").CallsPerRequest},
		{`the pool ([0-9.]+); - coalescing`, rep.mode("pool").CallsPerRequest},
		{`64 goroutines on one key, ([0-9.]+) times the reservations`, rep.Coalescing.Speedup},
		{`\(([0-9.]+) times those of uncoalesced callers on a default client`, rep.Coalescing.CoalescedPerSec / rep.Coalescing.UncoalescedPerSec},
		{`server CPU ([0-9.]+) times redis_rate's`, target("server CPU per reserve / redis_rate")},
		{`and ([0-9.]+) times the guide-style script's \(met\)`, target("server CPU per reserve / guide-style")},
		{`([0-9.]+) times the floor script's, and p50`, target("server CPU per reserve / TIME")},
		{`and p50 ([0-9.]+) times its p50`, target("reserve p50 / TIME")},
		{`costs ([0-9.]+) times the floor; the rest`, lat("reference: the same with slotbook's").UsecPerCall / ref},
		{`\(the guide-style script ([0-9.]+) times the floor`, lat("guide-style").UsecPerCall / ref},
		{`floor, redis_rate ([0-9.]+)\)`, lat("go-redis").UsecPerCall / ref},
		{`published run ([0-9.]+) \([0-9.]+ to [0-9.]+ over the rounds\)`, ratio(10000, 1, 1)},
		{`over the rounds\) and ([0-9.]+) \([0-9.]+ to [0-9.]+\) times its granted`, ratio(10000, 1, 4)},
		{`redis_rate's at 16 goroutines, ([0-9.]+)x at 64`, ratio(10000, 1, 64)},
		{`on 10,000 keys served ([0-9.]+)x redis_rate's at 16`, ratio(10000, 1, 16)},
		{`and ([0-9.]+)x at 256 \(one process`, ratio(10000, 1, 256)},
		{`flight\), ([0-9.]+)x and [0-9.]+x at 64 and 256 over four processes`, ratio(10000, 4, 64)},
		{`flight\), [0-9.]+x and ([0-9.]+)x at 64 and 256 over four processes`, ratio(10000, 4, 256)},
		{`times its granted requests per second at one and four goroutines in one process, ([0-9.]+) \([0-9.]+ to`, ratio(10000, 4, 4)},
		{`in one process, [0-9.]+ \([0-9.]+ to [0-9.]+\) and ([0-9.]+) \([0-9.]+ to [0-9.]+\) at one and four goroutines in each of four`, ratio(10000, 4, 16)},
		{`([0-9.]+) times redis_rate's server CPU per granted request at 64 goroutines on one key`,
			sp(stratCoalesced, 1, 1, 64).CPUPerGranted / sp(stratRedisRate, 1, 1, 64).CPUPerGranted},
	}
	var errs []string
	for _, c := range claims {
		m := regexp.MustCompile(c.re).FindStringSubmatch(readme)
		if m == nil {
			errs = append(errs, "README lacks: "+c.re)
			continue
		}
		v := rvF(t, m[1])
		// The README rounds: within half its last digit (plus the inputs' rounding).
		digits := 0
		if i := strings.IndexByte(m[1], '.'); i >= 0 {
			digits = len(m[1]) - i - 1
		}
		tol := 0.5*math.Pow(10, -float64(digits)) + 0.006*math.Abs(c.want)
		if math.Abs(v-c.want) > tol {
			errs = append(errs, fmt.Sprintf("README says %s where BENCHMARKS.md gives %.3f (%s)", m[1], c.want, c.re))
		}
	}
	// The ranges over the rounds the README gives for 10,000 keys at one
	// and four goroutines, as the side-by-side table prints them.
	for _, pt := range [][2]int{{1, 1}, {1, 4}, {4, 4}, {4, 16}} {
		row := regexp.MustCompile(fmt.Sprintf(`(?m)^\| 10000 \| %d \| %d \| ([0-9.]+) \(([0-9.]+)–([0-9.]+)\) \|`, pt[0], pt[1])).FindStringSubmatch(md)
		if row == nil {
			errs = append(errs, fmt.Sprintf("BENCHMARKS.md has no side-by-side row for 10000 keys, %d processes, %d goroutines", pt[0], pt[1]))
			continue
		}
		if want := fmt.Sprintf("%s (%s to %s", row[1], row[2], row[3]); !strings.Contains(readme, want) {
			errs = append(errs, fmt.Sprintf("README lacks %q (10000 keys, %d processes, %d goroutines)", want, pt[0], pt[1]))
		}
	}
	require.Empty(t, errs)
}

// rvMemHook watches a client's INFO memory replies and dials, in order.
type rvMemHook struct {
	mu     sync.Mutex
	events []string // "dial", or "info:<mem_clients_normal>:<used_memory>"
}

func (h *rvMemHook) DialHook(next redis.DialHook) redis.DialHook {
	return func(ctx context.Context, network, addr string) (net.Conn, error) {
		h.mu.Lock()
		h.events = append(h.events, "dial")
		h.mu.Unlock()
		return next(ctx, network, addr)
	}
}

func (h *rvMemHook) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		err := next(ctx, cmd)
		if sc, ok := cmd.(*redis.StringCmd); ok && cmd.Name() == "info" && strings.Contains(sc.Val(), "used_memory:") {
			h.mu.Lock()
			h.events = append(h.events, "info:"+infoField(sc.Val(), "mem_clients_normal")+":"+infoField(sc.Val(), "used_memory"))
			h.mu.Unlock()
		}
		return err
	}
}

func (h *rvMemHook) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}

// TestReviewSBMemoryInfoDeltaIncludesConnections (FAILS, minor; the
// column is not judged by any target): measureMemory's INFO
// used_memory delta is taken between two INFO calls with the fill between
// them; the fill's 16 goroutines may open connections the warm-up's 16
// PINGs did not, and their buffers are in the delta (the report blames
// "dictionaries and allocator slack"). Observed through the measurement's
// own INFO replies (mem_clients_normal) and the client's dials; logged,
// and failed if connection memory moves the figure by more than 10 bytes
// a key.
func TestReviewSBMemoryInfoDeltaIncludesConnections(t *testing.T) {
	srv, _ := rvServer(t)
	ctx := context.Background()
	rdb := redis.NewClient(srv.Options())
	defer rdb.Close()
	h := &rvMemHook{}
	rdb.AddHook(h)
	eng, err := throttle.New(rdb, throttle.WithPrefix("rate:"), throttle.WithTimeout(5*time.Second))
	require.NoError(t, err)
	const keys = 10_000                                                        // the published run's count
	row, err := measureMemory(ctx, rdb, strategies(rdb, eng)[4], "rvmc", keys) // the floor
	require.NoError(t, err)
	var infos []string
	dialsBetween := 0
	for _, e := range h.events {
		if strings.HasPrefix(e, "info:") {
			infos = append(infos, e)
		} else if len(infos) == 1 {
			dialsBetween++
		}
	}
	require.Len(t, infos, 2)
	f0, f1 := strings.Split(infos[0], ":"), strings.Split(infos[1], ":")
	c0, _ := strconv.ParseFloat(f0[1], 64)
	c1, _ := strconv.ParseFloat(f1[1], 64)
	perKey := (c1 - c0) / keys
	t.Logf("INFO delta %.1f bytes/key (MEMORY USAGE %.1f); connections dialled during the fill: %d; client memory moved %.0f bytes (%.1f a key)",
		row.InfoPerKey, row.UsagePerKey, dialsBetween, c1-c0, perKey)
	require.LessOrEqual(t, math.Abs(perKey), 10.0, "client connections' memory in the per-key INFO delta")
}
