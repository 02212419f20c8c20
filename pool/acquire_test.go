package pool_test

import (
	"context"
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
				require.NoError(t, p.Close(cctx), "Close waits for no sleeping Acquire caller")
				ccancel()
			}
			acancel()
			select {
			case err := <-aerr:
				require.ErrorIs(t, err, context.Canceled)
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
