package asynqadapter

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/slotbook/slotbook/throttle"
)

// TestBookedPrunesQuietKeys: a process's state for a key that has gone
// quiet (a booking it kept, a used member waiting to be taken out of the
// index) is dropped once it is of no use, by a call for any other key.
// Before, only a call for the same key pruned it, so with many keys (a
// limiter key per tenant) the state grew with every key ever booked
// (found by review).
func TestBookedPrunesQuietKeys(t *testing.T) {
	b := newBooked(&bookedConfig{horizon: time.Minute}, 0, time.Second)
	t0 := time.Now()
	wait, forget := b.enter("quiet")
	require.Nil(t, wait)
	b.leave("quiet", "self", throttle.RetryBooking{Now: t0, Due: map[string]time.Time{"other": t0.Add(time.Second)}}, t0, forget, false)
	b.forgetLater("quiet", "used")
	b.mu.Lock()
	require.Contains(t, b.due, "quiet", "the booking the reply listed is kept")
	require.Contains(t, b.forget, "quiet")
	b.mu.Unlock()

	later := t0.Add(2 * cacheKeep) // the kept slot passed long ago; Redis has dropped the used member
	wait, forget = b.enter("busy")
	require.Nil(t, wait)
	b.leave("busy", "self", throttle.RetryBooking{Now: later}, later, forget, false)
	b.mu.Lock()
	defer b.mu.Unlock()
	require.NotContains(t, b.due, "quiet", "the quiet key's kept bookings")
	require.NotContains(t, b.forget, "quiet", "the quiet key's members to take out")
}
