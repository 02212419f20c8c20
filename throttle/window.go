package throttle

import (
	"context"
	_ "embed"
	"fmt"
	"time"
)

var (
	//go:embed scripts/window.lua
	windowSrc    string
	windowScript = newScript(clockSrc + windowSrc)
)

// A Window is an exact limit: at most Max events in any span of Span. It is
// kept as a sliding-window log, one sorted-set member per event, so it
// costs memory per event (a few hundred bytes each) where GCRA costs one
// integer per key: use it only where the exact count in the last window
// matters, with small limits. The zero Window is invalid.
type Window struct {
	Max  int
	Span time.Duration
}

// Validate reports whether w can be enforced; the error matches
// ErrInvalidLimit.
func (w Window) Validate() error {
	switch {
	case w.Max <= 0:
		return fmt.Errorf("%w: window max %d must be positive", ErrInvalidLimit, w.Max)
	case w.Span < time.Microsecond || ceilMicros(w.Span) >= maxMicros:
		return fmt.Errorf("%w: window span %v", ErrInvalidLimit, w.Span)
	}
	return nil
}

// AllowWindow reports whether n events may happen for key now under the
// exact window w, and records them if so. RetryAfter, for a denial, is the
// exact time until enough past events leave the window. Unlike AllowN, the
// call is bounded by ctx, deadline included: a reply the deadline cuts off
// is lost (ErrReplyLost), and the events it recorded stay in the window,
// which has no give-back.
func (e *Engine) AllowWindow(ctx context.Context, key string, w Window, n int) (Result, error) {
	if err := w.Validate(); err != nil {
		return Result{}, err
	}
	if err := CheckKey(key); err != nil {
		return Result{}, err
	}
	if n <= 0 || n > w.Max {
		return Result{}, fmt.Errorf("%w: n = %d under a window of %d", ErrInvalidRequest, n, w.Max)
	}
	vals, err := e.run(ctx, windowScript, []string{key}, []any{nowArg(ctx), ceilMicros(w.Span), w.Max, n}, 4)
	if err != nil {
		return Result{}, fmt.Errorf("throttle: window %q: %w", key, err)
	}
	r := Result{
		Allowed:    vals[0] == 1,
		RetryAfter: time.Duration(vals[1]) * time.Microsecond,
		Remaining:  int(vals[2]),
		ResetAfter: time.Duration(vals[3]) * time.Microsecond,
	}
	if r.Allowed {
		e.observer.ObserveDecision(label(key), Allowed, 0)
	} else {
		e.observer.ObserveDecision(label(key), Denied, r.RetryAfter)
	}
	return r, nil
}
