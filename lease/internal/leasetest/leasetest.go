// Package leasetest is the test rig shared by package lease's tests and
// the reviews in lease/internal/leasereview and keepreview: an engine on
// a key prefix of its own (Env), Semaphores closed when the test ends, an
// Acquire in a goroutine of its own (AcquireAsync), the Redis keys of a
// subject, engines over proxied or hooked clients, a goroutine check
// after Close, a hook that sees every command, and the Redis side of a
// lease found by its fencing token. Nothing outside tests imports it.
package leasetest

import (
	"context"
	"fmt"
	"net"
	"os"
	"runtime"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/slotbook/slotbook/internal/callcount"
	"github.com/slotbook/slotbook/internal/redistest"
	"github.com/slotbook/slotbook/lease"
	"github.com/slotbook/slotbook/throttle"
)

// Env is one test's engine on a key prefix of its own.
type Env struct {
	Srv    *redistest.Server
	Rdb    *redis.Client
	Calls  *callcount.Counter
	Eng    *throttle.Engine
	Prefix string
}

// NewEnv returns an Env on the test binary's shared server.
func NewEnv(t *testing.T) *Env {
	t.Helper()
	srv := redistest.Shared(t)
	srv.RequireReal(t)
	rdb := srv.Client(t)
	calls := callcount.Attach(rdb)
	prefix := redistest.Prefix(t)
	// A generous timeout: these tests check logic, not latency.
	eng, err := throttle.New(rdb, throttle.WithPrefix(prefix), throttle.WithTimeout(5*time.Second))
	require.NoError(t, err)
	return &Env{Srv: srv, Rdb: rdb, Calls: calls, Eng: eng, Prefix: prefix}
}

// Sem builds a Semaphore named partner on e's engine, closed when the
// test ends.
func (e *Env) Sem(t *testing.T, n int, opts ...lease.Option) *lease.Semaphore {
	t.Helper()
	s, err := lease.New(e.Eng, "partner", n, opts...)
	require.NoError(t, err)
	t.Cleanup(func() { _ = s.Close(context.Background()) })
	return s
}

// Key returns the full Redis key of one of subject's lease structures
// (h holders, q queue, w waiters, t tokens, c counter).
func (e *Env) Key(subject, part string) string {
	return e.Prefix + "partner:{" + subject + "}:lease:" + part
}

// Keys lists the Redis keys under the test's prefix.
func (e *Env) Keys(t *testing.T) []string {
	t.Helper()
	ks, err := e.Rdb.Keys(context.Background(), e.Prefix+"*").Result()
	require.NoError(t, err)
	return ks
}

// KeysBut is Keys without subject's set of waiters that gave up (:l),
// which is kept for a TTL after the last of them (so that a call their
// leave overtook does not queue them again): it checks that the set
// expires within ttl and a second.
func (e *Env) KeysBut(t *testing.T, subject string, ttl time.Duration) []string {
	t.Helper()
	var out []string
	for _, k := range e.Keys(t) {
		if k != e.Key(subject, "l") {
			out = append(out, k)
			continue
		}
		d, err := e.Rdb.PTTL(context.Background(), k).Result()
		require.NoError(t, err)
		require.True(t, d > 0 && d <= ttl+time.Second, "%s expires in %v, want within %v", k, d, ttl+time.Second)
	}
	return out
}

// Queued waits (as WaitFor) until subject's queue holds want waiters.
func (e *Env) Queued(t *testing.T, subject string, want int64) {
	t.Helper()
	WaitFor(t, func() bool { return e.Rdb.ZCard(context.Background(), e.Key(subject, "q")).Val() == want })
}

// NoGhosts checks that no holder, queue or waiter entry of subjects is
// left in Redis.
func (e *Env) NoGhosts(t *testing.T, subjects []string) {
	t.Helper()
	ctx := context.Background()
	for _, k := range subjects {
		for _, part := range []string{"h", "q", "w"} {
			v := e.Rdb.ZRange(ctx, e.Key(k, part), 0, -1).Val()
			require.Empty(t, v, "%s of %s left in Redis after every worker is done and Close", part, k)
		}
	}
}

// WaitFor polls cond until it holds, for at most 20 s.
func WaitFor(t *testing.T, cond func() bool) { t.Helper(); WaitForSaying(t, cond, nil) }

// WaitForSaying is WaitFor that, if cond never holds, reports what state
// says (if not nil) as the test fails: what the scene looked like.
func WaitForSaying(t *testing.T, cond func() bool, state func() string) {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			if state != nil {
				t.Fatalf("condition never held: %s", state())
			}
			t.Fatal("condition never held")
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// Proxied returns a proxy to e's server and an engine (on e's prefix)
// over a client through it, with its options changed by tweak (if not
// nil) and hooks added.
func Proxied(t *testing.T, e *Env, timeout time.Duration, tweak func(*redis.Options), hooks ...redis.Hook) (*redistest.Proxy, *throttle.Engine) {
	t.Helper()
	p := redistest.NewProxy(t, e.Srv.Addr)
	var c *redis.Client
	if tweak != nil {
		c = p.Client(t, e.Srv, tweak)
	} else {
		c = p.Client(t, e.Srv)
	}
	for _, h := range hooks {
		c.AddHook(h)
	}
	eng, err := throttle.New(c, throttle.WithPrefix(e.Prefix), throttle.WithTimeout(timeout))
	require.NoError(t, err)
	return p, eng
}

// Direct returns an engine (on e's prefix) over a client of its own,
// with hooks added.
func Direct(t *testing.T, e *Env, timeout time.Duration, hooks ...redis.Hook) *throttle.Engine {
	t.Helper()
	c := e.Srv.Client(t)
	for _, h := range hooks {
		c.AddHook(h)
	}
	eng, err := throttle.New(c, throttle.WithPrefix(e.Prefix), throttle.WithTimeout(timeout))
	require.NoError(t, err)
	return eng
}

// Server returns a redis-server of the test's own if own (to pause or
// stop it), else the shared one, which must be a real redis-server.
func Server(t *testing.T, own bool) *redistest.Server {
	t.Helper()
	if own {
		return redistest.Start(t)
	}
	srv := redistest.Shared(t)
	srv.RequireReal(t)
	return srv
}

// Hooked returns an engine (on prefix, with the given timeout) over a
// client of srv of its own with hook added: direct, or through a proxy
// adding latency each way if latency is not zero (the proxy is returned,
// else nil).
func Hooked(t *testing.T, srv *redistest.Server, prefix string, timeout, latency time.Duration, hook redis.Hook) (*throttle.Engine, *redistest.Proxy) {
	t.Helper()
	var (
		c *redis.Client
		p *redistest.Proxy
	)
	if latency > 0 {
		p = redistest.NewProxy(t, srv.Addr)
		p.SetLatency(latency)
		c = p.Client(t, srv)
	} else {
		c = srv.Client(t)
	}
	c.AddHook(hook)
	eng, err := throttle.New(c, throttle.WithPrefix(prefix), throttle.WithTimeout(timeout))
	require.NoError(t, err)
	return eng, p
}

// SemOn builds a Semaphore named partner on eng, closed (within 5 s) when
// the test ends.
func SemOn(t *testing.T, eng *throttle.Engine, n int, opts ...lease.Option) *lease.Semaphore {
	t.Helper()
	s, err := lease.New(eng, "partner", n, opts...)
	require.NoError(t, err)
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_ = s.Close(ctx)
	})
	return s
}

// IsLost tells whether l's Lost channel has closed, without waiting.
func IsLost(l *lease.Lease) bool {
	select {
	case <-l.Lost():
		return true
	default:
		return false
	}
}

// leaseGoroutines counts goroutines running code of package lease.
func leaseGoroutines() int {
	buf := make([]byte, 4<<20)
	buf = buf[:runtime.Stack(buf, true)]
	n := 0
	for _, g := range strings.Split(string(buf), "\n\n") {
		if strings.Contains(g, "slotbook/slotbook/lease.") {
			n++
		}
	}
	return n
}

// CloseAtEnd closes s when the test ends (within 5 s), so that a test that
// fails before its own Close leaves no keeper running into the tests
// after it (their goroutine checks would fail too). Close is idempotent.
func CloseAtEnd(t *testing.T, s *lease.Semaphore) {
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_ = s.Close(ctx)
	})
}

// SettleTime polls until no goroutine of package lease is left, for at
// most within, and returns how long that took (within if never).
func SettleTime(within time.Duration) time.Duration {
	start := time.Now()
	for leaseGoroutines() != 0 {
		if time.Since(start) > within {
			return within
		}
		time.Sleep(10 * time.Millisecond)
	}
	return time.Since(start)
}

// Settled polls until no goroutine of package lease is left, or within
// has passed.
func Settled(t *testing.T, within time.Duration) {
	t.Helper()
	deadline := time.Now().Add(within)
	for leaseGoroutines() != 0 {
		if time.Now().After(deadline) {
			buf := make([]byte, 1<<20)
			t.Errorf("%d goroutines of package lease left %v after Close:\n%s", leaseGoroutines(), within, buf[:runtime.Stack(buf, true)])
			return
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// ScriptArgs returns a script call's ARGV and KEYS, or nil.
func ScriptArgs(cmd redis.Cmder) (argv []any, keys []string) {
	a := cmd.Args()
	if (cmd.Name() != "evalsha" && cmd.Name() != "eval") || len(a) < 3 {
		return nil, nil
	}
	nk, ok := a[2].(int)
	if !ok || len(a) < 3+nk {
		return nil, nil
	}
	for _, k := range a[3 : 3+nk] {
		keys = append(keys, fmt.Sprint(k))
	}
	return a[3+nk:], keys
}

// IsKeep tells a keep call (its 4th argument is the count of held ids).
func IsKeep(cmd redis.Cmder) bool {
	argv, _ := ScriptArgs(cmd)
	if len(argv) < 4 {
		return false
	}
	_, ok := argv[3].(int)
	return ok
}

// ErrLostRead is what a hook answers for a call whose reply it reports
// lost: a read timeout, after which the call may have run (the engine
// reports it as throttle.ErrReplyLost).
var ErrLostRead error = &net.OpError{Op: "read", Net: "tcp", Err: os.ErrDeadlineExceeded}

// ErrNotSent is what a hook answers for a call it fails unsent: a refused
// dial, as when Redis is away (the engine's breaker counts it).
var ErrNotSent error = &net.OpError{Op: "dial", Net: "tcp", Err: syscall.ECONNREFUSED}

// Hook calls Before (if set) before each command is sent, and After (if
// set) once it has its reply, in the caller's goroutine: either may block
// it, as a scheduler or a slow path would.
type Hook struct {
	Before func(cmd redis.Cmder)
	After  func(cmd redis.Cmder, took time.Duration)
}

func (h Hook) DialHook(next redis.DialHook) redis.DialHook { return next }
func (h Hook) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		if h.Before != nil {
			h.Before(cmd)
		}
		t0 := time.Now()
		err := next(ctx, cmd)
		if h.After != nil {
			h.After(cmd, time.Since(t0))
		}
		return err
	}
}
func (h Hook) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}

// probe finds the lease of token on the Redis side: its id, its expiry
// (ZSCORE, µs), Redis's TIME (µs) and whether it is still a holder.
var probe = redis.NewScript(`
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local all = redis.call('HGETALL', KEYS[2])
for i = 1, #all, 2 do
  if all[i + 1] == ARGV[1] then
    local s = redis.call('ZSCORE', KEYS[1], all[i])
    if s then return {all[i], tonumber(s), now, 1} end
    return {all[i], 0, now, 0}
  end
end
return {'', 0, now, 0}
`)

// Seen is the Redis side of a lease, as Look found it.
type Seen struct {
	ID          string
	Expiry, Now int64 // µs, Redis clock
	Held        bool
}

// Margin is how long Redis still holds the lease.
func (s Seen) Margin() time.Duration { return time.Duration(s.Expiry-s.Now) * time.Microsecond }

// Look finds the lease of token under key on the Redis side (the zero
// Seen if the probe fails).
func Look(ctx context.Context, rdb *redis.Client, e *Env, key string, token int64) Seen {
	s, _ := LookOn(ctx, rdb, e.Prefix, key, token)
	return s
}

// LookOn is Look on any Scripter (a Cluster client routes the probe to
// the key's node, whose TIME it reads), for a Semaphore named partner on
// an engine with the given key prefix. It returns the probe's error, or
// one naming a reply that is not four values, with the zero Seen.
func LookOn(ctx context.Context, rdb redis.Scripter, prefix, key string, token int64) (Seen, error) {
	base := prefix + "partner:{" + key + "}:lease:"
	v, err := probe.Run(ctx, rdb, []string{base + "h", base + "t"}, fmt.Sprint(token)).Slice()
	if err != nil {
		return Seen{}, err
	}
	if len(v) != 4 {
		return Seen{}, fmt.Errorf("probe reply %v", v)
	}
	id, _ := v[0].(string)
	s, _ := v[1].(int64)
	now, _ := v[2].(int64)
	h, _ := v[3].(int64)
	return Seen{ID: id, Expiry: s, Now: now, Held: h == 1}, nil
}

// RedisNow is Redis's TIME in µs (0 if it cannot be read).
func RedisNow(rdb *redis.Client) int64 {
	tm, err := rdb.Time(context.Background()).Result()
	if err != nil {
		return 0
	}
	return tm.UnixMicro()
}

// Ms is us µs as a Duration, to the millisecond (for logs).
func Ms(us int64) time.Duration {
	return (time.Duration(us) * time.Microsecond).Round(time.Millisecond)
}

// Got is the outcome of an Acquire started by AcquireAsync: who made it,
// the lease or the error, and when it returned on the Redis clock
// (microseconds).
type Got struct {
	Who string
	L   *lease.Lease
	Err error
	At  int64
}

// AcquireAsync starts an Acquire of key on s in its own goroutine and
// sends its outcome to got.
func AcquireAsync(ctx context.Context, e *Env, s *lease.Semaphore, who, key string, got chan<- Got) {
	go func() {
		l, err := s.Acquire(ctx, key)
		got <- Got{Who: who, L: l, Err: err, At: RedisNow(e.Rdb)}
	}()
}

// Pause stops srv (SIGSTOP: connections are accepted, nothing answers)
// and waits until eng's breaker is open, opened by eng's calls.
func Pause(t *testing.T, srv *redistest.Server, eng *throttle.Engine) {
	t.Helper()
	require.NoError(t, syscall.Kill(srv.Pid(), syscall.SIGSTOP))
	lim := throttle.PerSecond(1000, 1000)
	WaitFor(t, func() bool {
		_, _ = eng.Allow(context.Background(), "leasetest-pause", lim)
		open, _ := eng.Unavailable()
		return open
	})
}

// Resume resumes srv, stopped by Pause, and waits until it answers eng.
func Resume(t *testing.T, srv *redistest.Server, eng *throttle.Engine) {
	t.Helper()
	require.NoError(t, syscall.Kill(srv.Pid(), syscall.SIGCONT))
	lim := throttle.PerSecond(1000, 1000)
	redistest.UntilOK(t, func() error { _, err := eng.Allow(context.Background(), "leasetest-resume", lim); return err })
}

// Recv returns the next value of ch, or fails the test if none comes
// within 10 s (what names the awaited value).
func Recv[T any](t *testing.T, ch <-chan T, what string) T {
	t.Helper()
	select {
	case v := <-ch:
		return v
	case <-time.After(10 * time.Second):
		t.Fatalf("%s: not within 10 s", what)
		panic("unreachable")
	}
}
