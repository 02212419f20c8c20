package asynqadapter_test

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/stretchr/testify/require"

	"github.com/slotbook/slotbook/asynqadapter"
	"github.com/slotbook/slotbook/internal/redistest"
	"github.com/slotbook/slotbook/lease"
	"github.com/slotbook/slotbook/reserve"
	"github.com/slotbook/slotbook/throttle"
)

// leaseServer stands for one asynq server: a client, an engine and a
// semaphore of its own.
func leaseServer(t *testing.T, prefix string, n int) (*throttle.Engine, *lease.Semaphore) {
	t.Helper()
	rdb := redistest.Shared(t).Client(t)
	eng, err := throttle.New(rdb, throttle.WithPrefix(prefix), throttle.WithTimeout(5*time.Second))
	require.NoError(t, err)
	sem, err := lease.New(eng, "tasks", n, lease.WithTTL(30*time.Second))
	require.NoError(t, err)
	t.Cleanup(func() { _ = sem.Close(context.Background()) })
	return eng, sem
}

// TestLeaseMiddlewarePerType runs tasks of two types through the lease
// and rate middlewares of two servers: at most N of a type at once across
// both, each type on its own.
func TestLeaseMiddlewarePerType(t *testing.T) {
	prefix := redistest.Prefix(t)
	const n = 2
	var mu sync.Mutex
	running := map[string]int{}
	peak := map[string]int{}
	handler := asynq.HandlerFunc(func(_ context.Context, task *asynq.Task) error {
		mu.Lock()
		running[task.Type()]++
		peak[task.Type()] = max(peak[task.Type()], running[task.Type()])
		mu.Unlock()
		time.Sleep(3 * time.Millisecond)
		mu.Lock()
		running[task.Type()]--
		mu.Unlock()
		return nil
	})
	var hs []asynq.Handler
	for range 2 {
		eng, sem := leaseServer(t, prefix, n)
		lim, err := reserve.New(eng, "tasks", throttle.PerSecond(2000, 50))
		require.NoError(t, err)
		mux := asynq.NewServeMux()
		mux.Use(asynqadapter.LeaseMiddleware(sem), asynqadapter.Middleware(lim))
		mux.Handle("email", handler)
		mux.Handle("sms", handler)
		hs = append(hs, mux)
	}
	var wg sync.WaitGroup
	var failed atomic.Int64
	for i := range 40 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			typ := "email"
			if i%2 == 1 {
				typ = "sms"
			}
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			if err := hs[i%len(hs)].ProcessTask(ctx, asynq.NewTask(typ, nil)); err != nil {
				t.Error(err)
				failed.Add(1)
			}
		}()
	}
	wg.Wait()
	for typ, p := range peak {
		if p > n {
			t.Errorf("%d %q tasks ran at once, want at most %d", p, typ, n)
		}
	}
	if peak["email"] < 2 && peak["sms"] < 2 {
		t.Errorf("no type ever had two tasks at once (%v): the test judged nothing", peak)
	}
}

// TestLeaseMiddlewareMaxWait sends a task back to asynq, as a refusal,
// when no lease is free within the max wait, without running it.
func TestLeaseMiddlewareMaxWait(t *testing.T) {
	prefix := redistest.Prefix(t)
	_, sem := leaseServer(t, prefix, 1)
	ctx := context.Background()
	held, err := sem.Acquire(ctx, "email")
	require.NoError(t, err)
	defer held.Release(ctx)
	ran := false
	h := asynqadapter.LeaseMiddleware(sem, asynqadapter.WithLeaseMaxWait(50*time.Millisecond))(
		asynq.HandlerFunc(func(context.Context, *asynq.Task) error { ran = true; return nil }))
	err = h.ProcessTask(ctx, asynq.NewTask("email", nil))
	var rl *asynqadapter.RateLimitedError
	require.ErrorAs(t, err, &rl)
	if !errors.Is(err, asynqadapter.ErrLeaseBusy) || !asynqadapter.IsRefusal(err) || asynqadapter.IsFailure(err) {
		t.Errorf("got %v, want a refusal matching ErrLeaseBusy that is not a failure", err)
	}
	if rl.RetryAfter != 50*time.Millisecond {
		t.Errorf("RetryAfter %v, want the max wait", rl.RetryAfter)
	}
	if ran {
		t.Error("the handler ran without a lease")
	}
}

func TestLeaseMiddlewareBadOptions(t *testing.T) {
	_, sem := leaseServer(t, redistest.Prefix(t), 1)
	for _, tc := range []struct {
		name string
		sem  *lease.Semaphore
		opts []asynqadapter.LeaseOption
	}{
		{"nil semaphore", nil, nil},
		{"nil key", sem, []asynqadapter.LeaseOption{asynqadapter.WithLeaseKey(nil)}},
		{"zero max wait", sem, []asynqadapter.LeaseOption{asynqadapter.WithLeaseMaxWait(0)}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if _, err := asynqadapter.NewLeaseMiddleware(tc.sem, tc.opts...); !errors.Is(err, asynqadapter.ErrInvalidOption) {
				t.Errorf("got %v, want ErrInvalidOption", err)
			}
		})
	}
}
