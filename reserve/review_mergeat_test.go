package reserve_test

// Review of 9f876c5/356f88e (throttle.WithMergeAt: single bookings merge
// once four are in flight, not only once the pool is full) through
// package reserve's public API. Every test runs more than four callers on
// distinct keys through a client whose pool (20) is larger than the
// callers, with replies delayed by a proxy so that calls overlap: single
// bookings then go out merged (checked by counting Redis calls).
//
// Oracles of their own: the slots that ran are checked against the
// arrival curve of the limit (units with slots in any window of length d
// at most Burst+1+floor(d/I)), which a GCRA-conforming sequence keeps;
// the state a key is left in is checked by a probe booking, whose wait is
// predicted by a virtual-scheduling replay written here.

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"runtime"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/slotbook/slotbook/internal/callcount"
	"github.com/slotbook/slotbook/internal/limitcheck"
	"github.com/slotbook/slotbook/internal/redistest"
	"github.com/slotbook/slotbook/reserve"
	"github.com/slotbook/slotbook/throttle"
)

// rmaEngine is an engine on srv through a proxy, its client's pool 20,
// merging on with WithMergeAt's default, and the proxy and a call counter.
func rmaEngine(t *testing.T, srv *redistest.Server, opts ...throttle.Option) (*throttle.Engine, *redistest.Proxy, *callcount.Counter) {
	t.Helper()
	p := redistest.NewProxy(t, srv.Addr)
	rdb := p.Client(t, srv, func(o *redis.Options) { o.PoolSize = 20 })
	eng, err := throttle.New(rdb, append([]throttle.Option{throttle.WithPrefix(redistest.Prefix(t)), throttle.WithTimeout(5 * time.Second)}, opts...)...)
	require.NoError(t, err)
	redistest.UntilOK(t, func() error { return eng.Load(context.Background()) })
	require.NoError(t, rdb.Ping(context.Background()).Err())
	return eng, p, callcount.Attach(rdb)
}

type rmaSlot struct {
	at int64 // µs, Redis clock
	n  int
}

// rmaArrivalCurve fails t if some window of slots holds more units than
// the limit lets through in it: Burst+1 at once, one more per interval.
func rmaArrivalCurve(t *testing.T, lim throttle.Limit, slots []rmaSlot, what string) {
	t.Helper()
	s := slices.Clone(slots)
	slices.SortFunc(s, func(a, b rmaSlot) int { return int(a.at - b.at) })
	I := limitcheck.Interval(lim)
	for i := range s {
		units := 0
		for j := i; j < len(s); j++ {
			units += s[j].n
			allowed := int64(lim.Burst+1) + (s[j].at-s[i].at)/I
			if int64(units) > allowed {
				t.Fatalf("%s: %d units in [%d, %d] µs (%d µs), the limit %v lets %d through", what, units, s[i].at, s[j].at, s[j].at-s[i].at, lim, allowed)
			}
		}
	}
}

// rmaVS is a virtual-scheduling replay of one key: tat is the theoretical
// arrival time after the bookings replayed (0: none).
type rmaVS struct{ I, tau, tat int64 }

func rmaNewVS(l throttle.Limit) rmaVS {
	I := limitcheck.Interval(l)
	return rmaVS{I: I, tau: int64(l.Burst) * I}
}

// booked replays a booking of n units decided at now.
func (v *rmaVS) booked(now int64, n int) { v.tat = max(v.tat, now) + int64(n)*v.I }

// waitFor is the wait of one unit decided at now.
func (v rmaVS) waitFor(now int64) int64 { return max(0, v.tat-v.tau-now) }

func rmaDecided(b throttle.Booking) int64 { return b.At.UnixMicro() - b.Wait.Microseconds() }

// rmaProbe books one unit of key with no max wait and returns its
// booking; the caller compares its wait with a replay's.
func rmaProbe(t *testing.T, l *reserve.Limiter, key string) throttle.Booking {
	t.Helper()
	p, err := l.With(reserve.WithoutMaxWait())
	require.NoError(t, err)
	r, err := p.Reserve(context.Background(), key)
	require.NoError(t, err)
	require.True(t, r.OK(), "probe of %s: %v", key, r.Err())
	return r.Booking()
}

// rmaGoroutines lists the goroutines running code of packages reserve or
// throttle (not the test's own functions).
func rmaGoroutines() []string {
	buf := make([]byte, 4<<20)
	buf = buf[:runtime.Stack(buf, true)]
	var out []string
	for _, g := range strings.Split(string(buf), "\n\n") {
		if strings.Contains(g, "review_mergeat_test.go") || strings.Contains(g, "TestMain") {
			continue
		}
		if strings.Contains(g, "slotbook/reserve.(") || strings.Contains(g, "slotbook/throttle.(") {
			out = append(out, g)
		}
	}
	return out
}

func rmaNoGoroutinesLeft(t *testing.T) {
	t.Helper()
	var left []string
	for end := time.Now().Add(10 * time.Second); time.Now().Before(end); time.Sleep(20 * time.Millisecond) {
		if left = rmaGoroutines(); len(left) == 0 {
			return
		}
	}
	t.Fatalf("%d goroutines of reserve/throttle left:\n%s", len(left), strings.Join(left, "\n\n"))
}

// TestReviewMergeAtDeadlines: 16 callers, one per key, each reserving in
// turn with a random near deadline (20 to 250 ms) under 40 ms of latency
// each way. A reservation that is OK never has its slot (Redis clock, the
// same host's clock as the deadline) past its deadline; a refusal or an
// error books nothing: a probe at the end of each key waits what a replay
// of that key's OK bookings predicts. The slots pass the limit's
// arrival curve. Calls were merged: fewer calls than bookings sent
// (with throttle.WithMergeWait(Forever): at 80 ms a round trip the
// default wait of 250µs sends most bookings alone, as it should). (Errors are allowed to leave their slot booked: a caller whose context
// ends as an immediate slot's reply comes keeps that slot booked, merged
// or not; see the stop's note.)
func TestReviewMergeAtDeadlines(t *testing.T) {
	t.Parallel()
	eng, p, calls := rmaEngine(t, redistest.Shared(t), throttle.WithMergeWait(throttle.Forever))
	p.SetLatency(40 * time.Millisecond)
	lim := throttle.PerSecond(10, 1) // I = 100 ms
	l, err := reserve.New(eng, "rmadl", lim)
	require.NoError(t, err)

	const keys, rounds = 16, 12
	var (
		mu                       sync.Mutex
		okAt                     = map[string][]throttle.Booking{}
		trail                    = map[string][]string{}
		errUnits                 = map[string]int{}
		sent, oks, refused, errd atomic.Int64
		wg                       sync.WaitGroup
	)
	before := calls.Load()
	errs := make(chan error, keys)
	for k := range keys {
		wg.Go(func() {
			key := fmt.Sprintf("k%d", k)
			rng := rand.New(rand.NewPCG(uint64(k), 11))
			for range rounds {
				d := time.Duration(20+rng.IntN(231)) * time.Millisecond
				ctx, cancel := context.WithTimeout(context.Background(), d)
				dl, _ := ctx.Deadline()
				n := 1 + rng.IntN(2)
				r, err := l.ReserveN(ctx, key, n)
				cancel()
				sent.Add(1)
				switch {
				case err != nil:
					if !errors.Is(err, context.DeadlineExceeded) {
						errs <- fmt.Errorf("%s: %w", key, err)
						return
					}
					errd.Add(1)
					mu.Lock()
					errUnits[key] += n
					trail[key] = append(trail[key], fmt.Sprintf("err after %v (deadline %v)", time.Since(dl.Add(-d)), d))
					mu.Unlock()
				case r.OK():
					oks.Add(1)
					if r.Booking().At.After(dl) {
						errs <- fmt.Errorf("%s: slot %v past the deadline %v by %v", key, r.Booking().At, dl, r.Booking().At.Sub(dl))
						return
					}
					if r.SlotAt().After(dl) {
						errs <- fmt.Errorf("%s: SlotAt %v past the deadline %v", key, r.SlotAt(), dl)
						return
					}
					mu.Lock()
					okAt[key] = append(okAt[key], r.Booking())
					trail[key] = append(trail[key], fmt.Sprintf("ok n=%d wait %v decided %d", r.Booking().N, r.Booking().Wait, rmaDecided(r.Booking())))
					mu.Unlock()
				default:
					refused.Add(1)
					if r.Booking().OK {
						errs <- fmt.Errorf("%s: a refusal %v holds a booking", key, r.Err())
						return
					}
				}
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		require.NoError(t, err)
	}
	used := calls.Load() - before
	t.Logf("%d reservations: %d OK, %d refused, %d ended waiting; %d Redis calls", sent.Load(), oks.Load(), refused.Load(), errd.Load(), used)
	require.Less(t, used, sent.Load(), "no booking was merged: the test did not reach the merged path")
	require.Positive(t, refused.Load()+errd.Load(), "no refusal: the deadlines were not near")

	p.SetLatency(0)
	for k := range keys {
		key := fmt.Sprintf("k%d", k)
		v := rmaNewVS(lim)
		var slots []rmaSlot
		for _, b := range okAt[key] {
			v.booked(rmaDecided(b), b.N)
			slots = append(slots, rmaSlot{b.At.UnixMicro(), b.N})
		}
		rmaArrivalCurve(t, lim, slots, key)
		pb := rmaProbe(t, l, key)
		// A caller whose deadline passed as its reply came in gets the
		// context's error, and its slot, if it has come, stays booked:
		// the probe may wait up to those units more than the replay,
		// never less.
		want := v.waitFor(rmaDecided(pb))
		v.booked(rmaDecided(pb), errUnits[key])
		most := v.waitFor(rmaDecided(pb))
		if got := pb.Wait.Microseconds(); got < want || got > most {
			t.Fatalf("%s: the probe waits %d µs, the replay of its %d OK bookings %d (%d with its %d units that ended in an error): a refusal left a booking, or a give-back gave too much\n%s",
				key, got, len(okAt[key]), want, most, errUnits[key], strings.Join(trail[key], "\n"))
		}
	}
}

// TestReviewMergeAtCancel: per key (16, side by side, one slot every 2 s,
// no burst), a first booking is kept and four more are booked in the
// future, each in a call merged with other keys'; they are cancelled
// latest first, each Cancel called twice at once and once more after,
// while the other keys book. A probe then waits exactly what the kept
// booking alone predicts: every future booking's room came back, and no
// more. On 4 further keys the second booking is cancelled only after its
// slot: nothing is given back (the probe waits as if both stood).
func TestReviewMergeAtCancel(t *testing.T) {
	t.Parallel()
	eng, p, calls := rmaEngine(t, redistest.Shared(t))
	p.SetReplyDelay(30 * time.Millisecond)
	lim := throttle.Every(2*time.Second, 1, 0)
	l, err := reserve.New(eng, "rmacancel", lim, reserve.WithMaxWait(time.Minute))
	require.NoError(t, err)
	// The same quota without coalescing, for half the keys.
	lnc, err := l.With(reserve.WithCoalescing(false))
	require.NoError(t, err)
	ctx := context.Background()

	const keys, future = 16, 4
	kept := make([]throttle.Booking, keys)
	var wg sync.WaitGroup
	errs := make(chan error, 2*keys)
	before := calls.Load()
	for k := range keys {
		wg.Go(func() {
			lk := l
			if k%2 == 1 {
				lk = lnc
			}
			key := fmt.Sprintf("c%d", k)
			r0, err := lk.Reserve(ctx, key)
			if err != nil || !r0.OK() || r0.Booking().Wait != 0 {
				errs <- fmt.Errorf("%s: first booking %v %v", key, r0, err)
				return
			}
			kept[k] = r0.Booking()
			var rs []*reserve.Reservation
			for range future {
				r, err := lk.Reserve(ctx, key)
				if err != nil || !r.OK() {
					errs <- fmt.Errorf("%s: future booking: %v", key, err)
					return
				}
				rs = append(rs, r)
			}
			for i := len(rs) - 1; i >= 0; i-- {
				var cw sync.WaitGroup
				for range 2 {
					cw.Go(func() {
						if err := rs[i].Cancel(ctx); err != nil {
							errs <- fmt.Errorf("%s: cancel %d: %w", key, i, err)
						}
					})
				}
				cw.Wait()
				if err := rs[i].Cancel(ctx); err != nil {
					errs <- fmt.Errorf("%s: cancel %d again: %w", key, i, err)
				}
			}
		})
	}
	// Cancelled after the slot, on keys of their own.
	late := make([][2]throttle.Booking, 4)
	for k := range 4 {
		wg.Go(func() {
			key := fmt.Sprintf("a%d", k)
			r0, err := l.Reserve(ctx, key)
			if err != nil || !r0.OK() {
				errs <- fmt.Errorf("%s: %v", key, err)
				return
			}
			r1, err := l.Reserve(ctx, key)
			if err != nil || !r1.OK() {
				errs <- fmt.Errorf("%s: %v", key, err)
				return
			}
			if err := r1.Wait(ctx); err != nil {
				errs <- err
				return
			}
			time.Sleep(5 * time.Millisecond)
			if err := r1.Cancel(ctx); err != nil {
				errs <- err
			}
			late[k] = [2]throttle.Booking{r0.Booking(), r1.Booking()}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		require.NoError(t, err)
	}
	used := calls.Load() - before
	t.Logf("%d Redis calls for %d bookings and %d cancels", used, keys*(1+future)+8, keys*future*3+4)
	p.SetReplyDelay(0)
	for k := range keys {
		key := fmt.Sprintf("c%d", k)
		v := rmaNewVS(lim)
		v.booked(rmaDecided(kept[k]), 1)
		pb := rmaProbe(t, l, key)
		require.Equal(t, v.waitFor(rmaDecided(pb)), pb.Wait.Microseconds(), "%s: the key is not back to its one kept booking", key)
	}
	for k := range 4 {
		key := fmt.Sprintf("a%d", k)
		v := rmaNewVS(lim)
		v.booked(rmaDecided(late[k][0]), 1)
		v.booked(rmaDecided(late[k][1]), 1)
		pb := rmaProbe(t, l, key)
		require.Equal(t, v.waitFor(rmaDecided(pb)), pb.Wait.Microseconds(), "%s: a Cancel after the slot gave room back", key)
	}
}

// TestReviewMergeAtCancelledWaiting: 24 callers on 24 keys (one slot per
// 2 s, each key's first slot taken beforehand, so that the callers' slots
// lie in the future and can be given back), replies held 150 ms and
// throttle.WithMergeWait(Forever), so that four fly and the rest wait to
// be merged until one lands; their contexts are cancelled at
// random times (0 to 400 ms), before their call is sent, while it flies,
// or after. A caller that gets an error left nothing booked (its probe
// waits what the first booking alone predicts); one that got a
// reservation left exactly it. Coalescing on and off. No goroutine of
// reserve or throttle is left.
//
// Not parallel: it ends by counting goroutines.
func TestReviewMergeAtCancelledWaiting(t *testing.T) {
	eng, p, calls := rmaEngine(t, redistest.Shared(t), throttle.WithMergeWait(throttle.Forever))
	lim := throttle.Every(2*time.Second, 1, 0)
	for _, coalesce := range []bool{true, false} {
		t.Run(fmt.Sprintf("coalescing=%v", coalesce), func(t *testing.T) {
			l, err := reserve.New(eng, fmt.Sprintf("rmawait%v", coalesce), lim, reserve.WithCoalescing(coalesce))
			require.NoError(t, err)
			const n = 24
			pre := make([]throttle.Booking, n)
			for i := range n {
				r, err := l.Reserve(context.Background(), fmt.Sprintf("w%d", i))
				require.NoError(t, err)
				require.True(t, r.OK())
				pre[i] = r.Booking()
			}
			p.SetReplyDelay(150 * time.Millisecond)
			type out struct {
				r   *reserve.Reservation
				err error
			}
			outs := make([]out, n)
			before := calls.Load()
			var wg sync.WaitGroup
			for i := range n {
				wg.Go(func() {
					ctx, cancel := context.WithCancel(context.Background())
					defer cancel()
					rng := rand.New(rand.NewPCG(uint64(i), 3))
					if i%3 != 0 { // a third are never cancelled
						time.AfterFunc(time.Duration(rng.IntN(400))*time.Millisecond, cancel)
					}
					r, err := l.Reserve(ctx, fmt.Sprintf("w%d", i))
					outs[i] = out{r, err}
				})
			}
			wg.Wait()
			used := calls.Load() - before
			p.SetReplyDelay(0)
			var cancelled, booked int
			for i, o := range outs {
				key := fmt.Sprintf("w%d", i)
				v := rmaNewVS(lim)
				v.booked(rmaDecided(pre[i]), 1)
				switch {
				case o.err != nil:
					require.ErrorIs(t, o.err, context.Canceled, key)
					cancelled++
				case o.r.OK():
					booked++
					v.booked(rmaDecided(o.r.Booking()), 1)
				default:
					t.Fatalf("%s: refused with no max wait: %v", key, o.r.Err())
				}
				// A give-back by the caller's finish is bounded by a second,
				// and done before Reserve returns: the key is settled now.
				pb := rmaProbe(t, l, key)
				require.Equal(t, v.waitFor(rmaDecided(pb)), pb.Wait.Microseconds(), "%s (err %v): a booking stayed for a caller who did not get it, or one got was lost", key, o.err)
			}
			t.Logf("%d callers: %d got an error, %d a reservation; %d Redis calls", n, cancelled, booked, used)
			require.Less(t, used, int64(n), "nothing merged")
			require.Positive(t, cancelled, "no caller was cancelled in time")
		})
	}
	rmaNoGoroutinesLeft(t)
}

// TestReviewMergeAtMixedLatency: 40 ms each way; 16 workers for 1.5 s mix
// Reserve (max wait 150 ms) on 12 keys of a single-limit Limiter (half of
// them cancelled at once), Allow on the same keys, and Reserve on 6 keys
// of a Limiter with two limits (not merged: its bookings are calls of
// their own) beside them. The slots that stood pass each limit's arrival
// curve, on the Redis clock; the layered Limiter books and refuses too.
// With throttle.WithMergeWait(Forever), so that bookings merge at this
// latency (the default wait sends most of them alone).
func TestReviewMergeAtMixedLatency(t *testing.T) {
	t.Parallel()
	eng, p, calls := rmaEngine(t, redistest.Shared(t), throttle.WithMergeWait(throttle.Forever))
	p.SetLatency(40 * time.Millisecond)
	one := throttle.PerSecond(10, 2)
	a, err := reserve.New(eng, "rmamixa", one, reserve.WithMaxWait(150*time.Millisecond))
	require.NoError(t, err)
	first, second := throttle.PerSecond(10, 1), throttle.Every(2*time.Second, 8, 2)
	b, err := reserve.New(eng, "rmamixb", first, reserve.WithLimit(second), reserve.WithMaxWait(150*time.Millisecond))
	require.NoError(t, err)
	ctx := context.Background()

	var (
		mu                          sync.Mutex
		slotsA                      = map[string][]rmaSlot{}
		slotsB                      = map[string][]rmaSlot{}
		nA, nB, nAllow, nCancel, nR atomic.Int64
		wg                          sync.WaitGroup
	)
	stop := time.Now().Add(1500 * time.Millisecond)
	before := calls.Load()
	errs := make(chan error, 16)
	for w := range 16 {
		wg.Go(func() {
			rng := rand.New(rand.NewPCG(uint64(w), 5))
			for time.Now().Before(stop) {
				switch op := rng.IntN(10); {
				case op < 6:
					key := fmt.Sprintf("m%d", rng.IntN(12))
					r, err := a.ReserveN(ctx, key, 1+rng.IntN(2))
					if err != nil {
						errs <- err
						return
					}
					if !r.OK() {
						nR.Add(1)
						continue
					}
					nA.Add(1)
					if rng.IntN(2) == 0 {
						if err := r.Cancel(ctx); err != nil {
							errs <- err
							return
						}
						nCancel.Add(1)
						continue // given back, or standing: a subset of what stood
					}
					mu.Lock()
					slotsA[key] = append(slotsA[key], rmaSlot{r.Booking().At.UnixMicro(), r.Booking().N})
					mu.Unlock()
				case op < 8:
					if _, err := a.Allow(ctx, fmt.Sprintf("m%d", rng.IntN(12))); err != nil {
						errs <- err
						return
					}
					nAllow.Add(1)
				default:
					key := fmt.Sprintf("l%d", rng.IntN(6))
					r, err := b.Reserve(ctx, key)
					if err != nil {
						errs <- err
						return
					}
					if !r.OK() {
						nR.Add(1)
						continue
					}
					nB.Add(1)
					mu.Lock()
					slotsB[key] = append(slotsB[key], rmaSlot{r.Booking().At.UnixMicro(), r.Booking().N})
					mu.Unlock()
				}
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		require.NoError(t, err)
	}
	used := calls.Load() - before
	t.Logf("single-limit bookings %d (%d cancelled), layered %d, Allow %d, refused %d; %d Redis calls", nA.Load(), nCancel.Load(), nB.Load(), nAllow.Load(), nR.Load(), used)
	require.Less(t, used, nA.Load()+nB.Load()+nAllow.Load()+nCancel.Load(), "nothing merged")
	require.Positive(t, nB.Load())
	require.Positive(t, nR.Load(), "nothing refused: the limits were not reached")
	for key, s := range slotsA {
		rmaArrivalCurve(t, one, s, "single "+key)
	}
	for key, s := range slotsB {
		rmaArrivalCurve(t, first, s, "layered first "+key)
		rmaArrivalCurve(t, second, s, "layered second "+key)
	}
}

// TestReviewMergeAtRedisKilled: a server of the test's own is killed while
// 16 callers on 16 keys book through merged calls (replies held 60 ms),
// under FailOpen and LocalShare. Every answer comes within a bound (no
// hang): Redis's, the fallback's, or ErrUnavailable. Once the server is
// back, Redis answers again. No goroutine of reserve or throttle is left.
//
// Not parallel: it ends by counting goroutines.
func TestReviewMergeAtRedisKilled(t *testing.T) {
	srv := redistest.Start(t)
	srv.RequireReal(t)
	eng, p, _ := rmaEngine(t, srv, throttle.WithTimeout(300*time.Millisecond),
		throttle.WithProbeBackoff(5*time.Millisecond, 50*time.Millisecond))
	p.SetReplyDelay(60 * time.Millisecond)
	lim := throttle.PerSecond(50, 4)
	open, err := reserve.New(eng, "rmakillopen", lim, reserve.WithFallback(reserve.FailOpen()), reserve.WithMaxWait(time.Second))
	require.NoError(t, err)
	share, err := reserve.New(eng, "rmakillshare", lim, reserve.WithFallback(reserve.LocalShare(50*time.Millisecond, 2, 100)), reserve.WithMaxWait(time.Second))
	require.NoError(t, err)

	var epoch atomic.Int64 // 0 up, 1 killed, 2 restarted
	var fromRedis, fromFallback, unavailable [3]atomic.Int64
	var slowest atomic.Int64
	stop := make(chan struct{})
	errs := make(chan error, 16)
	var wg sync.WaitGroup
	for w := range 16 {
		wg.Go(func() {
			l := open
			if w%2 == 1 {
				l = share
			}
			key := fmt.Sprintf("x%d", w)
			for {
				select {
				case <-stop:
					return
				default:
				}
				began := time.Now()
				ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
				r, err := l.Reserve(ctx, key)
				cancel()
				took := time.Since(began)
				for {
					s := slowest.Load()
					if int64(took) <= s || slowest.CompareAndSwap(s, int64(took)) {
						break
					}
				}
				e := epoch.Load()
				switch {
				case err != nil:
					if !errors.Is(err, throttle.ErrUnavailable) {
						errs <- fmt.Errorf("%s: %w", key, err)
						return
					}
					unavailable[e].Add(1)
				case r.Fallback():
					fromFallback[e].Add(1)
					_ = r.Cancel(context.Background())
				default:
					fromRedis[e].Add(1)
					_ = r.Cancel(context.Background())
				}
				time.Sleep(time.Duration(w) * time.Millisecond)
			}
		})
	}
	time.Sleep(400 * time.Millisecond)
	epoch.Store(1)
	require.NoError(t, syscall.Kill(srv.Pid(), syscall.SIGKILL))
	require.Eventually(t, func() bool {
		c, err := net.DialTimeout("tcp", srv.Addr, time.Second)
		if err == nil {
			c.Close()
		}
		return err != nil
	}, 10*time.Second, time.Millisecond)
	time.Sleep(800 * time.Millisecond)
	srv.Restart(t)
	epoch.Store(2)
	require.Eventually(t, func() bool { return fromRedis[2].Load() > 16 }, 15*time.Second, 10*time.Millisecond, "Redis answers did not resume")
	close(stop)
	wg.Wait()
	close(errs)
	for err := range errs {
		require.NoError(t, err)
	}
	t.Logf("Redis %d/%d/%d, fallback %d/%d/%d, unavailable %d/%d/%d (up/killed/back); slowest answer %v",
		fromRedis[0].Load(), fromRedis[1].Load(), fromRedis[2].Load(),
		fromFallback[0].Load(), fromFallback[1].Load(), fromFallback[2].Load(),
		unavailable[0].Load(), unavailable[1].Load(), unavailable[2].Load(), time.Duration(slowest.Load()))
	require.Positive(t, fromRedis[0].Load())
	require.Positive(t, fromFallback[1].Load(), "the fallbacks answered nothing while Redis was down")
	// An answer takes at most the engine's timeout (on a probe, a few of
	// them) past its wait for a merged call: far under the callers' 3 s.
	require.Less(t, time.Duration(slowest.Load()), 3*time.Second, "a caller waited out its whole context")
	rmaNoGoroutinesLeft(t)
}
