package throttle_test

import (
	"context"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/slotbook/slotbook/internal/callcount"
	"github.com/slotbook/slotbook/internal/redistest"
	"github.com/slotbook/slotbook/throttle"
)

// TestStatePredicts: at every step of a sequence of bookings on an
// explicit clock, State reads what the next request will meet, without
// changing it: a booking made at the same instant waits exactly State's
// Wait, and exactly State's Available units pass at once (one more does
// not).
func TestStatePredicts(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	limit := throttle.PerSecond(10, 2) // I = 100ms, tau = 200ms
	t0 := base()
	key := "s"

	s, err := e.eng.State(at(t0, 0), []string{key}, []throttle.Limit{limit})
	require.NoError(t, err)
	require.Equal(t, time.UnixMicro(t0), s.Now)
	require.False(t, s.Keys[0].Exists, "an idle subject has no key")
	require.Zero(t, s.Wait)
	require.Equal(t, s.Now, s.NextFree)
	require.Equal(t, limit.Burst+1, s.Available)
	require.Zero(t, s.Backlog)
	require.Zero(t, s.Keys[0].TTL)

	steps := []struct {
		book int           // bookings made (max wait Forever) before reading
		at   time.Duration // clock of the reading, from t0
	}{
		{1, 0}, {4, 0}, {0, 150 * time.Millisecond}, {2, 300 * time.Millisecond}, {0, 2 * time.Second}, {3, 2 * time.Second},
	}
	for i, st := range steps {
		ctx := at(t0, st.at)
		for k := 0; k < st.book; k++ {
			_, err := e.eng.Book(ctx, key, limit, throttle.Request{N: 1, MaxWait: throttle.Forever})
			require.NoError(t, err)
		}
		s, err := e.eng.State(ctx, []string{key}, []throttle.Limit{limit})
		require.NoError(t, err, "step %d", i)
		raw, err := e.rdb.Get(context.Background(), e.prefix+key).Result()
		require.NoError(t, err)
		again, err := e.eng.State(ctx, []string{key}, []throttle.Limit{limit})
		require.NoError(t, err)
		require.Equal(t, s.Wait, again.Wait, "step %d: a reading changes nothing", i)
		require.Equal(t, s.Available, again.Available, "step %d: a reading changes nothing", i)
		after, err := e.rdb.Get(context.Background(), e.prefix+key).Result()
		require.NoError(t, err)
		require.Equal(t, raw, after, "step %d: a reading writes nothing", i)

		tat, err := strconv.ParseInt(raw, 10, 64)
		require.NoError(t, err)
		ks := s.Keys[0]
		require.True(t, ks.Exists)
		require.Equal(t, time.UnixMicro(tat), ks.TAT, "step %d", i)
		require.Equal(t, time.Duration(max(0, tat-s.Now.UnixMicro()))*time.Microsecond, s.Backlog, "step %d", i)
		require.Positive(t, ks.TTL, "step %d", i)
		require.Equal(t, limit, ks.Limit)
		require.Equal(t, s.Now.Add(s.Wait), s.NextFree)

		// Exactly Available units pass now, and one more does not.
		if s.Available > 0 {
			r, err := e.eng.AllowN(ctx, key, limit, s.Available)
			require.NoError(t, err)
			require.True(t, r.Allowed, "step %d: %d units available", i, s.Available)
		}
		r, err := e.eng.Allow(ctx, key, limit)
		require.NoError(t, err)
		require.False(t, r.Allowed, "step %d: only %d units available", i, s.Available)
		// The wait State read is the wait the next booking gets.
		s, err = e.eng.State(ctx, []string{key}, []throttle.Limit{limit})
		require.NoError(t, err)
		b, err := e.eng.Book(ctx, key, limit, throttle.Request{N: 1, MaxWait: throttle.Forever})
		require.NoError(t, err)
		require.Equal(t, s.Wait, b.Wait, "step %d", i)
		require.Equal(t, s.NextFree, b.At, "step %d", i)
	}
}

// TestStateLayered: under several limits each key is reported under its
// own limit, and the subject's wait and availability are those of the
// most constrained.
func TestStateLayered(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	keys := []string{"api:{t}", "api:{t}:86400000ms"}
	limits := []throttle.Limit{throttle.PerSecond(10, 4), throttle.PerDay(3, 1)}
	t0 := base()
	ctx := at(t0, 0)
	_, err := e.eng.BookAll(ctx, keys, limits, []throttle.Request{{N: 1, MaxWait: throttle.Forever}, {N: 1, MaxWait: throttle.Forever}})
	require.NoError(t, err)
	s, err := e.eng.State(ctx, keys, limits)
	require.NoError(t, err)
	require.Len(t, s.Keys, 2)
	require.Equal(t, 3, s.Keys[0].Available, "per second: 5 less 2")
	require.Zero(t, s.Keys[0].Wait)
	require.Equal(t, 0, s.Keys[1].Available, "per day: 2 less 2")
	require.Equal(t, 0, s.Available, "the fewest of any limit")
	require.Equal(t, limits[1].Interval(), s.Keys[1].Wait, "the day's tolerance is spent: one interval to wait")
	require.Equal(t, s.Keys[1].Wait, s.Wait)
	require.Equal(t, 2*limits[1].Interval(), s.Backlog)
	b, err := e.eng.BookAll(ctx, keys, limits, []throttle.Request{{N: 1, MaxWait: throttle.Forever}})
	require.NoError(t, err)
	require.Equal(t, s.Wait, b[0].Wait)
}

// TestStateWithoutLimits: an operator's tool reads keys it found without
// knowing their limits: the stored TAT, backlog and TTL, no wait; only the
// value's form is checked.
func TestStateWithoutLimits(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	ctx := context.Background()
	limit := throttle.PerMinute(1, 0) // slow: a busy machine cannot move the reading past a booking
	for i := 0; i < 3; i++ {
		_, err := e.eng.Book(ctx, "{w}", limit, throttle.Request{N: 1, MaxWait: throttle.Forever})
		require.NoError(t, err)
	}
	s, err := e.eng.State(ctx, []string{"{w}", "{w}:absent"}, nil)
	require.NoError(t, err)
	require.True(t, s.Keys[0].Exists)
	require.False(t, s.Keys[1].Exists)
	require.Zero(t, s.Keys[1].TTL)
	require.Zero(t, s.Wait)
	require.Zero(t, s.Available)
	require.Greater(t, s.Backlog, 2*time.Minute)
	require.LessOrEqual(t, s.Backlog, 3*time.Minute)
	require.Greater(t, s.Keys[0].TTL, 2*time.Minute)
	require.LessOrEqual(t, s.Keys[0].TTL, 3*time.Minute+2*time.Millisecond)

	// No expiry: not a key slotbook wrote, reported as such.
	require.NoError(t, e.rdb.Set(ctx, e.prefix+"persist", time.Now().UnixMicro(), 0).Err())
	s, err = e.eng.State(ctx, []string{"persist"}, nil)
	require.NoError(t, err)
	require.Negative(t, s.Keys[0].TTL)

	// Far ahead: corrupt under a limit, readable as a value without one.
	far := strconv.FormatInt(time.Now().Add(throttle.MaxHorizon+time.Hour).UnixMicro(), 10)
	require.NoError(t, e.rdb.Set(ctx, e.prefix+"far", far, time.Hour).Err())
	_, err = e.eng.State(ctx, []string{"far"}, []throttle.Limit{limit})
	require.ErrorIs(t, err, throttle.ErrCorruptState)
	s, err = e.eng.State(ctx, []string{"far"}, nil)
	require.NoError(t, err)
	require.Greater(t, s.Backlog, throttle.MaxHorizon)
}

// TestStateCorrupt: a value that is not a TAT is an error naming the key,
// with or without limits, and nothing is written over it.
func TestStateCorrupt(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	ctx := context.Background()
	for _, v := range []string{"1e30", "-5", "x", "99999999999999999"} {
		key := "c" + strconv.Quote(v)
		require.NoError(t, e.rdb.Set(ctx, e.prefix+key, v, time.Hour).Err())
		for _, limits := range [][]throttle.Limit{nil, {tenPerSecond}} {
			_, err := e.eng.State(ctx, []string{key}, limits)
			require.ErrorIs(t, err, throttle.ErrCorruptState, v)
			require.ErrorContains(t, err, e.prefix+key)
		}
		got, err := e.rdb.Get(ctx, e.prefix+key).Result()
		require.NoError(t, err)
		require.Equal(t, v, got)
	}
	require.NoError(t, e.rdb.HSet(ctx, e.prefix+"hash", "a", 1).Err())
	_, err := e.eng.State(ctx, []string{"hash"}, nil)
	require.ErrorContains(t, err, "WRONGTYPE")
}

// TestStateBadInput: bad input is a typed error, and no Redis call is made.
func TestStateBadInput(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	ok := tenPerSecond
	tests := []struct {
		name   string
		keys   []string
		limits []throttle.Limit
		want   error
	}{
		{"no keys", nil, nil, throttle.ErrInvalidRequest},
		{"no keys, empty limits", []string{}, []throttle.Limit{}, throttle.ErrInvalidRequest},
		{"empty key", []string{""}, nil, throttle.ErrInvalidRequest},
		{"key too long", []string{strings.Repeat("x", throttle.MaxKeyLen+1)}, nil, throttle.ErrInvalidRequest},
		{"braces without a tag", []string{"a{b"}, nil, throttle.ErrInvalidRequest},
		{"too many keys", []string{"{a}1", "{a}2", "{a}3", "{a}4", "{a}5", "{a}6", "{a}7", "{a}8", "{a}9"}, nil, throttle.ErrInvalidRequest},
		{"no shared tag", []string{"{a}", "{b}"}, nil, throttle.ErrInvalidRequest},
		{"several without a tag", []string{"a", "b"}, nil, throttle.ErrInvalidRequest},
		{"key twice", []string{"{a}", "{a}"}, nil, throttle.ErrInvalidRequest},
		{"fewer limits than keys", []string{"{a}1", "{a}2"}, []throttle.Limit{ok}, throttle.ErrInvalidRequest},
		{"invalid limit", []string{"a"}, []throttle.Limit{throttle.PerSecond(0, 1)}, throttle.ErrInvalidLimit},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			before := e.calls.Load()
			_, err := e.eng.State(context.Background(), tc.keys, tc.limits)
			require.ErrorIs(t, err, tc.want)
			require.Equal(t, before, e.calls.Load(), "no Redis call for bad input")
		})
	}
}

// TestLoadIncludesState: after Load, the first State is one call (no
// NOSCRIPT round trip), as the first booking is.
func TestLoadIncludesState(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t) // a server of its own: its script cache starts empty
	rdb := srv.Client(t)
	calls := callcount.Attach(rdb)
	eng, err := throttle.New(rdb, throttle.WithPrefix(redistest.Prefix(t)), throttle.WithTimeout(10*time.Second))
	require.NoError(t, err)
	ctx := context.Background()
	require.NoError(t, eng.Load(ctx))
	before := calls.Load()
	_, err = eng.State(ctx, []string{"k"}, []throttle.Limit{tenPerSecond})
	require.NoError(t, err)
	require.Equal(t, int64(1), calls.Load()-before, "State after Load: one call")
}
