package reserve_test

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"

	"github.com/slotbook/slotbook/deadline"
	"github.com/slotbook/slotbook/reserve"
	"github.com/slotbook/slotbook/throttle"
)

func exampleEngine() (*throttle.Engine, func()) {
	mr, err := miniredis.Run() // any Redis will do; this one is embedded
	if err != nil {
		panic(err)
	}
	rdb := redis.NewClient(&redis.Options{Addr: mr.Addr(), ContextTimeoutEnabled: true})
	// Ten seconds, not the default 50ms: the embedded Redis runs its Lua in
	// this busy test process (under -race, slowly), and an example's output
	// must not depend on its speed.
	eng, err := throttle.New(rdb, throttle.WithTimeout(10*time.Second))
	if err != nil {
		panic(err)
	}
	return eng, func() { rdb.Close(); mr.Close() }
}

// Reserve books without waiting: act after Delay, or Cancel to give the
// slot back.
func ExampleLimiter_Reserve() {
	eng, done := exampleEngine()
	defer done()
	lim, err := reserve.New(eng, "reports", throttle.PerMinute(2, 0))
	if err != nil {
		panic(err)
	}
	ctx := context.Background()
	book := func() *reserve.Reservation {
		r, err := lim.Reserve(ctx, "tenant-7")
		if err != nil {
			panic(err) // bad input, or Redis unavailable
		}
		return r
	}
	first, second := book(), book()
	fmt.Println(first.OK(), first.Booking().Wait)
	fmt.Println(second.OK(), second.Booking().Wait.Round(time.Second))
	// Not needed after all: give it back (it is the latest booking, so all
	// of it comes back), and the next caller gets its slot.
	if err := second.Cancel(ctx); err != nil {
		panic(err)
	}
	third := book()
	fmt.Println(third.Booking().Wait.Round(time.Second))
	// Output:
	// true 0s
	// true 30s
	// 30s
}

// Acquire sleeps until the slot, or refuses at once when the slot would
// come too late.
func ExampleLimiter_Acquire() {
	eng, done := exampleEngine()
	defer done()
	lim, err := reserve.New(eng, "partner", throttle.PerSecond(1, 0), reserve.WithMaxWait(100*time.Millisecond))
	if err != nil {
		panic(err)
	}
	ctx := context.Background()
	fmt.Println(lim.Acquire(ctx, "eu"))
	err = lim.Acquire(ctx, "eu") // the next slot is a second away
	retry, _ := deadline.RetryAfterOf(err)
	fmt.Println(errors.Is(err, reserve.ErrMaxWaitExceeded), retry.Round(time.Second))
	// Output:
	// <nil>
	// true 1s
}
