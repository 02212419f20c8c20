package throttle

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"
)

// maxMerge is the most single bookings one merged call carries.
const maxMerge = 64

// A merger gathers single bookings (one request on one key under one
// limit, book1.lua's calls) that find every connection to a node busy, or
// the most bookings WithMergeAt lets fly already in flight, so that they
// go out together, in one call of bookmany.lua, when one frees: at many
// keys and many callers, one call then books many keys, for much less
// server and client CPU per booking than one call each
// (BenchmarkBook1Pipelining). A booking that finds room goes alone; so
// does every other call.
//
// The first request of a batch leads it: it waits for a flight token
// (until the engine's WithMergeWait has passed since the batch formed,
// then it goes without one) and the connection (bounded by its context),
// takes the batch and sends it. Until then the
// batch takes more requests (up to maxMerge), and a request whose wait
// ends leaves it, nothing sent; if that was the leader, the next request
// leads (the batch's wait does not start again). Once taken, a request's
// answer comes with the call's (bounded by the engine's timeout, as a
// batch of calls from package reserve is): the call books for every
// request in it, so none is cut short. A merger is used only for a client
// that is not a Cluster's (the keys of one call need not share a hash
// slot), with a known pool size and a timeout.
type merger struct {
	e   *Engine
	off atomic.Bool // set once the server refused a merged call's keys as not one slot's
	// flight holds a token for each single booking and merged call in
	// flight (WithMergeAt), nil where only a full pool merges; a batch
	// that waited wait (WithMergeWait) for one goes without.
	flight chan struct{}
	// landFn is land as a func value, made once: a method value made on
	// each call that flies (book, board) would cost an allocation each.
	landFn func()
	wait   time.Duration
	mu     sync.Mutex  // guards open, and each batch's items and taken
	open   *mergeBatch // the batch taking requests, if any
}

// A mergeBatch is the requests of one merged call.
type mergeBatch struct {
	items []*mergeItem
	taken bool      // by its leader, to send (or to fail): no one joins or leaves
	due   time.Time // when it goes without a flight token; zero: never
}

// A mergeItem is one request of a mergeBatch.
type mergeItem struct {
	key    string // as given to book: without the engine's prefix
	limit  Limit
	req    Request
	leader bool             // leads its batch (guarded by merger.mu)
	answer chan mergeAnswer // room for one: named leader, or answered
}

// A mergeAnswer is what a request of a batch hears: that it leads the
// batch, or its booking or error, or that it must go alone (its key held
// a value the merged call could not read; alone it gets its own error).
type mergeAnswer struct {
	lead  bool
	b     Booking
	err   error
	alone bool
}

// book books req for key under limit in a merged call, if every
// connection is busy or the most bookings that go alone are in flight;
// merged reports whether it did. If not, the caller sends the request
// alone and calls done once its call is over.
func (m *merger) book(ctx context.Context, key string, limit Limit, req Request) (b Booking, merged bool, done func(), err error) {
	if nowArg(ctx) != "" || m.off.Load() {
		return Booking{}, false, noCancel, nil // a test clock, or no merging here: alone
	}
	if gate := m.e.fixed.gate; len(gate) < cap(gate) {
		if m.flight == nil {
			return Booking{}, false, noCancel, nil // a connection is free: alone
		}
		select {
		case m.flight <- struct{}{}:
			return Booking{}, false, m.landFn, nil // room in flight: alone
		default: // enough bookings in flight: wait for one, with others
		}
	}
	it := &mergeItem{key: key, limit: limit, req: req, answer: make(chan mergeAnswer, 1)}
	m.mu.Lock()
	batch := m.open
	if batch == nil {
		batch = &mergeBatch{due: m.due()}
		m.open = batch
		it.leader = true
	}
	batch.items = append(batch.items, it)
	if len(batch.items) == maxMerge {
		m.open = nil // full: the next request starts another
	}
	a := mergeAnswer{lead: it.leader}
	m.mu.Unlock()

	if !a.lead {
		a = m.await(ctx, batch, it)
	}
	if a.lead {
		a = m.lead(ctx, batch, it)
	}
	if a.alone && m.flight != nil {
		// Sent again alone (its key could not be booked in the merged
		// call), it flies as a booking alone does.
		land, err := m.board(ctx, m.due())
		if err != nil {
			return Booking{}, true, noCancel, err
		}
		return Booking{}, false, land, nil
	}
	return a.b, !a.alone, noCancel, a.err
}

// land gives back a flight token.
func (m *merger) land() { <-m.flight }

// await waits for it's answer: named leader, or answered. While batch is
// not taken, it leaves when ctx's wait ends, nothing sent.
func (m *merger) await(ctx context.Context, batch *mergeBatch, it *mergeItem) mergeAnswer {
	select {
	case a := <-it.answer:
		return a
	case <-ctx.Done():
	}
	m.mu.Lock()
	if !batch.taken {
		m.leaveLocked(batch, it)
		m.mu.Unlock()
		return mergeAnswer{err: ctx.Err()}
	}
	m.mu.Unlock()
	// Sent, or being sent: its booking comes with the call's reply.
	return <-it.answer
}

// leaveLocked takes it out of batch, which is not taken; if it led the
// batch, the next request leads it. m.mu is held.
func (m *merger) leaveLocked(batch *mergeBatch, it *mergeItem) {
	for i, x := range batch.items {
		if x == it {
			batch.items = append(batch.items[:i], batch.items[i+1:]...)
			break
		}
	}
	if !it.leader {
		return
	}
	if len(batch.items) == 0 {
		if m.open == batch {
			m.open = nil
		}
		return
	}
	next := batch.items[0]
	next.leader = true
	next.answer <- mergeAnswer{lead: true} // never blocks: nothing else is sent before the batch is taken
}

// lead waits for a turn to call the node, takes batch, sends it in one call
// and answers each of its requests; it returns its own request's answer.
func (m *merger) lead(ctx context.Context, batch *mergeBatch, it *mergeItem) mergeAnswer {
	e := m.e
	if m.flight != nil {
		land, err := m.board(ctx, batch.due) // a new leader's wait does not start again
		if err != nil {
			m.mu.Lock()
			m.leaveLocked(batch, it)
			m.mu.Unlock()
			return mergeAnswer{err: err}
		}
		defer land()
	}
	t, err := e.take(ctx, e.prefix+it.key, label(it.key))
	m.mu.Lock()
	if err != nil {
		if werr := ctx.Err(); werr != nil && errors.Is(err, werr) {
			// Its wait ended before a connection freed: it leaves, and the
			// next request leads.
			m.leaveLocked(batch, it)
			m.mu.Unlock()
			return mergeAnswer{err: err}
		}
	}
	batch.taken = true
	if m.open == batch {
		m.open = nil
	}
	items := batch.items
	m.mu.Unlock()

	// If sending panics (an Observer's panic, say) or ends the goroutine
	// (runtime.Goexit: recover gives nil), the batch's other requests get
	// an error, the tokens come back (the deferred calls), and a panic
	// goes on up the leader's stack; a Goexit goes on ending it.
	answered := false
	defer func() {
		if answered {
			return
		}
		p := recover()
		why := "ended its goroutine (runtime.Goexit)"
		if p != nil {
			why = fmt.Sprintf("panicked: %v", p)
		}
		for _, x := range items {
			if x != it {
				x.answer <- mergeAnswer{err: fmt.Errorf("merged call %s", why)}
			}
		}
		if p != nil {
			panic(p)
		}
	}()
	var answers []mergeAnswer
	if err == nil {
		defer t.release()
		answers = m.send(ctx, t, items)
	} else { // the breaker is open: every request would have failed fast
		answers = make([]mergeAnswer, len(items))
		for i := range answers {
			answers[i].err = err
		}
	}
	answered = true
	var own mergeAnswer
	for i, x := range items {
		if x == it {
			own = answers[i]
			continue
		}
		x.answer <- answers[i] // never blocks: its one answer
	}
	return own
}

// due is when a batch forming now, or a booking sent again alone now,
// goes without a flight token: zero for never (or where there are no
// flight tokens, and so no wait for one).
func (m *merger) due() time.Time {
	if m.flight == nil || m.wait >= Forever {
		return time.Time{}
	}
	return time.Now().Add(m.wait)
}

// board waits for a flight token, until due (see due) and bounded by ctx,
// and returns what gives it back: m.land, or
// noCancel if due came first and the call goes without one (far from
// Redis, the calls in flight are on the wire, not queued in Redis).
func (m *merger) board(ctx context.Context, due time.Time) (land func(), err error) {
	select {
	case m.flight <- struct{}{}:
		return m.landFn, nil
	default:
	}
	var out <-chan time.Time
	if !due.IsZero() {
		d := time.Until(due)
		if d <= 0 {
			return noCancel, nil
		}
		t := time.NewTimer(d)
		defer t.Stop()
		out = t.C
	}
	select {
	case m.flight <- struct{}{}:
		return m.landFn, nil
	case <-out:
		return noCancel, nil
	case <-ctx.Done():
		return nil, ctx.Err()
	}
}

// send runs bookmany.lua for items in turn t, under ctx's values but not
// its end (the engine's timeout bounds the call), and returns each item's
// answer.
func (m *merger) send(ctx context.Context, t turn, items []*mergeItem) []mergeAnswer {
	e := m.e
	k := len(items)
	full := make([]string, k)
	a := cmdArgs(k, 1+4*k)
	a = append(a, "")
	for i, x := range items {
		full[i] = e.prefix + x.key
		I := x.limit.intervalMicros()
		a = append(a, I, x.limit.tauMicros(), x.req.N, x.req.maxWaitMicros())
	}
	answers := make([]mergeAnswer, k)
	lbl := label(items[0].key)
	reply, err := e.exec(context.WithoutCancel(ctx), t, bookManyScript, full, a, lbl)
	// The call counts for every limiter in it, not only the first's.
	took := time.Since(t.start)
	seen := []string{lbl}
	for _, x := range items[1:] {
		if l := label(x.key); !slices.Contains(seen, l) {
			seen = append(seen, l)
			e.observer.ObserveCall(l, took, err)
		}
	}
	var vals []int64
	if err == nil {
		// Room after the reply's values for each booking's end.
		vals, err = int64sCap(reply, 1+2*k, k)
		err = unreadable(err)
	}
	if err != nil {
		alone, off := refusedBeforeRun(err)
		if off {
			m.off.Store(true)
		}
		for i := range answers {
			answers[i].err, answers[i].alone = err, alone
		}
		return answers
	}
	now := vals[0]
	ends := vals[1+2*k:]
	for i, x := range items {
		tat, w := vals[1+2*i], vals[2+2*i]
		if tat == -1 {
			answers[i].alone = true
			continue
		}
		answers[i].b, answers[i].err = single(now, vals[1+2*i:2+2*i:2+2*i], w, x.req, x.limit, ends[i:i+1:i+1])
	}
	return answers
}

// single is the Booking of req under limit, judged against the TAT
// starts[0] at now with the reply's w (the wait if booked, -1 - wait if
// refused); end is room for its end. A booking's starts and ends are never
// written once it is made. A reply whose wait is not the one the TAT
// gives, or that books a request whose wait is past its max wait (or
// refuses one within it), was not made by bookmany.lua, which ran all the
// same: ErrReplyLost, as for book.lua's (see judge).
func single(now int64, starts []int64, w int64, req Request, limit Limit, end []int64) (Booking, error) {
	n := req.N
	b := Booking{OK: w >= 0, N: n, now: now, starts: starts, ends: starts}
	if !b.OK {
		w = -1 - w
	}
	slot := max(now, starts[0]+int64(n-1)*limit.intervalMicros()-limit.tauMicros())
	if w != slot-now || b.OK == (w > req.maxWaitMicros()) {
		return Booking{}, unreadable(fmt.Errorf("unexpected reply: wait %dµs (%dµs by the TAT), max wait %v, booked: %v", w, slot-now, req.MaxWait, b.OK))
	}
	b.Wait = time.Duration(w) * time.Microsecond
	b.At = time.UnixMicro(now + w)
	if b.OK {
		b.id, b.way = rand.Uint64(), new(atomic.Uint64)
		end[0] = max(starts[0], now+w) + int64(n)*limit.intervalMicros()
		b.ends = end
	}
	return b, nil
}

// refusedBeforeRun reports whether err is Redis refusing a merged call's
// keys before running it (nothing booked): alone, each request is sent
// again by itself, to be answered on its own key. NOPERM: an ACL user may
// not touch one of the keys (the others' callers must not fail for it).
// CROSSSLOT, MOVED, ASK: the server (a cluster-enabled node, or a proxy in
// front of shards behind one address) wants every call's keys in one
// slot: off, the engine stops merging.
func refusedBeforeRun(err error) (alone, off bool) {
	var rerr redis.Error
	if !errors.As(err, &rerr) {
		return false, false
	}
	msg := rerr.Error()
	for _, p := range []string{"CROSSSLOT ", "MOVED ", "ASK "} {
		if strings.HasPrefix(msg, p) {
			return true, true
		}
	}
	return strings.HasPrefix(msg, "NOPERM "), false
}
