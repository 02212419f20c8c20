package throttle_test

import (
	"context"
	"fmt"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"

	"github.com/slotbook/slotbook/throttle"
)

// Check mode: one a second with a burst of two. After idling, three pass;
// the fourth is told exactly when to come back.
func ExampleEngine_Allow() {
	mr, err := miniredis.Run() // any Redis will do; this one is embedded
	if err != nil {
		panic(err)
	}
	defer mr.Close()
	rdb := redis.NewClient(&redis.Options{Addr: mr.Addr(), ContextTimeoutEnabled: true})
	defer rdb.Close()

	// Ten seconds, not the default 50ms: the embedded Redis runs its Lua in
	// this busy test process (under -race, slowly), and an example's output
	// must not depend on its speed.
	eng, err := throttle.New(rdb, throttle.WithTimeout(10*time.Second))
	if err != nil {
		panic(err)
	}
	ctx := context.Background()
	for i := 0; i < 4; i++ {
		r, err := eng.Allow(ctx, "login:{alice}", throttle.PerSecond(1, 2))
		if err != nil {
			panic(err)
		}
		fmt.Println(r.Allowed, r.Remaining, r.RetryAfter.Round(time.Second))
	}
	// Output:
	// true 2 0s
	// true 1 0s
	// true 0 0s
	// false 0 1s
}

// Reservation mode: book the next slot with one call; a booking whose slot
// is further away than its max wait is refused and books nothing.
func ExampleEngine_Book() {
	mr, err := miniredis.Run()
	if err != nil {
		panic(err)
	}
	defer mr.Close()
	rdb := redis.NewClient(&redis.Options{Addr: mr.Addr(), ContextTimeoutEnabled: true})
	defer rdb.Close()
	// Ten seconds, not the default 50ms: the embedded Redis runs its Lua in
	// this busy test process (under -race, slowly), and an example's output
	// must not depend on its speed.
	eng, err := throttle.New(rdb, throttle.WithTimeout(10*time.Second))
	if err != nil {
		panic(err)
	}
	ctx := context.Background()
	limit := throttle.PerMinute(60, 0) // one a second
	for _, maxWait := range []time.Duration{0, time.Minute, 500 * time.Millisecond} {
		b, err := eng.Book(ctx, "api:{partner}", limit, throttle.Request{N: 1, MaxWait: maxWait})
		if err != nil {
			panic(err)
		}
		fmt.Println(b.OK, b.Wait.Round(time.Second))
	}
	// Output:
	// true 0s
	// true 1s
	// false 2s
}

func ExampleLimit() {
	l := throttle.PerSecond(3, 1)
	fmt.Println(l, l.Interval(), l.Validate() == nil)
	fmt.Println(throttle.PerSecond(0, 1).Validate())
	// Output:
	// 3/1s burst 1 333.334ms true
	// throttle: invalid limit: rate 0 must be positive
}
