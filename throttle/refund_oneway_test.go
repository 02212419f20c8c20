package throttle_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/slotbook/slotbook/throttle"
)

// TestRefundOneWayOnly: a booking is given back one way only. Under 1 per
// 200 ms, A books now and B the next slot; B is given back by RefundAll
// before its slot, and C takes that slot, ending where B did. Once C's
// slot has come (its holder acted) and B's tombstone, which lives until
// B's slot, is gone, a RefundUnused of B (or of a copy of it) must not
// give back C's room: it fails with ErrInvalidRequest, making no Redis
// call, and the next booking D is a whole interval after C, as a textbook
// GCRA has it. (Before, it gave C's room back: D came about 100 ms after C.)
// The other order fails the same way, and retrying the same way is safe.
func TestRefundOneWayOnly(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	ctx := context.Background()
	lim := throttle.PerSecond(5, 0) // I = 200 ms
	req := throttle.Request{N: 1, MaxWait: time.Minute}
	for try := 0; ; try++ {
		key := fmt.Sprintf("oneway%d", try)
		book := func() throttle.Booking {
			t.Helper()
			b, err := e.eng.Book(ctx, key, lim, req)
			require.NoError(t, err)
			require.True(t, b.OK)
			return b
		}
		book() // A
		b := book()
		copyOfB := b
		given, err := e.eng.Refund(ctx, key, lim, b)
		require.NoError(t, err)
		c := book()
		if given <= 0 || !c.At.Equal(b.At) {
			// A busy machine let B's slot come first: C does not end
			// where B did, and nothing here tells the ways apart.
			require.Less(t, try, 5, "B's slot came before C could take it, five times")
			continue
		}
		time.Sleep(time.Until(c.At) + 100*time.Millisecond) // C's slot has come, and B's tombstone is gone
		for _, x := range []throttle.Booking{b, copyOfB} {
			before := e.calls.Load()
			_, err = e.eng.RefundUnused(ctx, []string{key}, []throttle.Limit{lim}, x)
			require.ErrorIs(t, err, throttle.ErrInvalidRequest, "RefundUnused after RefundAll")
			require.Equal(t, before, e.calls.Load(), "a refused give-back made a Redis call")
		}
		again, err := e.eng.Refund(ctx, key, lim, b)
		require.NoError(t, err, "RefundAll retried")
		require.Zero(t, again)
		d := book()
		require.GreaterOrEqual(t, d.At.Sub(c.At), lim.Interval(), "D after C: %v", d.At.Sub(c.At))
		break
	}

	// The other order: RefundUnused first, then RefundAll fails.
	b, err := e.eng.Book(ctx, "oneway-rev", lim, req)
	require.NoError(t, err)
	_, err = e.eng.RefundUnused(ctx, []string{"oneway-rev"}, []throttle.Limit{lim}, b)
	require.NoError(t, err)
	_, err = e.eng.RefundUnused(ctx, []string{"oneway-rev"}, []throttle.Limit{lim}, b)
	require.NoError(t, err, "RefundUnused retried")
	before := e.calls.Load()
	_, err = e.eng.Refund(ctx, "oneway-rev", lim, b)
	require.ErrorIs(t, err, throttle.ErrInvalidRequest, "RefundAll after RefundUnused")
	require.Equal(t, before, e.calls.Load())
}
