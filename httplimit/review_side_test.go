package httplimit_test

// Adversarial review of httplimit's side paths, through the public API
// only. Oracles come from the docs and from a textbook GCRA replayed over
// the instants at which the upstream httptest server received requests.

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/slotbook/slotbook/httplimit"
	"github.com/slotbook/slotbook/internal/redistest"
	"github.com/slotbook/slotbook/reserve"
	"github.com/slotbook/slotbook/throttle"
)

// ---------------------------------------------------------------- helpers

// ------------------------------------------------ context ends while waiting

// A request whose context ends while it waits for its slot is not sent, its
// body is closed once, and its slot is given back: on the Redis clock the
// key's next free slot moves back by one interval, and the next request
// arrives one interval after the first, not two.
func TestReviewHTTPCancelWhileWaiting(t *testing.T) {
	srv := redistest.Shared(t)
	lim, err := reserve.New(rvEngine(t, srv.Client(t), time.Second), "rv", throttle.Every(time.Second, 1, 0))
	require.NoError(t, err)
	up := rvNewUp(t, nil)
	tr, err := httplimit.New(lim, httplimit.WithBase(up.client))
	require.NoError(t, err)
	bg := context.Background()

	resp, err := tr.RoundTrip(rvReq(t, bg, up.URL, "A", nil))
	require.NoError(t, err)
	rvDrain(resp)

	ctx, cancel := context.WithCancel(bg)
	body := &rvBody{Reader: strings.NewReader("b")}
	done := make(chan error, 1)
	go func() {
		resp, err := tr.RoundTrip(rvReq(t, ctx, up.URL, "B", body))
		rvDrain(resp)
		done <- err
	}()
	// B's booking stands: a request now would wait behind A and B.
	var during throttle.State
	require.Eventually(t, func() bool {
		during, err = lim.State(bg, up.host())
		return err == nil && during.Wait > 1300*time.Millisecond
	}, 2*time.Second, 5*time.Millisecond, "B booked a slot behind A")
	cancel()
	err = <-done
	var ns *httplimit.NotSentError
	require.ErrorAs(t, err, &ns)
	require.ErrorIs(t, err, context.Canceled)
	_, ok := ns.RetryAfter()
	require.False(t, ok)
	require.EqualValues(t, 1, body.closes.Load(), "body closed exactly once")
	after, err := lim.State(bg, up.host())
	require.NoError(t, err)
	require.Less(t, after.Wait, time.Second, "B's slot given back (Redis clock: next free is A+1s, was A+2s: %v before)", during.Wait)

	resp, err = tr.RoundTrip(rvReq(t, bg, up.URL, "C", nil))
	require.NoError(t, err)
	rvDrain(resp)
	a, _ := up.gotID("A")
	c, okC := up.gotID("C")
	require.True(t, okC)
	_, sentB := up.gotID("B")
	require.False(t, sentB, "B never reaches the upstream")
	// C has A+1s (B's given-back slot); without the give-back it would be A+2s.
	// 1.5s splits the two with half an interval of slack for jitter.
	require.Less(t, c.Sub(a), 1500*time.Millisecond)
	require.Greater(t, c.Sub(a), 800*time.Millisecond, "C not ahead of the limit (200ms jitter on A's arrival)")
}

// --------------------------------------- context ends after the slot came

func TestReviewHTTPCancelAfterSlot(t *testing.T) {
	srv := redistest.Shared(t)
	bg := context.Background()
	t.Run("while upstream answers", func(t *testing.T) {
		lim, err := reserve.New(rvEngine(t, srv.Client(t), time.Second), "rv", throttle.PerSecond(10, 3))
		require.NoError(t, err)
		arrived := make(chan struct{}, 1)
		up := rvNewUp(t, func(_ int, r *http.Request, w http.ResponseWriter) {
			arrived <- struct{}{}
			<-r.Context().Done()
		})
		tr, err := httplimit.New(lim, httplimit.WithBase(up.client))
		require.NoError(t, err)
		ctx, cancel := context.WithCancel(bg)
		go func() { <-arrived; cancel() }()
		_, err = tr.RoundTrip(rvReq(t, ctx, up.URL, "x", strings.NewReader("x")))
		require.ErrorIs(t, err, context.Canceled)
		var ns *httplimit.NotSentError
		require.False(t, errors.As(err, &ns), "it was sent: not a NotSentError: %v", err)
		require.Len(t, up.got(), 1)
	})
	for _, check := range []bool{false, true} {
		t.Run("429 then context ends, pause check "+strconv.FormatBool(check), func(t *testing.T) {
			lim, err := reserve.New(rvEngine(t, srv.Client(t), time.Second), "rv", throttle.PerSecond(10, 3))
			require.NoError(t, err)
			up := rvNewUp(t, func(_ int, _ *http.Request, w http.ResponseWriter) {
				w.Header().Set("Retry-After", "3")
				w.WriteHeader(http.StatusTooManyRequests)
			})
			ctx, cancel := context.WithCancel(bg)
			base := rvRT(func(r *http.Request) (*http.Response, error) {
				resp, err := up.client.RoundTrip(r)
				cancel() // the caller gives up as the 429 comes back
				return resp, err
			})
			var perr error
			tr, err := httplimit.New(lim, httplimit.WithBase(base), httplimit.WithPauseCheck(check),
				httplimit.WithPauseErrorHandler(func(_ *http.Request, _ time.Duration, err error) { perr = err }))
			require.NoError(t, err)
			resp, err := tr.RoundTrip(rvReq(t, ctx, up.URL, "x", nil))
			require.NoError(t, err)
			require.Equal(t, http.StatusTooManyRequests, resp.StatusCode)
			rvDrain(resp)
			require.NoError(t, perr)
			st, err := lim.State(bg, up.host())
			require.NoError(t, err)
			require.Greater(t, st.Wait, 2*time.Second, "pause stored though the request's context ended")
			require.LessOrEqual(t, st.Wait, 3*time.Second)
		})
	}
}

// ---------------------------------------------------- refused requests

func TestReviewHTTPRefusedBody(t *testing.T) {
	srv := redistest.Shared(t)
	bg := context.Background()
	lim, err := reserve.New(rvEngine(t, srv.Client(t), time.Second), "rv", throttle.Every(time.Minute, 1, 0), reserve.WithMaxWait(0))
	require.NoError(t, err)
	up := rvNewUp(t, nil)
	tr, err := httplimit.New(lim, httplimit.WithBase(up.client))
	require.NoError(t, err)
	resp, err := tr.RoundTrip(rvReq(t, bg, up.URL, "first", nil))
	require.NoError(t, err)
	rvDrain(resp)

	// Direct RoundTrip with a body.
	b1 := &rvBody{Reader: strings.NewReader("one")}
	resp, err = tr.RoundTrip(rvReq(t, bg, up.URL, "r1", b1))
	require.Nil(t, resp)
	require.ErrorIs(t, err, reserve.ErrMaxWaitExceeded)
	require.EqualValues(t, 1, b1.closes.Load())

	// Through an http.Client, with GetBody set: closed once, GetBody unused.
	b2 := &rvBody{Reader: strings.NewReader("two")}
	req := rvReq(t, bg, up.URL, "r2", b2)
	var gets atomic.Int32
	req.GetBody = func() (io.ReadCloser, error) { gets.Add(1); return io.NopCloser(strings.NewReader("two")), nil }
	req.ContentLength = 3
	_, err = (&http.Client{Transport: tr}).Do(req)
	var ns *httplimit.NotSentError
	require.ErrorAs(t, err, &ns)
	require.EqualValues(t, 1, b2.closes.Load(), "closed exactly once through http.Client")
	require.Zero(t, gets.Load())

	// nil body and http.NoBody.
	_, err = tr.RoundTrip(rvReq(t, bg, up.URL, "r3", nil))
	require.ErrorAs(t, err, &ns)
	_, err = tr.RoundTrip(rvReq(t, bg, up.URL, "r4", http.NoBody))
	require.ErrorAs(t, err, &ns)
	d, ok := ns.RetryAfter()
	require.True(t, ok)
	require.Greater(t, d, 50*time.Second)

	// Deadline refusal: immediate, nothing booked (Redis clock: the queue
	// does not grow by a minute).
	lim2, err := lim.With(reserve.WithoutMaxWait())
	require.NoError(t, err)
	tr2, err := httplimit.New(lim2, httplimit.WithBase(up.client))
	require.NoError(t, err)
	before, err := lim.State(bg, up.host())
	require.NoError(t, err)
	dctx, dcancel := context.WithTimeout(bg, 300*time.Millisecond)
	defer dcancel()
	b5 := &rvBody{Reader: strings.NewReader("five")}
	_, err = tr2.RoundTrip(rvReq(t, dctx, up.URL, "r5", b5))
	require.ErrorIs(t, err, reserve.ErrWouldExceedDeadline)
	require.NoError(t, dctx.Err(), "refused at once, not after waiting out the deadline")
	require.EqualValues(t, 1, b5.closes.Load())
	after, err := lim.State(bg, up.host())
	require.NoError(t, err)
	require.LessOrEqual(t, after.Wait, before.Wait, "refusal booked nothing")

	got := up.got()
	require.Len(t, got, 1, "refused requests never reach the upstream: %v", got)
}

// ------------------------------------------------------------ bad keys

func TestReviewHTTPEmptyKey(t *testing.T) {
	srv := redistest.Shared(t)
	lim, err := reserve.New(rvEngine(t, srv.Client(t), time.Second), "rv", throttle.PerSecond(10, 3))
	require.NoError(t, err)
	up := rvNewUp(t, nil)
	for _, kf := range []func(*http.Request) string{
		func(*http.Request) string { return "" },
		func(*http.Request) string { return "}tag" },
		func(*http.Request) string { return strings.Repeat("k", 5000) },
	} {
		tr, err := httplimit.New(lim, httplimit.WithBase(up.client), httplimit.WithKey(kf))
		require.NoError(t, err)
		b := &rvBody{Reader: strings.NewReader("x")}
		resp, err := tr.RoundTrip(rvReq(t, context.Background(), up.URL, "e", b))
		require.Nil(t, resp)
		var ns *httplimit.NotSentError
		require.ErrorAs(t, err, &ns)
		require.ErrorIs(t, err, throttle.ErrInvalidRequest)
		_, ok := ns.RetryAfter()
		require.False(t, ok)
		require.EqualValues(t, 1, b.closes.Load())
	}
	// ByHost on a request without any host: an empty key, not sent.
	tr, err := httplimit.New(lim, httplimit.WithBase(up.client))
	require.NoError(t, err)
	req := rvReq(t, context.Background(), up.URL, "nohost", nil)
	req.URL.Host, req.Host = "", ""
	_, err = tr.RoundTrip(req)
	require.ErrorIs(t, err, throttle.ErrInvalidRequest)
	require.Empty(t, up.got())
}

// A key the limiter accepts, but whose pause marker (key+"#pause") is too
// long: with WithPauseCheck the 429 must still pause the key.
func TestReviewHTTPLongKeyPauseCheck(t *testing.T) {
	srv := redistest.Shared(t)
	lim, err := reserve.New(rvEngine(t, srv.Client(t), time.Second), "rv", throttle.PerSecond(10, 3))
	require.NoError(t, err)
	n := 1
	for lim.CheckKey(strings.Repeat("k", n+1)) == nil {
		n++
	}
	key := strings.Repeat("k", n) // the longest key the limiter accepts
	require.NoError(t, lim.CheckKey(key))
	up := rvNewUp(t, func(_ int, _ *http.Request, w http.ResponseWriter) {
		w.Header().Set("Retry-After", "5")
		w.WriteHeader(http.StatusTooManyRequests)
	})
	for _, check := range []bool{false, true} {
		t.Run("pause check "+strconv.FormatBool(check), func(t *testing.T) {
			require.NoError(t, lim.Reset(context.Background(), key))
			var perr error
			tr, err := httplimit.New(lim, httplimit.WithBase(up.client), httplimit.WithPauseCheck(check),
				httplimit.WithKey(func(*http.Request) string { return key }),
				httplimit.WithPauseErrorHandler(func(_ *http.Request, _ time.Duration, err error) { perr = err }))
			require.NoError(t, err)
			resp, err := tr.RoundTrip(rvReq(t, context.Background(), up.URL, "x", nil))
			require.NoError(t, err)
			require.Equal(t, http.StatusTooManyRequests, resp.StatusCode)
			rvDrain(resp)
			require.NoError(t, perr, "pause of a %d-byte key (accepted by the limiter) not stored", len(key))
			st, err := lim.State(context.Background(), key)
			require.NoError(t, err)
			require.Greater(t, st.Wait, 4*time.Second, "key paused for Retry-After: 5")
		})
	}
}

// ---------------------------------------------------- Retry-After values

func TestReviewHTTPRetryAfterValues(t *testing.T) {
	srv := redistest.Shared(t)
	lim, err := reserve.New(rvEngine(t, srv.Client(t), time.Second), "rv", throttle.PerSecond(10, 5))
	require.NoError(t, err)
	type tc struct {
		name     string
		status   int
		value    func() string
		min, max time.Duration // expected pause on the Redis clock, read just after (0,0: none)
	}
	date := func(d time.Duration) func() string {
		return func() string { return time.Now().Add(d).UTC().Format(http.TimeFormat) }
	}
	lit := func(s string) func() string { return func() string { return s } }
	cases := []tc{
		{"seconds", 429, lit("2"), 1500 * time.Millisecond, 2 * time.Second},
		{"503 seconds", 503, lit("2"), 1500 * time.Millisecond, 2 * time.Second},
		{"spaces", 429, lit(" 2 "), 1500 * time.Millisecond, 2 * time.Second},
		{"date +3s", 429, date(3 * time.Second), 1500 * time.Millisecond, 3 * time.Second},
		{"date RFC850", 429, func() string { return time.Now().Add(3 * time.Second).UTC().Format(time.RFC850) }, 1500 * time.Millisecond, 3 * time.Second},
		{"date past", 429, date(-time.Hour), 0, 0},
		{"zero", 429, lit("0"), 0, 0},
		{"negative", 429, lit("-5"), 0, 0},
		{"fraction", 429, lit("1.5"), 0, 0},
		{"plus", 429, lit("+3"), 0, 0},
		{"garbage", 429, lit("soon"), 0, 0},
		{"empty", 429, lit(""), 0, 0},
		{"200 ignored", 200, lit("5"), 0, 0},
		{"500 ignored", 500, lit("5"), 0, 0},
		{"huge", 429, lit("99999999999999999999999"), 1500 * time.Millisecond, 2500 * time.Millisecond},
		{"big", 429, lit("5000000000"), 1500 * time.Millisecond, 2500 * time.Millisecond},
		{"date far", 429, lit("Fri, 31 Dec 9999 23:59:59 GMT"), 1500 * time.Millisecond, 2500 * time.Millisecond},
		{"uint64 max", 429, lit("18446744073709551615"), 1500 * time.Millisecond, 2500 * time.Millisecond},
	}
	var cur atomic.Pointer[tc]
	up := rvNewUp(t, func(_ int, _ *http.Request, w http.ResponseWriter) {
		c := cur.Load()
		if v := c.value(); v != "" {
			w.Header().Set("Retry-After", v)
		}
		w.WriteHeader(c.status)
		_, _ = io.WriteString(w, "body of "+c.name)
	})
	tr, err := httplimit.New(lim, httplimit.WithBase(up.client), httplimit.WithMaxPause(2500*time.Millisecond),
		httplimit.WithKey(func(r *http.Request) string { return r.Header.Get("X-RV-ID") }))
	require.NoError(t, err)
	for i := range cases {
		c := &cases[i]
		cur.Store(c)
		id := fmt.Sprintf("ra-%d", i)
		resp, err := tr.RoundTrip(rvReq(t, context.Background(), up.URL, id, nil))
		require.NoError(t, err, c.name)
		require.Equal(t, c.status, resp.StatusCode, c.name)
		b, _ := io.ReadAll(resp.Body)
		_ = resp.Body.Close()
		require.Equal(t, "body of "+c.name, string(b), "the upstream's response reaches the caller")
		st, err := lim.State(context.Background(), id)
		require.NoError(t, err)
		if c.max == 0 {
			require.Zero(t, st.Wait, "%s: no pause expected", c.name)
		} else {
			require.Greater(t, st.Wait, c.min, c.name)
			require.LessOrEqual(t, st.Wait, c.max, "%s: capped at the max pause", c.name)
		}
	}
}

// ----------------------------------------------- lost replies, Redis away

func TestReviewHTTPLostReply(t *testing.T) {
	srv := redistest.Shared(t)
	bg := context.Background()
	p := redistest.NewProxy(t, srv.Addr)
	lim, err := reserve.New(rvEngine(t, p.Client(t, srv), 250*time.Millisecond), "rv", throttle.Every(3*time.Second, 1, 0))
	require.NoError(t, err)
	up := rvNewUp(t, nil)
	tr, err := httplimit.New(lim, httplimit.WithBase(up.client))
	require.NoError(t, err)
	// Warm the booking script too, so that the lost call is the booking
	// itself (not a NOSCRIPT round).
	redistest.UntilOK(t, func() error { _, err := lim.Reserve(bg, "warm"); return err })

	p.SetReplyDelay(700 * time.Millisecond)
	b := &rvBody{Reader: strings.NewReader("x")}
	resp, err := tr.RoundTrip(rvReq(t, bg, up.URL, "lost", b))
	require.Nil(t, resp)
	var ns *httplimit.NotSentError
	require.ErrorAs(t, err, &ns)
	require.ErrorIs(t, err, throttle.ErrUnavailable)
	require.ErrorIs(t, err, throttle.ErrReplyLost)
	_, ok := ns.RetryAfter()
	require.False(t, ok)
	require.EqualValues(t, 1, b.closes.Load())
	require.Contains(t, err.Error(), up.host())
	p.SetReplyDelay(0)

	// The script ran: the lost booking holds its slot (Redis clock), and the
	// retry is sent only at a slot of its own.
	var st throttle.State
	redistest.UntilOK(t, func() error { st, err = lim.State(bg, up.host()); return err })
	require.Greater(t, st.Wait, time.Second, "the lost booking holds its slot (3s interval)")
	resp, err = tr.RoundTrip(rvReq(t, bg, up.URL, "retry", nil))
	require.NoError(t, err)
	rvDrain(resp)
	got := up.got()
	require.Len(t, got, 1)
	require.Equal(t, "retry", got[0].id)

	// Redis away, no fallback: not sent, ErrUnavailable.
	p.Close()
	b2 := &rvBody{Reader: strings.NewReader("x")}
	_, err = tr.RoundTrip(rvReq(t, bg, up.URL, "away", b2))
	require.ErrorAs(t, err, &ns)
	require.ErrorIs(t, err, throttle.ErrUnavailable)
	require.EqualValues(t, 1, b2.closes.Load())
	require.Len(t, up.got(), 1)
}

func TestReviewHTTPFallbacks(t *testing.T) {
	srv := redistest.Shared(t)
	bg := context.Background()
	t.Run("fail closed", func(t *testing.T) {
		p := redistest.NewProxy(t, srv.Addr)
		lim, err := reserve.New(rvEngine(t, p.Client(t, srv), 250*time.Millisecond), "rv", throttle.PerSecond(10, 0),
			reserve.WithFallback(reserve.FailClosed()))
		require.NoError(t, err)
		up := rvNewUp(t, nil)
		tr, err := httplimit.New(lim, httplimit.WithBase(up.client))
		require.NoError(t, err)
		p.Close()
		var ns *httplimit.NotSentError
		for i := 0; i < 3; i++ { // the first fails on the engine, then the breaker is open
			b := &rvBody{Reader: strings.NewReader("x")}
			_, err = tr.RoundTrip(rvReq(t, bg, up.URL, "fc", b))
			require.ErrorAs(t, err, &ns)
			require.ErrorIs(t, err, throttle.ErrUnavailable)
			require.EqualValues(t, 1, b.closes.Load())
		}
		var fe *reserve.FallbackError
		require.ErrorAs(t, err, &fe)
		_, ok := ns.RetryAfter()
		require.True(t, ok)
		require.Empty(t, up.got())
	})
	t.Run("fail open keeps the full limit locally", func(t *testing.T) {
		p := redistest.NewProxy(t, srv.Addr)
		lim, err := reserve.New(rvEngine(t, p.Client(t, srv), 250*time.Millisecond), "rv", throttle.Every(time.Second, 4, 0),
			reserve.WithFallback(reserve.FailOpen()))
		require.NoError(t, err)
		up := rvNewUp(t, nil)
		tr, err := httplimit.New(lim, httplimit.WithBase(up.client))
		require.NoError(t, err)
		p.Close()
		var wg sync.WaitGroup
		for i := 0; i < 5; i++ {
			wg.Add(1)
			go func() {
				defer wg.Done()
				resp, err := tr.RoundTrip(rvReq(t, bg, up.URL, "fo"+strconv.Itoa(i), nil))
				if err == nil {
					rvDrain(resp)
				}
			}()
		}
		wg.Wait()
		got := up.got()
		require.NotEmpty(t, got)
		// Local limit 4/s, no burst: 250ms apart; 120ms jitter slack.
		for i := 1; i < len(got); i++ {
			require.Greater(t, got[i].at.Sub(got[i-1].at), 130*time.Millisecond, "fail-open local limit: %d and %d", i-1, i)
		}
	})
}

// -------------------------------------- pause vs requests waiting locally

// rvPauseWaiters: one Transport, requests waiting for slots when the
// first one's answer is 429 Retry-After: 2. The doc: "Those waiting in this
// Transport when it learns of the pause (its own 429) book again, behind
// the pause." Oracle: no request whose base send came after the base
// returned the 429 arrives at the upstream before the pause ends.
func rvPauseWaiters(t *testing.T, latency time.Duration, check, severAfter429 bool, interval time.Duration) {
	srv := redistest.Shared(t)
	p := redistest.NewProxy(t, srv.Addr)
	lim, err := reserve.New(rvEngine(t, p.Client(t, srv), 2*time.Second), "rv", throttle.Every(interval, 1, 0))
	require.NoError(t, err)
	// Warm every script the Transport uses (State, booking, Pause) and a few
	// pooled connections, so that the Pause below costs one round trip.
	redistest.UntilOK(t, func() error { _, err := lim.State(context.Background(), "warm"); return err })
	var warm sync.WaitGroup
	for i := 0; i < 4; i++ {
		warm.Add(1)
		go func() {
			defer warm.Done()
			redistest.UntilOK(t, func() error { _, err := lim.Reserve(context.Background(), "warm"+strconv.Itoa(i)); return err })
			redistest.UntilOK(t, func() error { return lim.Pause(context.Background(), "warm"+strconv.Itoa(i), time.Millisecond) })
		}()
	}
	warm.Wait()
	p.SetLatency(latency)
	// forcedAt is when the upstream answered 429, kept with its monotonic
	// reading: the Transport times its own pause on the monotonic clock,
	// which this VM's wall clock is slewed against, by more than the
	// slack between forcedAt and the Transport's reading of the 429.
	var (
		forcedMu sync.Mutex
		forcedAt time.Time
	)
	up := rvNewUp(t, func(n int, _ *http.Request, w http.ResponseWriter) {
		if n == 1 {
			forcedMu.Lock()
			forcedAt = time.Now()
			forcedMu.Unlock()
			w.Header().Set("Retry-After", "2")
			w.WriteHeader(http.StatusTooManyRequests)
		}
	})
	var (
		mu       sync.Mutex
		sent     = map[string]time.Time{}
		learned  time.Time // the base returned the 429
		returned time.Time // RoundTrip returned the 429 to its caller
	)
	var first atomic.Bool
	base := rvRT(func(r *http.Request) (*http.Response, error) {
		if severAfter429 && first.CompareAndSwap(false, true) {
			time.Sleep(100 * time.Millisecond) // let the others book their slots first
		}
		mu.Lock()
		sent[r.Header.Get("X-RV-ID")] = time.Now()
		mu.Unlock()
		resp, err := up.client.RoundTrip(r)
		if err == nil && resp.StatusCode == http.StatusTooManyRequests {
			mu.Lock()
			learned = time.Now()
			mu.Unlock()
			if severAfter429 {
				p.Close()
			}
		}
		return resp, err
	})
	pauseErrs := atomic.Int32{}
	tr, err := httplimit.New(lim, httplimit.WithBase(base), httplimit.WithPauseCheck(check),
		httplimit.WithPauseErrorHandler(func(*http.Request, time.Duration, error) { pauseErrs.Add(1) }))
	require.NoError(t, err)
	var wg sync.WaitGroup
	for i := 0; i < 6; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			resp, err := tr.RoundTrip(rvReq(t, context.Background(), up.URL, "w"+strconv.Itoa(i), nil))
			if err != nil {
				t.Logf("w%d: %v", i, err)
			}
			if err == nil && resp.StatusCode == http.StatusTooManyRequests {
				mu.Lock()
				returned = time.Now()
				mu.Unlock()
			}
			rvDrain(resp)
		}()
		time.Sleep(2 * time.Millisecond)
	}
	wg.Wait()
	mu.Lock()
	defer mu.Unlock()
	require.False(t, learned.IsZero())
	if severAfter429 {
		require.Positive(t, pauseErrs.Load(), "the pause could not be stored")
	}
	forcedMu.Lock()
	end := forcedAt.Add(2 * time.Second)
	forcedMu.Unlock()
	// Where the pause cannot be stored, judge only what was sent after the
	// 429 reached its caller (the window before is the latency test's).
	// A request that had passed the Transport's pause check just before
	// the 429 came back goes to the base at once, not waiting: on a busy
	// machine its goroutine may reach the base a few milliseconds after
	// learned. So the judged window begins 5 ms on; the requests it is
	// for wait for slots 25 ms or more apart, and still fall in it.
	from := learned.Add(5 * time.Millisecond)
	if severAfter429 {
		from = returned.Add(5 * time.Millisecond)
	}
	for _, a := range up.got() {
		s := sent[a.id]
		t.Logf("%s sent %v after the 429 came back from the base (%v after it reached its caller), arrived %v before the pause end",
			a.id, s.Sub(learned).Round(time.Millisecond), s.Sub(returned).Round(time.Millisecond), end.Sub(a.at).Round(time.Millisecond))
		if s.After(from) && a.at.Before(end) {
			t.Errorf("request %s was waiting in the Transport when its 429 came back, yet was sent %v after it (%v after the 429 reached its caller) and reached the upstream %v before the pause ends",
				a.id, s.Sub(learned).Round(time.Millisecond), s.Sub(returned).Round(time.Millisecond), end.Sub(a.at).Round(time.Millisecond))
		}
	}
}

// 40ms latency each way: the Pause call takes a round trip, and requests of
// the same Transport whose slots come meanwhile go out into the pause.
func TestReviewHTTPPauseWindowLatency(t *testing.T) {
	t.Run("pause check false", func(t *testing.T) { rvPauseWaiters(t, 40*time.Millisecond, false, false, 25*time.Millisecond) })
	t.Run("pause check true", func(t *testing.T) { rvPauseWaiters(t, 40*time.Millisecond, true, false, 25*time.Millisecond) })
}

// The pause cannot be stored (Redis gone as the 429 comes back): the
// response still reaches the caller, but the requests waiting in the same
// Transport, which the Transport knows to be inside the upstream's
// Retry-After, are still sent at their old slots.
func TestReviewHTTPPauseUnstoredWaitersSent(t *testing.T) {
	rvPauseWaiters(t, 0, false, true, 400*time.Millisecond)
}

// ------------------------- concurrency, Retry-After, GCRA replay on arrivals

// Two processes (engine, Limiter, Transport each, with WithPauseCheck),
// three callers each, offering more than the limit while the upstream
// answers some requests 429/503 with Retry-After in seconds, as a date,
// invalid, negative and huge (capped by WithMaxPause). Judged on the
// upstream's arrival instants: GCRA conformance with pauses, and no
// request sent after a pause was in place arriving before its end.
func TestReviewHTTPConcurrentRetryAfterGCRA(t *testing.T) {
	srv := redistest.Shared(t)
	const (
		I        = 250 * time.Millisecond
		burst    = 1
		tau      = burst * I
		slack    = 120 * time.Millisecond // timer wake-up + loopback HTTP on a busy 2-core box, below I/2
		maxPause = 1500 * time.Millisecond
	)
	limit := throttle.Every(time.Second, 4, burst)
	prefix := redistest.Prefix(t)

	type forced struct {
		status int
		value  func(now time.Time) string
		pause  func(at time.Time) time.Duration // the pause the value asks for, capped (0: none)
	}
	secs := func(s string, d time.Duration) forced {
		return forced{429, func(time.Time) string { return s }, func(time.Time) time.Duration { return d }}
	}
	schedule := map[int]forced{
		5:  secs("1", time.Second),
		11: {503, func(now time.Time) string { return now.Add(2 * time.Second).UTC().Format(http.TimeFormat) }, nil},
		16: secs("-3", 0),
		18: secs("soon", 0),
		20: secs("99999999999999999999", maxPause),
		25: secs("0", 0),
	}
	var (
		mu      sync.Mutex
		sent    = map[string]time.Time{}
		pauses  []rvPause
		atForce = map[string]time.Time{}
		dPause  = map[string]time.Duration{}
		failed  = map[string]bool{} // RoundTrip returned an error (its 429 may not have reached the caller)
	)
	up := rvNewUp(t, func(n int, r *http.Request, w http.ResponseWriter) {
		f, ok := schedule[n]
		if !ok {
			return
		}
		now := time.Now()
		v := f.value(now)
		var d time.Duration
		if f.pause != nil {
			d = f.pause(now)
		} else { // a date: until it (second precision), capped
			at, _ := http.ParseTime(v)
			d = min(at.Sub(now), maxPause)
		}
		mu.Lock()
		atForce[r.Header.Get("X-RV-ID")], dPause[r.Header.Get("X-RV-ID")] = now, d
		mu.Unlock()
		w.Header().Set("Retry-After", v)
		w.WriteHeader(f.status)
	})
	base := rvRT(func(r *http.Request) (*http.Response, error) {
		mu.Lock()
		sent[r.Header.Get("X-RV-ID")] = time.Now()
		mu.Unlock()
		return up.client.RoundTrip(r)
	})
	ctx, cancel := context.WithTimeout(context.Background(), 9*time.Second)
	defer cancel()
	var wg sync.WaitGroup
	var seq atomic.Int64
	for proc := 0; proc < 2; proc++ {
		eng, err := throttle.New(srv.Client(t), throttle.WithPrefix(prefix), throttle.WithTimeout(time.Second))
		require.NoError(t, err)
		lim, err := reserve.New(eng, "rv", limit)
		require.NoError(t, err)
		tr, err := httplimit.New(lim, httplimit.WithBase(base), httplimit.WithPauseCheck(true), httplimit.WithMaxPause(maxPause),
			httplimit.WithKey(func(*http.Request) string { return "api" }))
		require.NoError(t, err)
		for c := 0; c < 3; c++ {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for ctx.Err() == nil {
					id := fmt.Sprintf("p%d-%d", proc, seq.Add(1))
					rctx, rcancel := context.WithTimeout(ctx, 3*time.Second)
					resp, err := tr.RoundTrip(rvReq(t, rctx, up.URL, id, nil))
					if err != nil {
						mu.Lock()
						failed[id] = true
						mu.Unlock()
					}
					if err == nil {
						if resp.StatusCode != http.StatusOK {
							now := time.Now()
							mu.Lock()
							if d := dPause[id]; d > 0 {
								pauses = append(pauses, rvPause{back: now, end: atForce[id].Add(d)})
							}
							mu.Unlock()
						}
						rvDrain(resp)
					} else if ctx.Err() == nil && !errors.Is(err, context.DeadlineExceeded) {
						var ns *httplimit.NotSentError
						if !errors.As(err, &ns) {
							t.Errorf("%s: %v", id, err)
						}
					}
					rcancel()
				}
			}()
		}
	}
	wg.Wait()
	mu.Lock()
	defer mu.Unlock()
	arr := up.got()
	t.Logf("%d arrivals, %d pauses", len(arr), len(pauses))
	require.GreaterOrEqual(t, len(arr), 20)
	// Three forced answers ask for a pause; one whose RoundTrip ended
	// with an error (its own 3 s deadline passed while the answer was on
	// its way, on a busy machine) never reached its caller, which cannot
	// heed it.
	asked := 0
	for id, d := range dPause {
		if d > 0 && !failed[id] {
			asked++
		}
	}
	require.Len(t, pauses, asked, "forced answers asking for a pause that reached their caller")
	require.GreaterOrEqual(t, asked, 2, "forced answers asking for a pause that reached their caller")
	for _, a := range arr {
		s, ok := sent[a.id]
		require.True(t, ok, "%s reached the upstream without passing the base", a.id)
		for _, p := range pauses {
			if s.After(p.back) && a.at.Before(p.end) {
				t.Errorf("%s sent %v after a pause was in place arrived %v before its end", a.id, s.Sub(p.back), p.end.Sub(a.at))
			}
		}
	}
	for _, b := range rvReplay(arr, sent, pauses, I, tau, slack) {
		t.Error(b)
	}
}

// The replay oracle itself flags what it must: a burst at a pause's end,
// an arrival inside a pause, arrivals faster than the limit; and passes a
// conforming sequence with late (jittered) arrivals.
func TestReviewHTTPOracleSanity(t *testing.T) {
	t0 := time.Unix(1000, 0)
	I, tau, slack := 250*time.Millisecond, 250*time.Millisecond, 120*time.Millisecond
	seq := func(offs ...time.Duration) ([]rvArrival, map[string]time.Time) {
		var a []rvArrival
		s := map[string]time.Time{}
		for i, o := range offs {
			id := strconv.Itoa(i)
			a = append(a, rvArrival{at: t0.Add(o), id: id})
			s[id] = t0.Add(o)
		}
		return a, s
	}
	ms := func(v int) time.Duration { return time.Duration(v) * time.Millisecond }
	a, s := seq(0, 0, ms(250), ms(500), ms(860), ms(1000))
	require.Empty(t, rvReplay(a, s, nil, I, tau, slack), "conforming, one arrival 110ms late")
	a, s = seq(0, 0, ms(10))
	require.NotEmpty(t, rvReplay(a, s, nil, I, tau, slack), "three at once, burst 1")
	p := []rvPause{{back: t0.Add(ms(100)), end: t0.Add(ms(1100))}}
	a, s = seq(0, ms(500))
	require.NotEmpty(t, rvReplay(a, s, p, I, tau, slack), "inside the pause")
	a, s = seq(0, ms(1100), ms(1105))
	require.NotEmpty(t, rvReplay(a, s, p, I, tau, slack), "burst at the pause's end")
	a, s = seq(0, ms(1100), ms(1350), ms(1600))
	require.Empty(t, rvReplay(a, s, p, I, tau, slack), "one interval apart after the pause")
}

// A later, shorter Retry-After does not shorten the pause in force (Redis
// clock); reset headers pause only when asked for, Retry-After first.
func TestReviewHTTPPauseNotShortenedAndResetHeaders(t *testing.T) {
	srv := redistest.Shared(t)
	bg := context.Background()
	lim, err := reserve.New(rvEngine(t, srv.Client(t), time.Second), "rv", throttle.PerSecond(10, 5))
	require.NoError(t, err)

	// A and B both booked at once (burst); A answered 429 Retry-After: 3;
	// B's answer, 429 Retry-After: 1, comes after A's pause is stored.
	aBack := make(chan struct{})
	upAB := rvNewUp(t, func(_ int, r *http.Request, w http.ResponseWriter) {
		if r.Header.Get("X-RV-ID") == "A" {
			w.Header().Set("Retry-After", "3")
		} else {
			<-aBack
			w.Header().Set("Retry-After", "1")
		}
		w.WriteHeader(http.StatusTooManyRequests)
	})
	trAB, err := httplimit.New(lim, httplimit.WithBase(upAB.client), httplimit.WithKey(func(*http.Request) string { return "ab" }))
	require.NoError(t, err)
	bDone := make(chan struct{})
	go func() {
		defer close(bDone)
		resp, err := trAB.RoundTrip(rvReq(t, bg, upAB.URL, "B", nil))
		if err == nil {
			rvDrain(resp)
		}
	}()
	require.Eventually(t, func() bool { return len(upAB.got()) == 1 }, 2*time.Second, time.Millisecond)
	resp, err := trAB.RoundTrip(rvReq(t, bg, upAB.URL, "A", nil))
	require.NoError(t, err)
	rvDrain(resp)
	close(aBack)
	<-bDone
	st, err := lim.State(bg, "ab")
	require.NoError(t, err)
	require.Greater(t, st.Wait, 2*time.Second, "a later Retry-After: 1 does not shorten the 3 s pause")

	var hdr atomic.Pointer[http.Header]
	up := rvNewUp(t, func(_ int, _ *http.Request, w http.ResponseWriter) {
		for k, v := range *hdr.Load() {
			w.Header()[k] = v
		}
		w.WriteHeader(http.StatusTooManyRequests)
	})
	key := func(r *http.Request) string { return r.Header.Get("X-RV-ID") }
	send := func(tr *httplimit.Transport, id string, h http.Header) throttle.State {
		hdr.Store(&h)
		resp, err := tr.RoundTrip(rvReq(t, bg, up.URL, id, nil))
		require.NoError(t, err)
		rvDrain(resp)
		st, err := lim.State(bg, id)
		require.NoError(t, err)
		return st
	}
	tr, err := httplimit.New(lim, httplimit.WithBase(up.client), httplimit.WithKey(key))
	require.NoError(t, err)
	require.Zero(t, send(tr, "noreset", http.Header{"X-Ratelimit-Reset": {"3"}, "Ratelimit-Reset": {"3"}}).Wait, "reset headers ignored by default")

	trR, err := httplimit.New(lim, httplimit.WithBase(up.client), httplimit.WithKey(key), httplimit.WithResetHeaders(true))
	require.NoError(t, err)
	st = send(trR, "rl", http.Header{"Ratelimit-Reset": {"2"}})
	require.Greater(t, st.Wait, 1500*time.Millisecond)
	require.LessOrEqual(t, st.Wait, 2*time.Second)
	st = send(trR, "xrl-unix", http.Header{"X-Ratelimit-Reset": {strconv.FormatInt(time.Now().Add(3*time.Second).Unix(), 10)}})
	require.Greater(t, st.Wait, time.Second)
	require.LessOrEqual(t, st.Wait, 3*time.Second)
	require.Zero(t, send(trR, "xrl-past", http.Header{"X-Ratelimit-Reset": {strconv.FormatInt(time.Now().Add(-time.Hour).Unix(), 10)}}).Wait)
	require.LessOrEqual(t, send(trR, "ra-wins", http.Header{"Retry-After": {"1"}, "Ratelimit-Reset": {"3"}}).Wait, time.Second, "Retry-After first")
}
