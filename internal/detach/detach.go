// Package detach makes the context of a call that a package makes on
// behalf of a caller who has gone (a booking given back, a recalled
// booking put back): the caller's values without its end, and a bound
// that leaves the engine's own to act.
package detach

import (
	"context"
	"time"
)

// Context returns a context with ctx's values but not its end, for one
// call through an engine whose timeout is timeout (throttle.Engine's
// Timeout), and its cancel function. It is bounded by a second, or, where
// the engine's timeout is a second or more, by that timeout and a second
// more: the engine's own bound then ends a call that Redis does not
// answer, and the engine counts it against Redis (the node's breaker
// opens, and the calls after fail at once, without waiting), where it
// counts a bound of its caller's, come first, against the caller. With a
// bound of one second whatever the timeout, a pool closed while Redis was
// paused gave its bookings back a second each, one after another, and the
// breaker never opened.
func Context(ctx context.Context, timeout time.Duration) (context.Context, context.CancelFunc) {
	d := time.Second
	if timeout >= time.Second {
		d = timeout + time.Second
	}
	return context.WithTimeout(context.WithoutCancel(ctx), d)
}
