package throttle_test

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/slotbook/slotbook/internal/redistest"
	"github.com/slotbook/slotbook/throttle"
)

// TestMergeAtMergesWithConnectionsFree: 16 callers book single requests
// through a client of 20 connections, so that a connection is always
// free. With WithMergeAt(2) the bookings beyond two in flight merge: fewer
// calls than bookings, each booking as a textbook GCRA gives it. With
// WithMergeAt(20), the pool's size (the control, in the same run), only a
// full pool merges, so every booking is a call of its own.
func TestMergeAtMergesWithConnectionsFree(t *testing.T) {
	t.Parallel()
	for _, at := range []int{2, 20} {
		t.Run(fmt.Sprintf("at=%d", at), func(t *testing.T) {
			eng, _, _, calls := mergeEngine(t, 20, throttle.WithMergeAt(at))
			before := calls.Load()
			recs, total := bookConcurrently(t, eng, 16, 40, 7)
			used := calls.Load() - before
			replayTextbook(t, recs)
			t.Logf("%d bookings in %d calls", total, used)
			if at == 2 {
				require.Less(t, used, int64(total), "calls for %d bookings: none merged", total)
			} else {
				require.Equal(t, int64(total), used, "calls for %d bookings with merging only on a full pool", total)
			}
		})
	}
}

// inFlight is a go-redis hook that keeps the most script calls it has
// seen in flight at once.
type inFlight struct{ now, most atomic.Int64 }

func (h *inFlight) DialHook(next redis.DialHook) redis.DialHook { return next }
func (h *inFlight) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}
func (h *inFlight) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		if n := cmd.Name(); n != "evalsha" && n != "eval" {
			return next(ctx, cmd)
		}
		n := h.now.Add(1)
		for m := h.most.Load(); n > m && !h.most.CompareAndSwap(m, n); m = h.most.Load() {
		}
		defer h.now.Add(-1)
		return next(ctx, cmd)
	}
}

// TestMergeAtBoundsCallsInFlight: through a proxy that holds every reply
// back 20 ms, 24 callers book single requests with WithMergeAt(3),
// WithMergeWait(Forever) (batches wait for a flight token however long it
// takes) and a pool of 30: no more than three booking calls are ever in
// flight, and every caller is answered.
func TestMergeAtBoundsCallsInFlight(t *testing.T) {
	t.Parallel()
	srv := redistest.Shared(t)
	p := redistest.NewProxy(t, srv.Addr)
	rdb := p.Client(t, srv, func(o *redis.Options) { o.PoolSize = 30 })
	h := new(inFlight)
	eng, err := throttle.New(rdb, throttle.WithPrefix(redistest.Prefix(t)), throttle.WithTimeout(5*time.Second), throttle.WithMergeAt(3), throttle.WithMergeWait(throttle.Forever))
	require.NoError(t, err)
	require.NoError(t, eng.Load(context.Background()))
	rdb.AddHook(h)
	p.SetReplyDelay(20 * time.Millisecond)
	var wg sync.WaitGroup
	var booked atomic.Int64
	for g := range 24 {
		wg.Go(func() {
			for i := range 5 {
				b, err := eng.Book(context.Background(), fmt.Sprintf("f%d-%d", g, i), throttle.PerSecond(10, 0), throttle.Request{N: 1, MaxWait: throttle.Forever})
				if err != nil {
					t.Error(err)
					return
				}
				if b.OK {
					booked.Add(1)
				}
			}
		})
	}
	wg.Wait()
	require.Equal(t, int64(24*5), booked.Load(), "every booking on an idle key")
	require.LessOrEqual(t, h.most.Load(), int64(3), "booking calls in flight at once")
	require.Positive(t, h.most.Load())
}

// TestMergeAtRefusesBadCounts: a count below one, and a merge wait that is
// not positive, are errors from New.
func TestMergeAtRefusesBadCounts(t *testing.T) {
	t.Parallel()
	rdb := redis.NewClient(&redis.Options{Addr: "127.0.0.1:1", ContextTimeoutEnabled: true})
	defer rdb.Close()
	for _, k := range []int{0, -1} {
		_, err := throttle.New(rdb, throttle.WithMergeAt(k))
		require.Error(t, err, "WithMergeAt(%d)", k)
	}
	for _, d := range []time.Duration{0, -time.Millisecond} {
		_, err := throttle.New(rdb, throttle.WithMergeWait(d))
		require.Error(t, err, "WithMergeWait(%v)", d)
	}
	_, err := throttle.New(rdb, throttle.WithMergeAt(1), throttle.WithMergeWait(time.Nanosecond))
	require.NoError(t, err)
}

// TestMergeAtAloneAgainStaysInBound: with WithMergeAt(1),
// WithMergeWait(Forever) and replies held back 100 ms, a batch holding a corrupt key's booking is followed by
// another batch; the corrupt key's booking, answered "alone" by its merged
// call, is sent again alone only once it has the one flight token, so no
// two booking calls are ever in flight at once.
func TestMergeAtAloneAgainStaysInBound(t *testing.T) {
	t.Parallel()
	srv := redistest.Shared(t)
	p := redistest.NewProxy(t, srv.Addr)
	rdb := p.Client(t, srv, func(o *redis.Options) { o.PoolSize = 10 })
	prefix := redistest.Prefix(t)
	eng, err := throttle.New(rdb, throttle.WithPrefix(prefix), throttle.WithTimeout(5*time.Second), throttle.WithMergeAt(1), throttle.WithMergeWait(throttle.Forever))
	require.NoError(t, err)
	ctx := context.Background()
	require.NoError(t, eng.Load(ctx))
	direct := srv.Client(t)
	h := new(inFlight)
	rdb.AddHook(h)
	p.SetReplyDelay(100 * time.Millisecond)
	lim := throttle.PerSecond(10, 0)
	book := func(key string) error {
		_, err := eng.Book(ctx, key, lim, throttle.Request{N: 1, MaxWait: throttle.Forever})
		return err
	}
	for round := range 3 {
		key := func(k string) string { return fmt.Sprintf("%s-%d", k, round) }
		require.NoError(t, direct.Set(ctx, prefix+key("corrupt"), "not a tat", time.Minute).Err())
		var wg sync.WaitGroup
		errs := make(chan error, 8)
		wg.Go(func() { errs <- book(key("holder")) })
		time.Sleep(30 * time.Millisecond) // the holder flies; the rest merge behind it
		for _, k := range []string{"corrupt", "a", "b"} {
			wg.Go(func() {
				if err := book(key(k)); err != nil && k != "corrupt" {
					errs <- err
				}
			})
		}
		// While the first batch is out, more bookings wait behind it.
		time.Sleep(150 * time.Millisecond)
		for _, k := range []string{"c", "d"} {
			wg.Go(func() { errs <- book(key(k)) })
		}
		wg.Wait()
		close(errs)
		for err := range errs {
			require.NoError(t, err)
		}
	}
	require.Equal(t, int64(1), h.most.Load(), "booking calls in flight at once")
}
