package throttle_test

import (
	"context"
	"errors"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/slotbook/slotbook/internal/callcount"
	"github.com/slotbook/slotbook/internal/redistest"
	"github.com/slotbook/slotbook/throttle"
)

var tenPerSecond = throttle.PerSecond(10, 5) // I = 100ms, tau = 500ms

func TestAllowBurstThenSpacing(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	t0 := base()
	for i := 0; i < 6; i++ {
		r, err := e.eng.Allow(at(t0, 0), "k", tenPerSecond)
		require.NoError(t, err)
		if !r.Allowed || r.Remaining != 5-i || r.RetryAfter != 0 {
			t.Fatalf("request %d: got %+v, want allowed with %d remaining", i, r, 5-i)
		}
		if want := time.Duration(i+1) * 100 * time.Millisecond; r.ResetAfter != want {
			t.Fatalf("request %d: ResetAfter = %v, want %v", i, r.ResetAfter, want)
		}
	}
	r, err := e.eng.Allow(at(t0, 0), "k", tenPerSecond)
	require.NoError(t, err)
	if r.Allowed || r.RetryAfter != 100*time.Millisecond || r.Remaining != 0 {
		t.Fatalf("7th at once: got %+v, want denied, retry after 100ms, 0 remaining", r)
	}
	r, err = e.eng.Allow(at(t0, 100*time.Millisecond-time.Microsecond), "k", tenPerSecond)
	require.NoError(t, err)
	if r.Allowed || r.RetryAfter != time.Microsecond || r.Remaining != 0 {
		t.Fatalf("1µs early: got %+v, want denied with retry after 1µs and nothing remaining", r)
	}
	r, err = e.eng.Allow(at(t0, 100*time.Millisecond), "k", tenPerSecond)
	require.NoError(t, err)
	if !r.Allowed {
		t.Fatalf("at the retry-after: got %+v, want allowed", r)
	}
}

// TestAllowSaturated is the published check on the Redis scripts with an
// explicit clock: 10/s burst 5, a client asking every millisecond for 3 s.
func TestAllowSaturated(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	t0 := base()
	allowed, early := 0, 0
	for ms := 0; ms <= 3000; ms++ {
		for {
			r, err := e.eng.Allow(at(t0, time.Duration(ms)*time.Millisecond), "k", tenPerSecond)
			require.NoError(t, err)
			if !r.Allowed {
				break
			}
			allowed++
			if ms <= 100 {
				early++
			}
		}
	}
	if allowed != 36 || early != 7 {
		t.Fatalf("allowed %d (%d in the first 100ms), want 36 (7)", allowed, early)
	}
}

func TestAllowNLargerThanBurstLeft(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	t0 := base()
	r, err := e.eng.AllowN(at(t0, 0), "k", tenPerSecond, 4)
	require.NoError(t, err)
	require.True(t, r.Allowed)
	require.Equal(t, 2, r.Remaining)
	// 3 units need 200ms more than the 2 left.
	r, err = e.eng.AllowN(at(t0, 0), "k", tenPerSecond, 3)
	require.NoError(t, err)
	if r.Allowed || r.RetryAfter != 100*time.Millisecond {
		t.Fatalf("got %+v, want denied with retry after 100ms", r)
	}
}

func TestBookMaxWait(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	ctx := context.Background()
	t0 := base()
	for i := 0; i < 6; i++ {
		b, err := e.eng.Book(at(t0, 0), "k", tenPerSecond, throttle.Request{N: 1, MaxWait: 0})
		require.NoError(t, err)
		require.True(t, b.OK)
		require.Zero(t, b.Wait)
	}
	before, err := e.rdb.Get(ctx, e.prefix+"k").Result()
	require.NoError(t, err)

	b, err := e.eng.Book(at(t0, 0), "k", tenPerSecond, throttle.Request{N: 1, MaxWait: 99 * time.Millisecond})
	require.NoError(t, err)
	if b.OK || b.Wait != 100*time.Millisecond {
		t.Fatalf("got %+v, want refused with wait 100ms", b)
	}
	after, err := e.rdb.Get(ctx, e.prefix+"k").Result()
	require.NoError(t, err)
	require.Equal(t, before, after, "a refusal must write nothing")

	b, err = e.eng.Book(at(t0, 0), "k", tenPerSecond, throttle.Request{N: 1, MaxWait: 100 * time.Millisecond})
	require.NoError(t, err)
	if !b.OK || b.Wait != 100*time.Millisecond || !b.At.Equal(time.UnixMicro(t0).Add(100*time.Millisecond)) {
		t.Fatalf("got %+v, want booked at +100ms", b)
	}
	b, err = e.eng.Book(at(t0, 0), "k", tenPerSecond, throttle.Request{N: 3, MaxWait: throttle.Forever})
	require.NoError(t, err)
	if !b.OK || b.Wait != 400*time.Millisecond {
		t.Fatalf("n=3 after one queued: got %+v, want booked with wait 400ms", b)
	}
}

// TestBookBatchEqualsSequence checks that one batch call decides exactly as
// the same requests sent one by one at the same instant.
func TestBookBatchEqualsSequence(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	t0 := base()
	reqs := []throttle.Request{
		{N: 1, MaxWait: 0}, {N: 6, MaxWait: 0}, {N: 2, MaxWait: 0},
		{N: 1, MaxWait: 50 * time.Millisecond}, {N: 3, MaxWait: time.Second},
		{N: 6, MaxWait: 200 * time.Millisecond}, {N: 1, MaxWait: throttle.Forever},
	}
	got, err := e.eng.BookBatch(at(t0, 0), "batch", tenPerSecond, reqs)
	require.NoError(t, err)
	require.Len(t, got, len(reqs))
	for i, r := range reqs {
		want, err := e.eng.Book(at(t0, 0), "seq", tenPerSecond, r)
		require.NoError(t, err)
		if got[i].OK != want.OK || got[i].Wait != want.Wait || !got[i].At.Equal(want.At) {
			t.Errorf("request %d %+v: batch %+v, one by one %+v", i, r, got[i], want)
		}
	}
	ctx := context.Background()
	require.Equal(t, e.rdb.Get(ctx, e.prefix+"seq").Val(), e.rdb.Get(ctx, e.prefix+"batch").Val())
	// And the batch judged each on its own: some of each.
	oks := 0
	for _, b := range got {
		if b.OK {
			oks++
		}
	}
	require.Greater(t, oks, 0)
	require.Less(t, oks, len(got))
}

func TestRefund(t *testing.T) {
	t.Parallel()
	lim := tenPerSecond
	book := func(t *testing.T, e *env, t0 int64, d time.Duration) throttle.Booking {
		t.Helper()
		b, err := e.eng.Book(at(t0, d), "k", lim, throttle.Request{N: 1, MaxWait: throttle.Forever})
		require.NoError(t, err)
		require.True(t, b.OK)
		return b
	}
	fill := func(t *testing.T, e *env, t0 int64) []throttle.Booking {
		t.Helper()
		var bs []throttle.Booking
		for i := 0; i < 9; i++ { // 6 at once, then slots at +100, +200, +300ms
			bs = append(bs, book(t, e, t0, 0))
		}
		return bs
	}
	tests := []struct {
		name     string
		cancel   func(bs []throttle.Booking) throttle.Booking
		when     time.Duration
		refunded time.Duration
		nextWait time.Duration // wait of a booking made right after, at `when`
	}{
		{"latest gives its slot back", func(bs []throttle.Booking) throttle.Booking { return bs[8] },
			10 * time.Millisecond, 100 * time.Millisecond, 290 * time.Millisecond},
		{"earlier one: later bookings keep their slots", func(bs []throttle.Booking) throttle.Booking { return bs[7] },
			10 * time.Millisecond, 0, 390 * time.Millisecond},
		{"slot passed", func(bs []throttle.Booking) throttle.Booking { return bs[8] },
			300 * time.Millisecond, 0, 100 * time.Millisecond},
		{"immediate booking", func(bs []throttle.Booking) throttle.Booking { return bs[0] },
			10 * time.Millisecond, 0, 390 * time.Millisecond},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			e := newEnv(t)
			t0 := base()
			bs := fill(t, e, t0)
			got, err := e.eng.Refund(at(t0, tc.when), "k", lim, tc.cancel(bs))
			require.NoError(t, err)
			if got != tc.refunded {
				t.Fatalf("refunded %v, want %v", got, tc.refunded)
			}
			if b := book(t, e, t0, tc.when); b.Wait != tc.nextWait {
				t.Fatalf("next booking waits %v, want %v", b.Wait, tc.nextWait)
			}
		})
	}
	t.Run("refused booking is a no-op", func(t *testing.T) {
		t.Parallel()
		e := newEnv(t)
		got, err := e.eng.Refund(context.Background(), "k", lim, throttle.Booking{})
		require.NoError(t, err)
		require.Zero(t, got)
		require.Zero(t, e.calls.Load())
	})
}

// TestStoredState checks the one-integer-per-key claim on a real server:
// the value is TAT in microseconds, int-encoded, with an expiry at TAT.
func TestStoredState(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	e.srv.RequireReal(t)
	ctx := context.Background()
	lim := throttle.PerSecond(10, 0)
	b, err := e.eng.Book(ctx, "k", lim, throttle.Request{N: 1, MaxWait: 0})
	require.NoError(t, err)
	require.True(t, b.OK)
	key := e.prefix + "k"
	val, err := e.rdb.Get(ctx, key).Result()
	require.NoError(t, err)
	tat, err := strconv.ParseInt(val, 10, 64)
	require.NoError(t, err, "value %q is not an integer", val)
	if now := time.Now().UnixMicro(); tat < now || tat > now+100_000+50_000 {
		t.Fatalf("TAT %d not about 100ms after now %d", tat, now)
	}
	enc, err := e.rdb.ObjectEncoding(ctx, key).Result()
	require.NoError(t, err)
	require.Equal(t, "int", enc)
	pttl, err := e.rdb.PTTL(ctx, key).Result()
	require.NoError(t, err)
	if pttl <= 0 || pttl > 102*time.Millisecond {
		t.Fatalf("PTTL %v, want in (0, 102ms]", pttl)
	}
	require.Eventually(t, func() bool { return e.rdb.Exists(ctx, key).Val() == 0 },
		2*time.Second, 10*time.Millisecond, "key should be gone once idle")
}

func TestCorruptValueIsAnError(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	ctx := context.Background()
	// A booking far ahead, so that its refund below has something to give.
	_, err := e.eng.Book(ctx, "k", throttle.PerHour(1, 0), throttle.Request{N: 1, MaxWait: throttle.Forever})
	require.NoError(t, err)
	b, err := e.eng.Book(ctx, "k", throttle.PerHour(1, 0), throttle.Request{N: 1, MaxWait: throttle.Forever})
	require.NoError(t, err)
	require.NoError(t, e.rdb.Set(ctx, e.prefix+"k", "not a number", 0).Err())
	// Every script that reads a TAT says so, naming the key: book1.lua,
	// book.lua, block.lua, refund.lua.
	notTAT := func(err error) {
		t.Helper()
		require.ErrorIs(t, err, throttle.ErrCorruptState)
		require.ErrorContains(t, err, "key "+e.prefix+"k holds \"not a number\", not a TAT")
		require.NotContains(t, err.Error(), "script:")
	}
	_, err = e.eng.Allow(ctx, "k", tenPerSecond)
	notTAT(err)
	_, err = e.eng.BookBatch(ctx, "k", tenPerSecond, []throttle.Request{{N: 1}, {N: 1}})
	notTAT(err)
	err = e.eng.Block(ctx, "k", tenPerSecond, time.Second)
	notTAT(err)
	_, err = e.eng.Refund(ctx, "k", throttle.PerHour(1, 0), b)
	notTAT(err)
	val, err := e.rdb.Get(ctx, e.prefix+"k").Result()
	require.NoError(t, err)
	require.Equal(t, "not a number", val, "no script wrote over it")
	require.NoError(t, e.rdb.Set(ctx, e.prefix+"k", 12, 0).Err()) // a hash would be WRONGTYPE
	require.NoError(t, e.rdb.Del(ctx, e.prefix+"k").Err())
	require.NoError(t, e.rdb.HSet(ctx, e.prefix+"k", "a", 1).Err())
	_, err = e.eng.Allow(ctx, "k", tenPerSecond)
	require.ErrorContains(t, err, "WRONGTYPE")
}

// TestAbsurdStoredValues: a value that parses as a number but is no TAT
// the engine could have written is an error naming the key (never a
// permanent denial with RetryAfter 0, a hot spin for retry loops), nothing
// is written over it, and Reset clears it.
func TestAbsurdStoredValues(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	ctx := context.Background()
	ahead := func(d time.Duration) string { return strconv.FormatInt(time.Now().Add(d).UnixMicro(), 10) }
	for _, v := range []string{"99999999999999999999", "9007199254740993", "1e30", "inf", "-inf", "nan", "1.5", "-5", " 12", "0x10", "",
		ahead(throttle.MaxHorizon + time.Hour)} {
		t.Run(strconv.Quote(v), func(t *testing.T) {
			key := "k" + strconv.Quote(v)
			require.NoError(t, e.rdb.Set(ctx, e.prefix+key, v, 0).Err())
			_, err := e.eng.Allow(ctx, key, tenPerSecond)
			require.ErrorIs(t, err, throttle.ErrCorruptState)
			require.ErrorContains(t, err, e.prefix+key)
			_, err = e.eng.BookBatch(ctx, key, tenPerSecond, []throttle.Request{{N: 1, MaxWait: throttle.Forever}, {N: 1}})
			require.ErrorIs(t, err, throttle.ErrCorruptState)
			require.ErrorIs(t, e.eng.Block(ctx, key, tenPerSecond, time.Second), throttle.ErrCorruptState)
			got, err := e.rdb.Get(ctx, e.prefix+key).Result()
			require.NoError(t, err)
			require.Equal(t, v, got, "nothing written over it")

			require.NoError(t, e.eng.Reset(ctx, key))
			r, err := e.eng.Allow(ctx, key, tenPerSecond)
			require.NoError(t, err)
			require.True(t, r.Allowed, "a reset subject is idle")
		})
	}
	// A TAT within the horizon is a (long) wait, not an error.
	require.NoError(t, e.rdb.Set(ctx, e.prefix+"far", ahead(throttle.MaxHorizon-time.Hour), 0).Err())
	r, err := e.eng.Allow(ctx, "far", throttle.PerDay(1, 0))
	require.NoError(t, err)
	require.False(t, r.Allowed)
	require.Greater(t, r.RetryAfter, throttle.MaxHorizon-2*time.Hour)
	require.ErrorIs(t, e.eng.Reset(ctx), throttle.ErrInvalidRequest)
	require.ErrorIs(t, e.eng.Reset(ctx, "{a}", "{b}"), throttle.ErrInvalidRequest)
}

func TestBadInput(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	ok := tenPerSecond
	long := strings.Repeat("x", throttle.MaxKeyLen+1)
	tests := []struct {
		name  string
		key   string
		limit throttle.Limit
		reqs  []throttle.Request
		want  error
	}{
		{"zero rate", "k", throttle.PerSecond(0, 5), []throttle.Request{{N: 1}}, throttle.ErrInvalidLimit},
		{"negative rate", "k", throttle.PerSecond(-3, 5), []throttle.Request{{N: 1}}, throttle.ErrInvalidLimit},
		{"zero period", "k", throttle.Every(0, 10, 5), []throttle.Request{{N: 1}}, throttle.ErrInvalidLimit},
		{"negative period", "k", throttle.Every(-time.Second, 10, 5), []throttle.Request{{N: 1}}, throttle.ErrInvalidLimit},
		{"negative burst", "k", throttle.PerSecond(10, -1), []throttle.Request{{N: 1}}, throttle.ErrInvalidLimit},
		{"n zero", "k", ok, []throttle.Request{{N: 0}}, throttle.ErrInvalidRequest},
		{"n negative", "k", ok, []throttle.Request{{N: -1}}, throttle.ErrInvalidRequest},
		{"n above burst+1", "k", ok, []throttle.Request{{N: 7}}, throttle.ErrExceedsBurst},
		{"bad one late in a batch", "k", ok, []throttle.Request{{N: 1}, {N: 7}}, throttle.ErrExceedsBurst},
		{"empty key", "", ok, []throttle.Request{{N: 1}}, throttle.ErrInvalidRequest},
		{"key too long", long, ok, []throttle.Request{{N: 1}}, throttle.ErrInvalidRequest},
		{"negative max wait", "k", ok, []throttle.Request{{N: 1, MaxWait: -time.Nanosecond}}, throttle.ErrInvalidRequest},
		{"empty batch", "k", ok, nil, throttle.ErrInvalidRequest},
		{"batch too large", "k", ok, make([]throttle.Request, throttle.MaxBatch+1), throttle.ErrInvalidRequest},
	}
	ctx := context.Background()
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			before := e.calls.Load()
			_, err := e.eng.BookBatch(ctx, tc.key, tc.limit, tc.reqs)
			if !errors.Is(err, tc.want) {
				t.Fatalf("BookBatch: err = %v, want %v", err, tc.want)
			}
			if len(tc.reqs) == 1 && tc.reqs[0].MaxWait == 0 {
				_, err = e.eng.AllowN(ctx, tc.key, tc.limit, tc.reqs[0].N)
				if !errors.Is(err, tc.want) {
					t.Fatalf("AllowN: err = %v, want %v", err, tc.want)
				}
			}
			if got := e.calls.Load() - before; got != 0 {
				t.Fatalf("%d Redis calls made for bad input, want 0", got)
			}
		})
	}
	keys, err := e.rdb.Keys(ctx, e.prefix+"*").Result()
	require.NoError(t, err)
	require.Empty(t, keys, "bad input must book nothing")

	t.Run("nil client", func(t *testing.T) {
		if _, err := throttle.New(nil); err == nil {
			t.Fatal("New(nil) succeeded")
		}
	})
	t.Run("client without context timeouts", func(t *testing.T) {
		plain := redis.NewClient(&redis.Options{Addr: e.srv.Addr})
		defer plain.Close()
		_, err := throttle.New(plain)
		require.ErrorContains(t, err, "ContextTimeoutEnabled")
		_, err = throttle.New(plain, throttle.WithTimeout(0))
		require.NoError(t, err, "no engine timeout, no requirement")
	})
	t.Run("negative timeout", func(t *testing.T) {
		if _, err := throttle.New(e.rdb, throttle.WithTimeout(-time.Second)); err == nil {
			t.Fatal("New with a negative timeout succeeded")
		}
	})
}

func TestLoadSendsScripts(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	ctx := context.Background()
	require.NoError(t, e.eng.Load(ctx))
	before := e.calls.Load()
	_, err := e.eng.Allow(ctx, "k", tenPerSecond)
	require.NoError(t, err)
	require.Equal(t, int64(1), e.calls.Load()-before, "one call per decision once loaded")
}

// TestLoadSendsBookRetryScript: after Load on a server whose script cache
// is empty, BookRetry (asynqadapter's booked retries) is one call, as every
// other booking is: Load sends its script too.
func TestLoadSendsBookRetryScript(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t) // its own script cache
	rdb := srv.Client(t)
	calls := callcount.Attach(rdb)
	eng, err := throttle.New(rdb, throttle.WithPrefix(redistest.Prefix(t)), throttle.WithTimeout(5*time.Second))
	require.NoError(t, err)
	ctx := context.Background()
	require.NoError(t, eng.Load(ctx))
	before := calls.Load()
	rb, err := eng.BookRetry(ctx, []string{"r:{k}"}, []throttle.Limit{tenPerSecond}, throttle.Request{N: 1, MaxWait: time.Minute},
		throttle.RetryIndex{Key: "r:{k}:asynq", Member: "a", KeepFrom: time.Second, Window: time.Second, MaxDue: 10})
	require.NoError(t, err)
	require.True(t, rb.OK)
	require.Equal(t, int64(1), calls.Load()-before, "one call once loaded, no NOSCRIPT round trip")
}
