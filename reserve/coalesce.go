package reserve

import (
	"context"
	"fmt"
	"time"

	"github.com/slotbook/slotbook/internal/waitbound"
	"github.com/slotbook/slotbook/throttle"
)

// Coalescing (group commit): at most one batch call per key is in flight
// from a Limiter. A caller that finds none in flight sends its request at
// once, alone. So does a caller that finds fewer than soloBelow other
// callers of its key in the Limiter (in flight or queued): with so few,
// waiting a round trip for the call in flight costs more time than the
// calls saved are worth. Callers that arrive while more are about queue
// (up to maxQueue of them); when the call returns,
// its sender names the first of them the next leader and wakes it, after
// the batch's own callers. The leader takes whatever has queued by the
// time it runs, itself first (up to throttle.MaxBatch), sends it as one
// batch call, and in turn hands on to whoever queued meanwhile. No
// goroutine is started: each batch is sent by one of its own callers.

// defaultMaxQueue bounds the callers queued for one key. Past it, callers
// make calls of their own, uncoalesced, so memory stays bounded whatever
// the load.
const defaultMaxQueue = 4 * throttle.MaxBatch

// soloBelow: a caller that finds fewer callers of its key than this sends
// its request at once, alone, even while a call is in flight. At 4 callers
// on one key, queueing behind the call in flight served 0.65x the
// reservations per second of sending alone (slotbench -scaling, the
// 2026-12-03 05:52 run, before this rule); from 16
// on, queueing serves more and makes a tenth of the calls or fewer.
const soloBelow = 4

// queue is the state of one key with a call in flight and callers
// waiting. A key with a call in flight and no one waiting has a nil queue
// in Limiter.queues: a caller alone allocates none.
type queue struct {
	pending []*call
}

// call is one ReserveN caller.
type call struct {
	ctx  context.Context
	n    int
	hold bool // a ReserveBatch request's HoldLate
	// maxWait is the call's max wait: the limiter's (deadline.NoCap if
	// none), or a shorter one of ReserveWithin's.
	maxWait time.Duration

	res *Reservation // set, or err, before wake says done
	err error
	// ended: not sent because its context had ended; res holds the
	// context's error (ReserveN returns it as its error).
	ended bool

	// wake, made when the caller queues, says true if the caller is to
	// lead the next batch (which it reads before sending it), and false
	// once the caller's batch is back (its res or err set).
	wake  chan bool
	taken bool // guarded by Limiter.mu: out of pending, into a batch or leading one

	self [1]*call // the batch of a caller sent alone
}

// alone returns the batch of c alone.
func (c *call) alone() []*call {
	c.self[0] = c
	return c.self[:]
}

func (l *Limiter) coalesced(key string, c *call) (*Reservation, error) {
	l.mu.Lock()
	others := l.callers[key]
	l.callers[key] = others + 1
	defer l.leave(key)
	q, busy := l.queues[key]
	if busy && others < l.soloBelow {
		l.mu.Unlock()
		return l.sendAlone(key, c)
	}
	if !busy {
		l.queues[key] = nil // in flight, no one waiting
		l.mu.Unlock()
		l.send(c.ctx, key, c.alone())
		return c.finish()
	}
	if q == nil {
		q = &queue{}
		l.queues[key] = q
	} else if len(q.pending) >= l.maxQueue {
		l.mu.Unlock()
		return l.sendAlone(key, c)
	}
	c.wake = make(chan bool, 1)
	q.pending = append(q.pending, c)
	l.mu.Unlock()

	select {
	case lead := <-c.wake:
		if lead {
			l.lead(key, c)
		}
		return c.finish()
	case <-c.ctx.Done():
	}

	// Cancelled while queued: leave the queue if no batch has taken us.
	l.mu.Lock()
	if !c.taken {
		for i, p := range q.pending {
			if p == c {
				q.pending = append(q.pending[:i], q.pending[i+1:]...)
				break
			}
		}
		l.mu.Unlock()
		return nil, c.ctx.Err()
	}
	l.mu.Unlock()
	// Taken: our request is in a batch, or we lead the next one. Send it if
	// we lead, else wait for it; then give back anything booked for us.
	if <-c.wake {
		l.lead(key, c)
	}
	return c.finish()
}

// sendAlone books c in a call of its own beside the one in flight, and
// answers it as a batch's caller is answered: once sent, the call is not
// cut short when c's context ends (the engine's timeout bounds it), and if
// it ended meanwhile, c gets the context's error and its slot is given
// back. Waiting for a free connection, nothing is sent yet, so c's end
// ends the wait (waitbound).
func (l *Limiter) sendAlone(key string, c *call) (*Reservation, error) {
	k := l.subjectKey(key)
	l.giveBackLate(c.ctx, k, l.book(waitbound.Detach(c.ctx), k, c.alone()), nil)
	return c.finish()
}

// leave counts a caller of key out of Limiter.callers.
func (l *Limiter) leave(key string) {
	l.mu.Lock()
	if n := l.callers[key] - 1; n > 0 {
		l.callers[key] = n
	} else {
		delete(l.callers, key)
	}
	l.mu.Unlock()
}

// lead sends, for leader c (taken by handOn), the batch of c and the
// callers queued for key by now.
func (l *Limiter) lead(key string, c *call) {
	l.mu.Lock()
	batch := c.alone()
	if q := l.queues[key]; q != nil && len(q.pending) > 0 {
		n := min(len(q.pending), throttle.MaxBatch-1)
		batch = make([]*call, 0, 1+n)
		batch = append(batch, c)
		batch = append(batch, q.pending[:n]...)
		for _, p := range q.pending[:n] {
			p.taken = true
		}
		rest := copy(q.pending, q.pending[n:])
		clear(q.pending[rest:])
		q.pending = q.pending[:rest]
	}
	l.mu.Unlock()
	l.send(c.ctx, key, batch)
}

// finish returns the call's outcome once its batch is back. A caller whose
// context ended meanwhile gets the context's error, and anything booked for
// it is given back.
func (c *call) finish() (*Reservation, error) {
	err := c.ctx.Err()
	if err == nil {
		return c.res, c.err
	}
	if c.res != nil && c.res.OK() {
		c.res.giveBack(c.ctx, true) // the caller never had it
	}
	return nil, err
}

// send books batch (whose callers are all taken) in one call, wakes its
// callers, and hands the queue that built up meanwhile to its first caller,
// or marks the key idle. If booking panics (an Observer's panic, say), the
// batch's other callers get an error, the key is handed on all the same, so
// it cannot stall, and the panic goes on up the sender's stack.
func (l *Limiter) send(ctx context.Context, key string, batch []*call) {
	defer func() {
		if p := recover(); p != nil {
			for _, c := range batch {
				if c.res == nil && c.err == nil {
					c.err = fmt.Errorf("reserve: booking for %q panicked: %v", key, p)
				}
			}
			l.handOn(key, batch)
			panic(p)
		}
	}()
	// The batch serves callers other than the sender: the sender's
	// cancellation must not fail their call (the engine's timeout bounds it).
	// A batch of the sender alone fails no one else's: its wait for a free
	// connection, before anything is sent, ends with the sender's context.
	var bctx context.Context
	if len(batch) == 1 {
		bctx = waitbound.Detach(ctx)
	} else {
		bctx = context.WithoutCancel(ctx)
	}
	k := l.subjectKey(key)
	late := l.book(bctx, k, batch)
	after := lateAfter(late, batch)
	l.handOn(key, batch)
	l.giveBackLate(ctx, k, late, after)
}

// handOn names the first caller queued meanwhile the key's next leader,
// or marks the key idle, and wakes batch's callers and then the leader.
// Go's scheduler tends to run the goroutine woken last first where the
// sender yields, but the leader takes its batch only when it runs, so the
// callers just woken that queue again before then go in it too. The key
// stays marked busy until the leader has sent its batch and handed on in
// turn, so no other call for it goes out meanwhile.
func (l *Limiter) handOn(key string, batch []*call) {
	l.mu.Lock()
	var next *call
	if q := l.queues[key]; q == nil || len(q.pending) == 0 {
		delete(l.queues, key)
	} else {
		next = q.pending[0]
		next.taken = true
		rest := copy(q.pending, q.pending[1:])
		q.pending[rest] = nil
		q.pending = q.pending[:rest]
	}
	l.mu.Unlock()
	for _, c := range batch {
		if c.wake != nil {
			c.wake <- false // never blocks: room for one, and a leader has read its true
		}
	}
	if next != nil {
		next.wake <- true
	}
}
