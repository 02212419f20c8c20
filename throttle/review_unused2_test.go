package throttle_test

// Second review of 9494129 and b47ae7f (Engine.RefundUnused, the
// tombstone living until the latest of a booking's slot and ends) through
// the public API. Oracle of its own: a model of who acted. A booking whose
// holder acted runs at Booking.At; one given back before its slot, or
// never used, does not run. The runs are replayed against the arrival
// curve (ruCurve: at most Burst+1+floor(d/I) units in any window d), and
// every give-back is checked against "a booking comes back at most once,
// never more than its own units, and a used slot never".

import (
	"context"
	"fmt"
	"math/rand/v2"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/slotbook/slotbook/internal/redistest"
	"github.com/slotbook/slotbook/throttle"
)

// ru2Booking is one booking in the model.
type ru2Booking struct {
	b      throttle.Booking
	used   bool // its holder acts at its slot unless it cancels before
	ran    bool // it ran (or, for a used one whose refund came late, runs)
	gave   bool // some refund of it gave something back
	cancel bool // its holder gave it back before its slot: it never runs

	tried, triedAll bool // refunded before; by RefundAll
}

// ru2Model drives one key set (one or two limits) through random bookings
// and refunds, RefundAll and RefundUnused mixed, retried, in any order,
// with pauses, on the clock now() returns (test or Redis). A booking
// given back one way and then the other gets ErrInvalidRequest the second
// way, and nothing is sent.
type ru2Model struct {
	t      *testing.T
	e      *env
	keys   []string
	lims   []throttle.Limit
	rng    *rand.Rand
	all    []*ru2Booking
	pauses [][2]int64 // {issued at, no slot before}
	stats  struct{ unusedLate, otherWay, twiceTried int }
}

func (m *ru2Model) book(ctx context.Context, now int64, n int, maxWait time.Duration, used bool) {
	bs, err := m.e.eng.BookAll(ctx, m.keys, m.lims, []throttle.Request{{N: n, MaxWait: maxWait}})
	require.NoError(m.t, err)
	b := bs[0]
	if !b.OK {
		return
	}
	for _, p := range m.pauses {
		if now >= p[0] {
			require.GreaterOrEqual(m.t, b.At.UnixMicro(), p[1], "a booking made after a pause runs before its end")
		}
	}
	m.all = append(m.all, &ru2Booking{b: b, used: used})
}

func (m *ru2Model) refund(ctx context.Context, now int64, x *ru2Booking, unused bool) {
	var g []time.Duration
	var err error
	before := m.e.calls.Load()
	if unused {
		require.False(m.t, x.used, "model: RefundUnused only for a booking no one acted on")
		g, err = m.e.eng.RefundUnused(ctx, m.keys, m.lims, x.b)
	} else {
		g, err = m.e.eng.RefundAll(ctx, m.keys, m.lims, x.b)
	}
	if x.tried && x.triedAll == unused { // given back the other way before
		require.ErrorIs(m.t, err, throttle.ErrInvalidRequest, "a booking given back both ways")
		require.Equal(m.t, before, m.e.calls.Load(), "the second way made a Redis call")
		m.stats.otherWay++
		return
	}
	require.NoError(m.t, err)
	gaveAny := false
	for k, d := range g {
		require.GreaterOrEqual(m.t, d, time.Duration(0), "negative give-back")
		// A key's give-back is its TAT's move: the booking's units, and
		// on a layered limit the idle gap its slot (pushed by another
		// limit) skipped; never more than the slot's distance from now
		// plus its units.
		gap := max(0, time.Duration(x.b.At.UnixMicro()-now)*time.Microsecond)
		require.LessOrEqual(m.t, d, gap+time.Duration(x.b.N)*m.lims[k].Interval(), "more than the booking's room given back")
		gaveAny = gaveAny || d > 0
	}
	slot := x.b.At.UnixMicro()
	if unused && gaveAny && now >= slot {
		m.stats.unusedLate++
	}
	if x.tried {
		m.stats.twiceTried++
	}
	x.tried = true
	x.triedAll = x.triedAll || !unused
	if gaveAny {
		require.False(m.t, x.gave, "booking (slot %d, N %d) given back twice: %v (unused=%v at %d)", slot, x.b.N, g, unused, now)
		x.gave = true
	}
	if x.used {
		if now < slot && !x.ran {
			x.cancel = true // its holder gave up before its slot: it never runs
		} else if !x.cancel {
			x.ran = true
			require.False(m.t, gaveAny, "a used slot (at %d) given back at %d: %v", slot, now, g)
		}
	}
}

// check replays what ran against each limit's arrival curve.
func (m *ru2Model) check() {
	var at []int64
	var n []int
	for _, x := range m.all {
		if x.used && !x.cancel {
			at = append(at, x.b.At.UnixMicro())
			n = append(n, x.b.N)
		}
	}
	for _, l := range m.lims {
		ruCurve(m.t, l.Interval().Microseconds(), l.Burst, at, n)
	}
}

// step does one random operation at now.
func (m *ru2Model) step(ctx context.Context, now int64) {
	switch r := m.rng.IntN(10); {
	case r < 4 || len(m.all) == 0:
		maxB := m.lims[0].Burst
		for _, l := range m.lims {
			maxB = min(maxB, l.Burst)
		}
		n := 1 + m.rng.IntN(maxB+1)
		mw := []time.Duration{0, 50 * time.Millisecond, throttle.Forever}[m.rng.IntN(3)]
		m.book(ctx, now, n, mw, m.rng.IntN(2) == 0)
	case r < 9:
		x := m.all[m.rng.IntN(len(m.all))]
		unused := !x.used && m.rng.IntN(3) > 0
		m.refund(ctx, now, x, unused)
	default:
		d := time.Duration(m.rng.IntN(300)) * time.Millisecond
		require.NoError(m.t, m.e.eng.BlockAll(ctx, m.keys, m.lims, d))
		m.pauses = append(m.pauses, [2]int64{now, now + d.Microseconds()})
	}
}

// TestReviewUnused2RandomTestClock: random bookings on one key and on two
// layered keys, used or not, given back by RefundAll and RefundUnused in
// random orders and retried, with pauses, on the test clock.
func TestReviewUnused2RandomTestClock(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	ms := time.Millisecond
	sets := []struct {
		keys []string
		lims []throttle.Limit
	}{
		{[]string{"k"}, []throttle.Limit{throttle.Every(100*ms, 1, 0)}},
		{[]string{"k"}, []throttle.Limit{throttle.Every(100*ms, 1, 2)}},
		{[]string{"{s}:a", "{s}:b"}, []throttle.Limit{throttle.Every(100*ms, 1, 1), throttle.Every(350*ms, 1, 3)}},
		{[]string{"{s}:a", "{s}:b"}, []throttle.Limit{throttle.Every(300*ms, 1, 2), throttle.Every(70*ms, 1, 0)}},
	}
	var unusedLate, otherWay, twice int
	defer func() {
		t.Logf("RefundUnused gave back after the slot %d times; the other way refused %d; refunds retried %d",
			unusedLate, otherWay, twice)
	}()
	for seed := range uint64(60) {
		for si, s := range sets {
			e := e.fresh(t)
			m := &ru2Model{t: t, e: e, keys: s.keys, lims: s.lims, rng: rand.New(rand.NewPCG(seed, uint64(si)))}
			t0 := base()
			now := time.Duration(0)
			for range 40 {
				now += time.Duration(m.rng.IntN(120)) * ms
				m.step(at(t0, now), t0+now.Microseconds())
			}
			// Everyone still holding a used booking acts.
			for _, x := range m.all {
				if x.used && !x.cancel {
					x.ran = true
				}
			}
			m.check()
			unusedLate += m.stats.unusedLate
			otherWay += m.stats.otherWay
			twice += m.stats.twiceTried
		}
	}
}

// TestReviewUnused2RandomRedisClock: the same on the Redis clock (keys and
// tombstones expire for real), with short intervals and real time passing.
func TestReviewUnused2RandomRedisClock(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	ms := time.Millisecond
	sets := []struct {
		keys []string
		lims []throttle.Limit
	}{
		{[]string{"k"}, []throttle.Limit{throttle.Every(20*ms, 1, 1)}},
		{[]string{"{s}:a", "{s}:b"}, []throttle.Limit{throttle.Every(15*ms, 1, 1), throttle.Every(40*ms, 1, 2)}},
	}
	ctx := context.Background()
	for seed := range uint64(4) {
		for si, s := range sets {
			e := e.fresh(t)
			m := &ru2Model{t: t, e: e, keys: s.keys, lims: s.lims, rng: rand.New(rand.NewPCG(seed, uint64(si)+100))}
			for range 40 {
				time.Sleep(time.Duration(m.rng.IntN(15)) * ms)
				// The model's "now" must not run ahead of Redis's: read it
				// before the call, from a zero-cost probe of the clock (a
				// refused booking under a huge N would do; Booking.At of a
				// 0-wait refusal is now). Use the local clock less a margin
				// only to decide "before the slot", conservatively.
				now := redisNow(t, e)
				m.step(ctx, now)
			}
			for _, x := range m.all {
				if x.used && !x.cancel {
					x.ran = true
				}
			}
			m.check()
		}
	}
}

// redisNow reads the Redis clock in microseconds.
func redisNow(t *testing.T, e *env) int64 {
	tm, err := e.rdb.Time(context.Background()).Result()
	require.NoError(t, err)
	return tm.UnixMicro()
}

// TestReviewUnused2ThreeOrders: three bookings a, b, c on one key, queued
// (burst 0, I = 1 s), none used, given back in each of the six orders, each
// by RefundUnused, or by RefundAll (then RefundUnused, refused: one way
// only), at times before and after the slots: every order given latest
// first gives everything back;
// each booking comes back at most once; then the key is idle again and
// what runs next keeps the curve.
func TestReviewUnused2ThreeOrders(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	lim := throttle.Every(time.Second, 1, 0)
	keys, lims := []string{"k"}, []throttle.Limit{lim}
	one := throttle.Request{N: 1, MaxWait: throttle.Forever}
	ms := time.Millisecond
	perms := [][3]int{{0, 1, 2}, {0, 2, 1}, {1, 0, 2}, {1, 2, 0}, {2, 0, 1}, {2, 1, 0}}
	for _, p := range perms {
		for mode := range 4 { // bit 0: RefundAll first; bit 1: late (after every slot but before the ends)
			e := e.fresh(t)
			t0 := base()
			var bs [3]throttle.Booking
			for i := range bs {
				b, err := e.eng.Book(at(t0, 0), "k", lim, one) // slots t0, t0+1s, t0+2s
				require.NoError(t, err)
				bs[i] = b
			}
			now := 100 * ms
			if mode&2 != 0 {
				now = 2500 * ms
			}
			var total time.Duration
			gaveOnce := [3]bool{}
			for round := range 2 { // the second round retries everything
				for _, i := range p {
					if mode&1 != 0 {
						g, err := e.eng.RefundAll(at(t0, now), keys, lims, bs[i])
						require.NoError(t, err)
						if g[0] > 0 {
							require.False(t, gaveOnce[i], "order %v mode %d: booking %d given back twice", p, mode, i)
							gaveOnce[i] = true
						}
						total += g[0]
					}
					g, err := e.eng.RefundUnused(at(t0, now), keys, lims, bs[i])
					if mode&1 != 0 {
						require.ErrorIs(t, err, throttle.ErrInvalidRequest, "RefundUnused after RefundAll")
						now += 10 * ms
						continue
					}
					require.NoError(t, err)
					if g[0] > 0 {
						require.False(t, gaveOnce[i], "order %v mode %d: booking %d given back twice (round %d)", p, mode, i, round)
						gaveOnce[i] = true
					}
					total += g[0]
					now += 10 * ms
				}
			}
			// Only the latest-first order gives back in full; never more
			// than the room in front of the key.
			require.LessOrEqual(t, total, 3*time.Second-100*ms)
			switch {
			case p == [3]int{2, 1, 0} && mode == 0:
				// c at +100ms and b at +110ms in full, a (slot come) its
				// 880 ms still standing, by RefundUnused.
				require.Equal(t, 2880*ms, total, "latest first gives everything back")
			case p == [3]int{2, 1, 0} && mode == 1:
				// By RefundAll: c and b in full, a (slot come) nothing.
				require.Equal(t, 2000*ms, total, "latest first by RefundAll")
			}
			// What runs next: as many immediate bookings as pass, at now;
			// together with nothing else (none of a, b, c ran) they keep
			// the curve, and at least one passes when all came back.
			var ran []int64
			var n []int
			for range 3 {
				x, err := e.eng.Book(at(t0, now), "k", lim, throttle.Request{N: 1})
				require.NoError(t, err)
				if x.OK {
					ran = append(ran, x.At.UnixMicro())
					n = append(n, 1)
				}
			}
			ruCurve(t, time.Second.Microseconds(), 0, ran, n)
		}
	}
}

// TestReviewUnused2TombstoneLifetime measures how long the tombstone of an
// ordinary Cancel (RefundAll before the slot) lives, on the Redis clock,
// for a layered limit of 5 per second and 1000 per day (burst 999, the
// day's quota usable at once) after most of the day's quota is spent: the
// slot is at most 200 ms away, but the day key's end lies about a day
// ahead. It logs the PTTL and pins that it stays within the booking's
// latest end (it does not outlive what it guards).
func TestReviewUnused2TombstoneLifetime(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	sec := throttle.Every(time.Second, 5, 4)
	day := throttle.Every(24*time.Hour, 1000, 999)
	keys, lims := []string{"{u}:sec", "{u}:day"}, []throttle.Limit{sec, day}
	ctx := context.Background()
	// Spend 900 of the day's units in one booking-free step: N is capped
	// at Burst+1 of the smallest burst, so push the day key with bookings
	// of the day limit alone on its key.
	for range 180 {
		bs, err := e.eng.Book(ctx, "{u}:day", day, throttle.Request{N: 5})
		require.NoError(t, err)
		require.True(t, bs.OK)
	}
	bs, err := e.eng.BookAll(ctx, keys, lims, []throttle.Request{{N: 5, MaxWait: time.Second}, {N: 1, MaxWait: time.Second}})
	require.NoError(t, err)
	b := bs[1]
	require.True(t, b.OK)
	require.Positive(t, b.Wait, "the second booking waits for the per-second limit")
	require.Less(t, b.Wait, time.Second)
	g, err := e.eng.RefundAll(ctx, keys, lims, b)
	require.NoError(t, err)
	require.Positive(t, g[0])
	var tomb string
	all, err := e.rdb.Keys(ctx, e.prefix+"*:x:*").Result()
	require.NoError(t, err)
	require.Len(t, all, 1, "one tombstone")
	tomb = all[0]
	require.True(t, strings.Contains(tomb, "{u}"), "the tombstone %q hashes with its keys", tomb)
	pttl, err := e.rdb.PTTL(ctx, tomb).Result()
	require.NoError(t, err)
	t.Logf("Cancel %v before the slot: tombstone PTTL %v (the slot was %v away)", b.Wait, pttl, b.Wait)
	require.LessOrEqual(t, pttl, 24*time.Hour+time.Minute)
}

// TestReviewUnused2Cluster: on a 3-node Redis Cluster, RefundUnused of a
// layered booking (keys with a hash tag, and a single key without one,
// under a prefix with none) goes out in one script (its tombstone hashes
// with the keys), gives back once, and its retry gives nothing.
func TestReviewUnused2Cluster(t *testing.T) {
	t.Parallel()
	cluster := redistest.StartCluster(t, 3)
	cc := cluster.Client(t)
	eng, err := throttle.New(cc, throttle.WithPrefix("rv2:"), throttle.WithTimeout(5*time.Second))
	require.NoError(t, err)
	ctx := context.Background()
	ms := time.Millisecond
	a := throttle.Every(200*ms, 1, 0)
	b := throttle.Every(800*ms, 1, 0)
	for i, ks := range [][]string{{"{c1}:a", "{c1}:b"}, {"plain" + fmt.Sprint(1)}, {"x{c2}y"}} {
		lims := []throttle.Limit{a, b}
		if len(ks) == 1 {
			lims = []throttle.Limit{b}
		}
		var bs []throttle.Booking
		redistest.UntilOK(t, func() error {
			var err error
			bs, err = eng.BookAll(ctx, ks, lims, []throttle.Request{{N: 1, MaxWait: time.Second}, {N: 1, MaxWait: time.Second}})
			return err
		})
		x := bs[1]
		require.True(t, x.OK, "set %d", i)
		time.Sleep(x.Wait + 5*ms) // past the slots: only RefundUnused gives back
		g, err := eng.RefundAll(ctx, ks, lims, bs[0])
		require.NoError(t, err)
		for _, d := range g {
			require.Zero(t, d, "set %d: RefundAll after the slot", i)
		}
		g, err = eng.RefundUnused(ctx, ks, lims, x)
		require.NoError(t, err, "set %d", i)
		given := time.Duration(0)
		for _, d := range g {
			given += d
		}
		require.Positive(t, given, "set %d: RefundUnused gives back what stands", i)
		g, err = eng.RefundUnused(ctx, ks, lims, x)
		require.NoError(t, err)
		for _, d := range g {
			require.Zero(t, d, "set %d: a retry gives nothing", i)
		}
	}
}
