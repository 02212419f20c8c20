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
