package reserve_test

import (
	"context"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/slotbook/slotbook/internal/testhook"
	"github.com/slotbook/slotbook/reserve"
	"github.com/slotbook/slotbook/throttle"
)

// TestCoalescingBooksEveryCaller: 64 goroutines reserving at one frozen
// instant must get exactly the waits one-by-one booking would give (burst+1
// zeros, then one interval apart), in fewer Redis calls than reservations.
func TestCoalescingBooksEveryCaller(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	// I = 100ms: long enough that the key cannot expire in real time while
	// the explicit clock stands still.
	limit := throttle.PerSecond(10, 9)
	l := e.limiter(t, limit)
	ctx := testhook.WithNow(context.Background(), time.Now().UnixMicro())
	require.NoError(t, e.eng.Load(ctx))

	const goroutines, each = 64, 20
	var (
		mu    sync.Mutex // guards waits
		waits []time.Duration
		wg    sync.WaitGroup
	)
	before := e.calls.Load()
	// All start together: on a busy machine the first goroutines could
	// otherwise make their calls before the last exist, each alone.
	start := make(chan struct{})
	for g := 0; g < goroutines; g++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			<-start
			for i := 0; i < each; i++ {
				r, err := l.Reserve(ctx, "k")
				if err != nil || !r.OK() {
					t.Errorf("Reserve: %v, %v", r, err)
					return
				}
				mu.Lock()
				waits = append(waits, r.Booking().Wait)
				mu.Unlock()
			}
		}()
	}
	close(start)
	wg.Wait()
	calls := e.calls.Load() - before
	slices.Sort(waits)
	for i, w := range waits {
		want := time.Duration(max(0, i-limit.Burst)) * 100 * time.Millisecond
		if w != want {
			t.Fatalf("wait %d = %v, want %v", i, w, want)
		}
	}
	t.Logf("%d reservations in %d Redis calls", len(waits), calls)
	require.LessOrEqual(t, float64(calls)/float64(len(waits)), 0.3, "coalesced calls per reservation")
}

// gate blocks script calls while armed, one at a time, so tests can hold a
// call in flight: before it is sent, or (newAfterGate) once Redis has
// answered it, so that a test can end a caller's context after its request
// took effect.
type gate struct {
	armed   atomic.Bool
	after   bool
	entered chan struct{}
	release chan struct{}
}

func newGate(rdb *redis.Client) *gate {
	g := &gate{entered: make(chan struct{}, 16), release: make(chan struct{})}
	rdb.AddHook(g)
	return g
}

func newAfterGate(rdb *redis.Client) *gate {
	g := &gate{after: true, entered: make(chan struct{}, 16), release: make(chan struct{})}
	rdb.AddHook(g)
	return g
}

func (g *gate) DialHook(next redis.DialHook) redis.DialHook { return next }
func (g *gate) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}
func (g *gate) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		if g.after {
			err := next(ctx, cmd)
			g.hold(cmd)
			return err
		}
		g.hold(cmd)
		return next(ctx, cmd)
	}
}

func (g *gate) hold(cmd redis.Cmder) {
	if g.armed.Load() && (cmd.Name() == "evalsha" || cmd.Name() == "eval") {
		g.entered <- struct{}{}
		<-g.release
	}
}

// reserved is the outcome of one Reserve.
type reserved struct {
	r   *reserve.Reservation
	err error
}

// reserveAsync reserves key "k" of l under ctx on a goroutine of its own.
func reserveAsync(ctx context.Context, l *reserve.Limiter) chan reserved {
	ch := make(chan reserved, 1)
	go func() { r, err := l.Reserve(ctx, "k"); ch <- reserved{r, err} }()
	return ch
}

// TestCoalescingCancelledWhileQueued: a caller cancelled before its batch
// is sent leaves the queue and books nothing; the others are unaffected.
func TestCoalescingCancelledWhileQueued(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	g := newGate(e.rdb)
	// One a minute: the key outlives the test in real time whatever the
	// explicit clock says.
	l := e.limiter(t, throttle.PerMinute(1, 0))
	reserve.SetSoloBelow(l, 1) // b and c queue behind a's call
	base := testhook.WithNow(context.Background(), time.Now().UnixMicro())
	require.NoError(t, e.eng.Load(base))
	g.armed.Store(true)

	a := reserveAsync(base, l)
	<-g.entered // a is in flight
	bctx, cancelB := context.WithCancel(base)
	b := reserveAsync(bctx, l)
	c := reserveAsync(base, l)
	time.Sleep(50 * time.Millisecond) // let b and c queue
	cancelB()
	rb := <-b
	require.ErrorIs(t, rb.err, context.Canceled)

	g.release <- struct{}{} // a's call returns; c's batch is sent
	<-g.entered
	g.armed.Store(false)
	g.release <- struct{}{}
	ra, rc := <-a, <-c
	require.NoError(t, ra.err)
	require.NoError(t, rc.err)
	require.Equal(t, time.Duration(0), ra.r.Booking().Wait)
	require.Equal(t, time.Minute, rc.r.Booking().Wait, "b booked nothing, so c comes right after a")
}

// TestCoalescingCancelledInFlight: a caller cancelled while its batch is in
// flight returns its context's error and gives its slot back.
func TestCoalescingCancelledInFlight(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	g := newGate(e.rdb)
	l := e.limiter(t, throttle.PerMinute(1, 0))
	reserve.SetSoloBelow(l, 1) // b and c queue behind a's call
	base := testhook.WithNow(context.Background(), time.Now().UnixMicro())
	require.NoError(t, e.eng.Load(base))
	g.armed.Store(true)

	errs := make(chan error, 2)
	go func() { _, err := l.Reserve(base, "k"); errs <- err }()
	<-g.entered // first call in flight
	bctx, cancelB := context.WithCancel(base)
	go func() { _, err := l.Reserve(bctx, "k"); errs <- err }()
	time.Sleep(50 * time.Millisecond) // b queues
	g.release <- struct{}{}           // first returns; b's batch is sent...
	<-g.entered                       // ...and held in flight
	cancelB()
	g.armed.Store(false)
	g.release <- struct{}{}
	got := []error{<-errs, <-errs}
	require.Contains(t, got, nil)
	require.Contains(t, got, context.Canceled)

	r, err := l.Reserve(base, "k")
	require.NoError(t, err)
	require.Equal(t, time.Minute, r.Booking().Wait, "b's slot was given back")
}

// TestCoalescingFewCallersSendAlone: while a call is in flight for a key,
// a caller that finds fewer than four callers of the key sends its request
// at once, alone, rather than waiting a round trip behind the call in
// flight; the fifth queues, and its batch goes when a call returns.
func TestCoalescingFewCallersSendAlone(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	g := newGate(e.rdb)
	l := e.limiter(t, throttle.PerSecond(1000, 100))
	ctx := context.Background()
	require.NoError(t, e.eng.Load(ctx))
	g.armed.Store(true)
	errs := make(chan error, 5)
	reserveOne := func() { _, err := l.Reserve(ctx, "k"); errs <- err }
	go reserveOne()
	<-g.entered // the first call in flight
	for i := 0; i < 3; i++ {
		go reserveOne()
		select {
		case <-g.entered: // sent alone, beside the first
		case <-time.After(5 * time.Second):
			t.Fatalf("caller %d of 4 did not send its own call while the first was in flight (queued: %d)", i+2, reserve.QueueLen(l, "k"))
		}
	}
	go reserveOne()
	require.Eventually(t, func() bool { return reserve.QueueLen(l, "k") == 1 }, 5*time.Second, time.Millisecond, "the fifth queues")
	g.armed.Store(false)
	close(g.release)
	for i := 0; i < 5; i++ {
		require.NoError(t, <-errs)
	}
	require.Zero(t, reserve.QueueLen(l, "k"))
}

// TestCoalescingQueueBounded: past the queue bound, callers make calls of
// their own instead of queueing, so memory stays bounded. Five calls are
// held in flight at once: the engine lets that many fly before it merges.
func TestCoalescingQueueBounded(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	var err error
	e.eng, err = throttle.New(e.rdb, throttle.WithPrefix(e.prefix), throttle.WithTimeout(5*time.Second), throttle.WithMergeAt(5))
	require.NoError(t, err)
	g := newGate(e.rdb)
	l := e.limiter(t, throttle.PerSecond(1000, 100))
	reserve.SetMaxQueue(l, 2)
	reserve.SetSoloBelow(l, 1)
	ctx := context.Background()
	require.NoError(t, e.eng.Load(ctx))
	g.armed.Store(true)
	errs := make(chan error, 7)
	reserveOne := func() { _, err := l.Reserve(ctx, "k"); errs <- err }
	go reserveOne()
	<-g.entered // the first call in flight
	for i := 0; i < 6; i++ {
		go reserveOne()
	}
	for i := 0; i < 4; i++ {
		<-g.entered // four callers past the bound, in flight on their own
	}
	require.Equal(t, 2, reserve.QueueLen(l, "k"), "two queued")
	g.armed.Store(false)
	close(g.release)
	for i := 0; i < 7; i++ {
		require.NoError(t, <-errs)
	}
}

// panicky is an Observer that panics on its first decision once armed.
type panicky struct {
	armed atomic.Bool
}

func (o *panicky) ObserveDecision(string, throttle.Outcome, time.Duration) {
	if o.armed.CompareAndSwap(true, false) {
		panic("observer bug")
	}
}
func (o *panicky) ObserveCall(string, time.Duration, error) {}
func (o *panicky) ObserveRefund(string, time.Duration)      {}
func (o *panicky) ObserveBreaker(bool)                      {}

// panickyLimiter returns a limiter of 1000/s burst 100 on e, whose
// engine's Observer is the panicky one it returns, its scripts loaded.
func panickyLimiter(t *testing.T, e *env, opts ...reserve.Option) (*reserve.Limiter, *panicky) {
	t.Helper()
	obs := &panicky{}
	eng, err := throttle.New(e.rdb, throttle.WithPrefix(e.prefix), throttle.WithTimeout(5*time.Second), throttle.WithObserver(obs))
	require.NoError(t, err)
	require.NoError(t, eng.Load(context.Background()))
	l, err := reserve.New(eng, "api", throttle.PerSecond(1000, 100), opts...)
	require.NoError(t, err)
	return l, obs
}

// TestCoalescingObserverPanic: an Observer that panics while a coalesced
// call is in flight panics on its sender's stack, and the key is not left
// marked busy: the callers queued behind it are served, and so is the next
// caller.
func TestCoalescingObserverPanic(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	g := newGate(e.rdb)
	l, obs := panickyLimiter(t, e)
	reserve.SetSoloBelow(l, 1)
	ctx := context.Background()

	type result struct {
		r        *reserve.Reservation
		err      error
		panicked any
	}
	reserveAsync := func() chan result {
		ch := make(chan result, 1)
		go func() {
			var res result
			defer func() { res.panicked = recover(); ch <- res }()
			res.r, res.err = l.Reserve(ctx, "k")
		}()
		return ch
	}
	g.armed.Store(true)
	a := reserveAsync()
	<-g.entered // a is in flight
	b, c := reserveAsync(), reserveAsync()
	require.Eventually(t, func() bool { return reserve.QueueLen(l, "k") == 2 }, 5*time.Second, time.Millisecond)
	obs.armed.Store(true)
	g.armed.Store(false)
	g.release <- struct{}{}

	wait := func(ch chan result, who string) result {
		t.Helper()
		select {
		case r := <-ch:
			return r
		case <-time.After(10 * time.Second):
			t.Fatalf("%s never returned: the key is wedged", who)
			return result{}
		}
	}
	ra := wait(a, "the sender")
	require.Equal(t, "observer bug", ra.panicked, "the panic goes on up the sender's stack")
	for _, r := range []result{wait(b, "a queued caller"), wait(c, "a queued caller")} {
		require.Nil(t, r.panicked)
		require.NoError(t, r.err)
		require.True(t, r.r.OK())
	}
	r := wait(reserveAsync(), "the next caller")
	require.NoError(t, r.err)
	require.True(t, r.r.OK())
}

// TestCoalescingStateGoesWithItsCallers: once every caller is gone (booked,
// refused, cancelled while queued or in flight, sent alone), the Limiter
// holds no coalescing state for any key, and its store of states for reuse
// stays bounded: state lives only while a key has callers, whatever the
// number of keys.
func TestCoalescingStateGoesWithItsCallers(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	l := e.limiter(t, throttle.PerSecond(1000, 10), reserve.WithMaxWait(20*time.Millisecond))
	require.NoError(t, e.eng.Load(context.Background()))
	reserve.SetSoloBelow(l, 1) // callers queue behind any call in flight
	var wg sync.WaitGroup
	var booked, refused, ended atomic.Int64
	for g := 0; g < 64; g++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; i < 60; i++ {
				// Some callers give up at once, some while queued or in
				// flight; keys shared by a few goroutines at a time, and
				// more keys than a Limiter keeps spare states.
				ctx, cancel := context.WithTimeout(context.Background(), time.Duration(i%4)*3*time.Millisecond+time.Microsecond)
				key := strconv.Itoa((g*60 + i) % 400 / 3)
				if i%2 == 0 {
					key = strconv.Itoa(g % 8)
				}
				r, err := l.Reserve(ctx, key)
				switch {
				case err != nil:
					ended.Add(1)
				case r.OK():
					booked.Add(1)
				default:
					refused.Add(1)
				}
				cancel()
			}
		}()
	}
	wg.Wait()
	t.Logf("booked %d, refused %d, ended %d", booked.Load(), refused.Load(), ended.Load())
	require.Positive(t, booked.Load())
	require.Positive(t, ended.Load())
	live, spare := reserve.KeyStates(l)
	require.Zero(t, live, "keys holding coalescing state with no caller left")
	require.LessOrEqual(t, spare, 256)
}

// TestCoalescingGoexitHandsOn: the sender of a key's call whose Observer
// ends its goroutine (runtime.Goexit, as t.FailNow in an Observer does:
// there is no panic to recover) still hands the key on: the caller queued
// behind that call leads the next one and is served, and no state is left.
func TestCoalescingGoexitHandsOn(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	obs := &ksGoexit{}
	l := ksObserved(t, e, obs)
	reserve.SetSoloBelow(l, 1) // the second caller queues behind the first's call

	g := newGate(e.rdb)
	g.armed.Store(true)
	first := make(chan struct{})
	go func() {
		defer close(first)
		_, _ = l.Reserve(context.Background(), "k") // its goroutine ends in the Observer
	}()
	<-g.entered
	g.armed.Store(false)
	second := make(chan error, 1)
	go func() { _, err := l.Reserve(context.Background(), "k"); second <- err }()
	require.Eventually(t, func() bool { return reserve.QueueLen(l, "k") == 1 }, 5*time.Second, time.Millisecond)
	obs.armed.Store(true)
	close(g.release)
	<-first
	require.False(t, obs.armed.Load(), "the Observer did not end the first booking's goroutine")
	select {
	case err := <-second:
		require.NoError(t, err)
	case <-time.After(10 * time.Second): // the engine's timeout is 5s; a stalled key never answers
		t.Fatal("the caller queued behind a call whose sender's goroutine ended was never served: the key stalled")
	}
	live, _ := reserve.KeyStates(l)
	require.Zero(t, live)
}
