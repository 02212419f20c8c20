package pool

import (
	"context"
	"errors"
	"slices"
	"time"

	"github.com/slotbook/slotbook/lease"
)

// WithLease makes every job, and every Acquire caller, hold a lease of sem
// for its key (at most sem.N() of them at once across every process, see
// package lease) as well as a slot of the pool's limiter.
//
// The lease comes first, then the slot: a job waits (first come, first
// served across processes) for its lease, then books its slot, sleeps
// until it, runs, and gives the lease back when it is done. The other
// order would book a slot and then wait for a lease: the slot passes
// unused while the job waits, and when leases come back, jobs whose slots
// have passed would all start at once, a burst the rate limit never
// granted. Lease first keeps both limits exact; what it costs is a lease
// held idle while its job sleeps until its slot, which the limiter's max
// wait (or the job's deadline) bounds. A job refused by the max wait gives
// its lease back before it returns to the backlog.
//
// With a lease, each job books its slot alone as soon as its lease is
// granted (batches would hold leases idle while others wait), so a job
// costs the lease's two Redis calls (acquire, release) and one booking.
func WithLease(sem *lease.Semaphore) Option {
	return func(p *Pool) error {
		if sem == nil {
			return errors.New("pool: nil lease semaphore")
		}
		p.sem = sem
		return nil
	}
}

// leaseAndBook takes a lease for each job of batch, each job on a
// goroutine of its own, and books each job's slot once it has its lease.
// The jobs hold their workers (state booking) meanwhile, so at most
// Workers jobs wait for leases. The caller holds a count of p.wg.
func (p *Pool) leaseAndBook(key string, batch []*Job) {
	for _, j := range batch {
		p.wg.Add(1)
		go func() {
			defer p.wg.Done()
			ctx, cancel := context.WithCancel(j.ctx)
			stop := p.whenClosed(cancel)
			l, err := p.sem.Acquire(ctx, key)
			stop()
			cancel()
			if err != nil {
				p.mu.Lock()
				if j.ctx.Err() == nil && (p.closed || errors.Is(err, lease.ErrClosed)) {
					err = ErrClosed
				} else if j.ctx.Err() != nil {
					err = j.ctx.Err()
				}
				p.moveLocked(j, done, err)
				p.mu.Unlock()
				return
			}
			p.mu.Lock()
			j.lease = l
			// Bookings of the key being given back, or owed with
			// nothing wanted on them (the dispatcher gives them back at
			// its next look), must reach Redis before this one, or they
			// would give nothing back.
			for !p.closed && (p.giving[key] > 0 || p.givableOwedLocked(key)) {
				p.gave.Wait()
			}
			if p.closed { // the dispatcher may have returned: end it here
				p.moveLocked(j, done, ErrClosed) // gives the lease back
				p.mu.Unlock()
				return
			}
			// In flight: the dispatcher stays until the booking is in,
			// and gives it back with the others of its key, latest
			// first, if it is not to run.
			p.sendingLocked(key, []*Job{j})
			p.mu.Unlock()
			p.book(key, []*Job{j})
		}()
	}
}

// whenClosed calls f once the pool is closed, until the returned stop is
// called.
func (p *Pool) whenClosed(f func()) (stop func()) {
	done := make(chan struct{})
	exited := make(chan struct{})
	go func() {
		defer close(exited)
		select {
		case <-p.quit:
			f()
		case <-done:
		}
	}()
	return func() { close(done); <-exited }
}

// releaseLeaseLocked gives back j's lease, if it has one, on a goroutine
// (the Redis call is not made under p.mu): j is done, or back in the
// backlog. A count of p.wg is held by the caller of every such move, so
// Close waits for the release too. p.mu is held.
func (p *Pool) releaseLeaseLocked(j *Job) {
	l := j.lease
	if l == nil {
		return
	}
	j.lease = nil
	p.wg.Add(1)
	go func() {
		defer p.wg.Done()
		// The job's context may have ended: keep its values, not its end.
		ctx, cancel := context.WithTimeout(context.WithoutCancel(j.ctx), 5*time.Second)
		defer cancel()
		// A failed release is given back by the Semaphore's own leave
		// call once Redis answers (see lease.Lease.Release).
		_ = l.Release(ctx)
	}()
}

// takeLease takes a lease for an Acquire caller, if the pool has a
// semaphore, and returns the function that gives it back.
func (p *Pool) takeLease(ctx context.Context, key string) (release func(), err error) {
	if p.sem == nil {
		return func() {}, nil
	}
	lctx, cancel := context.WithCancel(ctx)
	stop := p.whenClosed(cancel)
	l, err := p.sem.Acquire(lctx, key)
	stop()
	cancel()
	if err != nil {
		if ctx.Err() != nil {
			return nil, ctx.Err()
		}
		p.mu.Lock()
		closed := p.closed
		p.mu.Unlock()
		if closed || errors.Is(err, lease.ErrClosed) {
			return nil, ErrClosed
		}
		return nil, err
	}
	return func() {
		ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
		defer cancel()
		_ = l.Release(ctx)
	}, nil
}

// givableOwedLocked reports whether key has owed bookings that no booking
// still wanted stands on: the dispatcher's next look gives them back. (An
// owed booking may lie under the key's latest wanted one, or above every
// wanted one once slots were handed down.) p.mu is held.
func (p *Pool) givableOwedLocked(key string) bool {
	var top *Job // the key's latest wanted booking
	for _, js := range [][]*Job{p.slots, p.callers} {
		for _, j := range js {
			if j.key == key && (j.caller || j.ctx.Err() == nil) && (top == nil || byBooking(j, top) > 0) {
				top = j
			}
		}
	}
	return slices.ContainsFunc(p.owed, func(j *Job) bool { return j.key == key && (top == nil || byBooking(j, top) > 0) })
}
