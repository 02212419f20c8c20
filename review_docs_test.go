package slotbook_test

// Review (A42): the promises users read, README.md, doc.go and each
// package's doc, checked through the public API against a real
// redis-server. Timing is judged on the Redis clock (TIME, Booking().At)
// and bookings against a textbook GCRA replay or the key's stored state.
// Redis calls are counted with a go-redis hook of this file's own.
//
// Failed on 7c689a5, each on a doc sentence it contradicted, since fixed
// (the code for the first; the docs for the others, and the tests now
// check what the docs say):
//   - TestReviewDOCNegativeMaxWaitIsInvalidRequest
//   - TestReviewDOCPoolRefusedJobReservation
//   - TestReviewDOCMetricsTwoCollectors
//   - TestReviewDOCCoalescingOffOneCallEach

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/slotbook/slotbook/asynqadapter"
	"github.com/slotbook/slotbook/deadline"
	"github.com/slotbook/slotbook/httplimit"
	"github.com/slotbook/slotbook/internal/callcount"
	"github.com/slotbook/slotbook/internal/redistest"
	"github.com/slotbook/slotbook/lease"
	"github.com/slotbook/slotbook/metrics"
	"github.com/slotbook/slotbook/pool"
	"github.com/slotbook/slotbook/reserve"
	"github.com/slotbook/slotbook/throttle"
)

// docCounter is a go-redis hook counting commands (a pipeline counts once)
// and dials. Connection handshakes (HELLO, CLIENT, AUTH, SELECT) are not
// counted as commands; the dials are counted on their own.
type docCounter struct {
	cmds  atomic.Int64
	dials atomic.Int64
	mu    sync.Mutex
	names []string
}

func (c *docCounter) DialHook(next redis.DialHook) redis.DialHook {
	return func(ctx context.Context, network, addr string) (net.Conn, error) {
		c.dials.Add(1)
		return next(ctx, network, addr)
	}
}

func (c *docCounter) note(cmd redis.Cmder) bool {
	switch cmd.Name() {
	case "hello", "client", "auth", "select":
		return false
	}
	c.mu.Lock()
	c.names = append(c.names, cmd.Name())
	c.mu.Unlock()
	return true
}

func (c *docCounter) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		if c.note(cmd) {
			c.cmds.Add(1)
		}
		return next(ctx, cmd)
	}
}

func (c *docCounter) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		counted := false
		for _, cmd := range cmds {
			if c.note(cmd) && !counted {
				c.cmds.Add(1)
				counted = true
			}
		}
		return next(ctx, cmds)
	}
}

func (c *docCounter) seen() string {
	c.mu.Lock()
	defer c.mu.Unlock()
	return strings.Join(c.names, ",")
}

// docEnv is one test's Redis: the shared real server, a direct client for
// inspection, a counted client, an engine on the counted client, and a key
// prefix of the test's own.
type docEnv struct {
	srv    *redistest.Server
	rdb    *redis.Client // direct, uncounted: inspection
	crdb   *redis.Client // counted
	calls  *docCounter
	eng    *throttle.Engine
	prefix string
}

func newDocEnv(t *testing.T, opts ...throttle.Option) *docEnv {
	t.Helper()
	return newDocEnvOn(t, redistest.Shared(t), opts...)
}

// newDocEnvOn is newDocEnv on srv.
func newDocEnvOn(t *testing.T, srv *redistest.Server, opts ...throttle.Option) *docEnv {
	t.Helper()
	srv.RequireReal(t)
	e := &docEnv{srv: srv, rdb: srv.Client(t), prefix: redistest.Prefix(t), calls: new(docCounter)}
	o := srv.Options()
	o.MaxRetries = -1
	e.crdb = redis.NewClient(o)
	e.crdb.AddHook(e.calls)
	t.Cleanup(func() { _ = e.crdb.Close() })
	var err error
	e.eng, err = throttle.New(e.crdb, append([]throttle.Option{throttle.WithPrefix(e.prefix), throttle.WithTimeout(5 * time.Second)}, opts...)...)
	require.NoError(t, err)
	// Load the scripts and open a connection before counting anything.
	ctx := context.Background()
	require.NoError(t, e.eng.Load(ctx))
	e.calls.cmds.Store(0)
	return e
}

func (e *docEnv) limiter(t *testing.T, name string, limit throttle.Limit, opts ...reserve.Option) *reserve.Limiter {
	t.Helper()
	l, err := reserve.New(e.eng, name, limit, opts...)
	require.NoError(t, err)
	return l
}

// now reads the Redis clock.
func (e *docEnv) now(t *testing.T) time.Time {
	t.Helper()
	tm, err := e.rdb.Time(context.Background()).Result()
	require.NoError(t, err)
	return tm
}

// tat reads the stored TAT (µs on the Redis clock) of name's subject key,
// and whether it exists.
func (e *docEnv) tat(t *testing.T, name, key string) (int64, bool) {
	t.Helper()
	v, err := e.rdb.Get(context.Background(), e.prefix+name+":{"+key+"}").Result()
	if errors.Is(err, redis.Nil) {
		return 0, false
	}
	require.NoError(t, err)
	n, err := strconv.ParseInt(v, 10, 64)
	require.NoError(t, err, "stored value %q", v)
	return n, true
}

func docMicros(tm time.Time) int64 { return tm.UnixMicro() }

// docNoLeak checks, after every cleanup of the test registered later
// (clients closed), that no goroutine started during the test is left.
func docNoLeak(t *testing.T) {
	t.Helper()
	redistest.Shared(t) // the shared server's own goroutine is not the test's
	snap := goleak.IgnoreCurrent()
	t.Cleanup(func() { goleak.VerifyNone(t, snap) })
}

// textbookWait is the GCRA's wait for n units at now against a stored TAT:
// max(0, max(tat, now) + (n-1)I - tau - now), all in µs.
func textbookWait(stored int64, exists bool, now int64, n int, limit throttle.Limit) int64 {
	tat := now
	if exists && stored > now {
		tat = stored
	}
	I := limit.Interval().Microseconds()
	tau := int64(limit.Burst) * I
	return max(0, tat+int64(n-1)*I-tau-now)
}

// ---------------------------------------------------------------------------
// "No Redis call is made" / "makes no network call" for constructors and bad
// input.

// TestReviewDOCNoCallForBadInput: constructors make no network call, and
// every documented kind of bad input is refused with its documented error
// before any Redis call.
func TestReviewDOCNoCallForBadInput(t *testing.T) {
	srv := redistest.Shared(t)
	srv.RequireReal(t)
	calls := new(docCounter)
	o := srv.Options()
	o.MaxRetries = -1
	rdb := redis.NewClient(o)
	rdb.AddHook(calls)
	defer rdb.Close()
	ctx := context.Background()
	prefix := redistest.Prefix(t)

	eng, err := throttle.New(rdb, throttle.WithPrefix(prefix))
	require.NoError(t, err)
	limit := throttle.PerSecond(10, 2)
	lim, err := reserve.New(eng, "api", limit, reserve.WithMaxWait(time.Second))
	require.NoError(t, err)
	layered, err := reserve.New(eng, "lay", limit, reserve.WithLimit(throttle.PerDay(1000, 10)))
	require.NoError(t, err)
	p, err := pool.New(lim)
	require.NoError(t, err)
	tr, err := httplimit.New(lim)
	require.NoError(t, err)
	_ = tr
	sem, err := lease.New(eng, "api", 2)
	require.NoError(t, err)
	_, err = asynqadapter.NewMiddleware(lim)
	require.NoError(t, err)
	_, err = metrics.New()
	require.NoError(t, err)
	assert.Zero(t, calls.cmds.Load(), "constructors: commands %s", calls.seen())
	assert.Zero(t, calls.dials.Load(), "constructors: dials (\"makes no network call\")")

	long := strings.Repeat("x", throttle.MaxKeyLen+1)
	check := func(what string, err error, want error) {
		t.Helper()
		assert.ErrorIs(t, err, want, what)
	}
	// reserve
	_, err = lim.ReserveN(ctx, "k", limit.Burst+2)
	check("ReserveN n > burst+1", err, throttle.ErrExceedsBurst)
	_, err = lim.ReserveN(ctx, "k", 0)
	check("ReserveN n = 0", err, throttle.ErrInvalidRequest)
	_, err = lim.ReserveN(ctx, "", 1)
	check("ReserveN empty key", err, throttle.ErrInvalidRequest)
	_, err = lim.ReserveN(ctx, long, 1)
	check("ReserveN over-long key", err, throttle.ErrInvalidRequest)
	check("AcquireN n > burst+1", lim.AcquireN(ctx, "k", limit.Burst+2), throttle.ErrExceedsBurst)
	_, err = lim.AllowN(ctx, "k", limit.Burst+2)
	check("AllowN n > burst+1", err, throttle.ErrExceedsBurst)
	_, err = lim.AllowN(ctx, "k", -1)
	check("AllowN n < 0", err, throttle.ErrInvalidRequest)
	_, err = lim.ReserveWithin(ctx, "k", 1, -time.Millisecond)
	assert.Error(t, err, "ReserveWithin negative (its error class: TestReviewDOCNegativeMaxWaitIsInvalidRequest)")
	_, err = lim.State(ctx, "")
	check("State empty key", err, throttle.ErrInvalidRequest)
	check("CheckKey empty", lim.CheckKey(""), throttle.ErrInvalidRequest)
	check("CheckKey long", lim.CheckKey(long), throttle.ErrInvalidRequest)
	_, err = layered.ReserveN(ctx, "k", limit.Burst+2) // burst+1 of the first limit is 3; the day's 11
	check("layered ReserveN n > burst+1 of the first", err, throttle.ErrExceedsBurst)
	_, err = lim.ReserveBatch(ctx, "k", []reserve.BatchRequest{{N: 1}, {N: limit.Burst + 2}})
	assert.Error(t, err, "ReserveBatch with one bad request")
	_, err = lim.ReserveBatch(ctx, "k", make([]reserve.BatchRequest, throttle.MaxBatch+1))
	assert.Error(t, err, "ReserveBatch over MaxBatch")

	// throttle
	_, err = eng.Book(ctx, "k", limit, throttle.Request{N: 1, MaxWait: -1})
	check("Book negative MaxWait", err, throttle.ErrInvalidRequest)
	_, err = eng.Book(ctx, "k", throttle.Limit{}, throttle.Request{N: 1})
	check("Book zero limit", err, throttle.ErrInvalidLimit)
	_, err = eng.BookBatch(ctx, "k", limit, nil)
	assert.Error(t, err, "BookBatch no requests")
	reqs := make([]throttle.Request, throttle.MaxBatch+1)
	for i := range reqs {
		reqs[i] = throttle.Request{N: 1}
	}
	_, err = eng.BookBatch(ctx, "k", limit, reqs)
	assert.Error(t, err, "BookBatch over MaxBatch")
	_, err = eng.Allow(ctx, "a{b", limit)
	check("Allow key with an open brace and no hash tag", err, throttle.ErrInvalidRequest)
	_, err = eng.State(ctx, nil, nil)
	assert.Error(t, err, "State no keys")
	_, err = eng.State(ctx, []string{"{a}x", "{b}y"}, []throttle.Limit{limit, throttle.PerDay(1, 0)})
	assert.Error(t, err, "State keys without a shared tag")

	// lease
	_, err = lease.New(eng, "x", 0)
	check("lease N=0", err, lease.ErrInvalid)
	_, err = lease.New(eng, "", 1)
	check("lease empty name", err, lease.ErrInvalid)
	_, err = lease.New(nil, "x", 1)
	check("lease nil engine", err, lease.ErrInvalid)
	_, err = lease.New(eng, "x", 1, lease.WithTTL(lease.MinTTL-time.Millisecond))
	check("lease TTL under MinTTL", err, lease.ErrInvalid)
	_, err = sem.Acquire(ctx, "")
	check("lease Acquire empty key", err, lease.ErrInvalid)
	_, _, err = sem.TryAcquire(ctx, "")
	check("lease TryAcquire empty key", err, lease.ErrInvalid)
	_, err = sem.Acquire(ctx, "}a")
	check("lease Acquire key whose braces leave no hash tag", err, lease.ErrInvalid)

	// pool
	_, err = p.Submit(ctx, "", func(context.Context) error { return nil })
	if err == nil {
		t.Log("pool.Submit with an empty key returned no error at once (the job reports it)")
	}

	assert.Zero(t, calls.cmds.Load(), "bad input made Redis calls: %s", calls.seen())
	require.NoError(t, p.Close(ctx))
	require.NoError(t, sem.Close(ctx))
}

// ---------------------------------------------------------------------------
// Refusals: at once, nothing booked, the exact retry-after.

// TestReviewDOCRefusalBooksNothing: "If the slot would land past its
// context deadline (or a max wait) it is refused at once and books
// nothing", with the exact retry-after (README, doc.go, reserve.ReserveN,
// deadline.Error): the wait equals the textbook GCRA's against the key's
// stored TAT at the decision's Redis time, and the key is left as it was.
func TestReviewDOCRefusalBooksNothing(t *testing.T) {
	e := newDocEnv(t)
	limit := throttle.PerMinute(10, 2) // I = 6 s: nothing frees while the test runs
	lim := e.limiter(t, "api", limit, reserve.WithMaxWait(10*time.Second))
	ctx := context.Background()
	for i := 0; i < 3; i++ { // the burst
		require.NoError(t, lim.Acquire(ctx, "k"))
	}
	// The next slot is ~6 s away: within the max wait, but not within a
	// 1 s deadline; the one after it ~12 s away: beyond the max wait.
	before, ok := e.tat(t, "api", "k")
	require.True(t, ok)

	short, cancel := context.WithTimeout(ctx, time.Second)
	defer cancel()
	e.calls.cmds.Store(0)
	r, err := lim.Reserve(short, "k")
	require.NoError(t, err, "a refusal is not an error")
	require.False(t, r.OK())
	require.ErrorIs(t, r.Err(), reserve.ErrWouldExceedDeadline)
	assert.Equal(t, int64(1), e.calls.cmds.Load(), "one Redis call: %s", e.calls.seen())
	after, _ := e.tat(t, "api", "k")
	assert.Equal(t, before, after, "a refusal wrote the key")
	var de *deadline.Error
	require.ErrorAs(t, r.Err(), &de)
	assert.Equal(t, de.RetryAfter, r.RetryAfter(), "Err's RetryAfter is the Reservation's")
	b := r.Booking()
	decided := docMicros(b.At) - b.Wait.Microseconds()
	assert.Equal(t, textbookWait(before, true, decided, 1, limit), r.RetryAfter().Microseconds(),
		"retry-after against the textbook GCRA at the decision's Redis time (stored TAT %d, decided %d)", before, decided)
	assert.True(t, r.SlotAt().IsZero(), "SlotAt of a refusal is the zero Time")
	assert.Positive(t, r.Delay(), "Delay of a refusal is the retry-after")
	assert.LessOrEqual(t, r.Delay(), r.RetryAfter())
	start := time.Now()
	assert.ErrorIs(t, r.Wait(ctx), reserve.ErrWouldExceedDeadline, "Wait of a refusal returns Err")
	assert.Less(t, time.Since(start), time.Second, "Wait of a refusal returns at once")
	e.calls.cmds.Store(0)
	require.NoError(t, r.Cancel(ctx), "cancelling a refusal does nothing")
	assert.Zero(t, e.calls.cmds.Load(), "Cancel of a refusal made a call: %s", e.calls.seen())

	// The max wait: AcquireN of 2 units lands ~12 s out, past 10 s.
	err = lim.AcquireN(ctx, "k", 2)
	require.ErrorIs(t, err, reserve.ErrMaxWaitExceeded)
	rt, ok := deadline.RetryAfterOf(err)
	require.True(t, ok, "the refusal carries its retry-after")
	assert.Greater(t, rt, 10*time.Second)
	after, _ = e.tat(t, "api", "k")
	assert.Equal(t, before, after, "a refusal by the max wait wrote the key")

	// "a request with a budget of at least RetryAfter would have been
	// booked": the Redis clock has only moved on since.
	uncapped, err := lim.With(reserve.WithoutMaxWait())
	require.NoError(t, err)
	r2, err := uncapped.ReserveWithin(ctx, "k", 2, rt)
	require.NoError(t, err)
	require.True(t, r2.OK(), "a budget of the retry-after given: %v", r2.Err())
	require.NoError(t, r2.Cancel(ctx))
	after, _ = e.tat(t, "api", "k")
	assert.Equal(t, before, after, "a cancelled latest booking leaves the key as it was")
}

// TestReviewDOCAllowResult: check mode's Result (throttle.Result,
// README "Results"): RetryAfter 0 and Remaining when allowed; a denial
// counts nothing, is not an error, and carries the exact retry-after;
// ResetAfter is the time until the key is idle. Bracketed by the Redis
// clock read before and after each call.
func TestReviewDOCAllowResult(t *testing.T) {
	e := newDocEnv(t)
	limit := throttle.PerMinute(10, 5) // I = 6 s, tau = 30 s
	lim := e.limiter(t, "chk", limit)
	ctx := context.Background()
	I := limit.Interval()
	for i := 0; i < 6; i++ {
		t0 := e.now(t)
		res, err := lim.Allow(ctx, "k")
		t1 := e.now(t)
		require.NoError(t, err)
		require.True(t, res.Allowed, "request %d of burst+1", i+1)
		assert.Zero(t, res.RetryAfter, "RetryAfter is 0 when allowed")
		assert.Equal(t, 5-i, res.Remaining, "Remaining after request %d", i+1)
		tat, ok := e.tat(t, "chk", "k")
		require.True(t, ok)
		lo, hi := time.Duration(tat-docMicros(t1))*time.Microsecond, time.Duration(tat-docMicros(t0))*time.Microsecond
		assert.True(t, res.ResetAfter >= lo && res.ResetAfter <= hi, "ResetAfter %v outside [%v, %v] (TAT - now)", res.ResetAfter, lo, hi)
		if i == 0 {
			assert.InDelta(t, float64(I), float64(res.ResetAfter), float64(50*time.Millisecond), "one unit on an idle key: back to idle after one interval")
		}
	}
	before, _ := e.tat(t, "chk", "k")
	t0 := e.now(t)
	res, err := lim.Allow(ctx, "k")
	t1 := e.now(t)
	require.NoError(t, err, "a denial is a result, not an error")
	require.False(t, res.Allowed)
	assert.Zero(t, res.Remaining)
	after, _ := e.tat(t, "chk", "k")
	assert.Equal(t, before, after, "a denial counted")
	tau := time.Duration(limit.Burst) * I
	lo := time.Duration(before-docMicros(t1))*time.Microsecond - tau
	hi := time.Duration(before-docMicros(t0))*time.Microsecond - tau
	assert.True(t, res.RetryAfter >= lo && res.RetryAfter <= hi, "RetryAfter %v outside the textbook [%v, %v]", res.RetryAfter, lo, hi)
	lo, hi = time.Duration(before-docMicros(t1))*time.Microsecond, time.Duration(before-docMicros(t0))*time.Microsecond
	assert.True(t, res.ResetAfter >= lo && res.ResetAfter <= hi, "denied ResetAfter %v outside [%v, %v]", res.ResetAfter, lo, hi)
}

// TestReviewDOCBurstThenInterval: "after idling a limit lets burst+1
// through at once, then one per interval" (README, Stability), for
// reservations: the slots replayed through a textbook GCRA, and the
// (burst+2)th exactly one interval after the first's decision.
func TestReviewDOCBurstThenInterval(t *testing.T) {
	e := newDocEnv(t)
	limit := throttle.PerSecond(10, 5)
	lim := e.limiter(t, "api", limit, reserve.WithCoalescing(false))
	ctx := context.Background()
	var rs []*reserve.Reservation
	for i := 0; i < 9; i++ {
		r, err := lim.Reserve(ctx, "k")
		require.NoError(t, err)
		require.True(t, r.OK())
		rs = append(rs, r)
	}
	first := rs[0].Booking()
	decided := first.At.Add(-first.Wait)
	for i := 0; i < 6; i++ {
		assert.Zero(t, rs[i].Booking().Wait, "request %d within burst+1 waits", i+1)
	}
	for i := 6; i < 9; i++ {
		want := decided.Add(time.Duration(i-5) * limit.Interval())
		assert.Equal(t, want, rs[i].Booking().At, "request %d: one interval per request after the burst", i+1)
	}
	I, tau := limit.Interval().Microseconds(), int64(limit.Burst)*limit.Interval().Microseconds()
	var tat int64
	for i, r := range rs {
		at := docMicros(r.Booking().At)
		if i == 0 {
			tat = at
		}
		assert.GreaterOrEqual(t, at, tat-tau, "slot %d earlier than the textbook GCRA allows", i+1)
		tat = max(tat, at) + I
	}
}

// ---------------------------------------------------------------------------
// Cancel.

// TestReviewDOCCancelCalls: Cancel gives the latest booking back exactly
// (the key returns to where it was); a second Cancel does nothing and makes
// no call; once the slot has come nothing is given back and Cancel makes no
// Redis call; a View's Cancel does nothing (reserve.Reservation.Cancel,
// README "Cancel").
func TestReviewDOCCancelCalls(t *testing.T) {
	e := newDocEnv(t)
	limit := throttle.PerSecond(5, 0) // I = 200ms
	lim := e.limiter(t, "api", limit, reserve.WithCoalescing(false))
	ctx := context.Background()
	a, err := lim.Reserve(ctx, "k")
	require.NoError(t, err)
	require.True(t, a.OK())
	before, _ := e.tat(t, "api", "k")
	b, err := lim.Reserve(ctx, "k")
	require.NoError(t, err)
	require.True(t, b.OK())
	assert.Greater(t, b.Delay(), time.Duration(0))

	e.calls.cmds.Store(0)
	require.NoError(t, b.View().Cancel(ctx))
	assert.Zero(t, e.calls.cmds.Load(), "a View's Cancel made a call")
	mid, _ := e.tat(t, "api", "k")
	assert.Equal(t, before+limit.Interval().Microseconds(), mid, "a View's Cancel gave back")

	require.NoError(t, b.Cancel(ctx))
	assert.Equal(t, int64(1), e.calls.cmds.Load(), "the first Cancel is one call: %s", e.calls.seen())
	after, _ := e.tat(t, "api", "k")
	assert.Equal(t, before, after, "the cancelled latest booking: the key is back where it was")
	e.calls.cmds.Store(0)
	require.NoError(t, b.Cancel(ctx))
	assert.Zero(t, e.calls.cmds.Load(), "a second Cancel made a call: %s", e.calls.seen())

	// A booking whose slot has come: sleep past it on the Redis clock.
	c, err := lim.Reserve(ctx, "k")
	require.NoError(t, err)
	require.True(t, c.OK())
	require.NoError(t, c.Wait(ctx))
	for e.now(t).Before(c.Booking().At) {
		time.Sleep(time.Millisecond)
	}
	held, _ := e.tat(t, "api", "k")
	e.calls.cmds.Store(0)
	require.NoError(t, c.Cancel(ctx))
	assert.Zero(t, e.calls.cmds.Load(), "Cancel after the slot made a call: %s", e.calls.seen())
	now, ok := e.tat(t, "api", "k")
	if ok {
		assert.Equal(t, held, now, "Cancel after the slot gave back")
	}
}

// TestReviewDOCAcquireCtxDoneGivesBack: "If ctx is done while sleeping, the
// booking is cancelled (its slot given back) and ctx's error is returned"
// (reserve.AcquireN), and Acquire returns before its slot.
func TestReviewDOCAcquireCtxDoneGivesBack(t *testing.T) {
	e := newDocEnv(t)
	limit := throttle.PerMinute(1, 0)
	lim := e.limiter(t, "api", limit)
	ctx := context.Background()
	require.NoError(t, lim.Acquire(ctx, "k"))
	before, _ := e.tat(t, "api", "k")
	cctx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- lim.Acquire(cctx, "k") }()
	// Wait until the booking stands, then end the context.
	require.Eventually(t, func() bool {
		v, _ := e.tat(t, "api", "k")
		return v > before
	}, 5*time.Second, time.Millisecond)
	cancel()
	select {
	case err := <-done:
		assert.ErrorIs(t, err, context.Canceled)
	case <-time.After(10 * time.Second):
		t.Fatal("Acquire did not return after its context ended")
	}
	after, _ := e.tat(t, "api", "k")
	assert.Equal(t, before, after, "the booking of a cancelled Acquire was not given back")
}

// TestReviewDOCNegativeMaxWaitIsInvalidRequest (FAILS on the current code):
// throttle.ErrInvalidRequest "is matched by errors that report a bad
// argument other than the limit: n <= 0, an empty or over-long key, a
// negative max wait", and the README lists it among the "Errors callers
// branch on". reserve.ReserveWithin calls a negative maxWait "bad input
// (no Redis call made)", and reserve.WithMaxWait(-d) is bad input too, but
// neither error matches ErrInvalidRequest: a caller branching on it for
// bad input misses them.
func TestReviewDOCNegativeMaxWaitIsInvalidRequest(t *testing.T) {
	e := newDocEnv(t)
	lim := e.limiter(t, "api", throttle.PerSecond(10, 2))
	_, err := lim.ReserveWithin(context.Background(), "k", 1, -time.Millisecond)
	require.Error(t, err)
	assert.Zero(t, e.calls.cmds.Load(), "no Redis call for bad input")
	assert.ErrorIs(t, err, throttle.ErrInvalidRequest, "ReserveWithin with a negative max wait")
	_, err = reserve.New(e.eng, "api", throttle.PerSecond(10, 2), reserve.WithMaxWait(-time.Second)) //nolint
	require.Error(t, err)
	if !errors.Is(err, throttle.ErrInvalidRequest) {
		t.Logf("likewise reserve.New(..., WithMaxWait(-1s)): %q (an option: not promised, noted)", err)
	}
}

// ---------------------------------------------------------------------------
// Pause.

// TestReviewDOCPause: "No slot is granted before then, and requests resume
// one interval apart. Slots booked before the pause keep their times ...
// nothing done later can shorten the pause: ... cancelling one of them
// gives nothing back, and bookings made after it start at or beyond its
// end" (README); reserve.Limiter.Pause. Also: a pause shorter than the
// backlog does not pull the backlog in.
func TestReviewDOCPause(t *testing.T) {
	e := newDocEnv(t)
	limit := throttle.PerSecond(10, 5)
	I := limit.Interval()
	lim := e.limiter(t, "api", limit, reserve.WithCoalescing(false))
	ctx := context.Background()
	var pre []*reserve.Reservation
	for i := 0; i < 2; i++ {
		r, err := lim.Reserve(ctx, "k")
		require.NoError(t, err)
		require.True(t, r.OK())
		pre = append(pre, r)
	}
	const d = time.Second
	t0 := e.now(t)
	require.NoError(t, lim.Pause(ctx, "k", d))
	t1 := e.now(t)
	paused, _ := e.tat(t, "api", "k")
	require.NoError(t, pre[1].Cancel(ctx))
	v, _ := e.tat(t, "api", "k")
	assert.Equal(t, paused, v, "cancelling a booking made before the pause changed the key")

	var post []*reserve.Reservation
	for i := 0; i < 3; i++ {
		r, err := lim.Reserve(ctx, "k")
		require.NoError(t, err)
		require.True(t, r.OK())
		post = append(post, r)
	}
	first := post[0].Booking().At
	assert.False(t, first.Before(t0.Add(d)), "first slot after the pause at %v, before its end (>= %v)", first.Sub(t0), d)
	assert.False(t, first.After(t1.Add(d+I)), "first slot after the pause at %v: more than an interval past its end", first.Sub(t0))
	for i := 1; i < 3; i++ {
		assert.Equal(t, I, post[i].Booking().At.Sub(post[i-1].Booking().At), "requests resume one interval apart (not a burst): %d", i)
	}
	// Cancelling the later bookings, latest first, gives back down to the
	// pause and never below.
	for i := 2; i >= 0; i-- {
		require.NoError(t, post[i].Cancel(ctx))
	}
	v, _ = e.tat(t, "api", "k")
	assert.GreaterOrEqual(t, v, paused, "cancels reached below the pause")
	r, err := lim.Reserve(ctx, "k")
	require.NoError(t, err)
	assert.False(t, r.Booking().At.Before(t0.Add(d)), "after cancels a slot lies inside the pause")

	// A pause shorter than the backlog leaves the backlog alone.
	reqs := make([]reserve.BatchRequest, 20)
	for i := range reqs {
		reqs[i] = reserve.BatchRequest{N: 1}
	}
	_, err = lim.ReserveBatch(ctx, "k2", reqs)
	require.NoError(t, err)
	backlog, _ := e.tat(t, "api", "k2")
	require.NoError(t, lim.Pause(ctx, "k2", 100*time.Millisecond))
	v, _ = e.tat(t, "api", "k2")
	assert.GreaterOrEqual(t, v, backlog, "a short pause pulled the backlog in")
}

// ---------------------------------------------------------------------------
// State and Reset, keys.

// TestReviewDOCState: State "reads a subject without booking anything or
// spending quota (one Redis call)": wait, slot on the Redis clock,
// Available, Backlog, per-key TAT and TTL; Reset clears the subject, so
// its next request finds it idle (burst+1 at once). Judged against the
// key's stored value and the textbook GCRA at State.Now.
func TestReviewDOCState(t *testing.T) {
	e := newDocEnv(t)
	limit := throttle.PerMinute(10, 5) // I = 6 s
	lim := e.limiter(t, "st", limit)
	ctx := context.Background()

	st, err := lim.State(ctx, "k")
	require.NoError(t, err)
	assert.Equal(t, int64(1), e.calls.cmds.Load(), "State is one call: %s", e.calls.seen())
	assert.Zero(t, st.Wait)
	assert.Equal(t, limit.Burst+1, st.Available, "idle: burst+1 available")
	assert.Zero(t, st.Backlog)
	assert.Equal(t, st.Now, st.NextFree)
	require.Len(t, st.Keys, 1)
	assert.False(t, st.Keys[0].Exists)
	assert.Zero(t, st.Keys[0].TTL)
	_, ok := e.tat(t, "st", "k")
	assert.False(t, ok, "State wrote the key")

	r, err := lim.ReserveN(ctx, "k", 3)
	require.NoError(t, err)
	require.True(t, r.OK())
	tat, _ := e.tat(t, "st", "k")
	st, err = lim.State(ctx, "k")
	require.NoError(t, err)
	v, _ := e.tat(t, "st", "k")
	assert.Equal(t, tat, v, "State changed the key")
	assert.Equal(t, 3, st.Available, "after 3 of 6 units")
	assert.Equal(t, tat, docMicros(st.Keys[0].TAT), "Keys[0].TAT is the stored TAT")
	assert.Equal(t, time.Duration(tat-docMicros(st.Now))*time.Microsecond, st.Backlog, "Backlog = TAT - Now")
	assert.Positive(t, st.Keys[0].TTL)
	assert.LessOrEqual(t, st.Keys[0].TTL, st.Backlog+time.Second, "TTL about the backlog")

	r, err = lim.ReserveN(ctx, "k", 5)
	require.NoError(t, err)
	require.True(t, r.OK())
	tat, _ = e.tat(t, "st", "k")
	st, err = lim.State(ctx, "k")
	require.NoError(t, err)
	assert.Zero(t, st.Available)
	want := textbookWait(tat, true, docMicros(st.Now), 1, limit)
	assert.Equal(t, want, st.Wait.Microseconds(), "Wait against the textbook GCRA at State.Now")
	assert.Equal(t, st.Now.Add(st.Wait), st.NextFree)

	require.NoError(t, lim.Reset(ctx, "k"))
	_, ok = e.tat(t, "st", "k")
	assert.False(t, ok, "Reset left the key")
	for i := 0; i < limit.Burst+1; i++ {
		res, err := lim.Allow(ctx, "k")
		require.NoError(t, err)
		assert.True(t, res.Allowed, "after Reset: request %d of burst+1", i+1)
	}
}

// TestReviewDOCLayeredKeys: "Keys are slotbook:partner:{tenant-42}
// (prefix, limiter name, subject) and slotbook:partner:{tenant-42}:86400000ms
// for the daily limit" (README); a refusal books nothing in any limit; a
// cancel gives back to each.
func TestReviewDOCLayeredKeys(t *testing.T) {
	e := newDocEnv(t)
	lim := e.limiter(t, "partner", throttle.PerSecond(10, 5), reserve.WithLimit(throttle.PerDay(10_000, 100)),
		reserve.WithMaxWait(0), reserve.WithCoalescing(false))
	ctx := context.Background()
	require.NoError(t, lim.Acquire(ctx, "tenant-42"))
	first := e.prefix + "partner:{tenant-42}"
	day := first + ":86400000ms"
	n, err := e.rdb.Exists(ctx, first, day).Result()
	require.NoError(t, err)
	assert.Equal(t, int64(2), n, "keys %s and %s", first, day)
	st, err := lim.State(ctx, "tenant-42")
	require.NoError(t, err)
	require.Len(t, st.Keys, 2)
	assert.Equal(t, "partner:{tenant-42}", st.Keys[0].Key)
	assert.Equal(t, "partner:{tenant-42}:86400000ms", st.Keys[1].Key)

	get := func() (string, string) {
		a, _ := e.rdb.Get(ctx, first).Result()
		b, _ := e.rdb.Get(ctx, day).Result()
		return a, b
	}
	for i := 0; i < 5; i++ {
		require.NoError(t, lim.Acquire(ctx, "tenant-42"))
	}
	a0, b0 := get()
	r, err := lim.Reserve(ctx, "tenant-42") // the first limit's burst is spent: refused by WithMaxWait(0)
	require.NoError(t, err)
	require.False(t, r.OK())
	a1, b1 := get()
	assert.Equal(t, a0, a1, "a refusal booked in the first limit")
	assert.Equal(t, b0, b1, "a refusal booked in the daily limit")

	view, err := lim.With(reserve.WithoutMaxWait())
	require.NoError(t, err)
	r, err = view.Reserve(ctx, "tenant-42")
	require.NoError(t, err)
	require.True(t, r.OK())
	require.NoError(t, r.Cancel(ctx))
	a2, b2 := get()
	assert.Equal(t, a0, a2, "cancel: the first limit given back")
	assert.Equal(t, b0, b2, "cancel: the daily limit given back")
}

// TestReviewDOCScriptFlush: "Scripts are sent again after a restart or
// SCRIPT FLUSH without the caller seeing NOSCRIPT" (README).
func TestReviewDOCScriptFlush(t *testing.T) {
	e := newDocEnvOn(t, redistest.Start(t)) // its own: the shared one refuses SCRIPT FLUSH
	lim := e.limiter(t, "api", throttle.PerSecond(100, 10))
	ctx := context.Background()
	require.NoError(t, lim.Acquire(ctx, "k"))
	require.NoError(t, e.rdb.ScriptFlush(ctx).Err())
	require.NoError(t, lim.Acquire(ctx, "k"), "a booking after SCRIPT FLUSH")
	_, err := lim.Allow(ctx, "k")
	require.NoError(t, err, "a check after SCRIPT FLUSH")
	require.NoError(t, e.rdb.ScriptFlush(ctx).Err())
	r, err := lim.Reserve(ctx, "k")
	require.NoError(t, err)
	require.NoError(t, e.rdb.ScriptFlush(ctx).Err())
	require.NoError(t, r.Cancel(ctx), "a refund after SCRIPT FLUSH")
	_, err = lim.State(ctx, "k")
	require.NoError(t, err, "State after SCRIPT FLUSH")
}

// ---------------------------------------------------------------------------
// Construction and defaults.

// TestReviewDOCEngineDefaults: throttle.New refuses a client without
// ContextTimeoutEnabled unless WithTimeout(0); the defaults (50ms timeout,
// "slotbook:" prefix); WithObserver(nil) and a typed nil are errors;
// Limit's String, Interval rounding and Validate.
func TestReviewDOCEngineDefaults(t *testing.T) {
	srv := redistest.Shared(t)
	o := srv.Options()
	o.ContextTimeoutEnabled = false
	rdb := redis.NewClient(o)
	defer rdb.Close()
	_, err := throttle.New(rdb)
	assert.Error(t, err, "a client without ContextTimeoutEnabled")
	eng, err := throttle.New(rdb, throttle.WithTimeout(0))
	require.NoError(t, err, "with WithTimeout(0)")
	assert.Zero(t, eng.Timeout())

	o = srv.Options()
	o.ContextTimeoutEnabled = true
	rdb2 := redis.NewClient(o)
	defer rdb2.Close()
	eng, err = throttle.New(rdb2)
	require.NoError(t, err)
	assert.Equal(t, 50*time.Millisecond, eng.Timeout())
	assert.Equal(t, throttle.DefaultTimeout, eng.Timeout())
	assert.Equal(t, "slotbook:", eng.Prefix())

	_, err = throttle.New(rdb2, throttle.WithObserver(nil))
	assert.Error(t, err, "WithObserver(nil)")
	var nilColl *metrics.Collector
	_, err = throttle.New(rdb2, throttle.WithObserver(nilColl))
	assert.Error(t, err, "WithObserver(nil *metrics.Collector)")
	_, err = lease.New(eng, "x", 1, lease.WithObserver(nil))
	assert.ErrorIs(t, err, lease.ErrInvalid, "lease.WithObserver(nil)")
	var nilLC *lease.Collector
	_, err = lease.New(eng, "x", 1, lease.WithObserver(nilLC))
	assert.ErrorIs(t, err, lease.ErrInvalid, "lease.WithObserver(nil *lease.Collector)")

	assert.Equal(t, "10/1s burst 5", throttle.PerSecond(10, 5).String())
	assert.Equal(t, 333334*time.Microsecond, throttle.PerSecond(3, 0).Interval(), "rounded up to a microsecond")
	assert.Zero(t, throttle.Limit{}.Interval(), "0 for an invalid Limit")
	for _, l := range []throttle.Limit{{}, {Rate: 0, Period: time.Second}, {Rate: 1, Period: 0}, {Rate: 1, Period: time.Second, Burst: -1},
		throttle.Every(500*time.Nanosecond, 1, 0), throttle.Every(time.Second, 2_000_000, 0)} {
		assert.ErrorIs(t, l.Validate(), throttle.ErrInvalidLimit, "%+v", l)
		_, err := reserve.New(eng, "x", l)
		assert.ErrorIs(t, err, throttle.ErrInvalidLimit, "reserve.New %+v", l)
	}
	assert.NoError(t, throttle.Every(time.Microsecond, 1, 0).Validate(), "an interval of exactly 1µs")
	assert.Equal(t, 24*time.Hour, throttle.PerDay(1, 0).Period)
	assert.Equal(t, time.Hour, throttle.PerHour(1, 0).Period)
	assert.Equal(t, time.Minute, throttle.PerMinute(1, 0).Period)
}

// ---------------------------------------------------------------------------
// pool.

// TestReviewDOCPoolClose: pool's Close "bookings not yet started are given
// back (their jobs end with ErrClosed) ... and Close waits for every
// goroutine the pool started. Close is idempotent"; ErrClosed "is returned
// for work submitted to, or left in, a closed Pool"; Acquire returns
// ErrClosed once the pool is closed; release twice does nothing more. The
// key after Close holds exactly the jobs that ran (textbook GCRA state).
func TestReviewDOCPoolClose(t *testing.T) {
	docNoLeak(t)
	e := newDocEnv(t)
	limit := throttle.PerMinute(60, 0) // I = 1 s
	lim := e.limiter(t, "pl", limit)
	ctx := context.Background()
	p, err := pool.New(lim, pool.WithWorkers(3))
	require.NoError(t, err)
	assert.Equal(t, 3, p.Workers())

	var ran atomic.Int64
	started := make(chan struct{}, 10)
	fn := func(context.Context) error { ran.Add(1); started <- struct{}{}; return nil }
	var jobs []*pool.Job
	for i := 0; i < 6; i++ {
		j, err := p.Submit(ctx, "k", fn)
		require.NoError(t, err)
		jobs = append(jobs, j)
	}
	<-started
	require.NoError(t, jobs[0].Wait(ctx))
	// Let the pool book ahead for the next jobs (their slots are 1 s and
	// 2 s away) before closing.
	require.Eventually(t, func() bool {
		v, _ := e.tat(t, "pl", "k")
		return v >= docMicros(jobs[0].Reservation().Booking().At)+3*limit.Interval().Microseconds()
	}, 900*time.Millisecond, time.Millisecond, "the pool booked ahead for its backlog")
	require.NoError(t, p.Close(ctx))
	require.NoError(t, p.Close(ctx), "Close is idempotent")
	ranJobs := 0
	for i, j := range jobs {
		select {
		case <-j.Done():
		default:
			t.Fatalf("job %d not done after Close", i)
		}
		if j.Err() == nil {
			ranJobs++
			continue
		}
		assert.ErrorIs(t, j.Err(), pool.ErrClosed, "job %d", i)
	}
	assert.Equal(t, int64(ranJobs), ran.Load())
	b := jobs[0].Reservation().Booking()
	v, _ := e.tat(t, "pl", "k")
	assert.Equal(t, docMicros(b.At)+int64(ranJobs)*limit.Interval().Microseconds(), v,
		"after Close the key holds %d job(s) that ran, no more: bookings not started given back", ranJobs)

	j, err := p.Submit(ctx, "k", fn)
	if err == nil {
		<-j.Done()
		err = j.Err()
	}
	assert.ErrorIs(t, err, pool.ErrClosed, "Submit after Close")
	_, err = p.Acquire(ctx, "k")
	assert.ErrorIs(t, err, pool.ErrClosed, "Acquire after Close")
	require.NoError(t, p.Wait(ctx))
}

// TestReviewDOCPoolRefusalAndRelease: a job whose slot would pass its
// deadline "books nothing and ends with the refusal
// (deadline.ErrWouldExceedDeadline, carrying the exact retry-after)" and
// never runs; Acquire's release may be called twice; Job.Wait returns ctx's
// error if ctx ends first; an Acquire caller waiting for a worker gets
// ErrClosed on Close.
func TestReviewDOCPoolRefusalAndRelease(t *testing.T) {
	docNoLeak(t)
	e := newDocEnv(t)
	limit := throttle.PerMinute(2, 1) // two at once, then 30 s apart
	lim := e.limiter(t, "pr", limit)
	ctx := context.Background()
	p, err := pool.New(lim, pool.WithWorkers(1))
	require.NoError(t, err)
	defer p.Close(ctx)

	release, err := p.Acquire(ctx, "k")
	require.NoError(t, err)
	// The only worker is held: a second Acquire waits for it, and a job
	// waits in the backlog.
	short, cancel := context.WithTimeout(ctx, 50*time.Millisecond)
	defer cancel()
	var ran atomic.Bool
	j, err := p.Submit(ctx, "k", func(context.Context) error { ran.Store(true); return nil })
	require.NoError(t, err)
	assert.ErrorIs(t, j.Wait(short), context.DeadlineExceeded, "Job.Wait returns ctx's error")
	release()
	release() // "Calling release more than once does nothing more."
	<-j.Done()
	require.NoError(t, j.Err(), "the queued job runs once the worker is free")
	assert.True(t, ran.Load())

	// Now a job whose slot (a minute out) passes its deadline.
	ran.Store(false)
	before, _ := e.tat(t, "pr", "k")
	dctx, dcancel := context.WithTimeout(ctx, 2*time.Second)
	defer dcancel()
	j, err = p.Submit(dctx, "k", func(context.Context) error { ran.Store(true); return nil })
	require.NoError(t, err)
	<-j.Done()
	require.ErrorIs(t, j.Err(), deadline.ErrWouldExceedDeadline)
	rt, ok := deadline.RetryAfterOf(j.Err())
	assert.True(t, ok, "the refusal carries its retry-after")
	assert.Greater(t, rt, 25*time.Second)
	assert.False(t, ran.Load(), "a refused job ran")
	v, _ := e.tat(t, "pr", "k")
	assert.Equal(t, before, v, "a refused job booked")
	if r := j.Reservation(); r != nil {
		assert.False(t, r.OK(), "a refused job's Reservation")
	}
	assert.True(t, j.Slot().IsZero(), "a refused job's Slot: never booked")
	assert.True(t, j.Started().IsZero(), "a refused job never started")
}

// ---------------------------------------------------------------------------
// lease.

// TestReviewDOCLeaseClose: Semaphore.Close: "waiting Acquire callers get
// ErrClosed (and leave the queue), held leases are released (their Lost is
// closed, and their Release is then a no-op) ... Close is idempotent";
// ErrClosed for Acquire and TryAcquire after; Release "returns nil if it
// was released before"; TryAcquire on a full key is not an error; tokens
// grow; a waiter whose context ends holds nothing.
func TestReviewDOCLeaseClose(t *testing.T) {
	docNoLeak(t)
	e := newDocEnv(t)
	ctx := context.Background()
	sem, err := lease.New(e.eng, "ls", 2, lease.WithTTL(3*time.Second))
	require.NoError(t, err)
	assert.Equal(t, 2, sem.N())
	assert.Equal(t, 3*time.Second, sem.TTL())
	l1, err := sem.Acquire(ctx, "k")
	require.NoError(t, err)
	l2, err := sem.Acquire(ctx, "k")
	require.NoError(t, err)
	assert.Greater(t, l2.Token(), l1.Token(), "fencing tokens grow")
	l, ok, err := sem.TryAcquire(ctx, "k")
	require.NoError(t, err, "a full key is not an error")
	assert.False(t, ok)
	assert.Nil(t, l)

	// A waiter whose context ends holds nothing, and leaves the queue.
	wctx, wcancel := context.WithTimeout(ctx, 100*time.Millisecond)
	_, err = sem.Acquire(wctx, "k")
	wcancel()
	assert.ErrorIs(t, err, context.DeadlineExceeded)

	waiting := make(chan error, 1)
	go func() {
		_, err := sem.Acquire(ctx, "k")
		waiting <- err
	}()
	time.Sleep(100 * time.Millisecond) // let it queue
	require.NoError(t, sem.Close(ctx))
	select {
	case err := <-waiting:
		assert.ErrorIs(t, err, lease.ErrClosed, "a waiting Acquire on Close")
	case <-time.After(10 * time.Second):
		t.Fatal("a waiting Acquire did not return on Close")
	}
	for i, l := range []*lease.Lease{l1, l2} {
		select {
		case <-l.Lost():
		default:
			t.Errorf("lease %d: Lost not closed by Close", i)
		}
		assert.NoError(t, l.Release(ctx), "Release after Close is a no-op (lease %d)", i)
	}
	require.NoError(t, sem.Close(ctx), "Close is idempotent")
	_, err = sem.Acquire(ctx, "k")
	assert.ErrorIs(t, err, lease.ErrClosed)
	_, _, err = sem.TryAcquire(ctx, "k")
	assert.ErrorIs(t, err, lease.ErrClosed)

	// Close released them in Redis: another process takes both places
	// at once, and nobody waits in front of it.
	sem2, err := lease.New(e.eng, "ls", 2, lease.WithTTL(3*time.Second))
	require.NoError(t, err)
	defer sem2.Close(ctx)
	a, ok, err := sem2.TryAcquire(ctx, "k")
	require.NoError(t, err)
	require.True(t, ok, "first place free after Close")
	b, ok, err := sem2.TryAcquire(ctx, "k")
	require.NoError(t, err)
	require.True(t, ok, "second place free after Close (no waiter left in the queue)")
	assert.Greater(t, a.Token(), l2.Token())
	require.NoError(t, a.Release(ctx))
	assert.NoError(t, a.Release(ctx), "Release twice: nil")
	require.NoError(t, b.Release(ctx))
	require.NoError(t, sem2.Close(ctx))
}

// TestReviewDOCPoolRefusedJobReservation (FAILS on the current code):
// pool.Job.Reservation "returns the reservation it held (nil if it was
// never booked)". A job refused because its slot would pass its deadline
// "books nothing" (pool package doc, Refusals), yet its Reservation is a
// non-nil refusal, not nil. A caller that tests `r != nil` to learn whether
// the job was booked, and then reads r.Booking() or r.SlotAt(), reads a
// refusal.
func TestReviewDOCPoolRefusedJobReservation(t *testing.T) {
	e := newDocEnv(t)
	lim := e.limiter(t, "prr", throttle.PerMinute(1, 0))
	ctx := context.Background()
	require.NoError(t, lim.Acquire(ctx, "k")) // the next slot is a minute out
	p, err := pool.New(lim, pool.WithWorkers(1))
	require.NoError(t, err)
	defer p.Close(ctx)
	dctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	j, err := p.Submit(dctx, "k", func(context.Context) error { return nil })
	require.NoError(t, err)
	<-j.Done()
	require.ErrorIs(t, j.Err(), deadline.ErrWouldExceedDeadline)
	r := j.Reservation()
	// The doc now says: a refused job's Reservation is its refusal, not
	// OK, which booked nothing.
	require.NotNil(t, r, "Job.Reservation of a job refused by its deadline")
	require.False(t, r.OK())
	require.False(t, r.Booking().OK)
	require.ErrorIs(t, r.Err(), deadline.ErrWouldExceedDeadline)
	st, err := lim.State(ctx, "k")
	require.NoError(t, err)
	require.Zero(t, st.Available, "the refusal booked nothing: the key holds the one Acquire's booking alone")
	require.Greater(t, st.Wait, 50*time.Second, "the key holds the one Acquire's booking alone")
	require.LessOrEqual(t, st.Wait, time.Minute, "the refusal booked nothing more")
}

// ---------------------------------------------------------------------------
// httplimit.

// docBody is a request body that records whether it was closed.
type docBody struct {
	io.Reader
	closed atomic.Bool
}

func (b *docBody) Close() error { b.closed.Store(true); return nil }

// docUpstream is a stand-in API: it counts requests and answers by path.
func docUpstream(t *testing.T, h func(w http.ResponseWriter, r *http.Request)) (*httptest.Server, *atomic.Int64) {
	t.Helper()
	var n atomic.Int64
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		n.Add(1)
		h(w, r)
	}))
	t.Cleanup(srv.Close)
	return srv, &n
}

// TestReviewDOCHTTPNotSent: "A request the limiter refuses is never sent:
// the error is a *httplimit.NotSentError wrapping the refusal and its
// retry-after, and the request's body is closed" (README, httplimit doc);
// http.Client wraps it, errors.As finds it.
func TestReviewDOCHTTPNotSent(t *testing.T) {
	e := newDocEnv(t)
	up, served := docUpstream(t, func(w http.ResponseWriter, r *http.Request) { fmt.Fprintln(w, "ok") })
	lim := e.limiter(t, "h1", throttle.PerMinute(1, 0), reserve.WithMaxWait(100*time.Millisecond))
	tr, err := httplimit.New(lim)
	require.NoError(t, err)
	client := &http.Client{Transport: tr}
	resp, err := client.Get(up.URL)
	require.NoError(t, err)
	resp.Body.Close()
	require.Equal(t, int64(1), served.Load())

	body := &docBody{Reader: strings.NewReader("payload")}
	req, err := http.NewRequest(http.MethodPost, up.URL, body)
	require.NoError(t, err)
	resp, err = client.Do(req)
	if resp != nil {
		resp.Body.Close()
	}
	require.Error(t, err)
	var ns *httplimit.NotSentError
	require.ErrorAs(t, err, &ns)
	assert.ErrorIs(t, err, reserve.ErrMaxWaitExceeded)
	d, ok := ns.RetryAfter()
	assert.True(t, ok, "a refusal carries its retry-after")
	assert.Greater(t, d, 50*time.Second)
	assert.LessOrEqual(t, d, time.Minute)
	assert.Equal(t, int64(1), served.Load(), "a refused request reached the upstream")
	assert.True(t, body.closed.Load(), "the refused request's body was not closed")
	u, _ := http.NewRequest(http.MethodGet, up.URL, nil)
	assert.Equal(t, u.URL.Host, ns.Key, "keyed by host (with port)")
	assert.Equal(t, u.URL.Host, httplimit.ByHost(u))
}

// TestReviewDOCHTTPPauseClamp: on 429 or 503 with Retry-After (seconds or an
// HTTP date) the key is paused for every process, for at most WithMaxPause
// (an hour by default: "a Retry-After: 5000000000 pauses an hour, not 158
// years"), and the caller always gets the upstream's response. Read back on
// the Redis clock with State; a 429 without Retry-After pauses nothing
// unless WithResetHeaders.
func TestReviewDOCHTTPPauseClamp(t *testing.T) {
	e := newDocEnv(t)
	var retryAfter atomic.Value
	up, _ := docUpstream(t, func(w http.ResponseWriter, r *http.Request) {
		switch r.URL.Path {
		case "/429":
			w.Header().Set("Retry-After", retryAfter.Load().(string))
			w.WriteHeader(http.StatusTooManyRequests)
		case "/503":
			w.Header().Set("Retry-After", retryAfter.Load().(string))
			w.WriteHeader(http.StatusServiceUnavailable)
		case "/bare":
			w.WriteHeader(http.StatusTooManyRequests)
		case "/xreset":
			w.Header().Set("X-RateLimit-Reset", strconv.FormatInt(time.Now().Add(5*time.Second).Unix(), 10))
			w.WriteHeader(http.StatusTooManyRequests)
		default:
			fmt.Fprintln(w, "ok")
		}
	})
	ctx := context.Background()
	host := strings.TrimPrefix(up.URL, "http://")
	try := func(name, path, ra string, opts ...httplimit.Option) time.Duration {
		t.Helper()
		lim := e.limiter(t, name, throttle.PerSecond(100, 10))
		tr, err := httplimit.New(lim, opts...)
		require.NoError(t, err)
		retryAfter.Store(ra)
		resp, err := (&http.Client{Transport: tr}).Get(up.URL + path)
		require.NoError(t, err, "%s: the upstream's response reaches the caller", name)
		resp.Body.Close()
		assert.NotEqual(t, http.StatusOK, resp.StatusCode)
		st, err := lim.State(ctx, host)
		require.NoError(t, err)
		return st.Wait
	}
	w := try("ha", "/429", "5000000000")
	assert.True(t, w > 59*time.Minute && w <= time.Hour, "Retry-After: 5000000000 paused %v, want an hour", w)
	w = try("hb", "/429", "5000000000", httplimit.WithMaxPause(10*time.Minute))
	assert.True(t, w > 9*time.Minute && w <= 10*time.Minute, "WithMaxPause(10m): paused %v", w)
	w = try("hc", "/503", "3")
	assert.True(t, w > 2*time.Second && w <= 3*time.Second, "503 Retry-After: 3 paused %v", w)
	w = try("hd", "/429", time.Now().Add(4*time.Second).UTC().Format(http.TimeFormat))
	assert.True(t, w > 2*time.Second && w <= 4*time.Second, "Retry-After as an HTTP date 4 s ahead paused %v", w)
	w = try("he", "/bare", "")
	assert.Zero(t, w, "a 429 without Retry-After paused")
	w = try("hf", "/xreset", "")
	assert.Zero(t, w, "X-RateLimit-Reset paused without WithResetHeaders")
	w = try("hg", "/xreset", "", httplimit.WithResetHeaders(true))
	assert.True(t, w > 3*time.Second && w <= 6*time.Second, "X-RateLimit-Reset (Unix time) with WithResetHeaders paused %v", w)

	lim := e.limiter(t, "hx", throttle.PerSecond(1, 0))
	_, err := httplimit.New(lim, httplimit.WithMaxPause(throttle.MaxHorizon+time.Second))
	assert.Error(t, err, "WithMaxPause beyond throttle.MaxHorizon")
}

// TestReviewDOCHTTPRedisDown: with Redis unreachable and no fallback the
// request is never sent (NotSentError matching throttle.ErrUnavailable,
// no retry-after); with FailOpen the request goes, a 429 that cannot be
// stored still reaches the caller and WithPauseErrorHandler hears of it,
// and this Transport's next request, whose max wait is shorter than the
// pause, "is refused at once ... with the pause's end as its retry-after".
func TestReviewDOCHTTPRedisDown(t *testing.T) {
	srv := redistest.Shared(t)
	srv.RequireReal(t)
	p := redistest.NewProxy(t, srv.Addr)
	p.Close()
	o := srv.Options()
	o.Addr = p.Addr()
	o.MaxRetries = -1
	rdb := redis.NewClient(o)
	defer rdb.Close()
	eng, err := throttle.New(rdb, throttle.WithPrefix(redistest.Prefix(t)), throttle.WithTimeout(time.Second))
	require.NoError(t, err)
	up, served := docUpstream(t, func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/429" {
			w.Header().Set("Retry-After", "5")
			w.WriteHeader(http.StatusTooManyRequests)
			return
		}
		fmt.Fprintln(w, "ok")
	})

	lim, err := reserve.New(eng, "hd1", throttle.PerSecond(100, 10), reserve.WithMaxWait(100*time.Millisecond))
	require.NoError(t, err)
	tr, err := httplimit.New(lim)
	require.NoError(t, err)
	body := &docBody{Reader: strings.NewReader("x")}
	req, _ := http.NewRequest(http.MethodPost, up.URL, body)
	resp, err := (&http.Client{Transport: tr}).Do(req)
	if resp != nil {
		resp.Body.Close()
	}
	var ns *httplimit.NotSentError
	require.ErrorAs(t, err, &ns)
	assert.ErrorIs(t, err, throttle.ErrUnavailable)
	_, ok := ns.RetryAfter()
	assert.False(t, ok, "a Redis failure carries no retry-after")
	assert.Zero(t, served.Load(), "a request that could not book was sent")
	assert.True(t, body.closed.Load(), "its body was not closed")

	lim2, err := reserve.New(eng, "hd2", throttle.PerSecond(100, 10), reserve.WithMaxWait(100*time.Millisecond),
		reserve.WithFallback(reserve.FailOpen()))
	require.NoError(t, err)
	var heard atomic.Int64
	tr2, err := httplimit.New(lim2, httplimit.WithPauseErrorHandler(func(_ *http.Request, d time.Duration, err error) {
		heard.Add(1)
	}))
	require.NoError(t, err)
	c2 := &http.Client{Transport: tr2}
	resp, err = c2.Get(up.URL + "/429")
	require.NoError(t, err, "FailOpen: sent; the 429 reaches the caller")
	resp.Body.Close()
	assert.Equal(t, http.StatusTooManyRequests, resp.StatusCode)
	assert.Equal(t, int64(1), heard.Load(), "WithPauseErrorHandler told of the pause it could not store")
	before := served.Load()
	start := time.Now()
	resp, err = c2.Get(up.URL + "/ok")
	if resp != nil {
		resp.Body.Close()
	}
	elapsed := time.Since(start)
	require.Error(t, err, "a request behind an unstored 5 s pause with a 100ms max wait")
	require.ErrorAs(t, err, &ns)
	d, ok := ns.RetryAfter()
	assert.True(t, ok, "refused with the pause's end as its retry-after")
	assert.True(t, d > 4*time.Second && d <= 5*time.Second, "retry-after %v, want the pause's end (~5 s)", d)
	assert.Equal(t, before, served.Load(), "sent during the pause")
	assert.Less(t, elapsed, 2*time.Second, "refused at once")
}

// ---------------------------------------------------------------------------
// Redis unavailable, fallbacks.

// docDown returns an engine whose Redis refuses connections (a closed
// proxy), and its counted client.
func docDown(t *testing.T, opts ...throttle.Option) (*throttle.Engine, *docCounter) {
	t.Helper()
	srv := redistest.Shared(t)
	srv.RequireReal(t)
	p := redistest.NewProxy(t, srv.Addr)
	p.Close()
	o := srv.Options()
	o.Addr = p.Addr()
	o.MaxRetries = -1
	rdb := redis.NewClient(o)
	calls := new(docCounter)
	rdb.AddHook(calls)
	t.Cleanup(func() { _ = rdb.Close() })
	eng, err := throttle.New(rdb, append([]throttle.Option{throttle.WithPrefix(redistest.Prefix(t)), throttle.WithTimeout(time.Second)}, opts...)...)
	require.NoError(t, err)
	return eng, calls
}

// TestReviewDOCRedisDown: without a fallback the error matches
// ErrUnavailable and not ErrReplyLost ("an error matching only
// ErrUnavailable means nothing reached Redis"), the breaker opens
// (Unavailable); FailClosed refuses with a *FallbackError matching
// ErrUnavailable; State "does not consult the fallback"; FailOpen lets the
// whole limit through locally, no more.
func TestReviewDOCRedisDown(t *testing.T) {
	docNoLeak(t)
	eng, _ := docDown(t)
	ctx := context.Background()
	limit := throttle.PerSecond(1, 2)

	bare, err := reserve.New(eng, "d0", limit)
	require.NoError(t, err)
	err = bare.Acquire(ctx, "k")
	require.ErrorIs(t, err, throttle.ErrUnavailable)
	assert.NotErrorIs(t, err, throttle.ErrReplyLost, "connection refused: nothing reached Redis")
	down, next := eng.Unavailable()
	assert.True(t, down, "the breaker opened")
	if down {
		assert.Positive(t, next, "time to the next probe")
	}
	_, err = bare.Allow(ctx, "k")
	assert.ErrorIs(t, err, throttle.ErrUnavailable, "Allow without a fallback")

	closed, err := reserve.New(eng, "d1", limit, reserve.WithFallback(reserve.FailClosed()))
	require.NoError(t, err)
	r, err := closed.Reserve(ctx, "k")
	if err == nil {
		require.False(t, r.OK(), "FailClosed booked")
		assert.True(t, r.Fallback())
		var fe *reserve.FallbackError
		assert.ErrorAs(t, r.Err(), &fe)
		assert.ErrorIs(t, r.Err(), throttle.ErrUnavailable, "FailClosed's refusal matches ErrUnavailable")
	} else {
		assert.ErrorIs(t, err, throttle.ErrUnavailable)
	}
	err = closed.Acquire(ctx, "k")
	assert.ErrorIs(t, err, throttle.ErrUnavailable, "FailClosed Acquire")
	res, err := closed.Allow(ctx, "k")
	if err == nil {
		assert.False(t, res.Allowed, "FailClosed let a check through")
	} else {
		assert.ErrorIs(t, err, throttle.ErrUnavailable)
	}

	open, err := reserve.New(eng, "d2", limit, reserve.WithFallback(reserve.FailOpen()), reserve.WithMaxWait(0))
	require.NoError(t, err)
	_, err = open.State(ctx, "k")
	assert.ErrorIs(t, err, throttle.ErrUnavailable, "State does not consult the fallback")
	allowed := 0
	for i := 0; i < 10; i++ {
		res, err := open.Allow(ctx, "k")
		require.NoError(t, err)
		if res.Allowed {
			allowed++
		}
	}
	// Ten calls within well under a second at 1/s burst 2: the whole
	// limit's burst+1, and at most one more if a second passed.
	assert.GreaterOrEqual(t, allowed, limit.Burst+1, "FailOpen admits the whole limit")
	assert.LessOrEqual(t, allowed, limit.Burst+2, "FailOpen admits no more than the limit")
	r, err = open.Reserve(ctx, "k2")
	require.NoError(t, err)
	assert.True(t, r.OK())
	assert.True(t, r.Fallback(), "answered by the fallback")
}

// TestReviewDOCRedisStopped: a real redis-server stopped, then restarted
// on the same port: calls while it is away fail with ErrUnavailable well
// within the engine's timeout budget (no go-redis seconds-long waits: a
// control bound of 5 timeouts), LocalShare admits this process's share
// (burst+1 at once for one instance), and "the first success restores
// shared limiting" once Redis is back.
func TestReviewDOCRedisStopped(t *testing.T) {
	srv := redistest.Start(t)
	o := srv.Options()
	o.MaxRetries = -1
	rdb := redis.NewClient(o)
	defer rdb.Close()
	const timeout = 200 * time.Millisecond
	eng, err := throttle.New(rdb, throttle.WithTimeout(timeout), throttle.WithProbeBackoff(5*time.Millisecond, 50*time.Millisecond))
	require.NoError(t, err)
	ctx := context.Background()
	limit := throttle.PerMinute(60, 2)
	bare, err := reserve.New(eng, "s0", limit)
	require.NoError(t, err)
	shared, err := reserve.New(eng, "s1", limit, reserve.WithFallback(reserve.LocalShare(time.Hour, 1, 100)), reserve.WithMaxWait(0))
	require.NoError(t, err)
	redistest.UntilOK(t, func() error { return bare.Acquire(ctx, "k") })

	srv.Stop()
	var worst time.Duration
	for i := 0; i < 10; i++ {
		start := time.Now()
		err := bare.Acquire(ctx, "k")
		worst = max(worst, time.Since(start))
		require.ErrorIs(t, err, throttle.ErrUnavailable)
	}
	assert.Less(t, worst, 5*timeout, "a call while Redis is away took %v", worst)
	admitted := 0
	for i := 0; i < 6; i++ {
		r, err := shared.Reserve(ctx, "k")
		require.NoError(t, err)
		assert.True(t, r.Fallback(), "LocalShare answers while Redis is away")
		if r.OK() {
			admitted++
		}
	}
	assert.Equal(t, limit.Burst+1, admitted, "one instance's share: burst+1 at once, then a second apart")

	srv.Restart(t)
	redistest.UntilOK(t, func() error { return bare.Acquire(ctx, "k2") })
	r, err := shared.Reserve(ctx, "k3")
	require.NoError(t, err)
	assert.False(t, r.Fallback(), "shared limiting restored after Redis came back")
	down, _ := eng.Unavailable()
	assert.False(t, down)
}

// ---------------------------------------------------------------------------
// Latency, lost replies, contexts.

// TestReviewDOCLatency: at 40 ms each way (SetLatency), WithMaxWait(0)
// "means only an immediate slot, whatever the latency" (an idle key's
// first request is booked); a request whose slot lies past its deadline is
// refused at once (well before that deadline) and books nothing; a Cancel
// gives the booking back exactly.
func TestReviewDOCLatency(t *testing.T) {
	e := newDocEnv(t)
	p := redistest.NewProxy(t, e.srv.Addr)
	o := e.srv.Options()
	o.Addr = p.Addr()
	o.MaxRetries = -1
	rdb := redis.NewClient(o)
	defer rdb.Close()
	ctx := context.Background()
	require.NoError(t, rdb.Ping(ctx).Err())
	eng, err := throttle.New(rdb, throttle.WithPrefix(e.prefix), throttle.WithTimeout(2*time.Second))
	require.NoError(t, err)
	require.NoError(t, eng.Load(ctx))
	p.SetLatency(40 * time.Millisecond)

	now0, err := reserve.New(eng, "lat", throttle.PerSecond(10, 0), reserve.WithMaxWait(0))
	require.NoError(t, err)
	require.NoError(t, now0.Acquire(ctx, "k"), "an immediate slot with WithMaxWait(0) at 80ms round trips")

	slow, err := reserve.New(eng, "lat2", throttle.PerMinute(1, 0))
	require.NoError(t, err)
	require.NoError(t, slow.Acquire(ctx, "k"))
	before, _ := e.tat(t, "lat2", "k")
	dctx, cancel := context.WithTimeout(ctx, 3*time.Second)
	defer cancel()
	err = slow.Acquire(dctx, "k")
	require.ErrorIs(t, err, reserve.ErrWouldExceedDeadline)
	assert.NoError(t, dctx.Err(), "the refusal came only at the deadline, not at once")
	v, _ := e.tat(t, "lat2", "k")
	assert.Equal(t, before, v, "the refusal booked")

	r, err := slow.Reserve(ctx, "k")
	require.NoError(t, err)
	require.True(t, r.OK())
	require.NoError(t, r.Cancel(ctx))
	v, _ = e.tat(t, "lat2", "k")
	assert.Equal(t, before, v, "Cancel through 40 ms latency")
}

// TestReviewDOCCallerDeadlineKeepsReply: "A caller's deadline does not lose
// the reply of a booking or a check ...: once sent, such a call's reply is
// read whatever the caller's context does (the engine's timeout bounds
// it), and a caller whose context ended meanwhile gets the context's error
// while what it booked or counted is given back" (README, Lost replies).
// The reply is held back 200 ms (SetReplyDelay) against a 100 ms deadline
// and a 2 s engine timeout: the error is the context's, not ErrReplyLost,
// and the key ends where it was. Each call must have been sent (counted on
// the client): one whose deadline passed before it is refused unsent, with
// the same error, and the test passed without its premise when the
// deadline was 30 ms and a stall of 40 ms came before the call.
func TestReviewDOCCallerDeadlineKeepsReply(t *testing.T) {
	e := newDocEnv(t)
	p := redistest.NewProxy(t, e.srv.Addr)
	o := e.srv.Options()
	o.Addr = p.Addr()
	o.MaxRetries = -1
	rdb := redis.NewClient(o)
	defer rdb.Close()
	ctx := context.Background()
	require.NoError(t, rdb.Ping(ctx).Err())
	calls := callcount.Attach(rdb)
	eng, err := throttle.New(rdb, throttle.WithPrefix(e.prefix), throttle.WithTimeout(2*time.Second))
	require.NoError(t, err)
	require.NoError(t, eng.Load(ctx))
	limit := throttle.PerMinute(10, 5)
	lim, err := reserve.New(eng, "cd", limit)
	require.NoError(t, err)
	direct := e.limiter(t, "cd", limit)
	_, err = direct.ReserveN(ctx, "k", 2) // the key exists, TAT 12 s ahead
	require.NoError(t, err)
	before, _ := e.tat(t, "cd", "k")

	p.SetReplyDelay(200 * time.Millisecond)
	for _, op := range []struct {
		name string
		call func(ctx context.Context) error
	}{
		{"Reserve", func(ctx context.Context) error { _, err := lim.Reserve(ctx, "k"); return err }},
		{"Allow", func(ctx context.Context) error { _, err := lim.Allow(ctx, "k"); return err }},
		{"Acquire", func(ctx context.Context) error { return lim.Acquire(ctx, "k") }},
	} {
		dctx, cancel := context.WithTimeout(ctx, 100*time.Millisecond)
		sent := calls.Load()
		err := op.call(dctx)
		cancel()
		require.Greater(t, calls.Load(), sent, "%s: the test's premise: the call was sent before its deadline (%v)", op.name, err)
		assert.ErrorIs(t, err, context.DeadlineExceeded, "%s: the context's error", op.name)
		assert.NotErrorIs(t, err, throttle.ErrReplyLost, "%s: the reply was read, not lost", op.name)
		// Given back "within a second more".
		assert.Eventually(t, func() bool { v, _ := e.tat(t, "cd", "k"); return v == before }, 3*time.Second, 5*time.Millisecond,
			"%s: what it booked or counted was not given back", op.name)
	}
	p.SetReplyDelay(0)
}

// TestReviewDOCLostReply: a booking whose reply is lost (held back past
// the engine's timeout) matches ErrReplyLost and ErrUnavailable; it may
// have booked (quota wasted), never more than its own units: the key
// advanced by at most one request's interval.
func TestReviewDOCLostReply(t *testing.T) {
	e := newDocEnv(t)
	p := redistest.NewProxy(t, e.srv.Addr)
	o := e.srv.Options()
	o.Addr = p.Addr()
	o.MaxRetries = -1
	rdb := redis.NewClient(o)
	defer rdb.Close()
	ctx := context.Background()
	require.NoError(t, rdb.Ping(ctx).Err())
	eng, err := throttle.New(rdb, throttle.WithPrefix(e.prefix), throttle.WithTimeout(100*time.Millisecond))
	require.NoError(t, err)
	require.NoError(t, eng.Load(ctx))
	limit := throttle.PerMinute(10, 0)
	lim, err := reserve.New(eng, "lr", limit)
	require.NoError(t, err)
	direct := e.limiter(t, "lr", limit)
	require.NoError(t, direct.Acquire(ctx, "k"))
	before, _ := e.tat(t, "lr", "k")
	p.SetReplyDelay(400 * time.Millisecond)
	_, err = lim.Reserve(ctx, "k")
	require.Error(t, err)
	assert.ErrorIs(t, err, throttle.ErrUnavailable)
	assert.ErrorIs(t, err, throttle.ErrReplyLost)
	p.SetReplyDelay(0)
	v, _ := e.tat(t, "lr", "k")
	assert.LessOrEqual(t, v-before, limit.Interval().Microseconds(), "a lost reply booked more than its own unit")
}

// TestReviewDOCReserveBatchEndedContexts: "A request whose Context has
// ended by the time the call is sent books nothing: its Reservation is not
// OK and its Err is the context's error (no call is made if every
// request's has)" (reserve.ReserveBatch).
func TestReviewDOCReserveBatchEndedContexts(t *testing.T) {
	e := newDocEnv(t)
	lim := e.limiter(t, "rb", throttle.PerSecond(10, 5))
	ctx := context.Background()
	gone, cancel := context.WithCancel(ctx)
	cancel()
	reqs := []reserve.BatchRequest{{N: 1, Context: gone}, {N: 2, Context: gone}}
	rs, err := lim.ReserveBatch(ctx, "k", reqs)
	require.NoError(t, err)
	require.Len(t, rs, 2)
	for i, r := range rs {
		assert.False(t, r.OK(), "request %d", i)
		assert.ErrorIs(t, r.Err(), context.Canceled, "request %d", i)
	}
	assert.Zero(t, e.calls.cmds.Load(), "a call was made though every request's context had ended: %s", e.calls.seen())
	_, ok := e.tat(t, "rb", "k")
	assert.False(t, ok, "booked")

	// One ended, one live: the live one is booked, the ended one is not.
	rs, err = lim.ReserveBatch(ctx, "k", []reserve.BatchRequest{{N: 1, Context: gone}, {N: 1}})
	require.NoError(t, err)
	assert.False(t, rs[0].OK())
	assert.ErrorIs(t, rs[0].Err(), context.Canceled)
	assert.True(t, rs[1].OK())
	st, err := lim.State(ctx, "k")
	require.NoError(t, err)
	assert.Equal(t, 5, st.Available, "exactly one unit booked")
}

// TestReviewDOCRefundWays: the engine's Refund is idempotent ("a second
// call for b ... gives nothing and returns 0"); a booking given back one
// way (RefundAll) and then the other (RefundUnused) fails with
// ErrInvalidRequest, making no Redis call; refunding a refused booking is a
// no-op.
func TestReviewDOCRefundWays(t *testing.T) {
	e := newDocEnv(t)
	limit := throttle.PerMinute(10, 0)
	ctx := context.Background()
	keys := []string{"rw:{k}"}
	limits := []throttle.Limit{limit}
	a, err := e.eng.Book(ctx, "rw:{k}", limit, throttle.Request{N: 1, MaxWait: throttle.Forever})
	require.NoError(t, err)
	b, err := e.eng.Book(ctx, "rw:{k}", limit, throttle.Request{N: 1, MaxWait: throttle.Forever})
	require.NoError(t, err)
	require.True(t, a.OK && b.OK)
	assert.True(t, a.Before(b))
	assert.False(t, b.Before(a))
	given, err := e.eng.Refund(ctx, "rw:{k}", limit, b)
	require.NoError(t, err)
	assert.Equal(t, limit.Interval(), given)
	given, err = e.eng.Refund(ctx, "rw:{k}", limit, b)
	require.NoError(t, err)
	assert.Zero(t, given, "a second Refund gives nothing")
	e.calls.cmds.Store(0)
	_, err = e.eng.RefundUnused(ctx, keys, limits, b)
	assert.ErrorIs(t, err, throttle.ErrInvalidRequest, "RefundUnused after RefundAll")
	assert.Zero(t, e.calls.cmds.Load(), "RefundUnused after RefundAll made a call")

	refused, err := e.eng.Book(ctx, "rw:{k}", limit, throttle.Request{N: 1, MaxWait: 0})
	require.NoError(t, err)
	require.False(t, refused.OK)
	before, _ := e.tat(t, "rw", "k")
	given, err = e.eng.Refund(ctx, "rw:{k}", limit, refused)
	require.NoError(t, err)
	assert.Zero(t, given, "refunding a refusal")
	v, _ := e.tat(t, "rw", "k")
	assert.Equal(t, before, v)
	assert.True(t, refused.End().IsZero(), "End of a refusal is the zero Time")
}

// ---------------------------------------------------------------------------
// deadline, asynqadapter, metrics: the documented edges.

// TestReviewDOCDeadlineBudget: deadline.Budget: the smaller of cap and the
// time left less work; bound names the binding limit; "A negative work
// counts as none. The arithmetic saturates"; NoCap; RetryAfterOf finds an
// *Error anywhere in a chain; Refuse.
func TestReviewDOCDeadlineBudget(t *testing.T) {
	now := time.Now()
	ctx := context.Background()
	b, bound := deadline.Budget(ctx, now, 2*time.Second, 0)
	assert.Equal(t, 2*time.Second, b)
	assert.ErrorIs(t, bound, deadline.ErrMaxWaitExceeded)
	b, bound = deadline.Budget(ctx, now, deadline.NoCap, time.Second)
	assert.Equal(t, deadline.NoCap, b, "no deadline, no cap")
	_ = bound

	dctx, cancel := context.WithDeadline(ctx, now.Add(time.Second))
	defer cancel()
	b, bound = deadline.Budget(dctx, now, 5*time.Second, 300*time.Millisecond)
	assert.Equal(t, 700*time.Millisecond, b)
	assert.ErrorIs(t, bound, deadline.ErrWouldExceedDeadline)
	b, _ = deadline.Budget(dctx, now, 5*time.Second, -time.Hour)
	assert.Equal(t, time.Second, b, "a negative work counts as none")
	b, bound = deadline.Budget(dctx, now, 500*time.Millisecond, 300*time.Millisecond)
	assert.Equal(t, 500*time.Millisecond, b)
	assert.ErrorIs(t, bound, deadline.ErrMaxWaitExceeded)

	far, cancel2 := context.WithDeadline(ctx, time.Unix(1<<40, 0))
	defer cancel2()
	b, _ = deadline.Budget(far, time.Unix(0, 0).Add(-100*365*24*time.Hour), deadline.NoCap, 0)
	assert.Positive(t, b, "a deadline centuries away saturates positive")
	past, cancel3 := context.WithDeadline(ctx, time.Unix(-(1<<40), 0))
	defer cancel3()
	b, _ = deadline.Budget(past, now, deadline.NoCap, time.Hour)
	assert.Negative(t, b, "a deadline long past saturates negative")

	e := deadline.Refuse(deadline.ErrMaxWaitExceeded, time.Second, 3*time.Second)
	assert.ErrorIs(t, e, deadline.ErrMaxWaitExceeded)
	assert.Equal(t, 3*time.Second, e.RetryAfter)
	assert.Equal(t, time.Second, e.Budget)
	wrapped := fmt.Errorf("outer: %w", fmt.Errorf("inner: %w", e))
	d, ok := deadline.RetryAfterOf(wrapped)
	assert.True(t, ok)
	assert.Equal(t, 3*time.Second, d)
	_, ok = deadline.RetryAfterOf(errors.New("x"))
	assert.False(t, ok)
}

// TestReviewDOCAsynqOptions: NewMiddleware returns ErrInvalidOption for a
// nil limiter or a bad option and makes no network call; Middleware panics
// instead; WithBookedRetries refuses another engine, a layered limiter and
// a horizon out of (0, MaxHorizon]; a task whose deadline is closer than
// the work estimate is archived at once (SkipRetry) "with no call to the
// limiter's Redis", and never runs; RetryDelayFunc, IsFailure, IsRefusal.
func TestReviewDOCAsynqOptions(t *testing.T) {
	e := newDocEnv(t)
	lim := e.limiter(t, "aq", throttle.PerSecond(10, 2), reserve.WithMaxWait(time.Second))
	layered := e.limiter(t, "aq2", throttle.PerSecond(10, 2), reserve.WithLimit(throttle.PerDay(1000, 10)))
	other, err := throttle.New(e.crdb, throttle.WithPrefix(e.prefix))
	require.NoError(t, err)

	_, err = asynqadapter.NewMiddleware(nil)
	assert.ErrorIs(t, err, asynqadapter.ErrInvalidOption, "nil limiter")
	for name, opt := range map[string]asynqadapter.Option{
		"another engine":          asynqadapter.WithBookedRetries(other, time.Minute),
		"horizon 0":               asynqadapter.WithBookedRetries(lim.Engine(), 0),
		"horizon negative":        asynqadapter.WithBookedRetries(lim.Engine(), -time.Second),
		"horizon over MaxHorizon": asynqadapter.WithBookedRetries(lim.Engine(), throttle.MaxHorizon+time.Hour),
		"nil engine":              asynqadapter.WithBookedRetries(nil, time.Minute),
		"nil key func":            asynqadapter.WithKey(nil),
		"negative max wait":       asynqadapter.WithMaxWait(-time.Second),
		"negative work":           asynqadapter.WithWorkEstimate(-time.Second),
	} {
		_, err := asynqadapter.NewMiddleware(lim, opt)
		assert.ErrorIs(t, err, asynqadapter.ErrInvalidOption, name)
		assert.Panics(t, func() { asynqadapter.Middleware(lim, opt) }, "Middleware panics: %s", name)
	}
	_, err = asynqadapter.NewMiddleware(layered, asynqadapter.WithBookedRetries(layered.Engine(), time.Minute))
	assert.ErrorIs(t, err, asynqadapter.ErrInvalidOption, "booked retries on a layered limiter")
	_, err = asynqadapter.NewLeaseMiddleware(nil)
	assert.ErrorIs(t, err, asynqadapter.ErrInvalidOption, "nil semaphore")
	assert.Zero(t, e.calls.cmds.Load(), "NewMiddleware made a call: %s", e.calls.seen())

	var ran atomic.Bool
	mw, err := asynqadapter.NewMiddleware(lim, asynqadapter.WithWorkEstimate(time.Second))
	require.NoError(t, err)
	h := mw(asynq.HandlerFunc(func(context.Context, *asynq.Task) error { ran.Store(true); return nil }))
	dctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	defer cancel()
	err = h.ProcessTask(dctx, asynq.NewTask("aq:t", nil))
	assert.ErrorIs(t, err, asynq.SkipRetry, "a deadline closer than the work estimate")
	assert.False(t, asynqadapter.IsRefusal(err), "archived: not a refusal")
	assert.False(t, ran.Load())
	assert.Zero(t, e.calls.cmds.Load(), "the limiter's Redis was called: %s", e.calls.seen())

	// RetryDelayFunc: refusals come back after their RetryAfter, rounded
	// up to a whole second; others go to next.
	rl := &asynqadapter.RateLimitedError{Key: "k", RetryAfter: 1200 * time.Millisecond, Err: deadline.Refuse(deadline.ErrMaxWaitExceeded, 0, 1200*time.Millisecond)}
	assert.True(t, asynqadapter.IsRefusal(rl))
	assert.False(t, asynqadapter.IsFailure(rl), "a refusal is not a failure")
	assert.True(t, asynqadapter.IsFailure(errors.New("boom")))
	assert.True(t, asynqadapter.IsRefusal(fmt.Errorf("wrapped: %w", rl)))
	assert.False(t, asynqadapter.IsRefusal(fmt.Errorf("%w: %w", rl, asynq.SkipRetry)), "a refusal that ends the task")
	var nextCalled bool
	f := asynqadapter.RetryDelayFunc(func(int, error, *asynq.Task) time.Duration { nextCalled = true; return 42 * time.Second })
	d := f(0, rl, asynq.NewTask("k", nil))
	assert.GreaterOrEqual(t, d, 1200*time.Millisecond, "a refusal comes back no earlier than its RetryAfter")
	assert.LessOrEqual(t, d, 2200*time.Millisecond, "rounded up to asynq's whole second")
	assert.False(t, nextCalled)
	assert.Equal(t, 42*time.Second, f(0, errors.New("boom"), asynq.NewTask("k", nil)), "other errors go to next")
	assert.Positive(t, asynqadapter.RetryDelayFunc(nil)(1, errors.New("boom"), asynq.NewTask("k", nil)), "nil next: asynq's default")
}

// TestReviewDOCMetricsOptions: metrics.New's options (a bad one is an
// error); two Collectors in one registry need different const labels or
// namespaces; every metric labelled by limiter, never by subject; the
// documented outcomes counted.
func TestReviewDOCMetricsOptions(t *testing.T) {
	for name, opt := range map[string]metrics.Option{
		"bad namespace":       metrics.WithNamespace("bad-ns"),
		"namespace digit":     metrics.WithNamespace("1ns"),
		"reserved label":      metrics.WithConstLabels(prometheus.Labels{"__x": "y"}),
		"own label limiter":   metrics.WithConstLabels(prometheus.Labels{"limiter": "y"}),
		"own label outcome":   metrics.WithConstLabels(prometheus.Labels{"outcome": "y"}),
		"own label node":      metrics.WithConstLabels(prometheus.Labels{"node": "y"}),
		"invalid label name":  metrics.WithConstLabels(prometheus.Labels{"a-b": "y"}),
		"invalid UTF-8 value": metrics.WithConstLabels(prometheus.Labels{"app": "\xff"}),
	} {
		_, err := metrics.New(opt)
		assert.Error(t, err, name)
	}
	_, err := metrics.New(metrics.WithNamespace(""))
	assert.NoError(t, err, "an empty namespace: no prefix")

	reg := prometheus.NewRegistry()
	m1, err := metrics.New()
	require.NoError(t, err)
	m2, err := metrics.New()
	require.NoError(t, err)
	require.NoError(t, reg.Register(m1))
	assert.Error(t, reg.Register(m2), "the registry refuses a second Collector of the same metrics")
	m3, err := metrics.New(metrics.WithNamespace("payments"))
	require.NoError(t, err)
	assert.NoError(t, reg.Register(m3), "a different namespace")

	e := newDocEnv(t, throttle.WithObserver(m1))
	lim := e.limiter(t, "mx", throttle.PerMinute(10, 1), reserve.WithMaxWait(0))
	ctx := context.Background()
	for i := 0; i < 3; i++ {
		_, err := lim.Reserve(ctx, "tenant-secret")
		require.NoError(t, err)
	}
	for i := 0; i < 1; i++ {
		_, err := lim.Allow(ctx, "tenant-secret")
		require.NoError(t, err)
	}
	view, err := lim.With(reserve.WithoutMaxWait())
	require.NoError(t, err)
	r, err := view.Reserve(ctx, "tenant-secret")
	require.NoError(t, err)
	require.NoError(t, r.Cancel(ctx))
	mfs, err := reg.Gather()
	require.NoError(t, err)
	got := map[string]float64{}
	for _, mf := range mfs {
		for _, m := range mf.GetMetric() {
			labels := map[string]string{}
			for _, lp := range m.GetLabel() {
				labels[lp.GetName()] = lp.GetValue()
				assert.NotContains(t, lp.GetValue(), "tenant-secret", "%s labelled by subject", mf.GetName())
			}
			if labels["limiter"] != "mx" && labels["limiter"] != "" {
				continue
			}
			k := mf.GetName()
			if o, ok := labels["outcome"]; ok {
				k += "{" + o + "}"
			}
			if m.GetCounter() != nil {
				got[k] += m.GetCounter().GetValue()
			}
		}
	}
	t.Logf("counters: %v", got)
	assert.Equal(t, 3.0, got["slotbook_decisions_total{booked}"], "2 booked with max wait 0 + 1 by the view")
	assert.Equal(t, 1.0, got["slotbook_decisions_total{refused}"])
	assert.Equal(t, 1.0, got["slotbook_decisions_total{denied}"])
	assert.Equal(t, 1.0, got["slotbook_refunds_total"])
	assert.InDelta(t, 6.0, got["slotbook_refunded_seconds_total"], 1e-6, "one interval (6 s) given back")
}

// TestReviewDOCMetricsTwoCollectors (FAILS on the current code): README
// (Metrics): "two Collectors in one registry need different
// metrics.WithConstLabels (say {"engine": "payments"}) or
// metrics.WithNamespace, or the registry refuses the second"; metrics doc:
// "Two Collectors in one registry must differ in WithNamespace or
// WithConstLabels (for instance {"engine": "payments"})". Doing just that,
// a default Collector and one WithConstLabels({"engine": "payments"}), the
// registry refuses the second: Prometheus wants every collector of one
// metric name to carry the same label names, so both need the "engine"
// label, with different values. The recipe as written fails at start-up.
func TestReviewDOCMetricsTwoCollectors(t *testing.T) {
	reg := prometheus.NewRegistry()
	plain, err := metrics.New()
	require.NoError(t, err)
	payments, err := metrics.New(metrics.WithConstLabels(prometheus.Labels{"engine": "payments"}))
	require.NoError(t, err)
	require.NoError(t, reg.Register(plain))
	// The docs now say so: one Collector without the label beside one with
	// it is refused too.
	assert.Error(t, reg.Register(payments), "a second Collector WithConstLabels({engine: payments}) beside a default one")

	// What does work: the same label names on both, different values.
	reg2 := prometheus.NewRegistry()
	a, err := metrics.New(metrics.WithConstLabels(prometheus.Labels{"engine": "orders"}))
	require.NoError(t, err)
	b, err := metrics.New(metrics.WithConstLabels(prometheus.Labels{"engine": "payments"}))
	require.NoError(t, err)
	require.NoError(t, reg2.Register(a))
	require.NoError(t, reg2.Register(b), "the same const label names, different values")
}

// ---------------------------------------------------------------------------
// Calls per operation, as documented.

// TestReviewDOCCallsPerOperation: "lim.Acquire(ctx, key) // one Redis
// call, then sleep until the slot" (README), Allow "1 per check",
// ReserveN "with one Redis call", State "one Redis call", Cancel one call
// before the slot; lease: "Acquire without contention is one Redis call,
// Release one"; httplimit WithPauseCheck: "one more Redis call (a read) for
// each request that waited", none for one that did not.
func TestReviewDOCCallsPerOperation(t *testing.T) {
	e := newDocEnv(t)
	ctx := context.Background()
	lim := e.limiter(t, "cp", throttle.PerSecond(10, 0))
	count := func(what string, want int64, f func()) {
		t.Helper()
		e.calls.cmds.Store(0)
		e.calls.mu.Lock()
		e.calls.names = nil
		e.calls.mu.Unlock()
		f()
		assert.Equal(t, want, e.calls.cmds.Load(), "%s: calls %s", what, e.calls.seen())
	}
	count("Acquire, immediate", 1, func() { require.NoError(t, lim.Acquire(ctx, "k")) })
	count("Acquire, waits 100ms", 1, func() { require.NoError(t, lim.Acquire(ctx, "k")) })
	count("Allow", 1, func() { _, err := lim.Allow(ctx, "k"); require.NoError(t, err) })
	var r *reserve.Reservation
	count("Reserve", 1, func() {
		var err error
		r, err = lim.Reserve(ctx, "k")
		require.NoError(t, err)
	})
	count("Cancel before the slot", 1, func() { require.NoError(t, r.Cancel(ctx)) })
	count("State", 1, func() { _, err := lim.State(ctx, "k"); require.NoError(t, err) })

	sem, err := lease.New(e.eng, "cp", 2)
	require.NoError(t, err)
	defer sem.Close(ctx)
	require.NoError(t, sem.Load(ctx))
	var l *lease.Lease
	count("lease Acquire, uncontended", 1, func() {
		l, err = sem.Acquire(ctx, "k")
		require.NoError(t, err)
	})
	count("lease Release", 1, func() { require.NoError(t, l.Release(ctx)) })

	up, _ := docUpstream(t, func(w http.ResponseWriter, r *http.Request) { fmt.Fprintln(w, "ok") })
	hl := e.limiter(t, "cph", throttle.PerSecond(10, 0))
	tr, err := httplimit.New(hl, httplimit.WithPauseCheck(true))
	require.NoError(t, err)
	c := &http.Client{Transport: tr}
	get := func() {
		resp, err := c.Get(up.URL)
		require.NoError(t, err)
		resp.Body.Close()
	}
	count("httplimit request that did not wait (WithPauseCheck)", 1, get)
	count("httplimit request that waited (WithPauseCheck)", 2, get)
}

// ---------------------------------------------------------------------------
// Data and configuration errors are not outages.

// TestReviewDOCNotAnOutage: a corrupt stored value is ErrCorruptState
// naming the key, nothing is written over it, the breaker stays closed and
// a fallback does not answer ("no: fix the configuration"); Reset clears
// it. A key of another type (WRONGTYPE) and an ACL user without permission
// (NOPERM) likewise: "Redis's error as is", FailOpen must not hide it.
func TestReviewDOCNotAnOutage(t *testing.T) {
	e := newDocEnv(t)
	ctx := context.Background()
	lim := e.limiter(t, "na", throttle.PerSecond(10, 2), reserve.WithFallback(reserve.FailOpen()))
	key := e.prefix + "na:{k}"
	require.NoError(t, e.rdb.Set(ctx, key, "garbage", 0).Err())
	_, err := lim.Reserve(ctx, "k")
	require.ErrorIs(t, err, throttle.ErrCorruptState)
	assert.Contains(t, err.Error(), "na:{k}", "the error names the key")
	assert.NotErrorIs(t, err, throttle.ErrUnavailable)
	err = lim.Acquire(ctx, "k")
	assert.ErrorIs(t, err, throttle.ErrCorruptState, "Acquire: FailOpen must not answer for a corrupt key")
	_, err = lim.Allow(ctx, "k")
	assert.ErrorIs(t, err, throttle.ErrCorruptState, "Allow")
	_, err = lim.State(ctx, "k")
	assert.ErrorIs(t, err, throttle.ErrCorruptState, "State")
	v, _ := e.rdb.Get(ctx, key).Result()
	assert.Equal(t, "garbage", v, "written over")
	down, _ := e.eng.Unavailable()
	assert.False(t, down, "the breaker opened for corrupt state")
	// Beyond MaxHorizon plus the burst: corrupt too.
	tm := e.now(t)
	far := tm.Add(throttle.MaxHorizon + time.Hour).UnixMicro()
	require.NoError(t, e.rdb.Set(ctx, key, far, 0).Err())
	_, err = lim.Reserve(ctx, "k")
	assert.ErrorIs(t, err, throttle.ErrCorruptState, "a TAT beyond MaxHorizon + burst")
	require.NoError(t, lim.Reset(ctx, "k"))
	require.NoError(t, lim.Acquire(ctx, "k"), "after Reset")

	require.NoError(t, e.rdb.Del(ctx, key).Err())
	require.NoError(t, e.rdb.RPush(ctx, key, "x").Err())
	_, err = lim.Reserve(ctx, "k")
	require.Error(t, err)
	assert.NotErrorIs(t, err, throttle.ErrUnavailable, "WRONGTYPE is not an outage")
	down, _ = e.eng.Unavailable()
	assert.False(t, down, "the breaker opened for WRONGTYPE")
	require.NoError(t, lim.Reset(ctx, "k"))
	require.NoError(t, lim.Acquire(ctx, "k"), "after Reset of a WRONGTYPE key")

	// NOPERM: a user who may not run scripts.
	user := "docnoperm" + strconv.FormatInt(time.Now().UnixNano(), 36)
	require.NoError(t, e.rdb.Do(ctx, "ACL", "SETUSER", user, "on", ">pw", "~*", "+@all", "-evalsha", "-eval", "-evalsha_ro", "-eval_ro", "-fcall").Err())
	t.Cleanup(func() { e.rdb.Do(context.Background(), "ACL", "DELUSER", user) })
	o := e.srv.Options()
	o.Username, o.Password = user, "pw"
	o.MaxRetries = -1
	urdb := redis.NewClient(o)
	defer urdb.Close()
	ueng, err := throttle.New(urdb, throttle.WithPrefix(e.prefix), throttle.WithTimeout(5*time.Second))
	require.NoError(t, err)
	ulim, err := reserve.New(ueng, "na", throttle.PerSecond(10, 2), reserve.WithFallback(reserve.FailOpen()))
	require.NoError(t, err)
	err = ulim.Acquire(ctx, "u")
	require.Error(t, err, "FailOpen answered for NOPERM")
	assert.Contains(t, err.Error(), "NOPERM")
	assert.NotErrorIs(t, err, throttle.ErrUnavailable)
	down, _ = ueng.Unavailable()
	assert.False(t, down, "the breaker opened for NOPERM")
}

// TestReviewDOCRing: "any go-redis client: Client, Cluster, Ring, Sentinel"
// (README): a Ring of one shard books, refuses, cancels and reads state.
func TestReviewDOCRing(t *testing.T) {
	e := newDocEnv(t)
	ring := redis.NewRing(&redis.RingOptions{Addrs: map[string]string{"a": e.srv.Addr}, ContextTimeoutEnabled: true, MaxRetries: -1})
	defer ring.Close()
	eng, err := throttle.New(ring, throttle.WithPrefix(e.prefix), throttle.WithTimeout(5*time.Second))
	require.NoError(t, err)
	ctx := context.Background()
	lim, err := reserve.New(eng, "rg", throttle.PerMinute(10, 1), reserve.WithMaxWait(10*time.Second))
	require.NoError(t, err)
	require.NoError(t, lim.Acquire(ctx, "k"))
	require.NoError(t, lim.Acquire(ctx, "k"))
	before, _ := e.tat(t, "rg", "k")
	r, err := lim.Reserve(ctx, "k")
	require.NoError(t, err)
	require.True(t, r.OK())
	require.NoError(t, r.Cancel(ctx))
	v, _ := e.tat(t, "rg", "k")
	assert.Equal(t, before, v)
	r, err = lim.ReserveN(ctx, "k", 2)
	require.NoError(t, err)
	assert.ErrorIs(t, r.Err(), reserve.ErrMaxWaitExceeded)
	st, err := lim.State(ctx, "k")
	require.NoError(t, err)
	assert.Equal(t, before, docMicros(st.Keys[0].TAT))
	ok, _ := eng.UnavailableFor(ctx, "rg:{k}")
	assert.False(t, ok)
}

// TestReviewDOCWorkEstimateAndWait: WithWorkEstimate "is subtracted from
// the context's deadline: a request whose slot would not leave that much
// time is refused with ErrWouldExceedDeadline"; Reservation.Wait: "If ctx
// is done first, it cancels the reservation and returns ctx's error".
func TestReviewDOCWorkEstimateAndWait(t *testing.T) {
	e := newDocEnv(t)
	ctx := context.Background()
	limit := throttle.Every(800*time.Millisecond, 1, 0)
	lim := e.limiter(t, "we", limit, reserve.WithWorkEstimate(time.Second))
	assert.Equal(t, time.Second, lim.WorkEstimate())
	require.NoError(t, lim.Acquire(ctx, "k")) // no deadline: the estimate does not apply
	before, _ := e.tat(t, "we", "k")
	tight, cancel := context.WithTimeout(ctx, 1500*time.Millisecond) // 0.5 s budget < 0.8 s
	defer cancel()
	r, err := lim.Reserve(tight, "k")
	require.NoError(t, err)
	require.False(t, r.OK(), "a slot ~0.8 s out with 1.5 s to the deadline and 1 s of work")
	assert.ErrorIs(t, r.Err(), reserve.ErrWouldExceedDeadline)
	var de *deadline.Error
	require.ErrorAs(t, r.Err(), &de)
	assert.LessOrEqual(t, de.Budget, 500*time.Millisecond)
	roomy, cancel2 := context.WithTimeout(ctx, 3*time.Second) // 2 s budget
	defer cancel2()
	r, err = lim.Reserve(roomy, "k")
	require.NoError(t, err)
	require.True(t, r.OK(), "%v", r.Err())

	wctx, wcancel := context.WithTimeout(ctx, 50*time.Millisecond)
	defer wcancel()
	err = r.Wait(wctx)
	assert.ErrorIs(t, err, context.DeadlineExceeded)
	v, _ := e.tat(t, "we", "k")
	assert.Equal(t, before, v, "Wait cut short: the reservation was not given back")
	assert.Zero(t, r.DelayFrom(r.SlotAt().Add(time.Millisecond)), "DelayFrom past the slot is 0")
}

// TestReviewDOCLeaseLapse: "A holder cut off from Redis: Lost is closed
// once 9/10 of the TTL have passed since the last successful extension was
// sent, ... which is before Redis lets the lease lapse and another process
// take its place" (lease doc). A holder behind a proxy that is closed; a
// second process (another Semaphore, direct) waits for the place.
func TestReviewDOCLeaseLapse(t *testing.T) {
	e := newDocEnv(t)
	ctx := context.Background()
	p := redistest.NewProxy(t, e.srv.Addr)
	o := e.srv.Options()
	o.Addr = p.Addr()
	o.MaxRetries = -1
	rdb := redis.NewClient(o)
	defer rdb.Close()
	engA, err := throttle.New(rdb, throttle.WithPrefix(e.prefix), throttle.WithTimeout(200*time.Millisecond))
	require.NoError(t, err)
	const ttl = 1500 * time.Millisecond
	semA, err := lease.New(engA, "lapse", 1, lease.WithTTL(ttl))
	require.NoError(t, err)
	defer semA.Close(ctx)
	semB, err := lease.New(e.eng, "lapse", 1, lease.WithTTL(ttl))
	require.NoError(t, err)
	defer semB.Close(ctx)
	la, err := semA.Acquire(ctx, "k")
	require.NoError(t, err)
	p.Close() // A is cut off from Redis from now on
	bctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	lb, err := semB.Acquire(bctx, "k")
	require.NoError(t, err, "the cut-off holder's lease lapsed within its TTL")
	// Lost must be closed by the time B holds the place: looked at
	// directly, not through the time a goroutine woken by Lost's closing
	// recorded (that goroutine may run later than B's Acquire returns on
	// a busy machine, though Lost closed long before).
	select {
	case <-la.Lost():
	default:
		t.Fatal("B holds the place while A's Lost is still open")
	}
	assert.Greater(t, lb.Token(), la.Token())
	require.NoError(t, lb.Release(ctx))
	err = la.Release(ctx)
	t.Logf("Release of the lapsed lease: %v", err)
	assert.ErrorIs(t, err, lease.ErrLost, "Release of a lapsed lease")
}

// ---------------------------------------------------------------------------
// Edges of the engine's promises.

// TestReviewDOCLayeredPause: "Holding back one limit is enough to hold back
// every slot, so only the limit with the shortest interval is pushed"
// (BlockAll), and Pause "makes sure no new slot for key is granted before d
// from now": with the pushed limit's burst large (tau 500ms), the first slot
// after a 2 s pause must still lie at or after its end. A booking made
// before the pause and cancelled after it leaves the pause whole.
func TestReviewDOCLayeredPause(t *testing.T) {
	e := newDocEnv(t)
	ctx := context.Background()
	lim := e.limiter(t, "lp", throttle.Every(2*time.Second, 2, 3), reserve.WithLimit(throttle.PerSecond(1000, 500)),
		reserve.WithCoalescing(false))
	pre, err := lim.Reserve(ctx, "k")
	require.NoError(t, err)
	require.True(t, pre.OK())
	const d = 2 * time.Second
	t0 := e.now(t)
	require.NoError(t, lim.Pause(ctx, "k", d))
	require.NoError(t, pre.Cancel(ctx))
	var slots []time.Time
	for i := 0; i < 3; i++ {
		r, err := lim.Reserve(ctx, "k")
		require.NoError(t, err)
		require.True(t, r.OK())
		slots = append(slots, r.Booking().At)
	}
	for i, s := range slots {
		assert.False(t, s.Before(t0.Add(d)), "slot %d lies %v inside the pause", i, t0.Add(d).Sub(s))
	}
	// One interval apart at the pushed (shortest) limit's pace, not a burst
	// of the 500-unit tolerance.
	assert.Equal(t, time.Millisecond, slots[1].Sub(slots[0]))
}

// TestReviewDOCHorizon: Forever "accepts a slot however far away it is, up
// to MaxHorizon"; a booking at the horizon must not make its key "further
// ahead than any booking could reach" (ErrCorruptState): the key stays
// readable and bookable.
func TestReviewDOCHorizon(t *testing.T) {
	e := newDocEnv(t)
	ctx := context.Background()
	limit := throttle.PerDay(1, 0)
	days := int(throttle.MaxHorizon / (24 * time.Hour))
	reqs := make([]throttle.Request, days+2)
	for i := range reqs {
		reqs[i] = throttle.Request{N: 1, MaxWait: throttle.Forever}
	}
	bs, err := e.eng.BookBatch(ctx, "hz:{k}", limit, reqs)
	require.NoError(t, err)
	t.Cleanup(func() { e.rdb.Del(context.Background(), e.prefix+"hz:{k}") })
	booked := 0
	for _, b := range bs {
		if b.OK {
			booked++
			assert.LessOrEqual(t, b.Wait, throttle.MaxHorizon)
		}
	}
	assert.Equal(t, days+1, booked, "slots from now to +MaxHorizon, one a day")
	assert.False(t, bs[len(bs)-1].OK, "a slot past MaxHorizon")
	_, err = e.eng.State(ctx, []string{"hz:{k}"}, []throttle.Limit{limit})
	assert.NoError(t, err, "State of a key booked up to the horizon")
	_, err = e.eng.Allow(ctx, "hz:{k}", limit)
	assert.NoError(t, err, "Allow on a key booked up to the horizon")
	_, err = e.eng.Book(ctx, "hz:{k}", limit, throttle.Request{N: 1, MaxWait: time.Second})
	assert.NoError(t, err, "a booking on a key booked up to the horizon")
}

// TestReviewDOCNoTimeForWork: deadline.Error's RetryAfter "is 0 when the
// deadline left no time for the work at all, whatever the slot", and such
// a request books nothing, even on an idle key.
func TestReviewDOCNoTimeForWork(t *testing.T) {
	e := newDocEnv(t)
	ctx := context.Background()
	lim := e.limiter(t, "nw", throttle.PerSecond(10, 5), reserve.WithWorkEstimate(time.Second))
	dctx, cancel := context.WithTimeout(ctx, 200*time.Millisecond)
	defer cancel()
	r, err := lim.Reserve(dctx, "k")
	require.NoError(t, err)
	require.False(t, r.OK())
	assert.ErrorIs(t, r.Err(), reserve.ErrWouldExceedDeadline)
	assert.Zero(t, r.RetryAfter(), "no time for the work at all: RetryAfter 0")
	_, ok := e.tat(t, "nw", "k")
	assert.False(t, ok, "booked")
}

// TestReviewDOCAllowWindow: the sliding-window log lets Max events in any
// Span, and a denial's RetryAfter "is the exact time until enough past
// events leave the window" (bracketed by the Redis clock).
func TestReviewDOCAllowWindow(t *testing.T) {
	e := newDocEnv(t)
	ctx := context.Background()
	w := throttle.Window{Max: 3, Span: 2 * time.Second}
	var t0, firstHi time.Time // the first event happened in [t0, firstHi]
	for i := 0; i < 3; i++ {
		before := e.now(t)
		res, err := e.eng.AllowWindow(ctx, "aw:{k}", w, 1)
		require.NoError(t, err)
		require.True(t, res.Allowed, "event %d", i+1)
		if i == 0 {
			t0, firstHi = before, e.now(t)
		}
	}
	t2 := e.now(t)
	res, err := e.eng.AllowWindow(ctx, "aw:{k}", w, 1)
	t3 := e.now(t)
	require.NoError(t, err)
	require.False(t, res.Allowed, "a 4th event within the span")
	lo := t0.Add(w.Span).Sub(t3)
	hi := firstHi.Add(w.Span).Sub(t2)
	assert.True(t, res.RetryAfter >= lo && res.RetryAfter <= hi, "RetryAfter %v outside [%v, %v]", res.RetryAfter, lo, hi)
	assert.ErrorIs(t, throttle.Window{}.Validate(), throttle.ErrInvalidLimit)
}

// TestReviewDOCRefundAfterSlot: the engine's Refund of a booking "whose
// slot has passed, is a no-op"; RefundUnused of a booking no one used gives
// its room back "even once its slot has come, for as long as its units
// still stand in front of the key".
func TestReviewDOCRefundAfterSlot(t *testing.T) {
	e := newDocEnv(t)
	ctx := context.Background()
	limit := throttle.PerSecond(20, 0) // I = 50ms
	keys, limits := []string{"ra:{k}"}, []throttle.Limit{limit}
	a, err := e.eng.Book(ctx, "ra:{k}", limit, throttle.Request{N: 1, MaxWait: throttle.Forever})
	require.NoError(t, err)
	b, err := e.eng.Book(ctx, "ra:{k}", limit, throttle.Request{N: 1, MaxWait: throttle.Forever})
	require.NoError(t, err)
	for !e.now(t).After(b.At) {
		time.Sleep(time.Millisecond)
	}
	before, _ := e.tat(t, "ra", "k")
	given, err := e.eng.Refund(ctx, "ra:{k}", limit, b)
	require.NoError(t, err)
	assert.Zero(t, given, "Refund after the slot")
	v, _ := e.tat(t, "ra", "k")
	assert.Equal(t, before, v)
	_ = a

	// A fresh key, a slot a second out, its time come but its units still
	// in front of the key (TAT one interval after the slot).
	slow := throttle.PerSecond(2, 0) // I = 500ms
	c, err := e.eng.Book(ctx, "ru:{k}", slow, throttle.Request{N: 1, MaxWait: throttle.Forever})
	require.NoError(t, err)
	d, err := e.eng.Book(ctx, "ru:{k}", slow, throttle.Request{N: 1, MaxWait: throttle.Forever})
	require.NoError(t, err)
	for !e.now(t).After(d.At) {
		time.Sleep(time.Millisecond)
	}
	require.True(t, e.now(t).Before(d.End()), "units still stand (test timing)")
	gv, err := e.eng.RefundUnused(ctx, []string{"ru:{k}"}, []throttle.Limit{slow}, d)
	require.NoError(t, err)
	require.Len(t, gv, 1)
	assert.Positive(t, gv[0], "RefundUnused after the slot, units still standing")
	// Back where it was before d: a TAT of c.End(), which has passed, so
	// the key may have expired.
	if v, ok := e.tat(t, "ru", "k"); ok {
		assert.Equal(t, docMicros(c.End()), v, "the key is back where it was before d")
	}
	_, _ = keys, limits
}

// ---------------------------------------------------------------------------
// pool: max-wait refusals, panics, Acquire refusals.

// TestReviewDOCPoolMaxWaitRequeue: "A job refused only by the limiter's max
// wait is not refused for good: it goes back to the front of the backlog,
// and its key is not booked again until the slot would fit." Every job
// runs; the slots replayed through a textbook GCRA; the calls stay a few per
// job (no retry storm).
func TestReviewDOCPoolMaxWaitRequeue(t *testing.T) {
	e := newDocEnv(t)
	ctx := context.Background()
	limit := throttle.PerSecond(5, 0) // I = 200ms
	lim := e.limiter(t, "pm", limit, reserve.WithMaxWait(50*time.Millisecond))
	p, err := pool.New(lim, pool.WithWorkers(4))
	require.NoError(t, err)
	defer p.Close(ctx)
	const n = 6
	var jobs []*pool.Job
	for i := 0; i < n; i++ {
		j, err := p.Submit(ctx, "k", func(context.Context) error { return nil })
		require.NoError(t, err)
		jobs = append(jobs, j)
	}
	wctx, cancel := context.WithTimeout(ctx, 20*time.Second)
	defer cancel()
	require.NoError(t, p.Wait(wctx))
	var slots []int64
	for i, j := range jobs {
		require.NoError(t, j.Err(), "job %d refused for good by the max wait", i)
		r := j.Reservation()
		require.NotNil(t, r)
		slots = append(slots, docMicros(r.Booking().At))
	}
	I := limit.Interval().Microseconds()
	for i := range slots {
		for k := range slots {
			if i != k && slots[i] <= slots[k] && slots[k]-slots[i] < I {
				t.Errorf("jobs %d and %d booked %dµs apart (< one interval)", i, k, slots[k]-slots[i])
			}
		}
	}
	assert.LessOrEqual(t, e.calls.cmds.Load(), int64(4*n), "calls for %d jobs: %s", n, e.calls.seen())
	t.Logf("%d calls for %d jobs", e.calls.cmds.Load(), n)
}

// TestReviewDOCPoolPanics: "A job's panic becomes its error, a *PanicError
// with the panic value and the stack; a job whose function calls
// runtime.Goexit ends with an error saying so. Either way its worker is
// given back and the pool goes on"; PanicError.Unwrap returns an error
// value. Pool.Acquire: "A refusal ... returns at once with the limiter's
// error, holding nothing."
func TestReviewDOCPoolPanics(t *testing.T) {
	docNoLeak(t)
	e := newDocEnv(t)
	ctx := context.Background()
	lim := e.limiter(t, "pp", throttle.PerSecond(100, 10))
	p, err := pool.New(lim, pool.WithWorkers(1))
	require.NoError(t, err)
	defer p.Close(ctx)
	boom := errors.New("boom")
	j, err := p.Submit(ctx, "k", func(context.Context) error { panic(boom) })
	require.NoError(t, err)
	err = j.Wait(ctx)
	var pe *pool.PanicError
	require.ErrorAs(t, err, &pe)
	assert.ErrorIs(t, err, boom, "Unwrap returns the panic value")
	assert.Contains(t, string(pe.Stack), "TestReviewDOCPoolPanics", "the stack includes the function that panicked")
	j, err = p.Submit(ctx, "k", func(context.Context) error { panicGoexit(); return nil })
	require.NoError(t, err)
	assert.Error(t, j.Wait(ctx), "Goexit ends with an error")
	j, err = p.Submit(ctx, "k", func(context.Context) error { return nil })
	require.NoError(t, err)
	require.NoError(t, j.Wait(ctx), "the pool goes on with its one worker")

	slow := e.limiter(t, "pp2", throttle.PerMinute(1, 0))
	p2, err := pool.New(slow, pool.WithWorkers(1))
	require.NoError(t, err)
	defer p2.Close(ctx)
	rel, err := p2.Acquire(ctx, "k")
	require.NoError(t, err)
	rel()
	before, _ := e.tat(t, "pp2", "k")
	dctx, cancel := context.WithTimeout(ctx, time.Second)
	defer cancel()
	_, err = p2.Acquire(dctx, "k")
	require.ErrorIs(t, err, reserve.ErrWouldExceedDeadline)
	assert.NoError(t, dctx.Err(), "refused at once, not at the deadline")
	v, _ := e.tat(t, "pp2", "k")
	assert.Equal(t, before, v, "a refused Acquire booked")
	rel, err = p2.Acquire(ctx, "other")
	require.NoError(t, err, "the only worker is free again: the refusal held nothing")
	rel()
}

// TestReviewDOCHTTPRebookBehindPause: "Requests already waiting in the same
// Transport book again behind the pause ... within the max wait counted
// from when their RoundTrip began." Request A gets 429 Retry-After: 2 while
// request B sleeps until its slot; B reaches the upstream no earlier than
// the pause's end, both stamped on the Redis clock.
func TestReviewDOCHTTPRebookBehindPause(t *testing.T) {
	e := newDocEnv(t)
	ctx := context.Background()
	lim := e.limiter(t, "hr", throttle.PerSecond(2, 0), reserve.WithMaxWait(4*time.Second))
	var first atomic.Bool
	var t429, tB atomic.Int64
	up, served := docUpstream(t, func(w http.ResponseWriter, r *http.Request) {
		if first.CompareAndSwap(false, true) {
			// Wait until B's booking stands (two intervals booked), then 429.
			host := r.Host
			deadline := time.Now().Add(5 * time.Second)
			for time.Now().Before(deadline) {
				if v, ok := e.tat(t, "hr", host); ok && v-docMicros(e.now(t)) > 600_000 {
					break
				}
				time.Sleep(time.Millisecond)
			}
			t429.Store(docMicros(e.now(t)))
			w.Header().Set("Retry-After", "2")
			w.WriteHeader(http.StatusTooManyRequests)
			return
		}
		tB.Store(docMicros(e.now(t)))
		fmt.Fprintln(w, "ok")
	})
	tr, err := httplimit.New(lim)
	require.NoError(t, err)
	c := &http.Client{Transport: tr}
	var wg sync.WaitGroup
	var errB error
	var statusA int
	wg.Add(2)
	go func() {
		defer wg.Done()
		resp, err := c.Get(up.URL)
		if err == nil {
			statusA = resp.StatusCode
			resp.Body.Close()
		}
	}()
	go func() {
		defer wg.Done()
		for !first.Load() {
			time.Sleep(time.Millisecond)
		}
		resp, err := c.Get(up.URL)
		errB = err
		if err == nil {
			resp.Body.Close()
		}
	}()
	wg.Wait()
	require.Equal(t, http.StatusTooManyRequests, statusA)
	require.NoError(t, errB, "B, within its max wait behind the pause, was sent")
	require.Equal(t, int64(2), served.Load())
	gap := time.Duration(tB.Load()-t429.Load()) * time.Microsecond
	assert.GreaterOrEqual(t, gap, 2*time.Second, "B reached the upstream %v after the 429 (Retry-After: 2)", gap)
	_ = ctx
}

func panicGoexit() { runtimeGoexit() }

func runtimeGoexit() { runtime.Goexit() }

// ---------------------------------------------------------------------------
// Contexts honoured everywhere.

// TestReviewDOCDoneContext: a context already done: Reserve and Acquire
// return its error ("err is non-nil only for bad input, a done context, or
// a Redis failure") and leave nothing booked; Allow counts nothing; a pool
// job never runs and books nothing; lease.Acquire holds nothing; httplimit
// does not send the request (NotSentError without retry-after, body
// closed); the asynq middleware does not run the task.
func TestReviewDOCDoneContext(t *testing.T) {
	e := newDocEnv(t)
	ctx := context.Background()
	limit := throttle.PerMinute(10, 5)
	lim := e.limiter(t, "dc", limit)
	require.NoError(t, lim.Acquire(ctx, "k"))
	before, _ := e.tat(t, "dc", "k")
	done, cancel := context.WithCancel(ctx)
	cancel()
	stands := func(what string) {
		t.Helper()
		// "given back within a second more" where a call went out.
		assert.Eventually(t, func() bool { v, _ := e.tat(t, "dc", "k"); return v == before }, 3*time.Second, 5*time.Millisecond,
			"%s with a done context left a booking", what)
	}
	_, err := lim.Reserve(done, "k")
	assert.ErrorIs(t, err, context.Canceled, "Reserve")
	stands("Reserve")
	assert.ErrorIs(t, lim.Acquire(done, "k"), context.Canceled, "Acquire")
	stands("Acquire")
	_, err = lim.Allow(done, "k")
	assert.ErrorIs(t, err, context.Canceled, "Allow")
	stands("Allow")
	rs, err := lim.ReserveBatch(done, "k", []reserve.BatchRequest{{N: 1}})
	if err == nil {
		assert.False(t, rs[0].OK(), "ReserveBatch with a done ctx booked")
	}
	stands("ReserveBatch")

	p, err := pool.New(lim)
	require.NoError(t, err)
	defer p.Close(ctx)
	var ran atomic.Bool
	j, err := p.Submit(done, "k", func(context.Context) error { ran.Store(true); return nil })
	if err == nil {
		<-j.Done()
		err = j.Err()
	}
	assert.ErrorIs(t, err, context.Canceled, "pool job")
	assert.False(t, ran.Load(), "a job with a done context ran")
	stands("pool.Submit")
	_, err = p.Acquire(done, "k")
	assert.ErrorIs(t, err, context.Canceled, "pool.Acquire")
	stands("pool.Acquire")

	sem, err := lease.New(e.eng, "dc", 1)
	require.NoError(t, err)
	defer sem.Close(ctx)
	_, err = sem.Acquire(done, "k")
	assert.ErrorIs(t, err, context.Canceled, "lease.Acquire")
	l, ok, err := sem.TryAcquire(ctx, "k")
	require.NoError(t, err)
	require.True(t, ok, "the done Acquire held the only lease")
	require.NoError(t, l.Release(ctx))

	up, served := docUpstream(t, func(w http.ResponseWriter, r *http.Request) { fmt.Fprintln(w, "ok") })
	tr, err := httplimit.New(e.limiter(t, "dch", throttle.PerSecond(10, 5)))
	require.NoError(t, err)
	body := &docBody{Reader: strings.NewReader("x")}
	req, _ := http.NewRequestWithContext(done, http.MethodPost, up.URL, body)
	resp, err := tr.RoundTrip(req)
	if resp != nil {
		resp.Body.Close()
	}
	require.Error(t, err)
	assert.ErrorIs(t, err, context.Canceled)
	var ns *httplimit.NotSentError
	if assert.ErrorAs(t, err, &ns, "httplimit: a request not sent is a NotSentError") {
		_, ok := ns.RetryAfter()
		assert.False(t, ok, "a context that ended carries no retry-after")
	}
	assert.Zero(t, served.Load(), "sent with a done context")
	assert.True(t, body.closed.Load(), "body not closed")

	var taskRan atomic.Bool
	h := asynqadapter.Middleware(lim)(asynq.HandlerFunc(func(context.Context, *asynq.Task) error { taskRan.Store(true); return nil }))
	assert.Error(t, h.ProcessTask(done, asynq.NewTask("k", nil)))
	assert.False(t, taskRan.Load(), "the task ran with a done context")
	stands("asynq middleware")
}

// TestReviewDOCPoolCloseCtx: pool.Close: "If ctx ends first, the running
// jobs' contexts are not cancelled (they are the caller's), but Close stops
// waiting and returns ctx's error. Close is idempotent", and afterwards no
// goroutine of the pool is left once the job returns and Close is called
// again.
func TestReviewDOCPoolCloseCtx(t *testing.T) {
	docNoLeak(t)
	e := newDocEnv(t)
	ctx := context.Background()
	lim := e.limiter(t, "pc", throttle.PerSecond(100, 10))
	p, err := pool.New(lim)
	require.NoError(t, err)
	release := make(chan struct{})
	started := make(chan struct{})
	var jobCtxErr atomic.Value
	j, err := p.Submit(ctx, "k", func(jctx context.Context) error {
		close(started)
		<-release
		jobCtxErr.Store(fmt.Sprint(jctx.Err()))
		return nil
	})
	require.NoError(t, err)
	<-started
	cctx, cancel := context.WithTimeout(ctx, 100*time.Millisecond)
	defer cancel()
	assert.ErrorIs(t, p.Close(cctx), context.DeadlineExceeded, "Close while a job runs, ctx ending first")
	close(release)
	require.NoError(t, j.Wait(ctx))
	assert.Equal(t, "<nil>", jobCtxErr.Load(), "the running job's context was cancelled")
	assert.NoError(t, p.Close(ctx), "Close again, after the job returned")
}

// ---------------------------------------------------------------------------
// Observer and metrics.

// docObs records what the engine tells its Observer.
type docObs struct {
	mu        sync.Mutex
	decisions []docDecision
	calls     []error
	refunds   []time.Duration
	breaker   []bool
	nodes     []string
}

type docDecision struct {
	limiter string
	o       throttle.Outcome
	wait    time.Duration
}

func (o *docObs) ObserveDecision(l string, out throttle.Outcome, wait time.Duration) {
	o.mu.Lock()
	defer o.mu.Unlock()
	o.decisions = append(o.decisions, docDecision{l, out, wait})
}

func (o *docObs) ObserveCall(_ string, _ time.Duration, err error) {
	o.mu.Lock()
	defer o.mu.Unlock()
	o.calls = append(o.calls, err)
}

func (o *docObs) ObserveRefund(_ string, given time.Duration) {
	o.mu.Lock()
	defer o.mu.Unlock()
	o.refunds = append(o.refunds, given)
}

func (o *docObs) ObserveBreaker(open bool) {
	o.mu.Lock()
	defer o.mu.Unlock()
	o.breaker = append(o.breaker, open)
}

func (o *docObs) ObserveNodeBreaker(node string, open bool) {
	o.mu.Lock()
	defer o.mu.Unlock()
	o.nodes = append(o.nodes, fmt.Sprintf("%s:%v", node, open))
}

func (o *docObs) reset() {
	o.mu.Lock()
	defer o.mu.Unlock()
	o.decisions, o.calls, o.refunds, o.breaker, o.nodes = nil, nil, nil, nil, nil
}

func (o *docObs) snapshot() ([]docDecision, []error, []time.Duration) {
	o.mu.Lock()
	defer o.mu.Unlock()
	return append([]docDecision(nil), o.decisions...), append([]error(nil), o.calls...), append([]time.Duration(nil), o.refunds...)
}

// TestReviewDOCObserver: throttle.Observer's contract: "wait is the booked
// wait for Booked, the retry-after for Denied, Refused and
// FallbackRefused"; FallbackAllowed for a check-mode request reports NoWait;
// one ObserveCall per script call; "Calls refused at once by the open
// breaker are not reported"; a refund reports what it gave back; the
// breaker's opening is reported, with the node (NodeObserver).
func TestReviewDOCObserver(t *testing.T) {
	obs := new(docObs)
	e := newDocEnv(t, throttle.WithObserver(obs))
	ctx := context.Background()
	limit := throttle.PerMinute(10, 1)
	lim := e.limiter(t, "ob", limit, reserve.WithMaxWait(7*time.Second), reserve.WithCoalescing(false))
	obs.reset()
	r1, err := lim.Reserve(ctx, "k")
	require.NoError(t, err)
	r2, err := lim.Reserve(ctx, "k")
	require.NoError(t, err)
	r3, err := lim.Reserve(ctx, "k") // ~6 s: within 7 s
	require.NoError(t, err)
	r4, err := lim.Reserve(ctx, "k") // ~12 s: refused
	require.NoError(t, err)
	res, err := lim.Allow(ctx, "k")
	require.NoError(t, err)
	require.False(t, res.Allowed)
	require.True(t, r3.OK())
	require.False(t, r4.OK())
	require.NoError(t, r3.Cancel(ctx))
	ds, calls, refunds := obs.snapshot()
	require.Len(t, ds, 5, "one decision per request: %+v", ds)
	want := []docDecision{
		{"ob", throttle.Booked, r1.Booking().Wait},
		{"ob", throttle.Booked, r2.Booking().Wait},
		{"ob", throttle.Booked, r3.Booking().Wait},
		{"ob", throttle.Refused, r4.RetryAfter()},
		{"ob", throttle.Denied, res.RetryAfter},
	}
	assert.Equal(t, want, ds)
	assert.Len(t, calls, 6, "one ObserveCall per script call (5 bookings/checks, 1 refund)")
	for _, c := range calls {
		assert.NoError(t, c)
	}
	assert.Equal(t, []time.Duration{limit.Interval()}, refunds, "the refund gave back one interval")

	// Down: the first call reports its error and opens the breaker; calls
	// refused at once by the open breaker are not reported.
	dobs := new(docObs)
	deng, _ := docDown(t, throttle.WithObserver(dobs), throttle.WithProbeBackoff(time.Second, 2*time.Second))
	dl, err := reserve.New(deng, "ob", limit, reserve.WithFallback(reserve.FailOpen()))
	require.NoError(t, err)
	for i := 0; i < 10; i++ {
		_, err := dl.Allow(ctx, "k")
		require.NoError(t, err)
	}
	r, err := dl.Reserve(ctx, "k2")
	require.NoError(t, err)
	require.True(t, r.Fallback())
	dobs.mu.Lock()
	defer dobs.mu.Unlock()
	assert.Len(t, dobs.calls, 1, "calls reported while the breaker was open: %v", dobs.calls)
	if len(dobs.calls) > 0 {
		assert.ErrorIs(t, dobs.calls[0], throttle.ErrUnavailable)
	}
	assert.Equal(t, []bool{true}, dobs.breaker, "the breaker's opening reported once")
	assert.Len(t, dobs.nodes, 1)
	for i, d := range dobs.decisions {
		switch d.o {
		case throttle.FallbackAllowed:
			if i < 10 { // the Allow calls come first
				assert.Equal(t, throttle.NoWait, d.wait, "FallbackAllowed for a check-mode request")
			}
		case throttle.FallbackRefused:
			assert.Positive(t, d.wait, "FallbackRefused: its retry-after")
		default:
			t.Errorf("outcome %v while Redis was down", d.o)
		}
	}
	assert.Equal(t, 11, len(dobs.decisions), "one decision per request while down")
	t.Logf("decisions while down: %+v", dobs.decisions)
	last := dobs.decisions[len(dobs.decisions)-1]
	assert.Equal(t, throttle.FallbackAllowed, last.o)
	assert.GreaterOrEqual(t, last.wait, time.Duration(0), "a reservation the fallback admitted reports its wait, not NoWait")
}

// TestReviewDOCMetricsDown: slotbook_breaker_open{node} is 1 for the
// unreachable node while its breaker is open; slotbook_redis_errors_total
// counts the failed call, not the calls the open breaker refused at once;
// fallback decisions are labelled fallback_allowed / fallback_refused;
// slotbook_lost_replies_total counts a lost reply.
func TestReviewDOCMetricsDown(t *testing.T) {
	m, err := metrics.New()
	require.NoError(t, err)
	reg := prometheus.NewRegistry()
	require.NoError(t, reg.Register(m))
	deng, _ := docDown(t, throttle.WithObserver(m), throttle.WithProbeBackoff(time.Second, 2*time.Second))
	ctx := context.Background()
	dl, err := reserve.New(deng, "md", throttle.PerMinute(10, 1), reserve.WithFallback(reserve.FailOpen()), reserve.WithMaxWait(0))
	require.NoError(t, err)
	for i := 0; i < 5; i++ {
		_, err := dl.Reserve(ctx, "k")
		require.NoError(t, err)
	}
	got := docGather(t, reg)
	t.Logf("metrics: %v", got)
	assert.Equal(t, 1.0, got[`slotbook_redis_errors_total{limiter="md"}`], "errors: only the call that reached the wire")
	assert.Equal(t, 2.0, got[`slotbook_decisions_total{limiter="md",outcome="fallback_allowed"}`], "burst+1 admitted locally")
	assert.Equal(t, 3.0, got[`slotbook_decisions_total{limiter="md",outcome="fallback_refused"}`])
	open := 0.0
	for k, v := range got {
		if strings.HasPrefix(k, "slotbook_breaker_open{") {
			open += v
		}
	}
	assert.Equal(t, 1.0, open, "one node's breaker open")

	// A lost reply.
	e := newDocEnv(t)
	m2, err := metrics.New()
	require.NoError(t, err)
	reg2 := prometheus.NewRegistry()
	require.NoError(t, reg2.Register(m2))
	p := redistest.NewProxy(t, e.srv.Addr)
	o := e.srv.Options()
	o.Addr = p.Addr()
	o.MaxRetries = -1
	rdb := redis.NewClient(o)
	defer rdb.Close()
	require.NoError(t, rdb.Ping(ctx).Err())
	eng, err := throttle.New(rdb, throttle.WithPrefix(e.prefix), throttle.WithTimeout(100*time.Millisecond), throttle.WithObserver(m2))
	require.NoError(t, err)
	require.NoError(t, eng.Load(ctx))
	lim, err := reserve.New(eng, "ml", throttle.PerMinute(10, 1))
	require.NoError(t, err)
	p.SetReplyDelay(400 * time.Millisecond)
	_, err = lim.Reserve(ctx, "k")
	require.ErrorIs(t, err, throttle.ErrReplyLost)
	p.SetReplyDelay(0)
	got = docGather(t, reg2)
	assert.Equal(t, 1.0, got[`slotbook_lost_replies_total{limiter="ml"}`])
	assert.Equal(t, 1.0, got[`slotbook_redis_errors_total{limiter="ml"}`])
}

// docGather returns every counter and gauge of reg by name{labels}.
func docGather(t *testing.T, reg *prometheus.Registry) map[string]float64 {
	t.Helper()
	mfs, err := reg.Gather()
	require.NoError(t, err)
	out := map[string]float64{}
	for _, mf := range mfs {
		for _, m := range mf.GetMetric() {
			var ls []string
			for _, lp := range m.GetLabel() {
				ls = append(ls, fmt.Sprintf("%s=%q", lp.GetName(), lp.GetValue()))
			}
			k := mf.GetName() + "{" + strings.Join(ls, ",") + "}"
			switch {
			case m.GetCounter() != nil:
				out[k] = m.GetCounter().GetValue()
			case m.GetGauge() != nil:
				out[k] = m.GetGauge().GetValue()
			case m.GetHistogram() != nil:
				out[k+"_count"] = float64(m.GetHistogram().GetSampleCount())
			}
		}
	}
	return out
}

// TestReviewDOCCoalescingOffOneCallEach (FAILS on the current code, a
// documentation contradiction): reserve.WithCoalescing: "Off, every
// ReserveN makes a Redis call of its own." On an engine with its defaults
// (merging on, throttle.WithMerging), concurrent ReserveN callers of a
// limiter with coalescing off share calls: the engine merges single
// bookings once four are in flight. (The README says so in passing, "the
// engine still merges calls under load"; the option's doc does not.) The
// control, an engine WithMerging(false), makes one call per ReserveN.
func TestReviewDOCCoalescingOffOneCallEach(t *testing.T) {
	const callers = 32
	run := func(t *testing.T, opts ...throttle.Option) (int64, string) {
		e := newDocEnv(t, opts...)
		lim := e.limiter(t, "co", throttle.PerDay(100_000, 999), reserve.WithCoalescing(false))
		ctx := context.Background()
		var wg sync.WaitGroup
		start := make(chan struct{})
		for i := 0; i < callers; i++ {
			wg.Add(1)
			go func() {
				defer wg.Done()
				<-start
				r, err := lim.Reserve(ctx, "k")
				assert.NoError(t, err)
				if err == nil {
					assert.True(t, r.OK())
				}
			}()
		}
		close(start)
		wg.Wait()
		st, err := lim.State(ctx, "k")
		require.NoError(t, err)
		assert.Equal(t, 1000-callers, st.Available, "every caller booked one unit")
		e.calls.mu.Lock()
		defer e.calls.mu.Unlock()
		n := int64(0)
		for _, c := range e.calls.names {
			if c == "evalsha" || c == "eval" {
				n++
			}
		}
		return n - 1, strings.Join(e.calls.names, ",") // less the State call
	}
	control, _ := run(t, throttle.WithMerging(false))
	assert.Equal(t, int64(callers), control, "control: merging off, one call per ReserveN")
	merged, seen := run(t)
	t.Logf("coalescing off, engine defaults: %d script calls for %d ReserveN (%s)", merged, callers, seen)
	// The option's doc now says the engine may still merge: at most one
	// call each.
	assert.LessOrEqual(t, merged, int64(callers), "WithCoalescing(false), merging on: at most a call per ReserveN")
}

// TestReviewDOCProbeBackoff: "one probe at a time (after 25ms, doubling to
// 400ms ...)" (README): with Redis refusing connections and the default
// probe backoff, the time to the next probe that Unavailable reports right
// after each failed probe doubles from 25ms and stops at 400ms.
func TestReviewDOCProbeBackoff(t *testing.T) {
	eng, _ := docDown(t, throttle.WithTimeout(throttle.DefaultTimeout))
	ctx := context.Background()
	lim, err := reserve.New(eng, "pb", throttle.PerSecond(10, 1))
	require.NoError(t, err)
	require.ErrorIs(t, lim.Acquire(ctx, "k"), throttle.ErrUnavailable)
	var seen []time.Duration
	for i := 0; i < 7; i++ {
		down, next := eng.Unavailable()
		require.True(t, down)
		seen = append(seen, next)
		time.Sleep(next + 2*time.Millisecond) // the probe is due: the next call is it
		require.ErrorIs(t, lim.Acquire(ctx, "k"), throttle.ErrUnavailable)
	}
	t.Logf("time to the next probe after each failure: %v", seen)
	want := []time.Duration{25, 50, 100, 200, 400, 400, 400}
	for i, w := range want {
		w *= time.Millisecond
		assert.True(t, seen[i] > w/2 && seen[i] <= w, "failure %d: next probe in %v, want about %v", i, seen[i], w)
	}
}

// TestReviewDOCCloseRedisDown: Close with Redis gone: the Semaphore's Close
// "returns the errors of the releases", closes every held lease's Lost and
// waits for its goroutines; the pool's Close returns (bounded by the
// engine's timeout) with its jobs done; neither leaves a goroutine behind.
func TestReviewDOCCloseRedisDown(t *testing.T) {
	docNoLeak(t)
	e := newDocEnv(t)
	ctx := context.Background()
	p := redistest.NewProxy(t, e.srv.Addr)
	o := e.srv.Options()
	o.Addr = p.Addr()
	o.MaxRetries = -1
	rdb := redis.NewClient(o)
	t.Cleanup(func() { rdb.Close() })
	eng, err := throttle.New(rdb, throttle.WithPrefix(e.prefix), throttle.WithTimeout(200*time.Millisecond))
	require.NoError(t, err)
	require.NoError(t, eng.Load(ctx))

	sem, err := lease.New(eng, "cr", 2, lease.WithTTL(3*time.Second))
	require.NoError(t, err)
	l1, err := sem.Acquire(ctx, "k")
	require.NoError(t, err)
	lim, err := reserve.New(eng, "cr", throttle.PerSecond(2, 0))
	require.NoError(t, err)
	pl, err := pool.New(lim, pool.WithWorkers(3))
	require.NoError(t, err)
	var jobs []*pool.Job
	for i := 0; i < 4; i++ {
		j, err := pl.Submit(ctx, "k", func(context.Context) error { return nil })
		require.NoError(t, err)
		jobs = append(jobs, j)
	}
	require.NoError(t, jobs[0].Wait(ctx))
	p.Close() // Redis gone for this client

	cctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	start := time.Now()
	err = sem.Close(cctx)
	t.Logf("Semaphore.Close with Redis gone: %v after %v", err, time.Since(start))
	assert.Error(t, err, "the release failed: Close returns its error")
	assert.NoError(t, cctx.Err(), "Semaphore.Close did not return before its ctx ended")
	select {
	case <-l1.Lost():
	default:
		t.Error("Lost not closed by Close")
	}
	start = time.Now()
	err = pl.Close(cctx)
	t.Logf("Pool.Close with Redis gone: %v after %v", err, time.Since(start))
	assert.NoError(t, cctx.Err(), "Pool.Close did not return before its ctx ended")
	for i, j := range jobs {
		select {
		case <-j.Done():
		default:
			t.Errorf("job %d not done after Close", i)
		}
	}
}

// TestReviewDOCFallbackViewsAndCancel: "Views of one limiter made with
// lim.With(...) ... share one fallback state, so together they admit one
// local share" (README); a local slot cancelled before its time "gives
// back all of it once no later local booking of the key stands on it ...
// so slots cancelled in any order all come back".
func TestReviewDOCFallbackViewsAndCancel(t *testing.T) {
	eng, _ := docDown(t, throttle.WithProbeBackoff(time.Minute, time.Minute))
	ctx := context.Background()
	limit := throttle.PerMinute(60, 2) // 3 at once, then 1 s apart
	lim, err := reserve.New(eng, "fv", limit, reserve.WithFallback(reserve.LocalShare(time.Second, 1, 100)), reserve.WithMaxWait(0))
	require.NoError(t, err)
	view, err := lim.With(reserve.WithMaxWait(10 * time.Second))
	require.NoError(t, err)
	admitted := 0
	for i := 0; i < 3; i++ {
		r, err := lim.Reserve(ctx, "k")
		require.NoError(t, err)
		require.True(t, r.Fallback())
		if r.OK() {
			admitted++
		}
	}
	require.Equal(t, 3, admitted, "the local share's burst+1")
	res, err := view.Allow(ctx, "k")
	require.NoError(t, err)
	assert.False(t, res.Allowed, "a view admitted beyond the share its limiter used")

	// Three local slots ahead (about +1 s, +2 s, +3 s): cancel the middle
	// one, then the last; both come back, so the next two bookings take
	// the middle and the last slot again.
	var rs []*reserve.Reservation
	for i := 0; i < 3; i++ {
		r, err := view.Reserve(ctx, "k")
		require.NoError(t, err)
		require.True(t, r.OK(), "%v", r.Err())
		require.True(t, r.Fallback())
		rs = append(rs, r)
	}
	require.NoError(t, rs[1].Cancel(ctx))
	require.NoError(t, rs[2].Cancel(ctx))
	for i := 1; i < 3; i++ {
		r, err := view.Reserve(ctx, "k")
		require.NoError(t, err)
		require.True(t, r.OK())
		d := r.SlotAt().Sub(rs[i].SlotAt())
		assert.True(t, d > -5*time.Millisecond && d < 5*time.Millisecond, "re-booked slot %d is %v off the cancelled one's", i, d)
	}
}

// TestReviewDOCExamplesOnRealRedis: the runnable examples' printed output
// (example_test.go, reserve and throttle), which run on an embedded Redis,
// holds on a real redis-server.
func TestReviewDOCExamplesOnRealRedis(t *testing.T) {
	e := newDocEnv(t)
	ctx := context.Background()

	// example_test.go: Example.
	lim := e.limiter(t, "stripe", throttle.PerMinute(10, 5))
	for i := 0; i < 6; i++ {
		require.NoError(t, lim.Acquire(ctx, "tenant-42"))
	}
	r, err := lim.Reserve(ctx, "tenant-42")
	require.NoError(t, err)
	d := r.Delay()
	assert.True(t, r.OK() && d > 0 && d <= 6*time.Second, "7th booked: true to wait up to 6s: true (got %v %v)", r.OK(), d)
	hurried, cancel := context.WithTimeout(ctx, 3*time.Second)
	defer cancel()
	assert.ErrorIs(t, lim.Acquire(hurried, "tenant-42"), reserve.ErrWouldExceedDeadline, "8th within 3s")

	// reserve: ExampleLimiter_Reserve.
	rl := e.limiter(t, "reports", throttle.PerMinute(2, 0))
	book := func() *reserve.Reservation {
		r, err := rl.Reserve(ctx, "tenant-7")
		require.NoError(t, err)
		return r
	}
	first, second := book(), book()
	assert.Equal(t, "true 0s", fmt.Sprint(first.OK(), first.Booking().Wait))
	assert.Equal(t, "true 30s", fmt.Sprint(second.OK(), second.Booking().Wait.Round(time.Second)))
	require.NoError(t, second.Cancel(ctx))
	assert.Equal(t, "30s", fmt.Sprint(book().Booking().Wait.Round(time.Second)))

	// reserve: ExampleLimiter_Acquire.
	al := e.limiter(t, "partner", throttle.PerSecond(1, 0), reserve.WithMaxWait(100*time.Millisecond))
	assert.NoError(t, al.Acquire(ctx, "eu"))
	err = al.Acquire(ctx, "eu")
	retry, _ := deadline.RetryAfterOf(err)
	assert.Equal(t, "true 1s", fmt.Sprint(errors.Is(err, reserve.ErrMaxWaitExceeded), retry.Round(time.Second)))

	// throttle: ExampleEngine_Book.
	limit := throttle.PerMinute(60, 0)
	var got []string
	for _, maxWait := range []time.Duration{0, time.Minute, 500 * time.Millisecond} {
		b, err := e.eng.Book(ctx, "api:{partner}", limit, throttle.Request{N: 1, MaxWait: maxWait})
		require.NoError(t, err)
		got = append(got, fmt.Sprint(b.OK, b.Wait.Round(time.Second)))
	}
	assert.Equal(t, []string{"true 0s", "true 1s", "false 2s"}, got)
}

// TestReviewDOCAsynqRefusals: LeaseMiddleware WithLeaseMaxWait: "A task
// that gets none within d goes back to asynq with a *RateLimitedError (Err
// ErrLeaseBusy, RetryAfter d), which IsFailure and RetryDelayFunc treat as
// a refusal"; the rate middleware with its limiter's Redis unavailable and
// no fallback: a refusal matching throttle.ErrUnavailable that comes back
// after WithUnavailableDelay (default throttle.DefaultProbeMax), or an
// ordinary failure with WithUnavailableAsFailure(true).
func TestReviewDOCAsynqRefusals(t *testing.T) {
	e := newDocEnv(t)
	ctx := context.Background()
	sem, err := lease.New(e.eng, "aql", 1)
	require.NoError(t, err)
	defer sem.Close(ctx)
	held, err := sem.Acquire(ctx, "aq:t")
	require.NoError(t, err)
	var ran atomic.Int64
	handler := asynq.HandlerFunc(func(context.Context, *asynq.Task) error { ran.Add(1); return nil })
	lmw, err := asynqadapter.NewLeaseMiddleware(sem, asynqadapter.WithLeaseMaxWait(100*time.Millisecond))
	require.NoError(t, err)
	err = lmw(handler).ProcessTask(ctx, asynq.NewTask("aq:t", nil))
	var rl *asynqadapter.RateLimitedError
	require.ErrorAs(t, err, &rl)
	assert.ErrorIs(t, err, asynqadapter.ErrLeaseBusy)
	assert.Equal(t, 100*time.Millisecond, rl.RetryAfter)
	assert.True(t, asynqadapter.IsRefusal(err))
	assert.False(t, asynqadapter.IsFailure(err))
	assert.Zero(t, ran.Load())
	require.NoError(t, held.Release(ctx))
	l, ok, err := sem.TryAcquire(ctx, "aq:t")
	require.NoError(t, err)
	require.True(t, ok, "the task that gave up holds no lease, and no waiter is left")
	require.NoError(t, l.Release(ctx))

	deng, _ := docDown(t)
	dl, err := reserve.New(deng, "aqd", throttle.PerSecond(10, 1))
	require.NoError(t, err)
	mw, err := asynqadapter.NewMiddleware(dl)
	require.NoError(t, err)
	err = mw(handler).ProcessTask(ctx, asynq.NewTask("aq:u", nil))
	require.ErrorAs(t, err, &rl)
	assert.ErrorIs(t, err, throttle.ErrUnavailable)
	// The default unavailable delay, plus up to one interval (100ms) of
	// the spread's jitter.
	assert.True(t, rl.RetryAfter >= throttle.DefaultProbeMax && rl.RetryAfter <= throttle.DefaultProbeMax+100*time.Millisecond,
		"RetryAfter %v, want the default unavailable delay %v", rl.RetryAfter, throttle.DefaultProbeMax)
	assert.True(t, asynqadapter.IsRefusal(err))
	assert.False(t, asynqadapter.IsFailure(err))
	assert.Zero(t, ran.Load())
	mw, err = asynqadapter.NewMiddleware(dl, asynqadapter.WithUnavailableAsFailure(true))
	require.NoError(t, err)
	err = mw(handler).ProcessTask(ctx, asynq.NewTask("aq:u", nil))
	assert.ErrorIs(t, err, throttle.ErrUnavailable)
	assert.False(t, asynqadapter.IsRefusal(err), "WithUnavailableAsFailure(true): a failure")
	assert.True(t, asynqadapter.IsFailure(err))
	mw, err = asynqadapter.NewMiddleware(dl, asynqadapter.WithUnavailableDelay(3*time.Second), asynqadapter.WithSpread(false))
	require.NoError(t, err)
	err = mw(handler).ProcessTask(ctx, asynq.NewTask("aq:v", nil))
	require.ErrorAs(t, err, &rl)
	assert.Equal(t, 3*time.Second, rl.RetryAfter)
	// asynq stores whole seconds: the delay brings now+RetryAfter up to
	// the next whole second.
	d := asynqadapter.RetryDelayFunc(nil)(0, err, asynq.NewTask("aq:v", nil))
	assert.True(t, d >= 3*time.Second && d <= 4*time.Second, "RetryDelayFunc %v", d)
}

// TestReviewDOCEngineMisc: Engine.State with nil limits "reads the keys
// alone" (Wait and Available 0, the zero Limit); Heartbeat "returns how many
// processes are (at least 1)"; HashTag and CheckKey as documented;
// MaxKeyLen's boundary.
func TestReviewDOCEngineMisc(t *testing.T) {
	e := newDocEnv(t)
	ctx := context.Background()
	limit := throttle.PerMinute(10, 5)
	_, err := e.eng.Book(ctx, "em:{k}", limit, throttle.Request{N: 3, MaxWait: throttle.Forever})
	require.NoError(t, err)
	tat, _ := e.tat(t, "em", "k")
	st, err := e.eng.State(ctx, []string{"em:{k}"}, nil)
	require.NoError(t, err)
	assert.Zero(t, st.Wait)
	assert.Zero(t, st.Available)
	require.Len(t, st.Keys, 1)
	assert.Equal(t, throttle.Limit{}, st.Keys[0].Limit)
	assert.True(t, st.Keys[0].Exists)
	assert.Equal(t, tat, docMicros(st.Keys[0].TAT))
	assert.Equal(t, time.Duration(tat-docMicros(st.Now))*time.Microsecond, st.Backlog)

	n, err := e.eng.Heartbeat(ctx, "em", "p1", time.Minute)
	require.NoError(t, err)
	assert.Equal(t, 1, n)
	n, err = e.eng.Heartbeat(ctx, "em", "p2", time.Minute)
	require.NoError(t, err)
	assert.Equal(t, 2, n)
	n, err = e.eng.Heartbeat(ctx, "em", "p1", time.Minute)
	require.NoError(t, err)
	assert.Equal(t, 2, n, "the same process twice counts once")

	assert.Equal(t, "b", throttle.HashTag("a{b}c"))
	assert.Equal(t, "", throttle.HashTag("{}b"), "an empty tag is no tag")
	assert.Equal(t, "", throttle.HashTag("a{b"))
	assert.Equal(t, "b{c", throttle.HashTag("a{b{c}d"), "between the first '{' and the next '}'")
	assert.NoError(t, throttle.CheckKey("plain"))
	assert.NoError(t, throttle.CheckKey("x:{t}"))
	assert.ErrorIs(t, throttle.CheckKey("}a"), throttle.ErrInvalidRequest, "a brace and no hash tag")
	assert.ErrorIs(t, throttle.CheckKey("{}a"), throttle.ErrInvalidRequest, "an empty tag")
	assert.NoError(t, throttle.CheckKey(strings.Repeat("k", throttle.MaxKeyLen)), "MaxKeyLen bytes")
	assert.ErrorIs(t, throttle.CheckKey(strings.Repeat("k", throttle.MaxKeyLen+1)), throttle.ErrInvalidRequest)
	res, err := e.eng.Allow(ctx, strings.Repeat("k", throttle.MaxKeyLen), limit)
	require.NoError(t, err, "a key of MaxKeyLen bytes")
	assert.True(t, res.Allowed)
	assert.ErrorIs(t, throttle.CheckRequest(throttle.Request{N: 7}, limit), throttle.ErrExceedsBurst)
	assert.NoError(t, throttle.CheckRequest(throttle.Request{N: 6}, limit))
	assert.ErrorIs(t, throttle.CheckRequest(throttle.Request{N: 1, MaxWait: -1}, limit), throttle.ErrInvalidRequest)
}

// TestReviewDOCLeaseHandoff: "a release hands its lease straight to the
// next waiter": TryAcquire "takes a lease for key if one is free and nobody
// is waiting for one", so right after the holder's Release, with a waiter
// queued, a TryAcquire from another process gets nothing, and the waiter
// gets the lease with a larger token.
func TestReviewDOCLeaseHandoff(t *testing.T) {
	e := newDocEnv(t)
	ctx := context.Background()
	semA, err := lease.New(e.eng, "lh", 1)
	require.NoError(t, err)
	defer semA.Close(ctx)
	semB, err := lease.New(e.eng, "lh", 1)
	require.NoError(t, err)
	defer semB.Close(ctx)
	assert.Equal(t, "lh", semA.Name())
	a, err := semA.Acquire(ctx, "k")
	require.NoError(t, err)
	assert.Equal(t, "k", a.Key())
	got := make(chan *lease.Lease, 1)
	go func() {
		l, err := semB.Acquire(ctx, "k")
		assert.NoError(t, err)
		got <- l
	}()
	// The waiter is queued once TryAcquire, even on a free place, finds
	// it there; wait until the queue key holds it.
	require.Eventually(t, func() bool {
		n, _ := e.rdb.ZCard(ctx, e.prefix+"lh:{k}:lease:q").Result()
		return n > 0
	}, 5*time.Second, time.Millisecond, "the waiter joined the queue")
	require.NoError(t, a.Release(ctx))
	l, ok, err := semA.TryAcquire(ctx, "k")
	require.NoError(t, err)
	assert.False(t, ok, "TryAcquire took the place released to a waiter")
	if ok {
		l.Release(ctx)
	}
	select {
	case w := <-got:
		require.NotNil(t, w)
		assert.Greater(t, w.Token(), a.Token())
		require.NoError(t, w.Release(ctx))
	case <-time.After(10 * time.Second):
		t.Fatal("the waiter was not woken")
	}
}

// TestReviewDOCResetHeaders: WithResetHeaders: "a 429 or 503 without
// Retry-After is paused by RateLimit-Reset (delay-seconds) or
// X-RateLimit-Reset (delay-seconds, or a Unix time ...)"; Retry-After wins
// where both are given.
func TestReviewDOCResetHeaders(t *testing.T) {
	e := newDocEnv(t)
	ctx := context.Background()
	var hdr atomic.Value
	up, _ := docUpstream(t, func(w http.ResponseWriter, r *http.Request) {
		for k, v := range hdr.Load().(map[string]string) {
			w.Header().Set(k, v)
		}
		w.WriteHeader(http.StatusTooManyRequests)
	})
	host := strings.TrimPrefix(up.URL, "http://")
	for i, tc := range []struct {
		h      map[string]string
		lo, hi time.Duration
	}{
		{map[string]string{"RateLimit-Reset": "3"}, 2 * time.Second, 3 * time.Second},
		{map[string]string{"X-RateLimit-Reset": "4"}, 3 * time.Second, 4 * time.Second},
		{map[string]string{"Retry-After": "2", "X-RateLimit-Reset": "30"}, time.Second, 2 * time.Second},
	} {
		name := fmt.Sprintf("rh%d", i)
		lim := e.limiter(t, name, throttle.PerSecond(100, 10))
		tr, err := httplimit.New(lim, httplimit.WithResetHeaders(true))
		require.NoError(t, err)
		hdr.Store(tc.h)
		resp, err := (&http.Client{Transport: tr}).Get(up.URL)
		require.NoError(t, err)
		resp.Body.Close()
		st, err := lim.State(ctx, host)
		require.NoError(t, err)
		assert.True(t, st.Wait > tc.lo && st.Wait <= tc.hi, "%v: paused %v, want (%v, %v]", tc.h, st.Wait, tc.lo, tc.hi)
	}
}

// docForeign is a client written from docs/PROTOCOL.md's "The algorithm"
// and "Stored values" alone, as another language's worker would: one
// limit, n units, max wait W, on the Redis clock. It shares nothing with
// the engine's scripts. Reply: {booked (0/1), wait µs}.
var docForeign = redis.NewScript(`
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local I, tau, n, W = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local v = redis.call('GET', KEYS[1])
local tat = now
if v then tat = math.max(tonumber(v), now) end
local slot = math.max(now, tat + (n - 1) * I - tau)
local wait = slot - now
if wait > W then return {0, wait} end
local e = math.max(tat, slot) + n * I
redis.call('SET', KEYS[1], string.format('%d', e), 'PX', math.ceil((e - now) / 1000) + 1)
return {1, wait}
`)

// TestReviewDOCForeignClient: "A worker in Python, Node, Ruby or any other
// language that follows it shares a quota with Go workers" (PROTOCOL.md,
// README): a client built from the protocol's text alone and the Go
// limiter, on one key, together let through burst+1 at once and then one
// per interval; each sees the other's bookings. A Go refund leaves a
// tombstone "<first key>:x:<booking id>" expiring at the booking's slot.
func TestReviewDOCForeignClient(t *testing.T) {
	e := newDocEnv(t)
	ctx := context.Background()
	limit := throttle.PerMinute(10, 5) // I = 6 s, tau = 30 s
	I, tau := limit.Interval().Microseconds(), int64(limit.Burst)*limit.Interval().Microseconds()
	lim := e.limiter(t, "ft", limit, reserve.WithMaxWait(0), reserve.WithCoalescing(false))
	key := e.prefix + "ft:{k}"
	foreign := func(n int, w int64) (bool, int64) {
		t.Helper()
		res, err := docForeign.Run(ctx, e.rdb, []string{key}, I, tau, n, w).Int64Slice()
		require.NoError(t, err)
		return res[0] == 1, res[1]
	}
	ok, w := foreign(2, 0)
	require.True(t, ok)
	require.Zero(t, w)
	for i := 0; i < 3; i++ {
		require.NoError(t, lim.Acquire(ctx, "k"), "Go unit %d after the foreign client's 2", i+1)
	}
	ok, _ = foreign(1, 0)
	require.True(t, ok, "the 6th unit, foreign")
	res, err := lim.Allow(ctx, "k")
	require.NoError(t, err)
	assert.False(t, res.Allowed, "Go let a 7th unit through at once")
	ok, w = foreign(1, 0)
	assert.False(t, ok, "the foreign client let a 7th unit through at once")
	assert.Greater(t, w, int64(5_000_000))

	// Go books the 7th; its wait is the textbook one against the stored
	// TAT; then the foreign client's next is one interval later.
	before, _ := e.tat(t, "ft", "k")
	view, err := lim.With(reserve.WithoutMaxWait())
	require.NoError(t, err)
	r, err := view.Reserve(ctx, "k")
	require.NoError(t, err)
	require.True(t, r.OK())
	b := r.Booking()
	decided := docMicros(b.At) - b.Wait.Microseconds()
	assert.Equal(t, textbookWait(before, true, decided, 1, limit), b.Wait.Microseconds())
	ok, w = foreign(1, 1<<50)
	require.True(t, ok)
	now := docMicros(e.now(t))
	assert.InDelta(t, float64(docMicros(b.At)+I), float64(now+w), 50_000, "the foreign client's slot one interval after Go's")

	// A Go refund's tombstone (the foreign client's booking stands on Go's,
	// so book a fresh one on another key to give back).
	_, err = view.ReserveN(ctx, "k2", 6) // the burst: the next slot is 6 s out
	require.NoError(t, err)
	r2, err := view.Reserve(ctx, "k2")
	require.NoError(t, err)
	require.Positive(t, r2.Booking().Wait)
	require.NoError(t, r2.Cancel(ctx))
	all, err := e.rdb.Keys(ctx, "*").Result()
	require.NoError(t, err)
	var tombs []string
	for _, k := range all {
		if strings.HasPrefix(k, e.prefix+"ft:{k2}:x:") {
			tombs = append(tombs, k)
		}
	}

	require.Len(t, tombs, 1, "one tombstone named <first key>:x:<id>")
	pttl, err := e.rdb.PTTL(ctx, tombs[0]).Result()
	require.NoError(t, err)
	left := r2.Booking().At.Sub(e.now(t))
	assert.InDelta(t, float64(left), float64(pttl), float64(100*time.Millisecond), "the tombstone expires at the booking's slot")
}

// TestReviewDOCKeyExpiry: "The key expires when TAT passes, so idle
// subjects cost nothing" with "PX = ceil((TAT - now) / 1000) + 1".
func TestReviewDOCKeyExpiry(t *testing.T) {
	e := newDocEnv(t)
	ctx := context.Background()
	lim := e.limiter(t, "kx", throttle.PerSecond(5, 1)) // I = 200ms
	require.NoError(t, lim.Acquire(ctx, "k"))
	require.NoError(t, lim.Acquire(ctx, "k"))
	now := e.now(t)
	tat, ok := e.tat(t, "kx", "k")
	require.True(t, ok)
	pttl, err := e.rdb.PTTL(ctx, e.prefix+"kx:{k}").Result()
	require.NoError(t, err)
	maxPX := (tat-docMicros(now)+999)/1000 + 1
	assert.Positive(t, pttl)
	assert.LessOrEqual(t, pttl.Milliseconds(), maxPX, "PX beyond ceil((TAT-now)/1ms)+1")
	for docMicros(e.now(t)) <= tat+2000 {
		time.Sleep(5 * time.Millisecond)
	}
	n, err := e.rdb.Exists(ctx, e.prefix+"kx:{k}").Result()
	require.NoError(t, err)
	assert.Zero(t, n, "the key outlived its TAT")
}

// TestReviewDOCForgoClaim: Reservation.Forgo "returns a Reservation that
// holds r's booking as a late refusal held for its caller does (not OK, its
// Err err; its Booking().OK is true): ... its Cancel gives the booking back
// even once its slot has come ... r then holds nothing: its Cancel does
// nothing. Forgo returns nil for a nil err, a view, a refusal"; Claim
// "returns nil for any other Reservation" than a held late refusal, and
// hands a forgone booking on as an OK Reservation.
func TestReviewDOCForgoClaim(t *testing.T) {
	e := newDocEnv(t)
	ctx := context.Background()
	limit := throttle.PerMinute(10, 2)
	lim := e.limiter(t, "fg", limit, reserve.WithCoalescing(false), reserve.WithMaxWait(time.Minute))
	require.NoError(t, lim.Acquire(ctx, "k"))
	before, _ := e.tat(t, "fg", "k")
	r, err := lim.Reserve(ctx, "k") // wait 0: its slot has come
	require.NoError(t, err)
	require.True(t, r.OK())
	require.Zero(t, r.Booking().Wait)
	assert.Nil(t, r.Claim(), "Claim of an ordinary booking")
	assert.Nil(t, r.Forgo(nil), "Forgo(nil)")
	assert.Nil(t, r.View().Forgo(errors.New("x")), "Forgo of a view")
	gone := errors.New("job ended before it started")
	f := r.Forgo(gone)
	require.NotNil(t, f)
	assert.False(t, f.OK())
	assert.ErrorIs(t, f.Err(), gone)
	assert.True(t, f.Booking().OK)
	e.calls.cmds.Store(0)
	require.NoError(t, r.Cancel(ctx))
	assert.Zero(t, e.calls.cmds.Load(), "the forgone-from Reservation's Cancel made a call")
	v, _ := e.tat(t, "fg", "k")
	assert.Equal(t, before+limit.Interval().Microseconds(), v)

	c := f.Claim()
	require.NotNil(t, c, "Claim hands the forgone booking on")
	assert.True(t, c.OK())
	assert.Equal(t, f.Booking().At, c.Booking().At)
	assert.Nil(t, f.Claim(), "claimed twice")
	require.NoError(t, f.Cancel(ctx), "f holds nothing now")
	v, _ = e.tat(t, "fg", "k")
	assert.Equal(t, before+limit.Interval().Microseconds(), v, "a claimed-from Reservation's Cancel gave back")
	// c is as one booked for its caller: its slot has come, so its Cancel
	// gives nothing back.
	require.NoError(t, c.Cancel(ctx))
	v, _ = e.tat(t, "fg", "k")
	assert.Equal(t, before+limit.Interval().Microseconds(), v, "Cancel of a claimed booking whose slot has come")

	// Forgo then Cancel: given back though the slot has come.
	r, err = lim.Reserve(ctx, "k")
	require.NoError(t, err)
	require.Zero(t, r.Booking().Wait)
	mid, _ := e.tat(t, "fg", "k")
	f = r.Forgo(gone)
	require.NoError(t, f.Cancel(ctx))
	v, _ = e.tat(t, "fg", "k")
	assert.Equal(t, mid-limit.Interval().Microseconds(), v, "a forgone booking whose slot has come, given back")

	refused, err := lim.ReserveN(ctx, "k", 3) // refused if its slot lies past the minute's max wait
	require.NoError(t, err)
	if !refused.OK() {
		assert.Nil(t, refused.Forgo(gone), "Forgo of a refusal")
		assert.Nil(t, refused.Claim(), "Claim of a refusal")
	}
}
