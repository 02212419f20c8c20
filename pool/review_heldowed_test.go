package pool_test

// Review (helper-86) of 2fc1a07, 252fb27, 3af4191: a late refusal's held
// booking is handed down, kept owed past its slot, and given back when
// nothing stands above it. Through the public API; slots on the Redis
// clock (Booking().At; Redis runs on this host).
//
// FAIL on the current code (one finding: since 3af4191 a held booking that
// cannot be handed down stays owed until its key goes quiet, long after
// its end has passed and refund.lua would give nothing back):
//   - TestReviewHOSteadyPileUp/lease=false: the owed list piles up under a
//     steady load; when the load stops the key is not booked while the pile
//     goes back, one round trip each (a fresh job waits seconds).
//   - TestReviewHORetainedWhileBusy: the pool holds every such job (and
//     its function) while the key is busy: memory grows with the load.
//   - TestReviewHOCloseWithPile/up, /paused: Close gives the pile back one
//     round trip each; with Redis paused, one second each.
// Every other test passes.

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"runtime"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/slotbook/slotbook/deadline"
	"github.com/slotbook/slotbook/internal/redistest"
	"github.com/slotbook/slotbook/lease"
	"github.com/slotbook/slotbook/pool"
	"github.com/slotbook/slotbook/reserve"
	"github.com/slotbook/slotbook/throttle"
)

// hoObs counts refunds (calls that reached Redis and answered) and how
// many gave anything back.
type hoObs struct {
	refunds, given atomic.Int64
}

func (o *hoObs) ObserveDecision(string, throttle.Outcome, time.Duration) {}
func (o *hoObs) ObserveCall(string, time.Duration, error)                {}
func (o *hoObs) ObserveRefund(_ string, given time.Duration) {
	o.refunds.Add(1)
	if given > 0 {
		o.given.Add(1)
	}
}
func (o *hoObs) ObserveBreaker(bool) {}

// hoRig: a limiter whose engine talks to Redis through a proxy, and a
// probe engine straight to Redis.
type hoRig struct {
	srv    *redistest.Server
	lim    *reserve.Limiter
	proxy  *redistest.Proxy
	eng    *throttle.Engine
	probe  *throttle.Engine
	obs    *hoObs
	name   string
	limits []throttle.Limit
}

func newHORig(t *testing.T, srv *redistest.Server, name string, limits []throttle.Limit, engOpts []throttle.Option, opts ...reserve.Option) *hoRig {
	t.Helper()
	prefix := redistest.Prefix(t)
	px := redistest.NewProxy(t, srv.Addr)
	obs := &hoObs{}
	engOpts = append([]throttle.Option{throttle.WithPrefix(prefix), throttle.WithTimeout(10 * time.Second), throttle.WithObserver(obs)}, engOpts...)
	eng, err := throttle.New(px.Client(t, srv), engOpts...)
	require.NoError(t, err)
	opts = append([]reserve.Option{reserve.WithMaxWait(time.Minute)}, opts...)
	if len(limits) > 1 {
		opts = append(opts, reserve.WithLimit(limits[1:]...))
	}
	lim, err := reserve.New(eng, name, limits[0], opts...)
	require.NoError(t, err)
	probe, err := throttle.New(srv.Client(t), throttle.WithPrefix(prefix), throttle.WithTimeout(10*time.Second)) // leases and probes ride it: no 50 ms timeout on a busy machine
	require.NoError(t, err)
	bg := context.Background()
	require.NoError(t, eng.Client().(*redis.Client).Ping(bg).Err())
	require.NoError(t, eng.Load(bg))
	require.NoError(t, probe.Load(bg))
	return &hoRig{srv: srv, lim: lim, proxy: px, eng: eng, probe: probe, obs: obs, name: name, limits: limits}
}

func (r *hoRig) keys(key string) []string {
	first := r.name + ":{" + key + "}"
	ks := []string{first}
	for _, l := range r.limits[1:] {
		ks = append(ks, first+":"+strconv.FormatInt(l.Period.Milliseconds(), 10)+"ms")
	}
	return ks
}

func (r *hoRig) probeBook(t *testing.T, key string) throttle.Booking {
	t.Helper()
	bs, err := r.probe.BookAll(context.Background(), r.keys(key), r.limits, []throttle.Request{{N: 1, MaxWait: throttle.Forever}})
	require.NoError(t, err)
	require.True(t, bs[0].OK)
	return bs[0]
}

func hoNop(context.Context) error { return nil }

// hoLate reports whether j was refused late, its booking held.
func hoLate(j *pool.Job) bool {
	r := j.Reservation()
	return r != nil && errors.Is(j.Err(), deadline.ErrWouldExceedDeadline) && r.Booking().OK
}

// An hoOut is what a job of hoLoad came to, recorded once it is done by a
// goroutine that then drops the job.
type hoOut struct {
	late    bool // refused late, its booking held
	lateJob bool // submitted with a deadline inside the reply's latency
	ran     bool
	err     error
	at      time.Time // Booking().At of its Reservation, if any
	started time.Time
	doneAt  time.Time
	freed   atomic.Bool // the object its function held was finalized
}

// An hoLoader records the jobs of a load without holding them.
type hoLoader struct {
	mu   sync.Mutex
	outs []*hoOut
	wg   sync.WaitGroup
}

func (l *hoLoader) submit(t *testing.T, p *pool.Pool, ctx context.Context, key string, lateJob, track bool) {
	t.Helper()
	o := &hoOut{lateJob: lateJob}
	fn := hoNop
	if track {
		obj := new([64]byte)
		runtime.SetFinalizer(obj, func(*[64]byte) { o.freed.Store(true) })
		fn = func(context.Context) error { runtime.KeepAlive(obj); return nil }
	}
	j, err := p.Submit(ctx, key, fn)
	if err != nil && ctx.Err() != nil {
		return // its deadline passed before it was submitted
	}
	require.NoError(t, err)
	l.mu.Lock()
	l.outs = append(l.outs, o)
	l.mu.Unlock()
	l.wg.Add(1)
	go func() {
		defer l.wg.Done()
		<-j.Done()
		doneAt := time.Now()
		err := j.Err()
		var at time.Time
		late := hoLate(j)
		if r := j.Reservation(); r != nil {
			at = r.Booking().At
			if err == nil {
				require.True(t, r.OK())
			}
		}
		started := j.Started()
		l.mu.Lock()
		o.late, o.ran, o.err, o.at, o.started, o.doneAt = late, err == nil && !started.IsZero(), err, at, started, doneAt
		l.mu.Unlock()
	}()
}

// load drives a steady load on keys for dur: every step a plain job on
// each key, and every lateEvery-th step also a job whose deadline, lateIn
// from its submission, lies within the reply's latency (on a key that is
// not saturated, Redis books it at once, and the reply comes too late).
func (l *hoLoader) load(t *testing.T, p *pool.Pool, keys []string, dur, step time.Duration, lateEvery int, lateIn time.Duration, track bool) {
	t.Helper()
	end := time.Now().Add(dur)
	for i := 0; time.Now().Before(end); i++ {
		for _, key := range keys {
			l.submit(t, p, context.Background(), key, false, track)
			if i%lateEvery == 0 {
				ctx, cancel := context.WithTimeout(context.Background(), lateIn)
				t.Cleanup(cancel)
				l.submit(t, p, ctx, key, true, track)
			}
		}
		time.Sleep(step)
	}
}

// check waits for every job's outcome: every job that ran started no
// earlier than its slot on the Redis clock; with noBurst, no two ran
// closer than I (textbook GCRA, no burst, of the slots that ran). It
// returns how many ran and were held late, and the latest slot that ran.
func (l *hoLoader) check(t *testing.T, I time.Duration, noBurst bool) (ran, late int, last time.Time) {
	t.Helper()
	l.wg.Wait()
	l.mu.Lock()
	defer l.mu.Unlock()
	var slots []time.Time
	for _, o := range l.outs {
		if o.late {
			late++
		}
		if !o.ran {
			continue
		}
		require.False(t, o.started.Before(o.at), "a job started %v before its slot on the Redis clock", o.at.Sub(o.started))
		slots = append(slots, o.at)
	}
	slices.SortFunc(slots, time.Time.Compare)
	if noBurst {
		for i := 1; i < len(slots); i++ {
			require.GreaterOrEqual(t, slots[i].Sub(slots[i-1]), I, "two jobs ran closer than the interval (slots %d, %d of %d): a room given back twice", i-1, i, len(slots))
		}
	}
	if len(slots) > 0 {
		last = slots[len(slots)-1]
	}
	return len(slots), late, last
}

func (l *hoLoader) errs() map[string]int {
	l.mu.Lock()
	defer l.mu.Unlock()
	m := map[string]int{}
	for _, o := range l.outs {
		if o.err != nil {
			m[fmt.Sprintf("late=%v %v", o.late, o.err)[:min(60, len(fmt.Sprintf("late=%v %v", o.late, o.err)))]]++
		}
	}
	return m
}

// TestReviewHOSteadyPileUp: a steady load on one key that is never
// saturated (a big burst: every booking is immediate), 40 ms reply
// latency, so the key always has a booking call in flight or a booked job;
// every few jobs one is refused late (its deadline inside the reply's
// latency), its held booking immediate and so never handable. Such a
// booking stays owed until the key is quiet, though its room is gone once
// its end has passed (refund.lua gives nothing back then): the owed list
// grows with the load. When the load stops, the pool gives each one back
// in turn, one Redis round trip each, and books nothing for the key
// meanwhile (giving): a job submitted then waits for all of them.
// Control: the same job on another key of the same pool, at the same time.
func TestReviewHOSteadyPileUp(t *testing.T) {
	t.Parallel()
	for _, withLease := range []bool{false, true} {
		t.Run(fmt.Sprintf("lease=%v", withLease), func(t *testing.T) {
			r := newHORig(t, redistest.Shared(t), "pile", []throttle.Limit{throttle.PerSecond(2000, 400)}, nil)
			opts := []pool.Option{pool.WithWorkers(32)}
			if withLease {
				sem, err := lease.New(r.probe, "pilelease", 32, lease.WithTTL(30*time.Second))
				require.NoError(t, err)
				defer func() { _ = sem.Close(context.Background()) }()
				opts = append(opts, pool.WithLease(sem))
			}
			p, err := pool.New(r.lim, opts...)
			require.NoError(t, err)
			defer func() {
				ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
				defer cancel()
				require.NoError(t, p.Close(ctx))
			}()
			r.proxy.SetReplyDelay(40 * time.Millisecond)
			var l hoLoader
			l.load(t, p, []string{"k"}, 4*time.Second, 5*time.Millisecond, 3, 65*time.Millisecond, false)
			// The load has stopped. Submit the fresh jobs as soon as the
			// backlog is done.
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			require.NoError(t, p.Wait(ctx))
			refundsBefore := r.obs.refunds.Load()
			t0 := time.Now()
			fresh, err := p.Submit(context.Background(), "k", hoNop)
			require.NoError(t, err)
			ctl, err := p.Submit(context.Background(), "ctl", hoNop)
			require.NoError(t, err)
			require.NoError(t, fresh.Wait(ctx))
			require.NoError(t, ctl.Wait(ctx))
			require.False(t, fresh.Started().Before(fresh.Reservation().Booking().At))
			dFresh, dCtl := fresh.Started().Sub(t0), ctl.Started().Sub(t0)
			time.Sleep(500 * time.Millisecond)
			refundsAfter := r.obs.refunds.Load() - refundsBefore
			ran, late, _ := l.check(t, time.Millisecond/2, false)
			t.Logf("jobs %d, ran %d, late held %d; refunds during the load %d; after it went quiet %d (gave room: %d in all); fresh job on k started after %v, on another key after %v; errors %v",
				len(l.outs), ran, late, refundsBefore, refundsAfter, r.obs.given.Load(), dFresh, dCtl, l.errs())
			if late < 20 {
				t.Skipf("only %d late refusals: inconclusive", late)
			}
			require.Less(t, refundsAfter, int64(40), "owed held bookings piled up under the steady load: %d of the %d late refusals were given back only once the key went quiet (each a Redis round trip giving nothing back)", refundsAfter, late)
			require.Less(t, dFresh, dCtl+time.Second, "a job on the key, submitted once the load stopped, started %v later than on another key: the key was not booked while its pile of owed held bookings went back one round trip at a time", dFresh-dCtl)
		})
	}
}

// TestReviewHORetainedWhileBusy: the load of TestReviewHOSteadyPileUp, each
// job's function holding an object with a finalizer. Midway through the
// load, the jobs refused late and done more than a second ago (their slot
// and its room long gone: refund.lua gives nothing back once the
// booking's end has passed, here half a millisecond after its slot) are
// still held by the pool, and more of them the longer the load runs.
// Control: the plain jobs done as long ago, all freed.
func TestReviewHORetainedWhileBusy(t *testing.T) {
	t.Parallel()
	r := newHORig(t, redistest.Shared(t), "keep", []throttle.Limit{throttle.PerSecond(2000, 400)}, nil)
	p, err := pool.New(r.lim, pool.WithWorkers(32))
	require.NoError(t, err)
	defer func() {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
		defer cancel()
		require.NoError(t, p.Close(ctx))
	}()
	r.proxy.SetReplyDelay(40 * time.Millisecond)
	var l hoLoader
	loaded := make(chan struct{})
	go func() {
		defer close(loaded)
		l.load(t, p, []string{"k"}, 7*time.Second, 5*time.Millisecond, 3, 65*time.Millisecond, true)
	}()
	look := func() (lateOld, lateKept, ctlOld, ctlKept int) {
		for range 3 {
			runtime.GC()
			time.Sleep(20 * time.Millisecond)
		}
		now := time.Now()
		l.mu.Lock()
		defer l.mu.Unlock()
		for _, o := range l.outs {
			if o.doneAt.IsZero() || now.Sub(o.doneAt) < time.Second {
				continue
			}
			if o.late {
				if now.Sub(o.at) < time.Second {
					continue
				}
				lateOld++
				if !o.freed.Load() {
					lateKept++
				}
				continue
			}
			ctlOld++
			if !o.freed.Load() {
				ctlKept++
			}
		}
		return
	}
	// One look only: the look's GC pauses the load long enough for the
	// key to go quiet, and the pile then goes back (see
	// TestReviewHOSteadyPileUp).
	time.Sleep(4 * time.Second)
	a, b, c, d := look()
	<-loaded
	t.Logf("after 4 s of load: jobs refused late, done >= 1 s ago: %d, still held by the pool: %d; other jobs: %d, still held: %d", a, b, c, d)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	require.NoError(t, p.Wait(ctx))
	if a < 20 {
		t.Skipf("only %d late refusals: inconclusive", a)
	}
	require.Zero(t, d, "control: plain jobs done long ago not freed (the look is unreliable)")
	require.Less(t, b, 10, "the pool still holds %d of %d jobs refused late more than a second ago: the owed list grows with the load while the key is busy", b, a)
}

// TestReviewHOCloseWithPile: the steady load of TestReviewHOSteadyPileUp,
// then Close at once. Close gives back the owed held bookings, one Redis
// round trip each, in turn (each giving nothing back: their ends have
// passed): it should not take much longer than the same pool's Close
// after the same load with no late refusals (control, same run).
// Variants: Redis up (40 ms replies); Redis paused (SIGSTOP of a private
// server) just before Close, where each give-back waits out its second
// (Close is cut off after 8 s, then Redis resumed and Close waited for);
// Redis killed just before Close (connections refused: fast).
func TestReviewHOCloseWithPile(t *testing.T) {
	t.Parallel()
	for _, redis := range []string{"up", "paused", "killed"} {
		t.Run(redis, func(t *testing.T) {
			var took [2]time.Duration
			var lates [2]int
			for i, lateEvery := range []int{1 << 30, 3} { // control first
				srv := redistest.Shared(t)
				if redis != "up" {
					srv = redistest.Start(t)
				}
				r := newHORig(t, srv, fmt.Sprintf("close%d", i), []throttle.Limit{throttle.PerSecond(2000, 400)}, []throttle.Option{throttle.WithTimeout(time.Second)})
				p, err := pool.New(r.lim, pool.WithWorkers(32))
				require.NoError(t, err)
				r.proxy.SetReplyDelay(40 * time.Millisecond)
				var l hoLoader
				l.load(t, p, []string{"k"}, 2*time.Second, 5*time.Millisecond, lateEvery, 65*time.Millisecond, false)
				switch redis {
				case "paused":
					require.NoError(t, syscall.Kill(srv.Pid(), syscall.SIGSTOP))
				case "killed":
					srv.Stop()
				}
				t0 := time.Now()
				ctx, cancel := context.WithTimeout(context.Background(), 8*time.Second)
				cerr := p.Close(ctx)
				cancel()
				took[i] = time.Since(t0)
				if redis == "paused" {
					require.NoError(t, syscall.Kill(srv.Pid(), syscall.SIGCONT))
				}
				if cerr != nil {
					ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
					require.NoError(t, p.Close(ctx), "Close never returned")
					cancel()
				}
				_, lates[i], _ = l.check(t, time.Millisecond/2, false)
				t.Logf("late every %d: %d jobs, %d refused late and held; Close took %v (%v); refunds %d", lateEvery, len(l.outs), lates[i], took[i], cerr, r.obs.refunds.Load())
			}
			if lates[1] < 20 {
				t.Skipf("only %d late refusals: inconclusive", lates[1])
			}
			// One give-back may be left at Close (a late refusal after the
			// key's last started job), and with Redis paused it waits out
			// its second; so may a booking call in flight at Close, which
			// waits out the engine's timeout (a second) before the
			// give-back goes (a CI run saw 2.02 s against 18.9 ms, where
			// the bound was 2 s). A pile would wait one second each, and
			// be cut off at 8 s (helper-86 saw 1m24s for 84 before 6742447
			// and the give-back's stop at a failed top).
			//
			// With Redis paused that is the documented limit (Pool.Close:
			// a second per booking given back while Redis does not
			// answer; a give-back that fails does not stop the ones under
			// it, see giveBack): whenever more than a few owed bookings
			// stand free of wanted ones at Close, the paused variant waits
			// them out (a busy full suite: 8 s, cut off). There it is
			// logged, and fails only under the build tag
			// slotbook_known_limits.
			if redis == "paused" && !knownLimits && took[1] >= took[0]+3*time.Second {
				t.Logf("known limit: Close took %v with %d late refusals owed (cut off at 8 s), %v without, while Redis was paused", took[1], lates[1], took[0])
				return
			}
			require.Less(t, took[1], took[0]+3*time.Second, "Close took %v with %d late refusals owed (cut off at 8 s), %v without", took[1], lates[1], took[0])
		})
	}
}

// tat reads the first limit's TAT of key straight from Redis (the next
// slot, with no burst), or now if the key is idle.
func (r *hoRig) tat(t *testing.T, key string) time.Time {
	v, err := r.srv.Client(t).Get(context.Background(), redistest.Prefix(t)+r.keys(key)[0]).Int64()
	if err != nil || time.UnixMicro(v).Before(time.Now()) {
		return time.Now()
	}
	return time.UnixMicro(v)
}

// TestReviewHOSaturatedMix: a saturated key (I = 20 ms, no burst), 40 ms
// replies, a seeded mix for 3 s: plain jobs; jobs whose deadline lies a
// little after their likely slot (the key's TAT read from Redis plus a few
// intervals), so that some are booked, some refused by Redis and some
// refused late and held, handed down or owed; jobs cancelled at a random
// moment. Then Close, with slots booked ahead. Oracle on the Redis clock:
// every job that ran started no earlier than its slot; no two ran closer
// than I (textbook GCRA, no burst: nothing given back twice); and a probe
// straight to Redis after Close lands at max(last slot run + I, now),
// give or take one interval above (a cancelled job's booking whose slot
// came unused is not given back): nothing left booked (wasted) above the
// jobs that ran. Variants: plain; layered (a second, looser limit with a
// burst); WithLease; latency both ways.
func TestReviewHOSaturatedMix(t *testing.T) {
	t.Parallel()
	const I = 20 * time.Millisecond
	for _, tc := range []struct {
		name    string
		limits  []throttle.Limit
		lease   bool
		latency bool
	}{
		{"plain", []throttle.Limit{throttle.Every(I, 1, 0)}, false, false},
		{"layered", []throttle.Limit{throttle.Every(I, 1, 0), throttle.Every(I/2, 1, 300)}, false, false},
		{"lease", []throttle.Limit{throttle.Every(I, 1, 0)}, true, false},
		{"bothways", []throttle.Limit{throttle.Every(I, 1, 0)}, false, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			seed := uint64(time.Now().UnixNano())
			t.Logf("seed %d", seed)
			rng := rand.New(rand.NewPCG(seed, 86))
			r := newHORig(t, redistest.Shared(t), "mix", tc.limits, nil)
			opts := []pool.Option{pool.WithWorkers(8)}
			if tc.lease {
				sem, err := lease.New(r.probe, "mixlease", 6, lease.WithTTL(30*time.Second))
				require.NoError(t, err)
				defer func() { _ = sem.Close(context.Background()) }()
				opts = append(opts, pool.WithLease(sem))
			}
			p, err := pool.New(r.lim, opts...)
			require.NoError(t, err)
			if tc.latency {
				r.proxy.SetLatency(20 * time.Millisecond)
			} else {
				r.proxy.SetReplyDelay(40 * time.Millisecond)
			}
			var l hoLoader
			end := time.Now().Add(3 * time.Second)
			for time.Now().Before(end) {
				ctx := context.Background()
				late := false
				switch x := rng.IntN(10); {
				case x < 4: // a deadline near its likely slot
					est := r.tat(t, "k").Add(time.Duration(rng.IntN(8)) * I)
					c, cancel := context.WithDeadline(ctx, est.Add(time.Duration(rng.IntN(60))*time.Millisecond))
					t.Cleanup(cancel)
					ctx, late = c, true
				case x < 5: // cancelled at a random moment
					c, cancel := context.WithCancel(ctx)
					time.AfterFunc(time.Duration(rng.IntN(400))*time.Millisecond, cancel)
					t.Cleanup(cancel)
					ctx = c
				}
				l.submit(t, p, ctx, "k", late, false)
				time.Sleep(time.Duration(10+rng.IntN(10)) * time.Millisecond)
			}
			// Replies at once from now on, so that Close's give-backs land
			// before the slots booked ahead come, and the probe can tell.
			r.proxy.SetLatency(0)
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			require.NoError(t, p.Close(ctx))
			ran, late, last := l.check(t, I, true)
			b := r.probeBook(t, "k")
			now := time.Now()
			t.Logf("%d jobs, ran %d, late held %d; refunds %d (gave room %d); probe at last+%v (now+%v); errors %v",
				len(l.outs), ran, late, r.obs.refunds.Load(), r.obs.given.Load(), b.At.Sub(last), b.At.Sub(now), l.errs())
			require.False(t, b.At.Before(last.Add(I)), "the probe landed %v after the last slot that ran: room given back twice", b.At.Sub(last))
			want := last.Add(I)
			if want.Before(now) {
				want = now
			}
			// Slots of jobs Close ended that came while it waited for a
			// booking call in flight (40 ms) are not given back: a margin.
			require.False(t, b.At.After(want.Add(I+60*time.Millisecond)), "the probe landed %v after textbook GCRA's slot (last ran + I, or now): room left booked, wasted", b.At.Sub(want))
		})
	}
}
