package pool

import (
	"container/list"
	"context"
	"errors"
	"fmt"
	"runtime/debug"
	"time"

	"github.com/slotbook/slotbook/lease"
	"github.com/slotbook/slotbook/reserve"
)

// A Job is a function submitted to a Pool. Its methods are safe for
// concurrent use.
type Job struct {
	key  string
	ctx  context.Context
	fn   func(context.Context) error
	done chan struct{} // closed when the job is done

	// Guarded by the pool's mu. state, elem, index and err change only in
	// moveLocked; res, seq and started are set just before a move. res, err
	// and started are read without the lock once done is closed.
	state   jobState
	stop    func() bool   // stops the context watch
	elem    *list.Element // in its key's backlog, while queued
	index   int           // in the pool's slots heap, while booked
	seq     uint64        // order of its booking among the pool's, once booked
	flight  uint64        // the number of its booking call (see calledLocked); for a record in stood, the calls sent before its job started
	forgone bool          // booked, then its booking forgone as it will not run (see forgoLocked)
	caller  bool          // a record of an Acquire caller's booking, while the caller waits for its slot (see Pool.callers)
	moved   chan struct{} // a caller's record: signalled when the pool hands it another booking (cap 1)
	at      time.Time     // once booked: its slot on the Redis clock (Booking().At)
	act     time.Time     // once booked: the local time its slot comes (for a late refusal, as reserve would have it)
	res     *reserve.Reservation
	lease   *lease.Lease // held from its grant until the job is done or back in the backlog (WithLease)
	err     error
	started time.Time
}

// Done is closed when the job has finished, run or not.
func (j *Job) Done() <-chan struct{} { return j.done }

// Err returns the job's outcome once Done is closed (nil before): the
// function's error; a *PanicError if it panicked (an error saying so if it
// called runtime.Goexit); a refusal (errors.Is
// deadline.ErrWouldExceedDeadline, with the exact retry-after); the job
// context's error; ErrClosed; or a Redis failure.
func (j *Job) Err() error {
	select {
	case <-j.done:
		return j.err
	default:
		return nil
	}
}

// Wait waits for the job and returns Err, or ctx's error if ctx is done
// first.
func (j *Job) Wait(ctx context.Context) error {
	select {
	case <-j.done:
		return j.err
	case <-ctx.Done():
		return ctx.Err()
	}
}

// Started waits for the job to finish and returns when its function
// began, or the zero Time if it never ran.
func (j *Job) Started() time.Time {
	<-j.done
	return j.started
}

// Reservation waits for the job to finish and returns, as a view (see
// reserve.Reservation.View), the reservation it held: for a job refused
// (by its deadline, or by the fallback), its refusal, not OK, which booked
// nothing unless it came late (below); nil if no answer came for the job
// (it ended while queued, or its booking call failed). A view's Booking
// gives the slot on the Redis clock, and its Cancel does nothing, for the booking of a job that did
// not run is the pool's to give back, after any later booking of its key
// (see Cancellation in the package doc). A job may hold another booking of
// its key than the one its batch made for it: an earlier one handed down
// to it, or, cancelled, a later one it took in its place. A cancelled
// job's booking is the one it held when it was done: the pool may hand it
// down to another job after that (an owed booking), which then runs in it.
// So may a job refused late (its booking held: Booking().OK is true),
// and a booked job that did not run (its booking forgone, held the same
// way: see reserve's Reservation.Forgo). A
// job that ran on top of such a booking of its own slot (see
// Cancellation in the package doc) traded bookings with it: its Reservation is the refusal's booking if
// the trade was made as it started, its own if made after.
func (j *Job) Reservation() *reserve.Reservation {
	<-j.done
	if j.res == nil {
		return nil
	}
	return j.res.View()
}

// Slot waits for the job to finish and returns the local time of its
// booked slot, when it could start, or the zero Time if it was never
// booked. For a slot handed down to it (see Cancellation in the package
// doc) it is counted from the job's own reply, so it may be earlier than
// its Reservation's SlotAt, which counts from the reply that booked it.
func (j *Job) Slot() time.Time {
	<-j.done
	if j.res == nil || !j.res.OK() && !j.forgone {
		return time.Time{}
	}
	return j.act
}

// A PanicError is the error of a job whose function panicked. The pool
// recovers the panic, ends the job with a *PanicError, gives its worker
// back and goes on.
type PanicError struct {
	// Value is the value the function panicked with.
	Value any
	// Stack is the stack of the job's goroutine when the panic was
	// recovered, as runtime/debug.Stack formats it: it includes the frames
	// of the function that panicked.
	Stack []byte
}

// Error returns the panic value followed by the stack.
func (e *PanicError) Error() string {
	return fmt.Sprintf("pool: job panicked: %v\n\n%s", e.Value, e.Stack)
}

// Unwrap returns the panic value if it is an error, so that errors.Is and
// errors.As see through the panic; otherwise nil.
func (e *PanicError) Unwrap() error {
	err, _ := e.Value.(error)
	return err
}

// errGoexit ends a job whose function called runtime.Goexit.
var errGoexit = errors.New("pool: job function called runtime.Goexit")

// run runs a job whose slot has come (moveLocked starts it), then ends it.
func (p *Pool) run(j *Job) {
	defer p.wg.Done()
	started := time.Now()
	err := errGoexit // unless call returns
	defer func() {   // deferred, so that it runs even after runtime.Goexit
		p.mu.Lock()
		j.started = started
		p.moveLocked(j, done, err)
		p.mu.Unlock()
	}()
	err = call(j.ctx, j.fn)
}

// call returns fn(ctx), or a *PanicError if fn panics.
func call(ctx context.Context, fn func(context.Context) error) (err error) {
	defer func() {
		if v := recover(); v != nil {
			err = &PanicError{Value: v, Stack: debug.Stack()}
		}
	}()
	return fn(ctx)
}
