package reserve_test

// Review (helper AL43) of 6dcf54b (reserve's keysIn: a single limit's key
// in a caller's stack array for AllowN and book) with the engine's
// allocation cuts under it (1eec856, 3a267c2, 1dd04e7). Attacked through
// the public API: single-limit and layered limiters from many goroutines
// (coalesced and not, merging under a small pool), every granted slot
// checked against a textbook GCRA replay on the Redis clock; Allow's
// admissions bounded by the definition; a Scripter that keeps the keys
// it is given; cancels; and a corrupt key in each limit.

import (
	"context"
	"fmt"
	"slices"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/slotbook/slotbook/internal/redistest"
	"github.com/slotbook/slotbook/internal/testhook"
	"github.com/slotbook/slotbook/reserve"
	"github.com/slotbook/slotbook/throttle"
)

type alSlot struct {
	at time.Time
	n  int
}

// alReplay: the textbook GCRA (virtual scheduling) over the granted slots
// of one key under l, in slot order.
func alReplay(t *testing.T, what string, l throttle.Limit, slots []alSlot) {
	t.Helper()
	I := l.Period.Microseconds() / int64(l.Rate)
	tau := int64(l.Burst) * I
	s := slices.Clone(slots)
	sort.SliceStable(s, func(i, j int) bool { return s[i].at.Before(s[j].at) })
	var tat int64 = -1 << 62
	for i, x := range s {
		at := x.at.UnixMicro()
		if at < tat+int64(x.n-1)*I-tau {
			t.Fatalf("%s: slot %d at %d (n=%d) is %dµs early by the textbook GCRA (I %d, tau %d)",
				what, i, at, x.n, tat+int64(x.n-1)*I-tau-at, I, tau)
		}
		tat = max(tat, at) + int64(x.n)*I
	}
}

// alKeeper is a Scripter, not a go-redis client, that keeps every keys
// slice it is given with a copy of what it held.
type alKeeper struct {
	rdb  *redis.Client
	mu   sync.Mutex
	kept [][]string
	then [][]string
}

func (s *alKeeper) keep(keys []string) {
	s.mu.Lock()
	s.kept = append(s.kept, keys)
	s.then = append(s.then, slices.Clone(keys))
	s.mu.Unlock()
}

func (s *alKeeper) Eval(ctx context.Context, script string, keys []string, args ...interface{}) *redis.Cmd {
	s.keep(keys)
	return s.rdb.Eval(ctx, script, keys, args...)
}

func (s *alKeeper) EvalSha(ctx context.Context, sha1 string, keys []string, args ...interface{}) *redis.Cmd {
	s.keep(keys)
	return s.rdb.EvalSha(ctx, sha1, keys, args...)
}

func (s *alKeeper) EvalRO(ctx context.Context, script string, keys []string, args ...interface{}) *redis.Cmd {
	s.keep(keys)
	return s.rdb.EvalRO(ctx, script, keys, args...)
}

func (s *alKeeper) EvalShaRO(ctx context.Context, sha1 string, keys []string, args ...interface{}) *redis.Cmd {
	s.keep(keys)
	return s.rdb.EvalShaRO(ctx, sha1, keys, args...)
}

func (s *alKeeper) ScriptExists(ctx context.Context, hashes ...string) *redis.BoolSliceCmd {
	return s.rdb.ScriptExists(ctx, hashes...)
}

func (s *alKeeper) ScriptLoad(ctx context.Context, script string) *redis.StringCmd {
	return s.rdb.ScriptLoad(ctx, script)
}

// alRun drives lim from many goroutines: Reserve/ReserveN on reservation
// keys, Allow/AllowN on keys of their own, and checks every granted slot
// against the replay under each of limits, and Allow's admitted units
// against the definition's bound over the Redis-clock window.
func alRun(t *testing.T, direct *redis.Client, lim *reserve.Limiter, limits []throttle.Limit, tag string) {
	ctx := context.Background()
	t0, err := direct.Time(ctx).Result()
	require.NoError(t, err)
	var mu sync.Mutex
	slots := map[string][]alSlot{}
	allowed := map[string]int{}
	var refusedR, deniedA atomic.Int64
	var failed atomic.Value
	var wg sync.WaitGroup
	for g := range 32 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range 40 {
				n := 1 + (g+i)%2
				if i%4 == 3 {
					k := fmt.Sprintf("a%d", (g+i)%5)
					res, err := lim.AllowN(ctx, k, n)
					if err != nil {
						failed.Store(err)
						return
					}
					if res.Allowed {
						require.Zero(t, res.RetryAfter)
						mu.Lock()
						allowed[k] += n
						mu.Unlock()
					} else {
						deniedA.Add(1)
						require.Positive(t, res.RetryAfter)
					}
					continue
				}
				k := fmt.Sprintf("r%d", (g*3+i)%6)
				cctx, cancel := context.WithTimeout(ctx, 5*time.Second)
				r, err := lim.ReserveN(cctx, k, n)
				cancel()
				if err != nil {
					failed.Store(fmt.Errorf("%s: %w", k, err))
					return
				}
				b := r.Booking()
				if !r.OK() {
					refusedR.Add(1)
					continue
				}
				if !b.OK || b.N != n {
					failed.Store(fmt.Errorf("%s: OK reservation with booking %+v", k, b))
					return
				}
				mu.Lock()
				slots[k] = append(slots[k], alSlot{at: b.At, n: n})
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
	if err, _ := failed.Load().(error); err != nil {
		t.Fatal(err)
	}
	t1, err := direct.Time(ctx).Result()
	require.NoError(t, err)
	granted := 0
	for k, s := range slots {
		granted += len(s)
		for i, l := range limits {
			alReplay(t, fmt.Sprintf("%s %s limit %d", tag, k, i), l, s)
		}
	}
	D := t1.Sub(t0).Microseconds()
	for k, u := range allowed {
		for i, l := range limits {
			I := l.Period.Microseconds() / int64(l.Rate)
			bound := (D+int64(l.Burst)*I)/I + 1
			require.LessOrEqual(t, int64(u), bound, "%s %s: %d units allowed in %dµs under limit %d", tag, k, u, D, i)
		}
		require.Positive(t, u, "%s %s: nothing allowed", tag, k)
	}
	t.Logf("%s: granted %d reservations, refused %d, allowed %v, denied %d, window %v", tag, granted, refusedR.Load(), allowed, deniedA.Load(), t1.Sub(t0))
}

// TestReviewALReserveReplay: single-limit and layered limiters, coalesced
// and not, through a pool of 2 with merging: granted slots pass the
// replay, Allow's admissions stay within the definition's bound.
func TestReviewALReserveReplay(t *testing.T) {
	srv := redistest.Shared(t)
	o := srv.Options()
	o.PoolSize = 2
	rdb := redis.NewClient(o)
	t.Cleanup(func() { _ = rdb.Close() })
	direct := srv.Client(t)
	one := throttle.PerSecond(400, 3)
	second := throttle.Every(100*time.Millisecond, 20, 4) // binds harder than one over time
	for _, co := range []bool{true, false} {
		eng, err := throttle.New(rdb, throttle.WithPrefix(redistest.Prefix(t)), throttle.WithMerging(true), throttle.WithTimeout(5*time.Second))
		require.NoError(t, err)
		single, err := reserve.New(eng, "one", one, reserve.WithCoalescing(co), reserve.WithMaxWait(20*time.Millisecond))
		require.NoError(t, err)
		alRun(t, direct, single, []throttle.Limit{one}, fmt.Sprintf("single coalesce=%v", co))
		lay, err := reserve.New(eng, "lay", one, reserve.WithLimit(second), reserve.WithCoalescing(co), reserve.WithMaxWait(20*time.Millisecond))
		require.NoError(t, err)
		alRun(t, direct, lay, []throttle.Limit{one, second}, fmt.Sprintf("layered coalesce=%v", co))
	}
}

// TestReviewALReserveKeeperScripter: through a Scripter that keeps every
// keys slice it is given, single-limit and layered Reserve, Allow and
// Cancel from many goroutines: every kept slice still holds what it held,
// the keys of its own call.
func TestReviewALReserveKeeperScripter(t *testing.T) {
	srv := redistest.Shared(t)
	sc := &alKeeper{rdb: srv.Client(t)}
	prefix := redistest.Prefix(t)
	eng, err := throttle.New(sc, throttle.WithPrefix(prefix), throttle.WithTimeout(5*time.Second))
	require.NoError(t, err)
	ctx := context.Background()
	single, err := reserve.New(eng, "ks", throttle.PerSecond(1000, 5))
	require.NoError(t, err)
	lay, err := reserve.New(eng, "kl", throttle.PerSecond(1000, 5), reserve.WithLimit(throttle.PerMinute(100000, 50)))
	require.NoError(t, err)
	var wg sync.WaitGroup
	var failed atomic.Value
	for g := range 16 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range 25 {
				for _, l := range []*reserve.Limiter{single, lay} {
					k := fmt.Sprintf("s%d", (g+i)%5)
					r, err := l.Reserve(ctx, k)
					if err == nil && i%2 == 0 {
						err = r.Cancel(ctx)
					}
					if err == nil {
						_, err = l.Allow(ctx, k)
					}
					if err != nil {
						failed.Store(err)
						return
					}
				}
			}
		}()
	}
	wg.Wait()
	if err, _ := failed.Load().(error); err != nil {
		t.Fatal(err)
	}
	sc.mu.Lock()
	defer sc.mu.Unlock()
	require.NotEmpty(t, sc.kept)
	for i := range sc.kept {
		require.Equal(t, sc.then[i], sc.kept[i], "kept keys slice %d changed after its call", i)
		k := sc.kept[i]
		require.True(t, strings.HasPrefix(k[0], prefix+"ks:{s") || strings.HasPrefix(k[0], prefix+"kl:{s"), "key %q", k[0])
		if strings.HasPrefix(k[0], prefix+"kl:") && len(k) >= 2 && !strings.Contains(k[1], "tomb") {
			// The layered call's second key is the first's, by period.
			if strings.HasSuffix(k[1], ":60000ms") {
				require.Equal(t, k[0]+":60000ms", k[1])
			}
		}
	}
}

// TestReviewALReserveCancel: cancels latest first give each slot back, on
// one limit and on two; the slots of later reservations come exactly where
// the cancelled ones stood (Redis clock), and the held Bookings read the
// same after the later calls.
func TestReviewALReserveCancel(t *testing.T) {
	srv := redistest.Shared(t)
	eng, err := throttle.New(srv.Client(t), throttle.WithPrefix(redistest.Prefix(t)), throttle.WithTimeout(5*time.Second))
	require.NoError(t, err)
	ctx := context.Background()
	single, err := reserve.New(eng, "cs", throttle.PerMinute(1, 0))
	require.NoError(t, err)
	lay, err := reserve.New(eng, "cl", throttle.PerMinute(1, 0), reserve.WithLimit(throttle.PerHour(30, 0)))
	require.NoError(t, err)
	for _, tc := range []struct {
		l    *reserve.Limiter
		step time.Duration
	}{{single, time.Minute}, {lay, 2 * time.Minute}} {
		var rs []*reserve.Reservation
		var held []throttle.Booking
		for range 4 {
			r, err := tc.l.Reserve(ctx, "x")
			require.NoError(t, err)
			require.True(t, r.OK())
			rs = append(rs, r)
			held = append(held, r.Booking())
		}
		for i := 1; i < 4; i++ {
			require.Equal(t, tc.step, held[i].At.Sub(held[i-1].At), "%s booking %d", tc.l.Name(), i)
		}
		require.NoError(t, rs[3].Cancel(ctx))
		require.NoError(t, rs[2].Cancel(ctx))
		r, err := tc.l.Reserve(ctx, "x")
		require.NoError(t, err)
		require.Equal(t, held[2].At, r.Booking().At, "%s: slot after cancels", tc.l.Name())
		for i, r := range rs {
			require.Equal(t, held[i], r.Booking())
		}
	}
}

// TestReviewALReserveCorrupt: "abc" in a single limit's key, and in a
// layered limiter's second key: Reserve and Allow fail, naming the
// subject's key (Redis's message the corrupt one's), from many goroutines
// beside good subjects; nothing panics.
func TestReviewALReserveCorrupt(t *testing.T) {
	srv := redistest.Shared(t)
	o := srv.Options()
	o.PoolSize = 2
	rdb := redis.NewClient(o)
	t.Cleanup(func() { _ = rdb.Close() })
	direct := srv.Client(t)
	prefix := redistest.Prefix(t)
	eng, err := throttle.New(rdb, throttle.WithPrefix(prefix), throttle.WithMerging(true), throttle.WithTimeout(5*time.Second))
	require.NoError(t, err)
	ctx := context.Background()
	single, err := reserve.New(eng, "xs", throttle.PerSecond(10000, 10))
	require.NoError(t, err)
	lay, err := reserve.New(eng, "xl", throttle.PerSecond(10000, 10), reserve.WithLimit(throttle.PerMinute(1000000, 100)))
	require.NoError(t, err)
	require.NoError(t, direct.Set(ctx, prefix+"xs:{bad}", "abc", time.Minute).Err())
	require.NoError(t, direct.Set(ctx, prefix+"xl:{bad}:60000ms", "abc", time.Minute).Err())
	var wg sync.WaitGroup
	var failed atomic.Value
	for g := range 24 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range 30 {
				l, name := single, "xs"
				corruptKey := prefix + "xs:{bad}"
				if (g+i)%2 == 1 {
					l, name = lay, "xl"
					corruptKey = prefix + "xl:{bad}:60000ms"
				}
				subj := fmt.Sprintf("good%d", (g+i)%7)
				bad := (g+i)%3 == 0
				if bad {
					subj = "bad"
				}
				var err error
				if i%2 == 0 {
					var r *reserve.Reservation
					r, err = l.Reserve(ctx, subj)
					if err == nil && !r.OK() {
						err = fmt.Errorf("refused: %w", r.Err())
					}
				} else {
					var res throttle.Result
					res, err = l.Allow(ctx, subj)
					if err == nil && !res.Allowed {
						err = fmt.Errorf("denied")
					}
				}
				switch {
				case bad && err == nil:
					failed.Store(fmt.Errorf("%s corrupt subject booked", name))
				case bad:
					msg := err.Error()
					if !strings.Contains(msg, fmt.Sprintf("%q", name+":{bad}")) || !strings.Contains(msg, "key "+corruptKey+" holds") {
						failed.Store(fmt.Errorf("%s: error names another key: %v", name, err))
					}
				case err != nil:
					failed.Store(fmt.Errorf("%s %s: %w", name, subj, err))
				}
			}
		}()
	}
	wg.Wait()
	if err, _ := failed.Load().(error); err != nil {
		t.Fatal(err)
	}
}

// TestReviewALReserveRefusalsBookNothing: on a test clock, a layered
// limiter (10/s burst 2, 20/min burst 4) and a single one: the textbook's
// slots, then refusals past the max wait that book nothing (the same
// retry-after twice, and the next slot with no bound is that one), and an
// Allow denied counts nothing.
func TestReviewALReserveRefusalsBookNothing(t *testing.T) {
	srv := redistest.Shared(t)
	eng, err := throttle.New(srv.Client(t), throttle.WithPrefix(redistest.Prefix(t)), throttle.WithTimeout(5*time.Second))
	require.NoError(t, err)
	T0 := time.Now().UnixMicro()
	ctx := testhook.WithNow(context.Background(), T0)
	lay, err := reserve.New(eng, "rb", throttle.PerSecond(10, 2), reserve.WithLimit(throttle.PerMinute(20, 4)), reserve.WithMaxWait(250*time.Millisecond))
	require.NoError(t, err)
	want := []time.Duration{0, 0, 0, 100 * time.Millisecond, 200 * time.Millisecond}
	for i, w := range want {
		r, err := lay.Reserve(ctx, "x")
		require.NoError(t, err)
		require.True(t, r.OK(), "booking %d: %v", i, r.Err())
		require.Equal(t, w, r.Booking().Wait, "booking %d", i)
		require.Equal(t, T0+w.Microseconds(), r.Booking().At.UnixMicro())
	}
	for range 2 {
		r, err := lay.Reserve(ctx, "x")
		require.NoError(t, err)
		require.False(t, r.OK())
		require.Equal(t, 3*time.Second, r.RetryAfter())
		require.False(t, r.Booking().OK)
		res, err := lay.Allow(ctx, "x")
		require.NoError(t, err)
		require.False(t, res.Allowed)
		require.Equal(t, 3*time.Second, res.RetryAfter)
	}
	free, err := lay.With(reserve.WithoutMaxWait())
	require.NoError(t, err)
	r, err := free.Reserve(ctx, "x")
	require.NoError(t, err)
	require.True(t, r.OK())
	require.Equal(t, 3*time.Second, r.Booking().Wait)

	single, err := reserve.New(eng, "rs", throttle.PerSecond(10, 1), reserve.WithMaxWait(150*time.Millisecond))
	require.NoError(t, err)
	for i, w := range []time.Duration{0, 0, 100 * time.Millisecond} {
		r, err := single.Reserve(ctx, "y")
		require.NoError(t, err)
		require.True(t, r.OK(), "booking %d", i)
		require.Equal(t, w, r.Booking().Wait)
	}
	for range 2 {
		res, err := single.Allow(ctx, "y")
		require.NoError(t, err)
		require.False(t, res.Allowed)
		require.Equal(t, 200*time.Millisecond, res.RetryAfter)
		r, err := single.Reserve(ctx, "y")
		require.NoError(t, err)
		require.False(t, r.OK())
		require.Equal(t, 200*time.Millisecond, r.RetryAfter())
	}
}
