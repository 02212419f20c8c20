package pool_test

import (
	"context"
	"errors"
	"math/rand/v2"
	"runtime"
	"slices"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/slotbook/slotbook/internal/redistest"
	"github.com/slotbook/slotbook/pool"
	"github.com/slotbook/slotbook/throttle"
)

// TestJobsCancelledAsBooked: jobs each cancelled at a random time
// around their booking either run (nil) or end with context.Canceled, never
// a refusal or a Redis error; those that ran started at their slots, which
// keep to the limit; afterwards fresh jobs all run, within the limit; and
// once the pool is closed no goroutine of it is left. Not parallel: it
// counts goroutines.
func TestJobsCancelledAsBooked(t *testing.T) {
	baseline := runtime.NumGoroutine()
	limit := throttle.PerSecond(100, 0) // 10 ms apart
	proc := newProcess(t, redistest.Prefix(t), limit)
	p, err := pool.New(proc.lim, pool.WithWorkers(8))
	require.NoError(t, err)

	var jobs []*pool.Job
	var cancels []context.CancelFunc
	for range 80 {
		ctx, cancel := context.WithCancel(context.Background())
		cancels = append(cancels, cancel)
		j, err := p.Submit(ctx, "k", func(context.Context) error { return nil })
		require.NoError(t, err)
		jobs = append(jobs, j)
		if rand.IntN(2) == 0 {
			time.AfterFunc(time.Duration(rand.IntN(600))*time.Millisecond, cancel)
		}
	}
	require.NoError(t, p.Wait(context.Background()))
	var ran []time.Time
	cancelled := 0
	for i, j := range jobs {
		switch err := j.Err(); {
		case err == nil:
			require.False(t, j.Started().IsZero(), "job %d", i)
			require.False(t, j.Started().Before(j.Slot()), "job %d started before its slot", i)
			ran = append(ran, j.Reservation().Booking().At)
		case errors.Is(err, context.Canceled):
			require.Equal(t, context.Canceled, err, "job %d: the context's error itself", i)
			require.True(t, j.Started().IsZero(), "job %d ran and was cancelled", i)
			cancelled++
		default:
			t.Fatalf("job %d: %v", i, err)
		}
	}
	slices.SortFunc(ran, func(a, b time.Time) int { return a.Compare(b) })
	checkWindows(t, ran, limit, 0)

	// No stall: fresh jobs all run, at slots that keep to the limit.
	var fresh []*pool.Job
	for range 10 {
		j, err := p.Submit(context.Background(), "k", func(context.Context) error { return nil })
		require.NoError(t, err)
		fresh = append(fresh, j)
	}
	wctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	require.NoError(t, p.Wait(wctx))
	var all []time.Time
	all = append(all, ran...)
	for i, j := range fresh {
		require.NoError(t, j.Err(), "fresh job %d", i)
		require.False(t, j.Started().Before(j.Slot()), "fresh job %d", i)
		all = append(all, j.Reservation().Booking().At)
	}
	slices.SortFunc(all, func(a, b time.Time) int { return a.Compare(b) })
	checkWindows(t, all, limit, 0)
	t.Logf("%d ran, %d cancelled; then %d fresh ran", len(ran), cancelled, len(fresh))

	require.NoError(t, p.Close(context.Background()))
	for _, c := range cancels {
		c()
	}
	deadline := time.Now().Add(5 * time.Second)
	for runtime.NumGoroutine() > baseline+2 && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	// The client's pool keeps goroutines of its own; the pool's are gone.
	require.LessOrEqual(t, runtime.NumGoroutine(), baseline+4, "goroutines left after Close")
}
