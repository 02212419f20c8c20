package slotbook_test

// Issue 12: the limit holds on every path. Each test walks one side path
// (cancels, pauses, lost replies, latency, fallbacks, corrupt state)
// through the public API against a real redis-server, and judges the
// outcome on the Redis clock (Booking().At) or on the stored state, never
// on a wall-clock bound. Faults come from redistest.Proxy: reply latency
// that does not reorder bytes, or a closed address.

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"math"
	"slices"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/slotbook/slotbook/deadline"
	"github.com/slotbook/slotbook/internal/redistest"
	"github.com/slotbook/slotbook/pool"
	"github.com/slotbook/slotbook/reserve"
	"github.com/slotbook/slotbook/throttle"
)

// sideEnv is one side-path test's Redis: the shared real server, a direct
// client, and a key prefix of the test's own.
type sideEnv struct {
	srv    *redistest.Server
	rdb    *redis.Client // direct, for inspecting and planting state
	prefix string
}

func newSideEnv(t *testing.T) *sideEnv {
	t.Helper()
	srv := redistest.Shared(t)
	srv.RequireReal(t)
	return &sideEnv{srv: srv, rdb: srv.Client(t), prefix: redistest.Prefix(t)}
}

// engine returns an engine on the test's prefix talking to addr (the
// server's, or a proxy's), and its client.
func (s *sideEnv) engine(t *testing.T, addr string, opts ...throttle.Option) (*throttle.Engine, *redis.Client) {
	t.Helper()
	o := s.srv.Options()
	o.Addr = addr
	o.MaxRetries = -1 // a fault must reach the engine, not be retried away
	rdb := redis.NewClient(o)
	t.Cleanup(func() { _ = rdb.Close() })
	eng, err := throttle.New(rdb, append([]throttle.Option{throttle.WithPrefix(s.prefix)}, opts...)...)
	require.NoError(t, err)
	return eng, rdb
}

// direct returns an engine on the server itself, with a timeout a busy
// machine keeps, and loads the scripts (Redis keeps them for every client).
func (s *sideEnv) direct(t *testing.T) *throttle.Engine {
	t.Helper()
	eng, _ := s.engine(t, s.srv.Addr, throttle.WithTimeout(5*time.Second))
	require.NoError(t, eng.Load(context.Background()))
	return eng
}

// proxied returns a proxy in front of the server and an engine through it
// with opts. The scripts are loaded and the engine's connection is open
// before the test sets any delay, so that a delay holds back script
// replies, not a NOSCRIPT round trip or the connection's handshake.
func (s *sideEnv) proxied(t *testing.T, opts ...throttle.Option) (*redistest.Proxy, *throttle.Engine) {
	t.Helper()
	s.direct(t)
	p := redistest.NewProxy(t, s.srv.Addr)
	eng, rdb := s.engine(t, p.Addr(), opts...)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	require.NoError(t, rdb.Ping(ctx).Err())
	return p, eng
}

// down returns an engine whose Redis is unreachable: it points at a closed
// proxy, so every connection is refused.
func (s *sideEnv) down(t *testing.T) *throttle.Engine {
	t.Helper()
	p := redistest.NewProxy(t, s.srv.Addr)
	p.Close()
	eng, _ := s.engine(t, p.Addr(), throttle.WithTimeout(time.Second))
	return eng
}

func newLimiter(t *testing.T, eng *throttle.Engine, limit throttle.Limit, opts ...reserve.Option) *reserve.Limiter {
	t.Helper()
	l, err := reserve.New(eng, "api", limit, opts...)
	require.NoError(t, err)
	return l
}

// gcraEvent is n units acting together at the microsecond at on the Redis
// clock.
type gcraEvent struct {
	name string
	at   int64
	n    int
}

// live returns r's booking as an event; r must be booked, and is one that
// will run (not cancelled).
func live(t *testing.T, name string, r *reserve.Reservation) gcraEvent {
	t.Helper()
	require.True(t, r.OK(), "%s: not booked: %v", name, r.Err())
	b := r.Booking()
	return gcraEvent{name: name, at: b.At.UnixMicro(), n: b.N}
}

// earlyEvents replays events, sorted by time, through a textbook GCRA with
// emission interval I and tolerance tau, from an empty key, one unit at a
// time: a unit at t conforms if t >= TAT - tau, and then
// TAT = max(TAT, t) + I. It describes every unit that does not conform.
// It shares nothing with the engine's scripts.
func earlyEvents(events []gcraEvent, interval, tau time.Duration) []string {
	ev := slices.Clone(events)
	slices.SortStableFunc(ev, func(a, b gcraEvent) int { return cmp.Compare(a.at, b.at) })
	if len(ev) == 0 {
		return nil
	}
	I, tol := interval.Microseconds(), tau.Microseconds()
	origin := ev[0].at
	tat := origin // an empty key: the first unit conforms
	var early []string
	for _, e := range ev {
		for u := 1; u <= e.n; u++ {
			if e.at < tat-tol {
				early = append(early, fmt.Sprintf("%s (unit %d of %d) at +%v is %v early (TAT %+v, tau %v)",
					e.name, u, e.n, time.Duration(e.at-origin)*time.Microsecond,
					time.Duration(tat-tol-e.at)*time.Microsecond, time.Duration(tat-origin)*time.Microsecond, tau))
			}
			tat = max(tat, e.at) + I
		}
	}
	return early
}

// offsets describes events by their time from the first, for messages.
func offsets(events []gcraEvent) string {
	if len(events) == 0 {
		return "none"
	}
	first := events[0].at
	for _, e := range events {
		first = min(first, e.at)
	}
	s := ""
	for _, e := range events {
		s += fmt.Sprintf(" %s=%dx@+%v", e.name, e.n, time.Duration(e.at-first)*time.Microsecond)
	}
	return s
}

// cancelUntilDone retries r.Cancel while it fails with ErrUnavailable (the
// breaker fails calls fast for a while after a fault), as a caller told
// "retrying is safe" would, and requires it to succeed within 10s.
func cancelUntilDone(t *testing.T, r *reserve.Reservation) {
	t.Helper()
	ctx := context.Background()
	deadline := time.Now().Add(10 * time.Second)
	for {
		err := r.Cancel(ctx)
		if err == nil {
			return
		}
		require.ErrorIs(t, err, throttle.ErrUnavailable, "retried Cancel")
		require.True(t, time.Now().Before(deadline), "retried Cancel kept failing: %v", err)
		time.Sleep(5 * time.Millisecond)
	}
}

// TestSidePathTwoCancels (issue 12, point 1): cancelling two bookings in a
// row, the later one first, must not hand out room that a booking still
// standing needs. 10/s burst 2: 3 units now, 3 at +300ms, 3 at +600ms and
// 1 at +700ms; cancel the +600ms booking, then the +300ms one; a new
// booking of 3 must not act beside the live 1-unit booking (4 units at
// once). The live bookings replayed through a textbook GCRA show no early
// unit.
func TestSidePathTwoCancels(t *testing.T) {
	t.Parallel()
	s := newSideEnv(t)
	limit := throttle.PerSecond(10, 2)
	lim := newLimiter(t, s.direct(t), limit)
	ctx := context.Background()
	reserveN := func(n int) *reserve.Reservation {
		t.Helper()
		r, err := lim.ReserveN(ctx, "k", n)
		require.NoError(t, err)
		require.True(t, r.OK(), "no max wait: always booked: %v", r.Err())
		return r
	}
	a, b, c, d := reserveN(3), reserveN(3), reserveN(3), reserveN(1)
	require.NoError(t, c.Cancel(ctx))
	require.NoError(t, b.Cancel(ctx))
	e := reserveN(3)

	events := []gcraEvent{live(t, "A", a), live(t, "D", d), live(t, "E", e)}
	t.Logf("booked A B C D on the Redis clock:%s; cancelled C, B; then E", offsets([]gcraEvent{
		live(t, "A", a), live(t, "B", b), live(t, "C", c), live(t, "D", d), live(t, "E", e)}))
	require.Empty(t, earlyEvents(events, limit.Interval(), 2*limit.Interval()),
		"live bookings%s replayed through a textbook GCRA (10/s burst 2)", offsets(events))
}

// TestSidePathCancelAfterPause (issue 12, point 2): cancelling a booking
// made before a Pause must not undo the Pause. 10/s burst 0: 10 slots
// (now .. +900ms), Pause(950ms), cancel the +900ms booking, book again:
// the new slot lies at or after the pause's end. The Pause was issued on
// the Redis clock no earlier than the decision time of the bookings made
// just before it, so that time plus 950ms is a lower bound of its end:
// the check errs only on the safe side.
func TestSidePathCancelAfterPause(t *testing.T) {
	t.Parallel()
	s := newSideEnv(t)
	limit := throttle.PerSecond(10, 0)
	lim := newLimiter(t, s.direct(t), limit)
	ctx := context.Background()
	reqs := make([]reserve.BatchRequest, 10)
	for i := range reqs {
		reqs[i] = reserve.BatchRequest{N: 1}
	}
	rs, err := lim.ReserveBatch(ctx, "k", reqs)
	require.NoError(t, err)
	last := rs[len(rs)-1]
	require.True(t, last.OK(), "no max wait: always booked: %v", last.Err())
	anchor := last.Booking().At.Add(-last.Booking().Wait) // Redis time of the decision
	const pause = 950 * time.Millisecond
	require.NoError(t, lim.Pause(ctx, "k", pause))
	require.NoError(t, last.Cancel(ctx))
	next, err := lim.Reserve(ctx, "k")
	require.NoError(t, err)
	require.True(t, next.OK(), "no max wait: always booked: %v", next.Err())

	pauseEnd := anchor.Add(pause) // at or before the pause's true end
	at := next.Booking().At
	require.False(t, at.Before(pauseEnd), "the slot after the cancel lies %v inside the pause (slot +%v, pause ends at +%v or later, from the batch's decision)",
		pauseEnd.Sub(at), at.Sub(anchor), pause)

	var events []gcraEvent
	for i, r := range rs[:len(rs)-1] {
		events = append(events, live(t, "R"+strconv.Itoa(i), r))
	}
	events = append(events, live(t, "next", next))
	require.Empty(t, earlyEvents(events, limit.Interval(), 0), "live bookings%s (10/s burst 0)", offsets(events))
}

// TestSidePathRetriedCancel (issue 12, point 3): a Cancel whose reply was
// lost (the refund ran, the reply came after the engine's timeout) reports
// ErrReplyLost; retrying it, as that error invites, gives nothing more,
// whether or not someone else booked the room meanwhile. 1/s burst 0, so
// that no slot comes while the test runs; the live bookings replayed
// through a textbook GCRA show no two slots within one interval.
func TestSidePathRetriedCancel(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name  string
		other bool // someone else books B's room before the retry
	}{
		{name: "retry"},
		{name: "retry after another booking", other: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			s := newSideEnv(t)
			limit := throttle.PerSecond(1, 0)
			// The timeout is short of the reply delay set below, and long
			// enough for the calls that must succeed on a busy machine.
			proxy, eng := s.proxied(t, throttle.WithTimeout(250*time.Millisecond), throttle.WithProbeBackoff(5*time.Millisecond, 20*time.Millisecond))
			lim := newLimiter(t, eng, limit)
			others := newLimiter(t, s.direct(t), limit) // another process, same quota
			ctx := context.Background()
			book := func(l *reserve.Limiter) *reserve.Reservation {
				t.Helper()
				for try := 0; ; try++ {
					r, err := l.Reserve(ctx, "k")
					// Through the proxy, a busy machine may miss the
					// engine's timeout: a booking whose reply was lost is
					// wasted room, never a live booking; try again.
					if errors.Is(err, throttle.ErrUnavailable) && try < 100 {
						time.Sleep(5 * time.Millisecond)
						continue
					}
					require.NoError(t, err)
					require.True(t, r.OK(), "no max wait: always booked: %v", r.Err())
					return r
				}
			}
			a, b := book(lim), book(lim)

			proxy.SetReplyDelay(time.Second) // beyond the engine's timeout
			err := b.Cancel(ctx)
			require.Error(t, err, "the refund's reply was held back past the engine's timeout")
			assert.ErrorIs(t, err, throttle.ErrUnavailable)
			assert.ErrorIs(t, err, throttle.ErrReplyLost, "the refund was sent: its reply was lost")
			proxy.SetReplyDelay(0)

			events := []gcraEvent{live(t, "A", a)}
			if tc.other {
				events = append(events, live(t, "C", book(others)))
			}
			cancelUntilDone(t, b)
			events = append(events, live(t, "D", book(others)))
			require.Empty(t, earlyEvents(events, limit.Interval(), 0),
				"live bookings%s (1/s burst 0; B cancelled, its Cancel retried)", offsets(events))
		})
	}
}

// TestSidePathDeadlineLatency (issue 12, point 4): the budget is judged on
// the slot as the caller sees it once the reply has come. With 40ms of
// reply latency, a slot that fits the deadline when Redis decides but not
// when the reply arrives is refused with ErrWouldExceedDeadline (not booked,
// not left to fail in Wait with context.DeadlineExceeded), and given back:
// the next booking takes the same slot.
//
// The numbers hold on a busy machine with no timing assumption but the
// proxy's delay: S is the next free slot (1/s burst 0, so S lies a second
// ahead), the deadline is S+20ms. Redis decides at some t after the call
// starts, so the wait S-t fits the budget (deadline - start) with 20ms to
// spare; the reply arrives 40ms or more after t, so arrived + wait >= S+40ms
// is past the deadline by 20ms or more.
func TestSidePathDeadlineLatency(t *testing.T) {
	t.Parallel()
	const (
		latency = 40 * time.Millisecond
		margin  = 20 * time.Millisecond
	)
	limit := throttle.PerSecond(1, 0)
	setup := func(t *testing.T) (*reserve.Limiter, time.Time) {
		t.Helper()
		s := newSideEnv(t)
		proxy, eng := s.proxied(t, throttle.WithTimeout(time.Second))
		lim := newLimiter(t, eng, limit)
		ctx := context.Background()
		proxy.SetReplyDelay(latency)
		begin := time.Now()
		_, err := lim.Allow(ctx, "rtt")
		rtt := time.Since(begin)
		require.NoError(t, err)
		require.GreaterOrEqual(t, rtt, latency, "a call through the proxy takes at least its reply delay")
		t.Logf("round trip through the proxy: %v", rtt)

		x, err := lim.Reserve(ctx, "k")
		require.NoError(t, err)
		require.True(t, x.OK(), "no max wait: always booked: %v", x.Err())
		return lim, x.Booking().At.Add(limit.Interval()) // S: the next free slot
	}
	// givenBack checks that the refused booking left no trace: the next
	// booking gets slot S (or now, if S has passed), not S + I.
	givenBack := func(t *testing.T, lim *reserve.Limiter, slot time.Time) {
		t.Helper()
		y, err := lim.Reserve(context.Background(), "k")
		require.NoError(t, err)
		require.True(t, y.OK(), "no max wait: always booked: %v", y.Err())
		require.True(t, y.Booking().At.Before(slot.Add(limit.Interval())),
			"the next booking's slot is %v after S: the refused slot was not given back", y.Booking().At.Sub(slot))
	}

	t.Run("reserve", func(t *testing.T) {
		t.Parallel()
		lim, slot := setup(t)
		ctx, cancel := context.WithDeadline(context.Background(), slot.Add(margin))
		defer cancel()
		r, err := lim.Reserve(ctx, "k")
		require.NoError(t, err, "a refusal is not an error")
		require.False(t, r.OK(), "booked a slot the caller reaches %v past its deadline (Redis slot S, deadline S+%v)",
			r.SlotAt().Sub(slot.Add(margin)), margin)
		require.ErrorIs(t, r.Err(), reserve.ErrWouldExceedDeadline)
		var de *deadline.Error
		require.ErrorAs(t, r.Err(), &de)
		require.Greater(t, de.RetryAfter, de.Budget, "a budget of RetryAfter would have been enough; the one given was not")
		require.ErrorIs(t, r.Wait(ctx), reserve.ErrWouldExceedDeadline, "Wait reports the refusal, not the context's end")
		givenBack(t, lim, slot)
	})

	t.Run("pool", func(t *testing.T) {
		t.Parallel()
		lim, slot := setup(t)
		p, err := pool.New(lim, pool.WithWorkers(2))
		require.NoError(t, err)
		t.Cleanup(func() {
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			_ = p.Close(ctx)
		})
		ctx, cancel := context.WithDeadline(context.Background(), slot.Add(margin))
		defer cancel()
		var ran atomic.Bool
		job, err := p.Submit(ctx, "k", func(context.Context) error { ran.Store(true); return nil })
		require.NoError(t, err)
		wctx, wcancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer wcancel()
		err = job.Wait(wctx)
		require.NoError(t, wctx.Err(), "the job did not end within 10s")
		require.ErrorIs(t, err, reserve.ErrWouldExceedDeadline, "the job's slot lies past its deadline once the reply came")
		require.False(t, ran.Load(), "the refused job ran")
		givenBack(t, lim, slot)
	})
}

// TestSidePathFallbackShared (issue 12, point 5): while Redis is
// unavailable (the engine points at a closed proxy: connection refused),
// LocalShare enforces one local share per quota: views made with With
// share it, and a layered limiter's every limit holds.
func TestSidePathFallbackShared(t *testing.T) {
	t.Parallel()
	local := reserve.WithFallback(reserve.LocalShare(time.Second, 1, 100)) // one instance: the whole limit

	t.Run("With", func(t *testing.T) {
		t.Parallel()
		lim := newLimiter(t, newSideEnv(t).down(t), throttle.PerMinute(1, 0), local, reserve.WithMaxWait(time.Second))
		view, err := lim.With(reserve.WithMaxWait(2 * time.Second))
		require.NoError(t, err)
		ctx := context.Background()

		admitted := 0
		for _, l := range []*reserve.Limiter{lim, view, lim, view} {
			r, err := l.Reserve(ctx, "reserve")
			require.NoError(t, err, "the fallback answers")
			require.True(t, r.Fallback(), "Redis is down: the fallback answered")
			if r.OK() {
				admitted++
			}
		}
		require.Equal(t, 1, admitted, "Reserve: the two views of one 1/min quota together admit one local share")

		allowed := 0
		for _, l := range []*reserve.Limiter{lim, view, lim, view} {
			res, err := l.Allow(ctx, "allow")
			require.NoError(t, err, "the fallback answers")
			if res.Allowed {
				allowed++
			}
		}
		require.Equal(t, 1, allowed, "Allow: the two views of one 1/min quota together admit one local share")
	})

	t.Run("layered", func(t *testing.T) {
		t.Parallel()
		lim := newLimiter(t, newSideEnv(t).down(t), throttle.PerSecond(100, 10), local,
			reserve.WithLimit(throttle.PerDay(3, 0)), reserve.WithMaxWait(100*time.Millisecond))
		ctx := context.Background()
		admitted := 0
		for i := 0; i < 30; i++ {
			r, err := lim.Reserve(ctx, "k")
			require.NoError(t, err, "the fallback answers")
			if r.OK() {
				admitted++
			}
			res, err := lim.Allow(ctx, "k")
			require.NoError(t, err, "the fallback answers")
			if res.Allowed {
				admitted++
			}
		}
		require.Positive(t, admitted, "LocalShare admits its share")
		require.LessOrEqual(t, admitted, 3, "100/s and 3/day, one instance: the per-day limit holds during the outage")
	})
}

// TestSidePathAbsurdStoredValue (issue 12, point 8): a key holding a value
// slotbook never writes is an error naming the full key (not a permanent
// denial), the value is left alone, and Limiter.Reset clears the subject,
// in every limit of a layered limiter too (the value planted in the second
// limit's key, "name:{subject}:period").
func TestSidePathAbsurdStoredValue(t *testing.T) {
	t.Parallel()
	s := newSideEnv(t)
	eng := s.direct(t)
	perDay := throttle.PerDay(1000, 0)
	single := newLimiter(t, eng, throttle.PerSecond(10, 5))
	layered := newLimiter(t, eng, throttle.PerSecond(10, 5), reserve.WithLimit(perDay))
	tenYears := strconv.FormatInt(time.Now().Add(10*365*24*time.Hour).UnixMicro(), 10)
	type tc struct {
		name, value string
		layered     bool
	}
	var cases []tc
	for _, v := range []string{"99999999999999999999", "1e30", "inf", "-inf", "nan", "1.5", "-5", "abc", tenYears} {
		cases = append(cases, tc{name: v, value: v})
	}
	cases[len(cases)-1].name = "10 years ahead"
	cases = append(cases,
		tc{name: "layered abc", value: "abc", layered: true},
		tc{name: "layered 10 years ahead", value: tenYears, layered: true})
	for i, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			lim := single
			subject := "s" + strconv.Itoa(i)
			key := "api:{" + subject + "}" // the engine's key, before the prefix
			if c.layered {
				lim = layered
				key += ":86400000ms" // wire protocol 2: the period in milliseconds
			}
			full := s.prefix + key
			require.NoError(t, s.rdb.Set(ctx, full, c.value, 0).Err())

			_, err := lim.Reserve(ctx, subject)
			require.ErrorIs(t, err, throttle.ErrCorruptState, "Reserve")
			require.Contains(t, err.Error(), full, "the error names the key")
			_, err = lim.Allow(ctx, subject)
			require.ErrorIs(t, err, throttle.ErrCorruptState, "Allow")
			require.Contains(t, err.Error(), full, "the error names the key")
			got, err := s.rdb.Get(ctx, full).Result()
			require.NoError(t, err, "the value is still there")
			require.Equal(t, c.value, got, "the value is not overwritten")

			require.NoError(t, lim.Reset(ctx, subject))
			r, err := lim.Reserve(ctx, subject)
			require.NoError(t, err, "after Reset")
			require.True(t, r.OK(), "after Reset the subject is idle")
			require.Zero(t, r.Booking().Wait, "after Reset the subject is idle")
		})
	}
}

// TestSidePathLostBookReply (issue 12, point 9): a booking whose reply is
// lost after it was sent (the script may have booked) is told apart from
// one that never reached Redis: the first matches ErrUnavailable and
// ErrReplyLost, the others (breaker open, connection refused) only
// ErrUnavailable.
func TestSidePathLostBookReply(t *testing.T) {
	t.Parallel()
	limit := throttle.PerSecond(10, 0)

	t.Run("reply lost, then breaker open", func(t *testing.T) {
		t.Parallel()
		s := newSideEnv(t)
		// A long probe backoff: after the fault the breaker stays open.
		proxy, eng := s.proxied(t, throttle.WithTimeout(50*time.Millisecond), throttle.WithProbeBackoff(time.Minute, time.Minute))
		lim := newLimiter(t, eng, limit)
		proxy.SetReplyDelay(300 * time.Millisecond) // beyond the engine's 50ms timeout
		ctx := context.Background()
		_, err := lim.Reserve(ctx, "k")
		require.ErrorIs(t, err, throttle.ErrUnavailable)
		require.ErrorIs(t, err, throttle.ErrReplyLost, "the booking was sent: it may have booked")

		_, err = lim.Reserve(ctx, "k")
		require.ErrorIs(t, err, throttle.ErrUnavailable, "the breaker is open")
		require.NotErrorIs(t, err, throttle.ErrReplyLost, "failing fast sends nothing")
	})

	t.Run("connection refused", func(t *testing.T) {
		t.Parallel()
		lim := newLimiter(t, newSideEnv(t).down(t), limit)
		_, err := lim.Reserve(context.Background(), "k")
		require.ErrorIs(t, err, throttle.ErrUnavailable)
		require.NotErrorIs(t, err, throttle.ErrReplyLost, "nothing reached Redis")
	})
}

// TestSidePathFallbackDeadline: a fallback answer is judged against the
// context deadline from when the failed call came back, not from before
// it: its local slot may not land past the deadline once the call's
// timeout has been spent (found by review: the budget was measured before
// the call).
func TestSidePathFallbackDeadline(t *testing.T) {
	t.Parallel()
	s := newSideEnv(t)
	p, eng := s.proxied(t, throttle.WithTimeout(300*time.Millisecond), throttle.WithProbeBackoff(time.Millisecond, time.Millisecond))
	p.SetReplyDelay(time.Hour) // every reply is lost at the engine's timeout
	lim := newLimiter(t, eng, throttle.PerMinute(1, 0), reserve.WithFallback(reserve.LocalShare(time.Minute, 1, 100)), reserve.WithCoalescing(false))
	ctx := context.Background()
	r1, err := lim.Reserve(ctx, "k")
	require.NoError(t, err)
	require.True(t, r1.OK() && r1.Fallback(), "%+v", r1)

	time.Sleep(5 * time.Millisecond) // a probe is due: the next call spends its timeout

	// The local limiter's next slot is a minute after r1's; the deadline
	// 150ms before it. Measured before the call, the budget would fit the
	// slot once the call's 300ms timeout has passed.
	next := r1.SlotAt().Add(time.Minute)
	dctx, cancel := context.WithDeadline(ctx, next.Add(-150*time.Millisecond))
	defer cancel()
	r2, err := lim.Reserve(dctx, "k")
	require.NoError(t, err)
	dl, _ := dctx.Deadline()
	if r2.OK() {
		require.False(t, r2.SlotAt().After(dl), "a fallback slot %v past the context deadline", r2.SlotAt().Sub(dl))
	}
}

// minDurations runs f and control in turn, n times each, and returns the
// shortest run of each: the least the machine's load added to them, with
// the two measured side by side so that a change of load hits both.
func minDurations(n int, f, control func()) (best, bestControl time.Duration) {
	best, bestControl = time.Duration(math.MaxInt64), time.Duration(math.MaxInt64)
	timed := func(g func()) time.Duration {
		start := time.Now()
		g()
		return time.Since(start)
	}
	for i := 0; i < n; i++ {
		best = min(best, timed(f))
		bestControl = min(bestControl, timed(control))
	}
	return best, bestControl
}

// TestSidePathHeartbeatOffThePath: LocalShare's heartbeat is not a round
// trip the caller waits for: with 40ms of latency, a reservation with a
// heartbeat due returns as fast as one without a fallback (a control in
// the same run), not a round trip later (found by review: the heartbeat
// ran between the deadline check and the caller, so Acquire said go after
// its deadline).
func TestSidePathHeartbeatOffThePath(t *testing.T) {
	t.Parallel()
	s := newSideEnv(t)
	const rtt = 40 * time.Millisecond
	p, eng := s.proxied(t, throttle.WithTimeout(5*time.Second))
	p.SetLatency(rtt / 2)
	withBeat := newLimiter(t, eng, throttle.PerSecond(1000, 100),
		reserve.WithFallback(reserve.LocalShare(10*time.Millisecond, 1, 100)), reserve.WithCoalescing(false))
	control := newLimiter(t, eng, throttle.PerSecond(1000, 100), reserve.WithCoalescing(false))
	ctx := context.Background()
	reserveOK := func(l *reserve.Limiter) func() {
		return func() {
			time.Sleep(20 * time.Millisecond) // a heartbeat is due again
			r, err := l.Reserve(ctx, "k")
			require.NoError(t, err)
			require.True(t, r.OK())
		}
	}
	beat, ctl := minDurations(8, reserveOK(withBeat), reserveOK(control))
	t.Logf("fastest reservation with a heartbeat due %v, without a fallback %v", beat, ctl)
	require.Less(t, beat, ctl+rtt/2, "the heartbeat's round trip must not be on the caller's path")
}

// TestSidePathLateRefundOffThePath: a batch in which one booking turns out
// late once the reply is in gives it back after the others have their
// answers: the batch returns as fast as one with nothing late (a control
// in the same run), not a refund's round trip later (found by review: an
// OK neighbour reached its caller after its own deadline).
func TestSidePathLateRefundOffThePath(t *testing.T) {
	t.Parallel()
	s := newSideEnv(t)
	const rtt = 40 * time.Millisecond
	p, eng := s.proxied(t, throttle.WithTimeout(5*time.Second))
	p.SetLatency(rtt / 2)
	lim := newLimiter(t, eng, throttle.PerSecond(1000, 100))
	ctx := context.Background()
	batch := func(first time.Duration) func() {
		return func() {
			// The first request's deadline passes while the reply travels
			// (its slot is immediate, its deadline shorter than the trip);
			// the second's leaves room.
			c0, cancel0 := context.WithTimeout(ctx, first)
			defer cancel0()
			c1, cancel1 := context.WithTimeout(ctx, time.Minute)
			defer cancel1()
			rs, err := lim.ReserveBatch(ctx, "k", []reserve.BatchRequest{{Context: c0, N: 1}, {Context: c1, N: 1}})
			require.NoError(t, err)
			require.True(t, rs[1].OK())
			if first < rtt/2 {
				require.ErrorIs(t, rs[0].Err(), reserve.ErrWouldExceedDeadline)
			}
		}
	}
	late, ctl := minDurations(8, batch(rtt/4), batch(time.Minute))
	t.Logf("fastest batch with a late booking %v, with none %v", late, ctl)
	require.Less(t, late, ctl+rtt/2, "the late booking's refund must not hold back its neighbours")
}
