package pool_test

// Review of 76ce7b6 (lease: a Release whose call fails gives its lease
// back with a leave call of the Semaphore's, before Close too), through
// pool.WithLease: jobs whose lease release fails.

import (
	"context"
	"crypto/sha1"
	"encoding/hex"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/slotbook/slotbook/internal/redistest"
	"github.com/slotbook/slotbook/lease"
	"github.com/slotbook/slotbook/pool"
	"github.com/slotbook/slotbook/throttle"
)

// r49FailReleases fails a share of the lease release calls that pass it
// with an error Redis might answer (so that no breaker opens): unsent, or
// after Redis ran the call (its reply replaced).
type r49FailReleases struct {
	release string // the release script's SHA1
	failed  atomic.Int32
	lost    atomic.Int32
}

func (h *r49FailReleases) DialHook(next redis.DialHook) redis.DialHook { return next }
func (h *r49FailReleases) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}
func (h *r49FailReleases) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		a := cmd.Args()
		if cmd.Name() != "evalsha" || len(a) < 2 || fmt.Sprint(a[1]) != h.release {
			return next(ctx, cmd)
		}
		switch m := rand.IntN(10); {
		case m < 2:
			h.failed.Add(1)
			err := errors.New("ERR injected: release unsent")
			cmd.SetErr(err)
			return err
		case m < 4:
			h.lost.Add(1)
			_ = next(ctx, cmd)
			err := errors.New("ERR injected: release reply replaced")
			cmd.SetErr(err)
			return err
		}
		return next(ctx, cmd)
	}
}

// TestReviewRelease49PoolWithLease: two pools (processes) share a lease
// of N = 2 (TTL 30 s, poll 100 ms) on one key, 8 workers each, 60 jobs of
// 3 ms; in one of them 40% of the lease release calls fail (unsent, or
// with the reply replaced after Redis ran it). Every job runs exactly
// once and without error, never more than N at once, all within 20 s (a
// lease left to lapse would hold its place for the 30 s TTL), and no
// holder is left in Redis a moment after.
func TestReviewRelease49PoolWithLease(t *testing.T) {
	prefix := redistest.Prefix(t)
	const n, jobs = 2, 60
	common, err := os.ReadFile("../lease/scripts/common.lua")
	require.NoError(t, err)
	rel, err := os.ReadFile("../lease/scripts/release.lua")
	require.NoError(t, err)
	sum := sha1.Sum(append(append([]byte{}, common...), rel...))
	hook := &r49FailReleases{release: hex.EncodeToString(sum[:])}
	var running, peak atomic.Int64
	runs := make([]atomic.Int32, jobs)
	var wg sync.WaitGroup
	var errs atomic.Int32
	start := time.Now()
	var rdb *redis.Client
	for i := range 2 {
		pr := newProcess(t, prefix, throttle.PerSecond(2000, 50))
		rdb = pr.rdb
		eng := pr.eng
		if i == 1 {
			c := redistest.Shared(t).Client(t)
			c.AddHook(hook)
			eng, err = throttle.New(c, throttle.WithPrefix(prefix), throttle.WithTimeout(5*time.Second))
			require.NoError(t, err)
		}
		sem, err := lease.New(eng, "api", n, lease.WithTTL(30*time.Second), lease.WithPollInterval(100*time.Millisecond))
		require.NoError(t, err)
		require.NoError(t, sem.Load(context.Background()))
		t.Cleanup(func() { _ = sem.Close(context.Background()) })
		p := newPool(t, pr.lim, pool.WithWorkers(8), pool.WithLease(sem))
		for k := i; k < jobs; k += 2 {
			j, err := p.Submit(context.Background(), "k", func(ctx context.Context) error {
				runs[k].Add(1)
				c := running.Add(1)
				for {
					old := peak.Load()
					if c <= old || peak.CompareAndSwap(old, c) {
						break
					}
				}
				time.Sleep(3 * time.Millisecond)
				running.Add(-1)
				return nil
			})
			require.NoError(t, err)
			wg.Go(func() {
				ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
				defer cancel()
				if err := j.Wait(ctx); err != nil {
					errs.Add(1)
					t.Errorf("job %d: %v", k, err)
				}
			})
		}
	}
	wg.Wait()
	t.Logf("%d jobs in %v; releases failed unsent %d, with the reply replaced %d; peak %d",
		jobs, time.Since(start).Round(time.Millisecond), hook.failed.Load(), hook.lost.Load(), peak.Load())
	assert.Zero(t, errs.Load())
	for k := range runs {
		assert.EqualValues(t, 1, runs[k].Load(), "runs of job %d", k)
	}
	assert.LessOrEqual(t, peak.Load(), int64(n), "jobs at once")
	assert.Positive(t, hook.failed.Load()+hook.lost.Load(), "no release failed: the test judged nothing")
	hkey := prefix + "api:{k}:lease:h"
	deadline := time.Now().Add(5 * time.Second)
	for rdb.ZCard(context.Background(), hkey).Val() > 0 && time.Now().Before(deadline) {
		time.Sleep(20 * time.Millisecond)
	}
	assert.Zero(t, rdb.ZCard(context.Background(), hkey).Val(), "holders left in Redis")
}
