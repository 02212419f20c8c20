package leasereview_test

// Review of 5817548 (helper-145): every Lease.Release that sends its call
// keeps the lease's room while the call is out (room.out), and a release
// that fails once Close has begun owes the lease's leave call, which the
// room's keeper sends. Side paths, through package lease's public API and
// go-redis hooks on an engine's client (c48cHook): releases with Redis
// healthy and no Close (goroutines, calls per Release, rooms reused); a
// holder's Release whose call is out as Close begins, failing or not; a
// Release that fails before Close; Release twice or concurrently around
// Close; the observer's held count throughout.

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/slotbook/slotbook/internal/redistest"
	"github.com/slotbook/slotbook/lease"
	"github.com/slotbook/slotbook/lease/internal/leasetest"
	"github.com/slotbook/slotbook/throttle"
)

// c48dNewPair is c48cNewPair with n leases per key: A direct, B hooked
// and observed, scripts loaded.
func c48dNewPair(t *testing.T, n int, ttl, btimeout time.Duration) *c48cPair {
	t.Helper()
	ctx := context.Background()
	srv := redistest.Shared(t)
	srv.RequireReal(t)
	p := &c48cPair{rdb: srv.Client(t), prefix: redistest.Prefix(t), hook: newC48cHook(t), obs: &c48cObs{}}
	aEng, err := throttle.New(p.rdb, throttle.WithPrefix(p.prefix), throttle.WithTimeout(5*time.Second))
	require.NoError(t, err)
	p.a, err = lease.New(aEng, "partner", n, lease.WithTTL(ttl))
	require.NoError(t, err)
	leasetest.CloseAtEnd(t, p.a)
	c := srv.Client(t)
	c.AddHook(p.hook)
	bEng, err := throttle.New(c, throttle.WithPrefix(p.prefix), throttle.WithTimeout(btimeout))
	require.NoError(t, err)
	p.b, err = lease.New(bEng, "partner", n, lease.WithTTL(ttl), lease.WithObserver(p.obs))
	require.NoError(t, err)
	leasetest.CloseAtEnd(t, p.b)
	redistest.UntilOK(t, func() error { return p.a.Load(ctx) })
	redistest.UntilOK(t, func() error { return p.b.Load(ctx) })
	return p
}

// c48dCount counts B's recorded calls of kind, by id.
func c48dCount(p *c48cPair, kind string) map[string]int {
	p.hook.mu.Lock()
	defer p.hook.mu.Unlock()
	out := map[string]int{}
	for _, c := range p.hook.calls {
		if c.kind == kind {
			out[c.id]++
		}
	}
	return out
}

// c48dReset forgets B's recorded calls.
func c48dReset(p *c48cPair) {
	p.hook.mu.Lock()
	p.hook.calls = nil
	p.hook.mu.Unlock()
}

// TestReviewClose48dHealthyNoClose: B (N = 2, TTL 3 s) holds both leases
// of each of 16 keys; all 32 are released at once; then, on one key (N =
// 2), 6 goroutines Acquire and Release in a loop (20 times each), so
// that releases hand the place to B's own waiters. Five rounds; no Close
// until the end. Checks after each round: every Release returned nil;
// one release call per Release, no leave call; no holder left in Redis;
// once nothing is held or waited for, no goroutine of package lease
// (rooms and keepers gone, within 5 s); then TryAcquire on each of the
// 16 keys gets a lease at once (rooms reused normally), whose Release
// too leaves no goroutine; the observer's held count is 0, never
// negative.
func TestReviewClose48dHealthyNoClose(t *testing.T) {
	const nk, rounds, workers, loops = 16, 5, 6, 20
	ctx := context.Background()
	p := c48dNewPair(t, 2, 3*time.Second, 5*time.Second)
	for round := 0; round < rounds; round++ {
		c48dReset(p)
		var ls []*lease.Lease
		var keys []string
		for i := 0; i < nk; i++ {
			key := fmt.Sprint("c48dh", round, "-", i)
			keys = append(keys, key)
			for range 2 {
				l, err := p.b.Acquire(ctx, key)
				require.NoError(t, err)
				ls = append(ls, l)
			}
		}
		errs := make([]error, len(ls))
		var wg sync.WaitGroup
		for i, l := range ls {
			wg.Go(func() { errs[i] = l.Release(ctx) })
		}
		wg.Wait()
		for i, err := range errs {
			require.NoError(t, err, "round %d: Release %d", round, i)
		}
		if round == 0 {
			// Control: no waiter ever (the waker never ran).
			t.Logf("round 0: no goroutine of package lease %v after the 32 releases (no waiter)", leasetest.SettleTime(5*time.Second).Round(time.Millisecond))
		}
		loopKey := fmt.Sprint("c48dh", round, "-loop")
		var releases sync.Map
		var lerrs []error
		var lmu sync.Mutex
		for w := 0; w < workers; w++ {
			wg.Go(func() {
				for range loops {
					l, err := p.b.Acquire(ctx, loopKey)
					if err == nil {
						releases.Store(l.Token(), true)
						err = l.Release(ctx)
					}
					if err != nil {
						lmu.Lock()
						lerrs = append(lerrs, err)
						lmu.Unlock()
						return
					}
				}
			})
		}
		wg.Wait()
		require.Empty(t, lerrs, "round %d: the loop's Acquire and Release", round)
		rel, lv := c48dCount(p, "release"), c48dCount(p, "leave")
		total := 0
		for id, n := range rel {
			total += n
			assert.Equal(t, 1, n, "round %d: release calls for %s", round, id)
		}
		assert.Equal(t, len(ls)+workers*loops, total, "round %d: release calls, one per Release", round)
		assert.Empty(t, lv, "round %d: leave calls, Redis healthy and nothing given up", round)
		for _, key := range append(keys, loopKey) {
			assert.Empty(t, p.holders(key), "round %d: holders of %s in Redis", round, key)
		}
		settle := leasetest.SettleTime(5 * time.Second)
		t.Logf("round %d: %d release calls; no goroutine of package lease %v after the last Release", round, total, settle.Round(time.Millisecond))
		leasetest.Settled(t, 0)
		// The Semaphore reused for the same keys.
		for _, key := range keys {
			l, ok, err := p.b.TryAcquire(ctx, key)
			require.NoError(t, err)
			require.True(t, ok, "round %d: TryAcquire of %s after its leases were released", round, key)
			require.NoError(t, l.Release(ctx))
		}
		leasetest.Settled(t, 5*time.Second)
		p.obs.check(t, fmt.Sprint("round ", round))
	}
}

// TestReviewClose48dOutAtClose: B (N = 1, TTL 20 s) holds key K's lease,
// and A has a waiter queued on K; B has a waiter of its own on key G
// (held by A), whose Acquire returning ErrClosed tells that Close has
// begun. The holder calls Release; B's hook holds its call until Close
// (Background) has begun, then:
//   - unsent: fails it unsent (a refused dial);
//   - lostReply: lets it run, and reports its reply lost;
//   - canceled: waits for the holder's context to end (cancelled once
//     Close has begun), failing it with the context's error;
//   - ok: lets it run.
//
// Checks, once Close returned: Close returned nil (the holder's release
// is not Close's); B's lease does not stand in Redis; A's waiter is
// granted K without waiting out the TTL (on the Redis clock, well before
// B's lease's expiry); the holder's Release returned the failure (nil
// for ok); exactly one call of B's gave the lease back (the release, or
// for unsent and canceled a leave call); for ok no leave call for its id
// was sent; one release call for its id; the observer is balanced; no
// goroutine of package lease left once A is closed.
func TestReviewClose48dOutAtClose(t *testing.T) {
	for _, variant := range []string{"unsent", "lostReply", "canceled", "ok"} {
		t.Run(variant, func(t *testing.T) {
			const ttl = 20 * time.Second
			ctx := context.Background()
			p := c48dNewPair(t, 1, ttl, 5*time.Second)
			key, gate := "c48do-"+variant, "c48dg-"+variant
			lb, err := p.b.Acquire(ctx, key)
			require.NoError(t, err)
			expiry := p.look(t, key, lb.Token())
			la, err := p.a.Acquire(ctx, gate)
			require.NoError(t, err)
			gotA, gotG := make(chan c48cGot, 1), make(chan c48cGot, 1)
			go func() { l, err := p.a.Acquire(ctx, key); gotA <- c48cGot{l, err} }()
			leasetest.WaitFor(t, func() bool { return p.queued(key) == 1 })
			go func() { l, err := p.b.Acquire(ctx, gate); gotG <- c48cGot{l, err} }()
			leasetest.WaitFor(t, func() bool { return p.queued(gate) == 1 })

			in, closing := make(chan struct{}), make(chan struct{})
			hctx, hcancel := context.WithCancel(context.WithValue(ctx, c48cTag{}, "holder"))
			defer hcancel()
			p.hook.setPre(func(ctx context.Context, kind, _ string) error {
				if kind != "release" || ctx.Value(c48cTag{}) == nil {
					return nil
				}
				close(in)
				<-closing
				switch variant {
				case "unsent":
					return leasetest.ErrNotSent
				case "canceled":
					<-ctx.Done()
					return ctx.Err()
				}
				return nil
			})
			p.hook.setPost(func(ctx context.Context, kind, _ string, err error) error {
				if kind == "release" && ctx.Value(c48cTag{}) != nil && err == nil && variant == "lostReply" {
					return leasetest.ErrLostRead
				}
				return nil
			})
			herrc := make(chan error, 1)
			go func() { herrc <- lb.Release(hctx) }()
			leasetest.Recv(t, in, "the holder's release call")
			cerrc := make(chan error, 1)
			go func() { cerrc <- p.b.Close(ctx) }()
			g := leasetest.Recv(t, gotG, "B's waiter on the gate key")
			require.ErrorIs(t, g.err, lease.ErrClosed, "premise: Close has begun")
			if variant == "canceled" {
				hcancel()
			}
			close(closing)
			herr := leasetest.Recv(t, herrc, "the holder's Release")
			var cerr error
			select {
			case cerr = <-cerrc:
			case <-time.After(15 * time.Second):
				t.Fatal("Close(Background) did not return within 15 s")
			}
			seen := p.look(t, key, lb.Token())
			a := leasetest.Recv(t, gotA, "A's Acquire")
			require.NoError(t, a.err)
			aAt := leasetest.RedisNow(p.rdb)
			calls := p.hook.of(expiry.ID)
			gave, answered, sent := c48cGaveBack(calls)
			rels := 0
			for _, c := range calls {
				if c.kind == "release" {
					rels++
				}
			}
			t.Logf("%s: holder's Release %v; Close %v; B's calls for %s: %v; A granted with B's lease %v from expiry (Redis clock); observer %v",
				variant, herr, cerr, expiry.ID, calls, leasetest.Ms(expiry.Expiry-aAt), p.obs)
			if variant == "ok" {
				require.NoError(t, herr, "premise: the holder's release succeeded")
				assert.Zero(t, sent, "ok: leave calls for a lease whose release succeeded")
			} else {
				require.Error(t, herr, "premise: the holder's release failed")
				require.NotErrorIs(t, herr, lease.ErrLost, "premise: failed, not lapsed")
			}
			assert.NoError(t, cerr, "%s: Close(Background)", variant)
			assert.False(t, seen.Held, "%s: B's lease stands in Redis once Close returned nil (Redis holds it %v more)", variant, c48dMargin(seen))
			assert.Less(t, aAt, expiry.Expiry-int64(ttl/2/time.Microsecond), "%s: A granted K only near B's lease's expiry", variant)
			assert.Equal(t, 1, gave, "%s: calls of B's that gave the lease back in Redis", variant)
			assert.Equal(t, 1, rels, "%s: release calls for B's lease", variant)
			if variant == "unsent" || variant == "canceled" {
				assert.Equal(t, 1, answered, "%s: answered leave calls for B's lease", variant)
			}
			p.obs.check(t, variant)
			require.NoError(t, a.l.Release(ctx))
			require.NoError(t, la.Release(ctx))
			require.NoError(t, p.a.Close(ctx))
			leasetest.Settled(t, 5*time.Second)
		})
	}
}

// TestReviewClose48dFailBeforeClose: B (N = 1, TTL 3 s) holds key K's
// lease, A has a waiter queued on K. The holder's Release fails unsent
// (unsent: a refused dial; canceled: a context already ended) and
// returns; then B's Close(Background). Release's doc: "If the call fails
// ... the Semaphore gives it back with a leave call of its own" (at first,
// stop 48, it said the lease "lapses after the TTL", and this test
// checked that A waited for the lapse). Checks: Close returns before B's
// lease's expiry on the Redis clock, returns nil, and B sent no more than
// a few calls for K while closing (no spin); A's waiter is granted K
// before B's lease could have lapsed (the leave call gave it back); the
// observer is balanced; no goroutine of package lease left.
func TestReviewClose48dFailBeforeClose(t *testing.T) {
	for _, variant := range []string{"unsent", "canceled"} {
		t.Run(variant, func(t *testing.T) {
			const ttl = 3 * time.Second
			ctx := context.Background()
			p := c48dNewPair(t, 1, ttl, 5*time.Second)
			key := "c48df-" + variant
			lb, err := p.b.Acquire(ctx, key)
			require.NoError(t, err)
			gotA := make(chan c48cGot, 1)
			go func() { l, err := p.a.Acquire(ctx, key); gotA <- c48cGot{l, err} }()
			leasetest.WaitFor(t, func() bool { return p.queued(key) == 1 })
			hctx := context.WithValue(ctx, c48cTag{}, "holder")
			if variant == "unsent" {
				p.hook.setPre(func(ctx context.Context, kind, _ string) error {
					if kind == "release" && ctx.Value(c48cTag{}) != nil {
						return leasetest.ErrNotSent
					}
					return nil
				})
			} else {
				var cancel context.CancelFunc
				hctx, cancel = context.WithCancel(hctx)
				cancel()
			}
			herr := lb.Release(hctx)
			require.Error(t, herr, "premise: the holder's Release failed")
			require.NotErrorIs(t, herr, lease.ErrLost)
			seen := p.look(t, key, lb.Token())
			require.True(t, seen.Held, "premise: B's lease stands in Redis after the failed Release")
			before := len(p.hook.onKey(key))
			cerr := p.b.Close(ctx)
			closedAt := leasetest.RedisNow(p.rdb)
			during := p.hook.onKey(key)[before:]
			t.Logf("%s: holder's Release %v; Close %v, returned %v before the lease's expiry (Redis clock); B's calls for K during Close %v",
				variant, herr, cerr, leasetest.Ms(seen.Expiry-closedAt), during)
			assert.NoError(t, cerr, "%s: Close", variant)
			assert.Less(t, closedAt, seen.Expiry, "%s: Close returned only once the lease had lapsed", variant)
			assert.LessOrEqual(t, len(during), 3, "%s: B's calls for K during Close", variant)
			a := leasetest.Recv(t, gotA, "A's Acquire")
			require.NoError(t, a.err)
			aAt := leasetest.RedisNow(p.rdb)
			t.Logf("%s: A granted %v before B's lease's expiry (Redis clock)", variant, leasetest.Ms(seen.Expiry-aAt))
			assert.Less(t, aAt, seen.Expiry, "%s: A granted K only once B's lease had lapsed: the failed release was not given back", variant)
			p.obs.check(t, variant)
			require.NoError(t, a.l.Release(ctx))
			require.NoError(t, p.a.Close(ctx))
			leasetest.Settled(t, 5*time.Second)
		})
	}
}

// TestReviewClose48dDoubleRelease: B (N = 1, TTL 20 s) holds the lease of
// each of 16 keys. For each lease, two Releases of the holder's start
// together with B's Close(Background), and a third after Close returned.
// Variants: ok (Redis healthy); fail (every holder's release call fails
// unsent: a refused dial). Ten rounds. Checks: no panic; Close returns
// (within 15 s), nil for ok; every holder's Release returns nil, ErrLost,
// or (fail) a failure; per lease at most one release call reached B's
// client, and at most one call of B's gave it back in Redis; once Close
// returned, no lease stands in Redis (fail: a failed release either went
// before Close began, and lapses, or owes a leave: counted apart, checked
// to stand only if it went before); the observer is balanced; no
// goroutine of package lease left.
func TestReviewClose48dDoubleRelease(t *testing.T) {
	const nk, rounds = 16, 10
	for _, variant := range []string{"ok", "fail"} {
		t.Run(variant, func(t *testing.T) {
			ctx := context.Background()
			var lapsing, total int
			for round := 0; round < rounds; round++ {
				p := c48dNewPair(t, 1, 20*time.Second, 5*time.Second)
				var ls []*lease.Lease
				var keys []string
				for i := 0; i < nk; i++ {
					key := fmt.Sprint("c48dd", round, "-", i)
					l, err := p.b.Acquire(ctx, key)
					require.NoError(t, err)
					ls = append(ls, l)
					keys = append(keys, key)
				}
				hctx := context.WithValue(ctx, c48cTag{}, "holder")
				if variant == "fail" {
					p.hook.setPre(func(ctx context.Context, kind, _ string) error {
						if kind == "release" && ctx.Value(c48cTag{}) != nil {
							return leasetest.ErrNotSent
						}
						return nil
					})
				}
				start := make(chan struct{})
				herrs := make([][3]error, nk)
				var wg sync.WaitGroup
				for i, l := range ls {
					for j := range 2 {
						wg.Go(func() { <-start; herrs[i][j] = l.Release(hctx) })
					}
				}
				cerrc := make(chan error, 1)
				close(start)
				go func() { cerrc <- p.b.Close(ctx) }()
				var cerr error
				select {
				case cerr = <-cerrc:
				case <-time.After(15 * time.Second):
					t.Fatalf("round %d: Close did not return within 15 s", round)
				}
				wg.Wait()
				for i, l := range ls {
					herrs[i][2] = l.Release(hctx)
				}
				var stand, twice []string
				for i, l := range ls {
					total++
					s := p.look(t, keys[i], l.Token())
					calls := p.hook.of(s.ID)
					gave, _, _ := c48cGaveBack(calls)
					rels, leaves := 0, 0
					for _, c := range calls {
						switch c.kind {
						case "release":
							rels++
						case "leave":
							leaves++
						}
					}
					for j, err := range herrs[i] {
						if err != nil && !errors.Is(err, lease.ErrLost) {
							assert.Equal(t, "fail", variant, "round %d: %s: holder's Release %d: %v", round, keys[i], j, err)
						}
					}
					if rels > 1 || gave > 1 {
						twice = append(twice, fmt.Sprintf("%s %v", keys[i], calls))
					}
					if s.Held {
						if variant == "fail" && leaves == 0 && !leasetest.IsLost(l) {
							lapsing++ // the holder's failed release went before Close began: it lapses
							continue
						}
						stand = append(stand, fmt.Sprintf("%s (Redis holds it %v more; Lost %v; holder's %v) %v",
							keys[i], c48dMargin(s), leasetest.IsLost(l), herrs[i], calls))
					}
				}
				if variant == "ok" {
					assert.NoError(t, cerr, "round %d: Close", round)
				}
				assert.Empty(t, twice, "round %d: leases with more than one release call, or given back twice", round)
				assert.Empty(t, stand, "round %d: leases standing once Close(Background) returned (Close %v)", round, cerr)
				p.obs.check(t, fmt.Sprint("round ", round))
				require.NoError(t, p.a.Close(ctx))
				leasetest.Settled(t, 5*time.Second)
			}
			t.Logf("%s: %d leases; failed releases before Close began, left to lapse: %d", variant, total, lapsing)
		})
	}
}

func c48dMargin(s leasetest.Seen) time.Duration {
	if !s.Held {
		return 0
	}
	return s.Margin().Round(time.Millisecond)
}

// TestReviewClose48dOutAtClosingGaveUp: as OutAtClose/unsent, but the
// first Close has a context of 100 ms, which ends while the holder's
// release call is held (premise: it returns DeadlineExceeded, and its
// keepers end); then the call fails unsent. A retry Close(Background)
// follows: after the holder's Release returned (after), or before the
// call is let go (during). Close's doc: the calls still owed "wait for a
// Close called after (a retry), which sends them as the first would
// have". Checks, once the retry returned nil: B's lease does not stand
// in Redis; one leave call for it was answered; the observer is
// balanced; no goroutine of package lease left.
func TestReviewClose48dOutAtClosingGaveUp(t *testing.T) {
	for _, variant := range []string{"after", "during"} {
		t.Run(variant, func(t *testing.T) {
			ctx := context.Background()
			p := c48dNewPair(t, 1, 20*time.Second, 5*time.Second)
			key := "c48dr-" + variant
			lb, err := p.b.Acquire(ctx, key)
			require.NoError(t, err)
			id := p.look(t, key, lb.Token()).ID
			in, goOn := make(chan struct{}), make(chan struct{})
			p.hook.setPre(func(ctx context.Context, kind, _ string) error {
				if kind != "release" || ctx.Value(c48cTag{}) == nil {
					return nil
				}
				close(in)
				<-goOn
				return leasetest.ErrNotSent
			})
			herrc := make(chan error, 1)
			go func() { herrc <- lb.Release(context.WithValue(ctx, c48cTag{}, "holder")) }()
			leasetest.Recv(t, in, "the holder's release call")
			c1, cancel := context.WithTimeout(ctx, 100*time.Millisecond)
			first := p.b.Close(c1)
			cancel()
			require.ErrorIs(t, first, context.DeadlineExceeded, "premise: the first Close gave up while the call was out")
			var cerr error
			switch variant {
			case "after":
				close(goOn)
				require.Error(t, leasetest.Recv(t, herrc, "the holder's Release"), "premise: the release failed")
				cerr = p.b.Close(ctx)
			case "during":
				cerrc := make(chan error, 1)
				go func() { cerrc <- p.b.Close(ctx) }()
				time.Sleep(50 * time.Millisecond)
				select {
				case err := <-cerrc:
					t.Logf("during: the retry Close returned (%v) while the release call was out", err)
				default:
				}
				close(goOn)
				require.Error(t, leasetest.Recv(t, herrc, "the holder's Release"), "premise: the release failed")
				cerr = leasetest.Recv(t, cerrc, "the retry Close")
			}
			s := p.look(t, key, lb.Token())
			calls := p.hook.of(id)
			_, answered, _ := c48cGaveBack(calls)
			t.Logf("%s: first Close %v; retry %v; B's calls for %s: %v", variant, first, cerr, id, calls)
			assert.NoError(t, cerr, "%s: the retry Close", variant)
			assert.False(t, s.Held, "%s: B's lease stands in Redis once the retry Close returned nil (Redis holds it %v more)", variant, c48dMargin(s))
			assert.Equal(t, 1, answered, "%s: answered leave calls for B's lease", variant)
			p.obs.check(t, variant)
			require.NoError(t, p.a.Close(ctx))
			leasetest.Settled(t, 5*time.Second)
		})
	}
}

// TestReviewClose48dOutAtCloseStopped: B (N = 1, TTL 20 s, engine timeout
// 200 ms) holds key K's lease on a redis-server of its own. The holder's
// release call is held by B's hook; Close(Background) begins (B's waiter
// on a gate key held by A returns ErrClosed); Redis is stopped (SIGSTOP);
// the call is let go, its reply lost to the timeout. Redis is resumed
// once Close has returned (or after 10 s). Checks: Close returned; 2 s
// after Redis resumed, B's lease does not stand (the release or the
// leave call, written before the stop, ran on resume; or a leave was
// sent after); the observer is balanced; no goroutine of package lease
// left once A is closed.
func TestReviewClose48dOutAtCloseStopped(t *testing.T) {
	ctx := context.Background()
	srv := redistest.Start(t)
	rdb := srv.Client(t)
	prefix := redistest.Prefix(t)
	p := &c48cPair{rdb: rdb, prefix: prefix, hook: newC48cHook(t), obs: &c48cObs{}}
	aEng, err := throttle.New(rdb, throttle.WithPrefix(prefix), throttle.WithTimeout(5*time.Second))
	require.NoError(t, err)
	p.a, err = lease.New(aEng, "partner", 1, lease.WithTTL(20*time.Second))
	require.NoError(t, err)
	leasetest.CloseAtEnd(t, p.a)
	c := srv.Client(t)
	c.AddHook(p.hook)
	bEng, err := throttle.New(c, throttle.WithPrefix(prefix), throttle.WithTimeout(200*time.Millisecond))
	require.NoError(t, err)
	p.b, err = lease.New(bEng, "partner", 1, lease.WithTTL(20*time.Second), lease.WithObserver(p.obs))
	require.NoError(t, err)
	leasetest.CloseAtEnd(t, p.b)
	redistest.UntilOK(t, func() error { return p.a.Load(ctx) })
	redistest.UntilOK(t, func() error { return p.b.Load(ctx) })

	key, gate := "c48ds", "c48ds-gate"
	lb, err := p.b.Acquire(ctx, key)
	require.NoError(t, err)
	id := p.look(t, key, lb.Token()).ID
	la, err := p.a.Acquire(ctx, gate)
	require.NoError(t, err)
	gotG := make(chan c48cGot, 1)
	go func() { l, err := p.b.Acquire(ctx, gate); gotG <- c48cGot{l, err} }()
	leasetest.WaitFor(t, func() bool { return p.queued(gate) == 1 })
	in, goOn := make(chan struct{}), make(chan struct{})
	p.hook.setPre(func(ctx context.Context, kind, _ string) error {
		if kind == "release" && ctx.Value(c48cTag{}) != nil {
			close(in)
			<-goOn
		}
		return nil
	})
	herrc := make(chan error, 1)
	go func() { herrc <- lb.Release(context.WithValue(ctx, c48cTag{}, "holder")) }()
	leasetest.Recv(t, in, "the holder's release call")
	cerrc := make(chan error, 1)
	go func() { cerrc <- p.b.Close(ctx) }()
	g := leasetest.Recv(t, gotG, "B's waiter on the gate key")
	require.ErrorIs(t, g.err, lease.ErrClosed, "premise: Close has begun")
	time.Sleep(100 * time.Millisecond) // the waiter's leave call answered
	require.NoError(t, syscall.Kill(srv.Pid(), syscall.SIGSTOP))
	resumed := false
	resume := func() {
		if !resumed {
			resumed = true
			require.NoError(t, syscall.Kill(srv.Pid(), syscall.SIGCONT))
		}
	}
	t.Cleanup(resume)
	close(goOn)
	herr := leasetest.Recv(t, herrc, "the holder's Release")
	var cerr error
	start := time.Now()
	select {
	case cerr = <-cerrc:
	case <-time.After(10 * time.Second):
		t.Log("Close has not returned 10 s into the stop: resuming Redis")
		resume()
		cerr = leasetest.Recv(t, cerrc, "Close, Redis resumed")
	}
	took := time.Since(start)
	resume()
	redistest.UntilOK(t, func() error { return rdb.Ping(ctx).Err() })
	time.Sleep(2 * time.Second)
	s := p.look(t, key, lb.Token())
	calls := p.hook.of(id)
	t.Logf("holder's Release %v; Close %v (%v after the call was let go); B's calls for %s: %v; lease held 2 s after resume: %v (%v more)",
		herr, cerr, took.Round(time.Millisecond), id, calls, s.Held, c48dMargin(s))
	require.Error(t, herr, "premise: the holder's release failed")
	assert.False(t, s.Held, "B's lease stands in Redis 2 s after Redis resumed, Close having returned %v", cerr)
	p.obs.check(t, "stopped")
	require.NoError(t, la.Release(ctx))
	require.NoError(t, p.a.Close(ctx))
	leasetest.Settled(t, 5*time.Second)
}
