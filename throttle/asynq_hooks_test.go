package throttle_test

import (
	"context"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/slotbook/slotbook/internal/testhook"
	"github.com/slotbook/slotbook/throttle"
)

// TestBookRetry: on an explicit clock, a booking beyond KeepFrom is
// recorded in the index and listed as due; the same member then gets it
// back without a booking (the key is left as it was), once; bad input is
// refused before any Redis call.
func TestBookRetry(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	ctx := testhook.WithNow(context.Background(), 1_000_000_000)
	lim := throttle.PerSecond(10, 0)
	keys := []string{"r:{k}"}
	idx := func(member string) throttle.RetryIndex {
		return throttle.RetryIndex{Key: "r:{k}:asynq", Member: member, KeepFrom: 150 * time.Millisecond, Window: time.Second, MaxDue: 10}
	}
	book := func(member string) throttle.RetryBooking {
		t.Helper()
		rb, err := e.eng.BookRetry(ctx, keys, []throttle.Limit{lim}, throttle.Request{N: 1, MaxWait: time.Minute}, idx(member))
		require.NoError(t, err)
		return rb
	}
	for i, member := range []string{"a", "b", "c"} {
		rb := book(member)
		require.True(t, rb.OK)
		require.False(t, rb.Recalled)
		require.Equal(t, time.Duration(i)*100*time.Millisecond, rb.Wait)
		require.Equal(t, i == 2, rb.Recorded, "recorded only beyond KeepFrom (booking %d)", i)
	}
	rb := book("d")
	require.True(t, rb.Recorded)
	require.Equal(t, map[string]time.Time{"c": time.UnixMicro(1_000_200_000), "d": time.UnixMicro(1_000_300_000)}, rb.Due)

	tat, err := e.rdb.Get(context.Background(), e.prefix+"r:{k}").Result()
	require.NoError(t, err)
	rb = book("c")
	require.True(t, rb.Recalled)
	require.True(t, rb.OK)
	require.Equal(t, 200*time.Millisecond, rb.Wait)
	require.Equal(t, time.UnixMicro(1_000_200_000), rb.At)
	after, err := e.rdb.Get(context.Background(), e.prefix+"r:{k}").Result()
	require.NoError(t, err)
	require.Equal(t, tat, after, "a recalled booking books nothing")
	rb = book("c")
	require.False(t, rb.Recalled, "recalled once")
	require.Equal(t, 400*time.Millisecond, rb.Wait)

	// Forget takes entries out.
	i := idx("e")
	i.Forget = []string{"d", "c"}
	rb, err = e.eng.BookRetry(ctx, keys, []throttle.Limit{lim}, throttle.Request{N: 1, MaxWait: time.Minute}, i)
	require.NoError(t, err)
	require.Equal(t, map[string]time.Time{"e": time.UnixMicro(1_000_500_000)}, rb.Due)

	before := e.calls.Load()
	for name, bad := range map[string]throttle.RetryIndex{
		"no member":      {Key: "r:{k}:asynq"},
		"other hash tag": {Key: "r:{other}:asynq", Member: "m"},
		"negative since": {Key: "r:{k}:asynq", Member: "m", Since: -time.Second},
		"negative max":   {Key: "r:{k}:asynq", Member: "m", MaxDue: -1},
	} {
		_, err := e.eng.BookRetry(ctx, keys, []throttle.Limit{lim}, throttle.Request{N: 1}, bad)
		require.ErrorIs(t, err, throttle.ErrInvalidRequest, name)
	}
	require.Equal(t, before, e.calls.Load(), "no Redis call for bad input")
}

// TestBookRetrySince: entries of tasks that never came back stay in the
// index for a minute after their slots and are listed first: with MaxDue
// of them, a booking due next was left out of the reply, and every task
// coming back made a call of its own (found by review). With Since the
// reply lists only entries whose slots passed at most that long ago.
func TestBookRetrySince(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	lim := throttle.PerSecond(10, 0)
	keys := []string{"s:{k}"}
	book := func(now int64, member string, since time.Duration) throttle.RetryBooking {
		t.Helper()
		ctx := testhook.WithNow(context.Background(), now)
		rb, err := e.eng.BookRetry(ctx, keys, []throttle.Limit{lim}, throttle.Request{N: 1, MaxWait: time.Minute},
			throttle.RetryIndex{Key: "s:{k}:asynq", Member: member, KeepFrom: 50 * time.Millisecond, Window: time.Second, MaxDue: 3, Since: since})
		require.NoError(t, err)
		return rb
	}
	const t0 = 1_000_000_000
	for _, m := range []string{"a", "b", "c", "d"} { // b, c, d recorded, their tasks never come back
		book(t0, m, 0)
	}
	later := int64(t0 + 5_000_000) // their slots passed 4.5 s ago or more
	book(later, "x", 0)            // at once: not recorded
	rb := book(later, "live", 0)   // 100 ms ahead: recorded
	require.True(t, rb.Recorded)
	rb = book(later, "probe", 0)
	require.NotContains(t, rb.Due, "live", "without Since, the stale entries fill the list (the scene)")
	rb = book(later, "probe2", time.Second)
	require.Contains(t, rb.Due, "live", "a booking due next is listed")
	for _, m := range []string{"b", "c", "d"} {
		require.NotContains(t, rb.Due, m, "passed more than Since ago")
	}
}

// TestBookRetrySpent: the entry of a booking whose task never comes back
// (deleted, archived) is dropped a minute after its slot, and the index
// key itself expires: the index never keeps a booking for ever.
func TestBookRetrySpent(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	lim := throttle.PerSecond(10, 0)
	keys := []string{"p:{k}"}
	book := func(now int64, member string) throttle.RetryBooking {
		t.Helper()
		ctx := testhook.WithNow(context.Background(), now)
		rb, err := e.eng.BookRetry(ctx, keys, []throttle.Limit{lim}, throttle.Request{N: 1, MaxWait: time.Minute},
			throttle.RetryIndex{Key: "p:{k}:asynq", Member: member, KeepFrom: 50 * time.Millisecond, Window: time.Second, MaxDue: 10})
		require.NoError(t, err)
		return rb
	}
	const t0 = 1_000_000_000
	book(t0, "a")          // at once
	rb := book(t0, "gone") // 100 ms ahead: recorded; its task never comes back
	require.True(t, rb.Recorded)
	ttl, err := e.rdb.PTTL(context.Background(), e.prefix+"p:{k}:asynq").Result()
	require.NoError(t, err)
	require.Positive(t, ttl, "the index key expires")
	require.LessOrEqual(t, ttl, time.Minute+3*time.Second, "about a minute after its last slot")

	rb = book(t0+100_000+59_000_000, "b") // 59 s after the slot: still held
	require.Contains(t, rb.Due, "gone")
	book(t0+100_000+61_000_000, "c") // 61 s after: dropped
	_, err = e.rdb.ZScore(context.Background(), e.prefix+"p:{k}:asynq", "gone").Result()
	require.ErrorIs(t, err, redis.Nil, "the spent entry is dropped")
}

// TestForgetRetry: ForgetRetry takes one member out of the index at once,
// so that BookRetry books it anew rather than recall it; forgetting a
// member not there is no error; bad input is refused before any call.
func TestForgetRetry(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	ctx := testhook.WithNow(context.Background(), 1_000_000_000)
	lim := throttle.PerSecond(10, 0)
	keys := []string{"f:{k}"}
	idx := throttle.RetryIndex{Key: "f:{k}:asynq", Member: "m"}
	book := func() throttle.RetryBooking {
		t.Helper()
		rb, err := e.eng.BookRetry(ctx, keys, []throttle.Limit{lim}, throttle.Request{N: 1, MaxWait: time.Minute}, idx)
		require.NoError(t, err)
		return rb
	}
	_, err := e.eng.Book(ctx, keys[0], lim, throttle.Request{N: 1, MaxWait: time.Minute}) // the next slot 100ms away
	require.NoError(t, err)
	first := book()
	require.True(t, first.Recorded, "a wait beyond KeepFrom (0): recorded")
	require.NoError(t, e.eng.ForgetRetry(ctx, idx))
	n, err := e.rdb.ZCard(context.Background(), e.prefix+idx.Key).Result()
	require.NoError(t, err)
	require.Zero(t, n, "taken out")
	again := book()
	require.False(t, again.Recalled, "forgotten: booked anew")
	require.Equal(t, first.At.Add(100*time.Millisecond), again.At)
	require.NoError(t, e.eng.ForgetRetry(ctx, throttle.RetryIndex{Key: idx.Key, Member: "absent"}))

	for _, bad := range []throttle.RetryIndex{{Key: idx.Key}, {Key: idx.Key, Member: "a\x00b"}, {Member: "m"}} {
		require.ErrorIs(t, e.eng.ForgetRetry(ctx, bad), throttle.ErrInvalidRequest, "%+v", bad)
	}
}
