package reserve_test

// Review of 9494129 (reserve's internal give-back through
// throttle.Engine.RefundUnused) through the public API. Oracle of its
// own: the slots that ran, on the Redis clock (Booking().At of the
// reservations whose holders got them and returned from Wait without
// error), are checked against the arrival curve of the limit (at most
// Burst+1+floor(d/I) units in any window of length d; rmaArrivalCurve).

import (
	"context"
	"fmt"
	"math/rand/v2"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/slotbook/slotbook/internal/redistest"
	"github.com/slotbook/slotbook/reserve"
	"github.com/slotbook/slotbook/throttle"
)

// ruRig is a limiter through a proxy and one on the same keys straight
// to Redis.
type ruRig struct {
	p      *redistest.Proxy
	viaP   *reserve.Limiter
	direct *reserve.Limiter
}

// jitter holds every reply back 0 to 30 ms, a new delay drawn every
// period, until the returned stop is called, which lets replies through
// at once again.
func (rg ruRig) jitter(every time.Duration) (stop func()) {
	done := make(chan struct{})
	ended := make(chan struct{})
	go func() {
		defer close(ended)
		for {
			select {
			case <-done:
				rg.p.SetReplyDelay(0)
				return
			case <-time.After(every):
				rg.p.SetReplyDelay(time.Duration(rand.IntN(30)) * time.Millisecond)
			}
		}
	}()
	var once sync.Once
	return func() { once.Do(func() { close(done); <-ended }) }
}

func ruNew(t *testing.T, lim throttle.Limit, opts ...reserve.Option) ruRig {
	t.Helper()
	srv := redistest.Shared(t)
	prefix := redistest.Prefix(t)
	p := redistest.NewProxy(t, srv.Addr)
	rdb := p.Client(t, srv, func(o *redis.Options) { o.PoolSize = 20 })
	eng, err := throttle.New(rdb, throttle.WithPrefix(prefix), throttle.WithTimeout(5*time.Second))
	require.NoError(t, err)
	redistest.UntilOK(t, func() error { return eng.Load(context.Background()) })
	deng, err := throttle.New(srv.Client(t), throttle.WithPrefix(prefix), throttle.WithTimeout(5*time.Second))
	require.NoError(t, err)
	opts = append([]reserve.Option{reserve.WithoutMaxWait()}, opts...)
	viaP, err := reserve.New(eng, "ru", lim, opts...)
	require.NoError(t, err)
	direct, err := reserve.New(deng, "ru", lim, opts...)
	require.NoError(t, err)
	return ruRig{p: p, viaP: viaP, direct: direct}
}

// TestReviewUnusedCancelLostThenWaitEnds: a Reservation (slot S, one per
// 2 s, burst 0) whose Cancel loses its reply (held past the Cancel's
// deadline, S+200ms) while another goroutine's Wait on it ends before S
// (at S-300ms): Wait's give-back waits for Cancel to let go, and goes out
// past S. Cancel's refund has run in Redis (its tombstone lives until S);
// meanwhile c booked the room it gave back (same slot, same end) and its
// holder acted at S. Wait's give-back (RefundUnused) then gives back c's
// room, and d runs early: three units within 2 s.
func TestReviewUnusedCancelLostThenWaitEnds(t *testing.T) {
	t.Parallel()
	const I = 2 * time.Second
	lim := throttle.Every(I, 1, 0)
	for _, co := range []bool{true, false} {
		t.Run(fmt.Sprintf("coalescing=%v", co), func(t *testing.T) {
			t.Parallel()
			rg := ruNew(t, lim, reserve.WithCoalescing(co))
			bg := context.Background()
			a, err := rg.viaP.Reserve(bg, "k")
			require.NoError(t, err)
			require.True(t, a.OK())
			require.NoError(t, a.Wait(bg))
			r, err := rg.viaP.Reserve(bg, "k")
			require.NoError(t, err)
			require.True(t, r.OK())
			S := r.SlotAt()

			rg.p.SetReplyDelay(10 * time.Second)
			cancelErr := make(chan error, 1)
			go func() {
				cctx, cancel := context.WithDeadline(bg, S.Add(200*time.Millisecond))
				defer cancel()
				cancelErr <- r.Cancel(cctx)
			}()
			time.Sleep(200 * time.Millisecond) // the refund has run in Redis
			c, err := rg.direct.Reserve(bg, "k")
			require.NoError(t, err)
			require.True(t, c.OK())
			require.Equal(t, r.Booking().At, c.Booking().At, "c takes the room Cancel gave back")

			waitErr := make(chan error, 1)
			go func() {
				wctx, cancel := context.WithDeadline(bg, S.Add(-300*time.Millisecond))
				defer cancel()
				waitErr <- r.Wait(wctx)
			}()
			require.NoError(t, c.Wait(bg)) // c's holder acts at S
			time.Sleep(100 * time.Millisecond)
			rg.p.SetReplyDelay(0)
			require.Error(t, <-cancelErr, "Cancel's reply was held past its deadline")
			require.Error(t, <-waitErr)

			d, err := rg.direct.Reserve(bg, "k")
			require.NoError(t, err)
			require.True(t, d.OK())
			if d.Booking().At.Sub(c.Booking().At) >= I {
				// Either the defect is not there or the machine was slow
				// (the give-back went out after c's end): d waited.
				return
			}
			rmaArrivalCurve(t, lim, []rmaSlot{
				{a.Booking().At.UnixMicro(), 1}, {c.Booking().At.UnixMicro(), 1}, {d.Booking().At.UnixMicro(), 1},
			}, "a, c, then d")
		})
	}
}

// TestReviewUnusedRandomCancels: callers of one key (10/s, burst 2),
// coalescing on and off, replies held 0 to 30 ms at random, each caller's
// context cancelled at a random moment (some while its call flies, some
// while it waits, some not at all); some callers Cancel (public) their
// reservation after a random pause instead of waiting. The slots of the
// callers who got a Reservation and returned from Wait without error
// must keep the limit on the Redis clock. Layered: the same with a
// second limit (4 per 2 s, burst 5).
func TestReviewUnusedRandomCancels(t *testing.T) {
	t.Parallel()
	for _, layered := range []bool{false, true} {
		for _, co := range []bool{true, false} {
			t.Run(fmt.Sprintf("layered=%v/coalescing=%v", layered, co), func(t *testing.T) {
				t.Parallel()
				lims := []throttle.Limit{throttle.PerSecond(10, 2)}
				if layered {
					lims = append(lims, throttle.Every(2*time.Second, 4, 5))
				}
				opts := []reserve.Option{reserve.WithCoalescing(co)}
				if layered {
					opts = append(opts, reserve.WithLimit(lims[1]))
				}
				rg := ruNew(t, lims[0], opts...)
				stop := rg.jitter(20 * time.Millisecond)
				var (
					mu  sync.Mutex
					ran []rmaSlot
					wg  sync.WaitGroup
				)
				for i := range 60 {
					wg.Go(func() {
						time.Sleep(time.Duration(rand.IntN(1500)) * time.Millisecond)
						ctx, cancel := context.WithCancel(context.Background())
						defer cancel()
						if rand.IntN(4) != 0 {
							time.AfterFunc(time.Duration(rand.IntN(600))*time.Millisecond, cancel)
						}
						r, err := rg.viaP.ReserveN(ctx, "k", 1+i%2)
						if err != nil || !r.OK() {
							return
						}
						if rand.IntN(5) == 0 {
							time.Sleep(time.Duration(rand.IntN(300)) * time.Millisecond)
							if r.Cancel(context.Background()) == nil {
								return
							}
						}
						if r.Wait(ctx) != nil {
							return
						}
						mu.Lock()
						ran = append(ran, rmaSlot{r.Booking().At.UnixMicro(), 1 + i%2})
						mu.Unlock()
					})
				}
				wg.Wait()
				stop()
				t.Logf("%d callers acted", len(ran))
				for _, l := range lims {
					rmaArrivalCurve(t, l, ran, l.String())
				}
			})
		}
	}
}
