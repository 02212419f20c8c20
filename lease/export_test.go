package lease

// SetMaxWakeLists sets the most lists one blocking read of s's waker names
// (maxWakeLists). Call it before s has waiters.
func SetMaxWakeLists(s *Semaphore, n int) {
	if s.waker != nil {
		s.waker.max = n
	}
}
