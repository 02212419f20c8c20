package asynqadapter

import (
	"context"
	"errors"
	"fmt"
	"hash/fnv"
	"strconv"
	"sync"
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
// tag). When the task comes back, to any server, it runs at its booking
// without booking again; if it comes back more than one interval of the
// limit late (every worker busy), it books again. A task deleted or
// archived meanwhile leaves its booking unused: the slot stays spent (the
// key is booked up to it) and the entry is dropped a minute after it.
//
// Run booked retries on every server that serves a key: a server without
// them books afresh for a task another has booked, and the booking lapses.
// A horizon shorter than the queue of a busy key, or task Timeouts close
// to the check interval plus the max wait, leave little to book ahead and
// cost calls.
//
// The reply to each booking call also lists the bookings due within the
// next two seconds, which the process keeps, so that most returning tasks
// find theirs without a Redis call, and one call per key is in flight per
// process at a time. Tasks refused together thus return spread by their
// bookings, across servers, and each second's quota is used. The index in
// Redis is the truth: a kept booking that a later reply should list but
// does not (used by a task run elsewhere, or lost) is dropped, and its
// task books again when it comes back; a task already waiting in its
// handler for such a booking is woken to book again. A booking's entry
// stays in the index until its task has run at it, so that replies can
// show it lost.
//
// If the limiter's Redis loses its state (a restart without persistence,
// a flush), the next bookings start from an empty key, with a full burst,
// as in any limiter that loses its state. The first reply to each
// process's next booking call for the key lists none of the bookings made
// before: the process drops those it kept and wakes the tasks waiting for
// them. What still runs beside the new bookings, and can exceed the
// limit, is what no reply could stop: bookings of tasks that were
// already waiting at the loss for a slot made by their own call (up to
// about two seconds ahead, as for any reservation granted before a loss),
// and kept bookings whose slots pass before the process's next booking
// call for the key (measured at 20/s burst 0 in one process,
// TestBookedStateLoss: at most 21 starts in a second whether the call or
// the tasks come first after a flush, against 37 and 30 to 32 when kept
// bookings ran regardless; with two processes, one that made no call
// after the flush ran the bookings its waiting tasks had kept: 30 to 31).
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

const (
	dueWindow = 2 * time.Second // bookings due this soon are kept locally
	maxDue    = 256             // at most this many per reply
	maxForget = 256             // used entries sent back for removal, per key
	cacheKeep = time.Minute     // a kept booking is dropped this long after its slot
)

// booked is the middleware's state for booked retries.
type booked struct {
	bookedConfig
	runCap time.Duration // the max wait for running now
	// since: replies list the index's entries whose slots passed at most
	// this long ago (a booking later than the middleware's tolerance is
	// booked again, and entries of tasks that never came back would crowd
	// out those due).
	since time.Duration

	mu       sync.Mutex                     // guards the fields below
	due      map[string]map[string]kept     // per subject: member -> its slot
	asleep   map[string]map[string]*sleeper // per subject: member -> its task, waiting for it
	inflight map[string]chan struct{}       // per subject: closed when its call returns
	forget   map[string][]string            // per subject: members used from due
	forgotAt map[string]time.Time           // per subject in forget: when its first member was added
	pruned   time.Time                      // when prune last ran
}

// sleeper is a task waiting in its handler for a kept booking taken from
// due: the booking's slot on Redis's clock, and lost, closed if a reply
// shows the booking gone from the index before the slot.
type sleeper struct {
	score time.Time
	lost  chan struct{}
}

// kept is a booking a reply listed as due: its slot on the local clock
// (from the reply's arrival) and, as the index holds it, on Redis's.
type kept struct {
	at, score time.Time
}

func newBooked(c *bookedConfig, runCap, since time.Duration) *booked {
	return &booked{bookedConfig: *c, runCap: runCap, since: since, due: map[string]map[string]kept{},
		asleep: map[string]map[string]*sleeper{}, inflight: map[string]chan struct{}{}, forget: map[string][]string{},
		forgotAt: map[string]time.Time{}}
}

// take returns, and removes, the kept booking of member under subject,
// whose task then waits for it until done. Its entry stays in the index
// meanwhile, so that a later reply that should list it but does not shows
// it lost (see drop): lost is then closed.
func (b *booked) take(subject, member string) (at time.Time, lost <-chan struct{}, ok bool) {
	b.mu.Lock()
	defer b.mu.Unlock()
	k, ok := b.due[subject][member]
	if !ok {
		return time.Time{}, nil, false
	}
	delete(b.due[subject], member)
	sl := &sleeper{score: k.score, lost: make(chan struct{})}
	if b.asleep[subject] == nil {
		b.asleep[subject] = map[string]*sleeper{}
	}
	b.asleep[subject][member] = sl
	return k.at, sl.lost, true
}

// done ends the wait of member's task for the booking it took: it runs at
// it, or gives it up, and the next call for subject takes the entry out of
// the index. done reports false, and changes nothing, if a reply has shown
// the booking lost meanwhile.
func (b *booked) done(subject, member string) bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	if _, ok := b.asleep[subject][member]; !ok {
		return false
	}
	delete(b.asleep[subject], member)
	if len(b.asleep[subject]) == 0 {
		delete(b.asleep, subject)
	}
	b.addForget(subject, member)
	return true
}

// forgetLater has the next call for subject take member out of the index.
func (b *booked) forgetLater(subject, member string) {
	b.mu.Lock()
	defer b.mu.Unlock()
	delete(b.due[subject], member)
	b.addForget(subject, member)
}

// addForget has the next call for subject take member out of the index
// (at most maxForget members wait per subject; an entry not taken out is
// dropped by Redis a minute after its slot). Call with b.mu held.
func (b *booked) addForget(subject, member string) {
	f := b.forget[subject]
	if len(f) >= maxForget {
		return
	}
	if len(f) == 0 {
		b.forgotAt[subject] = time.Now()
	}
	b.forget[subject] = append(f, member)
}

// prune drops, at most once per cacheKeep, the state of keys that have gone
// quiet (leave prunes its own key's on every call): kept bookings whose
// slot passed more than cacheKeep ago, and members waiting to be taken
// out of an index for longer than that (Redis has dropped them by then).
// Call with b.mu held.
func (b *booked) prune(now time.Time) {
	if now.Sub(b.pruned) < cacheKeep {
		return
	}
	b.pruned = now
	for subject := range b.due {
		b.pruneKept(subject, now)
	}
	for subject, at := range b.forgotAt {
		if _, busy := b.inflight[subject]; !busy && now.Sub(at) > cacheKeep {
			delete(b.forget, subject)
			delete(b.forgotAt, subject)
		}
	}
}

// pruneKept drops subject's kept bookings whose slot passed more than
// cacheKeep before now, and subject's entry once none is left. Call with
// b.mu held.
func (b *booked) pruneKept(subject string, now time.Time) {
	keep := b.due[subject]
	for member, k := range keep {
		if now.Sub(k.at) > cacheKeep {
			delete(keep, member)
		}
	}
	if len(keep) == 0 {
		delete(b.due, subject)
	}
}

// enter makes the caller the one with a call in flight for subject, or
// returns the channel closed when the current one returns.
func (b *booked) enter(subject string) (wait chan struct{}, forget []string) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if ch, ok := b.inflight[subject]; ok {
		return ch, nil
	}
	b.inflight[subject] = make(chan struct{})
	forget = b.forget[subject]
	delete(b.forget, subject)
	delete(b.forgotAt, subject)
	return nil, forget
}

// leave ends the caller's call for subject: it keeps the bookings due
// (at local times, from the reply's arrival), drops those the reply shows
// gone (see drop), and wakes those waiting.
func (b *booked) leave(subject, self string, rb throttle.RetryBooking, arrived time.Time, forget []string, failed bool) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if failed {
		for _, member := range forget {
			b.addForget(subject, member)
		}
	}
	keep := b.due[subject]
	if !failed {
		drop(keep, b.asleep[subject], rb, b.since)
		if len(b.asleep[subject]) == 0 {
			delete(b.asleep, subject)
		}
	}
	if keep == nil && len(rb.Due) > 0 {
		keep = map[string]kept{}
		b.due[subject] = keep
	}
	for member, at := range rb.Due {
		if _, taken := b.asleep[subject][member]; member != self && !taken {
			keep[member] = kept{at: arrived.Add(at.Sub(rb.Now)), score: at}
		}
	}
	b.pruneKept(subject, arrived)
	close(b.inflight[subject])
	delete(b.inflight, subject)
	b.prune(arrived)
}

// drop removes from keep the bookings that the reply rb should list but
// does not: the index in Redis is the truth, and such a booking was used
// by a task run elsewhere, or lost with Redis's state (a restart without
// persistence, a flush), where the next bookings start from an empty key.
// Run here, it would start beside them. Its task books again when it
// comes back. A task already waiting for such a booking (in asleep) is
// woken to book again. The reply lists the index's entries from
// now-since up to now+dueWindow, or, if it lists maxDue of them, those up
// to the latest it lists (an entry at that same score may be left out).
// Every kept booking was listed by an earlier reply, so its score is on
// Redis's clock: the comparison needs no conversion between clocks.
func drop(keep map[string]kept, asleep map[string]*sleeper, rb throttle.RetryBooking, since time.Duration) {
	if len(keep)+len(asleep) == 0 || rb.Now.IsZero() {
		return
	}
	from, to := rb.Now.Add(-since), rb.Now.Add(dueWindow)
	covered := func(score time.Time) bool { return !score.Before(from) && !score.After(to) }
	if len(rb.Due) >= maxDue {
		var last time.Time
		for _, at := range rb.Due {
			if at.After(last) {
				last = at
			}
		}
		covered = func(score time.Time) bool { return !score.Before(from) && score.Before(last) }
	}
	for member, k := range keep {
		if _, listed := rb.Due[member]; !listed && covered(k.score) {
			delete(keep, member)
		}
	}
	for member, sl := range asleep {
		if _, listed := rb.Due[member]; !listed && covered(sl.score) {
			delete(asleep, member)
			close(sl.lost)
		}
	}
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
	var forget []string
	for {
		if at, lost, ok := b.take(subject, member); ok {
			if m.late(at) {
				b.done(subject, member)
				continue // its entry is spent: book again
			}
			if err, rebook := m.runKept(ctx, at, lost, subject, member, t, next); !rebook {
				return err, true
			}
			continue // lost: book again
		}
		var wait chan struct{}
		if wait, forget = b.enter(subject); wait == nil {
			break
		}
		select {
		case <-wait:
		case <-ctx.Done():
			return ctx.Err(), true
		}
	}
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
		b.leave(subject, member, throttle.RetryBooking{}, now, forget, true)
		return m.refused(ctx, key, deadline.Refuse(bound, budget, 0)), true
	}
	rb, err := b.eng.BookRetry(ctx, []string{subject}, m.lim.Limits(), throttle.Request{N: 1, MaxWait: budget},
		throttle.RetryIndex{Key: subject + ":asynq", Member: member, KeepFrom: max(keep, 0), Window: dueWindow, MaxDue: maxDue,
			Since: b.since, Forget: forget})
	arrived := time.Now()
	b.leave(subject, member, rb, arrived, forget, err != nil)
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
		return m.runAt(ctx, at, nil, subject, t, next), true
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
			// keeps. Should it fail, the booking is given back and its
			// entry forgotten, so that no attempt runs at a slot that is
			// no longer its own.
			if err := m.pastDeadline(ctx, back); err != nil {
				m.giveBack(ctx, subject, rb.Booking)
				b.forgetLater(subject, member)
				return fmt.Errorf("%w: %w", e, err), true
			}
		}
		return e, true
	}
	return m.runAt(ctx, arrived.Add(rb.Wait), &rb.Booking, subject, t, next), true
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

// runAt sleeps until at and runs the task. If ctx ends first, a booking
// made by this attempt is given back.
func (m *middleware) runAt(ctx context.Context, at time.Time, bk *throttle.Booking, subject string, t *asynq.Task, next asynq.Handler) error {
	if d := time.Until(at); d > 0 {
		if err := sleep(ctx, d); err != nil {
			if bk != nil {
				m.giveBack(ctx, subject, *bk)
			}
			return err
		}
	}
	return next.ProcessTask(ctx, t)
}

// runKept waits until at for the kept booking of member under subject,
// taken from b.due, and runs the task. rebook reports that a reply showed
// the booking lost first: the task must book again.
func (m *middleware) runKept(ctx context.Context, at time.Time, lost <-chan struct{}, subject, member string, t *asynq.Task, next asynq.Handler) (err error, rebook bool) {
	b := m.booked
	if d := time.Until(at); d > 0 {
		timer := time.NewTimer(d)
		defer timer.Stop()
		select {
		case <-timer.C:
		case <-lost:
			return nil, true
		case <-ctx.Done():
			b.done(subject, member)
			return ctx.Err(), false
		}
	}
	if !b.done(subject, member) {
		return nil, true
	}
	return next.ProcessTask(ctx, t), false
}

// giveBack refunds a booking whose task will not run at it.
func (m *middleware) giveBack(ctx context.Context, subject string, bk throttle.Booking) {
	cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), time.Second)
	defer cancel()
	_, _ = m.booked.eng.RefundAll(cctx, []string{subject}, m.lim.Limits(), bk)
}
