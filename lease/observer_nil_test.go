package lease_test

import (
	"errors"
	"testing"

	"github.com/slotbook/slotbook/lease"
	"github.com/slotbook/slotbook/lease/internal/leasetest"
)

// TestWithObserverNilCollector: a nil *Collector in the Observer interface
// is refused by New, not left to panic on the first call.
func TestWithObserverNilCollector(t *testing.T) {
	e := leasetest.NewEnv(t)
	var c *lease.Collector
	if _, err := lease.New(e.Eng, "p", 1, lease.WithObserver(c)); !errors.Is(err, lease.ErrInvalid) {
		t.Fatalf("nil *Collector: got %v, want ErrInvalid", err)
	}
	if _, err := lease.New(e.Eng, "p", 1, lease.WithObserver(lease.NewCollector())); err != nil {
		t.Fatal(err)
	}
}
