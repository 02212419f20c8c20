package throttle

import (
	"context"
	_ "embed"
	"errors"
	"fmt"
	"math"
	"strconv"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/slotbook/slotbook/internal/testhook"
)

var (
	//go:embed scripts/book.lua
	bookSrc    string
	bookScript = redis.NewScript(bookSrc)

	//go:embed scripts/refund.lua
	refundSrc    string
	refundScript = redis.NewScript(refundSrc)

	//go:embed scripts/heartbeat.lua
	heartbeatSrc    string
	heartbeatScript = redis.NewScript(heartbeatSrc)
)

// Defaults for New.
const (
	DefaultPrefix  = "slotbook:"
	DefaultTimeout = 50 * time.Millisecond
)

// MaxKeyLen is the longest key (before the prefix) the engine accepts.
const MaxKeyLen = 1024

// MaxBatch is the most requests one BookBatch call takes.
const MaxBatch = 1000

// Forever, as a Request's MaxWait, accepts a slot however far away it is.
const Forever = time.Duration(math.MaxInt64)

// An Engine books GCRA slots in Redis. It holds no state of its own besides
// its configuration: all limiter state is in Redis, one integer per key, so
// any number of Engines in any number of processes share one quota per key.
//
// An Engine is safe for concurrent use. Build one with New; the zero Engine
// is not usable.
type Engine struct {
	rdb      redis.Scripter
	prefix   string
	timeout  time.Duration
	observer Observer
	breaker  *breaker
}

// An Option configures an Engine in New.
type Option func(*Engine) error

// WithPrefix sets the prefix put before every key (default "slotbook:").
func WithPrefix(prefix string) Option {
	return func(e *Engine) error {
		e.prefix = prefix
		return nil
	}
}

// WithTimeout bounds every Redis call the Engine makes (default 50ms). Zero
// means no bound beyond the caller's context. For the bound to cut a call
// short rather than only abandon it, build the go-redis client with
// ContextTimeoutEnabled: true.
func WithTimeout(d time.Duration) Option {
	return func(e *Engine) error {
		if d < 0 {
			return fmt.Errorf("throttle: negative timeout %v", d)
		}
		e.timeout = d
		return nil
	}
}

// WithObserver reports every decision, Redis call, refund and breaker
// change to o (package metrics has one for Prometheus).
func WithObserver(o Observer) Option {
	return func(e *Engine) error {
		if o == nil {
			return errors.New("throttle: nil observer")
		}
		e.observer = o
		return nil
	}
}

// WithProbeBackoff sets how often, while Redis is unavailable, one call is
// let through to see whether it is back: first after min, then doubling up
// to max (defaults DefaultProbeMin, DefaultProbeMax).
func WithProbeBackoff(min, max time.Duration) Option {
	return func(e *Engine) error {
		if min <= 0 || max < min {
			return fmt.Errorf("throttle: probe backoff %v to %v: want 0 < min <= max", min, max)
		}
		e.breaker.min, e.breaker.max = min, max
		return nil
	}
}

// New returns an Engine that runs its scripts through rdb: a go-redis
// Client, ClusterClient, Ring or failover client all fit. New makes no
// network call; the scripts are sent on first use (or by Load).
func New(rdb redis.Scripter, opts ...Option) (*Engine, error) {
	if rdb == nil {
		return nil, errors.New("throttle: nil Redis client")
	}
	e := &Engine{
		rdb: rdb, prefix: DefaultPrefix, timeout: DefaultTimeout, observer: nopObserver{},
		breaker: &breaker{min: DefaultProbeMin, max: DefaultProbeMax},
	}
	for _, opt := range opts {
		if err := opt(e); err != nil {
			return nil, err
		}
	}
	e.breaker.notify = e.observer.ObserveBreaker
	return e, nil
}

// Observer returns the engine's observer (a no-op one if none was set), for
// layers above that make decisions of their own, such as fallbacks.
func (e *Engine) Observer() Observer { return e.observer }

// Unavailable reports whether calls are failing fast because Redis is
// unavailable, and if so how long until the next probe.
func (e *Engine) Unavailable() (bool, time.Duration) {
	d := e.breaker.retryAfter()
	e.breaker.mu.Lock()
	open := e.breaker.open
	e.breaker.mu.Unlock()
	return open, d
}

// Load sends the engine's scripts to Redis, so that the first booking does
// not pay for a NOSCRIPT round trip. Calling it is optional.
func (e *Engine) Load(ctx context.Context) error {
	ctx, cancel := e.callContext(ctx)
	defer cancel()
	for _, s := range []*redis.Script{bookScript, refundScript, heartbeatScript} {
		if err := s.Load(ctx, e.rdb).Err(); err != nil {
			return fmt.Errorf("throttle: load scripts: %w", err)
		}
	}
	return nil
}

// Result is the outcome of a check-mode call (Allow, AllowN).
type Result struct {
	// Allowed reports whether the request passed; if so it has been counted.
	Allowed bool
	// Remaining is how many more units would pass right now.
	Remaining int
	// RetryAfter is, for a denied request, the exact time until a request of
	// the same size would pass if nobody else takes the room first. It is 0
	// when Allowed.
	RetryAfter time.Duration
	// ResetAfter is the time until the key is back to its idle state, with
	// Burst+1 units available.
	ResetAfter time.Duration
}

// Allow is shorthand for AllowN(ctx, key, limit, 1).
func (e *Engine) Allow(ctx context.Context, key string, limit Limit) (Result, error) {
	return e.AllowN(ctx, key, limit, 1)
}

// AllowN reports whether n units may pass for key now, and counts them if
// so. A denial is a Result with Allowed false, not an error; an error means
// the request was bad (ErrInvalidLimit, ErrExceedsBurst, ErrInvalidRequest;
// no Redis call made) or Redis failed.
func (e *Engine) AllowN(ctx context.Context, key string, limit Limit, n int) (Result, error) {
	bs, err := e.bookBatch(ctx, key, limit, []Request{{N: n, MaxWait: 0}})
	if err != nil {
		return Result{}, err
	}
	b := bs[0]
	I := limit.intervalMicros()
	tau := I * int64(limit.Burst)
	remaining := (b.now+tau-b.end)/I + 1
	remaining = max(0, min(remaining, int64(limit.Burst)+1))
	r := Result{
		Allowed:    b.OK,
		Remaining:  int(remaining),
		ResetAfter: time.Duration(max(0, b.end-b.now)) * time.Microsecond,
	}
	if !b.OK {
		r.RetryAfter = b.Wait
		e.observer.ObserveDecision(label(key), Denied, b.Wait)
	} else {
		e.observer.ObserveDecision(label(key), Allowed, 0)
	}
	return r, nil
}

// A Request asks for N units with a bound on the wait for their slot.
type Request struct {
	N       int           // units wanted, 1 to Burst+1
	MaxWait time.Duration // longest acceptable wait, >= 0; Forever for no bound
}

// A Booking is the engine's answer to one Request.
type Booking struct {
	// OK reports whether the slot was booked. A refused request booked
	// nothing.
	OK bool
	// N is the number of units asked for.
	N int
	// Wait is the exact delay, measured on the Redis clock at the moment of
	// the decision, until the slot. For a refusal it is the delay the slot
	// would have needed: the exact retry-after.
	Wait time.Duration
	// At is the slot on the Redis clock (decision time plus Wait).
	At time.Time

	now int64 // decision time, microseconds on the Redis clock
	end int64 // TAT after the decision
}

// Book is shorthand for BookBatch with one request.
func (e *Engine) Book(ctx context.Context, key string, limit Limit, req Request) (Booking, error) {
	bs, err := e.BookBatch(ctx, key, limit, []Request{req})
	if err != nil {
		return Booking{}, err
	}
	return bs[0], nil
}

// BookBatch judges reqs in order against key in one Redis call, booking each
// one whose slot lies within its MaxWait. Each request is judged on its own:
// a refusal books nothing and does not stop the requests after it. The
// result has one Booking per request, in the same order.
//
// Bad input (an invalid limit, an empty or over-long key, N <= 0,
// N > Burst+1, a negative MaxWait, no requests or more than MaxBatch) is
// reported before any Redis call.
func (e *Engine) BookBatch(ctx context.Context, key string, limit Limit, reqs []Request) ([]Booking, error) {
	bs, err := e.bookBatch(ctx, key, limit, reqs)
	for _, b := range bs {
		if b.OK {
			e.observer.ObserveDecision(label(key), Booked, b.Wait)
		} else {
			e.observer.ObserveDecision(label(key), Refused, b.Wait)
		}
	}
	return bs, err
}

func (e *Engine) bookBatch(ctx context.Context, key string, limit Limit, reqs []Request) ([]Booking, error) {
	if err := checkKeyLimit(key, limit); err != nil {
		return nil, err
	}
	if len(reqs) == 0 || len(reqs) > MaxBatch {
		return nil, fmt.Errorf("%w: batch of %d requests (want 1 to %d)", ErrInvalidRequest, len(reqs), MaxBatch)
	}
	I := limit.intervalMicros()
	args := make([]any, 0, 3+2*len(reqs))
	args = append(args, I, I*int64(limit.Burst), nowArg(ctx))
	for _, r := range reqs {
		if err := checkRequest(r, limit); err != nil {
			return nil, err
		}
		w := int64(-1)
		if us := ceilMicros(r.MaxWait); r.MaxWait != Forever && us < maxMicros {
			w = us
		}
		args = append(args, r.N, w)
	}

	vals, err := e.run(ctx, bookScript, key, args, 1+3*len(reqs))
	if err != nil {
		return nil, fmt.Errorf("throttle: book %q: %w", key, err)
	}
	now := vals[0]
	out := make([]Booking, len(reqs))
	for i := range reqs {
		v := vals[1+3*i : 4+3*i]
		out[i] = Booking{
			OK:   v[0] == 1,
			N:    reqs[i].N,
			Wait: time.Duration(v[1]) * time.Microsecond,
			At:   time.UnixMicro(now + v[1]),
			now:  now,
			end:  v[2],
		}
	}
	return out, nil
}

// Refund gives back b, which must have been booked for key under limit, as
// golang.org/x/time/rate's Reservation.Cancel does: only if its slot has not
// come yet, and only the part that bookings made after it have not built
// on, so they keep their slots. It returns how much time was given back.
// Refunding a refused booking, or one whose slot has passed, is a no-op.
func (e *Engine) Refund(ctx context.Context, key string, limit Limit, b Booking) (time.Duration, error) {
	if err := checkKeyLimit(key, limit); err != nil {
		return 0, err
	}
	if !b.OK {
		return 0, nil
	}
	length := int64(b.N) * limit.intervalMicros()
	slot := b.now + int64(b.Wait/time.Microsecond)
	vals, err := e.run(ctx, refundScript, key, []any{length, b.end, slot, nowArg(ctx)}, 2)
	if err != nil {
		return 0, fmt.Errorf("throttle: refund %q: %w", key, err)
	}
	given := time.Duration(vals[1]) * time.Microsecond
	e.observer.ObserveRefund(label(key), given)
	return given, nil
}

// Heartbeat records that the process id is alive under name for ttl and
// returns how many processes are (at least 1). Fallback policies that share
// the limit locally while Redis is down use it, once per interval, never
// per request. The set lives at the key "instances:"+name (prefixed).
func (e *Engine) Heartbeat(ctx context.Context, name, id string, ttl time.Duration) (int, error) {
	if name == "" || id == "" || ttl < time.Millisecond {
		return 0, fmt.Errorf("%w: heartbeat needs a name, an id and a TTL of at least 1ms", ErrInvalidRequest)
	}
	ms := int64(ttl / time.Millisecond)
	ctx, cancel := e.callContext(ctx)
	defer cancel()
	n, err := heartbeatScript.Run(ctx, e.rdb, []string{e.prefix + "instances:" + name}, id, ms).Int()
	if err != nil {
		return 0, fmt.Errorf("throttle: heartbeat %q: %w", name, err)
	}
	return max(n, 1), nil
}

// run runs s on the prefixed key through the breaker, within the timeout,
// and checks that the reply is an array of want integers.
func (e *Engine) run(ctx context.Context, s *redis.Script, key string, args []any, want int) ([]int64, error) {
	if !e.breaker.allow() {
		return nil, fmt.Errorf("%w (failing fast until a probe succeeds)", ErrUnavailable)
	}
	callCtx, cancel := e.callContext(ctx)
	defer cancel()
	start := time.Now()
	reply, err := s.Run(callCtx, e.rdb, []string{e.prefix + key}, args...).Result()
	e.observer.ObserveCall(label(key), time.Since(start), err)
	switch {
	case err == nil:
		e.breaker.success()
		return int64s(reply, want)
	case ctx.Err() != nil: // the caller gave up: no verdict on Redis
		e.breaker.abandon()
		return nil, err
	case unavailable(err):
		e.breaker.failure()
		return nil, fmt.Errorf("%w: %w", ErrUnavailable, err)
	default: // Redis answered, with an error
		e.breaker.success()
		return nil, err
	}
}

func (e *Engine) callContext(ctx context.Context) (context.Context, context.CancelFunc) {
	if e.timeout > 0 {
		return context.WithTimeout(ctx, e.timeout)
	}
	return ctx, func() {}
}

// int64s checks that reply is an array of exactly want integers.
func int64s(reply any, want int) ([]int64, error) {
	arr, ok := reply.([]any)
	if !ok {
		return nil, fmt.Errorf("unexpected reply %T, want an array", reply)
	}
	if len(arr) != want {
		return nil, fmt.Errorf("unexpected reply of %d values, want %d", len(arr), want)
	}
	out := make([]int64, want)
	for i, v := range arr {
		n, ok := v.(int64)
		if !ok {
			return nil, fmt.Errorf("unexpected reply value %d: %T, want an integer", i, v)
		}
		out[i] = n
	}
	return out, nil
}

func nowArg(ctx context.Context) string {
	if now, ok := testhook.Now(ctx); ok {
		return strconv.FormatInt(now, 10)
	}
	return ""
}

func checkKeyLimit(key string, limit Limit) error {
	if err := limit.Validate(); err != nil {
		return err
	}
	return CheckKey(key)
}

// CheckKey reports whether key is acceptable to the engine: not empty and
// at most MaxKeyLen bytes. The error matches ErrInvalidRequest.
func CheckKey(key string) error {
	if key == "" {
		return fmt.Errorf("%w: empty key", ErrInvalidRequest)
	}
	if len(key) > MaxKeyLen {
		return fmt.Errorf("%w: key of %d bytes (at most %d)", ErrInvalidRequest, len(key), MaxKeyLen)
	}
	return nil
}

// CheckRequest reports whether r can ever be granted under limit: the error
// matches ErrInvalidRequest for N <= 0 or a negative MaxWait, and
// ErrExceedsBurst for N > Burst+1.
func CheckRequest(r Request, limit Limit) error {
	if err := limit.Validate(); err != nil {
		return err
	}
	return checkRequest(r, limit)
}

func checkRequest(r Request, limit Limit) error {
	switch {
	case r.N <= 0:
		return fmt.Errorf("%w: n = %d must be positive", ErrInvalidRequest, r.N)
	case r.N > limit.Burst+1:
		return fmt.Errorf("%w: n = %d > burst+1 = %d under %v", ErrExceedsBurst, r.N, limit.Burst+1, limit)
	case r.MaxWait < 0:
		return fmt.Errorf("%w: negative max wait %v", ErrInvalidRequest, r.MaxWait)
	}
	return nil
}
