package reserve_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/slotbook/slotbook/internal/callcount"
	"github.com/slotbook/slotbook/reserve"
	"github.com/slotbook/slotbook/throttle"
)

// TestDeadlineInFlightGivesBack: a caller whose context deadline passes
// (or who cancels) while its booking call is out (Redis has booked, the reply held back
// 150 ms against a 60 ms deadline) gets the deadline's error and books
// nothing: the call is not cut short by the deadline (the socket's read
// would then lose the reply and the booking with it, its room wasted
// until its slot passed), and the booking goes back once the reply is
// in. Every path that books: ReserveN with coalescing on and off,
// AcquireN, ReserveBatch, the engine's own Book, BookBatch and BookAll
// called directly, and check mode (Limiter.AllowN, the engine's AllowN),
// which counts what it allows. The oracle is the textbook GCRA of an
// untouched key: Burst+1 units are allowed at once (for BookAll, on both
// of its keys).
func TestDeadlineInFlightGivesBack(t *testing.T) {
	t.Parallel()
	eng, p, _ := proxiedEngine(t, 32)
	calls := callcount.Attach(eng.Client().(*redis.Client))
	lim := throttle.PerSecond(2, 2) // three at once, then one every 500 ms
	mk := func(coalesce bool) *reserve.Limiter {
		l, err := reserve.New(eng, "dl", lim, reserve.WithCoalescing(coalesce), reserve.WithoutMaxWait())
		require.NoError(t, err)
		return l
	}
	co, unco := mk(true), mk(false)
	for i, tc := range []struct {
		name  string
		calls int64 // the booking, and its give-backs
		// cancelCalls, if not 0, is calls for a cancel (0: the same).
		cancelCalls int64
		run         func(ctx context.Context, subject string) error
	}{
		{"ReserveN coalesced", 2, 0, func(ctx context.Context, s string) error { _, err := co.ReserveN(ctx, s, 2); return err }},
		{"ReserveN uncoalesced", 2, 0, func(ctx context.Context, s string) error { _, err := unco.ReserveN(ctx, s, 2); return err }},
		{"AcquireN uncoalesced", 2, 0, func(ctx context.Context, s string) error { return unco.AcquireN(ctx, s, 2) }},
		{"ReserveBatch", 2, 0, func(ctx context.Context, s string) error {
			_, err := unco.ReserveBatch(ctx, s, []reserve.BatchRequest{{N: 1}, {N: 1}})
			return err
		}},
		// The engine's bookings, called directly: a call's bookings given
		// back in one refund.
		{"Engine.Book", 2, 0, func(ctx context.Context, s string) error {
			_, err := eng.Book(ctx, "dl:{"+s+"}", lim, throttle.Request{N: 2, MaxWait: throttle.Forever})
			return err
		}},
		{"Engine.BookBatch", 2, 0, func(ctx context.Context, s string) error {
			_, err := eng.BookBatch(ctx, "dl:{"+s+"}", lim, []throttle.Request{{N: 1, MaxWait: throttle.Forever}, {N: 2, MaxWait: throttle.Forever}})
			return err
		}},
		{"Engine.BookAll", 2, 0, func(ctx context.Context, s string) error {
			_, err := eng.BookAll(ctx, []string{"dl:{" + s + "}", "dl2:{" + s + "}"}, []throttle.Limit{lim, lim},
				[]throttle.Request{{N: 3, MaxWait: throttle.Forever}})
			return err
		}},
		// Check mode counts the units it allows: the same holds.
		{"AllowN", 2, 0, func(ctx context.Context, s string) error { _, err := co.AllowN(ctx, s, 2); return err }},
		{"Engine.AllowN", 2, 0, func(ctx context.Context, s string) error {
			_, err := eng.AllowN(ctx, "dl:{"+s+"}", lim, 2)
			return err
		}},
	} {
		for _, cancelled := range []bool{false, true} {
			name := tc.name + "/deadline"
			if cancelled {
				name = tc.name + "/cancel"
			}
			t.Run(name, func(t *testing.T) {
				bg := context.Background()
				subject := fmt.Sprintf("s%d-%v", i, cancelled)
				// A warm connection, so that the call is sent at once rather
				// than cut short while dialling.
				require.NoError(t, eng.Client().(*redis.Client).Ping(bg).Err())
				p.SetReplyDelay(150 * time.Millisecond)
				ctx, cancel := context.WithTimeout(bg, 60*time.Millisecond)
				want := context.DeadlineExceeded
				if cancelled {
					ctx, cancel = context.WithCancel(bg)
					time.AfterFunc(60*time.Millisecond, cancel)
					want = context.Canceled
				}
				before := calls.Load()
				err := tc.run(ctx, subject)
				cancel()
				p.SetReplyDelay(0)
				sent := calls.Load() - before
				for _, k := range []string{"dl:{" + subject + "}", "dl2:{" + subject + "}"} {
					res, aerr := eng.AllowN(bg, k, lim, lim.Burst+1)
					require.NoError(t, aerr)
					require.True(t, res.Allowed, "key %s must be untouched: Burst+1 units at once (caller's error: %v)", k, err)
				}
				require.ErrorIs(t, err, want)
				require.NotErrorIs(t, err, throttle.ErrReplyLost, "the reply must be read, not lost")
				wantCalls := tc.calls
				if cancelled && tc.cancelCalls != 0 {
					wantCalls = tc.cancelCalls
				}
				require.Equal(t, wantCalls, sent, "the booking and its give-backs")
			})
		}
	}
}
