package throttle_test

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/slotbook/slotbook/internal/redistest"
	"github.com/slotbook/slotbook/throttle"
)

// refundRecorder is an Observer that keeps the refunds it is told of.
type refundRecorder struct {
	mu    sync.Mutex
	given []time.Duration
}

func (r *refundRecorder) ObserveDecision(string, throttle.Outcome, time.Duration) {}
func (r *refundRecorder) ObserveCall(string, time.Duration, error)                {}
func (r *refundRecorder) ObserveBreaker(bool)                                     {}
func (r *refundRecorder) ObserveRefund(_ string, given time.Duration) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.given = append(r.given, given)
}

func (r *refundRecorder) take() []time.Duration {
	r.mu.Lock()
	defer r.mu.Unlock()
	out := r.given
	r.given = nil
	return out
}

// TestRefundReportedOnceAfterLostReply: a refund that gave time back but
// whose reply was lost (unreadable here) is retried, as documented: the
// retry gives nothing (its caller hears 0, the tombstone), and the
// Observer is told once what the first attempt gave back, as a refund
// that gave time back; a further call is a no-op. A refund whose reply
// came is reported once too, its retries as no-ops. The same for a run
// given back in one refund (RefundUnusedRun).
func TestRefundReportedOnceAfterLostReply(t *testing.T) {
	t.Parallel()
	g := garble()
	rec := &refundRecorder{}
	rdb := redistest.Shared(t).Client(t)
	eng, err := throttle.New(rdb, throttle.WithPrefix(redistest.Prefix(t)), throttle.WithObserver(rec), throttle.WithTimeout(5*time.Second))
	require.NoError(t, err)
	ctx := context.Background()
	require.NoError(t, eng.Load(ctx))
	rdb.AddHook(g)
	per := throttle.PerMinute(1, 0)
	req := throttle.Request{N: 1, MaxWait: throttle.Forever}

	// A single booking, its refund's reply lost.
	_, err = eng.Book(ctx, "lost", per, req)
	require.NoError(t, err)
	b, err := eng.Book(ctx, "lost", per, req)
	require.NoError(t, err)
	require.Greater(t, b.Wait, 50*time.Second)
	g.on.Store(true)
	_, err = eng.Refund(ctx, "lost", per, b)
	require.ErrorIs(t, err, throttle.ErrReplyLost)
	g.on.Store(false)
	require.Empty(t, rec.take(), "a lost reply reports no refund")
	given, err := eng.Refund(ctx, "lost", per, b)
	require.NoError(t, err)
	require.Zero(t, given, "the retry itself gives nothing")
	got := rec.take()
	require.Len(t, got, 1)
	require.InDelta(t, b.Wait.Seconds(), got[0].Seconds(), 5, "the retry reports what the first attempt gave back")
	_, err = eng.Refund(ctx, "lost", per, b)
	require.NoError(t, err)
	require.Equal(t, []time.Duration{0}, rec.take(), "a further call: a no-op")

	// A single booking, its refund's reply read: reported once.
	_, err = eng.Book(ctx, "read", per, req)
	require.NoError(t, err)
	b, err = eng.Book(ctx, "read", per, req)
	require.NoError(t, err)
	given, err = eng.Refund(ctx, "read", per, b)
	require.NoError(t, err)
	require.Positive(t, given)
	require.Equal(t, []time.Duration{given}, rec.take())
	given, err = eng.Refund(ctx, "read", per, b)
	require.NoError(t, err)
	require.Zero(t, given)
	require.Equal(t, []time.Duration{0}, rec.take(), "a retry after a read reply: a no-op")

	// A run, given back in one refund whose reply is lost.
	_, err = eng.Book(ctx, "run", per, req)
	require.NoError(t, err)
	run, err := eng.BookBatch(ctx, "run", per, []throttle.Request{req, req, req})
	require.NoError(t, err)
	for _, r := range run {
		require.True(t, r.OK)
	}
	keys, limits := []string{"run"}, []throttle.Limit{per}
	g.on.Store(true)
	_, err = eng.RefundUnusedRun(ctx, keys, limits, run)
	require.ErrorIs(t, err, throttle.ErrReplyLost)
	g.on.Store(false)
	require.Empty(t, rec.take())
	gs, err := eng.RefundUnusedRun(ctx, keys, limits, run)
	require.NoError(t, err)
	require.Equal(t, []time.Duration{0}, gs)
	got = rec.take()
	require.Len(t, got, 1)
	require.InDelta(t, 3*time.Minute.Seconds(), got[0].Seconds(), 5, "three bookings' room, reported once")
	_, err = eng.RefundUnusedRun(ctx, keys, limits, run)
	require.NoError(t, err)
	require.Equal(t, []time.Duration{0}, rec.take())
}
