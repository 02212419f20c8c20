package pool_test

// Review (helper-84) of 2d713ff (reserve: Reservation.Claim) and 2fc1a07
// (pool: a late refusal's held booking is handed down), through the
// public API. Slots are judged on the Redis clock (Booking().At; Redis
// runs on this host, so its clock is the local one) against a textbook
// GCRA replay of the jobs that actually ran plus a probe booking made
// straight to Redis: with every slot ahead of now (a Pause puts them
// there), GCRA books tat' - tau - I where tat' = max(tat, now) + I, so
// after a pause ending at P the k-th booking lands at P + kI, whatever
// the burst.
//
// FAIL on the current code (findings):
//   - TestReviewLCClaimAfterLostCancel, TestReviewLCClaimAfterUnsentCancel
//     (reserve: Claim after a failed Cancel)
//   - TestReviewLCHeldImmediateNotGivenBack (pool forgets a held late
//     refusal whose slot has come, never giving it back)
//   - TestReviewLCCancelledJobGetsRefusal (minor: a cancelled job's
//     Job.Reservation is another job's late refusal)
// Every other test passes.

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"sync"
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

// lcRig is a limiter whose engine talks to Redis through a proxy (to hold
// replies back) and a probe engine straight to Redis.
type lcRig struct {
	lim    *reserve.Limiter
	proxy  *redistest.Proxy
	eng    *throttle.Engine
	probe  *throttle.Engine
	limits []throttle.Limit
}

const lcName = "lc"

func newLCRig(t *testing.T, limits []throttle.Limit, opts ...reserve.Option) *lcRig {
	t.Helper()
	srv := redistest.Shared(t)
	prefix := redistest.Prefix(t)
	px := redistest.NewProxy(t, srv.Addr)
	eng, err := throttle.New(px.Client(t, srv), throttle.WithPrefix(prefix), throttle.WithTimeout(10*time.Second))
	require.NoError(t, err)
	opts = append([]reserve.Option{reserve.WithMaxWait(time.Minute)}, opts...)
	if len(limits) > 1 {
		opts = append(opts, reserve.WithLimit(limits[1:]...))
	}
	lim, err := reserve.New(eng, lcName, limits[0], opts...)
	require.NoError(t, err)
	probe, err := throttle.New(srv.Client(t), throttle.WithPrefix(prefix), throttle.WithTimeout(10*time.Second)) // leases and probes ride it: no 50 ms timeout on a busy machine
	require.NoError(t, err)
	bg := context.Background()
	require.NoError(t, eng.Client().(*redis.Client).Ping(bg).Err()) // a warm connection
	require.NoError(t, eng.Load(bg))
	require.NoError(t, probe.Load(bg))
	return &lcRig{lim: lim, proxy: px, eng: eng, probe: probe, limits: limits}
}

func (r *lcRig) newPool(t *testing.T, opts ...pool.Option) *pool.Pool {
	t.Helper()
	p, err := pool.New(r.lim, append([]pool.Option{pool.WithWorkers(8)}, opts...)...)
	require.NoError(t, err)
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		require.NoError(t, p.Close(ctx))
	})
	return p
}

// keys are the engine keys of subject key (reserve.WithLimit's doc).
func (r *lcRig) keys(key string) []string {
	first := lcName + ":{" + key + "}"
	ks := []string{first}
	for _, l := range r.limits[1:] {
		ks = append(ks, first+":"+strconv.FormatInt(l.Period.Milliseconds(), 10)+"ms")
	}
	return ks
}

// probeBook books one unit of key straight to Redis.
func (r *lcRig) probeBook(t *testing.T, key string) throttle.Booking {
	t.Helper()
	bs, err := r.probe.BookAll(context.Background(), r.keys(key), r.limits, []throttle.Request{{N: 1, MaxWait: throttle.Forever}})
	require.NoError(t, err)
	require.True(t, bs[0].OK)
	return bs[0]
}

func lcSubmit(t *testing.T, p *pool.Pool, ctx context.Context, key string) *pool.Job {
	t.Helper()
	j, err := p.Submit(ctx, key, func(context.Context) error { return nil })
	require.NoError(t, err)
	return j
}

func lcDeadline(t *testing.T, at time.Time) context.Context {
	ctx, cancel := context.WithDeadline(context.Background(), at)
	t.Cleanup(cancel)
	return ctx
}

func lcWait(t *testing.T, p *pool.Pool) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	require.NoError(t, p.Wait(ctx))
}

// requireLateHeld: j was refused late (the test's premise), never ran, and
// its Reservation holds the booking of slot at (Booking().OK, not OK).
func requireLateHeld(t *testing.T, name string, j *pool.Job, at time.Time) {
	t.Helper()
	require.ErrorIs(t, j.Err(), deadline.ErrWouldExceedDeadline, "%s refused late (the test's premise)", name)
	require.True(t, j.Started().IsZero(), "%s, refused, ran", name)
	require.True(t, j.Slot().IsZero(), "%s, refused, has a Slot", name)
	res := j.Reservation()
	require.NotNil(t, res, name)
	require.False(t, res.OK(), "%s's Reservation is OK though it was refused", name)
	require.True(t, res.Booking().OK, "%s held its booking (the test's premise)", name)
	require.Equal(t, at, res.Booking().At, "%s's held slot", name)
}

// check replays a textbook GCRA from P (the pause's end: every slot below
// lies ahead of now, so each booking lands one interval I after the last)
// over the jobs that ran: in slot order they hold P, P+I, ...; each
// started no earlier than its slot on the Redis clock (and its Slot), and
// its Reservation is OK; and a probe, before the last slot's successor,
// lands on that successor. A slot left unused under a job that ran pushes
// the later ones and the probe; one given back twice lets the probe in
// below.
func (r *lcRig) check(t *testing.T, key string, P time.Time, I time.Duration, ran map[string]*pool.Job) {
	t.Helper()
	type got struct {
		name string
		at   time.Time
	}
	var slots []got
	for name, j := range ran {
		require.NoError(t, j.Err(), "job %s, which should run", name)
		res := j.Reservation()
		require.NotNil(t, res, name)
		require.True(t, res.OK(), "job %s ran, yet its Reservation is not OK: %v", name, res.Err())
		require.False(t, j.Started().IsZero(), "job %s did not run", name)
		at := res.Booking().At
		require.False(t, j.Started().Before(at), "job %s started %v before its slot on the Redis clock", name, at.Sub(j.Started()))
		require.False(t, j.Started().Before(j.Slot()), "job %s started before its Slot", name)
		slots = append(slots, got{name, at})
	}
	slices.SortFunc(slots, func(a, b got) int { return a.at.Compare(b.at) })
	tat := P // the next slot of the replay
	for _, s := range slots {
		require.Equal(t, tat, s.at, "job %s: textbook GCRA puts it at P+%v, it ran at P+%v", s.name, tat.Sub(P), s.at.Sub(P))
		tat = tat.Add(I)
	}
	b := r.probeBook(t, key)
	require.Positive(t, b.Wait, "the probe came after the key's last slot: the test cannot tell where it was")
	require.Equal(t, tat, b.At, "the probe: textbook GCRA puts it at P+%v, it landed at P+%v", tat.Sub(P), b.At.Sub(P))
}

// lcShape is the common shape of the pool tests: a blocker X (no
// deadline) booked alone at P, its reply held back D, so that the jobs
// submitted meanwhile go out in one batch after it, their reply held back
// D too; a job named "A..." gets a deadline D/2 after its slot, which
// Redis books within its budget and the reply makes late (see
// reserve.BatchRequest.HoldLate).
type lcShape struct {
	I, D, pause time.Duration
	names       []string // the batch after X, in order
}

// start pauses key, books X and the batch; it returns P, each job by name,
// and each job's own slot (before any hand-down). ctxOf gives the context
// of a job not refused late (nil: Background).
func (r *lcRig) start(t *testing.T, p *pool.Pool, key string, sh lcShape, ctxOf func(name string) context.Context) (time.Time, map[string]*pool.Job, map[string]time.Time) {
	t.Helper()
	bg := context.Background()
	pauseAt := time.Now()
	require.NoError(t, r.lim.Pause(bg, key, sh.pause))
	P := pauseAt.Add(sh.pause) // to within the pause call's latency
	r.proxy.SetReplyDelay(sh.D)
	jobs := map[string]*pool.Job{"X": lcSubmit(t, p, bg, key)}
	time.Sleep(150 * time.Millisecond) // X's batch out alone
	own := map[string]time.Time{"X": P}
	for i, name := range sh.names {
		slot := P.Add(time.Duration(i+1) * sh.I)
		own[name] = slot
		ctx := bg
		if name[0] == 'A' {
			ctx = lcDeadline(t, slot.Add(sh.D/2))
		} else if ctxOf != nil {
			if c := ctxOf(name); c != nil {
				ctx = c
			}
		}
		jobs[name] = lcSubmit(t, p, ctx, key)
	}
	return P, jobs, own
}

// TestReviewLCManyLateOneBatch: X, then one batch A1 B A2 C (slots P+I ..
// P+4I) in which A1 and A2 are refused late. B and C take the earliest
// slots (A1's, claimed, and B's), the top ones go back: X, B, C run at P,
// P+I, P+2I and the probe lands at P+3I. Plain, with three layered limits
// (the binding one I = 2 s), and with a burst.
func TestReviewLCManyLateOneBatch(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name   string
		limits []throttle.Limit
	}{
		{"plain", []throttle.Limit{throttle.PerMinute(30, 0)}},
		{"layered", []throttle.Limit{throttle.PerSecond(5, 0), throttle.PerMinute(30, 0), throttle.PerHour(1000, 10)}},
		{"burst", []throttle.Limit{throttle.PerMinute(30, 3)}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			r := newLCRig(t, tc.limits)
			p := r.newPool(t)
			sh := lcShape{I: 2 * time.Second, D: time.Second, pause: 3 * time.Second, names: []string{"A1", "B", "A2", "C"}}
			_, jobs, own := r.start(t, p, "k", sh, nil)
			time.Sleep(2*sh.D + 200*time.Millisecond) // both replies in
			r.proxy.SetReplyDelay(0)
			lcWait(t, p)
			P := jobs["X"].Reservation().Booking().At
			require.WithinDuration(t, own["X"], P, 300*time.Millisecond, "X booked at the pause's end")
			requireLateHeld(t, "A1", jobs["A1"], P.Add(sh.I))
			requireLateHeld(t, "A2", jobs["A2"], P.Add(3*sh.I))
			r.check(t, "k", P, sh.I, map[string]*pool.Job{"X": jobs["X"], "B": jobs["B"], "C": jobs["C"]})
		})
	}
}

// TestReviewLCLateAcrossBatches: X; then A1 B in one batch, and A2 C
// submitted while it is out (a batch of their own after it). Each late
// refusal's slot is taken by the wanted job after it: X, B, C run at P,
// P+I, P+2I; the probe lands at P+3I.
func TestReviewLCLateAcrossBatches(t *testing.T) {
	t.Parallel()
	r := newLCRig(t, []throttle.Limit{throttle.PerMinute(30, 0)})
	p := r.newPool(t)
	bg := context.Background()
	I, D := 2*time.Second, 800*time.Millisecond
	sh := lcShape{I: I, D: D, pause: 5 * time.Second, names: []string{"A1", "B"}}
	P, jobs, _ := r.start(t, p, "k", sh, nil)
	time.Sleep(D) // X in; A1 B out
	// A2's slot, once B's own (P+2I) has gone back: P+2I.
	jobs["A2"] = lcSubmit(t, p, lcDeadline(t, P.Add(2*I+D/2)), "k")
	jobs["C"] = lcSubmit(t, p, bg, "k")
	time.Sleep(3*D + 300*time.Millisecond) // A1 B in, B's own given back, A2 C out and in
	r.proxy.SetReplyDelay(0)
	lcWait(t, p)
	P = jobs["X"].Reservation().Booking().At
	requireLateHeld(t, "A1", jobs["A1"], P.Add(I))
	requireLateHeld(t, "A2", jobs["A2"], P.Add(2*I))
	r.check(t, "k", P, I, map[string]*pool.Job{"X": jobs["X"], "B": jobs["B"], "C": jobs["C"]})
}

// TestReviewLCLateAndCancelled: X, then one batch A K B C where A is
// refused late and K cancelled once booked: B and C take A's and K's
// slots, X B C run at P, P+I, P+2I; the probe lands at P+3I.
func TestReviewLCLateAndCancelled(t *testing.T) {
	t.Parallel()
	r := newLCRig(t, []throttle.Limit{throttle.PerMinute(30, 0)})
	p := r.newPool(t)
	kctx, cancelK := context.WithCancel(context.Background())
	defer cancelK()
	sh := lcShape{I: 2 * time.Second, D: time.Second, pause: 3 * time.Second, names: []string{"A", "K", "B", "C"}}
	_, jobs, _ := r.start(t, p, "k", sh, func(name string) context.Context {
		if name == "K" {
			return kctx
		}
		return nil
	})
	time.Sleep(2*sh.D + 200*time.Millisecond)
	cancelK()
	r.proxy.SetReplyDelay(0)
	lcWait(t, p)
	P := jobs["X"].Reservation().Booking().At
	requireLateHeld(t, "A", jobs["A"], P.Add(sh.I))
	require.ErrorIs(t, jobs["K"].Err(), context.Canceled)
	require.True(t, jobs["K"].Started().IsZero())
	r.check(t, "k", P, sh.I, map[string]*pool.Job{"X": jobs["X"], "B": jobs["B"], "C": jobs["C"]})
}

// TestReviewLCClaimedThenCancelled: X, then A B (C): A refused late, B
// claims A's slot and is cancelled right after. The claimed booking must
// go on to C (X C at P, P+I, probe P+2I), or with no C go back (X at P,
// probe P+I): not wasted, and not given back twice (the probe would land
// below).
func TestReviewLCClaimedThenCancelled(t *testing.T) {
	t.Parallel()
	for _, withC := range []bool{true, false} {
		t.Run(fmt.Sprintf("C=%v", withC), func(t *testing.T) {
			t.Parallel()
			r := newLCRig(t, []throttle.Limit{throttle.PerMinute(30, 0)})
			p := r.newPool(t)
			bctx, cancelB := context.WithCancel(context.Background())
			defer cancelB()
			names := []string{"A", "B"}
			if withC {
				names = append(names, "C")
			}
			sh := lcShape{I: 2 * time.Second, D: time.Second, pause: 3500 * time.Millisecond, names: names}
			_, jobs, _ := r.start(t, p, "k", sh, func(name string) context.Context {
				if name == "B" {
					return bctx
				}
				return nil
			})
			time.Sleep(2*sh.D + 200*time.Millisecond) // B has claimed A's slot
			r.proxy.SetReplyDelay(0)
			time.Sleep(100 * time.Millisecond)
			cancelB()
			lcWait(t, p)
			P := jobs["X"].Reservation().Booking().At
			requireLateHeld(t, "A", jobs["A"], P.Add(sh.I))
			require.ErrorIs(t, jobs["B"].Err(), context.Canceled)
			require.True(t, jobs["B"].Started().IsZero())
			ran := map[string]*pool.Job{"X": jobs["X"]}
			if withC {
				ran["C"] = jobs["C"]
			}
			time.Sleep(200 * time.Millisecond) // give-backs in
			r.check(t, "k", P, sh.I, ran)
		})
	}
}

// TestReviewLCCloseWithClaimPending: X, then A B: B claims A's slot; the
// pool is closed before any slot comes. Nothing runs (X and B end with
// ErrClosed), and every booking goes back, once: the probe lands at P.
func TestReviewLCCloseWithClaimPending(t *testing.T) {
	t.Parallel()
	r := newLCRig(t, []throttle.Limit{throttle.PerMinute(30, 0)})
	p := r.newPool(t)
	sh := lcShape{I: 2 * time.Second, D: time.Second, pause: 3500 * time.Millisecond, names: []string{"A", "B", "C"}}
	_, jobs, own := r.start(t, p, "k", sh, nil)
	time.Sleep(2*sh.D + 200*time.Millisecond)
	r.proxy.SetReplyDelay(0)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	require.NoError(t, p.Close(ctx))
	P := jobs["X"].Reservation().Booking().At
	require.WithinDuration(t, own["X"], P, 300*time.Millisecond, "X booked at the pause's end")
	requireLateHeld(t, "A", jobs["A"], P.Add(sh.I))
	for _, n := range []string{"X", "B", "C"} {
		require.ErrorIs(t, jobs[n].Err(), pool.ErrClosed, n)
		require.True(t, jobs[n].Started().IsZero(), n)
	}
	b := r.probeBook(t, "k")
	require.Equal(t, P, b.At, "every booking given back once: the probe takes the pause's end P (it landed at P+%v)", b.At.Sub(P))
}

// TestReviewLCLease: WithLease (leases straight to Redis, plenty), so each
// job books alone: A (refused late) out first, B 300 ms after, both
// replies held back D. B takes A's slot: B runs at P, the probe lands at
// P+I.
func TestReviewLCLease(t *testing.T) {
	t.Parallel()
	r := newLCRig(t, []throttle.Limit{throttle.PerMinute(30, 0)})
	sem, err := lease.New(r.probe, "lcsem", 8, lease.WithTTL(30*time.Second))
	require.NoError(t, err)
	t.Cleanup(func() { _ = sem.Close(context.Background()) })
	p := r.newPool(t, pool.WithLease(sem))
	bg := context.Background()
	I, D := 2*time.Second, time.Second
	pauseAt := time.Now()
	require.NoError(t, r.lim.Pause(bg, "k", 3*time.Second))
	P := pauseAt.Add(3 * time.Second)
	r.proxy.SetReplyDelay(D)
	a := lcSubmit(t, p, lcDeadline(t, P.Add(D/2)), "k")
	time.Sleep(300 * time.Millisecond)
	b := lcSubmit(t, p, bg, "k")
	time.Sleep(D + 500*time.Millisecond)
	r.proxy.SetReplyDelay(0)
	lcWait(t, p)
	P = a.Reservation().Booking().At
	requireLateHeld(t, "A", a, P)
	r.check(t, "k", P, I, map[string]*pool.Job{"B": b})
}

// TestReviewLCHeldImmediateNotGivenBack: a job whose slot is immediate (an
// idle key) and whose deadline passes while the reply is out is refused
// late, its booking held for the pool. Nothing ran on the key, so a
// textbook GCRA of what ran books the next request at once; and Cancel of
// a held refusal gives its room back even once its slot has come
// (reserve's Cancel doc; CHANGELOG, helper-74). The pool forgets it
// instead (takeRefundsLocked: "refused late: nothing left to give"): the
// probe waits one interval. Controls in the same run: the same request
// through ReserveBatch without HoldLate (reserve gives it back itself),
// and with HoldLate and the caller's Cancel.
func TestReviewLCHeldImmediateNotGivenBack(t *testing.T) {
	t.Parallel()
	r := newLCRig(t, []throttle.Limit{throttle.PerMinute(30, 0)}) // I = 2 s
	p := r.newPool(t)
	bg := context.Background()
	r.proxy.SetReplyDelay(300 * time.Millisecond)
	a := lcSubmit(t, p, lcDeadline(t, time.Now().Add(100*time.Millisecond)), "k")
	rs1, err := r.lim.ReserveBatch(bg, "ctl1", []reserve.BatchRequest{{Context: lcDeadline(t, time.Now().Add(100*time.Millisecond)), N: 1}})
	require.NoError(t, err)
	rs2, err := r.lim.ReserveBatch(bg, "ctl2", []reserve.BatchRequest{{Context: lcDeadline(t, time.Now().Add(100*time.Millisecond)), N: 1, HoldLate: true}})
	require.NoError(t, err)
	r.proxy.SetReplyDelay(0)
	lcWait(t, p)
	require.ErrorIs(t, a.Err(), deadline.ErrWouldExceedDeadline, "the test's premise: refused late")
	held := a.Reservation()
	require.True(t, held.Booking().OK, "the test's premise: held")
	require.Zero(t, held.Booking().Wait, "the test's premise: an immediate slot")
	require.ErrorIs(t, rs1[0].Err(), deadline.ErrWouldExceedDeadline)
	require.True(t, rs2[0].Booking().OK, "control 2 held")
	require.NoError(t, rs2[0].Cancel(bg))
	time.Sleep(300 * time.Millisecond) // any give-back in
	for _, k := range []string{"ctl1", "ctl2"} {
		require.Zero(t, r.probeBook(t, k).Wait, "control %s: the late refusal's room came back", k)
	}
	b := r.probeBook(t, "k")
	require.Zero(t, b.Wait, "nothing ran on k, yet the probe waits %v: the pool never gave back job A's held booking (slot %v)", b.Wait, held.Booking().At)
}

// --- reserve.Reservation.Claim, straight ---

// heldRefusal books, for a fresh key paused for pause, one request of a
// ReserveBatch with HoldLate whose deadline the reply (held back D) makes
// it miss. It returns the held refusal; its slot is the pause's end.
func (r *lcRig) heldRefusal(t *testing.T, key string, pause, D time.Duration) *reserve.Reservation {
	t.Helper()
	bg := context.Background()
	pauseAt := time.Now()
	require.NoError(t, r.lim.Pause(bg, key, pause))
	r.proxy.SetReplyDelay(D)
	defer r.proxy.SetReplyDelay(0)
	rs, err := r.lim.ReserveBatch(bg, key, []reserve.BatchRequest{{Context: lcDeadline(t, pauseAt.Add(pause+D/2)), N: 1, HoldLate: true}})
	require.NoError(t, err)
	h := rs[0]
	require.ErrorIs(t, h.Err(), deadline.ErrWouldExceedDeadline, "the test's premise: refused late")
	require.True(t, h.Booking().OK, "the test's premise: held")
	return h
}

// TestReviewLCClaimAfterLostCancel: a held refusal's Cancel whose reply is
// lost (its context ends while the reply is held back) returns an error;
// the refund ran in Redis all the same (RefundUnused: the room is back).
// Claim then still hands out an OK Reservation of that slot, for a caller
// to act in, while the probe books the same slot: two callers act in one
// slot, one of them early on a textbook GCRA (which counts the claimed
// booking: the probe must land one interval after it).
func TestReviewLCClaimAfterLostCancel(t *testing.T) {
	t.Parallel()
	r := newLCRig(t, []throttle.Limit{throttle.PerMinute(30, 0)})
	bg := context.Background()
	I := 2 * time.Second
	h := r.heldRefusal(t, "k", 2*time.Second, 400*time.Millisecond)
	r.proxy.SetReplyDelay(time.Second)
	cctx, cancel := context.WithTimeout(bg, 200*time.Millisecond)
	cerr := h.Cancel(cctx)
	cancel()
	require.Error(t, cerr, "the test's premise: the Cancel's reply was lost")
	time.Sleep(1200 * time.Millisecond) // the held-back reply drained
	r.proxy.SetReplyDelay(0)
	c := h.Claim()
	if c == nil {
		return // Claim refused a booking whose Cancel may have given it back: fine
	}
	require.True(t, c.OK())
	b := r.probeBook(t, "k")
	t.Logf("Cancel: %v; claimed slot %v; probe %v; claimed Cancel: %v", cerr, c.Booking().At.Format(time.StampMilli), b.At.Format(time.StampMilli), c.Cancel(bg))
	require.False(t, b.At.Before(c.Booking().At.Add(I)),
		"Claim after a failed Cancel handed out slot %v, whose room that Cancel gave back: the probe booked it too (P+%v)",
		c.Booking().At.Format(time.StampMilli), b.At.Sub(c.Booking().At))
}

// TestReviewLCClaimRaces: Claim racing a second Claim, Cancel, View,
// Booking, SlotAt and the view's Claim, from other goroutines (run with
// -race). Exactly one outcome: one claim won and Cancel gave nothing back
// (the probe lands one interval after the held slot), or Cancel won and
// both claims are nil (the probe takes the held slot).
func TestReviewLCClaimRaces(t *testing.T) {
	t.Parallel()
	r := newLCRig(t, []throttle.Limit{throttle.PerMinute(30, 0)})
	bg := context.Background()
	I := 2 * time.Second
	won := map[string]int{}
	for i := range 8 {
		key := fmt.Sprintf("k%d", i)
		h := r.heldRefusal(t, key, 1500*time.Millisecond, 300*time.Millisecond)
		at := h.Booking().At
		var (
			wg          sync.WaitGroup
			start       = make(chan struct{})
			claims      [2]*reserve.Reservation
			cerr        error
			viewClaimed bool
		)
		for k := range 2 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				<-start
				if i%2 == 1 {
					time.Sleep(time.Duration(k) * 200 * time.Microsecond) // let Cancel in first, at times
				}
				claims[k] = h.Claim()
			}()
		}
		wg.Add(2)
		go func() { defer wg.Done(); <-start; cerr = h.Cancel(bg) }()
		go func() {
			defer wg.Done()
			<-start
			for range 50 {
				v := h.View()
				_ = v.Booking()
				_ = v.SlotAt()
				_ = h.Booking()
				_ = h.SlotAt()
				_ = h.OK()
				if v.Claim() != nil {
					viewClaimed = true
				}
			}
		}()
		close(start)
		wg.Wait()
		require.False(t, viewClaimed, "a view claimed")
		require.NoError(t, cerr)
		n := 0
		var c *reserve.Reservation
		for _, x := range claims {
			if x != nil {
				n++
				c = x
			}
		}
		require.LessOrEqual(t, n, 1, "%s: claimed twice", key)
		b := r.probeBook(t, key)
		if n == 1 {
			won["claim"]++
			require.True(t, c.OK())
			require.Equal(t, at, c.Booking().At)
			require.Equal(t, at.Add(I), b.At, "%s: claimed, yet the room came back (the probe at held+%v)", key, b.At.Sub(at))
			require.Nil(t, h.Claim())
		} else {
			won["cancel"]++
			require.Equal(t, at, b.At, "%s: cancelled, the room came back: the probe takes the held slot (it took held+%v)", key, b.At.Sub(at))
		}
	}
	t.Logf("outcomes: %v", won)
}

// TestReviewLCClaimMisc: a claimed Reservation is OK, of the held slot;
// Claim of it, of its view, of the held one again, of an OK one, is nil;
// the held one's Cancel after Claim gives nothing back; the claimed one's
// Cancel before its slot gives the room back once (Cancel twice, and the
// held one's, give nothing more); after its slot it gives nothing back.
func TestReviewLCClaimMisc(t *testing.T) {
	t.Parallel()
	r := newLCRig(t, []throttle.Limit{throttle.PerMinute(30, 0)})
	bg := context.Background()
	I := 2 * time.Second

	h := r.heldRefusal(t, "k1", 1500*time.Millisecond, 300*time.Millisecond)
	at := h.Booking().At
	require.Nil(t, h.View().Claim(), "a view of a held refusal")
	c := h.Claim()
	require.NotNil(t, c)
	require.True(t, c.OK(), "%v", c.Err())
	require.Equal(t, at, c.Booking().At)
	require.False(t, c.SlotAt().IsZero())
	require.False(t, c.SlotAt().Before(at), "the claimed SlotAt before its slot on the Redis clock")
	require.Nil(t, h.Claim(), "claimed twice")
	require.Nil(t, c.Claim(), "a claimed one")
	require.Nil(t, c.View().Claim(), "a claimed one's view")
	require.False(t, h.OK(), "the refusal stays a refusal")
	require.NoError(t, h.Cancel(bg))
	require.Equal(t, at.Add(I), r.probeBook(t, "k1").At, "the held one's Cancel after Claim gave the claimed room back")

	h = r.heldRefusal(t, "k2", 1500*time.Millisecond, 300*time.Millisecond)
	at = h.Booking().At
	c = h.Claim()
	require.NotNil(t, c)
	require.NoError(t, c.Cancel(bg))
	require.NoError(t, c.Cancel(bg))
	require.NoError(t, h.Cancel(bg))
	p1 := r.probeBook(t, "k2")
	require.Equal(t, at, p1.At, "the claimed one's Cancel before its slot: the room came back")
	p2 := r.probeBook(t, "k2")
	require.Equal(t, at.Add(I), p2.At, "given back more than once")

	h = r.heldRefusal(t, "k3", 1500*time.Millisecond, 300*time.Millisecond)
	at = h.Booking().At
	c = h.Claim()
	require.NotNil(t, c)
	require.NoError(t, c.Wait(bg))
	require.False(t, time.Now().Before(at), "the claimed Wait returned before the slot")
	require.NoError(t, c.Cancel(bg))
	require.NoError(t, h.Cancel(bg))
	require.Equal(t, at.Add(I), r.probeBook(t, "k3").At, "a claimed slot that has come gave its room back (its holder may have acted)")

	ok, err := r.lim.Reserve(bg, "k4")
	require.NoError(t, err)
	require.Nil(t, ok.Claim(), "an OK Reservation")
}

// TestReviewLCClaimFallback: with Redis unreachable, a ReserveBatch with
// HoldLate answered by the fallback: Claim of it (and of its view) is nil.
func TestReviewLCClaimFallback(t *testing.T) {
	t.Parallel()
	srv := redistest.Shared(t)
	px := redistest.NewProxy(t, srv.Addr)
	eng, err := throttle.New(px.Client(t, srv), throttle.WithPrefix(redistest.Prefix(t)), throttle.WithTimeout(300*time.Millisecond))
	require.NoError(t, err)
	lim, err := reserve.New(eng, "lc", throttle.PerSecond(10, 0), reserve.WithFallback(reserve.FailOpen()))
	require.NoError(t, err)
	px.Close()
	bg := context.Background()
	var got *reserve.Reservation
	for range 20 {
		rs, err := lim.ReserveBatch(bg, "k", []reserve.BatchRequest{{Context: lcDeadline(t, time.Now().Add(time.Second)), N: 1, HoldLate: true}, {N: 1, HoldLate: true}})
		if err == nil && rs[0].Fallback() {
			for _, x := range rs {
				require.Nil(t, x.Claim(), "a fallback's answer claimed")
				require.Nil(t, x.View().Claim())
			}
			got = rs[0]
			break
		}
		if err != nil && !errors.Is(err, throttle.ErrUnavailable) {
			t.Fatalf("unexpected: %v", err)
		}
		time.Sleep(50 * time.Millisecond)
	}
	require.NotNil(t, got, "the fallback never answered")
}

// TestReviewLCHandedSlotPassedOnRedisClock: the replies are held back
// longer than A's slot lies ahead of the decision, so on the Redis clock
// A's slot has passed when its refusal arrives, though locally (its wait
// counted from the reply) it has not. B takes it all the same: it must not
// start before that slot on the Redis clock, and nothing may be wasted or
// given back twice (X, B at P, P+I; the probe at P+2I).
func TestReviewLCHandedSlotPassedOnRedisClock(t *testing.T) {
	t.Parallel()
	r := newLCRig(t, []throttle.Limit{throttle.Every(2400*time.Millisecond, 1, 0)})
	p := r.newPool(t)
	sh := lcShape{I: 2400 * time.Millisecond, D: 1500 * time.Millisecond, pause: 200 * time.Millisecond, names: []string{"A", "B"}}
	_, jobs, own := r.start(t, p, "k", sh, nil)
	time.Sleep(2*sh.D + 200*time.Millisecond)
	r.proxy.SetReplyDelay(0)
	lcWait(t, p)
	P := jobs["X"].Reservation().Booking().At
	require.WithinDuration(t, own["X"], P, 300*time.Millisecond, "X booked at the pause's end")
	requireLateHeld(t, "A", jobs["A"], P.Add(sh.I))
	r.check(t, "k", P, sh.I, map[string]*pool.Job{"X": jobs["X"], "B": jobs["B"]})
}

// TestReviewLCCancelledJobGetsRefusal: X, then one batch C A B: C is
// cancelled while the batch is out, A refused late. B takes C's slot, and
// the booking left to C, to give back, is A's held one. Slots: X, B at P,
// P+I, the probe at P+2I (checked). But C, a job booked (OK) and then
// cancelled, reports through Job.Reservation a deadline refusal it never
// had: OK false, Err matching ErrWouldExceedDeadline (A's).
func TestReviewLCCancelledJobGetsRefusal(t *testing.T) {
	t.Parallel()
	r := newLCRig(t, []throttle.Limit{throttle.PerMinute(30, 0)})
	p := r.newPool(t)
	cctx, cancelC := context.WithCancel(context.Background())
	defer cancelC()
	sh := lcShape{I: 2 * time.Second, D: time.Second, pause: 3 * time.Second, names: []string{"C", "A", "B"}}
	_, jobs, _ := r.start(t, p, "k", sh, func(name string) context.Context {
		if name == "C" {
			return cctx
		}
		return nil
	})
	time.Sleep(sh.D + 400*time.Millisecond) // the batch out, its reply held back
	cancelC()
	time.Sleep(sh.D)
	r.proxy.SetReplyDelay(0)
	lcWait(t, p)
	P := jobs["X"].Reservation().Booking().At
	requireLateHeld(t, "A", jobs["A"], P.Add(2*sh.I))
	r.check(t, "k", P, sh.I, map[string]*pool.Job{"X": jobs["X"], "B": jobs["B"]})
	c := jobs["C"]
	require.ErrorIs(t, c.Err(), context.Canceled)
	res := c.Reservation()
	require.NotNil(t, res, "C was booked")
	t.Logf("C: Err %v; Reservation OK %v, Err %v, Booking %+v", c.Err(), res.OK(), res.Err(), res.Booking().At.Sub(P))
	require.NotErrorIs(t, res.Err(), deadline.ErrWouldExceedDeadline,
		"C was booked and cancelled, never refused, yet its Reservation is a deadline refusal (OK %v): another job's held refusal", res.OK())
}

// TestReviewLCClaimAfterUnsentCancel: a held refusal's Cancel fails
// without reaching Redis (its request held back, then the connection
// dropped). The refusal cannot tell that nothing reached Redis, so Claim
// refuses it (nil, as after a lost reply: see
// TestReviewLCClaimAfterLostCancel), and the refusal's own Cancel, tried
// again, gives the room back the way the first try would have: the probe
// then takes the held slot P. (Found by helper-84: Claim used to hand the
// booking out here, and the claimed Reservation's Cancel then failed every
// time, a booking given back "one way only", and its room was lost.)
func TestReviewLCClaimAfterUnsentCancel(t *testing.T) {
	t.Parallel()
	r := newLCRig(t, []throttle.Limit{throttle.PerMinute(30, 0)})
	bg := context.Background()
	h := r.heldRefusal(t, "k", 3*time.Second, 400*time.Millisecond)
	at := h.Booking().At
	r.proxy.SetLatency(2 * time.Second)
	errc := make(chan error, 1)
	go func() { errc <- h.Cancel(bg) }()
	time.Sleep(300 * time.Millisecond) // the refund's request held at the proxy
	r.proxy.Sever()                    // ... and dropped: it never reaches Redis
	cerr := <-errc
	r.proxy.SetLatency(0)
	require.Error(t, cerr, "the test's premise: the Cancel failed")
	require.Nil(t, h.Claim(), "a Cancel was tried: its booking is not handed out")
	// Tried again until it goes through (the dropped connection opened the
	// engine's breaker until a probe succeeds).
	var cerr2 error
	require.Eventually(t, func() bool { cerr2 = h.Cancel(bg); return cerr2 == nil }, 10*time.Second, 50*time.Millisecond,
		"the refusal's Cancel, tried again: %v", cerr2)
	b := r.probeBook(t, "k")
	t.Logf("first Cancel: %v; probe at held+%v", cerr, b.At.Sub(at))
	require.Equal(t, at, b.At, "the held booking, cancelled again, gave nothing back: the probe landed at held+%v", b.At.Sub(at))
}
