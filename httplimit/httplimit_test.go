package httplimit_test

import (
	"context"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
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

func TestMain(m *testing.M) { redistest.Main(m) }

// engine returns an engine of its own (as another process would have) on
// srv, under the test's prefix.
func engine(t *testing.T, srv *redistest.Server, prefix string) *throttle.Engine {
	t.Helper()
	eng, err := throttle.New(srv.Client(t), throttle.WithPrefix(prefix), throttle.WithTimeout(5*time.Second))
	require.NoError(t, err)
	return eng
}

// upstream is an API that enforces its own limit strictly, on its own
// arrival times: at most max requests in any window; one more is a
// violation, answered 429. It can be told to answer the next request 429
// with a Retry-After.
type upstream struct {
	*httptest.Server
	max    int
	window time.Duration

	mu         sync.Mutex // guards the fields below
	arrivals   []arrival
	violations int
	force      string    // Retry-After of the next answer, if not ""
	forcedAt   time.Time // arrival of the request answered with force
}

type arrival struct {
	at     time.Time
	client string
	issued time.Time // when the client issued the request (X-Issued)
}

func newUpstream(t *testing.T, max int, window time.Duration) *upstream {
	u := &upstream{max: max, window: window}
	u.Server = httptest.NewServer(http.HandlerFunc(u.serve))
	t.Cleanup(u.Close)
	return u
}

func (u *upstream) serve(w http.ResponseWriter, r *http.Request) {
	u.mu.Lock()
	defer u.mu.Unlock()
	now := time.Now()
	ns, _ := strconv.ParseInt(r.Header.Get("X-Issued"), 10, 64)
	u.arrivals = append(u.arrivals, arrival{at: now, client: r.Header.Get("X-Client"), issued: time.Unix(0, ns)})
	if u.force != "" {
		w.Header().Set("Retry-After", u.force)
		u.force, u.forcedAt = "", now
		w.WriteHeader(http.StatusTooManyRequests)
		return
	}
	n := 0
	for _, a := range u.arrivals {
		if a.at.After(now.Add(-u.window)) {
			n++
		}
	}
	if n > u.max {
		u.violations++
		w.Header().Set("Retry-After", "1")
		w.WriteHeader(http.StatusTooManyRequests)
	}
}

// client is one process's client: a limiter and a Transport of its own.
type client struct {
	name string
	http *http.Client

	mu       sync.Mutex // guards statuses and got429
	statuses []int
	got429   time.Time // when the last 429 reached the caller
}

func (c *client) get(t *testing.T, ctx context.Context, url string) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	require.NoError(t, err)
	req.Header.Set("X-Client", c.name)
	req.Header.Set("X-Issued", strconv.FormatInt(time.Now().UnixNano(), 10))
	resp, err := c.http.Do(req)
	if err != nil {
		if ctx.Err() == nil {
			t.Errorf("client %s: %v", c.name, err)
		}
		return
	}
	_, _ = io.Copy(io.Discard, resp.Body)
	_ = resp.Body.Close()
	c.mu.Lock()
	defer c.mu.Unlock()
	c.statuses = append(c.statuses, resp.StatusCode)
	if resp.StatusCode == http.StatusTooManyRequests {
		c.got429 = time.Now()
	}
}

// offer sends requests every period until ctx ends, one at a time (a tick
// missed while a request waits is dropped).
func (c *client) offer(t *testing.T, ctx context.Context, url string, period time.Duration) {
	tick := time.NewTicker(period)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
			c.get(t, ctx, url)
		}
	}
}

// TestSharedQuota: three clients, each with its own engine, Limiter and
// Transport (three processes), offer together 1.5 times what an upstream
// allows. Through one shared limit set below the upstream's, no request
// is refused by the upstream. Then the upstream answers one request 429
// with Retry-After: 2, and the upstream's own arrival times are judged:
//
//   - with WithPauseCheck, no request arrives during the 2 s but one sent
//     before the pause was in place (a request in flight on the wire);
//   - without it, the requests booked before the pause was in place still
//     go at their slots: at most one per other client (each waiting for
//     one slot then), none from the client that got the 429.
func TestSharedQuota(t *testing.T) {
	t.Parallel()
	for _, check := range []bool{true, false} {
		t.Run("pause check "+strconv.FormatBool(check), func(t *testing.T) {
			t.Parallel()
			sharedQuota(t, check)
		})
	}
}

func sharedQuota(t *testing.T, check bool) {
	srv := redistest.Shared(t)
	prefix := redistest.Prefix(t)
	up := newUpstream(t, 10, time.Second) // 10 in any second
	// The shared limit: 6 a second, no burst. The upstream's 10 leave room
	// for requests that a busy machine sends after their slots (four more
	// in a second: over half a second late).
	limit := throttle.Every(time.Second, 6, 0)

	var (
		mu   sync.Mutex               // guards sent
		sent = map[string]time.Time{} // by X-Issued: when the base sent it
	)
	base := roundTripFunc(func(req *http.Request) (*http.Response, error) {
		mu.Lock()
		sent[req.Header.Get("X-Client")+"/"+req.Header.Get("X-Issued")] = time.Now()
		mu.Unlock()
		return http.DefaultTransport.RoundTrip(req)
	})
	clients := make([]*client, 3)
	for i := range clients {
		lim, err := reserve.New(engine(t, srv, prefix), "partner", limit)
		require.NoError(t, err)
		tr, err := httplimit.New(lim, httplimit.WithBase(base), httplimit.WithPauseCheck(check))
		require.NoError(t, err)
		clients[i] = &client{name: strconv.Itoa(i), http: &http.Client{Transport: tr}}
	}
	// Each offers 5 a second: 15, 1.5 times the upstream's 10.
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	for _, c := range clients {
		wg.Add(1)
		go func() {
			defer wg.Done()
			c.offer(t, ctx, up.URL, 200*time.Millisecond)
		}()
	}
	defer func() { cancel(); wg.Wait() }()

	time.Sleep(3 * time.Second)
	up.mu.Lock()
	steady := len(up.arrivals)
	require.Zero(t, up.violations, "steady state: requests beyond the upstream's limit")
	require.GreaterOrEqual(t, steady, 10, "the clients did offer load")
	up.force = "2"
	up.mu.Unlock()

	// Run until well past the pause.
	require.Eventually(t, func() bool {
		up.mu.Lock()
		defer up.mu.Unlock()
		return !up.forcedAt.IsZero() && time.Since(up.forcedAt) > 4*time.Second
	}, 20*time.Second, 10*time.Millisecond)
	cancel()
	wg.Wait()

	up.mu.Lock()
	defer up.mu.Unlock()
	mu.Lock()
	defer mu.Unlock()
	require.Zero(t, up.violations, "requests beyond the upstream's limit")
	var forced *client
	n429 := 0
	for _, c := range clients {
		for _, s := range c.statuses {
			if s == http.StatusTooManyRequests {
				n429++
				forced = c
			}
		}
	}
	require.Equal(t, 1, n429, "only the forced 429")
	// The pause was in place (in Redis) once the 429 reached its caller:
	// the Transport stores it before returning the response.
	inPlace := forced.got429
	pauseEnd := up.forcedAt.Add(2 * time.Second)
	during := map[string]int{}
	resumed := 0
	for _, a := range up.arrivals {
		switch {
		case a.at.After(up.forcedAt) && a.at.Before(pauseEnd):
			during[a.client]++
			require.True(t, a.issued.Before(inPlace),
				"client %s's request issued %v after the pause was in place reached the upstream %v into the pause",
				a.client, a.issued.Sub(inPlace), a.at.Sub(up.forcedAt))
			if check {
				at, ok := sent[a.client+"/"+strconv.FormatInt(a.issued.UnixNano(), 10)]
				require.True(t, ok, "the base saw the request")
				require.True(t, at.Before(inPlace), "client %s's request sent %v after the pause was in place reached the upstream %v into the pause",
					a.client, at.Sub(inPlace), a.at.Sub(up.forcedAt))
			}
		case !a.at.Before(pauseEnd):
			resumed++
		}
	}
	t.Logf("during the pause, per client: %v; %d requests after it", during, resumed)
	require.Zero(t, during[forced.name], "the client that got the 429")
	for c, n := range during {
		require.LessOrEqual(t, n, 1, "client %s: booked before the pause, at most the one it was waiting for", c)
	}
	require.Positive(t, resumed, "requests resume after the pause")
}

// TestPauseRebooksWaiting: callers of one Transport waiting for slots
// when it gets a 429 book again behind the pause: on the upstream's own
// arrival times, no request reaches it during the pause but those already
// sent when the 429 came back.
func TestPauseRebooksWaiting(t *testing.T) {
	t.Parallel()
	srv := redistest.Shared(t)
	lim, err := reserve.New(engine(t, srv, redistest.Prefix(t)), "partner", throttle.PerSecond(10, 0))
	require.NoError(t, err)
	up := newUpstream(t, 1000, time.Second)
	var (
		mu   sync.Mutex               // guards sent
		sent = map[string]time.Time{} // by X-Client: when the base sent it
	)
	base := roundTripFunc(func(req *http.Request) (*http.Response, error) {
		mu.Lock()
		sent[req.Header.Get("X-Client")] = time.Now()
		mu.Unlock()
		return http.DefaultTransport.RoundTrip(req)
	})
	tr, err := httplimit.New(lim, httplimit.WithBase(base))
	require.NoError(t, err)
	hc := &http.Client{Transport: tr}

	// Four callers book slots 100ms apart; the first one's answer is 429,
	// Retry-After: 1, while the others wait for theirs.
	up.mu.Lock()
	up.force = "1"
	up.mu.Unlock()
	var wg sync.WaitGroup
	var returned atomic.Int64 // when the 429 came back, UnixNano
	for i := 0; i < 4; i++ {
		c := &client{name: strconv.Itoa(i), http: hc}
		wg.Add(1)
		go func() {
			defer wg.Done()
			c.get(t, context.Background(), up.URL)
			c.mu.Lock()
			if !c.got429.IsZero() {
				returned.Store(c.got429.UnixNano())
			}
			c.mu.Unlock()
		}()
	}
	wg.Wait()
	up.mu.Lock()
	defer up.mu.Unlock()
	mu.Lock()
	defer mu.Unlock()
	require.Len(t, up.arrivals, 4)
	require.NotZero(t, returned.Load())
	back := time.Unix(0, returned.Load())
	for _, a := range up.arrivals {
		if a.at.After(up.forcedAt) && a.at.Before(up.forcedAt.Add(time.Second)) {
			require.True(t, sent[a.client].Before(back), "request %s sent %v after the 429 came back, %v into the pause",
				a.client, sent[a.client].Sub(back), a.at.Sub(up.forcedAt))
		}
	}
}

// closeBody records whether it was closed.
type closeBody struct {
	io.Reader
	closed atomic.Bool
}

func (b *closeBody) Close() error { b.closed.Store(true); return nil }

// TestRefusedNotSent: a request the limiter refuses is never sent; the
// error is a *NotSentError wrapping the refusal with its retry-after, and
// the request's body is closed, as http.RoundTripper requires.
func TestRefusedNotSent(t *testing.T) {
	t.Parallel()
	srv := redistest.Shared(t)
	lim, err := reserve.New(engine(t, srv, redistest.Prefix(t)), "partner", throttle.PerMinute(1, 0), reserve.WithMaxWait(0))
	require.NoError(t, err)
	up := newUpstream(t, 1000, time.Second)
	tr, err := httplimit.New(lim)
	require.NoError(t, err)

	req, err := http.NewRequest(http.MethodPost, up.URL, strings.NewReader("first"))
	require.NoError(t, err)
	resp, err := tr.RoundTrip(req)
	require.NoError(t, err)
	require.NoError(t, resp.Body.Close())

	body := &closeBody{Reader: strings.NewReader("second")}
	req, err = http.NewRequest(http.MethodPost, up.URL, body)
	require.NoError(t, err)
	resp, err = tr.RoundTrip(req)
	require.Nil(t, resp)
	var ns *httplimit.NotSentError
	require.ErrorAs(t, err, &ns)
	require.ErrorIs(t, err, reserve.ErrMaxWaitExceeded)
	require.Equal(t, up.Listener.Addr().String(), ns.Key, "keyed by host")
	d, ok := ns.RetryAfter()
	require.True(t, ok)
	require.Greater(t, d, 50*time.Second)
	require.True(t, body.closed.Load(), "the refused request's body is closed")

	// Through an http.Client: the same error, in a *url.Error.
	_, err = (&http.Client{Transport: tr}).Get(up.URL)
	require.ErrorAs(t, err, &ns)

	up.mu.Lock()
	defer up.mu.Unlock()
	require.Len(t, up.arrivals, 1, "refused requests never reach the upstream")
}

// TestHugeRetryAfter: an absurd Retry-After pauses for the max pause (not
// years, not an overflowed negative duration), and the caller gets the
// upstream's response.
func TestHugeRetryAfter(t *testing.T) {
	t.Parallel()
	srv := redistest.Shared(t)
	for _, v := range []string{"5000000000", "99999999999999999999", "Fri, 31 Dec 9999 23:59:59 GMT"} {
		t.Run(v, func(t *testing.T) {
			lim, err := reserve.New(engine(t, srv, redistest.Prefix(t)), "partner", throttle.PerSecond(10, 0))
			require.NoError(t, err)
			api := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				w.Header().Set("Retry-After", v)
				w.WriteHeader(http.StatusServiceUnavailable)
				_, _ = io.WriteString(w, "busy")
			}))
			defer api.Close()
			var pauseErr error
			tr, err := httplimit.New(lim, httplimit.WithMaxPause(time.Minute),
				httplimit.WithPauseErrorHandler(func(_ *http.Request, _ time.Duration, err error) { pauseErr = err }))
			require.NoError(t, err)
			resp, err := (&http.Client{Transport: tr}).Get(api.URL)
			require.NoError(t, err)
			b, err := io.ReadAll(resp.Body)
			require.NoError(t, err)
			require.NoError(t, resp.Body.Close())
			require.Equal(t, http.StatusServiceUnavailable, resp.StatusCode)
			require.Equal(t, "busy", string(b))
			require.NoError(t, pauseErr)

			st, err := lim.State(context.Background(), api.Listener.Addr().String())
			require.NoError(t, err)
			require.Greater(t, st.Wait, 50*time.Second, "paused for the max pause")
			require.LessOrEqual(t, st.Wait, time.Minute)
		})
	}
}

// TestPauseFailureKeepsResponse: when the pause cannot be stored (Redis
// gone), the caller still gets the upstream's 429, and the handler hears
// of the failure.
func TestPauseFailureKeepsResponse(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	eng, err := throttle.New(srv.Client(t), throttle.WithTimeout(time.Second))
	require.NoError(t, err)
	lim, err := reserve.New(eng, "partner", throttle.PerSecond(10, 0))
	require.NoError(t, err)
	api := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		srv.Stop()
		w.Header().Set("Retry-After", "1")
		w.WriteHeader(http.StatusTooManyRequests)
	}))
	defer api.Close()
	var pauseErr error
	tr, err := httplimit.New(lim, httplimit.WithPauseErrorHandler(func(_ *http.Request, d time.Duration, err error) {
		require.Equal(t, time.Second, d)
		pauseErr = err
	}))
	require.NoError(t, err)
	resp, err := (&http.Client{Transport: tr}).Get(api.URL)
	require.NoError(t, err)
	require.NoError(t, resp.Body.Close())
	require.Equal(t, http.StatusTooManyRequests, resp.StatusCode)
	require.ErrorIs(t, pauseErr, throttle.ErrUnavailable)
}

func TestBadOptions(t *testing.T) {
	t.Parallel()
	srv := redistest.Shared(t)
	lim, err := reserve.New(engine(t, srv, redistest.Prefix(t)), "partner", throttle.PerSecond(10, 0))
	require.NoError(t, err)
	for name, opt := range map[string]httplimit.Option{
		"nil base":          httplimit.WithBase(nil),
		"nil key":           httplimit.WithKey(nil),
		"zero max pause":    httplimit.WithMaxPause(0),
		"max pause too big": httplimit.WithMaxPause(throttle.MaxHorizon + 1),
		"zero timeout":      httplimit.WithPauseTimeout(0),
		"nil handler":       httplimit.WithPauseErrorHandler(nil),
	} {
		_, err := httplimit.New(lim, opt)
		require.Error(t, err, name)
	}
	_, err = httplimit.New(nil)
	require.Error(t, err)
	_, err = httplimit.New(lim, httplimit.WithMaxPause(time.Minute), httplimit.WithResetHeaders(true))
	require.NoError(t, err)
	require.False(t, errors.Is(err, throttle.ErrInvalidRequest))
}

// roundTripFunc is an http.RoundTripper.
type roundTripFunc func(*http.Request) (*http.Response, error)

func (f roundTripFunc) RoundTrip(r *http.Request) (*http.Response, error) { return f(r) }
