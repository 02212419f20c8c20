package reserve_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/slotbook/slotbook/internal/redistest"
	"github.com/slotbook/slotbook/reserve"
	"github.com/slotbook/slotbook/throttle"
)

// Review (helper-76) of 3013aec (Engine.callerEnded judging calls made on
// waitbound.WithoutDeadline(callerCtx)), through the public API. Its one
// failing test, TestReviewClsPoolWaitMerged, passes since waitbound.Hidden
// no longer sees through a context made from WithoutDeadline's (the merged
// call's context.WithoutCancel). Helpers
// dlfLim, dlfProbeEngine, dlfStanding, dlfIsCtxErr come from
// review_dlflight_test.go; proxiedEngine(On) from
// coalesce_solo_sidepaths_test.go.

// clsHoldPool takes every connection of the engine's client (PoolSize 2)
// with BLPOPs on keys nobody pushes to, for about d, and returns once they
// are sent (the pool full).
func clsHoldPool(t *testing.T, eng *throttle.Engine, d time.Duration) {
	t.Helper()
	rdb := eng.Client().(*redis.Client)
	ctx, cancel := context.WithTimeout(context.Background(), d+2*time.Second)
	var wg sync.WaitGroup
	for i := range 2 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			_ = rdb.BLPop(ctx, d, fmt.Sprintf("%sblpop:%d", eng.Prefix(), i)).Err()
		}()
	}
	t.Cleanup(func() { cancel(); wg.Wait() })
	require.Eventually(t, func() bool { return rdb.PoolStats().TotalConns >= 2 }, 2*time.Second, 5*time.Millisecond)
	time.Sleep(50 * time.Millisecond) // both BLPOPs written
}

// TestReviewClsPoolWaitSolo (brief 1): PoolSize 2, both connections held
// by BLPOPs on the same client, engine timeout 300 ms. Callers alone
// (distinct keys, two at a time: the engine's gate never fills) whose
// deadline (100 ms) or cancel (100 ms) lands while their call waits in
// go-redis's pool: each returns at its end, well before the control (no
// end, ends at the engine's timeout as "client saturated"), with its
// context's error; the breaker stays closed for both.
func TestReviewClsPoolWaitSolo(t *testing.T) {
	t.Parallel()
	eng, _, _ := proxiedEngine(t, 2, throttle.WithTimeout(300*time.Millisecond))
	l, err := reserve.New(eng, "pw", dlfLim(5), reserve.WithCoalescing(false))
	require.NoError(t, err)
	bg := context.Background()
	r, err := l.Reserve(bg, "warm")
	require.NoError(t, err)
	require.NoError(t, r.Cancel(bg))
	clsHoldPool(t, eng, 4*time.Second)

	// Control.
	start := time.Now()
	_, cerr := l.Reserve(bg, "ctl")
	ctlTook := time.Since(start)
	t.Logf("control: %v in %v", cerr, ctlTook)
	require.ErrorIs(t, cerr, throttle.ErrUnavailable)
	open, _ := eng.Unavailable()
	require.False(t, open, "saturated control left the breaker unchanged")

	for i := range 6 {
		var ctx context.Context
		var cancel context.CancelFunc
		if i%2 == 0 {
			ctx, cancel = context.WithTimeout(bg, 100*time.Millisecond)
		} else {
			ctx, cancel = context.WithCancel(bg)
			time.AfterFunc(100*time.Millisecond, cancel)
		}
		start := time.Now()
		_, err := l.Reserve(ctx, fmt.Sprintf("e%d", i))
		took := time.Since(start)
		cancel()
		t.Logf("ended %d: %v in %v", i, err, took)
		require.Error(t, err)
		require.ErrorIs(t, err, ctx.Err(), "ended caller %d gets its context's error", i)
		require.Less(t, took, ctlTook-100*time.Millisecond, "ended caller %d returns at its end, before the control", i)
		open, _ := eng.Unavailable()
		require.False(t, open, "ended caller %d opened the breaker", i)
	}
}

// TestReviewClsPoolWaitMerged (brief 1, 5): PoolSize 2, both connections
// held by BLPOPs, engine timeout 300 ms. Two fillers (no end) take the
// engine's gate and wait in go-redis's pool; four more bookings on other
// keys find every connection busy and are merged: the first (the batch's
// leader) has a deadline of 450 ms, which passes while the merged call
// (sent at ~300 ms, when a filler gives its token back) waits in
// go-redis's pool for a connection; the other three have no end. The
// merged call ends at the engine's timeout (~600 ms), saturated: the
// three whose contexts never ended must see what the fillers see
// (ErrUnavailable, "client saturated"), not the leader's context error
// (at 3013aec they saw the leader's, the merged call judged by it).
func TestReviewClsPoolWaitMerged(t *testing.T) {
	t.Parallel()
	eng, _, _ := proxiedEngine(t, 2, throttle.WithTimeout(300*time.Millisecond), throttle.WithMergeWait(50*time.Millisecond))
	l, err := reserve.New(eng, "pm", dlfLim(5), reserve.WithCoalescing(false))
	require.NoError(t, err)
	bg := context.Background()
	r, err := l.Reserve(bg, "warm")
	require.NoError(t, err)
	require.NoError(t, r.Cancel(bg))
	clsHoldPool(t, eng, 5*time.Second)

	type res struct {
		err  error
		took time.Duration
	}
	var wg sync.WaitGroup
	fill := make([]res, 2)
	for i := range fill {
		wg.Add(1)
		go func() {
			defer wg.Done()
			s := time.Now()
			_, err := l.Reserve(bg, fmt.Sprintf("f%d", i))
			fill[i] = res{err, time.Since(s)}
		}()
	}
	time.Sleep(60 * time.Millisecond) // fillers at the gate's two tokens
	var lead res
	lctx, lcancel := context.WithTimeout(bg, 450*time.Millisecond)
	defer lcancel()
	wg.Add(1)
	go func() {
		defer wg.Done()
		s := time.Now()
		_, err := l.Reserve(lctx, "lead")
		lead = res{err, time.Since(s)}
	}()
	time.Sleep(20 * time.Millisecond)
	fol := make([]res, 3)
	for i := range fol {
		wg.Add(1)
		go func() {
			defer wg.Done()
			s := time.Now()
			_, err := l.Reserve(bg, fmt.Sprintf("m%d", i))
			fol[i] = res{err, time.Since(s)}
		}()
	}
	wg.Wait()
	for i, f := range fill {
		t.Logf("filler %d: %v in %v", i, f.err, f.took)
	}
	t.Logf("leader (deadline 450ms): %v in %v", lead.err, lead.took)
	for i, f := range fol {
		t.Logf("follower %d (no end): %v in %v", i, f.err, f.took)
	}
	for _, f := range fill {
		require.ErrorIs(t, f.err, throttle.ErrUnavailable)
	}
	require.ErrorIs(t, lead.err, context.DeadlineExceeded)
	open, _ := eng.Unavailable()
	require.False(t, open, "saturation left the breaker unchanged")
	for i, f := range fol {
		require.ErrorIs(t, f.err, throttle.ErrUnavailable,
			"follower %d, whose context never ended, got the leader's context error (%v) instead of the saturated class the fillers got", i, f.err)
	}
}

// TestReviewClsPausedMerged (brief 2, 5): CLIENT PAUSE ALL 1.2 s, engine
// timeout 200 ms. Eight concurrent callers on distinct keys (some merged:
// four in flight) with a deadline of 50 ms, against a control engine on
// the same server whose eight callers have no end. Both breakers open; a
// caller afterwards fails fast; each ended caller's error matches its
// context's and ErrReplyLost; after the pause the breaker closes again
// (probe), and the keys of callers that got only errors hold no units
// (units that stand are logged: a lost reply may leak, as documented).
func TestReviewClsPausedMerged(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	bg := context.Background()
	lim := dlfLim(5)
	type side struct {
		eng    *throttle.Engine
		l      *reserve.Limiter
		prefix string
	}
	mk := func() side {
		prefix := redistest.Prefix(t)
		o := srv.Options()
		o.PoolSize = 10
		rdb := redis.NewClient(o)
		t.Cleanup(func() { _ = rdb.Close() })
		eng, err := throttle.New(rdb, throttle.WithPrefix(prefix), throttle.WithTimeout(200*time.Millisecond),
			throttle.WithProbeBackoff(50*time.Millisecond, 200*time.Millisecond))
		require.NoError(t, err)
		require.NoError(t, eng.Load(bg))
		l, err := reserve.New(eng, "pz", lim, reserve.WithCoalescing(false))
		require.NoError(t, err)
		for i := range 8 { // warm connections
			r, err := l.Reserve(bg, fmt.Sprintf("warm%d", i))
			require.NoError(t, err)
			require.NoError(t, r.Cancel(bg))
		}
		return side{eng, l, prefix}
	}
	E, C := mk(), mk()
	require.NoError(t, srv.Client(t).Do(bg, "CLIENT", "PAUSE", 1200, "ALL").Err())
	pausedAt := time.Now()
	run := func(s side, ended bool) ([]error, []error) {
		errs := make([]error, 8)
		cerrs := make([]error, 8)
		var wg sync.WaitGroup
		for i := range 8 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				ctx, cancel := context.WithCancel(bg)
				if ended {
					ctx, cancel = context.WithTimeout(bg, 50*time.Millisecond)
				}
				defer cancel()
				r, err := s.l.Reserve(ctx, fmt.Sprintf("k%d", i))
				if err == nil {
					_ = r.Cancel(bg)
				}
				errs[i] = err
				cerrs[i] = ctx.Err()
			}()
		}
		wg.Wait()
		return errs, cerrs
	}
	var eErrs, eCtx, cErrs []error
	var wg sync.WaitGroup
	wg.Add(2)
	go func() { defer wg.Done(); eErrs, eCtx = run(E, true) }()
	go func() { defer wg.Done(); cErrs, _ = run(C, false) }()
	wg.Wait()
	for i := range 8 {
		t.Logf("ended %d: %v | control %d: %v", i, eErrs[i], i, cErrs[i])
	}
	eOpen, _ := E.eng.Unavailable()
	cOpen, _ := C.eng.Unavailable()
	t.Logf("breaker open: ended side %v, control %v", eOpen, cOpen)
	require.True(t, cOpen, "control: the breaker opened")
	require.Equal(t, cOpen, eOpen, "ended callers' calls ran to the engine's timeout on a paused Redis as the control's")
	for i := range 8 {
		require.Error(t, eErrs[i])
		require.ErrorIs(t, eErrs[i], eCtx[i], "ended caller %d: its context's error", i)
		// A call that had to dial (HELLO unanswered) sent nothing: only
		// ErrUnavailable; one sent on a warm connection lost its reply. One
		// whose deadline came while it waited to join a merged call (or
		// for a connection) left, nothing sent: the context's error alone,
		// as the package doc says (seen on a loaded machine).
		if !errors.Is(eErrs[i], throttle.ErrUnavailable) {
			require.Equal(t, eCtx[i], eErrs[i], "ended caller %d: neither Redis unavailable nor its context's error alone", i)
		}
		t.Logf("ended caller %d: ErrReplyLost in chain: %v (control: %v)", i,
			errors.Is(eErrs[i], throttle.ErrReplyLost), errors.Is(cErrs[i], throttle.ErrReplyLost))
	}
	if time.Since(pausedAt) < time.Second {
		s := time.Now()
		_, err := E.l.Reserve(bg, "after")
		took := time.Since(s)
		t.Logf("later caller: %v in %v", err, took)
		require.ErrorIs(t, err, throttle.ErrUnavailable)
		require.Less(t, took, 100*time.Millisecond, "a later caller fails fast")
	}
	// After the pause: probes close the breaker.
	time.Sleep(time.Until(pausedAt.Add(1300 * time.Millisecond)))
	require.Eventually(t, func() bool {
		r, err := E.l.Reserve(bg, "probe")
		if err == nil {
			_ = r.Cancel(bg)
		}
		open, _ := E.eng.Unavailable()
		return err == nil && !open
	}, 5*time.Second, 50*time.Millisecond, "the breaker closes after the pause")
	probe := dlfProbeEngine(t, srv, E.prefix)
	var leaked []string
	for i := range 8 {
		if eErrs[i] != nil {
			if n := dlfStanding(t, probe, fmt.Sprintf("pz:k%d", i), lim); n != 0 {
				leaked = append(leaked, fmt.Sprintf("k%d: %d", i, n))
			}
		}
	}
	t.Logf("units standing for ended callers (no holder): %v", leaked)
}

// TestReviewClsNoTimeoutSocket (brief 3): WithTimeout(0), replies held
// 150 ms by the proxy, 30 callers with deadlines of 20-100 ms (the socket
// deadline is theirs): the breaker never opens, each gets its context's
// error (with ErrReplyLost: sent). Then the server stops: a caller with no
// end opens it.
func TestReviewClsNoTimeoutSocket(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	eng, p, _ := proxiedEngineOn(t, srv, 0, throttle.WithTimeout(0))
	l, err := reserve.New(eng, "nt", dlfLim(5), reserve.WithCoalescing(false))
	require.NoError(t, err)
	bg := context.Background()
	r, err := l.Reserve(bg, "warm")
	require.NoError(t, err)
	require.NoError(t, r.Cancel(bg))
	p.SetReplyDelay(150 * time.Millisecond)
	var opened []int
	var wg sync.WaitGroup
	var mu sync.Mutex
	for i := range 30 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			ctx, cancel := context.WithTimeout(bg, time.Duration(20+(i*80)/30)*time.Millisecond)
			defer cancel()
			_, err := l.Reserve(ctx, fmt.Sprintf("k%d", i%6))
			mu.Lock()
			defer mu.Unlock()
			if !errors.Is(err, context.DeadlineExceeded) {
				t.Errorf("caller %d: %v, want its deadline's error", i, err)
			}
			if open, _ := eng.Unavailable(); open {
				opened = append(opened, i)
			}
		}()
		time.Sleep(3 * time.Millisecond)
	}
	wg.Wait()
	require.Empty(t, opened, "deadlines on the socket opened the breaker")
	p.SetReplyDelay(0)
	srv.Stop()
	_, err = l.Reserve(bg, "down")
	t.Logf("server stopped: %v", err)
	require.ErrorIs(t, err, throttle.ErrUnavailable)
	open, _ := eng.Unavailable()
	require.True(t, open, "a real outage opens the breaker")
}

// TestReviewClsRefusedDial (brief 4): the proxy closed (dials refused),
// engine timeout 300 ms: a caller whose deadline (30 ms) ends while go-redis
// dials (and backs off between attempts) and a control with no end, each
// on an engine of its own. The control is ErrUnavailable and opens the
// breaker; the ended caller gets its context's error and leaves it closed
// (go-redis hides the refusal behind its background dial), as do the ended
// callers after it until go-redis returns the refusal itself (logged).
func TestReviewClsRefusedDial(t *testing.T) {
	t.Parallel()
	bg := context.Background()
	type out struct {
		err  error
		took time.Duration
		open bool
	}
	run := func(ended bool) out {
		eng, p, _ := proxiedEngine(t, 2, throttle.WithTimeout(300*time.Millisecond))
		l, err := reserve.New(eng, "rd", dlfLim(5), reserve.WithCoalescing(false))
		require.NoError(t, err)
		p.Close()
		ctx, cancel := context.WithCancel(bg)
		if ended {
			ctx, cancel = context.WithTimeout(bg, 30*time.Millisecond)
		}
		defer cancel()
		s := time.Now()
		_, err = l.Reserve(ctx, "k")
		o := out{err: err, took: time.Since(s)}
		o.open, _ = eng.Unavailable()
		if ended {
			require.ErrorIs(t, err, ctx.Err(), "ended caller: its context's error")
			// More callers like it, one after another, over ~1 s of
			// refused dials: does the breaker ever open, do they ever
			// fail fast?
			for i := range 20 {
				if o.open {
					break
				}
				c2, cancel2 := context.WithTimeout(bg, 30*time.Millisecond)
				s := time.Now()
				_, err := l.Reserve(c2, fmt.Sprintf("k%d", i))
				cancel2()
				o.open, _ = eng.Unavailable()
				t.Logf("ended caller %d more: %v in %v, open %v", i, err, time.Since(s), o.open)
				time.Sleep(20 * time.Millisecond)
			}
		}
		return o
	}
	e, c := run(true), run(false)
	t.Logf("ended: %v in %v, open %v", e.err, e.took, e.open)
	t.Logf("control: %v in %v, open %v", c.err, c.took, c.open)
	require.ErrorIs(t, c.err, throttle.ErrUnavailable)
	require.True(t, c.open)
	// go-redis v9.23 dials in the background and a caller whose context
	// ends first gets its context's error, the refusal hidden: "caller
	// gave up", breaker unchanged, until go-redis has counted PoolSize
	// failed dials and returns the refusal at once; then it opens.
	require.True(t, e.open, "refused dials open the breaker in the end, whoever's context ended")
}
