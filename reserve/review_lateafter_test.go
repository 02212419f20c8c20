package reserve_test

// Review of 9c9370b (the late bookings of a batch that ReserveBatch does
// not hold go back on a goroutine; a Cancel of any Reservation of the
// batch waits, bounded by its ctx, until they are in) through the public
// API. Room is judged by the slot of the next booking on the Redis clock
// (Booking().At), one interval (500 ms) after the bookings that stand.

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/slotbook/slotbook/deadline"
	"github.com/slotbook/slotbook/internal/redistest"
	"github.com/slotbook/slotbook/reserve"
	"github.com/slotbook/slotbook/throttle"
)

// earlyLateBatch books, for a fresh key of l (every reply held back 40 ms
// by the caller's proxy), a head and then one batch: a request with no
// deadline (booked, the head's slot plus an interval), and one whose
// deadline the reply's delay makes it miss (refused late, not held:
// ReserveBatch gives it back itself, on a goroutine).
func earlyLateBatch(t *testing.T, l *reserve.Limiter, key string) (head, booked, late *reserve.Reservation) {
	t.Helper()
	ctx := context.Background()
	head, err := l.Reserve(ctx, key)
	require.NoError(t, err)
	require.True(t, head.OK())
	interval := l.Limits()[0].Interval()
	dl, cancel := context.WithDeadline(ctx, head.Booking().At.Add(2*interval+20*time.Millisecond))
	t.Cleanup(cancel)
	rs, err := l.ReserveBatch(ctx, key, []reserve.BatchRequest{{N: 1}, {Context: dl, N: 1}})
	require.NoError(t, err)
	require.True(t, rs[0].OK(), "%v", rs[0].Err())
	require.ErrorIs(t, rs[1].Err(), deadline.ErrWouldExceedDeadline)
	require.False(t, rs[1].Booking().OK, "not held")
	return head, rs[0], rs[1]
}

// lateFirstBatch is the other order: the late request first, then one
// with no deadline booked after it.
func lateFirstBatch(t *testing.T, l *reserve.Limiter, key string) (head, late, booked *reserve.Reservation) {
	t.Helper()
	ctx := context.Background()
	head, err := l.Reserve(ctx, key)
	require.NoError(t, err)
	require.True(t, head.OK())
	interval := l.Limits()[0].Interval()
	dl, cancel := context.WithDeadline(ctx, head.Booking().At.Add(interval+20*time.Millisecond))
	t.Cleanup(cancel)
	rs, err := l.ReserveBatch(ctx, key, []reserve.BatchRequest{{Context: dl, N: 1}, {N: 1}})
	require.NoError(t, err)
	require.ErrorIs(t, rs[0].Err(), deadline.ErrWouldExceedDeadline)
	require.True(t, rs[1].OK(), "%v", rs[1].Err())
	return head, rs[0], rs[1]
}

// nextAt books once more on key and returns its slot on the Redis clock.
func nextAt(t *testing.T, l *reserve.Limiter, key string) time.Time {
	t.Helper()
	r, err := l.Reserve(context.Background(), key)
	require.NoError(t, err)
	require.True(t, r.OK(), "%v", r.Err())
	return r.Booking().At
}

// TestReviewLateAfterCancelEndedContext: a Cancel of the batch's booked
// reservation with a context already ended returns at once with an error
// (it gives nothing back, and says so), however the late give-back is
// going; a Cancel after it, with a live context, gives the room back: the
// next booking takes the booked one's slot (the late one's room came back
// too, ReserveBatch's own give-back).
//
// In the rounds where the give-back is still out, its reply is held back
// laGiveBackDelay (set by the hook as the batch's reply comes in), so a
// Cancel that waited for it would take about that long: "at once" is
// judged against half of it, which leaves a busy machine room for its
// stalls (the bound was 30 ms against a 40 ms reply delay, which a stall
// of 30 ms would break).
func TestReviewLateAfterCancelEndedContext(t *testing.T) {
	t.Parallel()
	const laGiveBackDelay = 200 * time.Millisecond
	eng, p, _ := latencyEngine(t)
	hook := &delayAfterBatch{p: p, delay: laGiveBackDelay}
	eng.Client().(*redis.Client).AddHook(hook)
	l, err := reserve.New(eng, "api", throttle.PerSecond(2, 0))
	require.NoError(t, err)
	for i := range 4 {
		key := fmt.Sprintf("ended%d", i)
		p.SetReplyDelay(40 * time.Millisecond)
		hook.armed.Store(i%2 == 0)
		_, booked, _ := earlyLateBatch(t, l, key)
		if i%2 == 0 {
			require.False(t, hook.armed.Load(), "the batch's call went through the hook")
		} else {
			time.Sleep(100 * time.Millisecond) // the late give-back is in
		}
		ended, cancel := context.WithCancel(context.Background())
		cancel()
		t0 := time.Now()
		err := booked.Cancel(ended)
		took := time.Since(t0)
		p.SetReplyDelay(40 * time.Millisecond)
		require.Error(t, err, "round %d: Cancel on an ended context gave nothing back", i)
		require.Less(t, took, laGiveBackDelay/2, "round %d: Cancel on an ended context waited", i)
		require.NoError(t, booked.Cancel(context.Background()))
		require.Equal(t, booked.Booking().At, nextAt(t, l, key), "round %d: both rooms back", i)
	}
}

// TestReviewLateAfterCancelSlowGiveBack: slots 5 s apart. The late
// give-back's reply is lost (replies held back 1.5 s, past its one-second
// bound), and meanwhile
// the caller cancels the booked reservation, waits on it cut short
// (Wait), or cancels with a short ctx and then again. The refund of the
// late one reached Redis all the same, and the caller's Cancel (once the
// give-back is in) gives the booked one's room back: the next booking
// takes its slot.
func TestReviewLateAfterCancelSlowGiveBack(t *testing.T) {
	t.Parallel()
	eng, p, _ := latencyEngine(t)
	// Slots 5 s apart: the booked one's slot does not come while its
	// Cancel waits (up to a second) for the late give-back.
	l, err := reserve.New(eng, "slow", throttle.Every(5*time.Second, 1, 0))
	require.NoError(t, err)
	// The late give-back goes out on a goroutine as ReserveBatch returns,
	// so the test cannot hold its reply back in time by itself (on a busy
	// machine the goroutine ran first, and its reply came in 40 ms): the
	// hook holds replies back 1.5 s once the batch's call (book.lua, more
	// arguments than book1.lua's) is answered, before ReserveBatch sees it.
	hook := &delayAfterBatch{p: p}
	eng.Client().(*redis.Client).AddHook(hook)
	for _, how := range []string{"cancel", "wait", "short-then-again"} {
		t.Run(how, func(t *testing.T) {
			key := "slow-" + how
			p.SetReplyDelay(40 * time.Millisecond)
			hook.armed.Store(true)
			_, booked, _ := earlyLateBatch(t, l, key)
			require.False(t, hook.armed.Load(), "the batch's call went through the hook")
			time.Sleep(50 * time.Millisecond)
			p.SetReplyDelay(0) // the caller's own refund is answered at once
			switch how {
			case "cancel":
				require.NoError(t, booked.Cancel(context.Background()))
			case "wait":
				ctx, cancel := context.WithTimeout(context.Background(), 10*time.Millisecond)
				defer cancel()
				require.ErrorIs(t, booked.Wait(ctx), context.DeadlineExceeded)
			case "short-then-again":
				ctx, cancel := context.WithTimeout(context.Background(), 20*time.Millisecond)
				defer cancel()
				require.ErrorIs(t, booked.Cancel(ctx), context.DeadlineExceeded, "the late give-back is not in yet")
				require.NoError(t, booked.Cancel(context.Background()))
			}
			require.Equal(t, booked.Booking().At, nextAt(t, l, key), "both rooms back")
		})
	}
}

// TestReviewLateAfterLaterBookingCancelled: one batch, the first request
// late (not held: ReserveBatch gives it back itself), the second booked
// after it. The caller cancels the second, its only booking, at once.
// Then nothing of the batch stands and nothing was booked after it: both
// rooms should come back (BatchRequest: a request made late "is refused
// and its booking given back"; Cancel: reservations cancelled latest
// first all give their room back), so the next booking takes the late
// one's slot, an interval after the head. But the caller's Cancel waits
// for ReserveBatch's own give-back of the late booking, which, sent while
// the later booking still stands on it, gives nothing and leaves its
// tombstone: the late one's room is lost (the next booking comes an
// interval later). The control is the same batch with HoldLate, the
// caller giving both back latest first (TestBatchHoldLate's order): both
// rooms come back.
// Failed (3 of 3) before such a booking went back with the later one's Cancel.
func TestReviewLateAfterLaterBookingCancelled(t *testing.T) {
	t.Parallel()
	eng, p, _ := latencyEngine(t)
	p.SetReplyDelay(40 * time.Millisecond)
	l, err := reserve.New(eng, "api", throttle.PerSecond(2, 0))
	require.NoError(t, err)
	interval := l.Limits()[0].Interval()
	ctx := context.Background()

	// The control: held, both given back latest first.
	chead, err := l.Reserve(ctx, "control")
	require.NoError(t, err)
	dl, cancel := context.WithDeadline(ctx, chead.Booking().At.Add(interval+20*time.Millisecond))
	defer cancel()
	rs, err := l.ReserveBatch(ctx, "control", []reserve.BatchRequest{{Context: dl, N: 1, HoldLate: true}, {N: 1, HoldLate: true}})
	require.NoError(t, err)
	require.True(t, rs[0].Booking().OK && !rs[0].OK(), "held: %v", rs[0].Err())
	require.NoError(t, rs[1].Cancel(ctx))
	require.NoError(t, rs[0].Cancel(ctx))
	require.Equal(t, chead.Booking().At.Add(interval), nextAt(t, l, "control"), "control: both rooms back")

	lost := 0
	const rounds = 3
	for i := range rounds {
		key := fmt.Sprintf("later%d", i)
		head, late, booked := lateFirstBatch(t, l, key)
		require.NoError(t, booked.Cancel(ctx))
		_ = late.Cancel(ctx) // a refusal not held: nothing (the limiter gives it back)
		time.Sleep(100 * time.Millisecond)
		next := nextAt(t, l, key)
		if !next.Equal(head.Booking().At.Add(interval)) {
			lost++
			t.Logf("round %d: next booking %v after the head (the late one's slot is %v after it): room lost",
				i, next.Sub(head.Booking().At), late.Booking().At.Sub(head.Booking().At))
		}
	}
	require.Zero(t, lost, "rounds (of %d) in which the late booking's room was lost", rounds)
}

// TestReviewLateAfterEarlierCancelledFirst: the batch's booked request is
// the earlier, the late one after it. The caller cancels the booked one
// at once (before ReserveBatch's own give-back of the late one is in):
// its Cancel waits for that give-back, so both rooms come back (the next
// booking takes the booked one's slot). Repeated, with Cancel from
// several goroutines at once (one refund: the next two bookings take the
// booked slot and the late one's).
func TestReviewLateAfterEarlierCancelledFirst(t *testing.T) {
	t.Parallel()
	eng, p, _ := latencyEngine(t)
	p.SetReplyDelay(40 * time.Millisecond)
	l, err := reserve.New(eng, "api", throttle.PerSecond(2, 0))
	require.NoError(t, err)
	for i := range 4 {
		key := fmt.Sprintf("first%d", i)
		_, booked, late := earlyLateBatch(t, l, key)
		errs := make(chan error, 4)
		for range 4 {
			go func() { errs <- booked.Cancel(context.Background()) }()
		}
		for range 4 {
			if err := <-errs; err != nil && !errors.Is(err, context.Canceled) {
				require.NoError(t, err)
			}
		}
		require.Equal(t, booked.Booking().At, nextAt(t, l, key), "round %d: the booked one's room", i)
		require.Equal(t, late.Booking().At, nextAt(t, l, key), "round %d: the late one's room", i)
	}
}

// TestReviewLateAfterWaitCutAtOnceLostGiveBack: slots 5 s apart, every
// reply held back 1.5 s for the batch (so the late one's give-back, sent
// as ReserveBatch returns, has its reply lost at its one-second bound;
// the delay is lifted 50 ms later, for the caller's own refund). The
// caller's Wait on the booked reservation is cut short at once (its ctx
// already ended). Wait gives the booking back on a context of its own,
// bounded by a second, and that second is spent waiting for the late
// give-back: is anything left for its own refund? The booked one's room
// must come back: the next booking takes its slot.
// Its deadline once fell before the late slot on the Redis clock, so Redis
// refused the request and the scene never happened; with the deadline
// judged from Booking().At it failed 2 of 2, until a Wait cut short waited
// for the batch's give-backs before starting its own second.
func TestReviewLateAfterWaitCutAtOnceLostGiveBack(t *testing.T) {
	t.Parallel()
	eng, p, _ := latencyEngine(t)
	l, err := reserve.New(eng, "cut", throttle.Every(5*time.Second, 1, 0))
	require.NoError(t, err)
	lost := 0
	const rounds = 2
	for i := range rounds {
		key := fmt.Sprintf("cut%d", i)
		head, err := l.Reserve(context.Background(), key)
		require.NoError(t, err)
		interval := l.Limits()[0].Interval()
		dl, cancel := context.WithDeadline(context.Background(), head.Booking().At.Add(2*interval+20*time.Millisecond))
		defer cancel()
		p.SetReplyDelay(1500 * time.Millisecond)
		rs, err := l.ReserveBatch(context.Background(), key, []reserve.BatchRequest{{N: 1}, {Context: dl, N: 1}})
		require.NoError(t, err)
		go func() { time.Sleep(50 * time.Millisecond); p.SetReplyDelay(0) }()
		booked, late := rs[0], rs[1]
		require.True(t, booked.OK(), "%v", booked.Err())
		require.ErrorIs(t, late.Err(), deadline.ErrWouldExceedDeadline)
		ended, stop := context.WithCancel(context.Background())
		stop()
		t0 := time.Now()
		require.ErrorIs(t, booked.Wait(ended), context.Canceled)
		took := time.Since(t0)
		time.Sleep(100 * time.Millisecond)
		next := nextAt(t, l, key)
		if !next.Equal(booked.Booking().At) {
			lost++
			t.Logf("round %d: Wait took %v; the next booking is %v after the booked slot: its room lost", i, took, next.Sub(booked.Booking().At))
		}
	}
	require.Zero(t, lost, "rounds (of %d) in which the booked one's room was lost", rounds)
}

// delayAfterBatch, once armed, holds every reply of p back delay (1.5 s
// if zero) from the moment a book.lua call (a script call of more than
// book1.lua's eight arguments) is answered, before its caller sees the
// reply.
type delayAfterBatch struct {
	p     *redistest.Proxy
	delay time.Duration
	armed atomic.Bool
}

func (h *delayAfterBatch) DialHook(next redis.DialHook) redis.DialHook { return next }

func (h *delayAfterBatch) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		err := next(ctx, cmd)
		if name := cmd.Name(); (name == "evalsha" || name == "eval") && len(cmd.Args()) > 8 && h.armed.CompareAndSwap(true, false) {
			d := h.delay
			if d == 0 {
				d = 1500 * time.Millisecond
			}
			h.p.SetReplyDelay(d)
		}
		return err
	}
}

func (h *delayAfterBatch) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}
