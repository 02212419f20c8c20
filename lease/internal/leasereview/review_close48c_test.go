package leasereview_test

// Review of 665969d (helper-144): Close keeps the room of a held lease
// while its release is out, and owes a leave call for the lease's id if
// the release fails. Side paths, through package lease's public API,
// go-redis hooks on an engine's client, SIGSTOP/SIGCONT and Stop of the
// test's own redis-server: a release whose reply is lost after the freed
// place went to another process's waiter; a holder's Release racing
// Close's; a release that fails after the lease lapsed in Redis and its
// place was granted; the observer's held count; Redis stopped for good;
// many keys with the breaker open at Close.

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/slotbook/slotbook/internal/redistest"
	"github.com/slotbook/slotbook/lease"
	"github.com/slotbook/slotbook/lease/internal/leasetest"
	"github.com/slotbook/slotbook/throttle"
)

// c48cTag marks a context (a holder's Release): the hook sees it.
type c48cTag struct{}

// c48cCall is one lease script call as c48cHook saw it.
type c48cCall struct {
	kind   string
	id     string // release, leave, acquire: the lease or waiter id
	tag    string // the caller context's c48cTag value
	hkey   string // its first key (the holders set, with the engine's prefix)
	ran    bool   // Redis answered it (whatever the caller was told)
	status int64  // the reply's status (release, leave: 1 if it gave back a held lease), -1 if none
	err    error  // what the caller was told
}

func (c c48cCall) String() string {
	return fmt.Sprintf("{%s %s tag %q ran %v status %d err %v}", c.kind, c.id, c.tag, c.ran, c.status, c.err)
}

// c48cHook, on B's client, names each lease script call, lets pre fail it
// unsent (or hold it), lets post replace its outcome after it ran (a lost
// reply), and records every call.
type c48cHook struct {
	kinds map[string]string
	pre   atomic.Pointer[func(ctx context.Context, kind, id string) error]
	post  atomic.Pointer[func(ctx context.Context, kind, id string, err error) error]
	mu    sync.Mutex
	calls []c48cCall
}

// c48cKindID returns the kind of a lease script call (see c48bHook's
// kind; "" for another command), the lease or waiter id it names (a
// leave, release or acquire call's; else ""), and its keys.
func c48cKindID(kinds map[string]string, cmd redis.Cmder) (kind, id string, keys []string) {
	kind = (&c48bHook{kinds: kinds}).kind(cmd)
	if kind == "" {
		return "", "", nil
	}
	argv, keys := leasetest.ScriptArgs(cmd)
	if (kind == "leave" || kind == "release" || kind == "acquire") && len(argv) >= 4 {
		id = fmt.Sprint(argv[3])
	}
	return kind, id, keys
}

func newC48cHook(t *testing.T) *c48cHook { return &c48cHook{kinds: c48bKinds(t)} }

func (h *c48cHook) setPre(f func(ctx context.Context, kind, id string) error) { h.pre.Store(&f) }
func (h *c48cHook) setPost(f func(ctx context.Context, kind, id string, err error) error) {
	h.post.Store(&f)
}

func (h *c48cHook) DialHook(next redis.DialHook) redis.DialHook { return next }
func (h *c48cHook) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}
func (h *c48cHook) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		kind, id, keys := c48cKindID(h.kinds, cmd)
		if kind == "" {
			return next(ctx, cmd)
		}
		tag, _ := ctx.Value(c48cTag{}).(string)
		c := c48cCall{kind: kind, id: id, tag: tag, status: -1}
		if len(keys) > 0 {
			c.hkey = keys[0]
		}
		if p := h.pre.Load(); p != nil && *p != nil {
			if err := (*p)(ctx, kind, id); err != nil {
				cmd.SetErr(err)
				c.err = err
				h.record(c)
				return err
			}
		}
		err := next(ctx, cmd)
		if err == nil {
			c.ran = true
			if rc, ok := cmd.(interface{ Val() any }); ok { // the engine's command embeds a *redis.Cmd
				if arr, ok := rc.Val().([]any); ok && len(arr) > 0 {
					if s, ok := arr[0].(int64); ok {
						c.status = s
					}
				}
			}
		}
		if p := h.post.Load(); p != nil && *p != nil {
			if perr := (*p)(ctx, kind, id, err); perr != nil {
				cmd.SetErr(perr)
				err = perr
			}
		}
		c.err = err
		h.record(c)
		return err
	}
}

func (h *c48cHook) record(c c48cCall) {
	h.mu.Lock()
	h.calls = append(h.calls, c)
	h.mu.Unlock()
}

// of returns the calls recorded for id.
func (h *c48cHook) of(id string) []c48cCall {
	h.mu.Lock()
	defer h.mu.Unlock()
	var out []c48cCall
	for _, c := range h.calls {
		if c.id == id {
			out = append(out, c)
		}
	}
	return out
}

// onKey returns the calls recorded for key (a Semaphore named partner).
func (h *c48cHook) onKey(key string) []c48cCall {
	h.mu.Lock()
	defer h.mu.Unlock()
	var out []c48cCall
	for _, c := range h.calls {
		if strings.HasSuffix(c.hkey, "partner:{"+key+"}:lease:h") {
			out = append(out, c)
		}
	}
	return out
}

// gaveBack counts, in calls, the release and leave calls Redis ran that
// gave back a held lease (status 1), and the leave calls answered to the
// caller.
func c48cGaveBack(calls []c48cCall) (gave, leavesAnswered, leavesSent int) {
	for _, c := range calls {
		if c.ran && c.status == 1 && (c.kind == "release" || c.kind == "leave") {
			gave++
		}
		if c.kind == "leave" {
			leavesSent++
			if c.err == nil {
				leavesAnswered++
			}
		}
	}
	return gave, leavesAnswered, leavesSent
}

// c48cObs counts ObserveHeld and ObserveWaiting, and their lowest sums.
type c48cObs struct {
	mu                   sync.Mutex
	held, heldMin, heldN int // sum, lowest sum, calls
	plus, minus          int
	waiting, waitingMin  int
}

func (o *c48cObs) ObserveHeld(_ string, d int) {
	o.mu.Lock()
	defer o.mu.Unlock()
	o.held += d
	o.heldN++
	if d > 0 {
		o.plus++
	} else {
		o.minus++
	}
	o.heldMin = min(o.heldMin, o.held)
}
func (o *c48cObs) ObserveWaiting(_ string, d int) {
	o.mu.Lock()
	defer o.mu.Unlock()
	o.waiting += d
	o.waitingMin = min(o.waitingMin, o.waiting)
}
func (o *c48cObs) ObserveWait(string, time.Duration, error) {}
func (o *c48cObs) ObserveExpired(string, int)               {}

func (o *c48cObs) String() string {
	o.mu.Lock()
	defer o.mu.Unlock()
	return fmt.Sprintf("held %d (lowest %d, +%d -%d), waiting %d (lowest %d)", o.held, o.heldMin, o.plus, o.minus, o.waiting, o.waitingMin)
}

func (o *c48cObs) check(t *testing.T, what string) {
	t.Helper()
	o.mu.Lock()
	defer o.mu.Unlock()
	assert.Zero(t, o.held, "%s: observer's held sum once every lease is given back (+%d -%d)", what, o.plus, o.minus)
	assert.Zero(t, o.heldMin, "%s: observer's held sum went negative", what)
	assert.Equal(t, o.plus, o.minus, "%s: ObserveHeld +1 and -1 calls", what)
	assert.Zero(t, o.waiting, "%s: observer's waiting sum at the end", what)
	assert.Zero(t, o.waitingMin, "%s: observer's waiting sum went negative", what)
}

// c48cPair is A (direct engine, 5 s timeout) and B (an engine over a
// client hooked by a c48cHook, timeout btimeout, observed), N = 1, on the
// shared server, scripts loaded.
type c48cPair struct {
	rdb    *redis.Client
	prefix string
	a, b   *lease.Semaphore
	hook   *c48cHook
	obs    *c48cObs
}

func c48cNewPair(t *testing.T, ttl, btimeout time.Duration) *c48cPair {
	t.Helper()
	ctx := context.Background()
	srv := redistest.Shared(t)
	srv.RequireReal(t)
	p := &c48cPair{rdb: srv.Client(t), prefix: redistest.Prefix(t), hook: newC48cHook(t), obs: &c48cObs{}}
	aEng, err := throttle.New(p.rdb, throttle.WithPrefix(p.prefix), throttle.WithTimeout(5*time.Second))
	require.NoError(t, err)
	p.a, err = lease.New(aEng, "partner", 1, lease.WithTTL(ttl))
	require.NoError(t, err)
	leasetest.CloseAtEnd(t, p.a)
	c := srv.Client(t)
	c.AddHook(p.hook)
	bEng, err := throttle.New(c, throttle.WithPrefix(p.prefix), throttle.WithTimeout(btimeout))
	require.NoError(t, err)
	p.b, err = lease.New(bEng, "partner", 1, lease.WithTTL(ttl), lease.WithObserver(p.obs))
	require.NoError(t, err)
	leasetest.CloseAtEnd(t, p.b)
	redistest.UntilOK(t, func() error { return p.a.Load(ctx) })
	redistest.UntilOK(t, func() error { return p.b.Load(ctx) })
	return p
}

func (p *c48cPair) look(t *testing.T, key string, token int64) leasetest.Seen {
	t.Helper()
	var s leasetest.Seen
	redistest.UntilOK(t, func() error {
		var err error
		s, err = leasetest.LookOn(context.Background(), p.rdb, p.prefix, key, token)
		return err
	})
	return s
}

func (p *c48cPair) holders(key string) []string {
	return p.rdb.ZRange(context.Background(), p.prefix+"partner:{"+key+"}:lease:h", 0, -1).Val()
}

func (p *c48cPair) queued(key string) int64 {
	return p.rdb.ZCard(context.Background(), p.prefix+"partner:{"+key+"}:lease:q").Val()
}

type c48cGot struct {
	l   *lease.Lease
	err error
}

// TestReviewClose48cOwedLeaveSparesNewHolder: B (N = 1) holds key K's
// lease; A has two waiters queued on K (a1 first). Close(Background) of
// B, whose release call fails. Variants:
//   - lostReply: the release runs in Redis (granting a1 its place), and
//     its reply is reported lost (a read timeout).
//   - lapsedLost: B's hook holds the release call until a1 is granted
//     (B's lease, no longer extended, lapsed in Redis after the TTL and
//     A's poll swept it and granted a1), then runs it (it finds nothing)
//     and reports its reply lost.
//   - lapsedUnsent: as lapsedLost, but the call is failed unsent (a
//     refused dial).
//
// Checks, once Close returned: premise, Close returned the release's
// error (not ErrLost) and the keeper sent a leave call for B's lease id
// that Redis answered; that leave gave back nothing (status 0); a1's
// lease stands in Redis and is not Lost, for more than a TTL after (A
// extends it); a2 is not granted while a1 holds (one holder in Redis);
// once a1 releases, a2 is granted, its fencing token above a1's, a1's
// above B's; B's observer's held count is back to 0, never negative;
// nothing of B stands.
func TestReviewClose48cOwedLeaveSparesNewHolder(t *testing.T) {
	for _, variant := range []string{"lostReply", "lapsedLost", "lapsedUnsent"} {
		t.Run(variant, func(t *testing.T) {
			const ttl = 600 * time.Millisecond
			ctx := context.Background()
			p := c48cNewPair(t, ttl, 5*time.Second)
			key := "c48c-" + variant
			lb, err := p.b.Acquire(ctx, key)
			require.NoError(t, err)
			got1, got2 := make(chan c48cGot, 1), make(chan c48cGot, 1)
			go func() { l, err := p.a.Acquire(ctx, key); got1 <- c48cGot{l, err} }()
			leasetest.WaitFor(t, func() bool { return p.queued(key) == 1 })
			go func() { l, err := p.a.Acquire(ctx, key); got2 <- c48cGot{l, err} }()
			leasetest.WaitFor(t, func() bool { return p.queued(key) == 2 })

			var bID atomic.Value
			var a1 c48cGot
			a1Got := make(chan struct{})
			go func() { a1 = leasetest.Recv(t, got1, "a1's Acquire"); close(a1Got) }()
			p.hook.setPre(func(_ context.Context, kind, id string) error {
				if kind != "release" {
					return nil
				}
				bID.Store(id)
				if variant == "lostReply" {
					return nil
				}
				select { // held while B's lease lapses and a1 is granted
				case <-a1Got:
				case <-time.After(10 * time.Second):
				}
				if variant == "lapsedUnsent" {
					return leasetest.ErrNotSent
				}
				return nil
			})
			p.hook.setPost(func(_ context.Context, kind, _ string, err error) error {
				if kind == "release" && err == nil && variant != "lapsedUnsent" {
					return leasetest.ErrLostRead
				}
				return nil
			})
			cerr := p.b.Close(ctx)
			<-a1Got
			require.NoError(t, a1.err, "a1's Acquire")
			la1 := a1.l
			id, _ := bID.Load().(string)
			calls := p.hook.of(id)
			gave, answered, sent := c48cGaveBack(calls)
			t.Logf("%s: Close: %v; B's calls for its lease %s: %+v; a1's token %d, B's %d", variant, cerr, id, calls, la1.Token(), lb.Token())
			require.Error(t, cerr, "premise: Close returned the release's error")
			require.NotErrorIs(t, cerr, lease.ErrLost, "premise: the release failed (not lapsed)")
			require.Positive(t, answered, "premise: the owed leave call for B's lease was sent and answered (sent %d)", sent)
			for _, c := range calls {
				if c.kind == "leave" && c.ran {
					assert.Zero(t, c.status, "%s: the owed leave call gave back a held lease", variant)
				}
			}
			wantGave := 0
			if variant == "lostReply" {
				wantGave = 1 // the release itself, which ran
			}
			assert.Equal(t, wantGave, gave, "%s: calls of B's that gave back a held lease", variant)

			// a1's lease stands, and keeps standing past a TTL (A extends it).
			s := p.look(t, key, la1.Token())
			assert.True(t, s.Held, "%s: a1's lease stands in Redis once B's Close returned", variant)
			time.Sleep(ttl + ttl/2)
			s = p.look(t, key, la1.Token())
			assert.True(t, s.Held, "%s: a1's lease stands in Redis 1.5 TTL later", variant)
			assert.False(t, leasetest.IsLost(la1), "%s: a1's lease is Lost", variant)
			assert.Equal(t, []string{s.ID}, p.holders(key), "%s: holders in Redis while a1 holds", variant)
			select {
			case g := <-got2:
				t.Fatalf("%s: a2 granted (%v, %v) while a1 holds", variant, g.l, g.err)
			default:
			}
			assert.Greater(t, la1.Token(), lb.Token(), "%s: a1's token above B's", variant)
			require.NoError(t, la1.Release(ctx), "%s: a1's Release", variant)
			a2 := leasetest.Recv(t, got2, "a2's Acquire")
			require.NoError(t, a2.err)
			assert.Greater(t, a2.l.Token(), la1.Token(), "%s: a2's token above a1's", variant)
			assert.Len(t, p.holders(key), 1, "%s: holders in Redis while a2 holds", variant)
			require.NoError(t, a2.l.Release(ctx))
			assert.Empty(t, p.holders(key), "%s: holders once a2 released", variant)
			assert.True(t, leasetest.IsLost(lb), "%s: B's lease's Lost closed by Close", variant)
			p.obs.check(t, variant)
			t.Logf("%s: B's observer %v", variant, p.obs)
		})
	}
}

// TestReviewClose48cHolderRace: B (N = 1) holds K's lease, A has a
// waiter queued on K; the holder calls Release beside B's
// Close(Background). Variants:
//   - before: the holder's Release returns, then Close.
//   - during: B's hook holds Close's release call until the holder's
//     Release (called meanwhile) has returned; then the call goes.
//   - duringFail: as during, but Close's call is then failed unsent: the
//     owed leave gives the lease back.
//   - after: Close returns, then the holder's Release.
//
// Checks: no panic; the holder's Release returns nil or ErrLost (it was
// released before, by Close, or Close's went first); exactly one call
// of B's gave the lease back in Redis; A's waiter is granted (once) and
// its lease stands; B's observer is balanced; nothing of B's stands.
func TestReviewClose48cHolderRace(t *testing.T) {
	for _, variant := range []string{"before", "during", "duringFail", "after"} {
		t.Run(variant, func(t *testing.T) {
			ctx := context.Background()
			p := c48cNewPair(t, 3*time.Second, 5*time.Second)
			key := "c48cr-" + variant
			lb, err := p.b.Acquire(ctx, key)
			require.NoError(t, err)
			got := make(chan c48cGot, 1)
			go func() { l, err := p.a.Acquire(ctx, key); got <- c48cGot{l, err} }()
			leasetest.WaitFor(t, func() bool { return p.queued(key) == 1 })
			in, goOn := make(chan struct{}), make(chan struct{})
			var once sync.Once
			holderCtx := context.WithValue(ctx, c48cTag{}, "holder")
			p.hook.setPre(func(ctx context.Context, kind, _ string) error {
				if kind != "release" || ctx.Value(c48cTag{}) != nil || (variant != "during" && variant != "duringFail") {
					return nil
				}
				once.Do(func() { close(in) })
				<-goOn
				if variant == "duringFail" {
					return leasetest.ErrNotSent
				}
				return nil
			})
			var herr, cerr error
			switch variant {
			case "before":
				herr = lb.Release(holderCtx)
				cerr = p.b.Close(ctx)
			case "after":
				cerr = p.b.Close(ctx)
				herr = lb.Release(holderCtx)
			default:
				done := make(chan error, 1)
				go func() { done <- p.b.Close(ctx) }()
				leasetest.Recv(t, in, "Close's release call")
				herr = lb.Release(holderCtx)
				close(goOn)
				cerr = leasetest.Recv(t, done, "Close")
			}
			a := leasetest.Recv(t, got, "A's Acquire")
			require.NoError(t, a.err)
			var all []c48cCall
			p.hook.mu.Lock()
			for _, c := range p.hook.calls {
				if c.kind == "release" || c.kind == "leave" {
					all = append(all, c)
				}
			}
			p.hook.mu.Unlock()
			gave, answered, sent := c48cGaveBack(all)
			t.Logf("%s: holder's Release %v; Close %v; B's release and leave calls %+v", variant, herr, cerr, all)
			if herr != nil {
				assert.ErrorIs(t, herr, lease.ErrLost, "%s: the holder's Release: nil or ErrLost", variant)
			}
			if variant == "duringFail" {
				require.Error(t, cerr, "premise: Close's release failed")
				require.Positive(t, answered, "premise: the owed leave was answered (sent %d)", sent)
			} else {
				assert.NoError(t, cerr, "%s: Close", variant)
			}
			assert.Equal(t, 1, gave, "%s: calls of B's that gave the lease back in Redis", variant)
			assert.True(t, p.look(t, key, a.l.Token()).Held, "%s: A's lease stands", variant)
			assert.Equal(t, 1, len(p.holders(key)), "%s: holders in Redis", variant)
			assert.False(t, p.look(t, key, lb.Token()).Held, "%s: B's lease stands", variant)
			require.NoError(t, a.l.Release(ctx))
			p.obs.check(t, variant)
		})
	}
}

// TestReviewClose48cHolderRaceFails: B holds the lease of each of 32
// keys; each holder calls Release with a context already cancelled (a
// request's context, ended: the call fails unsent, and Release returns
// the context's error), started together with B's Close(Background),
// Redis answering. Rounds of this, until a lease is found that Close
// took as held (its Lost closed by Close: a failed Release of the
// holder's does not close it) while the holder's failed Release went
// first (Close's own then returned nil at once, "released before", and
// no leave is owed). Close's doc: held leases "are released", and "a
// lease whose release failed is given back by a leave call of its own".
// Checks, once Close returned nil: no lease Close took as held stands
// in Redis. At 5a491d6 it fails in the first round, every run (also
// beside a CPU load): 12 to 31 of the 32 leases are in that case, and
// each stands in Redis for the rest of its 20 s TTL (A's waiters could
// not have it meanwhile), though Close returned nil and closed its Lost.
// closeReleased owes a leave call only for Close's own release that
// failed; Close's Release of a lease whose holder's Release went first
// returns nil ("released before") whether that release reached Redis or
// not. (The holder's own Release returned its error, as its doc allows:
// "If the call fails, the lease ... lapses after the TTL"; Close's doc
// does not.) handOut's Release of a lease granted as Close began is, by
// reading, the same case.
func TestReviewClose48cHolderRaceFails(t *testing.T) {
	const nk, rounds = 32, 30
	ctx := context.Background()
	var hits, before, closeFirst, ran int
	for round := 0; round < rounds && hits == 0; round++ {
		ran++
		p := c48cNewPair(t, 20*time.Second, 5*time.Second)
		var ls []*lease.Lease
		var keys []string
		for i := 0; i < nk; i++ {
			key := fmt.Sprint("c48cf", round, "-", i)
			l, err := p.b.Acquire(ctx, key)
			require.NoError(t, err)
			ls = append(ls, l)
			keys = append(keys, key)
		}
		dead, cancel := context.WithCancel(context.WithValue(ctx, c48cTag{}, "holder"))
		cancel()
		start := make(chan struct{})
		herrs := make([]error, nk)
		var wg sync.WaitGroup
		for i, l := range ls {
			wg.Go(func() {
				<-start
				herrs[i] = l.Release(dead)
			})
		}
		close(start)
		cerr := p.b.Close(ctx)
		wg.Wait()
		var stand []string
		for i, l := range ls {
			seen := p.look(t, keys[i], l.Token())
			held := seen.Held
			failed := herrs[i] != nil && !errors.Is(herrs[i], lease.ErrLost)
			switch {
			case failed && leasetest.IsLost(l):
				hits++
				for _, c := range p.hook.onKey(keys[i]) {
					require.False(t, c.kind == "release" && c.tag == "", "premise: no release call of Close's for %s: %v", keys[i], c)
				}
				if held {
					stand = append(stand, fmt.Sprintf("%s (Redis holds it %v more; holder's Release: %v)", keys[i], seen.Margin().Round(time.Millisecond), herrs[i]))
				}
			case failed:
				before++ // the holder's went before Close began: not Close's
			default:
				closeFirst++
			}
		}
		t.Logf("round %d: Close %v; leases Close took as held whose holder's failed Release went first: standing %v", round, cerr, stand)
		if cerr == nil {
			assert.Empty(t, stand, "round %d: leases Close took as held (Lost closed by it) standing in Redis once Close returned nil, Redis answering", round)
		}
	}
	t.Logf("%d rounds of %d leases: holder's failed Release first with Close holding the lease %d, before Close began %d, Close's first %d", ran, nk, hits, before, closeFirst)
	if hits == 0 {
		t.Skip("the race was never hit: nothing checked")
	}
}

// TestReviewClose48cStoppedForGood: two Semaphores, each on a
// redis-server of its own with A holding each key's lease: B (engine
// timeout 50 ms, TTL 20 s) holds the lease of each of 8 keys and has 3
// waiters queued on each of 3 more; the control C has the waiters only.
// Both servers are stopped for good; C's Close(Background), then B's.
// Checks: both return (within 30 s); B's within three times C's and a
// second; B's returns the releases' errors; every Acquire of theirs
// returns; no goroutine of package lease is left.
func TestReviewClose48cStoppedForGood(t *testing.T) {
	ctx := context.Background()
	held := c48bSetup(t, c48bCfg{own: true, held: 8, waited: 3, w: 3, timeout: 50 * time.Millisecond, tag: "sfh"})
	ctl := c48bSetup(t, c48bCfg{own: true, waited: 3, w: 3, timeout: 50 * time.Millisecond, tag: "sfc"})
	held.srv.Stop()
	ctl.srv.Stop()
	closeIn := func(s *lease.Semaphore) (time.Duration, error) {
		done := make(chan error, 1)
		start := time.Now()
		go func() { done <- s.Close(ctx) }()
		select {
		case err := <-done:
			return time.Since(start), err
		case <-time.After(30 * time.Second):
			t.Fatal("Close did not return within 30 s, Redis stopped")
			return 0, nil
		}
	}
	ctlTook, ctlErr := closeIn(ctl.b)
	heldTook, heldErr := closeIn(held.b)
	for range 9 {
		leasetest.Recv(t, ctl.got, "C's Acquire")
		leasetest.Recv(t, held.got, "B's Acquire")
	}
	lost := 0
	for _, l := range held.leases {
		if leasetest.IsLost(l) {
			lost++
		}
	}
	t.Logf("Redis stopped: control Close %v (%v); B's Close with 8 held leases %v (%v); Lost closed %d of 8; B's %v", ctlTook, ctlErr, heldTook, heldErr, lost, held.hook)
	assert.Error(t, heldErr, "B's Close: its releases failed")
	assert.LessOrEqual(t, heldTook, 3*ctlTook+time.Second, "B's Close took %v, the control's %v", heldTook, ctlTook)
	assert.Equal(t, 8, lost, "B's leases whose Lost is closed")
	_ = held.a.Close(ctx)
	_ = ctl.a.Close(ctx)
	leasetest.Settled(t, 5*time.Second)
}

// TestReviewClose48cManyKeysBreakerOpen: B (engine timeout 200 ms, TTL
// 20 s, observed) holds the lease of each of 32 keys on a redis-server of
// its own. Redis is paused until B's breaker opens, then resumed (B's
// breaker still open). Variants:
//   - direct: B's Close(Background) at once: its releases are refused by
//     the open breaker (premise: Close returns ErrUnavailable), and the
//     owed leave calls go past it.
//   - retry: while Redis is paused, a Close with a context of 30 ms gives
//     up (premise); Redis is resumed; 300 ms on a retry Close(Background)
//     returns nil.
//
// Checks once the Background Close returned (Redis answering): none of
// the 32 leases stands; for each, at most one call of B's gave it back in
// Redis, and at most one of its leave calls was answered; B's observer's
// held count is 0, never negative; no goroutine of package lease is left.
func TestReviewClose48cManyKeysBreakerOpen(t *testing.T) {
	const nk = 32
	for _, variant := range []string{"direct", "retry"} {
		t.Run(variant, func(t *testing.T) {
			ctx := context.Background()
			const ttl = 20 * time.Second
			srv := redistest.Start(t)
			rdb := srv.Client(t)
			prefix := redistest.Prefix(t)
			hook, obs := newC48cHook(t), &c48cObs{}
			c := srv.Client(t)
			c.AddHook(hook)
			eng, err := throttle.New(c, throttle.WithPrefix(prefix), throttle.WithTimeout(200*time.Millisecond))
			require.NoError(t, err)
			b, err := lease.New(eng, "partner", 1, lease.WithTTL(ttl), lease.WithObserver(obs))
			require.NoError(t, err)
			leasetest.CloseAtEnd(t, b)
			redistest.UntilOK(t, func() error { return b.Load(ctx) })
			var ls []*lease.Lease
			var keys []string
			for i := 0; i < nk; i++ {
				key := fmt.Sprint("c48cm-", i)
				var l *lease.Lease
				redistest.UntilOK(t, func() error { var err error; l, err = b.Acquire(ctx, key); return err })
				ls = append(ls, l)
				keys = append(keys, key)
			}
			sc := &c48bScene{srv: srv, eng: eng}
			aEng, err := throttle.New(rdb, throttle.WithPrefix(prefix), throttle.WithTimeout(time.Second))
			require.NoError(t, err)
			sc.aEng = aEng
			sc.pause(t)
			var firstErr, cerr error
			start := time.Now()
			switch variant {
			case "direct":
				sc.resume(t)
				start = time.Now()
				cerr = b.Close(ctx)
				require.ErrorIs(t, cerr, throttle.ErrUnavailable, "premise: Close's releases were refused")
			case "retry":
				c1, cancel := context.WithTimeout(ctx, 30*time.Millisecond)
				firstErr = b.Close(c1)
				cancel()
				require.ErrorIs(t, firstErr, context.DeadlineExceeded, "premise: the first Close gave up")
				sc.resume(t)
				time.Sleep(300 * time.Millisecond)
				start = time.Now()
				cerr = b.Close(ctx)
				assert.NoError(t, cerr, "the retry Close (Background)")
			}
			took := time.Since(start)
			var stand, twice, twiceLeave []string
			for i, l := range ls {
				var s leasetest.Seen
				redistest.UntilOK(t, func() error {
					var err error
					s, err = leasetest.LookOn(ctx, rdb, prefix, keys[i], l.Token())
					return err
				})
				if s.Held {
					stand = append(stand, keys[i])
				}
			}
			// The lease ids, from the acquire calls (one each: no key was
			// contended).
			ids := map[string]bool{}
			hook.mu.Lock()
			for _, c := range hook.calls {
				if c.kind == "acquire" {
					ids[c.id] = true
				}
			}
			hook.mu.Unlock()
			leaves, answered := 0, 0
			for id := range ids {
				calls := hook.of(id)
				gave, ans, sent := c48cGaveBack(calls)
				leaves += sent
				answered += ans
				if gave > 1 {
					twice = append(twice, fmt.Sprintf("%s %+v", id, calls))
				}
				if ans > 1 {
					twiceLeave = append(twiceLeave, fmt.Sprintf("%s %+v", id, calls))
				}
			}
			t.Logf("%s: first Close %v; Background Close took %v: %v; release ids seen %d; leave calls for them %d, answered %d; standing %v; observer %v",
				variant, firstErr, took, cerr, len(ids), leaves, answered, stand, obs)
			assert.Len(t, ids, nk, "%s: acquire calls seen for distinct leases", variant)
			assert.Empty(t, stand, "%s: leases standing once the Background Close returned, Redis answering", variant)
			assert.Empty(t, twice, "%s: leases given back by more than one call", variant)
			assert.Empty(t, twiceLeave, "%s: leases with more than one answered leave call", variant)
			obs.check(t, variant)
			leasetest.Settled(t, 5*time.Second)
		})
	}
}

// TestReviewClose48cGrantedAsClosing: B has one waiter queued on each of
// 32 keys whose lease A holds (N = 1, TTL 20 s); B's client fails every
// release call of B's unsent (a refused dial, which opens B's breaker:
// the next are refused by it). A releases all 32 leases at once, and 0
// to 7.5 ms on B's Close(Background) begins, so that some of B's waiters
// are granted as Close begins: their lease is given back by Close's
// release (in Close's held set), by the waiter's leave call (abandon: it
// gave up as it was granted), or by handOut's Release (the grant reached
// its Acquire first, Close had begun: the caller gets ErrClosed); each
// of those releases fails. Close's doc: waiting callers "get ErrClosed
// (and leave the queue)"; "a lease whose release failed is given back
// by a leave call of its own". Checks, once Close returned, Redis
// answering: no lease granted to B stands in Redis (else A's next
// Acquire waits the TTL for a place nobody holds). 40 rounds.
//
// At 5a491d6 it fails every run of 40 rounds (6 of 6, 3 beside a CPU
// load; 1 to 5 rounds of 40, 1 to 5 keys each): the lease of a waiter
// whose Acquire returned ErrClosed stands for the rest of its 20 s TTL,
// B's client having sent for it no leave call and at most one release
// call, which failed (handOut's; refused by the open breaker, it does
// not reach the hook), Close's error not naming its key, in some rounds
// Close returning nil: nothing owes the leave call of a lease whose
// handOut Release failed (and Close's own Release of it, if Close took
// it as held, returned nil: "released before").
func TestReviewClose48cGrantedAsClosing(t *testing.T) {
	const nk, rounds = 32, 40
	ctx := context.Background()
	for round := 0; round < rounds; round++ {
		p := c48cNewPair(t, 20*time.Second, time.Second)
		delay := time.Duration(round%16) * 500 * time.Microsecond
		var las []*lease.Lease
		var keys []string
		for i := 0; i < nk; i++ {
			key := fmt.Sprint("c48cg", round, "-", i)
			l, err := p.a.Acquire(ctx, key)
			require.NoError(t, err)
			las = append(las, l)
			keys = append(keys, key)
		}
		type res struct {
			key string
			l   *lease.Lease
			err error
		}
		got := make(chan res, nk)
		for _, key := range keys {
			go func() { l, err := p.b.Acquire(ctx, key); got <- res{key, l, err} }()
		}
		for _, key := range keys {
			leasetest.WaitFor(t, func() bool { return p.queued(key) == 1 })
		}
		p.hook.setPre(func(_ context.Context, kind, _ string) error {
			if kind == "release" {
				return leasetest.ErrNotSent
			}
			return nil
		})
		var wg sync.WaitGroup
		for _, l := range las {
			wg.Go(func() { _ = l.Release(ctx) })
		}
		time.Sleep(delay)
		cerr := p.b.Close(ctx)
		wg.Wait()
		granted := 0
		outcome := map[string]error{}
		for range nk {
			g := leasetest.Recv(t, got, "B's Acquire")
			outcome[g.key] = g.err
			if g.err == nil {
				granted++
			}
		}
		var stand []string
		rels, leaves := 0, 0
		for _, key := range keys {
			hs := p.holders(key)
			calls := p.hook.onKey(key)
			for _, c := range calls {
				switch c.kind {
				case "release":
					rels++
				case "leave":
					leaves++
				}
			}
			if len(hs) > 0 {
				margin := time.Duration(p.rdb.ZScore(ctx, p.prefix+"partner:{"+key+"}:lease:h", hs[0]).Val())*time.Microsecond -
					time.Duration(leasetest.RedisNow(p.rdb))*time.Microsecond
				stand = append(stand, fmt.Sprintf("%s: %v (Redis holds it %v more; its Acquire: %v; named in Close's error: %v), B's calls %v",
					key, hs, margin.Round(time.Millisecond), outcome[key], cerr != nil && strings.Contains(cerr.Error(), `"`+key+`"`), calls))
			}
		}
		t.Logf("round %d (Close %v after A's releases): Close %v; B's Acquires that returned a lease %d; B's release calls (failed) %d, leave calls %d; standing %v",
			round, delay, cerr, granted, rels, leaves, stand)
		assert.Empty(t, stand, "round %d: leases granted to B standing in Redis once B's Close returned, Redis answering", round)
		p.obs.check(t, fmt.Sprint("round ", round))
	}
}
