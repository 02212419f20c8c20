// Package throttle is slotbook's engine: GCRA (the generic cell rate
// algorithm) in Redis, one integer per limited subject.
//
// Each key holds TAT, the theoretical arrival time of the next request, in
// whole microseconds on the Redis clock (TIME, read inside the scripts, so
// client clocks never matter), stored int-encoded with an expiry at TAT so
// idle subjects cost nothing. With I = Period/Rate (rounded up to a
// microsecond) and tau = Burst*I, booking n units with max wait W is
//
//	tat  = max(stored TAT or now, now)
//	wait = max(0, tat + (n-1)*I - tau - now)
//	wait > W:  refuse, write nothing, report wait (the exact retry-after)
//	otherwise: store tat + n*I, report wait
//
// Check mode (Allow) is booking with W = 0. BookBatch judges many requests
// for one key in one call; BookAll judges several limits of one subject
// together (their keys share a Redis Cluster hash tag); Refund gives a
// booking back as golang.org/x/time/rate's Reservation.Cancel does; Block
// holds a key back after an upstream 429; AllowWindow is an exact
// sliding-window log for small limits.
//
// Every call has a tight timeout. A call that cannot reach Redis fails with
// ErrUnavailable and opens a breaker that lets one probe through at a
// time; package reserve's fallback policies answer meanwhile. An Observer
// (package metrics has one) sees every decision and call.
//
// Most programs use package reserve on top of this one.
package throttle
