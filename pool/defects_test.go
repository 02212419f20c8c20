package pool_test

import (
	"context"
	"errors"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/slotbook/slotbook/internal/redistest"
	"github.com/slotbook/slotbook/pool"
	"github.com/slotbook/slotbook/throttle"
)

func noop(context.Context) error { return nil }

// TestAcquireReleaseWakesBacklog: a worker given back by an Acquire caller
// goes to the backlog at once. Every worker is held through Acquire while a
// job is submitted; after one release the job must run, with no other
// event to wake the pool. The bound is generous and scaled by a control
// measured in the same run (how long the idle pool takes to run a job); if
// the job misses it, the test shows whether an unrelated Submit is what it
// was waiting for.
func TestAcquireReleaseWakesBacklog(t *testing.T) {
	t.Parallel()
	proc := newProcess(t, redistest.Prefix(t), throttle.PerSecond(1000, 10))
	p := newPool(t, proc.lim, pool.WithWorkers(2))
	ctx := context.Background()

	t0 := time.Now()
	ctl, err := p.Submit(ctx, "k", noop)
	require.NoError(t, err)
	require.NoError(t, ctl.Wait(ctx))
	control := ctl.Started().Sub(t0)
	bound := 2*time.Second + 20*control

	release1, err := p.Acquire(ctx, "k")
	require.NoError(t, err)
	release2, err := p.Acquire(ctx, "k")
	require.NoError(t, err)
	defer release2()
	j, err := p.Submit(ctx, "k", noop)
	require.NoError(t, err)
	// No worker is free: the job cannot be booked, whatever the timing.
	require.Never(t, func() bool { return isDone(j) }, 100*time.Millisecond, 5*time.Millisecond,
		"a job ran while Acquire held every worker")
	released := time.Now()
	release1()
	select {
	case <-j.Done():
		require.NoError(t, j.Err())
		t.Logf("job ran %v after the release (control: %v from Submit to start on an idle pool)", j.Started().Sub(released), control)
		return
	case <-time.After(bound):
	}
	_, err = p.Submit(ctx, "other", noop)
	require.NoError(t, err)
	select {
	case <-j.Done():
		t.Fatalf("job not run %v after Acquire's release gave a worker back (control %v); it ran only once an unrelated Submit woke the pool", bound, control)
	case <-time.After(bound):
		t.Fatalf("job not run %v after Acquire's release gave a worker back (control %v), nor after an unrelated Submit", bound, control)
	}
}

func isDone(j *pool.Job) bool {
	select {
	case <-j.Done():
		return true
	default:
		return false
	}
}

// TestSubmitCancelKeepsKeysBounded: on a pool whose workers are all busy,
// jobs submitted and cancelled before they could be booked leave no trace
// in the pool's round-robin key list: it never holds more keys than have
// backlog (3 here), and none once the backlog is gone.
//
// Not parallel: its rounds keep the CPUs busy, and other tests judge
// timing.
func TestSubmitCancelKeepsKeysBounded(t *testing.T) {
	proc := newProcess(t, redistest.Prefix(t), throttle.PerSecond(1000, 10))
	const workers = 2
	p := newPool(t, proc.lim, pool.WithWorkers(workers))
	ctx := context.Background()

	// Make the pool busy: every worker runs a job that waits for the end.
	block := make(chan struct{})
	var unblock sync.Once
	t.Cleanup(func() { unblock.Do(func() { close(block) }) }) // before Close, which waits for the jobs
	started := make(chan struct{}, workers)
	var busy []*pool.Job
	for range workers {
		j, err := p.Submit(ctx, "busy", func(context.Context) error {
			started <- struct{}{}
			<-block
			return nil
		})
		require.NoError(t, err)
		busy = append(busy, j)
	}
	for range workers {
		<-started
	}

	// The old pool went past 3 keys within a few hundred rounds and held
	// 32,668 after 100,000; 25,000 rounds take about 2 s under -race.
	rounds := 25_000
	if testing.Short() {
		rounds = 5_000
	}
	keys := []string{"a", "b", "c"}
	most := 0
	for i := range rounds {
		jctx, cancel := context.WithCancel(ctx)
		j, err := p.Submit(jctx, keys[i%len(keys)], noop)
		require.NoError(t, err)
		most = max(most, pool.BacklogKeys(p))
		cancel()
		<-j.Done()
		require.ErrorIs(t, j.Err(), context.Canceled)
		most = max(most, pool.BacklogKeys(p))
		if most > len(keys) {
			t.Fatalf("round %d: the pool's key list holds %d keys; only %d keys ever had backlog", i, most, len(keys))
		}
	}
	require.Equal(t, 0, pool.BacklogKeys(p), "no key has backlog left")
	unblock.Do(func() { close(block) })
	for _, j := range busy {
		require.NoError(t, j.Wait(ctx))
	}
	t.Logf("%d rounds, at most %d keys", rounds, most)
}

// panickingJob is named so that the stack of its panic can be checked for
// it.
func panickingJob(context.Context) error { panic("boom") }

var errInPanic = errors.New("an error as the panic value")

// TestPanicBecomesJobError: a job that panics (or calls runtime.Goexit)
// ends with an error and gives its worker back; the pool goes on (one
// worker here, so the next job runs only if it was given back).
func TestPanicBecomesJobError(t *testing.T) {
	t.Parallel()
	proc := newProcess(t, redistest.Prefix(t), throttle.PerSecond(1000, 10))
	p := newPool(t, proc.lim, pool.WithWorkers(1))
	ctx := context.Background()

	j, err := p.Submit(ctx, "k", panickingJob)
	require.NoError(t, err)
	err = j.Wait(ctx)
	var pe *pool.PanicError
	require.ErrorAs(t, err, &pe)
	require.Equal(t, "boom", pe.Value)
	require.Contains(t, string(pe.Stack), "pool_test.panickingJob", "the stack names the job function")
	require.Contains(t, err.Error(), "boom")
	require.Contains(t, err.Error(), "pool_test.panickingJob")

	j, err = p.Submit(ctx, "k", func(context.Context) error { panic(errInPanic) })
	require.NoError(t, err)
	err = j.Wait(ctx)
	require.ErrorAs(t, err, &pe)
	require.ErrorIs(t, err, errInPanic, "an error as the panic value is unwrapped")

	j, err = p.Submit(ctx, "k", func(context.Context) error { runtime.Goexit(); return nil })
	require.NoError(t, err)
	err = j.Wait(ctx)
	require.Error(t, err)
	require.True(t, strings.Contains(err.Error(), "Goexit"), "got %v", err)

	next, err := p.Submit(ctx, "k", noop)
	require.NoError(t, err)
	require.NoError(t, next.Wait(ctx), "the pool goes on after a panic")
}
