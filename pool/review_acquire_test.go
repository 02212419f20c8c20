package pool_test

// Review (helper-95) of b486a50: pool.Acquire books with Reserve and
// sleeps itself, with the pool in sight of its callers' bookings. Through
// the public API (plus the package's test exports Booked, Owing and
// SetAfterReply, as the change's own tests use them). Room is judged on
// the Redis clock: a probe booking made straight in Redis (not through
// the proxy) is itself an act, and its Booking().At tells where the key's
// TAT stood; the textbook GCRA replay of the acts that happened says
// where it should stand.
//
// Found on b486a50, and fixed since (each test's comment says what it
// saw, "FAILED"):
//   - TestReviewAQClosedJobUnderCaller/closed=true and
//     TestReviewAQClosedCallersEarliestFirst/closed=true: once the
//     dispatcher had returned, a cancelled caller gave back only its own
//     booking, at once, whatever stood on it or lay owed under it. Now
//     Close ends sleeping callers (ErrClosed) and gives their bookings
//     back in order before the dispatcher returns.
//   - TestReviewAQBatchLateUnderCallerNoLease/lease=false: no stood record
//     without WithLease, so a batch's late refusal looked at after a
//     caller of the same slot acted was given back under it, for nothing.
//   - TestReviewAQCallerOvertakesGiveBack: a caller's Reserve did not
//     wait for the pool's give-backs of its key under way.
//   - TestReviewAQLeaseCallerGoneUnderJob/lease=true and
//     TestReviewAQCallerGoneUnderCaller: a caller whose context ended (or
//     deadline passed) while its call was out had its booking given back
//     by reserve, not held and owed by the pool.
//   - TestReviewAQHotKeyStarvesJobs/sameKey=true: callers' calls counted
//     as the key's in flight, and a pool without leases booked no batch of
//     a key with a call in flight: jobs of a hot key starved.
//   - TestReviewAQCloseWaitsForCallersCall: Close waited for a caller's
//     Redis call (against the docs then; it does again now, documented:
//     see the test).
//   - TestReviewAQClosedCancelPrompt/closed=true: after Close a cancelled
//     caller returned only after its give-back's round trip. (Close now
//     ends the caller at once, with ErrClosed.)

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/slotbook/slotbook/deadline"
	"github.com/slotbook/slotbook/pool"
	"github.com/slotbook/slotbook/reserve"
	"github.com/slotbook/slotbook/throttle"
)

type aqHoldKey struct{}

// aqRig is newFGRig with a few connections through the proxy opened
// beforehand, so that no call of the test pays a handshake through a
// slowed proxy.
func aqRig(t *testing.T, name string, limit throttle.Limit, engOpts ...throttle.Option) *fgRig {
	t.Helper()
	r := newFGRig(t, name, limit, engOpts...)
	rdb := r.lim.Engine().Client().(*redis.Client)
	var wg sync.WaitGroup
	for range 6 {
		wg.Go(func() { _ = rdb.Do(context.Background(), "PING").Err() })
	}
	wg.Wait()
	return r
}

// aqProbe books one unit of key straight in Redis under limits (the
// rig's limiter's, layered or not), waiting as long as it takes: an act
// at its Booking().At.
func aqProbe(t *testing.T, r *fgRig, key string, limits []throttle.Limit) throttle.Booking {
	t.Helper()
	keys := []string{r.name + ":{" + key + "}"}
	for _, l := range limits[1:] {
		keys = append(keys, keys[0]+":"+strconv.FormatInt(l.Period.Milliseconds(), 10)+"ms")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	bs, err := r.probe.BookAll(ctx, keys, limits, []throttle.Request{{N: 1, MaxWait: throttle.Forever}})
	require.NoError(t, err)
	require.True(t, bs[0].OK)
	return bs[0]
}

// aqAcquire runs p.Acquire(ctx, key) on a goroutine; the channel gets its
// error (release called at once on success) and the local time it
// returned.
type aqResult struct {
	err error
	at  time.Time
}

func aqAcquire(p *pool.Pool, ctx context.Context, key string) <-chan aqResult {
	ch := make(chan aqResult, 1)
	go func() {
		release, err := p.Acquire(ctx, key)
		at := time.Now()
		if err == nil {
			release()
		}
		ch <- aqResult{err, at}
	}()
	return ch
}

func aqRecv(t *testing.T, ch <-chan aqResult, within time.Duration, what string) aqResult {
	t.Helper()
	select {
	case r := <-ch:
		return r
	case <-time.After(within):
		t.Fatalf("%s: Acquire did not return within %v", what, within)
		return aqResult{}
	}
}

func aqClose(t *testing.T, p *pool.Pool, within time.Duration) error {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), within)
	defer cancel()
	return p.Close(ctx)
}

// TestReviewAQCancelMoments: an Acquire caller cancelled before its call,
// while its call is out, while it sleeps, with and without WithLease,
// with one limit and with two (reserve.WithLimit), at 40 ms and 400 ms of
// reply latency. P0, a probe straight in Redis, acts first at T; the
// caller books T+I (it would sleep 10 s). Textbook GCRA: the caller never
// acted, so a probe P1 right after finds the key as P0 left it: P1.At is
// T+I at most (2I had the caller's room been lost or let through). And
// Acquire returns promptly once its context ends (while it sleeps: at
// once; while its call is out: once the reply is in).
func TestReviewAQCancelMoments(t *testing.T) {
	t.Parallel()
	lim := throttle.PerMinute(6, 0) // I = 10 s
	second := throttle.PerHour(600, 2)
	for _, delay := range []time.Duration{40 * time.Millisecond, 400 * time.Millisecond} {
		for _, leases := range []int{0, 8} {
			for _, layered := range []bool{false, true} {
				name := fmt.Sprintf("delay=%v/lease=%v/layered=%v", delay, leases > 0, layered)
				t.Run(name, func(t *testing.T) {
					t.Parallel()
					r := aqRig(t, "aqmoment", lim)
					limits := []throttle.Limit{lim}
					if layered {
						l2, err := r.lim.With(reserve.WithLimit(second))
						require.NoError(t, err)
						r.lim = l2
						limits = append(limits, second)
					}
					p := newTradePool(t, r, leases)
					r.proxy.SetReplyDelay(delay)
					bg := context.Background()
					for _, moment := range []string{"before", "in flight", "sleeping"} {
						key := "k-" + moment
						p0 := aqProbe(t, r, key, limits)
						ctx, cancel := context.WithCancel(bg)
						defer cancel()
						var ch <-chan aqResult
						switch moment {
						case "before":
							cancel()
							ch = aqAcquire(p, ctx, key)
						case "in flight":
							ch = aqAcquire(p, ctx, key)
							time.Sleep(delay / 4) // sent (a lease first, straight to Redis), reply not in
							cancel()
						case "sleeping":
							ch = aqAcquire(p, ctx, key)
							time.Sleep(delay + 300*time.Millisecond)
							cancel()
						}
						cancelled := time.Now()
						res := aqRecv(t, ch, 5*time.Second, moment)
						require.ErrorIs(t, res.err, context.Canceled, moment)
						took := res.at.Sub(cancelled)
						bound := 200 * time.Millisecond
						if moment == "in flight" {
							bound += delay // the reply is waited for
						}
						require.Less(t, took, bound+time.Second, "%s: Acquire took %v to return once cancelled", moment, took)
						// The give-back (by the pool, or reserve's) is in.
						require.Eventually(t, func() bool { return pool.Owing(p) == 0 }, 5*time.Second, 5*time.Millisecond)
						time.Sleep(2*delay + 100*time.Millisecond)
						p1 := aqProbe(t, r, key, limits)
						got := p1.At.Sub(p0.At)
						t.Logf("%s: returned %v after cancel; P1 %v after P0", moment, took.Round(time.Millisecond), got)
						require.LessOrEqual(t, got, lim.Interval(), "%s: the caller never acted, yet its room did not come back", moment)
					}
				})
			}
		}
	}
}

// TestReviewAQCancelAtSlot: an Acquire caller whose context ends right
// at its slot, at offsets around it. Either it acted (Acquire returned
// nil) or it did not (context.Canceled), and the key must say the same:
// P0 acts at T, the caller's slot is T+I (I = 300 ms, no burst); a probe
// P1 right after the caller is done finds P1.At = T+2I iff the caller
// acted, and no later than T+I (or now) if it did not. Acted or not,
// nothing lets a request through early.
func TestReviewAQCancelAtSlot(t *testing.T) {
	t.Parallel()
	lim := throttle.Every(300*time.Millisecond, 1, 0)
	for _, leases := range []int{0, 8} {
		t.Run(fmt.Sprintf("lease=%v", leases > 0), func(t *testing.T) {
			t.Parallel()
			r := aqRig(t, "aqatslot", lim)
			p := newTradePool(t, r, leases)
			r.proxy.SetReplyDelay(5 * time.Millisecond)
			bg := context.Background()
			I := lim.Interval()
			acted, not := 0, 0
			for i, off := range []time.Duration{-20, -5, -1, 0, 2, 4, 5, 6, 7, 8, 10, 20} {
				off *= time.Millisecond
				key := fmt.Sprintf("k%d", i)
				p0 := aqProbe(t, r, key, []throttle.Limit{lim})
				ctx, cancel := context.WithCancel(bg)
				// The caller's slot on the local clock: P0's At plus I
				// (Redis runs on this host, on the same clock).
				stop := time.AfterFunc(time.Until(p0.At.Add(I+off)), cancel)
				res := aqRecv(t, aqAcquire(p, ctx, key), 5*time.Second, "at slot")
				stop.Stop()
				cancel()
				require.Eventually(t, func() bool { return pool.Owing(p) == 0 }, 5*time.Second, 5*time.Millisecond)
				time.Sleep(50 * time.Millisecond)
				p1 := aqProbe(t, r, key, []throttle.Limit{lim})
				got := p1.At.Sub(p0.At)
				switch {
				case res.err == nil:
					acted++
					require.Equal(t, 2*I, got, "offset %v: the caller acted, P1 must come I after its slot", off)
				default:
					not++
					require.ErrorIs(t, res.err, context.Canceled)
					require.Less(t, got, 2*I, "offset %v: the caller did not act, yet its room did not come back", off)
				}
			}
			t.Logf("acted %d, cancelled %d", acted, not)
		})
	}
}

// TestReviewAQClosedJobUnderCaller: a job J booked at T+I, then an
// Acquire caller A booked at T+2I (sleeping), on a key where the first
// Acquire acted at T (I = 10 s, no burst). Close: J, booked and not
// started, goes back (ErrClosed); A's booking stands on J's and is
// wanted, so J's is owed and the dispatcher returns. Then A's context
// ends: A gives its own booking back itself (the dispatcher has
// returned), and nothing gives back J's, now the key's top. Textbook
// GCRA: only the first Acquire acted, at T: a probe right after waits I at
// most. Open (no Close) the pool gives both back in order: the control.
//
// FAILED (closed) on b486a50: J's room was lost: the probe waited about 2I.
// Now Close ends A (ErrClosed) and gives both bookings back, A's first.
func TestReviewAQClosedJobUnderCaller(t *testing.T) {
	t.Parallel()
	lim := throttle.PerMinute(6, 0)
	for _, closed := range []bool{false, true} {
		t.Run(fmt.Sprintf("closed=%v", closed), func(t *testing.T) {
			t.Parallel()
			r := aqRig(t, "aqclosedjob", lim)
			p := newTradePool(t, r, 0)
			bg := context.Background()
			key := "k"
			release, err := p.Acquire(bg, key) // acts at once
			require.NoError(t, err)
			release()
			jctx, jcancel := context.WithCancel(bg)
			defer jcancel()
			j, err := p.Submit(jctx, key, fgNop) // T+I
			require.NoError(t, err)
			require.Eventually(t, func() bool { return pool.Booked(p) == 1 }, 5*time.Second, 5*time.Millisecond)
			actx, acancel := context.WithCancel(bg)
			defer acancel()
			ach := aqAcquire(p, actx, key) // T+2I, sleeps
			time.Sleep(300 * time.Millisecond)
			if closed {
				require.NoError(t, aqClose(t, p, 5*time.Second))
				require.ErrorIs(t, j.Wait(bg), pool.ErrClosed)
			} else {
				jcancel()
				require.ErrorIs(t, j.Wait(bg), context.Canceled)
				time.Sleep(100 * time.Millisecond) // J's booking owed, under A's
			}
			if closed {
				require.ErrorIs(t, aqRecv(t, ach, 5*time.Second, "A").err, pool.ErrClosed, "Close ends a sleeping caller")
			} else {
				acancel()
				require.ErrorIs(t, aqRecv(t, ach, 5*time.Second, "A").err, context.Canceled)
			}
			for i := 0; i < 200 && pool.Owing(p) > 0; i++ {
				time.Sleep(10 * time.Millisecond)
			}
			owing := pool.Owing(p) // closed: J's booking stays owed, the dispatcher gone
			time.Sleep(100 * time.Millisecond)
			pb := r.probeBook(t, key)
			require.LessOrEqual(t, pb.Wait, lim.Interval(), "no one acted after the first Acquire, yet room was lost (still owed: %d)", owing)
		})
	}
}

// TestReviewAQClosedCallersEarliestFirst: two Acquire callers sleeping,
// A1 at T+I and A2 at T+2I (the first Acquire acted at T; I = 10 s).
// The pool is closed (its dispatcher returns: nothing of its own is
// booked), then A1's context ends, then A2's. Open, A1's booking is owed
// under A2's and both go back in order (the control). Closed, each caller
// gives its own back itself, A1's first, while A2's stands on it: nothing.
// Textbook GCRA: only the first Acquire acted: a probe waits I at most.
//
// FAILED (closed) on b486a50: A1's room was lost: the probe waited about
// 2I. Now Close ends both callers (ErrClosed) and gives their bookings
// back, the latest first.
func TestReviewAQClosedCallersEarliestFirst(t *testing.T) {
	t.Parallel()
	lim := throttle.PerMinute(6, 0)
	for _, closed := range []bool{false, true} {
		t.Run(fmt.Sprintf("closed=%v", closed), func(t *testing.T) {
			t.Parallel()
			r := aqRig(t, "aqclosedcallers", lim)
			p := newTradePool(t, r, 0)
			bg := context.Background()
			key := "k"
			release, err := p.Acquire(bg, key)
			require.NoError(t, err)
			release()
			ctx1, cancel1 := context.WithCancel(bg)
			defer cancel1()
			ch1 := aqAcquire(p, ctx1, key)
			time.Sleep(200 * time.Millisecond)
			ctx2, cancel2 := context.WithCancel(bg)
			defer cancel2()
			ch2 := aqAcquire(p, ctx2, key)
			time.Sleep(200 * time.Millisecond)
			if closed {
				require.NoError(t, aqClose(t, p, 5*time.Second))
				require.ErrorIs(t, aqRecv(t, ch1, 5*time.Second, "A1").err, pool.ErrClosed)
				require.ErrorIs(t, aqRecv(t, ch2, 5*time.Second, "A2").err, pool.ErrClosed)
			} else {
				cancel1()
				require.ErrorIs(t, aqRecv(t, ch1, 5*time.Second, "A1").err, context.Canceled)
				time.Sleep(100 * time.Millisecond)
				cancel2()
				require.ErrorIs(t, aqRecv(t, ch2, 5*time.Second, "A2").err, context.Canceled)
			}
			require.Eventually(t, func() bool { return pool.Owing(p) == 0 }, 5*time.Second, 5*time.Millisecond)
			time.Sleep(100 * time.Millisecond)
			pb := r.probeBook(t, key)
			require.LessOrEqual(t, pb.Wait, lim.Interval(), "no one acted after the first Acquire, yet room was lost")
		})
	}
}

// TestReviewAQBatchLateUnderCallerNoLease: without WithLease, an Acquire
// caller's Reserve and a one-job batch of the pool merge in one Redis call
// (throttle.WithMergeAt(1), a call of another key in flight, and a merge
// wait long enough for both to join). Within a burst both get the same
// slot; J, the job, is booked first and refused late (its deadline
// passes while the reply is out: held for the pool); A, the caller,
// acts at once, on top of J's booking. The two replies come at once; the
// pool's goroutine may look at J's after A has acted (here held back
// until then with SetAfterReply, as TestLeaseLateRefusalUnderAcquireOfSameSlot
// does). With WithLease a record of A's booking goes in stood for that
// case; without, none does (stood is kept only while lease calls are
// aloft), so J's held booking is given back under A's, for nothing.
// Textbook GCRA: only X (another key) and A acted on a key with room for
// two at once: a probe straight in Redis right after finds room at once.
//
// FAILED (lease=false) on b486a50: J's held room was lost (the probe waited I).
func TestReviewAQBatchLateUnderCallerNoLease(t *testing.T) {
	t.Parallel()
	lim := throttle.PerMinute(6, 1) // I = 10 s, room for two at once
	for _, leases := range []int{0, 64} {
		t.Run(fmt.Sprintf("lease=%v", leases > 0), func(t *testing.T) {
			t.Parallel()
			r := aqRig(t, "aqbatchlate", lim, throttle.WithMergeAt(1), throttle.WithMergeWait(100*time.Millisecond))
			p := newTradePool(t, r, leases)
			var mu sync.Mutex
			held := map[string]chan struct{}{}
			pool.SetAfterReply(p, func(ctx context.Context) {
				if k, ok := ctx.Value(aqHoldKey{}).(string); ok {
					mu.Lock()
					c := held[k]
					mu.Unlock()
					<-c
				}
			})
			const D = 400 * time.Millisecond
			r.proxy.SetReplyDelay(D)
			bg := context.Background()
			met, lost := 0, 0
			for trial := 0; trial < 4 && met < 2; trial++ {
				key := fmt.Sprintf("k%d", trial)
				c := make(chan struct{})
				mu.Lock()
				held[key] = c
				mu.Unlock()
				x, err := p.Submit(bg, "x"+key, fgNop) // flies alone, holding the one flight token
				require.NoError(t, err)
				r.awaitFlying(t, "x"+key) // X's call in flight: J and A merge
				// J waits for the merge (up to 100 ms), then D for its
				// reply: its deadline passes meanwhile.
				jctx, jcancel := context.WithTimeout(context.WithValue(bg, aqHoldKey{}, key), 300*time.Millisecond)
				j, err := p.Submit(jctx, key, fgNop)
				require.NoError(t, err)
				time.Sleep(30 * time.Millisecond) // J joined the merge first
				ares := aqRecv(t, aqAcquire(p, bg, key), 10*time.Second, "A")
				close(c) // A has acted: J's reply is looked at now
				require.NoError(t, ares.err)
				wctx, wcancel := context.WithTimeout(bg, 20*time.Second)
				_ = j.Wait(wctx)
				require.NoError(t, x.Wait(wctx))
				require.NoError(t, p.Wait(wctx))
				wcancel()
				jcancel()
				require.Eventually(t, func() bool { return pool.Owing(p) == 0 }, 5*time.Second, 5*time.Millisecond)
				time.Sleep(2*D + 200*time.Millisecond) // a give-back's reply is in
				if !hoLate(j) {
					t.Logf("trial %d: premise not met (J err %v)", trial, j.Err())
					continue
				}
				// J under A: J's booking was the first on the empty key,
				// so its units stand one interval past its slot (two
				// over A).
				lb := j.Reservation().Booking()
				if lb.End().Sub(lb.At) >= lim.Interval()*3/2 {
					t.Logf("trial %d: premise not met: J over A", trial)
					continue
				}
				met++
				pb := r.probeBook(t, key)
				if pb.Wait > 0 {
					lost++
					t.Logf("trial %d: J's held room did not come back: the probe waits %v", trial, pb.Wait)
				}
			}
			require.Positive(t, met, "no trial met the premise (J refused late, under A)")
			require.Zero(t, lost, "a late refusal's held booking under an Acquire caller of the same slot that acted before its reply was looked at: its room was lost (%d of %d)", lost, met)
		})
	}
}

// TestReviewAQLeaseCallerGoneUnderJob: with WithLease a job's booking call
// does not wait for an Acquire caller's of the same key (the pool only
// holds its own give-backs while the caller's is out). A's call goes
// first; J's, sent while A's is out, is booked on top of it in Redis. A's
// context ends while its call is out: Reserve gives A's booking back
// itself (the pool never sees it: not held), under J's, for nothing.
// Then J is cancelled and the pool gives J's back. Textbook GCRA: no one
// acted on the key (I = 10 s, no burst): a probe right after finds room
// at once. Without WithLease the pool books no batch of the key while the
// caller's call is out (the control).
//
// FAILED (lease=true) on b486a50: A's room was lost (the probe waited about I).
func TestReviewAQLeaseCallerGoneUnderJob(t *testing.T) {
	t.Parallel()
	lim := throttle.PerMinute(6, 0)
	for _, leases := range []int{0, 64} {
		t.Run(fmt.Sprintf("lease=%v", leases > 0), func(t *testing.T) {
			t.Parallel()
			r := aqRig(t, "aqgoneunder", lim)
			p := newTradePool(t, r, leases)
			const D = 400 * time.Millisecond
			r.proxy.SetReplyDelay(D)
			bg := context.Background()
			key := "k"
			actx, acancel := context.WithCancel(bg)
			defer acancel()
			ach := aqAcquire(p, actx, key) // a lease first (straight to Redis), then the call
			time.Sleep(100 * time.Millisecond)
			jctx, jcancel := context.WithCancel(bg)
			defer jcancel()
			j, err := p.Submit(jctx, key, fgNop)
			require.NoError(t, err)
			time.Sleep(100 * time.Millisecond) // J's call sent (with a lease), or J waits for A's
			acancel()
			require.ErrorIs(t, aqRecv(t, ach, 5*time.Second, "A").err, context.Canceled)
			// J is booked (on top of A's booking: 10 s on), or, booked
			// after A's went back, has run at once.
			require.Eventually(t, func() bool {
				select {
				case <-j.Done():
					return true
				default:
					return pool.Booked(p) == 1
				}
			}, 5*time.Second, 5*time.Millisecond, "J booked or done")
			jcancel()
			jerr := j.Wait(bg)
			require.Eventually(t, func() bool { return pool.Owing(p) == 0 }, 5*time.Second, 5*time.Millisecond)
			time.Sleep(2*D + 100*time.Millisecond)
			pb := r.probeBook(t, key)
			if jr := j.Reservation(); jr != nil {
				t.Logf("J: %v; J at %v (wait %v), started %v; probe waits %v", jerr, jr.Booking().At, jr.Booking().Wait, j.Started(), pb.Wait)
			} else {
				t.Logf("J: %v; probe waits %v", jerr, pb.Wait)
			}
			if jerr == nil { // J acted, at its slot: the probe waits an interval at most
				require.LessOrEqual(t, pb.Wait, lim.Interval())
				return
			}
			require.ErrorIs(t, jerr, context.Canceled)
			require.Zero(t, pb.Wait, "no one acted on the key, yet a probe waits: the caller's room was lost")
		})
	}
}

// TestReviewAQCallerOvertakesGiveBack: the pool's own batches (and lease
// goroutines) wait for its give-backs of a key to reach Redis before they
// book the key again (giving); an Acquire caller's Reserve does not. J,
// booked at T+I (the first Acquire acted at T; I = 10 s), is cancelled:
// the pool gives its booking back, but the give-back's request is slow on
// the wire (its connection's latency 300 ms) while A's Reserve, sent
// after it on another connection, is not: A is booked on top of J's
// booking, and the give-back then gives nothing. A's context ends while
// it sleeps: its booking goes back. Textbook GCRA: only the first Acquire
// acted: a probe right after waits I at most.
//
// FAILED on b486a50: J's room was lost (the probe waited about 2I).
func TestReviewAQCallerOvertakesGiveBack(t *testing.T) {
	t.Parallel()
	lim := throttle.PerMinute(6, 0)
	for _, leases := range []int{0, 64} {
		t.Run(fmt.Sprintf("lease=%v", leases > 0), func(t *testing.T) {
			t.Parallel()
			r := aqRig(t, "aqovertake", lim)
			p := newTradePool(t, r, leases)
			bg := context.Background()
			key := "k"
			release, err := p.Acquire(bg, key)
			require.NoError(t, err)
			release()
			jctx, jcancel := context.WithCancel(bg)
			defer jcancel()
			j, err := p.Submit(jctx, key, fgNop)
			require.NoError(t, err)
			require.Eventually(t, func() bool { return pool.Booked(p) == 1 }, 5*time.Second, 5*time.Millisecond)
			r.proxy.SetLatency(300 * time.Millisecond)
			jcancel()
			require.Eventually(t, func() bool { return pool.Owing(p) > 0 }, 5*time.Second, time.Millisecond, "J's give-back under way")
			time.Sleep(60 * time.Millisecond) // its request is on the wire, held 300 ms
			r.proxy.SetLatency(0)
			actx, acancel := context.WithCancel(bg)
			defer acancel()
			ach := aqAcquire(p, actx, key)
			time.Sleep(200 * time.Millisecond) // A booked, sleeping
			require.ErrorIs(t, j.Wait(bg), context.Canceled)
			require.Eventually(t, func() bool { return pool.Owing(p) == 0 }, 5*time.Second, 5*time.Millisecond)
			acancel()
			require.ErrorIs(t, aqRecv(t, ach, 5*time.Second, "A").err, context.Canceled)
			require.Eventually(t, func() bool { return pool.Owing(p) == 0 }, 5*time.Second, 5*time.Millisecond)
			time.Sleep(200 * time.Millisecond)
			pb := r.probeBook(t, key)
			require.LessOrEqual(t, pb.Wait, lim.Interval(), "only the first Acquire acted, yet room was lost")
		})
	}
}

// TestReviewAQCloseWaitsForCallersCall: since b486a50 Close waits for an
// Acquire caller's booking call in flight (up to the engine's timeout), so
// that what it books is given back in order with the rest. On b486a50
// helper-95 proved that Close(ctx of 1 s) with replies 2 s late returned
// context.DeadlineExceeded, against the docs of then; b714773 stopped the
// wait, and helper-96 proved that the bookings of calls landing after the
// dispatcher had returned then went back out of order
// (TestReviewCLCloseTwoCallsInFlight). Now the docs say Close waits for
// callers' calls: it returns once the reply is in, the caller gets
// ErrClosed, and its booking is given back. Textbook GCRA: no one acted on
// the key: a probe books at once.
func TestReviewAQCloseWaitsForCallersCall(t *testing.T) {
	t.Parallel()
	r := aqRig(t, "aqclosewait", throttle.PerMinute(6, 0))
	p := newTradePool(t, r, 0)
	bg := context.Background()
	r.proxy.SetReplyDelay(2 * time.Second)
	ach := aqAcquire(p, bg, "k")
	time.Sleep(100 * time.Millisecond) // A's call out
	start := time.Now()
	err := aqClose(t, p, 10*time.Second)
	took := time.Since(start)
	res := aqRecv(t, ach, 10*time.Second, "A")
	t.Logf("Close took %v (%v); A: %v", took.Round(time.Millisecond), err, res.err)
	require.NoError(t, err)
	require.ErrorIs(t, res.err, pool.ErrClosed)
	require.Zero(t, pool.Owing(p))
	require.Zero(t, r.probeBook(t, "k").Wait, "the caller's booking was not given back")
}

// TestReviewAQRedisAway: with the proxy severed or closed (Redis away),
// an Acquire fails (no fallback) and gives its worker back; Close returns;
// nothing hangs. Then with Redis reachable again a caller cancelled while
// it sleeps gives its room back.
func TestReviewAQRedisAway(t *testing.T) {
	t.Parallel()
	lim := throttle.PerMinute(6, 0)
	r := aqRig(t, "aqaway", lim)
	p := newTradePool(t, r, 0)
	bg := context.Background()
	r.proxy.SetReplyDelay(300 * time.Millisecond)
	ach := aqAcquire(p, bg, "k")
	time.Sleep(100 * time.Millisecond)
	r.proxy.Sever() // the reply in flight is lost
	res := aqRecv(t, ach, 15*time.Second, "severed")
	require.Error(t, res.err)
	t.Logf("severed: %v", res.err)
	r.proxy.SetReplyDelay(0)
	require.Eventually(t, func() bool { // the breaker closes again
		res, err := r.lim.Reserve(bg, "warm")
		return err == nil && res.OK()
	}, 15*time.Second, 50*time.Millisecond)
	// A lost reply may have booked: nothing is given back for it. A fresh
	// key from here.
	p0 := aqProbe(t, r, "k2", []throttle.Limit{lim})
	actx, acancel := context.WithCancel(bg)
	ach = aqAcquire(p, actx, "k2")
	time.Sleep(200 * time.Millisecond)
	acancel()
	require.ErrorIs(t, aqRecv(t, ach, 5*time.Second, "k2").err, context.Canceled)
	require.Eventually(t, func() bool { return pool.Owing(p) == 0 }, 5*time.Second, 5*time.Millisecond)
	time.Sleep(50 * time.Millisecond)
	p1 := aqProbe(t, r, "k2", []throttle.Limit{lim})
	require.LessOrEqual(t, p1.At.Sub(p0.At), lim.Interval())
	require.NoError(t, aqClose(t, p, 5*time.Second))
	_, err := p.Acquire(bg, "k3")
	require.ErrorIs(t, err, pool.ErrClosed)
}

// aqAct is one act that happened on the key: a job's start or an Acquire
// caller's return, on the local clock (Redis runs on this host).
type aqAct struct {
	at   time.Time
	what string
}

// TestReviewAQMixedNoEarly: a seeded random mix on one key of Submit'd
// jobs and Acquire callers, each cancelled at a random moment (or not),
// with and without WithLease, at 40 ms of reply latency, some jobs
// refused late (deadlines inside the latency). Limit: 1 per 150 ms,
// burst 1. Textbook GCRA with the acts that happened: for any two acts
// k < m (sorted by time), t_m - t_k >= (m-k-1)*I less the slack of the
// local act times (a reply's latency: 40 ms, plus scheduling). And the
// key's final state: a probe straight in Redis once everything is done
// and given back must find no more than the textbook replay of the acts
// leaves (room lost is logged only: see the comment there). Close
// and Wait return; no goroutine is left.
func TestReviewAQMixedNoEarly(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		D, I, gap time.Duration
		n         int
	}{{40 * time.Millisecond, 150 * time.Millisecond, 60 * time.Millisecond, 40}, {400 * time.Millisecond, 600 * time.Millisecond, 250 * time.Millisecond, 16}} {
		for _, leases := range []int{0, 64} {
			t.Run(fmt.Sprintf("delay=%v/lease=%v", tc.D, leases > 0), func(t *testing.T) {
				t.Parallel()
				lim := throttle.Every(tc.I, 1, 1)
				I := lim.Interval()
				scale := tc.D / (40 * time.Millisecond)
				seed := uint64(time.Now().UnixNano())
				t.Logf("seed %d", seed)
				rng := rand.New(rand.NewPCG(seed, 95))
				r := aqRig(t, "aqmixed", lim)
				p := newTradePool(t, r, leases)
				D := tc.D
				r.proxy.SetReplyDelay(D)
				bg := context.Background()
				key := "k"
				var mu sync.Mutex
				var acts []aqAct
				var wg sync.WaitGroup
				for i := range tc.n {
					kind := rng.IntN(3)
					if aqNoCallers && kind == 0 {
						kind = 1
					}
					cancelAfter := time.Duration(-1)
					if rng.IntN(2) == 0 {
						cancelAfter = time.Duration(rng.IntN(400)) * time.Millisecond * scale
					}
					var ctx context.Context
					var cancel context.CancelFunc
					if kind == 2 { // a job whose deadline falls in the reply's latency, or just after
						ctx, cancel = context.WithTimeout(bg, time.Duration(20+rng.IntN(80))*time.Millisecond*scale)
					} else {
						ctx, cancel = context.WithCancel(bg)
					}
					if cancelAfter >= 0 {
						time.AfterFunc(cancelAfter, cancel)
					}
					switch kind {
					case 0: // an Acquire caller
						wg.Add(1)
						go func() {
							defer wg.Done()
							defer cancel()
							release, err := p.Acquire(ctx, key)
							if err == nil {
								mu.Lock()
								acts = append(acts, aqAct{time.Now(), fmt.Sprintf("caller %d", i)})
								mu.Unlock()
								release()
							}
						}()
					default:
						j, err := p.Submit(ctx, key, func(context.Context) error {
							mu.Lock()
							acts = append(acts, aqAct{time.Now(), fmt.Sprintf("job %d", i)})
							mu.Unlock()
							return nil
						})
						if err != nil && ctx.Err() != nil {
							// Its cancel (a few ms on) or deadline came before
							// Submit on a busy machine (CI, stop 49): Submit
							// refuses an ended context, and nothing is queued.
							require.ErrorIs(t, err, ctx.Err())
							cancel()
							break
						}
						require.NoError(t, err)
						wg.Add(1)
						go func() { defer wg.Done(); <-j.Done(); cancel() }()
					}
					time.Sleep(time.Duration(rng.Int64N(int64(tc.gap))))
				}
				done := make(chan struct{})
				go func() { wg.Wait(); close(done) }()
				select {
				case <-done:
				case <-time.After(60 * time.Second):
					t.Fatal("callers and jobs did not finish")
				}
				wctx, wcancel := context.WithTimeout(bg, 10*time.Second)
				require.NoError(t, p.Wait(wctx))
				wcancel()
				require.Eventually(t, func() bool { return pool.Owing(p) == 0 }, 10*time.Second, 5*time.Millisecond)
				time.Sleep(2*D + 100*time.Millisecond)
				probeNow := time.Now()
				probeAt := aqProbe(t, r, key, []throttle.Limit{lim}).At

				slices.SortFunc(acts, func(a, b aqAct) int { return a.at.Compare(b.at) })
				slack := D + 15*time.Millisecond
				for k := range acts {
					for m := k + 1; m < len(acts); m++ {
						need := time.Duration(m-k-lim.Burst) * I
						require.GreaterOrEqual(t, acts[m].at.Sub(acts[k].at), need-slack,
							"%s and %s: %d acts in %v (the limit lets %d)", acts[k].what, acts[m].what, m-k+1, acts[m].at.Sub(acts[k].at), lim.Burst+1)
					}
				}
				// Textbook replay of the acts (each at its local time, the
				// latest the Redis clock could have been), then of the probe.
				var tat time.Time
				tau := time.Duration(lim.Burst) * I
				for _, a := range acts {
					tat = later(tat, a.at).Add(I)
				}
				// The probe, booked at its own now (no later than probeAt's
				// call), is allowed at tat-tau at the earliest.
				allowed := later(tat.Add(-tau), probeNow)
				lost := probeAt.Sub(allowed)
				t.Logf("%d acts; probe at %v past the textbook's earliest", len(acts), lost.Round(time.Millisecond))
				if lost > slack {
					// Not failed on: the findings proven above lost room at
					// random here on b486a50 (with AQ_NOCALLERS=1, jobs only,
					// none was lost in 20 runs; with callers, about one run
					// in five). With their fixes none was lost in 16 runs;
					// a late refusal whose slot has come under a runner of
					// a later slot still may (a documented limit).
					t.Logf("ROOM LOST: the probe came %v after the textbook replay of the %d acts allows", lost, len(acts))
				}
				require.NoError(t, aqClose(t, p, 10*time.Second))
			})
		}
	}
}

func later(a, b time.Time) time.Time {
	if a.After(b) {
		return a
	}
	return b
}

// TestReviewAQCloseRace: Close runs while Acquire callers of one key are
// at every stage (waiting for a worker, call out, sleeping) and some are
// cancelled around it. Nothing hangs: Close, every Acquire, Wait return;
// callers get nil, ErrClosed, or their context's error; after they are all
// done no goroutine of theirs or the pool's is left (beyond the rig's).
func TestReviewAQCloseRace(t *testing.T) {
	t.Parallel()
	lim := throttle.Every(100*time.Millisecond, 1, 2)
	for _, leases := range []int{0, 4} {
		t.Run(fmt.Sprintf("lease=%v", leases > 0), func(t *testing.T) {
			t.Parallel()
			seed := uint64(time.Now().UnixNano())
			t.Logf("seed %d", seed)
			rng := rand.New(rand.NewPCG(seed, 96))
			r := aqRig(t, "aqcloserace", lim)
			p := newTradePool(t, r, leases)
			r.proxy.SetReplyDelay(40 * time.Millisecond)
			bg := context.Background()
			var wg sync.WaitGroup
			errs := make(chan error, 64)
			for i := range 40 {
				ctx, cancel := context.WithCancel(bg)
				if rng.IntN(3) == 0 {
					time.AfterFunc(time.Duration(rng.IntN(300))*time.Millisecond, cancel)
				}
				hold := time.Duration(rng.IntN(20)) * time.Millisecond
				wg.Add(1)
				go func() {
					defer wg.Done()
					defer cancel()
					release, err := p.Acquire(ctx, fmt.Sprintf("k%d", i%3))
					if err == nil {
						time.Sleep(hold)
						release()
						release()
					}
					errs <- err
				}()
				if i%5 == 0 {
					_, _ = p.Submit(ctx, fmt.Sprintf("k%d", i%3), fgNop)
				}
				if i == 25 {
					go func() { _ = aqClose(t, p, 10*time.Second) }()
				}
				time.Sleep(time.Duration(rng.IntN(10)) * time.Millisecond)
			}
			done := make(chan struct{})
			go func() { wg.Wait(); close(done) }()
			select {
			case <-done:
			case <-time.After(30 * time.Second):
				buf := make([]byte, 1<<20)
				t.Fatalf("callers hang:\n%s", buf[:runtime.Stack(buf, true)])
			}
			close(errs)
			count := map[string]int{}
			for err := range errs {
				switch {
				case err == nil:
					count["ok"]++
				case errors.Is(err, pool.ErrClosed):
					count["closed"]++
				case errors.Is(err, context.Canceled):
					count["canceled"]++
				case errors.Is(err, deadline.ErrMaxWaitExceeded), errors.Is(err, deadline.ErrWouldExceedDeadline):
					count["refused"]++
				default:
					t.Errorf("unexpected error: %v", err)
				}
			}
			t.Logf("outcomes: %v", count)
			require.NoError(t, aqClose(t, p, 10*time.Second))
			wctx, wcancel := context.WithTimeout(bg, 5*time.Second)
			require.NoError(t, p.Wait(wctx))
			wcancel()
			// Owed bookings may be left behind for good here: those under a
			// caller still sleeping when the dispatcher returned (see
			// TestReviewAQClosedJobUnderCaller, which proves the loss).
			for i := 0; i < 100 && pool.Owing(p) > 0; i++ {
				time.Sleep(10 * time.Millisecond)
			}
			if n := pool.Owing(p); n > 0 {
				t.Logf("closed pool still owes %d bookings, never to be given back", n)
			}
		})
	}
}

// TestReviewAQHotKeyStarvesJobs: without WithLease the pool books no
// batch of a key while a booking call of the key is in flight, and since
// b486a50 its Acquire callers' calls count as in flight. Callers looping
// on a hot key (Acquire, release, again; the limit roomy, replies 20 ms
// late) keep a call of the key out nearly all the time, and a job
// submitted to the key waits as long as they go on. Control: the callers
// on another key. Both jobs should start within a second (the limit has
// room: 1000/s, burst 50); the callers go on for 4 s.
//
// FAILED (same key) on b486a50: the job did not start while the callers went on.
func TestReviewAQHotKeyStarvesJobs(t *testing.T) {
	t.Parallel()
	for _, same := range []bool{false, true} {
		t.Run(fmt.Sprintf("sameKey=%v", same), func(t *testing.T) {
			t.Parallel()
			r := aqRig(t, "aqstarve", throttle.PerSecond(1000, 50))
			p := newTradePool(t, r, 0)
			r.proxy.SetReplyDelay(20 * time.Millisecond)
			bg := context.Background()
			ckey := "other"
			if same {
				ckey = "hot"
			}
			ctx, stop := context.WithTimeout(bg, 4*time.Second)
			defer stop()
			var wg sync.WaitGroup
			var acts int64
			var mu sync.Mutex
			for range 6 {
				wg.Go(func() {
					for ctx.Err() == nil {
						release, err := p.Acquire(ctx, ckey)
						if err == nil {
							mu.Lock()
							acts++
							mu.Unlock()
							release()
						}
					}
				})
			}
			time.Sleep(300 * time.Millisecond)
			submitted := time.Now()
			j, err := p.Submit(bg, "hot", fgNop)
			require.NoError(t, err)
			require.NoError(t, j.Wait(bg))
			waited := j.Started().Sub(submitted)
			stop()
			wg.Wait()
			t.Logf("callers acted %d times; the job waited %v", acts, waited.Round(time.Millisecond))
			require.Less(t, waited, time.Second, "the job of the key waited while Acquire callers of the key kept calling")
		})
	}
}

// TestReviewAQClosedCancelPrompt: "If ctx ends while Acquire sleeps until
// the slot, Acquire returns ctx's error at once" (Acquire's doc; the
// CHANGELOG: "Acquire returns at once rather than after the give-back").
// Once the pool is closed and its dispatcher has returned, the caller
// gives its booking back itself before it returns: with Redis slow
// (replies 600 ms late) it returns a round trip after its context ends.
// Control: the pool open.
//
// FAILED (closed) on b486a50: Acquire returned about 600 ms after its
// context ended. Now Close itself ends a sleeping caller, with ErrClosed,
// before the give-back: the closed case times Acquire's return from
// Close's start.
func TestReviewAQClosedCancelPrompt(t *testing.T) {
	t.Parallel()
	for _, closed := range []bool{false, true} {
		t.Run(fmt.Sprintf("closed=%v", closed), func(t *testing.T) {
			t.Parallel()
			r := aqRig(t, "aqprompt", throttle.PerMinute(6, 0))
			p := newTradePool(t, r, 0)
			bg := context.Background()
			release, err := p.Acquire(bg, "k")
			require.NoError(t, err)
			release()
			actx, acancel := context.WithCancel(bg)
			defer acancel()
			ach := aqAcquire(p, actx, "k") // sleeps 10 s
			time.Sleep(200 * time.Millisecond)
			r.proxy.SetReplyDelay(600 * time.Millisecond)
			ended := time.Now()
			closing := make(chan error, 1)
			if closed {
				go func() { closing <- aqClose(t, p, 5*time.Second) }()
			} else {
				acancel()
			}
			res := aqRecv(t, ach, 5*time.Second, "A")
			took := res.at.Sub(ended)
			t.Logf("returned %v after its context ended or Close began", took.Round(time.Millisecond))
			if closed {
				require.ErrorIs(t, res.err, pool.ErrClosed)
				require.NoError(t, <-closing)
			} else {
				require.ErrorIs(t, res.err, context.Canceled)
			}
			require.Less(t, took, 300*time.Millisecond, "Acquire did not return at once")
		})
	}
}

// TestReviewAQNoLeak (not parallel: it counts the pool's goroutines):
// Acquire callers cancelled at every stage, with jobs of their key, with
// and without WithLease, then Close: once every caller has returned, no
// goroutine runs pool code.
func TestReviewAQNoLeak(t *testing.T) {
	for _, leases := range []int{0, 4} {
		r := aqRig(t, "aqleak", throttle.Every(200*time.Millisecond, 1, 1))
		p := newTradePool(t, r, leases)
		r.proxy.SetReplyDelay(30 * time.Millisecond)
		bg := context.Background()
		var wg sync.WaitGroup
		for i := range 12 {
			ctx, cancel := context.WithTimeout(bg, time.Duration(10+i*40)*time.Millisecond)
			wg.Go(func() {
				defer cancel()
				if release, err := p.Acquire(ctx, "k"); err == nil {
					release()
				}
			})
			if i%3 == 0 {
				_, err := p.Submit(ctx, "k", fgNop)
				require.NoError(t, err)
			}
		}
		wg.Wait()
		require.NoError(t, aqClose(t, p, 10*time.Second))
		var stacks string
		require.Eventually(t, func() bool {
			buf := make([]byte, 1<<20)
			stacks = string(buf[:runtime.Stack(buf, true)])
			for _, g := range strings.Split(stacks, "\n\n") {
				if strings.Contains(g, "slotbook/pool.(*Pool)") || strings.Contains(g, "slotbook/pool.(*Job)") {
					return false
				}
			}
			return true
		}, 5*time.Second, 20*time.Millisecond, "pool goroutines left (lease=%v)", leases > 0)
	}
}

// aqNoCallers (AQ_NOCALLERS=1) makes TestReviewAQMixedNoEarly submit jobs
// only: a control for where its room is lost.
var aqNoCallers = os.Getenv("AQ_NOCALLERS") != ""

// TestReviewAQCallerGoneUnderCaller: TestReviewAQLeaseCallerGoneUnderJob
// with a second Acquire caller in the job's place, with and without
// WithLease. A1's call goes first; A2's, sent while A1's is out (alone:
// the limiter coalesces only from four callers of a key), is booked on top
// of it in Redis. A1's context ends while its call is out: Reserve gives
// A1's booking back itself, under A2's, for nothing (the pool, which
// holds a late job's booking to give back in order, never sees A1's).
// Then A2's context ends while it sleeps: the pool gives its booking
// back. Textbook GCRA: no one acted on the key (I = 10 s, no burst): a
// probe right after finds room at once.
//
// FAILED (both) on b486a50: A1's room was lost (the probe waited about I).
func TestReviewAQCallerGoneUnderCaller(t *testing.T) {
	t.Parallel()
	lim := throttle.PerMinute(6, 0)
	for _, leases := range []int{0, 64} {
		t.Run(fmt.Sprintf("lease=%v", leases > 0), func(t *testing.T) {
			t.Parallel()
			r := aqRig(t, "aqgonecallers", lim)
			p := newTradePool(t, r, leases)
			const D = 400 * time.Millisecond
			r.proxy.SetReplyDelay(D)
			bg := context.Background()
			key := "k"
			ctx1, cancel1 := context.WithCancel(bg)
			defer cancel1()
			ch1 := aqAcquire(p, ctx1, key)
			time.Sleep(100 * time.Millisecond)
			ctx2, cancel2 := context.WithCancel(bg)
			defer cancel2()
			ch2 := aqAcquire(p, ctx2, key)
			time.Sleep(100 * time.Millisecond) // both calls out, A1's first
			cancel1()
			require.ErrorIs(t, aqRecv(t, ch1, 5*time.Second, "A1").err, context.Canceled)
			time.Sleep(D) // A2 booked, sleeping
			cancel2()
			res2 := aqRecv(t, ch2, 5*time.Second, "A2")
			require.Eventually(t, func() bool { return pool.Owing(p) == 0 }, 5*time.Second, 5*time.Millisecond)
			time.Sleep(2*D + 100*time.Millisecond)
			pb := r.probeBook(t, key)
			t.Logf("A2: %v; probe waits %v", res2.err, pb.Wait)
			if res2.err == nil { // A2 booked after A1's went back, and acted at once
				require.LessOrEqual(t, pb.Wait, lim.Interval())
				return
			}
			require.ErrorIs(t, res2.err, context.Canceled)
			require.Zero(t, pb.Wait, "no one acted on the key, yet a probe waits: A1's room was lost")
		})
	}
}
