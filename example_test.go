package slotbook_test

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"

	"github.com/slotbook/slotbook/reserve"
	"github.com/slotbook/slotbook/throttle"
)

// Ten calls a minute with a burst of 5, shared by every process that uses
// the name "stripe": the first six go at once, the seventh is booked six
// seconds out, and a caller that will not wait that long is refused at
// once. (A minute, not a second, so that a busy machine running the example
// cannot change its output.)
func Example() {
	mr, err := miniredis.Run() // any Redis; an embedded one keeps the example self-contained
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
	lim, err := reserve.New(eng, "stripe", throttle.PerMinute(10, 5))
	if err != nil {
		panic(err)
	}
	ctx := context.Background()
	for i := 0; i < 6; i++ { // the burst: no wait
		if err := lim.Acquire(ctx, "tenant-42"); err != nil {
			panic(err)
		}
	}
	r, err := lim.Reserve(ctx, "tenant-42")
	if err != nil {
		panic(err)
	}
	d := r.Delay()
	fmt.Println("7th booked:", r.OK(), "to wait up to 6s:", d > 0 && d <= 6*time.Second)

	hurried, cancel := context.WithTimeout(ctx, 3*time.Second)
	defer cancel()
	err = lim.Acquire(hurried, "tenant-42")
	fmt.Println("8th within 3s:", errors.Is(err, reserve.ErrWouldExceedDeadline))
	// Output:
	// 7th booked: true to wait up to 6s: true
	// 8th within 3s: true
}
