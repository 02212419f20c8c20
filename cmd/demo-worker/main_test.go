package main

import (
	"bytes"
	"context"
	"encoding/json"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/slotbook/slotbook/internal/contention"
	"github.com/slotbook/slotbook/internal/redistest"
)

func TestMain(m *testing.M) { redistest.Main(m) }

func TestBadFlags(t *testing.T) {
	t.Parallel()
	for _, args := range [][]string{
		{"-clients", "0"}, {"-rate", "0"}, {"-burst", "-1"}, {"-period", "0s"},
		{"-duration", "-1s"}, {"-max-wait", "-1s"}, {"-modes", "retry,bogus"},
		{"-redis", "http://x"}, {"stray"}, {"-nosuchflag"},
	} {
		t.Run(strings.Join(args, " "), func(t *testing.T) {
			var out, errb bytes.Buffer
			code := run(context.Background(), args, &out, &errb)
			if args[0] == "-redis" {
				require.Equal(t, 1, code, "stderr: %s", errb.String())
			} else {
				require.Equal(t, 2, code, "stderr: %s", errb.String())
			}
			require.Contains(t, errb.String(), "demo-worker")
		})
	}
}

// TestDemoJSON runs the three modes briefly on a real Redis and checks the
// headline: reservation costs one call per request, retrying costs more.
func TestDemoJSON(t *testing.T) {
	srv := redistest.Shared(t)
	srv.RequireReal(t)
	var out, errb bytes.Buffer
	code := run(context.Background(), []string{
		"-redis", "redis://" + srv.Addr, "-clients", "10", "-duration", "1s", "-max-wait", "1s", "-json",
	}, &out, &errb)
	require.Equal(t, 0, code, "stderr: %s", errb.String())
	dec := json.NewDecoder(&out)
	got := map[string]contention.Result{}
	for dec.More() {
		var r contention.Result
		require.NoError(t, dec.Decode(&r))
		got[r.Mode] = r
	}
	require.Len(t, got, 3)
	res, retry, pl := got["reserve"], got["retry"], got["pool"]
	require.Positive(t, res.Through)
	require.Equal(t, 1.0, res.CallsPerRequest, "reservation: one call per request")
	require.Zero(t, res.Denials)
	require.Greater(t, retry.CallsPerRequest, 3.0, "retry-after-denial stampedes")
	require.Positive(t, pl.Through)
	require.Less(t, pl.CallsPerRequest, 1.0, "the pool books in batches")
	require.Zero(t, pl.Denials)
}

// TestDemoTable runs the default table output on the embedded Redis.
func TestDemoTable(t *testing.T) {
	var out, errb bytes.Buffer
	code := run(context.Background(), []string{"-clients", "4", "-duration", "500ms", "-modes", "reserve"}, &out, &errb)
	require.Equal(t, 0, code, "stderr: %s", errb.String())
	s := out.String()
	require.Contains(t, s, "embedded Redis")
	require.Contains(t, s, "calls/request")
	require.Regexp(t, `reserve\s+\d+\s+\d+\s+0\s+1\.00`, s)
}
