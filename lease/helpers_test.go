package lease_test

// Helpers shared by the package's tests, most of them by the adversarial
// reviews (review_side*_test.go): engines on proxied or hooked clients, goroutine checks after Close, a hook that
// sees every script call, the Redis side of a lease found by its token,
// and the bookkeeping of believed holders.

import (
	"context"
	"fmt"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/slotbook/slotbook/internal/redistest"
	"github.com/slotbook/slotbook/lease"
	"github.com/slotbook/slotbook/throttle"
)

// rvProxied returns a proxy to e's server and an engine (on e's prefix)
// over a client through it, with its options changed by tweak (if not
// nil) and hooks added.
func rvProxied(t *testing.T, e *env, timeout time.Duration, tweak func(*redis.Options), hooks ...redis.Hook) (*redistest.Proxy, *throttle.Engine) {
	t.Helper()
	p := redistest.NewProxy(t, e.srv.Addr)
	var c *redis.Client
	if tweak != nil {
		c = p.Client(t, e.srv, tweak)
	} else {
		c = p.Client(t, e.srv)
	}
	for _, h := range hooks {
		c.AddHook(h)
	}
	eng, err := throttle.New(c, throttle.WithPrefix(e.prefix), throttle.WithTimeout(timeout))
	require.NoError(t, err)
	return p, eng
}

// rvDirect returns an engine (on e's prefix) over a client of its own,
// with hooks added.
func rvDirect(t *testing.T, e *env, timeout time.Duration, hooks ...redis.Hook) *throttle.Engine {
	t.Helper()
	c := e.srv.Client(t)
	for _, h := range hooks {
		c.AddHook(h)
	}
	eng, err := throttle.New(c, throttle.WithPrefix(e.prefix), throttle.WithTimeout(timeout))
	require.NoError(t, err)
	return eng
}

// rvSem builds a Semaphore named partner, closed (within 5 s) when the test
// ends.
func rvSem(t *testing.T, eng *throttle.Engine, n int, opts ...lease.Option) *lease.Semaphore {
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

// rvLeaseGoroutines counts goroutines running code of package lease.
func rvLeaseGoroutines() int {
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

// rvSettled polls until no goroutine of package lease is left, or within
// has passed.
func rvSettled(t *testing.T, within time.Duration) {
	t.Helper()
	deadline := time.Now().Add(within)
	for rvLeaseGoroutines() != 0 {
		if time.Now().After(deadline) {
			buf := make([]byte, 1<<20)
			t.Errorf("%d goroutines of package lease left %v after Close:\n%s", rvLeaseGoroutines(), within, buf[:runtime.Stack(buf, true)])
			return
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// rvScriptArgs returns a script call's ARGV and KEYS, or nil.
func rvScriptArgs(cmd redis.Cmder) (argv []any, keys []string) {
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

// rvIsKeep tells a keep call (its 4th argument is the count of held ids).
func rvIsKeep(cmd redis.Cmder) bool {
	argv, _ := rvScriptArgs(cmd)
	if len(argv) < 4 {
		return false
	}
	_, ok := argv[3].(int)
	return ok
}

// rvBelieve holds l, believed held (in bel) meanwhile, until stop or until
// its Lost closes, looking every 2 ms, and returns the interval over
// which it was believed held (since base) and whether Lost closed. The
// time is read before Lost is: open when read, the lease was believed
// held at that time (read after, a goroutine descheduled between the two
// would stretch the interval past Lost's closing).
func rvBelieve(l *lease.Lease, bel *rvBelieved, base, stop time.Time) (from, to time.Duration, lost bool) {
	from = time.Since(base)
	bel.set(l, true)
	defer bel.set(l, false)
	to = from
	for {
		now := time.Since(base)
		select {
		case <-l.Lost():
			return from, to, true
		default:
			to = now // still believed here
		}
		if time.Now().After(stop) {
			return from, to, false
		}
		time.Sleep(2 * time.Millisecond)
	}
}

// rvKeepsOut is a hook that counts in out the keep calls on their way.
func rvKeepsOut(out *atomic.Int64) rvHook {
	return rvHook{
		before: func(cmd redis.Cmder) {
			if rvIsKeep(cmd) {
				out.Add(1)
			}
		},
		after: func(cmd redis.Cmder, _ time.Duration) {
			if rvIsKeep(cmd) {
				out.Add(-1)
			}
		},
	}
}

// rvHook calls before (if set) before each command is sent, and after (if
// set) once it has its reply, in the caller's goroutine: either may block
// it, as a scheduler or a slow path would.
type rvHook struct {
	before func(cmd redis.Cmder)
	after  func(cmd redis.Cmder, took time.Duration)
}

func (h rvHook) DialHook(next redis.DialHook) redis.DialHook { return next }
func (h rvHook) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		if h.before != nil {
			h.before(cmd)
		}
		t0 := time.Now()
		err := next(ctx, cmd)
		if h.after != nil {
			h.after(cmd, time.Since(t0))
		}
		return err
	}
}
func (h rvHook) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}

// rvProbe finds the lease of token on the Redis side: its id, its expiry
// (ZSCORE, µs), Redis's TIME (µs) and whether it is still a holder.
var rvProbe = redis.NewScript(`
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

type rvSeen struct {
	id          string
	expiry, now int64 // µs, Redis clock
	held        bool
}

// margin is how long Redis still holds the lease.
func (s rvSeen) margin() time.Duration { return time.Duration(s.expiry-s.now) * time.Microsecond }

func rvLook(ctx context.Context, rdb *redis.Client, e *env, key string, token int64) rvSeen {
	v, err := rvProbe.Run(ctx, rdb, []string{e.key(key, "h"), e.key(key, "t")}, fmt.Sprint(token)).Slice()
	if err != nil || len(v) != 4 {
		return rvSeen{}
	}
	id, _ := v[0].(string)
	s, _ := v[1].(int64)
	now, _ := v[2].(int64)
	h, _ := v[3].(int64)
	return rvSeen{id: id, expiry: s, now: now, held: h == 1}
}

// rvBelieved tracks, per token, the leases a worker believes it holds; a
// hook on every client checks each leave or release call sent by the
// package against it (ids are unique per waiter: a call for a lease its
// holder still believes in, Lost open, would be a defect).
type rvBelieved struct {
	mu    sync.Mutex
	held  map[int64]*lease.Lease
	rdb   *redis.Client
	viols atomic.Int64
	first atomic.Value
}

func (b *rvBelieved) set(l *lease.Lease, on bool) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if on {
		b.held[l.Token()] = l
	} else {
		delete(b.held, l.Token())
	}
}

// hook flags a leave or release call for a lease whose holder still
// believes it holds (Lost open, no Release).
func (b *rvBelieved) hook() rvHook {
	return rvHook{before: func(cmd redis.Cmder) {
		argv, keys := rvScriptArgs(cmd)
		if len(argv) != 4 || len(keys) < 2 {
			return
		}
		id, ok := argv[3].(string)
		if !ok {
			return
		}
		tok, err := b.rdb.HGet(context.Background(), keys[1], id).Int64()
		if err != nil {
			return
		}
		b.mu.Lock()
		l := b.held[tok]
		b.mu.Unlock()
		if l == nil {
			return
		}
		select {
		case <-l.Lost():
		default:
			if b.viols.Add(1) == 1 {
				b.first.Store(fmt.Sprintf("leave/release of %s (token %d) sent while its holder believes it holds (Lost open, no Release)", id, tok))
			}
		}
	}}
}
