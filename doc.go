// Package slotbook lets many worker processes share one outbound rate limit
// through Redis without stampedes.
//
// A worker books the next free slot of the shared quota with one Redis call
// (a GCRA script that keeps one integer per subject), is told exactly how
// long to wait, sleeps, and goes. If the slot would land past the worker's
// context deadline, or past a configured max wait, the request is refused at
// once and books nothing. Nobody retries into a wall of denials: twenty
// workers sharing 10 requests per second cost one Redis call per request
// instead of about eighteen.
//
// Start from package reserve:
//
//	eng, _ := throttle.New(rdb)                       // rdb: any go-redis client
//	lim, _ := reserve.New(eng, "stripe", throttle.PerSecond(10, 5),
//		reserve.WithMaxWait(2*time.Second))
//	if err := lim.Acquire(ctx, "tenant-42"); err != nil {
//		return err // refused at once (errors.Is reserve.ErrMaxWaitExceeded), or ctx done
//	}
//	callStripe()
//
// The packages, from the bottom up:
//
//   - throttle: the engine. Limits, the Lua scripts, check mode (Allow),
//     booking, batch booking and refunds.
//   - deadline: how long a request may wait, from its context deadline, a
//     cap and the work still to do; the refusal errors.
//   - reserve: the Limiter most users hold: Allow, Reserve, Acquire.
//
// This package itself holds only documentation and the end-to-end tests.
package slotbook
