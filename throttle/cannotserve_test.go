package throttle_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/slotbook/slotbook/internal/redistest"
	"github.com/slotbook/slotbook/throttle"
)

// TestCannotWrite: a Redis that refuses writes (out of memory with
// noeviction; READONLY after a failover and MISCONF on a full disk answer
// alike) cannot serve the limit: the error matches ErrUnavailable, so that
// the breaker opens and a fallback answers, and not ErrReplyLost, since
// nothing was written.
func TestCannotWrite(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	rdb := srv.Client(t)
	ctx := context.Background()
	eng, err := throttle.New(rdb, throttle.WithTimeout(5*time.Second), throttle.WithProbeBackoff(time.Minute, time.Minute))
	require.NoError(t, err)
	lim := throttle.PerHour(1, 0) // the key outlives the test in real time
	_, err = eng.Book(ctx, "k", lim, throttle.Request{N: 1})
	require.NoError(t, err)
	before, err := rdb.Get(ctx, "slotbook:k").Result()
	require.NoError(t, err)

	require.NoError(t, rdb.ConfigSet(ctx, "maxmemory-policy", "noeviction").Err())
	require.NoError(t, rdb.ConfigSet(ctx, "maxmemory", "1").Err())
	_, err = eng.Book(ctx, "k2", lim, throttle.Request{N: 1}) // an idle key: the booking writes
	require.ErrorIs(t, err, throttle.ErrUnavailable)
	require.NotErrorIs(t, err, throttle.ErrReplyLost)
	open, _ := eng.Unavailable()
	require.True(t, open, "the breaker opened")
	require.NoError(t, rdb.ConfigSet(ctx, "maxmemory", "0").Err())
	after, err := rdb.Get(ctx, "slotbook:k").Result()
	require.NoError(t, err)
	require.Equal(t, before, after, "nothing written")
	require.Zero(t, rdb.Exists(ctx, "slotbook:k2").Val(), "nothing written")
}
