package asynqadapter_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/slotbook/slotbook/asynqadapter"
	"github.com/slotbook/slotbook/deadline"
	"github.com/slotbook/slotbook/internal/callcount"
	"github.com/slotbook/slotbook/internal/limitcheck"
	"github.com/slotbook/slotbook/internal/redistest"
	"github.com/slotbook/slotbook/internal/testhook"
	"github.com/slotbook/slotbook/internal/timing"
	"github.com/slotbook/slotbook/reserve"
	"github.com/slotbook/slotbook/throttle"
)

func TestMain(m *testing.M) { redistest.Main(m) }

type env struct {
	rdb    *redis.Client
	calls  *callcount.Counter
	eng    *throttle.Engine
	prefix string
}

func newEnv(t *testing.T) *env {
	t.Helper()
	rdb := redistest.Shared(t).Client(t)
	calls := callcount.Attach(rdb)
	prefix := redistest.Prefix(t)
	eng, err := throttle.New(rdb, throttle.WithPrefix(prefix), throttle.WithTimeout(5*time.Second))
	require.NoError(t, err)
	redistest.UntilOK(t, func() error { return eng.Load(context.Background()) })
	return &env{rdb: rdb, calls: calls, eng: eng, prefix: prefix}
}

// queueEnv is what the tests that run asynq servers open with: the shared
// Redis (a real one: asynq needs it), an env on it, and a queue of the
// test's own.
func queueEnv(t *testing.T) (*redistest.Server, *env, string) {
	t.Helper()
	srvRedis := redistest.Shared(t)
	srvRedis.RequireReal(t)
	e := newEnv(t)
	return srvRedis, e, "q" + e.prefix
}

func (e *env) limiter(t *testing.T, limit throttle.Limit, opts ...reserve.Option) *reserve.Limiter {
	t.Helper()
	l, err := reserve.New(e.eng, "tasks", limit, opts...)
	require.NoError(t, err)
	return l
}

// fill books n slots on key, at ctx's clock, so the next one is
// n-burst-1 intervals away.
func fill(t *testing.T, ctx context.Context, l *reserve.Limiter, key string, n int) {
	t.Helper()
	patient, err := l.With(reserve.WithoutMaxWait())
	require.NoError(t, err)
	for i := 0; i < n; i++ {
		r, err := patient.Reserve(ctx, key)
		require.NoError(t, err)
		require.True(t, r.OK())
	}
}

var noop = asynq.HandlerFunc(func(context.Context, *asynq.Task) error { return nil })

func TestRefusalError(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	l := e.limiter(t, throttle.PerSecond(10, 0), reserve.WithMaxWait(250*time.Millisecond))
	// On an explicit clock, which the handler's context carries to the
	// limiter: the slots are exact however long the calls take.
	ctx := testhook.WithNow(context.Background(), time.Now().UnixMicro())
	fill(t, ctx, l, "email", 6) // next slot 600ms away
	h := asynqadapter.Middleware(l, asynqadapter.WithSpread(false))(noop)
	err := h.ProcessTask(ctx, asynq.NewTask("email", nil))

	var rl *asynqadapter.RateLimitedError
	require.ErrorAs(t, err, &rl)
	require.ErrorIs(t, err, deadline.ErrMaxWaitExceeded)
	require.Equal(t, "email", rl.Key)
	// It fits once the queue is no longer than the 250ms max wait.
	require.Equal(t, 350*time.Millisecond, rl.RetryAfter)
	require.True(t, asynqadapter.IsRateLimited(fmt.Errorf("wrapped: %w", err)))
	require.False(t, asynqadapter.IsFailure(err), "a refusal is not a failure")
	require.True(t, asynqadapter.IsFailure(errors.New("boom")))
	require.False(t, asynqadapter.IsFailure(nil))

	delay := asynqadapter.RetryDelayFunc(nil)
	before := time.Now().Round(0) // wall clock: asynq stores Unix seconds
	d := delay(3, err, asynq.NewTask("email", nil))
	after := time.Now().Round(0)
	require.GreaterOrEqual(t, d, rl.RetryAfter)
	require.Less(t, d, rl.RetryAfter+time.Second)
	// Counted from some instant of the call, it ends on a whole second.
	second := after.Add(d).Truncate(time.Second)
	require.False(t, second.Before(before.Add(d)), "ends on a whole second: %v from between %v and %v", d, before, after)
	other := errors.New("boom")
	task := asynq.NewTask("email", nil)
	// Other errors get asynq's default: 15 s plus up to 30 s of jitter on a first retry.
	if d := delay(0, other, task); d < 15*time.Second || d > 46*time.Second {
		t.Fatalf("delegated delay %v, want asynq's default", d)
	}
	custom := asynqadapter.RetryDelayFunc(func(int, error, *asynq.Task) time.Duration { return 42 * time.Second })
	require.Equal(t, 42*time.Second, custom(0, other, task))
}

// TestSpread: tasks refused together get return times one interval apart.
func TestSpread(t *testing.T) {
	t.Parallel()
	for _, spread := range []bool{true, false} {
		t.Run(fmt.Sprint("spread=", spread), func(t *testing.T) {
			t.Parallel()
			e := newEnv(t)
			interval := 100 * time.Millisecond
			l := e.limiter(t, throttle.PerSecond(10, 0), reserve.WithMaxWait(0))
			// On an explicit clock: every refusal finds the same slot,
			// exactly fits away.
			ctx := testhook.WithNow(context.Background(), time.Now().UnixMicro())
			fill(t, ctx, l, "sync", 1)
			const fits = 100 * time.Millisecond
			h := asynqadapter.Middleware(l, asynqadapter.WithSpread(spread))(noop)
			// The middleware counts each return time from its own reading
			// of the local clock, somewhere in [before, after].
			var backs []time.Duration
			var before, after []time.Time
			for i := 0; i < 8; i++ {
				var rl *asynqadapter.RateLimitedError
				before = append(before, time.Now())
				require.ErrorAs(t, h.ProcessTask(ctx, asynq.NewTask("sync", nil)), &rl)
				after = append(after, time.Now())
				backs = append(backs, rl.RetryAfter)
			}
			if !spread {
				for _, b := range backs {
					require.Equal(t, fits, b, "all the same: when the slot fits")
				}
				return
			}
			// Spread: the i-th return time (the local reading plus its
			// RetryAfter) is a base i intervals after the first's, which
			// is when the slot fits, plus up to one interval of jitter.
			// A base falls later only when the local clock ran more than
			// i intervals past the first reading (a stalled machine):
			// excess bounds that, from the readings' brackets.
			base0lo, base0hi := before[0].Add(fits), after[0].Add(fits)
			excess := time.Duration(0)
			for i, b := range backs {
				excess = max(excess, after[i].Sub(before[0])-time.Duration(i)*interval)
				lo := before[i].Add(b - time.Duration(i)*interval) // earliest the return, less i intervals, can be
				hi := after[i].Add(b - time.Duration(i)*interval)  // latest
				require.False(t, hi.Before(base0lo), "return %d (in %v) earlier than its base, i intervals after the first's", i, b)
				require.False(t, lo.After(base0hi.Add(excess+interval)), "return %d (in %v) more than an interval of jitter after its base", i, b)
			}
		})
	}
}

func TestKeys(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name string
		opt  []asynqadapter.Option
		ctx  context.Context
		want string
	}{
		{"by type", nil, context.Background(), "tasks:{email:welcome}"},
		{"by queue outside a server", []asynqadapter.Option{asynqadapter.WithKey(asynqadapter.ByQueue)}, context.Background(), "tasks:{default}"},
		{"by payload", []asynqadapter.Option{asynqadapter.WithKey(func(_ context.Context, t *asynq.Task) string {
			return "tenant-" + string(t.Payload())
		})}, context.Background(), "tasks:{tenant-42}"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			e := newEnv(t)
			l := e.limiter(t, throttle.PerSecond(10, 0))
			h := asynqadapter.Middleware(l, tc.opt...)(noop)
			require.NoError(t, h.ProcessTask(tc.ctx, asynq.NewTask("email:welcome", []byte("42"))))
			keys, err := e.rdb.Keys(context.Background(), e.prefix+"*").Result()
			require.NoError(t, err)
			require.Equal(t, []string{e.prefix + tc.want}, keys)
		})
	}
}

func TestMaxWaitOption(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	l := e.limiter(t, throttle.PerSecond(10, 0)) // no cap of its own
	// On an explicit clock: the next slot is exactly 2 s away, however
	// long the calls take.
	at := testhook.WithNow(context.Background(), time.Now().UnixMicro())
	fill(t, at, l, "k", 20)
	h := asynqadapter.Middleware(l, asynqadapter.WithMaxWait(50*time.Millisecond))(noop)
	err := h.ProcessTask(at, asynq.NewTask("k", nil))
	require.ErrorIs(t, err, deadline.ErrMaxWaitExceeded)
	// The handler's deadline bounds the wait too.
	h = asynqadapter.Middleware(l)(noop)
	ctx, cancel := context.WithTimeout(at, time.Second)
	defer cancel()
	err = h.ProcessTask(ctx, asynq.NewTask("k", nil))
	require.ErrorIs(t, err, deadline.ErrWouldExceedDeadline)
	require.True(t, asynqadapter.IsRateLimited(err))
}

func TestWaitsThenRuns(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	l := e.limiter(t, throttle.PerSecond(10, 0), reserve.WithMaxWait(time.Second))
	// Before the filling booking: its slot is now or later, and the
	// task's one interval after it, however long the calls take.
	start := time.Now()
	fill(t, context.Background(), l, "k", 1)
	ran := time.Time{}
	h := asynqadapter.Middleware(l)(asynq.HandlerFunc(func(context.Context, *asynq.Task) error {
		ran = time.Now()
		return errors.New("task's own error")
	}))
	err := h.ProcessTask(context.Background(), asynq.NewTask("k", nil))
	require.EqualError(t, err, "task's own error")
	// To the microsecond, the Redis clock's resolution.
	require.GreaterOrEqual(t, ran.Sub(start), 100*time.Millisecond-time.Microsecond, "waited for the slot")

	// Cancelled while waiting: the context's error, and the task never runs.
	// A limit of one a minute: the slot is a minute away however slow the
	// machine, so the cancel always comes first.
	slow := e.limiter(t, throttle.PerMinute(1, 0), reserve.WithMaxWait(2*time.Minute))
	fill(t, context.Background(), slow, "s", 1)
	h = asynqadapter.Middleware(slow)(asynq.HandlerFunc(func(context.Context, *asynq.Task) error {
		ran = time.Now()
		return errors.New("task's own error")
	}))
	ran = time.Time{}
	ctx, cancel := context.WithCancel(context.Background())
	time.AfterFunc(20*time.Millisecond, cancel)
	err = h.ProcessTask(ctx, asynq.NewTask("s", nil))
	require.ErrorIs(t, err, context.Canceled)
	require.True(t, ran.IsZero())
}

// TestLimiterErrors: an unavailable limiter (no fallback) is a refusal
// unless WithUnavailableAsFailure(true); other limiter errors, such as a
// corrupt stored value, are failures.
func TestLimiterErrors(t *testing.T) {
	t.Parallel()
	down := redistest.Start(t)
	rdb := down.Client(t)
	down.Stop()
	eng, err := throttle.New(rdb)
	require.NoError(t, err)
	l, err := reserve.New(eng, "tasks", throttle.PerSecond(10, 0))
	require.NoError(t, err)
	err = asynqadapter.Middleware(l)(noop).ProcessTask(context.Background(), asynq.NewTask("k", nil))
	require.ErrorIs(t, err, throttle.ErrUnavailable)
	require.True(t, asynqadapter.IsRefusal(err))
	require.False(t, asynqadapter.IsFailure(err))
	err = asynqadapter.Middleware(l, asynqadapter.WithUnavailableAsFailure(true))(noop).ProcessTask(context.Background(), asynq.NewTask("k", nil))
	require.ErrorIs(t, err, throttle.ErrUnavailable)
	require.False(t, asynqadapter.IsRefusal(err))
	require.True(t, asynqadapter.IsFailure(err))

	e := newEnv(t)
	l = e.limiter(t, throttle.PerSecond(10, 0))
	require.NoError(t, e.rdb.Set(context.Background(), e.prefix+"tasks:{k}", "not a TAT", 0).Err())
	err = asynqadapter.Middleware(l)(noop).ProcessTask(context.Background(), asynq.NewTask("k", nil))
	require.ErrorIs(t, err, throttle.ErrCorruptState)
	require.True(t, asynqadapter.IsFailure(err))
}

// TestBadOptions: NewMiddleware returns an error matching
// ErrInvalidOption for each bad option, making no Redis call; Middleware
// panics with the same message.
func TestBadOptions(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	l := e.limiter(t, throttle.PerSecond(10, 0))
	layered := e.limiter(t, throttle.PerSecond(10, 0), reserve.WithLimit(throttle.PerHour(1000, 0)))
	// The same client and prefix, another engine: booked attempts would
	// judge a key the limiter's other paths never see.
	other, err := throttle.New(e.rdb, throttle.WithPrefix(e.prefix), throttle.WithTimeout(5*time.Second))
	require.NoError(t, err)
	tests := []struct {
		name string
		lim  *reserve.Limiter
		opt  asynqadapter.Option
		want string
	}{
		{"nil limiter", nil, nil, "nil limiter"},
		{"negative max wait", l, asynqadapter.WithMaxWait(-time.Second), "negative max wait -1s"},
		{"nil key func", l, asynqadapter.WithKey(nil), "nil key function"},
		{"negative work estimate", l, asynqadapter.WithWorkEstimate(-time.Second), "negative work estimate -1s"},
		{"nil inspector", l, asynqadapter.WithInspector(nil), "nil inspector"},
		{"zero check interval", l, asynqadapter.WithCheckInterval(0), "check interval 0s: want a positive duration"},
		{"zero unavailable delay", l, asynqadapter.WithUnavailableDelay(0), "unavailable delay 0s: want a positive duration"},
		{"booked retries, nil engine", l, asynqadapter.WithBookedRetries(nil, time.Minute), "booked retries: nil engine"},
		{"booked retries, no horizon", l, asynqadapter.WithBookedRetries(e.eng, 0), "booked retries: horizon 0s: want a positive duration of at most 8784h0m0s"},
		{"booked retries, two limits", layered, asynqadapter.WithBookedRetries(e.eng, time.Minute), "booked retries: the limiter has 2 limits, want one"},
		{"booked retries, another engine", l, asynqadapter.WithBookedRetries(other, time.Minute), "booked retries: the engine is not the one the limiter books through"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			var opts []asynqadapter.Option
			if tc.opt != nil {
				opts = append(opts, tc.opt)
			}
			before := e.calls.Load()
			mw, err := asynqadapter.NewMiddleware(tc.lim, opts...)
			require.ErrorIs(t, err, asynqadapter.ErrInvalidOption)
			require.Nil(t, mw)
			want := "asynqadapter: invalid option: " + tc.want
			require.EqualError(t, err, want)
			require.PanicsWithValue(t, want, func() { asynqadapter.Middleware(tc.lim, opts...) })
			require.Equal(t, before, e.calls.Load(), "no Redis call")
		})
	}
	mw, err := asynqadapter.NewMiddleware(l, asynqadapter.WithWorkEstimate(time.Second), asynqadapter.WithCheckInterval(time.Second))
	require.NoError(t, err)
	require.NotNil(t, mw)
}

// server runs an asynq server on queue with the middleware, until the test
// ends.
func server(t *testing.T, rdb *redis.Client, queue string, concurrency int, mw asynq.MiddlewareFunc, h asynq.HandlerFunc, with ...func(*asynq.Config)) {
	t.Helper()
	cfg := asynq.Config{
		Concurrency:              concurrency,
		Queues:                   map[string]int{queue: 1},
		IsFailure:                asynqadapter.IsFailure,
		RetryDelayFunc:           asynqadapter.RetryDelayFunc(nil),
		DelayedTaskCheckInterval: time.Second,
		TaskCheckInterval:        50 * time.Millisecond,
		LogLevel:                 asynq.ErrorLevel,
		ShutdownTimeout:          5 * time.Second,
	}
	for _, f := range with {
		f(&cfg)
	}
	srv := asynq.NewServerFromRedisClient(rdb, cfg)
	mux := asynq.NewServeMux()
	mux.Use(mw)
	mux.Handle("api:call", h)
	require.NoError(t, srv.Start(mux))
	t.Cleanup(srv.Shutdown)
}

// TestTwoServersShareTheQuota: 200 tasks enqueued at once, two asynq
// servers of 10 workers each, 10/s burst 5, 2 s max wait. Every task
// completes; none is archived or failed because of the limit; starts keep
// to the limit; about one limiter call per task.
func TestTwoServersShareTheQuota(t *testing.T) {
	if testing.Short() {
		t.Skip("20 s: skipped with -short")
	}
	t.Parallel()
	srvRedis := redistest.Shared(t)
	srvRedis.RequireReal(t)
	prefix := redistest.Prefix(t)
	queue := "q" + prefix
	limit := throttle.PerSecond(10, 5)

	var (
		mu     sync.Mutex // guards starts
		starts []time.Time
		done   = make(chan struct{}, 200)
	)
	handler := func(context.Context, *asynq.Task) error {
		mu.Lock()
		starts = append(starts, time.Now())
		mu.Unlock()
		done <- struct{}{}
		return nil
	}
	var counters []*callcount.Counter
	for i := 0; i < 2; i++ {
		// Each server is a process: its own clients for asynq and the limiter.
		limRedis := srvRedis.Client(t)
		counters = append(counters, callcount.Attach(limRedis))
		eng, err := throttle.New(limRedis, throttle.WithPrefix(prefix), throttle.WithTimeout(5*time.Second))
		require.NoError(t, err)
		redistest.UntilOK(t, func() error { return eng.Load(context.Background()) })
		lim, err := reserve.New(eng, "asynq", limit, reserve.WithMaxWait(2*time.Second))
		require.NoError(t, err)
		server(t, srvRedis.Client(t), queue, 10, asynqadapter.Middleware(lim), handler)
	}

	control := timing.Control(t)
	client := asynq.NewClientFromRedisClient(srvRedis.Client(t))
	for i := 0; i < 200; i++ {
		_, err := client.Enqueue(asynq.NewTask("api:call", []byte(fmt.Sprint(i))), asynq.Queue(queue))
		require.NoError(t, err)
	}
	timeout := time.After(90 * time.Second)
	for i := 0; i < 200; i++ {
		select {
		case <-done:
		case <-timeout:
			t.Fatalf("only %d of 200 tasks completed", i)
		}
	}
	insp := asynq.NewInspectorFromRedisClient(srvRedis.Client(t))
	qi, err := insp.GetQueueInfo(queue)
	require.NoError(t, err)
	require.Zero(t, qi.Archived, "archived")
	require.Zero(t, qi.Failed, "failed today")
	require.Zero(t, qi.Retry, "waiting to retry")

	var calls int64
	for _, c := range counters {
		calls += c.Load()
	}
	t.Logf("%d limiter calls for 200 tasks", calls)
	require.LessOrEqual(t, float64(calls)/200, 2.0)

	// A start comes after its slot by as much as the machine delays a
	// timer's wake-up: allow the worst a plain timer measured alongside
	// saw, and 50ms more for asynq's hand-over.
	timerLate := control()
	require.NotEmpty(t, timerLate)
	slack := 50*time.Millisecond + timerLate[len(timerLate)-1]
	t.Logf("a plain timer alongside was up to %v late: %v slack", timerLate[len(timerLate)-1], slack)
	mu.Lock()
	defer mu.Unlock()
	require.NoError(t, limitcheck.Windows(starts, limit, slack))
}

// TestLastAttempt: a task with MaxRetry(0) whose slot is beyond the max
// wait waits for it (by default) instead of being archived; with
// WithLastAttemptWait(false) it is refused and asynq archives it.
func TestLastAttempt(t *testing.T) {
	for _, wait := range []bool{true, false} {
		t.Run(fmt.Sprint("wait=", wait), func(t *testing.T) {
			t.Parallel()
			srvRedis, e, queue := queueEnv(t)
			l := e.limiter(t, throttle.PerSecond(10, 0), reserve.WithMaxWait(50*time.Millisecond))
			// Waiting: the next slot ~400ms away. Refused: ~4 s away, so
			// that it is still beyond the max wait however long the
			// server takes to hand the task over.
			slots := 4
			if !wait {
				slots = 40
			}
			fill(t, context.Background(), l, "api:call", slots)
			ran := make(chan struct{}, 1)
			server(t, srvRedis.Client(t), queue, 2, asynqadapter.Middleware(l, asynqadapter.WithLastAttemptWait(wait)),
				func(context.Context, *asynq.Task) error { ran <- struct{}{}; return nil })
			client := asynq.NewClientFromRedisClient(srvRedis.Client(t))
			_, err := client.Enqueue(asynq.NewTask("api:call", nil), asynq.Queue(queue), asynq.MaxRetry(0))
			require.NoError(t, err)
			insp := asynq.NewInspectorFromRedisClient(srvRedis.Client(t))
			if wait {
				select {
				case <-ran:
				case <-time.After(10 * time.Second):
					t.Fatal("the task did not run")
				}
				return
			}
			require.Eventually(t, func() bool {
				qi, err := insp.GetQueueInfo(queue)
				return err == nil && qi.Archived == 1
			}, 10*time.Second, 20*time.Millisecond, "refused on its last attempt: archived")
			require.Empty(t, ran)
		})
	}
}

// TestInspectorDeadline: a refused task that could only come back after
// its absolute deadline is archived at once instead of sent back.
func TestInspectorDeadline(t *testing.T) {
	t.Parallel()
	srvRedis, e, queue := queueEnv(t)
	l := e.limiter(t, throttle.PerSecond(1, 0), reserve.WithMaxWait(100*time.Millisecond))
	fill(t, context.Background(), l, "api:call", 20) // next slot ~20 s away
	insp := asynq.NewInspectorFromRedisClient(srvRedis.Client(t))
	server(t, srvRedis.Client(t), queue, 2,
		asynqadapter.Middleware(l, asynqadapter.WithInspector(insp), asynqadapter.WithLastAttemptWait(false)),
		func(context.Context, *asynq.Task) error { return nil })
	client := asynq.NewClientFromRedisClient(srvRedis.Client(t))
	info, err := client.Enqueue(asynq.NewTask("api:call", nil), asynq.Queue(queue), asynq.Deadline(time.Now().Add(5*time.Second)))
	require.NoError(t, err)
	require.Eventually(t, func() bool {
		ti, err := insp.GetTaskInfo(queue, info.ID)
		return err == nil && ti.State == asynq.TaskStateArchived
	}, 5*time.Second, 20*time.Millisecond, "archived before its deadline passed")
	ti, err := insp.GetTaskInfo(queue, info.ID)
	require.NoError(t, err)
	require.Contains(t, ti.LastErr, "too close to its deadline")
	require.Zero(t, ti.Retried, "no retry was used up")
}

// TestSpreadReducesCollisions measures what spreading is for: 30 tasks
// arrive at once at 20/s with a 200ms max wait; each refused task comes
// back after its RetryAfter. Without spreading, the refused tasks return
// together and all but one are refused again, round after round.
func TestSpreadReducesCollisions(t *testing.T) {
	t.Parallel()
	attempts := map[bool]int64{}
	for _, spread := range []bool{false, true} {
		e := newEnv(t)
		l := e.limiter(t, throttle.PerSecond(20, 0), reserve.WithMaxWait(200*time.Millisecond))
		h := asynqadapter.Middleware(l, asynqadapter.WithSpread(spread))(noop)
		var (
			wg sync.WaitGroup
			mu sync.Mutex // guards n
			n  int64
		)
		for i := 0; i < 30; i++ {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for {
					mu.Lock()
					n++
					mu.Unlock()
					err := h.ProcessTask(context.Background(), asynq.NewTask("burst", nil))
					var rl *asynqadapter.RateLimitedError
					if !errors.As(err, &rl) {
						if err != nil {
							t.Error(err)
						}
						return
					}
					time.Sleep(rl.RetryAfter)
				}
			}()
		}
		wg.Wait()
		attempts[spread] = n
	}
	t.Logf("attempts for 30 tasks: %d without spreading, %d with", attempts[false], attempts[true])
	// Quiet, the ratio is about 6; two suites at once on 2 cores brought it
	// to 2.8. Without spreading's effect it would be about 1.
	require.Greater(t, attempts[false], 2*attempts[true], "spreading should cut repeated refusals")
}
