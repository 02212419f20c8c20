package limitcheck_test

import (
	"testing"
	"time"

	"github.com/slotbook/slotbook/internal/limitcheck"
	"github.com/slotbook/slotbook/throttle"
)

func TestWindows(t *testing.T) {
	t0 := time.Now()
	at := func(ms ...int) []time.Time {
		var ts []time.Time
		for _, m := range ms {
			ts = append(ts, t0.Add(time.Duration(m)*time.Millisecond))
		}
		return ts
	}
	limit := throttle.PerSecond(10, 1) // two at once, then 100ms apart
	for _, tc := range []struct {
		name  string
		times []time.Time
		slack time.Duration
		ok    bool
	}{
		{"burst then spaced", at(0, 0, 100, 200, 300), 0, true},
		{"three at once", at(0, 0, 0), 0, false},
		{"one early", at(0, 0, 100, 199), 0, false},
		{"one early, within slack", at(0, 0, 100, 199), 2 * time.Millisecond, true},
		{"unsorted", at(300, 0, 200, 0, 100), 0, true},
	} {
		err := limitcheck.Windows(tc.times, limit, tc.slack)
		if (err == nil) != tc.ok {
			t.Errorf("%s: Windows = %v, want ok=%v", tc.name, err, tc.ok)
		}
	}
}

func TestJudge(t *testing.T) {
	lim := throttle.PerSecond(10, 1) // I = 100000 µs, two at once
	const now = 5_000_000
	for _, tc := range []struct {
		name      string
		tat       int64
		n         int
		maxWait   time.Duration
		ok        bool
		wait, end int64
	}{
		{"idle key, one", 0, 1, 0, true, 0, now + 100_000},
		{"idle key, burst+1 at once", 0, 2, 0, true, 0, now + 200_000},
		{"passed TAT counts as idle", now - 1, 1, 0, true, 0, now + 100_000},
		{"second unit of the burst", now + 100_000, 1, 0, true, 0, now + 200_000},
		{"burst spent: waits an interval", now + 200_000, 1, time.Second, true, 100_000, now + 300_000},
		{"burst spent, max wait short by a microsecond", now + 200_000, 1, 100*time.Millisecond - time.Microsecond, false, 100_000, now + 200_000},
		{"max wait past the horizon counts as the horizon", now + throttle.MaxHorizon.Microseconds() + 100_001, 1, throttle.Forever, false, throttle.MaxHorizon.Microseconds() + 1, now + throttle.MaxHorizon.Microseconds() + 100_001},
	} {
		ok, wait, end := limitcheck.Judge(lim, tc.tat, now, tc.n, tc.maxWait)
		if ok != tc.ok || wait != tc.wait || end != tc.end {
			t.Errorf("%s: got ok=%v wait=%d end=%d, want ok=%v wait=%d end=%d", tc.name, ok, wait, end, tc.ok, tc.wait, tc.end)
		}
	}
}

func TestReplay(t *testing.T) {
	lim := throttle.PerSecond(10, 1) // I = 100000 µs, two at once
	t0 := time.UnixMicro(7_000_000)
	out := func(decidedMs, waitMs int, ok bool) limitcheck.Outcome {
		wait := time.Duration(waitMs) * time.Millisecond
		// A refusal's At is the slot it would have had, as the engine reports it.
		at := t0.Add(time.Duration(decidedMs) * time.Millisecond).Add(wait)
		return limitcheck.Outcome{Booking: throttle.Booking{OK: ok, At: at, Wait: wait}, N: 1, MaxWait: 150 * time.Millisecond}
	}
	// One call deciding four at once, listed out of the order that explains
	// them: the refusal (200 ms > 150 ms) came last.
	end, err := limitcheck.Replay(lim, 0, []limitcheck.Outcome{out(0, 200, false), out(0, 100, true), out(0, 0, true), out(0, 0, true)})
	if err != nil || end != t0.UnixMicro()+300_000 {
		t.Fatalf("got %d, %v; want TAT %d", end, err, t0.UnixMicro()+300_000)
	}
	// A later decision sees the TAT the earlier ones left.
	if _, err := limitcheck.Replay(lim, 0, []limitcheck.Outcome{out(50, 50, true), out(0, 0, true), out(0, 0, true)}); err != nil {
		t.Fatal(err)
	}
	// Booked twice: no order explains a third immediate slot.
	if _, err := limitcheck.Replay(lim, 0, []limitcheck.Outcome{out(0, 0, true), out(0, 0, true), out(0, 0, true)}); err == nil {
		t.Fatal("three immediate slots of a burst of two: want an error")
	}
	// A refusal where the textbook books is an error too.
	if _, err := limitcheck.Replay(lim, 0, []limitcheck.Outcome{out(0, 0, false)}); err == nil {
		t.Fatal("refused on an idle key: want an error")
	}
}
