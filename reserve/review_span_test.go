package reserve_test

// Review (helper-90) of f25d300 through the public API: throttle.Span
// (a back-to-back run of bookings given back in one refund), reserve's
// refundLate, the `giving` wait shared by a Limiter and its views, and
// AllowN at that gate. Slots are 2 s apart; room is judged on the Redis
// clock (Booking().At, State's TAT) against a textbook GCRA of what stands.
//
// It proved three defects of the public throttle.Span (RefundAll of a
// span gave back bookings whose slot had come, letting a request through
// early; a span made again for a retry after a lost reply gave the run
// back twice; a run's booking given back on its own, before or after its
// span, was not refused). Span gave way to Engine.RefundUnusedRun: a run
// given back as unused only, its tombstone the same for every retry of the
// same run, and each of its bookings marked so that giving it back on its
// own or in another run fails (ErrInvalidRequest). The tests below are
// adapted to it (the two RefundAll tests are gone with the API they
// attacked); TestReviewSPSpanTwiceAfterLostReply and
// TestReviewSPSpanThenOneOfItsBookings failed on f25d300 and pass since.

import (
	"context"
	"errors"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/slotbook/slotbook/internal/redistest"
	"github.com/slotbook/slotbook/reserve"
	"github.com/slotbook/slotbook/throttle"
)

const spI = 2 * time.Second

var spForever = throttle.Request{N: 1, MaxWait: throttle.Forever}

// spEngine is an engine on the shared server through a proxy (prefix of its
// own), and a second engine on the same Redis and prefix, direct: another
// process.
func spEngine(t *testing.T, opts ...throttle.Option) (*throttle.Engine, *throttle.Engine, *redistest.Proxy) {
	t.Helper()
	eng, p, prefix := proxiedEngineOn(t, redistest.Shared(t), 0, opts...)
	srv := redistest.Shared(t)
	other, err := throttle.New(srv.Client(t), throttle.WithPrefix(prefix), throttle.WithTimeout(10*time.Second))
	require.NoError(t, err)
	require.NoError(t, other.Load(context.Background()))
	return eng, other, p
}

func spTAT(t *testing.T, e *throttle.Engine, keys []string, lims []throttle.Limit) []time.Time {
	t.Helper()
	st, err := e.State(context.Background(), keys, lims)
	require.NoError(t, err)
	out := make([]time.Time, len(st.Keys))
	for i, k := range st.Keys {
		if k.Exists {
			out[i] = k.TAT
		}
	}
	return out
}

// TestReviewSPRefundUnusedSpanSlotCome: the run's last slot has come.
// RefundUnusedRun (no one acted) gives back what still stands in front of
// the key (the three units), and the key ends where nothing of the run
// stands. Then nothing more on a retry.
func TestReviewSPRefundUnusedSpanSlotCome(t *testing.T) {
	t.Parallel()
	eng, _, _ := spEngine(t)
	ctx := context.Background()
	lim := throttle.Every(spI, 1, 2) // three at once
	lims := []throttle.Limit{lim}
	key := "sp-come-unused"
	bs, err := eng.BookBatch(ctx, key, lim, []throttle.Request{spForever, spForever, spForever})
	require.NoError(t, err)
	require.Equal(t, bs[0].At, bs[2].At, "all due at once")
	gs, err := eng.RefundUnusedRun(ctx, []string{key}, lims, bs)
	require.NoError(t, err)
	tat := spTAT(t, eng, []string{key}, lims)[0]
	t.Logf("given %v, TAT t0+%v", gs[0], tat.Sub(bs[0].At))
	require.Greater(t, gs[0], 5*time.Second, "nothing ran: the three units come back")
	require.True(t, tat.IsZero(), "key idle")
	gs, err = eng.RefundUnusedRun(ctx, []string{key}, lims, bs)
	require.NoError(t, err)
	require.Zero(t, gs[0], "a retry")
}

// spHeadAndRun books, on key, a head through other (slot t0, TAT t0+I) and
// then a run of three through eng (slots t0+I .. t0+3I): the run's
// bookings and the head's slot.
func spHeadAndRun(t *testing.T, eng, other *throttle.Engine, key string, lim throttle.Limit) ([]throttle.Booking, time.Time) {
	t.Helper()
	ctx := context.Background()
	h, err := other.Book(ctx, key, lim, spForever)
	require.NoError(t, err)
	bs, err := eng.BookBatch(ctx, key, lim, []throttle.Request{spForever, spForever, spForever})
	require.NoError(t, err)
	for i, b := range bs {
		require.True(t, b.OK)
		require.Equal(t, h.At.Add(time.Duration(i+1)*spI), b.At)
	}
	return bs, h.At
}

// TestReviewSPSpanRetryAfterLostReply: RefundUnused of a Span whose reply
// is lost (the proxy holds it, then severs the link) after Redis gave the
// run back; another process then books three that end where the run did.
// A retry of the same Span gives nothing (its tombstone), and the other
// process's bookings stand (State's TAT).
func TestReviewSPSpanRetryAfterLostReply(t *testing.T) {
	t.Parallel()
	eng, other, p := spEngine(t)
	ctx := context.Background()
	lim := throttle.Every(spI, 1, 0)
	lims := []throttle.Limit{lim}
	key := "sp-lost"
	bs, t0 := spHeadAndRun(t, eng, other, key, lim)
	sb := bs
	p.SetReplyDelay(2 * time.Second)
	errc := make(chan error, 1)
	go func() {
		_, err := eng.RefundUnusedRun(ctx, []string{key}, lims, sb)
		errc <- err
	}()
	require.Eventually(t, func() bool {
		tat := spTAT(t, other, []string{key}, lims)[0]
		return tat.Equal(t0.Add(spI))
	}, 3*time.Second, 5*time.Millisecond, "Redis gave the run back")
	p.Sever()
	rerr := <-errc
	p.SetReplyDelay(0)
	t.Logf("refund with its reply lost: %v", rerr)
	ob, err := other.BookBatch(ctx, key, lim, []throttle.Request{spForever, spForever, spForever})
	require.NoError(t, err)
	require.Equal(t, bs[2].At, ob[2].At, "the other process's run ends where ours did")
	var gs []time.Duration
	redistest.UntilOK(t, func() (err error) { // the breaker opened on the lost reply
		gs, err = eng.RefundUnusedRun(ctx, []string{key}, lims, sb)
		return err
	})
	require.Zero(t, gs[0], "a retry of the same Span gives nothing")
	require.Equal(t, t0.Add(4*spI), spTAT(t, other, []string{key}, lims)[0], "the other process's bookings stand")
}

// TestReviewSPSpanTwiceAfterLostReply (FAILED on f25d300, where the retry
// made throttle.Span(bs) again, a new booking with a tombstone of its own):
// a run given back (RefundUnusedRun) whose reply is lost after Redis gave
// it back; another process books three that end where the run did; the
// retry, with the same run, must give nothing (the run's tombstone), and
// the other process's bookings stand.
func TestReviewSPSpanTwiceAfterLostReply(t *testing.T) {
	t.Parallel()
	eng, other, p := spEngine(t)
	ctx := context.Background()
	lim := throttle.Every(spI, 1, 0)
	lims := []throttle.Limit{lim}
	key := "sp-lost2"
	bs, t0 := spHeadAndRun(t, eng, other, key, lim)
	sb := bs
	p.SetReplyDelay(2 * time.Second)
	errc := make(chan error, 1)
	go func() {
		_, err := eng.RefundUnusedRun(ctx, []string{key}, lims, sb)
		errc <- err
	}()
	require.Eventually(t, func() bool {
		return spTAT(t, other, []string{key}, lims)[0].Equal(t0.Add(spI))
	}, 3*time.Second, 5*time.Millisecond)
	p.Sever()
	t.Logf("refund with its reply lost: %v", <-errc)
	p.SetReplyDelay(0)
	ob, err := other.BookBatch(ctx, key, lim, []throttle.Request{spForever, spForever, spForever})
	require.NoError(t, err)
	require.Equal(t, bs[2].At, ob[2].At)
	again := bs // the same run, as a retry loop would pass it
	var gs []time.Duration
	redistest.UntilOK(t, func() (err error) { // the breaker opened on the lost reply
		gs, err = eng.RefundUnusedRun(ctx, []string{key}, lims, again)
		return err
	})
	t.Logf("retry with Span made again: given %v", gs)
	nb, err := other.Book(ctx, key, lim, spForever)
	require.NoError(t, err)
	stand := []hdBooking{{t0, 1}, {ob[0].At, 1}, {ob[1].At, 1}, {ob[2].At, 1}, {nb.At, 1}}
	require.NoError(t, gtConform(stand, 0),
		"Span(run) made twice gave the run back twice: the second took another process's three bookings' room (next booking at t0+%v)", nb.At.Sub(t0))
}

// TestReviewSPSpanThenOneOfItsBookings (FAILED on f25d300): a run given
// back (RefundUnusedRun); another process books three that end where the
// run did; then the run's last booking given back on its own must be
// refused (ErrInvalidRequest, no Redis call), or it would give back the
// other process's last booking's room. And the reverse order: the last on
// its own, another books one ending where it did, then the run: refused.
func TestReviewSPSpanThenOneOfItsBookings(t *testing.T) {
	t.Parallel()
	eng, other, _ := spEngine(t)
	ctx := context.Background()
	lim := throttle.Every(spI, 1, 0)
	lims := []throttle.Limit{lim}
	var fails []string
	for _, spanFirst := range []bool{true, false} {
		key := "sp-then-one"
		if !spanFirst {
			key = "sp-one-then"
		}
		bs, t0 := spHeadAndRun(t, eng, other, key, lim)
		sb := bs
		var stand []hdBooking
		stand = append(stand, hdBooking{t0, 1})
		if spanFirst {
			_, err := eng.RefundUnusedRun(ctx, []string{key}, lims, sb)
			require.NoError(t, err)
			ob, err := other.BookBatch(ctx, key, lim, []throttle.Request{spForever, spForever, spForever})
			require.NoError(t, err)
			for _, b := range ob {
				stand = append(stand, hdBooking{b.At, 1})
			}
			gs, err := eng.RefundUnused(ctx, []string{key}, lims, bs[2])
			t.Logf("span first: the last on its own after its Span: given %v, err %v", gs, err)
			require.ErrorIs(t, err, throttle.ErrInvalidRequest, "refused, no Redis call")
		} else {
			_, err := eng.RefundUnused(ctx, []string{key}, lims, bs[2])
			require.NoError(t, err)
			ob, err := other.Book(ctx, key, lim, spForever)
			require.NoError(t, err)
			stand = append(stand, hdBooking{bs[0].At, 1}, hdBooking{bs[1].At, 1}, hdBooking{ob.At, 1})
			gs, err := eng.RefundUnusedRun(ctx, []string{key}, lims, sb)
			t.Logf("one first: the Span after its last on its own: given %v, err %v", gs, err)
			require.ErrorIs(t, err, throttle.ErrInvalidRequest, "refused, no Redis call")
			// Refused whole: bs[0] and bs[1] stand with the other's.
		}
		for range 3 { // up to where the run ended
			nb, err := other.Book(ctx, key, lim, spForever)
			require.NoError(t, err)
			stand = append(stand, hdBooking{nb.At, 1})
		}
		if err := gtConform(stand, 0); err != nil {
			fails = append(fails, key+": "+err.Error())
		}
	}
	require.Empty(t, fails, "a run's booking given back on its own and as part of its Span: another process's room given back")
}

// TestReviewSPTwoCallsBackToBack: two calls' runs that happen to lie back
// to back (nothing booked between) are one run: Span accepts them, and
// its refund gives all four back (the key is back at the head's TAT), as
// one by one would; the next booking lands at the textbook slot.
func TestReviewSPTwoCallsBackToBack(t *testing.T) {
	t.Parallel()
	eng, other, _ := spEngine(t)
	ctx := context.Background()
	lim := throttle.Every(spI, 1, 0)
	lims := []throttle.Limit{lim}
	key := "sp-two"
	h, err := other.Book(ctx, key, lim, spForever)
	require.NoError(t, err)
	a, err := eng.BookBatch(ctx, key, lim, []throttle.Request{spForever, spForever})
	require.NoError(t, err)
	b, err := eng.BookBatch(ctx, key, lim, []throttle.Request{spForever, spForever})
	require.NoError(t, err)
	sb := append(append([]throttle.Booking(nil), a...), b...)
	gs, err := eng.RefundUnusedRun(ctx, []string{key}, lims, sb)
	require.NoError(t, err)
	require.Equal(t, 4*spI, gs[0].Round(time.Millisecond))
	nb, err := other.Book(ctx, key, lim, spForever)
	require.NoError(t, err)
	require.Equal(t, h.At.Add(spI), nb.At)
	// A run with a booking of another process between: not back to back.
	a, err = eng.BookBatch(ctx, key, lim, []throttle.Request{spForever})
	require.NoError(t, err)
	_, err = other.Book(ctx, key, lim, spForever)
	require.NoError(t, err)
	b, err = eng.BookBatch(ctx, key, lim, []throttle.Request{spForever})
	require.NoError(t, err)
	_, err = eng.RefundUnusedRun(ctx, []string{key}, lims, []throttle.Booking{a[0], b[0]})
	require.ErrorIs(t, err, throttle.ErrInvalidRequest)
}

// TestReviewSPLayeredGap: layered limits; between two bookings of both
// keys, a booking of one key only (a Limiter of that limit alone on the
// same name): Span must refuse, whichever key has the gap; with no gap it
// spans both keys and gives both back.
func TestReviewSPLayeredGap(t *testing.T) {
	t.Parallel()
	eng, other, _ := spEngine(t)
	ctx := context.Background()
	l0, l1 := throttle.Every(spI, 1, 0), throttle.Every(time.Minute, 10, 3)
	lims := []throttle.Limit{l0, l1}
	for gap := -1; gap < 2; gap++ {
		keys := []string{"lay:{g" + string(rune('a'+gap+1)) + "}", "lay:{g" + string(rune('a'+gap+1)) + "}:60000ms"}
		a, err := eng.BookAll(ctx, keys, lims, []throttle.Request{spForever})
		require.NoError(t, err)
		if gap >= 0 {
			_, err = other.Book(ctx, keys[gap], lims[gap], spForever)
			require.NoError(t, err)
		}
		b, err := eng.BookAll(ctx, keys, lims, []throttle.Request{spForever})
		require.NoError(t, err)
		sb := []throttle.Booking{a[0], b[0]}
		if gap >= 0 {
			_, err := eng.RefundUnusedRun(ctx, keys, lims, sb)
			require.ErrorIs(t, err, throttle.ErrInvalidRequest, "gap on key %d", gap)
			continue
		}
		before := spTAT(t, eng, keys, lims)
		gs, err := eng.RefundUnusedRun(ctx, keys, lims, sb)
		require.NoError(t, err)
		t.Logf("no gap: given %v (TATs were %v)", gs, before)
		require.Positive(t, gs[0])
		require.Positive(t, gs[1])
		st := spTAT(t, eng, keys, lims)
		require.True(t, st[0].IsZero() && st[1].IsZero(), "both keys idle again: %v", st)
	}
}

// TestReviewSPLayeredViewAndParentShareGate: a Limiter with one limit
// (Every(2s,1,0)) and a view of it with a further limit (WithLimit: keys
// k and k:60000ms) share the first key. Each way round, a batch's late
// bookings are given back (held under way), and a booking through the
// other waits for it, then lands where a textbook GCRA of the head and B
// puts it; nothing stalls past the release; afterwards the second key of
// the view holds only what stands through the view.
func TestReviewSPLayeredViewAndParentShareGate(t *testing.T) {
	t.Parallel()
	const delay = 60 * time.Millisecond
	l, obs, p := gtLimiter(t, "spview", 0)
	p.SetReplyDelay(delay)
	v, err := l.With(reserve.WithLimit(throttle.Every(time.Minute, 20, 4)))
	require.NoError(t, err)
	ctx := context.Background()
	for _, tc := range []struct {
		name      string
		late, nxt *reserve.Limiter
	}{{"parent-late-view-books", l, v}, {"view-late-parent-books", v, l}} {
		key := "sv-" + tc.name
		release := obs.arm()
		h, b := gtLateBatch(t, tc.late, key, 3, delay)
		<-obs.entered
		done := make(chan *reserve.Reservation, 1)
		t0 := time.Now()
		go func() {
			r, err := tc.nxt.Reserve(ctx, key)
			if err != nil {
				t.Error(err)
			}
			done <- r
		}()
		select {
		case r := <-done:
			t.Fatalf("%s: booked during the give-back at +%v", tc.name, r.Booking().At.Sub(h))
		case <-time.After(200 * time.Millisecond):
		}
		release()
		var r *reserve.Reservation
		select {
		case r = <-done:
		case <-time.After(5 * time.Second):
			t.Fatalf("%s: stalled after the give-back was done", tc.name)
		}
		t.Logf("%s: waited %v; booked at head+%v", tc.name, time.Since(t0), r.Booking().At.Sub(h))
		want := hdReplay([]hdBooking{{h, 1}, {b.Booking().At, 1}}, gtI, 0, 1)
		require.Equal(t, want, r.Booking().At, "%s: room lost or early", tc.name)
		// Control: the same three bookings on a fresh key, nothing late.
		ctl := key + "-ctl"
		ch, err := tc.late.Reserve(ctx, ctl)
		require.NoError(t, err)
		_, err = tc.late.Reserve(ctx, ctl)
		require.NoError(t, err)
		_, err = tc.nxt.Reserve(ctx, ctl)
		require.NoError(t, err)
		st, err := v.State(ctx, key)
		require.NoError(t, err)
		cst, err := v.State(ctx, ctl)
		require.NoError(t, err)
		for i := range st.Keys {
			got, want := st.Keys[i].TAT.Sub(h), cst.Keys[i].TAT.Sub(ch.Booking().At)
			t.Logf("%s: key %d TAT head+%v, control head+%v", tc.name, i, got, want)
			require.InDelta(t, float64(want), float64(got), float64(300*time.Millisecond), "%s: key %d holds other than what stands", tc.name, i)
		}
	}
}

// TestReviewSPOtherProcessBetweenReplyAndGiveBack: a batch [B, E, E, E]
// whose E's are late; right as its reply is read (before the give-back
// goes out), another process (an engine of its own on the same Redis)
// books one unit, which lands above the late bookings. The span refund
// must then give nothing back (something stands on them): nothing may
// act early. Judged: head, B, the other's booking and the next two
// bookings conform to a textbook GCRA.
func TestReviewSPOtherProcessBetweenReplyAndGiveBack(t *testing.T) {
	t.Parallel()
	const delay = 60 * time.Millisecond
	obs := newGtObs()
	eng, p, prefix := proxiedEngineOn(t, redistest.Shared(t), 32, throttle.WithObserver(obs))
	lim := throttle.Every(gtI, 1, 0)
	l, err := reserve.New(eng, "spother", lim, reserve.WithoutMaxWait())
	require.NoError(t, err)
	srv := redistest.Shared(t)
	other, err := throttle.New(srv.Client(t), throttle.WithPrefix(prefix), throttle.WithTimeout(10*time.Second))
	require.NoError(t, err)
	ol, err := reserve.New(other, "spother", lim, reserve.WithoutMaxWait())
	require.NoError(t, err)
	p.SetReplyDelay(delay)
	ctx := context.Background()
	key := "o"
	head, err := l.Reserve(ctx, key)
	require.NoError(t, err)
	var theirs *reserve.Reservation
	f := func() {
		r, err := ol.Reserve(ctx, key)
		if err != nil {
			t.Error(err)
			return
		}
		theirs = r
	}
	ec, cancel := context.WithCancel(ctx)
	defer cancel()
	time.AfterFunc(delay/3, cancel)
	before := obs.calls.Load()
	obs.onDecide.Store(&f)
	rs, err := l.ReserveBatch(ctx, key, []reserve.BatchRequest{{N: 1}, {Context: ec, N: 1}, {Context: ec, N: 1}, {Context: ec, N: 1}})
	require.NoError(t, err)
	require.True(t, rs[0].OK())
	require.NotNil(t, theirs)
	time.Sleep(500 * time.Millisecond) // the give-back is done
	h := head.Booking().At
	t.Logf("their booking at head+%v; calls since the batch %d", theirs.Booking().At.Sub(h), obs.calls.Load()-before)
	stand := []hdBooking{{h, 1}, {rs[0].Booking().At, 1}, {theirs.Booking().At, 1}}
	for range 2 {
		r, err := l.Reserve(ctx, key)
		require.NoError(t, err)
		stand = append(stand, hdBooking{r.Booking().At, 1})
		t.Logf("next at head+%v", r.Booking().At.Sub(h))
	}
	require.NoError(t, gtConform(stand, 0))
}

// TestReviewSPAllowCtxEndsAtGate (not parallel: goroutines): an AllowN
// whose ctx ends while it waits at the gate (a give-back held under way)
// returns its ctx's error promptly, before the give-back is done, and
// sends nothing (no script call); after the release, the key holds only
// the head and B.
func TestReviewSPAllowCtxEndsAtGate(t *testing.T) {
	redistest.Shared(t) // its server's goroutines are no leak
	base := goleak.IgnoreCurrent()
	t.Run("run", func(t *testing.T) {
		const delay = 60 * time.Millisecond
		l, obs, p := gtLimiter(t, "spallowctx", 3)
		p.SetReplyDelay(delay)
		ctx := context.Background()
		release := obs.arm()
		defer release()
		h, b := gtLateBatch(t, l, "a", 2, delay)
		<-obs.entered
		for _, how := range []string{"deadline", "cancel"} {
			obs.mu.Lock()
			logged := len(obs.callLog)
			obs.mu.Unlock()
			var actx context.Context
			var cancel context.CancelFunc
			if how == "deadline" {
				actx, cancel = context.WithTimeout(ctx, 150*time.Millisecond)
			} else {
				actx, cancel = context.WithCancel(ctx)
				time.AfterFunc(150*time.Millisecond, cancel)
			}
			t0 := time.Now()
			res, err := l.Allow(actx, "a")
			d := time.Since(t0)
			cancel()
			obs.mu.Lock()
			newCalls := append([]gtCall(nil), obs.callLog[logged:]...)
			obs.mu.Unlock()
			t.Logf("%s: Allow at the gate: %+v %v after %v; calls reported %v", how, res, err, d, newCalls)
			require.Error(t, err, how)
			require.True(t, errors.Is(err, context.DeadlineExceeded) || errors.Is(err, context.Canceled), "%s: %v", how, err)
			require.False(t, res.Allowed)
			require.Less(t, d, 1500*time.Millisecond, "%s: not prompt", how)
			for _, c := range newCalls {
				// A call that reached Redis ends without the ctx's error
				// (the reply, or the client's own error).
				require.True(t, errors.Is(c.err, context.DeadlineExceeded) || errors.Is(c.err, context.Canceled),
					"%s: a call went out for a caller gone at the gate: %v", how, c.err)
			}
		}
		release()
		time.Sleep(300 * time.Millisecond)
		st, err := l.State(ctx, "a")
		require.NoError(t, err)
		// Burst 3: head at h (TAT h+I), B right after (TAT h+2I).
		t.Logf("TAT head+%v (want head+%v); B at head+%v", st.Keys[0].TAT.Sub(h), 2*gtI, b.Booking().At.Sub(h))
		require.Equal(t, h.Add(2*gtI), st.Keys[0].TAT, "the key holds head and B only")
	})
	time.Sleep(1500 * time.Millisecond)
	require.NoError(t, goleak.Find(base))
}

// TestReviewSPAllowFallbackRedisStopped (not parallel: goroutines, SIGSTOP
// of a server of its own): FailOpen and LocalShare limiters; Redis is
// stopped as a batch's reply is read, so its late bookings' give-back is
// stuck. An Allow of the key waits at the gate at most about the
// give-back's second, then gets an answer (the fallback's, or an error)
// in bounded time; nothing is left running.
func TestReviewSPAllowFallbackRedisStopped(t *testing.T) {
	base := goleak.IgnoreCurrent()
	for _, fb := range []struct {
		name string
		f    reserve.Fallback
	}{{"failopen", reserve.FailOpen()}, {"localshare", reserve.LocalShare(time.Second, 2, 100)}} {
		t.Run(fb.name, func(t *testing.T) {
			const delay = 60 * time.Millisecond
			srv := redistest.Start(t)
			l, obs, p := gtLimiterOn(t, srv, "spfb"+fb.name, 1, reserve.WithFallback(fb.f))
			_ = l
			pause := func() { _ = syscall.Kill(srv.Pid(), syscall.SIGSTOP) }
			resume := func() { _ = syscall.Kill(srv.Pid(), syscall.SIGCONT) }
			t.Cleanup(resume)
			p.SetReplyDelay(delay)
			ctx := context.Background()
			_, err := l.Reserve(ctx, "f")
			require.NoError(t, err)
			f := pause
			obs.onDecide.Store(&f)
			ec, cancel := context.WithCancel(ctx)
			defer cancel()
			time.AfterFunc(delay/3, cancel)
			rs, err := l.ReserveBatch(ctx, "f", []reserve.BatchRequest{{N: 1}, {Context: ec, N: 1}})
			require.NoError(t, err)
			require.True(t, rs[0].OK())
			t0 := time.Now()
			type ans struct {
				res throttle.Result
				err error
				d   time.Duration
			}
			var got []ans
			for i := 0; i < 4; i++ {
				actx, c := context.WithTimeout(ctx, 1500*time.Millisecond)
				res, err := l.Allow(actx, "f")
				c()
				got = append(got, ans{res, err, time.Since(t0)})
			}
			for i, a := range got {
				t.Logf("%s: Allow %d: allowed %v err %v at +%v", fb.name, i, a.res.Allowed, a.err, a.d)
			}
			obs.mu.Lock()
			for _, c := range obs.callLog {
				if c.at.After(t0.Add(-time.Second)) {
					t.Logf("%s: call reported at %+v: %v", fb.name, c.at.Sub(t0), c.err)
				}
			}
			obs.mu.Unlock()
			require.Less(t, got[len(got)-1].d, 10*time.Second, "%s: Allows stalled", fb.name)
			resume()
		})
	}
	time.Sleep(2 * time.Second)
	require.NoError(t, goleak.Find(base, goleak.IgnoreTopFunction("time.Sleep")))
}
