package throttle_test

import (
	"context"
	"math/rand/v2"
	"strconv"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/slotbook/slotbook/internal/limitcheck"
	"github.com/slotbook/slotbook/internal/redistest"
	"github.com/slotbook/slotbook/throttle"
)

// textbookModel is a textbook GCRA (virtual scheduling), one TAT per limit,
// in microseconds on the Redis clock; an absent TAT is the decision time.
type textbookModel struct {
	limits []throttle.Limit
	tat    []int64
	known  []bool
}

// judge decides n units at now with max wait maxWait (µs), and books them
// if they fit. The n units are n cells: cell j (0-based) conforms at t if
// t >= TAT + j*I - tau; the request's slot is the earliest t >= now at
// which every cell of every limit conforms.
func (m *textbookModel) judge(now int64, n int, maxWait int64) (ok bool, wait int64, before []int64) {
	before = make([]int64, len(m.limits))
	slot := now
	for i, l := range m.limits {
		I := limitcheck.Interval(l)
		tau := I * int64(l.Burst)
		tat := now
		if m.known[i] && m.tat[i] > now {
			tat = m.tat[i]
		}
		before[i] = tat
		for j := 0; j < n; j++ {
			if t := tat + int64(j)*I - tau; t > slot {
				slot = t
			}
		}
	}
	wait = slot - now
	if wait > maxWait {
		return false, wait, before
	}
	for i, l := range m.limits {
		tat := before[i]
		for j := 0; j < n; j++ { // cell by cell
			if slot > tat {
				tat = slot
			}
			tat += limitcheck.Interval(l)
		}
		m.tat[i], m.known[i] = tat, true
	}
	return true, wait, before
}

func textbookEngine(t *testing.T, rdb redis.Scripter) (*throttle.Engine, string) {
	prefix := redistest.Prefix(t)
	eng, err := throttle.New(rdb, throttle.WithPrefix(prefix), throttle.WithTimeout(5*time.Second))
	require.NoError(t, err)
	return eng, prefix
}

// TestBookAllMatchesTextbookGCRA: BookBatch and BookAll replies,
// request by request, against the textbook model, on the Redis clock:
// 1 to 8 limits, batches of 1 to MaxBatch, refusals in the middle.
func TestBookAllMatchesTextbookGCRA(t *testing.T) {
	t.Parallel()
	srv := redistest.Shared(t)
	rdb := srv.Client(t)
	eng, prefix := textbookEngine(t, rdb)
	ctx := context.Background()
	all := []throttle.Limit{
		throttle.PerSecond(10, 3),
		throttle.Every(time.Minute, 7, 2),
		throttle.Every(time.Second, 3, 5),
		throttle.Every(3*time.Second, 11, 4),
		throttle.Every(time.Hour, 1000, 6),
		throttle.Every(7*time.Second, 9, 3),
		throttle.Every(5*time.Second, 13, 8),
		throttle.Every(2*time.Second, 17, 2),
	}
	rng := rand.New(rand.NewPCG(7, 42))
	refusedMid := 0
	for round := 0; round < 60; round++ {
		m := 1 + rng.IntN(3)
		size := 1 + rng.IntN(40)
		if round%20 == 19 { // now and then the most of both
			m, size = throttle.MaxLimits, throttle.MaxBatch
		}
		limits := all[:m]
		maxN := 1 << 30
		for _, l := range limits {
			maxN = min(maxN, l.Burst+1)
		}
		keys := make([]string, m)
		for i := range keys {
			keys[i] = "{s" + strconv.Itoa(round) + "}:" + strconv.Itoa(i)
		}
		model := &textbookModel{limits: limits, tat: make([]int64, m), known: make([]bool, m)}
		for call := 0; call < 4; call++ {
			reqs := make([]throttle.Request, size)
			for i := range reqs {
				reqs[i].N = 1 + rng.IntN(maxN)
				switch rng.IntN(3) {
				case 0:
					reqs[i].MaxWait = 0
				case 1:
					reqs[i].MaxWait = time.Duration(rng.Int64N(int64(3*time.Second))) + time.Duration(rng.IntN(1000))
				default:
					reqs[i].MaxWait = throttle.Forever
				}
			}
			var bs []throttle.Booking
			var err error
			if m == 1 {
				bs, err = eng.BookBatch(ctx, keys[0], limits[0], reqs)
			} else {
				bs, err = eng.BookAll(ctx, keys, limits, reqs)
			}
			require.NoError(t, err)
			require.Len(t, bs, size)
			now := bs[0].At.UnixMicro() - bs[0].Wait.Microseconds()
			sawRefusal := false
			for i, b := range bs {
				require.Equal(t, now, b.At.UnixMicro()-b.Wait.Microseconds(), "round %d call %d request %d: one decision time per call", round, call, i)
				mw := int64(min(reqs[i].MaxWait, throttle.MaxHorizon) / time.Microsecond)
				ok, wait, _ := model.judge(now, reqs[i].N, mw)
				require.Equal(t, ok, b.OK, "round %d call %d request %d (n %d, max wait %v, %d limits)", round, call, i, reqs[i].N, reqs[i].MaxWait, m)
				require.Equal(t, wait, b.Wait.Microseconds(), "round %d call %d request %d: wait", round, call, i)
				require.Equal(t, reqs[i].N, b.N)
				if !ok {
					sawRefusal = true
				} else if sawRefusal {
					refusedMid++
				}
			}
			// What Redis holds is the model's TAT after the call.
			for i, k := range keys {
				if !model.known[i] {
					continue
				}
				v, err := rdb.Get(ctx, prefix+k).Int64()
				if model.tat[i] <= now {
					continue // may have expired
				}
				require.NoError(t, err)
				require.Equal(t, model.tat[i], v, "round %d call %d key %d: stored TAT", round, call, i)
			}
		}
	}
	require.Positive(t, refusedMid, "some batches booked after a refusal")
	t.Logf("%d bookings after a refusal in the same batch", refusedMid)
}

// opsAfterFlush books, refunds, allows and blocks through eng on key (hash
// tag {k}), calling flush before each, and checks that each books exactly
// once: Redis holds the TAT the textbook model has after it.
func opsAfterFlush(t *testing.T, eng *throttle.Engine, get func(string) (int64, error), flush func()) {
	ctx := context.Background()
	lim := throttle.PerMinute(60, 3) // 1 s apart
	day := throttle.PerDay(1000, 5)
	keys := []string{"{k}", "{k}:day"}
	I := limitcheck.Interval(lim)

	flush()
	b, err := eng.Book(ctx, keys[0], lim, throttle.Request{N: 1, MaxWait: throttle.Forever})
	require.NoError(t, err)
	require.True(t, b.OK)
	require.Zero(t, b.Wait)
	now := b.At.UnixMicro()
	v, err := get(keys[0])
	require.NoError(t, err)
	require.Equal(t, now+I, v, "Book after SCRIPT FLUSH booked once")

	flush()
	bs, err := eng.BookBatch(ctx, keys[0], lim, []throttle.Request{{N: 1, MaxWait: throttle.Forever}, {N: 2, MaxWait: 0}, {N: 1, MaxWait: throttle.Forever}})
	require.NoError(t, err)
	now2 := bs[0].At.UnixMicro() - bs[0].Wait.Microseconds()
	model := &textbookModel{limits: []throttle.Limit{lim}, tat: []int64{now + I}, known: []bool{true}}
	for i, r := range []throttle.Request{{N: 1, MaxWait: throttle.Forever}, {N: 2, MaxWait: 0}, {N: 1, MaxWait: throttle.Forever}} {
		mw := int64(min(r.MaxWait, throttle.MaxHorizon) / time.Microsecond)
		ok, wait, _ := model.judge(now2, r.N, mw)
		require.Equal(t, ok, bs[i].OK, "request %d", i)
		require.Equal(t, wait, bs[i].Wait.Microseconds(), "request %d", i)
	}
	v, err = get(keys[0])
	require.NoError(t, err)
	require.Equal(t, model.tat[0], v, "BookBatch after SCRIPT FLUSH booked once")

	// Refund the last booking: the TAT goes back to before it, once.
	flush()
	given, err := eng.Refund(ctx, keys[0], lim, bs[2])
	require.NoError(t, err)
	require.Equal(t, time.Duration(I)*time.Microsecond, given)
	v, err = get(keys[0])
	require.NoError(t, err)
	require.Equal(t, model.tat[0]-I, v, "Refund after SCRIPT FLUSH gave back once")
	flush()
	given, err = eng.Refund(ctx, keys[0], lim, bs[2]) // a retry: nothing more
	require.NoError(t, err)
	require.Zero(t, given)

	flush()
	ba, err := eng.BookAll(ctx, keys, []throttle.Limit{lim, day}, []throttle.Request{{N: 1, MaxWait: throttle.Forever}})
	require.NoError(t, err)
	require.True(t, ba[0].OK)
	dayV, err := get(keys[1])
	require.NoError(t, err)
	// The day limit was idle: its TAT is the slot (set by the minute
	// limit) plus its interval.
	require.Equal(t, ba[0].At.UnixMicro()+limitcheck.Interval(day), dayV, "BookAll after SCRIPT FLUSH booked the day limit once")

	flush()
	res, err := eng.Allow(ctx, "{k}:allow", lim)
	require.NoError(t, err)
	require.True(t, res.Allowed)
	require.Equal(t, lim.Burst, res.Remaining, "Allow after SCRIPT FLUSH counted once")

	flush()
	require.NoError(t, eng.Block(ctx, "{k}:allow", lim, time.Hour))
	res, err = eng.Allow(ctx, "{k}:allow", lim)
	require.NoError(t, err)
	require.False(t, res.Allowed, "Block after SCRIPT FLUSH took")
}

// TestEveryOpAfterScriptFlush: every operation still works, booking once,
// when Redis has forgotten the scripts (SCRIPT FLUSH before each call).
func TestEveryOpAfterScriptFlush(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t) // our own: SCRIPT FLUSH touches no one else
	rdb := srv.Client(t)
	eng, prefix := textbookEngine(t, rdb)
	ctx := context.Background()
	flushes := 0
	opsAfterFlush(t, eng, func(k string) (int64, error) { return rdb.Get(ctx, prefix+k).Int64() }, func() {
		require.NoError(t, rdb.ScriptFlush(ctx).Err())
		flushes++
	})
	require.Positive(t, flushes)
}

// TestEveryOpAfterScriptFlushCluster: the same on a Redis Cluster.
func TestEveryOpAfterScriptFlushCluster(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a cluster")
	}
	cl := redistest.StartCluster(t, 3)
	rdb := cl.Client(t)
	eng, prefix := textbookEngine(t, rdb)
	ctx := context.Background()
	opsAfterFlush(t, eng, func(k string) (int64, error) { return rdb.Get(ctx, prefix+k).Int64() }, func() {
		require.NoError(t, rdb.ForEachMaster(ctx, func(ctx context.Context, c *redis.Client) error {
			return c.ScriptFlush(ctx).Err()
		}))
	})
}

// scripterOnly hides every method of a client but the Scripter's: the
// engine then runs its scripts through go-redis's Script.Run.
type scripterOnly struct{ redis.Scripter }

// TestEveryOpAfterScriptFlushScripterOnly: the same through a client that
// offers only the Scripter methods, so that the engine's calls go through
// go-redis's Script.Run with the scripts' arguments alone.
func TestEveryOpAfterScriptFlushScripterOnly(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	rdb := srv.Client(t)
	eng, prefix := textbookEngine(t, scripterOnly{rdb})
	ctx := context.Background()
	flushes := 0
	opsAfterFlush(t, eng, func(k string) (int64, error) { return rdb.Get(ctx, prefix+k).Int64() }, func() {
		require.NoError(t, rdb.ScriptFlush(ctx).Err())
		flushes++
	})
	require.Positive(t, flushes)
}
