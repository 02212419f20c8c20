package reserve

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"math"
	"sync"
	"sync/atomic"
	"time"

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

// FailOpen lets each process use the whole limit on its own while Redis is
// unavailable: every key is limited in this process to the full limit (not
// a share of it), so N processes admit at most N times the limit, never
// an unbounded flood. Reservations wait for their
// local slot within their budget, as with LocalShare. At most 10,000 local
// limiters are kept.
//
// Like LocalShare's, the local limiters know nothing of the slots booked in
// Redis before the outage: when Redis becomes unavailable, a process may
// admit a local burst on top of the slots it had booked ahead.
func FailOpen() Fallback {
	return Fallback{kind: failOpen, instances: 1, maxKeys: defaultLocalKeys, configured: true}
}

// defaultLocalKeys bounds FailOpen's local limiters.
const defaultLocalKeys = 10_000

// FailClosed refuses every request while Redis is unavailable. The
// refusal's error matches throttle.ErrUnavailable.
func FailClosed() Fallback { return Fallback{kind: failClosed, configured: true} }

// LocalShare limits each key in this process to its share of each of the
// Limiter's limits, limit/instances, while Redis is unavailable, with one
// local limiter per limit, a GCRA as in Redis on this process's monotonic
// clock: a request passes when every limit's share lets it. Views made
// with Limiter.With share one local state. instances is learned while
// Redis is up: each process records a heartbeat every interval (one Redis
// call per interval, never per request) in a sorted set that forgets a
// process after three intervals. Until the first heartbeat, assumed
// instances is used (it must be at least 1). A share's burst is at
// least one request: with more processes than the limit's burst+1, they
// may together admit one request each at once, more than the burst. At
// most maxKeys local limiters are kept; past that, one is dropped for each
// new key.
func LocalShare(interval time.Duration, assumed, maxKeys int) Fallback {
	return Fallback{kind: localShare, every: interval, instances: assumed, maxKeys: maxKeys, configured: true}
}

// WithFallback sets how the Limiter answers while Redis is unavailable:
// for a call that failed with throttle.ErrUnavailable while the breaker of
// the Redis node that holds its key is open. A call that failed while the
// breaker stayed closed (the client's own saturation: Redis is up) gets its
// error, and the fallback admits nothing on top of what Redis admits.
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
		if f.kind == localShare || f.kind == failOpen {
			l.fallback.instances.Store(int64(f.instances))
			l.fallback.local = make(map[string]*localKey)
			l.fallback.epoch = time.Now()
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

	// mu guards local and last, and is held across each request's
	// bookings in its key's local limiters (one per limit), so that a
	// request passes or is refused by all of them at once.
	mu    sync.Mutex
	local map[string]*localKey
	// last is the latest time given to any local limiter: concurrent
	// callers' clocks reach the lock out of order, and no limiter is
	// given a time before one it has seen. Times are kept as nanoseconds
	// since epoch (see instant).
	last  time.Time
	epoch time.Time // with a monotonic reading: the zero of instant's clock
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
	// On a goroutine of its own (at most one started per interval, each
	// bounded by the engine's timeout): the caller whose call reached
	// Redis must not wait a round trip more for its answer.
	go l.beat(context.WithoutCancel(ctx))
}

// beat records this process's heartbeat and, if the count of processes
// changed, every local limiter's share.
func (l *Limiter) beat(ctx context.Context) {
	f := l.fallback
	n, err := l.eng.Heartbeat(ctx, l.name, processID, 3*f.every)
	if err != nil {
		return // the next interval tries again
	}
	if int64(n) != f.instances.Swap(int64(n)) {
		f.mu.Lock()
		now := f.instant(time.Now())
		for _, lk := range f.local {
			for i := range lk.b {
				every, size := f.share(l.limits[i])
				lk.b[i].rescale(now, every, size)
			}
			lk.gen++
		}
		f.mu.Unlock()
	}
}

// share is this process's part of limit: the emission interval of its
// rate (limit.Rate per limit.Period, divided among the instances), in
// nanoseconds, rounded up so that the share never exceeds its part, and
// its burst in units.
func (f *fallback) share(limit throttle.Limit) (every, size int64) {
	n := max(1, f.instances.Load())
	every = int64(math.Ceil(float64(limit.Period) * float64(n) / float64(limit.Rate)))
	return max(1, every), int64(max(1, (limit.Burst+1)/int(n)))
}

// localKey is a key's local limiters, one per limit in the Limiter's
// order, and how many share changes they have been through.
type localKey struct {
	b   []bucket
	gen int
}

// localBooking is a fallback Reservation's local bookings, one per limit
// of its key (from start to end of each), and its local time to act.
type localBooking struct {
	key   *localKey
	gen   int // key's gen when booked
	parts []span
	act   int64
}

// span is one limit's booking: from start to end on its bucket.
type span struct{ start, end int64 }

// limiters returns key's local limiters. f.mu is held.
func (f *fallback) limiters(key string, limits []throttle.Limit) *localKey {
	if lk, ok := f.local[key]; ok {
		return lk
	}
	if len(f.local) >= f.maxKeys {
		for k := range f.local { // drop one, at random
			delete(f.local, k)
			break
		}
	}
	lk := &localKey{b: make([]bucket, len(limits))}
	for i, limit := range limits {
		lk.b[i].every, lk.b[i].size = f.share(limit)
	}
	f.local[key] = lk
	return lk
}

// monotonic returns t, or last if t is before it, and moves last on. f.mu
// is held.
func (f *fallback) monotonic(t time.Time) time.Time {
	if t.Before(f.last) {
		return f.last
	}
	f.last = t
	return t
}

// instant is monotonic(t) in nanoseconds since epoch, the local limiters'
// clock. f.mu is held.
func (f *fallback) instant(t time.Time) int64 {
	return int64(f.monotonic(t).Sub(f.epoch))
}

// cancel gives back b's local bookings: on each limit, all of it once no
// later booking stands on it (at once, or with the last of those above
// it; see bucket.giveBack), so that nothing is ever let through early;
// and once its time to act has come, nothing, for its holder may have
// acted, unless unused tells that no one can have acted on it (its
// caller never had it).
func (f *fallback) cancel(b *localBooking, unused bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	now := f.instant(time.Now())
	if !unused && b.act <= now || b.gen != b.key.gen {
		// Come, or booked before a share change, which moved the key's
		// bookings off the times this one holds: nothing to give back.
		return
	}
	for i, p := range b.parts {
		b.key.b[i].giveBack(p, now)
	}
}

// forget drops key's local limiters (Limiter.Reset).
func (f *fallback) forget(key string) {
	f.mu.Lock()
	delete(f.local, key)
	f.mu.Unlock()
}

// localReserve books n units at now in every limit's local share, for a
// wait of at most budget. It returns the bookings (to cancel them later)
// and the delay, or ok false and the wait it would have needed (for a
// request no share can ever pass, the first limit's interval times n);
// a refusal books nothing.
func (l *Limiter) localReserve(key string, n int, now time.Time, budget time.Duration) (b *localBooking, delay time.Duration, ok bool) {
	f := l.fallback
	f.mu.Lock()
	defer f.mu.Unlock()
	t := f.instant(now)
	lk := f.limiters(key, l.limits)
	parts := make([]span, len(lk.b))
	var wait int64
	for i := range lk.b {
		if int64(n) > lk.b[i].size {
			return nil, l.limit.Interval() * time.Duration(n), false
		}
		var w int64
		parts[i], w = lk.b[i].book(t, n)
		wait = max(wait, w)
	}
	// From the caller's now, which the clock of the lock may have passed.
	delay = time.Duration(t + wait - int64(now.Sub(f.epoch)))
	if delay > budget {
		return nil, delay, false
	}
	for i, p := range parts {
		lk.b[i].tat = p.end
	}
	return &localBooking{key: lk, gen: lk.gen, parts: parts, act: t + wait}, delay, true
}

// fallbackReserve answers one request from the fallback.
func (l *Limiter) fallbackReserve(ctx context.Context, key string, n int, now time.Time, budget time.Duration, cause error) *Reservation {
	f := l.fallback
	obs := l.eng.Observer()
	r := &Reservation{lim: l, key: key, fallback: true}
	refuse := func(after time.Duration) *Reservation {
		r.err = &FallbackError{RetryAfter: after, Err: cause}
		obs.ObserveDecision(l.name, throttle.FallbackRefused, after)
		return r
	}
	switch f.kind {
	case failClosed:
		return refuse(l.probeIn(ctx, key))
	case failOpen, localShare:
		local, delay, ok := l.localReserve(key, n, now, budget)
		if !ok {
			return refuse(delay)
		}
		r.local = local
		r.act = now.Add(delay)
	}
	obs.ObserveDecision(l.name, throttle.FallbackAllowed, r.act.Sub(now))
	return r
}

// useFallback reports whether the fallback answers a call for key that
// failed with err: when the call found Redis unavailable and the breaker
// of the node that holds key is open. A call that failed while the
// breaker stayed closed (the client's own saturation: no connection in
// time, or a call that lost the race with a success since it started) is
// not Redis being down: its caller gets the error, and FailOpen and
// LocalShare admit nothing on top of what Redis admits, so that load alone
// never turns the limit off.
func (l *Limiter) useFallback(ctx context.Context, key string, err error) bool {
	if err == nil || l.fallback == nil || !errors.Is(err, throttle.ErrUnavailable) {
		return false
	}
	open, _ := l.eng.UnavailableFor(ctx, key)
	return open
}

// probeIn is how long until the engine next probes the Redis node that
// holds key (with a Redis Cluster, the master that owns its slot: another
// node's breaker may have opened sooner or later), FailClosed's retry-after.
// It is 0 if that node's breaker is closed: the call failed without opening
// it (a client saturated), and the next call goes to Redis.
func (l *Limiter) probeIn(ctx context.Context, key string) time.Duration {
	_, in := l.eng.UnavailableFor(ctx, key)
	return in
}

// fallbackAllow answers a check-mode request from the fallback.
func (l *Limiter) fallbackAllow(ctx context.Context, key string, n int) (throttle.Result, error) {
	f := l.fallback
	obs := l.eng.Observer()
	switch f.kind {
	case failClosed:
		probe := l.probeIn(ctx, key)
		obs.ObserveDecision(l.name, throttle.FallbackRefused, probe)
		return throttle.Result{RetryAfter: probe}, nil
	}
	now := time.Now()
	booked, after, ok := l.localReserve(key, n, now, 0)
	if !ok {
		obs.ObserveDecision(l.name, throttle.FallbackRefused, after)
		return throttle.Result{RetryAfter: after}, nil
	}
	obs.ObserveDecision(l.name, throttle.FallbackAllowed, throttle.NoWait) // check mode: no booked wait
	remaining := int64(math.MaxInt)
	f.mu.Lock()
	t := f.instant(now)
	for _, b := range booked.key.b { // the limiters it was booked in
		remaining = min(remaining, b.room(t))
	}
	f.mu.Unlock()
	return throttle.Result{Allowed: true, Remaining: int(max(remaining, 0))}, nil
}
