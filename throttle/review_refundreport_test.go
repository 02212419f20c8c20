package throttle_test

// Adversarial review of the refund report (528bf37: refund.lua's tombstone
// "1 g_1 .. g_m", the engine's wayReported bit), WithObserver's typed-nil
// check (d15a0d5) and throttle.NoWait (ddf56d0), through the public API.
//
// Findings when handed over, see each test's comment:
//   - TestReviewRRLateRetryAfterSlot       a lost refund retried after the
//     booking's slot is never reported (refund.lua reads the tombstone only
//     while slot > now), by the engine nor by reserve's Cancel + Collector:
//     now documented (Observer.ObserveRefund, the metrics' help, the
//     README), and the test pins that behaviour.
//   - TestReviewRRGarbageTombstone         a tombstone PROTOCOL.md says cannot
//     be parsed ("1 abc 7000000", "1 -7000000") was read as recording 7 s; a
//     parseable but absurd one was reported beyond what the booking could
//     give. Fixed: refund.lua reads only "1" and m counts of digits, and the
//     engine caps each at what the booking held on its key.

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/slotbook/slotbook/internal/redistest"
	"github.com/slotbook/slotbook/metrics"
	"github.com/slotbook/slotbook/reserve"
	"github.com/slotbook/slotbook/throttle"
)

// rrObs counts what the engine tells an Observer.
type rrObs struct {
	mu        sync.Mutex
	refunds   []time.Duration
	decisions []rrDecision
}

type rrDecision struct {
	o    throttle.Outcome
	wait time.Duration
}

func (r *rrObs) ObserveDecision(_ string, o throttle.Outcome, wait time.Duration) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.decisions = append(r.decisions, rrDecision{o, wait})
}
func (r *rrObs) ObserveCall(string, time.Duration, error) {}
func (r *rrObs) ObserveBreaker(bool)                      {}
func (r *rrObs) ObserveRefund(_ string, given time.Duration) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.refunds = append(r.refunds, given)
}

// refundsOf takes the refunds reported under key's label (subtests run
// one after another, so this is what the last call reported).
func (r *rrObs) refundsOf(string) []time.Duration { return r.takeRefunds() }

func (r *rrObs) takeRefunds() []time.Duration {
	r.mu.Lock()
	defer r.mu.Unlock()
	out := r.refunds
	r.refunds = nil
	return out
}

func (r *rrObs) takeDecisions() []rrDecision {
	r.mu.Lock()
	defer r.mu.Unlock()
	out := r.decisions
	r.decisions = nil
	return out
}

// rrHook garbles script replies while n > 0 (each garbled reply takes one
// from n; n < 0: garble all while on): Redis ran the script, its reply is
// lost (ErrReplyLost).
type rrHook struct {
	n atomic.Int64
}

func (h *rrHook) DialHook(next redis.DialHook) redis.DialHook { return next }
func (h *rrHook) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}
func (h *rrHook) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		err := next(ctx, cmd)
		if n := cmd.Name(); err == nil && (n == "evalsha" || n == "eval") {
			for {
				c := h.n.Load()
				if c == 0 {
					break
				}
				if c < 0 || h.n.CompareAndSwap(c, c-1) {
					cmd.(interface{ SetVal(any) }).SetVal("garbled")
					break
				}
			}
		}
		return err
	}
}

type rrEnv struct {
	eng    *throttle.Engine
	rdb    *redis.Client
	obs    *rrObs
	hook   *rrHook
	prefix string
}

func rrNew(t *testing.T) rrEnv {
	t.Helper()
	rdb := redistest.Shared(t).Client(t)
	obs, hook := &rrObs{}, &rrHook{}
	prefix := redistest.Prefix(t)
	eng, err := throttle.New(rdb, throttle.WithPrefix(prefix), throttle.WithObserver(obs), throttle.WithTimeout(5*time.Second))
	require.NoError(t, err)
	require.NoError(t, eng.Load(context.Background()))
	rdb.AddHook(hook)
	return rrEnv{eng: eng, rdb: rdb, obs: obs, hook: hook, prefix: prefix}
}

// tomb returns the one tombstone key stored for subject tag (keys named
// "...{tag}..."), failing if there is not exactly one.
func (e rrEnv) tomb(t *testing.T, tag string) string {
	t.Helper()
	var found []string
	iter := e.rdb.Scan(context.Background(), 0, e.prefix+"*{"+tag+"}*:x:*", 100).Iterator()
	for iter.Next(context.Background()) {
		found = append(found, iter.Val())
	}
	require.NoError(t, iter.Err())
	require.Len(t, found, 1, "tombstones of %s: %v", tag, found)
	return found[0]
}

func rrMicros(t time.Time) int64 { return t.UnixMicro() }

// rrReplay is the textbook GCRA (docs/PROTOCOL.md "The algorithm") over the
// bookings that stand, in order, on one limit: each decided at At - Wait
// on the Redis clock. It returns the TAT after them.
func rrReplay(l throttle.Limit, standing []throttle.Booking) int64 {
	I, tau := l.Interval().Microseconds(), l.Interval().Microseconds()*int64(l.Burst)
	var tat int64
	for _, b := range standing {
		now := rrMicros(b.At) - b.Wait.Microseconds()
		tat = max(tat, now)
		slot := max(now, tat+int64(b.N-1)*I-tau)
		tat = max(tat, slot) + int64(b.N)*I
	}
	return tat
}

// rrReplayAll is rrReplay for bookings made under several limits at once
// (BookAll): the slot is the latest any limit allows; each key's TAT after.
func rrReplayAll(ls []throttle.Limit, standing []throttle.Booking) []int64 {
	tat := make([]int64, len(ls))
	for _, b := range standing {
		now := rrMicros(b.At) - b.Wait.Microseconds()
		slot := now
		for i, l := range ls {
			I, tau := l.Interval().Microseconds(), l.Interval().Microseconds()*int64(l.Burst)
			tat[i] = max(tat[i], now)
			slot = max(slot, tat[i]+int64(b.N-1)*I-tau)
		}
		for i, l := range ls {
			tat[i] = max(tat[i], slot) + int64(b.N)*l.Interval().Microseconds()
		}
	}
	return tat
}

// rrExpectSlot is the slot the textbook gives a request of n decided at
// now after TAT tat.
func rrExpectSlot(l throttle.Limit, tat, now int64, n int) int64 {
	I, tau := l.Interval().Microseconds(), l.Interval().Microseconds()*int64(l.Burst)
	tat = max(tat, now)
	return max(now, tat+int64(n-1)*I-tau)
}

var rrForever = throttle.Request{N: 1, MaxWait: throttle.Forever}

// TestReviewRRRepeated: a refund repeated reports once; the caller hears
// the time once; the next booking's slot is the textbook's over the
// bookings that stand.
func TestReviewRRRepeated(t *testing.T) {
	t.Parallel()
	e, ctx := rrNew(t), context.Background()
	per := throttle.PerMinute(1, 0)
	var bs []throttle.Booking
	for range 4 {
		b, err := e.eng.Book(ctx, "rep:{a}", per, rrForever)
		require.NoError(t, err)
		require.True(t, b.OK)
		bs = append(bs, b)
	}
	// Latest first: both come back in full.
	for i := 3; i >= 2; i-- {
		g, err := e.eng.Refund(ctx, "rep:{a}", per, bs[i])
		require.NoError(t, err)
		require.Equal(t, time.Minute, g)
		require.Equal(t, []time.Duration{time.Minute}, e.obs.takeRefunds())
		for range 3 {
			g, err = e.eng.Refund(ctx, "rep:{a}", per, bs[i])
			require.NoError(t, err)
			require.Zero(t, g)
			require.Equal(t, []time.Duration{0}, e.obs.takeRefunds(), "a repeat reports nothing given")
		}
	}
	// The first booking: the second stands on it, nothing given back.
	g, err := e.eng.Refund(ctx, "rep:{a}", per, bs[0])
	require.NoError(t, err)
	require.Zero(t, g)
	require.Equal(t, []time.Duration{0}, e.obs.takeRefunds())
	next, err := e.eng.Book(ctx, "rep:{a}", per, rrForever)
	require.NoError(t, err)
	now := rrMicros(next.At) - next.Wait.Microseconds()
	want := rrExpectSlot(per, rrReplay(per, bs[:2]), now, 1)
	require.Equal(t, want, rrMicros(next.At), "next slot vs textbook replay of the bookings that stand")
}

// TestReviewRRLostReplyProxy: a refund whose reply comes after the engine's
// timeout (the proxy holds it back), and one whose connection is severed,
// are reported once by their retry, with what they gave.
func TestReviewRRLostReplyProxy(t *testing.T) {
	t.Parallel()
	srv := redistest.Shared(t)
	p := redistest.NewProxy(t, srv.Addr)
	rdb := p.Client(t, srv)
	obs := &rrObs{}
	prefix := redistest.Prefix(t)
	eng, err := throttle.New(rdb, throttle.WithPrefix(prefix), throttle.WithObserver(obs), throttle.WithTimeout(300*time.Millisecond))
	require.NoError(t, err)
	direct := srv.Client(t)
	ctx := context.Background()
	redistest.UntilOK(t, func() error { return eng.Load(ctx) })
	per := throttle.PerMinute(1, 0)

	for _, how := range []string{"delay", "sever"} {
		key := "px:{" + how + "}"
		var b throttle.Booking
		var first throttle.Booking
		redistest.UntilOK(t, func() error {
			var err error
			first, err = eng.Book(ctx, key, per, rrForever)
			return err
		})
		redistest.UntilOK(t, func() error {
			var err error
			b, err = eng.Book(ctx, key, per, rrForever)
			return err
		})
		obs.takeRefunds()
		switch how {
		case "delay":
			p.SetReplyDelay(2 * time.Second)
			_, err = eng.Refund(ctx, key, per, b)
			p.SetReplyDelay(0)
		case "sever":
			before := direct.Get(ctx, prefix+key).Val()
			p.SetReplyDelay(2 * time.Second)
			done := make(chan error, 1)
			go func() { _, err := eng.Refund(ctx, key, per, b); done <- err }()
			// Severed once the refund has run in Redis (the key's TAT
			// moved back), its reply held: not 100 ms after the call
			// began, which a stall of 110 ms of its goroutine outran
			// (severed before it was sent: not a lost reply).
			require.Eventually(t, func() bool { return direct.Get(ctx, prefix+key).Val() != before },
				5*time.Second, time.Millisecond, "the test's premise: the refund ran in Redis")
			p.Sever()
			err = <-done
			p.SetReplyDelay(0)
		}
		require.ErrorIs(t, err, throttle.ErrReplyLost, how)
		require.Empty(t, obs.takeRefunds(), "%s: a lost reply reports no refund", how)
		var g time.Duration
		redistest.UntilOK(t, func() error {
			var err error
			g, err = eng.Refund(ctx, key, per, b)
			return err
		})
		require.Zero(t, g, how)
		got := obs.takeRefunds()
		nonzero := 0
		for _, d := range got {
			if d != 0 {
				nonzero++
				require.Equal(t, time.Minute, d, how)
			}
		}
		require.Equal(t, 1, nonzero, "%s: reported %v", how, got)
		// Given back: the next booking takes b's slot.
		var c throttle.Booking
		redistest.UntilOK(t, func() error {
			var err error
			c, err = eng.Book(ctx, key, per, rrForever)
			return err
		})
		require.Equal(t, b.At, c.At, "%s: the lost refund gave b's slot back", how)
		_ = first
	}
}

// TestReviewRRConcurrentCopies: 16 copies of one Booking refunded at once:
// the time is given once and reported once; also when one reply (whichever)
// is lost, and when the first attempt's reply was lost and 16 retries race.
func TestReviewRRConcurrentCopies(t *testing.T) {
	t.Parallel()
	e, ctx := rrNew(t), context.Background()
	per := throttle.PerMinute(1, 0)
	for round, lose := range []string{"none", "one of the 16", "first attempt"} {
		key := fmt.Sprintf("cc:{r%d}", round)
		_, err := e.eng.Book(ctx, key, per, rrForever)
		require.NoError(t, err)
		b, err := e.eng.Book(ctx, key, per, rrForever)
		require.NoError(t, err)
		e.obs.takeRefunds()
		if lose == "first attempt" {
			e.hook.n.Store(1)
			_, err := e.eng.Refund(ctx, key, per, b)
			require.ErrorIs(t, err, throttle.ErrReplyLost)
		}
		if lose == "one of the 16" {
			e.hook.n.Store(1)
		}
		var wg sync.WaitGroup
		var given atomic.Int64
		var lost atomic.Int32
		for range 16 {
			c := b // a copy
			wg.Go(func() {
				g, err := e.eng.Refund(ctx, key, per, c)
				if errors.Is(err, throttle.ErrReplyLost) {
					lost.Add(1)
					return
				}
				if err != nil {
					t.Error(err)
				}
				given.Add(int64(g))
			})
		}
		wg.Wait()
		e.hook.n.Store(0)
		got := e.obs.takeRefunds()
		var sum time.Duration
		nonzero := 0
		for _, d := range got {
			sum += d
			if d != 0 {
				nonzero++
			}
		}
		require.Equal(t, 1, nonzero, "%s: reported %v", lose, got)
		require.Equal(t, time.Minute, sum, "%s", lose)
		if lose == "none" {
			require.Equal(t, int64(time.Minute), given.Load())
			require.Len(t, got, 16)
		}
		if lose == "one of the 16" {
			require.Equal(t, int32(1), lost.Load())
			require.Len(t, got, 15)
		}
		// Further retries: nothing more reported.
		g, err := e.eng.Refund(ctx, key, per, b)
		require.NoError(t, err)
		require.Zero(t, g)
		require.Equal(t, []time.Duration{0}, e.obs.takeRefunds())
	}
}

// TestReviewRRRunRetry: RefundUnusedRun, then a retry with the same run
// (and a copy of the run's slice), reported once; after the run, the run's
// first booking refunded on its own (any way) is ErrInvalidRequest and
// reports nothing; the reverse too.
func TestReviewRRRunRetry(t *testing.T) {
	t.Parallel()
	e, ctx := rrNew(t), context.Background()
	per := throttle.PerMinute(1, 0)
	keys, limits := []string{"run:{a}"}, []throttle.Limit{per}
	_, err := e.eng.Book(ctx, "run:{a}", per, rrForever)
	require.NoError(t, err)
	run, err := e.eng.BookBatch(ctx, "run:{a}", per, []throttle.Request{rrForever, rrForever, rrForever})
	require.NoError(t, err)
	e.obs.takeRefunds()
	gs, err := e.eng.RefundUnusedRun(ctx, keys, limits, run)
	require.NoError(t, err)
	require.Equal(t, []time.Duration{3 * time.Minute}, gs)
	require.Equal(t, []time.Duration{3 * time.Minute}, e.obs.takeRefunds())
	gs, err = e.eng.RefundUnusedRun(ctx, keys, limits, append([]throttle.Booking(nil), run...))
	require.NoError(t, err)
	require.Equal(t, []time.Duration{0}, gs)
	require.Equal(t, []time.Duration{0}, e.obs.takeRefunds())
	_, err = e.eng.RefundUnused(ctx, keys, limits, run[0])
	require.ErrorIs(t, err, throttle.ErrInvalidRequest)
	_, err = e.eng.RefundAll(ctx, keys, limits, run[0])
	require.ErrorIs(t, err, throttle.ErrInvalidRequest)
	_, err = e.eng.RefundUnusedRun(ctx, keys, limits, run[:1])
	require.ErrorIs(t, err, throttle.ErrInvalidRequest)
	_, err = e.eng.RefundUnusedRun(ctx, keys, limits, run[:2])
	require.ErrorIs(t, err, throttle.ErrInvalidRequest)
	require.Empty(t, e.obs.takeRefunds())
	next, err := e.eng.Book(ctx, "run:{a}", per, rrForever)
	require.NoError(t, err)
	require.Equal(t, run[0].At, next.At, "the run's room came back")

	// The reverse: run[0] given back alone (lost reply), then the run.
	_, err = e.eng.Book(ctx, "run:{b}", per, rrForever)
	require.NoError(t, err)
	run, err = e.eng.BookBatch(ctx, "run:{b}", per, []throttle.Request{rrForever, rrForever})
	require.NoError(t, err)
	e.obs.takeRefunds()
	kb := []string{"run:{b}"}
	e.hook.n.Store(1)
	_, err = e.eng.RefundUnused(ctx, kb, limits, run[0])
	require.ErrorIs(t, err, throttle.ErrReplyLost)
	_, err = e.eng.RefundUnusedRun(ctx, kb, limits, run)
	require.ErrorIs(t, err, throttle.ErrInvalidRequest)
	require.Empty(t, e.obs.takeRefunds())
	// run[0] had run[1] on it: nothing was given; its retry reports 0.
	gs, err = e.eng.RefundUnused(ctx, kb, limits, run[0])
	require.NoError(t, err)
	require.Equal(t, []time.Duration{0}, gs)
	require.Equal(t, []time.Duration{0}, e.obs.takeRefunds())
	// run[1] alone is still free to go back (the failed run unmarked it).
	gs, err = e.eng.RefundUnused(ctx, kb, limits, run[1])
	require.NoError(t, err)
	require.Equal(t, []time.Duration{time.Minute}, gs)
	require.Equal(t, []time.Duration{time.Minute}, e.obs.takeRefunds())

	// A run whose reply is lost, then its first booking alone, then the
	// run's retry: reported once, by the retry.
	_, err = e.eng.Book(ctx, "run:{c}", per, rrForever)
	require.NoError(t, err)
	run, err = e.eng.BookBatch(ctx, "run:{c}", per, []throttle.Request{rrForever, rrForever})
	require.NoError(t, err)
	kc := []string{"run:{c}"}
	e.obs.takeRefunds()
	e.hook.n.Store(1)
	_, err = e.eng.RefundUnusedRun(ctx, kc, limits, run)
	require.ErrorIs(t, err, throttle.ErrReplyLost)
	_, err = e.eng.RefundUnused(ctx, kc, limits, run[0])
	require.ErrorIs(t, err, throttle.ErrInvalidRequest)
	gs, err = e.eng.RefundUnusedRun(ctx, kc, limits, run)
	require.NoError(t, err)
	require.Equal(t, []time.Duration{0}, gs)
	require.Equal(t, []time.Duration{2 * time.Minute}, e.obs.takeRefunds())
}

// TestReviewRRLayered: several limits: the tombstone records each key's
// amount; a retry after a lost reply reports the most any key got, once;
// the next booking's slot is the textbook's on each key.
func TestReviewRRLayered(t *testing.T) {
	t.Parallel()
	e, ctx := rrNew(t), context.Background()
	fast, slow := throttle.PerSecond(10, 0), throttle.PerMinute(2, 0)
	keys, limits := []string{"lay:{s}", "lay:{s}:m"}, []throttle.Limit{fast, slow}
	var bs []throttle.Booking
	for range 3 {
		b, err := e.eng.BookAll(ctx, keys, limits, []throttle.Request{rrForever})
		require.NoError(t, err)
		require.True(t, b[0].OK)
		bs = append(bs, b[0])
	}
	e.obs.takeRefunds()
	e.hook.n.Store(1)
	_, err := e.eng.RefundAll(ctx, keys, limits, bs[2])
	require.ErrorIs(t, err, throttle.ErrReplyLost)
	v, err := e.rdb.Get(ctx, e.tomb(t, "s")).Result()
	require.NoError(t, err)
	f := strings.Fields(v)
	require.Len(t, f, 3, "tombstone %q", v)
	require.Equal(t, "1", f[0])
	// Each key gave back what the booking added to it (textbook replay
	// with and without it; the refund came long before key 1's earlier TAT).
	with, without := rrReplayAll(limits, bs[:3]), rrReplayAll(limits, bs[:2])
	for i := range limits {
		require.Equal(t, fmt.Sprint(with[i]-without[i]), f[1+i], "key %d in tombstone %q", i, v)
	}
	gs, err := e.eng.RefundAll(ctx, keys, limits, bs[2])
	require.NoError(t, err)
	require.Equal(t, []time.Duration{0, 0}, gs)
	require.Equal(t, []time.Duration{slow.Interval()}, e.obs.takeRefunds())
	next, err := e.eng.BookAll(ctx, keys, limits, []throttle.Request{rrForever})
	require.NoError(t, err)
	now := rrMicros(next[0].At) - next[0].Wait.Microseconds()
	want := max(rrExpectSlot(fast, without[0], now, 1), rrExpectSlot(slow, without[1], now, 1))
	require.Equal(t, want, rrMicros(next[0].At))
}

// TestReviewRROldTombstone: a tombstone of "1" alone (a version 1 client,
// or a refund that gave nothing): a retry reports nothing, without error.
func TestReviewRROldTombstone(t *testing.T) {
	t.Parallel()
	e, ctx := rrNew(t), context.Background()
	per := throttle.PerMinute(1, 0)
	_, err := e.eng.Book(ctx, "old:{o}", per, rrForever)
	require.NoError(t, err)
	b, err := e.eng.Book(ctx, "old:{o}", per, rrForever)
	require.NoError(t, err)
	e.obs.takeRefunds()
	e.hook.n.Store(1)
	_, err = e.eng.Refund(ctx, "old:{o}", per, b)
	require.ErrorIs(t, err, throttle.ErrReplyLost)
	tk := e.tomb(t, "o")
	require.NoError(t, e.rdb.Do(ctx, "SET", tk, "1", "KEEPTTL").Err())
	g, err := e.eng.Refund(ctx, "old:{o}", per, b)
	require.NoError(t, err)
	require.Zero(t, g)
	require.Equal(t, []time.Duration{0}, e.obs.takeRefunds())
	// Still given back once: the next booking takes b's slot.
	c, err := e.eng.Book(ctx, "old:{o}", per, rrForever)
	require.NoError(t, err)
	require.Equal(t, b.At, c.At)
}

// TestReviewRRGarbageTombstone (failed when handed over; fixed).
// PROTOCOL.md: a client "reads a tombstone of "1" alone, or one it cannot
// parse, as recording nothing given back". refund.lua took every run of
// digits after the first: "1 abc 7000000" and "1 -7000000" were read as 7 s
// given back and reported so. And a parseable but absurd record was
// reported as is, far beyond what the booking could ever give back (its
// own span, one minute): the engine did not bound earlier_i.
func TestReviewRRGarbageTombstone(t *testing.T) {
	t.Parallel()
	e, ctx := rrNew(t), context.Background()
	per := throttle.PerMinute(1, 0)
	for i, garbage := range []string{"garbage", "1 abc", "", "1 abc 7000000", "1 -7000000", "1 7e6", "1 9000000000000000"} {
		t.Run(fmt.Sprintf("%d:%q", i, garbage), func(t *testing.T) {
			tag := fmt.Sprintf("g%d", i)
			key := "gb:{" + tag + "}"
			_, err := e.eng.Book(ctx, key, per, rrForever)
			require.NoError(t, err)
			b, err := e.eng.Book(ctx, key, per, rrForever)
			require.NoError(t, err)
			e.hook.n.Store(1)
			_, err = e.eng.Refund(ctx, key, per, b)
			require.ErrorIs(t, err, throttle.ErrReplyLost)
			require.NoError(t, e.rdb.Do(ctx, "SET", e.tomb(t, tag), garbage, "KEEPTTL").Err())
			g, err := e.eng.Refund(ctx, key, per, b)
			got := e.obs.refundsOf(key)
			require.NoError(t, err)
			require.Zero(t, g)
			require.Len(t, got, 1)
			require.LessOrEqual(t, got[0], time.Minute, "reported more than the booking could give back")
			if garbage != "1 7e6" && garbage != "1 9000000000000000" {
				require.Zero(t, got[0], "a tombstone that does not parse records nothing (PROTOCOL.md)")
			}
		})
	}
}

// TestReviewRRLostGaveNothing: a refund that gave nothing (a later booking
// stood on it), its reply lost; the later booking is then given back, so
// the key ends where the first did; the retry gives nothing and reports
// nothing.
func TestReviewRRLostGaveNothing(t *testing.T) {
	t.Parallel()
	e, ctx := rrNew(t), context.Background()
	per := throttle.PerMinute(1, 0)
	_, err := e.eng.Book(ctx, "ln:{n}", per, rrForever)
	require.NoError(t, err)
	b1, err := e.eng.Book(ctx, "ln:{n}", per, rrForever)
	require.NoError(t, err)
	b2, err := e.eng.Book(ctx, "ln:{n}", per, rrForever)
	require.NoError(t, err)
	e.obs.takeRefunds()
	e.hook.n.Store(1)
	_, err = e.eng.Refund(ctx, "ln:{n}", per, b1)
	require.ErrorIs(t, err, throttle.ErrReplyLost)
	g, err := e.eng.Refund(ctx, "ln:{n}", per, b2)
	require.NoError(t, err)
	require.Equal(t, time.Minute, g)
	require.Equal(t, []time.Duration{time.Minute}, e.obs.takeRefunds())
	g, err = e.eng.Refund(ctx, "ln:{n}", per, b1)
	require.NoError(t, err)
	require.Zero(t, g)
	require.Equal(t, []time.Duration{0}, e.obs.takeRefunds())
	c, err := e.eng.Book(ctx, "ln:{n}", per, rrForever)
	require.NoError(t, err)
	require.Equal(t, b2.At, c.At, "b1 still stands; b2's slot is the next")
}

// TestReviewRRBeforeReset: a booking made before a Reset, refunded after:
// no error, nothing given or reported, and nothing let through early.
func TestReviewRRBeforeReset(t *testing.T) {
	t.Parallel()
	e, ctx := rrNew(t), context.Background()
	per := throttle.PerMinute(1, 0)
	_, err := e.eng.Book(ctx, "rs:{r}", per, rrForever)
	require.NoError(t, err)
	b, err := e.eng.Book(ctx, "rs:{r}", per, rrForever)
	require.NoError(t, err)
	require.NoError(t, e.eng.Reset(ctx, "rs:{r}"))
	c1, err := e.eng.Book(ctx, "rs:{r}", per, rrForever)
	require.NoError(t, err)
	e.obs.takeRefunds()
	g, err := e.eng.Refund(ctx, "rs:{r}", per, b)
	require.NoError(t, err)
	require.Zero(t, g)
	require.Equal(t, []time.Duration{0}, e.obs.takeRefunds())
	c2, err := e.eng.Book(ctx, "rs:{r}", per, rrForever)
	require.NoError(t, err)
	now := rrMicros(c2.At) - c2.Wait.Microseconds()
	require.Equal(t, rrExpectSlot(per, rrReplay(per, []throttle.Booking{c1}), now, 1), rrMicros(c2.At))

	// A refund lost before the Reset, retried after: reported once (the
	// lost attempt did give), and nothing more given back.
	_, err = e.eng.Book(ctx, "rs:{q}", per, rrForever)
	require.NoError(t, err)
	b, err = e.eng.Book(ctx, "rs:{q}", per, rrForever)
	require.NoError(t, err)
	e.hook.n.Store(1)
	_, err = e.eng.Refund(ctx, "rs:{q}", per, b)
	require.ErrorIs(t, err, throttle.ErrReplyLost)
	require.NoError(t, e.eng.Reset(ctx, "rs:{q}"))
	e.obs.takeRefunds()
	g, err = e.eng.Refund(ctx, "rs:{q}", per, b)
	require.NoError(t, err)
	require.Zero(t, g)
	got := e.obs.takeRefunds()
	require.Len(t, got, 1)
	require.LessOrEqual(t, got[0], time.Minute)
	t.Logf("lost refund before Reset, retried after: reported %v", got)
}

// TestReviewRRLateRetryAfterSlot: a refund that gave time back but whose
// reply was lost, retried (as documented, "calling it again is safe")
// after the booking's slot. refund.lua reads the tombstone only while
// slot > now (and the tombstone expires at the slot), so it is never
// reported; through reserve's Cancel, the retry makes no call at all once
// the slot has come (Cancel returns nil). A finding against the Observer's
// doc when handed over (it promised the retry reports, with no condition
// on the slot); the docs now say a retry reports the lost attempt only
// before the slot, and this test pins that: keeping the tombstone past
// the slot would keep a key per refund for as long as the booking's units
// stand, for a metric.
func TestReviewRRLateRetryAfterSlot(t *testing.T) {
	t.Parallel()
	e, ctx := rrNew(t), context.Background()
	per := throttle.PerSecond(4, 0) // 250 ms apart
	_, err := e.eng.Book(ctx, "late:{l}", per, rrForever)
	require.NoError(t, err)
	b, err := e.eng.Book(ctx, "late:{l}", per, rrForever)
	require.NoError(t, err)
	require.Positive(t, b.Wait)
	e.obs.takeRefunds()
	e.hook.n.Store(1)
	_, err = e.eng.Refund(ctx, "late:{l}", per, b)
	require.ErrorIs(t, err, throttle.ErrReplyLost)
	// Wait on the Redis clock until the slot has passed.
	require.Eventually(t, func() bool {
		now, err := e.rdb.Time(ctx).Result()
		return err == nil && now.After(b.At.Add(10*time.Millisecond))
	}, 10*time.Second, 20*time.Millisecond)
	g, err := e.eng.Refund(ctx, "late:{l}", per, b)
	require.NoError(t, err)
	require.Zero(t, g)
	got := e.obs.takeRefunds()
	require.Len(t, got, 1)
	engineOK := got[0] > 0
	t.Logf("engine: lost refund retried after the slot reported %v (the lost attempt gave back up to %v)", got, per.Interval())

	// Through reserve and metrics.Collector.
	srv := redistest.Shared(t)
	rdb := srv.Client(t)
	hook := &rrHook{}
	col, err := metrics.New()
	require.NoError(t, err)
	eng, err := throttle.New(rdb, throttle.WithPrefix(redistest.Prefix(t)), throttle.WithObserver(col), throttle.WithTimeout(5*time.Second))
	require.NoError(t, err)
	require.NoError(t, eng.Load(ctx))
	rdb.AddHook(hook)
	reg := prometheus.NewPedanticRegistry()
	require.NoError(t, reg.Register(col))
	refundsTotal := func(limiter string) float64 {
		mfs, err := reg.Gather()
		require.NoError(t, err)
		for _, mf := range mfs {
			if mf.GetName() == "slotbook_refunds_total" {
				for _, m := range mf.GetMetric() {
					for _, lp := range m.GetLabel() {
						if lp.GetName() == "limiter" && lp.GetValue() == limiter {
							return m.GetCounter().GetValue()
						}
					}
				}
			}
		}
		return 0
	}
	lostCancel := func(name string, limit throttle.Limit) *reserve.Reservation {
		l, err := reserve.New(eng, name, limit, reserve.WithoutMaxWait())
		require.NoError(t, err)
		_, err = l.Reserve(ctx, "k")
		require.NoError(t, err)
		r, err := l.Reserve(ctx, "k")
		require.NoError(t, err)
		require.True(t, r.OK())
		hook.n.Store(1)
		require.ErrorIs(t, r.Cancel(ctx), throttle.ErrReplyLost)
		return r
	}
	// Control: retried before the slot, counted once.
	r := lostCancel("rrctl", throttle.PerMinute(1, 0))
	require.NoError(t, r.Cancel(ctx))
	require.Equal(t, 1.0, refundsTotal("rrctl"), "control: a lost Cancel retried before its slot is counted")
	// Retried after the slot.
	r = lostCancel("rrlate", per)
	require.Eventually(t, func() bool {
		now, err := rdb.Time(ctx).Result()
		return err == nil && now.After(r.Booking().At.Add(10*time.Millisecond)) && r.Delay() <= 0
	}, 10*time.Second, 20*time.Millisecond)
	require.NoError(t, r.Cancel(ctx), "the documented safe retry")
	total := refundsTotal("rrlate")
	t.Logf("reserve: refunds_total after a lost Cancel retried after the slot: %v", total)
	require.False(t, engineOK, "engine: a lost refund retried after the slot is not reported (documented): %v", got)
	require.Zero(t, total, "reserve+Collector: a lost Cancel retried after the slot makes no call and is not counted (documented)")
}

// Typed-nil observers of every kind WithObserver names.
type (
	rrFuncObs  func()
	rrMapObs   map[string]int
	rrSliceObs []int
	rrChanObs  chan int
	rrPtrObs   struct{}
	rrValObs   struct{ _ int }
	rrEmbedObs struct{ throttle.Observer }
)

func (rrFuncObs) ObserveDecision(string, throttle.Outcome, time.Duration) {}
func (rrFuncObs) ObserveCall(string, time.Duration, error)                {}
func (rrFuncObs) ObserveRefund(string, time.Duration)                     {}
func (rrFuncObs) ObserveBreaker(bool)                                     {}
func (rrMapObs) ObserveDecision(string, throttle.Outcome, time.Duration)  {}
func (rrMapObs) ObserveCall(string, time.Duration, error)                 {}
func (rrMapObs) ObserveRefund(string, time.Duration)                      {}
func (rrMapObs) ObserveBreaker(bool)                                      {}
func (rrSliceObs) ObserveDecision(string, throttle.Outcome, time.Duration) {
}
func (rrSliceObs) ObserveCall(string, time.Duration, error)               {}
func (rrSliceObs) ObserveRefund(string, time.Duration)                    {}
func (rrSliceObs) ObserveBreaker(bool)                                    {}
func (rrChanObs) ObserveDecision(string, throttle.Outcome, time.Duration) {}
func (rrChanObs) ObserveCall(string, time.Duration, error)                {}
func (rrChanObs) ObserveRefund(string, time.Duration)                     {}
func (rrChanObs) ObserveBreaker(bool)                                     {}
func (*rrPtrObs) ObserveDecision(string, throttle.Outcome, time.Duration) {}
func (*rrPtrObs) ObserveCall(string, time.Duration, error)                {}
func (*rrPtrObs) ObserveRefund(string, time.Duration)                     {}
func (*rrPtrObs) ObserveBreaker(bool)                                     {}
func (rrValObs) ObserveDecision(string, throttle.Outcome, time.Duration)  {}
func (rrValObs) ObserveCall(string, time.Duration, error)                 {}
func (rrValObs) ObserveRefund(string, time.Duration)                      {}
func (rrValObs) ObserveBreaker(bool)                                      {}

func TestReviewRRTypedNilObservers(t *testing.T) {
	t.Parallel()
	rdb := redis.NewClient(&redis.Options{Addr: "127.0.0.1:1", ContextTimeoutEnabled: true}) // never dialled
	t.Cleanup(func() { _ = rdb.Close() })
	var col *metrics.Collector
	for name, o := range map[string]throttle.Observer{
		"nil func": rrFuncObs(nil), "nil map": rrMapObs(nil), "nil slice": rrSliceObs(nil),
		"nil chan": rrChanObs(nil), "nil pointer": (*rrPtrObs)(nil), "nil collector": col,
	} {
		_, err := throttle.New(rdb, throttle.WithObserver(o))
		require.ErrorContains(t, err, "nil observer", name)
	}
	for name, o := range map[string]throttle.Observer{
		"func": rrFuncObs(func() {}), "map": rrMapObs{}, "slice": rrSliceObs{}, "chan": make(rrChanObs),
		"pointer": &rrPtrObs{}, "value": rrValObs{},
	} {
		_, err := throttle.New(rdb, throttle.WithObserver(o))
		require.NoError(t, err, name)
	}
	_, err := throttle.New(rdb, throttle.WithObserver(nil))
	require.Error(t, err)
	// Beyond the doc's list: a struct embedding a nil Observer is taken.
	_, err = throttle.New(rdb, throttle.WithObserver(rrEmbedObs{}))
	t.Logf("struct embedding a nil Observer: err=%v (accepted if nil; would panic on first use)", err)
}

// TestReviewRRNoWait: NoWait reaches an Observer only for check-mode
// answers the fallback let pass; fallback reservations get a wait >= 0;
// Redis's own answers never a negative wait; the Collector's booked-wait
// histogram counts only Booked and fallback reservations.
func TestReviewRRNoWait(t *testing.T) {
	t.Parallel()
	srv := redistest.Shared(t)
	p := redistest.NewProxy(t, srv.Addr)
	rdb := p.Client(t, srv)
	obs := &rrObs{}
	col, err := metrics.New()
	require.NoError(t, err)
	both := rrTee{obs, col}
	eng, err := throttle.New(rdb, throttle.WithPrefix(redistest.Prefix(t)), throttle.WithObserver(both), throttle.WithProbeBackoff(time.Hour, time.Hour))
	require.NoError(t, err)
	ctx := context.Background()
	redistest.UntilOK(t, func() error { return eng.Load(ctx) })
	l, err := reserve.New(eng, "rrnw", throttle.PerSecond(1000, 10), reserve.WithFallback(reserve.FailOpen()), reserve.WithMaxWait(time.Second))
	require.NoError(t, err)
	// Redis up: Allow and Reserve.
	redistest.UntilOK(t, func() error { _, err := l.Allow(ctx, "k"); return err })
	redistest.UntilOK(t, func() error { _, err := l.Reserve(ctx, "k"); return err })
	for _, d := range obs.takeDecisions() {
		require.GreaterOrEqual(t, d.wait, time.Duration(0), "Redis's answer %v", d)
	}
	booked := 1.0
	p.Close()
	// Until the breaker opens and the fallback answers.
	require.Eventually(t, func() bool {
		res, err := l.Allow(ctx, "k")
		return err == nil && res.Allowed
	}, 10*time.Second, 10*time.Millisecond)
	obs.takeDecisions()
	for range 5 {
		res, err := l.Allow(ctx, "k")
		require.NoError(t, err)
		ds := obs.takeDecisions()
		require.Len(t, ds, 1)
		if res.Allowed {
			require.Equal(t, rrDecision{throttle.FallbackAllowed, throttle.NoWait}, ds[0])
		} else {
			require.Equal(t, throttle.FallbackRefused, ds[0].o)
			require.GreaterOrEqual(t, ds[0].wait, time.Duration(0))
		}
		r, err := l.Reserve(ctx, "k")
		require.NoError(t, err)
		require.True(t, r.Fallback())
		ds = obs.takeDecisions()
		require.Len(t, ds, 1)
		require.GreaterOrEqual(t, ds[0].wait, time.Duration(0), "a fallback reservation's wait %v", ds[0])
		if r.OK() {
			require.Equal(t, throttle.FallbackAllowed, ds[0].o)
			booked++
			require.NoError(t, r.Cancel(ctx))
		}
	}
	reg := prometheus.NewPedanticRegistry()
	require.NoError(t, reg.Register(col))
	mfs, err := reg.Gather()
	require.NoError(t, err)
	var count uint64
	for _, mf := range mfs {
		if mf.GetName() == "slotbook_booked_wait_seconds" {
			for _, m := range mf.GetMetric() {
				count += m.GetHistogram().GetSampleCount()
			}
		}
	}
	require.Equal(t, uint64(booked), count, "booked-wait samples: Redis's booking and the fallback's reservations only")
}

type rrTee []throttle.Observer

func (t rrTee) ObserveDecision(l string, o throttle.Outcome, w time.Duration) {
	for _, x := range t {
		x.ObserveDecision(l, o, w)
	}
}
func (t rrTee) ObserveCall(l string, d time.Duration, err error) {
	for _, x := range t {
		x.ObserveCall(l, d, err)
	}
}
func (t rrTee) ObserveRefund(l string, g time.Duration) {
	for _, x := range t {
		x.ObserveRefund(l, g)
	}
}
func (t rrTee) ObserveBreaker(open bool) {
	for _, x := range t {
		x.ObserveBreaker(open)
	}
}
