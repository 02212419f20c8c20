package pool_test

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/slotbook/slotbook/pool"
	"github.com/slotbook/slotbook/reserve"
	"github.com/slotbook/slotbook/throttle"
)

// owedJob is a job with its own context.
type owedJob struct {
	j      *pool.Job
	cancel context.CancelFunc
	keep   bool // cancelled last (or left to run)
}

// owedSettle waits until every key holds at least one booking after its
// head and the bookings have stopped growing for 30 ms (at most 3 s).
func owedSettle(e *reviewEnv, name string, keys []string, at []int64) {
	last, since := int64(-1), time.Now()
	for deadline := time.Now().Add(3 * time.Second); time.Now().Before(deadline); time.Sleep(time.Millisecond) {
		total, all := int64(0), true
		for i, k := range keys {
			b := e.booked(name, k, at[i])
			all = all && b >= 1
			total += b
		}
		if total != last {
			last, since = total, time.Now()
		}
		if all && time.Since(since) > 30*time.Millisecond {
			return
		}
	}
}

// owedRound: heads on each key, then n jobs per key (interleaved), each
// with its own context. A random subset per key (at least one job, anywhere
// in the order) is kept; the others are cancelled in a random order, with
// random pauses. Each of those must be done soon, unrun, with
// context.Canceled, long before its slot (10 s apart). Then the kept ones
// end: by cancel (random order), Close, Close then cancel, or cancel
// during Close. All the room must come back.
func owedRound(t *testing.T, e *reviewEnv, name string, workers, nkeys, n, end int) {
	lim := e.limiter(t, name)
	p, err := pool.New(lim, pool.WithWorkers(workers))
	require.NoError(t, err)
	defer func() { _ = p.Close(context.Background()) }()
	var keys []string
	for k := range nkeys {
		keys = append(keys, fmt.Sprintf("k%d", k))
	}
	heads, at := reviewHeads(t, p, keys)
	jobs := make(map[string][]*owedJob)
	var all []*owedJob
	for range n {
		for _, k := range keys {
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			j, err := p.Submit(ctx, k, func(context.Context) error { return nil })
			require.NoError(t, err)
			oj := &owedJob{j: j, cancel: cancel}
			jobs[k] = append(jobs[k], oj)
			all = append(all, oj)
		}
	}
	for _, k := range keys {
		js := jobs[k]
		js[rand.IntN(len(js))].keep = true
		for _, oj := range js {
			if rand.IntN(4) == 0 {
				oj.keep = true
			}
		}
	}
	owedSettle(e, name, keys, at)

	var first, kept []*owedJob
	for _, oj := range all {
		if oj.keep {
			kept = append(kept, oj)
		} else {
			first = append(first, oj)
		}
	}
	rand.Shuffle(len(first), func(a, b int) { first[a], first[b] = first[b], first[a] })
	rand.Shuffle(len(kept), func(a, b int) { kept[a], kept[b] = kept[b], kept[a] })
	for _, oj := range first {
		oj.cancel()
		if rand.IntN(3) == 0 {
			time.Sleep(time.Duration(rand.IntN(3000)) * time.Microsecond)
		}
	}
	for i, oj := range first {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		err := oj.j.Wait(ctx)
		cancel()
		require.ErrorIs(t, err, context.Canceled, "cancelled job %d (kept ones still wanted): not done with its context's error", i)
		require.True(t, oj.j.Started().IsZero(), "cancelled job %d ran", i)
		if s := oj.j.Slot(); !s.IsZero() {
			require.True(t, time.Now().Before(s), "cancelled job %d reported done only after its slot", i)
		}
	}

	cancelKept := func() {
		for _, oj := range kept {
			oj.cancel()
			if rand.IntN(3) == 0 {
				time.Sleep(time.Duration(rand.IntN(1000)) * time.Microsecond)
			}
		}
	}
	switch end {
	case 0:
		cancelKept()
	case 1:
		require.NoError(t, p.Close(context.Background()))
	case 2:
		require.NoError(t, p.Close(context.Background()))
		cancelKept()
	case 3:
		go cancelKept()
		require.NoError(t, p.Close(context.Background()))
	}
	wctx, wcancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer wcancel()
	require.NoError(t, p.Wait(wctx), "p.Wait")
	cctx, ccancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer ccancel()
	require.NoError(t, p.Close(cctx))
	for i, k := range keys {
		js := []*pool.Job{heads[i]}
		for _, oj := range jobs[k] {
			js = append(js, oj.j)
		}
		e.check(t, name, k, js, nil, context.Canceled, pool.ErrClosed)
	}
}

// TestReviewOwedRandomOrder: jobs with their own contexts, cancelled in
// random orders under later ones still wanted (owed), then the wanted
// ones end by cancel or Close in each way: every booking's room comes
// back, and every job is done.
func TestReviewOwedRandomOrder(t *testing.T) {
	t.Parallel()
	for _, w := range []int{2, 64} {
		for _, nkeys := range []int{1, 3} {
			for end := range 4 {
				t.Run(fmt.Sprintf("workers=%d/keys=%d/end=%d", w, nkeys, end), func(t *testing.T) {
					e := newReviewEnv(t, 0)
					n := max(3, min(w, 24)/nkeys)
					for i := range 2 { // the review ran 4
						if !t.Run(fmt.Sprint(i), func(t *testing.T) { owedRound(t, e, fmt.Sprintf("o%d", i), w, nkeys, n, end) }) {
							return
						}
					}
				})
			}
		}
	}
}

// owedFast is the 200 ms limit of the tests whose slots must come.
var owedFast = throttle.Every(200*time.Millisecond, 1, 0)

const owedFastI = int64(200_000) // µs

// TestReviewOwedKeptRun: on a 200 ms limit, jobs cancelled in random order
// under later ones that stay wanted and run. The kept ones run at their
// slots, the others never run and are done as soon as cancelled; what was
// booked after the last kept one comes back, and what was owed under it
// gives nothing (it ran on it): the key ends at the textbook TAT of the
// jobs that ran.
func TestReviewOwedKeptRun(t *testing.T) {
	t.Parallel()
	e := newReviewEnv(t, 0)
	for round := range 6 {
		t.Run(fmt.Sprint(round), func(t *testing.T) {
			name := fmt.Sprintf("f%d", round)
			lim, err := reserve.New(e.eng, name, owedFast, reserve.WithoutMaxWait())
			require.NoError(t, err)
			p, err := pool.New(lim, pool.WithWorkers(64))
			require.NoError(t, err)
			defer func() { _ = p.Close(context.Background()) }()
			heads, _ := reviewHeads(t, p, []string{"k"})
			const n = 6
			var js []*owedJob
			for range n {
				ctx, cancel := context.WithCancel(context.Background())
				defer cancel()
				j, err := p.Submit(ctx, "k", func(context.Context) error { return nil })
				require.NoError(t, err)
				js = append(js, &owedJob{j: j, cancel: cancel})
			}
			js[rand.IntN(n-1)].keep = true // never the last: something after it comes back
			for _, oj := range js {
				oj.keep = oj.keep || rand.IntN(4) == 0
			}
			// All booked: the TAT is n+1 intervals past the head's slot.
			key := e.prefix + name + ":{k}"
			head := heads[0].Reservation().Booking().At.UnixMicro()
			require.Eventually(t, func() bool {
				v, err := e.direct.Get(context.Background(), key).Int64()
				return err == nil && v == head+int64(n+1)*owedFastI
			}, 2*time.Second, time.Millisecond, "not all booked")
			var drop []*owedJob
			for _, oj := range js {
				if !oj.keep {
					drop = append(drop, oj)
				}
			}
			rand.Shuffle(len(drop), func(a, b int) { drop[a], drop[b] = drop[b], drop[a] })
			for _, oj := range drop {
				oj.cancel()
			}
			require.NoError(t, p.Wait(context.Background()))
			now, err := e.direct.Time(context.Background()).Result()
			require.NoError(t, err)
			var story []string
			ran := []int64{head}
			for i, oj := range js {
				err := oj.j.Err()
				b := oj.j.Reservation().Booking()
				story = append(story, fmt.Sprintf("%d keep=%v err=%v at=%+dI", i, oj.keep, err, (b.At.UnixMicro()-head)/owedFastI))
				if oj.keep {
					require.NoError(t, err, "kept job %d", i)
					require.False(t, oj.j.Started().Before(oj.j.Slot()), "kept job %d started before its slot", i)
					ran = append(ran, b.At.UnixMicro())
					continue
				}
				require.ErrorIs(t, err, context.Canceled, "job %d", i)
				require.True(t, oj.j.Started().IsZero(), "cancelled job %d ran", i)
			}
			// Textbook: each ran slot conforms; the TAT is the last's + I.
			var tat int64
			for k, s := range ran {
				require.False(t, k > 0 && s < tat, "slot %d early; %q", k, story)
				tat = max(tat, s) + owedFastI
			}
			for _, oj := range drop {
				if !oj.j.Reservation().Booking().At.After(now) && oj.j.Reservation().Booking().At.UnixMicro() > ran[len(ran)-1] {
					t.Skip("a dropped booking after the last kept one had its slot come before the check; inconclusive")
				}
			}
			got, err := e.direct.Get(context.Background(), key).Int64()
			if errors.Is(err, redis.Nil) {
				got = 0
			} else {
				require.NoError(t, err)
			}
			if tat <= now.UnixMicro() && got <= now.UnixMicro() {
				return
			}
			require.Equal(t, tat, got, "TAT %+d intervals from the textbook's; %q", (got-tat)/owedFastI, story)
		})
	}
}

// TestReviewOwedSlotCome: on a 200 ms limit, jobs cancelled under a later
// one still wanted; then the later one is cancelled or Close comes, after
// the first slots have come. Written when such jobs were owed until their
// slots came and went (forgotten); since the pool hands slots down, the
// wanted job takes the first of them (it may run, at a slot no earlier
// than the textbook's next after the head) and the rest go back. Nothing
// else runs, every job is done, Close/cancel still returns, and the key
// ends no later than the end of the latest booking whose slot has come.
func TestReviewOwedSlotCome(t *testing.T) {
	t.Parallel()
	e := newReviewEnv(t, 0)
	for round := range 4 {
		t.Run(fmt.Sprint(round), func(t *testing.T) {
			name := fmt.Sprintf("c%d", round)
			lim, err := reserve.New(e.eng, name, owedFast, reserve.WithoutMaxWait())
			require.NoError(t, err)
			p, err := pool.New(lim, pool.WithWorkers(64))
			require.NoError(t, err)
			defer func() { _ = p.Close(context.Background()) }()
			heads, _ := reviewHeads(t, p, []string{"k"})
			head := heads[0].Reservation().Booking().At.UnixMicro()
			// 2 owed (slots +1I, +2I), then a wanted one far enough out to
			// outlive them: 10 more jobs in between that are cancelled too
			// (owed), the last wanted at +13I.
			const n = 13
			var js []*owedJob
			for range n {
				ctx, cancel := context.WithCancel(context.Background())
				defer cancel()
				j, err := p.Submit(ctx, "k", func(context.Context) error { return nil })
				require.NoError(t, err)
				js = append(js, &owedJob{j: j, cancel: cancel})
			}
			key := e.prefix + name + ":{k}"
			require.Eventually(t, func() bool {
				v, err := e.direct.Get(context.Background(), key).Int64()
				return err == nil && v == head+int64(n+1)*owedFastI
			}, 2*time.Second, time.Millisecond, "not all booked")
			for _, i := range rand.Perm(n - 1) {
				js[i].cancel()
			}
			for i := range n - 1 {
				require.ErrorIs(t, js[i].j.Wait(context.Background()), context.Canceled)
			}
			// Wait (Redis clock) until the first two owed slots have come.
			for {
				now, err := e.direct.Time(context.Background()).Result()
				require.NoError(t, err)
				if now.UnixMicro() > head+2*owedFastI+20_000 {
					break
				}
				time.Sleep(10 * time.Millisecond)
			}
			if round%2 == 0 {
				js[n-1].cancel()
			} else {
				require.NoError(t, p.Close(context.Background()))
			}
			require.NoError(t, p.Wait(context.Background()))
			require.NoError(t, p.Close(context.Background()))
			now, err := e.direct.Time(context.Background()).Result()
			require.NoError(t, err)
			for i, oj := range js[:n-1] {
				require.True(t, oj.j.Started().IsZero(), "job %d ran", i)
			}
			if last := js[n-1].j; !last.Started().IsZero() {
				// Handed down a slot: never before the textbook's next one
				// after the head, never before its own slot.
				require.GreaterOrEqual(t, last.Reservation().Booking().At.UnixMicro(), head+owedFastI, "the wanted job's slot")
				require.False(t, last.Started().Before(last.Slot()), "the wanted job started before its slot")
			}
			// Bookings whose slot had not come by now gave back; those whose
			// slot came gave nothing. So the TAT is at most the end of the
			// latest booking whose slot has come, i.e. <= now + I.
			got, err := e.direct.Get(context.Background(), key).Int64()
			if errors.Is(err, redis.Nil) {
				return
			}
			require.NoError(t, err)
			require.LessOrEqual(t, got, now.UnixMicro()+owedFastI, "room not given back: TAT %+dI from head, now %+dI", (got-head)/owedFastI, (now.UnixMicro()-head)/owedFastI)
		})
	}
}

// TestReviewOwedLatency: the random-order rounds through a proxy that
// delays every byte, so that cancels and Close land while batches and
// refunds are in flight.
func TestReviewOwedLatency(t *testing.T) {
	t.Parallel()
	for end := range 4 {
		t.Run(fmt.Sprintf("end=%d", end), func(t *testing.T) {
			e := newReviewEnv(t, 2*time.Millisecond)
			for i := range 2 { // the review ran 3
				if !t.Run(fmt.Sprint(i), func(t *testing.T) { owedRound(t, e, fmt.Sprintf("y%d", i), 8, 2, 6, end) }) {
					return
				}
			}
		})
	}
}
