package pool_test

import (
	"context"
	"slices"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/slotbook/slotbook/internal/redistest"
	"github.com/slotbook/slotbook/pool"
	"github.com/slotbook/slotbook/reserve"
	"github.com/slotbook/slotbook/throttle"
)

// BenchmarkBacklog is the pool's headline figure: 20 workers and a backlog
// of 200 jobs under 10/s burst 5 (about 20 s an iteration). It reports
// Redis calls per job, refusals, and the spacing of the jobs' slots (Redis
// clock) and of their recorded starts (local clock, which adds scheduling
// delay). Targets: at most 0.10 calls per job, mean spacing 100ms ± 1%,
// minimum spacing at least 98ms, no refusals.
//
//	go test -run XXX -bench Backlog -benchtime 1x ./pool
func BenchmarkBacklog(b *testing.B) {
	redistest.Shared(b).RequireReal(b)
	limit := throttle.PerSecond(10, 5)
	for i := 0; i < b.N; i++ {
		proc := newProcess(b, redistest.Prefix(b)+"bench:", limit, reserve.WithMaxWait(2*time.Second))
		p, err := pool.New(proc.lim, pool.WithWorkers(20))
		require.NoError(b, err)
		ctx := context.Background()
		before := proc.calls.Load()
		jobs := make([]*pool.Job, 200)
		for k := range jobs {
			jobs[k], err = p.Submit(ctx, "k", func(context.Context) error { return nil })
			require.NoError(b, err)
		}
		require.NoError(b, p.Wait(ctx))
		calls := proc.calls.Load() - before
		require.NoError(b, p.Close(ctx))

		var slots, starts []time.Time
		refused := 0
		for _, j := range jobs {
			if j.Err() != nil {
				refused++
				continue
			}
			slots = append(slots, j.Reservation().Booking().At)
			starts = append(starts, j.Started())
		}
		slotMean, slotMin := spacing(slots, limit.Burst)
		startMean, startMin := spacing(starts, limit.Burst)
		b.ReportMetric(float64(calls)/float64(len(jobs)), "calls/job")
		b.ReportMetric(float64(refused), "refused")
		b.ReportMetric(ms(slotMean), "slot-mean-ms")
		b.ReportMetric(ms(slotMin), "slot-min-ms")
		b.ReportMetric(ms(startMean), "start-mean-ms")
		b.ReportMetric(ms(startMin), "start-min-ms")
	}
}

// spacing returns the mean and minimum gap between times, after the first
// burst (which passes at once).
func spacing(ts []time.Time, burst int) (mean, least time.Duration) {
	ts = slices.Clone(ts)
	slices.SortFunc(ts, func(a, b time.Time) int { return a.Compare(b) })
	ts = ts[min(burst, len(ts)):]
	if len(ts) < 2 {
		return 0, 0
	}
	least = ts[1].Sub(ts[0])
	for i := 2; i < len(ts); i++ {
		least = min(least, ts[i].Sub(ts[i-1]))
	}
	return ts[len(ts)-1].Sub(ts[0]) / time.Duration(len(ts)-1), least
}

func ms(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }
