package pool_test

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/slotbook/slotbook/internal/redistest"
	"github.com/slotbook/slotbook/lease"
	"github.com/slotbook/slotbook/pool"
	"github.com/slotbook/slotbook/reserve"
	"github.com/slotbook/slotbook/throttle"
)

func newSem(t *testing.T, pr *process, n int) *lease.Semaphore {
	t.Helper()
	s, err := lease.New(pr.eng, "api", n, lease.WithTTL(30*time.Second))
	require.NoError(t, err)
	t.Cleanup(func() { _ = s.Close(context.Background()) })
	return s
}

// TestWithLeaseBoundsConcurrency runs the jobs of two pools (two
// processes) on one key with 8 workers each and a lease of N = 3: never
// more than 3 jobs run at once, every job runs, and each starts no
// earlier than its slot.
func TestWithLeaseBoundsConcurrency(t *testing.T) {
	prefix := redistest.Prefix(t)
	const n, jobs = 3, 40
	var running, peak atomic.Int64
	var wg sync.WaitGroup
	var early atomic.Int64
	for range 2 {
		pr := newProcess(t, prefix, throttle.PerSecond(2000, 50))
		p := newPool(t, pr.lim, pool.WithWorkers(8), pool.WithLease(newSem(t, pr, n)))
		for range jobs / 2 {
			j, err := p.Submit(context.Background(), "k", func(ctx context.Context) error {
				c := running.Add(1)
				for {
					old := peak.Load()
					if c <= old || peak.CompareAndSwap(old, c) {
						break
					}
				}
				time.Sleep(3 * time.Millisecond)
				running.Add(-1)
				return nil
			})
			require.NoError(t, err)
			wg.Add(1)
			go func() {
				defer wg.Done()
				if err := j.Wait(context.Background()); err != nil {
					t.Error(err)
				}
				if j.Started().Before(j.Slot()) {
					early.Add(1)
				}
			}()
		}
	}
	wg.Wait()
	if got := peak.Load(); got > n {
		t.Errorf("%d jobs ran at once, want at most %d (the lease)", got, n)
	}
	if got := peak.Load(); got < 2 {
		t.Errorf("at most %d job ran at once: no contention, the test judged nothing", got)
	}
	if got := early.Load(); got != 0 {
		t.Errorf("%d jobs started before their slot", got)
	}
}

// TestWithLeaseAcquire takes a worker, a lease and a slot for a worker
// loop; the release gives the lease back.
func TestWithLeaseAcquire(t *testing.T) {
	prefix := redistest.Prefix(t)
	pr := newProcess(t, prefix, throttle.PerSecond(1000, 10))
	sem := newSem(t, pr, 1)
	p := newPool(t, pr.lim, pool.WithWorkers(4), pool.WithLease(sem))
	ctx := context.Background()
	release, err := p.Acquire(ctx, "k")
	require.NoError(t, err)
	if _, ok, err := sem.TryAcquire(ctx, "k"); err != nil || ok {
		t.Fatalf("TryAcquire while the pool's caller holds the only lease: %v, %v; want false, nil", ok, err)
	}
	// A second caller waits for the lease; its context ends first.
	wctx, cancel := context.WithTimeout(ctx, 50*time.Millisecond)
	defer cancel()
	if _, err := p.Acquire(wctx, "k"); !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("second Acquire: got %v, want context.DeadlineExceeded", err)
	}
	release()
	l, ok, err := sem.TryAcquire(ctx, "k")
	require.NoError(t, err)
	require.True(t, ok, "the release gave the lease back")
	require.NoError(t, l.Release(ctx))
}

// TestWithLeaseClose closes a pool whose jobs wait for a lease held
// elsewhere: they end with ErrClosed and nothing of theirs is left held.
func TestWithLeaseClose(t *testing.T) {
	prefix := redistest.Prefix(t)
	pr := newProcess(t, prefix, throttle.PerSecond(1000, 10))
	sem := newSem(t, pr, 1)
	ctx := context.Background()
	held, err := sem.Acquire(ctx, "k")
	require.NoError(t, err)
	p, err := pool.New(pr.lim, pool.WithWorkers(4), pool.WithLease(newSem(t, pr, 1)))
	require.NoError(t, err)
	var js []*pool.Job
	for range 3 {
		j, err := p.Submit(ctx, "k", func(context.Context) error { return nil })
		require.NoError(t, err)
		js = append(js, j)
	}
	queue := prefix + "api:{k}:lease:q"
	deadline := time.Now().Add(20 * time.Second)
	for n, _ := pr.rdb.ZCard(ctx, queue).Result(); n < 3; n, _ = pr.rdb.ZCard(ctx, queue).Result() {
		require.True(t, time.Now().Before(deadline), "the jobs never queued for the lease")
		time.Sleep(5 * time.Millisecond)
	}
	require.NoError(t, p.Close(ctx))
	for _, j := range js {
		if err := j.Err(); !errors.Is(err, pool.ErrClosed) {
			t.Errorf("job waiting for a lease at Close: got %v, want ErrClosed", err)
		}
	}
	require.NoError(t, held.Release(ctx))
	for _, part := range []string{"h", "q", "w"} {
		if n, _ := pr.rdb.Exists(ctx, prefix+"api:{k}:lease:"+part).Result(); n != 0 {
			t.Errorf("lease key %q left after Close and the release", part)
		}
	}
}

// TestWithLeaseCloseWhileBooking closes a pool just after submitting jobs
// that get their leases at once and book slots far ahead: whatever state
// Close finds each in (waiting for its lease, booking, booked), every job
// ends, and no lease is left held.
func TestWithLeaseCloseWhileBooking(t *testing.T) {
	for round := range 5 {
		prefix := redistest.Prefix(t)
		pr := newProcess(t, prefix, throttle.PerMinute(1, 0), reserve.WithoutMaxWait())
		sem := newSem(t, pr, 20)
		p, err := pool.New(pr.lim, pool.WithWorkers(10), pool.WithLease(sem))
		require.NoError(t, err)
		ctx := context.Background()
		var js []*pool.Job
		for range 10 {
			j, err := p.Submit(ctx, "k", func(context.Context) error { return nil })
			require.NoError(t, err)
			js = append(js, j)
		}
		time.Sleep(time.Duration(round) * 2 * time.Millisecond)
		cctx, cancel := context.WithTimeout(ctx, 30*time.Second)
		require.NoError(t, p.Close(cctx), "round %d", round)
		cancel()
		for _, j := range js {
			select {
			case <-j.Done():
			default:
				t.Fatalf("round %d: a job is not done after Close", round)
			}
		}
		holders := prefix + "api:{k}:lease:h"
		deadline := time.Now().Add(10 * time.Second) // the releases run on their own goroutines
		for n, _ := pr.rdb.ZCard(ctx, holders).Result(); n > 0; n, _ = pr.rdb.ZCard(ctx, holders).Result() {
			if time.Now().After(deadline) {
				t.Fatalf("round %d: %d leases still held after Close", round, n)
			}
			time.Sleep(5 * time.Millisecond)
		}
	}
}
