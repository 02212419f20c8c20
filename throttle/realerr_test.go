package throttle_test

import (
	"context"
	"errors"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/slotbook/slotbook/internal/redistest"
	"github.com/slotbook/slotbook/throttle"
)

// loadingSnapshot writes keys keys to a server of the test's own, saves
// them, and returns the path of the snapshot (an RDB file).
func loadingSnapshot(t *testing.T, keys int) string {
	t.Helper()
	ctx := context.Background()
	src := redistest.Start(t)
	rdb := src.Client(t)
	pipe := rdb.Pipeline()
	for i := 0; i < keys; i++ {
		pipe.Set(ctx, "filler:"+strconv.Itoa(i), i, 0)
	}
	_, err := pipe.Exec(ctx)
	require.NoError(t, err)
	require.NoError(t, rdb.Save(ctx).Err())
	dir, err := rdb.ConfigGet(ctx, "dir").Result()
	require.NoError(t, err)
	return filepath.Join(dir["dir"], "dump.rdb")
}

// TestLoading makes a real redis-server answer -LOADING (it loads a
// snapshot slowly, through Redis 7's hidden key-load-delay setting) and
// checks the class the package doc gives it: the engine's calls fail with
// ErrUnavailable, not ErrReplyLost (Redis refused them: nothing ran), the
// node's breaker opens, and calls succeed once loading ends, none of the
// refused ones having booked anything.
func TestLoading(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	const keys = 4000
	snapshot := loadingSnapshot(t, keys)
	lim := throttle.PerHour(1, 0) // one booking an hour: a second one would be refused
	var (
		srv *redistest.Server
		raw *redis.Client
		eng *throttle.Engine
		log *nodeLog
		err error
	)
	// 4000 keys at 500µs each or more: 2 s of loading at least, answering
	// clients every KiB of the snapshot (every 20 ms or so). Should a busy
	// machine hold the test up until loading is over, it tries again with
	// a longer delay.
	for delay := 500; ; delay *= 2 {
		srv = redistest.StartSnapshot(t, snapshot,
			"--key-load-delay", strconv.Itoa(delay), "--loading-process-events-interval-bytes", "1024")
		raw = srv.Client(t)
		log = &nodeLog{}
		eng, err = throttle.New(srv.Client(t), throttle.WithTimeout(5*time.Second), throttle.WithObserver(log))
		require.NoError(t, err)
		// The server says it is loading: the test sees what it claims to.
		ping := raw.Ping(ctx).Err()
		if redis.HasErrorPrefix(ping, "LOADING") {
			if _, err = eng.Book(ctx, "k", lim, throttle.Request{N: 1}); err != nil {
				break
			}
		}
		require.Less(t, delay, 4000, "the server was never seen loading: PING said %v, the booking %v", ping, err)
		t.Logf("loading was over before the test looked (key-load-delay %dµs); again, slower", delay)
		srv.Stop()
	}
	t.Logf("while loading: %v", err)
	require.ErrorIs(t, err, throttle.ErrUnavailable)
	require.NotErrorIs(t, err, throttle.ErrReplyLost, "refused: nothing ran")
	var rerr redis.Error
	require.True(t, errors.As(err, &rerr) && redis.HasErrorPrefix(rerr, "LOADING"), "Redis's own error is kept: %v", err)
	open, _ := eng.Unavailable()
	require.True(t, open, "the breaker opened")
	require.Equal(t, []nodeChange{{srv.Addr, true}}, log.getNodes(), "the loading node's breaker opened")

	// Until loading ends every call fails as unavailable, refused at once
	// by the open breaker or by Redis; then one succeeds and closes it.
	var loading, fast int
	deadline := time.Now().Add(30 * time.Second)
	for {
		res, err := eng.Allow(ctx, "k", lim)
		if err == nil {
			require.True(t, res.Allowed, "nothing was booked while loading")
			break
		}
		require.ErrorIs(t, err, throttle.ErrUnavailable)
		require.NotErrorIs(t, err, throttle.ErrReplyLost, "refused: nothing ran")
		if errors.As(err, &rerr) {
			require.True(t, redis.HasErrorPrefix(rerr, "LOADING"), "got %v, want LOADING", err)
			loading++
		} else {
			fast++
		}
		require.True(t, time.Now().Before(deadline), "still failing after 30 s: %v", err)
		time.Sleep(5 * time.Millisecond)
	}
	t.Logf("after the first failure: %d calls refused by Redis (probes), %d by the open breaker", loading, fast)
	// Loading is over: every key is there, and the breaker has closed.
	require.NoError(t, raw.Ping(ctx).Err())
	require.Equal(t, int64(keys+1), raw.DBSize(ctx).Val(), "the snapshot's keys and the booking")
	open, _ = eng.Unavailable()
	require.False(t, open, "a success closed the breaker")
	require.Equal(t, []nodeChange{{srv.Addr, true}, {srv.Addr, false}}, log.getNodes())
	b, err := eng.Book(ctx, "k", lim, throttle.Request{N: 1})
	require.NoError(t, err)
	require.False(t, b.OK, "the one booking of the hour is taken, by the call that succeeded")
}

// migrating is a slot of a 3-master cluster set migrating from its owner
// to another master, as redis-cli --cluster reshard does before it moves
// the slot's keys.
type migrating struct {
	slot           int64
	owner, target  *redis.Client // clients of the two masters
	ownerID, tgtID string
}

// migrate sets the slot of key (a full key, prefix included) migrating from
// its owner to another master: IMPORTING on the target, then MIGRATING on
// the owner. The slot is made stable again when the test ends.
func migrate(t *testing.T, cluster *redistest.Cluster, cc *redis.ClusterClient, key string) *migrating {
	t.Helper()
	ctx := context.Background()
	slot, err := cc.ClusterKeySlot(ctx, key).Result()
	require.NoError(t, err)
	m, err := cc.MasterForKey(ctx, key)
	require.NoError(t, err)
	owner := -1
	for i, a := range cluster.Addrs {
		if a == m.Options().Addr {
			owner = i
		}
	}
	require.GreaterOrEqual(t, owner, 0, "the owner %s is a node of the cluster", m.Options().Addr)
	mg := &migrating{slot: slot,
		owner:  cluster.Node(owner).Client(t),
		target: cluster.Node((owner + 1) % len(cluster.Addrs)).Client(t)}
	mg.ownerID, err = mg.owner.Do(ctx, "CLUSTER", "MYID").Text()
	require.NoError(t, err)
	mg.tgtID, err = mg.target.Do(ctx, "CLUSTER", "MYID").Text()
	require.NoError(t, err)
	require.NoError(t, mg.target.Do(ctx, "CLUSTER", "SETSLOT", slot, "IMPORTING", mg.ownerID).Err())
	require.NoError(t, mg.owner.Do(ctx, "CLUSTER", "SETSLOT", slot, "MIGRATING", mg.tgtID).Err())
	t.Cleanup(mg.stable)
	return mg
}

// stable ends the migration: the slot stays with its owner.
func (mg *migrating) stable() {
	ctx := context.Background()
	_ = mg.owner.Do(ctx, "CLUSTER", "SETSLOT", mg.slot, "STABLE").Err()
	_ = mg.target.Do(ctx, "CLUSTER", "SETSLOT", mg.slot, "STABLE").Err()
}

// rejected returns how many calls of the command (lower case: "evalsha")
// the node refused before running them (a redirection, TRYAGAIN...).
func rejected(t *testing.T, node *redis.Client, command string) int64 {
	t.Helper()
	info, err := node.Info(context.Background(), "commandstats").Result()
	require.NoError(t, err)
	for _, line := range strings.Split(info, "\n") {
		if rest, ok := strings.CutPrefix(strings.TrimSpace(line), "cmdstat_"+command+":"); ok {
			for _, f := range strings.Split(rest, ",") {
				if v, ok := strings.CutPrefix(f, "rejected_calls="); ok {
					n, err := strconv.ParseInt(v, 10, 64)
					require.NoError(t, err)
					return n
				}
			}
		}
	}
	return 0
}

// TestTryAgain makes a real 3-master cluster answer -TRYAGAIN: a layered
// subject (BookAll on two keys sharing a hash tag) whose slot is being
// resharded, one key there and the other not. go-redis sends the engine's
// script once (it is a NoRetry command; an ordinary command is retried on
// TRYAGAIN), and the engine reports ErrUnavailable without ErrReplyLost:
// Redis refused the call, nothing ran. Once the slot is stable again the
// subject is served.
func TestTryAgain(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	cluster := redistest.StartCluster(t, 3)
	cc := cluster.Client(t)
	eng, err := throttle.New(cc, throttle.WithTimeout(5*time.Second))
	require.NoError(t, err)
	keys := []string{"api:{s}", "api:{s}:1h0m0s"}
	full := []string{throttle.DefaultPrefix + keys[0], throttle.DefaultPrefix + keys[1]}
	limits := []throttle.Limit{throttle.PerHour(10, 9), throttle.PerHour(10, 9)}
	// The first key exists (booked alone), the second does not.
	redistest.UntilOK(t, func() error {
		_, err := eng.Book(ctx, keys[0], limits[0], throttle.Request{N: 1})
		return err
	})
	require.NoError(t, eng.Load(ctx)) // on every master: no NOSCRIPT below
	mg := migrate(t, cluster, cc, full[0])
	before, err := mg.owner.Get(ctx, full[0]).Result()
	require.NoError(t, err)

	// The owner answers TRYAGAIN: the test sees what it claims to. And
	// go-redis retries an ordinary command on it (a control for the
	// engine's, sent once below).
	err = mg.owner.Eval(ctx, "return 1", full).Err()
	require.True(t, redis.HasErrorPrefix(err, "TRYAGAIN"), "the owner refuses the split keys: %v", err)
	evals := rejected(t, mg.owner, "eval")
	err = cc.Eval(ctx, "return 1", full).Err()
	require.True(t, redis.HasErrorPrefix(err, "TRYAGAIN"), "through the cluster client: %v", err)
	tries := rejected(t, mg.owner, "eval") - evals
	t.Logf("go-redis sent an ordinary EVAL %d times", tries)
	require.Greater(t, tries, int64(1), "go-redis retries an ordinary command on TRYAGAIN")

	sent := rejected(t, mg.owner, "evalsha")
	_, err = eng.BookAll(ctx, keys, limits, []throttle.Request{{N: 1}})
	t.Logf("while the slot migrates: %v", err)
	require.ErrorIs(t, err, throttle.ErrUnavailable)
	require.NotErrorIs(t, err, throttle.ErrReplyLost, "refused: nothing ran")
	var rerr redis.Error
	require.True(t, errors.As(err, &rerr) && redis.HasErrorPrefix(rerr, "TRYAGAIN"), "Redis's own error is kept: %v", err)
	require.Equal(t, sent+1, rejected(t, mg.owner, "evalsha"), "sent once: go-redis does not retry the engine's script")
	after, err := mg.owner.Get(ctx, full[0]).Result()
	require.NoError(t, err)
	require.Equal(t, before, after, "nothing written")
	for _, node := range []*redis.Client{mg.owner, mg.target} {
		require.Zero(t, node.Exists(ctx, full[1]).Val(), "nothing written")
	}
	// What the open breaker does to another subject of the same master
	// (see the package doc's table): logged, not judged here.
	other := subjectOn(t, cc, throttle.DefaultPrefix, mg.owner.Options().Addr)
	require.NotEqual(t, mg.slot, cc.ClusterKeySlot(ctx, throttle.DefaultPrefix+other).Val(), "another slot")
	_, err = eng.Allow(ctx, other, limits[0])
	t.Logf("another subject of the same master, right after: %v", err)

	mg.stable()
	redistest.UntilOK(t, func() error { _, err := eng.BookAll(ctx, keys, limits, []throttle.Request{{N: 1}}); return err })
	require.Equal(t, int64(1), mg.owner.Exists(ctx, full[1]).Val(), "booked on the owner once the slot is stable")
}

// TestTryAgainSparesNode: TRYAGAIN is one slot being resharded, not a node
// down. While a layered subject's slot migrates with its keys split (every
// call for it refused with TRYAGAIN, as long as the migration lasts), the
// other subjects of the same master are served, every call, and no breaker
// opens: the master answered.
func TestTryAgainSparesNode(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	cluster := redistest.StartCluster(t, 3)
	cc := cluster.Client(t)
	log := &nodeLog{}
	eng, err := throttle.New(cc, throttle.WithTimeout(5*time.Second), throttle.WithObserver(log))
	require.NoError(t, err)
	keys := []string{"api:{s}", "api:{s}:1h0m0s"}
	limits := []throttle.Limit{throttle.PerHour(10, 9), throttle.PerHour(10, 9)}
	lim := throttle.PerHour(1000, 999)
	redistest.UntilOK(t, func() error {
		_, err := eng.Book(ctx, keys[0], limits[0], throttle.Request{N: 1})
		return err
	})
	mg := migrate(t, cluster, cc, throttle.DefaultPrefix+keys[0])
	other := subjectOn(t, cc, throttle.DefaultPrefix, mg.owner.Options().Addr)
	require.NotEqual(t, mg.slot, cc.ClusterKeySlot(ctx, throttle.DefaultPrefix+other).Val(), "another slot")
	redistest.UntilOK(t, func() error { _, err := eng.Allow(ctx, other, lim); return err })
	before := len(log.getNodes())

	failed := 0
	const rounds = 100
	for i := 0; i < rounds; i++ {
		_, err := eng.BookAll(ctx, keys, limits, []throttle.Request{{N: 1}})
		require.ErrorIs(t, err, throttle.ErrUnavailable, "round %d: the split subject", i)
		require.NotErrorIs(t, err, throttle.ErrReplyLost)
		if _, err := eng.Allow(ctx, other, lim); err != nil {
			failed++
			require.ErrorIs(t, err, throttle.ErrUnavailable)
		}
	}
	t.Logf("%d of %d calls for another subject of the master failed", failed, rounds)
	require.Zero(t, failed, "calls for another subject of the migrating slot's master failed")
	open, _ := eng.UnavailableFor(ctx, other)
	require.False(t, open, "the master answered: its breaker stays closed")
	require.Len(t, log.getNodes(), before, "no breaker changed")
}
