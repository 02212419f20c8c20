package throttle_test

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/slotbook/slotbook/throttle"
)

// TestRefundUnused, on the test clock (10/s burst 2, I = 100 ms, tau =
// 200 ms): a booking whose slot has come gives nothing back through
// Refund, but its units through RefundUnused, as long as they stand in
// front of the key; the key then books as if the booking had not been
// made (by the textbook rule: TAT back to max(its TAT before, now)). A
// retried RefundUnused gives nothing; neither does one under a later
// booking, nor one whose units have passed.
func TestRefundUnused(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	lim := throttle.PerSecond(10, 2)
	forever := throttle.Request{N: 1, MaxWait: throttle.Forever}
	t0 := base()
	ms := time.Millisecond

	// Immediate bookings of 2 units on idle keys: slot t0, TAT t0+200ms.
	used, err := e.eng.Book(at(t0, 0), "a0", lim, throttle.Request{N: 2, MaxWait: throttle.Forever})
	require.NoError(t, err)
	b, err := e.eng.Book(at(t0, 0), "a", lim, throttle.Request{N: 2, MaxWait: throttle.Forever})
	require.NoError(t, err)
	require.True(t, b.OK)
	require.Zero(t, b.Wait)
	// 50 ms on, the slot has come: Refund gives nothing.
	given, err := e.eng.Refund(at(t0, 50*ms), "a0", lim, used)
	require.NoError(t, err)
	require.Zero(t, given, "Refund after the slot")
	// RefundUnused gives back what stands in front: TAT t0+200ms, now
	// t0+50ms, 150 ms.
	gs, err := e.eng.RefundUnused(at(t0, 50*ms), []string{"a"}, []throttle.Limit{lim}, b)
	require.NoError(t, err)
	require.Equal(t, []time.Duration{150 * ms}, gs)
	// Again (a retry after a lost reply): nothing.
	gs, err = e.eng.RefundUnused(at(t0, 60*ms), []string{"a"}, []throttle.Limit{lim}, b)
	require.NoError(t, err)
	require.Equal(t, []time.Duration{0}, gs, "a retried RefundUnused")
	// The key is idle again: three units at once (burst 2 + 1) pass now.
	b3, err := e.eng.Book(at(t0, 70*ms), "a", lim, throttle.Request{N: 3, MaxWait: 0})
	require.NoError(t, err)
	require.True(t, b3.OK, "the key is idle again")

	// Under a later booking that still stands: nothing.
	b1, err := e.eng.Book(at(t0, 0), "b", lim, forever)
	require.NoError(t, err)
	_, err = e.eng.Book(at(t0, 0), "b", lim, forever)
	require.NoError(t, err)
	gs, err = e.eng.RefundUnused(at(t0, 10*ms), []string{"b"}, []throttle.Limit{lim}, b1)
	require.NoError(t, err)
	require.Equal(t, []time.Duration{0}, gs, "under a later booking")

	// Once its units have passed (TAT t0+100ms, now t0+150ms): nothing.
	bc, err := e.eng.Book(at(t0, 0), "c", lim, forever)
	require.NoError(t, err)
	gs, err = e.eng.RefundUnused(at(t0, 150*ms), []string{"c"}, []throttle.Limit{lim}, bc)
	require.NoError(t, err)
	require.Equal(t, []time.Duration{0}, gs, "units passed")

	// A booking whose slot has not come gives back as Refund does.
	_, err = e.eng.Book(at(t0, 0), "d", lim, throttle.Request{N: 3, MaxWait: throttle.Forever})
	require.NoError(t, err)
	bd, err := e.eng.Book(at(t0, 0), "d", lim, forever) // slot t0+100ms, TAT t0+400ms
	require.NoError(t, err)
	require.Equal(t, 100*ms, bd.Wait)
	gs, err = e.eng.RefundUnused(at(t0, 20*ms), []string{"d"}, []throttle.Limit{lim}, bd)
	require.NoError(t, err)
	require.Equal(t, []time.Duration{100 * ms}, gs)
}
