package reserve_test

import (
	"context"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/slotbook/slotbook/internal/redistest"
	"github.com/slotbook/slotbook/internal/testhook"
	"github.com/slotbook/slotbook/reserve"
	"github.com/slotbook/slotbook/throttle"
)

// warmProxied is proxiedEngine with at least n connections open in its
// client's pool: n overlapping calls, each slowed by the proxy.
func warmProxied(t *testing.T, n int) (*throttle.Engine, *redistest.Proxy) {
	t.Helper()
	eng, p, _ := proxiedEngine(t, 0, throttle.WithTimeout(5*time.Second))
	rdb := eng.Client().(*redis.Client)
	p.SetReplyDelay(30 * time.Millisecond)
	var wg sync.WaitGroup
	for i := 0; i < n; i++ {
		wg.Add(1)
		go func() { defer wg.Done(); _ = rdb.Ping(context.Background()).Err() }()
	}
	wg.Wait()
	p.SetReplyDelay(0)
	return eng, p
}

// TestCoalescingSoloCancelledInFlight: a caller sent alone beside the call
// in flight, cancelled once Redis has booked its slot, gets its context's
// error and its slot back, as a batch's caller does
// (TestCoalescingCancelledInFlight).
func TestCoalescingSoloCancelledInFlight(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	g := newAfterGate(e.rdb)
	l := e.limiter(t, throttle.PerMinute(1, 0))
	base := testhook.WithNow(context.Background(), time.Now().UnixMicro())
	require.NoError(t, e.eng.Load(base))
	g.armed.Store(true)

	a := reserveAsync(base, l)
	<-g.entered // a booked now, its answer held
	bctx, cancelB := context.WithCancel(base)
	b := reserveAsync(bctx, l)
	<-g.entered // b, sent alone, booked a minute on, its answer held
	cancelB()
	g.armed.Store(false)
	close(g.release)
	ra, rb := <-a, <-b
	require.NoError(t, ra.err)
	require.ErrorIs(t, rb.err, context.Canceled, "b's outcome: %v", rb.r)

	r, err := l.Reserve(base, "k")
	require.NoError(t, err)
	require.Equal(t, time.Minute, r.Booking().Wait, "b's slot was given back")
}

// TestCoalescingMixMatchesGCRA: 5 or 24 goroutines on one key, through 40ms of latency
// each way, at one frozen instant, with requests of 1 or 2 units and three
// max waits (none, 0, 300ms), so solo calls and batches mix. Every booked
// slot must be where a textbook GCRA puts it after the units booked before
// it, every refusal's retry-after must be the textbook wait at some point
// of that sequence (and past its max wait), and the next caller's slot must
// follow the units booked, so refusals booked nothing.
func TestCoalescingMixMatchesGCRA(t *testing.T) {
	t.Parallel()
	for _, goroutines := range []int{5, 24} {
		t.Run(strconv.Itoa(goroutines), func(t *testing.T) { mixGCRA(t, goroutines) })
	}
}

func mixGCRA(t *testing.T, goroutines int) {
	eng, p := warmProxied(t, goroutines)
	const (
		interval = 10 * time.Millisecond
		burst    = 4
	)
	limit := throttle.PerSecond(100, burst)
	l, err := reserve.New(eng, "api", limit)
	require.NoError(t, err)
	views := []struct {
		l   *reserve.Limiter
		cap time.Duration // -1: none
	}{{l, -1}}
	for _, mw := range []time.Duration{0, 300 * time.Millisecond} {
		v, err := l.With(reserve.WithMaxWait(mw))
		require.NoError(t, err)
		views = append(views, struct {
			l   *reserve.Limiter
			cap time.Duration
		}{v, mw})
	}
	now := time.UnixMicro(time.Now().UnixMicro()) // Redis's clock has microseconds
	base := testhook.WithNow(context.Background(), now.UnixMicro())
	p.SetLatency(40 * time.Millisecond)

	type rec struct {
		n     int
		cap   time.Duration
		ok    bool
		at    time.Time
		retry time.Duration
	}
	var (
		mu   sync.Mutex
		recs []rec
		wg   sync.WaitGroup
	)
	for g := 0; g < goroutines; g++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; i < 8; i++ {
				v := views[(g+i)%len(views)]
				n := 1 + (g*7+i)%2
				r, err := v.l.ReserveN(base, "k", n)
				if err != nil {
					t.Errorf("ReserveN: %v", err)
					return
				}
				mu.Lock()
				recs = append(recs, rec{n: n, cap: v.cap, ok: r.OK(), at: r.Booking().At, retry: r.RetryAfter()})
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
	p.SetLatency(0)

	// Textbook GCRA at the frozen instant: after k units, the slot of the
	// next n is max(0, (k+n-1)*T - tau).
	tau := burst * interval
	slot := func(k, n int) time.Duration { return max(0, time.Duration(k+n-1)*interval-tau) }
	var booked []rec
	refused := 0
	for _, r := range recs {
		if r.ok {
			booked = append(booked, r)
		} else {
			refused++
		}
	}
	// Sort booked by slot (Redis clock); ties only at slot 0.
	for i := range booked {
		for j := i + 1; j < len(booked); j++ {
			if booked[j].at.Before(booked[i].at) || (booked[j].at.Equal(booked[i].at) && booked[j].n < booked[i].n) {
				booked[i], booked[j] = booked[j], booked[i]
			}
		}
	}
	k := 0
	prefix := map[int]bool{0: true}
	for i, b := range booked {
		want := slot(k, b.n)
		got := b.at.Sub(now)
		if got != want && !(want == 0 && got == 0) {
			t.Fatalf("booking %d of %d units: slot %v, textbook %v after %d units", i, b.n, got, want, k)
		}
		k += b.n
		prefix[k] = true
		if got == 0 { // ties at slot 0 came in some order: any count up to k
			for c := 0; c <= k; c++ {
				prefix[c] = true
			}
		}
	}
	for _, r := range recs {
		if r.ok {
			continue
		}
		if r.cap >= 0 && r.retry <= r.cap {
			t.Errorf("refused with retry-after %v within max wait %v", r.retry, r.cap)
		}
		found := false
		for c := range prefix {
			if slot(c, r.n) == r.retry {
				found = true
			}
		}
		if !found {
			t.Errorf("refusal of %d units with retry-after %v: no textbook wait at any prefix", r.n, r.retry)
		}
	}
	next, err := l.Reserve(base, "k")
	require.NoError(t, err)
	require.Equal(t, slot(k, 1), next.Booking().Wait, "the next slot follows the %d units booked (%d refusals booked nothing)", k, refused)
	t.Logf("%d requests: %d booked (%d units), %d refused", len(recs), len(booked), k, refused)
}

// TestCoalescingCallerCountNotLeaked: after callers of a key panicked (an
// Observer's panic in a solo or a batch call), were cancelled in flight or
// queued, and were refused, the key behaves as a fresh one: with one call
// in flight, three more callers send their own calls at once and a fifth
// queues, and every caller returns.
func TestCoalescingCallerCountNotLeaked(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	g := newGate(e.rdb)
	l, obs := panickyLimiter(t, e, reserve.WithMaxWait(0))
	ctx := context.Background()

	done := make(chan any, 64)
	start := func(ctx context.Context) {
		go func() {
			defer func() { done <- recover() }()
			_, _ = l.Reserve(ctx, "k")
		}()
	}
	for round := 0; round < 6; round++ {
		g.armed.Store(true)
		start(ctx)
		<-g.entered // the leader in flight
		cctx, cancel := context.WithCancel(ctx)
		for i := 0; i < 3; i++ { // three solo calls in flight
			start(cctx)
			<-g.entered
		}
		for i := 0; i < 3; i++ { // three queue, one of them to be cancelled
			if i == 1 {
				start(cctx)
			} else {
				start(ctx)
			}
		}
		require.Eventually(t, func() bool { return reserve.QueueLen(l, "k") == 3 }, 5*time.Second, time.Millisecond)
		cancel()
		obs.armed.Store(true) // the first decision reported panics
		g.release <- struct{}{}
		if round%2 == 1 {
			g.release <- struct{}{}
		}
		g.armed.Store(false)
		close(g.release)
		panics := 0
		for i := 0; i < 7; i++ {
			select {
			case p := <-done:
				if p != nil {
					panics++
				}
			case <-time.After(10 * time.Second):
				t.Fatalf("round %d: caller %d never returned", round, i)
			}
		}
		require.Equal(t, 1, panics, "round %d: the Observer's panic reached one caller", round)
		g.release = make(chan struct{})
		for len(g.entered) > 0 {
			<-g.entered
		}
		require.Zero(t, reserve.QueueLen(l, "k"))
	}

	// The key is fresh: 1 in flight + 3 solo, the fifth queues.
	g.armed.Store(true)
	start(ctx)
	<-g.entered
	for i := 0; i < 3; i++ {
		start(ctx)
		select {
		case <-g.entered:
		case <-time.After(5 * time.Second):
			t.Fatalf("caller %d of 4 queued (queued: %d): the count of callers leaked", i+2, reserve.QueueLen(l, "k"))
		}
	}
	start(ctx)
	require.Eventually(t, func() bool { return reserve.QueueLen(l, "k") == 1 }, 5*time.Second, time.Millisecond, "the fifth queues")
	g.armed.Store(false)
	close(g.release)
	for i := 0; i < 5; i++ {
		<-done
	}
}
