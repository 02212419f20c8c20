package slotbook_test

import (
	"context"
	"strconv"
	"testing"
	"time"

	"github.com/go-redis/redis_rate/v10"
	"github.com/stretchr/testify/require"
	"golang.org/x/time/rate"

	"github.com/slotbook/slotbook/internal/redistest"
	"github.com/slotbook/slotbook/internal/testhook"
	"github.com/slotbook/slotbook/throttle"
)

// TestMigrationTable checks the README's table of equivalent limits: the
// same limit written for golang.org/x/time/rate, go-redis/redis_rate and
// slotbook lets as many requests through at once after an idle spell, and
// then the next one an interval later.
func TestMigrationTable(t *testing.T) {
	t.Parallel()
	srv := redistest.Shared(t)
	rdb := srv.Client(t)
	prefix := redistest.Prefix(t)
	eng, err := throttle.New(rdb, throttle.WithPrefix(prefix), throttle.WithTimeout(5*time.Second))
	require.NoError(t, err)
	rr := redis_rate.NewLimiter(rdb)

	for i, c := range []struct {
		name     string
		xrate    *rate.Limiter
		rr       redis_rate.Limit
		slotbook throttle.Limit
		atOnce   int
		interval time.Duration
	}{
		{"10/s, 5 at once", rate.NewLimiter(10, 5), redis_rate.Limit{Rate: 10, Burst: 5, Period: time.Second},
			throttle.PerSecond(10, 4), 5, 100 * time.Millisecond},
		{"slotbook's PerSecond(10, 5): 6 at once", rate.NewLimiter(10, 6), redis_rate.Limit{Rate: 10, Burst: 6, Period: time.Second},
			throttle.PerSecond(10, 5), 6, 100 * time.Millisecond},
		{"one every 100ms", rate.NewLimiter(rate.Every(100*time.Millisecond), 1), redis_rate.Limit{Rate: 1, Burst: 1, Period: 100 * time.Millisecond},
			throttle.Every(100*time.Millisecond, 1, 0), 1, 100 * time.Millisecond},
		{"redis_rate.PerMinute(100)", rate.NewLimiter(rate.Every(time.Minute/100), 100), redis_rate.PerMinute(100),
			throttle.PerMinute(100, 99), 100, 600 * time.Millisecond},
		{"10,000 a day, 100 at once", rate.NewLimiter(rate.Every(24*time.Hour/10_000), 100), redis_rate.Limit{Rate: 10_000, Burst: 100, Period: 24 * time.Hour},
			throttle.PerDay(10_000, 99), 100, 8640 * time.Millisecond},
	} {
		t.Run(c.name, func(t *testing.T) {
			key := "migration-" + strconv.Itoa(i)

			// x/time/rate, on an explicit clock.
			t0 := time.Now()
			got := 0
			for c.xrate.AllowN(t0, 1) {
				got++
			}
			require.Equal(t, c.atOnce, got, "x/time/rate: at once")
			require.Equal(t, c.interval, c.xrate.ReserveN(t0, 1).DelayFrom(t0), "x/time/rate: the next")

			// slotbook, on an explicit clock.
			ctx := testhook.WithNow(context.Background(), t0.UnixMicro())
			got = 0
			for {
				res, err := eng.Allow(ctx, key, c.slotbook)
				require.NoError(t, err)
				if !res.Allowed {
					require.Equal(t, c.interval, res.RetryAfter, "slotbook: the next")
					break
				}
				got++
				require.LessOrEqual(t, got, c.atOnce+1)
			}
			require.Equal(t, c.atOnce, got, "slotbook: at once")

			// redis_rate, on the Redis clock: one call takes as many as pass.
			start := time.Now()
			res, err := rr.AllowAtMost(context.Background(), prefix+key, c.rr, 10*c.atOnce)
			require.NoError(t, err)
			require.Equal(t, c.atOnce, res.Allowed, "redis_rate: at once")
			res, err = rr.Allow(context.Background(), prefix+key, c.rr)
			require.NoError(t, err)
			if res.Allowed != 0 { // a busy machine let an interval pass between the calls
				require.GreaterOrEqual(t, time.Since(start), c.interval, "redis_rate: the next came early")
				return
			}
			require.Greater(t, res.RetryAfter, time.Duration(0), "redis_rate: the next")
			require.LessOrEqual(t, res.RetryAfter, c.interval, "redis_rate: the next")
		})
	}
}
