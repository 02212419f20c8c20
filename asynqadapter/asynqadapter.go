// Package asynqadapter makes asynq handlers share one rate limit across
// every worker process, per task type, per queue or per tenant, without a
// task ever burning a retry on the limit.
//
// Wire it in three lines:
//
//	mw, err := asynqadapter.NewMiddleware(lim)                      // lim: a *reserve.Limiter
//	mux.Use(mw)
//	cfg.IsFailure = asynqadapter.IsFailure                          // a refusal is not a failure
//	cfg.RetryDelayFunc = asynqadapter.RetryDelayFunc(nil)           // refused tasks return when there is room
//
// and set cfg.DelayedTaskCheckInterval to time.Second: asynq moves retried
// tasks back to their queue only that often (every 5 s by default), and
// stores retry times in whole seconds. Tell the middleware the interval
// with WithCheckInterval when you use WithInspector.
//
// Before each task the middleware books the next slot for the task's key
// with one Redis call, bounded by the handler context's deadline (asynq
// always sets one, from the task's Timeout or Deadline) less the work
// estimate (WithWorkEstimate), and by the max wait. If the slot fits, the
// handler sleeps until it and runs the task. If not, nothing is booked and
// the task returns to asynq with a *RateLimitedError, a refusal, that
// carries when to try again.
//
// Refusals are not failures (with IsFailure): asynq keeps the task's
// Retried count, moves it to its retry set due at RetryAfter (whole
// seconds, rounded up) and records the refusal as the task's LastErr, which
// the Inspector and asynqmon show. There are three kinds:
//
//   - the shared limit: the slot lay beyond the max wait or the deadline
//     (a *deadline.Error);
//   - the fallback policy, while the limiter's Redis is unavailable (a
//     *reserve.FallbackError, from FailClosed, or from LocalShare or
//     FailOpen beyond the max wait): the task comes back at the fallback's
//     retry-after;
//   - for a limiter without a fallback, its Redis unavailable (an error
//     matching throttle.ErrUnavailable): the task comes back after
//     WithUnavailableDelay. WithUnavailableAsFailure(true) makes these
//     ordinary failures instead.
//
// Other errors from the limiter (bad input, a corrupt key) and the
// handler's own errors are failures as usual.
//
// asynq calls its Config.ErrorHandler for every error a handler returns,
// refusals included; filter them with IsRefusal.
//
// asynq archives a task that returns an error on its last attempt (or that
// has MaxRetry(0)) instead of retrying it, refusals included. So on a
// task's last attempt the middleware, by default, drops the max wait and
// waits for a slot as long as the task's deadline allows, and while the
// limiter's Redis is unavailable it tries again after each refusal, as long
// as the deadline allows; see WithLastAttemptWait.
//
// # Booked retries
//
// With WithBookedRetries, a task whose slot lies beyond the max wait (but
// within a horizon and its deadline) has that slot booked in the same
// call, and is retried at it: asynq brings it back one check interval
// before the slot (whole seconds, rounded down) and the handler sleeps the
// rest. The booking is kept in the limiter's Redis under the task's queue,
// id, retry count and a hash of its type and payload, so the task runs at
// it on whichever server takes it, without booking again: a returning task
// recalls its booking with one call, which takes it out of the index (a
// task cut short by a server's shutdown and run again as the same attempt
// then books a slot of its own; one cut short while it sleeps until its
// slot puts the booking back for its next attempt, unless that attempt
// has booked first). The max wait then
// only bounds how long a handler holds a worker. Set asynq's
// TaskCheckInterval to about 100ms with it: idle asynq workers look for
// new tasks only that often (every 0.5 to 1.5 s by default), and a task
// taken up after its slot (by more than one interval) books again.
// Sending tasks back earlier instead would not do: each would hold a
// worker that much longer while it sleeps to its slot, and 3 servers of
// 10 workers at 20 tasks a second leave 1.5 s per task. See the README
// for measured figures.
//
// Bad options make NewMiddleware return an error matching ErrInvalidOption;
// Middleware panics on them instead, for programs that wire a server with
// options written in the code.
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
	"github.com/slotbook/slotbook/throttle"
)

// ErrInvalidOption is matched by the error NewMiddleware returns for a bad
// option or a nil limiter.
var ErrInvalidOption = errors.New("asynqadapter: invalid option")

// RateLimitedError is what the middleware returns for a task it sends back
// to asynq without running it: a refusal. Nothing was booked for it, but
// with booked retries (WithBookedRetries), where Slot is set: the slot of
// its next attempt.
type RateLimitedError struct {
	// Key is the limiter key the task was judged under.
	Key string
	// RetryAfter is when the task should come back: where it would find
	// room, spread so that tasks refused together do not return together.
	RetryAfter time.Duration
	// Err is the refusal: a *deadline.Error matching
	// deadline.ErrMaxWaitExceeded or deadline.ErrWouldExceedDeadline; a
	// *reserve.FallbackError (the fallback policy refused while the
	// limiter's Redis was unavailable); or, for a limiter without a
	// fallback, the error matching throttle.ErrUnavailable.
	Err error
	// Slot, with booked retries (WithBookedRetries), is the local time of
	// the slot booked for the task's next attempt; the zero Time if
	// nothing was booked. RetryAfter then brings the task back one check
	// interval (WithCheckInterval) before it.
	Slot time.Time

	back time.Time // with Slot: when the task should be back
}

// Error describes the refusal and when the task comes back.
func (e *RateLimitedError) Error() string {
	if !e.Slot.IsZero() {
		return fmt.Sprintf("asynqadapter: rate limited on %q, slot booked in %v: %v", e.Key, e.RetryAfter, e.Err)
	}
	return fmt.Sprintf("asynqadapter: rate limited on %q, retry in %v: %v", e.Key, e.RetryAfter, e.Err)
}

// Unwrap returns Err.
func (e *RateLimitedError) Unwrap() error { return e.Err }

// IsRefusal reports whether err is (or wraps) a *RateLimitedError: the
// middleware sent the task back to asynq without running it. asynq calls
// its Config.ErrorHandler for every error a handler returns, refusals
// included, so an ErrorHandler that reports failures should skip these:
//
//	ErrorHandler: asynq.ErrorHandlerFunc(func(ctx context.Context, t *asynq.Task, err error) {
//		if asynqadapter.IsRefusal(err) {
//			return // sent back for the limit, not a failure
//		}
//		report(t, err)
//	}),
//
// A refusal that ends the task is not one: on the task's last attempt
// (asynq archives a task whose retries are used up, whatever IsFailure
// says), or when WithInspector finds it could not come back before its
// deadline, the refusal wraps asynq.SkipRetry and IsRefusal reports false,
// so that such a handler reports the task asynq archives.
func IsRefusal(err error) bool {
	var e *RateLimitedError
	return errors.As(err, &e) && !errors.Is(err, asynq.SkipRetry)
}

// IsRateLimited reports whether err is (or wraps) a *RateLimitedError.
//
// Deprecated: use IsRefusal, which matches the same errors.
func IsRateLimited(err error) bool { return IsRefusal(err) }

// IsFailure is an asynq.Config.IsFailure that does not count a refusal
// (IsRefusal) as a failure, so it neither uses up a retry nor shows in the
// failed statistics.
func IsFailure(err error) bool { return err != nil && !IsRefusal(err) }

// RetryDelayFunc returns an asynq.RetryDelayFunc that sends refused tasks
// back after their RetryAfter (rounded up to the whole second asynq
// stores), a task with a booked slot one check interval before that slot
// (asynq rounds it down to the whole second; the handler sleeps the rest),
// and delegates other errors to next (asynq.DefaultRetryDelayFunc if nil).
func RetryDelayFunc(next asynq.RetryDelayFunc) asynq.RetryDelayFunc {
	if next == nil {
		next = asynq.DefaultRetryDelayFunc
	}
	return func(n int, err error, t *asynq.Task) time.Duration {
		var e *RateLimitedError
		if errors.As(err, &e) {
			if !e.Slot.IsZero() {
				return max(0, time.Until(e.back))
			}
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

// An Option configures the middleware. A bad one makes NewMiddleware
// return an error matching ErrInvalidOption.
type Option func(*config) error

type config struct {
	key         KeyFunc
	maxWait     *time.Duration
	work        time.Duration
	lastWait    bool
	spread      bool
	insp        *asynq.Inspector
	check       time.Duration // asynq's DelayedTaskCheckInterval, for the deadline check
	unavailable time.Duration // when a task that found the limiter unavailable comes back
	unavailFail bool          // an unavailable limiter fails tasks instead
	booked      *bookedConfig // nil: no booked retries
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

// WithWorkEstimate sets how long the handler is expected to run after its
// slot (default: the limiter's own work estimate, 0 unless set with
// reserve.WithWorkEstimate). The slot must leave that much time before the
// handler's deadline (asynq's Timeout or Deadline), or the task goes back
// to asynq without running: with a Timeout of 2 s, a slot 1.8 s away and
// a handler that takes 300 ms, a work estimate of 300 ms or more sends the
// task back to run later instead of letting asynq cancel it at its
// timeout, which would count as a failure and use up a retry. A task whose
// deadline, when its handler starts, is closer than the work estimate can
// never run (every attempt has the same Timeout; a Deadline only comes
// closer): it is archived at once (its error wraps asynq.SkipRetry), with
// no call to the limiter's Redis.
func WithWorkEstimate(d time.Duration) Option {
	return func(c *config) error {
		if d < 0 {
			return fmt.Errorf("negative work estimate %v", d)
		}
		c.work = d
		return nil
	}
}

// WithLastAttemptWait sets whether a task on its last attempt (asynq would
// archive it on an error) waits for a slot as long as its deadline allows,
// ignoring the max wait (default true). While the limiter's Redis is
// unavailable such a task waits too, trying again after each refusal, as
// long as its deadline allows. A task whose slot would pass even its
// deadline is refused either way, and asynq archives it.
func WithLastAttemptWait(on bool) Option {
	return func(c *config) error {
		c.lastWait = on
		return nil
	}
}

// WithSpread sets whether refused tasks get return times spread one
// interval apart per key (default true), so that tasks refused together
// come back to free slots one by one instead of colliding again. Off, each
// gets the bare time until its slot would have fitted. Spreading is per
// process: servers do not know each other's return times.
func WithSpread(on bool) Option {
	return func(c *config) error {
		c.spread = on
		return nil
	}
}

// WithInspector lets the middleware read a refused task's absolute
// Deadline (one call to asynq's Redis, on refusal only). A task that would
// not come back at least the check interval (WithCheckInterval) plus one
// second plus the work estimate before its Deadline is archived at once
// (its error wraps asynq.SkipRetry) rather than sent back to fail on every
// later dequeue.
func WithInspector(insp *asynq.Inspector) Option {
	return func(c *config) error {
		if insp == nil {
			return errors.New("nil inspector")
		}
		c.insp = insp
		return nil
	}
}

// WithCheckInterval tells the middleware the servers' asynq
// Config.DelayedTaskCheckInterval (default 5 s, asynq's default): a task
// sent back is moved from the retry set to its queue only that often, so
// it may run up to that long after the time it was sent back for. Used by
// the deadline check of WithInspector, and by booked retries
// (WithBookedRetries), whose tasks are due back one check interval before
// their slot: with the default, 5 s, they hold workers that much longer.
func WithCheckInterval(d time.Duration) Option {
	return func(c *config) error {
		if d <= 0 {
			return fmt.Errorf("check interval %v: want a positive duration", d)
		}
		c.check = d
		return nil
	}
}

// WithUnavailableDelay sets when a task that found the limiter unavailable
// comes back (default throttle.DefaultProbeMax, the longest the engine
// waits between probes by default; asynq rounds it up to a whole second).
// That applies to a limiter without a fallback (reserve.WithFallback),
// whose calls then fail with throttle.ErrUnavailable; a fallback's
// refusals carry their own retry-after.
func WithUnavailableDelay(d time.Duration) Option {
	return func(c *config) error {
		if d <= 0 {
			return fmt.Errorf("unavailable delay %v: want a positive duration", d)
		}
		c.unavailable = d
		return nil
	}
}

// WithUnavailableAsFailure sets whether a task that finds the limiter
// unavailable (no fallback, and its Redis unreachable or its breaker open)
// fails as an ordinary error, using up a retry under asynq's backoff (on),
// or goes back to asynq as a refusal, without a failure, after
// WithUnavailableDelay (off, the default).
func WithUnavailableAsFailure(on bool) Option {
	return func(c *config) error {
		c.unavailFail = on
		return nil
	}
}

// NewMiddleware returns an asynq middleware that runs each task at a slot
// booked through lim. It returns an error matching ErrInvalidOption for a
// nil limiter or a bad option, and makes no network call.
func NewMiddleware(lim *reserve.Limiter, opts ...Option) (asynq.MiddlewareFunc, error) {
	m, err := newMiddleware(lim, opts...)
	if err != nil {
		return nil, fmt.Errorf("%w: %w", ErrInvalidOption, err)
	}
	return m.wrap, nil
}

// Middleware is like NewMiddleware but panics where NewMiddleware returns
// an error, as regexp.MustCompile does: for wiring a server at start-up
// with options written in the program.
func Middleware(lim *reserve.Limiter, opts ...Option) asynq.MiddlewareFunc {
	mw, err := NewMiddleware(lim, opts...)
	if err != nil {
		panic(err.Error())
	}
	return mw
}

type middleware struct {
	cfg      config
	lim      *reserve.Limiter // for most attempts
	last     *reserve.Limiter // for last attempts
	interval time.Duration
	// tolerance is how late a task may start after the slot booked for
	// it: one interval (see late).
	tolerance time.Duration
	booked    *booked // nil: no booked retries

	mu      sync.Mutex           // guards returns
	returns map[string]time.Time // per key: the latest return time handed out
}

// deadlineMargin is how long before its Deadline, beyond the check
// interval and the work estimate, a task sent back must be due: time for
// a worker to take it.
const deadlineMargin = time.Second

func newMiddleware(lim *reserve.Limiter, opts ...Option) (*middleware, error) {
	if lim == nil {
		return nil, errors.New("nil limiter")
	}
	cfg := config{key: ByType, lastWait: true, spread: true, check: 5 * time.Second, unavailable: throttle.DefaultProbeMax}
	for _, opt := range opts {
		if err := opt(&cfg); err != nil {
			return nil, err
		}
	}
	var base []reserve.Option
	if cfg.work == 0 {
		cfg.work = lim.WorkEstimate() // the limiter's, for the deadline checks
	} else {
		base = append(base, reserve.WithWorkEstimate(cfg.work))
	}
	m := &middleware{cfg: cfg, lim: lim, last: lim, interval: lim.Limit().Interval(), returns: map[string]time.Time{}}
	m.tolerance = m.interval
	var err error
	if cfg.maxWait != nil || len(base) > 0 {
		o := base
		if cfg.maxWait != nil {
			o = append(o, reserve.WithMaxWait(*cfg.maxWait))
		}
		if m.lim, err = lim.With(o...); err != nil {
			return nil, err
		}
		m.last = m.lim
	}
	if cfg.lastWait {
		if m.last, err = lim.With(append(base, reserve.WithoutMaxWait())...); err != nil {
			return nil, err
		}
	}
	if cfg.booked != nil {
		if len(lim.Limits()) != 1 {
			return nil, fmt.Errorf("booked retries: the limiter has %d limits, want one", len(lim.Limits()))
		}
		if cfg.booked.eng != lim.Engine() {
			return nil, errors.New("booked retries: the engine is not the one the limiter books through")
		}
		runCap, _ := m.lim.MaxWait()
		m.booked = newBooked(cfg.booked, runCap)
	}
	return m, nil
}

func (m *middleware) wrap(next asynq.Handler) asynq.Handler {
	return asynq.HandlerFunc(func(ctx context.Context, t *asynq.Task) error {
		key := m.cfg.key(ctx, t)
		// A deadline closer than the work estimate will not move away:
		// asynq gives every attempt the same Timeout, and an absolute
		// Deadline only comes closer. No slot can ever fit: archive the
		// task now rather than send it back forever, with no Redis call.
		if dl, ok := ctx.Deadline(); ok && m.cfg.work > 0 {
			if left := time.Until(dl); left < m.cfg.work {
				return fmt.Errorf("asynqadapter: %v left before the task's deadline, less than the work estimate %v: it cannot run: %w",
					left.Round(time.Millisecond), m.cfg.work, asynq.SkipRetry)
			}
		}
		lim, last := m.lim, lastAttempt(ctx)
		if last {
			lim = m.last
		} else if m.booked != nil {
			if err, handled := m.bookedAttempt(ctx, key, t, next); handled {
				return err
			}
		}
		for {
			r, err := lim.Reserve(ctx, key)
			if err != nil && (m.cfg.unavailFail || ctx.Err() != nil || !errors.Is(err, throttle.ErrUnavailable)) {
				return fmt.Errorf("asynqadapter: %w", err)
			}
			var refusal error
			switch {
			case err != nil:
				refusal = err // unavailable, no fallback
			case !r.OK():
				refusal = r.Err()
			default:
				if err := r.Wait(ctx); err != nil {
					return err
				}
				return next.ProcessTask(ctx, t)
			}
			// On its last attempt asynq would archive the task: one that
			// met an unavailable limiter or its fallback's refusal tries
			// again here, as long as its deadline allows.
			var de *deadline.Error
			if !last || !m.cfg.lastWait || errors.As(refusal, &de) {
				return m.refused(ctx, key, refusal)
			}
			if err := sleep(ctx, m.retryAfter(refusal)); err != nil {
				return m.refused(ctx, key, refusal)
			}
		}
	})
}

// sleep waits for d or until ctx is done.
func sleep(ctx context.Context, d time.Duration) error {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// lastAttempt reports whether asynq would archive the task on an error.
func lastAttempt(ctx context.Context) bool {
	n, ok1 := asynq.GetRetryCount(ctx)
	maxRetry, ok2 := asynq.GetMaxRetry(ctx)
	return ok1 && ok2 && n >= maxRetry
}

// retryAfter is how long from now the refused task would fit: for a
// refusal by the shared limit, once the queue in front of its slot is no
// longer than its budget; for the fallback's, its retry-after; for an
// unavailable limiter, the unavailable delay.
func (m *middleware) retryAfter(refusal error) time.Duration {
	var (
		de *deadline.Error
		fe *reserve.FallbackError
	)
	switch {
	case errors.As(refusal, &de):
		return max(0, de.RetryAfter-de.Budget)
	case errors.As(refusal, &fe):
		return max(fe.RetryAfter, time.Millisecond)
	}
	return m.cfg.unavailable
}

// refused builds the error for a refused task.
func (m *middleware) refused(ctx context.Context, key string, refusal error) error {
	now := time.Now()
	fits := m.retryAfter(refusal)
	back := fits
	if m.cfg.spread {
		back = m.returnSlot(key, now, fits)
	}
	e := &RateLimitedError{Key: key, RetryAfter: back, Err: refusal}
	if lastAttempt(ctx) {
		return fmt.Errorf("%w (its last attempt: archived): %w", e, asynq.SkipRetry)
	}
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
// absolute deadline that a task due back at returnAt would not meet: asynq
// moves it to its queue up to one check interval later, a worker needs a
// moment to take it, and the work must fit before the deadline.
func (m *middleware) pastDeadline(ctx context.Context, returnAt time.Time) error {
	id, ok1 := asynq.GetTaskID(ctx)
	q, ok2 := asynq.GetQueueName(ctx)
	if !ok1 || !ok2 {
		return nil
	}
	info, err := m.cfg.insp.GetTaskInfo(q, id)
	if err != nil || info.Deadline.IsZero() {
		return nil
	}
	latest := info.Deadline.Add(-m.cfg.check - deadlineMargin - m.cfg.work)
	if !returnAt.After(latest) {
		return nil
	}
	return fmt.Errorf("would come back at %v, too close to its deadline %v (check interval %v): %w",
		returnAt.Format(time.RFC3339), info.Deadline.Format(time.RFC3339), m.cfg.check, asynq.SkipRetry)
}
