package pool_test

import (
	"context"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/slotbook/slotbook/internal/redistest"
	"github.com/slotbook/slotbook/pool"
	"github.com/slotbook/slotbook/reserve"
	"github.com/slotbook/slotbook/throttle"
)

// TestPoolGiveBackStopsAtFailedTop: jobs of one key booked behind a pause
// and then cancelled go back latest first, each under the ones after it.
// With Redis paused (SIGSTOP) and an engine timeout longer than a
// give-back's second, the latest one's give-back fails after its second,
// and the ones under it, which could give nothing back while it stands,
// are not sent: Close returns after about one second for five cancelled
// jobs as for one (control, same run). Before, each waited out its own
// second: five seconds.
func TestPoolGiveBackStopsAtFailedTop(t *testing.T) {
	t.Parallel()
	closeAfter := func(jobs int) time.Duration {
		srv := redistest.Start(t)
		eng, err := throttle.New(srv.Client(t), throttle.WithPrefix(redistest.Prefix(t)), throttle.WithTimeout(10*time.Second))
		require.NoError(t, err)
		bg := context.Background()
		redistest.UntilOK(t, func() error { return eng.Load(bg) })
		lim, err := reserve.New(eng, "gb", throttle.PerSecond(1, 0), reserve.WithMaxWait(time.Minute))
		require.NoError(t, err)
		require.NoError(t, lim.Pause(bg, "k", 20*time.Second))
		p, err := pool.New(lim)
		require.NoError(t, err)
		ctx, cancel := context.WithCancel(bg)
		js := make([]*pool.Job, jobs)
		for i := range js {
			js[i], err = p.Submit(ctx, "k", func(context.Context) error { return nil })
			require.NoError(t, err)
		}
		time.Sleep(500 * time.Millisecond) // booked: one round trip on loopback (checked below)
		require.NoError(t, syscall.Kill(srv.Pid(), syscall.SIGSTOP))
		t.Cleanup(func() { _ = syscall.Kill(srv.Pid(), syscall.SIGCONT) })
		t0 := time.Now()
		cancel()
		cctx, stop := context.WithTimeout(bg, 30*time.Second)
		defer stop()
		require.NoError(t, p.Close(cctx))
		took := time.Since(t0)
		for i, j := range js {
			require.ErrorIs(t, j.Err(), context.Canceled, "job %d", i)
			res := j.Reservation()
			require.True(t, res != nil && res.Booking().OK, "job %d was booked (the test's premise)", i)
		}
		return took
	}
	one, five := closeAfter(1), closeAfter(5)
	t.Logf("Close with Redis paused: %v after one cancelled job, %v after five", one, five)
	require.Less(t, five, one+2*time.Second, "five give-backs each waited out their second")
}
