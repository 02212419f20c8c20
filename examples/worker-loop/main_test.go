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

// TestWorkerLoop: 12 units at 4/s burst 2: three at once, then 250ms apart.
func TestWorkerLoop(t *testing.T) {
	var out bytes.Buffer
	start := time.Now()
	// The embedded Redis runs its Lua in this busy test process (under
	// -race, slowly): a timeout that does not depend on its speed.
	require.NoError(t, run(context.Background(), []string{"-n", "7", "-timeout", "10s"}, &out))
	require.Equal(t, 7, strings.Count(out.String(), "unit"))
	require.GreaterOrEqual(t, time.Since(start), time.Second, "units 3 to 6 wait 250ms each")
}
