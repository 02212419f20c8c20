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
	"strings"
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
// not change hands, nor does a slot pass down under one that stands. Slots 2 s apart,
// a burst of 1 (room for two units at once), every reply held back 80 ms;
// each key starts with a head of two units, which takes the burst. A
// control key books one unit after its head: a textbook GCRA puts it one
// interval after the head. Then on other keys:
//   - [L(1), B(2)]: the late one's booking lies under the two-unit one,
//     which stands; cancelled, that one gives both back;
//   - [L(1), B(2), B(1)]: the one-unit request after the two-unit one
//     does not take the late one's slot, under the two-unit one: the
//     bookings that stand keep the requests' order, so that they give
//     everything back cancelled latest first by request (the late one's
//     with the two-unit one's Cancel).
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
			require.True(t, rs[2].Booking().At.After(rs[1].Booking().At), "the one-unit request's booking after the two-unit one's")
		}
		// Latest first, by request.
		if withOne {
			require.NoError(t, rs[2].Cancel(ctx))
		}
		require.NoError(t, rs[1].Cancel(ctx))
		got := belowNext(t, l, key).Sub(h)
		require.Equal(t, control, got, "withOne=%v: the next booking lands as the control's", withOne)
	}
}

// slowRefunds is a go-redis hook that holds each refund call (its keys
// name a booking's tombstone, ":x:") back before it is sent, and each
// other script call's reply after it runs.
type slowRefunds struct {
	refund, reply time.Duration
}

func (slowRefunds) DialHook(next redis.DialHook) redis.DialHook { return next }
func (slowRefunds) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}
func (h slowRefunds) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		if n := cmd.Name(); n != "evalsha" && n != "eval" {
			return next(ctx, cmd)
		}
		for _, a := range cmd.Args() {
			if s, ok := a.(string); ok && strings.Contains(s, ":x:") {
				time.Sleep(h.refund)
				return next(ctx, cmd)
			}
		}
		err := next(ctx, cmd)
		time.Sleep(h.reply)
		return err
	}
}

// TestCoalescedLateGoesBackBeforeNextBatch: coalescing on, every caller
// queued behind the call in flight (SetSoloBelow 1), slots 2 s apart, each
// booking's reply 80 ms late and each refund 40 ms slow to leave. A
// batch's late caller (its deadline just after its slot: the reply's delay
// makes it late) is its latest booking, given back by the limiter; the
// next batch of the key, queued meanwhile, must not be booked before that
// give-back is in: its bookings would stand on the late one's, which could
// then give nothing back. Textbook GCRA with no burst: the late caller
// never acts, so the next batch's caller takes the slot right after those
// that stand. Both ways a batch gives its late bookings back: alone (its
// sender gives it back itself) and with a caller that stands below it.
func TestCoalescedLateGoesBackBeforeNextBatch(t *testing.T) {
	t.Parallel()
	interval := 2 * time.Second
	const reply = 80 * time.Millisecond
	rdb := redistest.Shared(t).Client(t)
	rdb.AddHook(slowRefunds{refund: reply / 2, reply: reply})
	eng, err := throttle.New(rdb, throttle.WithPrefix(redistest.Prefix(t)), throttle.WithTimeout(5*time.Second))
	require.NoError(t, err)
	require.NoError(t, eng.Load(context.Background()))
	l, err := reserve.New(eng, "hdn", throttle.Every(interval, 1, 0), reserve.WithoutMaxWait())
	require.NoError(t, err)
	reserve.SetSoloBelow(l, 1)
	ctx := context.Background()
	for _, withStanding := range []bool{false, true} {
		key := fmt.Sprintf("next%v", withStanding)
		head, err := l.Reserve(ctx, key)
		require.NoError(t, err)
		at := func(k int) time.Time { return head.Booking().At.Add(time.Duration(k) * interval) }
		async := func(c context.Context) chan *reserve.Reservation {
			ch := make(chan *reserve.Reservation, 1)
			go func() {
				r, err := l.Reserve(c, key)
				if err != nil {
					r = nil
				}
				ch <- r
			}()
			return ch
		}
		a := async(ctx) // the leader, in flight
		require.Eventually(t, func() bool { return reserve.QueueLen(l, key) == 0 }, 5*time.Second, time.Millisecond)
		time.Sleep(reply / 4)
		// The second batch: [standing?, late], queued behind the leader.
		var standing chan *reserve.Reservation
		late := 2
		if withStanding {
			standing = async(ctx)
			require.Eventually(t, func() bool { return reserve.QueueLen(l, key) == 1 }, 5*time.Second, time.Millisecond)
			late = 3
		}
		dl, cancel := context.WithDeadline(ctx, at(late).Add(20*time.Millisecond))
		defer cancel()
		lr := async(dl)
		// The third batch queues once the second is out.
		queued := 1
		if withStanding {
			queued = 2
		}
		require.Eventually(t, func() bool { return reserve.QueueLen(l, key) == queued }, 5*time.Second, time.Millisecond)
		require.Eventually(t, func() bool { return reserve.QueueLen(l, key) == 0 }, 5*time.Second, time.Millisecond)
		c := async(ctx)

		ra := <-a
		require.NotNil(t, ra)
		require.Equal(t, at(1), ra.Booking().At, "the leader")
		if withStanding {
			rs := <-standing
			require.NotNil(t, rs)
			require.Equal(t, at(2), rs.Booking().At, "the second batch's caller that stands")
		}
		rl := <-lr
		require.True(t, rl == nil || errors.Is(rl.Err(), deadline.ErrWouldExceedDeadline), "the late caller: %v", rl)
		rc := <-c
		require.NotNil(t, rc)
		require.Equal(t, at(late), rc.Booking().At, "withStanding=%v: the third batch's caller takes the late one's slot, given back first", withStanding)
	}
}
