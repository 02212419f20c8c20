package pool_test

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/slotbook/slotbook/deadline"
	"github.com/slotbook/slotbook/internal/redistest"
	"github.com/slotbook/slotbook/pool"
	"github.com/slotbook/slotbook/reserve"
	"github.com/slotbook/slotbook/throttle"
)

// gate is a go-redis hook that, once armed, holds the next script call (a
// pool's batch) until it is let through, and can fail it instead of
// sending it.
type gate struct {
	mu      sync.Mutex // guards the fields below
	armed   bool
	fail    error
	entered chan struct{}
	release chan struct{}
}

func addGate(rdb *redis.Client) *gate {
	g := new(gate)
	rdb.AddHook(g)
	return g
}

// arm makes the next script call wait: entered is closed when it arrives,
// and it goes on (or fails with fail, if not nil, without reaching Redis)
// when release is called.
func (g *gate) arm(t *testing.T, fail error) (entered <-chan struct{}, release func()) {
	t.Helper()
	g.mu.Lock()
	defer g.mu.Unlock()
	g.armed, g.fail = true, fail
	g.entered, g.release = make(chan struct{}), make(chan struct{})
	var once sync.Once
	rel := g.release
	release = func() { once.Do(func() { close(rel) }) }
	t.Cleanup(release)
	return g.entered, release
}

func (g *gate) DialHook(next redis.DialHook) redis.DialHook { return next }

func (g *gate) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		switch cmd.Name() {
		case "evalsha", "eval", "evalsha_ro", "eval_ro":
		default:
			return next(ctx, cmd)
		}
		g.mu.Lock()
		armed, fail, entered, release := g.armed, g.fail, g.entered, g.release
		g.armed = false
		g.mu.Unlock()
		if !armed {
			return next(ctx, cmd)
		}
		close(entered)
		select {
		case <-release:
		case <-ctx.Done():
			return ctx.Err()
		}
		if fail != nil {
			return fail
		}
		return next(ctx, cmd)
	}
}

func (g *gate) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}

// waitClosed fails t if ch is not closed within a generous bound.
func waitClosed(t *testing.T, ch <-chan struct{}, what string) {
	t.Helper()
	select {
	case <-ch:
	case <-time.After(10 * time.Second):
		t.Fatalf("timed out waiting for %s", what)
	}
}

// stall holds p's dispatcher in the batch call of a job of its own, so
// that the jobs submitted meanwhile queue up and go out together in the
// next batch once resume is called. That job runs on a key of its own and
// holds a worker until it returns. The pool books one batch at a time
// from then on (SetSerial): else it would book other keys beside the
// stalled call (TestCloseWhileBatchInFlight hung so once, its gate
// holding a later batch than the one it meant).
func stall(t *testing.T, p *pool.Pool, g *gate) (resume func()) {
	t.Helper()
	pool.SetSerial(p)
	entered, release := g.arm(t, nil)
	_, err := p.Submit(context.Background(), "stall", noop)
	require.NoError(t, err)
	waitClosed(t, entered, "the stalling batch call")
	return release
}

// nextWait books one slot for key directly and returns its wait on the
// Redis clock: how much of the key the pool left booked.
func nextWait(t *testing.T, proc *process, key string, limit throttle.Limit) time.Duration {
	t.Helper()
	b, err := proc.eng.Book(context.Background(), "api:{"+key+"}", limit, throttle.Request{N: 1, MaxWait: throttle.Forever})
	require.NoError(t, err)
	return b.Wait
}

// TestCancelWhileBatchInFlight: jobs whose context ends while their batch
// is in flight wait for the reply, give back all it booked, and end with
// the context's error without running.
func TestCancelWhileBatchInFlight(t *testing.T) {
	t.Parallel()
	limit := throttle.PerSecond(10, 0)
	proc := newProcess(t, redistest.Prefix(t), limit)
	g := addGate(proc.rdb)
	p := newPool(t, proc.lim, pool.WithWorkers(5))
	ctx := context.Background()

	resume := stall(t, p, g)
	jctx, cancel := context.WithCancel(ctx)
	defer cancel()
	var ran atomic.Int32
	var jobs []*pool.Job
	for range 4 { // one batch: slots at 0, 100, 200, 300ms
		j, err := p.Submit(jctx, "k", func(context.Context) error { ran.Add(1); return nil })
		require.NoError(t, err)
		jobs = append(jobs, j)
	}
	entered, release := g.arm(t, nil)
	resume()
	waitClosed(t, entered, "the batch call")
	cancel()
	for i, j := range jobs {
		require.False(t, isDone(j), "job %d done while its batch was in flight", i)
	}
	release()
	for i, j := range jobs {
		require.ErrorIs(t, j.Wait(ctx), context.Canceled, "job %d", i)
		require.True(t, j.Reservation().Booking().OK, "job %d was booked (held: its context ended in flight)", i)
	}
	require.Zero(t, ran.Load())
	// Every slot was given back, the first too, though it had come: no
	// one acted on it. The key is idle: the next booking is immediate.
	// (Before such bookings were held, the first one's room was lost.)
	require.Zero(t, nextWait(t, proc, "k", limit))
}

// TestCloseWhileBatchInFlight: Close ends the backlog at once, then waits
// for the batch in flight, gives back what it booked, and ends its jobs
// with ErrClosed.
func TestCloseWhileBatchInFlight(t *testing.T) {
	t.Parallel()
	limit := throttle.PerSecond(10, 0)
	proc := newProcess(t, redistest.Prefix(t), limit)
	g := addGate(proc.rdb)
	p := newPool(t, proc.lim, pool.WithWorkers(5))
	ctx := context.Background()

	resume := stall(t, p, g)
	var ran atomic.Int32
	var jobs []*pool.Job
	for range 8 { // four in the batch (one worker runs the stall job), four in the backlog
		j, err := p.Submit(ctx, "k", func(context.Context) error { ran.Add(1); return nil })
		require.NoError(t, err)
		jobs = append(jobs, j)
	}
	entered, release := g.arm(t, nil)
	resume()
	waitClosed(t, entered, "the batch call")
	closed := make(chan error, 1)
	go func() { closed <- p.Close(ctx) }()
	for i, j := range jobs[4:] {
		require.ErrorIs(t, j.Wait(ctx), pool.ErrClosed, "backlog job %d", i)
	}
	for i, j := range jobs[:4] {
		require.False(t, isDone(j), "job %d done while its batch was in flight", i)
	}
	select {
	case err := <-closed:
		t.Fatalf("Close returned (%v) while a batch was in flight", err)
	default:
	}
	release()
	require.NoError(t, <-closed)
	for i, j := range jobs[:4] {
		require.ErrorIs(t, j.Err(), pool.ErrClosed, "job %d", i)
	}
	require.Zero(t, ran.Load())
	require.LessOrEqual(t, nextWait(t, proc, "k", limit), 100*time.Millisecond)
}

var errInjected = errors.New("injected failure")

// TestBatchFailureEndsItsJobs: a batch whose Redis call fails ends its
// jobs with the error, gives their workers back, and the pool goes on.
func TestBatchFailureEndsItsJobs(t *testing.T) {
	t.Parallel()
	prefix := redistest.Prefix(t)
	limit := throttle.PerSecond(100, 5)
	proc := newProcess(t, prefix, limit)
	g := addGate(proc.rdb)
	const workers = 4
	p := newPool(t, proc.lim, pool.WithWorkers(workers))
	ctx := context.Background()

	resume := stall(t, p, g)
	var ran atomic.Int32
	var jobs []*pool.Job
	for range workers - 1 { // one batch
		j, err := p.Submit(ctx, "k", func(context.Context) error { ran.Add(1); return nil })
		require.NoError(t, err)
		jobs = append(jobs, j)
	}
	_, release := g.arm(t, errInjected)
	release()
	resume()
	for i, j := range jobs {
		require.ErrorIs(t, j.Wait(ctx), errInjected, "job %d", i)
		require.Nil(t, j.Reservation(), "job %d", i)
	}
	require.Zero(t, ran.Load())
	_, err := proc.rdb.Get(ctx, prefix+"api:{k}").Result()
	require.ErrorIs(t, err, redis.Nil, "the failed batch booked nothing")
	var more []*pool.Job
	for range workers {
		j, err := p.Submit(ctx, "k", func(context.Context) error { ran.Add(1); return nil })
		require.NoError(t, err)
		more = append(more, j)
	}
	for i, j := range more {
		require.NoError(t, j.Wait(ctx), "job %d after the failure", i)
	}
}

// TestMaxWaitRefusalRequeuesDeadlineRefusalEnds: a job refused by the
// limiter's max wait goes back to the backlog and runs later, at a slot
// that keeps the limit; a job whose slot cannot come before its deadline
// ends with the refusal.
func TestMaxWaitRefusalRequeuesDeadlineRefusalEnds(t *testing.T) {
	t.Parallel()
	limit := throttle.PerSecond(10, 0)
	proc := newProcess(t, redistest.Prefix(t), limit, reserve.WithMaxWait(150*time.Millisecond))
	p := newPool(t, proc.lim, pool.WithWorkers(8))
	ctx := context.Background()
	var jobs []*pool.Job
	for range 6 { // slots 0 to 500ms: only two fit the max wait at first
		j, err := p.Submit(ctx, "k", noop)
		require.NoError(t, err)
		jobs = append(jobs, j)
	}
	short, cancel := context.WithTimeout(ctx, 300*time.Millisecond)
	defer cancel()
	ran := false
	late, err := p.Submit(short, "k", func(context.Context) error { ran = true; return nil })
	require.NoError(t, err)

	require.NoError(t, p.Wait(ctx))
	checkJobs(t, jobs, limit)
	// Refused for its deadline; on a machine slow enough, its context may
	// end first while it waits in the backlog. Either way it never ran.
	err = late.Err()
	require.True(t, errors.Is(err, deadline.ErrWouldExceedDeadline) || errors.Is(err, context.DeadlineExceeded), "%v", err)
	require.False(t, ran)
	require.True(t, late.Slot().IsZero())
}

// TestAcquireWaitingEndsAtClose: an Acquire caller waiting for a worker
// gets ErrClosed when the pool closes, holding nothing.
func TestAcquireWaitingEndsAtClose(t *testing.T) {
	t.Parallel()
	proc := newProcess(t, redistest.Prefix(t), throttle.PerSecond(100, 5))
	p := newPool(t, proc.lim, pool.WithWorkers(1))
	ctx := context.Background()
	release, err := p.Acquire(ctx, "k")
	require.NoError(t, err)
	got := make(chan error, 1)
	go func() {
		rel, err := p.Acquire(ctx, "k")
		if rel != nil {
			rel()
		}
		got <- err
	}()
	require.Eventually(t, func() bool { return pool.AcquireWaiters(p) == 1 }, 10*time.Second, time.Millisecond)
	require.NoError(t, p.Close(ctx))
	require.ErrorIs(t, <-got, pool.ErrClosed)
	require.Zero(t, pool.AcquireWaiters(p))
	release()
	_, err = p.Acquire(ctx, "k")
	require.ErrorIs(t, err, pool.ErrClosed)
}

// TestBatchFallbackOneCancelled: while Redis's replies are lost, a batch in
// which one job's context ends during the call still gets the fallback's
// answer for the others: one caller gone must not fail its neighbours (found
// by review: the whole batch ended with the engine's error).
func TestBatchFallbackOneCancelled(t *testing.T) {
	t.Parallel()
	srv := redistest.Shared(t)
	srv.RequireReal(t)
	p := redistest.NewProxy(t, srv.Addr)
	rdb := p.Client(t, srv)
	eng, err := throttle.New(rdb, throttle.WithPrefix(redistest.Prefix(t)), throttle.WithTimeout(300*time.Millisecond))
	require.NoError(t, err)
	require.NoError(t, eng.Load(context.Background()))
	lim, err := reserve.New(eng, "api", throttle.PerSecond(10, 5), reserve.WithFallback(reserve.FailOpen()))
	require.NoError(t, err)
	pl := newPool(t, lim, pool.WithWorkers(4))
	p.SetReplyDelay(time.Hour) // every reply is lost at the engine's timeout

	ctx2, cancel2 := context.WithCancel(context.Background())
	defer cancel2()
	ran := make(chan struct{}, 1)
	j1, err := pl.Submit(context.Background(), "k", func(context.Context) error { ran <- struct{}{}; return nil })
	require.NoError(t, err)
	j2, err := pl.Submit(ctx2, "k", func(context.Context) error { return nil })
	require.NoError(t, err)
	time.AfterFunc(100*time.Millisecond, cancel2) // while the call is in flight
	wctx, wc := context.WithTimeout(context.Background(), 30*time.Second)
	defer wc()
	require.NoError(t, j1.Wait(wctx), "job 1's context never ended: the fallback runs it")
	require.True(t, j1.Reservation().Fallback())
	<-ran
	require.ErrorIs(t, j2.Wait(wctx), context.Canceled)
}
