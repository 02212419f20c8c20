package pool

import (
	"cmp"
	"container/heap"
	"context"
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/slotbook/slotbook/deadline"
	"github.com/slotbook/slotbook/reserve"
	"github.com/slotbook/slotbook/throttle"
)

// dispatch is the pool's goroutine that decides. Each time it wakes (on
// any change of state, at the next slot or retry time, or at Close) it
// looks at the whole state and, in this order: takes the bookings of
// cancelled jobs to give back and sends them off to be given back on a
// goroutine of its own (giveBack; their keys are not booked again until
// that is done), starts the jobs whose slot has come, and sends one batch
// off to be booked on a goroutine of its own (book), one batch per key at
// a time and up to maxFlights at once, so that many keys are booked side
// by side (and share Redis calls, see throttle.WithMerging). Once closed,
// it waits for the batches in flight, gives back what is booked, waits
// for the give-backs and returns.
func (p *Pool) dispatch() {
	defer p.wg.Done()
	timer := time.NewTimer(time.Hour)
	defer timer.Stop()
	for {
		p.mu.Lock()
		now := time.Now()
		refunds := p.takeRefundsLocked(now)
		p.startDueLocked(now)
		var (
			key    string
			batch  []*Job
			wakeAt time.Time
			// Closed, every booking taken (see takeRefundsLocked), no
			// booking call in flight, the pool's or an Acquire caller's
			// (one that lands is given back), no caller sleeping until
			// its slot (Close ends it, its booking owed) and no
			// give-back under way.
			stopped = p.closed && len(refunds) == 0 && len(p.flying) == 0 && len(p.giving) == 0 &&
				len(p.calling) == 0 && len(p.callers) == 0
			// Once closed, quit is always ready: wait for what wakes the
			// dispatcher (a batch's answers) instead.
			quit = p.quit
		)
		if p.closed {
			quit = nil
		}
		if len(refunds) == 0 {
			key, batch, wakeAt = p.takeBatchLocked(now)
		}
		if len(batch) > 0 && p.sem == nil {
			p.sendingLocked(key, batch) // until book has the answers
		}
		if len(p.slots) > 0 {
			wakeAt = earliest(wakeAt, p.slots[0].act)
		}
		p.mu.Unlock()

		switch {
		case len(refunds) > 0:
			// On a goroutine of its own, so that other keys are booked and
			// started meanwhile; the keys given back are not (giving).
			p.wg.Add(1)
			go func() {
				defer p.wg.Done()
				p.giveBack(refunds)
			}()
			continue
		case len(batch) > 0 && p.sem != nil:
			p.leaseAndBook(key, batch) // lease first, then the slot: see WithLease
			continue
		case len(batch) > 0:
			p.wg.Add(1)
			go func() {
				defer p.wg.Done()
				p.book(key, batch)
			}()
			continue
		case stopped:
			return
		}
		if wakeAt.IsZero() {
			timer.Stop()
		} else {
			timer.Reset(time.Until(wakeAt))
		}
		select {
		case <-p.wake:
		case <-timer.C:
		case <-quit:
		}
	}
}

// earliest returns the earlier of a and b, where the zero Time is "never".
func earliest(a, b time.Time) time.Time {
	if a.IsZero() || (!b.IsZero() && b.Before(a)) {
		return b
	}
	return a
}

// takeRefundsLocked finds the bookings to give back now (see refundable),
// moves their booked jobs to refunding, their bookings forgone (see
// forgoLocked), and returns them with the owed ones among them, the latest
// booking first, for giveBack. A booked job whose context has ended but
// whose booking cannot be given back yet (a later booking on its key
// still stands) is done at once, with its context's error; its booking is
// owed, and given back once the later ones are. A booking refused late
// (see book) is owed too, its job refunding until it is given back or
// handed down. No one acted on an owed booking, so it is not forgotten
// when its slot comes: its Cancel gives its room back whenever nothing
// stands on it, until its units have lapsed (see lapsed; a late refusal's
// job is then done with its refusal). p.mu is held.
func (p *Pool) takeRefundsLocked(now time.Time) []*Job {
	p.owed = slices.DeleteFunc(p.owed, func(j *Job) bool {
		// A late refusal's held booking (not OK) gives its room back even
		// once its slot has come, for no one acted on it: it stays owed,
		// until its units have lapsed.
		if j.res.OK() && !j.act.After(now) && !j.at.After(now) || lapsed(j, now) {
			if j.state == refunding {
				p.moveLocked(j, done, j.err)
			}
			return true
		}
		return false
	})
	p.handDownLocked(now)
	give, owe := refundable(p.slots, p.callers, p.owed, p.closed, func(key string) bool {
		return p.flying[key] > 0 || p.calling[key] > 0 || p.giving[key] > 0
	})
	defer p.gave.Broadcast() // lease goroutines waiting on owed bookings look again
	p.owed = slices.DeleteFunc(p.owed, func(j *Job) bool { return slices.Contains(give, j) })
	for _, j := range give {
		if j.state == booked {
			p.forgoLocked(j)
			p.moveLocked(j, refunding, endErr(j))
		}
		p.giving[j.key]++ // until giveBack is done: no booking of the key meanwhile
	}
	for _, j := range owe {
		if j.state == booked {
			p.forgoLocked(j)
			p.moveLocked(j, refunding, endErr(j))
			p.owed = append(p.owed, j)
		}
		p.moveLocked(j, done, j.err)
	}
	return give
}

// handDownLocked hands the slots of a key that will not be used (those of
// booked jobs whose context has ended, and owed bookings) down to the
// key's later booked jobs that are still wanted, and to Acquire callers
// sleeping until their slot (callers, woken through moved), in their
// order, so that the wanted ones hold the key's earliest slots and the
// rest lie above them, for refundable to give back in full once the key
// is not busy. A slot left under a wanted booking would give nothing back
// and pass unused once that one runs. Only slots that have not come
// change hands, by the booking's own reply and by the receiving job's (a
// slot passed unused is not run late; see handedStart for when a handed
// slot starts), and only bookings made in Redis (see handable), a late
// refusal's held booking among them (a wanted job handed one claims it):
// every slot a job runs in was booked, for one unit (the pool's every
// request, and every Acquire caller's), by this pool, for a job or caller
// that did not act in it.
// An owed booking handed on is replaced by one that belongs to no job
// (its job is done, or, refused late, done now; a done job's fields are
// read without the lock). p.mu is held.
func (p *Pool) handDownLocked(now time.Time) {
	if p.closed || !slices.ContainsFunc(p.slots, func(j *Job) bool { return j.ctx.Err() != nil }) && !slices.ContainsFunc(p.owed, func(j *Job) bool { return handable(j, now) }) {
		return
	}
	type slot struct {
		j      *Job
		owed   int  // its index in p.owed, or -1 for a booked job
		wanted bool // as looked at once
		// the booking it holds
		res     *reserve.Reservation
		at, act time.Time
		seq     uint64
	}
	byKey := make(map[string][]slot)
	for _, j := range p.slots {
		if handable(j, now) {
			byKey[j.key] = append(byKey[j.key], slot{j: j, owed: -1, wanted: j.ctx.Err() == nil, res: j.res, at: j.at, act: j.act, seq: j.seq})
		}
	}
	for i, j := range p.owed {
		if handable(j, now) {
			byKey[j.key] = append(byKey[j.key], slot{j: j, owed: i, res: j.res, at: j.at, act: j.act, seq: j.seq})
		}
	}
	for _, j := range p.callers { // wanted until the caller acts, or forgoes its booking
		if handable(j, now) {
			byKey[j.key] = append(byKey[j.key], slot{j: j, owed: -1, wanted: true, res: j.res, at: j.at, act: j.act, seq: j.seq})
		}
	}
	moved := false
	for _, ss := range byKey {
		slices.SortFunc(ss, func(a, b slot) int { return byBooking(a.j, b.j) })
		// holder[k] is the slot (of ss) now taking ss[k]'s booking, or -1
		// while it is free: at first each wanted job holds its own, and
		// the others' are free. Each wanted job in turn, the earliest
		// first, moves to the earliest free booking below its own.
		holder := make([]int, len(ss))
		for k, s := range ss {
			holder[k] = -1
			if s.wanted {
				holder[k] = k
			}
		}
		for w, s := range ss {
			if !s.wanted {
				continue
			}
			for k := range w {
				// A booking whose slot has passed, as the job's own reply
				// tells the Redis clock, is not run late (its own, slower,
				// reply may say it has not come).
				if holder[k] < 0 && handedStart(ss[k].at, ss[k].act, s.at, s.act).After(now) {
					holder[k], holder[w] = w, -1
					break
				}
			}
		}
		// The others take the bookings left free, in order.
		k := 0
		for i, s := range ss {
			if s.wanted {
				continue
			}
			for holder[k] >= 0 {
				k++
			}
			holder[k] = i
		}
		for k, i := range holder {
			s, to := ss[i], ss[k]
			if s.res == to.res {
				continue
			}
			j := s.j
			res := to.res
			if s.owed >= 0 {
				res, _ = forgo(res, endErr(j)) // a wanted job's own booking, which it never acted on
			}
			switch {
			case s.owed >= 0:
				if j.state == refunding {
					// A late refusal's: the job is done, its booking
					// another's now.
					p.moveLocked(j, done, j.err)
				}
				j = noOnes(j)
				p.owed[s.owed] = j
			case !s.wanted && !res.OK():
				// A cancelled job left a late refusal's booking to give
				// back: it is done now, its Reservation its own booking
				// (handed on), not the refusal, and the refusal's booking
				// is owed by no job's.
				p.moveLocked(j, refunding, endErr(j))
				p.moveLocked(j, done, j.err)
				j = noOnes(j)
				p.owed = append(p.owed, j)
			}
			if s.wanted && !res.OK() {
				// A late refusal's booking, held for the pool: the job
				// acts in its slot. It is claimed once: its holder takes
				// another booking here.
				res = res.Claim()
			}
			j.res, j.at, j.act, j.seq = res, to.at, to.act, to.seq
			if s.wanted {
				j.act = handedStart(to.at, to.act, s.at, s.act)
				if res != nil && res.OK() {
					// No later than its Reservation says, as Job.Slot's doc
					// has it. Only a late refusal's booking, claimed, can
					// be later otherwise: its to.act counts from the
					// pool's reading after the reply (see book), a few µs
					// after reserve's.
					j.act = earliest(j.act, res.SlotAt())
				}
			}
			if j.caller {
				select { // it sleeps until the new slot
				case j.moved <- struct{}{}:
				default:
				}
			}
			moved = true
		}
	}
	if moved {
		heap.Init(&p.slots)
	}
}

// byBooking orders two bookings as they stand on their key: by slot on
// the Redis clock, which a later booking of a key never has earlier, then
// by Redis's own order (throttle.Booking.Before: bookings of one burst
// share a slot, and with WithLease the replies of one key's calls reach
// the pool in any order), then by order of booking (seq).
func byBooking(a, b *Job) int {
	if c := a.at.Compare(b.at); c != 0 {
		return c
	}
	if a.res != nil && b.res != nil {
		ab, bb := a.res.Booking(), b.res.Booking()
		switch {
		case ab.Before(bb):
			return -1
		case bb.Before(ab):
			return 1
		}
	}
	return cmp.Compare(a.seq, b.seq)
}

// handedStart is the local start of a booking (slot at on the Redis
// clock, local start act) handed to a job whose own booking had slot
// ownAt and local start ownAct. Each reply bounds the Redis clock at any
// later local time (it had reached the decision when the reply came), so
// the start may count from either reply: the booking's, or the job's,
// whichever says earlier. (Counted from the booking's alone, a job handed
// an earlier slot whose reply was slower would start later than at its
// own.) It keeps ownAct's monotonic clock reading: slot times on the Redis
// clock have none.
func handedStart(at, act, ownAt, ownAct time.Time) time.Time {
	return earliest(act, ownAct.Add(at.Sub(ownAt)))
}

// forgoLocked turns the booking of j, a booked job that will not run (its
// context ended, or the pool closed), into a held one (reserve's
// Reservation.Forgo): no one acted on it, so it gives its room back even
// once its slot has come, as a late refusal's does. (Booked with its slot
// come, the job's context may end before the dispatcher starts it.) p.mu
// is held.
func (p *Pool) forgoLocked(j *Job) {
	if f, ok := forgo(j.res, endErr(j)); ok {
		j.res, j.forgone = f, true
	}
}

// forgo returns res forgone (reserve's Reservation.Forgo) with err, and
// true, or res itself, and false, where it cannot be (not OK: held
// already; or a fallback's answer).
func forgo(res *reserve.Reservation, err error) (*reserve.Reservation, bool) {
	if f := res.Forgo(err); f != nil {
		return f, true
	}
	return res, false
}

// noOnes returns a Job that holds no job's booking (the caller sets it) of
// j's key, done: an owed booking whose job is done or another's now, or a
// record in stood. Its context gives the give-back its values.
func noOnes(j *Job) *Job {
	return &Job{key: j.key, ctx: j.ctx, state: done, index: -1}
}

// lapsed reports whether the units of j's booking no longer stand in front
// of its key (throttle.Booking.End), so that giving it back, by any way,
// would give nothing: by the local time at which its end comes, counted
// as its slot's is, and by the end itself, in case the booking was made on
// a clock ahead of the local one.
func lapsed(j *Job, now time.Time) bool {
	end := j.res.Booking().End()
	return !end.IsZero() && !j.act.Add(end.Sub(j.at)).After(now) && !end.After(now)
}

// handable reports whether j's booking (a booked job's, or an owed one)
// may change hands: a booking made in Redis (not a fallback's local one,
// which is no slot of the shared limit), OK or held for a late refusal,
// whose slot has not come.
func handable(j *Job, now time.Time) bool {
	return j.res != nil && j.res.Booking().OK && !j.res.Fallback() && j.act.After(now)
}

// endErr is the outcome of a booked job that will not run.
func endErr(j *Job) error {
	if err := j.ctx.Err(); err != nil {
		return err
	}
	return ErrClosed
}

// refundable sorts out the bookings that will not be used: those of the
// booked jobs (slots) whose context has ended (all of them, once the pool is
// closed) and those owed. give are the ones to give back now, the latest
// first; owe, the booked ones to keep owing. callers are the records of
// Acquire callers' bookings (see Pool.acquireSlot): wanted, even once the
// pool is closed, and never given back here.
//
// A booking gives its room back only while no later booking stands on its
// key. So for each key, going from its latest booking back (by slot on the
// Redis clock, which a later booking of a key never has earlier, then by
// order of booking), give takes bookings until one that is still wanted
// (a job's whose context has not ended, or a caller's); that one and every
// booking before it stay: the unwanted among them are owed (owe), to be
// given back once everything after them is. A busy key (a booking call
// in flight, the pool's or an Acquire caller's, which may book after them;
// or bookings being given back, which must reach Redis first) counts as
// wanted above all its bookings.
// Contexts shared by many jobs end at once, and a parent's children one
// by one; either way what give takes is given back in full, and the rest
// at a later look, after it. Taking an earlier booking while a later one
// stands would give nothing back (and leave the earlier one's tombstone,
// so it never could), and nor would any booked before it.
func refundable(slots, callers, owed []*Job, closed bool, busy func(key string) bool) (give, owe []*Job) {
	if !closed && len(owed) == 0 && !slices.ContainsFunc(slots, func(j *Job) bool { return j.ctx.Err() != nil }) {
		return nil, nil // the common case: nothing to give back, nothing sorted
	}
	js := slices.Concat(slots, callers, owed)
	// By key, the latest booking first.
	slices.SortFunc(js, func(a, b *Job) int { return cmp.Or(cmp.Compare(a.key, b.key), byBooking(b, a)) })
	wanted := false // a booking of this key, later than j, is still wanted
	for i, j := range js {
		if i == 0 || j.key != js[i-1].key {
			wanted = busy(j.key)
		}
		switch {
		case j.caller || j.state == booked && !closed && j.ctx.Err() == nil:
			wanted = true
		case !wanted:
			give = append(give, j)
		case j.state == booked || j.state == refunding: // refunding: refused late, not yet done
			owe = append(owe, j)
		}
	}
	// Across keys too, the latest first, in the same order as each key's
	// (by seq alone, a key whose calls came back out of order, as lease
	// goroutines' can, would give an earlier booking back first).
	slices.SortStableFunc(give, func(a, b *Job) int { return byBooking(b, a) })
	return give, owe
}

// giveBack gives back the bookings of js in order (of each key, the
// latest first, as refundable sorts them), then ends each job still
// refunding with the error it was given (an owed one is done).
func (p *Pool) giveBack(js []*Job) {
	for _, j := range js {
		// The job's context has ended: keep its values, not its end. A
		// give-back that fails does not stop the ones under it: its reply
		// may be lost with its refund run (a slow Redis), and theirs then
		// give their room back.
		ctx, cancel := context.WithTimeout(context.WithoutCancel(j.ctx), time.Second)
		_ = j.res.Cancel(ctx)
		cancel()
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, j := range js {
		if j.state == refunding {
			p.moveLocked(j, done, j.err)
		}
		if p.giving[j.key]--; p.giving[j.key] == 0 {
			delete(p.giving, j.key)
		}
	}
	p.gave.Broadcast()
	p.nudge()
}

// startDueLocked starts the booked jobs whose slot has come. p.mu is held.
func (p *Pool) startDueLocked(now time.Time) {
	for len(p.slots) > 0 && !p.slots[0].act.After(now) {
		j := p.slots[0]
		p.moveLocked(j, running, nil)
		p.actedLocked(j)
	}
}

// actedLocked is for j, a job just started or an Acquire caller's record
// whose caller has just acted: j now stands on its booking for good. The
// owed bookings under it are forgotten, a held one of its slot traded
// with it (forgetUnderLocked), and while a call of its key sent before
// flies, a record of its booking is kept in stood (a copy of a job's; a
// caller's record itself), for a late refusal that call may bring back
// under it (tradeUnderLocked). p.mu is held.
func (p *Pool) actedLocked(j *Job) {
	p.forgetUnderLocked(j)
	if len(p.aloft[j.key]) == 0 || !j.res.Booking().OK {
		return
	}
	s := j
	if j.state != done { // a job, which goes on
		s = noOnes(j)
		s.res, s.at, s.act, s.seq = j.res, j.at, j.act, j.seq
	}
	s.flight = p.sent
	p.stood[j.key] = append(p.stood[j.key], s)
}

// tradeLocked trades the held booking of o, a late refusal's (owed),
// for the booking of s, a started job's (or its record in stood), of the
// same slot that stands on o's (see reserve.Reservation.Trade): s now
// stands on o's booking, and o's place among the owed bookings is taken
// by s's own, held as o's was, to be given back once nothing wanted
// stands on it. Without it o's room would be lost: it lies under s's,
// which ran. It reports whether they traded. p.mu is held.
func (p *Pool) tradeLocked(o, s *Job) bool {
	claimed, spare := o.res.Trade(s.res)
	if claimed == nil {
		return false
	}
	i := slices.Index(p.owed, o)
	if o.state == refunding {
		p.moveLocked(o, done, o.err) // refused late: done with its refusal
	}
	sp := noOnes(s)
	sp.res, sp.at, sp.act, sp.seq = spare, s.at, s.act, s.seq
	p.owed[i] = sp
	s.res, s.seq = claimed, o.seq
	return true
}

// tradeUnderLocked trades o, a late refusal's booking just owed, with the
// latest booking of a started job of its key that stands on it with the
// same slot, if any (see tradeLocked). p.mu is held.
func (p *Pool) tradeUnderLocked(o *Job) {
	ss := p.stood[o.key]
	var top *Job
	for _, s := range ss {
		if s.at.Equal(o.at) && byBooking(o, s) < 0 && (top == nil || byBooking(s, top) > 0) {
			top = s
		}
	}
	if top != nil {
		p.tradeLocked(o, top)
	}
}

// sendingLocked counts a booking call of key for batch (a lease
// goroutine's job alone, or a batch without leases) in flight, and
// numbers it (flight), until landedLocked. p.mu is held.
func (p *Pool) sendingLocked(key string, batch []*Job) {
	p.flying[key]++
	n := p.calledLocked(key)
	for _, j := range batch {
		j.flight = n
	}
}

// calledLocked numbers a booking call of key, the pool's or an Acquire
// caller's, and counts it aloft until landedLocked: records of the
// bookings started on while it flies are kept (stood), for a late refusal
// it brings back. p.mu is held.
func (p *Pool) calledLocked(key string) uint64 {
	n := p.sent
	p.sent++
	p.aloft[key] = append(p.aloft[key], n)
	return n
}

// landedLocked takes call n of key off the calls in flight,
// and drops the records of started jobs' bookings (stood) that no call
// still in flight was sent before: a call sent after a job started is
// booked in Redis after it, so nothing it books lies under the job's.
// p.mu is held.
func (p *Pool) landedLocked(key string, n uint64) {
	aloft := slices.DeleteFunc(p.aloft[key], func(m uint64) bool { return m == n })
	if len(aloft) == 0 {
		delete(p.aloft, key)
		delete(p.stood, key)
		return
	}
	p.aloft[key] = aloft
	stood := slices.DeleteFunc(p.stood[key], func(s *Job) bool { return s.flight <= aloft[0] })
	if len(stood) == 0 {
		delete(p.stood, key)
	} else {
		p.stood[key] = stood
	}
}

// forgetUnderLocked drops the owed bookings of j's key under j's, which
// j, started, now stands on for good: none of them can give anything
// back (a late refusal's held booking would otherwise wait for j to start
// and then be sent, for nothing). First, j trades its booking for the
// earliest late refusal's held booking of the same slot under it, if
// there is one (see tradeLocked): j then stands on that one, and its own
// is owed. Only bookings made in Redis, under one made in Redis: a
// fallback's local booking (its slot the zero Time, so first by
// byBooking) stands on no key in Redis, nor one of Redis on its local
// limiter. A late refusal's job is done with its refusal. p.mu is held.
func (p *Pool) forgetUnderLocked(j *Job) {
	if len(p.owed) == 0 || !j.res.Booking().OK {
		return
	}
	var low *Job
	for _, o := range p.owed {
		if o.key == j.key && !o.res.OK() && o.at.Equal(j.at) && byBooking(o, j) < 0 && (low == nil || byBooking(o, low) < 0) {
			low = o
		}
	}
	if low != nil {
		p.tradeLocked(low, j)
	}
	p.owed = slices.DeleteFunc(p.owed, func(o *Job) bool {
		if o.key != j.key || !o.res.Booking().OK || byBooking(o, j) >= 0 {
			return false
		}
		if o.state == refunding {
			p.moveLocked(o, done, o.err)
		}
		return true
	})
}

// takeBatchLocked picks the next batch to book, if the workers allow one:
// up to the key's share of the free workers, from the first key in turn
// whose jobs have not been refused by the max wait too recently. It moves
// the jobs to booking and returns them with their key. If every key is
// waiting out a max-wait refusal, it returns when the first may be tried
// again. p.mu is held.
func (p *Pool) takeBatchLocked(now time.Time) (key string, batch []*Job, retryAt time.Time) {
	if p.closed || p.free == 0 {
		return "", nil, time.Time{}
	}
	if len(p.slots) > p.lowBooked && p.free < p.batchMin {
		return "", nil, time.Time{} // enough booked; wait to book many at once
	}
	if p.sem == nil && len(p.flying) >= p.maxFlights {
		return "", nil, time.Time{} // a batch coming back wakes the dispatcher
	}
	for n := p.turns.Len(); n > 0 && p.turns.Len() > 0; n-- {
		q := p.turns.Front().Value.(*keyQueue)
		p.turns.MoveToBack(q.turn)
		if p.giving[q.key] > 0 || (p.sem == nil && p.flying[q.key] > 0) {
			continue // one batch of a key at a time, and none while its bookings go back: either wakes the dispatcher when done
		}
		if q.notBefore.After(now) {
			retryAt = earliest(retryAt, q.notBefore)
			continue
		}
		// Share the free workers between the keys waiting for them.
		share := max(1, (p.free+p.turns.Len()-1)/p.turns.Len())
		want := min(q.jobs.Len(), throttle.MaxBatch, share)
		for len(batch) < want && q.jobs.Len() > 0 {
			j := q.jobs.Front().Value.(*Job)
			if err := j.ctx.Err(); err != nil {
				p.moveLocked(j, done, err) // may remove q
				continue
			}
			p.moveLocked(j, booking, nil)
			batch = append(batch, j)
		}
		if len(batch) > 0 {
			return q.key, batch, time.Time{}
		}
	}
	return "", nil, retryAt
}

// maxFlights is the most batches a pool without leases has in flight at
// once (each for a key of its own).
const maxFlights = 64

// book books batch for key in one Redis call and moves each job on by its
// answer. The caller has counted the call in flight for key (flying),
// which book undoes with the answers: meanwhile the dispatcher gives no
// booking of key back, and does not return.
func (p *Pool) book(key string, batch []*Job) {
	reqs := make([]reserve.BatchRequest, len(batch))
	for i, j := range batch {
		// A booking made late by the reply's latency is the pool's to
		// give back, with any others, latest first (see refundable).
		reqs[i] = reserve.BatchRequest{Context: j.ctx, N: 1, HoldLate: true}
	}
	// Not a job's context: one job's cancellation must not fail the
	// others' call, nor Close lose a reply that may have booked (the
	// engine's timeout bounds the call).
	rs, err := p.lim.ReserveBatch(context.Background(), key, reqs)
	if err == nil && len(rs) != len(batch) {
		err = fmt.Errorf("pool: %d answers to a batch of %d", len(rs), len(batch))
	}
	if p.afterReply != nil {
		for _, j := range batch {
			p.afterReply(j.ctx)
		}
	}
	now := time.Now()
	maxWait, _ := p.lim.MaxWait()

	p.mu.Lock()
	defer p.mu.Unlock()
	if p.flying[key]--; p.flying[key] == 0 {
		delete(p.flying, key)
	}
	defer p.landedLocked(key, batch[0].flight) // once its answer has been looked at
	var retryAt time.Time
	// Backwards, so that jobs going back to the front of the backlog keep
	// their order.
	for i := len(batch) - 1; i >= 0; i-- {
		j := batch[i]
		if err != nil {
			p.moveLocked(j, done, err)
			continue
		}
		r := rs[i]
		switch {
		case r.OK():
			// If its context has ended meanwhile, or the pool closed, the
			// dispatcher gives it back next.
			j.res, j.at, j.act = r, r.Booking().At, r.SlotAt()
			j.seq = p.bookings + uint64(i)
			p.moveLocked(j, booked, nil)
		case errors.Is(r.Err(), deadline.ErrMaxWaitExceeded) && j.ctx.Err() == nil && !p.closed:
			// Not yet rather than never: back to the backlog, and the key
			// rests until the slot would fit in the max wait.
			p.moveLocked(j, queued, nil)
			retryAt = earliest(retryAt, now.Add(r.RetryAfter()-maxWait))
		default:
			j.res = r
			if b := r.Booking(); b.OK {
				// Refused, late, yet booked: its booking is the pool's to
				// give back, latest first with the others of its key,
				// before the job is done; or, under a later booking still
				// wanted, owed, and the job done at once (see
				// takeRefundsLocked). Its slot comes locally no earlier
				// than reserve would have it (the reply was in before now).
				j.seq, j.at, j.act = p.bookings+uint64(i), b.At, now.Add(b.Wait)
				p.moveLocked(j, refunding, r.Err())
				p.owed = append(p.owed, j)
				p.tradeUnderLocked(j) // a job started on top of it
				break
			}
			p.moveLocked(j, done, outcome(j, r, p.closed))
		}
	}
	p.bookings += uint64(len(batch))
	if q := p.queues[key]; q != nil && !retryAt.IsZero() {
		q.notBefore = retryAt
	}
}

// outcome is the error of a job whose request r was refused and that will
// not be tried again.
func outcome(j *Job, r *reserve.Reservation, closed bool) error {
	if !errors.Is(r.Err(), deadline.ErrMaxWaitExceeded) {
		return r.Err() // refused by the deadline, or by the fallback
	}
	if err := j.ctx.Err(); err != nil {
		return err
	}
	if closed {
		return ErrClosed
	}
	return r.Err()
}
