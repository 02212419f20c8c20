package throttle_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/slotbook/slotbook/internal/redistest"
	"github.com/slotbook/slotbook/throttle"
)

// replyHook is a go-redis hook that, while on, hands every script call's
// reply to f, which may change it: Redis ran the script, but what comes
// back is not what the script answered (a proxy that mangles replies, a
// script of another version).
type replyHook struct {
	on atomic.Bool
	f  func(reply any) any
}

func (h *replyHook) DialHook(next redis.DialHook) redis.DialHook { return next }
func (h *replyHook) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}
func (h *replyHook) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		err := next(ctx, cmd)
		if n := cmd.Name(); err == nil && h.on.Load() && (n == "evalsha" || n == "eval") {
			c, ok := cmd.(interface {
				Val() any
				SetVal(any)
			})
			if !ok {
				panic(fmt.Sprintf("replyHook: a script call of type %T", cmd))
			}
			c.SetVal(h.f(c.Val()))
		}
		return err
	}
}

// hookedEnv is newEnv with the scripts loaded and h on its client.
func hookedEnv(t *testing.T, h *replyHook) *env {
	t.Helper()
	e := newEnv(t)
	require.NoError(t, e.eng.Load(context.Background()))
	e.rdb.AddHook(h)
	return e
}

// garble replaces every reply with a string no script of the engine
// answers.
func garble() *replyHook {
	return &replyHook{f: func(any) any { return "garbled" }}
}

// TestUnreadableReplyIsReplyLost: a booking call whose reply comes but
// cannot be read has run all the same: it booked. Its caller must hear
// ErrReplyLost ("the call may have taken effect"), as for a reply lost on
// the wire, not a plain error that reads as "nothing happened". So for a
// single booking, a batch on one key, a layered booking, a refund, a
// BookRetry and a merged call; each booking's key holds the booking.
func TestUnreadableReplyIsReplyLost(t *testing.T) {
	t.Parallel()
	g := garble()
	e := hookedEnv(t, g)
	eng, rdb, prefix, ctx := e.eng, e.rdb, e.prefix, context.Background()
	var err error
	lim := throttle.PerSecond(10, 0)
	req := throttle.Request{N: 1, MaxWait: throttle.Forever}
	booked := func(key string) {
		t.Helper()
		require.NoError(t, rdb.Get(ctx, prefix+key).Err(), "%s: nothing booked", key)
	}
	lost := func(what string, err error) {
		t.Helper()
		require.Error(t, err, what)
		require.ErrorIs(t, err, throttle.ErrReplyLost, what)
	}

	g.on.Store(true)
	_, err = eng.Book(ctx, "one", lim, req)
	lost("Book", err)
	booked("one")

	_, err = eng.BookBatch(ctx, "batch", lim, []throttle.Request{req, req})
	lost("BookBatch", err)
	booked("batch")

	keys := []string{"{l}:a", "{l}:b"}
	limits := []throttle.Limit{lim, throttle.PerMinute(100, 0)}
	_, err = eng.BookAll(ctx, keys, limits, []throttle.Request{req})
	lost("BookAll", err)
	booked(keys[0])
	booked(keys[1])

	_, err = eng.BookRetry(ctx, []string{"r:{k}"}, []throttle.Limit{lim}, throttle.Request{N: 1, MaxWait: time.Minute},
		throttle.RetryIndex{Key: "r:{k}:asynq", Member: "m", KeepFrom: time.Minute, Window: time.Second, MaxDue: 10})
	lost("BookRetry", err)
	booked("r:{k}")

	// A refund of the second of two bookings (its slot a minute ahead).
	g.on.Store(false)
	per := throttle.PerMinute(1, 0)
	_, err = eng.Book(ctx, "refund", per, req)
	require.NoError(t, err)
	b, err := eng.Book(ctx, "refund", per, req)
	require.NoError(t, err)
	require.True(t, b.OK)
	require.Greater(t, b.Wait, 50*time.Second)
	g.on.Store(true)
	_, err = eng.Refund(ctx, "refund", per, b)
	lost("Refund", err)
	g.on.Store(false)
	given, err := eng.Refund(ctx, "refund", per, b)
	require.NoError(t, err)
	require.Zero(t, given, "the refund whose reply was unreadable had given back")
	again, err := eng.Book(ctx, "refund", per, req)
	require.NoError(t, err)
	require.InDelta(t, b.Wait.Seconds(), again.Wait.Seconds(), 5, "the next booking takes the room given back")
}

// TestUnreadableMergedReplyIsReplyLost: WithMergeAt(1), WithMergeWait
// (Forever), replies held back 200 ms: two bookings merge behind a lone
// one, and their merged call's reply cannot be read. Each of the two
// hears ErrReplyLost and its key holds its booking.
func TestUnreadableMergedReplyIsReplyLost(t *testing.T) {
	t.Parallel()
	r := rmaEngine(t, redistest.Shared(t), 4, 200*time.Millisecond, throttle.WithMergeAt(1), throttle.WithMergeWait(throttle.Forever))
	g := garble()
	r.rdb.AddHook(g)
	g.on.Store(true)
	before := r.calls.Load()
	var wg sync.WaitGroup
	errs := make([]error, 3)
	for i := range 3 {
		wg.Go(func() {
			_, errs[i] = r.eng.Book(context.Background(), fmt.Sprintf("m%d", i), rmaLim, throttle.Request{N: 1, MaxWait: throttle.Forever})
		})
		if i == 0 {
			time.Sleep(60 * time.Millisecond) // the first flies alone; the others merge
		}
	}
	waitAll(t, &wg, 10*time.Second, "garbled replies")
	require.Equal(t, int64(2), r.calls.Load()-before, "calls: the lone booking and one merged call")
	for i, err := range errs {
		require.True(t, errors.Is(err, throttle.ErrReplyLost), "booking %d: %v", i, err)
		r.requireBookedOnce(t, fmt.Sprintf("m%d", i))
	}
}

// skew changes a reply of four values or more (BookRetry's {now, status,
// wait, tats..., due}; a merged call's {now, tat, wait, ...}) by f: a
// reply well formed but not what the script answers.
func skew(f func(reply []any)) *replyHook {
	return &replyHook{f: func(reply any) any {
		if arr, ok := reply.([]any); ok && len(arr) >= 4 {
			f(arr)
		}
		return reply
	}}
}

// TestBookRetryReplyMustAgree: BookRetry checks its reply as BookAll
// does: a wait that is not the one the reply's TATs give, or a status
// that says booked for a wait past the max wait (or refused within it),
// was not made by the engine's script, which ran all the same:
// ErrReplyLost, not a booking made up of the reply's numbers.
func TestBookRetryReplyMustAgree(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	eng, rdb, ctx := e.eng, e.rdb, context.Background()
	require.NoError(t, eng.Load(ctx))
	lim := throttle.PerSecond(10, 0)
	for name, f := range map[string]func([]any){
		"wait off by 1ms": func(a []any) { a[2] = a[2].(int64) + 1000 },
		"refused within":  func(a []any) { a[1] = int64(0) },
		"booked beyond":   func(a []any) { a[1], a[2] = int64(1), int64(time.Hour/time.Microsecond) },
		"unknown status":  func(a []any) { a[1] = int64(7) },
	} {
		t.Run(name, func(t *testing.T) {
			s := skew(f)
			s.on.Store(true)
			rdb.AddHook(s)
			defer s.on.Store(false)
			key := "agree:{" + name + "}"
			_, err := eng.BookRetry(ctx, []string{key}, []throttle.Limit{lim}, throttle.Request{N: 1, MaxWait: time.Minute},
				throttle.RetryIndex{Key: key + ":asynq", Member: "m", KeepFrom: time.Minute, Window: time.Second, MaxDue: 10})
			require.ErrorIs(t, err, throttle.ErrReplyLost)
		})
	}
}
