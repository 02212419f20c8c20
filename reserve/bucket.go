package reserve

import (
	"math"
	"slices"

	"github.com/slotbook/slotbook/throttle"
)

// A bucket is one limit's local share for one key, kept as the limit is
// kept in Redis: a GCRA, whose one number is the theoretical arrival time
// (tat) of the next request, here in nanoseconds on the fallback's
// monotonic clock (see fallback.instant). A request of n units at now
// books from start = max(tat, now) to end = start + n*every, and may act
// once end - size*every has come: a bucket whose tat has passed (full)
// lets size units through at once, then one every interval. Unlike
// x/time/rate's token count, where a reservation's Cancel works out from
// the latest reservation's time what later ones took, which a refusal or
// a cancelled reservation moves, the booking that stands on a bucket is
// always its latest one, ending at tat: a give-back is exact.
type bucket struct {
	every int64 // the share's emission interval, nanoseconds (at least 1)
	size  int64 // the share's burst, units (at least 1)
	tat   int64
	// freed are bookings given back while a later one stood on them, to
	// come back with it: bookings given back in any order all come back,
	// and none while a booking above it stands. At most throttle.MaxBatch
	// are kept (a coalesced batch's callers give back on their own
	// goroutines, in any order); past that one is forgotten, its room
	// lost, never lent.
	freed []span
}

// book works out a request of n units at now: its booking, and its wait.
// It changes nothing: the caller sets tat to the booking's end if the
// request passes.
func (b *bucket) book(now int64, n int) (p span, wait int64) {
	p.start = max(b.tat, now)
	p.end = p.start + int64(n)*b.every
	return p, max(0, p.end-b.size*b.every-now)
}

// giveBack undoes booking p, at now, if it is the latest on b (tat at
// its end): tat goes back to where the booking started, which is where it
// was, or a time at which b was already full, as it is by now; and so on
// down through the bookings under it given back before (freed). Under a
// later booking, p waits in freed for that one to go.
func (b *bucket) giveBack(p span, now int64) {
	// Those passed would give back nothing (b is full from their end on).
	b.freed = slices.DeleteFunc(b.freed, func(q span) bool { return q.end <= now })
	if b.tat != p.end {
		if p.end > now && len(b.freed) < throttle.MaxBatch {
			b.freed = append(b.freed, p)
		}
		return
	}
	b.tat = p.start
	for {
		i := slices.IndexFunc(b.freed, func(q span) bool { return q.end == b.tat })
		if i < 0 {
			return
		}
		b.tat = b.freed[i].start
		b.freed = slices.Delete(b.freed, i, i+1)
	}
}

// room is how many units a request at now could take at once: less than
// 0 while a booking made ahead waits.
func (b *bucket) room(now int64) int64 {
	return (now + b.size*b.every - max(b.tat, now)) / b.every
}

// rescale moves b to a new share, keeping the units booked ahead of now,
// rounded up: what is owed, where x/time/rate's SetLimit kept its token
// count. A booking made before gives nothing back (localBooking.gen).
func (b *bucket) rescale(now, every, size int64) {
	if b.tat > now {
		b.tat = now + int64(math.Ceil(float64(b.tat-now)*float64(every)/float64(b.every)))
	}
	b.every, b.size, b.freed = every, size, nil
}
