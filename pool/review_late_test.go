package pool_test

// A defect found in the review of 01355c7, fixed by BatchRequest.HoldLate:
// a booking that reserve refused on arrival (the reply's latency ate the
// room before its deadline) was given back by ReserveBatch on a goroutine
// of its own, while the pool gave back a later booking of the same batch
// (its job cancelled, or the pool closed, while the batch was in flight)
// after the reply: the earlier refund could reach Redis first, and then
// gave nothing back. Nothing ran early; the room was lost until the slot
// passed. The pool now holds such a booking and owes it.

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/slotbook/slotbook/deadline"
	"github.com/slotbook/slotbook/pool"
)

// TestReviewRefundLateInFlight: 40 ms each way between the pool and Redis.
// One batch books two jobs after the head: the first with a deadline just
// after its slot, which the reply's latency eats (reserve books it, then
// gives it back once the reply is in), the second with a context cancelled
// (or the pool closed) while the batch is in flight, which the pool gives
// back after the reply. Neither runs, nothing was booked after them: both
// rooms must come back, whatever the order the two refunds are sent in.
func TestReviewRefundLateInFlight(t *testing.T) {
	t.Parallel()
	e := newReviewEnv(t, 40*time.Millisecond)
	for i := range 12 {
		closeIt := i%2 == 1
		if !t.Run(fmt.Sprintf("%d/close=%v", i, closeIt), func(t *testing.T) {
			name := fmt.Sprintf("late%d", i)
			p, err := pool.New(e.limiter(t, name), pool.WithWorkers(8))
			require.NoError(t, err)
			defer func() { _ = p.Close(context.Background()) }()
			heads, at := reviewHeads(t, p, []string{"k"})
			I := reviewInterval(reviewLimits[0])
			dl, stop := context.WithDeadline(context.Background(), time.UnixMicro(at[0]+I).Add(30*time.Millisecond))
			defer stop()
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			j1, err := p.Submit(dl, "k", func(context.Context) error { return nil })
			require.NoError(t, err)
			j2, err := p.Submit(ctx, "k", func(context.Context) error { return nil })
			require.NoError(t, err)
			// The batch is sent at once; its reply comes 80 ms later.
			time.Sleep(30 * time.Millisecond)
			if closeIt {
				require.NoError(t, p.Close(context.Background()))
			} else {
				cancel()
			}
			require.NoError(t, p.Wait(context.Background()))
			require.NoError(t, p.Close(context.Background()))
			// Before the fix the late refund ran on a goroutine of its
			// own: let any such refund land before looking.
			time.Sleep(300 * time.Millisecond)
			for _, j := range []*pool.Job{j1, j2} {
				t.Logf("%v", j.Err())
			}
			e.check(t, name, "k", []*pool.Job{heads[0], j1, j2}, nil,
				context.Canceled, pool.ErrClosed, deadline.ErrWouldExceedDeadline)
		}) {
			return
		}
	}
}
