package reserve_test

// The hand-down inside a batch: requests that will not use their slot (made
// late by the reply's latency, or whose caller has gone while the call was
// out) leave it to the batch's later requests of as many units, which act
// in the earliest slots; the slots left over are the batch's latest, and go
// back in full. Judged by a textbook GCRA with no burst on the Redis clock
// (Booking().At): after the head at T, the requests that stand act at
// T+I, T+2I, ... in order, and the next booking of the key lands one
// interval after the last of them.

import (
	"context"
	"errors"
	"fmt"
	"sort"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/slotbook/slotbook/deadline"
	"github.com/slotbook/slotbook/reserve"
	"github.com/slotbook/slotbook/throttle"
)

// TestBatchHandsDownUnusedSlots: ReserveBatch on a key 2 s an interval
// (no slot comes during the test), every reply held back 80 ms. In each
// pattern, 'B' is a request with no deadline, 'L' one whose deadline the
// reply's delay makes it miss (late, not held), 'E' one whose context is
// cancelled while the call is out. Only the B's stand, and any L handed
// an earlier slot that its deadline fits: they hold the slots right after
// the head, in order, and the next booking comes right after them; the
// other L's are refused late and the E's with their context's error,
// holding nothing.
func TestBatchHandsDownUnusedSlots(t *testing.T) {
	t.Parallel()
	l, p := belowLimiter(t, "hd", 2*time.Second)
	interval := 2 * time.Second
	ctx := context.Background()
	for i, pattern := range []string{"LB", "LLB", "BLB", "LBLB", "EB", "EEBB", "BELB", "LEBBL"} {
		key := fmt.Sprintf("hd%d", i)
		head, err := l.Reserve(ctx, key)
		require.NoError(t, err)
		reqs := make([]reserve.BatchRequest, len(pattern))
		var cancels []context.CancelFunc
		for k, c := range pattern {
			reqs[k] = reserve.BatchRequest{N: 1}
			switch c {
			case 'L':
				// Its own slot (k+1 intervals after the head) fits its
				// deadline on the Redis clock; the reply's delay does not.
				dl, cancel := context.WithDeadline(ctx, head.Booking().At.Add(time.Duration(k+1)*interval+belowMargin))
				defer cancel()
				reqs[k].Context = dl
			case 'E':
				c, cancel := context.WithCancel(ctx)
				reqs[k].Context = c
				cancels = append(cancels, cancel)
			}
		}
		if len(cancels) > 0 {
			go func() {
				time.Sleep(belowDelay / 4) // sent, reply still out
				for _, cancel := range cancels {
					cancel()
				}
			}()
		}
		rs, err := l.ReserveBatch(ctx, key, reqs)
		require.NoError(t, err)
		var stand []time.Time
		for k, c := range pattern {
			r := rs[k]
			switch c {
			case 'B':
				require.True(t, r.OK(), "%s: request %d: %v", pattern, k, r.Err())
				stand = append(stand, r.Booking().At)
			case 'L':
				if r.OK() {
					// Handed an earlier slot, which its deadline fits.
					stand = append(stand, r.Booking().At)
					break
				}
				require.ErrorIs(t, r.Err(), deadline.ErrWouldExceedDeadline, "%s: request %d", pattern, k)
				require.False(t, r.Booking().OK, "%s: request %d holds nothing", pattern, k)
			case 'E':
				require.ErrorIs(t, r.Err(), context.Canceled, "%s: request %d", pattern, k)
				require.False(t, r.Booking().OK, "%s: request %d holds nothing", pattern, k)
			}
		}
		for k, at := range stand {
			require.Equal(t, head.Booking().At.Add(time.Duration(k+1)*interval), at, "%s: the %d-th request standing", pattern, k)
		}
		p.SetReplyDelay(0)
		time.Sleep(100 * time.Millisecond) // the limiter's own give-backs are in
		require.Equal(t, head.Booking().At.Add(time.Duration(len(stand)+1)*interval), belowNext(t, l, key), "%s: the next booking right after those standing", pattern)
		p.SetReplyDelay(belowDelay)
	}
}

// TestCoalescedHandsDownUnusedSlots: coalescing on, every caller queued
// behind the call in flight (SetSoloBelow 1). Eight callers of a key
// queue behind a leader; a late deadline makes some miss their slot by the
// reply's delay, and some are cancelled while their batch is out (or, if
// the machine is slow, while queued: then they book nothing). The callers
// that got a slot hold the slots right after the leader's, one interval
// apart, and the next booking comes right after them.
func TestCoalescedHandsDownUnusedSlots(t *testing.T) {
	t.Parallel()
	const delay = 200 * time.Millisecond
	l, p := belowLimiter(t, "hdc", 2*time.Second, reserve.WithCoalescing(true))
	p.SetReplyDelay(delay)
	reserve.SetSoloBelow(l, 1)
	interval := 2 * time.Second
	ctx := context.Background()
	for round := range 3 {
		key := fmt.Sprintf("hdc%d", round)
		head, err := l.Reserve(ctx, key)
		require.NoError(t, err)
		leader := make(chan *reserve.Reservation, 1)
		go func() {
			r, err := l.Reserve(ctx, key)
			if err != nil {
				r = nil
			}
			leader <- r
		}()
		time.Sleep(delay / 4) // the leader's call is out
		var (
			mu    sync.Mutex
			got   []*reserve.Reservation
			gone  int
			wg    sync.WaitGroup
			start = time.Now()
		)
		for i := range 8 {
			time.Sleep(2 * time.Millisecond) // queued in order
			var (
				c      context.Context
				cancel context.CancelFunc
			)
			switch i % 4 {
			case 1: // late: a deadline at its slot on the Redis clock
				c, cancel = context.WithDeadline(ctx, head.Booking().At.Add(time.Duration(i+2)*interval+belowMargin))
			case 2: // gone while its batch is out (sent once the leader's reply is in)
				c, cancel = context.WithCancel(ctx)
				time.AfterFunc(delay+delay/2-time.Since(start), cancel)
			default:
				c, cancel = context.WithCancel(ctx)
			}
			wg.Go(func() {
				defer cancel()
				r, err := l.Reserve(c, key)
				mu.Lock()
				defer mu.Unlock()
				switch {
				case err == nil && r.OK():
					got = append(got, r)
				case err == nil && errors.Is(r.Err(), deadline.ErrWouldExceedDeadline),
					errors.Is(err, context.Canceled):
					gone++
				default:
					t.Errorf("caller %d: %v %v", i, err, r.Err())
				}
			})
		}
		wg.Wait()
		lr := <-leader
		require.True(t, lr != nil && lr.OK(), "the leader booked")
		got = append(got, lr)
		sort.Slice(got, func(i, j int) bool { return got[i].Booking().At.Before(got[j].Booking().At) })
		for k, r := range got {
			require.Equal(t, head.Booking().At.Add(time.Duration(k+1)*interval), r.Booking().At, "round %d: the %d-th slot standing", round, k)
		}
		p.SetReplyDelay(0)
		time.Sleep(100 * time.Millisecond) // the limiter's own give-backs are in
		next := belowNext(t, l, key)
		t.Logf("round %d: %d stand, %d late or gone; next %v after the head", round, len(got), gone, next.Sub(head.Booking().At))
		require.Equal(t, head.Booking().At.Add(time.Duration(len(got)+1)*interval), next, "round %d: the next booking right after those standing", round)
		require.Positive(t, gone, "round %d: some callers late or gone", round)
		p.SetReplyDelay(delay)
	}
}

// TestBatchHandsDownMixedUnits: bookings of another number of units do
// not change hands, and the hand-down reaches past them. Slots 2 s apart,
// a burst of 1 (room for two units at once), every reply held back 80 ms;
// each key starts with a head of two units, which takes the burst. A
// control key books one unit after its head: a textbook GCRA puts it one
// interval after the head. Then on other keys:
//   - [L(1), B(2)]: the late one's booking lies under the two-unit one,
//     which stands; cancelled, that one gives both back;
//   - [L(1), B(2), B(1)]: the one-unit request after the two-unit one
//     takes the late one's slot, one interval after the head, and the late
//     one's booking goes back at once; the two cancelled latest first (the
//     two-unit one first) give everything back.
//
// Either way the next one-unit booking lands where the control's did,
// counted from each key's head.
func TestBatchHandsDownMixedUnits(t *testing.T) {
	t.Parallel()
	interval := 2 * time.Second
	eng, p, _ := latencyEngine(t)
	p.SetReplyDelay(belowDelay)
	l, err := reserve.New(eng, "hdm", throttle.Every(interval, 1, 1), reserve.WithoutMaxWait())
	require.NoError(t, err)
	ctx := context.Background()
	head := func(key string) time.Time {
		r, err := l.ReserveN(ctx, key, 2)
		require.NoError(t, err)
		require.True(t, r.OK(), "%v", r.Err())
		return r.Booking().At
	}
	ch := head("control")
	control := belowNext(t, l, "control").Sub(ch)
	require.Equal(t, interval, control, "the control: one interval after the head")

	for _, withOne := range []bool{false, true} {
		key := fmt.Sprintf("mixed%v", withOne)
		h := head(key)
		// The late one's own slot: one interval after the head.
		dl, cancel := context.WithDeadline(ctx, h.Add(interval+belowMargin))
		defer cancel()
		reqs := []reserve.BatchRequest{{Context: dl, N: 1}, {N: 2}}
		if withOne {
			reqs = append(reqs, reserve.BatchRequest{N: 1})
		}
		rs, err := l.ReserveBatch(ctx, key, reqs)
		require.NoError(t, err)
		require.ErrorIs(t, rs[0].Err(), deadline.ErrWouldExceedDeadline, "withOne=%v: the first is late", withOne)
		require.False(t, rs[0].Booking().OK, "withOne=%v: and holds nothing", withOne)
		require.True(t, rs[1].OK(), "%v", rs[1].Err())
		if withOne {
			require.True(t, rs[2].OK(), "%v", rs[2].Err())
			require.Equal(t, h.Add(interval), rs[2].Booking().At, "the one-unit request takes the late one's slot")
			require.True(t, rs[2].Booking().At.Before(rs[1].Booking().At), "under the two-unit one")
		}
		time.Sleep(4 * belowDelay) // the batch's own give-backs are in
		// Latest first.
		require.NoError(t, rs[1].Cancel(ctx))
		if withOne {
			require.NoError(t, rs[2].Cancel(ctx))
		}
		got := belowNext(t, l, key).Sub(h)
		require.Equal(t, control, got, "withOne=%v: the next booking lands as the control's", withOne)
	}
}
