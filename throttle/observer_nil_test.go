package throttle_test

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/slotbook/slotbook/internal/redistest"
	"github.com/slotbook/slotbook/throttle"
)

// ptrObserver is an Observer whose methods need a non-nil receiver.
type ptrObserver struct{ n int }

func (o *ptrObserver) ObserveDecision(string, throttle.Outcome, time.Duration) { o.n++ }
func (o *ptrObserver) ObserveCall(string, time.Duration, error)                { o.n++ }
func (o *ptrObserver) ObserveRefund(string, time.Duration)                     { o.n++ }
func (o *ptrObserver) ObserveBreaker(bool)                                     { o.n++ }

// TestWithObserverRefusesNilInside: a nil pointer in a non-nil Observer
// interface is refused at construction, not left to panic on the first
// call (possibly on one of the library's goroutines).
func TestWithObserverRefusesNilInside(t *testing.T) {
	t.Parallel()
	rdb := redistest.Shared(t).Client(t)
	var typedNil *ptrObserver
	_, err := throttle.New(rdb, throttle.WithPrefix(redistest.Prefix(t)), throttle.WithObserver(typedNil))
	require.ErrorContains(t, err, "nil observer")
	_, err = throttle.New(rdb, throttle.WithPrefix(redistest.Prefix(t)), throttle.WithObserver(nil))
	require.ErrorContains(t, err, "nil observer")
	_, err = throttle.New(rdb, throttle.WithPrefix(redistest.Prefix(t)), throttle.WithObserver(&ptrObserver{}))
	require.NoError(t, err)
}
