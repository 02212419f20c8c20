package limitcheck

import (
	"cmp"
	"fmt"
	"slices"
	"time"

	"github.com/slotbook/slotbook/throttle"
)

// Interval is l's emission interval in whole microseconds as the
// definition rounds it: the period over the rate, rounded up to the
// nanosecond, then up to the microsecond.
func Interval(l throttle.Limit) int64 {
	ns := l.Period.Nanoseconds()
	per := (ns + int64(l.Rate) - 1) / int64(l.Rate)
	return (per + 999) / 1000
}

// Judge is textbook GCRA (virtual scheduling) on one key, in microseconds
// on the Redis clock: n units asked for at now, on a key whose theoretical
// arrival time is tat (0, or any time passed, for an idle key), taken if
// every unit conforms within maxWait (capped at throttle.MaxHorizon). It
// returns whether they are taken, the wait until the last of them
// conforms, and the TAT they leave when taken (tat when not).
func Judge(l throttle.Limit, tat, now int64, n int, maxWait time.Duration) (ok bool, wait, after int64) {
	interval := Interval(l)
	tau := interval * int64(l.Burst)
	t := max(tat, now)
	slot := now
	for j := range n {
		slot = max(slot, t+int64(j)*interval-tau)
	}
	wait = slot - now
	if time.Duration(wait)*time.Microsecond > min(maxWait, throttle.MaxHorizon) {
		return false, wait, tat
	}
	after = t
	for range n {
		after = max(after, slot) + interval
	}
	return true, wait, after
}

// Outcome is one booking's decision as the engine reported it.
type Outcome struct {
	Booking throttle.Booking
	N       int           // units asked for
	MaxWait time.Duration // as asked for
}

// Decided is when the booking was decided, in microseconds on the Redis
// clock: its slot less its wait.
func (o Outcome) Decided() int64 {
	return o.Booking.At.UnixMicro() - o.Booking.Wait.Microseconds()
}

// Replay replays the outcomes of one key, whose TAT was tat0 before them
// (0: idle), through Judge, in the order they were decided, and returns
// the TAT they leave. Outcomes decided at the same microsecond (one
// merged call, or one batch) may have been judged in any order among
// themselves: Replay looks for an order in which the textbook gives each
// the answer it got (taken or refused, and its wait), and fails when
// none does; it gives up on more than 60 such outcomes.
func Replay(l throttle.Limit, tat0 int64, outcomes []Outcome) (int64, error) {
	outs := slices.Clone(outcomes)
	slices.SortStableFunc(outs, func(a, b Outcome) int { return cmp.Compare(a.Decided(), b.Decided()) })
	tat := tat0
	for i := 0; i < len(outs); {
		j := i
		for j < len(outs) && outs[j].Decided() == outs[i].Decided() {
			j++
		}
		g := outs[i:j]
		if len(g) > 60 {
			return 0, fmt.Errorf("%d bookings decided at %d: too many to order", len(g), g[0].Decided())
		}
		failed := map[uint64]bool{}
		var solve func(mask uint64, tat int64) (int64, bool)
		solve = func(mask uint64, tat int64) (int64, bool) {
			if mask == 1<<len(g)-1 {
				return tat, true
			}
			if failed[mask] {
				return 0, false
			}
			for k, o := range g {
				if mask&(1<<k) != 0 {
					continue
				}
				ok, wait, after := Judge(l, tat, o.Decided(), o.N, o.MaxWait)
				if ok != o.Booking.OK || wait != o.Booking.Wait.Microseconds() {
					continue
				}
				if end, done := solve(mask|1<<k, after); done {
					return end, true
				}
			}
			failed[mask] = true
			return 0, false
		}
		end, ok := solve(0, tat)
		if !ok {
			var desc []string
			for _, o := range g {
				ok, wait, _ := Judge(l, tat, o.Decided(), o.N, o.MaxWait)
				desc = append(desc, fmt.Sprintf("{n=%d max wait %v: got ok=%v wait=%dµs; textbook first ok=%v wait=%dµs}",
					o.N, o.MaxWait, o.Booking.OK, o.Booking.Wait.Microseconds(), ok, wait))
			}
			return 0, fmt.Errorf("at %d (TAT %d, %dµs ahead): no order explains %v: booked twice, or a booking given back that stands",
				g[0].Decided(), tat, tat-g[0].Decided(), desc)
		}
		tat = end
		i = j
	}
	return tat, nil
}
