package throttle_test

import (
	"context"
	"fmt"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/slotbook/slotbook/internal/redistest"
	"github.com/slotbook/slotbook/internal/testhook"
	"github.com/slotbook/slotbook/throttle"
)

// TestRunsBookRetryAgainstModel: BookRetry (book.lua with the retry
// tail) on one and two limits, booked and refused, interleaved with
// BookAll batches of runs, against the review's GCRA; the TATs the retry
// reply carries back are checked by giving its bookings back, latest
// first, and comparing each give and the keys with the model. Half the
// calls follow a SCRIPT FLUSH.
func TestRunsBookRetryAgainstModel(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t) // its own: SCRIPT FLUSH below would make other tests' calls on the shared one go twice (NOSCRIPT, then EVAL)
	rdb := srv.Client(t)
	eng, prefix := textbookEngine(t, rdb)
	all := []throttle.Limit{throttle.PerSecond(5, 2), throttle.Every(time.Minute, 30, 4)}
	rng := rand.New(rand.NewPCG(5, 55))
	var refused, recorded int
	for round := 0; round < 20; round++ {
		m := 1 + round%2
		limits := all[:m]
		keys := make([]string, m)
		for i := range keys {
			keys[i] = fmt.Sprintf("{rr%d}:%d", round, i)
		}
		now := int64(1_800_000_000_000_000) + int64(round)*10_000_000_000
		ctx := testhook.WithNow(context.Background(), now)
		g := newReviewGCRA(limits)
		type done struct {
			b throttle.Booking
			m reviewBooked
		}
		var booked []done
		for step := 0; step < 30; step++ {
			if rng.IntN(2) == 0 {
				require.NoError(t, rdb.ScriptFlush(context.Background()).Err())
			}
			if rng.IntN(3) == 0 {
				reqs := make([]throttle.Request, 1+rng.IntN(6))
				for i := range reqs {
					reqs[i] = throttle.Request{N: 1, MaxWait: 3 * time.Second}
				}
				bs, err := eng.BookAll(ctx, keys, limits, reqs)
				require.NoError(t, err)
				for i, r := range reqs {
					want := g.book(now, r.N, int64(r.MaxWait/time.Microsecond))
					require.Equal(t, want.ok, bs[i].OK)
					require.Equal(t, want.wait, bs[i].Wait.Microseconds())
					if want.ok {
						booked = append(booked, done{bs[i], want})
					}
				}
				continue
			}
			req := throttle.Request{N: 1 + rng.IntN(2), MaxWait: time.Duration(rng.IntN(4000)) * time.Millisecond}
			idx := throttle.RetryIndex{Key: fmt.Sprintf("{rr%d}:idx", round), Member: fmt.Sprintf("t%d", step),
				KeepFrom: 2 * time.Second, Window: time.Second, MaxDue: 5}
			rb, err := eng.BookRetry(ctx, keys, limits, req, idx)
			require.NoError(t, err)
			want := g.book(now, req.N, int64(req.MaxWait/time.Microsecond))
			require.False(t, rb.Recalled)
			require.Equal(t, want.ok, rb.OK, "round %d step %d", round, step)
			require.Equal(t, want.wait, rb.Wait.Microseconds(), "round %d step %d", round, step)
			require.Equal(t, now+want.wait, rb.At.UnixMicro())
			require.Equal(t, now, rb.Now.UnixMicro())
			require.Equal(t, want.ok && want.wait > (2*time.Second).Microseconds(), rb.Recorded)
			if !want.ok {
				refused++
			}
			if rb.Recorded {
				recorded++
			}
			if want.ok {
				booked = append(booked, done{rb.Booking, want})
			}
		}
		reviewCheckKeys(t, rdb, prefix, keys, g, now, fmt.Sprintf("round %d", round))
		for i := len(booked) - 1; i >= 0; i-- {
			got, err := eng.RefundAll(ctx, keys, limits, booked[i].b)
			require.NoError(t, err)
			want := g.refund(now, i, booked[i].m)
			for k := range keys {
				require.Equal(t, time.Duration(want[k])*time.Microsecond, got[k], "round %d refund %d limit %d", round, i, k)
			}
			reviewCheckKeys(t, rdb, prefix, keys, g, now, fmt.Sprintf("round %d refund %d", round, i))
		}
	}
	require.Positive(t, refused)
	require.Positive(t, recorded)
	t.Logf("%d retries refused, %d recorded", refused, recorded)
}
