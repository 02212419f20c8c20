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
	rdb := proxy.Client(t, srv, func(o *redis.Options) { o.MaxRetries = 3 }) // go-redis's default
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
	watch := t.Context()           // ends with the test: the watch below never outlives it
	go func() {
		// Once the script has run (the key moved on), the connection
		// breaks with its reply in flight.
		for {
			if v, err := direct.Get(watch, prefix+"k").Int64(); err == nil && v != first {
				break
			}
			if watch.Err() != nil {
				return
			}
			time.Sleep(time.Millisecond)
		}
		// Sever first: a reply the proxy reads after the delay is lifted
		// would be passed on at once (seen once on a busy machine).
		proxy.Sever()
		proxy.SetReplyDelay(0)
	}()
	b, err := eng.Book(ctx, "k", lim, throttle.Request{N: 1, MaxWait: throttle.Forever})
	require.ErrorIs(t, err, throttle.ErrReplyLost, "booking %+v", b)
	require.ErrorIs(t, err, throttle.ErrUnavailable)
	stored, err := direct.Get(ctx, prefix+"k").Int64()
	require.NoError(t, err)
	if stored == first {
		// The call never reached Redis: once, on a busy machine, it went
		// out on a new connection, whose handshake the held replies
		// stalled until go-redis's dial timeout (5 s). Nothing was sent
		// twice either, but the scene was not set.
		t.Skip("the call never ran (a new connection's handshake stalled by the held replies): no lost reply to judge")
	}
	require.Equal(t, first+time.Hour.Microseconds(), stored, "one booking, not two")
}

// TestCallerDeadlineIsNotAnOutage: a caller whose own context deadline
// runs out while its reply is on the way gave up; Redis did not fail. The
// socket's deadline (set from the context's) can fire before the context
// says it is done, and such a call used to count as Redis unavailable and
// open the breaker for every other caller. Its error matches the
// context's, never ErrUnavailable, and the breaker stays closed.
func TestCallerDeadlineIsNotAnOutage(t *testing.T) {
	t.Parallel()
	srv := redistest.Shared(t)
	proxy := redistest.NewProxy(t, srv.Addr)
	opts := srv.Options()
	opts.Addr = proxy.Addr()
	prefix := redistest.Prefix(t)
	// One an hour, its slot taken before the calls: each call is refused
	// (a decision in Redis, nothing booked), so that no give-back follows
	// it through the held replies (about a second a call).
	lim := throttle.PerHour(1, 0)
	direct, err := throttle.New(srv.Client(t), throttle.WithPrefix(prefix))
	require.NoError(t, err)
	first, err := direct.Book(context.Background(), "k", lim, throttle.Request{N: 1, MaxWait: 0})
	require.NoError(t, err)
	require.True(t, first.OK)
	for i := 0; i < 30; i++ {
		rdb := redis.NewClient(opts)
		obs := newBDLObs()
		eng, err := throttle.New(rdb, throttle.WithPrefix(prefix), throttle.WithTimeout(10*time.Second), throttle.WithObserver(obs))
		require.NoError(t, err)
		// The client's connection is made and the scripts loaded before
		// replies are held back: the handshake's replies, held 100 ms each
		// (and a NOSCRIPT's, where the server had not the script), took
		// the call past a 50 ms deadline before it went out, and every
		// call was refused unsent, with the same error, testing nothing.
		// The reply now comes at least 300 ms after the deadline's start,
		// 150 ms past it, and the call has 150 ms to go out.
		proxy.SetReplyDelay(0)
		require.NoError(t, eng.Load(context.Background()))
		require.NoError(t, rdb.Ping(context.Background()).Err()) // a pooled connection (Load's pipeline left none here)
		proxy.SetReplyDelay(300 * time.Millisecond)
		ctx, cancel := context.WithTimeout(context.Background(), 150*time.Millisecond)
		_, err = eng.Book(ctx, "k", lim, throttle.Request{N: 1, MaxWait: 0})
		cancel()
		require.Equal(t, 1, obs.snap().refused, "call %d: the test's premise: the call went out (and was refused in Redis)", i)
		require.ErrorIs(t, err, context.DeadlineExceeded, "call %d", i)
		require.NotErrorIs(t, err, throttle.ErrUnavailable, "call %d", i)
		open, _ := eng.Unavailable()
		require.False(t, open, "call %d: the breaker opened on a caller's own deadline", i)
		_ = rdb.Close()
	}
}
