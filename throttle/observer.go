package throttle

import (
	"strings"
	"time"
)

// Outcome is what became of one request.
type Outcome int

// The outcomes an Observer sees.
const (
	Allowed         Outcome = iota // check mode: passed
	Denied                         // check mode: did not pass
	Booked                         // reservation: a slot was booked
	Refused                        // reservation: the slot was too far away; nothing booked
	FallbackAllowed                // Redis unavailable: the fallback policy let it pass
	FallbackRefused                // Redis unavailable: the fallback policy refused it
)

// NoWait is the wait an Observer is told with FallbackAllowed for a
// check-mode request (Allow) that the fallback let pass: it booked no slot,
// so it has no booked wait. Every wait reported otherwise is at least 0.
const NoWait = time.Duration(-1)

var outcomeNames = [...]string{"allowed", "denied", "booked", "refused", "fallback_allowed", "fallback_refused"}

// String returns the outcome's name as used in metric labels.
func (o Outcome) String() string {
	if o < 0 || int(o) >= len(outcomeNames) {
		return "unknown"
	}
	return outcomeNames[o]
}

// An Observer is told of the engine's work; package metrics turns it into
// Prometheus metrics. Its methods are called synchronously on the request
// path, from many goroutines at once: they must be quick and safe for
// concurrent use, and must not panic: some run on goroutines of the
// library's own (a refund sent after its caller had its answer, a
// keeper's), where a panic ends the process as any goroutine's does.
// (Package reserve hands a key on to its next caller whatever a booking's
// Observer does, a panic or runtime.Goexit included.)
//
// limiter is the part of the key before its first ':' (for keys built by
// package reserve, the limiter's name). Keep it bounded: never a subject.
type Observer interface {
	// ObserveDecision reports one request's outcome; wait is the booked wait
	// for Booked, the retry-after for Denied, Refused and FallbackRefused.
	// For FallbackAllowed it is the wait of the reservation the fallback
	// admitted (booked in its local share, or 0 for FailOpen's), and NoWait
	// (negative) for a check-mode request (Allow) it let pass, which booked
	// nothing, as Allowed books nothing.
	ObserveDecision(limiter string, o Outcome, wait time.Duration)
	// ObserveCall reports one script call to Redis, with its duration and
	// error (nil on success), classified as the caller sees it: it matches
	// ErrUnavailable when Redis could not be reached, and ErrReplyLost as
	// well when the call was sent but its reply never came (it may have
	// taken effect). Calls refused at once by the open breaker are not
	// reported.
	ObserveCall(limiter string, d time.Duration, err error)
	// ObserveRefund reports a refund and how much time it gave back (the
	// most it gave any of the booking's limits). A refund whose reply was
	// lost is reported by its retry (the documented safe retry, which
	// itself gives nothing): with the time the lost attempt gave back,
	// read from its tombstone, once, if the retry comes before the
	// booking's slot (the tombstone lives until then; reserve's Cancel
	// makes no call once the slot has come); any other call for a booking
	// already given back is reported as giving 0. A lost refund never
	// retried, or retried only after the slot, is not reported here
	// (ObserveCall reports its ErrReplyLost).
	ObserveRefund(limiter string, given time.Duration)
	// ObserveBreaker reports the engine's first breaker opening (a Redis
	// node unavailable: calls for its subjects fail fast or go to the
	// fallback) and its last one closing (shared limiting restored
	// everywhere). The engine keeps one breaker per Redis node (see
	// NodeObserver); with a plain client there is one. Changes are
	// reported in the order they happen.
	ObserveBreaker(open bool)
}

// A NodeObserver is an Observer that is also told which Redis node's
// breaker opened or closed: the address of a plain client, of the master
// owning the key's slot for a Cluster ("cluster" while its slot map cannot
// be read), of the shard the key goes to for a Ring ("redis" while it has
// no shard up), or "redis" for another kind of client. The engine calls
// ObserveNodeBreaker, if its Observer has it, for every change of every
// node's breaker, under the breaker's lock: for each node, openings and
// closings arrive in the order they happened and alternate, starting with
// an opening. Like the Observer's methods it must be quick.
type NodeObserver interface {
	Observer
	ObserveNodeBreaker(node string, open bool)
}

// nopObserver is used when none is set.
type nopObserver struct{}

func (nopObserver) ObserveDecision(string, Outcome, time.Duration) {}
func (nopObserver) ObserveCall(string, time.Duration, error)       {}
func (nopObserver) ObserveRefund(string, time.Duration)            {}
func (nopObserver) ObserveBreaker(bool)                            {}

// label is the observer label of key.
func label(key string) string {
	name, _, _ := strings.Cut(key, ":")
	return name
}
