package pool_test

// A defect found in the review of 4fcab9f, fixed by Job.Reservation
// handing out a view: a job cancelled under a later booking still wanted
// is done at once and its booking owed to the pool; Job.Reservation
// handed out that reservation, and a caller's Cancel on it ran while the
// later booking stood: it gave nothing, left the tombstone and marked the
// reservation cancelled, so the pool's give-back later gave nothing too.

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/slotbook/slotbook/pool"
)

// TestReviewOwedUserCancelsReservation: a job cancelled under a later one
// still wanted is done at once, and Job.Reservation hands its caller a
// reservation the pool still owes. A caller that cancels it (as one may
// with any reservation) must not cost its room: once the later job is
// cancelled too, the room of both must come back.
func TestReviewOwedUserCancelsReservation(t *testing.T) {
	t.Parallel()
	e := newReviewEnv(t, 0)
	name := "u"
	lim := e.limiter(t, name)
	p, err := pool.New(lim, pool.WithWorkers(4))
	require.NoError(t, err)
	defer func() { _ = p.Close(context.Background()) }()
	heads, at := reviewHeads(t, p, []string{"k"})
	ctxA, cancelA := context.WithCancel(context.Background())
	defer cancelA()
	ctxB, cancelB := context.WithCancel(context.Background())
	defer cancelB()
	a, err := p.Submit(ctxA, "k", func(context.Context) error { return nil })
	require.NoError(t, err)
	b, err := p.Submit(ctxB, "k", func(context.Context) error { return nil })
	require.NoError(t, err)
	require.Eventually(t, func() bool { return e.booked(name, "k", at[0]) == 2 }, 3*time.Second, time.Millisecond)
	cancelA()
	require.ErrorIs(t, a.Wait(context.Background()), context.Canceled)
	// The caller tidies up after its cancelled job: the view's Cancel
	// does nothing, and the booking stays the pool's to give back.
	require.NoError(t, a.Reservation().Cancel(context.Background()))
	cancelB()
	require.NoError(t, p.Wait(context.Background()))
	require.NoError(t, p.Close(context.Background()))
	e.check(t, name, "k", []*pool.Job{heads[0], a, b}, nil, context.Canceled)
}
