package lease_test

// Adversarial review (side 4, helper-65) of e581a28 (throttle: Engine.HoldConn) and
// e30b7a1 (lease: blocking reads through HoldConn; a grant reported in a
// reply timed from the call's sending plus the time left Redis reports).
// Public API only; Redis state is judged with Redis's own clock.

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"runtime"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/slotbook/slotbook/internal/redistest"
	"github.com/slotbook/slotbook/lease"
	"github.com/slotbook/slotbook/lease/internal/leasetest"
	"github.com/slotbook/slotbook/throttle"
)

// rv4Switch is a loopback TCP proxy that can be cut (every connection
// dropped, new ones accepted and closed at once: the client is cut off
// from Redis) and restored.
type rv4Switch struct {
	ln     net.Listener
	target string
	mu     sync.Mutex
	down   bool
	conns  map[net.Conn]struct{}
	wg     sync.WaitGroup
}

func rv4NewSwitch(t *testing.T, target string) *rv4Switch {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	p := &rv4Switch{ln: ln, target: target, conns: make(map[net.Conn]struct{})}
	p.wg.Add(1)
	go p.accept()
	t.Cleanup(func() {
		_ = ln.Close()
		p.cut()
		p.wg.Wait()
	})
	return p
}

func (p *rv4Switch) Addr() string { return p.ln.Addr().String() }

func (p *rv4Switch) accept() {
	defer p.wg.Done()
	for {
		c, err := p.ln.Accept()
		if err != nil {
			return
		}
		p.mu.Lock()
		down := p.down
		p.mu.Unlock()
		if down {
			_ = c.Close()
			continue
		}
		s, err := net.DialTimeout("tcp", p.target, 2*time.Second)
		if err != nil {
			_ = c.Close()
			continue
		}
		p.mu.Lock()
		p.conns[c] = struct{}{}
		p.conns[s] = struct{}{}
		p.mu.Unlock()
		p.wg.Add(2)
		go func() { defer p.wg.Done(); _, _ = io.Copy(s, c); _ = s.Close(); _ = c.Close() }()
		go func() { defer p.wg.Done(); _, _ = io.Copy(c, s); _ = s.Close(); _ = c.Close() }()
	}
}

// cut drops every connection and refuses new ones until restore.
func (p *rv4Switch) cut() {
	p.mu.Lock()
	p.down = true
	cs := p.conns
	p.conns = make(map[net.Conn]struct{})
	p.mu.Unlock()
	for c := range cs {
		_ = c.Close()
	}
}

func (p *rv4Switch) restore() {
	p.mu.Lock()
	p.down = false
	p.mu.Unlock()
}

type rv4Result struct {
	l   *lease.Lease
	err error
	at  time.Time
}

func rv4Acquire(ctx context.Context, s *lease.Semaphore, key string) <-chan rv4Result {
	ch := make(chan rv4Result, 1)
	go func() {
		l, err := s.Acquire(ctx, key)
		ch <- rv4Result{l, err, time.Now()}
	}()
	return ch
}

// --- 1a. A stale wake-up delivered after the waiter was queued again -----

// TestReviewLease4StaleWakeupOverlap: process B waits on a key; B is cut
// off from Redis (its pending BLPOP is dropped with its connection); A's
// Release grants B's waiter and pushes "id token" on B's wake-up list; B
// stays cut off past the TTL, so the grant lapses in Redis and A takes the
// lease again (N = 1). B comes back within a second (the list lives TTL +
// 1 s): its keeper's first call is the keep call, which finds the waiter
// neither granted nor queued and queues it again, refreshing its since;
// the blocking read that follows pops the stale wake-up and delivers a
// lease Redis does not hold, timed from that fresh since. B's Acquire then
// returns a lease (not ErrLost) while A holds the only one: two believed
// holders of N = 1.
func TestReviewLease4StaleWakeupOverlap(t *testing.T) {
	e := leasetest.NewEnv(t)
	ctx := context.Background()
	const ttl = 300 * time.Millisecond
	sA := leasetest.SemOn(t, e.Eng, 1, lease.WithTTL(ttl))

	sw := rv4NewSwitch(t, e.Srv.Addr)
	opts := e.Srv.Options()
	opts.Addr = sw.Addr()
	opts.PoolSize = 4
	opts.DialTimeout = 200 * time.Millisecond
	rdbB := redis.NewClient(opts)
	t.Cleanup(func() { _ = rdbB.Close() })
	hk := &rv4Log{start: time.Now()}
	rdbB.AddHook(hk)
	engB, err := throttle.New(rdbB, throttle.WithPrefix(e.Prefix), throttle.WithTimeout(200*time.Millisecond),
		throttle.WithProbeBackoff(time.Millisecond, time.Millisecond))
	require.NoError(t, err)
	sB := leasetest.SemOn(t, engB, 1, lease.WithTTL(ttl))

	var overlaps, lostAcq, other []string
	for i := range 2 {
		key := fmt.Sprint("stale", i)
		hA, err := sA.Acquire(ctx, key)
		require.NoError(t, err)
		bctx, cancel := context.WithTimeout(ctx, 3*time.Second)
		got := rv4Acquire(bctx, sB, key)
		e.Queued(t, key, 1)
		time.Sleep(150 * time.Millisecond) // B's keeper is blocking on its wake-up list
		sw.cut()
		time.Sleep(100 * time.Millisecond) // Redis drops the BLPOP with its connection
		require.NoError(t, hA.Release(ctx))
		lists, _ := e.Rdb.Keys(ctx, e.Key(key, "n:")+"*").Result()
		var pending int64
		for _, k := range lists {
			n, _ := e.Rdb.LLen(ctx, k).Result()
			pending += n
		}
		var cutTrace []string
		for t1 := time.Now(); time.Since(t1) < ttl+100*time.Millisecond; time.Sleep(40 * time.Millisecond) { // the grant to B's waiter lapses in Redis
			if testing.Verbose() && len(lists) > 0 {
				n, _ := e.Rdb.LLen(ctx, lists[0]).Result()
				pt, _ := e.Rdb.PTTL(ctx, lists[0]).Result()
				cutTrace = append(cutTrace, fmt.Sprintf("%v: %d/%v", time.Since(t1).Round(time.Millisecond), n, pt))
			}
		}
		llen := func() int64 {
			if len(lists) == 0 {
				return -1
			}
			n, _ := e.Rdb.LLen(ctx, lists[0]).Result()
			return n
		}
		before := llen()
		hA2, err := sA.Acquire(ctx, key)
		require.NoError(t, err, "A takes the lease B's waiter let lapse")
		after := llen()
		sw.restore()
		cutTrace = append(cutTrace, fmt.Sprintf("before A's Acquire %d, after %d, at the restore %d", before, after, llen()))
		var trace []string
		var r rv4Result
	watch:
		for t0 := time.Now(); ; {
			select {
			case r = <-got:
				break watch
			case <-time.After(50 * time.Millisecond):
			}
			if time.Since(t0) < 1500*time.Millisecond {
				var n int64
				for _, k := range lists {
					m, _ := e.Rdb.LLen(ctx, k).Result()
					n += m
				}
				q, _ := e.Rdb.ZCard(ctx, e.Key(key, "q")).Result()
				trace = append(trace, fmt.Sprintf("%v: wake-ups %d queue %d", time.Since(t0).Round(time.Millisecond), n, q))
			}
		}
		if testing.Verbose() {
			t.Logf("B's commands: %s", hk.take())
			t.Logf("during the cut: %v", cutTrace)
			t.Logf("trial %d: wake-ups pending after the Release %d (lists %v); after the restore: %v", i, pending, lists, trace)
		}
		cancel()
		switch {
		case r.err == nil:
			left, _ := redisLeft(ctx, e, key)
			_, bHeld := left[r.l.Token()]
			aOK, bOK := !leasetest.IsLost(hA2), !leasetest.IsLost(r.l)
			msg := fmt.Sprintf("trial %d: B's Acquire returned token %d (Lost closed: %v; held in Redis: %v), A holds token %d (Lost closed: %v); Redis holders %v; wake-ups pending at the cut %d",
				i, r.l.Token(), !bOK, bHeld, hA2.Token(), !aOK, left, pending)
			if aOK && bOK && !bHeld {
				overlaps = append(overlaps, msg)
			} else {
				other = append(other, msg)
			}
			_ = r.l.Release(ctx)
		case errors.Is(r.err, lease.ErrLost):
			lostAcq = append(lostAcq, fmt.Sprintf("trial %d: %v", i, r.err))
		default:
			other = append(other, fmt.Sprintf("trial %d: B's Acquire: %v", i, r.err))
		}
		_ = hA2.Release(ctx)
		if len(overlaps) >= 2 {
			break
		}
	}
	t.Logf("ErrLost answers (acceptable): %v", lostAcq)
	t.Logf("other outcomes: %v", other)
	if len(overlaps) > 0 {
		t.Errorf("two believed holders of N = 1 (a stale wake-up delivered after the keep call queued the waiter again):\n%s", strings.Join(overlaps, "\n"))
	}
}

// --- 1b. Lost closes before Redis lets the lease lapse, on every grant path

// rv4LostMargin pauses Redis's writes (scripts included; reads go on), so
// that l is no longer extended, waits for Lost, and returns how long Redis
// still held l when Lost closed (negative: Lost came after the lapse).
func rv4LostMargin(t *testing.T, rdb *redis.Client, e *leasetest.Env, key string, l *lease.Lease, ttl time.Duration) (time.Duration, bool) {
	ctx := context.Background()
	require.NoError(t, rdb.Do(ctx, "client", "pause", (3*ttl).Milliseconds(), "write").Err())
	defer rdb.Do(ctx, "client", "unpause")
	select {
	case <-l.Lost():
	case <-time.After(3 * ttl):
		t.Errorf("%s: Lost never closed while Redis's writes were paused", key)
		return 0, false
	}
	left, err := redisLeft(ctx, e, key)
	require.NoError(t, err)
	d, ok := left[l.Token()]
	return d, ok
}

// TestReviewLease4LostBeforeRedisLapse: for each way a lease is granted
// (Acquire's own reply, TryAcquire, a Release handing it to a waiter of
// the same process, a Release whose reply is lost so that a keep call
// finds the grant, another process's Release through the wake-up list,
// all with 40 ms latency each way on the holder's link) writes are paused
// right after the grant, and Lost must close while Redis still holds the
// lease.
func TestReviewLease4LostBeforeRedisLapse(t *testing.T) {
	srv := redistest.Start(t)
	srv.RequireReal(t)
	judge := srv.Client(t)
	const prefix = "rv4:"
	e := &leasetest.Env{Srv: srv, Rdb: judge, Prefix: prefix}
	ctx := context.Background()
	const ttl = time.Second

	direct, err := throttle.New(srv.Client(t), throttle.WithPrefix(prefix), throttle.WithTimeout(time.Second))
	require.NoError(t, err)
	other := leasetest.SemOn(t, direct, 1, lease.WithTTL(ttl))

	px := redistest.NewProxy(t, srv.Addr)
	rdb := px.Client(t, srv)
	eng, err := throttle.New(rdb, throttle.WithPrefix(prefix), throttle.WithTimeout(400*time.Millisecond))
	require.NoError(t, err)
	s := leasetest.SemOn(t, eng, 1, lease.WithTTL(ttl), lease.WithPollInterval(200*time.Millisecond))

	var bad []string
	check := func(name, key string, l *lease.Lease) {
		d, held := rv4LostMargin(t, judge, e, key, l, ttl)
		t.Logf("%s: Redis held the lease %v more when Lost closed (held: %v)", name, d, held)
		if !held || d <= 0 {
			bad = append(bad, fmt.Sprintf("%s: Lost closed %v after Redis let the lease lapse (held %v)", name, -d, held))
		}
		if err := l.Release(ctx); err != nil && !errors.Is(err, lease.ErrLost) {
			t.Logf("%s: Release: %v", name, err)
		}
		time.Sleep(600 * time.Millisecond) // the engine's breaker, opened by keep calls during the pause, closes
	}

	for _, lat := range []time.Duration{0, 40 * time.Millisecond} {
		px.SetLatency(lat)
		tag := fmt.Sprintf("latency %v", lat)

		key := "own" + fmt.Sprint(lat.Milliseconds())
		l, err := s.Acquire(ctx, key)
		require.NoError(t, err)
		check(tag+": Acquire's own reply", key, l)

		key = "try" + fmt.Sprint(lat.Milliseconds())
		l, ok, err := s.TryAcquire(ctx, key)
		require.NoError(t, err)
		require.True(t, ok)
		check(tag+": TryAcquire", key, l)

		key = "handon" + fmt.Sprint(lat.Milliseconds())
		h, err := s.Acquire(ctx, key)
		require.NoError(t, err)
		got := rv4Acquire(ctx, s, key)
		e.Queued(t, key, 1)
		time.Sleep(ttl / 2) // the waiter's since ages
		require.NoError(t, h.Release(ctx))
		r := <-got
		require.NoError(t, r.err)
		check(tag+": Release handing on in its reply", key, r.l)

		key = "found" + fmt.Sprint(lat.Milliseconds())
		h, err = s.Acquire(ctx, key)
		require.NoError(t, err)
		got = rv4Acquire(ctx, s, key)
		e.Queued(t, key, 1)
		time.Sleep(200 * time.Millisecond)       // the waiter's acquire reply is back
		px.SetReplyDelay(600 * time.Millisecond) // Release's reply is lost; the grant is found by a keep call
		rerr := h.Release(ctx)
		px.SetLatency(lat)
		t.Logf("%s: Release with its reply delayed past the timeout: %v (matches ErrReplyLost: %v)", tag, rerr, errors.Is(rerr, throttle.ErrReplyLost))
		r = <-got
		require.NoError(t, r.err)
		check(tag+": grant found by a keep call", key, r.l)

		key = "wake" + fmt.Sprint(lat.Milliseconds())
		h, err = other.Acquire(ctx, key)
		require.NoError(t, err)
		got = rv4Acquire(ctx, s, key)
		e.Queued(t, key, 1)
		time.Sleep(300 * time.Millisecond)
		require.NoError(t, h.Release(ctx))
		r = <-got
		require.NoError(t, r.err)
		check(tag+": another process's Release (wake-up list)", key, r.l)
	}
	require.Empty(t, bad)
}

// --- 1c. Acquire retried after lost replies: never two believed holders --

// TestReviewLease4LostRepliesNoOverlap: two processes contend for N = 1;
// one's link delays replies past its engine's timeout half the time (its
// Acquire, Release and leave calls lose their replies), the other is
// direct. Believed holding intervals (from Acquire's return to the
// holder's check of Lost before Release) must never overlap.
func TestReviewLease4LostRepliesNoOverlap(t *testing.T) {
	e := leasetest.NewEnv(t)
	ctx := context.Background()
	const ttl = 600 * time.Millisecond
	px := redistest.NewProxy(t, e.Srv.Addr)
	rdb := px.Client(t, e.Srv)
	eng, err := throttle.New(rdb, throttle.WithPrefix(e.Prefix), throttle.WithTimeout(60*time.Millisecond))
	require.NoError(t, err)
	sp := leasetest.SemOn(t, eng, 1, lease.WithTTL(ttl))
	sd := leasetest.SemOn(t, e.Eng, 1, lease.WithTTL(ttl))

	type iv struct {
		from, to time.Time
		who      string
		tok      int64
	}
	var mu sync.Mutex
	var ivs []iv
	var errs = map[string]int{}
	stop := make(chan struct{})
	var wg sync.WaitGroup
	go func() { // flap the reply delay
		for i := 0; ; i++ {
			select {
			case <-stop:
				px.SetReplyDelay(0)
				return
			case <-time.After(150 * time.Millisecond):
			}
			if i%2 == 0 {
				px.SetReplyDelay(100 * time.Millisecond)
			} else {
				px.SetReplyDelay(0)
			}
		}
	}()
	for _, p := range []struct {
		name string
		s    *lease.Semaphore
	}{{"proxied", sp}, {"proxied", sp}, {"direct", sd}, {"direct", sd}} {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				select {
				case <-stop:
					return
				default:
				}
				actx, cancel := context.WithTimeout(ctx, 2*time.Second)
				l, err := p.s.Acquire(actx, "k")
				cancel()
				from := time.Now()
				if err != nil {
					mu.Lock()
					errs[p.name+": "+strings.SplitN(err.Error(), ":", 3)[len(strings.SplitN(err.Error(), ":", 3))-1]]++
					mu.Unlock()
					time.Sleep(10 * time.Millisecond)
					continue
				}
				time.Sleep(20 * time.Millisecond)
				to := time.Now()
				lost := leasetest.IsLost(l)
				if !lost {
					mu.Lock()
					ivs = append(ivs, iv{from, to, p.name, l.Token()})
					mu.Unlock()
				}
				_ = l.Release(ctx)
			}
		}()
	}
	time.Sleep(8 * time.Second)
	close(stop)
	wg.Wait()
	sort.Slice(ivs, func(i, j int) bool { return ivs[i].from.Before(ivs[j].from) })
	var overlaps []string
	for i := 1; i < len(ivs); i++ {
		for j := i - 1; j >= 0 && j >= i-5; j-- {
			if ivs[j].to.After(ivs[i].from) {
				overlaps = append(overlaps, fmt.Sprintf("%s token %d [%v] and %s token %d [%v]", ivs[j].who, ivs[j].tok, ivs[j].to.Sub(ivs[i].from), ivs[i].who, ivs[i].tok, ""))
			}
		}
	}
	t.Logf("%d believed holds; errors %v", len(ivs), errs)
	require.Empty(t, overlaps, "overlapping believed holders of N = 1")
	require.Greater(t, len(ivs), 20)
}

// --- 2. Liveness with small pools; Close; leaks -------------------------

// TestReviewLease4SmallPoolLiveness: two processes, each on a client of
// PoolSize 1, 2 or 3, wait on 10 keys at once (2 goroutines per key and
// process, N = 1). Every lease is handed out, each hand-on reaches its
// waiter within about a poll interval, no lease is given up while Redis
// holds it for more than half its TTL, Close returns promptly, Redis
// keeps nothing but the counters after the TTL, no goroutine is left,
// and no HoldConn token leaks.
func TestReviewLease4SmallPoolLiveness(t *testing.T) {
	for _, pool := range []int{1, 2, 3} {
		t.Run(fmt.Sprint("pool", pool), func(t *testing.T) {
			e := leasetest.NewEnv(t)
			ctx := context.Background()
			const ttl, poll = 1500 * time.Millisecond, 150 * time.Millisecond
			const keys, per, run, hold = 10, 2, 4 * time.Second, 30 * time.Millisecond
			g0 := runtime.NumGoroutine()
			var sems []*lease.Semaphore
			var engs []*throttle.Engine
			var clients []*redis.Client
			for range 2 {
				o := e.Srv.Options()
				o.PoolSize = pool
				c := redis.NewClient(o)
				clients = append(clients, c)
				eng, err := throttle.New(c, throttle.WithPrefix(e.Prefix), throttle.WithTimeout(time.Second))
				require.NoError(t, err)
				engs = append(engs, eng)
				s, err := lease.New(eng, "partner", 1, lease.WithTTL(ttl), lease.WithPollInterval(poll))
				require.NoError(t, err)
				sems = append(sems, s)
			}
			type ev struct {
				acq, rel time.Time
			}
			var mu sync.Mutex
			evs := map[string][]ev{}
			var errs, falseLost []string
			grants := 0
			end := time.Now().Add(run)
			var wg sync.WaitGroup
			for k := range keys {
				key := fmt.Sprint("k", k)
				for _, s := range sems {
					for range per {
						wg.Add(1)
						go func() {
							defer wg.Done()
							for time.Now().Before(end) {
								actx, cancel := context.WithTimeout(ctx, 10*time.Second)
								l, err := s.Acquire(actx, key)
								cancel()
								at := time.Now()
								if err != nil {
									mu.Lock()
									errs = append(errs, err.Error())
									mu.Unlock()
									continue
								}
								select {
								case <-l.Lost():
									left, _ := redisLeft(ctx, e, key)
									mu.Lock()
									falseLost = append(falseLost, fmt.Sprintf("%s token %d: Lost with %v left in Redis", key, l.Token(), left[l.Token()]))
									mu.Unlock()
								case <-time.After(hold):
								}
								rel := time.Now()
								_ = l.Release(ctx)
								mu.Lock()
								evs[key] = append(evs[key], ev{at, rel})
								grants++
								mu.Unlock()
							}
						}()
					}
				}
			}
			wg.Wait()
			// Hand-on gaps: from a holder's Release to the next holder's
			// Acquire returning, while others wait (4 goroutines per key).
			var gaps []time.Duration
			for _, es := range evs {
				sort.Slice(es, func(i, j int) bool { return es[i].acq.Before(es[j].acq) })
				for i := 1; i < len(es); i++ {
					gaps = append(gaps, es[i].acq.Sub(es[i-1].rel))
				}
			}
			sort.Slice(gaps, func(i, j int) bool { return gaps[i] < gaps[j] })
			q := func(f float64) time.Duration {
				if len(gaps) == 0 {
					return 0
				}
				return gaps[int(f*float64(len(gaps)-1))]
			}
			t.Logf("pool %d: %d leases in %v; hand-on gap p50 %v p90 %v p99 %v max %v; errors %d", pool, grants, run, q(.5), q(.9), q(.99), q(1), len(errs))
			if len(errs) > 0 {
				t.Errorf("Acquire errors on a healthy Redis (%d), first: %v", len(errs), errs[0])
			}
			if len(falseLost) > 0 {
				t.Errorf("Lost on a healthy Redis: %v", falseLost)
			}
			if q(.99) > 3*poll+300*time.Millisecond {
				t.Errorf("hand-on gap p99 %v, more than a few poll intervals (%v)", q(.99), poll)
			}

			// HoldConn tokens after the run: as many as half the pool can
			// be had again, and no more (once the last blocking reads end).
			time.Sleep(poll + 200*time.Millisecond)
			for i, eng := range engs {
				var rels []func()
				for {
					rel, ok := eng.HoldConn(ctx, "partner:{k0}:lease:n:x")
					if !ok {
						break
					}
					rels = append(rels, rel)
					if len(rels) > pool {
						break
					}
				}
				if len(rels) != pool/2 {
					t.Errorf("engine %d: HoldConn granted %d tokens on an idle pool of %d, want %d", i, len(rels), pool, pool/2)
				}
				for _, r := range rels {
					r()
				}
			}

			// Close: promptly, repeatedly and concurrently.
			start := time.Now()
			var cw sync.WaitGroup
			for _, s := range sems {
				for range 3 {
					cw.Add(1)
					go func() {
						defer cw.Done()
						cctx, cancel := context.WithTimeout(ctx, 10*time.Second)
						defer cancel()
						if err := s.Close(cctx); err != nil {
							t.Errorf("Close: %v", err)
						}
					}()
				}
			}
			cw.Wait()
			took := time.Since(start)
			t.Logf("pool %d: Close took %v", pool, took)
			if took > 2*time.Second+2*poll {
				t.Errorf("Close took %v", took)
			}
			for _, s := range sems {
				_, err := s.Acquire(ctx, "k0")
				require.ErrorIs(t, err, lease.ErrClosed)
				_, _, err = s.TryAcquire(ctx, "k0")
				require.ErrorIs(t, err, lease.ErrClosed)
			}
			for _, c := range clients {
				_ = c.Close()
			}
			// Redis: nothing but the counters once the TTL (+1 s) has passed.
			time.Sleep(ttl + 1200*time.Millisecond)
			var left []string
			for _, k := range e.Keys(t) {
				if !strings.HasSuffix(k, ":lease:c") {
					left = append(left, k)
				}
			}
			if len(left) > 0 {
				t.Errorf("keys left in Redis %v after Close and the TTL: %v", ttl+1200*time.Millisecond, left)
			}
			var g1 int
			for range 50 {
				if g1 = runtime.NumGoroutine(); g1 <= g0+3 {
					break
				}
				time.Sleep(40 * time.Millisecond)
			}
			if g1 > g0+3 {
				buf := make([]byte, 1<<20)
				n := runtime.Stack(buf, true)
				t.Errorf("goroutines %d before, %d after Close:\n%s", g0, g1, rv4LeaseStacks(string(buf[:n])))
			}
		})
	}
}

func rv4LeaseStacks(all string) string {
	var out []string
	for _, g := range strings.Split(all, "\n\n") {
		if strings.Contains(g, "slotbook/lease.") || strings.Contains(g, "slotbook/throttle.") {
			out = append(out, g)
		}
	}
	return strings.Join(out, "\n\n")
}

// --- 3. A Ring: the pool size unknown --------------------------------------

// TestReviewLease4Ring: on a redis.Ring the engine knows no pool size, so
// HoldConn holds nothing and says ok. Leases still work (contention, a
// wake-up across processes). Then, as TestSmallPoolNoFalseLost does for a
// Client, more keys are waited on at once than the Ring's shard pool has
// connections (PoolSize 3, 6 keys): the doc (lease/doc.go, README) says
// blocking reads "hold at most half the pool, so that they never starve"
// the engine's calls, which on a Ring they do not.
func TestReviewLease4Ring(t *testing.T) {
	e := leasetest.NewEnv(t)
	ctx := context.Background()
	mk := func(pool int) *throttle.Engine {
		r := redis.NewRing(&redis.RingOptions{
			Addrs: map[string]string{"a": e.Srv.Addr}, ContextTimeoutEnabled: true,
			MaxRetries: -1, PoolSize: pool,
		})
		t.Cleanup(func() { _ = r.Close() })
		eng, err := throttle.New(r, throttle.WithPrefix(e.Prefix), throttle.WithTimeout(time.Second))
		require.NoError(t, err)
		return eng
	}
	eng := mk(0)
	rel, ok := eng.HoldConn(ctx, "partner:{r}:lease:n:x")
	require.True(t, ok, "HoldConn on a Ring")
	rel()
	a := leasetest.SemOn(t, eng, 1, lease.WithTTL(time.Second))
	b := leasetest.SemOn(t, mk(0), 1, lease.WithTTL(time.Second))
	h, err := a.Acquire(ctx, "r")
	require.NoError(t, err)
	got := rv4Acquire(ctx, b, "r")
	e.Queued(t, "r", 1)
	time.Sleep(100 * time.Millisecond)
	released := time.Now()
	require.NoError(t, h.Release(ctx))
	r := <-got
	require.NoError(t, r.err)
	t.Logf("Ring: wake-up across processes took %v (poll %v)", r.at.Sub(released), time.Second/3)
	require.NoError(t, r.l.Release(ctx))

	t.Run("small pool", func(t *testing.T) {
		eng := mk(3)
		const ttl = 3 * time.Second
		s := leasetest.SemOn(t, eng, 1, lease.WithTTL(ttl))
		const keys, per = 6, 3
		var mu sync.Mutex
		var errs []string
		grants := 0
		end := time.Now().Add(5 * time.Second)
		var wg sync.WaitGroup
		for k := range keys {
			key := fmt.Sprint("ring", k)
			for range per {
				wg.Add(1)
				go func() {
					defer wg.Done()
					for time.Now().Before(end) {
						actx, cancel := context.WithTimeout(ctx, 10*time.Second)
						l, err := s.Acquire(actx, key)
						cancel()
						if err != nil {
							mu.Lock()
							errs = append(errs, err.Error())
							mu.Unlock()
							time.Sleep(50 * time.Millisecond)
							continue
						}
						select {
						case <-l.Lost():
							mu.Lock()
							errs = append(errs, "Lost while held on a healthy Redis")
							mu.Unlock()
						case <-time.After(100 * time.Millisecond):
						}
						_ = l.Release(ctx)
						mu.Lock()
						grants++
						mu.Unlock()
					}
				}()
			}
		}
		wg.Wait()
		t.Logf("Ring PoolSize 3, %d keys waited on: %d leases, %d errors", keys, grants, len(errs))
		if len(errs) > 0 {
			t.Errorf("on a Ring of PoolSize 3 with %d keys waited on, a healthy Redis: %d errors, first %q (blocking reads are not bounded on a Ring, contrary to lease/doc.go's Cost paragraph and the README)", keys, len(errs), errs[0])
		}
	})
}

// --- 4. Odds and ends -----------------------------------------------------

// TestReviewLease4StarvedPoolEdges: PoolSize 2 (one blocking read), many
// keys waited on; TryAcquire on a free key still answers at once; Release
// after Close is a no-op; Close racing Releases and Acquires returns.
func TestReviewLease4StarvedPoolEdges(t *testing.T) {
	e := leasetest.NewEnv(t)
	ctx := context.Background()
	o := e.Srv.Options()
	o.PoolSize = 2
	c := redis.NewClient(o)
	t.Cleanup(func() { _ = c.Close() })
	eng, err := throttle.New(c, throttle.WithPrefix(e.Prefix), throttle.WithTimeout(time.Second))
	require.NoError(t, err)
	const ttl = 900 * time.Millisecond
	s, err := lease.New(eng, "partner", 1, lease.WithTTL(ttl))
	require.NoError(t, err)
	other := leasetest.SemOn(t, e.Eng, 1, lease.WithTTL(ttl))
	t0 := time.Now()
	t.Cleanup(func() { t.Logf("%v: cleanup ends", time.Since(t0)) })

	// 12 keys held elsewhere, waited on here.
	var holds []*lease.Lease
	var waits []<-chan rv4Result
	wctx, wcancel := context.WithCancel(ctx)
	defer wcancel()
	for k := range 12 {
		key := fmt.Sprint("e", k)
		h, err := other.Acquire(ctx, key)
		require.NoError(t, err)
		holds = append(holds, h)
		waits = append(waits, rv4Acquire(wctx, s, key), rv4Acquire(wctx, s, key))
	}
	leasetest.WaitFor(t, func() bool {
		for k := range 12 {
			if n, _ := e.Rdb.ZCard(ctx, e.Key(fmt.Sprint("e", k), "q")).Result(); n != 2 {
				return false
			}
		}
		return true
	})
	t.Logf("%v: 24 waiters queued", time.Since(t0))
	// TryAcquire of a free key, with every keeper busy.
	for i := range 20 {
		tctx, cancel := context.WithTimeout(ctx, 2*time.Second)
		l, ok, err := s.TryAcquire(tctx, fmt.Sprint("free", i%3))
		cancel()
		require.NoError(t, err)
		require.True(t, ok)
		require.NoError(t, l.Release(ctx))
	}
	t.Logf("%v: 20 TryAcquire done", time.Since(t0))
	// Hand every key on; each first waiter gets it.
	var got []*lease.Lease
	used := map[int]bool{}
	for i, h := range holds {
		require.NoError(t, h.Release(ctx))
		select {
		case r := <-waits[2*i]:
			require.NoError(t, r.err)
			got = append(got, r.l)
			used[2*i] = true
		case r := <-waits[2*i+1]:
			require.NoError(t, r.err)
			got = append(got, r.l)
			used[2*i+1] = true
		case <-time.After(5 * time.Second):
			t.Fatalf("key e%d: no waiter got the lease 5 s after its release", i)
		}
	}
	t.Logf("%v: 12 hand-ons done", time.Since(t0))
	// Close while half the holders release and the other waiters wait.
	var wg sync.WaitGroup
	for i, l := range got {
		if i%2 == 0 {
			wg.Add(1)
			go func() { defer wg.Done(); _ = l.Release(ctx) }()
		}
	}
	cctx, cancel := context.WithTimeout(ctx, 8*time.Second)
	defer cancel()
	var cerrs [3]error
	for i := range cerrs {
		wg.Add(1)
		go func() { defer wg.Done(); cerrs[i] = s.Close(cctx) }()
	}
	wg.Wait()
	for i, err := range cerrs {
		require.NoError(t, err, "Close %d", i)
	}
	t.Logf("%v: Close returned", time.Since(t0))
	for i, l := range got {
		select {
		case <-l.Lost():
		default:
			if i%2 == 1 { // not released before Close: Close gave it back
				t.Errorf("token %d: Lost open after Close", l.Token())
			}
		}
		if err := l.Release(ctx); err != nil && !errors.Is(err, lease.ErrLost) {
			t.Errorf("Release after Close: %v", err)
		}
	}
	n := 0
	for i, w := range waits {
		if used[i] {
			continue
		}
		select {
		case r := <-w:
			if r.err != nil && !errors.Is(r.err, lease.ErrClosed) {
				t.Errorf("waiter at Close: %v", r.err)
			}
			if r.err == nil {
				_ = r.l.Release(ctx)
			}
			n++
		case <-time.After(3 * time.Second):
		}
	}
	t.Logf("%d of %d remaining waiters answered after Close", n, len(waits)-len(got))
	if n != len(waits)-len(got) {
		t.Errorf("waiters still blocked 3 s after Close: %d", len(waits)-len(got)-n)
	}
	t.Cleanup(func() { t.Logf("%v: cleanup begins", time.Since(t0)) })
	// Nothing of this process left in any queue.
	for k := range 12 {
		ids, _ := e.Rdb.ZRange(ctx, e.Key(fmt.Sprint("e", k), "q"), 0, -1).Result()
		if len(ids) > 0 {
			t.Errorf("key e%d: queue %v after Close", k, ids)
		}
	}
}

// rv4Log records a client's commands, with their results, for diagnosis.
type rv4Log struct {
	start time.Time
	mu    sync.Mutex
	lines []string
}

func (h *rv4Log) DialHook(next redis.DialHook) redis.DialHook { return next }
func (h *rv4Log) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}
func (h *rv4Log) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		t0 := time.Since(h.start)
		err := next(ctx, cmd)
		name := cmd.Name()
		if name == "evalsha" || name == "eval" {
			name = fmt.Sprintf("%s(%d args)", name, len(cmd.Args()))
		}
		h.mu.Lock()
		h.lines = append(h.lines, fmt.Sprintf("%v-%v %s -> %v", t0.Round(time.Millisecond), time.Since(h.start).Round(time.Millisecond), name, func() string {
			s := fmt.Sprint(cmd)
			if len(s) > 160 {
				s = s[len(s)-160:]
			}
			return s
		}()))
		h.mu.Unlock()
		return err
	}
}

func (h *rv4Log) take() string {
	h.mu.Lock()
	defer h.mu.Unlock()
	s := strings.Join(h.lines, "\n")
	h.lines = nil
	return s
}
