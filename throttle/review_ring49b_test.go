package throttle_test

// Review (helper-150) of 504e874: a breaker per Ring shard, "redis" while
// the Ring has no shard up, and sweepRing closing the breakers of shards
// the Ring's heartbeat marked down. Through the public API only: shards
// stopped and restarted, with the Ring's heartbeat short (keys move) and
// long (keys stay), every shard stopped, reserve's fallbacks, concurrent
// callers while shards flap, and the Redis calls a Ring call makes.

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/slotbook/slotbook/internal/redistest"
	"github.com/slotbook/slotbook/lease"
	"github.com/slotbook/slotbook/reserve"
	"github.com/slotbook/slotbook/throttle"
)

// r49bEvent is one breaker change as the observer was told of it: a
// node's (node set) or the engine-wide ObserveBreaker (node empty).
type r49bEvent struct {
	node string
	open bool
}

// r49bLog records node and engine-wide breaker changes in one list, in
// the order the engine told them (it tells both under one lock), and the
// outcome of the last decision.
type r49bLog struct {
	mu     sync.Mutex // guards events and last
	events []r49bEvent
	last   throttle.Outcome
	nDec   int
}

func (l *r49bLog) ObserveDecision(_ string, o throttle.Outcome, _ time.Duration) {
	l.mu.Lock()
	l.last, l.nDec = o, l.nDec+1
	l.mu.Unlock()
}
func (l *r49bLog) ObserveCall(string, time.Duration, error) {}
func (l *r49bLog) ObserveRefund(string, time.Duration)      {}
func (l *r49bLog) ObserveBreaker(open bool) {
	l.mu.Lock()
	l.events = append(l.events, r49bEvent{"", open})
	l.mu.Unlock()
}
func (l *r49bLog) ObserveNodeBreaker(node string, open bool) {
	l.mu.Lock()
	l.events = append(l.events, r49bEvent{node, open})
	l.mu.Unlock()
}

func (l *r49bLog) get() []r49bEvent {
	l.mu.Lock()
	defer l.mu.Unlock()
	return append([]r49bEvent(nil), l.events...)
}

// lastDecision returns the outcome of the last decision and how many
// were told so far.
func (l *r49bLog) lastDecision() (throttle.Outcome, int) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.last, l.nDec
}

// r49bCheck checks the log against the definition: each node's changes
// alternate, starting with an opening; ObserveBreaker(true) comes right
// after the opening that makes one breaker open of none, and
// ObserveBreaker(false) right after the closing that leaves none open,
// and at no other time. If closed, every breaker ends closed.
func r49bCheck(t *testing.T, ev []r49bEvent, closed bool) {
	t.Helper()
	open := map[string]bool{}
	n := 0
	for i := 0; i < len(ev); i++ {
		e := ev[i]
		require.NotEmpty(t, e.node, "event %d: an engine-wide change not right after a node's: %v", i, ev)
		require.NotEqual(t, open[e.node], e.open, "event %d: %s told %v twice in a row: %v", i, e.node, e.open, ev)
		open[e.node] = e.open
		before := n
		if e.open {
			n++
		} else {
			n--
		}
		if (before == 0 && n == 1) || (before == 1 && n == 0) {
			require.Less(t, i+1, len(ev), "event %d: the engine-wide change is missing: %v", i, ev)
			require.Equal(t, r49bEvent{"", n == 1}, ev[i+1], "event %d: the engine-wide change after it: %v", i, ev)
			i++
		}
	}
	if closed {
		require.Zero(t, n, "every breaker closed at the end: %v", ev)
	}
}

// r49bRing returns a Ring over the servers with the heartbeat given, and
// an engine over it with short probe intervals and obs.
func r49bRing(t *testing.T, hb time.Duration, obs throttle.Observer, srv ...*redistest.Server) (*redis.Ring, *throttle.Engine) {
	t.Helper()
	addrs := map[string]string{}
	for i, s := range srv {
		addrs["s"+strconv.Itoa(i)] = s.Addr
	}
	ring := redis.NewRing(&redis.RingOptions{Addrs: addrs, ContextTimeoutEnabled: true, MaxRetries: -1,
		HeartbeatFrequency: hb, DialTimeout: time.Second})
	t.Cleanup(func() { _ = ring.Close() })
	eng, err := throttle.New(ring, throttle.WithPrefix(redistest.Prefix(t)), throttle.WithTimeout(2*time.Second),
		throttle.WithProbeBackoff(25*time.Millisecond, 100*time.Millisecond), throttle.WithObserver(obs))
	require.NoError(t, err)
	return ring, eng
}

// r49bSubjectOn returns a subject key the engine (Engine.Node) places on
// the shard at addr, formed by form from a number.
func r49bSubjectOn(t *testing.T, eng *throttle.Engine, addr string, form func(int) string) int {
	t.Helper()
	for i := 0; i < 1000; i++ {
		if eng.Node(context.Background(), form(i)) == addr {
			return i
		}
	}
	t.Fatalf("no subject on %s", addr)
	return 0
}

func r49bKey(i int) string { return "r49b-" + strconv.Itoa(i) }

var r49bHeartbeats = []struct {
	name string
	hb   time.Duration
}{{"heartbeat long", time.Hour}, {"heartbeat short", 30 * time.Millisecond}}

// TestReviewRing49bRestart: a shard stopped and restarted, twice. With a
// long heartbeat its subjects fail with ErrUnavailable (the other shard's
// are served) until it answers again; with a short one they move to the
// other shard and back. Either way every call succeeds in the end, the
// engine is not unavailable, and the observer's changes alternate per
// node and pair engine-wide with the first opening and the last closing.
func TestReviewRing49bRestart(t *testing.T) {
	t.Parallel()
	for _, h := range r49bHeartbeats {
		t.Run(h.name, func(t *testing.T) {
			t.Parallel()
			a, b := redistest.Start(t), redistest.Start(t)
			log := &r49bLog{}
			_, eng := r49bRing(t, h.hb, log, a, b)
			ctx := context.Background()
			lim := throttle.PerSecond(1000, 1000)
			dead := r49bKey(r49bSubjectOn(t, eng, a.Addr, r49bKey))
			healthy := r49bKey(r49bSubjectOn(t, eng, b.Addr, r49bKey))
			for _, s := range []string{dead, healthy} {
				redistest.UntilOK(t, func() error { _, err := eng.Allow(ctx, s, lim); return err })
			}
			for round := 0; round < 2; round++ {
				a.Stop()
				if h.hb == time.Hour {
					_, err := eng.Allow(ctx, dead, lim)
					require.ErrorIs(t, err, throttle.ErrUnavailable, "round %d", round)
					for i := 0; i < 20; i++ {
						_, err := eng.Allow(ctx, healthy, lim)
						require.NoError(t, err, "round %d: call %d on the shard that answers", round, i)
					}
					open, _ := eng.UnavailableFor(ctx, dead)
					require.True(t, open, "round %d", round)
				} else {
					require.Eventually(t, func() bool {
						_, err := eng.Allow(ctx, dead, lim)
						return err == nil && eng.Node(ctx, dead) == b.Addr
					}, 10*time.Second, 10*time.Millisecond, "round %d: the stopped shard's subject served by the other", round)
				}
				a.Restart(t)
				require.Eventually(t, func() bool {
					_, err1 := eng.Allow(ctx, dead, lim)
					_, err2 := eng.Allow(ctx, healthy, lim)
					open, _ := eng.Unavailable()
					return err1 == nil && err2 == nil && !open && eng.Node(ctx, dead) == a.Addr
				}, 10*time.Second, 10*time.Millisecond, "round %d: served again, no breaker open", round)
			}
			for i := 0; i < 20; i++ {
				for _, s := range []string{dead, healthy} {
					_, err := eng.Allow(ctx, s, lim)
					require.NoError(t, err)
				}
			}
			open, _ := eng.Unavailable()
			require.False(t, open)
			r49bCheck(t, log.get(), true)
		})
	}
}

// TestReviewRing49bAllDown: every shard stopped, then restarted. Engine
// calls fail with ErrUnavailable, a Limiter with FailClosed answers from
// the fallback (a refusal, no error), and after the restart both are
// served by Redis again, no breaker left open.
func TestReviewRing49bAllDown(t *testing.T) {
	t.Parallel()
	for _, h := range r49bHeartbeats {
		t.Run(h.name, func(t *testing.T) {
			t.Parallel()
			a, b := redistest.Start(t), redistest.Start(t)
			log := &r49bLog{}
			_, eng := r49bRing(t, h.hb, log, a, b)
			ctx := context.Background()
			lim := throttle.PerSecond(1000, 1000)
			l, err := reserve.New(eng, "r49b", lim, reserve.WithFallback(reserve.FailClosed()))
			require.NoError(t, err)
			sub := func(i int) string { return "r49b:{" + strconv.Itoa(i) + "}" }
			subjects := []int{r49bSubjectOn(t, eng, a.Addr, sub), r49bSubjectOn(t, eng, b.Addr, sub)}
			for _, s := range subjects {
				redistest.UntilOK(t, func() error { _, err := l.Allow(ctx, strconv.Itoa(s)); return err })
				redistest.UntilOK(t, func() error { _, err := eng.Allow(ctx, r49bKey(s), lim); return err })
			}
			a.Stop()
			b.Stop()
			if h.hb != time.Hour {
				require.Eventually(t, func() bool { return eng.Node(ctx, r49bKey(0)) == "redis" },
					10*time.Second, 10*time.Millisecond, "every shard marked down")
			}
			for _, s := range subjects {
				require.Eventually(t, func() bool {
					_, err := eng.Allow(ctx, r49bKey(s), lim)
					return errors.Is(err, throttle.ErrUnavailable)
				}, 5*time.Second, 5*time.Millisecond)
				// The fallback answers once the call's node is known open.
				require.Eventually(t, func() bool {
					res, err := l.Allow(ctx, strconv.Itoa(s))
					o, _ := log.lastDecision()
					return err == nil && !res.Allowed && o == throttle.FallbackRefused
				}, 5*time.Second, 5*time.Millisecond, "subject %d: FailClosed answers", s)
				for i := 0; i < 10; i++ {
					_, err := eng.Allow(ctx, r49bKey(s), lim)
					require.ErrorIs(t, err, throttle.ErrUnavailable)
					res, err := l.Allow(ctx, strconv.Itoa(s))
					o, _ := log.lastDecision()
					require.NoError(t, err, "call %d", i)
					require.False(t, res.Allowed)
					require.Equal(t, throttle.FallbackRefused, o, "call %d", i)
				}
			}
			open, _ := eng.Unavailable()
			require.True(t, open)
			a.Restart(t)
			b.Restart(t)
			require.Eventually(t, func() bool {
				for _, s := range subjects {
					if _, err := eng.Allow(ctx, r49bKey(s), lim); err != nil {
						return false
					}
					res, err := l.Allow(ctx, strconv.Itoa(s))
					if o, _ := log.lastDecision(); err != nil || !res.Allowed || o != throttle.Allowed {
						return false
					}
				}
				open, _ := eng.Unavailable()
				return !open
			}, 10*time.Second, 10*time.Millisecond, "served again, no breaker open")
			r49bCheck(t, log.get(), true)
		})
	}
}

// TestReviewRing49bFallbackOneShard: one shard of two stopped (the Ring's
// heartbeat long, so its keys stay on it): only its subjects are answered
// by the fallback; the other shard's are decided by Redis, denials
// included, never by the fallback.
func TestReviewRing49bFallbackOneShard(t *testing.T) {
	t.Parallel()
	a, b := redistest.Start(t), redistest.Start(t)
	log := &r49bLog{}
	_, eng := r49bRing(t, time.Hour, log, a, b)
	ctx := context.Background()
	lim := throttle.PerHour(1, 1) // two pass, then a denial for an hour
	for _, fb := range []struct {
		name string
		f    reserve.Fallback
		want throttle.Outcome
	}{{"closed", reserve.FailClosed(), throttle.FallbackRefused}, {"open", reserve.FailOpen(), throttle.FallbackAllowed}} {
		a.Restart(t)
		l, err := reserve.New(eng, "r49b"+fb.name, lim, reserve.WithFallback(fb.f))
		require.NoError(t, err)
		onA := map[string]bool{}
		var keys []string
		for i := 0; i < 40; i++ {
			k := "k" + strconv.Itoa(i)
			keys = append(keys, k)
			onA[k] = eng.Node(ctx, "r49b"+fb.name+":{"+k+"}") == a.Addr
		}
		redistest.UntilOK(t, func() error { _, err := eng.Allow(ctx, "warm-"+fb.name, lim); return err })
		a.Stop()
		nA := 0
		for _, k := range keys {
			for call := 0; call < 3; call++ {
				res, err := l.Allow(ctx, k)
				o, _ := log.lastDecision()
				if onA[k] {
					// FailOpen limits each key locally to the full
					// limit: two pass, then a refusal.
					want := fb.want
					if call == 2 {
						want = throttle.FallbackRefused
					}
					require.NoError(t, err, "%s %s call %d", fb.name, k, call)
					require.Equal(t, want, o, "%s %s (stopped shard) call %d", fb.name, k, call)
					continue
				}
				require.NoError(t, err, "%s %s call %d", fb.name, k, call)
				want := throttle.Allowed
				if call == 2 {
					want = throttle.Denied
				}
				require.Equal(t, want, o, "%s %s (shard up) call %d: decided by Redis", fb.name, k, call)
				require.Equal(t, want == throttle.Allowed, res.Allowed)
			}
			if onA[k] {
				nA++
			}
		}
		require.Positive(t, nA)
		require.Less(t, nA, len(keys))
	}
	r49bCheck(t, log.get(), false)
}

// TestReviewRing49bFlap: callers on many goroutines (engine and Limiter
// calls, Unavailable, UnavailableFor, Node) while the Ring's two shards
// are stopped and restarted in turn, with a short heartbeat; run with
// -race. Calls fail only with ErrUnavailable (or are answered by the
// fallback), and once every shard is back, every subject is served, no
// breaker is left open, and the observer's log holds together.
func TestReviewRing49bFlap(t *testing.T) {
	t.Parallel()
	a, b := redistest.Start(t), redistest.Start(t)
	log := &r49bLog{}
	_, eng := r49bRing(t, 20*time.Millisecond, log, a, b)
	ctx := context.Background()
	lim := throttle.PerSecond(1000, 1000)
	l, err := reserve.New(eng, "r49bf", lim, reserve.WithFallback(reserve.FailOpen()), reserve.WithMaxWait(time.Second))
	require.NoError(t, err)
	for i := 0; i < 8; i++ {
		redistest.UntilOK(t, func() error { _, err := eng.Allow(ctx, r49bKey(i), lim); return err })
	}
	stop := make(chan struct{})
	var wg sync.WaitGroup
	var bad atomic.Value
	var calls, fails atomic.Int64
	for g := 0; g < 12; g++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				select {
				case <-stop:
					return
				default:
				}
				k := rand.IntN(64)
				var err error
				switch g % 4 {
				case 0:
					_, err = eng.Allow(ctx, r49bKey(k), lim)
				case 1:
					_, err = l.Allow(ctx, strconv.Itoa(k))
				case 2:
					var r *reserve.Reservation
					if r, err = l.Reserve(ctx, strconv.Itoa(k)); err == nil {
						_ = r.Cancel(ctx)
					}
				case 3:
					eng.Unavailable()
					eng.UnavailableFor(ctx, r49bKey(k))
					if n := eng.Node(ctx, r49bKey(k)); n != a.Addr && n != b.Addr && n != "redis" {
						bad.Store(fmt.Errorf("node %q", n))
					}
					time.Sleep(time.Millisecond)
				}
				calls.Add(1)
				if err != nil {
					fails.Add(1)
					if !errors.Is(err, throttle.ErrUnavailable) {
						bad.Store(err)
					}
				}
			}
		}()
	}
	for round := 0; round < 3; round++ {
		for _, s := range []*redistest.Server{a, b} {
			s.Stop()
			time.Sleep(150 * time.Millisecond)
		}
		time.Sleep(150 * time.Millisecond) // both down
		for _, s := range []*redistest.Server{a, b} {
			s.Restart(t)
			time.Sleep(150 * time.Millisecond)
		}
	}
	close(stop)
	wg.Wait()
	t.Logf("calls %d, failed %d", calls.Load(), fails.Load())
	if err, _ := bad.Load().(error); err != nil {
		require.NoError(t, err, "a call failed otherwise than as unavailable")
	}
	require.Eventually(t, func() bool {
		for k := 0; k < 64; k++ {
			if _, err := eng.Allow(ctx, r49bKey(k), lim); err != nil {
				return false
			}
		}
		open, _ := eng.Unavailable()
		return !open
	}, 10*time.Second, 20*time.Millisecond, "served again, no breaker open")
	r49bCheck(t, log.get(), true)
}

// r49bCounter counts, per client, the commands other than the heartbeat's
// PING that go through it.
type r49bCounter struct {
	mu sync.Mutex
	n  map[string]int
}

func (c *r49bCounter) hook(name string) redis.Hook { return r49bHook{c, name} }

func (c *r49bCounter) get(name string) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.n[name]
}

type r49bHook struct {
	c    *r49bCounter
	name string
}

func (h r49bHook) DialHook(next redis.DialHook) redis.DialHook { return next }
func (h r49bHook) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		if !strings.EqualFold(cmd.Name(), "ping") {
			h.c.mu.Lock()
			h.c.n[h.name]++
			h.c.mu.Unlock()
		}
		return next(ctx, cmd)
	}
}
func (h r49bHook) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		h.c.mu.Lock()
		h.c.n[h.name] += 100000 // no pipeline expected
		h.c.mu.Unlock()
		return next(ctx, cmds)
	}
}

// TestReviewRing49bCalls: a Ring call is one command, on the Ring and on
// the shard its key goes to, with every breaker closed and with one
// shard's open (the sweeps make none).
func TestReviewRing49bCalls(t *testing.T) {
	t.Parallel()
	a, b := redistest.Start(t), redistest.Start(t)
	cnt := &r49bCounter{n: map[string]int{}}
	ring := redis.NewRing(&redis.RingOptions{
		Addrs:                 map[string]string{"a": a.Addr, "b": b.Addr},
		ContextTimeoutEnabled: true, MaxRetries: -1, HeartbeatFrequency: time.Hour,
		NewClient: func(o *redis.Options) *redis.Client {
			c := redis.NewClient(o)
			c.AddHook(cnt.hook(o.Addr))
			return c
		},
	})
	t.Cleanup(func() { _ = ring.Close() })
	ring.AddHook(cnt.hook("ring"))
	eng, err := throttle.New(ring, throttle.WithPrefix(redistest.Prefix(t)), throttle.WithTimeout(2*time.Second),
		throttle.WithProbeBackoff(5*time.Millisecond, 10*time.Millisecond))
	require.NoError(t, err)
	ctx := context.Background()
	lim := throttle.PerSecond(1000, 1000)
	onA := r49bKey(r49bSubjectOn(t, eng, a.Addr, r49bKey))
	onB := r49bKey(r49bSubjectOn(t, eng, b.Addr, r49bKey))
	for _, k := range []string{onA, onB} {
		redistest.UntilOK(t, func() error { _, err := eng.Allow(ctx, k, lim); return err })
	}
	r0, a0, b0 := cnt.get("ring"), cnt.get(a.Addr), cnt.get(b.Addr)
	for i := 0; i < 50; i++ {
		for _, k := range []string{onA, onB} {
			_, err := eng.Allow(ctx, k, lim)
			require.NoError(t, err)
		}
	}
	require.Equal(t, 100, cnt.get("ring")-r0, "Ring commands for 100 calls")
	require.Equal(t, 50, cnt.get(a.Addr)-a0, "shard a's commands for 50 calls")
	require.Equal(t, 50, cnt.get(b.Addr)-b0, "shard b's commands for 50 calls")

	a.Stop()
	_, err = eng.Allow(ctx, onA, lim)
	require.ErrorIs(t, err, throttle.ErrUnavailable)
	b1 := cnt.get(b.Addr)
	for i := 0; i < 50; i++ {
		_, err := eng.Allow(ctx, onB, lim)
		require.NoError(t, err)
		_, _ = eng.Allow(ctx, onA, lim) // fails fast, or probes a
		time.Sleep(time.Millisecond)    // let sweeps fall due
	}
	require.Equal(t, 50, cnt.get(b.Addr)-b1, "shard b's commands for 50 calls while a's breaker is open")
}

// TestReviewRing49bLease: a Semaphore of one over a Ring of two shards,
// one stopped (the Ring's heartbeat long, so its keys stay on it). A
// subject on the shard that answers is taken and given back, again and
// again, each release reaching Redis at once (the next TryAcquire gets
// it); a subject on the stopped shard fails with ErrUnavailable; once
// the shard is back, its subject is served too, and no breaker is open.
func TestReviewRing49bLease(t *testing.T) {
	t.Parallel()
	a, b := redistest.Start(t), redistest.Start(t)
	log := &r49bLog{}
	_, eng := r49bRing(t, time.Hour, log, a, b)
	ctx := context.Background()
	sem, err := lease.New(eng, "r49bl", 1, lease.WithTTL(time.Minute))
	require.NoError(t, err)
	t.Cleanup(func() {
		cctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		defer cancel()
		_ = sem.Close(cctx)
	})
	sub := func(i int) string { return "r49bl:{" + strconv.Itoa(i) + "}:lease:h" }
	onA := strconv.Itoa(r49bSubjectOn(t, eng, a.Addr, sub))
	onB := strconv.Itoa(r49bSubjectOn(t, eng, b.Addr, sub))
	cycle := func(key string) error {
		l, ok, err := sem.TryAcquire(ctx, key)
		if err != nil {
			return err
		}
		if !ok {
			return fmt.Errorf("%s: not free", key)
		}
		return l.Release(ctx)
	}
	for _, k := range []string{onA, onB} {
		redistest.UntilOK(t, func() error { return cycle(k) })
	}
	a.Stop()
	for i := 0; i < 20; i++ {
		require.NoError(t, cycle(onB), "cycle %d on the shard that answers", i)
		_, _, err := sem.TryAcquire(ctx, onA)
		require.ErrorIs(t, err, throttle.ErrUnavailable, "cycle %d on the stopped shard", i)
	}
	a.Restart(t)
	require.Eventually(t, func() bool {
		open, _ := eng.Unavailable()
		return cycle(onA) == nil && cycle(onB) == nil && !open
	}, 10*time.Second, 10*time.Millisecond)
	for i := 0; i < 10; i++ {
		require.NoError(t, cycle(onA))
		require.NoError(t, cycle(onB))
	}
	r49bCheck(t, log.get(), true)
}

// TestReviewRing49bPausedAndRemoved: a shard paused (SIGSTOP: calls to it
// hang until the timeout) with a short heartbeat: its subjects move to
// the other shard, no breaker stays open, and they move back once it is
// resumed. Then a shard stopped and removed from the Ring (SetAddrs): its
// open breaker, which no call reaches any more, is closed.
func TestReviewRing49bPausedAndRemoved(t *testing.T) {
	t.Parallel()
	a, b := redistest.Start(t), redistest.Start(t)
	log := &r49bLog{}
	ring := redis.NewRing(&redis.RingOptions{Addrs: map[string]string{"a": a.Addr, "b": b.Addr},
		ContextTimeoutEnabled: true, MaxRetries: -1, HeartbeatFrequency: 30 * time.Millisecond,
		DialTimeout: 200 * time.Millisecond, ReadTimeout: 200 * time.Millisecond, WriteTimeout: 200 * time.Millisecond})
	t.Cleanup(func() { _ = ring.Close() })
	eng, err := throttle.New(ring, throttle.WithPrefix(redistest.Prefix(t)), throttle.WithTimeout(300*time.Millisecond),
		throttle.WithProbeBackoff(25*time.Millisecond, 100*time.Millisecond), throttle.WithObserver(log))
	require.NoError(t, err)
	ctx := context.Background()
	lim := throttle.PerSecond(1000, 1000)
	dead := r49bKey(r49bSubjectOn(t, eng, a.Addr, r49bKey))
	healthy := r49bKey(r49bSubjectOn(t, eng, b.Addr, r49bKey))
	for _, s := range []string{dead, healthy} {
		redistest.UntilOK(t, func() error { _, err := eng.Allow(ctx, s, lim); return err })
	}
	pid := a.Pid()
	require.NotZero(t, pid)
	require.NoError(t, syscall.Kill(pid, syscall.SIGSTOP))
	resumed := false
	t.Cleanup(func() {
		if !resumed {
			_ = syscall.Kill(pid, syscall.SIGCONT)
		}
	})
	_, err = eng.Allow(ctx, dead, lim)
	require.ErrorIs(t, err, throttle.ErrUnavailable)
	require.Eventually(t, func() bool {
		_, err := eng.Allow(ctx, dead, lim)
		open, _ := eng.Unavailable()
		return err == nil && !open && eng.Node(ctx, dead) == b.Addr
	}, 20*time.Second, 10*time.Millisecond, "the paused shard's subject served by the other, no breaker open")
	require.NoError(t, syscall.Kill(pid, syscall.SIGCONT))
	resumed = true
	require.Eventually(t, func() bool {
		_, err := eng.Allow(ctx, dead, lim)
		open, _ := eng.Unavailable()
		return err == nil && !open && eng.Node(ctx, dead) == a.Addr
	}, 20*time.Second, 10*time.Millisecond, "back on the resumed shard, no breaker open")
	r49bCheck(t, log.get(), true)

	// Removed: a stopped, its breaker open, then the Ring is given b alone.
	a.Stop()
	require.Eventually(t, func() bool {
		_, err := eng.Allow(ctx, dead, lim)
		open, _ := eng.UnavailableFor(ctx, dead)
		return errors.Is(err, throttle.ErrUnavailable) && open
	}, 5*time.Second, time.Millisecond, "a's breaker open before the heartbeat marks it down")
	ring.SetAddrs(map[string]string{"b": b.Addr})
	require.Eventually(t, func() bool {
		_, err := eng.Allow(ctx, dead, lim)
		open, _ := eng.Unavailable()
		return err == nil && !open && eng.Node(ctx, dead) == b.Addr
	}, 10*time.Second, 10*time.Millisecond, "a removed: its breaker closed")
	r49bCheck(t, log.get(), true)
}
