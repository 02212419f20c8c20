package reserve

import (
	"context"

	"github.com/slotbook/slotbook/throttle"
)

// State reads subject key's state in every limit without booking anything
// or spending quota, in one Redis call: the next free slot and the wait a
// one-unit request made now would get (State.NextFree, State.Wait, on the
// Redis clock), how many units would pass now (State.Available), how far
// ahead slots are booked (State.Backlog), and per limit, in the order of
// Limits, what its key holds and its time to live (State.Keys).
//
// A reading is a snapshot: others may book the next free slot before the
// caller does. State does not consult the fallback: while Redis is
// unavailable it returns the engine's error (matching
// throttle.ErrUnavailable). A bad key is an error matching
// throttle.ErrInvalidRequest, with no Redis call made.
func (l *Limiter) State(ctx context.Context, key string) (throttle.State, error) {
	k, err := l.engineKey(key)
	if err != nil {
		return throttle.State{}, err
	}
	return l.eng.State(ctx, l.keysOf(k), l.limits)
}
