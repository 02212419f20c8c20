package pool_test

import (
	"context"
	"fmt"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/slotbook/slotbook/internal/redistest"
	"github.com/slotbook/slotbook/lease"
	"github.com/slotbook/slotbook/pool"
)

// TestReviewSortSlotLeaseOutOfOrder attacks f21497b (give-backs across
// keys sorted by Redis slot, then booking order). WithLease: each job
// books alone on a goroutine of its own, through a proxy adding 40 ms each
// way (booking replies can come back out of order), on three keys; the
// lease engine's replies are jittered so leases come in out of order.
// Each job has its own context; a random subset is cancelled at a random
// moment while calls are in flight, and the pool is closed (at once or
// after a while, or while cancels still go on). Oracle: once all settles,
// each key's stored TATs equal a textbook GCRA over the slots of the jobs
// that ran (reviewEnv.check reads the keys before Redis TIME).
func TestReviewSortSlotLeaseOutOfOrder(t *testing.T) {
	t.Parallel()
	e := newReviewEnv(t, 40*time.Millisecond)
	leng, lpx := flightsEngine(t, redistest.Prefix(t)+"lease:")
	keys := []string{"a", "b", "c"}
	const rounds = 6
	for i := range rounds {
		name := fmt.Sprintf("ss%d", i)
		ok := t.Run(name, func(t *testing.T) {
			lpx.SetReplyDelay(0)
			sem, err := lease.New(leng, name, 64, lease.WithTTL(30*time.Second), lease.WithPollInterval(5*time.Millisecond))
			require.NoError(t, err)
			defer func() { _ = sem.Close(context.Background()) }()
			p, err := pool.New(e.limiter(t, name), pool.WithWorkers(32), pool.WithLease(sem))
			require.NoError(t, err)
			defer func() { _ = p.Close(context.Background()) }()
			heads, _ := reviewHeads(t, p, keys)

			jobs := map[string][]*pool.Job{}
			for k, key := range keys {
				jobs[key] = []*pool.Job{heads[k]}
			}
			var cancels []context.CancelFunc
			stopJitter := make(chan struct{})
			jitterDone := make(chan struct{})
			go func() {
				defer close(jitterDone)
				for {
					select {
					case <-stopJitter:
						lpx.SetReplyDelay(0)
						return
					case <-time.After(3 * time.Millisecond):
						lpx.SetReplyDelay(time.Duration(rand.IntN(30)) * time.Millisecond)
					}
				}
			}()
			for n := range 5 {
				for _, key := range keys {
					ctx, c := context.WithCancel(context.Background())
					cancels = append(cancels, c)
					j, err := p.Submit(ctx, key, func(context.Context) error { return nil })
					require.NoError(t, err)
					jobs[key] = append(jobs[key], j)
				}
				if n%2 == 1 {
					time.Sleep(time.Duration(rand.IntN(15)) * time.Millisecond)
				}
			}
			// Cancel a random half, spread over ~120 ms (calls in flight
			// take 80 ms a round trip).
			perm := rand.Perm(len(cancels))
			cancelDone := make(chan struct{})
			go func() {
				defer close(cancelDone)
				for _, x := range perm[:len(perm)/2] {
					time.Sleep(time.Duration(rand.IntN(15)) * time.Millisecond)
					cancels[x]()
				}
			}()
			switch i % 3 {
			case 0:
				<-cancelDone
				time.Sleep(time.Duration(rand.IntN(100)) * time.Millisecond)
			case 1:
				time.Sleep(time.Duration(rand.IntN(60)) * time.Millisecond)
			}
			require.NoError(t, p.Close(context.Background()))
			<-cancelDone
			close(stopJitter)
			<-jitterDone
			for _, c := range cancels {
				c()
			}
			require.NoError(t, p.Wait(context.Background()))
			for _, key := range keys {
				e.check(t, name, key, jobs[key], nil, context.Canceled, pool.ErrClosed)
			}
		})
		if !ok {
			return
		}
	}
}
