package reserve_test

// Adversarial review of a78c117 ("reserve: one map of per-key coalescing
// state"): the Limiter's keyStates, reused from a bounded free list once a
// key has no callers. Every test here drives the public API only (plus the
// package's test hooks SetSoloBelow, QueueLen and KeyStates) and checks,
// after each scenario: every call returned (bounded against a control
// measured in the same run), no key holds coalescing state, no goroutine is
// left behind, and the slots that stand obey a textbook GCRA of our own.

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"runtime"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/slotbook/slotbook/internal/redistest"
	"github.com/slotbook/slotbook/reserve"
	"github.com/slotbook/slotbook/throttle"
)

// ---------------------------------------------------------------------------
// The ledger: every booking handed to a caller that stands (not given back
// by a Cancel that returned nil), replayed through a textbook GCRA.

type ksCell struct {
	at        int64 // µs on the Redis clock
	n         int
	cancelled bool
}

type ksLedger struct {
	mu    sync.Mutex
	cells map[string][]*ksCell
}

func newKSLedger() *ksLedger { return &ksLedger{cells: map[string][]*ksCell{}} }

// add records r's booking for key if it holds one (booked, or a late
// refusal held for the caller), and returns its cell (nil if none).
func (lg *ksLedger) add(key string, r *reserve.Reservation) *ksCell {
	if r == nil {
		return nil
	}
	b := r.Booking()
	if !b.OK {
		return nil
	}
	c := &ksCell{at: b.At.UnixMicro(), n: b.N}
	lg.mu.Lock()
	lg.cells[key] = append(lg.cells[key], c)
	lg.mu.Unlock()
	return c
}

func (lg *ksLedger) cancelled(c *ksCell) {
	lg.mu.Lock()
	c.cancelled = true
	lg.mu.Unlock()
}

func (lg *ksLedger) count() (n int) {
	lg.mu.Lock()
	defer lg.mu.Unlock()
	for _, cs := range lg.cells {
		for _, c := range cs {
			if !c.cancelled {
				n++
			}
		}
	}
	return n
}

// check replays, per key, the standing bookings in slot order through the
// virtual-scheduling GCRA (ITU-T I.371): emission interval T = Period/Rate,
// tolerance tau = Burst*T; a request of n units at t conforms iff
// t >= max(TAT, t) + (n-1)*T - tau, and then TAT = max(TAT, t) + n*T.
func (lg *ksLedger) check(t *testing.T, lim throttle.Limit) {
	t.Helper()
	T := lim.Period.Microseconds() / int64(lim.Rate)
	require.Equal(t, lim.Period.Microseconds(), T*int64(lim.Rate), "pick a limit whose interval is whole µs")
	tau := int64(lim.Burst) * T
	lg.mu.Lock()
	defer lg.mu.Unlock()
	bad := 0
	for key, cs := range lg.cells {
		var stand []*ksCell
		for _, c := range cs {
			if !c.cancelled {
				stand = append(stand, c)
			}
		}
		sort.SliceStable(stand, func(i, j int) bool { return stand[i].at < stand[j].at })
		var tat int64
		for i, c := range stand {
			if i == 0 {
				tat = c.at
			}
			need := max(tat, c.at) + int64(c.n-1)*T - tau
			if c.at < need {
				bad++
				if bad <= 10 {
					t.Errorf("GCRA: key %q: slot %d of %d (n=%d) at %d µs came %d µs early (TAT %d)",
						key, i, len(stand), c.n, c.at, need-c.at, tat)
				}
			}
			tat = max(tat, c.at) + int64(c.n)*T
		}
	}
	if bad > 0 {
		t.Errorf("GCRA: %d slots early in all", bad)
	}
}

// ---------------------------------------------------------------------------
// Redis hooks: latency on the scripts, and a gate that holds them.

type ksHook struct {
	latency atomic.Int64 // ns added before each script call
	jitter  atomic.Int64 // up to this many ns more, at random
	gated   atomic.Bool
	mu      sync.Mutex
	release chan struct{}
	entered atomic.Int64
}

func newKSHook(rdb *redis.Client) *ksHook {
	h := &ksHook{release: make(chan struct{})}
	rdb.AddHook(h)
	return h
}

func (h *ksHook) DialHook(next redis.DialHook) redis.DialHook { return next }
func (h *ksHook) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}
func (h *ksHook) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		if n := cmd.Name(); n == "evalsha" || n == "eval" {
			d := time.Duration(h.latency.Load())
			if j := h.jitter.Load(); j > 0 {
				d += time.Duration(rand.Int64N(j))
			}
			if d > 0 {
				time.Sleep(d)
			}
			if h.gated.Load() {
				h.mu.Lock()
				rel := h.release
				h.mu.Unlock()
				h.entered.Add(1)
				<-rel
			}
		}
		return next(ctx, cmd)
	}
}

// open releases every held call and stops holding.
func (h *ksHook) open() {
	h.gated.Store(false)
	h.mu.Lock()
	close(h.release)
	h.release = make(chan struct{})
	h.mu.Unlock()
}

// ---------------------------------------------------------------------------
// Checks run after every scenario.

// ksWait waits for wg, failing (with the stacks of the reserve package's
// goroutines) if it takes longer than bound.
func ksWait(t *testing.T, wg *sync.WaitGroup, bound time.Duration, what string) bool {
	t.Helper()
	done := make(chan struct{})
	go func() { wg.Wait(); close(done) }()
	select {
	case <-done:
		return true
	case <-time.After(bound):
		t.Errorf("%s: calls still running after %v: stalled\n%s", what, bound, ksStacks())
		return false
	}
}

func ksStacks() string {
	buf := make([]byte, 1<<20)
	buf = buf[:runtime.Stack(buf, true)]
	var out []string
	for _, g := range strings.Split(string(buf), "\n\n") {
		if strings.Contains(g, "slotbook/reserve.(") {
			out = append(out, g)
		}
	}
	if len(out) > 6 {
		out = append(out[:6], fmt.Sprintf("... and %d more", len(out)-6))
	}
	return strings.Join(out, "\n\n")
}

// ksNoState requires that none of ls holds coalescing state for any key,
// and that their free lists stay bounded.
func ksNoState(t *testing.T, ls ...*reserve.Limiter) {
	t.Helper()
	for i, l := range ls {
		live, spare := reserve.KeyStates(l)
		require.Zero(t, live, "limiter %d: keys holding coalescing state with no caller left", i)
		require.LessOrEqual(t, spare, 256, "limiter %d: spare states", i)
	}
}

// ksNoLeak requires that no goroutine is left behind beyond those running
// when the test began (a few seconds allowed for give-backs in flight).
func ksNoLeak(t *testing.T, base goleak.Option) {
	t.Helper()
	var err error
	for i := 0; i < 10; i++ {
		if err = goleak.Find(base, goleak.IgnoreAnyFunction("os/exec.(*Cmd).Wait")); err == nil {
			return
		}
		time.Sleep(100 * time.Millisecond)
	}
	t.Errorf("goroutines left behind: %v", err)
}

// ksControl measures, in this run, how long 50 sequential reservations take
// on l (a fresh key): the yardstick of "every call returns in bounded time".
func ksControl(t *testing.T, l *reserve.Limiter) time.Duration {
	t.Helper()
	start := time.Now()
	for i := 0; i < 50; i++ {
		_, err := l.Reserve(context.Background(), "control")
		require.NoError(t, err)
	}
	return time.Since(start)
}

// ---------------------------------------------------------------------------
// The random caller.

type ksStats struct {
	booked, refused, ended, errs, panics, cancelled atomic.Int64
}

func (s *ksStats) String() string {
	return fmt.Sprintf("booked %d (cancelled after %d), refused %d, ended %d, errors %d, panics %d",
		s.booked.Load(), s.cancelled.Load(), s.refused.Load(), s.ended.Load(), s.errs.Load(), s.panics.Load())
}

// ksOne makes one call of a random kind on one of ls for key, under a
// context ended at a random point (before sending, while queued, in flight,
// as leadership is handed on) or carrying a deadline that gets some slots
// refused, and records what stands.
func ksOne(rng *rand.Rand, ls []*reserve.Limiter, key string, lg *ksLedger, st *ksStats) {
	l := ls[rng.IntN(len(ls))]
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	switch rng.IntN(8) {
	case 0: // cancelled before sending
		cancel()
	case 1: // ended at some point while queued or in flight
		var c2 context.CancelFunc
		ctx, c2 = context.WithTimeout(ctx, time.Duration(rng.IntN(3000))*time.Microsecond)
		defer c2()
	case 2: // cancelled from outside at a random instant
		d := time.Duration(rng.IntN(2000)) * time.Microsecond
		go func() { time.Sleep(d); cancel() }()
	case 3: // a deadline that gets some slots refused
		var c2 context.CancelFunc
		ctx, c2 = context.WithTimeout(ctx, time.Duration(1000+rng.IntN(6000))*time.Microsecond)
		defer c2()
	}
	defer func() {
		if p := recover(); p != nil {
			st.panics.Add(1)
		}
	}()
	var rs []*reserve.Reservation
	var err error
	switch k := rng.IntN(12); {
	case k < 6:
		var r *reserve.Reservation
		r, err = l.ReserveN(ctx, key, 1)
		rs = []*reserve.Reservation{r}
	case k == 6:
		var r *reserve.Reservation
		r, err = l.ReserveN(ctx, key, 2)
		rs = []*reserve.Reservation{r}
	case k == 7:
		var r *reserve.Reservation
		r, err = l.ReserveWithin(ctx, key, 1, time.Duration(rng.IntN(8))*time.Millisecond)
		rs = []*reserve.Reservation{r}
	case k == 8:
		reqs := make([]reserve.BatchRequest, 1+rng.IntN(3))
		for i := range reqs {
			reqs[i] = reserve.BatchRequest{N: 1, HoldLate: rng.IntN(2) == 0}
			if rng.IntN(3) == 0 {
				c, cc := context.WithTimeout(ctx, time.Duration(rng.IntN(3000))*time.Microsecond)
				defer cc()
				reqs[i].Context = c
			}
		}
		rs, err = l.ReserveBatch(ctx, key, reqs)
	case k == 9:
		// Acquire: its booking is not seen (a lenient ledger), but it
		// coalesces and waits like any caller.
		actx, ac := context.WithTimeout(ctx, 30*time.Millisecond)
		defer ac()
		err = l.Acquire(actx, key)
		if err == nil {
			st.booked.Add(1)
		} else {
			st.refused.Add(1)
		}
		return
	default:
		// A View of the base's quota as a caller: reserve and act at once.
		var r *reserve.Reservation
		r, err = l.Reserve(ctx, key)
		rs = []*reserve.Reservation{r}
	}
	if err != nil {
		if errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) {
			st.ended.Add(1)
		} else {
			st.errs.Add(1)
		}
		return
	}
	for _, r := range rs {
		c := lg.add(key, r)
		if r.OK() {
			st.booked.Add(1)
		} else {
			st.refused.Add(1)
		}
		if c != nil && rng.IntN(4) == 0 {
			cctx, cc := context.WithTimeout(context.Background(), 2*time.Second)
			if r.Cancel(cctx) == nil {
				lg.cancelled(c)
				st.cancelled.Add(1)
			}
			cc()
		}
	}
}

// ksDrive runs goroutines callers each making each calls of ksOne on
// keyOf(g, i), and waits for them within bound.
func ksDrive(t *testing.T, ls []*reserve.Limiter, goroutines, each int, keyOf func(g, i int) string,
	lg *ksLedger, st *ksStats, bound time.Duration, seed uint64) bool {
	t.Helper()
	var wg sync.WaitGroup
	for g := 0; g < goroutines; g++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rng := rand.New(rand.NewPCG(seed, uint64(g)))
			for i := 0; i < each; i++ {
				ksOne(rng, ls, keyOf(g, i), lg, st)
			}
		}()
	}
	return ksWait(t, &wg, bound, "drive")
}

// ksLimiters returns a base limiter on eng and two views of it made by With
// (other max waits, same quota), all with soloBelow set.
func ksLimiters(t *testing.T, eng *throttle.Engine, lim throttle.Limit, solo int) []*reserve.Limiter {
	t.Helper()
	base, err := reserve.New(eng, "api", lim, reserve.WithMaxWait(20*time.Millisecond))
	require.NoError(t, err)
	v1, err := base.With(reserve.WithMaxWait(3 * time.Millisecond))
	require.NoError(t, err)
	v2, err := base.With(reserve.WithMaxWait(60 * time.Millisecond))
	require.NoError(t, err)
	ls := []*reserve.Limiter{base, v1, v2}
	if solo > 0 {
		for _, l := range ls {
			reserve.SetSoloBelow(l, solo)
		}
	}
	return ls
}

// ---------------------------------------------------------------------------
// Tests.

// TestReviewKSStress: many goroutines on few keys and on many keys (more at
// once than the 256 spare states), through a base limiter and two views,
// callers ended at every point, some slots refused by deadlines, a jittered
// Redis latency; afterwards no key holds state, nothing leaked, and the
// standing slots obey GCRA.
func TestReviewKSStress(t *testing.T) {
	lim := throttle.PerSecond(2000, 4) // T = 500 µs
	cases := []struct {
		name  string
		solo  int // 0: the default
		keyOf func(g, i int) string
	}{
		{"few keys, queue behind any call", 1, func(g, i int) string { return "few" + strconv.Itoa((g+i)%3) }},
		{"few keys, default", 0, func(g, i int) string { return "few" + strconv.Itoa((g+i)%3) }},
		{"many keys, queue behind any call", 1, func(g, i int) string {
			if i%3 == 0 {
				return "hot" + strconv.Itoa(g%4)
			}
			return "wide" + strconv.Itoa((g*7+i*13)%700)
		}},
	}
	for ci, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			e := newEnv(t)
			base := goleak.IgnoreCurrent()
			h := newKSHook(e.rdb)
			require.NoError(t, e.eng.Load(context.Background()))
			ls := ksLimiters(t, e.eng, lim, tc.solo)
			control := ksControl(t, ls[0])
			h.latency.Store(int64(100 * time.Microsecond))
			h.jitter.Store(int64(1500 * time.Microsecond))
			lg, st := newKSLedger(), &ksStats{}
			bound := 20*time.Second + 400*control
			before := e.calls.Load()
			ok := ksDrive(t, ls, 64, 40, tc.keyOf, lg, st, bound, uint64(ci))
			t.Logf("control %v; %s; %d Redis calls for 2560 callers; %d slots standing",
				control, st, e.calls.Load()-before, lg.count())
			if !ok {
				return
			}
			require.Zero(t, st.errs.Load())
			require.Zero(t, st.panics.Load())
			require.Positive(t, st.ended.Load())
			require.Positive(t, st.refused.Load())
			ksNoState(t, ls...)
			lg.check(t, lim)
			ksNoLeak(t, base)
		})
	}
}

// TestReviewKSWide: 300 keys with callers at once (more than a Limiter
// keeps spare states), each with a call held in flight and callers queued
// behind it, half of them ended while queued; then a second wave on other
// keys reusing the states.
func TestReviewKSWide(t *testing.T) {
	e := newEnv(t)
	base := goleak.IgnoreCurrent()
	h := newKSHook(e.rdb)
	lim := throttle.PerSecond(1000, 2)
	l, err := reserve.New(e.eng, "api", lim)
	require.NoError(t, err)
	reserve.SetSoloBelow(l, 1)
	require.NoError(t, e.eng.Load(context.Background()))
	control := ksControl(t, l)
	lg, st := newKSLedger(), &ksStats{}

	for wave := 0; wave < 2; wave++ {
		const keys = 300
		h.gated.Store(true)
		h.entered.Store(0)
		var wg sync.WaitGroup
		var cancels []context.CancelFunc
		var mu sync.Mutex
		reserveOn := func(key string, ctx context.Context) {
			defer wg.Done()
			r, err := l.Reserve(ctx, key)
			switch {
			case err != nil:
				st.ended.Add(1)
			case r.OK():
				st.booked.Add(1)
				lg.add(key, r)
			default:
				st.refused.Add(1)
			}
		}
		for k := 0; k < keys; k++ {
			wg.Add(1)
			go reserveOn(fmt.Sprintf("w%d-%d", wave, k), context.Background())
		}
		// Every key's first call held in flight (merged by the engine or not).
		require.Eventually(t, func() bool { live, _ := reserve.KeyStates(l); return live == keys }, 30*time.Second, time.Millisecond,
			"every key with a caller at once")
		require.Positive(t, h.entered.Load())
		// Three queued behind each of the first 40 keys.
		for k := 0; k < 40; k++ {
			for q := 0; q < 3; q++ {
				ctx, cancel := context.WithCancel(context.Background())
				mu.Lock()
				cancels = append(cancels, cancel)
				mu.Unlock()
				wg.Add(1)
				go reserveOn(fmt.Sprintf("w%d-%d", wave, k), ctx)
			}
		}
		require.Eventually(t, func() bool {
			for k := 0; k < 40; k++ {
				if reserve.QueueLen(l, fmt.Sprintf("w%d-%d", wave, k)) != 3 {
					return false
				}
			}
			return true
		}, 30*time.Second, time.Millisecond)
		for i, c := range cancels {
			if i%2 == 0 {
				c() // ended while queued
			}
		}
		h.open()
		ok := ksWait(t, &wg, 20*time.Second+400*control, fmt.Sprintf("wave %d", wave))
		for _, c := range cancels {
			c()
		}
		if !ok {
			return
		}
		live, spare := reserve.KeyStates(l)
		require.Zero(t, live)
		require.Equal(t, 256, spare, "the free list fills to its bound")
	}
	t.Logf("control %v; %s", control, st)
	lg.check(t, lim)
	ksNoLeak(t, base)
}

// TestReviewKSHandover: a call held in flight with callers queued behind
// it; the call is released while the queued callers are cancelled at
// random instants around it, so that some are cancelled just as they are
// named leader, some as their batch is taken. Every call returns, the key
// holds no state, and the next callers of the key coalesce as before.
func TestReviewKSHandover(t *testing.T) {
	e := newEnv(t)
	base := goleak.IgnoreCurrent()
	g := newAfterGate(e.rdb) // the first call is booked, its reply held
	lim := throttle.PerSecond(2000, 50)
	l, err := reserve.New(e.eng, "api", lim)
	require.NoError(t, err)
	reserve.SetSoloBelow(l, 1)
	require.NoError(t, e.eng.Load(context.Background()))
	control := ksControl(t, l)
	lg, st := newKSLedger(), &ksStats{}
	rng := rand.New(rand.NewPCG(7, 7))
	for it := 0; it < 150; it++ {
		key := "h" + strconv.Itoa(it%5)
		var wg sync.WaitGroup
		one := func(ctx context.Context) {
			defer wg.Done()
			r, err := l.Reserve(ctx, key)
			switch {
			case err != nil:
				st.ended.Add(1)
			case r.OK():
				st.booked.Add(1)
				lg.add(key, r)
			default:
				st.refused.Add(1)
			}
		}
		g.armed.Store(true)
		wg.Add(1)
		go one(context.Background())
		<-g.entered
		g.armed.Store(false)
		const queued = 4
		cancels := make([]context.CancelFunc, queued)
		for q := 0; q < queued; q++ {
			ctx, cancel := context.WithCancel(context.Background())
			cancels[q] = cancel
			wg.Add(1)
			go one(ctx)
		}
		require.Eventually(t, func() bool { return reserve.QueueLen(l, key) == queued }, 10*time.Second, 50*time.Microsecond)
		var cw sync.WaitGroup
		for q := 0; q < queued; q++ {
			if rng.IntN(4) == 0 {
				continue // this one stays
			}
			d := time.Duration(rng.IntN(400)) * time.Microsecond
			cw.Add(1)
			go func() { defer cw.Done(); time.Sleep(d); cancels[q]() }()
		}
		g.release <- struct{}{}
		ok := ksWait(t, &wg, 10*time.Second+100*control, "iteration "+strconv.Itoa(it))
		cw.Wait()
		for _, c := range cancels {
			c()
		}
		if !ok {
			return
		}
		ksNoState(t, l)
	}
	t.Logf("control %v; %s", control, st)
	lg.check(t, lim)
	ksNoLeak(t, base)
}

// ksPanicky panics, once armed, on a random share of its decisions.
type ksPanicky struct {
	armed atomic.Bool
	every int64
	n     atomic.Int64
}

func (o *ksPanicky) ObserveDecision(string, throttle.Outcome, time.Duration) {
	if o.armed.Load() && o.n.Add(1)%o.every == 0 {
		panic("observer bug")
	}
}
func (o *ksPanicky) ObserveCall(string, time.Duration, error) {}
func (o *ksPanicky) ObserveRefund(string, time.Duration)      {}
func (o *ksPanicky) ObserveBreaker(bool)                      {}

// TestReviewKSObserverPanics: an Observer that panics on some decisions
// while many callers, on few and many keys, coalesce; then more traffic on
// the same and other keys with the Observer quiet. No stall, no state left,
// no leak, and the limit held.
func TestReviewKSObserverPanics(t *testing.T) {
	e := newEnv(t)
	base := goleak.IgnoreCurrent()
	h := newKSHook(e.rdb)
	obs := &ksPanicky{every: 7}
	eng, err := throttle.New(e.rdb, throttle.WithPrefix(e.prefix), throttle.WithTimeout(5*time.Second), throttle.WithObserver(obs))
	require.NoError(t, err)
	require.NoError(t, eng.Load(context.Background()))
	lim := throttle.PerSecond(2000, 4)
	ls := ksLimiters(t, eng, lim, 1)
	control := ksControl(t, ls[0])
	h.jitter.Store(int64(time.Millisecond))
	lg, st := newKSLedger(), &ksStats{}
	keyOf := func(g, i int) string {
		if i%2 == 0 {
			return "p" + strconv.Itoa(g%3)
		}
		return "q" + strconv.Itoa((g*31+i)%400)
	}
	bound := 20*time.Second + 400*control
	obs.armed.Store(true)
	if !ksDrive(t, ls, 48, 30, keyOf, lg, st, bound, 11) {
		return
	}
	obs.armed.Store(false)
	t.Logf("with panics: %s", st)
	require.Positive(t, st.panics.Load())
	ksNoState(t, ls...)
	st2 := &ksStats{}
	if !ksDrive(t, ls, 48, 20, keyOf, lg, st2, bound, 12) {
		return
	}
	t.Logf("after: %s", st2)
	require.Zero(t, st2.panics.Load())
	require.Zero(t, st2.errs.Load())
	ksNoState(t, ls...)
	lg.check(t, lim)
	ksNoLeak(t, base)
}

// TestReviewKSSlowRedis: callers queued behind calls slowed by 40 ms, some
// ended while queued or in flight; then Redis paused past the engine's
// timeout, and then stopped and restarted, while callers are queued. Every
// call returns, no key holds state, and once Redis is back the keys serve.
func TestReviewKSSlowRedis(t *testing.T) {
	srv := redistest.Start(t)
	base := goleak.IgnoreCurrent()
	rdb := srv.Client(t)
	admin := srv.Client(t)
	h := newKSHook(rdb)
	eng, err := throttle.New(rdb, throttle.WithPrefix(redistest.Prefix(t)), throttle.WithTimeout(300*time.Millisecond))
	require.NoError(t, err)
	require.NoError(t, eng.Load(context.Background()))
	lim := throttle.PerSecond(2000, 4)
	ls := ksLimiters(t, eng, lim, 1)
	control := ksControl(t, ls[0])
	bound := 30*time.Second + 400*control
	lg := newKSLedger()
	keyOf := func(g, i int) string {
		if i%2 == 0 {
			return "s" + strconv.Itoa(g%3)
		}
		return "t" + strconv.Itoa((g*17+i)%300)
	}

	// Slowed: 40 ms before every script call.
	h.latency.Store(int64(40 * time.Millisecond))
	st := &ksStats{}
	if !ksDrive(t, ls, 48, 6, keyOf, lg, st, bound, 21) {
		return
	}
	t.Logf("slowed: %s", st)
	require.Zero(t, st.panics.Load())
	ksNoState(t, ls...)
	h.latency.Store(0)

	// Paused past the engine's timeout while callers queue.
	for round, away := range []string{"pause", "stop"} {
		var wg sync.WaitGroup
		var errsSeen atomic.Int64
		st := &ksStats{}
		switch away {
		case "pause":
			require.NoError(t, admin.Do(context.Background(), "CLIENT", "PAUSE", 1500, "ALL").Err())
		case "stop":
			srv.Stop()
		}
		for g := 0; g < 48; g++ {
			wg.Add(1)
			go func() {
				defer wg.Done()
				rng := rand.New(rand.NewPCG(uint64(31+round), uint64(g)))
				for i := 0; i < 3; i++ {
					ksOne(rng, ls, keyOf(g, i), lg, st)
				}
			}()
		}
		time.Sleep(100 * time.Millisecond)
		ok := ksWait(t, &wg, bound, away)
		errsSeen.Add(st.errs.Load())
		t.Logf("%s: %s", away, st)
		if !ok {
			return
		}
		require.Positive(t, errsSeen.Load(), "Redis away: some calls failed")
		ksNoState(t, ls...)
		if away == "stop" {
			srv.Restart(t)
		}
		// Back: every key serves again (the engine may take a moment).
		require.Eventually(t, func() bool {
			r, err := ls[0].Reserve(context.Background(), keyOf(0, 0))
			return err == nil && lg.add(keyOf(0, 0), r) != nil
		}, 20*time.Second, 50*time.Millisecond)
		st2 := &ksStats{}
		if !ksDrive(t, ls, 32, 10, keyOf, lg, st2, bound, uint64(41+round)) {
			return
		}
		t.Logf("after %s: %s", away, st2)
		ksNoState(t, ls...)
	}
	lg.check(t, lim)
	ksNoLeak(t, base)
}

// ---------------------------------------------------------------------------
// Targeted side paths.

// ksRefundPanicky panics on the first refund it observes once armed.
type ksRefundPanicky struct{ armed atomic.Bool }

func (o *ksRefundPanicky) ObserveDecision(string, throttle.Outcome, time.Duration) {}
func (o *ksRefundPanicky) ObserveCall(string, time.Duration, error)                {}
func (o *ksRefundPanicky) ObserveRefund(string, time.Duration) {
	if o.armed.CompareAndSwap(true, false) {
		panic("observer bug in refund")
	}
}
func (o *ksRefundPanicky) ObserveBreaker(bool) {}

// TestReviewKSRefundObserverPanic: a caller queued behind a call in flight
// is named leader and sends alone; the reply arrives after its deadline, so
// its booking is refused late and given back at once (RefundUnused), and
// the Observer panics on that refund. The panic should go up the caller's
// stack, as a panic in booking does, and leave the key usable; it must not
// hang the caller.
func TestReviewKSRefundObserverPanic(t *testing.T) {
	e := newEnv(t)
	obs := &ksRefundPanicky{}
	l := ksObserved(t, e, obs)
	reserve.SetSoloBelow(l, 1)
	control := ksControl(t, l)

	// A gate that holds the first script call before Redis, and delays the
	// reply of the second past its caller's deadline.
	var calls atomic.Int64
	hold, held := make(chan struct{}), make(chan struct{})
	e.rdb.AddHook(ksFuncHook(func(ctx context.Context, cmd redis.Cmder, next redis.ProcessHook) error {
		if n := cmd.Name(); n != "evalsha" && n != "eval" {
			return next(ctx, cmd)
		}
		switch calls.Add(1) {
		case 1:
			close(held)
			<-hold
		case 2:
			err := next(ctx, cmd)
			time.Sleep(300 * time.Millisecond) // the reply comes late
			return err
		}
		return next(ctx, cmd)
	}))

	type out struct {
		r        *reserve.Reservation
		err      error
		panicked any
	}
	run := func(ctx context.Context) chan out {
		ch := make(chan out, 1)
		go func() {
			var o out
			defer func() { o.panicked = recover(); ch <- o }()
			o.r, o.err = l.Reserve(ctx, "k")
		}()
		return ch
	}
	a := run(context.Background())
	<-held
	ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
	defer cancel()
	b := run(ctx) // queued behind a, deadline 200 ms away
	require.Eventually(t, func() bool { return reserve.QueueLen(l, "k") == 1 }, 5*time.Second, time.Millisecond)
	obs.armed.Store(true)
	close(hold) // a returns at once; b leads, alone, and its reply is late

	bound := 5*time.Second + 100*control
	wait := func(ch chan out, who string) (out, bool) {
		select {
		case o := <-ch:
			return o, true
		case <-time.After(bound):
			t.Errorf("%s never returned within %v: stalled\n%s", who, bound, ksStacks())
			return out{}, false
		}
	}
	oa, ok := wait(a, "the first caller")
	require.True(t, ok)
	require.NoError(t, oa.err)
	ob, ok := wait(b, "the queued caller named leader, whose late refund panicked")
	if !ok {
		live, _ := reserve.KeyStates(l)
		t.Errorf("keys holding coalescing state: %d", live)
		return
	}
	t.Logf("leader: r=%v err=%v panicked=%v", ob.r, ob.err, ob.panicked)
	require.False(t, obs.armed.Load(), "the Observer saw the refund")
	oc, ok := wait(run(context.Background()), "the next caller")
	require.True(t, ok)
	require.NoError(t, oc.err)
	ksNoState(t, l)
}

type ksFuncHook func(ctx context.Context, cmd redis.Cmder, next redis.ProcessHook) error

func (f ksFuncHook) DialHook(next redis.DialHook) redis.DialHook { return next }
func (f ksFuncHook) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}
func (f ksFuncHook) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error { return f(ctx, cmd, next) }
}

// ksGoexit ends the goroutine of the first decision it observes once
// armed with runtime.Goexit, as testing's t.FailNow (require.*) does from
// an Observer asserting on the goroutine that books.
type ksGoexit struct{ armed atomic.Bool }

func (o *ksGoexit) ObserveDecision(string, throttle.Outcome, time.Duration) {
	if o.armed.CompareAndSwap(true, false) {
		runtime.Goexit()
	}
}
func (o *ksGoexit) ObserveCall(string, time.Duration, error) {}
func (o *ksGoexit) ObserveRefund(string, time.Duration)      {}
func (o *ksGoexit) ObserveBreaker(bool)                      {}

// TestReviewKSGoexitOtherKey: a booking of key "bad" whose Observer ends
// its goroutine (runtime.Goexit: no panic to recover). Whatever that does
// to "bad", another key that never met the Observer must coalesce as
// before: a caller queued behind its call in flight is served once the
// call returns. (Before a78c117 the busy mark stayed with "bad"'s entry of
// Limiter.queues; now it goes with "bad"'s keyState to the free list.)
func TestReviewKSGoexitOtherKey(t *testing.T) {
	e := newEnv(t)
	obs := &ksGoexit{}
	l := ksObserved(t, e, obs)
	reserve.SetSoloBelow(l, 1)
	control := ksControl(t, l)

	obs.armed.Store(true)
	done := make(chan struct{})
	go func() {
		defer close(done)
		_, _ = l.Reserve(context.Background(), "bad")
	}()
	<-done
	require.False(t, obs.armed.Load(), "the Observer ended the booking goroutine")
	live, spare := reserve.KeyStates(l)
	t.Logf("after the Goexit: %d live, %d spare", live, spare)

	// Another key, two callers: the second queues behind the first's call.
	g := newGate(e.rdb)
	g.armed.Store(true)
	errs := make(chan error, 2)
	go func() { _, err := l.Reserve(context.Background(), "other"); errs <- err }()
	<-g.entered
	g.armed.Store(false)
	go func() { _, err := l.Reserve(context.Background(), "other"); errs <- err }()
	queued := assertEventually(func() bool { return reserve.QueueLen(l, "other") == 1 }, 2*time.Second)
	if !queued {
		t.Logf("the second caller of \"other\" did not queue (sent alone)")
	}
	close(g.release)
	bound := 5*time.Second + 100*control
	for i := 0; i < 2; i++ {
		select {
		case err := <-errs:
			require.NoError(t, err)
		case <-time.After(bound):
			live, _ := reserve.KeyStates(l)
			t.Fatalf("a caller of \"other\", a key that never met the Observer, never returned within %v "+
				"(queued: %v; keys holding state: %d): the busy mark of \"bad\" came with a reused state\n%s",
				bound, queued, live, ksStacks())
		}
	}
	ksNoState(t, l)
}

func assertEventually(f func() bool, within time.Duration) bool {
	end := time.Now().Add(within)
	for time.Now().Before(end) {
		if f() {
			return true
		}
		time.Sleep(time.Millisecond)
	}
	return f()
}

// TestReviewKSLedgerCatchesEarlySlots: the GCRA replay of this file flags
// a slot that comes early and passes a conforming schedule (checked on a
// throwaway testing.T, so that the replay is known to bite).
func TestReviewKSLedgerCatchesEarlySlots(t *testing.T) {
	lim := throttle.PerSecond(1000, 2) // T = 1000 µs, tau = 2000 µs
	run := func(ats []int64, ns []int) bool {
		lg := newKSLedger()
		for i, at := range ats {
			lg.cells["k"] = append(lg.cells["k"], &ksCell{at: at, n: ns[i]})
		}
		ft := &testing.T{}
		done := make(chan struct{})
		go func() { defer close(done); lg.check(ft, lim) }()
		<-done
		return !ft.Failed()
	}
	require.True(t, run([]int64{0, 0, 0, 1000, 2000, 5000}, []int{1, 1, 1, 1, 1, 1}))
	require.False(t, run([]int64{0, 0, 0, 0}, []int{1, 1, 1, 1}), "burst+2 at once")
	require.False(t, run([]int64{0, 0, 0, 999}, []int{1, 1, 1, 1}), "1 µs early")
	require.True(t, run([]int64{0, 0}, []int{2, 1}))
	require.False(t, run([]int64{0, 0}, []int{2, 2}), "n=2 after n=2 at once")
	// A cancelled slot stands for nothing.
	lg := newKSLedger()
	for _, at := range []int64{0, 0, 0, 0} {
		lg.cells["k"] = append(lg.cells["k"], &ksCell{at: at, n: 1})
	}
	lg.cancelled(lg.cells["k"][1])
	ft := &testing.T{}
	done := make(chan struct{})
	go func() { defer close(done); lg.check(ft, lim) }()
	<-done
	require.False(t, ft.Failed())
}

// TestReviewKSGoexitOtherKeyDefault: TestReviewKSGoexitOtherKey with the
// Limiter's default soloBelow (no test hook on it): after the Goexit on
// "bad", five concurrent callers of "other"; the fifth queues behind the
// four sent alone and must be served once they return.
func TestReviewKSGoexitOtherKeyDefault(t *testing.T) {
	e := newEnv(t)
	obs := &ksGoexit{}
	l := ksObserved(t, e, obs)
	control := ksControl(t, l)

	obs.armed.Store(true)
	done := make(chan struct{})
	go func() {
		defer close(done)
		_, _ = l.Reserve(context.Background(), "bad")
	}()
	<-done
	require.False(t, obs.armed.Load(), "the Observer ended the booking goroutine")

	g := newGate(e.rdb)
	g.armed.Store(true)
	errs := make(chan error, 5)
	for i := 0; i < 4; i++ {
		go func() { _, err := l.Reserve(context.Background(), "other"); errs <- err }()
	}
	for i := 0; i < 4; i++ {
		<-g.entered
	}
	g.armed.Store(false)
	go func() { _, err := l.Reserve(context.Background(), "other"); errs <- err }()
	queued := assertEventually(func() bool { return reserve.QueueLen(l, "other") == 1 }, 2*time.Second)
	close(g.release)
	bound := 5*time.Second + 100*control
	for i := 0; i < 5; i++ {
		select {
		case err := <-errs:
			require.NoError(t, err)
		case <-time.After(bound):
			live, _ := reserve.KeyStates(l)
			t.Fatalf("a caller of \"other\" never returned within %v (fifth queued: %v; keys holding state: %d)",
				bound, queued, live)
		}
	}
	ksNoState(t, l)
}

// ksObserved returns a Limiter ("api", 1000/s, burst 100) on an engine of
// its own over e's client, with the Observer obs.
func ksObserved(t *testing.T, e *env, obs throttle.Observer) *reserve.Limiter {
	t.Helper()
	eng, err := throttle.New(e.rdb, throttle.WithPrefix(e.prefix), throttle.WithTimeout(5*time.Second), throttle.WithObserver(obs))
	require.NoError(t, err)
	require.NoError(t, eng.Load(context.Background()))
	l, err := reserve.New(eng, "api", throttle.PerSecond(1000, 100))
	require.NoError(t, err)
	return l
}
