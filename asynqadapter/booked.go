package asynqadapter

import (
	"context"
	"errors"
	"fmt"
	"hash/fnv"
	"strconv"
	"time"

	"github.com/hibiken/asynq"

	"github.com/slotbook/slotbook/deadline"
	"github.com/slotbook/slotbook/throttle"
)

// WithBookedRetries turns on booked retries: a task whose slot lies beyond
// the max wait, but within horizon and at least a second plus the work
// estimate before the handler's deadline, has that slot booked anyway, in
// the same Redis call that judged it, and goes back to asynq (a refusal,
// not a failure) to be retried at the slot: due one check interval
// (WithCheckInterval: set it to the servers' DelayedTaskCheckInterval)
// before it, in asynq's whole seconds, rounded down, after which the
// handler sleeps the rest. A slot less than one check interval away is
// waited for in the handler instead, as far as the deadline allows: a task
// sent back for it would be picked up after it. The booking is remembered
// in the limiter's Redis under the task's queue, id and retry count, in a
// sorted set per limiter key ("name:{key}:asynq", the rate key's hash
// tag). When the task comes back, to any server, it recalls its booking
// with one call, which takes the entry out of the index, and runs at it
// without booking again; if it comes back more than one interval of the
// limit late (every worker busy), it books again. A task deleted or
// archived meanwhile leaves its booking unused: the slot stays spent (the
// key is booked up to it) and the entry is dropped a minute after it.
//
// The recall takes the entry out so that no other attempt of the task
// finds it: asynq runs a task cut short by a server's shutdown (its
// handler still running after the ShutdownTimeout) again as the same
// attempt, with the same retry count, and that attempt must book a slot
// of its own rather than run again at one already used. A task cut short
// while it sleeps until its slot has not used it: it puts the booking
// back in the index (throttle.Engine.RestoreRetry), as long as the slot
// has not come, for its next attempt to recall. That can come too late:
// asynq puts the task back on its queue before it ends the handler's
// context, so the next attempt may call first and book a slot of its own,
// and the first goes unused (as it does if the recall's reply is lost).
// A booking given back (WithInspector: the task would not come back in
// time for its Deadline) has its entry taken out first, in a call of its
// own, so that the task run again by hand, on any server, cannot recall a
// slot given to someone else.
//
// Run booked retries on every server that serves a key: a server without
// them books afresh for a task another has booked, and the booking lapses.
// A horizon shorter than the queue of a busy key, or task Timeouts close
// to the check interval plus the max wait, leave little to book ahead and
// cost calls. Each attempt makes one call; the attempts of one key in one
// process make theirs side by side (none waits for another's).
//
// If the limiter's Redis loses its state (a restart without persistence,
// a flush), the next bookings start from an empty key, with a full burst,
// as in any limiter that loses its state, and the index is lost with it:
// tasks that come back find no booking and book again. What still runs
// beside the new bookings, and can exceed the limit, is what was granted
// before the loss: tasks already sleeping in their handlers until a slot
// booked or recalled before it (up to about a check interval ahead, as
// for any reservation granted before a loss).
//
// eng must be the engine lim books through (lim.Engine(); NewMiddleware
// refuses another, which would book a key the limiter's other paths never
// see), and lim must have one limit (reserve.WithLimit adds others: not
// supported here). Tasks on their last
// attempt (which asynq would archive on a refusal) still wait in their
// handler (WithLastAttemptWait). horizon must be positive and at most
// throttle.MaxHorizon.
func WithBookedRetries(eng *throttle.Engine, horizon time.Duration) Option {
	return func(c *config) error {
		if eng == nil {
			return errors.New("booked retries: nil engine")
		}
		if horizon <= 0 || horizon > throttle.MaxHorizon {
			return fmt.Errorf("booked retries: horizon %v: want a positive duration of at most %v", horizon, throttle.MaxHorizon)
		}
		c.booked = &bookedConfig{eng: eng, horizon: horizon}
		return nil
	}
}

type bookedConfig struct {
	eng     *throttle.Engine
	horizon time.Duration
}

// booked is the middleware's state for booked retries.
type booked struct {
	bookedConfig
	runCap time.Duration // the max wait for running now
}

func newBooked(c *bookedConfig, runCap time.Duration) *booked {
	return &booked{bookedConfig: *c, runCap: runCap}
}

// bookedAttempt runs a task's attempt with booked retries. handled is
// false where the ordinary path must judge the task instead: no task id,
// or the limiter's Redis failing (the fallback policy then answers).
func (m *middleware) bookedAttempt(ctx context.Context, key string, t *asynq.Task, next asynq.Handler) (err error, handled bool) {
	b := m.booked
	id, ok := asynq.GetTaskID(ctx)
	if !ok {
		return nil, false
	}
	if err := m.lim.CheckKey(key); err != nil {
		return fmt.Errorf("asynqadapter: %w", err), true
	}
	retried, _ := asynq.GetRetryCount(ctx)
	queue, _ := asynq.GetQueueName(ctx)
	member := bookedMember(queue, id, retried, t)
	subject := m.lim.Name() + ":{" + key + "}"
	now := time.Now()
	keep, keepBound := deadline.Budget(ctx, now, b.runCap, m.cfg.work)
	// A slot less than one check interval away is waited for here, as far
	// as the deadline allows: a task sent back for it would be due at once
	// and picked up after it, late, to book again.
	if within, _ := deadline.Budget(ctx, now, m.cfg.check, m.cfg.work); within > keep {
		keep, keepBound = within, deadline.ErrWouldExceedDeadline
		if within == m.cfg.check {
			keepBound = deadline.ErrMaxWaitExceeded
		}
	}
	// A slot booked for a later attempt must leave a margin before the
	// deadline: the task is taken up again around the slot, and the work
	// must end before the deadline (an absolute Deadline stays put).
	budget, bound := deadline.Budget(ctx, now, b.horizon, m.cfg.work+deadlineMargin)
	budget = max(budget, keep)
	if budget < 0 {
		return m.refused(ctx, key, deadline.Refuse(bound, budget, 0)), true
	}
	idx := throttle.RetryIndex{Key: subject + ":asynq", Member: member, KeepFrom: max(keep, 0)}
	rb, err := b.eng.BookRetry(ctx, []string{subject}, m.lim.Limits(), throttle.Request{N: 1, MaxWait: budget}, idx)
	arrived := time.Now()
	switch {
	case err != nil:
		return nil, false
	case rb.Recalled:
		at := arrived.Add(rb.At.Sub(rb.Now))
		if m.late(at) {
			return m.bookedAttempt(ctx, key, t, next) // spent: book again
		}
		if fits, _ := deadline.Budget(ctx, arrived, b.horizon, m.cfg.work); time.Until(at) > fits {
			// Too far for this attempt's deadline (a task enqueued
			// anew under the id of one deleted while booked, or run by
			// hand before its time): the slot stays spent; book again.
			return m.bookedAttempt(ctx, key, t, next)
		}
		return m.runRecalled(ctx, at, subject, idx, rb, t, next), true
	case !rb.OK:
		return m.refused(ctx, key, deadline.Refuse(bound, budget, rb.Wait)), true
	case rb.Recorded:
		// Back one check interval before the slot: asynq moves retried
		// tasks to their queue only that often, at a phase of its own.
		slot := arrived.Add(rb.Wait)
		back := slot.Add(-m.cfg.check)
		e := &RateLimitedError{Key: key, RetryAfter: max(0, back.Sub(arrived)), Slot: slot, back: back,
			Err: deadline.Refuse(keepBound, keep, rb.Wait)}
		if m.cfg.insp != nil {
			// Due back at back, taken up by the slot: pastDeadline's
			// rule for a task due back at back, which the budget above
			// keeps. Should it fail, the task is archived: its entry is
			// taken out of the index, then the booking given back, so
			// that no attempt (the task run again by hand, on any
			// server) runs at a slot that is no longer its own. If the
			// entry cannot be taken out, the booking stays, and only the
			// task can recall it.
			if err := m.pastDeadline(ctx, back); err != nil {
				if m.forgetNow(ctx, subject, member) {
					m.giveBack(ctx, subject, rb.Booking)
				}
				return fmt.Errorf("%w: %w", e, err), true
			}
		}
		return e, true
	}
	return m.runAt(ctx, arrived.Add(rb.Wait), rb.Booking, subject, t, next), true
}

// bookedMember names one attempt's booking in the index: the task's queue,
// its length first (so that no queue and id read as another pair: queue
// "q" with id "b:x" and queue "q:b" with id "x"), its id (unique only
// within a queue), its retry count (a booking is for one attempt, and a
// task's own failure counts a retry), and a hash of its type and payload,
// so that a task enqueued anew under the id of one that completed or was
// deleted (asynq.TaskID) does not find that one's booking, unless type
// and payload are the same too.
func bookedMember(queue, id string, retried int, t *asynq.Task) string {
	h := fnv.New64a()
	_, _ = h.Write([]byte(t.Type()))
	_, _ = h.Write([]byte{0})
	_, _ = h.Write(t.Payload())
	return strconv.Itoa(len(queue)) + ":" + queue + ":" + id + ":" + strconv.Itoa(retried) + ":" + strconv.FormatUint(h.Sum64(), 36)
}

// late reports whether a booked slot at has passed by more than one
// interval of the limit: the task came back too late for it (every worker
// busy, or asynq slow to hand it over), and running it now would start it
// on top of the slots booked since. It books again instead. (A tolerance
// of the whole burst let late tasks gather into bursts of more than the
// limit allows in a second, measured with TestFleetBooked.)
func (m *middleware) late(at time.Time) bool {
	return time.Since(at) > m.tolerance
}

// runAt sleeps until at, the slot of bk, booked by this attempt, and runs
// the task. If ctx ends first, bk is given back.
func (m *middleware) runAt(ctx context.Context, at time.Time, bk throttle.Booking, subject string, t *asynq.Task, next asynq.Handler) error {
	if d := time.Until(at); d > 0 {
		if err := sleep(ctx, d); err != nil {
			m.giveBack(ctx, subject, bk)
			return err
		}
	}
	return next.ProcessTask(ctx, t)
}

// runRecalled sleeps until at, the slot of rb, recalled from the index idx,
// and runs the task. If ctx ends first (a server shutting down puts the
// task back on its queue, as the same attempt), rb goes back in the index
// for the next attempt, while its slot has not come.
func (m *middleware) runRecalled(ctx context.Context, at time.Time, subject string, idx throttle.RetryIndex, rb throttle.RetryBooking, t *asynq.Task, next asynq.Handler) error {
	if d := time.Until(at); d > 0 {
		if err := sleep(ctx, d); err != nil {
			cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), time.Second)
			defer cancel()
			_, _ = m.booked.eng.RestoreRetry(cctx, []string{subject}, idx, rb)
			return err
		}
	}
	return next.ProcessTask(ctx, t)
}

// forgetNow takes member's entry out of subject's index, in a call of its
// own, and reports whether it did (or it was not there).
func (m *middleware) forgetNow(ctx context.Context, subject, member string) bool {
	cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), time.Second)
	defer cancel()
	return m.booked.eng.ForgetRetry(cctx, throttle.RetryIndex{Key: subject + ":asynq", Member: member}) == nil
}

// giveBack refunds a booking whose task will not run at it.
func (m *middleware) giveBack(ctx context.Context, subject string, bk throttle.Booking) {
	cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), time.Second)
	defer cancel()
	_, _ = m.booked.eng.RefundAll(cctx, []string{subject}, m.lim.Limits(), bk)
}
