package reserve_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/slotbook/slotbook/deadline"
	"github.com/slotbook/slotbook/internal/callcount"
	"github.com/slotbook/slotbook/internal/redistest"
	"github.com/slotbook/slotbook/internal/testhook"
	"github.com/slotbook/slotbook/reserve"
	"github.com/slotbook/slotbook/throttle"
)

type env struct {
	rdb    *redis.Client
	calls  *callcount.Counter
	eng    *throttle.Engine
	prefix string
}

func newEnv(t testing.TB) *env {
	t.Helper()
	rdb := redistest.Shared(t).Client(t)
	calls := callcount.Attach(rdb)
	prefix := redistest.Prefix(t)
	eng, err := throttle.New(rdb, throttle.WithPrefix(prefix), throttle.WithTimeout(5*time.Second))
	require.NoError(t, err)
	return &env{rdb: rdb, calls: calls, eng: eng, prefix: prefix}
}

func (e *env) limiter(t *testing.T, limit throttle.Limit, opts ...reserve.Option) *reserve.Limiter {
	t.Helper()
	l, err := reserve.New(e.eng, "api", limit, opts...)
	require.NoError(t, err)
	return l
}

// fill books burst+1 immediate slots at now, so the next slot is one
// interval away.
func fill(t *testing.T, l *reserve.Limiter, ctx context.Context) {
	t.Helper()
	for i := 0; i <= l.Limit().Burst; i++ {
		r, err := l.Reserve(ctx, "k")
		require.NoError(t, err)
		require.True(t, r.OK())
	}
}

func TestRefusals(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name     string
		opts     []reserve.Option
		deadline time.Duration // 0: none
		bound    error
		retry    time.Duration
		budget   time.Duration
		calls    int64
	}{
		{"max wait", []reserve.Option{reserve.WithMaxWait(500 * time.Millisecond)}, 0,
			reserve.ErrMaxWaitExceeded, time.Second, 500 * time.Millisecond, 1},
		{"zero max wait", []reserve.Option{reserve.WithMaxWait(0)}, 0,
			reserve.ErrMaxWaitExceeded, time.Second, 0, 1},
		{"deadline", nil, 500 * time.Millisecond,
			reserve.ErrWouldExceedDeadline, time.Second, 500 * time.Millisecond, 1},
		{"deadline less work", []reserve.Option{reserve.WithWorkEstimate(10 * time.Second)}, 10500 * time.Millisecond,
			reserve.ErrWouldExceedDeadline, time.Second, 500 * time.Millisecond, 1},
		{"no time for the work: no Redis call", []reserve.Option{reserve.WithWorkEstimate(10 * time.Second)}, 5 * time.Second,
			reserve.ErrWouldExceedDeadline, 0, 0, 0},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			e := newEnv(t)
			// One a second (the explicit clock stands still: keys must
			// not expire in real time meanwhile).
			l := e.limiter(t, throttle.PerMinute(60, 1), tc.opts...)
			now := time.Now()
			base := testhook.WithNow(context.Background(), now.UnixMicro())
			fill(t, l, base)
			next, err := e.rdb.Get(base, e.prefix+"api:{k}").Result()
			require.NoError(t, err)

			// The deadline is set just before the request, whose budget
			// is measured on the local clock a little later.
			ctx, set := base, time.Now()
			if tc.deadline > 0 {
				var cancel context.CancelFunc
				ctx, cancel = context.WithDeadline(base, set.Add(tc.deadline))
				defer cancel()
			}
			before := e.calls.Load()
			r, err := l.Reserve(ctx, "k")
			took := time.Since(set)
			require.NoError(t, err, "a refusal is not an error")
			require.False(t, r.OK())
			require.Equal(t, tc.calls, e.calls.Load()-before, "Redis calls")

			var de *deadline.Error
			require.ErrorAs(t, r.Err(), &de)
			require.ErrorIs(t, r.Err(), tc.bound)
			require.Equal(t, tc.retry, r.RetryAfter())
			require.Equal(t, tc.retry, de.RetryAfter)
			if tc.deadline > 0 && tc.calls > 0 {
				// The deadline's budget: what was left of it when the
				// request was judged, at most the time the call took less.
				require.LessOrEqual(t, de.Budget, tc.budget)
				require.GreaterOrEqual(t, de.Budget, tc.budget-took)
			} else {
				require.Equal(t, tc.budget, de.Budget)
			}

			// Acquire refuses the same way, at once (before its deadline,
			// and before the slot a second away it would have slept
			// for), and neither booked.
			start := time.Now()
			err = l.Acquire(ctx, "k")
			require.ErrorIs(t, err, tc.bound)
			require.NoError(t, ctx.Err(), "refused at once, before the deadline")
			require.Less(t, time.Since(start), time.Second, "refused at once, not at the slot")
			after, err := e.rdb.Get(base, e.prefix+"api:{k}").Result()
			require.NoError(t, err)
			require.Equal(t, next, after, "a refusal must book nothing")
			b, err := e.eng.Book(base, "api:{k}", l.Limit(), throttle.Request{N: 1, MaxWait: throttle.Forever})
			require.NoError(t, err)
			require.Equal(t, time.Second, b.Wait, "the next booking's wait is unchanged")
		})
	}
}

func TestBadInput(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	ok := throttle.PerSecond(10, 5)
	ctors := []struct {
		name  string
		eng   *throttle.Engine
		lname string
		limit throttle.Limit
		opts  []reserve.Option
	}{
		{"nil engine", nil, "api", ok, nil},
		{"empty name", e.eng, "", ok, nil},
		{"name with colon", e.eng, "a:b", ok, nil},
		{"name with brace", e.eng, "a{b", ok, nil},
		{"invalid limit", e.eng, "api", throttle.PerSecond(0, 1), nil},
		{"negative max wait", e.eng, "api", ok, []reserve.Option{reserve.WithMaxWait(-time.Second)}},
		{"negative work", e.eng, "api", ok, []reserve.Option{reserve.WithWorkEstimate(-time.Second)}},
	}
	for _, tc := range ctors {
		t.Run(tc.name, func(t *testing.T) {
			if _, err := reserve.New(tc.eng, tc.lname, tc.limit, tc.opts...); err == nil {
				t.Fatal("New succeeded")
			}
		})
	}
	l := e.limiter(t, ok)
	canceled, cancel := context.WithCancel(context.Background())
	cancel()
	calls := []struct {
		name string
		ctx  context.Context
		key  string
		n    int
		want error
	}{
		{"n zero", context.Background(), "k", 0, throttle.ErrInvalidRequest},
		{"n above burst+1", context.Background(), "k", 7, throttle.ErrExceedsBurst},
		{"empty key", context.Background(), "", 1, throttle.ErrInvalidRequest},
		{"cancelled context", canceled, "k", 1, context.Canceled},
		{"key that breaks the hash tag", context.Background(), "}", 1, throttle.ErrInvalidRequest},
	}
	for _, tc := range calls {
		t.Run(tc.name, func(t *testing.T) {
			if tc.ctx == context.Background() && tc.n >= 1 && tc.n <= 6 {
				// What CheckKey says of a key is what a call finds.
				if err := l.CheckKey(tc.key); !errors.Is(err, tc.want) {
					t.Fatalf("CheckKey(%q) = %v, want %v", tc.key, err, tc.want)
				}
			}
			before := e.calls.Load()
			if _, err := l.ReserveN(tc.ctx, tc.key, tc.n); !errors.Is(err, tc.want) {
				t.Fatalf("ReserveN = %v, want %v", err, tc.want)
			}
			if err := l.AcquireN(tc.ctx, tc.key, tc.n); !errors.Is(err, tc.want) {
				t.Fatalf("AcquireN = %v, want %v", err, tc.want)
			}
			if got := e.calls.Load() - before; got != 0 {
				t.Fatalf("%d Redis calls for bad input, want 0", got)
			}
		})
	}
	keys, err := e.rdb.Keys(context.Background(), e.prefix+"*").Result()
	require.NoError(t, err)
	require.Empty(t, keys)
}

func TestCancel(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	l := e.limiter(t, throttle.PerMinute(60, 0))
	ctx := testhook.WithNow(context.Background(), time.Now().UnixMicro())
	fill(t, l, ctx)
	called := time.Now()
	r, err := l.Reserve(ctx, "k")
	require.NoError(t, err)
	// The booked wait, counted from the reply: less what has passed since.
	delay, took := r.Delay(), time.Since(called)
	require.LessOrEqual(t, delay, time.Second)
	require.GreaterOrEqual(t, delay, time.Second-took)
	require.NoError(t, r.Cancel(ctx))
	before := e.calls.Load()
	require.NoError(t, r.Cancel(ctx), "second Cancel")
	require.Equal(t, before, e.calls.Load(), "a second Cancel makes no call")

	r2, err := l.Reserve(ctx, "k")
	require.NoError(t, err)
	require.Equal(t, time.Second, r.Booking().Wait)
	require.True(t, r2.Booking().At.Equal(r.Booking().At), "the next booking takes the cancelled slot")
}

func TestAllow(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	l := e.limiter(t, throttle.PerSecond(10, 1))
	ctx := testhook.WithNow(context.Background(), time.Now().UnixMicro())
	for _, want := range []bool{true, true, false} {
		r, err := l.Allow(ctx, "k")
		require.NoError(t, err)
		require.Equal(t, want, r.Allowed)
	}
}

func TestWithSharesTheQuota(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	l := e.limiter(t, throttle.PerSecond(10, 0), reserve.WithMaxWait(0))
	patient, err := l.With(reserve.WithoutMaxWait())
	require.NoError(t, err)
	_, err = l.With(reserve.WithMaxWait(-1))
	require.Error(t, err)
	if d, ok := patient.MaxWait(); ok {
		t.Fatalf("MaxWait() = %v, true; want no cap", d)
	}
	ctx := testhook.WithNow(context.Background(), time.Now().UnixMicro())
	r, err := l.Reserve(ctx, "k")
	require.NoError(t, err)
	require.True(t, r.OK())
	r, err = l.Reserve(ctx, "k")
	require.NoError(t, err)
	require.False(t, r.OK(), "no wait allowed")
	r, err = patient.Reserve(ctx, "k")
	require.NoError(t, err)
	require.True(t, r.OK())
	require.Equal(t, 100*time.Millisecond, r.Booking().Wait, "same quota, same key")
}
