package pool

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
