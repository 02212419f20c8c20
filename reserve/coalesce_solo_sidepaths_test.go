package reserve_test

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/slotbook/slotbook/internal/redistest"
	"github.com/slotbook/slotbook/reserve"
	"github.com/slotbook/slotbook/throttle"
)

// TestCoalescingSoloLeavesWaitWhenContextEnds: a caller sent alone beside
// the call in flight, whose context ends while it waits for one of the
// client's connections (all busy), returns when its context ends, as an
// uncoalesced caller does in the same state, and not only once the call
// in flight has come back.
func TestCoalescingSoloLeavesWaitWhenContextEnds(t *testing.T) {
	t.Parallel()
	srv := redistest.Shared(t)
	p := redistest.NewProxy(t, srv.Addr)
	rdb := p.Client(t, srv, func(o *redis.Options) { o.PoolSize = 1 })
	prefix := redistest.Prefix(t)
	eng, err := throttle.New(rdb, throttle.WithPrefix(prefix), throttle.WithTimeout(10*time.Second))
	require.NoError(t, err)
	require.NoError(t, eng.Load(context.Background()))
	l, err := reserve.New(eng, "api", throttle.PerSecond(1000, 100))
	require.NoError(t, err)
	control, err := l.With(reserve.WithCoalescing(false))
	require.NoError(t, err)

	p.SetReplyDelay(2 * time.Second) // a's request reaches Redis at once, its reply is held
	var mu sync.Mutex
	var order []string
	done := func(s string) { mu.Lock(); order = append(order, s); mu.Unlock() }
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		_, err := l.Reserve(context.Background(), "k")
		if err != nil {
			t.Errorf("a: %v", err)
		}
		done("a (the call in flight)")
	}()
	direct := srv.Client(t)
	require.Eventually(t, func() bool {
		return direct.Exists(context.Background(), prefix+"api:{k}").Val() == 1
	}, 5*time.Second, time.Millisecond, "a's call reached Redis")

	for _, c := range []struct {
		name string
		l    *reserve.Limiter
	}{{"b (coalesced, sent alone)", l}, {"c (uncoalesced control)", control}} {
		wg.Add(1)
		go func() {
			defer wg.Done()
			ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
			defer cancel()
			_, err := c.l.Reserve(ctx, "k")
			if !errors.Is(err, context.DeadlineExceeded) {
				t.Errorf("%s: got %v, want the context's error", c.name, err)
			}
			done(c.name)
		}()
	}
	wg.Wait()
	t.Logf("returned in this order: %q", order)
	require.Equal(t, "a (the call in flight)", order[2],
		"callers whose context ended 100 ms in returned before the 2 s call in flight came back")
}

// TestCoalescingSoloUnderLatencyBooksOnce: at 40 ms each way, callers of one
// key, few (sent alone) and many (queued), repeated, each get one slot,
// and the slots are one interval apart: nothing booked twice or lost.
func TestCoalescingSoloUnderLatencyBooksOnce(t *testing.T) {
	t.Parallel()
	srv := redistest.Shared(t)
	p := redistest.NewProxy(t, srv.Addr)
	rdb := p.Client(t, srv, func(o *redis.Options) { o.PoolSize = 32 })
	prefix := redistest.Prefix(t)
	eng, err := throttle.New(rdb, throttle.WithPrefix(prefix), throttle.WithTimeout(10*time.Second))
	require.NoError(t, err)
	require.NoError(t, eng.Load(context.Background()))
	lim := throttle.PerHour(3600, 0) // one a second, no burst: every slot distinct
	l, err := reserve.New(eng, "api", lim)
	require.NoError(t, err)
	p.SetLatency(40 * time.Millisecond)
	ctx := context.Background()
	var all []time.Time
	for _, callers := range []int{2, 3, 4, 5, 12} {
		for rep := 0; rep < 2; rep++ {
			var mu sync.Mutex
			var wg sync.WaitGroup
			for i := 0; i < callers; i++ {
				wg.Add(1)
				go func() {
					defer wg.Done()
					r, err := l.Reserve(ctx, "k")
					if err != nil || !r.OK() {
						t.Errorf("callers %d: %v %v", callers, r, err)
						return
					}
					mu.Lock()
					all = append(all, r.Booking().At)
					mu.Unlock()
				}()
			}
			wg.Wait()
		}
	}
	n := len(all)
	require.Equal(t, 2*(2+3+4+5+12), n)
	seen := map[int64]bool{}
	lo, hi := all[0], all[0]
	for _, at := range all {
		require.False(t, seen[at.UnixMicro()], "slot %v given twice", at)
		seen[at.UnixMicro()] = true
		if at.Before(lo) {
			lo = at
		}
		if at.After(hi) {
			hi = at
		}
	}
	require.Equal(t, time.Duration(n-1)*lim.Interval(), hi.Sub(lo), "slots back to back, one interval apart")
	v, err := srv.Client(t).Get(ctx, prefix+"api:{k}").Int64()
	require.NoError(t, err)
	require.Equal(t, hi.UnixMicro()+lim.Interval().Microseconds(), v, "Redis holds one booking per caller")
}

// TestCoalescingSoloRedisAway: with Redis unreachable,
// and queued all get an error matching ErrUnavailable, none hangs, and no
// caller count is left behind (the next callers go alone again and book).
func TestCoalescingSoloRedisAway(t *testing.T) {
	t.Parallel()
	srv := redistest.Shared(t)
	p := redistest.NewProxy(t, srv.Addr)
	rdb := p.Client(t, srv)
	prefix := redistest.Prefix(t)
	eng, err := throttle.New(rdb, throttle.WithPrefix(prefix), throttle.WithTimeout(200*time.Millisecond), throttle.WithProbeBackoff(time.Millisecond, 2*time.Millisecond))
	require.NoError(t, err)
	require.NoError(t, eng.Load(context.Background()))
	l, err := reserve.New(eng, "api", throttle.PerSecond(1000, 100))
	require.NoError(t, err)
	p.SetReplyDelay(100 * time.Millisecond)
	ctx := context.Background()
	var wg sync.WaitGroup
	errs := make(chan error, 10)
	for i := 0; i < 10; i++ {
		wg.Add(1)
		go func() { defer wg.Done(); _, err := l.Reserve(ctx, "k"); errs <- err }()
	}
	time.Sleep(20 * time.Millisecond)
	p.Close()
	wg.Wait()
	close(errs)
	for err := range errs {
		if err != nil {
			require.ErrorIs(t, err, throttle.ErrUnavailable)
		}
	}
}
