package reserve_test

// Review of d0103bc (a booking is given back one way only) from package
// reserve's side: none of its give-back paths may meet the engine's
// ErrInvalidRequest (a give-back silently dropped). What a Reservation's
// holder can see: Cancel's error, and its Booking(), a copy that shares
// the booking's marker, so that probing it with RefundAll (safe to
// repeat) tells whether reserve gave it back the other way.

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/slotbook/slotbook/internal/redistest"
	"github.com/slotbook/slotbook/reserve"
	"github.com/slotbook/slotbook/throttle"
)

// TestReviewOWReserveMixedGiveBacks: 48 concurrent callers of one key,
// coalesced, every reply held back 40 ms. A third give up while their
// call is out (reserve gives their bookings back as unused); a third
// have their Wait cut short, then Cancel; a third Cancel twice. No
// Cancel fails, and every booking a holder had was given back as used:
// RefundAll on its Booking() is accepted, RefundUnused refused.
func TestReviewOWReserveMixedGiveBacks(t *testing.T) {
	t.Parallel()
	eng, p, _ := proxiedEngine(t, 32)
	p.SetReplyDelay(40 * time.Millisecond)
	for _, co := range []bool{true, false} {
		t.Run(fmt.Sprintf("coalescing=%v", co), func(t *testing.T) {
			l, err := reserve.New(eng, fmt.Sprintf("ow2-%v", co), throttle.PerSecond(50, 0), reserve.WithoutMaxWait(), reserve.WithCoalescing(co))
			require.NoError(t, err)
			keys := engineKeys(l, "k")
			var (
				wg     sync.WaitGroup
				mu     sync.Mutex
				ended  int
				probed int
			)
			errs := make(chan error, 200)
			fail := func(format string, a ...any) { errs <- fmt.Errorf(format, a...) }
			for i := range 48 {
				wg.Go(func() {
					bg := context.Background()
					if i%3 == 0 {
						ctx, cancel := context.WithTimeout(bg, 15*time.Millisecond)
						defer cancel()
						r, err := l.Reserve(ctx, "k")
						if err != nil {
							mu.Lock()
							ended++
							mu.Unlock()
							return
						}
						_ = r.Cancel(bg) // answered before its end: its own to give back
						return
					}
					r, err := l.Reserve(bg, "k")
					if err != nil || !r.OK() {
						fail("caller %d: %v %v", i, err, r)
						return
					}
					if i%3 == 1 {
						ctx, cancel := context.WithTimeout(bg, 5*time.Millisecond)
						_ = r.Wait(ctx)
						cancel()
					}
					for range 2 {
						if err := r.Cancel(bg); err != nil {
							fail("caller %d: Cancel: %v", i, err)
						}
					}
					if _, err := eng.RefundAll(bg, keys, l.Limits(), r.Booking()); err != nil {
						fail("caller %d: RefundAll on a booking reserve gave back: %v", i, err)
					}
					if _, err := eng.RefundUnused(bg, keys, l.Limits(), r.Booking()); !errors.Is(err, throttle.ErrInvalidRequest) {
						fail("caller %d: RefundUnused after Cancel: %v", i, err)
					}
					mu.Lock()
					probed++
					mu.Unlock()
				})
			}
			wg.Wait()
			close(errs)
			for err := range errs {
				require.NoError(t, err)
			}
			t.Logf("%d callers ended in flight, %d holders probed", ended, probed)
		})
	}
}

// TestReviewOWUncoalescedEndedInFlightMerged: TestCancelledInFlightGivesBack
// without coalescing, on an engine whose single bookings merge
// (WithMergeAt(1), WithMergeWait(Forever)): a lone booking of another key
// is in flight, so the caller's booking merges, and a merged call is not
// cut short by the caller's context. The caller's context ends once Redis
// holds its booking (an immediate slot; the reply held back 150 ms).
// ReserveN's doc: err is non-nil for a done context; the coalescing path
// answers (nil, ctx's error) and gives the booking back as unused. Then a
// caller that did everything it could (Cancel, if it was handed a
// Reservation) must leave the key as a textbook GCRA over nothing
// standing has it: the next booking immediate.
func TestReviewOWUncoalescedEndedInFlightMerged(t *testing.T) {
	t.Parallel()
	// Coalescing on is the control, in the same run.
	for _, co := range []bool{true, false} {
		t.Run(fmt.Sprintf("coalescing=%v", co), func(t *testing.T) {
			t.Parallel()
			owEndedInFlightMerged(t, co)
		})
	}
}

func owEndedInFlightMerged(t *testing.T, co bool) {
	eng, p, prefix := proxiedEngine(t, 32, throttle.WithMergeAt(1), throttle.WithMergeWait(throttle.Forever))
	direct := redistest.Shared(t).Client(t)
	p.SetReplyDelay(150 * time.Millisecond)
	bg := context.Background()
	l, err := reserve.New(eng, "unco", throttle.PerSecond(2, 0), reserve.WithCoalescing(co)) // 500 ms apart
	require.NoError(t, err)
	for round := 0; ; round++ {
		require.Less(t, round, 5, "the caller's booking never merged")
		subject := fmt.Sprintf("s%d", round)
		// A lone booking in flight: it holds the one flight token.
		lone := make(chan error, 1)
		go func() {
			_, err := eng.Book(bg, fmt.Sprintf("lone%d", round), throttle.PerSecond(2, 0), throttle.Request{N: 1, MaxWait: throttle.Forever})
			lone <- err
		}()
		time.Sleep(30 * time.Millisecond)
		cctx, cancel := context.WithCancel(bg)
		type answer struct {
			r   *reserve.Reservation
			err error
		}
		done := make(chan answer, 1)
		go func() { r, err := l.Reserve(cctx, subject); done <- answer{r, err} }()
		key := prefix + "unco:{" + subject + "}"
		require.Eventually(t, func() bool { return direct.Exists(bg, key).Val() == 1 }, 5*time.Second, time.Millisecond)
		cancel()
		a := <-done
		require.NoError(t, <-lone)
		if a.err != nil && !errors.Is(a.err, context.Canceled) {
			t.Logf("round %d: %v (not merged?): again", round, a.err)
			continue
		}
		if a.err == nil && a.r.OK() {
			_ = a.r.Cancel(bg) // all its holder can do
		}
		next, err := l.Reserve(bg, subject)
		require.NoError(t, err)
		require.True(t, next.OK())
		assert.ErrorIs(t, a.err, context.Canceled, "ReserveN on a context that ended in flight: got a Reservation (OK %v, wait %v)",
			a.r != nil && a.r.OK(), func() time.Duration {
				if a.r != nil {
					return a.r.Booking().Wait
				}
				return 0
			}())
		require.Zero(t, next.Booking().Wait, "the ended caller's room (no one acted in it) is lost: the next booking waits")
		return
	}
}
