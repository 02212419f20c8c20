package httplimit_test

// Adversarial review (3) of httplimit after the commit "a booking heeds
// every pause its Transport learnt of ...; a pause that could not be stored
// refuses at once a request whose budget it exceeds", through the public
// API only. Faults in the store of a pause are injected with a go-redis
// hook on the engine's client, recognising the pause script by its SHA
// (learnt from a lim.Pause call), as review 2 did.

import (
	"context"
	"errors"
	"fmt"
	"math/rand"
	"net/http"
	"net/url"
	"runtime"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/slotbook/slotbook/deadline"
	"github.com/slotbook/slotbook/httplimit"
	"github.com/slotbook/slotbook/internal/redistest"
	"github.com/slotbook/slotbook/reserve"
	"github.com/slotbook/slotbook/throttle"
)

// ---------------------------------------------------------------- helpers

var errRV3Injected = errors.New("rv3: injected pause failure")

func rv3CPU() time.Duration {
	var ru syscall.Rusage
	_ = syscall.Getrusage(syscall.RUSAGE_SELF, &ru)
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

func rv3KeyHeader(r *http.Request) string { return r.Header.Get("X-Key") }

// ------------------------------- the budget while the pause is being stored

// R's 429 (Retry-After: 3) is learnt; its store is held 900 ms by the hook
// (then stored, or failed). W, of the same key, starts while the store is
// held, with a 400 ms max wait or a 700 ms context deadline: whether the
// pause ends up stored or not, its end lies beyond W's budget, so W is
// refused either way; the package says such a request is "refused at once"
// (with the pause's end as retry-after when unstored; the limiter's when
// stored). Control: the same W once the store has ended (refused at once).
func TestReviewHTTP3BudgetWhileStoring(t *testing.T) {
	bg := context.Background()
	type outcome struct {
		err     error
		elapsed time.Duration
		closes  int32
		sent    bool
	}
	try := func(t *testing.T, bound string, held bool, storeFails bool) outcome {
		var opts []reserve.Option
		if bound == "maxwait" {
			opts = append(opts, reserve.WithMaxWait(400*time.Millisecond))
		}
		// The engine's timeout (2 s) lets the held store run its 900 ms.
		lim, h := rvSetup(t, nil, redistest.Prefix(t), 2*time.Second, throttle.PerSecond(10, 5), opts...)
		in := make(chan struct{})
		var once sync.Once
		h.setPause(func(ctx context.Context, s string) error {
			if s != "k" {
				return nil
			}
			once.Do(func() { close(in) })
			if held {
				select {
				case <-time.After(900 * time.Millisecond):
				case <-ctx.Done():
					return ctx.Err()
				}
			}
			if storeFails {
				return errRV3Injected
			}
			return nil
		})
		up := rvNewUp(t, func(_ int, r *http.Request, w http.ResponseWriter) {
			if r.Header.Get("X-RV-ID") == "R" {
				w.Header().Set("Retry-After", "3")
				w.WriteHeader(http.StatusTooManyRequests)
			}
		})
		tr, err := httplimit.New(lim, httplimit.WithBase(up.client), httplimit.WithKey(func(*http.Request) string { return "k" }))
		require.NoError(t, err)
		rDone := rvGo(t, bg, tr, up.URL, "R")
		<-in
		if !held {
			<-rDone
		}
		ctx, cancel := context.WithTimeout(bg, 5*time.Second)
		if bound == "deadline" {
			ctx, cancel = context.WithTimeout(bg, 700*time.Millisecond)
		}
		defer cancel()
		b := &rvBody{Reader: strings.NewReader("w")}
		start := time.Now()
		resp, err := tr.RoundTrip(rvReq(t, ctx, up.URL, "W", b))
		o := outcome{err: err, elapsed: time.Since(start), closes: b.closes.Load()}
		rvDrain(resp)
		<-rDone
		_, o.sent = up.gotID("W")
		return o
	}
	for _, bound := range []string{"maxwait", "deadline"} {
		for _, fails := range []bool{false, true} {
			name := map[string]string{"maxwait": "max wait 400ms", "deadline": "deadline 700ms"}[bound] +
				map[bool]string{false: "/held then stored", true: "/held then failed"}[fails]
			t.Run(name, func(t *testing.T) {
				ctl := try(t, bound, false, fails)
				var ns *httplimit.NotSentError
				require.ErrorAs(t, ctl.err, &ns, "control")
				_, ok := ns.RetryAfter()
				require.True(t, ok, "control refused with a retry-after: %v", ctl.err)
				got := try(t, bound, true, fails)
				t.Logf("control (store ended): %v after %v; during the store: err=%v after %v, closes %d, sent %v",
					ctl.err, ctl.elapsed.Round(time.Millisecond), got.err, got.elapsed.Round(time.Millisecond), got.closes, got.sent)
				require.False(t, got.sent, "sent inside the 3 s pause")
				require.EqualValues(t, 1, got.closes, "body closed once")
				require.ErrorAs(t, got.err, &ns)
				ra, ok := ns.RetryAfter()
				require.True(t, ok, "a request whose budget the pause exceeds (whether or not it ends up stored) is refused with a retry-after, got %v", got.err)
				require.Greater(t, ra, time.Second)
				require.Less(t, got.elapsed, ctl.elapsed+300*time.Millisecond,
					"refused at once? it returned after %v (control %v): it waited for the store although the pause's end lay beyond its budget either way",
					got.elapsed.Round(time.Millisecond), ctl.elapsed.Round(time.Millisecond))
			})
		}
	}
}

// ------------------------------ the max wait across an unstored pause

// One request every 400 ms (no burst), max wait 1 s. R's 429 (Retry-After:
// 1) pauses the key; four requests W0-W3 start together once R's RoundTrip
// has returned. Control: the pause stored, each W waits at most the max
// wait (the rest are refused). The pause unstored: the Ws wait it out
// locally (it ends within their max wait), then book against the limiter
// with their whole max wait again: a request may wait pause + max wait.
func TestReviewHTTP3MaxWaitAcrossUnstoredPause(t *testing.T) {
	bg := context.Background()
	const maxWait = time.Second
	run := func(t *testing.T, stored bool) (waits []time.Duration, refused int) {
		lim, h := rvSetup(t, nil, redistest.Prefix(t), 500*time.Millisecond, throttle.Every(400*time.Millisecond, 1, 0), reserve.WithMaxWait(maxWait))
		if !stored {
			h.setPause(func(_ context.Context, s string) error {
				if s == "k" {
					return errRV3Injected
				}
				return nil
			})
		}
		up := rvNewUp(t, func(_ int, r *http.Request, w http.ResponseWriter) {
			if r.Header.Get("X-RV-ID") == "R" {
				w.Header().Set("Retry-After", "1")
				w.WriteHeader(http.StatusTooManyRequests)
			}
		})
		sent := rvNewSent(up.client)
		tr, err := httplimit.New(lim, httplimit.WithBase(sent), httplimit.WithKey(func(*http.Request) string { return "k" }))
		require.NoError(t, err)
		resp, err := tr.RoundTrip(rvReq(t, bg, up.URL, "R", nil))
		require.NoError(t, err)
		rvDrain(resp)
		var wg sync.WaitGroup
		starts := make([]time.Time, 4)
		errs := make([]error, 4)
		for i := range starts {
			wg.Add(1)
			go func() {
				defer wg.Done()
				starts[i] = time.Now()
				resp, err := tr.RoundTrip(rvReq(t, bg, up.URL, "W"+strconv.Itoa(i), nil))
				errs[i] = err
				rvDrain(resp)
			}()
		}
		wg.Wait()
		s := sent.copy()
		for i := range starts {
			if at, ok := s["W"+strconv.Itoa(i)]; ok {
				waits = append(waits, at.Sub(starts[i]))
			} else {
				require.ErrorIs(t, errs[i], reserve.ErrMaxWaitExceeded)
				refused++
			}
		}
		sort.Slice(waits, func(i, j int) bool { return waits[i] < waits[j] })
		return waits, refused
	}
	ctlWaits, ctlRefused := run(t, true)
	waits, refused := run(t, false)
	t.Logf("max wait %v; pause stored (control): waits %v, %d refused; unstored: waits %v, %d refused", maxWait, ctlWaits, ctlRefused, waits, refused)
	for _, w := range ctlWaits {
		require.LessOrEqual(t, w, maxWait+250*time.Millisecond, "control")
	}
	for _, w := range waits {
		require.LessOrEqual(t, w, maxWait+250*time.Millisecond,
			"a request waited %v before it was sent, with a max wait of %v (the stored control waits at most %v and refuses %d)",
			w.Round(time.Millisecond), maxWait, ctlWaits[len(ctlWaits)-1].Round(time.Millisecond), ctlRefused)
	}
}

// ----------------------------------- the refusal's chain and retry-after

// Through an http.Client: a key paused 3 s by this Transport's own 429,
// the pause stored (control) or not. A request whose budget the pause
// exceeds is refused at once, not sent, its body closed once; the error is
// a *url.Error wrapping a *NotSentError wrapping a *deadline.Error that
// matches the bound's sentinel (and not the other's); its retry-after is
// the pause's remaining time (judged against the upstream's answer + 3 s,
// and against the stored control in the same run).
func TestReviewHTTP3RefusalChain(t *testing.T) {
	bg := context.Background()
	type outcome struct {
		err     error
		elapsed time.Duration
		closes  int32
		sent    bool
		expect  time.Duration // the upstream's answer + 3 s, less the refusal's instant
	}
	try := func(t *testing.T, mode string, stored bool) outcome {
		var opts []reserve.Option
		switch mode {
		case "max wait":
			opts = append(opts, reserve.WithMaxWait(500*time.Millisecond))
		case "no time for the work":
			opts = append(opts, reserve.WithWorkEstimate(time.Second))
		}
		lim, h := rvSetup(t, nil, redistest.Prefix(t), 500*time.Millisecond, throttle.PerSecond(10, 5), opts...)
		if !stored {
			h.setPause(func(_ context.Context, s string) error {
				if s == "k" {
					return errRV3Injected
				}
				return nil
			})
		}
		var ansAt atomic.Int64
		up := rvNewUp(t, func(_ int, r *http.Request, w http.ResponseWriter) {
			if r.Header.Get("X-RV-ID") == "R" {
				ansAt.Store(time.Now().UnixNano())
				w.Header().Set("Retry-After", "3")
				w.WriteHeader(http.StatusTooManyRequests)
			}
		})
		tr, err := httplimit.New(lim, httplimit.WithBase(up.client), httplimit.WithKey(func(*http.Request) string { return "k" }))
		require.NoError(t, err)
		resp, err := tr.RoundTrip(rvReq(t, bg, up.URL, "R", nil))
		require.NoError(t, err)
		rvDrain(resp)
		client := &http.Client{Transport: tr}
		ctx := bg
		switch mode {
		case "context deadline":
			var cancel context.CancelFunc
			ctx, cancel = context.WithTimeout(bg, 800*time.Millisecond)
			defer cancel()
		case "client timeout":
			client.Timeout = 800 * time.Millisecond
		case "no time for the work":
			var cancel context.CancelFunc
			ctx, cancel = context.WithTimeout(bg, 500*time.Millisecond)
			defer cancel()
		}
		b := &rvBody{Reader: strings.NewReader("w")}
		start := time.Now()
		resp, err = client.Do(rvReq(t, ctx, up.URL, "W", b))
		end := time.Now()
		o := outcome{err: err, elapsed: end.Sub(start), closes: b.closes.Load()}
		o.expect = time.Unix(0, ansAt.Load()).Add(3 * time.Second).Sub(end)
		rvDrain(resp)
		_, o.sent = up.gotID("W")
		return o
	}
	for _, mode := range []string{"max wait", "context deadline", "client timeout", "no time for the work"} {
		t.Run(mode, func(t *testing.T) {
			want, other := reserve.ErrWouldExceedDeadline, reserve.ErrMaxWaitExceeded
			if mode == "max wait" {
				want, other = other, want
			}
			ras := map[bool]time.Duration{}
			for _, stored := range []bool{true, false} {
				o := try(t, mode, stored)
				what := map[bool]string{true: "stored (control)", false: "unstored"}[stored]
				t.Logf("%s: %v after %v; pause left at the refusal %v", what, o.err, o.elapsed.Round(time.Millisecond), o.expect.Round(time.Millisecond))
				require.False(t, o.sent, what+": sent")
				require.EqualValues(t, 1, o.closes, what+": body closed once")
				var ue *url.Error
				require.ErrorAs(t, o.err, &ue, what)
				var ns *httplimit.NotSentError
				require.ErrorAs(t, o.err, &ns, what)
				require.Equal(t, "k", ns.Key)
				require.ErrorIs(t, o.err, want, what)
				require.NotErrorIs(t, o.err, other, what)
				var de *deadline.Error
				require.ErrorAs(t, o.err, &de, what)
				ra, ok := ns.RetryAfter()
				require.True(t, ok, what)
				require.Equal(t, de.RetryAfter, ra, what)
				require.Less(t, o.elapsed, 400*time.Millisecond, what+": refused at once")
				ras[stored] = ra
				if mode != "no time for the work" {
					require.InDelta(t, float64(o.expect), float64(ra), float64(150*time.Millisecond),
						"%s: retry-after %v, the pause has %v left", what, ra, o.expect)
				}
			}
			// deadline.Error: "It is 0 when the deadline left no time for
			// the work at all, whatever the slot." The limiter says so for
			// the stored pause; the Transport's own refusal should agree.
			require.InDelta(t, float64(ras[true]), float64(ras[false]), float64(150*time.Millisecond),
				"retry-after: pause stored %v, unstored %v", ras[true], ras[false])
		})
	}
}

// ---------------------------------------------------- no spin, no calls

// CPU time and Redis calls while many requests wait on a pause, against an
// idle control of the same length in the same run: an unstored pause
// waited out locally, a store held 1.5 s, and a stream of 429s of 1 s
// pauses stored/unstored alternately learnt while requests wait.
func TestReviewHTTP3NoSpin(t *testing.T) {
	bg := context.Background()
	lim, h := rvSetup(t, nil, redistest.Prefix(t), 500*time.Millisecond, throttle.PerSecond(40, 0))
	var holdMode atomic.Int32 // 0 stored, 1 failed, 2 held 1.5s then stored, 3 alternate
	var nPause atomic.Int32
	h.setPause(func(ctx context.Context, s string) error {
		if !strings.HasPrefix(s, "k") {
			return nil
		}
		switch holdMode.Load() {
		case 1:
			return errRV3Injected
		case 2:
			select {
			case <-time.After(1500 * time.Millisecond):
			case <-ctx.Done():
				return ctx.Err()
			}
		case 3:
			if nPause.Add(1)%2 == 0 {
				return errRV3Injected
			}
		}
		return nil
	})
	up := rvNewUp(t, func(_ int, r *http.Request, w http.ResponseWriter) {
		if strings.HasPrefix(r.Header.Get("X-RV-ID"), "R") {
			w.Header().Set("Retry-After", r.Header.Get("X-RA"))
			w.WriteHeader(http.StatusTooManyRequests)
		}
	})
	tr, err := httplimit.New(lim, httplimit.WithBase(up.client), httplimit.WithKey(rv3KeyHeader), httplimit.WithPauseTimeout(2*time.Second))
	require.NoError(t, err)
	req := func(ctx context.Context, id, key, ra string) (*http.Response, error) {
		r := rvReq(t, ctx, up.URL, id, nil)
		r.Header.Set("X-Key", key)
		r.Header.Set("X-RA", ra)
		return tr.RoundTrip(r)
	}
	measure := func(d time.Duration) (time.Duration, int64) {
		c0, n0 := rv3CPU(), h.calls.Load()
		time.Sleep(d)
		return rv3CPU() - c0, h.calls.Load() - n0
	}
	runtime.GC()
	idleCPU, idleCalls := measure(time.Second)
	t.Logf("idle control: CPU %v, Redis calls %d in 1s", idleCPU, idleCalls)

	waiters := func(key string, n int) *sync.WaitGroup {
		var wg sync.WaitGroup
		for i := 0; i < n; i++ {
			wg.Add(1)
			go func() {
				defer wg.Done()
				ctx, cancel := context.WithTimeout(bg, 8*time.Second)
				defer cancel()
				resp, err := req(ctx, key+"-W"+strconv.Itoa(i), key, "")
				if err != nil {
					var ns *httplimit.NotSentError
					if !errors.As(err, &ns) {
						t.Errorf("%s W%d: %v", key, i, err)
					}
				}
				rvDrain(resp)
			}()
		}
		return &wg
	}
	check := func(phase string, cpu time.Duration, calls int64) {
		t.Logf("%s: CPU %v, Redis calls %d in 1s (idle %v, %d)", phase, cpu, calls, idleCPU, idleCalls)
		if cpu > idleCPU+200*time.Millisecond {
			t.Errorf("%s: %v of CPU in 1 s while requests wait (idle control %v): spinning?", phase, cpu, idleCPU)
		}
		if calls > idleCalls+2 {
			t.Errorf("%s: %d Redis calls in 1 s while requests wait (idle control %d)", phase, calls, idleCalls)
		}
	}

	// Unstored pause of 2 s, 40 waiters.
	holdMode.Store(1)
	resp, err := req(bg, "R1", "k1", "2")
	require.NoError(t, err)
	rvDrain(resp)
	wg := waiters("k1", 40)
	time.Sleep(200 * time.Millisecond)
	cpu, calls := measure(time.Second)
	check("unstored pause", cpu, calls)
	wg.Wait()

	// Store held 1.5 s (then stored), pause 3 s, 40 waiters (blocked on the
	// store, then booked behind it).
	holdMode.Store(2)
	rDone := make(chan struct{})
	go func() {
		defer close(rDone)
		resp, err := req(bg, "R2", "k2", "3")
		if err != nil {
			t.Errorf("R2: %v", err)
		}
		rvDrain(resp)
	}()
	time.Sleep(100 * time.Millisecond)
	wg = waiters("k2", 40)
	time.Sleep(200 * time.Millisecond)
	cpu, calls = measure(time.Second)
	check("store held", cpu, calls)
	<-rDone
	wg.Wait()

	// A stream of 429s (1 s pauses, stored/unstored alternately), one every
	// 300 ms for 2.4 s, while 20 requests of the key wait: count the
	// Redis calls per waiter over the whole span.
	holdMode.Store(3)
	n0 := h.calls.Load()
	c0 := rv3CPU()
	var rs sync.WaitGroup
	for i := 0; i < 8; i++ {
		rs.Add(1)
		go func() {
			defer rs.Done()
			time.Sleep(time.Duration(i) * 300 * time.Millisecond)
			resp, err := req(bg, "R3-"+strconv.Itoa(i), "k3", "1")
			if err != nil {
				var ns *httplimit.NotSentError
				if !errors.As(err, &ns) {
					t.Errorf("R3-%d: %v", i, err)
				}
			}
			rvDrain(resp)
		}()
	}
	time.Sleep(50 * time.Millisecond)
	wg = waiters("k3", 20)
	rs.Wait()
	wg.Wait()
	calls = h.calls.Load() - n0
	cpu = rv3CPU() - c0
	// Each 429 is at most 2 calls (marker off: 1) plus a booking; each
	// waiter books again at most once per pause learnt while it waited.
	bound := int64(8*(2+1) + 20*(1+8) + 10)
	t.Logf("stream of 8 429s, 20 waiters: %d Redis calls (bound %d), CPU %v", calls, bound, cpu)
	if calls > bound {
		t.Errorf("stream of 429s: %d Redis calls for 28 requests and 8 pauses (bound %d)", calls, bound)
	}
}

// ----------------------------- many goroutines, a stream of 429s, cancels

// One Transport; 8 callers of key "k" and 2 of key "o" for 5 s, above the
// limit (5/s, burst 1). The upstream answers every third "k" request 429
// Retry-After: 1; the pause stores alternately fail and succeed; a quarter
// of the requests' contexts are cancelled at a random instant (0-1.5 s: while
// waiting for a store, waiting out a pause, booking, waiting for a slot,
// or in flight). Oracle: no request sent after a 429 reached its caller
// arrives inside its pause (50 ms slack); "k" conforms to GCRA with the
// stored pauses, "o" to GCRA and keeps at least 60% of its pace; every
// body is closed exactly once; Redis calls per request are bounded;
// goroutines settle.
func TestReviewHTTP3StreamCancels(t *testing.T) {
	const (
		I     = 200 * time.Millisecond
		tau   = I
		slack = 100 * time.Millisecond
		run   = 5 * time.Second
	)
	bg := context.Background()
	lim, h := rvSetup(t, nil, redistest.Prefix(t), 500*time.Millisecond, throttle.Every(time.Second, 5, 1))
	var nStore atomic.Int32
	var mu sync.Mutex
	failed := map[string]bool{}
	h.setPause(func(ctx context.Context, s string) error {
		if s != "k" {
			return nil
		}
		if nStore.Add(1)%2 == 0 {
			return errRV3Injected
		}
		return nil
	})
	answered := map[string]time.Time{}
	var nK atomic.Int32
	up := rvNewUp(t, func(_ int, r *http.Request, w http.ResponseWriter) {
		if r.Header.Get("X-Key") != "k" || nK.Add(1)%3 != 0 {
			return
		}
		mu.Lock()
		answered[r.Header.Get("X-RV-ID")] = time.Now()
		mu.Unlock()
		w.Header().Set("Retry-After", "1")
		w.WriteHeader(http.StatusTooManyRequests)
	})
	sent := rvNewSent(up.client)
	tr, err := httplimit.New(lim, httplimit.WithBase(sent), httplimit.WithKey(rv3KeyHeader),
		httplimit.WithPauseErrorHandler(func(r *http.Request, _ time.Duration, _ error) {
			mu.Lock()
			failed[r.Header.Get("X-RV-ID")] = true
			mu.Unlock()
		}))
	require.NoError(t, err)
	runtime.GC()
	baseG := runtime.NumGoroutine()
	calls0 := h.calls.Load()
	ctx, cancel := context.WithCancel(bg) // no deadline: no budget refusals
	defer cancel()
	stop := time.AfterFunc(run, cancel)
	defer stop.Stop()
	var wg sync.WaitGroup
	var seq atomic.Int64
	var nReq atomic.Int64
	var pauses, stored []rvPause
	var bodies []*rvBody
	notSent := map[string]int{}
	for c := 0; c < 10; c++ {
		key := "k"
		if c >= 8 {
			key = "o"
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			rng := rand.New(rand.NewSource(int64(c) + time.Now().UnixNano()))
			for ctx.Err() == nil {
				id := fmt.Sprintf("%s-%d", key, seq.Add(1))
				rctx, rcancel := context.WithCancel(ctx)
				timer := time.AfterFunc(time.Hour, rcancel)
				if rng.Intn(4) == 0 { // a quarter are cancelled, at a random instant
					timer.Reset(time.Duration(rng.Intn(1500)) * time.Millisecond)
				}
				b := &rvBody{Reader: strings.NewReader("x")}
				mu.Lock()
				bodies = append(bodies, b)
				mu.Unlock()
				req := rvReq(t, rctx, up.URL, id, b)
				req.Header.Set("X-Key", key)
				nReq.Add(1)
				resp, err := tr.RoundTrip(req)
				if err == nil {
					if resp.StatusCode == http.StatusTooManyRequests {
						now := time.Now()
						mu.Lock()
						p := rvPause{back: now, end: answered[id].Add(time.Second)}
						pauses = append(pauses, p)
						if !failed[id] {
							stored = append(stored, p)
						}
						mu.Unlock()
					}
					rvDrain(resp)
				} else {
					var ns *httplimit.NotSentError
					if errors.As(err, &ns) {
						kind := "other"
						switch {
						case errors.Is(err, context.Canceled):
							kind = "canceled"
						case errors.Is(err, reserve.ErrMaxWaitExceeded), errors.Is(err, reserve.ErrWouldExceedDeadline):
							kind = "refused"
						}
						mu.Lock()
						notSent[kind]++
						mu.Unlock()
						if kind == "other" {
							t.Errorf("%s: not sent: %v", id, err)
						}
						time.Sleep(20 * time.Millisecond)
					} else if !errors.Is(err, context.Canceled) {
						t.Errorf("%s: %v", id, err)
					}
				}
				timer.Stop()
				rcancel()
			}
		}()
	}
	wg.Wait()
	calls := h.calls.Load() - calls0
	mu.Lock()
	defer mu.Unlock()
	s := sent.copy()
	var k, o []rvArrival
	for _, a := range up.got() {
		if strings.HasPrefix(a.id, "k") {
			k = append(k, a)
		} else {
			o = append(o, a)
		}
	}
	t.Logf("%d requests, %d Redis calls; k: %d arrivals, %d pauses (%d stored); o: %d arrivals; not sent %v",
		nReq.Load(), calls, len(k), len(pauses), len(stored), len(o), notSent)
	require.NotEmpty(t, pauses)
	for _, b := range rvInside(k, s, pauses, 50*time.Millisecond) {
		t.Error(b)
	}
	for _, b := range rvReplay(k, s, stored, I, tau, slack) {
		t.Error(b)
	}
	for _, b := range rvReplay(o, s, nil, I, tau, slack) {
		t.Error("o: " + b)
	}
	require.GreaterOrEqual(t, len(o), int(0.6*float64(run/I)), "key o kept its pace")
	for i, b := range bodies {
		if n := b.closes.Load(); n != 1 {
			t.Errorf("body %d closed %d times", i, n)
		}
	}
	// Each request: a booking, and a rebooking per pause learnt while it
	// waited; each pause: 1 store call.
	if bound := 2*nReq.Load() + 8*int64(len(pauses)) + int64(len(pauses)); calls > bound {
		t.Errorf("%d Redis calls for %d requests and %d pauses (bound %d)", calls, nReq.Load(), len(pauses), bound)
	}
	rvSettle(t, up, baseG)
}

// ---------------------------------------- Redis away mid-pause, then back

// R's 429 (Retry-After: 3) is stored in Redis. Then Redis goes away mid-
// pause: frozen (SIGSTOP, its data kept) for 1 s, or restarted (its data
// lost, as a restart without persistence loses it). Requests of the key
// are retried every 100 ms from then on. Oracle: "no request reaches the
// upstream inside a pause learnt by this Transport" (50 ms slack: the pause
// counts from the upstream's answer); this Transport learnt it, recorded
// its end locally, and stored it.
func TestReviewHTTP3RedisAwayMidPause(t *testing.T) {
	for _, how := range []string{"frozen", "restarted"} {
		t.Run(how, func(t *testing.T) {
			bg := context.Background()
			srv := redistest.Start(t)
			srv.RequireReal(t)
			lim, _ := rvSetup(t, srv, redistest.Prefix(t), 500*time.Millisecond, throttle.PerSecond(5, 1))
			var ansAt atomic.Int64
			up := rvNewUp(t, func(_ int, r *http.Request, w http.ResponseWriter) {
				if r.Header.Get("X-RV-ID") == "R" {
					ansAt.Store(time.Now().UnixNano())
					w.Header().Set("Retry-After", "3")
					w.WriteHeader(http.StatusTooManyRequests)
				}
			})
			var perr atomic.Value
			tr, err := httplimit.New(lim, httplimit.WithBase(up.client), httplimit.WithKey(func(*http.Request) string { return "k" }),
				httplimit.WithPauseErrorHandler(func(_ *http.Request, _ time.Duration, err error) { perr.Store(err) }))
			require.NoError(t, err)
			resp, err := tr.RoundTrip(rvReq(t, bg, up.URL, "R", nil))
			require.NoError(t, err)
			rvDrain(resp)
			require.Nil(t, perr.Load(), "the pause was stored")
			st, err := lim.State(bg, "k")
			require.NoError(t, err)
			require.Greater(t, st.Wait, 2*time.Second, "Redis holds the pause")
			end := time.Unix(0, ansAt.Load()).Add(3 * time.Second)

			switch how {
			case "frozen":
				pid := srv.Pid()
				require.NoError(t, syscall.Kill(pid, syscall.SIGSTOP))
				thawed := make(chan struct{})
				go func() {
					defer close(thawed)
					time.Sleep(time.Second)
					_ = syscall.Kill(pid, syscall.SIGCONT)
				}()
				defer func() { <-thawed }()
			case "restarted":
				srv.Restart(t)
			}
			var tries, notSent int
			var lastErr error
			for time.Now().Before(end.Add(time.Second)) {
				tries++
				ctx, cancel := context.WithTimeout(bg, 4*time.Second)
				id := "W" + strconv.Itoa(tries)
				resp, err := tr.RoundTrip(rvReq(t, ctx, up.URL, id, nil))
				cancel()
				if err == nil {
					rvDrain(resp)
					at, _ := up.gotID(id)
					t.Logf("%s sent after %d tries (%d not sent, last %v): arrived %v before the pause's end",
						id, tries, notSent, lastErr, end.Sub(at).Round(time.Millisecond))
					require.False(t, at.Before(end.Add(-50*time.Millisecond)),
						"Redis %s mid-pause: a request reached the upstream %v inside the pause this Transport learnt of and stored",
						how, end.Sub(at).Round(time.Millisecond))
					return
				}
				notSent++
				lastErr = err
				var ns *httplimit.NotSentError
				require.ErrorAs(t, err, &ns)
				time.Sleep(100 * time.Millisecond)
			}
			t.Fatalf("no request went within 1 s after the pause's end (%d tries, last %v)", tries, lastErr)
		})
	}
}
