package lease_test

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/slotbook/slotbook/lease"
	"github.com/slotbook/slotbook/lease/internal/leasetest"
	"github.com/slotbook/slotbook/throttle"
)

// overtaken is a redis.Hook that, once armed, holds back the next call
// whose arguments end with mark as the network may: the caller gets a
// read timeout once its context has ended (the call may have run, as far
// as it can tell), and the call reaches Redis, through late, after
// delay, when calls sent after it have run.
type overtaken struct {
	mark    string
	armed   atomic.Bool
	late    *redis.Client
	delay   time.Duration
	arrived chan struct{}
}

func (o *overtaken) DialHook(next redis.DialHook) redis.DialHook { return next }
func (o *overtaken) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		a := cmd.Args()
		if len(a) == 0 || a[len(a)-1] != o.mark || !o.armed.CompareAndSwap(true, false) {
			return next(ctx, cmd)
		}
		<-ctx.Done()
		go func() {
			time.Sleep(o.delay)
			_ = o.late.Do(context.Background(), a...).Err()
			close(o.arrived)
		}()
		err := leasetest.ErrLostRead
		cmd.SetErr(err)
		return err
	}
}
func (o *overtaken) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}

// TestAcquireOvertakenByItsLeave: an Acquire whose context ends while its
// acquire call is on its way (the reply lost, for all the caller can
// tell) leaves the queue before it returns. Its leave call may reach
// Redis before the acquire call, which comes 200 ms later: that must not
// queue the waiter again, or the next release would grant it a lease no
// one holds, which would stand until its TTL. On a single node and on a
// Ring (each key's keeper reads its own wake-ups).
func TestAcquireOvertakenByItsLeave(t *testing.T) {
	for _, ring := range []bool{false, true} {
		t.Run(map[bool]string{false: "node", true: "ring"}[ring], func(t *testing.T) {
			e := leasetest.NewEnv(t)
			ctx := context.Background()
			o := &overtaken{mark: "wait", late: e.Srv.Client(t), delay: 200 * time.Millisecond, arrived: make(chan struct{})}
			var rdb redis.UniversalClient
			if ring {
				r := redis.NewRing(&redis.RingOptions{Addrs: map[string]string{"a": e.Srv.Addr}, ContextTimeoutEnabled: true})
				t.Cleanup(func() { _ = r.Close() })
				r.AddHook(o)
				rdb = r
			} else {
				c := e.Srv.Client(t)
				c.AddHook(o)
				rdb = c
			}
			engA, err := throttle.New(rdb, throttle.WithPrefix(e.Prefix), throttle.WithTimeout(5*time.Second))
			require.NoError(t, err)
			const ttl = 30 * time.Second
			a := leasetest.SemOn(t, engA, 1, lease.WithTTL(ttl))
			b := leasetest.SemOn(t, e.Eng, 1, lease.WithTTL(ttl))
			held, err := b.Acquire(ctx, "k")
			require.NoError(t, err)

			o.armed.Store(true)
			actx, cancel := context.WithTimeout(ctx, 50*time.Millisecond)
			_, err = a.Acquire(actx, "k")
			cancel()
			require.Error(t, err)
			require.True(t, errors.Is(err, throttle.ErrReplyLost) || errors.Is(err, context.DeadlineExceeded), "%v", err)
			<-o.arrived // the acquire call has run, after the leave call

			require.NoError(t, held.Release(ctx))
			time.Sleep(100 * time.Millisecond) // A's keeper, if it had a waiter, would have polled
			hs := e.Rdb.ZRange(ctx, e.Key("k", "h"), 0, -1).Val()
			qs := e.Rdb.ZRange(ctx, e.Key("k", "q"), 0, -1).Val()
			require.Empty(t, hs, "holders of k, which nobody holds or waits for (queue %v)", qs)
			require.Empty(t, qs, "queue of k")
			// And k is free for the next caller at once.
			l, ok, err := b.TryAcquire(ctx, "k")
			require.NoError(t, err)
			require.True(t, ok, "k free again")
			require.NoError(t, l.Release(ctx))
		})
	}
}
