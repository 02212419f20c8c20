package reserve_test

// Review of c21e606 (a late booking of a batch under a later booking that
// stands is given back by that booking's Cancel, right after its own)
// through the public API, brought up to date with the hand-down inside a
// batch (a late booking's slot goes to the later requests that stand, and
// the late ones take the batch's latest slots; see belowBatch). The
// carrier mechanism itself now serves bookings of another number of
// units only. Slots are 2 s apart (none comes during a test
// unless waited for); room is judged by the slot of the next booking on
// the Redis clock (Booking().At) against the bookings that stand, a
// textbook GCRA with no burst: the next slot is one interval after the
// latest booking that stands.

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"sort"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/slotbook/slotbook/deadline"
	"github.com/slotbook/slotbook/internal/redistest"
	"github.com/slotbook/slotbook/reserve"
	"github.com/slotbook/slotbook/throttle"
)

// belowDelay is the reply delay of these tests' proxy; belowMargin how far
// before its local slot a late request's deadline falls (Redis books it
// within the budget, the reply's delay makes it late).
const (
	belowDelay  = 80 * time.Millisecond
	belowMargin = 40 * time.Millisecond
)

// belowBatch books a head for key and then one batch after pattern: 'B'
// a request with no deadline (booked), 'L' one made late by the reply's
// delay at its own slot (not held), 'H' one made late and held. It returns
// the head and the batch's reservations, having checked each came back as
// ReserveBatch's doc has it: the requests that stand take the earliest
// slots in order (each the earliest not taken), so an L or H after a late
// L is handed a slot an interval before its own, fits its deadline there
// and is booked; the late L's take the slots left, the latest.
func belowBatch(t *testing.T, l *reserve.Limiter, key, pattern string) (*reserve.Reservation, []*reserve.Reservation) {
	t.Helper()
	ctx := context.Background()
	head, err := l.Reserve(ctx, key)
	require.NoError(t, err)
	require.True(t, head.OK())
	interval := l.Limits()[0].Interval()
	reqs := make([]reserve.BatchRequest, len(pattern))
	for i, c := range pattern {
		reqs[i] = reserve.BatchRequest{N: 1}
		if c == 'L' || c == 'H' {
			dl, cancel := context.WithDeadline(ctx, head.Booking().At.Add(time.Duration(i+1)*interval+belowMargin))
			t.Cleanup(cancel)
			reqs[i].Context, reqs[i].HoldLate = dl, c == 'H'
		}
	}
	rs, err := l.ReserveBatch(ctx, key, reqs)
	require.NoError(t, err)
	// Each request's slot, in intervals after the head, and its outcome.
	slot, kind := make([]int, len(pattern)), []byte(pattern)
	own, next := 1, 1
	var left []int
	for i, c := range kind {
		switch {
		case c == 'B':
			slot[i], next = next, next+1
		case next < own:
			kind[i] = 'B'
			slot[i], next = next, next+1
		case c == 'H':
			slot[i], next = next, next+1
		default:
			left = append(left, i)
		}
		own++
	}
	for _, i := range left {
		slot[i], next = next, next+1
	}
	for i, c := range kind {
		r := rs[i]
		require.Equal(t, head.Booking().At.Add(time.Duration(slot[i])*interval), r.Booking().At, "%s: request %d's slot", pattern, i)
		switch c {
		case 'B':
			require.True(t, r.OK(), "request %d: %v", i, r.Err())
		case 'L':
			require.ErrorIs(t, r.Err(), deadline.ErrWouldExceedDeadline, "request %d", i)
			require.False(t, r.Booking().OK, "request %d not held", i)
		case 'H':
			require.ErrorIs(t, r.Err(), deadline.ErrWouldExceedDeadline, "request %d", i)
			require.True(t, r.Booking().OK, "request %d held", i)
		}
	}
	return head, rs
}

// belowLimiter is a limiter (slots interval apart, no burst, no max wait)
// whose every reply is held back belowDelay by a proxy of its own.
func belowLimiter(t *testing.T, name string, interval time.Duration, opts ...reserve.Option) (*reserve.Limiter, *redistest.Proxy) {
	t.Helper()
	eng, p, _ := latencyEngine(t)
	p.SetReplyDelay(belowDelay)
	l, err := reserve.New(eng, name, throttle.Every(interval, 1, 0), append([]reserve.Option{reserve.WithoutMaxWait()}, opts...)...)
	require.NoError(t, err)
	return l, p
}

// belowNext books once more on key and returns its slot on the Redis
// clock.
func belowNext(t *testing.T, l *reserve.Limiter, key string) time.Time {
	t.Helper()
	r, err := l.Reserve(context.Background(), key)
	require.NoError(t, err)
	require.True(t, r.OK(), "%v", r.Err())
	return r.Booking().At
}

// belowStands reports the bookings that a caller still holds: those booked
// or held (the late ones not held are the limiter's to give back).
func belowStands(r *reserve.Reservation) bool { return r.OK() || r.Booking().OK }

// TestReviewBelowInterleavedLatestFirst: batches of late bookings (not
// held) interleaved with booked and held ones, cancelled by the caller
// latest first (each Reservation's Cancel, the late ones' too, which do
// nothing): every room comes back, so the next booking takes the slot
// right after the head.
func TestReviewBelowInterleavedLatestFirst(t *testing.T) {
	t.Parallel()
	l, _ := belowLimiter(t, "lf", 2*time.Second)
	for i, pattern := range []string{"LB", "LLB", "BLLBLBL", "LBLBLB", "LLHLB", "BHLLH", "LBLLL"} {
		key := fmt.Sprintf("lf%d", i)
		head, rs := belowBatch(t, l, key, pattern)
		for k := len(rs) - 1; k >= 0; k-- {
			require.NoError(t, rs[k].Cancel(context.Background()), "%s: request %d", pattern, k)
		}
		require.Equal(t, head.Booking().At.Add(2*time.Second), belowNext(t, l, key), "%s: all the batch's room back", pattern)
	}
}

// TestReviewBelowCarrierLostReplyRetried: batch "LB" (the late one's slot
// handed down to the booked one, its own given back by the batch). The
// reply to the last booking's Cancel is lost (held back, then the
// connection dropped): Cancel errs, and called again it succeeds; with the
// others cancelled latest first, every room comes back, once: the next
// bookings take the batch's slots in turn.
func TestReviewBelowCarrierLostReplyRetried(t *testing.T) {
	t.Parallel()
	l, p := belowLimiter(t, "lost", 2*time.Second)
	for _, pattern := range []string{"LB", "LLB", "LH", "BLB"} {
		key := "lost" + pattern
		head, rs := belowBatch(t, l, key, pattern)
		time.Sleep(4 * belowDelay) // the batch's own give-backs are in
		var stand []*reserve.Reservation
		for _, r := range rs {
			if belowStands(r) {
				stand = append(stand, r)
			}
		}
		carrier := stand[len(stand)-1]
		p.SetReplyDelay(2 * time.Second)
		errc := make(chan error, 1)
		go func() { errc <- carrier.Cancel(context.Background()) }()
		time.Sleep(150 * time.Millisecond) // the refund has run; its reply is held
		p.Sever()
		require.Error(t, <-errc, "%s: a Cancel whose reply was lost", pattern)
		p.SetReplyDelay(0)
		redistest.UntilOK(t, func() error { return carrier.Cancel(context.Background()) })
		require.NoError(t, carrier.Cancel(context.Background()), "and again")
		for k := len(stand) - 2; k >= 0; k-- {
			require.NoError(t, stand[k].Cancel(context.Background()))
		}
		for k := range rs {
			want := head.Booking().At.Add(time.Duration(k+1) * 2 * time.Second)
			require.Equal(t, want, belowNext(t, l, key), "%s: slot %d back, once", pattern, k)
		}
		p.SetReplyDelay(belowDelay)
	}
}

// TestReviewBelowCarrierUsed: slots 1 s apart; batch "LB" (the late one's
// slot handed down to the booked one). The caller waits for the booked
// one's slot (it is used), then cancels it: nothing is given back: the
// next booking lies an interval after the used slot, never before.
// Also "BLLB" (the first L late, its slot handed down: the second L is
// booked an interval earlier than its own): the Wait of the last one cut
// short gives its booking back, and the others cancelled latest first
// give theirs: the next booking takes the slot right after the head.
func TestReviewBelowCarrierUsed(t *testing.T) {
	t.Parallel()
	l, _ := belowLimiter(t, "used", time.Second)
	t.Run("used", func(t *testing.T) {
		_, rs := belowBatch(t, l, "used", "LB")
		require.NoError(t, rs[1].Wait(context.Background()))
		require.NoError(t, rs[1].Cancel(context.Background()))
		require.NoError(t, rs[0].Cancel(context.Background()))
		next := belowNext(t, l, "used")
		require.False(t, next.Before(rs[1].Booking().At.Add(time.Second)), "next %v is before the used slot + interval %v", next, rs[1].Booking().At.Add(time.Second))
	})
	t.Run("wait-cut", func(t *testing.T) {
		head, rs := belowBatch(t, l, "cut", "BLLB")
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Millisecond)
		defer cancel()
		require.ErrorIs(t, rs[3].Wait(ctx), context.DeadlineExceeded)
		require.True(t, rs[2].OK(), "the second L, handed an earlier slot: %v", rs[2].Err())
		require.NoError(t, rs[2].Cancel(context.Background()))
		require.NoError(t, rs[0].Cancel(context.Background()))
		require.Equal(t, head.Booking().At.Add(time.Second), belowNext(t, l, "cut"), "all back")
	})
}

// TestReviewBelowOutOfOrder: batch "BLLBLBLB", a random subset of its
// booked reservations cancelled in a random order, one after the other
// or all at once (goroutines). Whatever room comes back, nothing early:
// the next booking lies at least an interval after the latest booking
// still held (the head's, if none).
func TestReviewBelowOutOfOrder(t *testing.T) {
	t.Parallel()
	l, _ := belowLimiter(t, "ooo", 2*time.Second)
	for round := range 6 {
		key := fmt.Sprintf("ooo%d", round)
		head, rs := belowBatch(t, l, key, "BLLBLBLB")
		var cancel []int
		for k, r := range rs {
			if belowStands(r) && rand.IntN(3) > 0 {
				cancel = append(cancel, k)
			}
		}
		rand.Shuffle(len(cancel), func(i, j int) { cancel[i], cancel[j] = cancel[j], cancel[i] })
		concurrent := round%2 == 1
		var wg sync.WaitGroup
		for _, k := range cancel {
			if concurrent {
				wg.Add(1)
				go func() { defer wg.Done(); _ = rs[k].Cancel(context.Background()) }()
				continue
			}
			require.NoError(t, rs[k].Cancel(context.Background()))
		}
		wg.Wait()
		latest := head.Booking().At
		for k, r := range rs {
			if belowStands(r) && !containsInt(cancel, k) {
				latest = r.Booking().At
			}
		}
		next := belowNext(t, l, key)
		t.Logf("round %d: cancelled %v (concurrent=%v): next %v after the head, latest held %v",
			round, cancel, concurrent, next.Sub(head.Booking().At), latest.Sub(head.Booking().At))
		require.False(t, next.Before(latest.Add(2*time.Second)), "round %d: next %v before the latest held slot + interval", round, next.Sub(head.Booking().At))
	}
}

func containsInt(xs []int, x int) bool {
	for _, y := range xs {
		if y == x {
			return true
		}
	}
	return false
}

// TestReviewBelowCoalesced: coalescing on, every caller queued behind the
// call in flight (SetSoloBelow 1), 12 callers of one key queued in order
// behind a leader, sent in one batch, a third of them with deadlines the
// reply's delay makes them miss (late, not held: in the middle of the
// batch they go back with the Cancel of the booked one above them). The
// callers' reservations, cancelled latest first by one goroutine once all
// are in, give every room back (the late ones': by the limiter or by the
// booked one above them): the next booking takes the slot right after the
// leader's.
func TestReviewBelowCoalesced(t *testing.T) {
	t.Parallel()
	l, p := belowLimiter(t, "co", 2*time.Second, reserve.WithCoalescing(true))
	reserve.SetSoloBelow(l, 1)
	for round := range 3 {
		key := fmt.Sprintf("co%d", round)
		ctx := context.Background()
		head, err := l.Reserve(ctx, key)
		require.NoError(t, err)
		// The leader: in flight while the others queue.
		var (
			mu    sync.Mutex
			all   []*reserve.Reservation
			lates int
			wg    sync.WaitGroup
		)
		leader := make(chan *reserve.Reservation, 1)
		go func() {
			r, err := l.Reserve(ctx, key)
			if err != nil {
				r = nil
			}
			leader <- r
		}()
		time.Sleep(20 * time.Millisecond)
		for i := range 12 {
			time.Sleep(2 * time.Millisecond) // queued in order: caller i gets slot i+2
			wg.Add(1)
			go func() {
				defer wg.Done()
				c := ctx
				if i%3 == 1 {
					// A deadline just before its slot: booked within
					// the budget, made late by the reply's delay (or,
					// queued out of order, refused by the budget or in
					// time).
					dl, cancel := context.WithDeadline(ctx, head.Booking().At.Add(time.Duration(2+i)*2*time.Second+belowMargin))
					defer cancel()
					c = dl
				}
				r, err := l.Reserve(c, key)
				mu.Lock()
				defer mu.Unlock()
				switch {
				case err == nil && r.OK():
					all = append(all, r)
				case err == nil && errors.Is(r.Err(), deadline.ErrWouldExceedDeadline):
					lates++
				default:
					t.Errorf("caller %d: %v", i, err)
				}
			}()
		}
		wg.Wait()
		lr := <-leader
		require.True(t, lr != nil && lr.OK(), "the leader booked")
		all = append(all, lr)
		sort.Slice(all, func(i, j int) bool { return all[i].Booking().At.Before(all[j].Booking().At) })
		// The refunds answered at once, so that no slot comes meanwhile.
		p.SetReplyDelay(0)
		time.Sleep(150 * time.Millisecond) // the limiter's own give-backs are in
		for k := len(all) - 1; k >= 0; k-- {
			require.NoError(t, all[k].Cancel(ctx))
		}
		next := belowNext(t, l, key)
		t.Logf("round %d: %d booked, %d refused (late or by budget); next %v after the head", round, len(all), lates, next.Sub(head.Booking().At))
		require.Equal(t, head.Booking().At.Add(2*time.Second), next, "round %d: all the room back", round)
		require.Positive(t, lates, "round %d: some callers late", round)
		p.SetReplyDelay(belowDelay)
	}
}
