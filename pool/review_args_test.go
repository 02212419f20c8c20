package pool_test

// Review of protocol v2 and the engine's argument lists through package
// pool: batches booked for a backlog through a client that offers only
// the Scripter methods, 40 ms away, with SCRIPT FLUSH while they run and
// jobs cancelled while booked. The jobs that ran are replayed, on the
// Redis clock, through a leaky bucket written here.

import (
	"context"
	"errors"
	"sort"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/slotbook/slotbook/internal/redistest"
	"github.com/slotbook/slotbook/pool"
	"github.com/slotbook/slotbook/reserve"
	"github.com/slotbook/slotbook/throttle"
)

type raScripterOnly struct{ redis.Scripter }

// TestReviewArgsPoolScripterOnlyUnderLatency: 160 jobs, 24 workers, one
// key under two limits; every fifth job's context ends at some point
// (queued, booked or waiting for its slot), and the scripts are flushed
// twice while the pool books. No job ran before its slot, locally, and
// the slots of the jobs that ran conform to each limit on the Redis
// clock: given-back bookings let nothing through early.
func TestReviewArgsPoolScripterOnlyUnderLatency(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	direct := srv.Client(t)
	p := redistest.NewProxy(t, srv.Addr)
	p.SetLatency(20 * time.Millisecond)
	far := p.Client(t, srv)
	eng, err := throttle.New(raScripterOnly{far}, throttle.WithPrefix(redistest.Prefix(t)), throttle.WithTimeout(10*time.Second))
	require.NoError(t, err)
	limits := []throttle.Limit{throttle.PerSecond(100, 4), throttle.PerMinute(3000, 40)}
	lim, err := reserve.New(eng, "rvp", limits[0], reserve.WithLimit(limits[1]), reserve.WithoutMaxWait())
	require.NoError(t, err)
	pl, err := pool.New(lim, pool.WithWorkers(24))
	require.NoError(t, err)
	bg := context.Background()

	var ran atomic.Int64
	jobs := make([]*pool.Job, 160)
	for i := range jobs {
		ctx := bg
		if i%5 == 0 {
			c, cancel := context.WithCancel(bg)
			time.AfterFunc(time.Duration(20+i*7)*time.Millisecond, cancel)
			ctx = c
		}
		j, err := pl.Submit(ctx, "s", func(context.Context) error { ran.Add(1); return nil })
		if err != nil {
			require.ErrorIs(t, err, context.Canceled) // ended before it was submitted
			j = nil
		}
		jobs[i] = j
		if i == 40 || i == 100 {
			require.NoError(t, direct.ScriptFlush(bg).Err())
		}
	}
	for _, j := range jobs {
		if j != nil {
			<-j.Done()
		}
	}
	require.NoError(t, pl.Close(bg))

	type cell struct{ at int64 }
	var cells []cell
	var ended int
	for i, j := range jobs {
		if j == nil {
			ended++
			continue
		}
		if err := j.Err(); err != nil {
			require.True(t, errors.Is(err, context.Canceled), "job %d: %v", i, err)
			ended++
			continue
		}
		r := j.Reservation()
		require.NotNil(t, r, "job %d ran without a reservation", i)
		require.False(t, j.Started().Before(r.SlotAt()), "job %d started before its slot", i)
		cells = append(cells, cell{r.Booking().At.UnixMicro()})
	}
	require.Equal(t, int64(len(cells)), ran.Load())
	t.Logf("%d ran, %d ended", len(cells), ended)
	sort.Slice(cells, func(a, b int) bool { return cells[a].at < cells[b].at })
	for k, l := range limits {
		d := int64(l.Rate) * 1000
		I := (l.Period.Nanoseconds() + d - 1) / d
		tau := I * int64(l.Burst)
		var x, lct int64
		for i, c := range cells {
			x = max(0, x-(c.at-lct))
			require.LessOrEqual(t, x, tau, "limit %d: job %d of %d (at %d) ran early by %d µs", k, i, len(cells), c.at, x-tau)
			x += I
			lct = c.at
		}
	}
}
