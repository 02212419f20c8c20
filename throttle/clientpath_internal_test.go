package throttle

import (
	"context"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/slotbook/slotbook/internal/redistest"
)

// TestKeySlot: the engine's hash slot is the one the Redis Cluster
// specification defines: CRC16/XMODEM, whose check value for "123456789"
// is 0x31C3, of the hash tag if there is one, modulo 16384. The other
// figures are CLUSTER KEYSLOT's answers in the Redis documentation.
func TestKeySlot(t *testing.T) {
	require.Equal(t, 0x31C3, keySlot("123456789"))
	require.Equal(t, 11058, keySlot("somekey"))
	require.Equal(t, 2515, keySlot("foo{hash_tag}"))
	require.Equal(t, keySlot("hash_tag"), keySlot("foo{hash_tag}"))
	require.Equal(t, keySlot("a{}b"), keySlot("a{}b"), "an empty tag hashes the whole key")
	require.NotEqual(t, keySlot("{}"), keySlot(""))
}

// TestBoundSavesTheTimer: a call gets a deadline of its own only where
// nothing else bounds it: not when the caller's deadline comes first, nor
// when the client's read, write and dial timeouts are all no longer than
// the engine's timeout.
func TestBoundSavesTheTimer(t *testing.T) {
	now := time.Now()
	rdb := redis.NewClient(&redis.Options{Addr: "127.0.0.1:1", ContextTimeoutEnabled: true,
		ReadTimeout: time.Second, WriteTimeout: time.Second, DialTimeout: 2 * time.Second})
	t.Cleanup(func() { _ = rdb.Close() })

	tight, err := New(rdb, WithTimeout(50*time.Millisecond))
	require.NoError(t, err)
	require.Equal(t, 2*time.Second, tight.clientBound)

	// No caller deadline: the engine's own.
	ctx, cancel := tight.bound(context.Background(), tight.timeout, now)
	dl, ok := ctx.Deadline()
	cancel()
	require.True(t, ok)
	require.WithinDuration(t, now.Add(50*time.Millisecond), dl, 10*time.Second)

	// A later caller deadline: the engine's, sooner.
	later, cancelLater := context.WithDeadline(context.Background(), now.Add(time.Hour))
	defer cancelLater()
	ctx, cancel = tight.bound(later, tight.timeout, now)
	dl, _ = ctx.Deadline()
	cancel()
	require.WithinDuration(t, now.Add(50*time.Millisecond), dl, 10*time.Second)

	// An earlier caller deadline bounds the call already: no new context.
	sooner, cancelSooner := context.WithDeadline(context.Background(), now.Add(10*time.Millisecond))
	defer cancelSooner()
	ctx, cancel = tight.bound(sooner, tight.timeout, now)
	cancel()
	require.Equal(t, sooner, ctx)

	// The client's timeouts no longer than the engine's: no new context.
	loose, err := New(rdb, WithTimeout(5*time.Second))
	require.NoError(t, err)
	ctx, cancel = loose.bound(later, loose.timeout, now)
	cancel()
	require.Equal(t, later, ctx)

	// A client timeout unset (no bound): the engine's own.
	unbounded := redis.NewClient(&redis.Options{Addr: "127.0.0.1:1", ContextTimeoutEnabled: true, ReadTimeout: -1})
	t.Cleanup(func() { _ = unbounded.Close() })
	e, err := New(unbounded, WithTimeout(time.Hour))
	require.NoError(t, err)
	require.Zero(t, e.clientBound)
	ctx, cancel = e.bound(context.Background(), e.timeout, now)
	_, ok = ctx.Deadline()
	cancel()
	require.True(t, ok)
}

// TestBreakerSuccessRacingFailure: a success that ends after a failing
// call started keeps the breaker closed (the failure was the client's
// own), whichever of the two records first, though a closed breaker's
// success takes no lock.
func TestBreakerSuccessRacingFailure(t *testing.T) {
	bs := newBreakers()
	b := bs.get("n")
	for i := 0; i < 2000; i++ {
		start := time.Now()
		var wg sync.WaitGroup
		wg.Add(2)
		go func() { defer wg.Done(); bs.failureB(b, start) }()
		go func() { defer wg.Done(); bs.successB(b, time.Now()) }()
		wg.Wait()
		open, _ := bs.stateOf("n")
		require.False(t, open, "round %d: a success after the failing call's start left the breaker open", i)
	}
}

// TestBreakerFastPath: a closed breaker lets calls through and records
// successes without allocating; an open one fails calls fast until its
// probe is due, and the probe's success closes it.
func TestBreakerFastPath(t *testing.T) {
	bs := newBreakers()
	bs.min, bs.max = time.Hour, time.Hour
	b := bs.get("n")
	allocs := testing.AllocsPerRun(100, func() {
		if ok, _ := bs.allowB(b); !ok {
			t.Fatal("a closed breaker refused a call")
		}
		bs.successB(b, time.Now())
	})
	require.Zero(t, allocs)

	bs.failureB(b, time.Now())
	ok, _ := bs.allowB(b)
	require.False(t, ok, "open: fail fast")
	b.next = time.Now() // the probe is due (the test holds the only reference)
	ok, probe := bs.allowB(b)
	require.True(t, ok)
	require.True(t, probe)
	ok, _ = bs.allowB(b)
	require.False(t, ok, "one probe at a time")
	bs.successB(b, time.Now())
	open, _ := bs.stateOf("n")
	require.False(t, open)
}

// TestClusterSlotCache: on a 3-master Redis Cluster the engine's slot of
// every key is the cluster's (CLUSTER KEYSLOT), and the node it counts a
// call against, cached per slot, is the master the client's slot map
// names for the key, on the first lookup and from the cache.
func TestClusterSlotCache(t *testing.T) {
	t.Parallel()
	cluster := redistest.StartCluster(t, 3)
	cc := cluster.Client(t)
	e, err := New(cc, WithTimeout(5*time.Second))
	require.NoError(t, err)
	ctx := context.Background()
	require.NoError(t, e.Load(ctx))
	seen := map[string]bool{}
	for i := 0; i < 300; i++ {
		key := DefaultPrefix + "k" + strconv.Itoa(i)
		if i%3 == 0 {
			key = DefaultPrefix + "api:{tenant-" + strconv.Itoa(i) + "}"
		}
		slot, err := cc.ClusterKeySlot(ctx, key).Result()
		require.NoError(t, err)
		require.Equal(t, int(slot), keySlot(key), "slot of %q", key)
		m, err := cc.MasterForKey(ctx, key)
		require.NoError(t, err)
		want := m.Options().Addr
		require.Equal(t, want, e.node(ctx, key), "first lookup of %q", key)
		r, cached, _ := e.nodeFor(ctx, key, time.Now())
		require.True(t, cached, "%q: the second lookup is the cache's", key)
		require.Equal(t, want, r.name, "cached node of %q", key)
		seen[want] = true
	}
	require.Len(t, seen, 3, "keys on every master")
	e.forgetSlot(DefaultPrefix + "k1")
	_, cached, _ := e.nodeFor(ctx, DefaultPrefix+"k1", time.Now())
	require.False(t, cached, "a forgotten slot is looked up again")
	_, cached, _ = e.nodeFor(ctx, DefaultPrefix+"k1", time.Now().Add(2*slotCacheTTL))
	require.False(t, cached, "an entry older than slotCacheTTL is looked up again")
}
