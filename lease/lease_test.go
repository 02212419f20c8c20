package lease_test

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/slotbook/slotbook/internal/callcount"
	"github.com/slotbook/slotbook/lease"
	"github.com/slotbook/slotbook/lease/internal/leasetest"
	"github.com/slotbook/slotbook/throttle"
)

func TestInvalidInputMakesNoCall(t *testing.T) {
	e := leasetest.NewEnv(t)
	s := e.Sem(t, 1)
	before := e.Calls.Load()
	for _, tc := range []struct {
		name string
		err  func() error
	}{
		{"nil engine", func() error { _, err := lease.New(nil, "p", 1); return err }},
		{"empty name", func() error { _, err := lease.New(e.Eng, "", 1); return err }},
		{"n zero", func() error { _, err := lease.New(e.Eng, "p", 0); return err }},
		{"n negative", func() error { _, err := lease.New(e.Eng, "p", -3); return err }},
		{"ttl zero", func() error { _, err := lease.New(e.Eng, "p", 1, lease.WithTTL(0)); return err }},
		{"ttl negative", func() error { _, err := lease.New(e.Eng, "p", 1, lease.WithTTL(-time.Second)); return err }},
		{"poll beyond ttl/3", func() error {
			_, err := lease.New(e.Eng, "p", 1, lease.WithTTL(3*time.Second), lease.WithPollInterval(2*time.Second))
			return err
		}},
		{"acquire empty key", func() error { _, err := s.Acquire(context.Background(), ""); return err }},
		{"try empty key", func() error { _, _, err := s.TryAcquire(context.Background(), ""); return err }},
		{"key without a hash tag", func() error { _, err := s.Acquire(context.Background(), "}"); return err }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := tc.err()
			if !errors.Is(err, lease.ErrInvalid) {
				t.Fatalf("got %v, want an error matching lease.ErrInvalid", err)
			}
		})
	}
	if got := e.Calls.Load() - before; got != 0 {
		t.Errorf("bad input made %d Redis calls, want 0", got)
	}
}

func TestAcquireTryRelease(t *testing.T) {
	e := leasetest.NewEnv(t)
	s := e.Sem(t, 2)
	ctx := context.Background()
	a, err := s.Acquire(ctx, "k")
	require.NoError(t, err)
	b, ok, err := s.TryAcquire(ctx, "k")
	require.NoError(t, err)
	require.True(t, ok, "second of two leases")
	if b.Token() <= a.Token() {
		t.Errorf("tokens %d then %d, want increasing", a.Token(), b.Token())
	}
	c, ok, err := s.TryAcquire(ctx, "k")
	require.NoError(t, err)
	if ok || c != nil {
		t.Fatalf("TryAcquire on a full key: got %v, %v, want nil, false", c, ok)
	}
	other, ok, err := s.TryAcquire(ctx, "other")
	require.NoError(t, err)
	require.True(t, ok, "another key has its own leases")
	require.NoError(t, other.Release(ctx))

	require.NoError(t, a.Release(ctx))
	require.NoError(t, a.Release(ctx), "a second release does nothing")
	c, ok, err = s.TryAcquire(ctx, "k")
	require.NoError(t, err)
	require.True(t, ok, "a released lease is free again")
	if c.Token() <= b.Token() {
		t.Errorf("tokens %d then %d, want increasing", b.Token(), c.Token())
	}
	require.NoError(t, b.Release(ctx))
	require.NoError(t, c.Release(ctx))
	if n, _ := e.Rdb.ZCard(ctx, e.Key("k", "h")).Result(); n != 0 {
		t.Errorf("%d holders left after every release, want 0", n)
	}
}

func TestWaiterWokenOnRelease(t *testing.T) {
	e := leasetest.NewEnv(t)
	// A poll far longer than the test: only the wake-up can grant.
	s := e.Sem(t, 1, lease.WithTTL(time.Minute), lease.WithPollInterval(20*time.Second))
	other := e.Sem(t, 1, lease.WithTTL(time.Minute), lease.WithPollInterval(20*time.Second))
	ctx := context.Background()
	held, err := s.Acquire(ctx, "k")
	require.NoError(t, err)
	got := make(chan *lease.Lease)
	go func() {
		l, err := other.Acquire(ctx, "k")
		if err != nil {
			t.Error(err)
		}
		got <- l
	}()
	e.Queued(t, "k", 1)
	require.NoError(t, held.Release(ctx))
	select {
	case l := <-got:
		require.NotNil(t, l)
		if l.Token() <= held.Token() {
			t.Errorf("token %d after %d, want larger", l.Token(), held.Token())
		}
		require.NoError(t, l.Release(ctx))
	case <-time.After(10 * time.Second):
		t.Fatal("the waiter of another process was not woken by the release")
	}
}

func TestCallsPerLease(t *testing.T) {
	e := leasetest.NewEnv(t)
	opts := []lease.Option{lease.WithTTL(time.Hour), lease.WithPollInterval(20 * time.Minute)}
	s := e.Sem(t, 1, opts...)
	ctx := context.Background()
	require.NoError(t, s.Load(ctx)) // no NOSCRIPT round trips in the count

	before := e.Calls.Load()
	l, err := s.Acquire(ctx, "k")
	require.NoError(t, err)
	require.NoError(t, l.Release(ctx))
	if got := e.Calls.Load() - before; got > 2 {
		t.Errorf("an uncontended acquire and release took %d calls, want at most 2", got)
	}

	// Contended: the waiter is in another Semaphore (another process, as
	// far as Redis can tell). Count only the waiter's calls: its acquire,
	// its wake-up (BLPOP) and its release.
	held, err := s.Acquire(ctx, "k")
	require.NoError(t, err)
	wrdb := e.Srv.Client(t)
	wcalls := callcount.Attach(wrdb)
	weng, err := throttle.New(wrdb, throttle.WithPrefix(e.Prefix), throttle.WithTimeout(5*time.Second))
	require.NoError(t, err)
	waiter, err := lease.New(weng, "partner", 1, opts...)
	require.NoError(t, err)
	t.Cleanup(func() { _ = waiter.Close(context.Background()) })
	got := make(chan error, 1)
	go func() {
		l, err := waiter.Acquire(ctx, "k")
		if err == nil {
			err = l.Release(ctx)
		}
		got <- err
	}()
	e.Queued(t, "k", 1)
	require.NoError(t, held.Release(ctx))
	require.NoError(t, <-got)
	if n := wcalls.Load(); n > 3 {
		t.Errorf("a waiter's acquire, wake-up and release took %d calls, want at most 3", n)
	}
}

func TestCancelledWaitersLeaveNothing(t *testing.T) {
	e := leasetest.NewEnv(t)
	s := e.Sem(t, 1, lease.WithTTL(time.Minute))
	other := e.Sem(t, 1, lease.WithTTL(time.Minute))
	ctx := context.Background()
	held, err := s.Acquire(ctx, "k")
	require.NoError(t, err)

	const waiters = 10
	wctx, cancel := context.WithCancel(ctx)
	var wg sync.WaitGroup
	var errs atomic.Int64
	for i := range waiters {
		wg.Add(1)
		go func() {
			defer wg.Done()
			sem := s
			if i%2 == 0 {
				sem = other
			}
			if _, err := sem.Acquire(wctx, "k"); errors.Is(err, context.Canceled) {
				errs.Add(1)
			}
		}()
	}
	e.Queued(t, "k", waiters)
	cancel()
	wg.Wait()
	if got := errs.Load(); got != waiters {
		t.Fatalf("%d waiters ended with context.Canceled, want %d", got, waiters)
	}
	left := e.KeysBut(t, "k", time.Minute)
	want := map[string]bool{e.Key("k", "h"): true, e.Key("k", "t"): true, e.Key("k", "c"): true}
	for _, k := range left {
		if !want[k] {
			t.Errorf("key %q left behind by cancelled waiters", k)
		}
	}
	require.NoError(t, held.Release(ctx))
	left = e.KeysBut(t, "k", time.Minute)
	if len(left) != 1 || left[0] != e.Key("k", "c") {
		t.Errorf("keys after the release: %q, want only the token counter %q", left, e.Key("k", "c"))
	}
}

// TestCancelAtGrantNeverHolds cancels waiters just as the lease they wait
// for is released to them, many times: whichever wins, a waiter that
// returns an error holds nothing, in this process or in Redis.
func TestCancelAtGrantNeverHolds(t *testing.T) {
	e := leasetest.NewEnv(t)
	s := e.Sem(t, 1, lease.WithTTL(time.Minute))
	other := e.Sem(t, 1, lease.WithTTL(time.Minute))
	ctx := context.Background()
	granted, cancelled := 0, 0
	for i := range 40 {
		held, err := s.Acquire(ctx, "k")
		require.NoError(t, err)
		wctx, cancel := context.WithCancel(ctx)
		got := make(chan *lease.Lease, 1)
		go func() {
			l, _ := other.Acquire(wctx, "k")
			got <- l
		}()
		e.Queued(t, "k", 1)
		// Release and cancel at once, staggered by a few microseconds
		// either way.
		go func() { time.Sleep(time.Duration(i%5) * 50 * time.Microsecond); cancel() }()
		require.NoError(t, held.Release(ctx))
		l := <-got
		holders, err := e.Rdb.ZCard(ctx, e.Key("k", "h")).Result()
		require.NoError(t, err)
		if l != nil {
			granted++
			if holders != 1 {
				t.Fatalf("round %d: the waiter holds a lease but Redis has %d holders", i, holders)
			}
			require.NoError(t, l.Release(ctx))
		} else {
			cancelled++
			if holders != 0 {
				t.Fatalf("round %d: the waiter gave up but Redis has %d holders", i, holders)
			}
		}
	}
	t.Logf("%d granted, %d cancelled", granted, cancelled)
	left := e.KeysBut(t, "k", time.Minute)
	if len(left) != 1 {
		t.Errorf("keys left: %q, want only the token counter", left)
	}
}

func TestLapsedLeaseIsLost(t *testing.T) {
	e := leasetest.NewEnv(t)
	ttl := 300 * time.Millisecond
	s := e.Sem(t, 1, lease.WithTTL(ttl))
	ctx := context.Background()
	l, err := s.Acquire(ctx, "k")
	require.NoError(t, err)
	// As if the lease had lapsed while its process stalled: the holder is
	// gone from Redis.
	require.NoError(t, e.Rdb.Del(ctx, e.Key("k", "h")).Err())
	select {
	case <-l.Lost():
	case <-time.After(20 * time.Second):
		t.Fatal("Lost was not closed after the lease vanished")
	}
	if err := l.Release(ctx); !errors.Is(err, lease.ErrLost) {
		t.Errorf("Release of a lapsed lease: got %v, want ErrLost", err)
	}
}

func TestExtendedPastTTL(t *testing.T) {
	e := leasetest.NewEnv(t)
	ttl := time.Second
	s := e.Sem(t, 1, lease.WithTTL(ttl))
	ctx := context.Background()
	l, err := s.Acquire(ctx, "k")
	require.NoError(t, err)
	start, err := e.Rdb.Time(ctx).Result()
	require.NoError(t, err)
	// Hold it for three TTLs on the Redis clock: extended every TTL/3, it
	// must not lapse.
	for {
		now, err := e.Rdb.Time(ctx).Result()
		require.NoError(t, err)
		if now.Sub(start) > 3*ttl {
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	select {
	case <-l.Lost():
		t.Fatal("a held lease lapsed although its keeper extends it every TTL/3")
	default:
	}
	if _, ok, err := s.TryAcquire(ctx, "k"); err != nil || ok {
		t.Errorf("TryAcquire while the extended lease is held: %v, %v; want false, nil", ok, err)
	}
	require.NoError(t, l.Release(ctx))
}

func TestClosedSemaphore(t *testing.T) {
	e := leasetest.NewEnv(t)
	s, err := lease.New(e.Eng, "partner", 1)
	require.NoError(t, err)
	ctx := context.Background()
	held, err := s.Acquire(ctx, "k")
	require.NoError(t, err)
	waiting := make(chan error, 1)
	other := e.Sem(t, 1)
	otherHeld, err := other.Acquire(ctx, "k2")
	require.NoError(t, err)
	_ = otherHeld
	go func() { _, err := s.Acquire(ctx, "k2"); waiting <- err }()
	e.Queued(t, "k2", 1)
	require.NoError(t, s.Close(ctx))
	if err := <-waiting; !errors.Is(err, lease.ErrClosed) {
		t.Errorf("waiter at Close: got %v, want ErrClosed", err)
	}
	if _, err := s.Acquire(ctx, "k"); !errors.Is(err, lease.ErrClosed) {
		t.Errorf("Acquire after Close: got %v, want ErrClosed", err)
	}
	if n, _ := e.Rdb.ZCard(ctx, e.Key("k", "h")).Result(); n != 0 {
		t.Errorf("Close left %d holders of its own, want 0", n)
	}
	require.NoError(t, held.Release(ctx), "released by Close already: a no-op")
}

// countingObserver counts what a Semaphore reports.
type countingObserver struct {
	held, waiting, expired atomic.Int64
}

func (o *countingObserver) ObserveHeld(_ string, d int)              { o.held.Add(int64(d)) }
func (o *countingObserver) ObserveWaiting(_ string, d int)           { o.waiting.Add(int64(d)) }
func (o *countingObserver) ObserveWait(string, time.Duration, error) {}
func (o *countingObserver) ObserveExpired(_ string, n int)           { o.expired.Add(int64(n)) }

// scripterOnly hides every method of a client but the Scripter's, so
// that a Semaphore over it cannot block for wake-ups: as if each one were
// lost.
type scripterOnly struct{ redis.Scripter }

// TestPollCoversLostWakeUps runs a waiter whose process reads no wake-up
// at all: the fallback poll alone must find its grant.
func TestPollCoversLostWakeUps(t *testing.T) {
	e := leasetest.NewEnv(t)
	s := e.Sem(t, 1, lease.WithTTL(time.Minute))
	deaf, err := throttle.New(scripterOnly{e.Rdb}, throttle.WithPrefix(e.Prefix), throttle.WithTimeout(0))
	require.NoError(t, err)
	w, err := lease.New(deaf, "partner", 1, lease.WithTTL(time.Minute), lease.WithPollInterval(100*time.Millisecond))
	require.NoError(t, err)
	t.Cleanup(func() { _ = w.Close(context.Background()) })
	ctx := context.Background()
	held, err := s.Acquire(ctx, "k")
	require.NoError(t, err)
	got := make(chan error, 1)
	go func() {
		actx, cancel := context.WithTimeout(ctx, 30*time.Second)
		defer cancel()
		l, err := w.Acquire(actx, "k")
		if err == nil {
			err = l.Release(ctx)
		}
		got <- err
	}()
	e.Queued(t, "k", 1)
	require.NoError(t, held.Release(ctx))
	require.NoError(t, <-got, "the poll never found the grant")
	// The wake-up pushed for it was never read: it lapses with its list.
	if n, _ := e.Rdb.ZCard(ctx, e.Key("k", "h")).Result(); n != 0 {
		t.Errorf("%d holders left, want 0", n)
	}
}
