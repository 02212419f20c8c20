package throttle_test

import (
	"context"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/slotbook/slotbook/internal/redistest"
	"github.com/slotbook/slotbook/throttle"
)

// TestNoRetryAfterSend: a booking whose connection breaks after Redis ran
// it must not be run again by go-redis's own retries (MaxRetries, 3 by
// default): the caller would hold the second booking while the first one's
// slots went unused, with nothing to say so. The caller gets ErrReplyLost,
// and the key holds one booking.
func TestNoRetryAfterSend(t *testing.T) {
	t.Parallel()
	srv := redistest.Shared(t)
	direct := srv.Client(t)
	proxy := redistest.NewProxy(t, srv.Addr)
	opts := srv.Options()
	opts.Addr = proxy.Addr()
	opts.MaxRetries = 3 // go-redis's default
	rdb := redis.NewClient(opts)
	t.Cleanup(func() { _ = rdb.Close() })
	prefix := redistest.Prefix(t)
	eng, err := throttle.New(rdb, throttle.WithPrefix(prefix), throttle.WithTimeout(10*time.Second))
	require.NoError(t, err)
	ctx := context.Background()
	require.NoError(t, eng.Load(ctx))
	lim := throttle.PerHour(1, 0)
	_, err = eng.Book(ctx, "k", lim, throttle.Request{N: 1, MaxWait: throttle.Forever}) // now; the next slot is an hour away
	require.NoError(t, err)
	first, err := direct.Get(ctx, prefix+"k").Int64()
	require.NoError(t, err)

	proxy.SetReplyDelay(time.Hour) // the reply is held until the connection is severed
	go func() {
		// Once the script has run (the key moved on), the connection
		// breaks with its reply in flight.
		for {
			if v, err := direct.Get(ctx, prefix+"k").Int64(); err == nil && v != first {
				break
			}
			time.Sleep(time.Millisecond)
		}
		proxy.SetReplyDelay(0)
		proxy.Sever()
	}()
	b, err := eng.Book(ctx, "k", lim, throttle.Request{N: 1, MaxWait: throttle.Forever})
	require.ErrorIs(t, err, throttle.ErrReplyLost, "booking %+v", b)
	require.ErrorIs(t, err, throttle.ErrUnavailable)
	stored, err := direct.Get(ctx, prefix+"k").Int64()
	require.NoError(t, err)
	require.Equal(t, first+time.Hour.Microseconds(), stored, "one booking, not two")
}
