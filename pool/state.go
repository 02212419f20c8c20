package pool

import (
	"container/heap"
	"container/list"
	"fmt"
	"time"
)

// A jobState is where a job is in the pool. A job moves only along the
// moves table below (forward, but for a job refused by the max wait, which
// goes back to the backlog), and only through Pool.moveLocked.
type jobState uint8

const (
	submitted jobState = iota // being submitted, not yet in the pool (the zero value)
	queued                    // in its key's backlog
	booking                   // in a batch whose Redis call is in flight
	booked                    // has a slot, in the slots heap
	running                   // its function runs
	refunding                 // its booking is being given back; it will not run
	done                      // finished; err is its outcome
)

var stateNames = [...]string{"submitted", "queued", "booking", "booked", "running", "refunding", "done"}

func (s jobState) String() string { return stateNames[s] }

// holdsWorker reports whether a job in state s holds one of the workers:
// from the moment its batch is sent until it is done (or back in the
// backlog).
func (s jobState) holdsWorker() bool { return s >= booking && s <= refunding }

// moves[from] has the bit 1<<to set for each legal move.
var moves = [...]uint8{
	submitted: 1 << queued,
	queued:    1<<booking | 1<<done,                           // taken into a batch, or cancelled or closed
	booking:   1<<booked | 1<<queued | 1<<refunding | 1<<done, // booked; refused by the max wait (not yet); refused late, its booking to give back; refused, failed, or no longer wanted
	booked:    1<<running | 1<<refunding,                      // its slot came; cancelled or closed
	running:   1 << done,                                      // returned (or panicked)
	refunding: 1 << done,                                      // given back
	done:      0,
}

// A keyQueue is one key's backlog.
type keyQueue struct {
	key       string
	jobs      list.List     // of *Job, first submitted first
	turn      *list.Element // in the pool's turns
	notBefore time.Time     // no batch before then: its jobs were refused by the max wait
}

// moveLocked moves j to state to, keeping the pool consistent with it:
//
//   - a job is in its key's backlog iff it is queued, and a key is in the
//     pool's backlog and turns iff it has a queued job;
//   - a job is in the slots heap iff it is booked;
//   - a job holds a worker iff its state holdsWorker: moving into such a
//     state takes a free worker, moving out gives one back;
//   - pending counts the jobs not done; idle is closed iff it is 0;
//   - a job has a goroutine iff it is running;
//   - a done job has its outcome err, its context watch stopped, and done
//     closed.
//
// err is the job's outcome for a move to refunding or done (ignored
// otherwise). Every move wakes the dispatcher, so no change of state can go
// unnoticed by it. p.mu is held. An illegal move is a bug in the pool: it
// panics.
func (p *Pool) moveLocked(j *Job, to jobState, err error) {
	from := j.state
	if moves[from]&(1<<to) == 0 {
		panic(fmt.Sprintf("pool: job moved from %v to %v", from, to))
	}

	// Leave from.
	switch from {
	case submitted:
		if p.pending == 0 {
			p.idle = make(chan struct{})
		}
		p.pending++
	case queued:
		p.unqueueLocked(j)
	case booked:
		heap.Remove(&p.slots, j.index)
	}
	switch {
	case from.holdsWorker() && !to.holdsWorker():
		p.putWorkerLocked()
	case !from.holdsWorker() && to.holdsWorker():
		p.takeWorkerLocked()
	}

	if to == done || to == queued {
		p.releaseLeaseLocked(j)
	}

	// Enter to.
	j.state = to
	switch to {
	case queued:
		// A job refused by the max wait goes back to the front: it was
		// first.
		p.enqueueLocked(j, from == booking)
	case booked:
		heap.Push(&p.slots, j)
	case running:
		p.wg.Add(1)
		go p.run(j)
	case refunding:
		j.err = err
	case done:
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
	p.nudge()
}

// enqueueLocked puts j in its key's backlog, at the front or the back,
// giving the key a turn if it had no backlog. p.mu is held.
func (p *Pool) enqueueLocked(j *Job, front bool) {
	q := p.queues[j.key]
	if q == nil {
		q = &keyQueue{key: j.key}
		q.turn = p.turns.PushBack(q)
		p.queues[j.key] = q
	}
	if front {
		j.elem = q.jobs.PushFront(j)
	} else {
		j.elem = q.jobs.PushBack(j)
	}
}

// unqueueLocked takes j out of its key's backlog, and the key out of the
// turns if that was its last job. p.mu is held.
func (p *Pool) unqueueLocked(j *Job) {
	q := p.queues[j.key]
	q.jobs.Remove(j.elem)
	j.elem = nil
	if q.jobs.Len() == 0 {
		p.turns.Remove(q.turn)
		delete(p.queues, j.key)
	}
}

// takeWorkerLocked takes a free worker. p.mu is held.
func (p *Pool) takeWorkerLocked() {
	if p.free <= 0 {
		panic("pool: a worker taken while none is free")
	}
	p.free--
}

// putWorkerLocked gives a worker back: to the first Acquire caller waiting
// for one, or else to the backlog, waking the dispatcher. So a worker is
// never free while an Acquire caller waits. p.mu is held.
func (p *Pool) putWorkerLocked() {
	if e := p.waiters.Front(); e != nil {
		close(p.waiters.Remove(e).(chan struct{}))
		return
	}
	p.free++
	p.nudge()
}
