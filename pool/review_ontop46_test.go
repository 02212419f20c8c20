package pool_test

// Review (helper-136) of f4e8b7f: what TestReviewPTAcquireOnTop saw once,
// with a stall injected by hand before X's Submit, made deterministic
// through the public API, without any stall.
//
// The scene is ptScene's (WithLease, 400 ms replies held at the proxy,
// single bookings merged at one call in flight), burst 1 (PerMinute(6, 1):
// two units at once), no X. L, a job whose deadline falls while its reply
// is out, is submitted first, and the test waits until its booking has run
// in Redis (its key seen straight from the server, its reply held). Only
// then does the other party ask: an Acquire caller of the pool, or a job R.
// Its booking goes out in a call of its own (L's call is the only one in
// flight; it merges with nothing and goes out after the merge wait), and is
// booked in Redis after L's: both immediate (burst 1), but at different
// slots on the Redis clock (L's decision, then the other's, some ms
// later). L is refused late, its booking held for the pool; the other
// acts in its own slot.
//
// Textbook GCRA replayed over the jobs that actually ran, at their Redis
// slots: one unit (the caller's, or R's) at a slot no later than the probe,
// burst 1: room for exactly one more at once. L's booking, which no one
// acted on, must be handed down or given back. It is neither: its slot has
// come when its reply is in, so it is not handable (dispatch.go:383); a
// refund gives nothing while the other's booking stands on it; and
// Reservation.Trade, the pool's only way to give a late refusal's room
// back from under a booking that ran, requires the same slot to the
// microsecond (dispatch.go:532 tradeUnderLocked, dispatch.go:600
// forgetUnderLocked, reserve.go:1124), which two calls never share. So when
// the other acts, forgetUnderLocked drops L's booking (dispatch.go:607):
// the pool sends no give-back at all (the rig's observer counts no
// refund). The room is lost: probes straight in Redis find none at once.
//
// FAILS at f4e8b7f: caller and job, 3 of 3 trials each (room 0, textbook
// 1), under the build tag slotbook_known_limits; without it the loss is
// logged, as it is the documented behaviour (pool's doc: a slot passed
// unused is not run late; an owed booking a later job has started on is
// forgotten). Control: the same scene with L not late (it runs too)
// leaves room 0, textbook 0: the probes read the key right.
//
// A mend, not made here (test code only): for a late refusal's held
// booking o under a started booking j of a later slot, the exact room is
// what Redis would hold had o not been booked: j's end would be
// max(o's start TAT, j.at) + I, i.e. I - (j.at - o.at) less when both were
// immediate. Trade across slots (j takes o's booking, j's own given back)
// gives back I, j.at - o.at more than the textbook with j at its own slot,
// and is exact only if j is counted in o's slot (run late in it, which
// handedStart refuses elsewhere); a partial give-back of j's booking down
// to that end (refund.lua, with the booking's identity kept) is exact.

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/slotbook/slotbook/pool"
	"github.com/slotbook/slotbook/throttle"
)

// TestReviewOnTop46SeparateCalls: L (late) booked in Redis before the
// other party's call is sent, in calls of their own; the other party is
// the pool's Acquire caller (caller) or a job (job). Oracle: probes
// straight in Redis find the room a textbook GCRA leaves after the one
// unit that ran (burst 1): 1 at once. The control (late=false) has L run
// as well: textbook room 0.
func TestReviewOnTop46SeparateCalls(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name   string
		caller bool
		late   bool
	}{
		{"caller", true, true},
		{"job", false, true},
		{"control/caller", true, false},
		{"control/job", false, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			sc := newPTScene(t, fmt.Sprintf("ot46%v%v", tc.caller, tc.late), 2, []throttle.Limit{throttle.PerMinute(6, 1)}, true)
			bg := context.Background()
			met, lost := 0, 0
			for trial := range 3 {
				key := fmt.Sprintf("k%d", trial)
				lctx, lcancel := context.WithTimeout(bg, time.Minute)
				if tc.late {
					lctx, lcancel = context.WithTimeout(bg, ptD-150*time.Millisecond)
				}
				refunds0, given0 := sc.r.obs.refunds.Load(), sc.r.obs.given.Load()
				l, err := sc.p.Submit(lctx, key, fgNop)
				require.NoError(t, err)
				// L's booking has run in Redis, its reply held at the
				// proxy: the other party's call goes out after it.
				sc.awaitFlying(t, key)
				wctx, wcancel := context.WithTimeout(bg, 20*time.Second)
				var r *pool.Job
				if tc.caller {
					release, err := sc.p.Acquire(wctx, key)
					require.NoError(t, err, "the caller acts")
					release()
				} else {
					r, err = sc.p.Submit(bg, key, fgNop)
					require.NoError(t, err)
					require.NoError(t, r.Wait(wctx), "R runs")
				}
				lerr := l.Wait(wctx)
				require.NoError(t, sc.p.Wait(wctx))
				wcancel()
				lcancel()
				time.Sleep(2*ptD + 300*time.Millisecond) // give-backs are in

				ran := 1 // the caller, or R
				if !l.Started().IsZero() {
					ran++
				}
				if tc.late != hoLate(l) || (!tc.late && ran != 2) {
					t.Logf("trial %d: premise not met (L late %v, ran %d, %v)", trial, hoLate(l), ran, lerr)
					continue
				}
				lat := l.Reservation().Booking().At
				if r != nil {
					require.False(t, r.Started().Before(r.Reservation().Booking().At), "R started before its slot")
					if tc.late {
						// Booked by a call sent after L's ran in Redis.
						require.True(t, r.Reservation().Booking().At.After(lat), "R's slot %v after L's %v", r.Reservation().Booking().At, lat)
					}
				}
				met++
				// Textbook GCRA (burst 1, I = 10 s) over the units that ran,
				// all at slots no later than the probe: room for 2 - ran.
				room := sc.probeRoom(t, key, 2)
				t.Logf("trial %d: L late %v (slot %v), %d ran; refunds sent by the pool %d (gave something: %d); room %d, textbook %d", trial, hoLate(l), lat.Format("15:04:05.000000"), ran, sc.r.obs.refunds.Load()-refunds0, sc.r.obs.given.Load()-given0, room, 2-ran)
				require.LessOrEqual(t, room, 2-ran, "trial %d: room given back twice", trial)
				if room < 2-ran {
					lost++
				}
			}
			require.Positive(t, met, "no trial met the premise")
			// A known limit (pool's doc: a slot passed unused is not run
			// late, and an owed booking a later job has started on is
			// forgotten, as it could give nothing back): logged, and a
			// failure only under the build tag slotbook_known_limits.
			if lost > 0 && !knownLimits {
				t.Logf("known limit: %d of %d trials lost L's room", lost, met)
				return
			}
			require.Zero(t, lost, "%d of %d trials: one unit ran at a slot no later than the probes, burst 1: textbook GCRA leaves room for one at once, Redis for none (L's booking, refused late and acted on by no one, at a slot of its own under the other's, was neither handed down nor given back)", lost, met)
		})
	}
}
