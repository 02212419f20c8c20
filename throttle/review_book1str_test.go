package throttle_test

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/slotbook/slotbook/internal/redistest"
	"github.com/slotbook/slotbook/internal/testhook"
	"github.com/slotbook/slotbook/throttle"
)

// Review of wire protocol 2's book1.lua (one string reply, the wait worked
// out by the client): every booking of one request on one key goes through
// book1.lua, every BookBatch of two or more requests through book.lua.
// The oracle is a GCRA written here, cell by cell (virtual scheduling):
// it does not share the engine's arithmetic.

// rvInterval is ceil(Period / Rate) in whole microseconds, computed in
// one division (ceil(ceil(x)/k) = ceil(x/k)).
func rvInterval(l throttle.Limit) int64 {
	d := int64(l.Rate) * 1000
	return (l.Period.Nanoseconds() + d - 1) / d
}

// rvGCRA is a textbook GCRA over one key: tat is the theoretical arrival
// time of the next cell, or absent.
type rvGCRA struct {
	I, tau int64
	tat    int64
	has    bool
}

func newRV(l throttle.Limit) *rvGCRA {
	I := rvInterval(l)
	return &rvGCRA{I: I, tau: I * int64(l.Burst)}
}

// decide judges n cells at now: each cell j conforms from
// tat_j - tau, where tat_0 = max(tat, now) and tat_{j+1} = max(tat_j, t) + I;
// the request's slot t is the earliest time at or after now at which all
// n cells conform, found by stepping the cells one at a time.
func (g *rvGCRA) decide(now int64, n int, maxWait int64) (ok bool, wait, start, end int64) {
	start = now
	if g.has && g.tat > now {
		start = start + (g.tat - now)
	}
	t := now
	theo := start
	for j := 0; j < n; j++ {
		if earliest := theo - g.tau; earliest > t {
			t = earliest
		}
		theo += g.I
	}
	wait = t - now
	if wait > maxWait {
		return false, wait, start, start
	}
	end = start
	if t > end {
		end = t
	}
	end += int64(n) * g.I
	g.tat, g.has = end, true
	return true, wait, start, end
}

func rvMaxWait(d time.Duration) int64 {
	if d > throttle.MaxHorizon {
		d = throttle.MaxHorizon
	}
	return int64(d / time.Microsecond)
}

func rvEngine(t *testing.T, rdb *redis.Client) (*throttle.Engine, string) {
	t.Helper()
	prefix := redistest.Prefix(t)
	eng, err := throttle.New(rdb, throttle.WithPrefix(prefix), throttle.WithTimeout(5*time.Second))
	require.NoError(t, err)
	return eng, prefix
}

// TestReviewBook1StrEdgesTestClock: at an explicit clock, every edge of
// book1's reply: idle keys, a TAT just passed (now-1), equal to now, just
// ahead (now+1), ahead by up to tau+3I; n from 1 to burst+1; max waits of
// 0, the exact wait, a microsecond short or over, a fraction of a
// microsecond, the horizon and Forever. Each booking matches the textbook
// exactly (OK, Wait, At), what Redis holds after it matches, a refusal
// writes nothing (the value kept byte for byte), and the same request
// judged by book.lua (BookAll with an idle second key) decides the same;
// refunding each booking gives back exactly its room on both paths.
func TestReviewBook1StrEdgesTestClock(t *testing.T) {
	t.Parallel()
	srv := redistest.Shared(t)
	rdb := srv.Client(t)
	eng, prefix := rvEngine(t, rdb)
	bg := context.Background()
	limits := []throttle.Limit{
		throttle.PerSecond(10, 3),
		throttle.Every(time.Second, 3, 0), // I = 333334
		throttle.Every(7*time.Second, 9, 5),
		throttle.PerSecond(1000000, 2), // I = 1
	}
	// An idle key under a limit that never binds: BookAll with it runs
	// book.lua for the same decision on the first key.
	loose := throttle.Every(time.Millisecond, 1, 1000)
	rng := rand.New(rand.NewPCG(3, 11))
	base := time.Now().UnixMicro()
	cases := 0
	for round := 0; round < 400; round++ {
		l := limits[round%len(limits)]
		g := newRV(l)
		now := base + int64(round)*10_000_000
		ctx := testhook.WithNow(bg, now)
		var stored string // "" = absent
		switch rng.IntN(6) {
		case 0:
		case 1:
			stored = strconv.FormatInt(now-1, 10)
		case 2:
			stored = strconv.FormatInt(now, 10)
		case 3:
			stored = strconv.FormatInt(now+1, 10)
		default:
			stored = strconv.FormatInt(now+rng.Int64N(g.tau+3*g.I+1), 10)
		}
		if stored != "" {
			v, _ := strconv.ParseInt(stored, 10, 64)
			g.tat, g.has = v, true
		}
		n := 1 + rng.IntN(l.Burst+1)
		// The exact wait, from a copy of the model.
		probe := *g
		_, exact, _, _ := probe.decide(now, n, 1<<62)
		var mw time.Duration
		switch rng.IntN(8) {
		case 0:
			mw = 0
		case 1:
			mw = time.Duration(exact) * time.Microsecond
		case 2:
			mw = time.Duration(exact-1) * time.Microsecond
		case 3:
			mw = time.Duration(exact+1) * time.Microsecond
		case 4:
			mw = time.Duration(exact)*time.Microsecond + 999 // rounded down
		case 5:
			mw = time.Duration(exact)*time.Microsecond - 1
		case 6:
			mw = throttle.Forever
		default:
			mw = throttle.MaxHorizon
		}
		if mw < 0 {
			mw = 0
		}
		req := throttle.Request{N: n, MaxWait: mw}
		k1 := fmt.Sprintf("{e%d}:one", round)
		k2 := fmt.Sprintf("{e%d}:many", round)
		kl := fmt.Sprintf("{e%d}:loose", round)
		for _, k := range []string{k1, k2} {
			if stored != "" {
				require.NoError(t, rdb.Set(bg, prefix+k, stored, time.Hour).Err())
			}
		}
		ok, wait, start, end := g.decide(now, n, rvMaxWait(mw))
		what := fmt.Sprintf("round %d: %v, stored %q (now %+d), n %d, max wait %v", round, l, stored, func() int64 {
			if stored == "" {
				return 0
			}
			v, _ := strconv.ParseInt(stored, 10, 64)
			return v - now
		}(), n, mw)

		b, err := eng.Book(ctx, k1, l, req)
		require.NoError(t, err, what)
		require.Equal(t, ok, b.OK, what)
		require.Equal(t, time.Duration(wait)*time.Microsecond, b.Wait, what)
		require.Equal(t, now+wait, b.At.UnixMicro(), what)
		require.Equal(t, n, b.N, what)

		bs, err := eng.BookAll(ctx, []string{k2, kl}, []throttle.Limit{l, loose}, []throttle.Request{req})
		require.NoError(t, err, what)
		require.Equal(t, b.OK, bs[0].OK, "book.lua decides as book1.lua: "+what)
		require.Equal(t, b.Wait, bs[0].Wait, "book.lua decides as book1.lua: "+what)
		require.Equal(t, b.At, bs[0].At, "book.lua decides as book1.lua: "+what)

		for _, k := range []string{k1, k2} {
			got, err := rdb.Get(bg, prefix+k).Result()
			if ok {
				require.NoError(t, err, what)
				require.Equal(t, strconv.FormatInt(end, 10), got, "%s: %s after booking", what, k)
				// PX: until the TAT has passed, rounded up to a ms, plus 1 ms,
				// plus the explicit clock's hour.
				px := (end-now+999)/1000 + 1 + 3_600_000
				ttl, err := rdb.PTTL(bg, prefix+k).Result()
				require.NoError(t, err)
				require.LessOrEqual(t, ttl, time.Duration(px)*time.Millisecond, "%s: %s's time to live", what, k)
				require.Greater(t, ttl, time.Duration(px)*time.Millisecond-2*time.Second, "%s: %s's time to live", what, k)
			} else if stored == "" {
				require.ErrorIs(t, err, redis.Nil, "%s: refused on an idle key, yet written", what)
			} else {
				require.NoError(t, err, what)
				require.Equal(t, stored, got, "%s: %s written by a refusal", what, k)
			}
		}
		if ok {
			given, err := eng.Refund(ctx, k1, l, b)
			require.NoError(t, err, what)
			given2, err := eng.RefundAll(ctx, []string{k2, kl}, []throttle.Limit{l, loose}, bs[0])
			require.NoError(t, err, what)
			if wait > 0 { // a slot still to come gives back
				require.Equal(t, time.Duration(end-start)*time.Microsecond, given, "%s: refund of book1's booking", what)
			} else {
				require.Zero(t, given, "%s: a slot that has come gives nothing back", what)
			}
			require.Equal(t, given2[0], given, "%s: refund after book1 as after book", what)
			// Given back to exactly where the key stood (absent if that was now or before).
			v1, e1 := rdb.Get(bg, prefix+k1).Result()
			v2, e2 := rdb.Get(bg, prefix+k2).Result()
			require.Equal(t, e2, e1, what)
			require.Equal(t, v2, v1, what)
			if given > 0 && start > now {
				require.Equal(t, strconv.FormatInt(start, 10), v1, what)
			}
			// Twice: nothing more.
			again, err := eng.Refund(ctx, k1, l, b)
			require.NoError(t, err, what)
			require.Zero(t, again, "%s: second refund", what)
		}
		cases++
	}
	t.Logf("%d cases", cases)
}

// TestReviewBook1StrAllowNRetryAfter: AllowN (book1.lua with max wait 0)
// at an explicit clock: Allowed, RetryAfter, Remaining and ResetAfter as
// the textbook has them, on TATs just passed, equal to now and just ahead.
func TestReviewBook1StrAllowNRetryAfter(t *testing.T) {
	t.Parallel()
	srv := redistest.Shared(t)
	rdb := srv.Client(t)
	eng, prefix := rvEngine(t, rdb)
	bg := context.Background()
	l := throttle.PerSecond(10, 3) // I 100000, tau 300000
	base := time.Now().UnixMicro()
	for i, off := range []int64{-1, 0, 1, 99_999, 100_000, 100_001, 300_000, 300_001, 399_999, 400_000} {
		now := base + int64(i)*10_000_000
		for n := 1; n <= l.Burst+1; n++ {
			key := fmt.Sprintf("a%d:%d", i, n)
			v := strconv.FormatInt(now+off, 10)
			require.NoError(t, rdb.Set(bg, prefix+key, v, time.Hour).Err())
			g := newRV(l)
			g.tat, g.has = now+off, true
			ok, wait, start, end := g.decide(now, n, 0)
			r, err := eng.AllowN(testhook.WithNow(bg, now), key, l, n)
			require.NoError(t, err)
			what := fmt.Sprintf("TAT now%+d, n %d", off, n)
			require.Equal(t, ok, r.Allowed, what)
			if ok {
				require.Zero(t, r.RetryAfter, what)
			} else {
				require.Equal(t, time.Duration(wait)*time.Microsecond, r.RetryAfter, what)
				end = start
				got, err := rdb.Get(bg, prefix+key).Result()
				require.NoError(t, err)
				require.Equal(t, v, got, what+": refusal wrote")
			}
			// Units that would pass now: the largest k with k cells conforming at now.
			rem := 0
			for k := 1; k <= l.Burst+1; k++ {
				h := &rvGCRA{I: g.I, tau: g.tau, tat: end, has: true}
				if o, _, _, _ := h.decide(now, k, 0); o {
					rem = k
				}
			}
			require.Equal(t, rem, r.Remaining, what)
			require.Equal(t, time.Duration(max(0, end-now))*time.Microsecond, r.ResetAfter, what)
		}
	}
}

// TestReviewBook1StrRedisClockReplay: on the Redis clock, single bookings
// (book1.lua) mixed with batches (book.lua) on the same keys, replayed
// through the textbook at each reply's decision time (At - Wait): every
// decision and every stored TAT matches. A limit of one unit per
// microsecond keeps the key's TAT near the Redis clock (a round trip
// away); the exact edges (TAT = now-1, now, now+1) are
// TestReviewBook1StrEdgesTestClock's.
func TestReviewBook1StrRedisClockReplay(t *testing.T) {
	t.Parallel()
	srv := redistest.Shared(t)
	rdb := srv.Client(t)
	eng, prefix := rvEngine(t, rdb)
	ctx := context.Background()
	limits := []throttle.Limit{
		throttle.PerSecond(1000000, 0),  // I = 1
		throttle.PerSecond(1000000, 40), // I = 1, tau = 40
		throttle.PerSecond(20000, 3),    // I = 50
		throttle.PerSecond(10, 3),
		throttle.Every(time.Second, 3, 1),
	}
	rng := rand.New(rand.NewPCG(5, 8))
	near := 0
	for ki, l := range limits {
		key := fmt.Sprintf("r%d", ki)
		g := newRV(l)
		for call := 0; call < 120; call++ {
			size := 1
			if rng.IntN(4) == 0 {
				size = 2 + rng.IntN(3)
			}
			reqs := make([]throttle.Request, size)
			for i := range reqs {
				reqs[i].N = 1 + rng.IntN(l.Burst+1)
				switch rng.IntN(4) {
				case 0:
					reqs[i].MaxWait = 0
				case 1:
					reqs[i].MaxWait = time.Duration(rng.Int64N(int64(g.I*3+5))) * time.Microsecond
				case 2:
					reqs[i].MaxWait = throttle.Forever
				default:
					reqs[i].MaxWait = time.Duration(rng.Int64N(2000)) * time.Nanosecond
				}
			}
			before := g.tat
			var bs []throttle.Booking
			if size == 1 {
				b, err := eng.Book(ctx, key, l, reqs[0])
				require.NoError(t, err)
				bs = []throttle.Booking{b}
			} else {
				var err error
				bs, err = eng.BookBatch(ctx, key, l, reqs)
				require.NoError(t, err)
			}
			now := bs[0].At.UnixMicro() - bs[0].Wait.Microseconds()
			if g.has && before-now >= -1000 && before-now <= 1000 {
				near++
			}
			for i, b := range bs {
				ok, wait, _, _ := g.decide(now, reqs[i].N, rvMaxWait(reqs[i].MaxWait))
				what := fmt.Sprintf("%v call %d req %d/%d: n %d max wait %v, TAT was now%+d", l, call, i, size, reqs[i].N, reqs[i].MaxWait, before-now)
				require.Equal(t, ok, b.OK, what)
				require.Equal(t, wait, b.Wait.Microseconds(), what)
				require.Equal(t, now+wait, b.At.UnixMicro(), what)
			}
			if g.tat > now {
				v, err := rdb.Get(ctx, prefix+key).Int64()
				if errors.Is(err, redis.Nil) {
					// Expired: only once the TAT has passed (PX ends after it).
					ts, err := rdb.Time(ctx).Result()
					require.NoError(t, err)
					require.Greater(t, ts.UnixMicro(), g.tat, "%v call %d: key gone before its TAT passed", l, call)
				} else {
					require.NoError(t, err)
					require.Equal(t, g.tat, v, "%v call %d: stored TAT", l, call)
				}
			}
		}
	}
	t.Logf("%d calls found the TAT within 1 ms of the Redis clock (exact edges: TestReviewBook1StrEdgesTestClock)", near)
}

// TestReviewBook1StrHugeInterval: limits whose interval is decades long
// (valid: I*(burst+2) <= 2^52) book an idle key and then refuse with the
// exact wait, through book1.lua as through book.lua.
func TestReviewBook1StrHugeInterval(t *testing.T) {
	t.Parallel()
	srv := redistest.Shared(t)
	rdb := srv.Client(t)
	eng, _ := rvEngine(t, rdb)
	ctx := context.Background()
	for i, l := range []throttle.Limit{
		throttle.Every(60*365*24*time.Hour, 1, 0),
		throttle.Every(45*365*24*time.Hour, 1, 1),
		throttle.Every(400*24*time.Hour, 1, 0),
		throttle.Every(200*24*time.Hour, 1, 1),
	} {
		require.NoError(t, l.Validate())
		for _, batch := range []bool{false, true} {
			key := fmt.Sprintf("h%d:%v", i, batch)
			g := newRV(l)
			for call := 0; call < 3; call++ {
				reqs := []throttle.Request{{N: l.Burst + 1, MaxWait: throttle.Forever}}
				if call > 0 {
					reqs[0].N = 1
				}
				if batch {
					reqs = append(reqs, throttle.Request{N: 1, MaxWait: 0})
				}
				bs, err := eng.BookBatch(ctx, key, l, reqs)
				require.NoError(t, err, "%v batch %v call %d", l, batch, call)
				now := bs[0].At.UnixMicro() - bs[0].Wait.Microseconds()
				for j, b := range bs {
					ok, wait, _, _ := g.decide(now, reqs[j].N, rvMaxWait(reqs[j].MaxWait))
					require.Equal(t, ok, b.OK, "%v batch %v call %d req %d", l, batch, call, j)
					require.Equal(t, wait, b.Wait.Microseconds(), "%v batch %v call %d req %d", l, batch, call, j)
				}
			}
		}
	}
}

// rvErrText is an error's text with the key's name and Redis's note of
// where in the script cut out, for comparing two paths' errors.
var rvDigits = regexp.MustCompile(`TAT [0-9]+ microseconds`)

func rvErrText(err error, key string) string {
	if err == nil {
		return "<nil>"
	}
	s := strings.ReplaceAll(err.Error(), key, "KEY")
	if i := strings.Index(s, " script: "); i >= 0 {
		s = s[:i]
	}
	// How far ahead the TAT lay depends on the moment of each call.
	return rvDigits.ReplaceAllString(s, "N")
}

// TestReviewBook1StrCorruptLikeBook: odd stored values, on the Redis clock
// and at an explicit one (for values exactly at the horizon bound): book1
// (Book) answers as book.lua (BookBatch of two) does: the same error class
// naming the key, or the same decision; nothing is written on an error.
func TestReviewBook1StrCorruptLikeBook(t *testing.T) {
	t.Parallel()
	srv := redistest.Shared(t)
	rdb := srv.Client(t)
	eng, prefix := rvEngine(t, rdb)
	bg := context.Background()
	l := throttle.PerSecond(10, 3)
	I, tau := rvInterval(l), rvInterval(l)*int64(l.Burst)
	horizon := int64(throttle.MaxHorizon / time.Microsecond)
	now := time.Now().UnixMicro()
	type tc struct {
		value   string
		clock   bool // at the explicit now
		corrupt bool
	}
	cases := []tc{
		{value: "abc", corrupt: true},
		{value: "", corrupt: true},
		{value: " 1", corrupt: true},
		{value: "1 ", corrupt: true},
		{value: "+1", corrupt: true},
		{value: "-1", corrupt: true},
		{value: "1e15", corrupt: true},
		{value: "0x10", corrupt: true},
		{value: "1.5", corrupt: true},
		{value: "12\n", corrupt: true},
		{value: "0000000000000001"},
		{value: "0"},
		{value: "1"},
		{value: "00" + strconv.FormatInt(now, 10), corrupt: true}, // 18 digits
		{value: "0" + strconv.FormatInt(now, 10), corrupt: true},  // 17 digits
		{value: "9007199254740992", corrupt: true},                // 2^53: beyond the horizon
		{value: "9007199254740993", corrupt: true},
		{value: "9999999999999999", corrupt: true},
		{value: "99999999999999999", corrupt: true},
		{value: strconv.FormatInt(now+horizon+2*(tau+I), 10), clock: true},
		{value: strconv.FormatInt(now+horizon+2*(tau+I)+1, 10), clock: true, corrupt: true},
		{value: strconv.FormatInt(now+horizon, 10), clock: true},
		{value: strconv.FormatInt(now+horizon+tau, 10), clock: true},
		{value: strconv.FormatInt(now+horizon+tau+1, 10), clock: true},
		{value: strconv.FormatInt(now+horizon+2*(tau+I)+1, 10), corrupt: false}, // on the moving Redis clock: just inside once a µs passed
	}
	// A small explicit clock: leading zeros ahead of now.
	small := []tc{
		{value: "0000000000005000", clock: true},
		{value: "0000000000500000", clock: true},
		{value: "0000000000900000", clock: true},
	}
	run := func(i int, c tc, now int64) {
		ctx := bg
		if c.clock {
			ctx = testhook.WithNow(bg, now)
		}
		k1, k2 := fmt.Sprintf("c%d:one", i), fmt.Sprintf("c%d:many", i)
		for _, k := range []string{k1, k2} {
			require.NoError(t, rdb.Set(bg, prefix+k, c.value, time.Hour).Err())
		}
		for _, mw := range []time.Duration{0, throttle.Forever} {
			b, err1 := eng.Book(ctx, k1, l, throttle.Request{N: 1, MaxWait: mw})
			bs, err2 := eng.BookBatch(ctx, k2, l, []throttle.Request{{N: 1, MaxWait: mw}, {N: 1, MaxWait: 0}})
			what := fmt.Sprintf("value %q (clock %v), max wait %v", c.value, c.clock, mw)
			require.Equal(t, errors.Is(err2, throttle.ErrCorruptState), errors.Is(err1, throttle.ErrCorruptState), "%s: %v / %v", what, err1, err2)
			require.Equal(t, rvErrText(err2, k2), rvErrText(err1, k1), what)
			if c.corrupt && c.clock {
				require.ErrorIs(t, err1, throttle.ErrCorruptState, what)
			}
			if err1 != nil {
				require.Contains(t, err1.Error(), prefix+k1, what)
				for _, k := range []string{k1, k2} {
					got, err := rdb.Get(bg, prefix+k).Result()
					require.NoError(t, err)
					require.Equal(t, c.value, got, "%s: %s written", what, k)
				}
				continue
			}
			require.Equal(t, bs[0].OK, b.OK, what)
			if c.clock {
				require.Equal(t, bs[0].Wait, b.Wait, what)
			}
			if c.corrupt && !c.clock {
				// The moving-clock case may land either side; only agreement matters.
				continue
			}
		}
	}
	for i, c := range cases {
		run(i, c, now)
	}
	for i, c := range small {
		run(100+i, c, 1000)
	}

	// Wrong types: the same error from both, nothing written.
	for i, setup := range []func(k string) error{
		func(k string) error { return rdb.RPush(bg, k, "1767225600000000").Err() },
		func(k string) error { return rdb.HSet(bg, k, "f", "1").Err() },
		func(k string) error { return rdb.ZAdd(bg, k, redis.Z{Score: 1, Member: "x"}).Err() },
	} {
		k1, k2 := fmt.Sprintf("w%d:one", i), fmt.Sprintf("w%d:many", i)
		require.NoError(t, setup(prefix+k1))
		require.NoError(t, setup(prefix+k2))
		_, err1 := eng.Book(bg, k1, l, throttle.Request{N: 1, MaxWait: throttle.Forever})
		_, err2 := eng.BookBatch(bg, k2, l, []throttle.Request{{N: 1, MaxWait: throttle.Forever}, {N: 1}})
		require.Error(t, err1)
		require.Contains(t, err1.Error(), "WRONGTYPE")
		require.Equal(t, rvErrText(err2, k2), rvErrText(err1, k1))
		typ, err := rdb.Type(bg, prefix+k1).Result()
		require.NoError(t, err)
		require.NotEqual(t, "string", typ)
	}
}

// TestReviewBook1StrRefundIdentity: on the Redis clock, a booking made by
// book1 and given back at once restores the key exactly (absent if it was
// idle, its old TAT if that lay ahead); a second give-back gives nothing;
// a give-back after another booking on the key gives nothing and leaves
// that booking's TAT.
func TestReviewBook1StrRefundIdentity(t *testing.T) {
	t.Parallel()
	srv := redistest.Shared(t)
	rdb := srv.Client(t)
	eng, prefix := rvEngine(t, rdb)
	ctx := context.Background()
	l := throttle.PerSecond(1, 2) // I = 1 s
	I := rvInterval(l)

	// Idle key, slot now: a slot that has come gives nothing back.
	b0, err := eng.Book(ctx, "k", l, throttle.Request{N: 3, MaxWait: 0})
	require.NoError(t, err)
	require.True(t, b0.OK)
	// Next: a wait of an interval (key at now+3I, tau 2I).
	b1, err := eng.Book(ctx, "k", l, throttle.Request{N: 1, MaxWait: 2 * time.Second})
	require.NoError(t, err)
	require.True(t, b1.OK)
	now1 := b1.At.UnixMicro() - b1.Wait.Microseconds()
	start1 := b0.At.UnixMicro() + 3*I
	require.Equal(t, start1-2*I-now1, b1.Wait.Microseconds(), "b1's wait")
	given, err := eng.Refund(ctx, "k", l, b1)
	require.NoError(t, err)
	require.Equal(t, time.Duration(I)*time.Microsecond, given, "b1 given back in full")
	v, err := rdb.Get(ctx, prefix+"k").Int64()
	require.NoError(t, err)
	require.Equal(t, start1, v, "key back to its TAT before b1")
	given, err = eng.Refund(ctx, "k", l, b1)
	require.NoError(t, err)
	require.Zero(t, given, "second give-back")

	// Book b2, then b3 on top; b2's give-back gives nothing, b3's all.
	b2, err := eng.Book(ctx, "k", l, throttle.Request{N: 1, MaxWait: 5 * time.Second})
	require.NoError(t, err)
	b3, err := eng.Book(ctx, "k", l, throttle.Request{N: 2, MaxWait: 5 * time.Second})
	require.NoError(t, err)
	require.True(t, b2.OK && b3.OK)
	require.Equal(t, b2.At.Add(time.Duration(2*I)*time.Microsecond), b3.At, "b3 two intervals after b2 (n=2)")
	given, err = eng.Refund(ctx, "k", l, b2)
	require.NoError(t, err)
	require.Zero(t, given, "b2 under b3")
	v3, err := rdb.Get(ctx, prefix+"k").Int64()
	require.NoError(t, err)
	given, err = eng.Refund(ctx, "k", l, b3)
	require.NoError(t, err)
	require.Equal(t, time.Duration(2*I)*time.Microsecond, given)
	v, err = rdb.Get(ctx, prefix+"k").Int64()
	require.NoError(t, err)
	require.Equal(t, v3-2*I, v)
}

// TestReviewBook1StrFlushAndRestart: book1 after SCRIPT FLUSH (NOSCRIPT,
// then EVAL) and after a Redis restart books exactly once.
func TestReviewBook1StrFlushAndRestart(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	rdb := srv.Client(t)
	eng, prefix := rvEngine(t, rdb)
	ctx := context.Background()
	l := throttle.PerSecond(10, 0)
	I := rvInterval(l)
	require.NoError(t, eng.Load(ctx))
	for i := 0; i < 4; i++ {
		switch i {
		case 1:
			require.NoError(t, rdb.ScriptFlush(ctx).Err())
		case 2:
			srv.Restart(t)
			redistest.UntilOK(t, func() error { return rdb.Ping(ctx).Err() })
		}
		key := fmt.Sprintf("f%d", i)
		b, err := eng.Book(ctx, key, l, throttle.Request{N: 1, MaxWait: throttle.Forever})
		require.NoError(t, err, "step %d", i)
		require.True(t, b.OK)
		require.Zero(t, b.Wait)
		v, err := rdb.Get(ctx, prefix+key).Int64()
		require.NoError(t, err)
		require.Equal(t, b.At.UnixMicro()+I, v, "step %d: booked once", i)
		b2, err := eng.Book(ctx, key, l, throttle.Request{N: 1, MaxWait: throttle.Forever})
		require.NoError(t, err)
		require.Equal(t, b.At.Add(l.Interval()), b2.At, "step %d", i)
	}
}

// TestReviewBook1StrReplyLost: a book1 reply held past the engine's
// timeout is ErrReplyLost, and the booking stands in Redis.
func TestReviewBook1StrReplyLost(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	p := redistest.NewProxy(t, srv.Addr)
	rdb := p.Client(t, srv, func(o *redis.Options) { o.PoolSize = 1 })
	direct := srv.Client(t)
	prefix := redistest.Prefix(t)
	eng, err := throttle.New(rdb, throttle.WithPrefix(prefix), throttle.WithTimeout(200*time.Millisecond))
	require.NoError(t, err)
	ctx := context.Background()
	require.NoError(t, eng.Load(ctx))
	require.NoError(t, rdb.Ping(ctx).Err()) // the one connection is open: no handshake is held
	l := throttle.PerMinute(1, 0)           // the booking's key lives a minute
	p.SetReplyDelay(time.Second)
	_, err = eng.Book(ctx, "lost", l, throttle.Request{N: 1, MaxWait: throttle.Forever})
	require.ErrorIs(t, err, throttle.ErrReplyLost)
	n, err := direct.Exists(ctx, prefix+"lost").Result()
	require.NoError(t, err)
	require.EqualValues(t, 1, n, "the call ran")
}

// TestReviewBook1StrMergedMix: many goroutines on few keys through a pool
// of 2 connections (merged calls, bookmany.lua, beside book1.lua calls
// alone and book.lua batches): per key, the booked slots replayed in
// decision order through the textbook match exactly, and no refusal says
// less than its max wait.
func TestReviewBook1StrMergedMix(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	o := srv.Options()
	o.PoolSize = 2
	rdb := redis.NewClient(o)
	t.Cleanup(func() { _ = rdb.Close() })
	eng, prefix := rvEngine(t, rdb)
	ctx := context.Background()
	require.NoError(t, eng.Load(ctx))
	l := throttle.PerSecond(2000, 5) // I = 500
	const keys, workers, per = 4, 24, 40
	type rec struct {
		now, at int64
		ok      bool
		wait    int64
		mw      int64
	}
	var mu sync.Mutex
	recs := map[int][]rec{}
	var wg sync.WaitGroup
	for w := 0; w < workers; w++ {
		wg.Go(func() {
			rng := rand.New(rand.NewPCG(uint64(w), 99))
			for i := 0; i < per; i++ {
				k := rng.IntN(keys)
				mw := throttle.Forever
				if rng.IntN(3) == 0 {
					mw = time.Duration(rng.IntN(3000)) * time.Microsecond
				}
				var bs []throttle.Booking
				var err error
				if rng.IntN(6) == 0 {
					bs, err = eng.BookBatch(ctx, fmt.Sprint("m", k), l, []throttle.Request{{N: 1, MaxWait: mw}, {N: 1, MaxWait: mw}})
				} else {
					var b throttle.Booking
					b, err = eng.Book(ctx, fmt.Sprint("m", k), l, throttle.Request{N: 1, MaxWait: mw})
					bs = []throttle.Booking{b}
				}
				if err != nil {
					t.Errorf("book: %v", err)
					return
				}
				mu.Lock()
				for _, b := range bs {
					now := b.At.UnixMicro() - b.Wait.Microseconds()
					recs[k] = append(recs[k], rec{now: now, at: b.At.UnixMicro(), ok: b.OK, wait: b.Wait.Microseconds(), mw: rvMaxWait(mw)})
				}
				mu.Unlock()
			}
		})
	}
	wg.Wait()
	for k, rs := range recs {
		var booked []rec
		for _, r := range rs {
			if r.ok {
				require.LessOrEqual(t, r.wait, r.mw)
				booked = append(booked, r)
			} else {
				require.Greater(t, r.wait, r.mw, "refused within its max wait")
			}
		}
		sort.Slice(booked, func(i, j int) bool {
			if booked[i].now != booked[j].now {
				return booked[i].now < booked[j].now
			}
			return booked[i].at < booked[j].at
		})
		g := newRV(l)
		for i, r := range booked {
			ok, wait, _, _ := g.decide(r.now, 1, throttle.MaxHorizon.Microseconds())
			require.True(t, ok)
			require.Equal(t, wait, r.wait, "key %d booking %d of %d: slot", k, i, len(booked))
		}
		v, err := rdb.Get(ctx, prefix+fmt.Sprint("m", k)).Int64()
		if err == nil {
			require.Equal(t, g.tat, v, "key %d: stored TAT", k)
		}
	}
}
