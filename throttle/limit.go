package throttle

import (
	"errors"
	"fmt"
	"time"
)

// ErrInvalidLimit is matched (with errors.Is) by every error that reports a
// Limit that can never be enforced: a rate or period that is not positive, a
// negative burst, or an emission interval shorter than a microsecond.
var ErrInvalidLimit = errors.New("throttle: invalid limit")

// ErrExceedsBurst is returned, before any Redis call, for a request of n
// units where n > Burst+1: such a request could never be granted.
var ErrExceedsBurst = errors.New("throttle: request exceeds burst")

// ErrInvalidRequest is matched by errors that report a bad argument other
// than the limit: n <= 0, an empty or over-long key, a negative max wait.
// No Redis call is made for such a request.
var ErrInvalidRequest = errors.New("throttle: invalid request")

// A Limit is Rate events per Period, with Burst extra events allowed back to
// back after an idle spell: after idling, Burst+1 requests pass at once, and
// under sustained load requests are spaced Interval() apart.
//
// The zero Limit is invalid; build one with PerSecond, PerMinute, PerHour or
// Every. A Limit is a plain value, safe to copy and share.
type Limit struct {
	Rate   int           // events per Period; must be > 0
	Period time.Duration // must be > 0
	Burst  int           // extra events allowed back to back; must be >= 0
}

// PerSecond returns a Limit of rate events per second with the given burst.
func PerSecond(rate, burst int) Limit { return Every(time.Second, rate, burst) }

// PerMinute returns a Limit of rate events per minute with the given burst.
func PerMinute(rate, burst int) Limit { return Every(time.Minute, rate, burst) }

// PerHour returns a Limit of rate events per hour with the given burst.
func PerHour(rate, burst int) Limit { return Every(time.Hour, rate, burst) }

// PerDay returns a Limit of rate events per 24 hours with the given burst.
func PerDay(rate, burst int) Limit { return Every(24*time.Hour, rate, burst) }

// Every returns a Limit of rate events per period with the given burst.
func Every(period time.Duration, rate, burst int) Limit {
	return Limit{Rate: rate, Period: period, Burst: burst}
}

// Validate reports whether l can be enforced. The error matches
// ErrInvalidLimit.
func (l Limit) Validate() error {
	switch {
	case l.Rate <= 0:
		return fmt.Errorf("%w: rate %d must be positive", ErrInvalidLimit, l.Rate)
	case l.Period <= 0:
		return fmt.Errorf("%w: period %v must be positive", ErrInvalidLimit, l.Period)
	case l.Burst < 0:
		return fmt.Errorf("%w: burst %d must not be negative", ErrInvalidLimit, l.Burst)
	case l.Period/time.Duration(l.Rate) < time.Microsecond:
		return fmt.Errorf("%w: %d per %v is more than one per microsecond", ErrInvalidLimit, l.Rate, l.Period)
	case l.intervalMicros() > maxMicros/int64(l.Burst+2):
		return fmt.Errorf("%w: interval %v with burst %d is too long", ErrInvalidLimit, l.Interval(), l.Burst)
	}
	return nil
}

// Interval returns the emission interval, Period/Rate, rounded up to a whole
// microsecond (the engine's unit, so a limit is never exceeded by rounding).
// It returns 0 for an invalid Limit.
func (l Limit) Interval() time.Duration {
	if l.Rate <= 0 || l.Period <= 0 {
		return 0
	}
	return time.Duration(l.intervalMicros()) * time.Microsecond
}

// intervalMicros is ceil(Period/Rate) in microseconds.
func (l Limit) intervalMicros() int64 {
	p := l.Period.Nanoseconds()
	r := int64(l.Rate)
	ns := p / r
	if p%r != 0 {
		ns++
	}
	return ceilMicros(time.Duration(ns))
}

// tauMicros is the limit's tolerance, Burst intervals, in microseconds:
// how far ahead of now a key's TAT may lie with a request still passing
// at once.
func (l Limit) tauMicros() int64 { return l.intervalMicros() * int64(l.Burst) }

// String returns the limit as "10/1s burst 5".
func (l Limit) String() string {
	return fmt.Sprintf("%d/%v burst %d", l.Rate, l.Period, l.Burst)
}

// maxMicros bounds every time value sent to Redis: Lua numbers are doubles,
// exact for integers up to 2^53.
const maxMicros = 1 << 52

// ceilMicros converts d to whole microseconds, rounding up.
func ceilMicros(d time.Duration) int64 {
	us := int64(d / time.Microsecond)
	if d%time.Microsecond > 0 {
		us++
	}
	return us
}
