package pool_test

// Review of 81b30fe and a28db1e (batches of different keys booked side by
// side, one per key at a time; no give-back of a key while a booking call
// of it is in flight; the dispatcher stays until every call is in)
// through the public API. Room is judged by reviewEnv.check (the key's
// stored TATs against a textbook GCRA of the jobs that ran), timing on the
// Redis clock (Booking().At).

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/slotbook/slotbook/deadline"
	"github.com/slotbook/slotbook/internal/redistest"
	"github.com/slotbook/slotbook/lease"
	"github.com/slotbook/slotbook/pool"
	"github.com/slotbook/slotbook/reserve"
	"github.com/slotbook/slotbook/throttle"
)

// flightsCPU returns the CPU time (user and system) this process has used.
func flightsCPU(t *testing.T) time.Duration {
	t.Helper()
	var ru syscall.Rusage
	require.NoError(t, syscall.Getrusage(syscall.RUSAGE_SELF, &ru))
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// flightsEngine is an engine on the shared Redis through a proxy of its
// own (so that its delays can be set apart from any other engine's).
func flightsEngine(t *testing.T, prefix string) (*throttle.Engine, *redistest.Proxy) {
	t.Helper()
	srv := redistest.Shared(t)
	px := redistest.NewProxy(t, srv.Options().Addr)
	eng, err := throttle.New(px.Client(t, srv), throttle.WithPrefix(prefix), throttle.WithTimeout(5*time.Second))
	require.NoError(t, err)
	require.NoError(t, eng.Load(context.Background()))
	return eng, px
}

// TestReviewFlightsCloseDoesNotSpin: a booking call is in flight (its
// reply held back 900 ms) when the pool is closed. Close must wait for
// it, and it does; but the dispatcher waits by looking again and again:
// once Close has closed quit, its select finds quit ready every time, so
// it loops (taking the lock, sorting the bookings) until the reply is in,
// a core burnt for as long as the call lasts (up to the engine's timeout
// with Redis gone). The control is the same run's CPU over 250 ms with
// the same call in flight before Close.
// Failed before the dispatcher stopped waiting on quit once closed.
func TestReviewFlightsCloseDoesNotSpin(t *testing.T) {
	prefix := redistest.Prefix(t)
	eng, px := flightsEngine(t, prefix)
	lim, err := reserve.New(eng, "spin", reviewLimits[0], reserve.WithLimit(reviewLimits[1]), reserve.WithoutMaxWait())
	require.NoError(t, err)
	p, err := pool.New(lim, pool.WithWorkers(4))
	require.NoError(t, err)
	defer func() { _ = p.Close(context.Background()) }()
	direct := redistest.Shared(t).Client(t)

	px.SetReplyDelay(900 * time.Millisecond)
	j, err := p.Submit(context.Background(), "k", func(context.Context) error { return nil })
	require.NoError(t, err)
	key := prefix + "spin:{k}"
	require.Eventually(t, func() bool { return direct.Exists(context.Background(), key).Val() == 1 },
		2*time.Second, time.Millisecond, "booked in Redis")

	c0, w0 := flightsCPU(t), time.Now()
	time.Sleep(250 * time.Millisecond)
	ctrl, ctrlWall := flightsCPU(t)-c0, time.Since(w0)

	c1, w1 := flightsCPU(t), time.Now()
	require.NoError(t, p.Close(context.Background()))
	used, wall := flightsCPU(t)-c1, time.Since(w1)
	t.Logf("call in flight, open: %v CPU over %v; Close: %v CPU over %v; job: %v", ctrl, ctrlWall, used, wall, j.Err())
	require.Greater(t, wall, 200*time.Millisecond, "Close waited for the call in flight")
	require.Less(t, used, wall/5+2*ctrl, "the dispatcher spun while Close waited for the call in flight")
}

// TestReviewFlightsLeaseBookingDuringGiveBack: WithLease (leases taken
// through an engine whose replies come 100 ms late), bookings 40 ms each
// way. Two jobs of a key are booked (slots 10 s apart after the head); a
// third is submitted (its lease on the way, so no booking call of the key
// is in flight yet), and 50 ms later the two booked jobs are cancelled.
// The dispatcher takes both to give back, latest first, one round trip
// after the other; meanwhile the third job's lease comes and its lease
// goroutine books at once, landing in Redis between the two give-backs.
// The earlier give-back then finds a later booking standing on it and
// gives nothing. Nothing but the head runs (the third job is closed
// before its slot): every room must come back. refundable holds back a
// key's give-backs while a booking call of it is in flight, but nothing
// holds back a lease goroutine's booking while give-backs of its key are
// in flight.
// Failed (3 of 3) before lease goroutines waited for their key's give-backs.
func TestReviewFlightsLeaseBookingDuringGiveBack(t *testing.T) {
	t.Parallel()
	e := newReviewEnv(t, 40*time.Millisecond)
	leng, lpx := flightsEngine(t, redistest.Prefix(t)+"lease:")
	const rounds = 3
	lost := 0
	// during=false is the control: the third job is submitted once the
	// give-backs are in.
	for i := range 2 * rounds {
		during := i >= rounds
		name := fmt.Sprintf("lg%d", i)
		lpx.SetReplyDelay(0)
		sem, err := lease.New(leng, name, 8, lease.WithTTL(30*time.Second))
		require.NoError(t, err)
		p, err := pool.New(e.limiter(t, name), pool.WithWorkers(40), pool.WithLease(sem))
		require.NoError(t, err)
		heads, at := reviewHeads(t, p, []string{"k"})
		ctx23, cancel23 := context.WithCancel(context.Background())
		j2, err := p.Submit(ctx23, "k", func(context.Context) error { return nil })
		require.NoError(t, err)
		time.Sleep(15 * time.Millisecond)
		j3, err := p.Submit(ctx23, "k", func(context.Context) error { return nil })
		require.NoError(t, err)
		require.Eventually(t, func() bool { return e.booked(name, "k", at[0]) == 2 }, 3*time.Second, 100*time.Microsecond)
		time.Sleep(100 * time.Millisecond) // both replies in: booked in the pool

		lpx.SetReplyDelay(100 * time.Millisecond)
		var j4 *pool.Job
		if during {
			j4, err = p.Submit(context.Background(), "k", func(context.Context) error { return nil })
			require.NoError(t, err)
			time.Sleep(50 * time.Millisecond)
		}
		cancel23()
		<-j2.Done()
		<-j3.Done()
		if !during {
			require.Eventually(t, func() bool { return e.booked(name, "k", at[0]) == 0 }, 3*time.Second, time.Millisecond)
			j4, err = p.Submit(context.Background(), "k", func(context.Context) error { return nil })
			require.NoError(t, err)
		}
		require.Eventually(t, func() bool { return e.booked(name, "k", at[0]) >= 1 }, 3*time.Second, time.Millisecond)
		time.Sleep(200 * time.Millisecond) // every call of the round is in
		require.NoError(t, p.Close(context.Background()))
		require.NoError(t, sem.Close(context.Background()))
		for _, j := range []*pool.Job{j2, j3} {
			if !errors.Is(j.Err(), context.Canceled) {
				t.Fatalf("round %d: a cancelled job: %v", i, j.Err())
			}
		}
		if j4.Err() == nil {
			t.Fatalf("round %d: the third job ran (%v)", i, j4.Reservation().Booking().At)
		}
		if !t.Run(fmt.Sprintf("during=%v/%d", during, i), func(t *testing.T) {
			e.check(t, name, "k", []*pool.Job{heads[0], j2, j3, j4}, nil, context.Canceled, pool.ErrClosed)
		}) {
			require.True(t, during, "the control lost room")
			lost++
		}
	}
	require.Zero(t, lost, "rounds (of %d) that lost room", rounds)
}

// flightsRound runs jobs over many keys with a head on each (so every
// later slot lies 10 s out), ends them all one way or another, and checks
// every key's room against the textbook.
type flightsRound struct {
	keys, workers, perKey int
	latency               time.Duration
	how                   int // 0 cancel one by one (random order), 1 one shared context, 2 children of one parent, 3 Close, 4 random deadlines (late bookings)
}

func (fr flightsRound) run(t *testing.T, e *reviewEnv, name string) {
	lim := e.limiter(t, name)
	p, err := pool.New(lim, pool.WithWorkers(fr.workers))
	require.NoError(t, err)
	defer func() { _ = p.Close(context.Background()) }()
	var keys []string
	for k := range fr.keys {
		keys = append(keys, fmt.Sprintf("k%d", k))
	}
	heads, at := reviewHeads(t, p, keys)
	atOf := make(map[string]int64)
	for i, k := range keys {
		atOf[k] = at[i]
	}

	parent, cancelParent := context.WithCancel(context.Background())
	defer cancelParent()
	jobs := make(map[string][]*pool.Job)
	for i, k := range keys {
		jobs[k] = []*pool.Job{heads[i]}
	}
	var cancels []context.CancelFunc
	for n := range fr.perKey {
		for _, k := range keys {
			ctx := parent
			switch fr.how {
			case 0, 2:
				var c context.CancelFunc
				ctx, c = context.WithCancel(parent)
				cancels = append(cancels, c)
			case 4:
				// A deadline on the slot of the n+1-th booking after the
				// head, give or take: some land late, some are refused
				// outright, some are booked.
				m := n + 1 + rand.IntN(2)
				var c context.CancelFunc
				ctx, c = context.WithDeadline(parent, time.UnixMicro(atOf[k]+int64(m)*reviewInterval(reviewLimits[0])))
				cancels = append(cancels, c)
			}
			j, err := p.Submit(ctx, k, func(context.Context) error { return nil })
			require.NoError(t, err)
			jobs[k] = append(jobs[k], j)
		}
	}
	time.Sleep(time.Duration(rand.IntN(int(4*fr.latency/time.Microsecond)+1)) * time.Microsecond)
	switch fr.how {
	case 0:
		rand.Shuffle(len(cancels), func(i, k int) { cancels[i], cancels[k] = cancels[k], cancels[i] })
		for _, c := range cancels {
			c()
		}
	case 1, 2:
		cancelParent()
	case 3:
		require.NoError(t, p.Close(context.Background()))
	case 4:
		// Wait for the deadlines' refusals, then Close the rest.
		time.Sleep(4 * fr.latency)
		require.NoError(t, p.Close(context.Background()))
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	require.NoError(t, p.Wait(ctx), "Wait never returned")
	require.NoError(t, p.Close(ctx))
	time.Sleep(2*fr.latency + 20*time.Millisecond) // nothing should be in flight: a margin for a stray give-back
	for _, k := range keys {
		e.check(t, name, k, jobs[k], nil, context.Canceled, pool.ErrClosed, deadline.ErrWouldExceedDeadline, context.DeadlineExceeded)
	}
}

// TestReviewFlightsManyKeys: 10 to 200 keys, few or many workers, jobs
// ended one by one, by a shared context, by a parent of their own
// contexts, or by Close. No job runs before its slot, no key keeps room
// nothing stands on, Wait returns.
func TestReviewFlightsManyKeys(t *testing.T) {
	t.Parallel()
	e := newReviewEnv(t, 0)
	for _, c := range []struct{ keys, workers, perKey int }{{10, 4, 3}, {10, 200, 4}, {100, 16, 1}, {200, 400, 2}} {
		for how := range 4 {
			name := fmt.Sprintf("mk-%d-%d-%d", c.keys, c.workers, how)
			t.Run(name, func(t *testing.T) {
				flightsRound{keys: c.keys, workers: c.workers, perKey: c.perKey, how: how}.run(t, e, name)
			})
		}
	}
}

// TestReviewFlightsManyKeysLatency: as TestReviewFlightsManyKeys at 40 ms
// each way (fewer keys: the give-backs go one round trip after another),
// and with deadlines that make some bookings late (owed).
func TestReviewFlightsManyKeysLatency(t *testing.T) {
	t.Parallel()
	e := newReviewEnv(t, 40*time.Millisecond)
	for _, c := range []struct{ keys, workers, perKey int }{{10, 4, 3}, {12, 64, 2}} {
		for how := range 5 {
			name := fmt.Sprintf("mkl-%d-%d-%d", c.keys, c.workers, how)
			t.Run(name, func(t *testing.T) {
				t.Parallel()
				flightsRound{keys: c.keys, workers: c.workers, perKey: c.perKey, latency: 40 * time.Millisecond, how: how}.run(t, e, name)
			})
		}
	}
}

// TestReviewFlightsOneFlightPerKey: at 40 ms each way, 32 keys with a
// backlog of 8 jobs each and few workers, so that each key is booked in
// several batches. A batch of a key is never sent while another of that
// key is in flight: on the Redis clock, the bookings of one key fall into
// groups (one call each, booked at one Redis instant... here, each job's
// slot is its booking's own; calls are told apart by the decision time,
// At minus Wait), and two calls of a key never lie closer than a round
// trip apart. Every job runs no earlier than its slot, and the keys all
// finish (no starvation).
func TestReviewFlightsOneFlightPerKey(t *testing.T) {
	t.Parallel()
	const rtt = 80 * time.Millisecond
	e := newReviewEnv(t, rtt/2)
	srvLimit := throttle.Every(5*time.Millisecond, 1, 0)
	lim, err := reserve.New(e.eng, "one", srvLimit, reserve.WithoutMaxWait())
	require.NoError(t, err)
	p, err := pool.New(lim, pool.WithWorkers(24))
	require.NoError(t, err)
	defer func() { _ = p.Close(context.Background()) }()
	const keys, per = 32, 8
	jobs := map[string][]*pool.Job{}
	for n := range per {
		_ = n
		for k := range keys {
			key := fmt.Sprint("k", k)
			j, err := p.Submit(context.Background(), key, func(context.Context) error { return nil })
			require.NoError(t, err)
			jobs[key] = append(jobs[key], j)
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	require.NoError(t, p.Wait(ctx))
	for key, js := range jobs {
		var decided []time.Time
		for _, j := range js {
			require.NoError(t, j.Err())
			b := j.Reservation().Booking()
			require.False(t, j.Started().Before(b.At), "%s: started %v before its slot on the Redis clock", key, b.At.Sub(j.Started()))
			decided = append(decided, b.At.Add(-b.Wait))
		}
		// Calls: distinct decision instants (one Redis call decides its
		// batch at one now).
		seen := map[time.Time]bool{}
		var calls []time.Time
		for _, d := range decided {
			if !seen[d] {
				seen[d] = true
				calls = append(calls, d)
			}
		}
		for i := range calls {
			for k := range calls {
				if i != k {
					gap := calls[i].Sub(calls[k]).Abs()
					require.GreaterOrEqual(t, gap, rtt/2, "%s: two booking calls %v apart on the Redis clock: two in flight at once", key, gap)
				}
			}
		}
	}
}

// TestReviewFlightsMaxWaitWhileOthersFly: a limiter with a max wait of
// 150 ms and slots 100 ms apart. A hot key with 20 jobs is refused by the
// max wait again and again (back to the backlog), while 30 cold keys with
// one job each fly beside it. Every job runs, none early (on the Redis
// clock), the cold keys are not held back behind the hot one, and the hot
// key's jobs keep the rate (a textbook GCRA of the slots that ran).
func TestReviewFlightsMaxWaitWhileOthersFly(t *testing.T) {
	t.Parallel()
	e := newReviewEnv(t, 20*time.Millisecond)
	const interval = 100 * time.Millisecond
	lim, err := reserve.New(e.eng, "mw", throttle.Every(interval, 1, 0), reserve.WithMaxWait(150*time.Millisecond))
	require.NoError(t, err)
	p, err := pool.New(lim, pool.WithWorkers(16))
	require.NoError(t, err)
	defer func() { _ = p.Close(context.Background()) }()
	var hot, cold []*pool.Job
	for range 20 {
		j, err := p.Submit(context.Background(), "hot", func(context.Context) error { return nil })
		require.NoError(t, err)
		hot = append(hot, j)
	}
	for k := range 30 {
		j, err := p.Submit(context.Background(), fmt.Sprint("cold", k), func(context.Context) error { return nil })
		require.NoError(t, err)
		cold = append(cold, j)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	require.NoError(t, p.Wait(ctx), "Wait never returned")
	var last time.Time
	for i, j := range cold {
		require.NoError(t, j.Err(), "cold %d", i)
		b := j.Reservation().Booking()
		require.Zero(t, b.Wait, "cold %d: a fresh key's first slot is immediate", i)
		require.False(t, j.Started().Before(b.At))
		if b.At.After(last) {
			last = b.At
		}
	}
	var slots []time.Time
	for i, j := range hot {
		require.NoError(t, j.Err(), "hot %d", i)
		b := j.Reservation().Booking()
		require.False(t, j.Started().Before(b.At), "hot %d started early", i)
		slots = append(slots, b.At)
	}
	// Textbook GCRA (burst 0): sorted slots at least an interval apart.
	sortTimes(slots)
	for i := 1; i < len(slots); i++ {
		require.GreaterOrEqual(t, slots[i].Sub(slots[i-1]), interval-time.Microsecond, "hot slots %d and %d", i-1, i)
	}
	first := slots[0]
	t.Logf("cold keys' last slot %v after the hot key's first", last.Sub(first))
	require.Less(t, last.Sub(first), 5*interval, "the cold keys waited behind the hot key")
}

func sortTimes(ts []time.Time) {
	for i := 1; i < len(ts); i++ {
		for k := i; k > 0 && ts[k].Before(ts[k-1]); k-- {
			ts[k], ts[k-1] = ts[k-1], ts[k]
		}
	}
}

// TestReviewFlightsRedisGoneMidFlight: 20 keys, 40 ms each way, a
// fallback (LocalShare). The connections are severed while batches fly;
// the pool goes on (the fallback answers, or the jobs fail), no job runs
// before its slot, jobs that panic do not stop the pool, Wait and Close
// return, and goleak (redistest.Main) finds nothing left.
func TestReviewFlightsRedisGoneMidFlight(t *testing.T) {
	t.Parallel()
	srv := redistest.Shared(t)
	px := redistest.NewProxy(t, srv.Options().Addr)
	eng, err := throttle.New(px.Client(t, srv), throttle.WithPrefix(redistest.Prefix(t)), throttle.WithTimeout(300*time.Millisecond))
	require.NoError(t, err)
	px.SetLatency(0)
	require.NoError(t, eng.Load(context.Background()))
	px.SetLatency(40 * time.Millisecond)
	lim, err := reserve.New(eng, "gone", throttle.Every(20*time.Millisecond, 1, 0),
		reserve.WithoutMaxWait(), reserve.WithFallback(reserve.LocalShare(20*time.Millisecond, 1, 1000)))
	require.NoError(t, err)
	p, err := pool.New(lim, pool.WithWorkers(12))
	require.NoError(t, err)
	defer func() { _ = p.Close(context.Background()) }()
	var jobs []*pool.Job
	for n := range 4 {
		for k := range 20 {
			panics := (n+k)%7 == 0
			j, err := p.Submit(context.Background(), fmt.Sprint("k", k), func(context.Context) error {
				if panics {
					panic("boom")
				}
				return nil
			})
			require.NoError(t, err)
			jobs = append(jobs, j)
		}
	}
	for range 3 {
		time.Sleep(60 * time.Millisecond)
		px.Sever()
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	require.NoError(t, p.Wait(ctx), "Wait never returned")
	require.NoError(t, p.Close(ctx))
	var ran, fell, failed, panicked int
	for i, j := range jobs {
		err := j.Err()
		var pe *pool.PanicError
		switch {
		case err == nil:
			ran++
		case errors.As(err, &pe):
			panicked++
		default:
			failed++
			require.True(t, j.Started().IsZero(), "job %d failed (%v) yet ran", i, err)
			continue
		}
		r := j.Reservation()
		require.NotNil(t, r)
		if r.Fallback() {
			fell++
		} else {
			require.False(t, j.Started().Before(r.Booking().At), "job %d started before its slot on the Redis clock", i)
		}
		require.False(t, j.Started().Before(r.SlotAt()), "job %d started before its slot", i)
	}
	t.Logf("ran %d, panicked %d, failed %d, by the fallback %d", ran, panicked, failed, fell)
}

// TestReviewFlightsAcquireInterleaved: Acquire callers on the keys the
// pool's jobs book, at 40 ms each way, with many keys in flight. Workers
// are shared (never more than Workers held), every caller and job gets
// through, and nothing runs early (a textbook GCRA of every slot per key).
func TestReviewFlightsAcquireInterleaved(t *testing.T) {
	t.Parallel()
	e := newReviewEnv(t, 40*time.Millisecond)
	const interval = 30 * time.Millisecond
	lim, err := reserve.New(e.eng, "acq", throttle.Every(interval, 1, 0), reserve.WithoutMaxWait())
	require.NoError(t, err)
	const workers = 6
	p, err := pool.New(lim, pool.WithWorkers(workers))
	require.NoError(t, err)
	defer func() { _ = p.Close(context.Background()) }()
	var held, most atomic.Int32
	hold := func() func() {
		n := held.Add(1)
		for {
			m := most.Load()
			if n <= m || most.CompareAndSwap(m, n) {
				break
			}
		}
		return func() { held.Add(-1) }
	}
	var jobs []*pool.Job
	for n := range 3 {
		_ = n
		for k := range 10 {
			j, err := p.Submit(context.Background(), fmt.Sprint("k", k), func(context.Context) error {
				defer hold()()
				time.Sleep(time.Millisecond)
				return nil
			})
			require.NoError(t, err)
			jobs = append(jobs, j)
		}
	}
	var wg sync.WaitGroup
	errs := make(chan error, 20)
	for c := range 20 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			release, err := p.Acquire(ctx, fmt.Sprint("k", c%10))
			if err != nil {
				errs <- err
				return
			}
			defer release()
			defer hold()()
			time.Sleep(time.Millisecond)
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		require.NoError(t, err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	require.NoError(t, p.Wait(ctx))
	for i, j := range jobs {
		require.NoError(t, j.Err(), "job %d", i)
		require.False(t, j.Started().Before(j.Reservation().Booking().At), "job %d early", i)
	}
	require.LessOrEqual(t, int(most.Load()), workers, "more running than workers")
}

// TestReviewFlightsGiveBackHoldsUpOtherKeys: 40 ms each way. Key "a" has
// 30 jobs booked (slots 10 s apart after its head), all ended by one
// cancel. The dispatcher gives their bookings back itself, one round trip
// after another (2.4 s), and meanwhile books nothing and starts nothing:
// a job submitted for a fresh key just after the cancel (an immediate
// slot) starts only once all of "a" is given back. The control, the same
// job on another fresh key submitted before the cancel, starts a round
// trip or two after its submission. Booking is side by side across keys;
// giving back holds every key up behind one.
// Failed (2.59 s against 87 ms) before give-backs went on a goroutine of their own.
func TestReviewFlightsGiveBackHoldsUpOtherKeys(t *testing.T) {
	t.Parallel()
	e := newReviewEnv(t, 40*time.Millisecond)
	name := "hold"
	// Enough workers that 30 booked are "few" (a quarter or fewer): the
	// pool books again at once.
	p, err := pool.New(e.limiter(t, name), pool.WithWorkers(200))
	require.NoError(t, err)
	defer func() { _ = p.Close(context.Background()) }()
	heads, at := reviewHeads(t, p, []string{"a"})
	ctxA, cancelA := context.WithCancel(context.Background())
	defer cancelA()
	const n = 30
	jobs := []*pool.Job{heads[0]}
	for range n {
		j, err := p.Submit(ctxA, "a", func(context.Context) error { return nil })
		require.NoError(t, err)
		jobs = append(jobs, j)
	}
	require.Eventually(t, func() bool { return e.booked(name, "a", at[0]) == n }, 5*time.Second, time.Millisecond)
	time.Sleep(100 * time.Millisecond) // the replies are in: booked in the pool

	lag := func(key string) time.Duration {
		t0 := time.Now()
		j, err := p.Submit(context.Background(), key, func(context.Context) error { return nil })
		require.NoError(t, err)
		require.NoError(t, j.Wait(context.Background()))
		require.Zero(t, j.Reservation().Booking().Wait)
		return j.Started().Sub(t0)
	}
	control := lag("b0")
	cancelA()
	time.Sleep(20 * time.Millisecond) // the dispatcher has begun giving back
	held := lag("b1")
	t.Logf("a fresh key's job started %v after its submission (control %v) while %d bookings of another key were given back", held, control, n)
	require.NoError(t, p.Wait(context.Background()))
	e.check(t, name, "a", jobs, nil, context.Canceled)
	require.Less(t, held, 4*control+300*time.Millisecond, "a fresh key's job waited for another key's give-backs")
}
