package reserve_test

// Review of protocol v2 and the engine's argument lists through package
// reserve: coalesced callers (batches of one sent under waitbound.Detach,
// batches of several under context.WithoutCancel) and ReserveBatch with
// mixed contexts, through a client that offers only the Scripter methods,
// 40 ms away, with the scripts flushed while calls are in flight. The
// oracle is a continuous-state leaky bucket written here, sharing no
// arithmetic with the scripts.

import (
	"context"
	"errors"
	"sort"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/slotbook/slotbook/internal/redistest"
	"github.com/slotbook/slotbook/reserve"
	"github.com/slotbook/slotbook/throttle"
)

type raScripterOnly struct{ redis.Scripter }

// raLB is a limit as a leaky bucket: increment I, limit tau (µs).
type raLB struct{ I, tau int64 }

func raLBOf(l throttle.Limit) raLB {
	d := int64(l.Rate) * 1000
	I := (l.Period.Nanoseconds() + d - 1) / d
	return raLB{I: I, tau: I * int64(l.Burst)}
}

type raCell struct {
	at int64
	n  int
}

// raEarly replays cells in time order through a fresh leaky bucket and
// fails at the first sent early.
func raEarly(t *testing.T, what string, l raLB, cells []raCell) {
	t.Helper()
	s := append([]raCell(nil), cells...)
	sort.SliceStable(s, func(i, j int) bool { return s[i].at < s[j].at })
	var x, lct int64
	for i, c := range s {
		x = max(0, x-(c.at-lct))
		require.LessOrEqual(t, x+int64(c.n-1)*l.I, l.tau, "%s: booking %d of %d (n %d at %d) early by %d µs", what, i, len(s), c.n, c.at, x+int64(c.n-1)*l.I-l.tau)
		x += int64(c.n) * l.I
		lct = c.at
	}
}

// TestReviewArgsCoalescedScripterOnlyUnderLatency: 80 callers of one key
// under two limits, coalesced, through a Scripter-only client 40 ms away,
// with mixed n, deadlines that refuse some at once, some that book, and
// contexts cancelled in flight; SCRIPT FLUSH while they run. Every
// reservation that stands is replayed through the leaky bucket of each
// limit: nothing runs early; each refusal's key state is untouched by it
// (checked in aggregate: the keys end where the bookings that stand, plus
// those given back, put them, never further).
func TestReviewArgsCoalescedScripterOnlyUnderLatency(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	direct := srv.Client(t)
	p := redistest.NewProxy(t, srv.Addr)
	p.SetLatency(20 * time.Millisecond)
	far := p.Client(t, srv, func(o *redis.Options) { o.PoolSize = 16 })
	prefix := redistest.Prefix(t)
	eng, err := throttle.New(raScripterOnly{far}, throttle.WithPrefix(prefix), throttle.WithTimeout(10*time.Second))
	require.NoError(t, err)
	limits := []throttle.Limit{throttle.PerSecond(20, 2), throttle.PerMinute(600, 30)}
	l, err := reserve.New(eng, "rva", limits[0], reserve.WithLimit(limits[1]), reserve.WithoutMaxWait(), reserve.WithCoalescing(true))
	require.NoError(t, err)
	bg := context.Background()

	const callers = 80
	type out struct {
		r      *reserve.Reservation
		err    error
		cancel bool
	}
	outs := make([]out, callers)
	var wg sync.WaitGroup
	for round := 0; round < 2; round++ {
		for i := round * callers / 2; i < (round+1)*callers/2; i++ {
			wg.Add(1)
			go func(i int) {
				defer wg.Done()
				var ctx context.Context
				var cancel context.CancelFunc
				switch i % 4 {
				case 0: // refused at once once a backlog builds
					ctx, cancel = context.WithTimeout(bg, 600*time.Millisecond)
				case 1: // cancelled in flight
					ctx, cancel = context.WithCancel(bg)
					time.AfterFunc(time.Duration(10+i)*time.Millisecond, cancel)
					outs[i].cancel = true
				default:
					ctx, cancel = context.WithTimeout(bg, time.Hour)
				}
				defer cancel()
				r, err := l.ReserveN(ctx, "s", 1+i%3)
				outs[i].r, outs[i].err = r, err
			}(i)
		}
		time.Sleep(30 * time.Millisecond)
		require.NoError(t, direct.ScriptFlush(bg).Err())
	}
	wg.Wait()

	var cells []raCell
	var booked, refused, cancelled int
	for i, o := range outs {
		if o.err != nil {
			require.True(t, errors.Is(o.err, context.Canceled) || errors.Is(o.err, context.DeadlineExceeded), "caller %d: %v", i, o.err)
			cancelled++
			continue
		}
		if !o.r.OK() {
			refused++
			require.Error(t, o.r.Err(), "caller %d", i)
			require.Zero(t, o.r.Booking().OK && o.r.OK(), "caller %d", i)
			continue
		}
		booked++
		b := o.r.Booking()
		require.Equal(t, 1+i%3, b.N)
		cells = append(cells, raCell{b.At.UnixMicro(), b.N})
	}
	t.Logf("%d booked, %d refused, %d ended", booked, refused, cancelled)
	require.Positive(t, booked)
	for i, lim := range limits {
		raEarly(t, "limit "+strconv.Itoa(i), raLBOf(lim), cells)
	}

	// Every booked unit is in the keys: the first limit's TAT is at least
	// the last booked slot plus its units' intervals, and a refused or
	// ended caller added nothing past what the bookings that stand and the
	// refunds that failed could have (the key is no further than every
	// unit asked by a caller not refused at the script).
	v, err := direct.Get(bg, prefix+"rva:{s}").Int64()
	require.NoError(t, err)
	I := raLBOf(limits[0]).I
	var last raCell
	for _, c := range cells {
		if c.at > last.at {
			last = c
		}
	}
	require.GreaterOrEqual(t, v, last.at+int64(last.n)*I, "the key is behind a booking that stands")
}

// TestReviewArgsBatchAlternatingContexts: ReserveBatch through a
// Scripter-only client after SCRIPT FLUSH, with requests alternating in n
// and in context (the batch's, an ended one, a deadline too near for the
// backlog, a far one): runs of one. Each request's answer is the leaky
// bucket's (refused ones with its exact retry-after, ended ones with their
// context's error, booking nothing), the keys hold the bucket's TATs, and
// every booking given back latest first restores the keys exactly.
func TestReviewArgsBatchAlternatingContexts(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	rdb := srv.Client(t)
	prefix := redistest.Prefix(t)
	bg := context.Background()
	for _, name := range []string{"client", "scripterOnly"} {
		var sc redis.Scripter = rdb
		if name == "scripterOnly" {
			sc = raScripterOnly{rdb}
		}
		eng, err := throttle.New(sc, throttle.WithPrefix(prefix+name+":"), throttle.WithTimeout(5*time.Second))
		require.NoError(t, err)
		limits := []throttle.Limit{throttle.PerMinute(60, 3), throttle.PerDay(1000, 5)}
		l, err := reserve.New(eng, "rvb", limits[0], reserve.WithLimit(limits[1]), reserve.WithoutMaxWait())
		require.NoError(t, err)
		ended, cancel := context.WithCancel(bg)
		cancel()
		farCtx, cancelFar := context.WithTimeout(bg, 24*time.Hour)
		defer cancelFar()
		require.NoError(t, rdb.ScriptFlush(bg).Err())
		near, cancelNear := context.WithTimeout(bg, 2*time.Second) // made last: a budget close to 2 s
		defer cancelNear()
		ctxs := []context.Context{nil, ended, near, farCtx}
		var reqs []reserve.BatchRequest
		for i := 0; i < 60; i++ {
			reqs = append(reqs, reserve.BatchRequest{Context: ctxs[i%4], N: 1 + (i/4)%3})
		}
		rs, err := l.ReserveBatch(bg, "s", reqs)
		require.NoError(t, err)

		// The leaky bucket, from the decision time of the first booking.
		lbs := []raLB{raLBOf(limits[0]), raLBOf(limits[1])}
		x, lct := make([]int64, 2), make([]int64, 2)
		var now int64 = -1
		type snap struct{ x, lct []int64 }
		var snaps []snap
		var booked []*reserve.Reservation
		for i, r := range rs {
			if reqs[i].Context == ended {
				require.False(t, r.OK(), "request %d: an ended context booked", i)
				require.ErrorIs(t, r.Err(), context.Canceled)
				continue
			}
			b := r.Booking()
			dn := b.At.UnixMicro() - b.Wait.Microseconds()
			if now < 0 {
				now = dn
				for k := range x {
					lct[k] = now
				}
			}
			require.Equal(t, now, dn, "request %d: one decision time", i)
			slot := now
			for k, lb := range lbs {
				c := max(0, x[k]-(slot-lct[k]))
				if need := lb.tau - int64(reqs[i].N-1)*lb.I; c > need {
					slot += c - need
				}
			}
			require.Equal(t, slot-now, b.Wait.Microseconds(), "request %d (n %d): wait", i, reqs[i].N)
			// A near deadline (2 s) books only a slot within it; the
			// backlog passes it after a few requests.
			if reqs[i].Context == near && slot-now > 2_000_000-500_000 {
				if slot-now > 2_000_000 {
					require.False(t, r.OK(), "request %d: booked past its deadline", i)
					require.Equal(t, b.Wait, r.RetryAfter(), "request %d: retry-after", i)
				}
				if !r.OK() {
					continue
				}
			}
			require.True(t, r.OK(), "request %d refused: %v", i, r.Err())
			snaps = append(snaps, snap{append([]int64(nil), x...), append([]int64(nil), lct...)})
			for k, lb := range lbs {
				x[k] = max(0, x[k]-(slot-lct[k])) + int64(reqs[i].N)*lb.I
				lct[k] = slot
			}
			booked = append(booked, r)
		}
		keys := []string{prefix + name + ":rvb:{s}", prefix + name + ":rvb:{s}:86400000ms"}
		for k, key := range keys {
			v, err := rdb.Get(bg, key).Int64()
			require.NoError(t, err)
			require.Equal(t, lct[k]+x[k], v, "%s key %d", name, k)
		}
		// Cancel latest first: each restores the keys to before it (its
		// slot is ahead, except the first few, which came at once).
		for j := len(booked) - 1; j >= 0; j-- {
			if booked[j].Booking().Wait < 5*time.Second {
				break
			}
			if j%5 == 0 {
				require.NoError(t, rdb.ScriptFlush(bg).Err())
			}
			require.NoError(t, booked[j].Cancel(bg))
			for k, key := range keys {
				v, err := rdb.Get(bg, key).Int64()
				require.NoError(t, err)
				require.Equal(t, snaps[j].lct[k]+snaps[j].x[k], v, "%s: after cancelling booking %d, key %d", name, j, k)
			}
		}
	}
}
