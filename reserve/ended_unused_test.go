package reserve_test

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/slotbook/slotbook/internal/redistest"
	"github.com/slotbook/slotbook/reserve"
	"github.com/slotbook/slotbook/throttle"
)

// TestEndedCallerGivesImmediateSlotBack (found by helper-52): eight
// callers on eight empty keys (so four fly and four are merged), replies
// held 200 ms, each caller's context cancelled 100 ms in, after its call
// was sent. Each Reserve returns context.Canceled and the caller holds no
// Reservation, so its slot, an immediate one that has come by the time
// the reply is in, must come back: the probe of each key waits nothing.
// The same with merging off.
func TestEndedCallerGivesImmediateSlotBack(t *testing.T) {
	t.Parallel()
	for _, merging := range []bool{true, false} {
		t.Run(fmt.Sprintf("merging=%v", merging), func(t *testing.T) {
			t.Parallel()
			eng, p, _ := rmaEngine(t, redistest.Shared(t), throttle.WithMerging(merging))
			lim := throttle.Every(2*time.Second, 1, 0)
			l, err := reserve.New(eng, "rmastays", lim)
			require.NoError(t, err)
			p.SetReplyDelay(200 * time.Millisecond)
			const n = 8
			errs := make([]error, n)
			var wg sync.WaitGroup
			for i := range n {
				wg.Go(func() {
					ctx, cancel := context.WithCancel(context.Background())
					defer cancel()
					time.AfterFunc(100*time.Millisecond, cancel)
					_, errs[i] = l.Reserve(ctx, fmt.Sprintf("s%d", i))
				})
			}
			wg.Wait()
			p.SetReplyDelay(0)
			for i, err := range errs {
				require.ErrorIs(t, err, context.Canceled, "caller %d", i)
			}
			for i := range n {
				pb := rmaProbe(t, l, fmt.Sprintf("s%d", i))
				require.Zero(t, pb.Wait, "s%d: its caller got context.Canceled, yet its slot stayed booked", i)
			}
		})
	}
}
