package slotbook_test

// End-to-end checks of the published verification list, against a real
// redis-server started by the test helper.

import (
	"context"
	"os"
	"slices"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/slotbook/slotbook/deadline"
	"github.com/slotbook/slotbook/internal/callcount"
	"github.com/slotbook/slotbook/internal/redistest"
	"github.com/slotbook/slotbook/internal/testhook"
	"github.com/slotbook/slotbook/reserve"
	"github.com/slotbook/slotbook/throttle"
)

func TestMain(m *testing.M) {
	// TestSoak starts this test binary as its worker processes.
	if os.Getenv("SOAK_WORKER") == "1" {
		os.Exit(soakWorker())
	}
	redistest.Main(m)
}

// published is the limit of the published measurements: 10/s, burst 5.
var published = throttle.PerSecond(10, 5)

type env struct {
	srv    *redistest.Server
	rdb    *redis.Client
	calls  *callcount.Counter
	eng    *throttle.Engine
	prefix string
}

func newEnv(t *testing.T) *env {
	t.Helper()
	srv := redistest.Shared(t)
	srv.RequireReal(t)
	rdb := srv.Client(t)
	calls := callcount.Attach(rdb)
	prefix := redistest.Prefix(t)
	// Generous timeout: correctness tests on a possibly busy machine.
	eng, err := throttle.New(rdb, throttle.WithPrefix(prefix), throttle.WithTimeout(5*time.Second))
	require.NoError(t, err)
	require.NoError(t, eng.Load(context.Background()))
	return &env{srv: srv, rdb: rdb, calls: calls, eng: eng, prefix: prefix}
}

func (e *env) limiter(t *testing.T, opts ...reserve.Option) *reserve.Limiter {
	t.Helper()
	l, err := reserve.New(e.eng, "api", published, opts...)
	require.NoError(t, err)
	return l
}

// TestSaturatedExact: after idling, exactly burst+1 pass at once, then one
// per interval: saturated for 3 s, 36 allowed, 7 within the first 100ms.
// The scripts run on an explicit clock, so the counts are exact.
func TestSaturatedExact(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	l := e.limiter(t)
	t0 := time.Now().UnixMicro()
	var allowedAt []time.Duration
	for us := int64(0); us <= 3_000_000; us += 500 {
		ctx := testhook.WithNow(context.Background(), t0+us)
		for {
			r, err := l.Allow(ctx, "subject")
			require.NoError(t, err)
			if !r.Allowed {
				require.Positive(t, r.RetryAfter)
				break
			}
			allowedAt = append(allowedAt, time.Duration(us)*time.Microsecond)
		}
	}
	require.Len(t, allowedAt, 36)
	early := 0
	for _, d := range allowedAt {
		if d <= 100*time.Millisecond {
			early++
		}
	}
	require.Equal(t, 7, early)
	for i := 6; i < len(allowedAt); i++ {
		require.Equal(t, 100*time.Millisecond, allowedAt[i]-allowedAt[i-1], "gap before request %d", i)
	}
}

// TestSaturatedRealTime is the same check on Redis's own clock: a client
// that retries exactly when told for 3 s.
func TestSaturatedRealTime(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	l := e.limiter(t)
	ctx := context.Background()
	start := time.Now()
	var allowedAt []time.Duration
	for time.Since(start) < 3*time.Second {
		r, err := l.Allow(ctx, "subject")
		require.NoError(t, err)
		if r.Allowed {
			allowedAt = append(allowedAt, time.Since(start))
			continue
		}
		time.Sleep(r.RetryAfter)
	}
	// 36 if the 3000ms slot is reached before the loop ends, else 35.
	if n := len(allowedAt); n < 35 || n > 36 {
		t.Fatalf("allowed %d in 3s, want 35 or 36", n)
	}
	require.Less(t, allowedAt[5], 50*time.Millisecond, "the burst passes at once")
	require.GreaterOrEqual(t, allowedAt[6], 99*time.Millisecond, "the 7th waits an interval")
	tail := allowedAt[6:]
	mean := (tail[len(tail)-1] - tail[0]) / time.Duration(len(tail)-1)
	require.InDelta(t, float64(100*time.Millisecond), float64(mean), float64(5*time.Millisecond), "mean spacing")
}

// TestOneKeyPerSubject: each subject is one int-encoded key with a TTL,
// gone once idle.
func TestOneKeyPerSubject(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	l := e.limiter(t)
	ctx := context.Background()
	for _, s := range []string{"a", "b", "c"} {
		for i := 0; i < 3; i++ {
			require.NoError(t, l.Acquire(ctx, s))
		}
	}
	keys, err := e.rdb.Keys(ctx, e.prefix+"*").Result()
	require.NoError(t, err)
	slices.Sort(keys)
	require.Equal(t, []string{e.prefix + "api:{a}", e.prefix + "api:{b}", e.prefix + "api:{c}"}, keys)
	for _, k := range keys {
		v, err := e.rdb.Get(ctx, k).Result()
		require.NoError(t, err)
		_, err = strconv.ParseInt(v, 10, 64)
		require.NoError(t, err, "value of %s", k)
		require.Equal(t, "int", e.rdb.ObjectEncoding(ctx, k).Val())
		ttl := e.rdb.PTTL(ctx, k).Val()
		require.True(t, ttl > 0 && ttl <= 301*time.Millisecond, "PTTL of %s = %v", k, ttl)
	}
	require.Eventually(t, func() bool { return e.rdb.Exists(ctx, keys...).Val() == 0 },
		3*time.Second, 20*time.Millisecond, "keys should expire once idle")
}

// TestCompetingAcquire: 20 clients share 10/s burst 5 through Acquire with a
// 2 s max wait for 3 s. At most one script call per request (exactly one
// with coalescing off), no refusals, starts spaced 100ms apart, each at its
// booked slot.
func TestCompetingAcquire(t *testing.T) {
	for _, coalesce := range []bool{false, true} {
		t.Run("coalescing="+strconv.FormatBool(coalesce), func(t *testing.T) {
			t.Parallel()
			competingAcquire(t, coalesce)
		})
	}
}

func competingAcquire(t *testing.T, coalesce bool) {
	e := newEnv(t)
	l := e.limiter(t, reserve.WithMaxWait(2*time.Second), reserve.WithCoalescing(coalesce))
	ctx := context.Background()

	// slot: the local time to act; at: when the client went; booked: the
	// slot on the Redis clock, where the limiter's spacing is exact.
	type start struct{ slot, at, booked time.Time }
	var (
		mu      sync.Mutex // guards starts and refused
		starts  []start
		refused int
		wg      sync.WaitGroup
	)
	before := e.calls.Load()
	t0 := time.Now()
	for c := 0; c < 20; c++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for time.Since(t0) < 3*time.Second {
				r, err := l.Reserve(ctx, "shared")
				if err != nil {
					t.Error(err)
					return
				}
				if !r.OK() {
					mu.Lock()
					refused++
					mu.Unlock()
					continue
				}
				if err := r.Wait(ctx); err != nil {
					t.Error(err)
					return
				}
				now := time.Now()
				mu.Lock()
				starts = append(starts, start{r.SlotAt(), now, r.Booking().At})
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
	calls := e.calls.Load() - before

	require.Zero(t, refused, "refusals")
	if coalesce {
		require.LessOrEqual(t, calls, int64(len(starts)), "at most one Redis call per request")
	} else {
		require.Equal(t, int64(len(starts)), calls, "one Redis call per request")
	}
	// 20 first bookings plus one per start within 3 s: 20 + 36 - 1.
	require.InDelta(t, 55, len(starts), 2, "requests through")

	slices.SortFunc(starts, func(a, b start) int { return a.at.Compare(b.at) })
	var late []time.Duration
	for _, s := range starts {
		require.False(t, s.at.Before(s.slot), "started before its slot")
		late = append(late, s.at.Sub(s.slot))
	}
	slices.Sort(late)
	require.Less(t, late[len(late)/2], 10*time.Millisecond, "median start after its slot")
	require.Less(t, late[len(late)-1], 100*time.Millisecond, "latest start after its slot")

	// Spacing is judged on the Redis clock, where it is exact: the local
	// SlotAt of each reservation also carries its reply's latency, which a
	// busy 2-core machine under -race varies by more than 10ms.
	slices.SortFunc(starts, func(a, b start) int { return a.booked.Compare(b.booked) })
	tail := starts[6:] // after the burst
	mean := tail[len(tail)-1].booked.Sub(tail[0].booked) / time.Duration(len(tail)-1)
	require.InDelta(t, float64(100*time.Millisecond), float64(mean), float64(2*time.Millisecond), "mean spacing of slots")
	for i := 1; i < len(tail); i++ {
		gap := tail[i].booked.Sub(tail[i-1].booked)
		require.GreaterOrEqual(t, gap, 100*time.Millisecond, "slot gap %d on the Redis clock", i)
	}
}

// TestDeadlineRefusal: a request whose slot would pass its context deadline
// is refused at once and leaves the next booking's wait unchanged.
func TestDeadlineRefusal(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	l := e.limiter(t)
	now := time.Now()
	at := testhook.WithNow(context.Background(), now.UnixMicro())
	for i := 0; i < 8; i++ { // 6 at once, then slots at +100ms, +200ms
		r, err := l.Reserve(at, "k")
		require.NoError(t, err)
		require.True(t, r.OK())
	}
	ctx, cancel := context.WithDeadline(at, now.Add(250*time.Millisecond))
	defer cancel()
	begin := time.Now()
	err := l.Acquire(ctx, "k")
	require.Less(t, time.Since(begin), 100*time.Millisecond, "refused at once")
	require.ErrorIs(t, err, reserve.ErrWouldExceedDeadline)
	retry, ok := deadline.RetryAfterOf(err)
	require.True(t, ok)
	require.Equal(t, 300*time.Millisecond, retry)

	b, err := e.eng.Book(at, "api:{k}", published, throttle.Request{N: 1, MaxWait: throttle.Forever})
	require.NoError(t, err)
	require.Equal(t, 300*time.Millisecond, b.Wait, "the next booking's wait is unchanged")
}

// TestCancelGivesSlotBack: cancelling the most recent booking gives its
// slot back, and a caller whose context ends while waiting cancels its own.
func TestCancelGivesSlotBack(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	l := e.limiter(t)
	ctx := context.Background()
	for i := 0; i < 6; i++ {
		require.NoError(t, l.Acquire(ctx, "k"))
	}
	r1, err := l.Reserve(ctx, "k")
	require.NoError(t, err)
	require.NoError(t, r1.Cancel(ctx))
	r2, err := l.Reserve(ctx, "k")
	require.NoError(t, err)
	require.True(t, r2.Booking().At.Equal(r1.Booking().At), "same slot again: %v, %v", r2.Booking().At, r1.Booking().At)

	short, cancel := context.WithTimeout(ctx, 30*time.Millisecond)
	defer cancel()
	err = l.Acquire(short, "k") // would wait ~200ms, but the deadline refuses it up front
	require.ErrorIs(t, err, reserve.ErrWouldExceedDeadline)

	waiting, stop := context.WithCancel(ctx)
	r3, err := l.Reserve(waiting, "k")
	require.NoError(t, err)
	time.AfterFunc(20*time.Millisecond, stop)
	require.ErrorIs(t, r3.Wait(waiting), context.Canceled)
	r4, err := l.Reserve(ctx, "k")
	require.NoError(t, err)
	require.True(t, r4.Booking().At.Equal(r3.Booking().At), "cancelled while waiting: slot reused")
}
