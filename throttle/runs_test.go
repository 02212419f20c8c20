package throttle_test

import (
	"context"
	"math/rand/v2"
	"strconv"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/slotbook/slotbook/internal/redistest"
	"github.com/slotbook/slotbook/internal/testhook"
	"github.com/slotbook/slotbook/throttle"
)

// TestBookRunsMatchTextbookGCRA: batches made of runs of like requests
// (which book.lua takes as one (count, n, max wait) triple each), with
// refusals in the middle of a run and between runs, on one and two
// limits. Every booking's wait is the textbook model's; then every
// booking is given back, latest first, and each gives back exactly what
// the model says it took, end - max(before, now): so the TATs the client
// works out for each request of a run (the reply carries only the
// first's) are the ones Redis judged it against, and the key ends where
// it started.
func TestBookRunsMatchTextbookGCRA(t *testing.T) {
	t.Parallel()
	srv := redistest.Shared(t)
	rdb := srv.Client(t)
	eng, prefix := textbookEngine(t, rdb)
	limits := []throttle.Limit{throttle.PerSecond(10, 4), throttle.Every(time.Minute, 40, 6)}
	rng := rand.New(rand.NewPCG(11, 5))
	var refusedMidRun, longRuns int
	for round := 0; round < 40; round++ {
		m := 1 + round%2
		ls := limits[:m]
		maxN := 5 // burst+1 of the first limit; the second allows 7
		keys := make([]string, m)
		for i := range keys {
			keys[i] = "{runs" + strconv.Itoa(round) + "}:" + strconv.Itoa(i)
		}
		// An explicit clock, so that no slot comes before its refund.
		now := int64(1_767_225_600_000_000) + int64(round)*1_000_000_000
		ctx := testhook.WithNow(context.Background(), now)
		model := &textbookModel{limits: ls, tat: make([]int64, m), known: make([]bool, m)}
		// A full burst first, so that every later booking waits (a slot
		// that has come cannot be given back).
		first, err := eng.BookAll(ctx, keys, ls, []throttle.Request{{N: maxN, MaxWait: 0}})
		require.NoError(t, err)
		ok, _, _ := model.judge(now, maxN, 0)
		require.True(t, ok)
		require.True(t, first[0].OK)
		start := append([]int64(nil), model.tat...)

		var reqs []throttle.Request
		for len(reqs) < 150 {
			r := throttle.Request{N: 1 + rng.IntN(maxN)}
			switch rng.IntN(4) {
			case 0:
				r.MaxWait = time.Duration(rng.IntN(3000)) * time.Millisecond
			case 1:
				r.MaxWait = time.Duration(rng.Int64N(int64(20 * time.Second)))
			default:
				r.MaxWait = throttle.Forever
			}
			run := 1 + rng.IntN(60)
			if run >= 20 {
				longRuns++
			}
			for j := 0; j < run && len(reqs) < throttle.MaxBatch; j++ {
				reqs = append(reqs, r)
			}
		}
		bs, err := eng.BookAll(ctx, keys, ls, reqs)
		require.NoError(t, err)
		require.Len(t, bs, len(reqs))
		type took struct{ before, after []int64 }
		var booked []int
		var tookBy []took
		for i, b := range bs {
			mw := int64(min(reqs[i].MaxWait, throttle.MaxHorizon) / time.Microsecond)
			ok, wait, before := model.judge(now, reqs[i].N, mw)
			require.Equal(t, ok, b.OK, "round %d request %d (n %d, max wait %v)", round, i, reqs[i].N, reqs[i].MaxWait)
			require.Equal(t, wait, b.Wait.Microseconds(), "round %d request %d: wait", round, i)
			require.Equal(t, now+wait, b.At.UnixMicro(), "round %d request %d: slot", round, i)
			if !ok {
				if i > 0 && reqs[i] == reqs[i-1] && i+1 < len(reqs) && reqs[i+1] == reqs[i] {
					refusedMidRun++
				}
				continue
			}
			booked = append(booked, i)
			tookBy = append(tookBy, took{before, append([]int64(nil), model.tat...)})
		}
		for j := len(booked) - 1; j >= 0; j-- {
			i, tk := booked[j], tookBy[j]
			given, err := eng.RefundAll(ctx, keys, ls, bs[i])
			require.NoError(t, err)
			for k := range keys {
				want := tk.after[k] - max(tk.before[k], now)
				require.Equal(t, time.Duration(want)*time.Microsecond, given[k], "round %d: refund of request %d, limit %d", round, i, k)
			}
		}
		for k, key := range keys {
			v, err := rdb.Get(context.Background(), prefix+key).Int64()
			require.NoError(t, err)
			require.Equal(t, start[k], v, "round %d key %d: back where the batch started", round, k)
		}
	}
	require.Positive(t, refusedMidRun, "some refusals fell inside a run")
	require.Positive(t, longRuns)
	t.Logf("%d refusals inside a run, %d runs of 20 or more", refusedMidRun, longRuns)
}
