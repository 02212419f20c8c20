package waitbound

import (
	"context"
	"testing"
	"time"
)

type valKey struct{}

func TestDetach(t *testing.T) {
	parent, cancel := context.WithTimeout(context.WithValue(context.Background(), valKey{}, "v"), time.Hour)
	d := Detach(Detach(parent))
	if _, ok := d.Deadline(); ok || d.Done() != nil || d.Err() != nil {
		t.Fatal("a detached context has a deadline or an end")
	}
	if d.Value(valKey{}) != "v" {
		t.Fatal("a detached context lost its parent's values")
	}
	if Of(d) != parent {
		t.Fatal("the wait of a detached context (detached twice) is not bounded by the caller's")
	}
	if plain := context.Background(); Of(plain) != plain {
		t.Fatal("a context without Detach does not bound its own wait")
	}
	cancel()
	if d.Err() != nil {
		t.Fatal("the caller's end reached the detached context")
	}
	select {
	case <-Of(d).Done():
	default:
		t.Fatal("the caller's end did not end the wait")
	}
}
