package pool

import "context"

// BacklogKeys returns how many keys the pool keeps backlog and turn
// bookkeeping for, for tests that check it is bounded by the keys with
// backlog.
func BacklogKeys(p *Pool) int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return max(len(p.queues), p.turns.Len())
}

// AcquireWaiters returns how many Acquire callers wait for a worker.
func AcquireWaiters(p *Pool) int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.waiters.Len()
}

// SetSerial makes p book one batch at a time, as it did before batches of
// different keys went side by side: for tests that hold the dispatcher in
// a batch call of a key of its own (stall). Call it before submitting.
func SetSerial(p *Pool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.maxFlights = 1
}

// SetAfterReply makes p call f, in book, with the context of each job of
// a batch once the batch's reply is in and before the pool looks at it:
// for tests that hold one job's reply back while others go on. Call it
// before submitting.
func SetAfterReply(p *Pool, f func(ctx context.Context)) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.afterReply = f
}

// Stood returns how many records of started jobs' bookings p keeps for
// late refusals still in flight (WithLease), and how many keys have
// booking calls in flight.
func Stood(p *Pool) (records, keysAloft int) {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, ss := range p.stood {
		records += len(ss)
	}
	return records, len(p.aloft)
}

// Booked returns how many jobs of p are booked (waiting for their slot).
func Booked(p *Pool) int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return len(p.slots)
}

// Owing returns how many bookings p still owes or is giving back.
func Owing(p *Pool) int {
	p.mu.Lock()
	defer p.mu.Unlock()
	n := len(p.owed)
	for _, g := range p.giving {
		n += g
	}
	return n
}

// Callers returns how many Acquire callers of p sleep until their slot.
func Callers(p *Pool) int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return len(p.callers)
}
