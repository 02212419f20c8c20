package throttle_test

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/slotbook/slotbook/throttle"
)

// TestRemainingAboveMaxBatch: a Remaining counts the units that would pass
// now, however many: under a burst of 5,000 an idle key has 5,000 left
// after one unit, more than MaxBatch (it was capped there).
func TestRemainingAboveMaxBatch(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	lim := throttle.PerSecond(10_000, 5_000)
	r, err := e.eng.Allow(context.Background(), "big", lim)
	require.NoError(t, err)
	require.True(t, r.Allowed)
	require.Greater(t, lim.Burst, throttle.MaxBatch)
	require.Equal(t, 5_000, r.Remaining)
	r, err = e.eng.AllowAll(context.Background(), []string{"{s}:a", "{s}:b"}, []throttle.Limit{lim, throttle.PerSecond(10_000, 3_000)}, 2)
	require.NoError(t, err)
	require.Equal(t, 2_999, r.Remaining, "the fewest of two limits")
}
