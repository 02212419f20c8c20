package main

import (
	"bytes"
	"context"
	"encoding/json"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/slotbook/slotbook/internal/redistest"
)

// TestLeaseDemo: -leases runs jobs under a concurrency limit and the rate
// at once; no more than the leases run together, and jobs do run.
func TestLeaseDemo(t *testing.T) {
	srv := redistest.Shared(t)
	srv.RequireReal(t)
	var out, errb bytes.Buffer
	code := run(context.Background(), []string{"-redis", "redis://" + srv.Addr, "-leases", "3", "-clients", "8",
		"-rate", "20", "-burst", "2", "-duration", "1s", "-work", "100ms", "-json"}, &out, &errb)
	require.Equal(t, 0, code, errb.String())
	var res leaseResult
	require.NoError(t, json.Unmarshal(out.Bytes(), &res), out.String())
	t.Logf("%+v", res)
	require.Positive(t, res.Jobs)
	require.LessOrEqual(t, res.Peak, 3, "more jobs at once than leases")
	require.Equal(t, 3, res.Leases)
}

// TestLeaseDemoFlags: the lease experiment refuses what it cannot honour.
func TestLeaseDemoFlags(t *testing.T) {
	for _, args := range [][]string{
		{"-leases", "-1"},
		{"-leases", "2", "-work", "0s"},
		{"-leases", "2", "-processes", "2"},
		{"-leases", "2", "-modes", "reserve"},
		{"-leases", "2", "-plot", "x.png"},
	} {
		var out, errb bytes.Buffer
		require.Equal(t, 2, run(context.Background(), args, &out, &errb), "%v", args)
	}
}
