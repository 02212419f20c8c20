// Package asynqadapter makes asynq handlers share one rate limit across
// every worker process, per task type, per queue or per tenant, without a
// task ever burning a retry on the limit.
//
// Wire it in three lines:
//
//	mux.Use(asynqadapter.Middleware(lim))                          // lim: a *reserve.Limiter
//	cfg.IsFailure = asynqadapter.IsFailure                          // a refusal is not a failure
//	cfg.RetryDelayFunc = asynqadapter.RetryDelayFunc(nil)           // refused tasks return when there is room
//
// and set cfg.DelayedTaskCheckInterval to time.Second: asynq moves retried
// tasks back to their queue only that often (every 5 s by default), and
// stores retry times in whole seconds.
//
// Before each task the middleware books the next slot for the task's key
// with one Redis call, bounded by the handler context's deadline (asynq
// always sets one, from the task's Timeout or Deadline) and the max wait. If
// the slot fits, the handler sleeps until it and runs the task. If not,
// nothing is booked and the task returns to asynq with a *RateLimitedError
// that carries when to try again.
//
// asynq archives a task that fails on its last attempt (or that has
// MaxRetry(0)) instead of retrying it. So on a task's last attempt the
// middleware, by default, drops the max wait and waits for a slot as long as
// the task's deadline allows; see WithLastAttemptWait.
package asynqadapter

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"sync"
	"time"

	"github.com/hibiken/asynq"

	"github.com/slotbook/slotbook/deadline"
	"github.com/slotbook/slotbook/reserve"
)

// RateLimitedError is what the middleware returns for a task whose slot
// would not fit its deadline or the max wait. Nothing was booked for it.
type RateLimitedError struct {
	// Key is the limiter key the task was judged under.
	Key string
	// RetryAfter is when the task should come back: where it would find
	// room, spread so that tasks refused together do not return together.
	RetryAfter time.Duration
	// Err is the refusal: a *deadline.Error matching
	// deadline.ErrMaxWaitExceeded or deadline.ErrWouldExceedDeadline.
	Err error
}

// Error describes the refusal and when the task comes back.
func (e *RateLimitedError) Error() string {
	return fmt.Sprintf("asynqadapter: rate limited on %q, retry in %v: %v", e.Key, e.RetryAfter, e.Err)
}

// Unwrap returns Err.
func (e *RateLimitedError) Unwrap() error { return e.Err }

// IsRateLimited reports whether err is (or wraps) a *RateLimitedError.
func IsRateLimited(err error) bool {
	var e *RateLimitedError
	return errors.As(err, &e)
}

// IsFailure is an asynq.Config.IsFailure that does not count a rate-limit
// refusal as a failure, so it neither uses up a retry nor shows in the
// failed statistics.
func IsFailure(err error) bool { return err != nil && !IsRateLimited(err) }

// RetryDelayFunc returns an asynq.RetryDelayFunc that sends refused tasks
// back after their RetryAfter (rounded up to the whole second asynq stores)
// and delegates other errors to next (asynq.DefaultRetryDelayFunc if nil).
func RetryDelayFunc(next asynq.RetryDelayFunc) asynq.RetryDelayFunc {
	if next == nil {
		next = asynq.DefaultRetryDelayFunc
	}
	return func(n int, err error, t *asynq.Task) time.Duration {
		var e *RateLimitedError
		if errors.As(err, &e) {
			return wholeSecond(time.Now(), e.RetryAfter)
		}
		return next(n, err, t)
	}
}

// wholeSecond returns d stretched so that now+d is a whole second: asynq
// stores retry times as Unix seconds, truncating, which would bring a task
// back early.
func wholeSecond(now time.Time, d time.Duration) time.Duration {
	at := now.Add(d)
	if t := at.Truncate(time.Second); t.Before(at) {
		at = t.Add(time.Second)
	}
	return at.Sub(now)
}

// KeyFunc returns the limiter key for a task; ctx is the handler's.
type KeyFunc func(ctx context.Context, t *asynq.Task) string

// ByType keys tasks by their type (the default).
func ByType(_ context.Context, t *asynq.Task) string { return t.Type() }

// ByQueue keys tasks by the queue they were taken from.
func ByQueue(ctx context.Context, t *asynq.Task) string {
	if q, ok := asynq.GetQueueName(ctx); ok {
		return q
	}
	return "default"
}

// An Option configures the middleware.
type Option func(*config) error

type config struct {
	key      KeyFunc
	maxWait  *time.Duration
	lastWait bool
	spread   bool
	insp     *asynq.Inspector
}

// WithKey sets how tasks map to limiter keys: ByType (the default), ByQueue,
// or a function of the task and its payload (a tenant, say).
func WithKey(f KeyFunc) Option {
	return func(c *config) error {
		if f == nil {
			return errors.New("nil key function")
		}
		c.key = f
		return nil
	}
}

// WithMaxWait caps how long a task may wait in its handler for a slot
// (default: the limiter's max wait; the handler's deadline always bounds
// it). A task whose slot is further away goes back to asynq.
func WithMaxWait(d time.Duration) Option {
	return func(c *config) error {
		if d < 0 {
			return fmt.Errorf("negative max wait %v", d)
		}
		c.maxWait = &d
		return nil
	}
}

// WithLastAttemptWait sets whether a task on its last attempt (asynq would
// archive it on an error) waits for a slot as long as its deadline allows,
// ignoring the max wait (default true). A task whose slot would pass even
// its deadline is refused either way, and asynq archives it.
func WithLastAttemptWait(on bool) Option {
	return func(c *config) error {
		c.lastWait = on
		return nil
	}
}

// WithSpread sets whether refused tasks get return times spread one
// interval apart per key (default true), so that tasks refused together
// come back to free slots one by one instead of colliding again. Off, each
// gets the bare time until its slot would have fitted.
func WithSpread(on bool) Option {
	return func(c *config) error {
		c.spread = on
		return nil
	}
}

// WithInspector lets the middleware read a refused task's absolute
// Deadline (one Redis call, on refusal only). A task that could only come
// back after its Deadline is archived at once (its error wraps
// asynq.SkipRetry) rather than sent back to fail on every later dequeue.
func WithInspector(insp *asynq.Inspector) Option {
	return func(c *config) error {
		c.insp = insp
		return nil
	}
}

// Middleware returns an asynq middleware that runs each task at a slot
// booked through lim. It panics on a nil limiter or a bad option: these
// are programming errors, found at start-up.
func Middleware(lim *reserve.Limiter, opts ...Option) asynq.MiddlewareFunc {
	m, err := newMiddleware(lim, opts...)
	if err != nil {
		panic("asynqadapter: " + err.Error())
	}
	return m.wrap
}

type middleware struct {
	cfg      config
	lim      *reserve.Limiter // for most attempts
	last     *reserve.Limiter // for last attempts
	interval time.Duration

	mu      sync.Mutex           // guards returns
	returns map[string]time.Time // per key: the latest return time handed out
}

func newMiddleware(lim *reserve.Limiter, opts ...Option) (*middleware, error) {
	if lim == nil {
		return nil, errors.New("nil limiter")
	}
	cfg := config{key: ByType, lastWait: true, spread: true}
	for _, opt := range opts {
		if err := opt(&cfg); err != nil {
			return nil, err
		}
	}
	m := &middleware{cfg: cfg, lim: lim, last: lim, interval: lim.Limit().Interval(), returns: map[string]time.Time{}}
	var err error
	if cfg.maxWait != nil {
		if m.lim, err = lim.With(reserve.WithMaxWait(*cfg.maxWait)); err != nil {
			return nil, err
		}
		m.last = m.lim
	}
	if cfg.lastWait {
		if m.last, err = lim.With(reserve.WithoutMaxWait()); err != nil {
			return nil, err
		}
	}
	return m, nil
}

func (m *middleware) wrap(next asynq.Handler) asynq.Handler {
	return asynq.HandlerFunc(func(ctx context.Context, t *asynq.Task) error {
		key := m.cfg.key(ctx, t)
		lim := m.lim
		if lastAttempt(ctx) {
			lim = m.last
		}
		r, err := lim.Reserve(ctx, key)
		if err != nil {
			return fmt.Errorf("asynqadapter: %w", err)
		}
		if !r.OK() {
			return m.refused(ctx, key, r.Err())
		}
		if err := r.Wait(ctx); err != nil {
			return err
		}
		return next.ProcessTask(ctx, t)
	})
}

// lastAttempt reports whether asynq would archive the task on an error.
func lastAttempt(ctx context.Context) bool {
	n, ok1 := asynq.GetRetryCount(ctx)
	maxRetry, ok2 := asynq.GetMaxRetry(ctx)
	return ok1 && ok2 && n >= maxRetry
}

// refused builds the error for a refused task.
func (m *middleware) refused(ctx context.Context, key string, refusal error) error {
	var de *deadline.Error
	if !errors.As(refusal, &de) {
		return fmt.Errorf("asynqadapter: %w", refusal)
	}
	now := time.Now()
	// The slot fits once the queue in front of it is no longer than the
	// task's budget.
	fits := max(0, de.RetryAfter-de.Budget)
	back := fits
	if m.cfg.spread {
		back = m.returnSlot(key, now, fits)
	}
	e := &RateLimitedError{Key: key, RetryAfter: back, Err: refusal}
	if m.cfg.insp != nil {
		if err := m.pastDeadline(ctx, now.Add(wholeSecond(now, back))); err != nil {
			return fmt.Errorf("%w: %w", e, err)
		}
	}
	return e
}

// returnSlot hands out return times for key one interval apart, from when
// the refused task would fit, with up to one interval of jitter so that
// processes spreading the same key interleave.
func (m *middleware) returnSlot(key string, now time.Time, fits time.Duration) time.Duration {
	m.mu.Lock()
	defer m.mu.Unlock()
	if len(m.returns) > 1024 {
		for k, t := range m.returns {
			if t.Before(now) {
				delete(m.returns, k)
			}
		}
	}
	at := now.Add(fits)
	if last, ok := m.returns[key]; ok && last.Add(m.interval).After(at) {
		at = last.Add(m.interval)
	}
	m.returns[key] = at
	jitter := time.Duration(rand.Int64N(int64(m.interval) + 1))
	return at.Sub(now) + jitter
}

// pastDeadline returns an error wrapping asynq.SkipRetry if the task has an
// absolute deadline before returnAt.
func (m *middleware) pastDeadline(ctx context.Context, returnAt time.Time) error {
	id, ok1 := asynq.GetTaskID(ctx)
	q, ok2 := asynq.GetQueueName(ctx)
	if !ok1 || !ok2 {
		return nil
	}
	info, err := m.cfg.insp.GetTaskInfo(q, id)
	if err != nil || info.Deadline.IsZero() || !returnAt.After(info.Deadline) {
		return nil
	}
	return fmt.Errorf("would come back after its deadline %v: %w", info.Deadline.Format(time.RFC3339), asynq.SkipRetry)
}
