package metrics_test

import (
	"context"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/require"

	"github.com/slotbook/slotbook/internal/redistest"
	"github.com/slotbook/slotbook/internal/testhook"
	"github.com/slotbook/slotbook/metrics"
	"github.com/slotbook/slotbook/reserve"
	"github.com/slotbook/slotbook/throttle"
)

func TestMain(m *testing.M) { redistest.Main(m) }

func TestDecisionsAndRefunds(t *testing.T) {
	t.Parallel()
	m := collector(t)
	reg := prometheus.NewPedanticRegistry()
	require.NoError(t, reg.Register(m))
	rdb := redistest.Shared(t).Client(t)
	eng, err := throttle.New(rdb, throttle.WithPrefix(redistest.Prefix(t)), throttle.WithObserver(m), throttle.WithTimeout(5*time.Second))
	require.NoError(t, err)
	lim, err := reserve.New(eng, "api", throttle.PerSecond(10, 1), reserve.WithMaxWait(150*time.Millisecond))
	require.NoError(t, err)
	// On an explicit clock: every wait below is exact however long the
	// calls take (on the real one, a slow machine would bring the slot
	// 200ms away within the max wait).
	ctx := testhook.WithNow(context.Background(), time.Now().UnixMicro())

	for i := 0; i < 2; i++ { // the burst: booked at once
		r, err := lim.Reserve(ctx, "tenant-1")
		require.NoError(t, err)
		require.True(t, r.OK())
	}
	r, err := lim.Reserve(ctx, "tenant-2") // another subject: same label
	require.NoError(t, err)
	require.True(t, r.OK())
	r, err = lim.Reserve(ctx, "tenant-1") // 100ms away: booked
	require.NoError(t, err)
	require.True(t, r.OK())
	require.NoError(t, r.Cancel(ctx))     // and given back
	r, err = lim.Reserve(ctx, "tenant-1") // the given-back slot, booked again
	require.NoError(t, err)
	require.True(t, r.OK())
	refused, err := lim.Reserve(ctx, "tenant-1") // 200ms away: refused
	require.NoError(t, err)
	require.False(t, refused.OK())
	res, err := lim.Allow(ctx, "tenant-1")
	require.NoError(t, err)
	require.False(t, res.Allowed)

	require.NoError(t, testutil.CollectAndCompare(m, strings.NewReader(`
# HELP slotbook_decisions_total Requests decided, by outcome.
# TYPE slotbook_decisions_total counter
slotbook_decisions_total{limiter="api",outcome="booked"} 5
slotbook_decisions_total{limiter="api",outcome="denied"} 1
slotbook_decisions_total{limiter="api",outcome="refused"} 1
# HELP slotbook_refunds_total Refunds that gave time back.
# TYPE slotbook_refunds_total counter
slotbook_refunds_total{limiter="api"} 1
# HELP slotbook_refunded_seconds_total Time given back by refunds.
# TYPE slotbook_refunded_seconds_total counter
slotbook_refunded_seconds_total{limiter="api"} 0.1
# HELP slotbook_redis_errors_total Script calls to Redis that failed.
# TYPE slotbook_redis_errors_total counter
`), "slotbook_decisions_total", "slotbook_refunds_total", "slotbook_refunded_seconds_total", "slotbook_redis_errors_total", "slotbook_breaker_open"))
	require.Equal(t, 2, testutil.CollectAndCount(m, "slotbook_booked_wait_seconds", "slotbook_redis_call_duration_seconds"))

	problems, err := testutil.CollectAndLint(m)
	require.NoError(t, err)
	require.Empty(t, problems, "metric names and help follow Prometheus conventions")
	_, err = reg.Gather()
	require.NoError(t, err, "the pedantic registry accepts the collector")
}

// TestBreakerGaugeAndErrors: with the limiter's Redis killed, the node's
// breaker gauge reads 1 and the fallback's decisions count.
func TestBreakerGaugeAndErrors(t *testing.T) {
	t.Parallel()
	m := collector(t, metrics.WithNamespace("acme"), metrics.WithConstLabels(prometheus.Labels{"app": "billing"}))
	srv := redistest.Start(t)
	// No probe within the test, however slow the machine: exactly one call
	// reaches the dead server. A generous timeout, so that the call before
	// the kill cannot miss it (after the kill, calls fail at once).
	eng, err := throttle.New(srv.Client(t), throttle.WithObserver(m), throttle.WithTimeout(5*time.Second),
		throttle.WithProbeBackoff(time.Minute, time.Minute))
	require.NoError(t, err)
	lim, err := reserve.New(eng, "api", throttle.PerSecond(10, 1), reserve.WithFallback(reserve.FailOpen()))
	require.NoError(t, err)
	ctx := context.Background()
	require.NoError(t, lim.Acquire(ctx, "k"))
	require.NoError(t, syscall.Kill(srv.Pid(), syscall.SIGKILL))
	for i := 0; i < 3; i++ {
		require.NoError(t, lim.Acquire(ctx, "k"))
	}
	require.NoError(t, testutil.CollectAndCompare(m, strings.NewReader(`
# HELP acme_breaker_open Engines whose breaker for the Redis node is open: calls for subjects on it fail fast or the fallback answers.
# TYPE acme_breaker_open gauge
acme_breaker_open{app="billing",node="`+srv.Addr+`"} 1
# HELP acme_decisions_total Requests decided, by outcome.
# TYPE acme_decisions_total counter
acme_decisions_total{app="billing",limiter="api",outcome="booked"} 1
acme_decisions_total{app="billing",limiter="api",outcome="fallback_allowed"} 3
# HELP acme_redis_errors_total Script calls to Redis that failed.
# TYPE acme_redis_errors_total counter
acme_redis_errors_total{app="billing",limiter="api"} 1
`), "acme_breaker_open", "acme_decisions_total", "acme_redis_errors_total"))
}

// TestLostReplies: a call sent to a Redis that does not answer in time
// (CLIENT PAUSE) may have taken effect: the caller's error says so, and
// slotbook_lost_replies_total counts it; a call that reaches no Redis does
// not count.
func TestLostReplies(t *testing.T) {
	t.Parallel()
	m := collector(t)
	srv := redistest.Start(t)
	admin := srv.Client(t)
	// A timeout generous enough for the calls before the pause on a busy
	// machine, and far shorter than the pause.
	eng, err := throttle.New(srv.Client(t), throttle.WithObserver(m), throttle.WithTimeout(time.Second),
		throttle.WithProbeBackoff(time.Minute, time.Minute))
	require.NoError(t, err)
	lim, err := reserve.New(eng, "api", throttle.PerSecond(10, 1))
	require.NoError(t, err)
	ctx := context.Background()
	require.NoError(t, eng.Load(ctx))
	_, err = lim.Reserve(ctx, "k") // a connection in the pool
	require.NoError(t, err)

	// Paused for far longer than the timeout and the calls below can take
	// on a busy machine, so the first is certainly cut off by its timeout.
	require.NoError(t, admin.Do(ctx, "CLIENT", "PAUSE", "5000", "ALL").Err())
	_, err = lim.Reserve(ctx, "k")
	require.ErrorIs(t, err, throttle.ErrUnavailable)
	require.ErrorIs(t, err, throttle.ErrReplyLost)
	_, err = lim.Reserve(ctx, "k") // the breaker is open: nothing sent
	require.ErrorIs(t, err, throttle.ErrUnavailable)
	require.NotErrorIs(t, err, throttle.ErrReplyLost)

	require.NoError(t, testutil.CollectAndCompare(m, strings.NewReader(`
# HELP slotbook_lost_replies_total Script calls sent to Redis whose reply never came: a booking call's may have booked slots nobody will use, a refund's may have given time back (counted in the refund metrics if the refund is retried).
# TYPE slotbook_lost_replies_total counter
slotbook_lost_replies_total{limiter="api"} 1
`), "slotbook_lost_replies_total"))
}

// TestRefundsCountOnlyWhatWasGivenBack: a refund that gives nothing back
// (a later booking stands on it, or it was given back before) counts in
// refunds_noop_total, not in refunds_total.
func TestRefundsCountOnlyWhatWasGivenBack(t *testing.T) {
	t.Parallel()
	m := collector(t)
	rdb := redistest.Shared(t).Client(t)
	eng, err := throttle.New(rdb, throttle.WithPrefix(redistest.Prefix(t)), throttle.WithObserver(m), throttle.WithTimeout(5*time.Second))
	require.NoError(t, err)
	ctx := testhook.WithNow(context.Background(), time.Now().UnixMicro()) // exact waits
	lim := throttle.PerSecond(10, 0)
	book := func() throttle.Booking {
		b, err := eng.Book(ctx, "api:{k}", lim, throttle.Request{N: 1, MaxWait: time.Second})
		require.NoError(t, err)
		require.True(t, b.OK)
		return b
	}
	refund := func(b throttle.Booking) time.Duration {
		given, err := eng.Refund(ctx, "api:{k}", lim, b)
		require.NoError(t, err)
		return given
	}
	book()           // now
	first := book()  // 100ms away
	second := book() // 200ms away, standing on first
	require.Zero(t, refund(first), "a later booking stands on it")
	require.Equal(t, 100*time.Millisecond, refund(second))
	require.Zero(t, refund(second), "given back before")

	require.NoError(t, testutil.CollectAndCompare(m, strings.NewReader(`
# HELP slotbook_refunds_total Refunds that gave time back.
# TYPE slotbook_refunds_total counter
slotbook_refunds_total{limiter="api"} 1
# HELP slotbook_refunds_noop_total Refunds that gave nothing back: a later booking or a pause stood on the booking (any refund); its slot had come (the engine's Refund called directly: reserve's Cancel makes no call then), or, for a booking no one used (given back as unused, as reserve does for late refusals), its units no longer stood; or it was given back before (the engine's Refund called again, or a retry of a lost refund that gave nothing).
# TYPE slotbook_refunds_noop_total counter
slotbook_refunds_noop_total{limiter="api"} 2
# HELP slotbook_refunded_seconds_total Time given back by refunds.
# TYPE slotbook_refunded_seconds_total counter
slotbook_refunded_seconds_total{limiter="api"} 0.1
`), "slotbook_refunds_total", "slotbook_refunds_noop_total", "slotbook_refunded_seconds_total"))
}

// TestOneCollectorTwoEngines: one Collector observing two engines, each on
// a Redis of its own: with one Redis killed, only its node's breaker gauge
// reads 1, the other engine's limiter is served by its Redis, and the
// gauge returns to 0 once the killed Redis is back. Two Collectors register
// in one registry when their const labels differ.
func TestOneCollectorTwoEngines(t *testing.T) {
	t.Parallel()
	m := collector(t)
	reg := prometheus.NewPedanticRegistry()
	require.NoError(t, reg.Register(m))
	down, up := redistest.Start(t), redistest.Start(t)
	engDown, err := throttle.New(down.Client(t), throttle.WithObserver(m), throttle.WithTimeout(5*time.Second),
		throttle.WithProbeBackoff(10*time.Millisecond, 50*time.Millisecond))
	require.NoError(t, err)
	engUp, err := throttle.New(up.Client(t), throttle.WithObserver(m), throttle.WithTimeout(5*time.Second))
	require.NoError(t, err)
	orders, err := reserve.New(engDown, "orders", throttle.PerSecond(1000, 10), reserve.WithFallback(reserve.FailOpen()))
	require.NoError(t, err)
	payments, err := reserve.New(engUp, "payments", throttle.PerSecond(1000, 10), reserve.WithFallback(reserve.FailOpen()))
	require.NoError(t, err)
	ctx := context.Background()
	redistest.UntilOK(t, func() error { _, err := engDown.Allow(ctx, "warm:orders", throttle.PerSecond(1000, 10)); return err })
	redistest.UntilOK(t, func() error { _, err := engUp.Allow(ctx, "warm:payments", throttle.PerSecond(1000, 10)); return err })

	down.Stop()
	for i := 0; i < 3; i++ {
		_, err := orders.Allow(ctx, "k")
		require.NoError(t, err)
		_, err = payments.Allow(ctx, "k")
		require.NoError(t, err)
	}
	gauge := func(node string) float64 {
		return value(t, reg, "slotbook_breaker_open", map[string]string{"node": node})
	}
	require.Equal(t, 1.0, gauge(down.Addr), "the killed Redis's breaker is open")
	require.Equal(t, 0.0, gauge(up.Addr), "the other engine's Redis is served")
	decisions := func(limiter string, o throttle.Outcome) float64 {
		return value(t, reg, "slotbook_decisions_total", map[string]string{"limiter": limiter, "outcome": o.String()})
	}
	require.Zero(t, decisions("payments", throttle.FallbackAllowed), "payments never fell back")
	require.Equal(t, 3.0, decisions("payments", throttle.Allowed))
	require.Equal(t, 3.0, decisions("orders", throttle.FallbackAllowed))

	down.Restart(t)
	redistest.UntilOK(t, func() error { _, err := engDown.Allow(ctx, "warm:orders", throttle.PerSecond(1000, 10)); return err })
	require.Equal(t, 0.0, gauge(down.Addr), "closed again once Redis is back")
	_, err = reg.Gather()
	require.NoError(t, err)

	// Two Collectors in one registry: with const labels telling them apart.
	two := prometheus.NewPedanticRegistry()
	require.NoError(t, two.Register(collector(t, metrics.WithConstLabels(prometheus.Labels{"engine": "orders"}))))
	require.NoError(t, two.Register(collector(t, metrics.WithConstLabels(prometheus.Labels{"engine": "payments"}))))
	require.Error(t, two.Register(collector(t, metrics.WithConstLabels(prometheus.Labels{"engine": "payments"}))),
		"the same metrics twice are refused")
}

// value returns the value of the gauge or counter name with the given
// labels in what reg gathers, or 0 if there is no such series.
func value(t *testing.T, reg prometheus.Gatherer, name string, labels map[string]string) float64 {
	t.Helper()
	families, err := reg.Gather()
	require.NoError(t, err)
	for _, f := range families {
		if f.GetName() != name {
			continue
		}
	series:
		for _, m := range f.GetMetric() {
			for _, l := range m.GetLabel() {
				if want, ok := labels[l.GetName()]; ok && want != l.GetValue() {
					continue series
				}
			}
			if g := m.GetGauge(); g != nil {
				return g.GetValue()
			}
			return m.GetCounter().GetValue()
		}
	}
	return 0
}

// TestBookedWaitLeavesOutNoWait: a FallbackAllowed with throttle.NoWait (a
// check-mode request the fallback let pass) counts as a decision but books
// no wait; one with a wait of 0 or more (a reservation) does.
func TestBookedWaitLeavesOutNoWait(t *testing.T) {
	c, err := metrics.New()
	require.NoError(t, err)
	c.ObserveDecision("l", throttle.FallbackAllowed, throttle.NoWait)
	c.ObserveDecision("l", throttle.FallbackAllowed, 0)
	c.ObserveDecision("l", throttle.FallbackAllowed, time.Second)
	c.ObserveDecision("l", throttle.Booked, 0)
	require.Equal(t, 2, testutil.CollectAndCount(c, "slotbook_decisions_total"), "fallback_allowed and booked")
	require.NoError(t, testutil.CollectAndCompare(c, strings.NewReader(`
# HELP slotbook_booked_wait_seconds Wait until the booked slot: the queue in front of the limit.
# TYPE slotbook_booked_wait_seconds histogram
slotbook_booked_wait_seconds_bucket{limiter="l",le="0"} 2
slotbook_booked_wait_seconds_bucket{limiter="l",le="0.005"} 2
slotbook_booked_wait_seconds_bucket{limiter="l",le="0.01"} 2
slotbook_booked_wait_seconds_bucket{limiter="l",le="0.025"} 2
slotbook_booked_wait_seconds_bucket{limiter="l",le="0.05"} 2
slotbook_booked_wait_seconds_bucket{limiter="l",le="0.1"} 2
slotbook_booked_wait_seconds_bucket{limiter="l",le="0.25"} 2
slotbook_booked_wait_seconds_bucket{limiter="l",le="0.5"} 2
slotbook_booked_wait_seconds_bucket{limiter="l",le="1"} 3
slotbook_booked_wait_seconds_bucket{limiter="l",le="2.5"} 3
slotbook_booked_wait_seconds_bucket{limiter="l",le="5"} 3
slotbook_booked_wait_seconds_bucket{limiter="l",le="10"} 3
slotbook_booked_wait_seconds_bucket{limiter="l",le="30"} 3
slotbook_booked_wait_seconds_bucket{limiter="l",le="60"} 3
slotbook_booked_wait_seconds_bucket{limiter="l",le="+Inf"} 3
slotbook_booked_wait_seconds_sum{limiter="l"} 1
slotbook_booked_wait_seconds_count{limiter="l"} 3
`), "slotbook_booked_wait_seconds"))
}
