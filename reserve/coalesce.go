package reserve

import (
	"context"
	"fmt"
	"slices"
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
// the batch's own callers; the next batch waits for the batch's late
// bookings (see book), if it has any, to be given back: booked first, it
// would stand on them (awaitGiven). The leader takes whatever has queued by the
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

// keyState is the coalescing state of one key while it has callers in
// the Limiter: how many (sending, queued, or sent alone), whether a call
// of its batches is in flight, and the callers queued behind it. A key
// without callers has none in Limiter.keys; a caller alone finds one on
// the Limiter's free list (one map lookup, one insert and one delete per
// call, and no allocation).
type keyState struct {
	callers int
	busy    bool // a batch call in flight; the leader chain holds it
	pending []*call
}

// maxSpare bounds the Limiter's free list of keyStates: enough for every
// key with callers at once under a busy process, and no more.
const maxSpare = 256

// enter counts a caller of key in, and returns its key's state and how
// many other callers it has. Called with l.mu held.
func (l *Limiter) enter(key string) (*keyState, int) {
	ks := l.keys[key]
	if ks == nil {
		if n := len(l.spare); n > 0 {
			ks = l.spare[n-1]
			l.spare[n-1] = nil
			l.spare = l.spare[:n-1]
		} else {
			ks = &keyState{}
		}
		l.keys[key] = ks
	}
	ks.callers++
	return ks, ks.callers - 1
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
	ks, others := l.enter(key)
	defer l.leave(key, ks)
	if ks.busy && (others < l.soloBelow || len(ks.pending) >= l.maxQueue) {
		l.mu.Unlock()
		return l.sendAlone(key, c)
	}
	if !ks.busy {
		ks.busy = true // in flight, no one waiting
		l.mu.Unlock()
		l.send(c.ctx, key, ks, c.alone())
		return c.finish()
	}
	c.wake = make(chan bool, 1)
	ks.pending = append(ks.pending, c)
	l.mu.Unlock()

	select {
	case lead := <-c.wake:
		if lead {
			l.lead(key, ks, c)
		}
		return c.finish()
	case <-c.ctx.Done():
	}

	// Cancelled while queued: leave the queue if no batch has taken us.
	l.mu.Lock()
	if !c.taken {
		if i := slices.Index(ks.pending, c); i >= 0 {
			ks.pending = slices.Delete(ks.pending, i, i+1)
		}
		l.mu.Unlock()
		return nil, c.ctx.Err()
	}
	l.mu.Unlock()
	// Taken: our request is in a batch, or we lead the next one. Send it if
	// we lead, else wait for it; then give back anything booked for us.
	if <-c.wake {
		l.lead(key, ks, c)
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
	l.giveBackLate(c.ctx, k, l.book(waitbound.WithoutDeadline(c.ctx), k, c.alone()), nil)
	return c.finish()
}

// leave counts a caller of key out; the last one takes the key's state out
// of Limiter.keys (no call is in flight then, and no one queued: every
// leader and queued caller is a caller) and keeps it for the next key.
func (l *Limiter) leave(key string, ks *keyState) {
	l.mu.Lock()
	if ks.callers--; ks.callers == 0 {
		delete(l.keys, key)
		// Not busy, nothing queued: every leader and queued caller is a
		// caller. Checked all the same, so that a state can never carry a
		// key's marks to another.
		if !ks.busy && len(ks.pending) == 0 && len(l.spare) < maxSpare && cap(ks.pending) <= throttle.MaxBatch {
			ks.pending = ks.pending[:0]
			l.spare = append(l.spare, ks)
		}
	}
	l.mu.Unlock()
}

// lead sends, for leader c (taken by handOn), the batch of c and the
// callers queued for key by now.
func (l *Limiter) lead(key string, ks *keyState, c *call) {
	l.mu.Lock()
	batch := c.alone()
	if len(ks.pending) > 0 {
		n := min(len(ks.pending), throttle.MaxBatch-1)
		batch = make([]*call, 0, 1+n)
		batch = append(batch, c)
		batch = append(batch, ks.pending[:n]...)
		for _, p := range ks.pending[:n] {
			p.taken = true
		}
		rest := copy(ks.pending, ks.pending[n:])
		clear(ks.pending[rest:])
		ks.pending = ks.pending[:rest]
	}
	l.mu.Unlock()
	l.send(c.ctx, key, ks, batch)
}

// finish returns the call's outcome once its batch is back. A caller whose
// context ended meanwhile gets the context's error, and anything booked for
// it is given back before it returns: by book, with the batch's late
// bookings (its caller gone at the reply), or here.
func (c *call) finish() (*Reservation, error) {
	err := waitbound.Ended(c.ctx)
	if err == nil {
		return c.res, c.err
	}
	switch r := c.res; {
	case r != nil && r.OK():
		_ = r.giveBack(c.ctx, true) // the caller never had it
	case r != nil && r.late != nil && r.late.after != nil:
		<-r.late.after // the batch's give-backs, its own among them
	}
	return nil, endedErr(err, c.err)
}

// send books batch (whose callers are all taken) in one call, wakes its
// callers, and hands the queue that built up meanwhile to its first caller,
// or marks the key idle. If booking panics (an Observer's panic, say) or
// ends the goroutine (runtime.Goexit), the batch's other callers get an
// error, the key is handed on all the same, so it cannot stall, and the
// panic goes on up the sender's stack.
func (l *Limiter) send(ctx context.Context, key string, ks *keyState, batch []*call) {
	// The key is handed on once, whichever way booking ends: normally,
	// with a panic (recovered, and raised again once the key is handed on),
	// or with runtime.Goexit (an Observer calling t.FailNow, say; recover
	// gives nil then). A panic after the key is handed on (a late booking's
	// refund Observer) goes up as it is: handing on again would wake the
	// batch's callers twice and start a second leader.
	handed := false
	defer func() {
		if handed {
			return
		}
		p := recover()
		why := "ended its goroutine (runtime.Goexit)"
		if p != nil {
			why = fmt.Sprintf("panicked: %v", p)
		}
		for _, c := range batch {
			if c.res == nil && c.err == nil {
				c.err = fmt.Errorf("reserve: booking for %q %s", key, why)
			}
		}
		handed = true
		l.handOn(ks, batch)
		if p != nil {
			panic(p)
		}
	}()
	// The batch serves callers other than the sender: the sender's
	// cancellation must not fail their call (the engine's timeout bounds it).
	// A batch of the sender alone fails no one else's: its wait for a free
	// connection, before anything is sent, ends with the sender's context.
	var bctx context.Context
	if len(batch) == 1 {
		bctx = waitbound.WithoutDeadline(ctx)
	} else {
		bctx = context.WithoutCancel(ctx)
	}
	k := l.subjectKey(key)
	late := l.book(bctx, k, batch)
	// Registered before the answers go out and the next leader is named:
	// the key's next batch, and a caller of this one that books again at
	// once, wait for the late bookings to be given back (awaitGiven), on
	// which, sent first, they would stand.
	l.giveBackLate(ctx, k, late, lateAfter(late, batch))
	handed = true
	l.handOn(ks, batch)
}

// handOn names the first caller queued meanwhile the key's next leader,
// or marks the key idle, and wakes batch's callers and then the leader.
// Go's scheduler tends to run the goroutine woken last first where the
// sender yields, but the leader takes its batch only when it runs, so the
// callers just woken that queue again before then go in it too. The key
// stays marked busy until the leader has sent its batch and handed on in
// turn, so no other call for it goes out meanwhile.
func (l *Limiter) handOn(ks *keyState, batch []*call) {
	l.mu.Lock()
	var next *call
	if len(ks.pending) == 0 {
		ks.busy = false
	} else {
		next = ks.pending[0]
		next.taken = true
		rest := copy(ks.pending, ks.pending[1:])
		ks.pending[rest] = nil
		ks.pending = ks.pending[:rest]
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
