package throttle_test

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/slotbook/slotbook/throttle"
)

// TestBookingBefore, on the test clock (2/s with a burst of 2): three
// bookings of one call all land at once, the same slot (At), so At cannot
// tell their order; Before tells Redis's. A refusal is before nothing and
// nothing is before it; a booking is not before itself. Bookings given
// back and booked again keep their order with those that stood under them.
func TestBookingBefore(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	lim := throttle.PerSecond(2, 2)
	t0 := base()
	now := throttle.Request{N: 1, MaxWait: 0}
	bs, err := e.eng.BookBatch(at(t0, 0), "b", lim, []throttle.Request{now, now, now, now})
	require.NoError(t, err)
	for i := range 3 {
		require.True(t, bs[i].OK, "booking %d", i)
		require.Equal(t, bs[0].At, bs[i].At, "booking %d: the same slot", i)
	}
	require.False(t, bs[3].OK, "the fourth finds no room at once")
	for i := range 3 {
		for k := range 3 {
			require.Equal(t, i < k, bs[i].Before(bs[k]), "booking %d before %d", i, k)
		}
		require.False(t, bs[i].Before(bs[3]), "before a refusal")
		require.False(t, bs[3].Before(bs[i]), "a refusal before")
	}

	// The latest given back and booked again: still after the others.
	_, err = e.eng.RefundUnused(at(t0, 0), []string{"b"}, []throttle.Limit{lim}, bs[2])
	require.NoError(t, err)
	again, err := e.eng.Book(at(t0, 0), "b", lim, now)
	require.NoError(t, err)
	require.True(t, again.OK)
	require.Equal(t, bs[0].At, again.At)
	require.True(t, bs[1].Before(again))
	require.False(t, again.Before(bs[1]))
}
