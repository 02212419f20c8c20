package lease_test

import (
	"context"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/slotbook/slotbook/internal/redistest"
	"github.com/slotbook/slotbook/lease"
	"github.com/slotbook/slotbook/throttle"
)

// TestCluster runs leases on a 3-master Redis Cluster: the keys of a
// subject share its hash tag (one slot, so the scripts run), waiters of
// two Semaphores (processes, as far as Redis can tell) are woken through
// the cluster client, and at most N hold a key at once.
func TestCluster(t *testing.T) {
	cluster := redistest.StartCluster(t, 3)
	cc := cluster.Client(t)
	eng, err := throttle.New(cc, throttle.WithPrefix(redistest.Prefix(t)), throttle.WithTimeout(5*time.Second))
	require.NoError(t, err)
	ctx := context.Background()
	const n = 2
	var sems []*lease.Semaphore
	for range 2 {
		// A poll far longer than the test: only the wake-ups, read through
		// the cluster client from the subject's node, can grant in time.
		s, err := lease.New(eng, "partner", n, lease.WithTTL(time.Minute), lease.WithPollInterval(20*time.Second))
		require.NoError(t, err)
		t.Cleanup(func() { _ = s.Close(ctx) })
		sems = append(sems, s)
	}
	subjects := []string{"alpha", "beta", "gamma", "delta"}
	slots := map[int64]bool{}
	for _, subj := range subjects {
		var subjSlot int64 = -1
		for _, part := range []string{"h", "t", "q", "w", "c", "n:x", "l"} {
			slot, err := cc.ClusterKeySlot(ctx, eng.Prefix()+"partner:{"+subj+"}:lease:"+part).Result()
			require.NoError(t, err)
			if subjSlot >= 0 && slot != subjSlot {
				t.Fatalf("the lease keys of %q hash to slots %d and %d", subj, subjSlot, slot)
			}
			subjSlot = slot
		}
		slots[subjSlot] = true
	}
	if len(slots) < 2 {
		t.Logf("the subjects all hash to one slot; the test covers one node")
	}

	var wg sync.WaitGroup
	var mu sync.Mutex
	peak := map[string]int{}
	cur := map[string]*atomic.Int64{}
	for _, subj := range subjects {
		cur[subj] = new(atomic.Int64)
	}
	for _, subj := range subjects {
		for w := range 6 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				s := sems[w%2]
				for range 8 {
					actx, cancel := context.WithTimeout(ctx, 15*time.Second)
					l, err := s.Acquire(actx, subj)
					cancel()
					if err != nil {
						t.Error(err)
						return
					}
					c := cur[subj].Add(1)
					mu.Lock()
					peak[subj] = max(peak[subj], int(c))
					mu.Unlock()
					time.Sleep(2 * time.Millisecond)
					cur[subj].Add(-1)
					if err := l.Release(ctx); err != nil {
						t.Error(err)
						return
					}
				}
			}()
		}
	}
	wg.Wait()
	for subj, p := range peak {
		if p > n {
			t.Errorf("%q: %d leases held at once, want at most %d", subj, p, n)
		}
	}
	for _, subj := range subjects {
		n, err := cc.Exists(ctx, eng.Prefix()+"partner:{"+subj+"}:lease:q", eng.Prefix()+"partner:{"+subj+"}:lease:h").Result()
		require.NoError(t, err)
		if n != 0 {
			t.Errorf("%q: queue or holders left after every lease was released", subj)
		}
	}
}
