package throttle_test

// Review of 62f67bf (helper-139): Engine.RunScriptPastBreaker, a call the
// node's open breaker does not refuse. Side paths: bypass calls beside
// ordinary calls and the breaker's probes, while Redis is stopped or
// paused, some of them ended early by their context (while queued for a
// connection, or out); on a plain client and on a Cluster with one master
// paused.

import (
	"context"
	"errors"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/slotbook/slotbook/internal/redistest"
	"github.com/slotbook/slotbook/throttle"
)

// pbOutcome is what one scene of TestReviewPastBreakerOutage saw.
type pbOutcome struct {
	calls, bypass     int64 // calls made during the outage (ordinary, past the breaker)
	succeeded         int64 // calls that succeeded during the outage
	closedSeen        int64 // samples of the node's breaker closed, once open, during the outage
	samples           int64
	recovered         time.Duration // from Redis back to an ordinary call's success
	refusedAfter      int           // ordinary calls failed with a refused connection once Redis listened again
	openAfterRecovery bool          // the breaker once an ordinary call succeeded
}

// pbLoad runs ordinary calls (and, if bypass, calls past the breaker, a
// third of them with a context of 1 to 60 ms) on key from g goroutines
// each until stop is closed; once the first call has failed and settle
// has passed, it samples open() every millisecond. It returns when every
// goroutine has.
func pbLoad(eng *throttle.Engine, key string, g int, bypass bool, settle time.Duration, open func() bool, stop <-chan struct{}) (o pbOutcome) {
	ctx := context.Background()
	incr := throttle.NewScript(`return redis.call('INCR', KEYS[1])`)
	var calls, bcalls, ok, closed, samples atomic.Int64
	var firstFail atomic.Int64 // unix nanos of the first failure
	var wg sync.WaitGroup
	call := func(past bool) {
		c := ctx
		if past && rand.IntN(3) == 0 {
			var cancel context.CancelFunc
			c, cancel = context.WithTimeout(ctx, time.Duration(1+rand.IntN(60))*time.Millisecond)
			defer cancel()
		}
		var err error
		if past {
			bcalls.Add(1)
			_, err = eng.RunScriptPastBreaker(c, incr, []string{key})
		} else {
			calls.Add(1)
			_, err = eng.RunScript(c, incr, []string{key})
		}
		if err == nil {
			ok.Add(1)
		} else {
			firstFail.CompareAndSwap(0, time.Now().UnixNano())
		}
	}
	for range g {
		wg.Go(func() {
			for {
				select {
				case <-stop:
					return
				default:
				}
				call(false)
				time.Sleep(time.Millisecond)
			}
		})
		if bypass {
			wg.Go(func() {
				for {
					select {
					case <-stop:
						return
					default:
					}
					call(true)
					time.Sleep(time.Millisecond)
				}
			})
		}
	}
	wg.Go(func() {
		for {
			select {
			case <-stop:
				return
			case <-time.After(time.Millisecond):
			}
			f := firstFail.Load()
			if f == 0 || time.Since(time.Unix(0, f)) < settle {
				continue
			}
			samples.Add(1)
			if !open() {
				closed.Add(1)
			}
		}
	})
	wg.Wait()
	return pbOutcome{calls: calls.Load(), bypass: bcalls.Load(), succeeded: ok.Load(), closedSeen: closed.Load(), samples: samples.Load()}
}

// pbRecover makes ordinary calls on key until one succeeds (at most 10 s)
// and returns how long that took, and how many of them failed with a
// refused connection (Redis listening again: a dial error the client
// reports without dialing).
func pbRecover(t *testing.T, eng *throttle.Engine, key string) (took time.Duration, refused int) {
	t.Helper()
	incr := throttle.NewScript(`return redis.call('INCR', KEYS[1])`)
	start := time.Now()
	for {
		_, err := eng.RunScript(context.Background(), incr, []string{key})
		if err == nil {
			return time.Since(start), refused
		}
		if errors.Is(err, syscall.ECONNREFUSED) {
			refused++
		}
		if time.Since(start) > 10*time.Second {
			t.Fatalf("no ordinary call succeeded within 10 s of Redis coming back: %v", err)
		}
		time.Sleep(time.Millisecond)
	}
}

// TestReviewPastBreakerOutage: an engine (timeout 50 ms, the default
// probe backoff) calls one key from four goroutines of ordinary calls
// (RunScript) and, but for the control, four of calls past the breaker
// (RunScriptPastBreaker, a third of them ended by a context of 1 to
// 60 ms: queued for a connection, or out, or the probe), for 1 s while
// Redis is stopped (Stop, then Restart) or paused (SIGSTOP, then
// SIGCONT). RunScriptPastBreaker's doc: "Redis's answer, or a failure,
// is told to the breaker as any call's (an answer closes it)"; the
// engine's: "a probe restores Redis as soon as it answers".
//
// Checks: no call succeeds while Redis is down; the breaker, once open
// (200 ms after the first failure), is never seen closed while Redis is
// down; once Redis is back, an ordinary call (the calls past the breaker
// stopped) succeeds within the longest probe interval and a second of
// the control's time (a probe flag left set, or a probe never let
// through, would refuse them for good; the times are logged), and no
// ordinary call fails then
// with a refused connection (Redis listens: that is the client's own
// dial lockout, go-redis's pool failing every dial at once after
// PoolSize dial errors in a row until its background dial, once a
// second, succeeds); and the breaker is closed then. The design: "A
// breaker stops every call from paying the timeout; a probe restores
// Redis as soon as it answers."
func TestReviewPastBreakerOutage(t *testing.T) {
	t.Parallel()
	run := func(t *testing.T, paused, bypass bool) pbOutcome {
		srv := redistest.Start(t)
		rdb := srv.Client(t)
		eng, err := throttle.New(rdb, throttle.WithPrefix(redistest.Prefix(t)))
		require.NoError(t, err)
		incr := throttle.NewScript(`return redis.call('INCR', KEYS[1])`)
		redistest.UntilOK(t, func() error { _, err := eng.RunScript(context.Background(), incr, []string{"pb"}); return err })
		pid := srv.Pid()
		if paused {
			require.NoError(t, syscall.Kill(pid, syscall.SIGSTOP))
		} else {
			srv.Stop()
		}
		stop := make(chan struct{})
		time.AfterFunc(time.Second, func() { close(stop) })
		o := pbLoad(eng, "pb", 4, bypass, 200*time.Millisecond, func() bool { open, _ := eng.Unavailable(); return open }, stop)
		if paused {
			require.NoError(t, syscall.Kill(pid, syscall.SIGCONT))
		} else {
			srv.Restart(t)
		}
		o.recovered, o.refusedAfter = pbRecover(t, eng, "pb")
		o.openAfterRecovery, _ = eng.Unavailable()
		return o
	}
	for _, paused := range []bool{false, true} {
		var control time.Duration
		for _, bypass := range []bool{false, true} {
			o := run(t, paused, bypass)
			t.Logf("paused %v, past the breaker %v: %d ordinary calls, %d past the breaker, %d succeeded during the outage; breaker seen closed %d of %d samples; an ordinary call succeeded %v after Redis came back (breaker open then: %v), %d failed before with a refused connection",
				paused, bypass, o.calls, o.bypass, o.succeeded, o.closedSeen, o.samples, o.recovered, o.openAfterRecovery, o.refusedAfter)
			assert.Zero(t, o.succeeded, "paused %v, bypass %v: calls succeeded while Redis was down", paused, bypass)
			assert.Positive(t, o.samples)
			assert.Zero(t, o.closedSeen, "paused %v, bypass %v: the breaker seen closed while Redis was down", paused, bypass)
			assert.False(t, o.openAfterRecovery, "paused %v, bypass %v: breaker open once an ordinary call succeeded", paused, bypass)
			assert.Zero(t, o.refusedAfter, "paused %v, bypass %v: ordinary calls failed with a refused connection once Redis listened again (the client's own dial lockout: go-redis fails every dial at once after PoolSize dial errors in a row, until a dial it retries every second succeeds)", paused, bypass)
			if !bypass {
				control = o.recovered
			} else {
				assert.Less(t, o.recovered, control+throttle.DefaultProbeMax+time.Second, "paused %v: recovery with calls past the breaker against the control's %v", paused, control)
			}
		}
	}
}

// TestReviewPastBreakerClusterPaused: a 3-master Cluster; one master is
// paused (SIGSTOP) for 1 s while four goroutines make ordinary calls and
// four calls past the breaker on a key it owns, and four ordinary calls
// on a key of another master. Checks: the other master's key is served
// meanwhile (its breaker stays closed); no call on the paused master's
// key succeeds; its breaker, once open, is never seen closed while it is
// paused; once it resumes, an ordinary call on its key succeeds within
// the longest probe interval and a second.
func TestReviewPastBreakerClusterPaused(t *testing.T) {
	t.Parallel()
	cl := redistest.StartCluster(t, 3)
	cc := cl.Client(t)
	eng, err := throttle.New(cc, throttle.WithPrefix(redistest.Prefix(t)))
	require.NoError(t, err)
	ctx := context.Background()
	incr := throttle.NewScript(`return redis.call('INCR', KEYS[1])`)
	// A key of node 0, and one of another node.
	var mine, other string
	for i := 0; mine == "" || other == ""; i++ {
		k := "{pb" + string(rune('a'+i%26)) + string(rune('a'+i/26)) + "}"
		m, err := cc.MasterForKey(ctx, eng.Prefix()+k)
		require.NoError(t, err)
		if m.Options().Addr == cl.Addrs[0] {
			if mine == "" {
				mine = k
			}
		} else if other == "" {
			other = k
		}
	}
	for _, k := range []string{mine, other} {
		redistest.UntilOK(t, func() error { _, err := eng.RunScript(ctx, incr, []string{k}); return err })
	}
	pid := cl.Node(0).Pid()
	require.NoError(t, syscall.Kill(pid, syscall.SIGSTOP))
	resumed := false
	defer func() {
		if !resumed {
			_ = syscall.Kill(pid, syscall.SIGCONT)
		}
	}()
	stop := make(chan struct{})
	time.AfterFunc(time.Second, func() { close(stop) })
	var otherOK, otherFail atomic.Int64
	var owg sync.WaitGroup
	for range 4 {
		owg.Go(func() {
			for {
				select {
				case <-stop:
					return
				default:
				}
				if _, err := eng.RunScript(ctx, incr, []string{other}); err == nil {
					otherOK.Add(1)
				} else {
					otherFail.Add(1)
				}
				time.Sleep(time.Millisecond)
			}
		})
	}
	o := pbLoad(eng, mine, 4, true, 200*time.Millisecond, func() bool { open, _ := eng.UnavailableFor(ctx, mine); return open }, stop)
	owg.Wait()
	otherOpen, _ := eng.UnavailableFor(ctx, other)
	require.NoError(t, syscall.Kill(pid, syscall.SIGCONT))
	resumed = true
	o.recovered, o.refusedAfter = pbRecover(t, eng, mine)
	t.Logf("paused master: %d ordinary calls, %d past the breaker, %d succeeded; its breaker seen closed %d of %d samples; an ordinary call succeeded %v after it resumed. Other master: %d calls served, %d failed, breaker open %v",
		o.calls, o.bypass, o.succeeded, o.closedSeen, o.samples, o.recovered, otherOK.Load(), otherFail.Load(), otherOpen)
	assert.Zero(t, o.succeeded, "calls on the paused master's key succeeded")
	assert.Positive(t, o.samples)
	assert.Zero(t, o.closedSeen, "the paused master's breaker seen closed while it was paused")
	assert.Positive(t, otherOK.Load(), "the other master's key was not served")
	assert.False(t, otherOpen, "the other master's breaker")
	assert.Less(t, o.recovered, throttle.DefaultProbeMax+time.Second, "recovery of the paused master's key")
}
