package throttle_test

// Adversarial review of d0103bc (a booking is given back one way only: a
// marker shared by the booking and its copies), e6b1ed5/7437ef6 (an
// unreadable reply matches ErrReplyLost) and 61aea71 (Remaining not capped
// at MaxBatch), through the public API. Outcomes are judged against a
// textbook GCRA (textbookModel) replayed over the bookings that still
// stand, on the clock the scripts saw (Booking.At - Booking.Wait).

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/slotbook/slotbook/internal/limitcheck"
	"github.com/slotbook/slotbook/internal/redistest"
	"github.com/slotbook/slotbook/internal/testhook"
	"github.com/slotbook/slotbook/throttle"
)

const ow2ms = time.Millisecond

// ow2Replay replays a textbook GCRA over the standing bookings (in the
// order they were made, each at its decision time with max wait Forever)
// and judges one more request of n units at now: its wait in µs.
func ow2Replay(lims []throttle.Limit, standing []throttle.Booking, now int64, n int) int64 {
	m := &textbookModel{limits: lims, tat: make([]int64, len(lims)), known: make([]bool, len(lims))}
	for _, b := range standing {
		ok, _, _ := m.judge(b.At.UnixMicro()-b.Wait.Microseconds(), b.N, throttle.MaxHorizon.Microseconds())
		if !ok {
			panic("replay: a standing booking does not fit")
		}
	}
	_, wait, _ := m.judge(now, n, throttle.MaxHorizon.Microseconds())
	return wait
}

// ow2Decided is the Redis-clock time at which b was decided.
func ow2Decided(b throttle.Booking) int64 { return b.At.UnixMicro() - b.Wait.Microseconds() }

func ow2Sum(g []time.Duration) time.Duration {
	var s time.Duration
	for _, d := range g {
		s += d
	}
	return s
}

// TestReviewOWConcurrentBothWays: one booking B (behind A, 1 per 200 ms)
// given back from 16 goroutines at once, each with its own copy of B and
// a random way, before B's slot or after it (before its end). Exactly one
// way wins: every call of that way succeeds, every call of the other
// fails with ErrInvalidRequest; B's room comes back once (never twice);
// and the next booking is where a textbook GCRA over what still stands
// puts it. Run with -race.
func TestReviewOWConcurrentBothWays(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	lim := throttle.PerSecond(5, 0) // I = 200 ms
	lims := []throttle.Limit{lim}
	I := 200 * ow2ms
	t0 := base()
	rng := rand.New(rand.NewPCG(7, 7))
	wins := map[bool]int{}
	for round := range 60 {
		key := fmt.Sprintf("cw%d", round)
		keys := []string{key}
		late := round%2 == 1
		req := throttle.Request{N: 1, MaxWait: throttle.Forever}
		a, err := e.eng.Book(at(t0, 0), key, lim, req)
		require.NoError(t, err)
		b, err := e.eng.Book(at(t0, 0), key, lim, req)
		require.NoError(t, err)
		require.Equal(t, I, b.Wait)
		now := I / 2
		if late {
			now = 3 * I / 2 // B's slot has come; its end (t0+2I) has not
		}
		ctx := at(t0, now)
		const g = 16
		ways := make([]bool, g) // true: RefundUnused
		for i := range ways {
			ways[i] = rng.IntN(2) == 0
		}
		ways[0], ways[1] = true, false // both ways every round
		given := make([][]time.Duration, g)
		errs := make([]error, g)
		start := make(chan struct{})
		var wg sync.WaitGroup
		for i := range g {
			x := b // a copy of its own
			wg.Go(func() {
				<-start
				if ways[i] {
					given[i], errs[i] = e.eng.RefundUnused(ctx, keys, lims, x)
				} else {
					given[i], errs[i] = e.eng.RefundAll(ctx, keys, lims, x)
				}
			})
		}
		close(start)
		wg.Wait()
		var winner *bool
		total := time.Duration(0)
		for i := range g {
			if errs[i] == nil {
				if winner == nil {
					w := ways[i]
					winner = &w
				}
				require.Equal(t, *winner, ways[i], "round %d: both ways given back", round)
				total += ow2Sum(given[i])
			}
		}
		require.NotNil(t, winner, "round %d: no way won", round)
		for i := range g {
			if ways[i] != *winner {
				require.ErrorIs(t, errs[i], throttle.ErrInvalidRequest, "round %d: the losing way", round)
			} else {
				require.NoError(t, errs[i], "round %d: the winning way, call %d", round, i)
			}
		}
		wins[*winner]++
		// B's room, at most once: before the slot I (either way); after
		// it, only the unused way gives, the half still standing.
		want := I
		if late {
			want = 0
			if *winner {
				want = I / 2
			}
		}
		require.Equal(t, want, total, "round %d (late %v, unused %v): total given back", round, late, *winner)
		// The losing way, once more: no Redis call.
		before := e.calls.Load()
		if *winner {
			_, err = e.eng.RefundAll(ctx, keys, lims, b)
		} else {
			_, err = e.eng.RefundUnused(ctx, keys, lims, b)
		}
		require.ErrorIs(t, err, throttle.ErrInvalidRequest)
		require.Equal(t, before, e.calls.Load(), "the refused way made a Redis call")
		// What runs next: a textbook GCRA over A, and B if it stands.
		standing := []throttle.Booking{a}
		if total == 0 {
			standing = append(standing, b)
		}
		c, err := e.eng.Book(ctx, key, lim, req)
		require.NoError(t, err)
		require.Equal(t, ow2Replay(lims, standing, t0+now.Microseconds(), 1), c.Wait.Microseconds(),
			"round %d (late %v, unused %v): the next booking's wait", round, late, *winner)
	}
	t.Logf("RefundUnused won %d rounds, RefundAll %d", wins[true], wins[false])
}

// TestReviewOWBatchMarkersIndependent: the bookings of one BookBatch (and
// one BookAll under two limits) share one allocation of markers; each
// must still be its own. Given back latest first, each its own way
// (alternating), every one comes back in full and the key is idle again,
// as a textbook GCRA over nothing standing says; a refusal in the batch
// gives 0 both ways, many times. Then each booking's other way is refused
// and its own way gives 0, without touching its neighbours.
func TestReviewOWBatchMarkersIndependent(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	sets := []struct {
		keys []string
		lims []throttle.Limit
	}{
		{[]string{"bi1"}, []throttle.Limit{throttle.PerSecond(5, 0)}},
		{[]string{"{bi2}:a", "{bi2}:b"}, []throttle.Limit{throttle.PerSecond(5, 0), throttle.Every(time.Second, 3, 1)}},
	}
	for si, s := range sets {
		t0 := base()
		F := throttle.Request{N: 1, MaxWait: throttle.Forever}
		Z := throttle.Request{N: 1, MaxWait: 0} // refused: not immediate
		reqs := []throttle.Request{F, F, Z, F, F, Z}
		bs, err := e.eng.BookAll(at(t0, 0), s.keys, s.lims, reqs)
		require.NoError(t, err)
		require.Equal(t, []bool{true, true, false, true, true, false},
			[]bool{bs[0].OK, bs[1].OK, bs[2].OK, bs[3].OK, bs[4].OK, bs[5].OK}, "set %d", si)
		now := at(t0, 10*ow2ms) // bs[0]'s slot has come
		way := func(i int) bool { return i%2 == 0 }
		refund := func(i int, unused bool) ([]time.Duration, error) {
			if unused {
				return e.eng.RefundUnused(now, s.keys, s.lims, bs[i])
			}
			return e.eng.RefundAll(now, s.keys, s.lims, bs[i])
		}
		for i := len(bs) - 1; i >= 0; i-- {
			if !bs[i].OK {
				for range 3 {
					for _, u := range []bool{true, false} {
						g, err := refund(i, u)
						require.NoError(t, err, "set %d: a refusal given back (unused %v)", si, u)
						require.Zero(t, ow2Sum(g))
					}
				}
				continue
			}
			g, err := refund(i, way(i))
			require.NoError(t, err, "set %d booking %d given back its own way (unused %v): its neighbour's marker?", si, i, way(i))
			if i == 0 && !way(i) {
				require.Zero(t, ow2Sum(g))
			} else {
				require.Positive(t, ow2Sum(g), "set %d booking %d: nothing given back latest first", si, i)
			}
		}
		// The key is idle again: the next booking is immediate, as a
		// textbook GCRA over nothing standing has it.
		c, err := e.eng.BookAll(now, s.keys, s.lims, []throttle.Request{F})
		require.NoError(t, err)
		var standing []throttle.Booking
		if !way(0) {
			standing = append(standing, bs[0])
		}
		require.Equal(t, ow2Replay(s.lims, standing, t0+10_000, 1), c[0].Wait.Microseconds(), "set %d: next booking", si)
		for i := range bs {
			if !bs[i].OK {
				continue
			}
			_, err := refund(i, !way(i))
			require.ErrorIs(t, err, throttle.ErrInvalidRequest, "set %d booking %d the other way", si, i)
			g, err := refund(i, way(i))
			require.NoError(t, err, "set %d booking %d its own way again", si, i)
			require.Zero(t, ow2Sum(g), "set %d booking %d given back twice", si, i)
		}
	}
}

// TestReviewOWMergedMarkers: 24 concurrent Books on keys of their own
// through an engine that lets one booking fly at a time
// (WithMergeAt(1), WithMergeWait(Forever)) with every reply held back
// 100 ms, so that most merge. Each key was booked once before, alone, so
// each merged booking waits an interval. Each is booked where a textbook
// GCRA puts it; given back (half as used, half as unused) each gives its
// whole interval back, the other way is then refused for it alone, and
// the next booking on every key is where the textbook puts it.
func TestReviewOWMergedMarkers(t *testing.T) {
	t.Parallel()
	rig := rmaEngine(t, redistest.Shared(t), 4, 100*ow2ms, throttle.WithMergeAt(1), throttle.WithMergeWait(throttle.Forever))
	direct, err := throttle.New(rig.direct, throttle.WithPrefix(rig.prefix), throttle.WithTimeout(5*time.Second))
	require.NoError(t, err)
	ctx := context.Background()
	lim := rmaLim // I = 10 s
	lims := []throttle.Limit{lim}
	req := throttle.Request{N: 1, MaxWait: throttle.Forever}
	const k = 24
	pre := make([]throttle.Booking, k)
	for i := range k {
		pre[i], err = direct.Book(ctx, fmt.Sprintf("mg%d", i), lim, req)
		require.NoError(t, err)
	}
	before := rig.calls.Load()
	bs := make([]throttle.Booking, k)
	errs := make([]error, k)
	var wg sync.WaitGroup
	for i := range k {
		wg.Go(func() { bs[i], errs[i] = rig.eng.Book(ctx, fmt.Sprintf("mg%d", i), lim, req) })
	}
	wg.Wait()
	calls := rig.calls.Load() - before
	t.Logf("%d bookings in %d calls", k, calls)
	require.Less(t, calls, int64(k), "nothing merged")
	for i := range k {
		require.NoError(t, errs[i])
		require.True(t, bs[i].OK)
		require.Equal(t, ow2Replay(lims, pre[i:i+1], ow2Decided(bs[i]), 1), bs[i].Wait.Microseconds(), "key %d booked", i)
	}
	I := lim.Interval()
	for i := range k {
		keys := []string{fmt.Sprintf("mg%d", i)}
		var g []time.Duration
		if i%2 == 0 {
			g, err = direct.RefundUnused(ctx, keys, lims, bs[i])
		} else {
			g, err = rig.eng.RefundAll(ctx, keys, lims, bs[i])
		}
		require.NoError(t, err, "key %d", i)
		require.Equal(t, I, g[0], "key %d: the whole interval back", i)
	}
	for i := range k {
		keys := []string{fmt.Sprintf("mg%d", i)}
		if i%2 == 0 {
			_, err = rig.eng.RefundAll(ctx, keys, lims, bs[i])
		} else {
			_, err = direct.RefundUnused(ctx, keys, lims, bs[i])
		}
		require.ErrorIs(t, err, throttle.ErrInvalidRequest, "key %d the other way", i)
	}
	for i := range k {
		c, err := direct.Book(ctx, fmt.Sprintf("mg%d", i), lim, req)
		require.NoError(t, err)
		require.Equal(t, ow2Replay(lims, pre[i:i+1], ow2Decided(c), 1), c.Wait.Microseconds(), "key %d: the next booking", i)
	}
}

// TestReviewOWLostReplyRetry: a refund whose reply is lost (held back past
// the caller's deadline: the script ran) is retried the same way: no
// error, nothing more given back; the other way is refused. Then the next
// booking C takes B's slot and, once C's slot has come (B's tombstone gone
// if it lived only until B's slot), B's other way still gives nothing
// back: the booking after C is an interval after it, as the textbook
// says. On the Redis clock, through a proxy.
func TestReviewOWLostReplyRetry(t *testing.T) {
	t.Parallel()
	srv := redistest.Shared(t)
	for _, firstUnused := range []bool{false, true} {
		t.Run(fmt.Sprintf("firstUnused=%v", firstUnused), func(t *testing.T) {
			t.Parallel()
			p := redistest.NewProxy(t, srv.Addr)
			rdb := p.Client(t, srv)
			eng, err := throttle.New(rdb, throttle.WithPrefix(redistest.Prefix(t)), throttle.WithTimeout(5*time.Second))
			require.NoError(t, err)
			bg := context.Background()
			require.NoError(t, eng.Load(bg))
			lim := throttle.Every(1500*ow2ms, 1, 0)
			lims := []throttle.Limit{lim}
			req := throttle.Request{N: 1, MaxWait: throttle.Forever}
			refund := func(ctx context.Context, key string, b throttle.Booking, unused bool) ([]time.Duration, error) {
				if unused {
					return eng.RefundUnused(ctx, []string{key}, lims, b)
				}
				return eng.RefundAll(ctx, []string{key}, lims, b)
			}
			for round := 0; ; round++ {
				require.Less(t, round, 5, "C never took B's slot")
				key := fmt.Sprintf("lr%d", round)
				a, err := eng.Book(bg, key, lim, req)
				require.NoError(t, err)
				b, err := eng.Book(bg, key, lim, req)
				require.NoError(t, err)
				p.SetReplyDelay(300 * ow2ms)
				ctx, cancel := context.WithTimeout(bg, 100*ow2ms)
				_, err = refund(ctx, key, b, firstUnused)
				cancel()
				p.SetReplyDelay(0)
				require.ErrorIs(t, err, throttle.ErrReplyLost)
				g, err := refund(bg, key, b, firstUnused)
				require.NoError(t, err, "retried the same way")
				require.Zero(t, g[0], "given back twice")
				_, err = refund(bg, key, b, !firstUnused)
				require.ErrorIs(t, err, throttle.ErrInvalidRequest)
				c, err := eng.Book(bg, key, lim, req)
				require.NoError(t, err)
				require.Equal(t, ow2Replay(lims, []throttle.Booking{a}, ow2Decided(c), 1), c.Wait.Microseconds(), "C")
				if !c.At.Equal(b.At) {
					t.Logf("round %d: B's slot came before C (busy machine): again", round)
					continue
				}
				time.Sleep(time.Until(c.At) + 100*ow2ms)
				for _, u := range []bool{true, false} {
					g, err := refund(bg, key, b, u)
					if u == firstUnused {
						require.NoError(t, err)
						require.Zero(t, g[0], "B given back again after C's slot")
					} else {
						require.ErrorIs(t, err, throttle.ErrInvalidRequest)
					}
				}
				d, err := eng.Book(bg, key, lim, req)
				require.NoError(t, err)
				require.Equal(t, ow2Replay(lims, []throttle.Booking{a, c}, ow2Decided(d), 1), d.Wait.Microseconds(),
					"D after C: %v", d.At.Sub(c.At))
				return
			}
		})
	}
}

// TestReviewOWBookRetryMarkers: BookRetry's bookings each carry a marker
// of their own (one way only, per booking, copies included); a recalled
// booking (nothing booked) is refused by both ways before any call.
func TestReviewOWBookRetryMarkers(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	t0 := base()
	ctx := at(t0, 0)
	lim := throttle.PerSecond(10, 0) // I = 100 ms
	lims := []throttle.Limit{lim}
	keys := []string{"r:{ow}"}
	idx := func(member string) throttle.RetryIndex {
		return throttle.RetryIndex{Key: "r:{ow}:asynq", Member: member, KeepFrom: 150 * ow2ms, Window: time.Second, MaxDue: 10}
	}
	var bs []throttle.Booking
	for _, m := range []string{"a", "b", "c", "d"} {
		rb, err := e.eng.BookRetry(ctx, keys, lims, throttle.Request{N: 1, MaxWait: time.Minute}, idx(m))
		require.NoError(t, err)
		require.True(t, rb.OK)
		bs = append(bs, rb.Booking)
	}
	// d (recorded) is recalled: nothing to give back.
	rb, err := e.eng.BookRetry(ctx, keys, lims, throttle.Request{N: 1, MaxWait: time.Minute}, idx("d"))
	require.NoError(t, err)
	require.True(t, rb.Recalled)
	before := e.calls.Load()
	for _, u := range []bool{true, false} {
		var err error
		if u {
			_, err = e.eng.RefundUnused(ctx, keys, lims, rb.Booking)
		} else {
			_, err = e.eng.RefundAll(ctx, keys, lims, rb.Booking)
		}
		require.ErrorIs(t, err, throttle.ErrInvalidRequest, "a recalled booking given back")
	}
	require.Equal(t, before, e.calls.Load())
	// Latest first, alternating ways, through copies.
	now := at(t0, 10*ow2ms)
	for i := len(bs) - 1; i >= 0; i-- {
		x := bs[i]
		var g []time.Duration
		if i%2 == 0 {
			g, err = e.eng.RefundUnused(now, keys, lims, x)
		} else {
			g, err = e.eng.RefundAll(now, keys, lims, x)
		}
		require.NoError(t, err, "booking %d", i)
		require.Positive(t, g[0], "booking %d", i)
	}
	for i := range bs {
		var err error
		if i%2 == 0 {
			_, err = e.eng.RefundAll(now, keys, lims, bs[i])
		} else {
			_, err = e.eng.RefundUnused(now, keys, lims, bs[i])
		}
		require.ErrorIs(t, err, throttle.ErrInvalidRequest, "booking %d the other way", i)
	}
	// All four given back (a's room still in front): the key is idle.
	c, err := e.eng.Book(now, keys[0], lim, throttle.Request{N: 1, MaxWait: throttle.Forever})
	require.NoError(t, err)
	require.Equal(t, ow2Replay(lims, nil, t0+10_000, 1), c.Wait.Microseconds())
}

// TestReviewOWRefusedAndZero: a zero Booking and a refusal are given back
// both ways, any number of times, from many goroutines: 0 each, no error,
// no Redis call (no marker to take).
func TestReviewOWRefusedAndZero(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	ctx := context.Background()
	lim := throttle.PerMinute(1, 0)
	_, err := e.eng.Book(ctx, "rz", lim, throttle.Request{N: 1, MaxWait: 0})
	require.NoError(t, err)
	refused, err := e.eng.Book(ctx, "rz", lim, throttle.Request{N: 1, MaxWait: 0})
	require.NoError(t, err)
	require.False(t, refused.OK)
	before := e.calls.Load()
	var wg sync.WaitGroup
	errs := make(chan error, 64)
	for i := range 32 {
		wg.Go(func() {
			for _, b := range []throttle.Booking{{}, refused} {
				var g []time.Duration
				var err error
				if i%2 == 0 {
					g, err = e.eng.RefundUnused(ctx, []string{"rz"}, []throttle.Limit{lim}, b)
				} else {
					g, err = e.eng.RefundAll(ctx, []string{"rz"}, []throttle.Limit{lim}, b)
				}
				if err == nil && g[0] != 0 {
					err = fmt.Errorf("gave %v", g[0])
				}
				if err != nil {
					errs <- err
				}
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		require.NoError(t, err)
	}
	require.Equal(t, before, e.calls.Load())
}

// TestReviewOWRemainingTextbook: Remaining after AllowAll, against a
// textbook GCRA: the number of further single units that would conform
// now (cell j conforms at now if TAT + j*I - tau <= now), the fewest over
// the limits, on bursts above MaxBatch, random sizes and times, one and
// two limits, allowed and denied.
func TestReviewOWRemainingTextbook(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	sets := []struct {
		keys []string
		lims []throttle.Limit
		step int // most µs between two calls
	}{
		{[]string{"rem1"}, []throttle.Limit{throttle.PerSecond(3000, 2500)}, 3000},
		{[]string{"{rem2}:a", "{rem2}:b"}, []throttle.Limit{throttle.PerSecond(5000, 4000), throttle.Every(10*time.Second, 6000, 1500)}, 20000},
		{[]string{"{rem3}:a", "{rem3}:b"}, []throttle.Limit{throttle.PerSecond(7, 1), throttle.PerSecond(2000, 1999)}, 300000},
	}
	rng := rand.New(rand.NewPCG(3, 9))
	for si, s := range sets {
		m := &textbookModel{limits: s.lims, tat: make([]int64, len(s.lims)), known: make([]bool, len(s.lims))}
		t0 := base()
		now := int64(0)
		maxN := s.lims[0].Burst + 1
		for _, l := range s.lims {
			maxN = min(maxN, l.Burst+1)
		}
		allowed, denied := 0, 0
		for step := range 300 {
			now += int64(rng.IntN(s.step))
			n := 1 + rng.IntN(maxN)
			if rng.IntN(3) > 0 {
				n = 1 + rng.IntN(min(maxN, 40))
			}
			ctx := testhook.WithNow(context.Background(), t0+now)
			r, err := e.eng.AllowAll(ctx, s.keys, s.lims, n)
			require.NoError(t, err)
			ok, _, _ := m.judge(t0+now, n, 0)
			require.Equal(t, ok, r.Allowed, "set %d step %d: allowed", si, step)
			if ok {
				allowed++
			} else {
				denied++
			}
			want := int64(1 << 62)
			for i, l := range s.lims {
				I := limitcheck.Interval(l)
				tau := I * int64(l.Burst)
				tat := t0 + now
				if m.known[i] && m.tat[i] > tat {
					tat = m.tat[i]
				}
				count := int64(0)
				// Cells j = 0.. conforming now; at most Burst+1.
				for j := int64(0); j <= int64(l.Burst) && tat+j*I-tau <= t0+now; j++ {
					count++
				}
				want = min(want, count)
			}
			require.Equal(t, int(want), r.Remaining, "set %d step %d (n %d, allowed %v): remaining", si, step, n, ok)
		}
		t.Logf("set %d: %d allowed, %d denied", si, allowed, denied)
	}
}

// TestReviewOWGarbledRefundIsReplyLost: a refund whose reply comes back
// garbled ran all the same; the caller hears ErrReplyLost, the retry the
// same way gives nothing more, the other way is refused, and the next
// booking is where the textbook puts it (B given back once).
func TestReviewOWGarbledRefundIsReplyLost(t *testing.T) {
	t.Parallel()
	g := garble()
	eng := hookedEnv(t, g).eng
	t0 := base()
	lim := throttle.PerSecond(5, 0)
	lims := []throttle.Limit{lim}
	for _, unused := range []bool{false, true} {
		key := fmt.Sprintf("gr%v", unused)
		req := throttle.Request{N: 1, MaxWait: throttle.Forever}
		a, err := eng.Book(at(t0, 0), key, lim, req)
		require.NoError(t, err)
		b, err := eng.Book(at(t0, 0), key, lim, req)
		require.NoError(t, err)
		refund := func(u bool) ([]time.Duration, error) {
			if u {
				return eng.RefundUnused(at(t0, 50*ow2ms), []string{key}, lims, b)
			}
			return eng.RefundAll(at(t0, 50*ow2ms), []string{key}, lims, b)
		}
		g.on.Store(true)
		_, err = refund(unused)
		g.on.Store(false)
		require.ErrorIs(t, err, throttle.ErrReplyLost)
		require.False(t, errors.Is(err, throttle.ErrInvalidRequest))
		given, err := refund(unused)
		require.NoError(t, err)
		require.Zero(t, given[0])
		_, err = refund(!unused)
		require.ErrorIs(t, err, throttle.ErrInvalidRequest)
		c, err := eng.Book(at(t0, 50*ow2ms), key, lim, req)
		require.NoError(t, err)
		require.Equal(t, ow2Replay(lims, []throttle.Booking{a}, t0+50_000, 1), c.Wait.Microseconds())
	}
}

// TestReviewOWMergedReplyMustAgree: 7437ef6 made BookRetry check its reply
// "as BookAll does" (a reply that disagrees with the TATs it gives was not
// made by the engine's script, which ran: ErrReplyLost). A single booking
// that merges is a BookAll call too (e6b1ed5 lists merged bookings among
// those whose unreadable replies are lost), but its well-formed reply is
// taken as it comes. Two bookings merge behind a lone one (WithMergeAt(1),
// replies held back 200 ms); a hook skews the merged reply's first answer
// ({now, tat_1, w_1, tat_2, w_2}) the ways TestBookRetryReplyMustAgree
// does. Each must hear ErrReplyLost, as an unmerged BookAll would (its
// judge checks the same), not a booking made of the reply's numbers: a
// wait 1 ms off gives a booking whose ends the key never held (its Refund
// gives nothing back), "refused within" reports refused what Redis booked
// (its room lost, silently), "booked beyond" books past the max wait.
func TestReviewOWMergedReplyMustAgree(t *testing.T) {
	t.Parallel()
	for name, tc := range map[string]struct {
		maxWait time.Duration
		f       func(a []any)
	}{
		"wait off by 1ms": {throttle.Forever, func(a []any) { a[2] = a[2].(int64) + 1000 }},
		"refused within":  {throttle.Forever, func(a []any) { a[2] = -1 - a[2].(int64) }},
		"booked beyond":   {0, func(a []any) { a[2] = int64(time.Hour / time.Microsecond) }},
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			r := rmaEngine(t, redistest.Shared(t), 4, 200*ow2ms, throttle.WithMergeAt(1), throttle.WithMergeWait(throttle.Forever))
			s := skew(func(a []any) {
				if len(a) == 5 { // a merged reply of two bookings
					tc.f(a)
				}
			})
			s.on.Store(true)
			r.rdb.AddHook(s)
			for round := 0; ; round++ {
				require.Less(t, round, 5, "no round merged two bookings")
				before := r.calls.Load()
				var wg sync.WaitGroup
				bs := make([]throttle.Booking, 3)
				errs := make([]error, 3)
				for i := range 3 {
					wg.Go(func() {
						bs[i], errs[i] = r.eng.Book(context.Background(), fmt.Sprintf("ag%d-%d", round, i), rmaLim,
							throttle.Request{N: 1, MaxWait: tc.maxWait})
					})
					if i == 0 {
						time.Sleep(60 * ow2ms) // the first flies alone; the others merge
					}
				}
				waitAll(t, &wg, 10*time.Second, "skewed replies")
				if r.calls.Load()-before != 2 {
					t.Logf("round %d: %d calls, not merged: again", round, r.calls.Load()-before)
					continue
				}
				// Which of the two merged bookings came first in the call
				// is not known: one of them got the skewed answer.
				skewed := -1
				for i := 1; i < 3; i++ {
					b := bs[i]
					if errs[i] != nil {
						require.ErrorIs(t, errs[i], throttle.ErrReplyLost, "booking %d", i)
						skewed = i
						continue
					}
					// A booking that stands: a fresh key, so immediate.
					if !b.OK || b.Wait != 0 {
						skewed = i
						if b.OK { // what its refund gives back, a slot 10 s ahead
							g, err := r.eng.RefundUnused(context.Background(), []string{fmt.Sprintf("ag%d-%d", round, i)},
								[]throttle.Limit{rmaLim}, b)
							t.Logf("booking %d given back as unused: %v, %v (a true booking gives back about %v)", i, g, err, rmaLim.Interval())
						}
						require.Failf(t, "a skewed merged reply taken as a booking",
							"booking %d: OK %v, wait %v, max wait %v (fresh key: Redis booked it at once)", i, b.OK, b.Wait, tc.maxWait)
					}
				}
				require.NotEqual(t, -1, skewed, "no booking saw the skew")
				return
			}
		})
	}
}
