package reserve

// Test hooks, compiled only into this package's tests.

// SetMaxQueue sets how many callers may queue for one key of l.
func SetMaxQueue(l *Limiter, n int) { l.maxQueue = n }

// SetSoloBelow sets how few callers of a key of l send alone while a call
// is in flight (1: none do; callers queue behind any call in flight).
func SetSoloBelow(l *Limiter, n int) { l.soloBelow = n }

// QueueLen returns how many callers are queued for subject key of l.
func QueueLen(l *Limiter, key string) int {
	l.mu.Lock()
	defer l.mu.Unlock()
	if ks := l.keys[key]; ks != nil {
		return len(ks.pending)
	}
	return 0
}

// Instances returns how many processes l's local share divides its limits
// by: assumed, or the count learned from the latest heartbeat.
func Instances(l *Limiter) int64 { return l.fallback.instances.Load() }

// KeyStates returns how many keys of l hold coalescing state, and how many
// spare states l keeps for reuse.
func KeyStates(l *Limiter) (live, spare int) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return len(l.keys), len(l.spare)
}
