package throttle_test

// Review of protocol v2 (book.lua's runs, one value per request) and of
// the engine's argument lists (cmdArgs/runCmd): every operation through
// every way the engine can reach Redis (a Client, a client that offers
// only the Scripter methods, a Cluster, a client 40 ms away), with the
// scripts flushed, after a restart, with lost replies and callers that
// give up in flight. The oracle is a continuous-state leaky bucket (the
// ITU-T I.371 formulation of GCRA), written here: it shares no arithmetic
// with the scripts' virtual-scheduling TATs, and every stored key is
// checked against it with GET.

import (
	"context"
	"errors"
	"math/rand/v2"
	"sort"
	"strconv"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/slotbook/slotbook/internal/redistest"
	"github.com/slotbook/slotbook/internal/testhook"
	"github.com/slotbook/slotbook/throttle"
)

// raLimit is a limit as the leaky bucket sees it: increment I and limit
// tau (both µs). I is Period/Rate rounded up to a whole microsecond,
// computed in one division.
type raLimit struct{ I, tau int64 }

func raOf(l throttle.Limit) raLimit {
	d := int64(l.Rate) * 1000
	I := (l.Period.Nanoseconds() + d - 1) / d
	return raLimit{I: I, tau: I * int64(l.Burst)}
}

// raBucket is one limit's leaky bucket: content x (µs) at time lct (µs),
// draining one µs per µs.
type raBucket struct {
	x, lct int64
	used   bool
}

type raOracle struct {
	ls []raLimit
	b  []raBucket
}

func newRAOracle(limits []throttle.Limit) *raOracle {
	o := &raOracle{b: make([]raBucket, len(limits))}
	for _, l := range limits {
		o.ls = append(o.ls, raOf(l))
	}
	return o
}

// content is bucket i's content at t (never negative).
func (o *raOracle) content(i int, t int64) int64 {
	b := o.b[i]
	if !b.used {
		return 0
	}
	return max(0, b.x-(t-b.lct))
}

// earliest is the first t >= now at which n cells sent together conform
// to every bucket: content(t) + (n-1)*I <= tau. The content falls one µs
// per µs until it is empty, so the first such t is found by stepping.
func (o *raOracle) earliest(now int64, n int) int64 {
	t := now
	for i, l := range o.ls {
		need := l.tau - int64(n-1)*l.I // the content at t must be at most this
		if c := o.content(i, t); c > need {
			t += c - need
		}
	}
	// A later t for one bucket only lowers the others' content: one pass
	// is enough, but check it.
	for i, l := range o.ls {
		if o.content(i, t)+int64(n-1)*l.I > l.tau {
			panic("raOracle: earliest does not conform")
		}
	}
	return t
}

// take sends n cells at t.
func (o *raOracle) take(t int64, n int) {
	for i, l := range o.ls {
		if o.b[i].used && t < o.b[i].lct {
			panic("raOracle: cells sent before the last ones")
		}
		o.b[i] = raBucket{x: o.content(i, t) + int64(n)*l.I, lct: t, used: true}
	}
}

// emptyAt is when bucket i empties: what the key holds (its TAT), or 0.
func (o *raOracle) emptyAt(i int) int64 {
	if !o.b[i].used {
		return 0
	}
	return o.b[i].lct + o.b[i].x
}

func (o *raOracle) snapshot() []raBucket { return append([]raBucket(nil), o.b...) }

// seed makes bucket i hold a key read as tat at now.
func (o *raOracle) seed(i int, now, tat int64) {
	o.b[i] = raBucket{x: max(0, tat-now), lct: now, used: true}
}

// raSent is one booked request: n cells at at (µs, Redis clock).
type raSent struct {
	at int64
	n  int
}

// raConforms replays sent (in time order) through a fresh leaky bucket of
// limit l and reports the first cell sent early, if any.
func raConforms(t *testing.T, what string, l raLimit, sent []raSent) {
	t.Helper()
	s := append([]raSent(nil), sent...)
	sort.SliceStable(s, func(i, j int) bool { return s[i].at < s[j].at })
	var x, lct int64
	for i, c := range s {
		x = max(0, x-(c.at-lct))
		require.LessOrEqual(t, x+int64(c.n-1)*l.I, l.tau,
			"%s: booking %d of %d (n %d at %d) let through early: bucket %d µs over", what, i, len(s), c.n, c.at, x+int64(c.n-1)*l.I-l.tau)
		x += int64(c.n) * l.I
		lct = c.at
	}
}

// raPath is one way of reaching Redis.
type raPath struct {
	name  string
	rdb   redis.Scripter
	get   func(ctx context.Context, key string) *redis.StringCmd // a plain client's GET
	flush func(ctx context.Context) error
}

type raScripterOnly struct{ redis.Scripter }

// raSlowHook sleeps before every command: 40 ms of latency on the client
// side, for each command (EVALSHA and its EVAL fallback alike).
type raSlowHook struct{ d time.Duration }

func (raSlowHook) DialHook(next redis.DialHook) redis.DialHook { return next }
func (h raSlowHook) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		time.Sleep(h.d)
		return next(ctx, cmd)
	}
}
func (raSlowHook) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}

func raPaths(t *testing.T, withCluster bool) []raPath {
	srv := redistest.Start(t) // our own: SCRIPT FLUSH touches no one else
	rdb := srv.Client(t)
	flush := func(ctx context.Context) error { return rdb.ScriptFlush(ctx).Err() }
	slow := srv.Client(t)
	slow.AddHook(raSlowHook{d: 40 * time.Millisecond})
	proxy := redistest.NewProxy(t, srv.Addr)
	proxy.SetLatency(20 * time.Millisecond)
	far := proxy.Client(t, srv)
	ps := []raPath{
		{"client", rdb, rdb.Get, flush},
		{"scripterOnly", raScripterOnly{rdb}, rdb.Get, flush},
		{"hook40ms", slow, rdb.Get, flush},
		{"proxy40ms", far, rdb.Get, flush},
		{"proxy40msScripterOnly", raScripterOnly{far}, rdb.Get, flush},
	}
	if withCluster && !testing.Short() {
		cl := redistest.StartCluster(t, 3)
		cc := cl.Client(t)
		cflush := func(ctx context.Context) error {
			return cc.ForEachMaster(ctx, func(ctx context.Context, c *redis.Client) error { return c.ScriptFlush(ctx).Err() })
		}
		ps = append(ps,
			raPath{"cluster", cc, cc.Get, cflush},
			raPath{"clusterScripterOnly", raScripterOnly{cc}, cc.Get, cflush})
	}
	return ps
}

// raSubject is one subject's keys and limits, its oracle, and the bookings
// that stand.
type raSubject struct {
	keys   []string
	limits []throttle.Limit
	o      *raOracle
	sent   []raSent
}

// raCheckCall checks one BookAll call's bookings against the oracle,
// request by request, and books them in it.
func (s *raSubject) check(t *testing.T, what string, reqs []throttle.Request, bs []throttle.Booking) (booked []int, snaps [][]raBucket) {
	t.Helper()
	require.Len(t, bs, len(reqs), what)
	now := bs[0].At.UnixMicro() - bs[0].Wait.Microseconds()
	for i, b := range bs {
		require.Equal(t, now, b.At.UnixMicro()-b.Wait.Microseconds(), "%s request %d: one decision time per call", what, i)
		require.Equal(t, reqs[i].N, b.N, "%s request %d", what, i)
		slot := s.o.earliest(now, reqs[i].N)
		wait := slot - now
		mw := int64(min(reqs[i].MaxWait, throttle.MaxHorizon) / time.Microsecond)
		require.Equal(t, wait, b.Wait.Microseconds(), "%s request %d (n %d, max wait %v): wait", what, i, reqs[i].N, reqs[i].MaxWait)
		require.Equal(t, wait <= mw, b.OK, "%s request %d (n %d, max wait %v, wait %d): booked", what, i, reqs[i].N, reqs[i].MaxWait, wait)
		if b.OK {
			snaps = append(snaps, s.o.snapshot())
			s.o.take(slot, reqs[i].N)
			s.sent = append(s.sent, raSent{slot, reqs[i].N})
			booked = append(booked, i)
		}
	}
	return booked, snaps
}

// stored checks that every key holds the oracle's TAT (or nothing, where
// the oracle's bucket has emptied by now).
func (s *raSubject) stored(t *testing.T, p raPath, what string) {
	t.Helper()
	ctx := context.Background()
	for i, k := range s.keys {
		v, err := p.get(ctx, raPrefix(t)+k).Int64()
		want := s.o.emptyAt(i)
		if errors.Is(err, redis.Nil) {
			require.LessOrEqual(t, want, time.Now().UnixMicro()+1_000_000, "%s: key %s absent, the oracle's TAT %d", what, k, want)
			continue
		}
		require.NoError(t, err, what)
		require.Equal(t, want, v, "%s: key %s", what, k)
	}
}

var raPrefixes = map[string]string{}

func raPrefix(t *testing.T) string {
	name := t.Name()
	if p, ok := raPrefixes[name]; ok {
		return p
	}
	p := redistest.Prefix(t)
	raPrefixes[name] = p
	return p
}

// raMixed builds size requests with n from 1 to maxN and max waits of 0,
// a few seconds, or Forever, each differing from the one before (runs of
// one) when alternate, else in runs of 1 to 4.
func raMixed(rng *rand.Rand, size, maxN int, alternate bool) []throttle.Request {
	waits := []time.Duration{0, 2500 * time.Millisecond, throttle.Forever, time.Hour + time.Microsecond, 7*time.Second + 999*time.Nanosecond}
	var reqs []throttle.Request
	prev := throttle.Request{N: -1}
	for len(reqs) < size {
		r := throttle.Request{N: 1 + rng.IntN(maxN), MaxWait: waits[rng.IntN(len(waits))]}
		if alternate && r.N == prev.N && r.MaxWait/time.Microsecond == prev.MaxWait/time.Microsecond {
			continue
		}
		run := 1
		if !alternate {
			run = 1 + rng.IntN(4)
		}
		for j := 0; j < run && len(reqs) < size; j++ {
			reqs = append(reqs, r)
		}
		prev = r
	}
	return reqs
}

// raScenario runs every operation on one subject of m limits through p.
func raScenario(t *testing.T, p raPath, m int, refunds int, bigBatch int) {
	ctx := context.Background()
	eng, err := throttle.New(p.rdb, throttle.WithPrefix(raPrefix(t)), throttle.WithTimeout(5*time.Second))
	require.NoError(t, err)
	all := []throttle.Limit{throttle.PerMinute(60, 3), throttle.Every(time.Hour, 100, 7), throttle.PerDay(1000, 5)}
	tag := "{ra-" + p.name + "-" + strconv.Itoa(m) + "}"
	s := &raSubject{limits: all[:m]}
	for i := 0; i < m; i++ {
		s.keys = append(s.keys, tag+":"+strconv.Itoa(i))
	}
	s.o = newRAOracle(s.limits)
	maxN := 4 // the first limit's burst + 1
	rng := rand.New(rand.NewPCG(uint64(m), 99))
	book := func(what string, reqs []throttle.Request, flush bool) ([]throttle.Booking, []int, [][]raBucket) {
		t.Helper()
		if flush {
			require.NoError(t, p.flush(ctx))
		}
		bs, err := eng.BookAll(ctx, s.keys, s.limits, reqs)
		require.NoError(t, err, what)
		booked, snaps := s.check(t, what, reqs, bs)
		s.stored(t, p, what)
		return bs, booked, snaps
	}

	// One request (book1.lua under one limit).
	book("one", []throttle.Request{{N: 1, MaxWait: throttle.Forever}}, true)
	// Runs of one: every request differs from the one before.
	book("alternating", raMixed(rng, 40, maxN, true), true)
	// Refusals inside runs and between them.
	book("runs", []throttle.Request{
		{N: 1, MaxWait: throttle.Forever}, {N: 1, MaxWait: throttle.Forever}, {N: 1, MaxWait: throttle.Forever},
		{N: 2, MaxWait: 0}, {N: 2, MaxWait: 0}, {N: 2, MaxWait: 0},
		{N: 1, MaxWait: throttle.Forever}, {N: 4, MaxWait: 0}, {N: 1, MaxWait: throttle.Forever}, {N: 1, MaxWait: throttle.Forever},
	}, false)
	// Everything refused: the keys are untouched (the raw values too).
	raw := make([]string, m)
	for i, k := range s.keys {
		raw[i] = p.get(ctx, raPrefix(t)+k).Val()
	}
	bs, _, _ := book("all refused", []throttle.Request{{N: 1, MaxWait: 0}, {N: 2, MaxWait: 0}, {N: 1, MaxWait: time.Millisecond}, {N: 1, MaxWait: time.Millisecond}}, true)
	for i, b := range bs {
		require.False(t, b.OK, "request %d of an all-refused batch booked", i)
	}
	for i, k := range s.keys {
		require.Equal(t, raw[i], p.get(ctx, raPrefix(t)+k).Val(), "a refused batch wrote key %s", k)
	}

	// A big batch, then its last bookings given back latest first, each
	// leaving every key where the oracle was before it (its slot is
	// ahead: the backlog is long by now).
	reqs := raMixed(rng, bigBatch, maxN, false)
	bs, booked, snaps := book("big", reqs, true)
	require.NotEmpty(t, booked)
	sentBefore := len(s.sent) - len(booked)
	k := max(0, len(booked)-refunds)
	for j := len(booked) - 1; j >= k; j-- {
		b := bs[booked[j]]
		if j%7 == 0 {
			require.NoError(t, p.flush(ctx))
		}
		given, err := eng.RefundAll(ctx, s.keys, s.limits, b)
		require.NoError(t, err, "refund %d", j)
		s.o.b = append([]raBucket(nil), snaps[j]...)
		s.stored(t, p, "after refund "+strconv.Itoa(j))
		require.Positive(t, given[0], "refund %d of a slot ahead gave nothing", j)
		// A retry gives nothing and writes nothing.
		again, err := eng.RefundAll(ctx, s.keys, s.limits, b)
		require.NoError(t, err)
		for _, g := range again {
			require.Zero(t, g, "refund %d retried gave again", j)
		}
		s.stored(t, p, "after refund "+strconv.Itoa(j)+" retried")
	}
	s.sent = s.sent[:sentBefore+k]

	// The room given back is booked again, exactly as the oracle says.
	book("after refunds", raMixed(rng, 25, maxN, true), true)

	// State reads what GET reads.
	require.NoError(t, p.flush(ctx))
	st, err := eng.State(ctx, s.keys, s.limits)
	require.NoError(t, err)
	for i := range s.keys {
		require.True(t, st.Keys[i].Exists)
		require.Equal(t, s.o.emptyAt(i), st.Keys[i].TAT.UnixMicro(), "State of key %d", i)
	}

	// Allow: the same decision as a booking with no wait.
	require.NoError(t, p.flush(ctx))
	if m == 1 {
		res, err := eng.AllowN(ctx, s.keys[0], s.limits[0], 1)
		require.NoError(t, err)
		require.False(t, res.Allowed, "Allow passed with a backlog")
		require.Positive(t, res.RetryAfter)
	} else {
		res, err := eng.AllowAll(ctx, s.keys, s.limits, 1)
		require.NoError(t, err)
		require.False(t, res.Allowed, "AllowAll passed with a backlog")
	}
	s.stored(t, p, "after a refused Allow")

	// Block: no slot before now + d; the oracle takes the pushed key as
	// read.
	require.NoError(t, p.flush(ctx))
	require.NoError(t, eng.BlockAll(ctx, s.keys, s.limits, time.Hour))
	st, err = eng.State(ctx, s.keys, s.limits)
	require.NoError(t, err)
	for i := range s.keys {
		s.o.seed(i, st.Now.UnixMicro(), st.Keys[i].TAT.UnixMicro())
	}
	bs, _, _ = book("after block", []throttle.Request{{N: 1, MaxWait: throttle.Forever}, {N: 2, MaxWait: throttle.Forever}}, true)
	require.GreaterOrEqual(t, bs[0].Wait, time.Hour-time.Second, "a slot inside the pause")

	// BookRetry: book.lua with the retry index, one run of one.
	require.NoError(t, p.flush(ctx))
	rb, err := eng.BookRetry(ctx, s.keys, s.limits, throttle.Request{N: 1, MaxWait: throttle.Forever},
		throttle.RetryIndex{Key: tag + ":retries", Member: "task-1", KeepFrom: time.Second, Window: time.Hour, MaxDue: 10})
	require.NoError(t, err)
	require.True(t, rb.OK)
	require.True(t, rb.Recorded)
	s.check(t, "book retry", []throttle.Request{{N: 1, MaxWait: throttle.Forever}}, []throttle.Booking{rb.Booking})
	s.stored(t, p, "after BookRetry")
	// Given back: the keys go back to before it.
	given, err := eng.RefundAll(ctx, s.keys, s.limits, rb.Booking)
	require.NoError(t, err)
	require.Positive(t, given[0])

	// Nothing that stands ran early, under any limit. (The pause only
	// delays; refunded bookings are out of s.sent, the BookRetry one too.)
	s.sent = s.sent[:len(s.sent)-1]
	for i := range s.limits {
		raConforms(t, p.name+" limit "+strconv.Itoa(i), raOf(s.limits[i]), s.sent)
	}

	// Reset: the subject is idle again.
	require.NoError(t, p.flush(ctx))
	require.NoError(t, eng.Reset(ctx, s.keys...))
	for _, k := range s.keys {
		require.ErrorIs(t, p.get(ctx, raPrefix(t)+k).Err(), redis.Nil)
	}
	b, err := eng.Book(ctx, s.keys[0], s.limits[0], throttle.Request{N: maxN, MaxWait: 0})
	require.NoError(t, err)
	require.True(t, b.OK)
	require.Zero(t, b.Wait)
}

// TestReviewArgsEveryOpEveryPath: every operation, on one, two and three
// limits, through a Client, a Scripter-only client, a client with 40 ms
// in a go-redis hook, a client 40 ms away behind a TCP proxy (and
// Scripter-only), and a Cluster (and Scripter-only), with SCRIPT FLUSH
// before most calls; every reply and every stored key against the leaky
// bucket.
func TestReviewArgsEveryOpEveryPath(t *testing.T) {
	for _, p := range raPaths(t, true) {
		t.Run(p.name, func(t *testing.T) {
			refunds, big := 200, throttle.MaxBatch // a refund is a call: 200 keep the package's time down
			if p.name != "client" && p.name != "scripterOnly" && p.name != "cluster" {
				refunds, big = 12, 200 // 40 ms a call
			} else if p.name != "client" {
				refunds = 60
			}
			for m := 1; m <= 3; m++ {
				raScenario(t, p, m, refunds, big)
			}
		})
	}
}

// TestReviewArgsRestart: after a restart (scripts and keys gone), a batch
// in runs under three limits, through a Client and a Scripter-only client,
// books as the oracle says; and a refund of a booking made before the
// restart gives nothing and writes only its tombstone.
func TestReviewArgsRestart(t *testing.T) {
	srv := redistest.Start(t)
	rdb := srv.Client(t)
	ctx := context.Background()
	limits := []throttle.Limit{throttle.PerMinute(60, 3), throttle.Every(time.Hour, 100, 7), throttle.PerDay(1000, 5)}
	rng := rand.New(rand.NewPCG(3, 4))
	for _, name := range []string{"client", "scripterOnly"} {
		var sc redis.Scripter = rdb
		if name == "scripterOnly" {
			sc = raScripterOnly{rdb}
		}
		p := raPath{name: name, rdb: sc, get: rdb.Get}
		eng, err := throttle.New(sc, throttle.WithPrefix(raPrefix(t)), throttle.WithTimeout(5*time.Second))
		require.NoError(t, err)
		s := &raSubject{limits: limits, keys: []string{"{rs-" + name + "}:a", "{rs-" + name + "}:b", "{rs-" + name + "}:c"}}
		s.o = newRAOracle(limits)
		reqs := raMixed(rng, 60, 4, true)
		bs, err := eng.BookAll(ctx, s.keys, limits, reqs)
		require.NoError(t, err)
		s.check(t, name+" before restart", reqs, bs)
		var last throttle.Booking
		for _, b := range bs {
			if b.OK {
				last = b
			}
		}

		srv.Restart(t)
		s.o = newRAOracle(limits) // the keys are gone
		s.sent = nil
		// The first call may find its pooled connection dead, before
		// anything was sent: try again then, never after a lost reply.
		for try := 0; ; try++ {
			reqs = raMixed(rng, 80, 4, false)
			bs, err = eng.BookAll(ctx, s.keys, limits, reqs)
			if err == nil || try == 3 || errors.Is(err, throttle.ErrReplyLost) || !errors.Is(err, throttle.ErrUnavailable) {
				break
			}
		}
		require.NoError(t, err)
		s.check(t, name+" after restart", reqs, bs)
		s.stored(t, p, name+" after restart")
		// book1.lua after the restart, on a key of its own.
		solo := &raSubject{limits: limits[:1], keys: []string{"{rs-" + name + "}:solo"}, o: newRAOracle(limits[:1])}
		for i := 0; i < 3; i++ {
			r := throttle.Request{N: 1 + i, MaxWait: throttle.Forever}
			one, err := eng.Book(ctx, solo.keys[0], limits[0], r)
			require.NoError(t, err)
			solo.check(t, name+" book1 after restart", []throttle.Request{r}, []throttle.Booking{one})
			solo.stored(t, p, name+" book1 after restart")
		}
		// The booking from before the restart: its keys hold other
		// bookings' ends, so nothing is given back.
		before := make([]string, 3)
		for i, k := range s.keys {
			before[i] = rdb.Get(ctx, raPrefix(t)+k).Val()
		}
		given, err := eng.RefundAll(ctx, s.keys, limits, last)
		require.NoError(t, err)
		for i, g := range given {
			require.Zero(t, g, "limit %d: a refund across a restart gave back", i)
			require.Equal(t, before[i], rdb.Get(ctx, raPrefix(t)+s.keys[i]).Val())
		}
	}
}

// TestReviewArgsLostReply: a batch in runs whose reply is lost (the proxy
// holds it past the engine's timeout) reports ErrReplyLost and has booked
// exactly once (on an explicit clock, the keys hold the oracle's TATs
// after one such batch); a refund whose reply is lost, retried, has given
// back once, whether the lost call ran (its script loaded) or not (its
// EVALSHA answered NOSCRIPT, late: the EVAL never went).
func TestReviewArgsLostReply(t *testing.T) {
	srv := redistest.Start(t)
	rdb := srv.Client(t)
	bg := context.Background()
	proxy := redistest.NewProxy(t, srv.Addr)
	far := proxy.Client(t, srv)
	limits := []throttle.Limit{throttle.PerMinute(6, 3), throttle.PerDay(1000, 5)} // 10 s apart
	reqs := []throttle.Request{{N: 1, MaxWait: throttle.Forever}, {N: 1, MaxWait: throttle.Forever}, {N: 2, MaxWait: throttle.Forever},
		{N: 4, MaxWait: 0}, {N: 1, MaxWait: throttle.Forever}, {N: 1, MaxWait: throttle.Forever}, {N: 3, MaxWait: time.Minute}, {N: 1, MaxWait: throttle.Forever}}
	for _, name := range []string{"client", "scripterOnly"} {
		var sc redis.Scripter = far
		if name == "scripterOnly" {
			sc = raScripterOnly{far}
		}
		eng, err := throttle.New(sc, throttle.WithPrefix(raPrefix(t)), throttle.WithTimeout(300*time.Millisecond))
		require.NoError(t, err)
		p := raPath{name: name, rdb: sc, get: rdb.Get}
		retry := func(f func() error) {
			var err error
			for try := 0; try < 40; try++ { // the breaker may be open a while
				if err = f(); err == nil {
					return
				}
				time.Sleep(100 * time.Millisecond)
			}
			require.NoError(t, err)
		}
		for _, warm := range []bool{false, true} {
			require.NoError(t, rdb.ScriptFlush(bg).Err())
			what := name + " warm=" + strconv.FormatBool(warm)
			tag := "{lr-" + name + strconv.FormatBool(warm) + "}"
			s := &raSubject{limits: limits, keys: []string{tag + ":a", tag + ":b"}, o: newRAOracle(limits)}

			// The batch, its reply lost, on an explicit clock.
			now := time.Now().UnixMicro()
			ctx := testhook.WithNow(bg, now)
			if warm {
				// Both scripts loaded: book and refund.
				retry(func() error {
					wb, err := eng.BookAll(ctx, []string{tag + ":warm", tag + ":warm2"}, limits, reqs[:2])
					if err == nil {
						_, err = eng.RefundAll(ctx, []string{tag + ":warm", tag + ":warm2"}, limits, wb[1])
					}
					return err
				})
			}
			require.NoError(t, far.Ping(bg).Err()) // a connection ready: the call is sent
			proxy.SetReplyDelay(time.Second)
			_, err := eng.BookAll(ctx, s.keys, limits, reqs)
			require.ErrorIs(t, err, throttle.ErrReplyLost, what)
			time.Sleep(1200 * time.Millisecond) // the reply drains
			proxy.SetReplyDelay(0)
			for _, r := range reqs {
				if t0 := s.o.earliest(now, r.N); t0-now <= int64(min(r.MaxWait, throttle.MaxHorizon)/time.Microsecond) {
					s.o.take(t0, r.N)
				}
			}
			if warm {
				s.stored(t, p, what+": the lost batch booked once")
			} else {
				// NOSCRIPT came back late: nothing ran.
				for _, k := range s.keys {
					require.ErrorIs(t, rdb.Get(bg, raPrefix(t)+k).Err(), redis.Nil, what)
				}
				s.o = newRAOracle(limits)
			}

			// Now on Redis's clock: a batch, and its last booking given
			// back with the reply lost.
			var bs []throttle.Booking
			retry(func() error { var err error; bs, err = eng.BookAll(bg, s.keys, limits, reqs); return err })
			_, snaps := s.check(t, what+" second batch", reqs, bs)
			s.stored(t, p, what+" second batch")
			last := bs[len(bs)-1]
			require.True(t, last.OK)
			require.Greater(t, last.Wait, 5*time.Second, "the slot refunded must stay ahead")
			s.o.b = snaps[len(snaps)-1] // the keys before the last booking
			want := make([]string, 2)
			for i := range want {
				want[i] = strconv.FormatInt(s.o.emptyAt(i), 10)
			}
			if !warm {
				require.NoError(t, rdb.ScriptFlush(bg).Err())
			}
			require.NoError(t, far.Ping(bg).Err())
			proxy.SetReplyDelay(time.Second)
			_, err = eng.RefundAll(bg, s.keys, limits, last)
			require.ErrorIs(t, err, throttle.ErrReplyLost, what)
			time.Sleep(1200 * time.Millisecond)
			proxy.SetReplyDelay(0)
			var given []time.Duration
			retry(func() error { var err error; given, err = eng.RefundAll(bg, s.keys, limits, last); return err })
			if warm {
				for _, g := range given {
					require.Zero(t, g, "%s: a refund retried after a lost reply gave again", what)
				}
			} else {
				require.Positive(t, given[0], "%s: the refund never ran and its retry gave nothing", what)
			}
			for i, k := range s.keys {
				require.Equal(t, want[i], rdb.Get(bg, raPrefix(t)+k).Val(), "%s: key %s not given back exactly once", what, k)
			}
		}
	}
}

// TestReviewArgsCancelInFlight: callers that give up while their call is
// 40 ms away: a call that reports nothing sent (no ErrReplyLost) has
// written nothing; one that reports ErrReplyLost may have booked, and the
// keys then hold exactly what one more batch would leave.
func TestReviewArgsCancelInFlight(t *testing.T) {
	srv := redistest.Start(t)
	rdb := srv.Client(t)
	proxy := redistest.NewProxy(t, srv.Addr)
	proxy.SetLatency(20 * time.Millisecond)
	far := proxy.Client(t, srv)
	slow := srv.Client(t)
	slow.AddHook(raSlowHook{d: 40 * time.Millisecond})
	limits := []throttle.Limit{throttle.PerMinute(60, 3), throttle.PerDay(1000, 5)}
	reqs := []throttle.Request{{N: 1, MaxWait: throttle.Forever}, {N: 2, MaxWait: 0}, {N: 1, MaxWait: throttle.Forever}, {N: 1, MaxWait: throttle.Forever}}
	bg := context.Background()
	for _, c := range []struct {
		name string
		rdb  redis.Scripter
	}{{"proxy", far}, {"proxyScripterOnly", raScripterOnly{far}}, {"hook", slow}, {"hookScripterOnly", raScripterOnly{slow}}} {
		eng, err := throttle.New(c.rdb, throttle.WithPrefix(raPrefix(t)), throttle.WithTimeout(5*time.Second))
		require.NoError(t, err)
		var lost, notSent int
		for round := 0; round < 12; round++ {
			keys := []string{"{cf-" + c.name + strconv.Itoa(round) + "}:a", "{cf-" + c.name + strconv.Itoa(round) + "}:b"}
			if round%3 == 0 {
				require.NoError(t, rdb.ScriptFlush(bg).Err())
			}
			require.NoError(t, far.Ping(bg).Err()) // connections ready: the cancel hits the call
			require.NoError(t, slow.Ping(bg).Err())
			d := time.Duration(5+round*6) * time.Millisecond
			ctx, cancel := context.WithCancel(bg)
			if round%2 == 0 {
				ctx, cancel = context.WithTimeout(bg, d) // the socket's deadline too
			} else {
				time.AfterFunc(d, cancel)
			}
			_, err := eng.BookAll(ctx, keys, limits, reqs)
			cancel()
			time.Sleep(150 * time.Millisecond) // whatever was sent has run
			vals := make([]string, 2)
			for i, k := range keys {
				vals[i] = rdb.Get(bg, raPrefix(t)+k).Val()
			}
			switch {
			case err == nil:
			case errors.Is(err, throttle.ErrReplyLost):
				lost++
			default:
				require.True(t, errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded), "%s: %v", c.name, err)
				notSent++
				require.Equal(t, []string{"", ""}, vals, "%s round %d: a call reported not sent (%v) wrote", c.name, round, err)
				continue
			}
			if vals[0] == "" {
				require.True(t, errors.Is(err, throttle.ErrReplyLost), "%s round %d: no error, nothing booked", c.name, round)
				continue
			}
			// Booked once: the keys stand apart as one batch leaves them,
			// whatever its decision time.
			o := newRAOracle(limits)
			for _, r := range reqs {
				if t0 := o.earliest(0, r.N); t0 <= int64(min(r.MaxWait, throttle.MaxHorizon)/time.Microsecond) {
					o.take(t0, r.N)
				}
			}
			v0, _ := strconv.ParseInt(vals[0], 10, 64)
			v1, _ := strconv.ParseInt(vals[1], 10, 64)
			require.Equal(t, o.emptyAt(1)-o.emptyAt(0), v1-v0, "%s round %d: the keys were not booked exactly once (%v)", c.name, round, err)
		}
		t.Logf("%s: %d lost, %d not sent of 12", c.name, lost, notSent)
	}
}

// TestReviewArgsRunScriptEcho: a script that echoes its KEYS and ARGV, run
// with RunScript (as package lease runs its scripts) through every path,
// after SCRIPT FLUSH before each call: 1 to 17 keys, 0 to 9 arguments of
// mixed types. The head of the argument list (command, script, key count,
// keys) never overlaps the script's arguments, on EVALSHA and on the EVAL
// fallback alike.
func TestReviewArgsRunScriptEcho(t *testing.T) {
	echo := throttle.NewScript(`
local out = {#KEYS}
for i = 1, #KEYS do out[#out + 1] = KEYS[i] end
out[#out + 1] = #ARGV
for i = 1, #ARGV do out[#out + 1] = ARGV[i] end
return out`)
	ctx := context.Background()
	for _, p := range raPaths(t, true) {
		t.Run(p.name, func(t *testing.T) {
			prefix := raPrefix(t)
			eng, err := throttle.New(p.rdb, throttle.WithPrefix(prefix), throttle.WithTimeout(5*time.Second))
			require.NoError(t, err)
			for _, nk := range []int{1, 2, 8, 17} {
				for _, na := range []int{0, 1, 2, 9} {
					keys := make([]string, nk)
					for i := range keys {
						keys[i] = "{echo}:" + strconv.Itoa(i)
					}
					args := make([]any, na)
					want := []any{int64(nk)}
					for _, k := range keys {
						want = append(want, prefix+k)
					}
					want = append(want, int64(na))
					for i := range args {
						switch i % 3 {
						case 0:
							args[i] = i * 7
							want = append(want, strconv.Itoa(i*7))
						case 1:
							args[i] = "a" + strconv.Itoa(i)
							want = append(want, "a"+strconv.Itoa(i))
						default:
							args[i] = int64(-i)
							want = append(want, strconv.Itoa(-i))
						}
					}
					require.NoError(t, p.flush(ctx))
					got, err := eng.RunScript(ctx, echo, keys, args...)
					require.NoError(t, err, "%d keys %d args", nk, na)
					require.Equal(t, want, got, "%d keys %d args after SCRIPT FLUSH", nk, na)
					got, err = eng.RunScript(ctx, echo, keys, args...)
					require.NoError(t, err)
					require.Equal(t, want, got, "%d keys %d args, script loaded", nk, na)
				}
			}
		})
	}
}

// TestReviewArgsAllowMatchesBucket: AllowN and AllowAll (book1.lua and
// book.lua with one request and no wait) on an explicit clock through a
// Client, a Scripter-only client and a Cluster, the scripts flushed now
// and then: Allowed, RetryAfter, Remaining and ResetAfter against the
// leaky bucket (units that fit now: floor((tau - content) / I) + 1).
func TestReviewArgsAllowMatchesBucket(t *testing.T) {
	all := []throttle.Limit{throttle.PerSecond(10, 3), throttle.Every(time.Minute, 30, 5), throttle.Every(time.Hour, 200, 4)}
	for _, p := range raPaths(t, true) {
		if p.name != "client" && p.name != "scripterOnly" && p.name != "cluster" && p.name != "clusterScripterOnly" {
			continue
		}
		t.Run(p.name, func(t *testing.T) {
			eng, err := throttle.New(p.rdb, throttle.WithPrefix(raPrefix(t)), throttle.WithTimeout(5*time.Second))
			require.NoError(t, err)
			rng := rand.New(rand.NewPCG(5, 6))
			for m := 1; m <= 3; m++ {
				ls := all[:m]
				keys := make([]string, m)
				for i := range keys {
					keys[i] = "{allow" + strconv.Itoa(m) + "}:" + strconv.Itoa(i)
				}
				o := newRAOracle(ls)
				now := time.Now().UnixMicro()
				for step := 0; step < 120; step++ {
					now += rng.Int64N(150_000)
					n := 1 + rng.IntN(4)
					if step%17 == 0 {
						require.NoError(t, p.flush(context.Background()))
					}
					ctx := testhook.WithNow(context.Background(), now)
					var res throttle.Result
					if m == 1 {
						res, err = eng.AllowN(ctx, keys[0], ls[0], n)
					} else {
						res, err = eng.AllowAll(ctx, keys, ls, n)
					}
					require.NoError(t, err)
					slot := o.earliest(now, n)
					ok := slot == now
					require.Equal(t, ok, res.Allowed, "m %d step %d n %d", m, step, n)
					if ok {
						o.take(now, n)
						require.Zero(t, res.RetryAfter)
					} else {
						require.Equal(t, slot-now, res.RetryAfter.Microseconds(), "m %d step %d: retry-after", m, step)
					}
					remaining, reset := 1<<30, int64(0)
					for i, l := range o.ls {
						c := o.content(i, now)
						remaining = min(remaining, int(min(max(0, floorDivR(l.tau-c, l.I)+1), l.tau/l.I+1)))
						reset = max(reset, c)
					}
					require.Equal(t, remaining, res.Remaining, "m %d step %d: remaining", m, step)
					require.Equal(t, reset, res.ResetAfter.Microseconds(), "m %d step %d: reset after", m, step)
				}
			}
		})
	}
}

func floorDivR(a, b int64) int64 {
	if a >= 0 {
		return a / b
	}
	return -((-a + b - 1) / b)
}

// TestReviewArgsMaxLimitsMaxBatch: the longest argument list the engine
// builds, MaxLimits limits and MaxBatch requests in runs and runs of one,
// through a Scripter-only client, a client 40 ms away and a Cluster, each
// after SCRIPT FLUSH; every reply against the leaky bucket, every key
// against GET, then the last 20 bookings given back latest first.
func TestReviewArgsMaxLimitsMaxBatch(t *testing.T) {
	ls := []throttle.Limit{
		throttle.PerSecond(1000, 3), throttle.Every(time.Minute, 7000, 2), throttle.Every(time.Second, 300, 5),
		throttle.Every(3*time.Second, 1100, 4), throttle.Every(time.Hour, 100000, 6), throttle.Every(7*time.Second, 900, 3),
		throttle.Every(5*time.Second, 1300, 8), throttle.Every(2*time.Second, 1700, 2),
	}
	require.Len(t, ls, throttle.MaxLimits)
	for _, p := range raPaths(t, true) {
		if p.name == "client" || p.name == "hook40ms" {
			continue
		}
		t.Run(p.name, func(t *testing.T) {
			ctx := context.Background()
			eng, err := throttle.New(p.rdb, throttle.WithPrefix(raPrefix(t)), throttle.WithTimeout(10*time.Second))
			require.NoError(t, err)
			s := &raSubject{limits: ls, o: newRAOracle(ls)}
			for i := range ls {
				s.keys = append(s.keys, "{max}:"+strconv.Itoa(i))
			}
			rng := rand.New(rand.NewPCG(8, 8))
			for call, alt := range []bool{true, false} {
				reqs := raMixed(rng, throttle.MaxBatch, 3, alt)
				require.NoError(t, p.flush(ctx))
				bs, err := eng.BookAll(ctx, s.keys, ls, reqs)
				require.NoError(t, err)
				booked, snaps := s.check(t, "call "+strconv.Itoa(call), reqs, bs)
				s.stored(t, p, "call "+strconv.Itoa(call))
				for j := len(booked) - 1; j >= len(booked)-20; j-- {
					if j%4 == 0 {
						require.NoError(t, p.flush(ctx))
					}
					_, err := eng.RefundAll(ctx, s.keys, ls, bs[booked[j]])
					require.NoError(t, err)
					s.o.b = append([]raBucket(nil), snaps[j]...)
					s.stored(t, p, "refund "+strconv.Itoa(j))
				}
				s.sent = s.sent[:len(s.sent)-20]
			}
			for i, l := range ls {
				raConforms(t, p.name+" limit "+strconv.Itoa(i), raOf(l), s.sent)
			}
		})
	}
}
