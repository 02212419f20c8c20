package reserve_test

// Second review of 9494129 and b47ae7f (reserve's give-back of a booking
// no one had through throttle.Engine.RefundUnused) through the public API,
// on the Redis clock (Booking().At, Booking().Wait), with replies held
// back by a proxy. The slots that ran are checked against the arrival
// curve (rmaArrivalCurve: at most Burst+1+floor(d/I) units in any window).

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/slotbook/slotbook/deadline"
	"github.com/slotbook/slotbook/reserve"
	"github.com/slotbook/slotbook/throttle"
)

// TestReviewUnused2LateImmediateSlotComesBack: with every reply held back
// 150 ms, a request whose deadline is 400 ms away with 300 ms of work on
// an idle key is booked at once by Redis (wait 0, within its budget) and
// refused late once the reply is in (acting then, 150 ms on, would end
// 50 ms past its deadline; its context has not ended). (It was 40 ms,
// 130 ms and 100 ms: on a 2-core machine running two suites every round
// of a subtest outlived its 130 ms context: its first call paid for
// dialling a connection too, and a reply lost costs the connection.) No one acted in
// that slot: nobody ever held it (not HoldLate). Its room must come back,
// as a caller's whose context ended in flight does since 9494129: the
// next booking on the key is immediate (Booking().Wait == 0 on the Redis
// clock). ReserveBatch's own give-back (giveBackLate) goes through
// RefundAll, which finds the slot come and gives nothing: the next
// booking waits most of an interval.
func TestReviewUnused2LateImmediateSlotComesBack(t *testing.T) {
	t.Parallel()
	eng, p, _ := latencyEngine(t)
	p.SetReplyDelay(150 * time.Millisecond)
	for _, co := range []bool{false, true} {
		for _, via := range []string{"ReserveN", "ReserveBatch"} {
			t.Run(fmt.Sprintf("coalescing=%v/%s", co, via), func(t *testing.T) {
				l, err := reserve.New(eng, fmt.Sprintf("late2-%v", co), throttle.PerSecond(1, 0), // 1 s apart
					reserve.WithoutMaxWait(), reserve.WithCoalescing(co), reserve.WithWorkEstimate(300*time.Millisecond))
				require.NoError(t, err)
				ctx := context.Background()
				// A connection open beforehand: dialling one (HELLO and
				// CLIENT SETINFO, each reply held back) takes more than the
				// deadline.
				_, err = l.Reserve(ctx, "warm-"+via)
				require.NoError(t, err)
				// A round whose call took too long on a busy machine (or
				// paid a NOSCRIPT round trip after another test's SCRIPT
				// FLUSH on the shared server) ends otherwise than refused
				// late: inconclusive, it is tried again on another key.
				for round := 0; ; round++ {
					require.Less(t, round, 8, "no round was refused late")
					key := fmt.Sprintf("%s-%d", via, round)
					// Budget 100 ms less the work: sent, booked at once; the
					// reply comes 150 ms later, still before the deadline.
					dl, cancel := context.WithTimeout(ctx, 400*time.Millisecond)
					var r *reserve.Reservation
					if via == "ReserveN" {
						r, err = l.Reserve(dl, key)
					} else {
						var rs []*reserve.Reservation
						rs, err = l.ReserveBatch(ctx, key, []reserve.BatchRequest{{Context: dl, N: 1}})
						if err == nil {
							r = rs[0]
						}
					}
					cancel()
					if err == nil {
						err = r.Err()
					}
					if !errors.Is(err, deadline.ErrWouldExceedDeadline) {
						t.Logf("round %d inconclusive: %v", round, err)
						continue
					}
					next, err := l.Reserve(ctx, key)
					require.NoError(t, err)
					require.True(t, next.OK())
					require.Zero(t, next.Booking().Wait,
						"the late refusal's room (never held, never used) is lost: the next booking waits")
					return
				}
			})
		}
	}
}

// TestReviewUnused2LateAndEndedCallersRandom: callers of one key, coalesced
// or not, layered or not, with replies held back 0-30 ms: some with a
// deadline tight enough that the reply's latency makes them late, some
// cancelled while their call is out (RefundUnused), some cancelling
// before their slot (RefundAll), and batches with HoldLate whose holders
// give back latest first or act. The slots that ran keep every limit.
func TestReviewUnused2LateAndEndedCallersRandom(t *testing.T) {
	t.Parallel()
	for _, layered := range []bool{false, true} {
		for _, co := range []bool{true, false} {
			t.Run(fmt.Sprintf("layered=%v/coalescing=%v", layered, co), func(t *testing.T) {
				t.Parallel()
				lims := []throttle.Limit{throttle.PerSecond(20, 1)}
				if layered {
					lims = append(lims, throttle.Every(2*time.Second, 16, 4))
				}
				opts := []reserve.Option{reserve.WithCoalescing(co)}
				if layered {
					opts = append(opts, reserve.WithLimit(lims[1]))
				}
				rg := ruNew(t, lims[0], opts...)
				if co {
					reserve.SetSoloBelow(rg.viaP, 1) // callers queue behind a call out: batches
				}
				stop := rg.jitter(15 * time.Millisecond)
				var (
					mu  sync.Mutex
					ran []rmaSlot
					wg  sync.WaitGroup
				)
				act := func(r *reserve.Reservation, ctx context.Context, n int) {
					if r.Wait(ctx) != nil {
						return
					}
					mu.Lock()
					ran = append(ran, rmaSlot{r.Booking().At.UnixMicro(), n})
					mu.Unlock()
				}
				for i := range 50 {
					wg.Go(func() {
						time.Sleep(time.Duration(rand.IntN(1200)) * time.Millisecond)
						n := 1 + i%2
						ctx, cancel := context.WithCancel(context.Background())
						defer cancel()
						switch rand.IntN(3) {
						case 0: // tight deadline: late refusals
							dl, c2 := context.WithTimeout(ctx, time.Duration(rand.IntN(30))*time.Millisecond)
							defer c2()
							ctx = dl
						case 1: // ends while its call is out, or while waiting
							time.AfterFunc(time.Duration(rand.IntN(60))*time.Millisecond, cancel)
						}
						if i%5 == 0 { // a batch, with HoldLate half the time
							hold := i%10 == 0
							reqs := []reserve.BatchRequest{{N: 1, HoldLate: hold}, {Context: ctx, N: 1, HoldLate: hold}, {N: 1, HoldLate: hold}}
							rs, err := rg.viaP.ReserveBatch(context.Background(), "k", reqs)
							if err != nil {
								return
							}
							if rand.IntN(2) == 0 { // give all back, latest first
								for j := len(rs) - 1; j >= 0; j-- {
									_ = rs[j].Cancel(context.Background())
								}
								return
							}
							for j, r := range rs {
								if r.OK() {
									c := context.Background()
									if j == 1 {
										c = ctx
									}
									act(r, c, 1)
								} else if r.Booking().OK {
									_ = r.Cancel(context.Background())
								}
							}
							return
						}
						r, err := rg.viaP.ReserveN(ctx, "k", n)
						if err != nil || !r.OK() {
							return
						}
						if rand.IntN(5) == 0 {
							if r.Cancel(context.Background()) == nil {
								return
							}
						}
						act(r, ctx, n)
					})
				}
				wg.Wait()
				stop()
				t.Logf("%d callers acted", len(ran))
				for _, l := range lims {
					rmaArrivalCurve(t, l, ran, l.String())
				}
			})
		}
	}
}
