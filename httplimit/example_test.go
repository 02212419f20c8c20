package httplimit_test

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"

	"github.com/slotbook/slotbook/httplimit"
	"github.com/slotbook/slotbook/reserve"
	"github.com/slotbook/slotbook/throttle"
)

// A client of a partner API that answers its second request "429, retry
// after 30 s": the pause holds every process back, and a request that
// would have to wait past the limiter's max wait is not sent.
func Example() {
	mr, err := miniredis.Run() // any Redis will do; this one is embedded
	if err != nil {
		panic(err)
	}
	defer mr.Close()
	rdb := redis.NewClient(&redis.Options{Addr: mr.Addr(), ContextTimeoutEnabled: true})
	defer rdb.Close()
	// Ten seconds, not the default 50ms: the embedded Redis runs its Lua in
	// this busy test process, and an example's output must not depend on
	// its speed.
	eng, err := throttle.New(rdb, throttle.WithTimeout(10*time.Second))
	if err != nil {
		panic(err)
	}

	served := 0
	api := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if served++; served == 2 {
			w.Header().Set("Retry-After", "30")
			w.WriteHeader(http.StatusTooManyRequests)
		}
	}))
	defer api.Close()

	lim, err := reserve.New(eng, "partner", throttle.PerMinute(60, 5), reserve.WithMaxWait(5*time.Second))
	if err != nil {
		panic(err)
	}
	tr, err := httplimit.New(lim)
	if err != nil {
		panic(err)
	}
	client := &http.Client{Transport: tr}
	for i := 0; i < 3; i++ {
		resp, err := client.Get(api.URL)
		var notSent *httplimit.NotSentError
		switch {
		case errors.As(err, &notSent):
			d, _ := notSent.RetryAfter()
			fmt.Printf("not sent: retry in about %v\n", d.Round(10*time.Second))
		case err != nil:
			panic(err)
		default:
			resp.Body.Close()
			fmt.Println(resp.Status)
		}
	}
	st, err := lim.State(context.Background(), httplimit.ByHost(&http.Request{Host: api.Listener.Addr().String()}))
	if err != nil {
		panic(err)
	}
	fmt.Println("paused for about", st.Wait.Round(10*time.Second))
	// Output:
	// 200 OK
	// 429 Too Many Requests
	// not sent: retry in about 30s
	// paused for about 30s
}
