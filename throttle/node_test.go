package throttle_test

import (
	"context"
	"errors"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/slotbook/slotbook/internal/redistest"
	"github.com/slotbook/slotbook/reserve"
	"github.com/slotbook/slotbook/throttle"
)

// nodeLog records every node breaker change.
type nodeLog struct {
	breakerLog
	mu    sync.Mutex // guards nodes
	nodes []nodeChange
}

type nodeChange struct {
	node string
	open bool
}

func (l *nodeLog) ObserveNodeBreaker(node string, open bool) {
	l.mu.Lock()
	l.nodes = append(l.nodes, nodeChange{node, open})
	l.mu.Unlock()
}

// reset forgets the changes seen so far: a test's warm-up, on a machine
// busy enough to time out a call of a server just started, may open and
// close a breaker before the part the test is about.
func (l *nodeLog) reset() {
	l.mu.Lock()
	l.nodes = nil
	l.mu.Unlock()
}

func (l *nodeLog) getNodes() []nodeChange {
	l.mu.Lock()
	defer l.mu.Unlock()
	return append([]nodeChange(nil), l.nodes...)
}

// subjectOn returns a subject whose key (under prefix) the cluster holds on
// the master at addr.
func subjectOn(t *testing.T, cc *redis.ClusterClient, prefix, addr string) string {
	t.Helper()
	for i := 0; i < 1000; i++ {
		s := "s" + strconv.Itoa(i)
		m, err := cc.MasterForKey(context.Background(), prefix+s)
		require.NoError(t, err)
		if m.Options().Addr == addr {
			return s
		}
	}
	t.Fatalf("no subject on %s", addr)
	return ""
}

// TestClusterNodeDown: on a 3-master Redis Cluster with one master
// stopped, subjects on that master fail with ErrUnavailable (the fallback
// answers for them) and its breaker opens; subjects on the healthy
// masters are served, every call: the breaker is per node, not per
// engine.
func TestClusterNodeDown(t *testing.T) {
	t.Parallel()
	// Full coverage not required: the healthy masters keep serving their
	// slots after the cluster notices the stopped one.
	cluster := redistest.StartCluster(t, 3, "--cluster-require-full-coverage", "no")
	cc := cluster.Client(t)
	log := &nodeLog{}
	// A generous timeout (a busy machine) and a probe backoff that keeps
	// the stopped node's breaker open for the whole test.
	eng, err := throttle.New(cc, throttle.WithTimeout(5*time.Second),
		throttle.WithProbeBackoff(time.Minute, time.Minute), throttle.WithObserver(log))
	require.NoError(t, err)
	ctx := context.Background()
	dead := subjectOn(t, cc, throttle.DefaultPrefix, cluster.Addrs[0])
	healthy := []string{
		subjectOn(t, cc, throttle.DefaultPrefix, cluster.Addrs[1]),
		subjectOn(t, cc, throttle.DefaultPrefix, cluster.Addrs[2]),
	}
	lim := throttle.PerSecond(1000, 1000)
	for _, s := range append([]string{dead}, healthy...) {
		redistest.UntilOK(t, func() error { _, err := eng.Allow(ctx, s, lim); return err })
	}
	require.Empty(t, log.getNodes(), "no breaker opened while every master was up")
	// Node names each subject's master as the observer names its breaker.
	for i, s := range append([]string{dead}, healthy...) {
		require.Equal(t, cluster.Addrs[i], eng.Node(ctx, s), "the node of %s", s)
	}

	cluster.Node(0).Stop()
	_, err = eng.Allow(ctx, dead, lim)
	require.ErrorIs(t, err, throttle.ErrUnavailable)
	open, _ := eng.UnavailableFor(ctx, dead)
	require.True(t, open, "the stopped master's breaker is open")
	for i := 0; i < 50; i++ {
		_, err := eng.Allow(ctx, dead, lim)
		require.ErrorIs(t, err, throttle.ErrUnavailable, "call %d for a subject on the stopped master", i)
		for _, s := range healthy {
			_, err := eng.Allow(ctx, s, lim)
			require.NoError(t, err, "call %d for a subject on a healthy master", i)
			open, _ := eng.UnavailableFor(ctx, s)
			require.False(t, open)
		}
	}
	open, _ = eng.Unavailable()
	require.True(t, open, "Unavailable: some node is")
	require.Equal(t, []nodeChange{{cluster.Addrs[0], true}}, log.getNodes(), "only the stopped master's breaker opened")
	require.Equal(t, cluster.Addrs[0], eng.Node(ctx, dead), "the stopped master still holds its slots in the client's map")
	require.Equal(t, []bool{true}, log.get(), "the engine-wide report: the first breaker opened")
}

// TestClusterNodeDownFallback: through package reserve, with FailClosed,
// only the subjects on a stopped master are refused by the fallback; the
// subjects on the healthy masters are decided by Redis.
func TestClusterNodeDownFallback(t *testing.T) {
	t.Parallel()
	cluster := redistest.StartCluster(t, 3, "--cluster-require-full-coverage", "no")
	cc := cluster.Client(t)
	eng, err := throttle.New(cc, throttle.WithTimeout(5*time.Second), throttle.WithProbeBackoff(time.Minute, time.Minute))
	require.NoError(t, err)
	// Slow enough that each subject's key lives while the test reads it.
	lim, err := reserve.New(eng, "nodes", throttle.PerHour(1000, 1000), reserve.WithFallback(reserve.FailClosed()))
	require.NoError(t, err)
	ctx := context.Background()
	subjects := make([]string, 24)
	for i := range subjects {
		subjects[i] = "subject-" + strconv.Itoa(100+i) // no subject's name within another's
		redistest.UntilOK(t, func() error { _, err := lim.Allow(ctx, subjects[i]); return err })
	}
	// Which subjects the stopped master holds: its keys name them.
	keys, err := cluster.Node(0).Client(t).Keys(ctx, "*").Result()
	require.NoError(t, err)
	onDead := map[string]bool{}
	for _, s := range subjects {
		for _, k := range keys {
			if strings.Contains(k, s) {
				onDead[s] = true
			}
		}
	}
	require.NotEmpty(t, onDead, "some subjects on the master to stop")
	require.Less(t, len(onDead), len(subjects), "some subjects on the others")

	cluster.Node(0).Stop()
	for round := 0; round < 5; round++ {
		for _, s := range subjects {
			res, err := lim.Allow(ctx, s)
			require.NoError(t, err, s)
			if onDead[s] {
				require.False(t, res.Allowed, "%s is on the stopped master: FailClosed refuses", s)
			} else {
				require.True(t, res.Allowed, "%s is on a healthy master: Redis decides (round %d)", s, round)
			}
		}
	}
}

// TestClusterSaturatedClient: a Cluster client whose per-node pool is far
// smaller than its callers queue them for a connection before their
// timeout starts, as a plain client's are: the client's own saturation
// fails no call.
func TestClusterSaturatedClient(t *testing.T) {
	t.Parallel()
	cluster := redistest.StartCluster(t, 3)
	cc := redis.NewClusterClient(&redis.ClusterOptions{Addrs: cluster.Addrs, ContextTimeoutEnabled: true, PoolSize: 1})
	t.Cleanup(func() { _ = cc.Close() })
	// A timeout longer than one call takes, and far shorter than the queue
	// below. (A call that a busy machine delays past it still counts as
	// having reached Redis.)
	eng, err := throttle.New(cc, throttle.WithTimeout(250*time.Millisecond))
	require.NoError(t, err)
	ctx := context.Background()
	lim := throttle.PerSecond(10, 0)
	// Each call judges a full batch, so that it takes a while; together
	// they queue far longer than the timeout for the node's one connection.
	reqs := make([]throttle.Request, throttle.MaxBatch)
	for i := range reqs {
		reqs[i] = throttle.Request{N: 1}
	}
	redistest.UntilOK(t, func() error { _, err := eng.BookBatch(ctx, "{k}", lim, reqs); return err }) // the script loaded
	node, err := cc.MasterForKey(ctx, throttle.DefaultPrefix+"{k}")
	require.NoError(t, err)
	before := scriptCalls(t, node)

	const callers = 300
	errs := make(chan error, callers)
	var wg sync.WaitGroup
	start := time.Now()
	for i := 0; i < callers; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			_, err := eng.BookBatch(ctx, "{k}", lim, reqs)
			errs <- err
		}()
	}
	wg.Wait()
	close(errs)
	sent := scriptCalls(t, node) - before
	// Every call either reached Redis, or was refused at once by a breaker
	// that a slow reply opened (a busy machine may delay one past the
	// timeout): none was lost to waiting for a connection.
	failed, fast := 0, 0
	for err := range errs {
		if err != nil {
			failed++
			t.Log(err)
			if errors.Is(err, throttle.ErrUnavailable) && !errors.Is(err, throttle.ErrReplyLost) {
				fast++
			}
		}
	}
	t.Logf("%d calls of %d requests in %v: %d reached Redis, %d failed (%d at once)",
		callers, throttle.MaxBatch, time.Since(start), sent, failed, fast)
	// A call whose reply was lost may still be in the node's input when the
	// count is read (a busy machine delays the server too): it is counted
	// once the node has run it.
	if sent+int64(fast) != int64(callers) {
		require.Eventually(t, func() bool { return scriptCalls(t, node)-before+int64(fast) >= int64(callers) },
			10*time.Second, 50*time.Millisecond, "calls that never reached Redis: the client's own saturation")
		sent = scriptCalls(t, node) - before
	}
	require.Equal(t, int64(callers), sent+int64(fast), "calls that never reached Redis: the client's own saturation")
}

// scriptCalls returns how many EVALSHA calls the node has run.
func scriptCalls(t *testing.T, node *redis.Client) int64 {
	t.Helper()
	info, err := node.Info(context.Background(), "commandstats").Result()
	require.NoError(t, err)
	for _, line := range strings.Split(info, "\n") {
		if rest, ok := strings.CutPrefix(strings.TrimSpace(line), "cmdstat_evalsha:calls="); ok {
			n, _, _ := strings.Cut(rest, ",")
			calls, err := strconv.ParseInt(n, 10, 64)
			require.NoError(t, err)
			return calls
		}
	}
	return 0
}

// TestNodePlainClient: with a plain client every key's node is the
// client's address, the name its one breaker is reported under.
func TestNodePlainClient(t *testing.T) {
	t.Parallel()
	srv := redistest.Shared(t)
	eng, err := throttle.New(srv.Client(t), throttle.WithPrefix(redistest.Prefix(t)))
	require.NoError(t, err)
	for _, k := range []string{"a", "b:{x}", "c"} {
		require.Equal(t, srv.Addr, eng.Node(context.Background(), k))
	}
}

// TestNodeRing: with a Ring, a key's node is the address of the shard the
// Ring sends it to (under the engine's prefix), and keys spread over both
// shards.
func TestNodeRing(t *testing.T) {
	t.Parallel()
	a, b := redistest.Start(t), redistest.Start(t)
	ring := redis.NewRing(&redis.RingOptions{Addrs: map[string]string{"a": a.Addr, "b": b.Addr}, ContextTimeoutEnabled: true})
	t.Cleanup(func() { _ = ring.Close() })
	prefix := redistest.Prefix(t)
	eng, err := throttle.New(ring, throttle.WithPrefix(prefix))
	require.NoError(t, err)
	seen := map[string]int{}
	for i := range 64 {
		k := "k" + strconv.Itoa(i)
		c, err := ring.GetShardClientForKey(prefix + k)
		require.NoError(t, err)
		node := eng.Node(context.Background(), k)
		require.Equal(t, c.Options().Addr, node, "the node of %s", k)
		seen[node]++
	}
	require.Len(t, seen, 2, "64 keys over two shards: %v", seen)
}

// ringSubjectOn returns a subject whose key (under prefix) the Ring sends
// to the shard at addr.
func ringSubjectOn(t *testing.T, ring *redis.Ring, prefix, addr string) string {
	t.Helper()
	for i := 0; i < 1000; i++ {
		s := "s" + strconv.Itoa(i)
		c, err := ring.GetShardClientForKey(prefix + s)
		require.NoError(t, err)
		if c.Options().Addr == addr {
			return s
		}
	}
	t.Fatalf("no subject on %s", addr)
	return ""
}

// TestRingShardDown: on a Ring of two shards with one stopped, subjects
// on that shard fail with ErrUnavailable and its breaker opens; subjects
// on the other shard are served, every call: each shard has a breaker of
// its own, as each master of a Cluster has. Once the Ring's heartbeat has
// marked the stopped shard down, its subjects go to the other shard, and
// its breaker, which no call reaches any more, is closed: the engine is
// not reported unavailable for good.
func TestRingShardDown(t *testing.T) {
	t.Parallel()
	for _, marked := range []bool{false, true} {
		t.Run(map[bool]string{false: "open", true: "marked down"}[marked], func(t *testing.T) {
			t.Parallel()
			a, b := redistest.Start(t), redistest.Start(t)
			hb := time.Hour // the Ring keeps sending to the stopped shard
			if marked {
				hb = 50 * time.Millisecond
			}
			ring := redis.NewRing(&redis.RingOptions{Addrs: map[string]string{"a": a.Addr, "b": b.Addr},
				ContextTimeoutEnabled: true, MaxRetries: -1, HeartbeatFrequency: hb})
			t.Cleanup(func() { _ = ring.Close() })
			log := &nodeLog{}
			prefix := redistest.Prefix(t)
			eng, err := throttle.New(ring, throttle.WithPrefix(prefix), throttle.WithTimeout(5*time.Second),
				throttle.WithProbeBackoff(25*time.Millisecond, 100*time.Millisecond), throttle.WithObserver(log))
			require.NoError(t, err)
			ctx := context.Background()
			dead := ringSubjectOn(t, ring, prefix, a.Addr)
			healthy := ringSubjectOn(t, ring, prefix, b.Addr)
			lim := throttle.PerSecond(1000, 1000)
			for _, s := range []string{dead, healthy} {
				redistest.UntilOK(t, func() error { _, err := eng.Allow(ctx, s, lim); return err })
			}
			log.reset()
			a.Stop()
			if !marked {
				_, err = eng.Allow(ctx, dead, lim)
				require.ErrorIs(t, err, throttle.ErrUnavailable)
				open, _ := eng.UnavailableFor(ctx, dead)
				require.True(t, open, "the stopped shard's breaker is open")
				for i := 0; i < 50; i++ {
					_, err := eng.Allow(ctx, healthy, lim)
					require.NoError(t, err, "call %d for a subject on the shard that answers", i)
					open, _ := eng.UnavailableFor(ctx, healthy)
					require.False(t, open)
				}
				require.Equal(t, []nodeChange{{a.Addr, true}}, log.getNodes(), "only the stopped shard's breaker opened")
				return
			}
			// Marked down: the dead shard's subjects move to b, and a's
			// breaker, if a call opened it meanwhile, is closed.
			require.Eventually(t, func() bool {
				_, err := eng.Allow(ctx, dead, lim)
				open, _ := eng.Unavailable()
				return err == nil && !open && eng.Node(ctx, dead) == b.Addr
			}, 10*time.Second, 10*time.Millisecond, "the stopped shard's subjects served by the other, and no breaker left open")
			changes := log.getNodes()
			for i, c := range changes {
				require.Equal(t, a.Addr, c.node, "change %d: only the stopped shard's breaker changed: %v", i, changes)
			}
			require.True(t, len(changes)%2 == 0, "every opening closed again: %v", changes)
		})
	}
}
