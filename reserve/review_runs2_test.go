package reserve_test

// Review test (helper) of b081c75 through package reserve, whose
// coalesced callers and ReserveBatch reach book.lua as runs of like
// requests: the slots that stand, sorted, replayed through a textbook
// GCRA written here (virtual scheduling, cell by cell), on the Redis
// clock.

import (
	"context"
	"fmt"
	"math/rand/v2"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/slotbook/slotbook/internal/redistest"
	"github.com/slotbook/slotbook/reserve"
	"github.com/slotbook/slotbook/throttle"
)

func rv2IntervalMicros(l throttle.Limit) int64 {
	ns := l.Period.Nanoseconds()
	per := ns / int64(l.Rate)
	if ns%int64(l.Rate) != 0 {
		per++
	}
	return (per + 999) / 1000
}

type rv2Slot struct {
	at int64
	n  int
}

// rv2Replay checks slots (sorted by time) against limit: every cell
// conforms (arrival >= TAT - tau) in slot order, and no window holds more
// than burst+1 + window/I units. It returns the first failure.
func rv2Replay(slots []rv2Slot, l throttle.Limit) error {
	I := rv2IntervalMicros(l)
	tau := I * int64(l.Burst)
	var tat int64
	for i, s := range slots {
		for c := 0; c < s.n; c++ {
			if s.at < tat-tau {
				return fmt.Errorf("booking %d (n %d at %d): cell %d arrives before TAT - tau = %d", i, s.n, s.at, c, tat-tau)
			}
			tat = max(tat, s.at) + I
		}
	}
	for i := range slots {
		units := 0
		for j := i; j < len(slots); j++ {
			units += slots[j].n
			if w := slots[j].at - slots[i].at; int64(units) > int64(l.Burst+1)+w/I {
				return fmt.Errorf("%d units in the %d µs from booking %d to %d", units, w, i, j)
			}
		}
	}
	return nil
}

// TestReviewRuns2ReserveCoalescedRuns: goroutines on one key call ReserveN
// (coalesced into runs by the Limiter) and ReserveBatch (runs of like
// requests), under one limit and under two; every booking that stands
// waits at most the max wait, and the bookings together pass the
// textbook GCRA of each limit.
func TestReviewRuns2ReserveCoalescedRuns(t *testing.T) {
	t.Parallel()
	rdb := redistest.Shared(t).Client(t)
	eng, err := throttle.New(rdb, throttle.WithPrefix(redistest.Prefix(t)), throttle.WithTimeout(10*time.Second))
	require.NoError(t, err)
	cases := []struct {
		name   string
		limits []throttle.Limit
	}{
		{"one", []throttle.Limit{throttle.Every(time.Second, 1000, 6)}},
		{"zero", []throttle.Limit{throttle.Every(time.Second, 3000, 0)}},
		{"two", []throttle.Limit{throttle.PerSecond(2000, 4), throttle.Every(100*time.Millisecond, 60, 10)}},
	}
	const maxWait = 20 * time.Millisecond
	for _, tc := range cases {
		lim, err := reserve.New(eng, "rv2"+tc.name, tc.limits[0], reserve.WithMaxWait(maxWait), reserve.WithLimit(tc.limits[1:]...))
		require.NoError(t, err)
		maxN := tc.limits[0].Burst + 1
		for _, l := range tc.limits {
			maxN = min(maxN, l.Burst+1)
		}
		var mu sync.Mutex
		var slots []rv2Slot
		var refused int
		keep := func(rs ...*reserve.Reservation) error {
			mu.Lock()
			defer mu.Unlock()
			for _, r := range rs {
				if !r.OK() {
					refused++
					continue
				}
				b := r.Booking()
				if !b.OK || b.Wait > maxWait || b.Wait < 0 {
					return fmt.Errorf("reservation OK with booking %+v (max wait %v)", b, maxWait)
				}
				slots = append(slots, rv2Slot{b.At.UnixMicro(), b.N})
			}
			return nil
		}
		var wg sync.WaitGroup
		errs := make(chan error, 8)
		for w := 0; w < 8; w++ {
			wg.Add(1)
			go func(w int) {
				defer wg.Done()
				rng := rand.New(rand.NewPCG(uint64(w), 4))
				for op := 0; op < 80; op++ {
					// Spread over some 120 ms, so that slots come and go.
					time.Sleep(time.Duration(rng.IntN(3000)) * time.Microsecond)
					var err error
					if rng.IntN(4) == 0 {
						var reqs []reserve.BatchRequest
						for len(reqs) < 1+rng.IntN(120) {
							n := 1 + rng.IntN(maxN)
							for c := 1 + rng.IntN(40); c > 0; c-- {
								reqs = append(reqs, reserve.BatchRequest{N: n})
							}
						}
						var rs []*reserve.Reservation
						rs, err = lim.ReserveBatch(context.Background(), "k", reqs[:min(len(reqs), throttle.MaxBatch)])
						if err == nil {
							err = keep(rs...)
						}
					} else {
						var r *reserve.Reservation
						r, err = lim.ReserveN(context.Background(), "k", []int{1, 1, 1, maxN}[rng.IntN(4)])
						if err == nil {
							err = keep(r)
						}
					}
					if err != nil {
						errs <- err
						return
					}
				}
			}(w)
		}
		wg.Wait()
		close(errs)
		for err := range errs {
			require.NoError(t, err, tc.name)
		}
		slices.SortFunc(slots, func(a, b rv2Slot) int { return int(a.at - b.at) })
		for _, l := range tc.limits {
			require.NoError(t, rv2Replay(slots, l), "%s: %v", tc.name, l)
		}
		require.NotEmpty(t, slots)
		t.Logf("%s: %d bookings stand, %d refused", tc.name, len(slots), refused)
	}
}
