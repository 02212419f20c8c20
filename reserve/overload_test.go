package reserve_test

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/slotbook/slotbook/internal/redistest"
	"github.com/slotbook/slotbook/reserve"
	"github.com/slotbook/slotbook/throttle"
)

// TestOverloadKeepsTheLimit: a client saturated by its own callers (1,000
// goroutines calling Allow every 10ms on one key, far more than its
// connection pool serves within the engine's 50ms timeout) is not Redis
// being down: callers queue for a connection instead of timing out, the
// breaker does not open wholesale, and FailOpen, should it answer at all,
// admits no more than the limit per process. Without a fallback the limit
// holds too. How many calls fail is logged; in how many spans of the run
// some failed is judged against a control (below): a machine busy enough to
// starve the goroutine reading a reply for 50ms times calls out whatever
// the engine does.
func TestOverloadKeepsTheLimit(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t) // a server of its own: the load would slow other tests' calls
	limit := throttle.PerSecond(10, 5)
	// run returns, beside the counts, in how many of the run's 100ms
	// spans some call failed: a call that fails returns at once and its
	// caller soon calls again, so the count of failed calls measures how
	// fast callers spin, while the spans say how long they were failed.
	//
	// A control runs beside the callers: a bare PING on a client of its
	// own every 5ms. A span in which one took half the engine's timeout
	// (25ms) or failed was slow for any call, whatever the engine does (the
	// machine starving this process or the server: two suites beside this
	// one did, and calls failed in 9 to 13 of the 15 spans), so failed
	// calls are judged only in the spans the control found fast.
	const spans = 15
	run := func(t *testing.T, opts ...reserve.Option) (allowed, calls, failed int64, failing, slow int, elapsed time.Duration) {
		obs := &outcomes{}
		defer func() { t.Logf("outcomes %v", obs) }()
		eng, err := throttle.New(srv.Client(t), throttle.WithPrefix(redistest.Prefix(t)), throttle.WithObserver(obs))
		require.NoError(t, err)
		l, err := reserve.New(eng, "api", limit, opts...)
		require.NoError(t, err)
		var a, c, f atomic.Int64
		var failedIn, slowIn [spans + 1]atomic.Bool
		var wg sync.WaitGroup
		start := time.Now()
		stop := start.Add(spans * 100 * time.Millisecond)
		span := func(at time.Time) int { return min(int(at.Sub(start)/(100*time.Millisecond)), spans) }
		control := srv.Client(t)
		require.NoError(t, control.Ping(context.Background()).Err())
		wg.Add(1)
		go func() {
			defer wg.Done()
			for time.Now().Before(stop) {
				t0 := time.Now()
				err := control.Ping(context.Background()).Err()
				if t1 := time.Now(); err != nil || t1.Sub(t0) > 25*time.Millisecond {
					slowIn[span(t0)].Store(true)
					slowIn[span(t1)].Store(true)
				}
				time.Sleep(5 * time.Millisecond)
			}
		}()
		for g := 0; g < 1000; g++ {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for time.Now().Before(stop) {
					r, err := l.Allow(context.Background(), "k")
					c.Add(1)
					switch {
					case err != nil:
						f.Add(1)
						failedIn[span(time.Now())].Store(true)
					case r.Allowed:
						a.Add(1)
					}
					time.Sleep(10 * time.Millisecond)
				}
			}()
		}
		wg.Wait()
		for i := range failedIn {
			switch {
			case slowIn[i].Load():
				slow++
			case failedIn[i].Load():
				failing++
			}
		}
		return a.Load(), c.Load(), f.Load(), failing, slow, time.Since(start)
	}
	// What the limit lets through in elapsed, on the Redis clock or on this
	// process's own when FailOpen answers: each at most rate*elapsed+burst+1.
	bound := func(elapsed time.Duration) int64 {
		return int64(elapsed.Seconds()*float64(limit.Rate)) + int64(limit.Burst) + 2
	}

	t.Run("fail open", func(t *testing.T) {
		allowed, calls, failed, failing, slow, elapsed := run(t, reserve.WithFallback(reserve.FailOpen()))
		t.Logf("fail open: %d allowed of %d calls (%d failed, in %d of the %d spans of 100ms the control found fast; %d slow) in %v",
			allowed, calls, failed, failing, spans+1-slow, slow, elapsed)
		// A call the client itself could not serve (no connection in
		// time, the breaker closed) fails rather than go to the fallback,
		// which would admit on top of Redis: now and then, never wholesale.
		require.LessOrEqual(t, allowed, 2*bound(elapsed), "Redis's share and at most one local limit's worth while the breaker is open")
		require.GreaterOrEqual(t, allowed, int64(limit.Burst+1), "the limit still lets its burst through")
		judgeFailing(t, failing, slow, spans+1)
	})
	t.Run("no fallback", func(t *testing.T) {
		allowed, calls, failed, failing, slow, elapsed := run(t)
		t.Logf("no fallback: %d allowed of %d calls (%d failed, in %d of the %d spans of 100ms the control found fast; %d slow) in %v",
			allowed, calls, failed, failing, spans+1-slow, slow, elapsed)
		require.LessOrEqual(t, allowed, bound(elapsed))
		judgeFailing(t, failing, slow, spans+1)
	})
}

// judgeFailing judges TestOverloadKeepsTheLimit's spans (buckets of them:
// the run's, and the one its last calls end in) with failed calls: at
// most half the spans the control found fast. With fewer than half of
// them fast, the machine was too slow to tell anything: inconclusive.
func judgeFailing(t *testing.T, failing, slow, buckets int) {
	t.Helper()
	fast := buckets - slow
	if 2*fast < buckets {
		t.Skipf("the control found only %d of %d spans fast (the limit's bounds held): inconclusive", fast, buckets)
	}
	require.LessOrEqual(t, 2*failing, fast, "calls failed in at most half the spans the control found fast")
}

// outcomes counts an engine's decisions by outcome, and its breaker's
// openings.
type outcomes struct {
	n     [throttle.FallbackRefused + 1]atomic.Int64
	opens atomic.Int64
}

func (o *outcomes) ObserveDecision(_ string, oc throttle.Outcome, _ time.Duration) { o.n[oc].Add(1) }
func (o *outcomes) ObserveCall(string, time.Duration, error)                       {}
func (o *outcomes) ObserveRefund(string, time.Duration)                            {}
func (o *outcomes) ObserveBreaker(open bool) {
	if open {
		o.opens.Add(1)
	}
}

func (o *outcomes) String() string {
	var b strings.Builder
	for i := range o.n {
		fmt.Fprintf(&b, "%v %d, ", throttle.Outcome(i), o.n[i].Load())
	}
	fmt.Fprintf(&b, "breaker opened %d times", o.opens.Load())
	return b.String()
}
