package throttle_test

// Review of 9494129 (Engine.RefundUnused) through the public API, on the
// test clock. Oracle of its own: the slots that ran (Booking().At of the
// bookings whose holders acted) are replayed against the arrival curve of
// the limit (at most Burst+1+floor(d/I) units in any window of length d),
// which a GCRA-conforming sequence keeps.

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/slotbook/slotbook/throttle"
)

// ruCurve fails t if the slots (µs, with their units) hold more units in
// some window than the limit (interval I µs, burst) lets through.
func ruCurve(t *testing.T, I int64, burst int, at []int64, n []int) {
	t.Helper()
	for i := range at {
		units := 0
		for j := range at {
			if at[j] < at[i] {
				continue
			}
			units = 0
			for k := range at {
				if at[k] >= at[i] && at[k] <= at[j] {
					units += n[k]
				}
			}
			if allowed := int64(burst+1) + (at[j]-at[i])/I; int64(units) > allowed {
				t.Fatalf("%d units ran in [%d, %d] µs (%d µs): a limit of interval %d µs, burst %d, lets %d through",
					units, at[i], at[j], at[j]-at[i], I, burst, allowed)
			}
		}
	}
}

// TestReviewUnusedRepeatAndReverse: RefundUnused retried (before and
// after the slot) gives nothing, even once a later booking ends where the
// given-back one did, and RefundAll after RefundUnused is refused
// (ErrInvalidRequest: one way only); the later booking's holder acts, and
// the slots that ran keep the limit.
func TestReviewUnusedRepeatAndReverse(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	lim := throttle.Every(time.Second, 1, 1) // I = 1 s, tau = 1 s
	t0 := base()
	one := throttle.Request{N: 1, MaxWait: throttle.Forever}
	ms := time.Millisecond
	keys, lims := []string{"k"}, []throttle.Limit{lim}
	var ran []int64

	for range 2 { // burst: slots t0, t0
		x, err := e.eng.Book(at(t0, 0), "k", lim, one)
		require.NoError(t, err)
		require.Zero(t, x.Wait)
		ran = append(ran, x.At.UnixMicro())
	}
	b, err := e.eng.Book(at(t0, 0), "k", lim, one) // slot t0+1s, end t0+3s
	require.NoError(t, err)
	require.Equal(t, time.Second, b.Wait)

	g, err := e.eng.RefundUnused(at(t0, 100*ms), keys, lims, b)
	require.NoError(t, err)
	require.Equal(t, []time.Duration{time.Second}, g)
	c, err := e.eng.Book(at(t0, 200*ms), "k", lim, one) // ends where b did
	require.NoError(t, err)
	require.Equal(t, b.At, c.At)
	ran = append(ran, c.At.UnixMicro())
	for _, now := range []time.Duration{300 * ms, 1500 * ms, 2500 * ms} {
		g, err = e.eng.RefundUnused(at(t0, now), keys, lims, b)
		require.NoError(t, err)
		require.Equal(t, []time.Duration{0}, g, "RefundUnused retried at +%v", now)
		_, err = e.eng.RefundAll(at(t0, now), keys, lims, b)
		require.ErrorIs(t, err, throttle.ErrInvalidRequest, "RefundAll after RefundUnused at +%v", now)
		_, err = e.eng.Refund(at(t0, now), "k", lim, b)
		require.ErrorIs(t, err, throttle.ErrInvalidRequest, "Refund after RefundUnused at +%v", now)
	}
	d, err := e.eng.Book(at(t0, 2500*ms), "k", lim, one)
	require.NoError(t, err)
	ran = append(ran, d.At.UnixMicro())
	ruCurve(t, time.Second.Microseconds(), 1, ran, []int{1, 1, 1, 1})
}

// TestReviewUnusedAfterPause: a booking made before a Pause gives nothing
// back through RefundUnused, before or after its slot, on a single limit.
func TestReviewUnusedAfterPause(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	lim := throttle.Every(time.Second, 1, 0)
	t0 := base()
	one := throttle.Request{N: 1, MaxWait: throttle.Forever}
	ms := time.Millisecond
	keys, lims := []string{"k"}, []throttle.Limit{lim}
	_, err := e.eng.Book(at(t0, 0), "k", lim, one)
	require.NoError(t, err)
	b, err := e.eng.Book(at(t0, 0), "k", lim, one) // slot t0+1s, end t0+2s
	require.NoError(t, err)
	for _, d := range []time.Duration{0, 500 * ms, 3 * time.Second} {
		require.NoError(t, e.eng.Block(at(t0, 10*ms), "k", lim, d))
		for _, now := range []time.Duration{20 * ms, 1500 * ms} {
			g, err := e.eng.RefundUnused(at(t0, now), keys, lims, b)
			require.NoError(t, err)
			require.Equal(t, []time.Duration{0}, g, "after a pause of %v, at +%v", d, now)
		}
	}
}

// TestReviewUnusedLayeredGivesNoNegative: a booking of two limits (100 ms
// and 1 s intervals) given back by RefundUnused at t0+500ms: the short
// limit's units have passed (its end t0+100ms), the long one's stand. The
// time given back to the short limit must be 0, not negative, and the
// long one's 500 ms.
func TestReviewUnusedLayeredGivesNoNegative(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	short := throttle.Every(100*time.Millisecond, 1, 0)
	long := throttle.Every(time.Second, 1, 0)
	keys, lims := []string{"{s}:short", "{s}:long"}, []throttle.Limit{short, long}
	t0 := base()
	ms := time.Millisecond
	bs, err := e.eng.BookAll(at(t0, 0), keys, lims, []throttle.Request{{N: 1, MaxWait: throttle.Forever}})
	require.NoError(t, err)
	require.True(t, bs[0].OK)
	require.Zero(t, bs[0].Wait)
	g, err := e.eng.RefundUnused(at(t0, 500*ms), keys, lims, bs[0])
	require.NoError(t, err)
	require.Equal(t, []time.Duration{0, 500 * ms}, g, "time given back per limit")
}

// TestReviewUnusedLayeredPartial: a booking of two limits, a later
// booking standing on the short limit only (another subject sharing that
// key): RefundUnused after the slot gives back the long limit's units,
// which no one used, and nothing of the short one's; the slots that ran
// then keep both limits.
func TestReviewUnusedLayeredPartial(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	short := throttle.Every(100*time.Millisecond, 1, 0)
	long := throttle.Every(time.Second, 1, 0)
	keys, lims := []string{"{s}:short", "{s}:long"}, []throttle.Limit{short, long}
	t0 := base()
	ms := time.Millisecond
	one := []throttle.Request{{N: 1, MaxWait: throttle.Forever}}
	a, err := e.eng.BookAll(at(t0, 0), keys, lims, one) // slot t0
	require.NoError(t, err)
	b, err := e.eng.BookAll(at(t0, 0), keys, lims, one) // slot t0+1s, ends t0+1.1s, t0+2s
	require.NoError(t, err)
	require.Equal(t, time.Second, b[0].Wait)
	x, err := e.eng.Book(at(t0, 10*ms), "{s}:short", short, one[0]) // stands on the short key
	require.NoError(t, err)
	require.Equal(t, 1090*ms, x.Wait)
	g, err := e.eng.RefundUnused(at(t0, 1050*ms), keys, lims, b[0])
	require.NoError(t, err)
	require.Equal(t, []time.Duration{0, 950 * ms}, g)
	c, err := e.eng.BookAll(at(t0, 1050*ms), keys, lims, one)
	require.NoError(t, err)
	// Short key: a at t0, x at t0+1.1s, c; long key: a at t0, c.
	ruCurve(t, 100*ms.Microseconds(), 0, []int64{a[0].At.UnixMicro(), x.At.UnixMicro(), c[0].At.UnixMicro()}, []int{1, 1, 1})
	ruCurve(t, time.Second.Microseconds(), 0, []int64{a[0].At.UnixMicro(), c[0].At.UnixMicro()}, []int{1, 1})
}
