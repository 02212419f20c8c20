package asynqadapter_test

// Adversarial review (side paths): repeated, retried, interleaved, slowed
// and cut-short operations of the asynq middleware, judged against a
// textbook GCRA replay of the handler starts that actually happened.

import (
	"context"
	"errors"
	"fmt"
	"sort"
	"sync"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/slotbook/slotbook/asynqadapter"
	"github.com/slotbook/slotbook/internal/redistest"
	"github.com/slotbook/slotbook/lease"
	"github.com/slotbook/slotbook/reserve"
	"github.com/slotbook/slotbook/throttle"
)

// revASReplay is a textbook GCRA (virtual scheduling) over start times:
// emission interval iv, burst b (tau = b*iv). A start earlier than
// TAT-tau-slack conforms to no schedule of the limit. It returns a
// description of every non-conforming start.
func revASReplay(starts []time.Time, iv time.Duration, b int, slack time.Duration) []string {
	s := append([]time.Time(nil), starts...)
	sort.Slice(s, func(i, j int) bool { return s[i].Before(s[j]) })
	tau := time.Duration(b) * iv
	var tat time.Time
	var bad []string
	for i, at := range s {
		if !tat.IsZero() && at.Before(tat.Add(-tau-slack)) {
			bad = append(bad, fmt.Sprintf("start %d at %s is %v before the earliest conforming instant",
				i, at.Format("15:04:05.000"), tat.Add(-tau).Sub(at).Round(time.Millisecond)))
		}
		if tat.IsZero() || at.After(tat) {
			tat = at
		}
		tat = tat.Add(iv)
	}
	return bad
}

// revASProc is one "process": an engine on a client of its own.
func revASProc(t *testing.T, prefix string) (*redis.Client, *throttle.Engine) {
	t.Helper()
	rdb := redistest.Shared(t).Client(t)
	eng, err := throttle.New(rdb, throttle.WithPrefix(prefix), throttle.WithTimeout(5*time.Second))
	require.NoError(t, err)
	redistest.UntilOK(t, func() error { return eng.Load(context.Background()) })
	return rdb, eng
}

// revASServer starts an asynq server on queues, with the middleware, and
// a short shutdown timeout (asynq then requeues the tasks still running
// and cancels their handlers' contexts). The caller may Shutdown it early.
func revASServer(t *testing.T, rdb *redis.Client, queues []string, mw asynq.MiddlewareFunc, h asynq.HandlerFunc) *asynq.Server {
	t.Helper()
	qs := map[string]int{}
	for _, q := range queues {
		qs[q] = 1
	}
	srv := asynq.NewServerFromRedisClient(rdb, asynq.Config{
		Concurrency:              4,
		Queues:                   qs,
		IsFailure:                asynqadapter.IsFailure,
		RetryDelayFunc:           asynqadapter.RetryDelayFunc(nil),
		DelayedTaskCheckInterval: time.Second,
		TaskCheckInterval:        50 * time.Millisecond,
		LogLevel:                 asynq.FatalLevel,
		ShutdownTimeout:          100 * time.Millisecond,
	})
	mux := asynq.NewServeMux()
	mux.Use(mw)
	mux.Handle("api:call", h)
	require.NoError(t, srv.Start(mux))
	t.Cleanup(srv.Shutdown)
	return srv
}

type revASStarts struct {
	mu  sync.Mutex
	all []time.Time
	by  map[string][]time.Time
	got map[string]time.Time // task id -> its latest delivery to the middleware (see timed)
}

// timed returns mw behind a middleware that times each delivery of a task
// as it reaches mw: a local instant (with its monotonic reading) before mw
// reads or books the task's slot, from which a start can be judged as a
// monotonic offset (see delivered).
func (s *revASStarts) timed(mw asynq.MiddlewareFunc) asynq.MiddlewareFunc {
	return func(next asynq.Handler) asynq.Handler {
		inner := mw(next)
		return asynq.HandlerFunc(func(ctx context.Context, task *asynq.Task) error {
			id, _ := asynq.GetTaskID(ctx)
			s.mu.Lock()
			if s.got == nil {
				s.got = map[string]time.Time{}
			}
			s.got[id] = time.Now()
			s.mu.Unlock()
			return inner.ProcessTask(ctx, task)
		})
	}
}

// delivered returns the latest delivery of task id through timed.
func (s *revASStarts) delivered(id string) time.Time {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.got[id]
}

func (s *revASStarts) add(ctx context.Context) {
	id, _ := asynq.GetTaskID(ctx)
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.by == nil {
		s.by = map[string][]time.Time{}
	}
	now := time.Now()
	s.all = append(s.all, now)
	s.by[id] = append(s.by[id], now)
}

func (s *revASStarts) get() ([]time.Time, map[string][]time.Time) {
	s.mu.Lock()
	defer s.mu.Unlock()
	by := map[string][]time.Time{}
	for k, v := range s.by {
		by[k] = append([]time.Time(nil), v...)
	}
	return append([]time.Time(nil), s.all...), by
}

// Failed before a returning task always recalled its booking from the
// index, taking the entry out (two starts on one slot).
//
// TestReviewASRequeuedTaskRunsTwiceOnOneSlot: booked retries, two
// processes P1 and P2 sharing one limit of 1/s, burst 0.
//
//  1. P2 refuses task X and books its slot S ahead (recorded in the index).
//  2. About 1.5 s before S, P1 books for another task Z of the same key:
//     the reply lists X's booking as due, and P1 keeps it locally.
//  3. X comes back to P2, which recalls its booking from the index (taking
//     it out) and starts X's handler at S. X's work is long.
//  4. P2's asynq server shuts down (a deploy): after its ShutdownTimeout
//     asynq requeues X (same retry count) and cancels its handler.
//  5. P1 takes X up, finds its kept copy of X's booking, not late, and
//     starts X at once, without a Redis call.
//
// X's re-run is a second call to the rate-limited API. It should have
// booked a slot of its own; it ran on S, already used by the first run.
func TestReviewASRequeuedTaskRunsTwiceOnOneSlot(t *testing.T) {
	srvRedis, e, queue := queueEnv(t)
	queueZ := queue + "z"
	const iv = time.Second
	limit := throttle.PerSecond(1, 0)
	prefix := e.prefix

	_, eng1 := revASProc(t, prefix)
	_, eng2 := revASProc(t, prefix)
	l1, err := reserve.New(eng1, "tasks", limit, reserve.WithMaxWait(5*time.Second))
	require.NoError(t, err)
	l2, err := reserve.New(eng2, "tasks", limit, reserve.WithMaxWait(100*time.Millisecond))
	require.NoError(t, err)
	mw1, err := asynqadapter.NewMiddleware(l1, asynqadapter.WithBookedRetries(eng1, time.Minute), asynqadapter.WithCheckInterval(time.Second))
	require.NoError(t, err)
	mw2, err := asynqadapter.NewMiddleware(l2, asynqadapter.WithBookedRetries(eng2, time.Minute), asynqadapter.WithCheckInterval(time.Second))
	require.NoError(t, err)

	var starts revASStarts
	xStarted := make(chan struct{}, 4)
	handler := func(ctx context.Context, task *asynq.Task) error {
		starts.add(ctx)
		if string(task.Payload()) == "x" {
			xStarted <- struct{}{}
			<-ctx.Done() // long work: still running when its server shuts down
			return ctx.Err()
		}
		return nil
	}
	insp := asynq.NewInspectorFromRedisClient(srvRedis.Client(t))
	client := asynq.NewClientFromRedisClient(srvRedis.Client(t))
	t.Cleanup(func() { _ = client.Close() })

	fill(t, context.Background(), l2, "api:call", 5) // next slot ~5 s away
	// 1. P2 refuses X and books its slot.
	p2 := revASServer(t, srvRedis.Client(t), []string{queue}, mw2, handler)
	_, err = client.Enqueue(asynq.NewTask("api:call", []byte("x")), asynq.Queue(queue), asynq.TaskID("x"), asynq.Retention(time.Hour))
	require.NoError(t, err)
	ti := waitState(t, insp, queue, "x", asynq.TaskStateRetry, 10*time.Second)
	require.Contains(t, ti.LastErr, "slot booked in")
	require.NoError(t, insp.PauseQueue(queue)) // X waits until step 3
	look := redistest.Shared(t).Client(t)
	idx := prefix + "tasks:{api:call}:asynq"
	entries, err := look.ZRangeWithScores(context.Background(), idx, 0, -1).Result()
	require.NoError(t, err)
	require.Len(t, entries, 1)
	slot := time.UnixMicro(int64(entries[0].Score))
	t.Logf("X booked for %v from now", time.Until(slot).Round(time.Millisecond))

	// 2. P1 books for Z about 1.5 s before S: its reply lists X's booking.
	time.Sleep(time.Until(slot.Add(-1500 * time.Millisecond)))
	revASServer(t, srvRedis.Client(t), []string{queueZ}, mw1, handler)
	_, err = client.Enqueue(asynq.NewTask("api:call", []byte("z")), asynq.Queue(queueZ), asynq.TaskID("z"), asynq.Retention(time.Hour))
	require.NoError(t, err)
	waitState(t, insp, queueZ, "z", asynq.TaskStateActive, 5*time.Second)
	time.Sleep(200 * time.Millisecond) // Z's booking call has returned
	n, err := look.ZCard(context.Background(), idx).Result()
	require.NoError(t, err)
	require.Equal(t, int64(1), n, "X's booking is still in the index")

	// 3. X comes back to P2, which recalls its booking and starts it.
	require.NoError(t, insp.UnpauseQueue(queue))
	select {
	case <-xStarted:
	case <-time.After(10 * time.Second):
		t.Fatal("X did not start on P2")
	}
	if late := time.Since(slot); late > iv/2 {
		t.Skipf("X started %v after its slot on P2: too late for the scene", late)
	}
	// 4. P2 shuts down: X is requeued with its retry count.
	p2.Shutdown()
	// 5. P1 serves X's queue.
	revASServer(t, srvRedis.Client(t), []string{queue}, mw1, func(ctx context.Context, _ *asynq.Task) error {
		starts.add(ctx)
		return nil
	})
	waitState(t, insp, queue, "x", asynq.TaskStateCompleted, 15*time.Second)
	waitState(t, insp, queueZ, "z", asynq.TaskStateCompleted, 15*time.Second)

	all, by := starts.get()
	for id, s := range by {
		for _, at := range s {
			t.Logf("task %s started %v after X's slot", id, at.Sub(slot).Round(time.Millisecond))
		}
	}
	require.Len(t, by["x"], 2, "X ran on P2, then again after the requeue")
	bad := revASReplay(all, iv, 0, 150*time.Millisecond)
	require.Empty(t, bad, "the handler starts, replayed through GCRA 1/s burst 0")
}

// TestReviewASAbortWhileSleepingGivesBack: without booked retries, a task
// sleeping in its handler until its slot when its server shuts down
// (asynq requeues it after ShutdownTimeout and cancels its context) gives
// the slot back: taken up again, it runs at that same slot, not one
// interval later.
func TestReviewASAbortWhileSleepingGivesBack(t *testing.T) {
	srvRedis, e, queue := queueEnv(t)
	const iv = time.Second
	l := e.limiter(t, throttle.PerSecond(1, 0), reserve.WithMaxWait(10*time.Second))
	var starts revASStarts
	mw := starts.timed(asynqadapter.Middleware(l))
	h := func(ctx context.Context, _ *asynq.Task) error { starts.add(ctx); return nil }
	insp := asynq.NewInspectorFromRedisClient(srvRedis.Client(t))
	client := asynq.NewClientFromRedisClient(srvRedis.Client(t))
	t.Cleanup(func() { _ = client.Close() })

	patient, err := l.With(reserve.WithoutMaxWait())
	require.NoError(t, err)
	var last *reserve.Reservation
	for range 3 {
		last, err = patient.Reserve(context.Background(), "api:call")
		require.NoError(t, err)
		require.True(t, last.OK())
	}
	next := last.Booking().At.Add(iv) // Redis clock (this machine's)
	srv := revASServer(t, srvRedis.Client(t), []string{queue}, mw, h)
	_, err = client.Enqueue(asynq.NewTask("api:call", nil), asynq.Queue(queue), asynq.TaskID("a"), asynq.Retention(time.Hour))
	require.NoError(t, err)
	waitState(t, insp, queue, "a", asynq.TaskStateActive, 5*time.Second)
	time.Sleep(300 * time.Millisecond) // booked, sleeping
	if time.Until(next) < 800*time.Millisecond {
		t.Skip("too close to the slot for the scene")
	}
	srv.Shutdown()
	revASServer(t, srvRedis.Client(t), []string{queue}, mw, h)
	waitState(t, insp, queue, "a", asynq.TaskStateCompleted, 15*time.Second)
	all, _ := starts.get()
	require.Len(t, all, 1)
	off := all[0].Sub(next)
	t.Logf("started %v after the slot it first booked", off.Round(time.Millisecond))
	// Judged as a monotonic offset from the delivery that ran it (before
	// the middleware booked again), against the slot's wall-clock offset
	// from that delivery, not as a wall-clock reading: the middleware
	// sleeps until the slot on the monotonic clock, which this VM's wall
	// clock is slewed against (hundreds of µs a second at times, over a
	// sleep of a second or more here).
	got := starts.delivered("a")
	require.GreaterOrEqual(t, all[0].Sub(got), next.Sub(got.Round(0))-time.Millisecond, "not before the slot")
	require.Less(t, off, iv*6/10, "the slot was given back and booked again: no interval lost")
}

// Failed before a task cut short while it slept put its recalled booking
// back in the index (a slot lost, quota wasted; the limit was not
// exceeded).
//
// TestReviewASRecalledSleepAbortLosesSlot: booked retries. A task whose
// booked slot was recalled from the index (it came back to a process that
// did not keep it) sleeps until it; its server shuts down meanwhile
// (asynq requeues it, same retry count, and cancels its context). Taken
// up again at once, the task must run at the slot booked for it, which it
// never reached, not book a new one a whole interval later.
func TestReviewASRecalledSleepAbortLosesSlot(t *testing.T) {
	srvRedis, e, queue := queueEnv(t)
	const iv = time.Second
	l := e.limiter(t, throttle.PerSecond(1, 0), reserve.WithMaxWait(100*time.Millisecond))
	// Check interval 2 s: the task comes back at least a second before its
	// slot, time for the server to shut down while it sleeps.
	mw, err := asynqadapter.NewMiddleware(l, asynqadapter.WithBookedRetries(e.eng, time.Minute), asynqadapter.WithCheckInterval(2*time.Second))
	require.NoError(t, err)
	var starts revASStarts
	h := func(ctx context.Context, _ *asynq.Task) error { starts.add(ctx); return nil }
	insp := asynq.NewInspectorFromRedisClient(srvRedis.Client(t))
	client := asynq.NewClientFromRedisClient(srvRedis.Client(t))
	t.Cleanup(func() { _ = client.Close() })
	fill(t, context.Background(), l, "api:call", 5) // next slot ~5 s away
	srv := revASServer(t, srvRedis.Client(t), []string{queue}, mw, h)
	_, err = client.Enqueue(asynq.NewTask("api:call", nil), asynq.Queue(queue), asynq.TaskID("a"), asynq.Retention(time.Hour))
	require.NoError(t, err)
	waitState(t, insp, queue, "a", asynq.TaskStateRetry, 10*time.Second)
	look := redistest.Shared(t).Client(t)
	idx := e.prefix + "tasks:{api:call}:asynq"
	entries, err := look.ZRangeWithScores(context.Background(), idx, 0, -1).Result()
	require.NoError(t, err)
	require.Len(t, entries, 1)
	slot := time.UnixMicro(int64(entries[0].Score))
	waitState(t, insp, queue, "a", asynq.TaskStateActive, 10*time.Second)
	time.Sleep(100 * time.Millisecond) // its recall has returned
	if left := time.Until(slot); left < 400*time.Millisecond {
		t.Skipf("taken up %v before its slot: too late for the scene", left)
	}
	n, err := look.ZCard(context.Background(), idx).Result()
	require.NoError(t, err)
	require.Zero(t, n, "the recall took the entry out")
	srv.Shutdown() // requeued, its context cancelled while it sleeps
	revASServer(t, srvRedis.Client(t), []string{queue}, mw, h)
	waitState(t, insp, queue, "a", asynq.TaskStateCompleted, 15*time.Second)
	all, _ := starts.get()
	require.Len(t, all, 1)
	off := all[0].Sub(slot)
	t.Logf("started %v after the slot booked for it", off.Round(time.Millisecond))
	require.GreaterOrEqual(t, off, -time.Millisecond)
	require.Less(t, off, iv*6/10, "the task never ran at its booked slot, yet ran a whole interval later: the slot was lost")
}

// TestReviewASRefusalBooksNothing: refusals, repeated, with a 40 ms round
// trip to the limiter's Redis, leave the key's state as it was; the last
// refusal's RetryAfter is when a slot fits. Then with the Redis away
// (proxy closed) a task is refused (unavailable) without a failure.
func TestReviewASRefusalBooksNothing(t *testing.T) {
	srv := redistest.Shared(t)
	srv.RequireReal(t)
	prefix := redistest.Prefix(t)
	p := redistest.NewProxy(t, fmt.Sprintf("127.0.0.1:%d", srv.Port()))
	p.SetLatency(20 * time.Millisecond) // 40 ms a round trip
	rdb := p.Client(t, srv)
	eng, err := throttle.New(rdb, throttle.WithPrefix(prefix), throttle.WithTimeout(2*time.Second))
	require.NoError(t, err)
	redistest.UntilOK(t, func() error { return eng.Load(context.Background()) })
	l, err := reserve.New(eng, "tasks", throttle.PerSecond(10, 0), reserve.WithMaxWait(100*time.Millisecond))
	require.NoError(t, err)
	fill(t, context.Background(), l, "k", 10) // next slot ~1 s away
	look := srv.Client(t)
	key := prefix + "tasks:{k}"
	before, err := look.Get(context.Background(), key).Result()
	require.NoError(t, err)
	ran := 0
	h := asynqadapter.Middleware(l, asynqadapter.WithSpread(false))(asynq.HandlerFunc(func(context.Context, *asynq.Task) error { ran++; return nil }))
	for range 5 {
		err := h.ProcessTask(context.Background(), asynq.NewTask("k", nil))
		var rl *asynqadapter.RateLimitedError
		require.ErrorAs(t, err, &rl)
		require.True(t, asynqadapter.IsRefusal(err))
		require.False(t, asynqadapter.IsFailure(err))
		require.Positive(t, rl.RetryAfter)
	}
	after, err := look.Get(context.Background(), key).Result()
	require.NoError(t, err)
	require.Equal(t, before, after, "refusals booked nothing")
	require.Zero(t, ran)

	p.Close()
	err = h.ProcessTask(context.Background(), asynq.NewTask("k", nil))
	require.ErrorIs(t, err, throttle.ErrUnavailable)
	require.True(t, asynqadapter.IsRefusal(err), "an unavailable limiter is a refusal: %v", err)
	require.False(t, asynqadapter.IsFailure(err))
	require.Zero(t, ran)
}

// TestReviewASLeaseReleasedOnEveryExit: the lease middleware gives its
// lease back when the handler panics, returns an error, or returns after
// its context ended, so that the next task (N = 1, TTL 30 s) gets a lease
// at once rather than after the TTL. With a 40 ms round trip too.
func TestReviewASLeaseReleasedOnEveryExit(t *testing.T) {
	srv := redistest.Shared(t)
	srv.RequireReal(t)
	prefix := redistest.Prefix(t)
	p := redistest.NewProxy(t, fmt.Sprintf("127.0.0.1:%d", srv.Port()))
	p.SetLatency(20 * time.Millisecond)
	eng, err := throttle.New(p.Client(t, srv), throttle.WithPrefix(prefix), throttle.WithTimeout(2*time.Second))
	require.NoError(t, err)
	redistest.UntilOK(t, func() error { return eng.Load(context.Background()) })
	sem, err := lease.New(eng, "tasks", 1, lease.WithTTL(30*time.Second))
	require.NoError(t, err)
	t.Cleanup(func() { _ = sem.Close(context.Background()) })
	mw := asynqadapter.LeaseMiddleware(sem, asynqadapter.WithLeaseMaxWait(3*time.Second))
	exits := map[string]asynq.HandlerFunc{
		"panic": func(context.Context, *asynq.Task) error { panic("boom") },
		"error": func(context.Context, *asynq.Task) error { return errors.New("task failed") },
		"ctx": func(ctx context.Context, _ *asynq.Task) error {
			<-ctx.Done()
			return ctx.Err()
		},
	}
	for _, name := range []string{"panic", "error", "ctx"} {
		h := mw(exits[name])
		ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
		func() {
			defer func() { _ = recover() }()
			_ = h.ProcessTask(ctx, asynq.NewTask("api:call", nil))
		}()
		cancel()
		start := time.Now()
		err := mw(noop).ProcessTask(context.Background(), asynq.NewTask("api:call", nil))
		require.NoError(t, err, "after the %s exit", name)
		require.Less(t, time.Since(start), 2*time.Second, "after the %s exit the lease came back at once", name)
	}
	_, err = asynqadapter.NewLeaseMiddleware(nil)
	require.ErrorIs(t, err, asynqadapter.ErrInvalidOption)
	_, err = asynqadapter.NewLeaseMiddleware(sem, asynqadapter.WithLeaseMaxWait(0))
	require.ErrorIs(t, err, asynqadapter.ErrInvalidOption)
}
