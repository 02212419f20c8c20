package lease_test

import (
	"context"
	"errors"
	"fmt"
	"strconv"
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

// redisLeft returns, for each lease of subject standing in Redis, its
// fencing token and how long Redis still holds it (its expiry in the
// holders set less Redis's TIME).
func redisLeft(ctx context.Context, e *leasetest.Env, subject string) (map[int64]time.Duration, error) {
	toks, err := e.Rdb.HGetAll(ctx, e.Key(subject, "t")).Result()
	if err != nil {
		return nil, err
	}
	now, err := e.Rdb.Time(ctx).Result()
	if err != nil {
		return nil, err
	}
	left := make(map[int64]time.Duration, len(toks))
	for id, tok := range toks {
		exp, err := e.Rdb.ZScore(ctx, e.Key(subject, "h"), id).Result()
		if errors.Is(err, redis.Nil) {
			continue
		}
		if err != nil {
			return nil, err
		}
		n, err := strconv.ParseInt(tok, 10, 64)
		if err != nil {
			return nil, err
		}
		left[n] = time.Duration(int64(exp)-now.UnixMicro()) * time.Microsecond
	}
	return left, nil
}

// TestSmallPoolNoFalseLost waits on more keys at once than the client has
// pooled connections (5 keys, PoolSize 3), with a healthy, idle Redis and
// a TTL of 3 s: the keepers' blocking reads must not starve the calls
// that grant and extend leases, and no lease may be given up (an Acquire
// answering ErrLost, or Lost closing) while Redis still holds it for more
// than half its TTL. Judged on Redis: the time left is its expiry in the
// holders set less Redis's TIME, read when the lease is given up; a
// lease Acquire gave up is found by its token, which no caller held.
func TestSmallPoolNoFalseLost(t *testing.T) {
	e := leasetest.NewEnv(t)
	opts := e.Srv.Options()
	opts.PoolSize = 3
	rdb := redis.NewClient(opts)
	t.Cleanup(func() { _ = rdb.Close() })
	eng, err := throttle.New(rdb, throttle.WithPrefix(e.Prefix), throttle.WithTimeout(time.Second))
	require.NoError(t, err)
	const ttl = 3 * time.Second
	s, err := lease.New(eng, "partner", 1, lease.WithTTL(ttl))
	require.NoError(t, err)
	t.Cleanup(func() { _ = s.Close(context.Background()) })

	const keys, perKey, run, hold = 5, 4, 8 * time.Second, 300 * time.Millisecond
	ctx := context.Background()
	var (
		mu       sync.Mutex
		held     = make(map[string]map[int64]bool)          // tokens handed to callers, by key
		seen     = make(map[string]map[int64]time.Duration) // tokens standing in Redis when Acquire answered ErrLost
		falseErr []string                                   // Lost closed with time left in Redis
		errs     []error
		grants   int
	)
	for k := range keys {
		held[fmt.Sprint("k", k)] = make(map[int64]bool)
		seen[fmt.Sprint("k", k)] = make(map[int64]time.Duration)
	}
	end := time.Now().Add(run)
	var wg sync.WaitGroup
	for k := range keys {
		key := fmt.Sprint("k", k)
		for range perKey {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for time.Now().Before(end) {
					actx, cancel := context.WithTimeout(ctx, 30*time.Second)
					l, err := s.Acquire(actx, key)
					cancel()
					if errors.Is(err, lease.ErrLost) {
						left, rerr := redisLeft(ctx, e, key)
						mu.Lock()
						for tok, d := range left {
							seen[key][tok] = max(seen[key][tok], d)
						}
						if rerr != nil {
							errs = append(errs, rerr)
						}
						mu.Unlock()
						continue
					}
					if err != nil {
						mu.Lock()
						errs = append(errs, err)
						mu.Unlock()
						return
					}
					mu.Lock()
					held[key][l.Token()] = true
					grants++
					mu.Unlock()
					select {
					case <-l.Lost():
						left, rerr := redisLeft(ctx, e, key)
						mu.Lock()
						if rerr != nil {
							errs = append(errs, rerr)
						} else if d := left[l.Token()]; d > ttl/2 {
							falseErr = append(falseErr, fmt.Sprintf("%s token %d: Lost closed with %v left in Redis", key, l.Token(), d))
						}
						mu.Unlock()
					case <-time.After(hold):
					}
					_ = l.Release(ctx)
				}
			}()
		}
	}
	wg.Wait()
	require.Empty(t, errs, "Acquire or the judge's reads failed")
	for key, toks := range seen {
		for tok, d := range toks {
			if !held[key][tok] && d > ttl/2 {
				falseErr = append(falseErr, fmt.Sprintf("%s token %d: Acquire answered ErrLost with %v left in Redis", key, tok, d))
			}
		}
	}
	t.Logf("%d leases handed out over %v", grants, run)
	require.Empty(t, falseErr, "leases given up while Redis held them")
	// With 1 lease per key held 300 ms at a time, 5 keys serve about 130
	// leases in 8 s; a starved pool serves a fraction of that.
	require.Greater(t, grants, keys*int(run/hold)/3, "leases handed out")
}

// TestGrantInReplyCountsFromItsCall: a lease granted in the reply of this
// process's own call (here a Release handing the lease to the next
// waiter) is held for the TTL from when that call ran, however long ago
// its waiter was last refreshed. Redis is paused (CLIENT PAUSE) from just
// before the Release is sent until past the TTL of the waiter's last
// refresh; the grant then comes back with its whole TTL left in Redis,
// and Acquire must hand it out, not give it up with ErrLost.
func TestGrantInReplyCountsFromItsCall(t *testing.T) {
	srv := redistest.Start(t)
	srv.RequireReal(t)
	opts := srv.Options()
	opts.ReadTimeout = 10 * time.Second // longer than the pause
	rdb := redis.NewClient(opts)
	t.Cleanup(func() { _ = rdb.Close() })
	const prefix = "reply:"
	eng, err := throttle.New(rdb, throttle.WithPrefix(prefix), throttle.WithTimeout(10*time.Second))
	require.NoError(t, err)
	e := &leasetest.Env{Srv: srv, Rdb: srv.Client(t), Prefix: prefix}
	const ttl = 6 * time.Second
	s, err := lease.New(eng, "partner", 1, lease.WithTTL(ttl), lease.WithPollInterval(ttl/3))
	require.NoError(t, err)
	t.Cleanup(func() { _ = s.Close(context.Background()) })
	ctx := context.Background()

	start := time.Now()
	h, err := s.Acquire(ctx, "k")
	require.NoError(t, err)
	type result struct {
		l   *lease.Lease
		err error
	}
	got := make(chan result, 1)
	go func() {
		l, err := s.Acquire(ctx, "k")
		got <- result{l, err}
	}()
	e.Queued(t, "k", 1)
	// The waiter's first refresh comes a poll interval (2 s) after the
	// room was made; pause before it, and past the waiter's TTL. A machine
	// too busy to queue the waiter by then has missed the scene.
	before := time.Until(start.Add(ttl/3 - 300*time.Millisecond))
	if before < 100*time.Millisecond {
		t.Skipf("the waiter queued %v after the first Acquire: too late to pause before its refresh", time.Since(start))
	}
	time.Sleep(before)
	pause := ttl - ttl/3 + ttl/4
	require.NoError(t, e.Rdb.Do(ctx, "client", "pause", pause.Milliseconds(), "all").Err())
	released := make(chan error, 1)
	go func() { released <- h.Release(ctx) }()

	r := <-got
	require.NoError(t, r.err, "Acquire of a lease granted with its whole TTL left")
	// The holder's own lease lapsed in Redis during the pause (its TTL
	// ran out before the Release ran), so its Release may say so.
	if err := <-released; err != nil {
		require.ErrorIs(t, err, lease.ErrLost)
	}
	left, err := redisLeft(ctx, e, "k")
	require.NoError(t, err)
	require.Greater(t, left[r.l.Token()], ttl/2, "the lease's time left in Redis")
	select {
	case <-r.l.Lost():
		t.Fatal("Lost closed on a lease Redis holds")
	case <-time.After(ttl / 3):
	}
	require.NoError(t, r.l.Release(ctx))
}

// acquired is an Acquire's answer.
type acquired struct {
	l   *lease.Lease
	err error
}

// queueAThenB has b take key k's one lease, then a waiter of a's and one
// of b's join k's queue, in that order; their answers come on gotA and
// gotB.
func queueAThenB(t *testing.T, e *leasetest.Env, ctx context.Context, a, b *lease.Semaphore) (l1 *lease.Lease, gotA, gotB chan acquired) {
	t.Helper()
	l1, err := b.Acquire(ctx, "k")
	require.NoError(t, err)
	gotA, gotB = make(chan acquired, 1), make(chan acquired, 1)
	go func() { l, err := a.Acquire(ctx, "k"); gotA <- acquired{l, err} }()
	e.Queued(t, "k", 1)
	go func() { l, err := b.Acquire(ctx, "k"); gotB <- acquired{l, err} }()
	e.Queued(t, "k", 2)
	return l1, gotA, gotB
}

// releaseHeld checks that Redis holds l (found by its token), and
// releases it.
func releaseHeld(t *testing.T, e *leasetest.Env, ctx context.Context, l *lease.Lease) {
	t.Helper()
	left, err := redisLeft(ctx, e, l.Key())
	require.NoError(t, err)
	_, held := left[l.Token()]
	require.True(t, held, "A was handed lease %d, which Redis does not hold (it holds %v)", l.Token(), left)
	require.NoError(t, l.Release(ctx))
}

// TestStaleWakeUpNotDelivered: a grant whose wake-up its process did not
// read before the lease lapsed (its keeper sat in a keep call whose reply
// was slow) must not be handed out later, when the waiter has joined the
// queue again behind another process's waiter that now holds the lease.
// Process A waits; process B holds, then has a waiter of its own. While
// A's keep call is out, B releases (granting A's waiter, whose wake-up is
// pushed) and A's keeper stays away past the TTL: the lease lapses
// unextended, B's waiter is granted, and A's next keep call puts A's
// waiter back in the queue. Any lease Acquire hands A must be one Redis
// holds (judged by its token in Redis), and never beside B's. On a Ring
// the keeper reads the key's wake-ups itself, and so reads none while it
// sits in the keep call; on a single node the Semaphore's waker reads
// them beside it, and may hand A the lease at once, which is fine.
func TestStaleWakeUpNotDelivered(t *testing.T) {
	for _, ring := range []bool{false, true} {
		t.Run(map[bool]string{false: "node", true: "ring"}[ring], func(t *testing.T) {
			testStaleWakeUpNotDelivered(t, ring)
		})
	}
}

func testStaleWakeUpNotDelivered(t *testing.T, ring bool) {
	e := leasetest.NewEnv(t)
	// armed runs once, right after a keep call of A's has had its reply,
	// before A's keeper sees it: a keep call whose reply is slow.
	var armed atomic.Pointer[func()]
	hook := leasetest.Hook{After: func(cmd redis.Cmder, _ time.Duration) {
		if f := armed.Load(); f != nil && leasetest.IsKeep(cmd) && armed.CompareAndSwap(f, nil) {
			(*f)()
		}
	}}
	var rdbA redis.UniversalClient
	if ring {
		r := redis.NewRing(&redis.RingOptions{Addrs: map[string]string{"a": e.Srv.Addr}, ContextTimeoutEnabled: true})
		t.Cleanup(func() { _ = r.Close() })
		r.AddHook(hook)
		rdbA = r
	} else {
		c := e.Srv.Client(t)
		c.AddHook(hook)
		rdbA = c
	}
	engA, err := throttle.New(rdbA, throttle.WithPrefix(e.Prefix), throttle.WithTimeout(5*time.Second))
	require.NoError(t, err)
	const ttl = time.Second
	opts := []lease.Option{lease.WithTTL(ttl), lease.WithPollInterval(100 * time.Millisecond)}
	a, err := lease.New(engA, "partner", 1, opts...)
	require.NoError(t, err)
	t.Cleanup(func() { _ = a.Close(context.Background()) })
	b := e.Sem(t, 1, opts...)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()

	l1, gotA, gotB := queueAThenB(t, e, ctx, a, b)

	slow := func() {
		require.NoError(t, l1.Release(ctx)) // grants A's waiter, at the head of the queue
		time.Sleep(ttl + ttl/2)             // the reply comes back after the grant's TTL
	}
	armed.Store(&slow)

	var bHeld *lease.Lease
	aDone := false // A's Acquire has answered
	for bHeld == nil {
		select {
		case r := <-gotA:
			if r.err != nil {
				t.Logf("A: %v", r.err) // a grant given up as late is the safe answer
				return
			}
			releaseHeld(t, e, ctx, r.l)
			aDone = true
		case r := <-gotB:
			require.NoError(t, r.err)
			bHeld = r.l
		}
	}
	if aDone { // A held the lease it was granted, then B
		require.NoError(t, bHeld.Release(ctx))
		return
	}
	// B holds; A waits behind it, and must not be handed a lease now.
	select {
	case r := <-gotA:
		if r.err == nil {
			left, _ := redisLeft(ctx, e, "k")
			t.Fatalf("A was handed lease %d while B holds %d (Redis holds %v)", r.l.Token(), bHeld.Token(), left)
		}
		t.Logf("A: %v", r.err)
	case <-time.After(ttl):
	}
	require.NoError(t, bHeld.Release(ctx))
	r := <-gotA
	require.NoError(t, r.err, "A, granted once B released")
	require.NoError(t, r.l.Release(ctx))
}
