package throttle_test

// Adversarial review of "throttle: Book, BookBatch and BookAll read their
// reply past the caller's deadline and give back what an ended caller
// booked" (helper-79). Every test is named TestReviewBDL*. Two tests
// failed on 2412859 (findings, marked [FAILED] below):
// TestReviewBDLGiveBackStopsWhenNothingCanComeBack and
// TestReviewBDLGiveBackCostPerBooking; they pass since the engine gives a
// call's bookings back in one refund (the tests that counted a give-back
// per booking now count one). The oracle is a textbook
// GCRA (bdlModel) replayed over the slots that actually stand, judged on
// the Redis clock (Booking.At - Booking.Wait is the decision time; State
// reads the stored TAT exactly).

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/slotbook/slotbook/internal/callcount"
	"github.com/slotbook/slotbook/internal/redistest"
	"github.com/slotbook/slotbook/reserve"
	"github.com/slotbook/slotbook/throttle"
)

// ---------------------------------------------------------------- observer

type bdlObs struct {
	mu      sync.Mutex
	dec     map[throttle.Outcome]int
	refunds int
	given   time.Duration
	zero    int // refunds that gave nothing
}

func newBDLObs() *bdlObs { return &bdlObs{dec: map[throttle.Outcome]int{}} }

func (o *bdlObs) ObserveDecision(_ string, out throttle.Outcome, _ time.Duration) {
	o.mu.Lock()
	o.dec[out]++
	o.mu.Unlock()
}
func (o *bdlObs) ObserveCall(string, time.Duration, error) {}
func (o *bdlObs) ObserveRefund(_ string, given time.Duration) {
	o.mu.Lock()
	o.refunds++
	o.given += given
	if given == 0 {
		o.zero++
	}
	o.mu.Unlock()
}
func (o *bdlObs) ObserveBreaker(bool) {}

type bdlObsSnap struct {
	booked, refused, allowed, denied, refunds, zero int
	given                                           time.Duration
}

func (o *bdlObs) snap() bdlObsSnap {
	o.mu.Lock()
	defer o.mu.Unlock()
	return bdlObsSnap{o.dec[throttle.Booked], o.dec[throttle.Refused], o.dec[throttle.Allowed], o.dec[throttle.Denied], o.refunds, o.zero, o.given}
}

func (a bdlObsSnap) minus(b bdlObsSnap) bdlObsSnap {
	return bdlObsSnap{a.booked - b.booked, a.refused - b.refused, a.allowed - b.allowed, a.denied - b.denied,
		a.refunds - b.refunds, a.zero - b.zero, a.given - b.given}
}

// ---------------------------------------------------------------- rig

type bdlRig struct {
	srv   *redistest.Server
	p     *redistest.Proxy
	rdb   *redis.Client // through the proxy
	calls *callcount.Counter
	eng   *throttle.Engine // through the proxy, observed
	other *throttle.Engine // straight to the server, same prefix
	obs   *bdlObs
	held  *bdlHold
}

// bdlHold is a go-redis hook that, once armed (hold), lets the next call
// run in Redis and have its reply read, then holds that reply back from
// the engine until released. A reply held back at the proxy had to be in
// the proxy (stamped with the delay) before a timer set the delay back to
// zero, and the call sent before a short deadline: a stall of the caller's
// goroutine broke the scene. Here the test releases the reply once its
// caller has ended and the others have acted.
type bdlHold struct {
	mu      sync.Mutex // guards ran and release
	ran     chan error
	release chan struct{}
}

func (h *bdlHold) DialHook(next redis.DialHook) redis.DialHook { return next }
func (h *bdlHold) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}
func (h *bdlHold) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		err := next(ctx, cmd)
		h.mu.Lock()
		ran, release := h.ran, h.release
		h.ran, h.release = nil, nil
		h.mu.Unlock()
		if ran != nil {
			ran <- err
			<-release
		}
		return err
	}
}

// hold arms r's hook for the next call through r.rdb: ran gets that
// call's own error once its reply is read (nil: it ran in Redis), and the
// engine gets the reply only once release is closed.
func (r *bdlRig) hold() (ran <-chan error, release chan<- struct{}) {
	rc, rel := make(chan error, 1), make(chan struct{})
	r.held.mu.Lock()
	r.held.ran, r.held.release = rc, rel
	r.held.mu.Unlock()
	return rc, rel
}

// heldRan waits (up to 5 s) for the held call's reply, and requires that
// the call ran in Redis: the premise of a reply held past its caller's end.
func heldRan(t *testing.T, ran <-chan error, what string) {
	t.Helper()
	select {
	case err := <-ran:
		require.NoError(t, err, "%s: the test's premise: the held call ran in Redis", what)
	case <-time.After(5 * time.Second):
		t.Fatalf("%s: the test's premise: the held call never went out", what)
	}
}

// endInFlight makes the context of a call through r that ends while the
// call's reply is held back (r.hold), at d from now (its deadline, or a
// cancel), or, if cancelled and the call has not run in Redis by then,
// once it has; the reply is released once the context has ended. fired gets nil then, or the premise's failure: the
// held call did not run in Redis, or never went out (5 s). It replaces a
// deadline (or a cancel timer) of 60 ms against a reply held 200 ms at the
// proxy, which a stall of 70 ms before the call outran: the call was
// refused unsent.
func (r *bdlRig) endInFlight(cancelled bool, d time.Duration) (ctx context.Context, cancel context.CancelFunc, fired <-chan error, want error) {
	ran, release := r.hold()
	start := time.Now()
	if cancelled {
		ctx, cancel = context.WithCancel(context.Background())
		want = context.Canceled
	} else {
		ctx, cancel = context.WithTimeout(context.Background(), d)
		want = context.DeadlineExceeded
	}
	f := make(chan error, 1)
	go func() {
		defer close(release)
		select {
		case err := <-ran:
			if cancelled {
				time.Sleep(time.Until(start.Add(d)))
				cancel()
			}
			<-ctx.Done()
			f <- err
		case <-time.After(5 * time.Second):
			f <- errors.New("the held call never went out")
		}
	}()
	return ctx, cancel, f, want
}

// endedInFlight requires fired (from endInFlight) to report that the call
// ran in Redis, its reply held past its caller's end: the test's premise.
func endedInFlight(t *testing.T, fired <-chan error, what string) {
	t.Helper()
	require.NoError(t, <-fired, "%s: the test's premise: the call ran in Redis, its reply held past its caller's end", what)
}

// bdlNewRig builds an engine through a proxy to srv, with pool warm
// connections (MinIdleConns = pool, waited for), and another engine on the
// same prefix straight to srv for reading State and booking beside it.
func bdlNewRig(t *testing.T, srv *redistest.Server, pool int, timeout time.Duration, opts ...throttle.Option) *bdlRig {
	t.Helper()
	p := redistest.NewProxy(t, srv.Addr)
	rdb := p.Client(t, srv, func(o *redis.Options) { o.PoolSize, o.MinIdleConns = pool, pool })
	calls := callcount.Attach(rdb)
	held := &bdlHold{}
	rdb.AddHook(held)
	prefix := redistest.Prefix(t)
	obs := newBDLObs()
	eng, err := throttle.New(rdb, append([]throttle.Option{throttle.WithPrefix(prefix), throttle.WithTimeout(timeout), throttle.WithObserver(obs)}, opts...)...)
	require.NoError(t, err)
	require.NoError(t, eng.Load(context.Background()))
	other, err := throttle.New(srv.Client(t), throttle.WithPrefix(prefix), throttle.WithTimeout(5*time.Second))
	require.NoError(t, err)
	require.NoError(t, other.Load(context.Background()))
	// Every connection open before replies are held back: a call must not
	// be cut short while dialling (the handshake's reply would be held too).
	deadline := time.Now().Add(10 * time.Second)
	for int(rdb.PoolStats().IdleConns) < pool {
		require.True(t, time.Now().Before(deadline), "pool never warmed: %+v", rdb.PoolStats())
		time.Sleep(5 * time.Millisecond)
	}
	require.NoError(t, rdb.Ping(context.Background()).Err())
	return &bdlRig{srv: srv, p: p, rdb: rdb, calls: calls, eng: eng, other: other, obs: obs, held: held}
}

// awaitHolder waits until a holder started after r.calls read calls0 has
// its call in flight (counted, and a connection of the pool taken), and
// returns r.calls then. It replaces sleeps of 50 and 60 ms, which a stall
// of the holder's goroutine outran: the callers under test then found the
// connection free, or the holder's call was counted as theirs.
func (r *bdlRig) awaitHolder(t *testing.T, calls0 int64) int64 {
	t.Helper()
	pool := uint32(r.rdb.Options().PoolSize)
	require.Eventually(t, func() bool {
		return r.calls.Load() > calls0 && r.rdb.PoolStats().IdleConns < pool
	}, 5*time.Second, time.Millisecond, "the holder's call in flight")
	return r.calls.Load()
}

// warm waits until the pool holds its warm connections again (a call cut
// short costs its connection) and no reply is held back.
func (r *bdlRig) warm(t *testing.T) {
	t.Helper()
	r.p.SetReplyDelay(0)
	pool := r.rdb.Options().PoolSize
	deadline := time.Now().Add(10 * time.Second)
	for int(r.rdb.PoolStats().IdleConns) < pool {
		require.True(t, time.Now().Before(deadline), "pool never warmed: %+v", r.rdb.PoolStats())
		time.Sleep(5 * time.Millisecond)
	}
	require.NoError(t, r.rdb.Ping(context.Background()).Err())
}

// ---------------------------------------------------------------- oracle

// bdlModel is a textbook GCRA over one subject's limits: tats[k] is the
// theoretical arrival time of limit k in µs on the Redis clock (0: idle).
type bdlModel struct {
	I, tau []int64
	tats   []int64
}

func bdlNewModel(lims ...throttle.Limit) *bdlModel {
	m := &bdlModel{}
	for _, l := range lims {
		I := int64(l.Interval() / time.Microsecond)
		m.I = append(m.I, I)
		m.tau = append(m.tau, I*int64(l.Burst))
		m.tats = append(m.tats, 0)
	}
	return m
}

func (m *bdlModel) clone() *bdlModel {
	return &bdlModel{I: m.I, tau: m.tau, tats: append([]int64(nil), m.tats...)}
}

func bdlMW(d time.Duration) int64 {
	if d >= throttle.MaxHorizon {
		d = throttle.MaxHorizon
	}
	return int64(d / time.Microsecond)
}

// book judges r at now: the slot is the earliest instant every limit
// conforms; it is booked if its wait is within r.MaxWait.
func (m *bdlModel) book(now int64, r throttle.Request) (ok bool, wait int64) {
	slot := now
	for k := range m.I {
		tat := max(m.tats[k], now)
		slot = max(slot, tat+int64(r.N-1)*m.I[k]-m.tau[k])
	}
	wait = slot - now
	if wait > bdlMW(r.MaxWait) {
		return false, wait
	}
	for k := range m.I {
		m.tats[k] = max(max(m.tats[k], now), slot) + int64(r.N)*m.I[k]
	}
	return true, wait
}

// bdlNow is a booking's decision time on the Redis clock, in µs.
func bdlNow(b throttle.Booking) int64 { return b.At.UnixMicro() - b.Wait.Microseconds() }

// replay books reqs in m at now and checks that bs are the textbook's
// answers: booked alike, the same wait and slot to the microsecond.
func (m *bdlModel) replay(t *testing.T, what string, now int64, reqs []throttle.Request, bs []throttle.Booking) {
	t.Helper()
	require.Len(t, bs, len(reqs), what)
	for i, r := range reqs {
		ok, wait := m.book(now, r)
		require.Equal(t, ok, bs[i].OK, "%s: request %d (%+v): booked", what, i, r)
		require.Equal(t, wait, bs[i].Wait.Microseconds(), "%s: request %d (%+v): wait (the exact retry-after for a refusal)", what, i, r)
		require.Equal(t, now+wait, bs[i].At.UnixMicro(), "%s: request %d: slot", what, i)
	}
}

// requireState checks keys' stored TATs against m on the Redis clock, and
// State's Available (how many units pass at once) against the textbook.
func bdlRequireState(t *testing.T, eng *throttle.Engine, what string, keys []string, lims []throttle.Limit, m *bdlModel) {
	t.Helper()
	st, err := eng.State(context.Background(), keys, lims)
	require.NoError(t, err, what)
	now := st.Now.UnixMicro()
	avail := 1 << 30
	for k, ks := range st.Keys {
		want := m.tats[k]
		if want > now {
			require.True(t, ks.Exists, "%s: key %s must hold TAT %d (now %d)", what, keys[k], want, now)
			require.Equal(t, want, ks.TAT.UnixMicro(), "%s: key %s TAT (textbook)", what, keys[k])
		} else if ks.Exists {
			require.LessOrEqual(t, ks.TAT.UnixMicro(), now, "%s: key %s must be idle, TAT %v", what, keys[k], ks.TAT)
		}
		tat := max(want, now)
		a := (now+m.tau[k]-tat)/m.I[k] + 1 // now+tau-tat >= 0 here (nothing booked beyond tau ahead in these tests)
		if now+m.tau[k]-tat < 0 {
			a = 0
		}
		avail = min(avail, int(min(a, int64(lims[k].Burst)+1)))
	}
	require.Equal(t, avail, st.Available, "%s: units that pass at once (textbook)", what)
}

func bdlEnded(t *testing.T, err error, want error, what string) {
	t.Helper()
	require.Error(t, err, what)
	require.ErrorIs(t, err, want, what)
	require.NotErrorIs(t, err, throttle.ErrReplyLost, "%s: the reply must be read, not lost", what)
}

// bdlCtx is a context that ends at d from now: by its deadline, or
// cancelled by a timer.
func bdlCtx(cancelled bool, d time.Duration) (context.Context, context.CancelFunc, error) {
	if cancelled {
		ctx, cancel := context.WithCancel(context.Background())
		tm := time.AfterFunc(d, cancel)
		return ctx, func() { tm.Stop(); cancel() }, context.Canceled
	}
	ctx, cancel := context.WithTimeout(context.Background(), d)
	return ctx, cancel, context.DeadlineExceeded
}

func bdlMode(cancelled bool) string {
	if cancelled {
		return "cancel"
	}
	return "deadline"
}

var bdlForever = throttle.Request{N: 1, MaxWait: throttle.Forever}

// ---------------------------------------------------------------- tests

// TestReviewBDLBatchMixedComesBackExactly: a BookBatch with refused
// requests mixed among booked ones (the key's burst spent by someone else
// first), whose caller's deadline passes (or who cancels) while the reply
// is held back. The caller gets its context's error, the key comes back to
// exactly where it was (the stored TAT, the units that pass at once, a
// refused request's retry-after), the Observer counts every decision and
// one refund per booking, giving back N*I each, and the same batch retried
// gets exactly the textbook's answers.
func TestReviewBDLBatchMixedComesBackExactly(t *testing.T) {
	t.Parallel()
	r := bdlNewRig(t, redistest.Shared(t), 1, 10*time.Second)
	lim := throttle.Every(time.Hour, 60, 4) // I = 1 min, tau = 4 min: the test's run time is nothing beside I
	reqs := []throttle.Request{
		{N: 3, MaxWait: 0},                // refused
		{N: 2, MaxWait: 0},                // booked at once
		{N: 1, MaxWait: 0},                // refused
		{N: 1, MaxWait: throttle.Forever}, // booked, a minute out
		{N: 2, MaxWait: 30 * time.Second}, // refused
		{N: 1, MaxWait: throttle.Forever}, // booked
		{N: 1, MaxWait: 59 * time.Second}, // refused
	}
	for _, cancelled := range []bool{false, true} {
		t.Run(bdlMode(cancelled), func(t *testing.T) {
			key := "mix:" + bdlMode(cancelled)
			bg := context.Background()
			m := bdlNewModel(lim)
			pre, err := r.other.Book(bg, key, lim, throttle.Request{N: 3, MaxWait: 0})
			require.NoError(t, err)
			m.replay(t, "pre", bdlNow(pre), []throttle.Request{{N: 3, MaxWait: 0}}, []throttle.Booking{pre})
			bdlRequireState(t, r.other, "before", []string{key}, []throttle.Limit{lim}, m)

			o0, c0 := r.obs.snap(), r.calls.Load()
			ctx, cancel, fired, want := r.endInFlight(cancelled, 200*time.Millisecond)
			bs, err := r.eng.BookBatch(ctx, key, lim, reqs)
			cancel()
			endedInFlight(t, fired, "ended batch")
			bdlEnded(t, err, want, "ended batch")
			require.Nil(t, bs)
			o := r.obs.snap().minus(o0)
			sent := r.calls.Load() - c0

			bdlRequireState(t, r.other, "after the give-back", []string{key}, []throttle.Limit{lim}, m)
			require.Equal(t, int64(1+1), sent, "the booking and one give-back for its bookings")
			require.Equal(t, 3, o.booked, "observer: booked")
			require.Equal(t, 4, o.refused, "observer: refused")
			require.Equal(t, 1, o.refunds, "observer: refunds")
			require.Equal(t, 4*time.Minute, o.given, "observer: time given back, N*I per booking on a key booked ahead")

			// A refused request's retry-after, on the Redis clock: its slot
			// is the textbook's.
			probe := throttle.Request{N: 3, MaxWait: 0}
			pb, err := r.other.Book(bg, key, lim, probe)
			require.NoError(t, err)
			m.clone().replay(t, "refused probe", bdlNow(pb), []throttle.Request{probe}, []throttle.Booking{pb})
			require.False(t, pb.OK)

			// The same batch again, no deadline: the textbook's answers.
			bs, err = r.eng.BookBatch(bg, key, lim, reqs)
			require.NoError(t, err)
			m.replay(t, "retried batch", bdlNow(bs[0]), reqs, bs)
			bdlRequireState(t, r.other, "after the retry", []string{key}, []throttle.Limit{lim}, m)
		})
	}
}

// TestReviewBDLBookAllTwoLimits: BookAll over two keys sharing a hash tag,
// under two limits, mixed refusals, ended in flight: both keys come back
// exactly, and a retry gets the textbook's answers.
func TestReviewBDLBookAllTwoLimits(t *testing.T) {
	t.Parallel()
	r := bdlNewRig(t, redistest.Shared(t), 1, 10*time.Second)
	lims := []throttle.Limit{throttle.Every(time.Hour, 60, 4), throttle.Every(time.Hour, 30, 2)} // I 1 min / 2 min, tau 4 min both
	reqs := []throttle.Request{
		{N: 1, MaxWait: 0},
		{N: 3, MaxWait: 0},
		{N: 2, MaxWait: throttle.Forever},
		{N: 1, MaxWait: time.Minute},
		{N: 1, MaxWait: throttle.Forever},
	}
	for _, cancelled := range []bool{false, true} {
		t.Run(bdlMode(cancelled), func(t *testing.T) {
			tag := "{two-" + bdlMode(cancelled) + "}"
			keys := []string{"a:" + tag, "b:" + tag}
			bg := context.Background()
			m := bdlNewModel(lims...)
			pre, err := r.other.BookAll(bg, keys, lims, []throttle.Request{{N: 2, MaxWait: 0}})
			require.NoError(t, err)
			m.replay(t, "pre", bdlNow(pre[0]), []throttle.Request{{N: 2, MaxWait: 0}}, pre)

			// What the ended call books, by the textbook (for the counts).
			booked := 0
			mm := m.clone()
			for _, q := range reqs {
				if ok, _ := mm.book(time.Now().UnixMicro(), q); ok {
					booked++
				}
			}
			o0, c0 := r.obs.snap(), r.calls.Load()
			ctx, cancel, fired, want := r.endInFlight(cancelled, 200*time.Millisecond)
			bs, err := r.eng.BookAll(ctx, keys, lims, reqs)
			cancel()
			endedInFlight(t, fired, "ended BookAll")
			bdlEnded(t, err, want, "ended BookAll")
			require.Nil(t, bs)
			o := r.obs.snap().minus(o0)
			bdlRequireState(t, r.other, "after the give-back", keys, lims, m)
			require.Equal(t, int64(1+min(booked, 1)), r.calls.Load()-c0, "the booking and one give-back for its bookings")
			require.Equal(t, booked, o.booked)
			require.Equal(t, len(reqs)-booked, o.refused)
			require.Equal(t, min(booked, 1), o.refunds)

			bs, err = r.eng.BookAll(bg, keys, lims, reqs)
			require.NoError(t, err)
			m.replay(t, "retried BookAll", bdlNow(bs[0]), reqs, bs)
			bdlRequireState(t, r.other, "after the retry", keys, lims, m)
		})
	}
}

// TestReviewBDLOthersBetween: while the ended caller's reply is held back,
// others act on the same key(s). The give-back must never let anything
// through early: the stored TATs must be the textbook's replay of the
// slots that actually stand.
func TestReviewBDLOthersBetween(t *testing.T) {
	t.Parallel()
	r := bdlNewRig(t, redistest.Shared(t), 1, 10*time.Second)
	lim := throttle.Every(time.Hour, 60, 4)
	lim2 := throttle.Every(time.Hour, 30, 2)
	ours := []throttle.Request{bdlForever, {N: 2, MaxWait: throttle.Forever}, {N: 1, MaxWait: 0}, bdlForever}
	bg := context.Background()

	// run books ours on keys through the proxy, ended in flight, with
	// between run by another caller while the reply is held back; it
	// returns the textbook model with ours booked at their decision time
	// (read from the first probe the others made, which is after ours).
	type between func(t *testing.T, keys []string, lims []throttle.Limit, m *bdlModel)
	run := func(t *testing.T, keys []string, lims []throttle.Limit, btw between) {
		m := bdlNewModel(lims...)
		// Ours go first on an idle key: decided at some now0 we learn
		// from the key's TAT afterwards. Their reply is held back (r.hold)
		// until the others have acted and ours' deadline has passed.
		ran, release := r.hold()
		ctx, cancel := context.WithTimeout(bg, 200*time.Millisecond)
		done := make(chan error, 1)
		go func() {
			_, err := r.eng.BookAll(ctx, keys, lims, ours)
			done <- err
		}()
		heldRan(t, ran, "ours") // ours ran in Redis; its reply is held
		// Learn ours' decision time: the TAT of keys[0] after ours is
		// now0 + sum of N*I (ours start from idle, all booked ahead).
		st, err := r.other.State(bg, keys, lims)
		require.NoError(t, err)
		require.True(t, st.Keys[0].Exists, "ours booked, reply held: %s holds ours", keys[0])
		// From idle, the textbook is the same at every instant: ours
		// judged at 0 put keys[0]'s TAT at mm.tats[0] after now0.
		mm := bdlNewModel(lims...)
		for _, q := range ours {
			mm.book(1, q)
		}
		now0 := st.Keys[0].TAT.UnixMicro() - (mm.tats[0] - 1)
		for _, q := range ours {
			m.book(now0, q)
		}
		bdlRequireState(t, r.other, "ours booked, reply held", keys, lims, m)
		btw(t, keys, lims, m)
		<-ctx.Done() // ours' caller has ended: the reply comes past it
		close(release)
		err = <-done
		cancel()
		bdlEnded(t, err, context.DeadlineExceeded, "ours")
		bdlRequireState(t, r.other, "after ours' give-back", keys, lims, m)
	}

	t.Run("a later booking stands on ours: nothing comes back", func(t *testing.T) {
		run(t, []string{"ob1"}, []throttle.Limit{lim}, func(t *testing.T, keys []string, lims []throttle.Limit, m *bdlModel) {
			x, err := r.other.Book(bg, keys[0], lims[0], bdlForever)
			require.NoError(t, err)
			m.replay(t, "other's booking", bdlNow(x), []throttle.Request{bdlForever}, []throttle.Booking{x})
		})
	})
	t.Run("a later booking stood and was given back: ours all come back", func(t *testing.T) {
		run(t, []string{"ob2"}, []throttle.Limit{lim}, func(t *testing.T, keys []string, lims []throttle.Limit, m *bdlModel) {
			x, err := r.other.Book(bg, keys[0], lims[0], bdlForever)
			require.NoError(t, err)
			require.True(t, x.OK)
			g, err := r.other.Refund(bg, keys[0], lims[0], x)
			require.NoError(t, err)
			require.Equal(t, lims[0].Interval(), g)
			// Ours then all come back: to the idle key.
			for k := range m.tats {
				m.tats[k] = 0
			}
		})
	})
	t.Run("a pause after ours: refunds never reach below it", func(t *testing.T) {
		run(t, []string{"ob3"}, []throttle.Limit{lim}, func(t *testing.T, keys []string, lims []throttle.Limit, m *bdlModel) {
			require.NoError(t, r.other.Block(bg, keys[0], lims[0], time.Second))
			m.tats[0]++ // block.lua moves a TAT beyond the pause by 1µs
		})
	})
	t.Run("BookAll: another booking on one of its keys only", func(t *testing.T) {
		keys := []string{"a:{ob4}", "b:{ob4}"}
		run(t, keys, []throttle.Limit{lim, lim2}, func(t *testing.T, keys []string, lims []throttle.Limit, m *bdlModel) {
			// Another subject's limit shares key a: it books there alone.
			one := bdlNewModel(lims[0])
			one.tats[0] = m.tats[0]
			x, err := r.other.Book(bg, keys[0], lims[0], bdlForever)
			require.NoError(t, err)
			one.replay(t, "other's booking on key a", bdlNow(x), []throttle.Request{bdlForever}, []throttle.Booking{x})
			// Key a keeps ours under x; key b has nothing standing but ours,
			// which all come back.
			m.tats[0] = one.tats[0]
			m.tats[1] = 0
		})
	})
}

// TestReviewBDLMergedEndedInFlight: single bookings merged in one call
// (WithMergeAt(1), WithMergeWait(Forever): while one booking is in flight
// the rest merge). The caller whose context ends while the merged call is
// out gets its context's error and its booking is given back; the other
// callers of the merged call keep theirs. Leader or not, on a key of its
// own or sharing a key with another caller of the batch.
func TestReviewBDLMergedEndedInFlight(t *testing.T) {
	t.Parallel()
	r := bdlNewRig(t, redistest.Shared(t), 4, 10*time.Second, throttle.WithMergeAt(1), throttle.WithMergeWait(throttle.Forever))
	lim := throttle.Every(time.Hour, 60, 2)
	const D = 400 * time.Millisecond
	bg := context.Background()
	type tc struct {
		name      string
		order     []string // the callers in the order they join: "A" ends in flight
		keyOf     map[string]string
		cancelled bool
	}
	var cases []tc
	for _, c := range []bool{false, true} {
		cases = append(cases,
			tc{"leader/" + bdlMode(c), []string{"A", "B", "C"}, map[string]string{"A": "a", "B": "b", "C": "c"}, c},
			tc{"middle/" + bdlMode(c), []string{"B", "A", "C"}, map[string]string{"A": "a", "B": "b", "C": "c"}, c},
			tc{"sharedKeyFirst/" + bdlMode(c), []string{"A", "B"}, map[string]string{"A": "s", "B": "s"}, c},
			tc{"sharedKeyLast/" + bdlMode(c), []string{"B", "A"}, map[string]string{"A": "s", "B": "s"}, c},
		)
	}
	for ci, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			key := func(who string) string { return fmt.Sprintf("m%d-%s", ci, c.keyOf[who]) }
			o0, c0 := r.obs.snap(), r.calls.Load()
			r.p.SetReplyDelay(D)
			start := time.Now()
			held := make(chan error, 1)
			go func() {
				_, err := r.eng.Book(bg, fmt.Sprintf("m%d-holder", ci), lim, bdlForever)
				held <- err
			}()
			r.awaitHolder(t, c0)
			var mu sync.Mutex
			res := map[string]throttle.Booking{}
			errs := map[string]error{}
			var wg sync.WaitGroup
			var want error
			for i, who := range c.order {
				if i > 0 {
					// They join in order (the oracle replays them so):
					// 60 ms apart, as a stall of 30 ms of a caller's
					// goroutine swapped them at 20 ms.
					time.Sleep(60 * time.Millisecond)
				}
				ctx, cancel := bg, context.CancelFunc(func() {})
				if who == "A" {
					// Ends once the merged call is out (at ~D) and before
					// its reply (~2D).
					var w error
					ctx, cancel, w = bdlCtx(c.cancelled, D+D/2-time.Since(start))
					want = w
				}
				wg.Go(func() {
					defer cancel()
					b, err := r.eng.Book(ctx, key(who), lim, bdlForever)
					mu.Lock()
					res[who], errs[who] = b, err
					mu.Unlock()
				})
			}
			wg.Wait()
			require.NoError(t, <-held)
			r.p.SetReplyDelay(0)
			sent := r.calls.Load() - c0
			o := r.obs.snap().minus(o0)
			require.Equal(t, int64(3), sent, "the holder's call, the merged call and A's give-back (else nothing merged)")
			bdlEnded(t, errs["A"], want, "A, ended in flight")
			require.Equal(t, throttle.Booking{}, res["A"])
			for _, who := range c.order {
				if who != "A" {
					require.NoError(t, errs[who], who)
					require.True(t, res[who].OK, who)
				}
			}
			require.Equal(t, len(c.order)+1, o.booked, "observer: every booking of the merged call and the holder's")
			require.Equal(t, 1, o.refunds, "observer: A's give-back")
			// The oracle: the slots that stand, replayed per key in the
			// order the merged call judged them (the order they joined).
			models := map[string]*bdlModel{}
			var now int64
			for _, who := range c.order {
				if who != "A" {
					now = bdlNow(res[who])
				}
			}
			given := false
			for _, who := range c.order {
				k := key(who)
				if models[k] == nil {
					models[k] = bdlNewModel(lim)
				}
				if who == "A" {
					// A's booking was given back unless a later booking of
					// the batch stands on it.
					lastOnKey := c.order[len(c.order)-1] == "A" || c.keyOf[c.order[len(c.order)-1]] != c.keyOf["A"]
					if lastOnKey {
						given = true
						continue
					}
					models[k].book(now, bdlForever)
					continue
				}
				models[k].replay(t, who, now, []throttle.Request{bdlForever}, []throttle.Booking{res[who]})
			}
			if given {
				require.Positive(t, o.given, "A's room came back")
			} else {
				require.Zero(t, o.given, "A's room cannot come back under B's booking")
			}
			for k, m := range models {
				bdlRequireState(t, r.other, "key "+k, []string{k}, []throttle.Limit{lim}, m)
			}
		})
	}
}

// TestReviewBDLEndedBeforeSending: with the client's one connection busy
// (a booking whose reply is held back), a caller whose context ends while
// it waits for the connection (merged or not) gets its context's error at
// once, books nothing, and no call of its own reaches the client.
func TestReviewBDLEndedBeforeSending(t *testing.T) {
	t.Parallel()
	lim := throttle.Every(time.Hour, 60, 4)
	for _, merging := range []bool{true, false} {
		r := bdlNewRig(t, redistest.Shared(t), 1, 10*time.Second, throttle.WithMerging(merging))
		for _, cancelled := range []bool{false, true} {
			for _, op := range []string{"Book", "BookBatch", "BookAll"} {
				name := fmt.Sprintf("merging=%v/%s/%s", merging, bdlMode(cancelled), op)
				t.Run(name, func(t *testing.T) {
					bg := context.Background()
					tag := "{" + strings.ReplaceAll(name, "/", "-") + "}"
					keys := []string{"a:" + tag, "b:" + tag}
					r.p.SetReplyDelay(500 * time.Millisecond)
					held := make(chan error, 1)
					calls0 := r.calls.Load()
					go func() {
						_, err := r.eng.Book(bg, "holder"+tag, lim, bdlForever)
						held <- err
					}()
					c0 := r.awaitHolder(t, calls0)
					// The caller's end comes 150 ms on (was 60 ms, which a
					// stall of 70 ms before the call outran: the context
					// ended before the call, never waiting for the
					// connection), the holder's reply 500 ms after its call.
					ctx, cancel, want := bdlCtx(cancelled, 150*time.Millisecond)
					require.NoError(t, ctx.Err(), "the test's premise: the caller's context ends while it waits for the connection, not before its call")
					var err error
					switch op {
					case "Book":
						_, err = r.eng.Book(ctx, keys[0], lim, bdlForever)
					case "BookBatch":
						_, err = r.eng.BookBatch(ctx, keys[0], lim, []throttle.Request{bdlForever, bdlForever})
					case "BookAll":
						_, err = r.eng.BookAll(ctx, keys, []throttle.Limit{lim, lim}, []throttle.Request{bdlForever})
					}
					cancel()
					select {
					case <-held:
						t.Fatalf("the caller returned only after the busy connection freed (err %v)", err)
					default:
					}
					bdlEnded(t, err, want, name)
					require.Equal(t, c0, r.calls.Load(), "no call of its own")
					require.NoError(t, <-held)
					r.p.SetReplyDelay(0)
					bdlRequireState(t, r.other, "untouched", keys, []throttle.Limit{lim, lim}, bdlNewModel(lim, lim))
				})
			}
		}
	}
}

// TestReviewBDLAroundTheReply: the caller's end swept across the reply's
// arrival. Whatever the instant, the outcome is one of two, each with the
// key where the textbook puts it: the bookings returned and standing, or
// the context's error (never a lost reply) and the key as it was.
func TestReviewBDLAroundTheReply(t *testing.T) {
	t.Parallel()
	r := bdlNewRig(t, redistest.Shared(t), 1, 10*time.Second)
	lim := throttle.Every(time.Hour, 60, 4)
	reqs := []throttle.Request{bdlForever, {N: 2, MaxWait: throttle.Forever}}
	const delay = 100 * time.Millisecond
	count := map[string]int{}
	for _, cancelled := range []bool{false, true} {
		for d := 70 * time.Millisecond; d <= 140*time.Millisecond; d += 5 * time.Millisecond {
			key := fmt.Sprintf("sw-%s-%v", bdlMode(cancelled), d)
			r.p.SetReplyDelay(delay)
			ctx, cancel, want := bdlCtx(cancelled, d)
			bs, err := r.eng.BookBatch(ctx, key, lim, reqs)
			cancel()
			r.p.SetReplyDelay(0)
			m := bdlNewModel(lim)
			if err == nil {
				count[bdlMode(cancelled)+" booked"]++
				m.replay(t, key, bdlNow(bs[0]), reqs, bs)
			} else {
				count[bdlMode(cancelled)+" ended"]++
				bdlEnded(t, err, want, key)
			}
			bdlRequireState(t, r.other, key, []string{key}, []throttle.Limit{lim}, m)
		}
	}
	t.Logf("outcomes: %v", count)
}

// TestReviewBDLRedisDownDuringGiveBack: the booking's reply is in, and
// Redis is stopped (SIGSTOP) or killed before the give-back: the caller
// returns within about one give-back's second of a same-run control in
// which Redis is up, not one second per booking, nor the engine's timeout.
// The give-back may run once Redis resumes; nothing comes back that a
// standing slot needs.
func TestReviewBDLRedisDownDuringGiveBack(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	srv.RequireReal(t)
	r := bdlNewRig(t, srv, 1, 10*time.Second)
	lim := throttle.Every(time.Hour, 60, 4)
	reqs := []throttle.Request{bdlForever, bdlForever, bdlForever}
	bg := context.Background()
	// call books reqs on key; the reply is held (r.hold) until the
	// caller's deadline has passed and during has run, Redis then down
	// (or not, for the control) before the give-back.
	call := func(key string, during func()) (time.Duration, error) {
		r.warm(t)
		ran, release := r.hold()
		ctx, cancel := context.WithTimeout(bg, 200*time.Millisecond)
		defer cancel()
		fired := make(chan error, 1)
		go func() {
			defer close(release)
			select {
			case err := <-ran:
				<-ctx.Done()
				during()
				fired <- err
			case <-time.After(5 * time.Second):
				fired <- errors.New("the held call never went out")
			}
		}()
		start := time.Now()
		_, err := r.eng.BookBatch(ctx, key, lim, reqs)
		el := time.Since(start)
		require.NoError(t, <-fired, "%s: the test's premise: the booking ran in Redis, its reply held past the deadline", key)
		return el, err
	}
	ctrl, err := call("ctrl", func() {})
	bdlEnded(t, err, context.DeadlineExceeded, "control")
	bdlRequireState(t, r.other, "control", []string{"ctrl"}, []throttle.Limit{lim}, bdlNewModel(lim))

	paused, err := call("paused", func() { _ = syscall.Kill(srv.Pid(), syscall.SIGSTOP) })
	_ = syscall.Kill(srv.Pid(), syscall.SIGCONT)
	bdlEnded(t, err, context.DeadlineExceeded, "paused")
	t.Logf("control %v, Redis paused during the give-back %v", ctrl, paused)
	require.Less(t, paused, ctrl+time.Second+1500*time.Millisecond, "one give-back's second past the control, not one per booking")
	// Safety: whatever the give-back did once Redis resumed (the engine
	// gives a call's bookings back in one refund, which the paused server
	// may run once it resumes), the key holds our bookings or nothing,
	// never more than the call booked.
	time.Sleep(200 * time.Millisecond)
	st, err := r.other.State(bg, []string{"paused"}, []throttle.Limit{lim})
	require.NoError(t, err)
	if st.Keys[0].Exists {
		require.LessOrEqual(t, st.Keys[0].TAT.Sub(st.Now), 3*lim.Interval(), "no more than the call's three bookings")
	}

	killed, err := call("killed", func() { srv.Stop() })
	require.Error(t, err)
	require.ErrorIs(t, err, context.DeadlineExceeded, "killed")
	t.Logf("Redis killed during the give-back: %v (%v)", killed, err)
	require.Less(t, killed, ctrl+1500*time.Millisecond, "a refused connection fails the give-back at once")
}

// TestReviewBDLNoTimeout: an engine without a timeout (WithTimeout(0)) is
// documented to let the caller's deadline bound the call: a deadline in
// flight loses the reply (ErrReplyLost) with its slots booked. A cancel
// does not cut the read: the caller gets context.Canceled and the
// bookings are given back (or, if go-redis cut the read, ErrReplyLost).
func TestReviewBDLNoTimeout(t *testing.T) {
	t.Parallel()
	r := bdlNewRig(t, redistest.Shared(t), 1, 0)
	lim := throttle.Every(time.Hour, 60, 4)
	reqs := []throttle.Request{bdlForever, {N: 2, MaxWait: throttle.Forever}}
	bg := context.Background()

	// The reply comes at least 300 ms after the deadline's start, 100 ms
	// past it, and the call has 200 ms to go out (a stall of 60 ms
	// refused it unsent with 60 ms).
	r.p.SetReplyDelay(300 * time.Millisecond)
	ctx, cancel := context.WithTimeout(bg, 200*time.Millisecond)
	_, err := r.eng.BookBatch(ctx, "nt-dl", lim, reqs)
	cancel()
	require.ErrorIs(t, err, context.DeadlineExceeded)
	require.ErrorIs(t, err, throttle.ErrReplyLost, "documented: without a timeout the deadline cuts the read")
	// The slots stand (wasted, never exceeding the limit): both booked.
	st, err := r.other.State(bg, []string{"nt-dl"}, []throttle.Limit{lim})
	require.NoError(t, err)
	require.Equal(t, 2, st.Available, "3 units stand of Burst+1 = 5")
	// The next call on the pool works (the cut connection was dropped).
	r.p.SetReplyDelay(0)
	require.NoError(t, r.rdb.Ping(bg).Err())
	r.warm(t) // warm again for the next in-flight call

	// Cancelled once the booking has run in Redis (its key seen straight
	// from the server), its reply held back 300 ms: not by a 60 ms timer,
	// which a stall before the call outran (the call refused unsent, and
	// the key untouched as if given back).
	r.p.SetReplyDelay(300 * time.Millisecond)
	cctx, ccancel := context.WithCancel(bg)
	booked := make(chan bool, 1)
	go func() {
		defer ccancel()
		for end := time.Now().Add(5 * time.Second); time.Now().Before(end); time.Sleep(time.Millisecond) {
			st, err := r.other.State(bg, []string{"nt-cancel"}, []throttle.Limit{lim})
			if err == nil && st.Keys[0].Exists {
				booked <- true
				return
			}
		}
		booked <- false
	}()
	_, err = r.eng.BookBatch(cctx, "nt-cancel", lim, reqs)
	ccancel()
	r.p.SetReplyDelay(0)
	require.True(t, <-booked, "the test's premise: the booking ran in Redis before the cancel")
	require.ErrorIs(t, err, context.Canceled)
	if errors.Is(err, throttle.ErrReplyLost) {
		t.Logf("cancel without a timeout lost the reply: %v", err)
		return
	}
	bdlRequireState(t, r.other, "cancelled, no timeout: given back", []string{"nt-cancel"}, []throttle.Limit{lim}, bdlNewModel(lim))
}

// TestReviewBDLBadInput: bad input is reported at once, with no Redis call
// and no Observer decision, whatever the context (live, cancelled, past
// its deadline) and with the one connection busy.
func TestReviewBDLBadInput(t *testing.T) {
	t.Parallel()
	r := bdlNewRig(t, redistest.Shared(t), 1, 10*time.Second)
	lim := throttle.Every(time.Hour, 60, 4)
	bad := throttle.Limit{Rate: 0, Period: time.Second}
	many := make([]throttle.Request, throttle.MaxBatch+1)
	for i := range many {
		many[i] = bdlForever
	}
	type tc struct {
		name string
		run  func(ctx context.Context) error
	}
	cases := []tc{
		{"Book n=0", func(ctx context.Context) error {
			_, err := r.eng.Book(ctx, "k", lim, throttle.Request{N: 0})
			return err
		}},
		{"Book n>burst+1", func(ctx context.Context) error {
			_, err := r.eng.Book(ctx, "k", lim, throttle.Request{N: 6})
			return err
		}},
		{"Book negative wait", func(ctx context.Context) error {
			_, err := r.eng.Book(ctx, "k", lim, throttle.Request{N: 1, MaxWait: -1})
			return err
		}},
		{"Book bad limit", func(ctx context.Context) error { _, err := r.eng.Book(ctx, "k", bad, bdlForever); return err }},
		{"Book empty key", func(ctx context.Context) error { _, err := r.eng.Book(ctx, "", lim, bdlForever); return err }},
		{"BookBatch none", func(ctx context.Context) error { _, err := r.eng.BookBatch(ctx, "k", lim, nil); return err }},
		{"BookBatch too many", func(ctx context.Context) error { _, err := r.eng.BookBatch(ctx, "k", lim, many); return err }},
		{"BookBatch bad last", func(ctx context.Context) error {
			_, err := r.eng.BookBatch(ctx, "k", lim, []throttle.Request{bdlForever, bdlForever, {N: 9}})
			return err
		}},
		{"BookAll no shared tag", func(ctx context.Context) error {
			_, err := r.eng.BookAll(ctx, []string{"a:{x}", "b:{y}"}, []throttle.Limit{lim, lim}, []throttle.Request{bdlForever})
			return err
		}},
		{"BookAll lengths differ", func(ctx context.Context) error {
			_, err := r.eng.BookAll(ctx, []string{"a:{x}", "b:{x}"}, []throttle.Limit{lim}, []throttle.Request{bdlForever})
			return err
		}},
		{"BookAll n over one limit's burst", func(ctx context.Context) error {
			_, err := r.eng.BookAll(ctx, []string{"a:{x}", "b:{x}"}, []throttle.Limit{lim, throttle.Every(time.Hour, 60, 0)}, []throttle.Request{{N: 2}})
			return err
		}},
	}
	bg := context.Background()
	r.p.SetReplyDelay(2 * time.Second)
	held := make(chan error, 1)
	calls0 := r.calls.Load()
	go func() {
		_, err := r.eng.Book(bg, "holder", lim, bdlForever)
		held <- err
	}()
	c0 := r.awaitHolder(t, calls0)
	o0 := r.obs.snap()
	for _, c := range cases {
		for _, ctxKind := range []string{"live", "cancelled", "past deadline"} {
			ctx, cancel := context.WithCancel(bg)
			switch ctxKind {
			case "cancelled":
				cancel()
			case "past deadline":
				cancel()
				ctx, cancel = context.WithDeadline(bg, time.Now().Add(-time.Second))
			}
			start := time.Now()
			err := c.run(ctx)
			el := time.Since(start)
			cancel()
			require.Error(t, err, c.name)
			require.True(t, errors.Is(err, throttle.ErrInvalidRequest) || errors.Is(err, throttle.ErrInvalidLimit) || errors.Is(err, throttle.ErrExceedsBurst),
				"%s (%s): bad input's error, got %v", c.name, ctxKind, err)
			require.NotErrorIs(t, err, context.Canceled, c.name)
			require.NotErrorIs(t, err, context.DeadlineExceeded, c.name)
			require.Less(t, el, 500*time.Millisecond, "%s (%s): at once, not after the busy connection", c.name, ctxKind)
		}
	}
	select {
	case <-held:
		t.Fatal("the holder returned before the bad input was checked: the test proves nothing")
	default:
	}
	require.Equal(t, c0, r.calls.Load(), "no Redis call")
	require.Equal(t, bdlObsSnap{}, r.obs.snap().minus(o0), "no Observer event")
	require.NoError(t, <-held)
	r.p.SetReplyDelay(0)
}

// TestReviewBDLReserveCancelOnly: package reserve's single booking on a
// context with no deadline (waitbound.WithoutDeadline hands it over as it
// is, so the engine does not see it as reserve's) cancelled in flight:
// the booking is given back once (by one of the two), the caller gets
// context.Canceled, the key is untouched.
func TestReviewBDLReserveCancelOnly(t *testing.T) {
	t.Parallel()
	r := bdlNewRig(t, redistest.Shared(t), 1, 10*time.Second)
	lim := throttle.Every(time.Hour, 60, 4)
	for _, co := range []bool{true, false} {
		t.Run(fmt.Sprintf("coalescing=%v", co), func(t *testing.T) {
			l, err := reserve.New(r.eng, fmt.Sprintf("rv%v", co), lim, reserve.WithCoalescing(co), reserve.WithoutMaxWait())
			require.NoError(t, err)
			o0, c0 := r.obs.snap(), r.calls.Load()
			ctx, cancel, fired, _ := r.endInFlight(true, 0)
			_, err = l.ReserveN(ctx, "k", 2)
			cancel()
			endedInFlight(t, fired, "reserve, cancelled")
			bdlEnded(t, err, context.Canceled, "reserve, cancelled")
			key := fmt.Sprintf("rv%v:{k}", co)
			bdlRequireState(t, r.other, "untouched", []string{key}, []throttle.Limit{lim}, bdlNewModel(lim))
			o := r.obs.snap().minus(o0)
			require.Equal(t, 1, o.refunds, "given back once")
			require.Equal(t, int64(2), r.calls.Load()-c0)
		})
	}
}

// ---------------------------------------------------------------- findings

// TestReviewBDLGiveBackStopsWhenNothingCanComeBack [FAILED on 2412859]:
// giveBackEnded's own comment says it stops at the first give-back that
// fails "as the bookings under it could give nothing back while it
// stands". A give-back that gives nothing (a later booking by someone
// else stands on the batch's latest) is the same case: every booking
// under it can give nothing back either (refund.lua needs the TAT to
// equal the booking's end). The engine still sends one RefundUnused per
// booking, each a round trip that the ended caller waits for: up to
// MaxBatch (1000) of them.
func TestReviewBDLGiveBackStopsWhenNothingCanComeBack(t *testing.T) {
	t.Parallel()
	r := bdlNewRig(t, redistest.Shared(t), 1, 10*time.Second)
	lim := throttle.Every(time.Hour, 3600, 0) // one a second, every booking Forever
	const n = 40
	reqs := make([]throttle.Request, n)
	for i := range reqs {
		reqs[i] = bdlForever
	}
	bg := context.Background()
	o0, c0 := r.obs.snap(), r.calls.Load()
	ran, release := r.hold()
	ctx, cancel := context.WithTimeout(bg, 200*time.Millisecond)
	done := make(chan error, 1)
	go func() {
		_, err := r.eng.BookBatch(ctx, "stop", lim, reqs)
		done <- err
	}()
	heldRan(t, ran, "the batch") // booked in Redis; its reply held
	// The other's booking stands on the batch's latest.
	x, err := r.other.Book(bg, "stop", lim, bdlForever)
	require.NoError(t, err)
	require.True(t, x.OK)
	require.Greater(t, x.Wait, time.Duration(n-1)*lim.Interval(), "the test's premise: the other's booking stands on the batch's %d", n)
	<-ctx.Done()
	close(release)
	err = <-done
	cancel()
	bdlEnded(t, err, context.DeadlineExceeded, "ended batch")
	o := r.obs.snap().minus(o0)
	sent := r.calls.Load() - c0
	t.Logf("round trips: %d (booking + give-backs); refunds observed %d, of which gave nothing %d", sent, o.refunds, o.zero)
	require.Zero(t, o.given, "nothing can come back under the other's booking")
	require.LessOrEqual(t, sent, int64(2), "after the latest booking gave nothing back, none under it can: no more round trips")
}

// TestReviewBDLGiveBackCostPerBooking [FAILED on 2412859; design]: an
// ended caller of a batch waits one sequential round trip per booking it
// made before it gets its error. Under 15 ms of latency each way (a Redis
// in another zone), a 40-booking batch ended in flight returns ~1.2 s
// after a same-run control of a 1-booking batch; at MaxBatch (1000) it
// would be ~30 s. The bookings of one batch are contiguous on the key
// (each starts where the one before it ended; refusals write nothing), so
// one refund from the first booking's start to the last one's end would
// give them all back in one round trip.
func TestReviewBDLGiveBackCostPerBooking(t *testing.T) {
	t.Parallel()
	r := bdlNewRig(t, redistest.Shared(t), 1, 10*time.Second)
	lim := throttle.Every(time.Hour, 3600, 0)
	bg := context.Background()
	call := func(key string, n int) time.Duration {
		reqs := make([]throttle.Request, n)
		for i := range reqs {
			reqs[i] = bdlForever
		}
		// Every call at 15 ms each way; the booking's reply held (r.hold)
		// until the caller's deadline has passed, the give-backs not.
		r.p.SetLatency(15 * time.Millisecond)
		ran, release := r.hold()
		ctx, cancel := context.WithTimeout(bg, 200*time.Millisecond)
		defer cancel()
		fired := make(chan error, 1)
		go func() {
			defer close(release)
			select {
			case err := <-ran:
				<-ctx.Done()
				fired <- err
			case <-time.After(5 * time.Second):
				fired <- errors.New("the held call never went out")
			}
		}()
		start := time.Now()
		_, err := r.eng.BookBatch(ctx, key, lim, reqs)
		el := time.Since(start)
		require.NoError(t, <-fired, "%s: the test's premise: the booking ran in Redis, its reply held past the deadline", key)
		bdlEnded(t, err, context.DeadlineExceeded, key)
		bdlRequireState(t, r.other, key, []string{key}, []throttle.Limit{lim}, bdlNewModel(lim))
		return el
	}
	one := call("cost1", 1)
	forty := call("cost40", 40)
	r.p.SetLatency(0)
	t.Logf("ended caller returned after: 1 booking %v, 40 bookings %v", one, forty)
	require.Less(t, forty, one+300*time.Millisecond, "the give-back of a batch should not cost a round trip per booking")
}

// bdlConforms checks that the used slots (bookings returned to callers)
// conform to lim by the textbook's virtual scheduling: taken in slot
// order, each slot is no earlier than the previous TAT + (n-1)*I - tau.
// A give-back that let anything through early would break it.
func bdlConforms(t *testing.T, what string, lim throttle.Limit, bs []throttle.Booking) {
	t.Helper()
	slices.SortStableFunc(bs, func(a, b throttle.Booking) int { return a.At.Compare(b.At) })
	I := int64(lim.Interval() / time.Microsecond)
	tau := I * int64(lim.Burst)
	tat := int64(0)
	for i, b := range bs {
		at := b.At.UnixMicro()
		if i > 0 {
			require.GreaterOrEqual(t, at, tat+int64(b.N-1)*I-tau, "%s: slot %d (%v, n=%d) is early: the limit is exceeded", what, i, b.At, b.N)
		}
		tat = max(tat, at) + int64(b.N)*I
	}
}

// TestReviewBDLStressConforms: many callers of one key, single bookings
// (merged with WithMergeAt(1), or alone) and small batches, under 5 ms of
// latency each way, each with a random deadline or a cancel around the
// round trip (seeded). Every error is the caller's context's (never a lost
// reply: the engine's timeout is long), and the slots callers got conform
// to the limit: no give-back, merged or not, let one through early.
func TestReviewBDLStressConforms(t *testing.T) {
	t.Parallel()
	lim := throttle.Every(time.Second, 50, 2) // I = 20 ms
	for _, merging := range []bool{true, false} {
		t.Run(fmt.Sprintf("merging=%v", merging), func(t *testing.T) {
			r := bdlNewRig(t, redistest.Shared(t), 4, 10*time.Second, throttle.WithMerging(merging), throttle.WithMergeAt(1))
			seed := uint64(time.Now().UnixNano())
			t.Logf("seed %d", seed)
			r.p.SetLatency(5 * time.Millisecond)
			var mu sync.Mutex
			var got []throttle.Booking
			counts := map[string]int{}
			var wg sync.WaitGroup
			for g := range 12 {
				rng := rand.New(rand.NewPCG(seed, uint64(g)))
				wg.Go(func() {
					for range 8 {
						d := time.Duration(1+rng.IntN(40)) * time.Millisecond
						ctx, cancel, _ := bdlCtx(rng.IntN(2) == 0, d)
						var bs []throttle.Booking
						var err error
						if rng.IntN(3) == 0 {
							bs, err = r.eng.BookBatch(ctx, "hot", lim, []throttle.Request{bdlForever, {N: 2, MaxWait: throttle.Forever}, {N: 1, MaxWait: 0}})
						} else {
							var b throttle.Booking
							b, err = r.eng.Book(ctx, "hot", lim, bdlForever)
							bs = []throttle.Booking{b}
						}
						cancel()
						mu.Lock()
						switch {
						case err == nil:
							counts["booked"]++
							for _, b := range bs {
								if b.OK {
									got = append(got, b)
								}
							}
						case errors.Is(err, throttle.ErrReplyLost):
							counts["lost"]++
							t.Errorf("a lost reply: %v", err)
						case errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded):
							counts["ended"]++
						default:
							counts["other"]++
							t.Errorf("unexpected error: %v", err)
						}
						mu.Unlock()
					}
				})
			}
			wg.Wait()
			r.p.SetLatency(0)
			t.Logf("outcomes %v, slots used %d, observer %+v", counts, len(got), r.obs.snap())
			bdlConforms(t, "used slots", lim, got)
			// Every refund the engine made was a give-back of an ended caller.
			o := r.obs.snap()
			require.LessOrEqual(t, o.refunds, o.booked)
		})
	}
}

// TestReviewBDLEndedOnEntry: a context already cancelled or past its
// deadline when Book, BookBatch or BookAll is called: the context's error,
// not a lost reply, and nothing booked.
func TestReviewBDLEndedOnEntry(t *testing.T) {
	t.Parallel()
	r := bdlNewRig(t, redistest.Shared(t), 2, 10*time.Second)
	lim := throttle.Every(time.Hour, 60, 4)
	lims := []throttle.Limit{lim, lim}
	for _, kind := range []string{"cancelled", "past deadline"} {
		ctx, cancel := context.WithCancel(context.Background())
		want := context.Canceled
		if kind == "past deadline" {
			cancel()
			ctx, cancel = context.WithDeadline(context.Background(), time.Now().Add(-time.Millisecond))
			want = context.DeadlineExceeded
		} else {
			cancel()
		}
		tag := "{entry-" + strings.ReplaceAll(kind, " ", "-") + "}"
		keys := []string{"a:" + tag, "b:" + tag}
		o0 := r.obs.snap()
		_, err := r.eng.Book(ctx, keys[0], lim, bdlForever)
		bdlEnded(t, err, want, kind+" Book")
		_, err = r.eng.BookBatch(ctx, keys[0], lim, []throttle.Request{bdlForever, bdlForever})
		bdlEnded(t, err, want, kind+" BookBatch")
		_, err = r.eng.BookAll(ctx, keys, lims, []throttle.Request{bdlForever})
		bdlEnded(t, err, want, kind+" BookAll")
		cancel()
		bdlRequireState(t, r.other, kind, keys, lims, bdlNewModel(lims...))
		o := r.obs.snap().minus(o0)
		require.Zero(t, o.booked+o.refused+o.refunds, "%s: nothing decided, nothing given back: %+v", kind, o)
	}
}

// TestReviewBDLShortIntervalComesBack: a limit whose interval is shorter
// than the held-back reply, so that by the give-back the earliest
// bookings' units have passed and the latest's slot has come: the key
// must come back to exactly what the textbook gives without ours (the
// state another caller left, aged), and an all-refused batch makes no
// give-back call at all.
func TestReviewBDLShortIntervalComesBack(t *testing.T) {
	t.Parallel()
	r := bdlNewRig(t, redistest.Shared(t), 1, 10*time.Second)
	lim := throttle.Every(time.Second, 20, 1) // I = 50 ms, tau = 50 ms
	bg := context.Background()
	for _, cancelled := range []bool{false, true} {
		t.Run(bdlMode(cancelled), func(t *testing.T) {
			key := "short-" + bdlMode(cancelled)
			m := bdlNewModel(lim)
			// Another caller books 2 units ahead first: TAT now0 + 100 ms,
			// then pushes it further with a booking 400 ms out.
			pre := []throttle.Request{{N: 2, MaxWait: 0}, {N: 1, MaxWait: throttle.Forever}, {N: 1, MaxWait: throttle.Forever}, {N: 1, MaxWait: throttle.Forever}, {N: 1, MaxWait: throttle.Forever}, {N: 1, MaxWait: throttle.Forever}, {N: 1, MaxWait: throttle.Forever}}
			pb, err := r.other.BookBatch(bg, key, lim, pre)
			require.NoError(t, err)
			m.replay(t, "pre", bdlNow(pb[0]), pre, pb)
			reqs := []throttle.Request{bdlForever, {N: 2, MaxWait: throttle.Forever}, {N: 1, MaxWait: 0}, bdlForever}
			o0, c0 := r.obs.snap(), r.calls.Load()
			// Ours' reply is held (r.hold) until its caller has ended: more
			// than I, and before ours' first slot (350 ms after now0).
			ctx, cancel, fired, want := r.endInFlight(cancelled, 150*time.Millisecond)
			_, err = r.eng.BookBatch(ctx, key, lim, reqs)
			cancel()
			endedInFlight(t, fired, "ended")
			bdlEnded(t, err, want, "ended")
			o := r.obs.snap().minus(o0)
			t.Logf("round trips %d, observer %+v", r.calls.Load()-c0, o)
			bdlRequireState(t, r.other, "after the give-back", []string{key}, []throttle.Limit{lim}, m)

			// All refused, ended: no give-back call. The key is first
			// booked half a second ahead, so that n = 2 cannot pass.
			ahead := make([]throttle.Request, 10)
			for i := range ahead {
				ahead[i] = bdlForever
			}
			_, err = r.other.BookBatch(bg, key, lim, ahead)
			require.NoError(t, err)
			o0 = r.obs.snap()
			c0 = r.calls.Load()
			ctx, cancel, fired, want = r.endInFlight(cancelled, 200*time.Millisecond)
			_, err = r.eng.BookBatch(ctx, key, lim, []throttle.Request{{N: 2, MaxWait: 0}, {N: 2, MaxWait: 0}})
			cancel()
			endedInFlight(t, fired, "all refused, ended")
			bdlEnded(t, err, want, "all refused, ended")
			require.Equal(t, int64(1), r.calls.Load()-c0, "nothing booked: nothing to give back")
			o = r.obs.snap().minus(o0)
			require.Equal(t, 2, o.refused)
			require.Zero(t, o.booked+o.refunds)
		})
	}
}
