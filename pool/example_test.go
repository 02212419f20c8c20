package pool_test

import (
	"context"
	"fmt"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"

	"github.com/slotbook/slotbook/pool"
	"github.com/slotbook/slotbook/reserve"
	"github.com/slotbook/slotbook/throttle"
)

func Example() {
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
	lim, err := reserve.New(eng, "emails", throttle.PerSecond(50, 4))
	if err != nil {
		panic(err)
	}

	p, err := pool.New(lim, pool.WithWorkers(4))
	if err != nil {
		panic(err)
	}
	defer p.Close(context.Background())
	ctx := context.Background()
	var jobs []*pool.Job
	for i := 0; i < 8; i++ {
		j, err := p.Submit(ctx, "newsletter", func(context.Context) error {
			return nil // send one email
		})
		if err != nil {
			panic(err)
		}
		jobs = append(jobs, j)
	}
	if err := p.Wait(ctx); err != nil {
		panic(err)
	}
	sent := 0
	for _, j := range jobs {
		if j.Err() == nil {
			sent++
		}
	}
	fmt.Println(sent, "sent")
	// Output: 8 sent
}
