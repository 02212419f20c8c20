package throttle_test

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/slotbook/slotbook/internal/redistest"
	"github.com/slotbook/slotbook/internal/testhook"
	"github.com/slotbook/slotbook/throttle"
)

// TestRunsFullBatchOneRun: MaxBatch alike requests (one run of
// 1000) under one and two limits, refused from some point on inside the
// run, against the review's GCRA; every booking given back latest first
// returns exactly what the model says and leaves the keys where they
// were. One more request is bad input.
func TestRunsFullBatchOneRun(t *testing.T) {
	t.Parallel()
	srv := redistest.Shared(t)
	rdb := srv.Client(t)
	argv := &reviewArgv{}
	rdb.AddHook(argv)
	eng, prefix := textbookEngine(t, rdb)
	all := []throttle.Limit{throttle.PerSecond(10, 5), throttle.PerMinute(300, 50)}
	for m := 1; m <= 2; m++ {
		limits := all[:m]
		keys := make([]string, m)
		for i := range keys {
			keys[i] = fmt.Sprintf("{rvfull%d}:%d", m, i)
		}
		now := int64(1_800_000_000_000_000) + int64(m)*1_000_000_000_000
		ctx := testhook.WithNow(context.Background(), now)
		g := newReviewGCRA(limits)
		// A first booking, so that every later one waits.
		first, err := eng.BookAll(ctx, keys, limits, []throttle.Request{{N: 6, MaxWait: 0}})
		require.NoError(t, err)
		require.True(t, first[0].OK)
		g.book(now, 6, 0)
		start := append([]int64(nil), g.tat...)
		reqs := make([]throttle.Request, throttle.MaxBatch)
		for i := range reqs {
			reqs[i] = throttle.Request{N: 2, MaxWait: 40*time.Second + 999}
		}
		bs, err := eng.BookAll(ctx, keys, limits, reqs)
		require.NoError(t, err)
		// The wire protocol: one run, (1000, 2, 40 000 000); the ns
		// dropped.
		last := argv.last()
		require.Equal(t, []any{"1000", "2", "40000000"}, last[len(last)-3:], "one run of 1000")
		require.Len(t, last, 3+m+2+2*m+3, "EVALSHA sha numkeys keys now m (I tau)*m count n W")
		model := make([]reviewBooked, len(reqs))
		var okN int
		for i := range reqs {
			model[i] = g.book(now, 2, (40 * time.Second).Microseconds())
			require.Equal(t, model[i].ok, bs[i].OK, "m %d request %d", m, i)
			require.Equal(t, model[i].wait, bs[i].Wait.Microseconds(), "m %d request %d", m, i)
			if bs[i].OK {
				okN++
			}
		}
		require.True(t, okN > 0 && okN < len(reqs), "m %d: %d booked", m, okN)
		reviewCheckKeys(t, rdb, prefix, keys, g, now, "after the run")
		for i := len(bs) - 1; i >= 0; i-- {
			got, err := eng.RefundAll(ctx, keys, limits, bs[i])
			require.NoError(t, err)
			want := g.refund(now, i, model[i])
			for k := range keys {
				require.Equal(t, time.Duration(want[k])*time.Microsecond, got[k], "m %d refund %d", m, i)
			}
		}
		require.Equal(t, start, g.tat)
		reviewCheckKeys(t, rdb, prefix, keys, g, now, "after the refunds")
		_, err = eng.BookAll(ctx, keys, limits, append(reqs, reqs[0]))
		require.ErrorIs(t, err, throttle.ErrInvalidRequest)
	}
}

// TestRunsAcrossRestart: a batch of runs, then the Redis server
// restarts (state and scripts gone): the next batch is sent again by EVAL
// and judged on an empty key, and a refund of a booking made before the
// restart, whose end the key does not hold, gives nothing. (Had the new
// batch been the same on the same frozen clock, the key would hold the
// old booking's end and the refund would give the new booking's room:
// refund.lua tells bookings apart by their ends, before and after this
// change alike.)
func TestRunsAcrossRestart(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	srv.RequireReal(t)
	rdb := srv.Client(t)
	eng, prefix := textbookEngine(t, rdb)
	lim := throttle.PerSecond(10, 2)
	now := int64(1_800_000_000_000_000)
	ctx := testhook.WithNow(context.Background(), now)
	reqs := []throttle.Request{{N: 1, MaxWait: time.Second}, {N: 1, MaxWait: time.Second}, {N: 1, MaxWait: time.Second}, {N: 2, MaxWait: time.Second}, {N: 2, MaxWait: time.Second}}
	g := newReviewGCRA([]throttle.Limit{lim})
	bs, err := eng.BookBatch(ctx, "{rvrs}", lim, reqs)
	require.NoError(t, err)
	for i, r := range reqs {
		w := g.book(now, r.N, r.MaxWait.Microseconds())
		require.Equal(t, w.wait, bs[i].Wait.Microseconds())
	}
	srv.Restart(t)
	g = newReviewGCRA([]throttle.Limit{lim})
	var again []throttle.Booking
	redistest.UntilOK(t, func() error {
		var err error
		again, err = eng.BookBatch(ctx, "{rvrs}", lim, reqs[:3])
		return err
	})
	for i, r := range reqs[:3] {
		w := g.book(now, r.N, r.MaxWait.Microseconds())
		require.Equal(t, w.ok, again[i].OK, "request %d", i)
		require.Equal(t, w.wait, again[i].Wait.Microseconds(), "request %d", i)
	}
	// A booking made before the restart: the key holds another end now,
	// so nothing is given back and the key is left as it is.
	given, err := eng.Refund(ctx, "{rvrs}", lim, bs[len(bs)-1])
	require.NoError(t, err)
	require.Zero(t, given)
	reviewCheckKeys(t, rdb, prefix, []string{"{rvrs}"}, g, now, "after the stale refund")
}

// TestRunsMicrosecondEdges: max waits that round down to the same
// microsecond are one run to the client and the same request to the
// script; a microsecond less refuses. Each is judged at the exact wait it
// needs (100 ms apart, no burst).
func TestRunsMicrosecondEdges(t *testing.T) {
	t.Parallel()
	srv := redistest.Shared(t)
	rdb := srv.Client(t)
	eng, prefix := textbookEngine(t, rdb)
	lim := throttle.PerSecond(10, 0)
	now := int64(1_800_000_000_000_000)
	ctx := testhook.WithNow(context.Background(), now)
	ms := time.Millisecond
	reqs := []throttle.Request{
		{N: 1, MaxWait: 0},                               // booked at once
		{N: 1, MaxWait: 100*ms - time.Nanosecond},        // 99 999 µs: refused
		{N: 1, MaxWait: 100*ms - time.Microsecond + 999}, // the same: refused
		{N: 1, MaxWait: 100 * ms},                        // booked at 100 ms
		{N: 1, MaxWait: 100*ms + 999},                    // the same as the last: needs 200 ms, refused
		{N: 1, MaxWait: 200*ms + time.Microsecond},       // booked at 200 ms
		{N: 1, MaxWait: 300*ms - time.Microsecond},       // refused
		{N: 1, MaxWait: 300 * ms},                        // booked
	}
	bs, err := eng.BookBatch(ctx, "{rvus}", lim, reqs)
	require.NoError(t, err)
	g := newReviewGCRA([]throttle.Limit{lim})
	wantOK := []bool{true, false, false, true, false, true, false, true}
	for i, r := range reqs {
		w := g.book(now, r.N, int64(r.MaxWait/time.Microsecond))
		require.Equal(t, wantOK[i], w.ok, "model, request %d", i)
		require.Equal(t, w.ok, bs[i].OK, "request %d", i)
		require.Equal(t, w.wait, bs[i].Wait.Microseconds(), "request %d", i)
	}
	reviewCheckKeys(t, rdb, prefix, []string{"{rvus}"}, g, now, "after")
}

// reviewArgv records the arguments of the last script call, as strings.
type reviewArgv struct {
	mu   sync.Mutex
	args []any
}

func (h *reviewArgv) DialHook(next redis.DialHook) redis.DialHook { return next }

func (h *reviewArgv) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		if name := cmd.Name(); name == "evalsha" || name == "eval" {
			args := make([]any, len(cmd.Args()))
			for i, a := range cmd.Args() {
				args[i] = fmt.Sprint(a)
			}
			h.mu.Lock()
			h.args = args
			h.mu.Unlock()
		}
		return next(ctx, cmd)
	}
}

func (h *reviewArgv) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}

func (h *reviewArgv) last() []any {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.args
}
