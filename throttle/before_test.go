package throttle_test

import (
	"testing"
	"time"

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

// TestBookingEnd, on the test clock (10/s, no burst): a booking's End is
// the instant from which giving it back gives nothing. A booking on an
// idle key at t0 ends one interval later: given back as unused a
// microsecond before that, it gives that microsecond back; at End, nothing.
// A refusal's End is the zero Time.
func TestBookingEnd(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	lim := throttle.PerSecond(10, 0)
	lims := []throttle.Limit{lim}
	t0 := base()
	req := throttle.Request{N: 1, MaxWait: 0}
	for _, c := range []struct {
		key  string
		at   time.Duration // when it is given back, after t0
		give time.Duration
	}{{"e1", 100*time.Millisecond - time.Microsecond, time.Microsecond}, {"e2", 100 * time.Millisecond, 0}} {
		bs, err := e.eng.BookBatch(at(t0, 0), c.key, lim, []throttle.Request{req, req})
		require.NoError(t, err)
		require.True(t, bs[0].OK)
		require.False(t, bs[1].OK, "no room for a second at once")
		require.True(t, bs[1].End().IsZero(), "a refusal's End")
		require.Equal(t, time.UnixMicro(t0).Add(100*time.Millisecond), bs[0].End())
		given, err := e.eng.RefundUnused(at(t0, c.at), []string{c.key}, lims, bs[0])
		require.NoError(t, err)
		require.Equal(t, c.give, given[0], "given back %v after t0", c.at)
	}
}
