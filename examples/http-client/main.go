// Command http-client calls a third-party API through httplimit.Transport,
// an http.RoundTripper that takes a slot of a shared quota before each
// request. When the API answers 429 with Retry-After, every worker sharing
// the key pauses until then: the pause is kept in Redis, not in one
// process.
//
//	go run ./examples/http-client            # a local stand-in API and an embedded Redis
//	go run ./examples/http-client -redis redis://127.0.0.1:6379/0
package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"os/signal"
	"sync"
	"sync/atomic"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"

	"github.com/slotbook/slotbook/httplimit"
	"github.com/slotbook/slotbook/reserve"
	"github.com/slotbook/slotbook/throttle"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()
	if err := run(ctx, os.Args[1:], os.Stdout); err != nil {
		fmt.Fprintln(os.Stderr, "http-client:", err)
		os.Exit(1)
	}
}

func run(ctx context.Context, args []string, out io.Writer) error {
	fs := flag.NewFlagSet("http-client", flag.ContinueOnError)
	url := fs.String("redis", "", "Redis URL; empty: an embedded Redis")
	timeout := fs.Duration("timeout", throttle.DefaultTimeout, "bound on each Redis call")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if *url == "" {
		mr, err := miniredis.Run()
		if err != nil {
			return err
		}
		defer mr.Close()
		*url = "redis://" + mr.Addr()
	}
	opts, err := redis.ParseURL(*url)
	if err != nil {
		return err
	}
	opts.ContextTimeoutEnabled = true // so that slotbook's tight timeouts hold
	rdb := redis.NewClient(opts)
	defer rdb.Close()
	eng, err := throttle.New(rdb, throttle.WithTimeout(*timeout))
	if err != nil {
		return err
	}

	// A stand-in for the partner's API: it answers the 8th request with
	// "429, retry after 1 s".
	var served atomic.Int64
	api := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if served.Add(1) == 8 {
			w.Header().Set("Retry-After", "1")
			w.WriteHeader(http.StatusTooManyRequests)
			return
		}
		fmt.Fprintln(w, "ok")
	}))
	defer api.Close()

	// Three workers, as if in three processes: each its own limiter.
	start := time.Now()
	var mu sync.Mutex // guards out
	var wg sync.WaitGroup
	for w := 0; w < 3; w++ {
		lim, err := reserve.New(eng, "partner-api", throttle.PerSecond(8, 1))
		if err != nil {
			return err
		}
		tr, err := httplimit.New(lim) // keyed by host; pauses on 429 and 503 with Retry-After
		if err != nil {
			return err
		}
		client := &http.Client{Transport: tr}
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; i < 5; i++ {
				req, _ := http.NewRequestWithContext(ctx, http.MethodGet, api.URL, nil)
				resp, err := client.Do(req)
				mu.Lock()
				if err != nil {
					fmt.Fprintf(out, "worker %d: %v\n", w, err)
				} else {
					fmt.Fprintf(out, "worker %d: %s at %.2fs\n", w, resp.Status, time.Since(start).Seconds())
					resp.Body.Close()
				}
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
	return nil
}
