package slotbook_test

// Review (helper E42, prefix TestReviewCH): two recent changes, through the
// public API.
//
//  1. pool (09df90d, since reverted): once a Pool is closed, a give-back
//     that gets no answer within its one-second bound stops the remaining
//     give-backs of its batch (left to lapse).
//  2. asynqadapter (bad239c): the attempts of one key in one process make
//     their BookRetry calls side by side (no per-key queueing).
//
// Oracles: a textbook GCRA replay, on the Redis clock, of the slots that
// actually ran (a key must never hold less than that: room given back that
// someone stood on; and should not hold more once Close has given back
// what did not run: room lost), against a control run in the same test;
// for asynq, each task runs once, at or after the slot it was sent back
// for, and the starts replayed through a textbook GCRA conform, allowing
// the one interval of hand-over lateness the package documents (late).
//
// Findings: the closed pool's rule of 09df90d lost room (on a Cluster, one
// hung master stopped the give-backs to the healthy ones:
// TestReviewCHPoolCloseHungNodeStopsHealthyNodes; replies of 1.2 s, or a
// dial within the give-back's second, counted as "no answer") and did not
// even bound Close (its test, err != nil && ctx.Err() != nil, missed
// give-backs cut by the socket deadline before the context's timer). The
// rule was reverted: the tests here pass. The slow-reply and dial tests
// fail with or without the rule (a give-back has one second, dial
// included): they are kept in review_changes42_limits_test.go, behind a
// build tag, as known limits.
// Nothing found given back twice or under a slot acted on, and nothing
// wrong in the asynqadapter change.

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/slotbook/slotbook/asynqadapter"
	"github.com/slotbook/slotbook/internal/redistest"
	"github.com/slotbook/slotbook/lease"
	"github.com/slotbook/slotbook/pool"
	"github.com/slotbook/slotbook/reserve"
	"github.com/slotbook/slotbook/throttle"
)

// chRan returns the bookings of the jobs that ran (their function was
// called), as GCRA events on the Redis clock.
func chRan(jobs []*pool.Job, ran []*atomic.Bool) []gcraEvent {
	var ev []gcraEvent
	for i, j := range jobs {
		<-j.Done()
		if !ran[i].Load() {
			continue
		}
		b := j.Reservation().Booking()
		ev = append(ev, gcraEvent{name: fmt.Sprintf("job%d", i), at: b.At.UnixMicro(), n: b.N})
	}
	return ev
}

// chRaw holds one direct client per test env (awEnv's, closed by its
// closeAll), for reading keys (awEnv's tat opens a client per call, too
// many when polled).
var chRaw sync.Map // *awEnv -> *redis.Client

// chTat is awEnv.tat on one client per env: key's stored TAT (µs on the
// Redis clock; 0 if absent) and the Redis clock now.
func chTat(t *testing.T, e *awEnv, key string) (tat, now int64) {
	t.Helper()
	v, ok := chRaw.Load(e)
	if !ok {
		v, _ = chRaw.LoadOrStore(e, e.raw())
		t.Cleanup(func() { chRaw.Delete(e) })
	}
	c := v.(*redis.Client)
	ctx := context.Background()
	tm, err := c.Time(ctx).Result()
	require.NoError(t, err)
	n, err := c.Get(ctx, e.prefix+key).Int64()
	if errors.Is(err, redis.Nil) {
		return 0, tm.UnixMicro()
	}
	require.NoError(t, err)
	return n, tm.UnixMicro()
}

// chSubmit submits n jobs of key that record whether they ran.
func chSubmit(t *testing.T, p *pool.Pool, key string, n int, fn func(context.Context) error) ([]*pool.Job, []*atomic.Bool) {
	t.Helper()
	var jobs []*pool.Job
	var ran []*atomic.Bool
	for range n {
		r := new(atomic.Bool)
		j, err := p.Submit(context.Background(), key, func(ctx context.Context) error {
			r.Store(true)
			if fn != nil {
				return fn(ctx)
			}
			return nil
		})
		require.NoError(t, err)
		jobs = append(jobs, j)
		ran = append(ran, r)
	}
	return jobs, ran
}

// --- 1. pool: Close stops giving back at the first give-back that spends its second ---

// chScene is a Close of a Pool through a proxy that slows Redis down.
type chScene struct {
	name     string
	reply    time.Duration // SetReplyDelay
	latency  time.Duration // SetLatency (each way)
	inFlight bool          // a booking call of another key in flight at Close
	oneIdle  bool          // the client keeps one idle connection (MaxIdleConns 1)
}

// chSlowClose runs sc: a Pool (engine timeout 3 s, so that every call is
// answered within it) books 4 jobs of key a, one a limit interval (5 s)
// apart; the first runs; with sc.inFlight a booking call of key b is in
// flight; the pool closes. It returns the room key a holds beyond a
// textbook replay of the jobs that ran (µs), checking that it holds no
// less.
func chSlowClose(t *testing.T, si int, sc chScene) int64 {
	t.Helper()
	limit := throttle.Every(5*time.Second, 1, 0) // the booked jobs stay ahead, the key does not lapse
	e := newAwEnv(t)
	proxy := redistest.NewProxy(t, e.srv.Addr)
	defer proxy.Close()
	defer e.closeAll()
	var tweak []func(*redis.Options)
	if sc.oneIdle {
		tweak = append(tweak, func(o *redis.Options) { o.MaxIdleConns = 1 })
	}
	eng, err := throttle.New(e.client(proxy.Addr(), tweak...), throttle.WithPrefix(e.prefix), throttle.WithTimeout(3*time.Second))
	require.NoError(t, err)
	redistest.UntilOK(t, func() error { return eng.Load(context.Background()) })
	lim, err := reserve.New(eng, fmt.Sprintf("ch%d", si), limit)
	require.NoError(t, err)
	p, err := pool.New(lim, pool.WithWorkers(16)) // books again while few are booked
	require.NoError(t, err)
	// A connection of the engine's, open before Redis slows down (a fresh
	// one's handshake would take round trips of its own).
	_, err = lim.Allow(context.Background(), "warm")
	require.NoError(t, err)
	proxy.SetReplyDelay(sc.reply)
	if sc.latency > 0 {
		proxy.SetLatency(sc.latency)
	}
	keyA := lim.Name() + ":{a}"
	jobs, ran := chSubmit(t, p, "a", 4, nil)
	if !assert.Eventually(t, func() bool { return ran[0].Load() }, 10*time.Second, 2*time.Millisecond, "%s: the first job ran", sc.name) {
		for i, j := range jobs {
			t.Logf("job %d: %v", i, j.Err())
		}
		t.FailNow()
	}
	// Every job booked: the key's TAT some 4 intervals ahead.
	require.Eventually(t, func() bool {
		tat, now := chTat(t, e, keyA)
		return tat-now > 7*limit.Interval().Microseconds()/2
	}, 10*time.Second, 2*time.Millisecond, "%s: every job booked", sc.name)
	tatBooked, _ := chTat(t, e, keyA)
	if sc.inFlight {
		_, _ = chSubmit(t, p, "b", 1, nil)
		// The call has reached Redis (its reply is held).
		require.Eventually(t, func() bool { tat, _ := chTat(t, e, lim.Name()+":{b}"); return tat > 0 }, 5*time.Second, time.Millisecond)
	}
	c, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	var cerr error
	d := timed(func() { cerr = p.Close(c) })
	cancel()
	require.NoError(t, cerr, sc.name)
	for i, j := range jobs[1:] {
		select {
		case <-j.Done():
		default:
			t.Errorf("%s: job %d not done after Close", sc.name, i+1)
			continue
		}
		assert.ErrorIs(t, j.Err(), pool.ErrClosed, "%s: job %d booked ahead at Close (ran %v)", sc.name, i+1, ran[i+1].Load())
	}
	want := gcraTAT(chRan(jobs, ran), limit.Interval())
	// A give-back whose reply was lost has run in Redis by now.
	time.Sleep(100 * time.Millisecond)
	got, _ := chTat(t, e, keyA)
	t.Logf("%s: Close took %v; key a holds %v beyond the replay of the jobs that ran (%d intervals; %d with every job booked)",
		sc.name, d, time.Duration(got-want)*time.Microsecond, (got-want)/limit.Interval().Microseconds(),
		(tatBooked-want)/limit.Interval().Microseconds())
	assert.GreaterOrEqual(t, got, want, "%s: key a holds less than the jobs that ran: room given back under them", sc.name)
	return got - want
}

// TestReviewCHPoolCloseSlowRedisControls (passes): Close with Redis healthy,
// 40 ms of latency each way (a call of another key in flight), and replies
// held 600 ms: every booking that did not run is given back.
func TestReviewCHPoolCloseSlowRedisControls(t *testing.T) {
	for i, sc := range []chScene{
		{name: "healthy", inFlight: true},
		{name: "40ms latency each way, call in flight", latency: 20 * time.Millisecond, inFlight: true},
		{name: "600ms replies", reply: 600 * time.Millisecond},
	} {
		lost := chSlowClose(t, i, sc)
		assert.Zero(t, lost, "%s: Close left %v of key a's room unreturned", sc.name, time.Duration(lost)*time.Microsecond)
	}
}

// TestReviewCHPoolCloseHungNodeStopsHealthyNodes (FAILS): a Pool over a Redis
// Cluster, keys on two masters; master 0 hangs (CLIENT PAUSE ALL) while
// the pool closes. The first give-back, to master 0 (its booking is the
// latest), spends its second, and Close drops the rest of the batch: the
// give-backs to master 1, which answers at once, among them. Measured: the
// room the key on master 1 keeps beyond a textbook replay of its jobs that
// ran, against a control close with no master hung.
func TestReviewCHPoolCloseHungNodeStopsHealthyNodes(t *testing.T) {
	e := newCL(t)
	eng := e.engine(t, e.cc, throttle.WithTimeout(2*time.Second))
	limit := throttle.Every(5*time.Second, 1, 0) // the keys do not lapse during the test
	lost := map[bool]int64{}
	for _, hang := range []bool{false, true} {
		name := "chc" + map[bool]string{false: "ctl", true: "hung"}[hang]
		lim, err := reserve.New(eng, name, limit)
		require.NoError(t, err)
		hung := e.subjectsOn(t, name, "h", 0, 1)[0]
		well := e.subjectsOn(t, name, "w", 1, 1)[0]
		p, err := pool.New(lim, pool.WithWorkers(10))
		require.NoError(t, err)
		wj, wr := chSubmit(t, p, well, 3, nil) // slots +0, +5, +10 s
		hj, hr := chSubmit(t, p, hung, 5, nil) // slots +0 .. +20 s: the latest
		require.Eventually(t, func() bool { return wr[0].Load() && hr[0].Load() }, 10*time.Second, 2*time.Millisecond)
		wellKey := e.prefix + lim.Name() + ":{" + well + "}"
		hungKey := e.prefix + lim.Name() + ":{" + hung + "}"
		// Every job booked: each key's TAT is its first slot (the first
		// job's, which ran) plus one interval per job, on the Redis clock.
		// (Against the wall clock plus 12 and 22 s, a busy suite that took
		// over 3 s to book them failed here.)
		wellFull := wj[0].Reservation().Booking().At.Add(3 * limit.Interval()).UnixMicro()
		hungFull := hj[0].Reservation().Booking().At.Add(5 * limit.Interval()).UnixMicro()
		require.Eventually(t, func() bool {
			return e.tatOf(t, 1, wellKey) >= wellFull && e.tatOf(t, 0, hungKey) >= hungFull
		}, 30*time.Second, time.Millisecond, "every job booked")
		if hang {
			e.clientPause(t, 0, 2500*time.Millisecond)
		}
		c, cancel := context.WithTimeout(context.Background(), 20*time.Second)
		var cerr error
		d := timed(func() { cerr = p.Close(c) })
		cancel()
		require.NoError(t, cerr)
		want := gcraTAT(chRan(wj, wr), limit.Interval())
		got := e.tatOf(t, 1, wellKey)
		lost[hang] = got - want
		t.Logf("hung master 0: %v: Close took %v; the key on master 1 holds %v beyond the replay of its jobs that ran (hung key: %d of 5 jobs ran)",
			hang, d, time.Duration(got-want)*time.Microsecond, len(chRan(hj, hr)))
		assert.GreaterOrEqual(t, got, want, "room given back under a job that ran")
		if hang {
			time.Sleep(3 * time.Second) // the pause ends
		}
	}
	assert.LessOrEqual(t, lost[true], lost[false],
		"master 0 hung: Close left %v of room unreturned on master 1, which answered every call (control: %v)",
		time.Duration(lost[true])*time.Microsecond, time.Duration(lost[false])*time.Microsecond)
}

// chTATs reads each limit's key of subject (reserve's names: the first
// "name:{subject}", the others with ":<period in ms>ms").
func chTATs(t *testing.T, e *awEnv, lim *reserve.Limiter, subject string) []int64 {
	t.Helper()
	var out []int64
	for i, l := range lim.Limits() {
		k := lim.Name() + ":{" + subject + "}"
		if i > 0 {
			k += fmt.Sprintf(":%dms", l.Period.Milliseconds())
		}
		tat, _ := chTat(t, e, k)
		out = append(out, tat)
	}
	return out
}

// TestReviewCHPoolClosePausedNoOverGive: Redis stopped (SIGSTOP) while the
// pool closes, an engine timeout of 2 s (so that a give-back's second runs
// out first and the rule stops the rest). On the key: an Acquire caller
// that acted (its worker still held), a job running (blocked until after
// Close), jobs booked ahead, an Acquire caller sleeping until its slot,
// and a job of a second key whose booking call is in flight. Close with a
// 300 ms ctx returns its error; Close again waits. Once Redis is back (and
// the refunds sent into the pause have run): every limit's key holds at
// least a textbook replay of the slots acted on (the caller's and the
// running job's), the sleeping caller got ErrClosed, the booked jobs
// ErrClosed, the running one its own result, and no goroutine is left.
// Plain, layered (reserve.WithLimit) and WithLease.
func TestReviewCHPoolClosePausedNoOverGive(t *testing.T) {
	for _, mode := range []string{"plain", "layered", "lease"} {
		t.Run(mode, func(t *testing.T) {
			e := newAwEnv(t)
			eng := e.engine(t, e.srv.Addr, 2*time.Second)
			base := goroutines()
			ctx := context.Background()
			var opts []reserve.Option
			if mode == "layered" {
				opts = append(opts, reserve.WithLimit(throttle.PerMinute(20, 3))) // I = 3 s
			}
			limit := throttle.Every(2*time.Second, 1, 0)
			lim, err := reserve.New(eng, "chp"+mode, limit, opts...)
			require.NoError(t, err)
			var popts []pool.Option
			var sem *lease.Semaphore
			if mode == "lease" {
				sem, err = lease.New(eng, "chp"+mode, 10)
				require.NoError(t, err)
				popts = append(popts, pool.WithLease(sem))
			}
			p, err := pool.New(lim, append(popts, pool.WithWorkers(12))...)
			require.NoError(t, err)

			// An Acquire caller that acts at once (a fresh key).
			rel, err := p.Acquire(ctx, "k")
			require.NoError(t, err)
			first := chTATs(t, e, lim, "k")
			callerAt := first[0] - limit.Interval().Microseconds() // its slot: the key was fresh
			// A job that runs next, blocked until released; jobs booked
			// ahead of it.
			unblock := make(chan struct{})
			runJ, runR := chSubmit(t, p, "k", 1, func(context.Context) error { <-unblock; return nil })
			require.Eventually(t, func() bool { // booked first (with leases, jobs book in any order)
				tat, _ := chTat(t, e, lim.Name()+":{k}")
				return tat >= callerAt+2*limit.Interval().Microseconds()
			}, 10*time.Second, time.Millisecond, "the job to block booked")
			aheadJ, aheadR := chSubmit(t, p, "k", 3, nil)
			require.Eventually(t, func() bool { return runR[0].Load() }, 10*time.Second, time.Millisecond, "the blocked job runs")
			setup := time.Now()
			require.Eventually(t, func() bool {
				tat, _ := chTat(t, e, lim.Name()+":{k}")
				return tat >= callerAt+5*limit.Interval().Microseconds()
			}, 10*time.Second, time.Millisecond, "jobs booked ahead")
			t.Logf("%s: jobs booked ahead %v after the blocked job ran", mode, time.Since(setup))
			// An Acquire caller sleeping until its slot.
			before := chTATs(t, e, lim, "k")[0]
			sleeper := make(chan error, 1)
			go func() {
				rel, err := p.Acquire(ctx, "k")
				if rel != nil {
					rel()
				}
				sleeper <- err
			}()
			setup = time.Now()
			require.Eventually(t, func() bool { return chTATs(t, e, lim, "k")[0] > before }, 10*time.Second, time.Millisecond, "the sleeping caller booked")
			t.Logf("%s: the sleeping caller booked %v after it called", mode, time.Since(setup))
			t.Logf("%s: SIGSTOP at +%v from the caller's slot", mode, time.Since(time.UnixMicro(callerAt)))
			require.NoError(t, syscall.Kill(e.srv.Pid(), syscall.SIGSTOP))
			paused := true
			defer func() {
				if paused {
					_ = syscall.Kill(e.srv.Pid(), syscall.SIGCONT)
				}
			}()
			// A booking call of another key in flight into the pause.
			otherJ, otherR := chSubmit(t, p, "k2", 1, nil)
			time.Sleep(50 * time.Millisecond)
			t.Logf("%s: Close at +%v from the caller's slot", mode, time.Since(time.UnixMicro(callerAt)))
			short, cancel := context.WithTimeout(ctx, 300*time.Millisecond)
			closeAt := time.Now()
			err = p.Close(short)
			cancel()
			assert.ErrorIs(t, err, context.DeadlineExceeded, "Close with a running job and Redis paused, 300 ms ctx")
			closed := make(chan error, 1)
			tookC := make(chan time.Duration, 1)
			go func() {
				c, cancel := context.WithTimeout(ctx, 30*time.Second)
				defer cancel()
				tookC <- timed(func() { closed <- p.Close(c) })
			}()
			time.Sleep(1500 * time.Millisecond)
			close(unblock) // the running job returns
			var cerr error
			select {
			case cerr = <-closed:
			case <-time.After(20 * time.Second):
				t.Fatal("Close did not return 20 s after the running job did, Redis paused")
			}
			require.NoError(t, syscall.Kill(e.srv.Pid(), syscall.SIGCONT))
			paused = false
			assert.NoError(t, cerr, "second Close")
			took := <-tookC
			t.Logf("%s: second Close returned %v after it began (the running job returned after 1.5 s)", mode, took)
			assert.ErrorIs(t, <-sleeper, pool.ErrClosed, "the sleeping Acquire caller")
			assert.NoError(t, runJ[0].Err(), "the running job")
			for i, j := range aheadJ {
				if aheadR[i].Load() {
					t.Logf("%s: job %d booked ahead ran, started %v after Close began (slot %v after), err %v", mode, i, j.Started().Sub(closeAt), j.Slot().Sub(closeAt), j.Err())
					continue
				}
				assert.ErrorIs(t, j.Err(), pool.ErrClosed, "job %d booked ahead", i)
			}
			<-otherJ[0].Done()
			t.Logf("%s: the job whose call flew into the pause: ran %v, %v", mode, otherR[0].Load(), otherJ[0].Err())
			rel()
			rel()
			// What was sent into the pause has run by now.
			redistest.UntilOK(t, func() error { _, err := lim.State(ctx, "k"); return err })
			time.Sleep(200 * time.Millisecond)
			acted := []gcraEvent{{name: "caller", at: callerAt, n: 1}}
			acted = append(acted, chRan(runJ, runR)...)
			acted = append(acted, chRan(aheadJ, aheadR)...)
			got := chTATs(t, e, lim, "k")
			_, now := chTat(t, e, lim.Name()+":{k}")
			for i, l := range lim.Limits() {
				want := gcraTAT(acted, l.Interval())
				t.Logf("%s: limit %v: the key holds %v beyond the replay of the slots acted on (now %v past the replay)", mode, l, time.Duration(got[i]-want)*time.Microsecond, time.Duration(now-want)*time.Microsecond)
				// A TAT behind Redis's now is now: once the replay's has
				// passed too (a slow Close on a busy machine), the key has
				// rightly expired, and holds nothing (s5, stop 48: read
				// 7.5 s after the replay's TAT, the key gone).
				assert.GreaterOrEqual(t, max(got[i], now), max(want, now), "%s: limit %v: room given back under a slot acted on", mode, l)
			}
			if sem != nil {
				c, cancel := context.WithTimeout(ctx, 10*time.Second)
				assert.NoError(t, sem.Close(c))
				cancel()
			}
			e.closeAll()
			settled(t, base, 2, mode+": pool closed with Redis paused")
		})
	}
}

// TestReviewCHPoolCloseRacesCancel: Redis healthy; jobs booked ahead (and
// an Acquire caller sleeping until its slot) whose contexts end at random
// moments around Close, Close itself called twice. Every time: nothing
// given back under the jobs that ran (the key holds at least their
// textbook replay) and, Redis answering at once, nothing lost (exactly
// it). Seeded; the seed is logged.
func TestReviewCHPoolCloseRacesCancel(t *testing.T) {
	seed := uint64(time.Now().UnixNano())
	t.Logf("seed %d", seed)
	rng := rand.New(rand.NewPCG(seed, 42))
	e := newAwEnv(t)
	eng := e.engine(t, e.srv.Addr, time.Second)
	base := goroutines()
	limit := throttle.Every(time.Second, 1, 0)
	lim, err := reserve.New(eng, "chr", limit)
	require.NoError(t, err)
	ctx := context.Background()
	for it := range 12 {
		key := fmt.Sprintf("k%d", it)
		p, err := pool.New(lim, pool.WithWorkers(16))
		require.NoError(t, err)
		const n = 6
		var (
			jobs    []*pool.Job
			ran     []*atomic.Bool
			cancels []context.CancelFunc
		)
		for range n {
			c, cancel := context.WithCancel(ctx)
			r := new(atomic.Bool)
			j, err := p.Submit(c, key, func(context.Context) error { r.Store(true); time.Sleep(5 * time.Millisecond); return nil })
			require.NoError(t, err)
			jobs, ran, cancels = append(jobs, j), append(ran, r), append(cancels, cancel)
		}
		require.Eventually(t, func() bool {
			tat, now := chTat(t, e, lim.Name()+":{"+key+"}")
			return tat-now > (n-1)*limit.Interval().Microseconds()
		}, 10*time.Second, time.Millisecond)
		cctx, ccancel := context.WithCancel(ctx)
		sleeper := make(chan error, 1)
		go func() {
			rel, err := p.Acquire(cctx, key)
			if rel != nil {
				rel()
			}
			sleeper <- err
		}()
		time.Sleep(time.Duration(rng.IntN(5)) * time.Millisecond)
		var wg sync.WaitGroup
		for i := range n {
			if rng.IntN(2) == 0 {
				d := time.Duration(rng.IntN(4000)) * time.Microsecond
				wg.Go(func() { time.Sleep(d); cancels[i]() })
			}
		}
		d := time.Duration(rng.IntN(4000)) * time.Microsecond
		wg.Go(func() { time.Sleep(d); ccancel() })
		time.Sleep(time.Duration(rng.IntN(3000)) * time.Microsecond)
		for range 2 {
			wg.Go(func() {
				c, cancel := context.WithTimeout(ctx, 10*time.Second)
				defer cancel()
				assert.NoError(t, p.Close(c))
			})
		}
		wg.Wait()
		serr := <-sleeper
		assert.True(t, errors.Is(serr, pool.ErrClosed) || errors.Is(serr, context.Canceled) || serr == nil, "the sleeping caller: %v", serr)
		want := gcraTAT(chRan(jobs, ran), limit.Interval())
		got, _ := chTat(t, e, lim.Name()+":{"+key+"}")
		if serr == nil {
			t.Logf("iteration %d: the caller acted (a slot handed down to it?)", it)
			assert.GreaterOrEqual(t, got, want, "iteration %d: room given back under a job that ran", it)
		} else {
			assert.Equal(t, want, got, "iteration %d: the key against the replay of the jobs that ran (%v beyond it; jobs ran: %v; caller %v)",
				it, time.Duration(got-want)*time.Microsecond, chRanNames(ran), serr)
		}
		for _, c := range cancels {
			c()
		}
	}
	e.closeAll()
	settled(t, base, 2, "pools closed racing cancellations")
}

// chRanNames lists which jobs ran.
func chRanNames(ran []*atomic.Bool) []int {
	var out []int
	for i, r := range ran {
		if r.Load() {
			out = append(out, i)
		}
	}
	return out
}

// --- 2. asynqadapter: booked retries, one key's calls side by side ---

// chConform replays starts (µs, any order) through a textbook GCRA of limit
// in which each start may have had its slot up to slack before it (the one
// interval a recalled task may start late, see asynqadapter's late, plus a
// little scheduling): each start takes the earliest slot in
// [start-slack, start] that conforms (slot >= TAT - tau), TAT = max(TAT,
// slot) + I. It describes every start for which none does.
func chConform(starts []int64, limit throttle.Limit, slack time.Duration) []string {
	ss := slices.Clone(starts)
	slices.Sort(ss)
	I := limit.Interval().Microseconds()
	tau := I * int64(limit.Burst)
	sl := slack.Microseconds()
	var bad []string
	var tat int64
	for k, st := range ss {
		slot := st - sl
		if k > 0 {
			slot = max(slot, tat-tau)
		}
		if slot > st {
			bad = append(bad, fmt.Sprintf("start %d at +%v: %v before any conforming slot (TAT %+v)", k,
				time.Duration(st-ss[0])*time.Microsecond, time.Duration(slot-st)*time.Microsecond, time.Duration(tat-ss[0])*time.Microsecond))
			slot = st
		}
		if k == 0 {
			tat = slot + I
		} else {
			tat = max(tat, slot) + I
		}
	}
	return bad
}

// chTasks is what the asynq tests record.
type chTasks struct {
	idx     *redis.Client // reads the booked-retry index (the Redis-clock slots)
	idxKey  string
	mu      sync.Mutex
	ats     map[string][]int64     // task id -> the slots of its index entries on the Redis clock (µs)
	starts  map[string][]int64     // task id -> handler starts (µs)
	runs    map[string][]chRun     // task id -> handler starts, with their deliveries
	got     map[string]time.Time   // task id -> its latest delivery to the middleware
	slots   map[string][]time.Time // task id -> slots its refusals were sent back for
	archive map[string]string      // task id -> the refusal that archived it (SkipRetry)
}

// chRun is a handler start and the delivery it followed, both local
// times with monotonic readings.
type chRun struct {
	got, started time.Time
}

func newCHTasks(idx *redis.Client, idxKey string) *chTasks {
	return &chTasks{idx: idx, idxKey: idxKey, ats: map[string][]int64{},
		starts: map[string][]int64{}, runs: map[string][]chRun{}, got: map[string]time.Time{},
		slots: map[string][]time.Time{}, archive: map[string]string{}}
}

// delivery is a middleware, put before the limiter's, that times each
// delivery of a task as it reaches the limiter's middleware.
func (c *chTasks) delivery(next asynq.Handler) asynq.Handler {
	return asynq.HandlerFunc(func(ctx context.Context, task *asynq.Task) error {
		id, _ := asynq.GetTaskID(ctx)
		c.mu.Lock()
		c.got[id] = time.Now()
		c.mu.Unlock()
		return next.ProcessTask(ctx, task)
	})
}

func (c *chTasks) handler(hold time.Duration) asynq.HandlerFunc {
	return func(ctx context.Context, _ *asynq.Task) error {
		started := time.Now()
		now := started.UnixMicro()
		id, _ := asynq.GetTaskID(ctx)
		c.mu.Lock()
		c.starts[id] = append(c.starts[id], now)
		c.runs[id] = append(c.runs[id], chRun{got: c.got[id], started: started})
		c.mu.Unlock()
		time.Sleep(hold)
		return nil
	}
}

func (c *chTasks) errorHandler() asynq.ErrorHandler {
	return asynq.ErrorHandlerFunc(func(ctx context.Context, _ *asynq.Task, err error) {
		id, _ := asynq.GetTaskID(ctx)
		var rl *asynqadapter.RateLimitedError
		if !errors.As(err, &rl) {
			return
		}
		var at int64
		if !rl.Slot.IsZero() && !errors.Is(err, asynq.SkipRetry) {
			// The entry the booking left in the index: its slot on the
			// Redis clock.
			zs, _ := c.idx.ZRangeWithScores(context.Background(), c.idxKey, 0, -1).Result()
			for _, z := range zs {
				if m, _ := z.Member.(string); strings.Contains(m, ":"+id+":") {
					at = int64(z.Score)
				}
			}
		}
		c.mu.Lock()
		defer c.mu.Unlock()
		if !rl.Slot.IsZero() {
			c.slots[id] = append(c.slots[id], rl.Slot)
		}
		if at > 0 {
			c.ats[id] = append(c.ats[id], at)
		}
		if errors.Is(err, asynq.SkipRetry) {
			c.archive[id] = err.Error()
		}
	})
}

// check judges what ran: each task in ids at most once (exactly once
// unless archived), never before the slot its index entry held on the
// Redis clock, and every start together within limit (chConform). How far
// a start came before RateLimitedError.Slot (a local time counted from
// when the booking reply was read) is logged; rtt is not used since.
func (c *chTasks) check(t *testing.T, what string, ids []string, limit throttle.Limit, rtt time.Duration) {
	t.Helper()
	c.mu.Lock()
	defer c.mu.Unlock()
	var all []int64
	booked := 0
	early := time.Duration(0)
	for _, id := range ids {
		st := c.starts[id]
		if _, archived := c.archive[id]; archived {
			assert.Empty(t, st, "%s: task %s archived (%s) yet ran", what, id, c.archive[id])
		} else {
			assert.Len(t, st, 1, "%s: task %s ran %d times", what, id, len(st))
		}
		if len(c.slots[id]) > 0 {
			booked++
		}
		for i, s := range st {
			all = append(all, s)
			start := time.UnixMicro(s)
			run := c.runs[id][i]
			for _, at := range c.ats[id] {
				if at-s > int64(time.Second/time.Microsecond) {
					continue // an entry after this run
				}
				// The middleware sleeps from after the delivery until the
				// slot, a Redis-clock (wall) instant, on the monotonic
				// clock: the start is judged as a monotonic offset from
				// the delivery against the slot's wall-clock offset from
				// it, not as a wall-clock reading, which this VM's wall
				// clock, slewed against the monotonic one (hundreds of µs
				// a second at times), can put before a slot the sleep
				// kept. A start before the slot is still caught.
				assert.GreaterOrEqual(t, run.started.Sub(run.got), time.UnixMicro(at).Sub(run.got.Round(0)),
					"%s: task %s started %v before its booked slot on the Redis clock", what, id, time.Duration(at-s)*time.Microsecond)
			}
			for _, slot := range c.slots[id] {
				if slot.Sub(start) > time.Second {
					continue // sent back after this run (not expected: a task runs once)
				}
				// Logged, not asserted: Slot is local, counted from when the
				// reply was read, which a busy machine makes late (a start
				// 18.9 ms before it, on time by the Redis clock, was seen in
				// a full suite). The Redis clock's check above is the oracle.
				early = max(early, slot.Sub(start))
			}
		}
	}
	slack := limit.Interval() + 15*time.Millisecond
	bad := chConform(all, limit, slack)
	t.Logf("%s: %d tasks, %d starts, %d sent back with a booked slot (%d index entries read), %d archived; starts over %v; earliest start %v before its Slot",
		what, len(ids), len(all), booked, len(c.ats), len(c.archive), time.Duration(slices.Max(all)-slices.Min(all))*time.Microsecond, early)
	assert.Empty(t, bad, "%s: starts beyond %v with %v of hand-over slack", what, limit, slack)
}

// chAsynqServer starts an asynq server of workers on queue with mw and the
// handler, polling as the booked-retry tests do.
func chAsynqServer(t *testing.T, rdb *redis.Client, queue string, workers int, mw asynq.MiddlewareFunc, c *chTasks, hold time.Duration, shutdown time.Duration) *asynq.Server {
	t.Helper()
	srv := asynq.NewServerFromRedisClient(rdb, asynq.Config{
		Concurrency:              workers,
		Queues:                   map[string]int{queue: 1},
		IsFailure:                asynqadapter.IsFailure,
		RetryDelayFunc:           asynqadapter.RetryDelayFunc(nil),
		ErrorHandler:             c.errorHandler(),
		DelayedTaskCheckInterval: time.Second,
		TaskCheckInterval:        50 * time.Millisecond,
		LogLevel:                 asynq.FatalLevel,
		ShutdownTimeout:          shutdown,
	})
	mux := asynq.NewServeMux()
	mux.Use(c.delivery, mw)
	mux.Handle("api:call", c.handler(hold))
	require.NoError(t, srv.Start(mux))
	return srv
}

// chLimiterEngine returns an engine on the shared Redis, through a proxy
// with latency each way (none if 0), and the proxy.
func chLimiterEngine(t *testing.T, prefix string, latency time.Duration) *throttle.Engine {
	t.Helper()
	shared := redistest.Shared(t)
	proxy := redistest.NewProxy(t, shared.Addr)
	rdb := proxy.Client(t, shared)
	eng, err := throttle.New(rdb, throttle.WithPrefix(prefix), throttle.WithTimeout(5*time.Second))
	require.NoError(t, err)
	redistest.UntilOK(t, func() error { return eng.Load(context.Background()) })
	proxy.SetLatency(latency)
	return eng
}

// chWaitDone waits until every task of ids is completed or archived.
func chWaitDone(t *testing.T, insp *asynq.Inspector, queue string, ids []string, within time.Duration) {
	t.Helper()
	end := time.Now().Add(within)
	for {
		left := 0
		for _, id := range ids {
			ti, err := insp.GetTaskInfo(queue, id)
			require.NoError(t, err)
			if ti.State != asynq.TaskStateCompleted && ti.State != asynq.TaskStateArchived {
				left++
			}
		}
		if left == 0 {
			return
		}
		require.True(t, time.Now().Before(end), "%d of %d tasks neither completed nor archived after %v", left, len(ids), within)
		time.Sleep(50 * time.Millisecond)
	}
}

// TestReviewCHAsynqOneKeySideBySide: 48 tasks of one key, taken up at once
// by two in-process asynq servers of 12 workers each (one process, one
// middleware), at 8/s burst 1 with a max wait of 150 ms: most are booked
// ahead and sent back, and come back to recall their bookings side by
// side with the others' calls. Every task runs once, none before the slot
// it was sent back for, and the starts keep to the limit with one
// interval of hand-over slack. On a direct link and on a 40 ms one.
func TestReviewCHAsynqOneKeySideBySide(t *testing.T) {
	shared := redistest.Shared(t)
	shared.RequireReal(t)
	for _, lat := range []time.Duration{0, 20 * time.Millisecond} {
		what := fmt.Sprintf("latency %v each way", lat)
		prefix := redistest.Prefix(t) + fmt.Sprint(lat.Milliseconds()) + ":"
		queue := "q" + prefix
		eng := chLimiterEngine(t, prefix, lat)
		limit := throttle.PerSecond(8, 1)
		lim, err := reserve.New(eng, "tasks", limit, reserve.WithMaxWait(150*time.Millisecond))
		require.NoError(t, err)
		mw, err := asynqadapter.NewMiddleware(lim, asynqadapter.WithBookedRetries(eng, time.Minute), asynqadapter.WithCheckInterval(time.Second))
		require.NoError(t, err)
		c := newCHTasks(shared.Client(t), prefix+"tasks:{api:call}:asynq")
		client := asynq.NewClientFromRedisClient(shared.Client(t))
		var ids []string
		for range 48 {
			info, err := client.Enqueue(asynq.NewTask("api:call", nil), asynq.Queue(queue), asynq.MaxRetry(20),
				asynq.Timeout(time.Minute), asynq.Retention(time.Hour))
			require.NoError(t, err)
			ids = append(ids, info.ID)
		}
		var srvs []*asynq.Server
		for range 2 {
			srvs = append(srvs, chAsynqServer(t, shared.Client(t), queue, 12, mw, c, 0, 5*time.Second))
		}
		insp := asynq.NewInspectorFromRedisClient(shared.Client(t))
		chWaitDone(t, insp, queue, ids, 60*time.Second)
		for _, s := range srvs {
			s.Shutdown()
		}
		c.check(t, what, ids, limit, 2*lat+5*time.Millisecond)
	}
}

// TestReviewCHAsynqInspectorDeadlines: with WithInspector, tasks of one
// key with absolute Deadlines 3 to 8 s away (whole seconds, as asynq keeps
// them), taken up side by side by two in-process servers over a 40 ms link
// to the limiter's Redis. A booking whose reply comes back later than its
// budget assumed (by up to the round trip) has a slot too close to the
// Deadline: its entry is taken out and the booking given back, and the
// task archived; tasks that cannot be booked in time are archived too.
// Archived tasks never run; the others run once, at or after their slots;
// the starts keep to the limit; no index entry is left behind.
func TestReviewCHAsynqInspectorDeadlines(t *testing.T) {
	shared := redistest.Shared(t)
	shared.RequireReal(t)
	prefix := redistest.Prefix(t)
	queue := "q" + prefix
	const lat = 20 * time.Millisecond
	eng := chLimiterEngine(t, prefix, lat)
	limit := throttle.PerSecond(8, 0)
	lim, err := reserve.New(eng, "tasks", limit, reserve.WithMaxWait(150*time.Millisecond))
	require.NoError(t, err)
	insp := asynq.NewInspectorFromRedisClient(shared.Client(t))
	mw, err := asynqadapter.NewMiddleware(lim, asynqadapter.WithBookedRetries(eng, time.Minute),
		asynqadapter.WithCheckInterval(time.Second), asynqadapter.WithInspector(insp))
	require.NoError(t, err)
	idxKey := prefix + "tasks:{api:call}:asynq"
	c := newCHTasks(shared.Client(t), idxKey)
	client := asynq.NewClientFromRedisClient(shared.Client(t))
	var ids []string
	now := time.Now()
	for g := range 6 {
		dl := now.Add(time.Duration(3+g) * time.Second)
		for range 9 {
			info, err := client.Enqueue(asynq.NewTask("api:call", nil), asynq.Queue(queue), asynq.MaxRetry(20),
				asynq.Deadline(dl), asynq.Retention(time.Hour))
			require.NoError(t, err)
			ids = append(ids, info.ID)
		}
	}
	var srvs []*asynq.Server
	for range 2 {
		srvs = append(srvs, chAsynqServer(t, shared.Client(t), queue, 12, mw, c, 0, 5*time.Second))
	}
	chWaitDone(t, insp, queue, ids, 60*time.Second)
	for _, s := range srvs {
		s.Shutdown()
	}
	given := 0
	c.mu.Lock()
	for _, msg := range c.archive {
		if strings.Contains(msg, "slot booked in") {
			given++
		}
	}
	c.mu.Unlock()
	t.Logf("archived after booking (entry taken out, booking given back): %d", given)
	archived := 0
	for _, id := range ids {
		ti, err := insp.GetTaskInfo(queue, id)
		require.NoError(t, err)
		if ti.State == asynq.TaskStateArchived {
			archived++
			c.mu.Lock()
			if _, ok := c.archive[id]; !ok {
				c.archive[id] = "archived: " + ti.LastErr
			}
			c.mu.Unlock()
		}
	}
	t.Logf("%d of %d tasks archived", archived, len(ids))
	c.check(t, "deadlines, 40 ms link", ids, limit, 2*lat+5*time.Millisecond)
	n, err := shared.Client(t).ZCard(context.Background(), idxKey).Result()
	require.NoError(t, err)
	assert.Zero(t, n, "index entries left once every task is done")
}

// TestReviewCHAsynqShutdownWhileSleeping: 36 tasks of one key booked ahead
// (6/s, max wait 200 ms) by two in-process servers; while several sleep in
// their handlers until their recalled slots, server A shuts down with a
// 100 ms ShutdownTimeout: asynq puts them back as the same attempts and
// cancels them; they restore their bookings; server B (and a new server
// A', same process) take them up, side by side with the others' calls.
// Every task runs once, none before its slot on the Redis clock, and the
// starts keep to the limit.
func TestReviewCHAsynqShutdownWhileSleeping(t *testing.T) {
	shared := redistest.Shared(t)
	shared.RequireReal(t)
	prefix := redistest.Prefix(t)
	queue := "q" + prefix
	eng := chLimiterEngine(t, prefix, 0)
	limit := throttle.PerSecond(6, 0)
	lim, err := reserve.New(eng, "tasks", limit, reserve.WithMaxWait(200*time.Millisecond))
	require.NoError(t, err)
	inner, err := asynqadapter.NewMiddleware(lim, asynqadapter.WithBookedRetries(eng, time.Minute), asynqadapter.WithCheckInterval(time.Second))
	require.NoError(t, err)
	var cut atomic.Int64
	mw := func(next asynq.Handler) asynq.Handler {
		h := inner(next)
		return asynq.HandlerFunc(func(ctx context.Context, task *asynq.Task) error {
			err := h.ProcessTask(ctx, task)
			if ctx.Err() != nil && errors.Is(err, ctx.Err()) {
				cut.Add(1)
			}
			return err
		})
	}
	c := newCHTasks(shared.Client(t), prefix+"tasks:{api:call}:asynq")
	client := asynq.NewClientFromRedisClient(shared.Client(t))
	var ids []string
	for range 36 {
		info, err := client.Enqueue(asynq.NewTask("api:call", nil), asynq.Queue(queue), asynq.MaxRetry(20),
			asynq.Timeout(time.Minute), asynq.Retention(time.Hour))
		require.NoError(t, err)
		ids = append(ids, info.ID)
	}
	a := chAsynqServer(t, shared.Client(t), queue, 10, mw, c, 0, 100*time.Millisecond)
	b := chAsynqServer(t, shared.Client(t), queue, 10, mw, c, 0, 5*time.Second)
	time.Sleep(2500 * time.Millisecond) // the first booked tasks are back, sleeping until their slots
	a.Shutdown()
	t.Logf("server A shut down: %d attempts cut short so far", cut.Load())
	a2 := chAsynqServer(t, shared.Client(t), queue, 10, mw, c, 0, 5*time.Second)
	insp := asynq.NewInspectorFromRedisClient(shared.Client(t))
	chWaitDone(t, insp, queue, ids, 60*time.Second)
	a2.Shutdown()
	b.Shutdown()
	t.Logf("%d attempts cut short in all", cut.Load())
	c.check(t, "shutdown while sleeping", ids, limit, 5*time.Millisecond)
}
