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
	m := metrics.New()
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
# HELP slotbook_refunds_total Bookings given back.
# TYPE slotbook_refunds_total counter
slotbook_refunds_total{limiter="api"} 1
# HELP slotbook_refunded_seconds_total Time given back by refunds.
# TYPE slotbook_refunded_seconds_total counter
slotbook_refunded_seconds_total{limiter="api"} 0.1
# HELP slotbook_redis_errors_total Script calls to Redis that failed.
# TYPE slotbook_redis_errors_total counter
# HELP slotbook_fallback_active 1 while Redis is unavailable and the fallback policy answers.
# TYPE slotbook_fallback_active gauge
slotbook_fallback_active{limiter="api"} 0
`), "slotbook_decisions_total", "slotbook_refunds_total", "slotbook_refunded_seconds_total", "slotbook_redis_errors_total", "slotbook_fallback_active"))
	require.Equal(t, 2, testutil.CollectAndCount(m, "slotbook_booked_wait_seconds", "slotbook_redis_call_duration_seconds"))

	problems, err := testutil.CollectAndLint(m)
	require.NoError(t, err)
	require.Empty(t, problems, "metric names and help follow Prometheus conventions")
	_, err = reg.Gather()
	require.NoError(t, err, "the pedantic registry accepts the collector")
}

func TestFallbackGaugeAndErrors(t *testing.T) {
	t.Parallel()
	m := metrics.New(metrics.WithNamespace("acme"), metrics.WithConstLabels(prometheus.Labels{"app": "billing"}))
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
# HELP acme_fallback_active 1 while Redis is unavailable and the fallback policy answers.
# TYPE acme_fallback_active gauge
acme_fallback_active{app="billing",limiter="api"} 1
# HELP acme_decisions_total Requests decided, by outcome.
# TYPE acme_decisions_total counter
acme_decisions_total{app="billing",limiter="api",outcome="booked"} 1
acme_decisions_total{app="billing",limiter="api",outcome="fallback_allowed"} 3
# HELP acme_redis_errors_total Script calls to Redis that failed.
# TYPE acme_redis_errors_total counter
acme_redis_errors_total{app="billing",limiter="api"} 1
`), "acme_fallback_active", "acme_decisions_total", "acme_redis_errors_total"))
}

// TestLostReplies: a call sent to a Redis that does not answer in time
// (CLIENT PAUSE) may have taken effect: the caller's error says so, and
// slotbook_lost_replies_total counts it; a call that reaches no Redis does
// not count.
func TestLostReplies(t *testing.T) {
	t.Parallel()
	m := metrics.New()
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
# HELP slotbook_lost_replies_total Script calls sent to Redis whose reply never came: each may have booked slots nobody will use.
# TYPE slotbook_lost_replies_total counter
slotbook_lost_replies_total{limiter="api"} 1
`), "slotbook_lost_replies_total"))
}
