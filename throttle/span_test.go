package throttle_test

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/slotbook/slotbook/throttle"
)

// TestSpan, on the test clock (10/s, no burst, I = 100 ms): three bookings
// of one call, back to back from t0, given back as one (Span) in one
// refund: the key is idle again, so the next booking lands at t0 (the
// textbook's slot with nothing standing), and a retry gives nothing more.
// A run that is empty, not back to back, or holds a refusal is bad input:
// ErrInvalidRequest, no Redis call. Layered limits span every key.
func TestSpan(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	lim := throttle.PerSecond(10, 0)
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

	_, err = throttle.Span(nil)
	require.ErrorIs(t, err, throttle.ErrInvalidRequest, "empty")
	_, err = throttle.Span([]throttle.Booking{bs[0], bs[2]})
	require.ErrorIs(t, err, throttle.ErrInvalidRequest, "a gap")
	_, err = throttle.Span([]throttle.Booking{bs[1], bs[0]})
	require.ErrorIs(t, err, throttle.ErrInvalidRequest, "out of order")
	_, err = throttle.Span([]throttle.Booking{bs[0], {}})
	require.ErrorIs(t, err, throttle.ErrInvalidRequest, "a refusal")
	one, err := throttle.Span(bs[:1])
	require.NoError(t, err)
	require.Equal(t, bs[0].At, one.At)

	all, err := throttle.Span(bs)
	require.NoError(t, err)
	require.Equal(t, bs[2].At, all.At, "the last one's slot")
	gs, err := e.eng.RefundUnused(at(t0, 10*ms), []string{"s"}, []throttle.Limit{lim}, all)
	require.NoError(t, err)
	require.Equal(t, []time.Duration{290 * ms}, gs, "all three given back: TAT t0+300ms to now, t0+10ms")
	gs, err = e.eng.RefundUnused(at(t0, 20*ms), []string{"s"}, []throttle.Limit{lim}, all)
	require.NoError(t, err)
	require.Equal(t, []time.Duration{0}, gs, "a retry")
	next, err := e.eng.Book(at(t0, 20*ms), "s", lim, forever)
	require.NoError(t, err)
	require.Equal(t, at0.Add(20*ms), next.At, "the key idle again")

	// Layered: two limits, each key given back.
	lims := []throttle.Limit{lim, throttle.PerMinute(600, 5)}
	keys := []string{"{l}", "{l}:60000ms"}
	lb, err := e.eng.BookAll(at(t0, 0), keys, lims, []throttle.Request{forever, forever})
	require.NoError(t, err)
	span, err := throttle.Span(lb)
	require.NoError(t, err)
	gs, err = e.eng.RefundUnused(at(t0, 0), keys, lims, span)
	require.NoError(t, err)
	require.Equal(t, []time.Duration{200 * ms, 200 * ms}, gs)
}
