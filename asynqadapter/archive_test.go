package asynqadapter_test

import (
	"context"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/stretchr/testify/require"

	"github.com/slotbook/slotbook/asynqadapter"
	"github.com/slotbook/slotbook/reserve"
	"github.com/slotbook/slotbook/throttle"
)

// TestWorkEstimateBeyondTimeout: a work estimate longer than the task's
// Timeout can never fit, on any attempt. The task is archived on its first
// attempt, without running and without a call to the limiter's Redis,
// rather than refused (not a failure, a retry-after of 0) every second
// forever. The estimate is given to the middleware, or only to the
// limiter. Found by review: refused 10 times in 10 s, never archived.
func TestWorkEstimateBeyondTimeout(t *testing.T) {
	for name, opts := range map[string]struct {
		lim []reserve.Option
		mw  []asynqadapter.Option
	}{
		"middleware": {mw: []asynqadapter.Option{asynqadapter.WithWorkEstimate(3 * time.Second)}},
		"limiter":    {lim: []reserve.Option{reserve.WithWorkEstimate(3 * time.Second)}},
	} {
		t.Run(name, func(t *testing.T) {
			srvRedis, e, queue := queueEnv(t)
			l := e.limiter(t, throttle.PerSecond(100, 10), opts.lim...)
			mw, err := asynqadapter.NewMiddleware(l, opts.mw...)
			require.NoError(t, err)
			var refusals, reported, ran atomic.Int64
			server(t, srvRedis.Client(t), queue, 2, mw, func(context.Context, *asynq.Task) error { ran.Add(1); return nil },
				func(c *asynq.Config) {
					c.ErrorHandler = asynq.ErrorHandlerFunc(func(_ context.Context, _ *asynq.Task, err error) {
						if asynqadapter.IsRefusal(err) {
							refusals.Add(1)
							return
						}
						reported.Add(1)
					})
				})
			client := asynq.NewClientFromRedisClient(srvRedis.Client(t))
			t.Cleanup(func() { _ = client.Close() })
			insp := asynq.NewInspectorFromRedisClient(srvRedis.Client(t))
			calls := e.calls.Load()
			info, err := client.Enqueue(asynq.NewTask("api:call", nil), asynq.Queue(queue), asynq.MaxRetry(3),
				asynq.Timeout(2*time.Second), asynq.Retention(time.Hour))
			require.NoError(t, err)
			ti := waitState(t, insp, queue, info.ID, asynq.TaskStateArchived, 10*time.Second)
			require.Zero(t, ran.Load(), "the handler never ran")
			require.Zero(t, refusals.Load(), "not sent back as a refusal")
			require.Equal(t, int64(1), reported.Load(), "the ErrorHandler reports the archived task once")
			require.Contains(t, ti.LastErr, "work estimate")
			require.Equal(t, calls, e.calls.Load(), "no call to the limiter's Redis")
		})
	}
}

// TestArchivingRefusalIsNotARefusal: a refusal on a task's last attempt
// ends the task (asynq archives it, whatever IsFailure says), so IsRefusal
// is false for it and the package doc's ErrorHandler pattern reports it.
// Found by review: the pattern skipped the archived task.
func TestArchivingRefusalIsNotARefusal(t *testing.T) {
	srvRedis, e, queue := queueEnv(t)
	l := e.limiter(t, throttle.PerSecond(1, 0), reserve.WithMaxWait(100*time.Millisecond))
	fill(t, context.Background(), l, "api:call", 10) // the next slot is some 10 s away
	mw, err := asynqadapter.NewMiddleware(l)
	require.NoError(t, err)
	var reported, skipped atomic.Int64
	var lastErr atomic.Value
	server(t, srvRedis.Client(t), queue, 2, mw, func(context.Context, *asynq.Task) error { return nil },
		func(c *asynq.Config) {
			c.ErrorHandler = asynq.ErrorHandlerFunc(func(_ context.Context, _ *asynq.Task, err error) {
				if asynqadapter.IsRefusal(err) {
					skipped.Add(1)
					return
				}
				lastErr.Store(err.Error())
				reported.Add(1)
			})
		})
	client := asynq.NewClientFromRedisClient(srvRedis.Client(t))
	t.Cleanup(func() { _ = client.Close() })
	insp := asynq.NewInspectorFromRedisClient(srvRedis.Client(t))
	info, err := client.Enqueue(asynq.NewTask("api:call", nil), asynq.Queue(queue), asynq.MaxRetry(0),
		asynq.Timeout(2*time.Second), asynq.Retention(time.Hour))
	require.NoError(t, err)
	ti := waitState(t, insp, queue, info.ID, asynq.TaskStateArchived, 10*time.Second)
	require.Equal(t, int64(1), reported.Load(), "the archived task is reported (skipped as refusals: %d)", skipped.Load())
	require.Zero(t, skipped.Load())
	require.True(t, strings.Contains(lastErr.Load().(string), "rate limited"), "the report says why: %v", lastErr.Load())
	require.Contains(t, ti.LastErr, "last attempt")
}
