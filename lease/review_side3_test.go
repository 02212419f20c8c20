package lease_test

// Third adversarial review of package lease (Lost waiting for an extension
// on its way, Close closing Lost, leave-again after Close), through the
// public API only, against a real redis-server. Oracle: the package doc.
// A holder believes it holds from Acquire's return until its Release call
// or until Lost is closed; at most N believed holders per key at once.
// Redis-side expiries are read as ZSCORE of name:{key}:lease:h (µs, Redis
// clock) and compared with Redis TIME read when Lost closes.

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/slotbook/slotbook/internal/redistest"
	"github.com/slotbook/slotbook/lease"
	"github.com/slotbook/slotbook/lease/internal/leasetest"
	"github.com/slotbook/slotbook/throttle"
)

// --- helpers (copies of the earlier reviews', under rv3 names; Redis's
// TIME and its logging are leasetest.RedisNow and leasetest.Ms) ---------

// rv3LostAt reports Redis's TIME when l's Lost closes.
func rv3LostAt(rdb *redis.Client, l *lease.Lease) <-chan int64 {
	ch := make(chan int64, 1)
	go func() {
		select {
		case <-l.Lost():
			ch <- leasetest.RedisNow(rdb)
		case <-time.After(5 * time.Second): // a lease that is never lost: no goroutine left behind
		}
	}()
	return ch
}

// rv3HoldOnGrant starts an Acquire of key on s within ctx; once granted,
// it sends Redis's TIME (µs) then and holds the lease until ctx ends.
func rv3HoldOnGrant(ctx context.Context, e *leasetest.Env, s *lease.Semaphore, key string) <-chan int64 {
	got := make(chan int64, 1)
	go func() {
		if l, err := s.Acquire(ctx, key); err == nil {
			got <- leasetest.RedisNow(e.Rdb)
			<-ctx.Done()
			_ = l.Release(context.Background())
		}
	}()
	return got
}

// rv3Live counts members of zset key scored after Redis's now (live
// holders for :h, live waiters for :w), and the latest score minus now.
var rv3LiveScript = redis.NewScript(`
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local n = redis.call('ZCOUNT', KEYS[1], '(' .. string.format('%d', now), '+inf')
local last = redis.call('ZRANGE', KEYS[1], -1, -1, 'WITHSCORES')
local left = 0
if #last == 2 then left = tonumber(last[2]) - now end
return {n, left}
`)

func rv3Live(rdb *redis.Client, key string) (n int64, left time.Duration) {
	v, err := rv3LiveScript.Run(context.Background(), rdb, []string{key}).Slice()
	if err != nil || len(v) != 2 {
		return -1, 0
	}
	n, _ = v[0].(int64)
	l, _ := v[1].(int64)
	return n, time.Duration(l) * time.Microsecond
}

// --- (a) Cut with a keep call out: how late is Lost? ---------------------

// Holder A (N=1, TTL 1 s, engine timeout 5 s) is cut off from Redis
// (both ways, or replies held forever) while another process B waits for
// the key. The doc: Lost is closed once the TTL has passed since the last
// successful extension was sent, no later than Redis lets the lease lapse
// and another process take its place, unless an extension is on its way
// then. Every cut catches a keep call on its way (one is sent every
// TTL/3 and may take the call's timeout), so Lost waits for that timeout
// while B holds the key.
func TestReviewLease3CutKeepCallOut(t *testing.T) {
	// A TTL of 1 s, not the 300 ms it was: on a starved machine (two
	// suites and more beside this one) the keeper's calls, every TTL/3,
	// came too late for 300 ms, and Lost closed before the cut, failing
	// the premise in both of two runs.
	const ttl = time.Second
	for _, tc := range []struct {
		name        string
		readTimeout time.Duration // 0: go-redis defaults (3 s read timeout bounds each call)
		replies     bool          // replies held forever (requests reach Redis); else both ways
	}{
		{"cut/clientDefaults", 0, false},
		{"cut/readTimeout30s", 30 * time.Second, false},
		{"repliesHeld/clientDefaults", 0, true},
		{"repliesHeld/readTimeout30s", 30 * time.Second, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			e := leasetest.NewEnv(t)
			ctx := context.Background()
			var tweak func(*redis.Options)
			if tc.readTimeout > 0 {
				tweak = func(o *redis.Options) { o.ReadTimeout, o.WriteTimeout = tc.readTimeout, tc.readTimeout }
			}
			var keepOut atomic.Int64 // keep calls of A out now
			p, aEng := leasetest.Proxied(t, e, 5*time.Second, tweak, rvKeepsOut(&keepOut))
			t.Cleanup(func() { p.SetLatency(0); p.SetReplyDelay(0); p.Sever() })
			a := leasetest.SemOn(t, aEng, 1, lease.WithTTL(ttl))
			b := leasetest.SemOn(t, e.Eng, 1, lease.WithTTL(ttl))
			require.NoError(t, a.Load(ctx))
			require.NoError(t, b.Load(ctx))
			l, err := a.Acquire(ctx, "k")
			require.NoError(t, err)
			time.Sleep(2*ttl + time.Duration(rand.IntN(100))*time.Millisecond)
			select {
			case <-l.Lost():
				t.Fatal("Lost closed before the cut, Redis healthy")
			default:
			}
			before := leasetest.Look(ctx, e.Rdb, e, "k", l.Token())
			if tc.replies {
				p.SetReplyDelay(time.Hour)
			} else {
				p.SetLatency(time.Hour)
			}
			cut := leasetest.RedisNow(e.Rdb)
			lostAt := rv3LostAt(e.Rdb, l)
			bGot := make(chan int64, 1)
			bctx, bcancel := context.WithTimeout(ctx, 40*time.Second)
			defer bcancel()
			var bl *lease.Lease
			bdone := make(chan struct{})
			go func() {
				defer close(bdone)
				var err error
				if bl, err = b.Acquire(bctx, "k"); err == nil {
					bGot <- leasetest.RedisNow(e.Rdb)
				}
			}()
			last := before
			var lost, bAt int64
			outAtExpiry := int64(-1)
			giveUp := time.Now().Add(40 * time.Second)
			for lost == 0 {
				if time.Now().After(giveUp) {
					t.Fatal("Lost never closed")
				}
				select {
				case lost = <-lostAt:
					continue
				case bAt = <-bGot:
				case <-time.After(3 * time.Millisecond):
				}
				if s := leasetest.Look(ctx, e.Rdb, e, "k", l.Token()); s.Held {
					last = s
				} else if outAtExpiry < 0 {
					outAtExpiry = keepOut.Load()
				}
			}
			if bAt == 0 {
				select {
				case bAt = <-bGot:
				case <-time.After(2 * ttl):
				}
			}
			t.Logf("%s: Redis expiry read before the cut: %v after the cut; final Redis expiry %v after the cut; keep calls of A out when Redis dropped the lease: %d; Lost closed %v after the final Redis expiry; B granted %v after it",
				tc.name, leasetest.Ms(before.Expiry-cut), leasetest.Ms(last.Expiry-cut), outAtExpiry, leasetest.Ms(lost-last.Expiry), leasetest.Ms(bAt-last.Expiry))
			if bAt != 0 && bAt < lost {
				t.Errorf("%s (N=1, TTL %v, engine timeout 5 s): holder A cut off from Redis kept Lost open %v after Redis's expiry of its lease (ZSCORE read before the cut: %v after the cut); process B was granted the key %v before A's Lost closed: two believed holders",
					tc.name, ttl, leasetest.Ms(lost-last.Expiry), leasetest.Ms(before.Expiry-cut), leasetest.Ms(lost-bAt))
			}
			bcancel()
			<-bdone
			if bl != nil {
				_ = bl.Release(ctx)
			}
		})
	}
	t.Cleanup(func() { leasetest.Settled(t, 15*time.Second) })
}

// --- (a) A lease delivered fresh while the keeper blocks on a dead BLPOP --

// Process A holds k (N=1) and has a waiter W queued; the keeper blocks in
// BLPOP. That one connection dies (its reply held forever: the proxy's
// reply delay is raised before the BLPOP goes out and lowered after its
// reply came in, so no other connection is hurt). A's holder releases;
// the release call's reply grants W (a grant to the calling process), W's
// last refresh being older than TTL/3: the lease is delivered "fresh", and
// lapse leaves it to the keeper, which is stuck in BLPOP until the
// client's read timeout. No extension is on its way; Redis is healthy.
func TestReviewLease3FreshLeaseDeadBlpop(t *testing.T) {
	for _, tc := range []struct {
		name string
		ttl  time.Duration
	}{
		{"fresh/ttl600ms", 600 * time.Millisecond},
		{"control-notFresh/ttl1200ms", 1200 * time.Millisecond}, // W refreshed < TTL/3 before the grant
		{"close/ttl600ms", 600 * time.Millisecond},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			e := leasetest.NewEnv(t)
			ctx := context.Background()
			var p *redistest.Proxy
			var armed atomic.Bool
			var blpopTook atomic.Int64
			hook := leasetest.Hook{
				Before: func(cmd redis.Cmder) {
					if cmd.Name() == "blpop" && armed.CompareAndSwap(true, false) {
						p.SetReplyDelay(time.Hour) // this connection's reply will be held forever
						blpopTook.Store(-1)
					}
				},
				After: func(cmd redis.Cmder, took time.Duration) {
					if cmd.Name() == "blpop" && blpopTook.Load() == -1 {
						blpopTook.Store(int64(took))
					}
				},
			}
			p, aEng := leasetest.Proxied(t, e, 5*time.Second, nil, hook)
			t.Cleanup(func() { p.SetReplyDelay(0); p.Sever() })
			a := leasetest.SemOn(t, aEng, 1, lease.WithTTL(tc.ttl), lease.WithPollInterval(50*time.Millisecond))
			b := leasetest.SemOn(t, e.Eng, 1, lease.WithTTL(tc.ttl))
			require.NoError(t, a.Load(ctx))
			require.NoError(t, b.Load(ctx))
			l0, err := a.Acquire(ctx, "k")
			require.NoError(t, err)
			wch := make(chan *lease.Lease, 1)
			go func() {
				l, err := a.Acquire(ctx, "k")
				if err != nil {
					wch <- nil
					return
				}
				wch <- l
			}()
			e.Queued(t, "k", 1)
			time.Sleep(100 * time.Millisecond)
			armed.Store(true)
			leasetest.WaitFor(t, func() bool { return blpopTook.Load() == -1 })
			time.Sleep(300 * time.Millisecond) // the BLPOP's nil reply (after <= 50 ms + Redis's tick) comes in, held
			p.SetReplyDelay(0)
			require.NoError(t, l0.Release(ctx)) // its reply grants W
			l1 := <-wch
			require.NotNil(t, l1)
			got := leasetest.RedisNow(e.Rdb)
			seen := leasetest.Look(ctx, e.Rdb, e, "k", l1.Token())
			lostAt := rv3LostAt(e.Rdb, l1)
			if tc.name == "close/ttl600ms" {
				cctx, cancel := context.WithTimeout(ctx, time.Second)
				t0 := time.Now()
				cerr := a.Close(cctx)
				took := time.Since(t0)
				cancel()
				select {
				case <-l1.Lost():
				default:
					t.Errorf("Close returned (%v) with the lease's Lost open", cerr)
				}
				t.Logf("close: Close(1 s ctx) with the keeper in a dead BLPOP returned %v after %v", cerr, took.Round(time.Millisecond))
				if took > 1500*time.Millisecond {
					t.Errorf("Close with a 1 s context returned after %v", took.Round(time.Millisecond))
				}
				h, _ := rv3Live(e.Rdb, e.Key("k", "h"))
				w, _ := rv3Live(e.Rdb, e.Key("k", "w"))
				if h+w != 0 {
					t.Errorf("after Close: %d live holders, %d live waiters in Redis", h, w)
				}
				return
			}
			bctx, bcancel := context.WithTimeout(ctx, 10*time.Second)
			defer bcancel()
			bGot := rv3HoldOnGrant(bctx, e, b, "k")
			var lost, bAt int64
			select {
			case lost = <-lostAt:
			case <-time.After(15 * time.Second):
				t.Fatal("Lost never closed")
			}
			select {
			case bAt = <-bGot:
			case <-time.After(tc.ttl):
			}
			bcancel()
			t.Logf("%s: W's lease handed out with %v left in Redis; dead BLPOP returned after %v; Lost closed %v after the Redis expiry; B granted %v after it",
				tc.name, leasetest.Ms(seen.Expiry-got), rv3Blpop(blpopTook.Load()), leasetest.Ms(lost-seen.Expiry), leasetest.Ms(bAt-seen.Expiry))
			if bAt != 0 && bAt < lost {
				t.Errorf("%s: Redis healthy but the keeper's BLPOP connection dead: the lease granted to W by A's own Release (delivered fresh) was never extended, Redis dropped it and B was granted the key %v before W's Lost closed (%v after the Redis expiry, no extension on its way): two believed holders, N=1",
					tc.name, leasetest.Ms(lost-bAt), leasetest.Ms(lost-seen.Expiry))
			}
			_ = l1.Release(ctx)
		})
	}
	t.Cleanup(func() { leasetest.Settled(t, 10*time.Second) })
}

func rv3Blpop(took int64) string {
	if took < 0 {
		return "(still blocked)"
	}
	return time.Duration(took).Round(time.Millisecond).String()
}

// --- (a)/(b) An acquire reply slower than the TTL -----------------------

// A's acquire call is granted at once in Redis, but its reply takes 400 ms
// (TTL 300 ms): Acquire hands out a lease whose TTL has passed since the
// call that granted it was sent, with no extension on its way. B, waiting
// behind it, gets the key once Redis drops it. Control: a 100 ms reply.
func TestReviewLease3SlowAcquireReply(t *testing.T) {
	const ttl = 300 * time.Millisecond
	for _, delay := range []time.Duration{100 * time.Millisecond, 400 * time.Millisecond} {
		t.Run(fmt.Sprintf("replyDelay=%v", delay), func(t *testing.T) {
			t.Parallel()
			e := leasetest.NewEnv(t)
			ctx := context.Background()
			p, aEng := leasetest.Proxied(t, e, 5*time.Second, nil)
			a := leasetest.SemOn(t, aEng, 1, lease.WithTTL(ttl))
			b := leasetest.SemOn(t, e.Eng, 1, lease.WithTTL(ttl))
			require.NoError(t, a.Load(ctx))
			require.NoError(t, b.Load(ctx))
			p.SetReplyDelay(delay)
			ach := make(chan *lease.Lease, 1)
			aerr := make(chan error, 1)
			go func() {
				l, err := a.Acquire(ctx, "k")
				aerr <- err
				ach <- l
			}()
			var expiry int64 // A's lease in Redis, read as soon as it is granted there
			leasetest.WaitFor(t, func() bool {
				z, _ := e.Rdb.ZRangeWithScores(ctx, e.Key("k", "h"), 0, -1).Result()
				if len(z) == 1 {
					expiry = int64(z[0].Score)
				}
				return len(z) == 1
			})
			bctx, bcancel := context.WithTimeout(ctx, 5*time.Second)
			defer bcancel()
			bGot := rv3HoldOnGrant(bctx, e, b, "k")
			err := <-aerr
			l := <-ach
			if delay > ttl {
				// The grant came back after its TTL: Acquire gives it back
				// and says so, rather than hand out a lease that may have
				// lapsed.
				require.ErrorIs(t, err, lease.ErrLost)
				return
			}
			require.NoError(t, err)
			require.NotNil(t, l)
			ret := leasetest.RedisNow(e.Rdb)
			openAtReturn := true
			select {
			case <-l.Lost():
				openAtReturn = false
			default:
			}
			seen := leasetest.Look(ctx, e.Rdb, e, "k", l.Token())
			lostAt := rv3LostAt(e.Rdb, l)
			var lost, bAt int64
			select {
			case lost = <-lostAt:
			case <-time.After(3 * time.Second):
			}
			select {
			case bAt = <-bGot:
			case <-time.After(500 * time.Millisecond):
			}
			bcancel()
			since := func(at int64) string {
				if at == 0 {
					return "never (within the wait)"
				}
				return leasetest.Ms(at - expiry).String()
			}
			t.Logf("reply delay %v: Acquire returned %v after the lease's Redis expiry, Lost open=%v, still a holder in Redis=%v; Lost closed after the Redis expiry: %v; B granted after it: %v",
				delay, leasetest.Ms(ret-expiry), openAtReturn, seen.Held, since(lost), since(bAt))
			if openAtReturn && bAt != 0 && (lost == 0 || bAt < lost) {
				t.Errorf("acquire reply %v > TTL %v: Acquire returned a lease %v after its Redis expiry (the TTL had passed since the granting call was sent, nothing on its way) with Lost open; B was granted the key %v after that expiry and %v before A's Lost closed (%v after the expiry): two believed holders, N=1",
					delay, ttl, leasetest.Ms(ret-expiry), leasetest.Ms(bAt-expiry), leasetest.Ms(lost-bAt), leasetest.Ms(lost-expiry))
			}
			_ = l.Release(ctx)
		})
	}
	t.Cleanup(func() { leasetest.Settled(t, 10*time.Second) })
}

// --- (b) At most N believed holders: severed connections, slow replies ---

func TestReviewLease3OverlapChaos(t *testing.T) {
	e := leasetest.NewEnv(t)
	ctx := context.Background()
	const n = 2
	// Lost comes a tenth of the TTL before Redis drops a lease: timers and
	// goroutines on a busy machine (this test runs beside the whole suite)
	// must be that punctual, so the TTL leaves them 150 ms.
	ttl := 1500 * time.Millisecond
	bel := &rvBelieved{held: map[int64]*lease.Lease{}, rdb: e.Rdb}
	p, aEng := leasetest.Proxied(t, e, time.Second, nil, bel.hook())
	bEng := leasetest.Direct(t, e, 2*time.Second, bel.hook())
	sems := []*lease.Semaphore{
		leasetest.SemOn(t, aEng, n, lease.WithTTL(ttl)),
		leasetest.SemOn(t, aEng, n, lease.WithTTL(ttl), lease.WithPollInterval(30*time.Millisecond)),
		leasetest.SemOn(t, bEng, n, lease.WithTTL(ttl)),
	}
	names := []string{"A1", "A2", "B"}
	base := time.Now()
	run := 8 * time.Second
	end := base.Add(run)
	var mu sync.Mutex
	var ivs []rvIv
	var lostN, errs, openAtReturn int
	var wg sync.WaitGroup
	for si, s := range sems {
		for w := range 3 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				rng := rand.New(rand.NewPCG(uint64(si)+100, uint64(w)))
				for time.Now().Before(end) {
					actx, cancel := context.WithTimeout(ctx, time.Duration(100+rng.IntN(900))*time.Millisecond)
					l, err := s.Acquire(actx, "k")
					cancel()
					if err != nil {
						mu.Lock()
						errs++
						mu.Unlock()
						time.Sleep(3 * time.Millisecond)
						continue
					}
					from, to, lost := rvBelieve(l, bel, base, time.Now().Add(time.Duration(rng.IntN(300))*time.Millisecond))
					rctx, rcancel := context.WithTimeout(ctx, 3*time.Second)
					_ = l.Release(rctx)
					rcancel()
					mu.Lock()
					ivs = append(ivs, rvIv{from, to, l.Token(), names[si]})
					if lost {
						lostN++
						if to > from {
							openAtReturn++
						}
					}
					mu.Unlock()
				}
			}()
		}
	}
	chaos := make(chan struct{})
	chaosDone := make(chan struct{})
	go func() {
		defer close(chaosDone)
		rng := rand.New(rand.NewPCG(3, 3))
		delays := []time.Duration{0, 0, 10 * time.Millisecond, 50 * time.Millisecond, 150 * time.Millisecond, 350 * time.Millisecond, 600 * time.Millisecond}
		for {
			select {
			case <-chaos:
				p.SetReplyDelay(0)
				return
			case <-time.After(time.Duration(100+rng.IntN(300)) * time.Millisecond):
				if rng.IntN(3) == 0 {
					p.Sever()
				} else {
					p.SetReplyDelay(delays[rng.IntN(len(delays))])
				}
			}
		}
	}()
	wg.Wait()
	close(chaos)
	<-chaosDone
	peak, bad := rvPeak(ivs, n)
	t.Logf("%d holds, %d Lost (%d seen open after Acquire returned), %d acquire errors/timeouts, peak %d believed holders", len(ivs), lostN, openAtReturn, errs, peak)
	if peak > n {
		t.Errorf("%d believed holders at once (N=%d; replies delayed up to 600 ms, engine timeout 1 s, TTL %v): %v", peak, n, ttl, bad)
	}
	if v := bel.viols.Load(); v > 0 {
		t.Errorf("%d leave/release calls for a lease still believed held; first: %v", v, bel.first.Load())
	}
	p.Sever()
	cctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	for _, s := range sems {
		require.NoError(t, s.Close(cctx))
	}
	time.Sleep(ttl + 100*time.Millisecond)
	h, _ := rv3Live(e.Rdb, e.Key("k", "h"))
	w, _ := rv3Live(e.Rdb, e.Key("k", "w"))
	if h+w != 0 {
		t.Errorf("a TTL after every Semaphore closed: %d live holders, %d live waiters in Redis", h, w)
	}
	leasetest.Settled(t, 10*time.Second)
}

// --- (c) Close while keep calls are out ---------------------------------

func TestReviewLease3CloseKeepCallsOut(t *testing.T) {
	e := leasetest.NewEnv(t)
	ctx := context.Background()
	ttl := 1200 * time.Millisecond
	var keepOut atomic.Int64
	p, aEng := leasetest.Proxied(t, e, 5*time.Second, nil, rvKeepsOut(&keepOut))
	a, err := lease.New(aEng, "partner", 1, lease.WithTTL(ttl), lease.WithPollInterval(60*time.Millisecond))
	require.NoError(t, err)
	b := leasetest.SemOn(t, e.Eng, 1, lease.WithTTL(ttl))
	require.NoError(t, a.Load(ctx))
	var held []*lease.Lease
	for _, k := range []string{"x", "y"} {
		l, err := a.Acquire(ctx, k)
		require.NoError(t, err)
		held = append(held, l)
	}
	bl, err := b.Acquire(ctx, "k")
	require.NoError(t, err)
	werrs := make(chan error, 3)
	for range 3 {
		go func() { _, err := a.Acquire(ctx, "k"); werrs <- err }()
	}
	e.Queued(t, "k", 3)
	p.SetReplyDelay(350 * time.Millisecond)
	leasetest.WaitFor(t, func() bool { return keepOut.Load() >= 2 })
	out := keepOut.Load()
	cctx, cancel := context.WithTimeout(ctx, 3*time.Second)
	t0 := time.Now()
	cerr := a.Close(cctx)
	took := time.Since(t0)
	cancel()
	t.Logf("Close with %d keep calls out (replies 350 ms late): %v after %v", out, cerr, took.Round(time.Millisecond))
	if took > 3500*time.Millisecond {
		t.Errorf("Close(3 s ctx) returned after %v", took)
	}
	for i, l := range held {
		select {
		case <-l.Lost():
		default:
			t.Errorf("lease %d: Lost open after Close", i)
		}
	}
	for range 3 {
		if err := <-werrs; !errors.Is(err, lease.ErrClosed) {
			t.Errorf("waiter: %v, want ErrClosed", err)
		}
	}
	p.SetReplyDelay(0)
	// B gives k back: the next holder should be nobody of the closed A.
	time.Sleep(400 * time.Millisecond) // every held-back reply and request is through
	require.NoError(t, bl.Release(ctx))
	time.Sleep(50 * time.Millisecond)
	for _, k := range []string{"k", "x", "y"} {
		h, hl := rv3Live(e.Rdb, e.Key(k, "h"))
		w, wl := rv3Live(e.Rdb, e.Key(k, "w"))
		if h+w != 0 {
			t.Errorf("key %s after the closed A's calls are all through and B released: %d live holders (%v left), %d live waiters (%v left): ghosts of the closed Semaphore", k, h, hl.Round(time.Millisecond), w, wl.Round(time.Millisecond))
		}
	}
	require.NoError(t, b.Close(ctx))
	leasetest.Settled(t, 5*time.Second)
}

// --- (c) Close while Redis is paused; ghosts after it resumes -------------

func TestReviewLease3CloseRedisPaused(t *testing.T) {
	srv := redistest.Start(t)
	c := srv.Client(t)
	eng, err := throttle.New(c, throttle.WithPrefix("rv3:"), throttle.WithTimeout(300*time.Millisecond))
	require.NoError(t, err)
	direct := srv.Client(t)
	e := &leasetest.Env{Srv: srv, Rdb: direct, Prefix: "rv3:"}
	ctx := context.Background()
	ttl := 900 * time.Millisecond
	a, err := lease.New(eng, "partner", 1, lease.WithTTL(ttl), lease.WithPollInterval(50*time.Millisecond))
	require.NoError(t, err)
	l, err := a.Acquire(ctx, "k")
	require.NoError(t, err)
	werrs := make(chan error, 2)
	for range 2 {
		go func() { _, err := a.Acquire(ctx, "k"); werrs <- err }()
	}
	e.Queued(t, "k", 2)
	time.Sleep(time.Duration(rand.IntN(60)) * time.Millisecond)
	require.NoError(t, syscall.Kill(srv.Pid(), syscall.SIGSTOP))
	paused := true
	defer func() {
		if paused {
			_ = syscall.Kill(srv.Pid(), syscall.SIGCONT)
		}
	}()
	time.Sleep(ttl / 2)
	cctx, cancel := context.WithTimeout(ctx, time.Second)
	t0 := time.Now()
	cerr := a.Close(cctx)
	took := time.Since(t0)
	cancel()
	t.Logf("Close(1 s ctx) with Redis paused: %v after %v", cerr, took.Round(time.Millisecond))
	if took > 1500*time.Millisecond {
		t.Errorf("Close(1 s ctx) with Redis paused returned after %v", took.Round(time.Millisecond))
	}
	select {
	case <-l.Lost():
	default:
		t.Errorf("Close returned with the held lease's Lost open")
	}
	for range 2 {
		if err := <-werrs; !errors.Is(err, lease.ErrClosed) {
			t.Errorf("waiter: %v, want ErrClosed", err)
		}
	}
	require.NoError(t, syscall.Kill(srv.Pid(), syscall.SIGCONT))
	paused = false
	resumed := time.Now()
	time.Sleep(100 * time.Millisecond) // what was sent while paused runs now
	h, hl := rv3Live(direct, e.Key("k", "h"))
	w, wl := rv3Live(direct, e.Key("k", "w"))
	t.Logf("100 ms after Redis resumed: %d live holders (latest expiry %v away), %d live waiters (%v away)", h, hl.Round(time.Millisecond), w, wl.Round(time.Millisecond))
	if hl > ttl+100*time.Millisecond || wl > ttl+100*time.Millisecond {
		t.Errorf("ghosts of the closed Semaphore outlive the TTL after Redis came back: holders %v, waiters %v left", hl, wl)
	}
	leasetest.Settled(t, 5*time.Second)
	time.Sleep(time.Until(resumed.Add(ttl + 150*time.Millisecond)))
	h, _ = rv3Live(direct, e.Key("k", "h"))
	w, _ = rv3Live(direct, e.Key("k", "w"))
	if h+w != 0 {
		t.Errorf("a TTL after Redis came back: %d live holders, %d live waiters of the closed Semaphore", h, w)
	}
}

// --- (d) Release racing the lapse timer and keep calls -------------------

func TestReviewLease3ReleaseRacesLapse(t *testing.T) {
	e := leasetest.NewEnv(t)
	ctx := context.Background()
	ttl := 60 * time.Millisecond
	bel := &rvBelieved{held: map[int64]*lease.Lease{}, rdb: e.Rdb}
	p, aEng := leasetest.Proxied(t, e, 2*time.Second, nil, bel.hook())
	p.SetLatency(3 * time.Millisecond)
	bEng := leasetest.Direct(t, e, 2*time.Second, bel.hook())
	sems := []*lease.Semaphore{leasetest.SemOn(t, aEng, 2, lease.WithTTL(ttl)), leasetest.SemOn(t, bEng, 2, lease.WithTTL(ttl))}
	end := time.Now().Add(4 * time.Second)
	var mu sync.Mutex
	outcomes := map[string]int{}
	var slowest time.Duration
	var bad []string
	var wg sync.WaitGroup
	for si, s := range sems {
		for w := range 3 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				rng := rand.New(rand.NewPCG(uint64(si)+7, uint64(w)))
				for time.Now().Before(end) {
					actx, cancel := context.WithTimeout(ctx, time.Second)
					l, err := s.Acquire(actx, "k")
					cancel()
					if err != nil {
						continue
					}
					bel.set(l, true)
					// Stall around the TTL, where the lapse timer and keep
					// calls race the Release.
					time.Sleep(ttl - 15*time.Millisecond + time.Duration(rng.IntN(40))*time.Millisecond)
					bel.set(l, false)
					rctx, rcancel := context.WithTimeout(ctx, 5*time.Second)
					var e1, e2 error
					var dwg sync.WaitGroup
					t0 := time.Now()
					dwg.Add(2)
					go func() { defer dwg.Done(); e1 = l.Release(rctx) }()
					go func() { defer dwg.Done(); e2 = l.Release(rctx) }()
					dwg.Wait()
					took := time.Since(t0)
					rcancel()
					mu.Lock()
					slowest = max(slowest, took)
					for _, err := range []error{e1, e2} {
						switch {
						case err == nil:
							outcomes["nil"]++
						case errors.Is(err, lease.ErrLost):
							outcomes["ErrLost"]++
						default:
							outcomes["other"]++
							if len(bad) < 3 {
								bad = append(bad, err.Error())
							}
						}
					}
					mu.Unlock()
					select {
					case <-l.Lost():
					default:
						if errors.Is(e1, lease.ErrLost) || errors.Is(e2, lease.ErrLost) {
							t.Errorf("Release returned ErrLost with Lost open")
						}
					}
				}
			}()
		}
	}
	wg.Wait()
	t.Logf("Release outcomes (two concurrent Releases per lease): %v; slowest pair %v; other errors %v", outcomes, slowest.Round(time.Millisecond), bad)
	if outcomes["other"] > 0 {
		t.Errorf("Release returned neither nil nor ErrLost %d times (Redis healthy): %v", outcomes["other"], bad)
	}
	if slowest > 4*time.Second {
		t.Errorf("a Release took %v", slowest)
	}
	if v := bel.viols.Load(); v > 0 {
		t.Errorf("%d leave/release calls for a lease still believed held; first: %v", v, bel.first.Load())
	}
	cctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	for _, s := range sems {
		require.NoError(t, s.Close(cctx))
	}
	leasetest.Settled(t, 5*time.Second)
}
