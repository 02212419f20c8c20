package reserve_test

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/slotbook/slotbook/internal/testhook"
	"github.com/slotbook/slotbook/reserve"
	"github.com/slotbook/slotbook/throttle"
)

// Cancel's refund runs on its context's clock (the module's test clock, if
// that context carries it), and so does its decision to skip the call. The
// tests below judge on Booking().At and on the slot the next booking gets.

// untilSlotPassed waits until r's slot has come on the local clock.
func untilSlotPassed(r *reserve.Reservation) {
	for r.Delay() > 0 {
		time.Sleep(r.Delay() + time.Millisecond)
	}
}

// TestFrozenCancelAfterLocalSlotGivesBack: booked and cancelled on
// one frozen test clock, a slot still to come on that clock is given back
// even though its SlotAt has passed locally, however many callers cancel,
// in exactly one Redis call.
func TestFrozenCancelAfterLocalSlotGivesBack(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	l := e.limiter(t, throttle.PerSecond(20, 0)) // 50 ms apart
	x := time.Now().UnixMicro()
	ctx := testhook.WithNow(context.Background(), x)
	require.NoError(t, e.eng.Load(ctx))
	first, err := l.Reserve(ctx, "k")
	require.NoError(t, err)
	require.Equal(t, time.UnixMicro(x), first.Booking().At)
	r, err := l.Reserve(ctx, "k")
	require.NoError(t, err)
	require.Equal(t, first.Booking().At.Add(50*time.Millisecond), r.Booking().At)
	untilSlotPassed(r)

	before := e.calls.Load()
	var wg sync.WaitGroup
	errs := make([]error, 8)
	for i := range errs {
		wg.Go(func() { errs[i] = r.Cancel(ctx) })
	}
	wg.Wait()
	for _, err := range errs {
		require.NoError(t, err)
	}
	require.Equal(t, before+1, e.calls.Load(), "one refund call for eight Cancels")
	require.NoError(t, r.Cancel(ctx))
	require.Equal(t, before+1, e.calls.Load(), "a repeated Cancel makes no call")

	next, err := l.Reserve(ctx, "k")
	require.NoError(t, err)
	require.Equal(t, r.Booking().At, next.Booking().At, "the next booking takes the given-back slot")
}

// TestFrozenWaitEndingGivesBack: Wait with a context (carrying the
// test clock) that ends first gives the slot back on that clock.
func TestFrozenWaitEndingGivesBack(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	l := e.limiter(t, throttle.PerMinute(1, 0)) // a minute apart
	x := time.Now().UnixMicro()
	base := testhook.WithNow(context.Background(), x)
	fill(t, l, base)
	r, err := l.Reserve(base, "k")
	require.NoError(t, err)
	require.Equal(t, time.UnixMicro(x).Add(time.Minute), r.Booking().At)
	ctx, cancel := context.WithCancel(base)
	cancel()
	require.ErrorIs(t, r.Wait(ctx), context.Canceled)
	next, err := l.Reserve(base, "k")
	require.NoError(t, err)
	require.Equal(t, r.Booking().At, next.Booking().At, "Wait gave the slot back")
}

// TestFrozenAcquireEndingGivesBack: Acquire whose context (carrying
// the test clock) ends during the sleep gives its slot back.
func TestFrozenAcquireEndingGivesBack(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	l := e.limiter(t, throttle.PerMinute(1, 0))
	x := time.Now().UnixMicro()
	base := testhook.WithNow(context.Background(), x)
	fill(t, l, base)
	ctx, cancel := context.WithCancel(base)
	time.AfterFunc(30*time.Millisecond, cancel)
	require.ErrorIs(t, l.Acquire(ctx, "k"), context.Canceled)
	next, err := l.Reserve(base, "k")
	require.NoError(t, err)
	require.Equal(t, time.UnixMicro(x).Add(time.Minute), next.Booking().At, "Acquire gave its slot back")
}

// TestFrozenInFlightCancelGivesBack: a caller (coalescing on, the
// default) whose context ends while its call is in flight gets the
// context's error, and its slot, still to come on its test clock, is given
// back even when the slot has passed locally by the time the reply is in.
func TestFrozenInFlightCancelGivesBack(t *testing.T) {
	t.Parallel()
	eng, p, _ := proxiedEngine(t, 0)
	l, err := reserve.New(eng, "api", throttle.PerSecond(100, 0)) // 10 ms apart
	require.NoError(t, err)
	x := time.Now().UnixMicro()
	base := testhook.WithNow(context.Background(), x)
	fill(t, l, base)
	p.SetReplyDelay(150 * time.Millisecond) // the reply arrives after the slot has passed locally
	ctx, cancel := context.WithCancel(base)
	time.AfterFunc(30*time.Millisecond, cancel)
	_, err = l.Reserve(ctx, "k")
	require.ErrorIs(t, err, context.Canceled)
	p.SetReplyDelay(0)
	next, err := l.Reserve(base, "k")
	require.NoError(t, err)
	require.Equal(t, time.UnixMicro(x).Add(10*time.Millisecond), next.Booking().At, "the in-flight caller's slot came back")
}

// TestFrozenCancelAfterLostReply: a refund whose reply is lost
// (errors.Is ErrReplyLost) took effect; retried on the same test clock
// after another booking has taken the room back, it gives nothing.
func TestFrozenCancelAfterLostReply(t *testing.T) {
	t.Parallel()
	eng, p, _ := proxiedEngine(t, 0, throttle.WithTimeout(100*time.Millisecond))
	l, err := reserve.New(eng, "api", throttle.PerSecond(20, 0)) // 50 ms apart
	require.NoError(t, err)
	x := time.Now().UnixMicro()
	ctx := testhook.WithNow(context.Background(), x)
	fill(t, l, ctx)
	r, err := l.Reserve(ctx, "k")
	require.NoError(t, err)
	untilSlotPassed(r)
	p.SetReplyDelay(400 * time.Millisecond)
	err = r.Cancel(ctx)
	require.ErrorIs(t, err, throttle.ErrReplyLost)
	time.Sleep(500 * time.Millisecond) // the delayed reply drains
	p.SetReplyDelay(0)
	taken, err := l.Reserve(ctx, "k")
	require.NoError(t, err)
	require.Equal(t, r.Booking().At, taken.Booking().At, "the lost refund took effect")
	require.NoError(t, r.Cancel(ctx))
	next, err := l.Reserve(ctx, "k")
	require.NoError(t, err)
	require.Equal(t, taken.Booking().At.Add(50*time.Millisecond), next.Booking().At, "the retry gave back nothing of the new booking")
}

// Booked on a test clock ahead of Redis's, cancelled with a plain context
// after SlotAt has passed locally: Redis's real clock has not reached the
// booking's slot, so Cancel asks Redis (the refund runs on Cancel's
// context's clock) and the room comes back; a refund sent after it by
// hand finds nothing more to give. (Before the fix, Cancel skipped the
// call and this refund gave back 50ms.)
func TestCancelPlainOfFutureTestClockBooking(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	l := e.limiter(t, throttle.PerSecond(20, 0))
	x := time.Now().Add(time.Hour).UnixMicro()
	hook := testhook.WithNow(context.Background(), x)
	fill(t, l, hook)
	r, err := l.Reserve(hook, "k")
	require.NoError(t, err)
	untilSlotPassed(r)
	require.NoError(t, r.Cancel(context.Background()))
	given, err := e.eng.RefundAll(context.Background(), []string{"api:{k}"}, l.Limits(), r.Booking())
	require.NoError(t, err)
	require.Zero(t, given[0], "Cancel gave the room back itself: a second refund finds nothing")
}
