package pool_test

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/slotbook/slotbook/internal/redistest"
	"github.com/slotbook/slotbook/lease"
	"github.com/slotbook/slotbook/pool"
	"github.com/slotbook/slotbook/throttle"
)

type heldReplyKey struct{}

// newTradePool returns a pool of 16 workers on r's limiter, WithLease of
// a semaphore of n leases per key if n > 0, closed (and its semaphore)
// when the test ends.
func newTradePool(t *testing.T, r *fgRig, n int) *pool.Pool {
	t.Helper()
	opts := []pool.Option{pool.WithWorkers(16)}
	if n > 0 {
		// Straight to Redis, with room for a busy machine (r.probe has
		// the default 50 ms timeout).
		eng, err := throttle.New(redistest.Shared(t).Client(t), throttle.WithPrefix(redistest.Prefix(t)), throttle.WithTimeout(5*time.Second))
		require.NoError(t, err)
		require.NoError(t, eng.Load(context.Background()))
		sem, err := lease.New(eng, r.name+"lease", n, lease.WithTTL(time.Minute))
		require.NoError(t, err)
		t.Cleanup(func() { _ = sem.Close(context.Background()) })
		opts = append(opts, pool.WithLease(sem))
	}
	p, err := pool.New(r.lim, opts...)
	require.NoError(t, err)
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		require.NoError(t, p.Close(ctx))
	})
	return p
}

// TestLeaseLateRefusalUnderJobOfSameSlot: with WithLease each job books
// alone, so two jobs of a key can be booked in one merged call, and
// within a burst both get the same slot (At); their replies reach the
// pool in either order. L is refused late (its deadline passes while the
// reply is out: its booking held for the pool); R runs. Textbook GCRA: only
// R ran on the key, which has room for two at once, so a booking made
// straight in Redis right after finds room at once. Every order is
// tried: L booked under R or over it in Redis (the merger's order, seen
// through Booking.Before), and L's reply looked at first or last (held
// back until R has run: L's booking then lands under a job already
// done). Before, the pool ordered the two by
// the order their replies reached it, and lost L's room (8.6 s of wait)
// whenever L lay under R.
func TestLeaseLateRefusalUnderJobOfSameSlot(t *testing.T) {
	t.Parallel()
	lim := throttle.PerMinute(6, 1) // I = 10 s, room for two at once
	r := newFGRig(t, "trade", lim, throttle.WithMergeAt(1))
	p := newTradePool(t, r, 64)
	const D = 400 * time.Millisecond
	var held = make(chan struct{}) // closed once R has run, per trial
	pool.SetAfterReply(p, func(ctx context.Context) {
		if ctx.Value(heldReplyKey{}) != nil {
			<-held
		}
	})
	r.proxy.SetReplyDelay(D)
	bg := context.Background()
	met := map[string]int{}
	trial := 0
	for _, holdL := range []bool{true, false} {
		// Which of L and R Redis books first is up to the merger: try
		// until both orders have been seen (or give up after 30 trials).
		seen := map[bool]bool{}
		for n := 0; n < 30 && !(seen[true] && seen[false]); n++ {
			trial++
			key := fmt.Sprintf("k%d", trial)
			held = make(chan struct{})
			x, err := p.Submit(bg, "x"+key, fgNop)
			require.NoError(t, err)
			r.awaitFlying(t, "x"+key) // X's call in flight: the next bookings merge
			lctx, lcancel := context.WithTimeout(bg, D-150*time.Millisecond)
			rctx := bg
			if holdL {
				lctx = context.WithValue(lctx, heldReplyKey{}, true)
			} else {
				rctx = context.WithValue(rctx, heldReplyKey{}, true)
			}
			var l, rj *pool.Job
			var wg sync.WaitGroup
			wg.Add(2)
			go func() { defer wg.Done(); l, _ = p.Submit(lctx, key, fgNop) }()
			go func() { defer wg.Done(); rj, _ = p.Submit(rctx, key, fgNop) }()
			wg.Wait()
			require.NotNil(t, l)
			require.NotNil(t, rj)
			wctx, wcancel := context.WithTimeout(bg, 20*time.Second)
			if holdL {
				require.NoError(t, rj.Wait(wctx)) // R has run; then L's reply is looked at
				close(held)
				_ = l.Wait(wctx)
			} else {
				_ = l.Wait(wctx) // L is owed; then R's reply is looked at, and R runs
				close(held)
				require.NoError(t, rj.Wait(wctx))
			}
			require.NoError(t, x.Wait(wctx))
			require.NoError(t, p.Wait(wctx)) // give-backs, if any, are under way or done
			wcancel()
			lcancel()
			time.Sleep(2*D + 200*time.Millisecond) // a give-back's reply is in

			lb, rb := l.Reservation().Booking(), rj.Reservation().Booking()
			if !hoLate(l) || !lb.At.Equal(rb.At) {
				t.Logf("trial %d: premise not met (L late %v, L err %v; L at %v, R at %v)", trial, hoLate(l), l.Err(), lb.At, rb.At)
				continue
			}
			// L under R: L's booking first, or R's now (R took it: see
			// reserve.Reservation.Trade).
			under := !rb.Before(lb)
			seen[under] = true
			met[fmt.Sprintf("L under R %v, L's reply last %v", under, holdL)]++
			pb := r.probeBook(t, key)
			require.Zero(t, pb.Wait, "trial %d (L under R: %v; L's reply looked at last: %v): L's held room did not come back", trial, under, holdL)
		}
		require.True(t, seen[true], "L's reply last %v: no trial booked L under R", holdL)
	}
	t.Logf("cases met: %v", met)
}

// TestLeaseStoodBounded: a WithLease pool keeps, for late refusals still
// in flight, a record of the bookings its started jobs stand on; under
// steady load on one key a call is always in flight, so the records must
// go once no call sent before their job started is left, not only when
// the key's calls all land. 600 jobs on a hot key, 16 at a time, each
// reply 2 ms late: the records stay few, and none is left after.
func TestLeaseStoodBounded(t *testing.T) {
	t.Parallel()
	r := newFGRig(t, "stood", throttle.PerSecond(2000, 40))
	p := newTradePool(t, r, 16)
	r.proxy.SetReplyDelay(2 * time.Millisecond)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	const jobs = 600
	js := make([]*pool.Job, jobs)
	for i := range js {
		j, err := p.Submit(ctx, "hot", fgNop)
		require.NoError(t, err)
		js[i] = j
	}
	most, aloftSeen := 0, false
	stop, sampled := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(sampled)
		for {
			n, aloft := pool.Stood(p)
			most = max(most, n)
			aloftSeen = aloftSeen || aloft > 0
			select {
			case <-stop:
				return
			case <-time.After(200 * time.Microsecond):
			}
		}
	}()
	require.NoError(t, p.Wait(ctx))
	close(stop)
	<-sampled
	for i, j := range js {
		require.NoError(t, j.Err(), "job %d", i)
	}
	require.True(t, aloftSeen, "the test's premise: calls in flight")
	n, aloft := pool.Stood(p)
	require.Zero(t, n, "records left once every call has landed")
	require.Zero(t, aloft)
	t.Logf("most records at once: %d", most)
	require.LessOrEqual(t, most, 64, "records of %d jobs: they pile up", jobs)
}

// TestBatchLateRefusalUnderJobOfSameSlot: without leases, two jobs of a
// key booked in one batch within a burst share a slot too. L, the first,
// is refused late (its deadline passes while the reply is out: held); R,
// booked on top of it, runs at once, so L's slot has come before anyone
// could be handed it. Textbook GCRA: X and R ran on a key with room for
// three at once, so a booking made straight in Redis right after finds
// room at once. Before, L's room was lost under R (its booking forgotten
// as R started).
func TestBatchLateRefusalUnderJobOfSameSlot(t *testing.T) {
	t.Parallel()
	lim := throttle.PerMinute(6, 2) // I = 10 s, room for three at once
	r := newFGRig(t, "batchtrade", lim)
	p := newTradePool(t, r, 0)
	const D = 400 * time.Millisecond
	r.proxy.SetReplyDelay(D)
	bg := context.Background()
	met := 0
	for trial := 0; trial < 10 && met < 2; trial++ {
		key := fmt.Sprintf("k%d", trial)
		x, err := p.Submit(bg, key, fgNop)
		require.NoError(t, err)
		r.awaitFlying(t, key) // X's batch in flight: L and R wait for it, then go in one batch
		// Sent about D after X's batch ran, L has about 250 ms left:
		// booked at once, its reply D later comes too late.
		lctx, lcancel := context.WithTimeout(bg, D+250*time.Millisecond)
		l, err := p.Submit(lctx, key, fgNop)
		require.NoError(t, err)
		rj, err := p.Submit(bg, key, fgNop)
		require.NoError(t, err)
		wctx, wcancel := context.WithTimeout(bg, 20*time.Second)
		require.NoError(t, x.Wait(wctx))
		require.NoError(t, rj.Wait(wctx))
		_ = l.Wait(wctx)
		require.NoError(t, p.Wait(wctx))
		wcancel()
		lcancel()
		time.Sleep(2*D + 200*time.Millisecond) // a give-back's reply is in

		lr, rr := l.Reservation(), rj.Reservation()
		if !hoLate(l) || lr == nil || !lr.Booking().At.Equal(rr.Booking().At) {
			t.Logf("trial %d: premise not met (L late %v, L err %v)", trial, hoLate(l), l.Err())
			continue
		}
		met++
		pb := r.probeBook(t, key)
		require.Zero(t, pb.Wait, "trial %d: L's held room did not come back", trial)
	}
	require.Positive(t, met, "no trial met the premise")
}

// TestLeaseLateRefusalUnderAcquireOfSameSlot: TestLeaseLateRefusalUnderJobOfSameSlot
// with an Acquire caller of the pool in R's place: with WithLease its
// booking merges with a job's, and within a burst both get the same
// slot. L, the job, is refused late (held); A, the caller, acts at once.
// Textbook GCRA: only X and A acted, on a key with room for two at once
// (X's key is another), so a booking made straight in Redis right after
// finds room at once. Both orders in Redis are tried, and L's reply
// looked at before A acts and after. Before, L's room was lost whenever L
// lay under A: the pool held no record of A's booking to trade with, and
// gave L's held booking back, for nothing, while A's stood on it.
func TestLeaseLateRefusalUnderAcquireOfSameSlot(t *testing.T) {
	t.Parallel()
	lim := throttle.PerMinute(6, 1) // I = 10 s, room for two at once
	// Booking calls counted (script calls less refunds): with X's, L and
	// A in one merged call make two, the premise of a shared slot.
	calls := &callCounter{}
	r := newFGRig(t, "acqtrade", lim, throttle.WithMergeAt(1), throttle.WithObserver(calls))
	p := newTradePool(t, r, 64)
	const D = 400 * time.Millisecond
	var held = make(chan struct{}) // closed once A has acted, per trial
	pool.SetAfterReply(p, func(ctx context.Context) {
		if ctx.Value(heldReplyKey{}) != nil {
			<-held
		}
	})
	r.proxy.SetReplyDelay(D)
	bg := context.Background()
	met := map[string]int{}
	trial := 0
	for _, holdL := range []bool{true, false} {
		seen := map[bool]bool{}
		for n := 0; n < 30 && !(seen[true] && seen[false]); n++ {
			trial++
			key := fmt.Sprintf("k%d", trial)
			held = make(chan struct{})
			booked0 := calls.booked()
			x, err := p.Submit(bg, "x"+key, fgNop)
			require.NoError(t, err)
			r.awaitFlying(t, "x"+key) // X's call in flight: the next bookings merge
			lctx, lcancel := context.WithTimeout(bg, D-150*time.Millisecond)
			if holdL {
				lctx = context.WithValue(lctx, heldReplyKey{}, true)
			}
			var l *pool.Job
			var release func()
			var aerr error
			var wg sync.WaitGroup
			wg.Add(2)
			go func() { defer wg.Done(); l, _ = p.Submit(lctx, key, fgNop) }()
			go func() { defer wg.Done(); release, aerr = p.Acquire(bg, key) }()
			wg.Wait()
			require.NotNil(t, l)
			require.NoError(t, aerr)
			release()
			close(held) // A has acted: L's reply, if held, is looked at now
			wctx, wcancel := context.WithTimeout(bg, 20*time.Second)
			_ = l.Wait(wctx)
			require.NoError(t, x.Wait(wctx))
			require.NoError(t, p.Wait(wctx))
			wcancel()
			lcancel()
			time.Sleep(2*D + 200*time.Millisecond) // a give-back's reply is in

			if n := calls.booked() - booked0; !hoLate(l) || n != 2 {
				t.Logf("trial %d: premise not met (L late %v, L err %v; %d booking calls)", trial, hoLate(l), l.Err(), n)
				continue
			}
			// L under A: L's booking was the first on the empty key, so
			// its units stand one interval past its slot (two, over A).
			lb := l.Reservation().Booking()
			under := lb.End().Sub(lb.At) < lim.Interval()*3/2
			pb := r.probeBook(t, key)
			seen[under] = true
			met[fmt.Sprintf("L under A %v, L's reply last %v", under, holdL)]++
			require.Zero(t, pb.Wait, "trial %d (L under A: %v; L's reply looked at last: %v): L's held room did not come back", trial, under, holdL)
		}
		require.True(t, seen[true], "L's reply last %v: no trial booked L under A", holdL)
	}
	t.Logf("cases met: %v", met)
}

// callCounter is a throttle.Observer that counts an engine's script calls
// that succeeded and its refunds.
type callCounter struct {
	calls, refunds atomic.Int64
}

// booked returns the calls that were not refunds.
func (c *callCounter) booked() int64 { return c.calls.Load() - c.refunds.Load() }

func (c *callCounter) ObserveDecision(string, throttle.Outcome, time.Duration) {}
func (c *callCounter) ObserveCall(_ string, _ time.Duration, err error) {
	if err == nil {
		c.calls.Add(1)
	}
}
func (c *callCounter) ObserveRefund(string, time.Duration) { c.refunds.Add(1) }
func (c *callCounter) ObserveBreaker(bool)                 {}
