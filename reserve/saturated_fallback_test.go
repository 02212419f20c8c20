package reserve_test

import (
	"context"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/slotbook/slotbook/internal/redistest"
	"github.com/slotbook/slotbook/reserve"
	"github.com/slotbook/slotbook/throttle"
)

// TestSaturatedClientNoFallback: a call that fails because the client had
// no connection to spare (its pool held by other work on the same client)
// leaves the breaker closed: Redis is up. The fallback must not answer it.
// FailOpen and LocalShare would admit on top of what Redis admitted (here
// the limit's one unit an hour, used already), and FailClosed would refuse
// with a made-up retry-after; the caller gets the error instead, through
// Allow and Reserve. Found by review: under load FailOpen admitted past
// the limit with the breaker never opened.
func TestSaturatedClientNoFallback(t *testing.T) {
	t.Parallel()
	srv := redistest.Shared(t)
	srv.RequireReal(t)
	for name, fb := range map[string]reserve.Fallback{
		"fail open":   reserve.FailOpen(),
		"local share": reserve.LocalShare(time.Second, 1, 100),
		"fail closed": reserve.FailClosed(),
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			opts := srv.Options()
			opts.PoolSize = 1
			opts.PoolTimeout = 20 * time.Millisecond
			rdb := redis.NewClient(opts)
			t.Cleanup(func() { _ = rdb.Close() })
			eng, err := throttle.New(rdb, throttle.WithPrefix(redistest.Prefix(t)), throttle.WithTimeout(5*time.Second))
			require.NoError(t, err)
			lim, err := reserve.New(eng, "api", throttle.PerHour(1, 0), reserve.WithFallback(fb))
			require.NoError(t, err)
			ctx := context.Background()
			res, err := lim.Allow(ctx, "k")
			require.NoError(t, err)
			require.True(t, res.Allowed, "the hour's one unit")

			// Other work on the same client holds its only connection.
			held := make(chan struct{})
			go func() {
				defer close(held)
				rdb.BLPop(context.Background(), 1500*time.Millisecond, redistest.Prefix(t)+"nothing")
			}()
			require.Eventually(t, func() bool { return rdb.PoolStats().IdleConns == 0 }, time.Second, time.Millisecond)
			time.Sleep(50 * time.Millisecond) // the BLPOP has its connection

			res, err = lim.Allow(ctx, "k")
			require.ErrorIs(t, err, throttle.ErrUnavailable, "the client's own saturation, as an error (allowed: %v)", res.Allowed)
			require.False(t, res.Allowed)
			r, err := lim.Reserve(ctx, "k")
			require.ErrorIs(t, err, throttle.ErrUnavailable, "Reserve: the error, not the fallback's answer")
			require.Nil(t, r)
			open, _ := eng.Unavailable()
			require.False(t, open, "Redis is up: the breaker stays closed")
			<-held

			res, err = lim.Allow(ctx, "k")
			require.NoError(t, err)
			require.False(t, res.Allowed, "the hour's unit is spent: Redis refuses")
		})
	}
}
