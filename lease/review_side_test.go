package lease_test

// Adversarial review of package lease, through its public API only, against
// a real redis-server. The oracle is the package doc's definition: at most N
// believed holders of a key at any instant (a holder believes it holds from
// Acquire's return to its Release call, or until Lost is closed), fencing
// tokens increasing in grant order, arrival order for waiters, and an
// error from Acquire never leaving a lease held.

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/slotbook/slotbook/internal/redistest"
	"github.com/slotbook/slotbook/lease"
	"github.com/slotbook/slotbook/lease/internal/leasetest"
	"github.com/slotbook/slotbook/throttle"
)

// --- Bad input, repeats, Close -------------------------------------------

func TestReviewLeaseInvalidInputNoCall(t *testing.T) {
	e := leasetest.NewEnv(t)
	s := e.Sem(t, 2)
	closed := e.Sem(t, 2)
	require.NoError(t, closed.Close(context.Background()))
	before := e.Calls.Load()
	ctx := context.Background()
	long := strings.Repeat("x", throttle.MaxKeyLen)
	for name, f := range map[string]func() error{
		"ttl under MinTTL":  func() error { _, err := lease.New(e.Eng, "p", 1, lease.WithTTL(lease.MinTTL-1)); return err },
		"name with braces":  func() error { _, err := lease.New(e.Eng, "p{x}", 1); return err },
		"poll zero":         func() error { _, err := lease.New(e.Eng, "p", 1, lease.WithPollInterval(0)); return err },
		"nil observer":      func() error { _, err := lease.New(e.Eng, "p", 1, lease.WithObserver(nil)); return err },
		"key too long":      func() error { _, err := s.Acquire(ctx, long); return err },
		"try key too long":  func() error { _, _, err := s.TryAcquire(ctx, long); return err },
		"closed, empty key": func() error { _, err := closed.Acquire(ctx, ""); return err },
	} {
		if err := f(); !errors.Is(err, lease.ErrInvalid) {
			t.Errorf("%s: got %v, want ErrInvalid", name, err)
		}
	}
	if got := e.Calls.Load() - before; got != 0 {
		t.Errorf("bad input made %d Redis calls", got)
	}
	for name, f := range map[string]func() error{
		"Acquire":    func() error { _, err := closed.Acquire(ctx, "k"); return err },
		"TryAcquire": func() error { _, _, err := closed.TryAcquire(ctx, "k"); return err },
	} {
		if err := f(); !errors.Is(err, lease.ErrClosed) {
			t.Errorf("%s after Close: %v, want ErrClosed", name, err)
		}
	}
}

func TestReviewLeaseRepeats(t *testing.T) {
	e := leasetest.NewEnv(t)
	s, err := lease.New(e.Eng, "partner", 1, lease.WithTTL(300*time.Millisecond))
	require.NoError(t, err)
	ctx := context.Background()
	a, err := s.Acquire(ctx, "k")
	require.NoError(t, err)
	require.NoError(t, a.Release(ctx))
	require.NoError(t, a.Release(ctx), "second Release")
	b, err := s.Acquire(ctx, "k")
	require.NoError(t, err)
	require.Greater(t, b.Token(), a.Token())
	require.NoError(t, e.Rdb.Del(ctx, e.Key("k", "h")).Err()) // b lapses
	select {
	case <-b.Lost():
	case <-time.After(10 * time.Second):
		t.Fatal("Lost never closed")
	}
	require.ErrorIs(t, b.Release(ctx), lease.ErrLost)
	require.NoError(t, b.Release(ctx), "Release after ErrLost: released before")
	c, err := s.Acquire(ctx, "k")
	require.NoError(t, err)
	require.Greater(t, c.Token(), b.Token())
	require.NoError(t, s.Close(ctx))
	require.NoError(t, s.Close(ctx), "second Close")
	require.NoError(t, c.Release(ctx), "Release after Close")
	if n, _ := e.Rdb.ZCard(ctx, e.Key("k", "h")).Result(); n != 0 {
		t.Errorf("%d holders after Close", n)
	}
	leasetest.Settled(t, 5*time.Second)
}

// TryAcquire whose call is in flight when Close runs: the doc says Close
// releases held leases and waits for the keepers; a lease handed out after
// Close began is one Close never releases.
func TestReviewLeaseTryAcquireDuringClose(t *testing.T) {
	e := leasetest.NewEnv(t)
	p := redistest.NewProxy(t, e.Srv.Addr)
	sent := make(chan struct{}, 1)
	c := p.Client(t, e.Srv)
	c.AddHook(leasetest.Hook{Before: func(cmd redis.Cmder) {
		if a, _ := leasetest.ScriptArgs(cmd); len(a) >= 5 && fmt.Sprint(a[4]) == "try" {
			select {
			case sent <- struct{}{}:
			default:
			}
		}
	}})
	eng, err := throttle.New(c, throttle.WithPrefix(e.Prefix), throttle.WithTimeout(5*time.Second))
	require.NoError(t, err)
	s, err := lease.New(eng, "partner", 1, lease.WithTTL(3*time.Second))
	require.NoError(t, err)
	ctx := context.Background()
	require.NoError(t, s.Load(ctx))
	p.SetLatency(40 * time.Millisecond)

	type res struct {
		l   *lease.Lease
		ok  bool
		err error
	}
	got := make(chan res, 1)
	go func() { l, ok, err := s.TryAcquire(ctx, "k"); got <- res{l, ok, err} }()
	<-sent // the call is on its way: Close now
	cctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	closeErr := s.Close(cctx)
	r := <-got
	holders, _ := e.Rdb.ZCard(ctx, e.Key("k", "h")).Result()
	t.Logf("TryAcquire: ok=%v err=%v; Close: %v; holders in Redis after Close: %d", r.ok, r.err, closeErr, holders)
	if closeErr != nil {
		t.Errorf("Close did not finish: %v (its keeper never stops while the late lease is held)", closeErr)
	}
	if r.ok {
		t.Errorf("TryAcquire handed out lease token %d after Close began; Close did not release it", r.l.Token())
	}
	if holders != 0 {
		// Still extended by the keeper of a closed Semaphore?
		time.Sleep(4 * time.Second)
		if h2, _ := e.Rdb.ZCard(ctx, e.Key("k", "h")).Result(); h2 != 0 {
			t.Errorf("4 s (> TTL) after Close the closed Semaphore still holds %d lease(s) in Redis", h2)
		}
	}
	if r.l != nil {
		_ = r.l.Release(ctx) // lets the keeper end
	}
	_ = s.Close(ctx)
	leasetest.Settled(t, 5*time.Second)
}

// --- Lost replies --------------------------------------------------------

// An Acquire whose reply is lost: it leaves the queue (before it returns,
// or, when that call cannot be made, soon after: the doc), and an error
// never leaves the caller holding a lease.
func TestReviewLeaseLostAcquireReply(t *testing.T) {
	for _, contended := range []bool{false, true} {
		t.Run(fmt.Sprintf("contended=%v", contended), func(t *testing.T) {
			e := leasetest.NewEnv(t)
			ctx := context.Background()
			ttl := 3 * time.Second
			direct := leasetest.SemOn(t, e.Eng, 1, lease.WithTTL(ttl))
			require.NoError(t, direct.Load(ctx))
			var scripts atomic.Int64 // script calls handed to the client
			p, eng := leasetest.Proxied(t, e, 150*time.Millisecond, nil, leasetest.Hook{Before: func(cmd redis.Cmder) {
				if a, _ := leasetest.ScriptArgs(cmd); a != nil {
					scripts.Add(1)
				}
			}})
			s := leasetest.SemOn(t, eng, 1, lease.WithTTL(ttl), lease.WithPollInterval(200*time.Millisecond))
			require.NoError(t, s.Load(ctx)) // a pooled connection through the proxy: no handshake in the call
			var held *lease.Lease
			if contended {
				var err error
				held, err = direct.Acquire(ctx, "k")
				require.NoError(t, err)
			}
			p.SetReplyDelay(time.Second)
			before := scripts.Load()
			_, err := s.Acquire(ctx, "k")
			sent := scripts.Load() - before
			p.SetReplyDelay(0)
			require.Error(t, err)
			t.Logf("Acquire: %v (ErrReplyLost: %v); script calls sent by the Acquire: %d (acquire + leave = 2)",
				err, errors.Is(err, throttle.ErrReplyLost), sent)
			// The leave call the Acquire makes before it returns is
			// refused by the breaker its lost reply opened; the keeper
			// sends it again every poll interval (200 ms here). Redis
			// would drop the waiter by itself only after the TTL (3 s):
			// half of it tells the two apart.
			want := int64(0)
			if contended {
				want = 1
			}
			var q []string
			var h int64
			for deadline := time.Now().Add(ttl / 2); ; time.Sleep(10 * time.Millisecond) {
				q, _ = e.Rdb.ZRange(ctx, e.Key("k", "q"), 0, -1).Result()
				h, _ = e.Rdb.ZCard(ctx, e.Key("k", "h")).Result()
				if (len(q) == 0 && h == want) || time.Now().After(deadline) {
					break
				}
			}
			if len(q) != 0 {
				t.Errorf("TTL/2 after the failed Acquire returned, its waiter is still in the queue: %q", q)
			}
			if h != want {
				t.Errorf("TTL/2 after the failed Acquire returned, Redis has %d holders, want %d (the caller holds nothing)", h, want)
			}
			if held != nil {
				require.NoError(t, held.Release(ctx))
			}
			// Nobody believes they hold k: another process must get it now.
			other := leasetest.SemOn(t, e.Eng, 1, lease.WithTTL(ttl))
			l, ok, err := other.TryAcquire(ctx, "k")
			require.NoError(t, err)
			if !ok {
				tm, _ := e.Rdb.Time(ctx).Result()
				zs, _ := e.Rdb.ZRangeWithScores(ctx, e.Key("k", "h"), 0, -1).Result()
				for _, z := range zs {
					t.Errorf("no believed holder, yet TryAcquire fails: %v holds k for %v more (Redis clock)",
						z.Member, time.UnixMicro(int64(z.Score)).Sub(tm).Round(time.Millisecond))
				}
			} else {
				require.NoError(t, l.Release(ctx))
			}
		})
	}
}

// The caller's own deadline ending while the acquire call is in flight
// (no breaker verdict): the waiter leaves and nothing is held.
func TestReviewLeaseCallerDeadlineInFlight(t *testing.T) {
	e := leasetest.NewEnv(t)
	ctx := context.Background()
	p, eng := leasetest.Proxied(t, e, 5*time.Second, nil)
	s := leasetest.SemOn(t, eng, 1, lease.WithTTL(3*time.Second))
	require.NoError(t, s.Load(ctx))
	held, err := leasetest.SemOn(t, e.Eng, 1, lease.WithTTL(3*time.Second)).Acquire(ctx, "k2")
	require.NoError(t, err)
	p.SetLatency(40 * time.Millisecond)
	for _, key := range []string{"k", "k2"} {
		actx, cancel := context.WithTimeout(ctx, 50*time.Millisecond)
		_, err := s.Acquire(actx, key)
		cancel()
		require.Error(t, err)
		q, _ := e.Rdb.ZCard(ctx, e.Key(key, "q")).Result()
		h, _ := e.Rdb.ZCard(ctx, e.Key(key, "h")).Result()
		want := map[string]int64{"k": 0, "k2": 1}[key]
		if q != 0 || h != want {
			t.Errorf("%s: after %v: queue %d holders %d, want 0 and %d", key, err, q, h, want)
		}
	}
	require.NoError(t, held.Release(ctx))
}

// --- Keeper interleavings ------------------------------------------------

// rvKeepBlocker blocks, once armed, the first keep call that refreshes a
// waiter (closing caught), until resume is closed: the keeper goroutine
// delayed between taking its snapshot and reaching Redis. Used as a
// leasetest.Hook's Before (here and in review_side2_test.go).
type rvKeepBlocker struct {
	armed  atomic.Bool
	caught chan struct{}
	resume chan struct{}
}

func (b *rvKeepBlocker) match(cmd redis.Cmder) {
	a, _ := leasetest.ScriptArgs(cmd)
	if len(a) < 4 {
		return
	}
	h, ok := a[3].(int) // keep: ARGV[4] is a count; other scripts: an id
	if !ok || len(a) <= 4+h || !b.armed.CompareAndSwap(true, false) {
		return
	}
	close(b.caught)
	<-b.resume
}

func TestReviewLeaseKeepRequeuesGoneWaiter(t *testing.T) {
	for _, how := range []string{"cancelled", "granted-and-released"} {
		t.Run(how, func(t *testing.T) {
			e := leasetest.NewEnv(t)
			ctx := context.Background()
			ttl := 3 * time.Second
			blk := &rvKeepBlocker{caught: make(chan struct{}), resume: make(chan struct{})}
			eng := leasetest.Direct(t, e, 5*time.Second, leasetest.Hook{Before: blk.match})
			s := leasetest.SemOn(t, eng, 1, lease.WithTTL(ttl), lease.WithPollInterval(50*time.Millisecond))
			holderSem := s
			if how == "cancelled" {
				holderSem = leasetest.SemOn(t, e.Eng, 1, lease.WithTTL(ttl))
			}
			first, err := holderSem.Acquire(ctx, "k")
			require.NoError(t, err)
			wctx, cancel := context.WithCancel(ctx)
			defer cancel()
			type res struct {
				l   *lease.Lease
				err error
			}
			got := make(chan res, 1)
			go func() { l, err := s.Acquire(wctx, "k"); got <- res{l, err} }()
			e.Queued(t, "k", 1)
			blk.armed.Store(true)
			select {
			case <-blk.caught:
			case <-time.After(10 * time.Second):
				t.Fatal("no keep call refreshing the waiter")
			}
			if how == "cancelled" {
				// The waiter's leave call waits for the keep call out (the
				// room's calls are ordered), which goes out 50 ms on.
				cancel()
				time.AfterFunc(50*time.Millisecond, func() { close(blk.resume) })
				r := <-got
				require.ErrorIs(t, r.err, context.Canceled)
				require.NoError(t, first.Release(ctx))
			} else {
				require.NoError(t, first.Release(ctx)) // grants the waiter in its reply
				r := <-got
				require.NoError(t, r.err)
				require.NoError(t, r.l.Release(ctx))
				n, _ := e.Rdb.ZCard(ctx, e.Key("k", "q")).Result()
				h, _ := e.Rdb.ZCard(ctx, e.Key("k", "h")).Result()
				require.Zero(t, n+h, "before the delayed keep call: queue and holders empty")
				close(blk.resume) // the keep call goes out now
			}
			// Nobody believes they hold k, nobody waits: k must stay free.
			other := leasetest.SemOn(t, e.Eng, 1, lease.WithTTL(ttl))
			for i := 0; i < 20; i++ {
				time.Sleep(10 * time.Millisecond)
				l, ok, err := other.TryAcquire(ctx, "k")
				require.NoError(t, err)
				if !ok {
					hs, _ := e.Rdb.ZRangeWithScores(ctx, e.Key("k", "h"), 0, -1).Result()
					tm, _ := e.Rdb.Time(ctx).Result()
					for _, z := range hs {
						t.Errorf("no believed holder and no waiter, yet k is full: %v, a waiter that is gone, holds it for %v more (Redis clock)",
							z.Member, time.UnixMicro(int64(z.Score)).Sub(tm).Round(time.Millisecond))
					}
					return
				}
				require.NoError(t, l.Release(ctx))
			}
		})
	}
}

// --- Partition, restart --------------------------------------------------

// A holder cut off from Redis: its lease lapses after the TTL and another
// process takes it. The doc: a holder whose lease lapsed must see Lost.
func TestReviewLeasePartitionedHolderNeverLost(t *testing.T) {
	e := leasetest.NewEnv(t)
	ctx := context.Background()
	ttl := 300 * time.Millisecond
	p, eng := leasetest.Proxied(t, e, 100*time.Millisecond, nil)
	// A connection and the scripts first: on a busy machine the dial and
	// handshake of a first call can take more than the 100 ms timeout.
	redistest.UntilOK(t, func() error { return eng.Load(ctx) })
	s := leasetest.SemOn(t, eng, 1, lease.WithTTL(ttl))
	a, err := s.Acquire(ctx, "k")
	require.NoError(t, err)
	p.Close() // Redis unreachable for s from now on
	cut := time.Now()
	other := leasetest.SemOn(t, e.Eng, 1, lease.WithTTL(ttl))
	actx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	b, err := other.Acquire(actx, "k")
	require.NoError(t, err)
	grantedAfter := time.Since(cut)
	time.Sleep(3 * ttl)
	select {
	case <-a.Lost():
	default:
		t.Errorf("N=1, TTL %v: the other process was granted k %v after the cut, and %v later the cut-off holder's Lost is still open: two believed holders, and the first has no signal",
			ttl, grantedAfter.Round(time.Millisecond), (3 * ttl))
	}
	require.NoError(t, b.Release(ctx))
	// Close while Redis is away: it must end, and leave no goroutine.
	cctx, ccancel := context.WithTimeout(ctx, 5*time.Second)
	defer ccancel()
	t.Logf("Close while cut off: %v", s.Close(cctx))
	require.NoError(t, other.Close(ctx))
	leasetest.Settled(t, 5*time.Second)
}

// Redis restarted without persistence: holders learn (Lost). Fencing
// tokens start again (a documented limit of Redis without persistence).
func TestReviewLeaseRedisRestart(t *testing.T) {
	srv := redistest.Start(t)
	c := srv.Client(t)
	eng, err := throttle.New(c, throttle.WithPrefix("rv:"), throttle.WithTimeout(time.Second))
	require.NoError(t, err)
	ctx := context.Background()
	ttl := 600 * time.Millisecond
	s := leasetest.SemOn(t, eng, 1, lease.WithTTL(ttl))
	var top int64
	for range 5 {
		l, err := s.Acquire(ctx, "k")
		require.NoError(t, err)
		top = l.Token()
		require.NoError(t, l.Release(ctx))
	}
	a, err := s.Acquire(ctx, "k")
	require.NoError(t, err)
	srv.Restart(t)
	o := leasetest.SemOn(t, eng, 1, lease.WithTTL(ttl))
	var b *lease.Lease
	redistest.UntilOK(t, func() error {
		l, ok, err := o.TryAcquire(ctx, "k")
		if err == nil && !ok {
			err = errors.New("full")
		}
		b = l
		return err
	})
	select {
	case <-a.Lost():
	case <-time.After(10 * time.Second):
		t.Error("the holder from before the restart never saw Lost")
	}
	// Documented limit (doc.go, Keys): the counter lives in Redis, so a
	// restart without persistence starts the tokens again lower.
	t.Logf("after a restart of Redis without persistence the fencing tokens started again: %d granted after %d", b.Token(), max(a.Token(), top))
	require.NoError(t, b.Release(ctx))
	require.NoError(t, s.Close(ctx))
	require.NoError(t, o.Close(ctx))
	leasetest.Settled(t, 5*time.Second)
}

// --- Stress: overlap, tokens, cancellations, latency --------------------

func TestReviewLeaseStress(t *testing.T) {
	e := leasetest.NewEnv(t)
	ctx := context.Background()
	var givenUp atomic.Int64 // leases whose Lost closed while held
	const n = 2
	ttl := 3 * time.Second
	p, peng := leasetest.Proxied(t, e, 2*time.Second, nil)
	p.SetLatency(40 * time.Millisecond)
	// A second plain client for a second "process", so the two differ.
	c2 := e.Srv.Client(t)
	eng2, err := throttle.New(c2, throttle.WithPrefix(e.Prefix), throttle.WithTimeout(2*time.Second))
	require.NoError(t, err)
	sems := []*lease.Semaphore{
		leasetest.SemOn(t, e.Eng, n, lease.WithTTL(ttl), lease.WithPollInterval(30*time.Millisecond)),
		leasetest.SemOn(t, eng2, n, lease.WithTTL(ttl)),
		leasetest.SemOn(t, peng, n, lease.WithTTL(ttl), lease.WithPollInterval(50*time.Millisecond)),
		leasetest.SemOn(t, e.Eng, n, lease.WithTTL(ttl)), // two Semaphores on one engine
	}
	base := time.Now()
	type hold struct {
		callAt, from, to time.Duration
		token            int64
	}
	var (
		mu      sync.Mutex
		holds   []hold
		errs    []string
		cancels int
	)
	end := base.Add(4 * time.Second)
	var wg sync.WaitGroup
	for i, s := range sems {
		for w := range 4 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				rng := rand.New(rand.NewPCG(uint64(i), uint64(w)))
				for time.Now().Before(end) {
					call := time.Since(base)
					var l *lease.Lease
					var err error
					if rng.IntN(5) == 0 {
						var ok bool
						l, ok, err = s.TryAcquire(ctx, "k")
						if err == nil && !ok {
							continue
						}
					} else {
						actx, cancel := context.WithTimeout(ctx, time.Duration(5+rng.IntN(150))*time.Millisecond)
						l, err = s.Acquire(actx, "k")
						cancel()
					}
					if err != nil {
						mu.Lock()
						if errors.Is(err, context.DeadlineExceeded) {
							cancels++
						} else {
							errs = append(errs, err.Error())
						}
						mu.Unlock()
						continue
					}
					from := time.Since(base)
					time.Sleep(time.Duration(rng.IntN(8)) * time.Millisecond)
					to := time.Since(base)
					// Lost is strict (9/10 of the TTL after the grant's or
					// last extension's sending, on this process's clock): on a
					// starved machine a lease can be given up while held, and
					// its Release then says ErrLost. Counted, not a defect;
					// the overlap below is what must never happen.
					select {
					case <-l.Lost():
						givenUp.Add(1)
					default:
					}
					if err := l.Release(ctx); err != nil && !errors.Is(err, lease.ErrLost) {
						mu.Lock()
						errs = append(errs, "release: "+err.Error())
						mu.Unlock()
					}
					mu.Lock()
					holds = append(holds, hold{call, from, to, l.Token()})
					mu.Unlock()
				}
			}()
		}
	}
	wg.Wait()
	for _, m := range errs {
		t.Errorf("worker: %s", m)
	}
	t.Logf("leases given up (Lost) while held: %d", givenUp.Load())
	// Nobody holds or waits now: Redis must agree at once (no ghost), or,
	// for leases given up while held, once their keeper's leave call (every
	// poll interval, 1 s here at most) has gone.
	h, _ := e.Rdb.ZCard(ctx, e.Key("k", "h")).Result()
	q, _ := e.Rdb.ZCard(ctx, e.Key("k", "q")).Result()
	for end := time.Now().Add(3 * time.Second); givenUp.Load() > 0 && h+q != 0 && time.Now().Before(end); {
		time.Sleep(20 * time.Millisecond)
		h, _ = e.Rdb.ZCard(ctx, e.Key("k", "h")).Result()
		q, _ = e.Rdb.ZCard(ctx, e.Key("k", "q")).Result()
	}
	if h != 0 || q != 0 {
		t.Errorf("after every worker released or gave up: %d holders, %d queued in Redis", h, q)
	}
	var ivs []rvIv
	seen := map[int64]bool{}
	for _, x := range holds {
		if seen[x.token] {
			t.Errorf("token %d granted twice", x.token)
		}
		seen[x.token] = true
		ivs = append(ivs, rvIv{from: x.from, to: x.to, tok: x.token})
	}
	peak, _ := rvPeak(ivs, n)
	if peak > n {
		t.Errorf("%d believed holders overlapped, N = %d", peak, n)
	}
	// Tokens: a lease whose Acquire began after another's returned has
	// the larger token.
	byFrom := slices.Clone(holds)
	slices.SortFunc(byFrom, func(a, b hold) int { return int(a.from - b.from) })
	for _, x := range holds {
		i, _ := slices.BinarySearchFunc(byFrom, x.callAt, func(a hold, t time.Duration) int { return int(a.from - t) })
		for _, y := range byFrom[:i] {
			if y.token >= x.token {
				t.Errorf("token %d was granted to an Acquire that began after token %d's returned", x.token, y.token)
				break
			}
		}
	}
	t.Logf("%d holds, %d timed-out waits, peak %d", len(holds), cancels, peak)
	for _, s := range sems {
		require.NoError(t, s.Close(ctx))
	}
	leasetest.Settled(t, 5*time.Second)
}

// FIFO across semaphores (one behind 40 ms latency), with a waiter that
// gives up in the middle of the queue.
func TestReviewLeaseFIFOWithLatency(t *testing.T) {
	e := leasetest.NewEnv(t)
	ctx := context.Background()
	ttl := 5 * time.Second
	p, peng := leasetest.Proxied(t, e, 2*time.Second, nil)
	p.SetLatency(40 * time.Millisecond)
	sems := []*lease.Semaphore{
		leasetest.SemOn(t, e.Eng, 1, lease.WithTTL(ttl)),
		leasetest.SemOn(t, peng, 1, lease.WithTTL(ttl)),
		leasetest.SemOn(t, e.Eng, 1, lease.WithTTL(ttl), lease.WithPollInterval(20*time.Millisecond)),
	}
	held, err := sems[0].Acquire(ctx, "k")
	require.NoError(t, err)
	const waiters = 9
	type grant struct {
		i     int
		token int64
	}
	grants := make(chan grant, waiters)
	cancels := make([]context.CancelFunc, waiters)
	var wg sync.WaitGroup
	for i := range waiters {
		wctx, cancel := context.WithCancel(ctx)
		cancels[i] = cancel
		wg.Add(1)
		go func() {
			defer wg.Done()
			l, err := sems[i%3].Acquire(wctx, "k")
			if err != nil {
				return
			}
			grants <- grant{i, l.Token()}
			time.Sleep(5 * time.Millisecond)
			_ = l.Release(ctx)
		}()
		e.Queued(t, "k", int64(i+1))
	}
	cancels[4]()
	e.Queued(t, "k", waiters-1)
	require.NoError(t, held.Release(ctx))
	wg.Wait()
	close(grants)
	var gs []grant
	for g := range grants {
		gs = append(gs, g)
	}
	slices.SortFunc(gs, func(a, b grant) int { return int(a.token - b.token) })
	var order []string
	for _, g := range gs {
		order = append(order, strconv.Itoa(g.i))
	}
	if strings.Join(order, ",") != "0,1,2,3,5,6,7,8" {
		t.Errorf("grant order %v, want arrival order 0,1,2,3,5,6,7,8", order)
	}
	for _, c := range cancels {
		c()
	}
}

// Release racing the keeper's extension: the keep call carrying the lease
// reaches Redis after the release. Neither Lost nor ErrLost may follow.
func TestReviewLeaseReleaseRacesKeep(t *testing.T) {
	e := leasetest.NewEnv(t)
	ctx := context.Background()
	var armed atomic.Bool
	caught, resume := make(chan struct{}), make(chan struct{})
	eng := leasetest.Direct(t, e, 5*time.Second, leasetest.Hook{Before: func(cmd redis.Cmder) {
		if a, _ := leasetest.ScriptArgs(cmd); len(a) >= 5 {
			if h, ok := a[3].(int); ok && h >= 1 && armed.CompareAndSwap(true, false) {
				close(caught)
				<-resume
			}
		}
	}})
	s := leasetest.SemOn(t, eng, 2, lease.WithTTL(300*time.Millisecond))
	a, err := s.Acquire(ctx, "k")
	require.NoError(t, err)
	b, err := s.Acquire(ctx, "k")
	require.NoError(t, err)
	armed.Store(true)
	<-caught
	require.NoError(t, a.Release(ctx))
	close(resume)
	time.Sleep(400 * time.Millisecond) // more keeps, past a TTL
	select {
	case <-a.Lost():
		t.Error("Lost closed for a lease released normally")
	case <-b.Lost():
		t.Error("Lost closed for the other lease, still extended")
	default:
	}
	require.NoError(t, b.Release(ctx))
	require.NoError(t, s.Close(ctx))
	leasetest.Settled(t, 5*time.Second)
}

// Connections severed every 300 ms under load: at most N believed holders
// at any instant, and whatever is left in Redis drains within the TTL.
func TestReviewLeaseSeverUnderLoad(t *testing.T) {
	e := leasetest.NewEnv(t)
	ctx := context.Background()
	const n = 2
	ttl := 1500 * time.Millisecond
	p, peng := leasetest.Proxied(t, e, 300*time.Millisecond, nil)
	sems := []*lease.Semaphore{
		leasetest.SemOn(t, peng, n, lease.WithTTL(ttl)),
		leasetest.SemOn(t, e.Eng, n, lease.WithTTL(ttl)),
	}
	base := time.Now()
	end := base.Add(3 * time.Second)
	var mu sync.Mutex
	var evs [][2]time.Duration
	var lostSeen, acqErrs int
	var wg sync.WaitGroup
	for _, s := range sems {
		for range 4 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for time.Now().Before(end) {
					actx, cancel := context.WithTimeout(ctx, 500*time.Millisecond)
					l, err := s.Acquire(actx, "k")
					cancel()
					if err != nil {
						mu.Lock()
						acqErrs++
						mu.Unlock()
						time.Sleep(5 * time.Millisecond)
						continue
					}
					from := time.Since(base)
					time.Sleep(3 * time.Millisecond)
					to := time.Since(base)
					lost := false
					select {
					case <-l.Lost():
						lost = true
					default:
					}
					_ = l.Release(ctx)
					mu.Lock()
					if lost {
						lostSeen++
					} else {
						evs = append(evs, [2]time.Duration{from, to})
					}
					mu.Unlock()
				}
			}()
		}
	}
	stop := make(chan struct{})
	go func() {
		for {
			select {
			case <-stop:
				return
			case <-time.After(300 * time.Millisecond):
				p.Sever()
			}
		}
	}()
	wg.Wait()
	close(stop)
	var ivs []rvIv
	for _, x := range evs {
		ivs = append(ivs, rvIv{from: x[0], to: x[1]})
	}
	peak, _ := rvPeak(ivs, n)
	t.Logf("%d holds, %d acquire errors, %d lost, peak %d", len(evs), acqErrs, lostSeen, peak)
	if peak > n {
		t.Errorf("%d believed holders overlapped, N = %d", peak, n)
	}
	h0, _ := e.Rdb.ZCard(ctx, e.Key("k", "h")).Result()
	q0, _ := e.Rdb.ZCard(ctx, e.Key("k", "q")).Result()
	t.Logf("left in Redis right after every worker stopped: %d holders, %d queued (no believed holder)", h0, q0)
	leasetest.WaitFor(t, func() bool {
		l, ok, err := sems[1].TryAcquire(ctx, "k")
		if ok {
			_ = l.Release(ctx)
		}
		return err == nil && ok
	})
	for _, s := range sems {
		require.NoError(t, s.Close(ctx))
	}
	leasetest.Settled(t, 5*time.Second)
}
