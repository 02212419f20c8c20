package throttle_test

import (
	"context"
	"fmt"
	"math/rand/v2"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/slotbook/slotbook/internal/callcount"
	"github.com/slotbook/slotbook/internal/redistest"
	"github.com/slotbook/slotbook/throttle"
)

// A mergeRecord is one single booking as its caller saw it.
type mergeRecord struct {
	key     string
	limit   throttle.Limit
	n       int
	maxWait time.Duration
	b       throttle.Booking
}

// mergeLimits are the limits of the merging tests' keys: key i has
// mergeLimits[i%len].
var mergeLimits = []throttle.Limit{
	throttle.PerSecond(10, 3),
	throttle.Every(time.Minute, 7, 2),
	throttle.Every(3*time.Second, 11, 0),
}

// mergeEngine returns an engine whose client has pool connections (so
// that concurrent single bookings find them busy and merge), its prefix,
// and a counter of the client's round trips.
func mergeEngine(t *testing.T, pool int, opts ...throttle.Option) (*throttle.Engine, *redis.Client, string, *callcount.Counter) {
	t.Helper()
	// A server of its own: the callers count calls, and another test's
	// SCRIPT FLUSH on the shared one would add EVAL retries.
	srv := redistest.Start(t)
	o := srv.Options()
	o.PoolSize = pool
	rdb := redis.NewClient(o)
	t.Cleanup(func() { _ = rdb.Close() })
	prefix := redistest.Prefix(t)
	eng, err := throttle.New(rdb, append([]throttle.Option{throttle.WithPrefix(prefix), throttle.WithTimeout(5 * time.Second)}, opts...)...)
	require.NoError(t, err)
	require.NoError(t, eng.Load(context.Background()))
	return eng, rdb, prefix, callcount.Attach(rdb)
}

// replayTextbook checks each key's bookings, in the order its one caller
// made them, against a textbook GCRA judging each at the reply's Redis
// time (At - Wait).
func replayTextbook(t *testing.T, recs map[string][]mergeRecord) {
	t.Helper()
	for key, rs := range recs {
		model := &textbookModel{limits: []throttle.Limit{rs[0].limit}, tat: make([]int64, 1), known: make([]bool, 1)}
		for i, r := range rs {
			now := r.b.At.UnixMicro() - r.b.Wait.Microseconds()
			mw := min(r.maxWait, throttle.MaxHorizon).Microseconds()
			ok, wait, _ := model.judge(now, r.n, mw)
			require.Equal(t, ok, r.b.OK, "key %s, booking %d (n=%d, max wait %v): booked", key, i, r.n, r.maxWait)
			require.Equal(t, wait, r.b.Wait.Microseconds(), "key %s, booking %d (n=%d, max wait %v): wait in µs", key, i, r.n, r.maxWait)
		}
	}
}

// bookConcurrently runs g goroutines, each booking rounds single requests
// on keys of its own (so each key's order is its caller's), under the
// limits of mergeLimits, with random sizes and max waits. It returns the
// bookings by key and how many were made.
func bookConcurrently(t *testing.T, eng *throttle.Engine, g, rounds int, seed uint64) (map[string][]mergeRecord, int) {
	t.Helper()
	var (
		mu   sync.Mutex
		recs = make(map[string][]mergeRecord)
		wg   sync.WaitGroup
	)
	errs := make(chan error, g)
	for w := range g {
		wg.Go(func() {
			rng := rand.New(rand.NewPCG(seed, uint64(w)))
			for range rounds {
				j := rng.IntN(3)
				key := fmt.Sprintf("m%d-%d", w, j)
				lim := mergeLimits[(w+j)%len(mergeLimits)]
				n := 1 + rng.IntN(lim.Burst+1)
				mw := [...]time.Duration{0, 150 * time.Millisecond, 2 * time.Second, throttle.Forever}[rng.IntN(4)]
				bs, err := eng.BookAll(context.Background(), []string{key}, []throttle.Limit{lim}, []throttle.Request{{N: n, MaxWait: mw}})
				if err != nil {
					errs <- err
					return
				}
				mu.Lock()
				recs[key] = append(recs[key], mergeRecord{key, lim, n, mw, bs[0]})
				mu.Unlock()
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		require.NoError(t, err)
	}
	total := 0
	for _, rs := range recs {
		total += len(rs)
	}
	return recs, total
}

// TestMergedBookingsMatchTextbookGCRA: 32 callers book single requests on
// keys of their own through a client of 2 connections, so that most find
// both busy and are merged. Every booking, merged or not, is what a
// textbook GCRA gives at its Redis time, and the bookings took fewer calls
// than there were bookings. With WithMerging(false), the control in the
// same run, each booking is a call of its own.
func TestMergedBookingsMatchTextbookGCRA(t *testing.T) {
	t.Parallel()
	for _, merging := range []bool{true, false} {
		t.Run(fmt.Sprintf("merging=%v", merging), func(t *testing.T) {
			eng, _, _, calls := mergeEngine(t, 2, throttle.WithMerging(merging))
			before := calls.Load()
			recs, total := bookConcurrently(t, eng, 32, 40, 11)
			used := calls.Load() - before
			replayTextbook(t, recs)
			t.Logf("%d bookings in %d calls", total, used)
			if merging {
				require.Less(t, used, int64(total), "calls for %d bookings: none merged", total)
			} else {
				require.Equal(t, int64(total), used, "calls for %d bookings without merging", total)
			}
		})
	}
}

// holdConnection makes a single booking on key through eng whose reply
// the proxy holds back, so that the client's one connection stays busy
// for about the proxy's delay; it returns a channel that gets its error.
// It returns once the booking has taken the connection (it slept 50 ms
// for it, which a stall of 60 ms of the booking's goroutine outran: the
// calls meant to queue behind it went first).
func holdConnection(t *testing.T, eng *throttle.Engine, key string) <-chan error {
	t.Helper()
	rdb, ok := eng.Client().(*redis.Client)
	require.True(t, ok, "holdConnection needs a *redis.Client")
	inUse := func() uint32 { st := rdb.PoolStats(); return st.TotalConns - st.IdleConns }
	require.Eventually(t, func() bool { return inUse() == 0 }, 5*time.Second, time.Millisecond, "a connection in use before the holder")
	done := make(chan error, 1)
	go func() {
		_, err := eng.Book(context.Background(), key, throttle.PerSecond(10, 0), throttle.Request{N: 1, MaxWait: throttle.Forever})
		done <- err
	}()
	require.Eventually(t, func() bool { return inUse() > 0 }, 5*time.Second, time.Millisecond, "the holder's booking took the connection")
	return done
}

// awaitHolderReply waits until the holder's booking (holdConnection) on
// full (the key with its prefix) has run in Redis, read through direct,
// then 50 ms more for its reply to reach the proxy: a reply delay set
// after is for the replies of the calls queued behind it, which go out
// once the holder's reply is in (its delay after). It replaces the 50 ms
// holdConnection slept, which counted from before the holder's goroutine
// ran.
func awaitHolderReply(t *testing.T, direct *redis.Client, full string) {
	t.Helper()
	require.Eventually(t, func() bool { return direct.Exists(context.Background(), full).Val() == 1 },
		5*time.Second, time.Millisecond, "the holder's booking ran in Redis")
	time.Sleep(50 * time.Millisecond)
}

// proxiedMergeEngine is mergeEngine with one connection, through a proxy
// that holds each reply back by delay, and the engine's timeout.
func proxiedMergeEngine(t *testing.T, delay, timeout time.Duration) (*throttle.Engine, *redis.Client, string, *redistest.Proxy, *callcount.Counter) {
	t.Helper()
	srv := redistest.Shared(t)
	p := redistest.NewProxy(t, srv.Addr)
	rdb := p.Client(t, srv, func(o *redis.Options) { o.PoolSize = 1 })
	prefix := redistest.Prefix(t)
	eng, err := throttle.New(rdb, throttle.WithPrefix(prefix), throttle.WithTimeout(timeout))
	require.NoError(t, err)
	require.NoError(t, eng.Load(context.Background()))
	// The one connection is open (and stays in the pool) before replies
	// are held back: no handshake is.
	require.NoError(t, rdb.Ping(context.Background()).Err())
	p.SetReplyDelay(delay)
	return eng, srv.Client(t), prefix, p, callcount.Attach(rdb)
}

// TestMergedBadKeysAnswerAlone: while the one connection is busy, single
// bookings on good keys (one of them twice) and on two bad ones (a value
// that is not a TAT, a hash) are merged. Each bad key's caller gets the
// error it would get alone (ErrCorruptState; WRONGTYPE), and the good keys
// are booked once each, as a textbook GCRA books them. A round counts as
// merged when it took four calls (the holder's, the merged one, one alone
// for each bad key) rather than seven; on a busy machine a request may
// come too late to merge, so the test looks for one merged round in five.
func TestMergedBadKeysAnswerAlone(t *testing.T) {
	t.Parallel()
	eng, direct, prefix, _, calls := proxiedMergeEngine(t, 300*time.Millisecond, 5*time.Second)
	ctx := context.Background()
	lim := throttle.PerMinute(6, 0) // 10 s apart: a key booked twice shows it
	for round := 0; ; round++ {
		key := func(k string) string { return fmt.Sprintf("%s-%d", k, round) }
		require.NoError(t, direct.Set(ctx, prefix+key("corrupt"), "not a tat", time.Minute).Err())
		require.NoError(t, direct.HSet(ctx, prefix+key("hash"), "f", "v").Err())
		before := calls.Load()
		held := holdConnection(t, eng, key("holder"))
		keys := []string{"good1", "corrupt", "good2", "hash", "good1", "good3"}
		var wg sync.WaitGroup
		bs := make([]throttle.Booking, len(keys))
		errs := make([]error, len(keys))
		for i, k := range keys {
			wg.Go(func() {
				bs[i], errs[i] = eng.Book(ctx, key(k), lim, throttle.Request{N: 1, MaxWait: throttle.Forever})
			})
		}
		wg.Wait()
		require.NoError(t, <-held)
		require.ErrorIs(t, errs[1], throttle.ErrCorruptState)
		require.ErrorContains(t, errs[3], "WRONGTYPE")
		recs := make(map[string][]mergeRecord)
		for i, k := range keys {
			if k == "corrupt" || k == "hash" {
				continue
			}
			require.NoError(t, errs[i], k)
			recs[k] = append(recs[k], mergeRecord{k, lim, 1, throttle.Forever, bs[i]})
		}
		// good1's two bookings in the order Redis made them: by slot.
		slices.SortFunc(recs["good1"], func(a, b mergeRecord) int { return a.b.At.Compare(b.b.At) })
		replayTextbook(t, recs)
		require.Equal(t, recs["good1"][0].b.At.Add(lim.Interval()), recs["good1"][1].b.At,
			"good1's second booking, on the Redis clock")
		used := calls.Load() - before
		t.Logf("round %d: %d calls", round, used)
		if used == 4 {
			return
		}
		require.Less(t, round, 4, "no round merged its requests")
	}
}

// TestMergedWaiterLeaves: while the one connection is busy, a batch forms
// behind it: a leader and a follower whose contexts end before the
// connection frees (in either order), then a caller without a deadline.
// The two get their context's error and book nothing (their keys stay
// empty); the last leads in their place and books once.
func TestMergedWaiterLeaves(t *testing.T) {
	t.Parallel()
	for _, leaderFirst := range []bool{true, false} {
		t.Run(fmt.Sprintf("leaderFirst=%v", leaderFirst), func(t *testing.T) {
			eng, direct, prefix, _, _ := proxiedMergeEngine(t, 400*time.Millisecond, 5*time.Second)
			ctx := context.Background()
			lim := throttle.PerMinute(6, 0) // 10 s apart: a key booked twice shows it
			held := holdConnection(t, eng, "holder")
			ends := map[string]time.Duration{"leader": 100 * time.Millisecond, "follower": 150 * time.Millisecond}
			if !leaderFirst {
				ends["leader"], ends["follower"] = ends["follower"], ends["leader"]
			}
			errs := make(map[string]chan error)
			for _, k := range []string{"leader", "follower"} {
				short, cancel := context.WithTimeout(ctx, ends[k])
				defer cancel()
				errs[k] = make(chan error, 1)
				go func() {
					_, err := eng.Book(short, k, lim, throttle.Request{N: 1, MaxWait: throttle.Forever})
					errs[k] <- err
				}()
				time.Sleep(20 * time.Millisecond)
			}
			b, err := eng.Book(ctx, "other", lim, throttle.Request{N: 1, MaxWait: throttle.Forever})
			require.NoError(t, err)
			require.True(t, b.OK)
			require.NoError(t, <-held)
			for _, k := range []string{"leader", "follower"} {
				require.ErrorIs(t, <-errs[k], context.DeadlineExceeded, k)
				n, err := direct.Exists(ctx, prefix+k).Result()
				require.NoError(t, err)
				require.Zero(t, n, "%s left, and booked something", k)
			}
			// "other" booked once: its next booking is one interval after it.
			next, err := eng.Book(ctx, "other", lim, throttle.Request{N: 1, MaxWait: throttle.Forever})
			require.NoError(t, err)
			require.Equal(t, b.At.Add(lim.Interval()), next.At)
		})
	}
}

// TestMergedReplyLost: the reply of a merged call comes after the engine's
// timeout (that of the call ahead of it, in time): every request in it
// gets ErrReplyLost (it may have booked), as a call of its own would.
func TestMergedReplyLost(t *testing.T) {
	t.Parallel()
	eng, direct, prefix, p, _ := proxiedMergeEngine(t, 150*time.Millisecond, 500*time.Millisecond)
	ctx := context.Background()
	lim := throttle.PerSecond(10, 0)
	held := holdConnection(t, eng, "holder")
	awaitHolderReply(t, direct, prefix+"holder")
	p.SetReplyDelay(time.Second) // for the replies read from now on
	var wg sync.WaitGroup
	errs := make([]error, 4)
	for i := range errs {
		wg.Go(func() {
			_, errs[i] = eng.Book(ctx, fmt.Sprintf("lost%d", i), lim, throttle.Request{N: 1, MaxWait: throttle.Forever})
		})
	}
	wg.Wait()
	require.NoError(t, <-held)
	for i, err := range errs {
		require.ErrorIs(t, err, throttle.ErrReplyLost, "request %d", i)
	}
}
