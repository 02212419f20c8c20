package reserve_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/slotbook/slotbook/internal/redistest"
	"github.com/slotbook/slotbook/reserve"
	"github.com/slotbook/slotbook/throttle"
)

// TestCoalescingLeavesWaitWhenContextEnds: with every connection busy
// (PoolSize 1, a call for key "k" in flight, its reply held), a caller
// whose context ends while it waits for a connection returns then, as an
// uncoalesced caller does in the same state, and not once the call in
// flight has come back: sent alone beside that call (same key), or leading
// a batch of one (an idle key). Nothing was sent for it, so nothing needs
// giving back.
func TestCoalescingLeavesWaitWhenContextEnds(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct{ name, key string }{
		{"sent alone beside the call in flight", "k"},
		{"leading a batch of one on an idle key", "b"},
	} {
		t.Run(tc.key, func(t *testing.T) {
			t.Parallel()
			leavesWait(t, tc.name, tc.key)
		})
	}
}

func leavesWait(t *testing.T, name, key string) {
	// A server of its own: another test's SCRIPT FLUSH on the shared one
	// made a's call a NOSCRIPT round trip, held 2 s, and then an EVAL, so
	// that its booking had not reached Redis when the test looked.
	srv := redistest.Start(t)
	eng, p, prefix := proxiedEngineOn(t, srv, 1)
	// 10 a second: a's booking keeps its key for 101 ms, which the test looks for.
	l, err := reserve.New(eng, "api", throttle.PerSecond(10, 100))
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
		if _, err := l.Reserve(context.Background(), "k"); err != nil {
			t.Errorf("a: %v", err)
		}
		done("a (the call in flight)")
	}()
	direct := srv.Client(t)
	require.Eventually(t, func() bool {
		return direct.Exists(context.Background(), prefix+"api:{k}").Val() == 1
	}, 5*time.Second, time.Millisecond, "a's call reached Redis")

	for _, c := range []struct {
		name, key string
		l         *reserve.Limiter
	}{{"b (coalesced, " + name + ")", key, l}, {"c (uncoalesced control)", "c", control}} {
		wg.Add(1)
		go func() {
			defer wg.Done()
			ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
			defer cancel()
			_, err := c.l.Reserve(ctx, c.key)
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

// proxiedEngine returns an engine on the shared server whose client (with
// poolSize connections at most, 0 for go-redis's default) goes through a
// latency proxy, with opts after its prefix and a 10 s timeout; and the
// proxy and the prefix.
func proxiedEngine(t *testing.T, poolSize int, opts ...throttle.Option) (*throttle.Engine, *redistest.Proxy, string) {
	t.Helper()
	return proxiedEngineOn(t, redistest.Shared(t), poolSize, opts...)
}

// proxiedEngineOn is proxiedEngine on the server srv.
func proxiedEngineOn(t *testing.T, srv *redistest.Server, poolSize int, opts ...throttle.Option) (*throttle.Engine, *redistest.Proxy, string) {
	t.Helper()
	p := redistest.NewProxy(t, srv.Addr)
	rdb := p.Client(t, srv, func(o *redis.Options) {
		if poolSize > 0 {
			o.PoolSize = poolSize
		}
	})
	prefix := redistest.Prefix(t)
	eng, err := throttle.New(rdb, append([]throttle.Option{throttle.WithPrefix(prefix), throttle.WithTimeout(10 * time.Second)}, opts...)...)
	require.NoError(t, err)
	require.NoError(t, eng.Load(context.Background()))
	return eng, p, prefix
}

// TestCoalescingSoloUnderLatencyBooksOnce: at 40 ms each way, callers of one
// key, few (sent alone) and many (queued), repeated, each get one slot,
// and the slots are one interval apart: nothing booked twice or lost.
func TestCoalescingSoloUnderLatencyBooksOnce(t *testing.T) {
	t.Parallel()
	eng, p, prefix := proxiedEngine(t, 32)
	srv := redistest.Shared(t)
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

// TestCoalescingSoloRedisAway: when Redis goes away while ten callers of
// one key are in flight (the first, three sent alone beside it) or queued,
// every caller returns, booked or with an error matching ErrUnavailable:
// none hangs.
func TestCoalescingSoloRedisAway(t *testing.T) {
	t.Parallel()
	eng, p, _ := proxiedEngine(t, 0, throttle.WithTimeout(200*time.Millisecond), throttle.WithProbeBackoff(time.Millisecond, 2*time.Millisecond))
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

// TestCoalescingSoloCancelAroundConnection: a solo caller b (beside a's call
// in flight, PoolSize 1) is cancelled at varied moments around the time
// a's reply frees the connection. Whatever b gets, Redis must hold exactly
// the bookings of the OK reservations: a's, plus b's only if b got OK
// (a booking made for a cancelled b must have been given back).
func TestCoalescingSoloCancelAroundConnection(t *testing.T) {
	eng, p, prefix := proxiedEngine(t, 1)
	srv := redistest.Shared(t)
	lim := throttle.PerHour(3600, 0)
	l, err := reserve.New(eng, "api", lim)
	require.NoError(t, err)
	direct := srv.Client(t)
	const delay = 30 * time.Millisecond
	p.SetReplyDelay(delay)
	outcomes := map[string]int{}
	for round := 0; round < 90; round++ {
		key := fmt.Sprintf("k%d", round)
		var ra *reserve.Reservation
		aDone := make(chan struct{})
		go func() {
			defer close(aDone)
			var err error
			ra, err = l.Reserve(context.Background(), key)
			if err != nil || !ra.OK() {
				t.Errorf("a: %v %v", ra, err)
			}
		}()
		require.Eventually(t, func() bool {
			return direct.Exists(context.Background(), prefix+"api:{"+key+"}").Val() == 1
		}, 5*time.Second, 100*time.Microsecond)
		ctx, cancel := context.WithCancel(context.Background())
		off := delay - 10*time.Millisecond + time.Duration(round%30)*3*time.Millisecond
		timer := time.AfterFunc(off, cancel)
		rb, errb := l.Reserve(ctx, key)
		timer.Stop()
		cancel()
		<-aDone
		if t.Failed() {
			return
		}
		tat, err := direct.Get(context.Background(), prefix+"api:{"+key+"}").Int64()
		require.NoError(t, err)
		aEnd := ra.Booking().At.UnixMicro() + lim.Interval().Microseconds()
		switch {
		case errb == nil && rb.OK():
			outcomes["ok"]++
			require.Equal(t, rb.Booking().At.UnixMicro()+lim.Interval().Microseconds(), tat, "round %d: b OK, Redis holds a and b", round)
		case errors.Is(errb, context.Canceled):
			outcomes["canceled"]++
			require.Equal(t, aEnd, tat, "round %d: b cancelled (%v), Redis must hold a's booking only", round, errb)
		default:
			t.Fatalf("round %d: b got %v %v", round, rb, errb)
		}
	}
	t.Logf("outcomes: %v", outcomes)
}
