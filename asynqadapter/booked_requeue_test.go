package asynqadapter_test

import (
	"context"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/stretchr/testify/require"

	"github.com/slotbook/slotbook/asynqadapter"
	"github.com/slotbook/slotbook/internal/redistest"
	"github.com/slotbook/slotbook/reserve"
	"github.com/slotbook/slotbook/throttle"
)

// TestBookedRequeuedAfterStart: booked retries, two processes sharing a
// limit of 1/s, burst 0. Task X, refused by P2, has its slot S booked and
// recorded in the index. Another task of the key, W, booked by P2 shortly
// before S, is answered with the index's bookings due soon, X's among
// them. X comes back to P2 before S, runs at S, and is still running when
// P2 shuts down: asynq puts it back on its queue as the same attempt (its
// retry count unchanged). P1 takes it up: X's entry must no longer be in
// the index, or P1 recalls it and runs X again on S, one interval early.
// Before the fix P2 kept the bookings W's reply listed and ran X at its
// kept booking without a call, leaving the entry in the index until P2's
// next booking call for the key, which a process shutting down never
// makes: X ran twice on S (its second start some 150 ms after S). Now X
// recalls its booking, which takes the entry out.
func TestBookedRequeuedAfterStart(t *testing.T) {
	srvRedis, e, queue := queueEnv(t)
	queueW := queue + "w"
	const iv = time.Second
	limit := throttle.PerSecond(1, 0)
	_, eng1 := revASProc(t, e.prefix)
	_, eng2 := revASProc(t, e.prefix)
	l1, err := reserve.New(eng1, "tasks", limit, reserve.WithMaxWait(100*time.Millisecond))
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
	look := redistest.Shared(t).Client(t)
	idx := e.prefix + "tasks:{api:call}:asynq"

	fill(t, context.Background(), l2, "api:call", 5) // the next slot some 5 s away
	p2 := revASServer(t, srvRedis.Client(t), []string{queue, queueW}, mw2, handler)
	_, err = client.Enqueue(asynq.NewTask("api:call", []byte("x")), asynq.Queue(queue), asynq.TaskID("x"), asynq.Retention(time.Hour))
	require.NoError(t, err)
	waitState(t, insp, queue, "x", asynq.TaskStateRetry, 10*time.Second)
	require.NoError(t, insp.PauseQueue(queue)) // X waits until W's booking is in
	entries, err := look.ZRangeWithScores(context.Background(), idx, 0, -1).Result()
	require.NoError(t, err)
	require.Len(t, entries, 1)
	slot := time.UnixMicro(int64(entries[0].Score)) // Redis's clock: this machine's

	// W's booking call, within two seconds of S (before the fix, its
	// reply listed X's booking, and P2 kept it).
	time.Sleep(time.Until(slot.Add(-1500 * time.Millisecond)))
	_, err = client.Enqueue(asynq.NewTask("api:call", []byte("w")), asynq.Queue(queueW), asynq.TaskID("w"), asynq.Retention(time.Hour))
	require.NoError(t, err)
	waitState(t, insp, queueW, "w", asynq.TaskStateRetry, 5*time.Second)
	n, err := look.ZCard(context.Background(), idx).Result()
	require.NoError(t, err)
	require.Equal(t, int64(2), n, "X's and W's bookings in the index")

	require.NoError(t, insp.UnpauseQueue(queue))
	select {
	case <-xStarted:
	case <-time.After(10 * time.Second):
		t.Fatal("X did not start on P2")
	}
	if late := time.Since(slot); late > iv/2 {
		t.Skipf("X started %v after its slot on P2: too late for the scene", late)
	}
	p2.Shutdown() // X is put back on its queue, its retry count unchanged
	revASServer(t, srvRedis.Client(t), []string{queue, queueW}, mw1, func(ctx context.Context, _ *asynq.Task) error {
		starts.add(ctx)
		return nil
	})
	waitState(t, insp, queue, "x", asynq.TaskStateCompleted, 15*time.Second)
	waitState(t, insp, queueW, "w", asynq.TaskStateCompleted, 15*time.Second)

	all, by := starts.get()
	for id, s := range by {
		for _, at := range s {
			t.Logf("task %s started %v after X's slot", id, at.Sub(slot).Round(time.Millisecond))
		}
	}
	require.Len(t, by["x"], 2, "X ran on P2, then again once put back on its queue")
	// Run again, X booked a slot of its own: S is taken (by X's first run)
	// and so is every slot of the key up to the one it got, which lies at
	// least an interval after S (with 150 ms for the clocks: S is Redis's,
	// the starts this process's, on one machine). Before the fix it ran
	// again at once, some 150 ms after S.
	require.GreaterOrEqual(t, by["x"][1].Sub(slot), iv-150*time.Millisecond, "X's second run on a slot of its own")
	// The starts through a textbook GCRA: W, whose slot is S+1s, may start
	// late (asynq hands it over up to a check interval late; the
	// middleware runs a task up to an interval after its slot), so half an
	// interval of slack, which the second run on S, 150 ms after it, still
	// breaks.
	require.Empty(t, revASReplay(all, iv, 0, iv/2), "the handler starts, replayed through GCRA 1/s burst 0")
}
