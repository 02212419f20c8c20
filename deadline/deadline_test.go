package deadline_test

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/slotbook/slotbook/deadline"
)

func TestBudget(t *testing.T) {
	t.Parallel()
	now := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	withDeadline := func(d time.Duration) context.Context {
		ctx, cancel := context.WithDeadline(context.Background(), now.Add(d))
		t.Cleanup(cancel)
		return ctx
	}
	tests := []struct {
		name      string
		ctx       context.Context
		cap, work time.Duration
		want      time.Duration
		bound     error
	}{
		{"no deadline, no cap", context.Background(), deadline.NoCap, time.Second, deadline.NoCap, deadline.ErrMaxWaitExceeded},
		{"no deadline", context.Background(), 2 * time.Second, time.Second, 2 * time.Second, deadline.ErrMaxWaitExceeded},
		{"cap binds", withDeadline(10 * time.Second), 2 * time.Second, time.Second, 2 * time.Second, deadline.ErrMaxWaitExceeded},
		{"deadline binds", withDeadline(3 * time.Second), 5 * time.Second, 2 * time.Second, time.Second, deadline.ErrWouldExceedDeadline},
		{"deadline binds, no cap", withDeadline(3 * time.Second), deadline.NoCap, 0, 3 * time.Second, deadline.ErrWouldExceedDeadline},
		{"equal: cap named", withDeadline(3 * time.Second), 2 * time.Second, time.Second, 2 * time.Second, deadline.ErrMaxWaitExceeded},
		{"no time for the work", withDeadline(time.Second), deadline.NoCap, 2 * time.Second, -time.Second, deadline.ErrWouldExceedDeadline},
		{"deadline passed", withDeadline(-time.Second), time.Second, 0, -time.Second, deadline.ErrWouldExceedDeadline},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			got, bound := deadline.Budget(tc.ctx, now, tc.cap, tc.work)
			if got != tc.want || bound != tc.bound {
				t.Fatalf("Budget = %v, %v; want %v, %v", got, bound, tc.want, tc.bound)
			}
		})
	}
}

func TestError(t *testing.T) {
	t.Parallel()
	err := fmt.Errorf("job 7: %w", deadline.Refuse(deadline.ErrWouldExceedDeadline, time.Second, 1500*time.Millisecond))
	if !errors.Is(err, deadline.ErrWouldExceedDeadline) || errors.Is(err, deadline.ErrMaxWaitExceeded) {
		t.Fatalf("errors.Is on %v: wrong sentinel", err)
	}
	var e *deadline.Error
	if !errors.As(err, &e) || e.RetryAfter != 1500*time.Millisecond || e.Budget != time.Second {
		t.Fatalf("errors.As on %v: got %+v", err, e)
	}
	if d, ok := deadline.RetryAfterOf(err); !ok || d != 1500*time.Millisecond {
		t.Fatalf("RetryAfterOf = %v, %v; want 1.5s, true", d, ok)
	}
	if _, ok := deadline.RetryAfterOf(errors.New("other")); ok {
		t.Fatal("RetryAfterOf found a retry-after in an unrelated error")
	}
	noTime := deadline.Refuse(deadline.ErrWouldExceedDeadline, -time.Second, 0)
	if noTime.Budget != 0 {
		t.Fatalf("negative budget kept: %+v", noTime)
	}
	if got, want := noTime.Error(), "slotbook: refused: slot would leave too little time before the context deadline (no time left for the work)"; got != want {
		t.Fatalf("Error() = %q, want %q", got, want)
	}
}

func ExampleBudget() {
	now := time.Now()
	ctx, cancel := context.WithDeadline(context.Background(), now.Add(3*time.Second))
	defer cancel()
	// A 2 s cap, and 1.5 s of work to do after the slot.
	budget, bound := deadline.Budget(ctx, now, 2*time.Second, 1500*time.Millisecond)
	fmt.Println(budget, errors.Is(bound, deadline.ErrWouldExceedDeadline))

	err := deadline.Refuse(bound, budget, 2*time.Second)
	fmt.Println(err)
	// Output:
	// 1.5s true
	// slotbook: refused: slot would leave too little time before the context deadline (slot in 2s, budget 1.5s)
}

func TestBudgetSaturates(t *testing.T) {
	now := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	at := func(dl time.Time) context.Context {
		ctx, cancel := context.WithDeadline(context.Background(), dl)
		t.Cleanup(cancel)
		return ctx
	}
	ancient := time.Date(1, 1, 1, 0, 0, 0, 0, time.UTC)
	for _, work := range []time.Duration{0, time.Nanosecond, time.Hour, deadline.NoCap} {
		b, bound := deadline.Budget(at(ancient), now, time.Second, work)
		if b >= 0 || bound != deadline.ErrWouldExceedDeadline {
			t.Errorf("deadline in year 1, work %v: budget %v, bound %v; want negative, ErrWouldExceedDeadline", work, b, bound)
		}
	}
	if b, _ := deadline.Budget(at(now.Add(time.Second)), now, deadline.NoCap, -time.Hour); b != time.Second {
		t.Errorf("negative work: budget %v, want 1s (counted as none)", b)
	}
}
