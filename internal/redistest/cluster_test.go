package redistest_test

import (
	"context"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/slotbook/slotbook/internal/redistest"
)

// TestClusterClientsOwnTheirAddrs: go-redis keeps ClusterOptions.Addrs
// as its list of known nodes and appends to it each node it learns from
// the slot map, so two clients made from one slice with room to spare
// write into the same array. Here a replica (an address not in Addrs)
// joins; two clients of the cluster then reload the slot map, each on a
// goroutine of its own, with nothing ordering the two. Under -race that
// was a data race (it failed TestReviewSWFailoverBothClients in CI); and
// the cluster's Addrs must stay as they were.
func TestClusterClientsOwnTheirAddrs(t *testing.T) {
	cluster := redistest.StartCluster(t, 3)
	before := slices.Clone(cluster.Addrs)
	ctx := context.Background()

	rep := cluster.AddReplica(t, 0)
	// Wait until every master's slot map lists the replica. go-redis reads
	// the map with CLUSTER SLOTS, so the test does too.
	for i := range cluster.Addrs {
		n := cluster.Node(i).Client(t)
		require.Eventually(t, func() bool {
			//lint:ignore SA1019 go-redis reads CLUSTER SLOTS, not CLUSTER SHARDS
			slots, err := n.ClusterSlots(ctx).Result()
			if err != nil {
				return false
			}
			for _, s := range slots {
				for _, nd := range s.Nodes {
					if nd.Addr == rep.Addr {
						return true
					}
				}
			}
			return false
		}, 30*time.Second, 50*time.Millisecond, "node %d lists the replica", i)
	}

	clients := []*redis.ClusterClient{cluster.Client(t), cluster.Client(t)}
	var wg sync.WaitGroup
	for _, cc := range clients {
		wg.Add(1)
		go func() {
			defer wg.Done()
			// ForEachShard reloads the slot map first.
			var mu sync.Mutex
			seen := map[string]bool{}
			require.NoError(t, cc.ForEachShard(ctx, func(_ context.Context, c *redis.Client) error {
				mu.Lock()
				seen[c.Options().Addr] = true
				mu.Unlock()
				return nil
			}))
			mu.Lock()
			defer mu.Unlock()
			require.True(t, seen[rep.Addr], "the client knows the replica: %v", seen)
		}()
	}
	wg.Wait()
	require.Equal(t, before, cluster.Addrs, "the cluster's Addrs")
}
