package waitbound

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"
)

type valKey struct{}

func TestWithoutDeadline(t *testing.T) {
	parent, cancel := context.WithTimeout(context.WithValue(context.Background(), valKey{}, "v"), time.Hour)
	u := WithoutDeadline(WithoutDeadline(parent))
	if _, ok := u.Deadline(); ok {
		t.Fatal("the context reports its parent's deadline")
	}
	if u.Done() != parent.Done() || u.Err() != nil {
		t.Fatal("the context does not end with its parent")
	}
	if u.Value(valKey{}) != "v" {
		t.Fatal("the context lost its parent's values")
	}
	if Of(u) != parent {
		t.Fatal("Of (through WithoutDeadline twice) does not give the caller's context")
	}
	if plain := context.Background(); Of(plain) != plain {
		t.Fatal("Of of a plain context is not itself")
	}
	if plain := context.WithValue(context.Background(), valKey{}, "w"); WithoutDeadline(plain) != plain {
		t.Fatal("a context without a deadline is not returned as it is")
	}
	if shared := context.WithoutCancel(u); Of(shared) != shared {
		t.Fatal("a context made from WithoutDeadline's (a shared call's) is taken for the caller's")
	}
	// A context derived from it (the engine's timeout) ends with the
	// caller, and has only its own deadline.
	child, stop := context.WithTimeout(u, time.Minute)
	defer stop()
	if dl, ok := child.Deadline(); !ok || dl.After(time.Now().Add(time.Minute)) {
		t.Fatal("the derived context's deadline is not its own")
	}
	cancel()
	select {
	case <-u.Done():
	default:
		t.Fatal("the caller's end did not end the context")
	}
	select {
	case <-child.Done():
	default:
		t.Fatal("the caller's end did not end the derived context")
	}
	if u.Err() != context.Canceled {
		t.Fatalf("Err after the caller's end: %v", u.Err())
	}
}

func TestEnded(t *testing.T) {
	if Ended(context.Background()) != nil {
		t.Fatal("a context with no end has ended")
	}
	// A deadline passed though the timer has yet to fire (a context type
	// of our own, whose Err stays nil): ended all the same.
	if err := Ended(passed{context.Background()}); err != context.DeadlineExceeded {
		t.Fatalf("a passed deadline: %v", err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if Ended(ctx) != context.Canceled {
		t.Fatal("a cancelled context has not ended")
	}
}

type passed struct{ context.Context }

func (passed) Deadline() (time.Time, bool) { return time.Now().Add(-time.Millisecond), true }

func TestEndedErr(t *testing.T) {
	lost := errors.New("lost")
	other := errors.New("other")
	dl := context.DeadlineExceeded
	for _, tc := range []struct {
		name      string
		cerr      error
		want      []error
		wantPlain bool
	}{
		{"no call error", nil, []error{dl}, true},
		{"the context's own, nothing sent", fmt.Errorf("book: %w", dl), []error{dl}, true},
		{"the context's, with a lost reply", fmt.Errorf("%w: %w", lost, dl), []error{dl, lost}, false},
		{"another error", other, []error{dl, other}, false},
	} {
		got := EndedErr(dl, tc.cerr, lost)
		for _, w := range tc.want {
			if !errors.Is(got, w) {
				t.Errorf("%s: %v is not %v", tc.name, got, w)
			}
		}
		if tc.wantPlain != (got == dl) {
			t.Errorf("%s: %v, plain %v", tc.name, got, tc.wantPlain)
		}
	}
}
