package throttle_test

// helper-91: adversarial review of Engine.RefundUnusedRun / span() (52fa465).
// TestReviewRUNPartialMarkStrandsRoom and TestReviewRUNBadInputMarks
// failed there (a refused run left its bookings marked: their room stuck).
// All on the test clock (testhook now); 10/s, no burst, I = 100 ms unless
// said otherwise. Room is judged by the next booking's slot against a
// textbook GCRA replay of the bookings that still stand.

import (
	"fmt"
	"math/rand"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/slotbook/slotbook/throttle"
)

const runTick = time.Millisecond

var runForever = throttle.Request{N: 1, MaxWait: throttle.Forever}

// runTextbook: textbook GCRA (I, tau) replaying standing requests of n
// units, each arriving at its arrival time (µs), then the slot of a
// one-unit request arriving at now.
func runTextbook(interval, tau time.Duration, arrivals []int64, ns []int, now int64) int64 {
	I, T := interval.Microseconds(), tau.Microseconds()
	var tat int64
	for i, a := range arrivals {
		slot := max(a, tat+int64(ns[i]-1)*I-T)
		tat = max(tat, slot) + int64(ns[i])*I
	}
	return max(now, tat-T)
}

// book4 books p (standing) then a back-to-back run of three at t0 on key k.
func book4(t *testing.T, e *env, k string, t0 int64, lim throttle.Limit) (throttle.Booking, []throttle.Booking) {
	t.Helper()
	bs, err := e.eng.BookBatch(at(t0, 0), k, lim, []throttle.Request{runForever, runForever, runForever, runForever})
	require.NoError(t, err)
	for _, b := range bs {
		require.True(t, b.OK)
	}
	return bs[0], bs[1:]
}

// Many goroutines give the same run back at once: given back once only.
func TestReviewRUNConcurrentSameRun(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	lim := throttle.PerSecond(10, 0)
	lims := []throttle.Limit{lim}
	t0 := base()
	for iter := range 20 {
		k := fmt.Sprintf("same%d", iter)
		_, run := book4(t, e, k, t0, lim)
		var (
			wg    sync.WaitGroup
			mu    sync.Mutex
			total time.Duration
			oks   int
		)
		for g := range 16 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				// each goroutine its own copy of the slice (copies of the values)
				gs, err := e.eng.RefundUnusedRun(at(t0, time.Duration(10+g%3)*runTick), []string{k}, lims, slices.Clone(run))
				mu.Lock()
				defer mu.Unlock()
				if err == nil {
					oks++
					total += gs[0]
				} else {
					t.Errorf("iter %d: %v", iter, err)
				}
			}()
		}
		wg.Wait()
		require.Equal(t, 16, oks)
		require.Equal(t, 300*runTick, total, "iter %d: the run given back exactly once", iter)
		next, err := e.eng.Book(at(t0, 20*runTick), k, lim, runForever)
		require.NoError(t, err)
		want := runTextbook(100*runTick, 0, []int64{t0}, []int{1}, t0+20*runTick.Microseconds())
		require.Equal(t, time.UnixMicro(want), next.At, "iter %d: only p stands", iter)
	}
}

// The run races RefundUnused / RefundAll of one of its bookings: exactly one
// wins, nothing given twice, no early slot.
func TestReviewRUNRaceRunVsSingle(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	lim := throttle.PerSecond(10, 0)
	lims := []throttle.Limit{lim}
	seed := time.Now().UnixNano()
	t.Logf("seed %d", seed)
	rng := rand.New(rand.NewSource(seed))
	t0 := base()
	wins := map[string]int{}
	for iter := range 60 {
		k := fmt.Sprintf("race%d", iter)
		p, run := book4(t, e, k, t0, lim)
		_ = p
		i := rng.Intn(3)
		used := rng.Intn(2) == 0
		now := at(t0, 10*runTick)
		var (
			wg           sync.WaitGroup
			gRun, gOne   []time.Duration
			errR, errOne error
		)
		wg.Add(2)
		go func() {
			defer wg.Done()
			gRun, errR = e.eng.RefundUnusedRun(now, []string{k}, lims, run)
		}()
		go func() {
			defer wg.Done()
			if used {
				gOne, errOne = e.eng.RefundAll(now, []string{k}, lims, run[i])
			} else {
				gOne, errOne = e.eng.RefundUnused(now, []string{k}, lims, run[i])
			}
		}()
		wg.Wait()
		require.True(t, (errR == nil) != (errOne == nil), "iter %d (i=%d used=%v): exactly one wins: run %v, single %v", iter, i, used, errR, errOne)
		// What stands: p, then the run up to what was given back.
		standing := 4
		var given time.Duration
		if errR == nil {
			wins["run"]++
			require.ErrorIs(t, errOne, throttle.ErrInvalidRequest)
			standing = 1
			given = gRun[0]
		} else {
			wins["single"]++
			require.ErrorIs(t, errR, throttle.ErrInvalidRequest)
			given = gOne[0]
			if i == 2 {
				standing = 3
			}
		}
		require.Equal(t, time.Duration(4-standing)*100*runTick, given, "iter %d: given back", iter)
		arr := make([]int64, standing)
		ns := make([]int, standing)
		for j := range arr {
			arr[j], ns[j] = t0, 1
		}
		next, err := e.eng.Book(at(t0, 20*runTick), k, lim, runForever)
		require.NoError(t, err)
		want := runTextbook(100*runTick, 0, arr, ns, t0+20*runTick.Microseconds())
		require.Equal(t, time.UnixMicro(want), next.At, "iter %d: next slot vs textbook of %d standing", iter, standing)
		// Afterwards every other way of giving any of it back is refused or gives nothing.
		for j, b := range run {
			g1, err1 := e.eng.RefundUnused(now, []string{k}, lims, b)
			g2, err2 := e.eng.RefundAll(now, []string{k}, lims, b)
			if err1 == nil {
				require.Equal(t, time.Duration(0), g1[0], "iter %d booking %d again", iter, j)
			}
			if err2 == nil {
				require.Equal(t, time.Duration(0), g2[0], "iter %d booking %d again", iter, j)
			}
		}
		gs, err := e.eng.RefundUnusedRun(now, []string{k}, lims, run)
		if err == nil {
			require.Equal(t, time.Duration(0), gs[0])
		}
	}
	t.Logf("wins %v", wins)
}

// Copies of the Booking values (shared way): after the run, a copy's own
// refund (either way) fails, a copy-run retry gives nothing; sub-runs of
// copies fail.
func TestReviewRUNCopies(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	lim := throttle.PerSecond(10, 0)
	lims := []throttle.Limit{lim}
	t0 := base()
	_, run := book4(t, e, "c", t0, lim)
	cp := make([]throttle.Booking, len(run))
	copy(cp, run)
	one := run[2] // a value copy
	gs, err := e.eng.RefundUnusedRun(at(t0, 10*runTick), []string{"c"}, lims, run)
	require.NoError(t, err)
	require.Equal(t, 300*runTick, gs[0])
	for j := range cp {
		_, err = e.eng.RefundUnused(at(t0, 11*runTick), []string{"c"}, lims, cp[j])
		require.ErrorIs(t, err, throttle.ErrInvalidRequest, "copy %d unused", j)
		_, err = e.eng.RefundAll(at(t0, 11*runTick), []string{"c"}, lims, cp[j])
		require.ErrorIs(t, err, throttle.ErrInvalidRequest, "copy %d used", j)
	}
	_, err = e.eng.RefundUnused(at(t0, 11*runTick), []string{"c"}, lims, one)
	require.ErrorIs(t, err, throttle.ErrInvalidRequest)
	_, err = e.eng.RefundUnusedRun(at(t0, 11*runTick), []string{"c"}, lims, cp[:2])
	require.ErrorIs(t, err, throttle.ErrInvalidRequest, "sub-run of copies")
	_, err = e.eng.RefundUnusedRun(at(t0, 11*runTick), []string{"c"}, lims, cp[1:])
	require.ErrorIs(t, err, throttle.ErrInvalidRequest, "sub-run of copies")
	_, err = e.eng.RefundUnusedRun(at(t0, 11*runTick), []string{"c"}, lims, cp[2:])
	require.ErrorIs(t, err, throttle.ErrInvalidRequest, "one-booking run of a copy")
	gs, err = e.eng.RefundUnusedRun(at(t0, 12*runTick), []string{"c"}, lims, cp)
	require.NoError(t, err)
	require.Equal(t, time.Duration(0), gs[0], "retry via copies")
	next, err := e.eng.Book(at(t0, 20*runTick), "c", lim, runForever)
	require.NoError(t, err)
	require.Equal(t, time.UnixMicro(t0+100*runTick.Microseconds()), next.At, "only p stands")
}

// Runs of two calls back to back: allowed as one run (gives both back);
// afterwards each call's run on its own is refused; and when the later
// call's run went first, the earlier call's run still gives its room.
func TestReviewRUNTwoCalls(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	lim := throttle.PerSecond(10, 0)
	lims := []throttle.Limit{lim}
	t0 := base()
	book2 := func(k string, d time.Duration) []throttle.Booking {
		bs, err := e.eng.BookBatch(at(t0, d), k, lim, []throttle.Request{runForever, runForever})
		require.NoError(t, err)
		return bs
	}
	// Combined.
	p := book2("x", 0)
	a, c := book2("x", 0), book2("x", 0)
	_ = p
	gs, err := e.eng.RefundUnusedRun(at(t0, 10*runTick), []string{"x"}, lims, append(slices.Clone(a), c...))
	require.NoError(t, err)
	require.Equal(t, 400*runTick, gs[0])
	_, err = e.eng.RefundUnusedRun(at(t0, 10*runTick), []string{"x"}, lims, c)
	require.ErrorIs(t, err, throttle.ErrInvalidRequest)
	_, err = e.eng.RefundUnusedRun(at(t0, 10*runTick), []string{"x"}, lims, a)
	require.ErrorIs(t, err, throttle.ErrInvalidRequest)
	next, err := e.eng.Book(at(t0, 20*runTick), "x", lim, runForever)
	require.NoError(t, err)
	require.Equal(t, time.UnixMicro(runTextbook(100*runTick, 0, []int64{t0, t0}, []int{1, 1}, t0+20000)), next.At)

	// Later call first, then earlier call.
	book2("y", 0)
	a, c = book2("y", 0), book2("y", 0)
	gs, err = e.eng.RefundUnusedRun(at(t0, 10*runTick), []string{"y"}, lims, c)
	require.NoError(t, err)
	require.Equal(t, 200*runTick, gs[0])
	gs, err = e.eng.RefundUnusedRun(at(t0, 10*runTick), []string{"y"}, lims, a)
	require.NoError(t, err)
	require.Equal(t, 200*runTick, gs[0])
	_, err = e.eng.RefundUnusedRun(at(t0, 10*runTick), []string{"y"}, lims, append(slices.Clone(a), c...))
	require.ErrorIs(t, err, throttle.ErrInvalidRequest, "combined after both halves")
	next, err = e.eng.Book(at(t0, 20*runTick), "y", lim, runForever)
	require.NoError(t, err)
	require.Equal(t, time.UnixMicro(runTextbook(100*runTick, 0, []int64{t0, t0}, []int{1, 1}, t0+20000)), next.At)

	// Calls apart in time but back to back in TAT (the key's TAT had not
	// expired): the run gives only what still stands in front of now.
	a = book2("z", 0)           // t0..t0+200
	c = book2("z", 500*runTick) // t0+500..t0+700
	{
		gs, err = e.eng.RefundUnusedRun(at(t0, 510*runTick), []string{"z"}, lims, append(slices.Clone(a), c...))
		if err == nil {
			require.Equal(t, 190*runTick, gs[0], "only c's room ahead of now")
		} else {
			t.Logf("apart-in-time run refused: %v", err)
		}
		next, err = e.eng.Book(at(t0, 520*runTick), "z", lim, runForever)
		require.NoError(t, err)
		require.False(t, next.At.Before(time.UnixMicro(t0+520000)))
		t.Logf("z next %v after t0", next.At.Sub(time.UnixMicro(t0)))
	}
}

// A run whose slot has passed (burst: every slot at once) given back as
// unused: what stands in front of now comes back, nothing past it; a run
// whose ends have all passed gives nothing.
func TestReviewRUNSlotPassed(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	lim := throttle.PerSecond(10, 5) // tau 500ms
	lims := []throttle.Limit{lim}
	t0 := base()
	bs, err := e.eng.BookBatch(at(t0, 0), "b", lim, []throttle.Request{runForever, runForever, runForever})
	require.NoError(t, err)
	for _, b := range bs {
		require.Equal(t, time.UnixMicro(t0), b.At)
	}
	gs, err := e.eng.RefundUnusedRun(at(t0, 150*runTick), []string{"b"}, lims, bs)
	require.NoError(t, err)
	require.Equal(t, 150*runTick, gs[0], "t0+300 back to now t0+150")
	// Textbook with nothing standing now (what stood before now has passed
	// and its room no longer counts... the key sits at now): a burst of 6
	// (tau/I + 1) at t0+150 at once, the 7th at +100.
	for j := range 6 {
		b, err := e.eng.Book(at(t0, 150*runTick), "b", lim, runForever)
		require.NoError(t, err)
		require.Equal(t, time.UnixMicro(t0+150000), b.At, "burst %d", j)
	}
	b, err := e.eng.Book(at(t0, 150*runTick), "b", lim, runForever)
	require.NoError(t, err)
	require.Equal(t, time.UnixMicro(t0+250000), b.At)

	// All ends passed: nothing.
	cs, err := e.eng.BookBatch(at(t0, 0), "d", lim, []throttle.Request{runForever, runForever})
	require.NoError(t, err)
	gs, err = e.eng.RefundUnusedRun(at(t0, 250*runTick), []string{"d"}, lims, cs)
	require.NoError(t, err)
	require.Equal(t, time.Duration(0), gs[0])
}

// Partial marking: a run refused because one booking was given back on
// its own first marks the others before it fails. Desired: the rest (as a
// run or one by one, latest first) can still be given back. This test
// asserts the desired behaviour; on 52fa465 it FAILS (room stranded).
func TestReviewRUNPartialMarkStrandsRoom(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	lim := throttle.PerSecond(10, 0)
	lims := []throttle.Limit{lim}
	t0 := base()
	_, run := book4(t, e, "pm", t0, lim)
	now := at(t0, 10*runTick)
	gs, err := e.eng.RefundUnused(now, []string{"pm"}, lims, run[2])
	require.NoError(t, err)
	require.Equal(t, 100*runTick, gs[0])
	_, err = e.eng.RefundUnusedRun(now, []string{"pm"}, lims, run)
	require.ErrorIs(t, err, throttle.ErrInvalidRequest, "run holding one given back alone")
	// The rest: as a run of its own.
	gs, err = e.eng.RefundUnusedRun(now, []string{"pm"}, lims, run[:2])
	if err != nil {
		_, e1 := e.eng.RefundUnused(now, []string{"pm"}, lims, run[1])
		_, e0 := e.eng.RefundUnused(now, []string{"pm"}, lims, run[0])
		next, _ := e.eng.Book(at(t0, 20*runTick), "pm", lim, runForever)
		t.Fatalf("FINDING (liveness): after the refused run, run[:2] as a run: %v; one by one: %v / %v; room stranded: next slot t0+%v (textbook with r0,r1 given back: t0+100ms)",
			err, e1, e0, next.At.Sub(time.UnixMicro(t0)))
	}
	require.Equal(t, 200*runTick, gs[0])
}

// Bad keys (wrong count) make RefundUnusedRun fail with ErrInvalidRequest,
// "no Redis call" — but the run's bookings are marked first. Desired: a
// call refused as bad input leaves no mark (as RefundUnused does: it checks
// keys before marking). Asserts the desired behaviour; FAILS on 52fa465.
func TestReviewRUNBadInputMarks(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	lim := throttle.PerSecond(10, 0)
	lims := []throttle.Limit{lim}
	t0 := base()
	_, run := book4(t, e, "bi", t0, lim)
	now := at(t0, 10*runTick)
	// Single booking with bad keys: no mark.
	_, err := e.eng.RefundUnused(now, []string{"bi", "{x}"}, []throttle.Limit{lim, lim}, run[2])
	require.ErrorIs(t, err, throttle.ErrInvalidRequest)
	_, err = e.eng.RefundAll(now, []string{"bi"}, lims, run[2])
	require.NoError(t, err, "RefundUnused with bad keys left no mark")
	// A fresh run: bad keys, then the bookings one by one.
	_, run = book4(t, e, "bj", t0, lim)
	_, err = e.eng.RefundUnusedRun(now, []string{"bj", "{x}"}, []throttle.Limit{lim, lim}, run)
	require.ErrorIs(t, err, throttle.ErrInvalidRequest)
	gs, err := e.eng.RefundUnused(now, []string{"bj"}, lims, run[2])
	if err != nil {
		t.Fatalf("FINDING (liveness, minor): RefundUnusedRun refused as bad input (wrong keys) still marked its bookings: RefundUnused of one after it: %v (a retry of the same run with the right keys does work)", err)
	}
	require.Equal(t, 100*runTick, gs[0])
}

// A run whose middle is swapped for another call's booking at the same
// TATs (same first and last: same tombstone and mark): gives nothing, and
// must not give the other call's room.
func TestReviewRUNSwappedMiddle(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	lim := throttle.PerSecond(10, 0)
	lims := []throttle.Limit{lim}
	t0 := base()
	_, a := book4(t, e, "sw", t0, lim) // p t0..+100, a +100..+400
	now := at(t0, 10*runTick)
	gs, err := e.eng.RefundUnusedRun(now, []string{"sw"}, lims, a)
	require.NoError(t, err)
	require.Equal(t, 300*runTick, gs[0])
	y, err := e.eng.BookBatch(now, "sw", lim, []throttle.Request{runForever, runForever, runForever})
	require.NoError(t, err) // same TATs as a
	gs, err = e.eng.RefundUnusedRun(at(t0, 11*runTick), []string{"sw"}, lims, []throttle.Booking{a[0], y[1], a[2]})
	t.Logf("swapped-middle run: %v %v", gs, err)
	if err == nil {
		require.Equal(t, time.Duration(0), gs[0], "given nothing: y stands")
	}
	// Was y's own run stranded by the swapped-middle call marking y[1]?
	gs, err = e.eng.RefundUnusedRun(at(t0, 12*runTick), []string{"sw"}, lims, y)
	t.Logf("y's own run after the swapped-middle run: %v %v", gs, err)
	next, err := e.eng.Book(at(t0, 20*runTick), "sw", lim, runForever)
	require.NoError(t, err)
	t.Logf("next slot t0+%v (t0+100ms if y came back, t0+400ms if y is stranded)", next.At.Sub(time.UnixMicro(t0)))
	require.False(t, next.At.Before(time.UnixMicro(t0+100000)), "never before p's end")
}
