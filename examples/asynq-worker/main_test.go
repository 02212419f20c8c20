package main

import (
	"bytes"
	"context"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/slotbook/slotbook/internal/redistest"
)

func TestMain(m *testing.M) { redistest.Main(m) }

// TestExample runs the example's default mode against a real Redis: 30
// tasks at 5/s burst 2 take about 5.4 s.
func TestExample(t *testing.T) {
	if testing.Short() {
		t.Skip("6 s: skipped with -short")
	}
	srv := redistest.Shared(t)
	srv.RequireReal(t)
	var out bytes.Buffer
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	start := time.Now()
	err := run(ctx, []string{"-redis", "redis://" + srv.Addr, "-queue", "q" + redistest.Prefix(t)}, &out)
	require.NoError(t, err, out.String())
	require.Equal(t, 30, strings.Count(out.String(), "started at"))
	require.GreaterOrEqual(t, time.Since(start), 5*time.Second, "30 tasks at 5/s burst 2 take at least 5.4 s")
}
