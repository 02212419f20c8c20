package pool_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/slotbook/slotbook/internal/redistest"
	"github.com/slotbook/slotbook/pool"
	"github.com/slotbook/slotbook/reserve"
	"github.com/slotbook/slotbook/throttle"
)

// TestRunsPoolGivesBackBatch: a pool books a batch of alike jobs
// (one run) under two limits on the Redis clock; every job but the first
// (whose slot is immediate) is cancelled once all are booked, and the
// pool gives back the bookings whose slots have not come, latest first.
// Both keys then hold exactly what the latest job that ran left (its slot
// plus one interval of each limit): every give-back found its booking's
// end, so the TATs the client worked out for each request of a run were
// Redis's.
func TestRunsPoolGivesBackBatch(t *testing.T) {
	t.Parallel()
	srv := redistest.Shared(t)
	rdb := srv.Client(t)
	prefix := redistest.Prefix(t)
	eng, err := throttle.New(rdb, throttle.WithPrefix(prefix), throttle.WithTimeout(5*time.Second))
	require.NoError(t, err)
	limits := []throttle.Limit{throttle.Every(10*time.Second, 1, 0), throttle.PerDay(100_000, 50)}
	lim, err := reserve.New(eng, "rvp", limits[0], reserve.WithLimit(limits[1]), reserve.WithoutMaxWait())
	require.NoError(t, err)
	p, err := pool.New(lim, pool.WithWorkers(16))
	require.NoError(t, err)
	t.Cleanup(func() { _ = p.Close(context.Background()) })

	ctx, cancel := context.WithCancel(context.Background())
	first, err := p.Submit(context.Background(), "s", func(context.Context) error { return nil })
	require.NoError(t, err)
	var jobs []*pool.Job
	for range 12 {
		j, err := p.Submit(ctx, "s", func(context.Context) error { return nil })
		require.NoError(t, err)
		jobs = append(jobs, j)
	}
	// The first job's slot is immediate: it runs at once. Then until
	// all 13 are booked: the first key's TAT 13 intervals from its slot.
	at := first.Reservation().Booking().At.UnixMicro()
	require.Zero(t, first.Reservation().Booking().Wait)
	keys := []string{prefix + "rvp:{s}", prefix + "rvp:{s}:86400000ms"}
	waitFrom := time.Now()
	require.Eventually(t, func() bool {
		v, err := rdb.Get(context.Background(), keys[0]).Int64()
		return err == nil && v == at+13*10_000_000
	}, 60*time.Second, 5*time.Millisecond, "every job booked")
	t.Logf("all booked %v after the first job ran", time.Since(waitFrom))
	cancel()
	require.NoError(t, p.Wait(context.Background()))
	require.NoError(t, first.Err())
	// Jobs whose slot came before the cancel (the pool may book in
	// several batches, as its workers free up) ran; the rest were given
	// back, latest first. The keys hold what the latest job that ran
	// left: its slot plus one interval of each limit (every slot is 10 s
	// after the one before, so the second limit's TAT is the slot's).
	latest, given := at, 0
	for i, j := range jobs {
		switch err := j.Err(); {
		case err == nil:
			latest = max(latest, j.Reservation().Booking().At.UnixMicro())
		case errors.Is(err, context.Canceled):
			if r := j.Reservation(); r != nil && r.Booking().OK {
				given++
			}
		default:
			t.Fatalf("job %d: %v", i, err)
		}
	}
	require.Positive(t, given, "bookings given back")
	t.Logf("%d bookings given back", given)
	want := []int64{latest + 10_000_000, latest + 864_000}
	for i, k := range keys {
		v, err := rdb.Get(context.Background(), k).Int64()
		require.NoError(t, err)
		require.Equal(t, want[i], v, "key %d", i)
	}
}
