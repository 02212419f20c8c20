package leasereview_test

// Second review of 671b9b6 and dd7f3df (helper-143): a retry Close after
// every Close under way gave up, on a Redis Cluster with one master
// stopped, with held leases, with Acquires churning, with a retry that
// gives up too while the keepers before it are still ending, and with
// many Closes while Redis flaps. Through package lease's public API,
// go-redis hooks on B's client, a latency proxy, SIGSTOP/SIGCONT of the
// test's own redis-server, and a 3-master test Cluster. (helper-142's
// review, review_close48_test.go, covers the rest.)

import (
	"context"
	"crypto/sha1"
	"encoding/hex"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
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

// c48bKinds maps the SHA1 of each lease script to its name ("leave",
// "release", "keep", "acquire"), read from lease/scripts as the package
// embeds them (common.lua before each): the hooks tell a leave call from
// a release by its script, not by its arguments.
func c48bKinds(t *testing.T) map[string]string {
	t.Helper()
	common, err := os.ReadFile("../../scripts/common.lua")
	require.NoError(t, err)
	kinds := map[string]string{}
	for _, k := range []string{"leave", "release", "keep", "acquire"} {
		src, err := os.ReadFile("../../scripts/" + k + ".lua")
		require.NoError(t, err)
		sum := sha1.Sum(append(append([]byte{}, common...), src...))
		kinds[hex.EncodeToString(sum[:])] = k
	}
	return kinds
}

// c48bHook, on B's client, names each lease script call (c48bKinds), lets
// pre (if set) fail it before it is sent, or hold it, and counts, per
// waiter id, the leave calls passed on to Redis and those answered
// without error, and the calls of each kind.
type c48bHook struct {
	kinds map[string]string
	// pre sees each script call first; a non-nil error fails it unsent.
	pre    atomic.Pointer[func(kind string, keys []string, argv []any) error]
	mu     sync.Mutex
	sent   map[string]int // leave calls passed on, by waiter id
	ok     map[string]int // leave calls answered without error, by waiter id
	byKind map[string]int // calls passed on, by kind
	errs   map[string]int // calls passed on that failed, by kind
	// inflight counts the keeper's leave calls (with a spare token: five
	// arguments) passed on and not yet answered.
	inflight atomic.Int32
}

func newC48bHook(t *testing.T) *c48bHook {
	return &c48bHook{kinds: c48bKinds(t), sent: map[string]int{}, ok: map[string]int{}, byKind: map[string]int{}, errs: map[string]int{}}
}

func (h *c48bHook) kind(cmd redis.Cmder) string {
	a := cmd.Args()
	if len(a) < 2 {
		return ""
	}
	switch cmd.Name() {
	case "evalsha":
		return h.kinds[fmt.Sprint(a[1])]
	case "eval":
		sum := sha1.Sum([]byte(fmt.Sprint(a[1])))
		return h.kinds[hex.EncodeToString(sum[:])]
	}
	return ""
}

func (h *c48bHook) setPre(f func(kind string, keys []string, argv []any) error) {
	if f == nil {
		h.pre.Store(nil)
		return
	}
	h.pre.Store(&f)
}

func (h *c48bHook) DialHook(next redis.DialHook) redis.DialHook { return next }
func (h *c48bHook) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}
func (h *c48bHook) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		kind := h.kind(cmd)
		if kind == "" {
			return next(ctx, cmd)
		}
		argv, keys := leasetest.ScriptArgs(cmd)
		if p := h.pre.Load(); p != nil {
			if err := (*p)(kind, keys, argv); err != nil {
				cmd.SetErr(err)
				return err
			}
		}
		id := ""
		if kind == "leave" && len(argv) >= 4 {
			id = fmt.Sprint(argv[3])
		}
		h.mu.Lock()
		h.byKind[kind]++
		if id != "" {
			h.sent[id]++
		}
		h.mu.Unlock()
		keeper := kind == "leave" && len(argv) == 5
		if keeper {
			h.inflight.Add(1)
		}
		err := next(ctx, cmd)
		if keeper {
			h.inflight.Add(-1)
		}
		h.mu.Lock()
		if err != nil {
			h.errs[kind]++
		} else if id != "" {
			h.ok[id]++
		}
		h.mu.Unlock()
		return err
	}
}

// counts returns copies of the per-id leave counts (sent, answered).
func (h *c48bHook) counts() (sent, ok map[string]int) {
	h.mu.Lock()
	defer h.mu.Unlock()
	sent, ok = map[string]int{}, map[string]int{}
	for k, v := range h.sent {
		sent[k] = v
	}
	for k, v := range h.ok {
		ok[k] = v
	}
	return sent, ok
}

func (h *c48bHook) String() string {
	h.mu.Lock()
	defer h.mu.Unlock()
	return fmt.Sprintf("calls %v, failed %v", h.byKind, h.errs)
}

// c48bStanding returns the ids standing in Redis, on rdb (a Client or a
// ClusterClient), in the queue or waiters set (waiters) and the holders
// set (holders) of each of keys, for a Semaphore named partner on prefix.
func c48bStanding(rdb redis.Cmdable, prefix string, keys []string) (waiters, holders []string) {
	ctx := context.Background()
	for _, k := range keys {
		base := prefix + "partner:{" + k + "}:lease:"
		seen := map[string]bool{}
		for _, part := range []string{"q", "w"} {
			for _, id := range rdb.ZRange(ctx, base+part, 0, -1).Val() {
				if !seen[id] {
					seen[id] = true
					waiters = append(waiters, k+"/"+id)
				}
			}
		}
		for _, id := range rdb.ZRange(ctx, base+"h", 0, -1).Val() {
			holders = append(holders, k+"/"+id)
		}
	}
	return waiters, holders
}

// c48bCfg shapes a single-node scene: B (N = 1, TTL ttl, poll interval
// poll, an engine of the given timeout over a client hooked by a
// c48bHook, through a proxy adding latency each way if it is not zero)
// holds the one lease of each of held keys and has w waiters queued on
// each of waited keys, whose lease A (an engine of its own, direct, 1 s
// timeout) holds. own: a redis-server of the test's own (to pause it).
type c48bCfg struct {
	own                         bool
	held, waited, w             int
	timeout, latency, ttl, poll time.Duration
	tag                         string
}

type c48bScene struct {
	srv       *redistest.Server
	rdb       *redis.Client // direct, for the checks
	prefix    string
	aEng, eng *throttle.Engine
	a, b      *lease.Semaphore
	hook      *c48bHook
	proxy     *redistest.Proxy
	heldKeys  []string
	waitKeys  []string
	leases    []*lease.Lease // B's
	got       chan error     // B's Acquires of the waited keys
}

func c48bSetup(t *testing.T, cfg c48bCfg) *c48bScene {
	t.Helper()
	ctx := context.Background()
	if cfg.ttl == 0 {
		cfg.ttl = 20 * time.Second
	}
	if cfg.poll == 0 {
		cfg.poll = 100 * time.Millisecond
	}
	sc := &c48bScene{hook: newC48bHook(t)}
	sc.srv = leasetest.Server(t, cfg.own)
	sc.rdb = sc.srv.Client(t)
	sc.prefix = redistest.Prefix(t)
	var err error
	sc.aEng, err = throttle.New(sc.rdb, throttle.WithPrefix(sc.prefix), throttle.WithTimeout(time.Second))
	require.NoError(t, err)
	sc.a, err = lease.New(sc.aEng, "partner", 1, lease.WithTTL(cfg.ttl))
	require.NoError(t, err)
	leasetest.CloseAtEnd(t, sc.a)
	// Loaded first: a lost reply's call into a paused server runs once it
	// is resumed, as NOSCRIPT unless the scripts are there (a known limit).
	redistest.UntilOK(t, func() error { return sc.a.Load(ctx) })
	sc.eng, sc.proxy = leasetest.Hooked(t, sc.srv, sc.prefix, cfg.timeout, cfg.latency, sc.hook)
	sc.b, err = lease.New(sc.eng, "partner", 1, lease.WithTTL(cfg.ttl), lease.WithPollInterval(cfg.poll))
	require.NoError(t, err)
	leasetest.CloseAtEnd(t, sc.b)
	for i := 0; i < cfg.held; i++ {
		key := fmt.Sprint("c48b", cfg.tag, "-h", i)
		sc.heldKeys = append(sc.heldKeys, key)
		var l *lease.Lease
		redistest.UntilOK(t, func() error {
			var err error
			l, err = sc.b.Acquire(ctx, key)
			return err
		})
		sc.leases = append(sc.leases, l)
	}
	sc.got = make(chan error, cfg.waited*cfg.w+1)
	var settingUp atomic.Bool
	settingUp.Store(true)
	for i := 0; i < cfg.waited; i++ {
		key := fmt.Sprint("c48b", cfg.tag, "-w", i)
		sc.waitKeys = append(sc.waitKeys, key)
		redistest.UntilOK(t, func() error { _, err := sc.a.Acquire(ctx, key); return err })
		for range cfg.w {
			go func() {
				for {
					_, err := sc.b.Acquire(ctx, key)
					if err != nil && !errors.Is(err, lease.ErrClosed) && settingUp.Load() {
						continue // its first call missed B's timeout on a busy machine
					}
					sc.got <- err
					return
				}
			}()
		}
	}
	leasetest.WaitFor(t, func() bool {
		ws, _ := c48bStanding(sc.rdb, sc.prefix, sc.waitKeys)
		return len(ws) >= cfg.waited*cfg.w
	})
	settingUp.Store(false)
	return sc
}

func (sc *c48bScene) waiters() []string {
	ws, _ := c48bStanding(sc.rdb, sc.prefix, sc.waitKeys)
	return ws
}

// heldStanding returns, for each of B's leases, whether Redis still holds
// it and its expiry (µs, Redis clock), and Redis's TIME.
func (sc *c48bScene) heldStanding(t *testing.T) (held []bool, expiry []int64, now int64) {
	t.Helper()
	ctx := context.Background()
	for i, l := range sc.leases {
		var s leasetest.Seen
		redistest.UntilOK(t, func() error {
			var err error
			s, err = leasetest.LookOn(ctx, sc.rdb, sc.prefix, sc.heldKeys[i], l.Token())
			return err
		})
		held = append(held, s.Held)
		expiry = append(expiry, s.Expiry)
		now = s.Now
	}
	return held, expiry, now
}

func c48bCount(bs []bool) int {
	n := 0
	for _, b := range bs {
		if b {
			n++
		}
	}
	return n
}

func (sc *c48bScene) pause(t *testing.T) { t.Helper(); leasetest.Pause(t, sc.srv, sc.eng) }

func (sc *c48bScene) resume(t *testing.T) { t.Helper(); leasetest.Resume(t, sc.srv, sc.aEng) }

// TestReviewClose48bHeldLeases: B (engine timeout 50 ms, 1 s in the
// control, TTL 20 s) holds
// the one lease of each of K = 4 keys and has W = 3 waiters queued on each
// of 3 more (A holding their leases). Variants:
//   - control: B's Close with context.Background(), Redis answering.
//   - paused: Redis paused (SIGSTOP, B's breaker open); a Close with a
//     context of 30 ms gives up (its releases fail, refused by the
//     breaker); 300 ms on Redis is resumed and, once it answers, a retry
//     Close with context.Background() is made.
//   - slow: B's client through a proxy adding 40 ms each way (engine
//     timeout 500 ms), Redis answering; a Close with a context of 20 ms
//     gives up, its releases out when its context ends; 500 ms on, the
//     retry Close with context.Background().
//
// Close's doc: "held leases are released (their Lost is closed ...) and
// no longer extended"; a retry "sends [the calls still owed] as the
// first would have". Checks, once the retry (or the control's Close)
// returned nil, Redis answering: none of B's leases stands in Redis
// (else A waits up to the TTL for a place nobody holds); no lease of
// B's was extended after the first Close began (its expiry is no later
// than before it); B's gone waiters do not stand; each lease's Lost is
// closed; goroutines of package lease settle. Premise (paused, slow):
// the first Close returned its context's error. At dd7f3df paused and
// slow fail, every run (also beside a CPU load): the first Close's
// releases fail (refused by the open breaker; cut off by its context),
// and its error says so, but a release that failed is owed to nobody (a
// gone waiter's leave call is kept for the retry; Release only marks the
// lease released), so the retry returns nil with all 4 leases standing
// in Redis, unextended, for the rest of their 20 s TTL; A cannot have
// those places meanwhile.
func TestReviewClose48bHeldLeases(t *testing.T) {
	const nh, nw, w = 4, 3, 3
	for _, variant := range []string{"control", "paused", "slow"} {
		t.Run(variant, func(t *testing.T) {
			ctx := context.Background()
			cfg := c48bCfg{held: nh, waited: nw, w: w, timeout: 50 * time.Millisecond, tag: variant}
			switch variant {
			case "control":
				cfg.timeout = time.Second // a busy machine's lost reply is not what the control is about
			case "paused":
				cfg.own = true
			case "slow":
				cfg.timeout, cfg.latency = 500*time.Millisecond, 40*time.Millisecond
			}
			sc := c48bSetup(t, cfg)
			_, before, _ := sc.heldStanding(t)
			var firstErr error
			switch variant {
			case "paused":
				sc.pause(t)
				c, cancel := context.WithTimeout(ctx, 30*time.Millisecond)
				firstErr = sc.b.Close(c)
				cancel()
				require.ErrorIs(t, firstErr, context.DeadlineExceeded, "premise: the first Close gave up")
				time.Sleep(300 * time.Millisecond)
				sc.resume(t)
				time.Sleep(300 * time.Millisecond) // calls in the paused server's sockets have run
			case "slow":
				c, cancel := context.WithTimeout(ctx, 20*time.Millisecond)
				firstErr = sc.b.Close(c)
				cancel()
				require.ErrorIs(t, firstErr, context.DeadlineExceeded, "premise: the first Close gave up")
				time.Sleep(500 * time.Millisecond)
			}
			heldPre, _, _ := sc.heldStanding(t)
			start := time.Now()
			err := sc.b.Close(ctx)
			took := time.Since(start)
			for range nw * w {
				require.Error(t, leasetest.Recv(t, sc.got, "B's Acquire"))
			}
			held, after, now := sc.heldStanding(t)
			ws := sc.waiters()
			time.Sleep(time.Second)
			held2, after2, _ := sc.heldStanding(t)
			lost := 0
			for _, l := range sc.leases {
				if leasetest.IsLost(l) {
					lost++
				}
			}
			t.Logf("%s: first Close %v; before the Background Close %d of B's %d leases stood; it took %v, error %v; then %d stood (Redis holding them %v, %v ... more), 1 s later %d; waiters standing %d; Lost closed %d; B's %v",
				variant, firstErr, c48bCount(heldPre), nh, took, err, c48bCount(held), leasetest.Ms(after[0]-now), leasetest.Ms(after[len(after)-1]-now), c48bCount(held2), len(ws), lost, sc.hook)
			assert.NoError(t, err, "%s: the Background Close", variant)
			assert.Zero(t, c48bCount(held), "%s: B's leases standing in Redis once a Close with context.Background() returned nil (Redis answering): Close's doc, held leases are released", variant)
			for i := range sc.leases {
				if held2[i] {
					assert.LessOrEqual(t, after2[i], before[i], "%s: lease %d extended after Close began (expiry %d µs later)", variant, i, after2[i]-before[i])
				}
			}
			assert.Empty(t, ws, "%s: B's gone waiters standing", variant)
			assert.Equal(t, nh, lost, "%s: leases whose Lost is closed", variant)
			require.NoError(t, sc.a.Close(ctx))
			leasetest.Settled(t, 5*time.Second)
		})
	}
}

// c48bClusterA starts a 3-master test Cluster (full coverage not
// required; extra: more redis-server arguments) and, on a client of its
// own (ca, also for the checks), Semaphore A (N = 1, TTL 20 s, an engine
// with a 1 s timeout, scripts loaded). Its first cleanup waits 1.5 s, and
// runs last: go-redis's background dial (tryDial, once the dial lockout
// trips) sees its closed pool only after its 1 s sleep.
func c48bClusterA(t *testing.T, extra ...string) (cluster *redistest.Cluster, prefix string, ca *redis.ClusterClient, a *lease.Semaphore) {
	t.Helper()
	t.Cleanup(func() { time.Sleep(1500 * time.Millisecond) })
	cluster = redistest.StartCluster(t, 3, append([]string{"--cluster-require-full-coverage", "no"}, extra...)...)
	prefix = redistest.Prefix(t)
	ca = cluster.Client(t)
	aEng, err := throttle.New(ca, throttle.WithPrefix(prefix), throttle.WithTimeout(time.Second))
	require.NoError(t, err)
	a, err = lease.New(aEng, "partner", 1, lease.WithTTL(20*time.Second))
	require.NoError(t, err)
	leasetest.CloseAtEnd(t, a)
	redistest.UntilOK(t, func() error { return a.Load(context.Background()) })
	return cluster, prefix, ca, a
}

// TestReviewClose48bClusterOneStopped: a 3-master Cluster (full coverage
// not required: the others serve while one is stopped). A (an engine of
// its own) holds the one lease of each of 4 keys on each master; B (N =
// 1, TTL 21 s, engine timeout 100 ms, poll 7 s) has W = 4 waiters
// queued on each of those 12 keys. Master 0 is stopped for good (refused
// dials) and B's breaker for it seen open (B's cluster client has a pool
// of 40 a node). B's client holds its waiters'
// own leave calls for master 1's keys until a gate opens, then fails them
// unsent (a refused dial: master 1's breaker opens too), and for 100 ms
// after, the engine's own second tries of them too, so that they are
// owed to the keepers; master 2's go through. Variants:
//   - plain: no hold; a Close with context.Background() (the control for
//     time: it judges master 0 away and drops its calls).
//   - held: a Close with context.Background(); the held calls fail 300 ms
//     in, then B's calls pass.
//   - retry: a Close with a context of 30 ms gives up (master 1's calls
//     held keep its rooms); 300 ms on the held calls fail, then B's calls
//     pass; a retry Close with context.Background() is made, master 0
//     still stopped.
//
// Close's doc: calls are dropped "only when Redis is away (two rounds in
// a row reach none of it, a call let by the breaker failing, the breaker
// open after)"; a retry "sends them as the first would have, judging
// afresh whether Redis is away". Masters 1 and 2 answer throughout (but
// for B's hook): checks, once the Background Close returned nil, none of
// B's gone waiters stands on masters 1 and 2; the retry's time is at most
// three times the plain control's and a second. What stands on master 0
// cannot be read (it is stopped); Semaphore.away is one count over every
// room while the breakers are per node, so master 0's failed rounds may
// make master 1's owed calls be dropped though master 1 answers: that is
// what this looks for.
func TestReviewClose48bClusterOneStopped(t *testing.T) {
	const perNode, w = 4, 4
	times := map[string]time.Duration{}
	for _, variant := range []string{"plain", "held", "retry"} {
		t.Run(variant, func(t *testing.T) {
			ctx := context.Background()
			cluster, prefix, ca, a := c48bClusterA(t)
			// A pool of 40 a node: the 16 leave calls held for master 1 wait
			// beside the keepers' blocking reads (up to half the pool).
			cb := redis.NewClusterClient(&redis.ClusterOptions{Addrs: slices.Clone(cluster.Addrs), ContextTimeoutEnabled: true, PoolSize: 40})
			t.Cleanup(func() { _ = cb.Close() })
			hook := newC48bHook(t)
			cb.AddHook(hook)
			eng, err := throttle.New(cb, throttle.WithPrefix(prefix), throttle.WithTimeout(100*time.Millisecond))
			require.NoError(t, err)
			// A poll of 7 s: no keep call is out as the waiters leave (one
			// out would put them back in the queue, and have their leave
			// calls sent a second time, as designed).
			b, err := lease.New(eng, "partner", 1, lease.WithTTL(21*time.Second), lease.WithPollInterval(7*time.Second))
			require.NoError(t, err)
			leasetest.CloseAtEnd(t, b)
			redistest.UntilOK(t, func() error { return b.Load(ctx) })

			// 4 keys on each master.
			byNode := make([][]string, 3)
			nodeOf := map[string]int{}
			for i := 0; len(byNode[0]) < perNode || len(byNode[1]) < perNode || len(byNode[2]) < perNode; i++ {
				key := fmt.Sprint("c48bc", i)
				m, err := ca.MasterForKey(ctx, prefix+"partner:{"+key+"}:lease:h")
				require.NoError(t, err)
				for n, addr := range cluster.Addrs {
					if m.Options().Addr == addr && len(byNode[n]) < perNode {
						byNode[n] = append(byNode[n], key)
						nodeOf["{"+key+"}"] = n
					}
				}
			}
			var all []string
			for _, ks := range byNode {
				all = append(all, ks...)
			}
			got := make(chan error, len(all)*w)
			var settingUp atomic.Bool
			settingUp.Store(true)
			for _, key := range all {
				redistest.UntilOK(t, func() error { _, err := a.Acquire(ctx, key); return err })
				for range w {
					go func() {
						for {
							_, err := b.Acquire(ctx, key)
							if err != nil && !errors.Is(err, lease.ErrClosed) && settingUp.Load() {
								continue // its first call missed B's timeout on a busy machine
							}
							got <- err
							return
						}
					}()
				}
			}
			leasetest.WaitFor(t, func() bool { ws, _ := c48bStanding(ca, prefix, all); return len(ws) == len(all)*w })
			settingUp.Store(false)

			gate := make(chan struct{})
			var held, failed atomic.Int32
			var failHeld atomic.Bool
			node1 := func(keys []string) bool {
				for tag, n := range nodeOf {
					if n == 1 && len(keys) > 0 && strings.Contains(keys[0], tag) {
						return true
					}
				}
				return false
			}
			if variant != "plain" {
				hook.setPre(func(kind string, keys []string, argv []any) error {
					if kind != "leave" || len(argv) != 4 || !node1(keys) {
						return nil
					}
					// A waiter's own leave call (abandon's: no spare token).
					if !failHeld.Load() {
						held.Add(1)
						<-gate
					}
					failed.Add(1)
					return leasetest.ErrNotSent
				})
			}
			cluster.Node(0).Stop()
			lim := throttle.PerSecond(1000, 1000)
			leasetest.WaitFor(t, func() bool {
				_, _ = eng.Allow(ctx, "{"+byNode[0][0]+"}u", lim)
				open, _ := eng.UnavailableFor(ctx, "partner:{"+byNode[0][0]+"}:lease:h")
				return open
			})
			letGo := func() {
				leasetest.WaitFor(t, func() bool { return held.Load() == perNode*w })
				failHeld.Store(true)
				close(gate)
				leasetest.WaitFor(t, func() bool { return failed.Load() >= perNode*w })
				// The engine sends again at once a call refused unsent
				// while the breaker was closed: those fail too.
				time.Sleep(100 * time.Millisecond)
				hook.setPre(nil)
			}
			var took time.Duration
			var cerr, firstErr error
			owed1 := -1
			switch variant {
			case "plain":
				start := time.Now()
				cerr = b.Close(ctx)
				took = time.Since(start)
			case "held":
				done := make(chan error, 1)
				start := time.Now()
				go func() { done <- b.Close(ctx) }()
				time.Sleep(300 * time.Millisecond)
				letGo()
				cerr = leasetest.Recv(t, done, "the Background Close")
				took = time.Since(start)
			case "retry":
				c, cancel := context.WithTimeout(ctx, 30*time.Millisecond)
				firstErr = b.Close(c)
				cancel()
				require.ErrorIs(t, firstErr, context.DeadlineExceeded, "premise: the first Close gave up")
				time.Sleep(300 * time.Millisecond)
				letGo()
				time.Sleep(100 * time.Millisecond)
				ws1, _ := c48bStanding(ca, prefix, byNode[1])
				owed1 = len(ws1)
				require.Positive(t, owed1, "premise: master 1's gone waiters stand before the retry (calls owed)")
				start := time.Now()
				cerr = b.Close(ctx)
				took = time.Since(start)
			}
			times[variant] = took
			for range len(all) * w {
				require.Error(t, leasetest.Recv(t, got, "B's Acquire"))
			}
			ws1, _ := c48bStanding(ca, prefix, byNode[1])
			ws2, _ := c48bStanding(ca, prefix, byNode[2])
			sent, ok := hook.counts()
			sent1, ok1 := 0, 0
			for _, n := range sent {
				sent1 += n
			}
			for _, n := range ok {
				ok1 += n
			}
			t.Logf("%s: first Close %v; master 1's waiters standing before the retry %d; the Background Close took %v, error %v; B's gone waiters standing on master 1: %d of %d, on master 2: %d of %d; leave calls passed on %d, answered %d; %v",
				variant, firstErr, owed1, took, cerr, len(ws1), perNode*w, len(ws2), perNode*w, sent1, ok1, hook)
			assert.NoError(t, cerr, "%s: the Background Close", variant)
			assert.Empty(t, ws1, "%s: B's gone waiters standing on master 1 (answering) once a Background Close returned nil, master 0 stopped", variant)
			assert.Empty(t, ws2, "%s: B's gone waiters standing on master 2 (answering)", variant)
			if variant == "retry" {
				control := times["plain"]
				t.Logf("retry %v against the plain control's %v", took, control)
				if control > 0 {
					assert.LessOrEqual(t, took, 3*control+time.Second, "the retry Close took %v, the plain control %v", took, control)
				}
			}
		})
	}
}

// TestReviewClose48bChurn: B (N = 1, TTL 20 s, poll 50 ms, an engine of
// timeout 200 ms through a proxy adding 5 ms each way; Redis answering
// throughout) on K = 3 keys, 5 workers per key, each in a loop: Acquire
// with a context of 10 to 60 ms (many are cancelled, their own leave
// calls out), hold 0 to 5 ms, Release. After 200 ms of churn, a first
// Close with a context of 1 to 10 ms (premise: it gave up, in some
// rounds; those it did not are counted); then, 0 to 30 ms after it
// returned, a retry Close with context.Background(). 10 rounds. Checks,
// once the retry returned nil: no worker's Acquire or Release hangs; no
// holder, queued waiter or waiter of B's stands in Redis (B is their only
// user; Close's doc: held leases are released, gone waiters' leave calls
// sent); at the end no goroutine of package lease is left. The first
// Close's error is logged (it names releases that failed).
func TestReviewClose48bChurn(t *testing.T) {
	const nk, workers, rounds = 3, 5, 10
	ctx := context.Background()
	gaveUp := 0
	for round := 0; round < rounds; round++ {
		sc := c48bSetup(t, c48bCfg{timeout: 200 * time.Millisecond, latency: 5 * time.Millisecond, poll: 50 * time.Millisecond, tag: fmt.Sprint("ch", round)})
		var keys []string
		for i := 0; i < nk; i++ {
			keys = append(keys, fmt.Sprint("c48bch", round, "-", i))
		}
		var wg sync.WaitGroup
		var grants, cancels atomic.Int32
		stop := make(chan struct{})
		for _, key := range keys {
			for range workers {
				wg.Go(func() {
					for {
						select {
						case <-stop:
							return
						default:
						}
						c, cancel := context.WithTimeout(ctx, time.Duration(10+rand.IntN(51))*time.Millisecond)
						l, err := sc.b.Acquire(c, key)
						cancel()
						if errors.Is(err, lease.ErrClosed) {
							return
						}
						if err != nil {
							cancels.Add(1)
							continue
						}
						grants.Add(1)
						time.Sleep(time.Duration(rand.IntN(6)) * time.Millisecond)
						_ = l.Release(ctx)
					}
				})
			}
		}
		time.Sleep(200 * time.Millisecond)
		d := time.Duration(1+rand.IntN(10)) * time.Millisecond
		c, cancel := context.WithTimeout(ctx, d)
		firstErr := sc.b.Close(c)
		cancel()
		if errors.Is(firstErr, context.DeadlineExceeded) {
			gaveUp++
		}
		time.Sleep(time.Duration(rand.IntN(31)) * time.Millisecond)
		start := time.Now()
		err := sc.b.Close(ctx)
		took := time.Since(start)
		close(stop)
		done := make(chan struct{})
		go func() { wg.Wait(); close(done) }()
		leasetest.Recv(t, done, "the workers")
		ws, hs := c48bStanding(sc.rdb, sc.prefix, keys)
		t.Logf("round %d: %d grants, %d Acquires ended by their context; first Close (%v) %v; retry took %v, error %v; standing: waiters %v, holders %v; B's %v",
			round, grants.Load(), cancels.Load(), d, firstErr, took, err, ws, hs, sc.hook)
		assert.NoError(t, err, "round %d: the retry Close (Background)", round)
		assert.Empty(t, ws, "round %d: B's gone waiters standing once the Background Close returned nil (Redis answering); first Close %v", round, firstErr)
		// Before stop 48's mend a lease whose release the first Close
		// reported failed stood here (TestReviewClose48bHeldLeases): 1 to 4
		// rounds in 10. Its leave call is now owed, and the retry sends it.
		assert.Empty(t, hs, "round %d: B's leases standing once the Background Close returned nil (Redis answering); first Close %v", round, firstErr)
		require.NoError(t, sc.a.Close(ctx))
	}
	t.Logf("%d rounds: the first Close gave up in %d", rounds, gaveUp)
	require.Positive(t, gaveUp, "premise: some first Closes gave up")
	leasetest.Settled(t, 5*time.Second)
}

// TestReviewClose48bThirdClose: B (engine timeout 500 ms, through a proxy
// adding 40 ms each way; TTL 21 s, poll 7 s, so that no keep call is out
// while the test runs) has W = 4 waiters queued on each of K = 4 keys (A
// holding each key's lease). B's client fails each waiter's own leave
// call (abandon's) unsent (a refused dial: the breaker opens), so that
// every one is owed to the keepers, which send them past the breaker,
// one at a time, 80 ms a round trip. A first Close, its context
// cancelled once a keeper's leave call is out, gives up while the
// keepers send; then (even rounds) at once, or (odd rounds) 24 to 120
// ms after it returned, a retry Close with a
// context of 1 to 60 ms gives up too; then a third Close with
// context.Background(). 6 rounds. Checks: no panic (a WaitGroup added to
// while waited on, or gone negative); the third Close returns nil; no
// gone waiter stands once it has; each of the 16 waiters had its leave
// call answered exactly once (the keepers of two generations must not
// both send one; every reply arrives); no goroutine of package lease is
// left. Premise: both first Closes returned their context's error; no
// keep call was sent (none of the legitimate second leaves it causes);
// in some rounds keeper leave calls were out as the retry began.
func TestReviewClose48bThirdClose(t *testing.T) {
	const nk, w, rounds = 4, 4, 6
	ctx := context.Background()
	midCall := 0
	for round := 0; round < rounds; round++ {
		sc := c48bSetup(t, c48bCfg{waited: nk, w: w, timeout: 500 * time.Millisecond, latency: 40 * time.Millisecond,
			ttl: 21 * time.Second, poll: 7 * time.Second, tag: fmt.Sprint("3c", round)})
		sc.hook.setPre(func(kind string, _ []string, argv []any) error {
			if kind == "leave" && len(argv) == 4 {
				return leasetest.ErrNotSent
			}
			return nil
		})
		// The first Close's context ends once a keeper's leave call is out.
		c1, cancel1 := context.WithCancel(ctx)
		go func() {
			t0 := time.Now()
			for sc.hook.inflight.Load() == 0 && time.Since(t0) < 2*time.Second {
				time.Sleep(time.Millisecond)
			}
			cancel1()
		}()
		err1 := sc.b.Close(c1)
		cancel1()
		require.ErrorIs(t, err1, context.Canceled, "round %d: premise: the first Close gave up", round)
		var delay time.Duration
		if round%2 == 1 {
			delay = time.Duration(round*24) * time.Millisecond
			time.Sleep(delay)
		}
		d2 := time.Duration(1+rand.IntN(60)) * time.Millisecond
		out := sc.hook.inflight.Load()
		if out > 0 {
			midCall++
		}
		c2, cancel2 := context.WithTimeout(ctx, d2)
		err2 := sc.b.Close(c2)
		cancel2()
		require.ErrorIs(t, err2, context.DeadlineExceeded, "round %d: premise: the retry Close (%v) gave up", round, d2)
		start := time.Now()
		err3 := sc.b.Close(ctx)
		took := time.Since(start)
		for range nk * w {
			require.Error(t, leasetest.Recv(t, sc.got, "B's Acquire"))
		}
		ws := sc.waiters()
		sent, ok := sc.hook.counts()
		var twice, never []string
		for id, n := range ok {
			if n > 1 {
				twice = append(twice, fmt.Sprintf("%s: %d (passed on %d)", id, n, sent[id]))
			}
		}
		if len(ok) < nk*w {
			never = append(never, fmt.Sprintf("%d of %d waiters", nk*w-len(ok), nk*w))
		}
		t.Logf("round %d: retry after %v (keeper leave calls out then %d) with a context of %v; the third Close took %v, error %v; standing %d; waiters answered twice %v; never %v; B's %v",
			round, delay, out, d2, took, err3, len(ws), twice, never, sc.hook)
		sc.hook.mu.Lock()
		keeps := sc.hook.byKind["keep"]
		sc.hook.mu.Unlock()
		require.Zero(t, keeps, "premise: no keep call was sent")
		assert.NoError(t, err3, "round %d: the third Close (Background)", round)
		assert.Empty(t, ws, "round %d: B's gone waiters standing once the third Close returned nil", round)
		assert.Empty(t, twice, "round %d: waiters whose leave call was answered more than once", round)
		assert.Empty(t, never, "round %d: waiters whose leave call was never answered", round)
		require.NoError(t, sc.a.Close(ctx))
	}
	t.Logf("%d rounds: keeper leave calls out as the retry began in %d", rounds, midCall)
	require.Positive(t, midCall, "premise: in some rounds the retry began while keepers of the Close that gave up were in a call")
	leasetest.Settled(t, 5*time.Second)
}

// TestReviewClose48bFlapping: B (engine timeout 20 ms, TTL 3 s, poll
// 100 ms) has W = 4 waiters queued on each of K = 6 keys (A holding each
// key's lease), on a redis-server of the test's own, which is paused and
// resumed every 50 ms (SIGSTOP, SIGCONT) for 1.5 s. 200 ms in, 16 Closes
// of B start, each after 0 to 200 ms: 4 with context.Background(), 4
// with a context already ended, 8 with a context of 5 to 300 ms. Checks:
// no panic; every Close returns (none hangs: within 10 s of the
// flapping's end), the Background ones with nil; once they all have, and
// Redis answers, what of B's gone waiters stands is logged, then 1 s
// later; that is asserted empty unless one of B's leave calls failed at
// its client (Close's doc allows dropping the calls once Redis is judged
// away, "and Redis drops their waiters within the TTL": so nothing of
// B's may stand once the TTL and a second have passed since the last
// Close returned); no goroutine of package lease is left. 3 rounds.
func TestReviewClose48bFlapping(t *testing.T) {
	const nk, w, rounds = 6, 4, 3
	ctx := context.Background()
	for round := 0; round < rounds; round++ {
		const ttl = 3 * time.Second
		sc := c48bSetup(t, c48bCfg{own: true, waited: nk, w: w, timeout: 20 * time.Millisecond, ttl: ttl, tag: fmt.Sprint("fl", round)})
		pid := sc.srv.Pid()
		flapDone := make(chan struct{})
		go func() {
			defer close(flapDone)
			end := time.Now().Add(1500 * time.Millisecond)
			for time.Now().Before(end) {
				_ = syscall.Kill(pid, syscall.SIGSTOP)
				time.Sleep(50 * time.Millisecond)
				_ = syscall.Kill(pid, syscall.SIGCONT)
				time.Sleep(50 * time.Millisecond)
			}
			_ = syscall.Kill(pid, syscall.SIGCONT)
		}()
		t.Cleanup(func() { _ = syscall.Kill(pid, syscall.SIGCONT) })
		time.Sleep(200 * time.Millisecond)
		type res struct {
			kind string
			d    time.Duration
			err  error
			over time.Duration // past its deadline when it returned
		}
		results := make(chan res, 16)
		for i := 0; i < 16; i++ {
			kind, d := "timeout", time.Duration(5+rand.IntN(296))*time.Millisecond
			switch {
			case i%4 == 0:
				kind = "background"
			case i%4 == 1:
				kind, d = "ended", 0
			}
			delay := time.Duration(rand.IntN(201)) * time.Millisecond
			go func() {
				time.Sleep(delay)
				c, cancel := ctx, context.CancelFunc(func() {})
				if kind != "background" {
					c, cancel = context.WithTimeout(ctx, d)
				}
				defer cancel()
				err := sc.b.Close(c)
				var over time.Duration
				if dl, ok := c.Deadline(); ok {
					over = time.Since(dl)
				}
				results <- res{kind, d, err, over}
			}()
		}
		<-flapDone
		var maxOver time.Duration
		for range 16 {
			r := leasetest.Recv(t, results, "a Close (Redis answering again)")
			if r.kind == "background" {
				assert.NoError(t, r.err, "round %d: a Background Close", round)
			} else {
				maxOver = max(maxOver, r.over)
			}
		}
		lastReturn := time.Now()
		for range nk * w {
			require.Error(t, leasetest.Recv(t, sc.got, "B's Acquire"))
		}
		sc.resume(t)
		at := sc.waiters()
		time.Sleep(time.Second)
		later := sc.waiters()
		sc.hook.mu.Lock()
		leaveErrs := sc.hook.errs["leave"]
		sc.hook.mu.Unlock()
		t.Logf("round %d: every Close returned; the latest past its deadline by %v; B's gone waiters standing %d, 1 s later %d (leave calls failed at B's client %d); B's %v",
			round, maxOver, len(at), len(later), leaveErrs, sc.hook)
		if leaveErrs == 0 {
			assert.Empty(t, later, "round %d: B's gone waiters standing, though none of its leave calls failed", round)
		}
		if len(later) > 0 {
			time.Sleep(time.Until(lastReturn.Add(ttl + time.Second)))
			final := sc.waiters()
			t.Logf("round %d: B's gone waiters standing the TTL and 1 s after the last Close returned: %d", round, len(final))
			assert.Empty(t, final, "round %d: B's gone waiters standing past the TTL", round)
		}
		require.NoError(t, sc.a.Close(ctx))
	}
	leasetest.Settled(t, 5*time.Second)
}
