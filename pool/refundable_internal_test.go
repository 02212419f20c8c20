package pool

import (
	"context"
	"fmt"
	"testing"

	"github.com/stretchr/testify/require"
)

// endsAfter is a context shared by several jobs that ends while the pool
// looks at them: its Err reports nil for the first calls, then Canceled,
// as a context cancelled by another goroutine mid-look does.
type endsAfter struct {
	context.Context
	calls *int
	after int
}

func (c endsAfter) Err() error {
	*c.calls++
	if *c.calls > c.after {
		return context.Canceled
	}
	return nil
}

// TestRefundableTakesTheLatestBookings: when the context that a pool's
// booked jobs share ends while the dispatcher looks at them, the jobs it
// takes to give back are the latest bookings, latest first, whatever the
// order of the slot heap: a booking gives its room back only while no
// later booking stands on it, so an earlier one taken while a later one
// was missed would give nothing back, and nor would every booking before
// it (its refund leaves a tombstone). Failed before: the contexts were
// looked at in heap order (seen as a pool test that gave back 7 of 12
// bookings once in some 600 runs beside a full suite, the heap holding
// seq 6 before seq 5).
func TestRefundableTakesTheLatestBookings(t *testing.T) {
	// A heap of slots is not in booking order: seq by position.
	for _, order := range [][]uint64{{0, 3, 1, 4, 2, 5}, {0, 1, 2, 3, 4, 5}, {5, 4, 3, 2, 1, 0}, {2, 0, 5, 1, 3, 4}} {
		for after := 0; after <= 2*len(order); after++ {
			t.Run(fmt.Sprintf("%v/after=%d", order, after), func(t *testing.T) {
				calls := 0
				ctx := endsAfter{context.Background(), &calls, after}
				var booked []*Job
				for _, seq := range order {
					booked = append(booked, &Job{ctx: ctx, seq: seq})
				}
				var got []uint64
				for _, j := range refundable(booked, false) {
					got = append(got, j.seq)
				}
				// The latest bookings, latest first: 5, 4, ... down to some seq.
				for i, seq := range got {
					require.Equal(t, uint64(len(order)-1-i), seq, "taken %v: not the latest bookings, latest first", got)
				}
			})
		}
	}
}
