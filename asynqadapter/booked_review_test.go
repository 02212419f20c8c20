package asynqadapter_test

import (
	"context"
	"errors"
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

// bookedMiddleware is a middleware of l with booked retries on e's engine
// (a horizon of a minute) and a check interval of a second, as the test
// servers poll, and opts.
func bookedMiddleware(t *testing.T, e *env, l *reserve.Limiter, opts ...asynqadapter.Option) asynq.MiddlewareFunc {
	t.Helper()
	mw, err := asynqadapter.NewMiddleware(l, append([]asynqadapter.Option{asynqadapter.WithBookedRetries(e.eng, time.Minute),
		asynqadapter.WithCheckInterval(time.Second)}, opts...)...)
	require.NoError(t, err)
	return mw
}

// TestBookedNoStaleEntryAfterGiveBack: with WithInspector, a task whose
// slot lies too close to its Deadline is archived (SkipRetry). It used to
// be booked, then given back, leaving its index entry: another caller
// booked the slot given back, and the archived task, run again by hand
// (Inspector.RunTask, asynqmon's "Run") before that slot, found the stale
// entry and ran at the other caller's slot: two starts on one slot of a
// burst-0 limit. Found by review (0.4 ms apart); a booking now keeps a
// margin before the deadline, so no such slot is booked.
func TestBookedNoStaleEntryAfterGiveBack(t *testing.T) {
	srvRedis, e, queue := queueEnv(t)
	limit := throttle.PerSecond(2, 0) // I = 500ms, no burst
	l := e.limiter(t, limit, reserve.WithMaxWait(100*time.Millisecond))
	fill(t, context.Background(), l, "api:call", 8) // next slot ~4 s away
	insp := asynq.NewInspectorFromRedisClient(srvRedis.Client(t))
	mw := bookedMiddleware(t, e, l, asynqadapter.WithInspector(insp))
	var (
		mu     sync.Mutex
		starts []time.Time
	)
	server(t, srvRedis.Client(t), queue, 2, mw, func(ctx context.Context, _ *asynq.Task) error {
		mu.Lock()
		starts = append(starts, time.Now())
		mu.Unlock()
		return nil
	})
	client := asynq.NewClientFromRedisClient(srvRedis.Client(t))
	// Deadline 4.5 s away: the slot (~4 s) leaves less than the margin
	// (1 s) before it, and the deadline check archives the task.
	info, err := client.Enqueue(asynq.NewTask("api:call", nil), asynq.Queue(queue), asynq.Retention(time.Hour),
		asynq.Deadline(time.Now().Add(4500*time.Millisecond)))
	require.NoError(t, err)
	// asynq may take the task up late enough (its idle workers poll once a
	// second) that, sent back, it can wait for its slot in the handler
	// before the deadline: it then runs at it, and the scene below (an
	// archived task run by hand) does not arise. Either way no index entry
	// is left.
	var ti *asynq.TaskInfo
	end := time.Now().Add(30 * time.Second)
	for {
		ti = taskInfo(t, insp, queue, info.ID)
		if ti.State == asynq.TaskStateArchived || ti.State == asynq.TaskStateCompleted {
			break
		}
		require.True(t, time.Now().Before(end), "task still %v after 30 s (last error %q)", ti.State, ti.LastErr)
		time.Sleep(20 * time.Millisecond)
	}
	t.Logf("%v: retried %d, last error %q", ti.State, ti.Retried, ti.LastErr)
	look := redistest.Shared(t).Client(t)
	idx := e.prefix + "tasks:{api:call}:asynq"
	members, err := look.ZRangeWithScores(context.Background(), idx, 0, -1).Result()
	require.NoError(t, err)
	t.Logf("index after the task ended: %v", members)
	require.Empty(t, members, "no booking kept for the task")
	if ti.State == asynq.TaskStateCompleted {
		require.Zero(t, ti.Retried)
		t.Log("the task ran at its slot before its deadline (taken up late): no archived task to run again")
		return
	}

	// Another caller books the next slot: the one given back.
	patient, err := l.With(reserve.WithoutMaxWait())
	require.NoError(t, err)
	r, err := patient.Reserve(context.Background(), "api:call")
	require.NoError(t, err)
	require.True(t, r.OK())
	other := r.SlotAt()
	t.Logf("other caller's slot in %v", time.Until(other))

	// The archived task is run again by hand before that slot.
	require.NoError(t, insp.RunTask(queue, info.ID))
	// It runs after the other caller's slot, or is archived again (its
	// deadline is near): either way not at that slot.
	require.Eventually(t, func() bool {
		ti := taskInfo(t, insp, queue, info.ID)
		return ti.State == asynq.TaskStateCompleted || (ti.State == asynq.TaskStateArchived && ti.Retried == 0 && time.Now().After(other))
	}, 30*time.Second, 50*time.Millisecond)
	mu.Lock()
	defer mu.Unlock()
	require.LessOrEqual(t, len(starts), 1)
	if len(starts) == 0 {
		return
	}
	gap := starts[0].Sub(other)
	t.Logf("re-run task started %v after the other caller's slot", gap)
	// The limit is 2/s with no burst: the re-run task must start at least
	// one interval away from the other caller's slot.
	require.False(t, gap > -limit.Interval() && gap < limit.Interval(),
		"re-run task started %v from the other caller's slot: two starts within one interval of a burst-0 limit", gap)
}

// TestBookedSameIDTwoQueues: asynq task ids are unique per queue only.
// Two tasks with the same TaskID in two queues, of one type (one limiter
// key), were one member of the booking index: the second found the first's
// booking and ran at it, while the first, back at its slot, found the same
// booking in its server's cache and ran at it too (found by review: 0.4 ms
// apart on a 2/s burst-0 limit). The member now names the queue.
func TestBookedSameIDTwoQueues(t *testing.T) {
	srvRedis := redistest.Shared(t)
	srvRedis.RequireReal(t)
	e := newEnv(t)
	q1, q2 := "q1"+e.prefix, "q2"+e.prefix
	limit := throttle.PerSecond(2, 0) // I = 500ms, no burst
	l := e.limiter(t, limit, reserve.WithMaxWait(100*time.Millisecond))
	fill(t, context.Background(), l, "api:call", 3) // next slot ~1.5 s away
	var (
		mu     sync.Mutex
		starts = map[string]time.Time{}
	)
	h := func(ctx context.Context, _ *asynq.Task) error {
		id, _ := asynq.GetTaskID(ctx)
		q, _ := asynq.GetQueueName(ctx)
		mu.Lock()
		starts[q+"/"+id] = time.Now()
		mu.Unlock()
		return nil
	}
	for _, q := range []string{q1, q2} {
		mw := bookedMiddleware(t, e, l)
		server(t, srvRedis.Client(t), q, 2, mw, h)
	}
	client := asynq.NewClientFromRedisClient(srvRedis.Client(t))
	insp := asynq.NewInspectorFromRedisClient(srvRedis.Client(t))
	enqueue := func(q, id string) {
		_, err := client.Enqueue(asynq.NewTask("api:call", nil), asynq.Queue(q), asynq.TaskID(id), asynq.Retention(time.Hour))
		require.NoError(t, err)
	}
	enqueue(q1, "dup") // booked ~1.5 s out, sent back
	waitState(t, insp, q1, "dup", asynq.TaskStateRetry, 10*time.Second)
	enqueue(q1, "filler") // its reply lists dup:0 as due: server 1 keeps it
	waitState(t, insp, q1, "filler", asynq.TaskStateRetry, 10*time.Second)
	enqueue(q2, "dup") // server 2: finds dup:0 in the index
	for _, k := range [][2]string{{q1, "dup"}, {q1, "filler"}, {q2, "dup"}} {
		waitState(t, insp, k[0], k[1], asynq.TaskStateCompleted, 30*time.Second)
	}
	mu.Lock()
	defer mu.Unlock()
	a, b := starts[q1+"/dup"], starts[q2+"/dup"]
	gap := b.Sub(a)
	t.Logf("q1/dup started %v after q2/dup... (b-a = %v); filler at %v after q1/dup", a.Sub(b), gap, starts[q1+"/filler"].Sub(a))
	require.False(t, gap > -limit.Interval() && gap < limit.Interval(),
		"two tasks started %v apart on a 2/s burst-0 limit: one booking used twice", gap)
}

// TestBookedNearDeadlineRuns: with WithInspector, a task whose slot lies
// about 3 s away and its Deadline 4.5 s away is booked and sent back, and
// runs at its slot, before the deadline. It used to be booked, judged by
// the rule for a task sent back to find room (due back at least the check
// interval plus a second before the deadline: that rule applied to the
// slot, not to when the task is due back), archived, and its booking
// given back, leaving an index entry that a re-run task could use.
func TestBookedNearDeadlineRuns(t *testing.T) {
	srvRedis, e, queue := queueEnv(t)
	l := e.limiter(t, throttle.PerSecond(2, 0), reserve.WithMaxWait(100*time.Millisecond))
	insp := asynq.NewInspectorFromRedisClient(srvRedis.Client(t))
	mw := bookedMiddleware(t, e, l, asynqadapter.WithInspector(insp))
	var (
		mu     sync.Mutex
		starts []time.Time
	)
	server(t, srvRedis.Client(t), queue, 2, mw, func(ctx context.Context, _ *asynq.Task) error {
		mu.Lock()
		starts = append(starts, time.Now())
		mu.Unlock()
		return nil
	})
	client := asynq.NewClientFromRedisClient(srvRedis.Client(t))
	t.Cleanup(func() { _ = client.Close() })
	fill(t, context.Background(), l, "api:call", 6) // next slot ~3 s away
	// asynq keeps a Deadline in whole seconds: 5 s, at least 4 s away.
	dl := time.Now().Add(5 * time.Second)
	info, err := client.Enqueue(asynq.NewTask("api:call", nil), asynq.Queue(queue), asynq.Retention(time.Hour), asynq.Deadline(dl))
	require.NoError(t, err)
	ti := waitState(t, insp, queue, info.ID, asynq.TaskStateRetry, 10*time.Second)
	require.Contains(t, ti.LastErr, "slot booked in")
	ti = waitState(t, insp, queue, info.ID, asynq.TaskStateCompleted, 30*time.Second)
	require.Zero(t, ti.Retried)
	mu.Lock()
	defer mu.Unlock()
	require.Len(t, starts, 1)
	require.True(t, starts[0].Before(ti.Deadline), "ran at %v, before its deadline %v", starts[0], ti.Deadline)
}

// TestBookedIDReusedAfterCompletion: task X, booked ahead by one process,
// takes the booking that process kept and runs; asynq deletes it on
// completion (no Retention), while its index entry stays until that
// process's next call for the key. A new task enqueued at once under X's
// id (asynq.TaskID), taken up by another process, found X's entry and ran
// at X's slot too: two starts on one slot of a 1/s burst-0 limit (found by
// review: 7 to 24 ms apart). The member now holds a hash of the task's
// type and payload.
func TestBookedIDReusedAfterCompletion(t *testing.T) {
	srvRedis := redistest.Shared(t)
	srvRedis.RequireReal(t)
	e := newEnv(t)
	qa, qb := "qa"+e.prefix, "qb"+e.prefix
	limit := throttle.PerSecond(1, 0)
	l := e.limiter(t, limit, reserve.WithMaxWait(100*time.Millisecond))
	mw1, mw2 := bookedMiddleware(t, e, l), bookedMiddleware(t, e, l) // two processes' state, in one asynq server
	var (
		mu     sync.Mutex // guards seen and starts
		seen   = map[string]bool{}
		starts = map[string]time.Time{}
	)
	xStarted := make(chan struct{})
	route := func(h asynq.Handler) asynq.Handler {
		a, b := mw1(h), mw2(h)
		return asynq.HandlerFunc(func(ctx context.Context, t *asynq.Task) error {
			p := string(t.Payload())
			mu.Lock()
			first := !seen[p]
			seen[p] = true
			mu.Unlock()
			if p == "X" || (p == "F" && first) { // X, and F's first attempt: process 1
				return a.ProcessTask(ctx, t)
			}
			return b.ProcessTask(ctx, t)
		})
	}
	server(t, srvRedis.Client(t), qa, 4, route, func(ctx context.Context, tk *asynq.Task) error {
		mu.Lock()
		starts[string(tk.Payload())] = time.Now()
		mu.Unlock()
		if string(tk.Payload()) == "X" {
			close(xStarted)
		}
		return nil
	}, func(c *asynq.Config) { c.Queues = map[string]int{qa: 1, qb: 1} })
	client := asynq.NewClientFromRedisClient(srvRedis.Client(t))
	t.Cleanup(func() { _ = client.Close() })
	insp := asynq.NewInspectorFromRedisClient(srvRedis.Client(t))
	fill(t, context.Background(), l, "api:call", 3) // next slot ~3 s away
	_, err := client.Enqueue(asynq.NewTask("api:call", []byte("X")), asynq.Queue(qa), asynq.TaskID("dup"))
	require.NoError(t, err)
	waitState(t, insp, qa, "dup", asynq.TaskStateRetry, 10*time.Second)
	require.NoError(t, insp.PauseQueue(qa)) // X cannot come back before F's reply
	time.Sleep(1300 * time.Millisecond)     // so that F's reply lists X (within 2 s)
	_, err = client.Enqueue(asynq.NewTask("api:call", []byte("F")), asynq.Queue(qb), asynq.TaskID("filler"), asynq.Retention(time.Hour))
	require.NoError(t, err)
	waitState(t, insp, qb, "filler", asynq.TaskStateRetry, 10*time.Second)
	require.NoError(t, insp.UnpauseQueue(qa))
	select {
	case <-xStarted:
	case <-time.After(20 * time.Second):
		t.Fatal("X did not start")
	}
	for { // X done and deleted: its id reused at once
		_, err = client.Enqueue(asynq.NewTask("api:call", []byte("Y")), asynq.Queue(qa), asynq.TaskID("dup"), asynq.Retention(time.Hour))
		if !errors.Is(err, asynq.ErrTaskIDConflict) {
			break
		}
		time.Sleep(5 * time.Millisecond)
	}
	require.NoError(t, err)
	waitState(t, insp, qa, "dup", asynq.TaskStateCompleted, 30*time.Second)
	waitState(t, insp, qb, "filler", asynq.TaskStateCompleted, 30*time.Second)
	mu.Lock()
	defer mu.Unlock()
	gap := starts["Y"].Sub(starts["X"])
	t.Logf("Y started %v after X; F %v after X", gap, starts["F"].Sub(starts["X"]))
	require.False(t, gap > -limit.Interval() && gap < limit.Interval(),
		"two tasks started %v apart on a 1/s burst-0 limit: X's booking used again by a task reusing its id", gap)
}

// TestBookedRecalledBeyondDeadline: a booked task (Timeout 1 min, its slot
// about 10 s away) is deleted, and a task with the same id, type and
// payload is enqueued with a Timeout of 3 s. It finds the deleted task's
// booking, which its deadline cannot reach: it used to sleep towards it
// until asynq cancelled it, a retry used up because of the limit (found by
// review). It books again instead, and is refused like any task whose
// slot is too far: no retry used.
func TestBookedRecalledBeyondDeadline(t *testing.T) {
	srvRedis, e, queue := queueEnv(t)
	l := e.limiter(t, throttle.PerSecond(1, 0), reserve.WithMaxWait(100*time.Millisecond))
	mw := bookedMiddleware(t, e, l)
	server(t, srvRedis.Client(t), queue, 2, mw, func(context.Context, *asynq.Task) error { return nil })
	client := asynq.NewClientFromRedisClient(srvRedis.Client(t))
	t.Cleanup(func() { _ = client.Close() })
	insp := asynq.NewInspectorFromRedisClient(srvRedis.Client(t))
	fill(t, context.Background(), l, "api:call", 11) // next slot ~10 s away
	_, err := client.Enqueue(asynq.NewTask("api:call", nil), asynq.Queue(queue), asynq.TaskID("dup"), asynq.Timeout(time.Minute))
	require.NoError(t, err)
	ti := waitState(t, insp, queue, "dup", asynq.TaskStateRetry, 10*time.Second)
	t.Logf("booked: %q", ti.LastErr)
	require.NoError(t, insp.DeleteTask(queue, "dup"))
	_, err = client.Enqueue(asynq.NewTask("api:call", nil), asynq.Queue(queue), asynq.TaskID("dup"),
		asynq.Timeout(3*time.Second), asynq.MaxRetry(5), asynq.Retention(time.Hour))
	require.NoError(t, err)
	// Judged once the new task has been refused (sent back) or has failed.
	end := time.Now().Add(20 * time.Second)
	for {
		ti = taskInfo(t, insp, queue, "dup")
		if ti.Retried > 0 || ti.State == asynq.TaskStateRetry || ti.State == asynq.TaskStateCompleted {
			break
		}
		require.True(t, time.Now().Before(end), "the new task still %v after 20 s", ti.State)
		time.Sleep(50 * time.Millisecond)
	}
	t.Logf("new task: state %v, retried %d, last error %q", ti.State, ti.Retried, ti.LastErr)
	require.Zero(t, ti.Retried, "a retry used up because of the limit")
}

// TestBookedMemberUnambiguous: queue "Q" with task id "b:dup" and queue
// "Q:b" with id "dup" were one member of the booking index ("Q:b:dup:0"):
// the second task found the first's booking and ran at it (found by
// review). Each now has an entry of its own.
func TestBookedMemberUnambiguous(t *testing.T) {
	srvRedis := redistest.Shared(t)
	srvRedis.RequireReal(t)
	e := newEnv(t)
	q1, q2 := "Q"+e.prefix, "Q"+e.prefix+":b"
	l := e.limiter(t, throttle.PerSecond(1, 0), reserve.WithMaxWait(100*time.Millisecond))
	mw := bookedMiddleware(t, e, l)
	server(t, srvRedis.Client(t), q1, 2, mw, func(context.Context, *asynq.Task) error { return nil },
		func(c *asynq.Config) { c.Queues = map[string]int{q1: 1, q2: 1} })
	client := asynq.NewClientFromRedisClient(srvRedis.Client(t))
	t.Cleanup(func() { _ = client.Close() })
	insp := asynq.NewInspectorFromRedisClient(srvRedis.Client(t))
	fill(t, context.Background(), l, "api:call", 6) // next slot ~5 s away: both are booked ahead
	_, err := client.Enqueue(asynq.NewTask("api:call", nil), asynq.Queue(q1), asynq.TaskID("b:dup"))
	require.NoError(t, err)
	waitState(t, insp, q1, "b:dup", asynq.TaskStateRetry, 10*time.Second)
	_, err = client.Enqueue(asynq.NewTask("api:call", nil), asynq.Queue(q2), asynq.TaskID("dup"))
	require.NoError(t, err)
	end := time.Now().Add(10 * time.Second)
	var ti *asynq.TaskInfo
	for {
		ti = taskInfo(t, insp, q2, "dup")
		if ti.State != asynq.TaskStatePending {
			break
		}
		require.True(t, time.Now().Before(end), "the second task never taken up")
		time.Sleep(20 * time.Millisecond)
	}
	// Booked and sent back, not run at the other's booking.
	ti = waitState(t, insp, q2, "dup", asynq.TaskStateRetry, 10*time.Second)
	require.Contains(t, ti.LastErr, "slot booked in")
	n, err := redistest.Shared(t).Client(t).ZCard(context.Background(), e.prefix+"tasks:{api:call}:asynq").Result()
	require.NoError(t, err)
	require.Equal(t, int64(2), n, "one index entry per task")
}
