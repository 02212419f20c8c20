// Package waitbound lets package reserve, and the engine's check mode,
// send a call that its caller's deadline does not cut short once it is
// sent, while the caller's end still ends the call's waits before
// anything is sent.
//
// go-redis puts a context's deadline on the socket (a reply that comes
// after it is lost) but watches the context's Done only while a call
// waits: for a pooled connection, a dial, a retry's pause. A booking's
// reply holds a slot to give back if its caller has gone, so reserve hands
// the engine its caller's context without the deadline: WithoutDeadline
// makes it. The engine's timeout then bounds the call once sent, and the
// caller's end still ends the engine's wait for a connection token and
// the client's for a connection, since the context's Done is the caller's.
// Of finds the caller's own context, for an engine without a timeout,
// whose calls the caller's deadline bounds; Hidden tells the engine that
// the caller's deadline did not bound the call, to judge its error. Ended
// and EndedErr tell whether the caller has gone once the reply is in, and
// with what error.
package waitbound

import (
	"context"
	"errors"
	"fmt"
	"time"
)

// undated is its parent without the parent's deadline: the parent's Done,
// Err and values.
type undated struct{ context.Context }

func (undated) Deadline() (time.Time, bool) { return time.Time{}, false }
func (undated) String() string              { return "waitbound.WithoutDeadline" }

// WithoutDeadline returns a context with ctx's values, Done and Err, that
// reports no deadline, so that a call made on it is not cut short by ctx's
// deadline once sent (a reply read past the deadline would be lost) while
// its waits still end when ctx does (at its deadline too, through Done). A
// context with no deadline (one it made, say) is returned as it is, at no
// cost.
func WithoutDeadline(ctx context.Context) context.Context {
	if _, ok := ctx.Deadline(); !ok {
		return ctx
	}
	return undated{ctx}
}

// Of returns the context that WithoutDeadline was given for ctx, if ctx is
// its, deadline included; else ctx itself.
func Of(ctx context.Context) context.Context {
	if b, ok := Hidden(ctx); ok {
		return b
	}
	return ctx
}

// Hidden returns the context that WithoutDeadline was given for ctx, and
// whether there is one: whether ctx is WithoutDeadline's. A context made
// from it (context.WithoutCancel's, for a call shared with other callers)
// is not: the caller's context is not that call's.
func Hidden(ctx context.Context) (context.Context, bool) {
	u, ok := ctx.(undated)
	return u.Context, ok
}

// Ended returns ctx's error, or context.DeadlineExceeded once its deadline
// has passed though its timer has yet to say so: a caller whose deadline
// passed while its call was out has gone, whatever the timer.
func Ended(ctx context.Context) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	if dl, ok := ctx.Deadline(); ok && !time.Now().Before(dl) {
		return context.DeadlineExceeded
	}
	return nil
}

// EndedErr is the error of a caller whose context ended (err, Ended's)
// while its call was out: err, with the call's own error cerr kept in the
// chain where it tells more (an error other than the context's, or one of
// tells, such as a lost reply); a call that ended with the context's own
// error, nothing sent, adds nothing.
func EndedErr(err, cerr error, tells ...error) error {
	switch {
	case cerr == nil:
		return err
	case !errors.Is(cerr, err):
		return fmt.Errorf("%w: %w", err, cerr)
	}
	for _, t := range tells {
		if errors.Is(cerr, t) {
			return cerr
		}
	}
	return err
}
