package pool_test

// Review of 9f876c5/356f88e (throttle.WithMergeAt) through package pool:
// many keys, each with one job in its backlog at a time, so that the pool
// books batches of one (single bookings), which the engine merges once
// four are in flight. Checked on the Redis clock (same host) against the
// limit's arrival curve, written here.

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/slotbook/slotbook/internal/callcount"
	"github.com/slotbook/slotbook/internal/redistest"
	"github.com/slotbook/slotbook/pool"
	"github.com/slotbook/slotbook/reserve"
	"github.com/slotbook/slotbook/throttle"
)

// TestReviewMergeAtPoolSingleBookings: 24 keys, each submitting its six
// jobs one after another (the next once the last is done), through a
// client of 20 connections with replies held 20 ms. Every job runs, none
// before its slot (Booking().At, Redis clock), and the slots of each key
// pass the limit's arrival curve: Burst+1 units at once, one more per
// interval. Fewer Redis calls than jobs: bookings were merged.
func TestReviewMergeAtPoolSingleBookings(t *testing.T) {
	t.Parallel()
	srv := redistest.Shared(t)
	p := redistest.NewProxy(t, srv.Addr)
	rdb := p.Client(t, srv, func(o *redis.Options) { o.PoolSize = 20 })
	eng, err := throttle.New(rdb, throttle.WithPrefix(redistest.Prefix(t)), throttle.WithTimeout(5*time.Second))
	require.NoError(t, err)
	require.NoError(t, eng.Load(context.Background()))
	calls := callcount.Attach(rdb)
	p.SetReplyDelay(20 * time.Millisecond)

	lim := throttle.PerSecond(25, 1) // 40 ms
	l, err := reserve.New(eng, "rmapool", lim)
	require.NoError(t, err)
	pl, err := pool.New(l, pool.WithWorkers(64))
	require.NoError(t, err)
	t.Cleanup(func() { _ = pl.Close(context.Background()) })

	const keys, jobs = 24, 6
	type ran struct {
		at      int64 // slot, µs on the Redis clock
		started int64 // µs, local clock
	}
	var (
		mu   sync.Mutex
		runs = map[string][]ran{}
		wg   sync.WaitGroup
	)
	before := calls.Load()
	errs := make(chan error, keys)
	for k := range keys {
		wg.Go(func() {
			key := fmt.Sprintf("p%d", k)
			for range jobs {
				var started time.Time
				j, err := pl.Submit(context.Background(), key, func(context.Context) error {
					started = time.Now()
					return nil
				})
				if err != nil {
					errs <- err
					return
				}
				if err := j.Wait(context.Background()); err != nil {
					errs <- fmt.Errorf("%s: %w", key, err)
					return
				}
				r := j.Reservation()
				if r == nil || !r.OK() {
					errs <- fmt.Errorf("%s: job ran without a booking", key)
					return
				}
				mu.Lock()
				runs[key] = append(runs[key], ran{r.Booking().At.UnixMicro(), started.UnixMicro()})
				mu.Unlock()
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		require.NoError(t, err)
	}
	used := calls.Load() - before
	t.Logf("%d jobs on %d keys, %d Redis calls", keys*jobs, keys, used)
	require.Less(t, used, int64(keys*jobs), "nothing merged")

	ns := lim.Period.Nanoseconds() / int64(lim.Rate)
	if lim.Period.Nanoseconds()%int64(lim.Rate) != 0 {
		ns++
	}
	I := (ns + 999) / 1000
	for key, rs := range runs {
		require.Len(t, rs, jobs, key)
		for _, r := range rs {
			require.GreaterOrEqual(t, r.started, r.at, "%s: a job started %d µs before its slot", key, r.at-r.started)
		}
		slices.SortFunc(rs, func(a, b ran) int { return int(a.at - b.at) })
		for i := range rs {
			for j := i; j < len(rs); j++ {
				units := int64(j - i + 1)
				allowed := int64(lim.Burst+1) + (rs[j].at-rs[i].at)/I
				require.LessOrEqual(t, units, allowed, "%s: %d jobs' slots within %d µs", key, units, rs[j].at-rs[i].at)
			}
		}
	}
}
