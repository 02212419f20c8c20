package reserve_test

import (
	"context"
	"sort"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/slotbook/slotbook/internal/callcount"
	"github.com/slotbook/slotbook/internal/redistest"
	"github.com/slotbook/slotbook/internal/testhook"
	"github.com/slotbook/slotbook/reserve"
	"github.com/slotbook/slotbook/throttle"
)

// TestRunsCoalescedLayeredUnderLatency: 40 ms each way, 96
// concurrent callers of one key under two limits, asking 1 or 2 units
// alike in runs (the coalesced batches), on a frozen test clock after a
// fill (so every slot waits). Replayed in slot order (bookings' slots rise
// strictly once none is immediate), each wait is the review GCRA's; then
// every reservation is cancelled latest first, and both keys are back
// where the fill left them: every coalesced booking's TATs before and
// after, which the client works out for each request of a run, were the
// ones Redis used.
func TestRunsCoalescedLayeredUnderLatency(t *testing.T) {
	t.Parallel()
	srv := redistest.Shared(t)
	p := redistest.NewProxy(t, srv.Addr)
	rdb := p.Client(t, srv, func(o *redis.Options) { o.PoolSize = 32 })
	prefix := redistest.Prefix(t)
	eng, err := throttle.New(rdb, throttle.WithPrefix(prefix), throttle.WithTimeout(10*time.Second))
	require.NoError(t, err)
	require.NoError(t, eng.Load(context.Background()))
	limits := []throttle.Limit{throttle.PerSecond(20, 2), throttle.PerMinute(600, 30)}
	l, err := reserve.New(eng, "rvc", limits[0], reserve.WithLimit(limits[1]), reserve.WithoutMaxWait())
	require.NoError(t, err)
	x := time.Now().UnixMicro()
	ctx := testhook.WithNow(context.Background(), x)
	g := newReviewModel(limits)
	// Fill: burst+1 of the first limit, booked alone.
	for i := 0; i < 3; i++ {
		r, err := l.Reserve(ctx, "s")
		require.NoError(t, err)
		want := g.book(x, 1, throttle.MaxHorizon.Microseconds())
		require.Equal(t, want.wait, r.Booking().Wait.Microseconds())
	}
	keys := reviewKeys(l, prefix, "s")
	reviewCheck(t, rdb, keys, g, "after the fill")
	filled := append([]int64(nil), g.tat...)

	calls := callcount.Attach(rdb)
	p.SetLatency(40 * time.Millisecond)
	const callers = 96
	rs := make([]*reserve.Reservation, callers)
	var wg sync.WaitGroup
	for i := range rs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			n := 1 + (i/8)%2 // runs of 8 alike
			r, err := l.ReserveN(ctx, "s", n)
			if err != nil {
				t.Error(err)
				return
			}
			rs[i] = r
		}()
	}
	wg.Wait()
	p.SetLatency(0)
	sent := calls.Load()
	t.Logf("%d callers in %d calls", callers, sent)
	require.Less(t, sent, int64(callers/4), "coalesced into batches")
	if t.Failed() {
		return
	}
	sort.Slice(rs, func(a, b int) bool { return rs[a].Booking().At.Before(rs[b].Booking().At) })
	for i, r := range rs {
		require.True(t, r.OK(), "caller %d: %v", i, r.Err())
		want := g.book(x, r.Booking().N, throttle.MaxHorizon.Microseconds())
		require.True(t, want.ok)
		require.Equal(t, want.wait, r.Booking().Wait.Microseconds(), "booking %d in slot order (n %d)", i, r.Booking().N)
	}
	reviewCheck(t, rdb, keys, g, "after the callers")
	for i := len(rs) - 1; i >= 0; i-- {
		require.NoError(t, rs[i].Cancel(ctx))
	}
	copy(g.tat, filled)
	reviewCheck(t, rdb, keys, g, "after cancelling latest first")
}
