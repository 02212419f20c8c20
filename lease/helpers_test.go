package lease_test

// The bookkeeping of believed holders, shared by the reviews in
// review_side2_test.go and review_side3_test.go (the rest of the tests'
// rig is package lease/internal/leasetest's).

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"

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
