package pool_test

import (
	"context"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/slotbook/slotbook/pool"
)

// TestPoolBooksKeysSideBySide: 40 ms each way, one job on each of 32 keys,
// 32 workers. The pool books the keys side by side, not one call after
// another: on the Redis clock the 32 bookings span well under the 31
// round trips (2.48 s) that booking them one at a time would take. Every
// job runs, and each key holds exactly its one booking (a textbook GCRA
// of the jobs that ran).
func TestPoolBooksKeysSideBySide(t *testing.T) {
	t.Parallel()
	const keys, rtt = 32, 80 * time.Millisecond
	e := newReviewEnv(t, rtt/2)
	name := "side"
	p, err := pool.New(e.limiter(t, name), pool.WithWorkers(keys))
	require.NoError(t, err)
	defer func() { _ = p.Close(context.Background()) }()
	jobs := make([]*pool.Job, keys)
	for i := range jobs {
		jobs[i], err = p.Submit(context.Background(), fmt.Sprint("k", i), func(context.Context) error { return nil })
		require.NoError(t, err)
	}
	require.NoError(t, p.Wait(context.Background()))
	var at []time.Time
	for i, j := range jobs {
		require.NoError(t, j.Err())
		at = append(at, j.Reservation().Booking().At)
		e.check(t, name, fmt.Sprint("k", i), []*pool.Job{j}, nil)
	}
	spread := slices.MaxFunc(at, time.Time.Compare).Sub(slices.MinFunc(at, time.Time.Compare))
	t.Logf("%d keys booked within %v on the Redis clock", keys, spread)
	require.Less(t, spread, 10*rtt, "the keys were booked one call after another (that takes %v)", (keys-1)*rtt)
}
