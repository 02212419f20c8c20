package reserve_test

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"runtime"
	"sort"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/slotbook/slotbook/internal/callcount"
	"github.com/slotbook/slotbook/internal/redistest"
	"github.com/slotbook/slotbook/reserve"
	"github.com/slotbook/slotbook/throttle"
)

// Review of e42cdb8, "check mode reads its reply past the caller's deadline
// and gives back what it counted", through the public API.
//
// Oracle: a textbook GCRA written here (adlGCRA), under limits of one unit
// an hour or a day, so that nothing drains during a test: the room of a
// key is Burst+1 minus the units that stand in front of it, measured by
// admission (adlRoom allows one unit at a time until denied, on an engine
// straight to Redis).

// adlGCRA is the textbook GCRA (virtual scheduling) of one key: a request
// of n units at now passes iff max(tat, now) + (n-1)*I - tau <= now, and
// then tat = max(tat, now) + n*I. Times are microseconds.
type adlGCRA struct{ tat, I, tau int64 }

func newADLGCRA(l throttle.Limit) *adlGCRA {
	I := int64(l.Interval() / time.Microsecond)
	return &adlGCRA{I: I, tau: int64(l.Burst) * I}
}

func (g *adlGCRA) allow(now int64, n int) bool {
	t := max(g.tat, now)
	if t+int64(n-1)*g.I-g.tau > now {
		return false
	}
	g.tat = t + int64(n)*g.I
	return true
}

// room is how many single units would pass at now, one after the other.
func (g *adlGCRA) room(now int64) int {
	c := *g
	k := 0
	for c.allow(now, 1) {
		k++
	}
	return k
}

// adlProbe is an engine straight to the shared server (no proxy) with
// prefix: the "other callers" and the oracle's reader.
func adlProbe(t *testing.T, srv *redistest.Server, prefix string) *throttle.Engine {
	t.Helper()
	eng, err := throttle.New(srv.Client(t), throttle.WithPrefix(prefix), throttle.WithTimeout(5*time.Second))
	require.NoError(t, err)
	return eng
}

// adlRoom admits single units on key under lim until one is denied and
// returns how many passed (consuming the key's room: once per key, at the
// end of a case).
func adlRoom(t *testing.T, probe *throttle.Engine, key string, lim throttle.Limit) int {
	t.Helper()
	n := 0
	for ; n <= lim.Burst+1; n++ {
		res, err := probe.AllowN(context.Background(), key, lim, 1)
		require.NoError(t, err)
		if !res.Allowed {
			break
		}
	}
	return n
}

// adlAvail reads (without consuming) how many units would pass on key.
func adlAvail(t *testing.T, probe *throttle.Engine, key string, lim throttle.Limit) int {
	t.Helper()
	st, err := probe.State(context.Background(), []string{key}, []throttle.Limit{lim})
	require.NoError(t, err)
	return st.Available
}

// adlWaitAvail polls until key's available units are want (the held
// call's script has run in Redis).
func adlWaitAvail(t *testing.T, probe *throttle.Engine, key string, lim throttle.Limit, want int) {
	t.Helper()
	require.Eventually(t, func() bool { return adlAvail(t, probe, key, lim) == want },
		5*time.Second, time.Millisecond, "the held call's script never ran on %s", key)
}

// adlWarm opens at least n connections in eng's client (through p): n
// overlapping pings, each slowed by the proxy, so that later calls are
// sent at once rather than dialled under a held reply.
func adlWarm(t *testing.T, eng *throttle.Engine, p *redistest.Proxy, n int) {
	t.Helper()
	rdb := eng.Client().(*redis.Client)
	p.SetReplyDelay(30 * time.Millisecond)
	var wg sync.WaitGroup
	for i := 0; i < n; i++ {
		wg.Add(1)
		go func() { defer wg.Done(); _ = rdb.Ping(context.Background()).Err() }()
	}
	wg.Wait()
	p.SetReplyDelay(0)
}

func adlCtxErr(err error) bool {
	return errors.Is(err, context.DeadlineExceeded) || errors.Is(err, context.Canceled)
}

// adlObs records what the engine tells its Observer.
type adlObs struct {
	mu        sync.Mutex
	decisions []throttle.Outcome
	calls     []error
	refunds   []time.Duration
	opens     int
}

func (o *adlObs) ObserveDecision(_ string, out throttle.Outcome, _ time.Duration) {
	o.mu.Lock()
	o.decisions = append(o.decisions, out)
	o.mu.Unlock()
}
func (o *adlObs) ObserveCall(_ string, _ time.Duration, err error) {
	o.mu.Lock()
	o.calls = append(o.calls, err)
	o.mu.Unlock()
}
func (o *adlObs) ObserveRefund(_ string, given time.Duration) {
	o.mu.Lock()
	o.refunds = append(o.refunds, given)
	o.mu.Unlock()
}
func (o *adlObs) ObserveBreaker(open bool) {
	o.mu.Lock()
	if open {
		o.opens++
	}
	o.mu.Unlock()
}

func (o *adlObs) reset() {
	o.mu.Lock()
	o.decisions, o.calls, o.refunds, o.opens = nil, nil, nil, 0
	o.mu.Unlock()
}

func (o *adlObs) count(out throttle.Outcome) int {
	o.mu.Lock()
	defer o.mu.Unlock()
	n := 0
	for _, d := range o.decisions {
		if d == out {
			n++
		}
	}
	return n
}

func (o *adlObs) String() string {
	o.mu.Lock()
	defer o.mu.Unlock()
	return fmt.Sprintf("decisions %v, calls %v, refunds %v, breaker openings %d", o.decisions, o.calls, o.refunds, o.opens)
}

// adlCaller is one check-mode entry point: the keys and limits it counts
// in for a subject, and the call.
type adlCaller struct {
	name string
	keys func(subject string) []string
	lims []throttle.Limit
	call func(ctx context.Context, subject string, n int) (throttle.Result, error)
}

func adlCallers(t *testing.T, eng *throttle.Engine) []adlCaller {
	hour, day := throttle.PerHour(1, 4), throttle.PerDay(1, 6)
	single, err := reserve.New(eng, "adlr", hour)
	require.NoError(t, err)
	layeredL, err := reserve.New(eng, "adll", hour, reserve.WithLimit(day))
	require.NoError(t, err)
	withFB, err := reserve.New(eng, "adlf", hour, reserve.WithFallback(reserve.FailOpen()))
	require.NoError(t, err)
	lim := func(l *reserve.Limiter) func(context.Context, string, int) (throttle.Result, error) {
		return func(ctx context.Context, s string, n int) (throttle.Result, error) { return l.AllowN(ctx, s, n) }
	}
	return []adlCaller{
		{"Engine.AllowN", func(s string) []string { return []string{"adle:{" + s + "}"} }, []throttle.Limit{hour},
			func(ctx context.Context, s string, n int) (throttle.Result, error) {
				return eng.AllowN(ctx, "adle:{"+s+"}", hour, n)
			}},
		{"Engine.AllowAll", func(s string) []string { return []string{"adla:{" + s + "}:h", "adla:{" + s + "}:d"} }, []throttle.Limit{hour, day},
			func(ctx context.Context, s string, n int) (throttle.Result, error) {
				return eng.AllowAll(ctx, []string{"adla:{" + s + "}:h", "adla:{" + s + "}:d"}, []throttle.Limit{hour, day}, n)
			}},
		{"Limiter.AllowN", func(s string) []string { return engineKeys(single, s) }, single.Limits(), lim(single)},
		{"Limiter.AllowN layered", func(s string) []string { return engineKeys(layeredL, s) }, layeredL.Limits(), lim(layeredL)},
		{"Limiter.AllowN with FailOpen", func(s string) []string { return engineKeys(withFB, s) }, withFB.Limits(), lim(withFB)},
	}
}

// ---------------------------------------------------------------------------
// 1. Where the end lands: deadline in flight, cancel in flight, ended
// before the call.

// TestReviewADLInFlight: for every check-mode entry point, a deadline
// passing while the reply is held (60 ms against 250 ms), a cancel while
// it is held, and a context ended before the call: the caller gets its
// context's error (not ErrReplyLost), a zero Result, and every key it
// counts in is as if it had never called (Burst+1 single units pass). The
// in-flight cases make two calls (the check and its give-back), the
// pre-ended ones none.
func TestReviewADLInFlight(t *testing.T) {
	t.Parallel()
	eng, p, prefix := proxiedEngine(t, 32)
	probe := adlProbe(t, redistest.Shared(t), prefix)
	calls := callcount.Attach(eng.Client().(*redis.Client))
	bg := context.Background()
	modes := []struct {
		name  string
		sent  int64
		want  error
		start func() (context.Context, context.CancelFunc)
	}{
		{"deadline in flight", 2, context.DeadlineExceeded, func() (context.Context, context.CancelFunc) {
			return context.WithTimeout(bg, 60*time.Millisecond)
		}},
		{"cancel in flight", 2, context.Canceled, func() (context.Context, context.CancelFunc) {
			ctx, cancel := context.WithCancel(bg)
			tm := time.AfterFunc(60*time.Millisecond, cancel)
			return ctx, func() { tm.Stop(); cancel() }
		}},
		// Ended before the call: the callcount hook sees the attempt
		// (go-redis runs its hooks before taking a connection), which
		// go-redis then refuses for the ended context: at most 1.
		{"cancelled before", 1, context.Canceled, func() (context.Context, context.CancelFunc) {
			ctx, cancel := context.WithCancel(bg)
			cancel()
			return ctx, cancel
		}},
		{"deadline passed before", 1, context.DeadlineExceeded, func() (context.Context, context.CancelFunc) {
			return context.WithDeadline(bg, time.Now().Add(-time.Second))
		}},
		{"deadline in flight, cancel too", 2, context.DeadlineExceeded, func() (context.Context, context.CancelFunc) {
			// The deadline passes in flight; the caller's cancel comes
			// later still (defer cancel() after the call).
			ctx, cancel := context.WithTimeout(bg, 60*time.Millisecond)
			return ctx, cancel
		}},
	}
	for ci, c := range adlCallers(t, eng) {
		for mi, m := range modes {
			t.Run(c.name+"/"+m.name, func(t *testing.T) {
				subject := fmt.Sprintf("f%d-%d", ci, mi)
				require.NoError(t, eng.Client().(*redis.Client).Ping(bg).Err()) // a warm connection
				p.SetReplyDelay(250 * time.Millisecond)
				ctx, cancel := m.start()
				before := calls.Load()
				res, err := c.call(ctx, subject, 2)
				cancel()
				p.SetReplyDelay(0)
				sent := calls.Load() - before
				require.ErrorIs(t, err, m.want, "result %+v", res)
				require.NotErrorIs(t, err, throttle.ErrReplyLost, "the reply must be read, not lost")
				require.Equal(t, throttle.Result{}, res, "an ended caller gets no decision")
				for i, k := range c.keys(subject) {
					lim := c.lims[i]
					require.Equal(t, lim.Burst+1, adlRoom(t, probe, k, lim), "key %s must be untouched", k)
				}
				if m.sent == 2 {
					require.Equal(t, m.sent, sent, "calls sent: the check and its give-back")
				} else {
					require.LessOrEqual(t, sent, m.sent, "no give-back for a call never sent")
				}
			})
		}
	}
}

// TestReviewADLAtReply: the deadline swept across the moment the reply
// comes (held 80 ms; deadlines 50 to 113 ms): each outcome is one of two,
// never a mix: (nil error, Allowed, its 2 units standing in every key) or
// (the context's error, a zero Result, every key untouched).
func TestReviewADLAtReply(t *testing.T) {
	t.Parallel()
	eng, p, prefix := proxiedEngine(t, 32)
	probe := adlProbe(t, redistest.Shared(t), prefix)
	callers := adlCallers(t, eng)
	bg := context.Background()
	require.NoError(t, eng.Client().(*redis.Client).Ping(bg).Err())
	p.SetReplyDelay(80 * time.Millisecond)
	defer p.SetReplyDelay(0)
	var allowed, ended, lateAllowed int
	for i, d := 0, 50*time.Millisecond; d <= 113*time.Millisecond; i, d = i+1, d+3*time.Millisecond {
		c := callers[i%len(callers)]
		subject := fmt.Sprintf("r%d", i)
		ctx, cancel := context.WithTimeout(bg, d)
		res, err := c.call(ctx, subject, 2)
		if err == nil && ctx.Err() != nil {
			lateAllowed++ // answered as the deadline passed: a race no one can close
		}
		cancel()
		standing := 0
		if err == nil {
			allowed++
			require.True(t, res.Allowed, "%s %v: an untouched key must allow 2", c.name, d)
			standing = 2
		} else {
			ended++
			require.True(t, adlCtxErr(err), "%s %v: %v", c.name, d, err)
			require.NotErrorIs(t, err, throttle.ErrReplyLost, "%s %v", c.name, d)
			require.Equal(t, throttle.Result{}, res)
		}
		for j, k := range c.keys(subject) {
			lim := c.lims[j]
			require.Equal(t, lim.Burst+1-standing, adlRoom(t, probe, k, lim), "%s deadline %v: key %s (err %v)", c.name, d, k, err)
		}
	}
	t.Logf("deadlines across the reply: %d allowed, %d ended (given back), %d allowed whose ctx had ended by the time the caller looked", allowed, ended, lateAllowed)
}

// ---------------------------------------------------------------------------
// 2. Interleaving: other callers on the key while the ended Allow's reply
// is held.

// TestReviewADLInterleave: limit one an hour, burst 9 (10 units). The
// ended caller A asks 2 units (reply held 400 ms, deadline 60 ms); the
// order in Redis is fixed by waiting for A's script to have run (or not
// sending it yet). The measured room must never exceed the textbook GCRA
// replay of the units that callers were told passed (nothing through
// early), and follows the refund rule: a give-back gives nothing when a
// later count stands on it (the units wasted are logged).
func TestReviewADLInterleave(t *testing.T) {
	t.Parallel()
	eng, p, prefix := proxiedEngine(t, 32)
	srv := redistest.Shared(t)
	probe := adlProbe(t, srv, prefix)
	lim := throttle.PerHour(1, 9)
	bg := context.Background()
	adlWarm(t, eng, p, 8)

	type ended struct {
		res throttle.Result
		err error
	}
	goEnded := func(key string, n int) chan ended {
		ch := make(chan ended, 1)
		go func() {
			ctx, cancel := context.WithTimeout(bg, 60*time.Millisecond)
			defer cancel()
			r, err := eng.AllowN(ctx, key, lim, n)
			ch <- ended{r, err}
		}()
		return ch
	}
	others := func(key string, k int) {
		for i := 0; i < k; i++ {
			r, err := probe.AllowN(bg, key, lim, 1)
			require.NoError(t, err)
			require.True(t, r.Allowed)
		}
	}
	check := func(name, key string, e ended, toldPassed []int, wantStanding []int) {
		t.Helper()
		require.ErrorIs(t, e.err, context.DeadlineExceeded, name)
		require.False(t, e.res.Allowed, name)
		// Textbook replay of what callers were told passed (the ended
		// caller's units were never its to use).
		g := newADLGCRA(lim)
		for _, n := range toldPassed {
			require.True(t, g.allow(0, n))
		}
		oracle := g.room(0)
		room := adlRoom(t, probe, key, lim)
		standing := lim.Burst + 1 - room
		require.LessOrEqual(t, room, oracle, "%s: room %d beyond the textbook replay's %d: something would pass early", name, room, oracle)
		require.Contains(t, wantStanding, standing, "%s: units standing", name)
		t.Logf("%s: room %d, textbook %d: %d units wasted", name, room, oracle, oracle-room)
	}

	t.Run("others after A's count", func(t *testing.T) {
		key := "adli:{a}"
		p.SetReplyDelay(400 * time.Millisecond)
		ch := goEnded(key, 2)
		adlWaitAvail(t, probe, key, lim, 8)
		others(key, 3) // they stand on A's 2
		e := <-ch
		p.SetReplyDelay(0)
		check("others after A", key, e, []int{1, 1, 1}, []int{5}) // A's 2 cannot come back: wasted
	})
	t.Run("others before A's count", func(t *testing.T) {
		key := "adli:{b}"
		others(key, 3)
		p.SetReplyDelay(400 * time.Millisecond)
		e := <-goEnded(key, 2)
		p.SetReplyDelay(0)
		check("others before A", key, e, []int{1, 1, 1}, []int{3}) // A's on top: back in full
	})
	t.Run("others count and give back while A is held", func(t *testing.T) {
		key := "adli:{c}"
		p.SetReplyDelay(400 * time.Millisecond)
		ch := goEnded(key, 2)
		adlWaitAvail(t, probe, key, lim, 8)
		b, err := probe.Book(bg, key, lim, throttle.Request{N: 1})
		require.NoError(t, err)
		require.True(t, b.OK)
		given, err := probe.RefundUnused(bg, []string{key}, []throttle.Limit{lim}, b)
		require.NoError(t, err)
		require.Positive(t, given[0])
		e := <-ch
		p.SetReplyDelay(0)
		check("other counts then gives back", key, e, nil, []int{0}) // A's on top again: back in full
	})
	t.Run("two ended callers", func(t *testing.T) {
		key := "adli:{d}"
		p.SetReplyDelay(400 * time.Millisecond)
		chA := goEnded(key, 2)
		adlWaitAvail(t, probe, key, lim, 8)
		chB := goEnded(key, 1)
		adlWaitAvail(t, probe, key, lim, 7)
		eA, eB := <-chA, <-chB
		p.SetReplyDelay(0)
		require.ErrorIs(t, eB.err, context.DeadlineExceeded)
		// A's give-back comes first and finds B on it: A's 2 are
		// wasted, B's 1 comes back (both back if B's came first).
		check("two ended", key, eA, nil, []int{2, 0})
	})
	t.Run("a reservation books on A's count", func(t *testing.T) {
		key := "adli:{e}"
		p.SetReplyDelay(400 * time.Millisecond)
		ch := goEnded(key, 2)
		adlWaitAvail(t, probe, key, lim, 8)
		b, err := probe.Book(bg, key, lim, throttle.Request{N: 3, MaxWait: throttle.Forever})
		require.NoError(t, err)
		require.True(t, b.OK)
		e := <-ch
		p.SetReplyDelay(0)
		check("reservation on A", key, e, []int{3}, []int{5})
	})
}

// ---------------------------------------------------------------------------
// 3. Layered limits.

// TestReviewADLLayeredInterleave: an ended AllowAll over two keys (one an
// hour burst 4, one a day burst 6) while another caller counts on the
// second key alone: the first key, which nothing else touched, comes back
// in full; the second keeps the other's unit and, by the rule, the ended
// caller's too (wasted), never less.
func TestReviewADLLayeredInterleave(t *testing.T) {
	t.Parallel()
	eng, p, prefix := proxiedEngine(t, 32)
	probe := adlProbe(t, redistest.Shared(t), prefix)
	hour, day := throttle.PerHour(1, 4), throttle.PerDay(1, 6)
	keys := []string{"adlx:{s}:h", "adlx:{s}:d"}
	lims := []throttle.Limit{hour, day}
	bg := context.Background()
	require.NoError(t, eng.Client().(*redis.Client).Ping(bg).Err())
	p.SetReplyDelay(400 * time.Millisecond)
	type out struct {
		r   throttle.Result
		err error
	}
	ch := make(chan out, 1)
	go func() {
		ctx, cancel := context.WithTimeout(bg, 60*time.Millisecond)
		defer cancel()
		r, err := eng.AllowAll(ctx, keys, lims, 2)
		ch <- out{r, err}
	}()
	adlWaitAvail(t, probe, keys[1], day, 5)
	r, err := probe.AllowN(bg, keys[1], day, 1)
	require.NoError(t, err)
	require.True(t, r.Allowed)
	o := <-ch
	p.SetReplyDelay(0)
	require.ErrorIs(t, o.err, context.DeadlineExceeded)
	require.Equal(t, hour.Burst+1, adlRoom(t, probe, keys[0], hour), "the key nothing else touched comes back in full")
	dayRoom := adlRoom(t, probe, keys[1], day)
	require.LessOrEqual(t, dayRoom, day.Burst, "the other caller's unit must stand")
	t.Logf("day key: room %d of %d after the other's 1 unit: %d wasted", dayRoom, day.Burst+1, day.Burst-dayRoom)
}

// ---------------------------------------------------------------------------
// 4. No engine timeout.

// TestReviewADLNoTimeout: WithTimeout(0). A deadline passing in flight
// bounds the call (documented: the reply is lost, ErrReplyLost with the
// context's error, its units counted): the caller returns long before the
// held reply (1.5 s) would come, the breaker stays closed, and the next
// call is served and counts on top. A cancel in flight (no deadline) does
// not cut the call: its reply is read and the units come back. A Limiter
// with FailOpen gives the ended caller no fallback decision.
func TestReviewADLNoTimeout(t *testing.T) {
	t.Parallel()
	obs := &adlObs{}
	eng, p, prefix := proxiedEngine(t, 32, throttle.WithTimeout(0), throttle.WithObserver(obs))
	probe := adlProbe(t, redistest.Shared(t), prefix)
	lim := throttle.PerHour(1, 4)
	fb, err := reserve.New(eng, "adlfb", lim, reserve.WithFallback(reserve.FailOpen()))
	require.NoError(t, err)
	bg := context.Background()
	require.NoError(t, eng.Client().(*redis.Client).Ping(bg).Err())

	t.Run("deadline in flight", func(t *testing.T) {
		p.SetReplyDelay(1500 * time.Millisecond)
		ctx, cancel := context.WithTimeout(bg, 60*time.Millisecond)
		start := time.Now()
		res, err := eng.AllowN(ctx, "adln:{a}", lim, 2)
		took := time.Since(start)
		cancel()
		p.SetReplyDelay(0)
		require.ErrorIs(t, err, context.DeadlineExceeded)
		require.ErrorIs(t, err, throttle.ErrReplyLost, "documented: the caller's deadline cut the read")
		require.Equal(t, throttle.Result{}, res)
		require.Less(t, took, 1200*time.Millisecond, "the caller's deadline bounds the call")
		open, _ := eng.Unavailable()
		require.False(t, open, "a caller's deadline says nothing of Redis")
		require.Eventually(t, func() bool { return adlAvail(t, probe, "adln:{a}", lim) == 3 }, 3*time.Second, 5*time.Millisecond,
			"documented: the lost reply's units stand")
		r, err := eng.AllowN(bg, "adln:{a}", lim, 1)
		require.NoError(t, err)
		require.True(t, r.Allowed)
		require.Equal(t, 2, r.Remaining)
	})
	t.Run("cancel in flight", func(t *testing.T) {
		p.SetReplyDelay(300 * time.Millisecond)
		ctx, cancel := context.WithCancel(bg)
		tm := time.AfterFunc(60*time.Millisecond, cancel)
		res, err := eng.AllowN(ctx, "adln:{b}", lim, 2)
		tm.Stop()
		cancel()
		p.SetReplyDelay(0)
		require.ErrorIs(t, err, context.Canceled)
		require.NotErrorIs(t, err, throttle.ErrReplyLost)
		require.Equal(t, throttle.Result{}, res)
		require.Equal(t, lim.Burst+1, adlRoom(t, probe, "adln:{b}", lim))
	})
	t.Run("Limiter with fallback, deadline in flight", func(t *testing.T) {
		obs.reset()
		p.SetReplyDelay(1500 * time.Millisecond)
		ctx, cancel := context.WithTimeout(bg, 60*time.Millisecond)
		res, err := fb.AllowN(ctx, "c", 2)
		cancel()
		p.SetReplyDelay(0)
		require.ErrorIs(t, err, context.DeadlineExceeded)
		require.Equal(t, throttle.Result{}, res)
		require.Zero(t, obs.count(throttle.FallbackAllowed)+obs.count(throttle.FallbackRefused), "no fallback decision: %v", obs)
		open, _ := eng.Unavailable()
		require.False(t, open)
		t.Logf("observer: %v", obs)
	})
}

// ---------------------------------------------------------------------------
// 5. Redis slow, paused, stopped; the breaker and the fallback.

// TestReviewADLSlowRedisBreaker: engine timeout 300 ms. Redis slow (reply
// held 100 ms, inside the timeout): eight ended callers (deadline 20 ms)
// each get the context's error, their keys untouched, and the breaker
// never opens. Redis paused (reply held 1 s, past the timeout): an ended
// caller's call is bounded by the engine's timeout, so it may open the
// breaker (Redis did not answer in time: a true verdict), and it gets its
// context's error with ErrUnavailable, never a fallback decision; a caller
// with no end opens the breaker and, with FailOpen, is answered by the
// fallback.
func TestReviewADLSlowRedisBreaker(t *testing.T) {
	t.Parallel()
	obs := &adlObs{}
	eng, p, prefix := proxiedEngine(t, 32, throttle.WithTimeout(300*time.Millisecond), throttle.WithObserver(obs))
	probe := adlProbe(t, redistest.Shared(t), prefix)
	lim := throttle.PerHour(1, 4)
	fb, err := reserve.New(eng, "adls", lim, reserve.WithFallback(reserve.FailOpen()))
	require.NoError(t, err)
	bg := context.Background()
	adlWarm(t, eng, p, 12)

	// Slow, within the timeout.
	p.SetReplyDelay(100 * time.Millisecond)
	var wg sync.WaitGroup
	errs := make([]error, 8)
	for i := range errs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			ctx, cancel := context.WithTimeout(bg, 20*time.Millisecond)
			defer cancel()
			_, errs[i] = fb.AllowN(ctx, fmt.Sprintf("s%d", i), 2)
		}()
	}
	wg.Wait()
	p.SetReplyDelay(0)
	for i, err := range errs {
		require.ErrorIs(t, err, context.DeadlineExceeded, "caller %d", i)
		require.NotErrorIs(t, err, throttle.ErrUnavailable, "caller %d", i)
	}
	open, _ := eng.Unavailable()
	require.False(t, open, "slow but answering Redis: %v", obs)
	require.Zero(t, obs.opens, "%v", obs)
	for i := range errs {
		k := engineKeys(fb, fmt.Sprintf("s%d", i))[0]
		require.Equal(t, lim.Burst+1, adlRoom(t, probe, k, lim), "caller %d's key", i)
	}

	// Paused past the timeout: an ended caller.
	obs.reset()
	p.SetReplyDelay(time.Second)
	ctx, cancel := context.WithTimeout(bg, 20*time.Millisecond)
	res, err := fb.AllowN(ctx, "p1", 2)
	cancel()
	require.ErrorIs(t, err, context.DeadlineExceeded)
	require.Equal(t, throttle.Result{}, res)
	require.Zero(t, obs.count(throttle.FallbackAllowed)+obs.count(throttle.FallbackRefused), "ended: no fallback: %v", obs)
	openAfterEnded, _ := eng.Unavailable()
	t.Logf("paused, ended caller: err %v; breaker open after it: %v; %v", err, openAfterEnded, obs)

	// A caller with no end, still paused: the breaker opens (if the ended
	// caller's call did not already) and the fallback answers.
	res, err = fb.AllowN(bg, "p2", 1)
	require.NoError(t, err, "FailOpen answers")
	require.True(t, res.Allowed)
	open, _ = eng.Unavailable()
	require.True(t, open)
	require.Equal(t, 1, obs.count(throttle.FallbackAllowed), "%v", obs)

	// Breaker open: an ended caller gets its context's error, not the
	// fallback's answer.
	ended, cancel2 := context.WithCancel(bg)
	cancel2()
	res, err = fb.AllowN(ended, "p3", 1)
	require.ErrorIs(t, err, context.Canceled)
	require.Equal(t, throttle.Result{}, res)
	require.Equal(t, 1, obs.count(throttle.FallbackAllowed), "no fallback decision for the ended caller: %v", obs)
	p.SetReplyDelay(0)
}

// TestReviewADLStoppedRedis: Redis stopped. Callers already ended get
// their context's error and leave the breaker closed; a caller with no end
// opens it and gets the fallback's answer; with the breaker open, an ended
// caller gets its context's error (ErrUnavailable kept in the chain), no
// fallback decision.
func TestReviewADLStoppedRedis(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	obs := &adlObs{}
	eng, _, _ := proxiedEngineOn(t, srv, 8, throttle.WithTimeout(300*time.Millisecond), throttle.WithObserver(obs))
	lim := throttle.PerHour(1, 4)
	fb, err := reserve.New(eng, "adlst", lim, reserve.WithFallback(reserve.FailOpen()))
	require.NoError(t, err)
	bg := context.Background()
	r, err := fb.AllowN(bg, "warm", 1)
	require.NoError(t, err)
	require.True(t, r.Allowed)
	srv.Stop()
	obs.reset()

	for i := 0; i < 5; i++ {
		ended, cancel := context.WithCancel(bg)
		cancel()
		res, err := fb.AllowN(ended, fmt.Sprintf("e%d", i), 1)
		require.ErrorIs(t, err, context.Canceled)
		require.Equal(t, throttle.Result{}, res)
		dl, cancel := context.WithDeadline(bg, time.Now().Add(-time.Millisecond))
		res, err = fb.AllowN(dl, fmt.Sprintf("d%d", i), 1)
		cancel()
		require.ErrorIs(t, err, context.DeadlineExceeded)
		require.Equal(t, throttle.Result{}, res)
	}
	open, _ := eng.Unavailable()
	require.False(t, open, "ended callers sent nothing and said nothing of Redis: %v", obs)
	require.Zero(t, obs.count(throttle.FallbackAllowed)+obs.count(throttle.FallbackRefused), "%v", obs)

	res, err := fb.AllowN(bg, "live", 1)
	require.NoError(t, err)
	require.True(t, res.Allowed)
	open, _ = eng.Unavailable()
	require.True(t, open, "a live caller's refused connection opens the breaker")
	require.Equal(t, 1, obs.count(throttle.FallbackAllowed))

	ended, cancel := context.WithCancel(bg)
	cancel()
	res, err = fb.AllowN(ended, "e-open", 1)
	require.ErrorIs(t, err, context.Canceled)
	require.ErrorIs(t, err, throttle.ErrUnavailable, "the chain keeps why the call failed")
	require.Equal(t, throttle.Result{}, res)
	require.Equal(t, 1, obs.count(throttle.FallbackAllowed), "no fallback decision for the ended caller")
	// The engine straight: the same.
	_, err = eng.AllowN(ended, "adlst:{x}", lim, 1)
	require.ErrorIs(t, err, context.Canceled)
}

// ---------------------------------------------------------------------------
// 6. Repeated and concurrent.

// TestReviewADLRetryAfterEnded: the same caller asks again at once after
// an ended Allow (reply no longer held): it passes, and exactly its own 2
// units stand (the ended call's came back before it returned). Repeated
// five times on one key with alternating ended and live calls: the live
// ones' units alone stand.
func TestReviewADLRetryAfterEnded(t *testing.T) {
	t.Parallel()
	eng, p, prefix := proxiedEngine(t, 32)
	probe := adlProbe(t, redistest.Shared(t), prefix)
	lim := throttle.PerHour(1, 14) // 15 units
	bg := context.Background()
	require.NoError(t, eng.Client().(*redis.Client).Ping(bg).Err())
	key := "adlrt:{k}"
	g := newADLGCRA(lim)
	for i := 0; i < 5; i++ {
		p.SetReplyDelay(200 * time.Millisecond)
		ctx, cancel := context.WithTimeout(bg, 40*time.Millisecond)
		_, err := eng.AllowN(ctx, key, lim, 2)
		cancel()
		p.SetReplyDelay(0)
		require.ErrorIs(t, err, context.DeadlineExceeded)
		r, err := eng.AllowN(bg, key, lim, 2)
		require.NoError(t, err)
		require.True(t, r.Allowed, "round %d", i)
		require.True(t, g.allow(0, 2))
		require.Equal(t, g.room(0), r.Remaining, "round %d: Remaining against the textbook", i)
	}
	require.Equal(t, g.room(0), adlRoom(t, probe, key, lim))
}

// TestReviewADLManyEnded: 32 goroutines ask 1 unit each of one key (one an
// hour, burst 63: every count passes) with the reply held 150 ms and
// deadlines drawn around it (110 to 190 ms, seeded). Those told Allowed
// stand (their Result.Remaining gives each one's place, p = 64 -
// Remaining), so the key's standing units are at least the highest such
// place and at least their number (nothing through early); ended ones come
// back by the rule: the topmost ended count, if above every allowed one,
// always comes back. No goroutine is left once the client and proxy are
// closed. Not parallel: it counts goroutines.
func TestReviewADLManyEnded(t *testing.T) {
	srv := redistest.Shared(t)
	seed := uint64(time.Now().UnixNano())
	t.Logf("seed %d", seed)
	rng := rand.New(rand.NewPCG(seed, 42))
	runtime.GC()
	before := runtime.NumGoroutine()

	func() {
		p := redistest.NewProxy(t, srv.Addr)
		rdb := p.Client(t, srv, func(o *redis.Options) { o.PoolSize = 32 })
		prefix := redistest.Prefix(t)
		eng, err := throttle.New(rdb, throttle.WithPrefix(prefix), throttle.WithTimeout(10*time.Second))
		require.NoError(t, err)
		require.NoError(t, eng.Load(context.Background()))
		adlWarm(t, eng, p, 32)
		probe, err := throttle.New(redis.NewClient(srv.Options()), throttle.WithPrefix(prefix), throttle.WithTimeout(5*time.Second))
		require.NoError(t, err)
		defer probe.Client().(*redis.Client).Close()
		lim := throttle.PerHour(1, 63)
		bg := context.Background()
		for round := 0; round < 4; round++ {
			key := fmt.Sprintf("adlm:{%d}", round)
			p.SetReplyDelay(150 * time.Millisecond)
			var wg sync.WaitGroup
			places := make([]int, 32) // 0: ended
			var bad atomic.Value
			dls := make([]time.Duration, 32)
			for i := range dls {
				dls[i] = 110*time.Millisecond + time.Duration(rng.IntN(81))*time.Millisecond
			}
			for i := 0; i < 32; i++ {
				wg.Add(1)
				go func() {
					defer wg.Done()
					ctx, cancel := context.WithTimeout(bg, dls[i])
					defer cancel()
					r, err := eng.AllowN(ctx, key, lim, 1)
					switch {
					case err == nil && r.Allowed:
						places[i] = lim.Burst + 1 - r.Remaining
					case err != nil && adlCtxErr(err) && !errors.Is(err, throttle.ErrReplyLost):
					default:
						bad.Store(fmt.Sprintf("caller %d: %+v %v", i, r, err))
					}
				}()
			}
			wg.Wait()
			p.SetReplyDelay(0)
			require.Nil(t, bad.Load())
			var told []int
			for _, pl := range places {
				if pl > 0 {
					told = append(told, pl)
				}
			}
			sort.Ints(told)
			maxPlace := 0
			if len(told) > 0 {
				maxPlace = told[len(told)-1]
			}
			standing := lim.Burst + 1 - adlRoom(t, probe, key, lim)
			endedN := 32 - len(told)
			givenBack := 32 - standing
			t.Logf("round %d: %d allowed (places %v), %d ended; standing %d: %d of the ended counts came back, %d wasted (%d stood above every allowed one)",
				round, len(told), told, endedN, standing, givenBack, endedN-givenBack, 32-maxPlace)
			require.GreaterOrEqual(t, standing, maxPlace, "an allowed count was given back under: something would pass early")
			require.GreaterOrEqual(t, standing, len(told))
			require.LessOrEqual(t, standing, 32)
			if maxPlace < 32 {
				require.GreaterOrEqual(t, givenBack, 1, "the topmost ended count has nothing on it: it must come back")
			}
		}
		_ = rdb.Close()
		p.Close()
	}()

	var after int
	ok := false
	for i := 0; i < 100 && !ok; i++ {
		time.Sleep(50 * time.Millisecond)
		after = runtime.NumGoroutine()
		ok = after <= before
	}
	if !ok {
		buf := make([]byte, 1<<20)
		n := runtime.Stack(buf, true)
		t.Fatalf("goroutines: %d before, %d after\n%s", before, after, buf[:n])
	}
}

// ---------------------------------------------------------------------------
// 7. The observer.

// TestReviewADLObserver: what the Observer sees of an ended check whose
// count was given back, of one that was denied, and of a live one. Logged;
// the assertions are what the docs promise: every script call reported
// (the check and its give-back, with no error), the give-back reported
// with the time it gave (2 intervals), and Redis's decision counted as a
// reservation's is.
func TestReviewADLObserver(t *testing.T) {
	t.Parallel()
	obs := &adlObs{}
	eng, p, _ := proxiedEngine(t, 32, throttle.WithObserver(obs))
	lim := throttle.PerHour(1, 4)
	bg := context.Background()
	require.NoError(t, eng.Client().(*redis.Client).Ping(bg).Err())
	obs.reset()

	p.SetReplyDelay(200 * time.Millisecond)
	ctx, cancel := context.WithTimeout(bg, 40*time.Millisecond)
	_, err := eng.AllowN(ctx, "adlo:{a}", lim, 2)
	cancel()
	p.SetReplyDelay(0)
	require.ErrorIs(t, err, context.DeadlineExceeded)
	t.Logf("ended, allowed then given back: %v", obs)
	obs.mu.Lock()
	require.Len(t, obs.calls, 2, "the check and its give-back")
	require.NoError(t, obs.calls[0])
	require.NoError(t, obs.calls[1])
	require.Len(t, obs.refunds, 1)
	// RefundUnused gives back from the refund's now: 2 intervals less
	// the time since the count.
	require.InDelta(t, float64(2*lim.Interval()-time.Second), float64(obs.refunds[0]), float64(time.Second))
	endedDecisions := len(obs.decisions)
	// Redis's decision is counted whether or not the caller heard it, as
	// a reservation's is, and the give-back as a refund (at e42cdb8 an
	// ended check counted no decision, where an ended reservation did).
	require.Equal(t, []throttle.Outcome{throttle.Allowed}, obs.decisions)
	obs.mu.Unlock()

	// Ended, denied (nothing to give back).
	r, err := eng.AllowN(bg, "adlo:{b}", lim, 5)
	require.NoError(t, err)
	require.True(t, r.Allowed)
	obs.reset()
	p.SetReplyDelay(200 * time.Millisecond)
	ctx, cancel = context.WithTimeout(bg, 40*time.Millisecond)
	_, err = eng.AllowN(ctx, "adlo:{b}", lim, 1)
	cancel()
	p.SetReplyDelay(0)
	require.ErrorIs(t, err, context.DeadlineExceeded)
	t.Logf("ended, denied: %v", obs)
	obs.mu.Lock()
	require.Len(t, obs.calls, 1, "a denial has nothing to give back")
	require.Empty(t, obs.refunds)
	require.Equal(t, []throttle.Outcome{throttle.Denied}, obs.decisions)
	obs.mu.Unlock()

	// Compare: a reservation whose caller ended in flight.
	l, err := reserve.New(eng, "adlo", lim, reserve.WithCoalescing(false))
	require.NoError(t, err)
	obs.reset()
	p.SetReplyDelay(200 * time.Millisecond)
	ctx, cancel = context.WithTimeout(bg, 40*time.Millisecond)
	_, err = l.ReserveN(ctx, "c", 2)
	cancel()
	p.SetReplyDelay(0)
	require.ErrorIs(t, err, context.DeadlineExceeded)
	t.Logf("ended reservation (for comparison): %v", obs)
	t.Logf("decisions recorded for an ended check whose count went back: %d", endedDecisions)
}

// ---------------------------------------------------------------------------
// The README's claim, widened by e42cdb8.

// TestReviewADLReadmeBookingClaim: README "Lost replies", as e42cdb8
// reworded it, said every booking's reply was read past the caller's
// deadline; a booking made through the engine directly (Engine.Book, with
// its 10 s timeout) whose caller's deadline passed in flight lost its
// reply (ErrReplyLost, the units standing): FAILED on e42cdb8 (PROVEN, a
// doc claim broader than the code). Since then the engine's own Book,
// BookBatch and BookAll read their reply past the deadline and give back
// what they booked, and the README says so; AllowWindow is still bounded
// by the caller's context and can lose a reply to its deadline: this
// checks both stated behaviours.
func TestReviewADLReadmeBookingClaim(t *testing.T) {
	t.Parallel()
	eng, p, prefix := proxiedEngine(t, 32, throttle.WithMerging(false))
	probe := adlProbe(t, redistest.Shared(t), prefix)
	lim := throttle.PerHour(1, 4)
	bg := context.Background()
	adlWarm(t, eng, p, 4)

	p.SetReplyDelay(250 * time.Millisecond)
	ctx, cancel := context.WithTimeout(bg, 60*time.Millisecond)
	_, berr := eng.Book(ctx, "adlb:{b}", lim, throttle.Request{N: 2, MaxWait: throttle.Forever})
	cancel()
	ctx, cancel = context.WithTimeout(bg, 60*time.Millisecond)
	_, werr := eng.AllowWindow(ctx, "adlw:{w}", throttle.Window{Max: 3, Span: time.Hour}, 1)
	cancel()
	p.SetReplyDelay(0)
	standing := lim.Burst + 1 - adlRoom(t, probe, "adlb:{b}", lim)
	t.Logf("Engine.Book, deadline in flight: %v; %d units standing", berr, standing)
	t.Logf("AllowWindow, deadline in flight: %v", werr)
	for _, err := range []error{berr, werr} {
		require.ErrorIs(t, err, context.DeadlineExceeded)
	}
	require.NotErrorIs(t, berr, throttle.ErrReplyLost, "the README: a booking's reply is read past the deadline")
	require.Equal(t, 0, standing, "the ended booking's units are given back")
	require.ErrorIs(t, werr, throttle.ErrReplyLost, "the README: AllowWindow can lose a reply to the deadline")
}

// TestReviewADLBadInputEnded: bad input with an ended context is reported
// as bad input (as before e42cdb8), not as the context's error, and makes
// no Redis call.
func TestReviewADLBadInputEnded(t *testing.T) {
	t.Parallel()
	eng, _, _ := proxiedEngine(t, 4)
	calls := callcount.Attach(eng.Client().(*redis.Client))
	lim := throttle.PerHour(1, 4)
	l, err := reserve.New(eng, "adlbad", lim, reserve.WithLimit(throttle.PerDay(1, 2)))
	require.NoError(t, err)
	ended, cancel := context.WithCancel(context.Background())
	cancel()
	before := calls.Load()
	for _, c := range []struct {
		name string
		err  error
		run  func() error
	}{
		{"n = 0", throttle.ErrInvalidRequest, func() error { _, err := eng.AllowN(ended, "adlbad:{k}", lim, 0); return err }},
		{"n > Burst+1", throttle.ErrExceedsBurst, func() error { _, err := eng.AllowN(ended, "adlbad:{k}", lim, 6); return err }},
		{"bad limit", throttle.ErrInvalidLimit, func() error { _, err := eng.AllowN(ended, "adlbad:{k}", throttle.Limit{}, 1); return err }},
		{"keys without a shared tag", throttle.ErrInvalidRequest, func() error {
			_, err := eng.AllowAll(ended, []string{"adlbad:{a}", "adlbad:{b}"}, []throttle.Limit{lim, lim}, 1)
			return err
		}},
		{"Limiter n over the second limit's burst", throttle.ErrExceedsBurst, func() error { _, err := l.AllowN(ended, "k", 4); return err }},
	} {
		err := c.run()
		require.ErrorIs(t, err, c.err, c.name)
		require.NotErrorIs(t, err, context.Canceled, c.name)
	}
	require.Equal(t, before, calls.Load(), "no Redis call for bad input")
}
