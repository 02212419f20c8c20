package reserve_test

import (
	"context"
	"slices"
	"strconv"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/slotbook/slotbook/internal/redistest"
	"github.com/slotbook/slotbook/internal/testhook"
	"github.com/slotbook/slotbook/reserve"
	"github.com/slotbook/slotbook/throttle"
)

// layered is 10/s burst 2 and 20/min burst 4: three at once, then 100ms
// apart, until the per-minute limit binds after five, at 3 s apart.
func layered(t *testing.T, eng *throttle.Engine, opts ...reserve.Option) *reserve.Limiter {
	t.Helper()
	l, err := reserve.New(eng, "api", throttle.PerSecond(10, 2), append(opts, reserve.WithLimit(throttle.PerMinute(20, 4)))...)
	require.NoError(t, err)
	return l
}

var layeredWaits = []time.Duration{0, 0, 0, 100 * time.Millisecond, 200 * time.Millisecond, 3 * time.Second, 6 * time.Second}

func bookWaits(t *testing.T, l *reserve.Limiter, ctx context.Context, subject string, n int) []time.Duration {
	t.Helper()
	var waits []time.Duration
	for i := 0; i < n; i++ {
		r, err := l.Reserve(ctx, subject)
		require.NoError(t, err)
		require.True(t, r.OK(), "booking %d: %v", i, r.Err())
		waits = append(waits, r.Booking().Wait)
	}
	return waits
}

func TestLayeredLimiter(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	l := layered(t, e.eng)
	ctx := testhook.WithNow(context.Background(), time.Now().UnixMicro())
	require.Equal(t, layeredWaits, bookWaits(t, l, ctx, "s", len(layeredWaits)))
	keys, err := e.rdb.Keys(ctx, e.prefix+"*").Result()
	require.NoError(t, err)
	slices.Sort(keys)
	// Wire protocol 2: the second limit's key ends in its period in ms.
	require.Equal(t, []string{e.prefix + "api:{s}", e.prefix + "api:{s}:60000ms"}, keys)

	// A refusal books nothing in either; a cancel gives back to both.
	capped, err := l.With(reserve.WithMaxWait(time.Second))
	require.NoError(t, err)
	r, err := capped.Reserve(ctx, "s")
	require.NoError(t, err)
	require.False(t, r.OK())
	require.Equal(t, 9*time.Second, r.RetryAfter())
	r, err = l.Reserve(ctx, "s")
	require.NoError(t, err)
	require.Equal(t, 9*time.Second, r.Booking().Wait)
	require.NoError(t, r.Cancel(ctx))
	r, err = l.Reserve(ctx, "s")
	require.NoError(t, err)
	require.Equal(t, 9*time.Second, r.Booking().Wait, "the slot was given back in both limits")
	require.Equal(t, 2, len(l.Limits()))
}

func TestLayeredBadOptions(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	for name, opt := range map[string]reserve.Option{
		"same period twice": reserve.WithLimit(throttle.PerSecond(5, 0)),
		"invalid":           reserve.WithLimit(throttle.PerMinute(0, 0)),
		"too many": reserve.WithLimit(throttle.PerMinute(1, 0), throttle.PerHour(1, 0), throttle.PerDay(1, 0),
			throttle.Every(2*time.Second, 1, 0), throttle.Every(3*time.Second, 1, 0), throttle.Every(4*time.Second, 1, 0),
			throttle.Every(5*time.Second, 1, 0), throttle.Every(6*time.Second, 1, 0)),
	} {
		_, err := reserve.New(e.eng, "api", throttle.PerSecond(10, 0), opt)
		require.Error(t, err, name)
	}
	// A further limit's key is named after its period in whole milliseconds.
	_, err := reserve.New(e.eng, "api", throttle.PerSecond(10, 0), reserve.WithLimit(throttle.Every(1500*time.Microsecond, 1, 0)))
	require.ErrorIs(t, err, throttle.ErrInvalidLimit, "a period of 1.5ms")
	l := layered(t, e.eng)
	before := e.calls.Load()
	_, err = l.ReserveN(context.Background(), "s", 4) // within 10/s burst 2? no: n > 3
	require.ErrorIs(t, err, throttle.ErrExceedsBurst)
	require.Equal(t, before, e.calls.Load())
}

// TestPause: a 429 seen by one process pauses every process's slots.
func TestPause(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	a := e.limiter(t, throttle.PerSecond(10, 5))
	b := e.limiter(t, throttle.PerSecond(10, 5))
	ctx := testhook.WithNow(context.Background(), time.Now().UnixMicro())
	require.NoError(t, a.Pause(ctx, "partner", 2*time.Second))
	r, err := b.Reserve(ctx, "partner")
	require.NoError(t, err)
	require.Equal(t, 2*time.Second, r.Booking().Wait)
	r, err = b.Reserve(ctx, "partner")
	require.NoError(t, err)
	require.Equal(t, 2100*time.Millisecond, r.Booking().Wait, "resumes one interval apart")
	require.ErrorIs(t, a.Pause(ctx, "", time.Second), throttle.ErrInvalidRequest)

	l := layered(t, e.eng)
	require.NoError(t, l.Pause(ctx, "s", time.Second))
	require.Equal(t, []time.Duration{time.Second, 1100 * time.Millisecond}, bookWaits(t, l, ctx, "s", 2))
}

// TestCluster runs layered limits on a real three-node Redis Cluster:
// subjects spread over the nodes, each subject's keys stay on one, and
// every limit holds.
func TestCluster(t *testing.T) {
	t.Parallel()
	cluster := redistest.StartCluster(t, 3)
	cc := cluster.Client(t)
	prefix := redistest.Prefix(t)
	eng, err := throttle.New(cc, throttle.WithPrefix(prefix), throttle.WithTimeout(5*time.Second))
	require.NoError(t, err)
	l := layered(t, eng)
	ctx := testhook.WithNow(context.Background(), time.Now().UnixMicro())

	nodes := map[string]bool{}
	for i := 0; i < 12; i++ {
		subject := "tenant-" + strconv.Itoa(i)
		require.Equal(t, layeredWaits, bookWaits(t, l, ctx, subject, len(layeredWaits)), subject)
		var owners []string
		for _, k := range []string{"api:{" + subject + "}", "api:{" + subject + "}:60000ms"} {
			node, err := cc.MasterForKey(ctx, prefix+k)
			require.NoError(t, err)
			owners = append(owners, node.Options().Addr)
		}
		require.Equal(t, owners[0], owners[1], "a subject's keys on one node")
		nodes[owners[0]] = true
	}
	require.GreaterOrEqual(t, len(nodes), 2, "subjects spread over the nodes")

	// Check mode, refunds, back-off and heartbeats work there too.
	res, err := l.Allow(ctx, "tenant-0")
	require.NoError(t, err)
	require.False(t, res.Allowed)
	require.NoError(t, l.Pause(ctx, "tenant-0", time.Minute))
	_, err = eng.Heartbeat(ctx, "api", "p1", time.Second)
	require.NoError(t, err)
	require.NoError(t, l.Reset(ctx, "tenant-0"))

	// The engine's own keys, with a hash tag or without: a refund's
	// tombstone lives on the key's node.
	for _, k := range []string{"plain", "tagged:{t}"} {
		_, err := eng.Book(ctx, k, throttle.PerMinute(1, 0), throttle.Request{N: 1, MaxWait: throttle.Forever})
		require.NoError(t, err, k)
		b, err := eng.Book(ctx, k, throttle.PerMinute(1, 0), throttle.Request{N: 1, MaxWait: throttle.Forever})
		require.NoError(t, err, k)
		given, err := eng.Refund(ctx, k, throttle.PerMinute(1, 0), b)
		require.NoError(t, err, k)
		require.Equal(t, time.Minute, given, k)
	}
	_, err = eng.Allow(ctx, "a{}b", throttle.PerMinute(1, 0))
	require.ErrorIs(t, err, throttle.ErrInvalidRequest, "braces without a hash tag")

	// A UniversalClient over the cluster's addresses fits as well.
	uc := redis.NewUniversalClient(&redis.UniversalOptions{Addrs: cluster.Addrs, ContextTimeoutEnabled: true})
	defer uc.Close()
	ueng, err := throttle.New(uc, throttle.WithPrefix(prefix), throttle.WithTimeout(5*time.Second))
	require.NoError(t, err)
	ul := layered(t, ueng)
	r, err := ul.Reserve(ctx, "tenant-1")
	require.NoError(t, err)
	require.Equal(t, 9*time.Second, r.Booking().Wait, "the same state, through another client")
}
