package pool_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/slotbook/slotbook/pool"
	"github.com/slotbook/slotbook/throttle"
)

// TestAcquireCancelledWhileSleeping: an Acquire caller whose context ends
// while it sleeps until its slot has not acted, so its booking's room
// comes back: with the pool open; after Close, once the dispatcher has
// returned; and under a job of its key booked after it, cancelled later
// (the job's booking must go back first, or the caller's gives nothing).
// Textbook GCRA: only the first caller acted, on a key with room for one
// at once (an interval of 10 s), so a booking made straight in Redis
// right after waits at most an interval.
func TestAcquireCancelledWhileSleeping(t *testing.T) {
	t.Parallel()
	lim := throttle.PerMinute(6, 0)
	for _, tc := range []struct {
		name         string
		close, jobOn bool
	}{{name: "open"}, {name: "closed", close: true}, {name: "under a job", jobOn: true}} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			r := newFGRig(t, "acqcancel", lim)
			p := newTradePool(t, r, 0)
			bg := context.Background()
			key := "k"
			release, err := p.Acquire(bg, key) // acts at once
			require.NoError(t, err)
			release()

			actx, acancel := context.WithCancel(bg)
			defer acancel()
			aerr := make(chan error, 1)
			go func() {
				release, err := p.Acquire(actx, key) // books a slot 10 s on, and sleeps
				if err == nil {
					release()
				}
				aerr <- err
			}()
			time.Sleep(300 * time.Millisecond) // booked, sleeping
			var j *pool.Job
			jctx, jcancel := context.WithCancel(bg)
			defer jcancel()
			if tc.jobOn {
				j, err = p.Submit(jctx, key, fgNop) // books a slot 20 s on
				require.NoError(t, err)
				require.Eventually(t, func() bool { return pool.Booked(p) == 1 }, 5*time.Second, 5*time.Millisecond)
			}
			if tc.close {
				cctx, ccancel := context.WithTimeout(bg, 5*time.Second)
				require.NoError(t, p.Close(cctx), "Close ends sleeping Acquire callers")
				ccancel()
			}
			acancel()
			select {
			case err := <-aerr:
				if tc.close {
					require.ErrorIs(t, err, pool.ErrClosed, "Close ends a sleeping caller")
				} else {
					require.ErrorIs(t, err, context.Canceled)
				}
			case <-time.After(5 * time.Second):
				t.Fatal("Acquire did not return once its context ended")
			}
			if tc.jobOn {
				time.Sleep(100 * time.Millisecond) // the caller's booking is owed, under the job's
				jcancel()
				require.ErrorIs(t, j.Wait(bg), context.Canceled)
			}
			wctx, wcancel := context.WithTimeout(bg, 10*time.Second)
			require.NoError(t, p.Wait(wctx))
			wcancel()
			require.Eventually(t, func() bool { return pool.Owing(p) == 0 }, 5*time.Second, 5*time.Millisecond, "give-backs done")
			pb := r.probeBook(t, key)
			require.LessOrEqual(t, pb.Wait, lim.Interval(), "the cancelled caller's room did not come back")
		})
	}
}

// TestAcquireHandedDown: a job booked before an Acquire caller and
// cancelled before its slot leaves its slot under the caller's booking.
// As for a job of the key, the slot is handed down: the caller acts in it,
// and its own, the later, goes back. Textbook GCRA: P (a probe straight to
// Redis) and the caller acted, one interval apart at most, on a key with
// room for one at once, so a probe after them books two intervals after P
// on the Redis clock. Before, the job's booking was left owed under the
// caller's, forgotten when the caller acted: the probe booked three
// intervals after P.
func TestAcquireHandedDown(t *testing.T) {
	t.Parallel()
	lim := throttle.PerMinute(30, 0) // I = 2 s
	for _, lease := range []int{0, 8} {
		t.Run(fmt.Sprintf("leases %d", lease), func(t *testing.T) {
			t.Parallel()
			r := newFGRig(t, "acqhand", lim)
			p := newTradePool(t, r, lease)
			bg := context.Background()
			key := "k"
			p0 := r.probeBook(t, key) // acts at once
			jctx, jcancel := context.WithCancel(bg)
			defer jcancel()
			j, err := p.Submit(jctx, key, fgNop) // booked one interval on
			require.NoError(t, err)
			require.Eventually(t, func() bool { return pool.Booked(p) == 1 }, 5*time.Second, time.Millisecond)
			aerr := make(chan error, 1)
			go func() {
				release, err := p.Acquire(bg, key) // booked two intervals on
				if err == nil {
					release()
				}
				aerr <- err
			}()
			require.Eventually(t, func() bool { return pool.Callers(p) == 1 }, 5*time.Second, time.Millisecond)
			jcancel()
			require.ErrorIs(t, j.Wait(bg), context.Canceled)
			select {
			case err := <-aerr:
				require.NoError(t, err)
			case <-time.After(10 * time.Second):
				t.Fatal("Acquire did not return")
			}
			require.Eventually(t, func() bool { return pool.Owing(p) == 0 }, 5*time.Second, 5*time.Millisecond, "give-backs done")
			pb := r.probeBook(t, key)
			require.Equal(t, 2*lim.Interval(), pb.At.Sub(p0.At), "the cancelled job's slot was not handed down to the caller")
		})
	}
}
