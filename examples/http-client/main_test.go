package main

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/slotbook/slotbook/httplimit"
	"github.com/slotbook/slotbook/internal/limitcheck"
	"github.com/slotbook/slotbook/internal/redistest"
	"github.com/slotbook/slotbook/internal/timing"
	"github.com/slotbook/slotbook/reserve"
	"github.com/slotbook/slotbook/throttle"
)

func TestMain(m *testing.M) { redistest.Main(m) }

// TestTransport: three workers (httplimit.Transport) with limiters of their own share one quota
// through Redis; after the API's 429 with Retry-After: 1, no request
// booked once the pause is in place reaches the API for a second. A
// request already booked before the 429 still goes at its slot: at most
// one for each other worker (and any booked in the moment between the 429
// and the pause taking hold, which a busy machine makes longer).
func TestTransport(t *testing.T) {
	srv := redistest.Shared(t)
	eng, err := throttle.New(srv.Client(t), throttle.WithPrefix(redistest.Prefix(t)), throttle.WithTimeout(5*time.Second))
	require.NoError(t, err)

	// Per request, by its X-Req header: when its worker issued it and got
	// the answer, when it left the limiter (its slot, and however late the
	// machine woke it), and when it reached the API.
	type times struct{ issued, done, sent, arrived time.Time }
	var (
		mu        sync.Mutex // guards reqs, limited and limitedID
		reqs      = map[string]*times{}
		limited   time.Time
		limitedID string
	)
	get := func(id string) *times {
		if reqs[id] == nil {
			reqs[id] = &times{}
		}
		return reqs[id]
	}
	api := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		defer mu.Unlock()
		id := r.Header.Get("X-Req")
		get(id).arrived = time.Now()
		n := 0
		for _, rt := range reqs {
			if !rt.arrived.IsZero() {
				n++
			}
		}
		if n == 6 {
			limited, limitedID = time.Now(), id
			w.Header().Set("Retry-After", "1")
			w.WriteHeader(http.StatusTooManyRequests)
		}
	}))
	defer api.Close()
	sent := roundTripFunc(func(req *http.Request) (*http.Response, error) {
		mu.Lock()
		get(req.Header.Get("X-Req")).sent = time.Now()
		mu.Unlock()
		return http.DefaultTransport.RoundTrip(req)
	})

	control := timing.Control(t)
	limit := throttle.PerSecond(20, 1)
	var wg sync.WaitGroup
	statuses := make(chan int, 64)
	for w := 0; w < 3; w++ {
		lim, err := reserve.New(eng, "api", limit)
		require.NoError(t, err)
		tr, err := httplimit.New(lim, httplimit.WithBase(sent))
		require.NoError(t, err)
		client := &http.Client{Transport: tr}
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; i < 6; i++ {
				id := fmt.Sprintf("%d-%d", w, i)
				req, _ := http.NewRequestWithContext(context.Background(), http.MethodGet, api.URL, nil)
				req.Header.Set("X-Req", id)
				mu.Lock()
				get(id).issued = time.Now()
				mu.Unlock()
				resp, err := client.Do(req)
				mu.Lock()
				get(id).done = time.Now()
				mu.Unlock()
				if err != nil {
					t.Error(err)
					return
				}
				resp.Body.Close()
				statuses <- resp.StatusCode
			}
		}()
	}
	wg.Wait()
	timerLate := control()
	close(statuses)
	n429 := 0
	for s := range statuses {
		if s == http.StatusTooManyRequests {
			n429++
		}
	}
	require.Equal(t, 1, n429)

	mu.Lock()
	defer mu.Unlock()
	require.Len(t, reqs, 18)
	// The pause was in place (in Redis) by the time the 429's worker got
	// its answer: Transport pauses before returning the response.
	paused := reqs[limitedID].done
	pauseEnd := limited.Add(995 * time.Millisecond) // the pause is a second from after the 429
	var during []string
	var after []time.Time
	beforeLimited := map[byte]int{} // per worker: arrived during the pause, issued before the 429
	for id, rt := range reqs {
		switch {
		case rt.arrived.After(limited) && rt.arrived.Before(pauseEnd):
			during = append(during, id)
			require.True(t, rt.issued.Before(paused), "request %s was issued after the pause was in place and still reached the API %v into it",
				id, rt.arrived.Sub(limited))
			if rt.issued.Before(limited) {
				beforeLimited[id[0]]++
			}
		case !rt.arrived.Before(pauseEnd):
			after = append(after, rt.sent)
		}
	}
	t.Logf("during the pause: %v (the pause took hold %v after the 429)", during, paused.Sub(limited))
	for w, n := range beforeLimited {
		require.LessOrEqual(t, n, 1, "worker %c: requests booked before the 429 that reached the API during the pause", w)
	}
	// After the pause, requests resume one interval (50ms) apart, not in a
	// burst: one slot at the end of the pause, then 50ms apart. They leave
	// the limiter as late after their slots as the machine wakes a timer:
	// allow the worst a plain timer measured alongside saw, and 20ms more.
	require.NotEmpty(t, after)
	require.NotEmpty(t, timerLate)
	slack := 20*time.Millisecond + timerLate[len(timerLate)-1]
	require.NoError(t, limitcheck.Windows(after, throttle.PerSecond(20, 0), slack))
}

// roundTripFunc is an http.RoundTripper.
type roundTripFunc func(*http.Request) (*http.Response, error)

func (f roundTripFunc) RoundTrip(r *http.Request) (*http.Response, error) { return f(r) }

func TestRun(t *testing.T) {
	var out syncBuffer
	// The embedded Redis runs its Lua in this busy test process (under
	// -race, slowly): a timeout that does not depend on its speed.
	require.NoError(t, run(context.Background(), []string{"-timeout", "10s"}, &out))
	require.Contains(t, out.String(), "429 Too Many Requests")
}

type syncBuffer struct {
	mu sync.Mutex
	b  []byte
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.b = append(s.b, p...)
	return len(p), nil
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return string(s.b)
}
