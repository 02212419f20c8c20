package asynqadapter_test

import (
	"context"
	"flag"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/stretchr/testify/require"

	"github.com/slotbook/slotbook/asynqadapter"
	"github.com/slotbook/slotbook/internal/callcount"
	"github.com/slotbook/slotbook/internal/redistest"
	"github.com/slotbook/slotbook/reserve"
	"github.com/slotbook/slotbook/throttle"
)

// fleet is a run of real asynq servers (in this process, each with its own
// Redis clients, as separate processes would have) sharing one limit
// through a limiter Redis of their own, separate from asynq's.
type fleet struct {
	servers, concurrency int
	limit                throttle.Limit
	maxWait              time.Duration
	tasks, lastAttempt   int // tasks enqueued at once; of them, with MaxRetry(0)
	opts                 []asynqadapter.Option
	booked               time.Duration // > 0: WithBookedRetries with this horizon
	taskCheck            time.Duration // asynq's TaskCheckInterval (0: its default, 1 s)
}

type fleetResult struct {
	starts   []time.Time // handler starts, sorted
	attempts int64       // middleware invocations
	calls    int64       // round trips to the limiter's Redis
	archived int
	retried  int // tasks with Retried > 0
}

func (f fleet) run(tb testing.TB) fleetResult {
	tb.Helper()
	srvRedis := redistest.Shared(tb)
	srvRedis.RequireReal(tb)
	limRedis := redistest.Start(tb) // used by the limiter only
	prefix := redistest.Prefix(tb)
	queue := "q" + prefix

	var (
		mu       sync.Mutex // guards starts
		starts   []time.Time
		attempts atomic.Int64
		done     = make(chan struct{}, f.tasks)
		calls    []*callcount.Counter
	)
	count := func(next asynq.Handler) asynq.Handler {
		return asynq.HandlerFunc(func(ctx context.Context, t *asynq.Task) error {
			attempts.Add(1)
			return next.ProcessTask(ctx, t)
		})
	}
	handler := func(context.Context, *asynq.Task) error {
		mu.Lock()
		starts = append(starts, time.Now())
		mu.Unlock()
		done <- struct{}{}
		return nil
	}
	for i := 0; i < f.servers; i++ {
		rdb := limRedis.Client(tb)
		calls = append(calls, callcount.Attach(rdb))
		eng, err := throttle.New(rdb, throttle.WithPrefix(prefix), throttle.WithTimeout(5*time.Second))
		require.NoError(tb, err)
		redistest.UntilOK(tb, func() error { return eng.Load(context.Background()) })
		lim, err := reserve.New(eng, "fleet", f.limit, reserve.WithMaxWait(f.maxWait))
		require.NoError(tb, err)
		opts := append([]asynqadapter.Option{asynqadapter.WithCheckInterval(time.Second)}, f.opts...)
		if f.booked > 0 {
			opts = append(opts, asynqadapter.WithBookedRetries(eng, f.booked))
		}
		mw, err := asynqadapter.NewMiddleware(lim, opts...)
		require.NoError(tb, err)
		srv := asynq.NewServerFromRedisClient(srvRedis.Client(tb), asynq.Config{
			Concurrency:              f.concurrency,
			Queues:                   map[string]int{queue: 1},
			IsFailure:                asynqadapter.IsFailure,
			RetryDelayFunc:           asynqadapter.RetryDelayFunc(nil),
			DelayedTaskCheckInterval: time.Second,
			TaskCheckInterval:        f.taskCheck,
			LogLevel:                 asynq.ErrorLevel,
			ShutdownTimeout:          5 * time.Second,
		})
		mux := asynq.NewServeMux()
		mux.Use(count, mw)
		mux.HandleFunc("api:call", handler)
		require.NoError(tb, srv.Start(mux))
		tb.Cleanup(srv.Shutdown)
	}
	base := int64(0)
	for _, c := range calls {
		base += c.Load()
	}

	client := asynq.NewClientFromRedisClient(srvRedis.Client(tb))
	var ids []string
	for i := 0; i < f.tasks; i++ {
		opts := []asynq.Option{asynq.Queue(queue), asynq.Retention(time.Hour), asynq.Timeout(5 * time.Minute)}
		if every := f.tasks / max(1, f.lastAttempt); f.lastAttempt > 0 && i%every == 0 && i/every < f.lastAttempt {
			opts = append(opts, asynq.MaxRetry(0))
		}
		info, err := client.Enqueue(asynq.NewTask("api:call", []byte(fmt.Sprint(i))), opts...)
		require.NoError(tb, err)
		ids = append(ids, info.ID)
	}
	// Generous: a busy machine; the limit alone needs tasks/rate.
	timeout := time.After(f.limit.Interval()*time.Duration(f.tasks)*3 + time.Minute)
	for i := 0; i < f.tasks; i++ {
		select {
		case <-done:
		case <-timeout:
			tb.Fatalf("only %d of %d tasks completed", i, f.tasks)
		}
	}
	var r fleetResult
	for _, c := range calls {
		r.calls += c.Load()
	}
	r.calls -= base
	insp := asynq.NewInspectorFromRedisClient(srvRedis.Client(tb))
	for _, id := range ids {
		ti, err := insp.GetTaskInfo(queue, id)
		require.NoError(tb, err)
		if ti.State == asynq.TaskStateArchived {
			r.archived++
		}
		if ti.Retried > 0 {
			r.retried++
		}
	}
	mu.Lock()
	r.starts = slices.Clone(starts)
	mu.Unlock()
	slices.SortFunc(r.starts, func(a, b time.Time) int { return a.Compare(b) })
	r.attempts = attempts.Load()
	return r
}

// maxInWindow returns the most starts within any window of length w.
func maxInWindow(starts []time.Time, w time.Duration) int {
	most, j := 0, 0
	for i := range starts {
		for starts[i].Sub(starts[j]) >= w {
			j++
		}
		most = max(most, i-j+1)
	}
	return most
}

// rateFrom returns the start rate from the k-th start (1-based) to the last.
func rateFrom(starts []time.Time, k int) float64 {
	if len(starts) <= k {
		return 0
	}
	return float64(len(starts)-k) / starts[len(starts)-1].Sub(starts[k-1]).Seconds()
}

// BenchmarkSpreadThroughAsynq measures what spreading refused tasks does
// through a real asynq server: 30 tasks enqueued at once, one server of 10
// workers, 20/s, a 200ms max wait. It reports handler attempts per task
// with spreading on and off (the README's figure).
//
//	go test -run XXX -bench SpreadThroughAsynq -benchtime 1x ./asynqadapter
func BenchmarkSpreadThroughAsynq(b *testing.B) {
	for _, spread := range []bool{false, true} {
		b.Run(fmt.Sprint("spread=", spread), func(b *testing.B) {
			for i := 0; i < b.N; i++ {
				r := fleet{servers: 1, concurrency: 10, limit: throttle.PerSecond(20, 0), maxWait: 200 * time.Millisecond,
					tasks: 30, opts: []asynqadapter.Option{asynqadapter.WithSpread(spread)}}.run(b)
				b.ReportMetric(float64(r.attempts)/30, "attempts/task")
				b.ReportMetric(float64(r.calls)/30, "calls/task")
			}
		})
	}
}

var fullFleet = flag.Bool("asynq.full", false, "run TestFleet at the full size of issue 15 (320 tasks)")

// TestFleet: three asynq servers (in this process, each with its own Redis
// clients; Concurrency 10, DelayedTaskCheckInterval 1 s) share 20/s burst
// 4 with a 500ms max wait; tasks are enqueued at once, one in 16 with
// MaxRetry(0). No task is lost, archived or charged a retry, and starts
// keep to the limit: at most rate+burst+1 in any second, judged on the
// recorded start times. The start rate and limiter calls per task are
// logged (issue 15's targets, 0.97 x 20/s and 1.2 calls, are not met yet).
// CI size: 80 tasks; -asynq.full: 320.
func TestFleet(t *testing.T) {
	if testing.Short() {
		t.Skip("10 s: skipped with -short")
	}
	t.Parallel()
	tasks := 80
	if *fullFleet {
		tasks = 320
	}
	limit := throttle.PerSecond(20, 4)
	r := fleet{servers: 3, concurrency: 10, limit: limit, maxWait: 500 * time.Millisecond,
		tasks: tasks, lastAttempt: tasks / 16}.run(t)
	require.Len(t, r.starts, tasks, "every task ran once")
	require.Zero(t, r.archived, "archived")
	require.Zero(t, r.retried, "tasks with Retried > 0")
	most := maxInWindow(r.starts, time.Second)
	elapsed := r.starts[len(r.starts)-1].Sub(r.starts[0])
	t.Logf("%d tasks: %d attempts (%.2f per task), %.2f limiter calls per task, most starts in 1 s: %d, "+
		"rate from the 25th start: %.2f/s, elapsed %v (ideal %v)",
		tasks, r.attempts, float64(r.attempts)/float64(tasks), float64(r.calls)/float64(tasks), most,
		rateFrom(r.starts, 25), elapsed.Round(time.Millisecond), (time.Duration(tasks-limit.Burst-1) * limit.Interval()))
	require.LessOrEqual(t, most, limit.Rate+limit.Burst+1, "starts in a 1 s window")
}

// TestFleetBooked is TestFleet with booked retries (WithBookedRetries,
// horizon one minute) and asynq's TaskCheckInterval at 100ms, judged on
// issue 15's targets: no task lost, archived or charged a retry; at most
// rate+burst+1 starts in any second, on the recorded start times; a start
// rate from the 25th start to the last of at least 0.97 times the limit's;
// at most 1.2 calls per task to the limiter's Redis (its own server, apart
// from asynq's). CI size: 80 tasks, a rate of 0.9 times the limit's;
// -asynq.full: 320.
func TestFleetBooked(t *testing.T) {
	if testing.Short() {
		t.Skip("10 s: skipped with -short")
	}
	// Not parallel: it runs alone in its package, on a machine busy enough.
	tasks := 80
	if *fullFleet {
		tasks = 320
	}
	limit := throttle.PerSecond(20, 4)
	r := fleet{servers: 3, concurrency: 10, limit: limit, maxWait: 500 * time.Millisecond,
		tasks: tasks, lastAttempt: tasks / 16, booked: time.Minute, taskCheck: 100 * time.Millisecond}.run(t)

	most := maxInWindow(r.starts, time.Second)
	t.Logf("%d tasks: %d attempts (%.2f per task), %.2f limiter calls per task, most starts in 1 s: %d, "+
		"rate from the 25th start: %.2f/s, elapsed %v",
		tasks, r.attempts, float64(r.attempts)/float64(tasks), float64(r.calls)/float64(tasks), most,
		rateFrom(r.starts, 25), r.starts[len(r.starts)-1].Sub(r.starts[0]).Round(time.Millisecond))
	require.Len(t, r.starts, tasks, "every task ran once")
	require.Zero(t, r.archived, "archived")
	require.Zero(t, r.retried, "tasks with Retried > 0")
	require.LessOrEqual(t, most, limit.Rate+limit.Burst+1, "starts in a 1 s window")
	require.LessOrEqual(t, float64(r.calls)/float64(tasks), 1.2, "limiter calls per task")
	// 0.97 of the limit at full size (the figure of issue 15). At CI size,
	// 55 starts after the 25th, one task late on a busy machine moves the
	// figure by several percent: 0.9 there (without booked retries it was
	// 11 to 15 a second).
	share := 0.9
	if *fullFleet {
		share = 0.97
	}
	require.GreaterOrEqual(t, rateFrom(r.starts, 25), share*float64(limit.Rate), "start rate from the 25th start")
}
