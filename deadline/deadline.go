// Package deadline decides how long a request may wait for its slot, and
// defines the errors for a request refused because its slot is too far away.
//
// The budget is
//
//	max_wait = min(configured cap, time left before the context deadline - work)
//
// where work is an estimate of what must still run after the slot. A
// request whose slot lies beyond its budget books nothing and fails at once
// with an *Error that carries the exact retry-after and matches
// ErrMaxWaitExceeded or ErrWouldExceedDeadline with errors.Is.
package deadline

import (
	"context"
	"errors"
	"fmt"
	"math"
	"time"
)

// ErrMaxWaitExceeded is matched by a refusal whose slot lay beyond the
// configured max wait.
var ErrMaxWaitExceeded = errors.New("slot is further away than the max wait")

// ErrWouldExceedDeadline is matched by a refusal whose slot would not leave
// time to finish the work before the context deadline.
var ErrWouldExceedDeadline = errors.New("slot would leave too little time before the context deadline")

// NoCap, as Budget's cap, puts no bound on the wait but the deadline's.
const NoCap = time.Duration(1<<63 - 1)

// Budget returns how long a request may wait for its slot: the smaller of
// cap and the time left before ctx's deadline less work, measured from now.
// bound names the limit that binds (ErrMaxWaitExceeded or
// ErrWouldExceedDeadline), for the refusal. A negative budget means the
// deadline leaves no time for the work even if it started now. A negative
// work counts as none. The arithmetic saturates: a deadline centuries
// away or long past gives the largest or the smallest Duration, never a
// budget of the wrong sign.
func Budget(ctx context.Context, now time.Time, cap, work time.Duration) (budget time.Duration, bound error) {
	budget, bound = cap, ErrMaxWaitExceeded
	if dl, ok := ctx.Deadline(); ok {
		work = max(work, 0)
		left := dl.Sub(now) // saturates at the Duration bounds
		if left < math.MinInt64+work {
			left = math.MinInt64 // left - work would wrap around
		} else {
			left -= work
		}
		if left < budget {
			budget, bound = left, ErrWouldExceedDeadline
		}
	}
	return budget, bound
}

// Error is a refusal: the request's slot lay beyond its budget, so nothing
// was booked. It is safe to copy and compare.
type Error struct {
	// Bound is ErrMaxWaitExceeded or ErrWouldExceedDeadline; errors.Is
	// matches it.
	Bound error
	// RetryAfter is the exact wait the slot would have needed when the
	// request was refused; a request with a budget of at least RetryAfter
	// would have been booked. It is 0 when the deadline left no time for the
	// work at all, whatever the slot.
	RetryAfter time.Duration
	// Budget is the longest wait the request would have accepted.
	Budget time.Duration
}

// Refuse returns the refusal error for a request with the given budget and
// bound (from Budget) whose slot needed wait.
func Refuse(bound error, budget, wait time.Duration) *Error {
	return &Error{Bound: bound, RetryAfter: wait, Budget: max(budget, 0)}
}

// Error describes the refusal, with the retry-after and the budget.
func (e *Error) Error() string {
	if e.Budget == 0 && e.RetryAfter == 0 {
		return fmt.Sprintf("slotbook: refused: %v (no time left for the work)", e.Bound)
	}
	return fmt.Sprintf("slotbook: refused: %v (slot in %v, budget %v)", e.Bound, e.RetryAfter, e.Budget)
}

// Unwrap returns Bound.
func (e *Error) Unwrap() error { return e.Bound }

// RetryAfterOf returns the retry-after carried by err (an *Error anywhere in
// its chain), and whether there was one.
func RetryAfterOf(err error) (time.Duration, bool) {
	var e *Error
	if errors.As(err, &e) {
		return e.RetryAfter, true
	}
	return 0, false
}
