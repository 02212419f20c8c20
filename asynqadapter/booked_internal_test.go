package asynqadapter

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// TestBookedPrunesQuietKeys: a process's state for a key that has gone
// quiet (a given-back member waiting to be taken out of the index) is
// dropped once it is of no use, by a call for any other key. Before, only
// a call for the same key pruned it, so with many keys (a limiter key per
// tenant) the state grew with every key ever booked (found by review).
func TestBookedPrunesQuietKeys(t *testing.T) {
	b := newBooked(&bookedConfig{horizon: time.Minute}, 0)
	b.forgetLater("quiet", "given back")
	b.mu.Lock()
	require.Contains(t, b.forget, "quiet")
	b.forgotAt["quiet"] = time.Now().Add(-2 * cacheKeep) // Redis has dropped the member's entry by now
	b.mu.Unlock()

	wait, forget := b.enter("busy")
	require.Nil(t, wait)
	b.leave("busy", forget, false)
	b.mu.Lock()
	defer b.mu.Unlock()
	require.NotContains(t, b.forget, "quiet", "the quiet key's members to take out")
	require.NotContains(t, b.forgotAt, "quiet")
}
