package pool_test

import (
	"context"
	"errors"
	"fmt"
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
	// The first job's slot is immediate: it runs at once. Then until at
	// least one more is booked: the first key's TAT two intervals from the
	// first slot or more. Not until all 13 are: submitted faster than the
	// dispatcher books (the usual case) they go in one batch, but on a busy
	// machine the dispatcher may take them a few at a time, and once more
	// than a quarter of the workers hold booked jobs the pool books again
	// only when the booked ones fall back to a quarter, a slot (10 s) at a
	// time; the bookings cover those slots meanwhile. Waiting for all 13
	// took 10 to 50 s in some runs beside a full suite, and failed one
	// suite at 60 s.
	at := first.Reservation().Booking().At.UnixMicro()
	require.Zero(t, first.Reservation().Booking().Wait)
	keys := []string{prefix + "rvp:{s}", prefix + "rvp:{s}:86400000ms"}
	waitFrom := time.Now()
	var booked int64
	require.Eventually(t, func() bool {
		v, err := rdb.Get(context.Background(), keys[0]).Int64()
		booked = (v - at) / 10_000_000
		return err == nil && booked >= 2
	}, 60*time.Second, 5*time.Millisecond, "a job booked after the first")
	t.Logf("%d booked %v after the first job ran", booked, time.Since(waitFrom))
	cancel()
	require.NoError(t, p.Wait(context.Background()))
	require.NoError(t, first.Err())
	// Jobs whose slot came before the cancel (the pool may book in
	// several batches, as its workers free up) ran; the rest were given
	// back, latest first. The keys hold what the latest job that ran
	// left: its slot plus one interval of each limit (every slot is 10 s
	// after the one before, so the second limit's TAT is the slot's).
	latest, given := at, 0
	// What each job came to, for a failure's message: its error, and its
	// slot in ms after the first job's if it was booked.
	var story []string
	for _, j := range jobs {
		e := fmt.Sprint(j.Err())
		if r := j.Reservation(); r != nil && r.Booking().OK {
			e += fmt.Sprintf(" @%dms", (r.Booking().At.UnixMicro()-at)/1000)
		}
		story = append(story, e)
	}
	defer func() {
		if t.Failed() {
			t.Logf("jobs: %q", story)
		}
	}()
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
