// Package reserve is the client most users hold: a Limiter that books the
// next free slot of a shared quota in Redis with one call, tells the caller
// exactly how long to wait, and refuses at once, booking nothing, when the
// slot would land past the caller's context deadline or the configured max
// wait.
//
// Its shape follows golang.org/x/time/rate: Allow/AllowN check without
// waiting, Reserve/ReserveN book and return a Reservation, Acquire/AcquireN
// book and sleep until the slot.
package reserve

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"time"

	"github.com/slotbook/slotbook/deadline"
	"github.com/slotbook/slotbook/throttle"
)

// Re-exported from package deadline so callers can branch with one import.
var (
	ErrMaxWaitExceeded     = deadline.ErrMaxWaitExceeded
	ErrWouldExceedDeadline = deadline.ErrWouldExceedDeadline
)

// A Limiter enforces one Limit, shared through Redis, for each subject key
// under a name: "stripe" and "tenant-42" share one quota with every other
// process that uses the same name and key.
//
// A Limiter is safe for concurrent use. Build one with New; the zero
// Limiter is not usable.
type Limiter struct {
	eng     *throttle.Engine
	name    string
	limit   throttle.Limit
	maxWait time.Duration // deadline.NoCap when unset
	work    time.Duration
	clock   clock
}

// An Option configures a Limiter in New.
type Option func(*Limiter) error

// WithMaxWait caps how long a reservation may wait for its slot. A request
// whose slot is further away is refused with ErrMaxWaitExceeded and books
// nothing. Zero means "only an immediate slot". Without this option the
// wait is bounded only by the context's deadline.
func WithMaxWait(d time.Duration) Option {
	return func(l *Limiter) error {
		if d < 0 {
			return fmt.Errorf("reserve: negative max wait %v", d)
		}
		l.maxWait = d
		return nil
	}
}

// WithWorkEstimate sets how long the work after the slot is expected to
// take. It is subtracted from the context's deadline: a request whose slot
// would not leave that much time is refused with ErrWouldExceedDeadline.
func WithWorkEstimate(d time.Duration) Option {
	return func(l *Limiter) error {
		if d < 0 {
			return fmt.Errorf("reserve: negative work estimate %v", d)
		}
		l.work = d
		return nil
	}
}

// New returns a Limiter enforcing limit for each key under name, through
// eng. It validates its arguments and makes no network call.
func New(eng *throttle.Engine, name string, limit throttle.Limit, opts ...Option) (*Limiter, error) {
	if eng == nil {
		return nil, errors.New("reserve: nil engine")
	}
	if name == "" || strings.ContainsAny(name, ":{}") {
		return nil, fmt.Errorf("reserve: name %q must be non-empty and free of ':', '{' and '}'", name)
	}
	if err := limit.Validate(); err != nil {
		return nil, err
	}
	l := &Limiter{eng: eng, name: name, limit: limit, maxWait: deadline.NoCap, clock: realClock{}}
	for _, opt := range opts {
		if err := opt(l); err != nil {
			return nil, err
		}
	}
	return l, nil
}

// Name returns the limiter's name.
func (l *Limiter) Name() string { return l.name }

// Limit returns the limiter's Limit.
func (l *Limiter) Limit() throttle.Limit { return l.limit }

// Key returns the engine key (before the engine's prefix) for subject key.
func (l *Limiter) engineKey(key string) (string, error) {
	if key == "" {
		return "", fmt.Errorf("%w: empty key", throttle.ErrInvalidRequest)
	}
	k := l.name + ":" + key
	return k, throttle.CheckKey(k)
}

// Allow is shorthand for AllowN(ctx, key, 1).
func (l *Limiter) Allow(ctx context.Context, key string) (throttle.Result, error) {
	return l.AllowN(ctx, key, 1)
}

// AllowN reports whether n units may pass for key now, counting them if
// so, without booking a future slot: check mode.
func (l *Limiter) AllowN(ctx context.Context, key string, n int) (throttle.Result, error) {
	k, err := l.engineKey(key)
	if err != nil {
		return throttle.Result{}, err
	}
	return l.eng.AllowN(ctx, k, l.limit, n)
}

// Reserve is shorthand for ReserveN(ctx, key, 1).
func (l *Limiter) Reserve(ctx context.Context, key string) (*Reservation, error) {
	return l.ReserveN(ctx, key, 1)
}

// ReserveN books the next slot for n units of key, with one Redis call, and
// returns without waiting. If the slot lies within the budget (the max
// wait, and the context deadline less the work estimate) the Reservation
// is OK and the caller should act after its Delay. If not, nothing is
// booked and the Reservation is not OK: its Err says why and carries the
// exact retry-after. A refusal is not an error; err is non-nil only for bad
// input (no Redis call made), a done context, or a Redis failure.
func (l *Limiter) ReserveN(ctx context.Context, key string, n int) (*Reservation, error) {
	k, err := l.engineKey(key)
	if err != nil {
		return nil, err
	}
	if err := throttle.CheckRequest(throttle.Request{N: n}, l.limit); err != nil {
		return nil, err
	}
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	budget, bound := deadline.Budget(ctx, l.clock.Now(), l.maxWait, l.work)
	r := &Reservation{lim: l, key: k}
	if budget < 0 {
		r.err = deadline.Refuse(bound, budget, 0)
		return r, nil
	}
	maxWait := budget
	if maxWait == deadline.NoCap {
		maxWait = throttle.Forever
	}
	b, err := l.eng.Book(ctx, k, l.limit, throttle.Request{N: n, MaxWait: maxWait})
	if err != nil {
		return nil, err
	}
	r.booking = b
	if !b.OK {
		r.err = deadline.Refuse(bound, budget, b.Wait)
		return r, nil
	}
	// The wait was measured on the Redis clock at some point before the
	// reply arrived; counting it from the arrival never starts early.
	r.act = l.clock.Now().Add(b.Wait)
	return r, nil
}

// Acquire is shorthand for AcquireN(ctx, key, 1).
func (l *Limiter) Acquire(ctx context.Context, key string) error {
	return l.AcquireN(ctx, key, 1)
}

// AcquireN books the next slot for n units of key and sleeps until it. If
// the slot would lie beyond the budget it returns at once, having booked
// nothing, with an error matching ErrMaxWaitExceeded or
// ErrWouldExceedDeadline that carries the exact retry-after (see
// deadline.Error). If ctx is done while sleeping, the booking is cancelled
// (its slot given back) and ctx's error is returned.
func (l *Limiter) AcquireN(ctx context.Context, key string, n int) error {
	r, err := l.ReserveN(ctx, key, n)
	if err != nil {
		return err
	}
	return r.Wait(ctx)
}

// A Reservation is a booked slot (or a refusal) from ReserveN. Its methods
// are safe for concurrent use.
type Reservation struct {
	lim     *Limiter
	key     string
	booking throttle.Booking
	act     time.Time // local time to act
	err     error     // the refusal, if not OK

	mu       sync.Mutex // guards canceled
	canceled bool
}

// OK reports whether a slot was booked.
func (r *Reservation) OK() bool { return r.err == nil }

// Err returns nil for a booked slot, and for a refusal a *deadline.Error
// matching ErrMaxWaitExceeded or ErrWouldExceedDeadline.
func (r *Reservation) Err() error { return r.err }

// RetryAfter returns, for a refusal, the exact wait the slot would have
// needed; for a booked slot, 0.
func (r *Reservation) RetryAfter() time.Duration {
	if e, ok := r.err.(*deadline.Error); ok {
		return e.RetryAfter
	}
	return 0
}

// Booking returns the engine's answer: the wait and slot as measured on the
// Redis clock when the booking was made.
func (r *Reservation) Booking() throttle.Booking { return r.booking }

// SlotAt returns the local time at which the holder may act. It is the zero
// Time for a refusal.
func (r *Reservation) SlotAt() time.Time { return r.act }

// Delay is shorthand for DelayFrom(time.Now()).
func (r *Reservation) Delay() time.Duration { return r.DelayFrom(r.lim.clock.Now()) }

// DelayFrom returns how long after t the holder must wait before acting: 0
// if the slot has come. For a refusal it returns the retry-after.
func (r *Reservation) DelayFrom(t time.Time) time.Duration {
	if !r.OK() {
		return r.RetryAfter()
	}
	return max(0, r.act.Sub(t))
}

// Wait sleeps until the slot. If ctx is done first, it cancels the
// reservation and returns ctx's error. For a refusal it returns Err at once.
func (r *Reservation) Wait(ctx context.Context) error {
	if !r.OK() {
		return r.err
	}
	if err := r.lim.clock.Sleep(ctx, r.Delay()); err != nil {
		cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), time.Second)
		defer cancel()
		_ = r.Cancel(cctx)
		return err
	}
	return nil
}

// Cancel gives the slot back if it has not come yet, so others may use it,
// as golang.org/x/time/rate's Reservation.Cancel does: bookings made after
// this one keep their slots. Cancelling twice, or cancelling a refusal, does
// nothing.
func (r *Reservation) Cancel(ctx context.Context) error {
	if !r.OK() {
		return nil
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.canceled {
		return nil
	}
	if _, err := r.lim.eng.Refund(ctx, r.key, r.lim.limit, r.booking); err != nil {
		return err
	}
	r.canceled = true
	return nil
}

// clock is the seam through which the Limiter reads local time and sleeps,
// so tests need not sleep for real.
type clock interface {
	Now() time.Time
	// Sleep returns nil after d, or ctx's error if ctx is done first.
	Sleep(ctx context.Context, d time.Duration) error
}

type realClock struct{}

func (realClock) Now() time.Time { return time.Now() }

func (realClock) Sleep(ctx context.Context, d time.Duration) error {
	if d <= 0 {
		return nil // the slot has come
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}
