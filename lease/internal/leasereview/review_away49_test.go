package leasereview_test

// Review of the judgement "Redis is away" after Close (helper-146):
// Semaphore.away counts the away rounds over every room, while the
// engine's breakers are per Redis node. On a Redis Cluster with one master
// stopped, the rooms of that master's keys make the count reach two; a
// room of a key on a master that answers, whose waiter's own leave call
// then fails once unsent (a pool timeout, a failed dial), drops the call
// at its next round without sending it. Through package lease's public
// API, a go-redis hook on B's cluster client, and a 3-master test Cluster.

import (
	"context"
	"fmt"
	"slices"
	"strings"
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

// aw49Hook, on B's cluster client, watches the leave calls of two keys:
// on key a (its hash tag tagA), it counts the keepers' calls (with a spare
// token: five arguments) that failed; on key b (tagB), it holds the
// waiter's own leave call (abandon's: four arguments) until release is
// closed and then fails it unsent with errB, and counts the keepers'
// calls passed on and those answered without error.
type aw49Hook struct {
	names      *c48bHook // names each lease script call (kind)
	tagA, tagB string
	errB       error
	release    chan struct{}
	heldB      atomic.Int32 // b's own leave calls held (and failed)
	failedA    atomic.Int32 // a's keeper leave calls that failed
	keeperB    atomic.Int32 // b's keeper leave calls passed on
	okB        atomic.Int32 // b's keeper leave calls answered without error
}

func (h *aw49Hook) DialHook(next redis.DialHook) redis.DialHook { return next }
func (h *aw49Hook) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}
func (h *aw49Hook) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		if h.names.kind(cmd) != "leave" {
			return next(ctx, cmd)
		}
		argv, keys := leasetest.ScriptArgs(cmd)
		if len(keys) == 0 {
			return next(ctx, cmd)
		}
		keeper := len(argv) == 5
		switch {
		case strings.Contains(keys[0], h.tagB) && !keeper:
			h.heldB.Add(1)
			<-h.release
			cmd.SetErr(h.errB)
			return h.errB
		case strings.Contains(keys[0], h.tagB):
			h.keeperB.Add(1)
			err := next(ctx, cmd)
			if err == nil {
				h.okB.Add(1)
			}
			return err
		case strings.Contains(keys[0], h.tagA) && keeper:
			err := next(ctx, cmd)
			if err != nil {
				h.failedA.Add(1)
			}
			return err
		}
		return next(ctx, cmd)
	}
}

// TestReviewAway49HealthyMasterDropped: a 3-master Cluster (full coverage
// not required). A (an engine of its own) holds the one lease of key KA,
// on master 0, and of key KB, on master 1; B (N = 1, TTL 21 s, engine
// timeout 1 s, poll 7 s: no keep call is out as the waiters leave) has
// one waiter queued on each. B's hook holds KB's waiter's own leave call
// and, once released, fails it unsent: with a pool timeout
// (redis.ErrPoolTimeout: the client's own saturation, which leaves master
// 1's breaker closed) or a refused dial (leasetest.ErrNotSent). B's
// keeper calls for KB pass. Variants:
//   - control/pool, control/dial: every master answers; KB's call is
//     released 300 ms after it was held.
//   - stopped/pool, stopped/dial: master 0 is stopped before Close and
//     B's breaker for it seen open; KB's call is released once KA's
//     keeper has sent two leave calls past that breaker, both failed
//     (two away rounds: Semaphore.away reaches 2), and 300 ms more.
//
// Close's doc: a leave call "that reaches no Redis is sent again, until
// it reaches Redis or its waiter's TTL has passed ... Only when Redis is
// away (two rounds in a row reach none of it, a call let by the breaker
// failing, the breaker open after) are they dropped". Master 1 answers
// throughout, and its breaker is closed (pool) or lets the keeper's call
// by (dial): checks, once Close with context.Background() returned nil,
// KB's gone waiter does not stand in Redis (queue or waiters set), and
// B's keeper sent its leave call for KB. Premises: KB's own call was held
// and failed; in the stopped variants KA's keeper's calls failed twice.
// At eca1eb8 the stopped variants fail in every run (6 of 6, both
// errors): KB's keeper sends nothing (away counts master 0's rounds, and
// KB's room drops the call owed unsent at its first round), Close
// returns nil, and KB's waiter stands in master 1's queue for its TTL
// (21 s), though master 1 answers. The controls pass: the keeper sends
// KB's call once, and the waiter is gone.
func TestReviewAway49HealthyMasterDropped(t *testing.T) {
	for _, tc := range []struct {
		name    string
		stopped bool
		err     error
	}{
		{"control/pool", false, redis.ErrPoolTimeout},
		{"control/dial", false, leasetest.ErrNotSent},
		{"stopped/pool", true, redis.ErrPoolTimeout},
		{"stopped/dial", true, leasetest.ErrNotSent},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ctx := context.Background()
			cluster, prefix, ca, a := c48bClusterA(t)

			// KA on master 0, KB on master 1.
			keys := make([]string, 2)
			for i := 0; keys[0] == "" || keys[1] == ""; i++ {
				key := fmt.Sprint("aw49-", i)
				m, err := ca.MasterForKey(ctx, prefix+"partner:{"+key+"}:lease:h")
				require.NoError(t, err)
				for n := range keys {
					if m.Options().Addr == cluster.Addrs[n] && keys[n] == "" {
						keys[n] = key
					}
				}
			}
			ka, kb := keys[0], keys[1]
			hook := &aw49Hook{names: newC48bHook(t), tagA: "{" + ka + "}", tagB: "{" + kb + "}", errB: tc.err, release: make(chan struct{})}
			cb := redis.NewClusterClient(&redis.ClusterOptions{Addrs: slices.Clone(cluster.Addrs), ContextTimeoutEnabled: true})
			t.Cleanup(func() { _ = cb.Close() })
			cb.AddHook(hook)
			eng, err := throttle.New(cb, throttle.WithPrefix(prefix), throttle.WithTimeout(time.Second))
			require.NoError(t, err)
			b, err := lease.New(eng, "partner", 1, lease.WithTTL(21*time.Second), lease.WithPollInterval(7*time.Second))
			require.NoError(t, err)
			leasetest.CloseAtEnd(t, b)
			redistest.UntilOK(t, func() error { return b.Load(ctx) })

			got := make(chan error, 2)
			for _, key := range keys {
				redistest.UntilOK(t, func() error { _, err := a.Acquire(ctx, key); return err })
				go func() {
					_, err := b.Acquire(ctx, key)
					got <- err
				}()
			}
			leasetest.WaitFor(t, func() bool { ws, _ := c48bStanding(ca, prefix, keys); return len(ws) == 2 })

			if tc.stopped {
				cluster.Node(0).Stop()
				lim := throttle.PerSecond(1000, 1000)
				leasetest.WaitFor(t, func() bool {
					_, _ = eng.Allow(ctx, "{"+ka+"}u", lim)
					open, _ := eng.UnavailableFor(ctx, "partner:{"+ka+"}:lease:h")
					return open
				})
			}
			done := make(chan error, 1)
			start := time.Now()
			go func() { done <- b.Close(ctx) }()
			leasetest.WaitFor(t, func() bool { return hook.heldB.Load() == 1 })
			if tc.stopped {
				// Two rounds of KA's keeper, each a call past master 0's
				// open breaker that failed: Semaphore.away is 2.
				leasetest.WaitFor(t, func() bool { return hook.failedA.Load() >= 2 })
			}
			time.Sleep(300 * time.Millisecond)
			open1, _ := eng.UnavailableFor(ctx, "partner:{"+kb+"}:lease:h")
			close(hook.release)
			cerr := leasetest.Recv(t, done, "B's Close")
			took := time.Since(start)
			for range keys {
				require.ErrorIs(t, leasetest.Recv(t, got, "B's Acquire"), lease.ErrClosed)
			}
			wsB, _ := c48bStanding(ca, prefix, []string{kb})
			time.Sleep(time.Second)
			wsB2, _ := c48bStanding(ca, prefix, []string{kb})
			openAfter, _ := eng.UnavailableFor(ctx, "partner:{"+kb+"}:lease:h")
			t.Logf("%s: Close took %v, error %v; KB's own leave call held %d, failed with %q (master 1's breaker open before: %v, after: %v); KA's keeper calls failed %d; KB's keeper calls passed on %d, answered %d; KB's gone waiter standing on master 1 after Close: %v, 1 s later: %v",
				tc.name, took, cerr, hook.heldB.Load(), tc.err, open1, openAfter, hook.failedA.Load(), hook.keeperB.Load(), hook.okB.Load(), wsB, wsB2)
			require.Equal(t, int32(1), hook.heldB.Load(), "premise: KB's own leave call held and failed unsent")
			require.False(t, open1, "premise: master 1's breaker closed before KB's call failed")
			if tc.stopped {
				require.Equal(t, int32(2), hook.failedA.Load(), "premise: KA's keeper sent two calls past master 0's breaker, both failed, and then dropped what it owed")
			}
			assert.NoError(t, cerr, "%s: B's Close", tc.name)
			assert.Positive(t, hook.okB.Load(), "%s: B's keeper leave calls for KB answered (master 1 answers): the call owed was dropped unsent", tc.name)
			assert.Empty(t, wsB, "%s: KB's gone waiter standing on master 1 (answering) once Close returned nil", tc.name)
			assert.Empty(t, wsB2, "%s: KB's gone waiter standing on master 1 a second after Close returned", tc.name)
		})
	}
}
