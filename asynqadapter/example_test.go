package asynqadapter_test

import (
	"context"
	"fmt"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"

	"github.com/slotbook/slotbook/asynqadapter"
	"github.com/slotbook/slotbook/reserve"
	"github.com/slotbook/slotbook/throttle"
)

// The middleware in front of a handler: the first task runs at once, the
// second would wait past the max wait and goes back to asynq, not as a
// failure, with when to come back.
func ExampleMiddleware() {
	mr, err := miniredis.Run() // the limiter's Redis; an embedded one here
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
	lim, err := reserve.New(eng, "partner", throttle.PerMinute(6, 0), reserve.WithMaxWait(time.Second))
	if err != nil {
		panic(err)
	}

	handler := asynqadapter.Middleware(lim, asynqadapter.WithSpread(false))(
		asynq.HandlerFunc(func(ctx context.Context, t *asynq.Task) error {
			fmt.Println("called the partner for", t.Type())
			return nil
		}))
	ctx := context.Background()
	fmt.Println(handler.ProcessTask(ctx, asynq.NewTask("partner:sync", nil)))
	err = handler.ProcessTask(ctx, asynq.NewTask("partner:sync", nil))
	fmt.Println(asynqadapter.IsRateLimited(err), asynqadapter.IsFailure(err))
	// Output:
	// called the partner for partner:sync
	// <nil>
	// true false
}
