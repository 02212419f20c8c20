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

// TestReviewBook1StrReserveCancel: Reservations booked by book1.lua (one
// key, one request) and cancelled through the public API: a Cancel right
// after the booking gives its room back, so the next Reserve gets the
// very slot it had on the Redis clock (Booking().At); a second Cancel
// gives nothing more; a Cancel under a later booking gives nothing, and
// the later one keeps its slot.
func TestReviewBook1StrReserveCancel(t *testing.T) {
	t.Parallel()
	srv := redistest.Shared(t)
	rdb := srv.Client(t)
	prefix := redistest.Prefix(t)
	eng, err := throttle.New(rdb, throttle.WithPrefix(prefix), throttle.WithTimeout(5*time.Second))
	require.NoError(t, err)
	ctx := context.Background()
	lim := throttle.PerSecond(1, 1) // 1 s apart, two at once
	l, err := reserve.New(eng, "rv", lim, reserve.WithMaxWait(10*time.Second), reserve.WithCoalescing(false))
	require.NoError(t, err)
	key := "s"
	tat := func() int64 {
		v, err := rdb.Get(ctx, prefix+"rv:{s}").Int64()
		if err == redis.Nil {
			return 0
		}
		require.NoError(t, err)
		return v
	}

	r0, err := l.ReserveN(ctx, key, 2) // the burst: the key at now+2s
	require.NoError(t, err)
	require.True(t, r0.OK())
	after0 := tat()
	require.Equal(t, r0.Booking().At.UnixMicro()+2_000_000, after0)

	r1, err := l.Reserve(ctx, key) // slot after0 - 1 s
	require.NoError(t, err)
	require.True(t, r1.OK())
	require.Equal(t, after0-1_000_000, r1.Booking().At.UnixMicro())
	require.Equal(t, after0+1_000_000, tat())
	require.NoError(t, r1.Cancel(ctx))
	require.Equal(t, after0, tat(), "Cancel restores the TAT r1 was judged against")
	require.NoError(t, r1.Cancel(ctx))
	require.Equal(t, after0, tat(), "a second Cancel gives nothing")

	r2, err := l.Reserve(ctx, key)
	require.NoError(t, err)
	require.True(t, r2.OK())
	require.Equal(t, r1.Booking().At, r2.Booking().At, "r2 gets r1's slot back")
	r3, err := l.Reserve(ctx, key)
	require.NoError(t, err)
	require.True(t, r3.OK())
	require.Equal(t, r2.Booking().At.Add(time.Second), r3.Booking().At)
	require.NoError(t, r2.Cancel(ctx))
	require.Equal(t, after0+2_000_000, tat(), "r2 under r3: nothing given back")
	require.NoError(t, r3.Cancel(ctx))
	require.Equal(t, after0+1_000_000, tat(), "r3 given back")

	// A refusal (max wait 0) is exact and books nothing.
	l0, err := l.With(reserve.WithMaxWait(0))
	require.NoError(t, err)
	r4, err := l0.Reserve(ctx, key)
	require.NoError(t, err)
	require.False(t, r4.OK())
	b := r4.Booking()
	now := b.At.UnixMicro() - b.Wait.Microseconds()
	require.Equal(t, after0+1_000_000-1_000_000-now, b.Wait.Microseconds(), "refused with the exact wait")
	require.Equal(t, after0+1_000_000, tat(), "refusal wrote nothing")
	require.NoError(t, r4.Cancel(ctx))
}
