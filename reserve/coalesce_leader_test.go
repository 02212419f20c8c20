package reserve_test

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/slotbook/slotbook/internal/redistest"
	"github.com/slotbook/slotbook/internal/testhook"
	"github.com/slotbook/slotbook/reserve"
	"github.com/slotbook/slotbook/throttle"
)

// TestCoalescingLoneLeaderEndsWhileQueued: a lone leader of idle key k waits
// for the one connection (held by a call on another key); callers queue
// behind it; the leader's context ends. The queued callers must all be
// served OK, the leader must get its context's error, and Redis must hold
// exactly the OK callers' bookings (none for the leader).
func TestCoalescingLoneLeaderEndsWhileQueued(t *testing.T) {
	t.Parallel()
	for _, soloBelow := range []int{1, 4} {
		t.Run(map[int]string{1: "all-queue", 4: "default-solo"}[soloBelow], func(t *testing.T) {
			t.Parallel()
			eng, p, prefix := proxiedEngine(t, 1)
			srv := redistest.Shared(t)
			direct := srv.Client(t)
			lim := throttle.PerHour(3600, 0) // one a second, no burst
			l, err := reserve.New(eng, "api", lim)
			require.NoError(t, err)
			reserve.SetSoloBelow(l, soloBelow)

			p.SetReplyDelay(1500 * time.Millisecond)
			var order []string
			var mu sync.Mutex
			done := func(s string) { mu.Lock(); order = append(order, s); mu.Unlock() }
			holdDone := make(chan struct{})
			go func() {
				defer close(holdDone)
				if _, err := l.Reserve(context.Background(), "hold"); err != nil {
					t.Errorf("hold: %v", err)
				}
				done("hold")
			}()
			require.Eventually(t, func() bool {
				return direct.Exists(context.Background(), prefix+"api:{hold}").Val() == 1
			}, 5*time.Second, time.Millisecond, "hold's call reached Redis")

			lctx, lcancel := context.WithCancel(context.Background())
			defer lcancel()
			leaderErr := make(chan error, 1)
			go func() {
				r, err := l.Reserve(lctx, "k")
				if err == nil && r.OK() {
					err = errors.New("leader got OK")
				}
				done("leader")
				leaderErr <- err
			}()
			time.Sleep(50 * time.Millisecond) // the leader first in (checked below by QueueLen)

			const m = 6
			queued := m - (soloBelow - 1) // the first soloBelow-1 send alone
			var wg sync.WaitGroup
			res := make([]*reserve.Reservation, m)
			errs := make([]error, m)
			for i := range m {
				wg.Add(1)
				go func() {
					defer wg.Done()
					ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
					defer cancel()
					res[i], errs[i] = l.Reserve(ctx, "k")
				}()
				if i < soloBelow-1 {
					time.Sleep(20 * time.Millisecond) // solo ones counted in before the rest
				}
			}
			require.Eventually(t, func() bool { return reserve.QueueLen(l, "k") == queued },
				5*time.Second, time.Millisecond, "callers queued behind the leader")
			lcancel() // the leader's context ends while it waits for the connection
			lerr := <-leaderErr
			require.ErrorIs(t, lerr, context.Canceled)

			wg.Wait()
			<-holdDone
			t.Logf("order: %q", order)
			var last time.Time
			for i := range m {
				require.NoError(t, errs[i], "caller %d", i)
				require.True(t, res[i].OK(), "caller %d: %v", i, res[i].Err())
				if at := res[i].Booking().At; at.After(last) {
					last = at
				}
			}
			tat, err := direct.Get(context.Background(), prefix+"api:{k}").Int64()
			require.NoError(t, err)
			require.Equal(t, last.UnixMicro()+lim.Interval().Microseconds(), tat,
				"Redis holds exactly the OK callers' bookings of k")
		})
	}
}

// TestCoalescingDetachKeepsValues: the test clock (a context value) reaches the
// scripts through a lone leader's call and a solo caller's call, both on
// waitbound.Detach.
func TestCoalescingDetachKeepsValues(t *testing.T) {
	t.Parallel()
	eng, p, _ := proxiedEngine(t, 1)
	lim := throttle.PerHour(3600, 0)
	l, err := reserve.New(eng, "api", lim)
	require.NoError(t, err)
	base := time.Date(2030, 1, 1, 0, 0, 0, 0, time.UTC)
	ctx := testhook.WithNow(context.Background(), base.UnixMicro())

	// lone leader on an idle key
	r, err := l.Reserve(ctx, "idle")
	require.NoError(t, err)
	require.True(t, r.OK())
	require.Equal(t, base.UnixMicro(), r.Booking().At.UnixMicro(), "lone leader: test clock reached the script")

	// solo beside a call in flight
	p.SetReplyDelay(500 * time.Millisecond)
	inflight := make(chan struct{})
	go func() {
		defer close(inflight)
		_, _ = l.Reserve(context.Background(), "s")
	}()
	time.Sleep(100 * time.Millisecond)
	r2, err := l.Reserve(ctx, "s")
	<-inflight
	require.NoError(t, err)
	require.True(t, r2.OK())
	t.Logf("solo booking at %v (base %v)", r2.Booking().At, base)
	require.False(t, r2.Booking().At.Before(base), "solo: test clock reached the script")
}

// TestCoalescingLoneLeaderCancelAroundConnection: a lone leader of an idle key
// (the connection held by a call on another key) is cancelled at varied
// moments around the time the connection frees. Whatever it gets, Redis
// must hold its booking only if it got OK.
func TestCoalescingLoneLeaderCancelAroundConnection(t *testing.T) {
	t.Parallel()
	eng, p, prefix := proxiedEngine(t, 1)
	direct := redistest.Shared(t).Client(t)
	lim := throttle.PerHour(3600, 0)
	l, err := reserve.New(eng, "api", lim)
	require.NoError(t, err)
	const delay = 30 * time.Millisecond
	p.SetReplyDelay(delay)
	outcomes := map[string]int{}
	for round := range 60 {
		hold, key := "h"+string(rune('A'+round%26))+time.Now().Format("150405.000000"), "k"+time.Now().Format("150405.000000")
		pre, err := l.Reserve(context.Background(), key) // so the leader's slot is ahead (refundable)
		require.NoError(t, err)
		preEnd := pre.Booking().At.UnixMicro() + lim.Interval().Microseconds()
		hdone := make(chan struct{})
		go func() {
			defer close(hdone)
			if _, err := l.Reserve(context.Background(), hold); err != nil {
				t.Errorf("hold: %v", err)
			}
		}()
		require.Eventually(t, func() bool {
			return direct.Exists(context.Background(), prefix+"api:{"+hold+"}").Val() == 1
		}, 5*time.Second, 100*time.Microsecond)
		ctx, cancel := context.WithCancel(context.Background())
		timer := time.AfterFunc(delay-10*time.Millisecond+time.Duration(round%30)*time.Millisecond, cancel)
		r, err := l.Reserve(ctx, key)
		timer.Stop()
		cancel()
		<-hdone
		exists := direct.Exists(context.Background(), prefix+"api:{"+key+"}").Val() == 1
		var tat int64
		if exists {
			tat, _ = direct.Get(context.Background(), prefix+"api:{"+key+"}").Int64()
		}
		switch {
		case err == nil && r.OK():
			outcomes["ok"]++
			require.Equal(t, r.Booking().At.UnixMicro()+lim.Interval().Microseconds(), tat, "round %d", round)
		case errors.Is(err, context.Canceled):
			outcomes["canceled"]++
			require.Equal(t, preEnd, tat, "round %d: cancelled leader (%v) left a booking", round, err)
		default:
			t.Fatalf("round %d: %v %v", round, r, err)
		}
	}
	t.Logf("outcomes: %v", outcomes)
}
