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
// booking back, once, and only while nothing booked after it stands on it,
// so that a refund can never let anything through early; Block holds a key
// back after an upstream 429, and no refund undoes it; Reset clears a
// subject; AllowWindow is an exact sliding-window log for small limits.
//
// A stored value the engine did not write (not an integer count of
// microseconds up to 2^53, or further ahead than MaxHorizon plus the
// limit's burst) is an error matching ErrCorruptState that names the key.
//
// Every call has a tight timeout. Errors come in three classes:
//
//	ErrUnavailable alone           nothing reached Redis (dial failed, no pooled
//	                               connection, breaker open, LOADING/BUSY...):
//	                               nothing happened; the breaker opens
//	ErrUnavailable + ErrReplyLost  sent, but the reply never came (timeout,
//	                               broken connection): the script may have run
//	anything else                  Redis answered with an error (ErrCorruptState,
//	                               WRONGTYPE, NOPERM...): returned as is, the
//	                               breaker stays closed
//
// While the breaker is open calls fail at once, and one probe at a time
// checks whether Redis is back; package reserve's fallback policies answer
// meanwhile. An Observer (package metrics has one) sees every decision and
// call.
//
// Most programs use package reserve on top of this one.
package throttle
