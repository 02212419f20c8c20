package asynqadapter_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/stretchr/testify/require"

	"github.com/slotbook/slotbook/asynqadapter"
	"github.com/slotbook/slotbook/deadline"
	"github.com/slotbook/slotbook/internal/redistest"
	"github.com/slotbook/slotbook/reserve"
	"github.com/slotbook/slotbook/throttle"
)

// taskInfo reads a task's state, failing the test on an error.
func taskInfo(t *testing.T, insp *asynq.Inspector, queue, id string) *asynq.TaskInfo {
	t.Helper()
	ti, err := insp.GetTaskInfo(queue, id)
	require.NoError(t, err)
	return ti
}

// waitState waits (generously: a busy machine) until the task is in state,
// and returns its info. It fails at once if the task is archived where
// that is not the state waited for.
func waitState(t *testing.T, insp *asynq.Inspector, queue, id string, state asynq.TaskState, within time.Duration) *asynq.TaskInfo {
	t.Helper()
	end := time.Now().Add(within)
	for {
		ti, err := insp.GetTaskInfo(queue, id)
		require.NoError(t, err)
		if ti.State == state {
			return ti
		}
		if ti.State == asynq.TaskStateArchived {
			t.Fatalf("task %s archived (retried %d, last error %q), waiting for %v", id, ti.Retried, ti.LastErr, state)
		}
		if time.Now().After(end) {
			t.Fatalf("task %s still %v after %v (retried %d, last error %q), waiting for %v", id, ti.State, within, ti.Retried, ti.LastErr, state)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// TestLimiterOutage: while the limiter's Redis is down, a task refused by
// the fallback (FailClosed) or by the unavailable limiter itself (no
// fallback) goes back to asynq without a failure, due again within seconds
// (not asynq's backoff of 15 s and more), and a MaxRetry(0) task waits
// instead of being archived; once Redis is back both complete without a
// retry used. WithUnavailableAsFailure(true) makes the outage a failure
// again.
func TestLimiterOutage(t *testing.T) {
	tests := []struct {
		name    string
		opts    []reserve.Option
		mw      []asynqadapter.Option
		failure bool
	}{
		{"no fallback", nil, nil, false},
		{"FailClosed", []reserve.Option{reserve.WithFallback(reserve.FailClosed())}, nil, false},
		{"no fallback, as failure", nil, []asynqadapter.Option{asynqadapter.WithUnavailableAsFailure(true)}, true},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			srvRedis := redistest.Shared(t)
			srvRedis.RequireReal(t)
			limRedis := redistest.Start(t) // the limiter's own, stopped below
			prefix := redistest.Prefix(t)
			queue := "q" + prefix
			eng, err := throttle.New(limRedis.Client(t), throttle.WithPrefix(prefix), throttle.WithTimeout(2*time.Second))
			require.NoError(t, err)
			lim, err := reserve.New(eng, "outage", throttle.PerSecond(10, 0), append(tc.opts, reserve.WithMaxWait(time.Second))...)
			require.NoError(t, err)
			limRedis.Stop()

			mw, err := asynqadapter.NewMiddleware(lim, tc.mw...)
			require.NoError(t, err)
			server(t, srvRedis.Client(t), queue, 4, mw, func(context.Context, *asynq.Task) error { return nil })
			client := asynq.NewClientFromRedisClient(srvRedis.Client(t))
			insp := asynq.NewInspectorFromRedisClient(srvRedis.Client(t))
			a, err := client.Enqueue(asynq.NewTask("api:call", []byte("a")), asynq.Queue(queue), asynq.MaxRetry(3),
				asynq.Timeout(2*time.Minute), asynq.Retention(time.Hour))
			require.NoError(t, err)

			ti := waitState(t, insp, queue, a.ID, asynq.TaskStateRetry, 30*time.Second)
			if tc.failure {
				require.Equal(t, 1, ti.Retried, "the outage counted as a failure")
				return
			}
			require.Zero(t, ti.Retried, "no retry used up (last error %q)", ti.LastErr)
			require.Contains(t, ti.LastErr, "unavailable")
			// Due back within the unavailable delay or the fallback's
			// retry-after, rounded up to a whole second (plus a second for
			// a busy machine): not asynq's backoff, 15 s at least.
			require.Less(t, time.Until(ti.NextProcessAt), 5*time.Second, "due back soon")

			b, err := client.Enqueue(asynq.NewTask("api:call", []byte("b")), asynq.Queue(queue), asynq.MaxRetry(0),
				asynq.Timeout(2*time.Minute), asynq.Retention(time.Hour))
			require.NoError(t, err)
			waitState(t, insp, queue, b.ID, asynq.TaskStateActive, 30*time.Second)
			// Refused at least once while waiting: it stays active, not archived.
			time.Sleep(time.Second)
			require.Equal(t, asynq.TaskStateActive, taskInfo(t, insp, queue, b.ID).State)

			limRedis.Restart(t)
			for _, id := range []string{a.ID, b.ID} {
				ti := waitState(t, insp, queue, id, asynq.TaskStateCompleted, time.Minute)
				require.Zero(t, ti.Retried, "task %s: no retry used up", id)
			}
		})
	}
}

// TestLocalShareRefusalIsNotAFailure: with the limiter's Redis down and
// LocalShare answering, tasks beyond the local share's max wait go back to
// asynq without a failure, at the local retry-after, and all complete.
func TestLocalShareRefusalIsNotAFailure(t *testing.T) {
	t.Parallel()
	srvRedis := redistest.Shared(t)
	srvRedis.RequireReal(t)
	limRedis := redistest.Start(t)
	prefix := redistest.Prefix(t)
	queue := "q" + prefix
	eng, err := throttle.New(limRedis.Client(t), throttle.WithPrefix(prefix))
	require.NoError(t, err)
	lim, err := reserve.New(eng, "local", throttle.PerSecond(2, 0), reserve.WithMaxWait(100*time.Millisecond),
		reserve.WithFallback(reserve.LocalShare(time.Second, 1, 100)))
	require.NoError(t, err)
	limRedis.Stop()

	var refusals sync.Map // task id -> *reserve.FallbackError seen
	server(t, srvRedis.Client(t), queue, 4, asynqadapter.Middleware(lim), func(context.Context, *asynq.Task) error { return nil },
		func(c *asynq.Config) {
			c.ErrorHandler = asynq.ErrorHandlerFunc(func(ctx context.Context, _ *asynq.Task, err error) {
				var fe *reserve.FallbackError
				if id, ok := asynq.GetTaskID(ctx); ok && errors.As(err, &fe) {
					refusals.Store(id, fe)
				}
			})
		})
	client := asynq.NewClientFromRedisClient(srvRedis.Client(t))
	insp := asynq.NewInspectorFromRedisClient(srvRedis.Client(t))
	var ids []string
	for i := 0; i < 4; i++ {
		info, err := client.Enqueue(asynq.NewTask("api:call", []byte(fmt.Sprint(i))), asynq.Queue(queue),
			asynq.MaxRetry(3), asynq.Retention(time.Hour))
		require.NoError(t, err)
		ids = append(ids, info.ID)
	}
	// Four tasks at 2/s with a 100ms max wait, however they arrive: at
	// least one is refused by the local share.
	for _, id := range ids {
		ti := waitState(t, insp, queue, id, asynq.TaskStateCompleted, time.Minute)
		require.Zero(t, ti.Retried, "task %s: no retry used up (last error %q)", id, ti.LastErr)
	}
	n := 0
	refusals.Range(func(any, any) bool { n++; return true })
	require.Positive(t, n, "the local share refused some")
}

// TestInspectorTooCloseToDeadline: a refused task due back less than the
// check interval plus a margin before its Deadline is archived at once:
// asynq would move it to its queue up to one check interval later, when
// too little time would be left.
func TestInspectorTooCloseToDeadline(t *testing.T) {
	t.Parallel()
	srvRedis, e, queue := queueEnv(t)
	l := e.limiter(t, throttle.PerSecond(1, 0), reserve.WithMaxWait(100*time.Millisecond))
	filled := time.Now()
	fill(t, context.Background(), l, "api:call", 10) // next slot ~10 s after filled
	insp := asynq.NewInspectorFromRedisClient(srvRedis.Client(t))
	server(t, srvRedis.Client(t), queue, 2,
		asynqadapter.Middleware(l, asynqadapter.WithInspector(insp), asynqadapter.WithCheckInterval(time.Second),
			asynqadapter.WithSpread(false)),
		func(context.Context, *asynq.Task) error { return nil })
	client := asynq.NewClientFromRedisClient(srvRedis.Client(t))
	// Due back when the slot fits, within a second of filled+9.9 s (asynq's
	// whole seconds): before the deadline at filled+11.5 s, but less than
	// the check interval and the margin (1 s each) before it.
	info, err := client.Enqueue(asynq.NewTask("api:call", nil), asynq.Queue(queue), asynq.MaxRetry(3),
		asynq.Deadline(filled.Add(11500*time.Millisecond)))
	require.NoError(t, err)
	ti := waitState(t, insp, queue, info.ID, asynq.TaskStateArchived, 8*time.Second)
	require.Contains(t, ti.LastErr, "too close to its deadline")
	require.Zero(t, ti.Retried)
}

// TestWorkEstimate: a Timeout of 2 s, a slot about 1.8 s away and a
// handler that takes 300 ms. Without a work estimate the task runs at its
// slot, asynq cancels it at its timeout and a retry is used up; with
// WithWorkEstimate(300ms) it goes back without a failure and completes.
func TestWorkEstimate(t *testing.T) {
	for _, work := range []time.Duration{0, 300 * time.Millisecond} {
		t.Run(fmt.Sprint("work=", work), func(t *testing.T) {
			t.Parallel()
			srvRedis, e, queue := queueEnv(t)
			l := e.limiter(t, throttle.PerSecond(20, 0), reserve.WithMaxWait(time.Minute))
			var opts []asynqadapter.Option
			if work > 0 {
				opts = append(opts, asynqadapter.WithWorkEstimate(work))
			}
			mw, err := asynqadapter.NewMiddleware(l, opts...)
			require.NoError(t, err)
			patient, err := l.With(reserve.WithoutMaxWait())
			require.NoError(t, err)
			// On the first attempt, before the middleware, book the slots
			// up to 200-250ms before the handler's deadline.
			var once sync.Once
			fillFirst := func(next asynq.Handler) asynq.Handler {
				return asynq.HandlerFunc(func(ctx context.Context, task *asynq.Task) error {
					once.Do(func() {
						dl, _ := ctx.Deadline() // asynq always sets one
						n := int((time.Until(dl) - 200*time.Millisecond) / (50 * time.Millisecond))
						for i := 0; i < n; i++ {
							r, err := patient.Reserve(ctx, "api:call")
							if err == nil {
								err = r.Err()
							}
							if err != nil {
								t.Errorf("filling: %v", err)
								return
							}
						}
					})
					return next.ProcessTask(ctx, task)
				})
			}
			handler := func(ctx context.Context, _ *asynq.Task) error {
				select {
				case <-time.After(300 * time.Millisecond):
					// Work that ran past the deadline did not fit, even if
					// this goroutine ran too late to see the deadline first
					// (a select of two ready cases picks either).
					return ctx.Err()
				case <-ctx.Done():
					return ctx.Err()
				}
			}
			server(t, srvRedis.Client(t), queue, 2, func(h asynq.Handler) asynq.Handler { return fillFirst(mw(h)) }, handler)
			client := asynq.NewClientFromRedisClient(srvRedis.Client(t))
			insp := asynq.NewInspectorFromRedisClient(srvRedis.Client(t))
			info, err := client.Enqueue(asynq.NewTask("api:call", nil), asynq.Queue(queue), asynq.MaxRetry(3),
				asynq.Timeout(2*time.Second), asynq.Retention(time.Hour))
			require.NoError(t, err)
			if work == 0 {
				ti := waitState(t, insp, queue, info.ID, asynq.TaskStateRetry, 30*time.Second)
				require.Equal(t, 1, ti.Retried, "the control: cancelled at its timeout (last error %q)", ti.LastErr)
				require.Contains(t, ti.LastErr, "deadline exceeded")
				return
			}
			ti := waitState(t, insp, queue, info.ID, asynq.TaskStateCompleted, 30*time.Second)
			require.Zero(t, ti.Retried)
			require.Contains(t, ti.LastErr, deadline.ErrWouldExceedDeadline.Error(), "sent back once for the deadline")
		})
	}
}

// TestErrorHandlerSeesRefusals: asynq calls its ErrorHandler for every
// refusal; IsRefusal tells them from the handler's own errors.
func TestErrorHandlerSeesRefusals(t *testing.T) {
	t.Parallel()
	srvRedis, e, queue := queueEnv(t)
	l := e.limiter(t, throttle.PerSecond(2, 0), reserve.WithMaxWait(100*time.Millisecond))
	var (
		mu             sync.Mutex // guards refusals, others
		refusals, owns int
	)
	own := errors.New("the task's own error")
	server(t, srvRedis.Client(t), queue, 4, asynqadapter.Middleware(l),
		func(_ context.Context, task *asynq.Task) error {
			if string(task.Payload()) == "fail" {
				return fmt.Errorf("%w: %w", own, asynq.SkipRetry)
			}
			return nil
		},
		func(c *asynq.Config) {
			c.ErrorHandler = asynq.ErrorHandlerFunc(func(_ context.Context, _ *asynq.Task, err error) {
				mu.Lock()
				defer mu.Unlock()
				switch {
				case asynqadapter.IsRefusal(err) && !asynqadapter.IsFailure(err):
					refusals++
				case errors.Is(err, own) && asynqadapter.IsFailure(err):
					owns++
				default:
					t.Errorf("unexpected error: %v", err)
				}
			})
		})
	client := asynq.NewClientFromRedisClient(srvRedis.Client(t))
	insp := asynq.NewInspectorFromRedisClient(srvRedis.Client(t))
	var ids []string
	for i := 0; i < 4; i++ {
		info, err := client.Enqueue(asynq.NewTask("api:call", nil), asynq.Queue(queue), asynq.Retention(time.Hour))
		require.NoError(t, err)
		ids = append(ids, info.ID)
	}
	failing, err := client.Enqueue(asynq.NewTask("api:call", []byte("fail")), asynq.Queue(queue), asynq.MaxRetry(0))
	require.NoError(t, err)
	for _, id := range ids {
		waitState(t, insp, queue, id, asynq.TaskStateCompleted, time.Minute)
	}
	require.Eventually(t, func() bool {
		ti, err := insp.GetTaskInfo(queue, failing.ID)
		return err == nil && ti.State == asynq.TaskStateArchived
	}, time.Minute, 20*time.Millisecond)
	mu.Lock()
	defer mu.Unlock()
	require.Positive(t, refusals, "five tasks at 2/s with a 100ms max wait: some refused")
	require.Equal(t, 1, owns, "the task's own error, once")
}

// TestBookedRetry: a task whose slot lies beyond the max wait has the slot
// booked in the same call, goes back to asynq without a failure (LastErr
// says so), due one check interval before the slot, and on its return runs
// at the slot without booking again: two limiter calls in all, the second
// finding the booking. A second task is booked the interval after it.
func TestBookedRetry(t *testing.T) {
	t.Parallel()
	srvRedis, e, queue := queueEnv(t)
	l := e.limiter(t, throttle.PerSecond(1, 0), reserve.WithMaxWait(100*time.Millisecond))
	fill(t, context.Background(), l, "api:call", 3) // next slot ~3 s away
	mw := bookedMiddleware(t, e, l)
	var (
		mu        sync.Mutex // guards starts and delivered
		starts    = map[string]time.Time{}
		delivered = map[string]time.Time{} // the middleware's latest delivery of each task
	)
	// Each delivery is timed as it reaches the middleware, so that the
	// start can be judged as a monotonic offset from an instant before the
	// middleware read the slot (see below).
	timedMW := func(next asynq.Handler) asynq.Handler {
		inner := mw(next)
		return asynq.HandlerFunc(func(ctx context.Context, task *asynq.Task) error {
			id, _ := asynq.GetTaskID(ctx)
			mu.Lock()
			delivered[id] = time.Now()
			mu.Unlock()
			return inner.ProcessTask(ctx, task)
		})
	}
	server(t, srvRedis.Client(t), queue, 2, timedMW, func(ctx context.Context, _ *asynq.Task) error {
		id, _ := asynq.GetTaskID(ctx)
		mu.Lock()
		starts[id] = time.Now()
		mu.Unlock()
		return nil
	})
	client := asynq.NewClientFromRedisClient(srvRedis.Client(t))
	insp := asynq.NewInspectorFromRedisClient(srvRedis.Client(t))
	// Send the script to Redis first (go-redis's EVALSHA, NOSCRIPT, EVAL),
	// so that the count below is of the task's calls alone.
	_, err := e.eng.BookRetry(context.Background(), []string{"warm:{up}"}, []throttle.Limit{throttle.PerSecond(1, 0)},
		throttle.Request{N: 1}, throttle.RetryIndex{Key: "warm:{up}:asynq", Member: "m"})
	require.NoError(t, err)
	before := e.calls.Load()
	info, err := client.Enqueue(asynq.NewTask("api:call", nil), asynq.Queue(queue), asynq.Retention(time.Hour))
	require.NoError(t, err)
	ti := waitState(t, insp, queue, info.ID, asynq.TaskStateRetry, 30*time.Second)
	require.Zero(t, ti.Retried)
	require.Contains(t, ti.LastErr, "slot booked in")
	sentBack := time.Now()
	// The booking is in the index, under the task's queue, id and retry count.
	look := redistest.Shared(t).Client(t) // not counted
	entries, err := look.ZRangeWithScores(context.Background(), e.prefix+"tasks:{api:call}:asynq", 0, -1).Result()
	require.NoError(t, err)
	require.Len(t, entries, 1)
	require.True(t, strings.HasPrefix(entries[0].Member.(string), fmt.Sprintf("%d:%s:%s:0:", len(queue), queue, info.ID)),
		"the member %q names the queue, the id and the retry count", entries[0].Member)
	slot := time.UnixMicro(int64(entries[0].Score))
	require.Greater(t, slot.Sub(sentBack), time.Second, "the slot is seconds away")
	require.False(t, ti.NextProcessAt.After(slot.Add(-time.Second)), "due a check interval before the slot")

	ti = waitState(t, insp, queue, info.ID, asynq.TaskStateCompleted, 30*time.Second)
	require.Zero(t, ti.Retried)
	mu.Lock()
	started, got := starts[info.ID], delivered[info.ID]
	mu.Unlock()
	// The local and Redis clocks are one machine's here. The middleware
	// sleeps from after got until the slot, a Redis-clock (wall) instant,
	// on the monotonic clock: the start is judged as a monotonic offset
	// from got against the slot's wall-clock offset from got, not as a
	// wall-clock reading, which this VM's wall clock, slewed against the
	// monotonic one (hundreds of µs a second at times), can put before a
	// slot the sleep kept. A start before the slot is still caught.
	require.GreaterOrEqual(t, started.Sub(got), slot.Sub(got.Round(0)), "started at %v, before its slot %v", started, slot)
	require.Equal(t, int64(2), e.calls.Load()-before, "one call to book, one to find the booking")
	n, err := look.ZCard(context.Background(), e.prefix+"tasks:{api:call}:asynq").Result()
	require.NoError(t, err)
	require.Zero(t, n, "the booking was taken out when found")
}

// TestBookedHorizon: a slot beyond the horizon is not booked ahead: the
// task is refused as without booked retries (nothing booked, no index
// entry), and runs once its slot comes within reach.
func TestBookedHorizon(t *testing.T) {
	t.Parallel()
	srvRedis, e, queue := queueEnv(t)
	l := e.limiter(t, throttle.PerSecond(1, 0), reserve.WithMaxWait(100*time.Millisecond))
	mw, err := asynqadapter.NewMiddleware(l, asynqadapter.WithBookedRetries(e.eng, 2*time.Second),
		asynqadapter.WithCheckInterval(time.Second))
	require.NoError(t, err)
	server(t, srvRedis.Client(t), queue, 2, mw, func(context.Context, *asynq.Task) error { return nil })
	client := asynq.NewClientFromRedisClient(srvRedis.Client(t))
	t.Cleanup(func() { _ = client.Close() })
	insp := asynq.NewInspectorFromRedisClient(srvRedis.Client(t))
	fill(t, context.Background(), l, "api:call", 5) // next slot ~4 s away: beyond the 2 s horizon
	info, err := client.Enqueue(asynq.NewTask("api:call", nil), asynq.Queue(queue), asynq.Retention(time.Hour))
	require.NoError(t, err)
	ti := waitState(t, insp, queue, info.ID, asynq.TaskStateRetry, 10*time.Second)
	t.Logf("refused: %q", ti.LastErr)
	require.Zero(t, ti.Retried)
	require.NotContains(t, ti.LastErr, "slot booked in", "nothing booked beyond the horizon")
	n, err := redistest.Shared(t).Client(t).ZCard(context.Background(), e.prefix+"tasks:{api:call}:asynq").Result()
	require.NoError(t, err)
	require.Zero(t, n, "no index entry")
	ti = waitState(t, insp, queue, info.ID, asynq.TaskStateCompleted, 30*time.Second)
	require.Zero(t, ti.Retried)
}

// TestBookedLateReturnBooksAgain: a booked task that comes back more than
// one interval after its slot (its queue paused here, as when every
// worker is busy) does not run at once on the spent slot, which would
// start it on top of the slots booked since: it finds its booking (one
// call), and books again (a second).
func TestBookedLateReturnBooksAgain(t *testing.T) {
	t.Parallel()
	srvRedis, e, queue := queueEnv(t)
	l := e.limiter(t, throttle.PerSecond(2, 0), reserve.WithMaxWait(100*time.Millisecond))
	mw := bookedMiddleware(t, e, l)
	started := make(chan time.Time, 1)
	server(t, srvRedis.Client(t), queue, 2, mw, func(context.Context, *asynq.Task) error {
		started <- time.Now()
		return nil
	})
	client := asynq.NewClientFromRedisClient(srvRedis.Client(t))
	t.Cleanup(func() { _ = client.Close() })
	insp := asynq.NewInspectorFromRedisClient(srvRedis.Client(t))
	fill(t, context.Background(), l, "api:call", 4) // next slot ~1.5 s away
	info, err := client.Enqueue(asynq.NewTask("api:call", nil), asynq.Queue(queue), asynq.Retention(time.Hour))
	require.NoError(t, err)
	waitState(t, insp, queue, info.ID, asynq.TaskStateRetry, 10*time.Second)
	require.NoError(t, insp.PauseQueue(queue))
	look := redistest.Shared(t).Client(t) // not counted
	entries, err := look.ZRangeWithScores(context.Background(), e.prefix+"tasks:{api:call}:asynq", 0, -1).Result()
	require.NoError(t, err)
	require.Len(t, entries, 1)
	slot := time.UnixMicro(int64(entries[0].Score))
	time.Sleep(time.Until(slot.Add(2 * time.Second))) // four intervals late
	before := e.calls.Load()
	require.NoError(t, insp.UnpauseQueue(queue))
	at := <-started
	require.Greater(t, at.Sub(slot), 2*time.Second, "ran after the queue resumed")
	require.Equal(t, int64(2), e.calls.Load()-before, "one call finds the spent booking, one books again")
	ti := waitState(t, insp, queue, info.ID, asynq.TaskStateCompleted, 10*time.Second)
	require.Zero(t, ti.Retried)
}
