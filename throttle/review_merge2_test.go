package throttle_test

// Review of 651916b (a merged call the server refuses before running it
// has its requests sent again alone; CROSSSLOT, MOVED and ASK turn merging
// off; NOPERM does not) through the public API. Room is judged by the next
// booking's slot on the Redis clock (Booking().At), one interval after the
// booking that stands.

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/slotbook/slotbook/internal/callcount"
	"github.com/slotbook/slotbook/internal/redistest"
	"github.com/slotbook/slotbook/throttle"
)

// merge2Round books one single request on each of keys at once while the
// one connection is held (so that they would merge), then checks that
// each key was booked exactly once (its next booking lies one interval
// after it) and returns how many calls the round made, the holder's
// included.
func merge2Round(t *testing.T, eng *throttle.Engine, calls *callcount.Counter, holder string, keys []string, lim throttle.Limit) int64 {
	t.Helper()
	before := calls.Load()
	held := holdConnection(t, eng, holder)
	bs, errs := bookAt(eng, keys, lim, throttle.Request{N: 1, MaxWait: throttle.Forever})
	require.NoError(t, <-held)
	n := calls.Load() - before
	for i, k := range keys {
		require.NoError(t, errs[i], k)
		require.True(t, bs[i].OK, k)
		require.Zero(t, bs[i].Wait, "%s: a fresh key's slot is immediate", k)
		next, err := eng.Book(context.Background(), k, lim, throttle.Request{N: 1, MaxWait: throttle.Forever})
		require.NoError(t, err)
		require.Equal(t, bs[i].At.Add(lim.Interval()), next.At, "%s booked once", k)
	}
	return n
}

// TestReviewMerge2CrossSlotTurnsMergingOff: a plain client in front of a
// server that wants a call's keys in one slot (a cluster-enabled node
// holding every slot). The first round's merged call is refused
// (CROSSSLOT) and its requests are sent again alone: 1 + 1 + k calls.
// Merging is then off for the engine: the next rounds make one call per
// booking (1 + k), none refused, and every key is booked once.
func TestReviewMerge2CrossSlotTurnsMergingOff(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t, "--cluster-enabled", "yes")
	admin := srv.Client(t)
	ctx := context.Background()
	require.NoError(t, admin.Do(ctx, "CLUSTER", "ADDSLOTSRANGE", 0, 16383).Err())
	redistest.UntilOK(t, func() error {
		info, err := admin.ClusterInfo(ctx).Result()
		if err == nil && !strings.Contains(info, "cluster_state:ok") {
			err = errors.New("cluster not ok")
		}
		return err
	})
	eng, _, _, _, calls := reviewProxied(t, srv, 150*time.Millisecond, nil)
	lim := throttle.Every(10*time.Second, 1, 0) // the next booking lies an interval on
	for round := range 2 {
		var keys []string
		for k := range 4 {
			keys = append(keys, fmt.Sprintf("r%d-x%d", round, k))
		}
		n := merge2Round(t, eng, calls, fmt.Sprintf("holder%d", round), keys, lim)
		t.Logf("round %d: %d calls for %d bookings and the holder", round, n, len(keys))
		if round == 0 {
			require.GreaterOrEqual(t, n, int64(1+len(keys)), "round 0: every booking sent alone in the end")
			continue
		}
		require.Equal(t, int64(1+len(keys)), n, "round %d: merging is off: one call per booking, none refused", round)
	}
}

// TestReviewMerge2NopermKeepsMerging: the engine runs as a Redis user
// allowed only keys under "<prefix>ok". A merged call with an outsider is
// refused (NOPERM) and its requests sent again alone; merging stays on:
// the next round, with allowed keys only, merges (fewer calls than
// bookings), and every allowed key is booked once.
func TestReviewMerge2NopermKeepsMerging(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	admin := srv.Client(t)
	ctx := context.Background()
	prefix := redistest.Prefix(t)
	user := "rev2"
	require.NoError(t, admin.Do(ctx, append([]any{"ACL", "SETUSER", user, "on", ">secret", "resetkeys", "~" + prefix + "ok*", "resetchannels", "-@all"},
		splitAny(aclCommands)...)...).Err())
	p := redistest.NewProxy(t, srv.Addr)
	rdb := p.Client(t, srv, func(o *redis.Options) {
		o.PoolSize = 1
		o.Username, o.Password = user, "secret"
	})
	eng, err := throttle.New(rdb, throttle.WithPrefix(prefix), throttle.WithTimeout(5*time.Second))
	require.NoError(t, err)
	require.NoError(t, eng.Load(ctx))
	require.NoError(t, rdb.Ping(ctx).Err())
	calls := callcount.Attach(rdb)
	p.SetReplyDelay(150 * time.Millisecond)
	lim := throttle.Every(10*time.Second, 1, 0) // the next booking lies an interval on

	// Round 0: an outsider among them.
	held := holdConnection(t, eng, "ok-holder0")
	keys := []string{"ok-a0", "outsider", "ok-b0", "ok-c0"}
	bs, errs := bookAt(eng, keys, lim, throttle.Request{N: 1, MaxWait: throttle.Forever})
	require.NoError(t, <-held)
	require.ErrorContains(t, errs[1], "NOPERM")
	for _, i := range []int{0, 2, 3} {
		require.NoError(t, errs[i], keys[i])
		require.True(t, bs[i].OK)
	}
	// Round 1: allowed keys only: merged.
	var allowed []string
	for k := range 6 {
		allowed = append(allowed, fmt.Sprintf("ok-r1-%d", k))
	}
	n := merge2Round(t, eng, calls, "ok-holder1", allowed, lim)
	t.Logf("round 1: %d calls for %d bookings and the holder", n, len(allowed))
	require.Less(t, n, int64(1+len(allowed)), "merging stays on after NOPERM")
}

// merge2Obs keeps the limiter of every call it is told of.
type merge2Obs struct{ callLog }

// TestReviewMerge2ObservedOncePerLimiter: single bookings of three
// limiters (labels "a", "b", "c"; "a" twice) merged behind a held
// connection into one call. The observer hears of the call once for each
// limiter in it: "a", "b" and "c" once each beyond the holder's and the
// checks' own calls, never "a" twice for the one call.
func TestReviewMerge2ObservedOncePerLimiter(t *testing.T) {
	t.Parallel()
	obs := &merge2Obs{}
	srv := redistest.Shared(t)
	eng, _, _, _, calls := reviewProxied(t, srv, 200*time.Millisecond, nil, throttle.WithObserver(obs))
	before := calls.Load()
	held := holdConnection(t, eng, "h:holder")
	keys := []string{"a:{1}", "b:{2}", "a:{3}", "c:{4}"}
	bs, errs := bookAt(eng, keys, throttle.PerSecond(10, 0), throttle.Request{N: 1, MaxWait: throttle.Forever})
	require.NoError(t, <-held)
	n := calls.Load() - before
	for i := range keys {
		require.NoError(t, errs[i])
		require.True(t, bs[i].OK)
	}
	obs.mu.Lock()
	count := map[string]int{}
	for _, c := range obs.calls {
		count[c.limiter]++
	}
	obs.mu.Unlock()
	t.Logf("%d calls; observed %v", n, count)
	if n != 2 {
		t.Skipf("the four were not merged into one call (%d calls): inconclusive", n)
	}
	require.Equal(t, map[string]int{"h": 1, "a": 1, "b": 1, "c": 1}, count)
}
