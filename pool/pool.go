package pool

import (
	"container/list"
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"time"

	"github.com/slotbook/slotbook/lease"
	"github.com/slotbook/slotbook/reserve"
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
	sem       *lease.Semaphore // nil: no lease (see WithLease)
	workers   int
	lowBooked int // book again when no more than this many are booked
	batchMin  int // ... or when at least this many workers are free

	wake chan struct{}  // nudges the dispatcher; cap 1
	quit chan struct{}  // closed by Close
	wg   sync.WaitGroup // the dispatcher and running jobs

	// mu guards the fields below and the state of every Job (see Job).
	// Jobs change state only through moveLocked, which keeps these fields
	// consistent with the states.
	mu         sync.Mutex
	queues     map[string]*keyQueue // the backlog, by key; only keys with backlog
	turns      list.List            // of *keyQueue: the same keys, in turn
	slots      jobHeap              // booked jobs, earliest slot first
	owed       []*Job               // jobs whose booking is still to give back: done, or refused late and refunding (see takeRefundsLocked)
	flying     map[string]int       // keys with booking calls of the pool's in flight: how many (see book)
	calling    map[string]int       // keys with booking calls of Acquire callers in flight: how many (see acquireSlot)
	stood      map[string][]*Job    // the bookings a key's started jobs (and Acquire callers that acted) stand on, while a call sent before they started flies (see tradeUnderLocked)
	callers    []*Job               // records of the bookings of Acquire callers waiting for their slot: wanted, never given back by the pool (see acquireSlot)
	aloft      map[string][]uint64  // the numbers of each key's booking calls in flight (the pool's and its Acquire callers'), in order
	sent       uint64               // booking calls sent so far, which number them
	giving     map[string]int       // keys with bookings being given back: how many (see giveBack)
	maxFlights int                  // most batches in flight at once: the const maxFlights (tests may lower it)
	gave       sync.Cond            // on mu: signalled when giveBack is done (a key's giving may be 0)
	free       int                  // workers held by no job and no Acquire caller
	waiters    list.List            // of chan struct{}: Acquire callers waiting for a worker, first first
	pending    int                  // jobs submitted and not done
	idle       chan struct{}        // closed while pending is 0
	bookings   uint64               // bookings made so far, to give back the latest first
	closed     bool

	afterReply func(ctx context.Context) // tests: called in book for each job's context once the reply is in
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
		lim:        lim,
		workers:    DefaultWorkers,
		wake:       make(chan struct{}, 1),
		quit:       make(chan struct{}),
		queues:     make(map[string]*keyQueue),
		flying:     make(map[string]int),
		calling:    make(map[string]int),
		stood:      make(map[string][]*Job),
		aloft:      make(map[string][]uint64),
		giving:     make(map[string]int),
		maxFlights: maxFlights,
		idle:       make(chan struct{}),
	}
	for _, opt := range opts {
		if err := opt(p); err != nil {
			return nil, err
		}
	}
	p.free = p.workers
	p.gave.L = &p.mu
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
	j := &Job{key: key, ctx: ctx, fn: fn, done: make(chan struct{}), index: -1}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return nil, ErrClosed
	}
	p.moveLocked(j, queued, nil)
	// Under the lock: the function runs on a goroutine of its own and
	// takes the lock, so it finds the job queued and its watch set.
	j.stop = context.AfterFunc(ctx, func() { p.cancel(j) })
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
// Callers waiting for a worker get the next one given back, before the
// backlog. A refusal (the slot would pass ctx's deadline or the limiter's
// max wait) returns at once with the limiter's error, holding nothing. A
// caller books alone, as a job with WithLease does: one Redis call each
// (the engine may merge calls, see throttle.WithMergeAt), made once the
// pool's give-backs of the key under way are in. If ctx ends while the
// call is out, or the reply comes too late for ctx's deadline, Acquire
// returns ctx's error or the refusal, and the pool owes the booking as it
// owes a job's. If ctx ends while Acquire sleeps until the slot, Acquire
// returns ctx's error at once, and the pool gives the booking back, after
// any later booking of the key that will not be used. Meanwhile the pool
// may hand the caller an earlier slot of its key that a cancelled job will
// not use: Acquire then returns at that slot (see Cancellation in the
// package doc). Acquire returns ErrClosed once the pool is closed: to a
// caller still waiting for a worker, and to one sleeping until its slot,
// at once (its booking is given back as a job's is). Calling release more
// than once does nothing more.
func (p *Pool) Acquire(ctx context.Context, key string) (release func(), err error) {
	if err := p.lim.CheckKey(key); err != nil {
		return nil, err
	}
	if err := p.acquireWorker(ctx); err != nil {
		return nil, err
	}
	dropLease, err := p.takeLease(ctx, key) // first the lease, then the slot: see WithLease
	if err != nil {
		p.mu.Lock()
		p.putWorkerLocked()
		p.mu.Unlock()
		return nil, err
	}
	giveBack := func() {
		dropLease()
		p.mu.Lock()
		p.putWorkerLocked()
		p.mu.Unlock()
	}
	if err := p.acquireSlot(ctx, key); err != nil {
		giveBack()
		return nil, err
	}
	var once sync.Once
	return func() { once.Do(giveBack) }, nil
}

// acquireSlot books a slot of key for an Acquire caller and sleeps until
// it, as the limiter's Acquire does, but with the pool in sight of the
// booking, as of a job's:
//
//   - it books once no booking of the key is being given back, or owed
//     with nothing wanted on it (as a lease goroutine does): those must
//     reach Redis first, or they would give nothing back;
//   - it books alone, HoldLate as a job does (see book): a booking made
//     late by the reply's latency, or after ctx has ended, is owed by the
//     pool (handed down, traded, given back in order), and the call is
//     numbered among the key's calls in flight (aloft) for a late refusal
//     to trade with a booking started on meanwhile;
//   - while the call is out the key is busy (calling): the pool gives
//     back none of its bookings, which the caller's may stand on;
//   - while the caller sleeps its booking is wanted (callers): the pool
//     gives back none under it, and hands it the slot of one under it that
//     will not be used, as it does a booked job;
//   - once the caller acts, the owed bookings under its booking are
//     forgotten and a late refusal's of the same slot under it is traded
//     with it, as for a started job (actedLocked);
//   - a caller whose ctx ends while it sleeps, or the pool closed, has not
//     acted: its booking is forgone and owed, for the dispatcher to give
//     back in order (once closed, it returns only when no caller's call is
//     out and no caller sleeps).
func (p *Pool) acquireSlot(ctx context.Context, key string) error {
	p.mu.Lock()
	stop := context.AfterFunc(ctx, func() { // wakes the wait below
		p.mu.Lock()
		p.gave.Broadcast()
		p.mu.Unlock()
	})
	for !p.closed && ctx.Err() == nil && (p.giving[key] > 0 || p.givableOwedLocked(key)) {
		p.gave.Wait()
	}
	stop()
	if err := p.closedErrLocked(ctx); err != nil {
		p.mu.Unlock()
		return err
	}
	p.calling[key]++
	n := p.calledLocked(key)
	p.mu.Unlock()
	// Not ctx: a reply that books after ctx ends is the pool's to give
	// back (the engine's timeout bounds the call).
	rs, err := p.lim.ReserveBatch(context.Background(), key, []reserve.BatchRequest{{Context: ctx, N: 1, HoldLate: true}})
	now := time.Now()

	p.mu.Lock()
	if p.calling[key]--; p.calling[key] == 0 {
		delete(p.calling, key)
	}
	var (
		r     *reserve.Reservation
		rec   *Job                 // its booking in Redis, if any
		local *reserve.Reservation // the fallback's booking, to give back (no Redis call)
		sleep bool
	)
	if err == nil {
		r = rs[0]
		switch b := r.Booking(); {
		case r.Fallback():
			// No slot of the shared limit: a local booking.
			if err = p.closedErrLocked(ctx); err != nil {
				local = r
			}
		case !b.OK:
			err = r.Err() // refused: nothing booked
		default:
			rec = &Job{key: key, ctx: ctx, state: done, index: -1, res: r, at: b.At, act: r.SlotAt(), seq: p.bookings}
			p.bookings++
			cerr := p.closedErrLocked(ctx)
			switch {
			case !r.OK():
				// Refused late, or gone while the call was out: held for
				// the pool, owed as a job's late refusal is (see book).
				rec.act = now.Add(b.Wait)
				err = r.Err()
				p.oweCallerLocked(rec, nil)
			case cerr != nil:
				err = cerr
				p.oweCallerLocked(rec, err)
			default:
				rec.caller, rec.moved = true, make(chan struct{}, 1)
				p.callers = append(p.callers, rec)
				sleep = true
			}
		}
	}
	p.landedLocked(key, n) // its answer looked at
	p.mu.Unlock()
	p.nudge() // the key is no longer busy with the call
	if local != nil {
		_ = local.Cancel(context.WithoutCancel(ctx))
	}
	switch {
	case r != nil && r.Fallback() && err == nil:
		return r.Wait(ctx)
	case !sleep:
		return err
	}

	// Sleep until the slot of the booking rec holds: its own, or one
	// handed down to it (handDownLocked), which comes earlier.
	t := time.NewTimer(time.Hour)
	defer t.Stop()
	acted := false
	for slept := false; !slept; {
		p.mu.Lock()
		act := rec.act
		p.mu.Unlock()
		t.Reset(time.Until(act))
		select {
		case <-t.C:
			acted, slept = true, true
		case <-rec.moved: // Reset drops a tick not received (Go 1.23 timers)
		case <-ctx.Done():
			slept = true
		case <-p.quit:
			slept = true
		}
	}
	p.mu.Lock()
	p.callers = slices.DeleteFunc(p.callers, func(j *Job) bool { return j == rec })
	rec.caller = false
	if !acted {
		err := p.closedErrLocked(ctx)
		p.oweCallerLocked(rec, err)
		p.mu.Unlock()
		p.nudge()
		return err
	}
	p.actedLocked(rec)
	p.mu.Unlock()
	p.nudge()
	return nil
}

// closedErrLocked is the error of an Acquire caller that will not act:
// ctx's, or ErrClosed once the pool is closed; nil if neither. p.mu is
// held.
func (p *Pool) closedErrLocked(ctx context.Context) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	if p.closed {
		return ErrClosed
	}
	return nil
}

// oweCallerLocked owes the booking of rec, an Acquire caller's that no
// one acted on: held already (a late refusal's), or OK and forgone here
// with err. The dispatcher gives it back in order with the others of its
// key (it does not return while a caller's call is out or a caller
// sleeps). p.mu is held.
func (p *Pool) oweCallerLocked(rec *Job, err error) {
	if err != nil {
		rec.res, _ = forgo(rec.res, err)
	}
	p.owed = append(p.owed, rec)
	p.tradeUnderLocked(rec) // a job or caller started on top of it
}

// acquireWorker takes a worker for an Acquire caller, waiting for one if
// none is free.
func (p *Pool) acquireWorker(ctx context.Context) error {
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		return ErrClosed
	}
	if p.free > 0 { // then no one is waiting (see putWorkerLocked)
		p.takeWorkerLocked()
		p.mu.Unlock()
		return nil
	}
	given := make(chan struct{})
	e := p.waiters.PushBack(given)
	p.mu.Unlock()
	var err error
	select {
	case <-given:
		return nil
	case <-ctx.Done():
		err = ctx.Err()
	case <-p.quit:
		err = ErrClosed
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	select {
	case <-given: // given as we gave up: pass it on
		p.putWorkerLocked()
	default:
		p.waiters.Remove(e)
	}
	return err
}

// Close stops the pool: no more jobs are accepted, jobs not yet booked end
// with ErrClosed, bookings not yet started are given back (their jobs end
// with ErrClosed, and Acquire callers sleeping until their slot return
// ErrClosed), and Close waits for running jobs, and for booking calls in
// flight, the pool's and its Acquire callers' (bounded by the engine's
// timeout), whose bookings it gives back too, in order, each within a
// second: while Redis does not answer, that is a second per booking (it
// goes on past a give-back that got no answer, whose refund may yet have
// run, so that the bookings under it give their room back), so bound
// Close with ctx. If ctx ends first,
// the running jobs' contexts are not cancelled (they are the caller's), but
// Close stops waiting and returns ctx's error. Close is idempotent.
func (p *Pool) Close(ctx context.Context) error {
	p.mu.Lock()
	if !p.closed {
		p.closed = true
		var queued []*Job
		for e := p.turns.Front(); e != nil; e = e.Next() {
			for je := e.Value.(*keyQueue).jobs.Front(); je != nil; je = je.Next() {
				queued = append(queued, je.Value.(*Job))
			}
		}
		for _, j := range queued {
			p.moveLocked(j, done, ErrClosed)
		}
		close(p.quit) // the dispatcher gives back the bookings, then returns
	}
	p.mu.Unlock()
	stopped := make(chan struct{})
	go func() { p.wg.Wait(); close(stopped) }()
	select {
	case <-stopped:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// nudge wakes the dispatcher.
func (p *Pool) nudge() {
	select {
	case p.wake <- struct{}{}:
	default:
	}
}

// cancel handles a job whose context has ended.
func (p *Pool) cancel(j *Job) {
	p.mu.Lock()
	defer p.mu.Unlock()
	switch j.state {
	case queued:
		p.moveLocked(j, done, j.ctx.Err())
	case booked:
		p.nudge() // the dispatcher gives the booking back
	}
	// booking: judged when the batch's reply arrives. running: the
	// function has the context. refunding, done: nothing left to do.
}
