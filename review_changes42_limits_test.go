//go:build slotbook_known_limits

package slotbook_test

// Known limits, not run by the suite (go test -tags slotbook_known_limits
// -run TestReviewCHPoolClose .): helper-113's tests of a pool closed while
// Redis answers slower than a second. A give-back has one second, dial
// and handshake included, whatever the engine's timeout; a reply that
// comes later is lost with its connection, and the next give-back must
// dial again within its own second. So with replies of 1.2 s, or of
// 700 ms with a new connection to make, the bookings not started at Close
// are not given back: their room is wasted (never exceeded) until they
// lapse. Giving give-backs the engine's timeout instead (e606580) passed
// both, but made Wait cut short, and Close, wait the engine's whole
// timeout, and was reverted. Both tests fail on the code as it is.

import (
	"slices"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
)

// TestReviewCHPoolCloseSlowReplyDropsGiveBacks (FAILS): Redis answers every
// call in 1.2 s, within the engine's timeout (3 s); bookings work. Close
// gives back the three bookings of key a that did not run, latest first.
// The first refund runs in Redis at once, but its reply comes after the
// give-back's second: the closed pool takes that as "Redis is not
// answering" and drops the other two, which Redis would have run (before
// 09df90d each was sent, and its refund ran though its reply was late).
// Two intervals (10 s) of room are lost, against none with Redis healthy.
func TestReviewCHPoolCloseSlowReplyDropsGiveBacks(t *testing.T) {
	ctl := chSlowClose(t, 0, chScene{name: "healthy (control)"})
	// Three times: a give-back whose failure escapes the rule (see
	// TestReviewCHPoolClosePausedDuration) lets the next ones go out.
	var lost []time.Duration
	for i := range 3 {
		l := chSlowClose(t, 1+i, chScene{name: "1.2s replies", reply: 1200 * time.Millisecond})
		lost = append(lost, time.Duration(l)*time.Microsecond)
	}
	assert.LessOrEqual(t, slices.Max(lost), time.Duration(ctl)*time.Microsecond,
		"1.2 s replies (engine timeout 3 s): Close left %v of key a's room unreturned, in 3 runs (control, Redis healthy: %v): Redis ran every refund it was sent, but the pool stopped sending",
		lost, time.Duration(ctl)*time.Microsecond)
}

// TestReviewCHPoolCloseDialSpendsSecond (FAILS; the loss does not come
// from 09df90d's rule alone): replies held 700 ms, within the engine's
// timeout (3 s), and a booking call of key b in flight at Close, holding
// the engine's one connection (the client keeps one idle, MaxIdleConns 1;
// with the default it often has one, as a second earlier call left it,
// and then all goes back). The give-back of key a's latest booking
// dials a new one: the handshake's round trips take the give-back's whole
// second, its refund is never sent, and the rest of key a's give-backs
// (dropped by the rule; before it, sent, but standing under the latest
// they would give nothing) leave all three bookings' room unreturned.
// On 09df90d's parent (give-backs bounded by the engine's timeout) the
// room all came back.
func TestReviewCHPoolCloseDialSpendsSecond(t *testing.T) {
	ctl := chSlowClose(t, 0, chScene{name: "healthy (control)", inFlight: true})
	// Three times: when the first give-back's failure escapes the rule (see
	// TestReviewCHPoolClosePausedDuration), the next ones go out and may
	// bring the room back.
	var lost []time.Duration
	for i := range 3 {
		l := chSlowClose(t, 1+i, chScene{name: "700ms replies, call in flight, one idle connection kept", reply: 700 * time.Millisecond, inFlight: true, oneIdle: true})
		lost = append(lost, time.Duration(l)*time.Microsecond)
	}
	assert.LessOrEqual(t, slices.Max(lost), time.Duration(ctl)*time.Microsecond,
		"700 ms replies (engine timeout 3 s), a call of another key in flight: Close left %v of key a's room unreturned, in 3 runs (control: %v)",
		lost, time.Duration(ctl)*time.Microsecond)
}
