package main

import (
	"bytes"
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/slotbook/slotbook/internal/redistest"
)

func TestMain(m *testing.M) {
	if spec := os.Getenv(workerEnv); spec != "" { // a process of a -scaling point
		os.Exit(workerMain(context.Background(), spec, os.Stdin, os.Stdout, os.Stderr))
	}
	redistest.Main(m)
}

// TestSmallRun runs every measurement at a small size on redis-servers the
// command starts itself, and checks the report holds every section and
// every target with a verdict.
func TestSmallRun(t *testing.T) {
	if testing.Short() {
		t.Skip("about 15 s: skipped with -short")
	}
	redistest.Shared(t).RequireReal(t)
	out := filepath.Join(t.TempDir(), "BENCH.md")
	var stdout, stderr bytes.Buffer
	code := run(context.Background(), []string{"-keys", "200", "-samples", "200", "-contention", "1s", "-json", "-out", out}, &stdout, &stderr)
	require.Equal(t, 0, code, stderr.String())

	var rep Report
	require.NoError(t, json.Unmarshal(stdout.Bytes(), &rep))
	require.Len(t, rep.Memory, 5)
	require.Len(t, rep.Latency, 10) // with the lease row (lease.go) and four references
	require.Equal(t, []string{"-contention", "1s", "-json", "-keys", "200", "-out", out, "-samples", "200"}, rep.Flags)
	require.Len(t, rep.Contention, 3)
	require.Equal(t, 1.0, rep.ContentionSeconds) // -contention 1s
	require.True(t, rep.FreshServers)
	require.NotEmpty(t, rep.Redis)
	require.Len(t, rep.Targets, 12)
	for _, m := range rep.Memory {
		require.Positive(t, m.UsagePerKey, m.Name)
	}
	for _, l := range rep.Latency {
		require.Positive(t, l.P50, l.Name)
		require.Positive(t, l.UsecPerCall, l.Name)
	}
	// The counts do not depend on the machine's speed.
	byName := map[string]Target{}
	for _, tg := range rep.Targets {
		byName[tg.Name] = tg
	}
	require.True(t, byName["contention: reservation calls per request"].Met)
	require.True(t, byName["memory per key / integer-plus-expiry floor"].Met)
	require.True(t, byName["coalescing: Redis calls per reservation"].Met)
	// Uncoalesced callers with merging off make one call each; merged,
	// the table prints the calls measured (it printed 1.000 whatever they
	// were once merging had landed).
	c := rep.Coalescing
	require.Equal(t, 1.0, c.AloneCalls, "one call per reservation with merging off")
	require.Positive(t, c.UncoalescedCalls)
	require.LessOrEqual(t, c.UncoalescedCalls, 1.0)

	md, err := os.ReadFile(out)
	require.NoError(t, err)
	require.Contains(t, string(md), "`go run ./cmd/slotbench -contention 1s -json -keys 200 -out "+out+" -samples 200` (full run)")
	require.Contains(t, string(md), "Every figure comes from this one run, memory per key with each strategy on a redis-server started for it, cost per check, contention and coalescing on one redis-server started for the run; ")
	for _, section := range []string{"## Targets", "## Memory per key", "## Cost per check", "## Contention", "## Coalescing"} {
		require.True(t, strings.Contains(string(md), section), section)
	}
	// The contention windows: 1 s to start (retry) or book (reserve, pool).
	require.Contains(t, string(md), "5 + 10 × 1 = 15 for retry, 5 + 10 × 3 = 35 for reserve and pool")
	require.Contains(t, string(md), fmt.Sprintf("| uncoalesced, merged | %.0f | %.3f |", c.UncoalescedPerSec, c.UncoalescedCalls))
	require.Contains(t, string(md), fmt.Sprintf("| uncoalesced, one call each (merging off) | %.0f | 1.000 |", c.AlonePerSec))
}

// TestSetFlags: the report records the flags given, in name order, as a
// shell takes them back, with -redis's password redacted.
func TestSetFlags(t *testing.T) {
	var o options
	fs := flag.NewFlagSet("t", flag.ContinueOnError)
	fs.StringVar(&o.redisURL, "redis", "", "")
	fs.StringVar(&o.out, "out", "", "")
	fs.BoolVar(&o.quick, "quick", false, "")
	fs.BoolVar(&o.json, "json", false, "")
	o.scale.register(fs)
	require.NoError(t, fs.Parse([]string{"-redis", "redis://me:s3cret@db:6379/2", "-quick", "-json=false", "-out", "it's here.md",
		"-scaling", "-scaling-goroutines", "1,4"}))
	got := setFlags(fs)
	require.Equal(t, []string{"-json=false", "-out", `'it'\''s here.md'`, "-quick", "-redis", "redis://me:xxxxx@db:6379/2",
		"-scaling", "-scaling-goroutines", "1,4"}, got)
	require.NotContains(t, strings.Join(got, " "), "s3cret")
}

func TestBadFlags(t *testing.T) {
	for _, args := range [][]string{{"-keys", "5"}, {"-samples", "1"}, {"-contention", "0s"}, {"stray"}, {"-nope"}} {
		var stdout, stderr bytes.Buffer
		require.Equal(t, 2, run(context.Background(), args, &stdout, &stderr), args)
		require.Equal(t, 1, strings.Count(stderr.String(), "\n"), stderr.String())
	}
}

// TestMemoryLeavesConnectionsOut: the INFO delta per key is the same
// whether the fill's 16 connections are closed before the second reading
// (a strategy made by strategies) or still open then (one without on, so
// filled through the measuring client): their memory, by CLIENT LIST's
// tot-mem, is taken out of both readings. Each on a fresh server, 10,000
// keys of the floor.
func TestMemoryLeavesConnectionsOut(t *testing.T) {
	if testing.Short() {
		t.Skip("needs a redis-server: skipped with -short")
	}
	ctx := context.Background()
	var rows []MemoryRow
	for _, open := range []bool{false, true} {
		srv := redistest.Start(t)
		srv.RequireReal(t)
		rdb := srv.Client(t)
		eng, err := newEngine(rdb)
		require.NoError(t, err)
		s := strategies(rdb, eng)[4]
		if open {
			s.on = nil
		}
		row, err := measureMemory(ctx, rdb, s, "lco", 10_000)
		require.NoError(t, err)
		n, _, err := clientsMemory(ctx, rdb)
		require.NoError(t, err)
		t.Logf("fill's connections open at the second reading: %v: INFO delta %.1f bytes/key, MEMORY USAGE %.1f; %d connections now", open, row.InfoPerKey, row.UsagePerKey, n)
		if open {
			require.Greater(t, n, 1, "the fill's connections are still open")
		}
		rows = append(rows, row)
	}
	// A dictionary table half-way through a resize moves the figure by
	// 64 KiB (6.6 bytes a key) from run to run; 16 connections' buffers
	// left in it would be some 30.
	require.InDelta(t, rows[0].InfoPerKey, rows[1].InfoPerKey, 10)
}
