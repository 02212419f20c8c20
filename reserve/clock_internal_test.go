package reserve

import (
	"context"
	"errors"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/slotbook/slotbook/internal/redistest"
	"github.com/slotbook/slotbook/internal/testhook"
	"github.com/slotbook/slotbook/throttle"
)

func TestMain(m *testing.M) { redistest.Main(m) }

// fakeClock records sleeps instead of sleeping. With block set, Sleep waits
// for the context instead.
type fakeClock struct {
	mu    sync.Mutex // guards now, slept and tick
	now   time.Time
	slept []time.Duration
	block bool
	tick  time.Duration // added to now after each Now: latency, seen from the caller
}

func (c *fakeClock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	now := c.now
	c.now = c.now.Add(c.tick)
	return now
}

func (c *fakeClock) Sleep(ctx context.Context, d time.Duration) error {
	c.mu.Lock()
	c.slept = append(c.slept, d)
	block := c.block
	c.mu.Unlock()
	if block {
		<-ctx.Done()
		return ctx.Err()
	}
	c.mu.Lock()
	c.now = c.now.Add(d)
	c.mu.Unlock()
	return nil
}

func fakeLimiter(t *testing.T, limit throttle.Limit, opts ...Option) (*Limiter, *fakeClock) {
	t.Helper()
	rdb := redistest.Shared(t).Client(t)
	eng, err := throttle.New(rdb, throttle.WithPrefix(redistest.Prefix(t)), throttle.WithTimeout(5*time.Second))
	require.NoError(t, err)
	l, err := New(eng, "api", limit, opts...)
	require.NoError(t, err)
	fc := &fakeClock{now: time.Unix(1_000_000, 0)}
	l.clock = fc
	return l, fc
}

// TestAcquireSleepsTheBookedWait checks, with no real sleeping, that each
// Acquire sleeps exactly the wait Redis booked for it.
func TestAcquireSleepsTheBookedWait(t *testing.T) {
	t.Parallel()
	l, fc := fakeLimiter(t, throttle.PerSecond(10, 2))
	ctx := testhook.WithNow(context.Background(), time.Now().UnixMicro())
	for i := 0; i < 6; i++ {
		require.NoError(t, l.Acquire(ctx, "k"))
	}
	want := []time.Duration{0, 0, 0, 100 * time.Millisecond, 200 * time.Millisecond, 300 * time.Millisecond}
	require.Equal(t, want, fc.slept)
}

// TestDeadlineJudgedAfterTheReply: a slot that fits the budget when Redis
// decides but lies past the context deadline once the reply has arrived
// (here 40ms of latency, seen on the limiter's clock) is given back at once
// and reported as a refusal with the retry-after the caller saw, never
// handed out; a slot that still fits is handed out.
func TestDeadlineJudgedAfterTheReply(t *testing.T) {
	t.Parallel()
	l, fc := fakeLimiter(t, throttle.PerHour(60, 0)) // a minute apart: real-time deadlines cannot pass during the test
	fc.now = time.Now()
	redisNow := time.Now().UnixMicro()
	at := testhook.WithNow(context.Background(), redisNow)
	r, err := l.Reserve(at, "k") // immediate; the next slot is a minute away
	require.NoError(t, err)
	require.True(t, r.OK())

	fc.mu.Lock()
	fc.tick = 40 * time.Millisecond
	start := fc.now
	fc.mu.Unlock()
	ctx, cancel := context.WithDeadline(at, start.Add(time.Minute+20*time.Millisecond))
	defer cancel()
	r, err = l.Reserve(ctx, "k")
	require.NoError(t, err)
	require.False(t, r.OK(), "a slot 20ms past the deadline once the reply is in must not be handed out")
	require.ErrorIs(t, r.Err(), ErrWouldExceedDeadline)
	require.Equal(t, time.Minute+40*time.Millisecond, r.RetryAfter(), "the wait as the caller saw it")

	fc.mu.Lock()
	fc.tick = 0
	fc.mu.Unlock()
	r, err = l.Reserve(at, "k")
	require.NoError(t, err)
	require.True(t, r.OK())
	require.Equal(t, time.Minute, r.Booking().Wait, "the refused slot was given back")

	fc.mu.Lock()
	fc.tick = 40 * time.Millisecond
	start = fc.now
	fc.mu.Unlock()
	ctx2, cancel2 := context.WithDeadline(at, start.Add(2*time.Minute+50*time.Millisecond))
	defer cancel2()
	r, err = l.Reserve(ctx2, "k")
	require.NoError(t, err)
	require.True(t, r.OK(), "2min + 40ms of latency still fits 2min + 50ms")
	require.Equal(t, 2*time.Minute, r.Booking().Wait)
}

// TestWaitCancelRefunds checks that a context cancelled while sleeping
// returns its error and gives the slot back to the next caller.
func TestWaitCancelRefunds(t *testing.T) {
	t.Parallel()
	l, fc := fakeLimiter(t, throttle.PerMinute(60, 0)) // keys outlive the test in real time
	now := time.Now().UnixMicro()
	at := testhook.WithNow(context.Background(), now)
	require.NoError(t, l.Acquire(at, "k")) // immediate
	fc.block = true
	ctx, cancel := context.WithCancel(at)
	errc := make(chan error)
	go func() { errc <- l.Acquire(ctx, "k") }()
	require.Eventually(t, func() bool { fc.mu.Lock(); defer fc.mu.Unlock(); return len(fc.slept) == 2 },
		5*time.Second, time.Millisecond)
	cancel()
	if err := <-errc; !errors.Is(err, context.Canceled) {
		t.Fatalf("Acquire = %v, want context.Canceled", err)
	}
	r, err := l.Reserve(at, "k")
	require.NoError(t, err)
	require.True(t, r.OK())
	require.Equal(t, time.Second, r.DelayFrom(fc.Now()), "the cancelled slot should be given back")
}

// TestLocalShareKeysBounded: the fallback keeps at most maxKeys local
// limiters, whatever number of subjects pass through it.
func TestLocalShareKeysBounded(t *testing.T) {
	t.Parallel()
	l, _ := fakeLimiter(t, throttle.PerSecond(10, 0), WithFallback(LocalShare(time.Second, 2, 3)))
	l.fallback.mu.Lock()
	defer l.fallback.mu.Unlock()
	for i := 0; i < 100; i++ {
		l.fallback.limiters(string(rune('a'+i%26))+strconv.Itoa(i), l.limits)
	}
	require.LessOrEqual(t, len(l.fallback.local), 3)
	every, size := l.fallback.share(l.limit)
	require.Equal(t, int64(200*time.Millisecond), every, "10/s shared by 2 assumed instances: 5/s")
	require.Equal(t, int64(1), size)
}
