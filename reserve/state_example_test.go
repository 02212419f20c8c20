package reserve_test

import (
	"context"
	"fmt"
	"time"

	"github.com/slotbook/slotbook/reserve"
	"github.com/slotbook/slotbook/throttle"
)

// State reads a subject without booking: here, after three requests under
// 2 a minute with a burst of 1 (two at once, then one every 30s), none is
// available and a fourth would wait a minute.
func ExampleLimiter_State() {
	eng, done := exampleEngine()
	defer done()
	lim, err := reserve.New(eng, "reports", throttle.PerMinute(2, 1))
	if err != nil {
		panic(err)
	}
	ctx := context.Background()
	for i := 0; i < 3; i++ {
		if _, err := lim.Reserve(ctx, "tenant-42"); err != nil {
			panic(err)
		}
	}
	st, err := lim.State(ctx, "tenant-42")
	if err != nil {
		panic(err)
	}
	fmt.Println("available:", st.Available)
	fmt.Println("a new request would wait about", st.Wait.Round(10*time.Second))
	fmt.Println("booked ahead about", st.Backlog.Round(10*time.Second))
	// Output:
	// available: 0
	// a new request would wait about 1m0s
	// booked ahead about 1m30s
}
