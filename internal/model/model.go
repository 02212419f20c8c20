// Package model is a reference implementation of the engine's arithmetic
// in plain Go, for tests only: the differential tests and the fuzz target
// run the same operations against the Lua scripts on a real Redis and
// against this model, and require the same answers and the same stored
// values. It derives intervals from the limits on its own, so a rounding
// mistake in the engine's Go side shows too.
package model

import (
	"time"

	"github.com/slotbook/slotbook/throttle"
)

// Limit is a limit in the model's terms: emission interval and tolerance,
// in microseconds.
type Limit struct{ I, Tau int64 }

// FromLimit computes I = ceil(Period / Rate) in whole microseconds, rounded
// up (never down: rounding down would let a limit be exceeded), and
// Tau = Burst * I.
func FromLimit(l throttle.Limit) Limit {
	num := l.Period.Nanoseconds()
	den := int64(l.Rate) * int64(time.Microsecond)
	i := num / den
	if num%den != 0 {
		i++
	}
	return Limit{I: i, Tau: i * int64(l.Burst)}
}

// Request is n units with a max wait in microseconds.
type Request struct{ N, MaxWait int64 }

// Booking is the model's answer to one request.
type Booking struct {
	OK     bool
	Wait   int64
	Starts []int64 // each key's TAT before the request
	Ends   []int64 // and after it
	ID     int     // names the booking, for the tombstone a refund leaves
}

// Model holds each key's stored TAT. The zero Model is not usable; use
// New.
type Model struct {
	tat    map[string]int64
	given  map[int]bool // bookings refunded once (their tombstones)
	nextID int
}

// New returns an empty model.
func New() *Model { return &Model{tat: map[string]int64{}, given: map[int]bool{}} }

// Get returns key's stored TAT, as GET would (before expiry).
func (m *Model) Get(key string) (int64, bool) {
	v, ok := m.tat[key]
	return v, ok
}

// Book judges reqs in order at now against every limit of keys.
func (m *Model) Book(now int64, keys []string, limits []Limit, reqs []Request) []Booking {
	tat := make([]int64, len(keys))
	for i, k := range keys {
		tat[i] = max(m.tat[k], now) // an absent key counts as now
	}
	changed := false
	out := make([]Booking, len(reqs))
	for r, req := range reqs {
		slot := now
		for i, l := range limits {
			slot = max(slot, tat[i]+(req.N-1)*l.I-l.Tau)
		}
		b := Booking{Wait: slot - now, Starts: append([]int64(nil), tat...)}
		b.OK = b.Wait <= req.MaxWait
		if b.OK {
			m.nextID++
			b.ID = m.nextID
			for i, l := range limits {
				tat[i] = max(tat[i], slot) + req.N*l.I
			}
			changed = true
		}
		b.Ends = append([]int64(nil), tat...)
		out[r] = b
	}
	if changed {
		for i, k := range keys {
			m.tat[k] = tat[i]
		}
	}
	return out
}

// Refund gives back booking b (made at bookedAt) at now, and returns the
// microseconds given back per key: once per booking, and for each key only
// while its TAT still equals the booking's end, back to its TAT before.
func (m *Model) Refund(now, bookedAt int64, keys []string, b Booking) []int64 {
	given := make([]int64, len(keys))
	if !b.OK || bookedAt+b.Wait <= now || m.given[b.ID] {
		return given
	}
	m.given[b.ID] = true
	for i, k := range keys {
		if tat, ok := m.tat[k]; !ok || tat != b.Ends[i] {
			continue
		}
		given[i] = b.Ends[i] - max(b.Starts[i], now)
		if b.Starts[i] > now {
			m.tat[k] = b.Starts[i]
		} else {
			delete(m.tat, k)
		}
	}
	return given
}

// Block holds key back so that no slot is granted before now+d: its TAT
// becomes at least now+d+tau, and moves by at least one microsecond.
func (m *Model) Block(now int64, key string, l Limit, d int64) {
	target := now + d + l.Tau
	if tat, ok := m.tat[key]; ok && tat >= target {
		target = tat + 1
	}
	m.tat[key] = target
}
