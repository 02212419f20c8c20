package pool_test

// Review (helper-96) of b714773: Acquire callers book alone (HoldLate),
// are owed, handed down and traded as jobs are, and Close ends sleeping
// callers. Through the public API plus the test exports (Booked, Owing,
// Callers, Stood). Room is judged on the Redis clock: a probe booked
// straight in Redis (aqProbe) is an act at its Booking().At, and the
// textbook GCRA replay of the acts that happened says where it should
// stand.
//
// Found on b714773 (PROVEN), fixed since (Close's dispatcher now returns
// only once no caller's booking call is out):
//   - TestReviewCLCloseWithCallInFlight/*/closed=true: Close while an
//     Acquire caller's booking call is out, with a booking of its key
//     under it that will not be used (a sleeping caller's, or a booked
//     job's). The key was busy (calling), so the dispatcher owed that
//     booking instead of giving it back, and then returned anyway (its
//     stop condition looked at flying, giving and callers, not calling).
//     The caller's booking landed after, and the caller gave only its
//     own back: the one under it stayed owed for good (Owing stayed 1)
//     and its room was lost (P1 at P0+2I, not P0+I). The open pool
//     (closed=false) gives both back.
//   - TestReviewCLCloseTwoCallsInFlight/*/closed=true: Close while two
//     callers' calls of a key are out: both landed after the dispatcher
//     had returned, and each caller gave its own booking back as its
//     reply landed, the earlier first, while the later stood on it in
//     Redis: the earlier's room was lost (P1 at P0+2I).

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/slotbook/slotbook/deadline"
	"github.com/slotbook/slotbook/internal/redistest"
	"github.com/slotbook/slotbook/lease"
	"github.com/slotbook/slotbook/pool"
	"github.com/slotbook/slotbook/reserve"
	"github.com/slotbook/slotbook/throttle"
)

// clPool is newTradePool with 64 workers: with 16, a pool without leases
// books no more batches once more than 4 jobs are booked and fewer than 12
// workers are free (callers hold theirs), which the chains here reach.
func clPool(t *testing.T, r *fgRig, n int) *pool.Pool {
	t.Helper()
	opts := []pool.Option{pool.WithWorkers(64)}
	if n > 0 {
		eng, err := throttle.New(redistest.Shared(t).Client(t), throttle.WithPrefix(redistest.Prefix(t)), throttle.WithTimeout(5*time.Second))
		require.NoError(t, err)
		require.NoError(t, eng.Load(context.Background()))
		sem, err := lease.New(eng, r.name+"lease", n, lease.WithTTL(time.Minute))
		require.NoError(t, err)
		t.Cleanup(func() { _ = sem.Close(context.Background()) })
		opts = append(opts, pool.WithLease(sem))
	}
	p, err := pool.New(r.lim, opts...)
	require.NoError(t, err)
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		require.NoError(t, p.Close(ctx))
	})
	return p
}

// clNotLost reports whether probe p1 booked no later than allowed (the
// textbook's TAT, less its burst) or its own now on the Redis clock (it
// did not wait).
func clNotLost(p1 throttle.Booking, allowed time.Time) bool {
	return p1.Wait == 0 || !p1.At.After(allowed.Add(time.Millisecond))
}

// clOwingSettles waits (up to within) for p to owe nothing, and returns
// what it still owes.
func clOwingSettles(p *pool.Pool, within time.Duration) int {
	deadline := time.Now().Add(within)
	for time.Now().Before(deadline) && pool.Owing(p) > 0 {
		time.Sleep(10 * time.Millisecond)
	}
	return pool.Owing(p)
}

// TestReviewCLCloseWithCallInFlight: Close while an Acquire caller's
// booking call is out (replies 600 ms late), with a booking of the same
// key under it that will not be used: another caller's, sleeping (A1),
// or a booked job's (J). Close does not wait for the caller's call
// (b714773), and the dispatcher returns once no caller sleeps; but while
// the call is out the key is busy (calling), so the dispatcher owes the
// booking under it rather than give it back, and returns owing it. The
// call then lands: the caller (ErrClosed) gives its own booking back
// itself, and nothing ever gives back the one under it. Textbook GCRA:
// only the probe P0 acted on the key (I = 10 s, no burst): a probe P1
// after everything is done books no later than P0+I. Control (open):
// the same moments with the pool open, the under one cancelled while the
// call is out, then the caller cancelled while it sleeps.
//
// FAILS (closed=true, every under and lease) on b714773: "P1 20s after
// P0; still owed: 1".
func TestReviewCLCloseWithCallInFlight(t *testing.T) {
	t.Parallel()
	lim := throttle.PerMinute(6, 0)
	I := lim.Interval()
	for _, under := range []string{"caller", "job"} {
		for _, leases := range []int{0, 8} {
			for _, closed := range []bool{false, true} {
				t.Run(fmt.Sprintf("under=%s/lease=%v/closed=%v", under, leases > 0, closed), func(t *testing.T) {
					t.Parallel()
					r := aqRig(t, "clclosefly", lim)
					p := newTradePool(t, r, leases)
					bg := context.Background()
					key := "k"
					p0 := aqProbe(t, r, key, []throttle.Limit{lim})
					uctx, ucancel := context.WithCancel(bg)
					defer ucancel()
					var uch <-chan aqResult
					var j *pool.Job
					switch under {
					case "caller":
						uch = aqAcquire(p, uctx, key) // P0+I, sleeps
						require.Eventually(t, func() bool { return pool.Callers(p) == 1 }, 5*time.Second, time.Millisecond)
					case "job":
						var err error
						j, err = p.Submit(uctx, key, fgNop) // P0+I, booked
						require.NoError(t, err)
						require.Eventually(t, func() bool { return pool.Booked(p) == 1 }, 5*time.Second, time.Millisecond)
					}
					const D = 600 * time.Millisecond
					r.proxy.SetReplyDelay(D)
					actx, acancel := context.WithCancel(bg)
					defer acancel()
					ach := aqAcquire(p, actx, key) // P0+2I; its reply D late
					time.Sleep(150 * time.Millisecond)
					if closed {
						require.NoError(t, aqClose(t, p, 5*time.Second))
					} else {
						ucancel()
					}
					switch under {
					case "caller":
						res := aqRecv(t, uch, 5*time.Second, "under")
						if closed {
							require.ErrorIs(t, res.err, pool.ErrClosed)
						} else {
							require.ErrorIs(t, res.err, context.Canceled)
						}
					case "job":
						err := j.Wait(bg)
						if closed {
							require.ErrorIs(t, err, pool.ErrClosed)
						} else {
							require.ErrorIs(t, err, context.Canceled)
						}
					}
					if !closed {
						require.Eventually(t, func() bool { return pool.Callers(p) == 1 }, 5*time.Second, time.Millisecond, "A booked, sleeping")
						acancel()
					}
					res := aqRecv(t, ach, 5*time.Second, "A")
					if closed {
						require.ErrorIs(t, res.err, pool.ErrClosed)
					} else {
						require.ErrorIs(t, res.err, context.Canceled)
					}
					r.proxy.SetReplyDelay(0)
					owing := clOwingSettles(p, 3*time.Second)
					time.Sleep(2*D + 200*time.Millisecond) // every give-back's reply is in
					p1 := aqProbe(t, r, key, []throttle.Limit{lim})
					got := p1.At.Sub(p0.At)
					t.Logf("P1 %v after P0; still owed: %d", got, owing)
					require.LessOrEqual(t, got, I, "only P0 acted on the key, yet room was lost (the pool still owes %d bookings)", owing)
				})
			}
		}
	}
}

// TestReviewCLCloseTwoCallsInFlight: Close while two Acquire callers'
// booking calls of one key are out (A1 sent 100 ms before A2; replies
// 600 ms late). Both land after the dispatcher has returned (it waits for
// no caller's call), so each caller gives its own booking back itself,
// as its reply lands: A1's first, while A2's stands on it in Redis (for
// nothing), then A2's. Textbook GCRA: only P0 acted (I = 10 s, no
// burst): P1 books no later than P0+I. Control (open): both callers
// cancelled while their calls are out: the pool holds and owes both and
// gives them back latest first.
//
// FAILS (closed=true, with and without leases) on b714773: "P1 20s after
// P0; still owed: 0".
func TestReviewCLCloseTwoCallsInFlight(t *testing.T) {
	t.Parallel()
	lim := throttle.PerMinute(6, 0)
	I := lim.Interval()
	for _, leases := range []int{0, 8} {
		for _, closed := range []bool{false, true} {
			t.Run(fmt.Sprintf("lease=%v/closed=%v", leases > 0, closed), func(t *testing.T) {
				t.Parallel()
				r := aqRig(t, "clclosetwo", lim)
				p := newTradePool(t, r, leases)
				bg := context.Background()
				key := "k"
				p0 := aqProbe(t, r, key, []throttle.Limit{lim})
				const D = 600 * time.Millisecond
				r.proxy.SetReplyDelay(D)
				ctx1, cancel1 := context.WithCancel(bg)
				defer cancel1()
				ch1 := aqAcquire(p, ctx1, key)
				time.Sleep(100 * time.Millisecond)
				ctx2, cancel2 := context.WithCancel(bg)
				defer cancel2()
				ch2 := aqAcquire(p, ctx2, key)
				time.Sleep(100 * time.Millisecond) // both calls out, A1's first
				want := pool.ErrClosed
				if closed {
					require.NoError(t, aqClose(t, p, 5*time.Second))
				} else {
					cancel1()
					cancel2()
					want = context.Canceled
				}
				require.ErrorIs(t, aqRecv(t, ch1, 5*time.Second, "A1").err, want)
				require.ErrorIs(t, aqRecv(t, ch2, 5*time.Second, "A2").err, want)
				r.proxy.SetReplyDelay(0)
				owing := clOwingSettles(p, 3*time.Second)
				time.Sleep(2*D + 200*time.Millisecond)
				p1 := aqProbe(t, r, key, []throttle.Limit{lim})
				got := p1.At.Sub(p0.At)
				t.Logf("P1 %v after P0; still owed: %d", got, owing)
				require.LessOrEqual(t, got, I, "no caller acted, yet room was lost")
			})
		}
	}
}

// clEntry is one booking of a hand-down chain: a job or an Acquire
// caller, cancelled (at its place in the cancellation order) or wanted.
type clEntry struct {
	caller bool
	cancel bool
	ctx    context.Context
	stop   context.CancelFunc
	job    *pool.Job
	ch     <-chan aqResult
	acted  time.Time // a job's start (recorded by its function)
}

// TestReviewCLHandDownChains: seeded chains of bookings of one key, jobs
// and Acquire callers mixed, booked one after another (each booked before
// the next is sent) behind a pause, so that they hold the slots P0+I,
// P0+2I, ... (P0: a probe that acts at the pause's end). Some of them, in
// a random order, are cancelled before the first slot. Textbook GCRA: the
// wanted ones (w of them) act, and nothing else does: sorted, the k-th
// act comes no earlier than P0+(k+1)I (nothing early), none acts twice,
// and the key's state after them is P0+(w+1)I: a probe P1 booked right
// after the last act finds exactly that (later: a cancelled slot was left
// unused under a wanted one; earlier: a booking acted on was given back).
// With and without WithLease, at 40 ms and 400 ms of reply latency, one
// limit and two (reserve.WithLimit).
func TestReviewCLHandDownChains(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		D      time.Duration
		layers string // one limit; two, the second roomy; two, the second binding
		trials int
	}{{40 * time.Millisecond, "one", 3}, {40 * time.Millisecond, "roomy", 2}, {40 * time.Millisecond, "binding", 2}, {400 * time.Millisecond, "one", 2}} {
		for _, leases := range []int{0, 8} {
			t.Run(fmt.Sprintf("delay=%v/lease=%v/layers=%s", tc.D, leases > 0, tc.layers), func(t *testing.T) {
				t.Parallel()
				lim := throttle.Every(300*time.Millisecond, 1, 0)
				var second throttle.Limit
				switch tc.layers {
				case "roomy":
					second = throttle.Every(time.Minute, 60, 30)
				case "binding":
					second = lim
					lim = throttle.Every(100*time.Millisecond, 1, 3)
				}
				I := lim.Interval()
				if tc.layers == "binding" {
					I = second.Interval()
				}
				limits := []throttle.Limit{lim}
				r := aqRig(t, "clchain", lim)
				if tc.layers != "one" {
					l2, err := r.lim.With(reserve.WithLimit(second))
					require.NoError(t, err)
					r.lim = l2
					limits = append(limits, second)
				}
				p := clPool(t, r, leases)
				r.proxy.SetReplyDelay(tc.D)
				seed := uint64(time.Now().UnixNano())
				t.Logf("seed %d", seed)
				rng := rand.New(rand.NewPCG(seed, 96))
				bg := context.Background()
				for trial := range tc.trials {
					key := fmt.Sprintf("k%d", trial)
					n := 4 + rng.IntN(3)
					es := make([]*clEntry, n)
					shape := ""
					for i := range es {
						e := &clEntry{caller: rng.IntN(2) == 0, cancel: rng.IntN(5) < 2}
						e.ctx, e.stop = context.WithCancel(bg)
						defer e.stop()
						es[i] = e
					}
					es[rng.IntN(n)].cancel = true
					es[n-1-rng.IntN(2)].cancel = false // a wanted one over a cancelled one, most times
					for _, e := range es {
						c := "J"
						if e.caller {
							c = "A"
						}
						if e.cancel {
							c = strings.ToLower(c)
						}
						shape += c
					}
					require.NoError(t, r.lim.Pause(bg, key, time.Duration(n)*(tc.D+150*time.Millisecond)+400*time.Millisecond))
					p0 := aqProbe(t, r, key, limits)
					var mu sync.Mutex
					for i, e := range es {
						if e.caller {
							before := pool.Callers(p)
							e.ch = aqAcquire(p, e.ctx, key)
							require.Eventually(t, func() bool { return pool.Callers(p) == before+1 }, 5*time.Second, time.Millisecond, "caller %d sleeping", i)
							continue
						}
						before := pool.Booked(p)
						j, err := p.Submit(e.ctx, key, func(context.Context) error {
							mu.Lock()
							e.acted = time.Now()
							mu.Unlock()
							return nil
						})
						require.NoError(t, err)
						e.job = j
						require.Eventually(t, func() bool { return pool.Booked(p) == before+1 }, 5*time.Second, time.Millisecond, "job %d booked", i)
					}
					if !time.Now().Before(p0.At.Add(I / 2)) {
						t.Fatalf("trial %d: the chain was booked too slowly for the premise", trial)
					}
					order := rng.Perm(n)
					for _, i := range order {
						if es[i].cancel {
							es[i].stop()
							time.Sleep(time.Duration(rng.IntN(15)) * time.Millisecond)
						}
					}
					var acts []aqAct
					for i, e := range es {
						var err error
						var at time.Time
						if e.caller {
							res := aqRecv(t, e.ch, 10*time.Second, fmt.Sprintf("caller %d", i))
							err, at = res.err, res.at
						} else {
							wctx, wcancel := context.WithTimeout(bg, 10*time.Second)
							err = e.job.Wait(wctx)
							wcancel()
							mu.Lock()
							at = e.acted
							mu.Unlock()
						}
						if e.cancel {
							require.ErrorIs(t, err, context.Canceled, "trial %d (%s): entry %d, cancelled", trial, shape, i)
							require.True(t, at.IsZero() || e.caller, "trial %d: cancelled job %d ran", trial, i)
							continue
						}
						require.NoError(t, err, "trial %d (%s): entry %d, wanted", trial, shape, i)
						acts = append(acts, aqAct{at, fmt.Sprintf("%d:%c", i, shape[i])})
					}
					slices.SortFunc(acts, func(a, b aqAct) int { return a.at.Compare(b.at) })
					var lateness []string
					for k, a := range acts {
						slot := p0.At.Add(time.Duration(k+1) * I)
						lateness = append(lateness, fmt.Sprintf("%s %+v", a.what, a.at.Sub(slot).Round(time.Millisecond)))
						require.False(t, a.at.Before(slot.Add(-time.Millisecond)), "trial %d (%s): act %d (%s) at %v before its slot P0+%dI (%v early)", trial, shape, k, a.what, a.at, k+1, slot.Sub(a.at))
					}
					require.Eventually(t, func() bool { return pool.Owing(p) == 0 }, 5*time.Second, time.Millisecond)
					probeNow := time.Now()
					p1 := aqProbe(t, r, key, limits)
					want := p0.At.Add(time.Duration(len(acts)+1) * I)
					t.Logf("trial %d: chain %s cancelled in order %v: acts (vs the textbook slot) %v; P1 at P0%+v (textbook P0%+v)", trial, shape, order, lateness, p1.At.Sub(p0.At), want.Sub(p0.At))
					require.False(t, p1.At.Before(want), "trial %d (%s): P1 at P0%+v, before the textbook's P0%+v: a booking acted on went back", trial, shape, p1.At.Sub(p0.At), want.Sub(p0.At))
					require.True(t, clNotLost(p1, want), "trial %d (%s): P1 at P0%+v (booked at P0%+v, wait %v), after the textbook's P0%+v: room lost", trial, shape, p1.At.Sub(p0.At), probeNow.Sub(p0.At), p1.Wait, want.Sub(p0.At))
				}
			})
		}
	}
}

// TestReviewCLCancelAtHandedSlot: J, a job, books P0+I; A, an Acquire
// caller, books P0+2I and sleeps (P0: a probe; I = 300 ms, no burst).
// J is cancelled at once: its slot is handed down to A, which is then
// cancelled itself at an offset around the handed slot (P0+I on the
// local clock; Redis runs on this host). Either A acted (Acquire returned
// nil, no earlier than P0+I), and a probe P1 right after books exactly
// P0+2I; or it did not (context.Canceled), and P1 books no later than
// P0+I (or its own now): both bookings went back. Offsets "both": A is
// cancelled right as J is (before or after it by a millisecond or two,
// at the instant the dispatcher hands J's slot down): A cannot have
// acted, and all room comes back.
func TestReviewCLCancelAtHandedSlot(t *testing.T) {
	t.Parallel()
	lim := throttle.Every(300*time.Millisecond, 1, 0)
	I := lim.Interval()
	for _, leases := range []int{0, 8} {
		t.Run(fmt.Sprintf("lease=%v", leases > 0), func(t *testing.T) {
			t.Parallel()
			r := aqRig(t, "clhanded", lim)
			p := newTradePool(t, r, leases)
			r.proxy.SetReplyDelay(5 * time.Millisecond)
			bg := context.Background()
			limits := []throttle.Limit{lim}
			type tc struct {
				both bool
				off  time.Duration
			}
			var cases []tc
			for _, off := range []time.Duration{-3, -1, 0, 1, 3} {
				cases = append(cases, tc{true, off * time.Millisecond})
			}
			for _, off := range []time.Duration{-20, -5, 0, 3, 5, 6, 7, 8, 10, 15, 30} {
				cases = append(cases, tc{false, off * time.Millisecond})
			}
			acted, not := 0, 0
			for i, c := range cases {
				key := fmt.Sprintf("k%d", i)
				p0 := aqProbe(t, r, key, limits)
				jctx, jcancel := context.WithCancel(bg)
				j, err := p.Submit(jctx, key, fgNop)
				require.NoError(t, err)
				require.Eventually(t, func() bool { return pool.Booked(p) == 1 }, 5*time.Second, time.Millisecond)
				actx, acancel := context.WithCancel(bg)
				ach := aqAcquire(p, actx, key)
				require.Eventually(t, func() bool { return pool.Callers(p) == 1 }, 5*time.Second, time.Millisecond)
				var stop *time.Timer
				if c.both {
					if c.off < 0 {
						acancel()
						time.Sleep(-c.off)
						jcancel()
					} else {
						jcancel()
						time.Sleep(c.off)
						acancel()
					}
				} else {
					jcancel()
					stop = time.AfterFunc(time.Until(p0.At.Add(I+c.off)), acancel)
				}
				require.ErrorIs(t, j.Wait(bg), context.Canceled)
				res := aqRecv(t, ach, 5*time.Second, "A")
				if stop != nil {
					stop.Stop()
				}
				acancel()
				jcancel()
				require.Eventually(t, func() bool { return pool.Owing(p) == 0 }, 5*time.Second, time.Millisecond)
				probeNow := time.Now()
				p1 := aqProbe(t, r, key, limits)
				got := p1.At.Sub(p0.At)
				switch {
				case res.err == nil:
					acted++
					require.False(t, c.both, "both cancelled at once, yet A acted")
					require.False(t, res.at.Before(p0.At.Add(I)), "offset %v: A acted %v before its handed slot", c.off, p0.At.Add(I).Sub(res.at))
					require.Equal(t, 2*I, got, "offset %v: A acted at P0+I (returned at P0%+v): P1 must book P0+2I", c.off, res.at.Sub(p0.At))
				default:
					not++
					require.ErrorIs(t, res.err, context.Canceled)
					require.True(t, clNotLost(p1, p0.At.Add(I)), "both=%v offset %v: A did not act, yet P1 books P0%+v (booked at P0%+v, wait %v; allowed P0+I): room lost", c.both, c.off, got, probeNow.Sub(p0.At), p1.Wait)
				}
			}
			t.Logf("acted %d, not %d", acted, not)
		})
	}
}

// TestReviewCLCancelWaitingForGiveBack: an Acquire caller waits, before
// it books, for the pool's give-back of its key under way (J's, slowed on
// the wire: 300 ms each way). Its context ends (or the pool is closed)
// while it waits: it returns at once (context.Canceled, or ErrClosed),
// having booked nothing. Textbook GCRA: only P0 acted (I = 10 s): P1
// books no later than P0+I.
func TestReviewCLCancelWaitingForGiveBack(t *testing.T) {
	t.Parallel()
	lim := throttle.PerMinute(6, 0)
	I := lim.Interval()
	for _, leases := range []int{0, 8} {
		for _, closed := range []bool{false, true} {
			t.Run(fmt.Sprintf("lease=%v/closed=%v", leases > 0, closed), func(t *testing.T) {
				t.Parallel()
				r := aqRig(t, "clwaitgive", lim)
				p := newTradePool(t, r, leases)
				bg := context.Background()
				key := "k"
				limits := []throttle.Limit{lim}
				p0 := aqProbe(t, r, key, limits)
				jctx, jcancel := context.WithCancel(bg)
				defer jcancel()
				j, err := p.Submit(jctx, key, fgNop)
				require.NoError(t, err)
				require.Eventually(t, func() bool { return pool.Booked(p) == 1 }, 5*time.Second, time.Millisecond)
				r.proxy.SetLatency(300 * time.Millisecond)
				jcancel()
				require.Eventually(t, func() bool { return pool.Owing(p) > 0 }, 5*time.Second, time.Millisecond)
				actx, acancel := context.WithCancel(bg)
				defer acancel()
				ach := aqAcquire(p, actx, key)
				time.Sleep(100 * time.Millisecond) // A waits for J's give-back (600 ms round trip)
				ended := time.Now()
				want := context.Canceled
				if closed {
					want = pool.ErrClosed
					go func() { _ = aqClose(t, p, 5*time.Second) }()
				} else {
					acancel()
				}
				res := aqRecv(t, ach, 5*time.Second, "A")
				took := res.at.Sub(ended)
				require.ErrorIs(t, res.err, want)
				require.Less(t, took, 250*time.Millisecond, "A did not return at once (%v)", took)
				require.ErrorIs(t, j.Wait(bg), context.Canceled)
				r.proxy.SetLatency(0)
				require.Eventually(t, func() bool { return pool.Owing(p) == 0 }, 5*time.Second, time.Millisecond)
				time.Sleep(700 * time.Millisecond)
				p1 := aqProbe(t, r, key, limits)
				t.Logf("A returned %v after; P1 at P0%+v", took.Round(time.Millisecond), p1.At.Sub(p0.At))
				require.LessOrEqual(t, p1.At.Sub(p0.At), I, "only P0 acted, yet room was lost")
			})
		}
	}
}

// TestReviewCLLateHandedUp: L books P0+I but is refused late (its
// deadline, P0+I+200ms, falls before its slot as its reply, 400 ms late,
// tells it: held for the pool, owed); O, sent while L's call is out,
// books P0+2I and waits. L and O are each a job or an Acquire caller.
// L's held slot is handed down to O, which acts in it (no earlier than
// P0+I), and O's own goes back: a probe P1 right after O acted books
// exactly P0+2I (P0+3I: L's slot left unused under O; I = 1 s).
func TestReviewCLLateHandedUp(t *testing.T) {
	t.Parallel()
	lim := throttle.PerSecond(1, 0)
	I := lim.Interval()
	const D = 400 * time.Millisecond
	for _, lk := range []string{"job", "caller"} {
		for _, ok := range []string{"job", "caller"} {
			for _, leases := range []int{0, 8} {
				t.Run(fmt.Sprintf("L=%s/O=%s/lease=%v", lk, ok, leases > 0), func(t *testing.T) {
					t.Parallel()
					r := aqRig(t, "cllate", lim)
					p := newTradePool(t, r, leases)
					bg := context.Background()
					key := "k"
					limits := []throttle.Limit{lim}
					p0 := aqProbe(t, r, key, limits)
					r.proxy.SetReplyDelay(D)
					lctx, lcancel := context.WithDeadline(bg, p0.At.Add(I+200*time.Millisecond))
					defer lcancel()
					var lj *pool.Job
					var lch <-chan aqResult
					if lk == "job" {
						var err error
						lj, err = p.Submit(lctx, key, fgNop)
						require.NoError(t, err)
					} else {
						lch = aqAcquire(p, lctx, key)
					}
					time.Sleep(100 * time.Millisecond)
					var oat time.Time
					var oerr error
					if ok == "job" {
						var mu sync.Mutex
						oj, err := p.Submit(bg, key, func(context.Context) error {
							mu.Lock()
							oat = time.Now()
							mu.Unlock()
							return nil
						})
						require.NoError(t, err)
						wctx, wcancel := context.WithTimeout(bg, 10*time.Second)
						oerr = oj.Wait(wctx)
						wcancel()
						mu.Lock()
						defer mu.Unlock()
					} else {
						res := aqRecv(t, aqAcquire(p, bg, key), 10*time.Second, "O")
						oat, oerr = res.at, res.err
					}
					probeNow := time.Now()
					p1 := aqProbe(t, r, key, limits)
					var lerr error
					if lj != nil {
						lerr = lj.Wait(bg)
					} else {
						lerr = aqRecv(t, lch, 5*time.Second, "L").err
					}
					t.Logf("L: %v; O: %v at P0%+v; P1 at P0%+v (booked at P0%+v)", lerr, oerr, oat.Sub(p0.At), p1.At.Sub(p0.At), probeNow.Sub(p0.At))
					require.ErrorIs(t, lerr, deadline.ErrWouldExceedDeadline, "the premise: L refused late")
					require.NoError(t, oerr)
					require.False(t, oat.Before(p0.At.Add(I)), "O acted before P0+I")
					require.Equal(t, 2*I, p1.At.Sub(p0.At), "L's held slot was not handed down to O")
				})
			}
		}
	}
}

// TestReviewCLStoodBoundedNoLease: since b714773 a pool without leases
// numbers its batches and its Acquire callers' calls aloft and keeps
// stood records of the bookings started on while a call flies. Steady
// load on one hot key: 600 jobs (batches) and 8 callers looping on
// Acquire, replies 2 ms late, so that a call of the key is nearly always
// aloft. The records stay few, and none is left once the load is done.
func TestReviewCLStoodBoundedNoLease(t *testing.T) {
	t.Parallel()
	r := aqRig(t, "clstood", throttle.PerSecond(3000, 40))
	p := newTradePool(t, r, 0)
	r.proxy.SetReplyDelay(2 * time.Millisecond)
	bg := context.Background()
	ctx, cancel := context.WithTimeout(bg, time.Minute)
	defer cancel()
	cctx, cstop := context.WithCancel(ctx)
	var wg sync.WaitGroup
	var mu sync.Mutex
	acts := 0
	for range 8 {
		wg.Go(func() {
			for cctx.Err() == nil {
				release, err := p.Acquire(cctx, "hot")
				if err == nil {
					mu.Lock()
					acts++
					mu.Unlock()
					release()
				}
			}
		})
	}
	js := make([]*pool.Job, 600)
	for i := range js {
		j, err := p.Submit(ctx, "hot", fgNop)
		require.NoError(t, err)
		js[i] = j
	}
	most, aloftSeen := 0, false
	stop, sampled := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(sampled)
		for {
			n, aloft := pool.Stood(p)
			most = max(most, n)
			aloftSeen = aloftSeen || aloft > 0
			select {
			case <-stop:
				return
			case <-time.After(200 * time.Microsecond):
			}
		}
	}()
	require.NoError(t, p.Wait(ctx))
	cstop()
	wg.Wait()
	close(stop)
	<-sampled
	for i, j := range js {
		require.NoError(t, j.Err(), "job %d", i)
	}
	require.True(t, aloftSeen, "the premise: calls aloft")
	n, aloft := pool.Stood(p)
	t.Logf("callers acted %d times; most records at once: %d; left: %d (keys aloft %d)", acts, most, n, aloft)
	require.Zero(t, n, "records left once every call has landed")
	require.Zero(t, aloft)
	require.LessOrEqual(t, most, 200, "records pile up")
	// Callers stopped in flight or asleep: their bookings owed, going back.
	require.Eventually(t, func() bool { return pool.Owing(p) == 0 }, 5*time.Second, time.Millisecond, "owed: %d", pool.Owing(p))
	require.Zero(t, pool.Callers(p))
}

// TestReviewCLRollingCancels: TestReviewCLHandDownChains with the
// cancellations spread over the chain's slots (each at a random time up
// to P0+(n+1)I), so that slots are handed down, or pass, while wanted
// ones act: a cancelled one may have acted already (then it counts as an
// act). Textbook GCRA replay of the acts that happened, at their local
// times (Redis runs on this host; each act comes up to a reply's latency
// after its slot): no two acts k < m are less than (m-k)I apart (no
// burst), less the slack of the latency; and a probe P1 right after the
// last act books no later than the replay's TAT (or its own now), and no
// earlier than the TAT less the slack and 100 ms (well short of I).
func TestReviewCLRollingCancels(t *testing.T) {
	t.Parallel()
	const D = 40 * time.Millisecond
	for _, leases := range []int{0, 8} {
		t.Run(fmt.Sprintf("lease=%v", leases > 0), func(t *testing.T) {
			t.Parallel()
			lim := throttle.Every(300*time.Millisecond, 1, 0)
			I := lim.Interval()
			limits := []throttle.Limit{lim}
			r := aqRig(t, "clrolling", lim)
			p := clPool(t, r, leases)
			r.proxy.SetReplyDelay(D)
			seed := uint64(time.Now().UnixNano())
			t.Logf("seed %d", seed)
			rng := rand.New(rand.NewPCG(seed, 961))
			bg := context.Background()
			slack := D + 15*time.Millisecond
			for trial := range 3 {
				key := fmt.Sprintf("k%d", trial)
				n := 5 + rng.IntN(3)
				es := make([]*clEntry, n)
				shape := ""
				for i := range es {
					e := &clEntry{caller: rng.IntN(2) == 0, cancel: rng.IntN(2) == 0}
					e.ctx, e.stop = context.WithCancel(bg)
					defer e.stop()
					es[i] = e
					c := "J"
					if e.caller {
						c = "A"
					}
					if e.cancel {
						c = strings.ToLower(c)
					}
					shape += c
				}
				require.NoError(t, r.lim.Pause(bg, key, time.Duration(n)*(D+150*time.Millisecond)+400*time.Millisecond))
				p0 := aqProbe(t, r, key, limits)
				var mu sync.Mutex
				for i, e := range es {
					if e.caller {
						before := pool.Callers(p)
						e.ch = aqAcquire(p, e.ctx, key)
						require.Eventually(t, func() bool { return pool.Callers(p) == before+1 }, 5*time.Second, time.Millisecond, "caller %d sleeping", i)
						continue
					}
					before := pool.Booked(p)
					j, err := p.Submit(e.ctx, key, func(context.Context) error {
						mu.Lock()
						e.acted = time.Now()
						mu.Unlock()
						return nil
					})
					require.NoError(t, err)
					e.job = j
					require.Eventually(t, func() bool { return pool.Booked(p) == before+1 }, 5*time.Second, time.Millisecond, "job %d booked", i)
				}
				var cancels []string
				for i, e := range es {
					if e.cancel {
						at := p0.At.Add(time.Duration(rng.Int64N(int64(time.Duration(n+1) * I))))
						time.AfterFunc(time.Until(at), e.stop)
						cancels = append(cancels, fmt.Sprintf("%d@P0%+v", i, at.Sub(p0.At).Round(time.Millisecond)))
					}
				}
				var acts []aqAct
				for i, e := range es {
					var err error
					var at time.Time
					if e.caller {
						res := aqRecv(t, e.ch, 15*time.Second, fmt.Sprintf("caller %d", i))
						err, at = res.err, res.at
					} else {
						wctx, wcancel := context.WithTimeout(bg, 15*time.Second)
						err = e.job.Wait(wctx)
						wcancel()
						mu.Lock()
						at = e.acted
						mu.Unlock()
					}
					if err != nil {
						require.True(t, e.cancel, "trial %d (%s): entry %d, never cancelled: %v", trial, shape, i, err)
						require.ErrorIs(t, err, context.Canceled)
						continue
					}
					acts = append(acts, aqAct{at, fmt.Sprintf("%d:%c", i, shape[i])})
				}
				slices.SortFunc(acts, func(a, b aqAct) int { return a.at.Compare(b.at) })
				for k := range acts {
					require.False(t, acts[k].at.Before(p0.At.Add(I-time.Millisecond)), "trial %d: act %s before the first slot", trial, acts[k].what)
					for m := k + 1; m < len(acts); m++ {
						require.GreaterOrEqual(t, acts[m].at.Sub(acts[k].at), time.Duration(m-k)*I-slack,
							"trial %d (%s; cancels %v): %s and %s: %d acts in %v", trial, shape, cancels, acts[k].what, acts[m].what, m-k+1, acts[m].at.Sub(acts[k].at))
					}
				}
				require.Eventually(t, func() bool { return pool.Owing(p) == 0 }, 5*time.Second, time.Millisecond)
				probeNow := time.Now()
				p1 := aqProbe(t, r, key, limits)
				tat := p0.At.Add(I)
				for _, a := range acts {
					tat = later(tat, a.at).Add(I)
				}
				var what []string
				for _, a := range acts {
					what = append(what, fmt.Sprintf("%s@P0%+v", a.what, a.at.Sub(p0.At).Round(time.Millisecond)))
				}
				t.Logf("trial %d: chain %s, cancels %v: acts %v; P1 at P0%+v, replay's TAT P0%+v", trial, shape, cancels, what, p1.At.Sub(p0.At), tat.Sub(p0.At))
				require.True(t, clNotLost(p1, tat), "trial %d (%s): room lost: P1 at P0%+v (booked at P0%+v, wait %v), the replay allows P0%+v", trial, shape, p1.At.Sub(p0.At), probeNow.Sub(p0.At), p1.Wait, tat.Sub(p0.At))
				// The replay runs on the acts' local times, each a reply's
				// latency and a wake-up after its slot, and one act's
				// lateness carries through the chain to the TAT: on a
				// busy machine a caller woke 21 ms later than the others,
				// and the TAT stood 61 ms past the Redis one. A booking
				// acted on that went back moves P1 a whole I earlier.
				late := slack + 100*time.Millisecond
				require.False(t, p1.At.Before(tat.Add(-late)), "trial %d (%s): P1 at P0%+v, before the replay's TAT P0%+v less %v: a booking acted on went back", trial, shape, p1.At.Sub(p0.At), tat.Sub(p0.At), late)
			}
		})
	}
}

// TestReviewCLCloseManySleeping: on each of three keys, Acquire callers
// and jobs booked one after another (I = 10 s, so none acts), some jobs
// cancelled (their slots handed down to callers above them, or owed);
// then Close, with no call out. Every caller returns ErrClosed at once,
// Close returns, the pool ends owing nothing, and, as only P0 acted on
// each key, a probe P1 books no later than P0+I: every booking went back,
// in an order that gives its room back.
func TestReviewCLCloseManySleeping(t *testing.T) {
	t.Parallel()
	lim := throttle.PerMinute(6, 0)
	I := lim.Interval()
	for _, leases := range []int{0, 8} {
		t.Run(fmt.Sprintf("lease=%v", leases > 0), func(t *testing.T) {
			t.Parallel()
			r := aqRig(t, "clclosemany", lim)
			p := clPool(t, r, leases)
			r.proxy.SetReplyDelay(5 * time.Millisecond)
			seed := uint64(time.Now().UnixNano())
			t.Logf("seed %d", seed)
			rng := rand.New(rand.NewPCG(seed, 962))
			bg := context.Background()
			limits := []throttle.Limit{lim}
			p0 := map[string]throttle.Booking{}
			var chs []<-chan aqResult
			var jobs []*pool.Job
			var cancels []context.CancelFunc
			for k := range 3 {
				key := fmt.Sprintf("k%d", k)
				p0[key] = aqProbe(t, r, key, limits)
				for i := range 4 {
					ctx, cancel := context.WithCancel(bg)
					defer cancel()
					if (i+k)%2 == 0 {
						before := pool.Callers(p)
						chs = append(chs, aqAcquire(p, ctx, key))
						require.Eventually(t, func() bool { return pool.Callers(p) == before+1 }, 5*time.Second, time.Millisecond)
						continue
					}
					before := pool.Booked(p)
					j, err := p.Submit(ctx, key, fgNop)
					require.NoError(t, err)
					jobs = append(jobs, j)
					require.Eventually(t, func() bool { return pool.Booked(p) == before+1 }, 5*time.Second, time.Millisecond)
					if rng.IntN(2) == 0 {
						cancels = append(cancels, cancel)
					}
				}
			}
			for _, c := range cancels {
				c()
			}
			time.Sleep(50 * time.Millisecond) // handed down, or owed
			start := time.Now()
			require.NoError(t, aqClose(t, p, 10*time.Second))
			for i, ch := range chs {
				res := aqRecv(t, ch, 5*time.Second, fmt.Sprintf("caller %d", i))
				require.ErrorIs(t, res.err, pool.ErrClosed)
			}
			t.Logf("Close and callers done in %v", time.Since(start).Round(time.Millisecond))
			for _, j := range jobs {
				err := j.Wait(bg)
				require.True(t, errors.Is(err, pool.ErrClosed) || errors.Is(err, context.Canceled), "job: %v", err)
			}
			require.Zero(t, clOwingSettles(p, 5*time.Second), "a closed pool still owes")
			time.Sleep(100 * time.Millisecond)
			for key, b0 := range p0 {
				p1 := aqProbe(t, r, key, limits)
				require.LessOrEqual(t, p1.At.Sub(b0.At), I, "%s: no one acted after P0, yet room was lost", key)
			}
		})
	}
}

// TestReviewCLLateCallerUnderJobSameSlot: an Acquire caller A, refused
// late (its deadline, 300 ms, falls in the merge wait and the reply's
// 400 ms: its booking held for the pool), and a job J of the same key,
// booked in one merged Redis call (throttle.WithMergeAt(1), X's call of
// another key in flight). Within a burst both get the same slot, and J
// runs at once, on top of A's held booking if Redis booked A first; the
// pool looks at A's reply and J's in either order (A's on the caller's
// goroutine, J's on the batch's or lease goroutine's). Without WithLease
// a record of J's booking is kept only since b714773 (stood). Textbook
// GCRA: only X (another key) and J acted on a key with room for two at
// once: a probe straight in Redis right after finds room at once.
func TestReviewCLLateCallerUnderJobSameSlot(t *testing.T) {
	t.Parallel()
	lim := throttle.PerMinute(6, 1)
	for _, leases := range []int{0, 64} {
		t.Run(fmt.Sprintf("lease=%v", leases > 0), func(t *testing.T) {
			t.Parallel()
			calls := &callCounter{}
			r := aqRig(t, "cllatecaller", lim, throttle.WithMergeAt(1), throttle.WithMergeWait(100*time.Millisecond), throttle.WithObserver(calls))
			p := newTradePool(t, r, leases)
			const D = 400 * time.Millisecond
			r.proxy.SetReplyDelay(D)
			bg := context.Background()
			met, lost := 0, 0
			for trial := 0; trial < 5 && met < 3; trial++ {
				key := fmt.Sprintf("k%d", trial)
				booked0 := calls.booked()
				x, err := p.Submit(bg, "x"+key, fgNop)
				require.NoError(t, err)
				r.awaitFlying(t, "x"+key) // X's call in flight: A and J merge
				actx, acancel := context.WithTimeout(bg, 300*time.Millisecond)
				ach := aqAcquire(p, actx, key)
				time.Sleep(20 * time.Millisecond)
				j, err := p.Submit(bg, key, fgNop)
				require.NoError(t, err)
				ares := aqRecv(t, ach, 10*time.Second, "A")
				wctx, wcancel := context.WithTimeout(bg, 20*time.Second)
				require.NoError(t, j.Wait(wctx))
				require.NoError(t, x.Wait(wctx))
				require.NoError(t, p.Wait(wctx))
				wcancel()
				acancel()
				require.Eventually(t, func() bool { return pool.Owing(p) == 0 }, 5*time.Second, 5*time.Millisecond)
				time.Sleep(2*D + 200*time.Millisecond)
				n := calls.booked() - booked0
				if !errors.Is(ares.err, deadline.ErrWouldExceedDeadline) || n != 2 {
					t.Logf("trial %d: premise not met (A: %v; %d booking calls)", trial, ares.err, n)
					continue
				}
				met++
				pb := r.probeBook(t, key)
				jb := j.Reservation().Booking()
				t.Logf("trial %d: J at %v (its units end %v on), probe waits %v", trial, jb.At.Format("15:04:05.000"), jb.End().Sub(jb.At), pb.Wait)
				if pb.Wait > 0 {
					lost++
				}
			}
			require.Positive(t, met, "no trial met the premise (A refused late, booked in one call with J)")
			require.Zero(t, lost, "A's held room did not come back (%d of %d)", lost, met)
		})
	}
}

// TestReviewCLRedisAwayNoHang: Redis slow, then away, while callers wait
// for their key's give-backs and sleep: J, booked under a sleeping caller
// A1, is cancelled (its slot handed down to A1, the top booking going
// back) with the proxy holding bytes 3 s each way; A2 then waits for that
// give-back; the proxy's connections are severed (the give-back fails).
// Nothing hangs: A2 books once the give-back has ended (or returns an
// error), Close ends the sleeping callers with ErrClosed at once, and
// returns.
func TestReviewCLRedisAwayNoHang(t *testing.T) {
	t.Parallel()
	lim := throttle.PerMinute(6, 0)
	for _, leases := range []int{0, 8} {
		t.Run(fmt.Sprintf("lease=%v", leases > 0), func(t *testing.T) {
			t.Parallel()
			r := aqRig(t, "claway", lim)
			p := newTradePool(t, r, leases)
			bg := context.Background()
			key := "k"
			aqProbe(t, r, key, []throttle.Limit{lim})
			jctx, jcancel := context.WithCancel(bg)
			defer jcancel()
			j, err := p.Submit(jctx, key, fgNop)
			require.NoError(t, err)
			require.Eventually(t, func() bool { return pool.Booked(p) == 1 }, 5*time.Second, time.Millisecond)
			ch1 := aqAcquire(p, bg, key)
			require.Eventually(t, func() bool { return pool.Callers(p) == 1 }, 5*time.Second, time.Millisecond)
			r.proxy.SetLatency(3 * time.Second)
			jcancel()
			require.Eventually(t, func() bool { return pool.Owing(p) > 0 }, 5*time.Second, time.Millisecond, "the top booking going back")
			actx, acancel := context.WithTimeout(bg, 20*time.Second)
			defer acancel()
			ch2 := aqAcquire(p, actx, key)
			time.Sleep(300 * time.Millisecond)
			r.proxy.SetLatency(0)
			r.proxy.Sever()
			// A2 books (or fails) once the give-back has ended: up to its
			// one-second timeout.
			var res2 aqResult
			select {
			case res2 = <-ch2:
				t.Logf("A2 returned before Close: %v", res2.err)
			case <-time.After(3 * time.Second):
				require.Equal(t, 2, pool.Callers(p), "A2 neither returned nor sleeps")
			}
			start := time.Now()
			require.NoError(t, aqClose(t, p, 10*time.Second))
			require.ErrorIs(t, aqRecv(t, ch1, 5*time.Second, "A1").err, pool.ErrClosed)
			if res2 == (aqResult{}) {
				require.ErrorIs(t, aqRecv(t, ch2, 5*time.Second, "A2").err, pool.ErrClosed)
			}
			t.Logf("Close and callers done in %v", time.Since(start).Round(time.Millisecond))
			require.ErrorIs(t, j.Wait(bg), context.Canceled)
			require.Zero(t, clOwingSettles(p, 5*time.Second))
		})
	}
}
