package throttle

import (
	"context"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/slotbook/slotbook/internal/waitbound"
)

// Result is the outcome of a check-mode call (Allow, AllowN, AllowAll).
type Result struct {
	// Allowed reports whether the request passed; if so it has been counted.
	Allowed bool
	// Remaining is how many more units would pass right now (under several
	// limits, the fewest any of them has).
	Remaining int
	// RetryAfter is, for a denied request, the exact time until a request of
	// the same size would pass if nobody else takes the room first. It is 0
	// when Allowed.
	RetryAfter time.Duration
	// ResetAfter is the time until the key is back to its idle state, with
	// Burst+1 units available (under several limits, the longest).
	ResetAfter time.Duration
}

// Allow is shorthand for AllowN(ctx, key, limit, 1).
func (e *Engine) Allow(ctx context.Context, key string, limit Limit) (Result, error) {
	return e.AllowN(ctx, key, limit, 1)
}

// AllowN reports whether n units may pass for key now, and counts them if
// so. A denial is a Result with Allowed false, not an error; an error means
// the request was bad (ErrInvalidLimit, ErrExceedsBurst, ErrInvalidRequest;
// no Redis call made) or Redis failed (ErrUnavailable when it could not be
// reached).
//
// Once sent, the call is not cut short when ctx ends, its deadline
// included: the engine's timeout bounds the wait for the reply (see
// WithTimeout; without one, ctx's deadline does, and a reply it cuts off
// is lost, ErrReplyLost, with its units counted). A caller whose ctx has
// ended by the time the reply is in gets ctx's error, and the units the
// call counted are given back (RefundUnused, within a second more), since
// the caller will not use them.
func (e *Engine) AllowN(ctx context.Context, key string, limit Limit, n int) (Result, error) {
	return e.AllowAll(ctx, []string{key}, []Limit{limit}, n)
}

// AllowAll is AllowN under several limits at once (keys[i] holds the state
// of limits[i]): n units pass only if every limit allows them now, and then
// count in all of them. The keys must share a hash tag.
func (e *Engine) AllowAll(ctx context.Context, keys []string, limits []Limit, n int) (Result, error) {
	// Check mode goes alone: an answer now, one call per request (see
	// WithMerging). It goes out without the caller's deadline, as
	// package reserve's bookings do (see internal/waitbound): the
	// deadline put on the socket would cut the read of a reply that
	// counted the units, which would then stand unused.
	bs, err := e.book(waitbound.WithoutDeadline(ctx), keys, limits, []Request{{N: n, MaxWait: 0}}, false)
	if err == nil {
		// The decision is Redis's, made whether or not the caller is
		// still there to hear it (a reservation's is counted alike, and
		// a give-back counted as a refund).
		if b := bs[0]; b.OK {
			e.observer.ObserveDecision(label(keys[0]), Allowed, 0)
		} else {
			e.observer.ObserveDecision(label(keys[0]), Denied, b.Wait)
		}
	}
	if cause := waitbound.Ended(ctx); cause != nil && !badInput(err) {
		// The caller has gone and will not act on the units: give them
		// back, as an unused booking.
		e.giveBackEnded(ctx, keys, limits, bs)
		return Result{}, waitbound.EndedErr(cause, err, ErrReplyLost, ErrUnavailable)
	}
	if err != nil {
		return Result{}, err
	}
	b := bs[0]
	r := Result{Allowed: b.OK, Remaining: math.MaxInt}
	for i, l := range limits {
		I := l.intervalMicros()
		tau := l.tauMicros()
		// Units that fit now: floor((now + tau - tat) / I) + 1. The division
		// floors: Go's truncates toward zero, which is one too many for a
		// negative numerator.
		remaining := max(0, min(floorDiv(b.now+tau-b.ends[i], I)+1, int64(l.Burst)+1))
		r.Remaining = min(r.Remaining, int(remaining))
		r.ResetAfter = max(r.ResetAfter, time.Duration(max(0, b.ends[i]-b.now))*time.Microsecond)
	}
	if !b.OK {
		r.RetryAfter = b.Wait
	}
	return r, nil
}

// A Request asks for N units with a bound on the wait for their slot.
type Request struct {
	N       int           // units wanted, 1 to Burst+1 (of every limit)
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

	now    int64   // decision time, microseconds on the Redis clock
	starts []int64 // each key's TAT before the decision
	ends   []int64 // each key's TAT after it
	id     uint64  // names the booking's tombstone once it is given back
	// way is how the booking was first given back (wayUsed, wayUnused,
	// waySpan: its low 32 bits) and whether a refund of it, or of the run
	// it was given back in as the run's first, was reported to the
	// Observer as giving time back (wayReported), shared by its copies;
	// nil for a refusal.
	way *atomic.Uint64
}

// Before reports whether b was booked before o on their keys: both booked
// by Redis (OK) for the same keys, with b's units ending, in the first
// key, before o's. The bookings of a key stand in the order they were
// made, each ending no earlier than the one before it, so for two that
// stand Before tells that order even where their slots (At) are the same,
// as those of one call within a burst are, and At cannot. It is false if
// either is a refusal. For bookings of different keys, or made apart by
// a Reset of the key, or with a booking given back between them (the
// later may then end where the given-back one did), it tells nothing.
func (b Booking) Before(o Booking) bool {
	return b.OK && o.OK && len(b.ends) > 0 && len(b.ends) == len(o.ends) && b.ends[0] < o.ends[0]
}

// End is the instant, on the Redis clock, from which b's units no longer
// stand in front of its keys (the latest of the TATs it left): from then
// on a give-back of b, by any way, gives nothing back. It is the zero Time
// for a refusal.
func (b Booking) End() time.Time {
	if !b.OK || len(b.ends) == 0 {
		return time.Time{}
	}
	return time.UnixMicro(slices.Max(b.ends))
}

// How a booking was given back: RefundAll's way or RefundUnused's.
const (
	wayUsed uint64 = 1 + iota
	wayUnused
	// waySpan, with the low 31 bits of the run's own id: given back as
	// part of that run (RefundUnusedRun), never on its own nor in another
	// run.
	waySpan uint64 = 1 << 31
	// wayMask keeps the way of a booking's way word.
	wayMask uint64 = 1<<32 - 1
	// wayReported, beside the way: a refund of the booking (or of the run
	// it is the first of) was reported to the Observer as giving time
	// back, so that a retry that finds the tombstone of a refund whose
	// reply was lost reports what that refund gave once, and only then.
	wayReported uint64 = 1 << 32
)

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
// reported before any Redis call. A single request that finds every
// connection busy may share its call with other keys' (see WithMerging).
// Once sent, the call is not cut short when ctx ends, and a caller whose
// ctx has ended by the time the reply is in gets ctx's error, what it
// booked given back (see BookAll).
func (e *Engine) BookBatch(ctx context.Context, key string, limit Limit, reqs []Request) ([]Booking, error) {
	return e.BookAll(ctx, []string{key}, []Limit{limit}, reqs)
}

// BookAll is BookBatch under several limits at once (keys[i] holds the
// state of limits[i], for instance 10 a second and 10,000 a day): a
// request's slot is the earliest time every limit allows it, and if it is
// booked, every limit counts it. The keys must share a hash tag ("{...}",
// see HashTag) so that a Redis Cluster holds them on one node.
//
// Once sent, the call is not cut short when ctx ends, its deadline
// included: the engine's timeout bounds the wait for the reply (see
// WithTimeout; without one, ctx's deadline does, and a reply it cuts off
// is lost, ErrReplyLost, with its slots booked). A caller whose ctx has
// ended by the time the reply is in gets ctx's error, and what the call
// booked is given back (RefundUnused, in one call for all its bookings,
// within a second more), since the caller will not use it. Book and
// BookBatch are BookAll.
func (e *Engine) BookAll(ctx context.Context, keys []string, limits []Limit, reqs []Request) ([]Booking, error) {
	// Sent without the caller's deadline, as check mode is (see AllowAll).
	// A context package reserve has hidden the deadline of is reserve's
	// call: reserve gives back for its callers itself.
	_, managed := waitbound.Hidden(ctx)
	bs, err := e.book(waitbound.WithoutDeadline(ctx), keys, limits, reqs, true)
	for _, b := range bs {
		if b.OK {
			e.observer.ObserveDecision(label(keys[0]), Booked, b.Wait)
		} else {
			e.observer.ObserveDecision(label(keys[0]), Refused, b.Wait)
		}
	}
	if managed || badInput(err) {
		return bs, err
	}
	if cause := waitbound.Ended(ctx); cause != nil {
		e.giveBackEnded(ctx, keys, limits, bs)
		return nil, waitbound.EndedErr(cause, err, ErrReplyLost, ErrUnavailable)
	}
	return bs, err
}

// giveBackEnded gives back bs, booked in one call for a caller that has
// gone, in one refund (RefundUnusedRun) within a second of its own. The
// bookings of a call stand end to end on each key (each booked from where
// the one before it left the key), so together they are one booking, from
// the first's start to the last's end: refund.lua gives it back while
// nothing booked since stands on it, as it would give them back one by
// one, latest first, in as many round trips (or give nothing, as each of
// them would, if something does).
func (e *Engine) giveBackEnded(ctx context.Context, keys []string, limits []Limit, bs []Booking) {
	// What Redis booked, back to back (a refusal books nothing).
	run := slices.DeleteFunc(slices.Clone(bs), func(b Booking) bool { return !b.OK })
	if len(run) == 0 {
		return
	}
	gctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), time.Second)
	defer cancel()
	_, _ = e.RefundUnusedRun(gctx, keys, limits, run)
}

// book books reqs for keys under limits; merge lets a single request
// share its call (see merger).
func (e *Engine) book(ctx context.Context, keys []string, limits []Limit, reqs []Request, merge bool) ([]Booking, error) {
	if err := checkKeysLimits(keys, limits); err != nil {
		return nil, err
	}
	if len(reqs) == 0 || len(reqs) > MaxBatch {
		return nil, fmt.Errorf("%w: batch of %d requests (want 1 to %d)", ErrInvalidRequest, len(reqs), MaxBatch)
	}
	m := len(keys)
	if merge && m == 1 && len(reqs) == 1 && e.merge != nil {
		if err := checkRequest(reqs[0], limits[0]); err != nil {
			return nil, err
		}
		b, merged, done, err := e.merge.book(ctx, keys[0], limits[0], reqs[0])
		if merged {
			if err != nil {
				return nil, fmt.Errorf("throttle: book %q: %w", keys[0], err)
			}
			return []Booking{b}, nil
		}
		defer done()
	}
	args := cmdArgs(m, 2+2*m+3*len(reqs))
	args = append(args, nowArg(ctx))
	script := book1Script
	if m > 1 || len(reqs) > 1 {
		script = bookScript
		args = append(args, m)
	}
	count, runs := 0, 0
	if script == book1Script {
		// book1.lua takes what its decision needs, worked out here: n*I
		// and tau+I (see the script).
		r, l := reqs[0], limits[0]
		if err := checkRequest(r, l); err != nil {
			return nil, err
		}
		I := l.intervalMicros()
		args = append(args, int64(r.N)*I, l.tauMicros()+I, r.maxWaitMicros())
	} else {
		for _, l := range limits {
			args = append(args, l.intervalMicros(), l.tauMicros())
		}
		// book.lua takes runs of requests alike: (count, n, max wait). A
		// run's count is written once it ends (a count over 255 put in an
		// any on every request would cost an allocation each).
		for i, r := range reqs {
			for _, l := range limits {
				if err := checkRequest(r, l); err != nil {
					return nil, err
				}
			}
			if sameRun(reqs, i) {
				count++
				continue
			}
			runs++
			if count > 0 {
				args[len(args)-3] = count
			}
			count = 1
			args = append(args, 0, r.N, r.maxWaitMicros()) // the count once the run ends
		}
		args[len(args)-3] = count
	}

	// book.lua answers {now, tat_1 .. tat_m, then per run: how many of its
	// requests were booked}; book1.lua answers a string that readBook1
	// reads into the same values. judge works out the rest.
	reply, err := e.runCmd(ctx, script, keys, args)
	var out []Booking
	if err == nil {
		var vals []int64
		var one *single1
		if script == book1Script {
			// The reply's values, the Booking and its way: one allocation
			// for all three.
			one = new(single1)
			vals, err = one.vals[:], readBook1(reply, one.vals[:])
		} else {
			// Room after the reply's values for every booking's ends: one
			// allocation for both.
			vals, err = int64sCap(reply, 1+m+runs, m*len(reqs))
		}
		if err == nil {
			out, err = judge(vals, limits, reqs, one)
		}
		err = unreadable(err)
	}
	if err != nil {
		return nil, fmt.Errorf("throttle: book %q: %w", keys[0], err)
	}
	return out, nil
}

// Refund gives back b, which must have been booked for key under limit, so
// that others may use its room, and returns how much time was given back.
// It never lets anything through early, so it gives back less than
// golang.org/x/time/rate's Reservation.Cancel in one case:
//
//   - b is given back only if its slot has not come and nothing booked
//     after it still stands: the key then returns exactly to where it was
//     before b. Bookings given back latest first (as package pool does)
//     all come back in full; a booking that later ones were built on gives
//     nothing back, where x/time/rate gives part (which can let a later
//     request through early after two cancels).
//   - A Block after b keeps b's room: refunds never reach below a pause.
//   - Refund is idempotent: the first call leaves a tombstone (a key that
//     lives until b's slot), and a second call for b, such as a retry after
//     a lost reply, gives nothing and returns 0, even if a new booking has
//     since ended where b did. The tombstone records what the first call
//     gave back, so that the Observer is told it once, by the retry, when
//     the first call's reply was lost.
//
// Refunding a refused booking, or one whose slot has passed, is a no-op.
func (e *Engine) Refund(ctx context.Context, key string, limit Limit, b Booking) (time.Duration, error) {
	given, err := e.RefundAll(ctx, []string{key}, []Limit{limit}, b)
	if err != nil {
		return 0, err
	}
	return given[0], nil
}

// RefundAll is Refund for a booking made by BookAll: it gives back to each
// limit, and returns the time given back to each.
func (e *Engine) RefundAll(ctx context.Context, keys []string, limits []Limit, b Booking) ([]time.Duration, error) {
	return e.refund(ctx, keys, limits, b, false, b.way)
}

// RefundUnused is RefundAll for a booking whose slot no one can use: its
// holder never had it (the caller gave up before the answer reached it,
// or was told it was refused). Its room comes back even once its slot has
// come, for as long as its units still stand in front of the key and
// nothing booked after it stands on them: nothing ran in it, so nothing
// is let through early. Only the code that booked it can know that; a
// holder that may have acted gives back with RefundAll. A booking must
// be given back one way only (RefundAll's mark that it was given back
// lasts until its slot, so a RefundUnused of the same booking after that
// slot could give back a later booking's room): once either has been
// called for a booking or any copy of it, the other fails with
// ErrInvalidRequest, making no Redis call. Retrying the same one is safe.
func (e *Engine) RefundUnused(ctx context.Context, keys []string, limits []Limit, b Booking) ([]time.Duration, error) {
	return e.refund(ctx, keys, limits, b, true, b.way)
}

// RefundUnusedRun is RefundUnused for run, bookings of the same keys that
// no one can use, made back to back (each starting, in every key, where
// the one before it ended: the bookings of one BookAll call that Redis
// booked, say), the earliest first. It gives them all back in one call,
// as giving them back one by one, latest first, would: as far as their
// units still stand in front of the keys and nothing booked after the
// last stands on them. Retrying it with the same run is safe. Each booking
// of run is then given back as part of it: given back on its own, before
// or after, by any way, or in another run, it fails with
// ErrInvalidRequest, making no Redis call, as does a run that is empty or
// not back to back.
func (e *Engine) RefundUnusedRun(ctx context.Context, keys []string, limits []Limit, run []Booking) ([]time.Duration, error) {
	if len(run) == 1 {
		return e.RefundUnused(ctx, keys, limits, run[0])
	}
	if err := checkKeysLimits(keys, limits); err != nil {
		return nil, err // before span marks the run's bookings
	}
	if len(run) > 0 && len(run[0].ends) != len(keys) {
		return nil, fmt.Errorf("%w: bookings of %d limits refunded to %d", ErrInvalidRequest, len(run[0].ends), len(keys))
	}
	b, err := span(run)
	if err != nil {
		return nil, err
	}
	return e.refund(ctx, keys, limits, b, true, run[0].way)
}

// span returns the booking that stands for run (see RefundUnusedRun), of
// two bookings or more: the first's TATs before, the last's after and its
// slot, and a tombstone of its own, the same for every span of the same
// run, so that a retry gives nothing more. It marks each booking of run
// as given back as part of this run (waySpan), and fails for one given
// back, or marked, otherwise, leaving the others as they were.
func span(run []Booking) (Booking, error) {
	if len(run) == 0 {
		return Booking{}, fmt.Errorf("%w: an empty run of bookings", ErrInvalidRequest)
	}
	first, last := run[0], run[len(run)-1]
	for i, b := range run {
		if !b.OK || b.way == nil || len(b.starts) != len(first.starts) || len(b.ends) != len(b.starts) {
			return Booking{}, fmt.Errorf("%w: booking %d of the run is not a booking of its keys", ErrInvalidRequest, i)
		}
		if i > 0 && !slices.Equal(b.starts, run[i-1].ends) {
			return Booking{}, fmt.Errorf("%w: booking %d of the run does not start where the one before ended", ErrInvalidRequest, i)
		}
	}
	// A booking of its own (refund reads its starts, ends and slot, not
	// its N), named after its run's first and last bookings.
	b := last
	b.starts, b.id, b.way = first.starts, first.id*0x9e3779b97f4a7c15^last.id, nil
	mark := waySpan | uint64(uint32(b.id))
	var marked []*atomic.Uint64 // by this call: unmarked again if it fails, so no room is stuck
	for i, r := range run {
		if r.way.CompareAndSwap(0, mark) {
			marked = append(marked, r.way)
		} else if r.way.Load()&wayMask != mark {
			for _, w := range marked {
				w.Store(0)
			}
			return Booking{}, fmt.Errorf("%w: booking %d of the run was given back on its own or in another run (a booking is given back one way only)", ErrInvalidRequest, i)
		}
	}
	return b, nil
}

// refund is RefundAll, and RefundUnused if unused. rep is the way word
// that holds wayReported for b (its own, or for a run's span the first
// booking's); nil if none.
func (e *Engine) refund(ctx context.Context, keys []string, limits []Limit, b Booking, unused bool, rep *atomic.Uint64) ([]time.Duration, error) {
	if err := checkKeysLimits(keys, limits); err != nil {
		return nil, err
	}
	if !b.OK {
		return make([]time.Duration, len(keys)), nil
	}
	if len(b.ends) != len(keys) || len(b.starts) != len(keys) {
		return nil, fmt.Errorf("%w: booking of %d limits refunded to %d", ErrInvalidRequest, len(b.ends), len(keys))
	}
	way := wayUsed
	if unused {
		way = wayUnused
	}
	if b.way != nil && !b.way.CompareAndSwap(0, way) && b.way.Load()&wayMask != way {
		return nil, fmt.Errorf("%w: a booking given back by more than one of RefundAll, RefundUnused and RefundUnusedRun (one way only)", ErrInvalidRequest)
	}
	// refund.lua gives back until the instant it is given, and its
	// tombstone lives until then: the slot, or for an unused booking the
	// latest of its ends, as long as its room lasts.
	until := b.now + int64(b.Wait/time.Microsecond)
	if unused {
		until = max(until, slices.Max(b.ends))
	}
	args := []any{nowArg(ctx), until}
	for i := range limits {
		args = append(args, b.starts[i], b.ends[i])
	}
	withTomb := append(keys[:len(keys):len(keys)], e.tombstone(keys[0], b.id))
	// The reply: {now, given_1 .. given_m, earlier_1 .. earlier_m}, what
	// this call gave back and what the tombstone it found says an earlier
	// refund of b gave.
	vals, err := e.run(ctx, refundScript, withTomb, args, 1+2*len(keys))
	if err != nil {
		return nil, fmt.Errorf("throttle: refund %q: %w", keys[0], err)
	}
	given := make([]time.Duration, len(keys))
	var earlier time.Duration
	for i := range given {
		given[i] = time.Duration(vals[1+i]) * time.Microsecond
		// What a tombstone says an earlier refund gave, at most what
		// the booking held on that key (a tombstone written by another
		// client is not trusted beyond that).
		earlier = max(earlier, time.Duration(min(vals[1+len(keys)+i], max(b.ends[i]-b.starts[i], 0)))*time.Microsecond)
	}
	e.observer.ObserveRefund(label(keys[0]), reported(rep, slices.Max(given), earlier))
	return given, nil
}

// reported is what the Observer is told a refund gave back, given what it
// gave and what the tombstone it found says an earlier refund of the same
// booking gave: the time given back, by this call or by an earlier one
// whose reply was lost, is reported once, by the first call of the
// booking's refunds whose reply comes; any other call reports 0 (nothing
// given). Without rep (a booking the engine did not make), what it gave.
func reported(rep *atomic.Uint64, given, earlier time.Duration) time.Duration {
	if rep == nil {
		return given
	}
	d := max(given, earlier)
	if d <= 0 {
		return 0
	}
	for {
		w := rep.Load()
		if w&wayReported != 0 {
			return 0 // reported already: by a call whose reply came
		}
		if rep.CompareAndSwap(w, w|wayReported) {
			return d
		}
	}
}

// Block is shared back-off: after an upstream answered "429, retry after
// d", it makes sure no slot for key is granted before d from now (on the
// Redis clock), for every process. Slots booked before keep their times;
// from then on requests resume one interval apart, not in a burst.
func (e *Engine) Block(ctx context.Context, key string, limit Limit, d time.Duration) error {
	return e.BlockAll(ctx, []string{key}, []Limit{limit}, d)
}

// BlockAll is Block for a subject with several limits. Holding back one
// limit is enough to hold back every slot, so only the limit with the
// shortest interval is pushed: requests resume at its pace, and the other
// limits keep their state (pushing a per-day limit would spend its burst).
func (e *Engine) BlockAll(ctx context.Context, keys []string, limits []Limit, d time.Duration) error {
	if err := checkKeysLimits(keys, limits); err != nil {
		return err
	}
	if d < 0 || d > MaxHorizon {
		return fmt.Errorf("%w: block for %v (want 0 to MaxHorizon)", ErrInvalidRequest, d)
	}
	k := 0
	for i, l := range limits {
		if l.intervalMicros() < limits[k].intervalMicros() {
			k = i
		}
	}
	l := limits[k]
	args := []any{nowArg(ctx), ceilMicros(d), l.intervalMicros(), l.tauMicros()}
	if _, err := e.run(ctx, blockScript, keys[k:k+1], args, 2); err != nil {
		return fmt.Errorf("throttle: block %q: %w", keys[k], err)
	}
	return nil
}

// run runs s on the prefixed keys through the breaker, within the timeout,
// and checks that the reply is an array of want integers.
func (e *Engine) run(ctx context.Context, s *script, keys []string, args []any, want int) ([]int64, error) {
	reply, err := e.runReply(ctx, s, keys, args)
	if err != nil {
		return nil, err
	}
	vals, err := int64s(reply, want)
	return vals, unreadable(err)
}

// unreadable marks err, if not nil, as a reply that came but could not be
// read: the script ran, so it may have taken effect (ErrReplyLost).
func unreadable(err error) error {
	if err == nil {
		return nil
	}
	return fmt.Errorf("%w: %w", ErrReplyLost, err)
}

// runReply runs s on the prefixed keys through the breaker of the Redis
// node that holds them, within the timeout, and classifies its error (see
// classify).
func (e *Engine) runReply(ctx context.Context, s *script, keys []string, args []any) (any, error) {
	return e.runCmd(ctx, s, keys, append(cmdArgs(len(keys), len(args)), args...))
}

// runCmd is runReply with the script's arguments after a's head (see
// cmdArgs).
func (e *Engine) runCmd(ctx context.Context, s *script, keys []string, a []any) (any, error) {
	// The prefixed keys: those of a call of one limit (or of a refund of
	// one, with its tombstone) off the heap.
	var buf [2]string
	full := buf[:0]
	for _, k := range keys {
		full = append(full, e.prefix+k)
	}
	lbl := label(keys[0])
	t, err := e.take(ctx, full[0], lbl)
	if err != nil {
		return nil, err
	}
	defer t.release()
	return e.exec(ctx, t, s, full, a, lbl)
}

// A turn is a call's right to go out: its node, whether it is the node's
// breaker's probe, and when it started; it holds one of the node's
// connection tokens, if the node has a gate, until release.
type turn struct {
	ref   *nodeRef
	probe bool
	past  bool // a call of RunScriptPastBreaker the open breaker let by: see breaker.past
	start time.Time
}

// release gives back t's connection token, if it holds one, and its
// place past the breaker.
func (t turn) release() {
	if t.ref.gate != nil {
		<-t.ref.gate
	}
	if t.past {
		t.ref.b.past.Store(false)
	}
}

// take waits for a turn to call the node that holds the prefixed key: it
// looks up the node, asks its breaker (failing fast while it is open), and
// takes a connection token, waiting for one (bounded by ctx) if every
// connection is busy. lbl labels the failed call for
// the observer.
func (e *Engine) take(ctx context.Context, key, lbl string) (turn, error) {
	now := time.Now()
	ref, cached, err := e.nodeFor(ctx, key, now)
	var ok, probe bool
	if err == nil {
		ok, probe = e.breakers.allowB(ref.b) // before the gate: fail fast without queueing
		if !ok && cached {
			// The slot may have moved off the node since it was cached:
			// look again before failing fast.
			e.forgetSlot(key)
			if ref, cached, err = e.nodeFor(ctx, key, now); err == nil {
				ok, probe = e.breakers.allowB(ref.b)
			}
		}
	}
	if err != nil { // the call was the probe of an unreadable slot map, and failed
		e.observer.ObserveCall(lbl, time.Since(now), err)
		return turn{}, err
	}
	if e.cluster != nil && !cached {
		now = time.Now() // the lookup may have read the cluster's slot map
	}
	past, refused := claimPast(ctx, ref.b, ok, probe)
	if refused {
		return turn{}, errBreakerOpen
	}
	if gate := ref.gate; gate != nil {
		select {
		case gate <- struct{}{}:
		default: // every connection busy: wait, bounded by the caller's context
			select {
			case gate <- struct{}{}:
			case <-ctx.Done():
				if probe {
					e.breakers.abandonB(ref.b)
				}
				if past {
					ref.b.past.Store(false)
				}
				return turn{}, ctx.Err()
			}
			now = time.Now()
		}
		if !probe && !past {
			// The breaker may have opened while this call queued, or
			// since it looked (a call ahead of it timed out and gave its
			// token back): look again, so that calls queued for a
			// connection do not go to a dead node one pool's worth at a
			// time, each paying the timeout. An atomic load while closed.
			ok, probe = e.breakers.allowB(ref.b)
			if past, refused = claimPast(ctx, ref.b, ok, probe); refused {
				<-gate
				return turn{}, errBreakerOpen
			}
		}
	}
	return turn{ref: ref, probe: probe, past: past, start: now}, nil
}

// claimPast tells a call that b's breaker judged (ok, probe) whether it
// holds the place past the open breaker (past: a RunScriptPastBreaker
// call the breaker refused, or one that is its probe, so that no second
// such call goes beside it: helper-136), and whether it is refused (the
// breaker refused it, and it may not go past: not such a call, or
// another holds the place). A call the breaker lets by as usual pays one
// test.
func claimPast(ctx context.Context, b *breaker, ok, probe bool) (past, refused bool) {
	if ok && !probe {
		return false, false
	}
	past = pastBreaker(ctx) && b.past.CompareAndSwap(false, true)
	return past, !ok && !past
}

// exec runs s on the prefixed keys full in turn t, within the timeout, and
// classifies its error (see classify). lbl labels the call for the
// observer.
func (e *Engine) exec(ctx context.Context, t turn, s *script, full []string, a []any, lbl string) (any, error) {
	timeout := e.timeout
	if t.probe {
		// The probe is the one call under way while the breaker is open:
		// a longer timeout costs no one else a wait, and keeps a client
		// that is merely busy from failing its probes and every call.
		timeout *= probeTimeouts
	}
	callCtx, cancel := e.bound(ctx, timeout, t.start)
	defer cancel()
	reply, err := s.runCmd(callCtx, e.rdb, full, a)
	end := time.Now()
	err = e.classify(ctx, callCtx, t.ref, full[0], t.probe, t.start, end, err)
	if err != nil && e.slots != nil && errors.Is(err, ErrUnavailable) {
		e.forgetSlot(full[0])
	}
	e.observer.ObserveCall(lbl, end.Sub(t.start), err)
	return reply, err
}

// callerEnded is the package's callerEnded for a call made on ctx whose
// error is err, where package reserve may have hidden the caller's
// deadline from ctx (waitbound). With the engine's timeout the socket's
// deadline was then the engine's (or the client's), never the caller's:
// the caller ended the call only through one of its waits before anything
// was sent (for a connection, a dial), which fail with the caller's own
// error, and a timeout is Redis's. Without one, the caller's context bounded
// the call, deadline included (see bound), and is judged as any other.
func (e *Engine) callerEnded(ctx, callCtx context.Context, err error) error {
	caller, hidden := waitbound.Hidden(ctx)
	switch {
	case !hidden:
		return callerEnded(ctx, callCtx)
	case e.timeout <= 0:
		return callerEnded(caller, callCtx)
	}
	if cerr := caller.Err(); cerr != nil && errors.Is(err, cerr) {
		return cerr
	}
	return nil
}

// callerEnded returns the caller's context error if the call ended
// because of it, not because of the engine's timeout: ctx is done, or its
// deadline (no later than callCtx's, which adds the engine's timeout) has
// passed. The second case matters because go-redis sets the socket's
// deadline from the context's, and the socket's can fire before the
// context's own timer says it is done: the call then fails with an i/o
// timeout while ctx.Err() is still nil.
func callerEnded(ctx, callCtx context.Context) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	mine, ok := ctx.Deadline()
	if !ok {
		return nil
	}
	if engine, ok := callCtx.Deadline(); ok && engine.Before(mine) {
		return nil // the engine's timeout came first
	}
	if time.Now().Before(mine) {
		return nil
	}
	return context.DeadlineExceeded
}

// probeTimeouts is how many timeouts a probe of an open breaker may take.
const probeTimeouts = 4

// ErrBreakerOpen is matched, with ErrUnavailable, by the error of a call
// the node's open breaker refused at once, sent nowhere: an earlier call
// found Redis unavailable, and another call is the probe (or past the
// breaker: RunScriptPastBreaker), or the next probe is not due. Unlike a
// call that was let through and failed, it says nothing new of Redis.
var ErrBreakerOpen = errors.New("breaker open: failing fast until a probe succeeds")

// errBreakerOpen is the error of a call refused at once by the open breaker.
var errBreakerOpen = fmt.Errorf("%w (%w)", ErrUnavailable, ErrBreakerOpen)

// classify tells node's breaker what err says of it (see verdict), and
// returns err as the caller should see it. key is the call's first
// (prefixed) key; probe tells whether the call was the open breaker's
// probe.
func (e *Engine) classify(ctx, callCtx context.Context, node *nodeRef, key string, probe bool, start, end time.Time, err error) error {
	v, err := e.verdict(ctx, callCtx, key, err)
	switch v {
	case redisServed:
		e.breakers.successB(node.b, end)
	case noVerdict:
		if probe {
			e.breakers.abandonB(node.b)
		}
	case redisDown:
		if probe {
			e.breakers.probeFailedB(node.b, start)
		} else {
			e.breakers.failureB(node.b, start)
		}
	}
	return err
}

// What a call's outcome says of its Redis node.
type callVerdict int

const (
	redisServed callVerdict = iota // it answered (with a reply or an error)
	noVerdict                      // the caller gave up, or the client's own pool was full
	redisDown                      // it could not be reached, or could not serve
)

// verdict classes a call's err (the table is in the package doc): what it
// says of Redis, and err as the caller should see it, matching
// ErrUnavailable when Redis could not be reached or could not serve, and
// ErrReplyLost as well when the script may have run all the same; matching
// ErrCorruptState for a stored value that is not a TAT. key is the call's
// first (prefixed) key.
func (e *Engine) verdict(ctx, callCtx context.Context, key string, err error) (callVerdict, error) {
	if err == nil {
		return redisServed, nil
	}
	switch ended := e.callerEnded(ctx, callCtx, err); {
	case ended != nil: // the caller gave up: no verdict on Redis
		sent := !notSent(err) // judged on go-redis's error as it came
		if !errors.Is(err, ended) {
			err = fmt.Errorf("%w: %w", ended, err)
		}
		if sent {
			return noVerdict, fmt.Errorf("%w: %w", ErrReplyLost, err)
		}
		return noVerdict, err
	case saturated(err, func() bool { return e.poolFull(key) }): // the client's own pool: no verdict on Redis either
		return noVerdict, fmt.Errorf("%w: %w", ErrUnavailable, err)
	case slotBusy(err): // Redis answered: one slot cannot serve this call, the node can
		return redisServed, fmt.Errorf("%w: %w", ErrUnavailable, err)
	case unavailable(err):
		if !notSent(err) {
			return redisDown, fmt.Errorf("%w: %w: %w", ErrUnavailable, ErrReplyLost, err)
		}
		return redisDown, fmt.Errorf("%w: %w", ErrUnavailable, err)
	default: // Redis answered, with an error
		if msg, ok := strings.CutPrefix(err.Error(), "SLOTBOOK_CORRUPT "); ok {
			msg, _, _ = strings.Cut(msg, " script: ") // Redis appends where in the script
			return redisServed, fmt.Errorf("%w: %s", ErrCorruptState, msg)
		}
		return redisServed, err
	}
}

// poolFull reports whether the client's connection pool for the node that
// holds the prefixed key has opened every connection it may (PoolSize, or
// MaxActiveConns if lower), so that a call waiting in it waits for another
// user of the client to give one back. It is false where the pool cannot
// be read (a Ring, a client of another kind).
func (e *Engine) poolFull(key string) bool {
	var c *redis.Client
	switch r := e.rdb.(type) {
	case *redis.Client:
		c = r
	case *redis.ClusterClient:
		// The client has read its slot map (the call went through it):
		// no Redis call.
		ctx, cancel := withTimeout(context.Background(), e.timeout)
		defer cancel()
		m, err := r.MasterForKey(ctx, key)
		if err != nil {
			return false
		}
		c = m
	default:
		return false
	}
	o := c.Options()
	size := o.PoolSize
	if o.MaxActiveConns > 0 {
		size = min(size, o.MaxActiveConns)
	}
	return int(c.PoolStats().TotalConns) >= size
}

// floorDiv is a / b rounded down, for b > 0.
func floorDiv(a, b int64) int64 {
	q := a / b
	if a%b != 0 && a < 0 {
		q--
	}
	return q
}

// tombstone is the key (before the prefix) that marks booking id of the
// subject whose first key is key as given back. Its full name hashes as
// the full key's does, so that a Redis Cluster holds it beside the keys:
// it follows key where the prefixed key has a hash tag, and otherwise
// takes the whole prefixed key as its tag (CheckKey admits no key with
// braces but no tag; a prefix with stray braces is the caller's own).
func (e *Engine) tombstone(key string, id uint64) string {
	suffix := ":x:" + strconv.FormatUint(id, 36)
	if full := e.prefix + key; HashTag(full) == "" {
		return "{" + full + "}" + suffix
	}
	return key + suffix
}

// Reset clears a subject: it deletes keys (the subject's keys, one per
// limit; several must share a hash tag), so that its next request finds it
// idle. It is the way out of ErrCorruptState. Slots already handed out are
// not recalled.
func (e *Engine) Reset(ctx context.Context, keys ...string) error {
	if len(keys) == 0 || len(keys) > MaxLimits {
		return fmt.Errorf("%w: reset of %d keys (want 1 to %d)", ErrInvalidRequest, len(keys), MaxLimits)
	}
	for i, k := range keys {
		if err := CheckKey(k); err != nil {
			return err
		}
		if i > 0 && (HashTag(k) == "" || HashTag(k) != HashTag(keys[0])) {
			return fmt.Errorf("%w: keys %q and %q do not share a hash tag", ErrInvalidRequest, keys[0], k)
		}
	}
	if _, err := e.runReply(ctx, resetScript, keys, nil); err != nil {
		return fmt.Errorf("throttle: reset %q: %w", keys[0], err)
	}
	return nil
}

// readBook1 reads book1.lua's reply ("s u", "s u tat", "s u -" or
// "s u -tat"; see the script) into vals, of length 4: book.lua's values
// for one request under one limit, {now, tat, booked (1 or 0)}, with room
// for the booking's end.
func readBook1(reply any, vals []int64) error {
	str, ok := reply.(string)
	if !ok {
		return fmt.Errorf("unexpected reply %T, want a string", reply)
	}
	bad := func() error {
		return fmt.Errorf("unexpected reply %q, want \"s u [-][tat]\"", str)
	}
	sec, rest, ok := strings.Cut(str, " ")
	if !ok {
		return bad()
	}
	usec, rest, more := strings.Cut(rest, " ")
	s, err1 := strconv.ParseInt(sec, 10, 64)
	u, err2 := strconv.ParseInt(usec, 10, 64)
	if err1 != nil || err2 != nil || s < 0 || u < 0 {
		return bad()
	}
	now := s*1_000_000 + u
	tat, refused := now, false
	if more {
		if rest, refused = strings.CutPrefix(rest, "-"); rest != "" {
			t, err := strconv.ParseInt(rest, 10, 64)
			if err != nil || t <= now {
				return bad()
			}
			tat = t
		} else if !refused {
			return bad()
		}
	}
	booked := int64(1)
	if refused {
		booked = 0
	}
	vals[0], vals[1], vals[2], vals[3] = now, tat, booked, 0
	return nil
}

// single1 is what a single request under one limit (a book1.lua call)
// holds on the heap: the reply's values (readBook1), which its Booking's
// starts and ends share, its Booking and its way, in one allocation.
type single1 struct {
	vals [4]int64
	b    [1]Booking
	w    [1]atomic.Uint64
}

// sameRun reports whether reqs[i] is alike the request before it (the
// same n and max wait), so that book.lua takes the two in one run.
func sameRun(reqs []Request, i int) bool {
	return i > 0 && reqs[i].N == reqs[i-1].N && reqs[i].maxWaitMicros() == reqs[i-1].maxWaitMicros()
}

// judge works out each request's Booking as book.lua and book1.lua judge
// them: in order, each against the TATs the bookings before it left.
// vals is a reply's values, {now, tat_1 .. tat_m, then per run of
// requests alike (sameRun): how many were booked}, followed by room for
// m ends per request. The scripts book exactly the requests whose wait is
// within their max wait, and a run's bookings are its first requests: a
// reply that disagrees was not made by this engine's scripts. one, if not
// nil, holds vals and the room for a single request's Booking and way.
func judge(vals []int64, limits []Limit, reqs []Request, one *single1) ([]Booking, error) {
	m := len(limits)
	now := vals[0]
	// tats: what the next request is judged against, as the script judged
	// it: where the last booking left each limit. Bookings share these
	// slices and never write them.
	tats := vals[1 : 1+m : 1+m]
	booked, ends := vals[1+m:], vals[len(vals)-m*len(reqs):]
	var interval, tau [MaxLimits]int64 // each limit's, worked out once
	for k, l := range limits {
		interval[k], tau[k] = l.intervalMicros(), l.tauMicros()
	}
	var (
		out  []Booking
		ways []atomic.Uint64 // each booking's way, one allocation for all
	)
	if len(reqs) == 1 {
		// One request, the common case: its Booking and its way in one
		// allocation (one's, where the caller made it).
		if one == nil {
			one = new(single1)
		}
		out, ways = one.b[:], one.w[:]
	} else {
		out = make([]Booking, len(reqs))
	}
	run, pos := -1, int64(0) // the request's run, and its place in it
	for i, r := range reqs {
		if !sameRun(reqs, i) {
			if run >= 0 && booked[run] > pos {
				return nil, fmt.Errorf("unexpected reply: %d of a run of %d requests booked", booked[run], pos)
			}
			run, pos = run+1, 0
		}
		slot := now
		for k := range m {
			slot = max(slot, tats[k]+int64(r.N-1)*interval[k]-tau[k])
		}
		w := slot - now
		b := Booking{OK: pos < booked[run], N: r.N, now: now, starts: tats, ends: tats,
			Wait: time.Duration(w) * time.Microsecond, At: time.UnixMicro(slot)}
		if b.OK == (w > r.maxWaitMicros()) {
			return nil, fmt.Errorf("unexpected reply: request %d (wait %dµs, max wait %v) booked: %v", i, w, r.MaxWait, b.OK)
		}
		if b.OK { // each limit advanced from the slot: tat = max(tat, slot) + n*I
			if ways == nil {
				ways = make([]atomic.Uint64, len(reqs))
			}
			b.id, b.way = rand.Uint64(), &ways[i]
			b.ends = ends[m*i : m*(i+1) : m*(i+1)]
			for k := range m {
				b.ends[k] = max(b.starts[k], slot) + int64(r.N)*interval[k]
			}
			tats = b.ends
		}
		out[i] = b
		pos++
	}
	if booked[run] > pos {
		return nil, fmt.Errorf("unexpected reply: %d of a run of %d requests booked", booked[run], pos)
	}
	return out, nil
}
