package reserve

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/time/rate"

	"github.com/slotbook/slotbook/throttle"
)

// A Fallback answers for a Limiter while Redis is unavailable (calls
// failing with throttle.ErrUnavailable: a timeout, a lost connection, or the
// engine's breaker open). Without one, such calls return the error. Build
// one with FailOpen, FailClosed or LocalShare.
type Fallback struct {
	kind       fallbackKind
	every      time.Duration // LocalShare: heartbeat interval
	instances  int           // LocalShare: assumed before the first heartbeat
	maxKeys    int           // LocalShare: bound on the local limiters kept
	configured bool
}

type fallbackKind int

const (
	failOpen fallbackKind = iota + 1
	failClosed
	localShare
)

// FailOpen lets every request pass at once while Redis is unavailable: the
// quota is not enforced, and nothing waits.
func FailOpen() Fallback { return Fallback{kind: failOpen, configured: true} }

// FailClosed refuses every request while Redis is unavailable. The
// refusal's error matches throttle.ErrUnavailable.
func FailClosed() Fallback { return Fallback{kind: failClosed, configured: true} }

// LocalShare limits each key in this process to its share of the limit,
// limit/instances, while Redis is unavailable, with golang.org/x/time/rate.
// instances is learned while Redis is up: each process records a heartbeat
// every interval (one Redis call per interval, never per request) in a
// sorted set that forgets a process after three intervals. Until the first
// heartbeat, assumed instances is used (at least 1). At most maxKeys local
// limiters are kept; past that, one is dropped for each new key.
func LocalShare(interval time.Duration, assumed, maxKeys int) Fallback {
	return Fallback{kind: localShare, every: interval, instances: assumed, maxKeys: maxKeys, configured: true}
}

// WithFallback sets how the Limiter answers while Redis is unavailable.
func WithFallback(f Fallback) Option {
	return func(l *Limiter) error {
		if !f.configured {
			return errors.New("reserve: zero Fallback; use FailOpen, FailClosed or LocalShare")
		}
		if f.kind == localShare && (f.every < 10*time.Millisecond || f.instances < 1 || f.maxKeys < 1) {
			return fmt.Errorf("reserve: LocalShare(%v, %d, %d): want an interval of at least 10ms and positive counts",
				f.every, f.instances, f.maxKeys)
		}
		l.fallback = &fallback{Fallback: f}
		if f.kind == localShare {
			l.fallback.instances.Store(int64(f.instances))
			l.fallback.local = make(map[string]*rate.Limiter)
		}
		return nil
	}
}

// FallbackError is a refusal by the fallback while Redis is unavailable. It
// matches throttle.ErrUnavailable.
type FallbackError struct {
	// RetryAfter is the local estimate of when the request would pass:
	// the local share's wait, or for FailClosed, the time to the next probe
	// of Redis.
	RetryAfter time.Duration
	// Err is the error from the engine.
	Err error
}

// Error describes the refusal.
func (e *FallbackError) Error() string {
	return fmt.Sprintf("reserve: refused by the fallback (retry in %v): %v", e.RetryAfter, e.Err)
}

// Unwrap returns Err.
func (e *FallbackError) Unwrap() error { return e.Err }

// processID names this process in heartbeats.
var processID = func() string {
	b := make([]byte, 8)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}()

// fallback is a Limiter's fallback state.
type fallback struct {
	Fallback
	instances     atomic.Int64
	lastHeartbeat atomic.Int64 // unix nanoseconds

	mu    sync.Mutex // guards local
	local map[string]*rate.Limiter
}

// heartbeat records this process, at most once per interval, after a call
// that reached Redis.
func (l *Limiter) heartbeat(ctx context.Context) {
	f := l.fallback
	if f == nil || f.kind != localShare {
		return
	}
	now := time.Now().UnixNano()
	last := f.lastHeartbeat.Load()
	if now-last < int64(f.every) || !f.lastHeartbeat.CompareAndSwap(last, now) {
		return
	}
	n, err := l.eng.Heartbeat(context.WithoutCancel(ctx), l.name, processID, 3*f.every)
	if err != nil {
		return // the next interval tries again
	}
	if int64(n) != f.instances.Swap(int64(n)) {
		f.mu.Lock()
		for _, lim := range f.local {
			r, b := f.share(l.limit)
			lim.SetLimit(r)
			lim.SetBurst(b)
		}
		f.mu.Unlock()
	}
}

// share is this process's part of limit: rate and burst.
func (f *fallback) share(limit throttle.Limit) (rate.Limit, int) {
	n := max(1, f.instances.Load())
	perSec := float64(limit.Rate) / limit.Period.Seconds() / float64(n)
	return rate.Limit(perSec), max(1, (limit.Burst+1)/int(n))
}

func (f *fallback) limiter(key string, limit throttle.Limit) *rate.Limiter {
	f.mu.Lock()
	defer f.mu.Unlock()
	if lim, ok := f.local[key]; ok {
		return lim
	}
	if len(f.local) >= f.maxKeys {
		for k := range f.local { // drop one, at random
			delete(f.local, k)
			break
		}
	}
	lim := rate.NewLimiter(f.share(limit))
	f.local[key] = lim
	return lim
}

// fallbackReserve answers one request from the fallback.
func (l *Limiter) fallbackReserve(key string, n int, now time.Time, budget time.Duration, cause error) *Reservation {
	f := l.fallback
	obs := l.eng.Observer()
	r := &Reservation{lim: l, key: key, fallback: true}
	refuse := func(after time.Duration) *Reservation {
		r.err = &FallbackError{RetryAfter: after, Err: cause}
		obs.ObserveDecision(l.name, throttle.FallbackRefused, after)
		return r
	}
	switch f.kind {
	case failOpen:
		r.act = now
	case failClosed:
		_, probe := l.eng.Unavailable()
		return refuse(probe)
	case localShare:
		lim := f.limiter(key, l.limit)
		local := lim.ReserveN(now, n)
		if !local.OK() {
			return refuse(l.limit.Interval() * time.Duration(n))
		}
		delay := local.DelayFrom(now)
		if delay > budget {
			local.CancelAt(now)
			return refuse(delay)
		}
		r.local = local
		r.act = now.Add(delay)
	}
	obs.ObserveDecision(l.name, throttle.FallbackAllowed, r.act.Sub(now))
	return r
}

// fallbackAllow answers a check-mode request from the fallback.
func (l *Limiter) fallbackAllow(key string, n int) (throttle.Result, error) {
	f := l.fallback
	obs := l.eng.Observer()
	switch f.kind {
	case failOpen:
		obs.ObserveDecision(l.name, throttle.FallbackAllowed, 0)
		return throttle.Result{Allowed: true}, nil
	case failClosed:
		_, probe := l.eng.Unavailable()
		obs.ObserveDecision(l.name, throttle.FallbackRefused, probe)
		return throttle.Result{RetryAfter: probe}, nil
	}
	lim := l.fallback.limiter(key, l.limit)
	now := time.Now()
	if lim.AllowN(now, n) {
		obs.ObserveDecision(l.name, throttle.FallbackAllowed, 0)
		return throttle.Result{Allowed: true, Remaining: int(lim.TokensAt(now))}, nil
	}
	r := lim.ReserveN(now, n)
	after := r.DelayFrom(now)
	r.CancelAt(now)
	if !r.OK() {
		after = l.limit.Interval() * time.Duration(n)
	}
	obs.ObserveDecision(l.name, throttle.FallbackRefused, after)
	return throttle.Result{RetryAfter: after}, nil
}
