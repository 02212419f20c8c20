package reserve_test

import (
	"context"
	"strconv"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/slotbook/slotbook/internal/redistest"
	"github.com/slotbook/slotbook/reserve"
	"github.com/slotbook/slotbook/throttle"
)

// TestClusterFailClosedRetryAfterPerNode: on a 3-master Redis Cluster with
// two masters stopped one after the other, FailClosed's retry-after for a
// subject is the time until its own master's next probe, not the soonest
// probe of any master (which would send callers back before their node is
// tried again), through Allow and Reserve alike.
func TestClusterFailClosedRetryAfterPerNode(t *testing.T) {
	t.Parallel()
	cluster := redistest.StartCluster(t, 3, "--cluster-require-full-coverage", "no")
	cc := cluster.Client(t)
	// The probe backoff keeps each stopped master's breaker open for the
	// whole test, its next probe a fixed 20 s after it opened.
	eng, err := throttle.New(cc, throttle.WithTimeout(5*time.Second), throttle.WithProbeBackoff(20*time.Second, 20*time.Second))
	require.NoError(t, err)
	lim, err := reserve.New(eng, "probes", throttle.PerHour(1000, 1000), reserve.WithFallback(reserve.FailClosed()))
	require.NoError(t, err)
	ctx := context.Background()

	// One subject on master 0 and one on master 1: the masters' keys name them.
	on := map[int]string{}
	for i := 0; len(on) < 2 && i < 200; i++ {
		s := "subject-" + strconv.Itoa(1000+i)
		redistest.UntilOK(t, func() error { _, err := lim.Allow(ctx, s); return err })
		for node := 0; node < 2; node++ {
			if _, ok := on[node]; ok {
				continue
			}
			keys, err := cluster.Node(node).Client(t).Keys(ctx, "*"+s+"*").Result()
			require.NoError(t, err)
			if len(keys) > 0 {
				on[node] = s
			}
		}
	}
	require.Len(t, on, 2, "a subject on each of masters 0 and 1")

	// Master 0's breaker opens first, master 1's at least 2 s later.
	cluster.Node(0).Stop()
	res, err := lim.Allow(ctx, on[0])
	require.NoError(t, err)
	require.False(t, res.Allowed, "FailClosed refuses a subject on a stopped master")
	time.Sleep(2 * time.Second)
	cluster.Node(1).Stop()
	res, err = lim.Allow(ctx, on[1])
	require.NoError(t, err)
	require.False(t, res.Allowed)

	// The engine keys of the subjects, as package reserve names them.
	open0, probe0 := eng.UnavailableFor(ctx, "probes:{"+on[0]+"}")
	require.True(t, open0)
	res, err = lim.Allow(ctx, on[1])
	require.NoError(t, err)
	require.False(t, res.Allowed)
	// Master 1's probe is at least 2 s after master 0's: a retry-after at
	// or below master 0's is the soonest probe of any node.
	require.Greater(t, res.RetryAfter, probe0+time.Second,
		"Allow's retry-after for a subject on master 1 is its own master's probe, not master 0's (%v away)", probe0)
	open1, probe1 := eng.UnavailableFor(ctx, "probes:{"+on[1]+"}")
	require.True(t, open1)
	require.LessOrEqual(t, res.RetryAfter-probe1, time.Second, "and no later than it")

	r, err := lim.Reserve(ctx, on[1])
	require.NoError(t, err)
	var fe *reserve.FallbackError
	require.ErrorAs(t, r.Err(), &fe, "Reserve through FailClosed")
	require.Greater(t, fe.RetryAfter, probe0+time.Second, "Reserve's retry-after is master 1's probe")

	// The subject on master 0 keeps its own, sooner, probe.
	res, err = lim.Allow(ctx, on[0])
	require.NoError(t, err)
	require.False(t, res.Allowed)
	require.Less(t, res.RetryAfter, fe.RetryAfter-time.Second, "master 0's probe is the sooner one")
}
