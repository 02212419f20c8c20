package main

import (
	"context"
	"errors"
	"strconv"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/slotbook/slotbook/internal/callcount"
	"github.com/slotbook/slotbook/internal/contention"
	"github.com/slotbook/slotbook/internal/redistest"
	"github.com/slotbook/slotbook/reserve"
	"github.com/slotbook/slotbook/throttle"
)

// TestReviewCoalescingMeasurementsApart replays measureCoalescing's three
// runs (coalesced, uncoalesced merged, uncoalesced with merging off) on
// one client and one call counter, as it does, and pins what the table
// relies on: no Redis call of a run is made after its last reservation
// has returned (so none is counted in the next run's figure), the
// merging-off engine makes exactly one call per reservation after the
// merged engine's run, and the shared key's TAT stays within the limit's
// tolerance of the Redis clock (the limit is never reached, so no booking
// is refused late and given back on a goroutine of its own).
func TestReviewCoalescingMeasurementsApart(t *testing.T) {
	if testing.Short() {
		t.Skip("a few seconds: skipped with -short")
	}
	srv := redistest.Shared(t)
	srv.RequireReal(t)
	rdb := srv.Client(t)
	calls := callcount.Attach(rdb)
	prefix := redistest.Prefix(t)
	ctx := context.Background()
	eng, err := throttle.New(rdb, throttle.WithPrefix(prefix), throttle.WithTimeout(5*time.Second))
	require.NoError(t, err)
	require.NoError(t, eng.Load(ctx))
	alone, err := throttle.New(rdb, throttle.WithPrefix(prefix), throttle.WithTimeout(5*time.Second), throttle.WithMerging(false))
	require.NoError(t, err)
	open := throttle.PerSecond(1_000_000, 1_000_000)
	const total = 10_000

	// tatAhead reads the one key under prefix (without counting: a client
	// of its own) and returns how far its TAT is past the Redis clock, 0
	// when the key has already expired.
	probe := srv.Client(t)
	tatAhead := func() time.Duration {
		keys, err := probe.Keys(ctx, prefix+"*").Result()
		require.NoError(t, err)
		require.LessOrEqual(t, len(keys), 1, "the three runs share one key")
		if len(keys) == 0 {
			return 0 // expired: its TAT is past (a key lives until its TAT, plus a millisecond or two)
		}
		v, err := probe.Get(ctx, keys[0]).Result()
		if errors.Is(err, redis.Nil) {
			return 0 // expired since KEYS listed it
		}
		require.NoError(t, err)
		tat, err := strconv.ParseInt(v, 10, 64)
		require.NoError(t, err, "TAT %q", v)
		now, err := probe.Time(ctx).Result()
		require.NoError(t, err)
		return time.Duration(tat-now.UnixMicro()) * time.Microsecond
	}

	for _, m := range []struct {
		name     string
		eng      *throttle.Engine
		coalesce bool
	}{{"coalesced", eng, true}, {"merged", eng, false}, {"alone", alone, false}} {
		lim, err := reserve.New(m.eng, "coalesce", open, reserve.WithCoalescing(m.coalesce))
		require.NoError(t, err)
		perSec, per, err := contention.Throughput(ctx, lim, "k", 64, total, calls.Load)
		require.NoError(t, err, m.name)
		after := calls.Load()
		ahead := tatAhead()
		time.Sleep(300 * time.Millisecond)
		require.Equal(t, after, calls.Load(), "%s: no call once its reservations have returned", m.name)
		t.Logf("%s: %.0f reservations/s, %.3f calls/reservation, TAT %v past the Redis clock", m.name, perSec, per, ahead)
		require.Less(t, ahead, time.Second, "%s: the limit's tolerance (1,000,000 at 1µs) is never reached", m.name)
		switch m.name {
		case "alone":
			require.Equal(t, 1.0, per, "merging off: one call per reservation")
		default:
			require.Positive(t, per)
			require.LessOrEqual(t, per, 1.0)
		}
	}
}
