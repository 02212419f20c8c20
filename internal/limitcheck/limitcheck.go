// Package limitcheck holds the tests' oracles, written from the definition
// of the limit and sharing none of the engine's arithmetic: Windows checks
// that a record of start times kept to a limit (in any window W, no more
// than Burst + 1 + floor(W/interval) starts), and Replay checks booking
// decisions, as the engine reported them, against a textbook GCRA (Judge).
package limitcheck

import (
	"fmt"
	"slices"
	"time"

	"github.com/slotbook/slotbook/throttle"
)

// Windows returns an error naming the first window in which times hold
// more starts than limit allows. slack is added to every window: the
// lateness of starts recorded after their slots (0 for the slots
// themselves, which must keep to the limit exactly).
func Windows(times []time.Time, limit throttle.Limit, slack time.Duration) error {
	ts := slices.Clone(times)
	slices.SortFunc(ts, func(a, b time.Time) int { return a.Compare(b) })
	interval := limit.Interval()
	for i := range ts {
		for k := i; k < len(ts); k++ {
			w := ts[k].Sub(ts[i]) + slack
			if n, allowed := k-i+1, limit.Burst+1+int(w/interval); n > allowed {
				return fmt.Errorf("%d starts within %v (from start %d), at most %d allowed under %v", n, w, i, allowed, limit)
			}
		}
	}
	return nil
}
