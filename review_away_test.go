package slotbook_test

// Review (helper revD42): every public operation run while Redis is away
// (stopped, CLIENT PAUSE, replies held or severed by redistest.Proxy, 40 ms
// of latency), and what it leaves behind once Redis is back. Through the
// public API, against redis-servers of the tests' own (redistest.Start),
// since stopping or pausing the shared one would disturb other tests.
// The tests do not run in parallel: each counts goroutines.
//
// Found on 7c689a5 (one finding, documented since, not changed):
//   - TestReviewAWPoolClosePaused: with an engine timeout of 1 s or more
//     (a remote Redis), Pool.Close with Redis paused takes about one
//     second per booking it gives back (1.0 s for 1 booking, 7.0 s for
//     7), and the breaker never opens: each give-back's own one-second
//     context ends before the engine's timeout, which the engine counts
//     as the caller giving up, not Redis being down, so every give-back
//     is sent and waits out its second. Two fixes were tried and
//     dropped (see CHANGELOG.md); the test now holds Close to the
//     documented second per booking.
//
// Oracles: the error each operation's doc promises; its time against a
// control measured in the same run (the engine's timeout, documented as
// the bound, and a call through the same path with Redis up); the key's
// state in Redis against a textbook GCRA replay of the bookings that
// stand; runtime.NumGoroutine settling back after everything is closed.

import (
	"cmp"
	"context"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"runtime"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/slotbook/slotbook/httplimit"
	"github.com/slotbook/slotbook/internal/callcount"
	"github.com/slotbook/slotbook/internal/redistest"
	"github.com/slotbook/slotbook/lease"
	"github.com/slotbook/slotbook/metrics"
	"github.com/slotbook/slotbook/pool"
	"github.com/slotbook/slotbook/reserve"
	"github.com/slotbook/slotbook/throttle"
)

// awEnv is one test's own redis-server, a key prefix, and the clients it
// made (closed by closeAll, before the goroutine count is checked).
type awEnv struct {
	srv     *redistest.Server
	prefix  string
	mu      sync.Mutex
	clients []*redis.Client
}

func newAwEnv(t *testing.T) *awEnv {
	t.Helper()
	srv := redistest.Start(t)
	e := &awEnv{srv: srv, prefix: redistest.Prefix(t)}
	t.Cleanup(e.closeAll)
	return e
}

// client returns a client of addr (the server's, or a proxy's) with
// retries off, as the fault tests' are.
func (e *awEnv) client(addr string, tweak ...func(*redis.Options)) *redis.Client {
	o := e.srv.Options()
	o.Addr = addr
	o.MaxRetries = -1
	for _, f := range tweak {
		f(o)
	}
	c := redis.NewClient(o)
	e.mu.Lock()
	e.clients = append(e.clients, c)
	e.mu.Unlock()
	return c
}

func (e *awEnv) closeAll() {
	e.mu.Lock()
	cs := e.clients
	e.clients = nil
	e.mu.Unlock()
	for _, c := range cs {
		_ = c.Close()
	}
}

// engine returns an engine on the test's prefix through addr.
func (e *awEnv) engine(t *testing.T, addr string, timeout time.Duration, opts ...throttle.Option) *throttle.Engine {
	t.Helper()
	eng, err := throttle.New(e.client(addr), append([]throttle.Option{throttle.WithPrefix(e.prefix), throttle.WithTimeout(timeout)}, opts...)...)
	require.NoError(t, err)
	redistest.UntilOK(t, func() error { return eng.Load(context.Background()) })
	return eng
}

// raw is a direct client for inspecting state and issuing CLIENT PAUSE.
func (e *awEnv) raw() *redis.Client { return e.client(e.srv.Addr) }

// clientPause pauses every client of the server for d (CLIENT PAUSE ALL),
// issued from a client of its own.
func (e *awEnv) clientPause(t *testing.T, d time.Duration) {
	t.Helper()
	c := e.raw()
	require.NoError(t, c.Do(context.Background(), "client", "pause", d.Milliseconds(), "all").Err())
}

// tat reads key's stored TAT (microseconds on the Redis clock) straight
// from Redis, and the Redis clock now; 0 if the key is idle (absent).
func (e *awEnv) tat(t *testing.T, key string) (tat, now int64) {
	t.Helper()
	c := e.raw()
	ctx := context.Background()
	tm, err := c.Time(ctx).Result()
	require.NoError(t, err)
	v, err := c.Get(ctx, e.prefix+key).Int64()
	if errors.Is(err, redis.Nil) {
		return 0, tm.UnixMicro()
	}
	require.NoError(t, err)
	return v, tm.UnixMicro()
}

// goroutines returns the count now, after a short settle.
func goroutines() int {
	runtime.GC()
	time.Sleep(20 * time.Millisecond)
	return runtime.NumGoroutine()
}

// settled waits (up to 5 s: a grace period for goroutines that end with a
// timer of their own, a give-back's second, say) for the goroutine count
// to come back to at most base+slack, and fails with the stacks if not.
func settled(t *testing.T, base, slack int, what string) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	n := runtime.NumGoroutine()
	for n > base+slack && time.Now().Before(deadline) {
		time.Sleep(50 * time.Millisecond)
		n = runtime.NumGoroutine()
	}
	if n > base+slack {
		buf := make([]byte, 1<<20)
		t.Errorf("%s: %d goroutines 5 s after everything was closed, %d before:\n%s", what, n, base, buf[:runtime.Stack(buf, true)])
	}
}

// timed runs f and returns how long it took.
func timed(f func()) time.Duration {
	t0 := time.Now()
	f()
	return time.Since(t0)
}

// gcraTAT replays events (sorted by time) through a textbook GCRA from
// an empty key, one unit at a time (TAT = max(TAT, t) + I), and returns
// the final TAT in microseconds.
func gcraTAT(events []gcraEvent, interval time.Duration) int64 {
	ev := slices.Clone(events)
	slices.SortStableFunc(ev, func(a, b gcraEvent) int { return cmp.Compare(a.at, b.at) })
	var tat int64
	for _, e := range ev {
		for range e.n {
			tat = max(tat, e.at) + interval.Microseconds()
		}
	}
	return tat
}

// --- reserve ------------------------------------------------------------

// TestReviewAWLimiterStopped: a Limiter without fallback, its server
// stopped. Every operation returns an error matching
// throttle.ErrUnavailable, within the documented bound (the engine's
// timeout, four times it for a probe, plus a give-back's second) measured
// against the same call with Redis up; Wait on a reservation booked before
// the outage still sleeps to its slot (no Redis call); after Restart
// (state lost: no persistence) the limiter books again, a Cancel of a
// pre-outage booking is safe (gives nothing, lets nothing through early),
// and the new bookings replay through a textbook GCRA.
func TestReviewAWLimiterStopped(t *testing.T) {
	e := newAwEnv(t)
	const T = 200 * time.Millisecond
	limit := throttle.PerSecond(1, 1) // I = 1 s, tau = 1 s: slots still to come while Redis is away
	eng := e.engine(t, e.srv.Addr, T)
	base := goroutines()
	lim, err := reserve.New(eng, "aw", limit)
	require.NoError(t, err)
	ctx := context.Background()

	// Control: the same calls with Redis up.
	var before []*reserve.Reservation
	control := timed(func() {
		for range 4 { // +0, +0, +1 s, +2 s
			r, err := lim.Reserve(ctx, "k")
			require.NoError(t, err)
			require.True(t, r.OK())
			before = append(before, r)
		}
	})
	t.Logf("control: 4 bookings with Redis up took %v", control)

	e.srv.Stop()
	bound := 4*T + time.Second + 10*control // the documented bound, generously

	type op struct {
		name string
		f    func(context.Context) error
	}
	ops := []op{
		{"ReserveN", func(c context.Context) error { _, err := lim.ReserveN(c, "k", 1); return err }},
		{"ReserveWithin", func(c context.Context) error { _, err := lim.ReserveWithin(c, "k", 1, time.Second); return err }},
		{"AllowN", func(c context.Context) error { _, err := lim.AllowN(c, "k", 1); return err }},
		{"AcquireN", func(c context.Context) error { return lim.AcquireN(c, "k", 1) }},
		{"State", func(c context.Context) error { _, err := lim.State(c, "k"); return err }},
		{"Pause", func(c context.Context) error { return lim.Pause(c, "k", time.Second) }},
		{"Reset", func(c context.Context) error { return lim.Reset(c, "other") }},
		{"ReserveBatch", func(c context.Context) error {
			_, err := lim.ReserveBatch(c, "k", []reserve.BatchRequest{{N: 1}, {N: 1}})
			return err
		}},
		{"Cancel", func(c context.Context) error { return before[3].Cancel(c) }},
	}
	for round := range 2 { // the first with the breaker closed, then open
		for _, o := range ops {
			c, cancel := context.WithTimeout(ctx, 2*time.Second)
			var err error
			d := timed(func() { err = o.f(c) })
			cancel()
			assert.ErrorIs(t, err, throttle.ErrUnavailable, "round %d: %s with Redis stopped", round, o.name)
			assert.Less(t, d, bound, "round %d: %s with Redis stopped took %v", round, o.name, d)
		}
	}
	// A concurrent burst of coalesced callers: every one answered, in bound.
	var wg sync.WaitGroup
	var slow atomic.Int64
	var errs atomic.Int64
	for range 40 {
		wg.Go(func() {
			c, cancel := context.WithTimeout(ctx, 300*time.Millisecond)
			defer cancel()
			var err error
			d := timed(func() { _, err = lim.Reserve(c, "k") })
			if !errors.Is(err, throttle.ErrUnavailable) && !errors.Is(err, context.DeadlineExceeded) {
				errs.Add(1)
				t.Errorf("coalesced caller with Redis stopped: %v", err)
			}
			if d > bound {
				slow.Add(1)
			}
		})
	}
	wg.Wait()
	assert.Zero(t, slow.Load(), "coalesced callers over the bound %v", bound)

	// Wait on a reservation booked before the outage: no Redis call, sleeps
	// until the slot.
	wctx, wcancel := context.WithTimeout(ctx, 2*time.Second)
	require.NoError(t, before[2].Wait(wctx), "Wait of a booking made before the outage")
	wcancel()

	e.srv.Restart(t)
	// The scripts are gone with the restart: a burst of concurrent callers
	// on six keys (coalesced, merged) finds NOSCRIPT on every script it
	// uses. Each is booked once: each key's TAT is its replay's.
	redistest.UntilOK(t, func() error { _, err := lim.State(ctx, "z"); return err })
	var bmu sync.Mutex
	burst := map[string][]gcraEvent{}
	for i := range 60 {
		key := "b" + string(rune('0'+i%6))
		wg.Go(func() {
			r, err := lim.Reserve(ctx, key)
			if err != nil || !r.OK() {
				t.Errorf("burst after the restart, key %s: %v %v", key, err, r)
				return
			}
			bmu.Lock()
			burst[key] = append(burst[key], gcraEvent{name: key, at: r.Booking().At.UnixMicro(), n: 1})
			bmu.Unlock()
		})
	}
	wg.Wait()
	for key, ev := range burst {
		tat, _ := e.tat(t, "aw:{"+key+"}")
		assert.Equal(t, gcraTAT(ev, limit.Interval()), tat, "key %s after the burst: %d bookings", key, len(ev))
		assert.Empty(t, earlyEvents(ev, limit.Interval(), limit.Interval()), "key %s", key)
	}
	var r0 *reserve.Reservation
	redistest.UntilOK(t, func() error {
		var err error
		r0, err = lim.Reserve(ctx, "k")
		return err
	})
	require.True(t, r0.OK())
	// The pre-outage booking's Cancel, retried as its error invites: safe.
	redistest.UntilOK(t, func() error { return before[3].Cancel(ctx) })
	var rs []*reserve.Reservation
	for range 4 {
		r, err := lim.Reserve(ctx, "k")
		require.NoError(t, err)
		require.True(t, r.OK())
		rs = append(rs, r)
	}
	events := []gcraEvent{live(t, "r0", r0)}
	for i, r := range rs {
		events = append(events, live(t, "r"+string(rune('1'+i)), r))
	}
	require.Empty(t, earlyEvents(events, limit.Interval(), time.Duration(limit.Burst)*limit.Interval()),
		"bookings after the restart%s", offsets(events))
	// The key's TAT is the replay's: nothing booked twice or lost.
	tat, _ := e.tat(t, "aw:{k}")
	assert.Equal(t, gcraTAT(events, limit.Interval()), tat, "TAT after the restart's bookings%s", offsets(events))

	e.closeAll()
	settled(t, base, 2, "limiter with Redis stopped")
}

// TestReviewAWFallbacksStopped: FailOpen, FailClosed and LocalShare (a
// layered limit) while the server is stopped, and once it is back. The
// fallback answers within the bound; FailClosed refuses with a
// *FallbackError matching ErrUnavailable and a retry-after; FailOpen and
// LocalShare admit no more than the (share of the) limit locally; State
// does not consult the fallback; a fallback reservation's Cancel after
// Redis is back makes no Redis call and does not touch the shared key;
// once the breaker closes the answers come from Redis again.
func TestReviewAWFallbacksStopped(t *testing.T) {
	e := newAwEnv(t)
	const T = 200 * time.Millisecond
	limit := throttle.PerSecond(10, 2) // I = 100 ms, burst 2
	day := throttle.Every(time.Minute, 5, 0)
	eng := e.engine(t, e.srv.Addr, T)
	base := goroutines()
	ctx := context.Background()
	open, err := reserve.New(eng, "awopen", limit, reserve.WithFallback(reserve.FailOpen()))
	require.NoError(t, err)
	closed, err := reserve.New(eng, "awclosed", limit, reserve.WithFallback(reserve.FailClosed()))
	require.NoError(t, err)
	share, err := reserve.New(eng, "awshare", limit, reserve.WithLimit(day),
		reserve.WithFallback(reserve.LocalShare(50*time.Millisecond, 1, 100)), reserve.WithMaxWait(0))
	require.NoError(t, err)
	// Bookings before the outage, and the heartbeat of LocalShare.
	for _, l := range []*reserve.Limiter{open, closed, share} {
		r, err := l.Reserve(ctx, "k")
		require.NoError(t, err)
		require.True(t, r.OK())
		require.False(t, r.Fallback())
	}
	time.Sleep(60 * time.Millisecond)
	_, _ = share.Reserve(ctx, "k2") // a heartbeat goes out
	time.Sleep(50 * time.Millisecond)

	e.srv.Stop()
	bound := 4*T + time.Second

	// FailClosed: refused, not an error.
	for i := range 3 {
		var r *reserve.Reservation
		d := timed(func() { r, err = closed.Reserve(ctx, "k") })
		require.NoError(t, err, "FailClosed Reserve %d", i)
		require.False(t, r.OK())
		require.True(t, r.Fallback())
		var fe *reserve.FallbackError
		require.ErrorAs(t, r.Err(), &fe)
		require.ErrorIs(t, r.Err(), throttle.ErrUnavailable)
		assert.Less(t, d, bound)
		res, err := closed.Allow(ctx, "k")
		require.NoError(t, err)
		assert.False(t, res.Allowed, "FailClosed Allow")
		require.Error(t, r.Wait(ctx), "a refusal's Wait")
	}

	// FailOpen: the full limit locally, spaced: 3 at once, then refused
	// with max wait 0 (a view), a reservation waits within its budget.
	openNow, err := open.With(reserve.WithMaxWait(0))
	require.NoError(t, err)
	admitted := 0
	for range 10 {
		r, err := openNow.Reserve(ctx, "fresh")
		require.NoError(t, err)
		require.True(t, r.Fallback())
		if r.OK() {
			admitted++
		}
	}
	assert.Equal(t, limit.Burst+1, admitted, "FailOpen admitted at once on a fresh key (burst+1 wanted)")
	var fbRes []*reserve.Reservation
	for range 3 {
		r, err := open.Reserve(ctx, "k")
		require.NoError(t, err)
		require.True(t, r.OK(), "FailOpen without max wait books locally: %v", r.Err())
		require.True(t, r.Fallback())
		fbRes = append(fbRes, r)
	}
	// State does not consult the fallback.
	_, err = open.State(ctx, "k")
	require.ErrorIs(t, err, throttle.ErrUnavailable, "State while Redis is stopped")

	// LocalShare with a layered limit (5 a minute): at most 5 pass
	// locally, whatever the per-second limit allows.
	passed := 0
	for range 12 {
		r, err := share.Reserve(ctx, "layered")
		require.NoError(t, err)
		require.True(t, r.Fallback())
		if r.OK() {
			passed++
		}
		time.Sleep(110 * time.Millisecond / 4)
	}
	assert.LessOrEqual(t, passed, day.Burst+1+0, "LocalShare passed %d under 5/min with burst 0 (one unit at once)", passed)

	e.srv.Restart(t)
	redistest.UntilOK(t, func() error {
		r, err := open.Reserve(ctx, "probe")
		if err != nil {
			return err
		}
		if r.Fallback() {
			return errors.New("still the fallback's answer")
		}
		return nil
	})
	// The fallback's reservations, cancelled now: no Redis call, no key.
	for _, r := range fbRes {
		require.NoError(t, r.Cancel(ctx))
	}
	tat, _ := e.tat(t, "awopen:{k}")
	assert.Zero(t, tat, "the shared key after cancelling fallback reservations (none booked since the restart)")
	r, err := closed.Reserve(ctx, "k")
	require.NoError(t, err)
	require.True(t, r.OK())
	require.False(t, r.Fallback(), "FailClosed once Redis is back")

	e.closeAll()
	settled(t, base, 2, "fallbacks with Redis stopped")
}

// TestReviewAWClientPauseRefund: CLIENT PAUSE ALL (from a client of its
// own) while a Cancel and a Reserve are out. Both fail with
// ErrUnavailable and ErrReplyLost within the engine's timeout (ctx shorter
// than it does not cut the Reserve short, as documented), and may run in
// Redis once the pause ends. The Cancel, retried as its error invites,
// gives nothing more; the key's TAT shows each of them ran at most once.
func TestReviewAWClientPauseRefund(t *testing.T) {
	e := newAwEnv(t)
	const T = 150 * time.Millisecond
	limit := throttle.PerSecond(1, 0) // I = 1 s
	I := limit.Interval()
	engA := e.engine(t, e.srv.Addr, T)
	engB := e.engine(t, e.srv.Addr, T)
	engC := e.engine(t, e.srv.Addr, T)
	base := goroutines()
	limA, err := reserve.New(engA, "aw", limit)
	require.NoError(t, err)
	limB, err := reserve.New(engB, "aw", limit)
	require.NoError(t, err)
	limC, err := reserve.New(engC, "aw", limit)
	require.NoError(t, err)
	ctx := context.Background()
	var rs []*reserve.Reservation
	for range 3 { // +0, +1 s, +2 s
		r, err := limA.Reserve(ctx, "k")
		require.NoError(t, err)
		require.True(t, r.OK())
		rs = append(rs, r)
	}
	r3 := rs[2]
	// Make sure B's connection is open, so that its call is sent, not dialled.
	_, err = limB.State(ctx, "k")
	require.NoError(t, err)
	_, err = limC.State(ctx, "k")
	require.NoError(t, err)

	const pause = 900 * time.Millisecond
	paused := time.Now()
	e.clientPause(t, pause)
	var cerr, berr, xerr error
	dc := timed(func() { cerr = r3.Cancel(ctx) })
	db := timed(func() { _, berr = limB.Reserve(ctx, "k") })
	// A caller whose ctx (80 ms) is shorter than the engine's timeout: its
	// call is not cut short by it (its max wait, 80 ms, makes Redis refuse
	// it when it runs). The ctx must not end before the call is sent (one
	// past its deadline is refused unsent): it was 30 ms, which a stall of
	// 40 ms between here and the send broke.
	const shortCtx = 80 * time.Millisecond
	short, cancel := context.WithTimeout(ctx, shortCtx)
	dx := timed(func() { _, xerr = limC.Reserve(short, "k") })
	cancel()
	t.Logf("during the pause: Cancel %v in %v; Reserve %v in %v; Reserve (ctx %v) %v in %v", cerr, dc, berr, db, shortCtx, xerr, dx)
	require.ErrorIs(t, cerr, throttle.ErrUnavailable)
	require.ErrorIs(t, cerr, throttle.ErrReplyLost)
	require.ErrorIs(t, berr, throttle.ErrReplyLost, "the Reserve was sent: its reply lost")
	require.ErrorIs(t, xerr, throttle.ErrReplyLost, "the short Reserve was sent: its reply lost")
	for _, d := range []time.Duration{dc, db, dx} {
		assert.Less(t, d, 4*T+time.Second+500*time.Millisecond, "bound: engine timeout (4x for a probe) plus a give-back's second")
	}
	// It ran to the engine's timeout (T after it was sent), past its ctx.
	assert.GreaterOrEqual(t, dx, (shortCtx+T)/2, "the Reserve's ctx (%v) cut its call short, sooner than the engine's timeout", shortCtx)

	time.Sleep(time.Until(paused.Add(pause + 200*time.Millisecond)))
	redistest.UntilOK(t, func() error { return r3.Cancel(ctx) })
	tat, now := e.tat(t, "aw:{k}")
	r2 := rs[1].Booking().At.UnixMicro()
	z, a, b := r2+I.Microseconds(), r2+2*I.Microseconds(), r2+3*I.Microseconds()
	t.Logf("TAT after the pause: r2+%v (now r2+%v)", time.Duration(tat-r2)*time.Microsecond, time.Duration(now-r2)*time.Microsecond)
	// Redis drops a paused client's command when the client has closed
	// the connection (go-redis closes it on a timeout): the lost Reserve
	// may never have run.
	assert.True(t, tat == z || tat == a || tat == b, "TAT r2+%v: want r2+1s (r3 given back, the lost Reserve dropped), r2+2s (r3 given back, the lost Reserve in its room) or r2+3s (the lost Reserve above r3, refund gave nothing)",
		time.Duration(tat-r2)*time.Microsecond)
	// A booking now lands at TAT: nothing left booked twice or given twice.
	r, err := limA.Reserve(ctx, "k")
	require.NoError(t, err)
	assert.Equal(t, tat, r.Booking().At.UnixMicro(), "the next slot")
	e.closeAll()
	settled(t, base, 2, "CLIENT PAUSE")
}

// TestReviewAWProxyHeldAndSevered: replies held by a proxy past the
// engine's timeout, then connections severed, under 24 concurrent
// coalesced callers. Every caller returns an error matching
// ErrUnavailable within the bound; afterwards the key holds no more than
// the units that were asked for (each request sent at most once: the
// engine never retries a call that may have run), and a fresh caller is
// served.
func TestReviewAWProxyHeldAndSevered(t *testing.T) {
	e := newAwEnv(t)
	const T = 150 * time.Millisecond
	limit := throttle.PerSecond(10, 0) // I = 100 ms
	I := limit.Interval()
	e.engine(t, e.srv.Addr, time.Second) // loads the scripts
	p := redistest.NewProxy(t, e.srv.Addr)
	eng := e.engine(t, p.Addr(), T)
	base := goroutines()
	lim, err := reserve.New(eng, "aw", limit)
	require.NoError(t, err)
	ctx := context.Background()
	r0, err := lim.Reserve(ctx, "k")
	require.NoError(t, err)
	start := r0.Booking().At.UnixMicro()

	for _, mode := range []string{"held", "severed"} {
		p.SetReplyDelay(400 * time.Millisecond)
		if mode == "severed" {
			go func() { time.Sleep(40 * time.Millisecond); p.Sever() }()
		}
		var wg sync.WaitGroup
		var over, wrong atomic.Int64
		for range 24 {
			wg.Go(func() {
				c, cancel := context.WithTimeout(ctx, 2*time.Second)
				defer cancel()
				var err error
				d := timed(func() { _, err = lim.Reserve(c, "k") })
				if !errors.Is(err, throttle.ErrUnavailable) {
					wrong.Add(1)
					t.Errorf("%s: caller got %v", mode, err)
				}
				if d > 4*T+time.Second+500*time.Millisecond {
					over.Add(1)
					t.Errorf("%s: caller took %v", mode, d)
				}
			})
		}
		wg.Wait()
		p.SetReplyDelay(0)
		time.Sleep(500 * time.Millisecond) // the held replies drain
		redistest.UntilOK(t, func() error {
			_, err := lim.State(ctx, "k")
			return err
		})
	}
	tat, now := e.tat(t, "aw:{k}")
	// At most 1 + 2*24 units ever booked on the key (each caller's
	// request sent at most once), from r0's slot on.
	maxTAT := max(start, now-2*time.Second.Microseconds()) + int64(1+48)*I.Microseconds()
	t.Logf("TAT after: start+%v, now start+%v", time.Duration(tat-start)*time.Microsecond, time.Duration(now-start)*time.Microsecond)
	assert.LessOrEqual(t, tat, start+int64(1+48)*I.Microseconds(), "more booked than was asked for (a request run twice)")
	_ = maxTAT
	redistest.UntilOK(t, func() error {
		r, err := lim.Reserve(ctx, "k")
		if err == nil && !r.OK() {
			return r.Err()
		}
		return err
	})
	e.closeAll()
	p.Close()
	settled(t, base, 2, "proxy held and severed")
}

// TestReviewAWLatencyShortDeadline: 40 ms of latency each way; callers
// whose ctx deadline (30 ms) ends before the reply (a round trip of about
// 80 ms, the control, measured with a Ping through the same proxy) get
// the context's error once the reply is in, and the slot booked for each
// is given back: one caller at a time, the key is idle after each.
// Measured against the control: each returns within a few round trips
// plus the give-back, never cut at its 30 ms.
func TestReviewAWLatencyShortDeadline(t *testing.T) {
	e := newAwEnv(t)
	limit := throttle.PerSecond(2, 0) // I = 500 ms
	e.engine(t, e.srv.Addr, time.Second)
	p := redistest.NewProxy(t, e.srv.Addr)
	eng := e.engine(t, p.Addr(), time.Second)
	pc := e.client(p.Addr())
	base := goroutines()
	lim, err := reserve.New(eng, "aw", limit)
	require.NoError(t, err)
	ctx := context.Background()
	p.SetLatency(40 * time.Millisecond)
	rtt := timed(func() { require.NoError(t, pc.Ping(ctx).Err()) })
	rtt = min(rtt, timed(func() { require.NoError(t, pc.Ping(ctx).Err()) }))
	t.Logf("control round trip: %v", rtt)

	for i := range 4 {
		c, cancel := context.WithTimeout(ctx, 30*time.Millisecond)
		var err error
		d := timed(func() { _, err = lim.Reserve(c, "k") })
		cancel()
		require.ErrorIs(t, err, context.DeadlineExceeded, "caller %d", i)
		assert.Less(t, d, 4*rtt+time.Second, "caller %d took %v", i, d)
		tat, now := e.tat(t, "aw:{k}")
		assert.LessOrEqual(t, tat, now, "caller %d: the key holds a booking %v ahead after its caller got its context's error", i, time.Duration(tat-now)*time.Microsecond)
	}
	// Acquire cut while sleeping: the booking goes back.
	r, err := lim.Reserve(ctx, "k") // slot now
	require.NoError(t, err)
	_ = r
	c, cancel := context.WithCancel(ctx)
	time.AfterFunc(150*time.Millisecond, cancel) // after the reply, well before the slot
	err = lim.Acquire(c, "k")                    // its slot is 500 ms away
	cancel()
	require.ErrorIs(t, err, context.Canceled)
	tat, _ := e.tat(t, "aw:{k}")
	assert.Equal(t, r.Booking().At.Add(limit.Interval()).UnixMicro(), tat, "TAT after an Acquire cut while sleeping: its slot given back")

	// Check mode, and batches, whose contexts end while the call is out,
	// on a limiter with a burst (5 units at once).
	bl, err := reserve.New(eng, "awb", throttle.PerSecond(2, 4))
	require.NoError(t, err)
	idle := func(what string) {
		t.Helper()
		var tat, now int64
		ok := assert.Eventually(t, func() bool {
			tat, now = e.tat(t, "awb:{k}")
			return tat <= now
		}, 2*time.Second, 10*time.Millisecond)
		if !ok {
			t.Errorf("%s: the key holds %v ahead", what, time.Duration(tat-now)*time.Microsecond)
		}
	}
	c, cancel = context.WithTimeout(ctx, 30*time.Millisecond)
	var aerr error
	d := timed(func() { _, aerr = bl.AllowN(c, "k", 2) })
	cancel()
	assert.ErrorIs(t, aerr, context.DeadlineExceeded, "AllowN whose ctx ended while the call was out")
	assert.Less(t, d, 4*rtt+time.Second)
	idle("AllowN (what it counted goes back)")
	// The batch's deadlines are 60 ms, not 30: a request whose deadline
	// has passed before ReserveBatch reads the clock is refused unsent and
	// holds nothing, so 30 ms was all a stall could take before the call
	// (a 40 ms stall broke "holds its booking"). The reply still comes
	// after the deadline whatever the stalls: it takes at least the two
	// 40 ms legs of the proxy from the call's start.
	for _, hold := range []bool{false, true} {
		reqs := make([]reserve.BatchRequest, 3)
		var cancels []context.CancelFunc
		for i := range reqs {
			c, cancel := context.WithTimeout(ctx, 60*time.Millisecond)
			cancels = append(cancels, cancel)
			reqs[i] = reserve.BatchRequest{Context: c, N: 1, HoldLate: hold}
		}
		rs, err := bl.ReserveBatch(ctx, "k", reqs)
		for _, cancel := range cancels {
			cancel()
		}
		require.NoError(t, err)
		for i, r := range rs {
			assert.False(t, r.OK(), "hold %v: request %d", hold, i)
			assert.True(t, errors.Is(r.Err(), context.DeadlineExceeded) || errors.Is(r.Err(), reserve.ErrWouldExceedDeadline),
				"hold %v: request %d: %v", hold, i, r.Err())
			assert.Equal(t, hold, r.Booking().OK, "hold %v: request %d holds its booking", hold, i)
		}
		if hold {
			for i := len(rs) - 1; i >= 0; i-- {
				require.NoError(t, rs[i].Cancel(ctx))
			}
		}
		idle("ReserveBatch, contexts ended in flight, hold " + map[bool]string{false: "false", true: "true"}[hold])
	}
	p.SetLatency(0)
	e.closeAll()
	p.Close()
	settled(t, base, 2, "latency")
}

// --- pool ---------------------------------------------------------------

// TestReviewAWPoolStopped: a Pool with its server stopped. Submitted jobs
// end with an error matching ErrUnavailable without running; Acquire
// returns one, holding nothing; each in bound. After Restart no worker is
// missing (Workers() concurrent Acquire callers all get theirs), jobs run;
// Close is bounded; afterwards Submit and Acquire fail with ErrClosed; no
// goroutine is left.
func TestReviewAWPoolStopped(t *testing.T) {
	e := newAwEnv(t)
	const T = 200 * time.Millisecond
	limit := throttle.PerSecond(20, 4)
	eng := e.engine(t, e.srv.Addr, T)
	base := goroutines()
	lim, err := reserve.New(eng, "aw", limit)
	require.NoError(t, err)
	p, err := pool.New(lim, pool.WithWorkers(3))
	require.NoError(t, err)
	ctx := context.Background()
	// Up first.
	j, err := p.Submit(ctx, "k", func(context.Context) error { return nil })
	require.NoError(t, err)
	require.NoError(t, j.Wait(ctx))

	e.srv.Stop()
	bound := 4*T + time.Second
	var ran atomic.Int64
	var jobs []*pool.Job
	for range 6 {
		j, err := p.Submit(ctx, "k", func(context.Context) error { ran.Add(1); return nil })
		require.NoError(t, err)
		jobs = append(jobs, j)
	}
	for i, j := range jobs {
		c, cancel := context.WithTimeout(ctx, 10*time.Second)
		err := j.Wait(c)
		cancel()
		assert.ErrorIs(t, err, throttle.ErrUnavailable, "job %d with Redis stopped", i)
	}
	assert.Zero(t, ran.Load(), "jobs ran with Redis stopped (no fallback)")
	for i := range 4 {
		var rel func()
		d := timed(func() { rel, err = p.Acquire(ctx, "k") })
		assert.ErrorIs(t, err, throttle.ErrUnavailable, "Acquire %d with Redis stopped", i)
		assert.Nil(t, rel)
		assert.Less(t, d, bound, "Acquire %d took %v", i, d)
	}

	e.srv.Restart(t)
	redistest.UntilOK(t, func() error {
		j, err := p.Submit(ctx, "k", func(context.Context) error { return nil })
		if err != nil {
			return err
		}
		return j.Wait(ctx)
	})
	// Every worker is there: Workers() callers at once.
	var rels []func()
	var mu sync.Mutex
	var wg sync.WaitGroup
	for range p.Workers() {
		wg.Go(func() {
			c, cancel := context.WithTimeout(ctx, 5*time.Second)
			defer cancel()
			rel, err := p.Acquire(c, "k")
			if err != nil {
				t.Errorf("Acquire after the restart: %v", err)
				return
			}
			mu.Lock()
			rels = append(rels, rel)
			mu.Unlock()
		})
	}
	wg.Wait()
	require.Len(t, rels, p.Workers())
	for _, rel := range rels[1:] {
		rel()
	}
	// Close with one Acquire caller still holding its worker (it acted):
	// bounded, and its release afterwards is harmless.
	d := timed(func() {
		c, cancel := context.WithTimeout(ctx, 10*time.Second)
		defer cancel()
		require.NoError(t, p.Close(c))
	})
	assert.Less(t, d, bound, "Close took %v", d)
	rels[0]()
	rels[0]()
	_, err = p.Submit(ctx, "k", func(context.Context) error { return nil })
	assert.ErrorIs(t, err, pool.ErrClosed, "Submit after Close")
	_, err = p.Acquire(ctx, "k")
	assert.ErrorIs(t, err, pool.ErrClosed, "Acquire after Close")
	e.closeAll()
	settled(t, base, 2, "pool with Redis stopped")
}

// TestReviewAWPoolClosePaused (see the file's comment): Close with
// Redis paused (SIGSTOP) and
// bookings outstanding (jobs booked ahead, an Acquire caller sleeping
// until its slot). How long does Close take, against the number of
// bookings it must give back, with an engine timeout a remote Redis would
// want (300 ms: its probe, four times it, outlasts a give-back's second)?
// And once Redis is back: the Acquire caller got ErrClosed at once, the
// jobs not started ended with ErrClosed, and nothing left behind.
func TestReviewAWPoolClosePaused(t *testing.T) {
	e := newAwEnv(t)
	const T = time.Second
	limit := throttle.PerSecond(2, 0) // I = 500 ms: slots well ahead
	m, err := metrics.New()
	require.NoError(t, err)
	reg := prometheus.NewRegistry()
	require.NoError(t, reg.Register(m))
	eng := e.engine(t, e.srv.Addr, T, throttle.WithObserver(m))
	base := goroutines()
	ctx := context.Background()
	var took []time.Duration
	for _, workers := range []int{2, 8} {
		lim, err := reserve.New(eng, "aw"+string(rune('a'+workers)), limit)
		require.NoError(t, err)
		p, err := pool.New(lim, pool.WithWorkers(workers))
		require.NoError(t, err)
		var jobs []*pool.Job
		for range workers - 1 {
			j, err := p.Submit(ctx, "k", func(context.Context) error { return nil })
			require.NoError(t, err)
			jobs = append(jobs, j)
		}
		// Wait for the batch to be booked: the key's TAT moves on.
		key := lim.Name() + ":{k}"
		var booked int64 // the TAT once the jobs are booked
		ahead := false
		// Polled, not assert.Eventually, which would fail the test before
		// it could be skipped below.
		for until := time.Now().Add(5 * time.Second); time.Now().Before(until); time.Sleep(5 * time.Millisecond) {
			tat, now := e.tat(t, key)
			booked = tat
			if ahead = tat >= now+int64(workers-3)*limit.Interval().Microseconds(); ahead {
				break
			}
		}
		if !ahead {
			// Seen in busy runs, in the second round: the jobs were booked
			// one or a few at a time as they came, and all ran, one
			// interval apart, within the 5 s: no booking stood far ahead
			// to give back at Close. No scene then; anything else fails.
			ran := 0
			for i, j := range jobs {
				select {
				case <-j.Done():
					t.Logf("workers %d: job %d done: %v", workers, i, j.Err())
					if j.Err() == nil {
						ran++
					}
				default:
					t.Logf("workers %d: job %d not done", workers, i)
				}
			}
			if ran == len(jobs) {
				// Closed first: a pool skipped over would leave its
				// dispatcher behind for the package's end-of-run
				// goroutine check (seen once in a busy run, stop 49).
				require.NoError(t, p.Close(ctx))
				t.Skipf("workers %d: the jobs ran before the pool held bookings ahead: no scene", workers)
			}
			t.Fatalf("workers %d: the key's TAT never stood %d intervals ahead", workers, workers-3)
		}
		time.Sleep(50 * time.Millisecond)
		booked, _ = e.tat(t, key)
		// An Acquire caller sleeping until its slot.
		acq := make(chan error, 1)
		var accDone atomic.Int64
		go func() {
			rel, err := p.Acquire(ctx, "k")
			accDone.Store(time.Now().UnixNano())
			if rel != nil {
				rel()
			}
			acq <- err
		}()
		require.Eventually(t, func() bool {
			tat, _ := e.tat(t, key)
			return tat > booked
		}, 5*time.Second, 5*time.Millisecond)
		time.Sleep(20 * time.Millisecond)

		_, stopAt := e.tat(t, key) // the Redis clock as Redis stops, in µs
		require.NoError(t, syscall.Kill(e.srv.Pid(), syscall.SIGSTOP))
		closeAt := time.Now()
		c, cancel := context.WithTimeout(ctx, 20*time.Second)
		var cerr error
		d := timed(func() { cerr = p.Close(c) })
		cancel()
		breaker := awMetric(t, reg, "slotbook_breaker_open", nil)
		errsN := awMetric(t, reg, "slotbook_redis_errors_total", nil)
		require.NoError(t, syscall.Kill(e.srv.Pid(), syscall.SIGCONT))
		t.Logf("workers %d: after Close with Redis paused: breaker gauge %v, failed calls so far %v", workers, breaker, errsN)
		took = append(took, d)
		aerr := <-acq
		t.Logf("workers %d: %d bookings not started at Close (the first job ran at once); Close with Redis paused took %v (%v); Acquire caller returned %v after Close began: %v",
			workers, workers-1, d, cerr, time.Duration(accDone.Load()-closeAt.UnixNano()), aerr)
		assert.NoError(t, cerr)
		if aerr == nil && accDone.Load() < closeAt.UnixNano() {
			// Its slot came before Close began (a busy machine, as for
			// the jobs below): it was no longer sleeping at Close.
			t.Logf("workers %d: the Acquire caller's slot came before Close: no sleeping caller to judge", workers)
		} else {
			assert.ErrorIs(t, aerr, pool.ErrClosed, "an Acquire caller sleeping until its slot when the pool closed")
			assert.Less(t, time.Duration(accDone.Load()-closeAt.UnixNano()), time.Second, "the sleeping Acquire caller got ErrClosed 'at once'")
		}
		for i, j := range jobs {
			if i == 0 {
				continue // may have run
			}
			if j.Err() == nil && !j.Started().IsZero() {
				// It ran: setting the scene (the bookings, the Acquire
				// caller's) can take longer than an interval on a busy
				// machine (seen once: job 1, its slot 500 ms in, ran). Its
				// slot must have come by the time Close began, as the
				// Redis clock tells it (plus 100 ms for the steps between
				// the reading and Close; the slots lie 500 ms apart).
				at := j.Reservation().Booking().At.UnixMicro()
				t.Logf("workers %d: job %d ran before Close: its slot %v before Redis stopped", workers, i, time.Duration(stopAt-at)*time.Microsecond)
				assert.LessOrEqual(t, at, stopAt+(100*time.Millisecond).Microseconds(), "job %d ran, its slot not come when Close began", i)
				continue
			}
			assert.ErrorIs(t, j.Err(), pool.ErrClosed, "job %d booked ahead at Close", i)
		}
		redistest.UntilOK(t, func() error { _, err := lim.State(ctx, "k"); return err })
	}
	// Close's time grows with what it must give back, about a second each
	// while Redis does not answer (found here, 7 s for 7). Stopping at the
	// first give-back without an answer was tried and dropped (it lost
	// room to healthy nodes and to a slow Redis: helper-113's
	// review_changes42_test.go); the pool's Close doc now says so, and
	// that the caller bounds Close with its ctx. What holds: a second per
	// booking, no more.
	assert.Less(t, took[1], 7*time.Second+2*time.Second, "Close with Redis paused: %v with 1 booking to give back, %v with 7 (engine timeout %v): at most a second each", took[0], took[1], T)
	e.closeAll()
	settled(t, base, 2, "pool Close with Redis paused")
}

// --- lease --------------------------------------------------------------

// TestReviewAWLeaseStopped: a Semaphore with its server stopped. A held
// lease's Lost closes within the TTL of its last extension (9/10 of it,
// plus timer slack); Acquire and TryAcquire fail with ErrUnavailable in
// bound; Release fails or reports ErrLost; Close returns in bounded time;
// afterwards Acquire fails with ErrClosed, and no goroutine is left.
// After Restart a new Semaphore grants all N places.
func TestReviewAWLeaseStopped(t *testing.T) {
	e := newAwEnv(t)
	const T = 200 * time.Millisecond
	const ttl = 900 * time.Millisecond
	eng := e.engine(t, e.srv.Addr, T)
	calls := callcount.Attach(eng.Client().(*redis.Client))
	base := goroutines()
	ctx := context.Background()
	sem, err := lease.New(eng, "aw", 2, lease.WithTTL(ttl))
	require.NoError(t, err)
	l1, err := sem.Acquire(ctx, "k")
	require.NoError(t, err)
	acquired := time.Now()
	l2, err := sem.Acquire(ctx, "k3")
	require.NoError(t, err)

	e.srv.Stop()
	stopped := time.Now()
	bound := 4*T + time.Second
	c, cancel := context.WithTimeout(ctx, 2*time.Second)
	var aerr error
	d := timed(func() { _, aerr = sem.Acquire(c, "k") })
	cancel()
	assert.ErrorIs(t, aerr, throttle.ErrUnavailable, "Acquire with Redis stopped")
	assert.Less(t, d, bound, "Acquire with Redis stopped took %v", d)
	var terr error
	d = timed(func() { _, _, terr = sem.TryAcquire(ctx, "k2") })
	assert.ErrorIs(t, terr, throttle.ErrUnavailable, "TryAcquire with Redis stopped")
	assert.Less(t, d, bound)
	select {
	case <-l1.Lost():
		t.Logf("Lost closed %v after the grant, %v after the stop", time.Since(acquired), time.Since(stopped))
	case <-time.After(ttl + 500*time.Millisecond):
		t.Errorf("Lost not closed %v after Redis stopped (TTL %v)", time.Since(stopped), ttl)
	}
	rerr := l1.Release(ctx)
	assert.Error(t, rerr, "Release of a lease Redis stopped holding")
	t.Logf("Release: %v", rerr)
	c, cancel = context.WithTimeout(ctx, 5*time.Second)
	d = timed(func() { err = sem.Close(c) })
	cancel()
	t.Logf("Close with Redis stopped: %v in %v", err, d)
	assert.Less(t, d, bound, "Close with Redis stopped took %v (%v)", d, err)
	_, err = sem.Acquire(ctx, "k")
	assert.ErrorIs(t, err, lease.ErrClosed, "Acquire after Close")
	_, _, err = sem.TryAcquire(ctx, "k")
	assert.ErrorIs(t, err, lease.ErrClosed, "TryAcquire after Close")
	select {
	case <-l2.Lost():
	default:
		t.Error("a lease Close gave back (its release failing) has Lost open")
	}
	// A no-op, as Close's doc has it: nil ("released before"), and no
	// Redis call. Judged by the outcome (a call now fails, fast, by the
	// breaker or a refused dial) and by a count of the calls that reach
	// the client, not by a 50 ms bound on its time, which a stall of
	// 50 ms broke and which such a call kept all the same.
	// l2 was granted just after l1, so its Lost timer (9/10 of the TTL
	// after its last extension) fires a few ms after l1's: a busy machine
	// can run it before Close begins (the suite beside CI, stop 50; seen
	// so with 100 ms slept before l1's Release), and Release then reports
	// the lapse, ErrLost, as its doc has it, with no Redis call either.
	before := calls.Load()
	d = timed(func() { err = l2.Release(ctx) })
	t.Logf("Release after Close: %v in %v", err, d)
	if err != nil {
		assert.ErrorIs(t, err, lease.ErrLost, "Release after Close is a no-op (or reports the lease lapsed before Close)")
	}
	assert.Equal(t, before, calls.Load(), "Release after Close makes no Redis call")

	e.srv.Restart(t)
	sem2, err := lease.New(eng, "aw", 2, lease.WithTTL(ttl))
	require.NoError(t, err)
	var held []*lease.Lease
	redistest.UntilOK(t, func() error {
		l, ok, err := sem2.TryAcquire(ctx, "k")
		if err != nil {
			return err
		}
		require.True(t, ok)
		held = append(held, l)
		return nil
	})
	l, ok, err := sem2.TryAcquire(ctx, "k")
	require.NoError(t, err)
	require.True(t, ok, "the second place after the restart")
	held = append(held, l)
	for _, l := range held {
		require.NoError(t, l.Release(ctx))
	}
	require.NoError(t, sem2.Close(ctx))
	e.closeAll()
	settled(t, base, 2, "lease with Redis stopped")
}

// TestReviewAWLeaseGhostGrant: Acquire's reply held by a proxy past the
// engine's timeout: the script ran and granted the only place (N = 1) to
// a waiter whose caller got an error. The breaker is open, so its leave
// call fails unsent, and the keeper must send it again every poll
// interval until it succeeds (package doc, Waiting). Once the replies flow
// again another process gets the place within a poll interval or so, not
// only when the TTL lets the ghost lapse; and Close leaves nothing behind.
func TestReviewAWLeaseGhostGrant(t *testing.T) {
	e := newAwEnv(t)
	const ttl = 4500 * time.Millisecond
	const poll = 500 * time.Millisecond
	e.engine(t, e.srv.Addr, time.Second) // loads the rate scripts
	p := redistest.NewProxy(t, e.srv.Addr)
	engA := e.engine(t, p.Addr(), 150*time.Millisecond)
	engB := e.engine(t, e.srv.Addr, time.Second)
	base := goroutines()
	ctx := context.Background()
	semA, err := lease.New(engA, "aw", 1, lease.WithTTL(ttl), lease.WithPollInterval(poll))
	require.NoError(t, err)
	semB, err := lease.New(engB, "aw", 1, lease.WithTTL(ttl), lease.WithPollInterval(poll))
	require.NoError(t, err)
	require.NoError(t, semA.Load(ctx))
	require.NoError(t, semB.Load(ctx))
	holders := e.prefix + "aw:{k}:lease:h"
	raw := e.raw()

	p.SetReplyDelay(400 * time.Millisecond)
	c, cancel := context.WithTimeout(ctx, 3*time.Second)
	_, aerr := semA.Acquire(c, "k")
	cancel()
	gaveUp := time.Now()
	t.Logf("Acquire with its reply held: %v", aerr)
	require.ErrorIs(t, aerr, throttle.ErrReplyLost)
	n, err := raw.ZCard(ctx, holders).Result()
	require.NoError(t, err)
	t.Logf("holders in Redis right after: %d", n)
	p.SetReplyDelay(0)

	var got *lease.Lease
	require.Eventually(t, func() bool {
		l, ok, err := semB.TryAcquire(ctx, "k")
		if err == nil && ok {
			got = l
			return true
		}
		return false
	}, ttl+time.Second, 20*time.Millisecond)
	freed := time.Since(gaveUp)
	t.Logf("another process got the place %v after the Acquire gave up (poll %v, TTL %v)", freed, poll, ttl)
	assert.Less(t, freed, ttl/2, "the ghost lease was freed only by its TTL, not by the keeper's leave")
	require.NoError(t, got.Release(ctx))
	require.NoError(t, semA.Close(ctx))
	require.NoError(t, semB.Close(ctx))
	p.Close()
	e.closeAll()
	settled(t, base, 2, "lease ghost grant")
}

// --- httplimit ------------------------------------------------------------

// awUpstream is an HTTP server that records when each request arrived
// and answers with the next status in line (200 once the line is empty).
type awUpstream struct {
	srv    *httptest.Server
	mu     sync.Mutex
	hits   []time.Time
	status []int
}

func newAwUpstream(t *testing.T) *awUpstream {
	u := &awUpstream{}
	u.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		u.mu.Lock()
		u.hits = append(u.hits, time.Now())
		code := http.StatusOK
		if len(u.status) > 0 {
			code, u.status = u.status[0], u.status[1:]
		}
		u.mu.Unlock()
		if code == http.StatusTooManyRequests {
			w.Header().Set("Retry-After", "1")
		}
		w.WriteHeader(code)
	}))
	t.Cleanup(u.srv.Close)
	return u
}

func (u *awUpstream) next(codes ...int) {
	u.mu.Lock()
	u.status = append(u.status, codes...)
	u.mu.Unlock()
}

func (u *awUpstream) count() int {
	u.mu.Lock()
	defer u.mu.Unlock()
	return len(u.hits)
}

func (u *awUpstream) last() time.Time {
	u.mu.Lock()
	defer u.mu.Unlock()
	return u.hits[len(u.hits)-1]
}

// closeBody records whether RoundTrip closed the request's body.
type closeBody struct {
	io.Reader
	closed atomic.Bool
}

func (b *closeBody) Close() error { b.closed.Store(true); return nil }

// TestReviewAWHTTPStopped: Transports over limiters without fallback,
// FailClosed and FailOpen, their server stopped. Without fallback and
// with FailClosed the request is not sent: a *NotSentError wrapping an
// ErrUnavailable (FailClosed: a *FallbackError, with a retry-after), the
// body closed, in bound. With FailOpen it is sent; a 429 it gets cannot
// be stored: the response reaches the caller, the pause error handler is
// told, within the pause timeout; the Transport's next request whose
// deadline the pause exceeds is refused at once, not sent. Then Restart,
// and a request after the pause's end goes.
func TestReviewAWHTTPStopped(t *testing.T) {
	e := newAwEnv(t)
	const T = 200 * time.Millisecond
	eng := e.engine(t, e.srv.Addr, T)
	up := newAwUpstream(t)
	base := goroutines()
	limit := throttle.PerSecond(20, 4)
	mk := func(name string, opts ...reserve.Option) *reserve.Limiter {
		l, err := reserve.New(eng, name, limit, opts...)
		require.NoError(t, err)
		return l
	}
	var pauseErrs atomic.Int64
	trNone, err := httplimit.New(mk("awnone"))
	require.NoError(t, err)
	trClosed, err := httplimit.New(mk("awclosed", reserve.WithFallback(reserve.FailClosed())))
	require.NoError(t, err)
	trOpen, err := httplimit.New(mk("awopen", reserve.WithFallback(reserve.FailOpen())),
		httplimit.WithPauseTimeout(300*time.Millisecond),
		httplimit.WithPauseErrorHandler(func(*http.Request, time.Duration, error) { pauseErrs.Add(1) }))
	require.NoError(t, err)
	hc := &http.Client{}
	do := func(tr *httplimit.Transport, ctx context.Context) (*http.Response, *closeBody, error) {
		body := &closeBody{Reader: strings.NewReader("x")}
		req, err := http.NewRequestWithContext(ctx, http.MethodPost, up.srv.URL, body)
		require.NoError(t, err)
		resp, err := tr.RoundTrip(req)
		if resp != nil {
			_, _ = io.Copy(io.Discard, resp.Body)
			_ = resp.Body.Close()
		}
		return resp, body, err
	}
	ctx := context.Background()
	// Up first: each Transport sends.
	for _, tr := range []*httplimit.Transport{trNone, trClosed, trOpen} {
		_, _, err := do(tr, ctx)
		require.NoError(t, err)
	}
	sent := up.count()

	e.srv.Stop()
	bound := 4*T + time.Second
	for name, tr := range map[string]*httplimit.Transport{"none": trNone, "FailClosed": trClosed} {
		for i := range 2 {
			var err error
			var body *closeBody
			d := timed(func() { _, body, err = do(tr, ctx) })
			var ns *httplimit.NotSentError
			require.ErrorAs(t, err, &ns, "%s %d", name, i)
			assert.ErrorIs(t, err, throttle.ErrUnavailable, "%s %d", name, i)
			assert.True(t, body.closed.Load(), "%s %d: body not closed", name, i)
			assert.Less(t, d, bound, "%s %d took %v", name, i, d)
			if name == "FailClosed" {
				var fe *reserve.FallbackError
				assert.ErrorAs(t, err, &fe)
				_, ok := ns.RetryAfter()
				assert.True(t, ok, "FailClosed's refusal carries a retry-after")
			}
		}
	}
	assert.Equal(t, sent, up.count(), "requests sent with Redis stopped and no fallback / FailClosed")

	// FailOpen: sent; a 429 that cannot be stored.
	up.next(http.StatusTooManyRequests)
	var resp *http.Response
	d := timed(func() { resp, _, err = do(trOpen, ctx) })
	require.NoError(t, err)
	learnt := up.last() // the 429 reached the upstream: its pause, learnt from the reply, begins after
	assert.Equal(t, http.StatusTooManyRequests, resp.StatusCode)
	assert.EqualValues(t, 1, pauseErrs.Load(), "the pause error handler")
	assert.Less(t, d, 300*time.Millisecond+bound, "a 429 with Redis stopped took %v", d)
	n := up.count()
	c, cancel := context.WithTimeout(ctx, 300*time.Millisecond)
	d = timed(func() { _, _, err = do(trOpen, c) })
	cancel()
	var ns *httplimit.NotSentError
	require.ErrorAs(t, err, &ns, "a request whose deadline the unstored pause exceeds")
	assert.Less(t, d, 100*time.Millisecond, "refused at once, not after waiting: %v", d)
	assert.Equal(t, n, up.count())
	// One with time: waits the pause out locally.
	c, cancel = context.WithTimeout(ctx, 3*time.Second)
	_, _, err = do(trOpen, c)
	cancel()
	require.NoError(t, err)
	assert.False(t, up.last().Before(learnt.Add(time.Second)), "sent %v after the 429, inside its 1 s pause", up.last().Sub(learnt))

	e.srv.Restart(t)
	redistest.UntilOK(t, func() error { _, _, err := do(trNone, ctx); return err })
	hc.CloseIdleConnections()
	up.srv.CloseClientConnections()
	http.DefaultTransport.(*http.Transport).CloseIdleConnections()
	e.closeAll()
	settled(t, base, 3, "httplimit with Redis stopped")
}

// TestReviewAWHTTPPauseLostAndCheck: a pause stored in Redis, then Redis
// restarted without persistence (the pause lost): the Transport that
// stored it still sends nothing before its end (lostPause, waited out
// locally). Then WithPauseCheck with Redis paused (CLIENT PAUSE) when the
// check would run: "If the check cannot reach Redis the request is sent",
// within its slot plus the engine's bound.
func TestReviewAWHTTPPauseLostAndCheck(t *testing.T) {
	e := newAwEnv(t)
	const T = 150 * time.Millisecond
	eng := e.engine(t, e.srv.Addr, T)
	up := newAwUpstream(t)
	base := goroutines()
	ctx := context.Background()
	lim, err := reserve.New(eng, "aw", throttle.PerSecond(20, 4))
	require.NoError(t, err)
	tr, err := httplimit.New(lim)
	require.NoError(t, err)
	get := func(tr *httplimit.Transport, c context.Context) error {
		req, err := http.NewRequestWithContext(c, http.MethodGet, up.srv.URL, nil)
		require.NoError(t, err)
		resp, err := tr.RoundTrip(req)
		if resp != nil {
			_, _ = io.Copy(io.Discard, resp.Body)
			_ = resp.Body.Close()
		}
		return err
	}
	up.next(http.StatusTooManyRequests)
	require.NoError(t, get(tr, ctx))
	// The 429 reached the upstream: its pause, learnt from the reply,
	// begins after.
	learnt := up.last()
	e.srv.Restart(t) // the pause, stored, is lost
	c, cancel := context.WithTimeout(ctx, 5*time.Second)
	redistest.UntilOK(t, func() error { return get(tr, c) })
	cancel()
	assert.False(t, up.last().Before(learnt.Add(time.Second)), "sent %v after the 429, inside its 1 s pause that Redis lost", up.last().Sub(learnt))

	// WithPauseCheck, Redis paused as the check goes out.
	lim2, err := reserve.New(eng, "awcheck", throttle.PerSecond(2, 0)) // I = 500 ms
	require.NoError(t, err)
	tr2, err := httplimit.New(lim2, httplimit.WithPauseCheck(true))
	require.NoError(t, err)
	require.NoError(t, get(tr2, ctx)) // slot now
	n := up.count()
	go func() { time.Sleep(150 * time.Millisecond); e.clientPause(t, 1500*time.Millisecond) }()
	var gerr error
	d := timed(func() { gerr = get(tr2, ctx) }) // slot in 500 ms, then the check
	assert.NoError(t, gerr, "a booked request whose pause check cannot reach Redis")
	assert.Equal(t, n+1, up.count(), "sent")
	assert.Less(t, d, 500*time.Millisecond+4*T+500*time.Millisecond, "request with its check unanswered took %v", d)
	time.Sleep(1500 * time.Millisecond)
	up.srv.CloseClientConnections()
	http.DefaultTransport.(*http.Transport).CloseIdleConnections()
	e.closeAll()
	settled(t, base, 3, "httplimit pause lost and check")
}

// --- metrics --------------------------------------------------------------

// awMetric returns the value of the metric named name whose labels hold
// every pair of want (a counter's or a gauge's), summed, from reg.
func awMetric(t *testing.T, reg *prometheus.Registry, name string, want map[string]string) float64 {
	t.Helper()
	fams, err := reg.Gather()
	require.NoError(t, err)
	var sum float64
	for _, f := range fams {
		if f.GetName() != name {
			continue
		}
	next:
		for _, m := range f.GetMetric() {
			have := map[string]string{}
			for _, l := range m.GetLabel() {
				have[l.GetName()] = l.GetValue()
			}
			for k, v := range want {
				if have[k] != v {
					continue next
				}
			}
			switch {
			case m.GetCounter() != nil:
				sum += m.GetCounter().GetValue()
			case m.GetGauge() != nil:
				sum += m.GetGauge().GetValue()
			}
		}
	}
	return sum
}

// TestReviewAWMetrics: a Collector while Redis is stopped, then back.
// The breaker gauge of the node is 1 while its breaker is open and 0 once
// a call succeeds again; failed calls count in redis_errors_total, the
// fallback's answers in decisions_total; held replies count in
// lost_replies_total; Collect works throughout.
func TestReviewAWMetrics(t *testing.T) {
	e := newAwEnv(t)
	const T = 150 * time.Millisecond
	m, err := metrics.New()
	require.NoError(t, err)
	reg := prometheus.NewRegistry()
	require.NoError(t, reg.Register(m))
	e.engine(t, e.srv.Addr, time.Second)
	p := redistest.NewProxy(t, e.srv.Addr)
	eng := e.engine(t, p.Addr(), T, throttle.WithObserver(m))
	base := goroutines()
	ctx := context.Background()
	lim, err := reserve.New(eng, "aw", throttle.PerSecond(20, 4), reserve.WithFallback(reserve.FailOpen()))
	require.NoError(t, err)
	r, err := lim.Reserve(ctx, "k")
	require.NoError(t, err)
	require.False(t, r.Fallback())
	node := map[string]string{"node": p.Addr()}
	assert.Zero(t, awMetric(t, reg, "slotbook_breaker_open", node))

	// Collect runs throughout, beside the failing calls.
	stopGather := make(chan struct{})
	gathered := make(chan struct{})
	go func() {
		defer close(gathered)
		for {
			select {
			case <-stopGather:
				return
			default:
			}
			if _, err := reg.Gather(); err != nil {
				t.Errorf("Gather while Redis fails: %v", err)
				return
			}
			time.Sleep(time.Millisecond)
		}
	}()
	// Replies held: a lost reply.
	p.SetReplyDelay(400 * time.Millisecond)
	r, err = lim.Reserve(ctx, "k")
	require.NoError(t, err)
	assert.True(t, r.Fallback(), "the call whose reply was lost is answered by the fallback")
	assert.EqualValues(t, 1, awMetric(t, reg, "slotbook_lost_replies_total", map[string]string{"limiter": "aw"}))
	assert.EqualValues(t, 1, awMetric(t, reg, "slotbook_breaker_open", node), "breaker gauge with the breaker open")
	for range 5 {
		r, err = lim.Reserve(ctx, "k")
		require.NoError(t, err)
		require.True(t, r.Fallback())
	}
	fb := awMetric(t, reg, "slotbook_decisions_total", map[string]string{"limiter": "aw", "outcome": "fallback_allowed"})
	assert.GreaterOrEqual(t, fb, 6.0, "fallback_allowed decisions")
	p.SetReplyDelay(0)
	redistest.UntilOK(t, func() error {
		r, err := lim.Reserve(ctx, "k")
		if err != nil {
			return err
		}
		if r.Fallback() {
			return errors.New("fallback")
		}
		return nil
	})
	assert.Zero(t, awMetric(t, reg, "slotbook_breaker_open", node), "breaker gauge once Redis answers again")
	errs := awMetric(t, reg, "slotbook_redis_errors_total", map[string]string{"limiter": "aw"})
	assert.GreaterOrEqual(t, errs, 1.0)
	t.Logf("errors %v, fallback_allowed %v", errs, fb)

	// Severed, then the proxy closed (refused): the breaker opens and
	// closes again, the gauge follows.
	p.SetReplyDelay(300 * time.Millisecond)
	go func() { time.Sleep(30 * time.Millisecond); p.Sever() }()
	_, err = lim.Reserve(ctx, "k")
	require.NoError(t, err)
	assert.EqualValues(t, 1, awMetric(t, reg, "slotbook_breaker_open", node), "breaker gauge after a severed call")
	p.SetReplyDelay(0)
	redistest.UntilOK(t, func() error {
		r, err := lim.Reserve(ctx, "k")
		if err != nil {
			return err
		}
		if r.Fallback() {
			return errors.New("fallback")
		}
		return nil
	})
	assert.Zero(t, awMetric(t, reg, "slotbook_breaker_open", node), "breaker gauge once back")
	close(stopGather)
	<-gathered

	// A Cancel whose reply is lost (the refund ran), retried as its error
	// invites: the room comes back once, and the refund counts once in
	// refunds_total ("one whose reply was lost is counted, once, when it
	// is retried before its slot"), never as a no-op.
	slow, err := reserve.New(eng, "awr", throttle.PerSecond(1, 0))
	require.NoError(t, err)
	r1, err := slow.Reserve(ctx, "k")
	require.NoError(t, err)
	r2, err := slow.Reserve(ctx, "k")
	require.NoError(t, err)
	require.True(t, r1.OK() && r2.OK() && !r2.Fallback())
	p.SetReplyDelay(400 * time.Millisecond)
	cerr := r2.Cancel(ctx)
	require.ErrorIs(t, cerr, throttle.ErrReplyLost)
	p.SetReplyDelay(0)
	redistest.UntilOK(t, func() error { return r2.Cancel(ctx) })
	tat, _ := e.tat(t, "awr:{k}")
	assert.Equal(t, r1.Booking().At.Add(time.Second).UnixMicro(), tat, "TAT after a lost refund and its retry: r2's room back once")
	lbl := map[string]string{"limiter": "awr"}
	assert.EqualValues(t, 1, awMetric(t, reg, "slotbook_refunds_total", lbl), "refunds_total after a lost refund retried")
	assert.EqualValues(t, 0, awMetric(t, reg, "slotbook_refunds_noop_total", lbl), "refunds_noop_total after a lost refund retried")

	p.Close()
	e.closeAll()
	settled(t, base, 2, "metrics")
}

// TestReviewAWPoolFailOpen: a Pool over a FailOpen limiter with its
// server stopped: its jobs run on the fallback's local slots, which keep
// to the limit in this process (a textbook GCRA replay of their start
// times, on the local clock, finds no early one); an Acquire caller is
// served the same way; a job cancelled while booked on a local slot ends
// with its context's error; Close is bounded and leaves nothing behind;
// once Redis is back the shared key holds nothing of the local slots.
func TestReviewAWPoolFailOpen(t *testing.T) {
	e := newAwEnv(t)
	const T = 150 * time.Millisecond
	limit := throttle.PerSecond(20, 0) // I = 50 ms
	eng := e.engine(t, e.srv.Addr, T)
	base := goroutines()
	ctx := context.Background()
	lim, err := reserve.New(eng, "aw", limit, reserve.WithFallback(reserve.FailOpen()))
	require.NoError(t, err)
	p, err := pool.New(lim, pool.WithWorkers(4))
	require.NoError(t, err)
	e.srv.Stop()
	// Open the breaker first, so that every job is answered by the fallback.
	redistest.UntilOK(t, func() error {
		r, err := lim.Reserve(ctx, "warm")
		if err != nil {
			return err
		}
		if !r.Fallback() {
			return errors.New("not the fallback")
		}
		return nil
	})
	// The local slots are timed on the monotonic clock: they are read as
	// offsets from t0 (Sub uses the monotonic readings), not as wall-clock
	// instants: this VM's wall clock is slewed against the monotonic one
	// (344 µs over a million time.Now() calls, one run here), so two
	// slots 50 ms apart on the monotonic clock can be less on the wall
	// clock (seen once: 1 µs short by UnixMicro).
	t0 := time.Now()
	var jobs []*pool.Job
	for range 12 {
		j, err := p.Submit(ctx, "k", func(context.Context) error { return nil })
		require.NoError(t, err)
		jobs = append(jobs, j)
	}
	cctx, cancel := context.WithCancel(ctx)
	late, err := p.Submit(cctx, "k", func(context.Context) error { return nil })
	require.NoError(t, err)
	rel, err := p.Acquire(ctx, "k")
	require.NoError(t, err, "Acquire on the fallback")
	acquiredAt := time.Now()
	rel()
	cancel()
	var events []gcraEvent
	for i, j := range jobs {
		wctx, wcancel := context.WithTimeout(ctx, 10*time.Second)
		require.NoError(t, j.Wait(wctx), "job %d on the fallback", i)
		wcancel()
		assert.False(t, j.Started().Before(j.Slot()), "job %d started %v before its local slot", i, j.Slot().Sub(j.Started()))
		events = append(events, gcraEvent{name: "j" + string(rune('a'+i)), at: j.Slot().Sub(t0).Microseconds(), n: 1})
	}
	t.Logf("the Acquire caller acted at %v", acquiredAt.Format("15:04:05.000000"))
	<-late.Done()
	if late.Started().IsZero() {
		assert.ErrorIs(t, late.Err(), context.Canceled, "a cancelled job on the fallback")
	} else {
		events = append(events, gcraEvent{name: "late", at: late.Slot().Sub(t0).Microseconds(), n: 1})
	}
	// The jobs' local slots replayed through a textbook GCRA (burst 0);
	// the Acquire caller's slot, which it does not report, is left out.
	assert.Empty(t, earlyEvents(events, limit.Interval(), 0), "local slots%s", offsets(events))
	d := timed(func() {
		c, cancel := context.WithTimeout(ctx, 10*time.Second)
		defer cancel()
		require.NoError(t, p.Close(c))
	})
	assert.Less(t, d, 4*T+time.Second, "Close on the fallback took %v", d)
	e.srv.Restart(t)
	tat, _ := e.tat(t, "aw:{k}")
	assert.Zero(t, tat, "the shared key after the fallback's slots")
	e.closeAll()
	settled(t, base, 2, "pool on FailOpen")
}

// TestReviewAWLeaseWaiterAcrossOutage: a waiter queued behind another
// process's lease (N = 1) while Redis is paused (SIGSTOP) for longer than
// the TTL: the holder's lease lapses (its Lost closes), the waiter's
// place in the queue lapses too. Once Redis is back the waiter, still
// waiting, is served within a few poll intervals: its refresh puts it
// back in the queue, and the lapsed lease is swept.
func TestReviewAWLeaseWaiterAcrossOutage(t *testing.T) {
	e := newAwEnv(t)
	const ttl = 600 * time.Millisecond
	const poll = 150 * time.Millisecond
	engX := e.engine(t, e.srv.Addr, 100*time.Millisecond)
	engA := e.engine(t, e.srv.Addr, 100*time.Millisecond)
	base := goroutines()
	ctx := context.Background()
	semX, err := lease.New(engX, "aw", 1, lease.WithTTL(ttl), lease.WithPollInterval(poll))
	require.NoError(t, err)
	semA, err := lease.New(engA, "aw", 1, lease.WithTTL(ttl), lease.WithPollInterval(poll))
	require.NoError(t, err)
	held, err := semX.Acquire(ctx, "k")
	require.NoError(t, err)
	type res struct {
		l   *lease.Lease
		err error
		at  time.Time
	}
	got := make(chan res, 1)
	wctx, wcancel := context.WithTimeout(ctx, 8*time.Second)
	defer wcancel()
	go func() {
		l, err := semA.Acquire(wctx, "k")
		got <- res{l, err, time.Now()}
	}()
	time.Sleep(3 * poll) // queued
	require.NoError(t, syscall.Kill(e.srv.Pid(), syscall.SIGSTOP))
	time.Sleep(2 * ttl)
	require.NoError(t, syscall.Kill(e.srv.Pid(), syscall.SIGCONT))
	back := time.Now()
	select {
	case <-held.Lost():
	case <-time.After(time.Second):
		t.Error("the holder's Lost not closed after an outage of twice the TTL")
	}
	r := <-got
	t.Logf("waiter: %v, %v after Redis came back", r.err, r.at.Sub(back))
	require.NoError(t, r.err, "a waiter across an outage longer than the TTL")
	assert.Less(t, r.at.Sub(back), 2*time.Second, "served %v after Redis came back (poll %v, TTL %v)", r.at.Sub(back), poll, ttl)
	require.NoError(t, r.l.Release(ctx))
	_ = held.Release(ctx)
	require.NoError(t, semA.Close(ctx))
	require.NoError(t, semX.Close(ctx))
	e.closeAll()
	settled(t, base, 2, "lease waiter across an outage")
}
