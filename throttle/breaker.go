package throttle

import (
	"context"
	"errors"
	"io"
	"net"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/redis/go-redis/v9"
)

// ErrUnavailable is matched by errors for calls that did not reach a
// working Redis: a timeout, a refused or broken connection, a server still
// loading, or the breaker open after such a failure. A fallback policy
// (package reserve) may answer instead.
var ErrUnavailable = errors.New("throttle: Redis unavailable")

// Defaults for the breaker's probe interval, which doubles after each failed
// probe between the two.
const (
	DefaultProbeMin = 25 * time.Millisecond
	DefaultProbeMax = 400 * time.Millisecond
)

// breaker stops calls from paying the timeout while Redis is down: after a
// failure it is open, and calls fail at once with ErrUnavailable, except one
// probe at a time, let through once the backoff has passed. The first
// success closes it.
type breaker struct {
	min, max time.Duration
	notify   func(open bool)

	mu          sync.Mutex // guards the fields below
	open        bool
	probing     bool
	next        time.Time
	backoff     time.Duration
	lastSuccess time.Time // when the last call succeeded
}

// allow reports whether a call may go to Redis now, and whether it goes as
// the probe of an open breaker.
func (b *breaker) allow() (ok, probe bool) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if !b.open {
		return true, false
	}
	if b.probing || time.Now().Before(b.next) {
		return false, false
	}
	b.probing = true
	return true, true
}

// state reports whether the breaker is open and how long until the next
// probe may go.
func (b *breaker) state() (open bool, probeIn time.Duration) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if !b.open {
		return false, 0
	}
	return true, max(0, time.Until(b.next))
}

// failure records a call, sent at start, that failed as if Redis were
// unavailable. If another call has succeeded since start, Redis was up
// while this one waited: the failure is this client's own (a starved
// goroutine, a lost packet), not Redis's, and the breaker stays closed, so
// a busy client never fails every caller at once (or hands them all to
// the fallback).
func (b *breaker) failure(start time.Time) {
	b.mu.Lock()
	if !b.open && b.lastSuccess.After(start) {
		b.mu.Unlock()
		return
	}
	opened := !b.open
	if opened {
		b.open = true
		b.backoff = b.min
	} else if b.probing {
		b.backoff = min(2*b.backoff, b.max)
	}
	b.probing = false
	b.next = time.Now().Add(b.backoff)
	b.mu.Unlock()
	if opened {
		b.notify(true)
	}
}

func (b *breaker) success() {
	b.mu.Lock()
	closed := b.open
	b.open, b.probing = false, false
	b.lastSuccess = time.Now()
	b.mu.Unlock()
	if closed {
		b.notify(false)
	}
}

// abandon releases a probe that ended without a verdict (the caller's
// context ended).
func (b *breaker) abandon() {
	b.mu.Lock()
	b.probing = false
	b.mu.Unlock()
}

// ErrReplyLost is matched, together with ErrUnavailable (or the context's
// error, when the caller's context ended first), by errors for calls that
// were sent but whose reply never came: a timeout or a broken connection
// after the command was written. The script may have run: a lost booking
// reply may have booked slots nobody will use (quota wasted, never
// exceeded); a lost refund reply may have given the booking back (retrying
// the refund is safe: refunds are idempotent). An error that matches
// ErrUnavailable without ErrReplyLost means nothing reached Redis.
var ErrReplyLost = errors.New("throttle: reply lost, the call may have taken effect")

// ErrCorruptState is matched by errors for a key that holds a value the
// engine did not write: not an integer count of microseconds, beyond 2^53,
// or further ahead than any booking under its limit could reach. The
// message names the key; Engine.Reset (or reserve's Limiter.Reset) clears
// it. Nothing is written over such a value.
var ErrCorruptState = errors.New("throttle: corrupt stored state")

// notSent reports whether err shows that the command never reached Redis
// (or that Redis refused it without running it), so that it certainly took
// no effect: a failed dial, no connection to be had from the client's pool,
// or a server that answered it is loading, down or busy.
func notSent(err error) bool {
	var op *net.OpError
	if errors.As(err, &op) && op.Op == "dial" {
		return true
	}
	return errors.Is(err, syscall.ECONNREFUSED) || errors.Is(err, redis.ErrPoolTimeout) ||
		errors.Is(err, redis.ErrPoolExhausted) || cannotServe(err)
}

// unavailable reports whether err means Redis could not be reached or could
// not serve, as opposed to a reply that was an error.
func unavailable(err error) bool {
	var ne net.Error
	switch {
	case errors.Is(err, context.DeadlineExceeded),
		errors.Is(err, io.EOF), errors.Is(err, io.ErrUnexpectedEOF),
		errors.Is(err, syscall.ECONNREFUSED), errors.Is(err, syscall.ECONNRESET), errors.Is(err, syscall.EPIPE),
		errors.Is(err, redis.ErrPoolTimeout), errors.Is(err, redis.ErrPoolExhausted),
		errors.As(err, &ne):
		return true
	}
	return cannotServe(err)
}

// cannotServe reports whether err is Redis's answer that it cannot run the
// command now (loading, a master down, a cluster resharding, a script
// running too long) or cannot write (out of memory, a read-only replica
// after a failover, a failed save, too few replicas): nothing was written.
func cannotServe(err error) bool {
	msg := err.Error()
	for _, p := range []string{"LOADING", "MASTERDOWN", "CLUSTERDOWN", "TRYAGAIN", "BUSY", "OOM", "READONLY", "MISCONF", "NOREPLICAS"} {
		if strings.HasPrefix(msg, p) {
			return true
		}
	}
	return false
}
