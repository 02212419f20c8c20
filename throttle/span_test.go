package throttle_test

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/slotbook/slotbook/throttle"
)

// TestRefundUnusedRun, on the test clock (10/s, no burst, I = 100 ms):
// three bookings of one call, back to back from t0, given back as one run
// in one refund: the key is idle again, so the next booking lands at once
// (the textbook's slot with nothing standing), and a retry with the same
// run gives nothing more. A run that is empty, not back to back, or holds
// a refusal is bad input: ErrInvalidRequest, no Redis call. A booking of a
// run given back on its own, by either way, or in another run, is refused
// too, and so is a run holding a booking given back on its own. Layered
// limits give back every key.
func TestRefundUnusedRun(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	lim := throttle.PerSecond(10, 0)
	lims := []throttle.Limit{lim}
	t0 := base()
	at0 := time.UnixMicro(t0)
	ms := time.Millisecond
	forever := throttle.Request{N: 1, MaxWait: throttle.Forever}
	bs, err := e.eng.BookBatch(at(t0, 0), "s", lim, []throttle.Request{forever, forever, forever})
	require.NoError(t, err)
	for i, b := range bs {
		require.True(t, b.OK)
		require.Equal(t, at0.Add(time.Duration(i)*100*ms), b.At, "booking %d", i)
	}

	ctx := at(t0, 10*ms)
	for what, run := range map[string][]throttle.Booking{
		"empty":        nil,
		"a gap":        {bs[0], bs[2]},
		"out of order": {bs[1], bs[0]},
		"a refusal":    {bs[0], {}},
	} {
		_, err = e.eng.RefundUnusedRun(ctx, []string{"s"}, lims, run)
		require.ErrorIs(t, err, throttle.ErrInvalidRequest, what)
	}

	gs, err := e.eng.RefundUnusedRun(ctx, []string{"s"}, lims, bs)
	require.NoError(t, err)
	require.Equal(t, []time.Duration{290 * ms}, gs, "all three given back: TAT t0+300ms to now, t0+10ms")
	gs, err = e.eng.RefundUnusedRun(at(t0, 20*ms), []string{"s"}, lims, bs)
	require.NoError(t, err)
	require.Equal(t, []time.Duration{0}, gs, "a retry of the same run")
	_, err = e.eng.RefundUnused(ctx, []string{"s"}, lims, bs[2])
	require.ErrorIs(t, err, throttle.ErrInvalidRequest, "one of the run on its own")
	_, err = e.eng.RefundAll(ctx, []string{"s"}, lims, bs[0])
	require.ErrorIs(t, err, throttle.ErrInvalidRequest, "one of the run on its own, as used")
	_, err = e.eng.RefundUnusedRun(ctx, []string{"s"}, lims, bs[1:])
	require.ErrorIs(t, err, throttle.ErrInvalidRequest, "part of the run as a run of its own")
	next, err := e.eng.Book(at(t0, 20*ms), "s", lim, forever)
	require.NoError(t, err)
	require.Equal(t, at0.Add(20*ms), next.At, "the key idle again")

	// A booking given back on its own first: the run holding it is refused.
	cs, err := e.eng.BookBatch(at(t0, 30*ms), "c", lim, []throttle.Request{forever, forever})
	require.NoError(t, err)
	_, err = e.eng.RefundUnused(at(t0, 30*ms), []string{"c"}, lims, cs[1])
	require.NoError(t, err)
	_, err = e.eng.RefundUnusedRun(at(t0, 30*ms), []string{"c"}, lims, cs)
	require.ErrorIs(t, err, throttle.ErrInvalidRequest, "a run holding a booking given back on its own")

	// Layered: two limits, each key given back.
	layered := []throttle.Limit{lim, throttle.PerMinute(600, 5)}
	keys := []string{"{l}", "{l}:60000ms"}
	lb, err := e.eng.BookAll(at(t0, 0), keys, layered, []throttle.Request{forever, forever})
	require.NoError(t, err)
	gs, err = e.eng.RefundUnusedRun(at(t0, 0), keys, layered, lb)
	require.NoError(t, err)
	require.Equal(t, []time.Duration{200 * ms, 200 * ms}, gs)
}
