package asynqadapter_test

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/stretchr/testify/require"

	"github.com/slotbook/slotbook/asynqadapter"
	"github.com/slotbook/slotbook/internal/redistest"
	"github.com/slotbook/slotbook/reserve"
	"github.com/slotbook/slotbook/throttle"
)

// TestBookedSlowLinkNoQueue: with booked retries, the tasks of one key that
// a process takes up together must not wait for one another's calls. On a
// 40 ms round trip to the limiter's Redis, under a limit never reached, 40
// tasks of one key run by 20 workers start about as fast as with the
// ordinary path (the control, measured in the same run on the same link).
// Before the fix the middleware let one call per key be in flight per
// process at a time: a process started at most one task of a key per
// round trip (25 a second here, whatever the limit), and the 40 starts
// spanned some 1.6 s against the control's few round trips.
func TestBookedSlowLinkNoQueue(t *testing.T) {
	if testing.Short() {
		t.Skip("a few seconds: skipped with -short")
	}
	srvRedis, e, queue := queueEnv(t)
	proxy := redistest.NewProxy(t, fmt.Sprintf("127.0.0.1:%d", redistest.Shared(t).Port()))
	slow := proxy.Client(t, redistest.Shared(t))
	eng, err := throttle.New(slow, throttle.WithPrefix(e.prefix), throttle.WithTimeout(5*time.Second))
	require.NoError(t, err)
	redistest.UntilOK(t, func() error { return eng.Load(context.Background()) })
	proxy.SetLatency(20 * time.Millisecond)

	const tasks, workers = 40, 20
	limit := throttle.PerSecond(1000, 100) // never reached by 40 tasks
	span := func(name string, opts ...asynqadapter.Option) time.Duration {
		l, err := reserve.New(eng, name, limit, reserve.WithMaxWait(time.Second))
		require.NoError(t, err)
		mw, err := asynqadapter.NewMiddleware(l, opts...)
		require.NoError(t, err)
		q := queue + name
		client := asynq.NewClientFromRedisClient(srvRedis.Client(t))
		defer func() { _ = client.Close() }()
		for i := 0; i < tasks; i++ {
			_, err := client.Enqueue(asynq.NewTask("api:call", nil), asynq.Queue(q), asynq.TaskID(fmt.Sprint(i)))
			require.NoError(t, err)
		}
		var (
			mu     sync.Mutex
			starts []time.Time
			done   = make(chan struct{})
		)
		srv := asynq.NewServerFromRedisClient(srvRedis.Client(t), asynq.Config{
			Concurrency:    workers,
			Queues:         map[string]int{q: 1},
			IsFailure:      asynqadapter.IsFailure,
			RetryDelayFunc: asynqadapter.RetryDelayFunc(nil),
			LogLevel:       asynq.FatalLevel,
		})
		mux := asynq.NewServeMux()
		mux.Use(mw)
		mux.HandleFunc("api:call", func(context.Context, *asynq.Task) error {
			mu.Lock()
			defer mu.Unlock()
			starts = append(starts, time.Now())
			if len(starts) == tasks {
				close(done)
			}
			return nil
		})
		require.NoError(t, srv.Start(mux))
		defer srv.Shutdown()
		select {
		case <-done:
		case <-time.After(30 * time.Second):
			t.Fatalf("%s: not every task started", name)
		}
		mu.Lock()
		defer mu.Unlock()
		return starts[len(starts)-1].Sub(starts[0])
	}
	plain := span("plain")
	booked := span("booked", asynqadapter.WithBookedRetries(eng, time.Minute), asynqadapter.WithCheckInterval(time.Second))
	t.Logf("40 starts spanned %v with booked retries, %v on the ordinary path", booked, plain)
	// Serialized calls take 40 round trips (1.6 s); the control a few.
	require.Less(t, booked, 2*plain+400*time.Millisecond, "starts with booked retries against the ordinary path's")
}
