package throttle_test

import (
	"errors"
	"testing"
	"time"

	"github.com/slotbook/slotbook/throttle"
)

func TestLimitInterval(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name  string
		limit throttle.Limit
		want  time.Duration
	}{
		{"10 per second", throttle.PerSecond(10, 5), 100 * time.Millisecond},
		{"100 per minute", throttle.PerMinute(100, 0), 600 * time.Millisecond},
		{"3600 per hour", throttle.PerHour(3600, 0), time.Second},
		{"3 per second rounds up", throttle.PerSecond(3, 0), 333334 * time.Microsecond},
		{"1e6 per second", throttle.PerSecond(1_000_000, 0), time.Microsecond},
		{"sub-microsecond nanos round up", throttle.Every(1500*time.Nanosecond, 1, 0), 2 * time.Microsecond},
		{"invalid", throttle.Limit{}, 0},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			if got := tc.limit.Interval(); got != tc.want {
				t.Errorf("%v.Interval() = %v, want %v", tc.limit, got, tc.want)
			}
		})
	}
}

func TestLimitValidate(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name  string
		limit throttle.Limit
		ok    bool
	}{
		{"valid", throttle.PerSecond(10, 5), true},
		{"zero burst", throttle.PerSecond(1, 0), true},
		{"zero rate", throttle.PerSecond(0, 5), false},
		{"negative rate", throttle.PerSecond(-1, 5), false},
		{"zero period", throttle.Every(0, 1, 1), false},
		{"negative period", throttle.Every(-time.Second, 1, 1), false},
		{"negative burst", throttle.PerSecond(10, -1), false},
		{"faster than a microsecond", throttle.PerSecond(2_000_000, 0), false},
		{"tolerance beyond the clock", throttle.Every(100*365*24*time.Hour, 1, 1000), false},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			err := tc.limit.Validate()
			if tc.ok && err != nil {
				t.Fatalf("Validate() = %v, want nil", err)
			}
			if !tc.ok && !errors.Is(err, throttle.ErrInvalidLimit) {
				t.Fatalf("Validate() = %v, want ErrInvalidLimit", err)
			}
		})
	}
}

func TestLimitString(t *testing.T) {
	t.Parallel()
	if got, want := throttle.PerSecond(10, 5).String(), "10/1s burst 5"; got != want {
		t.Errorf("String() = %q, want %q", got, want)
	}
}
