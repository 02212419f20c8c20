package pool_test

// Adversarial review of the pool's hand-down of cancelled slots (commit
// "pool: hand a cancelled job's slot down to the later jobs of its key").
// Every test here is named TestReviewHD...; helpers are prefixed hd
// (helper-80).
//
// FAILED on 2921062 (findings, since fixed):
//   - TestReviewHDLatencyInversion: the hand-down orders slots by the
//     Redis clock but jobs started at the booking's local SlotAt (wait
//     counted from its reply's arrival); a wanted job could be handed a
//     slot that started later than its own, past its deadline. A handed
//     slot's local start now counts from the job's own reply where that
//     says earlier.
//   - TestReviewHDOwedReservationShared: a cancelled (owed) job's
//     Reservation reports the booking another job ran in. Job.Reservation's
//     doc now says so; the test checks what must hold.
// The rest passed on 2921062 and pass.

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"sort"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/slotbook/slotbook/internal/redistest"
	"github.com/slotbook/slotbook/lease"
	"github.com/slotbook/slotbook/pool"
	"github.com/slotbook/slotbook/reserve"
	"github.com/slotbook/slotbook/throttle"
)

// hdRig: a limiter whose engine goes through a proxy (to hold replies
// back), a probe engine straight to Redis, and the limiter's name/prefix
// so that the probe can book the limiter's keys.
type hdRig struct {
	srv    *redistest.Server
	prefix string
	name   string
	proxy  *redistest.Proxy
	eng    *throttle.Engine
	lim    *reserve.Limiter
	probe  *throttle.Engine
	limits []throttle.Limit
}

func newHDRig(t *testing.T, srv *redistest.Server, limit throttle.Limit, opts ...reserve.Option) *hdRig {
	t.Helper()
	return newHDRigTimeout(t, srv, 10*time.Second, limit, opts...)
}

func newHDRigTimeout(t *testing.T, srv *redistest.Server, timeout time.Duration, limit throttle.Limit, opts ...reserve.Option) *hdRig {
	t.Helper()
	if srv == nil {
		srv = redistest.Shared(t)
	}
	prefix := redistest.Prefix(t)
	px := redistest.NewProxy(t, srv.Addr)
	eng, err := throttle.New(px.Client(t, srv), throttle.WithPrefix(prefix), throttle.WithTimeout(timeout))
	require.NoError(t, err)
	opts = append([]reserve.Option{reserve.WithMaxWait(time.Minute)}, opts...)
	lim, err := reserve.New(eng, "hdr", limit, opts...)
	require.NoError(t, err)
	probe, err := throttle.New(srv.Client(t), throttle.WithPrefix(prefix), throttle.WithTimeout(10*time.Second)) // leases and probes ride it: no 50 ms timeout on a busy machine
	require.NoError(t, err)
	// Warm connections through the proxy (overlapping pings each take one),
	// so that no booking dials (a dial's handshake would be held too).
	px.SetLatency(50 * time.Millisecond)
	var wg sync.WaitGroup
	for range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			_ = eng.Client().(*redis.Client).Ping(context.Background()).Err()
		}()
	}
	wg.Wait()
	px.SetLatency(0)
	require.NoError(t, eng.Client().(*redis.Client).Ping(context.Background()).Err())
	require.NoError(t, eng.Load(context.Background())) // no NOSCRIPT round trip under a held reply
	return &hdRig{srv: srv, prefix: prefix, name: "hdr", proxy: px, eng: eng, lim: lim, probe: probe, limits: lim.Limits()}
}

// keys are the limiter's engine keys for subject key (first limit first).
func (r *hdRig) keys(key string) []string {
	ks := []string{r.name + ":{" + key + "}"}
	for _, l := range r.limits[1:] {
		ks = append(ks, fmt.Sprintf("%s:{%s}:%dms", r.name, key, l.Period.Milliseconds()))
	}
	return ks
}

// probeBook books one unit of key straight in Redis, as the limiter would.
func (r *hdRig) probeBook(t *testing.T, key string) throttle.Booking {
	t.Helper()
	bs, err := r.probe.BookAll(context.Background(), r.keys(key), r.limits, []throttle.Request{{N: 1, MaxWait: throttle.Forever}})
	require.NoError(t, err)
	require.Len(t, bs, 1)
	return bs[0]
}

func hdSubmit(t *testing.T, p *pool.Pool, ctx context.Context, key string, fn func(context.Context) error) *pool.Job {
	t.Helper()
	if fn == nil {
		fn = func(context.Context) error { return nil }
	}
	j, err := p.Submit(ctx, key, fn)
	require.NoError(t, err)
	return j
}

func hdWait(t *testing.T, p *pool.Pool, d time.Duration) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), d)
	defer cancel()
	require.NoError(t, p.Wait(ctx), "the pool did not settle")
}

// TestReviewHDLatencyInversion: the hand-down orders a key's slots by the
// Redis clock (Booking().At) but a job starts at its reservation's local
// SlotAt, which counts the wait from the reply's arrival. A batch whose
// reply was slow holds an earlier Redis slot with a LATER local start than
// a later batch whose reply was fast. Cancel the slow batch's job: the
// wanted job of the fast batch is "handed down" the slow booking and
// starts later than its own slot (the doc: "each starts at a slot no later
// than its own"). With a deadline between the two local starts, the
// wanted job - whose own slot fits its deadline - never runs: it ends with
// context.DeadlineExceeded because another job was cancelled.
//
// Timeline (t0 = the pause): pause 3 s (first slot P = t0+3 s), I = 100
// ms. A's batch: reply held 1.5 s, so A books P and starts locally at
// ~t0+4.5 s. B's batch goes once A's lands (~t0+1.5 s) with no delay: B
// books P+I and starts at ~t0+3.1 s. B's deadline: t0+4.0 s. A is
// cancelled at ~t0+2.2 s. The control key runs the same without the
// cancel, same run.
//
// FAILED on 2921062 (PROVEN): B was handed A's booking, started ~1.4 s
// later than its own slot, and ended with context.DeadlineExceeded.
func TestReviewHDLatencyInversion(t *testing.T) {
	t.Parallel()
	r := newHDRig(t, nil, throttle.PerSecond(10, 0))
	p := newPool(t, r.lim, pool.WithWorkers(8))
	bg := context.Background()

	type run struct {
		a, b      *pool.Job
		cancelA   context.CancelFunc
		bDeadline time.Time
		bStarted  atomic.Int64
	}
	keys := []string{"inv", "ctl"}
	runs := make([]*run, len(keys))
	t0 := time.Now()
	for i, k := range keys {
		require.NoError(t, r.lim.Pause(bg, k, 3*time.Second))
		runs[i] = &run{}
	}
	r.proxy.SetReplyDelay(1500 * time.Millisecond)
	for i, k := range keys {
		actx, cancel := context.WithCancel(bg)
		t.Cleanup(cancel)
		runs[i].cancelA = cancel
		runs[i].a = hdSubmit(t, p, actx, k, nil)
	}
	time.Sleep(150 * time.Millisecond) // both A batches sent; their replies held 1.5 s
	r.proxy.SetReplyDelay(0)
	for i, k := range keys {
		ru := runs[i]
		ru.bDeadline = t0.Add(4 * time.Second)
		bctx, cancel := context.WithDeadline(bg, ru.bDeadline)
		t.Cleanup(cancel)
		ru.b = hdSubmit(t, p, bctx, k, func(context.Context) error {
			ru.bStarted.Store(time.Now().UnixNano())
			return nil
		})
	}
	time.Sleep(time.Until(t0.Add(2200 * time.Millisecond)))
	runs[0].cancelA() // the control's A is not cancelled
	hdWait(t, p, 20*time.Second)

	ctl := runs[1]
	require.NoError(t, ctl.a.Err(), "control: A")
	require.NoError(t, ctl.b.Err(), "control: B must run within its deadline (the setup is as intended)")
	require.True(t, ctl.a.Reservation().Booking().At.Before(ctl.b.Reservation().Booking().At))
	require.True(t, ctl.a.Slot().After(ctl.b.Slot()),
		"control: A's slow reply should give it the later local start (A %v, B %v)", ctl.a.Slot().Sub(t0), ctl.b.Slot().Sub(t0))

	inv := runs[0]
	require.ErrorIs(t, inv.a.Err(), context.Canceled)
	t.Logf("after the cancel: B holds Redis slot %v local start %v; A holds Redis slot %v local start %v (t0-relative)",
		inv.b.Reservation().Booking().At.Sub(t0), inv.b.Slot().Sub(t0), inv.a.Reservation().Booking().At.Sub(t0), inv.a.Slot().Sub(t0))
	// B's own booking was the one at P+I (A holds it now if they swapped,
	// else B still does): B must start no later than that booking's slot.
	own := inv.b.Slot()
	if inv.a.Reservation().Booking().At.After(inv.b.Reservation().Booking().At) {
		own = inv.a.Slot() // swapped: A holds B's own booking
	}
	assert.False(t, inv.b.Slot().After(own),
		"B was handed a slot that starts %v LATER than its own (B now starts at t0+%v, its own slot was t0+%v)",
		inv.b.Slot().Sub(own), inv.b.Slot().Sub(t0), own.Sub(t0))
	require.NoError(t, inv.b.Err(), "B's own slot fits its deadline (t0+%v); cancelling A made B fail", inv.bDeadline.Sub(t0))
}

// ---- a textbook GCRA, per limit, on µs of the Redis clock ----

// hdInterval is a limit's emission interval in µs (Period/Rate rounded up
// to a whole µs), from the definition.
func hdInterval(l throttle.Limit) int64 {
	ns := l.Period.Nanoseconds()
	per := (ns + int64(l.Rate) - 1) / int64(l.Rate)
	return (per + 999) / 1000
}

// hdGCRA is the textbook's state of one subject: per limit its TAT, or
// none (an idle key: the TAT has passed or the key does not exist).
type hdGCRA struct {
	limits []throttle.Limit
	tat    []int64
	has    []bool
}

// hdInitial reads the subject's state in Redis (what the pause left).
func (r *hdRig) hdInitial(t *testing.T, key string) *hdGCRA {
	t.Helper()
	st, err := r.lim.State(context.Background(), key)
	require.NoError(t, err)
	g := &hdGCRA{limits: r.limits, tat: make([]int64, len(r.limits)), has: make([]bool, len(r.limits))}
	for i, ks := range st.Keys {
		if ks.Exists && ks.TAT.After(st.Now) {
			g.tat[i], g.has[i] = ks.TAT.UnixMicro(), true
		}
	}
	return g
}

func (g *hdGCRA) clone() *hdGCRA {
	return &hdGCRA{limits: g.limits, tat: slices.Clone(g.tat), has: slices.Clone(g.has)}
}

// earliest is the first conforming slot for one unit (at or after floor).
func (g *hdGCRA) earliest(floor int64) int64 {
	s := floor
	for i, l := range g.limits {
		if g.has[i] {
			s = max(s, g.tat[i]-hdInterval(l)*int64(l.Burst))
		}
	}
	return s
}

// take books one unit at slot s: an error if s does not conform.
func (g *hdGCRA) take(s int64) error {
	for i, l := range g.limits {
		I := hdInterval(l)
		if g.has[i] && s < g.tat[i]-I*int64(l.Burst) {
			return fmt.Errorf("limit %d (%v): slot %d is %dµs before it conforms", i, l, s, g.tat[i]-I*int64(l.Burst)-s)
		}
		if !g.has[i] {
			g.tat[i], g.has[i] = s+I, true
		} else {
			g.tat[i] = max(g.tat[i], s) + I
		}
	}
	return nil
}

// hdReplay replays slots (sorted) through the textbook from g: an error if
// any does not conform (more than the limit allows).
func hdReplay(g *hdGCRA, slots []int64) (*hdGCRA, error) {
	g = g.clone()
	for k, s := range slots {
		if err := g.take(s); err != nil {
			return nil, fmt.Errorf("slot %d of %d: %w", k, len(slots), err)
		}
	}
	return g, nil
}

// hdGreedy is the textbook's next n slots from g, each as early as it
// conforms (all of them in the future: the floor never binds).
func hdGreedy(g *hdGCRA, floor int64, n int) []int64 {
	g = g.clone()
	out := make([]int64, 0, n)
	for range n {
		s := g.earliest(floor)
		_ = g.take(s)
		out = append(out, s)
	}
	return out
}

// ---- a job that records its runs ----

type hdJob struct {
	key       string
	j         *pool.Job
	runs      atomic.Int32
	startedAt atomic.Int64 // UnixNano, as the function saw it
	cancel    context.CancelFunc
	cancelled atomic.Bool
	cancelAt  time.Time
}

func (h *hdJob) fn(context.Context) error {
	h.runs.Add(1)
	h.startedAt.Store(time.Now().UnixNano())
	return nil
}

// hdCheckJobs checks oracle (3) for the jobs of one key and returns the
// Redis slots (µs) of the jobs that ran, sorted, and how many were
// wanted (never cancelled).
func hdCheckJobs(t *testing.T, jobs []*hdJob) (ran []int64, wanted int) {
	t.Helper()
	seen := map[int64]int{}
	for i, h := range jobs {
		if h.j == nil {
			continue
		}
		select {
		case <-h.j.Done():
		default:
			t.Errorf("job %d of %s is not done", i, h.key)
			continue
		}
		n := h.runs.Load()
		require.LessOrEqual(t, n, int32(1), "job %d of %s ran %d times", i, h.key, n)
		res := h.j.Reservation()
		if !h.cancelled.Load() {
			wanted++
		}
		if n == 0 {
			require.True(t, h.j.Started().IsZero(), "job %d of %s: Started without a run", i, h.key)
			require.True(t, h.cancelled.Load() || h.j.Err() != nil, "job %d of %s: did not run, no error", i, h.key)
			continue
		}
		require.NoError(t, h.j.Err(), "job %d of %s ran", i, h.key)
		require.False(t, h.j.Started().IsZero())
		require.NotNil(t, res, "job %d of %s ran without a reservation", i, h.key)
		require.True(t, res.OK(), "job %d of %s ran on a refusal", i, h.key)
		// A slot handed down starts as the job's own reply tells (see
		// Job.Slot): no later than the booking's own reply says.
		require.False(t, h.j.Slot().After(res.SlotAt()), "job %d of %s: Slot after its Reservation's", i, h.key)
		started := time.Unix(0, h.startedAt.Load())
		require.False(t, started.Before(h.j.Slot()), "job %d of %s started %v before its slot", i, h.key, h.j.Slot().Sub(started))
		if !res.Fallback() {
			// Same machine: the Redis clock is the local clock.
			require.False(t, started.Before(res.Booking().At), "job %d of %s started %v before its Redis slot", i, h.key, res.Booking().At.Sub(started))
			at := res.Booking().At.UnixMicro()
			if k, dup := seen[at]; dup {
				t.Errorf("jobs %d and %d of %s both ran in the Redis slot %d", k, i, h.key, at)
			}
			seen[at] = i
			ran = append(ran, at)
		}
	}
	slices.Sort(ran)
	return ran, wanted
}

// ---- the random scenario ----

type hdScenario struct {
	limits  []throttle.Limit
	nkeys   int
	njobs   int
	leaseN  int     // WithLease with N leases (0: none)
	cancelP float64 // share of the jobs cancelled
	delays  bool    // hold replies back at random while booking
	seed    uint64
	// closeAt, if set, closes the pool then (after the pause's start);
	// the probe follows Close.
	closeAt time.Duration
	// noProbe: judge (1) and (3), and that the jobs that ran hold the
	// textbook's first slots, but not where the next booking lands (a
	// Close amid the slots gives back the latest first, and those whose
	// slot comes meanwhile give nothing back: no exact answer).
	noProbe bool
}

// run: each key paused 4 s; jobs submitted over the first 1.2 s, a share
// of them cancelled at random before 2.2 s (queued, in flight, booked,
// under a give-back), replies held back at random until 1.6 s. Every
// cancel comes long before the first slot (P), so every cancelled slot
// can be handed down and the rest given back: nothing may be wasted. At
// 3.4 s (before P) a probe books the key straight in Redis: it must land
// exactly on the textbook's next slot after those of the jobs that will
// run, and the jobs that ran must hold exactly the textbook's first slots.
func (sc hdScenario) run(t *testing.T) {
	t.Logf("seed %d", sc.seed)
	rng := rand.New(rand.NewPCG(sc.seed, sc.seed^0x9e3779b97f4a7c15))
	var opts []reserve.Option
	if len(sc.limits) > 1 {
		opts = append(opts, reserve.WithLimit(sc.limits[1:]...))
	}
	r := newHDRig(t, nil, sc.limits[0], opts...)
	popts := []pool.Option{pool.WithWorkers(4 * sc.nkeys * sc.njobs)} // never waits to batch
	if sc.leaseN > 0 {
		sem, err := lease.New(r.probe, "hdlease", sc.leaseN, lease.WithTTL(30*time.Second))
		require.NoError(t, err)
		t.Cleanup(func() { _ = sem.Close(context.Background()) })
		popts = append(popts, pool.WithLease(sem))
	}
	p, err := pool.New(r.lim, popts...)
	require.NoError(t, err)
	closed := false
	t.Cleanup(func() {
		if !closed {
			_ = p.Close(context.Background())
		}
	})
	bg := context.Background()
	keys := make([]string, sc.nkeys)
	init := make([]*hdGCRA, sc.nkeys)
	t0 := time.Now()
	for k := range keys {
		keys[k] = fmt.Sprintf("k%d", k)
		require.NoError(t, r.lim.Pause(bg, keys[k], 4*time.Second))
		init[k] = r.hdInitial(t, keys[k])
	}
	P := time.UnixMicro(slices.Min(func() []int64 {
		var ps []int64
		for _, g := range init {
			ps = append(ps, g.earliest(0))
		}
		return ps
	}()))

	type event struct {
		at  time.Duration
		ord int
		do  func()
	}
	var evs []event
	jobs := make([][]*hdJob, sc.nkeys)
	for k := range keys {
		for range sc.njobs {
			h := &hdJob{key: keys[k]}
			jobs[k] = append(jobs[k], h)
			sub := time.Duration(rng.Int64N(int64(1200 * time.Millisecond)))
			ctx, cancel := context.WithCancel(bg)
			t.Cleanup(cancel)
			h.cancel = cancel
			key := keys[k]
			evs = append(evs, event{sub, 0, func() {
				j, err := p.Submit(ctx, key, h.fn)
				if sc.closeAt > 0 && errors.Is(err, pool.ErrClosed) {
					return
				}
				require.NoError(t, err)
				h.j = j
			}})
			if rng.Float64() < sc.cancelP {
				c := sub + time.Duration(rng.Int64N(int64(2200*time.Millisecond-sub)))
				evs = append(evs, event{c, 1, func() { h.cancelled.Store(true); h.cancelAt = time.Now(); cancel() }})
			}
		}
	}
	if sc.delays {
		for d := time.Duration(0); d < 1600*time.Millisecond; d += 80 * time.Millisecond {
			v := []time.Duration{0, 0, 30 * time.Millisecond, 120 * time.Millisecond, 250 * time.Millisecond}[rng.IntN(5)]
			evs = append(evs, event{d, 2, func() { r.proxy.SetReplyDelay(v) }})
		}
		evs = append(evs, event{1600 * time.Millisecond, 2, func() { r.proxy.SetReplyDelay(0) }})
	}
	if sc.closeAt > 0 {
		evs = append(evs, event{sc.closeAt, 3, func() {
			require.NoError(t, p.Close(bg))
			closed = true
		}})
	}
	sort.SliceStable(evs, func(a, b int) bool {
		if evs[a].at != evs[b].at {
			return evs[a].at < evs[b].at
		}
		return evs[a].ord < evs[b].ord
	})
	for _, ev := range evs {
		time.Sleep(time.Until(t0.Add(ev.at)))
		ev.do()
	}
	if sc.closeAt == 0 {
		time.Sleep(time.Until(t0.Add(3400 * time.Millisecond)))
		if time.Until(P) < 200*time.Millisecond {
			t.Skipf("the machine was too slow: the probe would come %v before the first slot", time.Until(P))
		}
	} else {
		time.Sleep(time.Until(t0.Add(sc.closeAt)))
		require.NoError(t, p.Close(bg)) // idempotent: waits for the close event's work
	}
	probes := make([]throttle.Booking, sc.nkeys)
	for k := range keys {
		probes[k] = r.probeBook(t, keys[k])
	}
	hdWait(t, p, 30*time.Second)
	require.NoError(t, p.Close(bg))
	closed = true
	// A goroutine that has called wg.Done may still be on its way out.
	require.Eventually(t, func() bool { return len(poolGoroutines(p)) == 0 }, 2*time.Second, time.Millisecond,
		"goroutines of the pool left after Close: %v", poolGoroutines(p))

	for k, key := range keys {
		ran, wanted := hdCheckJobs(t, jobs[k])
		if sc.closeAt == 0 {
			require.Equal(t, wanted, len(ran), "key %s: every job never cancelled runs", key)
		} else {
			for i, h := range jobs[k] {
				if h.j != nil && h.runs.Load() == 0 && !h.cancelled.Load() {
					require.ErrorIs(t, h.j.Err(), pool.ErrClosed, "key %s job %d: wanted, did not run", key, i)
				}
			}
		}
		// (1) rate safety: the slots that ran conform to the limits.
		_, err := hdReplay(init[k], ran)
		require.NoError(t, err, "key %s: the jobs that ran exceed the limit", key)
		// (2) nothing wasted: they hold the textbook's first slots, and
		// the probe the next.
		want := hdGreedy(init[k], 0, len(ran)+1)
		require.Equal(t, hdRel(want[:len(ran)], P), hdRel(ran, P), "key %s: the slots of the jobs that ran (µs after P)", key)
		if sc.noProbe {
			continue
		}
		if sc.closeAt > 0 && probes[k].Wait <= 0 {
			t.Logf("key %s: the probe came after the key's last slot: (2) not judged", key)
			continue
		}
		require.Positive(t, probes[k].Wait, "key %s: the probe came after the slots", key)
		require.Equal(t, hdRel(want[len(ran):], P), hdRel([]int64{probes[k].At.UnixMicro()}, P),
			"key %s: the next booking after the %d jobs that ran (µs after P): a cancelled slot was wasted", key, len(ran))
	}
}

func hdRel(xs []int64, P time.Time) []int64 {
	out := make([]int64, len(xs))
	for i, x := range xs {
		out[i] = x - P.UnixMicro()
	}
	return out
}

func hdSeed(t *testing.T, i int) uint64 {
	s := uint64(time.Now().UnixNano()) + uint64(i)
	return s
}

// TestReviewHDRandom: several keys, random cancels (queued, in flight,
// booked, during give-backs), replies held back at random: oracles (1),
// (2), (3).
func TestReviewHDRandom(t *testing.T) {
	t.Parallel()
	for i := range 3 {
		t.Run(fmt.Sprint(i), func(t *testing.T) {
			hdScenario{limits: []throttle.Limit{throttle.PerSecond(20, 0)}, nkeys: 3, njobs: 12, cancelP: 0.45, delays: true, seed: hdSeed(t, i)}.run(t)
		})
	}
}

// TestReviewHDRandomLayered: as TestReviewHDRandom under a layered limiter
// whose second limit (with a burst) binds after a few slots.
func TestReviewHDRandomLayered(t *testing.T) {
	t.Parallel()
	for i := range 2 {
		t.Run(fmt.Sprint(i), func(t *testing.T) {
			hdScenario{limits: []throttle.Limit{throttle.PerSecond(20, 0), throttle.PerMinute(600, 3)}, nkeys: 2, njobs: 12, cancelP: 0.45, delays: true, seed: hdSeed(t, i)}.run(t)
		})
	}
}

// TestReviewHDRandomBurst: a limit with a burst (the pause spends it).
func TestReviewHDRandomBurst(t *testing.T) {
	t.Parallel()
	for i := range 2 {
		t.Run(fmt.Sprint(i), func(t *testing.T) {
			hdScenario{limits: []throttle.Limit{throttle.PerSecond(20, 4)}, nkeys: 2, njobs: 12, cancelP: 0.45, delays: true, seed: hdSeed(t, i)}.run(t)
		})
	}
}

// TestReviewHDRandomLease: WithLease (enough leases for every job): jobs
// book one by one, several calls of a key in flight at once, replies
// coming back out of order.
func TestReviewHDRandomLease(t *testing.T) {
	t.Parallel()
	for i := range 2 {
		t.Run(fmt.Sprint(i), func(t *testing.T) {
			hdScenario{limits: []throttle.Limit{throttle.PerSecond(20, 0)}, nkeys: 2, njobs: 10, leaseN: 64, cancelP: 0.45, delays: true, seed: hdSeed(t, i)}.run(t)
		})
	}
}

// TestReviewHDOwedReservationShared: Job.Reservation's doc says a job
// "may hold another booking of its key than the one its batch made for
// it: an earlier one handed down to it, or, cancelled, the later one it
// gave back in its place". A job cancelled while a batch of its key is in
// flight is owed and done at once, its Reservation fixed; its booking is
// then handed down (to a placeholder) once the batch lands, and a wanted
// job runs in it. So the cancelled job's Reservation reports the very
// booking another job ran in, not one that was given back: two jobs'
// Reservations answer the same slot, one of them as if unused.
//
// FAILED on 2921062 (PROVEN, a consistency/doc defect; no rate or waste
// consequence): Job.Reservation's doc now says so, and the test checks
// what must hold.
func TestReviewHDOwedReservationShared(t *testing.T) {
	t.Parallel()
	r := newHDRig(t, nil, throttle.PerSecond(5, 0)) // I = 200 ms
	p := newPool(t, r.lim, pool.WithWorkers(8))
	bg := context.Background()
	require.NoError(t, r.lim.Pause(bg, "k", 2*time.Second))
	actx, cancelA := context.WithCancel(bg)
	defer cancelA()
	a := hdSubmit(t, p, actx, "k", nil)
	b := hdSubmit(t, p, bg, "k", nil)
	time.Sleep(300 * time.Millisecond) // a and b booked
	r.proxy.SetReplyDelay(600 * time.Millisecond)
	d := hdSubmit(t, p, bg, "k", nil)
	e := hdSubmit(t, p, bg, "k", nil)
	time.Sleep(200 * time.Millisecond) // d and e in flight
	cancelA()
	<-a.Done() // owed: done at once
	time.Sleep(900 * time.Millisecond)
	r.proxy.SetReplyDelay(0)
	hdWait(t, p, 20*time.Second)
	require.ErrorIs(t, a.Err(), context.Canceled)
	require.True(t, a.Started().IsZero(), "a ran")
	// Since the finding, Job.Reservation's doc says so: a cancelled job's
	// booking is the one it held when it was done, which the pool may hand
	// down to another job after that. What must hold: the jobs that ran
	// hold distinct slots, each started no earlier than its slot (on this
	// machine the Redis clock is the local clock).
	aAt := a.Reservation().Booking().At
	seen := map[time.Time]string{}
	for name, j := range map[string]*pool.Job{"b": b, "d": d, "e": e} {
		require.NoError(t, j.Err(), name)
		at := j.Reservation().Booking().At
		require.NotContains(t, seen, at, "jobs %s and %s ran in one slot", seen[at], name)
		seen[at] = name
		require.False(t, j.Started().Before(at), "job %s started before its Redis slot", name)
		if at.Equal(aAt) {
			t.Logf("job %s runs in the booking cancelled job a held when it was done (%v after the pause's end)", name, aAt.Sub(b.Reservation().Booking().At))
		}
	}
}

// TestReviewHDRandomClose: as TestReviewHDRandom, and Close comes at a
// random time: while batches are in flight, while cancels are handed down
// and given back, or once it all settled, before the first slot. Nothing
// runs; every booking comes back: the probe lands on the pause's end.
func TestReviewHDRandomClose(t *testing.T) {
	t.Parallel()
	for i := range 3 {
		t.Run(fmt.Sprint(i), func(t *testing.T) {
			seed := hdSeed(t, i)
			closeAt := time.Duration(200+seed%2800) * time.Millisecond
			t.Logf("close at %v", closeAt)
			hdScenario{limits: []throttle.Limit{throttle.PerSecond(20, 0)}, nkeys: 2, njobs: 12, cancelP: 0.45, delays: true, seed: seed, closeAt: closeAt}.run(t)
		})
	}
}

// TestReviewHDRandomCloseLease: the same with WithLease.
func TestReviewHDRandomCloseLease(t *testing.T) {
	t.Parallel()
	for i := range 2 {
		t.Run(fmt.Sprint(i), func(t *testing.T) {
			seed := hdSeed(t, i)
			closeAt := time.Duration(200+seed%2800) * time.Millisecond
			t.Logf("close at %v", closeAt)
			hdScenario{limits: []throttle.Limit{throttle.PerSecond(20, 0)}, nkeys: 2, njobs: 10, leaseN: 64, cancelP: 0.45, delays: true, seed: seed, closeAt: closeAt}.run(t)
		})
	}
}

// TestReviewHDRandomCloseAmidSlots: Close comes while the first slots
// come (P = 4 s, I = 50 ms): some jobs ran, the rest are given back. No
// replies held back (a held reply makes a job's local start later than
// its Redis slot, so the jobs that ran before Close need not be the
// first). (1), (3), and the jobs that ran hold the textbook's first slots.
func TestReviewHDRandomCloseAmidSlots(t *testing.T) {
	t.Parallel()
	for i := range 2 {
		t.Run(fmt.Sprint(i), func(t *testing.T) {
			seed := hdSeed(t, i)
			closeAt := time.Duration(3950+seed%400) * time.Millisecond
			t.Logf("close at %v", closeAt)
			hdScenario{limits: []throttle.Limit{throttle.PerSecond(20, 0)}, nkeys: 2, njobs: 12, cancelP: 0.45, delays: false, seed: seed, closeAt: closeAt, noProbe: true}.run(t)
		})
	}
}

// hdFallbackRound: jobs booked in Redis behind a 3 s pause, then Redis
// unreachable (every reply held back an hour, the engine's timeout 250
// ms: the breaker opens and the fallback answers), jobs answered by the
// fallback, Redis-booked jobs cancelled during the outage (handed down
// among the Redis bookings; their give-backs fail), a fallback job
// cancelled, then Redis back and more jobs, one of them cancelled. Judged:
// (3) for every job; (1) for the Redis slots that ran (a subset of what
// the key holds, lost replies included); a fallback job is never handed a
// Redis slot nor a Redis job a fallback one (each ran on its own kind).
func hdFallbackRound(t *testing.T, fb reserve.Fallback) {
	r := newHDRigTimeout(t, nil, 250*time.Millisecond, throttle.PerSecond(10, 0), reserve.WithFallback(fb))
	p := newPool(t, r.lim, pool.WithWorkers(256))
	bg := context.Background()
	t0 := time.Now()
	require.NoError(t, r.lim.Pause(bg, "k", 3*time.Second))
	init := r.hdInitial(t, "k")
	var jobs []*hdJob
	sub := func(kind string) *hdJob {
		ctx, cancel := context.WithCancel(bg)
		t.Cleanup(cancel)
		h := &hdJob{key: kind, cancel: cancel}
		h.j = hdSubmit(t, p, ctx, "k", h.fn)
		jobs = append(jobs, h)
		return h
	}
	cancel := func(h *hdJob) { h.cancelled.Store(true); h.cancel() }
	at := func(d time.Duration) { time.Sleep(time.Until(t0.Add(d))) }
	var before []*hdJob
	for range 6 {
		before = append(before, sub("redis"))
	}
	at(400 * time.Millisecond)
	r.proxy.SetReplyDelay(time.Hour)
	at(500 * time.Millisecond)
	var during []*hdJob
	for range 4 {
		during = append(during, sub("outage"))
	}
	at(900 * time.Millisecond)
	cancel(before[0])
	cancel(before[2])
	at(1000 * time.Millisecond)
	cancel(during[3])
	at(1500 * time.Millisecond)
	r.proxy.SetReplyDelay(0)
	at(1700 * time.Millisecond)
	var after []*hdJob
	for range 3 {
		after = append(after, sub("after"))
	}
	at(2000 * time.Millisecond)
	cancel(after[0])
	hdWait(t, p, 30*time.Second)

	var redisRan []int64
	for i, h := range jobs {
		n := h.runs.Load()
		require.LessOrEqual(t, n, int32(1), "job %d ran twice", i)
		res := h.j.Reservation()
		t.Logf("job %d (%s) cancelled=%v runs=%d err=%v fallback=%v slot=%v", i, h.key, h.cancelled.Load(), n, h.j.Err(),
			res != nil && res.Fallback(), func() any {
				if res == nil || !res.OK() {
					return nil
				}
				return res.SlotAt().Sub(t0)
			}())
		if n == 0 {
			require.True(t, h.j.Started().IsZero())
			continue
		}
		require.NotNil(t, res)
		require.True(t, res.OK())
		started := time.Unix(0, h.startedAt.Load())
		require.False(t, started.Before(h.j.Slot()), "job %d started before its slot", i)
		if h.key == "redis" {
			require.False(t, res.Fallback(), "job %d booked in Redis before the outage ran on a fallback slot", i)
		}
		if !res.Fallback() {
			require.False(t, started.Before(res.Booking().At), "job %d started before its Redis slot", i)
			redisRan = append(redisRan, res.Booking().At.UnixMicro())
		}
	}
	for _, h := range before {
		if !h.cancelled.Load() {
			require.NoError(t, h.j.Err(), "a Redis-booked job never cancelled must run")
		}
	}
	slices.Sort(redisRan)
	require.Len(t, slices.Compact(slices.Clone(redisRan)), len(redisRan), "two jobs ran in one Redis slot")
	_, err := hdReplay(init, redisRan)
	require.NoError(t, err, "the Redis slots that ran exceed the limit")
	require.NoError(t, p.Close(bg))
	require.Eventually(t, func() bool { return len(poolGoroutines(p)) == 0 }, 2*time.Second, time.Millisecond)
}

// TestReviewHDFallbackFailOpen: hdFallbackRound under FailOpen.
func TestReviewHDFallbackFailOpen(t *testing.T) {
	t.Parallel()
	hdFallbackRound(t, reserve.FailOpen())
}

// TestReviewHDFallbackLocalShare: hdFallbackRound under LocalShare.
func TestReviewHDFallbackLocalShare(t *testing.T) {
	t.Parallel()
	hdFallbackRound(t, reserve.LocalShare(50*time.Millisecond, 1, 100))
}

// hdEdgeRound: 16 jobs of one key booked in one batch behind a 1 s pause
// (slots P + k*I, I = 40 ms); about half of them end exactly around a
// slot: at P + k*I + jitter (jitter within ±4 ms), by cancel or by their
// context's deadline (useDeadline: the deadline is set at submit, so a
// slot past it is refused or, late, held). Judged: (1), (3); a job that
// ran started no earlier than its slot and its Redis slot; one whose
// context had ended when its function started is counted (logged: the
// doc says it does not run).
func hdEdgeRound(t *testing.T, seed uint64, useDeadline bool) {
	t.Logf("seed %d", seed)
	rng := rand.New(rand.NewPCG(seed, 7))
	r := newHDRig(t, nil, throttle.PerSecond(25, 0))
	p := newPool(t, r.lim, pool.WithWorkers(256))
	bg := context.Background()
	require.NoError(t, r.lim.Pause(bg, "k", time.Second))
	init := r.hdInitial(t, "k")
	P := time.UnixMicro(init.earliest(0))
	I := time.Duration(hdInterval(throttle.PerSecond(25, 0))) * time.Microsecond
	var jobs []*hdJob
	var endedAtStart atomic.Int32
	for range 16 {
		h := &hdJob{key: "k"}
		ctx, cancel := context.WithCancel(bg)
		if rng.IntN(2) == 0 {
			end := P.Add(time.Duration(rng.IntN(16))*I + time.Duration(rng.Int64N(int64(8*time.Millisecond))) - 4*time.Millisecond)
			h.cancelled.Store(true)
			h.cancelAt = end
			if useDeadline {
				ctx, cancel = context.WithDeadline(bg, end)
			} else {
				time.AfterFunc(time.Until(end), cancel)
			}
		}
		t.Cleanup(cancel)
		fn := func(ctx context.Context) error {
			if ctx.Err() != nil {
				endedAtStart.Add(1)
			}
			return h.fn(ctx)
		}
		h.j = hdSubmit(t, p, ctx, "k", fn)
		jobs = append(jobs, h)
	}
	hdWait(t, p, 30*time.Second)
	var ran []int64
	for i, h := range jobs {
		n := h.runs.Load()
		require.LessOrEqual(t, n, int32(1), "job %d ran twice", i)
		if n == 0 {
			require.True(t, h.j.Started().IsZero())
			require.Error(t, h.j.Err(), "job %d did not run", i)
			if !h.cancelled.Load() {
				t.Errorf("job %d never ended yet did not run: %v", i, h.j.Err())
			}
			continue
		}
		require.NoError(t, h.j.Err())
		res := h.j.Reservation()
		started := time.Unix(0, h.startedAt.Load())
		require.False(t, started.Before(h.j.Slot()), "job %d started before its slot", i)
		require.False(t, started.Before(res.Booking().At), "job %d started before its Redis slot", i)
		if h.cancelled.Load() && started.After(h.cancelAt) {
			t.Logf("job %d started %v after its context's end", i, started.Sub(h.cancelAt))
		}
		ran = append(ran, res.Booking().At.UnixMicro())
	}
	slices.Sort(ran)
	require.Len(t, slices.Compact(slices.Clone(ran)), len(ran), "two jobs ran in one Redis slot")
	_, err := hdReplay(init, ran)
	require.NoError(t, err, "the jobs that ran exceed the limit")
	t.Logf("%d ran; %d started with their context already ended", len(ran), endedAtStart.Load())
}

// TestReviewHDEdgeCancel: contexts cancelled right around slots.
func TestReviewHDEdgeCancel(t *testing.T) {
	t.Parallel()
	for i := range 3 {
		t.Run(fmt.Sprint(i), func(t *testing.T) { hdEdgeRound(t, hdSeed(t, i), false) })
	}
}

// TestReviewHDEdgeDeadline: deadlines right around slots.
func TestReviewHDEdgeDeadline(t *testing.T) {
	t.Parallel()
	for i := range 3 {
		t.Run(fmt.Sprint(i), func(t *testing.T) { hdEdgeRound(t, hdSeed(t, i), true) })
	}
}
