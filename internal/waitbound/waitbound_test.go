package waitbound

import (
	"context"
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
