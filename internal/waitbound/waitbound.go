// Package waitbound lets package reserve bound a call's wait for a Redis
// connection by one context while the call itself runs on another.
//
// A caller whose request must not be cut short once sent (its reply holds
// a booking to give back if the caller has gone) hands the engine a
// context without its end, so the engine's timeout bounds the call. But
// while the call only waits for a free connection, nothing has been sent,
// and the caller's own end should end the wait: Detach makes such a
// context, and Of finds the caller's for that wait alone.
package waitbound

import (
	"context"
	"time"
)

type key struct{}

// detached is context.WithoutCancel(parent) that also answers Of with
// parent: one allocation where WithoutCancel and a WithValue would be two.
type detached struct{ parent context.Context }

func (detached) Deadline() (time.Time, bool) { return time.Time{}, false }
func (detached) Done() <-chan struct{}       { return nil }
func (detached) Err() error                  { return nil }
func (d detached) String() string            { return "waitbound.Detach" }
func (d detached) Value(k any) any {
	if k == (key{}) {
		return d.parent
	}
	return d.parent.Value(k)
}

// Detach returns a context with ctx's values and no deadline or
// cancellation, as context.WithoutCancel does, under which a call's wait
// for a connection (and nothing after it) still ends with ctx. A detached
// context is returned as it is, so the wait stays bounded by the caller's.
func Detach(ctx context.Context) context.Context {
	if d, ok := ctx.(detached); ok {
		return d
	}
	return detached{ctx}
}

// Of returns the context that bounds ctx's wait for a connection: the one
// given to Detach, or ctx itself.
func Of(ctx context.Context) context.Context {
	if b, ok := ctx.Value(key{}).(context.Context); ok {
		return b
	}
	return ctx
}
