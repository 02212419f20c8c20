package leasereview_test

// Review of 76ce7b6: a Release whose call fails, before Close too, gives
// its lease back with a leave call the room's keeper sends every poll
// interval until one reaches Redis (or the TTL has passed); Close sends
// it too. Side paths, through package lease's public API, go-redis hooks
// on an engine's client (r49Hook), a proxy adding latency, and Stop and
// Restart of the test's own redis-server: releases whose reply is lost
// and whose command runs in Redis only after the leave call (a delayed
// release), mixed with unsent and lost-reply releases under contention
// from two processes; Redis stopped for longer than the TTL after a
// failed release (leave calls counted, the keeper's end, Close); Redis
// restarted empty; 200 keys whose releases fail at once; 40 ms latency
// each way; Release twice and Release racing Close.

import (
	"context"
	"fmt"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/slotbook/slotbook/internal/redistest"
	"github.com/slotbook/slotbook/lease"
	"github.com/slotbook/slotbook/lease/internal/leasetest"
	"github.com/slotbook/slotbook/throttle"
)

// r49Call is one lease script call as r49Hook saw it.
type r49Call struct {
	kind string
	id   string // release, leave, acquire: the lease or waiter id
	at   time.Time
	ran  bool // passed on to Redis and answered
	err  error
}

// r49Hook names each lease script call (c48bKinds); do, if set, handles
// the call instead of the hook (it may call next, or not); every call is
// recorded.
type r49Hook struct {
	kinds map[string]string
	do    atomic.Pointer[func(ctx context.Context, kind, id string, cmd redis.Cmder, next redis.ProcessHook) (handled bool, err error)]
	mu    sync.Mutex
	calls []r49Call
}

func newR49Hook(t *testing.T) *r49Hook { return &r49Hook{kinds: c48bKinds(t)} }

func (h *r49Hook) setDo(f func(ctx context.Context, kind, id string, cmd redis.Cmder, next redis.ProcessHook) (bool, error)) {
	h.do.Store(&f)
}

func (h *r49Hook) DialHook(next redis.DialHook) redis.DialHook { return next }
func (h *r49Hook) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}
func (h *r49Hook) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		kind, id, _ := c48cKindID(h.kinds, cmd)
		if kind == "" {
			return next(ctx, cmd)
		}
		c := r49Call{kind: kind, id: id, at: time.Now()}
		if p := h.do.Load(); p != nil && *p != nil {
			if handled, err := (*p)(ctx, kind, id, cmd, next); handled {
				h.record(c)
				return err
			}
		}
		err := next(ctx, cmd)
		c.ran, c.err = err == nil, err
		h.record(c)
		return err
	}
}

func (h *r49Hook) record(c r49Call) {
	h.mu.Lock()
	h.calls = append(h.calls, c)
	h.mu.Unlock()
}

// count returns the recorded calls of kind (all ids if id is empty) made
// after since, and how many of them ran.
func (h *r49Hook) count(kind, id string, since time.Time) (n, ran int) {
	h.mu.Lock()
	defer h.mu.Unlock()
	for _, c := range h.calls {
		if c.kind == kind && (id == "" || c.id == id) && !c.at.Before(since) {
			n++
			if c.ran {
				ran++
			}
		}
	}
	return n, ran
}

// byID returns, for kind, the calls recorded per id after since.
func (h *r49Hook) byID(kind string, since time.Time) map[string]int {
	h.mu.Lock()
	defer h.mu.Unlock()
	out := map[string]int{}
	for _, c := range h.calls {
		if c.kind == kind && !c.at.Before(since) {
			out[c.id]++
		}
	}
	return out
}

// r49Rig is A (direct, 5 s timeout) and B (hooked, maybe proxied) on one
// server, scripts loaded.
type r49Rig struct {
	srv    *redistest.Server
	rdb    *redis.Client
	prefix string
	a, b   *lease.Semaphore
	hook   *r49Hook
	proxy  *redistest.Proxy
}

func newR49Rig(t *testing.T, own bool, n int, ttl, poll, btimeout, latency time.Duration) *r49Rig {
	t.Helper()
	ctx := context.Background()
	srv := leasetest.Server(t, own)
	r := &r49Rig{srv: srv, rdb: srv.Client(t), prefix: redistest.Prefix(t), hook: newR49Hook(t)}
	aEng, err := throttle.New(r.rdb, throttle.WithPrefix(r.prefix), throttle.WithTimeout(5*time.Second))
	require.NoError(t, err)
	r.a, err = lease.New(aEng, "partner", n, lease.WithTTL(ttl), lease.WithPollInterval(poll))
	require.NoError(t, err)
	leasetest.CloseAtEnd(t, r.a)
	var bEng *throttle.Engine
	bEng, r.proxy = leasetest.Hooked(t, srv, r.prefix, btimeout, latency, r.hook)
	r.b, err = lease.New(bEng, "partner", n, lease.WithTTL(ttl), lease.WithPollInterval(poll))
	require.NoError(t, err)
	leasetest.CloseAtEnd(t, r.b)
	redistest.UntilOK(t, func() error { return r.a.Load(ctx) })
	redistest.UntilOK(t, func() error { return r.b.Load(ctx) })
	return r
}

func (r *r49Rig) key(key, part string) string {
	return r.prefix + "partner:{" + key + "}:lease:" + part
}

func (r *r49Rig) holders(key string) []string {
	return r.rdb.ZRange(context.Background(), r.key(key, "h"), 0, -1).Val()
}

// TestReviewRelease49Delayed: N = 2, key k, three workers in A and three
// in B acquire and release in a loop for 6 s, each holding 0-15 ms. B's
// hook fails B's release calls at random: passed (40%), unsent (20%),
// run with the reply reported lost (20%), or delayed (20%): reported lost
// at once, and sent to Redis on a client of its own 0-300 ms later, so
// that the keeper's leave call for the lease may run before it. Checks:
// no holder whose lease is not Lost finds it gone from Redis while it
// holds it (before and after its hold); at most N ids in the holders set
// and at most N holders in the workers' own view at every sample; every
// token granted once; every worker makes progress; no holder in Redis at
// the end; the leave calls B sent for its failed releases. Direct, and
// with B through a proxy adding 40 ms each way (its delayed releases
// then go direct, and may overtake its calls).
func TestReviewRelease49Delayed(t *testing.T) {
	for _, latency := range []time.Duration{0, 40 * time.Millisecond} {
		t.Run(fmt.Sprint("latency", latency), func(t *testing.T) { r49Delayed(t, latency) })
	}
}

func r49Delayed(t *testing.T, latency time.Duration) {
	const n, workers = 2, 3
	key := fmt.Sprint("r49d-", latency)
	ctx := context.Background()
	r := newR49Rig(t, false, n, 3*time.Second, 100*time.Millisecond, time.Second, latency)
	raw := r.srv.Client(t)
	var delayed sync.WaitGroup
	var modes [4]atomic.Int32
	r.hook.setDo(func(ctx context.Context, kind, id string, cmd redis.Cmder, next redis.ProcessHook) (bool, error) {
		if kind != "release" {
			return false, nil
		}
		m := rand.IntN(10)
		switch {
		case m < 4:
			modes[0].Add(1)
			return false, nil
		case m < 6:
			modes[1].Add(1)
			cmd.SetErr(leasetest.ErrNotSent)
			return true, leasetest.ErrNotSent
		case m < 8:
			modes[2].Add(1)
			_ = next(ctx, cmd)
			cmd.SetErr(leasetest.ErrLostRead)
			return true, leasetest.ErrLostRead
		default:
			modes[3].Add(1)
			args := cmd.Args()
			delayed.Go(func() {
				time.Sleep(time.Duration(rand.IntN(300)) * time.Millisecond)
				_ = raw.Do(context.Background(), args...).Err()
			})
			cmd.SetErr(leasetest.ErrLostRead)
			return true, leasetest.ErrLostRead
		}
	})
	var (
		inView      atomic.Int32 // holders in the workers' own view
		acquireErrs atomic.Int32
		maxView     atomic.Int32
		maxRedis    atomic.Int32
		tmu         sync.Mutex
		tokens      = map[int64]string{}
		problems    []string
		progress    [2 * workers]int
	)
	report := func(format string, args ...any) {
		tmu.Lock()
		problems = append(problems, fmt.Sprintf(format, args...))
		tmu.Unlock()
	}
	check := func(who string, l *lease.Lease, when string) {
		s, err := leasetest.LookOn(ctx, r.rdb, r.prefix, key, l.Token())
		if err != nil {
			return
		}
		if !s.Held && !leasetest.IsLost(l) {
			report("%s: lease %d (id %q) gone from Redis %s its hold, not Lost", who, l.Token(), s.ID, when)
		}
	}
	stop := make(chan struct{})
	sampled := make(chan struct{})
	go func() {
		defer close(sampled)
		for {
			select {
			case <-stop:
				return
			default:
			}
			h := int32(r.rdb.ZCard(ctx, r.key(key, "h")).Val())
			if h > maxRedis.Load() {
				maxRedis.Store(h)
			}
			time.Sleep(2 * time.Millisecond)
		}
	}()
	deadline := time.Now().Add(6 * time.Second)
	var wg sync.WaitGroup
	for i := range 2 * workers {
		s, who := r.a, fmt.Sprint("A", i)
		if i >= workers {
			s, who = r.b, fmt.Sprint("B", i-workers)
		}
		wg.Go(func() {
			for time.Now().Before(deadline) {
				actx, cancel := context.WithTimeout(ctx, 5*time.Second)
				l, err := s.Acquire(actx, key)
				cancel()
				if err != nil {
					// B's breaker, opened by a failed release, fails
					// its Acquire fast: tried again a moment on.
					acquireErrs.Add(1)
					time.Sleep(20 * time.Millisecond)
					continue
				}
				v := inView.Add(1)
				if v > maxView.Load() {
					maxView.Store(v)
				}
				tmu.Lock()
				if prev, dup := tokens[l.Token()]; dup {
					problems = append(problems, fmt.Sprintf("token %d granted to %s and %s", l.Token(), prev, who))
				}
				tokens[l.Token()] = who
				progress[i]++
				tmu.Unlock()
				check(who, l, "at the start of")
				time.Sleep(time.Duration(rand.IntN(15)) * time.Millisecond)
				check(who, l, "at the end of")
				inView.Add(-1)
				_ = l.Release(ctx)
			}
		})
	}
	wg.Wait()
	close(stop)
	<-sampled
	delayed.Wait()
	lv, lvRan := r.hook.count("leave", "", time.Time{})
	t.Logf("Acquire errors (tried again) %d", acquireErrs.Load())
	{
		relOK := map[string]bool{}
		r.hook.mu.Lock()
		for _, c := range r.hook.calls {
			if c.kind == "release" && c.ran {
				relOK[c.id] = true
			}
		}
		r.hook.mu.Unlock()
		hist := map[string]int{}
		for id, c := range r.hook.byID("leave", time.Time{}) {
			hist[fmt.Sprintf("released %v, %d leave calls", relOK[id], c)]++
		}
		t.Logf("ids by leave calls: %v", hist)
	}
	t.Logf("modes (passed, unsent, lost, delayed) %d %d %d %d; B's leave calls %d (%d ran); progress %v; tokens %d; most holders in Redis %d, in view %d",
		modes[0].Load(), modes[1].Load(), modes[2].Load(), modes[3].Load(), lv, lvRan, progress, len(tokens), maxRedis.Load(), maxView.Load())
	assert.Empty(t, problems)
	assert.LessOrEqual(t, maxRedis.Load(), int32(n), "holders in Redis at a sample")
	assert.LessOrEqual(t, maxView.Load(), int32(n), "holders in the workers' own view")
	for i, p := range progress {
		assert.Positive(t, p, "worker %d's leases", i)
	}
	leasetest.WaitFor(t, func() bool { return len(r.holders(key)) == 0 })
}

// TestReviewRelease49DelayedOne: B (N = 1, TTL 30 s, poll 100 ms) holds
// k; A's waiter is queued. B's release call is reported lost at once,
// unsent; it is sent on a client of its own only once the keeper's leave
// call has run and A's waiter holds the lease (its token larger). Then
// A's holder must still hold it in Redis, alone, and A's release returns
// nil; the delayed release changed nothing (no holder after it is granted
// its place twice).
func TestReviewRelease49DelayedOne(t *testing.T) {
	const key = "r49o"
	ctx := context.Background()
	r := newR49Rig(t, false, 1, 30*time.Second, 100*time.Millisecond, 5*time.Second, 0)
	raw := r.srv.Client(t)
	held, err := r.b.Acquire(ctx, key)
	require.NoError(t, err)
	got := make(chan leasetest.Got, 1)
	e := &leasetest.Env{Rdb: r.rdb}
	leasetest.AcquireAsync(ctx, e, r.a, "A", key, got)
	leasetest.WaitFor(t, func() bool { return r.rdb.ZCard(ctx, r.key(key, "q")).Val() == 1 })
	var stash []any
	r.hook.setDo(func(ctx context.Context, kind, id string, cmd redis.Cmder, next redis.ProcessHook) (bool, error) {
		if kind != "release" || stash != nil {
			return false, nil
		}
		stash = cmd.Args()
		cmd.SetErr(leasetest.ErrLostRead)
		return true, leasetest.ErrLostRead
	})
	start := time.Now()
	require.Error(t, held.Release(ctx))
	var l *lease.Lease
	select {
	case g := <-got:
		require.NoError(t, g.Err)
		l = g.L
	case <-time.After(10 * time.Second):
		t.Fatal("A's waiter was not granted within 10 s of B's failed release (TTL 30 s)")
	}
	t.Logf("A's waiter granted %v after the failed release", time.Since(start).Round(time.Millisecond))
	require.Greater(t, l.Token(), held.Token())
	_, leaveRan := r.hook.count("leave", "", start)
	require.Positive(t, leaveRan, "B's leave call ran before A's grant")
	// The release, delayed past the leave call, runs now.
	require.NoError(t, raw.Do(ctx, stash...).Err())
	s := leasetest.Look(ctx, r.rdb, &leasetest.Env{Prefix: r.prefix}, key, l.Token())
	assert.True(t, s.Held, "A's lease still held in Redis after B's delayed release ran")
	assert.Len(t, r.holders(key), 1, "holders of %s", key)
	assert.False(t, leasetest.IsLost(l))
	assert.NoError(t, l.Release(ctx), "A's release")
	leave, _ := r.hook.count("leave", "", start)
	time.Sleep(500 * time.Millisecond)
	leave2, _ := r.hook.count("leave", "", start)
	assert.Equal(t, leave, leave2, "B's leave calls went on after one ran")
}

// TestReviewRelease49Stopped: B (N = 1, TTL 3 s, poll 100 ms) on a server
// of the test's own holds k; the server is stopped, and B's Release fails.
// Variants:
//   - long: Redis stays away 4.5 s (past the TTL); the leave calls the
//     hook sees are counted (at most one per poll interval: 30 in 3 s, and
//     a few more), none after the TTL; the keeper ends (no goroutine of
//     package lease, without Close); Close, Redis still away, returns
//     within 2 s.
//   - close: Close is called at once after the failed release, Redis
//     away: it returns within 5 s, no leave call after it, no goroutine
//     left.
//   - restart: Redis is restarted empty 500 ms after; the leave call then
//     runs (once, and no more are sent), nothing is held in Redis, and a
//     new Semaphore takes the key's lease at once.
func TestReviewRelease49Stopped(t *testing.T) {
	for _, variant := range []string{"long", "close", "restart"} {
		t.Run(variant, func(t *testing.T) {
			const key = "r49s"
			const ttl, poll = 3 * time.Second, 100 * time.Millisecond
			ctx := context.Background()
			r := newR49Rig(t, true, 1, ttl, poll, 200*time.Millisecond, 0)
			require.NoError(t, r.a.Close(ctx))
			held, err := r.b.Acquire(ctx, key)
			require.NoError(t, err)
			r.srv.Stop()
			start := time.Now()
			require.Error(t, held.Release(ctx))
			switch variant {
			case "long":
				time.Sleep(ttl + 500*time.Millisecond)
				n1, _ := r.hook.count("leave", "", start)
				time.Sleep(time.Second)
				n2, _ := r.hook.count("leave", "", start)
				t.Logf("leave calls seen by the hook: %d within the TTL and half a second, %d a second later", n1, n2)
				assert.LessOrEqual(t, n1, int(ttl/poll)+5, "leave calls: at most one per poll interval")
				assert.Positive(t, n1, "leave calls")
				assert.Equal(t, n1, n2, "leave calls after the TTL had passed")
				leasetest.Settled(t, 2*time.Second)
				cctx, cancel := context.WithTimeout(ctx, 10*time.Second)
				defer cancel()
				c0 := time.Now()
				assert.NoError(t, r.b.Close(cctx))
				assert.Less(t, time.Since(c0), 2*time.Second, "Close with Redis away")
			case "close":
				time.Sleep(150 * time.Millisecond)
				cctx, cancel := context.WithTimeout(ctx, 10*time.Second)
				defer cancel()
				c0 := time.Now()
				err := r.b.Close(cctx)
				took := time.Since(c0)
				t.Logf("Close, Redis away: %v, %v", took.Round(time.Millisecond), err)
				assert.Less(t, took, 5*time.Second, "Close with Redis away")
				n1, _ := r.hook.count("leave", "", time.Now())
				time.Sleep(500 * time.Millisecond)
				n2, _ := r.hook.count("leave", "", c0.Add(took))
				assert.Zero(t, n1+n2, "leave calls after Close returned")
				leasetest.Settled(t, 2*time.Second)
			case "restart":
				time.Sleep(500 * time.Millisecond)
				restarted := time.Now() // from the restart's beginning: a call may run before Restart returns
				r.srv.Restart(t)
				t.Logf("restarted %v after the failed release", restarted.Sub(start).Round(time.Millisecond))
				for i := 0; ; i++ {
					if _, ran := r.hook.count("leave", "", restarted); ran > 0 {
						break
					}
					if i == 500 {
						r.hook.mu.Lock()
						for _, c := range r.hook.calls {
							t.Logf("%v %s %s ran %v err %v", c.at.Sub(start).Round(time.Millisecond), c.kind, c.id, c.ran, c.err)
						}
						r.hook.mu.Unlock()
						t.Fatal("no leave call ran within 5 s of the restart")
					}
					time.Sleep(10 * time.Millisecond)
				}
				t.Logf("the leave call ran %v after the restart", time.Since(restarted).Round(time.Millisecond))
				time.Sleep(time.Second)
				n, ran := r.hook.count("leave", "", restarted)
				assert.Equal(t, 1, ran, "leave calls that ran after the restart")
				t.Logf("leave calls after the restart: %d (%d ran)", n, ran)
				assert.Empty(t, r.holders(key), "holders after the restart")
				leasetest.Settled(t, 2*time.Second)
				eng, err := throttle.New(r.rdb, throttle.WithPrefix(r.prefix), throttle.WithTimeout(5*time.Second))
				require.NoError(t, err)
				s2, err := lease.New(eng, "partner", 1, lease.WithTTL(ttl))
				require.NoError(t, err)
				leasetest.CloseAtEnd(t, s2)
				var l *lease.Lease
				var ok bool
				redistest.UntilOK(t, func() error {
					var err error
					l, ok, err = s2.TryAcquire(ctx, key)
					return err
				})
				require.True(t, ok, "TryAcquire after the restart")
				require.NoError(t, l.Release(ctx))
				require.NoError(t, r.b.Close(ctx))
			}
		})
	}
}

// TestReviewRelease49ManyKeys: B (N = 1, TTL 30 s, poll 100 ms) holds
// the lease of each of 200 keys; B's hook then fails every release and
// leave call unsent (Redis away), the 200 Releases fail at once, and 1 s
// later Redis answers again. Every lease is given back within 3 s (30
// poll intervals; the TTL is 30 s), and B's leave calls that ran number
// one per lease (at most two), its leave calls sent meanwhile at most one
// per poll interval and key.
func TestReviewRelease49ManyKeys(t *testing.T) {
	const nk = 200
	const poll = 100 * time.Millisecond
	ctx := context.Background()
	r := newR49Rig(t, false, 1, 30*time.Second, poll, 5*time.Second, 0)
	require.NoError(t, r.a.Close(ctx))
	var ls []*lease.Lease
	for i := range nk {
		l, err := r.b.Acquire(ctx, fmt.Sprint("r49m-", i))
		require.NoError(t, err)
		ls = append(ls, l)
	}
	var away atomic.Bool
	away.Store(true)
	r.hook.setDo(func(ctx context.Context, kind, id string, cmd redis.Cmder, next redis.ProcessHook) (bool, error) {
		if away.Load() && (kind == "release" || kind == "leave") {
			cmd.SetErr(leasetest.ErrNotSent)
			return true, leasetest.ErrNotSent
		}
		return false, nil
	})
	start := time.Now()
	var wg sync.WaitGroup
	var failed atomic.Int32
	for _, l := range ls {
		wg.Go(func() {
			if l.Release(ctx) != nil {
				failed.Add(1)
			}
		})
	}
	wg.Wait()
	require.EqualValues(t, nk, failed.Load(), "Releases that failed")
	time.Sleep(time.Second)
	awayFor := time.Since(start)
	away.Store(false)
	back := time.Now()
	left := func() int {
		n := 0
		for i := range nk {
			n += int(r.rdb.ZCard(ctx, r.key(fmt.Sprint("r49m-", i), "h")).Val())
		}
		return n
	}
	for left() > 0 && time.Since(back) < 10*time.Second {
		time.Sleep(20 * time.Millisecond)
	}
	took := time.Since(back)
	sentAway, _ := r.hook.count("leave", "", start)
	byID := r.hook.byID("leave", back)
	most := 0
	for _, c := range byID {
		most = max(most, c)
	}
	_, ran := r.hook.count("leave", "", back)
	t.Logf("every lease given back %v after Redis answered (%d left); leave calls while away %d over %v; after: %d ran, most for one id %d, ids %d",
		took.Round(time.Millisecond), left(), sentAway, awayFor.Round(time.Millisecond), ran, most, len(byID))
	assert.Zero(t, left(), "leases standing in Redis")
	assert.Less(t, took, 3*time.Second, "give-back after Redis answered")
	assert.LessOrEqual(t, most, 2, "leave calls of one lease after Redis answered")
	assert.LessOrEqual(t, ran, 2*nk, "leave calls that ran")
	leasetest.Settled(t, 3*time.Second)
}

// TestReviewRelease49Latency: B reaches Redis through a proxy adding 40
// ms each way (timeout 1 s); A's waiter is queued on k, held by B (N = 1,
// TTL 30 s, poll 100 ms). Control: B's Release succeeds. Then: B's
// Release fails unsent. On the Redis clock, A's waiter is granted within
// the control's delay plus a poll interval and a second (the TTL is 30
// s); the holders set never holds two.
func TestReviewRelease49Latency(t *testing.T) {
	ctx := context.Background()
	r := newR49Rig(t, false, 1, 30*time.Second, 100*time.Millisecond, time.Second, 40*time.Millisecond)
	var fail atomic.Bool
	r.hook.setDo(func(ctx context.Context, kind, id string, cmd redis.Cmder, next redis.ProcessHook) (bool, error) {
		if kind == "release" && fail.CompareAndSwap(true, false) {
			cmd.SetErr(leasetest.ErrNotSent)
			return true, leasetest.ErrNotSent
		}
		return false, nil
	})
	var most atomic.Int64
	stop := make(chan struct{})
	done := make(chan struct{})
	measure := func(key string, failing bool) time.Duration {
		held, err := r.b.Acquire(ctx, key)
		require.NoError(t, err)
		got := make(chan leasetest.Got, 1)
		leasetest.AcquireAsync(ctx, &leasetest.Env{Rdb: r.rdb}, r.a, "A", key, got)
		leasetest.WaitFor(t, func() bool { return r.rdb.ZCard(ctx, r.key(key, "q")).Val() == 1 })
		fail.Store(failing)
		t0 := leasetest.RedisNow(r.rdb)
		err = held.Release(ctx)
		if failing {
			require.Error(t, err)
		} else {
			require.NoError(t, err)
		}
		g := <-got
		require.NoError(t, g.Err)
		require.NoError(t, g.L.Release(ctx))
		return time.Duration(g.At-t0) * time.Microsecond
	}
	go func() {
		defer close(done)
		for {
			select {
			case <-stop:
				return
			default:
			}
			for _, k := range []string{"r49l-c", "r49l-f"} {
				most.Store(max(most.Load(), r.rdb.ZCard(ctx, r.key(k, "h")).Val()))
			}
			time.Sleep(2 * time.Millisecond)
		}
	}()
	control := measure("r49l-c", false)
	failed := measure("r49l-f", true)
	close(stop)
	<-done
	t.Logf("A's waiter granted %v after B's release (control), %v after B's failed release", control.Round(time.Millisecond), failed.Round(time.Millisecond))
	assert.Less(t, failed, control+100*time.Millisecond+time.Second)
	assert.LessOrEqual(t, most.Load(), int64(1), "holders at once")
}

// TestReviewRelease49Twice: B (N = 1, TTL 30 s, poll 100 ms) holds k, A
// waits for it. Variants:
//   - twice: the first Release fails unsent, the second (after it)
//     returns nil; A's waiter is granted soon; one leave call runs.
//   - racing: two Releases at once, one failed unsent by the hook.
//   - close: the Release fails unsent, and Close is called at once after
//     it; Close returns nil, A's waiter is granted before Close returns
//     or just after, no leave call after Close, no goroutine of B's left.
//   - closeRacing: Release (failed unsent, held 50 ms in the hook) and
//     Close at once.
func TestReviewRelease49Twice(t *testing.T) {
	for _, variant := range []string{"twice", "racing", "close", "closeRacing"} {
		t.Run(variant, func(t *testing.T) {
			key := "r49t-" + variant
			ctx := context.Background()
			r := newR49Rig(t, false, 1, 30*time.Second, 100*time.Millisecond, 5*time.Second, 0)
			held, err := r.b.Acquire(ctx, key)
			require.NoError(t, err)
			got := make(chan leasetest.Got, 1)
			leasetest.AcquireAsync(ctx, &leasetest.Env{Rdb: r.rdb}, r.a, "A", key, got)
			leasetest.WaitFor(t, func() bool { return r.rdb.ZCard(ctx, r.key(key, "q")).Val() == 1 })
			var fail atomic.Int32
			fail.Store(1)
			r.hook.setDo(func(ctx context.Context, kind, id string, cmd redis.Cmder, next redis.ProcessHook) (bool, error) {
				if kind == "release" && fail.Add(-1) == 0 {
					if variant == "closeRacing" {
						time.Sleep(50 * time.Millisecond)
					}
					cmd.SetErr(leasetest.ErrNotSent)
					return true, leasetest.ErrNotSent
				}
				return false, nil
			})
			start := time.Now()
			var closedAt time.Time
			switch variant {
			case "twice":
				require.Error(t, held.Release(ctx))
				require.NoError(t, held.Release(ctx))
			case "racing":
				var wg sync.WaitGroup
				errs := make([]error, 2)
				for i := range 2 {
					wg.Go(func() { errs[i] = held.Release(ctx) })
				}
				wg.Wait()
				t.Logf("the two Releases: %v, %v", errs[0], errs[1])
			case "close":
				require.Error(t, held.Release(ctx))
				require.NoError(t, r.b.Close(ctx))
				closedAt = time.Now()
			case "closeRacing":
				var wg sync.WaitGroup
				var rerr, cerr error
				wg.Go(func() { rerr = held.Release(ctx) })
				wg.Go(func() { time.Sleep(10 * time.Millisecond); cerr = r.b.Close(ctx) })
				wg.Wait()
				closedAt = time.Now()
				t.Logf("Release: %v; Close: %v", rerr, cerr)
				assert.NoError(t, cerr)
			}
			var l *lease.Lease
			select {
			case g := <-got:
				require.NoError(t, g.Err)
				l = g.L
			case <-time.After(10 * time.Second):
				t.Fatal("A's waiter not granted within 10 s (TTL 30 s)")
			}
			t.Logf("A's waiter granted %v after the Release", time.Since(start).Round(time.Millisecond))
			// Counted once the leave call's reply is surely in: A can be
			// granted (by the leave call's wake-up) before B's hook has
			// counted the call as run.
			time.Sleep(300 * time.Millisecond)
			all, allRan := r.hook.count("leave", "", start)
			t.Logf("B's leave calls: %d (%d ran)", all, allRan)
			assert.Equal(t, 1, allRan, "B's leave calls that ran")
			if !closedAt.IsZero() {
				after, _ := r.hook.count("leave", "", closedAt)
				assert.Zero(t, after, "B's leave calls after Close returned")
			}
			assert.Len(t, r.holders(key), 1)
			assert.True(t, leasetest.Look(ctx, r.rdb, &leasetest.Env{Prefix: r.prefix}, key, l.Token()).Held)
			require.NoError(t, l.Release(ctx))
		})
	}
}
