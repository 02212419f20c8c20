package throttle_test

// The oracle: random operations against the real engine on a real Redis,
// judged against the definition of GCRA rather than a copy of the scripts.
//
// The scripts keep one TAT per key and move it by their own rules (book,
// batch, several limits, refund, pause). This test never looks at the TAT
// and never computes a slot: it only records what callers see (which
// requests were booked and at which slot, which refunds were sent when),
// and then asks the question a user of the limiter asks. Take the bookings
// that run (booked, and not refunded while the clock was still before
// their slot), sort them by slot, and replay them unit by unit through
// textbook GCRA (virtual scheduling) from an empty key:
//
//	t < TAT - tau  → an early event: the limit was exceeded
//	otherwise        TAT = max(TAT, t) + I
//
// with I = ceil(Period/Rate) in whole microseconds and tau = Burst*I,
// derived here from the Limit's fields (not Limit.Interval, not
// internal/model). Whatever arithmetic the scripts use, and however a
// refund or pause is implemented, a wrong answer shows as an early event.
// Pauses are checked the same way: a booking made after Block(key, d) at
// clock t must have its slot at or after t + d.
//
// The explicit clock (internal/testhook) makes a run depend on its seed
// only: every failure names the seed and the operation, and
// -oracle-seed S -oracle-ops N replays it.

import (
	"context"
	"encoding/binary"
	"flag"
	"fmt"
	"math/rand/v2"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/slotbook/slotbook/internal/testhook"
	"github.com/slotbook/slotbook/throttle"
)

var (
	oracleOps  = flag.Int("oracle-ops", 20_000, "operations in TestOracleRandom")
	oracleSeed = flag.Uint64("oracle-seed", 0, "seed for TestOracleRandom (0: from the clock)")
)

const (
	// oracleEpoch is how many operations share one set of keys, limits and
	// one run of the explicit clock; the replay runs at the end of each.
	oracleEpoch = 500
	// oracleMaxLead bounds how far the explicit clock runs ahead of the
	// real one within an epoch (the scripts keep keys an hour past their
	// TAT under an explicit clock, on Redis's real-time expiry).
	oracleMaxLead = int64(30 * time.Minute / time.Microsecond)
	// oracleMinOps is the run length from which every kind of operation
	// must have happened (the test must not pass by doing nothing).
	oracleMinOps = 2_000
)

// oraclePeriods run from 250ms to a minute; 333,333,333ns makes the
// interval's rounding to a microsecond matter.
var oraclePeriods = []time.Duration{
	250 * time.Millisecond, time.Second, 333_333_333, 3 * time.Second, 7 * time.Second, time.Minute,
}

// oracleInterval is the textbook emission interval: Period/Rate rounded up
// to a whole microsecond (ceil(ceil(p/r ns)/1000) = ceil(p/(1000 r))).
func oracleInterval(l throttle.Limit) int64 {
	num, den := int64(l.Period), int64(l.Rate)*1000
	return (num + den - 1) / den
}

// oracleRand yields choices: from a seeded generator or from fuzz input.
type oracleRand interface{ Intn(n int) int }

type oracleSeeded struct{ r *rand.Rand }

func (s oracleSeeded) Intn(n int) int { return s.r.IntN(n) }

type oracleBytes struct {
	data []byte
	pos  int
}

func (s *oracleBytes) Intn(n int) int {
	if s.pos+4 > len(s.data) {
		s.pos = len(s.data)
		return 0
	}
	v := int(binary.LittleEndian.Uint32(s.data[s.pos:]))
	s.pos += 4
	return v % n
}

func (s *oracleBytes) done() bool { return s.pos+4 > len(s.data) }

// A subject is one caller's keys: one key, or a layered pair.
type orSubject struct {
	keys   []string
	limits []throttle.Limit
	base   int64 // its epoch's clock origin, for readable messages
}

// An orBooking is a granted request, as its caller saw it.
type orBooking struct {
	op        int // the operation that booked it
	subj      *orSubject
	n         int
	b         throttle.Booking // zero for Allow, which cannot be refunded
	slot      int64            // microseconds on the explicit clock
	refunds   int              // refunds sent for it
	cancelled bool             // a refund was sent before its slot: it does not run
	cancelOp  int
}

// An orPause is the latest floor a Block put on a key.
type orPause struct {
	op    int
	at    int64 // clock when the Block was sent
	until int64 // at + d, d rounded up to a microsecond
}

type orCounts struct {
	booked, refused, allowed, ran     int
	cancels, lateRefunds, givenBack   int
	retriedInRow, retriedLater, reuse int
	pauses, paused                    int
}

// oracle drives one run.
type oracle struct {
	t    testing.TB
	e    *env
	rnd  oracleRand
	seed uint64 // 0 under fuzzing
	now  int64  // the explicit clock, microseconds
	op   int    // index of the operation under way (or of the next one)

	stepping bool // an operation is under way (not a replay between two)

	epoch    int
	subjects []*orSubject // this epoch's: two single keys, one layered pair
	recent   []*orBooking // this epoch's refundable bookings
	refunded []*orBooking // this epoch's bookings with a refund sent
	all      []*orBooking // every booking of the run
	byKey    map[string][]*orBooking
	limitOf  map[string]throttle.Limit
	pause    map[string]orPause
	history  map[string][]string // per key, what happened to it, for messages
	counts   orCounts
}

func newOracle(t testing.TB, e *env, rnd oracleRand, seed uint64) *oracle {
	return &oracle{
		t: t, e: e, rnd: rnd, seed: seed,
		byKey: map[string][]*orBooking{}, limitOf: map[string]throttle.Limit{},
		pause: map[string]orPause{}, history: map[string][]string{},
	}
}

func (o *oracle) ctx() context.Context { return testhook.WithNow(context.Background(), o.now) }

// where names the operation under way (or, between operations, the check
// after the last one), for every message.
func (o *oracle) where() string {
	at := fmt.Sprintf("op %d", o.op)
	if !o.stepping {
		at = fmt.Sprintf("check after op %d", o.op-1)
	}
	if o.seed == 0 {
		return at
	}
	return fmt.Sprintf("seed %d %s", o.seed, at)
}

// done is how many operations a replay must run to reach this point.
func (o *oracle) done() int {
	if o.stepping {
		return o.op + 1
	}
	return o.op
}

func (o *oracle) fail(format string, args ...any) {
	o.t.Helper()
	msg := fmt.Sprintf(format, args...)
	if o.seed != 0 {
		msg += fmt.Sprintf("\nreplay: go test -race -run TestOracleRandom ./throttle -oracle-seed %d -oracle-ops %d", o.seed, o.done())
	}
	o.t.Fatal(msg)
}

// oracleRel shows clock time t relative to subject s's epoch origin.
func oracleRel(s *orSubject, t int64) string {
	d := t - s.base
	sign := "+"
	if d < 0 {
		sign, d = "-", -d
	}
	return fmt.Sprintf("%s%d.%06ds", sign, d/1e6, d%1e6)
}

func (o *oracle) note(keys []string, format string, args ...any) {
	line := fmt.Sprintf("op %d: ", o.op) + fmt.Sprintf(format, args...)
	for _, k := range keys {
		o.history[k] = append(o.history[k], line)
	}
}

func (o *oracle) newEpoch() {
	o.epoch++
	// Only differences of times matter to the scripts and to the oracle,
	// so starting each epoch at the real clock keeps a run reproducible.
	o.now = time.Now().UnixMicro()
	limit := func() throttle.Limit {
		return throttle.Every(oraclePeriods[o.rnd.Intn(len(oraclePeriods))], 1+o.rnd.Intn(30), o.rnd.Intn(6))
	}
	a, b, l1, l2 := limit(), limit(), limit(), limit()
	if l2 == l1 {
		l2.Rate = l1.Rate%30 + 1
	}
	tag := fmt.Sprintf("{L%d}", o.epoch)
	o.subjects = []*orSubject{
		{keys: []string{fmt.Sprintf("e%d:a", o.epoch)}, limits: []throttle.Limit{a}},
		{keys: []string{fmt.Sprintf("e%d:b", o.epoch)}, limits: []throttle.Limit{b}},
		{keys: []string{tag, tag + ":b"}, limits: []throttle.Limit{l1, l2}},
	}
	for _, s := range o.subjects {
		s.base = o.now
		for i, k := range s.keys {
			o.limitOf[k] = s.limits[i]
			o.note([]string{k}, "epoch %d: %v (I=%dµs), clock origin %d", o.epoch, s.limits[i], oracleInterval(s.limits[i]), o.now)
		}
	}
	o.recent, o.refunded = nil, nil
}

// step runs one random operation.
func (o *oracle) step() {
	o.stepping = true
	defer func() { o.stepping = false }()
	if o.op%oracleEpoch == 0 {
		o.newEpoch()
	}
	s := o.subjects[o.rnd.Intn(len(o.subjects))]
	switch op := o.rnd.Intn(20); {
	case op < 5: // one request: Book, or Allow now and then
		if o.rnd.Intn(6) == 0 {
			o.allow(s)
		} else {
			o.book(s, 1)
		}
	case op < 7: // a batch
		o.book(s, 2+o.rnd.Intn(5))
	case op < 10: // under two limits at once
		o.book(o.subjects[2], 1+o.rnd.Intn(2))
	case op < 13: // a refund, sometimes retried at once (as after a lost reply)
		if ob := o.pick(o.recent); ob != nil {
			o.refund(ob, "refund")
			if o.rnd.Intn(3) == 0 {
				o.counts.retriedInRow++
				o.refund(ob, "refund again")
			}
		}
	case op < 14: // a refund sent again later, maybe after a booking of the same size
		if ob := o.pick(o.refunded); ob != nil {
			if o.rnd.Intn(2) == 0 {
				if bs := o.bookReqs(ob.subj, []throttle.Request{{N: ob.n, MaxWait: o.maxWait()}}); bs[0].OK {
					o.counts.reuse++
				}
			}
			o.counts.retriedLater++
			o.refund(ob, "refund sent again")
		}
	case op < 15:
		o.block(s)
	default:
		o.tick()
	}
	o.op++
}

// pick returns a random booking of list, mostly a recent one.
func (o *oracle) pick(list []*orBooking) *orBooking {
	if len(list) == 0 {
		return nil
	}
	if o.rnd.Intn(3) > 0 {
		list = list[max(0, len(list)-8):]
	}
	return list[o.rnd.Intn(len(list))]
}

func (o *oracle) maxWait() time.Duration {
	switch o.rnd.Intn(4) {
	case 0:
		return 0
	case 1:
		return throttle.Forever
	default:
		return time.Duration(o.rnd.Intn(3_000_001)) * time.Microsecond
	}
}

func oracleMaxN(s *orSubject) int {
	n := s.limits[0].Burst + 1
	for _, l := range s.limits {
		n = min(n, l.Burst+1)
	}
	return n
}

func (o *oracle) book(s *orSubject, count int) {
	reqs := make([]throttle.Request, count)
	for i := range reqs {
		reqs[i] = throttle.Request{N: 1 + o.rnd.Intn(oracleMaxN(s)), MaxWait: o.maxWait()}
	}
	o.bookReqs(s, reqs)
}

func (o *oracle) bookReqs(s *orSubject, reqs []throttle.Request) []throttle.Booking {
	var bs []throttle.Booking
	var err error
	switch {
	case len(s.keys) > 1:
		bs, err = o.e.eng.BookAll(o.ctx(), s.keys, s.limits, reqs)
	case len(reqs) == 1:
		var b throttle.Booking
		b, err = o.e.eng.Book(o.ctx(), s.keys[0], s.limits[0], reqs[0])
		bs = []throttle.Booking{b}
	default:
		bs, err = o.e.eng.BookBatch(o.ctx(), s.keys[0], s.limits[0], reqs)
	}
	require.NoError(o.t, err, "%s: book %v on %q", o.where(), reqs, s.keys)
	require.Len(o.t, bs, len(reqs), "%s: bookings for %d requests", o.where(), len(reqs))
	for i, b := range bs {
		o.judge(s, reqs[i], b)
	}
	return bs
}

// judge checks what the caller of one request can see at once (a booking
// within its max wait, at or after every pause on its keys) and records it.
func (o *oracle) judge(s *orSubject, r throttle.Request, b throttle.Booking) {
	bounded := r.MaxWait != throttle.Forever
	if !b.OK {
		o.counts.refused++
		o.note(s.keys, "n=%d max wait %v at %s: refused, wait %v", r.N, r.MaxWait, oracleRel(s, o.now), b.Wait)
		// A refusal must have a cause: a slot beyond the max wait. (Forever
		// may meet an engine's horizon; a few seconds may not.)
		if bounded && b.Wait <= r.MaxWait {
			o.fail("%s: request of %d on %q (max wait %v) refused with a wait of %v, which fits", o.where(), r.N, s.keys, r.MaxWait, b.Wait)
		}
		return
	}
	slot := b.At.UnixMicro()
	o.note(s.keys, "n=%d max wait %v at %s: booked, slot %s", r.N, r.MaxWait, oracleRel(s, o.now), oracleRel(s, slot))
	switch {
	case b.N != r.N:
		o.fail("%s: booking on %q for %d units says N = %d", o.where(), s.keys, r.N, b.N)
	case slot < o.now || slot != o.now+b.Wait.Microseconds() || b.Wait%time.Microsecond != 0:
		o.fail("%s: booking on %q at clock %d: slot %d and wait %v disagree (or the slot has passed)", o.where(), s.keys, o.now, slot, b.Wait)
	case bounded && b.Wait > r.MaxWait:
		o.fail("%s: booking of %d on %q waits %v, past its max wait %v", o.where(), r.N, s.keys, b.Wait, r.MaxWait)
	}
	paused := false
	for _, k := range s.keys {
		p, ok := o.pause[k]
		if !ok {
			continue
		}
		if slot < p.until {
			o.fail("%s: booking of %d on %q has slot %s (%d), %dµs before the end %s (%d) of the pause op %d put on %q at %s\nhistory of %q:\n%s",
				o.where(), r.N, s.keys, oracleRel(s, slot), slot, p.until-slot, oracleRel(s, p.until), p.until, p.op, k, oracleRel(s, p.at), k, o.tail(k, o.op))
		}
		paused = paused || p.until > o.now
	}
	if paused {
		o.counts.paused++
	}
	o.counts.booked++
	o.record(&orBooking{op: o.op, subj: s, n: r.N, b: b, slot: slot}, true)
}

func (o *oracle) record(ob *orBooking, refundable bool) {
	o.all = append(o.all, ob)
	for _, k := range ob.subj.keys {
		o.byKey[k] = append(o.byKey[k], ob)
	}
	if refundable {
		o.recent = append(o.recent, ob)
	}
}

// allow is check mode: an allowed request is an event now that no refund
// can take back.
func (o *oracle) allow(s *orSubject) {
	n := 1 + o.rnd.Intn(oracleMaxN(s))
	r, err := o.e.eng.AllowAll(o.ctx(), s.keys, s.limits, n)
	require.NoError(o.t, err, "%s: allow %d on %q", o.where(), n, s.keys)
	o.note(s.keys, "allow n=%d at %s: %v", n, oracleRel(s, o.now), r.Allowed)
	if !r.Allowed {
		o.counts.refused++
		if r.RetryAfter <= 0 {
			o.fail("%s: allow of %d on %q denied with retry-after %v", o.where(), n, s.keys, r.RetryAfter)
		}
		return
	}
	for _, k := range s.keys {
		if p, ok := o.pause[k]; ok && o.now < p.until {
			o.fail("%s: allow of %d on %q passed at %s, during the pause op %d put on %q until %s",
				o.where(), n, s.keys, oracleRel(s, o.now), p.op, k, oracleRel(s, p.until))
		}
	}
	o.counts.allowed++
	o.record(&orBooking{op: o.op, subj: s, n: n, slot: o.now}, false)
}

// refund sends a refund for ob. The booking does not run if any refund of
// it was sent before its slot, whatever the refund gave back.
func (o *oracle) refund(ob *orBooking, what string) {
	s := ob.subj
	var given []time.Duration
	var err error
	if len(s.keys) == 1 {
		var g time.Duration
		g, err = o.e.eng.Refund(o.ctx(), s.keys[0], s.limits[0], ob.b)
		given = []time.Duration{g}
	} else {
		given, err = o.e.eng.RefundAll(o.ctx(), s.keys, s.limits, ob.b)
	}
	require.NoError(o.t, err, "%s: %s of op %d on %q", o.where(), what, ob.op, s.keys)
	if ob.refunds == 0 {
		o.refunded = append(o.refunded, ob)
	}
	ob.refunds++
	effect := "runs (its slot has come)"
	switch {
	case ob.cancelled:
		effect = fmt.Sprintf("already cancelled at op %d", ob.cancelOp)
	case o.now < ob.slot:
		ob.cancelled, ob.cancelOp = true, o.op
		o.counts.cancels++
		effect = "cancels it"
	default:
		o.counts.lateRefunds++
	}
	for _, g := range given {
		if g > 0 {
			o.counts.givenBack++
			break
		}
	}
	o.note(s.keys, "%s of op %d (n=%d, slot %s) at %s: gave back %v, %s", what, ob.op, ob.n, oracleRel(s, ob.slot), oracleRel(s, o.now), given, effect)
}

// block pauses a single key, or the layered pair (both keys or one).
func (o *oracle) block(s *orSubject) {
	d := time.Duration(o.rnd.Intn(2_000_000_001)) // nanoseconds: rounding up matters
	if o.rnd.Intn(8) == 0 {
		d = 0
	}
	keys, limits := s.keys, s.limits
	var err error
	if len(keys) > 1 && o.rnd.Intn(3) == 0 {
		i := o.rnd.Intn(len(keys))
		keys, limits = keys[i:i+1], limits[i:i+1]
	}
	if len(keys) == 1 {
		err = o.e.eng.Block(o.ctx(), keys[0], limits[0], d)
	} else {
		err = o.e.eng.BlockAll(o.ctx(), keys, limits, d)
	}
	require.NoError(o.t, err, "%s: block %q for %v", o.where(), keys, d)
	until := o.now + (int64(d)+999)/1000
	for _, k := range keys {
		if p, ok := o.pause[k]; !ok || until >= p.until {
			o.pause[k] = orPause{op: o.op, at: o.now, until: until}
		}
	}
	o.counts.pauses++
	o.note(keys, "block %v at %s: no slot before %s", d, oracleRel(s, o.now), oracleRel(s, until))
}

// tick moves the clock by nothing, a little, about one interval of one of
// the epoch's limits, or several.
func (o *oracle) tick() {
	s := o.subjects[o.rnd.Intn(len(o.subjects))]
	I := oracleInterval(s.limits[o.rnd.Intn(len(s.limits))])
	var step int64
	switch o.rnd.Intn(4) {
	case 0:
	case 1:
		step = 1 + int64(o.rnd.Intn(int(min(I/4, 50_000)+1)))
	case 2:
		step = I - I/10 + int64(o.rnd.Intn(int(I/5+1)))
	case 3:
		step = int64(2+o.rnd.Intn(5))*I + int64(o.rnd.Intn(int(I)))
	}
	o.now += min(step, max(0, o.subjects[0].base+oracleMaxLead-o.now))
}

// replay judges every booking so far against textbook GCRA, key by key.
func (o *oracle) replay() {
	keys := make([]string, 0, len(o.byKey))
	for k := range o.byKey {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for _, k := range keys {
		o.replayKey(k)
	}
}

func (o *oracle) replayKey(key string) {
	lim := o.limitOf[key]
	I := oracleInterval(lim)
	tau := int64(lim.Burst) * I
	var run []*orBooking
	for _, ob := range o.byKey[key] {
		if !ob.cancelled {
			run = append(run, ob)
		}
	}
	sort.SliceStable(run, func(i, j int) bool { return run[i].slot < run[j].slot })
	var tat int64
	for i, ob := range run {
		for u := 1; u <= ob.n; u++ {
			if i == 0 && u == 1 {
				tat = ob.slot + I // the key is empty: any first event conforms
				continue
			}
			if ob.slot < tat-tau {
				var before []string
				for _, p := range run[max(0, i-4):i] {
					before = append(before, fmt.Sprintf("op %d: %d at %s", p.op, p.n, oracleRel(p.subj, p.slot)))
				}
				hi := ob.op
				for _, p := range run[max(0, i-4):i] {
					hi = max(hi, p.op)
				}
				o.fail("%s: early event: the booking of op %d on %q (%v: I=%dµs, tau=%dµs) runs %d units at slot %s (%d); "+
					"unit %d comes %dµs before TAT-tau = %s (TAT %d)\nthe bookings that run just before it: %s\nhistory of %q:\n%s",
					o.where(), ob.op, key, lim, I, tau, ob.n, oracleRel(ob.subj, ob.slot), ob.slot,
					u, tat-tau-ob.slot, oracleRel(ob.subj, tat-tau), tat, strings.Join(before, "; "), key, o.tail(key, hi))
			}
			tat = max(tat, ob.slot) + I
		}
	}
}

// tail is the last lines of key's history up to operation hi.
func (o *oracle) tail(key string, hi int) string {
	h := o.history[key]
	end := len(h)
	for end > 0 {
		var op int
		if _, err := fmt.Sscanf(h[end-1], "op %d:", &op); err == nil && op <= hi {
			break
		}
		end--
	}
	return "  " + strings.Join(h[max(0, end-30):end], "\n  ")
}

// finish replays everything and counts the bookings that run.
func (o *oracle) finish() {
	o.replay()
	o.counts.ran = 0
	for _, ob := range o.all {
		if !ob.cancelled {
			o.counts.ran++
		}
	}
}

// TestOracleRandom runs -oracle-ops random operations (20,000 by default)
// and judges them against the definition of GCRA (see the top of the
// file); it replays the bookings every epoch and at the end.
func TestOracleRandom(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	e.srv.RequireReal(t)
	seed := *oracleSeed
	if seed == 0 {
		seed = uint64(time.Now().UnixNano())
	}
	t.Logf("seed %d (replay with -oracle-seed %d)", seed, seed)
	o := newOracle(t, e, oracleSeeded{rand.New(rand.NewPCG(seed, seed>>1))}, seed)
	start := time.Now()
	for o.op < *oracleOps {
		o.step()
		if o.op%oracleEpoch == 0 {
			o.replay()
		}
	}
	o.finish()
	c := o.counts
	t.Logf("%d ops in %v over %d epochs: %d booked (%d ran), %d allowed, %d refused; refunds: %d cancelled a booking, "+
		"%d came after the slot, %d gave time back; retried refunds: %d at once, %d later (%d after a booking of the same size); "+
		"%d pauses, %d bookings made during one",
		o.op, time.Since(start).Round(time.Millisecond), o.epoch, c.booked, c.ran, c.allowed, c.refused,
		c.cancels, c.lateRefunds, c.givenBack, c.retriedInRow, c.retriedLater, c.reuse, c.pauses, c.paused)
	if o.op < oracleMinOps {
		return
	}
	for _, n := range []struct {
		what string
		n    int
	}{
		{"bookings that ran", c.ran}, {"refunds that cancelled a booking", c.cancels},
		{"refunds retried at once", c.retriedInRow}, {"refunds re-sent later", c.retriedLater},
		{"refunds re-sent after a booking of the same size", c.reuse},
		{"pauses", c.pauses}, {"bookings made during a pause", c.paused},
	} {
		if n.n == 0 {
			t.Errorf("seed %d: no %s in %d operations: the test proves nothing about them", seed, n.what, o.op)
		}
	}
}

// FuzzOracle is TestOracleRandom on choices read from the fuzz input (4
// bytes a choice). Its seed inputs run with every go test; go test -fuzz
// FuzzOracle ./throttle explores further.
func FuzzOracle(f *testing.F) {
	// Found by fuzzing 8fded08: a refund retried at once gave back twice.
	f.Add([]byte("0000000000000000000000000000000090111001000000120200!82829220000000000000000000010000000200000000000z2890000100020100000A211"))
	for _, seed := range []uint64{1, 2, 3} {
		r := rand.New(rand.NewPCG(seed, seed))
		data := make([]byte, 1200)
		for i := range data {
			data[i] = byte(r.IntN(256))
		}
		f.Add(data)
	}
	e := newEnv(f)
	e.srv.RequireReal(f)
	f.Fuzz(func(t *testing.T, data []byte) {
		if len(data) > 4096 {
			return
		}
		src := &oracleBytes{data: data}
		o := newOracle(t, e.fresh(t), src, 0)
		for !src.done() && o.op < oracleEpoch {
			o.step()
		}
		o.finish()
	})
}
