package main

import (
	"bytes"
	"context"
	"flag"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/slotbook/slotbook/internal/redistest"
	"github.com/slotbook/slotbook/throttle"
)

// TestScalingSmall runs the scaling section at a tiny size: every
// strategy at one and two processes (the second re-executing the test
// binary as a worker), on one key and on 50, on a 3-master cluster too,
// memory at two key counts, and the plots; then checks each point's
// counts, the per-node figures, the targets and the report's sections.
func TestScalingSmall(t *testing.T) {
	if testing.Short() {
		t.Skip("about 30 s: skipped with -short")
	}
	redistest.Shared(t).RequireReal(t)
	dir := t.TempDir()
	var o options
	fs := flag.NewFlagSet("t", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	o.scale.register(fs)
	require.NoError(t, fs.Parse([]string{"-scaling", "-scaling-time", "400ms", "-scaling-rounds", "2", "-scaling-goroutines", "2",
		"-scaling-procs", "1,2", "-scaling-keys", "1,50", "-scaling-memory", "200,400",
		"-scaling-cluster-goroutines", "2", "-plots", filepath.Join(dir, "docs")}))
	require.NoError(t, o.scale.check(o))
	o.out = filepath.Join(dir, "BENCH.md")

	s, err := measureScaling(context.Background(), o, func(string, ...any) {})
	require.NoError(t, err)
	s.linkBase = dir
	// 2 key counts x 2 process counts x 4 strategies.
	require.Len(t, s.Points, 16)
	for _, p := range s.Points {
		name := p.Strategy
		require.Zero(t, p.Errors, "%s: %s", name, p.FirstError)
		require.Positive(t, p.Granted, name)
		require.Positive(t, p.PerSec, name)
		require.Positive(t, p.CPUPerGranted, name)
		require.Positive(t, p.P50, name)
		require.GreaterOrEqual(t, p.P99, p.P50, name)
		require.Equal(t, 2, p.Goroutines, name)
		require.Len(t, p.RoundPerSec, 2, name) // -scaling-rounds 2
		for _, r := range p.RoundPerSec {
			require.Positive(t, r, name)
		}
		switch p.Strategy {
		case stratUncoalesced, stratRedisRate: // one call per request, whatever the machine's speed
			require.InDelta(t, 1.0, p.CallsPerGranted, 0.001, name)
		default: // coalescing and batches never need more
			require.LessOrEqual(t, p.CallsPerGranted, 1.0, name)
		}
	}
	// The cluster: every granted request is counted on exactly one node,
	// and 50 keys spread over more than one.
	require.Len(t, s.Cluster, 8)
	for _, p := range s.Cluster {
		require.Zero(t, p.Errors, "%s: %s", p.Strategy, p.FirstError)
		require.Len(t, p.Nodes, 3)
		var granted, keys int64
		holding := 0
		for _, n := range p.Nodes {
			granted += n.Granted
			keys += n.Keys
			if n.Keys > 0 {
				holding++
			}
		}
		require.Equal(t, p.Granted, granted, p.Strategy)
		require.Equal(t, int64(p.Keys), keys, p.Strategy)
		if p.Keys == 1 {
			require.Equal(t, 1, holding, p.Strategy)
		} else {
			require.Greater(t, holding, 1, p.Strategy)
		}
	}
	require.Len(t, s.Memory, 6)
	require.Len(t, s.Plots, len(scaleMetrics))
	for _, f := range s.Plots {
		b, err := os.ReadFile(f)
		require.NoError(t, err)
		require.True(t, bytes.HasPrefix(b, []byte("\x89PNG")), f)
	}

	rep := &Report{Scaling: s}
	rep.judge()
	names := map[string]bool{}
	for _, tg := range rep.Targets {
		names[tg.Name] = true
	}
	// No 64-goroutine point in this run: only the targets it has points for.
	require.True(t, names["scaling, 50 keys, lowest over goroutines and processes: coalesced granted/s / redis_rate's"], names)
	require.True(t, names["memory per key at scale (highest over key counts) / integer-plus-expiry floor"], names)
	require.False(t, names["scaling, 1 key, 64 goroutines: coalesced granted/s / redis_rate's"], names)
	for _, tg := range rep.Targets {
		if strings.HasPrefix(tg.Name, "memory per key at scale") {
			require.True(t, tg.Met, "%+v", tg)
		}
	}
	md := rep.markdown()
	for _, section := range []string{"## Scaling", "### Side by side with redis_rate", "### Every point",
		"### Redis Cluster, 3 masters", "### Memory per key at scale", "](docs/scaling-throughput.png)"} {
		require.Contains(t, md, section)
	}
	// Two rounds: each ratio of granted/s with its range over them.
	require.Regexp(t, `\| \d+\.\d\d \(\d+\.\d\d–\d+\.\d\d\) \| \d+\.\d\d \(`, md)
}

// TestRoundSpread: the range is over the rounds' paired ratios, not the
// ratio of the best round to the worst; one round gives no range.
func TestRoundSpread(t *testing.T) {
	a := ScalePoint{PerSec: 150, RoundPerSec: []float64{100, 200}}
	b := ScalePoint{PerSec: 150, RoundPerSec: []float64{200, 100}}
	lo, hi, ok := roundSpread(a, b)
	require.True(t, ok)
	require.Equal(t, 0.5, lo)
	require.Equal(t, 2.0, hi)
	require.Equal(t, "1.00 (0.50–2.00)", ratioCell(a, b))

	b.RoundPerSec = []float64{0, 50}
	lo, hi, ok = roundSpread(a, b)
	require.True(t, ok)
	require.Equal(t, 4.0, lo)
	require.Equal(t, 4.0, hi)

	a.RoundPerSec, b.RoundPerSec = []float64{150}, []float64{150}
	require.Equal(t, "1.00", ratioCell(a, b))
	_, _, ok = roundSpread(a, ScalePoint{})
	require.False(t, ok)
	require.Equal(t, "–", ratioCell(a, ScalePoint{}))
}

func TestScalingFlags(t *testing.T) {
	for _, args := range [][]string{
		{"-scaling", "-redis", "redis://127.0.0.1:1/0"},
		{"-scaling", "-scaling-time", "0s"},
		{"-scaling", "-scaling-rounds", "0"},
		{"-scaling-goroutines", "4,x"},
		{"-scaling-procs", "0"},
	} {
		var stdout, stderr bytes.Buffer
		require.Equal(t, 2, run(context.Background(), args, &stdout, &stderr), args)
		require.Equal(t, 1, strings.Count(stderr.String(), "\n"), stderr.String())
	}
}

// TestLatencyHist checks the histogram's quantiles against known samples:
// each within its bucket's 5%.
func TestLatencyHist(t *testing.T) {
	var h latencyHist
	for i := 1; i <= 1000; i++ {
		h.add(time.Duration(i) * time.Microsecond)
	}
	var o latencyHist
	o.merge(h)
	require.InEpsilon(t, float64(500*time.Microsecond), float64(o.quantile(0.5)), 0.051)
	require.InEpsilon(t, float64(990*time.Microsecond), float64(o.quantile(0.99)), 0.051)
	require.Zero(t, latencyHist(nil).quantile(0.5))
}

func TestPlural(t *testing.T) {
	require.Equal(t, "1 key", plural(1, "key"))
	require.Equal(t, "10,000 keys", plural(10_000, "key"))
	require.Equal(t, "1,000,000 keys", plural(1_000_000, "key"))
	require.Equal(t, "4 processes", processes(4))
}

// TestScalingNotAtOnce: under a limit the load reaches, every request is
// either granted at once, counted apart (not at once) or an error, for
// every strategy; and the report says loudly which points reached it.
func TestScalingNotAtOnce(t *testing.T) {
	if testing.Short() {
		t.Skip("needs a redis-server: skipped with -short")
	}
	srv := redistest.Start(t)
	srv.RequireReal(t)
	saved := openLimit
	openLimit = throttle.PerSecond(100, 10)
	t.Cleanup(func() { openLimit = saved })
	ctx := context.Background()
	var points []ScalePoint
	for i, strat := range scaleStrategies {
		l, err := prepareLoad(ctx, loadSpec{Addrs: []string{srv.Addr}, Strategy: strat, Keys: 1, Goroutines: 4,
			Prefix: fmt.Sprintf("nao%d:", i), Duration: 200 * time.Millisecond})
		require.NoError(t, err, strat)
		var attempts atomic.Int64
		op := l.op
		l.op = func(ctx context.Context, key string) (bool, time.Duration, error) {
			attempts.Add(1)
			return op(ctx, key)
		}
		r := l.run(ctx)
		l.close()
		require.Zero(t, r.Errors, "%s: %s", strat, r.FirstError)
		require.Positive(t, r.NotAtOnce, strat)
		require.Equal(t, attempts.Load(), r.Granted+r.NotAtOnce, strat)
		a := &accum{spec: loadSpec{Strategy: strat, Keys: 1, Goroutines: 4}, procs: 1}
		a.add([]loadResult{r}, []serverStats{{}})
		p := a.point()
		require.Equal(t, r.NotAtOnce, p.NotAtOnce, strat)
		points = append(points, p)
	}
	var b strings.Builder
	(&ScalingReport{Seconds: 0.2, Rounds: 1, Points: points}).markdown(&b)
	require.Contains(t, b.String(), "**The limit was reached: in 4 of the 4 points, requests were not let through at once.**")
	for _, p := range points {
		require.Contains(t, b.String(), fmt.Sprintf("| single server | 1 | 1 | 4 | %s | %d | %d |", p.Strategy, p.Granted, p.NotAtOnce))
	}
	b.Reset()
	for i := range points {
		points[i].NotAtOnce = 0
	}
	(&ScalingReport{Seconds: 0.2, Rounds: 1, Points: points}).markdown(&b)
	require.Contains(t, b.String(), "Every request of every point was let through at once: no point reached the limit.")
	require.NotContains(t, b.String(), "The limit was reached")
}
