package lease_test

// The bookkeeping of believed holders, shared by the reviews in
// review_side2_test.go and review_side3_test.go, the count of holdings
// open at once, and waiters queued
// behind held keys, shared by the reviews of the waker (the rest of the
// tests' rig is package lease/internal/leasetest's).

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/slotbook/slotbook/lease"
	"github.com/slotbook/slotbook/lease/internal/leasetest"
)

// rvBelieve holds l, believed held (in bel) meanwhile, until stop or until
// its Lost closes, looking every 2 ms, and returns the interval over
// which it was believed held (since base) and whether Lost closed. The
// time is read before Lost is: open when read, the lease was believed
// held at that time (read after, a goroutine descheduled between the two
// would stretch the interval past Lost's closing).
func rvBelieve(l *lease.Lease, bel *rvBelieved, base, stop time.Time) (from, to time.Duration, lost bool) {
	from = time.Since(base)
	bel.set(l, true)
	defer bel.set(l, false)
	to = from
	for {
		now := time.Since(base)
		select {
		case <-l.Lost():
			return from, to, true
		default:
			to = now // still believed here
		}
		if time.Now().After(stop) {
			return from, to, false
		}
		time.Sleep(2 * time.Millisecond)
	}
}

// rvKeepsOut is a hook that counts in out the keep calls on their way.
func rvKeepsOut(out *atomic.Int64) leasetest.Hook {
	return leasetest.Hook{
		Before: func(cmd redis.Cmder) {
			if leasetest.IsKeep(cmd) {
				out.Add(1)
			}
		},
		After: func(cmd redis.Cmder, _ time.Duration) {
			if leasetest.IsKeep(cmd) {
				out.Add(-1)
			}
		},
	}
}

// rvBelieved tracks, per token, the leases a worker believes it holds; a
// hook on every client checks each leave or release call sent by the
// package against it (ids are unique per waiter: a call for a lease its
// holder still believes in, Lost open, would be a defect).
type rvBelieved struct {
	mu    sync.Mutex
	held  map[int64]*lease.Lease
	rdb   *redis.Client
	viols atomic.Int64
	first atomic.Value
}

func (b *rvBelieved) set(l *lease.Lease, on bool) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if on {
		b.held[l.Token()] = l
	} else {
		delete(b.held, l.Token())
	}
}

// hook flags a leave or release call for a lease whose holder still
// believes it holds (Lost open, no Release).
func (b *rvBelieved) hook() leasetest.Hook {
	return leasetest.Hook{Before: func(cmd redis.Cmder) {
		argv, keys := leasetest.ScriptArgs(cmd)
		if len(argv) != 4 || len(keys) < 2 {
			return
		}
		id, ok := argv[3].(string)
		if !ok {
			return
		}
		tok, err := b.rdb.HGet(context.Background(), keys[1], id).Int64()
		if err != nil {
			return
		}
		b.mu.Lock()
		l := b.held[tok]
		b.mu.Unlock()
		if l == nil {
			return
		}
		select {
		case <-l.Lost():
		default:
			if b.viols.Add(1) == 1 {
				b.first.Store(fmt.Sprintf("leave/release of %s (token %d) sent while its holder believes it holds (Lost open, no Release)", id, tok))
			}
		}
	}}
}

// behind is one waiter of a's per key, each key held by b (see
// queueBehind).
type behind struct {
	keys []string
	held []*lease.Lease // b's, one per key
	got  chan time.Time // when a waiter got its lease (it then gives it back)
	errs chan error     // a waiter's Acquire error
}

// queueBehind has b take a lease on each of n keys named tag0,
// tag1..., then starts one Acquire of a's per key, each with a context
// of within, and returns once every key's queue holds its waiter.
func queueBehind(t *testing.T, e *leasetest.Env, a, b *lease.Semaphore, tag string, n int, within time.Duration) *behind {
	t.Helper()
	ctx := context.Background()
	q := &behind{keys: make([]string, n), held: make([]*lease.Lease, n), got: make(chan time.Time, n), errs: make(chan error, n)}
	for i := range n {
		q.keys[i] = fmt.Sprint(tag, i)
		var err error
		q.held[i], err = b.Acquire(ctx, q.keys[i])
		require.NoError(t, err)
	}
	for _, k := range q.keys {
		go func() {
			actx, cancel := context.WithTimeout(ctx, within)
			defer cancel()
			l, err := a.Acquire(actx, k)
			if err != nil {
				q.errs <- err
				return
			}
			q.got <- time.Now()
			_ = l.Release(ctx)
		}()
	}
	for _, k := range q.keys {
		e.Queued(t, k, 1)
	}
	return q
}

// releaseAll has b release every held lease at once, each in a
// goroutine of its own, and returns once all are released.
func (q *behind) releaseAll(t *testing.T) {
	var wg sync.WaitGroup
	for _, l := range q.held {
		wg.Go(func() { require.NoError(t, l.Release(context.Background())) })
	}
	wg.Wait()
}

// wakeAfter has holder take key, starts an Acquire of waiter's on it,
// waits until it is queued and then settle more, and releases key: it
// returns how long after the release the waiter got the lease (which it
// gives back), failing the test if not within 2 poll.
func wakeAfter(t *testing.T, e *leasetest.Env, holder, waiter *lease.Semaphore, key string, settle, poll time.Duration) time.Duration {
	t.Helper()
	ctx := context.Background()
	held, err := holder.Acquire(ctx, key)
	require.NoError(t, err)
	got := make(chan time.Time, 1)
	go func() {
		l, err := waiter.Acquire(ctx, key)
		if err == nil {
			got <- time.Now()
			_ = l.Release(ctx)
		}
	}()
	e.Queued(t, key, 1)
	time.Sleep(settle)
	start := time.Now()
	require.NoError(t, held.Release(ctx))
	select {
	case at := <-got:
		return at.Sub(start)
	case <-time.After(2 * poll):
		t.Fatalf("waiter on %s never woken", key)
		return 0
	}
}

// rvIv is one believed holding of a lease, over [from, to) since some
// base, with its fencing token and, if set, who held it.
type rvIv struct {
	from, to time.Duration
	tok      int64
	who      string
}

// rvPeak returns the most of ivs open at once (one ending at the instant
// another begins does not overlap it) and, for the first three moments
// more than n were open, when and which (tokens, with who if set).
func rvPeak(ivs []rvIv, n int) (int, []string) {
	type ev struct {
		at  time.Duration
		d   int
		tok int64
		who string
	}
	var evs []ev
	for _, x := range ivs {
		evs = append(evs, ev{x.from, 1, x.tok, x.who}, ev{x.to, -1, x.tok, x.who})
	}
	slices.SortFunc(evs, func(a, b ev) int {
		if a.at != b.at {
			return int(a.at - b.at)
		}
		return a.d - b.d
	})
	cur, peak := 0, 0
	open := map[int64]string{}
	var bad []string
	for _, x := range evs {
		cur += x.d
		if x.d > 0 {
			open[x.tok] = x.who
		} else {
			delete(open, x.tok)
		}
		if cur > n && len(bad) < 3 {
			var s []string
			for k, w := range open {
				if w != "" {
					s = append(s, fmt.Sprintf("%d(%s)", k, w))
				} else {
					s = append(s, fmt.Sprint(k))
				}
			}
			slices.Sort(s)
			bad = append(bad, fmt.Sprintf("at %v: %v", x.at.Round(time.Millisecond), s))
		}
		peak = max(peak, cur)
	}
	return peak, bad
}
