package throttle_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/slotbook/slotbook/throttle"
)

var (
	layeredKeys   = []string{"api:{s}", "api:{s}:1m0s"}
	perSecond     = throttle.PerSecond(10, 0) // I = 100ms
	perHalfMinute = throttle.PerMinute(30, 1) // I = 2s, tau = 2s
)

// TestLayeredSlot checks the slot formula on an explicit clock: the slot is
// the earliest time every limit allows, and each limit advances from it.
func TestLayeredSlot(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	t0 := base()
	limits := []throttle.Limit{perSecond, perHalfMinute}
	var waits []time.Duration
	for i := 0; i < 5; i++ {
		b, err := e.eng.BookAll(at(t0, 0), layeredKeys, limits, []throttle.Request{{N: 1, MaxWait: throttle.Forever}})
		require.NoError(t, err)
		require.True(t, b[0].OK)
		waits = append(waits, b[0].Wait)
	}
	// First the per-second limit binds (100ms), then the per-minute one,
	// whose burst of one is spent: 2 s apart.
	ms := time.Millisecond
	require.Equal(t, []time.Duration{0, 100 * ms, 2000 * ms, 4000 * ms, 6000 * ms}, waits)
}

// TestLayeredEitherBinds: the daily-style limit binding before the
// per-second one, and the reverse.
func TestLayeredEitherBinds(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name   string
		limits []throttle.Limit
		gap    time.Duration // between slots once the bursts are spent
	}{
		{"long period binds", []throttle.Limit{throttle.PerSecond(100, 0), throttle.PerMinute(6, 0)}, 10 * time.Second},
		{"short period binds", []throttle.Limit{throttle.PerSecond(1, 0), throttle.PerMinute(600, 100)}, time.Second},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			e := newEnv(t)
			t0 := base()
			var last time.Duration
			for i := 0; i < 4; i++ {
				b, err := e.eng.BookAll(at(t0, 0), layeredKeys, tc.limits, []throttle.Request{{N: 1, MaxWait: throttle.Forever}})
				require.NoError(t, err)
				if i > 0 {
					require.Equal(t, tc.gap, b[0].Wait-last, "gap before booking %d", i)
				}
				last = b[0].Wait
			}
		})
	}
}

// TestLayeredRefusalAndRefund: a refusal books nothing in any limit; a
// refund gives back to each; check mode counts in all.
func TestLayeredRefusalAndRefund(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	ctx := context.Background()
	t0 := base()
	limits := []throttle.Limit{perSecond, perHalfMinute}
	get := func() []string {
		var vs []string
		for _, k := range layeredKeys {
			vs = append(vs, e.rdb.Get(ctx, e.prefix+k).Val())
		}
		return vs
	}
	for i := 0; i < 2; i++ {
		_, err := e.eng.BookAll(at(t0, 0), layeredKeys, limits, []throttle.Request{{N: 1, MaxWait: throttle.Forever}})
		require.NoError(t, err)
	}
	before := get()
	b, err := e.eng.BookAll(at(t0, 0), layeredKeys, limits, []throttle.Request{{N: 1, MaxWait: time.Second}})
	require.NoError(t, err)
	require.False(t, b[0].OK)
	require.Equal(t, 2*time.Second, b[0].Wait, "exact retry-after: the per-minute limit")
	require.Equal(t, before, get(), "a refusal writes nothing")

	b, err = e.eng.BookAll(at(t0, 0), layeredKeys, limits, []throttle.Request{{N: 1, MaxWait: throttle.Forever}})
	require.NoError(t, err)
	require.True(t, b[0].OK)
	given, err := e.eng.RefundAll(at(t0, 10*time.Millisecond), layeredKeys, limits, b[0])
	require.NoError(t, err)
	// The per-second TAT had jumped to the slot the per-minute limit set;
	// with nothing booked since, both go back exactly.
	require.Equal(t, []time.Duration{1900 * time.Millisecond, 2 * time.Second}, given)
	require.Equal(t, before, get(), "the refund gave back to both")

	r, err := e.eng.AllowAll(at(t0, 10*time.Millisecond), layeredKeys, limits, 1)
	require.NoError(t, err)
	require.False(t, r.Allowed)
	require.Equal(t, 1990*time.Millisecond, r.RetryAfter)
	require.Equal(t, 0, r.Remaining)
}

func TestLayeredBadInput(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	ok := []throttle.Limit{perSecond, perHalfMinute}
	nine := make([]throttle.Limit, 9)
	nineKeys := make([]string, 9)
	for i := range nine {
		nine[i] = throttle.Every(time.Duration(i+1)*time.Second, 1, 0)
		nineKeys[i] = "api:{s}:" + nine[i].Period.String()
	}
	tests := []struct {
		name   string
		keys   []string
		limits []throttle.Limit
		n      int
		want   error
	}{
		{"fewer keys than limits", layeredKeys[:1], ok, 1, throttle.ErrInvalidRequest},
		{"no keys", nil, nil, 1, throttle.ErrInvalidRequest},
		{"too many limits", nineKeys, nine, 1, throttle.ErrInvalidRequest},
		{"same key twice", []string{"api:{s}", "api:{s}"}, ok, 1, throttle.ErrInvalidRequest},
		{"no shared hash tag", []string{"api:{s}", "api:{t}:1m0s"}, ok, 1, throttle.ErrInvalidRequest},
		{"no hash tag", []string{"api:s", "api:s:1m0s"}, ok, 1, throttle.ErrInvalidRequest},
		{"one limit invalid", layeredKeys, []throttle.Limit{perSecond, throttle.PerMinute(0, 1)}, 1, throttle.ErrInvalidLimit},
		{"n above one limit's burst", layeredKeys, []throttle.Limit{throttle.PerSecond(10, 5), perHalfMinute}, 3, throttle.ErrExceedsBurst},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			before := e.calls.Load()
			_, err := e.eng.BookAll(context.Background(), tc.keys, tc.limits, []throttle.Request{{N: tc.n}})
			require.True(t, errors.Is(err, tc.want), "BookAll: %v, want %v", err, tc.want)
			_, err = e.eng.AllowAll(context.Background(), tc.keys, tc.limits, tc.n)
			require.True(t, errors.Is(err, tc.want), "AllowAll: %v, want %v", err, tc.want)
			require.Equal(t, before, e.calls.Load(), "no Redis call")
		})
	}
}

func TestHashTag(t *testing.T) {
	t.Parallel()
	for key, want := range map[string]string{
		"api:{s}":      "s",
		"api:{s}:1m0s": "s",
		"api:{}":       "",
		"api:s":        "",
		"{a}{b}":       "a",
		"api:{a}b}":    "a",
		"api:{{x}":     "{x",
		"api:{x":       "",
	} {
		require.Equal(t, want, throttle.HashTag(key), key)
	}
}

// TestBlock: after Block(d) no slot is granted before d, and requests
// resume one interval apart, not in a burst; bookings made before keep
// their slots.
func TestBlock(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	t0 := base()
	lim := throttle.PerSecond(10, 5)
	before, err := e.eng.Book(at(t0, 0), "k", lim, throttle.Request{N: 1, MaxWait: 0})
	require.NoError(t, err)
	require.True(t, before.OK)
	require.NoError(t, e.eng.Block(at(t0, 0), "k", lim, 3*time.Second))
	var waits []time.Duration
	for i := 0; i < 3; i++ {
		b, err := e.eng.Book(at(t0, 10*time.Millisecond), "k", lim, throttle.Request{N: 1, MaxWait: throttle.Forever})
		require.NoError(t, err)
		waits = append(waits, b.Wait)
	}
	ms := time.Millisecond
	require.Equal(t, []time.Duration{2990 * ms, 3090 * ms, 3190 * ms}, waits)
	r, err := e.eng.Allow(at(t0, 2999*time.Millisecond), "other", lim)
	require.NoError(t, err)
	require.True(t, r.Allowed, "other keys are not blocked")

	// A shorter block does not shorten a longer one. It still moves the
	// TAT, by a microsecond, so that no booking made before it can be
	// refunded below it.
	require.NoError(t, e.eng.Block(at(t0, 0), "k", lim, time.Second))
	b, err := e.eng.Book(at(t0, 10*time.Millisecond), "k", lim, throttle.Request{N: 1, MaxWait: throttle.Forever})
	require.NoError(t, err)
	require.Equal(t, 3290*ms+time.Microsecond, b.Wait)

	require.ErrorIs(t, e.eng.Block(context.Background(), "k", lim, -time.Second), throttle.ErrInvalidRequest)
}

func TestAllowWindow(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	t0 := base()
	w := throttle.Window{Max: 3, Span: time.Second}
	allow := func(d time.Duration, n int) throttle.Result {
		t.Helper()
		r, err := e.eng.AllowWindow(at(t0, d), "w", w, n)
		require.NoError(t, err)
		return r
	}
	ms := time.Millisecond
	require.True(t, allow(0, 1).Allowed)
	require.True(t, allow(100*ms, 1).Allowed)
	r := allow(200*ms, 1)
	require.True(t, r.Allowed)
	require.Equal(t, 0, r.Remaining)
	r = allow(300*ms, 1)
	require.False(t, r.Allowed)
	require.Equal(t, 700*ms, r.RetryAfter, "until the event at 0 leaves the window")
	r = allow(300*ms, 2)
	require.False(t, r.Allowed)
	require.Equal(t, 800*ms, r.RetryAfter, "until two events leave")
	require.False(t, allow(999*ms, 1).Allowed, "exactly 3 in (t-1s, t]")
	require.True(t, allow(1000*ms, 1).Allowed, "the event at 0 has left")
	require.False(t, allow(1000*ms, 1).Allowed)

	card, err := e.rdb.ZCard(context.Background(), e.prefix+"w").Result()
	require.NoError(t, err)
	require.Equal(t, int64(3), card, "one member per event in the window")

	for _, bad := range []struct {
		w throttle.Window
		n int
	}{{throttle.Window{Max: 0, Span: time.Second}, 1}, {throttle.Window{Max: 1, Span: 0}, 1}, {w, 0}, {w, 4}} {
		_, err := e.eng.AllowWindow(context.Background(), "w", bad.w, bad.n)
		require.Error(t, err)
	}
}

// TestAllowWindowSameInstant: events recorded at one instant are all
// counted.
func TestAllowWindowSameInstant(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	t0 := base()
	w := throttle.Window{Max: 5, Span: time.Minute}
	for i := 0; i < 5; i++ {
		r, err := e.eng.AllowWindow(at(t0, 0), "w", w, 1)
		require.NoError(t, err)
		require.True(t, r.Allowed)
	}
	r, err := e.eng.AllowWindow(at(t0, 0), "w", w, 1)
	require.NoError(t, err)
	require.False(t, r.Allowed)
}
