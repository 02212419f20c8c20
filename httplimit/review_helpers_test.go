package httplimit_test

// Helpers of the adversarial reviews (review_side*_test.go): an upstream
// that records arrivals, a RoundTripper that records sendings, a go-redis
// hook that holds or fails the pause script's calls, and the oracles (a
// textbook GCRA replayed over the upstream's arrival instants, and the
// pauses' windows).

import (
	"context"
	"fmt"
	"io"
	"maps"
	"net/http"
	"net/http/httptest"
	"runtime"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/slotbook/slotbook/internal/redistest"
	"github.com/slotbook/slotbook/reserve"
	"github.com/slotbook/slotbook/throttle"
)

type rvArrival struct {
	at time.Time
	id string
}

// rvUp is an upstream on 127.0.0.1 that records when each request arrived
// and answers as answer says (nil: 200).
type rvUp struct {
	*httptest.Server
	mu       sync.Mutex
	arrivals []rvArrival
	answer   func(n int, r *http.Request, w http.ResponseWriter) // n: 1-based arrival index
	client   *http.Transport
}

func rvNewUp(t *testing.T, answer func(n int, r *http.Request, w http.ResponseWriter)) *rvUp {
	u := &rvUp{answer: answer, client: &http.Transport{}}
	u.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		u.mu.Lock()
		u.arrivals = append(u.arrivals, rvArrival{at: time.Now(), id: r.Header.Get("X-RV-ID")})
		n := len(u.arrivals)
		u.mu.Unlock()
		_, _ = io.Copy(io.Discard, r.Body)
		if u.answer != nil {
			u.answer(n, r, w)
		}
	}))
	t.Cleanup(func() { u.client.CloseIdleConnections(); u.Close() })
	return u
}

func (u *rvUp) host() string { return u.Listener.Addr().String() }

func (u *rvUp) got() []rvArrival {
	u.mu.Lock()
	defer u.mu.Unlock()
	return append([]rvArrival(nil), u.arrivals...)
}

func (u *rvUp) gotID(id string) (time.Time, bool) {
	for _, a := range u.got() {
		if a.id == id {
			return a.at, true
		}
	}
	return time.Time{}, false
}

type rvRT func(*http.Request) (*http.Response, error)

func (f rvRT) RoundTrip(r *http.Request) (*http.Response, error) { return f(r) }

// rvBody counts its closes.
type rvBody struct {
	io.Reader
	closes atomic.Int32
}

func (b *rvBody) Close() error { b.closes.Add(1); return nil }

func rvEngine(t *testing.T, rdb redis.Scripter, timeout time.Duration) *throttle.Engine {
	t.Helper()
	eng, err := throttle.New(rdb, throttle.WithPrefix(redistest.Prefix(t)), throttle.WithTimeout(timeout))
	require.NoError(t, err)
	return eng
}

func rvReq(t *testing.T, ctx context.Context, url, id string, body io.Reader) *http.Request {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url, body)
	require.NoError(t, err)
	req.Header.Set("X-RV-ID", id)
	return req
}

func rvDrain(resp *http.Response) {
	if resp != nil {
		_, _ = io.Copy(io.Discard, resp.Body)
		_ = resp.Body.Close()
	}
}

// rvHook intercepts the engine's calls. pause, if set, is called before
// each call of the pause script with the subject it pauses (the text
// between "{" and "}" of its first key); its error fails the call unsent.
// after, if set, is called once any other call (a booking, a read) has its
// reply. Every call (a pipeline counts once) is counted in calls.
type rvHook struct {
	mu    sync.Mutex
	sig   string // the pause script's SHA (or body), learnt
	learn bool
	pause func(ctx context.Context, subject string) error
	after func(subject string)
	calls atomic.Int64
}

func (h *rvHook) DialHook(next redis.DialHook) redis.DialHook { return next }

func rvSubject(args []any) string {
	if len(args) < 4 {
		return ""
	}
	k, _ := args[3].(string)
	i, j := strings.Index(k, "{"), strings.LastIndex(k, "}")
	if i < 0 || j <= i {
		return k
	}
	return k[i+1 : j]
}

func (h *rvHook) isPause(args []any) bool {
	if len(args) < 2 {
		return false
	}
	s, _ := args[1].(string)
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.learn {
		h.sig = s
		return false
	}
	return s != "" && s == h.sig
}

func (h *rvHook) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		h.calls.Add(1)
		args := cmd.Args()
		if h.isPause(args) {
			h.mu.Lock()
			f := h.pause
			h.mu.Unlock()
			if f != nil {
				if err := f(ctx, rvSubject(args)); err != nil {
					cmd.SetErr(err)
					return err
				}
			}
			return next(ctx, cmd)
		}
		err := next(ctx, cmd)
		h.mu.Lock()
		f := h.after
		h.mu.Unlock()
		if f != nil {
			f(rvSubject(args))
		}
		return err
	}
}

func (h *rvHook) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		h.calls.Add(1)
		err := next(ctx, cmds)
		h.mu.Lock()
		f := h.after
		h.mu.Unlock()
		if f != nil {
			for _, c := range cmds {
				f(rvSubject(c.Args()))
			}
		}
		return err
	}
}

func (h *rvHook) set(pause func(context.Context, string) error, after func(string)) {
	h.mu.Lock()
	h.pause, h.after = pause, after
	h.mu.Unlock()
}

func (h *rvHook) setPause(f func(context.Context, string) error) {
	h.mu.Lock()
	h.pause = f
	h.mu.Unlock()
}

// rvSetup builds an engine (under prefix, with the given timeout) on a
// hooked client of srv (the shared server if nil), a limiter on it, learns
// the pause script's signature and warms the booking and state scripts.
func rvSetup(t *testing.T, srv *redistest.Server, prefix string, timeout time.Duration, limit throttle.Limit, opts ...reserve.Option) (*reserve.Limiter, *rvHook) {
	t.Helper()
	if srv == nil {
		srv = redistest.Shared(t)
	}
	return rvSetupOn(t, srv.Client(t), prefix, timeout, limit, opts...)
}

// rvSetupOn is rvSetup on a given client (one through a proxy, say).
func rvSetupOn(t *testing.T, c *redis.Client, prefix string, timeout time.Duration, limit throttle.Limit, opts ...reserve.Option) (*reserve.Limiter, *rvHook) {
	t.Helper()
	h := &rvHook{}
	c.AddHook(h)
	eng, err := throttle.New(c, throttle.WithPrefix(prefix), throttle.WithTimeout(timeout))
	require.NoError(t, err)
	lim, err := reserve.New(eng, "rv", limit, opts...)
	require.NoError(t, err)
	bg := context.Background()
	// Loads the script (retried: a first call through a proxy may miss a
	// tight timeout).
	redistest.UntilOK(t, func() error { return lim.Pause(bg, "rv-probe", time.Millisecond) })
	h.mu.Lock()
	h.learn = true
	h.mu.Unlock()
	require.NoError(t, lim.Pause(bg, "rv-probe", time.Millisecond))
	h.mu.Lock()
	h.learn = false
	sig := h.sig
	h.mu.Unlock()
	require.NotEmpty(t, sig)
	_, err = lim.State(bg, "rv-probe")
	require.NoError(t, err)
	r, err := lim.Reserve(bg, "rv-probe2")
	require.NoError(t, err)
	require.True(t, r.OK())
	return lim, h
}

// rvGo sends the request id through tr on a goroutine of its own, failing
// t if RoundTrip fails; the channel is closed once RoundTrip has returned.
func rvGo(t *testing.T, ctx context.Context, tr http.RoundTripper, url, id string) <-chan struct{} {
	done := make(chan struct{})
	go func() {
		defer close(done)
		resp, err := tr.RoundTrip(rvReq(t, ctx, url, id, nil))
		if err != nil {
			t.Errorf("%s: %v", id, err)
		}
		rvDrain(resp)
	}()
	return done
}

// rvSent wraps a base RoundTripper, recording when each request was handed
// to it and when each answer other than 200 came back from it.
type rvSent struct {
	mu   sync.Mutex
	sent map[string]time.Time
	back map[string]time.Time
	base http.RoundTripper
}

func rvNewSent(base http.RoundTripper) *rvSent {
	return &rvSent{sent: map[string]time.Time{}, back: map[string]time.Time{}, base: base}
}

func (s *rvSent) RoundTrip(r *http.Request) (*http.Response, error) {
	id := r.Header.Get("X-RV-ID")
	s.mu.Lock()
	s.sent[id] = time.Now()
	s.mu.Unlock()
	resp, err := s.base.RoundTrip(r)
	if err == nil && resp.StatusCode != http.StatusOK {
		s.mu.Lock()
		s.back[id] = time.Now()
		s.mu.Unlock()
	}
	return resp, err
}

func (s *rvSent) at(id string) time.Time {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.sent[id]
}

func (s *rvSent) copy() map[string]time.Time {
	s.mu.Lock()
	defer s.mu.Unlock()
	return maps.Clone(s.sent)
}

// rvPause is a pause as its caller saw it.
type rvPause struct {
	back time.Time // the 429 reached its caller
	end  time.Time // earliest possible end of the pause
}

// rvReplay replays textbook GCRA (virtual scheduling) over the arrival
// instants: an arrival at t conforms if t >= TAT - (tau + slack), then
// TAT = max(TAT, t) + I. A pause ending at E (resuming one interval apart)
// is TAT = max(TAT, E + tau), applied before the first arrival sent after
// the pause was in place. The slack covers lateness only: a request arrives
// at or after its slot (slots are on the Redis clock of this same machine,
// and the local slot is the reply's arrival plus the wait), at most slack
// late; slots that conform to GCRA(I, tau) delayed by at most slack conform
// to GCRA(I, tau+slack).
func rvReplay(arr []rvArrival, sent map[string]time.Time, pauses []rvPause, I, tau, slack time.Duration) []string {
	arr = append([]rvArrival(nil), arr...)
	pauses = append([]rvPause(nil), pauses...)
	sort.Slice(arr, func(i, j int) bool { return arr[i].at.Before(arr[j].at) })
	sort.Slice(pauses, func(i, j int) bool { return pauses[i].back.Before(pauses[j].back) })
	var bad []string
	var tat time.Time
	pi := 0
	for i, a := range arr {
		for pi < len(pauses) && pauses[pi].back.Before(sent[a.id]) {
			if e := pauses[pi].end.Add(tau); e.After(tat) {
				tat = e
			}
			pi++
		}
		if tat.IsZero() {
			tat = a.at
		}
		if a.at.Before(tat.Add(-(tau + slack))) {
			bad = append(bad, fmt.Sprintf("arrival %d (%s) at +%v is %v ahead of GCRA(I=%v, tau+slack=%v)",
				i, a.id, a.at.Sub(arr[0].at).Round(time.Millisecond), tat.Add(-(tau+slack)).Sub(a.at).Round(time.Millisecond), I, tau+slack))
		}
		if a.at.After(tat) {
			tat = a.at
		}
		tat = tat.Add(I)
	}
	return bad
}

// rvInside lists requests sent after a pause reached its caller that
// arrived before its end (less slack).
func rvInside(arr []rvArrival, sent map[string]time.Time, pauses []rvPause, slack time.Duration) []string {
	var bad []string
	for _, a := range arr {
		s, ok := sent[a.id]
		if !ok {
			bad = append(bad, a.id+" reached the upstream without passing the base")
			continue
		}
		for _, p := range pauses {
			if s.After(p.back) && a.at.Before(p.end.Add(-slack)) {
				bad = append(bad, fmt.Sprintf("%s sent %v after a pause reached its caller arrived %v before its end",
					a.id, s.Sub(p.back).Round(time.Millisecond), p.end.Sub(a.at).Round(time.Millisecond)))
			}
		}
	}
	return bad
}

// rvSettle waits (up to 5 s, closing u's idle connections) until at most
// base+2 goroutines run, and reports the stacks if more are left.
func rvSettle(t *testing.T, u *rvUp, base int) {
	t.Helper()
	u.client.CloseIdleConnections()
	deadline := time.Now().Add(5 * time.Second)
	for runtime.NumGoroutine() > base+2 && time.Now().Before(deadline) {
		time.Sleep(50 * time.Millisecond)
		u.client.CloseIdleConnections()
	}
	if n := runtime.NumGoroutine(); n > base+2 {
		buf := make([]byte, 1<<20)
		t.Errorf("%d goroutines after the run, %d before:\n%s", n, base, buf[:runtime.Stack(buf, true)])
	}
}
