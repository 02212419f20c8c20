package pool_test

import (
	"context"
	"slices"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/slotbook/slotbook/deadline"
	"github.com/slotbook/slotbook/internal/callcount"
	"github.com/slotbook/slotbook/internal/redistest"
	"github.com/slotbook/slotbook/pool"
	"github.com/slotbook/slotbook/reserve"
	"github.com/slotbook/slotbook/throttle"
)

// handDownRig is a pool on a limiter whose engine talks to Redis through a
// proxy (to hold replies back), and a second engine straight to Redis for
// the probe.
type handDownRig struct {
	p     *pool.Pool
	lim   *reserve.Limiter
	proxy *redistest.Proxy
	probe *throttle.Engine
	limit throttle.Limit
}

func newHandDownRig(t *testing.T, limit throttle.Limit, workers int) *handDownRig {
	t.Helper()
	srv := redistest.Shared(t)
	prefix := redistest.Prefix(t)
	px := redistest.NewProxy(t, srv.Addr)
	eng, err := throttle.New(px.Client(t, srv), throttle.WithPrefix(prefix), throttle.WithTimeout(10*time.Second))
	require.NoError(t, err)
	lim, err := reserve.New(eng, "hd", limit, reserve.WithMaxWait(time.Minute))
	require.NoError(t, err)
	probe, err := throttle.New(srv.Client(t), throttle.WithPrefix(prefix), throttle.WithTimeout(10*time.Second)) // leases and probes ride it: no 50 ms timeout on a busy machine
	require.NoError(t, err)
	// A warm connection through the proxy, so that no call dials.
	require.NoError(t, eng.Client().(*redis.Client).Ping(context.Background()).Err())
	return &handDownRig{p: newPool(t, lim, pool.WithWorkers(workers)), lim: lim, proxy: px, probe: probe, limit: limit}
}

func (r *handDownRig) submit(t *testing.T, ctx context.Context, key string) *pool.Job {
	t.Helper()
	j, err := r.p.Submit(ctx, key, func(context.Context) error { return nil })
	require.NoError(t, err)
	return j
}

// requireNothingWasted checks the outcome against a textbook GCRA with no
// burst (slots one interval I apart, the first at the pause's end P): the
// jobs that ran hold the slots P, P+I, ..., P+(k-1)I on the Redis clock,
// each started no earlier than its slot, and the next booking of the key
// (a probe, straight to Redis) lands at P+kI. A cancelled job's slot that
// nobody used would push the probe, and the later jobs, one interval on.
// The last job runs less than I after its slot (a reply's latency), so
// the probe finds the key's last slot ahead.
// P is the earliest slot any job of the key was booked at: the cancelled
// jobs were booked (their Reservation holds an OK booking).
func (r *handDownRig) requireNothingWasted(t *testing.T, key string, ran, cancelled []*pool.Job) {
	t.Helper()
	I := r.limit.Period / time.Duration(r.limit.Rate)
	var slots, all []time.Time
	for i, j := range ran {
		require.NoError(t, j.Err(), "job %d that should run", i)
		require.False(t, j.Started().Before(j.Slot()), "job %d started before its slot", i)
		slots = append(slots, j.Reservation().Booking().At)
	}
	for i, j := range cancelled {
		require.ErrorIs(t, j.Err(), context.Canceled, "cancelled job %d", i)
		require.True(t, j.Started().IsZero(), "cancelled job %d ran", i)
		res := j.Reservation()
		require.NotNil(t, res, "cancelled job %d was never booked: the test did not set up what it means to", i)
		require.True(t, res.Booking().OK, "cancelled job %d was never booked", i)
		all = append(all, res.Booking().At)
	}
	all = append(all, slots...)
	first := slices.MinFunc(all, func(a, b time.Time) int { return a.Compare(b) })
	slices.SortFunc(slots, func(a, b time.Time) int { return a.Compare(b) })
	for k, at := range slots {
		require.Equal(t, first.Add(time.Duration(k)*I), at, "slot %d of the jobs that ran (first slot %v): a cancelled job's slot was left unused", k, first)
	}
	b, err := r.probe.Book(context.Background(), "hd:{"+key+"}", r.limit, throttle.Request{N: 1, MaxWait: throttle.Forever})
	require.NoError(t, err)
	require.Positive(t, b.Wait, "the probe came after the key's last slot: the test cannot tell where it was")
	require.Equal(t, first.Add(time.Duration(len(slots))*I), b.At, "the next slot after the %d that ran", len(slots))
}

// TestPoolHandsDownCancelledSlot: three jobs of a key booked in one batch
// behind a pause (slots P, P+I, P+2I); the first is cancelled before its
// slot. The later two run at P and P+I, and the top slot goes back: the
// cancelled job's slot is not left unused under the later ones (before,
// it was owed until its slot came, and wasted).
func TestPoolHandsDownCancelledSlot(t *testing.T) {
	t.Parallel()
	r := newHandDownRig(t, throttle.PerSecond(1, 0), 8) // I = 1 s
	bg := context.Background()
	require.NoError(t, r.lim.Pause(bg, "k", 1500*time.Millisecond))
	actx, cancelA := context.WithCancel(bg)
	defer cancelA()
	a := r.submit(t, actx, "k")
	b := r.submit(t, bg, "k")
	c := r.submit(t, bg, "k")
	time.Sleep(400 * time.Millisecond) // booked (one round trip), long before P
	cancelA()
	wctx, cancel := context.WithTimeout(bg, 30*time.Second)
	defer cancel()
	require.NoError(t, r.p.Wait(wctx))
	r.requireNothingWasted(t, "k", []*pool.Job{b, c}, []*pool.Job{a})
}

// TestPoolHandsDownOwedSlot: as above, but the first job is cancelled
// while a second batch of the key is in flight (its reply held back), so
// that its booking cannot be given back at once (the batch may book after
// it): it is owed. The batch lands above it; the owed slot is then handed
// down to the later jobs, and the top one given back.
func TestPoolHandsDownOwedSlot(t *testing.T) {
	t.Parallel()
	r := newHandDownRig(t, throttle.PerSecond(1, 0), 8) // I = 1 s; books again at 2 booked
	bg := context.Background()
	require.NoError(t, r.lim.Pause(bg, "k", 2*time.Second))
	actx, cancelA := context.WithCancel(bg)
	defer cancelA()
	a := r.submit(t, actx, "k")
	b := r.submit(t, bg, "k")
	time.Sleep(300 * time.Millisecond) // the first batch booked
	r.proxy.SetReplyDelay(600 * time.Millisecond)
	d := r.submit(t, bg, "k")
	e := r.submit(t, bg, "k")
	time.Sleep(200 * time.Millisecond) // the second batch in flight
	cancelA()
	time.Sleep(900 * time.Millisecond) // the second batch in, and what it gave back
	r.proxy.SetReplyDelay(0)
	wctx, cancel := context.WithTimeout(bg, 30*time.Second)
	defer cancel()
	require.NoError(t, r.p.Wait(wctx))
	r.requireNothingWasted(t, "k", []*pool.Job{b, d, e}, []*pool.Job{a})
}

// TestPoolHandsDownLateHeldSlot: a job whose slot fitted its deadline
// when its batch was sent, but not once the reply (held back 1 s) was
// in, is refused late and its booking held for the pool to give back; a
// later job of the key, with no deadline, booked above it, takes that
// slot and runs in it, and its own (the top one) goes back. Checked on
// the Redis clock against a textbook GCRA with no burst: the job that ran
// holds the first slot after the pause, P, and a probe lands at P+I.
// Before, the held booking was owed under the later one and wasted once
// that one ran: the job ran at P+I and the probe landed at P+2I.
func TestPoolHandsDownLateHeldSlot(t *testing.T) {
	t.Parallel()
	// I = 2 s: B runs up to a reply's delay (1 s) after its slot on the
	// Redis clock, and the probe must still find that slot's successor
	// ahead.
	r := newHandDownRig(t, throttle.PerMinute(30, 0), 8)
	bg := context.Background()
	I := 2 * time.Second
	require.NoError(t, r.probe.Load(bg)) // the scripts loaded on the server: one round trip below
	require.NoError(t, r.lim.Pause(bg, "k", 1500*time.Millisecond))
	r.proxy.SetReplyDelay(time.Second)
	// A's slot, about 1.5 s ahead, fits a deadline 2.1 s ahead when sent
	// (600 ms to spare); counted from the reply, 1 s on, it does not (by
	// 400 ms).
	actx, cancelA := context.WithTimeout(bg, 2100*time.Millisecond)
	defer cancelA()
	a := r.submit(t, actx, "k")
	b := r.submit(t, bg, "k")
	time.Sleep(100 * time.Millisecond)
	r.proxy.SetReplyDelay(0)
	wctx, cancel := context.WithTimeout(bg, 30*time.Second)
	defer cancel()
	require.NoError(t, r.p.Wait(wctx))

	require.ErrorIs(t, a.Err(), deadline.ErrWouldExceedDeadline, "A was refused late (the test's premise)")
	require.True(t, a.Started().IsZero(), "A ran")
	held := a.Reservation()
	require.NotNil(t, held)
	if !held.Booking().OK {
		t.Skipf("A's call went out more than 600 ms late and Redis refused it: nothing held to hand down (%v)", a.Err())
	}
	P := held.Booking().At

	require.NoError(t, b.Err())
	require.False(t, b.Started().Before(b.Slot()), "B started before its slot")
	require.Equal(t, P, b.Reservation().Booking().At, "B ran in slot P+%v, not in A's unused slot P", b.Reservation().Booking().At.Sub(P))
	pb, err := r.probe.Book(bg, "hd:{k}", r.limit, throttle.Request{N: 1, MaxWait: throttle.Forever})
	require.NoError(t, err)
	require.Positive(t, pb.Wait, "the probe came after the key's last slot: the test cannot tell where it was")
	require.Equal(t, P.Add(I), pb.At, "the next slot after the one that ran")
}

// TestPoolForgetsHeldUnderRun: a job A refused late, whose slot came
// while the reply was out, holds a booking no one can take (its slot has
// passed); a later job B of its batch is booked above it. Once B has
// started, its booking stands on the key for good, and the held one can
// give nothing back: the pool forgets it and sends no refund for it.
// Counted on the pool's client: two calls in all, the two bookings.
// (Before, the pool gave it back once B had started: one refund that gave
// nothing.) Replies are held back 2 s; a first job X keeps the key's call
// in flight so that A and B go out in one batch behind it.
func TestPoolForgetsHeldUnderRun(t *testing.T) {
	t.Parallel()
	r := newHandDownRig(t, throttle.PerMinute(30, 0), 8) // I = 2 s
	calls := callcount.Attach(r.lim.Engine().Client().(*redis.Client))
	bg := context.Background()
	require.NoError(t, r.probe.Load(bg))
	r.proxy.SetReplyDelay(2 * time.Second)
	x := r.submit(t, bg, "k") // slot t0, its reply at t0+2s
	time.Sleep(100 * time.Millisecond)
	// A's slot, t0+2s, fits its deadline t0+3s when its batch goes out
	// (t0+2s); counted from the reply (t0+4s), it does not.
	actx, cancelA := context.WithTimeout(bg, 2900*time.Millisecond)
	defer cancelA()
	a := r.submit(t, actx, "k")
	b := r.submit(t, bg, "k")
	wctx, cancel := context.WithTimeout(bg, 30*time.Second)
	defer cancel()
	require.NoError(t, r.p.Wait(wctx))
	r.proxy.SetReplyDelay(0)
	require.NoError(t, x.Err())
	require.ErrorIs(t, a.Err(), deadline.ErrWouldExceedDeadline, "A was refused late (the test's premise)")
	if held := a.Reservation(); held == nil || !held.Booking().OK {
		t.Skipf("A's call went out too late and Redis refused it: nothing held (%v)", a.Err())
	}
	require.NoError(t, b.Err())
	require.Equal(t, b.Reservation().Booking().At, a.Reservation().Booking().At.Add(2*time.Second), "B booked right above A (the test's premise)")
	// Wait does not wait for a give-back: Close does.
	require.NoError(t, r.p.Close(wctx))
	require.Equal(t, int64(2), calls.Load(), "X's booking and A and B's, and no refund of a booking B stands on")
}
