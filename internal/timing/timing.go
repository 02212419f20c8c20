// Package timing gives the module's tests a control for timing checks: how
// late plain timers fire on this machine while a test runs, so that a test
// can judge its own lateness against the machine's rather than against a
// fixed wall-clock bound a busy 2-core machine cannot keep.
package timing

import (
	"slices"
	"sync"
	"testing"
	"time"
)

// Control measures, until the function it returns is called, how late
// a plain timer fires on this machine right now, for timers of 1 to 20ms:
// a control for how late a test's clients, run alongside, may start after
// their slots without the limiter being at fault. The function returns the
// lateness of every timer, sorted.
func Control(t testing.TB) func() []time.Duration {
	t.Helper()
	var (
		done     = make(chan struct{})
		finished = make(chan struct{})
		lates    []time.Duration
		once     sync.Once
	)
	go func() {
		defer close(finished)
		for i := 0; ; i++ {
			d := time.Duration(1+i%20) * time.Millisecond
			begin := time.Now()
			timer := time.NewTimer(d)
			select {
			case <-timer.C:
				lates = append(lates, time.Since(begin)-d)
			case <-done:
				timer.Stop()
				return
			}
		}
	}()
	stop := func() []time.Duration {
		once.Do(func() { close(done); <-finished })
		slices.Sort(lates)
		return lates
	}
	t.Cleanup(func() { stop() })
	return stop
}
