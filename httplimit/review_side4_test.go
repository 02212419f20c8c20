package httplimit_test

// Adversarial review (4, helper-67) of httplimit, through the public API only: the
// path after a Transport waited out locally a pause Redis does not hold
// (its store failed), whose next booking goes through a view of the
// limiter built per booking (Limiter.With(WithMaxWait(maxWait - local))).

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math/rand"
	"net/http"
	"net/http/httptest"
	"runtime"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/slotbook/slotbook/deadline"
	"github.com/slotbook/slotbook/httplimit"
	"github.com/slotbook/slotbook/internal/redistest"
	"github.com/slotbook/slotbook/reserve"
	"github.com/slotbook/slotbook/throttle"
)

var errRV4Injected = errors.New("rv4: injected pause failure")

func rv4Key(*http.Request) string { return "k" }

// ------------------------------------ Q1: the budget after a local wait

type rv4Out struct {
	err      error
	elapsed  time.Duration // W's RoundTrip
	sentIn   time.Duration // W handed to the base, after W's start (-1: not sent)
	arrived  bool
	closes   int32
	pauseErr int32
}

// rv4Unstored: one request a period of I (no burst). R is sent at once and
// answered 429 Retry-After: 2; the pause's store fails, at once (hold
// false) or after Redis stayed silent until the Transport's pause timeout
// of 1.2 s (hold true: an unresponsive Redis). W starts while the store is
// under way; its slot in Redis is R's + I.
func rv4Unstored(t *testing.T, hold bool, I time.Duration, ctxFor func() (context.Context, context.CancelFunc), opts ...reserve.Option) rv4Out {
	bg := context.Background()
	lim, h := rvSetup(t, nil, redistest.Prefix(t), 3*time.Second, throttle.Every(I, 1, 0), opts...)
	in := make(chan struct{})
	var once sync.Once
	h.setPause(func(ctx context.Context, s string) error {
		if s != "k" {
			return nil
		}
		once.Do(func() { close(in) })
		if hold {
			<-ctx.Done() // Redis silent until the pause timeout
			return ctx.Err()
		}
		return errRV4Injected
	})
	up := rvNewUp(t, func(_ int, r *http.Request, w http.ResponseWriter) {
		if r.Header.Get("X-RV-ID") == "R" {
			w.Header().Set("Retry-After", "2")
			w.WriteHeader(http.StatusTooManyRequests)
		}
	})
	sent := rvNewSent(up.client)
	var perr atomic.Int32
	tr, err := httplimit.New(lim, httplimit.WithBase(sent), httplimit.WithKey(rv4Key),
		httplimit.WithPauseTimeout(1200*time.Millisecond),
		httplimit.WithPauseErrorHandler(func(*http.Request, time.Duration, error) { perr.Add(1) }))
	require.NoError(t, err)
	rDone := rvGo(t, bg, tr, up.URL, "R")
	<-in
	ctx, cancel := ctxFor()
	defer cancel()
	b := &rvBody{Reader: strings.NewReader("w")}
	start := time.Now()
	resp, err := tr.RoundTrip(rvReq(t, ctx, up.URL, "W", b))
	o := rv4Out{err: err, elapsed: time.Since(start), closes: b.closes.Load(), sentIn: -1}
	rvDrain(resp)
	<-rDone
	if at := sent.at("W"); !at.IsZero() {
		o.sentIn = at.Sub(start)
	}
	_, o.arrived = up.gotID("W")
	o.pauseErr = perr.Load()
	return o
}

func rv4Background() (context.Context, context.CancelFunc) {
	return context.WithTimeout(context.Background(), 10*time.Second)
}

// Max wait 2.5 s. The pause (2 s) ends within it; W waits it out locally.
// "far": W's slot in Redis lies 1.4 s past the pause's end: with the whole
// pause counted (store failed at once), 2.5 - 1.95 < 1.4: refused, the
// limiter's retry-after; with the store silent for 1.2 s first, only the
// 0.8 s after it is counted as local wait: W books with 1.7 s and is sent
// about 3.35 s after it started. "near": the slot lies 0.2 s past the end:
// sent either way (a budget that covers the slot is never refused).
func TestReviewHTTP4MaxWaitCountsStoreWait(t *testing.T) {
	const maxWait = 2500 * time.Millisecond
	for _, c := range []struct {
		name string
		I    time.Duration
		far  bool
	}{{"far", 3400 * time.Millisecond, true}, {"near", 2200 * time.Millisecond, false}} {
		t.Run(c.name, func(t *testing.T) {
			ctl := rv4Unstored(t, false, c.I, rv4Background, reserve.WithMaxWait(maxWait))
			got := rv4Unstored(t, true, c.I, rv4Background, reserve.WithMaxWait(maxWait))
			for _, o := range []struct {
				what string
				o    rv4Out
			}{{"store failed at once (control)", ctl}, {"store silent 1.2 s, then failed", got}} {
				t.Logf("%s: err=%v, returned after %v, sent %v after its start, pause errors %d",
					o.what, o.o.err, o.o.elapsed.Round(time.Millisecond), o.o.sentIn.Round(time.Millisecond), o.o.pauseErr)
				require.EqualValues(t, 1, o.o.pauseErr, o.what+": the pause was not stored")
				if !c.far {
					require.NoError(t, o.o.err, o.what+": refused although its budget covered its slot")
				}
				if o.o.err != nil {
					require.False(t, o.o.arrived, o.what)
					require.EqualValues(t, 1, o.o.closes, o.what)
					require.ErrorIs(t, o.o.err, reserve.ErrMaxWaitExceeded, o.what)
					ra, ok := deadline.RetryAfterOf(o.o.err)
					require.True(t, ok, o.what)
					require.InDelta(t, float64(1400*time.Millisecond), float64(ra), float64(300*time.Millisecond), o.what+": retry-after")
					require.Less(t, o.o.elapsed, 2*time.Second+300*time.Millisecond, o.what+": refused once the pause ended")
					continue
				}
				require.LessOrEqual(t, o.o.sentIn, maxWait+250*time.Millisecond,
					"%s: sent %v after its start, with a max wait of %v (the control: %v)",
					o.what, o.o.sentIn.Round(time.Millisecond), maxWait, ctl.err)
			}
		})
	}
}

// The same with a context deadline (2.8 s from W's start) and a work
// estimate of 200 ms, no max wait: the deadline is absolute, so the time
// spent on the store cannot be lost.
func TestReviewHTTP4DeadlineAfterLocalWait(t *testing.T) {
	const work = 200 * time.Millisecond
	for _, c := range []struct {
		name string
		I    time.Duration
		far  bool
	}{{"far", 3400 * time.Millisecond, true}, {"near", 2200 * time.Millisecond, false}} {
		t.Run(c.name, func(t *testing.T) {
			for _, hold := range []bool{false, true} {
				var dl time.Time
				o := rv4Unstored(t, hold, c.I, func() (context.Context, context.CancelFunc) {
					dl = time.Now().Add(2800 * time.Millisecond)
					return context.WithDeadline(context.Background(), dl)
				}, reserve.WithWorkEstimate(work))
				what := map[bool]string{false: "store failed at once", true: "store silent 1.2 s"}[hold]
				t.Logf("%s: err=%v after %v, sent %v after its start", what, o.err, o.elapsed.Round(time.Millisecond), o.sentIn.Round(time.Millisecond))
				if !c.far {
					require.NoError(t, o.err, what+": refused although its budget covered its slot")
					require.LessOrEqual(t, o.sentIn, 2800*time.Millisecond-work+100*time.Millisecond, what)
					continue
				}
				require.Error(t, o.err, what)
				require.False(t, o.arrived, what)
				require.EqualValues(t, 1, o.closes, what)
				require.ErrorIs(t, o.err, reserve.ErrWouldExceedDeadline, what)
				ra, ok := deadline.RetryAfterOf(o.err)
				require.True(t, ok, what)
				require.InDelta(t, float64(1400*time.Millisecond), float64(ra), float64(300*time.Millisecond), what+": retry-after")
			}
		})
	}
}

// One request a second, max wait 2.5 s. R is sent at once; its answer (429,
// Retry-After: 3) comes 300 ms later. W books right after R (slot 1 s
// away); when it comes, the pause (to about 3.3 s) has overtaken it: W
// waits it out (locally if unstored) and books again. Is W sent within its
// max wait from its start? (The first slot's wait is not counted.)
func TestReviewHTTP4WaitBeforePauseCounts(t *testing.T) {
	bg := context.Background()
	const maxWait = 2500 * time.Millisecond
	for _, stored := range []bool{true, false} {
		t.Run(map[bool]string{true: "stored", false: "unstored"}[stored], func(t *testing.T) {
			lim, h := rvSetup(t, nil, redistest.Prefix(t), 2*time.Second, throttle.Every(time.Second, 1, 0), reserve.WithMaxWait(maxWait))
			if !stored {
				h.setPause(func(_ context.Context, s string) error {
					if s == "k" {
						return errRV4Injected
					}
					return nil
				})
			}
			gotR := make(chan struct{})
			up := rvNewUp(t, func(_ int, r *http.Request, w http.ResponseWriter) {
				if r.Header.Get("X-RV-ID") == "R" {
					close(gotR)
					time.Sleep(300 * time.Millisecond)
					w.Header().Set("Retry-After", "3")
					w.WriteHeader(http.StatusTooManyRequests)
				}
			})
			sent := rvNewSent(up.client)
			tr, err := httplimit.New(lim, httplimit.WithBase(sent), httplimit.WithKey(rv4Key))
			require.NoError(t, err)
			rDone := rvGo(t, bg, tr, up.URL, "R")
			<-gotR
			start := time.Now()
			resp, err := tr.RoundTrip(rvReq(t, bg, up.URL, "W", nil))
			elapsed := time.Since(start)
			rvDrain(resp)
			<-rDone
			at := sent.at("W")
			t.Logf("W: err=%v after %v, sent %v after its start", err, elapsed.Round(time.Millisecond), at.Sub(start).Round(time.Millisecond))
			if err == nil {
				require.LessOrEqual(t, at.Sub(start), maxWait+250*time.Millisecond,
					"W was sent %v after its start with a max wait of %v", at.Sub(start).Round(time.Millisecond), maxWait)
			}
		})
	}
}

// ------------------------------ Q2: the limit across processes, layered

// Two processes (engines) A and B on one quota of two limits (8/s burst 3,
// and 10 per 2 s burst 2), max wait 2.5 s, four goroutines each sending
// four requests. A's 2nd and 6th requests are answered 429 Retry-After: 1,
// B's 5th too; A's pauses are never stored (A waits them out, then books
// through the per-booking view), B's are. Oracles: a textbook GCRA of each
// limit over every arrival (no pause assumed: a pause only moves slots
// later), and none of A's requests sent after one of A's 429s reached its
// caller arrives before that pause's end.
func TestReviewHTTP4TwoProcessesLayered(t *testing.T) {
	bg := context.Background()
	l1, l2 := throttle.PerSecond(8, 3), throttle.Every(2*time.Second, 10, 2)
	pfx := redistest.Prefix(t)
	limA, hA := rvSetup(t, nil, pfx, 2*time.Second, l1, reserve.WithLimit(l2), reserve.WithMaxWait(2500*time.Millisecond))
	limB, _ := rvSetup(t, nil, pfx, 2*time.Second, l1, reserve.WithLimit(l2), reserve.WithMaxWait(2500*time.Millisecond))
	hA.setPause(func(_ context.Context, s string) error {
		if s == "k" {
			return errRV4Injected
		}
		return nil
	})
	var nA, nB atomic.Int32
	var ansMu sync.Mutex
	ans := map[string]time.Time{}
	up := rvNewUp(t, func(_ int, r *http.Request, w http.ResponseWriter) {
		id := r.Header.Get("X-RV-ID")
		var n int32
		if strings.HasPrefix(id, "A") {
			n = nA.Add(1)
		} else {
			n = nB.Add(1) + 100
		}
		if n == 2 || n == 6 || n == 105 {
			ansMu.Lock()
			ans[id] = time.Now()
			ansMu.Unlock()
			w.Header().Set("Retry-After", "1")
			w.WriteHeader(http.StatusTooManyRequests)
		}
	})
	sent := rvNewSent(up.client)
	var perrA, perrB atomic.Int32
	trA, err := httplimit.New(limA, httplimit.WithBase(sent), httplimit.WithKey(rv4Key),
		httplimit.WithPauseErrorHandler(func(*http.Request, time.Duration, error) { perrA.Add(1) }))
	require.NoError(t, err)
	trB, err := httplimit.New(limB, httplimit.WithBase(sent), httplimit.WithKey(rv4Key),
		httplimit.WithPauseErrorHandler(func(*http.Request, time.Duration, error) { perrB.Add(1) }))
	require.NoError(t, err)
	var mu sync.Mutex
	var pausesA []rvPause
	var refused []string
	var wg sync.WaitGroup
	for _, proc := range []string{"A", "B"} {
		tr := map[string]*httplimit.Transport{"A": trA, "B": trB}[proc]
		for g := 0; g < 4; g++ {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for i := 0; i < 4; i++ {
					id := fmt.Sprintf("%s%d.%d", proc, g, i)
					ctx, cancel := context.WithTimeout(bg, 6*time.Second)
					resp, err := tr.RoundTrip(rvReq(t, ctx, up.URL, id, nil))
					cancel()
					if err != nil {
						var ns *httplimit.NotSentError
						if !errors.As(err, &ns) {
							t.Errorf("%s: %v", id, err)
							continue
						}
						ra, ok := ns.RetryAfter()
						mu.Lock()
						refused = append(refused, fmt.Sprintf("%s (%v, retry-after %v %v)", id, err, ra, ok))
						mu.Unlock()
						if !ok || ra <= 0 {
							t.Errorf("%s refused without a retry-after: %v", id, err)
						}
						continue
					}
					if resp.StatusCode == http.StatusTooManyRequests && proc == "A" {
						ansMu.Lock()
						end := ans[id].Add(time.Second)
						ansMu.Unlock()
						mu.Lock()
						pausesA = append(pausesA, rvPause{back: time.Now(), end: end})
						mu.Unlock()
					}
					rvDrain(resp)
				}
			}()
		}
	}
	wg.Wait()
	arr := up.got()
	t.Logf("%d arrivals, %d refused %v, A's unstored pauses %d (errors %d), B's store errors %d",
		len(arr), len(refused), refused, len(pausesA), perrA.Load(), perrB.Load())
	require.EqualValues(t, 2, perrA.Load())
	require.Zero(t, perrB.Load())
	s := sent.copy()
	// Judged on when each request went to the base transport, the moment
	// the limiter let it go: an arrival adds the HTTP round's own delay,
	// which on a busy machine (a new connection dialled, say) made one
	// request arrive late and the next seem early (seen once: 2 and 10 ms
	// past a 60 ms slack). The slack, 100 ms as elsewhere here, is below
	// either interval (125 and 200 ms): a request let go a slot early is
	// caught.
	var sends []rvArrival
	for _, a := range arr {
		at, ok := s[a.id]
		require.True(t, ok, "%s reached the upstream without passing the base", a.id)
		sends = append(sends, rvArrival{at: at, id: a.id})
	}
	for _, l := range []throttle.Limit{l1, l2} {
		I := l.Interval()
		bad := rvReplay(sends, s, nil, I, time.Duration(l.Burst)*I, 100*time.Millisecond)
		require.Empty(t, bad, "GCRA(%v)", l)
	}
	var arrA []rvArrival
	for _, a := range arr {
		if strings.HasPrefix(a.id, "A") {
			arrA = append(arrA, a)
		}
	}
	require.Empty(t, rvInside(arrA, s, pausesA, 30*time.Millisecond), "A's requests inside A's unstored pauses")
}

// ---------------------------------------- Q2: a fallback shared by views

// Redis goes away as R's 429 (Retry-After: 1) comes back: the pause cannot
// be stored; five requests waiting on it wait it out, then each books
// through a view of its own, answered by the FailOpen fallback (the full
// limit locally: one a 300 ms, and 5 per 2 s as a second limit). The views
// share the limiter's fallback state, so the five keep to the local limit
// together: arrivals at least 400 ms apart (less 120 ms of slack).
func TestReviewHTTP4FallbackSharedByViews(t *testing.T) {
	bg := context.Background()
	srv := redistest.Shared(t)
	p := redistest.NewProxy(t, srv.Addr)
	lim, _ := rvSetupOn(t, p.Client(t, srv), redistest.Prefix(t), 250*time.Millisecond, throttle.Every(300*time.Millisecond, 1, 0),
		reserve.WithLimit(throttle.Every(2*time.Second, 5, 0)), reserve.WithMaxWait(3*time.Second), reserve.WithFallback(reserve.FailOpen()))
	up := rvNewUp(t, func(_ int, r *http.Request, w http.ResponseWriter) {
		if r.Header.Get("X-RV-ID") == "R" {
			w.Header().Set("Retry-After", "1")
			w.WriteHeader(http.StatusTooManyRequests)
		}
	})
	var learnt time.Time // the base returned the 429: the pause counts from after it
	base := rvRT(func(r *http.Request) (*http.Response, error) {
		resp, err := up.client.RoundTrip(r)
		if err == nil && resp.StatusCode == http.StatusTooManyRequests {
			learnt = time.Now()
			p.Close()
		}
		return resp, err
	})
	var perr atomic.Int32
	tr, err := httplimit.New(lim, httplimit.WithBase(base), httplimit.WithKey(rv4Key),
		httplimit.WithPauseErrorHandler(func(*http.Request, time.Duration, error) { perr.Add(1) }))
	require.NoError(t, err)
	resp, err := tr.RoundTrip(rvReq(t, bg, up.URL, "R", nil))
	require.NoError(t, err)
	back := learnt
	require.Equal(t, http.StatusTooManyRequests, resp.StatusCode)
	rvDrain(resp)
	require.EqualValues(t, 1, perr.Load())
	var wg sync.WaitGroup
	errs := make([]error, 5)
	for i := range errs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			resp, err := tr.RoundTrip(rvReq(t, bg, up.URL, "W"+strconv.Itoa(i), nil))
			errs[i] = err
			rvDrain(resp)
		}()
	}
	wg.Wait()
	var ws []time.Time
	for _, a := range up.got() {
		if a.id != "R" {
			ws = append(ws, a.at)
		}
	}
	sort.Slice(ws, func(i, j int) bool { return ws[i].Before(ws[j]) })
	var gaps []time.Duration
	for i := range ws {
		if i == 0 {
			gaps = append(gaps, ws[0].Sub(back))
		} else {
			gaps = append(gaps, ws[i].Sub(ws[i-1]))
		}
	}
	t.Logf("errors %v; first arrival, then gaps: %v", errs, gaps)
	require.NotEmpty(t, ws)
	require.Greater(t, gaps[0], 900*time.Millisecond, "sent inside the unstored pause")
	for i, g := range gaps[1:] {
		require.Greater(t, g, 400*time.Millisecond-120*time.Millisecond, "gap %d: the views' fallbacks admitted more than the local limit", i+1)
	}
}

// ---------------------------------- Q3: stress: latency, cancels, pauses

// rv4Up is an upstream that records arrivals and each request's body.
type rv4Up struct {
	*httptest.Server
	mu       sync.Mutex
	arrivals []rvArrival
	bodies   map[string]string
	n        atomic.Int32
	client   *http.Transport
}

// rv4Stack counts the goroutines of httplimit or reserve, and those that
// are no proxy link's (the proxy serves each new pooled connection with
// goroutines of its own).
func rv4Stack() (ours, notProxy int, all string) {
	buf := make([]byte, 1<<22)
	all = string(buf[:runtime.Stack(buf, true)])
	for _, g := range strings.Split(all, "\n\n") {
		if strings.Contains(g, "httplimit.(*Transport)") || strings.Contains(g, "slotbook/reserve.") {
			ours++
		}
		if !strings.Contains(g, "redistest.(*Proxy)") {
			notProxy++
		}
	}
	return ours, notProxy, all
}

// 40 ms latency each way to Redis; 20/s burst 4, max wait 3 s; 16
// goroutines of 5 requests each with a body; one in three with a context
// cancelled at a random time within 1.5 s. Every 9th arrival is answered
// 429 Retry-After: 1, some after 0-400 ms (so a second pause comes while
// the first is waited out); the hook fails the store of every other
// pause. Oracles: no goroutine of ours left, no request sent after its
// context ended, each body closed and, if sent, intact, no request of
// this one Transport sent after an unstored pause reached its caller that
// arrives before its end, GCRA over every arrival.
func TestReviewHTTP4Stress(t *testing.T) {
	srv := redistest.Shared(t)
	p := redistest.NewProxy(t, srv.Addr)
	limit := throttle.PerSecond(20, 4)
	lim, h := rvSetupOn(t, p.Client(t, srv), redistest.Prefix(t), 2*time.Second, limit, reserve.WithMaxWait(3*time.Second))
	var stores atomic.Int32
	h.setPause(func(_ context.Context, s string) error {
		if s == "k" && stores.Add(1)%2 == 1 {
			return errRV4Injected
		}
		return nil
	})
	p.SetLatency(40 * time.Millisecond)
	u := &rv4Up{bodies: map[string]string{}, client: &http.Transport{}}
	var ansMu sync.Mutex
	ans := map[string]time.Time{}
	u.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		id := r.Header.Get("X-RV-ID")
		now := time.Now()
		b, _ := io.ReadAll(r.Body)
		u.mu.Lock()
		u.arrivals = append(u.arrivals, rvArrival{at: now, id: id})
		u.bodies[id] += string(b)
		u.mu.Unlock()
		if n := u.n.Add(1); n%9 == 3 {
			time.Sleep(time.Duration(n%5) * 100 * time.Millisecond)
			ansMu.Lock()
			ans[id] = time.Now()
			ansMu.Unlock()
			w.Header().Set("Retry-After", "1")
			w.WriteHeader(http.StatusTooManyRequests)
		}
	}))
	t.Cleanup(func() { u.client.CloseIdleConnections(); u.Close() })
	sent := rvNewSent(u.client)
	var perr atomic.Int32
	var perrMu sync.Mutex
	unstored := map[string]bool{}
	tr, err := httplimit.New(lim, httplimit.WithBase(sent), httplimit.WithKey(rv4Key),
		httplimit.WithPauseErrorHandler(func(r *http.Request, _ time.Duration, _ error) {
			perr.Add(1)
			perrMu.Lock()
			unstored[r.Header.Get("X-RV-ID")] = true
			perrMu.Unlock()
		}))
	require.NoError(t, err)
	oursBefore, before, _ := rv4Stack()
	beforeAll := runtime.NumGoroutine()

	type rec struct {
		body     *rvBody
		cancelAt time.Time
		err      error
		status   int
		back     time.Time
	}
	var mu sync.Mutex
	recs := map[string]*rec{}
	var wg sync.WaitGroup
	for g := 0; g < 16; g++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rng := rand.New(rand.NewSource(int64(g)))
			for i := 0; i < 5; i++ {
				id := fmt.Sprintf("g%d.%d", g, i)
				r := &rec{body: &rvBody{Reader: strings.NewReader("body-" + id)}}
				ctx, cancel := context.WithTimeout(context.Background(), 8*time.Second)
				var timer *time.Timer
				if rng.Intn(3) == 0 {
					d := time.Duration(rng.Intn(1500)) * time.Millisecond
					timer = time.AfterFunc(d, func() {
						mu.Lock()
						r.cancelAt = time.Now()
						mu.Unlock()
						cancel()
					})
				}
				mu.Lock()
				recs[id] = r
				mu.Unlock()
				resp, err := tr.RoundTrip(rvReq(t, ctx, u.URL, id, r.body))
				mu.Lock()
				r.err, r.back = err, time.Now()
				if resp != nil {
					r.status = resp.StatusCode
				}
				mu.Unlock()
				rvDrain(resp)
				if timer != nil {
					timer.Stop()
				}
				cancel()
			}
		}()
	}
	wg.Wait()
	u.client.CloseIdleConnections()

	// Goroutines: none of ours left; the count (the proxy's links of new
	// pooled connections aside) back near the baseline: slack 5.
	var ours, after int
	var stacks string
	for deadline := time.Now().Add(3 * time.Second); time.Now().Before(deadline); time.Sleep(100 * time.Millisecond) {
		ours, after, stacks = rv4Stack()
		if ours <= oursBefore && after <= before+5 {
			break
		}
	}
	t.Logf("goroutines: %d before (%d not the proxy's), %d after (%d not the proxy's)", beforeAll, before, runtime.NumGoroutine(), after)
	if ours > oursBefore || after > before+5 {
		t.Errorf("goroutines not the proxy's: %d before, %d after; of ours %d before, %d after:\n%s", before, after, oursBefore, ours, stacks)
	}

	mu.Lock()
	defer mu.Unlock()
	s := sent.copy()
	u.mu.Lock()
	arr := append([]rvArrival(nil), u.arrivals...)
	bodies := u.bodies
	u.mu.Unlock()
	seen := map[string]int{}
	for _, a := range arr {
		seen[a.id]++
	}
	var pauses []rvPause
	var nSent, nRefused, nCancelled int
	for id, r := range recs {
		require.LessOrEqual(t, seen[id], 1, "%s arrived twice", id)
		require.GreaterOrEqual(t, r.body.closes.Load(), int32(1), "%s: body never closed (err %v)", id, r.err)
		if seen[id] == 1 {
			nSent++
			require.Equal(t, "body-"+id, bodies[id], "%s: body", id)
			if !r.cancelAt.IsZero() && s[id].After(r.cancelAt.Add(5*time.Millisecond)) {
				t.Errorf("%s sent %v after its context was cancelled", id, s[id].Sub(r.cancelAt))
			}
		}
		var ns *httplimit.NotSentError
		if errors.As(r.err, &ns) {
			require.Zero(t, seen[id], "%s refused but sent", id)
			require.EqualValues(t, 1, r.body.closes.Load(), "%s: body closed once", id)
			if errors.Is(r.err, context.Canceled) {
				nCancelled++
			} else {
				nRefused++
			}
		}
		if r.status == http.StatusTooManyRequests {
			perrMu.Lock()
			un := unstored[id]
			perrMu.Unlock()
			ansMu.Lock()
			end := ans[id].Add(time.Second)
			ansMu.Unlock()
			if un {
				pauses = append(pauses, rvPause{back: r.back, end: end})
			}
		}
	}
	t.Logf("%d requests: %d sent, %d refused, %d cancelled unsent; %d pause stores failed (%d unstored pauses returned)",
		len(recs), nSent, nRefused, nCancelled, perr.Load(), len(pauses))
	require.Positive(t, perr.Load())
	require.Empty(t, rvInside(arr, s, pauses, 30*time.Millisecond), "sent inside an unstored pause it knew of")
	I := limit.Interval()
	require.Empty(t, rvReplay(arr, s, nil, I, time.Duration(limit.Burst)*I, 100*time.Millisecond), "GCRA")
}

// ------------------------- Q3: a second pause while waiting out the first

// 10/s burst 3. R1 and R2 are sent together; R1 is answered at once 429
// Retry-After: 1, R2 300 ms later 429 Retry-After: 2; neither pause can be
// stored. W starts once R1's answer is back, and waits out the first
// pause locally. With a max wait (or a context deadline) of 1.8 s, the
// second pause's end (about 2.3 s after W's start) lies beyond W's budget
// as soon as R2's answer is back: the package says such a request is
// "refused at once". With 2.5 s, W is sent after the second pause and
// within its max wait.
func TestReviewHTTP4SecondPauseWhileWaiting(t *testing.T) {
	bg := context.Background()
	for _, c := range []struct {
		name     string
		budget   time.Duration
		deadline bool
	}{{"max wait 1.8s", 1800 * time.Millisecond, false}, {"deadline 1.8s", 1800 * time.Millisecond, true}, {"max wait 2.5s", 2500 * time.Millisecond, false}} {
		t.Run(c.name, func(t *testing.T) {
			var opts []reserve.Option
			if !c.deadline {
				opts = append(opts, reserve.WithMaxWait(c.budget))
			}
			lim, h := rvSetup(t, nil, redistest.Prefix(t), 2*time.Second, throttle.PerSecond(10, 3), opts...)
			h.setPause(func(_ context.Context, s string) error {
				if s == "k" {
					return errRV4Injected
				}
				return nil
			})
			var end2 atomic.Int64
			r2in := make(chan struct{})
			up := rvNewUp(t, func(_ int, r *http.Request, w http.ResponseWriter) {
				switch r.Header.Get("X-RV-ID") {
				case "R1":
					select { // both in flight before the first pause is learnt
					case <-r2in:
					case <-time.After(3 * time.Second):
					}
					w.Header().Set("Retry-After", "1")
					w.WriteHeader(http.StatusTooManyRequests)
				case "R2":
					close(r2in)
					time.Sleep(300 * time.Millisecond)
					end2.Store(time.Now().Add(2 * time.Second).UnixNano())
					w.Header().Set("Retry-After", "2")
					w.WriteHeader(http.StatusTooManyRequests)
				}
			})
			sent := rvNewSent(up.client)
			tr, err := httplimit.New(lim, httplimit.WithBase(sent), httplimit.WithKey(rv4Key))
			require.NoError(t, err)
			r1 := make(chan struct{})
			var r2Back time.Time
			var wg sync.WaitGroup
			wg.Add(2)
			go func() {
				defer wg.Done()
				resp, err := tr.RoundTrip(rvReq(t, bg, up.URL, "R1", nil))
				require.NoError(t, err)
				rvDrain(resp)
				close(r1)
			}()
			go func() {
				defer wg.Done()
				resp, err := tr.RoundTrip(rvReq(t, bg, up.URL, "R2", nil))
				require.NoError(t, err)
				r2Back = time.Now()
				rvDrain(resp)
			}()
			<-r1
			ctx, cancel := context.WithTimeout(bg, 10*time.Second)
			if c.deadline {
				ctx, cancel = context.WithTimeout(bg, c.budget)
			}
			defer cancel()
			b := &rvBody{Reader: strings.NewReader("w")}
			start := time.Now()
			resp, err := tr.RoundTrip(rvReq(t, ctx, up.URL, "W", b))
			done := time.Now()
			rvDrain(resp)
			wg.Wait()
			at, arrived := up.gotID("W")
			t.Logf("W: err=%v; R2's answer back %v after W's start, W returned %v after its start, sent %v after",
				err, r2Back.Sub(start).Round(time.Millisecond), done.Sub(start).Round(time.Millisecond), sent.at("W").Sub(start).Round(time.Millisecond))
			if c.budget > 2*time.Second {
				require.NoError(t, err)
				require.False(t, at.Before(time.Unix(0, end2.Load())), "W arrived inside the second pause")
				require.LessOrEqual(t, sent.at("W").Sub(start), c.budget+250*time.Millisecond)
				return
			}
			require.Error(t, err)
			require.False(t, arrived)
			require.EqualValues(t, 1, b.closes.Load())
			ra, ok := deadline.RetryAfterOf(err)
			require.True(t, ok)
			require.InDelta(t, float64(time.Unix(0, end2.Load()).Sub(done)), float64(ra), float64(200*time.Millisecond), "retry-after: the second pause's end")
			require.Less(t, done.Sub(r2Back), 300*time.Millisecond,
				"W was refused %v after the second pause, whose end lay beyond its budget, was back: not at once (it waited out the first pause)",
				done.Sub(r2Back).Round(time.Millisecond))
		})
	}
}
