package reserve_test

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/slotbook/slotbook/internal/redistest"
	"github.com/slotbook/slotbook/internal/testhook"
	"github.com/slotbook/slotbook/reserve"
	"github.com/slotbook/slotbook/throttle"
)

// reviewModel is a textbook GCRA (virtual scheduling) written for this
// review: one TAT per limit in microseconds (0: absent), refunds as
// docs/PROTOCOL.md describes them.
type reviewModel struct {
	I, tau, tat []int64
}

type reviewSlot struct {
	ok            bool
	wait, now     int64
	before, after []int64
}

func newReviewModel(limits []throttle.Limit) *reviewModel {
	g := &reviewModel{}
	for _, l := range limits {
		ns := (l.Period.Nanoseconds() + int64(l.Rate) - 1) / int64(l.Rate)
		us := (ns + 999) / 1000
		g.I = append(g.I, us)
		g.tau = append(g.tau, us*int64(l.Burst))
		g.tat = append(g.tat, 0)
	}
	return g
}

func (g *reviewModel) book(now int64, n int, maxWait int64) reviewSlot {
	s := reviewSlot{now: now}
	slot := now
	for i := range g.I {
		t := max(g.tat[i], now)
		s.before = append(s.before, t)
		for j := 0; j < n; j++ { // cell j conforms at t + j*I - tau
			slot = max(slot, t+int64(j)*g.I[i]-g.tau[i])
		}
	}
	s.wait = slot - now
	if s.wait > maxWait {
		return s
	}
	s.ok = true
	for i := range g.I {
		t := s.before[i]
		for j := 0; j < n; j++ {
			t = max(t, slot) + g.I[i]
		}
		g.tat[i] = t
		s.after = append(s.after, t)
	}
	return s
}

func (g *reviewModel) refund(now int64, s reviewSlot) {
	if !s.ok || now >= s.now+s.wait {
		return
	}
	for i := range g.I {
		if g.tat[i] != 0 && g.tat[i] == s.after[i] {
			if s.before[i] > now {
				g.tat[i] = s.before[i]
			} else {
				g.tat[i] = 0
			}
		}
	}
}

func reviewKeys(l *reserve.Limiter, prefix, subject string) []string {
	first := prefix + l.Name() + ":{" + subject + "}"
	keys := []string{first}
	for _, lim := range l.Limits()[1:] {
		keys = append(keys, first+":"+strconv.FormatInt(lim.Period.Milliseconds(), 10)+"ms")
	}
	return keys
}

func reviewCheck(t *testing.T, rdb *redis.Client, keys []string, g *reviewModel, what string) {
	t.Helper()
	for i, k := range keys {
		v, err := rdb.Get(context.Background(), k).Int64()
		if errors.Is(err, redis.Nil) {
			require.Zero(t, g.tat[i], "%s: key %d absent", what, i)
			continue
		}
		require.NoError(t, err)
		require.Equal(t, g.tat[i], v, "%s: key %d", what, i)
	}
}

// TestRunsReserveBatchLayered: a ReserveBatch under two limits whose
// requests come in runs (the batch's context, per-request deadlines shared
// by neighbours, ended contexts that split runs, N 1 and 2), on the test
// clock, against the review's GCRA; then its reservations are cancelled
// in the middle, the last one through a lost reply and a retry, and the
// rest latest first, the keys checked after each.
func TestRunsReserveBatchLayered(t *testing.T) {
	t.Parallel()
	srv := redistest.Shared(t)
	p := redistest.NewProxy(t, srv.Addr)
	rdb := p.Client(t, srv)
	prefix := redistest.Prefix(t)
	eng, err := throttle.New(rdb, throttle.WithPrefix(prefix), throttle.WithTimeout(time.Second))
	require.NoError(t, err)
	require.NoError(t, eng.Load(context.Background()))
	// 30 minutes apart, burst 1; 144 minutes apart per day, burst 3:
	// every wait is a multiple of 6 minutes.
	limits := []throttle.Limit{throttle.Every(time.Hour, 2, 1), throttle.PerDay(10, 3)}
	l, err := reserve.New(eng, "rv", limits[0], reserve.WithLimit(limits[1]), reserve.WithoutMaxWait())
	require.NoError(t, err)
	x := time.Now().UnixMicro()
	ctx := testhook.WithNow(context.Background(), x)
	ended, cancel := context.WithCancel(ctx)
	cancel()
	realNow := time.Now()
	dl := func(k int) (context.Context, int64) { // budget k*6 min + 3 min
		d := time.Duration(k)*6*time.Minute + 3*time.Minute
		c, cancel := context.WithDeadline(ctx, realNow.Add(d))
		t.Cleanup(cancel)
		return c, d.Microseconds()
	}
	type spec struct {
		req reserve.BatchRequest
		mw  int64 // -1: ended
	}
	forever := throttle.MaxHorizon.Microseconds()
	var specs []spec
	add := func(n, count int, c context.Context, mw int64) {
		for i := 0; i < count; i++ {
			specs = append(specs, spec{reserve.BatchRequest{Context: c, N: n}, mw})
		}
	}
	d10, w10 := dl(10)
	d40, w40 := dl(40)
	add(1, 3, nil, forever)
	add(1, 1, ended, -1)
	add(1, 2, nil, forever)
	add(2, 4, d10, w10) // refused after the first few
	add(2, 1, ended, -1)
	add(2, 3, d10, w10)
	add(1, 5, d40, w40)
	add(2, 2, nil, forever)
	add(1, 1, ended, -1)
	add(1, 6, d40, w40)
	reqs := make([]reserve.BatchRequest, len(specs))
	for i, s := range specs {
		reqs[i] = s.req
	}
	rs, err := l.ReserveBatch(ctx, "s", reqs)
	require.NoError(t, err)
	g := newReviewModel(limits)
	model := make([]reviewSlot, len(specs))
	var booked []int
	var refused int
	for i, s := range specs {
		if s.mw < 0 {
			require.ErrorIs(t, rs[i].Err(), context.Canceled, "request %d", i)
			continue
		}
		model[i] = g.book(x, s.req.N, s.mw)
		require.Equal(t, model[i].ok, rs[i].OK(), "request %d: %v", i, rs[i].Err())
		require.Equal(t, model[i].wait, rs[i].Booking().Wait.Microseconds(), "request %d", i)
		require.Equal(t, x+model[i].wait, rs[i].Booking().At.UnixMicro(), "request %d", i)
		if model[i].ok {
			booked = append(booked, i)
		} else {
			refused++
		}
	}
	require.Positive(t, refused)
	keys := reviewKeys(l, prefix, "s")
	reviewCheck(t, rdb, keys, g, "after the batch")

	// A booking in the middle first: later ones stand on it, nothing back.
	mid := booked[len(booked)/2]
	require.NoError(t, rs[mid].Cancel(ctx))
	g.refund(x, model[mid])
	reviewCheck(t, rdb, keys, g, "after the middle cancel")

	// The last through a lost reply, then retried.
	last := booked[len(booked)-1]
	p.SetReplyDelay(1500 * time.Millisecond)
	err = rs[last].Cancel(ctx)
	require.ErrorIs(t, err, throttle.ErrReplyLost)
	time.Sleep(2 * time.Second)
	p.SetReplyDelay(0)
	g.refund(x, model[last])
	reviewCheck(t, rdb, keys, g, "after the lost cancel")
	require.NoError(t, rs[last].Cancel(ctx))
	reviewCheck(t, rdb, keys, g, "after the retried cancel")

	for j := len(booked) - 2; j >= 0; j-- {
		i := booked[j]
		require.NoError(t, rs[i].Cancel(ctx))
		if i != mid { // cancelled already (once only)
			g.refund(x, model[i])
		}
		reviewCheck(t, rdb, keys, g, fmt.Sprintf("after cancelling request %d", i))
	}
	// The middle one, cancelled before the others, gave nothing then and
	// gives nothing now: its room stays taken (documented).
	require.NotZero(t, g.tat[0])
}
