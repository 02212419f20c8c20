// Package waitbound lets package reserve bound a call's wait for a Redis
// connection by one context while the call itself runs on another.
//
// A caller whose request must not be cut short once sent (its reply holds
// a booking to give back if the caller has gone) hands the engine a
// context without its end (context.WithoutCancel), so the engine's timeout
// bounds the call. But while the call only waits for a free connection,
// nothing has been sent, and the caller's own end should end the wait:
// With carries the caller's context for that wait alone.
package waitbound

import "context"

type key struct{}

// With returns ctx carrying bound, whose end ends the call's wait for a
// connection (and nothing after it).
func With(ctx, bound context.Context) context.Context {
	return context.WithValue(ctx, key{}, bound)
}

// Of returns the context that bounds ctx's wait for a connection: the one
// given to With, or ctx itself.
func Of(ctx context.Context) context.Context {
	if b, ok := ctx.Value(key{}).(context.Context); ok {
		return b
	}
	return ctx
}
