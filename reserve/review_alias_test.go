package reserve_test

// Adversarial review of d98270d (a Reservation points at its booking in
// its batch's slice of answers; a booking refused late gets a copy of its
// own with OK false; a single booking is allocated with its refund state)
// and 776131e (a key's coalescing sender hands it on exactly once, however
// booking ends). Public API only, plus the package's test hooks
// (SetSoloBelow, QueueLen, KeyStates). Room is judged on the Redis clock:
// the key's TAT read with GET under the engine's prefix, and the slot of the
// next booking, against a textbook GCRA replay of the bookings that stand.

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"runtime"
	"runtime/debug"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/slotbook/slotbook/deadline"
	"github.com/slotbook/slotbook/internal/redistest"
	"github.com/slotbook/slotbook/reserve"
	"github.com/slotbook/slotbook/throttle"
)

// raT is the interval of the limit under test: one slot per 5 s, no burst,
// so that every booking's slot is distinct and far enough ahead that no
// slot comes while a test runs (a Cancel then always reaches Redis).
const raT = 5 * time.Second

var raLimit = throttle.Every(raT, 1, 0)

// ---------------------------------------------------------------------------
// A go-redis hook on script calls: holds them before Redis (gate), delays
// their replies (after), loses the reply of the next refund (the script
// runs, the caller sees io.EOF), and records each call's script hash.

type raHook struct {
	after      atomic.Int64 // ns slept after each script call's reply
	gated      atomic.Bool
	entered    chan struct{}
	release    chan struct{}
	loseRefund atomic.Bool
	lost       atomic.Int64
	mu         sync.Mutex
	shas       []string
	tombs      map[string]int // refund calls per tombstone (per booking)
}

func newRAHook(rdb *redis.Client) *raHook {
	h := &raHook{entered: make(chan struct{}, 64), release: make(chan struct{})}
	rdb.AddHook(h)
	return h
}

func (h *raHook) DialHook(next redis.DialHook) redis.DialHook { return next }
func (h *raHook) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}
func (h *raHook) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		n := cmd.Name()
		if n != "evalsha" && n != "eval" {
			return next(ctx, cmd)
		}
		args := cmd.Args()
		h.mu.Lock()
		if len(args) > 1 {
			h.shas = append(h.shas, fmt.Sprint(args[1]))
		}
		for _, a := range args {
			if s, ok := a.(string); ok && strings.Contains(s, ":x:") {
				if h.tombs == nil {
					h.tombs = map[string]int{}
				}
				h.tombs[s]++
			}
		}
		h.mu.Unlock()
		if h.gated.Load() {
			h.entered <- struct{}{}
			<-h.release
		}
		err := next(ctx, cmd)
		if d := h.after.Load(); d > 0 {
			time.Sleep(time.Duration(d))
		}
		if err == nil && raIsRefund(args) && h.loseRefund.CompareAndSwap(true, false) {
			h.lost.Add(1)
			err = io.EOF // the script ran; its reply never came
			cmd.SetErr(err)
		}
		return err
	}
}

// raIsRefund: refund.lua's keys end with the booking's tombstone, ":x:<id>".
func raIsRefund(args []any) bool {
	for _, a := range args {
		if s, ok := a.(string); ok && strings.Contains(s, ":x:") {
			return true
		}
	}
	return false
}

// ---------------------------------------------------------------------------
// The textbook GCRA (virtual scheduling, ITU-T I.371) of raLimit: T the
// emission interval, tau = Burst*T = 0. n is 1 throughout.

// raReplay replays the slots that stand (µs on the Redis clock), in slot
// order, and fails t for any slot that came early. It returns the TAT the
// replay ends with (0 if none stand).
func raReplay(t *testing.T, what string, slots []int64) int64 {
	t.Helper()
	T := raLimit.Interval().Microseconds()
	tau := int64(raLimit.Burst) * T
	s := slices.Clone(slots)
	sort.Slice(s, func(i, j int) bool { return s[i] < s[j] })
	var tat int64
	for i, at := range s {
		if i > 0 && at < tat-tau {
			t.Errorf("%s: GCRA: slot %d of %d at %d µs came %d µs early (TAT %d)", what, i, len(s), at, tat-tau-at, tat)
		}
		tat = max(tat, at) + T
	}
	return tat
}

// raTAT reads the key's TAT (µs on the Redis clock) under the engine's
// prefix; 0 if the key is idle (absent).
func raTAT(t *testing.T, rdb *redis.Client, prefix, subject string) int64 {
	t.Helper()
	v, err := rdb.Get(context.Background(), prefix+"api:{"+subject+"}").Result()
	if errors.Is(err, redis.Nil) {
		return 0
	}
	require.NoError(t, err)
	n, err := strconv.ParseInt(v, 10, 64)
	require.NoError(t, err)
	return n
}

// ---------------------------------------------------------------------------
// One scenario: bookings of one key, some booked (B), some refused by
// Redis (R), some late (L: booked within the budget, but the reply's
// latency makes the caller miss its deadline), some late and held (H,
// ReserveBatch with HoldLate), some ended before they were sent (E).

type raCase struct {
	kind byte  // the outcome expected: ask's, or B for an L or H handed an earlier slot it fits
	ask  byte  // the kind of request made
	own  int64 // the slot Redis books for it (µs on the Redis clock); R: the one it would have had
	slot int64 // expected slot for B, L, H once the batch has handed slots down; R, E: own
	r    *reserve.Reservation
	snap throttle.Booking // Booking() right after it was returned
	v    *reserve.Reservation
	keep bool // never cancelled: stands to the end
}

func (c *raCase) String() string { return fmt.Sprintf("%c@%d", c.kind, c.slot) }

// raSame compares two Bookings whole, unexported fields included (the
// TATs before and after, the tombstone id, the address of the refund
// state), without reading the refund state itself (atomic).
func raSame(a, b throttle.Booking) bool { return fmt.Sprintf("%+v", a) == fmt.Sprintf("%+v", b) }

// rooms: whether the case took room in Redis.
func (c *raCase) room() bool { return c.kind == 'B' || c.kind == 'L' || c.kind == 'H' || c.kind == 'X' }

// given: whether its batch gives the case's booking back itself: a late
// refusal not held (L), or a caller ended in flight (X). The batch hands
// their slots down to the requests after them that stand, so every such
// booking lies above those that stand (the batches here are of one unit
// each), and goes back at once.
func (c *raCase) given() bool { return c.kind == 'L' || c.kind == 'X' }

// holds: whether the caller holds the room (its Cancel gives it back).
func (c *raCase) holds() bool { return c.kind == 'B' || c.kind == 'H' }

type raScene struct {
	t       *testing.T
	e       *env
	h       *raHook
	l       *reserve.Limiter
	key     string
	tat0    int64 // the key's TAT once the fill stands
	fill    []int64
	cases   []*raCase
	xs      []*raCase // X cases: given back by ReserveN itself, before any Cancel
	cancel  []context.CancelFunc
	xcancel []context.CancelFunc
	work    time.Duration // the limiter's work estimate (WithWorkEstimate)
}

// newRAScene: a limiter (raLimit) on an engine of its own over a client
// with raHook, and three bookings standing on key, so that every slot of
// the scenario lies 15 s or more ahead.
func newRAScene(t *testing.T, key string, opts ...throttle.Option) *raScene {
	t.Helper()
	e := newEnv(t)
	h := newRAHook(e.rdb)
	eng, err := throttle.New(e.rdb, append([]throttle.Option{throttle.WithPrefix(e.prefix), throttle.WithTimeout(5 * time.Second)}, opts...)...)
	require.NoError(t, err)
	require.NoError(t, eng.Load(context.Background()))
	l, err := reserve.New(eng, "api", raLimit)
	require.NoError(t, err)
	s := &raScene{t: t, e: e, h: h, l: l, key: key}
	for range 3 {
		r, err := l.Reserve(context.Background(), key)
		require.NoError(t, err)
		require.True(t, r.OK(), "%v", r.Err())
		s.fill = append(s.fill, r.Booking().At.UnixMicro())
	}
	s.tat0 = raTAT(t, e.rdb, e.prefix, key)
	require.Equal(t, s.fill[2]+raT.Microseconds(), s.tat0, "the fill's TAT")
	t.Cleanup(func() {
		for _, c := range s.cancel {
			c()
		}
	})
	return s
}

// ctxFor returns the context of a case of kind k whose slot would be slot.
func (s *raScene) ctxFor(k byte, slot int64) context.Context {
	bg := context.Background()
	var ctx context.Context
	var cancel context.CancelFunc
	switch k {
	case 'B':
		return bg
	case 'R': // a budget, but 2 s short of the slot: Redis refuses it
		ctx, cancel = context.WithDeadline(bg, time.UnixMicro(slot).Add(-2*time.Second+s.work))
	case 'L', 'H': // within the budget on the Redis clock; 40 ms of reply make it late
		ctx, cancel = context.WithDeadline(bg, time.UnixMicro(slot).Add(20*time.Millisecond+s.work))
	case 'Z': // no room for the work estimate: refused before any call, nothing booked
		ctx, cancel = context.WithTimeout(bg, s.work/2)
	case 'E':
		ctx, cancel = context.WithCancel(bg)
		cancel()
	case 'X': // ended by the test while its batch call is in flight
		ctx, cancel = context.WithCancel(bg)
		s.xcancel = append(s.xcancel, cancel)
	}
	s.cancel = append(s.cancel, cancel)
	return ctx
}

// plan lays out kinds in order from first, the slot of the first booking
// (ReserveBatch's doc): Redis books each B, L, H or X the next slot (own);
// then the requests that stand take the earliest slots in order, each the
// earliest not taken (no later than its own), and those that will not act
// take the rest. An L or H handed a slot earlier than its own fits its
// deadline there (it lies an interval, 5 s, before): it is booked (B). An
// L at its own slot is late (given back), an H held, an X given back.
func (s *raScene) plan(kinds string, first int64) []*raCase {
	var cs, left []*raCase
	own, next := first, first
	for _, k := range []byte(kinds) {
		c := &raCase{kind: k, ask: k, own: own, slot: own} // R: the slot it would have had
		if c.room() {
			own += raT.Microseconds()
			switch {
			case k == 'X', k == 'L' && next == c.own:
				left = append(left, c)
			default:
				if (k == 'L' || k == 'H') && next < c.own {
					c.kind = 'B'
				}
				c.slot = next
				next += raT.Microseconds()
			}
		}
		cs = append(cs, c)
	}
	for _, c := range left {
		c.slot = next
		next += raT.Microseconds()
	}
	return cs
}

// check checks each case's answer against its kind, and takes its
// snapshot and a View.
func (s *raScene) check(cs []*raCase) {
	t := s.t
	t.Helper()
	for i, c := range cs {
		r := c.r
		require.NotNil(t, r, "case %d %v", i, c)
		b := r.Booking()
		switch c.kind {
		case 'B':
			require.True(t, r.OK(), "case %d %v: %v", i, c, r.Err())
			require.True(t, b.OK, "case %d %v", i, c)
			require.Equal(t, c.slot, b.At.UnixMicro(), "case %d %v: slot", i, c)
		case 'R':
			require.False(t, r.OK(), "case %d %v", i, c)
			require.ErrorIs(t, r.Err(), deadline.ErrWouldExceedDeadline, "case %d %v", i, c)
			require.False(t, b.OK, "case %d %v", i, c)
		case 'L', 'H':
			require.False(t, r.OK(), "case %d %v", i, c)
			require.ErrorIs(t, r.Err(), deadline.ErrWouldExceedDeadline, "case %d %v: late", i, c)
			require.Equal(t, c.kind == 'H', b.OK, "case %d %v: Booking().OK of a late refusal, held or not", i, c)
			require.Equal(t, c.slot, b.At.UnixMicro(), "case %d %v: slot of a late refusal", i, c)
			require.True(t, r.SlotAt().IsZero(), "case %d %v", i, c)
		case 'Z':
			require.False(t, r.OK(), "case %d %v", i, c)
			require.ErrorIs(t, r.Err(), deadline.ErrWouldExceedDeadline, "case %d %v", i, c)
			require.True(t, raSame(throttle.Booking{}, b), "case %d %v: nothing booked: %+v", i, c, b)
		case 'E':
			require.False(t, r.OK(), "case %d %v", i, c)
			require.ErrorIs(t, r.Err(), context.Canceled, "case %d %v", i, c)
			require.True(t, raSame(throttle.Booking{}, b), "case %d %v: nothing booked: %+v", i, c, b)
		}
		c.snap = b
		c.v = r.View()
		require.True(t, raSame(b, c.v.Booking()), "case %d %v: a View's Booking", i, c)
	}
}

// readers reads every case's Booking(), its View's, and a fresh View's,
// and cancels Views and refusals, until stop; any difference from the
// snapshot is an error.
func (s *raScene) readers(stop <-chan struct{}, n int) *sync.WaitGroup {
	var wg sync.WaitGroup
	ctx := context.Background()
	for g := range n {
		wg.Go(func() {
			for iter := 0; ; iter++ {
				select {
				case <-stop:
					return
				default:
				}
				for i, c := range s.cases {
					if b := c.r.Booking(); !raSame(b, c.snap) {
						s.t.Errorf("case %d %v: Booking() changed after it was returned: %+v, was %+v", i, c, b, c.snap)
					}
					v := c.r.View()
					if b := v.Booking(); !raSame(b, c.snap) || v.OK() != c.r.OK() || v.Err() != c.r.Err() {
						s.t.Errorf("case %d %v: a View disagrees: %+v", i, c, b)
					}
					if err := v.Cancel(ctx); err != nil {
						s.t.Errorf("case %d %v: a View's Cancel: %v", i, c, err)
					}
					if b := c.v.Booking(); !raSame(b, c.snap) {
						s.t.Errorf("case %d %v: an old View's Booking() changed: %+v", i, c, b)
					}
					if !c.holds() && (g+iter)%3 == 0 {
						if err := c.r.Cancel(ctx); err != nil {
							s.t.Errorf("case %d %v: a refusal's Cancel: %v", i, c, err)
						}
					}
				}
				runtime.Gosched()
			}
		})
	}
	return &wg
}

// cancelOne cancels c from three goroutines at once and once more after,
// each Cancel must return nil (no reply is lost here).
func (s *raScene) cancelOne(c *raCase) {
	ctx := context.Background()
	var wg sync.WaitGroup
	for range 3 {
		wg.Go(func() {
			if err := c.r.Cancel(ctx); err != nil {
				s.t.Errorf("%v: Cancel: %v", c, err)
			}
		})
	}
	wg.Wait()
	if err := c.r.Cancel(ctx); err != nil {
		s.t.Errorf("%v: Cancel again: %v", c, err)
	}
}

// expect is the TAT the doc promises once the cancels in order have run
// one after another: a room comes back when its holder cancels while no
// room after it is still taken; a late refusal not held, and a caller
// ended in flight, go back at once, above every booking of their batch
// that stands (see plan and ReserveBatch). batches lists the cases of
// each batch call.
func (s *raScene) expect(batches [][]*raCase, order []*raCase) int64 {
	taken := map[*raCase]bool{}
	var rooms []*raCase
	for _, b := range batches {
		for _, c := range b {
			if c.room() {
				taken[c] = true
				rooms = append(rooms, c)
			}
		}
	}
	top := func(c *raCase) bool { // no room after c is taken
		for _, o := range rooms {
			if taken[o] && o.slot > c.slot {
				return false
			}
		}
		return true
	}
	give := func(c *raCase) {
		if top(c) {
			delete(taken, c)
		}
	}
	for _, b := range batches {
		given := slices.DeleteFunc(slices.Clone(b), func(c *raCase) bool { return !c.given() })
		sort.Slice(given, func(i, j int) bool { return given[i].slot > given[j].slot })
		for _, c := range given { // the latest first
			give(c)
		}
	}
	for _, c := range order {
		give(c)
	}
	tat := s.tat0
	for c := range taken {
		tat = max(tat, c.slot+raT.Microseconds())
	}
	return tat
}

// refunds checks the refund calls made for the scenario, given the
// holders whose Cancel ran (in any order): one per holder cancelled, and
// one per batch that gives bookings back itself (late, or its caller
// ended in flight: they lie end to end, and go back as one, see
// throttle.Engine.RefundUnusedRun); none twice (each tombstone once).
func (s *raScene) refunds(batches [][]*raCase, cancelled []*raCase) {
	t := s.t
	t.Helper()
	want := len(cancelled)
	for _, b := range batches {
		if slices.ContainsFunc(b, (*raCase).given) {
			want++
		}
	}
	count := func() (calls, twice int) {
		s.h.mu.Lock()
		defer s.h.mu.Unlock()
		for _, n := range s.h.tombs {
			calls += n
			if n > 1 {
				twice++
			}
		}
		return calls, twice
	}
	assertEventually(func() bool { n, _ := count(); return n >= want }, 3*time.Second)
	time.Sleep(50 * time.Millisecond) // room for one too many
	calls, twice := count()
	require.Zero(t, twice, "a booking given back twice")
	require.Equal(t, want, calls, "refund calls: one per booking given back")
}

// final checks the key's TAT in Redis against want (if want > 0) and
// against the replay of what stands, then books once more: the next slot
// must be the TAT (burst 0), must not come early by the replay, and is
// given back.
func (s *raScene) final(want int64, standing []int64) {
	t := s.t
	t.Helper()
	if want > 0 {
		// Late bookings the batch gives back itself go out after it has
		// returned: give them time.
		assertEventually(func() bool { return raTAT(t, s.e.rdb, s.e.prefix, s.key) == want }, 3*time.Second)
	}
	got := raTAT(t, s.e.rdb, s.e.prefix, s.key)
	stand := slices.Concat(s.fill, standing)
	replay := raReplay(t, "standing bookings", stand)
	require.GreaterOrEqual(t, got, replay, "the key's TAT is below the replay of the bookings that stand: a slot would come early")
	if want > 0 {
		require.Equal(t, want, got, "the key's TAT (%+d µs from the promised one): room given back did not come back, or came back twice", got-want)
	}
	probe, err := s.l.Reserve(context.Background(), s.key)
	require.NoError(t, err)
	require.True(t, probe.OK(), "%v", probe.Err())
	require.Equal(t, got, probe.Booking().At.UnixMicro(), "the next booking's slot is the TAT")
	raReplay(t, "standing bookings and the next one", append(stand, probe.Booking().At.UnixMicro()))
	require.NoError(t, probe.Cancel(context.Background()))
	require.Equal(t, got, raTAT(t, s.e.rdb, s.e.prefix, s.key), "the next booking given back")
}

// standing returns the slots of the cases that hold a room and were not
// cancelled.
func standing(cs []*raCase) []int64 {
	var out []int64
	for _, c := range cs {
		if c.holds() && c.keep {
			out = append(out, c.slot)
		}
	}
	return out
}

// ---------------------------------------------------------------------------
// Building the scenarios.

// coalesced books kinds ("B", "R", "L" only: no HoldLate for callers of
// ReserveN) as callers of one key queued behind a call in flight (a B, the
// leader), so that they go in one batch call; every reply comes 40 ms
// late. It returns the batches: the leader alone, then the others.
func (s *raScene) coalesced(kinds string) [][]*raCase {
	t := s.t
	t.Helper()
	reserve.SetSoloBelow(s.l, 1)
	lead := &raCase{kind: 'B', ask: 'B', own: s.tat0, slot: s.tat0}
	cs := s.plan(kinds, s.tat0+raT.Microseconds())
	type res struct {
		r   *reserve.Reservation
		err error
	}
	chans := make([]chan res, len(cs)+1)
	run := func(i int, ctx context.Context) {
		ch := make(chan res, 1)
		chans[i] = ch
		go func() { r, err := s.l.Reserve(ctx, s.key); ch <- res{r, err} }()
	}
	s.h.gated.Store(true)
	run(0, context.Background())
	<-s.h.entered
	s.h.after.Store(int64(40 * time.Millisecond))
	for i, c := range cs {
		run(i+1, s.ctxFor(c.ask, c.own))
		require.Eventually(t, func() bool { return reserve.QueueLen(s.l, s.key) == i+1 }, 5*time.Second, time.Millisecond,
			"caller %d did not queue", i)
	}
	s.h.release <- struct{}{} // the leader's call
	<-s.h.entered             // the batch's call, sent: Redis has not run it yet
	for _, cancel := range s.xcancel {
		cancel()
	}
	s.h.gated.Store(false)
	s.h.release <- struct{}{}
	all := append([]*raCase{lead}, cs...)
	s.cases = nil
	for i, c := range all {
		select {
		case o := <-chans[i]:
			if c.kind == 'X' {
				require.ErrorIs(t, o.err, context.Canceled, "caller %d %v: ended in flight", i, c)
				require.Nil(t, o.r)
				s.xs = append(s.xs, c)
				continue
			}
			require.NoError(t, o.err, "caller %d %v", i, c)
			c.r = o.r
			s.cases = append(s.cases, c)
		case <-time.After(20 * time.Second):
			t.Fatalf("caller %d %v never returned\n%s", i, c, ksStacks())
		}
	}
	s.check(s.cases)
	return [][]*raCase{{lead}, cs}
}

// batch books kinds in one ReserveBatch, every reply 40 ms late; H and E
// are allowed.
func (s *raScene) batch(kinds string) [][]*raCase {
	t := s.t
	t.Helper()
	cs := s.plan(kinds, s.tat0)
	reqs := make([]reserve.BatchRequest, len(cs))
	for i, c := range cs {
		reqs[i] = reserve.BatchRequest{Context: s.ctxFor(c.ask, c.own), N: 1, HoldLate: c.ask == 'H' || (c.ask != 'L' && i%2 == 0)}
	}
	s.h.after.Store(int64(40 * time.Millisecond))
	rs, err := s.l.ReserveBatch(context.Background(), s.key, reqs)
	require.NoError(t, err)
	for i, c := range cs {
		c.r = rs[i]
	}
	s.cases = cs
	s.check(cs)
	return [][]*raCase{cs}
}

// raKinds draws a pattern of n kinds from alphabet, with at least one of
// each of must.
func raKinds(rng *rand.Rand, n int, alphabet, must string) string {
	for {
		b := make([]byte, n)
		for i := range b {
			b[i] = alphabet[rng.IntN(len(alphabet))]
		}
		ok := true
		for _, m := range []byte(must) {
			ok = ok && slices.Contains(b, m)
		}
		if ok {
			return string(b)
		}
	}
}

// raRun cancels, in the order named by how, the cases that hold a room,
// with readers running beside, and checks the outcome.
//
//	latest:  latest first: every room comes back (the TAT is the fill's).
//	random:  a random order, one after another, some kept: the TAT is
//	         exactly what the doc's rule gives (expect).
//	at once: a random subset, all at once: no slot early, TAT within
//	         bounds.
func raRun(t *testing.T, s *raScene, batches [][]*raCase, how string, rng *rand.Rand) {
	stop := make(chan struct{})
	wg := s.readers(stop, 4)
	defer func() { close(stop); wg.Wait() }()
	var holders []*raCase
	for _, c := range s.cases {
		if c.holds() {
			holders = append(holders, c)
		}
	}
	switch how {
	case "latest":
		sort.Slice(holders, func(i, j int) bool { return holders[i].slot > holders[j].slot })
		for _, c := range holders {
			s.cancelOne(c)
		}
		s.refunds(batches, holders)
		s.final(s.expect(batches, holders), nil)
		require.Equal(t, s.tat0, raTAT(t, s.e.rdb, s.e.prefix, s.key), "cancelled latest first: every room of the batch came back")
	case "random":
		rng.Shuffle(len(holders), func(i, j int) { holders[i], holders[j] = holders[j], holders[i] })
		var order []*raCase
		for _, c := range holders {
			if rng.IntN(4) == 0 {
				c.keep = true
				continue
			}
			order = append(order, c)
			s.cancelOne(c)
		}
		s.refunds(batches, order)
		s.final(s.expect(batches, order), standing(s.cases))
	case "at once":
		var wg2 sync.WaitGroup
		var gone []*raCase
		for _, c := range holders {
			if rng.IntN(4) == 0 {
				c.keep = true
				continue
			}
			gone = append(gone, c)
			wg2.Go(func() { s.cancelOne(c) })
		}
		wg2.Wait()
		s.refunds(batches, gone)
		var hi int64 = s.tat0
		for _, c := range s.cases {
			if c.room() {
				hi = max(hi, c.slot+raT.Microseconds())
			}
		}
		got := raTAT(t, s.e.rdb, s.e.prefix, s.key)
		require.LessOrEqual(t, got, hi, "the key's TAT beyond every booking made")
		s.final(0, standing(s.cases))
	}
	// A refusal's Cancel, a View's, and Cancel again, after everything:
	// nothing changes.
	before := raTAT(t, s.e.rdb, s.e.prefix, s.key)
	for _, c := range s.cases {
		require.NoError(t, c.v.Cancel(context.Background()))
		if !c.holds() || !c.keep {
			require.NoError(t, c.r.Cancel(context.Background()))
		}
		require.True(t, raSame(c.snap, c.r.Booking()), "%v: Booking() after its Cancel: %+v, was %+v", c, c.r.Booking(), c.snap)
		require.True(t, raSame(c.snap, c.v.Booking()), "%v: its View's Booking() after its Cancel", c)
	}
	require.Equal(t, before, raTAT(t, s.e.rdb, s.e.prefix, s.key), "Cancel again, of a View, of a refusal: nothing given back")
}

// ---------------------------------------------------------------------------
// The tests.

// TestReviewAliasCoalesced: callers of one key queued behind a call in
// flight go in one batch call whose reply comes 40 ms late: some booked,
// some refused, some late (their bookings given back by the batch at once,
// or by the Cancel of the nearest booking after them). Each Reservation's
// Booking() is read, copied with View and cancelled concurrently; the
// key's TAT in Redis must then be exactly what the rooms given back leave.
func TestReviewAliasCoalesced(t *testing.T) {
	t.Parallel()
	seed := uint64(time.Now().UnixNano())
	t.Logf("seed %d", seed)
	rng := rand.New(rand.NewPCG(seed, 7))
	fixed := []string{"LB", "BXLB", "LLBRL", "RLBLLB", "BRLRBL", "LLL", "BLL"}
	for round, how := range []string{"latest", "random", "at once", "latest", "random", "at once", "random"} {
		kinds := fixed[round%len(fixed)]
		if round >= len(fixed)/2 {
			kinds = raKinds(rng, 4+rng.IntN(6), "BRL", "BL")
			if rng.IntN(2) == 0 { // one caller ended in flight
				at := rng.IntN(len(kinds) + 1)
				kinds = kinds[:at] + "X" + kinds[at:]
			}
		}
		t.Run(fmt.Sprintf("%d-%s-%s", round, kinds, how), func(t *testing.T) {
			s := newRAScene(t, "k")
			batches := s.coalesced(kinds)
			raRun(t, s, batches, how, rng)
			ksNoState(t, s.l)
		})
	}
}

// TestReviewAliasBatch: the same with one ReserveBatch, late requests held
// (H) or not (L), requests ended before the call (E), refused (R), booked
// (B, some of them HoldLate too: it changes nothing for a booking in time).
func TestReviewAliasBatch(t *testing.T) {
	t.Parallel()
	seed := uint64(time.Now().UnixNano())
	t.Logf("seed %d", seed)
	rng := rand.New(rand.NewPCG(seed, 11))
	fixed := []string{"LH", "HLB", "BLHLB", "ELRHLBE", "LLHLL", "BRLEHRLB", "HHLL"}
	for round, how := range []string{"latest", "random", "at once", "latest", "random", "at once", "random", "latest"} {
		kinds := fixed[round%len(fixed)]
		if round >= len(fixed)/2 {
			kinds = raKinds(rng, 4+rng.IntN(8), "BRLHE", "LH")
		}
		t.Run(fmt.Sprintf("%d-%s-%s", round, kinds, how), func(t *testing.T) {
			s := newRAScene(t, "k")
			batches := s.batch(kinds)
			raRun(t, s, batches, how, rng)
		})
	}
}

// TestReviewAliasBatchWork: TestReviewAliasBatch under a work estimate
// of a minute, with requests refused before the call for want of room for
// the work (Z) among the others: every answer is still the one of its own
// request.
func TestReviewAliasBatchWork(t *testing.T) {
	t.Parallel()
	seed := uint64(time.Now().UnixNano())
	t.Logf("seed %d", seed)
	rng := rand.New(rand.NewPCG(seed, 13))
	for round, how := range []string{"latest", "random", "at once", "random"} {
		kinds := []string{"ZLHZB", "BZLZHLZ"}[round%2]
		if round >= 2 {
			kinds = raKinds(rng, 5+rng.IntN(6), "BRLHEZ", "LHZ")
		}
		t.Run(fmt.Sprintf("%d-%s-%s", round, kinds, how), func(t *testing.T) {
			s := newRAScene(t, "k")
			l, err := s.l.With(reserve.WithWorkEstimate(time.Minute))
			require.NoError(t, err)
			s.l, s.work = l, time.Minute
			batches := s.batch(kinds)
			raRun(t, s, batches, how, rng)
		})
	}
}

// TestReviewAliasEveryOrder: for a coalesced batch and a ReserveBatch,
// every order of the Cancels of the bookings held, one after another,
// each Cancel repeated and concurrent with reads and Views: the key's TAT
// is exactly what the rooms given back leave.
func TestReviewAliasEveryOrder(t *testing.T) {
	t.Parallel()
	perms := func(n int) [][]int {
		var out [][]int
		var rec func(p []int, used []bool)
		rec = func(p []int, used []bool) {
			if len(p) == n {
				out = append(out, slices.Clone(p))
				return
			}
			for i := range n {
				if !used[i] {
					used[i] = true
					rec(append(p, i), used)
					used[i] = false
				}
			}
		}
		rec(nil, make([]bool, n))
		return out
	}
	// Three holders each (the coalesced leader is one), once the late
	// (L) and ended (X) requests' slots are handed down; see plan.
	for _, sc := range []struct{ how, kinds string }{{"coalesced", "LBB"}, {"batch", "HLBB"}, {"coalesced", "LXBB"}, {"coalesced", "BLXB"}} {
		for n, p := range perms(3) {
			t.Run(fmt.Sprintf("%s-%s-%v", sc.how, sc.kinds, p), func(t *testing.T) {
				s := newRAScene(t, "k")
				var batches [][]*raCase
				if sc.how == "coalesced" {
					batches = s.coalesced(sc.kinds)
				} else {
					batches = s.batch(sc.kinds)
				}
				var holders []*raCase
				for _, c := range s.cases {
					if c.holds() {
						holders = append(holders, c)
					}
				}
				require.Len(t, holders, 3)
				stop := make(chan struct{})
				wg := s.readers(stop, 2)
				var order []*raCase
				for _, i := range p {
					order = append(order, holders[i])
					s.cancelOne(holders[i])
				}
				close(stop)
				wg.Wait()
				s.refunds(batches, order)
				want := s.expect(batches, order)
				t.Logf("order %d: TAT %+d µs from the fill's", n, want-s.tat0)
				s.final(want, nil)
			})
		}
	}
}

// TestReviewAliasLostReply: a batch B L B (the late one's slot handed down
// to the last one, its own given back by the batch at once). The last
// one's Cancel loses its reply (the refund ran): it fails. Retried, it
// succeeds: cancelled latest first, everything comes back. In the second
// run another booking takes the room between the lost reply and the
// retry: the retry must give nothing back (not that booking's room, which
// ends where the cancelled one did).
func TestReviewAliasLostReply(t *testing.T) {
	t.Parallel()
	for _, intruder := range []bool{false, true} {
		t.Run(fmt.Sprintf("intruder=%v", intruder), func(t *testing.T) {
			s := newRAScene(t, "k")
			batches := s.batch("BLB")
			b0, l1, b2 := s.cases[0], s.cases[1], s.cases[2]
			ctx := context.Background()
			// The batch's own give-back of the late booking first (it goes
			// out after the batch has returned), its reply in, so that the
			// reply lost is the Cancel's.
			s.h.after.Store(0)
			require.Eventually(t, func() bool { return raTAT(t, s.e.rdb, s.e.prefix, s.key) == l1.slot }, 3*time.Second, time.Millisecond)
			time.Sleep(200 * time.Millisecond)
			s.h.loseRefund.Store(true)
			err := b2.r.Cancel(ctx)
			require.Error(t, err, "the refund's reply was lost")
			require.ErrorIs(t, err, throttle.ErrReplyLost)
			require.Equal(t, int64(1), s.h.lost.Load())
			require.Equal(t, b2.slot, raTAT(t, s.e.rdb, s.e.prefix, s.key),
				"the refund ran: the key is back at the last booking's slot (the late one's above it given back)")
			require.Equal(t, b2.slot+raT.Microseconds(), l1.slot, "the late one's slot handed down")
			// The lost reply opened the engine's breaker: calls fail fast
			// (nothing sent) until a probe succeeds.
			var c *reserve.Reservation
			if intruder {
				redistest.UntilOK(t, func() (err error) { c, err = s.l.Reserve(ctx, s.key); return err })
				require.True(t, c.OK())
				require.Equal(t, b2.slot, c.Booking().At.UnixMicro(), "the intruder takes the room given back")
			}
			redistest.UntilOK(t, func() error { return b2.r.Cancel(ctx) }) // Cancel retried
			require.NoError(t, b2.r.Cancel(ctx), "and again")
			require.NoError(t, b0.r.Cancel(ctx))
			if !intruder {
				s.final(s.expect(batches, []*raCase{b2, b0}), nil)
				require.Equal(t, s.tat0, raTAT(t, s.e.rdb, s.e.prefix, s.key), "everything came back")
				return
			}
			// The intruder stands: nothing under it can come back.
			s.final(b2.slot+raT.Microseconds(), []int64{c.Booking().At.UnixMicro()})
			require.NoError(t, c.Cancel(ctx))
		})
	}
}

// TestReviewAliasLateSingle: a caller alone (not coalesced, and coalesced
// but sent alone) refused late: its Booking() is OK false with the slot as
// booked, its room comes back before ReserveN returns (the next booking
// takes its slot), and its Cancel, its View's, repeated and concurrent,
// make no difference.
func TestReviewAliasLateSingle(t *testing.T) {
	t.Parallel()
	for _, coalesce := range []bool{false, true} {
		t.Run(fmt.Sprintf("coalesce=%v", coalesce), func(t *testing.T) {
			s := newRAScene(t, "k")
			l, err := s.l.With(reserve.WithCoalescing(coalesce))
			require.NoError(t, err)
			s.h.after.Store(int64(40 * time.Millisecond))
			c := &raCase{kind: 'L', ask: 'L', own: s.tat0, slot: s.tat0}
			r, err := l.Reserve(s.ctxFor('L', c.slot), s.key)
			require.NoError(t, err)
			c.r = r
			s.cases = []*raCase{c}
			s.check(s.cases)
			stop := make(chan struct{})
			wg := s.readers(stop, 4)
			var cw sync.WaitGroup
			for range 8 {
				cw.Go(func() {
					if err := c.r.Cancel(context.Background()); err != nil {
						t.Errorf("Cancel: %v", err)
					}
				})
			}
			cw.Wait()
			close(stop)
			wg.Wait()
			s.final(s.tat0, nil)
		})
	}
}

// TestReviewAliasFallback: with Redis gone and a fallback answering,
// Booking() of every answer (coalesced callers, a ReserveBatch with
// HoldLate, a refusal) and of its View must not panic and is the zero
// Booking; Cancel, repeated and concurrent with reads, and Wait cut short,
// return.
func TestReviewAliasFallback(t *testing.T) {
	t.Parallel()
	for _, fb := range []struct {
		name string
		f    reserve.Fallback
	}{{"fail open", reserve.FailOpen()}, {"local share", reserve.LocalShare(time.Minute, 1, 100)}, {"fail closed", reserve.FailClosed()}} {
		t.Run(fb.name, func(t *testing.T) {
			t.Parallel()
			eng, _, kill := outage(t)
			l, err := reserve.New(eng, "api", throttle.PerSecond(20, 2), reserve.WithFallback(fb.f))
			require.NoError(t, err)
			reserve.SetSoloBelow(l, 1)
			bookedByRedis(t, l)
			kill()
			ctx := context.Background()
			require.Eventually(t, func() bool {
				r, err := l.Reserve(ctx, "k")
				if err == nil && r.Fallback() {
					_ = r.Cancel(ctx)
					return true
				}
				return false
			}, 10*time.Second, 10*time.Millisecond, "the fallback never answered")

			var mu sync.Mutex
			var rs []*reserve.Reservation
			var wg sync.WaitGroup
			for i := range 12 {
				wg.Go(func() {
					var got []*reserve.Reservation
					if i%3 == 0 {
						b, err := l.ReserveBatch(ctx, "k", []reserve.BatchRequest{{N: 1, HoldLate: true}, {N: 1}, {N: 3, HoldLate: true}})
						if err != nil {
							t.Errorf("ReserveBatch: %v", err)
							return
						}
						got = b
					} else {
						short, cancel := context.WithTimeout(ctx, 150*time.Millisecond)
						defer cancel()
						r, err := l.Reserve(short, "k")
						if err != nil {
							return // a context's end: no answer to read
						}
						got = []*reserve.Reservation{r}
					}
					mu.Lock()
					rs = append(rs, got...)
					mu.Unlock()
				})
			}
			wg.Wait()
			require.NotEmpty(t, rs)
			var fb, ok int
			for _, r := range rs {
				if r.Fallback() {
					fb++
				}
				if r.OK() {
					ok++
				}
			}
			t.Logf("%d answers: %d by the fallback, %d OK", len(rs), fb, ok)
			require.Positive(t, fb, "no answer came from the fallback")
			var rw sync.WaitGroup
			for i, r := range rs {
				rw.Go(func() {
					defer func() {
						if p := recover(); p != nil {
							t.Errorf("answer %d (fallback %v, ok %v): panicked: %v", i, r.Fallback(), r.OK(), p)
						}
					}()
					for range 3 {
						if b := r.Booking(); !raSame(b, throttle.Booking{}) {
							t.Errorf("answer %d: fallback's Booking() %+v", i, b)
						}
						v := r.View()
						_ = v.Booking()
						_ = v.Cancel(ctx)
						_ = r.Cancel(ctx)
						short, cancel := context.WithTimeout(ctx, time.Millisecond)
						_ = v.Wait(short)
						_ = r.Wait(short)
						cancel()
					}
				})
			}
			rw.Wait()
		})
	}
}

// ---------------------------------------------------------------------------
// 776131e: a key handed on once, whichever way booking ends.

// raObs ends its goroutine (runtime.Goexit) or panics at the first call of
// the method it is armed for.
type raObs struct {
	goexitRefund, goexitCall atomic.Bool
	panicRefund              atomic.Bool
	decisionsToGoexit        atomic.Int64 // the decision that ends its goroutine, counted down
}

func (o *raObs) ObserveDecision(string, throttle.Outcome, time.Duration) {
	if o.decisionsToGoexit.Load() > 0 && o.decisionsToGoexit.Add(-1) == 0 {
		runtime.Goexit()
	}
}
func (o *raObs) ObserveCall(string, time.Duration, error) {
	if o.goexitCall.CompareAndSwap(true, false) {
		runtime.Goexit()
	}
}
func (o *raObs) ObserveRefund(string, time.Duration) {
	if o.goexitRefund.CompareAndSwap(true, false) {
		runtime.Goexit()
	}
	if o.panicRefund.CompareAndSwap(true, false) {
		panic("review: observer panics on a refund")
	}
}
func (o *raObs) ObserveBreaker(bool) {}

// raOutcome is what became of one Reserve on a goroutine of its own.
type raOutcome struct {
	r        *reserve.Reservation
	err      error
	returned bool
	panicked any
	stack    string // where it panicked, if it did
}

func raGo(l *reserve.Limiter, ctx context.Context, key string) chan raOutcome {
	ch := make(chan raOutcome, 1)
	go func() {
		var o raOutcome
		defer func() { // runs on Goexit too
			if o.panicked = recover(); o.panicked != nil {
				o.stack = string(debug.Stack())
			}
			ch <- o
		}()
		o.r, o.err = l.Reserve(ctx, key)
		o.returned = true
	}()
	return ch
}

func raWait(t *testing.T, ch chan raOutcome, who string) raOutcome {
	t.Helper()
	select {
	case o := <-ch:
		return o
	case <-time.After(20 * time.Second):
		t.Fatalf("%s never returned\n%s", who, ksStacks())
	}
	return raOutcome{}
}

// TestReviewAliasHandOnLateRefund: the leader of a key's call alone is
// refused late; its booking goes back (after the key is handed on to the
// caller queued behind it), and the Observer ends the goroutine, or
// panics, on that refund. The queued caller must be served once, callers
// after it too, no key state may be left, and the room must stand as the
// replay of what stands says.
func TestReviewAliasHandOnLateRefund(t *testing.T) {
	t.Parallel()
	for _, how := range []string{"goexit", "panic", "none"} {
		t.Run(how, func(t *testing.T) {
			obs := &raObs{}
			s := newRAScene(t, "k", throttle.WithObserver(obs))
			reserve.SetSoloBelow(s.l, 1)
			s.h.gated.Store(true)
			first := raGo(s.l, s.ctxFor('L', s.tat0), s.key)
			<-s.h.entered
			s.h.gated.Store(false)
			s.h.after.Store(int64(40 * time.Millisecond))
			second := raGo(s.l, context.Background(), s.key)
			require.Eventually(t, func() bool { return reserve.QueueLen(s.l, s.key) == 1 }, 5*time.Second, time.Millisecond)
			switch how {
			case "goexit":
				obs.goexitRefund.Store(true)
			case "panic":
				obs.panicRefund.Store(true)
			}
			s.h.release <- struct{}{}
			o1 := raWait(t, first, "the late leader")
			o2 := raWait(t, second, "the caller queued behind it")
			t.Logf("late leader: returned %v, panicked %v, err %v", o1.returned, o1.panicked, o1.err)
			switch how {
			case "goexit":
				require.False(t, o1.returned)
				require.Nil(t, o1.panicked, "a Goexit became a panic")
			case "panic":
				require.NotNil(t, o1.panicked)
			default:
				require.True(t, o1.returned)
				require.NoError(t, o1.err)
				require.ErrorIs(t, o1.r.Err(), deadline.ErrWouldExceedDeadline)
			}
			require.True(t, o2.returned)
			require.Nil(t, o2.panicked)
			require.NoError(t, o2.err)
			require.True(t, o2.r.OK())
			at := o2.r.Booking().At.UnixMicro()
			// The late room came back before or after the second booked:
			// its slot is the late one's, or the one after it.
			require.Contains(t, []int64{s.tat0, s.tat0 + raT.Microseconds()}, at)
			var more []chan raOutcome
			for range 5 {
				more = append(more, raGo(s.l, context.Background(), s.key))
			}
			var stand []int64
			stand = append(stand, at)
			for i, ch := range more {
				o := raWait(t, ch, fmt.Sprintf("caller %d after", i))
				require.True(t, o.returned)
				require.NoError(t, o.err)
				require.True(t, o.r.OK())
				stand = append(stand, o.r.Booking().At.UnixMicro())
			}
			require.Eventually(t, func() bool { live, _ := reserve.KeyStates(s.l); return live == 0 }, 5*time.Second, time.Millisecond)
			want := slices.Max(stand) + raT.Microseconds()
			s.final(want, stand)
		})
	}
}

// TestReviewAliasGoexitMergedCall: a booking that goes out in a merged
// call (WithMergeAt(1): another single booking is in flight) whose
// Observer ends its goroutine (runtime.Goexit) on the call. The key must
// be handed on as with a call of its own, and the Goexit must stay a
// Goexit: the caller's goroutine ends, without a panic.
func TestReviewAliasGoexitMergedCall(t *testing.T) {
	t.Parallel()
	obs := &raObs{}
	s := newRAScene(t, "a", throttle.WithObserver(obs), throttle.WithMergeAt(1))
	s.h.mu.Lock()
	s.h.shas = nil
	s.h.mu.Unlock()
	s.h.gated.Store(true)
	held := raGo(s.l, context.Background(), "a") // alone, holding the one flight token
	<-s.h.entered
	s.h.gated.Store(false)
	obs.goexitCall.Store(true)
	merged := raGo(s.l, context.Background(), "b")
	o := raWait(t, merged, "the merged booking")
	s.h.mu.Lock()
	shas := slices.Clone(s.h.shas)
	s.h.mu.Unlock()
	s.h.release <- struct{}{}
	oh := raWait(t, held, "the held booking")
	require.True(t, oh.returned)
	require.NoError(t, oh.err)
	require.Len(t, shas, 2)
	t.Logf("scripts: %v (the second differs: a merged call)", shas)
	require.False(t, obs.goexitCall.Load(), "the Observer ended the goroutine")
	require.False(t, o.returned)
	if o.panicked != nil {
		var frames []string
		for _, line := range strings.Split(o.stack, "\n") {
			if strings.Contains(line, ".go:") && !strings.Contains(line, "_test.go") && !strings.Contains(line, "/runtime/") {
				frames = append(frames, strings.TrimSpace(line))
			}
		}
		t.Errorf("an Observer's runtime.Goexit on a merged call came out of Reserve as a panic: %T %v\nat:\n%s",
			o.panicked, o.panicked, strings.Join(frames, "\n"))
	}
	next := raWait(t, raGo(s.l, context.Background(), "b"), "the next caller of b")
	require.True(t, next.returned)
	require.NoError(t, next.err)
	require.Eventually(t, func() bool { live, _ := reserve.KeyStates(s.l); return live == 0 }, 5*time.Second, time.Millisecond)
}

// TestReviewAliasGoexitBatchDecision: the Observer ends the goroutine of a
// batch call's sender on the batch's first decision (the call booked in
// Redis, its reply in), in a batch of coalesced callers with late ones.
// Every other caller of the batch must get an answer (an error), the key
// must be handed on once, and later callers served.
func TestReviewAliasGoexitBatchDecision(t *testing.T) {
	t.Parallel()
	obs := &raObs{}
	s := newRAScene(t, "k", throttle.WithObserver(obs))
	reserve.SetSoloBelow(s.l, 1)
	s.h.gated.Store(true)
	lead := raGo(s.l, context.Background(), s.key)
	<-s.h.entered
	s.h.gated.Store(false)
	s.h.after.Store(int64(40 * time.Millisecond))
	cs := s.plan("BLBL", s.tat0+raT.Microseconds())
	var chans []chan raOutcome
	for i, c := range cs {
		chans = append(chans, raGo(s.l, s.ctxFor(c.ask, c.own), s.key))
		require.Eventually(t, func() bool { return reserve.QueueLen(s.l, s.key) == i+1 }, 5*time.Second, time.Millisecond)
	}
	obs.decisionsToGoexit.Store(2) // the leader's decision passes; the batch's first ends its sender
	s.h.release <- struct{}{}
	o := raWait(t, lead, "the leader")
	require.True(t, o.returned)
	require.NoError(t, o.err)
	var answered, ended int
	for i, ch := range chans {
		o := raWait(t, ch, fmt.Sprintf("caller %d", i))
		if o.returned {
			answered++
			require.Error(t, o.err, "caller %d: its batch's sender ended", i)
		} else {
			ended++
			require.Nil(t, o.panicked)
		}
	}
	t.Logf("answered %d, goroutines ended %d", answered, ended)
	require.Equal(t, 1, ended, "the batch's sender alone ends")
	for i := range 3 {
		o := raWait(t, raGo(s.l, context.Background(), s.key), fmt.Sprintf("caller %d after", i))
		require.True(t, o.returned)
		require.NoError(t, o.err)
	}
	require.Eventually(t, func() bool { live, _ := reserve.KeyStates(s.l); return live == 0 }, 5*time.Second, time.Millisecond)
}
