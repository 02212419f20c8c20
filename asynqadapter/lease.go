package asynqadapter

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/hibiken/asynq"

	"github.com/slotbook/slotbook/lease"
)

// ErrLeaseBusy is the Err of the *RateLimitedError LeaseMiddleware returns
// for a task that waited its max wait for a lease without getting one.
var ErrLeaseBusy = errors.New("asynqadapter: no lease free within the max wait")

// A LeaseOption configures LeaseMiddleware.
type LeaseOption func(*leaseConfig) error

type leaseConfig struct {
	key     KeyFunc
	maxWait time.Duration // 0: as long as the task's context allows
}

// WithLeaseKey sets how a task is mapped to its lease key (default
// ByType: at most N tasks of each type at once, across every server).
func WithLeaseKey(f KeyFunc) LeaseOption {
	return func(c *leaseConfig) error {
		if f == nil {
			return fmt.Errorf("%w: nil key function", ErrInvalidOption)
		}
		c.key = f
		return nil
	}
}

// WithLeaseMaxWait bounds how long a task waits for a lease. A task that
// gets none within d goes back to asynq with a *RateLimitedError (Err
// ErrLeaseBusy, RetryAfter d), which IsFailure and RetryDelayFunc treat
// as a refusal, not a failure. Without it a task waits as long as its
// context allows (asynq always sets a deadline), and a task whose
// deadline passes while it waits fails with the context's error.
func WithLeaseMaxWait(d time.Duration) LeaseOption {
	return func(c *leaseConfig) error {
		if d <= 0 {
			return fmt.Errorf("%w: lease max wait %v", ErrInvalidOption, d)
		}
		c.maxWait = d
		return nil
	}
}

// LeaseMiddleware runs each task while holding a lease of sem for its key,
// the task type by default: at most sem.N() tasks of a type run at once
// across every server sharing sem's name and Redis (asynq's own
// concurrency is per server). Waiting tasks are served first come, first
// served across servers, and the lease is given back when the handler
// returns. It panics if an option is bad (NewLeaseMiddleware returns the
// error instead).
//
// To require a slot of a rate limit as well, put LeaseMiddleware first, so
// that it wraps the rate middleware:
//
//	mux.Use(asynqadapter.LeaseMiddleware(sem), asynqadapter.Middleware(lim))
//
// A task then takes its lease, then books its slot and sleeps until it.
// The other order would book a slot and then wait for a lease, letting
// the slot pass unused and starting tasks whose slots have passed all at
// once when leases come back, a burst the rate limit never granted; lease
// first keeps both limits exact, at the cost of a lease held idle while
// its task sleeps until its slot (bounded by the rate middleware's max
// wait).
func LeaseMiddleware(sem *lease.Semaphore, opts ...LeaseOption) asynq.MiddlewareFunc {
	mw, err := NewLeaseMiddleware(sem, opts...)
	if err != nil {
		panic(err)
	}
	return mw
}

// NewLeaseMiddleware is LeaseMiddleware returning an error matching
// ErrInvalidOption for a nil semaphore or a bad option.
func NewLeaseMiddleware(sem *lease.Semaphore, opts ...LeaseOption) (asynq.MiddlewareFunc, error) {
	if sem == nil {
		return nil, fmt.Errorf("%w: nil lease semaphore", ErrInvalidOption)
	}
	c := leaseConfig{key: ByType}
	for _, opt := range opts {
		if err := opt(&c); err != nil {
			return nil, err
		}
	}
	return func(next asynq.Handler) asynq.Handler {
		return asynq.HandlerFunc(func(ctx context.Context, t *asynq.Task) error {
			key := c.key(ctx, t)
			wctx, cancel := ctx, context.CancelFunc(func() {})
			if c.maxWait > 0 {
				wctx, cancel = context.WithTimeout(ctx, c.maxWait)
			}
			l, err := sem.Acquire(wctx, key)
			cancel()
			if err != nil {
				if c.maxWait > 0 && ctx.Err() == nil && errors.Is(err, context.DeadlineExceeded) {
					return &RateLimitedError{Key: key, RetryAfter: c.maxWait, Err: ErrLeaseBusy}
				}
				return err
			}
			defer func() {
				// The handler's context may have ended: keep its values.
				rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
				defer cancel()
				_ = l.Release(rctx) // a failed release lapses after the TTL
			}()
			return next.ProcessTask(ctx, t)
		})
	}, nil
}
