package reserve_test

// Adversarial review (helper-85) of 32838e4: the fallback's local limiters
// are a GCRA of the package's own (reserve/bucket.go), not x/time/rate.
//
// Redis is made unavailable by a client whose dialer goes through a
// redistest.Proxy that can be closed (down) and replaced by a new one (up):
// the same Limiter then sees Redis come and go, so heartbeats (LocalShare)
// can change its share between outages while local bookings stand.
//
// Oracle: an independent textbook check. The acts that stand (every OK
// local booking at its SlotAt, but those cancelled before their SlotAt and
// those whose caller never had them; an Allow at the time of the call)
// must conform, for each limit, to a token bucket of the local share:
// Burst+1 tokens (divided by the instances for LocalShare), one more every
// Period/Rate (times the instances), replayed in the order of the acts
// (virtual scheduling: tat = max(tat, a) + n*T, conforming iff
// tat - size*T <= a). Given back more, or handed out early, shows as an
// act before the bucket allows it.
//
// Outcome at 32838e4: nothing PROVEN. Every test here passes (100 seeds of
// the random sequences, BK_SEEDS=100, passed too). Edges seen, by design
// or documented, none early: a key whose limiter was evicted (maxKeys) or
// Reset starts with a full burst; bookings made before a share change give
// nothing back after it; past MaxBatch bookings given back out of order,
// room is lost (TestReviewBKFreedCapNeverEarly logs 17m33s where the
// textbook says 4s; the README's "slots cancelled in any order all come
// back" does not say so).

import (
	"context"
	"fmt"
	"math"
	"math/rand/v2"
	"net"
	"os"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/slotbook/slotbook/internal/redistest"
	"github.com/slotbook/slotbook/reserve"
	"github.com/slotbook/slotbook/throttle"
)

// ---------------------------------------------------------------------------
// Infrastructure
// ---------------------------------------------------------------------------

// bkObs counts decisions and calls a hook at each one (after helper-83's).
type bkObs struct {
	n     [throttle.FallbackRefused + 1]atomic.Int64
	onDec atomic.Pointer[func(throttle.Outcome)]
}

func (o *bkObs) ObserveDecision(_ string, oc throttle.Outcome, _ time.Duration) {
	o.n[oc].Add(1)
	if f := o.onDec.Load(); f != nil {
		(*f)(oc)
	}
}
func (o *bkObs) ObserveCall(string, time.Duration, error) {}
func (o *bkObs) ObserveRefund(string, time.Duration)      {}
func (o *bkObs) ObserveBreaker(bool)                      {}
func (o *bkObs) hook(f func(throttle.Outcome))            { o.onDec.Store(&f) }
func (o *bkObs) unhook()                                  { o.onDec.Store(nil) }

// bkNet is a Redis that can be made unreachable (down: dials refused, the
// connections dropped) and reachable again (up).
type bkNet struct {
	t      *testing.T
	srv    *redistest.Server
	mu     sync.Mutex
	p      *redistest.Proxy // nil while down
	eng    *throttle.Engine
	prefix string
	raw    *redis.Client // straight to the server, for the test's own looks
}

func (n *bkNet) dial(ctx context.Context, network, _ string) (net.Conn, error) {
	n.mu.Lock()
	p := n.p
	n.mu.Unlock()
	if p == nil {
		return nil, &net.OpError{Op: "dial", Net: network, Err: syscall.ECONNREFUSED}
	}
	var d net.Dialer
	return d.DialContext(ctx, network, p.Addr())
}

func (n *bkNet) down() {
	n.mu.Lock()
	p := n.p
	n.p = nil
	n.mu.Unlock()
	if p != nil {
		p.Close()
	}
}

func (n *bkNet) up() {
	p := redistest.NewProxy(n.t, n.srv.Addr)
	n.mu.Lock()
	n.p = p
	n.mu.Unlock()
}

// bkEngine returns an engine on a bkNet, up, whose breaker probes every
// 20 to 50 ms.
func bkEngine(t *testing.T, obs *bkObs) *bkNet {
	t.Helper()
	srv := redistest.Shared(t)
	n := &bkNet{t: t, srv: srv}
	n.up()
	o := srv.Options()
	o.Dialer = n.dial
	o.PoolSize = 8
	o.DialerRetries = 1 // a refused dial fails at once (not after 4 backoffs)
	rdb := redis.NewClient(o)
	t.Cleanup(func() {
		_ = rdb.Close()
		// go-redis's pool, after PoolSize failed dials, redials once a
		// second on a goroutine of its own until the pool is closed.
		time.Sleep(1100 * time.Millisecond)
	})
	n.prefix = redistest.Prefix(t)
	eng, err := throttle.New(rdb, throttle.WithPrefix(n.prefix), throttle.WithTimeout(time.Second),
		throttle.WithObserver(obs), throttle.WithProbeBackoff(20*time.Millisecond, 50*time.Millisecond))
	require.NoError(t, err)
	require.NoError(t, eng.Load(context.Background()))
	n.eng = eng
	n.raw = srv.Client(t)
	return n
}

// bkWaitDown makes l's Redis unreachable and books (and gives back) on a
// key of its own until the fallback answers.
func bkWaitDown(t *testing.T, n *bkNet, l *reserve.Limiter) {
	t.Helper()
	n.down()
	bg := context.Background()
	for i := 0; i < 200; i++ {
		r, err := l.ReserveN(bg, "bk-warm", 1)
		if err == nil && r.Fallback() {
			require.NoError(t, r.Cancel(bg))
			return
		}
		time.Sleep(10 * time.Millisecond)
	}
	t.Fatal("the fallback never answered")
}

// bkWaitUp makes l's Redis reachable and waits until a booking is Redis's.
func bkWaitUp(t *testing.T, n *bkNet, l *reserve.Limiter) {
	t.Helper()
	n.up()
	bg := context.Background()
	for i := 0; i < 400; i++ {
		r, err := l.ReserveN(bg, "bk-up", 1)
		if err == nil && !r.Fallback() {
			require.NoError(t, r.Cancel(bg))
			return
		}
		time.Sleep(10 * time.Millisecond)
	}
	t.Fatal("Redis never answered again")
}

// bkDown returns a Limiter named name whose Redis is unreachable, the
// fallback answering.
func bkDown(t *testing.T, name string, lim throttle.Limit, fb reserve.Fallback, opts ...reserve.Option) (*reserve.Limiter, *bkObs, *bkNet) {
	t.Helper()
	obs := &bkObs{}
	n := bkEngine(t, obs)
	l, err := reserve.New(n.eng, name, lim, append([]reserve.Option{reserve.WithFallback(fb), reserve.WithoutMaxWait()}, opts...)...)
	require.NoError(t, err)
	bkWaitDown(t, n, l)
	return l, obs, n
}

// ---------------------------------------------------------------------------
// Oracle
// ---------------------------------------------------------------------------

// bkShare is a textbook bucket: one unit every e nanoseconds (exact, not
// rounded), size units.
type bkShare struct {
	e    float64
	size int
}

func bkShareOf(lim throttle.Limit, instances int) bkShare {
	return bkShare{
		e:    float64(lim.Period) * float64(instances) / float64(lim.Rate),
		size: max(1, (lim.Burst+1)/instances),
	}
}

// bkAct is one act that stands: n units at at; slack is how much later the
// act may really have been (an Allow's call took that long).
type bkAct struct {
	at    time.Time
	n     int
	slack time.Duration
	what  string
	gone  bool // given back (cancelled before its time, or never had)
}

// bkCheck checks acts (those not gone) against the bucket sh, starting
// from tat0 (zero Time: full), and returns a description of a window the
// bucket does not allow, or "". A token bucket of size units, one more
// every e, lets acts through iff every window [a_i, a_j] holds at most
// size + (a_j - a_i)/e units (the same as GCRA's virtual scheduling:
// tat_j = max_i(a_i + e*units from i to j) <= a_j + size*e). An act whose
// time is known only within [at, at+slack] (an Allow) is counted in a
// window only where it must lie in it, and a window's length is taken at
// its longest: a window flagged is overfull whatever the true times.
func bkCheck(sh bkShare, tat0 time.Time, acts []*bkAct) string {
	var live []*bkAct
	for _, a := range acts {
		if !a.gone {
			live = append(live, a)
		}
	}
	if len(live) == 0 {
		return ""
	}
	sort.SliceStable(live, func(i, j int) bool { return live[i].at.Before(live[j].at) })
	base := live[0].at
	pre := func(a *bkAct) float64 { return float64(a.at.Sub(base)) }
	post := func(a *bkAct) float64 { return float64(a.at.Add(a.slack).Sub(base)) }
	const eps = 1000 // ns: float rounding; the implementation rounds its interval up
	describe := func(i, j *bkAct, units int, from, to float64) string {
		var b strings.Builder
		for k, c := range live {
			if float64(c.at.Sub(base)) > to+float64(time.Millisecond) {
				break
			}
			sl := ""
			if c.slack > 0 {
				sl = fmt.Sprintf(" (+%v)", c.slack.Round(time.Microsecond))
			}
			fmt.Fprintf(&b, "\n    #%d %s n=%d at +%v%s", k, c.what, c.n, c.at.Sub(base).Round(time.Microsecond), sl)
		}
		over := float64(units)*sh.e - float64(sh.size)*sh.e - (to - from)
		return fmt.Sprintf("%d units acted from %q at +%v to %q at +%v (%v apart); a bucket of one unit per %v and %d units allows %.2f: %v early; standing acts:%s",
			units, i.what, time.Duration(from).Round(time.Microsecond), j.what, time.Duration(to).Round(time.Microsecond),
			time.Duration(to-from).Round(time.Microsecond), time.Duration(sh.e), sh.size,
			float64(sh.size)+(to-from)/sh.e, time.Duration(over).Round(time.Microsecond), b.String())
	}
	for _, j := range live {
		// From the state before the first act (tat0).
		if !tat0.IsZero() {
			units := 0
			for _, k := range live {
				if k == j || post(k) <= pre(j) {
					units += k.n
				}
			}
			if t0 := float64(tat0.Sub(base)); t0+float64(units)*sh.e > post(j)+float64(sh.size)*sh.e+eps {
				return fmt.Sprintf("from tat0 +%v: ", time.Duration(t0).Round(time.Microsecond)) + describe(j, j, units, t0, post(j))
			}
		}
		for _, i := range live {
			// The window from the earlier of i and j to the later, at its
			// longest; counted in it, i, j, and what lies in it for sure.
			lo, hi := min(pre(i), pre(j)), max(post(i), post(j))
			inLo, inHi := min(post(i), post(j)), max(pre(i), pre(j))
			units := i.n
			if i != j {
				units += j.n
			}
			for _, k := range live {
				if k != i && k != j && pre(k) >= inLo && post(k) <= inHi {
					units += k.n
				}
			}
			if float64(units)*sh.e > float64(sh.size)*sh.e+(hi-lo)+eps {
				return describe(i, j, units, lo, hi)
			}
		}
	}
	return ""
}

// bkTat is the textbook bucket's tat after the live acts, from tat0 (zero
// Time: full); zero Time if there is nothing.
func bkTat(sh bkShare, tat0 time.Time, acts []*bkAct) time.Time {
	var live []*bkAct
	for _, a := range acts {
		if !a.gone {
			live = append(live, a)
		}
	}
	if len(live) == 0 {
		return tat0
	}
	sort.SliceStable(live, func(i, j int) bool { return live[i].at.Before(live[j].at) })
	base := live[0].at
	tat := math.Inf(-1)
	if !tat0.IsZero() {
		tat = float64(tat0.Sub(base))
	}
	for _, a := range live {
		tat = max(tat, float64(a.at.Sub(base))) + float64(a.n)*sh.e
	}
	return base.Add(time.Duration(tat))
}

// TestReviewBKOracleSelfCheck: the oracle flags what it must.
func TestReviewBKOracleSelfCheck(t *testing.T) {
	sh := bkShare{e: float64(time.Minute), size: 4}
	t0 := time.Now()
	ok := []*bkAct{{at: t0, n: 4}, {at: t0.Add(4 * time.Minute), n: 4}, {at: t0.Add(5 * time.Minute), n: 1}}
	require.Empty(t, bkCheck(sh, time.Time{}, ok))
	bad := []*bkAct{{at: t0, n: 4}, {at: t0.Add(2 * time.Minute), n: 4}}
	require.NotEmpty(t, bkCheck(sh, time.Time{}, bad))
	bad[1].gone = true
	require.Empty(t, bkCheck(sh, time.Time{}, bad))
	require.NotEmpty(t, bkCheck(sh, t0.Add(time.Minute), []*bkAct{{at: t0, n: 4}}))
	require.Equal(t, t0.Add(4*time.Minute), bkTat(sh, time.Time{}, ok[:1]))
	// An act known only within a span: not counted where it may lie
	// outside the window.
	fuzzy := []*bkAct{{at: t0, n: 4}, {at: t0.Add(time.Minute), n: 3, slack: 10 * time.Minute}, {at: t0.Add(2 * time.Minute), n: 2}}
	require.Empty(t, bkCheck(sh, time.Time{}, fuzzy))
	fuzzy[1].slack = 0
	require.NotEmpty(t, bkCheck(sh, time.Time{}, fuzzy))
}

// ---------------------------------------------------------------------------
// Random sequences
// ---------------------------------------------------------------------------

type bkHeld struct {
	r   *reserve.Reservation
	act *bkAct
	key string
}

type bkRun struct {
	t      *testing.T
	rng    *rand.Rand
	l      *reserve.Limiter
	views  []*reserve.Limiter
	obs    *bkObs
	lims   []throttle.Limit
	inst   int
	keys   []string
	fast   bool
	held   []*bkHeld
	acts   map[string][]*bkAct
	log    []string
	seq    int
	counts map[string]int
	start  time.Time
}

func (b *bkRun) logf(format string, args ...any) {
	b.log = append(b.log, time.Now().Format("15:04:05.000000 ")+fmt.Sprintf("%d [%v]: ", b.seq, time.Since(b.start).Round(time.Microsecond))+fmt.Sprintf(format, args...))
}

func (b *bkRun) maxN() int {
	m := math.MaxInt
	for _, lim := range b.lims {
		m = min(m, lim.Burst+1) // what every limit accepts (checkN)
	}
	return m
}

func (b *bkRun) record(key string, r *reserve.Reservation, n int, what string) {
	if r == nil || !r.OK() {
		return
	}
	require.True(b.t, r.Fallback(), "not the fallback's answer")
	a := &bkAct{at: r.SlotAt(), n: n, what: fmt.Sprintf("%s#%d", what, b.seq)}
	b.acts[key] = append(b.acts[key], a)
	b.held = append(b.held, &bkHeld{r: r, act: a, key: key})
	b.logf("%s key=%s n=%d OK delay=%v", what, key, n, r.Delay().Round(time.Microsecond))
}

// budgetCtx returns a context for a request: background, or with a
// deadline the fallback judges the slot by.
func (b *bkRun) budgetCtx() (context.Context, context.CancelFunc, string) {
	if b.rng.IntN(3) != 0 {
		d := time.Duration(b.rng.Int64N(int64(b.scale() * 6)))
		ctx, cancel := context.WithTimeout(context.Background(), d+b.scale()/2)
		return ctx, cancel, fmt.Sprintf("dl=%v", (d + b.scale()/2).Round(time.Microsecond))
	}
	return context.Background(), func() {}, ""
}

// scale is the first limit's textbook interval at the share.
func (b *bkRun) scale() time.Duration {
	return time.Duration(bkShareOf(b.lims[0], b.inst).e)
}

func (b *bkRun) view() (*reserve.Limiter, int) {
	i := b.rng.IntN(len(b.views) + 1)
	if i == 0 {
		return b.l, 0
	}
	return b.views[i-1], i
}

func (b *bkRun) opReserve(key string) {
	n := 1 + b.rng.IntN(b.maxN())
	l, v := b.view()
	ctx, cancel, dl := b.budgetCtx()
	defer cancel()
	var r *reserve.Reservation
	var err error
	what := "reserve"
	if b.rng.IntN(3) == 0 {
		mw := time.Duration(b.rng.Int64N(int64(b.scale() * 6)))
		r, err = l.ReserveWithin(ctx, key, n, mw)
		what = fmt.Sprintf("within(%v)", mw.Round(time.Microsecond))
	} else {
		r, err = l.ReserveN(ctx, key, n)
	}
	what = fmt.Sprintf("%s[v%d]%s", what, v, dl)
	if err != nil {
		require.ErrorIs(b.t, err, context.DeadlineExceeded, "%s", what)
		b.logf("%s key=%s n=%d ended: %v", what, key, n, err)
		return
	}
	if !r.OK() {
		b.logf("%s key=%s n=%d refused %v", what, key, n, r.RetryAfter().Round(time.Microsecond))
		b.counts["refused"]++
		return
	}
	b.counts["ok"]++
	b.record(key, r, n, what)
}

func (b *bkRun) opCancel() {
	if len(b.held) == 0 {
		return
	}
	i := b.rng.IntN(len(b.held))
	h := b.held[i]
	pre := time.Now()
	require.NoError(b.t, h.r.Cancel(context.Background()))
	if b.rng.IntN(4) == 0 {
		require.NoError(b.t, h.r.Cancel(context.Background())) // twice: nothing more
	}
	if pre.Before(h.r.SlotAt()) {
		h.act.gone = true // given back (or kept: the oracle is then weaker)
		b.counts["cancel-before"]++
		b.logf("cancel %s (before its time)", h.act.what)
	} else {
		b.counts["cancel-after"]++
		b.logf("cancel %s (its time came: stands)", h.act.what)
	}
	b.held = slices.Delete(b.held, i, i+1)
}

// opUnused: a caller whose context ends right after the fallback answered;
// nested, another caller books on the key before the give-back.
func (b *bkRun) opUnused(key string, nested bool) {
	n := 1 + b.rng.IntN(b.maxN())
	l, v := b.view()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var once sync.Once
	b.obs.hook(func(oc throttle.Outcome) {
		if oc != throttle.FallbackAllowed {
			return
		}
		once.Do(func() {
			cancel()
			if nested {
				b.obs.unhook()
				m := 1 + b.rng.IntN(b.maxN())
				r, err := b.l.ReserveN(context.Background(), key, m)
				if err == nil && r.OK() {
					b.record(key, r, m, "nested")
				}
			}
		})
	})
	r, err := l.ReserveN(ctx, key, n)
	b.obs.unhook()
	if err == nil {
		require.False(b.t, r.OK(), "an ended caller got a slot")
		b.logf("unused[v%d] key=%s n=%d refused", v, key, n)
		return
	}
	require.ErrorIs(b.t, err, context.Canceled)
	b.counts["unused"]++
	b.logf("unused[v%d] key=%s n=%d given back (nested=%v)", v, key, n, nested)
}

func (b *bkRun) opBatch(key string, ended bool) {
	k := 1 + b.rng.IntN(4)
	reqs := make([]reserve.BatchRequest, k)
	var cancels []context.CancelFunc
	defer func() {
		for _, c := range cancels {
			c()
		}
	}()
	for i := range reqs {
		reqs[i].N = 1 + b.rng.IntN(b.maxN())
		ctx, cancel, _ := b.budgetCtx()
		cancels = append(cancels, cancel)
		reqs[i].Context = ctx
		reqs[i].HoldLate = b.rng.IntN(2) == 0
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	if ended {
		var once sync.Once
		b.obs.hook(func(oc throttle.Outcome) {
			if oc == throttle.FallbackAllowed {
				once.Do(cancel)
			}
		})
	}
	rs, err := b.l.ReserveBatch(ctx, key, reqs)
	b.obs.unhook()
	if err != nil {
		if ended {
			require.ErrorIs(b.t, err, context.Canceled)
		} else {
			require.ErrorIs(b.t, err, context.DeadlineExceeded)
		}
		b.counts["batch-ended"]++
		b.logf("batch key=%s %d requests ended: %v", key, k, err)
		return
	}
	for i, r := range rs {
		if r.OK() {
			b.record(key, r, reqs[i].N, fmt.Sprintf("batch[%d/%d]", i, k))
		}
	}
}

func (b *bkRun) allowN(key string, n int, what string) (throttle.Result, bool) {
	pre := time.Now()
	res, err := b.l.AllowN(context.Background(), key, n)
	post := time.Now()
	require.NoError(b.t, err)
	if res.Allowed {
		b.acts[key] = append(b.acts[key], &bkAct{at: pre, n: n, slack: post.Sub(pre), what: fmt.Sprintf("%s#%d", what, b.seq)})
		b.counts["allowed"]++
	}
	b.logf("%s key=%s n=%d allowed=%v remaining=%d retry=%v", what, key, n, res.Allowed, res.Remaining, res.RetryAfter.Round(time.Microsecond))
	return res, res.Allowed
}

func (b *bkRun) opAllow(key string) {
	n := 1 + b.rng.IntN(b.maxN())
	res, ok := b.allowN(key, n, "allow")
	if !ok || b.fast {
		return
	}
	// Slow limits: nothing comes back in the milliseconds this takes, so
	// Remaining is exactly what passes next.
	if r := res.Remaining; r > 0 && r <= b.maxN() {
		_, ok := b.allowN(key, r, "allow-remaining")
		require.True(b.t, ok, "BUG: AllowN answered Remaining %d, and AllowN(%d) right after was refused", r, r)
		_, ok = b.allowN(key, 1, "allow-one-more")
		require.False(b.t, ok, "Remaining %d was short: one more passed after it", r)
	} else if r == 0 {
		_, ok := b.allowN(key, 1, "allow-one-more")
		require.False(b.t, ok, "Remaining 0 was short: one more passed")
	}
}

func (b *bkRun) check(when string) {
	b.t.Helper()
	for _, key := range b.keys {
		for i, lim := range b.lims {
			if msg := bkCheck(bkShareOf(lim, b.inst), time.Time{}, b.acts[key]); msg != "" {
				tail := b.log
				if os.Getenv("BK_FULLLOG") == "" && len(tail) > 60 {
					tail = tail[len(tail)-60:]
				}
				b.t.Fatalf("BUG (%s): through early on key %s, limit %d (%v): %s\nlast ops:\n  %s",
					when, key, i, lim, msg, strings.Join(tail, "\n  "))
			}
		}
	}
}

// bkSeeds returns the seeds to run: BK_SEED if set, else n fixed ones (or
// BK_SEEDS of them, for a longer run).
func bkSeeds(n int) []uint64 {
	if s := os.Getenv("BK_SEED"); s != "" {
		v, err := strconv.ParseUint(s, 10, 64)
		if err == nil {
			return []uint64{v}
		}
	}
	if s := os.Getenv("BK_SEEDS"); s != "" {
		if v, err := strconv.Atoi(s); err == nil && v > 0 {
			n = v
		}
	}
	out := make([]uint64, n)
	for i := range out {
		out[i] = uint64(0x5eed0 + 7919*i)
	}
	return out
}

type bkConfig struct {
	name  string
	lims  []throttle.Limit
	fb    reserve.Fallback
	inst  int
	fast  bool
	steps int
	seeds int
}

func bkRandom(t *testing.T, cfg bkConfig) {
	opts := []reserve.Option{}
	if len(cfg.lims) > 1 {
		opts = append(opts, reserve.WithLimit(cfg.lims[1:]...))
	}
	l, obs, _ := bkDown(t, "bk"+cfg.name, cfg.lims[0], cfg.fb, opts...)
	for _, seed := range bkSeeds(cfg.seeds) {
		t.Run(fmt.Sprint(seed), func(t *testing.T) {
			t.Logf("seed %d (BK_SEED=%d reruns it alone)", seed, seed)
			rng := rand.New(rand.NewPCG(seed, 85))
			b := &bkRun{t: t, rng: rng, l: l, obs: obs, lims: cfg.lims, inst: cfg.inst, fast: cfg.fast,
				acts: map[string][]*bkAct{}, counts: map[string]int{}, start: time.Now()}
			for i := 0; i < 2; i++ {
				b.keys = append(b.keys, fmt.Sprintf("s%d-k%d", seed, i))
			}
			nc, err := l.With(reserve.WithCoalescing(false))
			require.NoError(t, err)
			mw, err := l.With(reserve.WithMaxWait(3 * b.scale()))
			require.NoError(t, err)
			b.views = []*reserve.Limiter{nc, mw}
			for b.seq = 0; b.seq < cfg.steps; b.seq++ {
				if b.seq%40 == 39 {
					b.keys = append(b.keys, fmt.Sprintf("s%d-k%d", seed, len(b.keys)))
				}
				// Mostly the two newest keys (slow limits never refill).
				key := b.keys[len(b.keys)-1-rng.IntN(2)]
				if rng.IntN(10) == 0 {
					key = b.keys[rng.IntN(len(b.keys))]
				}
				switch x := rng.IntN(100); {
				case x < 28:
					b.opReserve(key)
				case x < 50:
					b.opCancel()
				case x < 57:
					b.opUnused(key, false)
				case x < 62:
					b.opUnused(key, true)
				case x < 70:
					b.opBatch(key, false)
				case x < 74:
					b.opBatch(key, true)
				case x < 90:
					b.opAllow(key)
				case x < 93:
					// Everything held given back, in random order.
					rng.Shuffle(len(b.held), func(i, j int) { b.held[i], b.held[j] = b.held[j], b.held[i] })
					for len(b.held) > 0 {
						b.opCancel()
					}
				default:
					if cfg.fast {
						time.Sleep(time.Duration(rng.Int64N(int64(min(3*b.scale(), 5*time.Millisecond)))))
					} else {
						b.opCancel()
					}
				}
				if b.seq%25 == 0 {
					b.check(fmt.Sprintf("step %d", b.seq))
				}
			}
			b.check("end of sequence")
			// Everything still held given back in random order, then each
			// key probed.
			rng.Shuffle(len(b.held), func(i, j int) { b.held[i], b.held[j] = b.held[j], b.held[i] })
			for len(b.held) > 0 {
				b.opCancel()
			}
			for _, key := range b.keys {
				b.opReserve(key)
				b.opAllow(key)
			}
			b.check("after giving everything back")
			t.Logf("seed %d: %v", seed, b.counts)
		})
	}
}

// TestReviewBKRandomSlow: FailOpen and LocalShare (assumed instances, no
// heartbeat ever: Redis is down from the start), slow limits (minutes per
// unit), single and layered, rates that do not divide their period.
func TestReviewBKRandomSlow(t *testing.T) {
	t.Parallel()
	for _, cfg := range []bkConfig{
		{name: "fo1", lims: []throttle.Limit{throttle.PerHour(60, 3)}, fb: reserve.FailOpen(), inst: 1},
		{name: "folay", lims: []throttle.Limit{throttle.PerHour(60, 3), throttle.PerDay(24*6, 5)}, fb: reserve.FailOpen(), inst: 1},
		{name: "fo7", lims: []throttle.Limit{throttle.PerMinute(7, 4), throttle.PerHour(100, 2)}, fb: reserve.FailOpen(), inst: 1},
		{name: "ls3", lims: []throttle.Limit{throttle.PerHour(180, 11)}, fb: reserve.LocalShare(time.Hour, 3, 100_000), inst: 3},
		{name: "ls2lay", lims: []throttle.Limit{throttle.PerMinute(7, 4), throttle.PerDay(1000, 9)}, fb: reserve.LocalShare(time.Hour, 2, 100_000), inst: 2},
	} {
		cfg.steps, cfg.seeds = 400, 4
		t.Run(cfg.name, func(t *testing.T) { bkRandom(t, cfg) })
	}
}

// TestReviewBKRandomFast: fast limits (PerSecond(1000), PerSecond(3)), so
// that slots come during the sequence: Cancel after the slot came, the
// freed list's entries passing their time.
func TestReviewBKRandomFast(t *testing.T) {
	t.Parallel()
	for _, cfg := range []bkConfig{
		{name: "f1000", lims: []throttle.Limit{throttle.PerSecond(1000, 9)}, fb: reserve.FailOpen(), inst: 1},
		{name: "f1000lay", lims: []throttle.Limit{throttle.PerSecond(1000, 9), throttle.Every(50*time.Millisecond, 20, 4)}, fb: reserve.FailOpen(), inst: 1},
		{name: "f3", lims: []throttle.Limit{throttle.PerSecond(3, 1)}, fb: reserve.LocalShare(time.Hour, 1, 100_000), inst: 1},
		{name: "ls1000", lims: []throttle.Limit{throttle.PerSecond(1000, 9)}, fb: reserve.LocalShare(time.Hour, 2, 100_000), inst: 2},
	} {
		cfg.fast, cfg.steps, cfg.seeds = true, 500, 3
		t.Run(cfg.name, func(t *testing.T) { bkRandom(t, cfg) })
	}
}

// ---------------------------------------------------------------------------
// Deterministic side paths
// ---------------------------------------------------------------------------

const bkMin = time.Minute

// bkLocal books n units of key and requires the fallback's OK.
func bkLocal(t *testing.T, l *reserve.Limiter, key string, n int) *reserve.Reservation {
	t.Helper()
	r, err := l.ReserveN(context.Background(), key, n)
	require.NoError(t, err)
	require.True(t, r.Fallback(), "not the fallback's answer")
	require.True(t, r.OK(), "refused: %v", r.Err())
	return r
}

// TestReviewBKGiveBackAnyOrder: with one booking standing (a whole burst,
// acted), pending bookings cancelled in any order (seeded shuffles; k up
// to 40, n random) all come back: a probe then waits what a bucket that saw
// only the standing one says, never less, and not more (the README's
// "slots cancelled in any order all come back"). Layered too.
func TestReviewBKGiveBackAnyOrder(t *testing.T) {
	t.Parallel()
	main := throttle.PerHour(60, 3) // 1/min, 4 units
	day := throttle.PerDay(24*4, 5) // 1 per 15 min, 6 units
	for _, layered := range []bool{false, true} {
		t.Run(fmt.Sprintf("layered=%v", layered), func(t *testing.T) {
			t.Parallel()
			var opts []reserve.Option
			lims := []throttle.Limit{main}
			if layered {
				opts = append(opts, reserve.WithLimit(day))
				lims = append(lims, day)
			}
			l, _, _ := bkDown(t, fmt.Sprintf("bkorder%v", layered), main, reserve.FailOpen(), opts...)
			bg := context.Background()
			for _, seed := range bkSeeds(8) {
				rng := rand.New(rand.NewPCG(seed, 1))
				key := fmt.Sprint("o", seed)
				a := bkLocal(t, l, key, 4)
				acts := []*bkAct{{at: a.SlotAt(), n: 4, what: "a"}}
				k := 1 + rng.IntN(40)
				var rs []*reserve.Reservation
				for i := 0; i < k; i++ {
					rs = append(rs, bkLocal(t, l, key, 1+rng.IntN(4)))
				}
				rng.Shuffle(len(rs), func(i, j int) { rs[i], rs[j] = rs[j], rs[i] })
				for _, r := range rs {
					require.True(t, time.Now().Before(r.SlotAt()))
					require.NoError(t, r.Cancel(bg))
				}
				p := bkLocal(t, l, key, 4)
				acts = append(acts, &bkAct{at: p.SlotAt(), n: 4, what: "probe"})
				for i, lim := range lims {
					sh := bkShareOf(lim, 1)
					require.Empty(t, bkCheck(sh, time.Time{}, acts), "seed %d limit %d", seed, i)
				}
				// Not more: the textbook earliest is a's time plus what its
				// 4 units and the probe's take beyond the bucket.
				want := time.Duration(0)
				for _, lim := range lims {
					sh := bkShareOf(lim, 1)
					want = max(want, time.Duration(float64(8-sh.size)*sh.e))
				}
				got := p.SlotAt().Sub(a.SlotAt())
				t.Logf("seed %d: %d pending given back in random order; probe of 4 acts %v after a (textbook %v)", seed, k, got.Round(time.Millisecond), want)
				require.InDelta(t, float64(want), float64(got), float64(5*time.Second),
					"after %d pending bookings cancelled in random order, a probe of 4 acts %v after the standing a; textbook %v", k, got, want)
			}
		})
	}
}

// TestReviewBKFreedCapNeverEarly: more pending bookings than the freed list
// keeps (MaxBatch), cancelled earliest first, so each waits under the
// latest; past the cap they are forgotten (room lost, never lent). The
// probe is never early; the list stays bounded (a second round on the key
// behaves the same).
func TestReviewBKFreedCapNeverEarly(t *testing.T) {
	t.Parallel()
	lim := throttle.PerSecond(1, 3) // 1 per second, 4 units; bookings of 1 an hour ahead at the end
	l, _, _ := bkDown(t, "bkcap", lim, reserve.FailOpen())
	bg := context.Background()
	sh := bkShareOf(lim, 1)
	for round := 0; round < 2; round++ {
		key := fmt.Sprint("cap", round)
		a := bkLocal(t, l, key, 4)
		acts := []*bkAct{{at: a.SlotAt(), n: 4, what: "a"}}
		var rs []*reserve.Reservation
		for i := 0; i < throttle.MaxBatch+50; i++ {
			rs = append(rs, bkLocal(t, l, key, 1))
		}
		for _, r := range rs { // earliest first: each under a later one
			require.NoError(t, r.Cancel(bg))
		}
		p := bkLocal(t, l, key, 4)
		acts = append(acts, &bkAct{at: p.SlotAt(), n: 4, what: "probe"})
		require.Empty(t, bkCheck(sh, time.Time{}, acts))
		t.Logf("round %d: %d pending cancelled earliest first: a probe of 4 acts %v after a (textbook 4s; room past the cap is lost by design)",
			round, len(rs), p.SlotAt().Sub(a.SlotAt()).Round(time.Millisecond))
	}
}

// TestReviewBKAllowRemainingLayered: check mode on a layered limiter:
// Remaining is the least room of the limits, and exactly what passes next
// (slow limits: nothing refills meanwhile); a refusal counts nothing.
func TestReviewBKAllowRemainingLayered(t *testing.T) {
	t.Parallel()
	main := throttle.PerHour(60, 5) // 6 units
	day := throttle.PerDay(100, 3)  // 4 units
	l, _, _ := bkDown(t, "bkremain", main, reserve.FailOpen(), reserve.WithLimit(day))
	bg := context.Background()
	res, err := l.AllowN(bg, "r", 1)
	require.NoError(t, err)
	require.True(t, res.Allowed)
	require.Equal(t, 3, res.Remaining, "day's room after 1 of 4")
	res, err = l.AllowN(bg, "r", 4)
	require.NoError(t, err)
	require.False(t, res.Allowed, "4 more than the day's 3")
	res, err = l.AllowN(bg, "r", 3)
	require.NoError(t, err)
	require.True(t, res.Allowed, "the refusal counted nothing")
	require.Equal(t, 0, res.Remaining)
	res, err = l.AllowN(bg, "r", 1)
	require.NoError(t, err)
	require.False(t, res.Allowed)
	// A reservation made ahead takes room from Allow; given back, returns it.
	res, err = l.AllowN(bg, "r2", 2)
	require.NoError(t, err)
	require.Equal(t, 2, res.Remaining)
	r := bkLocal(t, l, "r2", 2)
	require.Zero(t, r.Delay())
	r2 := bkLocal(t, l, "r2", 1) // ahead: the day's interval
	require.Greater(t, r2.Delay(), 10*time.Minute)
	res, err = l.AllowN(bg, "r2", 1)
	require.NoError(t, err)
	require.False(t, res.Allowed)
	require.NoError(t, r2.Cancel(bg))
	require.NoError(t, r.Cancel(bg)) // its time came: stands
	res, err = l.AllowN(bg, "r2", 1)
	require.NoError(t, err)
	require.False(t, res.Allowed, "r's 2 stand (acted), 2+2 = the day's 4")
}

// bkFake keeps count-1 fake processes alive in name's heartbeat set while
// it runs (each beat within the limiter's TTL of 3 intervals), on an
// engine of its own straight to Redis.
func bkFake(t *testing.T, n *bkNet, name string, count int, every time.Duration) (stop func()) {
	t.Helper()
	eng, err := throttle.New(n.raw, throttle.WithPrefix(n.prefix))
	require.NoError(t, err)
	done := make(chan struct{})
	var wg sync.WaitGroup
	beat := func() {
		for i := 1; i < count; i++ {
			_, _ = eng.Heartbeat(context.Background(), name, fmt.Sprintf("bk-fake-%d", i), 3*every)
		}
	}
	beat()
	wg.Add(1)
	go func() {
		defer wg.Done()
		tk := time.NewTicker(every / 3)
		defer tk.Stop()
		for {
			select {
			case <-done:
				return
			case <-tk.C:
				beat()
			}
		}
	}()
	var once sync.Once
	stop = func() { once.Do(func() { close(done); wg.Wait() }) }
	t.Cleanup(stop)
	return stop
}

// bkBeat brings Redis up, makes calls that reach it until the limiter's
// own heartbeat has been recorded after the fakes settled with want
// processes in the set, and returns the bounds of the time at which the
// share changed: lo, before Redis came up; hi, after the heartbeat was
// seen and had time to take effect. Redis is left up.
func bkBeat(t *testing.T, n *bkNet, l *reserve.Limiter, name string, want int) (lo, hi time.Time) {
	t.Helper()
	lo = time.Now()
	bkWaitUp(t, n, l)
	bg := context.Background()
	key := n.prefix + "instances:" + name
	for try := 0; try < 100; try++ {
		tm, err := n.raw.Time(bg).Result()
		require.NoError(t, err)
		since := tm.UnixMicro()
		time.Sleep(150 * time.Millisecond) // past the heartbeat interval
		r, err := l.ReserveN(bg, "bk-beat", 1)
		require.NoError(t, err)
		require.False(t, r.Fallback())
		require.NoError(t, r.Cancel(bg))
		for poll := 0; poll < 50; poll++ {
			zs, err := n.raw.ZRangeWithScores(bg, key, 0, -1).Result()
			require.NoError(t, err)
			fresh := false
			for _, z := range zs {
				if m, _ := z.Member.(string); !strings.HasPrefix(m, "bk-fake") && int64(z.Score) >= since {
					fresh = true
				}
			}
			if fresh && len(zs) == want {
				time.Sleep(100 * time.Millisecond) // the share's change under the lock
				return lo, time.Now()
			}
			time.Sleep(10 * time.Millisecond)
		}
	}
	t.Fatalf("no heartbeat of the limiter seen with %d processes", want)
	return
}

// TestReviewBKShareChange: LocalShare, one process (assumed 1), a key with
// a whole burst acted and bookings ahead; Redis comes back and a heartbeat
// finds two processes (a fake one kept alive in the set), then one again.
// The oracle is the documented rule (the units booked ahead are kept on a
// share change) on top of the textbook: after the change at tc, acts
// conform to the new share's bucket started from tc + (units ahead at tc,
// as the textbook at the old share counts them) * the new interval.
// Bookings made before the change and cancelled after it give nothing back
// (conservative: the oracle drops them); those made after it come back.
func TestReviewBKShareChange(t *testing.T) {
	t.Parallel()
	lim := throttle.PerHour(60, 9) // whole: 1/min, 10 units; half: 1 per 2 min, 5 units
	obs := &bkObs{}
	n := bkEngine(t, obs)
	name := "bkshare"
	const hb = 100 * time.Millisecond
	l, err := reserve.New(n.eng, name, lim, reserve.WithFallback(reserve.LocalShare(hb, 1, 100)), reserve.WithoutMaxWait())
	require.NoError(t, err)
	bg := context.Background()
	one, two := bkShareOf(lim, 1), bkShareOf(lim, 2)
	bkBeat(t, n, l, name, 1)
	bkWaitDown(t, n, l)

	// Phase 1, one process: a (10, acts now), b, c (1 each), d (2) ahead.
	var pre []*bkAct
	book := func(acts *[]*bkAct, key string, k int, what string) (*reserve.Reservation, *bkAct) {
		r := bkLocal(t, l, key, k)
		a := &bkAct{at: r.SlotAt(), n: k, what: what}
		*acts = append(*acts, a)
		return r, a
	}
	book(&pre, "k", 10, "a")
	b, bAct := book(&pre, "k", 1, "b")
	c, cAct := book(&pre, "k", 1, "c")
	d, dAct := book(&pre, "k", 2, "d")
	require.Empty(t, bkCheck(one, time.Time{}, pre))

	// Phase 2: two processes.
	stopFake := bkFake(t, n, name, 2, hb)
	// The share halves at some time in [lo, hi]: the seed is the latest
	// time's, 2*tat - tc, the more lenient.
	_, tc1 := bkBeat(t, n, l, name, 2)
	bkWaitDown(t, n, l)
	// A fresh key has the half share: 5 at once, not 6.
	res, err := l.AllowN(bg, "fresh2", 5)
	require.NoError(t, err)
	require.True(t, res.Allowed, "a fresh key's half share: 5 units")
	res, err = l.AllowN(bg, "fresh2", 1)
	require.NoError(t, err)
	require.False(t, res.Allowed, "a fresh key's half share is 5 units")

	ahead := max(0, bkTat(one, time.Time{}, pre).Sub(tc1))
	seed1 := tc1.Add(time.Duration(float64(ahead) * two.e / one.e))
	var post1 []*bkAct
	p1, _ := book(&post1, "k", 1, "p1")
	// Pre-change bookings cancelled now: nothing comes back (the oracle
	// drops them all the same, which only makes it weaker).
	require.NoError(t, b.Cancel(bg))
	require.NoError(t, d.Cancel(bg))
	require.NoError(t, c.Cancel(bg))
	bAct.gone, cAct.gone, dAct.gone = true, true, true
	p2, p2Act := book(&post1, "k", 5, "p2")
	p3, p3Act := book(&post1, "k", 1, "p3")
	require.NoError(t, p2.Cancel(bg)) // under p3: waits for it
	require.NoError(t, p3.Cancel(bg)) // both come back
	p2Act.gone, p3Act.gone = true, true
	p4, _ := book(&post1, "k", 2, "p4")
	t.Logf("two processes from tc1 (+%v after a): booked ahead %v; p1 acts at +%v, p4 at +%v (textbook seed +%v)",
		tc1.Sub(pre[0].at).Round(time.Millisecond), ahead.Round(time.Second),
		p1.SlotAt().Sub(pre[0].at).Round(time.Second), p4.SlotAt().Sub(pre[0].at).Round(time.Second), seed1.Sub(pre[0].at).Round(time.Second))
	require.Empty(t, bkCheck(two, seed1, post1), "BUG: through early after the share halved")
	// With b, c, d given back before the change, p1 could act no sooner
	// than the textbook of a alone at the new share allows.
	wantP1 := tc1.Add(time.Duration(float64(max(0, bkTat(one, time.Time{}, pre[:1]).Sub(tc1))) * two.e / one.e)).Add(time.Duration(two.e) - time.Duration(float64(two.size)*two.e))
	require.False(t, p1.SlotAt().Before(wantP1.Add(-5*time.Second)), "p1 at %v, before %v", p1.SlotAt(), wantP1)

	// Phase 3: one process again (the fake stops; the limiter's next
	// heartbeat drops it after three intervals).
	stopFake()
	time.Sleep(4 * hb)
	// The share doubles: (tc + tat)/2 is least at the earliest time.
	tc2, _ := bkBeat(t, n, l, name, 1)
	bkWaitDown(t, n, l)
	aheadTwo := max(0, bkTat(two, seed1, post1).Sub(tc2))
	seed2 := tc2.Add(time.Duration(float64(aheadTwo) * one.e / two.e))
	var post2 []*bkAct
	q1, _ := book(&post2, "k", 3, "q1")
	q2, q2Act := book(&post2, "k", 4, "q2")
	require.NoError(t, p4.Cancel(bg)) // before the change: gives nothing back
	require.NoError(t, q2.Cancel(bg))
	q2Act.gone = true
	q3, _ := book(&post2, "k", 10, "q3")
	t.Logf("one process again from tc2: booked ahead %v (at the half share); q1 at +%v, q3 at +%v (textbook seed +%v)",
		aheadTwo.Round(time.Second), q1.SlotAt().Sub(pre[0].at).Round(time.Second), q3.SlotAt().Sub(pre[0].at).Round(time.Second),
		seed2.Sub(pre[0].at).Round(time.Second))
	require.Empty(t, bkCheck(one, seed2, post2), "BUG: through early after the share doubled")
	// A fresh key has the whole share again.
	res, err = l.AllowN(bg, "fresh1", 10)
	require.NoError(t, err)
	require.True(t, res.Allowed, "a fresh key's whole share: 10 units")
}

// TestReviewBKEvictAndReset: LocalShare with maxKeys 1, and Reset. A key
// whose local limiter was dropped (another key came) or reset starts
// afresh (documented); a booking made on the old limiter and cancelled
// before or after the key's new one exists gives nothing to the new one:
// its acts conform to a fresh bucket on their own.
func TestReviewBKEvictAndReset(t *testing.T) {
	t.Parallel()
	lim := throttle.PerHour(60, 3) // 1/min, 4 units
	sh := bkShareOf(lim, 1)
	bg := context.Background()
	l, _, n := bkDown(t, "bkevict", lim, reserve.LocalShare(time.Hour, 1, 1))
	// A fresh bucket: 4 at once, 1 a minute later, 2 more two minutes on.
	fresh := func(key string, ns ...int) []*bkAct {
		var acts []*bkAct
		for _, k := range ns {
			r := bkLocal(t, l, key, k)
			acts = append(acts, &bkAct{at: r.SlotAt(), n: k, what: fmt.Sprint(key, k)})
		}
		return acts
	}
	// Cancelled before the key's new limiter exists.
	bkLocal(t, l, "a", 4)
	a2 := bkLocal(t, l, "a", 3)
	bkLocal(t, l, "b", 1) // drops a's
	require.NoError(t, a2.Cancel(bg))
	acts := fresh("a", 4, 1, 2)
	require.Empty(t, bkCheck(sh, time.Time{}, acts))
	require.InDelta(t, float64(3*bkMin), float64(acts[2].at.Sub(acts[0].at)), float64(5*time.Second))

	// Cancelled after.
	bkLocal(t, l, "c", 4)
	c2 := bkLocal(t, l, "c", 3)
	bkLocal(t, l, "d", 1) // drops c's
	acts = fresh("c", 4, 1)
	require.NoError(t, c2.Cancel(bg))
	r := bkLocal(t, l, "c", 2)
	acts = append(acts, &bkAct{at: r.SlotAt(), n: 2, what: "c2 after"})
	require.Empty(t, bkCheck(sh, time.Time{}, acts))
	require.InDelta(t, float64(3*bkMin), float64(acts[2].at.Sub(acts[0].at)), float64(5*time.Second))

	// Reset (Redis up for it), then the old booking cancelled.
	l2, err := l.With(reserve.WithFallback(reserve.LocalShare(time.Hour, 1, 100)))
	require.NoError(t, err)
	bkLocal(t, l2, "e", 4)
	e2 := bkLocal(t, l2, "e", 3)
	bkWaitUp(t, n, l2)
	require.NoError(t, l2.Reset(bg, "e"))
	bkWaitDown(t, n, l2)
	acts = nil
	for _, k := range []int{4, 1} {
		r := bkLocal(t, l2, "e", k)
		acts = append(acts, &bkAct{at: r.SlotAt(), n: k, what: fmt.Sprint("e", k)})
	}
	require.NoError(t, e2.Cancel(bg))
	r = bkLocal(t, l2, "e", 2)
	acts = append(acts, &bkAct{at: r.SlotAt(), n: 2, what: "e2 after"})
	require.Empty(t, bkCheck(sh, time.Time{}, acts))
	require.InDelta(t, float64(3*bkMin), float64(acts[2].at.Sub(acts[0].at)), float64(5*time.Second))
}

// TestReviewBKConcurrent: several goroutines on two keys at once
// (coalesced batches, callers sent alone, an uncoalesced view), with
// Reserve, ReserveWithin, Wait cut short, Cancel (twice, racing another
// goroutine's), short deadlines that end calls in flight (the unused
// give-back on the callers' own goroutines), ReserveBatch and AllowN. Every
// act recorded is checked against the textbook bucket.
func TestReviewBKConcurrent(t *testing.T) {
	t.Parallel()
	for _, cfg := range []struct {
		name string
		lim  throttle.Limit
		fb   reserve.Fallback
		inst int
	}{
		{"fast", throttle.PerSecond(1000, 9), reserve.FailOpen(), 1},
		{"fast3", throttle.PerSecond(300, 2), reserve.LocalShare(time.Hour, 3, 100), 3},
		{"slow", throttle.PerMinute(7, 4), reserve.FailOpen(), 1},
	} {
		t.Run(cfg.name, func(t *testing.T) {
			l, _, _ := bkDown(t, "bkconc"+cfg.name, cfg.lim, cfg.fb)
			nc, err := l.With(reserve.WithCoalescing(false))
			require.NoError(t, err)
			sh := bkShareOf(cfg.lim, cfg.inst)
			e := time.Duration(sh.e)
			keys := []string{"x", "y"}
			var mu sync.Mutex
			acts := map[string][]*bkAct{}
			var shared []*reserve.Reservation // for racing Cancels
			add := func(key string, a *bkAct) {
				mu.Lock()
				acts[key] = append(acts[key], a)
				mu.Unlock()
			}
			const workers, ops = 6, 150
			var wg sync.WaitGroup
			for w := 0; w < workers; w++ {
				wg.Add(1)
				go func() {
					defer wg.Done()
					rng := rand.New(rand.NewPCG(uint64(w), 85))
					type held struct {
						r   *reserve.Reservation
						a   *bkAct
						key string
					}
					var mine []held
					for i := 0; i < ops; i++ {
						key := keys[rng.IntN(len(keys))]
						lim := l
						if rng.IntN(3) == 0 {
							lim = nc
						}
						nn := 1 + rng.IntN(cfg.lim.Burst+1)
						switch x := rng.IntN(10); {
						case x < 4:
							ctx, cancel := context.Background(), context.CancelFunc(func() {})
							if rng.IntN(2) == 0 {
								// Short: may end while the call is out.
								ctx, cancel = context.WithTimeout(ctx, time.Duration(rng.Int64N(int64(min(8*e, 2*time.Millisecond)))))
							}
							var r *reserve.Reservation
							var err error
							if rng.IntN(2) == 0 {
								r, err = lim.ReserveWithin(ctx, key, nn, time.Duration(rng.Int64N(int64(10*e))))
							} else {
								r, err = lim.ReserveN(ctx, key, nn)
							}
							cancel()
							if err != nil || !r.OK() {
								continue
							}
							a := &bkAct{at: r.SlotAt(), n: nn, what: fmt.Sprintf("w%d#%d", w, i)}
							add(key, a)
							mine = append(mine, held{r, a, key})
							if rng.IntN(4) == 0 {
								mu.Lock()
								shared = append(shared, r)
								mu.Unlock()
							}
						case x < 6:
							if len(mine) == 0 {
								continue
							}
							j := rng.IntN(len(mine))
							h := mine[j]
							mine = slices.Delete(mine, j, j+1)
							if rng.IntN(3) == 0 {
								// Wait, cut short at a random point.
								ctx, cancel := context.WithTimeout(context.Background(), time.Duration(rng.Int64N(int64(min(2*e, 3*time.Millisecond)))))
								err := h.r.Wait(ctx)
								cancel()
								if err != nil {
									mu.Lock()
									h.a.gone = true // maybe given back: the oracle is weaker
									mu.Unlock()
								}
								continue
							}
							pre := time.Now()
							require.NoError(t, h.r.Cancel(context.Background()))
							if pre.Before(h.r.SlotAt()) {
								mu.Lock()
								h.a.gone = true
								mu.Unlock()
							}
						case x < 7:
							// Another goroutine's reservation cancelled from here
							// too (its owner may cancel it as well): racing
							// Cancels give back once.
							mu.Lock()
							if len(shared) == 0 {
								mu.Unlock()
								continue
							}
							r := shared[rng.IntN(len(shared))]
							mu.Unlock()
							pre := time.Now()
							require.NoError(t, r.Cancel(context.Background()))
							if pre.Before(r.SlotAt()) {
								// Which act is r's is known to its owner only:
								// every act with its slot is dropped (weaker).
								mu.Lock()
								for _, as := range acts {
									for _, a := range as {
										if a.at.Equal(r.SlotAt()) {
											a.gone = true
										}
									}
								}
								mu.Unlock()
							}
						case x < 8:
							k := 1 + rng.IntN(3)
							reqs := make([]reserve.BatchRequest, k)
							for q := range reqs {
								reqs[q].N = 1 + rng.IntN(cfg.lim.Burst+1)
							}
							ctx, cancel := context.WithTimeout(context.Background(), 20*e)
							rs, err := l.ReserveBatch(ctx, key, reqs)
							cancel()
							if err != nil {
								continue
							}
							for q, r := range rs {
								if r.OK() {
									a := &bkAct{at: r.SlotAt(), n: reqs[q].N, what: fmt.Sprintf("w%d#%d/%d", w, i, q)}
									add(key, a)
									mine = append(mine, held{r, a, key})
								}
							}
						case x < 9:
							pre := time.Now()
							res, err := l.AllowN(context.Background(), key, nn)
							post := time.Now()
							require.NoError(t, err)
							if res.Allowed {
								add(key, &bkAct{at: pre, slack: post.Sub(pre), n: nn, what: fmt.Sprintf("w%d#%d allow", w, i)})
							}
						default:
							time.Sleep(time.Duration(rng.Int64N(int64(min(2*e, time.Millisecond)))))
						}
					}
				}()
			}
			wg.Wait()
			for _, key := range keys {
				require.Empty(t, bkCheck(sh, time.Time{}, acts[key]), "BUG: through early on key %s (%d acts)", key, len(acts[key]))
				t.Logf("key %s: %d acts recorded", key, len(acts[key]))
			}
		})
	}
}
