package main

import (
	"context"
	"net/http"
	"net/http/httptest"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/slotbook/slotbook/internal/limitcheck"
	"github.com/slotbook/slotbook/internal/redistest"
	"github.com/slotbook/slotbook/reserve"
	"github.com/slotbook/slotbook/throttle"
)

func TestMain(m *testing.M) { redistest.Main(m) }

// TestTransport: three workers with limiters of their own share one quota
// through Redis; after the API's 429 with Retry-After: 1, no new booking
// reaches the API for a second. A request already booked before the 429
// still goes at its slot: at most one for each other worker.
func TestTransport(t *testing.T) {
	srv := redistest.Shared(t)
	eng, err := throttle.New(srv.Client(t), throttle.WithPrefix(redistest.Prefix(t)), throttle.WithTimeout(5*time.Second))
	require.NoError(t, err)

	var (
		mu       sync.Mutex // guards arrivals and limited
		arrivals []time.Time
		limited  time.Time
	)
	api := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		defer mu.Unlock()
		arrivals = append(arrivals, time.Now())
		if len(arrivals) == 6 {
			limited = time.Now()
			w.Header().Set("Retry-After", "1")
			w.WriteHeader(http.StatusTooManyRequests)
		}
	}))
	defer api.Close()

	limit := throttle.PerSecond(20, 1)
	var wg sync.WaitGroup
	statuses := make(chan int, 64)
	for w := 0; w < 3; w++ {
		lim, err := reserve.New(eng, "api", limit)
		require.NoError(t, err)
		client := &http.Client{Transport: &Transport{Limiter: lim}}
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; i < 6; i++ {
				req, _ := http.NewRequestWithContext(context.Background(), http.MethodGet, api.URL, nil)
				resp, err := client.Do(req)
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
	require.Len(t, arrivals, 18)
	during := 0
	for _, a := range arrivals {
		if a.After(limited) && a.Sub(limited) < 995*time.Millisecond {
			during++
		}
	}
	require.LessOrEqual(t, during, 2, "only requests booked before the 429 reach the API during the pause")
	// After the pause, requests resume one interval (50ms) apart, not in a
	// burst: one slot at the end of the pause, then 50ms apart (allowing
	// 20ms for each request to travel after its slot).
	var after []time.Time
	for _, a := range arrivals {
		if a.Sub(limited) >= 995*time.Millisecond {
			after = append(after, a)
		}
	}
	require.NotEmpty(t, after)
	require.NoError(t, limitcheck.Windows(after, throttle.PerSecond(20, 0), 20*time.Millisecond))
}

func TestRetryAfter(t *testing.T) {
	now := time.Date(2026, 12, 2, 12, 0, 0, 0, time.UTC)
	for v, want := range map[string]time.Duration{
		"3":                             3 * time.Second,
		"0":                             0,
		"Wed, 02 Dec 2026 12:00:10 GMT": 10 * time.Second,
		"Wed, 02 Dec 2026 11:59:00 GMT": 0,
	} {
		got, ok := retryAfter(v, now)
		require.True(t, ok, v)
		require.Equal(t, want, got, v)
	}
	for _, v := range []string{"", "soon", "-1"} {
		_, ok := retryAfter(v, now)
		require.False(t, ok, v)
	}
}

func TestRun(t *testing.T) {
	var out syncBuffer
	require.NoError(t, run(context.Background(), nil, &out))
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
