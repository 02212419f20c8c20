package slotbook_test

// End-to-end checks of the published verification list, against a real
// redis-server started by the test helper.

import (
	"context"
	"os"
	"slices"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/slotbook/slotbook/deadline"
	"github.com/slotbook/slotbook/internal/callcount"
	"github.com/slotbook/slotbook/internal/limitcheck"
	"github.com/slotbook/slotbook/internal/redistest"
	"github.com/slotbook/slotbook/internal/testhook"
	"github.com/slotbook/slotbook/internal/timing"
	"github.com/slotbook/slotbook/reserve"
	"github.com/slotbook/slotbook/throttle"
)

func TestMain(m *testing.M) {
	// TestSoak starts this test binary as its worker processes.
	if os.Getenv("SOAK_WORKER") == "1" {
		os.Exit(soakWorker())
	}
	redistest.Main(m)
}

// published is the limit of the published measurements: 10/s, burst 5.
var published = throttle.PerSecond(10, 5)

type env struct {
	srv    *redistest.Server
	rdb    *redis.Client
	calls  *callcount.Counter
	eng    *throttle.Engine
	prefix string
}

func newEnv(t *testing.T) *env {
	t.Helper()
	srv := redistest.Shared(t)
	srv.RequireReal(t)
	rdb := srv.Client(t)
	calls := callcount.Attach(rdb)
	prefix := redistest.Prefix(t)
	// Generous timeout: correctness tests on a possibly busy machine.
	eng, err := throttle.New(rdb, throttle.WithPrefix(prefix), throttle.WithTimeout(5*time.Second))
	require.NoError(t, err)
	require.NoError(t, eng.Load(context.Background()))
	return &env{srv: srv, rdb: rdb, calls: calls, eng: eng, prefix: prefix}
}

func (e *env) limiter(t *testing.T, opts ...reserve.Option) *reserve.Limiter {
	t.Helper()
	l, err := reserve.New(e.eng, "api", published, opts...)
	require.NoError(t, err)
	return l
}

// TestSaturatedExact: after idling, exactly burst+1 pass at once, then one
// per interval: saturated for 3 s, 36 allowed, 7 within the first 100ms.
// The scripts run on an explicit clock, so the counts are exact.
func TestSaturatedExact(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	l := e.limiter(t)
	t0 := time.Now().UnixMicro()
	var allowedAt []time.Duration
	for us := int64(0); us <= 3_000_000; us += 500 {
		ctx := testhook.WithNow(context.Background(), t0+us)
		for {
			r, err := l.Allow(ctx, "subject")
			require.NoError(t, err)
			if !r.Allowed {
				require.Positive(t, r.RetryAfter)
				break
			}
			allowedAt = append(allowedAt, time.Duration(us)*time.Microsecond)
		}
	}
	require.Len(t, allowedAt, 36)
	early := 0
	for _, d := range allowedAt {
		if d <= 100*time.Millisecond {
			early++
		}
	}
	require.Equal(t, 7, early)
	for i := 6; i < len(allowedAt); i++ {
		require.Equal(t, 100*time.Millisecond, allowedAt[i]-allowedAt[i-1], "gap before request %d", i)
	}
}

// TestSaturatedRealTime is the same check on Redis's own clock: a client
// that retries exactly when told, for 3 s. Every call is bracketed by Redis
// TIME read just before and just after it, and the decisions are replayed
// through a textbook GCRA whose clock is known only to lie in those
// brackets: however late a busy machine wakes the client, a decision no
// instant of its bracket explains is a defect, and on a quiet machine the
// brackets are a fraction of a millisecond wide.
func TestSaturatedRealTime(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	l := e.limiter(t)
	ctx := context.Background()
	redisNow := func() time.Time {
		t.Helper()
		now, err := e.rdb.Time(ctx).Result()
		require.NoError(t, err)
		return now
	}
	type call struct {
		lo, hi time.Time // the decision's instant on the Redis clock lies between
		res    throttle.Result
	}
	var calls []call
	start := time.Now()
	for time.Since(start) < 3*time.Second {
		lo := redisNow()
		r, err := l.Allow(ctx, "subject")
		require.NoError(t, err)
		calls = append(calls, call{lo, redisNow(), r})
		if !r.Allowed {
			require.Positive(t, r.RetryAfter)
			time.Sleep(r.RetryAfter)
		}
	}

	allowed, widest := 0, time.Duration(0)
	for i, c := range calls {
		if i < 6 {
			require.True(t, c.res.Allowed, "the burst passes at once: call %d denied", i)
		}
		if i > 0 && !c.res.Allowed && !calls[i-1].res.Allowed {
			t.Fatalf("call %d: denied again after sleeping the RetryAfter %v it was told", i, calls[i-1].res.RetryAfter)
		}
		if c.res.Allowed {
			allowed++
		}
		widest = max(widest, c.hi.Sub(c.lo))
	}
	t.Logf("%d calls, %d allowed in 3 s; widest bracket %v", len(calls), allowed, widest)
	require.Greater(t, allowed, 6, "the client got past the burst")

	// The replay. The TAT (theoretical arrival time, the state GCRA keeps)
	// lies in [tatLo, tatHi]; zero: no state yet (an idle key).
	interval := published.Interval()
	tau := time.Duration(published.Burst) * interval
	var tatLo, tatHi time.Time
	later := func(a, b time.Time) time.Time {
		if a.After(b) {
			return a
		}
		return b
	}
	for i, c := range calls {
		if !c.res.Allowed {
			// Denied at d: RetryAfter is exactly TAT - tau - d.
			tatLo = later(tatLo, c.lo.Add(c.res.RetryAfter+tau))
			if hi := c.hi.Add(c.res.RetryAfter + tau); hi.Before(tatHi) {
				tatHi = hi
			}
			require.False(t, tatLo.After(tatHi),
				"call %d: denied with RetryAfter %v, which no instant of its bracket explains (%v off)", i, c.res.RetryAfter, tatLo.Sub(tatHi))
			continue
		}
		// Allowed at d only if TAT - tau <= d; then TAT = max(TAT, d) + I.
		require.False(t, tatLo.Add(-tau).After(c.hi), "call %d: allowed %v before its slot", i, tatLo.Add(-tau).Sub(c.hi))
		if hi := c.hi.Add(tau); !tatHi.IsZero() && hi.Before(tatHi) {
			tatHi = hi
		}
		tatLo, tatHi = later(tatLo, c.lo).Add(interval), later(tatHi, c.hi).Add(interval)
	}
}

// TestOneKeyPerSubject: each subject is one int-encoded key with a TTL,
// gone once idle. At one a second, three requests put each TAT 3 s ahead:
// the keys outlive the reads below however slow the machine is, and their
// TTL is at most that.
func TestOneKeyPerSubject(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	l, err := reserve.New(e.eng, "api", throttle.PerSecond(1, 5))
	require.NoError(t, err)
	ctx := context.Background()
	for _, s := range []string{"a", "b", "c"} {
		for i := 0; i < 3; i++ {
			require.NoError(t, l.Acquire(ctx, s))
		}
	}
	keys, err := e.rdb.Keys(ctx, e.prefix+"*").Result()
	require.NoError(t, err)
	slices.Sort(keys)
	require.Equal(t, []string{e.prefix + "api:{a}", e.prefix + "api:{b}", e.prefix + "api:{c}"}, keys)
	for _, k := range keys {
		v, err := e.rdb.Get(ctx, k).Result()
		require.NoError(t, err)
		_, err = strconv.ParseInt(v, 10, 64)
		require.NoError(t, err, "value of %s", k)
		require.Equal(t, "int", e.rdb.ObjectEncoding(ctx, k).Val())
		ttl := e.rdb.PTTL(ctx, k).Val()
		require.True(t, ttl > 0 && ttl <= 3001*time.Millisecond, "PTTL of %s = %v", k, ttl)
	}
	require.Eventually(t, func() bool { return e.rdb.Exists(ctx, keys...).Val() == 0 },
		10*time.Second, 20*time.Millisecond, "keys should expire once idle")
}

// TestCompetingAcquire: 20 clients share 10/s burst 5 through Acquire with a
// 2 s max wait for 3 s. At most one script call per request, no refusals,
// starts spaced 100ms apart, each at its booked slot.
func TestCompetingAcquire(t *testing.T) {
	for _, coalesce := range []bool{false, true} {
		t.Run("coalescing="+strconv.FormatBool(coalesce), func(t *testing.T) {
			t.Parallel()
			competingAcquire(t, coalesce)
		})
	}
}

func competingAcquire(t *testing.T, coalesce bool) {
	e := newEnv(t)
	l := e.limiter(t, reserve.WithMaxWait(2*time.Second), reserve.WithCoalescing(coalesce))
	ctx := context.Background()
	const clients, run = 20, 3 * time.Second

	// slot: the local time to act; at: when the client went; booked: the
	// slot on the Redis clock, where the limiter's spacing is exact;
	// called, replied: when its Reserve was called and returned; wait: the
	// booked wait, exact on the Redis clock.
	type start struct {
		slot, at, booked, called, replied time.Time
		wait                              time.Duration
	}
	var (
		mu      sync.Mutex // guards starts and refused
		starts  []start
		refused int
		wg      sync.WaitGroup
	)
	control := timing.Control(t)
	before := e.calls.Load()
	t0 := time.Now()
	for c := 0; c < clients; c++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				called := time.Now()
				r, err := l.Reserve(ctx, "shared")
				replied := time.Now()
				if err != nil {
					t.Error(err)
					return
				}
				if !r.OK() {
					mu.Lock()
					refused++
					mu.Unlock()
					if time.Since(t0) >= run {
						return
					}
					continue
				}
				if err := r.Wait(ctx); err != nil {
					t.Error(err)
					return
				}
				now := time.Now()
				mu.Lock()
				starts = append(starts, start{r.SlotAt(), now, r.Booking().At, called, replied, r.Booking().Wait})
				mu.Unlock()
				// The start, not a later reading, decides whether the
				// client goes on: the count below relies on it.
				if now.Sub(t0) >= run {
					return
				}
			}
		}()
	}
	wg.Wait()
	timerLate := control()
	require.NotEmpty(t, timerLate)
	calls := e.calls.Load() - before

	require.Zero(t, refused, "refusals")
	// Coalesced in the process, or merged by the engine when more than
	// WithMergeAt's bookings are in flight (the first instant's burst).
	require.LessOrEqual(t, calls, int64(len(starts)), "at most one Redis call per request")

	slices.SortFunc(starts, func(a, b start) int { return a.at.Compare(b.at) })
	var late []time.Duration
	for _, s := range starts {
		// The local slot is the booked wait counted from the reply: not
		// earlier than from the call, not later than from its return.
		require.False(t, s.slot.Before(s.called.Add(s.wait)) || s.slot.After(s.replied.Add(s.wait)),
			"local slot %v not the booked wait %v after the call (%v to %v)", s.slot, s.wait, s.called, s.replied)
		require.False(t, s.at.Before(s.slot), "started before its slot")
		late = append(late, s.at.Sub(s.slot))
	}
	// Starts come at their slots, as late as a plain timer fires on this
	// machine right now (the control, measured alongside), not later: an
	// interval late for none, and the median within a tenth of one.
	slices.Sort(late)
	t.Logf("start after its slot: median %v, latest %v; a plain timer alongside: median %v, latest %v",
		late[len(late)/2], late[len(late)-1], timerLate[len(timerLate)/2], timerLate[len(timerLate)-1])
	require.Less(t, late[len(late)/2], timerLate[len(timerLate)/2]+published.Interval()/10, "median start after its slot")
	require.Less(t, late[len(late)-1], timerLate[len(timerLate)-1]+published.Interval(), "latest start after its slot")

	// Spacing is judged on the Redis clock, where it is exact (the local
	// SlotAt of each reservation also carries its reply's latency, which a
	// busy 2-core machine under -race varies by more than 10ms): the slots
	// keep to the limit in every window; and once every client has booked,
	// the queue stays full, so they follow one another exactly one interval
	// apart, none wasted. (The first bookings' slots are the instants each
	// was decided, which a busy machine spreads out: the burst's need not
	// coincide, nor come before the first queued slot.)
	booked := make([]time.Time, len(starts))
	for i, s := range starts {
		booked[i] = s.booked
	}
	require.NoError(t, limitcheck.Windows(booked, published, 0), "slots on the Redis clock")
	slices.SortFunc(booked, func(a, b time.Time) int { return a.Compare(b) })
	for i := clients + 1; i < len(booked); i++ {
		require.Equal(t, published.Interval(), booked[i].Sub(booked[i-1]), "slot gap %d on the Redis clock, with the queue full", i)
	}

	// Requests through: the first bookings, and one more for each start
	// made within the run, which with the queue full (checked above) is
	// every slot the run offered: about 55 (20 + 36 - 1), at most one per
	// slot of the run.
	t.Logf("%d requests through", len(starts))
	require.Greater(t, len(starts), clients+published.Burst+1, "requests through: past the first bookings")
	require.LessOrEqual(t, len(starts), clients+36+1, "requests through: at most one per slot of the run")
}

// TestDeadlineRefusal: a request whose slot would pass its context deadline
// is refused at once (before the deadline: a request that waited for it
// would not be) and leaves the next booking's wait unchanged. The bookings
// run on an explicit clock, so the slot is exactly 2 s away however long
// they take; the deadline, 1.5 s away, is set just before the request.
func TestDeadlineRefusal(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	l := e.limiter(t)
	at := testhook.WithNow(context.Background(), time.Now().UnixMicro())
	for i := 0; i < 25; i++ { // 6 at once, then slots at +100ms ... +1.9s
		r, err := l.Reserve(at, "k")
		require.NoError(t, err)
		require.True(t, r.OK())
	}
	ctx, cancel := context.WithTimeout(at, 1500*time.Millisecond)
	defer cancel()
	err := l.Acquire(ctx, "k")
	require.NoError(t, ctx.Err(), "refused at once, before the deadline")
	require.ErrorIs(t, err, reserve.ErrWouldExceedDeadline)
	retry, ok := deadline.RetryAfterOf(err)
	require.True(t, ok)
	require.Equal(t, 2*time.Second, retry)

	b, err := e.eng.Book(at, "api:{k}", published, throttle.Request{N: 1, MaxWait: throttle.Forever})
	require.NoError(t, err)
	require.Equal(t, 2*time.Second, b.Wait, "the next booking's wait is unchanged")
}

// TestCancelGivesSlotBack: cancelling the most recent booking gives its
// slot back, and a caller whose context ends while waiting cancels its own.
// The bookings run on an explicit clock, so the slots are exact however
// long the calls take, and every real-time margin is a second or more.
func TestCancelGivesSlotBack(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	l := e.limiter(t)
	ctx := testhook.WithNow(context.Background(), time.Now().UnixMicro())
	reserveOK := func() {
		t.Helper()
		r, err := l.Reserve(ctx, "k")
		require.NoError(t, err)
		require.True(t, r.OK())
	}
	for i := 0; i < 6; i++ { // the burst: 6 at once
		reserveOK()
	}
	r1, err := l.Reserve(ctx, "k")
	require.NoError(t, err)
	require.Equal(t, 100*time.Millisecond, r1.Booking().Wait)
	require.NoError(t, r1.Cancel(ctx))
	r2, err := l.Reserve(ctx, "k")
	require.NoError(t, err)
	require.True(t, r2.Booking().At.Equal(r1.Booking().At), "same slot again: %v, %v", r2.Booking().At, r1.Booking().At)
	for i := 0; i < 10; i++ { // slots at +200ms ... +1.1s
		reserveOK()
	}

	short, cancel := context.WithTimeout(ctx, time.Second)
	defer cancel()
	err = l.Acquire(short, "k") // would wait 1.2 s, but the deadline refuses it up front
	require.ErrorIs(t, err, reserve.ErrWouldExceedDeadline)

	waiting, stop := context.WithCancel(ctx)
	r3, err := l.Reserve(waiting, "k")
	require.NoError(t, err)
	require.Equal(t, 1200*time.Millisecond, r3.Booking().Wait, "the refusal booked nothing")
	time.AfterFunc(20*time.Millisecond, stop)
	require.ErrorIs(t, r3.Wait(waiting), context.Canceled)
	r4, err := l.Reserve(ctx, "k")
	require.NoError(t, err)
	require.True(t, r4.Booking().At.Equal(r3.Booking().At), "cancelled while waiting: slot reused")
}
