// Package httplimit keeps HTTP calls to a third-party API within a quota
// shared through Redis by every process that calls it: a Transport (an
// http.RoundTripper) takes a slot from a reserve.Limiter before each
// request, and when the API answers 429 Too Many Requests or 503 Service
// Unavailable with Retry-After, pauses the quota for every process until
// then.
//
//	lim, err := reserve.New(eng, "partner-api", throttle.PerSecond(8, 1), reserve.WithMaxWait(5*time.Second))
//	...
//	tr, err := httplimit.New(lim)
//	...
//	client := &http.Client{Transport: tr}
//
// What it guarantees:
//
//   - A request is sent only at a slot booked for its key (by default the
//     request's host): requests of every process sharing the limiter's name
//     keep to its limit together.
//   - A request the limiter refuses (its slot lies beyond the max wait or
//     the request context's deadline), or cannot book (Redis unavailable
//     and no fallback policy), is never sent: RoundTrip returns a
//     *NotSentError wrapping the refusal, with its retry-after, and closes
//     the request's body as http.RoundTripper requires.
//   - After a 429 or 503 with Retry-After (delay-seconds or an HTTP-date;
//     optionally RateLimit-Reset or X-RateLimit-Reset, see
//     WithResetHeaders), no slot for the key is granted before that time,
//     in any process (reserve.Limiter.Pause). A value beyond the
//     Transport's max pause (DefaultMaxPause) counts as the max pause, so
//     that an absurd header cannot stop the quota for years. The
//     upstream's response always reaches the caller, even if the pause
//     cannot be stored (WithPauseErrorHandler hears of it).
//   - Requests already booked before the pause keep their slots in the
//     shared limit. Those waiting in this Transport when it learns of the
//     pause (its own 429, as the response comes back) book again, behind
//     the pause; its requests that book while the pause is being stored
//     wait until Redis has it. If it cannot be stored, this Transport's
//     requests wait it out before they book, since the shared limit does
//     not hold it, or are refused at once (as the limiter refuses, with
//     the pause's end as their retry-after) when it ends beyond their
//     max wait or deadline. A request's max wait counts from when
//     RoundTrip began, through its waits for pauses and its bookings
//     again. Those waiting in other processes go at their slots (at most
//     one per caller waiting there at the time), unless WithPauseCheck is
//     on: then a request that
//     had to wait for its slot reads the key's pause (one more Redis call)
//     before it is sent, and books again behind a pause any process stored
//     meanwhile.
//
// A Transport is safe for concurrent use.
package httplimit

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/slotbook/slotbook/deadline"
	"github.com/slotbook/slotbook/reserve"
	"github.com/slotbook/slotbook/throttle"
)

// Defaults for New.
const (
	// DefaultMaxPause is the longest pause a response may ask for.
	DefaultMaxPause = time.Hour
	// DefaultPauseTimeout bounds storing a pause in Redis.
	DefaultPauseTimeout = time.Second
)

// A Transport is an http.RoundTripper that sends each request at a slot of
// a shared quota, and pauses the quota when the upstream asks. Build one
// with New; the zero Transport is not usable. It is safe for concurrent
// use.
type Transport struct {
	base         http.RoundTripper
	lim          *reserve.Limiter
	key          func(*http.Request) string
	maxPause     time.Duration
	pauseTimeout time.Duration
	resetHeaders bool
	pauseCheck   bool
	onPauseError func(req *http.Request, d time.Duration, err error)

	mu     sync.Mutex        // guards paused and changed
	paused map[string]*pause // per key, the pause this Transport learnt of that ends last
	// changed is closed, and replaced, when a pause is learnt of: it
	// wakes the requests waiting on a pause, which judge their budget
	// against the new one.
	changed chan struct{}
}

// pause is a pause this Transport learnt of (its own 429 or 503).
type pause struct {
	learnt, until time.Time
	stored        chan struct{} // closed once the call storing it in Redis has ended
	unshared      bool          // that call failed; set before stored is closed, under Transport.mu
}

// An Option configures a Transport in New.
type Option func(*Transport) error

// WithBase sets the RoundTripper that sends requests (default
// http.DefaultTransport).
func WithBase(rt http.RoundTripper) Option {
	return func(t *Transport) error {
		if rt == nil {
			return errors.New("httplimit: nil base RoundTripper")
		}
		t.base = rt
		return nil
	}
}

// WithKey sets the limiter key of a request (default ByHost). The key names
// the quota the request counts against and the one a 429 pauses.
func WithKey(f func(*http.Request) string) Option {
	return func(t *Transport) error {
		if f == nil {
			return errors.New("httplimit: nil key function")
		}
		t.key = f
		return nil
	}
}

// WithMaxPause sets the longest pause a response may ask for (default
// DefaultMaxPause, at most throttle.MaxHorizon): a longer Retry-After
// pauses for d.
func WithMaxPause(d time.Duration) Option {
	return func(t *Transport) error {
		if d <= 0 || d > throttle.MaxHorizon {
			return fmt.Errorf("httplimit: max pause %v: want more than 0, at most %v", d, throttle.MaxHorizon)
		}
		t.maxPause = d
		return nil
	}
}

// WithPauseTimeout bounds the Redis call that stores a pause (default
// DefaultPauseTimeout). It runs even if the request's context has ended.
func WithPauseTimeout(d time.Duration) Option {
	return func(t *Transport) error {
		if d <= 0 {
			return fmt.Errorf("httplimit: pause timeout %v must be positive", d)
		}
		t.pauseTimeout = d
		return nil
	}
}

// WithResetHeaders sets whether a 429 or 503 without Retry-After is paused
// by RateLimit-Reset (delay-seconds, IETF draft) or X-RateLimit-Reset
// (delay-seconds, or a Unix time in seconds when 1,000,000,000 or more, as
// GitHub sends it). Default off: these headers mean different things to
// different APIs.
func WithResetHeaders(on bool) Option {
	return func(t *Transport) error {
		t.resetHeaders = on
		return nil
	}
}

// WithPauseCheck sets whether a request that had to wait for its slot
// checks, just before it is sent, that no process has paused the key since
// it was booked (default off). On, no request reaches the upstream during
// a pause stored before its slot came, at the cost of one more Redis call
// (a read) for each request that waited; the pause also writes a marker
// (one more key while it lasts, the subject key + "#pause", or "#pause#"
// and the key's SHA-256 for a key too long for that; New refuses it on a
// limiter whose name leaves too little room for that marker). Off, a
// request booked before a pause in another process is sent at its slot. If
// the check cannot reach Redis the request is sent: its slot was booked.
func WithPauseCheck(on bool) Option {
	return func(t *Transport) error {
		t.pauseCheck = on
		return nil
	}
}

// WithPauseErrorHandler sets a function told when a pause could not be
// stored (Redis unavailable, say). The response is returned to the caller
// all the same. f is called on the request's goroutine.
func WithPauseErrorHandler(f func(req *http.Request, d time.Duration, err error)) Option {
	return func(t *Transport) error {
		if f == nil {
			return errors.New("httplimit: nil pause error handler")
		}
		t.onPauseError = f
		return nil
	}
}

// New returns a Transport that books through lim. It makes no network
// call.
func New(lim *reserve.Limiter, opts ...Option) (*Transport, error) {
	if lim == nil {
		return nil, errors.New("httplimit: nil limiter")
	}
	t := &Transport{
		base: http.DefaultTransport, lim: lim, key: ByHost,
		maxPause: DefaultMaxPause, pauseTimeout: DefaultPauseTimeout,
		onPauseError: func(*http.Request, time.Duration, error) {},
		paused:       make(map[string]*pause),
		changed:      make(chan struct{}),
	}
	for _, opt := range opts {
		if err := opt(t); err != nil {
			return nil, err
		}
	}
	if t.pauseCheck && lim.CheckKey(strings.Repeat("x", len(hashMarkerPrefix)+2*sha256.Size)) != nil {
		return nil, fmt.Errorf("httplimit: WithPauseCheck: the limiter's name %q leaves too little room for a key to hold a pause marker", lim.Name())
	}
	return t, nil
}

// ByHost keys a request by its URL's host (with its port, if any): one
// quota per API server. It is the default key.
func ByHost(req *http.Request) string {
	if req.URL != nil && req.URL.Host != "" {
		return req.URL.Host
	}
	return req.Host
}

// NotSentError reports a request that was not sent: the limiter refused
// it or could not book a slot for it. Err is the limiter's error: a
// refusal matches reserve.ErrMaxWaitExceeded or
// reserve.ErrWouldExceedDeadline (a *deadline.Error), a refusal by the
// fallback policy is a *reserve.FallbackError, and a Redis failure matches
// throttle.ErrUnavailable. http.Client wraps it in a *url.Error: use
// errors.As.
type NotSentError struct {
	Key string // the request's limiter key
	Err error
}

// Error says which key refused the request, and why.
func (e *NotSentError) Error() string {
	return fmt.Sprintf("httplimit: request not sent (key %q): %v", e.Key, e.Err)
}

// Unwrap returns Err.
func (e *NotSentError) Unwrap() error { return e.Err }

// RetryAfter returns how long after the refusal a request of the key would
// have been sent (the limiter's exact retry-after, or the fallback's
// estimate), and false when Err carries none (a Redis failure, a context
// that ended).
func (e *NotSentError) RetryAfter() (time.Duration, bool) {
	if d, ok := deadline.RetryAfterOf(e.Err); ok {
		return d, true
	}
	var fe *reserve.FallbackError
	if errors.As(e.Err, &fe) {
		return fe.RetryAfter, true
	}
	return 0, false
}

// RoundTrip implements http.RoundTripper: it books a slot for the
// request's key, sleeps until it, sends the request, and pauses the key
// when the response asks for it.
func (t *Transport) RoundTrip(req *http.Request) (*http.Response, error) {
	key := t.key(req)
	if err := t.acquire(req.Context(), key); err != nil {
		if req.Body != nil {
			_ = req.Body.Close()
		}
		return nil, &NotSentError{Key: key, Err: err}
	}
	resp, err := t.base.RoundTrip(req)
	if err != nil || (resp.StatusCode != http.StatusTooManyRequests && resp.StatusCode != http.StatusServiceUnavailable) {
		return resp, err
	}
	if d, ok := t.pauseFor(resp.Header, time.Now()); ok && d > 0 {
		// This Transport's own waiters heed the pause from now on, not
		// from when Redis has it (a round trip later), nor only if it
		// does.
		p := t.remember(key, d)
		ctx, cancel := context.WithTimeout(context.WithoutCancel(req.Context()), t.pauseTimeout)
		defer cancel()
		err := t.storePause(ctx, key, d)
		if err != nil {
			t.mu.Lock()
			p.unshared = true
			t.mu.Unlock()
		}
		close(p.stored)
		if err != nil {
			t.onPauseError(req, d, err)
		}
	}
	return resp, nil
}

// acquire books a slot for key and sleeps until it. A slot that a pause
// stored meanwhile has overtaken (booked before the pause, due before its
// end) is booked again, behind the pause: a pause this Transport stored,
// and with WithPauseCheck one any process stored.
func (t *Transport) acquire(ctx context.Context, key string) error {
	start := time.Now()
	for {
		asked, err := t.heed(ctx, key, start)
		if err != nil {
			return err
		}
		// The max wait counts from the request's start, its waits for
		// pauses and its earlier slots included.
		r, err := t.lim.ReserveWithin(ctx, key, 1, t.maxWaitLeft(time.Since(start)))
		if err != nil {
			return err
		}
		slept := r.OK() && r.Booking().Wait > 0
		if err := r.Wait(ctx); err != nil {
			return err
		}
		if t.pausedSince(key, asked) || t.lostPause(key) {
			continue
		}
		if !t.pauseCheck || !slept {
			return nil
		}
		if st, err := t.lim.State(ctx, t.pauseMarker(key)); err != nil || st.Wait == 0 {
			return nil // no pause (or none to be read: the slot was booked)
		}
	}
}

// pauseMarker is the subject whose state marks key's pause for
// WithPauseCheck: paused along with key, it is otherwise never booked, so
// its wait is exactly the time left of the pause. It is key + "#pause",
// or, for a key too long for that, "#pause#" and the key's SHA-256.
func (t *Transport) pauseMarker(key string) string {
	if m := key + "#pause"; t.lim.CheckKey(m) == nil {
		return m
	}
	sum := sha256.Sum256([]byte(key))
	return hashMarkerPrefix + hex.EncodeToString(sum[:])
}

// hashMarkerPrefix begins the pause marker of a key too long for
// key + "#pause"; New refuses WithPauseCheck on a limiter whose keys
// cannot be that long.
const hashMarkerPrefix = "#pause#"

// storePause pauses key for d for every process: first its marker (with
// WithPauseCheck), so that no process can read "not paused" once the key is.
func (t *Transport) storePause(ctx context.Context, key string, d time.Duration) error {
	if t.pauseCheck {
		if err := t.lim.Pause(ctx, t.pauseMarker(key), d); err != nil {
			return err
		}
	}
	return t.lim.Pause(ctx, key, d)
}

// remember records a pause of key for d that this Transport learnt of
// now, unless one it knows of ends later, forgets pauses that have ended,
// and returns the new pause (to be stored in Redis, then marked so).
func (t *Transport) remember(key string, d time.Duration) *pause {
	t.mu.Lock()
	defer t.mu.Unlock()
	now := time.Now() // under mu: see heed
	p := &pause{learnt: now, until: now.Add(d), stored: make(chan struct{})}
	for k, old := range t.paused {
		if !old.until.After(now) {
			delete(t.paused, k)
		}
	}
	if old, ok := t.paused[key]; !ok || p.until.After(old.until) {
		t.paused[key] = p
		close(t.changed)
		t.changed = make(chan struct{})
	}
	return p
}

// heed waits, before a booking of key by a request that began at start,
// until every pause of key this Transport learnt of is stored in Redis, so
// that the booking comes after it there; a pause Redis does not hold
// (storing it failed, or it was lost: see lostPause) is waited out here. A
// request whose budget (what is left of the limiter's max wait since
// start, or ctx's deadline less the work estimate) a pause in force here
// exceeds is refused at once, as the limiter refuses, with the pause's end
// as its retry-after; a pause learnt of while it waits is judged so at
// once too. heed returns when the request may book (asked: a pause learnt
// of after it was not heeded, see pausedSince), or ctx's error if ctx ends
// first.
func (t *Transport) heed(ctx context.Context, key string, start time.Time) (asked time.Time, err error) {
	for {
		t.mu.Lock()
		p := t.paused[key]
		changed := t.changed
		now := time.Now()
		if p == nil || !now.Before(p.until) {
			t.mu.Unlock()
			return now, nil // under mu: a pause remembered later is learnt after now
		}
		t.mu.Unlock()
		limit := t.maxWaitLeft(now.Sub(start))
		if budget, bound := deadline.Budget(ctx, now, limit, t.lim.WorkEstimate()); p.until.Sub(now) > budget {
			if budget < 0 { // no time for the work at all: no retry-after, as the limiter's
				return time.Time{}, deadline.Refuse(bound, budget, 0)
			}
			return time.Time{}, deadline.Refuse(bound, budget, p.until.Sub(now))
		}
		select {
		case <-p.stored:
		case <-changed:
			continue // a later pause: judge the request against it
		case <-ctx.Done():
			return time.Time{}, ctx.Err()
		}
		t.mu.Lock()
		if !p.unshared {
			if t.paused[key] == p {
				asked = time.Now() // under mu, as above
				t.mu.Unlock()
				return asked, nil
			}
			t.mu.Unlock()
			continue // a later pause came meanwhile
		}
		t.mu.Unlock()
		timer := time.NewTimer(time.Until(p.until))
		select {
		case <-timer.C:
		case <-changed:
			timer.Stop() // a later pause: judge the request against it
		case <-ctx.Done():
			timer.Stop()
			return time.Time{}, ctx.Err()
		}
	}
}

// maxWaitLeft returns what is left of the limiter's max wait to a request
// that began spent ago (deadline.NoCap if the limiter has none).
func (t *Transport) maxWaitLeft(spent time.Duration) time.Duration {
	mw, ok := t.lim.MaxWait()
	if !ok {
		return deadline.NoCap
	}
	return max(mw-spent, 0)
}

// lostPause reports whether a slot that came now lies inside a pause of
// key that this Transport stored in Redis before the slot was booked: Redis
// lost the pause (a restart without persistence, a Reset). The pause is
// then marked as one Redis does not hold, which heed waits out.
func (t *Transport) lostPause(key string) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	p := t.paused[key]
	if p == nil || p.unshared || !time.Now().Before(p.until) {
		return false
	}
	select {
	case <-p.stored:
		p.unshared = true
		return true
	default:
		return false // being stored: pausedSince's business
	}
}

// pausedSince reports whether a pause of key learnt of after since is still
// in force.
func (t *Transport) pausedSince(key string, since time.Time) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	p, ok := t.paused[key]
	return ok && p.learnt.After(since) && time.Now().Before(p.until)
}

// pauseFor returns the pause a 429 or 503 response's headers ask for, at
// most the max pause, and whether they ask for one.
func (t *Transport) pauseFor(h http.Header, now time.Time) (time.Duration, bool) {
	if d, ok := retryAfter(h.Get("Retry-After"), now, t.maxPause); ok {
		return d, true
	}
	if !t.resetHeaders {
		return 0, false
	}
	if d, ok := seconds(h.Get("RateLimit-Reset"), t.maxPause); ok {
		return d, true
	}
	v := strings.TrimSpace(h.Get("X-RateLimit-Reset"))
	if n, err := strconv.ParseInt(v, 10, 64); err == nil && n >= unixTimeFrom {
		return min(max(0, time.Unix(n, 0).Sub(now)), t.maxPause), true
	}
	return seconds(v, t.maxPause)
}

// unixTimeFrom is where X-RateLimit-Reset values are read as a Unix time
// (2001-09-09) rather than delay-seconds (31 years).
const unixTimeFrom = 1_000_000_000

// retryAfter parses a Retry-After value, delay-seconds or an HTTP-date,
// into a pause of at most maxPause (a date in the past: 0).
func retryAfter(v string, now time.Time, maxPause time.Duration) (time.Duration, bool) {
	v = strings.TrimSpace(v)
	if d, ok := seconds(v, maxPause); ok {
		return d, true
	}
	if at, err := http.ParseTime(v); err == nil {
		return min(max(0, at.Sub(now)), maxPause), true
	}
	return 0, false
}

// seconds parses delay-seconds (digits only) into a pause of at most
// maxPause; a value too large for any integer type is the max pause too.
func seconds(v string, maxPause time.Duration) (time.Duration, bool) {
	v = strings.TrimSpace(v)
	if v == "" || strings.TrimLeft(v, "0123456789") != "" {
		return 0, false
	}
	n, err := strconv.ParseUint(v, 10, 64)
	if err != nil || n > uint64(maxPause/time.Second) { // ErrRange: beyond any pause
		return maxPause, true
	}
	return min(time.Duration(n)*time.Second, maxPause), true
}
