package main

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/slotbook/slotbook/throttle"
)

// TestNextFreeDate: NEXT FREE shows its date when it is a day or more
// away (the time of day alone would name the wrong day), and the time of
// day alone when it is nearer.
func TestNextFreeDate(t *testing.T) {
	t.Parallel()
	e := rvNewEnv(t, "")
	day := throttle.Every(24*time.Hour, 1, 0)
	lim := e.limiter(t, "api", day)
	e.book(t, lim, "far", 2) // the next free slot two days ahead
	text := e.run(t, "-limit", "1/24h:0", "inspect", "api", "far")
	st, err := lim.State(context.Background(), "far")
	require.NoError(t, err)
	require.Greater(t, st.Wait, 24*time.Hour)
	require.Contains(t, text, st.NextFree.Format("2006-01-02 15:04:05.000"), text)

	sec := throttle.Every(10*time.Second, 1, 0)
	e.book(t, e.limiter(t, "near", sec), "s", 2)
	text = e.run(t, "-limit", "1/10s:0", "inspect", "near", "s")
	st, err = e.limiter(t, "near", sec).State(context.Background(), "s")
	require.NoError(t, err)
	require.Contains(t, text, st.NextFree.Format("15:04:05.000"), text)
	require.NotContains(t, text, st.NextFree.Format("2006-01-02 15:04"), text)
	require.Equal(t, 1, strings.Count(text, `"s"`))
}
