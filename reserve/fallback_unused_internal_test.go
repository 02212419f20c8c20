package reserve

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/slotbook/slotbook/throttle"
)

// TestFallbackUnusedGivesBackAfterItsTime: a fallback slot that no one can
// have used (its caller had gone before it had the answer) gives its room
// back even once its time to act has passed, as a booking in Redis does
// (throttle's RefundUnused), where the x/time/rate limiters used before
// gave nothing back once that time had passed. The oracle is a token bucket that never saw the
// booking: full, it passes a request of its whole burst at once. A slot
// its caller may have used gives nothing back once its time has come, and
// a slot another booking came after never gives back more than a bucket
// that only saw the other one holds.
func TestFallbackUnusedGivesBackAfterItsTime(t *testing.T) {
	t.Parallel()
	// One a second, burst 3: the local limiter holds 4 tokens, and a
	// second refills a single one, so no test step below refills enough
	// to hide a token kept.
	lim := throttle.PerSecond(1, 3)
	l, _ := fakeLimiter(t, lim, WithFallback(FailOpen()))
	ctx := context.Background()
	cause := throttle.ErrUnavailable
	whole := lim.Burst + 1 // the local limiter's burst
	// room reads how many units of key would pass at once, without
	// touching its limiter.
	room := func(key string) int64 {
		f := l.fallback
		f.mu.Lock()
		defer f.mu.Unlock()
		return f.limiters(key, l.limits).b[0].room(f.instant(time.Now()))
	}
	book := func(key string, n int) *Reservation {
		r := l.fallbackReserve(ctx, key, n, time.Now(), time.Hour, cause)
		require.True(t, r.OK(), "%v", r.Err())
		require.True(t, r.Fallback())
		return r
	}

	require.Equal(t, int64(whole), room("control"), "a fresh key holds its whole burst")

	// Unused, its time (at once) passed: all of its room comes back.
	r := book("unused", 2)
	time.Sleep(time.Millisecond)
	require.NoError(t, r.cancel(ctx, true))
	require.Equal(t, int64(whole), room("unused"), "the unused slot's room came back")

	// Its caller had it, and its time has come: spent, nothing back.
	r = book("used", 2)
	time.Sleep(time.Millisecond)
	require.NoError(t, r.Cancel(ctx))
	require.Less(t, room("used"), int64(whole-1), "a slot whose time came stays spent")

	// Another booking after it: never more back than a bucket holds that
	// only saw the other one (2 tokens of 4, and the refill of a moment).
	r = book("under", 2)
	time.Sleep(time.Millisecond)
	book("under", 2)
	require.NoError(t, r.cancel(ctx, true))
	require.Less(t, room("under"), int64(whole-1), "the give-back lent room the other booking took")
}
