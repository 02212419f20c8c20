// Package testhook lets the module's own tests run the engine's scripts at
// an explicit time instead of the Redis clock. Being internal, it cannot be
// reached from outside the module, so production callers always get TIME.
package testhook

import "context"

type nowKey struct{}

// WithNow returns a context under which engine scripts use micros as now.
func WithNow(ctx context.Context, micros int64) context.Context {
	return context.WithValue(ctx, nowKey{}, micros)
}

// Now returns the time set by WithNow, if any.
func Now(ctx context.Context) (int64, bool) {
	v, ok := ctx.Value(nowKey{}).(int64)
	return v, ok
}
