package reserve_test

// Review of 73271e2 (BatchRequest.HoldLate, Reservation.View) through the
// public API: the side paths of a late refusal held for the caller. Every
// test judges room by the slots of the next bookings on the Redis clock
// (Booking().At), worked out from the bookings that stand, one interval
// (500 ms) apart, never from the code's own arithmetic.

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/slotbook/slotbook/deadline"
	"github.com/slotbook/slotbook/internal/redistest"
	"github.com/slotbook/slotbook/reserve"
	"github.com/slotbook/slotbook/throttle"
)

// heldLate books, with every reply held back 40 ms, a head and then a
// late request held for the caller (lateBatch with HoldLate) and the
// request after it; it gives the one after back (latest first), so the
// late one is the key's latest standing booking. The late booking must be
// held: refused, Booking().OK, SlotAt zero.
func heldLate(t *testing.T, l *reserve.Limiter, key string) (head, late *reserve.Reservation) {
	t.Helper()
	head, late, after := lateBatch(t, l, key, true)
	require.ErrorIs(t, late.Err(), deadline.ErrWouldExceedDeadline)
	require.False(t, late.OK())
	require.True(t, late.Booking().OK, "held")
	require.True(t, late.SlotAt().IsZero())
	require.True(t, after.OK(), "%v", after.Err())
	require.NoError(t, after.Cancel(context.Background()))
	return head, late
}

// nextTwo books twice on key and returns the two slots on the Redis clock.
func nextTwo(t *testing.T, l *reserve.Limiter, key string) (a, b time.Time) {
	t.Helper()
	ctx := context.Background()
	ra, err := l.Reserve(ctx, key)
	require.NoError(t, err)
	require.True(t, ra.OK(), "%v", ra.Err())
	rb, err := l.Reserve(ctx, key)
	require.NoError(t, err)
	require.True(t, rb.OK(), "%v", rb.Err())
	return ra.Booking().At, rb.Booking().At
}

// TestReviewHoldLateCancelConcurrentOnce: a held late refusal cancelled by
// sixteen goroutines at once, and by views of it, makes one refund call and
// gives its room back once: the next two bookings take its slot and the
// one an interval after it (not its slot twice, not the one after).
func TestReviewHoldLateCancelConcurrentOnce(t *testing.T) {
	t.Parallel()
	eng, p, calls := latencyEngine(t)
	p.SetReplyDelay(40 * time.Millisecond)
	l, err := reserve.New(eng, "api", throttle.PerSecond(2, 0)) // 500 ms apart
	require.NoError(t, err)
	_, late := heldLate(t, l, "k")
	ctx := context.Background()

	before := calls.Load()
	var wg sync.WaitGroup
	errs := make([]error, 16)
	for i := range errs {
		wg.Go(func() {
			if i%4 == 0 {
				errs[i] = late.View().Cancel(ctx)
				return
			}
			errs[i] = late.Cancel(ctx)
		})
	}
	wg.Wait()
	for i, err := range errs {
		require.NoError(t, err, "goroutine %d", i)
	}
	require.Equal(t, before+1, calls.Load(), "concurrent Cancels of a held refusal: one refund call")
	require.NoError(t, late.Cancel(ctx))
	require.Equal(t, before+1, calls.Load(), "Cancel again: no call")

	p.SetReplyDelay(0)
	a, b := nextTwo(t, l, "k")
	interval := l.Limits()[0].Interval()
	require.Equal(t, late.Booking().At, a, "the held booking's room came back")
	require.Equal(t, late.Booking().At.Add(interval), b, "and only once")
}

// TestReviewHoldLateCancelLostReply: the reply to a held refusal's Cancel
// is lost (the proxy holds it back, then drops the connection). Cancel
// reports an error; called again it succeeds, and the room has come back
// exactly once (the refund ran in Redis; the retry finds its tombstone).
func TestReviewHoldLateCancelLostReply(t *testing.T) {
	t.Parallel()
	eng, p, _ := latencyEngine(t)
	p.SetReplyDelay(40 * time.Millisecond)
	l, err := reserve.New(eng, "api", throttle.PerSecond(2, 0))
	require.NoError(t, err)
	_, late := heldLate(t, l, "k")
	ctx := context.Background()

	p.SetReplyDelay(2 * time.Second)
	errc := make(chan error, 1)
	go func() { errc <- late.Cancel(ctx) }()
	time.Sleep(100 * time.Millisecond) // the refund has reached Redis; its reply is held
	p.Sever()
	first := <-errc
	require.Error(t, first, "a Cancel whose reply was lost")
	t.Logf("first Cancel: %v", first)

	p.SetReplyDelay(0)
	// The engine's breaker may fail fast for a while after the lost
	// reply: retry until Redis answers, as a caller would.
	redistest.UntilOK(t, func() error { return late.Cancel(ctx) })
	require.NoError(t, late.Cancel(ctx), "and again")
	a, b := nextTwo(t, l, "k")
	interval := l.Limits()[0].Interval()
	require.Equal(t, late.Booking().At, a, "the held booking's room came back")
	require.Equal(t, late.Booking().At.Add(interval), b, "and only once")
}

// TestReviewHoldLateCancelAfterSlotCame: once a held refusal's slot has
// come, its Cancel still gives its room back (one call), since no one acts
// on a refusal: the next booking is immediate, before the end of the held
// one. (Before stop 34 it made no call and gave nothing, and
// this test checked that; helper-74 proved the room lost.)
func TestReviewHoldLateCancelAfterSlotCame(t *testing.T) {
	t.Parallel()
	eng, p, calls := latencyEngine(t)
	p.SetReplyDelay(40 * time.Millisecond)
	l, err := reserve.New(eng, "api", throttle.PerSecond(2, 0))
	require.NoError(t, err)
	_, late := heldLate(t, l, "k")
	ctx := context.Background()
	// Past the slot on both clocks (the local one and Redis's, which the
	// reply's delay puts 40 ms behind the act time).
	time.Sleep(time.Until(late.Booking().At) + 150*time.Millisecond)
	before := calls.Load()
	require.NoError(t, late.Cancel(ctx))
	require.Equal(t, before+1, calls.Load(), "Cancel after the slot came: the refund")
	p.SetReplyDelay(0)
	r, err := l.Reserve(ctx, "k")
	require.NoError(t, err)
	require.True(t, r.OK())
	// Textbook: with the held booking given back, only the head stands,
	// ending at the held slot, which has passed: the next slot is now.
	require.Zero(t, r.Booking().Wait, "the held room came back")
	require.True(t, r.Booking().At.Before(late.Booking().At.Add(l.Limits()[0].Interval())),
		"the next booking %v lies at or after the end of the held one %v", r.Booking().At, late.Booking().At)
}

// TestReviewHoldLateCancelAfterPause: a Pause made after a held refusal
// keeps its room: its Cancel gives nothing below the pause's end, and the
// next booking lies at or after it.
func TestReviewHoldLateCancelAfterPause(t *testing.T) {
	t.Parallel()
	eng, p, _ := latencyEngine(t)
	p.SetReplyDelay(40 * time.Millisecond)
	l, err := reserve.New(eng, "api", throttle.PerSecond(2, 0))
	require.NoError(t, err)
	_, late := heldLate(t, l, "k")
	ctx := context.Background()
	p.SetReplyDelay(0)
	t0, err := eng.Client().(*redis.Client).Time(ctx).Result()
	require.NoError(t, err)
	const pause = 2 * time.Second // beyond the held slot (500 ms away)
	require.NoError(t, l.Pause(ctx, "k", pause))
	require.NoError(t, late.Cancel(ctx))
	r, err := l.Reserve(ctx, "k")
	require.NoError(t, err)
	require.True(t, r.OK())
	require.False(t, r.Booking().At.Before(t0.Add(pause)),
		"the next booking %v lies before the pause's end (>= %v): the held refusal's Cancel reached below it", r.Booking().At, t0.Add(pause))
}

// TestReviewHoldLateLayered: under two limits (500 ms apart, and 1 s apart
// with a burst of one, two per 2 s), a held late refusal cancelled after the booking
// after it gives its room back in both: the next booking takes its slot
// (had the second limit kept it, the next slot would lie 1.5 s after the
// held one, where the second limit next conforms).
func TestReviewHoldLateLayered(t *testing.T) {
	t.Parallel()
	eng, p, _ := latencyEngine(t)
	p.SetReplyDelay(40 * time.Millisecond)
	l, err := reserve.New(eng, "api", throttle.PerSecond(2, 0), reserve.WithLimit(throttle.Every(2*time.Second, 2, 1)))
	require.NoError(t, err)
	head, late := heldLate(t, l, "k")
	ctx := context.Background()
	require.Equal(t, head.Booking().At.Add(500*time.Millisecond), late.Booking().At, "the held slot: one interval after the head")
	require.NoError(t, late.Cancel(ctx))
	p.SetReplyDelay(0)
	a, b := nextTwo(t, l, "k")
	// Textbook, from the head alone at h: limit 1 (I=500ms, tau=0) and
	// limit 2 (I=1s, tau=1s): a at h+500ms; b at max(h+1s, h+2s-1s) = h+1s.
	h := head.Booking().At
	require.Equal(t, h.Add(500*time.Millisecond), a, "both limits gave the held room back")
	require.Equal(t, h.Add(time.Second), b)
}

// TestReviewHoldLateContextEndsInFlight: a request whose deadline passes
// while its batch is in flight, its slot within the deadline (so Redis
// booked it), is held: refused, Booking().OK. Its slot has come by the
// time the reply is in, yet its Cancel gives its room back (no one acts
// on a refusal; before stop 34 it made no call and the room
// stood). A request whose context is cancelled (no deadline) in flight is
// booked as any other, and its Cancel gives its room back.
func TestReviewHoldLateContextEndsInFlight(t *testing.T) {
	t.Parallel()
	eng, p, calls := latencyEngine(t)
	p.SetReplyDelay(150 * time.Millisecond)
	l, err := reserve.New(eng, "api", throttle.PerSecond(2, 0))
	require.NoError(t, err)
	ctx := context.Background()

	dl, stop := context.WithTimeout(ctx, 50*time.Millisecond)
	defer stop()
	cc, cancel := context.WithCancel(ctx)
	defer cancel()
	go func() { time.Sleep(50 * time.Millisecond); cancel() }()
	rs, err := l.ReserveBatch(ctx, "k", []reserve.BatchRequest{
		{Context: dl, N: 1, HoldLate: true}, // immediate slot: the key is idle
		{Context: cc, N: 1, HoldLate: true}, // one interval later
	})
	require.NoError(t, err)
	require.Error(t, dl.Err())
	require.Error(t, cc.Err())
	held, booked := rs[0], rs[1]
	if errors.Is(held.Err(), context.DeadlineExceeded) || errors.Is(booked.Err(), context.Canceled) {
		t.Skip("a context ended before the batch was sent (a slow machine): inconclusive")
	}
	require.ErrorIs(t, held.Err(), deadline.ErrWouldExceedDeadline)
	require.True(t, held.Booking().OK, "held")
	require.True(t, held.SlotAt().IsZero())
	require.True(t, booked.OK(), "cancelled in flight, no deadline: booked (%v)", booked.Err())

	require.NoError(t, booked.Cancel(ctx))
	before := calls.Load()
	require.NoError(t, held.Cancel(ctx))
	require.Equal(t, before+1, calls.Load(), "the held slot came in flight: its refund all the same")
	p.SetReplyDelay(0)
	r, err := l.Reserve(ctx, "k")
	require.NoError(t, err)
	// Textbook: both given back, the key is idle again.
	require.Zero(t, r.Booking().Wait, "both bookings' room came back")
}

// TestReviewHoldLateViews: a View answers as the reservation does, for a
// booked one, a held refusal, a plain refusal, a late refusal not held,
// and a fallback's answer; none of the views' Cancels (nor a view's Wait
// cut short) gives anything back.
func TestReviewHoldLateViews(t *testing.T) {
	t.Parallel()
	eng, p, calls := latencyEngine(t)
	p.SetReplyDelay(40 * time.Millisecond)
	l, err := reserve.New(eng, "api", throttle.PerSecond(2, 0))
	require.NoError(t, err)
	ctx := context.Background()

	_, held, after := lateBatch(t, l, "held", true)
	_, notHeld, after2 := lateBatch(t, l, "plain", false)
	short, stopShort := context.WithTimeout(ctx, 400*time.Millisecond) // the next slot is 1.5 s away
	defer stopShort()
	refused, err := l.Reserve(short, "held")
	require.NoError(t, err)
	require.False(t, refused.OK())
	for name, r := range map[string]*reserve.Reservation{
		"booked": after, "held": held, "late": notHeld, "refused": refused, "booked2": after2,
	} {
		v := r.View()
		require.Equal(t, r.OK(), v.OK(), name)
		require.Equal(t, r.Err(), v.Err(), name)
		require.Equal(t, r.Booking(), v.Booking(), name)
		require.Equal(t, r.SlotAt(), v.SlotAt(), name)
		require.Equal(t, r.RetryAfter(), v.RetryAfter(), name)
		require.Equal(t, r.Fallback(), v.Fallback(), name)
		require.Equal(t, r.View().Booking(), v.View().Booking(), name)
		before := calls.Load()
		require.NoError(t, v.Cancel(ctx), name)
		require.NoError(t, v.View().Cancel(ctx), name)
		short, stop := context.WithTimeout(ctx, time.Millisecond)
		_ = v.Wait(short)
		stop()
		require.Equal(t, before, calls.Load(), "%s: a view's Cancel or Wait made a call", name)
	}
	// The views gave nothing back: the real ones give back, latest first,
	// both rooms of the held key.
	require.NoError(t, after.Cancel(ctx))
	require.NoError(t, held.Cancel(ctx))
	p.SetReplyDelay(0)
	a, err := l.Reserve(ctx, "held")
	require.NoError(t, err)
	require.Equal(t, held.Booking().At, a.Booking().At)
}

// TestReviewHoldLateFallback: with Redis gone, HoldLate changes nothing:
// the fallback answers (no Redis booking to hold: Booking().OK false), a
// view of a fallback reservation answers as it does, and its Cancel gives
// no local room back, while the reservation's own does.
func TestReviewHoldLateFallback(t *testing.T) {
	t.Parallel()
	eng, _, kill := outage(t)
	l, err := reserve.New(eng, "api", throttle.PerSecond(2, 0), reserve.WithFallback(reserve.LocalShare(time.Minute, 1, 10)))
	require.NoError(t, err)
	kill()
	ctx := context.Background()
	var rs []*reserve.Reservation
	require.Eventually(t, func() bool {
		rs, err = l.ReserveBatch(ctx, "k", []reserve.BatchRequest{{N: 1, HoldLate: true}, {N: 1, HoldLate: true}})
		if err == nil && !rs[0].Fallback() {
			for _, r := range rs {
				_ = r.Cancel(ctx)
			}
		}
		return err == nil && rs[0].Fallback()
	}, 10*time.Second, 10*time.Millisecond)
	for i, r := range rs {
		require.True(t, r.OK(), "%d: %v", i, r.Err())
		require.True(t, r.Fallback(), "%d", i)
		require.False(t, r.Booking().OK, "%d: no Redis booking", i)
		v := r.View()
		require.True(t, v.Fallback() && v.OK(), "%d", i)
		require.Equal(t, r.SlotAt(), v.SlotAt(), "%d", i)
	}
	require.Greater(t, rs[1].Delay(), 250*time.Millisecond, "the local share's second slot is an interval (500 ms) away")
	require.NoError(t, rs[1].View().Cancel(ctx))
	third, err := l.Reserve(ctx, "k")
	require.NoError(t, err)
	require.True(t, third.Fallback() && third.OK(), "%v", third.Err())
	require.Greater(t, third.Delay(), 750*time.Millisecond, "a view's Cancel gave the local slot back")
	require.NoError(t, third.Cancel(ctx))
	require.NoError(t, rs[1].Cancel(ctx))
	fourth, err := l.Reserve(ctx, "k")
	require.NoError(t, err)
	require.True(t, fourth.Fallback() && fourth.OK(), "%v", fourth.Err())
	require.Less(t, fourth.Delay(), 750*time.Millisecond, "the reservation's own Cancel gave the local slot back")
}

// TestReviewHoldLateMixedBatchCancel: one batch, both requests late for
// their deadlines: the first held (HoldLate), the second not (ReserveBatch
// gives it back itself). The caller gives the held one back as soon as
// ReserveBatch returns. Nothing of either stands, nothing was booked after
// them: both rooms must come back, so the next booking takes the held
// one's slot. Failed before a Cancel of a Reservation of the batch waited
// for ReserveBatch's own give-backs, which run on a goroutine since
// another request shares the batch: when the caller's refund reached
// Redis first the held one gave nothing back (the later booking still
// stood on it), its room lost until its slot passed (2 to 4 rounds of 8).
func TestReviewHoldLateMixedBatchCancel(t *testing.T) {
	t.Parallel()
	eng, p, _ := latencyEngine(t)
	p.SetReplyDelay(40 * time.Millisecond)
	l, err := reserve.New(eng, "api", throttle.PerSecond(2, 0))
	require.NoError(t, err)
	interval := l.Limits()[0].Interval()
	ctx := context.Background()
	lost := 0
	const rounds = 8
	for i := range rounds {
		key := fmt.Sprintf("k%d", i)
		head, err := l.Reserve(ctx, key)
		require.NoError(t, err)
		dl1, stop1 := context.WithDeadline(ctx, head.Booking().At.Add(interval+20*time.Millisecond))
		dl2, stop2 := context.WithDeadline(ctx, head.Booking().At.Add(2*interval+20*time.Millisecond))
		rs, err := l.ReserveBatch(ctx, key, []reserve.BatchRequest{
			{Context: dl1, N: 1, HoldLate: true},
			{Context: dl2, N: 1},
		})
		require.NoError(t, err)
		held, late := rs[0], rs[1]
		require.True(t, held.Booking().OK && !held.OK(), "held: %v", held.Err())
		require.ErrorIs(t, late.Err(), deadline.ErrWouldExceedDeadline)
		require.NoError(t, held.Cancel(ctx))
		stop1()
		stop2()
		time.Sleep(100 * time.Millisecond) // ReserveBatch's own refund has landed
		r, err := l.Reserve(ctx, key)
		require.NoError(t, err)
		if !r.Booking().At.Equal(held.Booking().At) {
			lost++
			t.Logf("round %d: next booking %v after the held slot (%v): room lost", i, r.Booking().At.Sub(held.Booking().At), held.Booking().At)
		}
	}
	require.Zero(t, lost, "rounds (of %d) in which the held booking's room was lost", rounds)
}
