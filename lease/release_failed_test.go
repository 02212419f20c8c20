package lease_test

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/slotbook/slotbook/lease"
	"github.com/slotbook/slotbook/lease/internal/leasetest"
)

// failNext fails the next script call after it is armed: unsent (a refused
// dial), or once Redis has run it, with its reply lost.
type failNext struct {
	armed atomic.Bool
	lost  bool
	hit   atomic.Int32
}

func (h *failNext) DialHook(next redis.DialHook) redis.DialHook { return next }
func (h *failNext) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}
func (h *failNext) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		if argv, _ := leasetest.ScriptArgs(cmd); argv == nil || !h.armed.CompareAndSwap(true, false) {
			return next(ctx, cmd)
		}
		h.hit.Add(1)
		if !h.lost {
			cmd.SetErr(leasetest.ErrNotSent)
			return leasetest.ErrNotSent
		}
		_ = next(ctx, cmd)
		cmd.SetErr(leasetest.ErrLostRead)
		return leasetest.ErrLostRead
	}
}

// TestFailedReleaseGivesBack: a Release whose call fails, before any
// Close, returns the error, and the Semaphore then gives the lease back
// with a leave call of its own once Redis answers, as it does a gone
// waiter's: a waiter of another process gets the lease within a few poll
// intervals, not after the TTL (30 s). Failed unsent (a refused dial), or
// with its reply lost after Redis ran it (the leave call then finds the
// lease released and leaves the next holder's alone: it still holds the
// key's one lease a moment on).
func TestFailedReleaseGivesBack(t *testing.T) {
	for _, lost := range []bool{false, true} {
		name := map[bool]string{false: "unsent", true: "reply lost"}[lost]
		t.Run(name, func(t *testing.T) {
			e := leasetest.NewEnv(t)
			h := &failNext{lost: lost}
			const ttl = 30 * time.Second
			s := leasetest.SemOn(t, leasetest.Direct(t, e, 5*time.Second, h), 1, lease.WithTTL(ttl), lease.WithPollInterval(100*time.Millisecond))
			other := e.Sem(t, 1, lease.WithTTL(ttl), lease.WithPollInterval(100*time.Millisecond))
			ctx := context.Background()
			// Loaded first: an EVALSHA of a script the server lacks runs
			// as NOSCRIPT, and its lost reply would hide that it did not
			// run (a known limit).
			require.NoError(t, s.Load(ctx))
			held, err := s.Acquire(ctx, "k")
			require.NoError(t, err)
			got := make(chan leasetest.Got, 1)
			leasetest.AcquireAsync(ctx, e, other, "other", "k", got)
			e.Queued(t, "k", 1)

			h.armed.Store(true)
			start := time.Now()
			err = held.Release(ctx)
			require.Error(t, err, "the release call failed")
			require.EqualValues(t, 1, h.hit.Load(), "the hook failed the release call")

			var l *lease.Lease
			select {
			case g := <-got:
				require.NoError(t, g.Err)
				l = g.L
			case <-time.After(ttl / 3):
				t.Fatalf("the waiter of another process did not get the lease within %v of a failed release (TTL %v)", ttl/3, ttl)
			}
			t.Logf("%s: the waiter got the lease %v after the failed release", name, time.Since(start))
			require.Greater(t, l.Token(), held.Token())
			// The owed leave call, however late, spares the new holder.
			time.Sleep(500 * time.Millisecond)
			holders, err := e.Rdb.ZRange(ctx, e.Key("k", "h"), 0, -1).Result()
			require.NoError(t, err)
			require.Len(t, holders, 1, "the new holder's lease stands, alone")
			require.NoError(t, l.Release(ctx))
		})
	}
}
