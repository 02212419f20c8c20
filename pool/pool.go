// Package pool runs jobs under a shared rate limit with fewer than one
// Redis call per job. A Pool knows its backlog, so it books slots for many
// jobs in one batch call, sleeps until each job's slot, then runs it.
//
// Concurrency and rate are bounded together: a job holds one of the pool's
// workers from the moment its slot is booked until it returns, so at most
// Workers jobs are booked or running at once. Pool.Acquire lets an existing
// worker loop take a worker and a slot the same way.
package pool

import (
	"container/heap"
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"time"

	"golang.org/x/sync/semaphore"

	"github.com/slotbook/slotbook/deadline"
	"github.com/slotbook/slotbook/reserve"
	"github.com/slotbook/slotbook/throttle"
)

// ErrClosed is returned for work submitted to, or left in, a closed Pool.
var ErrClosed = errors.New("pool: closed")

// DefaultWorkers is the number of workers of a Pool built without
// WithWorkers.
const DefaultWorkers = 10

// A Pool runs submitted jobs, each at a slot booked through a
// reserve.Limiter, with at most Workers of them booked or running at once.
//
// A Pool is safe for concurrent use. Build one with New and stop it with
// Close; the zero Pool is not usable.
type Pool struct {
	lim       *reserve.Limiter
	workers   int
	sem       *semaphore.Weighted // one unit per worker; shared with Acquire
	lowBooked int                 // book again when no more than this many are booked
	batchMin  int                 // ... or when at least this many workers are free

	wake chan struct{} // nudges the dispatcher; cap 1
	quit chan struct{} // closed by Close
	wg   sync.WaitGroup

	mu        sync.Mutex // guards everything below
	backlog   map[string][]*Job
	keys      []string // keys with backlog, in round-robin order
	notBefore map[string]time.Time
	scheduled jobHeap // booked, waiting for their slot
	refunds   []*Job  // cancelled after booking, to give back
	held      int     // workers held by jobs (booked, booking or running)
	booked    int     // jobs booked or booking, not started
	pending   int     // jobs not done
	idle      chan struct{}
	closed    bool
}

// An Option configures a Pool in New.
type Option func(*Pool) error

// WithWorkers sets how many jobs may be booked or running at once (default
// DefaultWorkers). It also bounds how far ahead the pool books.
func WithWorkers(n int) Option {
	return func(p *Pool) error {
		if n <= 0 {
			return fmt.Errorf("pool: %d workers: must be positive", n)
		}
		p.workers = n
		return nil
	}
}

// New returns a Pool that books through lim and starts its dispatcher.
// Close stops it. New makes no network call.
func New(lim *reserve.Limiter, opts ...Option) (*Pool, error) {
	if lim == nil {
		return nil, errors.New("pool: nil limiter")
	}
	p := &Pool{
		lim:       lim,
		workers:   DefaultWorkers,
		wake:      make(chan struct{}, 1),
		quit:      make(chan struct{}),
		backlog:   make(map[string][]*Job),
		notBefore: make(map[string]time.Time),
		idle:      make(chan struct{}),
	}
	for _, opt := range opts {
		if err := opt(p); err != nil {
			return nil, err
		}
	}
	p.sem = semaphore.NewWeighted(int64(p.workers))
	// Book for a quarter of the workers or fewer only when the booked
	// queue is running dry; otherwise wait until three quarters are free,
	// so that each Redis call books many jobs.
	p.lowBooked = p.workers / 4
	p.batchMin = max(1, p.workers*3/4)
	close(p.idle)
	p.wg.Add(1)
	go p.dispatch()
	return p, nil
}

// Workers returns the number of workers.
func (p *Pool) Workers() int { return p.workers }

// A Job is a function submitted to a Pool. Its methods are safe for
// concurrent use.
type Job struct {
	key  string
	ctx  context.Context
	fn   func(context.Context) error
	stop func() bool // stops the context watch

	done chan struct{}

	// Guarded by the pool's mu.
	state   jobState
	res     *reserve.Reservation
	err     error
	started time.Time
	index   int // in the scheduled heap
}

type jobState int

const (
	backlogged jobState = iota
	booking
	scheduled
	running
	refunding // its booking is being given back
	finished
	cancelled // while booking; resolved when the batch returns
)

// Done is closed when the job has finished, run or not.
func (j *Job) Done() <-chan struct{} { return j.done }

// Err returns the job's outcome once Done is closed: the function's error,
// a refusal (errors.Is deadline.ErrWouldExceedDeadline, with the exact
// retry-after), the job context's error, ErrClosed, or a Redis failure.
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

// Reservation waits for the job to finish and returns the reservation made
// for it (nil if none was): its Booking gives the slot on the Redis clock.
func (j *Job) Reservation() *reserve.Reservation {
	<-j.done
	return j.res
}

// Slot waits for the job to finish and returns the local time of its
// booked slot, or the zero Time if it was never booked.
func (j *Job) Slot() time.Time {
	<-j.done
	if j.res == nil || !j.res.OK() {
		return time.Time{}
	}
	return j.res.SlotAt()
}

// Submit queues fn to run for subject key at its next free slot. ctx is
// the job's context: fn receives it, and its deadline bounds the wait, so a
// job whose slot would pass it is refused without booking. Submit returns
// at once; the Job reports the outcome.
func (p *Pool) Submit(ctx context.Context, key string, fn func(context.Context) error) (*Job, error) {
	if fn == nil {
		return nil, errors.New("pool: nil job function")
	}
	if err := p.lim.CheckKey(key); err != nil {
		return nil, err
	}
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	j := &Job{key: key, ctx: ctx, fn: fn, done: make(chan struct{})}
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		return nil, ErrClosed
	}
	if len(p.backlog[key]) == 0 {
		p.keys = append(p.keys, key)
	}
	p.backlog[key] = append(p.backlog[key], j)
	if p.pending == 0 {
		p.idle = make(chan struct{})
	}
	p.pending++
	// Under the lock: the function runs on a goroutine of its own and
	// takes the lock, so it sees the job queued.
	j.stop = context.AfterFunc(ctx, func() { p.cancel(j) })
	p.mu.Unlock()
	p.nudge()
	return j, nil
}

// Wait waits until every job submitted so far is done, or ctx is done.
func (p *Pool) Wait(ctx context.Context) error {
	p.mu.Lock()
	idle := p.idle
	p.mu.Unlock()
	select {
	case <-idle:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// Acquire takes one of the pool's workers and then a slot for key, sleeping
// until the slot, for a worker loop of the caller's own:
//
//	release, err := p.Acquire(ctx, key)
//	if err != nil { return err }
//	defer release()
//	doWork()
//
// A refusal (the slot would pass ctx's deadline or the limiter's max wait)
// returns at once with the limiter's error, holding nothing.
func (p *Pool) Acquire(ctx context.Context, key string) (release func(), err error) {
	p.mu.Lock()
	closed := p.closed
	p.mu.Unlock()
	if closed {
		return nil, ErrClosed
	}
	if err := p.lim.CheckKey(key); err != nil {
		return nil, err
	}
	if err := p.sem.Acquire(ctx, 1); err != nil {
		return nil, err
	}
	if err := p.lim.Acquire(ctx, key); err != nil {
		p.sem.Release(1)
		return nil, err
	}
	var once sync.Once
	return func() { once.Do(func() { p.sem.Release(1) }) }, nil
}

// Close stops the pool: no more jobs are accepted, jobs not yet booked end
// with ErrClosed, bookings not yet started are given back (their jobs end
// with ErrClosed), and Close waits for running jobs. If ctx ends first, the
// running jobs' contexts are not cancelled (they are the caller's), but
// Close stops waiting and returns ctx's error. Close is idempotent.
func (p *Pool) Close(ctx context.Context) error {
	p.mu.Lock()
	if !p.closed {
		p.closed = true
		close(p.quit)
	}
	p.mu.Unlock()
	done := make(chan struct{})
	go func() { p.wg.Wait(); close(done) }()
	select {
	case <-done:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

func (p *Pool) nudge() {
	select {
	case p.wake <- struct{}{}:
	default:
	}
}

// cancel handles a job whose context ended before it ran.
func (p *Pool) cancel(j *Job) {
	p.mu.Lock()
	defer p.mu.Unlock()
	switch j.state {
	case backlogged:
		q := p.backlog[j.key]
		for i, x := range q {
			if x == j {
				p.backlog[j.key] = append(q[:i:i], q[i+1:]...)
				break
			}
		}
		p.finishLocked(j, j.ctx.Err())
	case booking:
		j.state = cancelled
	case scheduled:
		heap.Remove(&p.scheduled, j.index)
		p.booked--
		p.releaseLocked()
		p.refundLocked(j, j.ctx.Err())
	}
}

// refundLocked queues j's booking to be given back by the dispatcher; j
// ends with err once it has been, so that a job reported done has left
// nothing booked. p.mu is held.
func (p *Pool) refundLocked(j *Job, err error) {
	j.state = refunding
	j.err = err
	p.refunds = append(p.refunds, j)
	p.nudge()
}

// finishLocked ends j with err. p.mu is held.
func (p *Pool) finishLocked(j *Job, err error) {
	if j.state == finished {
		return
	}
	j.state = finished
	j.err = err
	if j.stop != nil {
		j.stop()
	}
	close(j.done)
	p.pending--
	if p.pending == 0 {
		close(p.idle)
	}
}

func (p *Pool) releaseLocked() {
	p.held--
	p.sem.Release(1)
}

// dispatch books the backlog, starts jobs at their slots and gives back
// cancelled bookings, until Close.
func (p *Pool) dispatch() {
	defer p.wg.Done()
	timer := time.NewTimer(time.Hour)
	defer timer.Stop()
	for {
		p.giveBack()
		p.book()
		next := p.startDue()
		if !next.IsZero() {
			timer.Reset(time.Until(next))
		}
		select {
		case <-p.wake:
		case <-timer.C:
		case <-p.quit:
			p.shutdown()
			return
		}
	}
}

// book sends batches for keys with backlog while workers are free.
func (p *Pool) book() {
	for tried := 0; ; tried++ {
		p.mu.Lock()
		if p.closed || len(p.keys) == 0 || tried >= len(p.keys) {
			p.mu.Unlock()
			return
		}
		if p.booked > p.lowBooked && p.workers-p.held < p.batchMin {
			p.mu.Unlock()
			return
		}
		key := p.keys[0]
		p.keys = append(p.keys[1:], key) // round robin
		if nb, ok := p.notBefore[key]; ok {
			if time.Now().Before(nb) {
				p.mu.Unlock()
				continue
			}
			delete(p.notBefore, key)
		}
		q := p.backlog[key]
		if len(q) == 0 { // emptied by cancellations
			p.dropKeyLocked(key)
			p.mu.Unlock()
			continue
		}
		// Share the free workers between the keys waiting for them.
		free := p.workers - p.held
		want := min(len(q), throttle.MaxBatch, max(1, (free+len(p.keys)-1)/len(p.keys)))
		n := 0
		for n < want && p.sem.TryAcquire(1) {
			n++
		}
		if n == 0 {
			p.mu.Unlock()
			return
		}
		batch := q[:n:n]
		p.backlog[key] = q[n:]
		if len(p.backlog[key]) == 0 {
			p.dropKeyLocked(key)
		}
		reqs := make([]reserve.BatchRequest, n)
		for i, j := range batch {
			j.state = booking
			reqs[i] = reserve.BatchRequest{Context: j.ctx, N: 1}
		}
		p.held += n
		p.booked += n
		p.mu.Unlock()

		// Not a job's context: one job's cancellation must not fail the
		// others' call (the engine's timeout bounds it).
		rs, err := p.lim.ReserveBatch(context.Background(), key, reqs)
		p.settle(key, batch, rs, err)
		tried = -1 // something was booked; go round again
	}
}

// settle records a batch's answers.
func (p *Pool) settle(key string, batch []*Job, rs []*reserve.Reservation, err error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	var back []*Job // refused by the max wait: not yet, rather than never
	for i, j := range batch {
		p.booked--
		switch {
		case err != nil:
			p.releaseLocked()
			p.finishLocked(j, err)
		case j.state == cancelled:
			p.releaseLocked()
			j.res = rs[i]
			if rs[i].OK() {
				p.refundLocked(j, j.ctx.Err())
			} else {
				p.finishLocked(j, j.ctx.Err())
			}
		case rs[i].OK():
			j.res = rs[i]
			j.state = scheduled
			p.booked++
			heap.Push(&p.scheduled, j)
		case errors.Is(rs[i].Err(), deadline.ErrMaxWaitExceeded):
			p.releaseLocked()
			j.state = backlogged
			back = append(back, j)
			if maxWait, ok := p.lim.MaxWait(); ok {
				p.notBefore[key] = time.Now().Add(rs[i].RetryAfter() - maxWait)
			}
		default:
			p.releaseLocked()
			j.res = rs[i]
			p.finishLocked(j, rs[i].Err())
		}
	}
	if len(back) > 0 {
		if len(p.backlog[key]) == 0 {
			p.keys = append(p.keys, key)
		}
		p.backlog[key] = append(back, p.backlog[key]...)
	}
}

func (p *Pool) dropKeyLocked(key string) {
	delete(p.backlog, key)
	delete(p.notBefore, key)
	for i, k := range p.keys {
		if k == key {
			p.keys = append(p.keys[:i], p.keys[i+1:]...)
			return
		}
	}
}

// startDue starts the jobs whose slot has come and returns when the next
// thing is due: the next slot, or a key's retry time (zero if nothing).
func (p *Pool) startDue() time.Time {
	p.mu.Lock()
	defer p.mu.Unlock()
	now := time.Now()
	for p.scheduled.Len() > 0 {
		j := p.scheduled[0]
		if j.res.SlotAt().After(now) {
			break
		}
		heap.Pop(&p.scheduled)
		p.booked--
		j.state = running
		p.wg.Add(1)
		go p.run(j)
	}
	var next time.Time
	if p.scheduled.Len() > 0 {
		next = p.scheduled[0].res.SlotAt()
	}
	for _, t := range p.notBefore {
		if t.After(now) && (next.IsZero() || t.Before(next)) {
			next = t
		}
	}
	return next
}

func (p *Pool) run(j *Job) {
	defer p.wg.Done()
	started := time.Now()
	err := j.fn(j.ctx)
	p.mu.Lock()
	j.started = started
	p.releaseLocked()
	p.finishLocked(j, err)
	p.mu.Unlock()
	p.nudge()
}

// giveBack refunds cancelled bookings, latest slot first, so that each
// refund can give back all of its booking. A refund gives back only what
// later bookings have not built on, so the order matters: jobs whose
// context has ended but whose cancellation has not reached the pool yet
// (contexts shared by many jobs end at once) are taken now too.
func (p *Pool) giveBack() {
	p.mu.Lock()
	if len(p.refunds) == 0 {
		p.mu.Unlock()
		return
	}
	for i := 0; i < p.scheduled.Len(); {
		j := p.scheduled[i]
		if j.ctx.Err() == nil {
			i++
			continue
		}
		heap.Remove(&p.scheduled, i)
		p.booked--
		p.releaseLocked()
		p.refundLocked(j, j.ctx.Err())
		i = 0 // the heap moved
	}
	js := p.refunds
	p.refunds = nil
	p.mu.Unlock()
	p.refund(js)
}

// refund gives back the bookings of js, latest slot first, then ends each
// job with the error it was given.
func (p *Pool) refund(js []*Job) {
	if len(js) == 0 {
		return
	}
	slices.SortFunc(js, func(a, b *Job) int { return b.res.SlotAt().Compare(a.res.SlotAt()) })
	for _, j := range js {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		_ = j.res.Cancel(ctx)
		cancel()
	}
	p.mu.Lock()
	for _, j := range js {
		p.finishLocked(j, j.err)
	}
	p.mu.Unlock()
}

// shutdown ends what has not started and gives back its bookings.
func (p *Pool) shutdown() {
	p.mu.Lock()
	for _, q := range p.backlog {
		for _, j := range q {
			p.finishLocked(j, ErrClosed)
		}
	}
	p.backlog = map[string][]*Job{}
	p.keys = nil
	for p.scheduled.Len() > 0 {
		j := heap.Pop(&p.scheduled).(*Job)
		p.booked--
		p.releaseLocked()
		p.refundLocked(j, ErrClosed)
	}
	js := p.refunds
	p.refunds = nil
	p.mu.Unlock()
	p.refund(js)
}
