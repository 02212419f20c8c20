package throttle_test

// Review (helper AL43) of 1eec856, 3a267c2, 1dd04e7 (and reserve's
// 6dcf54b): the client path's allocation cuts: the merger's landFn made
// once; a book1.lua reply read into single1 (one allocation for the
// reply's values, the Booking and its way); runCmd's prefixed keys in a
// stack array; keys cloned only for a Scripter that is not a go-redis
// client. Attacked through the public API: holders that keep what they
// are given (a Scripter wrapper, a client hook keeping cmd.Args(), an
// Observer), Bookings kept, copied and compared across calls, merged
// calls under a small pool, a textbook GCRA replay of the slots granted,
// and replies that cannot be read.

import (
	"context"
	"errors"
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
	"github.com/slotbook/slotbook/throttle"
)

// alKept is one keys slice a Scripter was given, with what it held then.
type alKept struct {
	keys []string
	then []string
}

// alScripter is a redis.Scripter that is not a go-redis client: it
// forwards to a real client, keeps every keys slice it is given (and a
// copy of what it held), and, if clobber, writes over the slice once the
// call is over, as a holder of the caller's memory might.
type alScripter struct {
	rdb     *redis.Client
	clobber bool
	// reply, if set, replaces the real reply (after the call ran).
	reply func(keys []string, real any) any

	mu   sync.Mutex
	kept []alKept
}

func (s *alScripter) keep(keys []string) {
	s.mu.Lock()
	s.kept = append(s.kept, alKept{keys: keys, then: slices.Clone(keys)})
	s.mu.Unlock()
}

func (s *alScripter) after(keys []string, cmd *redis.Cmd) *redis.Cmd {
	if s.reply != nil && cmd.Err() == nil {
		c := redis.NewCmd(context.Background())
		c.SetVal(s.reply(slices.Clone(keys), cmd.Val()))
		cmd = c
	}
	if s.clobber {
		for i := range keys {
			keys[i] = "CLOBBERED"
		}
	}
	return cmd
}

func (s *alScripter) Eval(ctx context.Context, script string, keys []string, args ...interface{}) *redis.Cmd {
	s.keep(keys)
	return s.after(keys, s.rdb.Eval(ctx, script, slices.Clone(keys), args...))
}

func (s *alScripter) EvalSha(ctx context.Context, sha1 string, keys []string, args ...interface{}) *redis.Cmd {
	s.keep(keys)
	return s.after(keys, s.rdb.EvalSha(ctx, sha1, slices.Clone(keys), args...))
}

func (s *alScripter) EvalRO(ctx context.Context, script string, keys []string, args ...interface{}) *redis.Cmd {
	s.keep(keys)
	return s.after(keys, s.rdb.EvalRO(ctx, script, slices.Clone(keys), args...))
}

func (s *alScripter) EvalShaRO(ctx context.Context, sha1 string, keys []string, args ...interface{}) *redis.Cmd {
	s.keep(keys)
	return s.after(keys, s.rdb.EvalShaRO(ctx, sha1, slices.Clone(keys), args...))
}

func (s *alScripter) ScriptExists(ctx context.Context, hashes ...string) *redis.BoolSliceCmd {
	return s.rdb.ScriptExists(ctx, hashes...)
}

func (s *alScripter) ScriptLoad(ctx context.Context, script string) *redis.StringCmd {
	return s.rdb.ScriptLoad(ctx, script)
}

// check fails t if a kept slice no longer holds what it held when given
// (only meaningful without clobber).
func (s *alScripter) check(t *testing.T) int {
	t.Helper()
	s.mu.Lock()
	defer s.mu.Unlock()
	for i, k := range s.kept {
		require.Equal(t, k.then, k.keys, "kept keys slice %d changed after its call", i)
	}
	return len(s.kept)
}

// alArgsHook keeps every command's cmd.Args() slice and a copy of it.
type alArgsHook struct {
	mu      sync.Mutex
	args    [][]any
	then    [][]any
	many    atomic.Int64 // evalsha/eval with more than 2 keys (bookmany.lua)
	scripts atomic.Int64
}

func (h *alArgsHook) DialHook(next redis.DialHook) redis.DialHook { return next }
func (h *alArgsHook) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}

func (h *alArgsHook) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		a := cmd.Args()
		if len(a) > 2 {
			if name, _ := a[0].(string); name == "evalsha" || name == "eval" {
				h.scripts.Add(1)
				if n, ok := a[2].(int); ok && n > 2 {
					h.many.Add(1)
				}
			}
		}
		h.mu.Lock()
		h.args = append(h.args, a)
		h.then = append(h.then, slices.Clone(a))
		h.mu.Unlock()
		return next(ctx, cmd)
	}
}

func (h *alArgsHook) check(t *testing.T) int {
	t.Helper()
	h.mu.Lock()
	defer h.mu.Unlock()
	for i := range h.args {
		require.Equal(t, h.then[i], h.args[i], "kept cmd.Args() %d changed after its call", i)
	}
	return len(h.args)
}

// alObserver records the labels it is told, checking them against want.
type alObserver struct {
	want      func(string) bool
	mu        sync.Mutex
	bad       []string
	decisions map[string]int
	refunds   atomic.Int64
}

func (o *alObserver) note(l string) {
	o.mu.Lock()
	defer o.mu.Unlock()
	if o.decisions == nil {
		o.decisions = map[string]int{}
	}
	if !o.want(l) {
		o.bad = append(o.bad, l)
	}
}

func (o *alObserver) ObserveDecision(l string, _ throttle.Outcome, _ time.Duration) {
	o.note(l)
	o.mu.Lock()
	o.decisions[l]++
	o.mu.Unlock()
}
func (o *alObserver) ObserveCall(l string, _ time.Duration, _ error) { o.note(l) }
func (o *alObserver) ObserveRefund(l string, _ time.Duration)        { o.note(l); o.refunds.Add(1) }
func (o *alObserver) ObserveBreaker(bool)                            {}

// alSlot is a granted booking on the Redis clock.
type alSlot struct {
	at time.Time
	n  int
}

// alReplay checks slots (granted on one key under l, none given back)
// against the textbook GCRA (virtual scheduling): in order of their slots,
// each of n units conforms if at >= tat + (n-1)*I - tau, and moves tat to
// max(tat, at) + n*I. Slots of one key are granted in the order they are
// booked, each no earlier than the TAT before it allows.
func alReplay(t *testing.T, what string, l throttle.Limit, slots []alSlot) {
	t.Helper()
	I := l.Period.Microseconds() / int64(l.Rate)
	tau := int64(l.Burst) * I
	sort.SliceStable(slots, func(i, j int) bool { return slots[i].at.Before(slots[j].at) })
	var tat int64 = -1 << 62
	for i, s := range slots {
		at := s.at.UnixMicro()
		if at < tat+int64(s.n-1)*I-tau {
			t.Fatalf("%s: slot %d at %d (n=%d) is %dµs before the textbook GCRA allows (tat %d, I %d, tau %d)",
				what, i, at, s.n, tat+int64(s.n-1)*I-tau-at, tat, I, tau)
		}
		tat = max(tat, at) + int64(s.n)*I
	}
}

func alClient(t *testing.T, srv *redistest.Server, pool int, h redis.Hook) *redis.Client {
	o := srv.Options()
	if pool > 0 {
		o.PoolSize = pool
	}
	c := redis.NewClient(o)
	t.Cleanup(func() { _ = c.Close() })
	if h != nil {
		c.AddHook(h)
	}
	return c
}

// TestReviewALScripterKeepsKeys: a Scripter that is not a go-redis client
// keeps every keys slice it is given; after many more calls from many
// goroutines (Book, BookAll with two limits, Allow, Refund, RefundAll,
// RefundUnused, Block), every kept slice still holds what it held, and
// holds the prefixed keys of its own call.
func TestReviewALScripterKeepsKeys(t *testing.T) {
	srv := redistest.Shared(t)
	sc := &alScripter{rdb: srv.Client(t)}
	prefix := redistest.Prefix(t)
	eng, err := throttle.New(sc, throttle.WithPrefix(prefix), throttle.WithTimeout(5*time.Second))
	require.NoError(t, err)
	ctx := context.Background()
	l1 := throttle.PerSecond(1000, 5)
	l2 := throttle.PerMinute(100000, 10)
	var wg sync.WaitGroup
	errs := make(chan error, 1000)
	for g := range 16 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			k := fmt.Sprintf("al%d:{s%d}", g%4, g)
			ks := []string{k, k + ":day"}
			for i := range 30 {
				b, err := eng.Book(ctx, k, l1, throttle.Request{N: 1, MaxWait: throttle.Forever})
				if err != nil {
					errs <- err
					return
				}
				bs, err := eng.BookAll(ctx, ks, []throttle.Limit{l1, l2}, []throttle.Request{{N: 1, MaxWait: throttle.Forever}})
				if err != nil {
					errs <- err
					return
				}
				if _, err := eng.Allow(ctx, k, l1); err != nil {
					errs <- err
					return
				}
				switch i % 3 {
				case 0:
					_, err = eng.Refund(ctx, k, l1, b)
				case 1:
					_, err = eng.RefundUnused(ctx, []string{k}, []throttle.Limit{l1}, b)
				}
				if err == nil {
					_, err = eng.RefundAll(ctx, ks, []throttle.Limit{l1, l2}, bs[0])
				}
				if err != nil {
					errs <- err
					return
				}
				require.Equal(t, []string{k, k + ":day"}, ks, "the caller's keys changed")
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		require.NoError(t, err)
	}
	n := sc.check(t)
	require.Greater(t, n, 16*30*4)
	sc.mu.Lock()
	for _, k := range sc.kept {
		for _, key := range k.keys {
			require.True(t, strings.HasPrefix(key, prefix+"al"), "kept key %q lacks the prefix", key)
		}
	}
	sc.mu.Unlock()
}

// TestReviewALScripterClobbers: a Scripter that writes over the keys slice
// it was given once its call is over changes none of the caller's keys,
// no Booking, and no later call: bookings stay right (two bookings in a
// row on one key, spaced by the interval) and errors quote the right key.
func TestReviewALScripterClobbers(t *testing.T) {
	srv := redistest.Shared(t)
	sc := &alScripter{rdb: srv.Client(t), clobber: true}
	prefix := redistest.Prefix(t)
	eng, err := throttle.New(sc, throttle.WithPrefix(prefix), throttle.WithTimeout(5*time.Second))
	require.NoError(t, err)
	ctx := context.Background()
	l := throttle.PerMinute(60, 0) // I = 1s, no burst
	keys := []string{"clob:{a}"}
	b1, err := eng.BookAll(ctx, keys, []throttle.Limit{l}, []throttle.Request{{N: 1, MaxWait: throttle.Forever}})
	require.NoError(t, err)
	require.Equal(t, []string{"clob:{a}"}, keys)
	b2, err := eng.Book(ctx, "clob:{a}", l, throttle.Request{N: 1, MaxWait: throttle.Forever})
	require.NoError(t, err)
	require.True(t, b1[0].OK && b2.OK)
	require.Equal(t, time.Second, b2.At.Sub(b1[0].At).Round(time.Millisecond), "second booking not one interval after the first")
	require.True(t, b1[0].Before(b2))
	// The refund of the latest gives back one interval, on the right key.
	given, err := eng.Refund(ctx, "clob:{a}", l, b2)
	require.NoError(t, err)
	require.Equal(t, time.Second, given)
	b3, err := eng.Book(ctx, "clob:{a}", l, throttle.Request{N: 1, MaxWait: throttle.Forever})
	require.NoError(t, err)
	require.Equal(t, b2.At, b3.At, "the slot given back was not booked again")
	// Nothing ever reached a key named CLOBBERED.
	n, err := srv.Client(t).Exists(ctx, prefix+"CLOBBERED", "CLOBBERED").Result()
	require.NoError(t, err)
	require.Zero(t, n)
	// An error quotes the caller's key, not what the Scripter wrote.
	require.NoError(t, srv.Client(t).Set(ctx, prefix+"clob:{bad}", "abc", time.Minute).Err())
	_, err = eng.Book(ctx, "clob:{bad}", l, throttle.Request{N: 1, MaxWait: throttle.Forever})
	require.Error(t, err)
	require.Contains(t, err.Error(), `"clob:{bad}"`)
	require.NotContains(t, err.Error(), "CLOBBERED")
}

// TestReviewALHookKeepsArgs: a go-redis client whose hook keeps every
// command's cmd.Args(): after many calls from many goroutines, merged
// ones among them (a pool of 2, WithMerging), every kept argument list
// still holds what it held, and the key arguments of single calls are
// their callers' prefixed keys.
func TestReviewALHookKeepsArgs(t *testing.T) {
	srv := redistest.Start(t) // its own: SCRIPT FLUSH below
	h := &alArgsHook{}
	rdb := alClient(t, srv, 2, h)
	prefix := redistest.Prefix(t)
	eng, err := throttle.New(rdb, throttle.WithPrefix(prefix), throttle.WithMerging(true), throttle.WithTimeout(5*time.Second))
	require.NoError(t, err)
	ctx := context.Background()
	l := throttle.PerSecond(100000, 10)
	var wg sync.WaitGroup
	var failed atomic.Value
	// SCRIPT FLUSH now and then: calls answered NOSCRIPT send EVAL, a
	// second argument list beside the first's, which the hook keeps too.
	direct := srv.Client(t)
	stop := make(chan struct{})
	flushed := make(chan struct{})
	go func() {
		defer close(flushed)
		for {
			select {
			case <-stop:
				return
			case <-time.After(20 * time.Millisecond):
				_ = direct.ScriptFlush(ctx).Err()
			}
		}
	}()
	for g := range 64 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range 40 {
				k := fmt.Sprintf("hk%d:{k%d}", g%3, (g*40+i)%97)
				b, err := eng.Book(ctx, k, l, throttle.Request{N: 1, MaxWait: throttle.Forever})
				if err == nil && i%4 == 0 {
					_, err = eng.Refund(ctx, k, l, b)
				}
				if err == nil && i%5 == 0 {
					_, err = eng.Allow(ctx, k, l)
				}
				if err != nil {
					failed.Store(err)
					return
				}
			}
		}()
	}
	wg.Wait()
	close(stop)
	<-flushed
	if err, _ := failed.Load().(error); err != nil {
		t.Fatal(err)
	}
	n := h.check(t)
	evals := 0
	h.mu.Lock()
	for _, a := range h.args {
		if name, _ := a[0].(string); name == "eval" {
			evals++
		}
	}
	h.mu.Unlock()
	t.Logf("commands kept: %d, scripts %d, merged (bookmany) calls: %d, EVALs after NOSCRIPT: %d", n, h.scripts.Load(), h.many.Load(), evals)
	h.mu.Lock()
	defer h.mu.Unlock()
	for _, a := range h.args {
		if len(a) < 4 {
			continue
		}
		if name, _ := a[0].(string); name != "evalsha" && name != "eval" {
			continue
		}
		nk := a[2].(int)
		for i := range nk {
			key := a[3+i].(string)
			require.True(t, strings.HasPrefix(key, prefix+"hk"), "key argument %q", key)
		}
	}
}

// TestReviewALBookingsKept: Bookings kept from many calls, copied and
// compared later: each keeps its slot, End and order (Before) after many
// later calls; a copy shares its way (RefundAll of a copy, then
// RefundUnused of the original fails with ErrInvalidRequest); refunds
// latest first give back one interval each, and a second refund gives 0.
// On a test clock, so every value is exact.
func TestReviewALBookingsKept(t *testing.T) {
	e := newEnv(t)
	T0 := base()
	ctx := testhook.WithNow(context.Background(), T0)
	l := throttle.PerSecond(10, 2) // I = 100ms, tau = 200ms
	key := "kept:{a}"
	var bs []throttle.Booking
	for range 6 {
		b, err := e.eng.Book(ctx, key, l, throttle.Request{N: 1, MaxWait: 350 * time.Millisecond})
		require.NoError(t, err)
		bs = append(bs, b)
	}
	// Textbook: 3 at T0 (burst+1), then T0+100ms, T0+200ms, T0+300ms.
	want := []int64{0, 0, 0, 100_000, 200_000, 300_000}
	copies := slices.Clone(bs)
	for i, b := range bs {
		require.True(t, b.OK, "booking %d", i)
		require.Equal(t, T0+want[i], b.At.UnixMicro(), "booking %d", i)
		require.Equal(t, T0+want[i]-T0, b.Wait.Microseconds())
	}
	// Refusals book nothing: two in a row, the same retry-after.
	r1, err := e.eng.Book(ctx, key, l, throttle.Request{N: 1, MaxWait: 350 * time.Millisecond})
	require.NoError(t, err)
	r2, err := e.eng.Book(ctx, key, l, throttle.Request{N: 1, MaxWait: 350 * time.Millisecond})
	require.NoError(t, err)
	require.False(t, r1.OK)
	require.False(t, r2.OK)
	require.Equal(t, 400*time.Millisecond, r1.Wait)
	require.Equal(t, r1.Wait, r2.Wait)
	require.True(t, r1.End().IsZero())
	// Many more calls on other keys, then look again.
	for i := range 200 {
		_, err := e.eng.Book(ctx, fmt.Sprintf("kept:{o%d}", i%7), l, throttle.Request{N: 1, MaxWait: throttle.Forever})
		require.NoError(t, err)
	}
	for i, b := range bs {
		require.Equal(t, copies[i], b)
		require.Equal(t, T0+want[i], b.At.UnixMicro())
		// End: the TAT it left, max(tat, slot) + I.
		require.Equal(t, T0+int64(i+1)*100_000, b.End().UnixMicro(), "End of booking %d", i)
		for j := range bs {
			require.Equal(t, i < j, b.Before(bs[j]), "booking %d Before %d", i, j)
		}
	}
	// A copy's give-back marks the original: one way shared.
	c := copies[5]
	given, err := e.eng.RefundAll(ctx, []string{key}, []throttle.Limit{l}, c)
	require.NoError(t, err)
	require.Equal(t, []time.Duration{100 * time.Millisecond}, given)
	_, err = e.eng.RefundUnused(ctx, []string{key}, []throttle.Limit{l}, bs[5])
	require.ErrorIs(t, err, throttle.ErrInvalidRequest)
	again, err := e.eng.Refund(ctx, key, l, bs[5])
	require.NoError(t, err)
	require.Zero(t, again)
	// Latest first: each gives one interval back.
	for i := 4; i >= 3; i-- {
		g, err := e.eng.Refund(ctx, key, l, bs[i])
		require.NoError(t, err)
		require.Equal(t, 100*time.Millisecond, g, "refund of booking %d", i)
	}
	// The key is back to three at T0: the next booking's slot is T0+100ms.
	b, err := e.eng.Book(ctx, key, l, throttle.Request{N: 1, MaxWait: throttle.Forever})
	require.NoError(t, err)
	require.Equal(t, T0+100_000, b.At.UnixMicro())
	// The old bookings still read as before.
	for i, b := range bs {
		require.Equal(t, copies[i], b)
	}
}

// TestReviewALReplayMerged: many goroutines on many keys through a pool of
// 2 with merging: every booking's slot, on the Redis clock, passes a
// textbook GCRA replay per key; refusals (a bounded max wait) book
// nothing; bookings given back with a nonzero refund are left out of the
// replay. The Observer sees only the limiters' names.
func TestReviewALReplayMerged(t *testing.T) {
	srv := redistest.Shared(t)
	h := &alArgsHook{}
	rdb := alClient(t, srv, 2, h)
	prefix := redistest.Prefix(t)
	obs := &alObserver{want: func(l string) bool { return l == "rm0" || l == "rm1" || l == "rm2" }}
	eng, err := throttle.New(rdb, throttle.WithPrefix(prefix), throttle.WithMerging(true),
		throttle.WithTimeout(5*time.Second), throttle.WithObserver(obs))
	require.NoError(t, err)
	ctx := context.Background()
	l := throttle.PerSecond(500, 3) // I = 2ms, tau = 6ms
	const keys = 12
	var mu sync.Mutex
	slots := map[string][]alSlot{}
	var refused, given atomic.Int64
	var wg sync.WaitGroup
	var failed atomic.Value
	for g := range 48 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range 60 {
				k := fmt.Sprintf("rm%d:{k%d}", (g+i)%3, (g*7+i)%keys)
				mw := throttle.Forever
				if i%3 == 0 {
					mw = 5 * time.Millisecond
				}
				n := 1 + (g+i)%2
				b, err := eng.Book(ctx, k, l, throttle.Request{N: n, MaxWait: mw})
				if err != nil {
					failed.Store(err)
					return
				}
				if !b.OK {
					refused.Add(1)
					require.True(t, b.End().IsZero())
					continue
				}
				require.Equal(t, n, b.N)
				if i%7 == 0 {
					gv, err := eng.Refund(ctx, k, l, b)
					if err != nil {
						failed.Store(err)
						return
					}
					if gv > 0 {
						given.Add(1)
						continue // never ran: out of the replay
					}
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
	total := 0
	for k, s := range slots {
		total += len(s)
		alReplay(t, k, l, s)
	}
	t.Logf("granted %d, refused %d, given back %d, merged calls %d of %d", total, refused.Load(), given.Load(), h.many.Load(), h.scripts.Load())
	require.Empty(t, obs.bad, "labels the Observer should not have seen")
	require.Equal(t, 48*60, obs.decisions["rm0"]+obs.decisions["rm1"]+obs.decisions["rm2"])
}

// TestReviewALMergedSpacing: each of 64 goroutines books its own key 6
// times with Forever under 1 a minute (no burst) through a pool of 2 with
// merging: the slots of each key are exactly a minute apart on the Redis
// clock, each key's bookings stand in order (Before, End), and refunds
// latest first give back a minute each, on the caller's own key.
func TestReviewALMergedSpacing(t *testing.T) {
	srv := redistest.Shared(t)
	h := &alArgsHook{}
	rdb := alClient(t, srv, 2, h)
	prefix := redistest.Prefix(t)
	eng, err := throttle.New(rdb, throttle.WithPrefix(prefix), throttle.WithMerging(true), throttle.WithTimeout(5*time.Second))
	require.NoError(t, err)
	ctx := context.Background()
	l := throttle.PerMinute(1, 0)
	const G, N = 64, 6
	got := make([][]throttle.Booking, G)
	var wg sync.WaitGroup
	var failed atomic.Value
	for g := range G {
		wg.Add(1)
		go func() {
			defer wg.Done()
			k := fmt.Sprintf("sp:{g%d}", g)
			for range N {
				b, err := eng.Book(ctx, k, l, throttle.Request{N: 1, MaxWait: throttle.Forever})
				if err != nil {
					failed.Store(err)
					return
				}
				got[g] = append(got[g], b)
			}
		}()
	}
	wg.Wait()
	if err, _ := failed.Load().(error); err != nil {
		t.Fatal(err)
	}
	t.Logf("merged calls %d of %d", h.many.Load(), h.scripts.Load())
	for g, bs := range got {
		for i := 1; i < N; i++ {
			require.Equal(t, time.Minute, bs[i].At.Sub(bs[i-1].At), "key %d booking %d", g, i)
			require.True(t, bs[i-1].Before(bs[i]))
			require.Equal(t, bs[i].At, bs[i-1].End())
		}
	}
	// Refunds latest first, from all goroutines at once.
	for g := range G {
		wg.Add(1)
		go func() {
			defer wg.Done()
			k := fmt.Sprintf("sp:{g%d}", g)
			for i := N - 1; i >= 1; i-- {
				gv, err := eng.Refund(ctx, k, l, got[g][i])
				if err != nil {
					failed.Store(err)
					return
				}
				if gv != time.Minute {
					failed.Store(fmt.Errorf("key %d booking %d: refund gave %v, want 1m", g, i, gv))
					return
				}
			}
		}()
	}
	wg.Wait()
	if err, _ := failed.Load().(error); err != nil {
		t.Fatal(err)
	}
}

// TestReviewALCorruptNamesKey: keys holding "abc" among good ones, booked
// from many goroutines through a pool of 2 with merging (a merged call
// with a corrupt key sends each request again alone): each caller of a
// corrupt key gets an error naming its own key (and Redis's naming its
// prefixed key), each caller of a good key a booking; nothing panics.
func TestReviewALCorruptNamesKey(t *testing.T) {
	srv := redistest.Shared(t)
	rdb := alClient(t, srv, 2, nil)
	direct := srv.Client(t)
	prefix := redistest.Prefix(t)
	eng, err := throttle.New(rdb, throttle.WithPrefix(prefix), throttle.WithMerging(true), throttle.WithTimeout(5*time.Second))
	require.NoError(t, err)
	ctx := context.Background()
	for i := range 8 {
		require.NoError(t, direct.Set(ctx, prefix+fmt.Sprintf("cx:{bad%d}", i), "abc", time.Minute).Err())
	}
	l := throttle.PerSecond(100000, 10)
	var wg sync.WaitGroup
	var failed atomic.Value
	var bad, good atomic.Int64
	for g := range 48 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range 40 {
				var k string
				corrupt := (g+i)%3 == 0
				if corrupt {
					k = fmt.Sprintf("cx:{bad%d}", (g+i)%8)
				} else {
					k = fmt.Sprintf("cx:{good%d}", (g+i)%11)
				}
				var err error
				var ok bool
				if i%2 == 0 {
					var b throttle.Booking
					b, err = eng.Book(ctx, k, l, throttle.Request{N: 1, MaxWait: throttle.Forever})
					ok = b.OK
				} else {
					var r throttle.Result
					r, err = eng.Allow(ctx, k, l)
					ok = r.Allowed
				}
				switch {
				case corrupt && err == nil:
					failed.Store(fmt.Errorf("corrupt key %s booked", k))
				case corrupt:
					bad.Add(1)
					msg := err.Error()
					if !strings.Contains(msg, fmt.Sprintf("%q", k)) || !strings.Contains(msg, "key "+prefix+k+" holds") {
						failed.Store(fmt.Errorf("error for %s names another key: %v", k, err))
					}
				case err != nil:
					failed.Store(fmt.Errorf("good key %s: %w", k, err))
				case !ok:
					failed.Store(fmt.Errorf("good key %s refused", k))
				default:
					good.Add(1)
				}
			}
		}()
	}
	wg.Wait()
	if err, _ := failed.Load().(error); err != nil {
		t.Fatal(err)
	}
	t.Logf("corrupt errors %d, good bookings %d", bad.Load(), good.Load())
	// The corrupt keys still hold what they held: nothing wrote them.
	for i := range 8 {
		v, err := direct.Get(ctx, prefix+fmt.Sprintf("cx:{bad%d}", i)).Result()
		require.NoError(t, err)
		require.Equal(t, "abc", v)
	}
}

// TestReviewALUnreadableReply: a Scripter whose book1.lua replies are
// replaced by ones that cannot be read (or that disagree with the
// request): every call fails with ErrReplyLost naming the caller's key,
// and nothing panics; afterwards the same engine books right again.
func TestReviewALUnreadableReply(t *testing.T) {
	srv := redistest.Shared(t)
	prefix := redistest.Prefix(t)
	bads := []any{
		"", "1", "x y", "1 2 3 4", "1 -2", "1 2 -x", "-1 2", "1 2 --5",
		"99999999999999999999 1", "1 99999999999999999999", "1 2 99999999999999999999",
		"1 2 -", // a refusal where the wait is 0: disagrees with max wait Forever
		"1 0 9223372036854775807",
		int64(5), []any{int64(1), int64(2)}, nil, []any{},
	}
	var which atomic.Int64
	which.Store(-1)
	sc := &alScripter{rdb: srv.Client(t), reply: func(keys []string, real any) any {
		if i := which.Load(); i >= 0 {
			return bads[i]
		}
		return real
	}}
	eng, err := throttle.New(sc, throttle.WithPrefix(prefix), throttle.WithTimeout(5*time.Second))
	require.NoError(t, err)
	ctx := context.Background()
	l := throttle.PerSecond(10, 1)
	for i, r := range bads {
		which.Store(int64(i))
		k := fmt.Sprintf("ur:{k%d}", i)
		func() {
			defer func() {
				if p := recover(); p != nil {
					t.Fatalf("reply %#v: panic %v", r, p)
				}
			}()
			b, err := eng.Book(ctx, k, l, throttle.Request{N: 1, MaxWait: throttle.Forever})
			require.Error(t, err, "reply %#v gave %+v", r, b)
			require.ErrorIs(t, err, throttle.ErrReplyLost, "reply %#v", r)
			require.Contains(t, err.Error(), fmt.Sprintf("%q", k))
			_, err = eng.Allow(ctx, k, l)
			require.ErrorIs(t, err, throttle.ErrReplyLost, "reply %#v (Allow)", r)
			require.Contains(t, err.Error(), fmt.Sprintf("%q", k))
		}()
	}
	which.Store(-1)
	b1, err := eng.Book(ctx, "ur:{fresh}", l, throttle.Request{N: 1, MaxWait: throttle.Forever})
	require.NoError(t, err)
	b2, err := eng.Book(ctx, "ur:{fresh}", l, throttle.Request{N: 1, MaxWait: throttle.Forever})
	require.NoError(t, err)
	b3, err := eng.Book(ctx, "ur:{fresh}", l, throttle.Request{N: 1, MaxWait: throttle.Forever})
	require.NoError(t, err)
	require.True(t, b1.OK && b2.OK && b3.OK)
	// Burst 1: the second goes at once, the third one interval after the first.
	require.Less(t, b2.Wait, time.Millisecond)
	require.Equal(t, 100*time.Millisecond, b3.At.Sub(b1.At))
	require.False(t, errors.Is(err, throttle.ErrReplyLost))
}

// TestReviewALFlightTokens: with flight tokens (WithMergeAt(2) under a
// pool of 16) held strictly (WithMergeWait(Forever)), many goroutines on
// many keys, corrupt ones among them (a merged call's corrupt key goes
// again alone, boarding for a token): every token comes back (landFn): a
// leaked one would leave later calls waiting for ever. Afterwards single
// calls go alone, each as one book1.lua call of one key, and the slots of
// each key pass the replay.
func TestReviewALFlightTokens(t *testing.T) {
	srv := redistest.Shared(t)
	h := &alArgsHook{}
	rdb := alClient(t, srv, 16, h)
	direct := srv.Client(t)
	prefix := redistest.Prefix(t)
	eng, err := throttle.New(rdb, throttle.WithPrefix(prefix), throttle.WithMerging(true), throttle.WithMergeAt(2),
		throttle.WithMergeWait(throttle.Forever), throttle.WithTimeout(5*time.Second))
	require.NoError(t, err)
	ctx := context.Background()
	for i := range 4 {
		require.NoError(t, direct.Set(ctx, prefix+fmt.Sprintf("ft:{bad%d}", i), "abc", time.Minute).Err())
	}
	l := throttle.PerSecond(1000, 2)
	var mu sync.Mutex
	slots := map[string][]alSlot{}
	var wg sync.WaitGroup
	var failed atomic.Value
	for g := range 64 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range 50 {
				k := fmt.Sprintf("ft:{k%d}", (g*13+i)%40)
				bad := (g+i)%9 == 0
				if bad {
					k = fmt.Sprintf("ft:{bad%d}", (g+i)%4)
				}
				cctx, cancel := context.WithTimeout(ctx, 10*time.Second)
				b, err := eng.Book(cctx, k, l, throttle.Request{N: 1, MaxWait: throttle.Forever})
				cancel()
				switch {
				case bad && err == nil:
					failed.Store(fmt.Errorf("corrupt %s booked", k))
					return
				case bad:
					if !strings.Contains(err.Error(), fmt.Sprintf("%q", k)) {
						failed.Store(fmt.Errorf("%s: %v", k, err))
						return
					}
				case err != nil:
					failed.Store(fmt.Errorf("%s: %w", k, err))
					return
				default:
					mu.Lock()
					slots[k] = append(slots[k], alSlot{at: b.At, n: 1})
					mu.Unlock()
				}
			}
		}()
	}
	wg.Wait()
	if err, _ := failed.Load().(error); err != nil {
		t.Fatal(err)
	}
	for k, s := range slots {
		alReplay(t, k, l, s)
	}
	t.Logf("merged calls %d of %d", h.many.Load(), h.scripts.Load())
	// Every token back: two calls at once each go alone, at once.
	before := h.scripts.Load()
	h.mu.Lock()
	var manySha any
	for _, a := range h.args {
		if name, _ := a[0].(string); name == "evalsha" && a[2].(int) > 2 {
			manySha = a[1]
		}
	}
	require.NotNil(t, manySha, "no merged call during the load")
	h.args, h.then = nil, nil
	h.mu.Unlock()
	for i := range 20 {
		var wg2 sync.WaitGroup
		for j := range 2 {
			wg2.Add(1)
			go func() {
				defer wg2.Done()
				cctx, cancel := context.WithTimeout(ctx, 5*time.Second)
				defer cancel()
				_, err := eng.Book(cctx, fmt.Sprintf("ft:{after%d-%d}", i, j), l, throttle.Request{N: 1, MaxWait: throttle.Forever})
				if err != nil {
					failed.Store(err)
				}
			}()
		}
		wg2.Wait()
	}
	if err, _ := failed.Load().(error); err != nil {
		t.Fatalf("after the load: %v (a flight token not given back?)", err)
	}
	require.Equal(t, int64(40), h.scripts.Load()-before)
	h.mu.Lock()
	defer h.mu.Unlock()
	for _, a := range h.args {
		if name, _ := a[0].(string); name == "evalsha" || name == "eval" {
			require.Equal(t, 1, a[2], "a call after the load went merged: %v", a)
			require.NotEqual(t, manySha, a[1], "a call after the load went merged (bookmany.lua): %v", a)
		}
	}
}

// TestReviewALCluster: a 3-node Cluster, a client whose hook keeps every
// cmd.Args(), an Observer, many goroutines on many keys (single and
// layered, a corrupt key among them): slots pass the replay, errors name
// their keys, and every kept argument list still holds what it held.
func TestReviewALCluster(t *testing.T) {
	cluster := redistest.StartCluster(t, 3)
	cc := cluster.Client(t)
	h := &alArgsHook{}
	cc.AddHook(h)
	obs := &alObserver{want: func(l string) bool { return strings.HasPrefix(l, "cl") }}
	eng, err := throttle.New(cc, throttle.WithObserver(obs), throttle.WithTimeout(5*time.Second))
	require.NoError(t, err)
	ctx := context.Background()
	redistest.UntilOK(t, func() error { _, err := eng.Allow(ctx, "clwarm:{w}", throttle.PerSecond(1000, 1000)); return err })
	require.NoError(t, cc.Set(ctx, "slotbook:cl0:{bad}", "abc", time.Minute).Err())
	l1 := throttle.PerSecond(1000, 2)
	l2 := throttle.PerMinute(30000, 20)
	var mu sync.Mutex
	slots := map[string][]alSlot{}
	var wg sync.WaitGroup
	var failed atomic.Value
	for g := range 32 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range 40 {
				k := fmt.Sprintf("cl%d:{k%d}", g%3, (g*5+i)%30)
				if (g+i)%11 == 0 {
					_, err := eng.Book(ctx, "cl0:{bad}", l1, throttle.Request{N: 1, MaxWait: throttle.Forever})
					if err == nil || !strings.Contains(err.Error(), `"cl0:{bad}"`) {
						failed.Store(fmt.Errorf("corrupt key: %v", err))
						return
					}
					continue
				}
				bs, err := eng.BookAll(ctx, []string{k, k + ":m"}, []throttle.Limit{l1, l2}, []throttle.Request{{N: 1, MaxWait: throttle.Forever}})
				if err != nil {
					failed.Store(fmt.Errorf("%s: %w", k, err))
					return
				}
				mu.Lock()
				slots[k] = append(slots[k], alSlot{at: bs[0].At, n: 1})
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
	if err, _ := failed.Load().(error); err != nil {
		t.Fatal(err)
	}
	for k, s := range slots {
		alReplay(t, k+" l1", l1, s)
		alReplay(t, k+" l2", l2, s)
	}
	n := h.check(t)
	t.Logf("commands kept %d", n)
	require.Empty(t, obs.bad)
}
