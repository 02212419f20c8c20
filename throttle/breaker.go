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

	mu      sync.Mutex // guards the fields below
	open    bool
	probing bool
	next    time.Time
	backoff time.Duration
}

// allow reports whether a call may go to Redis now.
func (b *breaker) allow() bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	if !b.open {
		return true
	}
	if b.probing || time.Now().Before(b.next) {
		return false
	}
	b.probing = true
	return true
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

func (b *breaker) failure() {
	b.mu.Lock()
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
	msg := err.Error()
	for _, p := range []string{"LOADING", "MASTERDOWN", "CLUSTERDOWN", "TRYAGAIN", "BUSY"} {
		if strings.HasPrefix(msg, p) {
			return true
		}
	}
	return false
}
