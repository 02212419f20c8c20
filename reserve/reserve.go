// Package reserve is the client most users hold: a Limiter that books the
// next free slot of a shared quota in Redis with one call, tells the caller
// exactly how long to wait, and refuses at once, booking nothing, when the
// slot would land past the caller's context deadline or the configured max
// wait.
//
// Its shape follows golang.org/x/time/rate: Allow/AllowN check without
// waiting, Reserve/ReserveN book and return a Reservation, Acquire/AcquireN
// book and sleep until the slot.
package reserve

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/slotbook/slotbook/deadline"
	"github.com/slotbook/slotbook/internal/testhook"
	"github.com/slotbook/slotbook/internal/waitbound"
	"github.com/slotbook/slotbook/throttle"
)

// Re-exported from package deadline so callers can branch with one import.
var (
	ErrMaxWaitExceeded     = deadline.ErrMaxWaitExceeded
	ErrWouldExceedDeadline = deadline.ErrWouldExceedDeadline
)

// A Limiter enforces one Limit, shared through Redis, for each subject key
// under a name: "stripe" and "tenant-42" share one quota with every other
// process that uses the same name and key.
//
// A Limiter is safe for concurrent use. Build one with New; the zero
// Limiter is not usable.
type Limiter struct {
	eng     *throttle.Engine
	name    string
	limit   throttle.Limit   // the first limit
	limits  []throttle.Limit // all of them, the first first
	maxWait time.Duration    // deadline.NoCap when unset
	work    time.Duration
	clock   clock

	fallback *fallback // nil: Redis failures are errors

	coalesce  bool
	maxQueue  int
	soloBelow int
	mu        sync.Mutex           // guards keys and spare, and the keyStates
	keys      map[string]*keyState // per subject key with callers in coalesced
	spare     []*keyState          // keyStates of keys gone idle, for reuse

	giving *giving // shared with the Limiter's views (With)
}

// giving holds, per subject key, the give-backs of late bookings under way
// (giveBackLate), each closed once done: a booking or check (AllowN) of
// the key waits for them (awaitGiven), since, made first, it would stand
// on them and they would give nothing back. n counts them, so that a
// booking finds none without taking mu. A Limiter and its views share it,
// as they share the quota.
type giving struct {
	mu   sync.Mutex
	keys map[string][]chan struct{}
	n    atomic.Int64
}

// An Option configures a Limiter in New.
type Option func(*Limiter) error

// WithMaxWait caps how long a reservation may wait for its slot. A request
// whose slot is further away is refused with ErrMaxWaitExceeded and books
// nothing. Zero means "only an immediate slot". Without this option the
// wait is bounded only by the context's deadline.
func WithMaxWait(d time.Duration) Option {
	return func(l *Limiter) error {
		if d < 0 {
			return fmt.Errorf("%w: negative max wait %v", throttle.ErrInvalidRequest, d)
		}
		l.maxWait = d
		return nil
	}
}

// WithLimit adds limits that every request must satisfy as well, judged
// together in the same Redis call: 10 a second and 10,000 a day, say. A
// request's slot is the earliest time every limit allows it; a refusal
// books nothing in any of them; a refund gives back to each. Each limit
// needs a period of its own, a whole number of milliseconds (the error
// matches throttle.ErrInvalidLimit otherwise). The first limit's key is
// "name:{subject}", the others' "name:{subject}:<period in ms>ms" (a day:
// ":86400000ms", wire protocol 2, docs/PROTOCOL.md): one hash tag, so one
// Redis Cluster node.
func WithLimit(limits ...throttle.Limit) Option {
	return func(l *Limiter) error {
		for _, lim := range limits {
			if err := lim.Validate(); err != nil {
				return err
			}
			if lim.Period%time.Millisecond != 0 {
				return fmt.Errorf("reserve: the period %v of a further limit is not a whole number of milliseconds, "+
					"which its key is named after: %w", lim.Period, throttle.ErrInvalidLimit)
			}
			for _, have := range l.limits {
				if have.Period == lim.Period {
					return fmt.Errorf("reserve: two limits with the period %v (%v and %v)", lim.Period, have, lim)
				}
			}
			l.limits = append(l.limits, lim)
		}
		if len(l.limits) > throttle.MaxLimits {
			return fmt.Errorf("reserve: %d limits (at most %d)", len(l.limits), throttle.MaxLimits)
		}
		return nil
	}
}

// WithoutMaxWait removes the cap on the wait: only the context's deadline
// bounds it (the default). Useful with Limiter.With.
func WithoutMaxWait() Option {
	return func(l *Limiter) error {
		l.maxWait = deadline.NoCap
		return nil
	}
}

// WithWorkEstimate sets how long the work after the slot is expected to
// take. It is subtracted from the context's deadline: a request whose slot
// would not leave that much time is refused with ErrWouldExceedDeadline.
func WithWorkEstimate(d time.Duration) Option {
	return func(l *Limiter) error {
		if d < 0 {
			return fmt.Errorf("reserve: negative work estimate %v", d)
		}
		l.work = d
		return nil
	}
}

// WithCoalescing turns the sharing of Redis calls between concurrent
// callers for one key on (the default) or off. On, up to three callers of a
// key send calls of their own beside the one in flight; more queue and share
// the next call. Off, every ReserveN goes to the engine on its own; the
// engine may still merge bookings that find every connection busy into
// one call (throttle.WithMerging, on by default: turn it off too for a
// call per ReserveN).
func WithCoalescing(on bool) Option {
	return func(l *Limiter) error {
		l.coalesce = on
		return nil
	}
}

// New returns a Limiter enforcing limit for each key under name, through
// eng. It validates its arguments and makes no network call.
func New(eng *throttle.Engine, name string, limit throttle.Limit, opts ...Option) (*Limiter, error) {
	if eng == nil {
		return nil, errors.New("reserve: nil engine")
	}
	if name == "" || strings.ContainsAny(name, ":{}") {
		return nil, fmt.Errorf("reserve: name %q must be non-empty and free of ':', '{' and '}'", name)
	}
	if err := limit.Validate(); err != nil {
		return nil, err
	}
	l := &Limiter{
		eng: eng, name: name, limit: limit, limits: []throttle.Limit{limit}, maxWait: deadline.NoCap, clock: realClock{},
		coalesce: true, maxQueue: defaultMaxQueue, soloBelow: soloBelow,
		keys: make(map[string]*keyState), giving: &giving{keys: make(map[string][]chan struct{})},
	}
	for _, opt := range opts {
		if err := opt(l); err != nil {
			return nil, err
		}
	}
	return l, nil
}

// With returns a Limiter sharing l's engine, name and limits (and so its
// quota) with opts applied over l's own options: for example a different
// max wait for one kind of caller. The view shares l's fallback state too
// (LocalShare's local limiters and heartbeat), so that all views of one
// quota together admit one local share while Redis is unavailable; a
// WithFallback or WithLimit among opts gives the view state of its own.
// A view and l wait for each other's give-backs of late bookings of a key
// before they book it (see ReserveBatch); each coalesces its own callers.
func (l *Limiter) With(opts ...Option) (*Limiter, error) {
	base := []Option{WithMaxWait(l.maxWait), WithWorkEstimate(l.work), WithCoalescing(l.coalesce), WithLimit(l.limits[1:]...)}
	nl, err := New(l.eng, l.name, l.limit, append(base, opts...)...)
	if err != nil {
		return nil, err
	}
	nl.clock, nl.giving = l.clock, l.giving
	if nl.fallback == nil && l.fallback != nil {
		if slices.Equal(nl.limits, l.limits) {
			nl.fallback = l.fallback
		} else if err := WithFallback(l.fallback.Fallback)(nl); err != nil {
			return nil, err
		}
	}
	return nl, nil
}

// Name returns the limiter's name.
func (l *Limiter) Name() string { return l.name }

// Engine returns the engine the limiter books through.
func (l *Limiter) Engine() *throttle.Engine { return l.eng }

// Limit returns the limiter's first Limit.
func (l *Limiter) Limit() throttle.Limit { return l.limit }

// Limits returns all the limiter's limits, the first first.
func (l *Limiter) Limits() []throttle.Limit { return append([]throttle.Limit(nil), l.limits...) }

// MaxWait returns the configured max wait, and false if none is set.
func (l *Limiter) MaxWait() (time.Duration, bool) {
	return l.maxWait, l.maxWait != deadline.NoCap
}

// WorkEstimate returns the work estimate (WithWorkEstimate): how much time
// a slot must leave before the caller's deadline. 0 if none is set.
func (l *Limiter) WorkEstimate() time.Duration { return l.work }

// CheckKey reports whether key is an acceptable subject key: not empty,
// and not so long that the engine would refuse it. The error matches
// throttle.ErrInvalidRequest.
func (l *Limiter) CheckKey(key string) error {
	_, err := l.engineKey(key)
	return err
}

// engineKey returns the engine key (before the engine's prefix) of the
// first limit for subject key: "name:{key}".
func (l *Limiter) engineKey(key string) (string, error) {
	if err := l.checkSubject(key); err != nil {
		return "", err
	}
	return l.subjectKey(key), nil
}

// checkSubject reports whether subject key makes an engine key the engine
// accepts, without building it: a caller's own check, before anything is
// sent (coalesced callers build the key once per batch).
func (l *Limiter) checkSubject(key string) error {
	switch {
	case key == "":
		return fmt.Errorf("%w: empty key", throttle.ErrInvalidRequest)
	case len(l.name)+len(":{}")+len(key)+24 > throttle.MaxKeyLen: // room for a period suffix
		return fmt.Errorf("%w: key of %d bytes", throttle.ErrInvalidRequest, len(key))
	case key[0] == '}':
		// The name holds no brace, so the hash tag of "name:{key}" ends at
		// key's first '}': a subject such as "}" leaves none.
		return throttle.CheckKey(l.subjectKey(key))
	}
	return nil
}

// subjectKey is "name:{key}", the engine key of the first limit.
func (l *Limiter) subjectKey(key string) string { return l.name + ":{" + key + "}" }

// keysOf returns the engine keys of every limit, given the first's: the
// others end in their period in whole milliseconds, ":86400000ms" for a
// day (wire protocol 2; protocol 1 used Go's Duration.String, ":24h0m0s").
func (l *Limiter) keysOf(first string) []string {
	return l.keysIn(first, nil)
}

// keysIn is keysOf, in one for a single limit (the common case: a caller's
// array, kept off the heap where the keys do not outlive the call).
func (l *Limiter) keysIn(first string, one *[1]string) []string {
	if len(l.limits) == 1 && one != nil {
		one[0] = first
		return one[:]
	}
	keys := make([]string, len(l.limits))
	keys[0] = first
	for i, lim := range l.limits[1:] {
		keys[i+1] = first + ":" + strconv.FormatInt(lim.Period.Milliseconds(), 10) + "ms"
	}
	return keys
}

// checkN reports whether n units can ever pass every limit.
func (l *Limiter) checkN(n int) error {
	for _, lim := range l.limits {
		if err := throttle.CheckRequest(throttle.Request{N: n}, lim); err != nil {
			return err
		}
	}
	return nil
}

// Allow is shorthand for AllowN(ctx, key, 1).
func (l *Limiter) Allow(ctx context.Context, key string) (throttle.Result, error) {
	return l.AllowN(ctx, key, 1)
}

// AllowN reports whether n units may pass for key now, counting them if
// so, without booking a future slot: check mode. As with ReserveN, a ctx
// that ends while the call is out does not cut it short: the caller gets
// ctx's error once the reply is in, and what it counted goes back (see
// throttle.Engine.AllowN).
func (l *Limiter) AllowN(ctx context.Context, key string, n int) (throttle.Result, error) {
	k, err := l.engineKey(key)
	if err != nil {
		return throttle.Result{}, err
	}
	l.awaitGiven(ctx, k)
	var one [1]string
	res, err := l.eng.AllowAll(ctx, l.keysIn(k, &one), l.limits, n)
	switch {
	case err == nil:
		l.heartbeat(ctx)
	case l.useFallback(ctx, k, err) && waitbound.Ended(ctx) == nil:
		return l.fallbackAllow(ctx, k, n)
	}
	return res, err
}

// Reserve is shorthand for ReserveN(ctx, key, 1).
func (l *Limiter) Reserve(ctx context.Context, key string) (*Reservation, error) {
	return l.ReserveN(ctx, key, 1)
}

// ReserveN books the next slot for n units of key, with one Redis call, and
// returns without waiting. If the slot lies within the budget (the max
// wait, and the context deadline less the work estimate) the Reservation
// is OK and the caller should act after its Delay. If not, nothing is
// booked and the Reservation is not OK: its Err says why and carries the
// exact retry-after. A refusal is not an error; err is non-nil only for bad
// input (no Redis call made), a done context, or a Redis failure.
//
// Once its call is sent, ctx's deadline does not cut it short: a caller
// whose context ends, or whose deadline passes, while the call is out gets
// the context's error once the reply is in, and the slot booked for it is
// given back (as Cancel gives back: in full unless a later booking stands
// on it). Cut short, the call would lose its reply, and the slot's room
// with it. That wait is bounded by the engine's timeout (throttle's
// WithTimeout; four times it for the call that probes an open breaker),
// and the give-back's by a second. With no engine timeout, ctx bounds a
// call that is its caller's alone as it would any other, and the client's
// own timeouts (its ReadTimeout) one shared with other callers of the key.
//
// Concurrent calls for the same key share Redis calls (see WithCoalescing):
// a caller that finds fewer than four other callers of the key is sent at
// once; more callers arriving while a call is in flight go together in the
// next one, each judged on its own budget. In a shared call, the slots of
// callers that will not act (gone, or made late by the reply's latency)
// go to the call's later callers of as many units, who act earlier for
// it, and the call's latest slots go back in full (see ReserveBatch).
func (l *Limiter) ReserveN(ctx context.Context, key string, n int) (*Reservation, error) {
	return l.reserveN(ctx, key, n, l.maxWait)
}

// ReserveWithin is ReserveN with a max wait of its own, maxWait, where it
// is shorter than the limiter's (WithMaxWait): for a caller that has spent
// part of its max wait already, as package httplimit's requests booking
// again behind a pause have. A slot beyond it is refused with
// ErrMaxWaitExceeded. The call coalesces with the limiter's other
// callers. A negative maxWait is bad input (no Redis call made).
func (l *Limiter) ReserveWithin(ctx context.Context, key string, n int, maxWait time.Duration) (*Reservation, error) {
	if maxWait < 0 {
		return nil, fmt.Errorf("%w: negative max wait %v", throttle.ErrInvalidRequest, maxWait)
	}
	return l.reserveN(ctx, key, n, min(maxWait, l.maxWait))
}

// reserveN is ReserveN with the call's max wait.
func (l *Limiter) reserveN(ctx context.Context, key string, n int, maxWait time.Duration) (*Reservation, error) {
	if err := l.checkSubject(key); err != nil {
		return nil, err
	}
	if err := l.checkN(n); err != nil {
		return nil, err
	}
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	c := &call{ctx: ctx, n: n, maxWait: maxWait}
	if l.coalesce {
		return l.coalesced(key, c)
	}
	// As a coalesced caller's: the call is not cut short once sent (a
	// deadline passing in flight would lose the reply, and the booking's
	// room with it); ended meanwhile, the caller gets its context's error
	// and the booking goes back.
	return l.sendAlone(key, c)
}

// A BatchRequest is one request of ReserveBatch.
type BatchRequest struct {
	// Context bounds this request's wait by its deadline, as ReserveN's ctx
	// does; nil means the batch's ctx.
	Context context.Context
	// N is the number of units, 1 to Burst+1.
	N int
	// HoldLate leaves this request's booking to the caller if the reply's
	// latency makes it late: Redis booked a slot within the request's
	// budget, but acting at it, counted from the reply's arrival, would
	// end past the deadline. The Reservation is refused all the same (Err
	// matching ErrWouldExceedDeadline), but it holds the booking:
	// Booking().OK is true and Cancel gives it back (even once its slot
	// has come: no one acts on a refusal), or Claim hands it to a caller
	// that can act in its slot. So does a request whose Context ends
	// while the call is out: refused with the context's error, holding
	// its booking. Unset, ReserveBatch gives such bookings back itself.
	//
	// A caller that gives back several bookings of one key (a pool whose
	// jobs are cancelled) sets it, so that it can give them all back
	// latest first: a booking gives its room back only while nothing
	// booked after it stands (see Reservation.Cancel), and ReserveBatch
	// cannot know which of the later ones the caller will give back. (The
	// late bookings ReserveBatch gives back itself go out after the batch
	// has returned, so as not to hold back the others' answers; the
	// Cancel of any booking of the batch, held or not, waits until they
	// are in, and so does the Limiter's next booking of the key, which
	// would otherwise stand on them. A refusal that holds nothing has
	// nothing to give back, and its Cancel returns at once.)
	HoldLate bool
}

// ReserveBatch books reqs for key in order, in one Redis call, each judged
// on its own budget exactly as ReserveN would judge it. It returns one
// Reservation per request (a refused one is not OK), or an error for bad
// input (nothing sent), a Redis failure (nothing booked, except where the
// error matches throttle.ErrReplyLost: the call may have run, and its
// bookings then stand until they lapse) or ctx ending before the reply
// is in (what was booked given back before it returns,
// all of it in one refund: see throttle.Engine.BookAll). A request
// whose Context has ended by the time the call is sent books nothing: its
// Reservation is not OK and its Err is the context's error (no call is
// made if every request's has). A request whose Context ends while the
// call is out is refused with the context's error, and one that the
// reply's latency made late with ErrWouldExceedDeadline; neither holds a
// booking, unless it asks to hold it (HoldLate: the Reservation is
// refused all the same, and holds its booking).
//
// The slots of the requests that will not act are handed down: the
// requests that stand (booked, or held) take, in order, the earliest of
// the batch's bookings of their number of units that lies after the one
// taken by the request before them that stands, each no later than its
// own (so a request may get an earlier slot than Redis booked for it, and
// one made late at its own slot may fit its deadline at an earlier one);
// the bookings that stand keep the requests' order. The latest are given
// back at once (after ReserveBatch has returned; the Limiter books the key
// again only once they are in). A booking gives its room back only
// while nothing booked after it stands, so one left under a booking that
// is used would pass unused. Bookings of another number of units do not
// change hands: a refused request's booking under a later one that stands
// goes back with that one's Cancel (cancelled latest first, in the
// requests' reverse order, all of the batch's room comes back). It is
// what a worker pool uses to book slots for its backlog.
func (l *Limiter) ReserveBatch(ctx context.Context, key string, reqs []BatchRequest) ([]*Reservation, error) {
	k, err := l.engineKey(key)
	if err != nil {
		return nil, err
	}
	if len(reqs) == 0 || len(reqs) > throttle.MaxBatch {
		return nil, fmt.Errorf("%w: batch of %d requests (want 1 to %d)", throttle.ErrInvalidRequest, len(reqs), throttle.MaxBatch)
	}
	calls := make([]*call, len(reqs))
	for i, r := range reqs {
		if err := l.checkN(r.N); err != nil {
			return nil, fmt.Errorf("request %d: %w", i, err)
		}
		c := &call{ctx: r.Context, n: r.N, hold: r.HoldLate, maxWait: l.maxWait}
		if c.ctx == nil {
			c.ctx = ctx
		}
		calls[i] = c
	}
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	// Once sent, the call is not cut short by ctx's deadline, and if ctx
	// has ended by the time the reply is in, the engine gives back what
	// the call booked, in one refund (throttle.Engine.BookAll), and
	// answers with ctx's error.
	late := l.book(ctx, k, calls)
	if err := waitbound.Ended(ctx); err != nil {
		// Ended in flight: the caller never had its answer. As ReserveN's,
		// it gets its context's error, and what was booked goes back
		// before it returns: the engine's, or, for a ctx that ended just
		// after the engine looked, here.
		l.giveBackEnded(ctx, k, late, calls)
		for _, c := range calls {
			if c.err != nil {
				return nil, endedErr(err, c.err)
			}
		}
		return nil, err
	}
	l.giveBackLate(ctx, k, late, lateAfter(late, calls))
	out := make([]*Reservation, len(calls))
	for i, c := range calls {
		if c.err != nil {
			return nil, c.err
		}
		out[i] = c.res
	}
	return out, nil
}

// book judges calls for key in one engine call (ctx bounds the call) and
// sets each call's res or err. A call whose budget is already spent is
// refused without being sent, and one whose context has ended is answered
// with its error, nothing booked; if none is left, no call is made. It returns
// the bookings refused once the reply was in that lie above every booking
// that stands, the earliest first, for the caller to give back with
// giveBackLate once every call has its answer (so that the refunds' round
// trip does not hold back the calls that were booked).
func (l *Limiter) book(ctx context.Context, key string, calls []*call) (late []throttle.Booking) {
	// The local time is read only for a caller with a deadline, whose
	// budget counts from it (a clock read costs on the hot path).
	var now time.Time
	// A caller alone (the common case) needs no slices on the heap.
	var (
		reqBuf [1]throttle.Request
		outBuf [1]sent
	)
	reqs, out := reqBuf[:0], outBuf[:0]
	for _, c := range calls {
		if err := c.ctx.Err(); err != nil {
			// Its caller is gone (a queued caller cancelled as its batch
			// was taken, a pool job cancelled as it was booked): a slot
			// booked for it would cost a second call to give back. Its
			// answer is ReserveN's for an ended context, whatever its
			// deadline.
			c.res = &Reservation{lim: l, key: key, err: err}
			c.ended = true
			continue
		}
		if _, ok := c.ctx.Deadline(); ok && now.IsZero() {
			now = l.clock.Now()
		}
		budget, bound := deadline.Budget(c.ctx, now, c.maxWait, l.work)
		if budget < 0 {
			c.res = &Reservation{lim: l, key: key, err: deadline.Refuse(bound, budget, 0)}
			l.eng.Observer().ObserveDecision(l.name, throttle.Refused, 0)
			continue
		}
		maxWait := budget
		if maxWait == deadline.NoCap {
			maxWait = throttle.Forever
		}
		reqs = append(reqs, throttle.Request{N: c.n, MaxWait: maxWait})
		out = append(out, sent{c: c, budget: budget, bound: bound})
	}
	if len(reqs) == 0 {
		return nil
	}
	l.awaitGiven(ctx, key)
	var one [1]string
	bs, err := l.eng.BookAll(ctx, l.keysIn(key, &one), l.limits, reqs)
	// The waits were measured on the Redis clock at some point before the
	// reply arrived; counting them from the arrival never starts early.
	arrived := l.clock.Now()
	if err == nil {
		l.heartbeat(ctx)
	}
	useFallback := l.useFallback(ctx, key, err)
	var gone error // the whole call's caller has gone (ReserveBatch's)
	if useFallback {
		gone = waitbound.Ended(ctx)
	}
	var take []int // the booking each request takes, if not its own
	if err == nil && !useFallback {
		// Whether each caller has gone while the call was out, looked at
		// once: the hand-down and the answer must agree.
		for i := range out {
			if !out[i].c.hold {
				out[i].gone = out[i].c.ctx.Err()
			}
		}
		if len(out) > 1 {
			take = l.handDown(out, bs, arrived)
		}
	}
	anyLate := false // a booking refused late, or for a caller gone, and not held
	for i, s := range out {
		if useFallback {
			cerr := waitbound.Ended(s.c.ctx)
			if cerr == nil {
				cerr = gone
			}
			if cerr != nil {
				// Its caller is gone: no local slot for it (no one would
				// act on it, and a slot whose time has passed may not come
				// back whole), and the batch's other requests still get
				// the fallback's answer.
				s.c.res = &Reservation{lim: l, key: key, err: cerr}
				continue
			}
			// The local slot is taken now: the budget from now.
			budget, _ := deadline.Budget(s.c.ctx, arrived, s.c.maxWait, l.work)
			s.c.res = l.fallbackReserve(s.c.ctx, key, s.c.n, arrived, budget, err)
			continue
		}
		if err != nil {
			s.c.err = err
			continue
		}
		j := i
		if take != nil {
			j = take[i]
		}
		r := &Reservation{lim: l, key: key, booking: &bs[j]}
		act := arrived.Add(bs[j].Wait)
		tooLate := bs[j].OK && l.pastDeadline(s.c.ctx, act)
		switch {
		case !bs[j].OK:
			r.err = deadline.Refuse(s.bound, s.budget, bs[j].Wait)
		case tooLate && s.c.hold:
			// The reply's latency ate the room the budget left: the
			// caller would act too late. Refused, its booking left to
			// the caller, for Cancel or Claim.
			r.err = deadline.Refuse(deadline.ErrWouldExceedDeadline, s.budget, act.Sub(now))
			r.act = act // for Cancel's look at whether the slot has come
			r.held = true
		case s.c.hold && bs[j].OK && s.c.ctx.Err() != nil:
			// Its caller gone while the call was out: refused, its
			// booking left to the caller as a late one's is (no one acts
			// on it: Cancel gives it back even once its slot has come).
			r.err = s.c.ctx.Err()
			r.act = act
			r.held = true
		case tooLate || s.gone != nil:
			// Late, or its caller gone: refused, and the slot given back
			// here (see below).
			r.err = s.gone
			if tooLate {
				r.err = deadline.Refuse(deadline.ErrWouldExceedDeadline, s.budget, act.Sub(now))
			}
			r.act = act
			given := bs[j] // given back, see below (bs[j] stays as booked)
			given.OK = false
			r.booking = &given
			anyLate = true
		default:
			r.act = act
		}
		s.c.res = r
	}
	if !anyLate {
		return nil
	}
	// A late booking gives its room back only while nothing booked after
	// it stands. Those above every booking that stands (booked, or held
	// for its caller) go back at once, in one refund (late, for
	// giveBackLate); one under a booking that stands (of another number of
	// units, which the hand-down does not reach) goes back with the
	// nearest such booking above it, once that one's Cancel has given it
	// back (below): if that one is used instead, there is nothing to give.
	holder := func(i int) *Reservation { return out[i].c.res }
	if take != nil {
		byBooking := make([]*Reservation, len(out))
		for i, j := range take {
			byBooking[j] = out[i].c.res
		}
		holder = func(j int) *Reservation { return byBooking[j] }
	}
	var carrier *Reservation
	for i := len(out) - 1; i >= 0; i-- {
		r := holder(i)
		switch {
		case r.OK() || r.held:
			carrier = r
		case bs[i].OK && carrier != nil: // late, not held
			carrier.links().below = append(carrier.links().below, bs[i])
		case bs[i].OK:
			late = append(late, bs[i])
		}
	}
	slices.Reverse(late) // the earliest first, as a run (refundLate)
	return late
}

// handDown works out, for a batch of several requests (out) that Redis
// answered (bs), which booking each request takes, by its index in bs: the
// requests whose callers will act in their slot (or hold it, HoldLate)
// take, in order, each the earliest of the batch's bookings of its number
// of units that lies after the booking taken by the one before it (so
// that the bookings that stand keep the requests' order, and one given
// back latest first by request gives its room back), and those that will
// not (made late by the reply's latency, or whose caller has gone while
// the call was out) take the rest. A booking gives its room back only
// while nothing booked after it stands, so a slot left under one that is
// used would pass unused; on top, it goes back in full. Bookings of as
// many units span as much of the limit, so they change hands whole; and
// each request takes a booking no later than its own (its own is free,
// and lies after any taken before it), so it keeps within its budget. A
// request that Redis refused keeps its answer.
func (l *Limiter) handDown(out []sent, bs []throttle.Booking, arrived time.Time) []int {
	// The batch's bookings by number of units, in order, and which of
	// them are taken.
	type units struct {
		n     int
		slots []int
		taken []bool
	}
	var groups []units
	group := func(n int) *units {
		for g := range groups {
			if groups[g].n == n {
				return &groups[g]
			}
		}
		groups = append(groups, units{n: n})
		return &groups[len(groups)-1]
	}
	for i, s := range out {
		if bs[i].OK {
			g := group(s.c.n)
			g.slots = append(g.slots, i)
			g.taken = append(g.taken, false)
		}
	}
	take := make([]int, len(out))
	var left []int // the requests that will not act, in order
	floor := -1    // the booking taken by the last request that stands
	for i, s := range out {
		take[i] = i
		if !bs[i].OK {
			continue
		}
		g := group(s.c.n)
		k := 0
		for g.taken[k] || g.slots[k] < floor {
			k++
		}
		j := g.slots[k]
		if s.gone == nil && (s.c.hold || !l.pastDeadline(s.c.ctx, arrived.Add(bs[j].Wait))) {
			take[i], g.taken[k], floor = j, true, j
			continue
		}
		left = append(left, i)
	}
	for _, i := range left {
		g := group(out[i].c.n)
		k := 0
		for g.taken[k] {
			k++
		}
		take[i], g.taken[k] = g.slots[k], true
	}
	return take
}

// sent is a request book sends: its call, the budget it was judged on and
// what bounds it (for the refusal's error), and, once the reply is in,
// whether its caller has gone meanwhile (the context's error), for a
// request not held (HoldLate).
type sent struct {
	c      *call
	budget time.Duration
	bound  error
	gone   error
}

// giveBackLate gives back late, the bookings book refused once the reply
// was in and that nothing booked stands on (refundLate). With after (see
// lateAfter) it runs on a goroutine of its own, so that the batch's other
// calls have their answers first, and closes after once done; without,
// before it returns. Either way the give-back is bounded by a one-second
// timeout, and the Limiter's bookings of key wait for it (awaitGiven) from
// the moment giveBackLate is called.
func (l *Limiter) giveBackLate(ctx context.Context, key string, late []throttle.Booking, after chan struct{}) {
	if len(late) == 0 {
		return // the common case: no closure made
	}
	done := l.startGiving(key)
	run := func() {
		defer l.endGiving(key, done)
		cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), time.Second)
		defer cancel()
		_ = l.refundLate(cctx, key, late)
	}
	if after == nil {
		run()
		return
	}
	go func() {
		defer close(after)
		run()
	}()
}

// refundLate gives back late, bookings refused once the reply was in,
// never anyone's (so their room comes back even if their slot has come),
// that lie end to end above every booking of their batch that stands, the
// earliest first: in one refund (throttle.Engine.RefundUnusedRun), one
// round trip for all of them.
func (l *Limiter) refundLate(ctx context.Context, key string, late []throttle.Booking) error {
	_, err := l.eng.RefundUnusedRun(ctx, l.keysOf(key), l.limits, late)
	return err
}

// startGiving registers a give-back of key's late bookings under way and
// returns the channel endGiving closes.
func (l *Limiter) startGiving(key string) chan struct{} {
	g, done := l.giving, make(chan struct{})
	g.mu.Lock()
	g.keys[key] = append(g.keys[key], done)
	g.mu.Unlock()
	g.n.Add(1)
	return done
}

// endGiving ends the give-back of key's late bookings that startGiving
// registered as done.
func (l *Limiter) endGiving(key string, done chan struct{}) {
	g := l.giving
	g.mu.Lock()
	if gs := slices.DeleteFunc(g.keys[key], func(c chan struct{}) bool { return c == done }); len(gs) > 0 {
		g.keys[key] = gs
	} else {
		delete(g.keys, key)
	}
	g.mu.Unlock()
	g.n.Add(-1)
	close(done)
}

// awaitGiven waits, until ctx ends, for the give-backs of key's late
// bookings under way (see giving). Nothing is sent meanwhile.
func (l *Limiter) awaitGiven(ctx context.Context, key string) {
	g := l.giving
	if g.n.Load() == 0 {
		return // the common case: none, and no lock taken
	}
	g.mu.Lock()
	gs := slices.Clone(g.keys[key])
	g.mu.Unlock()
	for _, done := range gs {
		select {
		case <-done:
		case <-ctx.Done():
			return
		}
	}
}

// giveBackEnded gives back everything calls booked for a caller whose
// context ended while they were out, where the engine has not (the
// context ended just after it looked): the late bookings book returned
// (refundLate), then every booking that stands (held ones too), the
// latest first, so that each gives its room back as far as nothing booked
// since stands on it; a round trip each, each bounded by a second. It
// stops at the first that fails: the bookings under it could give nothing
// back while it stands.
func (l *Limiter) giveBackEnded(ctx context.Context, key string, late []throttle.Booking, calls []*call) {
	if len(late) > 0 {
		cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), time.Second)
		err := l.refundLate(cctx, key, late)
		cancel()
		if err != nil {
			return
		}
	}
	for _, c := range slices.Backward(calls) {
		if r := c.res; r != nil && (r.OK() || r.held) && r.giveBack(ctx, true) != nil {
			return
		}
	}
}

// endedErr is waitbound.EndedErr, keeping a lost reply or Redis
// unavailable in the chain.
func endedErr(err, cerr error) error {
	return waitbound.EndedErr(err, cerr, throttle.ErrReplyLost, throttle.ErrUnavailable)
}

// lateAfter returns, for a batch of several calls of which some were
// refused late (late), a channel that giveBackLate closes once it has
// given them back, and has every Reservation of the batch wait for it
// before it gives its own booking back (Cancel): a booking of the batch
// given back before a later one that is given back late would give
// nothing. It returns nil for a call alone or nothing late: giveBackLate
// then gives back before the caller has its answer. It is called before
// any of calls has its answer.
func lateAfter(late []throttle.Booking, calls []*call) chan struct{} {
	if len(late) == 0 || len(calls) == 1 {
		return nil
	}
	after := make(chan struct{})
	for _, c := range calls {
		if c.res != nil {
			c.res.links().after = after
		}
	}
	return after
}

// pastDeadline reports whether a caller acting at act would not finish
// the work estimate before ctx's deadline. The max wait, unlike the
// deadline, is judged on the Redis clock alone (the script's wait), so that
// WithMaxWait(0) still means "only an immediate slot" whatever the latency.
func (l *Limiter) pastDeadline(ctx context.Context, act time.Time) bool {
	dl, ok := ctx.Deadline()
	return ok && act.Add(l.work).After(dl)
}

// Reset clears subject key: its state in every limit is deleted (and so
// is any local fallback state for it), so its next request finds it idle.
// It is the way out of throttle.ErrCorruptState. Slots already handed out
// are not recalled.
func (l *Limiter) Reset(ctx context.Context, key string) error {
	k, err := l.engineKey(key)
	if err != nil {
		return err
	}
	if err := l.eng.Reset(ctx, l.keysOf(k)...); err != nil {
		return err
	}
	if l.fallback != nil && l.fallback.local != nil {
		l.fallback.forget(k)
	}
	return nil
}

// Pause makes sure no new slot for key is granted before d from now, in
// every process sharing the limit: shared back-off after an upstream
// answered "429, retry after d". Slots already booked keep their times
// (and cannot be given back below the pause's end: cancelling them gives
// nothing back); afterwards requests resume one interval apart. Nothing a
// later Cancel or booking does can shorten the pause.
func (l *Limiter) Pause(ctx context.Context, key string, d time.Duration) error {
	k, err := l.engineKey(key)
	if err != nil {
		return err
	}
	return l.eng.BlockAll(ctx, l.keysOf(k), l.limits, d)
}

// Acquire is shorthand for AcquireN(ctx, key, 1).
func (l *Limiter) Acquire(ctx context.Context, key string) error {
	return l.AcquireN(ctx, key, 1)
}

// AcquireN books the next slot for n units of key and sleeps until it. If
// the slot would lie beyond the budget it returns at once, having booked
// nothing, with an error matching ErrMaxWaitExceeded or
// ErrWouldExceedDeadline that carries the exact retry-after (see
// deadline.Error). If ctx is done while sleeping, the booking is cancelled
// (its slot given back) and ctx's error is returned.
func (l *Limiter) AcquireN(ctx context.Context, key string, n int) error {
	r, err := l.ReserveN(ctx, key, n)
	if err != nil {
		return err
	}
	return r.Wait(ctx)
}

// A Reservation is a booked slot (or a refusal) from ReserveN. Its methods
// are safe for concurrent use.
type Reservation struct {
	lim *Limiter
	key string
	// booking is the engine's answer, nil if none (a refusal before any
	// call, the fallback's answer). It points into the batch's slice of
	// answers, shared with the batch's other Reservations, and is never
	// written through: a copy of a Reservation's own replaces it.
	booking *throttle.Booking
	act     time.Time // local time to act
	err     error     // the refusal, if not OK

	local *localBooking // the fallback's local bookings, nil if none
	late  *lateLinks    // nil unless its batch had late bookings

	mu sync.Mutex // guards canceled

	fallback bool // answered by the fallback, not Redis
	held     bool // a refusal holding its booking (BatchRequest.HoldLate)
	view     bool // made by View: Cancel gives nothing back
	canceled bool
	tried    bool // a give-back was sent, which may have taken effect: no Claim
}

// OK reports whether a slot was booked.
func (r *Reservation) OK() bool { return r.err == nil }

// Err returns nil for a booked slot, and for a refusal a *deadline.Error
// matching ErrMaxWaitExceeded or ErrWouldExceedDeadline (or, answered by
// the fallback, a *FallbackError). In a ReserveBatch, a request whose own
// context had ended when the batch was sent, or (answered by the
// fallback) ended meanwhile, gets that context's error.
func (r *Reservation) Err() error { return r.err }

// RetryAfter returns, for a refusal, the exact wait the slot would have
// needed (or the fallback's estimate); for a booked slot, 0.
func (r *Reservation) RetryAfter() time.Duration {
	switch e := r.err.(type) {
	case *deadline.Error:
		return e.RetryAfter
	case *FallbackError:
		return e.RetryAfter
	}
	return 0
}

// Fallback reports whether the answer came from the fallback policy while
// Redis was unavailable, rather than from the shared limit.
func (r *Reservation) Fallback() bool { return r.fallback }

// Booking returns the engine's answer: the wait and slot as measured on the
// Redis clock when the booking was made. Its OK reports whether Redis
// booked a slot that r holds: for a refusal it is false, but for one held
// for the caller (BatchRequest.HoldLate: late, or its caller gone).
func (r *Reservation) Booking() throttle.Booking {
	if r.booking == nil {
		return throttle.Booking{}
	}
	return *r.booking
}

// SlotAt returns the local time at which the holder may act. It is the zero
// Time for a refusal.
func (r *Reservation) SlotAt() time.Time {
	if !r.OK() {
		return time.Time{}
	}
	return r.act
}

// View returns a copy of r that answers as r does but gives nothing back:
// its Cancel does nothing, and nor does its Wait when cut short. It is for
// handing a reservation to code that may read it while its booking is the
// giver's to give back (a pool's Job.Reservation, say).
func (r *Reservation) View() *Reservation {
	return &Reservation{
		lim: r.lim, key: r.key, booking: r.booking, act: r.act, err: r.err,
		fallback: r.fallback, held: r.held, view: true,
	}
}

// Claim hands over the booking of a late refusal held for its caller
// (BatchRequest.HoldLate) to a caller that can act in its slot all the
// same (one whose deadline is later, say). It returns a Reservation that
// holds the booking and is OK: r's slot (SlotAt, Booking) and r's place
// in its batch (the late bookings under it go back with its Cancel). It
// is as one booked for that caller: its Cancel gives the booking back
// only before the slot has come. r then holds nothing: its Cancel does
// nothing. Claim returns nil for any other Reservation, and for a held
// one already claimed, or cancelled, even by a Cancel that failed (it may
// have given the booking back, and its retry must give it back the same
// way).
func (r *Reservation) Claim() *Reservation {
	if r.view || !r.held {
		return nil
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.canceled || r.tried {
		return nil
	}
	r.canceled = true // the booking is the claimant's to give back
	return r.handed(nil)
}

// handed returns a Reservation that holds r's booking, r's slot and place
// in its batch: OK if err is nil (Claim's), else refused with err and
// held, as a late refusal held for its caller is (Forgo's, Trade's
// spare). Its caller has marked r as holding nothing.
func (r *Reservation) handed(err error) *Reservation {
	return &Reservation{lim: r.lim, key: r.key, booking: r.booking, act: r.act, err: err, held: err != nil, late: r.late}
}

// Forgo is for a holder that has not acted in r's slot and never will (a
// pool whose job ended before it started): it returns a Reservation that
// holds r's booking as a late refusal held for its caller does (not OK,
// its Err err; its Booking().OK is true): no one acts on it, so its Cancel
// gives the booking back even once its slot has come, and Claim or Trade
// hands it on. r then holds nothing: its Cancel does nothing. Forgo
// returns nil for a nil err, a view, a refusal, an answer of the fallback,
// and a Reservation cancelled or claimed from, even by a Cancel that
// failed.
// Forgoing a booking someone acted on lets a request through early: only
// the code that hands out the slot can know that no one did.
func (r *Reservation) Forgo(err error) *Reservation {
	if err == nil || r.view || !r.OK() || r.fallback || r.booking == nil || !r.booking.OK {
		return nil
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.canceled || r.tried {
		return nil
	}
	r.canceled = true
	return r.handed(err)
}

// Trade is Claim for the holder of own, an OK Reservation of the same
// Limiter and key whose booking has the same slot as r's (Booking().At)
// and number of units, and stands on it (r's Booking().Before own's:
// booked after it in the same burst, by one call, say), who has acted, or
// will act, in own's slot. A late refusal held under own would give
// nothing back, for own stands on it; so own's holder takes r's booking,
// of the same slot, and gives up its own, the key's later one. Trade
// returns claimed, OK, which holds r's booking as Claim's Reservation
// would, and spare, which holds own's booking as a late refusal held for
// its caller does (not OK; its Booking().OK is true, its Err is r's): no
// one acts on it, so its Cancel gives it back even once its slot has come,
// and Claim or Trade hands it on. r and own then hold nothing: their
// Cancel does nothing. Trade returns nil, nil and changes nothing when r
// could not be claimed, or own is not such a Reservation (a view,
// cancelled, claimed from, or answered by the fallback).
//
// It is exact: had r's request not been booked, own's would have been
// booked where r's was, at the same slot, and everything after it as it
// is. It trusts Before, which tells nothing across a Reset of the key:
// do not Trade bookings made apart by one (on the Redis clock two such
// bookings never share a slot to the microsecond; on a test clock they
// can, and own's units would then be let through early).
func (r *Reservation) Trade(own *Reservation) (claimed, spare *Reservation) {
	if r.view || !r.held || own == nil || own.view || !own.OK() || own.fallback ||
		own.lim != r.lim || own.key != r.key || own.booking == nil || own.booking.N != r.booking.N ||
		!own.booking.At.Equal(r.booking.At) || !r.booking.Before(*own.booking) {
		return nil, nil
	}
	// r is held and own is OK, never the other way round: a fixed order.
	r.mu.Lock()
	defer r.mu.Unlock()
	own.mu.Lock()
	defer own.mu.Unlock()
	if r.canceled || r.tried || own.canceled || own.tried {
		return nil, nil
	}
	r.canceled, own.canceled = true, true
	return r.handed(nil), own.handed(r.err)
}

// lateLinks ties a Reservation to the late bookings of its batch (see
// book and lateAfter); a reservation of a batch with none has no links,
// and costs no more.
type lateLinks struct {
	after <-chan struct{}    // Cancel waits for it: the batch's own late refunds
	below []throttle.Booking // late bookings under this one, latest first: Cancel gives them back after it
}

// links returns r's lateLinks, made on first use. Only book and lateAfter
// call it, before r is handed out.
func (r *Reservation) links() *lateLinks {
	if r.late == nil {
		r.late = new(lateLinks)
	}
	return r.late
}

// Delay is shorthand for DelayFrom(time.Now()).
func (r *Reservation) Delay() time.Duration { return r.DelayFrom(r.lim.clock.Now()) }

// DelayFrom returns how long after t the holder must wait before acting: 0
// if the slot has come. For a refusal it returns the retry-after.
func (r *Reservation) DelayFrom(t time.Time) time.Duration {
	if !r.OK() {
		return r.RetryAfter()
	}
	return max(0, r.act.Sub(t))
}

// Wait sleeps until the slot. If ctx is done first, it cancels the
// reservation and returns ctx's error: the give-back goes out on a context
// of its own, bounded by a second, after any give-backs of its batch's late
// bookings (bounded by theirs), so with Redis slow to answer Wait can
// return up to about two seconds after ctx ends. For a refusal it returns
// Err at once.
func (r *Reservation) Wait(ctx context.Context) error {
	if !r.OK() {
		return r.err
	}
	if err := r.lim.clock.Sleep(ctx, r.Delay()); err != nil {
		// Another Wait on r may have returned and its holder acted: a
		// slot that has come stays spent.
		_ = r.giveBack(ctx, false)
		return err
	}
	return nil
}

// giveBack cancels r for a caller whose ctx has ended: on a context that
// keeps ctx's values but not its end, so the refund still goes out, and
// returns Cancel's error. unused tells that no one can have acted on r
// (its caller never had it), so that its room comes back even if its
// slot has come.
func (r *Reservation) giveBack(ctx context.Context, unused bool) error {
	if r.late != nil && r.late.after != nil {
		// The batch's own give-backs first (bounded by their second), so
		// that this one's second is its own.
		<-r.late.after
	}
	cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), time.Second)
	defer cancel()
	return r.cancel(cctx, unused)
}

// Cancel gives the slot back if it has not come yet, so others may use it.
// It never lets anything through early (see throttle.Engine.Refund), which
// makes it stricter than golang.org/x/time/rate's Reservation.Cancel in one
// case: the room comes back only while no booking made after this one
// still stands on it, so reservations cancelled latest first all give
// their room back, while one that later bookings were built on gives
// nothing back (x/time/rate gives part, and can then let a later request
// through early). A Pause made after the booking keeps its room too.
//
// A Reservation of a batch (ReserveBatch, or callers of one key sharing a
// call) in which a later booking was refused late waits until that
// booking has been given back (at most a second) before giving its own.
// Once the slot has come nothing is given back, and Cancel makes no Redis
// call. Cancelling twice, cancelling a View, or cancelling a refusal does
// nothing, but for a late refusal held for the caller
// (BatchRequest.HoldLate) and not claimed (Claim), whose booking Cancel
// gives back even once its slot has come, since no one acts on a refusal. If
// Cancel returns an error (Redis unreachable, or its reply lost: errors.Is
// throttle.ErrReplyLost), calling it again is safe: the engine gives a
// booking back at most once.
func (r *Reservation) Cancel(ctx context.Context) error { return r.cancel(ctx, false) }

// cancel is Cancel; unused tells that no one can have acted on r (its
// caller never had it), so that its room comes back even if the slot has
// come (throttle's RefundUnused).
func (r *Reservation) cancel(ctx context.Context, unused bool) error {
	if r.view || (!r.OK() && !r.held) {
		return nil
	}
	if r.late != nil && r.late.after != nil {
		select {
		case <-r.late.after:
		default:
			select {
			case <-r.late.after:
			case <-ctx.Done():
				return ctx.Err()
			}
		}
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.canceled {
		return nil
	}
	if r.fallback {
		if r.local != nil {
			r.lim.fallback.cancel(r.local, unused)
		}
		r.canceled = true
		return nil
	}
	refund := r.lim.eng.RefundAll
	switch {
	case unused || r.held: // no one acts on a refusal, held or not
		refund = r.lim.eng.RefundUnused
	case r.slotCome(ctx):
		r.canceled = true // Redis would give nothing back: no call
		return nil
	}
	r.tried = true
	if _, err := refund(ctx, r.lim.keysOf(r.key), r.lim.limits, *r.booking); err != nil {
		return err
	}
	r.canceled = true
	// The late bookings of its batch right under it, refused and given
	// back by no one else, can give their room back now (best effort: a
	// lost reply loses that room until its slot passes).
	if r.late != nil {
		for _, b := range r.late.below {
			_, _ = r.lim.eng.RefundUnused(ctx, r.lim.keysOf(r.key), r.lim.limits, b)
		}
	}
	return nil
}

// slotCome reports whether the refund Cancel would send on ctx would find
// the slot come, and so give nothing back. The refund runs on ctx's clock:
// Redis's, unless ctx carries the module's explicit test clock, which is
// then compared with the slot as Redis would. On Redis's clock the slot has
// come once the local time to act has, since that counts the wait from the
// reply's arrival, after Redis decided; the slot on the Redis clock must
// have passed locally too, in case the booking was made on a test clock
// ahead of it.
func (r *Reservation) slotCome(ctx context.Context) bool {
	if now, test := testhook.Now(ctx); test {
		return now >= r.booking.At.UnixMicro()
	}
	now := r.lim.clock.Now()
	return !r.act.After(now) && !r.booking.At.After(now)
}

// clock is the seam through which the Limiter reads local time and sleeps,
// so tests need not sleep for real.
type clock interface {
	Now() time.Time
	// Sleep returns nil after d, or ctx's error if ctx is done first.
	Sleep(ctx context.Context, d time.Duration) error
}

type realClock struct{}

func (realClock) Now() time.Time { return time.Now() }

func (realClock) Sleep(ctx context.Context, d time.Duration) error {
	if d <= 0 {
		return nil // the slot has come
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}
